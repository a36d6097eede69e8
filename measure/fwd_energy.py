"""Each forward's energy per call and speed under sustained load, next to the FA4
package's.

The benchmark (utils.bench) times short bursts of calls, L2 flushed before each. A training run
keeps the GPU busy for hours instead, and an H200 that reaches its power limit lowers its clock
until the board draws no more: then a kernel's speed is its work divided by the energy it spends
on that work, at the power the limit allows. This tool runs each implementation back to back for
a few seconds (no L2 flush, ten calls queued at a time), reads the board's energy counter
(NVML, millijoules) before and after, and stores per call: joules, time, TFLOP/s, the mean power
and the SM clock over the run. Implementations alternate in three rounds per shape, odd ones
backwards: fa4_final, the same kernel
without the split tail (non-causal shapes), and the benchmark's two fastest peers.

    python -m measure.fwd_energy               # writes results/<gpu>/fa4_final_energy.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from fa4_final.runtime.prologue import forward
from utils import bench, results

RESULTS = "fa4_final_energy"
PRODUCES = [(f"results/h200/{RESULTS}.json", "python -m measure.fwd_energy",
             "fa4_final and its two fastest peers run back to back for seconds each: energy "
             "per call, speed, power and clock under sustained load")]
# the forward benchmark's eight shapes (measure.benchmark --name fa4_final_fwd)
SHAPES = tuple((d, s, c) for d in (64, 128) for s in (4096, 16384) for c in (False, True))
TOKENS, HEADS = 16384, 16
PEERS = ("fa4_package", "sdpa_cudnn")  # the two fastest peers of the benchmark
WHOLE = "fa4_final, last round whole"  # non-causal: the same kernel without the split tail


def sustained(fn, sensors, seconds: float) -> dict:
    """Call ``fn`` back to back for about ``seconds``; energy and time per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    sampler = bench.Sampler(sensors)
    start = sensors.energy()["energy_mj"]
    t0 = time.perf_counter()
    calls = 0
    with sampler:
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                fn()
            calls += 10
            torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    end = sensors.energy()["energy_mj"]
    out = {"calls": calls, "seconds": elapsed, "ms_per_call": 1e3 * elapsed / calls}
    out.update({k: v for k, v in sampler.summary().items() if k in ("sm_clock_mhz", "power_w")})
    if start is not None and end is not None:
        out["joules_per_call"] = (end - start) / 1e3 / calls
        out["mean_power_w"] = (end - start) / 1e3 / elapsed
    return out


def measure(seconds: float = 1.5, rounds: int = 3, save: bool = True) -> list[dict]:
    from dataclasses import replace

    from fa4_final.hopper.config import hopper_fwd_default
    from utils.reference import random_qkv

    sensors = bench.open_sensors()
    rows = []
    for d, s, causal in SHAPES:
        batch = TOKENS // s
        q, k, v, seed = random_qkv(batch, s, HEADS, d, device="cuda")
        flops = bench.attention_flops(batch, HEADS, s, s, d, causal)
        calls = {"fa4_final": lambda qkv=(q, k, v), c=causal: forward(*qkv, c)}
        if not causal:
            whole = replace(hopper_fwd_default(d, causal), schedule="table")
            calls[WHOLE] = lambda qkv=(q, k, v), cfg=whole: forward(*qkv, config=cfg)
        calls.update(bench.peer_calls(q, k, v, causal, names=PEERS))
        # the kernels' answers first (NaN never passes): against torch's SDPA (the backend it
        # picks), within bf16's rounding of out
        want = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)
        agree = {}
        for name in [n for n in calls if n.startswith("fa4_final")]:
            got = calls[name]()[0]
            err = (got.float() - want.float()).abs().max().item()
            agree[name] = err
            if not err <= 2e-2:  # NaN fails too
                raise AssertionError(f"{name} D={d} S={s} causal={causal}: max |out - SDPA| "
                                     f"{err} > 2e-2")
        runs = {name: [] for name in calls}
        for rnd in range(rounds):
            for name in bench.round_order(list(calls), rnd):
                runs[name].append(sustained(calls[name], sensors, seconds))
        for name, got in runs.items():
            per_run = [r["ms_per_call"] for r in got]
            ms = statistics.median(per_run)
            row = {"impl": name, "pass": "fwd", "dtype": "bf16", "b": batch, "s": s,
                   "h": HEADS, "h_kv": HEADS, "d": d, "causal": causal, "seed": seed, "runs": got,
                   "ms": ms, "ms_rounds": per_run, "rounds": len(per_run),
                   "spread": (max(per_run) - min(per_run)) / ms,
                   "tflops": flops / (ms * 1e-3) / 1e12}
            if name in agree:
                row["max_abs_diff_vs_sdpa"] = agree[name]
            joules = [r["joules_per_call"] for r in got if r.get("joules_per_call")]
            if joules:
                row["joules_per_call"] = statistics.median(joules)
                row["tflop_per_joule"] = flops / 1e12 / row["joules_per_call"]
            rows.append(row)
            print(f"D={d} S={s} causal={causal} {name:28s} {row['tflops']:5.0f} TFLOP/s "
                  f"sustained, {row.get('tflop_per_joule', float('nan')):.2f} TFLOP/J, "
                  f"power {[round(r.get('mean_power_w') or 0) for r in got]} W, clock "
                  f"{[r.get('sm_clock_mhz') for r in got]} MHz", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    if save:
        limit = sensors.energy()["power_limit_w"]
        for r in rows:
            r["power_limit_w"] = limit
        print("wrote", results.save(RESULTS, rows, command="python -m measure.fwd_energy"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90); the stored results are in results/h200/")
        return 0
    measure(args.seconds, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
