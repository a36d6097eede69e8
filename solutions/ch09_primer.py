"""Chapters 09-10's primer: one attention tile on Blackwell, every tcgen05 step in the open.

``OneTileAttention`` computes out = softmax(scale * Q K^T) V for one tile of 128 query rows and
128 keys (D = 64 or 128), with the pieces the full forward (``fa4_final.blackwell.fwd``) builds on,
each used exactly once:

    tcgen05.alloc        the MMA warp allocates the TMEM columns of ``tmem.forward_plan``
    TMA + mbarrier       Q, K, V land in shared memory; one barrier counts their bytes
    tcgen05.mma          ONE thread issues S = Q K^T (A and B from shared memory, fp32 in TMEM)
    tcgen05.commit       the MMAs' completion arrives on an mbarrier: "S is ready"
    tcgen05.ld           each softmax thread loads its own row of S (lane = row: the
                         lane-quarter rule makes the softmax a whole warpgroup)
    tcgen05.st           P = exp2(S - m) in bf16, stored into the upper half of S's columns
    tcgen05.wait::st     the stores are complete before the softmax tells the MMA warp so
    tcgen05.mma (TMEM A) O = P V reads P straight from TMEM, V from shared memory
    tcgen05.ld           O, scaled by 1 / rowsum, written to global memory row by row
    tcgen05.dealloc      the same warp frees the columns

Roles: warps 0-3 are the softmax warpgroup (thread t owns row t, TMEM lane t); warp 4 loads and
issues the MMAs. Synchronisation is written with raw mbarrier calls, so each wait and arrive is
visible; the forward wraps the same calls in named pipelines.

Two pieces are functions the kernel calls, so that a course exercise can replace them:
``issue_qk`` (the MMA warp's S = Q K^T and its commit: exercise 09.3) and ``softmax_to_p`` (the
softmax warpgroup from S in TMEM to P in TMEM and the arrive: exercise 09.4).

``PairTileAttention`` (chapter 10) is the same tile with 256 query rows on a CTA pair: one
``cta_group::2`` MMA of M = 256 issued by the leader CTA (rank 0) computes both CTAs' rows; each
CTA holds its own 128 rows of Q, half of K's keys and half of V's columns, and its own 128 rows of
S, P and O in its own TMEM. Its pieces for exercises: ``pair_mma`` (what each CTA's MMA warp does:
10.3) and ``init_pair_barriers`` (the barriers, their arrival counts and the cluster barrier that
publishes them: 10.4).

Shapes: q (128, D), k (128, D), v (128, D), out (128, D), lse (128,) float32 (the pair: 256 query
rows); compiled for sm_100a only. This is complete code for a B200 (tests/gpu/test_blackwell_fwd.py
runs it there); here it is compiled and its PTX read.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import TmemAllocator
from cutlass.pipeline import NamedBarrier

from fa4_final.blackwell.tmem import forward_plan
from fa4_final.common.constants import LN_2, LOG2_E, WARP_SIZE
from fa4_final.common.fragments import select_modes

TILE = 128  # query rows per CTA = keys = TMEM lanes = threads of the softmax warpgroup
MMA_WARP = 4  # the warp after the softmax warpgroup
THREADS = (MMA_WARP + 1) * WARP_SIZE
TMEM_BARRIER_ID = 1  # named barrier: the TMEM address is in shared memory for everyone
PAIR = 2  # CTAs in a pair (cluster of 2); rank 0 is the leader
PAIR_MASK = 0b11  # a multicast commit's CTA mask: both CTAs of the pair
LEADER = 0


# ----------------------------------------------------------------------------------------------
# the pieces the kernels call (exercises 09.3, 09.4, 10.3, 10.4)


@cute.jit
def issue_qk(mma_qk, tStS, tSrQ, tSrK, mbar_s):
    """S = Q K^T in TMEM: D/16 MMAs of 128 x 128 x 16 (cute.gemm lets one elected thread of the
    warp issue each), the first overwriting S, the others adding to it; then one
    ``tcgen05.commit`` that arrives on ``mbar_s`` once every MMA above has completed.

    ``tStS``: ((128, 128), 1, 1) fp32 accumulator in TMEM; ``tSrQ``, ``tSrK``: (MMA, 1, D/16)
    shared-memory descriptors of Q and K, one per block of 16 along D."""
    for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
        mma_qk.set(tcgen05.Field.ACCUMULATE, k != 0)
        cute.gemm(mma_qk, tStS, tSrQ[None, None, k], tSrK[None, None, k], tStS)
    with cute.arch.elect_one():
        tcgen05.commit(mbar_s)


@cute.jit
def softmax_to_p(load_s, tStS, rS, store_p, tPtP, rP32, rP, mbar_s, mbar_p, scale_log2):
    """One thread, one row: wait until S is in TMEM, load the row (tcgen05.ld), its max, the
    exponentials exp2(scale_log2 * (s - max)), P in 16 bits written over S's upper half
    (tcgen05.st), the stores waited for (tcgen05.wait::st), then one arrive on ``mbar_p``.
    Returns (max * scale_log2, row sum) for the epilogue.

    ``load_s`` / ``store_p``: the thread's TMEM copies; ``tStS``: its row of S in TMEM (the
    source of ``load_s``); ``rS``: 128 fp32 registers; ``rP``: 128 16-bit values in the 64
    registers ``rP32`` (the source of ``store_p``); ``tPtP``: its row of P in TMEM."""
    cute.arch.mbarrier_wait(mbar_s, 0)
    cute.copy(load_s, tStS, rS)
    row_max = -Float32.inf
    for c in cutlass.range_constexpr(cute.size(rS)):
        row_max = cute.arch.fmax(row_max, rS[c])
    max_scaled = row_max * scale_log2
    row_sum = Float32(0.0)
    for c in cutlass.range_constexpr(cute.size(rS)):
        p = cute.math.exp2(rS[c] * scale_log2 - max_scaled, fastmath=True)
        row_sum += p
        rS[c] = p
    rP.store(rS.load().to(rP.element_type))
    cute.copy(store_p, rP32, tPtP)
    cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st: P is in TMEM ...
    cute.arch.mbarrier_arrive(mbar_p)  # ... before the MMA warp hears so (128 arrivals)
    return max_scaled, row_sum


@cute.jit
def pair_mma(cta_rank, issue_s, issue_pv, mbar_load, mbar_s, mbar_p, mbar_o):
    """The MMA warp of each CTA of a pair. Only the leader (rank 0) issues: one cta_group::2
    MMA computes the rows of both CTAs. Its barriers are the leader's: ``mbar_load`` counts both
    CTAs' TMA bytes, ``mbar_p`` both softmax warpgroups' arrivals. Each commit is multicast:
    it arrives on the barrier at the same offset in both CTAs, so each CTA's softmax waits on
    its own ``mbar_s`` and ``mbar_o``. ``issue_s()`` / ``issue_pv()`` issue the K-blocks of
    S = Q K^T / O = P V."""
    if cta_rank == LEADER:
        cute.arch.mbarrier_wait(mbar_load, 0)  # both CTAs' Q, K, V halves have landed
        issue_s()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_s, PAIR_MASK, tcgen05.CtaGroup.TWO)
        cute.arch.mbarrier_wait(mbar_p, 0)  # both CTAs' P are in their TMEM
        issue_pv()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_o, PAIR_MASK, tcgen05.CtaGroup.TWO)


@cute.jit
def init_pair_barriers(mbar_load, mbar_s, mbar_p, mbar_o, warp):
    """Every CTA of the pair runs this at start-up. One thread initialises the CTA's barriers
    with the arrivals each phase needs (the follower's copies of mbar_load and mbar_p are
    never used); the fence makes the inits visible to the cluster, and the cluster barrier
    keeps either CTA from touching the other's barriers before they are initialised."""
    if warp == MMA_WARP:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar_load, 1)  # the leader's expect_tx; both CTAs' bytes
            cute.arch.mbarrier_init(mbar_s, 1)  # one multicast commit
            cute.arch.mbarrier_init(mbar_p, PAIR * TILE)  # every softmax thread of the pair
            cute.arch.mbarrier_init(mbar_o, 1)  # one multicast commit
        cute.arch.mbarrier_init_fence()
    cute.arch.cluster_arrive_relaxed()
    cute.arch.cluster_wait()


