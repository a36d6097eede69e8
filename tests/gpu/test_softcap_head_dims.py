"""FA4's softcap at head dims other than 64 and 128 through fa4_final's public API on an
H100/H200: the forward (out and lse) and the autograd backward (dq, dk, dv, and dsink with a
learnable sink) against float64, at D = dv = 96, 192, 256, at D = 192 with dv = 128, and the
forward alone at D = 128 with dv = 64 (no backward is built there); dense (flash_attn_func) and
varlen (flash_attn_varlen_func, packed sequences checked one by one). Their passing on an H100
is what lifted the softcap_head_dims row of fa4_final.runtime.pending (no gate now).
The rule and the helpers are tests/gpu/test_softcap_sinks.py's and test_softcap_sinks_api.py's
(max error <= 2 x PyTorch's own in the input dtype + rounding slack; lse within the softcap's
tanh.approx allowance). Inputs are fresh random tensors (the seed is in each failure's line).
About three minutes, most of it compiling:
    timeout 580 python -m pytest -q -m gpu -p no:cacheprovider -rA \
        tests/gpu/test_softcap_head_dims.py
"""

from __future__ import annotations

import pytest
import torch

from fa4_final.runtime import pending
from tests.gpu.test_softcap_sinks import BF16, FP16, FP32, _check_forward
from tests.gpu.test_softcap_sinks_api import (
    SPREAD,
    autograd_against_float64,
    check_varlen_forward_and_autograd,
)
from utils import checks
from utils.hardware import missing
from utils.reference import random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]

# (batch, seqlen_q, seqlen_k, heads, heads_kv, D, dv, causal, dtype), softcap, sink dtype
CASES = [
    ((2, 257, 300, 4, 2, 96, 96, True, BF16), 30.0, FP32),
    ((1, 300, 513, 4, 2, 192, 128, False, BF16), 5.0, None),
    ((1, 257, 129, 2, 2, 192, 192, True, FP16), 50.0, BF16),  # rows that see no key
    ((2, 129, 257, 4, 2, 256, 256, False, BF16), 50.0, None),  # Gemma 2's head dim and cap
    ((1, 200, 333, 2, 1, 128, 64, True, BF16), 30.0, FP32),  # forward only
]


def _ids(case):
    (b, sq, sk, h, hk, d, dv, causal, dt), cap, sink = case
    return (f"d{d}v{dv}-b{b}-{sq}x{sk}-h{h}/{hk}-{'causal' if causal else 'dense'}-"
            f"{str(dt).replace('torch.', '')}-cap{cap:g}-sink_{str(sink).replace('torch.', '')}")


def _inputs(case, requires_grad):
    (b, sq, sk, h, hk, d, dv, causal, dtype), _, sink_dtype = case
    q, k, _, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype,
                               device="cuda", scale=SPREAD)
    v = random_qkv(b, sq, h, dv, seqlen_k=sk, heads_kv=hk, dtype=dtype, device="cuda",
                   seed=seed + 1, scale=SPREAD)[2]
    sink = None
    if sink_dtype is not None:
        g = torch.Generator().manual_seed(seed)
        sink = (torch.randn(h, generator=g) * 2 + 1).to("cuda", sink_dtype)
    leaves = [t for t in (q, k, v, sink) if t is not None]
    for t in leaves if requires_grad else ():
        t.requires_grad_(True)
    return q, k, v, sink, leaves, seed


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_with_a_softcap_matches_float64(case):
    from fa4_final import flash_attn_func

    (_, _, _, _, _, _, _, causal, _), softcap, _ = case
    q, k, v, sink, _, seed = _inputs(case, requires_grad=False)
    out, lse = flash_attn_func(q, k, v, causal=causal, softcap=softcap, learnable_sink=sink,
                               return_lse=True)
    label = f"{_ids(case)} seed={seed}"
    checks.wait_for_gpu(label)
    assert out.shape == (*q.shape[:-1], v.shape[-1])
    _check_forward(label, q, k, v, sink, causal, softcap, out, lse)


@pytest.mark.parametrize("case", [c for c in CASES
                                  if (c[0][5], c[0][6]) in pending.BACKWARD_HEAD_DIMS], ids=_ids)
def test_autograd_with_a_softcap_matches_float64(case):
    """loss = sum(out * dout): dq, dk, dv (and dsink) through the custom op's autograd against
    float64 autograd (test_softcap_sinks_api's check, with dv)."""
    (b, sq, sk, h, hk, d, dv, causal, dtype), softcap, _ = case
    q, k, v, sink, _, seed = _inputs(case, requires_grad=True)
    g = torch.Generator().manual_seed(seed + 2)
    dout = torch.randn(b, sq, h, dv, generator=g).to("cuda", dtype)
    autograd_against_float64(f"{_ids(case)} seed={seed}", q, k, v, sink, causal, softcap, dout)


@pytest.mark.parametrize("d, dv, softcap, sink_dtype", [
    (96, 96, 30.0, FP32), (192, 128, 5.0, None), (192, 192, 50.0, BF16), (256, 256, 50.0, None),
    (128, 64, 30.0, FP32)], ids=lambda x: str(x).replace("torch.", ""))
def test_varlen_with_a_softcap_matches_float64(d, dv, softcap, sink_dtype):
    """flash_attn_varlen_func with a softcap: out and lse per sequence, then the gradients
    (where the backward is built) against float64 (test_softcap_sinks_api's varlen check)."""
    check_varlen_forward_and_autograd(softcap, sink_dtype, d, dv,
                                      backward=(d, dv) in pending.BACKWARD_HEAD_DIMS)
