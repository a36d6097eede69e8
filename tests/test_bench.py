import itertools

import pytest
import torch

from utils import bench
from utils.bench import Shape, attention_flops, geomean, ratio_table
from utils.results import load


def test_flops_formula():
    f = attention_flops(1, 16, 4096, 4096, 128)
    assert f == 4 * 16 * 4096 * 4096 * 128
    assert attention_flops(1, 16, 4096, 4096, 128, causal=True) == f / 2
    assert attention_flops(1, 16, 4096, 4096, 128, pass_="bwd") == 2.5 * f
    with pytest.raises(ValueError):
        attention_flops(1, 1, 1, 1, 1, pass_="sideways")


def test_standard_shape_keeps_tokens_constant():
    assert Shape.standard(4096) == Shape(b=4, s=4096, h=16, d=128)
    assert Shape.standard(16384, d=64, causal=True).b == 1


def test_ratio_table():
    rows = [
        {"impl": "a", "pass": "fwd", "d": 128, "s": 4096, "causal": False, "tflops": 500.0},
        {"impl": "sdpa_cudnn", "pass": "fwd", "d": 128, "s": 4096, "causal": False,
         "tflops": 250.0},
    ]
    text = ratio_table(rows, "sdpa_cudnn")
    assert "2.00x" in text and "1.00x" in text
    assert geomean([2, 8]) == pytest.approx(4)


# -- interleaved rounds, on the CPU with fake timers and sensors --------------------------------


class FakeTimer:
    """Stands in for time_cuda: calls fn once inside ``during`` (where the sensors are read)
    and returns the next programmed median for that function, recording the order of calls."""

    def __init__(self, medians: dict):
        self.medians = {name: iter(ms) for name, ms in medians.items()}
        self.order = []

    def __call__(self, fn, during, **kw):
        name = fn()
        self.order.append(name)
        with during():
            ms = next(self.medians[name])
        return bench.Timing(ms, 0.9 * ms, ms, ms, kw.get("rep", 30))


class FakeSensors(bench.GpuSensors):
    source = "fake"

    def __init__(self, clocks):
        self.clocks = itertools.cycle(clocks)

    def read(self):
        return {"sm_clock_mhz": next(self.clocks), "power_w": 500.0, "reasons": 0x4}


def named(*names):
    return {n: (lambda n=n: n) for n in names}


def test_rounds_interleave_every_implementation_before_the_next_round():
    timer = FakeTimer({"a": [1, 1, 1], "b": [2, 2, 2], "c": [3, 3, 3]})
    bench.interleaved(named("a", "b", "c"), rounds=3, timer=timer,
                      sensors=bench.NoSensors("test"))
    # odd rounds backwards: an implementation's predecessor alternates
    assert timer.order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]


def test_rounds_keep_median_spread_and_per_round_values():
    timer = FakeTimer({"a": [2.0, 1.0, 4.0], "b": [1.0, 1.0, 1.0]})
    got = bench.interleaved(named("a", "b"), rounds=3, timer=timer,
                            sensors=FakeSensors([1980.0]))
    a = got["a"]
    assert a.ms_rounds == [2.0, 1.0, 4.0] and a.median_ms == 2.0
    assert a.spread == pytest.approx((4.0 - 1.0) / 2.0)
    assert a.min_ms == pytest.approx(0.9) and got["b"].spread == 0.0
    row = a.fields(flops=2e12)
    assert row["ms"] == 2.0 and row["tflops"] == pytest.approx(1000.0)
    assert row["tflops_rounds"] == pytest.approx([1000.0, 2000.0, 500.0])
    assert row["rounds"] == 3 and row["sm_clock_mhz"] == 1980.0
    assert row["sm_clock_mhz_rounds"] == [1980.0] * 3 and row["power_w"] == 500.0
    assert row["clock_reasons"] == ["software power cap"] and row["sensors"] == "fake"


def test_sensor_readings_are_per_round():
    timer = FakeTimer({"a": [1.0, 1.0, 1.0]})
    # each Sampler reads at least twice (entry and exit): 1800 and 1900 in round 1, ...
    sensors = FakeSensors([1800.0, 1900.0])
    got = bench.interleaved(named("a"), rounds=3, timer=timer, sensors=sensors)
    clocks = got["a"].fields()["sm_clock_mhz_rounds"]
    assert len(clocks) == 3 and all(1800.0 <= c <= 1900.0 for c in clocks)


def test_missing_sensors_store_none_with_the_reason():
    timer = FakeTimer({"a": [1.0, 1.0, 1.0]})
    got = bench.interleaved(named("a"), rounds=3, timer=timer,
                            sensors=bench.NoSensors("no NVML here"))
    row = got["a"].fields()
    assert row["sm_clock_mhz"] is None and row["sm_clock_mhz_rounds"] == [None] * 3
    assert row["sensors"] is None and row["sensors_note"] == "no NVML here"


