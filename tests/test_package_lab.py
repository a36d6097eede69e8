"""The readers of labs/package_sweeps_and_host_cost.ipynb (labs/package_sweeps_and_host_cost_
helpers.py): they work on rows of the shapes measure/package_sweep.py, package_varlen.py and
package_host.py write, say "not measured yet" for a file that is absent, and show the package as it
is (the newest tree of the CPU profile)."""

import matplotlib
import pytest

from labs import package_sweeps_and_host_cost_helpers as lab
from tests.fake_sweeps import fake, timed
from tests.fake_sweeps import sweep as fake_sweep
from utils.results import load

matplotlib.use("Agg")


def sweep():
    return fake_sweep(lab.PASSES)


def test_sweep_series_and_plots():
    res = sweep()
    seqlens, series = lab.sweep_series(res, "bwd", 128, True)
    assert seqlens == [512, 4096, 32768]
    assert list(series) == ["fa4_final", "sdpa_flash", "sdpa_cudnn", "fa4_package"]
    assert all(len(v) == 3 for v in series.values())
    fig = lab.plot_sweep(res, "fwd")
    assert len([a for a in fig.axes if a.get_visible()]) == 4
    fig = lab.plot_vs_best_peer(res)
    assert len(fig.axes) == 3


def test_verdicts_follow_the_data():
    res = sweep()
    text = lab.verdict_summary(res)
    # D=64 is 1.1x cuDNN/fa4_package (the best peer, 1.003x cudnn): faster; D=128 0.9x: slower.
    assert "fwd      12 shapes: faster on 6, within noise on 0, slower on 6" in text
    assert text.count("shapes") == 3
    assert "fastest at fa4_final 6, fa4_package 6 of 12 shapes" in lab.fastest_counts(res, "fwd")
    assert lab.sweep_ratio(res, "fwd", 128, 512, False) == pytest.approx(0.9 / 1.003)


def test_within_noise_is_not_called_a_difference():
    res = fake("x", [timed("fa4_final", "fwd", 128, 4096, False, 500, 0.03),
                     timed("sdpa_cudnn", "fwd", 128, 4096, False, 510, 0.03)])
    assert "within noise on 1" in lab.verdict_summary(res)


def test_varlen_table_pivots_cases():
    extra = {"s_max": 8000, "total_tokens": 65536, "b": 32}
    rows = [{**timed(n, "fwd", 128, 2048, False, t), **extra}
            for n, t in (("fa4_final_varlen", 400), ("fa4_final_loop", 350),
                         ("fa4_package", 450))]
    text = lab.varlen_table(fake("package_varlen", rows))
    assert "32 seqs, mean 2048 max 8000" in text and "slower" in text
    assert "vs fa4_package" in text and "fa4_final_loop" in text
    # the backward's rows make cases of their own, next to the forward's
    bwd = [{**timed(n, p, 128, 2048, False, t), **extra}
           for p in ("bwd", "fwd+bwd")
           for n, t in (("fa4_final_varlen", 300), ("fa4_package", 250))]
    text = lab.varlen_table(fake("package_varlen", rows + bwd))
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["fwd", "bwd", "fwd+bwd"]
    assert "faster" in lines[3] and "vs fa4_package" in lines[4]
    assert lab.varlen_table(None) == "not measured yet"


def test_varlen_schedule_lines_compare_with_the_zigzag_rounds():
    rows = [timed(n, "fwd", 128, 2048, c, t)
            for c in (False, True)
            for n, t in (("fa4_final_varlen", 500), ("fa4_final_varlen_zigzag", 400))]
    text = lab.varlen_schedule_lines(fake("package_varlen", rows))
    lines = text.splitlines()
    assert len(lines) == 2 and lines[1].startswith("fwd causal")
    assert all("1.25x" in line and "faster" in line for line in lines)
    assert "no zigzag rows" in lab.varlen_schedule_lines(fake("package_varlen", rows[:1]))
    assert lab.varlen_schedule_lines(None) == "not measured yet"


def test_memory_table():
    rows = [{"impl": n, "dtype": "bf16", "b": 1, "s": 16384, "h": 16, "d": 128, "causal": True,
             "inputs_and_grads_bytes": 2**30, "metric": "peak_extra_bytes", "value": v,
             "unit": "bytes"} for n, v in (("fa4_final", 2**28), ("sdpa_flash", 2**29))]
    rows.append({**rows[0], "impl": "fa4_package", "value": None, "error": "ImportError: x"})
    text = lab.memory_table(fake("package_memory", rows))
    assert "256 ( 0.25x)" in text and "error" in text
    assert lab.memory_table(None) == "not measured yet"


