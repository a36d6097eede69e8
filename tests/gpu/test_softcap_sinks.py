"""FA4's softcap and learnable sink in fa4_final's Hopper kernels, on an H100/H200, against
float64 (utils.reference.attention_reference_features and torch.autograd through it).

The kernels are reached through fa4_final.hopper.host (forward_recipe / backward_recipe with
softcap and sink_dtype, launch_forward / launch_varlen_forward / launch_backward) because the
API still refuses both features: these tests are what lifts that refusal. Outputs are filled
with NaN first. The rule is the course's (utils.checks.tolerance_check): max error <= 2 x
PyTorch's own error in the input dtype + rounding slack, where PyTorch's own is the same math
with the scores from a 16-bit matmul, the softmax in float32 and P rounded to 16 bits. lse
is also held within LSE_ATOL of float64, widened by the tanh.approx error of a softcap build
(about softcap * 2^-11: Note [Softcap]). Rows that see no key: out = 0 and lse = the sink.
Run (about 10 minutes, most of it compiling ~14 kernels):
    timeout 1200 python -m pytest tests/gpu/test_softcap_sinks.py -m gpu -x -v
"""

from __future__ import annotations

import pytest
import torch

from utils import checks
from utils.hardware import missing
from utils.reference import attention_reference_features, causal_mask, random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAMES = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}

# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype), softcap, sink dtype (None:
# no sink): one row, tails of every tile, rows that see no key (seqlen_q > seqlen_k, causal),
# GQA and MQA, both 16-bit dtypes, all three sink dtypes
CASES = [
    ((1, 1, 1, 1, 1, 128, False, BF16), 5.0, FP32),
    ((2, 17, 17, 2, 1, 64, True, FP16), 5.0, FP16),
    ((1, 1000, 100, 2, 2, 128, True, BF16), 0.0, FP32),
    ((1, 1000, 100, 2, 2, 128, True, BF16), 5.0, BF16),
    ((3, 257, 513, 8, 2, 128, False, BF16), 30.0, FP32),
    ((3, 257, 513, 8, 2, 128, False, BF16), 5.0, None),
    ((2, 300, 77, 6, 1, 64, True, BF16), 5.0, FP32),
    ((1, 1000, 1000, 2, 1, 64, False, BF16), 0.0, BF16),
    ((1, 4097, 4097, 1, 1, 128, True, FP16), 50.0, FP32),
    ((1, 129, 129, 4, 4, 128, True, BF16), 5.0, None),
]
SPREAD = 2.0  # inputs ~ N(0, 4): scale * q.k has a std of about 4, so a cap of 5 bends it


def _ids(case):
    (b, sq, sk, h, hk, d, causal, dt), cap, sink = case
    return (f"b{b}-{sq}x{sk}-h{h}/{hk}-d{d}-{'causal' if causal else 'dense'}-{NAMES[dt]}"
            f"-cap{cap:g}-sink_{NAMES.get(sink, 'none')}")


def _inputs(shape, sink_dtype, requires_grad=False):
    b, sq, sk, h, hk, d, causal, dtype = shape
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype,
                               device="cuda", scale=SPREAD)
    sink = None
    if sink_dtype is not None:
        g = torch.Generator().manual_seed(seed)
        sink = (torch.randn(h, generator=g) * 2 + 1).to("cuda", sink_dtype)
    if requires_grad:
        for t in (q, k, v, sink):
            if t is not None:
                t.requires_grad_(True)
    return q, k, v, sink, seed


