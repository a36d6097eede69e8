"""Test-only CPU implementations of fa4_final's custom ops, in float32 PyTorch.

``register()`` adds them to the ops for the CPU dispatch key, so opcheck, FakeTensor shape
propagation, torch.compile and autograd can be exercised end to end on a machine with no GPU.
They are inactive outside ``with active():``, where a CPU tensor gets the package's own
UnsupportedError, as it does for users.

The backward is written out (not autograd through the forward) the way the kernels do it:
P from q, k and lse; dS = P * (dP - D) with D = rowsum(dO * O). O is used for D only, which is
what Note [Gradient of the returned lse] in fa4_final/api/ops.py relies on.
"""

from __future__ import annotations

import contextlib
import math

import torch

from fa4_final.api import ops
from utils.window import visible_mask

_ACTIVE = [False]
_REGISTERED = [False]


def visible(sq, sk, causal, left, right, device=None):
    """(sq, sk) bool: query i sees key j (bottom-right aligned): FA4's reading of causal and the
    window (utils.window), which leaves already normalised sides as they are."""
    return visible_mask(sq, sk, causal, (left, right), device)


def attention_masked(q, k, v, causal=False, window=(None, None), softmax_scale=None,
                     dtype=torch.float64):
    """(out, lse) with autograd on any device, in the package's layout: the float64 yardstick
    (``dtype=torch.float64``), or PyTorch in the kernel's precision (``dtype=q.dtype``: S
    rounded to it, the softmax in float32, P rounded to it), as utils.reference, plus windows.
    Rows that see no key: out 0, lse -inf."""
    h, hk, d = q.shape[2], k.shape[2], q.shape[3]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    qf, kf, vf = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    kf, vf = (t.repeat_interleave(h // hk, dim=1) for t in (kf, vf))
    s = (qf @ kf.transpose(-1, -2)).to(soft) * scale
    s = s.masked_fill(~visible(q.shape[1], k.shape[1], causal, *window, device=q.device),
                      -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return (p.to(dtype) @ vf).transpose(1, 2), lse


def _probs(q, k, scale, causal, left, right, lse=None, softcap=0.0, sink=None):
    """(b, h, sq, sk) float32 P and lse (b, h, sq) from q (b, sq, h, d), k (b, sk, hk, d);
    FA4's softcap (scores softcap * tanh(s / softcap)) and learnable sink (an extra logit per
    head in the denominator) as in Note [Softcap] and Note [Learnable sink]."""
    h, hk = q.shape[2], k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible(q.shape[1], k.shape[1], causal, left, right), -math.inf)
    if lse is None:
        cols = s
        if sink is not None:
            column = sink.float().view(1, h, 1, 1).expand(*s.shape[:3], 1)
            cols = torch.cat([s, column], dim=-1)
        lse = torch.logsumexp(cols, dim=-1)
    finite = torch.isfinite(lse)[..., None]
    p = torch.where(finite, torch.exp(s - torch.where(finite, lse[..., None], 0.0)), 0.0)
    return p, lse


def dense_forward(q, k, v, scale, causal, left, right, softcap=0.0, sink=None):
    h, hk = q.shape[2], k.shape[2]
    b, sq = q.shape[:2]
    if min(q.shape[0], sq, h) == 0 or k.shape[1] == 0:
        lse = torch.full((b, h, sq), -math.inf, dtype=torch.float32, device=q.device)
        if sink is not None:
            lse = sink.float().view(1, h, 1).expand(b, h, sq).contiguous()
        return torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device), lse
    p, lse = _probs(q, k, scale, causal, left, right, softcap=softcap, sink=sink)
    vf = v.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    out = (p @ vf).transpose(1, 2).to(q.dtype).contiguous()
    return out, lse.float().contiguous()


def dense_backward(dout, q, k, v, out, lse, scale, causal, left, right, softcap=0.0, dlse=None):
    h, hk = q.shape[2], k.shape[2]
    g = h // hk
    if min(q.shape[0], q.shape[1], h, k.shape[1]) == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    p, _ = _probs(q, k, scale, causal, left, right, lse=lse.float(), softcap=softcap)
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(g, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(g, dim=1)
    do = dout.float().transpose(1, 2)
    o = out.float().transpose(1, 2)
    dp = do @ vf.transpose(-1, -2)
    delta = (do * o).sum(-1, keepdim=True)
    if dlse is not None:  # the lse's gradient folded into delta, as bwd_pre's has_dlse builds
        delta = delta - dlse.float().unsqueeze(-1)
    ds = p * (dp - delta)
    if softcap:  # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2
        ds = ds * (1 - torch.tanh((qf @ kf.transpose(-1, -2)) * scale / softcap) ** 2)
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf) * scale
    dv = p.transpose(-1, -2) @ do

    def fold(t):  # sum the heads of each k/v group (GQA)
        b, _, s, d = t.shape
        return t.reshape(b, hk, g, s, d).sum(2).transpose(1, 2)

    return (dq.transpose(1, 2).to(q.dtype).contiguous(), fold(dk).to(k.dtype).contiguous(),
            fold(dv).to(v.dtype).contiguous())


def _spans(cu_q, cu_k, seqused_k, seqused_q=None):
    """(first q row, end of its used rows, first k row, end of its used keys) per sequence."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else [b - a for a, b in zip(ck, ck[1:])]
    used_q = seqused_q.tolist() if seqused_q is not None else [b - a for a, b in zip(cq, cq[1:])]
    return [(cq[i], cq[i] + used_q[i], ck[i], ck[i] + used[i]) for i in range(len(cq) - 1)]


def varlen_forward(q, k, v, cu_q, cu_k, seqused_k, scale, causal, left, right, softcap=0.0,
                   sink=None, seqused_q=None):
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)  # v's head dim
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32)
    if seqused_q is not None:  # padding rows: 0, as the op's zero-filled buffers keep them
        lse.zero_()
    for q0, q1, k0, k1 in _spans(cu_q, cu_k, seqused_k, seqused_q):
        o, l = dense_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, causal,
                             left, right, softcap, sink)
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, seqused_k, scale, causal, left, right,
                    softcap=0.0, dlse=None, seqused_q=None):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0, q1, k0, k1 in _spans(cu_q, cu_k, seqused_k, seqused_q):
        g = dense_backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                           out[None, q0:q1], lse[None, :, q0:q1], scale, causal, left, right,
                           softcap, None if dlse is None else dlse[None, :, q0:q1])
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# registration


def _gate(reference, package):
    def impl(*args):
        return reference(*args) if _ACTIVE[0] else package(*args)

    return impl


def _cpu_fwd(q, k, v, scale, causal, wl, wr, deterministic, return_lse, softcap=0.0,
             sink=None):
    return dense_forward(q, k, v, scale, causal, wl, wr, softcap, sink)


def _cpu_bwd(dout, q, k, v, out, lse, scale, causal, wl, wr, deterministic, softcap=0.0,
             dlse=None):
    return dense_backward(dout, q, k, v, out, lse, scale, causal, wl, wr, softcap, dlse)


def _cpu_varlen_fwd(q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, scale, causal, wl, wr,
                    deterministic, return_lse, softcap=0.0, sink=None, seqused_q=None):
    return varlen_forward(q, k, v, cu_q, cu_k, seqused_k, scale, causal, wl, wr, softcap, sink,
                          seqused_q)


def _cpu_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, seqused_k, max_q, max_k, scale, causal,
                    wl, wr, deterministic, softcap=0.0, dlse=None, seqused_q=None):
    return varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, seqused_k, scale, causal, wl, wr,
                           softcap, dlse, seqused_q)


def register() -> None:
    """Add the CPU kernels (once per process); inactive until ``active()``."""
    if _REGISTERED[0]:
        return
    for op, ref, package in ((ops.fwd, _cpu_fwd, ops.fwd_impl), (ops.bwd, _cpu_bwd, ops.bwd_impl),
                             (ops.varlen_fwd, _cpu_varlen_fwd, ops.varlen_fwd_impl),
                             (ops.varlen_bwd, _cpu_varlen_bwd, ops.varlen_bwd_impl)):
        op.register_kernel("cpu", _gate(ref, package))
    _REGISTERED[0] = True


@contextlib.contextmanager
def active():
    """The CPU reference answers for CPU tensors inside this block."""
    register()
    before = _ACTIVE[0]
    _ACTIVE[0] = True
    try:
        yield
    finally:
        _ACTIVE[0] = before
