"""Benchmarking attention on a GPU: timing, FLOP counts, peers measured in the same run.

Method (written down so every number in the course means the same thing):
- CUDA events around the timed call only; the L2 cache (50 MB on an H200) is flushed before
  every timed call by writing a 256 MB buffer, so no run reads inputs left warm in L2 by the
  previous one;
- warm-up calls first (compilation, autotuning, module load stay out of the numbers);
- the median of ``rep`` timed calls is reported, with the min and the spread;
- FLOPs: forward 4 * b * h * s_q * s_k * d (two matmuls of 2 * s_q * s_k * d each), halved for
  causal, x2.5 for the backward (five matmuls instead of two);
- peers (SDPA's flash, cuDNN, memory-efficient and math backends; the FA4 package when installed)
  run on the same inputs, in the same process, interleaved with the course's kernels.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def attention_flops(b, h, s_q, s_k, d, causal=False, pass_="fwd") -> float:
    """FLOPs of attention by the usual convention (causal counted as half the square)."""
    flops = 4.0 * b * h * s_q * s_k * d
    if causal:
        flops *= 0.5
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
    if pass_ not in factor:
        raise ValueError(f"pass_ must be one of {sorted(factor)}, got {pass_!r}")
    return flops * factor[pass_]


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    p20_ms: float
    p80_ms: float
    reps: int

    def tflops(self, flops: float) -> float:
        return flops / (self.median_ms * 1e-3) / 1e12


class _L2Flusher:
    def __init__(self, nbytes: int = 256 * 2**20):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def __call__(self):
        self.buf.zero_()


_flusher: _L2Flusher | None = None


def time_cuda(fn: Callable[[], object], warmup: int = 5, rep: int = 30,
              flush_l2: bool = True, max_seconds: float = 4.0) -> Timing:
    """Median time of ``fn()`` in milliseconds, measured with CUDA events.

    ``rep`` is lowered for slow functions so one measurement takes about ``max_seconds``.
    """
    global _flusher
    if flush_l2 and _flusher is None:
        _flusher = _L2Flusher()
    fn()  # first call: compilation, autotuning, allocations
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    # Slow functions (eager PyTorch loops) need no long warm-up and few repeats.
    for _ in range(min(warmup, int(200.0 / one))):
        fn()
    rep = max(3, min(rep, int(max_seconds * 1e3 / one)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for i in range(rep):
        if flush_l2:
            _flusher()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0]] * 4
    return Timing(statistics.median(times), times[0], q[0], q[-1], rep)


# ----------------------------------------------------------------------------------------------
# Peers: the course signature attention(q, k, v, causal, softmax_scale) -> (out, lse or None).
# SDPA wants (batch, heads, seqlen, dim): a transposed view of our layout is what FlashAttention
# itself uses internally, so no copy is timed. SDPA aligns causal masks to the top left; peers
# are benchmarked with seqlen_q == seqlen_k only, where both conventions agree.


def _sdpa(backend_name: str):
    def run(q, k, v, causal=False, softmax_scale=None):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        gqa = q.shape[2] != k.shape[2]
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=causal, scale=softmax_scale, enable_gqa=gqa,
            )
        return out.transpose(1, 2), None

    run.__name__ = f"sdpa_{backend_name.lower()}"
    return run


def _fa4_package():
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        return None

    def run(q, k, v, causal=False, softmax_scale=None):
        out, lse = flash_attn_func(
            q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True
        )
        return out, lse

    return run


def peers(include_math: bool = False) -> dict[str, Callable]:
    """Reference implementations available on this machine, by name."""
    found = {
        "sdpa_flash": _sdpa("FLASH_ATTENTION"),
        "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
        "sdpa_efficient": _sdpa("EFFICIENT_ATTENTION"),
    }
    if include_math:
        found["sdpa_math"] = _sdpa("MATH")
    fa4 = _fa4_package()
    if fa4 is not None:
        found["fa4_package"] = fa4
    return found


# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    b: int
    s: int
    h: int
    d: int
    causal: bool = False
    h_kv: int | None = None

    @classmethod
    def standard(cls, s: int, d: int = 128, causal: bool = False, tokens: int = 16384,
                 h: int = 16) -> Shape:
        """The course's sweep shape: batch x seqlen = 16384 tokens, 16 heads."""
        return cls(b=max(1, tokens // s), s=s, h=h, d=d, causal=causal)


def _inputs(shape: Shape, dtype, requires_grad=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hk = shape.h_kv or shape.h

    def r(heads):
        t = torch.randn(shape.b, shape.s, heads, shape.d, device="cuda", dtype=dtype, generator=g)
        return t.requires_grad_(requires_grad)

    return r(shape.h), r(hk), r(hk)


def _time_one(fn, shape: Shape, pass_: str, dtype, warmup: int, rep: int) -> Timing:
    q, k, v = _inputs(shape, dtype, requires_grad=(pass_ != "fwd"))
    if pass_ == "fwd":
        with torch.no_grad():
            return time_cuda(lambda: fn(q, k, v, causal=shape.causal), warmup=warmup, rep=rep)
    out = fn(q, k, v, causal=shape.causal)[0]
    dout = torch.randn_like(out)
    return time_cuda(
        lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        warmup=warmup, rep=rep,
    )


def benchmark_attention(
    impls: dict[str, Callable],
    shapes: list[Shape],
    passes=("fwd",),
    dtype=torch.bfloat16,
    warmup: int = 5,
    rep: int = 30,
    progress: bool = True,
    on_error: str = "record",
) -> list[dict]:
    """Time every implementation on every shape; return result rows (see utils/results.py).

    An implementation that raises (unsupported shape, out of memory) is recorded with
    ``ms = None`` and the error text, or re-raised with ``on_error="raise"``.
    """
    jobs = [(s, p, n) for s in shapes for p in passes for n in impls]
    try:
        from tqdm.auto import tqdm

        it = tqdm(jobs, disable=not progress, desc="benchmark")
    except ImportError:
        it = jobs
    rows = []
    for shape, pass_, name in it:
        fn = impls[name]
        row = {
            "impl": name, "pass": pass_, "dtype": DTYPE_NAMES.get(dtype, str(dtype)),
            "b": shape.b, "s": shape.s, "h": shape.h, "d": shape.d, "causal": shape.causal,
            "h_kv": shape.h_kv or shape.h, "ms": None, "tflops": None,
        }
        flops = attention_flops(shape.b, shape.h, shape.s, shape.s, shape.d, shape.causal, pass_)
        try:
            timing = _time_one(fn, shape, pass_, dtype, warmup, rep)
            row.update(ms=timing.median_ms, tflops=timing.tflops(flops),
                       ms_min=timing.min_ms, ms_p20=timing.p20_ms, ms_p80=timing.p80_ms,
                       reps=timing.reps)
        except Exception as exc:  # a peer may not support a shape; record it plainly
            if on_error == "raise":
                raise
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        finally:
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def ratio_table(rows: list[dict], baseline: str, pass_: str = "fwd") -> str:
    """Each implementation's TFLOP/s and its ratio to ``baseline``, shape by shape."""
    keys = sorted({(r["d"], r["s"], r["causal"]) for r in rows if r["pass"] == pass_})
    names = list(dict.fromkeys(r["impl"] for r in rows))
    lines = [f"{'D':>4} {'S':>6} {'causal':>6}  " + "  ".join(f"{n:>16}" for n in names)]
    for d, s, causal in keys:
        found = {
            r["impl"]: r for r in rows
            if r["pass"] == pass_ and (r["d"], r["s"], r["causal"]) == (d, s, causal)
        }
        base = found.get(baseline, {}).get("tflops")
        cells = []
        for n in names:
            t = found.get(n, {}).get("tflops")
            if t is None:
                cells.append(f"{'-':>16}")
            elif base:
                cells.append(f"{t:8.0f} ({t / base:4.2f}x)")
            else:
                cells.append(f"{t:16.0f}")
        lines.append(f"{d:>4} {s:>6} {causal!s:>6}  " + "  ".join(cells))
    return "\n".join(lines)


def geomean(values) -> float:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
