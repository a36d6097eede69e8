"""Chapter 07: conditional softmax rescaling (FA4's "rescale only when the max grows by > tau").

What it adds to the online softmax of chapters 02-05. Per row and per KV tile the usual step is,
in the log2 domain (scores already multiplied by ``scale * log2(e)``):

    m_new = max(m_old, max_j s_j)
    alpha = 2^(m_old - m_new)                 O <- alpha O + P V,   l <- alpha l + sum_j p_j
    p_j   = 2^(s_j - m_new)

The multiply of O by alpha is D FMULs per row per tile (128 x 128 per tile at D = 128: on
Blackwell also a TMEM load and store of the whole O tile by the correction warps). This chapter
keeps the old max when the tile raises it by at most ``tau`` log2 units:

    growth = max(m_old, max_j s_j) - m_old
    growth <= tau:  m_used = m_old,  alpha = 1, nothing is multiplied   ("stale max")
    growth >  tau:  m_used = m_new,  alpha = 2^(m_old - m_new)          (rescale as usual)

Note [Why a stale max is exact]
    Every rescale multiplies O and l by the same alpha, which moves all terms already summed to
    the new reference. So whatever sequence of decisions was taken, after the last tile

        l = sum_j 2^(s_j - m),   O = sum_j 2^(s_j - m) v_j,   m = the max actually subtracted,

    and O / l = sum_j 2^(s_j) v_j / sum_j 2^(s_j): the common factor 2^(-m) cancels, for any m.
    Only the LSE sees m, so it must use the m that was subtracted, not the true max:

        lse = ln 2 * (m + log2 l)          (natural log, the course signature)

    With the true max m* >= m the same quantity is ln 2 * (m* + log2 l'), l' = l 2^(m - m*): it
    is the same number, but only if l is paired with its own m.

Note [Why tau = 8 is safe]
    The max in use never lags the true running max by more than tau (the moment it would, the
    step rescales). So every p_j = 2^(s_j - m) <= 2^tau: with tau = 8, p <= 256, and P fits
    bf16 and fp16 (fp16 max 65504 = 2^15.999) before the P V MMA, with the same relative
    precision as p <= 1 (floating point is scale-free until it overflows). The row sum over N
    keys is at most 256 N: 2^23 for N = 32768, far below float32's 2^128. FA4 uses tau = 8 for
    16-bit inputs. A threshold far too large breaks exactly these bounds: with tau = 200 a max
    that grows by 40 log2 units gives p = 2^40, which is inf in fp16 (torch's cast) or, with a
    saturating convert, 65504 while l counts 2^40 (a silently shrunken output); growth past 128
    makes p itself inf in float32, so l = inf and out = inf / inf = NaN.
    ``largest_safe_threshold`` gives the bound for a dtype and a sequence length.

Warp-uniform decisions. In the kernel a warp holds several rows (16 in a Hopper wgmma warpgroup,
32 on Blackwell with one thread per row); a branch that differs between its rows costs both
paths. ``group_rows`` makes one decision per group of consecutive query rows:
``group_rule="any"`` moves the whole group to its new maxima when ANY row needs it (what chapter
05's kernel does with ``HopperConfig.rescale_threshold``: Note [Warp vote] in ch05_softmax, and a
GPU test compares its per-row maxima with this model); ``group_rule="own"`` is FA4's Blackwell
variant: each row keeps its own stale-max decision and the warp vote only decides whether the O
multiply runs at all (rows that kept their max multiply by 1). Both are exact; they differ in
how many group steps pay for the multiply.

Code. ``conditional_tile_update(tau)`` plugs the step into chapter 02's loop
(``ch02_online_softmax.attention_fa2(..., update=...)``); with tau = 0 it is chapter 02's
``tile_update`` bit for bit. ``attention_with_stats`` runs the same arithmetic over all rows at
once, in the kernels' KV order, and counts the decisions; ``scan_tile_maxima`` counts them from
the tile maxima alone (no P, no O), cheap enough for 32k-key sequences on a CPU.

KV order. Chapter 05 and FA4 walk the KV tiles from last to first (the masked diagonal tiles
come first), so ``kv_order="reverse"`` is the default; where a row's big scores sit in the
sequence decides how often its max grows (see ``rescale_frequency``).

Measured: ``results/<gpu>/ch07_rescale.json`` (chapter 05's kernel with the knob on and off,
made by ``python -m measure.rescale_knob --save``), printed by the notebook with its
provenance; no figure is typed here.

Device code: exercises 07.2 (``running_max``: rows decide alone, the warp votes) and 07.3
(``softmax_step``: the step whose exponentials never wait for the vote), run lane by lane on
the CPU (Note [A warp on the CPU]), compiled for sm_90a, and run on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import numpy as np
import torch
from cutlass import Float32

from solutions.ch02_online_softmax import LN2 as LN_2
from solutions.ch02_online_softmax import LOG2E as LOG2_E
from solutions.ch02_online_softmax import lse_from_state
from utils.claims import claim
from utils.reference import check_attention_inputs, positive_int

FA4_RESCALE_THRESHOLD = 8.0  # log2(256): FA4's value for 16-bit inputs
KV_ORDERS = ("reverse", "forward")
GROUP_RULES = ("any", "own")
HOPPER_WARP_ROWS = 16  # a wgmma warpgroup's 64 rows over its 4 warps
BLACKWELL_WARP_ROWS = 32  # one thread per row
PATTERNS = ("random", "sorted", "drift", "sink", "adversarial")
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# 1. Argument checks


def _check_tau(tau, allow_none: bool = False) -> float | None:
    if tau is None and allow_none:
        return None
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau >= 0:
        raise ValueError(f"rescale_threshold must be a number >= 0 (log2 units), got {tau!r}")
    if math.isinf(tau):
        raise ValueError("rescale_threshold must be finite: inf would never rescale and overflow")
    return float(tau)


def _check_choice(name: str, value, options) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")


def _check_group(group_rows, group_rule) -> None:
    if group_rows is not None:
        positive_int("group_rows", group_rows)
    _check_choice("group_rule", group_rule, GROUP_RULES)


# ---------------------------------------------------------------------------------------------
# 2. The conditional step (its PyTorch model; exercise 07.2 writes it in device code) and the
#    final normalisation (exercise 07.1)


def _group_any(flags: torch.Tensor, group_rows: int) -> torch.Tensor:
    """(..., rows) bool -> (..., ceil(rows / group_rows)): True where any row of the group is."""
    rows = flags.shape[-1]
    pad = (-rows) % group_rows
    if pad:
        flags = torch.cat([flags, flags.new_zeros(*flags.shape[:-1], pad)], dim=-1)
    return flags.reshape(*flags.shape[:-1], -1, group_rows).any(dim=-1)


def _ungroup(groups: torch.Tensor, group_rows: int, rows: int) -> torch.Tensor:
    return groups.repeat_interleave(group_rows, dim=-1)[..., :rows]


def _decide(m_old, m_tile, tau, group_rows=None, group_rule="any"):
    """The decision for one KV tile, vectorised over rows (last dim = query rows of a head).

    ``m_old``: max in use so far (log2 units, -inf: the row has seen no key); ``m_tile``: this
    tile's max (-inf: every key masked). ``tau=None`` is the textbook always-rescale step.
    Returns (m_used, alpha, rescaled rows, O multiplied per row).
    """
    m_cand = torch.maximum(m_old, m_tile)
    if tau is None:
        # Textbook step. Where the new max is still -inf, subtract 0 instead: alpha = 2^-inf = 0
        # multiplies an O and l that are 0 anyway, never inf - inf = NaN.
        safe = torch.where(torch.isinf(m_cand), torch.zeros_like(m_cand), m_cand)
        alpha = torch.exp2(m_old - safe)
        return m_cand, alpha, torch.ones_like(m_cand, dtype=torch.bool), alpha != 1
    # growth is +inf where the row had no key yet and now has one (a stale -inf cannot be kept),
    # NaN where both are -inf; NaN > tau is False, so a row with no key yet keeps -inf.
    growth = m_cand - m_old
    rescaled = growth > tau
    multiplied = rescaled
    if group_rows is not None:
        vote = _ungroup(_group_any(rescaled, group_rows), group_rows, rescaled.shape[-1])
        if group_rule == "any":
            rescaled = vote
        multiplied = vote
    m_used = torch.where(rescaled, m_cand, m_old)
    # A group vote can "rescale" a row that still has no key (-inf to -inf): subtract 0 there.
    m_safe = m_used.masked_fill(m_used == float("-inf"), 0.0)
    alpha = torch.where(rescaled, torch.exp2(m_old - m_safe), torch.ones_like(m_used))
    return m_used, alpha, rescaled, multiplied


def conditional_update(m_old: torch.Tensor, tile_scores: torch.Tensor, tau: float):
    """One row-wise step of conditional rescaling: the PyTorch model of exercise 07.2's decision.

    m_old: (rows,) float32, the max in use so far in log2 units (-inf: no key seen yet).
    tile_scores: (rows, n) float32, this tile's scores in log2 units (-inf: masked).
    tau: threshold in log2 units, >= 0.
    Returns (m_used, alpha, rescaled): the max to subtract for this tile (rows,), the factor for
    O and l (rows,; 1 where the stale max is kept), and a bool (rows,) telling which rows
    rescaled. A growth of exactly tau keeps the stale max (p then reaches exactly 2^tau).
    """
    tau = _check_tau(tau)
    if tile_scores.dim() != 2 or m_old.shape != tile_scores.shape[:1]:
        raise ValueError(
            f"m_old must be (rows,) and tile_scores (rows, n); got {tuple(m_old.shape)} and "
            f"{tuple(tile_scores.shape)}"
        )
    m_used, alpha, rescaled, _ = _decide(m_old, tile_scores.amax(dim=-1), tau)
    return m_used, alpha, rescaled


def finalize(o_acc: torch.Tensor, row_sum: torch.Tensor, m_used: torch.Tensor):
    """out = O / l and lse = ln 2 * (m_used + log2 l) (reference for exercise 07.1).

    o_acc: (..., rows, d) float32, sum_j 2^(s_j - m_used) v_j; row_sum: (..., rows), l;
    m_used: (..., rows), the max actually subtracted, log2 units. A row with l = 0 (no key)
    gets out = 0 and lse = -inf.
    """
    # With l = 0 the row's O is 0 too: divide by 1. log2(0) = -inf gives lse = -inf.
    out = o_acc / row_sum.masked_fill(row_sum == 0, 1.0)[..., None]
    return out, lse_from_state(m_used, row_sum)


def _fold(o, l, s, v, m_used, alpha):  # noqa: E741  (l: the running sum, as in the papers)
    """Fold a tile into (O, l) with the max ``m_used``: the arithmetic of chapter 02's
    ``tile_update``, operation for operation, so tau = 0 reproduces it bit for bit."""
    m_safe = m_used.masked_fill(m_used == float("-inf"), 0.0)  # no key yet: p = 2^-inf = 0
    p = torch.exp2(s - m_safe[..., None])  # <= 2^tau: see Note [Why tau = 8 is safe]
    l_new = alpha * l + p.sum(dim=-1)
    pv = p.to(v.dtype).to(o.dtype) @ v.to(o.dtype)  # P enters the MMA in the inputs' dtype
    return alpha[..., None] * o + pv, l_new


def conditional_tile_update(tau, group_rows=None, group_rule="any"):
    """An ``update(o, m, l, s, v) -> (o, m, l)`` for chapter 02's ``attention_fa2`` loop, with
    m the max in use: chapter 02's loop, with conditional rescaling plugged in. (Groups are
    formed within each Q tile, as the warps of a CTA do.)"""
    tau = _check_tau(tau)
    _check_group(group_rows, group_rule)

    def update(o, m, l, s, v):  # noqa: E741
        m_used, alpha, _, _ = _decide(m, s.amax(dim=-1), tau, group_rows, group_rule)
        o_new, l_new = _fold(o, l, s, v, m_used, alpha)
        return o_new, m_used, l_new

    return update


# ---------------------------------------------------------------------------------------------
# 3. Statistics of one pass


@dataclass
class RescaleStats:
    """Counts over (row, KV tile) steps. A step is a tile that brings a row at least one visible
    key after an earlier tile already did (the first one needs no rescale in any scheme)."""

    tau: float | None
    steps: int = 0
    grew: int = 0  # the true running max grew (what an always-rescale kernel reacts to)
    rescaled: int = 0  # the row rescaled O and l (its own need, or its group's vote)
    max_p: float = 0.0  # largest p = 2^(s - m_used) in any tile; <= 2^tau
    group_rows: int | None = None
    group_steps: int = 0  # (group, tile) pairs where some row of the group has a step
    group_multiplied: int = 0  # ... and the warp vote says: multiply O

    @property
    def skipped(self) -> int:
        return self.steps - self.rescaled

    @property
    def frac_grew(self) -> float:
        return self.grew / self.steps if self.steps else 0.0

    @property
    def frac_rescaled(self) -> float:
        return self.rescaled / self.steps if self.steps else 0.0

    @property
    def frac_group(self) -> float:
        return self.group_multiplied / self.group_steps if self.group_steps else 0.0

    def add(self, m_old, m_tile, m_true_old, m_used, rescaled, multiplied):
        finite_old = torch.isfinite(m_old)
        has_key = torch.isfinite(m_tile)
        step = finite_old & has_key
        self.steps += int(step.sum())
        self.grew += int((step & (m_tile > m_true_old)).sum())
        self.rescaled += int((step & rescaled).sum())
        live = has_key & torch.isfinite(m_used)
        if bool(live.any()):
            self.max_p = max(self.max_p, float(torch.exp2(m_tile - m_used)[live].max()))
        if self.group_rows is not None:
            g_step = _group_any(step, self.group_rows)
            g_mult = _group_any(multiplied & has_key, self.group_rows)
            self.group_steps += int(g_step.sum())
            self.group_multiplied += int((g_step & g_mult).sum())

    def __str__(self) -> str:
        tau = "always" if self.tau is None else f"tau={self.tau:g}"
        text = (f"{tau}: {self.steps} steps, max grew in {self.frac_grew:.1%}, rescaled "
                f"{self.rescaled} ({self.frac_rescaled:.1%}), skipped {self.skipped}, "
                f"largest p {self.max_p:.4g}")
        if self.group_rows is not None:
            text += (f"; groups of {self.group_rows} rows multiply O in "
                     f"{self.frac_group:.1%} of {self.group_steps} group steps")
        return text


def scan_tile_maxima(tile_max: torch.Tensor, tau, group_rows=None, group_rule="any",
                     trace: bool = False):
    """Run the decisions over precomputed tile maxima, with no P or O (cheap: a loop over tiles,
    vectorised over rows).

    tile_max: (..., rows, n_tiles) float, log2 units, tiles in PROCESSING order, -inf where a
    tile has no visible key for a row. Returns RescaleStats, and with ``trace=True`` also a dict
    of (..., rows, n_tiles) tensors: ``m_true`` and ``m_used`` after each tile, ``rescaled``.
    """
    tau = _check_tau(tau, allow_none=True)
    _check_group(group_rows, group_rule)
    if tile_max.dim() < 2:
        raise ValueError(f"tile_max must be (..., rows, n_tiles), got {tuple(tile_max.shape)}")
    tile_max = tile_max.to(torch.float32)
    stats = RescaleStats(tau=tau, group_rows=group_rows)
    m_used = torch.full(tile_max.shape[:-1], float("-inf"))
    m_true = m_used.clone()
    traces = {"m_true": [], "m_used": [], "rescaled": []}
    for t in range(tile_max.shape[-1]):
        m_tile = tile_max[..., t]
        new_used, _, rescaled, multiplied = _decide(m_used, m_tile, tau, group_rows, group_rule)
        stats.add(m_used, m_tile, m_true, new_used, rescaled, multiplied)
        m_used, m_true = new_used, torch.maximum(m_true, m_tile)
        if trace:
            traces["m_true"].append(m_true)
            traces["m_used"].append(m_used)
            traces["rescaled"].append(rescaled & torch.isfinite(m_tile))
    if not trace:
        return stats
    return stats, {k: torch.stack(v, dim=-1) for k, v in traces.items()}


# ---------------------------------------------------------------------------------------------
# 4. Blockwise attention with the threshold


def _heads_first(t: torch.Tensor, heads: int, dtype=torch.float32) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, H, S, D) in ``dtype``; GQA repeats each kv head H / Hkv times."""
    t = t.transpose(1, 2).to(dtype)
    if t.shape[1] != heads:
        t = t.repeat_interleave(heads // t.shape[1], dim=1)
    return t


def _tile_starts(seqlen_k: int, tile_n: int, kv_order: str) -> list[int]:
    starts = list(range(0, seqlen_k, tile_n))
    return starts[::-1] if kv_order == "reverse" else starts


def attention_with_stats(q, k, v, causal=False, softmax_scale=None, *, rescale_threshold=8.0,
                         tile_n=128, kv_order="reverse", group_rows=None, group_rule="any"):
    """Blockwise attention as the kernels compute it, with conditional rescaling.

    float32 accumulators, exp2 with log2(e) folded into the scale, P cast to the inputs' dtype
    before P V when they are 16-bit (the MMA's A operand), products accumulated in float32.
    ``rescale_threshold``: tau in log2 units; ``None`` is the textbook always-rescale step.
    Returns (out, lse, RescaleStats); out like q, lse float32 (batch, heads, seqlen_q).
    PyTorch on the CPU: a model of the kernel's numerics, not a fast path.
    """
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v, softmax_scale)
    tau = _check_tau(rescale_threshold, allow_none=True)
    positive_int("tile_n", tile_n)
    _check_choice("kv_order", kv_order, KV_ORDERS)
    _check_group(group_rows, group_rule)
    scale_log2 = (d**-0.5 if softmax_scale is None else float(softmax_scale)) * LOG2_E
    qh, kh = _heads_first(q, h), _heads_first(k, h)
    vh = _heads_first(v, h, v.dtype if v.dtype in _SIXTEEN_BIT else torch.float32)
    rows = torch.arange(sq)[:, None] + (sk - sq)  # bottom-right causal: key j visible if j <= it

    m_used = torch.full((b, h, sq), float("-inf"))
    m_true = m_used.clone()
    row_sum = torch.zeros(b, h, sq)
    o_acc = torch.zeros(b, h, sq, d)
    stats = RescaleStats(tau=tau, group_rows=group_rows)
    for start in _tile_starts(sk, tile_n, kv_order):
        stop = min(start + tile_n, sk)
        s = torch.matmul(qh, kh[:, :, start:stop].transpose(-1, -2)) * scale_log2
        if causal:
            s = s.masked_fill(torch.arange(start, stop)[None, :] > rows, float("-inf"))
        m_tile = s.amax(dim=-1)
        new_used, alpha, rescaled, multiplied = _decide(m_used, m_tile, tau, group_rows,
                                                        group_rule)
        stats.add(m_used, m_tile, m_true, new_used, rescaled, multiplied)
        o_acc, row_sum = _fold(o_acc, row_sum, s, vh[:, :, start:stop], new_used, alpha)
        m_used, m_true = new_used, torch.maximum(m_true, m_tile)
    out, lse = finalize(o_acc, row_sum, m_used)
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse, stats


