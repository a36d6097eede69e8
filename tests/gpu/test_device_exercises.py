"""The device-code exercises on a GPU: each reference solution inside its small kernel (or the
whole attention kernel) against PyTorch or float64 on awkward shapes, and typical wrong answers,
to show the GPU check catches what the CPU check names.

Wrong answers live in tests/exercise_mutations/chNN.py (the DSL reads kernels' source from
files), shared with the CPU tests."""

import pytest
import torch

from solutions import ch03_cute_basics as ch03

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# --- chapter 03: the tiled copy's partition (03.3), the GEMM's epilogue (03.5) -----------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 8), (37, 264), (16, 256), (1000, 72), (4097, 520)])
def test_copy_partition_reference_on_gpu(shape, dtype):
    ok, line = ch03.check_copy_on_gpu(ch03.copy_partition, shape, dtype, seed=shape[0])
    assert ok, line


def test_copy_partition_without_predicate_writes_outside_on_gpu():
    from tests.exercise_mutations import ch03 as wrong3

    ok, line = ch03.check_copy_on_gpu(wrong3.partition_no_predicate, (37, 264), torch.bfloat16)
    assert not ok and "outside the tensor" in line, line


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mnk", [(77, 136, 40), (64, 64, 64), (5, 3, 8), (1000, 130, 264),
                                 (130, 1000, 72)])
def test_epilogue_reference_on_gpu(mnk, dtype):
    ok, line = ch03.check_epilogue_on_gpu(ch03.store_accumulators, mnk, dtype, seed=mnk[0])
    assert ok, line


@pytest.mark.parametrize("name, words", [("epilogue_no_predicate", "past the end of C"),
                                         ("epilogue_lane_not_thread", "never written")])
def test_a_wrong_epilogue_is_wrong_on_gpu(name, words):
    from tests.exercise_mutations import ch03 as wrong3

    ok, line = ch03.check_epilogue_on_gpu(getattr(wrong3, name), (77, 136, 40))
    assert not ok and words in line, line


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


# --- chapter 05: the producer's loop (05.4), the turn's GEMMs (05.5), the epilogue (05.6) ------
# Each inside the whole attention kernel, against float64 on awkward shapes. Wrong answers live
# in tests/exercise_mutations/ch05.py.


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90): TMA, wgmma")
@pytest.mark.parametrize("producer", ["reference", "v_first"])
def test_producer_loop_inside_the_kernel_on_hopper(producer):
    from solutions import ch05_teaching as t5
    from tests.exercise_mutations import ch05 as wrong5

    fn = t5.load_kv if producer == "reference" else wrong5.load_v_first_in_each_turn
    ok, lines = t5.check_load_kv_on_gpu(fn)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90): TMA, wgmma")
@pytest.mark.parametrize("turn", ["reference", "own helper"])
def test_gemm_turn_inside_the_kernel_on_hopper(turn):
    from solutions import ch05_consumer as c5
    from tests.exercise_mutations import ch05 as wrong5

    fn = c5.gemm_turn if turn == "reference" else wrong5.turn_with_own_helper
    ok, lines = c5.check_gemm_turn_on_gpu(fn)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90): TMA, wgmma")
def test_gemm_turn_that_accumulates_s_is_wrong_on_hopper():
    from solutions import ch05_consumer as c5
    from tests.exercise_mutations import ch05 as wrong5

    ok, lines = c5.check_gemm_turn_on_gpu(wrong5.turn_s_accumulates, cases=c5.GPU_CASES[4:5])
    assert not ok, lines


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90): TMA, wgmma")
def test_store_o_inside_the_kernel_on_hopper():
    from solutions import ch05_consumer as c5

    ok, lines = c5.check_store_o_on_gpu(c5.store_o)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90): TMA, wgmma")
def test_store_o_from_every_warp_is_only_slower_on_hopper():
    """Every consumer warp storing the whole tile is refused by the checker (wasteful) yet gives
    the right answer: the GPU check cannot tell, the recorder can."""
    from solutions import ch05_consumer as c5
    from tests.exercise_mutations import ch05 as wrong5

    ok, lines = c5.check_store_o_on_gpu(wrong5.store_from_every_warp, cases=c5.GPU_CASES[:2])
    assert ok, "\n".join(lines)


# --- chapter 08: the ping-pong turn (08.1) and the persistent tile loop (08.2) -----------------
# Both run inside fa4_final's Hopper forward (ch08_teaching.HopperExercise) against float64 on
# awkward shapes. A turn or a loop that only unbalances or reorders passes here: the order of
# the turns and the balance of the tiles change the time, not the values, which is why their
# checkers on the CPU simulate and count instead.


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90): TMA, wgmma")
@pytest.mark.parametrize("which", ["turn", "tiles"])
def test_ch08_exercise_references_inside_the_kernel_on_hopper(which):
    from solutions import ch08_teaching as t08

    fn = t08.pingpong_turn if which == "turn" else t08.tile_loop
    ok, lines = t08.check_on_gpu(which, fn)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90): TMA, wgmma")
def test_ch08_round_robin_tiles_are_right_but_unbalanced_on_hopper():
    from solutions import ch08_teaching as t08

    ok, lines = t08.check_on_gpu("tiles", t08.round_robin_loop, t08.EXERCISE_GPU_CASES[:3])
    assert ok, "\n".join(lines)
    assert t08.schedule_balance_of(t08.round_robin_loop)["imbalance"] > 0.05


# --- chapter 07: the decision and its warp vote (07.2), the step (07.3) -----------------------


