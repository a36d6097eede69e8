"""fa4_final's torch entry points refuse bad input with a message that says what is accepted
(CPU only: every check runs before anything touches a GPU)."""

import pytest
import torch

from fa4_final.common.errors import UnsupportedError
from fa4_final.hopper.host import l2_section_pairs
from fa4_final.runtime.checks import normalise_window
from fa4_final.runtime.prologue import forward


def qkv(b=1, sq=64, sk=64, h=2, hk=2, d=128, dtype=torch.bfloat16):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


@pytest.mark.parametrize("change, error, match", [
    (dict(dtype=torch.float32), TypeError, "bfloat16, torch.float16"),
    (dict(d=80), ValueError, "head_dim must be one of"),  # 96 runs (head_dims left the gate)
    (dict(h=3, hk=2), ValueError, "multiple of"),
])
def test_bad_shapes_and_dtypes(change, error, match):
    with pytest.raises(error, match=match):
        forward(*qkv(**change))


def test_mismatched_batch_and_dims():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="batch"):
        forward(q, torch.cat([k, k]), torch.cat([v, v]))
    with pytest.raises(ValueError, match="same shape"):
        forward(q, k, v[:, :10])


def test_strides_tma_cannot_read():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="contiguous"):
        forward(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)


def test_a_cpu_tensor_names_the_supported_gpus():
    with pytest.raises(UnsupportedError, match="Hopper"):
        forward(*qkv())


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), True])
def test_softmax_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        forward(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("window, causal, expect", [
    ((None, None), False, (False, None, None)), ((-1, -1), False, (False, None, None)),
    ((None, 0), False, (True, None, 0)), ((10, None), True, (True, 10, 0)),
    ((5, 7), False, (False, 5, 7)), ((None, 3), True, (True, None, 0)),
    # a negative side is a bound; only both negative mean no window (FA4's reading)
    ((None, -1), False, (False, None, -1)), ((-4, None), False, (False, -4, None)),
    ((-2, 5), False, (False, -2, 5)), ((3, -1), False, (False, 3, -1)),
    ((-3, -1), True, (True, None, 0)), ((-3, 9), True, (True, -3, 0)),
])
def test_window_normalisation_negative_sides_are_bounds(window, causal, expect):
    assert normalise_window(causal, window) == expect


@pytest.mark.parametrize("window, match", [
    (5, "pair"), ((1, 2, 3), "pair"), ((1.5, None), "left side must be an int"),
    ((None, True), "right side must be an int"), (("3", None), "left side"),
])
def test_window_errors(window, match):
    with pytest.raises(ValueError, match=match):
        normalise_window(False, window)


def test_l2_sections_fit_l2():
    assert l2_section_pairs(16384, 128, 2, 16) == 4  # 8 MB of K+V per head
    assert l2_section_pairs(10**7, 128, 2, 16) == 1
    assert l2_section_pairs(128, 64, 2, 3) == 2
