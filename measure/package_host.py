"""What one call of fa4_final's PyTorch API costs the host (the CPU), apart from the kernels.

    python -m measure.package_host --profile [--label after]   # any machine: kernels are no-ops
    python -m measure.package_host --gpu                       # a GPU: wall time vs kernel time

``--profile`` replaces the kernels by functions that do nothing (the compiled launches, the GPU
lookup, the SM count) and runs the API on tiny CPU tensors: what is left is the Python and
PyTorch work of a call (checks, dispatch, autograd, allocations). It prints host microseconds
per forward and per forward + backward, the time split by where it goes (from cProfile, scaled
to the measured time), and how often the checks and launches run per call. Rows are stored in
results/cpu/package_host.json under ``--label`` (rows of other labels are kept, so two versions
of the package measured on the same CPU sit side by side); ``--fa4-commit`` names the fa4_final
tree measured when it is not the one of this checkout (PYTHONPATH pointing at another copy).

``--gpu`` times, at short sequences where the kernels are short, each implementation's
forward and forward + backward through its public API: host time per call (issuing the calls,
no wait), wall time per call (back-to-back calls, the GPU's clock) and kernel time per call
(the sum of the kernels' durations, torch.profiler). Wall above kernel time is the GPU waiting
for the host. fa4_final, SDPA's flash and cuDNN backends and the FA4 package when installed, in
one run. Also the cost of one TVM-FFI launch of the compiled forward with its arguments ready.
Writes results/<gpu>/package_host.json.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time

import torch

from utils import bench, results

PRODUCES = [
    ("results/cpu/package_host.json", "python -m measure.package_host --profile --label after",
     "host microseconds per API call with every kernel a no-op, the checks and launches per "
     "call, the time split by where it goes; one variant per fa4_final tree measured on that "
     "CPU (--label, --fa4-commit)"),
    ("results/h200/package_host.json",
     "python -m measure.package_host --gpu --seqlens 256 512 1024 --dims 64 128 --tokens 16384 "
     "--calls 40 --rounds 5",
     "host, wall and kernel microseconds per call at short sequences, every implementation "
     "through its public API; one TVM-FFI launch and one allocation"),
]

SETUP_CPU = ("this CPU, no GPU: tiny CPU tensors (b=1, s=16, h=2, d=64, bf16), every kernel "
             "launch and the GPU lookups replaced by no-ops")


# ----------------------------------------------------------------------------------------------
# --profile: the host path with no kernels


class _Noop:
    """A stand-in for a compiled kernel: counts its calls, does nothing."""

    calls = 0

    def __call__(self, *args, **kwargs):
        _Noop.calls += 1


@contextlib.contextmanager
def noop_kernels():
    """Every GPU-only step of fa4_final replaced by a no-op, for CPU tensors: the dispatch to
    the Hopper row, every compiled kernel (the compile path's cache lookup answers with a
    no-op), the SM count. Restores all."""
    from fa4_final.api import interface, ops
    from fa4_final.hopper import host
    from fa4_final.runtime import checks, dispatch, prologue
    from fa4_final.runtime import compile as compile_path

    hopper = next(b for b in dispatch.BACKENDS if b.family == "Hopper")
    noop = _Noop()
    patches = [(dispatch, "backend_for", lambda device: hopper),
               (prologue, "backend_for", lambda device: hopper),
               (compile_path, "cached", lambda key, build: noop),
               (host, "num_sms", lambda device: 132)]
    if hasattr(ops, "EAGER_DEVICE_TYPES"):  # the eager path (ops.eager) for CPU tensors too
        patches.append((ops, "EAGER_DEVICE_TYPES", (*ops.EAGER_DEVICE_TYPES, "cpu")))
    counted = {"check_inputs": 0}
    for module in (checks, prologue, interface, ops):
        if hasattr(module, "check_inputs"):
            original = module.check_inputs

            def counting(*a, _original=original, **k):
                counted["check_inputs"] += 1
                return _original(*a, **k)

            patches.append((module, "check_inputs", counting))
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    caches = _host_caches()
    for m, name, value in patches:
        setattr(m, name, value)
    for c in caches:
        c.clear()
    try:
        yield counted
    finally:
        for m, name, value in saved:
            setattr(m, name, value)
        for c in caches:
            c.clear()


def _host_caches() -> list[dict]:
    """The per-call caches of fa4_final's host path: cleared around a profile, so none keeps a
    no-op kernel or a real one across it."""
    from fa4_final.api import interface
    from fa4_final.common import backward
    from fa4_final.hopper import host
    from fa4_final.runtime import compile as compile_path
    from fa4_final.runtime import prologue

    found = []
    for module in (compile_path, prologue, host, backward, interface):
        for name in ("_PLANS", "_BACKENDS", "_TURN_DUMMIES", "_SMS", "_REPEATED"):
            c = getattr(module, name, None)
            if isinstance(c, dict):
                found.append(c)
    return found


def _tiny(grad: bool):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 64, generator=g).to(torch.bfloat16).requires_grad_(grad)
               for _ in range(3))
    return q, k, v, torch.randn(1, 16, 2, 64, generator=g).to(torch.bfloat16)


def _calls() -> dict:
    """The measured calls: zero-argument functions, one API call each."""
    from fa4_final import flash_attn_func

    q, k, v, dout = _tiny(grad=True)
    qn, kn, vn = q.detach(), k.detach(), v.detach()

    def fwd():
        flash_attn_func(qn, kn, vn)

    def fwd_grad():
        flash_attn_func(q, k, v)

    def fwd_bwd():
        out, _ = flash_attn_func(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    return {"fwd": fwd, "fwd (inputs need grad)": fwd_grad, "fwd+bwd": fwd_bwd,
            "floor fwd+bwd": _floor_call(q, k, v, dout)}


def _floor_call(q, k, v, dout):
    """The least a differentiable Python op can cost: a torch.autograd.Function that only
    allocates its outputs and gradients (what any attention op allocates), fwd and bwd."""

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]),
                                                     dtype=torch.float32)

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v = ctx.saved_tensors
            return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def run():
        out, _ = Floor.apply(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    return run


def time_host(fn, n: int = 200, repeats: int = 15, warmup: int = 30) -> dict:
    """Microseconds per call over ``repeats`` batches of ``n`` calls: ``value`` is the fastest
    batch's (as timeit advises: on a shared CPU other processes only ever add time, so the
    fastest batch is the closest to the work itself), with the median and the slowest."""
    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per_call.append((time.perf_counter() - t0) / n * 1e6)
    return {"value": min(per_call), "median": statistics.median(per_call), "min": min(per_call),
            "max": max(per_call), "repeats": repeats, "calls_per_repeat": n}


# Where the host's time goes, by the file (or builtin) that spends it (cProfile's own time).
CATEGORIES = (
    ("checks (fa4_final.runtime.checks)", ("fa4_final/runtime/checks.py",)),
    ("fa4_final API and ops (interface, ops)", ("fa4_final/api/",)),
    ("fa4_final launch layers (runtime, hopper.host)",
     ("fa4_final/runtime/prologue.py", "fa4_final/runtime/varlen.py",
      "fa4_final/runtime/dispatch.py", "fa4_final/runtime/compile.py", "fa4_final/hopper/",
      "fa4_final/common/")),
    ("torch custom-op dispatch (torch._library, torch._ops, dynamo guards)",
     ("torch/_library/", "torch/_ops.py", "torch/_compile.py", "torch/_dynamo/",
      "torch/_C/_dynamo", "torch/utils/_python_dispatch.py", "torch/_subclasses")),
    ("autograd (torch.autograd, the engine)", ("torch/autograd/", "run_backward",
                                                "_engine_run_backward")),
    ("tensor methods (allocations, views, requires_grad)", ("method '", "built-in method")),
)


def _category(func: tuple) -> str:
    filename, _, name = func
    where = f"{filename} {name}"
    for label, needles in CATEGORIES:
        if any(n in where for n in needles):
            return label
    return "other Python (this tool's loop, torch helpers)"


def breakdown(fn, us_per_call: float, n: int = 200) -> dict[str, float]:
    """Microseconds per call by category: cProfile's own-time shares, scaled to the measured
    (unprofiled) time of a call."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    shares: dict[str, float] = {}
    for func, (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        shares[_category(func)] = shares.get(_category(func), 0.0) + tottime
    total = sum(shares.values()) or 1.0
    return {k: us_per_call * v / total for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}


def counts_per_call(counted: dict, fn, n: int = 50) -> dict[str, float]:
    before_checks, before_launch = counted["check_inputs"], _Noop.calls
    for _ in range(n):
        fn()
    return {"check_inputs": (counted["check_inputs"] - before_checks) / n,
            "kernel launches": (_Noop.calls - before_launch) / n}


def profile(label: str, fa4_commit: str | None, n: int, repeats: int,
            save: bool = True) -> list[dict]:
    import fa4_final

    rows = []
    common = {"impl": "fa4_final", "variant": label,
              "fa4_final_commit": fa4_commit or results._git_commit(),
              "fa4_final_path": str(fa4_final.__file__), "setup": SETUP_CPU}
    with noop_kernels() as counted:
        calls = _calls()
        for name, fn in calls.items():
            t = time_host(fn, n=n, repeats=repeats)
            impl = "floor" if name.startswith("floor") else "fa4_final"
            pass_ = name.removeprefix("floor ")
            rows.append({**common, "impl": impl, "metric": f"host_us {pass_}", "unit": "us", **t})
            print(f"{impl:9s} {pass_:24s} {t['value']:7.1f} us per call (the fastest of "
                  f"{repeats} x {n} calls; median {t['median']:.1f}, slowest {t['max']:.1f})")
        for name in ("fwd", "fwd+bwd"):
            for what, c in counts_per_call(counted, calls[name]).items():
                rows.append({**common, "metric": f"{what} per call {name}", "value": c,
                             "unit": "calls"})
            us = next(r["value"] for r in rows if r["metric"] == f"host_us {name}"
                      and r["impl"] == "fa4_final")
            print(f"\nwhere a {name} call's {us:.0f} us go (cProfile own time, scaled):")
            for cat, part in breakdown(calls[name], us, n=n).items():
                rows.append({**common, "metric": f"host_us {name} by part", "part": cat,
                             "value": part, "unit": "us"})
                print(f"  {part:7.1f} us  {cat}")
        for r in rows:
            if r["metric"].endswith("per call fwd+bwd") or r["metric"].endswith("per call fwd"):
                print(f"{r['metric']}: {r['value']:g}")
    if save:
        _save_merged(rows, label, "python -m measure.package_host --profile --label " + label)
    return rows


def _save_merged(rows: list[dict], label: str, command: str, name: str = "package_host") -> None:
    """Store under results/cpu/<name>.json, keeping the rows of other labels; each row gets
    this CPU and the date, as rows of two runs share the file."""
    kept = []
    old = results.RESULTS_DIR / "cpu" / f"{name}.json"
    if old.exists():
        kept = [r for r in results.load(name, gpu="cpu").rows if r.get("variant") != label]
    from measure.compile_times import host

    rows = [{**r, **host(), "date": results.collect_provenance(command)["date"]} for r in rows]
    path = results.save(name, kept + rows, command=command, gpu="cpu")
    print(f"\nwrote {path}")


# ----------------------------------------------------------------------------------------------
# --gpu: wall time per call against kernel time


def _fa4_final_call(q, k, v, causal=False, softmax_scale=None):
    from fa4_final import flash_attn_func

    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)


