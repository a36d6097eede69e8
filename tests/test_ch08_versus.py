"""solutions.ch08_versus on the CPU: ncu's raw page read into rows (units converted), and the
side-by-side lines, from a hand-made page; the GPU run itself is on the H200."""

from types import SimpleNamespace

from solutions import ch08_versus as v


def _raw(duration="1.5", unit="msecond", dram_bytes="2048", dram_unit="Mbyte"):
    header = ["ID", "gpu__time_duration.sum",
              "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
              "dram__bytes_read.sum", "lts__t_sector_hit_rate.pct",
              "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]
    units = ["", unit, "%", dram_unit, "%", "ratio"]
    values = ["0", duration, "80.5", dram_bytes, "91.25", "1.2"]
    return "\n".join(",".join(f'"{x}"' for x in row) for row in (header, units, values))


def test_rows_convert_time_and_bytes_and_keep_the_shape():
    rows = v.rows_of(_raw(duration="1500", unit="usecond"), "fa4_final", 64, 16384, True)
    by = {r["metric"]: r for r in rows}
    assert by["duration_ms"]["value"] == 1.5
    assert by["dram_read_gbytes"]["value"] == 2.048 and by["dram_read_gbytes"]["unit"] == "GB"
    assert by["l2_hit_rate_pct"]["value"] == 91.25
    assert by["stall_wait"]["value"] == 1.2
    assert all((r["d"], r["s"], r["causal"], r["b"], r["h"]) == (64, 16384, True, 1, 16)
               for r in rows)


def test_side_by_side_puts_the_two_kernels_in_columns():
    rows = (v.rows_of(_raw(), "fa4_final", 128, 4096, True)
            + v.rows_of(_raw(duration="1.2"), "fa4_package", 128, 4096, True))
    lines = v.side_by_side(SimpleNamespace(rows=rows))
    assert lines[0].startswith("D=128 S=4096 causal") and "fa4_package" in lines[0]
    time_line = next(line for line in lines if "kernel time" in line)
    assert time_line.split()[-2:] == ["1.50", "1.20"]
    assert any(line.strip().startswith("stall: wait") for line in lines)


def test_reading_computes_the_speed_ratio_from_the_times():
    rows = (v.rows_of(_raw(duration="1.6"), "fa4_final", 64, 16384, True)
            + v.rows_of(_raw(duration="1.2"), "fa4_package", 64, 16384, True))
    (sentence,) = v.reading(SimpleNamespace(rows=rows))
    assert "0.75x the package's speed" in sentence and "L2 hit rate 91% against 91%" in sentence
