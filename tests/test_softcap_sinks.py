"""FA4's softcap and learnable sink on the CPU: the float64 reference, its backward formulas
against torch.autograd (the sink's gradient included), and the host-side checks.

utils.reference.attention_reference_features is the yardstick of the GPU tests
(tests/gpu/test_softcap_sinks.py); attention_backward_features holds the formulas a
FlashAttention backward computes from (out, lse) (dS times 1 - tanh^2 for the softcap, dsink =
-sum exp(sink - lse) (delta - dlse)), checked here against autograd in float64. The API keeps
refusing both features until the GPU tests have passed; the last test holds it to that.
"""

from __future__ import annotations

import math

import pytest
import torch

from fa4_final.runtime.checks import check_learnable_sink, check_softcap
from utils.reference import (
    attention_backward_features,
    attention_reference,
    attention_reference_features,
    causal_mask,
    random_qkv,
)

F64 = torch.float64
# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal): GQA, rows that see no key
# (causal, seqlen_q > seqlen_k), tails of no tile size, one key
SHAPES = [
    (1, 7, 13, 2, 1, 8, True),
    (2, 19, 5, 4, 2, 16, True),  # 14 rows see no key
    (1, 9, 1, 2, 2, 8, False),
    (2, 11, 17, 3, 3, 8, False),
]