def _fa4_final_op_call(q, k, v, causal=False, softmax_scale=None):
    """fa4_final through its custom ops even in eager mode (the path torch.compile and fake
    tensors take, Note [The eager path] in fa4_final/api/ops.py): the cost of the op dispatch."""
    from fa4_final.api import ops

    saved, ops.EAGER_DEVICE_TYPES = ops.EAGER_DEVICE_TYPES, ()
    try:
        return _fa4_final_call(q, k, v, causal, softmax_scale)
    finally:
        ops.EAGER_DEVICE_TYPES = saved


def implementations() -> dict:
    from fa4_final.api import ops

    impls = {"fa4_final": _fa4_final_call}
    if hasattr(ops, "EAGER_DEVICE_TYPES"):
        impls["fa4_final_op"] = _fa4_final_op_call
    impls.update(bench.peers())
    impls.pop("sdpa_efficient", None)
    return impls


def _path_fields() -> dict:
    """Whether fa4_final's calls here take the eager path, and whether torch tensors reach
    TVM-FFI through the DLPack C exchange API (its fast path) rather than per-call capsules."""
    from fa4_final.api import ops

    try:
        import tvm_ffi  # noqa: F401  (installs the exchange API on torch.Tensor when it can)
    except ImportError:
        pass

    q = torch.empty(1, 8, 1, 64, dtype=torch.bfloat16, device="cuda")
    eager = getattr(ops, "eager", None)
    return {"eager_path": None if eager is None else bool(eager(q, q, q)),
            "dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__")}


