"""Chapter 03's exercises: typical wrong answers, each with the words its checker must say.
The device-code ones (03.3 the tiled copy's partition, 03.5 the GEMM's epilogue) are @cute.jit
functions, most of them the reference with one change (``mutant``, which writes each to a file:
the DSL reads a kernel's source); the GPU tests (tests/gpu/test_device_exercises.py) use them
too."""

import cutlass.cute as cute

from solutions import ch03_cute_basics as ch03
from tests.exercise_mutations import mutant, planted
from utils import layout_plots as lp


# --- 03.1 a layout's index --------------------------------------------------------------------
def _index(shape, stride, coord, split):
    if isinstance(shape, int):
        return coord * stride
    if isinstance(coord, int):
        coord = split(shape, coord)
    return sum(_index(s, d, c, split) for s, d, c in zip(shape, stride, coord))


def _split_rightmost(shape, coord):
    parts = []
    for s in reversed(shape):
        parts.append(coord % lp.size(s))
        coord //= lp.size(s)
    return tuple(reversed(parts))


def index_rightmost_fastest(shape, stride, coord):
    return _index(shape, stride, coord, _split_rightmost)


def index_int_as_first_mode(shape, stride, coord):
    return _index(shape, stride, coord, lambda s, c: (c,) + (0,) * (len(s) - 1))


def index_from_the_plot_helper(shape, stride, coord):
    return lp.crd2idx(coord, shape, stride)


# --- 03.2 a thread's coordinates --------------------------------------------------------------
def coords_row_major(tv_shape, tv_stride, tile_shape, tid):
    n = tile_shape[1]
    out = []
    for v in range(lp.size(tv_shape[1])):
        i = ch03.layout_index(tv_shape, tv_stride, (tid, v))
        out.append((i // n, i % n))  # rows first: the tile index is column by column
    return out


def coords_sorted(tv_shape, tv_stride, tile_shape, tid):
    m = tile_shape[0]
    idx = sorted(ch03.layout_index(tv_shape, tv_stride, (tid, v))
                 for v in range(lp.size(tv_shape[1])))
    return [(i % m, i // m) for i in idx]


def coords_from_cute(tv_shape, tv_stride, tile_shape, tid):
    import numpy as np

    tags = (np.arange(tile_shape[0])[:, None] * 10000
            + np.arange(tile_shape[1])[None, :]).astype(np.int32)
    mine = ch03.cute_thread_slice(tags, tv_shape, tv_stride, tid)
    return [(int(t) // 10000, int(t) % 10000) for t in mine]


# --- 03.3 the tiled copy's partition and predicate --------------------------------------------
COPY, STORE = ch03.copy_partition, ch03.store_accumulators
INSIDE = "cute.elem_less(tXcX[0, m, n], shape)"


partition_no_predicate = mutant(COPY, INSIDE, "True")  # every vector inside


partition_rows_only = mutant(COPY, INSIDE, "tXcX[0, m, n][0] < shape[0]")  # columns overhang


partition_thread_zero = mutant(COPY, "get_slice(tidx)", "get_slice(0)")  # every thread: slice 0


@cute.jit
def partition_not_done(tiled_copy, tidx, gX, gY, cX, shape):
    raise NotImplementedError("exercise: replace this line with your code")


@cute.jit
def partition_calls_the_reference(tiled_copy, tidx, gX, gY, cX, shape):
    return ch03.copy_partition(tiled_copy, tidx, gX, gY, cX, shape)


# --- 03.4 the swizzle -------------------------------------------------------------------------
def swizzle_none(row, col):
    return row * 64 + col


def swizzle_elements(row, col):
    return row * 64 + (col ^ (row % 8))  # permutes elements inside a 16-byte chunk


def swizzle_by_row_block(row, col):
    return row * 64 + ((col // 8) ^ (row // 8 % 8)) * 8 + col % 8  # rows 0..7 share a key


def swizzle_or_not_xor(row, col):
    return row * 64 + ((col // 8) | (row % 8)) * 8 + col % 8  # two chunks land in one slot


def swizzle_read_from_cute(row, col):
    return int(ch03.cute_swizzled_offsets()[row, col])


# --- 03.5 the GEMM's epilogue -----------------------------------------------------------------
epilogue_no_predicate = mutant(  # the last tiles overhang M and N
    STORE, "if cute.elem_less(tCcC[i], shape):", "if True:")


epilogue_rows_only = mutant(  # columns past N are written too
    STORE, "cute.elem_less(tCcC[i], shape)", "tCcC[i][0] < shape[0]")


epilogue_thread_zero = mutant(  # every thread stores to thread 0's places
    STORE, "get_slice(tidx)", "get_slice(0)")


epilogue_lane_not_thread = mutant(  # the lane: every warp stores to warp 0's places
    STORE, "get_slice(tidx)", "get_slice(tidx % 32)")


@cute.jit
def epilogue_not_done(tiled_mma, tidx, tCrC, gC, cC, shape):
    raise NotImplementedError("exercise: replace this line with your code")


MUTATIONS = [
    *planted("03.1", ch03.check_layout_index, ch03.layout_index, ch03.LAYOUT_INDEX_FORBID, rows=[
        (index_rightmost_fastest, "leftmost-mode-fastest"),
        (index_int_as_first_mode, "leftmost-mode-fastest"),
        (index_from_the_plot_helper, "evaluates the layout for you"),
    ]),
    *planted("03.2", ch03.check_thread_coords, ch03.thread_coords, ch03.THREAD_COORDS_FORBID, rows=[
        (coords_row_major, "column by column"),
        (coords_sorted, "wrong order"),
        (coords_from_cute, "lets CuTe partition the tile"),
    ]),
    *planted("03.3", ch03.check_copy_partition, ch03.copy_partition, rows=[
        (partition_no_predicate, "outside the tensor"),
        (partition_rows_only, "columns"),
        (partition_thread_zero, "get_slice(tidx)"),
        (partition_not_done, "not done"),
        (partition_calls_the_reference, "reference solution"),
    ]),
    *planted("03.4", ch03.check_swizzled_offset, ch03.swizzled_offset, ch03.SWIZZLE_FORBID, rows=[
        (swizzle_none, "bank conflict"),
        (swizzle_elements, "Permute whole 16-byte chunks"),
        (swizzle_by_row_block, "bank conflict"),
        (swizzle_or_not_xor, "one-to-one"),
        (swizzle_read_from_cute, "CuTe's own swizzled layout"),
    ]),
    *planted("03.5", ch03.check_store_accumulators, ch03.store_accumulators, rows=[
        (epilogue_no_predicate, "outside C"),
        (epilogue_rows_only, "columns"),
        (epilogue_thread_zero, "get_slice(tidx)"),
        (epilogue_lane_not_thread, "get_slice(tidx)"),
        (epilogue_not_done, "not done"),
    ]),
]
