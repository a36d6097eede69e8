"""Typical wrong answers to the device-code exercises of chapters 03-05, written the way a
learner would write them, so the checkers' words are tested on real slips (CPU tests) and the
GPU checks are shown to catch them (tests/gpu). Kernels' source must live in a file: here."""

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


# ----------------------------------------------------------------------------------------------
# 05.4: the producer's K/V loop


def _load(pipe, state, atom, tg, ts, tile):
    pipe.producer_acquire(state)
    cute.copy(atom, tg[None, tile], ts[None, state.index],
              tma_bar_ptr=pipe.producer_get_barrier(state))
    state.advance()


@cute.jit
def load_all_k_then_v(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k, tma_atom_v,
                      tKgK, tKsK, tVgV, tVsV, n_tiles):
    for i in cutlass.range(n_tiles, unroll=1):
        _load(pipeline_k, state_k, tma_atom_k, tKgK, tKsK, n_tiles - 1 - i)
    for i in cutlass.range(n_tiles, unroll=1):
        _load(pipeline_v, state_v, tma_atom_v, tVgV, tVsV, n_tiles - 1 - i)


@cute.jit
def load_v_first_in_each_turn(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k,
                              tma_atom_v, tKgK, tKsK, tVgV, tVsV, n_tiles):  # right, too
    # written out in the loop body: a state advanced inside a helper function is not carried
    # through the DSL's loop (see test_a_helper_that_advances_the_state_is_named)
    if n_tiles > 0:
        pipeline_k.producer_acquire(state_k)
        cute.copy(tma_atom_k, tKgK[None, n_tiles - 1], tKsK[None, state_k.index],
                  tma_bar_ptr=pipeline_k.producer_get_barrier(state_k))
        state_k.advance()
        for i in cutlass.range(n_tiles - 1, unroll=1):
            pipeline_v.producer_acquire(state_v)
            cute.copy(tma_atom_v, tVgV[None, n_tiles - 1 - i], tVsV[None, state_v.index],
                      tma_bar_ptr=pipeline_v.producer_get_barrier(state_v))
            state_v.advance()
            pipeline_k.producer_acquire(state_k)
            cute.copy(tma_atom_k, tKgK[None, n_tiles - 2 - i], tKsK[None, state_k.index],
                      tma_bar_ptr=pipeline_k.producer_get_barrier(state_k))
            state_k.advance()
        pipeline_v.producer_acquire(state_v)
        cute.copy(tma_atom_v, tVgV[None, 0], tVsV[None, state_v.index],
                  tma_bar_ptr=pipeline_v.producer_get_barrier(state_v))


@cute.jit
def load_with_a_helper(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k, tma_atom_v,
                       tKgK, tKsK, tVgV, tVsV, n_tiles):  # the right order, but see above
    if n_tiles > 0:
        _load(pipeline_k, state_k, tma_atom_k, tKgK, tKsK, n_tiles - 1)
        for i in cutlass.range(n_tiles - 1, unroll=1):
            _load(pipeline_k, state_k, tma_atom_k, tKgK, tKsK, n_tiles - 2 - i)
            _load(pipeline_v, state_v, tma_atom_v, tVgV, tVsV, n_tiles - 1 - i)
        _load(pipeline_v, state_v, tma_atom_v, tVgV, tVsV, 0)


@cute.jit
def load_in_ascending_order(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k, tma_atom_v,
                            tKgK, tKsK, tVgV, tVsV, n_tiles):
    if n_tiles > 0:
        _load(pipeline_k, state_k, tma_atom_k, tKgK, tKsK, 0)
        for i in cutlass.range(n_tiles - 1, unroll=1):
            _load(pipeline_k, state_k, tma_atom_k, tKgK, tKsK, i + 1)
            _load(pipeline_v, state_v, tma_atom_v, tVgV, tVsV, i)
        _load(pipeline_v, state_v, tma_atom_v, tVgV, tVsV, n_tiles - 1)