def _inputs(shape, seed, spread=2.0, grad=False):
    b, sq, sk, h, hk, d, causal = shape
    q, k, v, _ = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=F64, seed=seed,
                            scale=spread)
    g = torch.Generator().manual_seed(seed + 1)
    sink = torch.randn(h, generator=g, dtype=F64) * 2
    if grad:
        for t in (q, k, v, sink):
            t.requires_grad_(True)
    return q, k, v, causal, sink


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_without_features_it_is_the_plain_reference(shape):
    q, k, v, causal, _ = _inputs(shape, 1)
    out, lse = attention_reference_features(q, k, v, causal)
    ref_out, ref_lse = attention_reference(q, k, v, causal)
    assert torch.allclose(out, ref_out, atol=1e-13, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-13, rtol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_features_by_plain_formulas(shape):
    """Softcap: softmax of c tanh(scale q.k / c); sink: a softmax over one more column whose
    value is zero. Written row by row with torch.softmax, independent of the reference."""
    q, k, v, causal, sink = _inputs(shape, 2, spread=4.0)
    b, sq, sk, h, hk, d, _ = shape
    scale, c = 0.3, 2.5
    out, lse = attention_reference_features(q, k, v, causal, scale, c, sink)
    visible = causal_mask(sq, sk) if causal else torch.ones(sq, sk, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            kh, vh = k[bi, :, hi // (h // hk)], v[bi, :, hi // (h // hk)]
            for i in range(sq):
                logits = c * torch.tanh(scale * (kh @ q[bi, i, hi]) / c)
                logits = torch.cat([logits[visible[i]], sink[hi].view(1)])
                p = torch.softmax(logits, dim=0)
                want = p[:-1] @ vh[visible[i]]
                assert torch.allclose(out[bi, i, hi], want, atol=1e-13, rtol=0)
                assert math.isclose(float(lse[bi, hi, i]), float(torch.logsumexp(logits, 0)),
                                    abs_tol=1e-12)
                assert bool((logits[:-1].abs() <= c).all())  # tanh rounds to 1 far out
    empty = ~visible.any(dim=1)
    assert bool((out[:, empty] == 0).all())
    assert torch.equal(lse[:, :, empty], sink.view(1, h, 1).expand(b, h, int(empty.sum())))


def test_reference_gradients_pass_gradcheck():
    """autograd through the reference equals finite differences (q, k, v and the sink)."""
    q, k, v, causal, sink = _inputs((1, 5, 6, 2, 1, 4, True), 3, grad=True)

    def f(q, k, v, sink):
        out, lse = attention_reference_features(q, k, v, causal, 0.5, 3.0, sink)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, sink), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("softcap", [0.0, 4.0])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_backward_formulas_match_autograd(shape, softcap, with_dlse):
    """dq, dk, dv and dsink from (out, lse) by the kernel's formulas equal torch.autograd's
    gradients of the float64 reference, with and without an upstream gradient of lse."""
    q, k, v, causal, sink = _inputs(shape, 4, spread=3.0, grad=True)
    out, lse = attention_reference_features(q, k, v, causal, None, softcap, sink)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(out.shape, generator=g, dtype=F64)
    dlse = torch.randn(lse.shape, generator=g, dtype=F64) if with_dlse else None
    loss = (out * dout).sum() + ((lse * dlse).sum() if with_dlse else 0.0)
    want = torch.autograd.grad(loss, (q, k, v, sink))
    got = attention_backward_features(q.detach(), k.detach(), v.detach(), out.detach(), dout,
                                      lse.detach(), causal, None, softcap, sink.detach(),
                                      dlse=dlse)
    for name, a, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert a.shape == w.shape, name
        assert torch.allclose(a, w, atol=1e-11, rtol=1e-9), (name, float((a - w).abs().max()))


def test_dsink_counts_a_row_without_keys_whole():
    """A row that sees no key holds all its mass in the sink: P_sink = 1, so its term of dsink
    is -delta (+ dlse), and its lse = sink moves one for one with the sink."""
    q, k, v, causal, sink = _inputs((1, 6, 2, 1, 1, 4, True), 6, grad=True)
    out, lse = attention_reference_features(q, k, v, causal, None, 0.0, sink)
    empty = ~causal_mask(6, 2).any(dim=1)
    assert int(empty.sum()) == 4
    (dsink,) = torch.autograd.grad(lse[0, 0, empty].sum(), (sink,))
    assert float(dsink) == pytest.approx(4.0)


def test_sink_gradient_on_a_hand_example():
    """One row, one key of score s, sink z: lse = log(e^s + e^z), out = e^(s - lse) v, so
    d out / d z = -P_sink out and d lse / d z = P_sink."""
    q = torch.tensor([[[[1.0]]]], dtype=F64)
    k = torch.tensor([[[[0.7]]]], dtype=F64)
    v = torch.tensor([[[[2.0]]]], dtype=F64)
    z = torch.tensor([0.4], dtype=F64, requires_grad=True)
    out, lse = attention_reference_features(q, k, v, False, 1.0, 0.0, z)
    p_sink = math.exp(0.4) / (math.exp(0.7) + math.exp(0.4))
    (d_out,) = torch.autograd.grad(out.sum(), (z,), retain_graph=True)
    (d_lse,) = torch.autograd.grad(lse.sum(), (z,))
    assert float(d_out) == pytest.approx(-p_sink * out.item())
    assert float(d_lse) == pytest.approx(p_sink)


# ----------------------------------------------------------------------------------------------
# host-side checks (fa4_final.runtime.checks), ready for the API


def test_check_softcap_accepts_fa4s_values():
    assert check_softcap(None) == 0.0 and check_softcap(0.0) == 0.0 and check_softcap(0) == 0.0
    assert check_softcap(30) == 30.0 and check_softcap(50.0) == 50.0


@pytest.mark.parametrize("bad, error, says", [
    (-1.0, ValueError, "got -1.0"), (float("nan"), ValueError, "got nan"),
    (float("inf"), ValueError, "got inf"), (True, TypeError, "got True"),
    ("30", TypeError, "got '30'"), (torch.tensor(30.0), TypeError, "Tensor"),
])
def test_check_softcap_refuses_and_names_the_value(bad, error, says):
    with pytest.raises(error, match="softcap must be") as info:
        check_softcap(bad)
    assert says in str(info.value)


def test_check_learnable_sink():
    check_learnable_sink(None, 4, "cpu")
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        check_learnable_sink(torch.zeros(4, dtype=dt), 4, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"shape \(4,\).*got shape \(2,\)"):
        check_learnable_sink(torch.zeros(2), 4, "cpu")
    with pytest.raises(ValueError, match=r"got shape \(1, 4\)"):
        check_learnable_sink(torch.zeros(1, 4), 4, "cpu")
    with pytest.raises(TypeError, match="torch.float64; accepted: torch.float32"):
        check_learnable_sink(torch.zeros(4, dtype=F64), 4, "cpu")
    with pytest.raises(TypeError, match="got list"):
        check_learnable_sink([0.0] * 4, 4, "cpu")
    with pytest.raises(ValueError, match="q's device cuda"):
        check_learnable_sink(torch.zeros(4), 4, torch.device("cuda"))


def test_the_api_takes_both_without_the_gate(monkeypatch):
    """tests/gpu/test_softcap_sinks.py and test_softcap_sinks_api.py passed on an H100
    (results/h100/gpu_checks.json): a user's call reaches the device code without
    FA4_FINAL_PENDING (on a CPU it stops at the device check, not at the gate)."""
    from fa4_final.api.interface import flash_attn_func, flash_attn_varlen_func
    from fa4_final.common.errors import UnsupportedError
    from fa4_final.runtime import pending

    monkeypatch.delenv(pending.ENV, raising=False)
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for call in (lambda: flash_attn_func(q, q, q, softcap=30.0),
                 lambda: flash_attn_func(q, q, q, learnable_sink=torch.zeros(2)),
                 lambda: flash_attn_varlen_func(q[0], q[0], q[0], cu_seqlens_q=cu,
                                                cu_seqlens_k=cu, softcap=1.0)):
        with pytest.raises(UnsupportedError, match="runs on CUDA GPUs"):
            call()


@pytest.mark.parametrize("varlen", [False, True])
def test_sink_gradient_of_the_package_equals_the_formula(varlen):
    """fa4_final.common.backward.sink_gradient (torch ops beside the kernels, float32) against
    the float64 formula, dense and in varlen's (h, total_q) layout, with dlse; a -inf sink on
    an empty row counts its probability as 1 (FA4's dsink_row_term)."""
    from fa4_final.common.backward import sink_gradient

    q, k, v, causal, sink = _inputs((2, 19, 5, 4, 2, 16, True), 8)
    out, lse = attention_reference_features(q, k, v, causal, None, 3.0, sink)
    g = torch.Generator().manual_seed(9)
    dout = torch.randn(out.shape, generator=g, dtype=F64)
    dlse = torch.randn(lse.shape, generator=g, dtype=F64)
    want = attention_backward_features(q, k, v, out, dout, lse, causal, None, 3.0, sink,
                                       dlse=dlse)[3]
    args = (lse.float(), out.float(), dout.float(), dlse.float())
    if varlen:  # (b, h, s) -> (h, b * s); (b, s, h, D) -> (b * s, h, D)
        args = (args[0].permute(1, 0, 2).reshape(4, -1), args[1].reshape(-1, 4, 16),
                args[2].reshape(-1, 4, 16), args[3].permute(1, 0, 2).reshape(4, -1))
    got = sink_gradient(sink.float(), *args)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    lse_empty = torch.full((1, 1, 3), -math.inf)
    ones = torch.ones(1, 3, 1, 2)
    assert float(sink_gradient(torch.tensor([-math.inf]), lse_empty, ones, ones)) == -6.0
