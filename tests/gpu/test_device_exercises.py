"""The device-code exercises of chapters 03-05 on a GPU: each reference solution inside its
small kernel (or, for 05.4, inside the whole attention kernel) against PyTorch, and one typical
wrong answer per exercise, to show the GPU check catches what the CPU check names.

Wrong answers live in tests/device_exercise_mistakes.py (the DSL reads kernels' source from
files), shared with the CPU tests."""

import pytest
import torch

from solutions import ch03_cute_basics as ch03
from solutions import ch04_teaching as t4
from tests import device_exercise_mistakes as wrong

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 8), (37, 264), (16, 256), (1000, 72), (4097, 520)])
def test_copy_partition_reference_on_gpu(shape, dtype):
    ok, line = ch03.check_copy_on_gpu(ch03.copy_partition, shape, dtype, seed=shape[0])
    assert ok, line


def test_copy_partition_without_predicate_writes_outside_on_gpu():
    ok, line = ch03.check_copy_on_gpu(wrong.partition_no_predicate, (37, 264), torch.bfloat16)
    assert not ok and "outside the tensor" in line, line


def test_quad_allreduce_reference_on_gpu():
    ok, line = t4.check_quad_allreduce_on_gpu(t4.quad_allreduce)
    assert ok, line


def test_quad_allreduce_over_eight_lanes_is_wrong_on_gpu():
    ok, line = t4.check_quad_allreduce_on_gpu(wrong.allreduce_eight_lanes)
    assert not ok, line


def test_mask_reference_on_gpu():
    ok, lines = t4.check_mask_on_gpu(t4.mask_scores)
    assert ok, lines


def test_top_left_mask_is_wrong_on_gpu():
    ok, lines = t4.check_mask_on_gpu(wrong.mask_top_left)
    assert not ok, lines


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90): TMA, wgmma")
@pytest.mark.parametrize("producer", ["reference", "v_first"])
def test_producer_loop_inside_the_kernel_on_hopper(producer):
    from solutions import ch05_teaching as t5

    fn = t5.load_kv if producer == "reference" else wrong.load_v_first_in_each_turn
    ok, lines = t5.check_load_kv_on_gpu(fn)
    assert ok, "\n".join(lines)


# --- chapter 06: exp2 in device code (06.4) and the split of a row (06.5) ---------------------


@pytest.mark.skipif(not _hopper(), reason="compiled for sm_90a")
def test_exp2_device_reference_on_gpu():
    from solutions import ch06_exp2 as ch06

    ok, lines = ch06.check_exp2_device_on_gpu(ch06.exp2_device)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="compiled for sm_90a")
def test_exp2_whose_clamp_drops_nan_differs_on_gpu():
    from solutions import ch06_exp2 as ch06
    from tests.exercise_mutations import ch06 as wrong6

    ok, lines = ch06.check_exp2_device_on_gpu(wrong6.exp2_clamp_drops_nan)
    assert not ok and "first difference at x = " in lines[0], lines


@pytest.mark.skipif(not _hopper(), reason="compiled for sm_90a")
def test_exp2_split_reference_on_gpu():
    from solutions import ch06_exp2 as ch06

    ok, lines = ch06.check_exp2_split_on_gpu(ch06.exp2_split)
    assert ok, "\n".join(lines)