def _kernel_us(fn, calls: int) -> tuple[float, float]:
    """(sum of GPU kernel and memset/memcpy durations per call in us, GPU ops per call)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    gpu_events = [e for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in gpu_events)
    return busy / calls, len(gpu_events) / calls


def measure_call(fn, calls: int = 40, rounds: int = 5) -> dict:
    """host_us: issuing ``calls`` back-to-back calls (no wait; the GPU's queue is deep enough);
    wall_us: from the first call's start to the last kernel's end, per call (CUDA events);
    kernel_us: the kernels' own durations per call. Medians over ``rounds``."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        end.record()
        torch.cuda.synchronize()
        wall.append(start.elapsed_time(end) * 1e3 / calls)
    h, w = statistics.median(host), statistics.median(wall)
    row = {"host_us": h, "wall_us": w, "host_us_rounds": host, "wall_us_rounds": wall}
    try:
        kernel_us, ops_per_call = _kernel_us(fn, calls)
    except Exception as exc:  # the profiler: keep the timings without it
        return {**row, "kernel_us": None, "kernel_error": bench.error_text(exc)}
    return {**row, "kernel_us": kernel_us, "gpu_ops_per_call": ops_per_call,
            "host_bound": h > kernel_us, "gpu_idle_us": max(0.0, w - kernel_us)}


def tvm_ffi_launch_us(d: int = 128, calls: int = 200) -> list[dict]:
    """Host us of one launch of the compiled forward with every argument ready (what the API
    adds nothing to), and of allocating one output tensor."""
    from fa4_final.common.constants import DTYPE_NAMES
    from fa4_final.hopper import host
    from fa4_final.runtime.compile import compiled as compiled_plan

    shape = bench.Shape.standard(512, d)
    q, k, v = bench._inputs(shape, torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(shape.b, shape.h, shape.s, dtype=torch.float32, device="cuda")
    # the arguments as the API builds them (the split tail's workspace included), once
    plan = compiled_plan(host.forward_recipe, d, DTYPE_NAMES[q.dtype], False, None, False,
                         False, False, False)
    compiled = plan.kernels["main"]
    args = host.forward_args(plan, q, k, v, out, lse, False, d**-0.5, None, None)

    def one():
        compiled(*args)

    def alloc():
        torch.empty(q.shape, dtype=q.dtype, device=q.device)

    rows = []
    for metric, fn in (("tvm_ffi_launch_us", one), ("torch_empty_us", alloc)):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        us = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        rows.append({"impl": "fa4_final", "metric": metric, "value": us, "unit": "us",
                     "d": d, "note": "host time per call, arguments prepared once",
                     **_path_fields()})
        print(f"{metric}: {us:.1f} us")
    return rows


def gpu(seqlens, dims, calls: int, rounds: int, tokens: int) -> list[dict]:
    impls = implementations()
    paths = _path_fields()
    print(f"fa4_final: {paths}")
    rows = []
    for d in dims:
        for s in seqlens:
            for causal in (False, True):
                shape = bench.Shape.standard(s, d, causal, tokens=tokens)
                for pass_ in ("fwd", "fwd+bwd"):
                    flops = bench.attention_flops(shape.b, shape.h, s, s, d, causal, pass_)
                    for name, impl in impls.items():
                        row = {"impl": name, **bench._shape_fields(shape, pass_, torch.bfloat16),
                               "ms": None, "tflops": None,
                               **(paths if name.startswith("fa4_final") else {})}
                        try:
                            m = measure_call(bench._timed_call(impl, shape, pass_,
                                                               torch.bfloat16), calls, rounds)
                        except Exception as exc:
                            row["error"] = bench.error_text(exc)
                            rows.append(row)
                            print(f"{name} {pass_} s={s} d={d}: {row['error']}")
                            continue
                        row.update(m, ms=m["wall_us"] / 1e3,
                                   tflops=flops / (m["wall_us"] * 1e-6) / 1e12)
                        rows.append(row)
                        kernels = (f"kernels {m['kernel_us']:6.1f} us "
                                   f"({m['gpu_ops_per_call']:.0f} per call)"
                                   if m["kernel_us"] is not None else m["kernel_error"])
                        print(f"{name:12s} {pass_:7s} b={shape.b:3d} s={s:5d} d={d} "
                              f"causal={causal!s:5}: host {m['host_us']:6.1f} us, wall "
                              f"{m['wall_us']:6.1f} us, {kernels}")
                    torch.cuda.empty_cache()
    try:
        rows += tvm_ffi_launch_us()
    except Exception as exc:
        print(f"tvm_ffi_launch_us: {bench.error_text(exc)}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--profile", action="store_true", help="host path on the CPU, no kernels")
    ap.add_argument("--gpu", action="store_true", help="wall vs kernel time on a GPU")
    ap.add_argument("--label", default="current", help="--profile: the rows' variant label")
    ap.add_argument("--fa4-commit", default=None,
                    help="--profile: the commit of the fa4_final tree measured")
    ap.add_argument("--n", type=int, default=200, help="--profile: calls per repeat")
    ap.add_argument("--repeats", type=int, default=15, help="--profile: repeats")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--seqlens", nargs="+", type=int, default=[256, 512, 1024])
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--tokens", type=int, default=16384, help="--gpu: batch x seqlen")
    ap.add_argument("--calls", type=int, default=40, help="--gpu: back-to-back calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not (args.profile or args.gpu):
        ap.error("say what to measure: --profile (host path, no kernels) and/or --gpu")
    if args.profile:
        profile(args.label, args.fa4_commit, args.n, args.repeats, save=not args.no_save)
    if args.gpu:
        if not torch.cuda.is_available():
            print("package_host --gpu: needs a CUDA GPU", file=sys.stderr)
            return 2
        rows = gpu(args.seqlens, args.dims, args.calls, args.rounds, args.tokens)
        if not args.no_save:
            cmd = ("python -m measure.package_host --gpu --seqlens " +
                   " ".join(map(str, args.seqlens)) + " --dims " + " ".join(map(str, args.dims))
                   + f" --tokens {args.tokens} --calls {args.calls} --rounds {args.rounds}")
            print(f"wrote {results.save('package_host', rows, command=cmd)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
