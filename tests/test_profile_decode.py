"""measure.profile_decode's reading of ncu's raw export, on a hand-made table (no GPU)."""

import pytest

from measure import profile_decode as prof
from tests.ncu_tables import raw_page


def test_rows_convert_units_and_give_the_read_rate():
    raw = raw_page({"Kernel Name": ("", "kernel_HopperDecode_0"),
                "gpu__time_duration.sum": ("usecond", "350.0"),
                "dram__bytes_read.sum": ("Gbyte", "1.07"),
                "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("%", "91.5"),
                "launch__grid_size": ("", "264"),
                "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio":
                    ("", "12.5")})
    rows = {r["metric"]: r for r in prof.build_rows(raw, "fa4_final_splits", 8192, 16)}
    assert rows["duration_ms"]["value"] == pytest.approx(0.35)
    assert rows["dram_read_gb"]["value"] == pytest.approx(1.07)
    assert rows["dram_read_tbps"]["value"] == pytest.approx(1.07 / 0.35)
    assert rows["ctas"]["value"] == 264 and rows["stall_long_scoreboard"]["value"] == 12.5
    assert all(r["impl"] == "fa4_final_splits" and r["s"] == 8192 and r["h_kv"] == 8
               and r["s_q"] == 16 and r["h"] == 64 for r in rows.values())


def test_an_unknown_target_is_refused_by_name():
    with pytest.raises(SystemExit):
        prof.main(["--target", "flash_attn_2", "1", "8192"])
