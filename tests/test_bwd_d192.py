"""The Hopper backward at head dim 192 with dv = 128 (DeepSeek's MLA prefill), on a CPU: its
config (tile_m = 32, dQ^T split 128 + 64 rows of D, Note [dQ split unevenly] in
fa4_final.hopper.bwd) and the dv != D shapes (Note [dV head dim]); the dQ accumulator order the
two writer warpgroups, bwd_pre and bwd_post share, read from the kernel's own CuTe partitions
(traced for sm_90a, no GPU); the bwd_head_dims row of fa4_final.runtime.pending, deleted once
tests/gpu/test_bwd_head_dims.py and the sanitizers passed (a gradient at (192, 128) goes
through every entry point without FA4_FINAL_PENDING, routed to the (192, 128) build; every
other dv != D pair refused whatever the environment says); the runtime's checks of dout and dv
at v's head dim; and the compile for sm_90a (slow). Nothing here runs a GPU kernel:
tests/gpu/test_bwd_head_dims.py does."""

from __future__ import annotations

import re

import pytest
import torch

from fa4_final import UnsupportedError
from fa4_final.common.constants import (
    BWD_HEAD_DIM_PAIRS,
    CUTLASS_BY_NAME,
    SM90_SMEM_BYTES,
)
from fa4_final.hopper.config import HopperBwdConfig, hopper_bwd_default
from fa4_final.runtime import pending
from fa4_final.runtime.checks import check_grads
from tests import fa4_cpu_reference as ref
from tests.bwd_head_dims_common import (
    assert_every_entry_reaches_the_device_check,
    backward_runner_keys,
    check_autograd_against_float64,
    check_varlen_autograd_against_float64,
    clean_main,
    probe_dq_writes,
)
from tests.test_pending_features import BF16, dense

ROW = "bwd_head_dims"
D, DV = 192, 128

pytestmark = pytest.mark.usefixtures("no_pending")


# ----------------------------------------------------------------------------------------------
# the config


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_d192_dv128_default_is_32_by_128_with_dq_split_unevenly(causal, deterministic):
    assert (D, DV) in BWD_HEAD_DIM_PAIRS
    cfg = hopper_bwd_default(D, causal, deterministic, head_dim_v=DV)
    assert (cfg.tile_m, cfg.tile_n, cfg.dq_swap_ab, cfg.dq_uneven, cfg.dq_single_wg) == (
        32, 128, True, True, False)
    assert cfg.deterministic == deterministic and (cfg.stages_q, cfg.stages_ds) == (2, 2)
    cfg.check(D, DV)
    # Q 2 x 32 x 192, dO 2 x 32 x 128, K 128 x 192, V 128 x 128, dS 2 x 32 x 128 (16-bit),
    # a float32 dQ of 32 x 192, lse and delta: 161 KB of the 227
    assert cfg.smem_bytes(D, 2, DV) == 161 * 1024 <= SM90_SMEM_BYTES
    assert cfg.smem_bytes(D, 2, DV) == cfg.smem_bytes(D, 2) - (32 * 64 * 2 * 2 + 128 * 64 * 2)
    # the knob is chosen for (192, 128) only; dv == D defaults are what they were
    for d in (64, 96, 128):
        assert not hopper_bwd_default(d, causal, deterministic).dq_uneven
        assert hopper_bwd_default(d, causal, deterministic, head_dim_v=d) == \
            hopper_bwd_default(d, causal, deterministic)


def test_d192_config_errors_name_the_knob_and_the_pair():
    with pytest.raises(ValueError, match=r"dq_uneven splits dQ\^T .* got dq_swap_ab=False"):
        HopperBwdConfig(tile_m=64, dq_uneven=True).check(D, DV)
    with pytest.raises(ValueError, match="dq_uneven splits .* head_dim=128"):
        HopperBwdConfig(tile_m=32, dq_swap_ab=True, dq_uneven=True).check(128)
    with pytest.raises(ValueError, match="dq_swap_ab puts head_dim on the wgmma M"):
        HopperBwdConfig(tile_m=32, dq_swap_ab=True).check(D, DV)
    for d, dv in ((192, 192), (128, 64), (192, 96), (256, 128)):
        with pytest.raises(ValueError, match=re.escape(
                f"(head_dim, head_dim_v) must be one of {BWD_HEAD_DIM_PAIRS} when they "
                f"differ, got "
                f"({d}, {dv})") if d != dv else r"head_dim must be one of \(64, 128, 96\)"):
            HopperBwdConfig(tile_m=32, dq_swap_ab=True, dq_uneven=True).check(d, dv)
    # 64 query rows a step need 242 KB (and spill: Note [dQ split unevenly])
    with pytest.raises(ValueError, match="config needs 247808 B .* dO of 64x128, K of 128x192 "
                                         "and V of 128x128"):
        HopperBwdConfig(tile_m=64, dq_swap_ab=True, dq_uneven=True).check(D, DV)


