"""Benchmarking attention on a GPU: timing, FLOP counts, peers measured in the same run.

Method (written down so every number in the course means the same thing):
- CUDA events around the timed calls only; the L2 cache (50 MB on an H200) is flushed before
  every timed call by writing a 256 MB buffer, so no run reads inputs left warm in L2 by the
  previous one;
- warm-up calls first (compilation, autotuning, module load stay out of the numbers);
- one *round* times every implementation once (the median of ``rep`` calls); at least 3 rounds
  run in one process, round r timing every implementation before round r + 1 starts, so a
  change of clock or temperature during the run hits all of them alike (``interleaved``), odd
  rounds in reverse order, so no implementation always follows the same one (Note
  [Predecessors]);
- each row stores the median over rounds, the per-round values and their spread
  ((max - min) / median); a difference between two rows is called real only when it is larger
  than the spread of both (``compare``), otherwise it is printed "within noise";
- the SM clock, board power and clock-event reasons are read through NVML while the timed
  calls run (``GpuSensors``) and stored per round, or None with the reason they could not be;
- FLOPs: forward 4 * b * h * s_q * s_k * d (two matmuls of 2 * s_q * s_k * d each), halved for
  causal, x2.5 for the backward (five matmuls instead of two);
- peers (SDPA's flash, cuDNN, memory-efficient and math backends; the FA4 package when installed)
  run on the same inputs, in the same rounds, as the course's kernels; every table names the
  fastest peer of each shape in that run and gives the ratio to it (``attach_best_peer``).

Files written before rounds existed have one measurement per row (``ms``, ``ms_min`` over its
calls, no ``ms_rounds``); every reader here accepts them and takes the spread of the calls.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def attention_flops(b, h, s_q, s_k, d, causal=False, pass_="fwd") -> float:
    """FLOPs of attention by the usual convention (causal counted as half the square)."""
    flops = 4.0 * b * h * s_q * s_k * d
    if causal:
        flops *= 0.5
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
    if pass_ not in factor:
        raise ValueError(f"pass_ must be one of {sorted(factor)}, got {pass_!r}")
    return flops * factor[pass_]


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    p20_ms: float
    p80_ms: float
    reps: int

    def tflops(self, flops: float) -> float:
        return flops / (self.median_ms * 1e-3) / 1e12


class _L2Flusher:
    def __init__(self, nbytes: int = 256 * 2**20):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def __call__(self):
        self.buf.zero_()


_flusher: _L2Flusher | None = None


def clear_l2() -> None:
    """Overwrite a buffer larger than L2 (256 MB), as time_cuda does before every timed call:
    the next kernel finds none of its inputs in L2."""
    global _flusher
    if _flusher is None:
        _flusher = _L2Flusher()
    _flusher()


def call_times(fn: Callable[[], object], reps: int, flush_l2: bool = True) -> list[float]:
    """Each of ``reps`` calls of ``fn`` in milliseconds, in call order, by CUDA events around
    the call alone (L2 flushed before each unless ``flush_l2`` is False); no warm-up."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush_l2:
            clear_l2()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def time_cuda(fn: Callable[[], object], warmup: int = 5, rep: int = 30,
              flush_l2: bool = True, max_seconds: float = 4.0,
              during=contextlib.nullcontext, settle_ms: float = 0.0) -> Timing:
    """Median time of ``fn()`` in milliseconds, measured with CUDA events.

    ``rep`` is lowered for slow functions so one measurement takes about ``max_seconds``.
    ``during()`` is a context manager entered around the timed calls only (warm-up and
    compilation stay outside): ``interleaved`` reads the SM clock there. ``settle_ms``: after
    the warm-up, ``fn`` runs (L2 flushed before each call, as in the timed calls) for about
    this long more, so the GPU's clock is the one ``fn`` itself sets, not the one left by
    whatever ran before (Note [Predecessors]).
    """
    fn()  # first call: compilation, autotuning, allocations
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    # Slow functions (eager PyTorch loops) need no long warm-up and few repeats.
    for _ in range(min(warmup, int(200.0 / one))):
        fn()
    for _ in range(min(int(settle_ms / one), 10_000)):
        if flush_l2:
            clear_l2()
        fn()
    rep = max(3, min(rep, int(max_seconds * 1e3 / one)))
    with during():
        times = sorted(call_times(fn, rep, flush_l2))
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0]] * 4
    return Timing(statistics.median(times), times[0], q[0], q[-1], rep)


