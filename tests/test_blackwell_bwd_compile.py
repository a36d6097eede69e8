"""fa4_final's Blackwell backward compiled for sm_100a on a CPU: the tcgen05 instructions it must
contain, its resources (TMEM columns = the plan, <= 512; shared memory = the config's arithmetic,
<= 227 KB; no spills; setmaxnreg = the roles' budgets), the per-step GEMM count, the dQ
accumulator order it shares with the Hopper backward (so bwd_post serves both) and the
pre/post kernels compiled for sm_100a. No GPU anywhere: select with -k sm100 / blackwell.
"""

import re

import pytest

from fa4_final.blackwell import tmem
from fa4_final.blackwell.bwd import BlackwellBackward
from fa4_final.blackwell.config import BWD_DQ_CHUNK, BlackwellBwdConfig
from fa4_final.blackwell.host import backward_recipe
from fa4_final.common.constants import CUTLASS_BY_NAME, SM100_SMEM_BYTES, SM100_TMEM_COLUMNS
from fa4_final.common.dq_order import DqOrder
from fa4_final.runtime.compile import artifacts

pytestmark = pytest.mark.slow

BF16 = CUTLASS_BY_NAME["bf16"]


@pytest.fixture(scope="module")
def compiled():
    """Artifacts of every variant the tests ask for, each compiled once per module."""
    cache = {}

    def get(head_dim=128, causal=False, cfg=None, dtype="bf16", roles=("main",), **window):
        key = (head_dim, causal, cfg, dtype, roles, tuple(sorted(window.items())))
        if key not in cache:
            cache[key] = artifacts(backward_recipe(head_dim, dtype, causal, cfg, **window), roles)
        return cache[key]

    return get


# ----------------------------------------------------------------------------------------------
# plain Python: the TMEM plan, shared memory, roles


@pytest.mark.parametrize("head_dim", [64, 128])
def test_blackwell_bwd_tmem_plan_and_smem(head_dim):
    cfg = BlackwellBwdConfig()
    plan = cfg.tmem_plan(head_dim)
    assert plan.columns_used == 2 * 128 + 2 * head_dim <= SM100_TMEM_COLUMNS
    assert plan.columns_allocated == 512
    assert plan["P"].alias_of == "S" and plan["P"].end == plan["S"].end  # P^T in S^T's top half
    assert plan["dQ"].alias_of == "dP" and plan["dQ"].columns == head_dim
    assert cfg.smem_bytes(head_dim) <= SM100_SMEM_BYTES
    with pytest.raises(ValueError, match="shared memory"):
        BlackwellBwdConfig(q_stages=3, do_stages=2).check(128)
    with pytest.raises(ValueError, match="must lie inside dP"):  # dQ (D columns) in dP^T's 128
        tmem.backward_plan(128, 128, 192)


def test_blackwell_bwd_roles_cover_the_lanes_and_the_register_file():
    k = BlackwellBackward(BF16, 128, False, BlackwellBwdConfig())
    for role in ("compute0", "compute1", "dq"):  # one TMEM lane (key or query) per thread
        lanes = sorted(lane for w in k.roles[role]["warps"] for lane in tmem.lane_quarter(w))
        assert lanes == list(range(tmem.TMEM_LANES)), role
    assert sum(32 * len(r["warps"]) * r["registers"] for r in k.roles.values()) <= 64 * 1024
    names = [p.name for p in k.pipelines()]
    assert names == ["kv", "q", "do", "s", "dp", "dq", "dkv"]


