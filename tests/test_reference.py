"""The reference is what every kernel is judged by, so it is tested against an independent,
deliberately plain implementation (Python loops, float64)."""

import pytest
import torch

from utils.reference import (
    attention_naive_loops,
    attention_reference,
    causal_mask,
    check_attention_inputs,
    random_qkv,
)

CASES = [
    # batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal
    (1, 5, 5, 1, 1, 8, False),
    (2, 7, 7, 2, 2, 16, True),
    (1, 3, 9, 4, 2, 8, True),  # fewer queries than keys: the last query sees every key
    (1, 9, 3, 2, 1, 8, True),  # more queries than keys: the first rows see nothing
    (2, 6, 11, 4, 1, 4, False),  # MQA
]


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal", CASES)
def test_reference_matches_plain_loops(b, sq, sk, h, hk, d, causal):
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=0.3)
    out_n, lse_n = attention_naive_loops(q, k, v, causal=causal, softmax_scale=0.3)
    assert torch.allclose(out, out_n, atol=1e-12), f"seed {seed}"
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_n))
    finite = torch.isfinite(lse_n)
    assert torch.allclose(lse[finite], lse_n[finite], atol=1e-12)


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    q, k, v, _ = random_qkv(1, 6, 1, 4, seqlen_k=2, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, causal=True)
    # bottom-right alignment: query i sees keys j <= i + 2 - 6, so rows 0..3 see none
    assert torch.all(out[0, :4] == 0)
    assert torch.all(torch.isneginf(lse[0, 0, :4]))
    assert torch.all(torch.isfinite(lse[0, 0, 4:]))


def test_causal_mask_alignment():
    m = causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_same_precision_reference_is_close_but_not_exact():
    q, k, v, _ = random_qkv(1, 64, 2, 32, dtype=torch.bfloat16)
    ref, _ = attention_reference(q, k, v)
    low, _ = attention_reference(q, k, v, dtype=torch.bfloat16)
    err = (low.double() - ref).abs().max().item()
    assert 0 < err < 0.05


@pytest.mark.parametrize(
    "shapes,message",
    [
        (((1, 4, 2, 8), (1, 4, 3, 8), (1, 4, 3, 8)), "multiple of"),
        (((1, 4, 2, 8), (1, 4, 2, 16), (1, 4, 2, 16)), "head dim"),
        (((1, 4, 2), (1, 4, 2, 8), (1, 4, 2, 8)), "4-D"),
        (((2, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)), "batch"),
        (((1, 4, 2, 8), (1, 4, 2, 8), (1, 5, 2, 8)), "same shape"),
    ],
)
def test_bad_shapes_are_named(shapes, message):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        check_attention_inputs(q, k, v)


def test_bad_dtype_and_scale():
    q = torch.zeros(1, 2, 1, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match="dtype"):
        check_attention_inputs(q, q, q)
    f = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match="softmax_scale"):
        check_attention_inputs(f, f, f, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="share a dtype"):
        check_attention_inputs(f, f.double(), f)


def test_window_mask_follows_the_rule():
    """causal_mask with a window against the rule written out entry by entry."""
    from utils.reference import causal_mask

    for sq, sk, window in [(5, 9, (2, 1)), (9, 5, (None, 0)), (7, 7, (0, None)), (4, 6, (3, 3))]:
        left, right = window
        m = causal_mask(sq, sk, window_size=window)
        for i in range(sq):
            for j in range(sk):
                lo = -10**9 if left is None else i + sk - sq - left
                hi = 10**9 if right is None else i + sk - sq + right
                assert bool(m[i, j]) == (lo <= j <= hi), (sq, sk, window, i, j)
    assert bool((causal_mask(6, 4) == causal_mask(6, 4, window_size=(None, 0))).all())


def test_window_reference_is_dense_attention_on_visible_keys():
    import torch

    from utils.reference import attention_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 1, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out, lse = attention_reference(q, k, v, window_size=(1, 1))
    for i in range(6):
        keys = [j for j in range(6) if abs(i - j) <= 1]
        s = (q[0, i, 0] @ k[0, keys, 0].T) * 8**-0.5
        p = torch.softmax(s, dim=-1)
        assert torch.allclose(out[0, i, 0], p @ v[0, keys, 0])
        assert torch.allclose(lse[0, 0, i], torch.logsumexp(s, dim=-1))
