"""Benchmark varlen attention, forward and backward: one kernel launch (per kernel) against the
per-sequence loop and FA4.

    python -m measure.package_varlen                # 32 sequences, 64..8192, ~64k tokens
    python -m measure.package_varlen --rounds 5 --causal yes --passes fwd,bwd

Rows (all on the same packed inputs, every pass and implementation in the same rounds):
  fa4_final_varlen          fa4_final.flash_attn_varlen_func, the varlen kernels, with the
                            offsets' value checks off (FA4_FINAL_VARLEN_CHECKS=0): nothing
                            waits for the GPU, as in FA4's own call
  fa4_final_varlen_checked  the same call with the value checks on (the default): one copy of
                            the offsets to the host, i.e. one device synchronisation per call
                            (per forward and per backward)
  fa4_final_varlen_zigzag   the forward alone, the varlen kernel in fixed zigzag rounds, longest
                            first over all of a sequence's heads, in place of tiles taken at run
                            time (fa4_final.common.schedule, Note [Varlen order]); checks off
  fa4_final_loop            fa4_final.runtime.varlen.forward_loop / backward_loop: the dense kernels
                            once per sequence, one launch per sequence
  fa4_package               flash_attn.cute.flash_attn_varlen_func (the FA4 package), when
                            installed
Passes (``--passes``, the column ``pass``): ``fwd`` the forward; ``bwd`` the backward alone
(torch.autograd.grad of out with dout, on a graph recorded once and kept: for the loop its
backward_loop on the same out and lse); ``fwd+bwd`` both, as a training step runs them.

Lengths: ``--batch`` sequences drawn log-uniformly from [--min, --max], scaled to about
``--tokens`` in total (seeded: every run times the same list, stored with each row). q and k
have the same lengths (self-attention). A row's ``s`` is the *mean* length (``s_max`` the
longest, ``lengths`` all of them); its FLOPs are counted per sequence, sum_i 4 h L_i^2 D (halved
when causal; x 2.5 for the backward, x 3.5 for both: utils.bench.attention_flops), so TFLOP/s
are comparable with the dense tables only for the same work, not the same ``s``.
Timing: utils.bench.interleaved (every row once per round, ``--rounds`` rounds, the L2 flushed
before every call; medians and spread stored). Before timing, the varlen kernel's output (and
its dq, dk, dv) are compared with the loop's and the FA4 package's (max |difference|, stored with
their rows; a backward row's is the largest over dq, dk, dv).

Writes results/<gpu>/package_varlen.json (utils.results.save, with provenance).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys

import torch

from utils import bench, results

PRODUCES = [
    ("results/h200/package_varlen.json", "python -m measure.package_varlen",
     "a packed batch of 32 sequences of mixed lengths: the varlen kernels with and without the "
     "offsets' host check, in fixed zigzag rounds, the per-sequence loop and the FA4 package; "
     "forward, backward and both"),
]

IMPLS = ("fa4_final_varlen", "fa4_final_varlen_checked", "fa4_final_varlen_zigzag",
         "fa4_final_loop", "fa4_package")
FORWARD_ONLY = ("fa4_final_varlen_zigzag",)  # rows of the pass "fwd" only
PASSES = ("fwd", "bwd", "fwd+bwd")


def draw_lengths(batch: int, lo: int, hi: int, tokens: int, seed: int = 0) -> list[int]:
    """``batch`` lengths log-uniform in [lo, hi] (as many sequences of 64-128 as of
    4096-8192), scaled so they sum to about ``tokens`` (each still inside [lo, hi])."""
    rng = random.Random(seed)
    raw = [math.exp(rng.uniform(math.log(lo), math.log(hi))) for _ in range(batch)]
    scale = tokens / sum(raw)
    return [min(hi, max(lo, round(x * scale))) for x in raw]


def varlen_flops(lengths: list[int], heads: int, dim: int, causal: bool,
                 pass_: str = "fwd") -> float:
    """FLOPs of ``pass_`` ("fwd", "bwd", "fwd+bwd"), counted per sequence (q and k of the same
    length)."""
    return sum(bench.attention_flops(1, heads, n, n, dim, causal, pass_) for n in lengths)


def _inputs(lengths, heads, dim, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, generator=g, device="cuda").to(dtype)
               for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    return q, k, v, cu


class _Checks:
    """FA4_FINAL_VARLEN_CHECKS set for the ``with`` block (runtime.varlen), then restored."""

    def __init__(self, on: bool):
        self.value = "1" if on else "0"

    def __enter__(self):
        self.before = os.environ.get("FA4_FINAL_VARLEN_CHECKS")
        os.environ["FA4_FINAL_VARLEN_CHECKS"] = self.value

    def __exit__(self, *exc):
        if self.before is None:
            os.environ.pop("FA4_FINAL_VARLEN_CHECKS")
        else:
            os.environ["FA4_FINAL_VARLEN_CHECKS"] = self.before


def _zigzag_runner(q, k, v, cu, longest):
    """f(causal) -> out: the varlen forward in fixed zigzag rounds instead of tiles taken at run
    time (schedule "zigzag", Note [Varlen order]), checks off."""
    from dataclasses import replace

    from fa4_final.hopper.config import hopper_fwd_default
    from fa4_final.runtime import varlen

    def run(causal):
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        config = replace(hopper_fwd_default(q.shape[-1], causal, varlen=True),
                         schedule="zigzag", l2_sections=False)
        with _Checks(False):
            varlen.varlen_forward_into(q.detach(), k.detach(), v.detach(), cu, cu, None,
                                       longest, longest, out, lse, causal=causal,
                                       config=config)
        return out

    return run


def _runners(q, k, v, cu, longest):
    """impl -> f(causal) returning out (differentiable in q, k, v where they require grad)."""
    import fa4_final
    from fa4_final.runtime import varlen

    def ours(checked: bool):
        def run(causal):
            with _Checks(checked):
                return fa4_final.flash_attn_varlen_func(
                    q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                    max_seqlen_k=longest, causal=causal)[0]

        return run

    runners = {
        "fa4_final_varlen": ours(False),
        "fa4_final_varlen_checked": ours(True),
        "fa4_final_loop": lambda causal: varlen.forward_loop(
            q.detach(), k.detach(), v.detach(), cu, cu, causal=causal)[0],
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


def _grad_runners(runners, q, k, v, cu, dout):
    """{(impl, pass): f(causal)} for the passes "bwd" (on a graph recorded once per impl and
    causal, kept with retain_graph) and "fwd+bwd"; each returns (dq, dk, dv)."""
    from fa4_final.runtime import varlen

    graphs = {}  # (impl, causal) -> out of one forward, its graph kept

    def backward(name):
        def run(causal):
            if (name, causal) not in graphs:
                graphs[(name, causal)] = runners[name](causal)
            with _Checks(name == "fa4_final_varlen_checked"):
                return torch.autograd.grad(graphs[(name, causal)], (q, k, v), dout,
                                           retain_graph=True)

        return run

    def both(name):
        def run(causal):
            with _Checks(name == "fa4_final_varlen_checked"):
                return torch.autograd.grad(runners[name](causal), (q, k, v), dout)

        return run

    def loop_backward(causal, fwd=None):
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        if fwd is None:
            if causal not in graphs:
                graphs[causal] = varlen.forward_loop(qd, kd, vd, cu, cu, causal=causal)
            fwd = graphs[causal]
        return varlen.backward_loop(qd, kd, vd, *fwd, dout, cu, cu, causal=causal)

    def loop_both(causal):
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        return loop_backward(causal, varlen.forward_loop(qd, kd, vd, cu, cu, causal=causal))

    fns = {}
    for name in runners:
        if name == "fa4_final_loop":
            fns[(name, "bwd")], fns[(name, "fwd+bwd")] = loop_backward, loop_both
        else:
            fns[(name, "bwd")], fns[(name, "fwd+bwd")] = backward(name), both(name)
    return fns


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
    ap.add_argument("--passes", default=",".join(PASSES),
                    help=f"comma-separated, of {', '.join(PASSES)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="package_varlen")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("package_varlen: needs a CUDA GPU", file=sys.stderr)
        return 2
    passes = [p for p in args.passes.split(",") if p]
    if not passes or any(p not in PASSES for p in passes):
        ap.error(f"--passes takes some of {', '.join(PASSES)}, got {args.passes!r}")
    lengths = draw_lengths(args.batch, args.min, args.max, args.tokens, args.seed)
    longest = max(lengths)
    dtype = torch.bfloat16
    q, k, v, cu = _inputs(lengths, args.heads, args.dim, dtype)
    grads_needed = any(p != "fwd" for p in passes)
    for t in (q, k, v):
        t.requires_grad_(grads_needed)
    dout = torch.randn(q.shape, device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(args.seed + 1)).to(dtype)
    runners = _runners(q, k, v, cu, longest)
    # the forward rows record no graph
    by_pass = {("fwd", name): _without_grad(fn) for name, fn in runners.items()}
    by_pass[("fwd", "fa4_final_varlen_zigzag")] = _zigzag_runner(q, k, v, cu, longest)
    if grads_needed:
        by_pass |= {(p, name): fn for (name, p), fn in
                    _grad_runners(runners, q, k, v, cu, dout).items()}
    by_pass = {key: fn for key, fn in by_pass.items() if key[0] in passes}
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens, lengths {min(lengths)}.."
          f"{longest} (mean {sum(lengths) / len(lengths):.0f}), h={args.heads}, D={args.dim}",
          flush=True)

    diffs = {}  # (pass, impl, causal) -> max |result - varlen kernel's|, before any timing
    for causal in causals:
        for pass_ in passes:
            grad_pass = "bwd" if pass_ != "fwd" else "fwd"
            try:
                mine = _as_list(by_pass[(grad_pass, "fa4_final_varlen")](causal))
            except Exception as exc:  # recorded again by the timing rounds
                print(f"{pass_} causal={causal}: fa4_final_varlen failed: "
                      f"{bench.error_text(exc)}", flush=True)
                continue
            for name in ("fa4_final_varlen_zigzag", "fa4_final_loop", "fa4_package"):
                if (grad_pass, name) not in by_pass:
                    continue
                try:
                    other = _as_list(by_pass[(grad_pass, name)](causal))
                except Exception as exc:  # the timing rounds record it as the row's error
                    print(f"{pass_} causal={causal}: {name} failed: {bench.error_text(exc)}",
                          flush=True)
                    continue
                diffs[(pass_, name, causal)] = max(
                    (a.float() - b.float()).abs().max().item() for a, b in zip(mine, other))
                print(f"{pass_} causal={causal}: max |varlen kernel - {name}| = "
                      f"{diffs[(pass_, name, causal)]:.3e}", flush=True)
            diffs[(pass_, "fa4_final_varlen", causal)] = 0.0

    fns = {(pass_, name, causal): (lambda f=fn, c=causal: f(c))
           for causal in causals for (pass_, name), fn in by_pass.items()}
    measured = bench.interleaved(fns, rounds=args.rounds, rep=args.rep,
                                 progress=lambda line: print(line, flush=True))
    rows = []
    for pass_ in passes:
        for causal in causals:
            flops = varlen_flops(lengths, args.heads, args.dim, causal, pass_)
            for name in IMPLS:
                if name in FORWARD_ONLY and pass_ != "fwd":
                    continue
                key = (pass_, name, causal)
                row = dict(impl=name, **{"pass": pass_}, dtype=bench.DTYPE_NAMES[dtype],
                           b=len(lengths), s=round(sum(lengths) / len(lengths)), h=args.heads,
                           d=args.dim, causal=causal, s_is="mean sequence length",
                           s_max=longest, total_tokens=sum(lengths), lengths=lengths,
                           flops=flops)
                if key in measured:
                    row.update(measured[key].fields(flops))
                else:
                    row.update(ms=None, tflops=None, error="not installed")
                if key in diffs:
                    row["max_abs_diff_vs_fa4_final_varlen"] = diffs[key]
                rows.append(row)
    command = "python -m measure.package_varlen " + " ".join(
        argv if argv is not None else sys.argv[1:])
    path = results.save(args.name, rows, command=command)
    print("\nvarlen attention, median of rounds:")
    for pass_ in passes:
        for causal in causals:
            case = [r for r in rows if r["pass"] == pass_ and r["causal"] == causal]
            ref = next((r for r in case if r["impl"] == "fa4_package" and r.get("ms")), None)
            for row in case:
                if not row.get("ms"):
                    print(f"  {pass_:<8} {row['impl']:<26} causal={causal!s:<5} "
                          f"{row.get('error')}")
                    continue
                vs = f"  {ref['ms'] / row['ms']:.2f}x fa4_package" if ref else ""
                print(f"  {pass_:<8} {row['impl']:<26} causal={causal!s:<5} {row['ms']:8.3f} ms"
                      f" {row['tflops']:6.0f} TFLOP/s (spread {100 * row['spread']:.1f} %){vs}")
    print(f"\nstored {path}")
    return 0


def _without_grad(fn):
    def run(causal):
        with torch.no_grad():
            return fn(causal)

    return run


def _as_list(result):
    """A runner's result as a list of tensors: out, or (dq, dk, dv)."""
    return list(result) if isinstance(result, (tuple, list)) else [result]


if __name__ == "__main__":
    sys.exit(main())