def attention(q, k, v, causal=False, softmax_scale=None, rescale_threshold=FA4_RESCALE_THRESHOLD,
              tile_n=128):
    """The course signature: (out, lse), with tau = 8 (FA4's value)."""
    out, lse, _ = attention_with_stats(q, k, v, causal, softmax_scale,
                                       rescale_threshold=rescale_threshold, tile_n=tile_n)
    return out, lse


def largest_safe_threshold(p_dtype: torch.dtype, seqlen_k: int) -> float:
    """Largest tau for which p <= 2^tau stays finite in ``p_dtype`` and l <= N 2^tau stays
    finite in float32 (strictly below both; FA4 asserts the first one)."""
    positive_int("seqlen_k", seqlen_k)
    if p_dtype not in (*_SIXTEEN_BIT, torch.float32):
        raise TypeError(f"p_dtype must be float16, bfloat16 or float32, got {p_dtype}")
    p_max = math.log2(torch.finfo(p_dtype).max)
    l_max = math.log2(torch.finfo(torch.float32).max) - math.log2(seqlen_k)
    return min(p_max, l_max)


# ---------------------------------------------------------------------------------------------
# 5. Inputs: score patterns, the adversarial one (exercise 07.4), a late spike


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def _bias_channel(q: torch.Tensor, k: torch.Tensor, bias_nats: torch.Tensor, scale: float):
    """Add ``bias_nats[j]`` to every query's score with key j, exactly: channel 0 of q is 1/scale
    and channel 0 of key j is bias_j, so scale * q.k gains bias_j (one "position" feature)."""
    q = q.clone()
    k = k.clone()
    q[..., 0] = 1.0 / scale
    k[..., 0] = bias_nats.to(k.dtype)[None, :, None]
    return q, k


