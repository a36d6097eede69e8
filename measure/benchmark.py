"""Benchmark course kernels next to their peers in one run and store the figures.

    python -m measure.benchmark --versions flash_ampere --name ch04_fwd \
        --seqlens 4096 16384 --dims 128 --causal both

Writes results/<gpu>/<name>.json (utils/results.py) and prints TFLOP/s with ratios to the
fastest peer of each shape. Course versions and peers are timed in ``--rounds`` interleaved
rounds shape by shape (utils.bench.interleaved: every implementation once per round), so all see
the same GPU state; rows keep the median over rounds, each round's value, the spread and the SM
clock of each round.
"""

from __future__ import annotations

import argparse
import sys

import torch

from solutions.registry import by_name
from utils import bench, results

_FWD = "--seqlens 4096 16384 --dims 64 128 --causal both"
PRODUCES = [
    ("results/h200/peers.json", "python -m measure.benchmark --name peers --seqlens 1024 4096 "
     "16384 --dims 64 128 --causal both --passes fwd bwd",
     "the peers alone (SDPA flash, cuDNN, the FA4 package), forward and backward"),
    ("results/h200/ch01_ch02_fwd.json", "python -m measure.benchmark --versions naive tiled_fa2 "
     "--name ch01_ch02_fwd --seqlens 1024 4096 16384 --dims 128 --causal no",
     "chapters 01-02's PyTorch versions beside the peers"),
    ("results/h200/ch04_fwd.json", f"python -m measure.benchmark --versions flash_ampere --name "
     f"ch04_fwd {_FWD}", "chapter 04's kernel beside the peers"),
    ("results/h200/ch05_fwd.json", f"python -m measure.benchmark --versions flash_hopper --name "
     f"ch05_fwd {_FWD}", "chapter 05's kernel beside the peers"),
    ("results/h200/fa4_final_fwd.json", f"python -m measure.benchmark --versions fa4_final "
     f"flash_hopper --name fa4_final_fwd {_FWD} --rounds 3",
     "fa4_final's forward beside chapter 05's kernel and the peers, in bursts"),
    ("results/h200/fa4_final_fwd_settled.json", f"python -m measure.benchmark --versions "
     f"fa4_final flash_hopper --name fa4_final_fwd_settled {_FWD} --rounds 5 --settle-ms 50",
     "the same, each implementation settled at its own clock first"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--versions", nargs="*", default=[], help="course versions (registry names)")
    ap.add_argument("--name", required=True, help="results file name, e.g. ch04_fwd")
    ap.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--dims", nargs="+", type=int, default=[128])
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--passes", nargs="+", default=["fwd"], choices=["fwd", "bwd", "fwd+bwd"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--rep", type=int, default=30, help="timed calls per round")
    ap.add_argument("--rounds", type=int, default=bench.MIN_ROUNDS,
                    help=f"interleaved rounds (at least {bench.MIN_ROUNDS})")
    ap.add_argument("--settle-ms", type=float, default=0.0,
                    help="before its timed calls, each implementation runs this long more "
                    "(utils.bench Note [Predecessors])")
    args = ap.parse_args(argv)
    if args.rounds < bench.MIN_ROUNDS:
        ap.error(f"--rounds: at least {bench.MIN_ROUNDS}, so a round's spread can be told from "
                 "an effect")

    if not torch.cuda.is_available():
        print("benchmark: needs a CUDA GPU", file=sys.stderr)
        return 2
    versions = [by_name(name) for name in args.versions]
    impls = {v.name: v.load() for v in versions}
    if not args.no_peers:
        impls.update(bench.peers())
    no_backward = {v.name for v in versions if not v.backward}
    causal = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    shapes = [
        bench.Shape.standard(s, d, c) for d in args.dims for s in args.seqlens for c in causal
    ]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = []
    for pass_ in args.passes:
        run = {n: f for n, f in impls.items() if pass_ == "fwd" or n not in no_backward}
        rows += bench.benchmark_attention(run, shapes, passes=(pass_,), dtype=dtype, rep=args.rep,
                                          rounds=args.rounds, settle_ms=args.settle_ms)
    path = results.save(args.name, rows, command="python -m measure.benchmark " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    for pass_ in args.passes:
        print(f"\n{pass_}:")
        print(bench.ratio_table(rows, None, pass_))
    clocks = [r["sm_clock_mhz"] for r in rows if r.get("sm_clock_mhz")]
    if clocks:
        print(f"\nSM clock during the timed calls: {min(clocks):.0f}-{max(clocks):.0f} MHz "
              f"({rows[0]['sensors']})")
    else:
        note = next((r.get("sensors_note") for r in rows if "sensors" in r), "nothing timed")
        print(f"\nSM clock not read: {note}")
    for r in rows:
        if r.get("error"):
            print(f"  {r['impl']} D={r['d']} S={r['s']} causal={r['causal']}: {r['error']}")
    print(f"\nstored {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
