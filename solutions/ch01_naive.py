"""Chapter 01: attention in plain PyTorch, the version every later chapter is measured against.

    S = scale * Q K^T        (B, H, Sq, Sk), written to memory
    P = softmax(S)           row by row, masked keys at -inf; written to memory
    O = P V

Each line of ``attention`` below is one eager PyTorch kernel, and every kernel that touches S or P
reads or writes all B*H*Sq*Sk of them. So the version is slow (per score it moves tens of bytes
for 4*D FLOPs: ``naive_traffic``) and big (at the peak a bf16 copy and a float32 copy of the
score matrix are alive: ``predict_peak_bytes``, checked against ``measure_peak_bytes``).
Chapter 02 never writes S or P at all.

Measured against PyTorch's SDPA backends: ``results/<gpu>/peers.json`` (printed by the notebook,
with where and when it was measured). ``roofline`` judges a measured speed against the bytes it
moves: at I FLOPs per byte and W bytes/s of memory bandwidth no kernel beats I * W FLOP/s.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from utils.bench import attention_flops
from utils.claims import claim
from utils.reference import attention_reference, check_attention_inputs, positive_int, random_qkv

# ---------------------------------------------------------------------------------------------
# 1. The version itself


def _heads_first(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, Hkv, D) -> contiguous (B, H, S, D), each kv head repeated H / Hkv times (GQA)."""
    t = t.transpose(1, 2)
    group = heads // t.shape[1]
    if group > 1:
        t = t.repeat_interleave(group, dim=1)
    return t.contiguous()


def attention(q, k, v, causal=False, softmax_scale=None):
    """Attention with S and P materialised: (out, lse), the course signature (CONTRIBUTING.md).

    The matmuls run in the inputs' precision; the softmax in float32 (float64 for float64
    inputs). A row that sees no key (causal, seqlen_q > seqlen_k) gives out = 0, lse = -inf.
    """
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v, softmax_scale)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    # The layout matmul wants: (B, H, S, D) contiguous copies, O(S * D) bytes each.
    qh, kh, vh = _heads_first(q, h), _heads_first(k, h), _heads_first(v, h)

    s = torch.matmul(qh, kh.transpose(-1, -2))  # (B, H, Sq, Sk) in the inputs' dtype
    s = s.to(acc).mul_(scale)  # a second (B, H, Sq, Sk): float32 for the softmax
    if causal:
        # Bottom-right aligned: query i sees keys j <= i + (Sk - Sq).
        blocked = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu_(sk - sq + 1)
        s.masked_fill_(blocked, float("-inf"))
        del blocked
    m = s.amax(dim=-1, keepdim=True)  # row max: exp never sees a positive argument
    m = m.masked_fill(m == float("-inf"), 0.0)  # a row with no key: exp(-inf - 0) = 0, not NaN
    s.sub_(m).exp_()  # unnormalised P, in place
    l = s.sum(dim=-1, keepdim=True)  # noqa: E741 (the row sum is l in every FlashAttention paper)
    lse = (m + l.log()).squeeze(-1)  # log(0) = -inf for an empty row
    s.div_(l.masked_fill(l == 0, 1.0))  # P = softmax(S); an empty row stays 0
    p = s.to(q.dtype)
    del s  # free the float32 matrix before the second matmul
    out = torch.matmul(p, vh)  # (B, H, Sq, D)
    return out.transpose(1, 2).contiguous(), lse.float()


# ---------------------------------------------------------------------------------------------
# 2. Bytes against FLOPs


