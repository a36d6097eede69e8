"""The Hopper backward at head dim 96 (dv = 96), on a CPU: its config (dQ by one warpgroup,
Note [dQ by one warpgroup] in fa4_final.hopper.bwd); the dQ accumulator order the writer,
bwd_pre and bwd_post share at D = 96, read from the kernel's own CuTe partitions (traced for
sm_90a, no GPU); the bwd_head_dims row of fa4_final.runtime.pending, deleted once
tests/gpu/test_bwd_head_dims.py and the sanitizers passed (results/h100/gpu_checks.json,
results/h200/gpu_checks.json): a gradient at D = 96 goes through every entry point without
FA4_FINAL_PENDING, routed to the D = 96 build; and the compile for sm_90a (slow). Nothing here
runs a GPU kernel: tests/gpu/test_bwd_head_dims.py does."""

from __future__ import annotations

import pytest
import torch

from fa4_final import UnsupportedError
from fa4_final.common.constants import (
    BWD_EXTRA_HEAD_DIMS,
    CUTLASS_BY_NAME,
    HEAD_DIMS,
    SM90_SMEM_BYTES,
)
from fa4_final.common.dq_order import dq_offset
from fa4_final.hopper.config import HopperBwdConfig, hopper_bwd_default
from fa4_final.runtime import pending
from tests import fa4_cpu_reference as ref
from tests.bwd_head_dims_common import (
    assert_every_entry_reaches_the_device_check,
    backward_runner_keys,
    check_autograd_against_float64,
    check_varlen_autograd_against_float64,
    clean_main,
)
from tests.test_pending_features import dense

ROW = "bwd_head_dims"


pytestmark = pytest.mark.usefixtures("no_pending")


# ----------------------------------------------------------------------------------------------
# the config


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_d96_default_is_64_by_128_with_dq_by_one_warpgroup(causal, deterministic):
    assert BWD_EXTRA_HEAD_DIMS == (96,) and 96 not in HEAD_DIMS
    cfg = hopper_bwd_default(96, causal, deterministic)
    assert (cfg.tile_m, cfg.tile_n, cfg.dq_single_wg, cfg.dq_swap_ab) == (64, 128, True, False)
    assert cfg.dq_warpgroups == 1 and cfg.deterministic == deterministic
    cfg.check(96)
    assert cfg.smem_bytes(96) <= SM90_SMEM_BYTES
    for d in HEAD_DIMS:  # the verified defaults keep both warpgroups on dQ
        assert not hopper_bwd_default(d, causal, deterministic).dq_single_wg
        assert hopper_bwd_default(d, causal, deterministic).dq_warpgroups == 2


def test_d96_config_errors_name_the_knob():
    with pytest.raises(ValueError, match="dq_single_wg=True"):
        HopperBwdConfig(tile_m=64).check(96)  # 48 columns a warpgroup cut K's swizzle atom
    with pytest.raises(ValueError, match="dq_single_wg runs dQ"):
        HopperBwdConfig(tile_m=128, dq_single_wg=True).check(96)
    with pytest.raises(ValueError, match="dq_single_wg runs dQ"):
        HopperBwdConfig(tile_m=80, dq_swap_ab=True, dq_single_wg=True).check(128)
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 128, 96\), got 192"):
        HopperBwdConfig(dq_single_wg=True).check(192)
    HopperBwdConfig(tile_m=64, dq_single_wg=True).check(128)  # a knob D = 128 may use too


# ----------------------------------------------------------------------------------------------
# the dQ accumulator order at D = 96: the kernel's own partitions, traced for sm_90a


