"""Chapter 04's KV step as three device-code exercises (solutions/ch04_kv_step.py): the CPU
models the checkers run (GEMM loops with recording stand-ins, a warp of 32 lanes for the softmax)
are faithful to the kernel, the references pass, and the kernel with its pieces swapped for the
references compiles to the kernel's own SASS. Typical wrong answers and the words that name them
are in tests/exercise_mutations/ch04.py."""

import numpy as np
import pytest

from solutions import ch04_cpu_model as cm
from solutions import ch04_flash_ampere as fa
from solutions import ch04_kv_step as kv
from tests.exercise_mutations import ch04 as wrong


def test_the_references_are_the_kernels_own_loops():
    assert kv.gemm_qk is fa.gemm_from_smem and kv.gemm_pv is fa.gemm_from_regs


@pytest.mark.parametrize("check, fn", [(kv.check_gemm_qk, kv.gemm_qk),
                                       (kv.check_gemm_pv, kv.gemm_pv),
                                       (kv.check_online_softmax, kv.online_softmax)])
def test_references_pass_on_the_cpu(check, fn):
    check(fn, compile_check=False)
    check(fn, compile_check=False)  # a second run sees the source as written, not the DSL's


def test_gemm_models_record_the_kernels_order():
    _, _, log = kv.run_gemm(kv.gemm_qk, "qk", 128)
    assert [kind for kind, _, _ in log.loops] == ["range"]
    assert log.loops[0][2] == {"unroll": fa.default_config(128).qk_unroll}
    assert log.gemms == [(("Q", k), ("K", k)) for k in range(8)]
    assert not log.run_time_slots
    assert kv.pv_load_order(kv.gemm_pv) == \
        "ld V0, ld V1, mma P0, ld V2, mma P1, ld V3, mma P2, mma P3"


def test_fragment_coords_are_the_kernels_layout():
    s_xy, o_xy = kv.fragment_coords(128)
    cfg = fa.default_config(128)
    assert s_xy.shape == (cfg.num_threads, 4, cfg.n_block // 4, 2)
    for t in (0, 5, 37, 127):
        assert sorted(map(tuple, s_xy[t].reshape(-1, 2).tolist())) == \
            sorted(cm.thread_s_elements(t, cfg))
        assert (o_xy[t, :, :, 0] == s_xy[t, :, :1, 0]).all()  # O's rows are S's rows
    lanes = np.arange(32)
    assert (s_xy[lanes, 0, 0, 0] == lanes // 4).all()  # a quad shares its rows


def test_softmax_cases_hold_the_hard_rows():
    first, later = kv.softmax_cases()
    assert first["is_first"] and np.isneginf(first["S"][0]).all()
    assert not later["is_first"] and later["grow"] and len(later["grow"]) < len(later["S"])
    truth = kv.softmax_truth(later)
    s_xy, _ = kv.fragment_coords(128)
    for lane in range(32):
        assert np.isfinite(truth["P"][lane]).all() and (truth["P"][lane] <= 1).all()
        rows = s_xy[lane, :, 0, 0]
        empty = np.isin(rows, later["empty"])
        assert (truth["l"][lane][empty] == 0).all() and (truth["l"][lane][~empty] > 0).all()


def test_the_warp_model_is_a_butterfly_and_catches_divergence():
    got = kv.run_softmax(kv.online_softmax, kv.softmax_cases()[1])
    assert all(calls == [("bfly", 2), ("bfly", 1)] * 4 for calls in got["calls"])
    with pytest.raises(AssertionError, match="different numbers of shuffles"):
        kv.run_softmax(wrong.softmax_shuffles_in_a_branch, kv.softmax_cases()[0])


def test_not_done_is_not_a_crash():
    for check, fn in ((kv.check_gemm_qk, wrong.qk_not_done),
                      (kv.check_online_softmax, wrong.softmax_not_done),
                      (kv.check_gemm_pv, wrong.pv_not_done)):
        with pytest.raises(NotImplementedError):
            check(fn, compile_check=False)


def test_expected_mma_counts():
    e = kv._expected_hmma(128)
    assert e["qk_step"] == e["qk_trip"] * e["slices"] // e["unroll"]
    assert 2 * (e["pv_step"] + e["qk_trip"]) == 320  # the kernel's two copies of the step


def test_the_gpu_runner_is_built_without_a_gpu():
    run = kv.attention_into_with(kv.gemm_qk, kv.online_softmax, kv.gemm_pv)
    assert callable(run) and len(kv.GPU_CASES) >= 5


@pytest.mark.slow
def test_the_reference_pieces_compile_to_the_kernels_sass():
    """KernelWithPieces with the three references is the kernel, instruction for instruction;
    the checkers' compiled half passes them."""
    art = kv.compile_with(kv.gemm_qk, kv.online_softmax, kv.gemm_pv)
    assert kv.same_as_kernel(art)
    counts = kv.sass_counts(art)
    assert counts["HMMA"] == 320 and counts["SHFL.BFLY"] == 24 and counts["LDL/STL"] == 0
    for check, fn in ((kv.check_gemm_qk, kv.gemm_qk), (kv.check_online_softmax,
                                                       kv.online_softmax),
                      (kv.check_gemm_pv, kv.gemm_pv)):
        check(fn)
    assert "the kernel's own" in kv.piece_report(kv.gemm_qk, kv.online_softmax, kv.gemm_pv)[-1]


@pytest.mark.slow
def test_a_run_time_index_into_registers_is_local_memory_in_the_sass():
    """What the CPU model names at once (registers indexed by the run-time k), the compiled
    kernel confirms: a stack frame and LDL/STL."""
    counts = kv.sass_counts(kv.compile_with(qk=wrong.qk_registers_by_k))
    assert counts["stack bytes"] > 0 and counts["LDL/STL"] > 0