def test_blackwell_bwd_dq_order_is_the_hopper_accumulator_order():
    """Every (row, col) of a 128 x D dQ tile: the staging buffer plus bulk-add offset this
    kernel writes (Note [dQ accumulator order]) equals where the Hopper kernel's dq_copy puts
    the register holding it (thread t, register i -> 512 (i // 4) + 4 t + i % 4 in chunk w),
    with the registers' coordinates from DqOrder.dq_coords, which bwd_post reads back."""
    for d in (64, 128):
        order = DqOrder(BF16, d, 128)
        hopper = {}
        for tidx in range(256):
            w, t = divmod(tidx, 128)
            for i, (r, c) in enumerate(order.dq_coords(tidx)):
                hopper[(r, c)] = w * order.dq_chunk + 512 * (i // 4) + 4 * t + i % 4
        assert len(hopper) == 128 * d and sorted(hopper.values()) == list(range(128 * d))
        k = BlackwellBackward(BF16, d, False, BlackwellBwdConfig())
        lay = k.dq_stage_layout_plain()
        for (r, c), off in hopper.items():
            chunk, cl = divmod(c, BWD_DQ_CHUNK)
            w, local = divmod(lay(r, cl), 64 * BWD_DQ_CHUNK)
            # buffer half w goes to m_block's slab at w * 64 D + chunk * 64 * 32
            assert w * 64 * d + chunk * 64 * BWD_DQ_CHUNK + local == off, (r, c)


# ----------------------------------------------------------------------------------------------
# compiled: instructions


@pytest.mark.parametrize("head_dim,causal", [(128, False), (64, True)])
def test_sm100_bwd_has_the_blackwell_instructions(compiled, head_dim, causal):
    art = compiled(head_dim, causal)["main"]
    art.require("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.relinquish_alloc_permit",
                "tcgen05.mma", "tcgen05.commit", "tcgen05.ld", "tcgen05.st",
                "mbarrier.try_wait", "setmaxnreg.inc", "setmaxnreg.dec",
                "cp.async.bulk.tensor", "cp.reduce.async.bulk", "ex2.approx")
    art.forbid("cta_group::2", "wgmma")
    art.require("UTCHMMA", "UTCBAR", "LDTM", "STTM", "MUFU.EX2", "UTMALDG", where="sass")
    assert re.search(r"\.(reqntid|maxntid)\s+512", art.ptx)
    # A from TMEM exactly for dV += P^T dO: m/16 = 8 of the instructions
    assert len(re.findall(r"tcgen05\.mma[^\n]*\[%r\d+\], \[%r\d+", art.ptx)) == 128 // 16
    # Note [P^T over S^T]: both compute warpgroups meet before P^T overwrites S^T, once per
    # compiled step (masked and unmasked)
    from fa4_final.blackwell.bwd import NamedBarrier

    assert len(re.findall(rf"bar\.sync\s+{int(NamedBarrier.COMPUTE)}, 256;", art.ptx)) == 2


def test_sm100_bwd_issues_five_gemms_per_step(compiled):
    """S^T, dP^T (K = D), dV, dK (K = 128 queries), dQ (K = 128 keys): D/16 + D/16 + 3 * 8
    tcgen05.mma per step, issued once (one step loop, no copies)."""
    for d in (64, 128):
        art = compiled(d)["main"]
        assert art.count("tcgen05.mma") == 2 * d // 16 + 3 * 128 // 16, d
        assert art.count("UTCHMMA", where="sass") == 2 * d // 16 + 3 * 128 // 16, d


def test_sm100_bwd_dq_bulk_adds_per_step(compiled):
    """Two 8 KB bulk float32 adds (the tile's two 64-row halves) per 32-column dQ chunk: 2 D / 32
    cp.reduce.async.bulk per step, where per-element atomics would be 128 D / 4 red.v4."""
    for d in (64, 128):
        art = compiled(d)["main"]
        assert art.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == \
            2 * d // BWD_DQ_CHUNK
        art.forbid("red.global.add.f32", "atom.global.add.f32")


def test_sm100_bwd_deterministic_uses_the_turn_counters(compiled):
    art = compiled(128, True, BlackwellBwdConfig(deterministic=True))["main"]
    art.require("ld.acquire.gpu", "red.release.gpu")
    assert "ld.acquire.gpu" not in compiled(128, True)["main"].ptx


# ----------------------------------------------------------------------------------------------
# compiled: resources


def test_blackwell_bwd_compiles_spill_free_everywhere(compiled):
    variants = [dict(head_dim=128), dict(head_dim=64, causal=True),
                dict(head_dim=128, causal=True, cfg=BlackwellBwdConfig(deterministic=True)),
                dict(head_dim=128, causal=True, dtype="fp16"),
                dict(head_dim=64, has_window_left=True, has_window_right=True)]
    for v in variants:
        art = compiled(**v)["main"]
        assert art.spills == 0 and art.frame_bytes == 0, (v, art.resources())


def test_blackwell_bwd_setmaxnreg_is_the_roles_budget(compiled):
    art = compiled(128)["main"]
    k = BlackwellBackward(BF16, 128, False, BlackwellBwdConfig())
    budget = {r["registers"] for r in k.roles.values()}
    seen = {int(x) for x in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)",
                                       art.ptx)}
    assert seen == budget


