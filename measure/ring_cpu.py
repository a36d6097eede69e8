"""The ring on this CPU: 1, 2 and 4 gloo processes, time per step and the communication hidden.

    python -m measure.ring_cpu [--seqlen 2048] [--rounds 3]

Each run starts W processes (solutions.ch14_ring.launch, one thread each) that hold a zigzag
share of one causal problem in float32 and run the ring forward (solutions.ch14_ring
.ring_forward with the float32 reference block function). Per rank it records the forward's
wall time, the time blocked in waits for the next K, V piece (DistRing.waited_s), and, in a
second pass with the attention replaced by nothing, the time the same transfers take alone.
The rows keep the slowest rank's figures (the ring finishes with it), the median over
``--rounds`` interleaved rounds (W in order 1, 2, 4, then reversed) and every round's value.

These are CPU and gloo figures (loopback TCP between processes of one machine, which is shared
with other work): they show the method (what overlaps, what each step costs), not what a GPU
with NVLink does. Writes results/cpu/ring_cpu.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from solutions import ch14_ring as ring
from utils import results

PRODUCES = [
    ("results/cpu/ring_cpu.json", "python -m measure.ring_cpu",
     "the ring forward on 1, 2 and 4 gloo processes of this CPU (float32, causal, zigzag): wall "
     "time, time waited for K, V, the same transfers alone, per round; chapter 14 reads it"),
]

WORLDS = (1, 2, 4)


def _nothing(q, k, v, q_start=0, k_start=0, causal=False, softmax_scale=None):
    b, sq, h, _ = q.shape
    return (torch.zeros(b, sq, h, v.shape[-1], dtype=q.dtype),
            torch.full((b, h, sq), float("-inf"), dtype=q.dtype))


def timing_worker(rank: int, world: int, case, repeats: int):
    """One rank: the forward ``repeats`` times with attention, then with none; the medians."""
    import torch.distributed as dist

    comm = ring.DistRing()
    q, k, v, _ = case.inputs(dtype=torch.float32)
    layout = ring.zigzag_layout(case.s, world)
    lq, lk, lv = (layout.shard(t, rank) for t in (q, k, v))
    found = {}
    for name, block in (("with", ring.block_forward), ("alone", _nothing)):
        walls, waits = [], []
        for _ in range(repeats + 1):  # the first is a warm-up
            dist.barrier()
            comm.waited_s = 0.0
            t0 = time.perf_counter()
            ring.ring_forward(lq, lk, lv, layout, comm, case.causal, block_fn=block)
            walls.append(time.perf_counter() - t0)
            waits.append(comm.waited_s)
        found[name] = (statistics.median(walls[1:]) * 1e3, statistics.median(waits[1:]) * 1e3)
    return found


def measure(seqlen: int, rounds: int, repeats: int) -> list[dict]:
    case = ring.Case(1, seqlen, 4, 4, 64, True, 0)
    per_world: dict = {w: {"fwd_ms": [], "wait_ms": [], "transfer_alone_ms": []}
                       for w in WORLDS}
    for rnd in range(rounds):
        order = WORLDS if rnd % 2 == 0 else tuple(reversed(WORLDS))
        for world in order:
            ranks = ring.launch(timing_worker, world, (case, repeats), deadline=600)
            slowest = max(range(world), key=lambda r: ranks[r]["with"][0])
            per_world[world]["fwd_ms"].append(ranks[slowest]["with"][0])
            per_world[world]["wait_ms"].append(max(r["with"][1] for r in ranks))
            per_world[world]["transfer_alone_ms"].append(max(r["alone"][1] for r in ranks))
            print(f"round {rnd} W={world}: forward {ranks[slowest]['with'][0]:.1f} ms, waited "
                  f"{per_world[world]['wait_ms'][-1]:.2f} ms, transfers alone "
                  f"{per_world[world]['transfer_alone_ms'][-1]:.2f} ms", flush=True)
    import os

    rows = []
    for world, metrics in per_world.items():
        for metric, values in metrics.items():
            med = statistics.median(values)
            rows.append({
                "impl": "ring_gloo_cpu", "metric": metric, "value": med, "unit": "ms",
                "world": world, "rounds": [round(v, 4) for v in values],
                "spread": (max(values) - min(values)) / med if med else 0.0,
                "seqlen": case.s, "heads": case.h, "heads_kv": case.hk, "head_dim": case.d,
                "causal": case.causal, "dtype": "float32", "layout": "zigzag",
                "backend": "gloo", "threads_per_rank": 1, "repeats": repeats,
                "host_cores": os.cpu_count(),
                "note": "CPU and gloo over loopback on one shared machine: not a GPU figure",
            })
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows = measure(args.seqlen, args.rounds, args.repeats)
    command = "python -m measure.ring_cpu" + (
        "" if (args.seqlen, args.rounds, args.repeats) == (2048, 3, 3)
        else f" --seqlen {args.seqlen} --rounds {args.rounds} --repeats {args.repeats}")
    path = results.save("ring_cpu", rows, command, gpu="cpu")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
