"""Chapters 01-02 on a CUDA GPU: the PyTorch versions on the device, and the memory prediction
against torch.cuda.max_memory_allocated."""

import pytest
import torch

from solutions import ch01_naive as ch01
from solutions import ch02_online_softmax as ch02
from utils.checks import check_attention
from utils.reference import random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(2, 1000, 1000, 8, 8, 128), (1, 300, 1234, 8, 2, 64), (1, 1234, 300, 4, 1, 128)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", [ch01.attention, ch02.attention])
def test_versions_on_the_gpu(version, shape, causal):
    b, sq, sk, h, hk, d = shape
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=torch.bfloat16,
                               device="cuda")
    out, lse = version(q, k, v, causal=causal)
    assert out.is_cuda and lse.is_cuda
    check_attention(version, q, k, v, causal=causal)


@pytest.mark.parametrize("b, h, sq, sk, d, causal", [(1, 16, 4096, 4096, 128, False),
                                                    (2, 8, 2048, 3000, 64, True)])
def test_predicted_peak_memory_on_the_gpu(b, h, sq, sk, d, causal):
    """The prediction counts tensor bytes; the caching allocator rounds each block up to
    512 bytes and reductions may take a little scratch: 2% covers both."""
    q, k, v, _ = random_qkv(b, sq, h, d, seqlen_k=sk, dtype=torch.bfloat16, device="cuda")
    measured = ch01.measure_peak_bytes(ch01.attention, q, k, v, causal=causal)
    predicted = ch01.predict_peak_bytes(b, h, sq, sk, d, torch.bfloat16, causal)
    assert "max_memory_allocated" in measured.method
    assert abs(measured.bytes - predicted.peak) <= 0.02 * predicted.peak, (
        measured.bytes, predicted.peak, predicted.stages)
