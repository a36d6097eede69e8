"""fa4_final's Hopper backward compiled for sm_90a with fake tensors, on a CPU: the instructions
each kernel must contain, resources (no spills, no wgmma serialised by ptxas), the instruction
mix of one step, the config checks; and the torch entry's input checks."""

import re
from dataclasses import replace

import pytest
import torch

from fa4_final.common.errors import UnsupportedError
from fa4_final.hopper.config import HopperBwdConfig, hopper_bwd_default
from fa4_final.hopper.host import backward_config, backward_recipe
from fa4_final.runtime.compile import artifacts as compile_artifacts
from fa4_final.runtime.prologue import backward
from solutions import ch11_teaching as teach

slow = pytest.mark.slow


@pytest.fixture(scope="module")
def artifacts():
    cache = {}

    def get(head_dim=128, causal=False, deterministic=False, dtype="bf16", config=None,
            **window):
        key = (head_dim, causal, deterministic, dtype, config, tuple(sorted(window.items())))
        if key not in cache:
            cache[key] = compile_artifacts(backward_recipe(head_dim, dtype, causal, config,
                                                           deterministic, **window))
        return cache[key]

    return get


def wgmma_serialised(art) -> int:
    """Fences ptxas added on its own (C7512: wgmma serialised): WARPGROUP.ARRIVE in the SASS
    beyond the source's wgmma.fence."""
    return art.count("WARPGROUP.ARRIVE", where="sass") - art.count("wgmma.fence.sync.aligned")


@slow
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_kernel_builds_clean(artifacts, head_dim, causal, deterministic):
    arts = artifacts(head_dim, causal, deterministic)
    main, pre, post = arts["main"], arts["pre"], arts["post"]
    main.require("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait",
                 "setmaxnreg.inc", "setmaxnreg.dec", "bar.sync", "bar.arrive", "stmatrix",
                 "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32",
                 "cp.async.bulk.shared::cluster.global.mbarrier")
    main.require("HGMMA", "UTMALDG", "UTMASTG", "STSM", "MUFU.EX2", where="sass")
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+240;", main.ptx)
    assert re.search(r"setmaxnreg.dec.sync.aligned.u32\s+24;", main.ptx)
    if deterministic:  # the turn counters: acquire loads, release adds
        main.require("ld.acquire.gpu.global.b32", "red.release.gpu.global.add.s32")
    else:
        main.forbid("ld.acquire.gpu", "red.release.gpu")
    pre.require("ld.global.v4", "st.global.v4")
    post.require("ld.global.v4", "st.global.v4")
    for art in arts.values():
        assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    assert wgmma_serialised(main) == 0


@slow
@pytest.mark.parametrize("config", [
    HopperBwdConfig(tile_m=64),  # D = 128 non-causal without the swap
    HopperBwdConfig(tile_m=80, dq_swap_ab=True),
    HopperBwdConfig(tile_m=64, stages_ds=1),
    HopperBwdConfig(tile_m=64, stages_q=1, stages_ds=1),
    HopperBwdConfig(tile_m=64, pin_lane=True),
], ids=["m64", "m80_swap", "ds1", "q1", "pin_lane"])
def test_every_knob_compiles_clean(artifacts, config):
    art = artifacts(128, False, config=config)["main"]
    assert art.spills == 0, art.resources()
    assert wgmma_serialised(art) == 0
    if config.pin_lane:  # Note [Signalling lane]: no read of the thread index in the loops
        from solutions.ch08_compare import thread_index_reads

        assert thread_index_reads(art.sass) == 0


def mbarrier_arrives(sass: str) -> tuple[int, int]:
    """(all, predicated) SYNCS.ARRIVE instructions of a kernel's SASS: a predicated one is one
    lane's arrive (@P), an unpredicated one every thread's."""
    lines = [line for line in sass.splitlines() if "SYNCS.ARRIVE" in line]
    return len(lines), sum(1 for line in lines if re.search(r"@!?U?P\d", line))


