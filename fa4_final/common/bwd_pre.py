"""The backward's preprocessing kernel: what every KV tile's CTA needs per query row, once.

Per (query tile, head, batch), for the rows of the tile:
- delta_i = sum_d dO_id O_id in float32 (the softmax Jacobian's row term, dS = P * (dP - delta));
- the lse in log2 units, lse * log2(e), so the main kernel recomputes P = 2^(S * scale * log2 e
  - lse_log2) with one FFMA and one MUFU.EX2 per element. A row that sees no key (lse = -inf)
  and the padding rows past seqlen_q get +inf: their P is 2^(-inf) = 0, never inf - inf = NaN;
- the tile's float32 dQ accumulator zeroed (every KV tile then adds into it), and in the
  deterministic mode its turn counter set to 0 (with dq_first_store only the counters: the
  first KV tile stores, Note [dQ copies] in fa4_final.common.bwd_tiles);
- with ``has_dlse`` (Note [The lse gradient folded]), delta_i - dlse_i in delta's place.
Both vectors are padded to whole query tiles so the main kernel loads a tile's worth with one
bulk copy. Bytes: O and dO read once (2 x 2 B per element), 4 B of dQ accumulator written per
element: a memory-bound pass of about 3 % of the backward's time at S = 4096.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4_final.common.constants import LOG2_E, WARP_SIZE
from fa4_final.common.seqlens import varlen_query_tile

THREADS = 128
VECTOR = 8  # 16-bit elements per 16-byte load


class BackwardPre:
    """delta, lse_log2, zeroed dQ accumulator (and turn counters), one CTA per query tile."""

    varlen = False  # VarlenBackwardPre: packed sequences

    def __init__(self, dtype, head_dim: int, tile_m: int, deterministic: bool = False,
                 has_dlse: bool = False, has_seqused_q: bool = False, dq_copies: int = 1,
                 dq_first_store: bool = False, head_dim_v: int | None = None):
        # accumulator copies per query tile (Note [dQ copies] in fa4_final.common.bwd_tiles)
        self.dq_copies = int(dq_copies)
        # the main kernel's first visitor stores: the accumulator is not zeroed, only the turns
        self.dq_first_store = bool(deterministic) and bool(dq_first_store)
        self.has_dlse = bool(has_dlse)  # Note [The lse gradient folded]
        # varlen only: a sequence's rows past seqused_q are padding (Note [Used query rows])
        self.has_seqused_q = self.varlen and bool(has_seqused_q)
        self.dtype = dtype
        self.head_dim = head_dim  # D: the dQ accumulator's rows
        # dv: the columns of out and dout that delta sums over (D if None)
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.tile_m = tile_m
        self.deterministic = bool(deterministic)
        # threads a row: the largest power of two dividing its vectors, 16 at dv = 128 (one row
        # per half warp), 4 at dv = 96 (each thread reads 3 vectors of the row)
        vectors = self.head_dim_v // VECTOR
        self.threads_per_row = vectors & -vectors
        self.rows_per_pass = THREADS // self.threads_per_row
        assert WARP_SIZE % self.threads_per_row == 0 and tile_m % self.rows_per_pass == 0
        assert (tile_m * head_dim) % (THREADS * 4) == 0

    def cache_key(self) -> tuple:
        key = (type(self).__name__, self.dtype.__name__, self.head_dim, self.tile_m,
               self.deterministic)
        key = key + (("seqused_q",),) if self.has_seqused_q else key
        key = key + (("dq_copies", self.dq_copies),) if self.dq_copies > 1 else key
        key = key + (("dq_first_store",),) if self.dq_first_store else key
        key = key + (("head_dim_v", self.head_dim_v),) if self.head_dim_v != self.head_dim else key
        return key + (("dlse",),) if self.has_dlse else key

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (batch, seqlen_q, heads, dv)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, dv)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) float32, natural log
        mLSE2: cute.Tensor,  # (batch, heads, seqlen_q_padded) float32 out, log2 units
        mDelta: cute.Tensor,  # (batch, heads, seqlen_q_padded) float32 out
        mdQaccum: cute.Tensor,  # (batch, heads, seqlen_q_padded * D) float32 out, zeroed
        # (untouched with dq_first_store)
        mTurn: cute.Tensor,  # (batch, heads, num_m_blocks) int32 out (deterministic), zeroed
        stream,
        mdLSE: cute.Tensor | None = None,  # has_dlse: (batch, heads, seqlen_q) float32
    ):
        self.launch(mO, mdO, mLSE, mLSE2, mDelta, mdQaccum, mTurn, None, stream, mdLSE)

    @cute.jit
    def launch(self, mO, mdO, mLSE, mLSE2, mDelta, mdQaccum, mTurn, mCuSeqlensQ, stream,
               mdLSE=None, mSeqUsedQ=None):
        """Both variants' host side; ``mCuSeqlensQ`` is None in the dense one."""
        if const_expr(not (mO.element_type == mdO.element_type == self.dtype)):
            raise TypeError(f"out and dout must be {self.dtype}")
        if const_expr(self.has_dlse != (mdLSE is not None)):
            raise TypeError("dlse is given exactly to a build with has_dlse=True "
                            "(Note [The lse gradient folded])")
        if const_expr(mdLSE is not None and mdLSE.element_type != Float32):
            raise TypeError("dlse must be float32")
        if const_expr(self.has_seqused_q != (mSeqUsedQ is not None)):
            raise TypeError("seqused_q is given exactly to a varlen build with has_seqused_q")
        num_m_blocks = cute.ceil_div(mO.shape[1], self.tile_m)
        # one thread per VECTOR elements of a row: (rows_per_pass, threads_per_row) threads
        copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                        num_bits_per_copy=128)
        tiled_copy = cute.make_tiled_copy_tv(
            copy_atom,
            cute.make_layout((self.rows_per_pass, self.threads_per_row),
                             stride=(self.threads_per_row, 1)),
            cute.make_layout((1, VECTOR)))
        grid = (num_m_blocks, mO.shape[2], mO.shape[0])
        if const_expr(self.varlen):  # the query tiles of every sequence and head, as a list
            grid = ((num_m_blocks + mCuSeqlensQ.shape[0] - 1) * mO.shape[2], 1, 1)
        self.kernel(mO, mdO, mLSE, mLSE2, mDelta, mdQaccum, mTurn, tiled_copy,
                    mCuSeqlensQ, mdLSE, mSeqUsedQ).launch(grid=grid, block=[THREADS, 1, 1],
                                                          stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mDelta: cute.Tensor, mdQaccum: cute.Tensor, mTurn: cute.Tensor,
               tiled_copy: cute.TiledCopy, mCuSeqlensQ: cute.Tensor | None,
               mdLSE: cute.Tensor | None, mSeqUsedQ: cute.Tensor | None):
        m_block, head, b = cute.arch.block_idx()
        if const_expr(not self.varlen):
            self.tile(mO, mdO, mLSE, mLSE2, mDelta, mdQaccum, mTurn, tiled_copy, m_block,
                      head, b, mO.shape[1], None, mdLSE)
        else:
            m_in_seq, at = varlen_query_tile(m_block, mCuSeqlensQ, self.tile_m, mO.shape[2],
                                             mSeqUsedQ)
            if at.valid:
                self.tile(mO, mdO, mLSE, mLSE2, mDelta, mdQaccum, mTurn, tiled_copy, m_in_seq,
                          at.head, Int32(0), at.seqlen_q, (at.offset_q, at.m_base), mdLSE)

    @cute.jit
    def tile(self, mO, mdO, mLSE, mLSE2, mDelta, mdQaccum, mTurn, tiled_copy, m_block, head,
             b, seqlen_q, seq, mdLSE=None):
        """One query tile: rows m_block * tile_m .. of ``head``. Varlen (``seq``): the rows of
        a sequence starting at packed row seq[0], its padded tiles from seq[1]."""
        tidx, _, _ = cute.arch.thread_idx()
        mO_rows, mdO_rows = mO[b, None, head, None], mdO[b, None, head, None]  # (s, D)
        m_pad, first_row, first_pad_row = m_block, None, None
        if const_expr(seq is not None):  # Note [Varlen dQ accumulator] (fa4_final.common.bwd_tiles)
            first_row, first_pad_row = seq[0], seq[1] * self.tile_m
            m_pad = seq[1] + m_block
            mO_rows = cute.domain_offset((first_row, 0), mO_rows)
            mdO_rows = cute.domain_offset((first_row, 0), mdO_rows)
        tile = (self.tile_m, self.head_dim_v)
        gO = cute.local_tile(mO_rows, tile, (m_block, 0))  # (tile_m, dv)
        gdO = cute.local_tile(mdO_rows, tile, (m_block, 0))
        cO = cute.local_tile(cute.make_identity_tensor((seqlen_q, self.head_dim_v)), tile,
                             (m_block, 0))
        thr_copy = tiled_copy.get_slice(tidx)
        tOgO = thr_copy.partition_S(gO)  # (CPY, passes, vectors a thread's row holds)
        tOgdO = thr_copy.partition_S(gdO)
        tOcO = thr_copy.partition_S(cO)
        rO = cute.make_rmem_tensor_like(tOgO[None, 0, 0])
        rdO = cute.make_rmem_tensor_like(tOgdO[None, 0, 0])
        lane_in_row = tidx % self.threads_per_row
        for p in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            row = tOcO[0, p, 0][0]
            partial = Float32(0.0)
            if row < seqlen_q:
                for c in cutlass.range_constexpr(cute.size(tOgO, mode=[2])):
                    cute.autovec_copy(tOgO[None, p, c], rO)
                    cute.autovec_copy(tOgdO[None, p, c], rdO)
                    o = rO.load().to(Float32)
                    do = rdO.load().to(Float32)
                    if const_expr(c == 0):
                        partial = (o * do).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    else:
                        partial = partial + (o * do).reduce(cute.ReductionOp.ADD, Float32(0.0),
                                                            0)
            delta = cute.arch.warp_reduction_sum(partial, threads_in_group=self.threads_per_row)
            if lane_in_row == 0:
                lse2 = Float32.inf  # padding rows and rows that see no key: P = 0
                if row < seqlen_q:
                    if const_expr(seq is None):
                        lse = mLSE[b, head, row]
                    else:
                        lse = mLSE[b, head, first_row + row]
                    if lse != -Float32.inf:
                        lse2 = lse * LOG2_E
                    if const_expr(mdLSE is not None):  # Note [The lse gradient folded]
                        if const_expr(seq is None):
                            delta = delta - mdLSE[b, head, row]
                        else:
                            delta = delta - mdLSE[b, head, first_row + row]
                if const_expr(seq is None):
                    mLSE2[b, head, row] = lse2
                    mDelta[b, head, row] = delta
                else:
                    mLSE2[b, head, first_pad_row + row] = lse2
                    mDelta[b, head, first_pad_row + row] = delta
        # zero this tile's slab of the dQ accumulator: 16 B per thread per step
        # (with dq_copies: the tile's run of copies, slabs m_pad * C .. m_pad * C + C - 1)
        # (dq_first_store: not at all, the first visitor of each copy stores; Note [dQ copies])
        if const_expr(not self.dq_first_store):
            slab = self.tile_m * self.head_dim * self.dq_copies
            gAcc = cute.local_tile(mdQaccum[b, head, None], (slab,), (m_pad,))
            gAcc = cute.flat_divide(gAcc, (4,))  # (4, slab / 4)
            zeros = cute.make_rmem_tensor(4, Float32)
            zeros.fill(0.0)
            for i in cutlass.range_constexpr(slab // (4 * THREADS)):
                cute.autovec_copy(zeros, gAcc[None, i * THREADS + tidx])
        if const_expr(self.deterministic and self.dq_copies > 1):
            if tidx < self.dq_copies:
                mTurn[b, head, m_pad * self.dq_copies + tidx] = Int32(0)
        elif const_expr(self.deterministic):
            if tidx == 0:
                mTurn[b, head, m_pad] = Int32(0)


# Note [The lse gradient folded]
# A loss that uses the returned lse sends its gradient dlse into the backward. lse_i = log sum_j
# exp(s_ij), so d lse_i / d s_ij = P_ij and the softmax's Jacobian gains one term:
#     dS_ij = P_ij (dP_ij - delta_i + dlse_i) = P_ij (dP_ij - (delta_i - dlse_i)),
# with delta_i = rowsum(dO_i * O_i). So the whole effect is delta_i - dlse_i in delta's place,
# one float a row, read here once; the main kernel and bwd_post are the builds without it. A row
# that sees no key has P = 0 and no gradient either way. A compile-time variant (has_dlse): the
# build without it is exactly the kernel it was.


class VarlenBackwardPre(BackwardPre):
    """bwd_pre over packed sequences (runtime.varlen): out, dout (1, total_q, heads, D), lse
    (1, heads, total_q); lse_log2, delta, the dQ accumulator and the turn counters in the padded
    layout of Note [Varlen dQ accumulator]. One CTA per query tile of a sequence and head,
    listed as the forward lists them (schedule.varlen_locate); CTAs past the last exit."""

    varlen = True

    def cache_key(self) -> tuple:
        return super().cache_key() + ("varlen",)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor,
                 mTurn: cute.Tensor, mCuSeqlensQ: cute.Tensor, stream,
                 mdLSE: cute.Tensor | None = None,  # has_dlse: (1, heads, total_q) float32
                 mSeqUsedQ: cute.Tensor | None = None):  # has_seqused_q: (batch,) int32
        self.launch(mO, mdO, mLSE, mLSE2, mDelta, mdQaccum, mTurn, mCuSeqlensQ, stream, mdLSE,
                    mSeqUsedQ)
