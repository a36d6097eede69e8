"""Pending features through fa4_final's public API on an H100/H200, each test setting
FA4_FINAL_PENDING for itself (Note [Pending features] in fa4_final.runtime.pending):

- lse_fold (left the gate after these passed; the tests still set FA4_FINAL_PENDING, which
  changes nothing now): a loss on the returned lse, its gradient folded into the one backward
  call (the has_dlse builds, Note [The lse gradient folded]), dq, dk, dv (and dsink) against
  float64 autograd, dense and varlen; the call count proves the probe's second call is gone.
- head_dims (left the gate after these passed): flash_attn_func's forward at (D, dv) =
  (96, 96), (192, 128), (256, 256) (and varlen at (192, 128); varlen at v head dims 96 and
  192: tests/gpu/test_fwd_head_dims.py -k varlen) against float64, inputs NaN-free, out with v's
  head dim; a call that needs a gradient where no backward is built ((256, 128)) is refused at
  the forward, gate or no gate (the backward's own head dims: tests/gpu/test_bwd_head_dims.py).
- seqused_q: flash_attn_varlen_func with seqused_q (causal and not, an empty sequence, one
  with no used row, one with every row used), forward and autograd against float64 on each
  sequence's used rows; padding rows: out 0 and dq 0; api.sdpa's _flash_attn_fwd leaves a
  caller's out/lse sentinel in the padding rows (FA4's semantics).

The rule is the course's (utils.checks.tolerance_check: max error <= 2 x PyTorch's own in the
input dtype + rounding slack); the helpers are tests/gpu/test_softcap_sinks.py's. These tests,
with the kernels' own (tests/gpu/test_lse_fold.py, ...), are what lets a row of
fa4_final.runtime.pending.PENDING be deleted. Run (about 10 minutes, most of it compiling):
    timeout 1500 python -m pytest tests/gpu/test_pending_api.py -m gpu -x -v
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_softcap_sinks import (
    BF16,
    FP16,
    FP32,
    NAMES,
    SPREAD,
    _check_forward,
    _inputs,
    _same_precision,
)
from tests.gpu.test_softcap_sinks_api import (
    _grads_against_float64,
    _packed,
    autograd_against_float64,
)
from utils import checks
from utils.hardware import missing
from utils.reference import attention_reference_features

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]


def _counting_backward(monkeypatch):
    """Record whether each dense backward launch (runtime.prologue.backward_prepared, which the
    op and the eager path both reach) was given a dlse."""
    from fa4_final.runtime import prologue

    calls, real = [], prologue.backward_prepared

    def counted(*args, **kw):
        calls.append(kw.get("dlse") is not None)
        return real(*args, **kw)

    monkeypatch.setattr(prologue, "backward_prepared", counted)
    return calls


# ----------------------------------------------------------------------------------------------
# lse_fold


LSE_CASES = [  # (b, sq, sk, h, hk, d, causal, dtype), softcap, sink dtype, deterministic
    ((2, 17, 17, 2, 1, 64, True, FP16), 0.0, None, False),
    ((1, 300, 77, 2, 2, 128, True, BF16), 0.0, None, False),  # rows that see no key
    ((2, 257, 513, 4, 2, 128, False, BF16), 0.0, None, True),  # GQA, deterministic
    ((1, 129, 200, 2, 2, 128, True, BF16), 5.0, FP32, False),  # with softcap and a sink
]


def _lse_id(case):
    (b, sq, sk, h, hk, d, causal, dt), cap, sink, det = case
    return (f"b{b}-{sq}x{sk}-h{h}/{hk}-d{d}-{'causal' if causal else 'dense'}-{NAMES[dt]}"
            f"-cap{cap:g}-sink_{NAMES.get(sink, 'none')}{'-det' if det else ''}")


@pytest.mark.parametrize("case", LSE_CASES, ids=_lse_id)
def test_lse_fold_one_backward_call_matches_float64(monkeypatch, case):
    shape, softcap, sink_dtype, deterministic = case
    monkeypatch.setenv("FA4_FINAL_PENDING", "lse_fold,softcap,learnable_sink")
    calls = _counting_backward(monkeypatch)
    b, sq, sk, h, hk, d, causal, dtype = shape
    q, k, v, sink, seed = _inputs(shape, sink_dtype, requires_grad=True)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(b, sq, h, d, generator=g).to("cuda", dtype)
    dlse = torch.randn(b, h, sq, generator=g).to("cuda")
    autograd_against_float64(f"{_lse_id(case)} seed={seed}", q, k, v, sink, causal, softcap,
                             dout, dlse, deterministic=deterministic)
    assert calls == [True], calls  # one backward, given dlse: no probe call


def test_lse_fold_varlen_matches_the_probe_path(monkeypatch):
    """Packed sequences (causal, one empty, one with no key): the folded backward's dq, dk, dv
    (one call, the default since lse_fold left the gate) against the probe's two calls (the
    path it replaced, reached by putting the lse_fold row back in PENDING for the run) and
    float64 per sequence."""
    from fa4_final import flash_attn_varlen_func
    from fa4_final.api import ops
    from fa4_final.runtime import pending

    lens_q, lens_k, h, hk, d = [37, 300, 0, 1], [300, 77, 5, 0], 4, 2, 128
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, h, hk, d, BF16, True)
    g = torch.Generator().manual_seed(11)
    dout = torch.randn(q.shape, generator=g).to("cuda", BF16)
    dlse = torch.randn(h, q.shape[0], generator=g).to("cuda")
    monkeypatch.delenv("FA4_FINAL_PENDING", raising=False)
    results = []
    for probe, want in ((True, [False, False]), (False, [True])):
        with monkeypatch.context() as m:
            if probe:
                m.setitem(pending.PENDING, "lse_fold", "put back by the test: the probe's path")
            calls, op = [], ops.varlen_bwd

            def counted(*args, op=op, calls=calls):
                calls.append(len(args) > 17 and args[17] is not None)  # dlse's place
                return op(*args)

            m.setattr(ops, "varlen_bwd", counted)
            out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                              max_seqlen_q=max(lens_q),
                                              max_seqlen_k=max(lens_k), causal=True,
                                              return_lse=True)
            loss = (out.float() * dout.float()).sum() + (
                lse.where(lse.isfinite(), 0.0) * dlse).sum()
            results.append(torch.autograd.grad(loss, [q, k, v]))
            assert calls == want, (probe, calls)
    checks.wait_for_gpu("varlen lse_fold")
    oq = ok_ = 0
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq and sk:
            leaves = [t[rows].detach().double()[None].requires_grad_(True) for t, rows in (
                (q, slice(oq, oq + sq)), (k, slice(ok_, ok_ + sk)), (v, slice(ok_, ok_ + sk)))]
            o, s = attention_reference_features(*leaves, True, None, 0.0, None)
            ref = (o * dout[None, oq:oq + sq].double()).sum() + (
                s.where(s.isfinite(), 0.0) * dlse[None, :, oq:oq + sq].double()).sum()
            want = torch.autograd.grad(ref, leaves)
            for name, w, rows, j in (("dq", want[0], slice(oq, oq + sq), 0),
                                     ("dk", want[1], slice(ok_, ok_ + sk), 1),
                                     ("dv", want[2], slice(ok_, ok_ + sk), 2)):
                probe, folded = results[0][j][rows].double(), results[1][j][rows].double()
                err_probe = float((probe - w[0]).abs().max())
                err_folded = float((folded - w[0]).abs().max())
                assert err_folded <= 1.5 * err_probe + 1e-2, (i, name, err_folded, err_probe)
        oq, ok_ = oq + sq, ok_ + sk


# ----------------------------------------------------------------------------------------------
# head_dims


HEAD_DIM_CASES = [  # (b, sq, sk, h, hk, d, dv, causal, dtype)
    (2, 257, 513, 4, 2, 96, 96, False, BF16),
    (1, 300, 77, 2, 2, 96, 96, True, FP16),  # rows that see no key
    (2, 1000, 1000, 4, 1, 192, 128, True, BF16),  # DeepSeek's MLA prefill shape class
    (1, 129, 200, 2, 2, 192, 128, False, FP16),
    (2, 513, 513, 2, 2, 256, 256, True, BF16),
    (1, 77, 300, 4, 2, 256, 256, False, FP16),
]


def _hd_id(case):
    b, sq, sk, h, hk, d, dv, causal, dt = case
    return (f"b{b}-{sq}x{sk}-h{h}/{hk}-d{d}-dv{dv}-{'causal' if causal else 'dense'}-"
            f"{NAMES[dt]}")


def _qkv_dv(b, sq, sk, h, hk, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, sq, h, d, generator=g) * SPREAD).to("cuda", dtype)
    k = (torch.randn(b, sk, hk, d, generator=g) * SPREAD).to("cuda", dtype)
    v = torch.randn(b, sk, hk, dv, generator=g).to("cuda", dtype)
    return q, k, v


@pytest.mark.parametrize("case", HEAD_DIM_CASES, ids=_hd_id)
def test_head_dims_forward_through_flash_attn_func_matches_float64(monkeypatch, case):
    from fa4_final import flash_attn_func

    monkeypatch.setenv("FA4_FINAL_PENDING", "head_dims")
    b, sq, sk, h, hk, d, dv, causal, dtype = case
    q, k, v = _qkv_dv(b, sq, sk, h, hk, d, dv, dtype, seed=sq + d)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (b, sq, h, dv) and lse.shape == (b, h, sq)
    checks.wait_for_gpu(_hd_id(case))
    _check_forward(_hd_id(case), q, k, v, None, causal, 0.0, out, lse)


def test_head_dims_varlen_forward_matches_float64(monkeypatch):
    from fa4_final import flash_attn_varlen_func

    monkeypatch.setenv("FA4_FINAL_PENDING", "head_dims")
    lens_q, lens_k, h, hk, d, dv = [37, 300, 0, 129], [300, 77, 5, 129], 4, 2, 192, 128
    parts = [_qkv_dv(1, sq, sk, h, hk, d, dv, BF16, seed=i) for i, (sq, sk) in
             enumerate(zip(lens_q, lens_k))]
    q, k, v = (torch.cat([p[j][0] for p in parts]) for j in range(3))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                               device="cuda") for lens in (lens_q, lens_k))
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                      causal=True, return_lse=True)
    assert out.shape == (q.shape[0], h, dv)
    checks.wait_for_gpu("varlen head dims")
    oq = ok_ = 0
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq:
            _check_forward(f"varlen sequence {i} ({sq} x {sk}, d192 dv128)", q[None, oq:oq + sq],
                           k[None, ok_:ok_ + sk], v[None, ok_:ok_ + sk], None, True, 0.0,
                           out[None, oq:oq + sq], lse[None, :, oq:oq + sq])
        oq, ok_ = oq + sq, ok_ + sk


def test_head_dims_a_gradient_is_refused_at_the_forward(monkeypatch):
    from fa4_final import UnsupportedError, flash_attn_func

    monkeypatch.setenv("FA4_FINAL_PENDING", "head_dims")
    q, k, v = (t.requires_grad_(True) for t in _qkv_dv(1, 64, 64, 2, 2, 256, 128, BF16, 0))
    with pytest.raises(UnsupportedError, match="the backward at head_dim=256, dv=128 is not "
                                               "built"):
        flash_attn_func(q, k, v)
    with torch.no_grad():
        out, _ = flash_attn_func(q, k, v)
    assert out.shape == (1, 64, 2, 128)


# ----------------------------------------------------------------------------------------------
# seqused_q


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_seqused_q_forward_and_autograd_match_float64(monkeypatch, causal):
    from fa4_final import flash_attn_varlen_func

    monkeypatch.setenv("FA4_FINAL_PENDING", "seqused_q")
    lens_q, used_q, lens_k = [300, 0, 130, 64, 257], [200, 0, 0, 64, 129], [300, 5, 77, 64, 513]
    h, hk, d = 4, 2, 128
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, h, hk, d, BF16, True)
    used = torch.tensor(used_q, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                                      seqused_q=used, causal=causal, return_lse=True)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(out.shape, generator=g).to("cuda", BF16)
    dq, dk, dv = torch.autograd.grad((out.float() * dout.float()).sum(), [q, k, v])
    checks.wait_for_gpu("seqused_q")
    oq = ok_ = 0
    for i, (nq, nu, nk) in enumerate(zip(lens_q, used_q, lens_k)):
        pad = slice(oq + nu, oq + nq)
        assert bool((out[pad] == 0).all()) and bool((dq[pad] == 0).all()), f"sequence {i} padding"
        if nu:
            rows, keys = slice(oq, oq + nu), slice(ok_, ok_ + nk)
            _check_forward(f"seqused_q sequence {i} ({nu} of {nq} x {nk})",
                           q[None, rows].detach(), k[None, keys].detach(),
                           v[None, keys].detach(), None, causal, 0.0, out[None, rows].detach(),
                           lse[None, :, rows].detach())
            leaves = [t[None, r].detach() for t, r in ((q, rows), (k, keys), (v, keys))]
            got = [dq[None, rows], dk[None, keys], dv[None, keys]]
            d_out = dout[None, rows]

            def ref_loss(*ts, d_out=d_out):
                o, _ = attention_reference_features(*ts, causal, None, 0.0, None)
                return (o * d_out.double()).sum()

            def same_loss(*ts, d_out=d_out):
                o, _ = _same_precision(*ts, causal, d ** -0.5, 0.0, None)
                return (o.float() * d_out.float()).sum()

            _grads_against_float64(f"seqused_q sequence {i}", got,
                                   [t.requires_grad_(True) for t in leaves], ref_loss, same_loss)
        oq, ok_ = oq + nq, ok_ + nk


def test_seqused_q_sdpa_forward_keeps_the_callers_padding(monkeypatch):
    from fa4_final.api import sdpa

    monkeypatch.setenv("FA4_FINAL_PENDING", "seqused_q")
    lens_q, used_q, lens_k, h, d = [100, 37], [60, 37], [80, 200], 2, 64
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, h, h, d, BF16, False)
    used = torch.tensor(used_q, dtype=torch.int32, device="cuda")
    out = torch.full((q.shape[0], h, d), 7.0, dtype=BF16, device="cuda")
    lse = torch.full((h, q.shape[0]), 5.0, device="cuda")
    sdpa._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used,
                         causal=True, out=out, lse=lse, return_lse=True)
    checks.wait_for_gpu("sdpa seqused_q")
    assert bool((out[60:100] == 7).all()) and bool((lse[:, 60:100] == 5).all())
    _check_forward("sdpa seqused_q sequence 0", q[None, :60], k[None, :80], v[None, :80], None,
                   True, 0.0, out[None, :60], lse[None, :, :60])
