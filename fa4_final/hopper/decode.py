"""The Hopper decode forward (sm_90a): few query tokens against a long KV cache, packed GQA rows,
the keys split over CTAs, a paged cache read by TMA.

What it changes against the forward (fa4_final.hopper.fwd), for 1-16 query tokens and 1k-128k
cached keys:

1. Packed GQA rows (Note [Packed GQA rows] in fa4_final.common.decode_index). The query heads that
   share a KV head fill one tile's rows, so the keys of a (batch entry, KV head) are read once for
   all of them instead of once per query head. A 64-row tile (wgmma's smallest M) holds one
   token of up to 64 heads or 16 tokens of GQA 4; at GQA 8 and one token 8 of its 64 rows are real.
2. Split-KV (Note [Key splits]). The grid is (m-block, split) x KV head x batch entry; each CTA
   walks its split's share of the key tiles and writes float32 partial out and lse, merged by
   the combine (fa4_final.common.combine). With one split it writes out and lse themselves.
3. A paged cache (Note [Key tile pages]): the producer reads the page of each key tile from the
   page table and points the tile's TMA box into that page; pages smaller than the tile are
   gathered, a few boxes a tile (Note [Gathered key tiles]). A contiguous cache is the same walk
   with one page per sequence, so paged and contiguous do the same arithmetic in the same order
   and agree bit for bit.
4. The cached lengths (seqused_k) are read on the device and the grid depends only on shapes and
   the split count: no host synchronisation, safe to capture in a CUDA graph.
5. Varlen queries (``varlen_q``): sequences of different query counts packed along one axis
   (cu_seqlens_q), as a batch of one whose rows start at each sequence's offset; the grid is sized
   for max_seqlen_q and the m-blocks past a shorter sequence's rows visit no key and store
   nothing. Chunked prefill and decode steps in one launch, with a batched or paged cache.
6. A left window (sliding-window attention, ``has_window_left``): an m-block visits only the key
   tiles its rows' windows reach, its splits share those, and the lowest tiles, left of some
   row's window, are masked like the highest ones.

Roles: warpgroup 0 is the producer (warp 0 issues every K and V load), warpgroup 1 the consumer
(Q from global memory into shared memory once, then per key tile S = Q K^T, mask, online
softmax, O += P V, then the epilogue). Note [Decode bytes in flight] says why one consumer
warpgroup and how many stages.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from fa4_final.common.constants import LOG2_E, THREADS_PER_WARPGROUP, WARP_SIZE
from fa4_final.common.decode_index import (
    block_key_start,
    block_key_tiles,
    gathered_box_start,
    key_box_location,
    key_limit,
    key_start,
    key_tile_location,
    left_masked_tiles,
    masked_tiles,
    num_m_blocks,
    packed_rows,
    split_key_tiles,
    unpack_row,
)
from fa4_final.common.fragments import acc_as_a_operand, acc_rows_cols, select_modes
from fa4_final.common.mask import fragment_coords
from fa4_final.common.pipelines import PipelineSpec, tma_async_pipeline
from fa4_final.common.register_plan import check_role_registers
from fa4_final.common.softmax import OnlineSoftmax
from fa4_final.hopper.config import DECODE_CTAS_PER_SM_BOUND, HopperDecodeConfig
from fa4_final.hopper.wgmma import (
    attention_fragments,
    attention_tiled_mmas,
    issue_wgmma,
    smem_tile_layout,
)

# named barriers of the consumer warpgroup (id 0: syncthreads): its Q stores are done; its
# zeros are in the last V tile (Note [Keys past the cached length])
Q_READY_BARRIER = 1
V_TAIL_BARRIER = 2
Q_VECTOR = 8  # elements of one 16-byte load of Q

# Note [Decode bytes in flight]
# Decode reads the whole KV cache for little arithmetic, so what limits it is how many K/V bytes
# each SM keeps requested. By Little's law, bytes in flight = rate x latency: the H200's copy
# rate of about 4.3 TB/s over 132 SMs is 33 GB/s an SM, and at a DRAM latency of about 1 us
# under load an SM must keep some 33 KB requested at all times, more while its latency grows
# with the load. One 128-key tile of K and V is 2 x 128 x 128 x 2 B = 64 KB at D = 128 (32 KB at
# D = 64), so three stages of each put 192 KB (96 KB) in flight, several times the bound.
# The tensor cores are not the limit, even with most of a 64-row tile wasted: per 128-key tile
# at D = 128, S = Q K^T and O += P V are 2 x 2 x 64 x 128 x 128 = 4.2 MFLOP, 1024 cycles at
# 4096 FLOP/clk, and the softmax's 64 x 128 exponentials 512 cycles at 16 a clock, while the
# 64 KB take about 3500 cycles to arrive at 18.6 B/clk an SM (33 GB/s at 1.75 GHz). So one
# consumer warpgroup with a 64-row tile, its steps one after the other, keeps up with the
# memory; a second consumer warpgroup would only help when the packed rows pass 64 (16 tokens at
# GQA 8: 128 rows), where it would read each K/V tile once for 128 rows. Here such shapes take
# two m-blocks, whose CTAs are neighbours in the grid and read the same tiles, the second mostly
# from L2: the cost is L2 bandwidth and a second pass of the tile's compute, not HBM bytes.
# Shared memory: Q (16 KB) + 3 x 32 KB of K + 3 x 32 KB of V = 209 KB at D = 128, one CTA an
# SM; at D = 64 105 KB, so two CTAs fit and their steps interleave. The launch bound of two CTAs
# an SM fixes each thread's registers at launch to 128, and setmaxnreg moves the producer's
# unused ones to the consumer (24 + 232 = 2 x 128). These are the arithmetic's choices; none is
# timed yet (fa4_final.hopper.config.hopper_decode_default).


class HopperDecode:
    """Decode attention forward: one CTA per (m-block of packed rows, split, KV head, batch
    entry).

    Roles (data, ``self.roles``):
      warpgroup 0  producer: warp 0 issues every K and V load (TMA); the others only give
                   registers
      warpgroup 1  consumer: Q into shared memory, wgmma S = Q K^T, mask, online softmax,
                   wgmma O += P V, the epilogue

    Compile-time variants: ``causal`` (bottom-right), ``paged`` (k and v are (num_pages,
    page_size, heads_kv, D) and a page table maps each sequence's key tiles to pages),
    ``has_seqused_k`` (per-sequence cached lengths, read on the device), ``split`` (float32
    partial out and lse per split, for the combine; otherwise out and lse themselves),
    ``varlen_q`` (packed query sequences: q, out and lse as a batch of one, cu_seqlens_q),
    ``has_window_left`` (sliding-window attention: token t sees no key before
    t + seqlen_k - seqlen_q - window_left).
    """

    def __init__(self, dtype, head_dim: int, causal: bool, config: HopperDecodeConfig,
                 paged: bool = False, has_seqused_k: bool = False, split: bool = False,
                 varlen_q: bool = False, has_window_left: bool = False):
        config.check(head_dim)
        if config.page_box is not None and not paged:
            raise ValueError(f"page_box={config.page_box} gathers key tiles from pages: it needs "
                             f"paged=True")
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = bool(causal)
        self.cfg = config
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.paged = bool(paged)
        self.has_seqused_k = bool(has_seqused_k)
        self.split = bool(split)
        self.varlen_q = bool(varlen_q)
        self.has_window_left = bool(has_window_left)
        self.producer_regs, self.consumer_regs = config.registers
        self.num_threads = 2 * THREADS_PER_WARPGROUP
        self.roles = {
            "producer": {"warpgroups": (0,), "tma_warp": 0, "registers": self.producer_regs},
            "consumer": {"warpgroups": (1,), "registers": self.consumer_regs},
        }
        check_role_registers(self.roles, self.num_threads)  # per SM sub-partition

    def pipelines(self) -> tuple[PipelineSpec, ...]:
        """The producer -> consumer rings: FULL completes with the TMA warp's one arrive carrying
        the byte count, EMPTY with one arrive per consumer warp."""
        warps = THREADS_PER_WARPGROUP // WARP_SIZE
        return (
            PipelineSpec("k", "K tiles of the CTA's split, from the highest down", "tma_async",
                         self.cfg.stages, "producer", "consumer", 1, warps),
            PipelineSpec("v", "V tiles, in K's order", "tma_async", self.cfg.stages,
                         "producer", "consumer", 1, warps),
        )

    def cache_key(self) -> tuple:
        return (type(self).__name__, self.dtype.__name__, self.head_dim, self.causal,
                self.paged, self.has_seqused_k, self.split, self.varlen_q,
                self.has_window_left, self.cfg)

    # ------------------------------------------------------------------------------------------
    # host side: layouts, TMA descriptors, shared storage, grid, launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, D); varlen_q: (1, total_q, heads, D)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, D); paged: (num_pages, page_size, ...)
        mV: cute.Tensor,  # like mK
        mO: cute.Tensor,  # like mQ; split: (splits, ...) float32
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) float32 (varlen_q: batch 1, total_q);
        # split: (splits, ...)
        mPageTable: cute.Tensor | None,  # paged: (batch, max_pages) int32; else None
        mSeqUsedK: cute.Tensor | None,  # (batch,) int32 cached lengths, or None
        mCuSeqlensQ: cute.Tensor | None,  # varlen_q: (batch + 1,) int32 offsets; else None
        max_seqlen_q: Int32,  # varlen_q: the longest sequence's query count (sizes the grid)
        window_left: Int32,  # has_window_left: keys a token sees left of its diagonal
        softmax_scale: Float32,
        stream,
    ):
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type
                           == self.dtype)):
            raise TypeError(f"q, k, v must all be {self.dtype}")
        out_type = Float32 if self.split else self.dtype
        if const_expr(mO.element_type != out_type or mLSE.element_type != Float32):
            raise TypeError(f"out must be {out_type} and lse float32 (split={self.split})")
        if const_expr(self.paged != (mPageTable is not None)
                      or self.has_seqused_k != (mSeqUsedK is not None)):
            raise TypeError("page_table (and seqused_k) are given exactly to the variant built "
                            "with paged=True (has_seqused_k=True)")
        if const_expr(self.varlen_q != (mCuSeqlensQ is not None)):
            raise TypeError("cu_seqlens_q is given exactly to the variant built with "
                            "varlen_q=True")
        # (b or page, rows, h_kv, D) -> (rows, D, h_kv, b or page): the TMA box tiles modes 0, 1
        mK, mV = [select_modes(t, [1, 3, 2, 0]) for t in (mK, mV)]

        tiled_mma_qk, tiled_mma_pv = attention_tiled_mmas(self.dtype, 1, self.tile_n,
                                                          self.head_dim)
        sQ_layout = smem_tile_layout(self.dtype, self.head_dim, self.tile_m)
        sK_layout = smem_tile_layout(self.dtype, self.head_dim, self.tile_n, self.cfg.stages)
        sV_layout = smem_tile_layout(self.dtype, self.head_dim, self.tile_n, self.cfg.stages)
        sKV_one = cute.select(sK_layout, mode=[0, 1])  # one stage: the TMA box
        bytes_kv = cute.size_in_bytes(self.dtype, sKV_one)  # a stage's FULL barrier expects
        box_rows = self.tile_n
        if const_expr(self.cfg.page_box is not None):
            # gathered: the TMA box is page_box rows of the stage, its own swizzled layout
            # (Note [Gathered key tiles])
            box_rows = self.cfg.page_box
            sKV_one = cute.composition(
                sKV_one, cute.make_layout((box_rows, self.head_dim), stride=(1, self.tile_n)))

        @cute.struct
        class SharedStorage:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.cfg.stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.cfg.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        assert SharedStorage.size_in_bytes() == self.cfg.smem_bytes(self.head_dim,
                                                                    self.dtype.width // 8)

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load, mK, sKV_one,
                                                        (box_rows, self.head_dim))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(load, mV, sKV_one,
                                                        (box_rows, self.head_dim))
        group = mQ.shape[2] // mK.shape[2]
        num_splits = mO.shape[0] if const_expr(self.split) else 1
        batch, seqlen_q_bound = mQ.shape[0], mQ.shape[1]
        if const_expr(self.varlen_q):
            batch, seqlen_q_bound = mCuSeqlensQ.shape[0] - 1, max_seqlen_q
        grid = (num_m_blocks(seqlen_q_bound, group, self.tile_m) * num_splits, mK.shape[2],
                batch)
        self.kernel(
            mQ, tma_k, tma_v, mO, mLSE, tma_atom_k, tma_atom_v, mPageTable, mSeqUsedK,
            mCuSeqlensQ, max_seqlen_q, window_left, softmax_scale * LOG2_E, sQ_layout, sK_layout,
            sV_layout,
            tiled_mma_qk, tiled_mma_pv, bytes_kv, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=DECODE_CTAS_PER_SM_BOUND, preferred_smem_carveout=100)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # (b, s_q, h, D)
        mK: cute.Tensor,  # TMA coordinate tensors: (rows, D, h_kv, b or page)
        mV: cute.Tensor,
        mO: cute.Tensor,  # (b, s_q, h, D); split: (splits, b, s_q, h, D)
        mLSE: cute.Tensor,  # (b, h, s_q); split: (splits, b, h, s_q)
        tma_atom_k: cute.CopyAtom,
        tma_atom_v: cute.CopyAtom,
        mPageTable: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mCuSeqlensQ: cute.Tensor | None,
        max_seqlen_q: Int32,
        window_left: Int32,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        bytes_kv: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_k, tma_atom_v):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        mbar = {"k": storage.mbar_k, "v": storage.mbar_v}
        pipes = {spec.name: tma_async_pipeline(spec, mbar[spec.name], bytes_kv)
                 for spec in self.pipelines()}
        pipeline_k, pipeline_v = pipes["k"], pipes["v"]
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (tile_m, D)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (n, D, STAGE)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (n, D, STAGE)
        # mbarrier inits (warp 0) must be visible to every thread before anyone waits on them
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        # which work: Note [Packed GQA rows], Note [Key splits]
        bx, kv_head, b = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        group = mQ.shape[2] // mK.shape[2]
        # q, out and lse rows of sequence b: batch entry qb, rows from q_offset (varlen_q: the
        # packed batch of one); the grid's m-blocks are counted for the longest sequence
        qb, q_offset, seqlen_q, seqlen_q_bound = b, Int32(0), mQ.shape[1], mQ.shape[1]
        if const_expr(self.varlen_q):
            qb, q_offset = Int32(0), mCuSeqlensQ[b]
            seqlen_q, seqlen_q_bound = mCuSeqlensQ[b + 1] - q_offset, max_seqlen_q
        m_blocks = num_m_blocks(seqlen_q_bound, group, self.tile_m)
        m_block = bx % m_blocks
        split = bx // m_blocks
        num_splits = grid_x // m_blocks
        seqlen_k = self.cached_length(mK, mPageTable, mSeqUsedK, b)
        n_end, n_full = block_key_tiles(m_block, self.tile_m, self.tile_n, group, seqlen_q,
                                        seqlen_k, self.causal)
        window = window_left if const_expr(self.has_window_left) else None
        n_start, n_left_free = block_key_start(m_block, self.tile_m, self.tile_n, group,
                                               seqlen_q, seqlen_k, window)
        n_lo, n_hi = split_key_tiles(split, num_splits, seqlen_k, self.tile_n, n_end, n_start)

        if warp_idx < THREADS_PER_WARPGROUP // WARP_SIZE:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == self.roles["producer"]["tma_warp"]:
                self.load(mK, mV, sK, sV, tma_atom_k, tma_atom_v, pipeline_k, pipeline_v,
                          mPageTable, b, kv_head, n_lo, n_hi, seqlen_k)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(mQ, mO, mLSE, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv, pipeline_k,
                         pipeline_v, scale_log2, (qb, q_offset), kv_head, m_block, split, group,
                         seqlen_q, seqlen_k, n_lo, n_hi, n_full, n_left_free, window)

    @cute.jit
    def cached_length(self, mK, mPageTable, mSeqUsedK, b):
        """Keys of sequence ``b``: seqused_k[b] when given; else the cache's length (paged: the
        table's pages times the page size)."""
        if const_expr(mSeqUsedK is not None):
            return mSeqUsedK[b]
        if const_expr(self.paged):
            return mK.shape[0] * mPageTable.shape[1]
        return mK.shape[0]

    @cute.jit
    def load(self, mK, mV, sK, sV, tma_atom_k, tma_atom_v, pipeline_k, pipeline_v, mPageTable,
             b, kv_head, n_lo, n_hi, seqlen_k):
        """Producer warp: K[n] then V[n] for the split's key tiles, n from n_hi - 1 down to n_lo,
        each from its page (Note [Key tile pages]). The consumer releases K[n] before it waits
        for V[n], so K[n + stages] never waits on a V."""
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.cfg.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.cfg.stages)
        for i in cutlass.range(n_hi - n_lo, unroll=1):
            n = n_hi - 1 - i
            boxes = self.tile_boxes(mPageTable, b, n, seqlen_k, mK.shape[0])
            state_k = self.load_tile(tma_atom_k, mK, sK, kv_head, boxes, pipeline_k, state_k)
            state_v = self.load_tile(tma_atom_v, mV, sV, kv_head, boxes, pipeline_v, state_v)

    @cute.jit
    def tile_boxes(self, mPageTable, b, n, seqlen_k, page_size):
        """(page, box inside the page) of each TMA box of key tile ``n``, read once for K and V:
        one box of the whole tile (contiguous: page b, box n; paged: Note [Key tile pages]),
        or the tile gathered from page_box rows a box (Note [Gathered key tiles])."""
        if const_expr(not self.paged):
            return [(b, n)]  # contiguous: one page per sequence
        if const_expr(self.cfg.page_box is None):
            slot, tile = key_tile_location(n, self.tile_n, page_size)
            return [(mPageTable[b, slot], tile)]
        box = self.cfg.page_box
        boxes = []
        for j in cutlass.range_constexpr(self.tile_n // box):
            key = gathered_box_start(n, j, self.tile_n, box, seqlen_k)
            slot, inside = key_box_location(key, page_size, box)
            boxes.append((mPageTable[b, slot], inside))
        return boxes

    @cute.jit
    def load_tile(self, tma_atom, mX, sX, kv_head, boxes, pipe, state):
        """Wait for a free stage, arm its FULL barrier with the whole tile's bytes, start one
        TMA copy a box (``tile_boxes``) into the stage's rows j * box."""
        box = self.tile_n // len(boxes)
        pipe.producer_acquire(state)
        for j in cutlass.range_constexpr(len(boxes)):
            page, inside = boxes[j]
            # (box, D, boxes in the page) of this page and KV head; the stage's rows of box j
            gX = cute.local_tile(mX[None, None, kv_head, page], (box, self.head_dim), (None, 0))
            sX_box = cute.local_tile(sX[None, None, state.index], (box, self.head_dim), (j, 0))
            tXsX, tXgX = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1),
                                               cute.group_modes(sX_box, 0, 2),
                                               cute.group_modes(gX, 0, 2))
            cute.copy(tma_atom, tXgX[None, inside], tXsX,
                      tma_bar_ptr=pipe.producer_get_barrier(state))
        state.advance()
        return state

    @cute.jit
    def load_q(self, mQ, sQ, tidx, rows_at, kv_head, m_block, group, seqlen_q):
        """Q's packed rows into shared memory by the consumer warpgroup, 16 bytes a thread at a
        time (a TMA box cannot gather the heads of a group from several tokens). Padding rows
        past the packed count repeat its last row: finite scores that are never stored. Only a
        CTA with key tiles calls it, so its m-block holds at least one row."""
        chunks = self.head_dim // Q_VECTOR
        last = packed_rows(seqlen_q, group) - 1
        for it in cutlass.range_constexpr(self.tile_m * chunks // THREADS_PER_WARPGROUP):
            idx = tidx + it * THREADS_PER_WARPGROUP
            r, chunk = idx // chunks, idx % chunks
            token, head = unpack_row(cutlass.min(m_block * self.tile_m + r, last), group,
                                     kv_head)
            qb, q_offset = rows_at
            gq = cute.local_tile(mQ[qb, q_offset + token, head, None], (Q_VECTOR,),
                                 (chunk,))  # (8,)
            sq = cute.local_tile(sQ[r, None], (Q_VECTOR,), (chunk,))  # (8,)
            sq.store(gq.load())
        # generic-proxy shared stores -> visible to wgmma (async proxy), from every thread
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=Q_READY_BARRIER, number_of_threads=THREADS_PER_WARPGROUP)

    @cute.jit
    def consume(self, mQ, mO, mLSE, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv, pipeline_k,
                pipeline_v, scale_log2: Float32, rows_at, kv_head, m_block, split, group,
                seqlen_q, seqlen_k, n_lo, n_hi, n_full, n_left_free, window):
        """The consumer warpgroup: Q, the split's key tiles, the epilogue. ``rows_at``: (batch
        entry, first row) of the sequence's rows in q, out and lse."""
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - THREADS_PER_WARPGROUP  # 0 .. 127
        # A and B descriptors per warpgroup, C fragments per thread
        (thr_mma_qk, thr_mma_pv, tSrQ, tSrK, tOrVt, acc_s, acc_o, tOrP) = attention_fragments(
            tiled_mma_qk, tiled_mma_pv, 0, tidx, sQ, sK, sV, self.tile_m,
            self.tile_n, self.head_dim, self.cfg.stages, self.dtype)
        tScS, t0ScS = fragment_coords(thr_mma_qk, (self.tile_m, self.tile_n))
        rows = cute.size(acc_rows_cols(acc_o), mode=[0])
        softmax = OnlineSoftmax(scale_log2, rows)
        # each row's key limit (and window start), less this thread's first column
        # (Note [Mask with constants])
        limit = cute.make_rmem_tensor(rows, Int32)
        start = cute.make_rmem_tensor(rows, Int32)
        for r in cutlass.range_constexpr(rows):
            row = m_block * self.tile_m + tScS[r, 0][0]
            limit[r] = key_limit(row, group, seqlen_q, seqlen_k, self.causal) - tScS[0, 0][1]
            if const_expr(self.has_window_left):
                start[r] = key_start(row, group, seqlen_q, seqlen_k, window) - tScS[0, 0][1]
        mask = lambda s, n: self.mask(s, t0ScS, limit, start, n)  # noqa: E731
        zero_tail = lambda stage, n: self.zero_v_tail(  # noqa: E731
            sV, stage, seqlen_k - n * self.tile_n, tidx)
        acc_o.fill(0.0)

        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.cfg.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.cfg.stages)
        n_tiles = n_hi - n_lo
        if n_tiles > 0:  # (uniform over the CTA) a CTA with no key tile needs no Q either
            self.load_q(mQ, sQ, tidx, rows_at, kv_head, m_block, group, seqlen_q)
            step = lambda i, first, masked, sk, sv: self.step(  # noqa: E731
                n_hi - 1 - i, first, masked, mask, zero_tail, softmax, acc_s, acc_o, tOrP, tSrQ,
                tSrK,
                tOrVt, tiled_mma_qk, tiled_mma_pv, pipeline_k, pipeline_v, sk, sv)
            # the first tile visited is always masked (it may hold seqlen_k's end or the causal
            # diagonal); then the rest of the masked ones, then the free ones, then (a left
            # window) those left of some row's window: the range is split, not the body (each
            # loop runs one step function; with a window every masked step masks both sides,
            # as a narrow window's tiles can need both)
            state_k, state_v = step(0, True, True, state_k, state_v)
            top_end = cutlass.max(masked_tiles(n_lo, n_hi, n_full), 1)
            bottom_start = n_tiles
            if const_expr(self.has_window_left):
                bottom_start = cutlass.max(
                    n_tiles - left_masked_tiles(n_lo, n_hi, n_left_free), top_end)
            for i in cutlass.range(1, top_end, unroll=1):
                state_k, state_v = step(i, False, True, state_k, state_v)
            for i in cutlass.range(top_end, bottom_start, unroll=1):
                state_k, state_v = step(i, False, False, state_k, state_v)
            if const_expr(self.has_window_left):
                for i in cutlass.range(bottom_start, n_tiles, unroll=1):
                    state_k, state_v = step(i, False, True, state_k, state_v)
        self.epilogue(acc_o, softmax, mO, mLSE, thr_mma_pv, rows_at, kv_head, m_block, split,
                      group, seqlen_q)

    @cute.jit
    def mask(self, acc_s, t0ScS, limit, start, n):
        """Scores of keys at or past a row's key limit (or, with a left window, before its
        start) -> -inf in key tile ``n``: compares with a compile-time column and one select
        per element."""
        s = acc_rows_cols(acc_s)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            hi = limit[r] - n * self.tile_n
            lo = start[r] - n * self.tile_n
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                col = t0ScS[0, c][1]
                if const_expr(self.has_window_left):
                    s[r, c] = -Float32.inf if (col >= hi) | (col < lo) else s[r, c]
                else:
                    s[r, c] = -Float32.inf if col >= hi else s[r, c]

    # Note [Keys past the cached length]
    # The tile that holds the last cached key (seqlen_k - 1) also holds rows past it: a cache's
    # rows past seqused_k, or a page's rows past the sequence's end, which a serving engine may
    # never have written (torch.empty: any bits, NaN among them). The mask gives those keys
    # p = 0 exactly (a select, whatever the score), but 0 * NaN in P V is NaN. So before that
    # tile's P V the consumer warpgroup writes zeros over its V rows past seqlen_k, 16 bytes a
    # thread at a time, then fences them for wgmma (async proxy) and syncs its four warps; the
    # TMA that later refills the stage is ordered after the same fence. K needs nothing: the
    # mask replaces a NaN score. The tile is the first one its split visits, so only that step
    # carries the code, and at run time only when seqlen_k is not a multiple of tile_n.

    @cute.jit
    def zero_v_tail(self, sV, stage, valid, tidx):
        """Zeros over rows valid .. tile_n - 1 of V stage ``stage`` when valid < tile_n
        (Note [Keys past the cached length])."""
        if valid < self.tile_n:  # uniform over the warpgroup
            chunks = self.head_dim // Q_VECTOR
            zeros = cute.make_rmem_tensor((Q_VECTOR,), self.dtype)
            zeros.fill(0.0)
            for it in cutlass.range_constexpr(self.tile_n * chunks // THREADS_PER_WARPGROUP):
                idx = tidx + it * THREADS_PER_WARPGROUP
                r, chunk = idx // chunks, idx % chunks
                if r >= valid:
                    sv = cute.local_tile(sV[r, None, stage], (Q_VECTOR,), (chunk,))  # (8,)
                    sv.store(zeros.load())
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=V_TAIL_BARRIER, number_of_threads=THREADS_PER_WARPGROUP)

    @cute.jit
    def step(self, n, first: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool], mask,
             zero_tail,
             softmax, acc_s, acc_o, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv,
             pipeline_k, pipeline_v, state_k, state_v):
        """Key tile ``n``: S = Q K^T, (mask), the online softmax, O = alpha O + P V. ``first``:
        the split's first tile (the softmax starts from it, and P V overwrites O)."""
        pipeline_k.consumer_wait(state_k)
        s = cute.make_rmem_tensor_like(acc_s)  # a fresh S each step: its registers die with P
        issue_wgmma(tiled_mma_qk, s, tSrQ, tSrK[None, None, None, state_k.index], False)
        warpgroup.wait_group(0)
        pipeline_k.consumer_release(state_k)
        state_k.advance()
        if const_expr(masked):
            mask(s, n)
        row_scale, rescale = softmax.update(s, is_first=first)
        tOrP.store(acc_as_a_operand(s).load().to(self.dtype))
        if const_expr(not first):
            softmax.rescale_o(acc_o, row_scale, rescale)
        pipeline_v.consumer_wait(state_v)
        if const_expr(first):  # the only tile that can hold seqlen_k's end
            zero_tail(state_v.index, n)
        issue_wgmma(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, state_v.index],
                    not first)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(state_v)
        state_v.advance()
        return state_k, state_v

    @cute.jit
    def epilogue(self, acc_o, softmax, mO, mLSE, thr_mma_pv, rows_at, kv_head, m_block, split,
                 group, seqlen_q):
        """out = O / l and lse straight from registers to global memory, each packed row to its
        (token, head); float32 partials with ``split``. Decode's output is a few rows per CTA:
        no shared-memory staging, no TMA store. A split (or row) that saw no key writes out = 0
        and lse = -inf (OnlineSoftmax.finalize)."""
        inv_sum, lse = softmax.finalize()
        o = acc_rows_cols(acc_o)
        for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
            for c in cutlass.range(cute.size(o, mode=[1]), unroll_full=True):
                o[r, c] = o[r, c] * inv_sum[r]
        rO = acc_o
        if const_expr(not self.split):
            rO = cute.make_rmem_tensor_like(acc_o, self.dtype)
            rO.store(acc_o.load().to(self.dtype))
        out = acc_rows_cols(rO)
        tOcO = acc_rows_cols(thr_mma_pv.partition_C(
            cute.make_identity_tensor((self.tile_m, self.head_dim))))
        packed = packed_rows(seqlen_q, group)
        for r in cutlass.range_constexpr(cute.size(out, mode=[0])):
            row = m_block * self.tile_m + tOcO[r, 0][0]
            if row < packed:
                token, head = unpack_row(row, group, kv_head)
                qb, q_offset = rows_at
                token = q_offset + token
                gO = self.out_row(mO, split, qb, token, head)  # (D,)
                for c in cutlass.range_constexpr(cute.size(out, mode=[1])):
                    gO[tOcO[r, c][1]] = out[r, c]
                if tOcO[0, 0][1] == 0:  # the thread holding column 0 writes the row's lse
                    if const_expr(self.split):
                        mLSE[split, qb, head, token] = lse[r]
                    else:
                        mLSE[qb, head, token] = lse[r]

    def out_row(self, mO, split, b, token, head):
        """(D,) row of out, or of the split's partial out."""
        if const_expr(self.split):
            return mO[split, b, token, head, None]
        return mO[b, token, head, None]
