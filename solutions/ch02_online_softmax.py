"""Chapter 02: the online softmax, and attention computed tile by tile (PyTorch).

What it adds to chapter 01: the (B, H, Sq, Sk) score matrix is never stored. A softmax needs the
row max and the row sum before it can normalise, but both can be kept *running*: after each
tile of keys, a row's max m may grow, and everything summed so far is rescaled by
exp(m_old - m_new). Attention then reads Q, K, V and writes O and the LSE, and nothing else:
the N^2 terms of ``ch01_naive.naive_traffic`` disappear, and so does the N^2 memory.

The loops mirror the kernels to come:

* ``attention_fa1``: FlashAttention-1 order. Outer loop over KV tiles, inner over Q tiles; each
  Q tile's O, m, l live in memory and are read and written at every KV tile. FlashAttention-1's
  kernel ran this whole loop in one CTA per (batch, head).
* ``attention_fa2`` (= ``attention``): FlashAttention-2 order. Outer loop over Q tiles, inner over
  KV tiles; O, m, l stay in "registers" (local tensors) and O is written once. This is the loop
  every later kernel runs (one CTA per Q tile: FlashAttention-2 parallelises over the sequence
  too, not only over batch and heads).

As kernels do: inputs in bf16/fp16, scores, P's row sums and O accumulated in float32; P rounded
to the inputs' dtype before the P V matmul (the tensor cores take it that way); exp2 instead of
exp with log2(e) folded into the softmax scale (exp(x) = 2^(x log2 e), and ex2 is the hardware
instruction), so m, l live in the log2 domain and LSE = (m + log2 l) * ln 2. Causal tiles that
hold no visible key are skipped (``kv_tiles_to_visit``); ``TileCounts`` records how many.

``trace_running_max`` records per row and KV tile the running max and the rescale factor;
``max_growth_fractions`` says how often the max grows at all, and by more than tau (chapter 07
skips the rescale below tau = 8).
"""

# ruff: noqa: E741  (m and l are the running max and sum in every FlashAttention paper)
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from utils.claims import claim
from utils.reference import attention_reference, check_attention_inputs, positive_int, random_qkv

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)  # log(x) = log2(x) * LN2
NEG_INF = float("-inf")

# ---------------------------------------------------------------------------------------------
# 1. Softmax, safe and online


def safe_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """softmax(x) = exp(x - max) / sum exp(x - max): the max keeps exp's argument <= 0, so
    nothing overflows. A row of -inf (no visible key) gives zeros, not NaN."""
    m = x.amax(dim=dim, keepdim=True)
    m = m.masked_fill(m == NEG_INF, 0.0)
    e = torch.exp(x - m)
    total = e.sum(dim=dim, keepdim=True)
    return e / total.masked_fill(total == 0, 1.0)


