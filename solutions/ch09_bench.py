"""Chapters 09-10 on a Blackwell GPU: verify, then time our sm_100a forward against its peers.

    python -m solutions.ch09_bench            # the course's sweep, 3 interleaved rounds
    python -m solutions.ch09_bench --small    # one small verified case per variant (a smoke run)

Variants: the 1-CTA kernel, the 2-CTA kernel, each knob of chapters 06-07 off; peers: PyTorch
SDPA (flash, cuDNN) and the FA4 package when installed. Every variant is first checked against
the float64 reference on one case (the row carries ``verified``). Rounds interleave every
implementation so that clock drift hits all of them alike; the stored figure is the median of
the rounds. Results: ``results/b200/ch09_fwd.json`` (the folder follows the GPU's name), with
provenance. This is a script, not a test: it only runs where a B200/B300 is present, and nothing
in the course quotes a Blackwell figure until it has run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

VARIANTS = {
    "fa4_final_sm100": {},
    "fa4_final_sm100_1cta": {"two_cta": False},
    "fa4_final_sm100_2cta": {"two_cta": True},
    "fa4_final_sm100_no_emulation": {"exp2_emulation_fraction": 0.0},
    "fa4_final_sm100_always_rescale": {"rescale_threshold": 0.0},
}


def variant(knobs: dict, causal_default=None):
    from fa4_final.blackwell.config import blackwell_fwd_default
    from fa4_final.blackwell.fwd import attention

    def run(q, k, v, causal=False, softmax_scale=None):
        cfg = replace(blackwell_fwd_default(q.shape[-1], causal), **knobs)
        return attention(q, k, v, causal, softmax_scale, config=cfg)

    return run


def verify(fn, d: int, causal: bool) -> bool:
    import torch

    from utils.checks import tolerance_check
    from utils.reference import attention_reference, random_qkv

    q, k, v, _ = random_qkv(2, 1000, 4, d, seqlen_k=1100, heads_kv=2, dtype=torch.bfloat16,
                            device="cuda")
    out, _ = fn(q, k, v, causal=causal)
    ref = attention_reference(q, k, v, causal, dtype=torch.float64)
    same = attention_reference(q, k, v, causal, dtype=torch.bfloat16)
    return tolerance_check(out, ref[0], same[0], "out").ok


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
        print(f"ch09_bench: {why}", file=sys.stderr)
        return 2
    from utils import bench, results

    ours = {name: variant(knobs) for name, knobs in VARIANTS.items()}
    if args.small:
        for name, fn in ours.items():
            for d in (64, 128):
                for causal in (False, True):
                    ok = verify(fn, d, causal)
                    print(f"{name} D={d} causal={causal}: {'verified' if ok else 'WRONG'}")
                    if not ok:
                        return 1
        return 0
    verified = {(n, d, c): verify(fn, d, c) for n, fn in ours.items() for d in args.dims
                for c in (False, True)}
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
    cmd = "python -m solutions.ch09_bench " + " ".join(argv if argv is not None
                                                       else sys.argv[1:])
    path = results.save(args.name, rows, command=cmd)
    print(bench.ratio_table(rows, "sdpa_cudnn"))
    print(f"stored {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
