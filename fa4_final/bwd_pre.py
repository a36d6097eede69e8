"""The backward's preprocessing kernel: what every KV tile's CTA needs per query row, once.

Per (query tile, head, batch), for the rows of the tile:
- delta_i = sum_d dO_id O_id in float32 (the softmax Jacobian's row term, dS = P * (dP - delta));
- the lse in log2 units, lse * log2(e), so the main kernel recomputes P = 2^(S * scale * log2 e
  - lse_log2) with one FFMA and one MUFU.EX2 per element. A row that sees no key (lse = -inf)
  and the padding rows past seqlen_q get +inf: their P is 2^(-inf) = 0, never inf - inf = NaN;
- the tile's float32 dQ accumulator zeroed (every KV tile then adds into it), and in the
  deterministic mode its turn counter set to 0.
Both vectors are padded to whole query tiles so the main kernel loads a tile's worth with one
bulk copy. Bytes: O and dO read once (2 x 2 B per element), 4 B of dQ accumulator written per
element: a memory-bound pass of about 3 % of the backward's time at S = 4096.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4_final.constants import LOG2_E, WARP_SIZE

THREADS = 128
VECTOR = 8  # 16-bit elements per 16-byte load


class BackwardPre:
    """delta, lse_log2, zeroed dQ accumulator (and turn counters), one CTA per query tile."""

    def __init__(self, dtype, head_dim: int, tile_m: int, deterministic: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.deterministic = bool(deterministic)
        self.threads_per_row = head_dim // VECTOR  # 16 at D = 128: one row per half warp
        self.rows_per_pass = THREADS // self.threads_per_row
        assert WARP_SIZE % self.threads_per_row == 0 and tile_m % self.rows_per_pass == 0
        assert (tile_m * head_dim) % (THREADS * 4) == 0

    def cache_key(self) -> tuple:
        return (type(self).__name__, self.dtype.__name__, self.head_dim, self.tile_m,
                self.deterministic)

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) float32, natural log
        mLSE2: cute.Tensor,  # (batch, heads, seqlen_q_padded) float32 out, log2 units
        mDelta: cute.Tensor,  # (batch, heads, seqlen_q_padded) float32 out
        mdQaccum: cute.Tensor,  # (batch, heads, seqlen_q_padded * D) float32 out, zeroed
        mTurn: cute.Tensor,  # (batch, heads, num_m_blocks) int32 out (deterministic), zeroed
        stream,
    ):
        if const_expr(not (mO.element_type == mdO.element_type == self.dtype)):
            raise TypeError(f"out and dout must be {self.dtype}")
        num_m_blocks = cute.ceil_div(mO.shape[1], self.tile_m)
        # one thread per VECTOR elements of a row: (rows_per_pass, threads_per_row) threads
        copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                        num_bits_per_copy=128)
        tiled_copy = cute.make_tiled_copy_tv(
            copy_atom,
            cute.make_layout((self.rows_per_pass, self.threads_per_row),
                             stride=(self.threads_per_row, 1)),
            cute.make_layout((1, VECTOR)))
        self.kernel(mO, mdO, mLSE, mLSE2, mDelta, mdQaccum, mTurn, tiled_copy).launch(
            grid=(num_m_blocks, mO.shape[2], mO.shape[0]), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mDelta: cute.Tensor, mdQaccum: cute.Tensor, mTurn: cute.Tensor,
               tiled_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, b = cute.arch.block_idx()
        seqlen_q = mO.shape[1]
        tile = (self.tile_m, self.head_dim)
        gO = cute.local_tile(mO[b, None, head, None], tile, (m_block, 0))  # (tile_m, D)
        gdO = cute.local_tile(mdO[b, None, head, None], tile, (m_block, 0))
        cO = cute.local_tile(cute.make_identity_tensor((seqlen_q, self.head_dim)), tile,
                             (m_block, 0))
        thr_copy = tiled_copy.get_slice(tidx)
        tOgO = thr_copy.partition_S(gO)  # (CPY, passes, 1)
        tOgdO = thr_copy.partition_S(gdO)
        tOcO = thr_copy.partition_S(cO)
        rO = cute.make_rmem_tensor_like(tOgO[None, 0, 0])
        rdO = cute.make_rmem_tensor_like(tOgdO[None, 0, 0])
        lane_in_row = tidx % self.threads_per_row
        for p in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            row = tOcO[0, p, 0][0]
            partial = Float32(0.0)
            if row < seqlen_q:
                cute.autovec_copy(tOgO[None, p, 0], rO)
                cute.autovec_copy(tOgdO[None, p, 0], rdO)
                o = rO.load().to(Float32)
                do = rdO.load().to(Float32)
                partial = (o * do).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            delta = cute.arch.warp_reduction_sum(partial, threads_in_group=self.threads_per_row)
            if lane_in_row == 0:
                lse2 = Float32.inf  # padding rows and rows that see no key: P = 0
                if row < seqlen_q:
                    lse = mLSE[b, head, row]
                    if lse != -Float32.inf:
                        lse2 = lse * LOG2_E
                mLSE2[b, head, row] = lse2
                mDelta[b, head, row] = delta
        # zero this tile's slab of the dQ accumulator: 16 B per thread per step
        slab = self.tile_m * self.head_dim
        gAcc = cute.local_tile(mdQaccum[b, head, None], (slab,), (m_block,))
        gAcc = cute.flat_divide(gAcc, (4,))  # (4, slab / 4)
        zeros = cute.make_rmem_tensor(4, Float32)
        zeros.fill(0.0)
        for i in cutlass.range_constexpr(slab // (4 * THREADS)):
            cute.autovec_copy(zeros, gAcc[None, i * THREADS + tidx])
        if const_expr(self.deterministic):
            if tidx == 0:
                mTurn[b, head, m_block] = Int32(0)