@cute.jit
def load_without_acquire(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k, tma_atom_v,
                         tKgK, tKsK, tVgV, tVsV, n_tiles):
    for i in cutlass.range(n_tiles, unroll=1):
        cute.copy(tma_atom_k, tKgK[None, n_tiles - 1 - i], tKsK[None, state_k.index],
                  tma_bar_ptr=pipeline_k.producer_get_barrier(state_k))
        state_k.advance()
        cute.copy(tma_atom_v, tVgV[None, n_tiles - 1 - i], tVsV[None, state_v.index],
                  tma_bar_ptr=pipeline_v.producer_get_barrier(state_v))
        state_v.advance()


@cute.jit
def load_without_advance(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k, tma_atom_v,
                         tKgK, tKsK, tVgV, tVsV, n_tiles):
    if n_tiles > 0:
        pipeline_k.producer_acquire(state_k)
        cute.copy(tma_atom_k, tKgK[None, n_tiles - 1], tKsK[None, state_k.index],
                  tma_bar_ptr=pipeline_k.producer_get_barrier(state_k))
        for i in cutlass.range(n_tiles - 1, unroll=1):
            pipeline_k.producer_acquire(state_k)
            cute.copy(tma_atom_k, tKgK[None, n_tiles - 2 - i], tKsK[None, state_k.index],
                      tma_bar_ptr=pipeline_k.producer_get_barrier(state_k))
            _load(pipeline_v, state_v, tma_atom_v, tVgV, tVsV, n_tiles - 1 - i)
        _load(pipeline_v, state_v, tma_atom_v, tVgV, tVsV, 0)


@cute.jit
def load_barrier_after_advance(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k,
                               tma_atom_v, tKgK, tKsK, tVgV, tVsV, n_tiles):
    if n_tiles > 0:
        _load(pipeline_k, state_k, tma_atom_k, tKgK, tKsK, n_tiles - 1)
        for i in cutlass.range(n_tiles - 1, unroll=1):
            _load(pipeline_k, state_k, tma_atom_k, tKgK, tKsK, n_tiles - 2 - i)
            pipeline_v.producer_acquire(state_v)
            slot = state_v.index
            state_v.advance()
            cute.copy(tma_atom_v, tVgV[None, n_tiles - 1 - i], tVsV[None, slot],
                      tma_bar_ptr=pipeline_v.producer_get_barrier(state_v))
        _load(pipeline_v, state_v, tma_atom_v, tVgV, tVsV, 0)


@cute.jit
def load_forgets_last_v(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k, tma_atom_v,
                        tKgK, tKsK, tVgV, tVsV, n_tiles):
    if n_tiles > 0:
        _load(pipeline_k, state_k, tma_atom_k, tKgK, tKsK, n_tiles - 1)
        for i in cutlass.range(n_tiles - 1, unroll=1):
            _load(pipeline_k, state_k, tma_atom_k, tKgK, tKsK, n_tiles - 2 - i)
            _load(pipeline_v, state_v, tma_atom_v, tVgV, tVsV, n_tiles - 1 - i)


@cute.jit
def load_without_guard(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k, tma_atom_v,
                       tKgK, tKsK, tVgV, tVsV, n_tiles):
    _load(pipeline_k, state_k, tma_atom_k, tKgK, tKsK, n_tiles - 1)
    for i in cutlass.range(n_tiles - 1, unroll=1):
        _load(pipeline_k, state_k, tma_atom_k, tKgK, tKsK, n_tiles - 2 - i)
        _load(pipeline_v, state_v, tma_atom_v, tVgV, tVsV, n_tiles - 1 - i)
    _load(pipeline_v, state_v, tma_atom_v, tVgV, tVsV, 0)


@cute.jit
def load_not_done(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k, tma_atom_v,
                  tKgK, tKsK, tVgV, tVsV, n_tiles):
    raise NotImplementedError("exercise: replace this line with your code")
