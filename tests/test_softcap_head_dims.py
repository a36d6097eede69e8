"""FA4's softcap at head dims other than 64 and 128 (D = 96, 192, 256, dv != D) on a CPU: no
row of fa4_final.runtime.pending (Note [Pending features]) gates it any more (the dense and the
varlen forward and autograd backward passed against float64 on an H100:
tests/gpu/test_softcap_head_dims.py, results/h100/gpu_checks.json), so every entry, forward
and backward (where the backward is built), dense and varlen, takes it to the device check (the
inputs are CPU tensors), as it takes a softcap at 64 and 128 and a call without one."""

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
OTHER = [(96, 96), (192, 128), (192, 192), (256, 256), (128, 64)]
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


def test_softcap_head_dims_left_the_table():
    assert ROW not in pending.PENDING and pending.listed(ROW)


@pytest.mark.parametrize("d, dv", OTHER + DEFAULT)
@pytest.mark.parametrize("softcap", [CAP, 0.0])
def test_every_entry_takes_a_softcap_at_every_head_dim_to_the_device_check(d, dv, softcap):
    names = []
    for name, call in _entries(d, dv, softcap):
        message = _message(call)
        assert DEVICE in message and GATE not in message and ROW not in message, (name, message)
        names.append(name)
    assert set(VARLEN[:2]) <= set(names)