def test_blackwell_bwd_tmem_alloc_is_the_plan(compiled):
    art = compiled(128)["main"]
    regs = re.findall(r"tcgen05\.alloc[^\n]*?,\s*(%r\d+|\d+);", art.ptx)
    assert len(regs) == 1
    cols = regs[0] if regs[0].isdigit() else \
        re.search(rf"mov\.[ub]32\s+{regs[0]},\s*(\d+);", art.ptx).group(1)
    assert int(cols) == BlackwellBwdConfig().tmem_plan(128).columns_allocated == 512


def test_blackwell_bwd_pre_and_post_compile_for_sm100(compiled):
    arts = compiled(128, roles=("pre", "main", "post"))
    for role in ("pre", "post"):
        assert arts[role].spills == 0, arts[role].resources()
        arts[role].forbid("wgmma", "tcgen05")


# ----------------------------------------------------------------------------------------------
# the stored side-by-side with FA4's own sm100 backward (solutions.ch09_compare --bwd)


def test_sm100_bwd_side_by_side_our_side_regenerates(compiled):
    """Our rows of results/compile/sm100_bwd_vs_fa4.json are what this code compiles to now
    (the same variants the tests above compile, so no extra compile for D = 128 / 64 causal)."""
    import cutlass

    from solutions import ch09_compare as C

    table = C.load_bwd_table()
    if table.provenance["cutlass_dsl"] != getattr(cutlass, "__version__", "?"):
        pytest.skip(f"table compiled with CuTe DSL {table.provenance['cutlass_dsl']}: "
                    f"regenerate with python -m measure.sm100_vs_fa4 --bwd --write --ours")
    for c in C.BWD_CONFIGS:
        if not c["ours"]:
            continue
        cfg = BlackwellBwdConfig(two_cta=True) if c["two_cta"] else None
        now = C.our_bwd_metrics(c["d"], c["causal"], compiled(c["d"], c["causal"], cfg)["main"],
                                two_cta=c["two_cta"])
        for row in C.flatten("fa4_final", c["config"], now):
            stored = C.value(table, "fa4_final", c["config"], row["metric"])
            assert stored == row["value"], (c["config"], row["metric"], stored, row["value"])


# ----------------------------------------------------------------------------------------------
# the 2-CTA mode (fa4_final.blackwell.bwd_pair): a CTA pair per 256 keys

PAIR = BlackwellBwdConfig(two_cta=True)


def test_blackwell_bwd_pair_refuses_what_it_does_not_build():
    with pytest.raises(ValueError, match="deterministic"):
        backward_recipe(128, "bf16", True, BlackwellBwdConfig(two_cta=True, deterministic=True))
    with pytest.raises(ValueError, match="head_dim"):
        backward_recipe(96, "bf16", False, PAIR)
    with pytest.raises(ValueError, match="pair kernel"):  # the 1-CTA class never takes the flag
        BlackwellBackward(BF16, 128, False, PAIR)
    assert BlackwellBwdConfig().two_cta is False  # the default stays 1-CTA


@pytest.mark.parametrize("head_dim", [64, 128])
def test_blackwell_bwd_pair_tmem_plan_and_smem(head_dim):
    plan = PAIR.tmem_plan(head_dim)
    assert plan.columns_used == 2 * 128 + 2 * head_dim and plan.columns_allocated == 512
    assert plan["dS"].alias_of == "dP" and plan["dS"].end == plan["dP"].end  # dK's A in TMEM
    assert plan["dQ"].alias_of == "dP" and plan["dQ"].columns == head_dim // 2
    assert plan["dQ"].end <= plan["dS"].start
    assert PAIR.smem_bytes(head_dim) <= SM100_SMEM_BYTES
    assert PAIR.q_depth(head_dim) == (1 if head_dim == 128 else 2)


