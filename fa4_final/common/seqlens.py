"""Which sequence a tile belongs to, and where its rows lie: the dense batch or packed varlen
sequences, one interface for the kernels.

Dense: q is (batch, seqlen_q, heads, D) and every sequence has the same lengths; tile t is placed
by schedule.tile_coords. Varlen (runtime.varlen): the packed q (total_q, heads, D) arrives as
a batch of one, (1, total_q, heads, D), and sequence b is rows cu_seqlens_q[b] ..
cu_seqlens_q[b + 1] - 1 of it; tile t is placed by schedule.varlen_locate (Note [Varlen order]).
Its rows are reached by moving the coordinate origin to the sequence's first row
(``cute.domain_offset``): the kernel then indexes a sequence exactly as it indexes a dense batch
entry, and the TMA descriptors stay the ones built once for the whole packed tensor.

What the offset does not do is stop at the sequence's end: a TMA box that starts inside
sequence b and runs past its last row reads rows of sequence b + 1 (clipped only at total_q).
Loads may: those keys are masked by the per-sequence seqlen_k (mask.apply_mask) and those query
rows are never stored. Stores may not: Note [Varlen epilogue] in hopper/fwd.py. One consequence
of reading past the end: a masked key's probability is exactly 0, but 0 * V is NaN where V
holds a NaN or an infinity, so key rows past seqused_k (or the next sequence's) must hold finite
values, as any initialised KV cache does (the per-sequence loop, varlen.forward_loop, reads
zeros there instead: TMA fills a box past a slice's end with zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from fa4_final.common.bwd_tiles import dq_accum_tile
from fa4_final.common.schedule import tile_coords, varlen_locate


@dataclass(frozen=True)
class SeqTile:
    """One tile of work: its query block, head, batch entry and its sequence's lengths."""

    m_block: Int32
    head: Int32
    b: Int32  # batch entry; 0 for varlen (the packed batch of one)
    seqlen_q: Int32
    seqlen_k: Int32
    offset_q: Int32 | None  # the sequence's first row in the packed q, out and lse (varlen)
    offset_k: Int32 | None  # its first row in the packed k and v