# Note [Predecessors]
# -------------------
# An H200 near its power limit sets its clock from the power drawn in the last few tens of
# milliseconds, so a kernel timed right after another can run partly at the clock that one
# left behind: after a slow, cool kernel (SDPA's memory-efficient backend) a higher clock than
# after a hot one. Rounds in one fixed order give every implementation the same predecessor in every
# round, and a rotated order (round r starting at implementation r) does too, cyclically; the
# H200 runs of 2026-12-01 from commit ebbb135 on used that rotation. Odd rounds backwards give
# each implementation its two neighbours in turn. A sustained run (solutions.ch08_energy), each
# implementation back to back for seconds, has no predecessor at all.
#
# Measured (results/h200/fa4_final_predecessors.json, solutions.ch08_predecessors): at D = 64,
# S = 16384, causal, a burst of 30 calls takes 8-10% longer after 40 ms of a hot kernel than
# after an idle pause, for fa4_final and the FA4 package alike, and the ratio of the two moved
# from 0.96 to 1.00 with the predecessor alone. ``time_cuda(settle_ms=...)`` runs the timed
# function itself for that long before its timed calls: every implementation is then timed at
# the clock its own load sets (after 40 ms of itself, the first timed calls there were already
# within a few per cent of the burst's last ones).


# ----------------------------------------------------------------------------------------------
# Sensors: the SM clock (and board power) while the timed calls run
#
# A GPU changes its clock with temperature and power draw, and power depends on the data (a
# multiplier whose inputs flip fewer bits draws less). Two timings taken at different clocks are
# different experiments, so every round stores the clock it ran at. NVML is the source: the
# pynvml module when importable (torch.cuda.clock_rate wraps the same call, but needs pynvml
# too), else the driver's libnvidia-ml through ctypes, else the nvidia-smi command. Where none
# works the readings are None and the reason is stored instead.

NVML_CLOCK_SM = 1  # nvmlClockType_t
# nvmlClocksEventReasons bits (nvml.h) that explain a clock below its maximum
CLOCK_EVENT_REASONS = {
    0x1: "gpu idle", 0x2: "application clocks setting", 0x4: "software power cap",
    0x8: "hardware slowdown", 0x10: "sync boost", 0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown", 0x80: "hardware power brake", 0x100: "display clocks",
}


def clock_reason_names(mask: int | None) -> list[str]:
    """The names of the set bits of an NVML clock-event reasons mask (None: nothing known)."""
    if mask is None:
        return []
    return [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]


class GpuSensors:
    """Reads one GPU's SM clock (MHz), board power (W) and clock-event reasons.

    ``read()`` returns ``{"sm_clock_mhz", "power_w", "reasons"}``, each None when unknown;
    ``source`` names what answered and ``note`` says why nothing does (``source`` None)."""

    source: str | None = None
    note: str | None = None
    min_interval_s = 0.0  # how often it may be read without disturbing the measurement

    def read(self) -> dict:
        return {"sm_clock_mhz": None, "power_w": None, "reasons": None}

    def energy(self) -> dict:
        """``{"energy_mj", "power_limit_w"}``: the energy counter and the enforced power limit
        (NVML only; None elsewhere)."""
        return {"energy_mj": None, "power_limit_w": None}


class NoSensors(GpuSensors):
    def __init__(self, note: str):
        self.note = note


