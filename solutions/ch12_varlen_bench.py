"""Benchmark the varlen forward: one kernel launch against the per-sequence loop and FA4.

    python -m solutions.ch12_varlen_bench                # 32 sequences, 64..8192, ~64k tokens
    python -m solutions.ch12_varlen_bench --rounds 5 --causal yes

Rows (all on the same packed inputs, in the same rounds):
  fa4_final_varlen          fa4_final.flash_attn_varlen_func, the varlen kernel, with the
                            offsets' value checks off (FA4_FINAL_VARLEN_CHECKS=0): nothing
                            waits for the GPU, as in FA4's own call
  fa4_final_varlen_checked  the same call with the value checks on (the default): one copy of
                            the offsets to the host, i.e. one device synchronisation per call
  fa4_final_loop            fa4_final.varlen.forward_loop: the dense kernel once per sequence,
                            what flash_attn_varlen_func ran before the varlen kernel
  fa4_package               flash_attn.cute.flash_attn_varlen_func (the FA4 package), when
                            installed

Lengths: ``--batch`` sequences drawn log-uniformly from [--min, --max], scaled to about
``--tokens`` in total (seeded: every run times the same list, stored with each row). q and k
have the same lengths (self-attention). A row's ``s`` is the *mean* length (``s_max`` the
longest, ``lengths`` all of them); its FLOPs are counted per sequence, sum_i 4 h L_i^2 D (halved
when causal), so TFLOP/s are comparable with the dense tables only for the same work, not the
same ``s``.
Timing: utils.bench.interleaved (every row once per round, ``--rounds`` rounds, the L2 flushed
before every call; medians and spread stored). Before timing, the varlen kernel's output is
compared with the loop's and the FA4 package's (max |difference|, stored with its rows).

Writes results/<gpu>/ch12_varlen.json (utils.results.save, with provenance).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys

import torch

from utils import bench, results

IMPLS = ("fa4_final_varlen", "fa4_final_varlen_checked", "fa4_final_loop", "fa4_package")


def draw_lengths(batch: int, lo: int, hi: int, tokens: int, seed: int = 0) -> list[int]:
    """``batch`` lengths log-uniform in [lo, hi] (as many sequences of 64-128 as of
    4096-8192), scaled so they sum to about ``tokens`` (each still inside [lo, hi])."""
    rng = random.Random(seed)
    raw = [math.exp(rng.uniform(math.log(lo), math.log(hi))) for _ in range(batch)]
    scale = tokens / sum(raw)
    return [min(hi, max(lo, round(x * scale))) for x in raw]


def varlen_flops(lengths: list[int], heads: int, dim: int, causal: bool) -> float:
    """The forward's FLOPs, counted per sequence (q and k of the same length)."""
    return sum(bench.attention_flops(1, heads, n, n, dim, causal) for n in lengths)


def _inputs(lengths, heads, dim, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, generator=g, device="cuda").to(dtype)
               for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    return q, k, v, cu


def _runners(q, k, v, cu, longest):
    """impl -> f(causal) returning out."""
    import fa4_final
    from fa4_final import varlen

    def ours(checked: bool):
        def run(causal):
            before = os.environ.get("FA4_FINAL_VARLEN_CHECKS")
            os.environ["FA4_FINAL_VARLEN_CHECKS"] = "1" if checked else "0"
            try:
                return fa4_final.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                                        causal=causal)[0]
            finally:
                if before is None:
                    os.environ.pop("FA4_FINAL_VARLEN_CHECKS")
                else:
                    os.environ["FA4_FINAL_VARLEN_CHECKS"] = before

        return run

    runners = {
        "fa4_final_varlen": ours(False),
        "fa4_final_varlen_checked": ours(True),
        "fa4_final_loop": lambda causal: varlen.forward_loop(q, k, v, cu, cu, causal=causal)[0],
    }
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
    except Exception as exc:  # recorded as the row's error
        print(f"fa4_package: not importable ({type(exc).__name__}: {exc})", flush=True)
    else:
        def fa4(causal):
            out = fa4_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,  # 4th: qv
                             max_seqlen_q=longest, max_seqlen_k=longest, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        runners["fa4_package"] = fa4
    return runners


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--min", type=int, default=64)
    ap.add_argument("--max", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="ch12_varlen")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ch12_varlen_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    lengths = draw_lengths(args.batch, args.min, args.max, args.tokens, args.seed)
    longest = max(lengths)
    dtype = torch.bfloat16
    q, k, v, cu = _inputs(lengths, args.heads, args.dim, dtype)
    runners = _runners(q, k, v, cu, longest)
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens, lengths {min(lengths)}.."
          f"{longest} (mean {sum(lengths) / len(lengths):.0f}), h={args.heads}, D={args.dim}",
          flush=True)

    diffs = {}  # (impl, causal) -> max |out - varlen kernel's out|, before any timing
    for causal in causals:
        mine = runners["fa4_final_varlen"](causal)
        for name in ("fa4_final_loop", "fa4_package"):
            if name in runners:
                other = runners[name](causal)
                diffs[(name, causal)] = (mine.float() - other.float()).abs().max().item()
                print(f"causal={causal}: max |varlen kernel - {name}| = "
                      f"{diffs[(name, causal)]:.3e}", flush=True)
        diffs[("fa4_final_varlen", causal)] = 0.0

    fns = {(name, causal): (lambda f=fn, c=causal: f(c))
           for causal in causals for name, fn in runners.items()}
    measured = bench.interleaved(fns, rounds=args.rounds, rep=args.rep,
                                 progress=lambda line: print(line, flush=True))
    rows = []
    for causal in causals:
        flops = varlen_flops(lengths, args.heads, args.dim, causal)
        for name in IMPLS:
            row = dict(impl=name, **{"pass": "fwd"}, dtype=bench.DTYPE_NAMES[dtype],
                       b=len(lengths), s=round(sum(lengths) / len(lengths)), h=args.heads,
                       d=args.dim, causal=causal, s_is="mean sequence length", s_max=longest,
                       total_tokens=sum(lengths), lengths=lengths, flops=flops)
            if (name, causal) in measured:
                row.update(measured[(name, causal)].fields(flops))
            else:
                row.update(ms=None, tflops=None, error="not installed")
            if (name, causal) in diffs:
                row["max_abs_diff_vs_fa4_final_varlen"] = diffs[(name, causal)]
            rows.append(row)
    command = "python -m solutions.ch12_varlen_bench " + " ".join(
        argv if argv is not None else sys.argv[1:])
    path = results.save(args.name, rows, command=command)
    print("\nvarlen forward, median of rounds:")
    for causal in causals:
        ref = next((r for r in rows if r["impl"] == "fa4_package" and r["causal"] == causal
                    and r.get("ms")), None)
        for row in (r for r in rows if r["causal"] == causal):
            if not row.get("ms"):
                print(f"  {row['impl']:<26} causal={causal!s:<5} {row.get('error')}")
                continue
            vs = f"  {ref['ms'] / row['ms']:.2f}x fa4_package" if ref else ""
            print(f"  {row['impl']:<26} causal={causal!s:<5} {row['ms']:8.3f} ms "
                  f"{row['tflops']:6.0f} TFLOP/s (spread {100 * row['spread']:.1f} %){vs}")
    print(f"\nstored {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