def test_host_tables():
    stored = load("package_host", gpu="cpu")
    newest = lab.latest_variant(stored)
    commit = next(r["fa4_final_commit"] for r in stored.rows if r["variant"] == newest)
    assert str(stored.provenance["commit"]).startswith(str(commit)[:10])
    text = lab.host_table(stored)
    assert f"fa4_final as of {str(commit)[:10]}" in text and "floor" in text
    assert "the floor's" in text and lab.host_over_floor(stored) > 1
    parts = lab.host_parts(stored)
    assert any(line.startswith("checks (fa4_final.") for line in parts.splitlines())
    assert len(parts.splitlines()) == 1 + len({r["part"] for r in stored.rows
                                               if r.get("part") and r["variant"] == newest
                                               and "fwd+bwd" in r["metric"]})
    shape = {"pass": "fwd+bwd", "dtype": "bf16", "b": 32, "s": 512, "h": 16, "d": 128,
             "causal": False, "ms": 0.5, "tflops": 100.0}
    rows = [{**shape, "impl": "fa4_final", "host_us": 120.0, "wall_us": 500.0,
             "kernel_us": 380.0, "host_bound": False},
            {**shape, "impl": "fa4_final_op", "host_us": 600.0, "wall_us": 640.0,
             "kernel_us": 380.0, "host_bound": True},
            {"impl": "fa4_final", "metric": "tvm_ffi_launch_us", "value": 6.5, "unit": "us",
             "note": "host time per call, arguments prepared once"}]
    table = lab.host_gpu_table(fake("package_host", rows))
    assert "fwd+bwd b=32 S=512 D=128" in table and table.count("host-bound") == 1
    assert "tvm_ffi_launch_us: 6.5 us" in table
    assert lab.op_over_eager(fake("package_host", rows)) == pytest.approx(5.0)
    for fn in (lab.host_table, lab.host_parts, lab.host_gpu_table):
        assert fn(None) == "not measured yet"


def test_stored_files_read():
    assert 0 < lab.varlen_over_loop(load("package_varlen")) < 10
    assert 0 < lab.memory_multiple(load("package_memory")) < 2
    assert lab.op_over_eager(load("package_host")) > 0


def _decode_result(rows):
    from pathlib import Path

    from utils.results import Results
    return Results("decode_combine", Path("decode_combine.json"), {}, rows)


def test_combine_candidate_table_reads_graph_rows_with_splits():
    """unroll_lines: per replayed batch-1 shape with splits, each candidate's step beside the
    default and cuDNN; a shape of one split (no combine) and the back-to-back rows left out."""
    shape = {"b": 1, "h": 32, "h_kv": 8, "d": 128, "mode": "graph"}
    rows = [{**shape, "impl": impl, "s_q": 1, "s": 8192, "ms": ms, "spread": 0.01, "splits": 16}
            for impl, ms in (("fa4_final_decode", 0.0142), ("fa4_final_decode_c16", 0.0125),
                             ("fa4_final_decode_c16p", 0.0118), ("sdpa_cudnn", 0.0120))]
    rows.append({**shape, "impl": "fa4_final_decode", "s_q": 1, "s": 256, "ms": 0.007,
                 "spread": 0.01, "splits": 1})
    rows.append({**shape, "impl": "fa4_final_decode", "mode": "back_to_back", "s_q": 16,
                 "s": 8192, "ms": 0.02, "spread": 0.01, "splits": 16})
    lines = lab.unroll_lines(_decode_result(rows))
    assert len(lines) == 3, lines
    assert "16 first" in lines[1]
    cells = lines[2].split()
    assert cells[:3] == ["1", "8192", "16"] and "14.2" in cells and "11.8" in cells, cells
    assert cells.count("-") == 2 and cells[-2] == "12.0", cells  # c8, c4p absent; cuDNN last
    assert lab.unroll_lines(None) == ["(no stored run of the combine's candidates)"]


def test_combine_passes_price_one_pass_from_the_stored_timeline():
    """combine_pass_lines: the split counts the call chooses on an H100 (4 at 1k keys, 16 at
    8k), the default's passes over them and the per-pass difference of the two combines."""
    shape = {"b": 1, "h": 32, "h_kv": 8, "d": 128, "dtype": "bf16", "causal": False, "s_q": 1,
             "impl": "fa4_final_splits", "metric": "duration_us", "kernel": 1}
    rows = [{**shape, "s": 1024, "value": 2.0}, {**shape, "s": 8192, "value": 5.0},
            {**shape, "s": 8192, "kernel": 0, "value": 9.0}]
    passes = lab.combine_passes(_decode_result(rows))
    assert passes == [(1024, 4, 1, 2.0), (8192, 16, 4, 5.0)]
    last = lab.combine_pass_lines(_decode_result(rows))[-1]
    assert "one more pass: 1.00 us" in last and "about 2.00 us" in last, last
