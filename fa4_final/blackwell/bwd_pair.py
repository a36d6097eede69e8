"""The 2-CTA mode of the Blackwell backward (sm_100a): a CTA pair shares every GEMM
(``tcgen05.mma.cta_group::2``) and exchanges dS through distributed shared memory, so each CTA
adds half of what a 1-CTA CTA adds to the float32 dQ accumulator. ``BlackwellBwdConfig(
two_cta=True)``; the default stays 1-CTA (``fa4_final.blackwell.bwd``), because this kernel has
never run on a GPU: it is verified by compiling it for sm_100a and by replaying its pipelines in a
CPU simulation, nothing more.

A cluster (2, 1, 1) owns 256 keys, 128 per CTA (its TMEM lanes); CTA 0, the leader, issues every
MMA from one thread, its commits reach both CTAs' barriers (the forward's pairs, fa4_final.
blackwell.fwd). Per step of 128 queries:

    S^T  = K Q^T     M = 256 keys, N = 128 queries  A: own 128 keys x D   B: 64 queries x D
    dP^T = V dO^T    the same shapes
    dV  += P^T dO    M = 256, N = D, K = 128        A: P^T from TMEM      B: dOt, D/2 x 128
    dK  += dS^T Q    M = 256, N = D, K = 128        A: dS^T from TMEM     B: Qt, D/2 x 128
    dQ   = dS K      M = 128 queries, N = D, K = 256 keys
                                                    A: dS, 64 queries x 256 keys
                                                    B: Kt, D/2 x 256 keys

(A and B as each CTA holds them: a pair MMA splits A by M and B by N.) Q and dO are split by
queries for S^T and dP^T but by D for dK and dV, so each CTA loads a second, differently split copy
of them (Qt, dOt; FA4's mQt, mdOt), and K^T split by D (Kt). dQ's accumulator, M = 128 over the
pair, is ((64, (D/2, 2)) : (lane, (column, 64 lanes))) in each CTA: lanes i and 64 + i hold the two
halves of query i's row, D/2 columns. CTA r's 64 queries are one contiguous 64 x D block of the
Hopper accumulator order (bwd.py Note [dQ accumulator order]): each CTA issues 2 bulk adds of 8 KB
per 32-column chunk of its D/2 columns, D/32 a step, half of the 1-CTA kernel's 2 D/32 (4 instead
of 8 at D = 128). Why it halves: the pair's dQ GEMM sums over its 256 keys before anything leaves
the SM, so a query tile receives one 128 x D add per 256 keys (64 x D from each CTA) where the
1-CTA kernel sent one per 128 keys: the global float32 adds halve in count and in bytes, and so
does the contention of CTAs adding into the same accumulator lines.

The dS exchange (Note [The dS exchange]): CTA r's dQ A needs dS for its 64 queries and all 256
keys; its own keys' block it writes itself, the peer's 16 KB arrive from the peer's warpgroup r
by st.async, 16 bytes a store, counted by an mbarrier in the receiving CTA (not a bulk copy:
that needs the 16 KB staged first, and a staging buffer does not fit beside this kernel's two
32-column dQ buffers at D = 128, 231424 + 16384 B > 232448 B; FA4 shrinks its dQ staging to four
8-column buffers and stages dS instead). Each step it costs each CTA 16 KB into the peer's
shared memory plus one relay arrival (the follower's MMA warp tells the leader its barrier
completed), and the dQ GEMM waits for it.

Note [The pair's shared memory]
Per CTA (``BlackwellBwdConfig.pair_smem_fields``, asserted against the struct):

                                                D = 128   D = 64
    small fields (barriers, TMEM address, the     2048     3072   (1 / 2 Q stages)
      MMA warp's descriptor words, lse, delta
      per Q stage)
    K, V (own keys)                              65536    32768
    Kt (D/2 x 256 keys)                          32768    16384
    Q, Qt per Q stage                            32768    32768   (1 / 2 stages)
    dO, dOt per dO stage                         32768    32768   (1 / 2 stages)
    dS (64 queries x 256 keys)                   32768    32768
    dQ staging, two 32-column buffers            32768    32768
    = total                                     231424   183296   (limit 232448)

dS^T, dK's A, lives in TMEM (tmem.backward_pair_plan): a dS^T tile in
shared memory as the 1-CTA kernel keeps it would need 32 KB more, 264192 B at D = 128. TMEM per
CTA: S^T 128 + dP^T 128 + dV D + dK D columns (512 at D = 128); P^T over S^T's upper half, dS^T
over dP^T's upper half, dQ (D/2) over dP^T's lower half.

Note [The pair's handshakes]
The pipelines (``pipelines()``, replayed by the course's pipeline simulation):
    kv    load -> mma     FULL in the leader: 1 + both CTAs' K, V, Kt bytes; EMPTY: commit (both)
    q     load -> mma     FULL: 1 + both CTAs' Q, Qt bytes    EMPTY: commit after dK (both CTAs)
    do    load -> mma     FULL: 1 + both CTAs' dO, dOt bytes  EMPTY: commit after dV
    rows  load -> compute each CTA's own: lse and delta of the step's 128 queries (bulk copies);
                          EMPTY: its 8 compute warps after dS. Not in the Q stage as in 1-CTA: the
                          pair's Q FULL barrier is in the leader, the follower's warps cannot wait
                          on it.
    s     mma -> compute  FULL: commit (both)   EMPTY in the leader: 16 warps (P^T in TMEM)
    dp    mma -> compute  FULL: commit (both)   EMPTY in the leader: 16 warps (dS^T in TMEM, own
                          dS block stored)
    dsx   peer -> mma     FULL in each CTA: 1 (the peer's remote expect_tx) + 16 KB of st.async
    dsx_relay             in the leader: 1 (the follower's MMA warp, after its dsx FULL)
    dq    mma -> dq warps FULL: commit (both; also frees both CTAs' dS)   EMPTY in the leader:
                          8 warps (dQ read); the leader's MMA warp waits for the last one before
                          it leaves, so no remote arrival is in flight when it exits
    dkv   mma -> compute  FULL: commit after the pair's last step (both)
Arrivals on the leader's barriers are one per warp (an elected lane after __syncwarp), as FA4's.

Not built: a deterministic mode (refused: the turn counters of the 1-CTA kernel order key tiles,
and the pair's two CTAs add disjoint halves; it would need its own turn order). What the compile
cannot show and a B200 must: that the pair is faster (a cycle model says shared memory per CTA
drops; the dQ GEMM's wait for the exchange is new); that the exchange's bytes reach the tcgen05
MMA (the exchange is fenced on both sides and its waits acquire at cluster scope,
Note [The dS exchange]; the same steps run on the H200 with a bulk store as the async-proxy
reader); and the gradients themselves (GPU tests compare them with float64 when a B200 is
present).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import TmemAllocator

from fa4_final.blackwell import peer, umma
from fa4_final.blackwell.bwd import (
    GROUP_THREADS,
    THREADS,
    WARPS_PER_GROUP,
    BlackwellBackward,
    NamedBarrier,
    at,
)
from fa4_final.blackwell.config import BWD_DQ_BUFFERS, BWD_DQ_CHUNK
from fa4_final.blackwell.roles import set_registers
from fa4_final.blackwell.tmem import TMEM_LANES
from fa4_final.common.atomics import bulk_add_f32
from fa4_final.common.constants import LOG2_E
from fa4_final.common.fragments import select_modes
from fa4_final.common.pipelines import PipelineSpec, pipeline_args
from fa4_final.common.tiles import TileWindow

PAIR = 2  # CTAs of a cluster
CLUSTER = (PAIR, 1, 1)  # the launch's cluster shape: the two CTAs of a pair are grid x 2 p, 2 p + 1
COMPUTE_WARPS = 2 * WARPS_PER_GROUP
DESC_WORDS = 8  # the leader's MMA operands in shared memory (Note [Descriptors read each step])
DQ_WARPS = WARPS_PER_GROUP


class BlackwellBackwardPair(BlackwellBackward):
    """dK, dV and the float32 dQ accumulator on sm_100a, one CTA pair per 256 keys."""

    def __init__(self, dtype, head_dim: int, causal: bool, config,
                 has_window_left: bool = False, has_window_right: bool = False):
        if not config.two_cta:
            raise ValueError("BlackwellBackwardPair needs BlackwellBwdConfig(two_cta=True)")
        if config.deterministic:
            raise ValueError("the 2-CTA backward has no deterministic mode (its two CTAs add "
                             "disjoint halves of dQ; the turn counters are per key tile): use "
                             "two_cta=False with deterministic=True")
        super().__init__(dtype, head_dim, causal, config, has_window_left, has_window_right)
        self.pair_tile_n = PAIR * self.tile_n
        # a pair's query tiles are those that see any of its 256 keys (bwd_tiles.q_tile_range)
        self.window = TileWindow(self.tile_m, self.pair_tile_n, self.causal,
                                 has_left=bool(has_window_left),
                                 has_right=bool(has_window_right) and not self.causal)
        does = {"compute0": "P^T, dS^T (TMEM) and dS for queries 0-63: into CTA 0's dS",
                "compute1": "the same for queries 64-127: into CTA 1's dS",
                "dq": "its CTA's 64 queries of dQ: TMEM -> shared memory -> bulk float32 adds",
                "mma": "TMEM alloc/free; leader: one thread issues every pair tcgen05.mma; "
                       "follower: relays its dS-exchange barrier to the leader",
                "load": "TMA: K, V, Kt once; Q + Qt, lse + delta, dO + dOt per step"}
        for role, text in does.items():
            self.roles[role]["does"] = text

    def pipelines(self) -> tuple[PipelineSpec, ...]:
        """The pair's pipelines (Note [The pair's handshakes]); arrivals per barrier phase. Kinds:
        tma_umma: FULL in the leader, counting both CTAs' TMA bytes, EMPTY in each CTA (the
        leader's commit reaches both); umma_async: FULL in each CTA (commit to both), EMPTY in
        the leader, counting both CTAs' warps; local: both barriers in each CTA, its own
        threads; peer: FULL in each CTA, armed and filled by the other CTA (no EMPTY: dq's FULL
        frees it); relay: one barrier in the leader, the follower's MMA warp arrives."""
        return (
            PipelineSpec("kv", "K, V (own keys), Kt (D/2 x 256 keys), once", "tma_umma", 1,
                         "load", "mma", 1, 1),
            PipelineSpec("q", "Q (64 queries), Qt (D/2) per step", "tma_umma", self.q_stages,
                         "load", "mma", 1, 1),
            PipelineSpec("do", "dO (64 queries), dOt (D/2) per step", "tma_umma",
                         self.do_stages, "load", "mma", 1, 1),
            PipelineSpec("rows", "lse (log2 units) and delta of the step's 128 queries", "local",
                         self.q_stages, "load", "compute", 1, COMPUTE_WARPS),
            PipelineSpec("s", "full: S^T in TMEM; empty: P^T in TMEM", "umma_async", 1, "mma",
                         "compute", 1, PAIR * COMPUTE_WARPS),
            PipelineSpec("dp", "full: dP^T in TMEM; empty: dS^T in TMEM, own dS block stored",
                         "umma_async", 1, "mma", "compute", 1, PAIR * COMPUTE_WARPS),
            PipelineSpec("dsx", "full: the peer's 16 KB of dS (block 1 - rank of sdS)", "peer", 1,
                         "compute (peer)", "mma (leader) / relay (follower)", 1, 0),
            PipelineSpec("dsx_relay", "the follower's dsx FULL completed", "relay", 1,
                         "mma warp (follower)", "mma (leader)", 1, 0),
            PipelineSpec("dq", "full: dQ in TMEM, dS read; empty: dQ read", "umma_async", 1,
                         "mma", "dq (+ compute: dS free)", 1, PAIR * DQ_WARPS),
            PipelineSpec("dkv", "full: the pair's last dK, dV MMA done", "umma_async", 1, "mma",
                         "compute", 1, PAIR * COMPUTE_WARPS),
        )


    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    def tiled_mmas(self):
        """(S^T and dP^T; dV; dK; dQ), every one a pair MMA (cta_group::2). S^T, dP^T, dV, dK:
        M = 256 keys (128 per CTA, its TMEM lanes); dV and dK read their A (P^T, dS^T) from
        TMEM. dQ: M = 128 queries (64 per CTA), K = the pair's 256 keys."""
        major = cute.nvgpu.OperandMajorMode
        two = tcgen05.CtaGroup.TWO
        tmem = tcgen05.OperandSource.TMEM
        dt, d, m, n2 = self.dtype, self.head_dim, self.tile_m, self.pair_tile_n
        sdp = sm100_utils.make_trivial_tiled_mma(dt, dt, major.K, major.K, Float32, two, (n2, m))
        dv = sm100_utils.make_trivial_tiled_mma(dt, dt, major.K, major.MN, Float32, two, (n2, d),
                                                tmem)
        dk = sm100_utils.make_trivial_tiled_mma(dt, dt, major.K, major.MN, Float32, two, (n2, d),
                                                tmem)
        dq = sm100_utils.make_trivial_tiled_mma(dt, dt, major.MN, major.MN, Float32, two, (m, d))
        return sdp, dv, dk, dq

    def smem_layouts(self, mmas) -> dict:
        """One CTA's share of every pair operand (CuTe's layouts of a cta_group::2 MMA are per
        CTA): K, V its 128 keys; Q, dO 64 queries; Qt, dOt D/2 columns; Kt D/2 columns of the
        pair's 256 keys; dS 64 queries x 256 keys. P^T and dS^T (in TMEM) as dV's and dK's A."""
        return self.operand_layouts(mmas, self.pair_tile_n)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, D)
        mV: cute.Tensor,
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mLSE2: cute.Tensor,  # (batch, heads, seqlen_q_padded) float32, log2 units (bwd_pre)
        mDelta: cute.Tensor,  # (batch, heads, seqlen_q_padded) float32 (bwd_pre)
        mdQaccum: cute.Tensor,  # (batch, heads, seqlen_q_padded * D) float32, zeroed (bwd_pre)
        mdK: cute.Tensor,  # (batch, seqlen_k, heads_kv, D) out
        mdV: cute.Tensor,
        mTurn: cute.Tensor,  # unused: the pair has no deterministic mode
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
    ):
        self.check_dtypes(mQ, mK, mV, mdO, mdK, mdV)
        d, m, n2 = self.head_dim, self.tile_m, self.pair_tile_n
        # (b, s, h, d) -> (s, d, h, b): TMA boxes tile modes 0 and 1; the transposed views
        # (d, s, h, b) are the B operands split by D (Qt, dOt, Kt)
        mQ, mK, mV, mdO = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO)]
        mQt, mKt, mdOt = [select_modes(t, [1, 0, 2, 3]) for t in (mQ, mK, mdO)]
        mLSE2, mDelta, mdQaccum = [select_modes(t, [2, 1, 0]) for t in (mLSE2, mDelta, mdQaccum)]
        mmas = self.tiled_mmas()
        sdp, dv, dk, dq = mmas
        lay = self.smem_layouts(mmas)
        vmnk = self.cluster_layout(sdp).shape
        load = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.TWO)
        one = lambda lay_: cute.select(lay_, mode=[0, 1, 2])  # noqa: E731
        tma = {}
        tma["K"], tK = cute.nvgpu.make_tiled_tma_atom_A(load, mK, lay["K"], (n2, m, d), sdp,
                                                        vmnk)
        tma["V"], tV = cute.nvgpu.make_tiled_tma_atom_A(load, mV, lay["V"], (n2, m, d), sdp,
                                                        vmnk)
        tma["Q"], tQ = cute.nvgpu.make_tiled_tma_atom_B(load, mQ, one(lay["Q"]), (n2, m, d), sdp,
                                                        vmnk)
        tma["dO"], tdO = cute.nvgpu.make_tiled_tma_atom_B(load, mdO, one(lay["dO"]), (n2, m, d),
                                                          sdp, vmnk)
        tma["Qt"], tQt = cute.nvgpu.make_tiled_tma_atom_B(load, mQt, one(lay["Qt"]), (n2, d, m),
                                                          dk, vmnk)
        tma["dOt"], tdOt = cute.nvgpu.make_tiled_tma_atom_B(load, mdOt, one(lay["dOt"]),
                                                            (n2, d, m), dv, vmnk)
        tma["Kt"], tKt = cute.nvgpu.make_tiled_tma_atom_B(load, mKt, lay["Kt"], (m, d, n2), dq,
                                                          vmnk)
        size = lambda lay_: cute.size_in_bytes(self.dtype, lay_)  # noqa: E731
        # the leader's FULL barriers count both CTAs' bytes
        bytes_kv = PAIR * (size(lay["K"]) + size(lay["V"]) + size(lay["Kt"]))
        bytes_q = PAIR * (size(one(lay["Q"])) + size(one(lay["Qt"])))
        bytes_do = PAIR * (size(one(lay["dO"])) + size(one(lay["dOt"])))
        qs, ds = self.q_stages, self.do_stages

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * qs]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * ds]
            mbar_rows: cute.struct.MemRange[cutlass.Int64, 2 * qs]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dp: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dq: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dkv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dsx: cutlass.Int64
            mbar_dsx_relay: cutlass.Int64
            tmem_dealloc: cutlass.Int64  # the pair frees TMEM together
            tmem_addr: Int32
            desc_lo: cute.struct.Align[cute.struct.MemRange[Int32, DESC_WORDS], 16]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, m * qs], 16]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, m * qs], 16]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["K"])], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["V"])], 1024]
            sKt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["Kt"])],
                                   1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["Q"])], 1024]
            sQt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["Qt"])],
                                   1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["dO"])],
                                   1024]
            sdOt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["dOt"])],
                                    1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["dS"])],
                                   1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, m * BWD_DQ_CHUNK
                                                        * BWD_DQ_BUFFERS], 1024]

        # the budget arithmetic of BlackwellBwdConfig.pair_smem_fields() is the struct's size
        assert SharedStorage.size_in_bytes() == self.cfg.smem_bytes(d, self.dtype.width // 8)
        num_pairs = cute.ceil_div(mK.shape[0], n2)
        self.kernel(
            tQ, tQt, tK, tKt, tV, tdO, tdOt, mLSE2, mDelta, mdQaccum, mdK, mdV,
            tma["Q"], tma["Qt"], tma["K"], tma["Kt"], tma["V"], tma["dO"], tma["dOt"],
            softmax_scale, softmax_scale * LOG2_E, window_left, window_right, mQ.shape[2],
            bytes_q, bytes_do, bytes_kv, SharedStorage,
        ).launch(grid=(num_pairs * PAIR, mK.shape[2], mK.shape[3]), block=[THREADS, 1, 1],
                 cluster=CLUSTER, stream=stream, min_blocks_per_mp=1)

    def cluster_layout(self, mma_sdp):
        return cute.tiled_divide(cute.make_layout((PAIR, 1, 1)), (mma_sdp.thr_id.shape,))

    # ------------------------------------------------------------------------------------------
    # device side: set-up and role dispatch
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA coordinate tensors: (s, D, h, b); the transposed (D, s, h, b)
        mQt: cute.Tensor,
        mK: cute.Tensor,
        mKt: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mdOt: cute.Tensor,
        mLSE2: cute.Tensor,  # (s_padded, h, b)
        mDelta: cute.Tensor,
        mdQaccum: cute.Tensor,  # (s_padded * D, h, b)
        mdK: cute.Tensor,  # (b, s, h_kv, D)
        mdV: cute.Tensor,
        tma_q: cute.CopyAtom,
        tma_qt: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_kt: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_do: cute.CopyAtom,
        tma_dot: cute.CopyAtom,
        softmax_scale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        heads: Int32,
        bytes_q: cutlass.Constexpr[int],
        bytes_do: cutlass.Constexpr[int],
        bytes_kv: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        atoms = {"Q": tma_q, "Qt": tma_qt, "K": tma_k, "Kt": tma_kt, "V": tma_v, "dO": tma_do,
                 "dOt": tma_dot}
        if warp == self.warp("load"):
            for atom in atoms.values():
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        mmas = self.tiled_mmas()
        lay = self.smem_layouts(mmas)
        vmnk = self.cluster_layout(mmas[0])
        pipes = self.make_pair_pipelines(storage, vmnk, bytes_q, bytes_do, bytes_kv)
        bars = {"rows_full": storage.mbar_rows.data_ptr(),
                "rows_empty": storage.mbar_rows.data_ptr() + self.q_stages,
                "dsx": storage.mbar_dsx.ptr, "dsx_relay": storage.mbar_dsx_relay.ptr}
        if warp == 0:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(self.q_stages):
                    cute.arch.mbarrier_init(bars["rows_full"] + i, 1)
                    cute.arch.mbarrier_init(bars["rows_empty"] + i, COMPUTE_WARPS)
                cute.arch.mbarrier_init(bars["dsx"], 1)
                cute.arch.mbarrier_init(bars["dsx_relay"], 1)
        # the allocator initialises the pair's TMEM-free barrier here, before the cluster arrive
        # that publishes every mbarrier to the peer (fwd Note [Allocator barrier first])
        tmem_users = self.tmem_threads()
        tmem = TmemAllocator(storage.tmem_addr.ptr,
                             barrier_for_retrieve=pipeline.NamedBarrier(int(NamedBarrier.TMEM),
                                                                        tmem_users),
                             allocator_warp_id=self.warp("mma"), is_two_cta=True,
                             two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc.ptr)
        # every mbarrier initialised and visible to both CTAs before anyone waits or arrives
        pipeline.pipeline_init_arrive(cluster_shape_mn=vmnk, is_relaxed=True)
        smem = self.smem_tensors(storage, lay)
        pipeline.pipeline_init_wait(cluster_shape_mn=vmnk)

        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        work_of = lambda: self.pair_work(seqlen_q, seqlen_k, heads, mK.shape[2],  # noqa: E731
                                         window_left, window_right)
        regs = {name: r["registers"] for name, r in self.roles.items()}
        if warp >= self.warp("mma"):  # warpgroup 3: one budget (bwd Note [Register plan])
            set_registers(regs["mma"], THREADS)
            if warp == self.warp("load"):
                n_block, r, head_kv, b, work = work_of()
                self.load(mQ, mQt, mK, mKt, mV, mdO, mdOt, mLSE2, mDelta, smem, atoms, mmas,
                          self.with_leader(pipes, r), bars, n_block, r, head_kv, b, work)
            if warp == self.warp("mma"):
                tmem.allocate(self.plan.columns_allocated)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                _, r, _, _, work = work_of()
                if r == 0:
                    self.mma(mmas, lay, smem, tmem_ptr, pipes, bars, work)
                else:
                    self.relay(bars, work)
                # every compute and dQ thread of this CTA has arrived: nobody reads its TMEM
                cute.arch.barrier(barrier_id=int(NamedBarrier.TMEM),
                                  number_of_threads=tmem_users)
                tmem.relinquish_alloc_permit()
                tmem.free(tmem_ptr)
        if warp < self.warp("dq"):
            set_registers(regs["compute0"], THREADS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            n_block, r, head_kv, b, work = work_of()
            self.compute(mmas, lay, tmem_ptr, smem, storage, pipes, bars, mdK, mdV,
                         softmax_scale, scale_log2, window_left, window_right, n_block, r,
                         head_kv, b, seqlen_q, seqlen_k, work)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TMEM),
                                     number_of_threads=tmem_users, aligned=False)
        if warp >= self.warp("dq") and warp < self.warp("mma"):
            set_registers(regs["dq"], THREADS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            _, r, _, b, work = work_of()
            self.store_dq(mmas, tmem_ptr, smem, pipes, mdQaccum, r, b, work)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TMEM),
                                     number_of_threads=tmem_users, aligned=False)

    @cute.jit
    def pair_work(self, seqlen_q, seqlen_k, heads, heads_kv, window_left, window_right):
        """(pair's key block, rank r in the pair, kv head, batch, work): the query tiles that see
        any of the pair's 256 keys (both CTAs walk the same steps: they share every MMA)."""
        bidx, head_kv, b = cute.arch.block_idx()
        n_block = bidx // PAIR
        r = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        return n_block, r, head_kv, b, self.key_tile_work(
            n_block, self.pair_tile_n, head_kv, heads, heads_kv, seqlen_q, seqlen_k, window_left,
            window_right)

    # Note [Pair masks] (fa4_final.blackwell.fwd): the commit masks and the leader's rank as
    # compile-time constants, so no value of the prologue lives across the roles' setmaxnreg.
    PAIR_COMMIT_MASK = 0b11
    PAIR_LEADER_RANK = 0

    def make_pair_pipelines(self, storage, vmnk, bytes_q: int, bytes_do: int,
                            bytes_kv: int) -> dict:
        """The cutlass pipelines of the tma_umma and umma_async kinds of ``self.pipelines()``
        (rows, dsx and dsx_relay are plain mbarriers, ``bars``)."""
        mbar = {"kv": storage.mbar_kv, "q": storage.mbar_q, "do": storage.mbar_do,
                "s": storage.mbar_s, "dp": storage.mbar_dp, "dq": storage.mbar_dq,
                "dkv": storage.mbar_dkv}
        tx = {"kv": bytes_kv, "q": bytes_q, "do": bytes_do}
        out = {}
        for spec in self.pipelines():
            if spec.name not in mbar:
                continue
            common = dict(pipeline_args(spec, mbar[spec.name]), cta_layout_vmnk=vmnk)
            if spec.kind == "tma_umma":
                pipe = pipeline.PipelineTmaUmma.create(tx_count=tx[spec.name], **common)
                pipe = dataclasses.replace(pipe, consumer_mask=Int32(self.PAIR_COMMIT_MASK))
            else:
                pipe = pipeline.PipelineUmmaAsync.create(**common)
                pipe = dataclasses.replace(pipe, producer_mask=Int32(self.PAIR_COMMIT_MASK),
                                           consumer_mask=Int32(self.PAIR_LEADER_RANK))
            out[spec.name] = pipe
        return out

    @cute.jit
    def with_leader(self, pipes: dict, r) -> dict:
        """The TMA-UMMA pipelines with ``is_leader_cta`` from this role's own rank: only the
        leader arms the FULL barrier (with both CTAs' bytes)."""
        return {n: dataclasses.replace(p, is_leader_cta=r == 0)
                if isinstance(p, pipeline.PipelineTmaUmma) else p for n, p in pipes.items()}

    def smem_tensors(self, storage, lay) -> dict:
        """Every shared-memory view, by name."""
        def view(field, layout):
            return field.get_tensor(layout.outer, swizzle=layout.inner)

        s = {name: view(getattr(storage, f"s{name}"), lay[name])
             for name in ("K", "V", "Kt", "Q", "Qt", "dO", "dOt", "dS")}
        # dS as (key of the pair, query) rows for the compute warps: the MN-major A layout
        # ((64 queries, 16 keys), 1, 256 / 16) regrouped as ((16, 16) keys, 64 queries)
        outer = lay["dS"].outer
        rows = cute.make_layout(((outer.shape[0][1], outer.shape[2]), outer.shape[0][0]),
                                stride=((outer.stride[0][1], outer.stride[2]),
                                        outer.stride[0][0]))
        s["dS_rows"] = storage.sdS.get_tensor(rows, swizzle=lay["dS"].inner)
        s["dS_base"] = storage.sdS.data_ptr()
        s["desc_lo"] = storage.desc_lo.get_tensor(cute.make_layout(DESC_WORDS))
        s.update(self.row_and_staging_tensors(storage))
        return s

    def tmem_view(self, tmem_ptr, tiled_mma, mn, region: str, col0=0, cols=None):
        """(128, cols) fp32 view of TMEM region ``region`` in this CTA: the pair MMA's
        accumulator for an ``mn`` tile holds 128 of its rows (lanes) in each CTA."""
        thr = tiled_mma.get_slice(0)
        acc = thr.make_fragment_C(thr.partition_shape_C(mn)).layout
        full = cute.make_tensor(tmem_ptr + self.plan.offset(region), acc)[(None, None), 0, 0]
        cols = mn[1] if cols is None else cols
        return cute.make_tensor(full.iterator + col0, cute.composition(
            full.layout, cute.make_layout((TMEM_LANES, cols))))

    # ------------------------------------------------------------------------------------------
    # load warp (each CTA loads its own share; the TMA bytes count on the leader's barrier)
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load(self, mQ, mQt, mK, mKt, mV, mdO, mdOt, mLSE2, mDelta, smem, atoms, mmas, pipes,
             bars, n_block, r, head_kv, b, work):
        """K, V, Kt once; per step Q + Qt, the rows (lse, delta: this CTA's own ring), dO + dOt
        (Note [The pair's handshakes])."""
        m_min, m_max, _, _, head0, group = work
        d, m, n2 = self.head_dim, self.tile_m, self.pair_tile_n
        sdp, dv, dk, dq = mmas
        thr_sdp, thr_dv, thr_dk, thr_dq = (x.get_slice(r) for x in mmas)
        state_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.q_stages)
        state_rows = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                  self.q_stages)
        state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.do_stages)
        bulk = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32)
        if m_max > m_min:
            gK = cute.local_tile(mK[None, None, head_kv, b], (n2, d), (None, 0))  # (256, D, blk)
            gV = cute.local_tile(mV[None, None, head_kv, b], (n2, d), (None, 0))
            gKt = cute.local_tile(mKt[None, None, head_kv, b], (d, n2), (0, None))  # (D, 256, )
            pipes["kv"].producer_acquire(state_kv)
            bar = pipes["kv"].producer_get_barrier(state_kv)
            for name, part in (("K", thr_sdp.partition_A(gK)), ("V", thr_sdp.partition_A(gV)),
                               ("Kt", thr_dq.partition_B(gKt))):
                tXsX, tXgX = self._tma_partition(atoms[name], smem[name], part)
                cute.copy(atoms[name], tXgX[None, n_block], tXsX, tma_bar_ptr=bar)
            for h in cutlass.range(group, unroll=1):
                head = head0 + h
                gQ = cute.local_tile(mQ[None, None, head, b], (m, d), (None, 0))  # (m, D, blk)
                gdO = cute.local_tile(mdO[None, None, head, b], (m, d), (None, 0))
                gQt = cute.local_tile(mQt[None, None, head, b], (d, m), (0, None))  # (D, m, )
                gdOt = cute.local_tile(mdOt[None, None, head, b], (d, m), (0, None))
                gLSE = cute.local_tile(mLSE2[None, head, b], (m,), (None,))  # (m, blk)
                gDelta = cute.local_tile(mDelta[None, head, b], (m,), (None,))
                q_parts = [(*self._tma_partition(atoms[nm], smem[nm], part), atoms[nm])
                           for nm, part in (("Q", thr_sdp.partition_B(gQ)),
                                            ("Qt", thr_dk.partition_B(gQt)))]
                do_parts = [(*self._tma_partition(atoms[nm], smem[nm], part), atoms[nm])
                            for nm, part in (("dO", thr_sdp.partition_B(gdO)),
                                             ("dOt", thr_dv.partition_B(gdOt)))]
                for m_block in cutlass.range(m_min, m_max, unroll=1):
                    state_q = self.load_stage(q_parts, m_block, pipes["q"], state_q)
                    state_rows = self.load_rows(bulk, ((gLSE, smem["LSE"]),
                                                       (gDelta, smem["Delta"])), m_block, bars,
                                                state_rows)
                    state_do = self.load_stage(do_parts, m_block, pipes["do"], state_do)
            pipes["q"].producer_tail(state_q)
            pipes["do"].producer_tail(state_do)
            for _ in cutlass.range_constexpr(self.q_stages):  # the rows ring's last empties
                cute.arch.mbarrier_wait(bars["rows_empty"] + state_rows.index, state_rows.phase)
                state_rows.advance()

    @cute.jit
    def load_stage(self, parts, block, pipe, state):
        """Tiles of one stage (TMA), all counted by the leader's FULL barrier of the stage."""
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        for tXsX, tXgX, atom in parts:
            cute.copy(atom, tXgX[None, block], tXsX[None, state.index], tma_bar_ptr=bar)
        state.advance()
        return state

    @cute.jit
    def load_rows(self, bulk, rows, block, bars, state):
        """lse and delta of the step's 128 queries into this CTA's rows ring (bulk copies, its
        own FULL barrier: the compute warps of each CTA wait there)."""
        cute.arch.mbarrier_wait(bars["rows_empty"] + state.index, state.phase)
        full = bars["rows_full"] + state.index
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(full, 4 * self.tile_m * len(rows))
            for gRow, sRow in rows:
                cute.copy(bulk, gRow[None, block], sRow[None, state.index], mbar_ptr=full)
        state.advance()
        return state

    # ------------------------------------------------------------------------------------------
    # MMA warp: the leader issues; the follower relays
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def mma(self, mmas, lay, smem, tmem_ptr, pipes, bars, work):
        """The leader's thread issues the five pair GEMMs of every step in the 1-CTA order S^T,
        dP^T, dV, dK, dQ; dK reads dS^T from TMEM (TS, as dV reads P^T), dQ waits for both
        halves of the dS exchange (Note [The dS exchange])."""
        mma_sdp, mma_dv, mma_dk, mma_dq = mmas
        m_min, m_max, _, _, _, group = work
        d16, m16, n16 = self.head_dim // 16, self.tile_m // 16, self.pair_tile_n // 16
        which = (("K", mma_sdp, False, d16), ("V", mma_sdp, False, d16),
                 ("Q", mma_sdp, True, d16), ("dO", mma_sdp, True, d16),
                 ("dOt", mma_dv, True, m16), ("Qt", mma_dk, True, m16),
                 ("dS", mma_dq, False, n16), ("Kt", mma_dq, True, n16))
        ops = {name: self.desc(t, is_b, smem[name], blocks) for name, t, is_b, blocks in which}
        tP = mma_dv.get_slice(0).make_fragment_A(lay["P"].outer)  # (MMA, 1, m/16) in TMEM
        p_offsets = umma.block_offsets(tP.layout, m16, 32, self.dtype.width)
        tdS = mma_dk.get_slice(0).make_fragment_A(lay["dSt"].outer)
        ds_offsets = umma.block_offsets(tdS.layout, m16, 32, self.dtype.width)
        base = tmem_ptr.toint()
        idesc = {name: umma.op_instr_desc(t.op) for name, t in
                 (("sdp", mma_sdp), ("dv", mma_dv), ("dk", mma_dk), ("dq", mma_dq))}
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.q_stages)
        state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.do_stages)
        phase = Int32(0)
        n_steps = (m_max - m_min) * group
        if n_steps > 0:
            pipes["kv"].consumer_wait(pipeline.PipelineState(1, Int32(0), Int32(0), Int32(0)))
        # Note [Descriptors read each step]: the base words go through shared memory
        names = [w[0] for w in which]
        assert len(names) == DESC_WORDS
        words = smem["desc_lo"]  # (DESC_WORDS,) Int32
        if cute.arch.lane_idx() == 0:
            for i in cutlass.range_constexpr(DESC_WORDS):
                words[i] = ops[names[i]][0]
        cute.arch.sync_warp()
        for t in cutlass.range(n_steps, unroll=1):
            lo = umma.reload_words(words.iterator.toint(), DESC_WORDS)
            cur = {n: (lo[i],) + tuple(ops[n][1:]) for i, n in enumerate(names)}
            q_lo, q_hi, q_off, q_st = cur["Q"]
            k_lo, k_hi, k_off, _ = cur["K"]
            pipes["q"].consumer_wait(state_q)
            umma.mma(base + self.plan.offset("S"), k_lo, k_hi, k_off,
                     q_lo + state_q.index * q_st, q_hi, q_off, idesc["sdp"], False, PAIR)
            pipes["s"].producer_commit(at(0))  # S^T -> both CTAs' compute warps
            o_lo, o_hi, o_off, o_st = cur["dO"]
            v_lo, v_hi, v_off, _ = cur["V"]
            pipes["do"].consumer_wait(state_do)
            pipes["dq"].producer_acquire(at(phase ^ 1))  # dQ(t - 1) read out of dP's columns
            umma.mma(base + self.plan.offset("dP"), v_lo, v_hi, v_off,
                     o_lo + state_do.index * o_st, o_hi, o_off, idesc["sdp"], False, PAIR)
            pipes["dp"].producer_commit(at(0))
            pipes["s"].producer_acquire(at(phase))  # P^T stored in both CTAs
            t_lo, t_hi, t_off, t_st = cur["dOt"]
            umma.mma(base + self.plan.offset("dV"), base + self.plan.offset("P"), None,
                     p_offsets, t_lo + state_do.index * t_st, t_hi, t_off, idesc["dv"], t > 0,
                     PAIR)
            pipes["do"].consumer_release(state_do)  # after dV: the last reader of dO, dOt
            state_do.advance()
            pipes["dp"].producer_acquire(at(phase))  # dS^T in both CTAs' TMEM, own dS blocks
            r_lo, r_hi, r_off, r_st = cur["Qt"]
            umma.mma(base + self.plan.offset("dK"), base + self.plan.offset("dS"), None,
                     ds_offsets, r_lo + state_q.index * r_st, r_hi, r_off, idesc["dk"], t > 0,
                     PAIR)
            # the follower's dS block landed here, and ours in the follower (its relay), both
            # acquired at cluster scope, then handed to the async proxy (fa4_final.blackwell.
            # peer, Note [Exchange proxies])
            peer.wait_acquire_cluster(bars["dsx"], phase)
            peer.wait_peer_bytes(bars["dsx_relay"], phase)
            a_lo, a_hi, a_off, _ = cur["dS"]
            b_lo, b_hi, b_off, _ = cur["Kt"]
            umma.mma(base + self.plan.offset("dQ"), a_lo, a_hi, a_off, b_lo, b_hi, b_off,
                     idesc["dq"], False, PAIR)
            pipes["dq"].producer_commit(at(0))  # dQ -> both dQ warpgroups; dS free
            pipes["q"].consumer_release(state_q)  # after dK: the last reader of Q, Qt
            state_q.advance()
            phase ^= 1
        if n_steps > 0:
            pipes["dkv"].producer_commit(at(0))  # dK, dV final once every MMA completed
            # the last dQ read by both CTAs' dQ warps: no remote arrival left in flight here
            pipes["dq"].producer_acquire(at(phase ^ 1))

    # Note [Descriptors read each step]
    # Every operand's K blocks differ only in the low word of its shared-memory descriptor (a
    # constant added to the base, blackwell.umma), and the bases never change: left to itself,
    # ptxas computes all 80 per-block descriptors of a D = 128 step (8 operands, 8 or 16 K
    # blocks) once, before the step loop, and keeps them as 64-bit pairs: 160 registers, more
    # than warpgroup 3 can have beside 2 x 176 compute and 48 dQ registers on one SM
    # sub-partition (bwd Note [Register plan]); at 128 it spilled them (103 spill
    # instructions). So the leader writes the 8 base words to shared memory once and reads them
    # back at the top of each step with ld.volatile.shared.v4 (two loads, ``umma.
    # reload_words``), which ptxas executes where it stands: each GEMM's block descriptors are
    # computed from the fresh words inside the step, and the warp fits in 112 registers with no
    # spill. The 32 bytes sit in the alignment gap before sLSE, so the shared-memory total is
    # unchanged. Two shared loads a step, against a step of five pair GEMMs.

    @cute.jit
    def relay(self, bars, work):
        """The follower's MMA warp: each step, once the leader's 16 KB of dS have landed here
        (this CTA's dsx barrier), tell the leader (its dsx_relay barrier): the leader cannot
        wait on a barrier in another CTA's shared memory."""
        m_min, m_max, _, _, _, group = work
        phase = Int32(0)
        for _ in cutlass.range((m_max - m_min) * group, unroll=1):
            peer.wait_peer_bytes(bars["dsx"], phase)  # as the leader's MMA thread does
            with cute.arch.elect_one():
                peer.relay_arrive(bars["dsx_relay"], Int32(self.PAIR_LEADER_RANK))
            phase ^= 1

    # ------------------------------------------------------------------------------------------
    # compute warpgroups
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def compute(self, mmas, lay, tmem_ptr, smem, storage, pipes, bars, mdK, mdV, softmax_scale,
                scale_log2, window_left, window_right, n_block, r, head_kv, b, seqlen_q,
                seqlen_k, work):
        """Thread t of warpgroup g of CTA r owns key 256 n_block + 128 r + t and queries
        64 g .. 64 g + 63 of each step: P^T (TMEM), dS^T (TMEM, for dK) and dS for dQ: into
        this CTA's shared memory when g = r, into the peer's when not (Note [The dS exchange]);
        then its half of the key's dK and dV."""
        mma_sdp, mma_dv, _, _ = mmas
        m_min, m_max = work[0], work[1]
        tidx = cute.arch.thread_idx()[0] % GROUP_THREADS
        g = cute.arch.make_warp_uniform(cute.arch.warp_idx() // WARPS_PER_GROUP)
        v = self.step_views(tmem_ptr, mma_sdp, (self.pair_tile_n, self.tile_m), tidx, g)
        tdS32 = self.packed_columns(v["tdP"], "dS", "dP", g)  # Note [dS^T over dP^T]
        store_ds = tcgen05.make_tmem_copy(self.store_16bit_pairs(), tdS32).get_slice(tidx)
        v.update(store_ds=store_ds, tdStdS=store_ds.partition_D(tdS32))
        key_in_pair = r * self.tile_n + tidx
        state_rows = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                  self.q_stages)
        phase = Int32(0)
        key = n_block * self.pair_tile_n + key_in_pair
        self.compute_steps(work, state_rows, phase, (
            key, key_in_pair, g, r, tidx, v, smem, pipes, bars, scale_log2, seqlen_q,
            seqlen_k, window_left, window_right))  # BlackwellBackward's walk, this compute_step
        self.epilogue(mma_dv, tmem_ptr, pipes, mdK, mdV, softmax_scale, tidx, g, key,
                      head_kv, b, seqlen_k, m_max > m_min)

    # Note [dS^T over dP^T]
    # dK's A is dS^T in TMEM (16-bit pairs over dP^T's upper 64 columns, tmem.backward_pair_plan):
    # warpgroup g stores its 32 columns at 192 + 32 g, and warpgroup 0's land on dP^T columns
    # warpgroup 1 loads. So a second bar.sync COMPUTE, as before P^T (Note [P^T over S^T]); a
    # CPU simulation of the pair's pipelines catches its absence.

    @cute.jit
    def compute_step(self, m_block, masked: cutlass.Constexpr[bool], state_rows, phase, key,
                     key_in_pair, g, r, tidx, v, smem, pipes, bars, scale_log2, seqlen_q,
                     seqlen_k, window_left, window_right):
        """One step for 64 queries of one key: S^T row -> P^T (TMEM); dP^T row -> dS^T (TMEM)
        and dS (this CTA's or the peer's shared memory); ``v``: ``step_views`` plus the dS^T
        store (tdStdS by store_ds)."""
        half = self.tile_m // 2
        cute.arch.mbarrier_wait(bars["rows_full"] + state_rows.index, state_rows.phase)
        pipes["s"].consumer_wait(at(phase))
        s = cute.make_rmem_tensor(v["tScS"].shape, Float32)  # this key's 64 scores
        cute.copy(v["load_s"], v["tStS"], s)
        self.probabilities(s, masked, m_block, key, g, v["t0ScS"],
                           smem["LSE"][None, state_rows.index], scale_log2, seqlen_q, seqlen_k,
                           window_left, window_right)
        rP32, _ = self.packed_16bit(s, v["p_regs"])
        cute.arch.fence_view_async_tmem_load()
        cute.arch.barrier(barrier_id=int(NamedBarrier.COMPUTE),  # Note [P^T over S^T]
                          number_of_threads=2 * GROUP_THREADS)
        cute.copy(v["store_p"], rP32, v["tPtP"])
        cute.arch.fence_view_async_tmem_store()
        cute.arch.sync_warp()
        with cute.arch.elect_one():  # one arrival per warp on the leader's barrier
            pipes["s"].consumer_release(at(phase))
        pipes["dp"].consumer_wait(at(phase))
        dp = cute.make_rmem_tensor(v["tScS"].shape, Float32)
        cute.copy(v["load_dp"], v["tdPtdP"], dp)
        delta = smem["Delta"][None, state_rows.index]
        for c in cutlass.range_constexpr(cute.size(dp)):
            dp[c] = s[c] * (dp[c] - delta[g * half + c])
        rdS32, rdS = self.packed_16bit(dp, v["p_regs"])
        cute.arch.fence_view_async_tmem_load()  # dP^T read
        cute.arch.barrier(barrier_id=int(NamedBarrier.COMPUTE),  # Note [dS^T over dP^T]
                          number_of_threads=2 * GROUP_THREADS)
        cute.copy(v["store_ds"], rdS32, v["tdStdS"])
        cute.arch.fence_view_async_tmem_store()
        pipes["dq"].consumer_wait(at(phase ^ 1))  # dQ(t - 1) has read both CTAs' dS
        self.store_ds(rdS, rdS32, key_in_pair, g, r, tidx, smem, bars)
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            pipes["dp"].consumer_release(at(phase))
            cute.arch.mbarrier_arrive(bars["rows_empty"] + state_rows.index)
        state_rows.advance()
        return state_rows, phase ^ 1

    # Note [The dS exchange]
    # dQ's A in CTA c is dS for its 64 queries (64 c ..) and all 256 keys of the pair, block b of
    # 128 keys from CTA b. Warpgroup g of CTA r holds dS of CTA r's keys for queries 64 g ..: the
    # block r of CTA g's A. So warpgroup r stores into its own CTA (generic stores, then
    # fence.proxy.async), warpgroup 1 - r into the peer: st.async, 16 bytes each (8 a thread,
    # 16 KB a warpgroup), whose bytes complete the peer's dsx barrier; one thread first arms it
    # (mbarrier.expect_tx, remote). The leader's MMA thread waits for its own dsx barrier and,
    # since it cannot wait on the follower's, for dsx_relay, on which the follower's MMA warp
    # arrives once its dsx barrier completed. The block is free again after dQ(t - 1), whose
    # commit reaches both CTAs' dq FULL barrier, which the compute warps wait on before storing.
    #
    # The proxies (fa4_final.blackwell.peer, Note [Exchange proxies] in its docstring): st.async
    # writes in the generic proxy and the dQ MMA reads in the async proxy, so the exchange is
    # fenced on both sides of the path, with nothing left to what PTX does not spell out about
    # st.async. Writer: fence.proxy.async.shared::cluster before its st.async (the dQ(t - 1)
    # MMA's read of the block, observed through dq FULL, is ordered before the new writes).
    # Reader: mbarrier.try_wait.acquire.cluster on dsx (the default .cta scope does not
    # synchronise with the peer's release); the follower fences (fence.proxy.async) and relays
    # with .release.cluster; the leader acquires dsx_relay at cluster scope too, then fences
    # once, then issues the MMA, which reads both CTAs' blocks. Not FA4's way (a bulk copy
    # cp.async.bulk.shared::cluster from a staged 16 KB, in the async proxy end to end): that
    # staging buffer does not fit at D = 128 (module docstring). The H200 runs these same steps
    # in a probe kernel: the peer's bytes, read back by a bulk store (async proxy), over several
    # steps of one buffer.

    # Note [The swizzle in bytes]
    # The 128 B swizzle of the operand tiles (CuTe's S<3,4,3>, the UMMA descriptor's mode) acts
    # on the shared-memory byte address: bits 4-6 ^= bits 7-9. The generic stores get it from
    # the swizzled tensor view (its PTX: xor of (addr >> 3) & 112 into addr); st.async takes a
    # plain address, so the exchange applies the same: a -> a ^ ((a >> 3) & 0x70), then mapa to
    # the peer (same offset there). The 16 bytes of 8 queries stay contiguous (the XOR moves
    # whole 16 B units), so each st.async.v4 lands in one piece.

    @cute.jit
    def store_ds(self, rdS, rdS32, key_in_pair, g, r, tidx, smem, bars):
        """This thread's 64 dS values (one key, 64 queries: 128 bytes, one swizzled row of the
        MN-major A tile) into block r of CTA g's dS (Note [The dS exchange])."""
        if g == r:
            cute.autovec_copy(rdS, smem["dS_rows"][key_in_pair, None])
            cute.arch.fence_view_async_shared()  # generic-proxy stores -> visible to the MMA
        else:
            other = 1 - r
            peer.fence_before_peer_store()  # Note [The dS exchange]: the proxies
            if tidx == 0:
                peer.arm_peer(bars["dsx"], DS_EXCHANGE_BYTES, other)
            words = cute.make_tensor(cute.recast_ptr(rdS32.iterator, dtype=Int32),
                                     cute.make_layout(cute.size(rdS32)))
            base = smem["dS_base"].toint()
            for j in cutlass.range_constexpr(cute.size(rdS32) // 4):  # 16 B = 8 queries each
                addr = base + 2 * cute.crd2idx((key_in_pair, 8 * j), smem["dS_rows"].layout)
                addr = addr ^ ((addr >> 3) & 0x70)  # Note [The swizzle in bytes]
                peer.store_peer_v4(addr, (words[4 * j], words[4 * j + 1], words[4 * j + 2],
                                          words[4 * j + 3]), bars["dsx"], other)

    # ------------------------------------------------------------------------------------------
    # dQ warpgroup
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def store_dq(self, mmas, tmem_ptr, smem, pipes, mdQaccum, r, b, work):
        """Per step this CTA's 64 queries of dQ (the pair MMA's M = 128 accumulator: lane i and
        64 + i hold columns 0 .. D/2 - 1 and D/2 .. D - 1 of query i), 32 columns a lane at a
        time, staged in the Hopper accumulator order (Note [dQ accumulator order] of bwd.py:
        staging row t = lane t), two 8 KB bulk adds per chunk: half of a 1-CTA CTA's adds."""
        mma_sdp = mmas[0]
        m_min, m_max, _, _, head0, group = work
        tidx = cute.arch.thread_idx()[0] % GROUP_THREADS
        d = self.head_dim
        chunks = d // 2 // BWD_DQ_CHUNK
        stage_layout = self.dq_stage_layout()
        half_rows = self.tile_m // 2 * BWD_DQ_CHUNK  # floats of one 8 KB block
        tdQ = self.tmem_view(tmem_ptr, mma_sdp, (self.pair_tile_n, self.tile_m), "dQ", 0,
                             BWD_DQ_CHUNK)  # (128 lanes, 32 columns)
        load = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(BWD_DQ_CHUNK)), Float32), tdQ
        ).get_slice(tidx)
        tdQtdQ = load.partition_S(tdQ)
        regs = load.partition_D(cute.make_identity_tensor((self.tile_m, BWD_DQ_CHUNK))).shape
        phase = Int32(0)
        buf = Int32(0)
        for h in cutlass.range(group, unroll=1):
            gAcc = mdQaccum[None, head0 + h, b]  # (s_padded * D,)
            for m_block in cutlass.range(m_min, m_max, unroll=1):
                pipes["dq"].consumer_wait(at(phase))
                for c in cutlass.range_constexpr(chunks):
                    rr = cute.make_rmem_tensor(regs, Float32)
                    cute.copy(load, cute.make_tensor(tdQtdQ.iterator + c * BWD_DQ_CHUNK,
                                                     tdQtdQ.layout), rr)
                    if const_expr(c == chunks - 1):  # dQ read: dP^T may take the columns
                        cute.arch.fence_view_async_tmem_load()
                        cute.arch.sync_warp()
                        with cute.arch.elect_one():
                            pipes["dq"].consumer_release(at(phase))
                    self.stage_dq_chunk(rr, smem, buf, stage_layout, tidx)
                    if tidx == 0:
                        for hh in cutlass.range_constexpr(2):  # lanes 0-63, then 64-127
                            offset = (m_block * (self.tile_m * d) + r * (self.tile_m // 2 * d)
                                      + hh * (self.tile_m // 2 * d // 2) + c * half_rows)
                            bulk_add_f32(gAcc.iterator + offset,
                                         smem["dQ"][None, buf].iterator + hh * half_rows,
                                         half_rows * 4)
                        cute.arch.cp_async_bulk_commit_group()
                    buf = buf ^ 1
                phase ^= 1
        if tidx == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)


DS_EXCHANGE_BYTES = 128 * 64 * 2  # one warpgroup's dS: 128 keys x 64 queries, 16-bit
assert GROUP_THREADS * 128 == DS_EXCHANGE_BYTES  # 128 B (64 queries) a thread