# ----------------------------------------------------------------------------------------------
# the one-CTA primer (chapter 09)


class OneTileAttention:
    """One 128 x 128 attention tile with tcgen05 (see the module docstring). ``issue_qk_fn``
    and ``softmax_fn`` replace the module's ``issue_qk`` and ``softmax_to_p``."""

    def __init__(self, dtype, head_dim: int, issue_qk_fn=None, softmax_fn=None):
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.plan = forward_plan(TILE, head_dim, q_stages=1)
        self.issue_qk_fn = issue_qk_fn or issue_qk
        self.softmax_fn = softmax_fn or softmax_to_p

    def _mmas(self):
        """S = Q K^T: A = Q, B = K, both K-major in shared memory. O = P V: A = P from TMEM
        (K-major: a row of P runs along the keys), B = V read MN-major (V^T's view)."""
        major = cute.nvgpu.OperandMajorMode
        one = tcgen05.CtaGroup.ONE
        qk = sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, major.K, major.K,
                                                Float32, one, (TILE, TILE))
        pv = sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, major.K, major.MN,
                                                Float32, one, (TILE, self.head_dim),
                                                tcgen05.OperandSource.TMEM)
        return qk, pv

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, stream):
        d = self.head_dim
        mma_qk, mma_pv = self._mmas()
        tiler_qk, tiler_pv = (TILE, TILE, d), (TILE, d, TILE)
        sQ_layout = sm100_utils.make_smem_layout_a(mma_qk, tiler_qk, self.dtype, 1)
        sK_layout = sm100_utils.make_smem_layout_b(mma_qk, tiler_qk, self.dtype, 1)
        sV_layout = sm100_utils.make_smem_layout_b(mma_pv, tiler_pv, self.dtype, 1)
        tP_layout = sm100_utils.make_smem_layout_a(mma_pv, tiler_pv, self.dtype, 1)
        # V^T: (D, keys), so that the P V MMA's B operand (N = D, K = keys) is a plain tile
        mVt = select_modes(mV, [1, 0])
        load = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        one = cute.make_layout((1, 1, 1, 1))
        tma_q, gQ = cute.nvgpu.make_tiled_tma_atom_A(
            load, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), tiler_qk, mma_qk, one.shape)
        tma_k, gK = cute.nvgpu.make_tiled_tma_atom_B(
            load, mK, cute.select(sK_layout, mode=[0, 1, 2]), tiler_qk, mma_qk, one.shape)
        tma_v, gVt = cute.nvgpu.make_tiled_tma_atom_B(
            load, mVt, cute.select(sV_layout, mode=[0, 1, 2]), tiler_pv, mma_pv, one.shape)
        load_bytes = 3 * TILE * d * self.dtype.width // 8

        @cute.struct
        class SharedStorage:
            mbar_load: cutlass.Int64  # Q, K and V landed (1 arrive + their bytes)
            mbar_s: cutlass.Int64  # S = Q K^T is in TMEM (tcgen05.commit)
            mbar_p: cutlass.Int64  # P is in TMEM (128 softmax threads arrive)
            mbar_o: cutlass.Int64  # O = P V is in TMEM (tcgen05.commit)
            tmem_addr: Int32  # where tcgen05.alloc writes the address it allocated
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)],
                                  1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)],
                                  1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)],
                                  1024]

        self.kernel(mma_qk, mma_pv, tma_q, gQ, tma_k, gK, tma_v, gVt, mO, mLSE,
                    softmax_scale * LOG2_E, sQ_layout, sK_layout, sV_layout, tP_layout,
                    load_bytes, SharedStorage).launch(
            grid=(1, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, tma_q: cute.CopyAtom,
               gQ: cute.Tensor, tma_k: cute.CopyAtom, gK: cute.Tensor, tma_v: cute.CopyAtom,
               gVt: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
               load_bytes: cutlass.Constexpr[int], SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        if warp == MMA_WARP:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(storage.mbar_load.ptr, 1)
                cute.arch.mbarrier_init(storage.mbar_s.ptr, 1)
                cute.arch.mbarrier_init(storage.mbar_p.ptr, TILE)
                cute.arch.mbarrier_init(storage.mbar_o.ptr, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()  # every barrier is initialised before anyone waits on it

        # (MMA, MMA_M, MMA_K, STAGE) views of the shared-memory tiles
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        # TMEM: warp MMA_WARP allocates; everyone waits on a named barrier for the address
        tmem = TmemAllocator(storage.tmem_addr.ptr,
                             barrier_for_retrieve=NamedBarrier(TMEM_BARRIER_ID, THREADS),
                             allocator_warp_id=MMA_WARP)
        tmem.allocate(self.plan.columns_allocated)
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(Float32)
        tStS, tOtO, tOrP = tmem_views(tmem_ptr, self.plan, mma_qk.get_slice(0),
                                      mma_pv.get_slice(0), tP_layout, self.dtype, TILE,
                                      self.head_dim)

        if warp == MMA_WARP:
            self.load_and_mma(mma_qk, mma_pv, tma_q, gQ, tma_k, gK, tma_v, gVt, sQ, sK, sV,
                              tStS, tOtO, tOrP, storage, load_bytes)
        if warp < MMA_WARP:
            self.softmax_and_epilogue(tidx, tStS, tOtO, mO, mLSE, scale_log2, storage)
        cute.arch.barrier()  # nobody touches TMEM any more
        if warp == MMA_WARP:
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr)

    @cute.jit
    def load_and_mma(self, mma_qk, mma_pv, tma_q, gQ, tma_k, gK, tma_v, gVt, sQ, sK, sV,
                     tStS, tOtO, tOrP, storage, load_bytes: cutlass.Constexpr[int]):
        thr_qk, thr_pv = mma_qk.get_slice(0), mma_pv.get_slice(0)
        copies = tma_copies(self.head_dim, TILE, tma_q, gQ, tma_k, gK, tma_v, gVt, sQ, sK, sV,
                            thr_qk, thr_pv)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(storage.mbar_load.ptr, load_bytes)
        for atom, tg, ts in copies:
            cute.copy(atom, tg, ts, tma_bar_ptr=storage.mbar_load.ptr)
        cute.arch.mbarrier_wait(storage.mbar_load.ptr, 0)

        tSrQ = mma_qk.make_fragment_A(sQ)[None, None, None, 0]  # (MMA, 1, D/16) descriptors
        tSrK = mma_qk.make_fragment_B(sK)[None, None, None, 0]
        self.issue_qk_fn(mma_qk, tStS, tSrQ, tSrK, storage.mbar_s.ptr)  # exercise 09.3

        cute.arch.mbarrier_wait(storage.mbar_p.ptr, 0)  # the softmax stored P
        issue_pv(mma_pv, tOtO, tOrP, mma_pv.make_fragment_B(sV)[None, None, None, 0])
        with cute.arch.elect_one():
            tcgen05.commit(storage.mbar_o.ptr)

    @cute.jit
    def softmax_and_epilogue(self, tidx, tStS, tOtO, mO, mLSE, scale_log2, storage):
        """Thread t owns row t: lane t of TMEM, which warp t // 32 may reach (quarter t // 32)."""
        load_s, tStS_t2r, rS, store_p, tPtP, rP32, rP = row_views(tidx, tStS, self.plan,
                                                                   self.dtype)
        max_scaled, row_sum = self.softmax_fn(load_s, tStS_t2r, rS, store_p, tPtP, rP32, rP,
                                              storage.mbar_s.ptr, storage.mbar_p.ptr,
                                              scale_log2)  # exercise 09.4
        cute.arch.mbarrier_wait(storage.mbar_o.ptr, 0)
        write_row(tidx, tidx, tOtO, mO, mLSE, max_scaled, row_sum, self.head_dim, self.dtype)


# ----------------------------------------------------------------------------------------------
# what both primers share: TMEM views, TMA partitions, the P V issue, the epilogue


def tmem_views(tmem_ptr, plan, thr_qk, thr_pv, tP_layout, dtype, mma_m: int, head_dim: int):
    """TMEM at the plan's columns: S ((128, 128), 1, 1) and O ((128, D), 1, 1) fp32
    accumulators (this CTA's rows), P (MMA, 1, 128/16) in 16 bits, the A operand of O = P V."""
    tStS = cute.make_tensor(tmem_ptr + plan.offset("S0"), thr_qk.make_fragment_C(
        thr_qk.partition_shape_C((mma_m, TILE))).layout)
    tOtO = cute.make_tensor(tmem_ptr + plan.offset("O0"), thr_pv.make_fragment_C(
        thr_pv.partition_shape_C((mma_m, head_dim))).layout)
    tOrP_layout = thr_pv.make_fragment_A(tP_layout.outer)[None, None, None, 0].layout
    tOrP = cute.make_tensor(cute.recast_ptr(tmem_ptr + plan.offset("P0"), dtype=dtype),
                            tOrP_layout)
    return tStS, tOtO, tOrP


def tma_copies(d: int, mma_m: int, tma_q, gQ, tma_k, gK, tma_v, gVt, sQ, sK, sV, thr_qk,
               thr_pv):
    """(atom, global source, shared destination) of the one tile of Q, K and V; in a pair,
    ``thr_qk`` / ``thr_pv`` are this CTA's slices (its rows of Q, its halves of K and V)."""
    tiler_qk, tiler_pv = (mma_m, TILE, d), (mma_m, d, TILE)
    gq = cute.local_tile(gQ, cute.select(tiler_qk, mode=[0, 2]), (0, 0))
    gk = cute.local_tile(gK, cute.select(tiler_qk, mode=[1, 2]), (0, 0))
    gv = cute.local_tile(gVt, cute.select(tiler_pv, mode=[1, 2]), (0, 0))
    copies = []
    for atom, g, s, part in ((tma_q, gq, sQ, thr_qk.partition_A),
                             (tma_k, gk, sK, thr_qk.partition_B),
                             (tma_v, gv, sV, thr_pv.partition_B)):
        ts, tg = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                       cute.group_modes(s, 0, 3),
                                       cute.group_modes(part(g), 0, 3))
        copies.append((atom, tg, ts[None, 0]))
    return copies


@cute.jit
def issue_pv(mma_pv, tOtO, tOrP, tOrV):
    """O = P V: TILE/16 MMAs reading P from TMEM and V from shared memory."""
    for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
        mma_pv.set(tcgen05.Field.ACCUMULATE, k != 0)
        cute.gemm(mma_pv, tOtO, tOrP[None, None, k], tOrV[None, None, k], tOtO)


@cute.jit
def row_views(tidx, tStS, plan, dtype):
    """A softmax thread's TMEM copies and registers: (load_s, its row of S in TMEM, 128 fp32
    registers, store_p, its row of P in TMEM, the 64 32-bit registers of P, their 16-bit view)."""
    tS = tStS[(None, None), 0, 0]  # (TILE, TILE) fp32 in TMEM
    load_s = tcgen05.make_tmem_copy(
        cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
        tS).get_slice(tidx)
    tStS_t2r = load_s.partition_S(tS)  # (((32, 32), 1), 1, TILE/32): 4 loads of 32 columns
    rS = cute.make_rmem_tensor(load_s.partition_D(cute.make_identity_tensor((TILE, TILE)))
                               .shape, Float32)  # this thread's 128 scores
    # P goes to TMEM as pairs of 16-bit values in 32-bit columns: a register tensor of
    # TILE/2 fp32 "words", written through a 16-bit view of the same registers
    p_cols = plan["P0"].columns
    tP32 = cute.make_tensor(tStS.iterator + (plan.offset("P0") - plan.offset("S0")),
                            cute.composition(tS.layout, cute.make_layout((TILE, p_cols))))
    store_p = tcgen05.make_tmem_copy(
        cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(16)), Float32),
        tP32).get_slice(tidx)
    tPtP = store_p.partition_D(tP32)  # (((16, 32), 1), 1, TILE/32): 4 stores of 16 columns
    rP32 = cute.make_rmem_tensor(store_p.partition_S(cute.make_identity_tensor(
        (TILE, p_cols))).shape, Float32)
    rP = cute.make_tensor(cute.recast_ptr(rP32.iterator, dtype=dtype), rS.layout)
    return load_s, tStS_t2r, rS, store_p, tPtP, rP32, rP