class _NvmlSensors(GpuSensors):
    """NVML through pynvml (``module``) or through ctypes on libnvidia-ml."""

    def __init__(self, device_ids: dict):
        import ctypes

        self._ct = ctypes
        try:
            import pynvml

            pynvml.nvmlInit()
            self._py, self.source = pynvml, "nvml (pynvml)"
            self._handle = self._py_handle(device_ids)
        except ImportError:
            self._py = None
            self._lib = ctypes.CDLL("libnvidia-ml.so.1")
            if self._lib.nvmlInit_v2() != 0:
                raise OSError("nvmlInit_v2 failed") from None
            self.source = "nvml (libnvidia-ml via ctypes)"
            self._handle = self._ct_handle(device_ids)

    def _py_handle(self, ids):
        py = self._py
        if ids.get("bus_id"):
            return py.nvmlDeviceGetHandleByPciBusId(ids["bus_id"])
        if ids.get("uuid"):
            return py.nvmlDeviceGetHandleByUUID(ids["uuid"])
        return py.nvmlDeviceGetHandleByIndex(ids["index"])

    def _ct_handle(self, ids):
        ct, lib = self._ct, self._lib
        handle = ct.c_void_p()
        if ids.get("bus_id"):
            rc = lib.nvmlDeviceGetHandleByPciBusId_v2(ids["bus_id"].encode(), ct.byref(handle))
        elif ids.get("uuid"):
            rc = lib.nvmlDeviceGetHandleByUUID(ids["uuid"].encode(), ct.byref(handle))
        else:
            rc = lib.nvmlDeviceGetHandleByIndex_v2(ct.c_uint(ids["index"]), ct.byref(handle))
        if rc != 0:
            raise OSError(f"NVML found no device for {ids} (error {rc})")
        return handle

    def energy(self) -> dict:
        """The board's energy counter since the driver loaded (millijoules) and the power limit
        it enforces (watts); None where NVML does not say."""
        out = {"energy_mj": None, "power_limit_w": None}
        if self._py is not None:
            py, h = self._py, self._handle
            for key, call in (("energy_mj", lambda: py.nvmlDeviceGetTotalEnergyConsumption(h)),
                              ("power_limit_w",
                               lambda: py.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)):
                with contextlib.suppress(Exception):
                    out[key] = call()
            return out
        ct, lib, h = self._ct, self._lib, self._handle
        wide, value = ct.c_ulonglong(), ct.c_uint()
        if lib.nvmlDeviceGetTotalEnergyConsumption(h, ct.byref(wide)) == 0:
            out["energy_mj"] = int(wide.value)
        if lib.nvmlDeviceGetEnforcedPowerLimit(h, ct.byref(value)) == 0:
            out["power_limit_w"] = value.value / 1000.0
        return out

    def read(self) -> dict:
        out = {"sm_clock_mhz": None, "power_w": None, "reasons": None}
        if self._py is not None:
            py, h = self._py, self._handle
            reasons = (getattr(py, "nvmlDeviceGetCurrentClocksEventReasons", None)
                       or py.nvmlDeviceGetCurrentClocksThrottleReasons)  # older name
            for key, call in (("sm_clock_mhz", lambda: py.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)),
                              ("power_w", lambda: py.nvmlDeviceGetPowerUsage(h) / 1000.0),
                              ("reasons", lambda: reasons(h))):
                with contextlib.suppress(Exception):
                    out[key] = call()
            return out
        ct, lib, h = self._ct, self._lib, self._handle
        value, wide = ct.c_uint(), ct.c_ulonglong()
        if lib.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM, ct.byref(value)) == 0:
            out["sm_clock_mhz"] = float(value.value)
        if lib.nvmlDeviceGetPowerUsage(h, ct.byref(value)) == 0:
            out["power_w"] = value.value / 1000.0  # milliwatts
        reasons = (getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
                   or lib.nvmlDeviceGetCurrentClocksThrottleReasons)  # drivers before 535
        if reasons(h, ct.byref(wide)) == 0:
            out["reasons"] = int(wide.value)
        return out


