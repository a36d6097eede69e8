"""Chapter 01's exercises: typical wrong answers, each with the words its checker must say."""

import torch
import torch.nn.functional as F

from solutions import ch01_naive as ch01
from tests.exercise_mutations import Mutation


# --- 01.1 attention with its mask -------------------------------------------------------------
def _scores(q, k, v, softmax_scale=None, gqa="interleave"):
    h, hk, d = q.shape[2], k.shape[2], q.shape[-1]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))
    if gqa == "interleave":
        kh, vh = kh.repeat_interleave(h // hk, 1), vh.repeat_interleave(h // hk, 1)
    else:  # query head i on kv head i % H_kv
        kh, vh = kh.repeat(1, h // hk, 1, 1), vh.repeat(1, h // hk, 1, 1)
    return qh @ kh.transpose(-1, -2) * scale, vh


def _finish(s, vh, q, lse_with_max=True):
    m = s.amax(-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)  # noqa: E741
    out = p @ vh / torch.where(l > 0, l, torch.ones_like(l))
    lse = (m + torch.log(l)) if lse_with_max else torch.log(l)
    return out.transpose(1, 2).to(q.dtype), lse.squeeze(-1)


def attention_no_mask(q, k, v, causal=False, softmax_scale=None):
    s, vh = _scores(q, k, v, softmax_scale)
    return _finish(s, vh, q)


def attention_top_left(q, k, v, causal=False, softmax_scale=None):
    s, vh = _scores(q, k, v, softmax_scale)
    if causal:
        i, j = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
        s = s.masked_fill(j > i, float("-inf"))  # the diagonal from the top-left corner
    return _finish(s, vh, q)


def attention_nan_rows(q, k, v, causal=False, softmax_scale=None):
    s, vh = _scores(q, k, v, softmax_scale)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    out = torch.softmax(s, -1) @ vh  # a row of -inf: 0 / 0
    return out.transpose(1, 2).to(q.dtype), torch.logsumexp(s, -1)


def attention_wrong_gqa(q, k, v, causal=False, softmax_scale=None):
    s, vh = _scores(q, k, v, softmax_scale, gqa="tile")
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    return _finish(s, vh, q)


def attention_lse_without_max(q, k, v, causal=False, softmax_scale=None):
    s, vh = _scores(q, k, v, softmax_scale)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    return _finish(s, vh, q, lse_with_max=False)


def attention_with_sdpa(q, k, v, causal=False, softmax_scale=None):
    s, vh = _scores(q, k, v, softmax_scale)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2), torch.logsumexp(s, -1)


# --- 01.2 the peak memory ---------------------------------------------------------------------
def _copies(b, h, s_q, s_k, d):
    return 2 * b * h * (s_q + 2 * s_k) * d


def peak_scores_only(b, h, s_q, s_k, d):
    return 6 * b * h * s_q * s_k


def peak_bf16_only(b, h, s_q, s_k, d):
    return 2 * b * h * s_q * s_k + _copies(b, h, s_q, s_k, d)


def peak_float32_only(b, h, s_q, s_k, d):
    return 4 * b * h * s_q * s_k + _copies(b, h, s_q, s_k, d)


def peak_three_matrices(b, h, s_q, s_k, d):
    return (2 + 4 + 2) * b * h * s_q * s_k + _copies(b, h, s_q, s_k, d)


def peak_in_gib(b, h, s_q, s_k, d):
    return (6 * b * h * s_q * s_k + _copies(b, h, s_q, s_k, d)) / 2**30


def peak_asks_the_course(b, h, s_q, s_k, d):
    return ch01.predict_peak_bytes(b, h, s_q, s_k, d).peak


A = dict(check=ch01.check_causal_attention, reference=ch01.attention,
         forbid=ch01.ATTENTION_FORBID)
P = dict(check=ch01.check_peak_bytes, reference=ch01.naive_peak_bytes, forbid=ch01.PEAK_FORBID)

MUTATIONS = [
    Mutation("01.1", answer=attention_no_mask, says="masked exactly when j > i", **A),
    Mutation("01.1", answer=attention_top_left, says="top left", **A),
    Mutation("01.1", answer=attention_nan_rows, says="see no key", **A),
    Mutation("01.1", answer=attention_wrong_gqa, says="GQA", **A),
    Mutation("01.1", answer=attention_lse_without_max, says="lse by", **A),
    Mutation("01.1", answer=attention_with_sdpa, says="PyTorch's fused attention", **A),
    Mutation("01.2", answer=peak_scores_only, says="copies of Q, K and V", **P),
    Mutation("01.2", answer=peak_bf16_only, says="its float32 copy is alive too", **P),
    Mutation("01.2", answer=peak_float32_only, says="the bf16 P is made", **P),
    Mutation("01.2", answer=peak_three_matrices, says="at most two score matrices", **P),
    Mutation("01.2", answer=peak_in_gib, says="Return bytes", **P),
    Mutation("01.2", answer=peak_asks_the_course, says="the course's count", **P),
]
