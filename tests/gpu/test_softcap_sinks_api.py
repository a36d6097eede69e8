"""FA4's softcap and learnable sink through fa4_final's public API on an H100/H200: forward and
autograd backward (dq, dk, dv and d(learnable_sink)) against float64, dense and varlen, the
return_lse gradient with a sink, one torch.compile(fullgraph=True) call, and api.sdpa's
_flash_attn_fwd/_flash_attn_bwd with both (the backward returning dsink, as FA4).

Both features are pending (Note [Pending features] in fa4_final.runtime.pending): each test sets
FA4_FINAL_PENDING=softcap,learnable_sink for itself. These tests, with
tests/gpu/test_softcap_sinks.py (the kernels launched directly), are what lets the rows of
fa4_final.runtime.pending.PENDING be deleted. The rule is the course's (utils.checks
.tolerance_check: max error <= 2 x PyTorch's own in the input dtype + rounding slack); the
helpers are test_softcap_sinks.py's. Run (about 10 minutes, most of it compiling):
    timeout 1200 python -m pytest tests/gpu/test_softcap_sinks_api.py -m gpu -x -v
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_softcap_sinks import (
    BF16,
    FP16,
    FP32,
    NAMES,
    _check_forward,
    _inputs,
    _same_precision,
)
from utils import checks
from utils.hardware import missing
from utils.reference import attention_reference_features, random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]

SPREAD = 2.0


@pytest.fixture(autouse=True)
def pending_on(monkeypatch):
    monkeypatch.setenv("FA4_FINAL_PENDING", "softcap,learnable_sink")


def _ids(case):
    (b, sq, sk, h, hk, d, causal, dt), cap, sink = case
    return (f"b{b}-{sq}x{sk}-h{h}/{hk}-d{d}-{'causal' if causal else 'dense'}-{NAMES[dt]}"
            f"-cap{cap:g}-sink_{NAMES.get(sink, 'none')}")


FWD_CASES = [
    ((2, 17, 17, 2, 1, 64, True, FP16), 5.0, FP16),
    ((1, 1000, 100, 2, 2, 128, True, BF16), 5.0, BF16),  # rows that see no key: lse = sink
    ((3, 257, 513, 8, 2, 128, False, BF16), 30.0, FP32),
    ((1, 129, 129, 4, 4, 128, True, BF16), 5.0, None),
    ((1, 1000, 1000, 2, 1, 64, False, BF16), 0.0, FP32),
]


@pytest.mark.parametrize("case", FWD_CASES, ids=_ids)
def test_flash_attn_func_forward_matches_float64(case):
    from fa4_final import flash_attn_func

    shape, softcap, sink_dtype = case
    causal = shape[6]
    q, k, v, sink, seed = _inputs(shape, sink_dtype)
    out, lse = flash_attn_func(q, k, v, causal=causal, softcap=softcap, learnable_sink=sink,
                               return_lse=True)
    label = f"{_ids(case)} seed={seed}"
    checks.wait_for_gpu(label)
    _check_forward(label, q, k, v, sink, causal, softcap, out, lse)


def sink_step(out64, lse64, dout, sink, dtype, heads_dim: int = 2) -> float:
    """dsink's share of rounding the output (measure.conformance's Note [Sink gradient step]):
    d sink reads the stored, rounded O (as FA4's does), which PyTorch's float32 path never
    rounds. sum over a head's rows of exp(sink - lse) * sum_d |dO| |O - round(O)|, the largest
    head's. ``out64`` (..., h, d) float64, ``lse64`` with heads at ``heads_dim`` of out's
    order moved to lse's layout by the caller."""
    if sink is None:
        return 0.0
    step = (out64 - out64.to(dtype).double()).abs()
    rows = (dout.double().abs() * step).sum(-1)  # (b, sq, h) or (total_q, h)
    rows = rows.transpose(-1, -2)  # like lse: (b, h, sq) or (h, total_q)
    shape = [1] * lse64.dim()
    shape[-2] = sink.shape[0]
    p_sink = torch.exp(sink.detach().double().view(shape) - lse64).nan_to_num(1.0)
    per_head = (p_sink * rows).transpose(0, -2).reshape(sink.shape[0], -1).sum(1)
    return float(per_head.max())


def _grads_against_float64(label, got, leaves, ref_loss, same_loss, dsink_atol=0.0):
    names = ("dq", "dk", "dv", "dsink")
    leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
    want = torch.autograd.grad(ref_loss(*leaves64), leaves64)
    same = torch.autograd.grad(same_loss(*leaves), leaves)
    failed = [str(v) for v in (checks.tolerance_check(g, w, s, n,
                                                      extra_atol=dsink_atol if n == "dsink"
                                                      else 0.0)
                               for n, g, w, s in zip(names, got, want, same)) if not v.passed]
    assert not failed, f"{label}\n" + "\n".join(failed)


BWD_CASES = [
    ((2, 17, 17, 2, 1, 64, True, FP16), 5.0, FP32),
    ((1, 300, 77, 2, 2, 128, True, BF16), 5.0, BF16),  # rows that see no key
    ((2, 257, 513, 4, 2, 128, False, BF16), 30.0, FP32),  # GQA
    ((1, 1000, 1000, 2, 1, 64, False, BF16), 5.0, None),
    ((1, 129, 200, 2, 2, 128, True, BF16), 0.0, FP32),  # sink only
]


def autograd_against_float64(label, q, k, v, sink, causal, softcap, dout, dlse=None,
                             **call):
    """loss = sum(out * dout) (+ sum(lse * dlse) over rows with a finite lse when ``dlse`` is
    given): dq, dk, dv (and dsink) from torch.autograd through flash_attn_func's custom op
    (with the keywords ``call`` too), against float64 autograd (_grads_against_float64's rule).
    q, k, v (and sink) require grad; v's last dim is dv, dout's too."""
    from fa4_final import flash_attn_func

    leaves = [t for t in (q, k, v, sink) if t is not None]
    res = flash_attn_func(q, k, v, causal=causal, softcap=softcap, learnable_sink=sink,
                          return_lse=dlse is not None, **call)
    out, lse = res if isinstance(res, tuple) else (res, None)
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        loss = loss + (lse.where(lse.isfinite(), 0.0) * dlse).sum()
    got = torch.autograd.grad(loss, leaves)

    def split(ts):
        return ts[0], ts[1], ts[2], (ts[3] if sink is not None else None)

    def ref_loss(*ts):
        o, s = attention_reference_features(*split(ts)[:3], causal, None, softcap, split(ts)[3])
        total = (o * dout.double()).sum()
        return total + ((s.where(s.isfinite(), 0.0) * dlse.double()).sum() if dlse is not None
                        else 0)

    def same_loss(*ts):
        o, s = _same_precision(*split(ts)[:3], causal, q.shape[-1] ** -0.5, softcap,
                               split(ts)[3])
        total = (o.float() * dout.float()).sum()
        return total + ((s.where(s.isfinite(), 0.0) * dlse).sum() if dlse is not None else 0)

    checks.wait_for_gpu(label)
    with torch.no_grad():
        out64, lse64 = attention_reference_features(q, k, v, causal, None, softcap, sink)
    _grads_against_float64(label, got, leaves, ref_loss, same_loss,
                           sink_step(out64, lse64, dout, sink, q.dtype))


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("case", BWD_CASES, ids=_ids)
def test_flash_attn_func_autograd_matches_float64(case, return_lse):
    """autograd_against_float64 on out (and on lse too)."""
    shape, softcap, sink_dtype = case
    b, sq, sk, h, hk, d, causal, dtype = shape
    q, k, v, sink, seed = _inputs(shape, sink_dtype, requires_grad=True)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(b, sq, h, d, generator=g).to("cuda", dtype)
    dlse = torch.randn(b, h, sq, generator=g).to("cuda")
    autograd_against_float64(f"{_ids(case)} return_lse={return_lse} seed={seed}", q, k, v,
                             sink, causal, softcap, dout, dlse if return_lse else None)


def _packed(lens_q, lens_k, h, hk, d, dtype, requires_grad, dv=None):
    qs, ks, vs = [], [], []
    for sq, sk in zip(lens_q, lens_k):
        q, k, v, seed = random_qkv(1, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype,
                                   device="cuda", scale=SPREAD)
        if dv is not None and dv != d:  # v of its own head dim, its own seed
            v = random_qkv(1, sq, h, dv, seqlen_k=sk, heads_kv=hk, dtype=dtype,
                           device="cuda", seed=seed + 1, scale=SPREAD)[2]
        qs.append(q[0]), ks.append(k[0]), vs.append(v[0])
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                       device="cuda") for lens in (lens_q, lens_k)]
    q, k, v = (torch.cat(ts).requires_grad_(requires_grad) for ts in (qs, ks, vs))
    return q, k, v, *cu


