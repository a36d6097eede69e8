"""Chapter 05: a FlashAttention-3 style forward for Hopper (sm_90a) in CuTe DSL.

What this adds over chapter 04 (Ampere-style: cp.async + mma.sync, every warp loads and computes):

1. TMA loads. One thread asks the TMA unit for a whole (128, 128) bf16 tile, 32 KB, with one
   ``cp.async.bulk.tensor``; with cp.async, 128 threads issued 2048 16-byte copies per tile and
   computed every address. The TMA unit also zero-fills rows past the end of the sequence and
   counts the bytes it wrote into an mbarrier, so "tile ready" is one wait, not a __syncthreads.
2. wgmma. ``wgmma.mma_async`` runs a 64 x N x 16 product for a whole warpgroup (4 warps), reads
   its B operand (and here A for QK^T) straight from swizzled shared memory and runs
   asynchronously: the warps keep issuing other work until they wait on the group. Hopper's tensor
   cores reach 4096 dense bf16 FLOP/clk/SM only through wgmma; mma.sync reaches about two
   thirds of it on the H200 (microbench.MmaSyncThroughput, results/h200/microbench.json).
   One (128 x 128) tile step at D = 128 is 2 GEMMs x 2 x 128^3 = 8.4 MFLOP: 2048 clk through
   wgmma, about 3100 at mma.sync's measured rate, while its 128 x 128 exponentials take 1024 clk
   on the 16 MUFU/clk/SM. So after wgmma the softmax is half of the GEMM time: it must overlap
   with it.
3. Warp specialisation. Freed from copying, the warps split into roles: one producer warp issues
   TMA, two (or three) consumer warpgroups each own 64 of the tile's query rows and do
   MMA + softmax. ``setmaxnreg`` moves registers from the producer (24 per thread) to the
   consumers (240), which hold S (64 fp32/thread), P (32 regs) and O (64 fp32/thread at D=128).
4. Overlap. Inside a warpgroup, the softmax of tile j runs while the wgmma of S_{j+1} = Q K_{j+1}^T
   and O += P_j V_j are in flight ("intra-warpgroup overlap"); across warpgroups, named barriers
   can make them take turns issuing wgmma ("ping-pong", FA3's schedule; off by default here,
   Note [Ping-pong] says why). Both are knobs in ``HopperConfig``. How much of the softmax
   really runs under P V is decided by ptxas's instruction scheduler, not by the source order:
   ``sass_overlap()`` counts it in the compiled kernel.

Shared memory (227 KB = 232448 B per CTA on H100/H200), D = 128, bf16, 128 x 128 tiles:
1 KB of mbarriers, Q 128 x 128 x 2 B = 32 KB, one K stage 32 KB, one V stage 32 KB; O reuses
Q's buffer. So stages = (227 - 1 - 32) // (32 + 32) = 3 fit; the default is FA4's 2 (161 KB),
3 is a knob to measure. ``smem_bytes()`` / ``max_stages()`` do this sum for any config, and the
kernel checks it against its SharedStorage struct at compile time.

The knobs of the next two chapters live in the same ``HopperConfig`` and enter the softmax at one
method each (``ch05_softmax.OnlineSoftmax``): ``exp2_emulation_fraction`` (chapter 06: a share of
the exponentials on the FMA pipe) and ``rescale_threshold`` (chapter 07: skip the O rescale
unless a warp's max grew by more than tau). Chapter 00's model predicts little from either on
Hopper at D = 128, where the tile is MMA-bound (2048 MMA cycles against 1024 of MUFU): time that
was already hidden under the GEMMs cannot be won back; at D = 64 the two tie (1024 each).

Measured speeds live in results/<gpu>/*.json, not here: ``python -m measure.benchmark``
(against the peers) and ``python -m measure.ch05_knobs`` (every knob, verified then timed:
results/<gpu>/ch05_knobs.json); labs/ch05_tuning.ipynb reads them.
"""

import argparse
import sys
import time
from dataclasses import dataclass, replace
from enum import IntEnum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import torch
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from fa4_final.common.constants import LOG2_E
from fa4_final.common.fragments import acc_as_a_operand, acc_rows_cols, select_modes
from fa4_final.common.mask import apply_mask, fragment_coords
from fa4_final.common.softmax import MAX_RESCALE_THRESHOLD, OnlineSoftmax, check_softmax_knobs  # noqa: F401  (re-exported for ch07 and tests)
from fa4_final.common.tiles import TileWindow, kv_tile_range
from fa4_final.common.tiles import visible_cols as window_visible_cols
from fa4_final.hopper.wgmma import (
    attention_tiled_mmas,
    issue_wgmma,
    smem_tile_layout,
)
from utils import checks

SMEM_BYTES_PER_CTA = 227 * 1024  # H100 / H200 opt-in maximum of dynamic shared memory per CTA
REGISTERS_PER_SM = 64 * 1024
THREADS_PER_WG = 128
WGMMA_M = 64  # rows of one wgmma; each consumer warpgroup owns this many query rows
SUPPORTED_HEAD_DIMS = (64, 128, 256)
TORCH_TO_CUTLASS = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}


# ================================ tuning knobs (one place) =====================================
@dataclass(frozen=True)
class HopperConfig:
    """What the notebooks vary. tile_m is derived: 64 query rows per consumer warpgroup."""

    tile_n: int = 128  # keys per K/V tile (one pipeline stage)
    num_stages: int = 2  # depth of each of the K and V rings
    num_consumer_wgs: int = 2  # MMA + softmax warpgroups; tile_m = 64 * num_consumer_wgs
    intra_wg_overlap: bool = True  # softmax(S_j) while wgmma(S_{j+1}) and wgmma(P_j V_j) run
    pingpong: bool = False  # consumer warpgroups take turns issuing wgmma: Note [Ping-pong]
    # Chapter 06: share of each row's exp2 on the FMA polynomial instead of MUFU, in steps of
    # 1/8 (OnlineSoftmax.exp2_row).
    exp2_emulation_fraction: float = 0.0
    # Chapter 07: tau, log2 units; keep a warp's stale max unless a row grew by more than tau
    # (Note [Warp vote] in ch05_softmax). 0: always rescale. At most MAX_RESCALE_THRESHOLD.
    rescale_threshold: float = 0.0

    @property
    def tile_m(self) -> int:
        return WGMMA_M * self.num_consumer_wgs


# setmaxnreg budgets (producer, consumer) per number of consumer warpgroups: the CTA's total,
# 128 * (producer + n * consumer), must stay within the SM's 64 K registers.
REGISTER_BUDGETS = {1: (56, 256), 2: (24, 240), 3: (32, 160)}

# MAX_RESCALE_THRESHOLD (fa4_final.common.softmax): a stale max lets p reach 2^tau, and P enters the
# P V wgmma in the input dtype, so tau stays below fp16's 2^16 with headroom.