@pytest.mark.skipif(not _hopper(), reason="compiled for sm_90a")
def test_running_max_reference_on_gpu():
    from solutions import ch07_rescaling as ch07

    ok, lines = ch07.check_running_max_on_gpu(ch07.running_max)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="compiled for sm_90a")
def test_softmax_step_reference_on_gpu():
    from solutions import ch07_rescaling as ch07

    ok, lines = ch07.check_softmax_step_on_gpu(ch07.softmax_step)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="compiled for sm_90a")
def test_step_without_the_row_sum_correction_is_wrong_on_gpu():
    from solutions import ch07_rescaling as ch07
    from tests.exercise_mutations import ch07 as wrong7

    ok, lines = ch07.check_softmax_step_on_gpu(wrong7.step_no_alpha_on_l)
    assert not ok, "\n".join(lines)


# --- chapter 04: the KV step's three pieces (04.3 QK^T, 04.4 the softmax, 04.5 PV) ------------


def _ampere() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


@pytest.mark.skipif(not _ampere(), reason="needs an Ampere-or-newer GPU (sm_80+)")
@pytest.mark.parametrize("piece", ["qk", "softmax", "pv", "all"])
def test_kv_step_references_inside_the_kernel_on_gpu(piece):
    from solutions import ch04_kv_step as kv

    refs = {"qk": kv.gemm_qk, "softmax": kv.online_softmax, "pv": kv.gemm_pv}
    pieces = refs if piece == "all" else {piece: refs[piece]}
    ok, lines = kv.check_pieces_on_gpu(**pieces)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _ampere(), reason="needs an Ampere-or-newer GPU (sm_80+)")
@pytest.mark.parametrize("piece, name", [("softmax", "softmax_no_o_rescale"),
                                         ("softmax", "softmax_no_guard"),
                                         ("pv", "pv_slot_off_by_one"),
                                         ("qk", "qk_first_slice_of_k")])
def test_a_wrong_kv_step_piece_is_wrong_on_gpu(piece, name):
    """What the CPU check names, the GPU shows: the kernel with the slip is off float64."""
    from solutions import ch04_kv_step as kv
    from tests.exercise_mutations import ch04 as wrong4

    ok, lines = kv.check_pieces_on_gpu(**{piece: getattr(wrong4, name)})
    assert not ok, "\n".join(lines)


# --- chapter 11: the pointwise step (11.5) and the deterministic turn (11.6) -------------------
# Both inside fa4_final's Hopper backward (ch11_ds_step.HopperDsStep, ch11_turns.HopperTurns),
# pre- and postprocess kernels around them, against float64 autograd on awkward shapes.


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
def test_ch11_ds_step_reference_inside_the_backward_on_hopper():
    from solutions import ch11_ds_step as ds

    ok, lines = ds.check_ds_step_on_gpu(ds.ds_step)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("name", ["ds_mask_off_by_one", "ds_delta_outside"])
def test_ch11_a_wrong_ds_step_is_wrong_on_hopper(name):
    from solutions import ch11_ds_step as ds
    from tests.exercise_mutations import ch11 as wrong11

    ok, lines = ds.check_ds_step_on_gpu(getattr(wrong11, name))
    assert not ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
def test_ch11_turn_reference_is_bitwise_deterministic_on_hopper():
    from solutions import ch11_turns as turns

    ok, lines = turns.check_add_in_turn_on_gpu(turns.add_in_turn)
    assert ok, "\n".join(lines)


# --- chapter 13: the sink mask (13.3) and the softcap (13.4) ------------------------------------
# Both inside fa4_final's Hopper forward (ch13_scores.HopperWithScores: the kernel's mask step
# swapped while it is traced, every visited key tile masked), against float64 on awkward shapes.


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
def test_ch13_sink_mask_reference_inside_the_forward_on_hopper():
    from solutions import ch13_scores as t13s

    ok, lines = t13s.check_sink_mask_on_gpu(t13s.sink_mask)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
def test_ch13_softcap_reference_inside_the_forward_on_hopper():
    from solutions import ch13_scores as t13s

    ok, lines = t13s.check_softcap_on_gpu(t13s.softcap_scores)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("which, name", [("mask", "mask_without_sinks"),
                                         ("mask", "sinks_past_the_right_side"),
                                         ("softcap", "softcap_unscaled")])
def test_ch13_a_wrong_answer_is_wrong_on_hopper(which, name):
    from solutions import ch13_scores as t13s
    from tests.exercise_mutations import ch13 as wrong13

    check, cases = ((t13s.check_sink_mask_on_gpu, t13s.SINK_GPU_CASES) if which == "mask"
                    else (t13s.check_softcap_on_gpu, t13s.SOFTCAP_GPU_CASES))
    ok, lines = check(getattr(wrong13, name), cases=cases[:1])  # each case compiles a kernel
    assert not ok, "\n".join(lines)


# --- chapter 07: the learnable sink in the last step (07.5) ------------------------------------


@pytest.mark.skipif(not _hopper(), reason="compiled for sm_90a")
def test_ch07_finalize_with_sink_reference_on_gpu():
    from solutions import ch07_sink

    ok, lines = ch07_sink.check_finalize_with_sink_on_gpu(ch07_sink.finalize_with_sink)
    assert ok, "\n".join(lines)


@pytest.mark.skipif(not _hopper(), reason="compiled for sm_90a")
@pytest.mark.parametrize("name", ["sink_without_the_max", "sink_nan_on_empty_row"])
def test_ch07_a_wrong_sink_is_wrong_on_gpu(name):
    from solutions import ch07_sink
    from tests.exercise_mutations import ch07 as wrong7

    ok, lines = ch07_sink.check_finalize_with_sink_on_gpu(getattr(wrong7, name))
    assert not ok, "\n".join(lines)
