"""Ring attention with fa4_final's kernels inside (solutions/ch14_ring.py), on Hopper GPUs.

With one GPU: 2 ranks share it, as 2 processes joined by gloo (the K, V pieces move through host
memory), so fa4_final's forward and backward run inside the ring at global offsets (the causal
mask as a window) and are checked against float64 (ch14_ring.check_on_gpus). With two or more
GPUs: one rank per GPU over NCCL. Also chapter 14's device-code exercises (the merge kernels)
against float64 on awkward row counts. Run: ``pytest -q -m gpu tests/gpu/test_ring_attention.py``.
"""

from __future__ import annotations

import pytest
import torch

from solutions import ch14_ring as ring

pytestmark = pytest.mark.gpu


def test_ring_fa4_kernels_two_ranks_on_one_gpu():
    ok, lines = ring.check_on_gpus(2, "gloo")
    print("\n".join(lines))
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs for NCCL")
def test_ring_fa4_kernels_over_nccl():
    ok, lines = ring.check_on_gpus(min(torch.cuda.device_count(), 4), "nccl")
    print("\n".join(lines))
    assert ok, "\n".join(lines)


def test_ring_merge_exercises_on_gpu():
    from solutions import ch14_teaching as t14

    for kwargs in ({"pair": t14.merge_pair}, {"step": t14.merge_step}):
        ok, lines = t14.check_merge_on_gpu(**kwargs)
        assert ok, "\n".join(lines)
