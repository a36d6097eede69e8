"""fa4_final's torch entry points refuse bad input with a message that says what is accepted
(CPU only: every check runs before anything touches a GPU)."""

import pytest
import torch

from fa4_final import interface


def qkv(b=1, sq=64, sk=64, h=2, hk=2, d=128, dtype=torch.bfloat16):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


@pytest.mark.parametrize("change, error, match", [
    (dict(dtype=torch.float32), TypeError, "bfloat16, torch.float16"),
    (dict(d=96), ValueError, "head_dim must be one of"),
    (dict(h=3, hk=2), ValueError, "multiple of"),
])
def test_bad_shapes_and_dtypes(change, error, match):
    with pytest.raises(error, match=match):
        interface.forward(*qkv(**change))


def test_mismatched_batch_and_dims():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="batch"):
        interface.forward(q, torch.cat([k, k]), torch.cat([v, v]))
    with pytest.raises(ValueError, match="same shape"):
        interface.forward(q, k, v[:, :10])


def test_strides_tma_cannot_read():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="contiguous"):
        interface.forward(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)


def test_a_cpu_tensor_names_the_supported_gpus():
    with pytest.raises(interface.UnsupportedError, match="Hopper"):
        interface.forward(*qkv())


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), True])
def test_softmax_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        interface.forward(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("window, causal, expect", [
    ((None, None), False, (False, None, None)), ((-1, -1), False, (False, None, None)),
    ((None, 0), False, (True, None, 0)), ((10, None), True, (True, 10, 0)),
    ((5, 7), False, (False, 5, 7)),
])
def test_window_normalisation(window, causal, expect):
    assert interface._normalise_window(causal, window) == expect


def test_window_errors():
    with pytest.raises(ValueError, match="right side to 0"):
        interface._normalise_window(True, (None, 3))
    with pytest.raises(ValueError, match="pair"):
        interface._normalise_window(False, 5)


def test_l2_sections_fit_l2():
    assert interface.l2_section_pairs(16384, 128, 2, 16) == 4  # 8 MB of K+V per head
    assert interface.l2_section_pairs(10**7, 128, 2, 16) == 1
    assert interface.l2_section_pairs(128, 64, 2, 3) == 2