class Sequences:
    """The tile space of one launch. Built inside the kernel from its arguments; the producer
    and the consumer warps each hold one and call ``tile(t)`` for the same t
    (Note [Forward phases])."""

    def __init__(self, tile_m: int, longest_first: bool, seqlen_q, seqlen_k, heads, batch,
                 l2_group, mCuSeqlensQ=None, mCuSeqlensK=None, mSeqUsedK=None, mSeqUsedQ=None):
        self.tile_m, self.longest_first = tile_m, longest_first
        self.seqlen_q, self.seqlen_k, self.heads, self.batch = seqlen_q, seqlen_k, heads, batch
        self.l2_group = l2_group
        self.cu_q, self.cu_k, self.used_k = mCuSeqlensQ, mCuSeqlensK, mSeqUsedK
        self.used_q = mSeqUsedQ  # Note [Used query rows]
        self.varlen = mCuSeqlensQ is not None

    def num_tiles(self):
        if not self.varlen:
            return cute.ceil_div(self.seqlen_q, self.tile_m) * self.heads * self.batch
        return varlen_locate(Int32(-1), self.cu_q, self.tile_m, self.heads)[2]

    def tile(self, t) -> SeqTile:
        """Where linear tile ``t`` (< num_tiles()) lies. Varlen: warp-collective."""
        if not self.varlen:
            m_block, head, b = _dense_tile(t, self.seqlen_q, self.heads, self.batch,
                                           self.l2_group, self.tile_m, self.longest_first)
            return SeqTile(m_block, head, b, self.seqlen_q, self.seqlen_k, None, None)
        b, before, _ = varlen_locate(t, self.cu_q, self.tile_m, self.heads)
        offset_q, offset_k = self.cu_q[b], self.cu_k[b]
        rows_q = self.cu_q[b + 1] - offset_q  # the tiles are counted over these
        seqlen_q = rows_q
        if self.used_q is not None:  # Note [Used query rows]
            seqlen_q = self.used_q[b]
        if self.used_k is not None:
            seqlen_k = self.used_k[b]
        else:
            seqlen_k = self.cu_k[b + 1] - offset_k
        # inside the sequence: the dense order with a batch of one
        m_block, head, _ = tile_coords(t - before, cute.ceil_div(rows_q, self.tile_m),
                                       self.heads, 1, longest_first=self.longest_first,
                                       l2_group=self.l2_group)
        return SeqTile(m_block, head, Int32(0), seqlen_q, seqlen_k, offset_q, offset_k)

    # Note [Used query rows]
    # FA4's seqused_q: sequence b's queries are the first seqused_q[b] of its
    # cu_seqlens_q[b + 1] - cu_seqlens_q[b] packed rows; the rest are padding, never read into
    # a result and never written (out and lse keep what the caller's buffers held there, as in
    # the FA4 package). The tile count stays that of the packed rows (varlen_locate: the grid
    # and the tile order need no device value more), so a tile that lies wholly in the padding
    # takes part in the order but sees no key (tile_past_used_rows) and stores nothing: its
    # epilogue's rows are all past seqlen_q. The causal diagonal is placed by the used length,
    # bottom-right: key j is visible to query i when j <= i + seqlen_k - seqused_q[b].

    def tile_past_used_rows(self, w: SeqTile):
        """Whether tile ``w`` lies wholly in its sequence's padding rows
        (Note [Used query rows]); False wherever there is no seqused_q."""
        if self.used_q is None:
            return False
        return w.m_block * self.tile_m >= w.seqlen_q

    def rows_q(self, mX: cute.Tensor, w: SeqTile, head) -> cute.Tensor:
        """``mX`` (s, D, h, b) or (s, h, b) -> this sequence's (s, D) or (s,) slab of ``head``,
        row 0 its first query row (q, out, lse)."""
        return sequence_slab(mX, head, w.b, w.offset_q)

    def rows_k(self, mX: cute.Tensor, w: SeqTile, head_kv) -> cute.Tensor:
        """The same for k and v: row 0 is the sequence's first key."""
        return sequence_slab(mX, head_kv, w.b, w.offset_k)


@cute.jit
def _dense_tile(t: Int32, seqlen_q: Int32, heads: Int32, batch: Int32, l2_group,
                tile_m: cutlass.Constexpr[int], longest_first: cutlass.Constexpr[bool]):
    return tile_coords(t, cute.ceil_div(seqlen_q, tile_m), heads, batch,
                       longest_first=longest_first, l2_group=l2_group)


def sequence_slab(mX: cute.Tensor, head, b, offset):
    """``mX`` (s, D, h, b) or (s, h, b) -> the (s, D) or (s,) slab of ``head`` and batch entry
    ``b``, row 0 moved to ``offset`` when given (varlen: a sequence's first row), else as is."""
    if cute.rank(mX) == 4:
        slab = mX[None, None, head, b]
        return slab if offset is None else cute.domain_offset((offset, 0), slab)
    slab = mX[None, head, b]
    return slab if offset is None else cute.domain_offset((offset,), slab)


def rows_per_store_pass(rows: int, threads: int, per_row: int) -> int:
    """The rows store_rows writes per pass: as many as ``threads`` cover at ``per_row`` threads
    a row, down to one that divides ``rows``. D = 64, 128, 256 divide evenly; D = 96 and 192
    (12 and 24 threads a row: 256 // 12 = 21 rows, which do not divide 128) take 16 and 8
    rows a pass, so some threads sit the store out."""
    n = threads // per_row
    while rows % n:
        n -= 1
    return n