def _probe(head_dim: int) -> dict:
    """(row, col) of each dQ register of every writer thread (HopperBackward.dq_coords) and
    the float offset in its query tile's slab where dq_copy puts it, read from the CuTe
    objects the kernel and bwd_post build, while tracing a jit function for sm_90a (static
    layouts only: nothing is launched)."""
    import cutlass.cute as cute

    from fa4_final.common.bwd_post import BackwardPost
    from fa4_final.common.bwd_pre import BackwardPre
    from fa4_final.hopper.bwd import HopperBackward

    bf16 = CUTLASS_BY_NAME["bf16"]
    cfg = hopper_bwd_default(head_dim)
    main = HopperBackward(bf16, head_dim, False, cfg)
    got = {"main": main, "post": BackwardPost(main),
           "pre": BackwardPre(bf16, head_dim, cfg.tile_m), "coords": {}, "offsets": {}}

    def collect():
        slab = cute.make_identity_tensor(cute.product(main.dq_chunk_layout().shape))
        slab = cute.make_tensor(slab.iterator, main.dq_chunk_layout())  # (chunk, chunks)
        for tidx in range(main.dq_threads):
            c = main.dq_coords(tidx)
            got["coords"][tidx] = [tuple(int(x) for x in c[i]) for i in range(cute.size(c))]
            p = main.dq_copy().get_slice(tidx).partition_D(slab)
            got["offsets"][tidx] = [int(p[i]) if not isinstance(p[i], tuple) else int(p[i][0])
                                    for i in range(cute.size(p))]

    @cute.jit
    def probe():
        collect()

    cute.compile(probe, options="--gpu-arch sm_90a")
    return got


@pytest.fixture(scope="module")
def probe96():
    return _probe(96)


