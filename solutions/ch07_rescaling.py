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

Measured: ``results/<gpu>/ch07_rescale.json`` (chapter 05's kernel with the knob on and off),
printed by the notebook with its provenance; no figure is typed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from solutions.ch02_online_softmax import LN2 as LN_2
from solutions.ch02_online_softmax import LOG2E as LOG2_E
from solutions.ch02_online_softmax import lse_from_state
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
# 2. The conditional step (exercise 07.1) and the final normalisation (exercise 07.2)


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
    """One row-wise step of conditional rescaling (reference for exercise 07.1).

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
    """out = O / l and lse = ln 2 * (m_used + log2 l) (reference for exercise 07.2).

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
# 5. Inputs: score patterns, the adversarial one (exercise 07.3), a late spike


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
    reference for exercise 07.3). q, k, v in the course layout with one head.

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


def check_conditional_update(fn) -> None:
    """Exercise 07.1: fn(m_old, tile_scores, tau) -> (m_used, alpha, rescaled)."""
    ninf = float("-inf")
    # rows: no growth, growth 5, growth exactly 8, growth 9, first key, still nothing
    m_old = torch.tensor([4.0, 4.0, 4.0, 4.0, ninf, ninf])
    top = torch.tensor([3.0, 9.0, 12.0, 13.0, 2.5, ninf])
    tile = torch.full((6, 5), ninf)
    tile[:, 2] = top
    tile[:5, 0] = top[:5] - 1.5
    why = ["the tile max is below the old max", "the max grows by 5 <= tau = 8",
           "the max grows by exactly tau = 8 (at most tau: keep the stale max)",
           "the max grows by 9 > tau = 8", "the row saw its first key (old max -inf)",
           "every key so far is masked (both maxima -inf)"]
    exp_m = torch.tensor([4.0, 4.0, 4.0, 13.0, 2.5, ninf])
    exp_alpha = torch.tensor([1.0, 1.0, 1.0, 2.0**-9, 0.0, 1.0])
    exp_resc = torch.tensor([False, False, False, True, True, False])
    got = fn(m_old.clone(), tile.clone(), 8.0)
    assert isinstance(got, tuple) and len(got) == 3, (
        "return a tuple (m_used, alpha, rescaled)")
    m_used, alpha, resc = (torch.as_tensor(x) for x in got)
    for name, t in (("m_used", m_used), ("alpha", alpha), ("rescaled", resc)):
        assert t.shape == (6,), f"{name} should have one value per row, shape (6,), got {t.shape}"
    for i in range(6):
        for name, t in (("m_used", m_used), ("alpha", alpha)):
            hint = ("-inf - (-inf) is NaN: keep the -inf max and do not rescale" if i == 5
                    else "check the arithmetic")
            assert not math.isnan(float(t[i])), f"row {i} ({why[i]}): {name} is NaN; {hint}"
        assert _close(m_used[i], exp_m[i]), (
            f"row {i} ({why[i]}): m_used should be {exp_m[i].item()}, got {m_used[i].item()}")
        ok_alpha = (alpha[i].item() in (0.0, 1.0)) if i == 5 else _close(alpha[i], exp_alpha[i])
        assert ok_alpha, (
            f"row {i} ({why[i]}): alpha should be {exp_alpha[i].item():g} = 2^(m_old - m_used), "
            f"got {alpha[i].item():g}")
        if i != 5:
            assert bool(resc[i]) == bool(exp_resc[i]), (
                f"row {i} ({why[i]}): rescaled should be {bool(exp_resc[i])}, got {bool(resc[i])}")
    # tau = 0: rescale whenever the max grows at all; random rows against the reference
    g = _generator(7)
    m0 = torch.randn(64, generator=g) * 4
    scores = torch.randn(64, 32, generator=g) * 4
    for tau in (0.0, 3.0, 8.0):
        want = conditional_update(m0, scores, tau)
        got = fn(m0.clone(), scores.clone(), tau)
        for name, a, b in zip(("m_used", "alpha", "rescaled"), got, want):
            a = torch.as_tensor(a)
            bad = ~torch.isclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)
            assert not bad.any(), (
                f"tau={tau}: {name} is wrong for {int(bad.sum())} of 64 random rows (first: row "
                f"{int(bad.nonzero()[0])}, got {a[bad][0].item():g}, "
                f"expected {b[bad][0].item():g})")


def stale_max_example(seed: int = 3):
    """A finished row state with a stale max, for exercise 07.2 and the notebook: returns
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
    """Exercise 07.2: fn(o_acc, row_sum, m_used) -> (out, lse)."""
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


def check_adversarial(fn) -> None:
    """Exercise 07.3: fn(seqlen_k, tile_n=..., tau=..., kv_order=...) -> (q, k, v) whose running
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


def _bench_inputs(pattern: str, batch: int, seqlen: int, heads: int, dim: int, tau: float,
                  tile_n: int):
    """bf16 CUDA q, k, v (batch, seqlen, heads, dim) and a seed: fresh N(0, 1) ("random") or
    ``adversarial_qkv`` per head for the kernel's tile_n and reverse order ("adversarial")."""
    from utils.reference import random_qkv

    if pattern == "random":
        q, k, v, seed = random_qkv(batch, seqlen, heads, dim, device="cuda")
        return q, k, v, seed
    qkv = [pattern_qkv("adversarial", seqlen, seqlen, heads, dim, seed=b, tile_n=tile_n,
                       tau=tau, kv_order="reverse") for b in range(batch)]
    q, k, v = (torch.cat([t[i] for t in qkv]).to("cuda", torch.bfloat16) for i in range(3))
    return q, k, v, 0


