"""The backward's postprocessing kernel: dQ = scale * (float32 dQ accumulator), in the inputs'
dtype. The dQ epilogue the main kernel cannot run itself, because a query tile's dQ is complete
only when every KV tile's CTA has added its part.

The accumulator is stored in the main kernel's register order (Note [dQ in accumulator order] in
common.dq_order), so this kernel asks the writer which (row, col) each loaded float belongs to
(``dq_coords``: the Hopper kernel partitions its dQ tiled MMA once more; for the Blackwell kernel,
which writes the same order, common.dq_order.DqOrder states it as arithmetic). Each thread loads
exactly the floats the matching MMA thread stored (16 B at a time, coalesced), scales and converts
them, writes them into a shared-memory tile by coordinate, and the CTA copies the tile out row by
row (rows past seqlen_q are not written). Bytes: 4 B read and 2 B written per dQ element.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4_final.common.seqlens import varlen_query_tile

VECTOR = 8  # 16-bit elements per 16-byte store
ROW_PAD = 8  # elements of padding per shared-memory row: rows start in different banks


class BackwardPost:
    """dQ from the accumulator ``main`` wrote (a HopperBackward, or a common.dq_order.DqOrder:
    its tile_m, dQ copy, chunk layout and register coordinates), one CTA of the writer's MMA
    threads per query tile."""

    varlen = False  # VarlenBackwardPost: packed sequences

    def __init__(self, main):
        self.main = main
        self.dtype = main.dtype
        self.head_dim = main.head_dim
        self.tile_m = main.tile_m
        self.num_threads = main.dq_threads  # those that wrote dQ: one per MMA thread
        # threads a row: the largest power of two dividing its vectors (4 at D = 96, each
        # thread then stores head_dim / (4 VECTOR) vectors of the row)
        vectors = self.head_dim // VECTOR
        self.threads_per_row = vectors & -vectors
        self.rows_per_pass = self.num_threads // self.threads_per_row
        assert self.tile_m % self.rows_per_pass == 0

    def cache_key(self) -> tuple:
        return (type(self).__name__, self.main.cache_key())

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # (batch, heads, seqlen_q_padded * D) float32
        mdQ: cute.Tensor,  # (batch, seqlen_q, heads, D) out
        softmax_scale: Float32,
        stream,
        mTurn: cute.Tensor | None = None,  # dq_first_store: the main kernel's turn counters
    ):
        self.launch(mdQaccum, mdQ, softmax_scale, None, stream, mTurn)

    @cute.jit
    def launch(self, mdQaccum, mdQ, softmax_scale, mCuSeqlensQ, stream, mTurn=None):
        """Both variants' host side; ``mCuSeqlensQ`` is None in the dense one. ``mTurn``
        (batch, heads, tiles * copies) int32, with dq_first_store only: a copy whose counter
        is 0 had no visitor and is read as zero (Note [dQ copies])."""
        if const_expr(mdQ.element_type != self.dtype or mdQaccum.element_type != Float32):
            raise TypeError(f"dq must be {self.dtype} and its accumulator float32")
        row_stride = self.head_dim + ROW_PAD
        sdQ_layout = cute.make_layout((self.tile_m, self.head_dim), stride=(row_stride, 1))

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, self.tile_m * row_stride],
                                   16]

        copy_out = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            cute.make_layout((self.rows_per_pass, self.threads_per_row),
                             stride=(self.threads_per_row, 1)),
            cute.make_layout((1, VECTOR)))
        num_m_blocks = cute.ceil_div(mdQ.shape[1], self.tile_m)
        grid = (num_m_blocks, mdQ.shape[2], mdQ.shape[0])
        if const_expr(self.varlen):  # bwd_pre's list of query tiles
            grid = ((num_m_blocks + mCuSeqlensQ.shape[0] - 1) * mdQ.shape[2], 1, 1)
        self.kernel(mdQaccum, mdQ, softmax_scale, self.main.dq_copy(), copy_out,
                    sdQ_layout, SharedStorage, mCuSeqlensQ, mTurn).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, softmax_scale: Float32,
               dq_copy: cute.TiledCopy, copy_out: cute.TiledCopy,
               sdQ_layout: cute.Layout, SharedStorage: cutlass.Constexpr,
               mCuSeqlensQ: cute.Tensor | None, mTurn: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, b = cute.arch.block_idx()
        if const_expr(not self.varlen):
            self.tile(mdQaccum, mdQ, softmax_scale, dq_copy, copy_out, sdQ_layout,
                      SharedStorage, tidx, m_block, head, b, mdQ.shape[1], None, mTurn)
        else:
            m_in_seq, at = varlen_query_tile(m_block, mCuSeqlensQ, self.tile_m, mdQ.shape[2])
            if at.valid:
                self.tile(mdQaccum, mdQ, softmax_scale, dq_copy, copy_out, sdQ_layout,
                          SharedStorage, tidx, m_in_seq, at.head, Int32(0), at.seqlen_q,
                          (at.offset_q, at.m_base), mTurn)

    @cute.jit
    def tile(self, mdQaccum, mdQ, softmax_scale, dq_copy, copy_out, sdQ_layout, SharedStorage,
             tidx, m_block, head, b, seqlen_q, seq, mTurn=None):
        """dQ of one query tile. Varlen (``seq``): of the sequence whose rows start at packed
        row seq[0] and whose accumulator slabs at seq[1] (Note [Varlen dQ accumulator])."""
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sdQ = storage.sdQ.get_tensor(sdQ_layout)  # (tile_m, D)
        m_pad = m_block
        mdQ_rows = mdQ[b, None, head, None]  # (s, D)
        if const_expr(seq is not None):
            m_pad = seq[1] + m_block
            mdQ_rows = cute.domain_offset((seq[0], 0), mdQ_rows)
        # 1. this thread's floats, in the order MMA thread tidx stored them
        slab = self.tile_m * self.head_dim
        # Note [dQ copies] (common.bwd_tiles); a writer without the knob has one accumulator
        copies = getattr(getattr(self.main, "cfg", None), "dq_copies", 1)
        first_store = getattr(getattr(self.main, "cfg", None), "dq_first_store", False)
        if const_expr(copies > 1 or first_store):  # the copies' sum, copy 0 first, always
            flat = None
            for c in cutlass.range_constexpr(copies):
                gAcc = cute.local_tile(mdQaccum[b, head, None], (slab,), (m_pad * copies + c,))
                gAcc = cute.make_tensor(gAcc.iterator, self.main.dq_chunk_layout())
                tAgA = dq_copy.get_slice(tidx).partition_D(gAcc)
                part = cute.make_rmem_tensor(tAgA.shape, Float32)
                if const_expr(first_store):
                    # nobody zeroed the slab: only a copy with a visitor (its counter passed
                    # at least once) holds dQ; the others are zero (Note [dQ copies])
                    part.fill(0.0)
                    if mTurn[b, head, m_pad * copies + c] != 0:
                        cute.autovec_copy(tAgA, part)
                else:
                    cute.autovec_copy(tAgA, part)
                if const_expr(c == 0):
                    flat = part
                else:
                    flat.store(flat.load() + part.load())
        else:
            gAcc = cute.local_tile(mdQaccum[b, head, None], (slab,), (m_pad,))
            gAcc = cute.make_tensor(gAcc.iterator, self.main.dq_chunk_layout())  # (chunk, 2)
            tAgA = dq_copy.get_slice(tidx).partition_D(gAcc)  # positions MMA thread tidx wrote
            flat = cute.make_rmem_tensor(tAgA.shape, Float32)
            cute.autovec_copy(tAgA, flat)
        # 2. the same registers seen as the dQ accumulator: register i is (row, col) coords[i]
        coords = self.main.dq_coords(tidx)
        for i in cutlass.range_constexpr(cute.size(flat)):
            rc = coords[i]
            value = (flat[i] * softmax_scale).to(self.dtype)
            if const_expr(self.main.dq_swap_ab):
                sdQ[rc[1], rc[0]] = value  # dQ^T: (col, row)
            else:
                sdQ[rc[0], rc[1]] = value
        cute.arch.barrier()
        # 3. the tile out, 16 B per thread, rows past seqlen_q skipped
        gdQ = cute.local_tile(mdQ_rows, (self.tile_m, self.head_dim), (m_block, 0))
        cdQ = cute.local_tile(cute.make_identity_tensor((seqlen_q, self.head_dim)),
                              (self.tile_m, self.head_dim), (m_block, 0))
        thr_out = copy_out.get_slice(tidx)
        tOsdQ = thr_out.partition_S(sdQ)  # (CPY, passes, vectors a thread's row holds)
        tOgdQ = thr_out.partition_D(gdQ)
        tOcdQ = thr_out.partition_D(cdQ)
        for p in cutlass.range_constexpr(cute.size(tOsdQ, mode=[1])):
            if tOcdQ[0, p, 0][0] < seqlen_q:
                for c in cutlass.range_constexpr(cute.size(tOsdQ, mode=[2])):
                    cute.autovec_copy(tOsdQ[None, p, c], tOgdQ[None, p, c])


class VarlenBackwardPost(BackwardPost):
    """bwd_post over packed sequences: dq (1, total_q, heads, D) from the padded accumulator
    (Note [Varlen dQ accumulator]), one CTA per query tile of a sequence and head (bwd_pre's
    list); each writes only its own sequence's rows."""

    varlen = True

    def cache_key(self) -> tuple:
        return super().cache_key() + ("varlen",)

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                 softmax_scale: Float32, stream, mTurn: cute.Tensor | None = None):
        self.launch(mdQaccum, mdQ, softmax_scale, mCuSeqlensQ, stream, mTurn)
