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


def test_causal_checker_accepts_the_solution():
    ch01.check_causal_attention(ch01.attention)


def test_peak_checker_accepts_the_reference_and_the_formula():
    ch01.check_peak_bytes(ch01.naive_peak_bytes)
    ch01.check_peak_bytes(lambda b, h, sq, sk, d: 2 * b * h * (sq + 2 * sk) * d
                          + 6 * b * h * sq * sk)


def test_stored_run_readings():
    from utils import results

    v = results.load("ch01_ch02_fwd", gpu="h200")
    peer, ratio = ch01.best_peer_over_naive(v)
    assert peer != "naive" and ratio > 1
    pts = ch01.naive_points(v, 4.8e12, 989e12)
    assert pts and all(pt.memory_bound for _, pt, _ in pts)


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
