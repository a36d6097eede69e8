"""Chapter 03: CuTe DSL fundamentals: layouts, partitions, copies and mma.sync.

This chapter has no attention kernel. It builds, one at a time, the pieces chapter 04's first
CuTe FlashAttention kernel is made of, and checks each against PyTorch:

1. ``vector_add``: one element per thread, the smallest complete CuTe kernel (launch, thread and
   block indices, a bounds check). Every load and store moves 4 bytes per thread: a warp
   instruction moves 128 B.
2. ``tiled_copy``: a CTA copies a (16, 32 * vec) tile; a thread-value (TV) layout gives each
   thread 16-byte vectors (``ld.global.v4``), so a warp instruction moves 512 B, 4x fewer
   instructions for the same bytes. Predicates, one per vector, handle ragged edges. The
   thread's partition and predicates come from one function, ``copy_partition``, which the
   learner writes in exercise 03.3 (``TiledCopy`` takes it as an argument).
3. ``gemm_tn``: C = A @ B^T, bf16/fp16 in, fp32 accumulate, the S = Q K^T of chapter 04. A 64x64
   CTA tile; cp.async copies 16 B per thread from global into swizzled shared memory, ldmatrix
   loads 8x8 blocks into registers, and mma.sync m16n8k16 does 2*16*8*16 = 4096 FLOP per warp
   instruction (an FMA instruction does 2*32 = 64: 64x fewer instructions). The K loop is not
   pipelined yet: each tile is loaded, waited for, then used (chapter 04 overlaps them). The
   epilogue (each thread's accumulators into C, predicated per element) is one function,
   ``store_accumulators``, which the learner writes in exercise 03.5 (``Gemm`` takes it as an
   argument; ``EpilogueOnCpu`` runs it for every thread on the CPU).

Also here: CuTe run on the host (a CPU, no GPU: layout algebra, partitions of NumPy arrays, the
vector-add and copy kernels' per-thread code run for every (block, thread) in a loop), the
chapter's exercises with their checkers, and ``compile_only(arch, kernel)`` for PTX/SASS on a CPU.
Measured figures live in results/<gpu>/ch03_kernels.json (``python -m measure.ch03_kernels``:
each kernel beside PyTorch in interleaved rounds); none are typed here.

Entry points (CUDA tensors): ``vector_add(a, b)``, ``tiled_copy(x)``, ``gemm_tn(a, b)``; each takes
an optional ``out=``. ``python -m solutions.ch03_cute_basics`` runs all three once on a GPU.
"""

import argparse
import functools
import math
import random
import re
import sys

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import numpy as np
import torch
from cutlass import Boolean, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cute.runtime import from_dlpack

from utils import layout_plots as lp

# ----------------------------------------------------------------------------------------------
# Tuning knobs

VECTOR_BITS = 128  # the widest global access one thread can make: 16 bytes
ADD_THREADS = 256  # vector add: threads per CTA, one element each
COPY_THREADS = 128  # tiled copy: 4 warps, laid out as 4 rows of 32 threads
COPY_TILE_M = 16  # tiled copy: rows per CTA tile, so each thread moves 16 / 4 = 4 vectors
GEMM_TILE = (64, 64, 64)  # (M, N, K) per CTA; K = 64 bf16 = one 128-byte row of shared memory
GEMM_WARPS = (2, 2, 1)  # warps along (M, N, K): each warp owns a 32x32 block of C
GEMM_THREADS = 32 * math.prod(GEMM_WARPS)

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}
MMA_DTYPES = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------
# 1. CuTe on the host. A @cute.jit function that launches no kernel runs on the CPU: static
#    layouts evaluate to Python ints while the function is traced, and tensors made with
#    from_dlpack over NumPy arrays can be read and written.


@cute.jit
def _cute_layout_grid(shape: cutlass.Constexpr, stride: cutlass.Constexpr):
    layout = cute.make_layout(shape, stride=stride)
    return lp.layout_grid(layout).tolist()


def cute_layout_grid(shape, stride) -> np.ndarray:
    """CuTe's own answer: the index the layout ``shape:stride`` gives every coordinate, as a
    2-D array (rank-1 layouts give one row). Runs on the CPU."""
    return np.array(_cute_layout_grid(shape, stride), dtype=np.int64)


@cute.jit
def _cute_layout_indices(cases: cutlass.Constexpr):
    return [cute.make_layout(s, stride=d)(c) for s, d, c in cases]


def cute_layout_indices(cases) -> list[int]:
    """CuTe's index for each ``(shape, stride, coord)`` in ``cases`` (one host trace)."""
    return [int(i) for i in _cute_layout_indices(tuple(cases))]


@cute.jit
def _cute_algebra_examples():
    out = {}
    # coalesce: the same function with the fewest modes (here one contiguous run of 12).
    a = cute.make_layout((2, (1, 6)), stride=(1, (6, 2)))
    out["coalesce"] = (f"coalesce({a})", str(cute.coalesce(a)))
    # composition R = A o B: R(c) = A(B(c)), B re-indexes A. A is a 4x8 row-major matrix; B
    # sends (i, j) to 4i + j, which A reads as its coordinate (j, i): R is A transposed.
    rows = cute.make_layout((4, 8), stride=(8, 1))
    walk = cute.make_layout((8, 4), stride=(4, 1))
    out["composition"] = (f"composition({rows}, {walk})", str(cute.composition(rows, walk)))
    # complement: the layout that reaches what the first one skips, up to a size: the "rest" of
    # a tiling. 4:2 reaches 0,2,4,6; (2,3):(1,8) adds 0,1 and 0,8,16, together covering 0..23.
    out["complement"] = ("complement(4:2, 24)", str(cute.complement(cute.make_layout(4, stride=2),
                                                                     24)))
    # divides: split a (8,16) row-major matrix into (4,8) tiles. logical_divide keeps each mode
    # as (tile, rest); zipped_divide gathers ((tile modes), (rest modes)): a CTA picks its tile
    # by slicing the second mode.
    m = cute.make_layout((8, 16), stride=(16, 1))
    out["logical_divide"] = (f"logical_divide({m}, (4,8))", str(cute.logical_divide(m, (4, 8))))
    out["zipped_divide"] = (f"zipped_divide({m}, (4,8))", str(cute.zipped_divide(m, (4, 8))))
    # A TV layout from a thread layout and a per-thread value layout: 4x8 threads, 1x4 values.
    thr = cute.make_layout((4, 8), stride=(8, 1))
    val = cute.make_layout((1, 4), stride=(4, 1))
    tiler, tv = cute.make_layout_tv(thr, val)
    out["make_layout_tv"] = (f"make_layout_tv({thr}, {val})", f"tile {tiler}, TV {tv}")
    return out


def layout_algebra_examples() -> dict[str, tuple[str, str]]:
    """A few layout-algebra results computed by CuTe on the CPU: name -> (expression, result)."""
    return dict(_cute_algebra_examples())


def _as_tuples(layout):
    return (layout.shape, layout.stride)


@cute.jit
def _copy_tv(dtype: cutlass.Constexpr):
    tiled_copy = _make_vector_copy(dtype, cute.nvgpu.CopyUniversalOp())
    return _as_tuples(tiled_copy.layout_tv_tiled), tuple(cute.size(t) for t in
                                                        tiled_copy.tiler_mn)


def copy_tv_layout(dtype=cutlass.BFloat16):
    """The TV layout of one pass of ``tiled_copy``'s threads, and the tile that pass covers:
    ``((shape, stride), (rows, cols))``. A CTA's tile is COPY_TILE_M // rows passes."""
    return _copy_tv(dtype)


@cute.jit
def _mma_tv(dtype: cutlass.Constexpr):
    atom = cute.make_mma_atom(warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)))
    return {
        "A": (_as_tuples(atom.tv_layout_A), (16, 16)),
        "B": (_as_tuples(atom.tv_layout_B), (8, 16)),
        "C": (_as_tuples(atom.tv_layout_C), (16, 8)),
    }


def mma_tv_layouts(dtype=cutlass.BFloat16) -> dict:
    """TV layouts of one mma.sync m16n8k16 (a warp: 32 threads): operand name -> ((shape,
    stride), tile). A is (M, K) = 16x16, B is (N, K) = 8x16, the accumulator C is 16x8."""
    return dict(_mma_tv(dtype))