def _same_precision(q, k, v, causal, scale, softcap, sink):
    """What PyTorch computes in the inputs' dtype: S from a 16-bit matmul, the cap and the
    softmax (with the sink's column) in float32, P rounded to 16 bits for P V. Differentiable."""
    dtype = q.dtype
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if hk != h:
        kt, vt = (t.repeat_interleave(h // hk, dim=1) for t in (kt, vt))
    s = torch.matmul(qt, kt.transpose(-1, -2)).float() * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(~causal_mask(sq, sk, s.device), float("-inf"))
    cols = s
    if sink is not None:
        cols = torch.cat([s, sink.float().view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
    lse = torch.logsumexp(cols, dim=-1)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe[..., None]).to(dtype)
    return torch.matmul(p, vt).transpose(1, 2), lse


def _lse_atol(softcap):
    return max(checks.LSE_ATOL, 2 * softcap * 2.0 ** -11)


def _plan_fwd(shape, softcap, sink_dtype, varlen=False):
    from fa4_final.hopper.host import forward_recipe
    from fa4_final.runtime.compile import compiled

    _, _, _, _, _, d, causal, dtype = shape
    return compiled(forward_recipe, d, NAMES[dtype], causal, None, False, False, varlen,
                    False, "sm_90a", softcap, NAMES.get(sink_dtype))


def _check_forward(label, q, k, v, sink, causal, softcap, out, lse):
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = attention_reference_features(q, k, v, causal, scale, softcap, sink)
    same_out, same_lse = _same_precision(q, k, v, causal, scale, softcap, sink)
    on_out = checks.tolerance_check(out, ref_out, same_out, "out")
    on_lse = checks.tolerance_check(lse, ref_lse, same_lse, "lse", extra_atol=_lse_atol(softcap))
    lse_err = float((lse.double() - ref_lse).abs().nan_to_num(0.0).max())
    b, sq, h, _ = q.shape
    empty = ~causal_mask(sq, k.shape[1], q.device).any(dim=1) if causal else \
        torch.zeros(sq, dtype=torch.bool, device=q.device)
    empty_ok = bool((out[:, empty] == 0).all())
    if sink is not None and bool(empty.any()):
        want = sink.float().view(1, h, 1).expand(b, h, int(empty.sum()))
        empty_ok &= torch.allclose(lse[:, :, empty], want, rtol=1e-6, atol=1e-6)
    ok = on_out.passed and on_lse.passed and lse_err <= _lse_atol(softcap) and empty_ok
    assert ok, (f"{label}\n{on_out}\n{on_lse}\nlse err {lse_err:.2e} (atol "
                f"{_lse_atol(softcap):.1e}); empty rows 0 / sink: {empty_ok}")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_matches_float64(case):
    from fa4_final.hopper.host import launch_forward

    shape, softcap, sink_dtype = case
    b, sq, sk, h, hk, d, causal, dtype = shape
    q, k, v, sink, seed = _inputs(shape, sink_dtype)
    out = checks.poisoned_empty(b, sq, h, d, dtype=dtype, device="cuda")
    lse = checks.poisoned_empty(b, h, sq, dtype=FP32, device="cuda")
    plan = _plan_fwd(shape, softcap, sink_dtype)
    launch_forward(plan, q, k, v, out, lse, causal, d ** -0.5, None, 0 if causal else None,
                   sink)
    label = f"{_ids(case)} seed={seed}"
    checks.wait_for_gpu(label)
    _check_forward(label, q, k, v, sink, causal, softcap, out, lse)


def test_varlen_forward_matches_float64_per_sequence():
    """Packed sequences of 37, 300 and 1 queries over 300, 77 and 5 keys (causal: the middle
    one has rows that see no key), softcap 5 and an fp32 sink, checked sequence by sequence."""
    from fa4_final.hopper.host import launch_varlen_forward

    lens_q, lens_k, h, hk, d = [37, 300, 1], [300, 77, 5], 4, 2, 128
    shape = (1, 0, 0, h, hk, d, True, BF16)
    plan = _plan_fwd(shape, 5.0, FP32, varlen=True)
    qs, ks, vs = [], [], []
    for sq, sk in zip(lens_q, lens_k):
        q, k, v, _ = random_qkv(1, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=BF16,
                                device="cuda", scale=SPREAD)
        qs.append(q[0]), ks.append(k[0]), vs.append(v[0])
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    sink = torch.tensor([-1.0, 0.5, 2.0, 3.5], device="cuda")
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)),  # noqa: E731
                                   dtype=torch.int32, device="cuda")
    out = checks.poisoned_empty(q.shape[0], h, d, dtype=BF16, device="cuda")
    lse = checks.poisoned_empty(h, q.shape[0], dtype=FP32, device="cuda")
    launch_varlen_forward(plan, q, k, v, cu(lens_q), cu(lens_k), None, max(lens_q),
                          max(lens_k), out, lse, True, d ** -0.5, None, 0, sink)
    checks.wait_for_gpu("varlen softcap + sink")
    oq = ok_ = 0
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        _check_forward(f"varlen sequence {i} ({sq} x {sk})", q[None, oq:oq + sq],
                       k[None, ok_:ok_ + sk], v[None, ok_:ok_ + sk], sink, True, 5.0,
                       out[None, oq:oq + sq], lse[None, :, oq:oq + sq])
        oq, ok_ = oq + sq, ok_ + sk


