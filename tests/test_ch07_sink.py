"""Chapter 07, section 7: the learnable sink in the softmax's last step (exercise 07.5), on the
CPU: the float64 model of where the sink goes, the reference against its checker (lane by lane,
and compiled for sm_90a), and the GPU check's logic through a CPU runner."""

import numpy as np
import pytest

from solutions import ch07_rescaling as ch07
from solutions import ch07_sink
from tests.exercise_mutations import ch07 as wrong7


def test_only_the_sink_against_the_max_in_use_is_exact():
    table = ch07_sink.sink_placements()
    assert table[0]["where"].startswith("once, against the max in use")
    assert table[0]["out error"] < 1e-12 and table[0]["lse error"] < 1e-12
    assert all(r["out error"] > 1e-3 and r["lse error"] > 1e-2 for r in table[1:])
    assert table[0]["lag"] > 1.0, "the model's max in use must really lag the true max"


def test_reference_with_sink_gives_the_sink_to_a_row_without_keys():
    scores = np.array([[0.0, 1.0], [-np.inf, -np.inf]])
    out, lse = ch07_sink.reference_with_sink(scores, np.eye(2), 0.5)
    assert np.allclose(out[1], 0.0) and lse[1] == pytest.approx(0.5)
    w = np.exp(np.array([0.0, np.log(2.0), 0.5]))
    assert lse[0] == pytest.approx(np.log(w.sum()))
    assert np.allclose(out[0], w[:2] / w.sum())


def test_the_stale_state_model_is_chapter_07s_loop():
    scores = ch07_sink.drift_scores(8, 1000)
    v = np.random.default_rng(0).normal(size=(1000, 4))
    m, m_true, l_sum, o, _ = ch07_sink.stale_state(scores, v)
    assert (m <= m_true).all() and (m_true - m <= ch07.FA4_RESCALE_THRESHOLD).all()
    want_out, _ = ch07_sink.reference_with_sink(scores, v, -np.inf)
    assert np.allclose(o / l_sum[:, None], want_out)


def test_checker_accepts_the_reference_on_the_cpu():
    ch07_sink.check_finalize_with_sink(ch07_sink.finalize_with_sink, compile_check=False)


@pytest.mark.slow
def test_checker_accepts_the_reference_compiled_for_sm90a():
    ch07_sink.check_finalize_with_sink(ch07_sink.finalize_with_sink)
    facts = ch07_sink.finalize_sass_facts(ch07_sink.finalize_with_sink)
    assert facts["MUFU.EX2 per row"] == 1 and not facts["local memory"]


def test_cases_hold_stale_maxima_empty_rows_and_extreme_sinks():
    cases = ch07_sink.sink_cases()
    assert any((~np.isfinite(m)).any() for _, m, *_ in cases)
    for what, m, l_sum, _sink, lse in cases:
        seen = np.isfinite(m)
        assert (l_sum[seen] >= 1.0).all(), what  # the max in use never exceeds the true max
        assert np.isfinite(lse).all(), what
    sinks = [c[3] for c in cases]
    assert max(sinks) - min(sinks) > 100


def test_gpu_check_judges_through_a_cpu_runner():
    case = ch07_sink.gpu_sink_cases()[1]
    ok, lines = ch07_sink.check_finalize_with_sink_on_gpu(
        ch07_sink.finalize_with_sink, run=ch07_sink.emulate_sink_kernel, cases=[case])
    assert ok, "\n".join(lines)
    ok, lines = ch07_sink.check_finalize_with_sink_on_gpu(
        wrong7.sink_nan_on_empty_row, run=ch07_sink.emulate_sink_kernel, cases=[case])
    assert not ok and "WRONG" in lines[0]


@pytest.mark.slow
def test_the_gpu_kernel_compiles_for_sm90a():
    from cutlass import Float32

    from utils.compile_only import compile_for, fake_stream, fake_tensor

    art = compile_for("sm_90a", ch07_sink.SinkRows(ch07_sink.finalize_with_sink),
                      fake_tensor(Float32, (None, None, None)),
                      fake_tensor(Float32, (None, ch07.HEAD_DIM)), fake_tensor(Float32, (None,)),
                      fake_tensor(Float32, (None, None, ch07.HEAD_DIM)),
                      fake_tensor(Float32, (None, None)), fake_stream())
    assert "ex2.approx" in art.ptx and "rcp.approx" in art.ptx
