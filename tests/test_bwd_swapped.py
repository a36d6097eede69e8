"""The Hopper backward with dK and dV swapped (Note [dK and dV swapped] in fa4_final.hopper.bwd)
at D = dv = 192 (64 x 96) and D = 256 (64 x 48), on a CPU: the config and its errors, the
shared-memory budget, the dQ accumulator order of the two writer parts read from the kernel's
own CuTe partitions traced for sm_90a (bwd_post reads it back unchanged), the bwd_head_dims row
of fa4_final.runtime.pending, deleted once tests/gpu/test_bwd_head_dims.py and the sanitizers
passed (a gradient at D = dv = 192 and 256 goes through every entry point without
FA4_FINAL_PENDING, routed to the swapped build) and the compile for sm_90a (slow). Nothing here
runs a GPU kernel: tests/gpu/test_bwd_head_dims.py does (-k d192v192, -k d256)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from fa4_final.common.constants import (
    BWD_HEAD_DIM_PAIRS,
    CUTLASS_BY_NAME,
    SM90_SMEM_BYTES,
)
from fa4_final.hopper.config import HopperBwdConfig, hopper_bwd_default
from fa4_final.runtime import pending
from tests.bwd_head_dims_common import (
    assert_every_entry_reaches_the_device_check,
    backward_runner_keys,
    check_autograd_against_float64,
    check_varlen_autograd_against_float64,
    clean_build,
    clean_main,
    probe_dq_writes,
)
from tests.test_pending_features import dense

ROW = "bwd_head_dims"
TILE_N = {192: 96, 256: 48}

pytestmark = pytest.mark.usefixtures("no_pending")


# ----------------------------------------------------------------------------------------------
# the config


@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_default_is_64_by_tile_n_with_dk_dv_swapped(d, causal, deterministic):
    assert (d, d) in BWD_HEAD_DIM_PAIRS
    for cfg in (hopper_bwd_default(d, causal, deterministic),
                hopper_bwd_default(d, causal, deterministic, head_dim_v=d)):
        assert (cfg.tile_m, cfg.tile_n, cfg.dkv_swap_ab, cfg.swap_tile_n) == (
            64, TILE_N[d], True, TILE_N[d])
        assert (cfg.dq_swap_ab, cfg.dq_uneven, cfg.dq_single_wg) == (True, True, False)
        assert (cfg.stages_q, cfg.do_stages, cfg.stages_ds, cfg.deterministic) == (
            2, 1, 1, deterministic)
        assert cfg.rows_early  # Note [Per-query values before the wait]
        cfg.check(d)
        cfg.check(d, d)
    # every other default is what it was: no swap, 128 keys
    for dd, dv in ((64, 64), (96, 96), (128, 128), (192, 128)):
        other = hopper_bwd_default(dd, causal, deterministic, head_dim_v=dv)
        assert not other.dkv_swap_ab and other.swap_tile_n == 0 and other.tile_n == 128
        assert not other.rows_early


def test_shared_memory_counts_p_beside_ds():
    """Q (two stages), dO (one), K, V, dS, P (16-bit), a float32 dQ of 64 x D, lse and
    delta: 217 KB at D = 192, 221 KB at 256; two dO stages too would not fit, one of each
    takes 24 KB (192) or 32 KB (256) less."""
    c192, c256 = hopper_bwd_default(192), hopper_bwd_default(256)
    kb = 1024
    assert c192.smem_bytes(192) == 217 * kb <= SM90_SMEM_BYTES
    assert c256.smem_bytes(256) == 221 * kb <= SM90_SMEM_BYTES
    assert replace(c192, stages_q=1).smem_bytes(192) == 193 * kb
    assert replace(c256, stages_q=1).smem_bytes(256) == 189 * kb
    for cfg, d in ((c192, 192), (c256, 256)):
        with pytest.raises(ValueError, match="more than the 232448 B a CTA may use"):
            replace(cfg, stages_do=2).check(d)
    # dO as deep as Q: the same arithmetic as before the knob
    same = HopperBwdConfig(tile_m=64, stages_q=2)
    assert same.do_stages == 2 and same.smem_bytes(128) == replace(same, stages_do=2).smem_bytes(
        128)


def test_config_errors_name_the_knob():
    base = hopper_bwd_default(192)
    with pytest.raises(ValueError, match=re.escape(
            "dkv_swap_ab=True is built for (head_dim, head_dim_v) in ((192, 192), (256, 256)), "
            "got (128, 128)")):
        replace(base).check(128)
    with pytest.raises(ValueError, match=r"got \(192, 128\)"):
        base.check(192, 128)
    with pytest.raises(ValueError, match="swap_tile_n must be a positive multiple of 16"):
        replace(base, swap_tile_n=40).check(192)
    with pytest.raises(ValueError, match="swap_tile_n and stages_do are knobs of dkv_swap_ab"):
        HopperBwdConfig(swap_tile_n=96).check(128)
    with pytest.raises(ValueError, match="stages_do=1"):
        HopperBwdConfig(stages_do=1).check(128)
    with pytest.raises(ValueError, match="stages_do must be an int >= 0"):
        replace(base, stages_do=-1).check(192)
    with pytest.raises(ValueError, match="tile_m = 64 query rows"):
        replace(base, tile_m=32).check(192)
    with pytest.raises(ValueError, match=r"dq_swap_ab=True, dq_uneven=True"):
        replace(base, dq_uneven=False).check(192)
    with pytest.raises(ValueError, match="stages_ds=1"):
        replace(base, stages_ds=2).check(192)
    # without the swap D = dv = 192 and 256 stay refused by the config
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 128, 96\)"):
        HopperBwdConfig().check(256)


# ----------------------------------------------------------------------------------------------
# the dQ accumulator order, from the kernel's own CuTe objects


@pytest.fixture(scope="module", params=[192, 256])
def probe(request) -> dict:
    """Traced for sm_90a (static layouts only, nothing launched): each writer part's (row, col)
    and slab offset per register, from swapped_mmas()'s dQ MMA (what mma_swapped builds) and
    dq_copy over dq_part_view; bwd_post's reading (dq_coords over tiled_mmas(), dq_copy over
    dq_chunk_layout)."""
    from fa4_final.common.bwd_post import BackwardPost
    from fa4_final.hopper.bwd import HopperBackward

    d = request.param
    bf16 = CUTLASS_BY_NAME["bf16"]
    main = HopperBackward(bf16, d, False, hopper_bwd_default(d))
    got = {"d": d, "main": main, "post": BackwardPost(main), "read": {}, "write": {}}

    probe_dq_writes(main, main.swapped_mmas, got)
    return got


def test_dq_parts_cover_the_tile_and_bwd_post_reads_each_offset_s_writer(probe):
    """dQ^T (D x 64) split 128 + 64 rows (192) or 128 + 128 (256): every element once, each
    slab offset written once, and bwd_post's one-warpgroup reading gives it the same (row,
    col) (the order of Note [dQ split unevenly], shared by the swapped build)."""
    d, main, post = probe["d"], probe["main"], probe["post"]
    assert (main.dq_part(0), main.dq_part(1)) == ((0, 128), (128, d - 128))
    assert (main.dq_threads, main.dq_chunk) == (128, 64 * d)
    written = {}
    for (part, _t), regs in probe["write"].items():
        assert len(regs) == main.dq_part(part)[1] * 64 // 128
        for rc, off in regs:
            assert off not in written
            written[off] = rc
    assert sorted(written) == list(range(64 * d))
    assert sorted(written.values()) == [(r, c) for r in range(d) for c in range(64)]
    read = {}
    for regs in probe["read"].values():
        for rc, off in regs:
            read[off] = rc
    assert read == written
    assert post.num_threads == 128 and post.main.dq_swap_ab


# ----------------------------------------------------------------------------------------------
# bwd_head_dims (left the gate after its GPU tests and sanitizer runs passed)


@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_without_the_env_a_gradient_runs_the_backward(cpu_kernels, d, causal):
    """No FA4_FINAL_PENDING: flash_attn_func and flash_attn_varlen_func with a gradient at
    D = dv run the forward and the backward op (the CPU stand-ins of tests/fa4_cpu_reference),
    the gradients float64's."""
    assert ROW not in pending.PENDING and not pending.forward_only(d, d)
    q, k, v = dense(d=d, dv=d, grad=True)
    check_autograd_against_float64(q, k, v, causal)
    check_varlen_autograd_against_float64(d, d, causal)