def default_config(head_dim: int) -> HopperConfig:
    """192 x 64 tiles for D = 64, 128 x 128 for D = 128, 128 x 80 for D = 256 (Q 64 KB +
    2 x (K + V) 160 KB).

    D = 64 is where this kernel trails cuDNN most (results/h200/ch05_fwd.json). Per warpgroup
    turn (64 rows, n keys) the two GEMMs take 2 * 2 * 64 * n * 64 / 4096 cycles, 512 at
    n = 128, while the part of a warp's softmax after its own P V (Note [Ping-pong], point 1)
    needs n / 2 MUFU.EX2 at 8 cycles each (512) and some 180 other instructions: with two
    warpgroups it must hide under the other's 512 GEMM cycles, with no slack. A third warpgroup
    (FA4's Hopper tile, 192 x 128) gives it two turns to hide under, but at the 160 registers
    three warpgroups get, 192 x 128 with intra-warpgroup overlap spills (S 64 + P 32 + O 32
    registers per thread, plus addresses), and 192 x 112 / 96 / 80 compile spill-free only
    because ptxas inserts a warpgroup.arrive between the P V wgmmas to free registers (ptxas
    -v: C7519; ``injected_wgmma_fences``), which splits the P V into one group per wgmma, so
    wait_group(1) ("S is ready") also waits for most of P V. Two three-warpgroup tiles compile
    clean: 192 x 64, and 192 x 128 without intra-warpgroup overlap (the other two warpgroups'
    GEMMs cover a softmax). The knob run (measure.ch05_knobs, results/h200/ch05_knobs.json)
    timed both against the two-warpgroup 128 x 128 tile at D = 64: 192 x 64 (ping-pong on) was
    faster by more than the spread between runs, 192 x 128 without overlap within noise; so
    192 x 64 is the default at D = 64 (labs/ch05_tuning.ipynb prints the figures). Ping-pong
    flipped on the two-warpgroup tile was within noise, so neither setting is established at
    D = 64."""
    if head_dim <= 64:
        return HopperConfig(tile_n=64, num_consumer_wgs=3, pingpong=True)
    if head_dim <= 128:
        return HopperConfig(tile_n=128, num_consumer_wgs=2)
    return HopperConfig(tile_n=80, num_consumer_wgs=2)
# ===============================================================================================


class NamedBarrier(IntEnum):
    """Hardware named barriers (bar.sync id, count); id 0 is __syncthreads."""

    EPILOGUE = 1  # all consumer threads: O rows are in shared memory, TMA may store them
    TURN_WG0 = 2  # TURN_WG0 + w: consumer warpgroup w may issue its wgmma (ping-pong)


