"""Chapter 11, exercise 11.5: the pointwise middle of a backward step, in device code.

Between the GEMMs of a step, each thread of fa4_final's Hopper backward turns its share of S^T
into P^T and its share of dP^T into dS^T, in registers (keys on the rows, queries on the
columns: Note [Why S^T] in the chapter). The learner writes that part as a ``@cute.jit``
function of the thread's fragments:

    ds_step(s, dp, lse, delta, scale_log2, wait_dp, mask)

and it is checked three ways:

- on the CPU, lane by lane: the function runs as plain Python on every one of the 256 MMA
  threads' fragments (the wgmma accumulator layout: thread t of warpgroup g holds keys
  64 g + 16 (t // 32) + (t % 32) // 4 + 8 r and queries 8 (c // 2) + 2 (t % 4) + c % 2), with
  MUFU's ex2 for ``cute.math.exp2``; the tiles it makes are held against float64 and every
  difference is named (natural exp, a scale forgotten, the LSE converted twice, the mask
  flipped or off by one on the diagonal, keys past seqlen_k, delta outside the bracket, dP^T
  read before its GEMM finished);
- compiled for sm_90a inside fa4_final's Hopper backward (``HopperDsStep``, a course subclass
  whose ``step`` is the kernel's own with the pointwise part replaced): no spills, one MUFU.EX2
  per score in every copy of the step, FSEL only where the step is masked;
- on a GPU (``check_ds_step_on_gpu``): the whole backward with it, against float64 autograd on
  awkward shapes.

fa4_final's ``HopperBackward.step`` does the pointwise part with ``_p_from_scores`` and
``_ds_from_dp`` (shared with the swapped step); ``HopperDsStep.step`` repeats the rest of that
method around the learner's function (so the subclass holds a copy of the step's GEMM
sequence: the seam fa4_final would need is one method ``pointwise(s, dp, lse, delta,
scale_log2, wait_dp, mask)`` called where those two are), and calls the kernel's own
``dq_to_warp`` for the hand-off of dQ.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warpgroup

from fa4_final.common.constants import THREADS_PER_WARPGROUP, WARP_SIZE
from fa4_final.common.fragments import acc_as_a_operand, acc_rows_cols
from fa4_final.hopper.bwd import MMA_THREADS, HopperBackward, NamedBarrier, _convert
from fa4_final.hopper.config import HopperBwdConfig, hopper_bwd_default

LOG2E = float(np.log2(np.e))


# ----------------------------------------------------------------------------------------------
# The reference


@cute.jit
def ds_step(s, dp, lse, delta, scale_log2, wait_dp, mask):
    """Exercise 11.5's reference: one thread's share of a step, keys on the rows.

    ``s`` (rows, cols): S^T = K Q^T of this thread, raw (not scaled); becomes P^T in place.
    ``dp`` (rows, cols): dP^T = V dO^T; becomes dS^T in place. Not ready until ``wait_dp()``.
    ``lse[r, c]``, ``delta[r, c]``: query column c's lse (log2 units; +inf for a query that sees
    no key) and delta, whatever r. ``scale_log2``: softmax scale x log2 e.
    ``wait_dp()``: hands P^T to the dV GEMM and waits for dP^T. ``mask``: None on a step whose
    pairs are all visible, else (coords, offset, seqlen_k, causal): ``coords[r, c]`` is the
    (key, query) of element (r, c); query i sees key j when j < seqlen_k and, if causal,
    j <= i + offset."""
    rows = cute.size(s, mode=[0])
    cols = cute.size(s, mode=[1])
    if const_expr(mask is not None):
        coords, offset, seqlen_k, causal = mask
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                key, query = coords[r, c]
                hidden = key >= seqlen_k
                if const_expr(causal):
                    hidden = hidden | (key > query + offset)
                s[r, c] = -Float32.inf if hidden else s[r, c]
    for c in cutlass.range_constexpr(cols):
        lse_c = lse[0, c]
        for r in cutlass.range_constexpr(rows):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - lse_c, fastmath=True)
    wait_dp()
    for c in cutlass.range_constexpr(cols):
        delta_c = delta[0, c]
        for r in cutlass.range_constexpr(rows):
            dp[r, c] = s[r, c] * (dp[r, c] - delta_c)


# ----------------------------------------------------------------------------------------------
# The kernel with the learner's pointwise step


class HopperDsStep(HopperBackward):
    """fa4_final.hopper.bwd.HopperBackward whose step runs ``ds_fn`` (exercise 11.5's
    signature) for the pointwise part; the rest of ``step`` is the kernel's own sequence. Causal
    or not, no sliding window (the learner's mask knows only the causal diagonal)."""

    def __init__(self, ds_fn, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.window.has_left or self.window.has_right:
            raise ValueError("exercise 11.5's kernel takes no sliding window")
        self.ds_fn = ds_fn

    def cache_key(self) -> tuple:
        return super().cache_key() + (("exercise 11.5", self.ds_fn),)

    @cute.jit
    def hand_over_p(self, acc_s, rP):
        """P^T -> the dV GEMM's A operand (16-bit), then wait for dP^T (wait_group 0)."""
        _convert(acc_as_a_operand(acc_s), rP)
        warpgroup.wait_group(0)

    @cute.jit
    def step(self, m_block, masked: cutlass.Constexpr[bool], wg, state_q, ops, acc_dv, acc_dk,
             shape_st, shape_a, sLSE, sDelta, thr_sdp, tScS, t0ScS, mma_sdp, mma_dkv,
             mma_dq, pipeline_q, pipeline_do, scale_log2, window_left, window_right, n_block,
             seqlen_q, seqlen_k):
        """HopperBackward.step with its mask, exponentials and dS replaced by ``ds_fn``."""
        (tSrK, tSrQ, tdPrV, tdPrdO, tdVrdO, tdKrQ, tdQrA, tdQrB, st_t, thr_st_t, tdSsdS, tdQsdQ,
         thr_dq) = ops
        stage = state_q.index
        ds_stage = stage if const_expr(self.cfg.stages_ds > 1) else 0
        pipeline_q.consumer_wait(state_q)
        acc_s = cute.make_rmem_tensor(shape_st, Float32)
        self.wgmma(mma_sdp, acc_s, tSrK, tSrQ[None, None, None, stage], False)  # S^T = K Q^T
        pipeline_do.consumer_wait(state_q)
        acc_dp = cute.make_rmem_tensor(shape_st, Float32)
        self.wgmma(mma_sdp, acc_dp, tdPrV, tdPrdO[None, None, None, stage], False)  # dP^T
        lse = self.column_values(thr_sdp, sLSE, stage)
        warpgroup.wait_group(1)  # S^T is ready; dP^T may still run
        rP = cute.make_rmem_tensor(shape_a, self.dtype)
        delta = self.column_values(thr_sdp, sDelta, stage)
        mask = None
        if const_expr(masked):
            # (key, query) of each element: the tile's origin plus the fragment's coordinates
            coords = cute.domain_offset((n_block * self.tile_n, m_block * self.tile_m), tScS)
            mask = (coords, seqlen_k - seqlen_q, seqlen_k, self.causal)
        self.ds_fn(acc_rows_cols(acc_s), acc_rows_cols(acc_dp), lse, delta, scale_log2,
                   lambda: self.hand_over_p(acc_s, rP), mask)
        rdS = cute.make_rmem_tensor(shape_a, self.dtype)
        _convert(acc_as_a_operand(acc_dp), rdS)
        if const_expr(self.cfg.stages_ds == 1):  # the other warpgroup's last dQ GEMM read dS
            cute.arch.barrier(barrier_id=int(NamedBarrier.DS_FREE), number_of_threads=MMA_THREADS)
        cute.copy(st_t, thr_st_t.retile(rdS), tdSsdS[None, None, None, ds_stage])
        self.wgmma(mma_dkv, acc_dv, rP, tdVrdO[None, None, None, stage], True)  # dV += P^T dO
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.DS_READY), number_of_threads=MMA_THREADS)
        acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C(self.dq_tile_shape()), Float32)
        if const_expr(self.cfg.dq_swap_ab):
            self.wgmma(mma_dq, acc_dq, tdQrA, tdQrB[None, None, None, ds_stage], False)
        else:
            self.wgmma(mma_dq, acc_dq, tdQrA[None, None, None, ds_stage], tdQrB, False)
        warpgroup.wait_group(1)  # dV done: dO's stage is free
        self.release(pipeline_do, state_q)  # the kernel's own release (every thread)
        self.wgmma(mma_dkv, acc_dk, rdS, tdKrQ[None, None, None, stage], True)  # dK += dS^T Q
        warpgroup.wait_group(1)  # dQ done
        self.dq_to_warp(acc_dq, tdQsdQ, wg)  # the kernel's own hand-off to the dQ warp
        warpgroup.wait_group(0)  # dK done: Q's stage is free
        self.release(pipeline_q, state_q)
        state_q.advance()
        return state_q


