"""Chapter 07, last section: a learnable sink, one more term in the softmax's denominator.

A learnable sink (gpt-oss's attention sinks; FA4's ``learnable_sink``, a float tensor of shape
(num_heads,)) is one extra logit per query head, ``sink[h]`` in natural-log units, that joins
every row's denominator and carries no value:

    out_i = sum_j exp(s_ij - lse_i) v_j,     lse_i = log(exp(sink) + sum_j exp(s_ij))

so a row's probabilities sum to 1 - exp(sink - lse_i): the sink lets a head attend to nothing.

Note [Sink in the last step]
    After the last KV tile the kernel holds, per row, the max it subtracted m (log2 units: the
    scores were multiplied by scale * log2 e; with chapter 07's stale max, up to tau below the
    true max), l = sum_j 2^(s_j - m) and O = sum_j 2^(s_j - m) v_j. The sink's term, on the same
    footing, is 2^(sink log2 e - m): the sink converted to log2 units (it is not a score, so no
    softmax scale), minus the SAME m as l. Then

        T = l + 2^(sink log2 e - m),   out = O / T,   lse = ln 2 (m + log2 T).

    Every term carries the factor 2^-m, which cancels in O / T whatever m is: the stale max is
    as good as the true one, as long as l and the sink use the same one. The sink is added once,
    at the end: added at each of n tiles it would count n times (a sink of sink + ln n). A row
    that saw no key (m = -inf, l = 0, O = 0) has the sink as its only column: take the sink
    itself as the max, T = 1, out = 0, lse = sink (FA4's rule), never -inf - (-inf) = NaN.
    fa4_final does this in ``OnlineSoftmax.finalize`` and ``fold_sink`` (Note [Learnable sink]
    in fa4_final/common/softmax.py), where the kernel keeps the max in raw score units and
    multiplies it by scale_log2 there.

Exercise 07.5 (device code): ``finalize_with_sink(row_max, row_sum, sink)`` for one lane of
chapter 07's exercise warp (two whole rows per lane), returning (1/T, lse) per row. Checked with
no GPU: run lane by lane on the CPU on random, stale, empty and extreme rows against float64
(``check_finalize_with_sink``), compiled for sm_90a (one MUFU.EX2, one MUFU.LG2 and one MUFU.RCP
per row, no division subroutine, no local memory); on a Hopper GPU inside chapter 07's exercise
kernel (the reference step of exercise 07.3 with tau = 8, then ``fn``) on awkward shapes against
float64 (``check_finalize_with_sink_on_gpu``).
"""

from __future__ import annotations

import math
from collections import Counter

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32

from solutions import ch07_rescaling as ch07
from solutions.ch02_online_softmax import LN2 as LN_2
from solutions.ch02_online_softmax import LOG2E as LOG2_E

WARP, ROWS_PER_LANE, WARP_ROWS = ch07.WARP, ch07.ROWS_PER_LANE, ch07.WARP_ROWS
TILE_COLS, HEAD_DIM = ch07.TILE_COLS, ch07.HEAD_DIM


# ---------------------------------------------------------------------------------------------
# The idea on the CPU: where the sink's term goes, and against which max