@pytest.mark.parametrize("softcap, sink_dtype", [(5.0, FP32), (0.0, BF16), (30.0, None)])
def test_flash_attn_varlen_func_forward_and_autograd(softcap, sink_dtype):
    check_varlen_forward_and_autograd(softcap, sink_dtype)


def check_varlen_forward_and_autograd(softcap, sink_dtype, d=128, dv=None, backward=True):
    """Packed sequences of 37, 300, 0 and 1 queries over 300, 77, 5 and 0 keys (causal: rows
    that see no key; an empty sequence; one with no key: lse = the sink), forward per sequence
    against float64 and (``backward``) the gradients of sum(out * dout), dsink summed over
    every sequence; head dim ``d``, v's ``dv`` (None: d)."""
    from fa4_final import flash_attn_varlen_func

    lens_q, lens_k, h, hk = [37, 300, 0, 1], [300, 77, 5, 0], 4, 2
    # no gradient asked where the backward is not built: the call refuses one by name
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, h, hk, d, BF16, backward, dv)
    sink = None
    if sink_dtype is not None:
        sink = torch.tensor([-1.0, 0.5, 2.0, 3.5], device="cuda").to(sink_dtype)
        sink.requires_grad_(backward)
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                      causal=True, softcap=softcap, learnable_sink=sink,
                                      return_lse=True)
    checks.wait_for_gpu("varlen forward")
    oq = ok_ = 0
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq and sk:
            _check_forward(f"varlen sequence {i} ({sq} x {sk})", q[None, oq:oq + sq].detach(),
                           k[None, ok_:ok_ + sk].detach(), v[None, ok_:ok_ + sk].detach(),
                           None if sink is None else sink.detach(), True, softcap,
                           out[None, oq:oq + sq].detach(), lse[None, :, oq:oq + sq])
        elif sq:  # no key: out 0, lse = the sink (or -inf)
            assert bool((out[oq:oq + sq] == 0).all())
            want = (sink.detach().float().view(h, 1).expand(h, sq) if sink is not None
                    else torch.full((h, sq), float("-inf"), device="cuda"))
            assert torch.equal(lse[:, oq:oq + sq], want)
        oq, ok_ = oq + sq, ok_ + sk
    if not backward:
        return

    g = torch.Generator().manual_seed(5)
    dout = torch.randn(out.shape, generator=g).to("cuda", BF16)
    leaves = [t for t in (q, k, v, sink) if t is not None]
    got = torch.autograd.grad((out.float() * dout.float()).sum(), leaves)

    def per_sequence(fn, cast, ts):
        qq, kk, vv = ts[:3]
        s = ts[3] if sink is not None else None
        total, oq, ok_ = 0, 0, 0
        for sq, sk in zip(lens_q, lens_k):
            if sq and sk:
                o = fn(qq[None, oq:oq + sq], kk[None, ok_:ok_ + sk], vv[None, ok_:ok_ + sk], s)
                total = total + (cast(o) * cast(dout[None, oq:oq + sq])).sum()
            oq, ok_ = oq + sq, ok_ + sk
        return total

    def ref_loss(*ts):
        return per_sequence(lambda a, b_, c, s: attention_reference_features(
            a, b_, c, True, None, softcap, s)[0], lambda t: t.double(), ts)

    def same_loss(*ts):
        return per_sequence(lambda a, b_, c, s: _same_precision(
            a, b_, c, True, d ** -0.5, softcap, s)[0], lambda t: t.float(), ts)

    checks.wait_for_gpu("varlen backward")
    step, oq, ok_ = 0.0, 0, 0
    with torch.no_grad():
        for sq, sk in zip(lens_q, lens_k):  # a bound per sequence, summed (sequences add up)
            if sq and sk and sink is not None:
                o64, l64 = attention_reference_features(
                    q[None, oq:oq + sq], k[None, ok_:ok_ + sk], v[None, ok_:ok_ + sk], True,
                    None, softcap, sink)
                step += sink_step(o64, l64, dout[None, oq:oq + sq], sink, BF16)
            oq, ok_ = oq + sq, ok_ + sk
    _grads_against_float64(f"varlen softcap={softcap} sink={sink_dtype}", got, leaves,
                           ref_loss, same_loss, step)