@slow
@pytest.mark.parametrize("causal", [False, True])
def test_release_every_thread_arrives_from_every_thread(artifacts, causal):
    """Note [Release after the warp's reads]: under release_every_thread (the default) the four
    releases of a step's Q and dO stages (two code paths, masked and not) carry no one-lane
    predicate, and EMPTY counts 256 arrivals instead of 8; nothing else of the kernel's arrives
    differs from the one-lane build's, and it compiles without spills or serialised wgmma."""
    from fa4_final.hopper.bwd import HopperBackward

    knob = hopper_bwd_default(128, causal)
    assert knob.release_every_thread
    base = replace(knob, release_every_thread=False)
    default, every = (artifacts(128, causal, config=c)["main"] for c in (base, knob))
    assert every.spills == 0 and wgmma_serialised(every) == 0, every.resources()
    total, predicated = mbarrier_arrives(default.sass)
    assert mbarrier_arrives(every.sass) == (total, predicated - 4), (
        mbarrier_arrives(default.sass), mbarrier_arrives(every.sass))
    import cutlass

    counts = {spec.name: spec.empty_arrivals for spec in HopperBackward(
        cutlass.BFloat16, 128, causal, knob).pipelines()}
    assert counts["q"] == counts["do"] == 256 and counts["kv"] == 8, counts


@slow
@pytest.mark.parametrize("window", [dict(has_window_left=True),
                                    dict(has_window_left=True, has_window_right=True)])
def test_windows_and_fp16_compile_clean(artifacts, window):
    art = artifacts(128, False, dtype="fp16", **window)["main"]
    assert art.spills == 0 and wgmma_serialised(art) == 0


@slow
@pytest.mark.parametrize("head_dim,causal", [(128, False), (128, True), (64, False)])
def test_one_step_does_the_algorithm_and_little_else(artifacts, head_dim, causal):
    """Per step and thread (64 keys x tile_m queries per warpgroup, 2 rows x tile_m/4 columns per
    thread): one FFMA + one MUFU.EX2 per score (P), one FADD + one FMUL (dS), one F2FP per two
    values of P and of dS, the five GEMMs' HGMMAs; masking only in the masked copy."""
    cfg = hopper_bwd_default(head_dim, causal)
    mixes = teach.step_mixes(artifacts(head_dim, causal)["main"].sass,
                             teach.gemms_per_step(cfg, head_dim))
    assert len(mixes) == 2  # a masked and an unmasked copy of the step
    per_thread = 2 * cfg.tile_m // 4
    masked, plain = sorted(mixes, key=lambda c: -c.get("FSEL", 0))
    for mix in mixes:
        assert mix["MUFU.EX2"] == per_thread
        assert mix["FFMA"] >= per_thread and mix["FMUL"] >= per_thread
        assert mix["F2FP.BF16.F32.PACK_AB"] == per_thread  # no conversion done twice
        assert sum(v for k, v in mix.items() if k.startswith("HGMMA")) == \
            teach.gemms_per_step(cfg, head_dim)
        assert sum(mix.values()) < 9 * per_thread + 160, teach.mix_table({"step": mix})
    assert masked["FSEL"] == per_thread and plain.get("FSEL", 0) == 0


def test_config_errors_name_the_knob():
    with pytest.raises(ValueError, match="tile_m"):
        HopperBwdConfig(tile_m=72).check(128)
    with pytest.raises(ValueError, match="dq_swap_ab"):
        HopperBwdConfig(tile_m=80).check(128)
    with pytest.raises(ValueError, match="dq_swap_ab"):
        HopperBwdConfig(tile_m=80, dq_swap_ab=True).check(64)
    with pytest.raises(ValueError, match="shared memory"):
        HopperBwdConfig(tile_m=128).check(128)
    with pytest.raises(ValueError, match="stages_ds"):
        HopperBwdConfig(stages_ds=3).check(128)
    with pytest.raises(ValueError, match="stages_q"):
        HopperBwdConfig(stages_q=0).check(128)
    with pytest.raises(ValueError, match="head_dim"):
        HopperBwdConfig().check(96)
    for d in (64, 128):
        for causal in (False, True):
            cfg = hopper_bwd_default(d, causal)
            cfg.check(d)
            assert cfg.smem_bytes(d) <= 227 * 1024
            assert not cfg.deterministic and hopper_bwd_default(d, causal, True).deterministic
    with pytest.raises(UnsupportedError, match="sm_90a"):
        backward_recipe(arch="sm_100a")