def test_open_sensors_without_a_gpu_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    s = bench.open_sensors()
    assert s.source is None and s.note
    assert s.read() == {"sm_clock_mhz": None, "power_w": None, "reasons": None}


def test_a_failing_implementation_is_recorded_and_skipped_later():
    calls = []

    def timer(fn, during, **kw):
        name = fn()
        calls.append(name)
        if name == "bad" and calls.count("bad") == 2:
            raise RuntimeError("out of memory\nmore text")
        return bench.Timing(1.0, 1.0, 1.0, 1.0, 30)

    got = bench.interleaved(named("good", "bad"), rounds=3, timer=timer,
                            sensors=bench.NoSensors("test"))
    # round 1 runs backwards: "bad" first, fails there and is skipped in round 2
    assert calls == ["good", "bad", "bad", "good", "good"]
    assert got["bad"].error == "RuntimeError: out of memory (in round 1)"
    assert got["bad"].ms_rounds == [1.0] and got["good"].ms_rounds == [1.0] * 3
    with pytest.raises(RuntimeError):
        bench.interleaved(named("bad"), rounds=1, on_error="raise", sensors=bench.NoSensors(""),
                          timer=lambda fn, during, **kw: (_ for _ in ()).throw(RuntimeError()))
    with pytest.raises(ValueError, match="rounds"):
        bench.interleaved(named("a"), rounds=0, timer=timer)


def test_compare_calls_an_effect_real_only_beyond_the_spread():
    base = {"ms": 1.0, "ms_rounds": [0.98, 1.0, 1.02], "spread": 0.04}
    near = {"ms": 1.03, "ms_rounds": [1.01, 1.03, 1.05], "spread": 0.04}
    far = {"ms": 1.2, "ms_rounds": [1.19, 1.2, 1.21], "spread": 0.02}
    assert bench.compare(near, base).verdict == "within noise"
    c = bench.compare(far, base)
    assert c.real and c.verdict == "slower" and c.ratio == pytest.approx(1 / 1.2)
    assert "within noise" in str(bench.compare(near, base))
    assert bench.compare(base, far).verdict == "faster"
    assert bench.compare({"ms": None}, base) is None


def test_old_rows_without_rounds_use_the_spread_of_their_calls():
    old = {"ms": 3.2, "ms_min": 3.0}
    assert bench.row_spread(old) == pytest.approx(0.2 / 3.2)
    c = bench.compare({"ms": 3.1, "ms_min": 3.05}, old)
    assert not c.rounds and c.noise == pytest.approx(0.2 / 3.2) and not c.real


def _row(impl, tflops, s=4096, causal=False, spread=0.01):
    return {"impl": impl, "pass": "fwd", "dtype": "bf16", "b": 4, "s": s, "h": 16, "d": 128,
            "causal": causal, "h_kv": 16, "ms": 1000.0 / tflops, "tflops": tflops,
            "ms_rounds": [1000.0 / tflops] * 3, "spread": spread}


def test_best_peer_is_the_fastest_peer_of_the_same_shape():
    rows = [_row("flash_hopper", 600), _row("sdpa_cudnn", 640), _row("fa4_package", 680),
            _row("fa4_package", 900, s=16384), _row("sdpa_flash", 350)]
    bench.attach_best_peer(rows)
    assert rows[0]["best_peer"] == "fa4_package" and rows[0]["best_peer_tflops"] == 680
    assert rows[0]["vs_best_peer"] == pytest.approx(600 / 680)
    assert rows[2]["best_peer"] == "sdpa_cudnn"  # a peer is compared with the other peers
    assert "best_peer" not in rows[3]  # alone at its shape
    assert bench.vs_best_peer(rows[0]) == "0.88x fa4_package (680)"


def test_ratio_table_shows_the_best_peer_and_marks_noise():
    rows = [_row("flash_hopper", 675, spread=0.02), _row("fa4_package", 680),
            _row("flash_hopper", 500, causal=True), _row("fa4_package", 680, causal=True)]
    text = bench.ratio_table(rows)
    assert "ratio to best peer" in text and "fa4_package 680" in text
    assert "(~0.99x)" in text and "( 0.74x)" in text and "within noise" in text