def test_torch_compile_fullgraph_with_softcap_and_sink():
    """One compiled call (inductor): the op in one graph, out bitwise the eager call's (the same
    kernel), gradients (deterministic backward) within the rule against float64."""
    from fa4_final import flash_attn_func

    torch._dynamo.reset()
    shape = (2, 257, 300, 4, 2, 128, True, BF16)
    q, k, v, sink, seed = _inputs(shape, FP32, requires_grad=True)

    def layer(q, k, v, sink):
        out, _ = flash_attn_func(q, k, v, causal=True, softcap=5.0, learnable_sink=sink,
                                 deterministic=True)
        return out

    compiled = torch.compile(layer, fullgraph=True)
    out = compiled(q, k, v, sink)
    eager = layer(q, k, v, sink)
    checks.wait_for_gpu("compiled forward")
    assert torch.equal(out, eager)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g).to("cuda", BF16)
    leaves = [q, k, v, sink]
    got = torch.autograd.grad((out.float() * dout.float()).sum(), leaves)

    def ref_loss(*ts):
        o, _ = attention_reference_features(*ts[:3], True, None, 5.0, ts[3])
        return (o * dout.double()).sum()

    def same_loss(*ts):
        o, _ = _same_precision(*ts[:3], True, 128 ** -0.5, 5.0, ts[3])
        return (o.float() * dout.float()).sum()

    checks.wait_for_gpu("compiled backward")
    with torch.no_grad():
        out64, lse64 = attention_reference_features(q, k, v, True, None, 5.0, sink)
    _grads_against_float64("torch.compile", got, leaves, ref_loss, same_loss,
                           sink_step(out64, lse64, dout, sink, BF16))