@cute.jit
def store_rows(s_tile: cute.Tensor, g_tile: cute.Tensor, tidx, rows_left, threads: int):
    """The first ``rows_left`` rows of the (rows, D) shared-memory tile ``s_tile`` to ``g_tile``,
    16 bytes per thread and pass, one predicate per row (Note [Varlen epilogue] in hopper/fwd.py);
    all ``threads`` threads take part where a pass's rows divide the tile's (else the first
    rows_per_store_pass x threads-a-row of them). The shared-memory reads are plain loads:
    nothing to wait for after. The forward's partial O tile, the backward's partial dK and dV
    tiles."""
    dtype = s_tile.element_type
    rows, head_dim = cute.size(s_tile, mode=[0]), cute.size(s_tile, mode=[1])
    vec = 128 // dtype.width  # elements per 16-byte vector
    per_row = head_dim // vec  # threads per row
    rows_per_pass = rows_per_store_pass(rows, threads, per_row)
    active = rows_per_pass * per_row
    if const_expr(active < threads):
        if tidx < active:
            _store_rows(s_tile, g_tile, tidx, rows_left, dtype, rows, head_dim, vec, per_row,
                        rows_per_pass)
    else:
        _store_rows(s_tile, g_tile, tidx, rows_left, dtype, rows, head_dim, vec, per_row,
                    rows_per_pass)


@cute.jit
def _store_rows(s_tile, g_tile, tidx, rows_left, dtype: cutlass.Constexpr,
                rows: cutlass.Constexpr, head_dim: cutlass.Constexpr, vec: cutlass.Constexpr,
                per_row: cutlass.Constexpr, rows_per_pass: cutlass.Constexpr):
    """store_rows' copy by its rows_per_pass x per_row threads."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    tiled = cute.make_tiled_copy_tv(
        atom, cute.make_ordered_layout((rows_per_pass, per_row), order=(1, 0)),
        cute.make_layout((1, vec)))
    thr = tiled.get_slice(tidx)
    tXsX = thr.partition_S(s_tile)  # (CPY, rows / rows_per_pass, 1)
    tXgX = thr.partition_D(g_tile)
    tXcX = thr.partition_S(cute.make_identity_tensor((rows, head_dim)))
    tXrX = cute.make_fragment_like(tXsX, dtype)
    cute.autovec_copy(tXsX, tXrX)
    for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
        if tXcX[0, m, 0][0] < rows_left:
            cute.copy(atom, tXrX[None, m, None], tXgX[None, m, None])


class QueryTile:
    """Where a varlen query tile lies: its sequence's rows and padded tiles, and its head."""

    def __init__(self, valid, head, seqlen_q, offset_q, m_base):
        self.valid, self.head, self.seqlen_q = valid, head, seqlen_q
        self.offset_q, self.m_base = offset_q, m_base


@cute.jit
def varlen_query_tile(t, mCuSeqlensQ: cute.Tensor, tile_m: cutlass.Constexpr[int], heads,
                      mSeqUsedQ: cute.Tensor | None = None):
    """(m_block, QueryTile) of linear tile ``t`` of the backward's bwd_pre and bwd_post: sequence by
    sequence, in each its heads, in each head its query tiles (warp-collective). With
    ``mSeqUsedQ`` the tile's seqlen_q is the sequence's used rows; the tiles stay those of its
    packed rows (Note [Used query rows])."""
    b, before, total = varlen_locate(t, mCuSeqlensQ, tile_m, heads)
    offset_q = mCuSeqlensQ[b]
    rows_q = mCuSeqlensQ[b + 1] - offset_q
    seqlen_q = rows_q
    if const_expr(mSeqUsedQ is not None):
        seqlen_q = mSeqUsedQ[b]
    n_m = cutlass.max(cute.ceil_div(rows_q, tile_m), 1)
    r = t - before
    return r % n_m, QueryTile(t < total, r // n_m, seqlen_q, offset_q,
                              dq_accum_tile(offset_q, b, tile_m))
