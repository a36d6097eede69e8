"""The Hopper forward (sm_90a): warp-specialised, ping-pong, persistent.

What it adds over a one-tile-per-CTA kernel (TMA + wgmma + an mbarrier pipeline):

1. Ping-pong with exact turns. Two (three at D = 64) consumer warpgroups take turns issuing
   their GEMMs (Note [Turns]), so while the tensor cores run one warpgroup's S = Q K^T and
   O += P V, the other runs its softmax. Per 128 x 128 tile step at D = 128 the SM has 2048
   tensor cycles of GEMMs and 1024 MUFU cycles of exponentials (a cycle model): the
   exponentials fit under the other warpgroup's GEMMs only if they never wait behind them.
2. Persistence. One CTA per SM walks many tiles (common.schedule). The K/V rings keep streaming
   across tile boundaries, and O leaves through its own shared-memory buffer, so the next tile's
   Q and first K land while this tile's last P V and epilogue run, instead of a one-tile CTA
   paying its pipeline fill and its epilogue with the tensor cores idle.
3. Which CTA computes which tile is one choice, ``config.schedule``: causal tiles go longest
   first in sections of heads whose K and V fit in L2, each CTA taking its next tile from a
   global counter when its producer has issued the current one's loads ("dynamic",
   Note [Dynamic tiles]); or handed out by a table the host builds per shape with list
   scheduling ("table", Note [Tile table]); or in fixed zigzag rounds ("zigzag"), which only
   balance the unsectioned order; or one CTA per tile ("grid"). Equal tiles (not causal) come
   from the table, whose last, partial round is cut along the keys so that every SM ends
   together ("split_tail", Note [Split tail]): a piece leaves its partial O and row statistics in
   a workspace and the tile's last piece merges.
4. O rescaled at the next P V's issue, off the softmax's critical path
   (Note [Where O is rescaled]), a fresh S accumulator per step (ptxas serialises the wgmma
   otherwise, for lack of registers), and a three-deep K ring next to the O buffer within the
   227 KB (config.smem_bytes).
5. Varlen, a compile-time variant (``varlen=True``): packed sequences in one launch. Only the
   tile lookup (common.seqlens, schedule.varlen_locate), the TMA tiles' origin (a domain offset
   per sequence) and the store of a sequence's partial last tile (Note [Varlen epilogue]) differ;
   its tiles come from the same counter (a CTA may find none: the grid is sized from a bound, the
   exact count is known only on the device). The dense variant's code is what it was without
   the flag.

Which of these pay, and by how much, is measured, not claimed here (fa4_final.hopper.defaults
says what each default rests on). Everything the Blackwell kernel can share is shared: tile
ranges (tiles), masks (mask), the online softmax with the exp2 emulation and rescale-threshold
knobs (softmax, fast_math) and the tile order (schedule).
"""

from __future__ import annotations

from enum import IntEnum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from fa4_final.common.constants import LOG2_E, THREADS_PER_WARPGROUP, WARP_SIZE
from fa4_final.common.fragments import (
    acc_as_a_operand,
    acc_rows_cols,
    select_modes,
    to_16bit_pairs,
)
from fa4_final.common.mask import apply_mask, fragment_coords
from fa4_final.common.pipelines import PipelineSpec, tma_async_pipeline
from fa4_final.common.register_plan import check_role_registers
from fa4_final.common.schedule import (
    SPLIT_FIELDS,
    TILE_SLOTS,
    WHOLE_TILE_KEYS,
    fetch_tile,
    lane_here,
    publish_tile,
    read_tile,
    rounds,
    table_rounds,
    zigzag_tile,
)
from fa4_final.common.seqlens import Sequences, store_rows
from fa4_final.common.softmax import OnlineSoftmax, check_softcap, softcap_scores
from fa4_final.common.tiles import TileWindow, clip_range, kv_tile_range
from fa4_final.common.timeline import Mark, mark
from fa4_final.hopper.config import HopperFwdConfig
from fa4_final.hopper.wgmma import (
    attention_fragments,
    attention_tiled_mmas,
    issue_wgmma,
    smem_tile_layout,
)


class NamedBarrier(IntEnum):
    """Hardware named barriers (bar.sync id); id 0 is __syncthreads."""

    EPILOGUE = 1  # all consumer threads: the O buffer is free / full
    TURN_WG0 = 2  # TURN_WG0 + w: consumer warpgroup w may issue its wgmma (ping-pong)