def test_sdpa_private_functions_with_softcap_and_sink():
    """FA4's contract: _flash_attn_fwd(..., softcap=, learnable_sink=) and _flash_attn_bwd
    returning (dq, dk, dv, dsink); against float64 autograd."""
    from fa4_final.api import sdpa

    shape = (2, 200, 150, 4, 2, 64, True, BF16)
    b, sq, sk, h, hk, d, causal, dtype = shape
    q, k, v, sink, seed = _inputs(shape, BF16)
    out, lse = sdpa._flash_attn_fwd(q, k, v, causal=True, softcap=5.0, learnable_sink=sink,
                                    return_lse=True)
    checks.wait_for_gpu("sdpa forward")
    _check_forward("sdpa forward", q, k, v, sink, True, 5.0, out, lse)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g).to("cuda", dtype)
    got = sdpa._flash_attn_bwd(q, k, v, out, dout, lse, causal=True, softcap=5.0,
                               learnable_sink=sink)
    assert len(got) == 4 and got[3].dtype == sink.dtype

    def ref_loss(*ts):
        o, _ = attention_reference_features(*ts[:3], True, None, 5.0, ts[3])
        return (o * dout.double()).sum()

    def same_loss(*ts):
        o, _ = _same_precision(*ts[:3], True, d ** -0.5, 5.0, ts[3])
        return (o.float() * dout.float()).sum()

    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, sink)]
    checks.wait_for_gpu("sdpa backward")
    with torch.no_grad():
        out64, lse64 = attention_reference_features(q, k, v, True, None, 5.0, sink)
    _grads_against_float64("sdpa", got, leaves, ref_loss, same_loss,
                           sink_step(out64, lse64, dout, sink, dtype))
