"""Typical wrong answers to the device-code exercises of chapters 03-04, written the way a
learner would write them, so the checkers' words are tested on real slips (CPU tests) and the
GPU checks are shown to catch them (tests/gpu). Kernels' source must live in a file: here.
Chapter 05's live in tests/exercise_mutations/ch05.py."""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32

from solutions import ch03_cute_basics as ch03

# ----------------------------------------------------------------------------------------------
# 03.3: the tiled copy's partition and predicate


def _predicates(tXgX):
    return cute.make_rmem_tensor((cute.size(tXgX, mode=[1]), cute.size(tXgX, mode=[2])), Boolean)


@cute.jit
def partition_no_predicate(tiled_copy, tidx, gX, gY, cX, shape):
    thr = tiled_copy.get_slice(tidx)
    tXgX, tXgY = thr.partition_S(gX), thr.partition_D(gY)
    tXpX = _predicates(tXgX)
    tXpX.fill(True)
    return tXgX, tXgY, tXpX


@cute.jit
def partition_rows_only(tiled_copy, tidx, gX, gY, cX, shape):
    thr = tiled_copy.get_slice(tidx)
    tXgX, tXgY, tXcX = thr.partition_S(gX), thr.partition_D(gY), thr.partition_S(cX)
    tXpX = _predicates(tXgX)
    for m in cutlass.range_constexpr(cute.size(tXpX, mode=[0])):
        for n in cutlass.range_constexpr(cute.size(tXpX, mode=[1])):
            tXpX[m, n] = tXcX[0, m, n][0] < shape[0]  # the row only: columns overhang
    return tXgX, tXgY, tXpX


@cute.jit
def partition_thread_zero(tiled_copy, tidx, gX, gY, cX, shape):
    return ch03.copy_partition(tiled_copy, 0, gX, gY, cX, shape)  # every thread takes slice 0


@cute.jit
def partition_not_done(tiled_copy, tidx, gX, gY, cX, shape):
    raise NotImplementedError("exercise: replace this line with your code")


# ----------------------------------------------------------------------------------------------
# 04.4: the quad all-reduce


@cute.jit
def allreduce_eight_lanes(x: Float32, op: cutlass.Constexpr) -> Float32:
    for offset in (1, 2, 4):
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=offset))
    return x


@cute.jit
def allreduce_one_step(x: Float32, op: cutlass.Constexpr) -> Float32:
    return op(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def allreduce_same_offset_twice(x: Float32, op: cutlass.Constexpr) -> Float32:
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return op(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def allreduce_shift_down(x: Float32, op: cutlass.Constexpr) -> Float32:
    x = op(x, cute.arch.shuffle_sync_down(x, offset=2))
    return op(x, cute.arch.shuffle_sync_down(x, offset=1))


@cute.jit
def allreduce_max_always(x: Float32, op: cutlass.Constexpr) -> Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def allreduce_in_a_loop(x: Float32, op: cutlass.Constexpr) -> Float32:  # right, written as a loop
    for i in cutlass.range_constexpr(2):
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1 << i))
    return x


@cute.jit
def allreduce_no_return(x: Float32, op: cutlass.Constexpr) -> Float32:
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1))


# ----------------------------------------------------------------------------------------------
# 04.5: the causal mask of a fragment


@cute.jit
def mask_top_left(acc_S, tScS, row0, col0, seqlen_q, seqlen_k, causal: cutlass.Constexpr):
    for i in cutlass.range(cute.size(acc_S), unroll_full=True):
        row, col = row0 + tScS[i][0], col0 + tScS[i][1]
        limit = seqlen_k
        if cutlass.const_expr(causal):
            limit = cutlass.min(limit, row + 1)  # as if seqlen_q == seqlen_k
        if col >= limit:
            acc_S[i] = -Float32.inf


@cute.jit
def mask_hides_diagonal(acc_S, tScS, row0, col0, seqlen_q, seqlen_k, causal: cutlass.Constexpr):
    for i in cutlass.range(cute.size(acc_S), unroll_full=True):
        row, col = row0 + tScS[i][0], col0 + tScS[i][1]
        limit = seqlen_k
        if cutlass.const_expr(causal):
            limit = cutlass.min(limit, row + seqlen_k - seqlen_q)  # one short
        if col >= limit:
            acc_S[i] = -Float32.inf


@cute.jit
def mask_tile_coordinates(acc_S, tScS, row0, col0, seqlen_q, seqlen_k,
                          causal: cutlass.Constexpr):
    for i in cutlass.range(cute.size(acc_S), unroll_full=True):
        row, col = tScS[i][0], tScS[i][1]  # forgot the tile's origin
        limit = seqlen_k
        if cutlass.const_expr(causal):
            limit = cutlass.min(limit, row + 1 + seqlen_k - seqlen_q)
        if col >= limit:
            acc_S[i] = -Float32.inf


@cute.jit
def mask_causal_only(acc_S, tScS, row0, col0, seqlen_q, seqlen_k, causal: cutlass.Constexpr):
    for i in cutlass.range(cute.size(acc_S), unroll_full=True):
        row, col = row0 + tScS[i][0], col0 + tScS[i][1]
        if cutlass.const_expr(causal):  # keys past seqlen_k stay visible when not causal
            if col > row + seqlen_k - seqlen_q:
                acc_S[i] = -Float32.inf


@cute.jit
def mask_wrong_sign(acc_S, tScS, row0, col0, seqlen_q, seqlen_k, causal: cutlass.Constexpr):
    for i in cutlass.range(cute.size(acc_S), unroll_full=True):
        row, col = row0 + tScS[i][0], col0 + tScS[i][1]
        limit = seqlen_k
        if cutlass.const_expr(causal):
            limit = cutlass.min(limit, row + 1 + seqlen_q - seqlen_k)
        if col >= limit:
            acc_S[i] = -Float32.inf


@cute.jit
def mask_nothing(acc_S, tScS, row0, col0, seqlen_q, seqlen_k, causal: cutlass.Constexpr):
    pass


@cute.jit
def mask_not_done(acc_S, tScS, row0, col0, seqlen_q, seqlen_k, causal: cutlass.Constexpr):
    raise NotImplementedError("exercise: replace this line with your code")