def first_ffma_waits_on_lds(art) -> int:
    """Waits for S (WARPGROUP.DEPBAR.LE gsb0, 0x1) whose first FFMA reads a register that an LDS
    loaded after the wait: the FFMA stalls on that load."""
    lines, found = art.sass.splitlines(), 0
    for i, line in enumerate(lines):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in line:
            continue
        loaded = set()
        for later in lines[i + 1:i + 40]:
            got = re.search(r"LDS(?:\.\S+)? (R\d+),", later)
            if got:
                loaded.add(got.group(1))
            if "FFMA" in later:
                sources = later.split("FFMA", 1)[1].split(",", 1)[1]
                found += bool(set(re.findall(r"R\d+", sources)) & loaded)
                break
    return found


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rows_early_loads_lse_before_the_wait(artifacts, head_dim, causal):
    """HopperBwdConfig.rows_early (Note [Per-query values before the wait]): no spill, the same
    loads of lse and delta, and no first FFMA after the wait for S reading a register loaded
    after it (the build without it has such FFMAs); D = 256 is the swapped step (dkv_swap_ab),
    whose default it is."""
    base = replace(hopper_bwd_default(head_dim, causal), rows_shuffled=False)  # the lazy read
    assert base.dkv_swap_ab == (head_dim == 256) == base.rows_early
    plain = artifacts(head_dim, causal, config=replace(base, rows_early=False))["main"]
    early = artifacts(head_dim, causal, config=replace(base, rows_early=True))["main"]
    assert early.spills == 0 and early.frame_bytes == 0, early.resources()
    assert early.count("LDS", "sass") == plain.count("LDS", "sass")
    assert first_ffma_waits_on_lds(plain) > 0, "the lazy read no longer waits: the test is stale"
    assert first_ffma_waits_on_lds(early) == 0
    # about the same instructions: the two builds differ in their order (what the Note's
    # reading of the D = 64 timing rests on)
    def count(art):
        return len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", art.sass))

    assert count(plain) > 1000
    assert abs(count(early) - count(plain)) <= 0.01 * count(plain), (count(early), count(plain))


def test_smem_plan_adds_up():
    for d, cfg in ((128, hopper_bwd_default(128)), (64, hopper_bwd_default(64)),
                   (128, hopper_bwd_default(128, True))):
        plan = sum(b for _, b, _ in teach.smem_plan(cfg, d))
        assert plan <= cfg.smem_bytes(d) <= plan + 4096  # barriers and alignment