class HopperForward:
    """Attention forward, one (tile_m, D) block of O per tile, tiles walked by persistent CTAs.

    Roles (data, ``self.roles``):
      warpgroup 0      producer: warp 0 issues every TMA load; the others only give registers
      warpgroups 1..n  consumers: wgmma S = Q K^T, mask, online softmax, wgmma O += P V, epilogue

    Pipelines (producer -> consumer), data as on Blackwell: ``pipelines()``, one
    common.pipelines.PipelineSpec each, from which the kernel builds its rings. An EMPTY barrier
    completes with one arrive per consumer warp, a FULL one with the producer's arrive carrying
    the TMA byte count: q (1 stage), k (stages_k), v (stages_v).
    """

    def __init__(self, dtype, head_dim: int, causal: bool, config: HopperFwdConfig,
                 has_window_left: bool = False, has_window_right: bool = False,
                 varlen: bool = False, has_seqused_k: bool = False, softcap: float = 0.0,
                 sink_dtype=None, head_dim_v: int | None = None, has_seqused_q: bool = False):
        # Note [Head dims] (fa4_final.hopper.config): dv of V and O, D if None
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        config.check(head_dim, head_dim_v)
        # Note [Softcap] and Note [Learnable sink] (fa4_final.common.softmax): compile-time
        # variants; 0.0 and False compile exactly the kernel without them
        # named so that no subclass's own softcap attribute switches this build on
        self.logit_softcap = check_softcap(softcap)
        self.sink_dtype = sink_dtype  # the learnable sink's element type, or None: no sink
        self.has_sink = sink_dtype is not None
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = bool(causal)
        self.cfg = config
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.num_wgs = config.num_consumer_wgs
        self.window = TileWindow(self.tile_m, self.tile_n, self.causal,
                                 has_left=bool(has_window_left),
                                 has_right=bool(has_window_right) and not self.causal)
        self.producer_regs, self.consumer_regs = config.registers
        # varlen: packed sequences (fa4_final.common.seqlens); a separate compiled variant, so the
        # dense kernel's code is exactly what it is without this flag
        self.varlen = bool(varlen)
        self.has_seqused_k = self.varlen and bool(has_seqused_k)
        # Note [Used query rows] (fa4_final.common.seqlens): a varlen variant of its own
        self.has_seqused_q = self.varlen and bool(has_seqused_q)
        # the table needs each tile's cost before the launch: dense only (varlen's costs are in
        # device memory, and reading them back would cost a sync)
        if self.varlen and config.uses_table:
            raise ValueError(f"schedule={config.schedule!r} hands out tiles from a table the host "
                             f"builds from their costs, which a varlen launch has only on the "
                             f"device: take 'dynamic', 'zigzag' or 'grid'")
        self.use_table = config.uses_table
        # Note [Split tail] (fa4_final.common.schedule): the table's entries carry key ranges, and a
        # tile cut into pieces is merged by its last piece
        self.split = self.use_table and config.splits_tail
        # Note [Dynamic tiles] (fa4_final.common.schedule): dense and varlen alike (the tile count
        # is known on the device; a varlen CTA may find none: Note [Varlen order])
        self.dynamic = config.schedules_dynamically
        self.num_consumer_threads = THREADS_PER_WARPGROUP * self.num_wgs
        self.num_threads = THREADS_PER_WARPGROUP + self.num_consumer_threads
        self.roles = {
            "producer": {"warpgroups": (0,), "tma_warp": 0, "registers": self.producer_regs},
            "consumer": {"warpgroups": tuple(range(1, self.num_wgs + 1)),
                         "registers": self.consumer_regs},
        }
        check_role_registers(self.roles, self.num_threads)  # per SM sub-partition

    def pipelines(self) -> tuple[PipelineSpec, ...]:
        """The producer -> consumer rings (Note [Forward phases]): FULL completes with the TMA
        warp's one arrive carrying the byte count, EMPTY with one arrive per consumer warp."""
        warps = self.num_consumer_threads // WARP_SIZE
        return (
            PipelineSpec("q", "Q of the current tile; released after its last Q K^T",
                         "tma_async", 1, "producer", "consumer", 1, warps),
            PipelineSpec("k", "K tiles, visited from the highest n_block down", "tma_async",
                         self.cfg.stages_k, "producer", "consumer", 1, warps),
            PipelineSpec("v", "V tiles, in K's order", "tma_async", self.cfg.stages_v,
                         "producer", "consumer", 1, warps),
        )

    def cache_key(self) -> tuple:
        key = (type(self).__name__, self.dtype.__name__, self.head_dim, self.causal,
               self.window, self.cfg)
        if self.head_dim_v != self.head_dim:
            key = key + (("head_dim_v", self.head_dim_v),)
        key = key + (("varlen", self.has_seqused_k),) if self.varlen else key
        if self.has_seqused_q:
            key = key + (("seqused_q",),)
        if self.logit_softcap:
            key = key + (("softcap", self.logit_softcap),)
        return key + (("sink", self.sink_dtype.__name__),) if self.has_sink else key

    def fields(self) -> int:
        """int32 per table entry: the tile, or (Note [Split tail]) the tile and its piece."""
        return SPLIT_FIELDS if self.split else 1

    def rounds(self, num_tiles, grid, mTileTable):
        """Rounds of the persistent tile loop: fixed (zigzag) or the table's."""
        if const_expr(mTileTable is None):
            return rounds(num_tiles, grid)
        return table_rounds(mTileTable.shape[0] // self.fields(), grid)

    def tile_of(self, r, cta, grid, mTileTable):
        """Linear tile of CTA ``cta`` in round ``r``: zigzag rounds, or the table's entry
        (Note [Tile table]); >= num_tiles means none."""
        if const_expr(mTileTable is None):
            return zigzag_tile(r, cta, grid)
        return mTileTable[(r * grid + cta) * self.fields()]

    @cute.jit
    def walk_tiles(self, num_tiles: Int32, cta: Int32, grid: Int32, mTileTable, state_q,
                   state_k, state_v, visit):
        """The persistent tile loop of fixed rounds, the producer's and the consumers' alike:
        ``visit(tile, r, last, state_q, state_k, state_v)`` for each tile of CTA ``cta`` in
        order (zigzag rounds, or the table's), returning the rings' states, which the loop
        carries to the next tile. ``last``: no tile follows in this CTA (Note [Turns])."""
        for r in cutlass.range(self.rounds(num_tiles, grid, mTileTable), unroll=1):
            tile = self.tile_of(r, cta, grid, mTileTable)
            if tile < num_tiles:
                last = self.tile_of(r + 1, cta, grid, mTileTable) >= num_tiles
                state_q, state_k, state_v = visit(tile, r, last, state_q, state_k, state_v)

    def piece_of(self, r, cta, grid, mTileTable):
        """(first key tile, end key tile, slot, first slot of the tile, pieces of the tile) of
        CTA ``cta``'s round ``r`` (Note [Split tail]); a whole tile: (0, 2^30, -1, 0, 0)."""
        if const_expr(not self.split):
            return Int32(0), Int32(WHOLE_TILE_KEYS), Int32(-1), Int32(0), Int32(0)
        at = (r * grid + cta) * SPLIT_FIELDS
        return tuple(mTileTable[at + f] for f in range(1, SPLIT_FIELDS))

    # ------------------------------------------------------------------------------------------
    # host side: layouts, TMA descriptors, shared storage, grid, launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, D)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, dv)
        mO: cute.Tensor,  # (batch, seqlen_q, heads, dv)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) float32
        mTL: cute.Tensor,  # (1 + consumer warpgroups, MAX_STEPS, MARKS) int64: Note [Timeline]
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        l2_group: Int32,  # causal tile order: (head, batch) pairs per section (scheduler)
        max_ctas: Int32,  # persistent grid size: the SM count
        mCuSeqlensQ: cute.Tensor | None,  # varlen: (batch + 1,) int32; dense: None
        mCuSeqlensK: cute.Tensor | None,  # varlen: (batch + 1,) int32; dense: None
        mSeqUsedK: cute.Tensor | None,  # varlen with seqused_k: (batch,) int32; else None
        mTileTable: cute.Tensor | None,  # a table schedule: (rounds + 1) * grid entries
        mPartO: cute.Tensor | None,  # split tail: (slots, O elements, threads) float32
        mPartML: cute.Tensor | None,  # split tail: (slots, 2 * rows, threads) float32
        mCounters: cute.Tensor | None,  # split tail: (slots,) int32, zero before the launch
        mTileCounter: cute.Tensor | None,  # "dynamic": (1,) int32, zero before the launch
        stream,
        mSink: cute.Tensor | None = None,  # has_sink: (heads,) fp32/fp16/bf16 logits; else None
        mSeqUsedQ: cute.Tensor | None = None,  # varlen with seqused_q: (batch,) int32; else None
    ):
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type
                           == mO.element_type == self.dtype)):
            raise TypeError(f"q, k, v, out must all be {self.dtype}")
        if const_expr(mLSE.element_type != Float32):
            raise TypeError("lse must be float32")
        if const_expr(self.varlen != (mCuSeqlensQ is not None and mCuSeqlensK is not None)
                      or self.has_seqused_k != (mSeqUsedK is not None)):
            raise TypeError("cu_seqlens_q/k (and seqused_k) are given exactly to the varlen "
                            "variant (varlen=True, has_seqused_k=True)")
        if const_expr(self.use_table != (mTileTable is not None)):
            raise TypeError("the tile table is given exactly to a build whose schedule is "
                            "'table' or 'split_tail' (Note [Tile table])")
        if const_expr(any((t is not None) != self.split for t in (mPartO, mPartML, mCounters))):
            raise TypeError("the split-tail workspace (partial O, row stats, counters) is given "
                            "exactly to a build whose schedule is 'split_tail' "
                            "(Note [Split tail])")
        if const_expr(self.dynamic != (mTileCounter is not None)):
            raise TypeError("the tile counter is given exactly to a build whose schedule is "
                            "'dynamic' (Note [Dynamic tiles])")
        if const_expr(self.has_seqused_q != (mSeqUsedQ is not None)):
            raise TypeError("seqused_q is given exactly to the varlen variant built with "
                            "has_seqused_q=True (Note [Used query rows])")
        if const_expr(self.has_sink != (mSink is not None)):
            raise TypeError("learnable_sink is given exactly to a build with a sink_dtype")
        if const_expr(self.has_sink and mSink.element_type != self.sink_dtype):
            raise TypeError(f"learnable_sink must be {self.sink_dtype} in this build")
        # the kernel's scale_log2 argument: the softmax's scale in the log2 domain, or with a
        # softcap the multiplier of the scores before tanh (Note [Softcap])
        score_scale = softmax_scale * LOG2_E
        if const_expr(self.logit_softcap):
            score_scale = softmax_scale * Float32(1.0 / self.logit_softcap)
        # (b, s, h, d) -> (s, d, h, b): TMA boxes tile modes 0 and 1; head, batch pick the slab
        mQ, mK, mV, mO = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        mLSE = select_modes(mLSE, [2, 1, 0])  # (s, h, b)

        dv = self.head_dim_v
        tiled_mma_qk, tiled_mma_pv = attention_tiled_mmas(self.dtype, self.num_wgs, self.tile_n,
                                                          self.head_dim, dv)
        sQ_layout = smem_tile_layout(self.dtype, self.head_dim, self.tile_m)
        sO_layout = smem_tile_layout(self.dtype, dv, self.tile_m)
        sK_layout = smem_tile_layout(self.dtype, self.head_dim, self.tile_n, self.cfg.stages_k)
        sV_layout = smem_tile_layout(self.dtype, dv, self.tile_n, self.cfg.stages_v)
        sK_one = cute.select(sK_layout, mode=[0, 1])  # one stage: the TMA box
        sV_one = cute.select(sV_layout, mode=[0, 1])
        bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        bytes_k = cute.size_in_bytes(self.dtype, sK_one)
        bytes_v = cute.size_in_bytes(self.dtype, sV_one)
        # Note [Head dims]: O in its own buffer, or over Q's (no bytes of its own)
        o_elems = cute.cosize(sO_layout) if const_expr(self.cfg.separate_o) else 0

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.cfg.stages_k]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.cfg.stages_v]
            # Note [Split tail]: the count a tile's counter showed, for every consumer thread
            split_count: cute.struct.MemRange[Int32, 2]
            # Note [Dynamic tiles]: the tile ring's FULL and EMPTY barriers, and its slots
            mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * TILE_SLOTS]
            tile_slots: cute.struct.MemRange[Int32, TILE_SLOTS]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, o_elems], 1024]

        # the budget arithmetic of HopperFwdConfig.smem_bytes() is the struct's real size
        assert SharedStorage.size_in_bytes() == self.cfg.smem_bytes(
            self.head_dim, self.dtype.width // 8, head_dim_v=dv)

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(load, mQ, sQ_layout,
                                                        (self.tile_m, self.head_dim))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load, mK, sK_one,
                                                        (self.tile_n, self.head_dim))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(load, mV, sV_one, (self.tile_n, dv))
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (self.tile_m, dv))

        num_m_blocks = cute.ceil_div(mQ.shape[0], self.tile_m)
        num_tiles = num_m_blocks * mQ.shape[2] * mQ.shape[3]
        mO_rows = None
        if const_expr(self.varlen):
            # a batch of one packed (total_q) rows: at most one partial tile more per sequence
            # (bwd_tiles.varlen_grid_bound on the host). The exact count needs the offsets'
            # values; CTAs past it find no tile and exit.
            num_tiles = (num_m_blocks + mCuSeqlensQ.shape[0] - 1) * mQ.shape[2]
            mO_rows = mO  # the partial last tile of a sequence is stored without TMA
        grid = num_tiles
        if const_expr(self.cfg.persistent):
            grid = cutlass.min(num_tiles, max_ctas)
        self.kernel(
            tma_q, tma_k, tma_v, tma_o, mLSE, mTL,
            tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o,
            score_scale, window_left, window_right, l2_group,
            sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma_qk, tiled_mma_pv,
            bytes_q, bytes_k, bytes_v, SharedStorage, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mO_rows,
            mTileTable, mPartO, mPartML, mCounters, mTileCounter, mSink, mSeqUsedQ,
        ).launch(grid=(grid, 1, 1), block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA coordinate tensors: (s, D, h, b)
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,  # (s, h, b)
        mTL: cute.Tensor,
        tma_atom_q: cute.CopyAtom,
        tma_atom_k: cute.CopyAtom,
        tma_atom_v: cute.CopyAtom,
        tma_atom_o: cute.CopyAtom,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        l2_group: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        bytes_q: cutlass.Constexpr[int],
        bytes_k: cutlass.Constexpr[int],
        bytes_v: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mO_rows: cute.Tensor | None,  # varlen: out itself (s, D, h, b), for partial tiles
        mTileTable: cute.Tensor | None,  # Note [Tile table]
        mPartO: cute.Tensor | None,  # Note [Split tail]
        mPartML: cute.Tensor | None,
        mCounters: cute.Tensor | None,
        mTileCounter: cute.Tensor | None,  # Note [Dynamic tiles]
        mSink: cute.Tensor | None,  # Note [Learnable sink]
        mSeqUsedQ: cute.Tensor | None,  # Note [Used query rows]
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)

        # Note [Signalling lane]
        # Lane 0 of each consumer warp arrives on a ring's EMPTY barrier. The rings would read
        # the thread index for that themselves, and LLVM, which may re-read it anywhere, reads
        # it again every KV step: an S2R whose latency the next instruction waited out between
        # the V wait and the P V issue, while this warpgroup held its turn on the tensor cores
        # (ncu's stall samples, D = 64). With pin_lane the lane is read once by
        # lane_here, an asm LLVM may not repeat, and stays in a register. Only D = 64 causal
        # does so by default: elsewhere ptxas then scheduled the step worse than the stall
        # cost (hopper_fwd_default).
        lane = lane_here() if const_expr(self.cfg.pin_lane) else None
        mbar = {"q": storage.mbar_q, "k": storage.mbar_k, "v": storage.mbar_v}
        tx = {"q": bytes_q, "k": bytes_k, "v": bytes_v}
        pipes = {spec.name: tma_async_pipeline(spec, mbar[spec.name], tx[spec.name], lane)
                 for spec in self.pipelines()}
        pipeline_q, pipeline_k, pipeline_v = pipes["q"], pipes["k"], pipes["v"]
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (tile_m, D)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (n, D, STAGE)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (n, dv, STAGE)
        if const_expr(self.cfg.separate_o):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)  # (tile_m, dv)
        else:  # Note [Head dims]: O over Q, whose buffer is free once every Q K^T is done
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        tiles = None  # Note [Dynamic tiles]: (counter, FULL, EMPTY, slots)
        if const_expr(self.dynamic):
            full = storage.mbar_tile.data_ptr()
            tiles = (mTileCounter, full, full + TILE_SLOTS,
                     storage.tile_slots.get_tensor(cute.make_layout(TILE_SLOTS)))
            if warp_idx == 0:
                with cute.arch.elect_one():
                    for s in cutlass.range_constexpr(TILE_SLOTS):
                        cute.arch.mbarrier_init(full + s, 1)
                        cute.arch.mbarrier_init(full + TILE_SLOTS + s,
                                                self.num_consumer_threads)
                cute.arch.mbarrier_init_fence()
        # mbarrier inits (warp 0) must be visible to every thread before anyone waits on them
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        seqs = lambda: Sequences(  # noqa: E731  (built where used: the dense code stays as it was)
            self.tile_m, self.causal, mQ.shape[0], mK.shape[0], mQ.shape[2], mQ.shape[3],
            l2_group, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSeqUsedQ)
        if warp_idx < THREADS_PER_WARPGROUP // WARP_SIZE:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == self.roles["producer"]["tma_warp"]:
                self.load(mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v,
                          pipeline_q, pipeline_k, pipeline_v, window_left, window_right,
                          seqs(), mTL, mTileTable, tiles)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            split = None
            if const_expr(self.split):
                split = (mPartO, mPartML, mCounters, storage.split_count.get_tensor(
                    cute.make_layout(2)))
            self.consume(mO, mLSE, mTL, sQ, sK, sV, sO, tma_atom_o, tiled_mma_qk, tiled_mma_pv,
                         pipeline_q, pipeline_k, pipeline_v, scale_log2, window_left,
                         window_right, seqs(), mO_rows, mTileTable, split, tiles, mSink)

    # Note [Forward phases]
    # Each stage has a FULL and an EMPTY mbarrier; PipelineState walks a ring (index = count %
    # stages, the phase bit flips at each wrap). The producer waits EMPTY with the opposite
    # parity, so its first lap passes at once. Both roles walk the same tiles in the same order
    # and take n_tiles from kv_tile_range() with the same arguments, so every FULL that a
    # consumer waits on is filled: per tile the producer issues
    #     K[n-1], Q, then for t = n-2 .. 0: K[t], V[t+1]; then V[0]
    # (only Q when the tile sees no key) and the consumers read K[n-1], ..., K[0] and V[n-1],
    # ..., V[0]. The rings' states carry over from tile to tile. No deadlock: K[t] needs the
    # release of K[t + stages_k], which the consumers give before they wait for K[t] or V[t+1];
    # Q of the next tile needs this tile's Q released, which happens after its last Q K^T, and
    # by then every K and V this tile reads is already issued.

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v, pipeline_q,
             pipeline_k, pipeline_v, window_left: Int32, window_right: Int32, seqs: Sequences,
             tl: cute.Tensor, mTileTable: cute.Tensor | None, tiles=None):
        """Producer warp: Q and the K/V tiles of every tile this CTA computes
        (Note [Forward phases]); with ``tiles``, the tiles it takes at run time
        (Note [Dynamic tiles])."""
        num_tiles = seqs.num_tiles()
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.cfg.stages_k)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.cfg.stages_v)
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        record = (bidx == 0) & (cute.arch.lane_idx() == 0)
        if const_expr(tiles is not None):
            counter, full, empty, slots = tiles
            tile, r = Int32(bidx), Int32(0)
            while tile < num_tiles:
                publish_tile(full, empty, slots, r, tile)
                n_lo, n_hi, _, _, _ = self.piece_of(r, bidx, grid, mTileTable)  # whole tiles
                state_q, state_k, state_v = self.load_tile(
                    tile, mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v, pipeline_q,
                    pipeline_k, pipeline_v, state_q, state_k, state_v, window_left,
                    window_right, seqs, tl, record & (r == 0), n_lo, n_hi)
                tile = fetch_tile(counter, grid, num_tiles)  # after the loads: as late as can be
                r = r + 1
            publish_tile(full, empty, slots, r, tile)  # past the last: every consumer stops
        else:
            load_step = lambda tile, r, last, sq, sk, sv: self.load_tile(  # noqa: E731
                tile, mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v, pipeline_q,
                pipeline_k, pipeline_v, sq, sk, sv, window_left, window_right, seqs, tl,
                record & (r == 0), *self.piece_of(r, bidx, grid, mTileTable)[:2])
            self.walk_tiles(num_tiles, bidx, grid, mTileTable, state_q, state_k, state_v,
                            load_step)

    @cute.jit
    def load_tile(self, tile, mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v,
                  pipeline_q, pipeline_k, pipeline_v, state_q, state_k, state_v,
                  window_left: Int32, window_right: Int32, seqs: Sequences, tl, record,
                  n_lo: Int32, n_hi: Int32):
        """Q and the K/V tiles of one tile (or of its piece n_lo <= n < n_hi:
        Note [Split tail]), in the order of Note [Forward phases]."""
        w = seqs.tile(tile)
        m_block, head = w.m_block, w.head
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        n_min, n_max, n_top, n_bottom = self.key_tiles(seqs, w, window_left, window_right, n_lo,
                                                       n_hi)
        # (tile_m, D); (tile_n, D, n_tiles) of this (sequence, head)
        gQ = cute.local_tile(seqs.rows_q(mQ, w, head), (self.tile_m, self.head_dim),
                             (m_block, 0))
        gK = cute.local_tile(seqs.rows_k(mK, w, head_kv), (self.tile_n, self.head_dim),
                             (None, 0))
        gV = cute.local_tile(seqs.rows_k(mV, w, head_kv), (self.tile_n, self.head_dim_v),
                             (None, 0))
        # TMA partitions: (TMA,) for Q; (TMA, STAGE) in smem and (TMA, n_tiles) for K, V
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, cute.make_layout(1),
                                           cute.group_modes(sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_k, 0, cute.make_layout(1),
                                           cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_v, 0, cute.make_layout(1),
                                           cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))

        n_tiles = n_max - n_min
        timeline = self.cfg.timeline
        if n_tiles > 0:  # K first, so the first GEMM's operand is on its way early
            mark(timeline, tl, record, 0, 0, Mark.WAIT)
            state_k = self.load_one(tma_atom_k, tKgK, tKsK, n_max - 1, pipeline_k, state_k)
        pipeline_q.producer_acquire(state_q)
        cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(state_q))
        state_q.advance()
        if n_tiles > 0:
            for i in cutlass.range(n_tiles - 1, unroll=1):
                n_block = n_max - 2 - i
                mark(timeline, tl, record, 0, i + 1, Mark.WAIT)
                state_k = self.load_one(tma_atom_k, tKgK, tKsK, n_block, pipeline_k, state_k)
                state_v = self.load_one(tma_atom_v, tVgV, tVsV, n_block + 1, pipeline_v,
                                        state_v)
            state_v = self.load_one(tma_atom_v, tVgV, tVsV, n_min, pipeline_v, state_v)
        return state_q, state_k, state_v

    @cute.jit
    def key_tiles(self, seqs: Sequences, w, window_left: Int32, window_right: Int32,
                  n_lo: Int32, n_hi: Int32):
        """(n_min, n_max, n_top, n_bottom) of tile ``w``: its key tiles (tiles.kv_tile_range),
        cut to its piece [n_lo, n_hi) (Note [Split tail]), none when it lies wholly in its
        sequence's padding rows (Note [Used query rows]). The producer and the consumers both
        take their walk from here (Note [Forward phases])."""
        n_min, n_max, n_top, n_bottom = kv_tile_range(self.window, w.m_block, w.seqlen_q,
                                                      w.seqlen_k, window_left, window_right)
        if const_expr(self.split):
            n_min, n_max, n_top, n_bottom = clip_range(n_min, n_max, n_top, n_bottom, n_lo,
                                                       n_hi)
        if const_expr(self.has_seqused_q):
            if seqs.tile_past_used_rows(w):
                n_max = n_min
        return n_min, n_max, n_top, n_bottom

    @cute.jit
    def load_one(self, tma_atom, tXgX, tXsX, n_block, pipe, state):
        """Wait for a free stage, arm its FULL barrier with the byte count, start the TMA copy
        of tile ``n_block`` into it. Returns the advanced state (the loops carry it)."""
        pipe.producer_acquire(state)
        cute.copy(tma_atom, tXgX[None, n_block], tXsX[None, state.index],
                  tma_bar_ptr=pipe.producer_get_barrier(state))
        state.advance()
        return state

    # Note [Turns]
    # Ping-pong: consumer warpgroups take turns *issuing* wgmma; the GEMMs then run on the tensor
    # cores while the issuer does its softmax. A turn of warpgroup w starts with bar.sync on named
    # barrier TURN_WG0 + w and ends, once its wgmma are issued, with bar.arrive on the next
    # warpgroup's barrier (256 participants: 128 that sync, 128 that arrive). Turns run in the
    # order (turn 0, wg 0), (0, 1), ..., (1, 0), ... over every tile of the CTA: all warpgroups
    # of a CTA compute the same tiles, so they take the same number of turns, and a tile that
    # sees no key still takes one empty turn so the count never depends on the data. The first
    # turn of warpgroup 0 has nobody before it and does not wait; the last turn of the last
    # warpgroup has nobody after it and does not arrive: every barrier then sees as many
    # arrive-halves as sync-halves and none is left pending when the CTA exits.
    # With dynamic tiles (Note [Dynamic tiles]) no turn knows it is the last: the last one
    # arrives too, and warpgroup 0 syncs once more after its tile loop to take that arrive.

    @cute.jit
    def turn_begin(self, wg: Int32, first_of_cta):
        if const_expr(self.cfg.pingpong):
            if (wg > 0) | (not first_of_cta):
                cute.arch.barrier(barrier_id=int(NamedBarrier.TURN_WG0) + wg,
                                  number_of_threads=2 * THREADS_PER_WARPGROUP)

    @cute.jit
    def turn_end(self, wg: Int32, last_of_cta):
        if const_expr(self.cfg.pingpong):
            if (wg < self.num_wgs - 1) | (not last_of_cta):
                next_wg = wg + 1
                if next_wg == self.num_wgs:
                    next_wg = Int32(0)
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TURN_WG0) + next_wg,
                                         number_of_threads=2 * THREADS_PER_WARPGROUP)

    @cute.jit
    def turn(self, wg: Int32, first_of_cta, last_of_cta, issue):
        """One ping-pong turn of warpgroup ``wg`` (Note [Turns]): wait for it, ``issue()`` the
        warpgroup's GEMMs, hand the turn to the next warpgroup. ``first_of_cta`` /
        ``last_of_cta``: this is the CTA's very first / very last turn."""
        self.turn_begin(wg, first_of_cta)
        issue()
        self.turn_end(wg, last_of_cta)

    def wgmma(self, tiled_mma, acc, tA, tB, accumulate):
        issue_wgmma(tiled_mma, acc, tA, tB, accumulate)

    @cute.jit
    def store_p(self, s: cute.Tensor, tOrP: cute.Tensor):
        """P = S in the input dtype, as P V's register A operand: converted as one vector where
        the compiler keeps it in 32-bit pairs (tile_n a multiple of 64), pair by pair elsewhere
        (Note [Pairwise conversion] in fa4_final.common.fragments)."""
        if const_expr(self.tile_n % 64 == 0):
            tOrP.store(acc_as_a_operand(s).load().to(self.dtype))
        else:
            to_16bit_pairs(acc_as_a_operand(s), tOrP)

    @cute.jit
    def consume(self, mO, mLSE, tl, sQ, sK, sV, sO, tma_atom_o, tiled_mma_qk, tiled_mma_pv,
                pipeline_q, pipeline_k, pipeline_v, scale_log2: Float32, window_left: Int32,
                window_right: Int32, seqs: Sequences, mO_rows: cute.Tensor | None,
                mTileTable: cute.Tensor | None, split, tiles=None, mSink=None):
        """Consumer warpgroups: every tile (or piece of one: Note [Split tail]; ``split`` is
        then its workspace) of this CTA, then the O store's tail. ``tiles``: the ring the
        producer hands the tiles through (Note [Dynamic tiles]). ``mSink``: the heads' sink
        logits (Note [Learnable sink]). With a softcap, ``scale_log2`` carries the scores'
        multiplier before tanh (Note [Softcap])."""
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - THREADS_PER_WARPGROUP  # 0 .. num_consumer_threads - 1
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        # A and B descriptors per warpgroup, C fragments per thread
        (thr_mma_qk, thr_mma_pv, tSrQ, tSrK, tOrVt, acc_s, acc_o, tOrP) = attention_fragments(
            tiled_mma_qk, tiled_mma_pv, wg * THREADS_PER_WARPGROUP, tidx, sQ, sK, sV, self.tile_m,
            self.tile_n, self.head_dim_v, self.cfg.stages_v, self.dtype)
        tScS, t0ScS = fragment_coords(thr_mma_qk, (self.tile_m, self.tile_n))
        cap = None  # Note [Softcap]: scores -> tanh(scores * scale / softcap), in place
        if const_expr(self.logit_softcap):
            cap_scale = scale_log2
            cap = lambda acc: softcap_scores(acc, cap_scale)  # noqa: E731
            scale_log2 = Float32(self.logit_softcap * LOG2_E)
        softmax = OnlineSoftmax(scale_log2, cute.size(acc_rows_cols(acc_o), mode=[0]),
                                self.cfg.exp2_emulation_fraction, self.cfg.rescale_threshold,
                                skip_unchanged=self.cfg.rescale_skip_unchanged)

        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.cfg.stages_k)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.cfg.stages_v)
        num_tiles = seqs.num_tiles()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        record = (bidx == 0) & (tidx % THREADS_PER_WARPGROUP == 0)  # Note [Timeline]
        tile_step = lambda tile, r, last, piece, sq, sk, sv: self.consume_tile(  # noqa: E731
            tl, record & (r == 0), tile, r == 0, last, mO, mLSE, sO, tma_atom_o, tiled_mma_qk,
            tiled_mma_pv, thr_mma_pv, wg, tidx, acc_s, acc_o, tOrP, tSrQ, tSrK, tOrVt, tScS,
            t0ScS, softmax, pipeline_q, pipeline_k, pipeline_v, sq, sk, sv, window_left,
            window_right, seqs, mO_rows, piece, split, cap, mSink)
        if const_expr(tiles is not None):
            _, full, empty, slots = tiles
            r = Int32(0)
            tile = read_tile(full, empty, slots, r)
            while tile < num_tiles:
                # not known to be the last: every turn hands on (Note [Dynamic tiles]); whole
                # tiles (no table, so no split)
                state_q, state_k, state_v = tile_step(
                    tile, r, False, self.piece_of(r, bidx, grid, mTileTable), state_q, state_k,
                    state_v)
                r = r + 1
                tile = read_tile(full, empty, slots, r)
            if (wg == 0) & (r > 0):  # the turn the last warpgroup's last arrive opened
                self.turn_begin(wg, False)
        else:
            self.walk_tiles(num_tiles, bidx, grid, mTileTable, state_q, state_k, state_v,
                            lambda tile, r, last, sq, sk, sv: tile_step(
                                tile, r, last, self.piece_of(r, bidx, grid, mTileTable), sq, sk,
                                sv))
        if tidx == 0:  # shared memory must outlive the last O store's reads of it
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def consume_tile(self, tl, record, tile, first_tile, last_tile, mO, mLSE, sO, tma_atom_o,
                     tiled_mma_qk, tiled_mma_pv, thr_mma_pv, wg, tidx, acc_s, acc_o, tOrP, tSrQ,
                     tSrK, tOrVt, tScS, t0ScS, softmax, pipeline_q, pipeline_k, pipeline_v,
                     state_q, state_k, state_v, window_left, window_right, seqs, mO_rows,
                     piece, split, cap=None, mSink=None):
        """One tile: its KV loop and its epilogue. ``first_tile`` / ``last_tile``: of this
        CTA (Note [Turns]). ``piece``: its key range and slot (Note [Split tail]). ``cap``:
        the softcap of a score tile, ``mSink`` the sink logits (both None when not built)."""
        w = seqs.tile(tile)
        m_block, head, seqlen_q, seqlen_k = w.m_block, w.head, w.seqlen_q, w.seqlen_k
        sink = None  # read before the KV loop, so its latency hides behind it
        if const_expr(mSink is not None):
            sink = Float32(mSink[head])
        n_lo, n_hi, slot, first_slot, pieces = piece
        n_min, n_max, n_top, n_bottom = self.key_tiles(seqs, w, window_left, window_right, n_lo,
                                                       n_hi)
        n_tiles = n_max - n_min
        softmax.reset()
        acc_o.fill(0.0)
        mask = lambda acc, i, left: apply_mask(  # noqa: E731  (i: visit index, n = n_max-1-i)
            acc, tScS, t0ScS, self.window, m_block, n_max - 1 - i, seqlen_q, seqlen_k,
            window_left, window_right, mask_left=left)
        pipeline_q.consumer_wait(state_q)
        if n_tiles > 0:
            if const_expr(self.cfg.intra_wg_overlap):
                state_k, state_v = self.mainloop_overlap(
                    tl, record, wg, first_tile, last_tile, n_tiles, n_top, n_bottom, mask, cap,
                    softmax,
                    acc_s, acc_o, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv,
                    pipeline_q, pipeline_k, pipeline_v, state_q, state_k, state_v)
            else:
                state_k, state_v = self.mainloop_serial(
                    wg, first_tile, last_tile, n_tiles, n_top, n_bottom, mask, cap, softmax,
                    acc_s, acc_o, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv,
                    pipeline_q, pipeline_k, pipeline_v, state_q, state_k, state_v)
        else:  # no visible key: out = 0, and one empty turn keeps the turn count fixed
            acc_o.fill(0.0)
            self.turn(wg, first_tile, last_tile, lambda: None)
            if const_expr(self.cfg.separate_o):
                pipeline_q.consumer_release(state_q)
        gO_rows = None  # varlen: out's own rows of this sequence and head (Note [Varlen epilogue])
        if const_expr(mO_rows is not None):
            gO_rows = seqs.rows_q(mO_rows, w, head)
        gO_all, gLSE_all = seqs.rows_q(mO, w, head), seqs.rows_q(mLSE, w, head)
        if const_expr(self.split):
            # a whole tile stores out; a piece only when it is the tile's last
            store = cutlass.Boolean(True)
            if slot >= 0:
                store = self.merge_pieces(acc_o, softmax, split, tidx, slot, first_slot, pieces)
            if store:
                self.epilogue(acc_o, softmax, gO_all, gLSE_all, sO, tma_atom_o, thr_mma_pv, tidx,
                              m_block, seqlen_q, gO_rows, sink)
        else:
            self.epilogue(acc_o, softmax, gO_all, gLSE_all, sO, tma_atom_o, thr_mma_pv, tidx,
                          m_block, seqlen_q, gO_rows, sink)
        if const_expr(not self.cfg.separate_o):
            # Note [Head dims]: Q's buffer held O until the store has read it; then the next
            # tile's Q may land there (a piece that stored nothing passes straight through)
            if tidx // WARP_SIZE == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE),
                              number_of_threads=self.num_consumer_threads)
            pipeline_q.consumer_release(state_q)
        state_q.advance()
        return state_q, state_k, state_v

    @cute.jit
    def mainloop_overlap(self, tl, record, wg, first_tile, last_tile, n_tiles, n_top, n_bottom,
                         mask, cap,
                         softmax, acc_s, acc_o, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk,
                         tiled_mma_pv, pipeline_q, pipeline_k, pipeline_v, state_q, state_k,
                         state_v):
        """Turn 0: S for the first KV tile. Turns 1 .. n-1: S_{j+1} = Q K_{j+1}^T and O += P_j
        V_j in flight together, the softmax of S_{j+1} under P_j V_j. Turn n: the last P V."""
        timeline, role = self.cfg.timeline, wg + 1
        mark(timeline, tl, record, role, 0, Mark.WAIT)
        pipeline_k.consumer_wait(state_k)
        s = cute.make_rmem_tensor_like(acc_s)  # a fresh S each step: its registers die with P
        self.turn(wg, first_tile, False, lambda: (
            mark(timeline, tl, record, role, 0, Mark.ISSUE),
            self.wgmma(tiled_mma_qk, s, tSrQ, tSrK[None, None, None, state_k.index], False)))
        mark(timeline, tl, record, role, 0, Mark.ISSUED)
        warpgroup.wait_group(0)
        mark(timeline, tl, record, role, 0, Mark.S_READY)
        pipeline_k.consumer_release(state_k)
        state_k.advance()
        if const_expr(cap is not None):
            cap(s)  # before the mask: a masked score stays -inf (Note [Softcap])
        # the first tile visited holds the diagonal or the keys past seqlen_k: mask it always
        mask(s, 0, self.window.has_left)
        row_scale, rescale = softmax.update(s, is_first=True)
        self.store_p(s, tOrP)
        mark(timeline, tl, record, role, 0, Mark.P_READY)
        # alpha of the last softmax, applied to O when the next P V is issued
        # (Note [Where O is rescaled])
        pending = cute.make_rmem_tensor_like(row_scale)
        pending.store(row_scale.load())

        step = lambda i, masked, left, sk, sv, pend: self.overlap_step(  # noqa: E731
            tl, record, i, masked, left, wg, mask, cap, softmax, acc_s, acc_o, tOrP, tSrQ, tSrK,
            tOrVt, tiled_mma_qk, tiled_mma_pv, pipeline_k, pipeline_v, sk, sv, pending, pend)
        # Split the range, not the body: the tiles that need a mask, then those that do not,
        # then (sliding window) those masked on the left. Each loop runs one step function.
        top_end = 1  # without a causal diagonal or window only the first tile needs a mask
        if const_expr(self.window.masks_right):
            top_end = cutlass.max(cutlass.min(n_top, n_tiles), 1)
        bottom_start = cutlass.max(n_tiles - n_bottom, top_end)
        for i in cutlass.range(1, top_end, unroll=1):
            # a window narrower than a tile can cut a diagonal tile on both sides
            state_k, state_v, rescale = step(i, True, self.window.has_left, state_k, state_v,
                                             rescale)
        for i in cutlass.range(top_end, bottom_start, unroll=1):
            state_k, state_v, rescale = step(i, False, False, state_k, state_v, rescale)
        if const_expr(self.window.has_left):
            for i in cutlass.range(bottom_start, n_tiles, unroll=1):
                state_k, state_v, rescale = step(i, True, True, state_k, state_v, rescale)
        if const_expr(self.cfg.separate_o):
            pipeline_q.consumer_release(state_q)  # every Q K^T of this tile is done
        pipeline_v.consumer_wait(state_v)
        self.turn(wg, False, last_tile, lambda: self.issue_last_pv(
            softmax, acc_o, pending, rescale, tiled_mma_pv, tOrP, tOrVt, state_v))
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(state_v)
        state_v.advance()
        return state_k, state_v

    @cute.jit
    def issue_last_pv(self, softmax, acc_o, pending, rescale, tiled_mma_pv, tOrP, tOrVt,
                      state_v):
        """The last turn of a tile: O's pending rescale, then O += P_{n-1} V_{n-1}."""
        softmax.rescale_o(acc_o, pending, rescale)
        self.wgmma(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, state_v.index], True)

    # Note [Where O is rescaled]
    # O must be multiplied by alpha after the P V that accumulates into it has finished and
    # before the next P V adds to it. Three places were built and timed on the H200:
    #   after the softmax, as written in the algorithm: the D multiplies per row then sit on
    #     the warpgroup's critical path to its next turn;
    #   right after the row maxima and alpha, before the exponentials: the multiplies fill the
    #     issue slots between MUFU instructions (MUFU takes 8 cycles per warp instruction at
    #     16 exp/clk/SM, so most issue slots of the softmax are free);
    #   at the start of the next turn, between the S GEMM and the P V GEMM (this kernel): they
    #     run while the tensor cores are busy with S.
    # The other two were never faster beyond the run-to-run spread and at D = 128 often slower,
    # so the place is fixed and the knob went. The source order is a request: ptxas schedules.
    # What it makes of it, read off the SASS: it puts the wait for P V (the second
    # WARPGROUP.DEPBAR of the step) right before the first instruction that needs P V done,
    # whatever the source says: the first O multiply, the first F2FP into tOrP (P is
    # loop-carried: it goes into the registers P V is reading), or the arrive that frees the V
    # stage. Here that is the first F2FP, before any MUFU.EX2: at D = 128 none of the 64
    # exponentials runs under P V (FA4's sm90 kernel: 10), and the 64 O multiplies land between
    # the turn's bar.sync and its last HGMMA. Before the exponentials ptxas spreads the
    # multiplies late among them and 36 (causal: 66) run under P V. Two P buffers with the wait
    # moved to the next step do not escape this either: ptxas hoists that wait into the
    # previous step's softmax.

    @cute.jit
    def overlap_step(self, tl, record, i, masked: cutlass.Constexpr[bool],
                     left: cutlass.Constexpr[bool],
                     wg, mask, cap, softmax, acc_s, acc_o, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk,
                     tiled_mma_pv, pipeline_k, pipeline_v, state_k, state_v, pending,
                     pending_rescale):
        """One steady-state turn: issue S_i and P_{i-1} V_{i-1}, softmax S_i under the P V."""
        timeline, role = self.cfg.timeline, wg + 1
        mark(timeline, tl, record, role, i, Mark.WAIT)
        pipeline_k.consumer_wait(state_k)
        s = cute.make_rmem_tensor_like(acc_s)
        self.turn(wg, False, False, lambda: self.issue_step(
            tl, record, role, i, s, acc_o, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv,
            pipeline_v, state_k, state_v, softmax, pending, pending_rescale))
        mark(timeline, tl, record, role, i, Mark.ISSUED)
        warpgroup.wait_group(1)  # S is ready; P V may still be running
        mark(timeline, tl, record, role, i, Mark.S_READY)
        pipeline_k.consumer_release(state_k)
        state_k.advance()
        if const_expr(cap is not None):
            cap(s)
        if const_expr(masked):
            mask(s, i, left)
        row_scale, rescale, max_scaled = softmax.new_max(s, is_first=False)
        softmax.exponentiate(s, max_scaled, row_scale, is_first=False)
        warpgroup.wait_group(0)  # P V done: O, tOrP and the V stage are free again
        pipeline_v.consumer_release(state_v)
        state_v.advance()
        pending.store(row_scale.load())  # O's rescale waits for the next P V's issue
        self.store_p(s, tOrP)
        mark(timeline, tl, record, role, i, Mark.P_READY)
        return state_k, state_v, rescale

    @cute.jit
    def issue_step(self, tl, record, role, i, s, acc_o, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk,
                   tiled_mma_pv, pipeline_v, state_k, state_v, softmax, pending,
                   pending_rescale):
        """A steady turn's GEMMs: S_i = Q K_i^T, O's pending rescale (Note [Where O is rescaled]),
        then, once V has landed, O += P_{i-1} V_{i-1}."""
        mark(self.cfg.timeline, tl, record, role, i, Mark.ISSUE)
        self.wgmma(tiled_mma_qk, s, tSrQ, tSrK[None, None, None, state_k.index], False)
        softmax.rescale_o(acc_o, pending, pending_rescale)
        pipeline_v.consumer_wait(state_v)
        self.wgmma(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, state_v.index], True)

    @cute.jit
    def mainloop_serial(self, wg, first_tile, last_tile, n_tiles, n_top, n_bottom, mask, cap,
                        softmax, acc_s, acc_o, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk,
                        tiled_mma_pv, pipeline_q, pipeline_k, pipeline_v, state_q, state_k,
                        state_v):
        """Without intra-warpgroup overlap (the ablation): S, softmax, P V, one after another,
        two turns per KV tile."""
        for i in cutlass.range(n_tiles, unroll=1):
            pipeline_k.consumer_wait(state_k)
            self.turn(wg, first_tile & (i == 0), False, lambda: self.wgmma(
                tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, state_k.index], False))
            warpgroup.wait_group(0)
            pipeline_k.consumer_release(state_k)
            state_k.advance()
            if const_expr(self.cfg.separate_o):
                if i == n_tiles - 1:
                    pipeline_q.consumer_release(state_q)
            if const_expr(cap is not None):
                cap(acc_s)
            if (i < n_top) | (i >= n_tiles - n_bottom) | (i == 0):
                mask(acc_s, i, self.window.has_left)
            row_scale, rescale = softmax.update(acc_s, is_first=False)
            self.store_p(acc_s, tOrP)
            softmax.rescale_o(acc_o, row_scale, rescale)
            pipeline_v.consumer_wait(state_v)
            self.turn(wg, False, last_tile & (i == n_tiles - 1), lambda: self.wgmma(
                tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, state_v.index],
                i > 0))  # the first P V overwrites the uninitialised O
            warpgroup.wait_group(0)
            pipeline_v.consumer_release(state_v)
            state_v.advance()
        return state_k, state_v

    @cute.jit
    def merge_pieces(self, acc_o, softmax, split, tidx: Int32, slot: Int32, first_slot: Int32,
                     pieces: Int32):
        """A piece of a tile cut along the keys (Note [Split tail] in fa4_final.common.schedule):
        leave this piece's O, row max and row sum in its slot, count it on the tile's counter,
        and if it is the last, merge the other pieces into the registers (the online softmax's
        rescale, piece by piece). Returns whether this piece stores the tile. Every consumer
        thread reads the same count, so the answer is uniform over the CTA."""
        mPartO, mPartML, mCounters, sCount = split
        o = acc_rows_cols(acc_o)
        rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                mPartO[slot, r * cols + c, tidx] = o[r, c]  # a warp writes 128 B per element
            mPartML[slot, r, tidx] = softmax.row_max[r]
            mPartML[slot, rows + r, tidx] = softmax.row_sum[r]  # this thread's partial sum
        cute.arch.fence_acq_rel_gpu()  # the partial is visible before the count says so
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE),
                          number_of_threads=self.num_consumer_threads)
        if tidx == 0:
            sCount[0] = cute.arch.atomic_add(mCounters.iterator + first_slot, Int32(1),
                                             sem="acq_rel", scope="gpu")
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE),
                          number_of_threads=self.num_consumer_threads)
        last = sCount[0] == pieces - 1
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE),  # read before it is reused
                          number_of_threads=self.num_consumer_threads)
        if last:
            cute.arch.fence_acq_rel_gpu()  # the other pieces' partials, after their counts
            if tidx == 0:
                mCounters[first_slot] = Int32(0)  # ready for the next launch
            scale = softmax.scale_log2
            for other in cutlass.range(first_slot, first_slot + pieces, unroll=1):
                if other != slot:
                    for r in cutlass.range_constexpr(rows):
                        m_other = mPartML[other, r, tidx]
                        m_new = cute.arch.fmax(softmax.row_max[r], m_other)
                        # a row that saw no key in both: max -inf, merged against 0 (no NaN)
                        m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
                        keep = cute.math.exp2(softmax.row_max[r] * scale - m_safe * scale,
                                              fastmath=True)
                        take = cute.math.exp2(m_other * scale - m_safe * scale, fastmath=True)
                        softmax.row_sum[r] = (softmax.row_sum[r] * keep
                                              + mPartML[other, rows + r, tidx] * take)
                        softmax.row_max[r] = m_new
                        for c in cutlass.range_constexpr(cols):
                            o[r, c] = o[r, c] * keep + mPartO[other, r * cols + c, tidx] * take
        return last

    @cute.jit
    def epilogue(self, acc_o, softmax, gO_all, gLSE_all, sO, tma_atom_o, thr_mma_pv,
                 tidx: Int32, m_block: Int32, seqlen_q: Int32,
                 gO_rows: cute.Tensor | None = None, sink=None):
        """out = O / l and lse to global memory. O goes registers -> shared (stmatrix) -> one TMA
        store, which clips rows past seqlen_q; lse is written directly. Varlen (``gO_rows``):
        Note [Varlen epilogue]."""
        inv_sum, lse = softmax.finalize(sink)  # Note [Learnable sink]: folded in here
        o = acc_rows_cols(acc_o)
        for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
            for c in cutlass.range(cute.size(o, mode=[1]), unroll_full=True):
                o[r, c] = o[r, c] * inv_sum[r]
        rO = cute.make_rmem_tensor_like(acc_o, self.dtype)
        rO.store(acc_o.load().to(self.dtype))

        # lse: the thread holding column 0 of a row writes it
        tOcO = acc_rows_cols(thr_mma_pv.partition_C(
            cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
                row = m_block * self.tile_m + tOcO[r, 0][0]
                if row < seqlen_q:
                    gLSE_all[row] = lse[r]

        consumer_warp = tidx // WARP_SIZE
        # O has its own buffer up to D = 128. Writing O over Q's (a warpgroup's O rows are
        # exactly the bytes of its Q rows) frees a tile of shared memory for a deeper ring, but
        # the next tile's Q must then wait for this store, and timed on the H200 at D <= 128 it
        # was never faster beyond the spread; at larger head dims it is what makes the buffers
        # fit (Note [Head dims]). With its own buffer, the previous tile's O store must have
        # read it before it is rewritten; over Q, that wait came before Q's release. The
        # barrier: every consumer warpgroup's GEMMs of this tile are done
        if const_expr(self.cfg.separate_o):
            if tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE),
                          number_of_threads=self.num_consumer_threads)
        store_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_store = cute.make_tiled_copy_C(store_atom, thr_mma_pv).get_slice(tidx)
        cute.copy(store_atom, thr_store.retile(rO), thr_store.partition_D(sO))
        # generic-proxy smem writes -> visible to the TMA (async proxy), then all rows written
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE),
                          number_of_threads=self.num_consumer_threads)
        if const_expr(gO_rows is None):
            self.store_o_tma(sO, gO_all, tma_atom_o, m_block, consumer_warp)
        else:
            if (m_block + 1) * self.tile_m <= seqlen_q:
                self.store_o_tma(sO, gO_all, tma_atom_o, m_block, consumer_warp)
            else:
                gO = cute.local_tile(gO_rows, (self.tile_m, self.head_dim_v), (m_block, 0))
                store_rows(sO, gO, tidx, seqlen_q - m_block * self.tile_m,
                           self.num_consumer_threads)  # Note [Varlen epilogue]

    @cute.jit
    def store_o_tma(self, sO, gO_all, tma_atom_o, m_block: Int32, consumer_warp: Int32):
        """One TMA store of the (tile_m, dv) block of O, issued by the first consumer warp."""
        gO = cute.local_tile(gO_all, (self.tile_m, self.head_dim_v), (m_block, 0))
        tOsO, tOgO = cpasync.tma_partition(tma_atom_o, 0, cute.make_layout(1),
                                           cute.group_modes(sO, 0, 2),
                                           cute.group_modes(gO, 0, 2))
        if consumer_warp == 0:
            cute.copy(tma_atom_o, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()

    # Note [Varlen epilogue]
    # The TMA store clips at the tensor's end, total_q, not at the sequence's: the last, partial
    # tile of a sequence would overwrite the first rows of the next one. Full tiles keep the TMA
    # store; a partial tile goes from shared memory to global memory in 16-byte vectors, one
    # predicate per row (fa4_final.common.seqlens.store_rows, which the backward's partial dK and dV
    # tiles use too; at D = 128: 256 threads x 8 vectors, 16 rows per pass). FA4's own
    # answer keeps TMA for every tile: a tensor with one more mode, whose pointer shift and
    # domain offset make the descriptor's bound fall exactly at the sequence's end
    # (quack.copy_utils.offset_ragged_tensor); one partial tile per sequence did not seem worth
    # that here. The shared-memory reads are plain loads, finished before the thread passes the
    # next EPILOGUE barrier, so the buffer's reuse needs no bulk wait for them.

