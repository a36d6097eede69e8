"""Typical wrong answers to the device-code exercises of chapter 03, written the way a
learner would write them, so the checkers' words are tested on real slips (CPU tests) and the
GPU checks are shown to catch them (tests/gpu). Kernels' source must live in a file: here.
Chapters 04 and 05's live in tests/exercise_mutations/ch04.py and ch05.py."""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean

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
