"""Reference attention: the function every kernel in the course must compute.

Layout (batch, seqlen, heads, dim) for q, k, v and out; lse is (batch, heads, seqlen_q), the
natural log of each row's softmax denominator. Grouped-query attention: k and v may have fewer
heads than q, as long as they divide it. Causal masks align to the bottom right, so with
seqlen_q < seqlen_k the last query sees every key (as in FlashAttention); a row that sees no key
gives out = 0 and lse = -inf.
"""

from __future__ import annotations

import math

import torch

from utils.window import fa4_sides

SUPPORTED_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def positive_int(name: str, value) -> int:
    """``value`` if it is a positive int (a bool is not one); else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_attention_inputs(q, k, v, softmax_scale=None, allow_dv: bool = False
                           ) -> tuple[int, int, int, int, int, int]:
    """Validate shapes and dtypes; return (batch, seqlen_q, seqlen_k, heads, heads_kv, dim).
    ``allow_dv``: v's head dim may differ from q's and k's (FA4's dv != d; the references take
    it, the course's kernels do not).

    Raises ValueError/TypeError naming what was wrong and what is accepted.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, heads, dim), got shape {tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: {SUPPORTED_FLOAT_DTYPES}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, sq, h, d = q.shape
    bk, sk, hk, dk = k.shape
    if allow_dv and k.shape[:3] == v.shape[:3] and v.shape[3] > 0:
        pass
    elif k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if bk != b:
        raise ValueError(f"q has batch {b} but k/v have batch {bk}")
    if dk != d:
        raise ValueError(f"q has head dim {d} but k/v have head dim {dk}")
    if hk == 0 or h % hk != 0:
        raise ValueError(f"q's {h} heads must be a multiple of k/v's {hk} heads (GQA)")
    if min(b, sq, sk, h, d) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)
    ):
        raise ValueError(f"softmax_scale must be a finite number or None, got {softmax_scale!r}")
    return b, sq, sk, h, hk, d


def causal_mask(seqlen_q: int, seqlen_k: int, device=None, window_size=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k), True where query i may see key j (bottom-right aligned):
    j <= i + seqlen_k - seqlen_q. With ``window_size = (left, right)`` (None: unbounded) the
    sliding-window rule instead: i + off - left <= j <= i + off + right, off = seqlen_k -
    seqlen_q; causal is the window (None, 0)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    off = seqlen_k - seqlen_q
    left, right = window_size if window_size is not None else (None, 0)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right is not None:
        visible &= j <= i + off + right
    if left is not None:
        visible &= j >= i + off - left
    return visible