def smem_bytes(head_dim: int, cfg: HopperConfig, elem_bytes: int = 2) -> int:
    """Bytes of the kernel's SharedStorage: the mbarriers (8 B each: full + empty for Q and
    for every K and V stage), then Q (reused for O), K and V rings, each 1 KB aligned for the
    128 B swizzle. The kernel checks this sum against the struct's size at compile time."""

    def align(n):
        return -(-n // 1024) * 1024

    barriers = 8 * (2 + 2 * cfg.num_stages + 2 * cfg.num_stages)
    q = cfg.tile_m * head_dim * elem_bytes
    kv_ring = cfg.num_stages * cfg.tile_n * head_dim * elem_bytes
    return align(barriers) + align(q) + 2 * align(kv_ring)


def max_stages(head_dim: int, cfg: HopperConfig, elem_bytes: int = 2) -> int:
    """Deepest K/V ring that fits the 227 KB per CTA."""
    stages = 1
    while smem_bytes(head_dim, replace(cfg, num_stages=stages + 1), elem_bytes) <= (
        SMEM_BYTES_PER_CTA
    ):
        stages += 1
    return stages


def check_config(head_dim: int, cfg: HopperConfig) -> None:
    """Raise ValueError naming the knob that cannot work, and why."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if cfg.num_consumer_wgs not in REGISTER_BUDGETS:
        raise ValueError(
            f"num_consumer_wgs must be one of {sorted(REGISTER_BUDGETS)}, got "
            f"{cfg.num_consumer_wgs}"
        )
    if cfg.tile_n % 16 != 0 or not 16 <= cfg.tile_n <= 256:
        raise ValueError(f"tile_n must be a multiple of 16 in [16, 256] (wgmma), got {cfg.tile_n}")
    if cfg.num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {cfg.num_stages}")
    need = smem_bytes(head_dim, cfg)
    if need > SMEM_BYTES_PER_CTA:
        raise ValueError(
            f"config needs {need} B of shared memory (Q {cfg.tile_m}x{head_dim} + "
            f"{cfg.num_stages} x (K + V) {cfg.tile_n}x{head_dim}, bf16), more than the "
            f"{SMEM_BYTES_PER_CTA} B a CTA may use; at most {max_stages(head_dim, cfg)} stages fit"
        )
    # chapters 06 and 07: the share of exponentials on the FMA units, the rescale threshold;
    # the package's words, plus the chapter that explains the knob
    for chapter, args in (("chapter 06", (cfg.exp2_emulation_fraction, 0.0)),
                          ("chapter 07", (0.0, cfg.rescale_threshold))):
        try:
            check_softmax_knobs(*args)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{chapter}: {exc}") from None


def _assume_16b_strides(t: cute.Tensor) -> cute.Tensor:
    """Promise the compiler every non-unit stride is a multiple of 16 bytes (TMA requires it;
    the torch entry point checks it before launch)."""
    divby = 128 // t.element_type.width
    strides = tuple(
        s if isinstance(s, int) else cute.assume(s, divby=divby) for s in t.stride[:-1]
    )
    return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=(*strides, t.stride[-1])))


class FlashAttentionHopper:
    """One CTA computes a (tile_m, D) block of O for one (batch, head).

    Warp roles (data, so the notebook can print them):
      warpgroup 0     producer: warp 0 issues TMA for Q, K, V; warps 1-3 only give registers away
      warpgroup 1..n  consumers: wgmma S = Q K^T, online softmax, wgmma O += P V, epilogue
    """

    def __init__(self, dtype, head_dim: int, causal: bool, config: HopperConfig | None = None,
                 write_max_used: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        # a probe for tests (max_used()): the lse output receives the max each row subtracted
        self.write_max_used = bool(write_max_used)
        self.cfg = config or default_config(head_dim)
        check_config(head_dim, self.cfg)
        self.tile_m, self.tile_n = self.cfg.tile_m, self.cfg.tile_n
        self.window = TileWindow(self.tile_m, self.tile_n, self.causal)
        self.num_stages = self.cfg.num_stages
        self.num_consumer_wgs = self.cfg.num_consumer_wgs
        self.producer_regs, self.consumer_regs = REGISTER_BUDGETS[self.num_consumer_wgs]
        self.num_consumer_threads = THREADS_PER_WG * self.num_consumer_wgs
        self.num_threads = THREADS_PER_WG + self.num_consumer_threads
        assert THREADS_PER_WG * (
            self.producer_regs + self.num_consumer_wgs * self.consumer_regs
        ) <= REGISTERS_PER_SM
        self.roles = {
            "producer": {"warpgroups": (0,), "tma_warp": 0, "registers": self.producer_regs},
            "consumer": {
                "warpgroups": tuple(range(1, self.num_consumer_wgs + 1)),
                "registers": self.consumer_regs,
            },
        }

    # ---------------------------------------------------------------------------------------
    # host side: layouts, TMA descriptors, shared storage, grid, launch
    # ---------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, D)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, D)
        mO: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) float32
        softmax_scale: Float32,
        stream,
    ):
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type
                           == mO.element_type == self.dtype)):
            raise TypeError(f"q, k, v, out must all be {self.dtype}")
        if const_expr(mLSE.element_type != Float32):
            raise TypeError("lse must be float32")
        # (b, s, h, d) -> (s, d, h, b): TMA boxes tile modes 0 and 1; head, batch pick the slab
        mQ, mK, mV, mO = [select_modes(_assume_16b_strides(t), [1, 3, 2, 0])
                          for t in (mQ, mK, mV, mO)]
        mLSE = select_modes(mLSE, [2, 1, 0])  # (s, h, b)

        # S = Q K^T (A, B both K-major in smem) and O = P V (P from registers, V^T MN-major);
        # each consumer warpgroup owns 64 rows
        tiled_mma_qk, tiled_mma_pv = attention_tiled_mmas(self.dtype, self.num_consumer_wgs,
                                                          self.tile_n, self.head_dim)
        # 128 B-swizzled K-major tiles; sQ is also O's layout: O overwrites Q
        sQ_layout = smem_tile_layout(self.dtype, self.head_dim, self.tile_m)
        sK_layout = smem_tile_layout(self.dtype, self.head_dim, self.tile_n, self.num_stages)
        sV_layout = smem_tile_layout(self.dtype, self.head_dim, self.tile_n, self.num_stages)
        sKV_one = cute.select(sK_layout, mode=[0, 1])  # one stage, the TMA box
        tile_bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        tile_bytes_kv = cute.size_in_bytes(self.dtype, sKV_one)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]  # full + empty
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        # the budget arithmetic of smem_bytes() is the struct's real size
        assert SharedStorage.size_in_bytes() == smem_bytes(self.head_dim, self.cfg,
                                                           self.dtype.width // 8)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            load_op, mQ, sQ_layout, (self.tile_m, self.head_dim)
        )
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
            load_op, mK, sKV_one, (self.tile_n, self.head_dim)
        )
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
            load_op, mV, sKV_one, (self.tile_n, self.head_dim)
        )
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (self.tile_m, self.head_dim)
        )

        grid = (cute.ceil_div(mQ.shape[0], self.tile_m), mQ.shape[2], mQ.shape[3])
        self.kernel(
            tma_q, tma_k, tma_v, tma_o, mLSE,
            tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o,
            softmax_scale * LOG2_E,
            sQ_layout, sK_layout, sV_layout,
            tiled_mma_qk, tiled_mma_pv,
            tile_bytes_q, tile_bytes_kv,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------------------------------
    # device side
    # ---------------------------------------------------------------------------------------
    # The next four methods are plain Python arithmetic: the kernel calls them on run-time
    # Int32 values, and the CPU tests call them on Python ints and compare with brute force.
    def kv_tile_counts(self, m_block, seqlen_q, seqlen_k):
        """(n_tiles, n_masked) for query tile m_block. Tiles are visited from n_tiles - 1 down
        to 0; the first n_masked of them need a per-element mask, the rest are full.

        Both roles call this, so producer and consumers agree on the number of K/V tiles: a
        consumer never waits for a tile the producer will not load (see Note [Phases]).
        Causal is bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q.
        The arithmetic is fa4_final.common.tiles.kv_tile_range's (shared with chapter 08's
        kernel)."""
        n_min, n_max, n_top, _ = kv_tile_range(self.window, m_block, seqlen_q, seqlen_k)
        return n_max - n_min, n_top

    def visible_cols(self, row, n_block, seqlen_q, seqlen_k):
        """Query ``row`` (index in the sequence) sees columns c < visible_cols(...) of key tile
        n_block: keys below seqlen_k and, with causal, keys j <= row + seqlen_k - seqlen_q."""
        return window_visible_cols(self.window, row, n_block, seqlen_q, seqlen_k)[1]

    def turn_waits(self, wg, turn):
        """Ping-pong (Note [Turns]): does warpgroup wg wait before issuing in this turn?"""
        return (wg > 0) | (turn > 0)

    def turn_passes(self, wg, turn, num_turns):
        """Ping-pong: does warpgroup wg hand the turn on to the next one after issuing?"""
        return (wg < self.num_consumer_wgs - 1) | (turn < num_turns - 1)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA coordinate tensors: (s, D, h, b)
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,  # (s, h, b)
        tma_atom_q: cute.CopyAtom,
        tma_atom_k: cute.CopyAtom,
        tma_atom_v: cute.CopyAtom,
        tma_atom_o: cute.CopyAtom,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tile_bytes_q: cutlass.Constexpr[int],
        tile_bytes_kv: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        # See Note [Phases]. Producer: the one TMA thread (its arrive carries the byte count).
        # Consumers: one arrive per consumer warp (PipelineTmaAsync lets lane 0 of each warp
        # release), so an empty barrier completes when every consumer warp is done with a stage.
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, self.num_consumer_threads // cute.arch.WARP_SIZE
        )
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=tile_bytes_q, defer_sync=True,
        )
        pipeline_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages,
            producer_group=producer, consumer_group=consumers, tx_count=tile_bytes_kv,
            defer_sync=True,
        )
        pipeline_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages,
            producer_group=producer, consumer_group=consumers, tx_count=tile_bytes_kv,
            defer_sync=True,
        )
        # (tile_m, D)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        # (tile_n, D, STAGE)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # mbarrier inits (warp 0) must be visible to every thread before anyone waits on them
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        num_m_blocks = cute.ceil_div(mQ.shape[0], self.tile_m)
        bidx, head, batch = cute.arch.block_idx()
        m_block = bidx
        if const_expr(self.causal):
            m_block = num_m_blocks - 1 - bidx  # longest (most keys) tiles start first
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        n_tiles, n_masked = self.kv_tile_counts(m_block, seqlen_q, seqlen_k)

        if warp_idx < THREADS_PER_WG // cute.arch.WARP_SIZE:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == self.roles["producer"]["tma_warp"]:
                head_kv = head // (mQ.shape[2] // mK.shape[2])
                self.load(
                    mQ[None, None, head, batch], mK[None, None, head_kv, batch],
                    mV[None, None, head_kv, batch], sQ, sK, sV,
                    tma_atom_q, tma_atom_k, tma_atom_v, pipeline_q, pipeline_k, pipeline_v,
                    m_block, n_tiles,
                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.mma_softmax(
                mO[None, None, head, batch], mLSE[None, head, batch], sQ, sK, sV,
                tma_atom_o, tiled_mma_qk, tiled_mma_pv, pipeline_q, pipeline_k, pipeline_v,
                scale_log2, m_block, n_tiles, n_masked, seqlen_q, seqlen_k,
            )

    # Note [Phases]
    # -------------
    # Each pipeline stage has two mbarriers. FULL: the producer's arrive_and_expect_tx(bytes)
    # plus the TMA's byte count complete it ("data landed"). EMPTY: one arrive from each of the
    # 8 (or 12) consumer warps completes it ("everyone is done reading"). An mbarrier counts
    # phases; try_wait.parity(p) returns once the phase with parity p has completed, and a
    # freshly initialised barrier behaves as if the phase before phase 0 (parity 1) completed.
    #
    # PipelineState walks the ring: index = tile % stages, and the phase bit flips each time
    # the index wraps. The consumer starts at phase 0 and waits FULL[index] for parity
    # (tile // stages) & 1. The producer starts at phase 1 and waits EMPTY[index] for parity
    # ((tile // stages) & 1) ^ 1: in the first lap that is parity 1, which a fresh barrier
    # reports complete, so the first `stages` loads go out without waiting; in lap r >= 1 it
    # waits for the consumers' release of lap r - 1. Each barrier's phase advances exactly once
    # per lap, so parity is enough to tell laps apart: the producer can never be more than one
    # lap ahead, because it waits for the release of the previous lap of that slot.
    #
    # K and V have separate rings (pipeline_k, pipeline_v) and separate states on both sides;
    # every tile advances each state exactly once, in the same order on both sides:
    #   producer: Q, K[n-1], then for t = n-2 .. 0: K[t], V[t+1]; then V[0]
    #   consumer: reads K[n-1], K[n-2], ..., K[0] and V[n-1], ..., V[0] in that order.
    # Both sides take n (the tile count) from kv_tile_counts() with the same arguments, so the
    # count of arrives and waits matches: no consumer waits on a FULL that nobody will fill.
    # A tile with no visible key (causal, seqlen_q > seqlen_k) has n = 0: only Q moves.
    # No deadlock: the producer's K[t] needs K[t + stages] released, which the consumers do
    # before they ever wait for K[t] or V[t + 1]; likewise for V.
    #
    # Q is a one-stage pipeline used once: the consumers wait FULL[0] parity 0 and never
    # release it (the CTA computes one tile). Every consumer waits for Q, even with n = 0,
    # because the epilogue writes O over Q's buffer and must not race the TMA writing Q.

    @cute.jit
    def load(
        self,
        gQ_all: cute.Tensor,  # (seqlen_q, D) of this (batch, head)
        gK_all: cute.Tensor,  # (seqlen_k, D) of this (batch, kv head)
        gV_all: cute.Tensor,
        sQ: cute.Tensor,  # (tile_m, D)
        sK: cute.Tensor,  # (tile_n, D, STAGE)
        sV: cute.Tensor,
        tma_atom_q: cute.CopyAtom,
        tma_atom_k: cute.CopyAtom,
        tma_atom_v: cute.CopyAtom,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        m_block: Int32,
        n_tiles: Int32,
    ):
        """Producer warp: Q once, then K and V tiles into their rings (order: Note [Phases])."""
        # (tile_m, D)
        gQ = cute.local_tile(gQ_all, (self.tile_m, self.head_dim), (m_block, 0))
        # (tile_n, D, n_tiles)
        gK = cute.local_tile(gK_all, (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(gV_all, (self.tile_n, self.head_dim), (None, 0))
        # TMA partitions: (TMA,) for Q; (TMA, STAGE) in smem and (TMA, n_tiles) in gmem for K, V
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
            cute.group_modes(gQ, 0, 2),
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
            cute.group_modes(gK, 0, 2),
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
            cute.group_modes(gV, 0, 2),
        )
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state_k = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.num_stages
        )
        state_v = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.num_stages
        )
        # acquire = wait EMPTY (free slot) and arm FULL with the byte count; the TMA completes it
        pipeline_q.producer_acquire(state_q)
        cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(state_q))
        if n_tiles > 0:
            pipeline_k.producer_acquire(state_k)
            cute.copy(
                tma_atom_k, tKgK[None, n_tiles - 1], tKsK[None, state_k.index],
                tma_bar_ptr=pipeline_k.producer_get_barrier(state_k),
            )
            state_k.advance()
            for i in cutlass.range(n_tiles - 1, unroll=1):
                n_block = n_tiles - 2 - i
                pipeline_k.producer_acquire(state_k)
                cute.copy(
                    tma_atom_k, tKgK[None, n_block], tKsK[None, state_k.index],
                    tma_bar_ptr=pipeline_k.producer_get_barrier(state_k),
                )
                state_k.advance()
                pipeline_v.producer_acquire(state_v)
                cute.copy(
                    tma_atom_v, tVgV[None, n_block + 1], tVsV[None, state_v.index],
                    tma_bar_ptr=pipeline_v.producer_get_barrier(state_v),
                )
                state_v.advance()
            pipeline_v.producer_acquire(state_v)
            cute.copy(
                tma_atom_v, tVgV[None, 0], tVsV[None, state_v.index],
                tma_bar_ptr=pipeline_v.producer_get_barrier(state_v),
            )

    # Note [Ping-pong]
    # ----------------
    # FA3 makes its consumer warpgroups take turns issuing GEMMs (Note [Turns]) so that one
    # warpgroup's exponentials run while the tensor cores work on the other's GEMMs. The knob
    # run (measure.ch05_knobs, results/<gpu>/ch05_knobs.json) found flipping it within noise at
    # D = 128 and for the two-warpgroup tile at D = 64; the default is off at D = 128 and on at
    # D = 64 (the 192 x 64 tile was timed with it on only). The SASS of the two builds differs
    # only by the BAR.SYNC before the turn's 16 HGMMA and the BAR.ARV after them. What follows
    # is our reading of why the barriers find little to order; point 1 is read in the SASS,
    # points 2 and 3 are hypotheses about hardware NVIDIA does not document.
    # 1. A warpgroup waits for its own P V before its exponentials: ptxas hoists wait_group(0)
    #    (WARPGROUP.DEPBAR.LE gsb0, 0x0) above all but a handful of a turn's 64 MUFU.EX2
    #    (sass_overlap()). So its softmax can only overlap the *other* warpgroup's GEMMs.
    # 2. Hypothesis: the tensor cores of an SM take the wgmma groups of its warpgroups roughly
    #    in the order they were issued. Then, while warpgroup A waits for its P V, B's GEMMs
    #    wait behind it; when A's P V ends, B's S and P V (1024 tensor cycles at D = 128) start,
    #    and A's softmax (60 MUFU.EX2 per warp at 8 cycles each, about 480 cycles, and some 210
    #    other instructions) ends before them, so A issues its next turn behind B's: the two
    #    would alternate without barriers. What would show it: per-warpgroup timestamps of
    #    wgmma issue and completion (globaltimer or clock64 around wait_group), or ncu's tensor
    #    pipe activity with one consumer warpgroup against two.
    # 3. Hypothesis: if 2 holds, the barriers can only add waiting: a ready warpgroup waits
    #    until the other has issued, and any delay of one (a K/V tile landing late, issue
    #    slots lost to the other's softmax) stalls both. What would show it: ncu's
    #    barrier-stall share of the consumer warps with and without the knob.
    # The knob stays: a kernel whose softmax really overlaps its own P V (chapter 08) changes
    # point 1.

    # Note [Turns]
    # ------------
    # Ping-pong: consumer warpgroups take turns *issuing* wgmma (the GEMMs then run on the tensor
    # cores while the issuer does softmax). Turn r of warpgroup w waits on named barrier
    # TURN_WG0 + w and, once its wgmma are issued, arrives on the next warpgroup's barrier.
    # Each barrier has 256 participants: the 128 threads that wait (bar.sync) and the 128 of
    # the previous warpgroup that arrive (bar.arrive). Order: (turn 0, wg 0), (0, 1), ...,
    # (1, 0), ... Warpgroup 0's first turn has nobody before it, so it does not wait; the last
    # warpgroup's last turn has nobody after it, so it does not arrive. Then every barrier
    # sees exactly as many arrive-halves as sync-halves and no arrive is left pending at exit.
    # All consumer warpgroups of a CTA share n_tiles, so they take the same number of turns.

    @cute.jit
    def turn_begin(self, wg: Int32, turn: Int32):
        if const_expr(self.cfg.pingpong and self.num_consumer_wgs > 1):
            if self.turn_waits(wg, turn):
                cute.arch.barrier(
                    barrier_id=int(NamedBarrier.TURN_WG0) + wg,
                    number_of_threads=2 * THREADS_PER_WG,
                )

    @cute.jit
    def turn_end(self, wg: Int32, turn: Int32, num_turns: Int32):
        if const_expr(self.cfg.pingpong and self.num_consumer_wgs > 1):
            if self.turn_passes(wg, turn, num_turns):
                next_wg = wg + 1
                if next_wg == self.num_consumer_wgs:
                    next_wg = Int32(0)
                cute.arch.barrier_arrive(
                    barrier_id=int(NamedBarrier.TURN_WG0) + next_wg,
                    number_of_threads=2 * THREADS_PER_WG,
                )

    @cute.jit
    def gemm_turn(self, wg: Int32, turn: Int32, num_turns: Int32, tiled_mma_qk, tiled_mma_pv,
                  acc_s: cute.Tensor, acc_o: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                  tOrP: cute.Tensor, tOrVt: cute.Tensor):
        """A steady turn's GEMMs: S_{j+1} = Q K_{j+1}^T (a fresh accumulator) and O += P_j V_j,
        two groups in that order; hand the turn on (ping-pong); return once S is complete, P V
        still running. ``tSrK`` and ``tOrVt`` are this turn's stages."""
        self.wgmma(tiled_mma_qk, acc_s, tSrQ, tSrK, True)
        self.wgmma(tiled_mma_pv, acc_o, tOrP, tOrVt, False)
        self.turn_end(wg, turn, num_turns)
        warpgroup.wait_group(1)  # the older group, S, is done; P V may still run

    def wgmma(self, tiled_mma, acc, tA, tB, zero_init: bool):
        """Issue acc (+)= A B as one async group (fa4_final.hopper.wgmma.issue_wgmma); the caller
        waits on it. ``zero_init`` overwrites acc."""
        issue_wgmma(tiled_mma, acc, tA, tB, not zero_init)

    @cute.jit
    def apply_mask(self, acc_s: cute.Tensor, thr_mma_qk, m_block: Int32, n_block: Int32,
                   seqlen_q: Int32, seqlen_k: Int32):
        """Scores of invisible keys -> -inf: keys past seqlen_k, and with causal keys
        j > i + seqlen_k - seqlen_q. Only the first n_masked tiles of a row of tiles call this.
        fa4_final.common.mask.apply_mask does the work (Note [Mask with constants] there)."""
        tScS, t0ScS = fragment_coords(thr_mma_qk, (self.tile_m, self.tile_n))
        apply_mask(acc_s, tScS, t0ScS, self.window, m_block, n_block, seqlen_q, seqlen_k,
                   None, None)

    @cute.jit
    def mma_softmax(
        self,
        gO_all: cute.Tensor,  # TMA coordinates (seqlen_q, D) of this (batch, head)
        gLSE_all: cute.Tensor,  # (seqlen_q,)
        sQ: cute.Tensor,  # (tile_m, D)
        sK: cute.Tensor,  # (tile_n, D, STAGE)
        sV: cute.Tensor,  # (tile_n, D, STAGE)
        tma_atom_o: cute.CopyAtom,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        pipeline_q: pipeline.PipelineAsync,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        scale_log2: Float32,
        m_block: Int32,
        n_tiles: Int32,
        n_masked: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
    ):
        """Consumer warpgroups: S = Q K^T, mask, online softmax, O += P V; then the epilogue."""
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - THREADS_PER_WG  # 0 .. num_consumer_threads - 1
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        # A and B fragments are per warpgroup (wgmma descriptors), C per thread
        wg_mma_qk = tiled_mma_qk.get_slice(wg * THREADS_PER_WG)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * THREADS_PER_WG)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        # V^T view (D, tile_n, STAGE): B operand of O = P V with N = D, K = tile_n
        sVt = cute.composition(
            sV, cute.make_ordered_layout((self.head_dim, self.tile_n, self.num_stages),
                                         order=(1, 0, 2))
        )
        # smem descriptors for this warpgroup's 64 rows: (MMA, MMA_M=1, MMA_K=D/16)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        # (MMA, MMA_N=1, MMA_K=D/16, STAGE)
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        # (MMA, MMA_N=1, MMA_K=tile_n/16, STAGE)
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        # fp32 accumulators, this thread's part: S ((2, 2, tile_n/8), 1, 1), O ((2, 2, D/8), 1, 1)
        acc_s = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)),
                                      Float32)
        acc_o = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((self.tile_m, self.head_dim)),
                                      Float32)
        acc_o.fill(0.0)  # so every P V may accumulate, and a tile with no keys writes zeros
        # P as the register A operand of O += P V, input dtype: ((2, 2, 2), 1, tile_n/16)
        tOrP = cute.make_rmem_tensor(thr_mma_pv.partition_shape_A((self.tile_m, self.tile_n)),
                                     self.dtype)
        softmax = OnlineSoftmax(scale_log2, cute.size(acc_rows_cols(acc_o), mode=[0]),
                                self.cfg.exp2_emulation_fraction, self.cfg.rescale_threshold)

        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        pipeline_q.consumer_wait(state_q)

        if const_expr(self.cfg.intra_wg_overlap):
            num_turns = n_tiles + 1
        else:
            num_turns = 2 * n_tiles
        if n_tiles > 0:
            if const_expr(self.cfg.intra_wg_overlap):
                # turn 0: S for the first tile only
                pipeline_k.consumer_wait(state_k)
                self.turn_begin(wg, 0)
                self.wgmma(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, state_k.index], True)
                self.turn_end(wg, 0, num_turns)
                warpgroup.wait_group(0)
                pipeline_k.consumer_release(state_k)
                state_k.advance()
                # the first tile visited is the last one: the one past seqlen_k or on the
                # causal diagonal; masking it when it happens to be full costs 64 FSEL, once
                self.apply_mask(acc_s, thr_mma_qk, m_block, n_tiles - 1, seqlen_q, seqlen_k)
                softmax.update(acc_s, is_first=True)
                self.convert_p(acc_s, tOrP)
                # turns 1 .. n-1: S_{j+1} = Q K_{j+1}^T and O += P_j V_j in flight together
                for i in cutlass.range(1, n_tiles, unroll=1):
                    pipeline_k.consumer_wait(state_k)
                    pipeline_v.consumer_wait(state_v)
                    self.turn_begin(wg, i)
                    self.gemm_turn(wg, i, num_turns, tiled_mma_qk, tiled_mma_pv, acc_s, acc_o,
                                   tSrQ, tSrK[None, None, None, state_k.index], tOrP,
                                   tOrVt[None, None, None, state_v.index])
                    pipeline_k.consumer_release(state_k)
                    state_k.advance()
                    if i < n_masked:
                        self.apply_mask(acc_s, thr_mma_qk, m_block, n_tiles - 1 - i, seqlen_q,
                                        seqlen_k)
                    row_scale, rescale = softmax.update(acc_s, is_first=False)
                    # P V done: tOrP, O and the V stage are free again. ptxas may schedule this
                    # wait earlier than written (see sass_overlap): source order is a request.
                    warpgroup.wait_group(0)
                    pipeline_v.consumer_release(state_v)
                    state_v.advance()
                    self.convert_p(acc_s, tOrP)
                    softmax.rescale_o(acc_o, row_scale, rescale)
                # turn n: the last O += P V
                pipeline_v.consumer_wait(state_v)
                self.turn_begin(wg, n_tiles)
                self.wgmma(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, state_v.index],
                           False)
                self.turn_end(wg, n_tiles, num_turns)
                warpgroup.wait_group(0)
                pipeline_v.consumer_release(state_v)
            else:
                for i in cutlass.range(n_tiles, unroll=1):
                    pipeline_k.consumer_wait(state_k)
                    self.turn_begin(wg, 2 * i)
                    self.wgmma(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, state_k.index],
                               True)
                    self.turn_end(wg, 2 * i, num_turns)
                    warpgroup.wait_group(0)
                    pipeline_k.consumer_release(state_k)
                    state_k.advance()
                    if i < n_masked:
                        self.apply_mask(acc_s, thr_mma_qk, m_block, n_tiles - 1 - i, seqlen_q,
                                        seqlen_k)
                    row_scale, rescale = softmax.update(acc_s, is_first=False)
                    self.convert_p(acc_s, tOrP)
                    softmax.rescale_o(acc_o, row_scale, rescale)
                    pipeline_v.consumer_wait(state_v)
                    self.turn_begin(wg, 2 * i + 1)
                    self.wgmma(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, state_v.index],
                               False)
                    self.turn_end(wg, 2 * i + 1, num_turns)
                    warpgroup.wait_group(0)
                    pipeline_v.consumer_release(state_v)
                    state_v.advance()

        self.epilogue(acc_o, softmax, gO_all, gLSE_all, sQ, tma_atom_o, thr_mma_pv, tidx,
                      m_block, seqlen_q)

    @cute.jit
    def convert_p(self, acc_s: cute.Tensor, tOrP: cute.Tensor):
        """P (fp32, accumulator layout) -> tOrP (input dtype, wgmma A-operand layout): the same
        registers regrouped (acc_as_a_operand), then converted two at a time (F2FP.PACK_AB)."""
        tOrP.store(acc_as_a_operand(acc_s).load().to(self.dtype))

    @cute.jit
    def epilogue(self, acc_o: cute.Tensor, softmax: OnlineSoftmax, gO_all: cute.Tensor,
                 gLSE_all: cute.Tensor, sQ: cute.Tensor, tma_atom_o: cute.CopyAtom,
                 thr_mma_pv, tidx: Int32, m_block: Int32, seqlen_q: Int32):
        """out = O / l and lse to global memory. O goes registers -> shared (over Q's buffer)
        -> TMA store, which clips rows past seqlen_q; lse is written directly."""
        inv_sum, lse = softmax.finalize()
        if const_expr(self.write_max_used):
            for r in cutlass.range_constexpr(softmax.num_rows):
                lse[r] = softmax.row_max[r] * softmax.scale_log2  # log2 units; -inf: no key
        o = acc_rows_cols(acc_o)
        for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
            for c in cutlass.range(cute.size(o, mode=[1]), unroll_full=True):
                o[r, c] = o[r, c] * inv_sum[r]

        # lse: the thread holding column 0 of a row writes it
        c_o = cute.make_identity_tensor((self.tile_m, self.head_dim))
        tOcO = acc_rows_cols(thr_mma_pv.partition_C(c_o))  # (rows, cols) of (row, col)
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
                row = m_block * self.tile_m + tOcO[r, 0][0]
                if row < seqlen_q:
                    gLSE_all[row] = lse[r]

        # O over Q: a warpgroup's O rows are exactly the bytes of its own Q rows (same layout,
        # same 64-row band), and its last wgmma reading them has retired (wait_group 0).
        sO = sQ
        tOsO = thr_mma_pv.partition_C(sO)  # ((2, 2, D/8), 1, 1): where this thread's O goes
        rO = cute.make_rmem_tensor_like(acc_o, self.dtype)
        rO.store(acc_o.load().to(self.dtype))
        # (tile_m, D)
        gO = cute.local_tile(gO_all, (self.tile_m, self.head_dim), (m_block, 0))
        # the TMA's view of the whole tile: (TMA,) in shared and in global memory
        tOsO_tma, tOgO_tma = cpasync.tma_partition(
            tma_atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
            cute.group_modes(gO, 0, 2),
        )
        self.store_o(rO, tOsO, tma_atom_o, tOsO_tma, tOgO_tma, tidx)

    # Note [Proxies]
    # --------------
    # Shared memory is reached through two proxies. The threads' ld.shared / st.shared use the
    # generic proxy; the TMA and wgmma read and write it through the async proxy. Program order
    # and bar.sync order generic accesses among threads, not generic against async. So when
    # threads write a tile that the TMA (or wgmma) then reads, each writing thread issues
    # fence.proxy.async.shared::cta after its stores and before the barrier that hands the tile
    # over; the thread that issues the TMA waits at that barrier first. Without the fence
    # nothing traps or hangs: the TMA may read stale bytes, or may not, depending on when the
    # stores drain, so a test run cannot be relied on to catch it (exercise 05.6 checks the
    # code and the PTX instead). The other direction needs no fence in code: the mbarrier's
    # byte count makes the TMA's writes visible to the threads that waited on it.

    @cute.jit
    def store_o(self, rO: cute.Tensor, tOsO: cute.Tensor, tma_atom_o: cute.CopyAtom,
                tOsO_tma: cute.Tensor, tOgO_tma: cute.Tensor, tidx: Int32):
        """Every consumer thread writes its O fragment ``rO`` into shared memory (``tOsO``),
        then one warp stores the whole tile to global memory with the TMA. See Note [Proxies]."""
        cute.autovec_copy(rO, tOsO)
        # generic-proxy smem writes -> visible to the TMA (async proxy), then all rows written
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE),
                          number_of_threads=self.num_consumer_threads)
        if tidx // cute.arch.WARP_SIZE == 0:
            cute.copy(tma_atom_o, tOsO_tma, tOgO_tma)
            cute.arch.cp_async_bulk_commit_group()
            # shared memory must outlive the TMA's reads of it
            cute.arch.cp_async_bulk_wait_group(0, read=True)


