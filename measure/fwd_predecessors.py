"""Does a kernel's time in a burst depend on what ran before it?

utils.bench Note [Predecessors] says an H200 near its power limit may run a kernel partly at
the clock its predecessor left. This module tests that at one shape: for each implementation
and each predecessor (an idle pause, a burst of SDPA's slow memory-efficient backend, a burst of
the other implementation, a burst of itself), it runs the predecessor, then ``reps`` timed calls
with the L2 flushed before each (as utils.bench.time_cuda does), and keeps every call's time,
not just the median, so a drift inside the burst shows. Orders alternate over ``rounds``.

    python -m measure.fwd_predecessors              # results/<gpu>/fa4_final_predecessors.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fa4_final.runtime.prologue import forward
from utils import bench, results

NAME = "fa4_final_predecessors"
PRODUCES = [(f"results/h200/{NAME}.json", "python -m measure.fwd_predecessors",
             "one shape's bursts of fa4_final and the FA4 package, each timed after four "
             "different predecessors, every call kept")]
PREDECESSORS = ("idle 0.5 s", "sdpa_efficient", "other", "itself")


def _burst(fn, calls: int) -> None:
    for _ in range(calls):
        fn()


def measure(d: int = 64, s: int = 16384, causal: bool = True, reps: int = 30, rounds: int = 4,
            pred_ms: float = 40.0) -> list[dict]:
    from utils.reference import random_qkv

    b = 16384 // s
    q, k, v, seed = random_qkv(b, s, 16, d, device="cuda")
    flops = bench.attention_flops(b, 16, s, s, d, causal)
    peers = bench.peers()
    impls = {"fa4_final": lambda: forward(q, k, v, causal),
             "fa4_package": lambda: peers["fa4_package"](q, k, v, causal=causal)}
    slow = lambda: peers["sdpa_efficient"](q, k, v, causal=causal)  # noqa: E731
    for fn in (*impls.values(), slow):  # compile and warm every kernel once
        fn()
    torch.cuda.synchronize()

    def calls_for(fn):  # how many calls of fn fill about pred_ms
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return max(1, int(pred_ms / max((time.perf_counter() - t0) * 1e3, 1e-3)))

    counts = {name: calls_for(fn) for name, fn in impls.items()}
    counts["sdpa_efficient"] = calls_for(slow)
    sensors = bench.open_sensors()
    rows = []
    names = list(impls)
    for rnd in range(rounds):
        for name in bench.round_order(names, rnd):
            other = names[1 - names.index(name)]
            for pred in bench.round_order(list(PREDECESSORS), rnd):
                torch.cuda.synchronize()
                if pred.startswith("idle"):
                    time.sleep(0.5)
                elif pred == "sdpa_efficient":
                    _burst(slow, counts["sdpa_efficient"])
                elif pred == "other":
                    _burst(impls[other], counts[other])
                else:
                    _burst(impls[name], counts[name])
                sampler = bench.Sampler(sensors)
                with sampler:
                    ms = bench.call_times(impls[name], reps)
                med = statistics.median(ms)
                rows.append({"impl": name, "predecessor": pred, "round": rnd, "pass": "fwd",
                             "dtype": "bf16", "b": b, "s": s, "h": 16, "d": d,
                             "causal": causal, "seed": seed, "ms": med, "ms_calls": ms,
                             "tflops": flops / (med * 1e-3) / 1e12, **sampler.summary()})
                print(f"round {rnd} {name:12s} after {pred:15s}: {med:.3f} ms, first 5 "
                      f"{[round(x, 3) for x in ms[:5]]}, last 5 {[round(x, 3) for x in ms[-5:]]}"
                      f" ({rows[-1]['sm_clock_mhz']} MHz, {rows[-1]['power_w']} W)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs=3, type=int, default=(64, 16384, 1),
                    metavar=("D", "S", "CAUSAL"))
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90); the stored results are in results/h200/")
        return 0
    d, s, c = args.shape
    rows = measure(d, s, bool(c), rounds=args.rounds)
    print("wrote", results.save(NAME, rows, command="python -m measure.fwd_predecessors"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