class _SmiSensors(GpuSensors):
    source = "nvidia-smi"
    min_interval_s = 0.5  # each read starts a process: rarely, so the host stays free
    _QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"

    def __init__(self, device_ids: dict):
        self._id = device_ids.get("bus_id") or device_ids.get("uuid") or str(device_ids["index"])
        if self.read()["sm_clock_mhz"] is None:
            raise OSError("nvidia-smi gave no SM clock")

    def read(self) -> dict:
        out = {"sm_clock_mhz": None, "power_w": None, "reasons": None}
        try:
            text = subprocess.run(
                ["nvidia-smi", f"--query-gpu={self._QUERY}", "--format=csv,noheader,nounits",
                 "-i", self._id], capture_output=True, text=True, timeout=5,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return out
        fields = [f.strip() for f in text.split(",")]
        for key, raw, conv in zip(("sm_clock_mhz", "power_w", "reasons"), fields,
                                  (float, float, lambda x: int(x, 16))):
            with contextlib.suppress(ValueError):
                out[key] = conv(raw)
        return out


def _device_ids(device) -> dict:
    """How NVML can find the torch device: its PCI bus id, else the CUDA_VISIBLE_DEVICES entry
    (an index or a UUID), else its index."""
    import torch

    index = torch.cuda.current_device() if device is None else torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    ids = {"index": index}
    if getattr(props, "pci_bus_id", None) is not None:
        ids["bus_id"] = (f"{getattr(props, 'pci_domain_id', 0):08X}:{props.pci_bus_id:02X}:"
                         f"{getattr(props, 'pci_device_id', 0):02X}.0")
        return ids
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    if index < len(visible):
        if visible[index].isdigit():
            ids["index"] = int(visible[index])
        else:
            ids["uuid"] = visible[index]
    return ids


def open_sensors(device=None) -> GpuSensors:
    """The best available reader of this GPU's clock and power, or ``NoSensors`` saying why."""
    try:
        import torch

        if not torch.cuda.is_available():
            return NoSensors("no CUDA GPU")
        ids = _device_ids(device)
    except Exception as exc:  # torch without CUDA, a broken driver: say so, measure on
        return NoSensors(f"cannot identify the GPU: {exc}")
    failures = []
    for kind in (_NvmlSensors, _SmiSensors):
        try:
            return kind(ids)
        except Exception as exc:
            failures.append(f"{kind.__name__.strip('_')}: {type(exc).__name__}: {exc}")
    return NoSensors("; ".join(failures))


class Sampler:
    """Reads ``sensors`` every ``interval_s`` seconds on a background thread between ``start``
    and ``stop`` (and once at each end), so a reading falls inside even a short timed loop."""

    def __init__(self, sensors: GpuSensors, interval_s: float = 0.02):
        self.sensors, self.interval_s = sensors, max(interval_s, sensors.min_interval_s)
        self.readings: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self):
        while not self._stop.wait(self.interval_s):
            self.readings.append(self.sensors.read())

    def __enter__(self):
        self.readings.append(self.sensors.read())
        if self.sensors.source is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.readings.append(self.sensors.read())
        return False

    def summary(self) -> dict:
        """Median clock and power over the readings, and every clock-event reason seen."""
        def median_of(key):
            values = [r[key] for r in self.readings if r.get(key) is not None]
            return statistics.median(values) if values else None

        mask = 0
        for r in self.readings:
            mask |= r.get("reasons") or 0
        return {"sm_clock_mhz": median_of("sm_clock_mhz"), "power_w": median_of("power_w"),
                "reasons": clock_reason_names(mask), "samples": len(self.readings)}


# ----------------------------------------------------------------------------------------------
# Rounds: every implementation timed once per round, rounds repeated, medians kept

MIN_ROUNDS = 3