def test_benchmark_attention_rounds_on_the_cpu():
    def slow(q, k, v, causal=False, softmax_scale=None):
        return "slow"

    def fast(q, k, v, causal=False, softmax_scale=None):
        return "fast"

    shapes = [bench.Shape(b=1, s=8, h=2, d=4), bench.Shape(b=1, s=16, h=2, d=4, causal=True)]
    timer = FakeTimer({"slow": [4.0, 5.0, 6.0, 4.0, 4.0, 4.0],
                       "fast": [1.0, 1.0, 1.1, 1.0, 1.0, 1.0]})
    rows = bench.benchmark_attention({"naive": slow, "fa4_package": fast}, shapes, rounds=3,
                                     timer=timer, sensors=FakeSensors([1755.0]),
                                     device="cpu", progress=False)
    assert timer.order == ["slow", "fast", "fast", "slow", "slow", "fast"] * 2  # odd rounds back
    assert [r["impl"] for r in rows] == ["naive", "fa4_package"] * 2
    first = rows[0]
    assert first["ms"] == 5.0 and first["ms_rounds"] == [4.0, 5.0, 6.0]
    assert first["spread"] == pytest.approx(0.4) and first["sm_clock_mhz"] == 1755.0
    flops = bench.attention_flops(1, 2, 8, 8, 4)
    assert first["tflops"] == pytest.approx(flops / 5e-3 / 1e12)
    assert first["best_peer"] == "fa4_package"
    assert first["vs_best_peer"] == pytest.approx(1.0 / 5.0)


def test_peer_fields_for_files_of_one_kernels_configurations():
    timer = FakeTimer({"sdpa_flash": [2.0] * 3, "fa4_package": [1.0, 1.1, 1.0]})
    measured = bench.interleaved(named("sdpa_flash", "fa4_package"), timer=timer,
                                 sensors=bench.NoSensors("test"))
    fields = bench.peer_fields(measured, flops=1e12)
    assert fields["best_peer"] == "fa4_package"
    assert fields["best_peer_tflops"] == pytest.approx(1000.0)
    assert fields["peers_tflops"]["sdpa_flash"] == pytest.approx(500.0)
    assert fields["best_peer_spread"] == pytest.approx(0.1)


def test_stored_files_from_before_rounds_still_read():
    res = load("ch05_fwd", gpu="h200")
    assert all("ms_rounds" not in r for r in res.rows)  # written by the one-round method
    text = bench.ratio_table(res.rows)
    assert "best peer" in text and "fa4_package" in text


# -- the NVML readers, with the library and the command faked ------------------------------------


class _FakeNvml:
    """libnvidia-ml's C functions as ctypes sees them: results come back through byref()."""

    def __init__(self):
        self.asked = {}

    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus_id, handle):
        self.asked["bus_id"] = bus_id
        handle._obj.value = 1234
        return 0

    def nvmlDeviceGetClockInfo(self, handle, kind, out):
        assert kind == bench.NVML_CLOCK_SM
        out._obj.value = 1980
        return 0

    def nvmlDeviceGetPowerUsage(self, handle, out):
        out._obj.value = 612_500  # milliwatts
        return 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, out):
        out._obj.value = 0x4 | 0x80
        return 0


def test_nvml_through_ctypes(monkeypatch):
    import ctypes
    import sys

    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: ctypes is next
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    sensors = bench._NvmlSensors({"index": 0, "bus_id": "00000000:19:00.0"})
    assert sensors.source == "nvml (libnvidia-ml via ctypes)"
    assert fake.asked["bus_id"] == b"00000000:19:00.0"
    got = sensors.read()
    assert got == {"sm_clock_mhz": 1980.0, "power_w": 612.5, "reasons": 0x84}
    assert bench.clock_reason_names(got["reasons"]) == ["software power cap",
                                                         "hardware power brake"]


def test_nvidia_smi_is_read_rarely_and_parsed(monkeypatch):
    import subprocess

    class Done:
        stdout = "1755, 498.20, 0x0000000000000004\n"

    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: Done())
    sensors = bench._SmiSensors({"index": 0, "uuid": "GPU-abc"})
    assert sensors.read() == {"sm_clock_mhz": 1755.0, "power_w": 498.2, "reasons": 4}
    assert bench.Sampler(sensors).interval_s >= 0.5
    Done.stdout = "[N/A], [N/A], [N/A]"
    assert sensors.read() == {"sm_clock_mhz": None, "power_w": None, "reasons": None}


def test_benchmark_attention_passes_the_settle_time_to_the_timer_only_when_asked():
    seen = []

    class Recording(FakeTimer):
        def __call__(self, fn, during, **kw):
            seen.append(kw.get("settle_ms"))
            return super().__call__(fn, during, **kw)

    def impl(q, k, v, causal=False, softmax_scale=None):
        return "a"

    shape = [bench.Shape(b=1, s=8, h=2, d=4)]
    for settle, want in ((0.0, None), (50.0, 50.0)):
        seen.clear()
        bench.benchmark_attention({"a": impl}, shape, rounds=3, timer=Recording({"a": [1.0] * 3}),
                                  sensors=FakeSensors([1755.0]), device="cpu", progress=False,
                                  settle_ms=settle)
        assert seen == [want] * 3
