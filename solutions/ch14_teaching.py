"""Chapter 14's exercises, their checkers, the models the notebook prints, and its claims.

14.1 ``merge_pair``   (device code) the stable merge of two partial results of one row
14.2 ``merge_step``   (device code) one step of the W-way merge in one pass, a running max
14.3 ``ring_loop``    (host, threads) the ring forward's loop: exchange, attend, merge, wait
14.4 ``zigzag``       (host) the causal chunk assignment: every rank the same work

Note [Device code on the CPU, for real]
14.1 and 14.2 are ``@cute.jit`` functions of one row. The checkers run them twice. On this CPU,
through the DSL itself: a host ``@cute.jit`` loop calls the learner's function for every row of
NumPy arrays (``from_dlpack``), so the same source is compiled to host code and run, with the
DSL's own float32 arithmetic and ``exp2``/``log2``. Two device-only calls have no host version
and are swapped while the host loop is traced: ``cute.arch.fmax`` becomes ``cute.math.max`` and
``cute.arch.rcp_approx`` a division. Then compiled for sm_90a in a kernel of one thread per row,
where the SASS is read: how many MUFU.EX2, MUFU.LG2 and reciprocals the function costs per row.
"""

from __future__ import annotations

import math
from collections import Counter

import cutlass
import cutlass.cute as cute
import numpy as np
import torch
from cutlass import Float32

from solutions import ch14_ring as ring
from utils.claims import claim
from utils.hardware import DATASHEET_DENSE_BF16_TFLOPS

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
HEAD_DIM = 32  # the row length of the compiled exercise kernels
THREADS = 128


# ================================================================================================
# Exercise 14.1: the stable merge of two partial results, one row, device code
# ================================================================================================
@cute.jit
def merge_pair(o1: cute.Tensor, lse1: Float32, o2: cute.Tensor, lse2: Float32,
               o: cute.Tensor) -> Float32:
    """Note [The merge] for one row: o1, o2 (D,) normalised partial outputs with their lse
    (natural log); writes the merged row into o and returns its lse. One ex2 per part, one lg2
    and one reciprocal per row; a row that saw no key in either part gives (0, -inf)."""
    m = cute.arch.fmax(lse1, lse2)
    m_safe = Float32(0.0) if m == -Float32.inf else m  # both -inf: weights exp2(-inf) = 0
    w1 = cute.math.exp2((lse1 - m_safe) * Float32(LOG2_E), fastmath=True)
    w2 = cute.math.exp2((lse2 - m_safe) * Float32(LOG2_E), fastmath=True)
    total = w1 + w2
    inv = Float32(0.0) if total == Float32(0.0) else Float32(1.0) / total
    w1 = w1 * inv
    w2 = w2 * inv
    for i in cutlass.range_constexpr(cute.size(o)):
        o[i] = o1[i] * w1 + o2[i] * w2
    return m_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)


# ================================================================================================
# Exercise 14.2: the W-way merge in one pass (the online softmax's step over partials)
# ================================================================================================
@cute.jit
def merge_step(acc: cute.Tensor, row_max: Float32, row_sum: Float32, o_b: cute.Tensor,
               lse_b: Float32):
    """One partial (o_b, lse_b) into the running state of a row: acc (D,) = sum of
    exp(lse_i - row_max) o_i over the partials so far (not normalised), row_sum = sum of
    exp(lse_i - row_max), row_max = the largest lse so far (-inf before any key). Returns
    (row_max, row_sum); acc in place. No log and no division: the caller finishes once,
    o = acc / row_sum, lse = row_max + log(row_sum)."""
    m_new = cute.arch.fmax(row_max, lse_b)
    m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
    alpha = cute.math.exp2((row_max - m_safe) * Float32(LOG2_E), fastmath=True)
    w = cute.math.exp2((lse_b - m_safe) * Float32(LOG2_E), fastmath=True)
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = acc[i] * alpha + o_b[i] * w
    return m_new, row_sum * alpha + w