def o_multiply_share(q, k, causal: bool, tau: float, tile_n: int, rows: int = 256) -> float:
    """The model's share of (warp, KV tile) steps in which chapter 05's kernel multiplies O,
    from the last ``rows`` query rows of batch 0, head 0 (they see the most tiles). tau = 0: the
    kernel multiplies at every step; tau > 0: the 16-row "any" vote (HOPPER_WARP_ROWS)."""
    if tau == 0:
        return 1.0
    tmax = tile_maxima(q[:1, -rows:, :1].cpu(), k[:1, :, :1].cpu(), causal=causal,
                       tile_n=tile_n, kv_order="reverse")
    return scan_tile_maxima(tmax, tau, group_rows=HOPPER_WARP_ROWS).frac_group


def benchmark_knob(seqlen: int = 16384, heads: int = 16, dim: int = 128,
                   tau: float = FA4_RESCALE_THRESHOLD, rep: int = 30,
                   causal_modes=(False, True), rounds: int = 3) -> list[dict]:
    """Chapter 05's forward with the knob off (tau = 0) and on, on random inputs (the max
    settles: the vote skips almost every O rescale) and on adversarial ones (every tile
    rescales: the vote is pure overhead), causal and not. Every (inputs, causal, config) is
    first checked against the float64 reference on a small awkward shape (NaN-poisoned
    outputs, ``ch05.run_and_compare``); a failure raises AssertionError before any timing.

    Then everything is timed in ``rounds`` interleaved rounds (``utils.bench.interleaved``):
    both configs and the peers (SDPA flash, cuDNN, the FA4 package) on both inputs, causal and
    not, once per round. The peers are the control for the inputs: they run the same
    instructions whatever the data, so a difference they show between random and adversarial
    inputs comes from the hardware (clock, power), not from a kernel's branches. Needs a Hopper
    GPU; returns rows for utils.results with the median over rounds, the per-round values,
    the spread, the SM clock and power of each round, the peers of the same inputs
    (``peers_tflops``, ``best_peer``), and the model's share of O multiplies
    (``o_multiply_share``) next to each time."""
    from solutions import ch05_flash_hopper as ch05
    from utils import bench as ub

    off, on = knob_configs(dim, tau)
    batch = max(1, 16384 // seqlen)
    rows, calls, flops_of = [], {}, {}
    for pattern in ("random", "adversarial"):
        q, k, v, seed = _bench_inputs(pattern, batch, seqlen, heads, dim, tau, off.tile_n)
        for causal in causal_modes:
            group = (pattern, causal)
            flops_of[group] = ub.attention_flops(batch, heads, seqlen, seqlen, dim, causal)
            for cfg in (off, on):
                small = _bench_inputs(pattern, 1, 1031, 2, dim, tau, cfg.tile_n)[:3]
                ok, line = ch05.run_and_compare(*small, causal, config=cfg,
                                                label=f"{pattern} tau={cfg.rescale_threshold:g}")
                print(line, flush=True)
                if not ok:
                    raise AssertionError(line)
                name = f"tau={cfg.rescale_threshold:g}"
                calls[(group, name)] = lambda q=q, k=k, v=v, c=causal, cfg=cfg: ch05.attention(
                    q, k, v, c, config=cfg)
                rows.append({
                    "impl": "flash_hopper", "config": name,
                    "pass": "fwd", "dtype": "bf16", "b": batch, "s": seqlen, "h": heads, "d": dim,
                    "causal": causal, "ms": None, "tflops": None,
                    "inputs": pattern, "rescale_threshold": cfg.rescale_threshold,
                    "o_multiply_share_model": o_multiply_share(q, k, causal,
                                                               cfg.rescale_threshold, cfg.tile_n),
                    "seed": seed, "verified": True,
                })
            for peer, call in ub.peer_calls(q, k, v, causal).items():
                calls[(group, ub.PEER_KEY, peer)] = call
    measured = ub.interleaved(calls, rounds=rounds, rep=rep,
                              progress=lambda line: print("  " + line, flush=True))
    for row in rows:
        group = (row["inputs"], row["causal"])
        row.update(measured[(group, row["config"])].fields(flops_of[group]))
        row.update(ub.peer_fields({key[2]: m for key, m in measured.items()
                                   if key[0] == group and key[1:2] == (ub.PEER_KEY,)},
                                  flops_of[group]))
    return rows


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


def main(argv=None) -> int:
    """``python -m solutions.ch07_rescaling [--save]`` on a Hopper GPU: chapter 05's kernel with
    the knob off and on, random and adversarial inputs, causal and not; --save writes
    results/<gpu>/ch07_rescale.json."""
    import argparse

    from utils import results

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--save", action="store_true", help=f"write results/<gpu>/{RESULTS_NAME}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (at least 3)")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds: at least 3, so a round's spread can be told from an effect")
    if not torch.cuda.is_available():
        print("no CUDA GPU here; the stored figures: utils.results.load('ch07_rescale')")
        return 0
    rows = benchmark_knob(seqlen=args.seqlen, rounds=args.rounds)
    print(format_knob_rows(rows))
    if args.save:
        command = "python -m solutions.ch07_rescaling --save"
        if args.seqlen != 16384:
            command += f" --seqlen {args.seqlen}"
        if args.rounds != 3:
            command += f" --rounds {args.rounds}"
        print("wrote", results.save(RESULTS_NAME, rows, command=command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