def adversarial_qkv(seqlen_k: int, tile_n: int = 128, tau: float = FA4_RESCALE_THRESHOLD,
                    kv_order: str = "reverse", seqlen_q: int = 64, dim: int = 64,
                    dtype=torch.float32, seed: int = 0):
    """Inputs whose running max grows by more than tau at EVERY KV tile, for every row (the
    reference for exercise 07.4). q, k, v in the course layout with one head.

    Construction: channel 0 of every query is a constant c; in each tile one "leader" key has
    p + 1 + offset in channel 0 (p: the tile's position in processing order) and zeros
    elsewhere; every other key has channel 0 = 0. The leader of step p scores exactly
    scale * c * (p + 1 + offset) nats: one step more per tile, for every query. c makes a step
    tau + 1 log2 units and is rounded to ``dtype`` first; the integers are exact in bf16 up to
    256 (hence the tile limit) and the products exact in float32. The other keys score about
    N(0, 1) nats, and the first leader sits >= 12 nats above 0, so no ordinary key leads a tile.
    """
    positive_int("seqlen_k", seqlen_k)
    positive_int("tile_n", tile_n)
    positive_int("seqlen_q", seqlen_q)
    positive_int("dim", dim)
    tau = _check_tau(tau)
    _check_choice("kv_order", kv_order, KV_ORDERS)
    if dim < 2:
        raise ValueError("dim must be >= 2: channel 0 carries the construction")
    if dtype not in (*_SIXTEEN_BIT, torch.float32, torch.float64):
        raise TypeError(f"dtype must be a floating point dtype, got {dtype}")
    scale = dim**-0.5
    step_nats = (tau + 1.0) * LN_2
    offset = math.ceil(12.0 / step_nats)  # the first leader sits >= 12 nats above the others
    n_tiles = -(-seqlen_k // tile_n)
    exact_up_to = {torch.bfloat16: 256, torch.float16: 2048}.get(dtype, 2**24)
    if n_tiles + offset > exact_up_to:
        raise ValueError(f"{n_tiles} tiles: the step counts are not exact in {dtype} beyond "
                         f"{exact_up_to - offset} tiles; use fewer tiles or float32")
    g = _generator(seed)
    q = torch.randn(1, seqlen_q, 1, dim, generator=g)
    k = torch.randn(1, seqlen_k, 1, dim, generator=g)
    v = torch.randn(1, seqlen_k, 1, dim, generator=g)
    q[..., 0] = float(torch.tensor(step_nats / scale).to(dtype))  # c, as the dtype holds it
    k[..., 0] = 0.0
    for p, start in enumerate(_tile_starts(seqlen_k, tile_n, kv_order)):
        k[0, start, 0, :] = 0.0
        k[0, start, 0, 0] = float(p + 1 + offset)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def late_spike_qkv(growth_log2: float, seqlen_k: int = 1024, tile_n: int = 128,
                   kv_order: str = "reverse", seqlen_q: int = 32, dim: int = 64,
                   dtype=torch.float32, seed: int = 0):
    """Ordinary N(0, 1)-nat scores plus one key, in the LAST tile processed, that beats every
    query's max by about ``growth_log2`` log2 units: the input that shows a too-large tau."""
    positive_int("seqlen_k", seqlen_k)
    if seqlen_k <= tile_n:
        raise ValueError(f"seqlen_k ({seqlen_k}) must exceed tile_n ({tile_n}): two tiles at least")
    scale = dim**-0.5
    g = _generator(seed)
    q = torch.randn(1, seqlen_q, 1, dim, generator=g)
    k = torch.randn(1, seqlen_k, 1, dim, generator=g)
    v = torch.randn(1, seqlen_k, 1, dim, generator=g)
    spike = _tile_starts(seqlen_k, tile_n, kv_order)[-1]
    bias = torch.zeros(seqlen_k)
    # the other scores stay below ~5 nats; the spike sits growth_log2 log2 units above that
    bias[spike] = 5.0 + growth_log2 * LN_2
    q, k = _bias_channel(q, k, bias, scale)
    k[0, spike, 0, 1:] = 0.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


def pattern_qkv(name: str, seqlen_k: int = 16384, seqlen_q: int = 128, heads: int = 2,
                dim: int = 128, seed: int = 0, *, tile_n: int = 128,
                tau: float = FA4_RESCALE_THRESHOLD, kv_order: str = "reverse",
                drift_nats: float = 32.0, sink_nats: float = 12.0):
    """float32 q, k, v (1, seqlen, heads, dim) whose scores follow a pattern; scale 1/sqrt(dim).

    random       q, k ~ N(0, 1): scores ~ N(0, 1) nats, like q.k at initialisation.
    sorted       keys sorted so every query's scores rise along the sequence (queries share a
                 direction c; keys ordered by c.k), as in strongly recency-biased heads.
    drift        random scores plus a linear bias rising by ``drift_nats`` over the sequence
                 (ALiBi-like recency, a slow drift of the max).
    sink         random scores plus ``sink_nats`` on key 0 for every query (attention sink).
    adversarial  ``adversarial_qkv``: the max grows by tau + 1 at every tile in ``kv_order``.
    """
    _check_choice("pattern", name, PATTERNS)
    for nm, val in (("seqlen_k", seqlen_k), ("seqlen_q", seqlen_q), ("heads", heads),
                    ("dim", dim)):
        positive_int(nm, val)
    if name == "adversarial":
        qkv = [adversarial_qkv(seqlen_k, tile_n, tau, kv_order, seqlen_q, dim, seed=seed + i)
               for i in range(heads)]
        return tuple(torch.cat([t[j] for t in qkv], dim=2) for j in range(3))
    scale = dim**-0.5
    g = _generator(seed)
    q = torch.randn(1, seqlen_q, heads, dim, generator=g)
    k = torch.randn(1, seqlen_k, heads, dim, generator=g)
    v = torch.randn(1, seqlen_k, heads, dim, generator=g)
    if name == "sorted":
        c = torch.randn(1, 1, heads, dim, generator=g)
        q = c + 0.5 * q
        order = torch.argsort((k * c).sum(-1), dim=1)  # (1, seqlen_k, heads), per head
        k = torch.gather(k, 1, order[..., None].expand_as(k))
    elif name in ("drift", "sink"):
        bias = torch.zeros(seqlen_k)
        if name == "drift":
            bias = torch.linspace(0.0, drift_nats, seqlen_k)
        else:
            bias[0] = sink_nats
        q, k = _bias_channel(q, k, bias, scale)
    return q, k, v


def tile_maxima(q, k, causal=False, softmax_scale=None, tile_n=128, kv_order="reverse"):
    """(batch, heads, seqlen_q, n_tiles) float32: each tile's max score per row, log2 units,
    tiles in processing order, -inf where a tile has no visible key for the row."""
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, k, softmax_scale)
    positive_int("tile_n", tile_n)
    _check_choice("kv_order", kv_order, KV_ORDERS)
    scale_log2 = (d**-0.5 if softmax_scale is None else float(softmax_scale)) * LOG2_E
    s = torch.matmul(_heads_first(q, h), _heads_first(k, h).transpose(-1, -2)) * scale_log2
    if causal:
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(~visible, float("-inf"))
    n_tiles = -(-sk // tile_n)
    pad = n_tiles * tile_n - sk
    if pad:
        s = torch.cat([s, s.new_full((b, h, sq, pad), float("-inf"))], dim=-1)
    tmax = s.reshape(b, h, sq, n_tiles, tile_n).amax(dim=-1)
    return tmax.flip(-1) if kv_order == "reverse" else tmax


FP32_SMALLEST_NORMAL = 2.0**-126  # ex2.approx.ftz returns 0 below it


def p_zero_share(q, k, softmax_scale=None, tile_n=128, kv_order="reverse") -> float:
    """The share of P entries that are exactly 0 when the kernel computes them with tau = 0
    (no mask): each tile's p = 2^(s - m) against the running max after that tile, in the
    visiting order, and ``ex2.approx.ftz`` flushes anything below 2^-126 to zero. Zeros are
    what the P.V matmul then multiplies: data-dependent work for the multipliers, not for the
    instruction stream, which is the same for every input."""
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, k, softmax_scale)
    scale_log2 = (d**-0.5 if softmax_scale is None else float(softmax_scale)) * LOG2_E
    s = torch.matmul(_heads_first(q, h), _heads_first(k, h).transpose(-1, -2)) * scale_log2
    zeros = total = 0
    m = torch.full(s.shape[:-1], float("-inf"))
    for start in _tile_starts(sk, tile_n, kv_order):
        tile = s[..., start:start + tile_n]
        m = torch.maximum(m, tile.amax(dim=-1))
        p = torch.exp2(tile - m[..., None])
        zeros += int((p < FP32_SMALLEST_NORMAL).sum())
        total += p.numel()
    return zeros / total


def rescale_frequency(patterns=PATTERNS, orders=KV_ORDERS, tau=FA4_RESCALE_THRESHOLD,
                      group_rows=(HOPPER_WARP_ROWS, BLACKWELL_WARP_ROWS), seqlen_k=16384,
                      seqlen_q=128, heads=2, dim=128, tile_n=128, seed=0) -> list[dict]:
    """One row per (pattern, order): the fraction of tile steps where the max grew at all
    (= where an always-rescale kernel multiplies O by alpha < 1), where it outran the max in use
    by more than tau (a rescale), and, per group size, the fraction of group decisions that
    multiply O (``group_rule="any"``): ``group{g}`` with the threshold, ``exact{g}`` with tau = 0
    (the true max always; a group skips the multiply only where none of its rows' maxima moved,
    fa4_final's ``rescale_skip_unchanged``). CPU-cheap: scores once per pattern, then a scan."""
    table = []
    for name in patterns:
        for order in orders:
            q, k, _ = pattern_qkv(name, seqlen_k, seqlen_q, heads, dim, seed, tile_n=tile_n,
                                  tau=tau, kv_order=order)
            tmax = tile_maxima(q, k, tile_n=tile_n, kv_order=order)
            stats = scan_tile_maxima(tmax, tau)
            row = {"pattern": name, "order": order, "steps": stats.steps,
                   "grew": stats.frac_grew, "rescaled": stats.frac_rescaled,
                   "max_p": stats.max_p}
            for g in group_rows:
                row[f"group{g}"] = scan_tile_maxima(tmax, tau, group_rows=g).frac_group
            for g in group_rows:
                row[f"exact{g}"] = scan_tile_maxima(tmax, 0.0, group_rows=g).frac_group
            table.append(row)
    return table


def format_frequency(table: list[dict]) -> str:
    """The rows of ``rescale_frequency`` as a plain-text table (percentages)."""
    groups = [c for c in table[0] if c.startswith(("group", "exact"))] if table else []

    def title(c):
        return f"any of {c[5:]}" if c.startswith("group") else f"tau=0, {c[5:]}"

    head = (f"{'pattern':<12}{'order':<9}{'steps':>8}{'grew':>9}{'rescaled':>10}"
            + "".join(f"{title(c):>11}" for c in groups) + f"{'largest p':>11}")
    lines = [head]
    for r in table:
        lines.append(f"{r['pattern']:<12}{r['order']:<9}{r['steps']:>8}{r['grew']:>9.1%}"
                     f"{r['rescaled']:>10.1%}" + "".join(f"{r[c]:>11.1%}" for c in groups)
                     + f"{r['max_p']:>11.4g}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 6. Checkers for the exercises (AssertionError in plain words)


def _close(a, b, atol=1e-5, rtol=1e-5) -> bool:
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape or torch.isnan(a).any():
        return False
    same_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    fin = torch.isfinite(a) & torch.isfinite(b)
    return bool((same_inf | (fin & ((a - b).abs() <= atol + rtol * b.abs()))).all())


def stale_max_example(seed: int = 3):
    """A finished row state with a stale max, for exercise 07.1 and the notebook: returns
    (o_acc, row_sum, m_used, out, lse, lag). Row i's m_used lags its true max by lag[i] log2
    units (0 to 8); the last row saw no key. out and lse (float64) are what finalize must give."""
    g = _generator(seed)
    rows, n, d = 6, 40, 8
    s = torch.randn(rows, n, generator=g, dtype=torch.float64) * 3
    vals = torch.randn(n, d, generator=g, dtype=torch.float64)
    lag = torch.tensor([0.0, 2.0, 5.0, 7.5, 8.0, 0.0], dtype=torch.float64)
    m_used = s.amax(-1) - lag
    p = torch.exp2(s - m_used[:, None])
    p[-1] = 0.0
    m_used[-1] = float("-inf")
    o_acc, row_sum = (p @ vals).float(), p.sum(-1).float()
    nat = s * LN_2
    want_out = torch.softmax(nat, -1) @ vals
    want_out[-1] = 0.0
    want_lse = torch.logsumexp(nat, -1)
    want_lse[-1] = float("-inf")
    return o_acc, row_sum, m_used.float(), want_out, want_lse, lag


def check_finalize(fn) -> None:
    """Exercise 07.1: fn(o_acc, row_sum, m_used) -> (out, lse)."""
    o_acc, row_sum, m_used, want_out, want_lse, lag = stale_max_example()
    got = fn(o_acc.clone(), row_sum.clone(), m_used.clone())
    assert isinstance(got, tuple) and len(got) == 2, "return a tuple (out, lse)"
    out, lse = (torch.as_tensor(x) for x in got)
    assert out.shape == want_out.shape, f"out should be {tuple(want_out.shape)}, got {out.shape}"
    assert lse.shape == want_lse.shape, f"lse should be {tuple(want_lse.shape)}, got {lse.shape}"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), (
        "NaN in the result: the last row saw no key (l = 0, m_used = -inf); it must give "
        "out = 0 and lse = -inf")
    assert bool((out[-1] == 0).all()) and lse[-1].item() == float("-inf"), (
        "the last row saw no key: out must be 0 and lse -inf")
    for i in range(len(lag) - 1):
        assert _close(out[i], want_out[i], atol=1e-5, rtol=1e-4), (
            f"row {i} (max in use {lag[i]:g} log2 units below the true max): out is wrong, "
            f"max error {float((out[i].double() - want_out[i]).abs().max()):.3g}; out = O / l")
        err = float(lse[i].double() - want_lse[i])
        assert abs(err) <= 1e-4, (
            f"row {i} (max in use {lag[i]:g} log2 units below the true max): lse is off by "
            f"{err:+.4g}. m_used and log2 l are in log2 units; the natural-log LSE is "
            "ln 2 * (m_used + log2 l), with the max that was actually subtracted")