@dataclass
class Measured:
    """One implementation's timings over the rounds of ``interleaved``."""

    ms_rounds: list[float] = field(default_factory=list)  # the median of each round's calls
    min_ms: float | None = None  # the fastest single call of all rounds
    reps: int | None = None  # calls per round (the last round's)
    sensor_rounds: list[dict] = field(default_factory=list)  # Sampler.summary() per round
    sensors: str | None = None  # what read them
    sensors_note: str | None = None  # why nothing did
    error: str | None = None  # why it was not (fully) timed

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.ms_rounds) if self.ms_rounds else None

    @property
    def spread(self) -> float | None:
        """(slowest round - fastest round) / median: how much the same code moved in one run."""
        if not self.ms_rounds:
            return None
        return (max(self.ms_rounds) - min(self.ms_rounds)) / self.median_ms

    def tflops(self, flops: float) -> float | None:
        return flops / (self.median_ms * 1e-3) / 1e12 if self.ms_rounds else None

    def _sensor(self, key):
        return [r.get(key) for r in self.sensor_rounds]

    def fields(self, flops: float | None = None) -> dict:
        """The row fields of this measurement (see utils/results.py); ``flops`` adds TFLOP/s."""
        clocks = self._sensor("sm_clock_mhz")
        powers = self._sensor("power_w")
        known = [c for c in clocks if c is not None]
        known_w = [w for w in powers if w is not None]
        out = {
            "ms": self.median_ms, "ms_min": self.min_ms, "ms_rounds": list(self.ms_rounds),
            "spread": self.spread, "rounds": len(self.ms_rounds), "reps": self.reps,
            "sm_clock_mhz": statistics.median(known) if known else None,
            "sm_clock_mhz_rounds": clocks,
            "power_w": statistics.median(known_w) if known_w else None,
            "power_w_rounds": powers,
            "clock_reasons": sorted({n for r in self.sensor_rounds for n in r.get("reasons", [])}),
            "sensors": self.sensors,
        }
        if self.sensors is None:
            out["sensors_note"] = self.sensors_note
        if flops is not None:
            out["tflops"] = self.tflops(flops)
            out["tflops_rounds"] = [flops / (ms * 1e-3) / 1e12 for ms in self.ms_rounds]
        if self.error:
            out["error"] = self.error
        return out


def error_text(exc: Exception) -> str:
    """How a failed implementation is recorded in a row: the exception's type and first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def round_order(keys: list, rnd: int) -> list:
    """The order of round ``rnd``: odd rounds run backwards, so an implementation's predecessor
    alternates between its two neighbours (Note [Predecessors])."""
    return keys if rnd % 2 == 0 else keys[::-1]


def interleaved(fns: dict, rounds: int = MIN_ROUNDS, timer: Callable | None = None,
                sensors: GpuSensors | None = None, on_error: str = "record",
                progress: Callable[[str], None] | None = None, **timer_kw) -> dict:
    """Time every zero-argument callable of ``fns`` once per round, ``rounds`` times: round r
    times all of them before round r + 1 starts. Returns ``{key: Measured}`` in ``fns``'s order.

    ``timer(fn, during=..., **timer_kw)`` returns a ``Timing`` (default ``time_cuda``);
    ``during`` is where the sensors are sampled. One that raises is recorded (``error``) and
    left out of the later rounds, or re-raised with ``on_error="raise"``."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    timer = time_cuda if timer is None else timer
    if sensors is None:
        sensors = open_sensors() if timer is time_cuda else NoSensors("no sensors given")
    out = {key: Measured(sensors=sensors.source, sensors_note=sensors.note) for key in fns}
    for rnd in range(rounds):
        for key in round_order(list(fns), rnd):
            fn = fns[key]
            m = out[key]
            if m.error:
                continue
            sampler = Sampler(sensors)
            try:
                timing = timer(fn, during=lambda s=sampler: s, **timer_kw)
            except Exception as exc:  # a peer may not support a shape; record it plainly
                if on_error == "raise":
                    raise
                m.error = error_text(exc) + (
                    f" (in round {rnd})" if rnd else "")
                continue
            m.ms_rounds.append(timing.median_ms)
            m.min_ms = timing.min_ms if m.min_ms is None else min(m.min_ms, timing.min_ms)
            m.reps = timing.reps
            m.sensor_rounds.append(sampler.summary())
            if progress is not None:
                progress(f"round {rnd + 1}/{rounds} {key}: {timing.median_ms:.3f} ms")
    return out


def row_spread(row: dict) -> float | None:
    """A row's relative spread: between its rounds when it has them, else (older files, one
    round) between the median and the fastest of its calls."""
    if row.get("spread") is not None:
        return row["spread"]
    if row.get("ms") and row.get("ms_min"):
        return (row["ms"] - row["ms_min"]) / row["ms"]
    return None


@dataclass(frozen=True)
class Comparison:
    ratio: float  # speed of ``a`` over speed of ``b`` (> 1: a is faster)
    noise: float  # the larger of the two rows' spreads
    rounds: bool  # whether the spreads are between rounds (else between calls of one round)

    @property
    def real(self) -> bool:
        return abs(self.ratio - 1.0) > self.noise

    @property
    def verdict(self) -> str:
        if not self.real:
            return "within noise"
        return "faster" if self.ratio > 1 else "slower"

    def __str__(self) -> str:
        return f"{self.ratio:.2f}x ({self.verdict}; spread {self.noise:.1%})"


