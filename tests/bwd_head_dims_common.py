"""Pieces the CPU tests of the Hopper backward at extra head dims share (tests/test_bwd_d192.py,
tests/test_bwd_swapped.py, tests/test_bwd_head_dims.py, tests/test_pending_wiring.py): the
entry-point calls that raise (a refusal, or the device check on a CPU), float64 gradients of the
CPU reference (dense and varlen autograd), the dQ writer/reader probe traced for sm_90a, and the
Hopper backward runners recorded at one head dim."""

from __future__ import annotations

import re

import pytest
import torch

from fa4_final import UnsupportedError, flash_attn_func, flash_attn_varlen_func
from fa4_final.api import sdpa
from fa4_final.runtime import dispatch, prologue, varlen
from tests import fa4_cpu_reference as ref
from tests.hopper_recorder import record_hopper_runs
from tests.test_pending_features import BF16, DEVICE, GATE, dense, packed


def refused_calls(q, k, v, pq, pk, pv, cu_q, cu_k):
    """Yields (func, call, message) for flash_attn_func(q, k, v), then flash_attn_varlen_func
    on the packed inputs, once call() has raised UnsupportedError with that message."""
    for func, call in (("flash_attn_func", lambda: flash_attn_func(q, k, v)),
                       ("flash_attn_varlen_func", lambda: flash_attn_varlen_func(
                           pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))):
        with pytest.raises(UnsupportedError) as info:
            call()
        yield func, call, str(info.value)


def refused_backward_calls(q, k, v, out, lse, pq, pk, pv, pout, plse, cu_q, cu_k):
    """Yields (func, message) for prologue.backward_into, sdpa._flash_attn_bwd (dense: q, k, v,
    out, lse) and varlen.varlen_backward_into (packed: pq, pk, pv, pout, plse), once each has
    raised UnsupportedError with that message (out and pout serve as dout too)."""
    calls = (
        ("backward_into", lambda: prologue.backward_into(
            q, k, v, out, lse, out, torch.zeros_like(q), torch.zeros_like(k),
            torch.zeros_like(v))),
        ("_flash_attn_bwd", lambda: sdpa._flash_attn_bwd(q, k, v, out, out, lse)),
        ("varlen_backward_into", lambda: varlen.varlen_backward_into(
            pq, pk, pv, pout, plse, pout, torch.zeros_like(pq), torch.zeros_like(pk),
            torch.zeros_like(pv), cu_q, cu_k, None, None, None)),
    )
    for func, call in calls:
        with pytest.raises(UnsupportedError) as info:
            call()
        yield func, str(info.value)


def assert_every_entry_reaches_the_device_check(d: int, dv: int) -> None:
    """flash_attn_func and flash_attn_varlen_func with inputs requiring grad at (d, dv), then the
    backward entry points (prologue.backward_into, api.sdpa._flash_attn_bwd,
    varlen.varlen_backward_into): each gets past every check to the device check (the inputs
    are CPU tensors), none meets the gate."""
    q, k, v = dense(d=d, dv=dv, grad=True)
    pq, pk, pv, cu_q, cu_k = packed(d=d, dv=dv, grad=True)
    for func, _, message in refused_calls(q, k, v, pq, pk, pv, cu_q, cu_k):
        assert DEVICE in message and GATE not in message, (func, message)
    q, k, v = dense(d=d, dv=dv)
    out, lse = torch.zeros(*q.shape[:-1], dv, dtype=BF16), torch.zeros(2, 4, 24)
    pq, pk, pv, cu_q, cu_k = packed(d=d, dv=dv)
    pout, plse = torch.zeros(pq.shape[0], 4, dv, dtype=BF16), torch.zeros(4, pq.shape[0])
    funcs = []
    for func, message in refused_backward_calls(q, k, v, out, lse, pq, pk, pv, pout, plse,
                                                cu_q, cu_k):
        assert DEVICE in message and GATE not in message, (func, message)
        funcs.append(func)
    assert funcs == ["backward_into", "_flash_attn_bwd", "varlen_backward_into"]


def float64_grads(q, k, v, causal):
    qf, kf, vf = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, _ = ref.attention_masked(qf, kf, vf, causal)
    out.square().sum().backward()
    return qf.grad, kf.grad, vf.grad


def check_autograd_against_float64(q, k, v, causal):
    """flash_attn_func(q, k, v) with a gradient, out.float().square().sum() backward: each
    gradient float64's (the CPU reference) within 0.05 of its largest + 0.05."""
    out, _ = flash_attn_func(q, k, v, causal=causal)
    out.float().square().sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), float64_grads(q, k, v, causal)):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max() <= 0.05 * want.abs().max() + 0.05