FORBID_FINALIZE = {lse_from_state: "that is chapter 02's LSE; write ln 2 * (m + log2 l)"}


def check_adversarial(fn) -> None:
    """Exercise 07.4: fn(seqlen_k, tile_n=..., tau=..., kv_order=...) -> (q, k, v) whose running
    max grows by more than tau at every KV tile, for every row."""
    cases = [(1000, 128, 8.0, "reverse"), (777, 64, 8.0, "forward"), (512, 32, 3.0, "reverse")]
    for seqlen_k, tile_n, tau, order in cases:
        what = f"seqlen_k={seqlen_k}, tile_n={tile_n}, tau={tau}, kv_order={order!r}"
        got = fn(seqlen_k, tile_n=tile_n, tau=tau, kv_order=order)
        assert isinstance(got, tuple) and len(got) == 3, "return a tuple (q, k, v)"
        q, k, v = got
        try:
            check_attention_inputs(q, k, v)
        except (TypeError, ValueError) as exc:
            raise AssertionError(
                f"{what}: the inputs are not valid attention inputs: {exc}") from None
        assert k.shape[1] == seqlen_k, f"{what}: k should have {seqlen_k} keys, got {k.shape[1]}"
        for name, t in (("q", q), ("k", k), ("v", v)):
            assert torch.isfinite(t).all(), f"{what}: {name} has inf or NaN entries"
        tmax = tile_maxima(q, k, tile_n=tile_n, kv_order=order)
        stats, tr = scan_tile_maxima(tmax, tau, trace=True)
        n_tiles = tmax.shape[-1]
        want = tmax.shape[0] * tmax.shape[1] * tmax.shape[2] * (n_tiles - 1)
        if stats.rescaled != want:
            missed = ~tr["rescaled"][..., 1:]
            where = missed.nonzero()[0].tolist()
            t = where[-1] + 1
            grow = (tmax[..., t] - tr["m_used"][..., t - 1])[tuple(where[:-1])].item()
            raise AssertionError(
                f"{what}: {stats.rescaled} of {want} tile steps rescaled. First miss: tile "
                f"{t} in processing order ({order}), where the max grew by {grow:.3g} log2 units "
                f"over the max in use; it must grow by more than tau = {tau}. Remember the "
                "kernel order: 'reverse' visits the LAST tile first.")


# ---------------------------------------------------------------------------------------------
# 8. Exercises 07.2 and 07.3 (device code): a warp's rows run on the CPU, compiled, on a GPU
#
# The exercises' kernel gives each lane of a warp two whole rows (lane l: rows l and l + 32 of
# the warp's 64), so no shuffle is needed and the warp's only conversation is the vote. (In
# chapter 05's kernel four lanes share a row; in FA4's Blackwell softmax one thread owns a row.)
# Scores arrive in log2 units, TILE_COLS keys per tile; O has HEAD_DIM columns.
#
# Note [A warp on the CPU]
# The learner's @cute.jit function runs as plain Python once per lane, in 32 threads: each lane
# holds its registers as NumPy float32 scalars and arrays, and cute.arch.vote_any_sync becomes a
# meeting of the 32 threads (a barrier) that answers all of them with the any() of their
# predicates. A lane that skips the vote while the others wait in it is a divergent vote, and the
# meeting says so. The other DSL calls become their NumPy models: fmax, ex2 (float32(2^x),
# flushed to zero below 2^-126), make_rmem_tensor (a zeroed array). So the checker sees every
# lane's decisions, tile by tile, and can say which row of which lane went wrong, and how.

WARP = 32
ROWS_PER_LANE = 2
WARP_ROWS = WARP * ROWS_PER_LANE
TILE_COLS = 16
HEAD_DIM = 8


@cute.jit
def running_max(row_max, tile_max, tau: cutlass.Constexpr):
    """Exercise 07.2's reference (fa4_final.common.softmax, Note [Warp vote], rows deciding alone):
    each row keeps its max unless this tile raised it by more than ``tau`` (log2 units); the
    warp votes whether any of its rows moved, and that vote alone decides O's multiply.
    Returns (the max each row subtracts from now on, a new register tensor; the vote)."""
    m_used = cute.make_rmem_tensor(cute.size(row_max), Float32)
    moved = cutlass.Boolean(False)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        m_new = cute.arch.fmax(row_max[r], tile_max[r])
        # +inf at a row's first key (it must move); NaN while it has none: NaN > tau is False
        grew = m_new - row_max[r] > Float32(tau)
        m_used[r] = m_new if grew else row_max[r]
        moved = moved | grew
    return m_used, cute.arch.vote_any_sync(moved)


@cute.jit
def softmax_step(s, row_max, row_sum, acc_o, tau: cutlass.Constexpr):
    """Exercise 07.3's reference: one KV tile for this lane's rows. ``s`` (rows, cols): the
    tile's scores in log2 units, becomes p in place; ``row_max``, ``row_sum`` (rows,): the
    running state, updated; ``acc_o`` (rows, d): O, multiplied by alpha only when the warp's
    vote says a row moved. The exponentials depend on each row's own decision, never on the
    vote (Note [Warp vote])."""
    rows = cute.size(s, mode=[0])
    cols = cute.size(s, mode=[1])
    tile_max = cute.make_rmem_tensor(rows, Float32)
    for r in cutlass.range_constexpr(rows):
        m = s[r, 0]
        for c in cutlass.range_constexpr(1, cols):
            m = cute.arch.fmax(m, s[r, c])
        tile_max[r] = m
    m_used, multiply_o = running_max(row_max, tile_max, tau)
    alpha = cute.make_rmem_tensor(rows, Float32)
    for r in cutlass.range_constexpr(rows):
        # a row that has seen no key keeps -inf: subtract 0 instead, p = 2^-inf = 0
        m_safe = Float32(0.0) if m_used[r] == -Float32.inf else m_used[r]
        alpha[r] = cute.math.exp2(row_max[r] - m_safe, fastmath=True)  # 1 if the max was kept
        total = Float32(0.0)
        for c in cutlass.range_constexpr(cols):
            s[r, c] = cute.math.exp2(s[r, c] - m_safe, fastmath=True)
            total = total + s[r, c]
        row_sum[r] = row_sum[r] * alpha[r] + total
        row_max[r] = m_used[r]
    if multiply_o:
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cute.size(acc_o, mode=[1])):
                acc_o[r, c] = acc_o[r, c] * alpha[r]


def _forbid_tables():
    from fa4_final.common.softmax import OnlineSoftmax

    running = {
        OnlineSoftmax.running_max_to_use: "that is the package's version; write your own",
        conditional_update: "that is the PyTorch model of the decision, not device code",
        _decide: "that is the PyTorch model of the decision, not device code",
    }
    step = {
        softmax_step: "that is the reference step",
        OnlineSoftmax.update: "that is the package's step; write your own",
        OnlineSoftmax.exponentiate: "that is the package's step; write your own",
        _fold: "that is the PyTorch model of the step, not device code",
    }
    return running, step


FORBID_RUNNING_MAX, FORBID_STEP = _forbid_tables()


class _Diverged(Exception):
    pass


