"""Chapter 11: the backward's math and tile loop against torch.autograd in float64, the pieces'
checkers (right answers pass, typical mistakes are named), the counts."""

import math

import pytest
import torch

from solutions import ch11_backward as ch11
from utils.reference import attention_reference, random_qkv

# (b, sq, sk, h, hk, d, tile_m, tile_n): lengths off the tiles, sq != sk both ways, GQA, MQA,
# a tile larger than the sequence, one query row
CASES = [(2, 75, 110, 4, 2, 16, 32, 48), (1, 110, 75, 4, 1, 16, 64, 32),
         (1, 1, 70, 2, 1, 8, 16, 16), (1, 50, 50, 2, 2, 8, 128, 128),
         (1, 129, 63, 2, 1, 16, 64, 16)]


def _grads(case, causal, dtype=torch.float64):
    b, sq, sk, h, hk, d, tm, tn = case
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype, scale=1.5)
    dout = torch.randn(b, sq, h, d, dtype=torch.float64).to(dtype)
    return q, k, v, dout, seed


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_loop_matches_autograd(case, causal):
    q, k, v, dout, seed = _grads(case, causal)
    tm, tn = case[-2:]
    out, lse = attention_reference(q, k, v, causal)
    counts = ch11.BackwardCounts()
    got = ch11.attention_backward_tiles(q, k, v, out, lse, dout, causal, tile_m=tm, tile_n=tn,
                                        counts=counts)
    want = ch11.backward_reference(q, k, v, dout, causal)
    math_ = ch11.backward_math(q, k, v, dout, causal)
    for g, w, m in zip(got, want, math_):
        assert g.shape == w.shape and not torch.isnan(g).any(), seed
        assert torch.allclose(g, w, atol=1e-10), (seed, (g - w).abs().max())
        assert torch.allclose(m, w, atol=1e-10), seed
    n_q, n_kv = -(-case[1] // tm), -(-case[2] // tn)
    assert counts.total == n_q * n_kv
    assert counts.gemm_flops <= ch11.backward_flops(1, case[3], case[1], case[2], case[5]) * (
        1 + tm / case[1] + tn / case[2])


def test_empty_rows_give_zero_dq():
    # causal with seqlen_q > seqlen_k: the first rows see no key at all
    q, k, v, _ = random_qkv(1, 40, 2, 8, seqlen_k=10, dtype=torch.float64)
    dout = torch.randn_like(q)
    out, lse = attention_reference(q, k, v, True)
    dq, dk, dv = ch11.attention_backward_tiles(q, k, v, out, lse, dout, True, tile_m=16,
                                               tile_n=8)
    assert torch.isinf(lse[..., :30]).all()
    assert (dq[:, :30] == 0).all() and not torch.isnan(dk).any()


@pytest.mark.parametrize("seed", range(3))
def test_bf16_loop_is_as_accurate_as_pytorch(seed):
    # the course's rule: within 2 x PyTorch's own bf16 error (the loop keeps S and the sums in
    # float32; about half PyTorch's error with a forward whose lse matches those scores)
    q, k, v, _ = random_qkv(1, 200, 2, 64, heads_kv=1, dtype=torch.bfloat16, seed=seed)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).bfloat16()
    got = ch11.backward(q, k, v, dout, causal=True)
    ref = ch11.backward_reference(q, k, v, dout, True)
    same = ch11.backward_reference(q, k, v, dout, True, dtype=torch.bfloat16)
    for g, r, s in zip(got, ref, same):
        assert (g.double() - r).abs().max() <= 2 * (s.double() - r).abs().max(), seed


@pytest.mark.parametrize("check,fn", [
    (ch11.check_softmax_delta, ch11.softmax_delta),
    (ch11.check_tile_step, ch11.tile_step),
    (ch11.check_first_q_tile, ch11.first_q_tile),
    (ch11.check_dq_add_bytes, ch11.dq_add_bytes),
])
def test_reference_pieces_pass_their_checks(check, fn):
    check(fn)


def test_recompute_p_gives_zero_for_rows_that_see_no_key():
    s = torch.full((1, 3, 4), float("-inf"), dtype=torch.float64)
    s[0, 0] = torch.tensor([0.5, -1.0, 2.0, 0.0])
    lse = torch.tensor([[torch.logsumexp(s[0, 0] / ch11.LOG2E, 0), float("-inf"),
                         float("-inf")]], dtype=torch.float64)
    p = ch11.recompute_p(s, lse)
    assert not torch.isnan(p).any() and (p[0, 1:] == 0).all()
    assert torch.allclose(p[0, 0].sum(), torch.tensor(1.0, dtype=torch.float64))
    ds = ch11.ds_from_dp(p, torch.ones_like(p), torch.ones(1, 3, dtype=torch.float64))
    assert (ds == 0).all()


def test_checks_name_the_mistake():
    with pytest.raises(AssertionError, match="float32"):
        ch11.check_softmax_delta(lambda o, do: (o * do).sum(-1).transpose(1, 2))
    with pytest.raises(AssertionError, match="every Q tile"):
        ch11.check_first_q_tile(lambda k0, sq, sk, tm, causal: k0 // tm)
    with pytest.raises(AssertionError, match="skips"):
        ch11.check_dq_add_bytes(lambda sq, sk, d, tm, tn, causal: (
            -(-sq // tm)) * (-(-sk // tn)) * tm * d * 4)
    with pytest.raises(NotImplementedError):
        def todo(*a):
            raise NotImplementedError
        ch11.check_tile_step(todo)


def test_flops_and_traffic():
    assert ch11.backward_flops(2, 3, 5, 7, 11) / ch11.forward_flops(2, 3, 5, 7, 11) == 2.5
    assert ch11.backward_flops(1, 1, 8, 8, 8, True) == 0.5 * ch11.backward_flops(1, 1, 8, 8, 8)
    t = ch11.backward_traffic(4096, 4096, 128, tile_n=128)
    # the accumulator traffic is n_kv = 32 float32 read-modify-writes of dQ
    assert t.dq_accum_bytes == 32 * 2 * 4 * 4096 * 128
    assert math.isclose(t.flops, 10 * 4096**2 * 128)


def test_dq_add_bytes_counts_the_visited_tiles():
    # non-causal: every pair; causal, seqlen_q = seqlen_k = 4096, tiles 64 x 128: key tile n
    # skips 2 n query tiles, so 64 + 62 + ... + 2 pairs
    block = 64 * 128 * 4
    assert ch11.dq_add_bytes(4096, 4096, 128, 64, 128, False) == 64 * 32 * block
    assert ch11.dq_add_bytes(4096, 4096, 128, 64, 128, True) == sum(
        64 - 2 * n for n in range(32)) * block


def test_float32_sums_depend_on_order():
    q, k, v, _ = random_qkv(1, 64, 1, 32, seqlen_k=256, dtype=torch.bfloat16, seed=0)
    parts = ch11.dq_parts(q, k, v, torch.randn_like(q), tile_n=32)
    assert len(parts) == 8
    assert ch11.sum_orders(parts, orders=30) > 1
    assert ch11.sum_orders(parts[:1], orders=5) == 1