@cute.jit
def write_row(tidx, row, tOtO, mO, mLSE, max_scaled, row_sum, d: cutlass.Constexpr[int], dtype):
    """The epilogue of one row: O from TMEM (after its commit was waited for), / row sum, to
    global memory; lse = ln(row sum) + max."""
    tO = tOtO[(None, None), 0, 0]  # (TILE, D)
    load_o = tcgen05.make_tmem_copy(
        cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
        tO).get_slice(tidx)
    rO = cute.make_rmem_tensor(load_o.partition_D(cute.make_identity_tensor((TILE, d)))
                               .shape, Float32)
    cute.copy(load_o, load_o.partition_S(tO), rO)
    inv_sum = cute.arch.rcp_approx(row_sum)
    for c in cutlass.range_constexpr(cute.size(rO)):
        rO[c] = rO[c] * inv_sum
    rOut = cute.make_rmem_tensor(d, dtype)
    rOut.store(rO.load().to(dtype))
    cute.autovec_copy(rOut, mO[row, None])  # one row per thread: D contiguous elements
    mLSE[row] = (max_scaled + cute.math.log2(row_sum, fastmath=True)) * LN_2


# ----------------------------------------------------------------------------------------------
# the pair (chapter 10)


class PairTileAttention:
    """256 query rows x 128 keys on a CTA pair with ``cta_group::2`` (see the module docstring).
    ``mma_fn`` and ``init_fn`` replace ``pair_mma`` and ``init_pair_barriers``."""

    def __init__(self, dtype, head_dim: int, mma_fn=None, init_fn=None):
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.plan = forward_plan(TILE, head_dim, q_stages=1)  # each CTA's own TMEM
        self.mma_fn = mma_fn or pair_mma
        self.init_fn = init_fn or init_pair_barriers

    def _mmas(self):
        """The 1-CTA primer's MMAs with M = 256 over the pair (cta_group::2)."""
        major = cute.nvgpu.OperandMajorMode
        two = tcgen05.CtaGroup.TWO
        qk = sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, major.K, major.K,
                                                Float32, two, (PAIR * TILE, TILE))
        pv = sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, major.K, major.MN,
                                                Float32, two, (PAIR * TILE, self.head_dim),
                                                tcgen05.OperandSource.TMEM)
        return qk, pv

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, stream):
        d, m = self.head_dim, PAIR * TILE
        mma_qk, mma_pv = self._mmas()
        tiler_qk, tiler_pv = (m, TILE, d), (m, d, TILE)
        cta_layout_vmnk = cute.tiled_divide(cute.make_layout((PAIR, 1, 1)),
                                            (mma_qk.thr_id.shape,))
        # each CTA's share: its 128 rows of Q, half of K's keys, half of V^T's rows (D / 2)
        sQ_layout = sm100_utils.make_smem_layout_a(mma_qk, tiler_qk, self.dtype, 1)
        sK_layout = sm100_utils.make_smem_layout_b(mma_qk, tiler_qk, self.dtype, 1)
        sV_layout = sm100_utils.make_smem_layout_b(mma_pv, tiler_pv, self.dtype, 1)
        tP_layout = sm100_utils.make_smem_layout_a(mma_pv, tiler_pv, self.dtype, 1)
        mVt = select_modes(mV, [1, 0])
        load = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.TWO)
        one = [cute.select(x, mode=[0, 1, 2]) for x in (sQ_layout, sK_layout, sV_layout)]
        tma_q, gQ = cute.nvgpu.make_tiled_tma_atom_A(load, mQ, one[0], tiler_qk, mma_qk,
                                                     cta_layout_vmnk.shape)
        tma_k, gK = cute.nvgpu.make_tiled_tma_atom_B(load, mK, one[1], tiler_qk, mma_qk,
                                                     cta_layout_vmnk.shape)
        tma_v, gVt = cute.nvgpu.make_tiled_tma_atom_B(load, mVt, one[2], tiler_pv, mma_pv,
                                                      cta_layout_vmnk.shape)
        # the leader's barrier counts the bytes of both CTAs' loads
        load_bytes = PAIR * sum(cute.size_in_bytes(self.dtype, x) for x in one)

        @cute.struct
        class SharedStorage:
            mbar_load: cutlass.Int64  # leader: both CTAs' Q, K, V halves landed
            mbar_s: cutlass.Int64  # each CTA: S is in its TMEM (multicast commit)
            mbar_p: cutlass.Int64  # leader: both CTAs' P are in their TMEM (2 x 128 arrives)
            mbar_o: cutlass.Int64  # each CTA: O is in its TMEM (multicast commit)
            tmem_dealloc: cutlass.Int64  # the pair frees TMEM together (TmemAllocator)
            tmem_addr: Int32
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)],
                                  1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)],
                                  1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)],
                                  1024]

        self.kernel(mma_qk, mma_pv, tma_q, gQ, tma_k, gK, tma_v, gVt, mO, mLSE,
                    softmax_scale * LOG2_E, sQ_layout, sK_layout, sV_layout, tP_layout,
                    load_bytes, SharedStorage).launch(
            grid=(PAIR, 1, 1), block=(THREADS, 1, 1), cluster=(PAIR, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, tma_q: cute.CopyAtom,
               gQ: cute.Tensor, tma_k: cute.CopyAtom, gK: cute.Tensor, tma_v: cute.CopyAtom,
               gVt: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
               load_bytes: cutlass.Constexpr[int], SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # the allocator initialises its dealloc barrier: before the cluster barrier below
        tmem = TmemAllocator(storage.tmem_addr.ptr,
                             barrier_for_retrieve=NamedBarrier(TMEM_BARRIER_ID, THREADS),
                             allocator_warp_id=MMA_WARP, is_two_cta=True,
                             two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc.ptr)
        self.init_fn(storage.mbar_load.ptr, storage.mbar_s.ptr, storage.mbar_p.ptr,
                     storage.mbar_o.ptr, warp)  # exercise 10.4

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        tmem.allocate(self.plan.columns_allocated)
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(Float32)
        thr_qk, thr_pv = mma_qk.get_slice(cta_rank), mma_pv.get_slice(cta_rank)
        tStS, tOtO, tOrP = tmem_views(tmem_ptr, self.plan, thr_qk, thr_pv, tP_layout,
                                      self.dtype, PAIR * TILE, self.head_dim)

        if warp == MMA_WARP:
            copies = tma_copies(self.head_dim, PAIR * TILE, tma_q, gQ, tma_k, gK, tma_v, gVt,
                                sQ, sK, sV, thr_qk, thr_pv)
            if cta_rank == LEADER:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(storage.mbar_load.ptr, load_bytes)
            for atom, tg, ts in copies:  # a cta_group::2 load signals the leader's barrier
                cute.copy(atom, tg, ts, tma_bar_ptr=storage.mbar_load.ptr)
            tSrQ = mma_qk.make_fragment_A(sQ)[None, None, None, 0]
            tSrK = mma_qk.make_fragment_B(sK)[None, None, None, 0]
            tOrV = mma_pv.make_fragment_B(sV)[None, None, None, 0]

            # each issue builds its own tiled MMA: the accumulate flag it sets then stays
            # inside the leader's branch (a flag set on a shared object would escape it)
            def issue_s():
                qk = self._mmas()[0]
                for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    qk.set(tcgen05.Field.ACCUMULATE, k != 0)
                    cute.gemm(qk, tStS, tSrQ[None, None, k], tSrK[None, None, k], tStS)

            def issue_o():
                issue_pv(self._mmas()[1], tOtO, tOrP, tOrV)

            self.mma_fn(cta_rank, issue_s, issue_o, storage.mbar_load.ptr, storage.mbar_s.ptr,
                        storage.mbar_p.ptr, storage.mbar_o.ptr)  # exercise 10.3
        if warp < MMA_WARP:
            load_s, tStS_t2r, rS, store_p, tPtP, rP32, rP = row_views(tidx, tStS, self.plan,
                                                                       self.dtype)
            cute.arch.mbarrier_wait(storage.mbar_s.ptr, 0)  # the multicast commit, here
            cute.copy(load_s, tStS_t2r, rS)
            max_scaled, row_sum = row_exp2(rS, scale_log2)
            rP.store(rS.load().to(self.dtype))
            cute.copy(store_p, rP32, tPtP)
            cute.arch.fence_view_async_tmem_store()
            # the barrier the leader's MMA warp waits on counts both CTAs' threads
            cute.arch.mbarrier_arrive(storage.mbar_p.ptr, peer_cta_rank_in_cluster=LEADER)
            cute.arch.mbarrier_wait(storage.mbar_o.ptr, 0)
            write_row(tidx, cta_rank * TILE + tidx, tOtO, mO, mLSE, max_scaled, row_sum,
                      self.head_dim, self.dtype)
        cute.arch.barrier()  # nobody of this CTA touches its TMEM any more
        if warp == MMA_WARP:
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr)  # the pair's dealloc handshake (TmemAllocator, 2-CTA)


@cute.jit
def row_exp2(rS, scale_log2):
    """The row's max and exponentials in place, as softmax_to_p: (max * scale_log2, sum)."""
    row_max = -Float32.inf
    for c in cutlass.range_constexpr(cute.size(rS)):
        row_max = cute.arch.fmax(row_max, rS[c])
    max_scaled = row_max * scale_log2
    row_sum = Float32(0.0)
    for c in cutlass.range_constexpr(cute.size(rS)):
        p = cute.math.exp2(rS[c] * scale_log2 - max_scaled, fastmath=True)
        row_sum += p
        rS[c] = p
    return max_scaled, row_sum


# ----------------------------------------------------------------------------------------------
# compile (no GPU) and run (a B200)


def _compile_kernel(*args, **kwargs):
    from fa4_final.runtime.compile import compile_kernel

    return compile_kernel(*args, **kwargs)


def _fake_args(head_dim: int, dtype: str, rows: int):
    from fa4_final.common.constants import CUTLASS_BY_NAME
    from fa4_final.common.recipe import fake_stream, fake_tensor

    dt = CUTLASS_BY_NAME[dtype]
    div = 128 // dt.width
    q = fake_tensor(dt, (rows, head_dim), divisibility=div)
    k, v = (fake_tensor(dt, (TILE, head_dim), divisibility=div) for _ in range(2))
    out = fake_tensor(dt, (rows, head_dim), divisibility=div)
    lse = fake_tensor(Float32, (rows,), divisibility=1)
    return dt, (q, k, v, out, lse, Float32(head_dim**-0.5), fake_stream())


def compile_one_tile(head_dim: int = 128, dtype: str = "bf16", keep: bool = True,
                     issue_qk_fn=None, softmax_fn=None):
    """Compile ``OneTileAttention`` for sm_100a from fake tensors; (compiled, artifacts)."""
    dt, args = _fake_args(head_dim, dtype, TILE)
    kernel = OneTileAttention(dt, head_dim, issue_qk_fn, softmax_fn)
    return _compile_kernel(kernel, *args, arch="sm_100a", keep=keep)


def compile_pair_tile(head_dim: int = 128, dtype: str = "bf16", keep: bool = True,
                      mma_fn=None, init_fn=None):
    """Compile ``PairTileAttention`` for sm_100a from fake tensors; (compiled, artifacts)."""
    dt, args = _fake_args(head_dim, dtype, PAIR * TILE)
    kernel = PairTileAttention(dt, head_dim, mma_fn, init_fn)
    return _compile_kernel(kernel, *args, arch="sm_100a", keep=keep)