def check_varlen_autograd_against_float64(d, dv, causal):
    """flash_attn_varlen_func with a gradient at (d, dv) over three sequences (5 x 9, 7 queries
    and no key, 19 x 30), out.float().square().sum() backward: each sequence's gradients
    float64's (the CPU reference on that sequence alone) within 0.05 of their largest + 0.05,
    dq 0 for the queries that see no key."""
    lens_q, lens_k = (5, 7, 19), (9, 0, 30)
    pq, pk, pv, cu_q, cu_k = packed(lens_q=lens_q, lens_k=lens_k, d=d, dv=dv, grad=True)
    out, _ = flash_attn_varlen_func(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    causal=causal)
    assert out.shape == (sum(lens_q), 4, dv)
    out.float().square().sum().backward()
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i, sk in enumerate(lens_k):
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if not sk:
            assert not pq.grad[rq].float().abs().max()
            continue
        want = float64_grads(pq[None, rq], pk[None, rk], pv[None, rk], causal)
        for got, w in zip((pq.grad[rq], pk.grad[rk], pv.grad[rk]), want):
            assert got.shape == w.shape[1:]
            assert (got.double() - w[0]).abs().max() <= 0.05 * w.abs().max() + 0.05


def probe_dq_writes(main, mmas, got) -> None:
    """Fills got["read"] (bwd_post's reading: dq_coords, dq_copy over dq_chunk_layout) and
    got["write"] (each writer part's (row, col) and slab offset per register, from the dQ MMA
    that mmas() returns third and dq_copy over dq_part_view), traced for sm_90a."""
    import cutlass.cute as cute

    def collect():
        slab = cute.make_identity_tensor(cute.product(main.dq_chunk_layout().shape))
        slab = cute.make_tensor(slab.iterator, main.dq_chunk_layout())
        _, _, mma_dq = mmas()
        for t in range(main.dq_threads):
            c = main.dq_coords(t)
            p = main.dq_copy().get_slice(t).partition_D(slab)
            got["read"][t] = [(tuple(int(x) for x in c[i]), int(p[i]))
                              for i in range(cute.size(c))]
        for part in (0, 1):
            first, _ = main.dq_part(part)
            tile = cute.make_identity_tensor(main.dq_tile_shape(part))
            for t in range(128):
                c = mma_dq.get_slice(t).partition_C(tile)
                p = main.dq_copy().get_slice(t).partition_D(main.dq_part_view(slab, part))
                got["write"][part, t] = [((first + int(c[i][0]), int(c[i][1])), int(p[i]))
                                         for i in range(cute.size(c))]

    @cute.jit
    def probe():
        collect()

    cute.compile(probe, options="--gpu-arch sm_90a")


def backward_runner_keys(monkeypatch, d, dv=None, varlen_out_is_q=False):
    """Runs the Hopper backward runners (dense, then varlen) at (d, dv) with the launches
    recorded: checks the calls are compiled, launch_backward, compiled, launch_varlen_backward;
    returns (the recorded calls, runners, the two compile keys). The varlen out and dout are q
    itself when varlen_out_is_q, else zeros."""
    calls = record_hopper_runs(monkeypatch)
    runners = dispatch.runners(dispatch.HOPPER.host, dispatch.HOPPER.features)
    q, k, v = dense(d=d, dv=dv)
    out, lse = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=BF16), torch.zeros(2, 4, 24)
    grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    runners["backward"](q, k, v, out, lse, out, *grads, True, 0.1, None, 0)
    pq, pk, pv, cu_q, cu_k = packed(d=d, dv=dv)
    pout = (pq if varlen_out_is_q
            else torch.zeros(pq.shape[0], 4, pv.shape[-1], dtype=BF16))
    pgrads = torch.zeros_like(pq), torch.zeros_like(pk), torch.zeros_like(pv)
    runners["varlen_backward"](pq, pk, pv, pout, torch.zeros(4, pq.shape[0]), pout, *pgrads,
                               cu_q, cu_k, None, 19, 9, False, 0.1, None, None)
    keys = [c[2] for c in calls if c[0] == "compiled"]
    assert [c[0] for c in calls] == ["compiled", "launch_backward", "compiled",
                                     "launch_varlen_backward"]
    return calls, runners, keys


def serialised(art) -> int:
    """wgmma the compiler serialised: WARPGROUP.ARRIVE in the SASS beyond the PTX's fences."""
    return art.count("WARPGROUP.ARRIVE", where="sass") - art.count("wgmma.fence.sync.aligned")


def clean_build(recipe) -> dict:
    """artifacts(recipe) (compiled for sm_90a), checked: no spill and no stack in any kernel,
    no wgmma serialised in the main kernel."""
    from fa4_final.runtime.compile import artifacts

    arts = artifacts(recipe)
    for art in arts.values():
        assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    assert serialised(arts["main"]) == 0
    return arts


def clean_main(recipe):
    """clean_build's main kernel, also with the setmaxnreg plan of the other builds (24 / 240),
    bulk adds of dQ and stmatrix."""
    main = clean_build(recipe)["main"]
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+240;", main.ptx)
    assert re.search(r"setmaxnreg.dec.sync.aligned.u32\s+24;", main.ptx)
    main.require("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", "stmatrix")
    return main