class WarpEmulator:
    """32 lanes as Python threads running the same code; a warp vote is a meeting of all of
    them (Note [A warp on the CPU]). ``votes`` logs (tile, the lanes' predicates, the answer)."""

    def __init__(self, lanes: int = WARP, timeout: float = 30.0):
        import threading

        self.lanes = lanes
        self.local = threading.local()
        self.arrived: list = [None] * lanes
        self.answer = None
        self.error: str | None = None
        self.votes: list = []
        self.barrier = threading.Barrier(lanes, action=self._meet, timeout=timeout)

    def _meet(self):
        kinds = {a[:2] for a in self.arrived}
        if len(kinds) > 1:
            tile = min(a[1] for a in self.arrived)
            voting = [i for i, a in enumerate(self.arrived) if a[0] == "vote"]
            others = [i for i, a in enumerate(self.arrived) if a[0] != "vote"]
            self.error = (
                f"at tile {tile} lanes {_lane_ranges(voting)} reached vote_any_sync and lanes "
                f"{_lane_ranges(others)} did not: a warp vote needs every lane of the warp "
                "(vote.sync with the full mask), so it must not sit inside a branch that only "
                "some lanes take")
            return
        if self.arrived[0][0] == "vote":
            preds = [a[2] for a in self.arrived]
            self.answer = any(preds)
            self.votes.append((self.arrived[0][1], preds, self.answer))

    def _wait(self):
        import threading

        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise _Diverged() from None
        if self.error:
            raise _Diverged()

    def vote_any(self, pred, mask=None, **_):
        self.arrived[self.local.lane] = ("vote", self.local.tile, bool(pred))
        self._wait()
        return np.bool_(self.answer)

    def end_step(self):
        self.arrived[self.local.lane] = ("end", self.local.tile)
        self._wait()

    def run(self, lane_fn) -> list:
        """``lane_fn(lane)`` on every lane at once; returns the lanes' results. A lane's
        exception is raised here (the first one), a divergent vote as AssertionError."""
        import threading

        results: list = [None] * self.lanes
        failures: list = []

        def main(lane):
            self.local.lane, self.local.tile = lane, 0
            try:
                with np.errstate(all="ignore"):
                    results[lane] = lane_fn(lane)
            except _Diverged:
                pass
            except BaseException as exc:  # noqa: BLE001  (re-raised below, with its lane)
                failures.append((lane, exc))
                self.barrier.abort()

        threads = [threading.Thread(target=main, args=(lane,)) for lane in range(self.lanes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise min(failures, key=lambda f: f[0])[1]
        if self.error:
            raise AssertionError(self.error)
        return results


def _lane_ranges(lanes: list[int]) -> str:
    if not lanes:
        return "none"
    runs, start = [], lanes[0]
    for a, b in zip(lanes, lanes[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(runs)


class _Scalar:
    """The DSL's Float32 / Int32 / Boolean for one lane: NumPy scalars."""

    def __init__(self, kind):
        self.kind = kind

    def __call__(self, value=0):
        return {"Float32": np.float32, "Int32": np.int32, "Boolean": np.bool_}[self.kind](value)


def _lane_types():
    import cutlass as cutlass_mod

    types = {}
    for kind in ("Float32", "Int32", "Boolean"):
        attrs = {"__new__": lambda cls, v=0, k=kind: _Scalar(k)(v), "_emu_kind": kind}
        if kind == "Float32":
            attrs["inf"] = np.float32(np.inf)
        types[getattr(cutlass_mod, kind)] = type(kind, (), attrs)
    return types


def _lane_fmax(a, b, *, nan=False, **_):
    a, b = np.float32(a), np.float32(b)
    return np.float32(np.maximum(a, b) if nan else np.fmax(a, b))


def lane_ex2(x, fastmath=False, **_) -> np.float32:
    """MUFU's ``ex2.approx.ftz.f32`` for one lane: float32(2^x), flushed to zero below 2^-126."""
    x = np.float32(x)
    if abs(x) < np.float32(2.0**-126):
        x = np.float32(0.0)
    y = np.float32(np.exp2(np.float64(x)))
    return np.float32(0.0) if y < np.float32(2.0**-126) else y


def _make_rmem(shape, dtype=None, **_):
    kind = getattr(dtype, "_emu_kind", getattr(dtype, "__name__", "Float32"))
    return np.zeros(shape, dtype=np.bool_ if kind == "Boolean" else np.float32)


def _size(t, mode=None, **_):
    shape = np.shape(t) if not hasattr(t, "shape") else t.shape
    if mode is None:
        return int(np.prod(shape))
    return int(np.prod([shape[m] for m in mode]))


def _is_jit(obj) -> bool:
    try:
        return callable(obj) and getattr(obj, "_dsl_cls", None) is not None
    except Exception:  # noqa: BLE001  (an object whose attribute lookup itself fails)
        return False


def _emulation_swap(fn, warp: WarpEmulator):
    """({DSL object: stand-in}, modules to patch) for running ``fn`` on ``warp``'s lanes; the
    @cute.jit functions ``fn`` calls (by a global name or through this module) are emulated
    too."""
    import sys

    import cutlass as cutlass_mod
    import cutlass.cute as cute_mod

    from solutions.ch06_exp2 import _undecorated, swapped
    from utils.host_emulation import _const_expr, _PyRange

    this = sys.modules[__name__]
    swap = {
        cute_mod.arch.fmax: _lane_fmax, cute_mod.math.exp2: lane_ex2,
        cute_mod.make_rmem_tensor: _make_rmem, cute_mod.size: _size,
        cute_mod.arch.vote_any_sync: warp.vote_any,
        cute_mod.arch.lane_idx: lambda **_: np.int32(warp.local.lane),
        cutlass_mod.range: _PyRange, cutlass_mod.range_constexpr: _PyRange,
        cutlass_mod.const_expr: _const_expr,
        **_lane_types(),
    }
    modules = [this, cute_mod, cute_mod.arch, cute_mod.math, cutlass_mod]
    jits = {}
    for source in (_undecorated(fn)[0].__globals__, vars(this)):
        for value in source.values():
            if _is_jit(value) and value is not fn:
                jits[id(value)] = value
    targets: dict = {}
    for key, jit in jits.items():
        swap[jit] = (lambda k: lambda *a, **kw: targets[k](*a, **kw))(key)
    for key, jit in jits.items():
        targets[key] = swapped(jit, swap, modules)[0]
    clone, patches = swapped(fn, swap, modules)
    return clone, patches


class RecordedO:
    """A lane's O accumulator (rows, d) that counts the writes made to it."""

    def __init__(self, a):
        self.a = np.array(a, dtype=np.float32)
        self.shape = self.a.shape
        self.size = self.a.size
        self.writes = 0

    def __getitem__(self, key):
        return self.a[key]

    def __setitem__(self, key, value):
        self.a[key] = value
        self.writes += 1

    def fill(self, value):
        self.a.fill(value)


# --- the cases the checks run: (name, scores (64, keys) log2 units, tau) ------------------------


def _rule(m_old: np.ndarray, m_tile: np.ndarray, tau: float) -> tuple[np.ndarray, np.ndarray]:
    """(m_used, moved) of rows deciding alone, in float32 as the lanes compute it."""
    with np.errstate(invalid="ignore"):
        m_new = np.fmax(m_old, m_tile).astype(np.float32)
        grew = (m_new - m_old) > np.float32(tau)
    return np.where(grew, m_new, m_old).astype(np.float32), grew


def vote_cases() -> list[tuple[str, np.ndarray, np.ndarray, float]]:
    """Exercise 07.2's cases: (what, old maxima (64,), tile maxima (64,), tau)."""
    ninf = -np.inf
    g = np.random.default_rng(71)
    base = g.uniform(-4, 4, WARP_ROWS).astype(np.float32)
    cases = []
    small = base + g.uniform(-3, 8, WARP_ROWS).astype(np.float32)
    small[5] = base[5] + 8.0  # grows by exactly tau: keeps
    cases.append(("every row grew by at most tau = 8 (row 5 by exactly 8)", base, small, 8.0))
    one = base + g.uniform(-3, 7.9, WARP_ROWS).astype(np.float32)
    one[39] = base[39] + 9.0
    cases.append(("one row (row 39, lane 7's second) grew by 9 > tau = 8", base, one, 8.0))
    first = base.copy()
    first[:16] = ninf
    tile = base + 1.0
    tile[8:16] = ninf
    cases.append(("rows 0-7 see their first key, rows 8-15 still see none", first, tile, 8.0))
    nothing = np.full(WARP_ROWS, ninf, dtype=np.float32)
    cases.append(("every key of the tile is masked", base, nothing, 8.0))
    cases.append(("tau = 0: a row moves whenever its max grew", base,
                  (base + g.normal(0, 1, WARP_ROWS)).astype(np.float32), 0.0))
    wide = (base + g.uniform(-6, 6, WARP_ROWS)).astype(np.float32)
    cases.append(("tau = 2, random growth", base, wide, 2.0))
    return [(w, np.asarray(o, np.float32), np.asarray(t, np.float32), tau)
            for w, o, t, tau in cases]


def _lane_rows(lane: int) -> list[int]:
    return [lane + WARP * r for r in range(ROWS_PER_LANE)]


def _row_name(row: int) -> str:
    return f"row {row} (lane {row % WARP}'s row {row // WARP})"


def emulate_running_max(fn, old: np.ndarray, tile: np.ndarray, tau: float):
    """``fn`` on a warp of 32 lanes, two rows each: (m_used (64,), vote per lane (32,), whether
    a lane changed its inputs)."""
    warp = WarpEmulator()
    clone, patches = _emulation_swap(fn, warp)

    def lane_fn(lane):
        rows = _lane_rows(lane)
        row_max, tile_max = old[rows].copy(), tile[rows].copy()
        out = clone(row_max, tile_max, tau)
        warp.end_step()
        return out, not (np.array_equal(row_max, old[rows], equal_nan=True)
                         and np.array_equal(tile_max, tile[rows], equal_nan=True))

    with patches():
        results = warp.run(lane_fn)
    m_used = np.zeros(WARP_ROWS, dtype=np.float32)
    votes, changed = [], False
    for lane, (out, touched) in enumerate(results):
        if not (isinstance(out, tuple) and len(out) == 2):
            raise AssertionError("return a pair (m_used, the warp's vote)")
        m, vote = out
        m = np.asarray(m, dtype=np.float32)
        if m.shape != (ROWS_PER_LANE,):
            raise AssertionError(f"m_used must hold one max per row of the lane, shape "
                                 f"({ROWS_PER_LANE},); lane {lane} returned shape {m.shape}")
        m_used[_lane_rows(lane)] = m
        votes.append(bool(vote))
        changed |= touched
    return m_used, np.array(votes), changed


def check_running_max(fn, compile_check: bool = True) -> None:
    """Exercise 07.2: ``fn(row_max, tile_max, tau)`` run on a warp of 32 lanes on the CPU (Note
    [A warp on the CPU]) for every case of ``vote_cases``: each row keeps its max unless it grew
    by more than tau, a row with no key keeps -inf (no NaN), the vote is the same in every lane
    and says whether any row of the warp moved; then compiled for sm_90a: a warp vote in the
    SASS."""
    for what, old, tile, tau in vote_cases():
        m_used, votes, changed = emulate_running_max(fn, old, tile, tau)
        want, moved = _rule(old, tile, tau)
        assert not changed, (
            f"{what}: your function changed row_max or tile_max in place; return the new "
            "maxima in a new register tensor (cute.make_rmem_tensor): the step still needs the "
            "old max for alpha")
        nan = np.flatnonzero(np.isnan(m_used))
        assert not nan.size, (
            f"{what}: {_row_name(nan[0])} got a NaN max. With no key yet, -inf - (-inf) is "
            "NaN; compare so that NaN counts as 'did not grow' and keep -inf")
        for row in np.flatnonzero(m_used != want):
            growth = float(np.fmax(old[row], tile[row]) - old[row])
            if moved[row]:
                raise AssertionError(
                    f"{what}: {_row_name(row)} grew by {growth:g} > tau = {tau:g} but kept the "
                    f"max {old[row]:g}: a stale max more than tau behind lets p exceed 2^tau "
                    "(Note [Why tau = 8 is safe]); it must move to the new max")
            if np.isfinite(growth) and m_used[row] == np.fmax(old[row], tile[row]):
                raise AssertionError(
                    f"{what}: {_row_name(row)} grew by only {growth:g} <= tau = {tau:g} but "
                    "moved its max. Each row decides alone: it keeps its max unless it grew by "
                    "more than tau (a growth of exactly tau keeps it); the vote decides only "
                    "O's multiply, never a row's max")
            raise AssertionError(
                f"{what}: {_row_name(row)} should subtract {want[row]:g} from now on, your "
                f"function says {m_used[row]:g}")
        if len(set(votes.tolist())) > 1:
            yes = [i for i, v in enumerate(votes) if v]
            no = [i for i, v in enumerate(votes) if not v]
            raise AssertionError(
                f"{what}: the decision is not the same in every lane (lanes {_lane_ranges(yes)} "
                f"say multiply O, lanes {_lane_ranges(no)} say skip): a per-lane branch "
                "diverges. Let the warp vote: cute.arch.vote_any_sync(moved)")
        if votes[0] != bool(moved.any()):
            if moved.any():
                rows = np.flatnonzero(moved)
                raise AssertionError(
                    f"{what}: {_row_name(rows[0])} moved its max but the warp's vote says skip "
                    "O's multiply: O would keep the old scale while l takes the new one. Vote "
                    "on whether ANY row of the lane moved (both of its rows)")
            raise AssertionError(
                f"{what}: no row of the warp moved its max, yet the vote says multiply O: the "
                "skip then saves nothing. Vote on 'moved', i.e. grew by more than tau")
    if compile_check:
        ptx = compile_vote_kernel(fn).ptx
        assert "vote.sync" in ptx, (
            "compiled for sm_90a the function has no warp vote (vote.sync): the lanes must "
            "agree on O's multiply through cute.arch.vote_any_sync")


# --- exercise 07.3: the step ------------------------------------------------------------------


@dataclass
class StepCase:
    what: str
    scores: np.ndarray  # (rows, keys) log2 units, -inf where masked
    v: np.ndarray  # (keys, HEAD_DIM)
    tau: float


def _late_growth_scores(g, rows: int, keys: int, tau: float) -> np.ndarray:
    """Ordinary scores, except that every other row's max jumps by tau + 1 in each of the last
    four tiles: rows moving late, next to rows that never move."""
    s = g.normal(0, 2, (rows, keys)).astype(np.float32)
    tiles = -(-keys // TILE_COLS)
    for k, t in enumerate(range(max(tiles - 4, 1), tiles)):
        col = min(t * TILE_COLS + 3, keys - 1)
        s[::2, col] = 6.0 + (k + 1) * (tau + 1.0)
    return s


def step_cases(rows: int = WARP_ROWS, keys: int = 6 * TILE_COLS, seed: int = 74) -> list:
    """Exercise 07.3's cases: random scores; wide ones with a small tau (mixed decisions); the
    late growth; rows that see no key for a while, and one that never does; tau = 0."""
    g = np.random.default_rng(seed)

    def v():
        return g.normal(0, 1, (keys, HEAD_DIM)).astype(np.float32)

    cases = [StepCase("random scores, tau = 8", g.normal(0, 2, (rows, keys)).astype(np.float32),
                      v(), 8.0),
             StepCase("wide random scores, tau = 2 (rows disagree)",
                      g.normal(0, 4, (rows, keys)).astype(np.float32), v(), 2.0),
             StepCase("every other row's max grows by more than tau late, tau = 8",
                      _late_growth_scores(g, rows, keys, 8.0), v(), 8.0)]
    masked = g.normal(0, 2, (rows, keys)).astype(np.float32)
    masked[: rows // 4, : 3 * TILE_COLS] = -np.inf  # see no key for three tiles
    masked[1] = -np.inf  # never sees a key: out 0, lse -inf
    cases.append(StepCase("rows with no key for three tiles, one with none at all, tau = 8",
                          masked, v(), 8.0))
    cases.append(StepCase("random scores, tau = 0", g.normal(0, 2, (rows, keys))
                          .astype(np.float32), v(), 0.0))
    return cases


def reference_attention(scores: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 softmax in base 2 of ``scores`` (rows, keys) times ``v``: (out, lse, natural
    log); a row with no key gets out 0 and lse -inf."""
    s = scores.astype(np.float64)
    m = np.max(s, axis=1, keepdims=True)
    seen = np.isfinite(m[:, 0])
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp2(s - m)
    total = w.sum(axis=1)
    out = np.where(seen[:, None], (w @ v.astype(np.float64)) / np.where(seen, total, 1)[:, None],
                   0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, (m[:, 0] + np.log2(total)) * LN_2, -np.inf)
    return out, lse


@dataclass
class StepTrace:
    """What the emulated warp did at each tile, per row: the state before and after the step,
    p, the vote, whether O was written."""

    row_max: list  # per tile: (rows,) before the step; and a last entry after the last tile
    row_sum: list
    p: list  # per tile: (rows, TILE_COLS) after the step
    o_before: list  # per tile: (rows, d)
    o_after: list
    o_writes: list  # per tile: (lanes,)
    votes: list  # per tile: the warp's answer, or None when no vote was taken
    out: np.ndarray
    lse: np.ndarray


def emulate_step(fn, case: StepCase) -> StepTrace:
    """The exercise's kernel, lane by lane on the CPU, with ``fn`` as its step: for each tile,
    load the scores, call the step, then O += P V; at the end out = O / l, lse = ln 2 (m +
    log2 l). Rows beyond the case's are padded as rows with no key."""
    rows, keys = case.scores.shape
    assert rows == WARP_ROWS, "the emulation runs one warp of 64 rows"
    tiles = -(-keys // TILE_COLS)
    pad = tiles * TILE_COLS - keys
    scores = np.concatenate([case.scores, np.full((rows, pad), -np.inf, np.float32)], axis=1)
    v = np.concatenate([case.v, np.zeros((pad, HEAD_DIM), np.float32)])
    warp = WarpEmulator()
    clone, patches = _emulation_swap(fn, warp)

    def lane_fn(lane):
        r = _lane_rows(lane)
        row_max = np.full(ROWS_PER_LANE, -np.inf, np.float32)
        row_sum = np.zeros(ROWS_PER_LANE, np.float32)
        acc = RecordedO(np.zeros((ROWS_PER_LANE, HEAD_DIM), np.float32))
        log = []
        for t in range(tiles):
            warp.local.tile = t
            s = scores[r, t * TILE_COLS:(t + 1) * TILE_COLS].copy()
            before = (row_max.copy(), row_sum.copy(), acc.a.copy())
            acc.writes = 0
            clone(s, row_max, row_sum, acc, case.tau)
            log.append((*before, s.copy(), acc.a.copy(), acc.writes))
            warp.end_step()
            acc.a += (s.astype(np.float32) @ v[t * TILE_COLS:(t + 1) * TILE_COLS]).astype(
                np.float32)
        seen = row_sum > 0
        out = np.where(seen[:, None], acc.a / np.where(seen, row_sum, 1)[:, None], 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            lse = np.where(seen, (row_max + np.log2(row_sum)) * np.float32(LN_2), -np.inf)
        return log, row_max.copy(), row_sum.copy(), out, lse

    with patches():
        lanes = warp.run(lane_fn)
    trace = StepTrace([], [], [], [], [], [], [], np.zeros((rows, HEAD_DIM)), np.zeros(rows))
    by_tile = {t: answer for t, _, answer in warp.votes}
    for t in range(tiles):
        rm, rs, p, ob, oa = (np.zeros((rows,) + shape, np.float32) for shape in
                             ((), (), (TILE_COLS,), (HEAD_DIM,), (HEAD_DIM,)))
        writes = np.zeros(WARP, dtype=np.int64)
        for lane, (log, *_rest) in enumerate(lanes):
            idx = _lane_rows(lane)
            rm[idx], rs[idx], ob[idx], p[idx], oa[idx], writes[lane] = log[t]
        for name, val in (("row_max", rm), ("row_sum", rs), ("p", p), ("o_before", ob),
                          ("o_after", oa), ("o_writes", writes)):
            getattr(trace, name).append(val)
        trace.votes.append(by_tile.get(t))
    final_m, final_l = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    for lane, (_, m, lsum, out, lse) in enumerate(lanes):
        idx = _lane_rows(lane)
        final_m[idx], final_l[idx], trace.out[idx], trace.lse[idx] = m, lsum, out, lse
    trace.row_max.append(final_m)
    trace.row_sum.append(final_l)
    return trace


def _tile_maxima(case: StepCase, t: int) -> np.ndarray:
    cols = case.scores[:, t * TILE_COLS:(t + 1) * TILE_COLS]
    return np.max(cols, axis=1) if cols.shape[1] else np.full(cols.shape[0], -np.inf)


def _step_mistake(case: StepCase, tr: StepTrace) -> str | None:
    """The first thing the emulated warp did wrong, tile by tile, in words (None: nothing)."""
    tiles = len(tr.p)
    for t in range(tiles):
        m_old, m_after = tr.row_max[t], tr.row_max[t + 1]
        l_old, l_after = tr.row_sum[t], tr.row_sum[t + 1]
        want, moved = _rule(m_old, _tile_maxima(case, t), case.tau)
        where = f"{case.what}, tile {t}"
        for row in np.flatnonzero(~((m_after == want) | (np.isnan(m_after) & np.isnan(want)))):
            growth = float(np.fmax(m_old[row], _tile_maxima(case, t)[row]) - m_old[row])
            if m_after[row] == m_old[row] and moved[row]:
                return (f"{where}: {_row_name(row)} grew by {growth:g} > tau but row_max still "
                        f"holds {m_old[row]:g}: store the max the row subtracted "
                        "(row_max[r] = m_used[r]), or the next tile compares against a max "
                        "that is no longer the one in use")
            return (f"{where}: {_row_name(row)} should hold the max {want[row]:g} after the "
                    f"step (it grew by {growth:g}, tau = {case.tau:g}); row_max holds "
                    f"{m_after[row]:g}")
        m_safe = np.where(np.isfinite(want), want, 0).astype(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            arg = (case.scores[:, t * TILE_COLS:(t + 1) * TILE_COLS].astype(np.float64)
                   - m_safe[:, None])
            p_want = np.exp2(arg)
        cols = p_want.shape[1]
        p_got = tr.p[t][:, :cols].astype(np.float64)
        # s - m is rounded to float32 in the lane: a relative error of |s - m| 2^-24 ln 2 in p
        slack = np.where(np.isfinite(arg), 2e-6 + np.abs(arg) * 2.0**-22, 0.0)
        with np.errstate(invalid="ignore"):
            bad = ~((p_got == p_want) | (np.abs(p_got - p_want) <= slack * p_want + 1e-37))
        if bad.any():
            row = int(np.flatnonzero(bad.any(axis=1))[0])
            return (f"{where}: {_row_name(row)}'s p is not 2^(s - m) with the max it keeps "
                    f"({want[row]:g}): the exponentials must subtract that max (0 while the row "
                    "has seen no key), in place in s")
        if bool(np.any(p_got > 2.0**case.tau * (1 + 1e-6))):
            return f"{where}: a p exceeds 2^tau"
        with np.errstate(invalid="ignore", over="ignore"):
            alpha = np.where(np.isfinite(m_old), np.exp2(m_old.astype(np.float64) - m_safe), 0.0)
        l_want = alpha * l_old + p_want.sum(axis=1)
        bad = ~np.isclose(l_after, l_want, rtol=1e-5, atol=1e-30)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            if np.isclose(l_after[row], l_old[row] + p_want[row].sum(), rtol=1e-5):
                return (f"{where}: {_row_name(row)} moved its max from {m_old[row]:g} to "
                        f"{want[row]:g}, but its row sum was not multiplied by alpha = "
                        f"2^(m_old - m_new) = {alpha[row]:.3g}: l keeps terms scaled to the old "
                        "max while the new p are scaled to the new one. l = alpha * l + sum(p)")
            return (f"{where}: {_row_name(row)}'s row sum should be alpha * l + sum(p) = "
                    f"{l_want[row]:.6g}, it is {l_after[row]:.6g}")
        writes = tr.o_writes[t]
        if len(set((writes > 0).tolist())) > 1:
            yes = [i for i, w in enumerate(writes) if w]
            no = [i for i, w in enumerate(writes) if not w]
            return (f"{where}: lanes {_lane_ranges(yes)} multiplied O and lanes "
                    f"{_lane_ranges(no)} did not: O's multiply diverges within the warp. Put "
                    "it under the warp's vote (if multiply_o:)")
        any_moved = bool(moved.any())
        if tr.votes[t] is None:
            return (f"{where}: the warp took no vote: O's multiply must be decided by the warp "
                    "together (running_max's vote)")
        if writes.any() and not any_moved:
            return (f"{where}: no row of the warp moved its max, yet O was multiplied: that is "
                    "the work the vote exists to skip (multiply only if multiply_o)")
        o_want = alpha[:, None] * tr.o_before[t]
        bad = ~np.isclose(tr.o_after[t], o_want, rtol=1e-5, atol=1e-30)
        if bad.any():
            row = int(np.flatnonzero(bad.any(axis=1))[0])
            return (f"{where}: {_row_name(row)} moved its max (alpha = {alpha[row]:.3g}) but "
                    "its O was not multiplied by alpha: O and l must carry the same scale, so "
                    "when the vote says multiply, every row's O is multiplied by its own alpha")
    return None


def check_softmax_step(fn, compile_check: bool = True) -> None:
    """Exercise 07.3: ``fn(s, row_max, row_sum, acc_o, tau)`` as the step of the exercise's
    kernel, run on a warp of 32 lanes on the CPU for every case of ``step_cases``, tile by
    tile: each row's max (kept unless it grew by more than tau), p against it, the row sum
    corrected by alpha, O multiplied only when the warp's vote says so and then by alpha; the
    result against float64. Then compiled for sm_90a (``vote_in_sass``): the vote is there, the
    exponentials do not wait for it, and O's multiply does."""
    for case in step_cases():
        tr = emulate_step(fn, case)
        mistake = _step_mistake(case, tr)
        if mistake:
            raise AssertionError(mistake)
        want_out, want_lse = reference_attention(case.scores, case.v)
        err = np.abs(tr.out - want_out).max()
        assert err <= 2e-5, (
            f"{case.what}: out differs from float64 by {err:.2g} although every step looked "
            "right: check the end of the row (O / l)")
        seen = np.isfinite(want_lse)
        assert np.array_equal(np.isfinite(tr.lse), seen) and (
            np.abs(tr.lse[seen] - want_lse[seen]).max() <= 2e-5), (
            f"{case.what}: lse differs from float64")
    if compile_check:
        facts = vote_in_sass(compile_step_kernel(fn).sass)
        assert facts["vote"], (
            "compiled for sm_90a the step has no warp vote (VOTE.ANY) in its KV loop")
        assert not facts["exponentials wait for the vote"], (
            "compiled for sm_90a, an instruction before the first exponential of the KV loop "
            "reads the vote's predicate: the exponentials wait for the warp to vote. Subtract "
            "each row's own max (its own decision); let the vote gate only O's multiply "
            "(Note [Warp vote] in fa4_final/common/softmax.py)")
        assert facts["O multiply reads the vote"], (
            "compiled for sm_90a, nothing after the vote reads its predicate: O's multiply does "
            "not depend on the vote, so nothing is skipped. Put it under if multiply_o:")


# --- the exercises' kernels: compiled for sm_90a with no GPU, and run on one -------------------


class VoteKernel:
    """Exercise 07.2 in a kernel: each lane loads its rows' old and tile maxima, calls ``fn``,
    stores the maxima it returns and the vote (1.0 or 0.0, per lane)."""

    def __init__(self, fn, tau: float):
        self.fn, self.tau = fn, tau

    @cute.jit
    def __call__(self, mOld: cute.Tensor, mTile: cute.Tensor, mUsed: cute.Tensor,
                 mVote: cute.Tensor, stream):
        warps = cute.size(mOld) // WARP_ROWS
        self.kernel(mOld, mTile, mUsed, mVote).launch(grid=(warps, 1, 1), block=(WARP, 1, 1),
                                                      stream=stream)

    @cute.kernel
    def kernel(self, mOld: cute.Tensor, mTile: cute.Tensor, mUsed: cute.Tensor,
               mVote: cute.Tensor):
        lane, _, _ = cute.arch.thread_idx()
        warp, _, _ = cute.arch.block_idx()
        row_max = cute.make_rmem_tensor(ROWS_PER_LANE, Float32)
        tile_max = cute.make_rmem_tensor(ROWS_PER_LANE, Float32)
        for r in cutlass.range_constexpr(ROWS_PER_LANE):
            row_max[r] = mOld[warp * WARP_ROWS + r * WARP + lane]
            tile_max[r] = mTile[warp * WARP_ROWS + r * WARP + lane]
        m_used, vote = self.fn(row_max, tile_max, self.tau)
        for r in cutlass.range_constexpr(ROWS_PER_LANE):
            mUsed[warp * WARP_ROWS + r * WARP + lane] = m_used[r]
        mVote[warp * WARP + lane] = Float32(1.0) if vote else Float32(0.0)


class WarpRows:
    """The exercise's attention kernel: one warp per 64 rows, lane l owning rows l and l + 32;
    for each tile of TILE_COLS keys it loads the scores (log2 units), calls ``step``, then adds
    P V to O; at the end out = O / l and lse = ln 2 (m + log2 l) (0 and -inf for a row that saw
    no key). Keys padded to whole tiles with -inf scores, rows to whole warps."""

    def __init__(self, step, tau: float):
        self.step, self.tau = step, tau

    @cute.jit
    def __call__(self, mS: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor,
                 stream):
        warps = cute.size(mS, mode=[0]) // WARP_ROWS
        self.kernel(mS, mV, mO, mL).launch(grid=(warps, 1, 1), block=(WARP, 1, 1),
                                           stream=stream)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor):
        lane, _, _ = cute.arch.thread_idx()
        warp, _, _ = cute.arch.block_idx()
        n_tiles = cute.size(mS, mode=[1]) // TILE_COLS
        row_max = cute.make_rmem_tensor(ROWS_PER_LANE, Float32)  # (rows,) log2 units
        row_sum = cute.make_rmem_tensor(ROWS_PER_LANE, Float32)
        acc_o = cute.make_rmem_tensor((ROWS_PER_LANE, HEAD_DIM), Float32)
        s = cute.make_rmem_tensor((ROWS_PER_LANE, TILE_COLS), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        acc_o.fill(0.0)
        for t in cutlass.range(n_tiles, unroll=1):
            for r in cutlass.range_constexpr(ROWS_PER_LANE):
                for c in cutlass.range_constexpr(TILE_COLS):
                    s[r, c] = mS[warp * WARP_ROWS + r * WARP + lane, t * TILE_COLS + c]
            self.step(s, row_max, row_sum, acc_o, self.tau)
            for r in cutlass.range_constexpr(ROWS_PER_LANE):
                for c in cutlass.range_constexpr(TILE_COLS):
                    for dd in cutlass.range_constexpr(HEAD_DIM):
                        acc_o[r, dd] = acc_o[r, dd] + s[r, c] * mV[t * TILE_COLS + c, dd]
        for r in cutlass.range_constexpr(ROWS_PER_LANE):
            row = warp * WARP_ROWS + r * WARP + lane
            seen = row_sum[r] > Float32(0.0)
            inv = Float32(1.0) / row_sum[r] if seen else Float32(0.0)
            for dd in cutlass.range_constexpr(HEAD_DIM):
                mO[row, dd] = acc_o[r, dd] * inv
            log2_sum = cute.math.log2(row_sum[r], fastmath=True)
            mL[row] = (row_max[r] + log2_sum) * Float32(LN_2) if seen else -Float32.inf


_BUILDS: dict = {}


def compile_vote_kernel(fn, tau: float = FA4_RESCALE_THRESHOLD):
    """VoteKernel(fn) compiled for sm_90a with no GPU (remembered)."""
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    key = ("vote", fn, tau)
    if key not in _BUILDS:
        _BUILDS[key] = compile_for("sm_90a", VoteKernel(fn, tau),
                                   *(fake_tensor(Float32, (None,)) for _ in range(4)),
                                   fake_stream())
    return _BUILDS[key]


def compile_step_kernel(fn, tau: float = FA4_RESCALE_THRESHOLD):
    """WarpRows(fn) compiled for sm_90a with no GPU (remembered)."""
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    key = ("step", fn, tau)
    if key not in _BUILDS:
        _BUILDS[key] = compile_for(
            "sm_90a", WarpRows(fn, tau), fake_tensor(Float32, (None, None)),
            fake_tensor(Float32, (None, HEAD_DIM)), fake_tensor(Float32, (None, HEAD_DIM)),
            fake_tensor(Float32, (None,)), fake_stream())
    return _BUILDS[key]


def _kv_loop(sass: str) -> list[str]:
    """The instructions of the outermost loop of a SASS listing: from a label to the last
    branch back to it."""
    import re

    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            start = labels[m.group(1)]
            if best is None or i - start > best[1] - best[0]:
                best = (start, i)
    if best is None:
        return []
    return [ln for ln in lines[best[0]:best[1] + 1] if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]


def vote_in_sass(sass: str) -> dict:
    """What the KV loop of a compiled step does with its warp vote: whether there is one,
    whether an instruction before the loop's first MUFU.EX2 reads the vote's predicate (the
    exponentials then wait for the vote: the rule of ch08_compare.exponentials_wait_for_vote),
    and whether anything after the vote reads it (O's multiply, predicated or branched)."""
    import re

    body = _kv_loop(sass)
    vote = next(((i, m.group(1)) for i, line in enumerate(body)
                 if (m := re.search(r"VOTE\.ANY\s+(P\d)", line))), None)
    out = {"vote": vote is not None, "exponentials wait for the vote": False,
           "O multiply reads the vote": False}
    if vote is None:
        return out
    i_vote, pred = vote
    first_exp = next((i for i, line in enumerate(body) if "MUFU.EX2" in line), len(body))
    rewritten = next((i for i, line in enumerate(body) if i > i_vote and re.search(
        rf"(SETP|PLOP3|VOTE)[\w.]*\s+{pred}\s*,", line)), len(body))
    reads = [i for i, line in enumerate(body) if i_vote < i <= rewritten
             and re.search(rf"(@!?{pred}\b|,\s*!?{pred}\s*[;,])", line)]
    out["exponentials wait for the vote"] = any(i < first_exp for i in reads)
    out["O multiply reads the vote"] = bool(reads)
    return out


def _gpu_arrays(case: StepCase):
    """Scores and V padded to whole warps and tiles, as CUDA tensors."""
    import torch

    rows, keys = case.scores.shape
    rows_p = -(-rows // WARP_ROWS) * WARP_ROWS
    keys_p = -(-keys // TILE_COLS) * TILE_COLS
    s = np.full((rows_p, keys_p), -np.inf, np.float32)
    s[:rows, :keys] = case.scores
    v = np.zeros((keys_p, HEAD_DIM), np.float32)
    v[:keys] = case.v
    return torch.from_numpy(s).cuda(), torch.from_numpy(v).cuda()


def run_step_kernel(fn, case: StepCase) -> tuple[np.ndarray, np.ndarray]:
    """WarpRows(fn) on a GPU over ``case``: (out, lse) of its rows."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack

    s, v = _gpu_arrays(case)
    o = torch.empty(s.shape[0], HEAD_DIM, device="cuda")
    lse = torch.empty(s.shape[0], device="cuda")
    args = [from_dlpack(t, assumed_align=4).mark_layout_dynamic() for t in (s, v, o, lse)]
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    key = ("gpu-step", fn, case.tau)
    if key not in _BUILDS:
        _BUILDS[key] = cute.compile[cute.GPUArch("sm_90a")](WarpRows(fn, case.tau), *args,
                                                             stream)
    _BUILDS[key](*args, stream)
    torch.cuda.synchronize()
    rows = case.scores.shape[0]
    return o[:rows].cpu().numpy(), lse[:rows].cpu().numpy()


def gpu_step_cases() -> list[StepCase]:
    """Awkward shapes for the GPU: rows not a multiple of 64, keys not a multiple of the tile,
    many tiles; the late growth at full length."""
    g = np.random.default_rng(75)
    rows, keys = 200, 1000
    cases = [StepCase(c.what, c.scores, c.v, c.tau) for c in step_cases(rows, keys, seed=76)]
    long_rows = _late_growth_scores(g, 130, 4099, 8.0)
    cases.append(StepCase("late growth over 257 tiles, tau = 8", long_rows,
                          g.normal(0, 1, (4099, HEAD_DIM)).astype(np.float32), 8.0))
    return cases


def check_softmax_step_on_gpu(fn, run=None, cases=None) -> tuple[bool, list[str]]:
    """Exercise 07.3 on a Hopper GPU: the exercise's kernel with ``fn`` as its step, on the
    awkward cases of ``gpu_step_cases``, against float64 (MUFU's ex2 and the final division are
    approximate: 1e-4). Returns (ok, one line per case). ``run``: the runner, by default
    ``run_step_kernel`` (``emulate_step_kernel`` checks this function's logic with no GPU)."""
    run = run or run_step_kernel
    ok, lines = True, []
    for case in cases or gpu_step_cases():
        out, lse = run(fn, case)
        want_out, want_lse = reference_attention(case.scores, case.v)
        seen = np.isfinite(want_lse)
        err = float(np.abs(out - want_out).max())
        lse_ok = np.array_equal(np.isfinite(lse), seen) and (
            not seen.any() or float(np.abs(lse[seen] - want_lse[seen]).max()) <= 1e-4)
        case_ok = err <= 1e-4 and lse_ok
        ok &= case_ok
        lines.append(f"{case.what} ({case.scores.shape[0]} rows, {case.scores.shape[1]} keys): "
                     f"out max error {err:.1e}, lse {'ok' if lse_ok else 'WRONG'}: "
                     f"{'ok' if case_ok else 'WRONG'}")
    return ok, lines


def run_vote_kernel(fn, old: np.ndarray, tile: np.ndarray, tau: float):
    """VoteKernel(fn) on a GPU for one warp's 64 rows: (the maxima it returns, each lane's
    vote as 1.0 or 0.0)."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack

    tensors = [torch.from_numpy(old).cuda(), torch.from_numpy(tile).cuda(),
               torch.empty(WARP_ROWS, device="cuda"), torch.empty(WARP, device="cuda")]
    args = [from_dlpack(t, assumed_align=4).mark_layout_dynamic() for t in tensors]
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    key = ("gpu-vote", fn, tau)
    if key not in _BUILDS:
        _BUILDS[key] = cute.compile[cute.GPUArch("sm_90a")](VoteKernel(fn, tau), *args, stream)
    _BUILDS[key](*args, stream)
    torch.cuda.synchronize()
    return tensors[2].cpu().numpy(), tensors[3].cpu().numpy()


def emulate_vote_kernel(fn, old: np.ndarray, tile: np.ndarray, tau: float):
    """``run_vote_kernel`` on the CPU: the same function on a warp of emulated lanes."""
    m_used, votes, _ = emulate_running_max(fn, old, tile, tau)
    return m_used, votes.astype(np.float32)


def emulate_step_kernel(fn, case: StepCase) -> tuple[np.ndarray, np.ndarray]:
    """``run_step_kernel`` on the CPU: the kernel's warps one after another, each on emulated
    lanes (rows padded to whole warps with rows that see no key)."""
    rows = case.scores.shape[0]
    pad = -(-rows // WARP_ROWS) * WARP_ROWS - rows
    scores = np.concatenate([case.scores,
                             np.full((pad, case.scores.shape[1]), -np.inf, np.float32)])
    outs, lses = [], []
    for start in range(0, scores.shape[0], WARP_ROWS):
        tr = emulate_step(fn, StepCase(case.what, scores[start:start + WARP_ROWS], case.v,
                                       case.tau))
        outs.append(tr.out)
        lses.append(tr.lse)
    return np.concatenate(outs)[:rows], np.concatenate(lses)[:rows]


def check_running_max_on_gpu(fn, run=run_vote_kernel) -> tuple[bool, list[str]]:
    """Exercise 07.2 on a Hopper GPU: VoteKernel(fn) on every case of ``vote_cases`` (one
    warp each), maxima and votes against the rule. Returns (ok, one line per case). ``run``:
    the runner (``emulate_vote_kernel`` checks this function's logic with no GPU)."""
    ok, lines = True, []
    for what, old, tile, tau in vote_cases():
        got, votes = run(fn, old, tile, tau)
        want, moved = _rule(old, tile, tau)
        case_ok = (np.array_equal(got, want, equal_nan=True)
                   and bool((votes == float(moved.any())).all()))
        ok &= case_ok
        lines.append(f"{what}: {'ok' if case_ok else 'WRONG'}")
    return ok, lines


FORBID_ADVERSARIAL = {
    pattern_qkv: "pattern_qkv('adversarial') builds the input for you",
    late_spike_qkv: "a late spike makes one tile grow, not every tile",
}


# ---------------------------------------------------------------------------------------------
# 7. Chapter 05's kernel with the knob (GPU; the notebook and `python -m` use these)

RESULTS_NAME = "ch07_rescale"


def knob_configs(head_dim: int = 128, tau: float = FA4_RESCALE_THRESHOLD):
    """(knob off, knob on): chapter 05's default config for ``head_dim`` with rescale_threshold
    0 and ``tau``. Raises ValueError saying why when chapter 05 refuses tau (it takes
    0 <= tau <= ch05.MAX_RESCALE_THRESHOLD, the fp16 bound of Note [Why tau = 8 is safe]) or,
    in an older tree, has no such field."""
    import dataclasses

    from solutions import ch05_flash_hopper as ch05

    if "rescale_threshold" not in {f.name for f in dataclasses.fields(ch05.HopperConfig)}:
        raise ValueError("chapter 05's HopperConfig has no rescale_threshold field yet")
    off = dataclasses.replace(ch05.default_config(head_dim), rescale_threshold=0.0)
    on = dataclasses.replace(off, rescale_threshold=float(_check_tau(tau)))
    ch05.check_config(head_dim, on)
    return off, on


def o_multiply_share(q, k, causal: bool, tau: float, tile_n: int, rows: int = 256) -> float:
    """The model's share of (warp, KV tile) steps in which chapter 05's kernel multiplies O,
    from the last ``rows`` query rows of batch 0, head 0 (they see the most tiles). tau = 0: the
    kernel multiplies at every step; tau > 0: the 16-row "any" vote (HOPPER_WARP_ROWS)."""
    if tau == 0:
        return 1.0
    tmax = tile_maxima(q[:1, -rows:, :1].cpu(), k[:1, :, :1].cpu(), causal=causal,
                       tile_n=tile_n, kv_order="reverse")
    return scan_tile_maxima(tmax, tau, group_rows=HOPPER_WARP_ROWS).frac_group


def format_knob_rows(rows: list[dict]) -> str:
    """One line per measurement: time, TFLOP/s, the spread, knob-on / knob-off time with
    ``utils.bench.compare``'s verdict ("within noise" unless the change exceeds the spread),
    the model's share of (warp, tile) steps that multiply O, and the fastest peer on the same
    inputs in the same run."""
    from utils.bench import compare, row_spread, spread_note, vs_best_peer

    lines = [f"{'inputs':12s} {'causal':6s} {'config':7s} {'ms':>8s} {'TFLOP/s':>8s} "
             f"{'spread':>6s} {'on/off':>7s} {'':12s} {'O multiplied (model)':>21s}  "
             "vs best peer"]
    for r in rows:
        off = [o for o in rows if o["inputs"] == r["inputs"] and o["causal"] == r["causal"]
               and o["rescale_threshold"] == 0.0]
        ratio, verdict = "", ""
        if off:
            ratio = f"{r['ms'] / off[0]['ms']:7.3f}"
            verdict = "" if off[0] is r else compare(r, off[0]).verdict
        spread = row_spread(r)
        spread = f"{spread:6.1%}" if spread is not None else ""
        lines.append(f"{r['inputs']:12s} {r['causal']!s:6s} {r['config']:7s} {r['ms']:8.3f} "
                     f"{r['tflops']:8.1f} {spread:>6s} {ratio:>7s} {verdict:12s} "
                     f"{r['o_multiply_share_model']:21.1%}  {vs_best_peer(r)}".rstrip())
    if any("ms_rounds" in r or "ms_min" in r for r in rows):  # measured rows, not made up
        lines.append(spread_note(rows))
    return "\n".join(lines)


def partial_attention(attention_fn, config):
    """attention_fn with ``config`` fixed, as a course-signature function."""

    def fn(q, k, v, causal=False, softmax_scale=None):
        return attention_fn(q, k, v, causal=causal, softmax_scale=softmax_scale, config=config)

    return fn


# ---------------------------------------------------------------------------------------------
# 9. Reading the stored run (results/h200/ch07_rescale.json) and the claims the prose makes



def stored_row(res, inputs: str, causal: bool, tau: float) -> dict | None:
    return next((r for r in res.rows if (r["inputs"], r["causal"], r["rescale_threshold"])
                 == (inputs, causal, tau) and r.get("ms")), None)


def knob_comparisons(res, tau: float = FA4_RESCALE_THRESHOLD) -> dict:
    """{(inputs, causal): utils.bench.compare of the knob on (tau) against off (tau = 0)}."""
    from utils.bench import compare

    out = {}
    for inputs in ("random", "adversarial"):
        for causal in dict.fromkeys(r["causal"] for r in res.rows):
            on, off = stored_row(res, inputs, causal, tau), stored_row(res, inputs, causal, 0.0)
            if on and off:
                out[(inputs, causal)] = compare(on, off)
    return out


@claim("07.knob_costs_on_adversarial", RESULTS_NAME,
       "on the adversarial input, chapter 05's kernel with tau = 8 is slower than with tau = 0, "
       "beyond the spread, causal and not")
def _costs_on_adversarial(res):
    c = {k: v for k, v in knob_comparisons(res).items() if k[0] == "adversarial"}
    return (len(c) == 2 and all(v.real and v.ratio < 1 for v in c.values()),
            ", ".join(f"causal={k[1]}: {v}" for k, v in c.items()))


@claim("07.knob_no_gain_on_random", RESULTS_NAME,
       "on random inputs tau = 8 is not faster than tau = 0 beyond the spread, causal or not")
def _no_gain_on_random(res):
    c = {k: v for k, v in knob_comparisons(res).items() if k[0] == "random"}
    return (len(c) == 2 and not any(v.real and v.ratio > 1 for v in c.values()),
            ", ".join(f"causal={k[1]}: {v}" for k, v in c.items()))


@claim("07.adversarial_cost_larger_than_causal", RESULTS_NAME,
       "on the adversarial input the knob costs more non-causal than causal")
def _cost_larger_noncausal(res):
    c = knob_comparisons(res)
    nc, ca = c.get(("adversarial", False)), c.get(("adversarial", True))
    return (nc is not None and ca is not None and nc.ratio < ca.ratio,
            f"non-causal {nc}, causal {ca}")


@claim("07.same_instructions_other_speed", RESULTS_NAME,
       "at tau = 0 the adversarial input runs faster than random input, beyond the spread, "
       "causal and not, with the same instructions")
def _same_instructions(res):
    from utils.bench import compare

    out = []
    for causal in (False, True):
        adv, rnd = stored_row(res, "adversarial", causal, 0.0), stored_row(res, "random",
                                                                         causal, 0.0)
        out.append((causal, compare(adv, rnd)))
    return (all(c.real and c.ratio > 1 for _, c in out),
            ", ".join(f"causal={k}: {c}" for k, c in out))