def fake_backward_args(head_dim: int) -> dict:
    """The backward kernels' fake arguments (role -> tuple), bf16: symbolic batch, lengths,
    heads (fa4_final's own)."""
    from fa4_final.common.backward import fake_backward_args

    return fake_backward_args("bf16", head_dim)


def compile_for(kernel, role: str, head_dim: int, arch: str, keep: bool = True):
    """(compiled, artifacts) of one backward kernel object (``role``: pre, main or post)."""
    from fa4_final.runtime.compile import compile_kernel

    return compile_kernel(kernel, *fake_backward_args(head_dim)[role], arch=arch, keep=keep)


_BUILDS: dict = {}


def compile_ds_step(ds_fn, head_dim: int = 128, causal: bool = True,
                    config: HopperBwdConfig | None = None):
    """The main backward kernel with ``ds_fn`` compiled for sm_90a (fake tensors, no GPU)."""
    cfg = config or hopper_bwd_default(head_dim, causal)
    key = (ds_fn, head_dim, causal, cfg)
    if key not in _BUILDS:
        kernel = HopperDsStep(ds_fn, cutlass.BFloat16, head_dim, causal, cfg)
        _BUILDS[key] = compile_for(kernel, "main", head_dim, "sm_90a")[1]
    return _BUILDS[key]


