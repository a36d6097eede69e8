"""measure.decode_timeline's cutting of profiler records into replayed decode steps, on made-up
records (no GPU): durations, gaps (the first kernel's from the previous step), spans, and
records that do not split into equal steps refused."""

import pytest

from measure.decode_timeline import step_rows, steps


def _records(reps, kernels=(("split", 10.0), ("combine", 3.0)), gap=1.5, between=4.0):
    out, t = [], 0.0
    for _ in range(reps):
        for i, (name, dur) in enumerate(kernels):
            t += gap if i else between
            out.append((name, t, t + dur))
            t += dur
    return out[::-1]  # any order in, start order out


def test_decode_steps_are_cut_in_start_order():
    cut = steps(_records(3), 3)
    assert [[k[0] for k in step] for step in cut] == [["split", "combine"]] * 3
    assert all(a[1] < b[1] for step in cut for a, b in zip(step, step[1:]))


def test_decode_step_rows_durations_gaps_and_span():
    rows = step_rows(_records(5), 5, {"impl": "x"})
    got = {(r["kernel"], r["metric"]): r["value"] for r in rows}
    assert got[(0, "duration_us")] == pytest.approx(10.0)
    assert got[(1, "duration_us")] == pytest.approx(3.0)
    assert got[(1, "gap_before_us")] == pytest.approx(1.5)
    assert got[(0, "gap_before_us")] == pytest.approx(4.0)  # from the previous step's end
    assert got[(None, "span_us")] == pytest.approx(14.5)
    assert {r["steps"] for r in rows if r["metric"] == "gap_before_us" and r["kernel"] == 0} \
        == {4}
    assert all(r["impl"] == "x" and r["unit"] == "us" for r in rows)


def test_decode_records_that_do_not_split_are_refused():
    recs = _records(3)
    with pytest.raises(ValueError, match="do not split"):
        steps(recs[:-1], 3)
    swapped = [("other" if r[0] == "combine" and r[1] > 30 else r[0], *r[1:]) for r in recs]
    with pytest.raises(ValueError, match="same kernels"):
        steps(swapped, 3)


def test_decode_timeline_profiles_variant_rows():
    from measure.decode_timeline import variants_of

    assert variants_of(["fa4_final_decode", "fa4_final_decode_c8", "fa4_final_decode_c16",
                        "sdpa_cudnn", "fa4_final_splits"]) == ["c8", "c16"]
    assert variants_of(["fa4_final_decode_nothing"]) == []