@cute.jit
def _thread_slice(mTile: cute.Tensor, mOut: cute.Tensor, tv_shape: cutlass.Constexpr,
                  tv_stride: cutlass.Constexpr, tid: cutlass.Constexpr):
    tv = cute.make_layout(tv_shape, stride=tv_stride)
    # Partitioning is composition: tile o TV maps (thread, value) to an element of the tile.
    tTV = cute.composition(mTile, tv)  # (T, V)
    tMine = tTV[tid, None]  # (V,): the values of thread `tid`, in value order
    for v in cutlass.range_constexpr(cute.size(tMine)):
        mOut[v] = tMine[v]


def cute_thread_slice(tile: np.ndarray, tv_shape, tv_stride, tid: int) -> np.ndarray:
    """The values thread ``tid`` owns when the TV layout ``tv_shape:tv_stride`` partitions the
    2-D NumPy array ``tile`` (value order), computed by CuTe on the CPU through from_dlpack."""
    if not isinstance(tile, np.ndarray) or tile.ndim != 2:
        raise TypeError(f"tile must be a 2-D NumPy array, got {type(tile).__name__}")
    if tile.dtype not in (np.float32, np.int32):
        raise TypeError(f"tile dtype must be float32 or int32, got {tile.dtype}")
    threads, values = lp.size(tv_shape[0]), lp.size(tv_shape[1])
    if not 0 <= tid < threads:
        raise ValueError(f"tid must be in [0, {threads}) for TV shape {tv_shape}, got {tid}")
    reach = max(lp.crd2idx((t, v), tv_shape, tv_stride)
                for t in range(threads) for v in range(values))
    if reach >= tile.size:
        raise ValueError(f"TV layout {tv_shape}:{tv_stride} reaches index {reach}, outside the "
                         f"{tile.shape[0]}x{tile.shape[1]} tile")
    tile = np.ascontiguousarray(tile)
    out = np.zeros(values, dtype=tile.dtype)
    _thread_slice(from_dlpack(tile), from_dlpack(out), tv_shape, tv_stride, tid)
    return out


@cute.jit
def _cute_swizzle_grid(rows: cutlass.Constexpr, cols: cutlass.Constexpr):
    return lp.layout_grid(_smem_layout(rows, cols)).tolist()  # the GEMM's own smem layout


def cute_swizzled_offsets(rows: int = 64, cols: int = 64) -> np.ndarray:
    """Element offset of every (row, col) of a ``rows x cols`` 16-bit tile in ``gemm_tn``'s
    swizzled shared-memory layout, computed by CuTe on the CPU."""
    if rows % 8 or cols % 64:
        raise ValueError(f"rows must be a multiple of 8 and cols of 64, got {rows}x{cols}")
    return np.array(_cute_swizzle_grid(rows, cols), dtype=np.int64)


@cute.jit
def print_vs_printf(n: cutlass.Int32, tile: cutlass.Constexpr):
    """Python ``print`` runs once, while tracing: it sees static values and types, and shows
    dynamic ones as ``?``. ``cute.printf`` runs when the compiled code runs and sees values."""
    layout = cute.make_layout((n, tile))
    print(f"[trace]   tile = {tile}, n = {n}, layout = {layout}")
    cute.printf("[runtime] n = {}, layout = {}", n, layout)


# ----------------------------------------------------------------------------------------------
# 2a. Vector add: one element per thread. The per-thread code is its own @cute.jit function so
#     the same code runs in the kernel (GPU) and in a loop over (block, thread) on the CPU.


@cute.jit
def _vector_add_thread(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, bidx, tidx):
    i = bidx * ADD_THREADS + tidx  # this thread's element
    if i < cute.size(mC):  # the last CTA overhangs the end of the vectors
        mC[i] = mA[i] + mB[i]


