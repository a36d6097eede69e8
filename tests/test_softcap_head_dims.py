"""The softcap_head_dims row of fa4_final.runtime.pending (Note [Pending features]) on a CPU:
FA4's softcap at head dims other than 64 and 128 (D = 96, 192, 256, dv != D) in the varlen
kernels is refused by the row's name from every varlen entry, forward and backward, unless
FA4_FINAL_PENDING lists it; listed, the call gets past every check to the device check (the
inputs are CPU tensors). The dense entries take it ungated (their GPU tests passed on an H100:
tests/gpu/test_softcap_head_dims.py, results/h100/gpu_checks.json); a softcap at 64 and 128,
and any call without a softcap, never asks the row. What lifts it: the varlen test of
tests/gpu/test_softcap_head_dims.py on an H100/H200."""

from __future__ import annotations

import pytest
import torch

from fa4_final import UnsupportedError, flash_attn_func, flash_attn_varlen_func
from fa4_final.api import sdpa
from fa4_final.runtime import pending, prologue, varlen
from tests.test_pending_features import BF16, DEVICE, GATE, dense, packed

pytestmark = pytest.mark.usefixtures("no_pending")

ROW = "softcap_head_dims"
CAP = 30.0
GATED = [(96, 96), (192, 128), (192, 192), (256, 256), (128, 64)]
DEFAULT = [(64, 64), (128, 128)]


VARLEN = ("flash_attn_varlen_func", "varlen_forward_into", "varlen_backward_into")


def _entries(d: int, dv: int, softcap: float):
    """(name, call) of every entry with a softcap at (d, dv); the backward entries only where
    the backward is built (runtime.pending.BACKWARD_HEAD_DIMS)."""
    q, k, v = dense(d=d, dv=dv)
    pq, pk, pv, cu_q, cu_k = packed(d=d, dv=dv)
    out, lse = torch.zeros(*q.shape[:-1], dv, dtype=BF16), torch.zeros(2, 4, 24)
    pout, plse = torch.zeros(pq.shape[0], 4, dv, dtype=BF16), torch.zeros(4, pq.shape[0])
    kw = {"softcap": softcap}
    yield "flash_attn_func", lambda: flash_attn_func(q, k, v, **kw)
    yield "flash_attn_varlen_func", lambda: flash_attn_varlen_func(
        pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    yield "_flash_attn_fwd", lambda: sdpa._flash_attn_fwd(q, k, v, **kw)
    yield "forward_into", lambda: prologue.forward_into(q, k, v, out, lse, **kw)
    yield "varlen_forward_into", lambda: varlen.varlen_forward_into(
        pq, pk, pv, cu_q, cu_k, None, None, None, pout, plse, **kw)
    if (d, dv) in pending.BACKWARD_HEAD_DIMS:
        yield "backward_into", lambda: prologue.backward_into(
            q, k, v, out, lse, out, torch.zeros_like(q), torch.zeros_like(k),
            torch.zeros_like(v), **kw)
        yield "varlen_backward_into", lambda: varlen.varlen_backward_into(
            pq, pk, pv, pout, plse, pout, torch.zeros_like(pq), torch.zeros_like(pk),
            torch.zeros_like(pv), cu_q, cu_k, None, None, None, **kw)
        yield "_flash_attn_bwd", lambda: sdpa._flash_attn_bwd(q, k, v, out, out, lse, **kw)


def _message(call) -> str:
    with pytest.raises(UnsupportedError) as info:
        call()
    return str(info.value)


def test_softcap_head_dims_is_a_pending_row():
    assert ROW in pending.PENDING and not pending.listed(ROW)


@pytest.mark.parametrize("d, dv", GATED)
def test_a_softcap_at_other_head_dims_is_refused_by_name_in_the_varlen_entries(d, dv):
    names = []
    for name, call in _entries(d, dv, CAP):
        message = _message(call)
        if name in VARLEN:
            assert ROW in message and GATE in message and f"softcap={CAP}" in message and (
                f"head_dim={d}, dv={dv}" in message), (name, message)
            names.append(name)
        else:  # the dense kernels' softcap at these head dims passed on a GPU
            assert DEVICE in message and GATE not in message, (name, message)
    assert names == list(VARLEN if (d, dv) in pending.BACKWARD_HEAD_DIMS else VARLEN[:2])


@pytest.mark.parametrize("d, dv", GATED)
def test_listed_it_reaches_the_device_check(monkeypatch, d, dv):
    monkeypatch.setenv(pending.ENV, ROW)
    for name, call in _entries(d, dv, CAP):
        message = _message(call)
        assert DEVICE in message and GATE not in message, (name, message)


@pytest.mark.parametrize("d, dv", DEFAULT)
def test_a_softcap_at_64_and_128_never_asks_the_row(d, dv):
    for name, call in _entries(d, dv, CAP):
        message = _message(call)
        assert DEVICE in message and ROW not in message, (name, message)


@pytest.mark.parametrize("d, dv", GATED)
def test_no_softcap_never_asks_the_row(d, dv):
    for name, call in _entries(d, dv, 0.0):
        message = _message(call)
        assert DEVICE in message and ROW not in message, (name, message)
