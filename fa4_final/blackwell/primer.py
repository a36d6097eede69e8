"""Chapter 09's primer: one attention tile on Blackwell, every tcgen05 step in the open.

``OneTileAttention`` computes out = softmax(scale * Q K^T) V for one tile of 128 query rows and
128 keys (D = 64 or 128), with the pieces the full forward (``fa4_final.blackwell.fwd``) builds on,
each used exactly once:

    tcgen05.alloc        the MMA warp allocates the TMEM columns of ``tmem.forward_plan``
    TMA + mbarrier       Q, K, V land in shared memory; one barrier counts their bytes
    tcgen05.mma          ONE thread issues S = Q K^T (A and B from shared memory, fp32 in TMEM)
    tcgen05.commit       the MMA's completion arrives on an mbarrier: "S is ready"
    tcgen05.ld           each softmax thread loads its own row of S (lane = row: the
                         lane-quarter rule makes the softmax a whole warpgroup)
    tcgen05.st           P = exp2(S - m) in bf16, stored into the upper half of S's columns
    tcgen05.mma (TMEM A) O = P V reads P straight from TMEM, V from shared memory
    tcgen05.ld           O, scaled by 1 / rowsum, written to global memory row by row
    tcgen05.dealloc      the same warp frees the columns

Roles: warps 0-3 are the softmax warpgroup (thread t owns row t, TMEM lane t); warp 4 loads and
issues the MMAs. Synchronisation is written with raw mbarrier calls here, so each wait and
arrive is visible; the forward wraps the same calls in named pipelines.

Shapes: q (128, D), k (128, D), v (128, D), out (128, D), lse (128,) float32; compiled for
sm_100a only. It is complete code for a B200 (tests/gpu/test_blackwell_fwd.py runs it there);
here it is compiled and its PTX read.
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
from fa4_final.constants import LN_2, LOG2_E, WARP_SIZE
from fa4_final.fragments import select_modes

TILE = 128  # query rows = keys = TMEM lanes = threads of the softmax warpgroup
MMA_WARP = 4  # the warp after the softmax warpgroup
THREADS = (MMA_WARP + 1) * WARP_SIZE
TMEM_BARRIER_ID = 1  # named barrier: the TMEM address is in shared memory for everyone


class OneTileAttention:
    """One 128 x 128 attention tile with tcgen05 (see the module docstring)."""

    def __init__(self, dtype, head_dim: int):
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.plan = forward_plan(TILE, head_dim, q_stages=1)

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
        d = self.head_dim
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
        thr_qk, thr_pv = mma_qk.get_slice(0), mma_pv.get_slice(0)
        # ((TILE, TILE), 1, 1) fp32 accumulator S and ((TILE, D), 1, 1) O, at the plan's columns
        tStS = cute.make_tensor(tmem_ptr + self.plan.offset("S0"),
                                thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE, TILE)))
                                .layout)
        tOtO = cute.make_tensor(tmem_ptr + self.plan.offset("O0"),
                                thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE, d)))
                                .layout)
        # P as the A operand of O = P V, 16-bit, inside S's columns: (MMA, MMA_M, MMA_K)
        tOrP_layout = thr_pv.make_fragment_A(tP_layout.outer)[None, None, None, 0].layout
        tOrP = cute.make_tensor(cute.recast_ptr(tmem_ptr + self.plan.offset("P0"),
                                                dtype=self.dtype), tOrP_layout)

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
        tiler_qk, tiler_pv = (TILE, TILE, self.head_dim), (TILE, self.head_dim, TILE)
        # TMA partitions of the one tile of each operand: (TMA, 1) in smem and gmem
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
            copies.append((atom, tg, ts))
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(storage.mbar_load.ptr, load_bytes)
            for atom, tg, ts in copies:
                cute.copy(atom, tg, ts[None, 0], tma_bar_ptr=storage.mbar_load.ptr)
        cute.arch.mbarrier_wait(storage.mbar_load.ptr, 0)

        # S = Q K^T, D / 16 instructions of 128 x 128 x 16, issued by one thread
        tSrQ = mma_qk.make_fragment_A(sQ)  # (MMA, 1, D/16, 1): smem descriptors
        tSrK = mma_qk.make_fragment_B(sK)
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            mma_qk.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(mma_qk, tStS, tSrQ[None, None, k, 0], tSrK[None, None, k, 0], tStS)
        with cute.arch.elect_one():
            tcgen05.commit(storage.mbar_s.ptr)  # arrives when the MMAs above have completed

        cute.arch.mbarrier_wait(storage.mbar_p.ptr, 0)  # the softmax stored P
        tOrV = mma_pv.make_fragment_B(sV)  # (MMA, 1, TILE/16, 1)
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            mma_pv.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(mma_pv, tOtO, tOrP[None, None, k], tOrV[None, None, k, 0], tOtO)
        with cute.arch.elect_one():
            tcgen05.commit(storage.mbar_o.ptr)

    @cute.jit
    def softmax_and_epilogue(self, tidx, tStS, tOtO, mO, mLSE, scale_log2, storage):
        """Thread t owns row t: lane t of TMEM, which warp t // 32 may reach (quarter t // 32)."""
        d = self.head_dim
        tS = tStS[(None, None), 0, 0]  # (TILE, TILE) fp32 in TMEM
        load_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            tS).get_slice(tidx)
        tStS_t2r = load_s.partition_S(tS)  # (((32, 32), 1), 1, TILE/32): 4 loads of 32 columns
        rS = cute.make_rmem_tensor(load_s.partition_D(cute.make_identity_tensor((TILE, TILE)))
                                   .shape, Float32)  # this thread's 128 scores
        cute.arch.mbarrier_wait(storage.mbar_s.ptr, 0)
        cute.copy(load_s, tStS_t2r, rS)

        row_max = -Float32.inf
        for c in cutlass.range_constexpr(cute.size(rS)):
            row_max = cute.arch.fmax(row_max, rS[c])
        max_scaled = row_max * scale_log2
        row_sum = Float32(0.0)
        # P goes to TMEM as pairs of 16-bit values in 32-bit columns: a register tensor of
        # TILE/2 fp32 "words", written through a 16-bit view of the same registers
        p_cols = self.plan["P0"].columns
        tP32 = cute.make_tensor(tStS.iterator + (self.plan.offset("P0") - self.plan.offset("S0")),
                                cute.composition(tS.layout, cute.make_layout((TILE, p_cols))))
        store_p = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(16)), Float32),
            tP32).get_slice(tidx)
        tPtP_r2t = store_p.partition_D(tP32)
        rP32 = cute.make_rmem_tensor(store_p.partition_S(cute.make_identity_tensor(
            (TILE, p_cols))).shape, Float32)
        rP = cute.make_tensor(cute.recast_ptr(rP32.iterator, dtype=self.dtype), rS.layout)
        for c in cutlass.range_constexpr(cute.size(rS)):
            p = cute.math.exp2(rS[c] * scale_log2 - max_scaled, fastmath=True)
            row_sum += p
            rS[c] = p
        rP.store(rS.load().to(self.dtype))
        cute.copy(store_p, rP32, tPtP_r2t)
        cute.arch.fence_view_async_tmem_store()  # the stores are visible to the MMA ...
        cute.arch.mbarrier_arrive(storage.mbar_p.ptr)  # ... that waits for all 128 arrives

        tO = tOtO[(None, None), 0, 0]  # (TILE, D)
        load_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            tO).get_slice(tidx)
        rO = cute.make_rmem_tensor(load_o.partition_D(cute.make_identity_tensor((TILE, d)))
                                   .shape, Float32)
        cute.arch.mbarrier_wait(storage.mbar_o.ptr, 0)
        cute.copy(load_o, load_o.partition_S(tO), rO)
        inv_sum = cute.arch.rcp_approx(row_sum)
        for c in cutlass.range_constexpr(cute.size(rO)):
            rO[c] = rO[c] * inv_sum
        rOut = cute.make_rmem_tensor(d, self.dtype)
        rOut.store(rO.load().to(self.dtype))
        cute.autovec_copy(rOut, mO[tidx, None])  # one row per thread: D contiguous elements
        mLSE[tidx] = (max_scaled + cute.math.log2(row_sum, fastmath=True)) * LN_2


def compile_one_tile(head_dim: int = 128, dtype: str = "bf16", keep: bool = True):
    """Compile ``OneTileAttention`` for sm_100a from fake tensors; (compiled, artifacts)."""
    from fa4_final.compile import compile_kernel, fake_stream, fake_tensor
    from fa4_final.constants import CUTLASS_BY_NAME

    dt = CUTLASS_BY_NAME[dtype]
    div = 128 // dt.width
    tiles = [fake_tensor(dt, (TILE, head_dim), divisibility=div) for _ in range(4)]
    lse = fake_tensor(Float32, (TILE,), divisibility=1)
    kernel = OneTileAttention(dt, head_dim)
    return compile_kernel(kernel, *tiles, lse, Float32(head_dim**-0.5), fake_stream(),
                          arch="sm_100a", keep=keep)
