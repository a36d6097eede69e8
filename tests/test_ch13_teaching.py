"""Chapter 13's helpers (solutions/ch13_teaching.py): the checkers of exercises 13.1 and 13.2 pass
the solutions and name the usual mistakes; the readers of the stored files work on rows of the
shapes measure/package_sweep.py writes, and say "not measured yet" for a file that is absent."""

import matplotlib
import pytest

from solutions import ch13_teaching as t13
from tests.fake_sweeps import fake
from tests.fake_sweeps import sweep as fake_sweep
from utils.results import load

matplotlib.use("Agg")


def sweep():
    return fake_sweep(t13.PASSES)


# ----------------------------------------------------------------------------------------------
# exercises


def test_check_sink_solution_passes_and_mistakes_are_named():
    import numpy as np

    t13.check_check_sink(t13.check_sink_tokens)
    assert t13.check_sink_tokens(np.int64(3), (10, 0)) == 3
    for bad in (True, 2.0, -1):
        with pytest.raises((TypeError, ValueError)):
            t13.check_sink_tokens(bad, (64, 0))
    with pytest.raises(ValueError, match="left"):
        t13.check_sink_tokens(4, (-2, -1))
    assert t13.check_sink_tokens(4, (-2, 5)) == 4  # a negative left side is a bound


normalise_window = t13.package_window_reader()


def test_sink_check_refuses_the_package_window_reader():
    from utils.exercises import judge

    def via_package(sink_tokens, window_size=None, causal=False):
        _, left, _ = normalise_window(causal, window_size)
        if sink_tokens and left is None:
            raise ValueError(f"sink_tokens={sink_tokens} needs a left side")
        return int(sink_tokens)

    said = judge(t13.check_check_sink, via_package, t13.check_sink_tokens,
                 t13.SINK_CHECK_FORBID)
    assert said is not None and "normalise_window" in said


def test_kernel_key_solution_passes_and_mistakes_are_named():
    t13.check_kernel_key(t13.kernel_key)
    with pytest.raises(AssertionError, match="changing batch"):
        t13.check_kernel_key(lambda c: tuple(sorted((k, repr(v)) for k, v in c.items())))
    with pytest.raises(AssertionError, match="window sizes"):
        t13.check_kernel_key(lambda c: (*t13.kernel_key(c), c["window_size"]))
    with pytest.raises(AssertionError, match="config"):
        t13.check_kernel_key(lambda c: t13.kernel_key(c)[:-1])
    with pytest.raises(AssertionError, match="object address"):
        t13.check_kernel_key(lambda c: (*t13.kernel_key(c), object()))
    with pytest.raises(AssertionError, match="hashable"):
        t13.check_kernel_key(lambda c: list(t13.kernel_key(c)))


def test_refusal_reports_the_error_or_acceptance():
    import torch

    from fa4_final import flash_attn_func

    q = torch.empty(1, 8, 2, 80, dtype=torch.bfloat16)  # no build at 80 (96 runs: head_dims)
    assert t13.refusal(lambda: flash_attn_func(q, q, q)).startswith("UnsupportedError: head_dim")
    q = torch.empty(1, 8, 2, 96, dtype=torch.bfloat16)
    assert t13.refusal(lambda: flash_attn_func(q, q, q)).startswith(
        "UnsupportedError: fa4_final runs on CUDA GPUs")
    assert t13.refusal(lambda: None) == "accepted"


# ----------------------------------------------------------------------------------------------
# the chapter's readers


def test_headline_lines_and_verdicts_follow_the_data():
    res = sweep()
    text = t13.headline_lines(res)
    lines = text.splitlines()
    assert lines[0].startswith("[package_sweep] measured on NVIDIA H200")
    assert all(" 512 " not in ln and " 32768 " not in ln for ln in lines[2:])
    assert len(lines) == 2 + 3 * 2 * 2 * 1  # passes x dims x causal x the one headline S here
    assert any("faster" in ln for ln in lines) and any("slower" in ln for ln in lines)
    verdicts = t13.headline_verdicts(res)
    assert verdicts.count("shapes") == 3 and "faster at 2, within noise at 0, slower at 2" in \
        verdicts
    assert t13.headline_ratio(res, "fwd", 64, 4096, False) == pytest.approx(1.1 / 1.003)
    assert t13.headline_lines(None) == "not measured yet"


def test_stored_headline_sweep_reads():
    res = load(t13.SWEEP)
    assert "best peer" in t13.headline_lines(res)
    assert 0.5 < t13.headline_ratio(res) < 2


def test_compile_times_table_and_fractions():
    stored = load("compile_times", gpu="cpu")
    table = t13.compile_times_table(stored.rows)
    assert table.splitlines()[0].startswith("case") and "D=128 bf16" in table
    fractions = t13.warm_over_cold(stored.rows)
    assert (128, False) in fractions and all(0 < f < 1 for f in fractions.values())


def test_accuracy_table_and_summary():
    case = {"dtype": "bf16", "b": 1, "sq": 1000, "sk": 1000, "h": 8, "h_kv": 8, "d": 128,
            "causal": False}
    rows = []
    for impl, err in (("fa4_final", 2e-3), ("sdpa_flash", 4e-3), ("fa4_package", 1e-3)):
        rows += [{**case, "impl": impl, "tensor": t, "metric": "max_abs_err", "value": err,
                  "unit": "", "rel_err": err, "finite": True} for t in t13.TENSORS]
    rows.append({**case, "causal": True, "sq": 333, "impl": "sdpa_flash", "metric": "max_abs_err",
                 "value": None, "unit": "", "error": "not compared: top-left mask"})
    res = fake("package_accuracy", rows)
    table = t13.accuracy_table(res)
    assert "not compared" in table and "2.00e-03" in table
    assert "out: fa4_final's error is at most 2.00x the most accurate peer's" in \
        t13.accuracy_summary(res)
    assert t13.accuracy_table(None) == "not measured yet"


    assert max(t13.accuracy_ratios(res)) == pytest.approx(2.0)


def test_training_summary_and_plot():
    res = load("fa4_final_training")
    text = t13.training_summary(res)
    assert "within the band" in text and "ms per training step" in text
    assert set(t13.training_losses(res)) >= {"fa4_final", "sdpa_flash"}
    t13.plot_training(res)
    assert t13.training_gap(res)["ok"]


def test_sink_mask_picture():
    fig = t13.plot_sink_mask()
    assert len(fig.axes) == 2