# ===============================================================================================
# torch entry point
# ===============================================================================================
_COMPILED: dict = {}  # (dtype, head_dim, causal, config) -> compiled kernel; sizes are dynamic


def check_inputs(q, k, v, softmax_scale=None, config=None):
    """Validate for this kernel; return (batch, seqlen_q, seqlen_k, heads, heads_kv, dim).
    Raises TypeError / ValueError saying what is wrong and what is accepted."""
    from utils.reference import check_attention_inputs

    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v, softmax_scale)
    if q.dtype not in TORCH_TO_CUTLASS:
        raise TypeError(f"the chapter 05 kernel takes bfloat16 or float16, got {q.dtype}")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
    if softmax_scale is not None and softmax_scale <= 0:
        raise ValueError(
            f"softmax_scale must be > 0 (the kernel's running max assumes it), got {softmax_scale}"
        )
    if config is not None and not isinstance(config, HopperConfig):
        raise TypeError(f"config must be a HopperConfig or None, got {type(config).__name__}")
    check_config(d, config or default_config(d))
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tma_operand(name, t)
    if q.device.type != "cuda":
        raise ValueError(f"q, k, v must be CUDA tensors, got device {q.device}")
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) != (9, 0):
        raise ValueError(
            f"this kernel needs compute capability 9.0 (H100/H200: TMA, wgmma, setmaxnreg), "
            f"got {major}.{minor} on {torch.cuda.get_device_name(q.device)}"
        )
    return b, sq, sk, h, hk, d