def compare(a: dict, b: dict) -> Comparison | None:
    """Row ``a`` against row ``b`` (same shape, same run): the speed ratio and whether it is
    larger than the noise, i.e. the spread of either row. None when one was not timed."""
    if not a.get("ms") or not b.get("ms"):
        return None
    spreads = [row_spread(a), row_spread(b)]
    noise = max((s for s in spreads if s is not None), default=0.0)
    return Comparison(b["ms"] / a["ms"], noise, "ms_rounds" in a and "ms_rounds" in b)


def fastest(rows: list[dict]) -> dict | None:
    """The row with the most TFLOP/s (by median), None when none was timed."""
    timed = [r for r in rows if r.get("tflops")]
    return max(timed, key=lambda r: r["tflops"]) if timed else None


# ----------------------------------------------------------------------------------------------
# Peers: the course signature attention(q, k, v, causal, softmax_scale) -> (out, lse or None).
# SDPA wants (batch, heads, seqlen, dim): a transposed view of our layout is what FlashAttention
# itself uses internally, so no copy is timed. SDPA aligns causal masks to the top left; peers
# are benchmarked with seqlen_q == seqlen_k only, where both conventions agree.


def _sdpa(backend_name: str):
    def run(q, k, v, causal=False, softmax_scale=None):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        gqa = q.shape[2] != k.shape[2]
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=causal, scale=softmax_scale, enable_gqa=gqa,
            )
        return out.transpose(1, 2), None

    run.__name__ = f"sdpa_{backend_name.lower()}"
    return run


def _fa4_package():
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        return None

    def run(q, k, v, causal=False, softmax_scale=None):
        out, lse = flash_attn_func(
            q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True
        )
        return out, lse

    return run


PEER_NAMES = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "fa4_package")


def peers(include_math: bool = False) -> dict[str, Callable]:
    """Reference implementations available on this machine, by name."""
    found = {
        "sdpa_flash": _sdpa("FLASH_ATTENTION"),
        "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
        "sdpa_efficient": _sdpa("EFFICIENT_ATTENTION"),
    }
    if include_math:
        found["sdpa_math"] = _sdpa("MATH")
    fa4 = _fa4_package()
    if fa4 is not None:
        found["fa4_package"] = fa4
    return found


# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    b: int
    s: int
    h: int
    d: int
    causal: bool = False
    h_kv: int | None = None

    @classmethod
    def standard(cls, s: int, d: int = 128, causal: bool = False, tokens: int = 16384,
                 h: int = 16) -> Shape:
        """The course's sweep shape: batch x seqlen = 16384 tokens, 16 heads."""
        return cls(b=max(1, tokens // s), s=s, h=h, d=d, causal=causal)


def _inputs(shape: Shape, dtype, requires_grad=False, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    hk = shape.h_kv or shape.h

    def r(heads):
        t = torch.randn(shape.b, shape.s, heads, shape.d, device=device, dtype=dtype, generator=g)
        return t.requires_grad_(requires_grad)

    return r(shape.h), r(hk), r(hk)


def _timed_call(fn, shape: Shape, pass_: str, dtype, device="cuda") -> Callable[[], object]:
    """A zero-argument call of ``fn`` on fresh inputs of ``shape``: the forward (inputs that
    need no gradient, so no graph is recorded), the backward of one stored forward (its graph
    kept for every call), or both ("fwd+bwd": a new forward and its backward per call)."""
    q, k, v = _inputs(shape, dtype, requires_grad=(pass_ != "fwd"), device=device)
    if pass_ == "fwd":
        return lambda: fn(q, k, v, causal=shape.causal)
    if pass_ == "fwd+bwd":  # a training step's attention: the forward, then its backward
        dout = torch.randn(q.shape, device=device, dtype=dtype)
        return lambda: torch.autograd.grad(fn(q, k, v, causal=shape.causal)[0], (q, k, v), dout)
    out = fn(q, k, v, causal=shape.causal)[0]
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def _shape_fields(shape: Shape, pass_: str, dtype) -> dict:
    return {"pass": pass_, "dtype": DTYPE_NAMES.get(dtype, str(dtype)), "b": shape.b,
            "s": shape.s, "h": shape.h, "d": shape.d, "causal": shape.causal,
            "h_kv": shape.h_kv or shape.h}


def benchmark_attention(
    impls: dict[str, Callable],
    shapes: list[Shape],
    passes=("fwd",),
    dtype=torch.bfloat16,
    warmup: int = 5,
    rep: int = 30,
    settle_ms: float = 0.0,
    progress: bool = True,
    on_error: str = "record",
    rounds: int = MIN_ROUNDS,
    timer: Callable | None = None,
    sensors: GpuSensors | None = None,
    device="cuda",
) -> list[dict]:
    """Time every implementation on every shape in ``rounds`` interleaved rounds (all of them
    on one shape and pass, then the next round); return result rows (see utils/results.py) with
    the median over rounds, the per-round values, the spread, the sensors' readings, and the
    fastest peer of the same shape (``attach_best_peer``).

    An implementation that raises (unsupported shape, out of memory) is recorded with
    ``ms = None`` and the error text, or re-raised with ``on_error="raise"``. ``timer`` and
    ``sensors`` replace ``time_cuda`` and the NVML readers (the CPU tests pass fakes, with
    ``device="cpu"``).
    """
    groups = [(s, p) for s in shapes for p in passes]
    try:
        from tqdm.auto import tqdm

        it = tqdm(groups, disable=not progress, desc="benchmark")
    except ImportError:
        it = groups
    timer = timer or time_cuda
    sensors = sensors or (open_sensors() if timer is time_cuda else NoSensors("no sensors given"))
    rows = []
    for shape, pass_ in it:
        flops = attention_flops(shape.b, shape.h, shape.s, shape.s, shape.d, shape.causal, pass_)
        calls, errors = {}, {}
        for name, fn in impls.items():
            try:
                calls[name] = _timed_call(fn, shape, pass_, dtype, device)
            except Exception as exc:  # the stored forward of a backward can fail already
                if on_error == "raise":
                    raise
                errors[name] = error_text(exc)
        measured = interleaved(calls, rounds=rounds, timer=timer, sensors=sensors,
                               on_error=on_error, warmup=warmup, rep=rep,
                               **({"settle_ms": settle_ms} if settle_ms else {}))
        for name in impls:
            row = {"impl": name, **_shape_fields(shape, pass_, dtype), "ms": None,
                   "tflops": None}
            if name in errors:
                row["error"] = errors[name]
            else:
                row.update(measured[name].fields(flops))
            rows.append(row)
        del calls
        if timer is time_cuda:
            torch.cuda.empty_cache()
    return attach_best_peer(rows)


SHAPE_KEYS = ("pass", "dtype", "b", "s", "h", "d", "causal", "h_kv")


def same_shape(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in SHAPE_KEYS)


def is_peer(row: dict) -> bool:
    return row.get("impl") in PEER_NAMES


def best_peer(rows: list[dict], row: dict) -> dict | None:
    """The fastest peer row of ``row``'s shape in ``rows`` (one run), other than ``row``."""
    return fastest([r for r in rows if is_peer(r) and r is not row and same_shape(r, row)])


def attach_best_peer(rows: list[dict]) -> list[dict]:
    """Add to every timed row the fastest peer of its shape in the same run: ``best_peer``,
    ``best_peer_tflops`` and ``vs_best_peer`` (this row's TFLOP/s over the peer's)."""
    for row in rows:
        peer = best_peer(rows, row) if row.get("tflops") else None
        if peer is not None:
            row.update(best_peer=peer["impl"], best_peer_tflops=peer["tflops"],
                       vs_best_peer=row["tflops"] / peer["tflops"])
    return rows


FAST_PEERS = ("sdpa_flash", "sdpa_cudnn", "fa4_package")  # the yardsticks of a kernel's tables
PEER_KEY = "peer"  # marks a peer's entry among a sweep's keys: (group, PEER_KEY, name)


def peer_calls(q, k, v, causal: bool, names=FAST_PEERS) -> dict[str, Callable[[], object]]:
    """Zero-argument forward calls of the peers in ``names`` found on this machine, on these
    inputs: what a sweep or knob table times in its rounds next to its own kernel."""
    found = peers(include_math="sdpa_math" in names)
    return {name: (lambda fn=found[name]: fn(q, k, v, causal=causal))
            for name in names if name in found}


def peer_fields(measured: dict, flops: float) -> dict:
    """For result files whose rows are one kernel's configurations (a sweep, a knob table):
    the peers timed in the same rounds, as fields to put in each row of that shape.
    ``measured`` maps peer names to their ``Measured``."""
    timed = {name: m for name, m in measured.items() if m.ms_rounds}
    out = {"peers_tflops": {name: m.tflops(flops) for name, m in timed.items()},
           "peers_spread": {name: m.spread for name, m in timed.items()}}
    errors = {name: m.error for name, m in measured.items() if m.error}
    if errors:
        out["peers_error"] = errors
    if timed:
        name = max(timed, key=lambda n: timed[n].tflops(flops))
        out.update(best_peer=name, best_peer_tflops=timed[name].tflops(flops),
                   best_peer_spread=timed[name].spread)
    return out


def vs_best_peer(row: dict) -> str:
    """'0.94x fa4_package (682)': a row's ratio to the fastest peer of its run, or '' if none."""
    peer = row.get("best_peer_tflops")
    if not peer or not row.get("tflops"):
        return ""
    return f"{row['tflops'] / peer:.2f}x {row['best_peer']} ({peer:.0f})"


def spread_note(rows: list[dict]) -> str:
    """What the spreads of ``rows`` are: between rounds, or (files written before rounds)
    between the calls of one measurement, which misses the drift from one run to the next."""
    timed = [r for r in rows if r.get("ms")]
    if timed and all("ms_rounds" in r for r in timed):
        n = min(r.get("rounds") or len(r["ms_rounds"]) for r in timed)
        return f"spread: (slowest - fastest) / median over {n} interleaved rounds"
    return ("spread: between the calls of one measurement (these rows were measured once, "
            "before rounds were stored); drift between runs is not in it, so a verdict from "
            "it is optimistic")


def ratio_table(rows: list[dict], baseline: str | None = None, pass_: str = "fwd") -> str:
    """Each implementation's TFLOP/s and its ratio to ``baseline`` (None: the fastest peer of
    that shape), shape by shape, and the fastest peer of each shape. A ratio marked ``~`` is
    within noise: no larger than the spread of either row."""
    keys = sorted({(r["d"], r["s"], r["causal"]) for r in rows if r["pass"] == pass_})
    names = list(dict.fromkeys(r["impl"] for r in rows))
    against = baseline or "best peer"
    lines = [f"TFLOP/s (ratio to {against})",
             f"{'D':>4} {'S':>6} {'causal':>6}  " + "  ".join(f"{n:>16}" for n in names)
             + "  best peer"]
    for d, s, causal in keys:
        found = {
            r["impl"]: r for r in rows
            if r["pass"] == pass_ and (r["d"], r["s"], r["causal"]) == (d, s, causal)
        }
        group = list(found.values())
        top = fastest([r for r in group if is_peer(r)])
        cells = []
        for n in names:
            r = found.get(n, {})
            t = r.get("tflops")
            base = found.get(baseline) if baseline else best_peer(group, r) if r else None
            if t is None:
                cells.append(f"{'-':>16}")
            elif base and base.get("tflops"):
                cmp = compare(r, base)
                mark = "~" if cmp is not None and not cmp.real else " "
                cells.append(f"{t:7.0f} ({mark}{t / base['tflops']:4.2f}x)")
            else:
                cells.append(f"{t:16.0f}")
        best = f"{top['impl']} {top['tflops']:.0f}" if top else "-"
        lines.append(f"{d:>4} {s:>6} {causal!s:>6}  " + "  ".join(cells) + f"  {best}")
    lines.append("~: within noise (the ratio differs from 1 by no more than either row's spread)")
    lines.append(spread_note([r for r in rows if r["pass"] == pass_]))
    return "\n".join(lines)


def geomean(values) -> float:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