def test_d96_writer_registers_are_the_wgmma_accumulator_of_warpgroup_0(probe96):
    """128 writer threads (warpgroup 0), 48 registers each: register i = a + 2 h + 4 j of
    thread t holds row 16 (t // 32) + (t % 32) // 4 + 8 h, column 8 j + 2 (t % 4) + a of the
    64 x 96 tile (m64n96k16's accumulator, PTX ISA), every element once."""
    main = probe96["main"]
    assert (main.dq_threads, main.dq_warpgroups, main.dq_chunk) == (128, 1, 64 * 96)
    seen = set()
    for t, coords in probe96["coords"].items():
        assert len(coords) == 48
        for i, rc in enumerate(coords):
            a, h, j = i % 2, (i // 2) % 2, i // 4
            assert rc == (16 * (t // 32) + (t % 32) // 4 + 8 * h, 8 * j + 2 * (t % 4) + a)
            seen.add(rc)
    assert seen == {(r, c) for r in range(64) for c in range(96)}


def test_d96_accumulator_order_rebuilds_every_element_once(probe96):
    """The writer's dq_copy puts thread t's register i at dq_offset(t, i) of the slab (one
    chunk of 64 x 96 floats), each offset once; bwd_post, which reads the same offsets with
    the same 128 threads and gives each the (row, col) of dq_coords, writes every element of
    the tile once; bwd_pre zeroes the whole slab."""
    main, post, pre = probe96["main"], probe96["post"], probe96["pre"]
    where = {}
    for t in range(main.dq_threads):
        offsets = probe96["offsets"][t]
        assert offsets == [dq_offset(t, i, main.dq_chunk) for i in range(48)]
        for off, rc in zip(offsets, probe96["coords"][t]):
            where[off] = rc
    assert sorted(where) == list(range(64 * 96))
    assert sorted(where.values()) == [(r, c) for r in range(64) for c in range(96)]
    assert post.num_threads == main.dq_threads == 128
    # bwd_post's row copy: 4 threads a row, 3 vectors of 8 each, 32 rows a pass, 2 passes
    assert (post.threads_per_row, post.rows_per_pass) == (4, 32)
    assert post.threads_per_row * post.rows_per_pass == post.num_threads
    assert 96 // (8 * post.threads_per_row) == 3 and 64 // post.rows_per_pass == 2
    # bwd_pre: the same row split for delta (4 lanes a row reduce, within a warp), the slab
    # zeroed 16 B a thread a step
    assert (pre.threads_per_row, pre.rows_per_pass) == (4, 32)
    assert 32 % pre.threads_per_row == 0
    assert (64 * 96) // (4 * 128) * 4 * 128 == 64 * 96


def test_dq_offset_is_the_two_warpgroup_order_at_d128():
    """dq_offset states the order the existing kernels use (the Blackwell test's formula):
    thread t of warpgroup w, register i -> w * chunk + 512 (i // 4) + 4 t + i % 4."""
    got = _probe(128)
    main = got["main"]
    assert main.dq_warpgroups == 2 and main.dq_threads == 256
    for tidx in (0, 1, 127, 128, 200, 255):
        w, t = divmod(tidx, 128)
        want = [w * main.dq_chunk + 512 * (i // 4) + 4 * t + i % 4
                for i in range(len(got["offsets"][tidx]))]
        assert got["offsets"][tidx] == want == [dq_offset(tidx, i, main.dq_chunk)
                                                for i in range(len(want))]


# ----------------------------------------------------------------------------------------------
# bwd_head_dims (left the gate after its GPU tests and sanitizer runs passed)


def test_bwd_head_dims_left_the_gate():
    assert ROW not in pending.PENDING and pending.listed(ROW)
    for d, dv in ((96, 96), (192, 128), (192, 192), (256, 256), (64, 64), (128, 128)):
        assert not pending.forward_only(d, dv), (d, dv)
        assert pending.refuse_backward_head_dims("backward_into", d, dv) is None
    for d, dv in ((96, 128), (128, 96), (192, 96), (256, 192), (64, 96)):
        assert pending.forward_only(d, dv), (d, dv)
    assert pending.BACKWARD_HEAD_DIMS == ((64, 64), (96, 96), (128, 128), (192, 128),
                                          (192, 192), (256, 256))


@pytest.mark.parametrize("causal", [False, True])
def test_without_the_env_a_gradient_at_d96_runs_the_backward(cpu_kernels, causal):
    """No FA4_FINAL_PENDING: flash_attn_func and flash_attn_varlen_func with a gradient at
    D = 96 run the forward and the backward op (the CPU stand-ins of tests/fa4_cpu_reference),
    and the gradients are float64's."""
    q, k, v = dense(d=96, grad=True)
    check_autograd_against_float64(q, k, v, causal)
    check_varlen_autograd_against_float64(96, 96, causal)


@pytest.mark.parametrize("env", ["", ROW], ids=["default", "named"])
def test_every_entry_takes_d96_to_the_device_check(monkeypatch, env):
    """flash_attn_func and flash_attn_varlen_func with inputs requiring grad, and the backward
    entry points (prologue.backward_into, api.sdpa._flash_attn_bwd,
    varlen.varlen_backward_into): past every check to the device check (a CPU tensor), no
    gate; naming the deleted row in FA4_FINAL_PENDING changes nothing."""
    monkeypatch.setenv(pending.ENV, env)
    assert_every_entry_reaches_the_device_check(96, 96)


@pytest.mark.parametrize("env", ["", ROW, f"softcap,{ROW}"])
def test_head_dims_with_no_backward_stay_refused_naming_what_runs(monkeypatch, env):
    """Where no backward is built, refused whatever FA4_FINAL_PENDING says, naming the value
    and every (head_dim, dv) the backward runs."""
    monkeypatch.setenv(pending.ENV, env)
    for d, dv in ((128, 192), (96, 128), (128, 96), (192, 96), (256, 128), (256, 192)):
        with pytest.raises(UnsupportedError, match=f"head_dim={d}, dv={dv} is not built") as e:
            pending.refuse_backward_head_dims("backward_into", d, dv)
        message = str(e.value)
        assert message.startswith(f"backward_into: the backward at head_dim={d}, dv={dv} ")
        assert "it runs (head_dim, dv) (64, 64), (96, 96), (128, 128), (192, 128), (192, 192), " \
               "(256, 256)" in message, message
        assert "torch.no_grad()" in message and pending.ENV not in message, message


def test_the_hopper_runners_build_the_d96_backward(monkeypatch):
    """The Hopper backward runners (dense and varlen) ask backward_recipe for head dim 96, and
    that recipe's kernels are the D = 96 build: dQ by one warpgroup, 128 bwd_post threads."""
    _, _, keys = backward_runner_keys(monkeypatch, 96, varlen_out_is_q=True)
    from fa4_final.hopper import host

    for key, is_varlen in zip(keys, (False, True)):
        assert key[:2] == (96, "bf16")
        recipe = host.backward_recipe(*key)
        main, post = recipe.kernels["main"], recipe.kernels["post"]
        assert main.head_dim == 96 and main.varlen == is_varlen
        assert recipe.config.dq_single_wg and main.dq_warpgroups == 1
        assert post.num_threads == 128 and recipe.kernels["pre"].head_dim == 96


# ----------------------------------------------------------------------------------------------
# compiled for sm_90a (slow: 10-20 s a build)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(causal=False), dict(causal=True), dict(causal=True, deterministic=True),
    dict(causal=False, varlen=True), dict(causal=True, varlen=True, has_seqused_k=True),
    dict(causal=False, has_window_left=True, has_window_right=True),
], ids=["dense", "causal", "causal_det", "varlen", "varlen_causal_used_k", "window"])
def test_d96_backward_compiles_clean(kw):
    """Every kernel of the D = 96 backward: no spill, no stack, no wgmma serialised, the
    setmaxnreg plan of the D = 64/128 builds; the main kernel's dQ is one m64n96k16 chain of
    warpgroup 0 (8 wgmma over 128 keys a step copy) beside S^T, dP^T (m64n64k16, K = 96) and
    dV, dK (m64n96k16) of both warpgroups, and one bulk add a step."""
    from fa4_final.hopper.host import backward_recipe

    kw = dict(kw)
    causal = kw.pop("causal")
    main = clean_main(backward_recipe(96, "bf16", causal, **kw))
    n64 = main.count("wgmma.mma_async.sync.aligned.m64n64k16")
    n96 = main.count("wgmma.mma_async.sync.aligned.m64n96k16")
    copies = n64 // 12  # step copies: S^T and dP^T, 6 k-steps each, in every copy
    assert n64 == 12 * copies and copies % 2 == 0  # as many of warpgroup 0 as of warpgroup 1
    # warpgroup 0's copies: dV, dK (4 each) and dQ (8); warpgroup 1's: dV and dK
    assert n96 == copies // 2 * (4 + 4 + 8) + copies // 2 * (4 + 4)
    if kw.get("deterministic"):
        main.require("ld.acquire.gpu.global.b32", "red.release.gpu.global.add.s32")


# ----------------------------------------------------------------------------------------------
# measure.features' backward case (the GPU run is a session step)


def test_the_benchmark_case_bwd_d96():
    from measure import features

    assert "bwd_d96" in features.BWD_CASES and "bwd_d96" not in features.FWD_CASES
    s = features.FeatureShape("bwd_d96", 4, 4096, 16, True)
    assert s.pass_ == "bwd" and features.row_fields(s)["pass"] == "bwd"
    assert s.flops() == 2.0 * 4 * 16 * 4096 * 4096 * 0.5 * (3 * 96 + 2 * 96)
    assert features.FeatureShape("d96", 4, 4096, 16, True).pass_ == "fwd"


@pytest.mark.filterwarnings("ignore::UserWarning")  # SDPA's peers saying why they do not run
@pytest.mark.parametrize("case", ["bwd_d96", "bwd_d192", "bwd_d192v192", "bwd_d256"])
def test_the_benchmark_times_the_backward_without_the_env(monkeypatch, cpu_kernels, case):
    """measure.features' fa4_final backward row is the public flash_attn_func with
    FA4_FINAL_PENDING unset, and the driver leaves the environment alone: on a CPU, with the CPU
    stand-ins (and no device to synchronise), its call runs, its row holds max_diff alone (no
    env, no error) and that is a bf16 kernel's against float64."""
    import os

    from measure import features

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **kw: None)
    shape = features.FeatureShape(case, 1, 33, 2, True)
    calls, extra = features._bwd_calls(shape, device="cpu")
    assert pending.ENV not in os.environ
    assert "fa4_final" in calls and set(extra["fa4_final"]) == {"max_diff"}, extra
    assert extra["fa4_final"]["max_diff"] < 0.05
    d, dv = shape.dims
    assert [tuple(g.shape) for g in calls["fa4_final"]()] == [(1, 33, 2, d), (1, 33, 2, d),
                                                             (1, 33, 2, dv)]


def test_the_benchmark_reference_is_float64_autograd():
    from measure import features

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 33, 3, 96, generator=g) for _ in range(4))
    got = features.bwd_reference(q, k, v, dout, True, 0.1)
    leaves = [t[:1, :, :1].double().requires_grad_(True) for t in (q, k, v)]
    out, _ = ref.attention_masked(*leaves, True, softmax_scale=0.1)
    want = torch.autograd.grad(out, leaves, dout[:1, :, :1].double())
    for r, w in zip(got, want):
        assert r.shape == (1, 33, 1, 96) and torch.allclose(r, w)
    assert features.bwd_max_diff([t.to(torch.bfloat16) for t in want], got) < 0.05