def _inputs(**kw):
    shape = dict(b=1, sq=64, sk=64, h=2, hk=2, d=64) | kw
    q = torch.randn(shape["b"], shape["sq"], shape["h"], shape["d"], dtype=torch.bfloat16)
    k = torch.randn(shape["b"], shape["sk"], shape["hk"], shape["d"], dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(shape["b"], shape["h"], shape["sq"])
    return q, k, v, out, lse, dout


def test_input_checks_say_what_is_wrong():
    q, k, v, out, lse, dout = _inputs()
    with pytest.raises(ValueError, match="head_dim must be one of"):
        backward(*_inputs(d=80))
    q2, k2, _, out2, lse2, dout2 = _inputs(d=256)  # v's head dim 128: no backward built there
    with pytest.raises(ValueError, match="head_dim=256, dv=128 is not built"):
        backward(q2, k2, torch.randn_like(k2[..., :128]), out2, lse2, dout2)
    with pytest.raises(ValueError, match="multiple"):
        backward(*_inputs(h=3, hk=2))
    with pytest.raises(ValueError, match="dout must have the shape, dtype and device of q"):
        backward(q, k, v, out, lse, dout[:, :32])
    with pytest.raises(ValueError, match="lse must be float32"):
        backward(q, k, v, out, lse.double(), dout)
    with pytest.raises(ValueError, match="lse must be float32"):
        backward(q, k, v, out, lse[:, :1], dout)
    with pytest.raises(ValueError, match="contiguous"):
        backward(q, k, v, out, lse, torch.randn(1, 64, 2, 128, dtype=q.dtype)[..., ::2])
    with pytest.raises(TypeError, match="dtype"):
        backward(q.float(), k, v, out, lse, dout)
    with pytest.raises(ValueError, match="softmax_scale"):
        backward(q, k, v, out, lse, dout, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="window_size"):
        backward(q, k, v, out, lse, dout, window_size=(1, 2, 3))
    with pytest.raises(TypeError, match="HopperBwdConfig"):
        backward_config(128, False, False, object())
    with pytest.raises(UnsupportedError, match="CUDA"):
        backward(q, k, v, out, lse, dout)  # valid, but on a CPU


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_flag_reaches_the_config(head_dim, causal):
    """What deterministic=True runs without a config= is hopper_bwd_default's deterministic
    config (two dQ buffers with a dQ warp each at D = 64 and 128,
    Note [Adds in flight across turns]), not the default mode's config with the flag set; a
    config= passed in is kept, only made deterministic."""
    cfg = backward_config(head_dim, causal, True, None)
    assert cfg.deterministic and cfg == hopper_bwd_default(head_dim, causal, deterministic=True)
    if head_dim != 96:
        assert cfg.dq_adds_overlap and cfg.dq_buffers == 2
    assert backward_config(head_dim, causal, False, None) == hopper_bwd_default(head_dim, causal)
    mine = HopperBwdConfig(tile_m=64)
    assert backward_config(head_dim, causal, True, mine) == replace(mine, deterministic=True)
    assert backward_config(128, True, False, HopperBwdConfig(tile_m=64)).tile_m == 64


@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, True)])
def test_rows_shuffled_gives_every_thread_its_own_columns(head_dim, causal):
    """Note [Per-query values by shuffle], traced for sm_90a from the kernel's own S^T MMA: for
    every MMA thread and fragment column, the lane it shuffles from loaded, in the register
    it names, exactly that thread's column; the warp loads each column exactly once. The
    mapping is the package's (shuffled_column_source, shuffled_column_loaded)."""
    import cutlass.cute as cute

    from fa4_final.common.constants import CUTLASS_BY_NAME
    from fa4_final.common.mask import fragment_coords
    from fa4_final.hopper.bwd import HopperBackward, shuffled_column_loaded, shuffled_column_source

    cfg = replace(hopper_bwd_default(head_dim, causal), rows_shuffled=True)
    main = HopperBackward(CUTLASS_BY_NAME["bf16"], head_dim, causal, cfg)
    cols: dict[int, list[int]] = {}

    def collect():
        mma_sdp, _, _ = main.tiled_mmas()
        for t in range(256):
            coords, _ = fragment_coords(mma_sdp.get_slice(t), (main.tile_n, main.tile_m))
            cols[t] = [int(coords[0, c][1]) for c in range(cute.size(coords, mode=[1]))]

    @cute.jit
    def probe():
        collect()

    cute.compile(probe, options="--gpu-arch sm_90a")

    assert len(cols[0]) == main.tile_m // 4
    for t, mine in cols.items():
        warp_base = t - t % 32
        assert sorted(cols[warp_base + t % 4]) == sorted(mine)  # lane groups share columns
        for c, col in enumerate(mine):
            src, reg = shuffled_column_source(cols[0][c], t % 32)
            assert shuffled_column_loaded(src, reg) == col, (t, c, col)
    # the warp's loads cover the tile's columns, each exactly once
    assert sorted(shuffled_column_loaded(lane, reg) for lane in range(32)
                  for reg in range(2 * (main.tile_m // 64))) == list(range(main.tile_m))


@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, True)])
def test_rows_shuffled_loads_an_eighth(artifacts, head_dim, causal):
    """HopperBwdConfig.rows_shuffled (Note [Per-query values by shuffle]) compiles clean, with
    an eighth of the LDS of lse and delta and a shuffle per column read; refused by name where
    tile_m is no multiple of 64 or with dkv_swap_ab."""
    base = replace(hopper_bwd_default(head_dim, causal), rows_shuffled=False)
    plain = artifacts(head_dim, causal, config=base)["main"]
    shuffled = artifacts(head_dim, causal, config=replace(base, rows_shuffled=True))["main"]
    assert shuffled.spills == 0 and shuffled.frame_bytes == 0, shuffled.resources()
    assert shuffled.count("LDS", "sass") * 8 == plain.count("LDS", "sass")
    # two builds of the step (masked, unmasked) x lse and delta x tile_m / 4 columns
    assert shuffled.count("SHFL", "sass") - plain.count("SHFL", "sass") == base.tile_m
    for bad in (replace(hopper_bwd_default(128), rows_shuffled=True),
                replace(hopper_bwd_default(256), rows_shuffled=True)):
        with pytest.raises(ValueError, match="rows_shuffled"):
            bad.check(128 if not bad.dkv_swap_ab else 256)
