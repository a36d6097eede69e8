"""The Hopper backward's varlen variants (pre, main, post) compiled for sm_90a with fake tensors, on
a CPU: they compile for D = 64 and 128, causal or not, deterministic or not, with no spills and
the dense kernels' registers; the main kernel's instruction mix is the dense one's (the same
wgmma, TMA loads and stores, stmatrix, exponentials, bulk copies and adds), one step costs what
a dense step costs, and the varlen pieces are there: the warp scan over cu_seqlens (SHFL.UP,
POPC) and the partial key tile's 16-byte row stores. The dense kernels have none of them."""

import pytest

from fa4_final.hopper.config import hopper_bwd_default
from fa4_final.hopper.host import backward_recipe
from fa4_final.runtime.compile import artifacts as compile_artifacts
from solutions import ch11_teaching as teach

pytestmark = pytest.mark.slow

SAME = ("HGMMA", "UTMALDG", "UTMASTG", "STSM", "MUFU.EX2", "BAR.SYNC", "UBLKCP", "UBLKRED")


@pytest.fixture(scope="module")
def artifacts():
    cache = {}

    def get(head_dim, causal, varlen, deterministic=False, **kw):
        key = (head_dim, causal, varlen, deterministic, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = compile_artifacts(backward_recipe(
                head_dim, "bf16", causal, None, deterministic, varlen=varlen, **kw))
        return cache[key]

    return get


def wgmma_serialised(art) -> int:
    return art.count("WARPGROUP.ARRIVE", where="sass") - art.count("wgmma.fence.sync.aligned")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_backward_compiles_clean_with_the_dense_mix(artifacts, head_dim, causal,
                                                           deterministic):
    var = artifacts(head_dim, causal, True, deterministic)
    dense = artifacts(head_dim, causal, False, deterministic)
    for role in ("pre", "main", "post"):
        art = var[role]
        assert art.spills == 0 and art.frame_bytes == 0, (role, art.resources())
        assert art.registers <= dense[role].registers + 8, (role, art.resources(),
                                                             dense[role].resources())
        # the sequence lookup: a warp scan (shfl.sync.up) and a ballot count (POPC)
        art.require("shfl.sync.up")
        art.require("POPC", where="sass")
        dense[role].forbid("shfl.sync.up")
        dense[role].forbid("POPC", where="sass")
    main, dmain = var["main"], dense["main"]
    assert main.registers == dmain.registers  # setmaxnreg: the same budget
    for word in SAME:
        assert main.count(word, "sass") == dmain.count(word, "sass"), word
    main.require("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32",
                 "cp.async.bulk.shared::cluster.global.mbarrier", "cp.async.bulk.tensor")
    # the partial last key tile's dK and dV rows: 16-byte stores, none in the dense kernel
    main.require("STG.E.128", where="sass")
    dmain.forbid("STG.E.128", where="sass")
    assert wgmma_serialised(main) == 0
    if deterministic:
        main.require("ld.acquire.gpu.global.b32", "red.release.gpu.global.add.s32")
    else:
        main.forbid("ld.acquire.gpu", "red.release.gpu")
    var["pre"].require("ld.global.v4", "st.global.v4")
    var["post"].require("ld.global.v4", "st.global.v4")


@pytest.mark.parametrize("head_dim,causal", [(128, False), (128, True), (64, False)])
def test_one_varlen_step_costs_what_a_dense_step_costs(artifacts, head_dim, causal):
    """The inner loop is the dense one: the sequence lookup and the offsets sit outside it, so
    the masked and the unmasked step have the dense counts of every arithmetic instruction and
    GEMM, and their totals differ by a few address instructions at most."""
    cfg = hopper_bwd_default(head_dim, causal)
    gemms = teach.gemms_per_step(cfg, head_dim)
    var = teach.step_mixes(artifacts(head_dim, causal, True)["main"].sass, gemms)
    dense = teach.step_mixes(artifacts(head_dim, causal, False)["main"].sass, gemms)
    assert len(var) == len(dense) == 2
    by_fsel = lambda mixes: sorted(mixes, key=lambda c: -c.get("FSEL", 0))  # noqa: E731
    for v, d in zip(by_fsel(var), by_fsel(dense)):
        for op in ("FFMA", "MUFU.EX2", "FADD", "FMUL", "F2FP.BF16.F32.PACK_AB", "FSEL",
                   "LDS.64"):
            assert v.get(op, 0) == d.get(op, 0), (op, teach.mix_table({"var": v, "dense": d}))
        assert sum(c for k, c in v.items() if k.startswith("HGMMA")) == gemms
        assert abs(sum(v.values()) - sum(d.values())) <= 8, teach.mix_table({"var": v,
                                                                             "dense": d})


def test_seqused_k_and_windows_compile_clean(artifacts):
    for kw in (dict(has_seqused_k=True), dict(has_seqused_k=True, has_window_left=True,
                                              has_window_right=True),
               dict(has_window_left=True)):
        arts = artifacts(128, False, True, True, **kw)
        for role, art in arts.items():
            assert art.spills == 0 and art.frame_bytes == 0, (kw, role, art.resources())
        assert wgmma_serialised(arts["main"]) == 0
        arts["main"].require("HGMMA", "UTMALDG", "UTMASTG", "POPC", "STG.E.128", where="sass")


def test_the_variants_are_cached_apart():
    from fa4_final.common.bwd_post import BackwardPost, VarlenBackwardPost
    from fa4_final.common.bwd_pre import BackwardPre, VarlenBackwardPre
    from fa4_final.common.constants import CUTLASS_BY_NAME
    from fa4_final.hopper.bwd import HopperBackward, HopperVarlenBackward

    dt, cfg = CUTLASS_BY_NAME["bf16"], hopper_bwd_default(128)
    dense = HopperBackward(dt, 128, False, cfg)
    keys = {dense.cache_key(), HopperVarlenBackward(dt, 128, False, cfg).cache_key(),
            HopperVarlenBackward(dt, 128, False, cfg, has_seqused_k=True).cache_key()}
    assert len(keys) == 3
    assert BackwardPre(dt, 128, 64).cache_key() != VarlenBackwardPre(dt, 128, 64).cache_key()
    assert BackwardPost(dense).cache_key() != VarlenBackwardPost(dense).cache_key()
    assert not dense.varlen and HopperVarlenBackward(dt, 128, False, cfg).varlen
