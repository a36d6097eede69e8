"""Chapter 13's helpers: the exercise checkers pass the solutions and name the usual mistakes;
the readers of the stored files work on rows of the shapes ch12_sweep.py and ch12_varlen_bench.py
write, and say "not measured yet" for a file that is absent."""

from pathlib import Path

import matplotlib
import pytest

from solutions import ch13_teaching as t13
from utils.results import Results, load

matplotlib.use("Agg")

PROV = {"gpu": "NVIDIA H200", "driver": "x", "cuda": "13.0", "torch": "2.11", "cutlass_dsl": "4",
        "commit": "abc", "date": "2026-12-01 00:00 UTC", "command": "test"}


def fake(name, rows):
    return Results(name, Path(f"{name}.json"), PROV, rows)


def timed(impl, pass_, d, s, causal, tflops, spread=0.01):
    ms = 1000.0 / tflops
    return {"impl": impl, "pass": pass_, "dtype": "bf16", "b": 16384 // s, "s": s, "h": 16,
            "d": d, "causal": causal, "ms": ms, "tflops": tflops, "spread": spread,
            "ms_rounds": [ms] * 3}


def sweep():
    rows = []
    for pass_ in t13.PASSES:
        for d in (64, 128):
            for s in (512, 4096, 32768):
                for causal in (False, True):
                    base = 300 + s / 100
                    ours = base * (1.1 if d == 64 else 0.9)
                    rows += [timed("fa4_final", pass_, d, s, causal, ours),
                             timed("sdpa_flash", pass_, d, s, causal, base * 0.7),
                             timed("sdpa_cudnn", pass_, d, s, causal, base),
                             timed("fa4_package", pass_, d, s, causal, base * 1.003)]
    return fake("ch12_sweep", rows)


# ----------------------------------------------------------------------------------------------
# exercises


def test_check_heads_solution_passes_and_mistakes_are_named():
    t13.check_check_heads(t13.check_heads)

    def no_gqa(q, k):
        h, d = q.shape[-2:]
        if d not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {d}")
        return h, k.shape[-2], d

    with pytest.raises(AssertionError, match="must be refused"):
        t13.check_check_heads(no_gqa)

    def vague(q, k):
        try:
            return t13.check_heads(q, k)
        except ValueError:
            raise ValueError("bad input") from None

    with pytest.raises(AssertionError, match="does not name"):
        t13.check_check_heads(vague)

    def modulo_first(q, k):
        h, hk = q.shape[-2], k.shape[-2]
        if h % hk:
            raise ValueError(f"{h} heads over {hk}")
        return t13.check_heads(q, k)

    with pytest.raises(AssertionError, match="divided by zero"):
        t13.check_check_heads(modulo_first)


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

    q = torch.empty(1, 8, 2, 96, dtype=torch.bfloat16)
    assert t13.refusal(lambda: flash_attn_func(q, q, q)).startswith("UnsupportedError: head_dim")
    assert t13.refusal(lambda: None) == "accepted"


# ----------------------------------------------------------------------------------------------
# the sweep


def test_sweep_series_and_plots():
    res = sweep()
    seqlens, series = t13.sweep_series(res, "bwd", 128, True)
    assert seqlens == [512, 4096, 32768]
    assert list(series) == ["fa4_final", "sdpa_flash", "sdpa_cudnn", "fa4_package"]
    assert all(len(v) == 3 for v in series.values())
    fig = t13.plot_sweep(res, "fwd")
    assert len([a for a in fig.axes if a.get_visible()]) == 4
    fig = t13.plot_vs_best_peer(res)
    assert len(fig.axes) == 3


def test_verdicts_follow_the_data():
    res = sweep()
    text = t13.verdict_summary(res)
    # D=64 is 1.1x cuDNN/fa4_package (the best peer, 1.003x cudnn): faster; D=128 0.9x: slower.
    assert "fwd      12 shapes: faster on 6, within noise on 0, slower on 6" in text
    assert text.count("shapes") == 3
    assert "fastest at fa4_final 6, fa4_package 6 of 12 shapes" in t13.fastest_counts(res, "fwd")
    lines = t13.headline_lines(res).splitlines()
    assert lines[0].startswith("[ch12_sweep] measured on NVIDIA H200")
    assert any("faster" in ln for ln in lines) and any("slower" in ln for ln in lines)


def test_within_noise_is_not_called_a_difference():
    res = fake("x", [timed("fa4_final", "fwd", 128, 4096, False, 500, 0.03),
                     timed("sdpa_cudnn", "fwd", 128, 4096, False, 510, 0.03)])
    assert "within noise on 1" in t13.verdict_summary(res)


def test_headline_files_read():
    for name in ("fa4_final_fwd", "ch11_bwd"):
        text = t13.headline_lines(load(name))
        assert "best peer" in text and "x (" in text
    assert t13.headline_lines(None) == "not measured yet"


# ----------------------------------------------------------------------------------------------
# varlen, accuracy, memory, training


