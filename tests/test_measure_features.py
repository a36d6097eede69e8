"""measure.features' host side, on the CPU: the grid, the FLOP count with dv != D, and the
ratio to the fastest peer of the same shape and mode (the GPU run is a session step)."""

from measure import features


def test_grid_and_flops():
    shapes = features.grid(["d192_dv128", "sink"], [4096, 16384], [0, 1], 16384, 16)
    assert len(shapes) == 8 and {s.b for s in shapes} == {4, 1}
    s = features.FeatureShape("d192_dv128", 4, 4096, 16, True)
    assert s.flops() == 2.0 * 4 * 16 * 4096 * 4096 * 0.5 * (192 + 128)
    fields = features.row_fields(s)
    assert (fields["d"], fields["dv"], fields["softcap"], fields["sink"]) == (192, 128, 0.0, False)


def test_ratios_take_the_fastest_peer_of_the_same_shape_and_mode():
    base = {"case": "d256", "b": 1, "s": 16384, "h": 16, "causal": True}
    rows = [
        {"impl": "fa4_final", "mode": "flush", "tflops": 500.0, "spread": 0.01, **base},
        {"impl": "fa4_package", "mode": "flush", "tflops": 450.0, "spread": 0.02, **base},
        {"impl": "sdpa_cudnn", "mode": "flush", "tflops": 520.0, "spread": 0.03, **base},
        {"impl": "sdpa_cudnn", "mode": "back_to_back", "tflops": 900.0, **base},
        {"impl": "sdpa_flash", "mode": "flush", "tflops": None, "error": "x", **base},
    ]
    features.attach_ratios(rows)
    ours = rows[0]
    assert ours["best_peer"] == "sdpa_cudnn" and abs(ours["vs_best_peer"] - 500 / 520) < 1e-12
    assert ours["best_peer_spread"] == 0.03


def test_rows_in_modes_times_every_call_in_every_mode_and_says_why_not(monkeypatch):
    from types import SimpleNamespace

    from measure import _modes
    from utils import bench

    seen = []

    def fake_interleaved(calls, rounds, rep, max_seconds, flush_l2):
        seen.append(flush_l2)
        return {name: bench.Measured(ms_rounds=[1.0, 1.1, 0.9]) for name in calls}

    monkeypatch.setattr(bench, "interleaved", fake_interleaved)
    args = SimpleNamespace(modes=["flush", "back_to_back"], rounds=3, rep=5, max_seconds=0.1)
    rows = _modes.rows_in_modes({"a": None}, {"a": {"max_diff": 0.0},
                                              "b": {"error": "not built"}},
                                {"s": 4096}, 2e12, args)
    assert seen == [True, False]
    assert [(r["impl"], r["mode"]) for r in rows] == [
        ("a", "flush"), ("b", "flush"), ("a", "back_to_back"), ("b", "back_to_back")]
    assert rows[0]["max_diff"] == 0.0 and abs(rows[0]["tflops"] - 2e12 / 1e-3 / 1e12) < 1e-9
    assert rows[1]["ms"] is None and rows[1]["error"] == "not built"


def test_graph_mode_times_the_replays_and_says_which_call_cannot_be_captured(monkeypatch):
    from types import SimpleNamespace

    from measure import _modes
    from utils import bench

    timed = []

    def fake_interleaved(calls, rounds, rep, max_seconds, flush_l2):
        assert not flush_l2  # replays run back to back
        timed.append({name: fn() for name, fn in calls.items()})
        return {name: bench.Measured(ms_rounds=[1.0, 1.0, 1.0]) for name in calls}

    def fake_capture(fn):
        if fn() == "syncs":
            raise RuntimeError("operation not permitted when stream is capturing")
        return lambda: "replayed"

    monkeypatch.setattr(bench, "interleaved", fake_interleaved)
    args = SimpleNamespace(modes=["graph"], rounds=3, rep=5, max_seconds=0.1)
    rows = _modes.rows_in_modes({"ours": lambda: "eager", "peer": lambda: "syncs"},
                                {"ours": {"splits": 4}}, {"s": 1024}, 1e9, args,
                                capture=fake_capture)
    assert timed == [{"ours": "replayed"}]  # the replay is timed, not the eager call
    by = {r["impl"]: r for r in rows}
    assert by["ours"]["mode"] == "graph" and by["ours"]["splits"] == 4 and by["ours"]["ms"]
    assert by["peer"]["ms"] is None and "not captured in a CUDA graph" in by["peer"]["error"]
    assert "RuntimeError" in by["peer"]["error"]
