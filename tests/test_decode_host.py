"""measure.decode_host: its calls on CPU tensors (a short run with the kernels no-ops) and the
stored comparison (results/cpu/decode_host.json) the closing note of its change quotes."""

from measure import decode_host
from utils import results


def test_a_short_run_gives_a_row_per_call():
    rows = decode_host.measure("probe", "none", n=2, repeats=1)
    assert [r["metric"] for r in rows] == [f"host_us {name}" for name in decode_host.decode_calls()]
    assert all(r["value"] > 0 and r["variant"] == "probe" for r in rows)


def test_the_stored_split_calls_spend_less_host_time_after_the_change():
    """The split path's combine of its own partials skips the combine's checks of four tensors:
    fastest batches, before and after, on one CPU; the one-split calls, which never combine,
    within 10% of each other."""
    res = results.load(decode_host.RESULTS, gpu="cpu")
    got = {(r["variant"], r["metric"]): r["value"] for r in res.rows}
    for call in ("dense", "paged"):
        split = f"host_us {call} num_splits=0"
        assert got[("after", split)] < 0.9 * got[("before", split)]
        one = f"host_us {call} num_splits=1"
        assert abs(got[("after", one)] / got[("before", one)] - 1) < 0.1


def test_a_repeated_decode_call_spends_less_than_0_7_of_the_host_time():
    """Note [A repeated decode call]: the fastest batches of the four calls on one CPU, the tree
    before the memo (repeat_before) and with it listed (repeat_after)."""
    res = results.load(decode_host.RESULTS, gpu="cpu")
    got = {(r["variant"], r["metric"]): r["value"] for r in res.rows}
    for name in decode_host.decode_calls():
        metric = f"host_us {name}"
        assert got[("repeat_after", metric)] < 0.7 * got[("repeat_before", metric)], name
