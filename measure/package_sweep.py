"""The package through its public API beside its peers: the full sweep, accuracy against
float64, memory. Chapter 13 reads the headline shapes and the accuracy; the lab
labs/package_sweeps_and_host_cost.ipynb reads all of it.

    python -m measure.package_sweep --sweep       # fwd, bwd, fwd+bwd; D 64, 128; S 512..32768
    python -m measure.package_sweep --accuracy    # max error against float64, every impl
    python -m measure.package_sweep --memory      # peak memory of a training step's attention

Every implementation goes through its public entry point with autograd: fa4_final's
``flash_attn_func``, SDPA's flash and cuDNN backends, the FA4 package's ``flash_attn_func``
when installed (utils.bench.peers). The sweep keeps the course's shape (batch x seqlen = 16384
tokens, 16 heads; at S = 32768 one sequence) and times every implementation once per shape per
round, interleaved (utils.bench.benchmark_attention), for ``--rounds`` rounds.

Writes results/<gpu>/package_sweep.json, package_accuracy.json and package_memory.json
(utils.results.save, with provenance).
"""

from __future__ import annotations

import argparse
import sys

import torch

from utils import bench, results
from utils.reference import attention_reference

PRODUCES = [
    ("results/h200/package_sweep.json",
     "python -m measure.package_sweep --sweep --dims 64 128 --seqlens 512 1024 2048 4096 8192 "
     "16384 32768 --passes fwd bwd fwd+bwd --rounds 3 --rep 10",
     "fa4_final's public API (autograd) beside SDPA flash, cuDNN and the FA4 package: forward, "
     "backward and both, D = 64 and 128, S = 512 to 32768, causal or not, in interleaved rounds"),
    ("results/h200/package_accuracy.json", "python -m measure.package_sweep --accuracy",
     "out, dq, dk, dv of every implementation against float64 autograd on awkward shapes"),
    ("results/h200/package_memory.json", "python -m measure.package_sweep --memory",
     "peak memory of one forward + backward beyond the inputs and their gradients"),
]

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
PASSES = ("fwd", "bwd", "fwd+bwd")


def fa4_final_autograd(q, k, v, causal=False, softmax_scale=None):
    """fa4_final's drop-in API in the course's common signature: (out, lse), differentiable."""
    from fa4_final import flash_attn_func

    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True)


def implementations() -> dict:
    impls = {"fa4_final": fa4_final_autograd, **bench.peers()}
    impls.pop("sdpa_efficient", None)  # far behind the rest: chapters 01-02 compare it
    return impls


def sweep(args) -> list[dict]:
    shapes = [bench.Shape.standard(s, d, c) for d in args.dims for s in args.seqlens
              for c in (False, True)]
    rows = bench.benchmark_attention(implementations(), shapes, passes=tuple(args.passes),
                                     rep=args.rep, rounds=args.rounds)
    results.save("package_sweep", rows, command="python -m measure.package_sweep --sweep " +
                 " ".join(f"--{k} {' '.join(map(str, v))}" for k, v in
                          (("dims", args.dims), ("seqlens", args.seqlens),
                           ("passes", args.passes), ("rounds", [args.rounds]),
                           ("rep", [args.rep]))))
    for pass_ in args.passes:
        print(f"\n{pass_}:")
        print(bench.ratio_table(rows, "fa4_final", pass_))
    return rows


# Awkward on purpose: odd lengths, sq != sk, GQA; each once causal and once not.
ACCURACY_CASES = ((1, 1000, 1000, 8, 8, 128), (2, 333, 901, 8, 2, 64), (1, 2048, 2048, 16, 1, 128))


