"""Chapters 09-10 on a Blackwell GPU: verify, then time our sm_100a forward against its peers.

    python -m measure.blackwell_fwd            # the course's sweep, 3 interleaved rounds
    python -m measure.blackwell_fwd --small    # one small verified case per variant (a smoke run)

Variants (``solutions.ch09_teaching.FORWARD_VARIANTS``): the 1-CTA kernel, the 2-CTA kernel,
each knob of chapters 06-07 off; peers: PyTorch SDPA (flash, cuDNN) and the FA4 package when
installed. Every variant is first checked against the float64 reference on one case (the row
carries ``verified``). Rounds interleave every implementation so that clock drift hits all of
them alike; the stored figure is the median of the rounds. Results: ``results/b200/ch09_fwd.json``
(the folder follows the GPU's name), with provenance. It only runs where a B200/B300 is present,
and nothing in the course quotes a Blackwell figure until it has run.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from solutions.ch09_teaching import FORWARD_VARIANTS, forward_variant, verify_forward

PRODUCES = [("results/b*/ch09_fwd.json", "python -m measure.blackwell_fwd",
             "fa4_final's sm_100a forward (1-CTA, 2-CTA, chapters 06-07's knobs off) verified, "
             "then timed in 3 interleaved rounds beside the peers on a Blackwell GPU")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--name", default="ch09_fwd")
    args = ap.parse_args(argv)

    from utils.hardware import missing

    why = missing("sm_100")
    if why:
        print(f"blackwell_fwd: {why}", file=sys.stderr)
        return 2
    from utils import bench, results

    ours = {name: forward_variant(knobs) for name, knobs in FORWARD_VARIANTS.items()}
    if args.small:
        for name, fn in ours.items():
            for d in (64, 128):
                for causal in (False, True):
                    ok = verify_forward(fn, d, causal)
                    print(f"{name} D={d} causal={causal}: {'verified' if ok else 'WRONG'}")
                    if not ok:
                        return 1
        return 0
    verified = {(n, d, c): verify_forward(fn, d, c) for n, fn in ours.items()
                for d in args.dims for c in (False, True)}
    impls = {**ours, **bench.peers()}
    shapes = [bench.Shape.standard(s, d, c) for d in args.dims for s in args.seqlens
              for c in (False, True)]
    rounds = [bench.benchmark_attention(impls, shapes, rep=args.rep)
              for _ in range(args.rounds)]
    rows = []
    for i, row in enumerate(rounds[0]):
        times = [r[i]["ms"] for r in rounds if r[i]["ms"] is not None]
        merged = dict(row)
        if times:
            ms = statistics.median(times)
            flops = bench.attention_flops(row["b"], row["h"], row["s"], row["s"], row["d"],
                                          row["causal"])
            merged.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, ms_rounds=times,
                          rounds=len(times))
        merged["verified"] = verified.get((row["impl"], row["d"], row["causal"]))
        rows.append(merged)
    cmd = "python -m measure.blackwell_fwd " + " ".join(argv if argv is not None
                                                        else sys.argv[1:])
    path = results.save(args.name, rows, command=cmd)
    print(bench.ratio_table(rows, "sdpa_cudnn"))
    print(f"stored {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