def attention_reference(
    q, k, v, causal: bool = False, softmax_scale: float | None = None, dtype=torch.float64,
    window_size=None,
):
    """Attention computed from the given inputs, in float64 by default.

    With ``dtype=q.dtype`` (bf16, fp16) it is the "same precision" reference: attention as plain
    PyTorch code computes it in that precision, the yardstick of the tolerance rule
    (utils/checks.py): the scores come out of the matmul rounded to ``dtype``, the softmax runs
    in float32, P is rounded to ``dtype`` for the second matmul. Kernels that keep S and the
    accumulators in float32 are more accurate than this.
    Returns (out, lse): out in ``dtype``; lse in float64 for the float64 reference, else float32.
    """
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v, softmax_scale)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    softmax_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    qf, kf, vf = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # (b, h, s, d)
    if hk != h:
        kf = kf.repeat_interleave(h // hk, dim=1)
        vf = vf.repeat_interleave(h // hk, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)).to(softmax_dtype) * scale  # (b, h, sq, sk)
    if causal or window_size is not None:  # FA4's reading of the two (utils.window)
        s = s.masked_fill(~causal_mask(sq, sk, s.device, fa4_sides(causal, window_size)),
                          float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    row_max = s.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(s - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.matmul(p.to(dtype), vf)
    return out.transpose(1, 2).contiguous(), lse


def attention_naive_loops(q, k, v, causal=False, softmax_scale=None):
    """An independent, deliberately plain float64 implementation (Python loops over rows),
    used only to test attention_reference itself. Small inputs only."""
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v, softmax_scale)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float64)
    qd, kd, vd = (t.double().cpu() for t in (q, k, v))
    for bi in range(b):
        for hi in range(h):
            hkv = hi // (h // hk)
            for i in range(sq):
                last = i + sk - sq if causal else sk - 1
                if last < 0:
                    continue
                scores = [
                    scale * float(torch.dot(qd[bi, i, hi], kd[bi, j, hkv])) for j in range(last + 1)
                ]
                m = max(scores)
                w = [math.exp(x - m) for x in scores]
                total = sum(w)
                lse[bi, hi, i] = m + math.log(total)
                for j, wj in enumerate(w):
                    out[bi, i, hi] += (wj / total) * vd[bi, j, hkv]
    return out, lse


def random_qkv(
    batch, seqlen_q, heads, dim, seqlen_k=None, heads_kv=None, dtype=torch.bfloat16,
    device="cpu", seed=None, scale=1.0,
):
    """Fresh random inputs; ``seed=None`` draws a new seed each call (and returns it)."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    heads_kv = heads if heads_kv is None else heads_kv
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    g = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*shape):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

    q = draw(batch, seqlen_q, heads, dim)
    k = draw(batch, seqlen_k, heads_kv, dim)
    v = draw(batch, seqlen_k, heads_kv, dim)
    return q, k, v, seed


# FA4's softcap and learnable sink (fa4_final.common.softmax, Note [Softcap] and
# Note [Learnable sink]), in float64, differentiable by torch.autograd.


def capped_scores(q, k, softmax_scale: float, softcap: float = 0.0, dtype=torch.float64):
    """(b, h, sq, sk) scores of q (b, sq, h, d) against k (b, sk, hk, d): scale * q.k, or with
    ``softcap`` > 0 softcap * tanh(scale * q.k / softcap) (the scale first, then the cap, as
    FA4's softcap score modifier); GQA by repeating k's heads. Differentiable."""
    h, hk = q.shape[2], k.shape[2]
    qf, kf = (t.to(dtype).transpose(1, 2) for t in (q, k))
    if hk != h:
        kf = kf.repeat_interleave(h // hk, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * softmax_scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s


def attention_reference_features(q, k, v, causal: bool = False, softmax_scale=None,
                                 softcap: float = 0.0, learnable_sink=None, window_size=None,
                                 dtype=torch.float64):
    """(out, lse) of FA4's attention with ``softcap`` (0.0: none) and ``learnable_sink`` (None
    or (heads,): one extra logit per query head in every row's softmax denominator, natural-log
    units, no value), in float64 and differentiable in q, k, v and the sink:

        out_i = sum_j exp(s_ij - lse_i) v_j,  lse_i = log(exp(sink_h) + sum_j exp(s_ij))

    with s the capped scores (capped_scores) and masked keys left out. A row that sees no key
    gets out = 0 and lse = sink (-inf without a sink), as FA4. Without both it equals
    attention_reference."""
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v, softmax_scale, allow_dv=True)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    s = capped_scores(q, k, scale, softcap, dtype)  # (b, h, sq, sk)
    if causal or window_size is not None:
        visible = causal_mask(sq, sk, s.device, fa4_sides(causal, window_size))
        s = s.masked_fill(~visible, float("-inf"))
    columns = s
    if learnable_sink is not None:
        sink = learnable_sink.to(dtype=dtype, device=s.device).view(1, h, 1, 1)
        columns = torch.cat([s, sink.expand(b, h, sq, 1)], dim=-1)
    lse = torch.logsumexp(columns, dim=-1)  # (b, h, sq); -inf for an empty row without sink
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe[..., None])  # masked keys: exp(-inf) = 0
    vf = v.to(dtype).transpose(1, 2)
    if hk != h:
        vf = vf.repeat_interleave(h // hk, dim=1)
    out = torch.matmul(p, vf)
    return out.transpose(1, 2), lse


def attention_backward_features(q, k, v, out, dout, lse, causal: bool = False,
                                softmax_scale=None, softcap: float = 0.0, learnable_sink=None,
                                dlse=None, window_size=None):
    """(dq, dk, dv, dsink) in float64 by the formulas a FlashAttention backward computes
    from (out, lse), the ones tested against torch.autograd:

        P = exp(s - lse),  dP = dO V^T,  delta_i = rowsum(dO_i * O_i) - dlse_i
        dS = P * (dP - delta) * (1 - t^2 with a softcap, t = tanh(scale q.k / softcap))
        dQ = scale dS K,  dK = scale dS^T Q,  dV = P^T dO
        dsink_h = -sum over the rows of head h of exp(sink_h - lse_i) * delta_i

    (FA4's dsink: a row with lse = -inf counts exp(sink - lse) as 1.) dsink is None without
    a sink; GQA sums dk, dv over a kv head's query heads."""
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v, softmax_scale)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    f64 = torch.float64
    qf, kf, vf, of, dof = (t.to(f64).transpose(1, 2) for t in (q, k, v, out, dout))
    if hk != h:
        kf, vf = (t.repeat_interleave(h // hk, dim=1) for t in (kf, vf))
    raw = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    s, t = raw, None
    if softcap:
        t = torch.tanh(raw / softcap)
        s = softcap * t
    if causal or window_size is not None:
        visible = causal_mask(sq, sk, s.device, fa4_sides(causal, window_size))
        s = s.masked_fill(~visible, float("-inf"))
    lse = lse.to(f64)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe[..., None])
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    delta = (dof * of).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(f64)
    ds = p * (dp - delta[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dv = torch.matmul(p.transpose(-1, -2), dof)
    if hk != h:
        dk, dv = (x.view(b, hk, h // hk, sk, d).sum(2) for x in (dk, dv))
    dsink = None
    if learnable_sink is not None:
        sink = learnable_sink.to(f64).view(1, h, 1)
        p_sink = torch.where(torch.isfinite(lse), torch.exp(sink - lse_safe),
                             torch.ones_like(lse))
        dsink = -(p_sink * delta).sum(dim=(0, 2))
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), dsink
