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
7. A candidate for few packed rows (HopperDecodeConfig.swap_ab, Note [Keys on M]): the GEMMs
   transposed, keys on the wgmma M and 8, 16 or 32 packed rows on N, the softmax statistics per
   accumulator column. Not the default; reached by no call of the package until a measurement
   chooses between the two.
8. Above 64 packed rows, two consumer warpgroups (HopperDecodeConfig.consumers = 2,
   Note [Two consumer warpgroups]): two consumer warpgroups of 64 rows each read every K/V
   stage, so a 128-row m-block streams its keys once. The default there
   (hopper.config.hopper_decode_for_rows), chosen by measurement.
9. A candidate for 256 packed rows (HopperDecodeConfig.cluster = 2,
   Note [A pair of CTAs shares the cache]): two CTAs of a cluster walk the same key tiles, each
   loading half of every K/V tile and multicasting it into both. Reached by no call of the
   package until a measurement chooses it.

Roles: warpgroup 0 is the producer (warp 0 issues every K and V load), warpgroup 1 the consumer
(Q from global memory into shared memory once, then per key tile S = Q K^T, mask, online
softmax, O += P V, then the epilogue); with consumers = 2 warpgroups 1 and 2 are consumers of
64 rows each. Note [Decode bytes in flight] says why one consumer warpgroup up to 64 packed rows
and how many stages.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from fa4_final.common.constants import LOG2_E, THREADS_PER_WARPGROUP, WARP_SIZE, WGMMA_M
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
from fa4_final.common.fragments import (
    acc_as_a_operand,
    acc_rows_cols,
    select_modes,
    tree_reduce,
)
from fa4_final.common.mask import fragment_coords
from fa4_final.common.pipelines import PipelineSpec, tma_async_pipeline
from fa4_final.common.register_plan import check_role_registers
from fa4_final.common.softmax import OnlineSoftmax, inverse_sum_and_lse
from fa4_final.hopper.config import (
    DECODE_EXCHANGE_WARPS,
    HopperDecodeConfig,
)
from fa4_final.hopper.wgmma import (
    attention_fragments,
    attention_tiled_mmas,
    issue_wgmma,
    smem_tile_layout,
    transposed,
)

# named barriers of the consumer warpgroup (id 0: syncthreads): its Q stores are done; its
# zeros are in the last V tile (Note [Keys past the cached length])
Q_READY_BARRIER = 1
V_TAIL_BARRIER = 2
# swap_ab (Note [Keys on M]): the warps' column values are in shared memory; P^T is
COLUMNS_BARRIER = 3
P_READY_BARRIER = 4
# consumers = 2 (Note [Two consumer warpgroups]): the second consumer warpgroup's Q_READY is
# Q_READY_BARRIER + this; V_TAIL_BARRIER is one barrier of both consumer warpgroups
SECOND_CONSUMER_BARRIER_OFFSET = 4
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
# (The H100 run measured that cost at 16 tokens and GQA 8: 86-91% of the copy rate; the
# candidate with the second consumer warpgroup is Note [Two consumer warpgroups].)
# Shared memory: Q (16 KB) + 3 x 32 KB of K + 3 x 32 KB of V = 209 KB at D = 128, one CTA an
# SM; at D = 64 105 KB, so two CTAs fit and their steps interleave. The launch bound of two CTAs
# an SM fixes each thread's registers at launch to 128, and setmaxnreg moves the producer's
# unused ones to the consumer (24 + 232 = 2 x 128). These are the arithmetic's choices, timed
# on an H100 since (fa4_final.hopper.config.hopper_decode_default).

# Note [Two consumer warpgroups]
# At 16 query tokens and GQA 8 a KV head has 128 packed rows: two 64-row m-blocks, two CTAs each
# streaming the (batch, KV head)'s whole K/V (the H100 run: 0.88-0.91x the fastest peer there,
# against 0.96-0.98x at 1 and 4 tokens). HopperDecodeConfig.consumers = 2 makes the m-block 128
# rows held by one CTA of three warpgroups (384 threads): warpgroup 0 the producer as before,
# warpgroups 1 and 2 consumers, warpgroup 1 + p owning the 64-row sub-block
# 2 m_block + p (its Q rows in stage p of sQ, a (64, D, 2) tile; its S, P, O, row statistics,
# masks and epilogue: the one-consumer code, called with that sub-block and its 64 rows). Both
# wait on the same FULL barriers and read the same K and V stages; a stage's EMPTY barrier
# completes at eight arrivals, one a consumer warp, so the producer refills it after both. The
# key range (causal end, window start, splits, masked tiles) is the 128-row block's, each row
# masked by its own limits as before.
# Named barriers (whole warps, one instruction an id, for synccheck): Q_READY is one bar.sync
# with the id 1 + 4 p in a register, 128 threads, each id reached by one warpgroup; the V tail
# zeros (Note [Keys past the cached length]) are shared by the 256 consumer threads and one
# bar.sync 2, 256, since both warpgroups read that stage (each writing all of them alone would
# race with the other's wgmma on the same bytes). 0 stays the CTA's init sync.
# Registers: two CTAs of 384 threads would leave 85 registers a thread, so the launch bound is
# one CTA an SM, 168 registers at launch (65536 / 384, in 8s); setmaxnreg 24 for the producer,
# 240 for each consumer: per sub-partition one producer warp and two consumer warps, 24 + 2 x 240
# = 504 = 3 x 168 (fa4_final.common.register_plan). Shared memory: Q 128 x D, so 225 KB at
# D = 128 with three 128-key stages (one CTA an SM, as the default) and 113 KB at D = 64 (one CTA
# an SM by the register bound, where the default fits two: at D = 64 the default keeps two CTAs
# of 96 KB of K/V requested an SM, this one 96 KB, so there it may lose; a hypothesis for the
# decode benchmark to test).
# Compiled for sm_90a (D = 64 and 128; contiguous, paged + seqused_k + split, varlen, window):
# no spill, no stack, 168 registers, no ptxas-injected warpgroup.arrive. Its GPU tests passed
# against float64 on an H200 and an H100; under compute-sanitizer (H100) memcheck and synccheck
# found no error and racecheck no hazard in it (the one it reported was in the cuBLAS kernel of
# the test's reference). Timed on an H100 at 16 tokens (GQA 8 and 16: 128 and 256 packed rows),
# 8k, 32k and 128k keys, batch 1 and 32, D = 64 and 128, beside the one-consumer kernel and the
# peers: at batch 32 it was 0.99-1.14x the fastest peer at D = 64 and 0.73-0.98x at D = 128,
# where the one-consumer kernel was 0.93-1.18x and 0.59-0.95x; at batch 1 both were 1.8-5.4x
# (there the peers run few CTAs). It lost to the one-consumer kernel at a few batch-1 shapes,
# by up to 14%, still 1.8x the peers or more. So it is the default above 64 packed rows
# (hopper_decode_for_rows). The shape it leaves furthest behind is 256 packed rows at D = 128
# and batch 32 (0.73-0.85x, 61-67% of the copy rate): two 128-row m-blocks whose CTAs both
# stream the cache, the second mostly from L2, as Note [Decode bytes in flight] describes.