def _check_tma_operand(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name}'s last dimension must be contiguous (stride 1), got strides {t.stride()}"
        )
    bad = [st for st in t.stride()[:-1] if st <= 0 or (st * t.element_size()) % 16]
    if bad or t.data_ptr() % 16:
        raise ValueError(
            f"TMA needs positive strides that are multiples of 16 bytes and a 16-byte aligned "
            f"base address: {name} has strides {t.stride()} ({t.element_size()}-byte elements) "
            f"and address % 16 = {t.data_ptr() % 16}; call .contiguous() first"
        )


def _to_cute(t: torch.Tensor, leading_dim: int, align: int = 16):
    from cutlass.cute.runtime import from_dlpack

    # dynamic shapes and strides: one compiled kernel serves every batch, seqlen and head count
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=leading_dim)


def attention_into(q, k, v, out, lse, causal=False, softmax_scale=None, config=None):
    """Run the kernel writing into given ``out`` (like q) and ``lse`` (b, h, sq) float32.
    Tests pass NaN-filled buffers here to prove every element gets written."""
    return _launch(q, k, v, out, lse, causal, softmax_scale, config, write_max_used=False)


def _launch(q, k, v, out, lse, causal, softmax_scale, config, write_max_used):
    import cuda.bindings.driver as cuda

    b, sq, sk, h, hk, d = check_inputs(q, k, v, softmax_scale, config)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be like q {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)}")
    _check_tma_operand("out", out)
    if lse.shape != (b, h, sq) or lse.dtype != torch.float32 or lse.stride(-1) != 1:
        raise ValueError(
            f"lse must be float32 {(b, h, sq)} with stride 1 last, got {lse.dtype} "
            f"{tuple(lse.shape)} strides {lse.stride()}"
        )
    cfg = config or default_config(d)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    args = [_to_cute(t, 3) for t in (q, k, v, out)] + [_to_cute(lse, 2, align=4)]
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    key = (q.dtype, d, bool(causal), cfg, write_max_used)
    if key not in _COMPILED:
        kernel = FlashAttentionHopper(TORCH_TO_CUTLASS[q.dtype], d, bool(causal), cfg,
                                      write_max_used)
        _COMPILED[key] = cute.compile[cute.GPUArch("sm_90a")](kernel, *args, scale, stream)
    _COMPILED[key](*args, scale, stream)
    return out, lse