def online_softmax_stats(x: torch.Tensor, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max m and row sum l = sum exp(x - m) of ``x`` (..., n) in ONE pass over column tiles.

    When a tile raises the max from m_old to m_new, the sum so far was taken relative to m_old:
    multiplying it by exp(m_old - m_new) moves it to m_new.
    """
    positive_int("tile", tile)
    m = torch.full(x.shape[:-1], NEG_INF, dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], tile):
        block = x[..., start:start + tile]
        m_new = torch.maximum(m, block.amax(dim=-1))
        m_use = m_new.masked_fill(m_new == NEG_INF, 0.0)
        l = l * torch.exp(m - m_use) + torch.exp(block - m_use[..., None]).sum(dim=-1)
        m = m_new
    return m, l


def online_softmax(x: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """Softmax over the last dim from the one-pass statistics (a second pass normalises)."""
    m, l = online_softmax_stats(x, tile)
    m = m.masked_fill(m == NEG_INF, 0.0)
    return torch.exp(x - m[..., None]) / l.masked_fill(l == 0, 1.0)[..., None]


# ---------------------------------------------------------------------------------------------
# 2. The pieces of the tile loop (each is an exercise)


def tile_update(o, m, l, s, v):
    """Fold one KV tile into a Q tile's running state; the inner step of the FA2 loop.

    o: (..., rows, D) unnormalised output, float32    m: (..., rows) running max (log2 units)
    l: (..., rows) running sum of exp2(s - m)         s: (..., rows, cols) scores already
    v: (..., cols, D) values, inputs' dtype              times scale*log2(e); masked = -inf
    Returns the new (o, m, l).
    """
    m_new = torch.maximum(m, s.amax(dim=-1))
    m_use = m_new.masked_fill(m_new == NEG_INF, 0.0)  # no key yet: avoid -inf - (-inf) = NaN
    alpha = torch.exp2(m - m_use)  # rescale factor of the old state; 0 when m was -inf
    p = torch.exp2(s - m_use[..., None])
    l_new = alpha * l + p.sum(dim=-1)
    # P goes into the matmul in the inputs' dtype, as the tensor cores take it.
    pv = p.to(v.dtype).to(o.dtype) @ v.to(o.dtype)
    return alpha[..., None] * o + pv, m_new, l_new


def lse_from_state(m, l):
    """Natural-log LSE of a row from its log2-domain state: log(sum e^x) = (m + log2 l) ln 2.
    A row that saw no key (m = -inf, l = 0) gets -inf."""
    return (m + torch.log2(l)) * LN2


def kv_tiles_to_visit(q_start: int, q_end: int, seqlen_q: int, seqlen_k: int, tile_n: int,
                      causal: bool) -> int:
    """How many KV tiles, counted from the first, hold a key that some query row in
    [q_start, q_end) sees. The loop visits those; every later tile is fully masked.

    Causal, bottom-right aligned: row i sees keys j <= i + (seqlen_k - seqlen_q), so the last
    row of the tile sees the most: keys up to q_end - 1 + seqlen_k - seqlen_q.
    """
    visible_end = seqlen_k if not causal else min(seqlen_k, q_end + seqlen_k - seqlen_q)
    return max(0, -(-visible_end // tile_n))  # ceil division; 0 when no row sees a key


@dataclass
class TileCounts:
    """What a tile loop did, per (batch, head): tiles computed / skipped, and bytes moved to
    and from memory (the loops process every head of a tile at once; each counts as one)."""

    computed: int = 0
    skipped: int = 0  # fully masked, never computed
    masked: int = 0  # computed with a partial mask (they straddle the diagonal)
    qkv_bytes: int = 0  # Q, K, V tiles loaded
    state_read_bytes: int = 0  # O, m, l read back from memory (FlashAttention-1 order only)
    state_write_bytes: int = 0  # O, m, l (or O and LSE) written

    @property
    def total(self) -> int:
        return self.computed + self.skipped


def count_tiles(seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int,
                causal: bool) -> TileCounts:
    """Tiles computed and skipped, by arithmetic alone (the loops must agree)."""
    counts = TileCounts()
    n_kv = -(-seqlen_k // tile_n)
    for q0 in range(0, seqlen_q, tile_m):
        visit = kv_tiles_to_visit(q0, min(q0 + tile_m, seqlen_q), seqlen_q, seqlen_k, tile_n,
                                  causal)
        counts.computed += visit
        counts.skipped += n_kv - visit
        if causal:
            # A visited tile needs the mask when its first row cannot see its last key.
            last_seen_by_first_row = q0 + seqlen_k - seqlen_q
            counts.masked += sum(
                min((j + 1) * tile_n, seqlen_k) - 1 > last_seen_by_first_row for j in range(visit)
            )
    return counts


# ---------------------------------------------------------------------------------------------
# 3. The two loop orders


def _prepare(q, k, v, softmax_scale, tile_m, tile_n):
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v, softmax_scale)
    positive_int("tile_m", tile_m), positive_int("tile_n", tile_n)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    acc = torch.promote_types(q.dtype, torch.float32)

    def heads_first(t):  # (B, S, Hkv, D) -> (B, H, S, D); GQA: kv head i // (H / Hkv)
        return t.transpose(1, 2).repeat_interleave(h // t.shape[2], dim=1)

    return sq, sk, scale * LOG2E, acc, heads_first(q), heads_first(k), heads_first(v)


def _mask_tile(s, q0, k0, seqlen_q, seqlen_k):
    """-inf where key k0 + c is beyond what query q0 + r sees; returns whether any was masked."""
    rows = torch.arange(q0, q0 + s.shape[-2], device=s.device)[:, None]
    cols = torch.arange(k0, k0 + s.shape[-1], device=s.device)[None, :]
    blocked = cols > rows + (seqlen_k - seqlen_q)
    if blocked.any():
        s.masked_fill_(blocked, NEG_INF)
        return True
    return False


def attention_fa2(q, k, v, causal=False, softmax_scale=None, *, tile_m=128, tile_n=128,
                  counts: TileCounts | None = None, update=tile_update, lse_fn=lse_from_state,
                  n_tiles=kv_tiles_to_visit):
    """FlashAttention-2 order: for each Q tile, walk its KV tiles with O, m, l kept local.

    ``update``, ``lse_fn``, ``n_tiles`` are the loop's pieces (the exercises plug in here).
    """
    sq, sk, scale_log2, acc, qh, kh, vh = _prepare(q, k, v, softmax_scale, tile_m, tile_n)
    counts = counts if counts is not None else TileCounts()
    e = q.element_size()
    n_kv = -(-sk // tile_n)
    out = torch.empty(qh.shape, dtype=q.dtype, device=q.device)  # (B, H, Sq, D)
    lse = torch.empty(qh.shape[:-1], dtype=torch.float32, device=q.device)  # (B, H, Sq)
    for q0 in range(0, sq, tile_m):
        q1 = min(q0 + tile_m, sq)
        q_tile = qh[:, :, q0:q1].to(acc)  # (B, H, rows, D): loaded once
        o = torch.zeros(q_tile.shape, dtype=acc, device=q.device)
        m = torch.full(q_tile.shape[:-1], NEG_INF, dtype=acc, device=q.device)
        l = torch.zeros_like(m)
        visit = n_tiles(q0, q1, sq, sk, tile_n, causal)
        for j in range(visit):
            k0, k1 = j * tile_n, min((j + 1) * tile_n, sk)
            s = q_tile @ kh[:, :, k0:k1].to(acc).transpose(-1, -2) * scale_log2  # (.., rows, cols)
            if causal and _mask_tile(s, q0, k0, sq, sk):
                counts.masked += 1
            o, m, l = update(o, m, l, s, vh[:, :, k0:k1])
            counts.qkv_bytes += 2 * (k1 - k0) * qh.shape[-1] * e
        counts.computed += visit
        counts.skipped += n_kv - visit
        counts.qkv_bytes += (q1 - q0) * qh.shape[-1] * e
        out[:, :, q0:q1] = (o / l.masked_fill(l == 0, 1.0)[..., None]).to(q.dtype)
        lse[:, :, q0:q1] = lse_fn(m, l)
        counts.state_write_bytes += (q1 - q0) * (qh.shape[-1] * e + 4)
    return out.transpose(1, 2).contiguous(), lse


def attention_fa1(q, k, v, causal=False, softmax_scale=None, *, tile_m=128, tile_n=128,
                  counts: TileCounts | None = None):
    """FlashAttention-1 order: for each KV tile, walk the Q tiles; every Q tile's O, m, l go
    back to memory after each visit (O kept normalised, in float32, as in the FA1 paper)."""
    sq, sk, scale_log2, acc, qh, kh, vh = _prepare(q, k, v, softmax_scale, tile_m, tile_n)
    counts = counts if counts is not None else TileCounts()
    e, d = q.element_size(), qh.shape[-1]
    state_bytes = d * 4 + 2 * 4  # one row of O, m, l in float32
    o_mem = torch.zeros(qh.shape, dtype=acc, device=q.device)  # "HBM"
    m_mem = torch.full(qh.shape[:-1], NEG_INF, dtype=acc, device=q.device)
    l_mem = torch.zeros_like(m_mem)
    for j, k0 in enumerate(range(0, sk, tile_n)):
        k1 = min(k0 + tile_n, sk)
        k_tile, v_tile = kh[:, :, k0:k1].to(acc), vh[:, :, k0:k1]  # loaded once
        counts.qkv_bytes += 2 * (k1 - k0) * d * e
        for q0 in range(0, sq, tile_m):
            q1 = min(q0 + tile_m, sq)
            if j >= kv_tiles_to_visit(q0, q1, sq, sk, tile_n, causal):
                counts.skipped += 1
                continue
            counts.computed += 1
            s = qh[:, :, q0:q1].to(acc) @ k_tile.transpose(-1, -2) * scale_log2
            counts.qkv_bytes += (q1 - q0) * d * e
            if causal and _mask_tile(s, q0, k0, sq, sk):
                counts.masked += 1
            o_i, m_i, l_i = o_mem[:, :, q0:q1], m_mem[:, :, q0:q1], l_mem[:, :, q0:q1]
            counts.state_read_bytes += (q1 - q0) * state_bytes
            # The tile's own max and sum, then both sides moved to the common max.
            m_tile = s.amax(dim=-1)
            p = torch.exp2(s - m_tile.masked_fill(m_tile == NEG_INF, 0.0)[..., None])
            m_new = torch.maximum(m_i, m_tile)
            m_use = m_new.masked_fill(m_new == NEG_INF, 0.0)
            a_old, a_new = torch.exp2(m_i - m_use), torch.exp2(m_tile - m_use)
            l_new = a_old * l_i + a_new * p.sum(dim=-1)
            pv = p.to(v.dtype).to(acc) @ v_tile.to(acc)
            o_new = (l_i * a_old)[..., None] * o_i + a_new[..., None] * pv
            o_mem[:, :, q0:q1] = o_new / l_new.masked_fill(l_new == 0, 1.0)[..., None]
            m_mem[:, :, q0:q1], l_mem[:, :, q0:q1] = m_new, l_new
            counts.state_write_bytes += (q1 - q0) * state_bytes
    return o_mem.to(q.dtype).transpose(1, 2).contiguous(), lse_from_state(m_mem, l_mem).float()


def attention(q, k, v, causal=False, softmax_scale=None):
    """The course signature: FlashAttention-2 order with 128 x 128 tiles."""
    return attention_fa2(q, k, v, causal=causal, softmax_scale=softmax_scale)


def plot_tile_grid(seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, causal: bool,
                   order: str = "fa2", ax=None):
    """The (Q tile, KV tile) grid: skipped tiles blank, masked ones hatched, each computed
    tile numbered in the order the chosen loop ("fa1" or "fa2") visits it."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if order not in ("fa1", "fa2"):
        raise ValueError(f"order must be 'fa1' or 'fa2', got {order!r}")
    n_q, n_kv = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    visits = {}
    pairs = [(i, j) for i in range(n_q) for j in range(n_kv)]
    if order == "fa1":
        pairs.sort(key=lambda ij: (ij[1], ij[0]))
    for i, j in pairs:
        q0, q1 = i * tile_m, min((i + 1) * tile_m, seqlen_q)
        if j < kv_tiles_to_visit(q0, q1, seqlen_q, seqlen_k, tile_n, causal):
            visits[(i, j)] = len(visits) + 1
    if ax is None:
        _, ax = plt.subplots(figsize=(0.5 * n_kv + 2, 0.5 * n_q + 1.2))
    for i in range(n_q):
        for j in range(n_kv):
            q0, k1 = i * tile_m, min((j + 1) * tile_n, seqlen_k)
            masked = causal and k1 - 1 > q0 + seqlen_k - seqlen_q
            computed = (i, j) in visits
            ax.add_patch(Rectangle((j, i), 1, 1, edgecolor="black", lw=0.5,
                                   facecolor="#9ecae1" if computed else "white",
                                   hatch="//" if computed and masked else None))
            if computed:
                ax.text(j + 0.5, i + 0.5, str(visits[(i, j)]), ha="center", va="center",
                        fontsize=7)
    ax.set_xlim(0, n_kv)
    ax.set_ylim(n_q, 0)
    ax.set_aspect("equal")
    ax.set_xlabel(f"KV tile ({tile_n} keys)")
    ax.set_ylabel(f"Q tile ({tile_m} rows)")
    ax.set_title(f"{order.upper()} order, {'causal' if causal else 'no mask'}: "
                 f"{len(visits)} of {n_q * n_kv} tiles computed")
    ax.grid(False)
    return ax


def plot_work_partition(warps: int = 4, ax_split_k=None, ax_split_q=None):
    """One CTA's S tile (its Q rows x the keys of one KV tile), coloured by the warp that computes
    each part: FlashAttention-1 splits the keys between warps (every warp holds a piece of every
    row, so row max, row sum and O must be combined across warps through shared memory);
    FlashAttention-2 splits the query rows (a warp owns whole rows: its softmax and its O rows
    need no other warp)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if ax_split_k is None or ax_split_q is None:
        _, (ax_split_k, ax_split_q) = plt.subplots(1, 2, figsize=(10, 3.6))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, split, title in ((ax_split_k, "k", "FlashAttention-1: warps split the keys"),
                             (ax_split_q, "q", "FlashAttention-2: warps split the query rows")):
        for w in range(warps):
            x, y, wd, ht = (w / warps, 0, 1 / warps, 1) if split == "k" else (0, w / warps, 1,
                                                                               1 / warps)
            ax.add_patch(Rectangle((x, y), wd, ht, facecolor=colours[w % len(colours)],
                                   alpha=0.55, edgecolor="black", lw=0.8))
            ax.text(x + wd / 2, y + ht / 2, f"warp {w}", ha="center", va="center", fontsize=8)
        ax.set_xlim(0, 1)
        ax.set_ylim(1, 0)
        ax.set_xticks([])
        ax.set_yticks([])
        note = ("row max, row sum, O: partial in every warp, combined through shared memory"
                if split == "k" else "each row's max, sum and O in one warp: no cross-warp step")
        ax.set_xlabel(f"keys of the KV tile\n{note}", fontsize=8)
        ax.set_ylabel("query rows of the CTA")
        ax.set_title(title, fontsize=9)
        ax.grid(False)
    return ax_split_k, ax_split_q


def normalisation_work(seqlen_q: int, seqlen_k: int, dim: int, tile_n: int = 128) -> dict:
    """Per (batch, head): the elements of O divided by the row sum, FlashAttention-1 style (O
    kept normalised after every KV tile) against FlashAttention-2's deferred normalisation
    (O unnormalised until the end, divided once)."""
    n_kv = -(-seqlen_k // tile_n)
    return {"fa1": n_kv * seqlen_q * dim, "fa2": seqlen_q * dim}


# ---------------------------------------------------------------------------------------------
# 4. Instrumentation: how often does the running max move?


@dataclass
class MaxTrace:
    """Per (batch, head, row, KV tile), all in log2 units of scale * q.k.

    m: running max after the tile (-inf before the row's first visible key)
    growth: m_after - m_before (0 when the max holds)
    alpha: rescale factor exp2(m_before - m_after) (1 when the max holds)
    counted: the step is a real decision: the tile holds a key the row sees, and the row saw a
             key before (its first tile has nothing to rescale). growth and alpha are NaN
             where not counted.
    """

    m: torch.Tensor
    growth: torch.Tensor
    alpha: torch.Tensor
    counted: torch.Tensor
    tile_n: int = field(default=128)


def trace_running_max(q, k, causal=False, softmax_scale=None, tile_n=128) -> MaxTrace:
    """Replay the FA2 inner loop's max bookkeeping for every row (no V needed)."""
    sq, sk, scale_log2, acc, qh, kh, _ = _prepare(q, k, k, softmax_scale, 1, tile_n)
    m = torch.full(qh.shape[:-1], NEG_INF, dtype=acc, device=q.device)
    ms, growths, alphas, counted = [], [], [], []
    for k0 in range(0, sk, tile_n):
        s = qh.to(acc) @ kh[:, :, k0:k0 + tile_n].to(acc).transpose(-1, -2) * scale_log2
        if causal:
            _mask_tile(s, 0, k0, sq, sk)
        tile_max = s.amax(dim=-1)
        m_new = torch.maximum(m, tile_max)
        real = (tile_max > NEG_INF) & (m > NEG_INF)
        nan = torch.full_like(m, float("nan"))
        growths.append(torch.where(real, m_new - m, nan))
        alphas.append(torch.where(real, torch.exp2(m - m_new), nan))
        counted.append(real)
        ms.append(m_new)
        m = m_new
    return MaxTrace(torch.stack(ms, -1), torch.stack(growths, -1), torch.stack(alphas, -1),
                    torch.stack(counted, -1), tile_n)


class MaxGrowth(NamedTuple):
    steps: int  # counted (row, tile) steps
    grew: int  # steps where the max grew at all: a rescale is due
    grew_over_tau: int  # steps where it grew by more than tau (log2 units)
    tau: float

    @property
    def fraction(self) -> float:
        return self.grew / self.steps if self.steps else 0.0

    @property
    def fraction_over_tau(self) -> float:
        return self.grew_over_tau / self.steps if self.steps else 0.0


def max_growth_fractions(trace: MaxTrace, tau: float = 8.0) -> MaxGrowth:
    """How often the running max grows (a rescale of O and l is due), and how often by more
    than ``tau`` in the log2 domain (tau = 8: a factor 256, FA4's threshold)."""
    if not (isinstance(tau, (int, float)) and tau >= 0):
        raise ValueError(f"tau must be a number >= 0 (log2 units), got {tau!r}")
    g = trace.growth[trace.counted]
    return MaxGrowth(int(g.numel()), int((g > 0).sum()), int((g > tau).sum()), float(tau))


def growth_by_tile(trace: MaxTrace) -> torch.Tensor:
    """Per KV tile: the fraction of counted rows whose max grew there (NaN if none counted)."""
    grew = ((trace.growth > 0) & trace.counted).sum(dim=(0, 1, 2)).double()
    steps = trace.counted.sum(dim=(0, 1, 2)).double()
    return torch.where(steps > 0, grew / steps.clamp_min(1), torch.full_like(steps, math.nan))


# ---------------------------------------------------------------------------------------------
# 5. Why the PyTorch loop is slow on a GPU: many small kernel launches
#
# Every ATen operator that produces new data runs at least one GPU kernel; views (slices,
# transposes, expands) and bare allocations run none. The operators each tile step issues do
# not depend on the batch, the heads or the tile size (every operator covers all heads of a
# tile at once), so counting them on the CPU on tiny inputs counts the GPU launches.

NO_KERNEL_OPS = frozenset({
    "aten._unsafe_view.default", "aten.empty.memory_format", "aten.empty_strided.default",
    "aten.promote_types.default", "aten.lift_fresh.default", "aten.detach.default",
})


class _KernelOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and str(func) not in NO_KERNEL_OPS:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_kernel_ops(fn, *args, **kwargs) -> Counter:
    """The ATen operators ``fn(*args, **kwargs)`` runs that launch a kernel, by name."""
    with torch.no_grad(), _KernelOps() as counter:
        fn(*args, **kwargs)
    return counter.ops


@dataclass(frozen=True)
class LaunchCount:
    """Kernel-launching operators of ``attention_fa2`` (no mask): ``per_step`` for each
    (Q tile, KV tile) pair, ``per_q_tile`` around each Q tile's inner loop, ``fixed`` per call."""

    per_step: int
    per_q_tile: int
    fixed: int

    def total(self, seqlen_q: int, seqlen_k: int, tile_m: int = 128, tile_n: int = 128) -> int:
        n_q, n_kv = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
        return n_q * n_kv * self.per_step + n_q * self.per_q_tile + self.fixed


def launch_count(dtype=torch.bfloat16) -> LaunchCount:
    """Count on the CPU: total(n_q, n_kv) = per_step n_q n_kv + per_q_tile n_q + fixed, from
    runs with (n_q, n_kv) = (1, 1), (1, 2) and (2, 1) tiles of 4 rows."""
    def total(n_q, n_kv):
        q, _, _, _ = random_qkv(1, 4 * n_q, 2, 8, dtype=dtype, seed=0)
        _, k, v, _ = random_qkv(1, 4 * n_kv, 2, 8, dtype=dtype, seed=1)
        ops = count_kernel_ops(attention_fa2, q, k, v, tile_m=4, tile_n=4)
        return sum(ops.values())

    t11, t12, t21 = total(1, 1), total(1, 2), total(2, 1)
    per_step = t12 - t11
    per_q_tile = t21 - t11 - per_step
    return LaunchCount(per_step, per_q_tile, t11 - per_step - per_q_tile)


def launch_lines(versions, launches: LaunchCount, micro=None) -> list[str]:
    """The stored run's loop beside its launch count and the fastest peer of the same run; and,
    when the microbenchmark measured one eager operator alone (``eager_launch_us``), what the
    launches would take at that cost. The cost comes from a separate measurement where the data
    is too small to matter, so comparing it with the loop's time tests the launch-bound reading
    instead of assuming it."""
    from utils import bench

    rows = [r for r in versions.where(impl="tiled_fa2", **{"pass": "fwd"}) if r.get("ms")]
    lines = []
    for r in rows:
        peer = bench.best_peer(versions.rows, r)
        n = launches.total(r["s"], r["s"])
        lines.append(f"  B={r['b']:<3} S={r['s']:<6} {r['ms']:8.1f} ms, {n:7,} launches"
                     + (f"; {peer['impl']} does the same forward in {peer['ms']:.2f} ms"
                        if peer else ""))
    alone = micro.where(metric="eager_launch_us") if micro is not None else []
    if not alone:
        lines.append("  one eager operator measured alone: not in microbench.json yet (python -m "
                     "measure.microbench measures it); the stored run alone cannot tell launch "
                     "cost from the GPU's work on the data")
        return lines
    for a in alone:
        lines.append(f"  one operator measured alone, {a['impl']}: {a['value']:.1f} us "
                     f"({a['min']:.1f}..{a['max']:.1f} over {a['rounds']} rounds)")
    loop = next((a for a in alone if "tile loop" in a["impl"]), alone[0])
    for r in rows:
        model = launches.total(r["s"], r["s"]) * loop["value"] * 1e-3
        lines.append(f"  B={r['b']:<3} S={r['s']:<6} launches x {loop['value']:.1f} us = "
                     f"{model:8.1f} ms, against {r['ms']:8.1f} ms measured: {model / r['ms']:.0%}")
    return lines


def loop_ms(versions, s: int = 16384) -> float:
    return versions.one(impl="tiled_fa2", s=s, **{"pass": "fwd"})["ms"]


@claim("02.loop_slower_than_naive", "ch01_ch02_fwd",
       "at every stored length the tile loop takes longer on the H200 than the naive version")
def _loop_slower(res):
    pairs = {r["s"]: (r["ms"], res.one(impl="naive", s=r["s"], **{"pass": "fwd"})["ms"])
             for r in res.where(impl="tiled_fa2", **{"pass": "fwd"})}
    return (bool(pairs) and all(t > n for t, n in pairs.values()),
            ", ".join(f"S={s}: loop {t:.0f} ms, naive {n:.0f} ms" for s, (t, n) in pairs.items()))


@claim("02.loop_hundred_times_behind_peers", "ch01_ch02_fwd",
       "at every stored length the fastest peer of the run does the same forward more than a "
       "hundred times as fast as the tile loop")
def _loop_behind(res):
    from utils import bench

    ratios = {r["s"]: r["ms"] / bench.best_peer(res.rows, r)["ms"]
              for r in res.where(impl="tiled_fa2", **{"pass": "fwd"})}
    return (bool(ratios) and all(x > 100 for x in ratios.values()),
            ", ".join(f"S={s}: {x:.0f}x" for s, x in ratios.items()))


# ---------------------------------------------------------------------------------------------
# 6. Checkers: run the learner's piece inside the loop against the float64 reference


def _compare_with_reference(what: str, causal_cases=(False, True), **pieces) -> str | None:
    """Run attention_fa2 with the given pieces on awkward float32 shapes; describe the first
    mismatch with the float64 reference, or return None."""
    shapes = [(2, 75, 110, 3, 3, 16), (1, 110, 75, 4, 2, 16), (1, 33, 33, 2, 1, 8)]
    for b, sq, sk, h, hk, d in shapes:
        q, k, v, _ = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=torch.float32,
                                scale=2.0)
        for causal in causal_cases:
            out, lse = attention_fa2(q, k, v, causal=causal, tile_m=32, tile_n=32, **pieces)
            ref_out, ref_lse = attention_reference(q, k, v, causal=causal)
            case = f"seqlen_q={sq}, seqlen_k={sk}, tiles 32x32, causal={causal}"
            if torch.isnan(out).any() or torch.isnan(lse).any():
                return f"NaN in the attention output ({case}) when {what} runs in the loop"
            lse64, out64 = lse.double(), out.double()
            if not torch.equal(torch.isinf(lse64), torch.isinf(ref_lse)):
                return (f"rows that see no key must get lse = -inf, and only they ({case}); "
                        f"check {what}")
            fin = torch.isfinite(ref_lse)
            err_lse = (lse64 - ref_lse)[fin].abs().max().item() if fin.any() else 0.0
            err_out = (out64 - ref_out).abs().max().item()
            if err_out > 1e-4 or err_lse > 1e-4:
                return (f"with {what} in the loop, out is off by up to {err_out:.3g} and lse by "
                        f"{err_lse:.3g} vs the float64 reference ({case})")
    return None


def _random_state(rows=6, cols=5, d=4, seed=0):
    """A running state part-way through a row (some rows still empty) and a new tile."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(2, rows, generator=g, dtype=torch.float64) * 3
    l = torch.rand(2, rows, generator=g, dtype=torch.float64) * 5 + 0.5
    o = torch.randn(2, rows, d, generator=g, dtype=torch.float64) * l[..., None]
    s = torch.randn(2, rows, cols, generator=g, dtype=torch.float64) * 4
    v = torch.randn(2, cols, d, generator=g, dtype=torch.float64)
    m[:, 0], l[:, 0], o[:, 0] = NEG_INF, 0.0, 0.0  # row 0: first tile with a key
    s[:, 1] = NEG_INF  # row 1: this tile is all masked for it
    m[:, 2], l[:, 2], o[:, 2], s[:, 2] = NEG_INF, 0.0, 0.0, NEG_INF  # row 2: nothing seen yet
    s[:, 3, 0] += 20.0  # row 3: the max jumps by about 2^20
    return o, m, l, s, v


def _close(a, b) -> bool:
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    return torch.allclose(a.double(), b.double(), rtol=1e-9, atol=1e-12)


TILE_UPDATE_FORBID = {  # 02.1 (the reference is refused anyway)
    online_softmax_stats: "it runs the running max and sum over whole rows for you; write the "
                          "one-tile update yourself",
    online_softmax: "it computes a whole softmax; the exercise is the one-tile update of O, m "
                    "and l",
}


def check_tile_update(fn) -> None:
    """Exercise 02.1: ``fn(o, m, l, s, v) -> (o, m, l)`` (see ``tile_update``)."""
    for seed in range(3):
        o, m, l, s, v = _random_state(seed=seed)
        got = fn(o.clone(), m.clone(), l.clone(), s.clone(), v.clone())
        if not (isinstance(got, tuple) and len(got) == 3):
            raise AssertionError("return the new state as a tuple (o, m, l)")
        go, gm, gl = got
        ro, rm, rl = tile_update(o, m, l, s, v)
        if any(torch.isnan(t).any() for t in (go, gm, gl)):
            raise AssertionError(
                "NaN in the new state. For a row that has seen no key yet, m_old and m_new are "
                "both -inf and exp2(-inf - (-inf)) is NaN: use 0 in place of an m_new of -inf "
                "when you subtract it")
        if not _close(gm, rm):
            raise AssertionError("m is wrong: the new running max is max(m_old, tile row max)")
        m_use = rm.masked_fill(rm == NEG_INF, 0.0)
        if not _close(gl, rl):
            if _close(gl, l + torch.exp2(s - m_use[..., None]).sum(-1)):
                raise AssertionError("row sums are off by a factor: did you rescale l by "
                                     "exp2(m_old - m_new) before adding the tile's sum?")
            if _close(gl, torch.exp(m - m_use) * l + torch.exp(s - m_use[..., None]).sum(-1)):
                raise AssertionError("l uses exp: the scores are in the log2 domain (log2 e is "
                                     "folded into the scale), so use torch.exp2")
            raise AssertionError("l is wrong: l_new = exp2(m_old - m_new) * l_old + "
                                 "sum over the tile of exp2(s - m_new)")
        if not _close(go, ro):
            pv = torch.exp2(s - m_use[..., None]) @ v
            if _close(go, o + pv):
                raise AssertionError("l is right but O is not: O must be rescaled by "
                                     "exp2(m_old - m_new) too, before the tile's P V is added")
            if _close(go, ro / rl.masked_fill(rl == 0, 1.0)[..., None]):
                raise AssertionError("O is normalised; keep it unnormalised in the loop (divide "
                                     "by l once, after the last tile)")
            raise AssertionError("O is wrong: O_new = exp2(m_old - m_new) * O_old + P V with "
                                 "P = exp2(s - m_new)")
    problem = _compare_with_reference("your tile_update", update=fn)
    if problem:
        raise AssertionError(problem)


def check_lse(fn) -> None:
    """Exercise 02.2: ``fn(m, l) -> lse``, natural log, from the log2-domain state."""
    g = torch.Generator().manual_seed(1)
    m = torch.randn(3, 7, generator=g, dtype=torch.float64) * 10
    l = torch.rand(3, 7, generator=g, dtype=torch.float64) * 50 + 1
    m[0, 0], l[0, 0] = NEG_INF, 0.0
    got = fn(m, l)
    if not isinstance(got, torch.Tensor) or got.shape != m.shape:
        raise AssertionError(f"return one LSE per row: a tensor of shape {tuple(m.shape)}")
    if torch.isnan(got).any():
        raise AssertionError("NaN: a row that saw no key has m = -inf and l = 0; its LSE is "
                             "-inf (log2(0) = -inf, and -inf + -inf is still -inf)")
    want = lse_from_state(m, l)
    fin = torch.isfinite(want)
    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        raise AssertionError("a row with l = 0 must get -inf, and only such rows")
    if not torch.allclose(got[fin], want[fin], rtol=1e-9, atol=1e-12):
        if torch.allclose(got[fin], (m + torch.log2(l))[fin], rtol=1e-9):
            raise AssertionError("that is the LSE in log2 units; the course's LSE is a natural "
                                 "log: multiply by ln 2")
        if torch.allclose(got[fin], (m + torch.log(l))[fin], rtol=1e-9) or torch.allclose(
                got[fin], ((m + torch.log(l)) * LN2)[fin], rtol=1e-9):
            raise AssertionError("l is a sum of powers of 2 (exp2): take log2(l), not log(l), "
                                 "then convert the whole (m + log2 l) with ln 2")
        if torch.allclose(got[fin], (m * LN2)[fin], rtol=1e-9):
            raise AssertionError("the max alone is not the LSE: add log2 of the row sum")
        raise AssertionError("LSE = (m + log2(l)) * ln 2 for m, l in the log2 domain")
    problem = _compare_with_reference("your lse", lse_fn=fn)
    if problem:
        raise AssertionError(problem)


def kv_tiles_forbid() -> dict:
    """What exercise 02.3 refuses: the course's other implementations of the same count (those of
    chapter 04 and fa4_final, when this session has imported them: an answer can only name an
    object its notebook has imported) and count_tiles, which runs the reference."""
    import sys

    why = "it counts the tiles for you; the exercise is to work out the last visible key"
    table = {count_tiles: why}
    for module, names in (("solutions.ch04_flash_ampere", ("kv_tile_range",)),
                          ("solutions.ch04_teaching", ("kv_tiles", "kv_tile_ranges")),
                          ("fa4_final.common.tiles", ("kv_tile_range",))):
        if module in sys.modules:
            table.update({getattr(sys.modules[module], n): why for n in names
                          if hasattr(sys.modules[module], n)})
    return table


def check_kv_tiles_to_visit(fn) -> None:
    """Exercise 02.3: ``fn(q_start, q_end, seqlen_q, seqlen_k, tile_n, causal) -> int``."""
    for sq, sk in ((100, 100), (40, 130), (130, 40), (64, 64), (1, 300)):
        for tile_m, tile_n in ((32, 32), (64, 16), (16, 64)):
            for q0 in range(0, sq, tile_m):
                q1 = min(q0 + tile_m, sq)
                n_kv = -(-sk // tile_n)
                got = fn(q0, q1, sq, sk, tile_n, False)
                if got != n_kv:
                    raise AssertionError(f"without a mask every KV tile is visited: "
                                         f"ceil({sk} / {tile_n}) = {n_kv}, got {got}")
                got = fn(q0, q1, sq, sk, tile_n, True)
                want = kv_tiles_to_visit(q0, q1, sq, sk, tile_n, True)
                where = (f"rows [{q0}, {q1}), seqlen_q={sq}, seqlen_k={sk}, tile_n={tile_n}: "
                         f"row i sees keys j <= i + {sk - sq}")
                if not isinstance(got, int) or isinstance(got, bool):
                    raise AssertionError(f"return an int, got {type(got).__name__} ({where})")
                if got < 0:
                    raise AssertionError(f"you visit {got} tiles: a count cannot be negative. "
                                         "When no row of the tile sees any key (seqlen_q > "
                                         f"seqlen_k, early rows) visit 0 tiles ({where})")
                if got > want:
                    raise AssertionError(f"you visit {got} tiles but tile {want} and later hold "
                                         f"no key any row sees ({where})")
                if got < want:
                    last = min(sk, q1 + sk - sq) - 1
                    raise AssertionError(f"you visit {got} tiles but row {q1 - 1} sees key "
                                         f"{last}, in tile {last // tile_n} ({where})")
    counts = TileCounts()
    q, k, v, _ = random_qkv(1, 130, 2, 16, seqlen_k=70, dtype=torch.float32)
    attention_fa2(q, k, v, causal=True, tile_m=32, tile_n=32, counts=counts, n_tiles=fn)
    want = count_tiles(130, 70, 32, 32, True)
    if (counts.computed, counts.skipped) != (want.computed, want.skipped):
        raise AssertionError(f"the loop computed {counts.computed} and skipped {counts.skipped} "
                             f"tiles; expected {want.computed} and {want.skipped}")
    problem = _compare_with_reference("your kv_tiles_to_visit", causal_cases=(True,), n_tiles=fn)
    if problem:
        raise AssertionError(problem)