@pytest.mark.parametrize("env", ["", ROW], ids=["default", "named"])
@pytest.mark.parametrize("d", [192, 256])
def test_every_entry_takes_the_swapped_dims_to_the_device_check(monkeypatch, d, env):
    """flash_attn_func and flash_attn_varlen_func with inputs requiring grad, and the backward
    entry points (prologue.backward_into, api.sdpa._flash_attn_bwd,
    varlen.varlen_backward_into): past every check to the device check, no gate; naming the
    deleted row changes nothing."""
    monkeypatch.setenv(pending.ENV, env)
    assert_every_entry_reaches_the_device_check(d, d)


@pytest.mark.parametrize("d", [192, 256])
def test_the_hopper_runners_build_the_swapped_backward(monkeypatch, d):
    """The Hopper backward runners (dense and varlen) ask backward_recipe for head dim d (no
    head_dim_v in the key: dv == D), and that recipe's kernels are the swapped build."""
    _, _, keys = backward_runner_keys(monkeypatch, d, dv=d)
    from fa4_final.hopper import host

    for key, is_varlen in zip(keys, (False, True)):
        assert key[:2] == (d, "bf16")
        recipe = host.backward_recipe(*key)
        main, post = recipe.kernels["main"], recipe.kernels["post"]
        assert (main.head_dim, main.head_dim_v, main.varlen, main.tile_n) == (
            d, d, is_varlen, TILE_N[d])
        assert recipe.config.dkv_swap_ab and post.num_threads == 128