@dataclass(frozen=True)
class Traffic:
    """Memory traffic of ``attention`` kernel by kernel, against its FLOPs."""

    steps: tuple[tuple[str, float, float], ...]  # (kernel, bytes read, bytes written)
    flops: float  # executed: the naive version computes every score, masked or not
    scores: int  # B * H * Sq * Sk

    @property
    def bytes(self) -> float:
        return sum(r + w for _, r, w in self.steps)

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes

    @property
    def bytes_per_score(self) -> float:
        return self.bytes / self.scores

    def table(self) -> str:
        lines = [f"{'kernel':<34}{'read MB':>10}{'written MB':>12}"]
        lines += [f"{name:<34}{r / 1e6:>10.1f}{w / 1e6:>12.1f}" for name, r, w in self.steps]
        lines.append(f"total {self.bytes / 1e6:.1f} MB for {self.flops / 1e9:.2f} GFLOP: "
                     f"{self.intensity:.1f} FLOP/byte, {self.bytes_per_score:.0f} bytes per score")
        return "\n".join(lines)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def naive_traffic(b, h, s_q, s_k, d, dtype=torch.bfloat16, causal=False,
                  heads_kv=None) -> Traffic:
    """Bytes each kernel of ``attention`` reads and writes, assuming nothing stays in cache.

    The score-sized terms are exact for this implementation; the O(S*D) terms count the
    layout copies of Q, K, V and O once each.
    """
    hk = h if heads_kv is None else heads_kv
    e, a = _elem(dtype), _elem(torch.promote_types(dtype, torch.float32))
    n2 = b * h * s_q * s_k
    qd, kd, kd_src = b * h * s_q * d, b * h * s_k * d, b * hk * s_k * d
    upcast = (e * n2, a * n2) if e != a else (0, 0)  # no copy when the inputs are float32
    steps = [
        ("copy Q, K, V to (B, H, S, D)", e * (qd + 2 * kd_src), e * (qd + 2 * kd)),
        ("S = Q K^T", e * (qd + kd), e * n2),
        ("S to float32", *upcast),
        ("times scale", a * n2, a * n2),
    ]
    if causal:
        steps.append(("causal mask (build, then fill)", a * n2 + s_q * s_k, a * n2 + s_q * s_k))
    steps += [
        ("row max", a * n2, 0),
        ("S - max, then exp (two kernels)", 2 * a * n2, 2 * a * n2),
        ("row sum", a * n2, 0),
        ("divide by the row sum", a * n2, a * n2),
        ("P to the inputs' dtype", *reversed(upcast)),
        ("O = P V", e * (n2 + kd), e * qd),
        ("O back to (B, S, H, D)", e * qd, e * qd),
    ]
    flops = attention_flops(b, h, s_q, s_k, d, causal=False)
    return Traffic(tuple(steps), flops, n2)


def fused_floor_bytes(b, h, s_q, s_k, d, dtype=torch.bfloat16, heads_kv=None) -> float:
    """The least any kernel that never writes S or P must move: read Q, K, V, write O and the
    float32 LSE once (what chapter 02's loop aims for)."""
    hk = h if heads_kv is None else heads_kv
    e = _elem(dtype)
    return e * (2 * b * s_q * h * d + 2 * b * s_k * hk * d) + 4 * b * h * s_q


@dataclass(frozen=True)
class RooflinePoint:
    """One measured run placed on the roofline: its FLOPs per byte and its speed."""

    label: str
    intensity: float  # FLOP per byte moved to and from memory
    tflops: float  # measured
    bound_tflops: float  # min(compute ceiling, intensity * bandwidth)
    compute_tflops: float  # the compute ceiling

    @property
    def memory_bound(self) -> bool:
        """Whether the bandwidth, not the compute ceiling, sets the bound."""
        return self.bound_tflops < self.compute_tflops

    @property
    def of_bound(self) -> float:
        """Measured speed as a fraction of what the roofline allows."""
        return self.tflops / self.bound_tflops


def roofline(label: str, flops: float, nbytes: float, ms: float, bandwidth: float,
             compute_flops: float) -> RooflinePoint:
    """Place a run of ``flops`` moving ``nbytes`` in ``ms`` under a roofline of ``bandwidth``
    bytes/s and ``compute_flops`` FLOP/s: the best it could do is min(compute, I * bandwidth)."""
    intensity = flops / nbytes
    bound = min(compute_flops, intensity * bandwidth) / 1e12
    return RooflinePoint(label, intensity, flops / (ms * 1e-3) / 1e12, bound,
                         compute_flops / 1e12)