def attention(q, k, v, causal=False, softmax_scale=None, config=None):
    """Chapter 05's Hopper forward; the contract of utils.reference.attention_reference:
    q (b, sq, h, d), k and v (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) float32.
    ``config`` (a HopperConfig) picks the tuning knobs; None means default_config(d)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    return attention_into(q, k, v, out, lse, causal, softmax_scale, config)


def max_used(q, k, v, causal=False, softmax_scale=None, config=None):
    """A probe for tests: (b, h, sq) float32, the max each query row subtracted in its last
    tile, in log2 units (scale * log2(e) * score; -inf for a row that saw no key). Without
    chapter 07 it is the row's true max; with ``rescale_threshold`` it is the stale max the warp
    vote kept (Note [Warp vote]), which ``ch07_rescaling``'s model predicts. The same kernel,
    compiled with its lse output replaced by this value."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    probe = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32,
                        device=q.device)
    _launch(q, k, v, out, probe, causal, softmax_scale, config, write_max_used=True)
    return probe


def compile_only(arch="sm_90a", head_dim=128, dtype="bf16", causal=False, config=None):
    """Compile with fake tensors, no GPU needed; return a utils.compile_only.Artifacts."""
    from cutlass.cute.runtime import make_fake_tensor

    from utils.compile_only import compile_for, fake_stream

    dtypes = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    if arch != "sm_90a":
        raise ValueError(
            f"chapter 05's kernel uses sm_90a-only instructions (wgmma.mma_async, setmaxnreg) "
            f"and TMA, so it compiles only for arch='sm_90a', got {arch!r}"
        )
    cfg = config or default_config(head_dim)
    check_config(head_dim, cfg)
    elem = dtypes[dtype]
    batch, heads, heads_kv = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    seqlen_q, seqlen_k = cute.sym_int32(), cute.sym_int32()

    def bshd(seqlen, nheads):  # (batch, seqlen, heads, D), 16-byte aligned strides
        strides = tuple(cute.sym_int64(divisibility=128 // elem.width) for _ in range(3))
        return make_fake_tensor(elem, (batch, seqlen, nheads, head_dim), (*strides, 1),
                                assumed_align=16)

    lse = make_fake_tensor(Float32, (batch, heads, seqlen_q),
                           (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    kernel = FlashAttentionHopper(elem, head_dim, causal, cfg)
    return compile_for(arch, kernel, bshd(seqlen_q, heads), bshd(seqlen_k, heads_kv),
                       bshd(seqlen_k, heads_kv), bshd(seqlen_q, heads), lse, 1.0, fake_stream())


def injected_wgmma_fences(art) -> int:
    """Fences ptxas added on its own: WARPGROUP.ARRIVE in the SASS beyond the source's
    wgmma.fence in the PTX. ptxas inserts them (message C7519 under ``ptxas -v``) when it runs
    short of registers for the wgmma pipeline; each one splits a group of wgmma, so a
    wait_group(n) then waits for more work than the source meant. 0 is the healthy value."""
    return art.count("WARPGROUP.ARRIVE", where="sass") - art.count("wgmma.fence")


def sass_overlap(sass: str) -> dict:
    """Where ptxas put the overlapped turn's two waits: MUFU.EX2 (exponentials) between
    ``wait_group(1)`` (S ready) and ``wait_group(0)`` (P V done) run under the P V GEMM; those
    after it do not. Reads the first steady-state turn of an intra-warpgroup-overlap build."""
    lines = sass.splitlines()
    try:
        s_ready = next(i for i, ln in enumerate(lines) if "DEPBAR.LE gsb0, 0x1" in ln)
    except StopIteration:
        return {"under_pv": 0, "after_pv": 0, "found": False}
    pv_done = next(i for i in range(s_ready, len(lines)) if "DEPBAR.LE gsb0, 0x0" in lines[i])
    after = 0
    for ln in lines[pv_done:]:
        if "HGMMA" in ln or "BAR.SYNC" in ln:
            break
        after += "MUFU.EX2" in ln
    under = sum("MUFU.EX2" in ln for ln in lines[s_ready:pv_done])
    return {"under_pv": under, "after_pv": after, "found": True}


# ===============================================================================================
# command line: quick checks on a Hopper GPU (also run under compute-sanitizer)
# ===============================================================================================
# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype)
SMALL_CASE = (1, 200, 200, 2, 1, 128, True, torch.bfloat16)
# --small, also what compute-sanitizer runs: the D = 128 default, a three-warpgroup D = 64
# candidate, and chapters 06 and 07's knobs together; (case, config)
SMALL_CASES = [
    (SMALL_CASE, None),
    ((1, 200, 300, 2, 1, 64, True, torch.bfloat16), HopperConfig(tile_n=64, num_consumer_wgs=3)),
    ((1, 200, 200, 2, 1, 128, False, torch.float16),
     replace(default_config(128), exp2_emulation_fraction=0.25, rescale_threshold=8.0)),
]
CHECK_CASES = [
    (1, 128, 128, 1, 1, 128, False, torch.bfloat16),
    (1, 128, 128, 1, 1, 128, True, torch.bfloat16),
    (2, 1, 1, 2, 2, 64, False, torch.bfloat16),
    (1, 17, 17, 2, 1, 128, True, torch.float16),
    (2, 129, 129, 4, 2, 64, True, torch.bfloat16),
    (1, 1000, 1000, 2, 2, 128, False, torch.float16),
    (1, 1000, 4097, 2, 1, 128, True, torch.bfloat16),
    (1, 4097, 1000, 2, 2, 64, True, torch.bfloat16),
    (1, 300, 77, 2, 2, 128, True, torch.bfloat16),
    (1, 1024, 1024, 2, 2, 256, True, torch.bfloat16),
    (1, 8192, 8192, 2, 2, 128, False, torch.bfloat16),
    (1, 8192, 8192, 2, 2, 128, True, torch.bfloat16),
]


def compare(q, k, v, out, lse, causal=False, softmax_scale=None, label=""):
    """Kernel output vs the float64 reference: ``utils.checks.compare_outputs``."""
    return checks.compare_outputs(q, k, v, out, lse, causal, softmax_scale, label=label)


def run_and_compare(q, k, v, causal=False, softmax_scale=None, config=None, label=""):
    """One launch into NaN-poisoned out and lse, then compare(). Returns (ok, one line)."""
    return checks.run_into_poisoned(attention_into, q, k, v, causal, softmax_scale, config,
                                    label=label)


def check_case(batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype, config=None):
    """Fresh random inputs, one run, compare(). Returns (ok, report)."""
    return checks.check_random_case(attention_into, batch, seqlen_q, seqlen_k, heads, heads_kv,
                                    dim, causal, dtype, config=config)


# ===============================================================================================
# The knob run: every knob at the chapter's target shape, verified, then timed. This module only
# times; ``python -m measure.ch05_knobs`` stores the rows (results/<gpu>/ch05_knobs.json).
# ===============================================================================================
BENCH_RESULTS = "ch05_knobs"
BENCH_SEQLEN, BENCH_HEADS = 16384, 16  # batch * seqlen = 16384 tokens, as in results/*/ch05_fwd
# (head_dim, causal) -> names of bench_configs(head_dim) to time there
BENCH_PLAN = {
    (128, False): ("default", "no intra-wg overlap", "ping-pong", "3 stages",
                   "exp2 emulation 1/4", "exp2 emulation 1/2", "tau = 8"),
    (128, True): ("default", "no intra-wg overlap", "ping-pong", "3 stages",
                  "exp2 emulation 1/4", "exp2 emulation 1/2", "tau = 8"),
    (64, False): ("default", "ping-pong", "128 x 128, 2 warpgroups", "192 x 128, no overlap",
                  "exp2 emulation 1/4"),
}


def bench_configs(head_dim: int) -> dict:
    """Name -> HopperConfig: the default and one knob changed at a time (chapters 05-07), and
    the tile candidates for D = 64 (default_config's docstring)."""
    base = default_config(head_dim)
    return {
        "default": base,
        "no intra-wg overlap": replace(base, intra_wg_overlap=False),
        "ping-pong": replace(base, pingpong=not base.pingpong),
        "3 stages": replace(base, num_stages=3),
        "exp2 emulation 1/4": replace(base, exp2_emulation_fraction=0.25),
        "exp2 emulation 1/2": replace(base, exp2_emulation_fraction=0.5),
        "tau = 8": replace(base, rescale_threshold=8.0),
        "192 x 64": replace(base, tile_n=64, num_consumer_wgs=3),
        "128 x 128, 2 warpgroups": replace(base, tile_n=128, num_consumer_wgs=2),
        "192 x 128, no overlap": replace(base, tile_n=128, num_consumer_wgs=3,
                                         intra_wg_overlap=False),
    }


def bench(plan=None, seqlen=BENCH_SEQLEN, heads=BENCH_HEADS, rep=30, save=False,
          rounds=3) -> list[dict]:
    """Each (head_dim, causal, config) of ``plan``: verified once against the float64 reference
    on a small awkward shape (fresh random inputs, NaN-poisoned outputs), then timed at
    (batch, seqlen, heads) = (16384 // seqlen, seqlen, heads) in ``rounds`` interleaved rounds
    (``utils.bench.interleaved``: every config of every group, and the peers SDPA flash, cuDNN
    and the FA4 package on the same inputs, once per round; L2 flushed, median of ``rep`` calls
    per round). A config that fails its check is not timed. Prints a table and returns rows for
    utils.results: median over rounds, per-round values, spread, SM clock, and the fastest peer
    of the group (``best_peer``, ``peers_tflops``). ``python -m measure.ch05_knobs`` stores them
    as BENCH_RESULTS; ``save=True`` is refused here (this module writes no results)."""
    from utils import bench as ub
    from utils.reference import random_qkv

    if save:
        raise ValueError("ch05_flash_hopper.bench only times; `python -m measure.ch05_knobs` "
                         f"stores the rows as results/<gpu>/{BENCH_RESULTS}.json")

    plan = BENCH_PLAN if plan is None else plan
    batch = max(1, 16384 // seqlen)
    rows, failures, calls, flops_of = [], 0, {}, {}
    for (head_dim, causal), names in plan.items():
        configs = bench_configs(head_dim)
        q, k, v, seed = random_qkv(batch, seqlen, heads, head_dim, device="cuda")
        group = (head_dim, causal)
        flops_of[group] = ub.attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
        for name in names:
            cfg = configs[name]
            t0 = time.perf_counter()
            try:  # one broken config must not cost the rest of a rare GPU session
                ok, line = check_case(1, 1000, 1100, 4, 2, head_dim, causal, torch.bfloat16,
                                      cfg)
            except Exception as exc:  # reported in the row and the table, the run goes on
                ok, line = False, f"FAIL d={head_dim} causal={causal} {name}: {exc!r}"
            rows.append({
                "impl": "flash_hopper", "config": name, "pass": "fwd", "dtype": "bf16",
                "b": batch, "s": seqlen, "h": heads, "d": head_dim, "causal": causal,
                "tile_m": cfg.tile_m, "tile_n": cfg.tile_n, "num_stages": cfg.num_stages,
                "intra_wg_overlap": cfg.intra_wg_overlap, "pingpong": cfg.pingpong,
                "exp2_emulation_fraction": cfg.exp2_emulation_fraction,
                "rescale_threshold": cfg.rescale_threshold, "verified": ok, "seed": seed,
                "ms": None, "tflops": None,
            })
            if ok:
                calls[(group, name)] = lambda q=q, k=k, v=v, c=causal, cfg=cfg: attention(
                    q, k, v, c, config=cfg)
            else:
                failures += 1
                print(line, flush=True)
            print(f"  {'ok  ' if ok else 'FAIL'} d={head_dim} causal={causal} {name}: "
                  f"checked in {time.perf_counter() - t0:.1f} s", flush=True)
        for peer, call in ub.peer_calls(q, k, v, causal).items():
            calls[(group, ub.PEER_KEY, peer)] = call
    measured = ub.interleaved(calls, rounds=rounds, rep=rep,
                              progress=lambda line: print("  " + line, flush=True))
    for row in rows:
        group = (row["d"], row["causal"])
        if (group, row["config"]) in measured:
            row.update(measured[(group, row["config"])].fields(flops_of[group]))
        row.update(ub.peer_fields({key[2]: m for key, m in measured.items()
                                   if key[0] == group and key[1:2] == (ub.PEER_KEY,)},
                                  flops_of[group]))
    print(format_knob_rows(rows), flush=True)
    if failures:
        print(f"{failures} configs FAILED their check", flush=True)
    return rows


def format_knob_rows(rows: list[dict], configs=None) -> str:
    """The rows of ``bench`` (or of the stored BENCH_RESULTS) as a table: time, TFLOP/s, the
    spread between rounds, speed relative to the "default" row of the same (d, causal) with
    ``utils.bench.compare``'s verdict ("within noise" unless the difference exceeds the spread),
    and the ratio to the fastest peer timed in the same run; ``configs`` picks names."""
    from utils.bench import compare, row_spread, spread_note, vs_best_peer

    lines = [f"{'d':>3s} {'causal':6s} {'config':26s} {'ms':>8s} {'TFLOP/s':>8s} "
             f"{'spread':>6s} {'vs default':>10s} {'':14s} {'vs best peer':s}"]
    for r in rows:
        if configs is not None and r["config"] not in configs:
            continue
        base = [b for b in rows if b["config"] == "default" and b["d"] == r["d"]
                and b["causal"] == r["causal"] and b["ms"]]
        if not r["ms"]:
            lines.append(f"{r['d']:3d} {r['causal']!s:6s} {r['config']:26s} "
                         f"{'check FAILED: not timed':>28s}")
            continue
        ratio, verdict = "", ""
        if base:
            ratio = f"{base[0]['ms'] / r['ms']:9.3f}x"
            verdict = "" if base[0] is r else compare(r, base[0]).verdict
        spread = row_spread(r)
        spread = f"{spread:6.1%}" if spread is not None else ""
        lines.append(f"{r['d']:3d} {r['causal']!s:6s} {r['config']:26s} {r['ms']:8.3f} "
                     f"{r['tflops']:8.1f} {spread:>6s} {ratio:>10s} {verdict:14s} "
                     f"{vs_best_peer(r)}".rstrip())
    timed = [r for r in rows if r["ms"] and (configs is None or r["config"] in configs)]
    if any("ms_rounds" in r or "ms_min" in r for r in timed):  # measured rows, not made up
        lines.append(spread_note(timed))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true",
                        help="SMALL_CASES: three small cases (the default)")
    parser.add_argument("--check", action="store_true", help="every CHECK_CASES entry")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU here; the compile-only checks are tests/test_ch05_compile.py")
        return 0
    cases = [(case, None) for case in CHECK_CASES] if args.check else SMALL_CASES
    return 1 if checks.run_cases(check_case, cases) else 0


if __name__ == "__main__":
    sys.exit(main())
