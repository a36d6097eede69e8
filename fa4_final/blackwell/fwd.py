"""The Blackwell forward (sm_100a): tcgen05 MMAs into tensor memory, warp roles, ping-pong on two
Q tiles, persistent tiles; 2-CTA MMA as a config flag.

What changes from the Hopper forward (``fa4_final.hopper.fwd``) and why (a cycle model, B200, one
128 x 128 tile step at D = 128: MMA 1024 cycles, exp 1024, shared memory 768):

1. The accumulators leave the registers. S and O live in tensor memory (TMEM), written by
   ``tcgen05.mma`` which ONE thread issues for the whole CTA. The warps that compute the softmax
   no longer hold O at all, so they can spend all their registers on one whole row of S each
   (128 fp32 values per thread: one thread per row, the TMEM lane of that row).
2. Roles become finer (``ROLES``): one warp loads, one warp issues MMAs, two softmax warpgroups
   work on two Q tiles (S0, S1) in turn, one correction warpgroup rescales O in TMEM and writes
   the epilogue, one warp stores O. On Hopper the same warpgroup issued its GEMMs, did the
   softmax and rescaled O; here exponentials, rescaling and MMA issue run on different warps, so
   each can overlap the others instead of being serialised by one instruction stream.
3. The exponent unit ties with the tensor cores, so two softmax tricks now pay: part
   of the exponentials go to the FMA pipe (``exp2_emulation_fraction``, packed in pairs) and O is
   rescaled only when a row's max grew by more than tau (``rescale_threshold``).
4. ``two_cta``: two CTAs of a cluster issue one M = 256 ``tcgen05.mma``
   (``cta_group::2``); each CTA loads half of every K and V tile, so each SM reads half of the B
   operands from shared memory and holds half of each K/V stage.

Shared with the Hopper kernel and therefore tested on the H200 for real: which key tiles a tile
visits and which need masks (``tiles``), the visibility rule of each row (``tiles.visible_cols``
via ``mask.apply_mask_row``), the tile order (``common.schedule``), exp2 polynomial coefficients
and selection rule (``fast_math``), the online-softmax bookkeeping (``softmax.OnlineSoftmax``, of
which ``blackwell.softmax.RowSoftmax`` is the one-row-per-thread subclass), and the one compile
path (``runtime.compile``). No Blackwell GPU was available to write this kernel: it is verified by
compiling it for sm_100a (instructions, resources, a side-by-side with FA4's own sm100 forward),
by simulating its pipelines on the CPU and by a cycle model; GPU tests check it against float64
the moment a B200 is present.
"""

from __future__ import annotations

import dataclasses
from enum import IntEnum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import TmemAllocator
from cutlass.tensor_utils import LayoutEnum

from fa4_final.blackwell import umma
from fa4_final.blackwell.config import Q_STAGES, THREADS, TILE_M, BlackwellFwdConfig
from fa4_final.blackwell.roles import WarpRoles, check_roles
from fa4_final.blackwell.softmax import RowSoftmax
from fa4_final.common.constants import LOG2_E, WARP_SIZE
from fa4_final.common.fragments import select_modes
from fa4_final.common.mask import apply_mask_row
from fa4_final.common.pipelines import PipelineSpec, pipeline_args
from fa4_final.common.schedule import rounds, tile_coords, zigzag_tile
from fa4_final.common.tiles import TileWindow, kv_tile_range

WARPS_PER_GROUP = 4


def at(index, phase) -> pipeline.PipelineState:
    """The state of stage ``index`` (a Q tile's own) at barrier parity ``phase``: the
    per-Q-stage pipelines are addressed, not walked (Note [Pipelines])."""
    return pipeline.PipelineState(Q_STAGES, Int32(0), Int32(index), Int32(phase))


class NamedBarrier(IntEnum):
    """Hardware named barriers (bar.sync id); id 0 is __syncthreads."""

    TMEM = 1  # MMA, softmax and correction warps: the TMEM address is written / TMEM is free


