"""Chapter 01: naive attention against float64, its byte count, its memory, its checkers."""

import math

import pytest
import torch

from solutions import ch01_naive as ch01
from utils.checks import check_attention
from utils.reference import attention_reference, causal_mask, random_qkv

# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim): odd lengths, sq != sk both ways, GQA, MQA
SHAPES = [(2, 77, 77, 4, 4, 32), (1, 50, 130, 4, 1, 64), (1, 130, 50, 6, 2, 16),
          (1, 1, 33, 2, 2, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_float64_reference_exactly_in_float64(shape, causal):
    b, sq, sk, h, hk, d = shape
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=torch.float64)
    out, lse = ch01.attention(q, k, v, causal=causal)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal)
    assert torch.allclose(out, ref_out, atol=1e-12), seed
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), seed
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[fin], ref_lse[fin], atol=1e-5), seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_tolerance_rule_in_low_precision(dtype, shape):
    b, sq, sk, h, hk, d = shape
    q, k, v, _ = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype)
    check_attention(ch01.attention, q, k, v, causal=True)
    check_attention(ch01.attention, q, k, v, causal=False, softmax_scale=0.3)


def test_rows_without_keys_are_zero_not_nan():
    q, k, v, _ = random_qkv(1, 40, 2, 16, seqlen_k=25, dtype=torch.bfloat16)
    out, lse = ch01.attention(q, k, v, causal=True)
    empty = ~causal_mask(40, 25).any(dim=1)  # the first 15 queries see nothing
    assert empty.sum() == 15
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[:, empty] == 0).all() and (lse[:, :, empty] == float("-inf")).all()


def test_bad_input_raises():
    q, k, v, _ = random_qkv(1, 8, 4, 16, heads_kv=2)
    with pytest.raises(ValueError, match="multiple"):
        ch01.attention(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1))
    with pytest.raises(TypeError):
        ch01.attention(q.int(), k, v)
    with pytest.raises(ValueError, match="positive integer"):
        ch01.predict_peak_bytes(1, 16, 0, 4096, 128)
    with pytest.raises(TypeError, match="dtype"):
        ch01.predict_peak_bytes(1, 16, 64, 64, 128, dtype="bf16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 256, 256, 2, 2, 32), (2, 100, 300, 4, 2, 16),
                                   (1, 300, 100, 2, 1, 64)])
def test_predicted_peak_memory_is_what_the_cpu_measures(dtype, causal, shape):
    b, sq, sk, h, hk, d = shape
    q, k, v, _ = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype)
    measured = ch01.measure_peak_bytes(ch01.attention, q, k, v, causal=causal)
    predicted = ch01.predict_peak_bytes(b, h, sq, sk, d, dtype, causal, heads_kv=hk)
    assert measured.bytes == predicted.peak
    assert "CPU" in measured.method


def test_peak_memory_grows_as_the_square():
    bf16 = [ch01.predict_peak_bytes(1, 16, s, s, 128).peak for s in (8192, 16384)]
    assert 3.9 < bf16[1] / bf16[0] <= 4.0
    # bf16 scores + their float32 copy: 6 bytes per score dominate at long length
    assert math.isclose(bf16[1] / (16 * 16384**2), 6.0, rel_tol=0.02)


def test_traffic_counts_bytes_per_score():
    """Per score: bf16 S written and read, fp32 copy passed over 12 times, bf16 P written and
    read: 4 * 2 + 12 * 4 = 56 bytes, against 4 * D FLOPs."""
    t = ch01.naive_traffic(1, 16, 8192, 8192, 64)
    assert math.isclose(t.bytes_per_score, 56, rel_tol=0.01)
    assert math.isclose(t.intensity, 4 * 64 / 56, rel_tol=0.01)
    fp32 = ch01.naive_traffic(1, 16, 8192, 8192, 64, dtype=torch.float32)
    assert math.isclose(fp32.bytes_per_score, 48, rel_tol=0.01)  # no upcast, no cast back
    causal = ch01.naive_traffic(1, 16, 8192, 8192, 64, causal=True)
    assert causal.flops == t.flops  # the naive version computes the masked half too
    assert "total" in t.table()
    floor = ch01.fused_floor_bytes(2, 16, 1000, 1000, 64, heads_kv=4)
    assert floor == 2 * (2 * 2 * 1000 * 16 * 64 + 2 * 2 * 1000 * 4 * 64) + 4 * 2 * 16 * 1000


