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
