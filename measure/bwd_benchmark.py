"""Chapter 11's measurement: the backward, fa4_final (default and deterministic) next to its
peers, one run.

    python -m measure.bwd_benchmark                 # D = 128, S = 4096 and 16384, causal or not
    python -m measure.bwd_benchmark --rounds 5 --seqlens 4096

Rows ``fa4_final`` and ``fa4_final_deterministic`` (fa4_final.api.autograd over fa4_final's forward
and backward) and the peers of utils.bench.peers() (SDPA's flash and cuDNN backends, the FA4
package when installed; SDPA's memory-efficient backend with --efficient). Each measurement is
the backward alone: the forward runs once and ``torch.autograd.grad`` is timed
(utils.bench._time_one), with the L2 cache flushed before every call. Every implementation runs
once per shape per round, interleaved, for ``--rounds`` rounds; the stored row is the median
of the rounds' medians, with the rounds' min and max. Before timing, each shape's fa4_final
gradients are compared with SDPA flash's (the largest difference relative to the largest
gradient is stored with the row): a wrong kernel is not benchmarked in silence.

Writes results/<gpu>/ch11_bwd.json (utils.results.save, with provenance); notebook 11 reads it
through solutions.ch11_teaching (ratio_rows, the claims).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from utils import bench, results

IMPLS = ("fa4_final", "fa4_final_deterministic")
PRODUCES = [("results/h200/ch11_bwd.json", "python -m measure.bwd_benchmark",
             "the backward (dQ, dK, dV from a stored forward) of fa4_final, default and "
             "deterministic, beside SDPA flash, cuDNN and the FA4 package: D = 128, S = 4096 and "
             "16384, causal or not, 3 interleaved rounds, gradients checked against SDPA flash"),
            ("results/h100/bwd_bench_h100.json", "python -m measure.bwd_benchmark --dims 64 128 "
             "--rounds 3 --name bwd_bench_h100", "an H100 visit (no H200 was lent): the same "
             "at D = 64 and 128, one call at a time after an L2 flush"),
            ("results/h100/bwd_bench.json", "python -m measure.bwd_benchmark --dims 64 128 "
             "--rounds 5 --name bwd_bench --deadline 357", "an H100 visit: issue 34's table, "
             "D = 64 and 128, S = 4096 and 16384, causal or not, five interleaved rounds, one "
             "call at a time after an L2 flush, default and deterministic beside every peer"),
            ("results/h100/fwd_bwd_bench.json", "python -m measure.bwd_benchmark --dims 64 128 "
             "--rounds 5 --passes fwd+bwd --name fwd_bwd_bench --deadline 450", "the same visit: "
             "a forward and its backward per call (a training step's attention), the same "
             "shapes, rounds and peers")]


def _ours(deterministic: bool):
    from fa4_final.api.autograd import attention_autograd

    def run(q, k, v, causal=False, softmax_scale=None):
        return attention_autograd(q, k, v, causal, softmax_scale, deterministic), None

    run.__name__ = IMPLS[deterministic]
    return run


def _max_rel_diff(fn, ref, shape: bench.Shape) -> float:
    """max |grad - grad_ref| / max |grad_ref| over dq, dk, dv on the benchmark's inputs."""
    q, k, v = bench._inputs(shape, torch.bfloat16, requires_grad=True, seed=1)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    worst = 0.0
    grads = []
    for f in (fn, ref):
        out = f(q, k, v, causal=shape.causal)[0]
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for g, r in zip(*grads):
        worst = max(worst, ((g.float() - r.float()).abs().max() / r.float().abs().max()).item())
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--dims", nargs="+", type=int, default=[128])
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--efficient", action="store_true", help="also SDPA's efficient backend")
    ap.add_argument("--name", default="ch11_bwd")
    ap.add_argument("--passes", nargs="+", default=["bwd"], choices=["bwd", "fwd+bwd"],
                    help="bwd: the backward alone; fwd+bwd: a forward and its backward per "
                    "call (a training step's attention)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds: start no round after this many; the file is saved after "
                    "every round, so a run cut short keeps the rounds it finished")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    start = time.monotonic()
    if not torch.cuda.is_available():
        print("measure.bwd_benchmark: needs a CUDA GPU", file=sys.stderr)
        return 2
    impls = {name: _ours(det) for det, name in enumerate(IMPLS)}
    peers = bench.peers()
    if not args.efficient:
        peers.pop("sdpa_efficient", None)
    impls.update(peers)
    causal = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    shapes = [bench.Shape.standard(s, d, c) for d in args.dims for s in args.seqlens
              for c in causal]

    checks = {}
    for shape in shapes:
        for name in IMPLS:
            checks[(name, shape)] = _max_rel_diff(impls[name], peers["sdpa_flash"], shape)
            print(f"{name} D={shape.d} S={shape.s} causal={shape.causal}: gradients within "
                  f"{checks[(name, shape)]:.2e} (relative) of SDPA flash", flush=True)

    command = "python -m measure.bwd_benchmark " + " ".join(
        argv if argv is not None else sys.argv[1:])
    per_round: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        if r and args.deadline is not None and time.monotonic() - start > args.deadline:
            print(f"stopped after {r} of {args.rounds} rounds (--deadline {args.deadline} s)",
                  flush=True)
            break
        for shape in shapes:  # interleaved: every implementation once per shape per round
            rows = bench.benchmark_attention(impls, [shape], passes=tuple(args.passes),
                                             rep=args.rep, progress=False)
            for row in rows:
                per_round.setdefault((row["impl"], shape, row["pass"]), []).append(row)
        out = _summarise(per_round, checks)
        path = results.save(args.name, out, command=command)
        print(f"round {r + 1}/{args.rounds} done (saved)", flush=True)

    for pass_ in args.passes:
        print(f"\n{pass_} TFLOP/s, median of rounds (ratio to the first column's impl):")
        print(bench.ratio_table(out, "fa4_final", pass_))
    for row in out:
        if row.get("tflops"):
            spread = (row["tflops_max"] - row["tflops_min"]) / row["tflops"]
            print(f"  {row['pass']:<7} {row['impl']:<24} D={row['d']} S={row['s']:<6} "
                  f"causal={row['causal']!s:<5} {row['tflops']:6.0f} TFLOP/s (rounds "
                  f"{row['tflops_min']:.0f}-"
                  f"{row['tflops_max']:.0f}, spread {100 * spread:.1f} %)")
        else:
            print(f"  {row['impl']} D={row['d']} S={row['s']} causal={row['causal']}: "
                  f"{row.get('error')}")
    print(f"\nstored {path}")
    return 0


def _summarise(per_round: dict, checks: dict) -> list[dict]:
    """One row per (implementation, shape, pass): the median of the rounds so far, their range."""
    out = []
    for (name, shape, _), rows in per_round.items():
        good = [x for x in rows if x.get("tflops")]
        row = dict(rows[0])
        row.pop("error", None)
        if good:
            tf = [x["tflops"] for x in good]
            ms = [x["ms"] for x in good]
            row.update(tflops=statistics.median(tf), ms=statistics.median(ms),
                       tflops_min=min(tf), tflops_max=max(tf), tflops_rounds=tf,
                       rounds=len(good))
        else:
            row.update(tflops=None, ms=None, error=rows[0].get("error", "failed"))
        if (name, shape) in checks:
            row["max_rel_diff_vs_sdpa_flash"] = checks[(name, shape)]
        out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