# ----------------------------------------------------------------------------------------------
# measure.features' backward cases (the GPU run is the session step features-bwd-swapped)


@pytest.mark.parametrize("case, d", [("bwd_d192v192", 192), ("bwd_d256", 256)])
def test_the_benchmark_cases(case, d):
    from measure import features

    assert features.BWD_CASES == ("bwd_d96", "bwd_d192", "bwd_d192v192", "bwd_d256")
    assert case not in features.FWD_CASES and features.CASES[case][:2] == (d, d)
    s = features.FeatureShape(case, 4, 4096, 16, True)
    assert s.pass_ == "bwd" and s.dims == (d, d)
    assert features.row_fields(s)["d"] == d and features.row_fields(s)["dv"] == d
    assert s.flops() == 2.0 * 4 * 16 * 4096 * 4096 * 0.5 * 5 * d


# ----------------------------------------------------------------------------------------------
# compiled for sm_90a (slow: a few seconds a build)


BUILDS = [
    dict(causal=False), dict(causal=True), dict(causal=True, deterministic=True),
    dict(causal=False, deterministic=True),
    dict(causal=False, varlen=True), dict(causal=True, varlen=True, has_seqused_k=True),
    dict(causal=False, has_window_left=True, has_window_right=True),
]
BUILD_IDS = ["dense", "causal", "causal_det", "det", "varlen", "varlen_causal_used_k", "window"]


@pytest.mark.slow
@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("kw", BUILDS, ids=BUILD_IDS)
def test_the_swapped_backward_compiles_clean(d, kw):
    """Every kernel of the build: no spill, no stack, no wgmma serialised, the setmaxnreg plan
    of the other builds (24 / 240). Per step copy of each warpgroup, D = 192: S and dP
    m64n48k16 over K = 192 (12 each), dV^T and dK^T m64n48k16 (3 M-blocks x 4, 12 each); dQ^T
    m64n64k16 over 96 keys, 12 in warpgroup 0's copies and 6 in warpgroup 1's. D = 256: S and
    dP m64n24k16 (16 each), dV^T and dK^T m64n48k16 (2 x 4 each), dQ^T 6 in each part. Two
    bulk adds a step, stmatrix for P, dS and the epilogue."""
    from fa4_final.hopper.host import backward_recipe

    kw = dict(kw)
    causal = kw.pop("causal")
    main = clean_main(backward_recipe(d, "bf16", causal, **kw))
    n24 = main.count("wgmma.mma_async.sync.aligned.m64n24k16")
    n48 = main.count("wgmma.mma_async.sync.aligned.m64n48k16")
    n64 = main.count("wgmma.mma_async.sync.aligned.m64n64k16")
    if d == 192:  # copies: step copies of both parts together
        copies = n48 // 48
        assert copies and n48 == 48 * copies and n64 == 9 * copies and n24 == 0
    else:
        copies = n24 // 32
        assert copies and n24 == 32 * copies and n48 == 16 * copies and n64 == 6 * copies
    assert not main.count("wgmma.mma_async.sync.aligned.m64n128k16")
    if kw.get("deterministic"):
        main.require("ld.acquire.gpu.global.b32", "red.release.gpu.global.add.s32")


@pytest.mark.slow
@pytest.mark.parametrize("d, dtype, kw", [
    (192, "bf16", dict(causal=True, varlen=True, has_seqused_q=True, has_seqused_k=True)),
    (256, "bf16", dict(causal=False, varlen=True, has_seqused_q=True, has_window_left=True)),
    (192, "fp16", dict(causal=True, has_window_left=True)),
    (256, "fp16", dict(causal=True, deterministic=True, varlen=True)),
    (192, "bf16", dict(causal=False, has_dlse=True)),
    (192, "bf16", dict(causal=True, softcap=30.0)),
    (256, "bf16", dict(causal=False, softcap=30.0, varlen=True)),
], ids=["d192_seqused_q", "d256_seqused_q_left", "d192_fp16_causal_left", "d256_fp16_det_varlen",
        "d192_dlse", "d192_softcap_causal", "d256_softcap_varlen"])
def test_more_swapped_builds_compile_clean(d, dtype, kw):
    """seqused_q, a left window with and without the causal mask, fp16, the lse gradient, a
    softcap (Note [Softcap in the backward]: tanh in the main kernel): no spill, no stack in
    any of the three kernels, no wgmma serialised."""
    from fa4_final.hopper.host import backward_recipe

    arts = clean_build(backward_recipe(d, dtype, **kw))
    assert ("tanh" in arts["main"].ptx) == bool(kw.get("softcap"))
