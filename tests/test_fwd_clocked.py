"""measure.fwd_clocked on the CPU: the launch order it profiles, reading ncu's raw page back
into per-variant rows, and the variants' configs."""

from dataclasses import replace

import pytest

from fa4_final.hopper.config import hopper_fwd_default
from measure import fwd_clocked as clocked
from utils import results


def _raw_page(times_us):
    head = '"ID","Kernel Name","gpu__time_duration.sum"\n"","","usecond"\n'
    return head + "".join(f'"{i}","kernel","{t}"\n' for i, t in enumerate(times_us))


def test_every_round_runs_every_variant_once_in_alternating_order():
    names = ["a", "b", "c"]
    order = clocked.launch_order(names, launches=4)
    assert order == ["a", "b", "c", "c", "b", "a"] * 2


def test_durations_and_rows_from_the_raw_page():
    names = ["fa4_final", "fa4_package"]
    order = clocked.launch_order(names)
    times = [1000.0 if n == "fa4_final" else 1100.0 for n in order]
    ms = clocked.durations(_raw_page(times))
    assert ms == pytest.approx([t / 1e3 for t in times])
    rows = clocked.rows_for(64, 16384, True, names, ms)
    assert [r["config"] for r in rows] == names
    assert rows[0]["impl"] == "fa4_final" and rows[1]["impl"] == "fa4_package"
    assert rows[0]["ms"] == pytest.approx(1.0) and len(rows[0]["ms_rounds"]) == clocked.LAUNCHES
    results.validate({"provenance": results.collect_provenance("test"), "rows": rows},
                     clocked.RESULTS)
    with pytest.raises(RuntimeError, match="kernel filter"):
        clocked.rows_for(64, 16384, True, names, ms[:-1])


def test_units_other_than_microseconds():
    page = '"ID","gpu__time_duration.sum"\n"","nsecond"\n"0","2500000"\n'
    assert clocked.durations(page) == pytest.approx([2.5])


@pytest.mark.parametrize("name", [n for n, c in clocked.VARIANTS.items() if c is not None])
@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (128, True)])
def test_every_variant_is_a_valid_config(name, d, causal):
    replace(hopper_fwd_default(d, causal), **clocked.change_of(name, causal)).check(d)



def test_the_ablation_switches_off_one_idea_per_config():
    from measure import fwd_knobs

    for d in (64, 128):
        for causal in (False, True):
            configs = fwd_knobs.ablation_configs(d, causal)
            base = configs.pop("default")
            assert base == hopper_fwd_default(d, causal)
            for name, cfg in configs.items():
                cfg.check(d)
                assert cfg != base, f"{name} changes nothing at D={d} causal={causal}"
