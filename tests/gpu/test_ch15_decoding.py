"""Chapter 15's device-code exercises on a Hopper GPU, and its CUDA-graph cell: the combine of
one row's split partials (15.1) against float64 with NaN partials for splits that saw no key,
the paged key row (15.2) bit for bit against torch's gather, typical wrong answers caught on the
GPU too, and fa4_final's combine captured in a CUDA graph and replayed on new partials."""

import pytest
import torch

from solutions import ch15_decoding as t15

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available()
                            and torch.cuda.get_device_capability() == (9, 0)),
                       reason="needs a Hopper GPU (sm_90)"),
]


def test_decode_combine_row_reference_on_gpu():
    ok, lines = t15.check_combine_on_gpu(t15.combine_row)
    assert ok, "\n".join(lines)


def test_decode_combine_row_that_reads_empty_splits_fails_on_gpu():
    from tests.exercise_mutations import ch15 as wrong

    ok, lines = t15.check_combine_on_gpu(wrong.combine_reads_every_split)
    assert not ok, "\n".join(lines)


def test_paged_gather_row_reference_on_gpu():
    ok, lines = t15.check_gather_on_gpu(t15.gather_key_row)
    assert ok, "\n".join(lines)


def test_paged_gather_row_with_the_slot_as_page_fails_on_gpu():
    from tests.exercise_mutations import ch15 as wrong

    ok, lines = t15.check_gather_on_gpu(wrong.gather_slot_as_page)
    assert not ok, "\n".join(lines)


def test_split_kv_combine_replayed_in_a_cuda_graph():
    ok, lines = t15.graph_replay_combine()
    assert ok, "\n".join(lines)