# ----------------------------------------------------------------------------------------------
# the dQ accumulator order: two writer warpgroups, read back as one


@pytest.fixture(scope="module")
def probe192() -> dict:
    """From the CuTe objects the kernel and bwd_post build, traced for sm_90a (static layouts
    only, nothing launched): each writer part's (row, col) and slab offset per register
    (the part's own tiled-MMA partition of its rows and dq_copy over dq_part_view, as mma()
    builds them) and bwd_post's reading (dq_coords, dq_copy over dq_chunk_layout)."""
    from fa4_final.common.bwd_post import BackwardPost
    from fa4_final.common.bwd_pre import BackwardPre
    from fa4_final.hopper.bwd import HopperBackward

    bf16 = CUTLASS_BY_NAME["bf16"]
    cfg = hopper_bwd_default(D, head_dim_v=DV)
    main = HopperBackward(bf16, D, False, cfg, head_dim_v=DV)
    got = {"main": main, "post": BackwardPost(main),
           "pre": BackwardPre(bf16, D, cfg.tile_m, head_dim_v=DV), "read": {}, "write": {}}

    probe_dq_writes(main, main.tiled_mmas, got)
    return got


def test_d192_writer_parts_are_128_and_64_rows_of_dq_transposed(probe192):
    """Warpgroup 0 holds rows 0-127 of dQ^T (D x tile_m), 32 registers a thread; warpgroup 1
    rows 128-191, 16 registers: each register is m64n32k16's accumulator element (PTX ISA:
    register v = a + 2 h + 4 j of M-block m holds row 64 m + 16 (t // 32) + (t % 32) // 4 +
    8 h, column 8 j + 2 (t % 4) + a), every element of the 192 x 32 tile once."""
    main = probe192["main"]
    assert (main.dq_part(0), main.dq_part(1)) == ((0, 128), (128, 64))
    assert (main.dq_at(0), main.dq_at(1)) == (0, 4096)
    assert (main.dq_bytes(0), main.dq_bytes(1)) == (16384, 8192)
    seen = []
    for (part, t), regs in probe192["write"].items():
        assert len(regs) == (32 if part == 0 else 16)
        for i, (rc, _) in enumerate(regs):
            v, m = i % 16, i // 16 + 2 * part
            a, h, j = v % 2, (v // 2) % 2, v // 4
            assert rc == (64 * m + 16 * (t // 32) + (t % 32) // 4 + 8 * h,
                          8 * j + 2 * (t % 4) + a)
            seen.append(rc)
    assert sorted(seen) == [(r, c) for r in range(D) for c in range(32)]


def test_d192_accumulator_order_is_one_warpgroup_s_and_bwd_post_rebuilds_it(probe192):
    """The two parts' slab offsets are those of one warpgroup holding the whole tile (register
    32 + i of that warpgroup is warpgroup 1's register i, 4096 floats in): bwd_post, reading
    with 128 threads, gives every offset the (row, col) its writer stored there, each element
    once. bwd_pre's delta rows (dv = 128: 16 threads a row) and the zeroed slab (192 x 32)."""
    main, post, pre = probe192["main"], probe192["post"], probe192["pre"]
    assert (main.dq_threads, main.dq_warpgroups, main.dq_chunk) == (128, 2, 32 * D)
    written = {}
    for (part, t), regs in probe192["write"].items():
        for i, (rc, off) in enumerate(regs):
            assert off == 4096 * part + 512 * (i // 4) + 4 * t + i % 4
            assert off not in written
            written[off] = rc
    assert sorted(written) == list(range(32 * D))
    read = {}
    for t, regs in probe192["read"].items():
        assert len(regs) == 48
        for i, (rc, off) in enumerate(regs):
            assert off == 512 * (i // 4) + 4 * t + i % 4
            read[off] = rc
    assert read == written
    assert post.num_threads == 128 and post.main.dq_swap_ab
    # bwd_post's row copy of dQ (D = 192): 8 threads a row, 3 vectors of 8 each, 16 rows a pass
    assert (post.threads_per_row, post.rows_per_pass) == (8, 16) and 32 % post.rows_per_pass == 0
    # bwd_pre: delta over dv = 128 (16 threads a row, 8 rows a pass); the slab is D wide
    assert (pre.head_dim, pre.head_dim_v) == (D, DV)
    assert (pre.threads_per_row, pre.rows_per_pass) == (16, 8)
    assert (32 * D) % (4 * 128) == 0


# ----------------------------------------------------------------------------------------------
# bwd_head_dims (left the gate after its GPU tests and sanitizer runs passed)


def test_d192_dv128_left_the_gate():
    assert ROW not in pending.PENDING and pending.listed(ROW)
    assert not pending.forward_only(D, DV) and not pending.forward_only(D, D)
    assert pending.refuse_backward_head_dims("flash_attn_func", D, DV) is None


@pytest.mark.parametrize("causal", [False, True])
def test_without_the_env_a_gradient_at_d192_dv128_runs_the_backward(cpu_kernels, causal):
    """No FA4_FINAL_PENDING: flash_attn_func and flash_attn_varlen_func with a gradient at
    (192, 128) run the forward and the backward op (the CPU stand-ins of
    tests/fa4_cpu_reference), dv like v, the gradients float64's."""
    q, k, v = dense(d=D, dv=DV, grad=True)
    check_autograd_against_float64(q, k, v, causal)
    assert v.grad.shape == v.shape and v.shape[-1] == DV
    check_varlen_autograd_against_float64(D, DV, causal)


@pytest.mark.parametrize("env", ["", ROW], ids=["default", "named"])
def test_every_entry_takes_d192_dv128_to_the_device_check(monkeypatch, env):
    """flash_attn_func and flash_attn_varlen_func with inputs requiring grad, and the backward
    entry points (prologue.backward_into, api.sdpa._flash_attn_bwd,
    varlen.varlen_backward_into): past every check to the device check, no gate; naming the
    deleted row changes nothing."""
    monkeypatch.setenv(pending.ENV, env)
    assert_every_entry_reaches_the_device_check(D, DV)


@pytest.mark.parametrize("env", ["", ROW])
def test_other_dv_pairs_stay_refused_naming_the_pair(monkeypatch, env):
    monkeypatch.setenv(pending.ENV, env)
    for d, dv in ((192, 64), (128, 64), (256, 128), (96, 64), (256, 192)):
        assert pending.forward_only(d, dv)
        with pytest.raises(UnsupportedError, match=f"head_dim={d}, dv={dv} is not built") as e:
            pending.refuse_backward_head_dims("flash_attn_func", d, dv)
        assert "(192, 128), (192, 192), (256, 256); the forward runs" in str(e.value)


def test_dout_and_dv_take_v_s_head_dim():
    """runtime.checks.check_grads at dv != D: dout like out (q's shape, v's head dim), dv like
    v; a dout or dv of q's or k's head dim is named with the shape it must have."""
    q, k, v = dense(d=D, dv=DV)
    dout = torch.zeros(*q.shape[:-1], DV, dtype=BF16)
    args = dict(check_address=False, v=v)
    check_grads(q, k, dout, torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                **args)
    with pytest.raises(ValueError, match=r"dout must have the shape, dtype and device of q with "
                                         r"v's head dim \(\(2, 24, 4, 128\)"):
        check_grads(q, k, torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(k),
                    torch.zeros_like(v), **args)
    with pytest.raises(ValueError, match=r"dv must have the shape, dtype and device of v "
                                         r"\(\(2, 40, 2, 128\)"):
        check_grads(q, k, dout, torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(k),
                    **args)
    with pytest.raises(ValueError, match="dk must have the shape"):
        check_grads(q, k, dout, torch.zeros_like(q), torch.zeros_like(v), torch.zeros_like(v),
                    **args)


def test_the_hopper_runners_build_the_d192_dv128_backward(monkeypatch):
    """The Hopper backward runners (dense and varlen) ask backward_recipe for head dim 192 with
    head_dim_v 128 (last in the compile key, only when it differs), and that recipe's kernels
    are the (192, 128) build: dQ split unevenly, 128 bwd_post threads, bwd_pre over dv."""
    calls, runners, keys = backward_runner_keys(monkeypatch, D, dv=DV)
    lse = torch.zeros(2, 4, 24)
    from fa4_final.hopper import host

    for key, is_varlen in zip(keys, (False, True)):
        assert key[:2] == (D, "bf16") and key[-1] == DV
        recipe = host.backward_recipe(*key)
        main, post, pre = (recipe.kernels[r] for r in ("main", "post", "pre"))
        assert (main.head_dim, main.head_dim_v, main.varlen) == (D, DV, is_varlen)
        assert recipe.config.dq_uneven and recipe.config.tile_m == 32
        assert post.num_threads == 128 and (pre.head_dim, pre.head_dim_v) == (D, DV)
    # dv == D keys are what they were: no head_dim_v in them
    runners["backward"](*dense(d=128), torch.zeros(2, 24, 4, 128, dtype=BF16), lse,
                        torch.zeros(2, 24, 4, 128, dtype=BF16),
                        *(torch.zeros_like(t) for t in dense(d=128)), True, 0.1, None, 0)
    assert [c[2] for c in calls if c[0] == "compiled"][-1][:2] == (128, "bf16")
    assert DV not in [c[2] for c in calls if c[0] == "compiled"][-1][2:]


# ----------------------------------------------------------------------------------------------
# compiled for sm_90a (slow: about 10 s a build)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(causal=False), dict(causal=True), dict(causal=True, deterministic=True),
    dict(causal=False, varlen=True), dict(causal=True, varlen=True, has_seqused_k=True),
    dict(causal=False, has_window_left=True, has_window_right=True),
    dict(causal=True, softcap=30.0),
], ids=["dense", "causal", "causal_det", "varlen", "varlen_causal_used_k", "window", "softcap"])
def test_d192_dv128_backward_compiles_clean(kw):
    """Every kernel of the (192, 128) backward: no spill, no stack, no wgmma serialised, the
    setmaxnreg plan of the other builds (24 / 240). Per step copy of each warpgroup: S^T
    (m64n32k16, K = 192: 12), dP^T (K = 128: 8), dV (m64n128k16, K = tile_m = 32: 2), dK
    (m64n192k16: 2); dQ^T (m64n32k16 over 128 keys) 16 in warpgroup 0's copies (two M-blocks)
    and 8 in warpgroup 1's; two bulk adds a step (16 KB and 8 KB)."""
    from fa4_final.hopper.host import backward_recipe

    kw = dict(kw)
    causal = kw.pop("causal")
    main = clean_main(backward_recipe(D, "bf16", causal, head_dim_v=DV, **kw))
    n32 = main.count("wgmma.mma_async.sync.aligned.m64n32k16")
    n128 = main.count("wgmma.mma_async.sync.aligned.m64n128k16")
    n192 = main.count("wgmma.mma_async.sync.aligned.m64n192k16")
    copies = n128 // 2  # step copies of both warpgroups together
    assert n128 == n192 == 2 * copies and copies % 2 == 0
    assert n32 == copies * (12 + 8) + copies // 2 * (16 + 8)
    assert not main.count("wgmma.mma_async.sync.aligned.m64n64k16")
    if kw.get("deterministic"):
        main.require("ld.acquire.gpu.global.b32", "red.release.gpu.global.add.s32")


# ----------------------------------------------------------------------------------------------
# measure.features' backward case (the GPU run is a session step)


def test_the_benchmark_case_bwd_d192():
    """bwd_d192 beside bwd_d96: the backward at (192, 128), out of the forward's default cases;
    its FLOPs count S, dK, dQ over D = 192 and dP, dV over dv = 128; the inputs _bwd_calls
    draws take v and dout of 128 columns (the shapes are the case's dims)."""
    from measure import features

    assert features.BWD_CASES[:2] == ("bwd_d96", "bwd_d192")
    assert "bwd_d192" not in features.FWD_CASES and features.CASES["bwd_d192"][:2] == (D, DV)
    s = features.FeatureShape("bwd_d192", 4, 4096, 16, True)
    assert s.pass_ == "bwd" and s.dims == (D, DV)
    assert features.row_fields(s)["d"] == D and features.row_fields(s)["dv"] == DV
    assert s.flops() == 2.0 * 4 * 16 * 4096 * 4096 * 0.5 * (3 * D + 2 * DV)


def test_the_benchmark_reference_takes_dv():
    from measure import features

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 33, 3, D, generator=g) for _ in range(2))
    v, dout = (torch.randn(2, 33, 3, DV, generator=g) for _ in range(2))
    got = features.bwd_reference(q, k, v, dout, True, 0.1)
    leaves = [t[:1, :, :1].double().requires_grad_(True) for t in (q, k, v)]
    out, _ = ref.attention_masked(*leaves, True, softmax_scale=0.1)
    want = torch.autograd.grad(out, leaves, dout[:1, :, :1].double())
    assert [tuple(t.shape) for t in got] == [(1, 33, 1, D), (1, 33, 1, D), (1, 33, 1, DV)]
    for r, w in zip(got, want):
        assert torch.allclose(r, w)


@pytest.mark.slow
def test_d192_dv128_tile_m_32_is_the_largest_that_compiles_clean():
    """Note [dQ split unevenly]: the same split at tile_m = 48 spills (S^T, dP^T of 24 floats
    and warpgroup 0's dQ^T of 48 beside dK and dV's 160), so the default takes 32."""
    from dataclasses import replace

    from fa4_final.hopper.host import backward_recipe
    from fa4_final.runtime.compile import artifacts

    cfg = replace(hopper_bwd_default(D, head_dim_v=DV), tile_m=48)
    cfg.check(D, DV)  # it fits shared memory (200 KB): registers are what refuse it
    main = artifacts(backward_recipe(D, "bf16", False, cfg, head_dim_v=DV))["main"]
    assert main.spills > 0