class BlackwellForward(WarpRoles):
    """Attention forward on sm_100a; one scheduled tile is ``cfg.cluster_tile_m`` query rows of
    one (batch, head): two Q tiles per CTA (the Q stages), 128 rows each, per CTA of a pair.

    Roles (``self.roles``) and pipelines (``self.pipelines()``, the
    table the kernel builds its barriers from and the CPU simulation replays) are data."""

    TMEM_ROLES = ("softmax0", "softmax1", "correction")  # one TMEM lane (row) per thread

    def __init__(self, dtype, head_dim: int, causal: bool, config: BlackwellFwdConfig,
                 has_window_left: bool = False, has_window_right: bool = False):
        config.check(head_dim)
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = bool(causal)
        self.cfg = config
        self.tile_n = config.tile_n
        self.cta_group = config.cta_group
        self.mma_m = config.mma_m
        self.kv_stages = config.ring_depth(head_dim, dtype.width // 8)
        self.window = TileWindow(config.cluster_tile_m, self.tile_n, self.causal,
                                 has_left=bool(has_window_left),
                                 has_right=bool(has_window_right) and not self.causal)
        self.plan = config.tmem_plan(head_dim)
        soft, corr, rest = config.register_budget(head_dim)
        self.roles = {
            "softmax0": {"warps": (0, 1, 2, 3), "registers": soft,
                         "does": "S0 -> P0 (TMEM), row stats of Q tile 0"},
            "softmax1": {"warps": (4, 5, 6, 7), "registers": soft,
                         "does": "S1 -> P1 (TMEM), row stats of Q tile 1"},
            "correction": {"warps": (8, 9, 10, 11), "registers": corr,
                           "does": "O *= alpha in TMEM; O / l -> shared memory"},
            "mma": {"warps": (12,), "registers": rest,
                    "does": "TMEM alloc/free; one thread issues every tcgen05.mma"},
            "epilogue": {"warps": (13,), "registers": rest, "does": "TMA store of O"},
            "load": {"warps": (14,), "registers": rest, "does": "TMA loads of Q, K, V"},
            "spare": {"warps": (15,), "registers": rest, "does": "gives its registers away"},
        }
        check_roles(self.roles, THREADS, self.TMEM_ROLES)

    def pipelines(self) -> tuple[PipelineSpec, ...]:
        """The pipelines (Note [Pipelines]); arrivals are per barrier phase, counted over the
        CTA pair in 2-CTA mode where the other CTA's threads arrive remotely."""
        g = self.cta_group
        wg = WARPS_PER_GROUP * WARP_SIZE
        epi = WARP_SIZE * len(self.roles["epilogue"]["warps"])
        return (
            PipelineSpec("q", "Q tiles 0, 1 of the tile", "tma_umma", Q_STAGES, "load", "mma",
                         1, 1),
            PipelineSpec("kv", "K and V tiles, in the order K, V, K, V, ...", "tma_umma",
                         self.kv_stages, "load", "mma", 1, 1),
            PipelineSpec("s", "full: S_i in TMEM; empty: P_i in TMEM and O_i rescaled",
                         "umma_async", Q_STAGES, "mma", "softmax_i+correction", 1, 2 * wg * g,
                         True),
            PipelineSpec("o", "O_i final in TMEM (last P V of the tile)", "umma_async",
                         Q_STAGES, "mma", "correction", 1, wg * g, True),
            PipelineSpec("stats", "alpha of a step, then 1 / l at the end (column i of sStats)",
                         "async", Q_STAGES, "softmax_i", "correction", wg, wg, True),
            PipelineSpec("epi", "O_i / l in shared memory, for the TMA store", "async",
                         Q_STAGES, "correction", "epilogue", wg, epi),
        )

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    def _mmas(self):
        """S = Q K^T: A = Q, B = K, both K-major in shared memory. O = P V: A = P from TMEM,
        B = V read MN-major. M = 128 rows per CTA; 256 over a pair (cta_group::2)."""
        major = cute.nvgpu.OperandMajorMode
        group = tcgen05.CtaGroup.TWO if self.cfg.two_cta else tcgen05.CtaGroup.ONE
        qk = sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, major.K, major.K,
                                                Float32, group, (self.mma_m, self.tile_n))
        pv = sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, major.K, major.MN,
                                                Float32, group, (self.mma_m, self.head_dim),
                                                tcgen05.OperandSource.TMEM)
        return qk, pv

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, D)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, D)
        mO: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) float32
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        l2_group: Int32,  # causal tile order: (head, batch) pairs per section (scheduler)
        max_ctas: Int32,  # persistent grid size: the SM count
        stream,
    ):
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type
                           == mO.element_type == self.dtype)):
            raise TypeError(f"q, k, v, out must all be {self.dtype}")
        if const_expr(mLSE.element_type != Float32):
            raise TypeError("lse must be float32")
        d, n = self.head_dim, self.tile_n
        # (b, s, h, d) -> (s, d, h, b): TMA boxes tile modes 0 and 1; V^T is (d, s, h, b)
        mQ, mK, mV, mO = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        mVt = select_modes(mV, [1, 0, 2, 3])
        mLSE = select_modes(mLSE, [2, 1, 0])

        mma_qk, mma_pv = self._mmas()
        tiler_qk, tiler_pv = (self.mma_m, n, d), (self.mma_m, d, n)
        cluster = (self.cta_group, 1, 1)
        cta_layout_vmnk = cute.tiled_divide(cute.make_layout(cluster), (mma_qk.thr_id.shape,))
        # (MMA, MMA_M, MMA_K, STAGE) layouts of the operand tiles in shared memory
        sQ_layout = sm100_utils.make_smem_layout_a(mma_qk, tiler_qk, self.dtype, Q_STAGES)
        sK_layout = sm100_utils.make_smem_layout_b(mma_qk, tiler_qk, self.dtype, self.kv_stages)
        sV_layout = sm100_utils.make_smem_layout_b(mma_pv, tiler_pv, self.dtype, self.kv_stages)
        tP_layout = sm100_utils.make_smem_layout_a(mma_pv, tiler_pv, self.dtype, 1)  # P in TMEM
        sO_layout = sm100_utils.make_smem_layout_epi(self.dtype, LayoutEnum.ROW_MAJOR,
                                                     (TILE_M, d), Q_STAGES)
        # K and V take turns in one ring: a stage holds either (same bytes: n x D / cta_group)
        assert cute.cosize(sK_layout) == cute.cosize(sV_layout)

        load = cpasync.CopyBulkTensorTileG2SOp(
            tcgen05.CtaGroup.TWO if self.cfg.two_cta else tcgen05.CtaGroup.ONE)
        one_q = cute.select(sQ_layout, mode=[0, 1, 2])
        one_k = cute.select(sK_layout, mode=[0, 1, 2])
        one_v = cute.select(sV_layout, mode=[0, 1, 2])
        tma_q, tQ = cute.nvgpu.make_tiled_tma_atom_A(load, mQ, one_q, tiler_qk, mma_qk,
                                                     cta_layout_vmnk.shape)
        tma_k, tK = cute.nvgpu.make_tiled_tma_atom_B(load, mK, one_k, tiler_qk, mma_qk,
                                                     cta_layout_vmnk.shape)
        tma_v, tV = cute.nvgpu.make_tiled_tma_atom_B(load, mVt, one_v, tiler_pv, mma_pv,
                                                     cta_layout_vmnk.shape)
        tma_o, tO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                                cute.select(sO_layout, mode=[0, 1]), (TILE_M, d))
        # a pair's barrier (in the leader CTA) counts both CTAs' bytes
        bytes_q = cute.size_in_bytes(self.dtype, one_q) * self.cta_group
        bytes_kv = cute.size_in_bytes(self.dtype, one_k) * self.cta_group

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * Q_STAGES]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2 * Q_STAGES]
            mbar_o: cute.struct.MemRange[cutlass.Int64, 2 * Q_STAGES]
            mbar_stats: cute.struct.MemRange[cutlass.Int64, 2 * Q_STAGES]
            mbar_epi: cute.struct.MemRange[cutlass.Int64, 2 * Q_STAGES]
            tmem_dealloc: cutlass.Int64  # 2-CTA: the pair frees TMEM together
            tmem_addr: Int32
            sStats: cute.struct.MemRange[Float32, Q_STAGES * TILE_M]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)],
                                   1024]

        # the budget arithmetic of BlackwellFwdConfig.smem_bytes() is the struct's real size
        assert SharedStorage.size_in_bytes() == self.cfg.smem_bytes(d, self.dtype.width // 8)

        num_m_blocks = cute.ceil_div(mQ.shape[0], self.cfg.cluster_tile_m)
        num_tiles = num_m_blocks * mQ.shape[2] * mQ.shape[3]
        clusters = num_tiles
        if const_expr(self.cfg.persistent):
            clusters = cutlass.min(num_tiles, cutlass.max(max_ctas // self.cta_group, 1))
        self.kernel(
            tQ, tK, tV, tO, mLSE, tma_q, tma_k, tma_v, tma_o,
            softmax_scale * LOG2_E, window_left, window_right, l2_group, clusters,
            mma_qk, mma_pv, sQ_layout, sK_layout, sV_layout, tP_layout, sO_layout,
            cta_layout_vmnk, bytes_q, bytes_kv, SharedStorage,
        ).launch(grid=(clusters * self.cta_group, 1, 1), block=[THREADS, 1, 1],
                 cluster=cluster if const_expr(self.cfg.two_cta) else None, stream=stream,
                 min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # device side: set-up and role dispatch
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA coordinate tensors: (s, D, h, b); V^T: (D, s, h, b)
        mK: cute.Tensor,
        mVt: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,  # (s, h, b)
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_o: cute.CopyAtom,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        l2_group: Int32,
        clusters: Int32,  # the persistent grid, in CTA pairs (2-CTA) or CTAs
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tP_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        cta_layout_vmnk: cute.Layout,
        bytes_q: cutlass.Constexpr[int],
        bytes_kv: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == self.warp("load"):
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        pipes = self.make_pipelines(storage, cta_layout_vmnk, bytes_q, bytes_kv)
        tmem_users = self.tmem_threads()
        # TMEM's allocator before the pipelines' init: Note [Allocator barrier first]
        tmem = TmemAllocator(storage.tmem_addr.ptr,
                             barrier_for_retrieve=pipeline.NamedBarrier(int(NamedBarrier.TMEM),
                                                                        tmem_users),
                             allocator_warp_id=self.warp("mma"), is_two_cta=self.cfg.two_cta,
                             two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc.ptr)
        # mbarrier inits must be visible to every thread of the pair before anyone waits
        pipeline.pipeline_init_arrive(cluster_shape_mn=cta_layout_vmnk, is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)  # (128, D, 2)
        sStats = storage.sStats.get_tensor(cute.make_layout((TILE_M, Q_STAGES)))

        pipeline.pipeline_init_wait(cluster_shape_mn=cta_layout_vmnk)

        soft_regs = self.roles["softmax0"]["registers"]
        corr_regs = self.roles["correction"]["registers"]
        rest_regs = self.roles["mma"]["registers"]
        launch_regs = 64 * 1024 // THREADS
        if warp == self.warp("spare"):
            cute.arch.setmaxregister_decrease(rest_regs)
        if warp == self.warp("load"):
            cute.arch.setmaxregister_decrease(rest_regs)
            v, thr_qk, thr_pv = self.pair_slices(mma_qk, mma_pv)
            self.load(mQ, mK, mVt, sQ, sK, sV, tma_q, tma_k, tma_v, thr_qk, thr_pv,
                      self.with_leader(pipes, v),
                      window_left, window_right, l2_group, clusters)
        if warp == self.warp("epilogue"):
            cute.arch.setmaxregister_decrease(rest_regs)
            v, _, _ = self.pair_slices(mma_qk, mma_pv)
            self.epilogue(mO, sO, tma_o, pipes, v, window_left, window_right, l2_group,
                          clusters, mQ.shape[0], mK.shape[0], mQ.shape[2], mQ.shape[3])
        if warp == self.warp("mma"):
            cute.arch.setmaxregister_decrease(rest_regs)
            tmem.allocate(self.plan.columns_allocated)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            v, _, thr_pv = self.pair_slices(mma_qk, mma_pv)
            self.mma(mma_qk, mma_pv, sQ, sK, sV, tmem_ptr, thr_pv, tP_layout,
                     self.with_leader(pipes, v), v,
                     window_left, window_right, l2_group, clusters, mQ.shape[0], mK.shape[0],
                     mQ.shape[2], mQ.shape[3])
            # every softmax and correction thread has arrived: nobody reads TMEM any more
            cute.arch.barrier(barrier_id=int(NamedBarrier.TMEM), number_of_threads=tmem_users)
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr)
        if warp < self.warp("correction"):
            cute.arch.setmaxregister_increase(soft_regs)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            stage = warp // WARPS_PER_GROUP
            v, thr_qk, thr_pv = self.pair_slices(mma_qk, mma_pv)
            self.softmax(stage, self.tmem_tensors(tmem_ptr, thr_qk, thr_pv, tP_layout, stage),
                         thr_qk,
                         mLSE, sStats, pipes, v, scale_log2, window_left, window_right,
                         l2_group, clusters, mQ.shape[0], mK.shape[0], mQ.shape[2], mQ.shape[3])
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TMEM),
                                     number_of_threads=tmem_users, aligned=False)
        if warp >= self.warp("correction") and warp < self.warp("mma"):
            if const_expr(corr_regs > launch_regs):
                cute.arch.setmaxregister_increase(corr_regs)
            else:
                cute.arch.setmaxregister_decrease(corr_regs)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            v, thr_qk, thr_pv = self.pair_slices(mma_qk, mma_pv)
            self.correction(self.tmem_tensors(tmem_ptr, thr_qk, thr_pv, tP_layout), thr_pv,
                            mma_pv, sO, sStats, pipes, window_left, window_right, l2_group,
                            clusters, mQ.shape[0], mK.shape[0], mQ.shape[2], mQ.shape[3])
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TMEM),
                                     number_of_threads=tmem_users, aligned=False)

    # Note [Pipelines]
    # Producer -> consumer, arrivals per phase (2-CTA: the leader's barriers count both CTAs):
    #   q      load -> mma          full: 1 + Q bytes     empty: 1 (tcgen05.commit)
    #   kv     load -> mma          full: 1 + K/V bytes   empty: 1 (tcgen05.commit)
    #   s[i]   mma -> softmax_i     full: 1 (commit after S_i = Q_i K^T)
    #          softmax_i + corr -> mma   empty: 128 (P_i stored) + 128 (O_i rescaled / read)
    #   o[i]   mma -> correction    full: 1 (commit after the tile's last O_i += P_i V)
    #   stats[i] softmax_i -> corr  full: 128, empty: 128 (one float per row in sStats)
    #   epi    correction -> epilogue   full: 128, empty: 32 (after the TMA store read sO)
    # s[i] is not a ring in the usual sense: its two barriers carry two flows, S_i (full) and
    # "P_i is ready and O_i may be written" (empty). The MMA warp waits the empty side before
    # every O_i += P_i V; it never waits before S_i = Q_i K^T, because it issues that MMA after
    # the P_i V that reads P_i (which lives inside S_i's columns), and tcgen05 MMAs of one thread
    # run in issue order. The correction arrives once at start-up (O_i is free), once per
    # rescale and once after reading the final O_i, so its k-th arrival pairs with the softmax's
    # k-th. o[i]'s empty side is never waited on: O_i's reuse is guarded by s[i].
    #
    # Note [The correction runs one phase ahead]
    # Because of its start-up arrival, the correction's last arrival on s[i] (after reading the
    # last tile's O_i) belongs to a phase no softmax arrival completes: one warpgroup's arrivals
    # stay pending on the (leader's) s[i] EMPTY barrier at exit. That is harmless in the CTA's
    # own shared memory. In a pair, the other CTA's correction arrives there remotely; the
    # leader cannot exit before it has: the leader's MMA warp frees TMEM only after the pair's
    # dealloc handshake, which the other CTA's MMA warp joins only after that CTA's softmax and
    # correction warps have passed the TMEM barrier, after their last arrival (FA4's 2-CTA
    # forward has the same structure and no cluster barrier at the end either).
    #
    # Note [Allocator barrier first]
    # In 2-CTA mode the TMEM allocator owns one more mbarrier, the pair's dealloc handshake
    # (tmem_dealloc), which the other CTA's MMA warp arrives on remotely before freeing TMEM.
    # Every mbarrier the peer may touch is published by one cluster barrier: the inits, then
    # fence.mbarrier_init.release.cluster, then barrier.cluster.arrive.relaxed in each CTA, and
    # barrier.cluster.wait before anyone arrives or waits. A relaxed arrive carries no release
    # of its own, so an init issued after it is not covered: the peer could pass its wait and
    # arrive on a barrier not yet initialised. So TmemAllocator, whose constructor initialises
    # the dealloc barrier, is built before pipeline_init_arrive (as FA4 builds it), here and in
    # bwd_pair; a compile test holds the PTX to that order.

    def make_pipelines(self, storage, cta_layout_vmnk, bytes_q: int, bytes_kv: int) -> dict:
        """The cutlass pipelines of ``self.pipelines()``, one dict entry per name (lists for
        the per-Q-stage ones)."""
        mbar = {"q": storage.mbar_q, "kv": storage.mbar_kv, "s": storage.mbar_s,
                "o": storage.mbar_o, "stats": storage.mbar_stats, "epi": storage.mbar_epi}
        tx = {"q": bytes_q, "kv": bytes_kv}
        out = {}
        for spec in self.pipelines():
            common = pipeline_args(spec, mbar[spec.name])
            if spec.kind == "tma_umma":
                out[spec.name] = pipeline.PipelineTmaUmma.create(
                    tx_count=tx[spec.name], cta_layout_vmnk=cta_layout_vmnk, **common)
            elif spec.kind == "umma_async":
                out[spec.name] = pipeline.PipelineUmmaAsync.create(
                    cta_layout_vmnk=cta_layout_vmnk, **common)
            else:
                out[spec.name] = pipeline.PipelineAsync.create(**common)
        if const_expr(self.cfg.two_cta):
            out = self.pair_masks(out)
        return out

    # Note [Pair masks]
    # In a (2, 1, 1) cluster the pipelines' signalling masks are the same in both CTAs:
    # tcgen05.commit arrives on both CTAs' barriers (mask 0b11), and a consumer's release of an
    # umma pipeline arrives on the leader's (rank 0). cutlass computes them from the CTA's rank
    # at run time, in the prologue, and ptxas then carries them across every role's
    # setmaxnreg (it spilled one). Here they are compile-time constants; a compile test evaluates
    # cutlass's own computation on the CPU and checks it gives these values.
    PAIR_COMMIT_MASK = 0b11
    PAIR_LEADER_RANK = 0

    def pair_masks(self, pipes: dict) -> dict:
        out = {}
        for name, pipe in pipes.items():
            if isinstance(pipe, pipeline.PipelineTmaUmma):
                pipe = dataclasses.replace(pipe, consumer_mask=Int32(self.PAIR_COMMIT_MASK))
            elif isinstance(pipe, pipeline.PipelineUmmaAsync):
                pipe = dataclasses.replace(pipe, producer_mask=Int32(self.PAIR_COMMIT_MASK),
                                           consumer_mask=Int32(self.PAIR_LEADER_RANK))
            out[name] = pipe
        return out

    @cute.jit
    def pair_slices(self, mma_qk, mma_pv):
        """(v, this CTA's slice of each MMA): v is the CTA's place in its pair (0 = the leader,
        which issues the MMAs; always 0 without 2-CTA). Each role derives them itself, so no
        value of the prologue has to live across the roles' setmaxnreg."""
        v = Int32(0)
        if const_expr(self.cfg.two_cta):
            v = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        return v, mma_qk.get_slice(v), mma_pv.get_slice(v)

    @cute.jit
    def with_leader(self, pipes: dict, v) -> dict:
        """The TMA-UMMA pipelines with ``is_leader_cta`` taken from this role's own ``v``."""
        if const_expr(not self.cfg.two_cta):
            return pipes
        return {n: dataclasses.replace(p, is_leader_cta=v == 0)
                if isinstance(p, pipeline.PipelineTmaUmma) else p for n, p in pipes.items()}

    def region_stride(self, name: str) -> int:
        """Columns from region ``name``0 to ``name``1: the kernel addresses a Q stage's S, P or
        O with a run-time stage index times this stride (the plan keeps it uniform)."""
        stride = self.plan.offset(f"{name}1") - self.plan.offset(f"{name}0")
        assert Q_STAGES == 2 and stride > 0
        return stride

    @cute.jit
    def tmem_tensors(self, tmem_ptr, thr_qk, thr_pv, tP_layout, stage=None) -> dict:
        """TMEM views at the plan's columns: S[i] ((128, n), 1, 1) and O[i] ((128, D), 1, 1)
        fp32 accumulators; P[i] (MMA, 1, n/16): P_i as the A operand of O_i += P_i V. With a
        run-time ``stage``, one view of each at that stage (a softmax warpgroup's own)."""
        s_layout = thr_qk.make_fragment_C(thr_qk.partition_shape_C(
            (self.mma_m, self.tile_n))).layout
        o_layout = thr_pv.make_fragment_C(thr_pv.partition_shape_C(
            (self.mma_m, self.head_dim))).layout
        p_layout = thr_pv.make_fragment_A(tP_layout.outer)[None, None, None, 0].layout
        views = {}
        for name, layout in (("S", s_layout), ("O", o_layout)):
            if const_expr(stage is None):
                views[name] = [cute.make_tensor(tmem_ptr + self.plan.offset(f"{name}{i}"),
                                                layout) for i in range(Q_STAGES)]
            else:
                views[name] = cute.make_tensor(tmem_ptr + self.plan.offset(f"{name}0")
                                               + stage * self.region_stride(name), layout)
        views["P"] = [cute.make_tensor(cute.recast_ptr(tmem_ptr + self.plan.offset(f"P{i}"),
                                                       dtype=self.dtype), p_layout)
                      for i in range(Q_STAGES)]
        return views

    @cute.jit
    def tile_info(self, tile: Int32, seqlen_q: Int32, seqlen_k: Int32, heads: Int32,
                  batch: Int32, l2_group, window_left, window_right):
        """(m_block, head, batch, n_min, n_max, n_top, n_bottom) of linear tile ``tile``: the
        scheduler's order and tiles.kv_tile_range, identical in every role."""
        num_m_blocks = cute.ceil_div(seqlen_q, self.cfg.cluster_tile_m)
        m_block, head, b = tile_coords(tile, num_m_blocks, heads, batch,
                                       longest_first=self.causal, l2_group=l2_group)
        n_min, n_max, n_top, n_bottom = kv_tile_range(self.window, m_block, seqlen_q, seqlen_k,
                                                      window_left, window_right)
        return m_block, head, b, n_min, n_max, n_top, n_bottom

    @cute.jit
    def my_tiles(self, seqlen_q: Int32, heads: Int32, batch: Int32, clusters: Int32):
        """(cluster index, clusters, number of tiles): the persistent loop's bounds. A pair of
        CTAs is one cluster and computes the same tiles. ``clusters`` comes from the host (a
        kernel parameter): derived from the grid size in every role, ptxas hoisted the
        division above the role branches and spilled it across their setmaxnreg."""
        bidx, _, _ = cute.arch.block_idx()
        num_tiles = cute.ceil_div(seqlen_q, self.cfg.cluster_tile_m) * heads * batch
        return bidx // self.cta_group, clusters, num_tiles

    # ------------------------------------------------------------------------------------------
    # load warp
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load(self, mQ, mK, mVt, sQ, sK, sV, tma_q, tma_k, tma_v, thr_qk, thr_pv, pipes,
             window_left: Int32, window_right: Int32, l2_group: Int32, clusters: Int32):
        """Every tile's K[last], Q0, Q1, V[last], then K, V of each further step: the order the
        MMA warp consumes them (Note [Pipelines])."""
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        heads, batch, heads_kv = mQ.shape[2], mQ.shape[3], mK.shape[2]
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, Q_STAGES)
        state_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.kv_stages)
        cluster, clusters, num_tiles = self.my_tiles(seqlen_q, heads, batch, clusters)
        for r in cutlass.range(rounds(num_tiles, clusters), unroll=1):
            tile = zigzag_tile(r, cluster, clusters)
            if tile < num_tiles:
                m_block, head, b, n_min, n_max, _, _ = self.tile_info(
                    tile, seqlen_q, seqlen_k, heads, batch, l2_group, window_left, window_right)
                head_kv = head // (heads // heads_kv)
                # (mma_m, D, q blocks); (n, D, kv blocks); (D, n, kv blocks)
                gQ = cute.local_tile(mQ[None, None, head, b], (self.mma_m, self.head_dim),
                                     (None, 0))
                gK = cute.local_tile(mK[None, None, head_kv, b], (self.tile_n, self.head_dim),
                                     (None, 0))
                gV = cute.local_tile(mVt[None, None, head_kv, b], (self.head_dim, self.tile_n),
                                     (0, None))
                # TMA partitions: (TMA, STAGE) in smem, (TMA, block) in gmem; in a pair each
                # CTA's slice (thr_qk, thr_pv) is its half of K and V, its own rows of Q
                tQsQ, tQgQ = self._tma_partition(tma_q, sQ, thr_qk.partition_A(gQ))
                tKsK, tKgK = self._tma_partition(tma_k, sK, thr_qk.partition_B(gK))
                tVsV, tVgV = self._tma_partition(tma_v, sV, thr_pv.partition_B(gV))
                if n_max > n_min:
                    state_kv = self.load_one(tma_k, tKgK, tKsK, n_max - 1, pipes["kv"], state_kv)
                    for i in cutlass.range_constexpr(Q_STAGES):
                        state_q = self.load_one(tma_q, tQgQ, tQsQ, Q_STAGES * m_block + i,
                                                pipes["q"], state_q)
                    state_kv = self.load_one(tma_v, tVgV, tVsV, n_max - 1, pipes["kv"], state_kv)
                    for j in cutlass.range(n_max - 1 - n_min, unroll=1):
                        n_block = n_max - 2 - j
                        state_kv = self.load_one(tma_k, tKgK, tKsK, n_block, pipes["kv"],
                                                 state_kv)
                        state_kv = self.load_one(tma_v, tVgV, tVsV, n_block, pipes["kv"],
                                                 state_kv)
        # the last stages' empties (commits of the pair's MMA warp) must land before exit
        pipes["kv"].producer_tail(state_kv)
        pipes["q"].producer_tail(state_q)

    def _tma_partition(self, atom, sX, tXgX_mma):
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 3),
                                     cute.group_modes(tXgX_mma, 0, 3))

    @cute.jit
    def load_one(self, atom, tXgX, tXsX, block, pipe, state):
        """Wait for a free stage, arm its FULL barrier with the bytes, start the TMA copy of
        ``block`` into it; returns the advanced state."""
        pipe.producer_acquire(state)
        cute.copy(atom, tXgX[None, block], tXsX[None, state.index],
                  tma_bar_ptr=pipe.producer_get_barrier(state))
        state.advance()
        return state

    # ------------------------------------------------------------------------------------------
    # MMA warp
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def mma(self, mma_qk, mma_pv, sQ, sK, sV, tmem_ptr, thr_pv, tP_layout, pipes, v,
            window_left, window_right, l2_group, clusters, seqlen_q, seqlen_k, heads, batch):
        """One thread of the leader CTA issues every MMA (the other CTA of a pair only walks
        the tiles). Per tile, with i = 0, 1 the Q stages and j the KV steps:
            S_i = Q_i K_0                      for i = 0, 1
            O_i (+)= P_i V_{j-1}; S_i = Q_i K_j   for j = 1 .. n-1, i = 0, 1
            O_i += P_i V_{n-1}                 for i = 0, 1
        so the tensor cores always have the other Q tile's work while one softmax runs.
        Operands are named by descriptors (blackwell.umma): one 64-bit descriptor per operand
        tile, computed once here, whose low word moves by a constant per K block and stage."""
        d16, n16 = self.head_dim // 16, self.tile_n // 16
        tSrQ = mma_qk.make_fragment_A(sQ)  # (MMA, 1, D/16, Q_STAGES) smem descriptors
        tSrK = mma_qk.make_fragment_B(sK)  # (MMA, 1, D/16, STAGE)
        tOrV = mma_pv.make_fragment_B(sV)  # (MMA, 1, n/16, STAGE)
        tOrP = thr_pv.make_fragment_A(tP_layout.outer)[None, None, None, 0]  # (MMA, 1, n/16)
        ops = {
            "q": umma.smem_desc_words(tSrQ) + (umma.block_offsets(tSrQ.layout, d16),
                                               cute.crd2idx((0, 0, 0, 1), tSrQ.layout)),
            "k": umma.smem_desc_words(tSrK) + (umma.block_offsets(tSrK.layout, d16),
                                               cute.crd2idx((0, 0, 0, 1), tSrK.layout)),
            "v": umma.smem_desc_words(tOrV) + (umma.block_offsets(tOrV.layout, n16),
                                               cute.crd2idx((0, 0, 0, 1), tOrV.layout)),
            "p": umma.block_offsets(tOrP.layout, n16, 32, self.dtype.width),
        }
        base = tmem_ptr.toint()  # TMEM address: lane << 16 | column
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, Q_STAGES)
        state_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.kv_stages)
        p_phase = Int32(0)  # parity of the s[i] EMPTY phase the next O_i += P_i V waits for
        cluster, clusters, num_tiles = self.my_tiles(seqlen_q, heads, batch, clusters)
        for r in cutlass.range(rounds(num_tiles, clusters), unroll=1):
            tile = zigzag_tile(r, cluster, clusters)
            if tile < num_tiles:
                _, _, _, n_min, n_max, _, _ = self.tile_info(
                    tile, seqlen_q, seqlen_k, heads, batch, l2_group, window_left, window_right)
                if (n_max > n_min) & (v == 0):
                    state_q, state_kv, p_phase = self.mma_tile(
                        n_max - n_min, mma_qk, mma_pv, ops, base, pipes, state_q, state_kv,
                        p_phase)

    # Note [One Q stage per iteration]
    # The steady-state loop runs once per (KV step, Q stage), the stage i = t & 1 a run-time
    # value, rather than once per KV step with both stages unrolled. The instructions are the
    # same; what changes is what ptxas sees: with a constant stage the 2 x D/16 shared-memory
    # descriptors of Q are loop invariants, ptxas hoists all of them out of the loop, and the
    # MMA warp (48 registers) spills them. With a run-time stage each descriptor is two uniform
    # adds away from its base and stays in the loop. The tile's first S GEMMs and last P V
    # GEMMs loop over a run-time stage for the same reason.

    @cute.jit
    def mma_tile(self, n_steps, mma_qk, mma_pv, ops, base, pipes, state_q, state_kv, p_phase):
        # Q_i always sits in stage i of pipeline q: each tile takes exactly Q_STAGES of its states
        for _ in cutlass.range_constexpr(Q_STAGES):
            pipes["q"].consumer_wait(state_q)
            state_q.advance()
        pipes["kv"].consumer_wait(state_kv)  # K of the first step
        for i in cutlass.range(Q_STAGES, unroll=1):  # a run-time stage, as in the loop below
            self.gemm_s(mma_qk, ops, base, i, state_kv.index)
            self.commit(pipes["s"], i)
        pipes["kv"].consumer_release(state_kv)
        state_kv.advance()
        state_v = state_kv.clone()
        for t in cutlass.range(Q_STAGES * (n_steps - 1), unroll=1):
            i = t % Q_STAGES
            if i == 0:
                pipes["kv"].consumer_wait(state_kv)  # V of step j - 1
                state_v = state_kv.clone()
                state_kv.advance()
                pipes["kv"].consumer_wait(state_kv)  # K of step j
            self.wait_p(pipes["s"], i, p_phase)  # P_i stored, O_i rescaled
            self.gemm_o(mma_pv, ops, base, i, state_v.index, t >= Q_STAGES)
            self.gemm_s(mma_qk, ops, base, i, state_kv.index)
            self.commit(pipes["s"], i)
            if i == Q_STAGES - 1:
                p_phase ^= 1
                pipes["kv"].consumer_release(state_v)
                pipes["kv"].consumer_release(state_kv)
                state_kv.advance()
        for i in cutlass.range_constexpr(Q_STAGES):  # every Q K^T of this tile is issued
            pipes["q"].consumer_release(pipeline.PipelineState(Q_STAGES, Int32(0), Int32(i),
                                                               Int32(0)))
        pipes["kv"].consumer_wait(state_kv)  # V of the last step
        for i in cutlass.range(Q_STAGES, unroll=1):
            self.wait_p(pipes["s"], i, p_phase)
            self.gemm_o(mma_pv, ops, base, i, state_kv.index, n_steps > 1)
            self.commit(pipes["o"], i)  # O_i is final once this MMA completes
        p_phase ^= 1
        pipes["kv"].consumer_release(state_kv)
        state_kv.advance()
        return state_q, state_kv, p_phase

    @cute.jit
    def gemm_s(self, mma_qk, ops, base, i, k_stage):
        """S_i = Q_i K^T (overwrites S_i: the P_i V that read P_i inside it was issued first)."""
        q_lo, q_hi, q_off, q_stride = ops["q"]
        k_lo, k_hi, k_off, k_stride = ops["k"]
        umma.mma(base + self.plan.offset("S0") + i * self.region_stride("S"),
                 q_lo + i * q_stride, q_hi, q_off, k_lo + k_stage * k_stride, k_hi, k_off,
                 umma.op_instr_desc(mma_qk.op), False, self.cta_group)

    @cute.jit
    def gemm_o(self, mma_pv, ops, base, i, v_stage, accumulate):
        """O_i (+)= P_i V: A = P_i straight from TMEM; ``accumulate`` False at a tile's first
        step (run-time predicate of the first instruction)."""
        v_lo, v_hi, v_off, v_stride = ops["v"]
        umma.mma(base + self.plan.offset("O0") + i * self.region_stride("O"),
                 base + self.plan.offset("P0") + i * self.region_stride("P"), None,
                 ops["p"], v_lo + v_stage * v_stride, v_hi, v_off,
                 umma.op_instr_desc(mma_pv.op), accumulate, self.cta_group)

    @cute.jit
    def commit(self, pipe, i):
        """tcgen05.commit onto FULL barrier ``i`` of an umma pipeline (multicast to both CTAs
        of a pair): it arrives when every MMA this thread issued so far has completed."""
        pipe.producer_commit(at(i, 0))

    @cute.jit
    def wait_p(self, pipe, i, phase):
        """Wait for EMPTY phase of parity ``phase`` of s[i] (Note [Pipelines])."""
        pipe.producer_acquire(at(i, phase))

    # ------------------------------------------------------------------------------------------
    # softmax warpgroups
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def softmax(self, stage, tmem, thr_qk, mLSE, sStats, pipes, v, scale_log2, window_left,
                window_right, l2_group, clusters, seqlen_q, seqlen_k, heads, batch):
        """Warpgroup ``stage`` owns Q tile ``stage``: thread t holds row t of S_stage (TMEM lane
        t) for the whole KV loop, in registers, and leaves P_stage in TMEM."""
        tidx = cute.arch.thread_idx()[0] % (WARPS_PER_GROUP * WARP_SIZE)
        tS = tmem["S"][(None, None), 0, 0]  # (128, n) fp32 in TMEM, this stage's S
        load_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            tS)
        thr_load = load_s.get_slice(tidx)
        tStS = thr_load.partition_S(tS)  # (((32, 32), 1), 1, n/32): n/32 loads of 32 columns
        cS = thr_qk.partition_C(cute.make_identity_tensor((self.mma_m, self.tile_n)))
        tScS = thr_load.partition_D(cS[(None, None), 0, 0])  # (row, col) of each register
        t0ScS = load_s.get_slice(0).partition_D(cS[(None, None), 0, 0])
        # P_stage: 16-bit pairs in the upper half of S_stage's columns (tmem.forward_plan)
        p_cols = self.plan["P0"].columns  # the same for every stage
        tP32 = cute.make_tensor(tS.iterator + (self.plan.offset("P0") - self.plan.offset("S0")),
                                cute.composition(tS.layout, cute.make_layout((TILE_M, p_cols))))
        store_p = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(16)), Float32),
            tP32).get_slice(tidx)
        tPtP = store_p.partition_D(tP32)  # (((16, 32), 1), 1, n/32)
        p_regs = store_p.partition_S(cute.make_identity_tensor((TILE_M, p_cols))).shape
        softmax = RowSoftmax(scale_log2, self.cfg.exp2_emulation_fraction,
                             self.cfg.rescale_threshold)
        stats_phase = Int32(1)  # producer side: the first wait for a free slot passes
        s_phase = Int32(0)
        cluster, clusters, num_tiles = self.my_tiles(seqlen_q, heads, batch, clusters)
        for r in cutlass.range(rounds(num_tiles, clusters), unroll=1):
            tile = zigzag_tile(r, cluster, clusters)
            if tile < num_tiles:
                m_block, head, b, n_min, n_max, n_top, n_bottom = self.tile_info(
                    tile, seqlen_q, seqlen_k, heads, batch, l2_group, window_left, window_right)
                row = (m_block * self.cfg.cluster_tile_m + stage * self.mma_m + v * TILE_M
                       + tidx)
                gLSE = mLSE[None, head, b]
                if n_max > n_min:
                    softmax.reset()
                    step = lambda j, first, masked, left, ph, st: self.softmax_step(  # noqa
                        j, first, masked, left, n_max - 1 - j, row, softmax, thr_load, tStS,
                        tScS, t0ScS, store_p, tPtP, p_regs, pipes["s"], pipes["stats"],
                        sStats, stage, tidx, ph, st, seqlen_q, seqlen_k, window_left,
                        window_right)
                    n_steps = n_max - n_min
                    # the first step visited holds the keys past seqlen_k or the diagonal
                    s_phase, stats_phase = step(0, True, True, self.window.has_left, s_phase,
                                                stats_phase)
                    top_end = 1
                    if const_expr(self.window.masks_right):
                        top_end = cutlass.max(cutlass.min(n_top, n_steps), 1)
                    bottom_start = cutlass.max(n_steps - n_bottom, top_end)
                    for j in cutlass.range(1, top_end, unroll=1):
                        s_phase, stats_phase = step(j, False, True, self.window.has_left,
                                                    s_phase, stats_phase)
                    for j in cutlass.range(top_end, bottom_start, unroll=1):
                        s_phase, stats_phase = step(j, False, False, False, s_phase,
                                                    stats_phase)
                    if const_expr(self.window.has_left):
                        for j in cutlass.range(bottom_start, n_steps, unroll=1):
                            s_phase, stats_phase = step(j, False, True, True, s_phase,
                                                        stats_phase)
                    inv_sum, lse = softmax.finalize()
                    if row < seqlen_q:
                        gLSE[row] = lse[0]
                    stats_phase = self.send_stat(pipes["stats"], stage, stats_phase, sStats,
                                                 tidx, inv_sum[0])
                else:  # no key visible to the whole tile: out = 0 (correction), lse = -inf
                    if row < seqlen_q:
                        gLSE[row] = -Float32.inf

    @cute.jit
    def send_stat(self, pipe, stage, phase, sStats, tidx, value):
        """Hand one float per row to the correction warpgroup through shared memory; returns
        the next phase."""
        pipe.producer_acquire(at(stage, phase))
        sStats[tidx, stage] = value
        pipe.producer_commit(at(stage, phase))
        return phase ^ 1

    @cute.jit
    def softmax_step(self, j, is_first: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool],
                     left: cutlass.Constexpr[bool], n_block, row, softmax, thr_load, tStS,
                     tScS, t0ScS, store_p, tPtP, p_regs, pipe_s, pipe_stats, sStats, stage,
                     tidx, s_phase, stats_phase, seqlen_q, seqlen_k, window_left, window_right):
        """One KV step of one row: S from TMEM, mask, max, alpha to the correction, exp2, P to
        TMEM (then the MMA may go on), row sum last."""
        pipe_s.consumer_wait(at(stage, s_phase))
        rS = cute.make_rmem_tensor(tScS.shape, Float32)  # this thread's row: n fp32
        cute.copy(thr_load, tStS, rS)
        s = rS  # indexed linearly below: s[c] is column c of the row
        if const_expr(masked):
            apply_mask_row(s, tScS, t0ScS, self.window, row, n_block, seqlen_q, seqlen_k,
                           window_left, window_right, mask_left=left)
        alpha, max_scaled = softmax.new_max(s, is_first)
        if const_expr(not is_first):  # the correction warpgroup rescales O_stage meanwhile
            stats_phase = self.send_stat(pipe_stats, stage, stats_phase, sStats, tidx, alpha)
        softmax.exp2_in_place(s, max_scaled)
        rP32 = cute.make_rmem_tensor(p_regs, Float32)
        rP = cute.make_tensor(cute.recast_ptr(rP32.iterator, dtype=self.dtype), rS.layout)
        rP.store(rS.load().to(self.dtype))
        cute.copy(store_p, rP32, tPtP)
        cute.arch.fence_view_async_tmem_store()  # P visible to the MMA before we say so
        pipe_s.consumer_release(at(stage, s_phase))
        softmax.add_to_sum(s, alpha, is_first)
        return s_phase ^ 1, stats_phase

    # ------------------------------------------------------------------------------------------
    # correction warpgroup
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def correction(self, tmem, thr_pv, mma_pv, sO, sStats, pipes, window_left, window_right,
                   l2_group, clusters, seqlen_q, seqlen_k, heads, batch):
        """Thread t owns row t of O_0 and O_1 (TMEM lane t): rescales it when the softmax's
        alpha asks for it, and writes O / l to shared memory at the end of each tile."""
        tidx = cute.arch.thread_idx()[0] % (WARPS_PER_GROUP * WARP_SIZE)
        for i in cutlass.range_constexpr(Q_STAGES):  # O_i is free at the start
            pipes["s"].consumer_release(at(i, 0))
        # both Q stages send the same number of stats per tile: one phase serves both
        stats_phase = Int32(0)
        state_epi = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, Q_STAGES)
        o_phase = Int32(0)
        cluster, clusters, num_tiles = self.my_tiles(seqlen_q, heads, batch, clusters)
        for r in cutlass.range(rounds(num_tiles, clusters), unroll=1):
            tile = zigzag_tile(r, cluster, clusters)
            if tile < num_tiles:
                _, _, _, n_min, n_max, _, _ = self.tile_info(
                    tile, seqlen_q, seqlen_k, heads, batch, l2_group, window_left, window_right)
                if n_max > n_min:
                    for _j in cutlass.range(n_max - n_min - 1, unroll=1):
                        for i in cutlass.range_constexpr(Q_STAGES):
                            alpha = self.receive_stat(pipes["stats"], i, stats_phase, sStats,
                                                      tidx)
                            # Note [Per-row threshold]: the warp skips O when no row needs it
                            if cute.arch.vote_any_sync(alpha < Float32(1.0)):
                                self.rescale_o(tmem["O"][i], tidx, alpha)
                            pipes["s"].consumer_release(at(i, 0))
                        stats_phase ^= 1
                    for i in cutlass.range_constexpr(Q_STAGES):
                        inv_sum = self.receive_stat(pipes["stats"], i, stats_phase, sStats, tidx)
                        pipes["o"].consumer_wait(at(i, o_phase))
                        state_epi = self.store_o(tmem["O"][i], thr_pv, mma_pv, sO, pipes["epi"],
                                                 state_epi, tidx, inv_sum, False)
                        cute.arch.fence_view_async_tmem_load()  # O_i read: the MMA may reuse it
                        pipes["s"].consumer_release(at(i, 0))
                    stats_phase ^= 1
                    o_phase ^= 1
                else:
                    for i in cutlass.range_constexpr(Q_STAGES):
                        state_epi = self.store_o(tmem["O"][i], thr_pv, mma_pv, sO, pipes["epi"],
                                                 state_epi, tidx, Float32(0.0), True)
        pipes["epi"].producer_tail(state_epi)

    @cute.jit
    def receive_stat(self, pipe, stage, phase, sStats, tidx):
        pipe.consumer_wait(at(stage, phase))
        value = sStats[tidx, stage]
        pipe.consumer_release(at(stage, phase))
        return value

    @cute.jit
    def rescale_o(self, tOtO, tidx, alpha: Float32):
        """O_row *= alpha in TMEM, 16 columns at a time: tcgen05.ld, 8 FMUL2, tcgen05.st."""
        chunk = 16
        tO = tOtO[(None, None), 0, 0]  # (128, D)
        tO_c = cute.composition(tO, cute.make_layout((TILE_M, chunk)))
        ld = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(chunk)), Float32), tO_c
        ).get_slice(tidx)
        st = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(chunk)), Float32), tO_c
        ).get_slice(tidx)
        tOtO_t2r = ld.partition_S(tO_c)
        tOtO_r2t = st.partition_D(tO_c)
        regs = ld.partition_D(cute.make_identity_tensor((TILE_M, chunk))).shape
        for k in cutlass.range_constexpr(self.head_dim // chunk):
            rO = cute.make_rmem_tensor(regs, Float32)
            cute.copy(ld, cute.make_tensor(tOtO_t2r.iterator + k * chunk, tOtO_t2r.layout), rO)
            for e in cutlass.range_constexpr(0, cute.size(rO), 2):
                rO[e], rO[e + 1] = cute.arch.mul_packed_f32x2((rO[e], rO[e + 1]),
                                                              (alpha, alpha))
            cute.copy(st, rO, cute.make_tensor(tOtO_r2t.iterator + k * chunk, tOtO_r2t.layout))
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def store_o(self, tOtO, thr_pv, mma_pv, sO, pipe_epi, state, tidx, inv_sum: Float32,
                zeros: cutlass.Constexpr[bool]):
        """O_row / l (or zeros for a tile that sees no key) -> bf16 -> the next sO slot, in
        chunks of 16 columns (tcgen05.ld shaped for the epilogue's shared-memory layout), then
        hand the slot to the epilogue warp."""
        chunk = 32 * 8 // self.dtype.width
        pipe_epi.producer_acquire(state)
        sO_i = sO[None, None, state.index]  # (128, D), this CTA's rows
        tOsO = mma_pv.get_slice(0).partition_C(sO_i)  # CTA 0's view: sO holds 128 rows
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((self.mma_m, self.head_dim)))
        per = cute.make_layout((TILE_M, chunk))
        tOtO_c = cute.logical_divide(tOtO, per)
        tOsO_c = cute.logical_divide(tOsO, per)
        tOcO_c = cute.logical_divide(tOcO, per)
        atom = sm100_utils.get_tmem_load_op((self.mma_m, self.head_dim, self.tile_n),
                                            LayoutEnum.ROW_MAJOR, self.dtype, Float32,
                                            (TILE_M, chunk), use_2cta_instrs=self.cfg.two_cta)
        tiled_load = tcgen05.make_tmem_copy(atom, tOtO_c[(None, None), 0])
        thr_load = tiled_load.get_slice(tidx)
        store = cute.make_tiled_copy_D(sm100_utils.get_smem_store_op(
            LayoutEnum.ROW_MAJOR, self.dtype, Float32, tiled_load), tiled_load)
        tTt = thr_load.partition_S(tOtO_c[(None, None), None])
        tTs = thr_load.partition_D(tOsO_c[(None, None), None])
        tTc = thr_load.partition_D(tOcO_c[(None, None), None])
        # a run-time chunk loop: unrolled, ptxas hoists all D/16 swizzled sO addresses out of
        # the tile loop and the correction (80 registers) spills them at fp16
        # (Note [One Q stage per iteration] for the same effect in the MMA warp)
        for c in cutlass.range(self.head_dim // chunk, unroll=1):
            rO = cute.make_rmem_tensor(tTc[None, 0, 0, 0].shape, Float32)
            if const_expr(zeros):
                rO.fill(0.0)
            else:
                cute.copy(tiled_load, tTt[None, 0, 0, c], rO)
                for e in cutlass.range_constexpr(0, cute.size(rO), 2):
                    rO[e], rO[e + 1] = cute.arch.mul_packed_f32x2((rO[e], rO[e + 1]),
                                                                  (inv_sum, inv_sum))
            rOut = cute.make_rmem_tensor(rO.shape, self.dtype)
            rOut.store(rO.load().to(self.dtype))
            cute.copy(store, rOut, tTs[None, 0, 0, c])
        cute.arch.fence_view_async_shared()  # generic-proxy writes -> visible to the TMA store
        pipe_epi.producer_commit(state)
        state.advance()
        return state

    # ------------------------------------------------------------------------------------------
    # epilogue warp
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def epilogue(self, mO, sO, tma_o, pipes, v, window_left, window_right, l2_group, clusters,
                 seqlen_q, seqlen_k, heads, batch):
        """TMA-store both Q tiles' O of every tile (the store clips rows past seqlen_q), then
        hand each slot back once the store has read it."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, Q_STAGES)
        cluster, clusters, num_tiles = self.my_tiles(seqlen_q, heads, batch, clusters)
        for r in cutlass.range(rounds(num_tiles, clusters), unroll=1):
            tile = zigzag_tile(r, cluster, clusters)
            if tile < num_tiles:
                m_block, head, b, _, _, _, _ = self.tile_info(
                    tile, seqlen_q, seqlen_k, heads, batch, l2_group, window_left, window_right)
                gO = cute.local_tile(mO[None, None, head, b], (TILE_M, self.head_dim),
                                     (None, 0))  # (128, D, row blocks)
                held = []
                for i in cutlass.range_constexpr(Q_STAGES):
                    pipes["epi"].consumer_wait(state)
                    block = (m_block * Q_STAGES + i) * self.cta_group + v
                    tOsO, tOgO = cpasync.tma_partition(
                        tma_o, 0, cute.make_layout(1),
                        cute.group_modes(sO[None, None, state.index], 0, 2),
                        cute.group_modes(gO[None, None, block], 0, 2))
                    cute.copy(tma_o, tOsO, tOgO)
                    cute.arch.cp_async_bulk_commit_group()
                    held.append(state.clone())
                    state.advance()
                for i in cutlass.range_constexpr(Q_STAGES):
                    cute.arch.cp_async_bulk_wait_group(Q_STAGES - 1 - i, read=True)
                    pipes["epi"].consumer_release(held[i])
        cute.arch.cp_async_bulk_wait_group(0, read=True)