def _logsumexp(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return (m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def reference_with_sink(scores: np.ndarray, v: np.ndarray, sink: float):
    """float64 attention of ``scores`` (rows, keys; log2 units, -inf where masked) with a sink
    logit ``sink`` (nats) in every row's denominator: (out (rows, d), lse (rows,), nats)."""
    nats = scores.astype(np.float64) * LN_2
    logits = np.concatenate([nats, np.full((nats.shape[0], 1), float(sink))], axis=1)
    lse = _logsumexp(logits, axis=1)
    with np.errstate(invalid="ignore"):
        p = np.exp(nats - lse[:, None])
    return p @ v.astype(np.float64), lse


def drift_scores(rows: int, keys: int, rise: float = 6.0, seed: int = 7) -> np.ndarray:
    """Scores (log2 units) that rise by ``rise`` < tau along the keys: visited first to last,
    each row's true max creeps up while the max in use stays at the first tile's."""
    g = np.random.default_rng(seed)
    return g.normal(0.0, 2.0, (rows, keys)) + np.linspace(0.0, rise, keys)


def stale_state(scores: np.ndarray, v: np.ndarray, tau: float = ch07.FA4_RESCALE_THRESHOLD,
                tile: int = 128):
    """Chapter 07's loop in float64 (rows decide alone against ``tau``), tiles first to last:
    (m_used, m_true, l, O, tiles) after the last tile."""
    rows, keys = scores.shape
    m_used = np.full(rows, -np.inf)
    l_sum, o = np.zeros(rows), np.zeros((rows, v.shape[1]))
    starts = range(0, keys, tile)
    for start in starts:
        s = scores[:, start:start + tile]
        m_new = np.fmax(m_used, s.max(axis=1))
        with np.errstate(invalid="ignore"):
            move = (m_new - m_used) > tau
        m_next = np.where(move, m_new, m_used)
        alpha = np.where(np.isfinite(m_used), np.exp2(m_used - m_next), 0.0)
        p = np.exp2(s - m_next[:, None])
        l_sum = alpha * l_sum + p.sum(axis=1)
        o = alpha[:, None] * o + p @ v[start:start + tile]
        m_used = m_next
    return m_used, scores.max(axis=1), l_sum, o, len(starts)


def sink_placements(rows: int = 64, keys: int = 2048, seed: int = 7) -> list[dict]:
    """Four ways to put a sink into chapter 07's finished state, against float64 softmax with
    the sink: the worst |out| and |lse| error of each, and how far the max in use lags the true
    max. The sink is chosen near the rows' own mass (each row's lse minus 1 nat)."""
    scores = drift_scores(rows, keys, seed=seed)
    v = np.random.default_rng(seed + 1).normal(0.0, 1.0, (keys, 8))
    m_used, m_true, l_sum, o, tiles = stale_state(scores, v)
    sink = float(np.median(_logsumexp(scores * LN_2, axis=1)) - 1.0)
    want_out, want_lse = reference_with_sink(scores, v, sink)
    sl2 = sink * LOG2_E
    ways = {
        "once, against the max in use (stale, as l)": (m_used, l_sum + np.exp2(sl2 - m_used)),
        "once, against the true max": (m_used, l_sum + np.exp2(sl2 - m_true)),
        f"at every tile ({tiles} tiles)": (m_used, l_sum + tiles * np.exp2(sl2 - m_used)),
        "once, in nats as if log2 (no log2 e)": (m_used, l_sum + np.exp2(sink - m_used)),
    }
    table = []
    for name, (m, total) in ways.items():
        out, lse = o / total[:, None], (m + np.log2(total)) * LN_2
        table.append({"where": name, "out error": float(np.abs(out - want_out).max()),
                      "lse error": float(np.abs(lse - want_lse).max())})
    lag = float((m_true - m_used).max())
    return [dict(r, sink=sink, lag=lag) for r in table]


def format_placements(table: list[dict]) -> str:
    head = (f"sink {table[0]['sink']:.2f} nats; the max in use lags the true max by up to "
            f"{table[0]['lag']:.2f} log2 units\n")
    lines = [f"{'the sink term added':44s} {'max |out err|':>14s} {'max |lse err|':>14s}"]
    lines += [f"{r['where']:44s} {r['out error']:14.2e} {r['lse error']:14.2e}" for r in table]
    return head + "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Exercise 07.5's reference


@cute.jit
def finalize_with_sink(row_max, row_sum, sink: Float32):
    """Exercise 07.5's reference (Note [Sink in the last step]): for this lane's rows, ``row_max``
    (the max subtracted, log2 units; -inf for a row that saw no key) and ``row_sum`` (l against
    it), with the head's ``sink`` logit (nats): returns (1 / T, lse), new register tensors,
    T = l + 2^(sink log2 e - m) and lse = ln 2 (m + log2 T)."""
    rows = cute.size(row_max)
    inv_sum = cute.make_rmem_tensor(rows, Float32)
    lse = cute.make_rmem_tensor(rows, Float32)
    sink_log2 = sink * Float32(LOG2_E)
    for r in cutlass.range_constexpr(rows):
        # a row that saw no key: the sink is its only column, so it is the max (T = 1)
        m = sink_log2 if row_max[r] == -Float32.inf else row_max[r]
        total = row_sum[r] + cute.math.exp2(sink_log2 - m, fastmath=True)
        inv_sum[r] = cute.arch.rcp_approx(total)
        lse[r] = (m + cute.math.log2(total, fastmath=True)) * Float32(LN_2)
    return inv_sum, lse


def _forbid():
    from fa4_final.common.softmax import OnlineSoftmax, fold_sink

    return {
        OnlineSoftmax.finalize: "that is the package's finalize; write your own",
        fold_sink: "that is the package's sink step; write your own",
        ch07.finalize: "that is exercise 07.1's PyTorch model, not device code",
        math.exp: "it runs on the host; in device code the exponential is cute.math.exp2",
        math.log: "it runs on the host; in device code the logarithm is cute.math.log2",
        np.exp: "it runs on the host; in device code the exponential is cute.math.exp2",
        np.log: "it runs on the host; in device code the logarithm is cute.math.log2",
    }


FORBID_SINK = _forbid()


# ---------------------------------------------------------------------------------------------
# One lane at a time on the CPU (no vote here, so no threads): the DSL's calls as float32 NumPy


def _lane_lg2(x, fastmath=False, **_) -> np.float32:
    """``lg2.approx.ftz.f32``: float32(log2 x); -inf at 0, NaN below."""
    with np.errstate(all="ignore"):
        return np.float32(np.log2(np.float64(np.float32(x))))


def _lane_rcp(x, **_) -> np.float32:
    """``rcp.approx.ftz.f32``: float32(1 / x); inf at 0, 0 at inf."""
    with np.errstate(all="ignore"):
        return np.float32(1.0 / np.float64(np.float32(x)))


def _lane_exp(x, fastmath=False, **_) -> np.float32:
    return ch07.lane_ex2(np.float32(x) * np.float32(LOG2_E))


def _lane_log(x, fastmath=False, **_) -> np.float32:
    return np.float32(_lane_lg2(x) * np.float32(LN_2))


class _Calls:
    def __init__(self):
        self.counts: Counter = Counter()

    def counted(self, name, fn):
        def call(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)
        return call


def emulate_finalize(fn, row_max: np.ndarray, row_sum: np.ndarray, sink: float):
    """``fn`` run as plain Python for each lane of a warp (lane l: rows l and l + 32): returns
    (1/T (64,), lse (64,), the calls per lane of exp2 / log2 / rcp, whether a lane changed its
    inputs)."""
    import sys

    import cutlass as cutlass_mod
    import cutlass.cute as cute_mod

    from solutions.ch06_exp2 import swapped
    from utils.host_emulation import _const_expr, _PyRange

    calls = _Calls()
    swap = {
        cute_mod.arch.fmax: ch07._lane_fmax,
        cute_mod.math.exp2: calls.counted("exp", ch07.lane_ex2),
        cute_mod.math.exp: calls.counted("exp", _lane_exp),
        cute_mod.math.log2: calls.counted("log", _lane_lg2),
        cute_mod.math.log: calls.counted("log", _lane_log),
        cute_mod.arch.rcp_approx: calls.counted("rcp", _lane_rcp),
        cute_mod.make_rmem_tensor: ch07._make_rmem, cute_mod.size: ch07._size,
        cutlass_mod.range: _PyRange, cutlass_mod.range_constexpr: _PyRange,
        cutlass_mod.const_expr: _const_expr,
        **ch07._lane_types(),
    }
    modules = [sys.modules[__name__], ch07, cute_mod, cute_mod.arch, cute_mod.math, cutlass_mod]
    clone, patches = swapped(fn, swap, modules)
    inv = np.zeros(WARP_ROWS, np.float32)
    lse = np.zeros(WARP_ROWS, np.float32)
    changed = False
    with patches(), np.errstate(all="ignore"):
        for lane in range(WARP):
            rows = ch07._lane_rows(lane)
            m, s = row_max[rows].astype(np.float32), row_sum[rows].astype(np.float32)
            out = clone(m, s, np.float32(sink))
            if not (isinstance(out, tuple) and len(out) == 2):
                raise AssertionError("return a pair (1 / T, lse): two register tensors of one "
                                     "value per row")
            a, b = (np.asarray(x, dtype=np.float32) for x in out)
            if a.shape != (ROWS_PER_LANE,) or b.shape != (ROWS_PER_LANE,):
                raise AssertionError(
                    f"return one value per row of the lane, shape ({ROWS_PER_LANE},); lane "
                    f"{lane} returned shapes {a.shape} and {b.shape}")
            inv[rows], lse[rows] = a, b
            changed |= not (np.array_equal(m, row_max[rows].astype(np.float32))
                            and np.array_equal(s, row_sum[rows].astype(np.float32)))
    per_lane = {k: v / WARP for k, v in calls.counts.items()}
    return inv, lse, per_lane, changed


# --- the cases: one warp's final state, made from scores so that float64 can judge -------------


def _state_from_scores(scores: np.ndarray, lag: np.ndarray):
    """(row_max, row_sum) in float32 as the kernel ends: the max in use ``lag`` below the true
    max (never above it), l = sum 2^(s - m); rows with no key: -inf and 0."""
    m_true = scores.max(axis=1)
    seen = np.isfinite(m_true)
    m = np.where(seen, m_true - lag, -np.inf).astype(np.float32)
    with np.errstate(invalid="ignore"):
        w = np.exp2(scores - np.where(seen, m, 0.0)[:, None].astype(np.float64))
    return m, np.where(seen, w.sum(axis=1), 0.0).astype(np.float32)


def sink_cases(seed: int = 75) -> list[tuple[str, np.ndarray, np.ndarray, float, np.ndarray]]:
    """Exercise 07.5's cases: (what, row_max (64,), row_sum (64,), sink (nats), the float64 lse
    of the scores with the sink (64,))."""
    g = np.random.default_rng(seed)
    cases = []

    def add(what, scores, lag, sink):
        m, l_sum = _state_from_scores(scores, lag)
        lse = _logsumexp(np.concatenate(
            [scores * LN_2, np.full((scores.shape[0], 1), sink)], axis=1), axis=1)
        cases.append((what, m, l_sum, float(sink), lse))

    keys = 300
    base = g.normal(0, 2, (WARP_ROWS, keys))
    mass = float(np.median(_logsumexp(base * LN_2, axis=1)))
    add("random rows, the true max in use, a sink near the rows' mass", base,
        np.zeros(WARP_ROWS), mass - 0.5)
    add("random rows, the max in use 0 to 8 log2 units below the true max (stale)", base,
        g.uniform(0, 8, WARP_ROWS), mass - 0.5)
    masked = base.copy()
    masked[:8] = -np.inf
    masked[40] = -np.inf
    add("rows 0-7 and 40 saw no key (fully masked), the others stale", masked,
        g.uniform(0, 8, WARP_ROWS), mass - 0.5)
    high = base + 60.0  # scores far from 0: a sink against the wrong max is far off
    add("large scores (max near 70 log2 units), a negative sink, stale max", high,
        g.uniform(0, 8, WARP_ROWS), -3.0)
    add("a sink 60 nats above every row's mass: out near 0, lse near the sink", base,
        g.uniform(0, 8, WARP_ROWS), mass + 60.0)
    add("a sink 60 nats below every row's mass: the plain softmax", base,
        g.uniform(0, 8, WARP_ROWS), mass - 60.0)
    return cases


def _total(m, l_sum, sink_term_log2):
    return l_sum.astype(np.float64) + np.exp2(sink_term_log2 - m.astype(np.float64))


def _sink_mistake(m, l_sum, sink, inv, lse, seen) -> str | None:
    """Which wrong formula ``inv``, ``lse`` follow on the rows that saw keys, in words."""
    m64, sl2 = m.astype(np.float64), sink * LOG2_E
    right = _total(m, l_sum, sl2)
    with np.errstate(all="ignore"):
        guesses = [
            ("the sink is in nats and the state in log2 units: its term is 2^(sink log2 e - m), "
             "not 2^(sink - m)", _total(m, l_sum, sink), None),
            ("the sink was multiplied by ln 2 instead of log2 e", _total(m, l_sum, sink * LN_2),
             None),
            ("the sink's term ignores the max: l holds sum 2^(s - m), so the sink must carry the "
             "same 2^-m: 2^(sink log2 e - m), not 2^(sink log2 e)",
             l_sum.astype(np.float64) + np.exp2(sl2), None),
            ("the sink is missing: T = l + 2^(sink log2 e - m)", l_sum.astype(np.float64),
             None),
            ("1 / T has the sink but lse does not: lse = ln 2 (m + log2 T), with the same T",
             right, ("lse", l_sum.astype(np.float64))),
            ("lse has the sink but 1 / T does not: out = O / T, with the same T",
             right, ("inv", l_sum.astype(np.float64))),
            ("lse is in log2 units: multiply by ln 2 (the course's lse is a natural log)",
             right, ("log2", right)),
        ]
        for why, total, twist in guesses:
            want_inv, want_lse = 1.0 / total, (m64 + np.log2(total)) * LN_2
            if twist and twist[0] == "lse":
                want_lse = (m64 + np.log2(twist[1])) * LN_2
            elif twist and twist[0] == "inv":
                want_inv = 1.0 / twist[1]
            elif twist and twist[0] == "log2":
                want_lse = m64 + np.log2(twist[1])
            if (np.allclose(inv[seen], want_inv[seen], rtol=1e-5, atol=0)
                    and np.allclose(lse[seen], want_lse[seen], rtol=1e-6, atol=1e-4)):
                return why
    return None


def _row(row: int) -> str:
    return ch07._row_name(row)


def check_sink_rules(fn) -> None:
    """Exercise 07.5 without compiling: ``fn`` on every lane of a warp for each case of
    ``sink_cases``, 1 / T and lse against float64."""
    for what, m, l_sum, sink, want_lse in sink_cases():
        inv, lse, calls, changed = emulate_finalize(fn, m, l_sum, sink)
        assert not changed, (
            f"{what}: your function changed row_max or row_sum in place; return new register "
            "tensors (cute.make_rmem_tensor)")
        seen = np.isfinite(m)
        empty = np.flatnonzero(~seen)
        for row in empty:
            if np.isnan(lse[row]) or np.isnan(inv[row]):
                raise AssertionError(
                    f"{what}: a fully masked row gave NaN ({_row(row)}: 1 / T {inv[row]:g}, "
                    f"lse {lse[row]:g}). With m = -inf, 2^(sink log2 e - m) is 2^inf and m + "
                    "log2 T is -inf + inf. A row that saw no key has one column, the sink: take "
                    "the sink itself (sink log2 e) as its max, so T = 1")
            if lse[row] == -np.inf:
                raise AssertionError(
                    f"{what}: {_row(row)} saw no key and got lse = -inf, but it still has the "
                    f"sink in its denominator: lse = the sink ({sink:g}), as FA4 gives")
            if not np.isfinite(inv[row]):
                raise AssertionError(
                    f"{what}: {_row(row)} saw no key and got 1 / T = {inv[row]:g}: out = O / T "
                    "must be 0 and O is 0, so 1 / T must be finite (T = 1: the sink alone)")
            if abs(lse[row] - sink) > 1e-5 * max(1.0, abs(sink)):
                raise AssertionError(
                    f"{what}: {_row(row)} saw no key: its only column is the sink, so lse = "
                    f"sink = {sink:g}; yours is {lse[row]:g}")
        nan = np.flatnonzero(np.isnan(inv) | np.isnan(lse))
        if nan.size:
            raise AssertionError(f"{what}: {_row(nan[0])} saw keys and got NaN "
                                 f"(1 / T {inv[nan[0]]:g}, lse {lse[nan[0]]:g})")
        total = _total(m, l_sum, sink * LOG2_E)
        with np.errstate(divide="ignore"):
            want_inv = 1.0 / total
        inv_bad = ~np.isclose(inv, want_inv, rtol=1e-5, atol=0) & seen
        lse_bad = ~np.isclose(lse, want_lse, rtol=1e-6, atol=1e-4) & seen
        if inv_bad.any() or lse_bad.any():
            why = _sink_mistake(m, l_sum, sink, inv, lse, seen)
            row = int(np.flatnonzero(inv_bad | lse_bad)[0])
            if why:
                raise AssertionError(f"{what}: {why} (e.g. {_row(row)})")
            raise AssertionError(
                f"{what}: {_row(row)} (m {m[row]:g}, l {l_sum[row]:g}, sink {sink:g}): you give "
                f"1 / T = {inv[row]:.7g} and lse = {lse[row]:.7g}; float64 says "
                f"{want_inv[row]:.7g} and {want_lse[row]:.7g}")
        if calls.get("exp", 0) > ROWS_PER_LANE:
            raise AssertionError(
                f"{what}: {calls['exp']:g} exponentials per lane for {ROWS_PER_LANE} rows: the "
                "sink needs one per row, once, at the end")


# --- compiled for sm_90a -----------------------------------------------------------------------


class FinalizeKernel:
    """Exercise 07.5 in a kernel: each lane loads its rows' max and sum and the head's sink,
    calls ``fn``, stores 1 / T and lse."""

    def __init__(self, fn):
        self.fn = fn

    @cute.jit
    def __call__(self, mMax: cute.Tensor, mSum: cute.Tensor, mSink: cute.Tensor,
                 mInv: cute.Tensor, mLse: cute.Tensor, stream):
        warps = cute.size(mMax) // WARP_ROWS
        self.kernel(mMax, mSum, mSink, mInv, mLse).launch(
            grid=(warps, 1, 1), block=(WARP, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mMax: cute.Tensor, mSum: cute.Tensor, mSink: cute.Tensor,
               mInv: cute.Tensor, mLse: cute.Tensor):
        lane, _, _ = cute.arch.thread_idx()
        warp, _, _ = cute.arch.block_idx()
        row_max = cute.make_rmem_tensor(ROWS_PER_LANE, Float32)
        row_sum = cute.make_rmem_tensor(ROWS_PER_LANE, Float32)
        for r in cutlass.range_constexpr(ROWS_PER_LANE):
            row_max[r] = mMax[warp * WARP_ROWS + r * WARP + lane]
            row_sum[r] = mSum[warp * WARP_ROWS + r * WARP + lane]
        inv_sum, lse = self.fn(row_max, row_sum, mSink[0])
        for r in cutlass.range_constexpr(ROWS_PER_LANE):
            mInv[warp * WARP_ROWS + r * WARP + lane] = inv_sum[r]
            mLse[warp * WARP_ROWS + r * WARP + lane] = lse[r]


_BUILDS: dict = {}


def compile_finalize_kernel(fn):
    """FinalizeKernel(fn) compiled for sm_90a with no GPU (remembered)."""
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    key = ("finalize", fn)
    if key not in _BUILDS:
        _BUILDS[key] = compile_for("sm_90a", FinalizeKernel(fn),
                                   *(fake_tensor(Float32, (None,)) for _ in range(5)),
                                   fake_stream())
    return _BUILDS[key]


def finalize_sass_facts(fn) -> dict:
    """What the compiled finalize does per row (the kernel around it adds no MUFU)."""
    from solutions.ch06_exp2 import sass_opcodes

    art = compile_finalize_kernel(fn)
    ops = sass_opcodes(art.sass)
    return {
        "rows per lane": ROWS_PER_LANE,
        "MUFU.EX2 per row": ops["MUFU.EX2"] / ROWS_PER_LANE,
        "MUFU.LG2 per row": ops["MUFU.LG2"] / ROWS_PER_LANE,
        "MUFU.RCP per row": ops["MUFU.RCP"] / ROWS_PER_LANE,
        "div.rn.f32 (division calls)": art.ptx.count("div.rn.f32"),
        "local memory": art.spills > 0 or art.frame_bytes > 0,
        "SASS instructions of the whole test kernel": sum(ops.values()),
    }


def _sass_mistake(facts: dict) -> str | None:
    if facts["local memory"]:
        return ("compiled for sm_90a, your finalize uses local memory: index the register "
                "tensors with compile-time indices (loops over cutlass.range_constexpr)")
    if facts["MUFU.EX2 per row"] != 1:
        return (f"compiled for sm_90a, your finalize has {facts['MUFU.EX2 per row']:g} "
                "MUFU.EX2 per row: the sink needs exactly one exponential per row (select the "
                "max first, then one cute.math.exp2(..., fastmath=True))")
    if facts["div.rn.f32 (division calls)"]:
        return ("compiled for sm_90a, your finalize divides (div.rn.f32, a subroutine with a "
                "slow path): 1 / T is one cute.arch.rcp_approx (one MUFU.RCP), and its error is "
                "far below what bf16 output keeps")
    if facts["MUFU.RCP per row"] != 1 or facts["MUFU.LG2 per row"] != 1:
        return (f"compiled for sm_90a, your finalize has {facts['MUFU.RCP per row']:g} MUFU.RCP "
                f"and {facts['MUFU.LG2 per row']:g} MUFU.LG2 per row: one reciprocal "
                "(cute.arch.rcp_approx) and one log2 (cute.math.log2 with fastmath=True) per row")
    return None


_sink_rules = check_sink_rules  # a private name: the workshop guide lists its messages


def check_finalize_with_sink(fn, compile_check: bool = True) -> None:
    """Exercise 07.5: ``check_sink_rules`` (lane by lane on the CPU against float64), then
    compiled for sm_90a: one MUFU.EX2, MUFU.LG2 and MUFU.RCP per row, no division, no local
    memory."""
    _sink_rules(fn)
    if not compile_check:
        return
    mistake = _sass_mistake(finalize_sass_facts(fn))
    if mistake:
        raise AssertionError(mistake)


# --- on a Hopper GPU: the whole exercise kernel, the sink at its end ----------------------------


class SinkRows:
    """Chapter 07's exercise kernel (ch07.WarpRows) with heads and a sink: grid (warps, heads);
    per KV tile the reference step of exercise 07.3 (``ch07.softmax_step``, tau = 8: stale
    maxima), then O += P V; at the end ``fn(row_max, row_sum, sink[head])`` gives (1 / T, lse)
    and out = O / T. Keys padded to whole tiles with -inf, rows to whole warps."""

    def __init__(self, fn, tau: float = ch07.FA4_RESCALE_THRESHOLD):
        self.fn, self.tau = fn, tau

    @cute.jit
    def __call__(self, mS: cute.Tensor, mV: cute.Tensor, mSink: cute.Tensor, mO: cute.Tensor,
                 mL: cute.Tensor, stream):
        warps = cute.size(mS, mode=[1]) // WARP_ROWS
        heads = cute.size(mS, mode=[0])
        self.kernel(mS, mV, mSink, mO, mL).launch(grid=(warps, heads, 1), block=(WARP, 1, 1),
                                                  stream=stream)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mV: cute.Tensor, mSink: cute.Tensor, mO: cute.Tensor,
               mL: cute.Tensor):
        lane, _, _ = cute.arch.thread_idx()
        warp, head, _ = cute.arch.block_idx()
        n_tiles = cute.size(mS, mode=[2]) // TILE_COLS
        row_max = cute.make_rmem_tensor(ROWS_PER_LANE, Float32)
        row_sum = cute.make_rmem_tensor(ROWS_PER_LANE, Float32)
        acc_o = cute.make_rmem_tensor((ROWS_PER_LANE, HEAD_DIM), Float32)
        s = cute.make_rmem_tensor((ROWS_PER_LANE, TILE_COLS), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        acc_o.fill(0.0)
        for t in cutlass.range(n_tiles, unroll=1):
            for r in cutlass.range_constexpr(ROWS_PER_LANE):
                for c in cutlass.range_constexpr(TILE_COLS):
                    s[r, c] = mS[head, warp * WARP_ROWS + r * WARP + lane, t * TILE_COLS + c]
            ch07.softmax_step(s, row_max, row_sum, acc_o, self.tau)
            for r in cutlass.range_constexpr(ROWS_PER_LANE):
                for c in cutlass.range_constexpr(TILE_COLS):
                    for dd in cutlass.range_constexpr(HEAD_DIM):
                        acc_o[r, dd] = acc_o[r, dd] + s[r, c] * mV[t * TILE_COLS + c, dd]
        inv_sum, lse = self.fn(row_max, row_sum, mSink[head])
        for r in cutlass.range_constexpr(ROWS_PER_LANE):
            row = warp * WARP_ROWS + r * WARP + lane
            for dd in cutlass.range_constexpr(HEAD_DIM):
                mO[head, row, dd] = acc_o[r, dd] * inv_sum[r]
            mL[head, row] = lse[r]


def gpu_sink_cases(seed: int = 77) -> list[dict]:
    """Awkward shapes for the GPU: 3 heads of 200 rows (not whole warps) over 1000 keys (not
    whole tiles), drifting scores (stale maxima); sinks near the mass, far below and far above;
    rows that see no key for three tiles, and rows that see none at all."""
    g = np.random.default_rng(seed)
    heads, rows, keys = 3, 200, 1000
    scores = np.stack([drift_scores(rows, keys, seed=seed + h) for h in range(heads)])
    scores[1, 190:] = -np.inf
    scores[2, :50, : 3 * TILE_COLS] = -np.inf
    mass = float(np.median(_logsumexp(scores[0] * LN_2, axis=1)))
    sinks = np.array([mass - 0.5, mass - 40.0, mass + 30.0])
    v = g.normal(0, 1, (keys, HEAD_DIM))
    small = np.stack([drift_scores(70, 100, seed=seed + 9)] * 2)
    small[0, 64:] = -np.inf  # the second warp's rows: none sees a key
    return [
        {"what": "3 heads x 200 rows x 1000 keys, drifting scores, sinks near/below/above, "
                 "masked rows", "scores": scores.astype(np.float32), "v": v.astype(np.float32),
         "sinks": sinks.astype(np.float32)},
        {"what": "2 heads x 70 rows x 100 keys, a warp whose rows see no key",
         "scores": small.astype(np.float32),
         "v": g.normal(0, 1, (100, HEAD_DIM)).astype(np.float32),
         "sinks": np.array([mass, -2.0], np.float32)},
    ]


def _padded(case: dict):
    heads, rows, keys = case["scores"].shape
    rows_p = -(-rows // WARP_ROWS) * WARP_ROWS
    keys_p = -(-keys // TILE_COLS) * TILE_COLS
    s = np.full((heads, rows_p, keys_p), -np.inf, np.float32)
    s[:, :rows, :keys] = case["scores"]
    v = np.zeros((keys_p, HEAD_DIM), np.float32)
    v[:keys] = case["v"]
    return s, v


def run_sink_kernel(fn, case: dict) -> tuple[np.ndarray, np.ndarray]:
    """SinkRows(fn) on a GPU over ``case``: (out (heads, rows, d), lse (heads, rows))."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack

    s, v = (torch.from_numpy(a).cuda() for a in _padded(case))
    sinks = torch.from_numpy(case["sinks"]).cuda()
    heads, rows_p, _ = s.shape
    o = torch.empty(heads, rows_p, HEAD_DIM, device="cuda")
    lse = torch.empty(heads, rows_p, device="cuda")
    args = [from_dlpack(t, assumed_align=4).mark_layout_dynamic() for t in (s, v, sinks, o, lse)]
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    key = ("gpu-sink", fn)
    if key not in _BUILDS:
        _BUILDS[key] = cute.compile[cute.GPUArch("sm_90a")](SinkRows(fn), *args, stream)
    _BUILDS[key](*args, stream)
    torch.cuda.synchronize()
    rows = case["scores"].shape[1]
    return o[:, :rows].cpu().numpy(), lse[:, :rows].cpu().numpy()


def emulate_sink_kernel(fn, case: dict) -> tuple[np.ndarray, np.ndarray]:
    """``run_sink_kernel`` on the CPU: each warp's KV loop emulated with the reference step
    (ch07.emulate_step), then ``fn`` lane by lane (slow: for small cases)."""
    s, v = _padded(case)
    heads, rows_p, keys_p = s.shape
    outs = np.zeros((heads, rows_p, HEAD_DIM), np.float32)
    lses = np.zeros((heads, rows_p), np.float32)
    for h in range(heads):
        for start in range(0, rows_p, WARP_ROWS):
            tr = ch07.emulate_step(ch07.softmax_step, ch07.StepCase(
                "", s[h, start:start + WARP_ROWS], v, ch07.FA4_RESCALE_THRESHOLD))
            o = tr.o_after[-1] + (tr.p[-1] @ v[-TILE_COLS:]).astype(np.float32)
            inv, lse, _, _ = emulate_finalize(fn, tr.row_max[-1], tr.row_sum[-1],
                                              float(case["sinks"][h]))
            outs[h, start:start + WARP_ROWS] = o * inv[:, None]
            lses[h, start:start + WARP_ROWS] = lse
    rows = case["scores"].shape[1]
    return outs[:, :rows], lses[:, :rows]


def check_finalize_with_sink_on_gpu(fn, run=None, cases=None) -> tuple[bool, list[str]]:
    """Exercise 07.5 on a Hopper GPU: SinkRows(fn) on ``gpu_sink_cases`` against float64
    attention with the sink (MUFU's ex2, lg2 and rcp are approximate: 1e-4). Returns (ok, one
    line per case and head). ``run``: by default ``run_sink_kernel`` (``emulate_sink_kernel``
    checks this function's logic with no GPU)."""
    run = run or run_sink_kernel
    ok, lines = True, []
    for case in cases or gpu_sink_cases():
        out, lse = run(fn, case)
        for h in range(case["scores"].shape[0]):
            want_out, want_lse = reference_with_sink(case["scores"][h], case["v"],
                                                     float(case["sinks"][h]))
            finite = bool(np.isfinite(out[h]).all() and np.isfinite(lse[h]).all())
            err = float(np.abs(out[h] - want_out).max()) if finite else math.inf
            lse_err = float(np.abs(lse[h] - want_lse).max()) if finite else math.inf
            head_ok = err <= 1e-4 and lse_err <= 1e-4 * max(1.0, float(np.abs(want_lse).max()))
            ok &= head_ok
            lines.append(f"{case['what']}, head {h} (sink {case['sinks'][h]:.2f}): out max error "
                         f"{err:.1e}, lse max error {lse_err:.1e}: "
                         f"{'ok' if head_ok else 'WRONG'}")
    return ok, lines