def _errors(fn, q, k, v, dout, causal, ref) -> list[dict]:
    """One row per tensor (out, dq, dk, dv): its largest error against float64."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves, causal=causal)[0]
    grads = torch.autograd.grad(out, leaves, dout)
    rows = []
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
        err = (got.double() - want).abs().max()
        rows.append({"tensor": name, "metric": "max_abs_err", "value": err.item(), "unit": "",
                     "rel_err": (err / want.abs().max()).item(),
                     "finite": bool(torch.isfinite(got).all())})
    return rows


def accuracy() -> list[dict]:
    """Each implementation's largest error against float64 autograd, on the same inputs."""
    impls = implementations()
    rows = []
    for b, sq, sk, h, hk, d in ACCURACY_CASES:
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk)
            q, k, v = (torch.randn(b, s, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
                       for s, n in ((sq, h), (sk, hk), (sk, hk)))
            dout = torch.randn(b, sq, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
            leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
            ref_out = attention_reference(*leaves, causal=causal)[0]
            ref = (ref_out.detach(), *torch.autograd.grad(ref_out, leaves, dout.double()))
            for name, fn in impls.items():
                case = {"impl": name, "dtype": "bf16", "b": b, "sq": sq, "sk": sk, "h": h,
                        "h_kv": hk, "d": d, "causal": causal}
                refused = {"metric": "max_abs_err", "value": None, "unit": ""}
                if causal and sq != sk and name.startswith("sdpa"):
                    rows.append({**case, **refused, "error": (
                        "not compared: SDPA's is_causal aligns the mask top-left when "
                        "sq != sk; the others align it bottom-right")})
                    continue
                try:
                    found = [{**case, **r} for r in _errors(fn, q, k, v, dout, causal, ref)]
                except Exception as exc:  # a peer that refuses a shape (GQA, sq != sk)
                    found = [{**case, **refused, "error": bench.error_text(exc)}]
                rows += found
                for r in found:
                    print(f"{name:12s} b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} "
                          f"{r.get('tensor', '-')}: {r.get('value')} {r.get('error', '')}",
                          flush=True)
    results.save("package_accuracy", rows,
                 command="python -m measure.package_sweep --accuracy")
    return rows


def memory(seqlens=(4096, 16384, 32768), d=128) -> list[dict]:
    """Peak memory allocated by one forward + backward of each implementation, beyond q, k, v,
    dout and the gradients themselves (which every implementation needs)."""
    impls = implementations()
    rows = []
    for s in seqlens:
        shape = bench.Shape.standard(s, d, causal=True)
        q, k, v = bench._inputs(shape, torch.bfloat16, requires_grad=True)
        dout = torch.randn_like(q)
        floor = 2 * sum(t.numel() * t.element_size() for t in (q, k, v))  # inputs + gradients
        for name, fn in impls.items():
            row = {"impl": name, "dtype": "bf16", "b": shape.b, "s": s, "h": shape.h, "d": d,
                   "causal": True, "inputs_and_grads_bytes": floor,
                   "metric": "peak_extra_bytes", "value": None, "unit": "bytes"}
            try:
                torch.autograd.grad(fn(q, k, v, causal=True)[0], (q, k, v), dout)  # compile
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                grads = torch.autograd.grad(fn(q, k, v, causal=True)[0], (q, k, v), dout)
                torch.cuda.synchronize()
                row["value"] = torch.cuda.max_memory_allocated() - base - sum(
                    g.numel() * g.element_size() for g in grads)
                del grads
            except Exception as exc:
                row["error"] = bench.error_text(exc)
            rows.append(row)
            print(row, flush=True)
        del q, k, v, dout
        torch.cuda.empty_cache()
    results.save("package_memory", rows, command="python -m measure.package_sweep --memory")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--seqlens", nargs="+", type=int, default=list(SEQLENS))
    ap.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    ap.add_argument("--rounds", type=int, default=bench.MIN_ROUNDS)
    ap.add_argument("--rep", type=int, default=10)
    args = ap.parse_args(argv)
    if not (args.sweep or args.accuracy or args.memory):
        ap.error("say what to measure: --sweep, --accuracy and/or --memory")
    if args.rounds < bench.MIN_ROUNDS:
        ap.error(f"--rounds: at least {bench.MIN_ROUNDS}")
    if not torch.cuda.is_available():
        print("package_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.accuracy:
        accuracy()
    if args.memory:
        memory()
    if args.sweep:
        sweep(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