def test_blackwell_bwd_pair_dq_lands_in_the_hopper_accumulator_order():
    """Every (query, column) of a pair's 128 x D dQ tile: CTA r holds query 64 r + (t % 64) at
    TMEM lane t, columns (t // 64) D/2 + 32 c + j (the pair MMA's M = 128 accumulator); its dQ
    warps stage lane t as row t of the 1-CTA staging layout and add half hh of the buffer at
    r 64 D + hh 32 D + 2048 c (BlackwellBackwardPair.store_dq). That is the Hopper accumulator
    order bwd_post reads (the formula of Note [dQ accumulator order]), each element once."""
    from fa4_final.blackwell.bwd_pair import BlackwellBackwardPair

    def hopper(row, col, d):
        return (64 * d * (row // 64) + 512 * (col // 8) + 128 * ((row % 64) // 16)
                + 16 * (row % 8) + 2 * ((row % 16) // 8) + 4 * ((col % 8) // 2) + col % 2)

    for d in (64, 128):
        k = BlackwellBackwardPair(BF16, d, False, BlackwellBwdConfig(two_cta=True))
        stage = k.dq_stage_layout_plain()
        half = 64 * BWD_DQ_CHUNK
        seen = set()
        for r in (0, 1):
            for t in range(128):
                for c in range(d // 2 // BWD_DQ_CHUNK):
                    for j in range(BWD_DQ_CHUNK):
                        hh, local = divmod(stage(t, j), half)
                        assert hh == t // 64
                        off = r * 64 * d + hh * 32 * d + c * half + local
                        row, col = 64 * r + t % 64, (t // 64) * d // 2 + BWD_DQ_CHUNK * c + j
                        assert off == hopper(row, col, d), (d, r, t, c, j)
                        seen.add(off)
        assert sorted(seen) == list(range(128 * d))


def test_blackwell_bwd_pair_layouts_as_the_kernel_assumes_them():
    """CuTe's own layouts (host-side CuTe runs on the CPU) are what store_dq, compute and the dS
    exchange assume: dQ's pair accumulator puts query i's columns D/2 .. D - 1 on lane 64 + i
    (lane stride 1 << 16 in a TMEM address); S^T's has 128 lanes per CTA; dS (dQ's A) is the
    MN-major ((64 queries, 16 keys), 1, 16 key blocks) tile that ``dS_rows`` regroups."""
    import cutlass.cute as cute

    from fa4_final.blackwell.bwd_pair import BlackwellBackwardPair

    got = {}

    def probe_for(d):
        k = BlackwellBackwardPair(BF16, d, False, PAIR)

        @cute.jit
        def probe():
            sdp, _, _, dq = k.tiled_mmas()
            lay = k.smem_layouts(k.tiled_mmas())
            for name, t, mn in (("dq", dq, (128, d)), ("s", sdp, (256, 128))):
                thr = t.get_slice(1)
                got[d, name] = str(thr.make_fragment_C(thr.partition_shape_C(mn)).layout)
            got[d, "dS"] = str(lay["dS"].outer)

        return probe

    for d in (64, 128):
        probe_for(d)()
        assert got[d, "dq"] == f"((64,({d // 2},2)),1,1):((65536,(1,{64 << 16})),0,0)"
        assert got[d, "s"] == "((128,128),1,1):((65536,1),0,0)"
        assert got[d, "dS"] == "((64,16),1,16):((1,64),0,1024)"


@pytest.mark.parametrize("head_dim,causal", [(128, False), (64, True), (128, True)])
def test_sm100_bwd_pair_is_a_pair_kernel(compiled, head_dim, causal):
    """Every tcgen05 instruction is cta_group::2 (newer toolkits reject a kernel that mixes
    ::1 and ::2), commits reach both CTAs, the TMA loads count on the leader's barrier, the
    kernel knows its cluster rank and meets the peer at cluster barriers; dS goes to the peer
    by st.async (mapa'd addresses, bytes counted by the peer's mbarrier, armed remotely)."""
    from fa4_final.blackwell import bwd_pair

    art = compiled(head_dim, causal, PAIR)["main"]
    art.require("tcgen05.mma.cta_group::2", "tcgen05.commit.cta_group::2",
                "multicast::cluster", "tcgen05.alloc.cta_group::2",
                "tcgen05.dealloc.cta_group::2", "cp.async.bulk.tensor", ".cta_group::2",
                "%cluster_ctarank", "barrier.cluster.arrive", "barrier.cluster.wait",
                "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32", "mapa",
                "mbarrier.arrive.expect_tx.shared::cluster", "mbarrier.arrive.shared::cluster")
    art.forbid("cta_group::1", "wgmma")
    assert art.count("tcgen05.mma.cta_group::2") == art.count("tcgen05.mma")
    art.require("UTCHMMA.2CTA", "UTCBAR.2CTA.MULTICAST", "UTMALDG.4D.2CTA", "STAS.128",
                where="sass")
    assert bwd_pair.CLUSTER == (2, 1, 1) and re.search(r"\.(reqntid|maxntid)\s+512", art.ptx)


def test_sm100_bwd_pair_issues_five_pair_gemms_per_step(compiled):
    """S^T, dP^T (K = D), dV, dK (K = 128 queries), dQ (K = the pair's 256 keys): D/16 + D/16
    + 8 + 8 + 16 tcgen05.mma per step, issued once; dV and dK read A from TMEM (16 of them)."""
    for d in (64, 128):
        art = compiled(d, False, PAIR)["main"]
        assert art.count("tcgen05.mma") == 2 * d // 16 + 2 * 128 // 16 + 256 // 16, d
        assert art.count("UTCHMMA.2CTA", where="sass") == art.count("tcgen05.mma"), d
        assert len(re.findall(r"tcgen05\.mma[^\n]*\[%r\d+\], \[%r\d+", art.ptx)) == 2 * 8


def test_sm100_bwd_pair_halves_the_dq_bulk_adds_per_cta(compiled):
    """Each CTA adds its 64 queries' dQ: two 8 KB adds per 32-column chunk of its D/2 columns,
    D/32 per step: half of the 1-CTA kernel's 2 D/32, and no per-element atomics."""
    word = "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"
    for d in (64, 128):
        one, two = compiled(d)["main"], compiled(d, False, PAIR)["main"]
        assert 2 * two.count(word) == one.count(word) == 2 * d // BWD_DQ_CHUNK, d
        assert two.count("UBLKRED", where="sass") == d // BWD_DQ_CHUNK
        two.forbid("red.global.add.f32", "atom.global.add.f32")


def test_sm100_bwd_pair_exchanges_ds_and_syncs_twice_per_step(compiled):
    """Per compiled step (masked and unmasked copies: 2, 3 with a left window): 8 st.async of 16
    bytes a thread (its 64 dS values) into the peer, one remote expect_tx arming the peer's
    barrier, and two bar.sync COMPUTE: before P^T over S^T and before dS^T over dP^T."""
    from fa4_final.blackwell.bwd import NamedBarrier

    for kw, copies in ((dict(head_dim=128), 2),
                       (dict(head_dim=64, has_window_left=True, has_window_right=True), 3)):
        art = compiled(cfg=PAIR, **kw)["main"]
        assert art.count("st.async.shared::cluster") == 8 * copies, kw
        assert art.count("mbarrier.arrive.expect_tx.shared::cluster") == copies, kw
        assert len(re.findall(rf"bar\.sync\s+{int(NamedBarrier.COMPUTE)}, 256;", art.ptx)) \
            == 2 * copies, kw


def test_blackwell_bwd_pair_compiles_spill_free_within_the_budgets(compiled):
    variants = [dict(head_dim=128), dict(head_dim=128, causal=True), dict(head_dim=64),
                dict(head_dim=64, causal=True), dict(head_dim=128, causal=True, dtype="fp16"),
                dict(head_dim=64, has_window_left=True, has_window_right=True)]
    from fa4_final.blackwell.bwd_pair import BlackwellBackwardPair

    k = BlackwellBackwardPair(BF16, 128, False, PAIR)
    budget = {r["registers"] for r in k.roles.values()}
    for v in variants:
        art = compiled(cfg=PAIR, **v)["main"]
        assert art.spills == 0 and art.frame_bytes == 0, (v, art.resources())
        seen = {int(x) for x in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)",
                                           art.ptx)}
        assert seen == budget, v
        regs = re.findall(r"tcgen05\.alloc[^\n]*?,\s*(%r\d+|\d+);", art.ptx)
        cols = regs[0] if regs[0].isdigit() else \
            re.search(rf"mov\.[ub]32\s+{regs[0]},\s*(\d+);", art.ptx).group(1)
        assert int(cols) == PAIR.tmem_plan(v["head_dim"]).columns_allocated == 512
    # the struct the kernel asserts against the config's arithmetic, at the limit's side
    assert PAIR.smem_bytes(128) == 231424 <= SM100_SMEM_BYTES == 232448