def test_varlen_table_pivots_cases():
    extra = {"s_max": 8000, "total_tokens": 65536, "b": 32}
    rows = [{**timed(n, "fwd", 128, 2048, False, t), **extra}
            for n, t in (("fa4_final_varlen", 400), ("fa4_final_loop", 350),
                         ("fa4_package", 450))]
    text = t13.varlen_table(fake("ch12_varlen", rows))
    assert "32 seqs, mean 2048 max 8000" in text and "slower" in text
    assert "vs fa4_package" in text and "fa4_final_loop" in text
    # the backward's rows make cases of their own, next to the forward's
    bwd = [{**timed(n, p, 128, 2048, False, t), **extra}
           for p in ("bwd", "fwd+bwd")
           for n, t in (("fa4_final_varlen", 300), ("fa4_package", 250))]
    text = t13.varlen_table(fake("ch12_varlen", rows + bwd))
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["fwd", "bwd", "fwd+bwd"]
    assert "faster" in lines[3] and "vs fa4_package" in lines[4]
    assert t13.varlen_table(None) == "not measured yet"


def test_varlen_schedule_lines_compare_with_the_zigzag_rounds():
    rows = [timed(n, "fwd", 128, 2048, c, t)
            for c in (False, True)
            for n, t in (("fa4_final_varlen", 500), ("fa4_final_varlen_zigzag", 400))]
    text = t13.varlen_schedule_lines(fake("ch12_varlen", rows))
    lines = text.splitlines()
    assert len(lines) == 2 and lines[1].startswith("fwd causal")
    assert all("1.25x" in line and "faster" in line for line in lines)
    assert "no zigzag rows" in t13.varlen_schedule_lines(fake("ch12_varlen", rows[:1]))
    assert t13.varlen_schedule_lines(None) == "not measured yet"


def test_accuracy_table_and_summary():
    case = {"dtype": "bf16", "b": 1, "sq": 1000, "sk": 1000, "h": 8, "h_kv": 8, "d": 128,
            "causal": False}
    rows = []
    for impl, err in (("fa4_final", 2e-3), ("sdpa_flash", 4e-3), ("fa4_package", 1e-3)):
        rows += [{**case, "impl": impl, "tensor": t, "metric": "max_abs_err", "value": err,
                  "unit": "", "rel_err": err, "finite": True} for t in t13.TENSORS]
    rows.append({**case, "causal": True, "sq": 333, "impl": "sdpa_flash", "metric": "max_abs_err",
                 "value": None, "unit": "", "error": "not compared: top-left mask"})
    res = fake("ch12_accuracy", rows)
    table = t13.accuracy_table(res)
    assert "not compared" in table and "2.00e-03" in table
    assert "out: fa4_final's error is at most 2.00x the most accurate peer's" in \
        t13.accuracy_summary(res)
    assert t13.accuracy_table(None) == "not measured yet"


def test_memory_table():
    rows = [{"impl": n, "dtype": "bf16", "b": 1, "s": 16384, "h": 16, "d": 128, "causal": True,
             "inputs_and_grads_bytes": 2**30, "metric": "peak_extra_bytes", "value": v,
             "unit": "bytes"} for n, v in (("fa4_final", 2**28), ("sdpa_flash", 2**29))]
    rows.append({**rows[0], "impl": "fa4_package", "value": None, "error": "ImportError: x"})
    text = t13.memory_table(fake("ch12_memory", rows))
    assert "256 ( 0.25x)" in text and "error" in text
    assert t13.memory_table(None) == "not measured yet"


def test_training_summary_and_plot():
    res = load("fa4_final_training")
    text = t13.training_summary(res)
    assert "within the band" in text and "ms per training step" in text
    assert set(t13.training_losses(res)) >= {"fa4_final", "sdpa_flash"}
    t13.plot_training(res)


def test_host_tables():
    stored = load("ch12_host", gpu="cpu")
    text = t13.host_table(stored)
    assert "fa4_final before" in text and "fa4_final after" in text and "floor" in text
    assert "less host time per call (after vs before)" in text
    parts = t13.host_parts(stored)
    assert "checks (fa4_final.checks)" in parts and "before" in parts.splitlines()[0]
    shape = {"pass": "fwd+bwd", "dtype": "bf16", "b": 32, "s": 512, "h": 16, "d": 128,
             "causal": False, "ms": 0.5, "tflops": 100.0}
    rows = [{**shape, "impl": "fa4_final", "host_us": 120.0, "wall_us": 500.0,
             "kernel_us": 380.0, "host_bound": False},
            {**shape, "impl": "fa4_final_op", "host_us": 600.0, "wall_us": 640.0,
             "kernel_us": 380.0, "host_bound": True},
            {"impl": "fa4_final", "metric": "tvm_ffi_launch_us", "value": 6.5, "unit": "us",
             "note": "host time per call, arguments prepared once"}]
    table = t13.host_gpu_table(fake("ch12_host", rows))
    assert "fwd+bwd b=32 S=512 D=128" in table and table.count("host-bound") == 1
    assert "tvm_ffi_launch_us: 6.5 us" in table
    for fn in (t13.host_table, t13.host_parts, t13.host_gpu_table):
        assert fn(None) == "not measured yet"