def plot_roofline(points, bandwidths: dict, ceilings: dict, ax=None, title="Roofline"):
    """Log-log FLOP/s against FLOP/byte: one sloped line per memory bandwidth (bytes/s), one
    flat line per compute ceiling (FLOP/s), and the measured ``points``."""
    import matplotlib.pyplot as plt
    import numpy as np

    ax = ax or plt.subplots(figsize=(8, 4.5))[1]
    lo = min(p.intensity for p in points) / 4
    hi = max(p.intensity for p in points) * 4
    x = np.geomspace(lo, hi, 200)
    top = max(ceilings.values())
    for (name, w), style in zip(bandwidths.items(), ("-", "--", ":")):
        ax.plot(x, np.minimum(x * w, top) / 1e12, style, color="black", lw=1,
                label=f"{name}: {w / 1e12:.2f} TB/s")
    for (name, c), style in zip(ceilings.items(), ("-", "--", ":")):
        ax.axhline(c / 1e12, ls=style, color="gray", lw=1, label=f"{name}: {c / 1e12:.0f} TFLOP/s")
    for p in points:
        ax.plot(p.intensity, p.tflops, "o")
        ax.annotate(p.label, (p.intensity, p.tflops), textcoords="offset points",
                    xytext=(6, -10), fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="FLOP per byte of memory traffic",
           ylabel="TFLOP/s", title=title)
    ax.legend(fontsize=7, loc="lower right")
    return ax


# ---------------------------------------------------------------------------------------------
# 3. Peak memory: predicted, then measured


@dataclass(frozen=True)
class MemoryPrediction:
    """Bytes alive at each stage of ``attention`` beyond its inputs; the peak is the largest."""

    stages: tuple[tuple[str, int], ...]

    @property
    def peak(self) -> int:
        return max(b for _, b in self.stages)

    @property
    def peak_stage(self) -> str:
        return max(self.stages, key=lambda s: s[1])[0]


def predict_peak_bytes(b, h, s_q, s_k, d, dtype=torch.bfloat16, causal=False,
                       heads_kv=None) -> MemoryPrediction:
    """What ``attention`` holds at once, stage by stage (tensors' bytes, allocator slack aside).

    The score matrix dominates: B*H*Sq*Sk * (bytes of the inputs' dtype + 4 for the float32
    copy) while the float32 scores are cast back to the inputs' dtype.
    """
    for name, val in (("b", b), ("h", h), ("s_q", s_q), ("s_k", s_k), ("d", d)):
        positive_int(name, val)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    hk = h if heads_kv is None else heads_kv
    if h % hk:
        raise ValueError(f"heads ({h}) must be a multiple of heads_kv ({hk})")
    e, a = _elem(dtype), _elem(torch.promote_types(dtype, torch.float32))
    n2, rows = b * h * s_q * s_k, b * h * s_q
    copies = e * b * h * (s_q + 2 * s_k) * d  # qh, kh, vh: alive until the function returns
    s_in = n2 * e  # S, later P, in the inputs' dtype
    s_acc = n2 * a if e != a else 0  # the float32 copy (for float32 inputs S itself is it)
    kept = 3 * rows * a  # m, l and lse: one number per row each (log(l) is a passing temporary)
    out = rows * d * e
    stages = [
        ("S = Q K^T", copies + s_in),
        ("S to float32", copies + s_in + s_acc),
        ("causal mask" if causal else "no mask", copies + max(s_acc, s_in) + s_q * s_k * causal),
        ("row statistics", copies + max(s_acc, s_in) + kept + rows * a + 2 * rows),
        ("P to the inputs' dtype", copies + s_acc + s_in + kept),
        ("O = P V, then back to (B, S, H, D)", copies + s_in + kept + 2 * out
         + (rows * 4 if a > 4 else 0)),
    ]
    return MemoryPrediction(tuple(stages))