class MergeKernels:
    """The exercise functions in a kernel of one thread per row (device) and in a host loop over
    the rows (Note [Device code on the CPU, for real]). ``pair``: a 14.1 function; ``step``: a
    14.2 function, called ``parts`` times per row, then finished by the kernel."""

    def __init__(self, pair=None, step=None, parts: int = 4, head_dim: int = HEAD_DIM):
        self.pair, self.step, self.parts, self.head_dim = pair, step, parts, head_dim

    # --- one row: the same code on the host and on the device ------------------------------
    @cute.jit
    def pair_row(self, mO1: cute.Tensor, mL1: cute.Tensor, mO2: cute.Tensor, mL2: cute.Tensor,
                 mO: cute.Tensor, mL: cute.Tensor, row):
        d = self.head_dim
        r1 = cute.make_rmem_tensor(d, Float32)  # (D,) this row of each part, in registers
        r2 = cute.make_rmem_tensor(d, Float32)
        ro = cute.make_rmem_tensor(d, Float32)
        for i in cutlass.range_constexpr(d):
            r1[i] = mO1[row, i]
            r2[i] = mO2[row, i]
        mL[row] = self.pair(r1, mL1[row], r2, mL2[row], ro)
        for i in cutlass.range_constexpr(d):
            mO[row, i] = ro[i]

    @cute.jit
    def step_row(self, mOs: cute.Tensor, mLs: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor,
                 row):
        d = self.head_dim
        acc = cute.make_rmem_tensor(d, Float32)  # (D,) the running, unnormalised output
        rb = cute.make_rmem_tensor(d, Float32)  # (D,) the partial arriving now
        for i in cutlass.range_constexpr(d):
            acc[i] = Float32(0.0)
        row_max = -Float32.inf
        row_sum = Float32(0.0)
        for p in cutlass.range_constexpr(self.parts):  # partials arrive one by one
            for i in cutlass.range_constexpr(d):
                rb[i] = mOs[p, row, i]
            row_max, row_sum = self.step(acc, row_max, row_sum, rb, mLs[p, row])
        inv = Float32(0.0) if row_sum == Float32(0.0) else Float32(1.0) / row_sum
        for i in cutlass.range_constexpr(d):
            mO[row, i] = acc[i] * inv
        mL[row] = row_max + cute.math.log2(row_sum, fastmath=True) * Float32(LN_2)

    # --- the host loop -----------------------------------------------------------------------
    @cute.jit
    def pair_on_cpu(self, mO1: cute.Tensor, mL1: cute.Tensor, mO2: cute.Tensor,
                    mL2: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor):
        for row in cutlass.range(cute.size(mL)):
            self.pair_row(mO1, mL1, mO2, mL2, mO, mL, row)

    @cute.jit
    def step_on_cpu(self, mOs: cute.Tensor, mLs: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor):
        for row in cutlass.range(cute.size(mL)):
            self.step_row(mOs, mLs, mO, mL, row)

    # --- the kernels ---------------------------------------------------------------------------
    @cute.kernel
    def pair_kernel(self, mO1: cute.Tensor, mL1: cute.Tensor, mO2: cute.Tensor,
                    mL2: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * THREADS + tidx
        if row < cute.size(mL):
            self.pair_row(mO1, mL1, mO2, mL2, mO, mL, row)

    @cute.jit
    def pair_launch(self, mO1: cute.Tensor, mL1: cute.Tensor, mO2: cute.Tensor,
                    mL2: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, stream):
        grid = (cute.ceil_div(cute.size(mL), THREADS), 1, 1)
        self.pair_kernel(mO1, mL1, mO2, mL2, mO, mL).launch(grid=grid, block=(THREADS, 1, 1),
                                                           stream=stream)

    @cute.kernel
    def step_kernel(self, mOs: cute.Tensor, mLs: cute.Tensor, mO: cute.Tensor,
                    mL: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * THREADS + tidx
        if row < cute.size(mL):
            self.step_row(mOs, mLs, mO, mL, row)

    @cute.jit
    def step_launch(self, mOs: cute.Tensor, mLs: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor,
                    stream):
        grid = (cute.ceil_div(cute.size(mL), THREADS), 1, 1)
        self.step_kernel(mOs, mLs, mO, mL).launch(grid=grid, block=(THREADS, 1, 1),
                                                  stream=stream)


# --- running on the CPU -------------------------------------------------------------------------
_HOST_OK = {"fmax", "rcp_approx"}


def _host_fmax(a, b, **_):
    return cute.math.max(a, b)


def _host_rcp(x, **_):
    return Float32(1.0) / x


def _refuse_device_only(fn) -> None:
    from utils.exercises import referenced

    for text, obj in referenced(fn):
        if text.startswith("cute.arch.") and text.split(".")[2] not in _HOST_OK:
            raise AssertionError(
                f"your function calls {text}, which the check cannot run on this CPU: a merge "
                "needs only arithmetic, cute.arch.fmax, cute.math.exp2 and cute.math.log2")
        if obj in (np.exp, np.log, np.logaddexp, math.exp, math.log, torch.logaddexp):
            raise AssertionError(f"your function calls {text}, which runs on the host; in "
                                 "device code use cute.math.exp2 and cute.math.log2")


def _on_cpu(run, *arrays):
    from cutlass.cute.runtime import from_dlpack

    from utils.host_emulation import patched

    with patched(cute.arch, fmax=_host_fmax, rcp_approx=_host_rcp):
        run(*(from_dlpack(a) for a in arrays))


def run_pair_on_cpu(fn, o1, l1, o2, l2):
    """14.1's function on every row of float32 NumPy arrays: (o (rows, D), lse (rows,))."""
    o1, o2 = (np.ascontiguousarray(a, dtype=np.float32) for a in (o1, o2))
    l1, l2 = (np.ascontiguousarray(a, dtype=np.float32) for a in (l1, l2))
    o = np.full_like(o1, np.nan)
    lse = np.full_like(l1, np.nan)
    kernels = MergeKernels(pair=fn, head_dim=o1.shape[1])
    _on_cpu(kernels.pair_on_cpu, o1, l1, o2, l2, o, lse)
    return o, lse


def run_steps_on_cpu(fn, os_, lses):
    """14.2's function over ``parts`` partials per row, then finished: (o, lse)."""
    os_ = np.ascontiguousarray(os_, dtype=np.float32)
    lses = np.ascontiguousarray(lses, dtype=np.float32)
    o = np.full(os_.shape[1:], np.nan, dtype=np.float32)
    lse = np.full(os_.shape[1], np.nan, dtype=np.float32)
    kernels = MergeKernels(step=fn, parts=os_.shape[0], head_dim=os_.shape[2])
    _on_cpu(kernels.step_on_cpu, os_, lses, o, lse)
    return o, lse


def merge_reference(os_, lses):
    """The W-way merge in float64 (NumPy): (o (rows, D), lse (rows,))."""
    os_, lses = np.asarray(os_, np.float64), np.asarray(lses, np.float64)
    lse = np.logaddexp.reduce(lses, axis=0)
    safe = np.where(np.isfinite(lse), lse, 0.0)
    w = np.exp(lses - safe)  # (W, rows), 0 for parts with no key
    return (w[..., None] * os_).sum(0), lse


# Rows that tell mistakes apart: (what the row is, lse of each part). Outputs are random.
def merge_rows(parts: int):
    rows = [("an ordinary row", [0.3, -0.2, 1.1, 0.4]),
            ("a row with lse near 100 (exp(lse) overflows float32 above 88.7)",
             [96.0, 101.5, 99.0, 100.2]),
            ("a row whose second part saw no key (lse = -inf)", [1.5, -np.inf, 0.2, -np.inf]),
            ("a row whose first part saw no key", [-np.inf, 2.0, -np.inf, 0.7]),
            ("a row that saw no key at all (every lse = -inf)", [-np.inf] * 4),
            ("a row whose largest lse arrives last", [-3.0, -1.0, 0.5, 30.0]),
            ("a row with lse far apart", [0.0, -90.0, -40.0, 5.0]),
            ("a row with negative lse", [-60.0, -58.5, -61.0, -59.0])]
    return [(what, np.array(l[:parts], dtype=np.float64)) for what, l in rows]


def _merge_case(parts: int, d: int = 8, seed: int = 14):
    rng = np.random.default_rng(seed)
    rows = merge_rows(parts)
    lses = np.stack([r[1] for r in rows], axis=1)  # (W, rows)
    os_ = rng.standard_normal((parts, len(rows), d))
    os_[np.isneginf(lses)] = 0.0  # a part that saw no key has out = 0
    return rows, os_, lses


def _row_mistake(what, got_o, got_l, want_o, want_l, log2_units_hint=True,
                 lses=()) -> str | None:
    if (np.isnan(got_l) or np.isnan(got_o).any()) and np.isneginf(lses).any() \
            and np.isfinite(want_l):
        return (f"{what} gives NaN: where the max is still -inf (no key yet) and a part's lse is "
                "-inf, lse - max = -inf - (-inf) is NaN. Subtract 0 instead of a max of -inf: "
                "the weight is then exp2(-inf) = 0")
    if np.isinf(want_l) and want_l < 0:
        if np.isnan(got_l) or np.isnan(got_o).any():
            return (f"{what} gives NaN: with every lse = -inf the max is -inf too, and "
                    "lse - max = -inf - (-inf) is NaN. Subtract 0 instead of the max for such "
                    "a row: its weights are then exp2(-inf) = 0, its out 0, its lse -inf")
        if not (np.isneginf(got_l) and np.all(got_o == 0)):
            return (f"{what} gives lse {got_l:.4g} and out {got_o[:3]}...: it must stay "
                    "(out 0, lse -inf)")
        return None
    if not (np.isfinite(got_l) and np.isfinite(got_o).all()):
        return (f"{what} gives lse {got_l} and non-finite outputs: an exponential overflowed. "
                "Subtract the larger lse before exponentiating (the stable form): exp2((lse_i "
                "- max) log2 e) is at most 1")
    if abs(got_l - want_l) > 1e-4 * max(1.0, abs(want_l)):
        if log2_units_hint and abs(got_l - want_l * LOG2_E) < 1e-3 * max(1.0, abs(want_l)):
            return (f"{what}: your lse is {got_l:.6g}, {want_l:.6g} times log2(e): you "
                    "return it in log2 units; multiply the log2 by ln 2")
        return f"{what}: the merged lse is {got_l:.6g}, it should be {want_l:.6g}"
    err = np.abs(got_o - want_o).max()
    if err > 1e-4 * max(1.0, np.abs(want_o).max()):
        ratio = (got_o @ want_o) / max(want_o @ want_o, 1e-30)
        if abs(ratio - 1) > 1e-3 and np.allclose(got_o, ratio * want_o, rtol=1e-3, atol=1e-5):
            return (f"{what}: out is {ratio:.4g} times the right row: the weights do not sum "
                    "to 1. Divide by their sum (once per row: multiply by its reciprocal)")
        return (f"{what}: out differs from the float64 merge by {err:.3g} (lse is right): "
                "check which weight multiplies which part")
    return None


def _check_pair_values(fn) -> None:
    """14.1 on this CPU: fn on the rows of ``merge_rows`` against float64."""
    _refuse_device_only(fn)
    rows, os_, lses = _merge_case(2)
    o, lse = run_pair_on_cpu(fn, os_[0], lses[0], os_[1], lses[1])
    want_o, want_l = merge_reference(os_, lses)
    for i, (what, _) in enumerate(rows):
        mistake = _row_mistake(what, o[i].astype(np.float64), float(lse[i]), want_o[i],
                               float(want_l[i]), lses=lses[:, i])
        if mistake:
            raise AssertionError(mistake)


def _check_step_values(fn, parts: int = 4) -> None:
    """14.2 on this CPU: fn as the step over ``parts`` partials per row, against float64."""
    _refuse_device_only(fn)
    rows, os_, lses = _merge_case(parts)
    o, lse = run_steps_on_cpu(fn, os_, lses)
    want_o, want_l = merge_reference(os_, lses)
    for i, (what, _) in enumerate(rows):
        mistake = _row_mistake(what, o[i].astype(np.float64), float(lse[i]), want_o[i],
                               float(want_l[i]), log2_units_hint=False, lses=lses[:, i])
        if mistake:
            if "do not sum" in mistake or "differs" in mistake:
                mistake = (f"{mistake}. The running acc must be rescaled by exp2((old max - "
                           "new max) log2 e) whenever the max grows, like the online softmax's O")
            raise AssertionError(mistake)


# --- compiled for sm_90a -------------------------------------------------------------------------
_SASS_CACHE: dict = {}


def _compile(kind: str, fn, parts: int = 4):
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    key = (kind, fn, parts)
    if key in _SASS_CACHE:
        return _SASS_CACHE[key]
    d = HEAD_DIM
    kernels = MergeKernels(pair=fn, head_dim=d) if kind == "pair" else \
        MergeKernels(step=fn, parts=parts, head_dim=d)
    rows = fake_tensor(Float32, (None, d), stride_order=(1, 0))
    lse = fake_tensor(Float32, (None,))
    if kind == "pair":
        art = compile_for("sm_90a", kernels.pair_launch, rows, lse, rows, lse, rows, lse,
                          fake_stream())
    else:
        parts_rows = fake_tensor(Float32, (parts, None, d), stride_order=(2, 1, 0))
        parts_lse = fake_tensor(Float32, (parts, None), stride_order=(1, 0))
        art = compile_for("sm_90a", kernels.step_launch, parts_rows, parts_lse, rows, lse,
                          fake_stream())
    _SASS_CACHE[key] = art
    return art


def _opcodes(sass: str) -> Counter:
    from solutions.ch06_exp2 import sass_opcodes

    return sass_opcodes(sass)


def merge_sass_facts(fn, kind: str = "pair", parts: int = 4) -> dict:
    """What the compiled kernel (one thread per row, D = 32) spends on the merge of a row."""
    art = _compile(kind, fn, parts)
    ops = _opcodes(art.sass)
    return {
        "row length D": HEAD_DIM,
        "partials per row": 2 if kind == "pair" else parts,
        "MUFU.EX2": sum(v for k, v in ops.items() if k.startswith("MUFU.EX2")),
        "MUFU.LG2": sum(v for k, v in ops.items() if k.startswith("MUFU.LG2")),
        "reciprocals and division calls": sum(v for k, v in ops.items()
                                              if k.startswith("MUFU.RCP") or k == "CALL.REL"
                                              or k.startswith("CALL")),
        "local memory": art.spills > 0 or any(k.frame_bytes for k in art.kernels),
    }


def _local_memory_mistake(facts: dict) -> str | None:
    if facts["local memory"]:
        return ("compiled for sm_90a, the row sits in local memory: index the tensors with "
                "compile-time indices (loops over cutlass.range_constexpr)")
    return None


def _pair_sass_mistake(facts: dict) -> str | None:
    d = facts["row length D"]
    if _local_memory_mistake(facts):
        return _local_memory_mistake(facts)
    if facts["MUFU.LG2"] > 1:
        return (f"compiled for sm_90a, your merge has {facts['MUFU.LG2']} MUFU.LG2 for a row "
                f"of {d}: the lse is one log per row, not one per element")
    if facts["MUFU.EX2"] > 2:
        return (f"compiled for sm_90a, your merge has {facts['MUFU.EX2']} MUFU.EX2 for a row "
                f"of {d}: the two weights are per row; compute them once, before the loop over "
                "the elements")
    if facts["reciprocals and division calls"] > 16:
        return (f"compiled for sm_90a, your merge divides per element "
                f"({facts['reciprocals and division calls']} reciprocals and division calls): "
                "take the reciprocal of the sum once and multiply")
    return None


def _step_sass_mistake(facts: dict) -> str | None:
    parts = facts["partials per row"]
    if _local_memory_mistake(facts):
        return _local_memory_mistake(facts)
    if facts["MUFU.LG2"] > 1:
        return ("compiled for sm_90a, your step takes a log: the step keeps row_max and row_sum; "
                "the log is taken once at the end (lse = row_max + log(row_sum))")
    if facts["MUFU.EX2"] > 2 * parts:
        return (f"compiled for sm_90a, {facts['MUFU.EX2']} MUFU.EX2 for {parts} partials: two "
                "exponentials per step (the rescale of the old state, the new part's weight), "
                "never one per element")
    if facts["reciprocals and division calls"] > 8:
        return ("compiled for sm_90a, your step divides: keep acc unnormalised (a sum of "
                "weighted outputs) and let the end divide once by row_sum")
    return None


def check_merge_pair(fn, compile_check: bool = True) -> None:
    """Exercise 14.1: the values on this CPU, then the SASS of one thread per row."""
    _check_pair_values(fn)
    if compile_check:
        mistake = _pair_sass_mistake(merge_sass_facts(fn, "pair"))
        if mistake:
            raise AssertionError(mistake)


def check_merge_step(fn, compile_check: bool = True) -> None:
    """Exercise 14.2: four partials per row on this CPU (three too, so a step that assumes a
    count is caught), then the SASS."""
    _check_step_values(fn, 4)
    _check_step_values(fn, 3)
    if compile_check:
        mistake = _step_sass_mistake(merge_sass_facts(fn, "step"))
        if mistake:
            raise AssertionError(mistake)


FORBID_MERGE = {
    ring.merge: "that is the ring's PyTorch merge; write the device code yourself",
    merge_step: "that is exercise 14.2's reference",
}
FORBID_STEP = {
    ring.merge: "that is the ring's PyTorch merge; write the device code yourself",
    merge_pair: "that is exercise 14.1's reference, a normalised merge; the step keeps the "
                "running state instead",
}


def _gpu_rows(rows: int, d: int, parts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lses = torch.randn(parts, rows, generator=g, dtype=torch.float64) * 20
    lses[:, ::7] = float("-inf")  # rows that saw no key anywhere
    lses[0, 3::11] = float("-inf")  # rows whose first part saw none
    lses[-1, 5::13] += 80.0  # a large lse arriving last
    os_ = torch.randn(parts, rows, d, generator=g, dtype=torch.float64)
    os_[torch.isneginf(lses)] = 0.0
    return os_, lses


def check_merge_on_gpu(pair=None, step=None, shapes=((1, 64), (300, 64), (1000, 64))):
    """14.1 (``pair``) or 14.2 (``step``) on a GPU: the compiled kernel on awkward row counts
    against float64. Returns (ok, one line per shape)."""
    from cutlass.cute.runtime import from_dlpack

    ok, lines = True, []
    for n, (rows, d) in enumerate(shapes):
        parts = 2 if pair is not None else 4
        os_, lses = _gpu_rows(rows, d, parts, 1400 + n)
        want_o, want_l = merge_reference(os_.numpy(), lses.numpy())
        dev = [t.float().cuda().contiguous() for t in (os_, lses)]
        o = torch.full((rows, d), float("nan"), device="cuda")
        lse = torch.full((rows,), float("nan"), device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        import cuda.bindings.driver as cuda_driver

        stream = cuda_driver.CUstream(stream)
        if pair is not None:
            k = MergeKernels(pair=pair, head_dim=d)
            args = [dev[0][0], dev[1][0], dev[0][1], dev[1][1], o, lse]
            k.pair_launch(*(from_dlpack(a) for a in args), stream)
        else:
            k = MergeKernels(step=step, parts=parts, head_dim=d)
            args = [dev[0], dev[1], o, lse]
            k.step_launch(*(from_dlpack(a) for a in args), stream)
        torch.cuda.synchronize()
        got_o, got_l = o.double().cpu().numpy(), lse.double().cpu().numpy()
        empty = np.isneginf(want_l)
        same_l = np.where(empty, np.isneginf(got_l), np.abs(got_l - want_l) <= 1e-4 *
                          np.maximum(1, np.abs(np.where(empty, 0, want_l))))
        err_o = float(np.abs(got_o - want_o).max())
        case_ok = bool(same_l.all()) and err_o < 1e-4 and np.isfinite(got_o).all()
        ok &= case_ok
        lines.append(f"rows={rows} d={d} parts={parts}: max |out - float64| {err_o:.2e}, lse "
                     f"{'right' if same_l.all() else 'WRONG'} -> {'ok' if case_ok else 'FAIL'}")
    return ok, lines


# ================================================================================================
# Exercise 14.3: the ring forward's loop (host Python; ranks as threads)
# ================================================================================================
def ring_loop(q, kv, comm, attend):
    """Exercise 14.3's reference: W steps; at each, start passing the K, V in hand on (all
    but the last step), attend to it, merge, then take the next piece."""
    out = lse = None
    for step in range(comm.world):
        src = (comm.rank - step) % comm.world
        handle = comm.exchange(kv) if step + 1 < comm.world else None
        o_b, l_b = attend(q, kv, src)
        out, lse = (o_b, l_b) if out is None else ring.merge(out, lse, o_b, l_b)
        if handle is not None:
            kv = handle.wait()
    return out, lse


class _Attend:
    """The checker's attend(q, kv, src): the float64 block function over the pieces of rank src,
    at their global offsets; it logs each call and checks that kv really is src's piece."""

    def __init__(self, threads: ring.ThreadRing, layout, full_kv, causal):
        self.threads, self.layout, self.full_kv, self.causal = threads, layout, full_kv, causal
        self.rank_of = {}

    def for_rank(self, rank):
        def attend(q, kv, src):
            self.threads.log(rank, "attend", src=src)
            want = self.layout.shard(self.full_kv, src, dim=2)
            if not (isinstance(kv, torch.Tensor) and kv.shape == want.shape
                    and torch.equal(kv, want)):
                holder = next((r for r in range(self.layout.world) if isinstance(kv, torch.Tensor)
                               and kv.shape == self.layout.shard(self.full_kv, r, dim=2).shape
                               and torch.equal(kv, self.layout.shard(self.full_kv, r, dim=2))),
                              None)
                raise AssertionError(
                    f"rank {rank} called attend(q, kv, src={src}) with the K, V of "
                    + (f"rank {holder}" if holder is not None else "no rank (a changed tensor)")
                    + ": at step s a rank holds the piece of rank (rank - s) mod W, and src must "
                    "name it")
            out = lse = None
            q_ranges = self.layout.local_ranges(rank)
            k_ranges = self.layout.local_ranges(src)
            b, _, h, _ = q.shape
            out = torch.zeros(q.shape, dtype=q.dtype)
            lse = torch.full((b, h, q.shape[1]), float("-inf"), dtype=q.dtype)
            for q_at, q_start, q_len in q_ranges:
                for k_at, k_start, k_len in k_ranges:
                    seen = ring.block_visibility((q_start, q_start + q_len),
                                                 (k_start, k_start + k_len), self.causal)
                    if seen == "none":
                        continue
                    o_b, l_b = ring.block_forward(q[:, q_at:q_at + q_len],
                                                  kv[0][:, k_at:k_at + k_len],
                                                  kv[1][:, k_at:k_at + k_len], q_start, k_start,
                                                  seen == "some")
                    o_m, l_m = ring.merge(out[:, q_at:q_at + q_len], lse[..., q_at:q_at + q_len],
                                          o_b, l_b)
                    out[:, q_at:q_at + q_len], lse[..., q_at:q_at + q_len] = o_m, l_m
            return out, lse

        return attend


def _order_mistake(events: list, rank: int, world: int) -> str | None:
    kinds = [e[0] for e in events]
    sends = [i for i, k in enumerate(kinds) if k == "exchange"]
    attends = [i for i, k in enumerate(kinds) if k == "attend"]
    waits = [i for i, k in enumerate(kinds) if k == "wait"]
    if len(attends) != world:
        return (f"rank {rank} called attend {len(attends)} times for {world} ranks: once per "
                "step, one step per piece of K, V")
    if len(sends) > world - 1:
        return (f"rank {rank} started {len(sends)} exchanges for {world} ranks: W - 1 are "
                "enough; at the last step no next piece is needed, and a send nobody receives "
                "is wasted traffic")
    if len(sends) < world - 1 or len(waits) < world - 1:
        return (f"rank {rank} started {len(sends)} exchanges and waited {len(waits)} times for "
                f"{world} ranks: each of the first W - 1 steps passes its piece on")
    for step in range(world - 1):
        if sends[step] > attends[step]:
            return (f"rank {rank}, step {step}: attend ran before the exchange was started, so "
                    "the transfer waits for the compute instead of running beside it. Start "
                    "the exchange first, then attend")
        if waits[step] < attends[step]:
            return (f"rank {rank}, step {step}: it waited for the next piece before attending "
                    "to the one in hand, so nothing overlaps: the transfer's whole time is "
                    "exposed. Wait after the attend")
    return None


def check_ring_loop(fn) -> None:
    """Exercise 14.3: ``fn`` on W = 3 and 4 ranks (threads), causal and not, zigzag chunks of
    uneven length, against one process in float64; then the order of its exchanges, attends
    and waits on every rank."""
    for world, case in ((3, ring.Case(1, 23, 2, 1, 8, True, 31)),
                        (4, ring.Case(2, 20, 2, 2, 4, False, 32)),
                        (4, ring.Case(1, 29, 2, 2, 4, True, 33))):
        q, k, v, _ = case.inputs()
        layout = ring.zigzag_layout(case.s, world)
        threads = ring.ThreadRing(world, timeout=5.0)
        attend = _Attend(threads, layout, torch.stack((k, v)), case.causal)

        def rank_fn(comm, layout=layout, q=q, attend=attend, k=k, v=v):
            kv = torch.stack((layout.shard(k, comm.rank), layout.shard(v, comm.rank)))
            return fn(layout.shard(q, comm.rank), kv, comm, attend.for_rank(comm.rank))

        try:
            results = threads.run(rank_fn)
        except ring.RingTimeout as exc:
            raise AssertionError(f"{world} ranks: {exc}") from None
        ref_out, ref_lse = ring.reference_attention(q, k, v, causal=case.causal)
        for rank, res in enumerate(results):
            assert isinstance(res, tuple) and len(res) == 2, (
                f"rank {rank} returned {type(res).__name__}: return (out, lse)")
            out, lse = res
            want_out, want_lse = layout.shard(ref_out, rank), layout.shard(ref_lse, rank, dim=2)
            if not torch.allclose(lse, want_lse, atol=1e-10):
                raise AssertionError(
                    f"{world} ranks, causal={case.causal}: rank {rank}'s lse differs from one "
                    "process's by " + f"{float((lse - want_lse).abs().nan_to_num(1e9).max()):.3g}"
                    ": every piece must be merged into the result exactly once")
            if not torch.allclose(out, want_out, atol=1e-10):
                raise AssertionError(
                    f"{world} ranks: rank {rank}'s lse is right but its out differs by "
                    f"{float((out - want_out).abs().max()):.3g}")
        for rank in range(world):
            mistake = _order_mistake(threads.events[rank], rank, world)
            if mistake:
                raise AssertionError(mistake)


FORBID_RING_LOOP = {
    ring.ring_forward: "that is the chapter's ring; write the loop yourself",
    ring.launch: "the check runs your loop on threads; it starts no process",
}


# ================================================================================================
# Exercise 14.4: the causal chunk assignment
# ================================================================================================
def zigzag_chunks(world: int) -> list[tuple[int, int]]:
    """Exercise 14.4's reference: of 2W chunks, rank r holds r and 2W-1-r."""
    return [(r, 2 * world - 1 - r) for r in range(world)]


def chunk_work(chunks) -> float:
    """Causal work of a rank holding these chunks (of equal length): chunk c sees c whole
    chunks and half of its own, in units of one chunk x chunk block."""
    return sum(c + 0.5 for c in chunks)


def check_zigzag(fn) -> None:
    """Exercise 14.4: for W = 1..8, every chunk held once, two per rank, and every rank the same
    causal work; an unbalanced rank is named."""
    for world in range(1, 9):
        got = fn(world)
        assert isinstance(got, (list, tuple)) and len(got) == world, (
            f"W = {world}: return one pair of chunk indices per rank ({world} pairs), got "
            f"{got!r}")
        held = [c for pair in got for c in pair]
        assert all(len(pair) == 2 for pair in got), (
            f"W = {world}: every rank holds exactly two chunks, got {got!r}")
        bad = [c for c in held if not (isinstance(c, int) and 0 <= c < 2 * world)]
        assert not bad, (f"W = {world}: chunk indices run from 0 to 2W - 1 = {2 * world - 1}, "
                         f"got {bad}")
        counts = Counter(held)
        twice = sorted(c for c, n in counts.items() if n > 1)
        assert not twice, (f"W = {world}: chunks {twice} are held by more than one rank and "
                           f"{sorted(set(range(2 * world)) - set(held))} by none")
        work = [chunk_work(pair) for pair in got]
        if max(work) != min(work):
            hi, lo = int(np.argmax(work)), int(np.argmin(work))
            raise AssertionError(
                f"W = {world}: rank {hi} (chunks {tuple(got[hi])}) does {work[hi]:g} blocks of "
                f"causal work and rank {lo} (chunks {tuple(got[lo])}) {work[lo]:g}: the ring "
                f"waits for rank {hi} at every step. Pair an early chunk with a late one so "
                "that every rank's two chunk indices add up to the same number")


FORBID_ZIGZAG = {
    ring.zigzag_layout: "that is the chapter's layout; work the assignment out yourself",
    ring.split_even: "this exercise is about which chunks, not their lengths",
}


# ================================================================================================
# Models the notebook prints (labelled: datasheet figures and the course's arithmetic)
# ================================================================================================
# datasheet figures (NVLink: 900 GB/s per GPU in both directions together)
H200 = {"hbm_gb": 141, "bf16_tflops": DATASHEET_DENSE_BF16_TFLOPS["sm_90"],
        "nvlink_gb_s_each_way": 450}
MODEL = {"layers": 32, "heads": 32, "heads_kv": 8, "head_dim": 128, "hidden": 4096}  # an 8B-class


def one_gpu_budget(seqlen: int, m: dict = MODEL, gpu: dict = H200) -> list[str]:
    """The arithmetic of why one GPU runs out at ``seqlen`` tokens, as printed lines."""
    h, hk, d, layers = m["heads"], m["heads_kv"], m["head_dim"], m["layers"]
    qkvo = seqlen * (2 * h + 2 * hk) * d * 2  # bf16 Q, K, V, O of one layer, kept for backward
    layer_in = seqlen * m["hidden"] * 2  # the layer's input, all activation checkpointing keeps
    scores = seqlen * seqlen * 2  # one head's score matrix in bf16, if it were materialised
    fwd = 4 * seqlen**2 * h * d / 2  # causal: half the square
    step = layers * fwd * 3.5 / (gpu["bf16_tflops"] * 1e12)  # forward + backward (2.5x)
    return [
        f"S = {seqlen:,} tokens, {layers} layers, {h} heads ({hk} KV), D = {d} (model)",
        f"  Q, K, V, O of one layer, bf16: S x (2H + 2Hkv) x D x 2 B = {qkvo / 1e9:,.1f} GB; "
        f"all layers: {layers * qkvo / 1e9:,.0f} GB (H200: {gpu['hbm_gb']} GB, datasheet)",
        f"  only each layer's input (full activation checkpointing): S x {m['hidden']} x 2 B x "
        f"{layers} = {layers * layer_in / 1e9:,.0f} GB",
        f"  one head's score matrix, if it were stored: S^2 x 2 B = {scores / 1e9:,.0f} GB "
        "(FlashAttention never stores it)",
        f"  attention FLOPs of one layer, causal forward: 4 S^2 H D / 2 = {fwd:.2e}",
        f"  a training step's attention at {gpu['bf16_tflops']} TFLOP/s (datasheet peak): "
        f"{layers} layers x 3.5 (forward + backward) = {step:,.0f} s",
    ]


def strategies(seqlen: int, world: int, m: dict = MODEL) -> list[dict]:
    """Per rank and per layer (forward): bytes received, the K, V held at the peak, and the
    limit of each way of splitting attention over ``world`` ranks (model, bf16)."""
    h, hk, d = m["heads"], m["heads_kv"], m["head_dim"]
    local = seqlen // world
    kv_piece = local * 2 * hk * d * 2  # one rank's K and V
    return [
        {"way": "all-gather K, V", "received_mb": (world - 1) * kv_piece / 1e6,
         "kv_held_mb": world * kv_piece / 1e6, "messages": "1 collective",
         "limit": "holds the whole K, V: memory grows with S, not S/W"},
        {"way": "ring (this chapter)", "received_mb": (world - 1) * kv_piece / 1e6,
         "kv_held_mb": 2 * kv_piece / 1e6, "messages": f"{world - 1} steps, each hidden "
         "behind a block", "limit": "a block must take longer than its transfer"},
        {"way": "all-to-all over heads (Ulysses)",
         "received_mb": (world - 1) / world * local * (2 * h + 2 * hk) * d * 2 / 1e6,
         "kv_held_mb": seqlen * 2 * (hk // world if hk >= world else 1) * d * 2 / 1e6,
         "messages": "2 all-to-alls (before, after)",
         "limit": f"W <= KV heads ({hk}); each rank holds the whole sequence of its heads"},
    ]


def overlap_model(chunk: int, m: dict = MODEL, gpu: dict = H200, causal: bool = True,
                  tflops: float | None = None) -> dict:
    """One ring step of one layer's forward: the bytes a rank sends (its K, V piece, bf16) and
    the FLOPs it computes on the piece in hand, as times at datasheet rates (model)."""
    h, hk, d = m["heads"], m["heads_kv"], m["head_dim"]
    rate = (tflops or gpu["bf16_tflops"]) * 1e12
    nbytes = chunk * 2 * hk * d * 2
    flops = 4 * chunk * chunk * h * d * (0.5 if causal else 1.0)
    t_send = nbytes / (gpu["nvlink_gb_s_each_way"] * 1e9)
    t_compute = flops / rate
    # compute / transfer grows linearly with the chunk: it hides the transfer above this chunk
    hides_above = chunk * t_send / t_compute
    return {"chunk": chunk, "bytes": nbytes, "flops": flops, "t_send_us": t_send * 1e6,
            "t_compute_us": t_compute * 1e6, "compute_over_send": t_compute / t_send,
            "hides_above_tokens": hides_above}


# ================================================================================================
# The CPU measurement (results/cpu/ring_cpu.json, measure/ring_cpu.py)
# ================================================================================================
RING_CPU = "ring_cpu"


def cpu_rows(res) -> dict:
    """{(metric, world): row} of the stored CPU ring run."""
    return {(r["metric"], r["world"]): r for r in res.rows}


def cpu_speedup(res, world: int) -> float:
    """The ring forward's time on 1 process over its time on ``world`` processes."""
    rows = cpu_rows(res)
    return rows[("fwd_ms", 1)]["value"] / rows[("fwd_ms", world)]["value"]


def cpu_hidden_share(res, world: int) -> float:
    """The share of the transfers' own time that the compute hid: 1 - (time waited with
    compute) / (time the same transfers take alone)."""
    rows = cpu_rows(res)
    alone = rows[("transfer_alone_ms", world)]["value"]
    waited = rows[("wait_ms", world)]["value"]
    return max(0.0, 1.0 - waited / alone) if alone > 0 else float("nan")


def cpu_verdict(res, world_a: int, world_b: int) -> str:
    """A sentence comparing the forward on ``world_b`` processes with ``world_a``, from the
    rounds: faster or slower only when the rounds' ranges do not overlap."""
    rows = cpu_rows(res)
    a, b = rows[("fwd_ms", world_a)], rows[("fwd_ms", world_b)]
    ratio = a["value"] / b["value"]
    if max(b["rounds"]) < min(a["rounds"]):
        word = "faster than"
    elif min(b["rounds"]) > max(a["rounds"]):
        word = "slower than"
    else:
        word = "within the rounds' spread of"
    return (f"{world_b} processes: {word} {world_a} (medians {b['value']:.0f} and "
            f"{a['value']:.0f} ms, ratio {ratio:.2f}; rounds {b['rounds']} and {a['rounds']})")


@claim("14.cpu_four_beyond_two", RING_CPU,
       "on this 2-core CPU the ring forward on 4 gloo processes is faster than on 2, beyond the "
       "spread of the rounds", gpu="cpu")
def _four_faster(res):
    rows = cpu_rows(res)
    two, four = rows[("fwd_ms", 2)], rows[("fwd_ms", 4)]
    return max(four["rounds"]) < min(two["rounds"]), (
        f"2 processes {two['rounds']} ms, 4 processes {four['rounds']} ms")


@claim("14.cpu_wait_small", RING_CPU,
       "on 2 gloo processes the time waited for K, V is a small share (under a tenth) of the "
       "forward's time", gpu="cpu")
def _wait_small(res):
    rows = cpu_rows(res)
    fwd, wait = rows[("fwd_ms", 2)], rows[("wait_ms", 2)]
    return wait["value"] < 0.1 * fwd["value"], (f"waited {wait['value']:.3f} ms of a "
                                                 f"{fwd['value']:.1f} ms forward")


# ================================================================================================
# Pictures
# ================================================================================================
def plot_ring(world: int = 4, ax=None):
    """Which rank's K, V piece each rank holds at each step of the ring."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(1.3 * world + 1.5, 0.6 * world + 1))[1]
    grid = np.array([[(r - s) % world for s in range(world)] for r in range(world)])
    ax.imshow(grid, cmap="tab10", vmin=0, vmax=9, alpha=0.55)
    for r in range(world):
        for s in range(world):
            ax.text(s, r, f"KV{grid[r, s]}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(world), [f"step {s}" for s in range(world)])
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set_title(f"the ring, W = {world}: rank r holds the piece of rank (r - step) mod W")
    return ax


def plot_balance(world: int = 4, ax=None):
    """Causal work per rank: contiguous pieces against the zigzag assignment."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(6, 2.6))[1]
    seqlen = 64 * world
    contiguous = ring.visible_pairs(ring.contiguous_layout(seqlen, world))
    zigzag = ring.visible_pairs(ring.zigzag_layout(seqlen, world))
    x = np.arange(world)
    ax.bar(x - 0.2, contiguous, 0.4, label="contiguous pieces")
    ax.bar(x + 0.2, zigzag, 0.4, label="zigzag: chunks r and 2W-1-r")
    ax.set_xticks(x, [f"rank {r}" for r in range(world)])
    ax.set_ylabel("causal work\n(chunk x chunk blocks)")
    ax.legend(fontsize=8)
    return ax


def computed_scores(seqlen: int, world: int, causal: bool = True) -> dict:
    """Scores the ring's block function computes (a block the mask cuts is computed whole, then
    masked): the slowest rank's, all ranks' together, and the scores the mask keeps."""
    layout = ring.zigzag_layout(seqlen, world)
    per_rank = []
    for rank in range(world):
        n = 0
        for qa, qb in layout.ranges[rank]:
            for ka, kb in (r for ranges in layout.ranges for r in ranges):
                if ring.block_visibility((qa, qb), (ka, kb), causal) != "none":
                    n += (qb - qa) * (kb - ka)
        per_rank.append(n)
    kept = seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
    return {"world": world, "slowest_rank": max(per_rank), "all_ranks": sum(per_rank),
            "kept": kept}