# Note [A pair of CTAs shares the cache]
# At 256 packed rows a KV head (16 tokens at GQA 16) the two-consumer kernel has two 128-row
# m-blocks, two CTAs that each stream the (batch, KV head)'s whole cache, the second mostly from
# L2 if the two run at once. HopperDecodeConfig.cluster = 2 launches the m-blocks in clusters of
# two along grid x (CTA rank r = m_block % 2) and lets them share the bytes: each CTA's producer
# loads half of every K and V tile (rows r * tile_n / 2 onwards, a box of tile_n / 2 keys) with a
# multicast TMA whose mask names both CTAs, so every tile leaves HBM (or L2) once for the pair
# and lands in both CTAs' shared memory.
# What that asks of the protocol:
# - Both CTAs walk the same tiles in the same order: the key range (causal end, window start,
#   splits, masked tiles) is that of the pair's block of block_m = 2 tile_m rows, the m-block
#   index m_block // 2; each row is still masked by its own limits. The grid has an even number
#   of m-blocks (a block past the packed rows loads clamped rows and stores none).
# - A stage's FULL barrier in each CTA expects the whole tile's bytes: its own half and the
#   peer's. The peer's half may land before this CTA's producer arms the barrier; the phase
#   cannot complete then, as the producer's one arrive is still missing.
# - A stage may be refilled only when both CTAs have read it, since either producer writes into
#   both: each consumer warp arrives on the stage's EMPTY barrier in both CTAs (lanes 0 and 1,
#   one each, the cutlass pipeline's cluster signalling), so EMPTY completes at twice the
#   consumer warps' arrivals.
# - Both CTAs' mbarriers are initialised and visible before any remote arrive or multicast
#   write: a cluster arrive (relaxed) and wait after the inits replace the CTA's sync.
# - No CTA exits while the peer may still arrive on its barriers: each producer waits, after its
#   last load, for every stage's EMPTY barrier (producer_tail), which completes only after both
#   CTAs' consumers released it. The bytes the peer multicasts into a CTA all belong to tiles
#   that CTA waits for, so none is in flight when its consumers finish.
# - The V tail's zeros (Note [Keys past the cached length]) are each CTA's own: both hold a copy
#   of the tile, and each zeros its copy before its own P V.
# Registers, shared memory and the step bodies are those of the config without the cluster.
# Compiled for sm_90a, its PTX checked for the multicast loads, the remote arrives and the
# cluster barrier; both CTAs' rings simulated on a CPU under random timings (no deadlock, no
# stage refilled while read, no arrive after a CTA exits; a release in one CTA only, a FULL
# counting one half and a missing tail each caught). It has not run on a GPU.


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
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = bool(causal)
        self.cfg = config
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        # packed rows a consumer warpgroup owns (Note [Two consumer warpgroups])
        self.consumers = config.consumers
        self.wg_rows = config.tile_m // config.consumers
        # CTAs of a cluster sharing each K/V tile (Note [A pair of CTAs shares the cache])
        self.cluster = config.cluster
        self.paged = bool(paged)
        self.has_seqused_k = bool(has_seqused_k)
        self.split = bool(split)
        self.varlen_q = bool(varlen_q)
        self.has_window_left = bool(has_window_left)
        self.producer_regs, self.consumer_regs = config.registers
        self.num_threads = (1 + self.consumers) * THREADS_PER_WARPGROUP
        self.roles = {
            "producer": {"warpgroups": (0,), "tma_warp": 0, "registers": self.producer_regs},
            "consumer": {"warpgroups": tuple(range(1, 1 + self.consumers)),
                         "registers": self.consumer_regs},
        }
        check_role_registers(self.roles, self.num_threads)  # per SM sub-partition

    def pipelines(self) -> tuple[PipelineSpec, ...]:
        """The producer -> consumer rings: FULL completes with the TMA warp's one arrive carrying
        the byte count, EMPTY with one arrive per consumer warp (of every consumer warpgroup)
        of every CTA of the cluster (Note [A pair of CTAs shares the cache])."""
        warps = self.consumers * THREADS_PER_WARPGROUP // WARP_SIZE * self.cluster
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
        if const_expr(self.consumers > 1):  # (64, D, consumers): a warpgroup's rows a stage
            sQ_layout = smem_tile_layout(self.dtype, self.head_dim, self.wg_rows, self.consumers)
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

        if const_expr(self.cfg.swap_ab):  # Note [Keys on M]
            tiled_mma_qk, tiled_mma_pv = self.keys_on_m_mmas()
            SharedStorage = self.keys_on_m_storage(sQ_layout, sK_layout, sV_layout)
        assert SharedStorage.size_in_bytes() == self.cfg.smem_bytes(self.head_dim,
                                                                    self.dtype.width // 8)

        load = cpasync.CopyBulkTensorTileG2SOp()
        multicast = {}
        if const_expr(self.cluster > 1):  # Note [A pair of CTAs shares the cache]
            load = cpasync.CopyBulkTensorTileG2SMulticastOp()
            multicast = {"num_multicast": self.cluster}
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load, mK, sKV_one,
                                                        (box_rows, self.head_dim), **multicast)
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(load, mV, sKV_one,
                                                        (box_rows, self.head_dim), **multicast)
        group = mQ.shape[2] // mK.shape[2]
        num_splits = mO.shape[0] if const_expr(self.split) else 1
        batch, seqlen_q_bound = mQ.shape[0], mQ.shape[1]
        if const_expr(self.varlen_q):
            batch, seqlen_q_bound = mCuSeqlensQ.shape[0] - 1, max_seqlen_q
        grid = (num_m_blocks(seqlen_q_bound, group, self.cfg.block_m) * self.cluster
                * num_splits, mK.shape[2], batch)
        self.kernel(
            mQ, tma_k, tma_v, mO, mLSE, tma_atom_k, tma_atom_v, mPageTable, mSeqUsedK,
            mCuSeqlensQ, max_seqlen_q, window_left, softmax_scale * LOG2_E, sQ_layout, sK_layout,
            sV_layout,
            tiled_mma_qk, tiled_mma_pv, bytes_kv, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=self.cfg.ctas_per_sm_bound, preferred_smem_carveout=100,
                 **({"cluster": (self.cluster, 1, 1)} if self.cluster > 1 else {}))

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
        pipes = {spec.name: tma_async_pipeline(spec, mbar[spec.name], bytes_kv,
                                               cluster=self.cluster)
                 for spec in self.pipelines()}
        pipeline_k, pipeline_v = pipes["k"], pipes["v"]
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (tile_m, D)
        # consumers = 2: (64, D, consumer warpgroup)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (n, D, STAGE)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (n, D, STAGE)
        # mbarrier inits (warp 0) must be visible to every thread before anyone waits on them;
        # with a cluster, to the peer CTA's too before it arrives or multicasts here
        if const_expr(self.cluster > 1):
            pair = cute.make_layout((self.cluster, 1))
            pipeline.pipeline_init_arrive(cluster_shape_mn=pair, is_relaxed=True)
            pipeline.pipeline_init_wait(cluster_shape_mn=pair)
        else:
            pipeline.pipeline_init_arrive()
            pipeline.pipeline_init_wait()
        # Note [The combine launches early]: a combine launched early may be scheduled now (it
        # waits for this grid); after an ordinary launch nothing follows from it
        if const_expr(self.split):
            cute.arch.griddepcontrol_launch_dependents()

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
        # a cluster's CTAs are consecutive m-blocks of one split
        # (Note [A pair of CTAs shares the cache]): the key range is their block's, block_m rows
        block_m = self.cfg.block_m
        m_blocks = num_m_blocks(seqlen_q_bound, group, block_m) * self.cluster
        rank = 0  # in the cluster: m_block % cluster, as the cluster runs along grid x
        if const_expr(self.cluster > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        m_block = bx % m_blocks
        split = bx // m_blocks
        num_splits = grid_x // m_blocks
        seqlen_k = self.cached_length(mK, mPageTable, mSeqUsedK, b)
        n_end, n_full = block_key_tiles(m_block // self.cluster, block_m, self.tile_n, group,
                                        seqlen_q, seqlen_k, self.causal)
        window = window_left if const_expr(self.has_window_left) else None
        n_start, n_left_free = block_key_start(m_block // self.cluster, block_m, self.tile_n,
                                               group, seqlen_q, seqlen_k, window)
        n_lo, n_hi = split_key_tiles(split, num_splits, seqlen_k, self.tile_n, n_end, n_start)

        if warp_idx < THREADS_PER_WARPGROUP // WARP_SIZE:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == self.roles["producer"]["tma_warp"]:
                self.load(mK, mV, sK, sV, tma_atom_k, tma_atom_v, pipeline_k, pipeline_v,
                          mPageTable, b, kv_head, n_lo, n_hi, seqlen_k, rank)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            poison = None  # Note [Out-of-range pages give NaN]
            if const_expr(self.paged):
                poison = self.page_poison(mK, mPageTable, mSeqUsedK, b, n_lo, n_hi, seqlen_k)
            if const_expr(self.cfg.swap_ab):  # Note [Keys on M]
                sP_layout = self.keys_on_m_p_layout()
                sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
                sX = storage.sX.get_tensor(cute.make_layout(
                    (DECODE_EXCHANGE_WARPS, self.tile_m), stride=(self.tile_m, 1)))
                self.consume_keys_on_m(
                    mQ, mO, mLSE, sQ, sK, sV, sP, sX, tiled_mma_qk, tiled_mma_pv, pipeline_k,
                    pipeline_v, scale_log2, (qb, q_offset), kv_head, m_block, split, group,
                    seqlen_q, seqlen_k, n_lo, n_hi, n_full, n_left_free, window, poison)
            elif const_expr(self.consumers == 1):
                self.consume(mQ, mO, mLSE, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv, pipeline_k,
                             pipeline_v, scale_log2, (qb, q_offset), kv_head, m_block, split,
                             group, seqlen_q, seqlen_k, n_lo, n_hi, n_full, n_left_free, window,
                             poison=poison)
            else:
                # Note [Two consumer warpgroups]: warpgroup 1 + part owns the CTA's 64-row
                # sub-block m_block * consumers + part, Q from its stage of sQ
                part = warp_idx // (THREADS_PER_WARPGROUP // WARP_SIZE) - 1
                self.consume(mQ, mO, mLSE, sQ[None, None, part], sK, sV, tiled_mma_qk,
                             tiled_mma_pv, pipeline_k, pipeline_v, scale_log2, (qb, q_offset),
                             kv_head, m_block * self.consumers + part, split, group, seqlen_q,
                             seqlen_k, n_lo, n_hi, n_full, n_left_free, window, part, poison)

    # Note [Out-of-range pages give NaN]
    # A page-table entry a sequence uses that is not a page of the cache, or a seqused_k past
    # max_pages x page_size or below 0, must not turn into a plausible answer. The launch is
    # safe without any check (cached_length clamps the length, so no slot past a row is read;
    # a TMA box at a page past the cache is filled with zeros), and the API does not stop the
    # host to read the values (Note [Paged KV checks] in fa4_final.runtime.decode): the kernel
    # looks for itself. Each consumer thread, before its first key tile, reads the entries of the
    # pages its split reads (keys n_lo * tile_n up to the split's last key: the 32 lanes of a
    # warp share them, then one vote) and seqused_k[b]; if one is out of range, every out
    # and lse value the CTA writes is NaN (a multiply of O and an add to lse by the factor
    # page_poison returns, 1 or NaN: no branch in the store). A split's NaN partial makes the
    # combined row NaN. Pages no split reads (left of a window) are not looked at: they change
    # no value of the answer.

    @cute.jit
    def page_poison(self, mK, mPageTable, mSeqUsedK, b, n_lo, n_hi, seqlen_k):
        """1.0, or NaN when sequence ``b``'s seqused_k is out of [0, max_pages x page_size] or
        an entry of a page the split reads is out of [0, num_pages)
        (Note [Out-of-range pages give NaN]). mK is the paged TMA coordinate tensor (page_size,
        D, heads_kv, num_pages)."""
        page_size = mK.shape[0]
        num_pages = mK.shape[3]
        bad = Int32(0)
        if const_expr(mSeqUsedK is not None):
            used = mSeqUsedK[b]
            if used < 0:
                bad = Int32(1)
            if used > page_size * mPageTable.shape[1]:
                bad = Int32(1)
        keys_end = cutlass.min(n_hi * self.tile_n, seqlen_k)
        first = n_lo * self.tile_n // page_size
        last = (keys_end - 1) // page_size
        if keys_end > n_lo * self.tile_n:
            # the warp's lanes share the slots, 32 apart, four loads in flight; one vote
            lane = cute.arch.lane_idx()
            for j in cutlass.range(first + lane, last + 1, WARP_SIZE, unroll=4):
                page = mPageTable[b, j]
                if page < 0:
                    bad = Int32(1)
                if page >= num_pages:
                    bad = Int32(1)
        poison = Float32(1.0)
        if cute.arch.vote_any_sync(bad != 0):
            poison = Float32(float("nan"))
        return poison

    @cute.jit
    def cached_length(self, mK, mPageTable, mSeqUsedK, b):
        """Keys of sequence ``b``: the cache's length (paged: the table's pages times the page
        size), or seqused_k[b] when given, clamped to it: a length past the cache, which the
        API does not stop to look for (Note [Paged KV checks] in fa4_final.runtime.decode;
        page_poison turns it into NaN rows), never makes the producer read a page-table slot
        past its row."""
        length = mK.shape[0]
        if const_expr(self.paged):
            length = mK.shape[0] * mPageTable.shape[1]
        if const_expr(mSeqUsedK is not None):
            return cutlass.min(mSeqUsedK[b], length)
        return length

    @cute.jit
    def load(self, mK, mV, sK, sV, tma_atom_k, tma_atom_v, pipeline_k, pipeline_v, mPageTable,
             b, kv_head, n_lo, n_hi, seqlen_k, rank):
        """Producer warp: K[n] then V[n] for the split's key tiles, n from n_hi - 1 down to n_lo,
        each from its page (Note [Key tile pages]). The consumer releases K[n] before it waits
        for V[n], so K[n + stages] never waits on a V. With a cluster (``rank``: this CTA's),
        half of each tile multicast, then a wait for every stage's release by both CTAs before
        the warp exits (Note [A pair of CTAs shares the cache])."""
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.cfg.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.cfg.stages)
        for i in cutlass.range(n_hi - n_lo, unroll=1):
            n = n_hi - 1 - i
            boxes = self.tile_boxes(mPageTable, b, n, seqlen_k, mK.shape[0])
            state_k = self.load_tile(tma_atom_k, mK, sK, kv_head, boxes, pipeline_k, state_k,
                                     rank)
            state_v = self.load_tile(tma_atom_v, mV, sV, kv_head, boxes, pipeline_v, state_v,
                                     rank)
        if const_expr(self.cluster > 1):  # the peer's last arrives land before this CTA exits
            pipeline_k.producer_tail(state_k)
            pipeline_v.producer_tail(state_v)

    @cute.jit
    def tile_boxes(self, mPageTable, b, n, seqlen_k, page_size):
        """(page, box inside the page) of each TMA box of key tile ``n``, read once for K and V:
        one box of the whole tile (contiguous: page b, box n; paged: Note [Key tile pages]),
        or the tile gathered from page_box rows a box (Note [Gathered key tiles]; a contiguous
        cache: boxes of sequence b's own rows, Note [Boxes of a contiguous cache])."""
        if const_expr(self.cfg.page_box is None):
            if const_expr(not self.paged):
                return [(b, n)]  # contiguous: one page per sequence
            slot, tile = key_tile_location(n, self.tile_n, page_size)
            return [(mPageTable[b, slot], tile)]
        box = self.cfg.page_box
        boxes = []
        for j in cutlass.range_constexpr(self.tile_n // box):
            key = gathered_box_start(n, j, self.tile_n, box, seqlen_k)
            if const_expr(not self.paged):  # Note [Boxes of a contiguous cache]
                boxes.append((b, key // box))
            else:
                slot, inside = key_box_location(key, page_size, box)
                boxes.append((mPageTable[b, slot], inside))
        return boxes

    # Note [Boxes of a contiguous cache]
    # With the 128-byte swizzle a TMA box is at most 64 columns (128 B) wide, so at D = 128 one
    # box a tile is two copies: the left halves of all tile_n key rows, then the right halves.
    # Each key row is 256 contiguous bytes, requested in two halves a whole tile apart.
    # page_box on a contiguous cache fills the tile from boxes of page_box rows, each box's two
    # copies back to back, so both halves of a row are requested within one box. Same shared
    # memory, same steps, the same bits out; only the order and size of the copies change.
    # The hypothesis, not documented behaviour: DRAM serves the two halves more efficiently
    # close together.
    # Timed on an H100 at D = 128 (three interleaved rounds, L2 flushed and calls back to back,
    # beside cuDNN and the FA4 package), one consumer warpgroup, batch 1 and 32, one and 16
    # tokens at GQA 4, 8k and 128k keys: boxes of 32 keys took 1.6-3.4% less time than one box
    # a tile in 9 of the 16 cases (shape and timing mode) and 0.8% less in a tenth; in the
    # other six the rounds spread by 4-33% and the two lie within it. With two consumer
    # warpgroups (16 tokens at GQA 8, batch 32, 8k keys) boxes of 32 took 2% less than the
    # call with one box a tile. At D = 64 one copy holds whole 128-byte key rows already, and
    # boxes of 32 were within the spread of one box a tile in 15 of 16 cases: so a contiguous
    # cache is read in boxes of 32 at D = 128 (hopper_decode_contiguous), one box a tile at
    # D = 64. Two stages of one box a tile (fewer bytes in flight, the halves a tile apart)
    # gained about as much with one consumer warpgroup, so the order of the halves
    # is not shown to be the cause. Paged caches keep Note [Gathered key tiles]'s boxes: pages
    # of whole tiles are read one box a tile, unmeasured with boxes.

    @cute.jit
    def load_tile(self, tma_atom, mX, sX, kv_head, boxes, pipe, state, rank):
        """Wait for a free stage, arm its FULL barrier with the whole tile's bytes, start one
        TMA copy a box (``tile_boxes``) into the stage's rows j * box. With a cluster, this
        CTA's share (``rank``) of the one box, multicast into every CTA of the cluster."""
        box = self.tile_n // len(boxes)
        pipe.producer_acquire(state)
        for j in cutlass.range_constexpr(len(boxes)):
            page, inside = boxes[j]
            # (box, D, boxes in the page) of this page and KV head; the stage's rows of box j
            gX = cute.local_tile(mX[None, None, kv_head, page], (box, self.head_dim), (None, 0))
            sX_box = cute.local_tile(sX[None, None, state.index], (box, self.head_dim), (j, 0))
            tXsX, tXgX = cpasync.tma_partition(tma_atom, rank, cute.make_layout(self.cluster),
                                               cute.group_modes(sX_box, 0, 2),
                                               cute.group_modes(gX, 0, 2))
            if const_expr(self.cluster > 1):
                cute.copy(tma_atom, tXgX[None, inside], tXsX,
                          tma_bar_ptr=pipe.producer_get_barrier(state),
                          mcast_mask=cutlass.Int16((1 << self.cluster) - 1))
            else:
                cute.copy(tma_atom, tXgX[None, inside], tXsX,
                          tma_bar_ptr=pipe.producer_get_barrier(state))
        state.advance()
        return state

    @cute.jit
    def load_q(self, mQ, sQ, tidx, rows_at, kv_head, m_block, group, seqlen_q, part=None):
        """Q's packed rows into shared memory by the consumer warpgroup, 16 bytes a thread at a
        time (a TMA box cannot gather the heads of a group from several tokens). Padding rows
        past the packed count repeat its last row: finite scores that are never stored. Only a
        CTA with key tiles calls it, so its m-block holds at least one row. consumers = 2:
        ``m_block`` is the warpgroup's 64-row sub-block, ``part`` its consumer index."""
        chunks = self.head_dim // Q_VECTOR
        last = packed_rows(seqlen_q, group) - 1
        total = self.wg_rows * chunks  # swap_ab's few rows: maybe fewer than the threads
        for it in cutlass.range_constexpr(-(-total // THREADS_PER_WARPGROUP)):
            idx = tidx + it * THREADS_PER_WARPGROUP
            if const_expr(total % THREADS_PER_WARPGROUP == 0):
                self.load_q_chunk(mQ, sQ, idx, chunks, last, rows_at, kv_head, m_block, group)
            elif idx < total:
                self.load_q_chunk(mQ, sQ, idx, chunks, last, rows_at, kv_head, m_block, group)
        # generic-proxy shared stores -> visible to wgmma (async proxy), from every thread
        cute.arch.fence_view_async_shared()
        q_ready = Q_READY_BARRIER
        if const_expr(self.consumers > 1):  # one instruction, an id a consumer warpgroup
            q_ready = Q_READY_BARRIER + SECOND_CONSUMER_BARRIER_OFFSET * part
        cute.arch.barrier(barrier_id=q_ready, number_of_threads=THREADS_PER_WARPGROUP)

    @cute.jit
    def load_q_chunk(self, mQ, sQ, idx, chunks, last, rows_at, kv_head, m_block, group):
        """16 bytes of Q: chunk idx % chunks of the tile's row idx // chunks."""
        r, chunk = idx // chunks, idx % chunks
        token, head = unpack_row(cutlass.min(m_block * self.wg_rows + r, last), group, kv_head)
        qb, q_offset = rows_at
        gq = cute.local_tile(mQ[qb, q_offset + token, head, None], (Q_VECTOR,),
                             (chunk,))  # (8,)
        sq = cute.local_tile(sQ[r, None], (Q_VECTOR,), (chunk,))  # (8,)
        sq.store(gq.load())

    @cute.jit
    def consume(self, mQ, mO, mLSE, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv, pipeline_k,
                pipeline_v, scale_log2: Float32, rows_at, kv_head, m_block, split, group,
                seqlen_q, seqlen_k, n_lo, n_hi, n_full, n_left_free, window, part=None,
                poison=None):
        """The consumer warpgroup: Q, the split's key tiles, the epilogue. ``rows_at``: (batch
        entry, first row) of the sequence's rows in q, out and lse. consumers = 2
        (Note [Two consumer warpgroups]): ``part`` is the warpgroup's index among the
        consumers, ``m_block`` its 64-row sub-block and ``sQ`` its 64 rows. ``poison``
        (paged): page_poison's factor for out and lse."""
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - THREADS_PER_WARPGROUP  # 0 .. 127
        tail_tidx = tidx  # zero_v_tail's thread among all the consumers
        if const_expr(self.consumers > 1):
            tidx = tidx - part * THREADS_PER_WARPGROUP
        # A and B descriptors per warpgroup, C fragments per thread
        (thr_mma_qk, thr_mma_pv, tSrQ, tSrK, tOrVt, acc_s, acc_o, tOrP) = attention_fragments(
            tiled_mma_qk, tiled_mma_pv, 0, tidx, sQ, sK, sV, self.wg_rows,
            self.tile_n, self.head_dim, self.cfg.stages, self.dtype)
        tScS, t0ScS = fragment_coords(thr_mma_qk, (self.wg_rows, self.tile_n))
        rows = cute.size(acc_rows_cols(acc_o), mode=[0])
        softmax = OnlineSoftmax(scale_log2, rows)
        # each row's key limit (and window start), less this thread's first column
        # (Note [Mask with constants])
        limit = cute.make_rmem_tensor(rows, Int32)
        start = cute.make_rmem_tensor(rows, Int32)
        for r in cutlass.range_constexpr(rows):
            row = m_block * self.wg_rows + tScS[r, 0][0]
            limit[r] = key_limit(row, group, seqlen_q, seqlen_k, self.causal) - tScS[0, 0][1]
            if const_expr(self.has_window_left):
                start[r] = key_start(row, group, seqlen_q, seqlen_k, window) - tScS[0, 0][1]
        mask = lambda s, n: self.mask(s, t0ScS, limit, start, n)  # noqa: E731
        zero_tail = lambda stage, n: self.zero_v_tail(  # noqa: E731
            sV, stage, seqlen_k - n * self.tile_n, tail_tidx)
        acc_o.fill(0.0)

        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.cfg.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.cfg.stages)
        n_tiles = n_hi - n_lo
        if n_tiles > 0:  # (uniform over the CTA) a CTA with no key tile needs no Q either
            self.load_q(mQ, sQ, tidx, rows_at, kv_head, m_block, group, seqlen_q, part)
            step = lambda i, first, masked, sk, sv: self.step(  # noqa: E731
                n_hi - 1 - i, first, masked, mask, zero_tail, softmax, acc_s, acc_o, tOrP, tSrQ,
                tSrK,
                tOrVt, tiled_mma_qk, tiled_mma_pv, pipeline_k, pipeline_v, sk, sv)
            state_k, state_v = self.walk_key_tiles(step, n_lo, n_hi, n_full, n_left_free,
                                                   n_tiles, state_k, state_v)
        self.epilogue(acc_o, softmax, mO, mLSE, thr_mma_pv, rows_at, kv_head, m_block, split,
                      group, seqlen_q, poison)

    @cute.jit
    def walk_key_tiles(self, step, n_lo, n_hi, n_full, n_left_free, n_tiles, state_k, state_v):
        """A consumer's key tiles in the order it visits them, ``step(i, first, masked, state_k,
        state_v)`` for each: the first (always masked: it may hold seqlen_k's end or the causal
        diagonal), then the rest of the masked ones, then the free ones, then (a left window)
        those left of some row's window. The range is split, not the body: each loop runs one
        step function; with a window every masked step masks both sides, as a narrow window's
        tiles can need both. Returns the rings' states."""
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
        return state_k, state_v

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
        (Note [Keys past the cached length]); ``tidx`` among all the consumer threads, which
        share the work and the barrier (Note [Two consumer warpgroups])."""
        if valid < self.tile_n:  # uniform over the CTA
            threads = self.consumers * THREADS_PER_WARPGROUP
            chunks = self.head_dim // Q_VECTOR
            zeros = cute.make_rmem_tensor((Q_VECTOR,), self.dtype)
            zeros.fill(0.0)
            for it in cutlass.range_constexpr(self.tile_n * chunks // threads):
                idx = tidx + it * threads
                r, chunk = idx // chunks, idx % chunks
                if r >= valid:
                    sv = cute.local_tile(sV[r, None, stage], (Q_VECTOR,), (chunk,))  # (8,)
                    sv.store(zeros.load())
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=V_TAIL_BARRIER, number_of_threads=threads)

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
                 group, seqlen_q, poison=None):
        """out = O / l and lse straight from registers to global memory, each packed row to its
        (token, head); float32 partials with ``split``. Decode's output is a few rows per CTA:
        no shared-memory staging, no TMA store. A split (or row) that saw no key writes out = 0
        and lse = -inf (OnlineSoftmax.finalize). ``poison`` (paged): 1 or NaN, multiplies out
        and is added to lse less 1 (Note [Out-of-range pages give NaN])."""
        inv_sum, lse = softmax.finalize()
        if const_expr(poison is not None):
            for r in cutlass.range_constexpr(cute.size(inv_sum)):
                inv_sum[r] = inv_sum[r] * poison
                lse[r] = lse[r] + (poison - Float32(1.0))
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
            cute.make_identity_tensor((self.wg_rows, self.head_dim))))
        packed = packed_rows(seqlen_q, group)
        for r in cutlass.range_constexpr(cute.size(out, mode=[0])):
            row = m_block * self.wg_rows + tOcO[r, 0][0]
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

    # ------------------------------------------------------------------------------------------
    # keys on the wgmma M (HopperDecodeConfig.swap_ab)
    # ------------------------------------------------------------------------------------------

    # Note [Keys on M]
    # At GQA 8 and one query token a KV head has 8 packed rows, and the 64-row tile computes
    # 56 rows of padding in both GEMMs. With ``swap_ab`` the GEMMs are transposed so that the
    # keys fill wgmma's M and the packed rows are its N, which may be as small as 8:
    #     S^T = K Q^T     A = K, the stage's (tile_n, D) tile, K-major; B = Q (rows_n, D)
    #     O^T = V^T P^T   A = V^T, the V stage read through a transposed view (MN-major, D on
    #                     M: D / 64 blocks); B = P^T (rows_n, tile_n) in shared memory, keys
    #                     contiguous (K-major)
    # with tile_n = 64 or 128 keys a stage (one or two M blocks of 64) and rows_n of 8, 16 or
    # 32 (HopperDecodeConfig.rows_n, the smallest that holds the KV head's tokens x group rows,
    # m-blocks of 32 beyond: hopper_decode_keys_on_m). The producer, the rings, the page walk
    # and the splits are the 64-row path's with tile_m = rows_n; only the consumer warpgroup
    # differs.
    # The softmax. In S^T's accumulator a query row is a column: thread (warp w, lane l) holds
    # keys 16 w + l / 4 (+ 8, + 64) and columns 2 (l % 4) + {0, 1} + 8 j, so a column's keys are
    # spread over the 8 lanes of equal l % 4 and over the 4 warps. Per step: each thread's max
    # over its keys, three butterfly shuffles (xor 4, 8, 16) for the warp's, lanes 0-3 write the
    # warp's rows_n maxima to shared memory (sX, 4 x rows_n float32), one named barrier, and
    # every thread takes the max of the four in a fixed order: every thread of the warpgroup
    # then holds the same running max of each of its columns, so alpha and the exponentials
    # agree across the keys of one P^T column, as O^T = V^T P^T needs. The sums need no
    # exchange per step: each thread keeps its own keys' partial sum of a column (rescaled by the
    # same alpha), reduced once in the epilogue, shuffles and sX again, in a fixed order
    # (deterministic; the same per split, so paged equals contiguous bit for bit; not the
    # 64-row path's bits, whose sums run in another order).
    # P^T leaves the registers by stmatrix (transposed 8 x 8 blocks: the accumulator's key rows
    # become the contiguous dimension of sP), then a proxy fence and a second named barrier,
    # because the B operand is read by the whole warpgroup. The barrier also orders the sX
    # reads of a step before the next step's writes, and each warp's wait for its O^T GEMM
    # before the next step's stmatrix over sP: one sX and one sP buffer suffice. O^T's columns
    # are the same packed rows in the same lanes as S^T's, so alpha rescales O^T column by
    # column in the thread that computed it. The epilogue writes out[token, head, d] element by
    # element from O^T's fragment (d on the rows) and lse from the threads holding d = 0.
    # Budget (D = 128, tile_n = 128, rows_n = 32): S^T and O^T are 32 float32 registers a thread
    # each (tile_n rows_n / 128 and D rows_n / 128), against 64 and 64 of the 64-row tile; sX
    # (512 B, in the barriers' 1 KB granule) and sP (8 KB) more shared memory, Q rows_n x D
    # (8 KB) instead of 16 KB: 209 KB at 3 stages, as the 64-row path
    # (HopperDecodeConfig.smem_bytes). rows_n below 8 cannot be had
    # (wgmma's smallest N). rows_n = 64 wastes nothing in the 64-row tile either, and here it
    # spilled when compiled for sm_90a (D = 128: 136 spill instructions, 160 B of stack; D = 64:
    # 26 and 48 B): a thread then holds 16 columns, and their per-column state (limit, max,
    # partial sum, alpha, the exchanged max) beside 64 registers of S^T and 64 of O^T passes
    # the consumer's 232.
    # Saves and costs (arithmetic, not measured): per 128-key step at D = 128 the two GEMMs do
    # 2 x 2 x 128 x rows_n x 128 FLOP, 1/8 of the 64-row tile's at rows_n = 8 (128 against
    # 1024 cycles at 4096 FLOP a clock); but both paths read the K and V tiles from shared
    # memory once a step (64 KB, 512 cycles at 128 B a clock), so the swapped GEMMs are bound
    # there, near 512 cycles, not 128. The softmax takes 128 x rows_n exponentials instead of
    # 64 x 128 (8 a thread at rows_n = 8, against 64). It adds per step one stmatrix pass of
    # P^T (tile_n x rows_n x 2 B: 2 KB at rows_n = 8), two named barriers of the warpgroup,
    # three butterfly shuffles for each of a thread's rows_n / 4 columns (two for each of its
    # two rows in the 64-row tile) and 4 x rows_n / 4 shared loads for the maxima, and the
    # same once more for the sums in the epilogue. Both paths
    # wait about 3500 cycles per 64 KB step for HBM
    # (Note [Decode bytes in flight]), so the gain is the consumer's latency per step, which
    # matters only if the memory stops hiding it (few CTAs an SM, short splits, back to back
    # steps from L2).
    # Measured (an H100, D = 128, batch 1 and 32, 1 and 4 tokens, GQA 4 and 8, 1k-32k keys, the
    # L2 flushed): where both kernels reach 90% of the copy rate or more, their times differ by
    # at most 0.3%; at batch 1 and 1k keys, where a step is latency, the swapped kernel at
    # rows_n = 8 or 16 took 0.84-0.93x the 64-row kernel's time, and at rows_n = 32 1.09x (inside
    # that run's spread).
    # The default stays the 64-row kernel: the two tie where decode spends its time, and the
    # swapped path has not been through the sanitizers or the API's tests.

    def keys_on_m_mmas(self):
        """(S^T = K Q^T, O^T = V^T P^T) tiled MMAs: one warpgroup, keys (S^T) or D (O^T) on M in
        64-row blocks, the packed rows on N; both operands from shared memory."""
        major = cute.nvgpu.OperandMajorMode
        tiler = (WGMMA_M, self.tile_m)
        mma_s = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major.K, major.K, Float32, (1, 1, 1), tiler)
        mma_o = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major.MN, major.K, Float32, (1, 1, 1), tiler)
        return mma_s, mma_o

    def keys_on_m_p_layout(self):
        """P^T's shared tile, (rows_n, tile_n) with the keys contiguous (128 B swizzle)."""
        return smem_tile_layout(self.dtype, self.tile_n, self.tile_m)

    def keys_on_m_p_store(self, mma_s):
        """(atom, tiled copy) that moves P^T out of S^T's registers: stmatrix of transposed 8 x 8
        blocks, so the accumulator's key rows become sP's contiguous dimension."""
        st = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(
            transpose=True, num_matrices=4 if self.tile_m % 16 == 0 else 2), self.dtype)
        return st, cute.make_tiled_copy_C(st, mma_s)

    def keys_on_m_storage(self, sQ_layout, sK_layout, sV_layout):
        """The SharedStorage of swap_ab: the barriers and the column exchange, Q, the K and V
        rings, P^T (HopperDecodeConfig.smem_bytes counts it)."""
        R, A = cute.struct.MemRange, cute.struct.Align
        dt, stages = self.dtype, self.cfg.stages
        fields = {
            "mbar_k": R[cutlass.Int64, 2 * stages],
            "mbar_v": R[cutlass.Int64, 2 * stages],
            "sX": A[R[Float32, DECODE_EXCHANGE_WARPS * self.tile_m], 16],
            "sQ": A[R[dt, cute.cosize(sQ_layout)], 1024],
            "sK": A[R[dt, cute.cosize(sK_layout)], 1024],
            "sV": A[R[dt, cute.cosize(sV_layout)], 1024],
            "sP": A[R[dt, cute.cosize(self.keys_on_m_p_layout())], 1024],
        }
        return cute.struct(type("KeysOnMStorage", (), {"__annotations__": fields}))

    @cute.jit
    def consume_keys_on_m(self, mQ, mO, mLSE, sQ, sK, sV, sP, sX, mma_s, mma_o, pipeline_k,
                          pipeline_v, scale_log2: Float32, rows_at, kv_head, m_block, split,
                          group, seqlen_q, seqlen_k, n_lo, n_hi, n_full, n_left_free, window,
                          poison=None):
        """The consumer warpgroup under swap_ab (Note [Keys on M]): Q, the split's key tiles
        with the keys on M, the transposed epilogue (``poison``: page_poison's factor)."""
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - THREADS_PER_WARPGROUP  # 0 .. 127
        wg_s, wg_o = mma_s.get_slice(0), mma_o.get_slice(0)
        thr_s, thr_o = mma_s.get_slice(tidx), mma_o.get_slice(tidx)
        tSrK = wg_s.make_fragment_A(wg_s.partition_A(sK))  # (MMA, tile_n/64, D/16, STAGE)
        tSrQ = wg_s.make_fragment_B(wg_s.partition_B(sQ))  # (MMA, 1, D/16)
        tOrVt = wg_o.make_fragment_A(wg_o.partition_A(transposed(sV)))  # (MMA, D/64, n/16, ST)
        tOrPt = wg_o.make_fragment_B(wg_o.partition_B(sP))  # (MMA, 1, tile_n/16)
        shape_s = thr_s.partition_shape_C((self.tile_n, self.tile_m))  # ((2,2,N/8), n/64, 1)
        acc_o = cute.make_rmem_tensor(thr_o.partition_shape_C((self.head_dim, self.tile_m)),
                                      Float32)  # ((2, 2, N/8), D/64, 1)
        st, tiled_st = self.keys_on_m_p_store(mma_s)
        thr_st = tiled_st.get_slice(tidx)
        tPsP = thr_st.partition_D(transposed(sP))  # P^T's (keys, rows) view
        tScS, t0ScS = fragment_coords(thr_s, (self.tile_n, self.tile_m))
        cols = cute.size(tScS, mode=[1])
        # each column's key limit (and window start), less this thread's first key
        # (Note [Mask with constants])
        limit = cute.make_rmem_tensor(cols, Int32)
        start = cute.make_rmem_tensor(cols, Int32)
        for c in cutlass.range_constexpr(cols):
            row = m_block * self.tile_m + tScS[0, c][1]
            limit[c] = key_limit(row, group, seqlen_q, seqlen_k, self.causal) - tScS[0, 0][0]
            if const_expr(self.has_window_left):
                start[c] = key_start(row, group, seqlen_q, seqlen_k, window) - tScS[0, 0][0]
        col_max = cute.make_rmem_tensor(cols, Float32)  # the same in every thread of a column
        col_sum = cute.make_rmem_tensor(cols, Float32)  # this thread's keys only
        col_max.fill(-Float32.inf)
        col_sum.fill(0.0)
        ops = (tSrK, tSrQ, tOrVt, tOrPt, st, thr_st, tPsP, tScS, t0ScS, limit, start, col_max,
               col_sum, sX, sV, shape_s, acc_o, mma_s, mma_o, tidx)

        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.cfg.stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.cfg.stages)
        n_tiles = n_hi - n_lo
        if n_tiles > 0:  # (uniform over the CTA) a CTA with no key tile needs no Q either
            self.load_q(mQ, sQ, tidx, rows_at, kv_head, m_block, group, seqlen_q)
            step = lambda i, first, masked, sk, sv: self.step_keys_on_m(  # noqa: E731
                n_hi - 1 - i, first, masked, ops, scale_log2, seqlen_k, pipeline_k, pipeline_v,
                sk, sv)
            state_k, state_v = self.walk_key_tiles(step, n_lo, n_hi, n_full, n_left_free,
                                                   n_tiles, state_k, state_v)
        else:
            # zeros only here: filled before the first step, whose O^T GEMM overwrites acc_o,
            # the zeros were moved into its registers after wgmma.fence and ptxas injected a
            # warpgroup.arrive (C7519) before it
            acc_o.fill(0.0)
        self.epilogue_keys_on_m(acc_o, col_max, col_sum, sX, tScS, tidx, scale_log2, mO, mLSE,
                                thr_o, rows_at, kv_head, m_block, split, group, seqlen_q, poison)

    @cute.jit
    def column_exchange(self, values, sX, tScS, tidx, op):
        """Each column's ``op`` (fmax, or a sum) over the warpgroup, from this thread's per
        column ``values`` (cols,): the lanes of equal lane % 4 by butterfly shuffles, the four
        warps through sX and one barrier, taken in warp order (Note [Keys on M])."""
        warp, lane = tidx // WARP_SIZE, tidx % WARP_SIZE
        for c in cutlass.range_constexpr(cute.size(values)):
            v = values[c]
            for offset in (4, 8, 16):
                v = op(v, cute.arch.shuffle_sync_bfly(v, offset=offset))
            if lane < 4:
                sX[warp, tScS[0, c][1]] = v
        cute.arch.barrier(barrier_id=COLUMNS_BARRIER, number_of_threads=THREADS_PER_WARPGROUP)
        out = cute.make_rmem_tensor(cute.size(values), Float32)
        for c in cutlass.range_constexpr(cute.size(values)):
            col = tScS[0, c][1]
            total = sX[0, col]
            for w in cutlass.range_constexpr(1, DECODE_EXCHANGE_WARPS):
                total = op(total, sX[w, col])
            out[c] = total
        return out

    @cute.jit
    def step_keys_on_m(self, n, first: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool],
                       ops, scale_log2, seqlen_k, pipeline_k, pipeline_v, state_k, state_v):
        """Key tile ``n`` with the keys on M: S^T = K Q^T, (mask), the column softmax, P^T to
        shared memory, O^T = alpha O^T + V^T P^T (Note [Keys on M])."""
        (tSrK, tSrQ, tOrVt, tOrPt, st, thr_st, tPsP, tScS, t0ScS, limit, start, col_max,
         col_sum, sX, sV, shape_s, acc_o, mma_s, mma_o, tidx) = ops
        pipeline_k.consumer_wait(state_k)
        acc_s = cute.make_rmem_tensor(shape_s, Float32)  # fresh: its registers die with P^T
        issue_wgmma(mma_s, acc_s, tSrK[None, None, None, state_k.index], tSrQ, False)
        warpgroup.wait_group(0)
        pipeline_k.consumer_release(state_k)
        state_k.advance()
        s = acc_rows_cols(acc_s)  # (keys, columns = packed rows)
        rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
        if const_expr(masked):
            for c in cutlass.range_constexpr(cols):
                hi = limit[c] - n * self.tile_n
                lo = start[c] - n * self.tile_n
                for r in cutlass.range_constexpr(rows):
                    key = t0ScS[r, 0][0]
                    if const_expr(self.has_window_left):
                        s[r, c] = -Float32.inf if (key >= hi) | (key < lo) else s[r, c]
                    else:
                        s[r, c] = -Float32.inf if key >= hi else s[r, c]
        local = cute.make_rmem_tensor(cols, Float32)
        for c in cutlass.range_constexpr(cols):
            local[c] = tree_reduce([s[r, c] for r in range(rows)], cute.arch.fmax)
        tile_max = self.column_exchange(local, sX, tScS, tidx, cute.arch.fmax)
        alpha = cute.make_rmem_tensor(cols, Float32)
        for c in cutlass.range_constexpr(cols):
            new = tile_max[c]
            if const_expr(not first):
                new = cute.arch.fmax(col_max[c], tile_max[c])
            # a column with no key yet: exponentiate against 0, p = 0 and alpha = 0, never NaN
            max_scaled = (Float32(0.0) if new == -Float32.inf else new) * scale_log2
            for r in cutlass.range_constexpr(rows):
                s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - max_scaled, fastmath=True)
            tile_sum = tree_reduce([s[r, c] for r in range(rows)], lambda a, b: a + b)
            if const_expr(first):
                col_sum[c] = tile_sum
            else:
                alpha[c] = cute.math.exp2(col_max[c] * scale_log2 - max_scaled, fastmath=True)
                col_sum[c] = col_sum[c] * alpha[c] + tile_sum
            col_max[c] = new
        rP = cute.make_rmem_tensor_like(acc_s, self.dtype)
        rP.store(acc_s.load().to(self.dtype))
        cute.copy(st, thr_st.retile(rP), tPsP)
        # stmatrix (generic proxy) -> wgmma (async proxy); every warp's part of P^T in place
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=P_READY_BARRIER, number_of_threads=THREADS_PER_WARPGROUP)
        if const_expr(not first):
            o = acc_rows_cols(acc_o)  # (D, columns): the same columns as S^T's
            for c in cutlass.range_constexpr(cols):
                for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
                    o[r, c] = o[r, c] * alpha[c]
        pipeline_v.consumer_wait(state_v)
        if const_expr(first):  # the only tile that can hold seqlen_k's end
            self.zero_v_tail(sV, state_v.index, seqlen_k - n * self.tile_n, tidx)
        issue_wgmma(mma_o, acc_o, tOrVt[None, None, None, state_v.index], tOrPt, not first)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(state_v)
        state_v.advance()
        return state_k, state_v

    @cute.jit
    def epilogue_keys_on_m(self, acc_o, col_max, col_sum, sX, tScS, tidx, scale_log2, mO, mLSE,
                           thr_o, rows_at, kv_head, m_block, split, group, seqlen_q,
                           poison=None):
        """out = O^T / l column by column and lse, from the transposed accumulator to each
        packed row's (token, head); float32 partials with ``split``. A column that saw no key
        writes out = 0 and lse = -inf. The sums are reduced over the warpgroup here, once."""
        total = self.column_exchange(col_sum, sX, tScS, tidx, lambda a, b: a + b)
        cols = cute.size(total)
        inv_sum = cute.make_rmem_tensor(cols, Float32)
        lse = cute.make_rmem_tensor(cols, Float32)
        for c in cutlass.range_constexpr(cols):
            inv_sum[c], lse[c] = inverse_sum_and_lse(total[c], col_max[c] * scale_log2)
            if const_expr(poison is not None):  # Note [Out-of-range pages give NaN]
                inv_sum[c] = inv_sum[c] * poison
                lse[c] = lse[c] + (poison - Float32(1.0))
        o = acc_rows_cols(acc_o)
        for c in cutlass.range_constexpr(cols):
            for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
                o[r, c] = o[r, c] * inv_sum[c]
        rO = acc_o
        if const_expr(not self.split):
            rO = cute.make_rmem_tensor_like(acc_o, self.dtype)
            rO.store(acc_o.load().to(self.dtype))
        out = acc_rows_cols(rO)
        tOcO = acc_rows_cols(thr_o.partition_C(
            cute.make_identity_tensor((self.head_dim, self.tile_m))))  # (d, packed row)
        packed = packed_rows(seqlen_q, group)
        for c in cutlass.range_constexpr(cols):
            row = m_block * self.tile_m + tOcO[0, c][1]
            if row < packed:
                token, head = unpack_row(row, group, kv_head)
                qb, q_offset = rows_at
                token = q_offset + token
                gO = self.out_row(mO, split, qb, token, head)  # (D,)
                for r in cutlass.range_constexpr(cute.size(out, mode=[0])):
                    gO[tOcO[r, c][0]] = out[r, c]
                if tOcO[0, 0][0] == 0:  # the threads holding d = 0 write the column's lse
                    if const_expr(self.split):
                        mLSE[split, qb, head, token] = lse[c]
                    else:
                        mLSE[qb, head, token] = lse[c]