@cute.kernel
def _vector_add_kernel(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    _vector_add_thread(mA, mB, mC, bidx, tidx)


@cute.jit
def vector_add_launch(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream: cuda.CUstream):
    """Host side: one CTA of ADD_THREADS threads per ADD_THREADS elements."""
    n = cute.size(mC)
    _vector_add_kernel(mA, mB, mC).launch(
        grid=((n + ADD_THREADS - 1) // ADD_THREADS, 1, 1), block=(ADD_THREADS, 1, 1),
        stream=stream,
    )


@cute.jit
def _vector_add_grid_on_cpu(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
    n = cute.size(mC)
    for bidx in cutlass.range((n + ADD_THREADS - 1) // ADD_THREADS):
        for tidx in cutlass.range(ADD_THREADS):
            _vector_add_thread(mA, mB, mC, bidx, tidx)


# ----------------------------------------------------------------------------------------------
# 2b. Tiled, vectorised copy. Threads form 4 rows of 32; each thread moves 16-byte vectors, so
#     one warp instruction covers 32 x 16 B = 512 contiguous bytes of a row.


def _vector_len(dtype) -> int:
    return VECTOR_BITS // dtype.width  # elements per 16-byte vector: 4 fp32, 8 bf16/fp16


@cute.jit
def _make_vector_copy(dtype: cutlass.Constexpr, op: cutlass.Constexpr):
    vec = _vector_len(dtype)
    warps = COPY_THREADS // 32
    thr = cute.make_layout((warps, 32), stride=(32, 1))  # (row, col) in the thread grid -> tid
    val = cute.make_layout((1, vec), stride=(vec, 1))  # each thread: 1 row x vec elements
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=VECTOR_BITS)
    return cute.make_tiled_copy_tv(atom, thr, val)  # covers a (4, 32 * vec) tile


def copy_tile_shape(dtype) -> tuple[int, int]:
    """The (rows, cols) tile one CTA of ``tiled_copy`` moves for a CuTe dtype."""
    return COPY_TILE_M, 32 * _vector_len(dtype)


@cute.jit
def copy_partition(tiled_copy: cute.TiledCopy, tidx, gX: cute.Tensor, gY: cute.Tensor,
                   cX: cute.Tensor, shape):
    """Thread ``tidx``'s share of one CTA tile (exercise 03.3's reference).

    Returns ``(tXgX, tXgY, tXpX)``: the thread's (CPY, CPY_M, CPY_N) slices of the source tile
    ``gX`` and the destination tile ``gY``, and one Boolean per vector, (CPY_M, CPY_N), True
    where the vector lies inside a tensor of extent ``shape``. ``cX`` holds the tile's (row,
    col) coordinates in the whole tensor."""
    thr_copy = tiled_copy.get_slice(tidx)
    tXgX = thr_copy.partition_S(gX)  # (CPY, CPY_M, CPY_N) = ((vec, 1), 4, 1)
    tXgY = thr_copy.partition_D(gY)  # (CPY, CPY_M, CPY_N)
    tXcX = thr_copy.partition_S(cX)  # (CPY, CPY_M, CPY_N) -> (row, col)
    # One predicate per vector: cols % vec == 0, so a vector is entirely inside or outside,
    # and its first element's coordinate decides for all of it.
    tXpX = cute.make_rmem_tensor((cute.size(tXgX, mode=[1]), cute.size(tXgX, mode=[2])),
                                 Boolean)  # (CPY_M, CPY_N)
    for m in cutlass.range_constexpr(cute.size(tXpX, mode=[0])):
        for n in cutlass.range_constexpr(cute.size(tXpX, mode=[1])):
            tXpX[m, n] = cute.elem_less(tXcX[0, m, n], shape)
    return tXgX, tXgY, tXpX


class TiledCopy:
    """The tiled copy kernel around a partition function: ``copy_partition`` or a learner's
    version of it (exercise 03.3). The host side, the device side and a CPU loop over every
    (block, thread) all call the same per-thread code, ``thread``."""

    def __init__(self, partition=copy_partition):
        self.partition = partition

    @cute.jit
    def thread(self, mX: cute.Tensor, mY: cute.Tensor, shape, bidx_m, bidx_n, tidx):
        """One thread of CTA (bidx_m, bidx_n). ``shape`` is the extent of the data: mX.shape
        in the kernel; on the CPU the tensors are larger buffers whose margin catches writes
        past the edges."""
        tile = copy_tile_shape(mX.element_type)
        tiled_copy = _make_vector_copy(mX.element_type, cute.nvgpu.CopyUniversalOp())
        gX = cute.local_tile(mX, tile, (bidx_m, bidx_n))  # (TILE_M, TILE_N)
        gY = cute.local_tile(mY, tile, (bidx_m, bidx_n))  # (TILE_M, TILE_N)
        # Coordinates of the same tile: c tensors hold (row, col) instead of data.
        cX = cute.local_tile(cute.make_identity_tensor(shape), tile, (bidx_m, bidx_n))
        # (CPY, CPY_M, CPY_N) twice, and (CPY_M, CPY_N) predicates
        tXgX, tXgY, tXpX = self.partition(tiled_copy, tidx, gX, gY, cX, shape)
        tXrX = cute.make_rmem_tensor_like(tXgX)  # (CPY, CPY_M, CPY_N) in registers
        # All loads first, then all stores: 4 loads in flight per thread instead of one.
        for m in cutlass.range_constexpr(cute.size(tXpX, mode=[0])):
            for n in cutlass.range_constexpr(cute.size(tXpX, mode=[1])):
                if tXpX[m, n]:
                    cute.copy(tiled_copy, tXgX[None, m, n], tXrX[None, m, n])
        for m in cutlass.range_constexpr(cute.size(tXpX, mode=[0])):
            for n in cutlass.range_constexpr(cute.size(tXpX, mode=[1])):
                if tXpX[m, n]:
                    cute.copy(tiled_copy, tXrX[None, m, n], tXgY[None, m, n])

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx_m, bidx_n, _ = cute.arch.block_idx()
        self.thread(mX, mY, mX.shape, bidx_m, bidx_n, tidx)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
        """Host side: a 2-D grid, one CTA per (COPY_TILE_M, 32 * vec) tile."""
        tile_m, tile_n = copy_tile_shape(mX.element_type)
        grid = ((mX.shape[0] + tile_m - 1) // tile_m, (mX.shape[1] + tile_n - 1) // tile_n, 1)
        self.kernel(mX, mY).launch(grid=grid, block=(COPY_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel_in_margin(self, mX: cute.Tensor, mY: cute.Tensor, rows: Int32, cols: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx_m, bidx_n, _ = cute.arch.block_idx()
        self.thread(mX, mY, (rows, cols), bidx_m, bidx_n, tidx)

    @cute.jit
    def launch_in_margin(self, mX: cute.Tensor, mY: cute.Tensor, rows: Int32, cols: Int32,
                         stream: cuda.CUstream):
        """The same grid for data of extent (rows, cols) inside larger buffers (the check's
        margin, which catches writes past the edges on the GPU too)."""
        tile_m, tile_n = copy_tile_shape(mX.element_type)
        grid = ((rows + tile_m - 1) // tile_m, (cols + tile_n - 1) // tile_n, 1)
        self.kernel_in_margin(mX, mY, rows, cols).launch(grid=grid, block=(COPY_THREADS, 1, 1),
                                                         stream=stream)

    @cute.jit
    def grid_on_cpu(self, mX: cute.Tensor, mY: cute.Tensor, rows: Int32, cols: Int32):
        """Every (block, thread) of the grid for data of extent (rows, cols), one after
        another; mX and mY may be larger (a margin that catches writes past the edges)."""
        tile_m, tile_n = copy_tile_shape(mX.element_type)
        for bidx_m in cutlass.range((rows + tile_m - 1) // tile_m):
            for bidx_n in cutlass.range((cols + tile_n - 1) // tile_n):
                for tidx in cutlass.range(COPY_THREADS):
                    self.thread(mX, mY, (rows, cols), bidx_m, bidx_n, tidx)


tiled_copy_launch = TiledCopy()  # the chapter's kernel, with the reference partition


# ----------------------------------------------------------------------------------------------
# 2c. GEMM with tensor cores: C (M, N) fp32 = A (M, K) @ B (N, K)^T, A and B K-major (row-major),
#     exactly S = Q K^T. One CTA: 4 warps, a 64x64 tile of C, K in steps of 64.
#
# Note [Swizzle] A 64-element bf16 row is 128 bytes: all 32 banks. ldmatrix reads an 8x8 block
# as 8 rows of 16 bytes at the same column; unswizzled, those 8 rows hit the same 4 banks, an
# 8-way conflict. Swizzle<3,3,3> XORs the row (mod 8) into the 16-byte chunk index, so the 8
# rows land in 8 different bank groups, while each 16-byte chunk stays contiguous for cp.async.


def _smem_layout(rows: int, cols: int):
    # An (8, 64) swizzled atom (8 rows x 128 B) repeated to cover the (rows, cols) tile.
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0,
                                     cute.make_layout((8, 64), stride=(64, 1)))
    return cute.tile_to_shape(atom, (rows, cols), (0, 1))


@cute.jit
def store_accumulators(tiled_mma: cute.TiledMma, tidx, tCrC: cute.Tensor, gC: cute.Tensor,
                       cC: cute.Tensor, shape):
    """The GEMM's epilogue (exercise 03.5's reference): thread ``tidx`` writes its fp32
    accumulators ``tCrC`` (MMA, MMA_M, MMA_N) into the CTA's tile ``gC`` of C, each one only
    where its coordinate, from the tile's coordinate tensor ``cC``, lies inside ``shape``."""
    thr_mma = tiled_mma.get_slice(tidx)
    tCgC = thr_mma.partition_C(gC)  # (MMA, MMA_M, MMA_N): the same TV layout as tCrC
    tCcC = thr_mma.partition_C(cC)  # (MMA, MMA_M, MMA_N) -> (m, n)
    for i in cutlass.range_constexpr(cute.size(tCrC)):
        if cute.elem_less(tCcC[i], shape):  # C's last tiles overhang M and N
            tCgC[i] = tCrC[i]


class Gemm:
    """C = A @ B^T with mma.sync around an epilogue function: ``store_accumulators`` or a
    learner's version of it (exercise 03.5)."""

    def __init__(self, epilogue=store_accumulators):
        self.epilogue = epilogue

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor,
               sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout,
               g2s_copy: cute.TiledCopy, tiled_mma: cute.TiledMma):
        tile_m, tile_n, tile_k = GEMM_TILE
        dtype = mA.element_type
        tidx, _, _ = cute.arch.thread_idx()
        bidx_m, bidx_n, _ = cute.arch.block_idx()

        # 1. This CTA's tiles of A, B, C in global memory, and their coordinates.
        gA = cute.local_tile(mA, (tile_m, tile_k), (bidx_m, None))  # (BM, BK, k_tiles)
        gB = cute.local_tile(mB, (tile_n, tile_k), (bidx_n, None))  # (BN, BK, k_tiles)
        gC = cute.local_tile(mC, (tile_m, tile_n), (bidx_m, bidx_n))  # (BM, BN)
        cA = cute.local_tile(cute.make_identity_tensor(mA.shape), (tile_m, tile_k),
                             (bidx_m, None))
        cB = cute.local_tile(cute.make_identity_tensor(mB.shape), (tile_n, tile_k),
                             (bidx_n, None))
        cC = cute.local_tile(cute.make_identity_tensor(mC.shape), (tile_m, tile_n),
                             (bidx_m, bidx_n))

        # 2. Shared memory: one swizzled (64, 64) tile each of A and B, 8 KB apiece.
        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(dtype, sA_layout, byte_alignment=128)  # (BM, BK)
        sB = smem.allocate_tensor(dtype, sB_layout, byte_alignment=128)  # (BN, BK)

        # 3. Global -> shared: each thread copies 16-byte vectors with cp.async.
        thr_g2s = g2s_copy.get_slice(tidx)
        tAgA = thr_g2s.partition_S(gA)  # (CPY, CPY_M, CPY_K, k_tiles)
        tAsA = thr_g2s.partition_D(sA)  # (CPY, CPY_M, CPY_K)
        tAcA = thr_g2s.partition_S(cA)  # (CPY, CPY_M, CPY_K, k_tiles) -> (m, k)
        tBgB = thr_g2s.partition_S(gB)  # (CPY, CPY_N, CPY_K, k_tiles)
        tBsB = thr_g2s.partition_D(sB)  # (CPY, CPY_N, CPY_K)
        tBcB = thr_g2s.partition_S(cB)  # (CPY, CPY_N, CPY_K, k_tiles) -> (n, k)

        # 4. The MMA's view: register fragments of A, B and the fp32 accumulator.
        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))  # (MMA, MMA_M, MMA_K)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))  # (MMA, MMA_N, MMA_K)
        tCrC = tiled_mma.make_fragment_C(thr_mma.partition_C(gC))  # (MMA, MMA_M, MMA_N) fp32
        tCrC.fill(0.0)

        # 5. Shared -> registers with ldmatrix, in exactly the layout the MMA fragments want.
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                   dtype)
        s2r_A = cute.make_tiled_copy_A(ldsm, tiled_mma)
        s2r_B = cute.make_tiled_copy_B(ldsm, tiled_mma)
        thr_s2r_A = s2r_A.get_slice(tidx)
        thr_s2r_B = s2r_B.get_slice(tidx)
        tCsA = thr_s2r_A.partition_S(sA)  # (CPY, CPY_M, CPY_K)
        tCrA_view = thr_s2r_A.retile(tCrA)  # (CPY, CPY_M, CPY_K): tCrA as ldmatrix's target
        tCsB = thr_s2r_B.partition_S(sB)  # (CPY, CPY_N, CPY_K)
        tCrB_view = thr_s2r_B.retile(tCrB)  # (CPY, CPY_N, CPY_K)

        # 6. Main loop over K tiles.
        for kt in range(cute.size(gA, mode=[2])):
            # Out-of-range vectors are zero-filled, not skipped: zeros past K add nothing to
            # the dot products, and rows past M or N never reach the output.
            for m in cutlass.range_constexpr(cute.size(tAsA, mode=[1])):
                for k in cutlass.range_constexpr(cute.size(tAsA, mode=[2])):
                    if cute.elem_less(tAcA[0, m, k, kt], mA.shape):
                        cute.copy(g2s_copy, tAgA[None, m, k, kt], tAsA[None, m, k])
                    else:
                        tAsA[None, m, k].fill(0)
            for n in cutlass.range_constexpr(cute.size(tBsB, mode=[1])):
                for k in cutlass.range_constexpr(cute.size(tBsB, mode=[2])):
                    if cute.elem_less(tBcB[0, n, k, kt], mB.shape):
                        cute.copy(g2s_copy, tBgB[None, n, k, kt], tBsB[None, n, k])
                    else:
                        tBsB[None, n, k].fill(0)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)  # this thread's copies have landed ...
            cute.arch.sync_threads()  # ... and everyone else's: the tile is complete
            for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):  # 64 / 16 = 4
                cute.copy(s2r_A, tCsA[None, None, kb], tCrA_view[None, None, kb])
                cute.copy(s2r_B, tCsB[None, None, kb], tCrB_view[None, None, kb])
                cute.gemm(tiled_mma, tCrC, tCrA[None, None, kb], tCrB[None, None, kb], tCrC)
            cute.arch.sync_threads()  # nobody overwrites the tile while another warp reads it

        # 7. Epilogue: each thread stores its accumulators that fall inside C (exercise 03.5).
        self.epilogue(tiled_mma, tidx, tCrC, gC, cC, mC.shape)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor,
                 stream: cuda.CUstream):
        """Host side: layouts, copy and MMA descriptions, one CTA per 64x64 tile of C."""
        tile_m, tile_n, tile_k = GEMM_TILE
        grid = ((mC.shape[0] + tile_m - 1) // tile_m, (mC.shape[1] + tile_n - 1) // tile_n, 1)
        self.kernel(mA, mB, mC, _smem_layout(tile_m, tile_k), _smem_layout(tile_n, tile_k),
                    _gemm_g2s_copy(mA.element_type), _gemm_tiled_mma(mA.element_type)).launch(
            grid=grid, block=(GEMM_THREADS, 1, 1), stream=stream)


@cute.jit
def _gemm_g2s_copy(dtype: cutlass.Constexpr):
    # cp.async, 16 B per thread: 8 threads cover a 64-element row, 128 threads 16 rows.
    vec = _vector_len(dtype)
    g2s_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   dtype, num_bits_per_copy=VECTOR_BITS)
    per_row = GEMM_TILE[2] // vec
    thr = cute.make_layout((GEMM_THREADS // per_row, per_row), stride=(per_row, 1))
    return cute.make_tiled_copy_tv(g2s_atom, thr, cute.make_layout((1, vec)))


@cute.jit
def _gemm_tiled_mma(dtype: cutlass.Constexpr):
    # 2x2 warps of m16n8k16. The permutation makes each warp's N extent 16 instead of 8, so
    # one ldmatrix.x4 loads B for two n8 atoms at once.
    return cute.make_tiled_mma(warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), GEMM_WARPS,
                               permutation_mnk=(GEMM_WARPS[0] * 16, GEMM_WARPS[1] * 16, 16))


gemm_launch = Gemm()  # the chapter's kernel, with the reference epilogue


class EpilogueOnCpu:
    """The GEMM's epilogue run on the CPU for every (block, thread) of the grid, one after
    another: each thread's accumulator fragment is filled with the values the reference
    partition gives it from a "truth" matrix (what the MMAs would have left there), then
    ``epilogue`` stores it. A right epilogue reproduces the truth matrix inside C and writes
    nothing outside."""

    def __init__(self, epilogue=store_accumulators):
        self.epilogue = epilogue

    @cute.jit
    def grid_on_cpu(self, mTruth: cute.Tensor, mC: cute.Tensor, rows: Int32, cols: Int32):
        tile_m, tile_n, _ = GEMM_TILE
        tiled_mma = _gemm_tiled_mma(cutlass.BFloat16)
        shape = (rows, cols)
        for bidx_m in cutlass.range((rows + tile_m - 1) // tile_m):
            for bidx_n in cutlass.range((cols + tile_n - 1) // tile_n):
                for tidx in cutlass.range(GEMM_THREADS):
                    gT = cute.local_tile(mTruth, (tile_m, tile_n), (bidx_m, bidx_n))
                    gC = cute.local_tile(mC, (tile_m, tile_n), (bidx_m, bidx_n))  # (BM, BN)
                    cC = cute.local_tile(cute.make_identity_tensor(shape), (tile_m, tile_n),
                                         (bidx_m, bidx_n))
                    thr_mma = tiled_mma.get_slice(tidx)
                    tTgT = thr_mma.partition_C(gT)  # (MMA, MMA_M, MMA_N)
                    tCrC = tiled_mma.make_fragment_C(tTgT)  # (MMA, MMA_M, MMA_N) fp32
                    for i in cutlass.range_constexpr(cute.size(tCrC)):
                        tCrC[i] = tTgT[i]
                    self.epilogue(tiled_mma, tidx, tCrC, gC, cC, shape)


# ----------------------------------------------------------------------------------------------
# 3. Running the kernels: on the CPU (the per-thread code of 2a/2b in a loop), on a GPU (torch),
#    or only compiling them for a chosen GPU (no GPU needed).


def _row_major_cute(t, vec: int):
    # Dynamic extents; the row length (hence the row stride) divisible by vec elements, so every
    # row starts on a 16-byte boundary and 16-byte vector accesses are legal.
    return (from_dlpack(t, assumed_align=16)
            .mark_compact_shape_dynamic(mode=0, stride_order=(0, 1))
            .mark_compact_shape_dynamic(mode=1, stride_order=(0, 1), divisibility=vec))


def vector_add_on_cpu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Run the vector-add kernel's per-thread code for every (block, thread) on the CPU."""
    _check_numpy(a, "a", ndim=1)
    _check_numpy(b, "b", ndim=1)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {a.shape} and {b.shape}")
    c = np.full_like(a, np.nan)
    args = [from_dlpack(x).mark_layout_dynamic() for x in (a, b, c)]
    _vector_add_grid_on_cpu(*args)
    return c


# Writes past the data's edges land in a margin around it (as wide as one CTA tile), so a run
# can show them instead of corrupting memory; the margin of the source holds this value (one
# that fp16 and bf16 represent exactly).
MARGIN_VALUE = 4096.0


def _margin_buffers(x, tile):
    """Source and destination buffers one tile larger than ``x`` below and to the right: x in
    the source's top-left corner, MARGIN_VALUE around it; the destination all NaN."""
    rows, cols = x.shape
    like = np if isinstance(x, np.ndarray) else torch
    kw = {"dtype": x.dtype} if like is np else {"dtype": x.dtype, "device": x.device}
    src = like.full((rows + tile[0], cols + tile[1]), MARGIN_VALUE, **kw)
    src[:rows, :cols] = x
    return src, like.full((rows + tile[0], cols + tile[1]), float("nan"), **kw)


def _copy_into_margin(x: np.ndarray, partition=copy_partition) -> np.ndarray:
    """The CPU run of the tiled copy with ``partition``, on x placed in the top-left corner of
    a larger buffer: returns the whole destination buffer, NaN wherever nothing was written."""
    vec = _vector_len(cutlass.Float32)
    src, dst = _margin_buffers(x, copy_tile_shape(cutlass.Float32))
    TiledCopy(partition).grid_on_cpu(_row_major_cute(src, vec), _row_major_cute(dst, vec),
                                     Int32(x.shape[0]), Int32(x.shape[1]))
    return dst


def tiled_copy_on_cpu(x: np.ndarray, partition=None) -> np.ndarray:
    """Run the tiled copy kernel's per-thread code for every (block, thread) on the CPU;
    ``partition`` replaces ``copy_partition`` (exercise 03.3)."""
    _check_numpy(x, "x", ndim=2)
    vec = _vector_len(cutlass.Float32)
    if x.shape[1] % vec:
        raise ValueError(f"x's row length must be a multiple of {vec} (16-byte vectors of "
                         f"float32), got shape {x.shape}")
    dst = _copy_into_margin(x, partition or copy_partition)
    return np.ascontiguousarray(dst[: x.shape[0], : x.shape[1]])


def _check_numpy(x, name, ndim):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if x.dtype != np.float32 or x.ndim != ndim or not x.flags.c_contiguous or x.size == 0:
        raise ValueError(f"{name} must be a non-empty C-contiguous {ndim}-D float32 array, got "
                         f"{x.dtype} with shape {x.shape}")


_COMPILED: dict = {}


def _check_tensor(name: str, t, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; accepted: {list(dtypes)}")


def _check_cuda(t, need_major: int = 0) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"these are GPU kernels: tensors must be on a CUDA device, got "
                         f"{t.device} (on a CPU use the *_on_cpu functions or compile_only)")
    major, minor = torch.cuda.get_device_capability(t.device)
    if major < need_major:
        raise ValueError(f"this kernel needs compute capability {need_major}.0 or newer, got "
                         f"{major}.{minor}")


def _aligned_contiguous(t):
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()  # a fresh allocation is 256-byte aligned


def _check_out(out, shape, dtype, device):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be {tuple(shape)} {dtype} on {device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError("out must be contiguous and start on a 16-byte boundary")
    return out


def _run(key, launcher, tensors, device):
    with torch.cuda.device(device):
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        if key not in _COMPILED:  # one compile per (kernel, dtype); every size reuses it
            _COMPILED[key] = cute.compile(launcher, *tensors, stream)
        _COMPILED[key](*tensors, stream)


def vector_add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None):
    """``a + b`` elementwise with the one-element-per-thread kernel (CUDA tensors, any shape)."""
    _check_tensor("a", a, TORCH_TO_CUTLASS)
    _check_tensor("b", b, TORCH_TO_CUTLASS)
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a and b must match in shape, dtype and device, got {tuple(a.shape)} "
                         f"{a.dtype} {a.device} and {tuple(b.shape)} {b.dtype} {b.device}")
    if a.numel() == 0:
        raise ValueError(f"empty input: shape {tuple(a.shape)}")
    _check_cuda(a)
    out = _check_out(out, a.shape, a.dtype, a.device)
    flat = [t.contiguous().view(-1) for t in (a, b)] + [out.view(-1)]
    tensors = [from_dlpack(t.detach()).mark_layout_dynamic() for t in flat]
    _run(("vector_add", a.dtype), vector_add_launch, tensors, a.device)
    return out


def tiled_copy(x: torch.Tensor, out: torch.Tensor | None = None, partition=None):
    """Copy a 2-D CUDA tensor with 16-byte accesses; its row length must be a multiple of
    16 bytes (4 fp32 or 8 bf16/fp16 elements). ``partition`` replaces ``copy_partition``
    (exercise 03.3)."""
    _check_tensor("x", x, TORCH_TO_CUTLASS)
    vec = _vector_len(TORCH_TO_CUTLASS[x.dtype])
    if x.dim() != 2 or x.numel() == 0 or x.shape[1] % vec:
        raise ValueError(f"x must be a non-empty 2-D tensor whose row length is a multiple of "
                         f"{vec} elements (16 bytes of {x.dtype}), got shape {tuple(x.shape)}")
    _check_cuda(x)
    x = _aligned_contiguous(x)
    out = _check_out(out, x.shape, x.dtype, x.device)
    tensors = [_row_major_cute(t.detach(), vec) for t in (x, out)]
    partition = partition or copy_partition
    _run(("tiled_copy", x.dtype, partition), TiledCopy(partition), tensors, x.device)
    return out


def gemm_tn(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, epilogue=None):
    """``a @ b.T`` in fp32 with mma.sync: a (M, K), b (N, K), bf16 or fp16 CUDA tensors,
    K a multiple of 8 (rows start on 16-byte boundaries). Returns (M, N) float32.
    ``epilogue`` replaces ``store_accumulators`` (exercise 03.5)."""
    _check_tensor("a", a, MMA_DTYPES)
    _check_tensor("b", b, MMA_DTYPES)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a must be (M, K) and b (N, K) with the same K, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a and b must share dtype and device, got {a.dtype} {a.device} and "
                         f"{b.dtype} {b.device}")
    (m, k), n = a.shape, b.shape[0]
    if min(m, n, k) == 0 or k % 8:
        raise ValueError(f"M, N, K must be positive and K a multiple of 8 (16-byte rows), got "
                         f"M={m}, N={n}, K={k}")
    _check_cuda(a, need_major=8)  # cp.async, ldmatrix and bf16 mma.sync arrived with sm_80
    out = _check_out(out, (m, n), torch.float32, a.device)
    a, b = _aligned_contiguous(a), _aligned_contiguous(b)
    tensors = [_row_major_cute(t.detach(), 8) for t in (a, b)] + [_row_major_cute(out, 1)]
    epilogue = epilogue or store_accumulators
    _run(("gemm_tn", a.dtype, epilogue), Gemm(epilogue), tensors, a.device)
    return out


KERNELS = ("vector_add", "tiled_copy", "gemm")


def compile_only(arch: str = "sm_80", kernel: str = "gemm", dtype=cutlass.BFloat16,
                 partition=None, epilogue=None):
    """Compile one of this chapter's kernels for ``arch`` with no GPU present and return its
    ``utils.compile_only.Artifacts`` (PTX, SASS, registers, spills). The fake tensors have the
    types the torch entry points pass (dynamic extents, 16-byte aligned rows). ``partition``
    replaces the tiled copy's ``copy_partition`` (exercise 03.3), ``epilogue`` the GEMM's
    ``store_accumulators`` (exercise 03.5)."""
    from utils.compile_only import compile_for, fake_stream

    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "gemm" and dtype not in (cutlass.BFloat16, cutlass.Float16):
        raise ValueError(f"gemm takes BFloat16 or Float16, got {dtype}")

    def fake(dt, rank, div=1, align=16):
        shape = (cute.sym_int32(),) if rank == 1 else (cute.sym_int32(),
                                                       cute.sym_int32(divisibility=div))
        return cute.runtime.make_fake_compact_tensor(
            dt, shape, stride_order=(0,) if rank == 1 else (1, 0), assumed_align=align)

    if kernel == "vector_add":  # scalar accesses: element alignment, like vector_add's tensors
        args = [fake(dtype, 1, align=dtype.width // 8) for _ in range(3)]
        return compile_for(arch, vector_add_launch, *args, fake_stream())
    vec = _vector_len(dtype)
    if kernel == "tiled_copy":
        return compile_for(arch, TiledCopy(partition or copy_partition), fake(dtype, 2, vec),
                           fake(dtype, 2, vec), fake_stream())
    return compile_for(arch, Gemm(epilogue or store_accumulators), fake(dtype, 2, vec),
                       fake(dtype, 2, vec),
                       fake(cutlass.Float32, 2), fake_stream())


# ----------------------------------------------------------------------------------------------
# 4. Exercises: a solved version of each and a checker that explains what is wrong.


def layout_index(shape, stride, coord) -> int:
    """Exercise 03.1: the index the layout ``shape:stride`` gives ``coord``.

    ``coord`` has the nesting of ``shape``, or is a single int, which is first split into a
    coordinate with the leftmost mode varying fastest."""

    def size(s):
        return s if isinstance(s, int) else math.prod(size(e) for e in s)

    if isinstance(shape, int):
        return coord * stride
    if isinstance(coord, int):  # split a 1-D coordinate: leftmost mode fastest
        parts = []
        for s in shape:
            parts.append(coord % size(s))
            coord //= size(s)
        coord = tuple(parts)
    return sum(layout_index(s, d, c) for s, d, c in zip(shape, stride, coord))


_FIXED_LAYOUT_CASES = (
    ((4, 8), (8, 1), (1, 2)),  # row-major 4x8: 1*8 + 2*1
    ((4, 8), (1, 4), (1, 2)),  # column-major 4x8: 1 + 2*4
    ((4, 8), (8, 1), 13),  # one int: 13 = (1, 3) leftmost-fastest, not (3, 1)
    (8, 2, 5),  # a rank-1 layout 8:2
    ((4, 8), (0, 1), (3, 5)),  # stride 0: every row sees the same elements (a broadcast)
    ((2, 2, 2), (4, 1, 2), 5),  # 5 = (1, 0, 1)
    ((4, (2, 4)), (2, (1, 8)), (1, (1, 2))),  # a nested mode
    ((4, (2, 4)), (2, (1, 8)), (3, 5)),  # an int inside a nested mode: 5 = (1, 2)
    ((4, (2, 4)), (2, (1, 8)), 29),
    (((4, 8), (2, 2)), ((32, 1), (16, 8)), (5, 3)),  # mma.sync's accumulator TV layout
)


def _random_layout(rng: random.Random, depth: int = 0):
    if depth >= 2 or rng.random() < 0.5:
        return rng.randint(1, 5), rng.choice([0, 1, 2, 3, 8, 16, 64])
    modes = [_random_layout(rng, depth + 1) for _ in range(rng.randint(2, 3))]
    return tuple(m[0] for m in modes), tuple(m[1] for m in modes)


def _random_coord(rng: random.Random, shape):
    if isinstance(shape, int) or rng.random() < 0.3:
        return rng.randrange(lp.size(shape))
    return tuple(_random_coord(rng, s) for s in shape)


@functools.lru_cache(maxsize=4)
def layout_index_cases(n_random: int = 30, seed: int = 3):
    """The fixed cases plus ``n_random`` random nested layouts, with CuTe's answers."""
    rng = random.Random(seed)
    cases = list(_FIXED_LAYOUT_CASES)
    while len(cases) < len(_FIXED_LAYOUT_CASES) + n_random:
        shape, stride = _random_layout(rng)
        if isinstance(shape, tuple):
            cases.append((shape, stride, _random_coord(rng, shape)))
    return tuple((s, d, c, i) for (s, d, c), i in zip(cases, cute_layout_indices(cases)))


def _has_int_inside(shape, coord) -> bool:
    if isinstance(shape, int):
        return False
    if isinstance(coord, int):
        return True
    return any(_has_int_inside(s, c) for s, c in zip(shape, coord))


def _split_ints(shape, coord):
    if isinstance(shape, int):
        return coord
    if isinstance(coord, int):
        coord = lp.idx2crd(coord, shape)
    return tuple(_split_ints(s, c) for s, c in zip(shape, coord))


def check_layout_index(fn) -> None:
    """Exercise 03.1's check: ``fn(shape, stride, coord)`` must agree with CuTe everywhere."""
    for shape, stride, coord, want in layout_index_cases():
        got = fn(shape, stride, coord)
        if got is None:
            raise AssertionError(f"layout_index returned None for {shape}:{stride} at {coord}; "
                                 "return the index (an int)")
        if got != want:
            hint = "index = sum of coordinate x stride over every mode"
            if _has_int_inside(shape, coord):
                hint = (f"a single int coordinate of a tuple mode is first split "
                        f"leftmost-mode-fastest: {coord} in shape {shape} is "
                        f"{_split_ints(shape, coord)}")
            raise AssertionError(f"layout {shape}:{stride} at coordinate {coord}: expected "
                                 f"{want}, got {got}. Hint: {hint}.")


def thread_coords(tv_shape, tv_stride, tile_shape, tid) -> list[tuple[int, int]]:
    """Exercise 03.2: the ``(m, n)`` tile coordinates thread ``tid`` owns under the TV layout
    ``tv_shape:tv_stride`` over a ``(M, N)`` tile, in value order."""
    tile_m = tile_shape[0]
    coords = []
    for v in range(lp.size(tv_shape[1])):  # number of values per thread
        i = layout_index(tv_shape, tv_stride, (tid, v))  # index into the tile, column by column
        coords.append((i % tile_m, i // tile_m))
    return coords


@functools.lru_cache(maxsize=1)
def thread_coords_cases():
    """(name, tv_shape, tv_stride, tile_shape, tid, CuTe's coordinates) for exercise 03.2."""
    copy_layout, copy_tile = copy_tv_layout(cutlass.Float32)
    cases = [("tiled_copy (fp32)", copy_layout, copy_tile, t) for t in (0, 5, 37, 127)]
    for name, (layout, tile) in mma_tv_layouts().items():
        # not lane 5 of the accumulator: the chapter shows that one before the exercise
        cases += [(f"mma.sync m16n8k16 operand {name}", layout, tile, t) for t in (0, 6, 31)]
    # make_layout_tv((4,8):(8,1), (1,4):(4,1)): 4x8 threads, 1x4 values each, a (4, 32) tile
    small = (((8, 4), 4), ((16, 1), 4))
    cases += [("4x8 threads x 1x4 values", small, (4, 32), t) for t in (0, 9, 31)]
    out = []
    for name, (shape, stride), tile, tid in cases:
        # Tag each element with its coordinates, let CuTe partition it, read the tags back.
        tags = (np.arange(tile[0])[:, None] * 10000 + np.arange(tile[1])[None, :]).astype(np.int32)
        mine = cute_thread_slice(tags, shape, stride, tid)
        out.append((name, shape, stride, tile, tid, [(int(t) // 10000, int(t) % 10000)
                                                     for t in mine]))
    return tuple(out)


def check_thread_coords(fn) -> None:
    """Exercise 03.2's check: ``fn`` must give the coordinates CuTe's partition gives."""
    for name, shape, stride, tile, tid, want in thread_coords_cases():
        got = fn(shape, stride, tile, tid)
        if got is None:
            raise AssertionError("thread_coords returned None; return a list of (m, n) pairs")
        got = [tuple(int(x) for x in c) for c in got]
        if got != want:
            hint = ("the TV layout gives an index into the tile counted column by column "
                    "(leftmost fastest): (m, n) = (i % M, i // M)")
            if sorted(got) == sorted(want):
                hint = "right elements, wrong order: list them in value order v = 0, 1, ..."
            raise AssertionError(f"{name}: TV layout {shape}:{stride} on a {tile[0]}x{tile[1]} "
                                 f"tile, thread {tid} owns {want}, you gave {got}. Hint: {hint}.")


TILE_ROWS, TILE_COLS = 64, 64  # exercise 03.4's shared-memory tile: 64 rows of 64 bf16 = 128 B
ELEM_BYTES = 2


def plain_offset(row: int, col: int) -> int:
    """Row-major element offset in the (64, 64) 16-bit tile: the bank-conflicted layout."""
    return row * TILE_COLS + col


def swizzled_offset(row: int, col: int) -> int:
    """Exercise 03.4: a conflict-free element offset for the (64, 64) 16-bit tile."""
    chunk = (col // 8) ^ (row % 8)  # XOR the row into the 16-byte chunk index: Swizzle<3,3,3>
    return row * TILE_COLS + chunk * 8 + col % 8


def ldmatrix_addresses(offset_fn, row0: int = 0, chunk: int = 0) -> list[int]:
    """Byte addresses one ldmatrix 8x8 read asks for: 16 bytes at 16-byte chunk ``chunk`` of
    rows ``row0 .. row0 + 7`` (one address per thread 0..7)."""
    return [offset_fn(row0 + r, 8 * chunk) * ELEM_BYTES for r in range(8)]


def row_write_addresses(offset_fn, row0: int = 0) -> list[int]:
    """Byte addresses of one warp's cp.async writes: 32 threads x 16 bytes, 8 per row, rows
    ``row0 .. row0 + 3`` (the gemm's global -> shared copy)."""
    return [offset_fn(row0 + t // 8, 8 * (t % 8)) * ELEM_BYTES for t in range(32)]


def check_swizzled_offset(fn) -> None:
    """Exercise 03.4's check: a one-to-one layout of the tile that keeps 16-byte chunks whole
    and makes both ldmatrix column reads and cp.async row writes conflict free."""
    grid = np.array([[fn(r, c) for c in range(TILE_COLS)] for r in range(TILE_ROWS)])
    if grid.dtype.kind not in "iu":
        raise AssertionError(f"offsets must be ints, got {grid.dtype}")
    n = TILE_ROWS * TILE_COLS
    if grid.min() < 0 or grid.max() >= n or len(np.unique(grid)) != n:
        raise AssertionError(f"offsets must be a one-to-one map of the {TILE_ROWS}x{TILE_COLS} "
                             f"tile onto 0..{n - 1}: two elements would share a slot or one "
                             "would fall outside the buffer")
    for r in range(TILE_ROWS):
        for c0 in range(0, TILE_COLS, 8):
            first = int(grid[r, c0])
            if first % 8 or any(int(grid[r, c0 + i]) != first + i for i in range(8)):
                raise AssertionError(
                    f"row {r}, columns {c0}..{c0 + 7} are no longer 8 consecutive elements "
                    "starting at a multiple of 8: a 16-byte cp.async or ldmatrix row could not "
                    "move them in one access. Permute whole 16-byte chunks, not elements.")
    for row0 in range(0, TILE_ROWS, 8):
        for chunk in range(TILE_COLS // 8):
            addrs = ldmatrix_addresses(fn, row0, chunk)
            rep = lp.bank_wavefronts(addrs, 16)
            if not rep.conflict_free:
                raise AssertionError(
                    f"ldmatrix reading 16-byte chunk {chunk} of rows {row0}..{row0 + 7} takes "
                    f"{rep.wavefronts} cycles instead of 1 ({rep.ways}-way bank conflict); its "
                    f"byte addresses {addrs} must fall in 8 different 16-byte bank groups "
                    "(address % 128 // 16 all different)")
    for row0 in range(0, TILE_ROWS, 4):
        rep = lp.bank_wavefronts(row_write_addresses(fn, row0), 16)
        if not rep.conflict_free:
            raise AssertionError(f"the cp.async writes of rows {row0}..{row0 + 3} take "
                                 f"{rep.wavefronts} cycles instead of {rep.ideal}")


# What the prompts forbid ({helper: why}); each exercise's reference is refused anyway.
LAYOUT_INDEX_FORBID = {
    lp.crd2idx: "it evaluates the layout for you; that is the exercise",
    lp.idx2crd: "it splits the int coordinate for you; splitting leftmost-fastest is half the "
                "exercise",
    cute_layout_indices: "it asks CuTe for the answer",
    cute_layout_grid: "it asks CuTe for the answer",
}
THREAD_COORDS_FORBID = {
    cute_thread_slice: "it lets CuTe partition the tile for you; compute the coordinates from "
                       "the TV layout",
    lp.crd2idx: "it evaluates the layout for you; use your layout_index from exercise 03.1",
}
SWIZZLE_FORBID = {
    cute_swizzled_offsets: "it reads CuTe's own swizzled layout; write the permutation yourself",
}


# Exercise 03.3: the tiled copy's partition and predicate. Shapes that are no multiple of the
# (16, 128) fp32 tile in either direction, one that is exactly a tile, and one smaller than a
# warp's row of vectors.
COPY_CHECK_SHAPES = ((37, 132), (16, 128), (1, 4), (17, 260), (40, 8))


def _first(mask: np.ndarray, k: int = 3) -> list[tuple[int, int]]:
    return [(int(r), int(c)) for r, c in np.argwhere(mask)[:k]]


def copy_verdict(x: np.ndarray, dst: np.ndarray, vec: int | None = None) -> str | None:
    """What is wrong with a tiled copy of ``x`` into the margin buffer ``dst`` (None: nothing):
    writes past the edges, elements never written, elements with the wrong value. ``vec`` is
    the copy's elements per 16-byte vector (default: from x's dtype)."""
    rows, cols = x.shape
    what = f"copying a {rows} x {cols} tensor (tiles of {COPY_TILE_M} x 32 vectors)"
    below, right = ~np.isnan(dst[rows:, :]), ~np.isnan(dst[:rows, cols:])
    if below.any() or right.any():
        where = []
        if below.any():
            first = [(r + rows, c) for r, c in _first(below)]
            where.append(f"rows {rows} and beyond (first at {first})")
        if right.any():
            first = [(r, c + cols) for r, c in _first(right)]
            where.append(f"columns {cols} and beyond (first at {first})")
        return (f"{what}: your threads wrote outside the tensor, at {' and at '.join(where)}. "
                "In a kernel those writes corrupt memory. The predicate of a vector must be "
                "False when its coordinate (row, col), from the coordinate tensor cX, is outside "
                "`shape` in either direction: cute.elem_less(coordinate, shape) checks both.")
    inside = dst[:rows, :cols]
    missing = np.isnan(inside)
    if missing.any():
        written = int((~missing).sum())
        hint = ("every vector inside the tensor needs a True predicate, and every thread its "
                "own slice")
        vec = vec or 128 // (8 * x.dtype.itemsize)
        ctas = -(-rows // COPY_TILE_M) * -(-cols // (32 * vec))
        one_thread = COPY_TILE_M // (COPY_THREADS // 32) * vec
        if written <= 2 * ctas * one_thread:  # about one thread's worth per CTA
            hint = ("only a few elements arrived, as if all threads took the same slice: "
                    "take thread tidx's own slice, tiled_copy.get_slice(tidx)")
        return (f"{what}: {int(missing.sum())} of {inside.size} elements were never written, "
                f"first at (row, col) {_first(missing)}. Hint: {hint}.")
    wrong = inside != x
    if wrong.any():
        r, c = _first(wrong, 1)[0]
        came = np.argwhere(x == inside[r, c])
        src = f" (it holds x{tuple(int(v) for v in came[0])})" if len(came) else ""
        return (f"{what}: element ({r}, {c}) received the wrong value{src}; {int(wrong.sum())} "
                "elements are wrong. The source and destination slices must be the same "
                "thread's view of the same tile: partition_S(gX) and partition_D(gY) of one "
                "get_slice(tidx).")
    return None


def check_copy_partition(fn) -> None:
    """Exercise 03.3's check: the tiled copy run on the CPU with ``fn`` as its partition, on
    awkward shapes with a margin that catches writes past the edges, then compiled for sm_80:
    four 16-byte loads and four 16-byte stores per thread, nothing narrower."""
    for i, shape in enumerate(COPY_CHECK_SHAPES):
        x = np.random.default_rng(40 + i).standard_normal(shape, dtype=np.float32)
        problem = copy_verdict(x, _copy_into_margin(x, fn))
        if problem:
            raise AssertionError(problem)
    art = compile_only("sm_80", "tiled_copy", partition=fn)
    loads, stores = art.count("ld.global.v4"), art.count("st.global.v4")
    per_thread = COPY_TILE_M // (COPY_THREADS // 32)
    if (loads, stores) != (per_thread, per_thread):
        raise AssertionError(
            f"compiled for sm_80, the copy makes {loads} 16-byte loads and {stores} 16-byte "
            f"stores per thread; a thread owns {per_thread} vectors of the {COPY_TILE_M}-row tile "
            "(4 rows of threads per pass), so expect that many of each.")
    narrow = re.findall(r"(?:ld|st)\.global\.(?:b|f|u|s)\d+\b", art.ptx)
    if narrow:
        raise AssertionError(f"compiled for sm_80, the copy also makes narrower global accesses "
                             f"({sorted(set(narrow))}): every access should be one 16-byte "
                             "vector, as the tiled copy's atom moves them.")


# Exercise 03.5: the GEMM's epilogue. C shapes that are no multiple of the 64 x 64 tile in
# either direction, one that is exactly a tile, one smaller than a warp's piece.
EPILOGUE_CHECK_SHAPES = ((77, 136), (64, 64), (5, 3), (130, 70))


def _epilogue_into_margin(truth: np.ndarray, epilogue) -> np.ndarray:
    """The CPU run of the epilogue on a C of truth's shape inside a larger buffer: returns the
    whole destination buffer, NaN wherever nothing was written."""
    rows, cols = truth.shape
    src, dst = _margin_buffers(truth, GEMM_TILE[:2])
    EpilogueOnCpu(epilogue).grid_on_cpu(_row_major_cute(src, 1), _row_major_cute(dst, 1),
                                        Int32(rows), Int32(cols))
    return dst


def epilogue_verdict(truth: np.ndarray, dst: np.ndarray) -> str | None:
    """What is wrong with an epilogue's C (inside the margin buffer ``dst``), or None."""
    rows, cols = truth.shape
    what = f"storing a {rows} x {cols} C (tiles of 64 x 64, 128 threads)"
    below, right = ~np.isnan(dst[rows:, :]), ~np.isnan(dst[:rows, cols:])
    if below.any() or right.any():
        where = []
        if below.any():
            where.append(f"rows {rows} and beyond (first at "
                         f"{[(r + rows, c) for r, c in _first(below)]})")
        if right.any():
            where.append(f"columns {cols} and beyond (first at "
                         f"{[(r, c + cols) for r, c in _first(right)]})")
        return (f"{what}: your threads wrote outside C, at {' and at '.join(where)}. The last "
                "tiles overhang M and N; store an accumulator only when its (m, n) from the "
                "partitioned coordinate tensor cC is inside `shape` in both directions "
                "(cute.elem_less)")
    inside = dst[:rows, :cols]
    missing = np.isnan(inside)
    if missing.any():
        hint = ("every accumulator inside C must be stored: check the predicate and that each "
                "thread stores its whole fragment")
        if missing.sum() >= 0.5 * inside.size:
            hint = ("most of C was never written, as if the threads shared a few slices: "
                    "partition gC and cC with this thread's slice, tiled_mma.get_slice(tidx)")
        return (f"{what}: {int(missing.sum())} of {inside.size} elements were never written, "
                f"first at (m, n) {_first(missing)}. Hint: {hint}")
    wrong = inside != truth
    if wrong.any():
        r, c = _first(wrong, 1)[0]
        came = np.argwhere(truth == inside[r, c])
        src = f" (it holds C{tuple(int(v) for v in came[0])})" if len(came) else ""
        return (f"{what}: element ({r}, {c}) received the wrong accumulator{src}; "
                f"{int(wrong.sum())} elements are wrong. The accumulator fragment tCrC is laid "
                "out by the MMA's C layout: partition gC with partition_C of the same thread's "
                "slice (not partition_A or B, not another thread's)")
    return None


def _epilogue_stores(art) -> int:
    """Global stores of 4-byte words in the PTX, a vector store counting each of its words."""
    words = 0
    for m in re.finditer(r"st\.global(?:\.v(\d))?\.(?:f32|b32|u32|s32)", art.ptx):
        words += int(m.group(1) or 1)
    return words


def check_store_accumulators(fn) -> None:
    """Exercise 03.5's check: the epilogue run on the CPU for every thread of ragged C's with a
    margin that catches writes past the edges, then compiled into the GEMM for sm_80: one 4-byte
    store per accumulator (32 per thread), the MMA loop untouched, no local memory."""
    for i, shape in enumerate(EPILOGUE_CHECK_SHAPES):
        truth = np.random.default_rng(70 + i).standard_normal(shape, dtype=np.float32)
        problem = epilogue_verdict(truth, _epilogue_into_margin(truth, fn))
        if problem:
            raise AssertionError(problem)
    art = compile_only("sm_80", "gemm", epilogue=fn)
    per_thread = GEMM_TILE[0] * GEMM_TILE[1] // GEMM_THREADS
    if art.count("mma.sync") != 32:
        raise AssertionError(f"compiled for sm_80, the GEMM has {art.count('mma.sync')} mma.sync "
                             "per K tile instead of 32: the epilogue must not change the loop")
    if art.count("ld.local") or art.count("st.local") or art.spills:
        raise AssertionError(
            "compiled for sm_80, the epilogue uses local memory (ld.local/st.local): an index "
            "into a register tensor that is not known at compile time forces it out of "
            "registers. Loop with cutlass.range_constexpr so every index is static")
    stores = _epilogue_stores(art)
    if stores != per_thread:
        raise AssertionError(f"compiled for sm_80, each thread stores {stores} 4-byte words; it "
                             f"holds {per_thread} accumulators (64 x 64 / 128 threads), and "
                             "each must be stored once")


def check_epilogue_on_gpu(epilogue, shape, dtype=torch.bfloat16, seed: int = 0):
    """Exercise 03.5 on a GPU: gemm_tn with ``epilogue`` against float64 for A (M, K) and B (N,
    K) of ``shape`` = (M, N, K); C is the start of a larger buffer whose tail (64 more rows) must
    stay untouched. Returns (ok, one line)."""
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, k, device="cuda", generator=g).to(dtype)
    buf = torch.full(((m + GEMM_TILE[0]) * n,), float("nan"), device="cuda")
    c = buf[: m * n].view(m, n)
    gemm_tn(a, b, out=c, epilogue=epilogue)
    torch.cuda.synchronize()
    name = f"{m} x {n} x {k} {str(dtype).replace('torch.', '')}"
    if not torch.isnan(buf[m * n:]).all():
        return False, f"{name}: the epilogue wrote past the end of C (rows {m} and beyond)"
    if torch.isnan(c).any():
        return False, f"{name}: {int(torch.isnan(c).sum())} elements of C were never written"
    ref = a.double() @ b.double().T
    err = ((c.double() - ref).norm() / ref.norm()).item()
    ok = err < 1e-5
    return ok, f"{name}: relative error {err:.1e} against float64" + ("" if ok else ": wrong")


def check_copy_on_gpu(partition, shape, dtype=torch.bfloat16, seed: int = 0):
    """Exercise 03.3 on a GPU: the tiled copy kernel with ``partition``, x of ``shape`` (fresh
    random values) in a margin buffer as on the CPU. Returns (ok, one line)."""
    _check_tensor("dtype", torch.empty(0, dtype=dtype), TORCH_TO_CUTLASS)
    dt = TORCH_TO_CUTLASS[dtype]
    if shape[1] % _vector_len(dt):
        raise ValueError(f"the row length must be a multiple of {_vector_len(dt)} for {dtype}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g).to(dtype)
    _check_cuda(x)
    src, dst = _margin_buffers(x, copy_tile_shape(dt))
    tensors = [_row_major_cute(t, _vector_len(dt)) for t in (src, dst)]
    key = ("tiled_copy_in_margin", dtype, partition)
    with torch.cuda.device(x.device):
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        args = (*tensors, Int32(shape[0]), Int32(shape[1]), stream)
        if key not in _COMPILED:
            _COMPILED[key] = cute.compile(TiledCopy(partition).launch_in_margin, *args)
        _COMPILED[key](*args)
    torch.cuda.synchronize()
    problem = copy_verdict(x.float().cpu().numpy(), dst.float().cpu().numpy(), _vector_len(dt))
    name = str(dtype).replace("torch.", "")
    return problem is None, f"{shape[0]} x {shape[1]} {name}: {problem or 'exact, nothing outside'}"


# ----------------------------------------------------------------------------------------------
# Reading the stored run (results/h200/ch03_kernels.json, measure/ch03_kernels.py)

KERNEL_PEERS = {"vector_add": "torch.add", "tiled_copy": "torch copy_",
                "gemm_tn": "torch bf16 matmul"}


def kernel_share(res, impl: str) -> float:
    """``impl``'s figure (GB/s or TFLOP/s) over PyTorch's for the same work, same run."""
    return (res.one(impl=impl)["value"] / res.one(impl=KERNEL_PEERS[impl])["value"])


def kernel_lines(res, impl: str) -> list[str]:
    """The pair of one stored measurement: each side's median and spread over the rounds, and
    the ratio, said to be within noise when it is inside the two spreads."""
    from utils import bench

    ours, peer = res.one(impl=impl), res.one(impl=KERNEL_PEERS[impl])
    lines = [f"  {r['impl']:<18} {r['value']:8.1f} {r['unit']} (spread {r['spread']:.1%} over "
             f"{r['rounds']} rounds)" for r in (ours, peer)]
    cmp = bench.compare(ours, peer)
    verdict = "" if cmp is None else f": {cmp}"
    lines.append(f"  {impl} at {ours['value'] / peer['value']:.2f} of {peer['impl']}{verdict}")
    return lines


# ----------------------------------------------------------------------------------------------
# Quick check on a GPU (also what to run under compute-sanitizer).


def _main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to run (compile_only(arch, kernel) works on a CPU)")
        return 0
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(1000, device="cuda", generator=g) for _ in range(2))
    ok = torch.equal(vector_add(a, b), a + b)
    x = torch.randn(37, 264, device="cuda", dtype=torch.bfloat16, generator=g)
    ok &= torch.equal(tiled_copy(x), x)
    a = torch.randn(77, 136, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(131, 136, device="cuda", dtype=torch.bfloat16, generator=g)
    err = (gemm_tn(a, b).double() - a.double() @ b.double().T).abs().max().item()
    torch.cuda.synchronize()
    ok &= err < 1e-3
    print(f"vector_add, tiled_copy exact; gemm_tn max |error| {err:.2e}: {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_main())
