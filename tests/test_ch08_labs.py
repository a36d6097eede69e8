"""The helpers of chapter 08's two labs read their stored files (labs/measuring_small_differences
and labs/the_last_three_percent)."""

from labs import measuring_small_differences_helpers as h
from utils import results


def test_energy_lines_read_a_sustained_run():
    res = results.load("fa4_final_energy")
    lines = h.energy_lines(res)
    assert len(lines) == len(res.rows)
    assert all("TFLOP/J" in line for line in lines)
    assert any("fa4_final / this" in line for line in lines)


def test_the_four_ways_of_timing_read_the_stored_files():
    named = {"bursts": results.load("fa4_final_fwd"),
             "fixed clock": results.load("fa4_final_clocked_vs_package"),
             "sustained": results.load("fa4_final_energy")}
    rows = h.instrument_rows(named)
    assert len(rows) == 8 and all(r[k] is not None for r in rows for k in named)
    lines = h.instrument_lines(named)
    assert lines[0].split()[:3] == ["D", "S", "causal"] and len(lines) == 9
    assert 0 <= h.below_one(named, "bursts") <= 8
    pred = results.load("fa4_final_predecessors")
    assert any(line.startswith("after idle") for line in h.predecessor_lines(pred))
    assert h.predecessor_swing(pred, "fa4_final") >= 1.0
    clocked = h.clocked_lines(results.load("fa4_final_clocked"))
    assert any("vs package" in line for line in clocked)


def test_back_to_back_and_one_at_a_time_pair_up_by_shape():
    modes = h.mode_lines(results.load("fa4_final_fwd"), results.load("fa4_final_energy"))
    assert len(modes["lines"]) == 8 and modes["median"] > 0


def test_both_dynamic_runs_name_their_two_schedules():
    for name in ("fa4_final_clocked_dynamic_first", "fa4_final_clocked_dynamic"):
        ahead, within = h.dynamic_against_table(results.load(name))
        assert 0 <= within <= ahead <= 4