# ----------------------------------------------------------------------------------------------
# The step on the CPU, thread by thread

TILE_N = 128  # keys of a CTA: 64 per MMA warpgroup
MMA_THREADS_ALL = 2 * THREADS_PER_WARPGROUP


def fragment_key(thread: int, r: int) -> int:
    """The key (row of the CTA's S^T tile) of element row ``r`` of MMA thread ``thread``: the
    wgmma accumulator layout, warpgroup g = thread // 128 owning keys 64 g .. 64 g + 63."""
    g, t = divmod(thread, THREADS_PER_WARPGROUP)
    return 64 * g + 16 * (t // WARP_SIZE) + (t % WARP_SIZE) // 4 + 8 * r


def fragment_query(thread: int, c: int) -> int:
    """The query (column of the S^T tile) of element column ``c`` of MMA thread ``thread``."""
    return 8 * (c // 2) + 2 * (thread % 4) + c % 2


def fragment_layout_mismatches(threads=(0, 1, 5, 37, 100, 130, 200, 255)) -> list:
    """(thread, r, c) where ``fragment_key`` / ``fragment_query`` disagree with CuTe's own
    partition of the kernel's S^T accumulator (two warpgroups, 64 x 64 each): empty when the
    emulation's layout is the kernel's. Host-side CuTe (launches nothing); needs
    CUTE_DSL_ARCH=sm_90a in the environment when no Hopper GPU is present."""
    import cutlass.utils.hopper_helpers as sm90_utils

    from fa4_final.common.mask import fragment_coords

    seen = {}

    @cute.jit
    def probe():
        major = cute.nvgpu.OperandMajorMode
        mma = sm90_utils.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, major.K,
                                                major.K, Float32, (2, 1, 1), (64, 64))
        for i in cutlass.range_constexpr(len(threads)):
            coords, _ = fragment_coords(mma.get_slice(threads[i]), (TILE_N, 64))
            seen[threads[i]] = [[coords[r, c] for c in range(16)] for r in range(2)]

    probe()
    return [(t, r, c) for t, rows in seen.items() for r in range(2) for c in range(16)
            if tuple(rows[r][c]) != (fragment_key(t, r), fragment_query(t, c))]


@dataclass
class StepCase:
    """One step of a CTA on the CPU: the raw S^T and dP^T tiles (TILE_N keys x tile_m queries,
    float32), each query's lse (log2 units, +inf where it sees no key or is padding) and delta,
    where the tile sits (n_block, m_block) and the lengths that decide the mask."""

    what: str
    s: np.ndarray
    dp: np.ndarray
    lse: np.ndarray
    delta: np.ndarray
    scale_log2: float
    n_block: int
    m_block: int
    seqlen_q: int
    seqlen_k: int
    causal: bool
    masked: bool

    @property
    def tile_m(self) -> int:
        return self.s.shape[1]

    def keys(self) -> np.ndarray:
        return self.n_block * TILE_N + np.arange(TILE_N)[:, None]

    def queries(self) -> np.ndarray:
        return self.m_block * self.tile_m + np.arange(self.tile_m)[None, :]

    def visible(self) -> np.ndarray:
        """(keys, queries) bool: query i sees key j (j < seqlen_k; j <= i + offset if causal)."""
        vis = np.broadcast_to(self.keys() < self.seqlen_k, self.s.shape).copy()
        if self.causal:
            vis &= self.keys() <= self.queries() + (self.seqlen_k - self.seqlen_q)
        return vis

    def reference(self) -> tuple[np.ndarray, np.ndarray]:
        """(P^T, dS^T) in float64."""
        s = self.s.astype(np.float64) * self.scale_log2 - self.lse.astype(np.float64)[None, :]
        p = np.where(self.visible(), np.exp2(np.where(self.visible(), s, -np.inf)), 0.0)
        return p, p * (self.dp.astype(np.float64) - self.delta.astype(np.float64)[None, :])


def step_cases(tile_m: int = 64, seed: int = 11) -> list[StepCase]:
    """Steps of a key tile: one that needs no mask; the causal diagonal (seqlen_q = seqlen_k);
    the diagonal with seqlen_k - seqlen_q = 37 and query rows past seqlen_q (padding, lse =
    +inf); the last key tile, partly past seqlen_k, without a causal mask; a causal tile whose
    first queries see none of its keys."""
    g = np.random.default_rng(seed)
    scale_log2 = 128 ** -0.5 * LOG2E
    out = []
    for what, n_block, m_block, sq, sk, causal, masked in (
            ("a step that needs no mask", 1, 5, 512, 512, True, False),
            ("the causal diagonal, seqlen_q = seqlen_k = 512", 2, 4, 512, 512, True, True),
            ("the diagonal with seqlen_q = 300, seqlen_k = 337 (rows past 300 are padding)",
             2, 4, 300, 337, True, True),
            ("the last key tile, keys 256-383 of seqlen_k = 300, no causal mask", 2, 1, 200,
             300, False, True),
            ("a causal key tile whose first queries see none of its keys (seqlen_q = 600, "
             "seqlen_k = 500)", 3, 7, 600, 500, True, True)):
        s = (g.standard_normal((TILE_N, tile_m)) * 6).astype(np.float32)
        dp = g.standard_normal((TILE_N, tile_m)).astype(np.float32)
        delta = g.standard_normal(tile_m).astype(np.float32)
        case = StepCase(what, s, dp, np.zeros(tile_m, np.float32), delta, scale_log2, n_block,
                        m_block, sq, sk, causal, masked)
        vis = case.visible() if masked else np.ones(s.shape, bool)
        lse = np.full(tile_m, np.inf, np.float32)
        for c in range(tile_m):
            if vis[:, c].any() and case.queries()[0, c] < sq:  # its row max, plus other tiles
                lse[c] = np.float32(np.log2(np.exp2(s[vis[:, c], c] * scale_log2).sum())
                                    + g.uniform(0.0, 3.0))
        case.lse = lse
        out.append(case)
    return out


class _NotReady:
    """dP^T of one thread before wait_dp(): its GEMM may still be writing it."""

    def __init__(self, a: np.ndarray, trace: dict):
        self.a, self.trace, self.shape = a, trace, a.shape

    def _ready(self, what: str):
        if not self.trace["waited"]:
            raise AssertionError(
                f"you {what} dP^T before calling wait_dp(): its GEMM (V dO^T) may still be "
                "writing those registers. Compute P^T first, then wait_dp(), then dS^T")

    def __getitem__(self, key):
        self._ready("read")
        return self.a[key]

    def __setitem__(self, key, value):
        self._ready("wrote")
        self.a[key] = value


class _Coords:
    """coords[r, c] -> (key, query) of one thread's element (r, c), as Int32s."""

    def __init__(self, thread: int, case: StepCase):
        self.thread, self.case = thread, case
        self.shape = (2, case.tile_m // 4)

    def __getitem__(self, key):
        r, c = key
        k = self.case.n_block * TILE_N + fragment_key(self.thread, r)
        q = self.case.m_block * self.case.tile_m + fragment_query(self.thread, c)
        return np.int32(k), np.int32(q)


@dataclass
class StepTrace:
    """What the step did on every thread, assembled into the tile: P^T as handed to the dV
    GEMM at wait_dp() (None where a thread never called it), P^T and dS^T at the end."""

    handed: np.ndarray
    p: np.ndarray
    ds: np.ndarray
    waits: list


def _lane_exp(x, fastmath=False, **_) -> np.float32:
    return np.float32(np.exp(np.float64(np.float32(x))))


def emulate_ds_step(fn, case: StepCase) -> StepTrace:
    """Run ``fn`` (exercise 11.5's signature) as plain Python on each MMA thread's fragment of
    ``case`` and assemble the tiles it makes."""
    import sys

    from solutions.ch06_exp2 import swapped
    from solutions.ch07_rescaling import _lane_types, _make_rmem, _size, lane_ex2
    from utils.host_emulation import _const_expr, _PyRange

    swap = {cute.math.exp2: lane_ex2, cute.math.exp: _lane_exp, cute.size: _size,
            cute.make_rmem_tensor: _make_rmem,
            cutlass.range: _PyRange,
            cutlass.range_constexpr: _PyRange, cutlass.const_expr: _const_expr,
            **_lane_types()}
    modules = [sys.modules[__name__], cute, cute.math, cutlass]
    clone, patches = swapped(fn, swap, modules)
    cols = case.tile_m // 4
    handed = np.full(case.s.shape, np.nan, np.float32)
    p = np.zeros(case.s.shape, np.float32)
    ds = np.zeros(case.s.shape, np.float32)
    waits = []
    mask = None
    for t in range(MMA_THREADS_ALL):
        keys = [fragment_key(t, r) for r in range(2)]
        queries = [fragment_query(t, c) for c in range(cols)]
        s_t = case.s[np.ix_(keys, queries)].copy()
        trace = {"waited": 0}
        dp_t = _NotReady(case.dp[np.ix_(keys, queries)].copy(), trace)
        lse_t = np.broadcast_to(case.lse[queries][None, :], (2, cols))
        delta_t = np.broadcast_to(case.delta[queries][None, :], (2, cols))

        def wait_dp(s_t=s_t, trace=trace, keys=keys, queries=queries):
            trace["waited"] += 1
            if trace["waited"] == 1:
                handed[np.ix_(keys, queries)] = s_t

        if case.masked:
            mask = (_Coords(t, case), np.int32(case.seqlen_k - case.seqlen_q),
                    np.int32(case.seqlen_k), case.causal)
        with patches(), np.errstate(all="ignore"):
            clone(s_t, dp_t, lse_t, delta_t, np.float32(case.scale_log2), wait_dp, mask)
        waits.append(trace["waited"])
        p[np.ix_(keys, queries)] = s_t
        ds[np.ix_(keys, queries)] = dp_t.a
    return StepTrace(handed, p, ds, waits)


def _where(case: StepCase, bad: np.ndarray) -> str:
    """'key j, query i' of the first True element of ``bad`` (tile coordinates made global)."""
    r, c = np.argwhere(bad)[0]
    return f"key {case.n_block * TILE_N + r}, query {case.m_block * case.tile_m + c}"


def _close(a, b, rtol=2e-5, atol=1e-6) -> np.ndarray:
    return np.isclose(a, b, rtol=rtol, atol=atol) | (np.isnan(a) & np.isnan(b))


def _p_mistake(case: StepCase, p: np.ndarray) -> str | None:
    """The first thing wrong with P^T as the learner made it, in words."""
    want, _ = case.reference()
    if np.isnan(p).any():
        return (f"{case.what}: NaN in P^T at {_where(case, np.isnan(p))}. A query that sees no "
                "key has lse = +inf and its masked scores -inf: 2^(-inf - inf) = 0, but "
                "-inf * 0 or inf - inf make NaN")
    ok = _close(p, want)
    if ok.all():
        return None
    vis = case.visible() if case.masked else np.ones(p.shape, bool)
    s = case.s.astype(np.float64)
    lse = case.lse.astype(np.float64)[None, :]
    with np.errstate(all="ignore"):
        alternatives = [
            (np.exp(s * case.scale_log2 - lse), "P^T = 2^(s * scale_log2 - lse): the scores "
             "and the lse are in log2 units, so the exponential is exp2, not exp"),
            (np.exp2(s - lse), "multiply the raw score by scale_log2 (softmax scale x log2 e) "
             "before subtracting the lse: S^T arrives unscaled"),
            (np.exp2(s * case.scale_log2 - lse * LOG2E), "the lse is already in log2 units "
             "(bwd_pre converted it): subtract it as it is, without another log2 e"),
            (np.exp2((s - lse) * case.scale_log2), "only the score takes scale_log2; the lse "
             "is subtracted after the multiplication (one FFMA: s * scale_log2 - lse)"),
        ]
    for alt, why in alternatives:
        if _close(np.where(vis, p, 0), np.where(vis, alt, 0)).all():
            return f"{case.what}: {why}"
    seen = p > 0
    on = want > 0
    keys, queries = case.keys(), case.queries()
    offset = case.seqlen_k - case.seqlen_q
    extra = seen & ~vis
    missing = ~seen & on
    if extra.any():
        past = extra & (keys >= case.seqlen_k)
        if past.all() or (past.any() and not (extra & ~past).any()):
            return (f"{case.what}: P^T is not 0 at {_where(case, past)}, a key past seqlen_k = "
                    f"{case.seqlen_k}: the last key tile's rows past the sequence hold no key "
                    "(TMA filled them with zeros) and must be masked too, causal or not")
        return (f"{case.what}: P^T is not 0 at {_where(case, extra)}, which that query must not "
                f"see. With keys on the rows, key j is hidden from query i when j > i + "
                f"offset (here offset = seqlen_k - seqlen_q = {offset}) or j >= seqlen_k")
    if missing.any():
        diag = missing & (keys == queries + offset)
        if diag.any() and not (missing & ~diag).any():
            return (f"{case.what}: P^T is 0 at {_where(case, diag)}, on the diagonal: query i "
                    f"sees key j = i + offset (j <= i + offset, not <); offset = {offset}")
        return (f"{case.what}: P^T is 0 at {_where(case, missing)}, a pair that is visible. "
                f"With keys on the rows, query i sees key j when j <= i + offset (offset = "
                f"{offset}) and j < seqlen_k: hide the rest, keep these")
    bad = ~ok & (p > 0) & vis
    if bad.any():  # the lse each wrong value implies: another query's?
        with np.errstate(all="ignore"):
            implied = s[bad] * case.scale_log2 - np.log2(p[bad].astype(np.float64))
        known = case.lse[np.isfinite(case.lse)].astype(np.float64)
        if known.size and np.mean(np.abs(implied[:, None] - known[None, :]).min(1) < 1e-3) > 0.9:
            return (f"{case.what}: P^T at {_where(case, bad)} used another query's lse: each "
                    "column is a query with its own lse, lse[r, c] (or lse[0, c]) for column c")
    bad = ~ok
    return (f"{case.what}: P^T differs from 2^(s * scale_log2 - lse) at {_where(case, bad)} "
            f"(got {p[bad][0]:.6g}, want {want[bad][0]:.6g})")


def _ds_mistake(case: StepCase, p: np.ndarray, ds: np.ndarray) -> str | None:
    _, want = case.reference()
    if np.isnan(ds).any():
        return f"{case.what}: NaN in dS^T at {_where(case, np.isnan(ds))}"
    ok = _close(ds, want, atol=1e-5)
    if ok.all():
        return None
    p64 = p.astype(np.float64)
    dp = case.dp.astype(np.float64)
    delta = case.delta.astype(np.float64)[None, :]
    for alt, why in ((p64 * dp - delta, "delta is subtracted inside the bracket: "
                      "dS = P (dP - delta)"),
                     (dp - delta, "dS = P (dP - delta): multiply by P^T (the values you just "
                      "made in s)"),
                     (p64 * dp, "dS = P (dP - delta): delta is missing"),
                     (p64 * (dp + delta), "dS = P (dP - delta): subtract delta")):
        if _close(ds, alt, atol=1e-5).all():
            return f"{case.what}: {why}"
    bad = ~ok & (np.abs(p64) > 1e-6)
    if bad.any():  # the delta each wrong value implies: another query's?
        implied = dp[bad] - ds[bad].astype(np.float64) / p64[bad]
        known = case.delta.astype(np.float64)
        if np.mean(np.abs(implied[:, None] - known[None, :]).min(1) < 1e-3) > 0.9:
            return (f"{case.what}: dS^T at {_where(case, bad)} used another query's delta: "
                    "delta belongs to a query, the column: delta[r, c] (or delta[0, c])")
    return (f"{case.what}: dS^T differs from P (dP - delta) at {_where(case, ~ok)} (got "
            f"{ds[~ok][0]:.6g}, want {want[~ok][0]:.6g})")


def _forbid() -> dict:
    return {HopperBackward.step: "that is the package's step; write the pointwise part yourself",
            HopperBackward.mask: "that is the package's mask (with its compile-time columns); "
                                 "write the mask from coords"}


FORBID = _forbid()


def check_ds_step_rules(fn) -> None:
    """Exercise 11.5 on the CPU: ``fn`` on every MMA thread of each ``step_cases`` step; P^T as
    handed to the dV GEMM and dS^T against float64, each mistake named."""
    for case in step_cases():
        tr = emulate_ds_step(fn, case)
        waits = Counter(tr.waits)
        if waits.get(0):
            raise AssertionError(f"{case.what}: {waits[0]} threads never called wait_dp(): "
                                 "the dV GEMM never gets P^T and dP^T is never waited for")
        if any(w > 1 for w in tr.waits):
            raise AssertionError(f"{case.what}: a thread called wait_dp() "
                                 f"{max(tr.waits)} times; once, between P^T and dS^T")
        mistake = _p_mistake(case, tr.p)
        if mistake:
            raise AssertionError(mistake)
        if not _close(tr.handed, tr.p).all():
            raise AssertionError(
                f"{case.what}: the P^T handed to the dV GEMM at wait_dp() is not the final "
                "P^T: compute every exponential before calling wait_dp() (they overlap the "
                "dP^T GEMM), and leave s alone after it")
        mistake = _ds_mistake(case, tr.p, tr.ds)
        if mistake:
            raise AssertionError(mistake)


_rules = check_ds_step_rules  # (a private name: the workshop guide lists its messages too)


def step_facts(sass: str, cfg: HopperBwdConfig, head_dim: int) -> list[Counter]:
    """The instruction mix of each copy of the step in a compiled main kernel's SASS."""
    from solutions.ch11_teaching import gemms_per_step, step_mixes

    return step_mixes(sass, gemms_per_step(cfg, head_dim))


def check_ds_step(fn, compile_check: bool = True) -> None:
    """Exercise 11.5: ``check_ds_step_rules``, then fa4_final's Hopper backward compiled for
    sm_90a with ``fn`` in its step (D = 128, causal): no spills, one MUFU.EX2 per score in each
    copy of the step (the masked and the unmasked one), FSEL only in the masked copy."""
    _rules(fn)
    if not compile_check:
        return
    cfg = hopper_bwd_default(128, True)
    art = compile_ds_step(fn, 128, True, cfg)
    if art.spills:
        raise AssertionError(f"compiled for sm_90a, the kernel spills ({art.spills} local-memory "
                             "instructions): keep the step to the thread's own registers")
    per_thread = TILE_N * cfg.tile_m // MMA_THREADS_ALL
    mixes = step_facts(art.sass, cfg, 128)
    if len(mixes) != 2:
        raise AssertionError(f"compiled for sm_90a, the kernel has {len(mixes)} copies of the "
                             "step, not 2 (masked and unmasked): is the mask None-checked with "
                             "const_expr?")
    masked, plain = mixes
    for name, mix in (("masked", masked), ("unmasked", plain)):
        if mix.get("MUFU.EX2", 0) != per_thread:
            raise AssertionError(
                f"compiled for sm_90a, the {name} step has {mix.get('MUFU.EX2', 0)} MUFU.EX2 a "
                f"thread, not {per_thread} (one per score of its {per_thread}): use "
                "cute.math.exp2(..., fastmath=True) once per element")
    if plain.get("FSEL", 0):
        raise AssertionError("compiled for sm_90a, the unmasked step selects (FSEL): with "
                             "mask None every pair is visible, so nothing is masked there")
    if not masked.get("FSEL", 0):
        raise AssertionError("compiled for sm_90a, the masked step has no FSEL: the mask "
                             "selects nothing")


# ----------------------------------------------------------------------------------------------
# On a GPU: the whole backward with the learner's function, against float64


class ExerciseBackward:
    """The backward's three launches (fa4_final's bwd_pre and bwd_post around an exercise's main
    kernel object), compiled for sm_90a and run on torch tensors: the runner of the GPU
    checks. ``make_main(dtype, head_dim, causal, cfg)`` builds the main kernel."""

    def __init__(self, make_main, deterministic: bool = False):
        self.make_main, self.deterministic = make_main, deterministic
        self.plans: dict = {}

    def plan(self, dtype, head_dim: int, causal: bool):
        from dataclasses import replace

        from fa4_final.common.bwd_post import BackwardPost
        from fa4_final.common.bwd_pre import BackwardPre

        key = (dtype, head_dim, causal)
        if key not in self.plans:
            cfg = replace(hopper_bwd_default(head_dim, causal), deterministic=self.deterministic)
            main = self.make_main(dtype, head_dim, causal, cfg)
            kernels = {"pre": BackwardPre(dtype, head_dim, cfg.tile_m, self.deterministic),
                       "main": main, "post": BackwardPost(main)}
            self.plans[key] = (cfg, {role: compile_for(k, role, head_dim, "sm_90a",
                                                        keep=False)[0]
                                     for role, k in kernels.items()})
        return self.plans[key]

    def __call__(self, q, k, v, out, lse, dout, causal: bool):
        """(dq, dk, dv) of the forward's ``out``, ``lse`` (float32) and ``dout``."""
        import torch

        b, sq, h, d = q.shape
        cfg, kern = self.plan(cutlass.BFloat16 if q.dtype == torch.bfloat16
                              else cutlass.Float16, d, causal)
        m_blocks = -(-sq // cfg.tile_m)
        lse2 = q.new_empty((b, h, m_blocks * cfg.tile_m), dtype=torch.float32)
        delta = torch.empty_like(lse2)
        accum = q.new_empty((b, h, m_blocks * cfg.tile_m * d), dtype=torch.float32)
        turn = torch.empty((b, h, m_blocks) if self.deterministic else (1, 1, 1),
                           dtype=torch.int32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        scale = d ** -0.5
        kern["pre"](out, dout, lse, lse2, delta, accum, turn)
        kern["main"](q, k, v, dout, lse2, delta, accum, dk, dv, turn, scale, 0, 0)
        kern["post"](accum, dq, scale)
        return dq, dk, dv


def reference_backward(q, k, v, dout, causal: bool):
    """(out in q's dtype, lse float32, float64 autograd (dq, dk, dv)) of plain attention."""
    import torch

    from solutions.ch11_backward import backward_reference
    from utils.reference import attention_reference

    out, lse = attention_reference(q, k, v, causal)
    grads = backward_reference(q, k, v, dout, causal)
    return out.to(q.dtype).contiguous(), lse.float().contiguous(), [
        g.to(q.device, torch.float64) for g in grads]


# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal): lengths off the tiles, seqlen_q
# above and below seqlen_k (rows that see no key), GQA, both head dims
GPU_CASES = [(1, 100, 130, 2, 1, 64, True), (1, 129, 129, 2, 2, 128, False),
             (2, 200, 333, 4, 2, 128, True), (1, 300, 77, 2, 1, 128, True),
             (1, 257, 513, 4, 4, 64, False), (1, 1000, 1000, 2, 2, 128, True)]


def gpu_case_lines(run, cases, repeat: bool = False, seed: int = 0) -> tuple[bool, list[str]]:
    """``run`` (an ExerciseBackward) on each case, on the out and lse of a float64 forward,
    against float64 autograd; with ``repeat`` also run twice and compared bit for bit.
    Returns (all passed, one line per case)."""
    import torch

    ok_all, lines = True, []
    for b, sq, sk, h, hk, d, causal in cases:
        g = torch.Generator().manual_seed(seed)
        q, k, v, dout = (torch.randn(b, s, n, d, generator=g).to("cuda", torch.bfloat16)
                         for s, n in ((sq, h), (sk, hk), (sk, hk), (sq, h)))
        out, lse, ref = reference_backward(q, k, v, dout, causal)
        grads = run(q, k, v, out, lse, dout, causal)
        errs = [(x.double() - r).abs().max().item() for x, r in zip(grads, ref)]
        scales = [r.abs().max().item() for r in ref]
        ok = all(e <= 2e-2 * max(s, 1.0) for e, s in zip(errs, scales))
        same = ""
        if repeat:
            again = run(q, k, v, out, lse, dout, causal)
            bitwise = all(torch.equal(x, y) for x, y in zip(grads, again))
            ok &= bitwise
            same = ", two runs bitwise equal" if bitwise else ", two runs DIFFER"
        ok_all &= ok
        lines.append(f"{'ok  ' if ok else 'FAIL'} b={b} sq={sq} sk={sk} h={h}/{hk} d={d} "
                     f"causal={causal}: max|err| dq {errs[0]:.1e} dk {errs[1]:.1e} dv "
                     f"{errs[2]:.1e}{same}")
    return ok_all, lines


def check_ds_step_on_gpu(fn, cases=None) -> tuple[bool, list[str]]:
    """Exercise 11.5 on a Hopper GPU: the backward with ``fn`` as its pointwise step."""
    run = ExerciseBackward(lambda dt, d, causal, cfg: HopperDsStep(fn, dt, d, causal, cfg))
    return gpu_case_lines(run, cases or GPU_CASES)