BWD_CASES = [
    ((2, 17, 17, 2, 1, 64, True, FP16), 5.0, FP32),
    ((1, 300, 77, 2, 2, 128, True, BF16), 5.0, BF16),  # rows that see no key
    ((2, 257, 513, 4, 2, 128, False, BF16), 30.0, FP32),  # GQA
    ((1, 1000, 1000, 2, 1, 64, False, BF16), 5.0, None),
    ((1, 129, 200, 2, 2, 128, True, BF16), 0.0, FP32),  # sink only: no backward kernel change
]


@pytest.mark.parametrize("case", BWD_CASES, ids=_ids)
def test_backward_matches_float64_autograd(case):
    """dq, dk, dv from the backward kernels (softcap build) and dsink from
    common.backward.sink_gradient, given the float64 forward's (out, lse) rounded as a forward
    stores them, against torch.autograd of the float64 reference."""
    from fa4_final.common.backward import sink_gradient
    from fa4_final.hopper.host import backward_recipe, launch_backward
    from fa4_final.runtime.compile import compiled

    shape, softcap, sink_dtype = case
    b, sq, sk, h, hk, d, causal, dtype = shape
    q, k, v, sink, seed = _inputs(shape, sink_dtype, requires_grad=True)
    scale = d ** -0.5
    leaves = [t for t in (q, k, v, sink) if t is not None]
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(b, sq, h, d, generator=g).to("cuda", dtype)

    # float64 leaves of their own: autograd returns a gradient in its leaf's dtype
    leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
    q64, k64, v64 = leaves64[:3]
    sink64 = leaves64[3] if sink is not None else None
    ref_out, ref_lse = attention_reference_features(q64, k64, v64, causal, scale, softcap,
                                                    sink64)
    want = torch.autograd.grad((ref_out * dout.double()).sum(), leaves64)
    same_out, _ = _same_precision(q, k, v, causal, scale, softcap, sink)
    same = torch.autograd.grad((same_out.float() * dout.float()).sum(), leaves)

    out, lse = ref_out.detach().to(dtype), ref_lse.detach().float()
    dq, dk, dv = (checks.poisoned_empty(*t.shape, dtype=dtype, device="cuda") for t in (q, k, v))
    plan = compiled(backward_recipe, d, NAMES[dtype], causal, None, False, False, False, False,
                    False, "sm_90a", softcap)
    launch_backward(plan, q.detach(), k.detach(), v.detach(), out, lse, dout, dq, dk, dv,
                    causal, scale, None, 0 if causal else None)
    got = [dq, dk, dv]
    extra = [0.0, 0.0, 0.0]
    if sink is not None:
        got.append(sink_gradient(sink.detach(), lse, out, dout))
        # dsink reads the stored, rounded O (as FA4's does): its limit gets that rounding step
        # carried through the formula (Note [Sink gradient step] in measure.conformance)
        step = (ref_out.detach() - out.double()).abs()
        rows = (dout.double().abs() * step).sum(-1).transpose(1, 2)  # like lse
        p_sink = torch.exp(sink64.detach().view(1, -1, 1) - ref_lse.detach())
        extra.append(float((p_sink * rows).sum(dim=(0, 2)).max()))
    label = f"{_ids(case)} seed={seed}"
    checks.wait_for_gpu(label)
    failed = []
    for name, value, ref, pt, ex in zip(("dq", "dk", "dv", "dsink"), got, want, same, extra):
        verdict = checks.tolerance_check(value, ref, pt, name, extra_atol=ex)
        if not verdict.passed:
            failed.append(str(verdict))
    assert not failed, f"{label}\n" + "\n".join(failed)