class _LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage created under it while it is alive.

    Sees each tensor an ATen operator returns; does not see scratch memory a kernel allocates
    inside itself, nor the allocator's rounding. Storages that existed before (the inputs) are
    not counted.
    """

    def __init__(self, ignore=()):
        super().__init__()
        self.ignore = {t.untyped_storage().data_ptr() for t in ignore}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.current -= self.sizes.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key in self.ignore or key == 0:
                continue
            if key not in self.refs:
                self.refs[key] = 0
                self.sizes[key] = t.untyped_storage().nbytes()
                self.current += self.sizes[key]
                self.peak = max(self.peak, self.current)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out


@dataclass(frozen=True)
class PeakMemory:
    bytes: int
    method: str  # how it was measured, in words

    def __str__(self) -> str:
        return f"{self.bytes / 2**20:.1f} MiB ({self.method})"


def measure_peak_bytes(fn, q, k, v, causal=False, softmax_scale=None) -> PeakMemory:
    """Peak memory ``fn(q, k, v, ...)`` adds on top of its inputs.

    On a GPU: ``torch.cuda.max_memory_allocated`` around one call (after a warm-up call, so
    one-off workspaces are already allocated). On a CPU there is no allocator statistic: the
    bytes of the tensors ATen operators return are summed while they are alive.
    """
    if q.is_cuda:
        fn(q, k, v, causal=causal, softmax_scale=softmax_scale)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn(q, k, v, causal=causal, softmax_scale=softmax_scale)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del result
        return PeakMemory(peak, "torch.cuda.max_memory_allocated, allocator rounding included")
    with torch.no_grad(), _LiveTensorBytes(ignore=(q, k, v)) as tracker:
        result = fn(q, k, v, causal=causal, softmax_scale=softmax_scale)
    del result
    return PeakMemory(tracker.peak, "CPU: bytes of live tensors returned by ATen operators; "
                                    "kernel scratch space and allocator slack not seen")


# ---------------------------------------------------------------------------------------------
# 4. Exercises: the checkers say in plain words what is wrong (01.1 attention, 01.2 its peak)


def _first_problem(fn, q, k, v, causal, what: str) -> str | None:
    out, lse = fn(q, k, v, causal=causal)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal)
    if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
        return "return a pair of tensors (out, lse)"
    if out.shape != q.shape:
        return f"out must have q's shape {tuple(q.shape)} (batch, seqlen, heads, dim), got " \
               f"{tuple(out.shape)}"
    if lse.shape != ref_lse.shape:
        return f"lse must be (batch, heads, seqlen_q) = {tuple(ref_lse.shape)}, got " \
               f"{tuple(lse.shape)}"
    out64, lse64 = out.double(), lse.double()
    empty = torch.isinf(ref_lse)  # (b, h, sq): rows that see no key
    if torch.isnan(out64).any() or torch.isnan(lse64).any():
        if empty.any():
            return (f"NaN in the output ({what}). Some rows see no key at all: softmax over a row "
                    "of -inf is 0/0. Give such rows out = 0 and lse = -inf")
        return f"NaN in the output ({what}): is a row max of -inf subtracted somewhere?"
    tol = 2e-2 if q.dtype in (torch.bfloat16, torch.float16) else 1e-4
    if empty.any():
        if not torch.equal(torch.isinf(lse64) & (lse64 < 0), empty):
            return f"lse must be -inf exactly for the rows that see no key ({what})"
        if out64.transpose(1, 2)[empty].abs().max() > 0:
            return f"rows that see no key must give out = 0 ({what})"
    err_lse = (lse64 - ref_lse)[~empty].abs().max().item() if (~empty).any() else 0.0
    err_out = (out64 - ref_out).abs().max().item()
    if err_out > tol or err_lse > tol:
        return f"out is off by up to {err_out:.3g} and lse by {err_lse:.3g} vs float64 ({what})"
    return None


def check_causal_attention(fn) -> None:
    """Exercise 01.1: ``fn(q, k, v, causal=False, softmax_scale=None) -> (out, lse)``."""
    q, k, v, _ = random_qkv(2, 37, 3, 16, dtype=torch.float32)
    problem = _first_problem(fn, q, k, v, False, "no mask, seqlen 37")
    if problem:
        raise AssertionError(problem)
    problem = _first_problem(fn, q, k, v, True, "causal, seqlen_q = seqlen_k = 37")
    if problem:
        raise AssertionError(problem + ": is key j masked exactly when j > i?")
    q2, k2, v2, _ = random_qkv(1, 19, 2, 16, seqlen_k=45, dtype=torch.float32)
    top_left = attention_reference(q2[:, :, :, :], k2[:, :19], v2[:, :19], causal=True)[0]
    out2, _ = fn(q2, k2, v2, causal=True)
    if torch.allclose(out2.double(), top_left, atol=1e-4):
        raise AssertionError(
            "with seqlen_q=19 < seqlen_k=45 your mask is aligned to the top left. The course "
            "aligns it to the bottom right: query i sees keys j <= i + (seqlen_k - seqlen_q), so "
            "the last query sees every key"
        )
    problem = _first_problem(fn, q2, k2, v2, True, "causal, seqlen_q=19 < seqlen_k=45")
    if problem:
        raise AssertionError(problem + ": query i sees keys j <= i + (seqlen_k - seqlen_q)")
    q3, k3, v3, _ = random_qkv(1, 40, 2, 16, seqlen_k=25, dtype=torch.float32)
    problem = _first_problem(fn, q3, k3, v3, True, "causal, seqlen_q=40 > seqlen_k=25")
    if problem:
        raise AssertionError(problem)
    q4, k4, v4, _ = random_qkv(1, 33, 4, 16, heads_kv=2, dtype=torch.bfloat16)
    problem = _first_problem(fn, q4, k4, v4, True, "bf16, 4 query heads sharing 2 kv heads")
    if problem:
        raise AssertionError(problem + ". With GQA, query head i uses kv head i // (H / H_kv)")


def _attention_forbid() -> dict:
    import torch.nn.functional as F

    from solutions import ch02_online_softmax as ch02

    why = "it computes attention for you; the exercise is to write the steps yourself"
    return {attention_reference: "that is the float64 reference the checker compares with; " + why,
            F.scaled_dot_product_attention: "PyTorch's fused attention: " + why,
            ch02.attention: why, ch02.attention_fa2: why, ch02.attention_fa1: why}


ATTENTION_FORBID = _attention_forbid()  # 01.1


# Exercise 01.2: the peak, beyond the inputs, of ``attention`` on bf16 inputs. Shapes where the
# score matrices dominate and shapes where the (B, H, S, D) copies are a few per cent of it.
PEAK_CASES = ((1, 16, 16384, 16384, 128), (1, 2, 100, 300, 64), (1, 4, 1024, 1024, 64),
              (2, 3, 512, 200, 64))
PEAK_TOLERANCE = 0.02
PEAK_FORBID = {
    predict_peak_bytes: "it is the course's count, stage by stage; the exercise is to make it",
    measure_peak_bytes: "it measures the peak instead of predicting it",
    naive_traffic: "it counts the bytes moved, not the bytes held; count what is alive at once",
}


def naive_peak_bytes(b: int, h: int, s_q: int, s_k: int, d: int) -> int:
    """Reference for 01.2: the bytes ``attention`` holds at its peak beyond its bf16 inputs."""
    return predict_peak_bytes(b, h, s_q, s_k, d, torch.bfloat16).peak


def check_peak_bytes(fn) -> None:
    """Exercise 01.2: ``fn(b, h, s_q, s_k, d) -> bytes`` within 2% of the count of every tensor
    ``attention`` holds at its peak (bf16 inputs, no mask)."""
    for b, h, sq, sk, d in PEAK_CASES:
        got = fn(b, h, sq, sk, d)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
            raise AssertionError(f"return a number of bytes, got {got!r}")
        want = naive_peak_bytes(b, h, sq, sk, d)
        if abs(got - want) <= PEAK_TOLERANCE * want:
            continue
        n2 = b * h * sq * sk
        copies = 2 * b * h * (sq + 2 * sk) * d
        where = (f"B={b}, H={h}, Sq={sq}, Sk={sk}, D={d}: you say {got:,.0f} bytes, the peak is "
                 f"{want:,.0f}")
        hints = [
            (6 * n2, "the score matrices are right, but matmul wants (B, H, S, D) copies of Q, "
                     "K and V (transposed, contiguous), 2 bytes per element, alive until the "
                     "function returns: add them"),
            (2 * n2 + copies, "that is one bf16 score matrix; at the peak its float32 copy is "
                              "alive too (2 + 4 bytes per score)"),
            (4 * n2 + copies, "that is the float32 scores alone; the bf16 P is made while they "
                              "are still alive (2 + 4 bytes per score)"),
            (8 * n2 + copies, "at most two score matrices are alive at once: the bf16 S is "
                              "dropped once its float32 copy exists, and P is made from that"),
            (10 * n2 + copies, "at most two score matrices are alive at once: the bf16 S is "
                               "dropped once its float32 copy exists, and P is made from that"),
        ]
        if got < 1e-3 * want:
            raise AssertionError(f"{where}. Return bytes, not GiB or MB")
        for value, hint in hints:
            if math.isclose(got, value, rel_tol=PEAK_TOLERANCE):
                raise AssertionError(f"{where}. {hint}")
        raise AssertionError(f"{where}. Count the (B, H, Sq, Sk) matrices alive at the same "
                             "moment and the bytes per element of each, plus the (B, H, S, D) "
                             "copies of Q, K and V")


# ---------------------------------------------------------------------------------------------
# 5. Reading the stored run (results/h200/ch01_ch02_fwd.json): roofline points, the peers


def naive_points(versions, bandwidth: float, compute_flops: float) -> list[tuple]:
    """(stored row, RooflinePoint, bytes per second moved by the byte count) for every naive
    forward row of ``versions`` that was timed."""
    out = []
    for r in versions.where(impl="naive", **{"pass": "fwd"}):
        if not r.get("ms"):
            continue
        t = naive_traffic(r["b"], r["h"], r["s"], r["s"], r["d"], causal=r["causal"])
        pt = roofline(f"naive S={r['s']}", t.flops, t.bytes, r["ms"], bandwidth, compute_flops)
        out.append((r, pt, t.bytes / (r["ms"] * 1e-3)))
    return out


def fused_point(row, bandwidth: float, compute_flops: float) -> RooflinePoint:
    """A fused kernel's stored row on the roofline, with the bytes a kernel that never writes S
    or P must move."""
    floor = fused_floor_bytes(row["b"], row["h"], row["s"], row["s"], row["d"])
    flops = naive_traffic(row["b"], row["h"], row["s"], row["s"], row["d"]).flops
    return roofline(f"{row['impl']} S={row['s']}", flops, floor, row["ms"], bandwidth,
                    compute_flops)


def naive_tflops(versions, s: int = 16384) -> float:
    return versions.one(impl="naive", s=s, **{"pass": "fwd"})["tflops"]


def best_peer_over_naive(versions, s: int = 16384) -> tuple[str, float]:
    """(the fastest peer of the run at length s, its TFLOP/s over the naive version's)."""
    from utils import bench

    naive = versions.one(impl="naive", s=s, **{"pass": "fwd"})
    peer = bench.best_peer(versions.rows, naive)
    return peer["impl"], peer["tflops"] / naive["tflops"]


@claim("01.naive_under_its_bandwidth_line", "ch01_ch02_fwd",
       "at every stored length the naive version runs below what its byte count allows at the "
       "H200's datasheet bandwidth, and far below the tensor cores' datasheet peak")
def _naive_under_bandwidth(res):
    from utils.hardware import DATASHEET_DENSE_BF16_TFLOPS, HBM_DATASHEET_BYTES_PER_S

    peak = DATASHEET_DENSE_BF16_TFLOPS["sm_90"]
    pts = naive_points(res, HBM_DATASHEET_BYTES_PER_S["H200"], peak * 1e12)
    ok = bool(pts) and all(pt.memory_bound and pt.of_bound < 1 and pt.tflops < 0.1 * peak
                           for _, pt, _ in pts)
    return ok, "; ".join(f"S={r['s']}: {pt.tflops:.1f} of {pt.bound_tflops:.1f} TFLOP/s allowed"
                         for r, pt, _ in pts)


@claim("01.fused_ten_times_ahead", "ch01_ch02_fwd",
       "at every stored length the fastest fused peer of the run does the same forward more than "
       "ten times as fast as the naive version")
def _fused_ahead(res):
    ratios = {r["s"]: best_peer_over_naive(res, r["s"])
              for r in res.where(impl="naive", **{"pass": "fwd"}) if r.get("tflops")}
    return (bool(ratios) and all(x > 10 for _, x in ratios.values()),
            ", ".join(f"S={s}: {p} {x:.0f}x" for s, (p, x) in sorted(ratios.items())))
