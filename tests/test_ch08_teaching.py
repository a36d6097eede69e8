"""Chapter 08's exercise checkers: the solutions pass, the usual mistakes fail with a message
that names them; the timeline and SASS readers on stored and compiled data."""

import pytest

from solutions import ch08_teaching as t08


def test_turn_rule_solution_passes_and_mistakes_are_named():
    t08.check_turn_rule((t08.turn_waits, t08.turn_passes))
    with pytest.raises(AssertionError, match="waits forever at its turn 0"):
        t08.check_turn_rule((lambda w, f: True, t08.turn_passes))
    with pytest.raises(AssertionError, match="pending"):
        t08.check_turn_rule((t08.turn_waits, lambda w, last, n: True))
    with pytest.raises(AssertionError, match="out of order"):
        t08.check_turn_rule((lambda w, f: w > 0, t08.turn_passes))


def test_turns_of_tiles_without_keys_still_alternate():
    res = t08.simulate_turns(t08.turn_waits, t08.turn_passes, 3, [0, 2, 0])
    assert not res["deadlock"] and not res["pending_arrives"]
    assert res["order"] == [(g, w) for g in range(4) for w in range(3)]


def test_tile_order_checker():
    t08.check_tile_order(t08.zigzag)
    with pytest.raises(AssertionError, match="reverse the order of every other round"):
        t08.check_tile_order(lambda r, c, g: r * g + c)
    with pytest.raises(AssertionError, match="twice or never"):
        t08.check_tile_order(lambda r, c, g: r * g)


def test_smem_checker():
    from fa4_final.config import HopperFwdConfig

    t08.check_smem_bytes(lambda cfg, d: cfg.smem_bytes(d))
    with pytest.raises(AssertionError, match="1 KB"):
        t08.check_smem_bytes(lambda cfg, d: cfg.smem_bytes(d) - 1024)
    assert HopperFwdConfig().smem_bytes(128) <= 227 * 1024


def test_stored_timeline_reads_as_phases():
    from utils import results

    tl = results.load("ch08_timeline")
    for impl in ("fa4_final", "chapter 05 schedule"):
        phases = t08.phase_medians(tl.rows, impl)
        assert set(phases) == {1, 2}
        assert all(v > 0 for p in phases.values() for v in p.values())
        assert 1000 < t08.step_period(tl.rows, impl) < 20000


@pytest.mark.slow
def test_loop_outline_shows_where_o_is_rescaled():
    from dataclasses import replace

    from fa4_final import interface
    from fa4_final.config import hopper_fwd_default

    cfg = hopper_fwd_default(128)
    end = interface.compile_only("sm_90a", 128, "bf16", False, replace(cfg, o_rescale="end"))
    nxt = interface.compile_only("sm_90a", 128, "bf16", False, replace(cfg, o_rescale="next_pv"))
    assert t08.loop_outline(end.sass).endswith("FMULx64")
    assert t08.loop_outline(nxt.sass).index("FMUL") < t08.loop_outline(nxt.sass).index("pass")
    assert t08.loop_census(end.sass)["HGMMA"] == 16


def test_the_split_tail_plan_and_its_merge():
    """Note [Split tail] as notebook 08 shows it: the plan ends every CTA sooner than a whole
    last round, and the pieces' merge is the softmax of the whole row (float64, any cuts)."""
    import numpy as np

    whole, split = (t08.last_work(2048, 32, 132, s) for s in (False, True))
    assert whole[0] == 16 * 32 and whole[-1] == 15 * 32
    assert split[0] < whole[0] and sum(split) >= sum(whole)  # the overhead is paid, not hidden
    rng = np.random.default_rng(7)
    scores, values = 5 * rng.standard_normal((16, 300)), rng.standard_normal((300, 8))
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    want = (p @ values) / p.sum(axis=1, keepdims=True)
    lse_want = np.log2(p.sum(axis=1)) + scores.max(axis=1) * np.log2(np.e)
    for cuts in ([0, 300], [0, 1, 300], [0, 100, 117, 299, 300]):
        out, lse = t08.merge_pieces_numpy(scores, values, cuts, float(np.log2(np.e)))
        assert np.abs(out - want).max() < 1e-12 and np.abs(lse - lse_want).max() < 1e-12


def test_energy_lines_read_a_sustained_run():
    from utils import results

    res = results.load("fa4_final_energy")
    lines = t08.energy_lines(res)
    assert len(lines) == len(res.rows)
    assert all("TFLOP/J" in line for line in lines)
    assert any("fa4_final / this" in line for line in lines)


def test_the_four_ways_of_timing_read_the_stored_files():
    from utils import results

    named = {"bursts": results.load("fa4_final_fwd"),
             "fixed clock": results.load("fa4_final_clocked_vs_package"),
             "sustained": results.load("fa4_final_energy")}
    rows = t08.instrument_rows(named)
    assert len(rows) == 8 and all(r[k] is not None for r in rows for k in named)
    lines = t08.instrument_lines(named)
    assert lines[0].split()[:3] == ["D", "S", "causal"] and len(lines) == 9
    pred = t08.predecessor_lines(results.load("fa4_final_predecessors"))
    assert any(line.startswith("after idle") for line in pred)
    clocked = t08.clocked_lines(results.load("fa4_final_clocked"))
    assert any("vs package" in line for line in clocked)