# ---------------------------------------------------------------------------------------------
# Checkers: accept the solution, reject wrong versions with a message that points at the bug


def _no_mask(q, k, v, causal=False, softmax_scale=None):
    return ch01.attention(q, k, v, causal=False, softmax_scale=softmax_scale)


def _top_left(q, k, v, causal=False, softmax_scale=None):
    if not causal:
        return ch01.attention(q, k, v)
    sq, sk = q.shape[1], k.shape[1]
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(
        q.shape[2] // k.shape[2], 2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.float().repeat_interleave(
        q.shape[2] // k.shape[2], 2))
    return out.to(q.dtype), torch.logsumexp(s, -1)


def _nan_rows(q, k, v, causal=False, softmax_scale=None):
    """softmax of an all -inf row: NaN (the classic bug)."""
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    s = qh @ kh.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[1], k.shape[1]), float("-inf"))
    out = torch.softmax(s, -1) @ vh
    return out.transpose(1, 2).to(q.dtype), torch.logsumexp(s, -1)


def _wrong_gqa(q, k, v, causal=False, softmax_scale=None):
    """Query head i uses kv head i % H_kv instead of i // (H / H_kv)."""
    g = q.shape[2] // k.shape[2]
    return ch01.attention(q, k.repeat(1, 1, g, 1), v.repeat(1, 1, g, 1), causal, softmax_scale)


def test_causal_checker_accepts_the_solution():
    ch01.check_causal_attention(ch01.attention)


@pytest.mark.parametrize("fn, words", [
    (_no_mask, "masked exactly when j > i"),
    (_top_left, "top left"),
    (_nan_rows, "see no key"),
    (_wrong_gqa, "GQA"),
])
def test_causal_checker_names_the_bug(fn, words):
    with pytest.raises(AssertionError, match=words):
        ch01.check_causal_attention(fn)


def test_memory_answer_checker():
    right = ch01.predict_peak_bytes(**ch01.MEMORY_QUESTION).peak / 2**30
    ch01.check_memory_answer(right)
    ch01.check_memory_answer(round(right, 1))
    n2 = 16 * 16384**2
    with pytest.raises(AssertionError, match="float32 copy"):
        ch01.check_memory_answer(n2 * 2 / 2**30)
    with pytest.raises(AssertionError, match="GiB"):
        ch01.check_memory_answer(n2 * 6 / 1e9)
    with pytest.raises(AssertionError, match="not it"):
        ch01.check_memory_answer(1.0)
    with pytest.raises(AssertionError, match="number"):
        ch01.check_memory_answer("24 GiB")


def test_roofline_bound_is_the_lower_of_bandwidth_and_compute():
    t = ch01.naive_traffic(1, 16, 4096, 4096, 128)
    ms = t.bytes / 3e12 * 1e3  # a run that moved its bytes at 3 TB/s
    pt = ch01.roofline("naive", t.flops, t.bytes, ms, bandwidth=4.8e12, compute_flops=1e15)
    assert pt.memory_bound and pt.bound_tflops == pytest.approx(t.intensity * 4.8)
    assert pt.of_bound == pytest.approx(3.0 / 4.8)
    fused = ch01.roofline("fused", t.flops, ch01.fused_floor_bytes(1, 16, 4096, 4096, 128), 1.0,
                          4.8e12, 1e15)
    assert not fused.memory_bound and fused.bound_tflops == pytest.approx(1000.0)


def test_roofline_picture():
    import matplotlib

    matplotlib.use("Agg")
    pts = [ch01.roofline("a", 1e12, 1e11, 1.0, 4.8e12, 1e15),
           ch01.roofline("b", 1e12, 1e8, 2.0, 4.8e12, 1e15)]
    ax = ch01.plot_roofline(pts, {"HBM": 4.8e12}, {"peak": 1e15})
    assert ax.get_xscale() == "log" and len(ax.get_lines()) == 4
