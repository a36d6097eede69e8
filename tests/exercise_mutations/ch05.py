"""Chapter 05's exercises and their typical wrong answers, written the way a learner would write
them: tests/test_exercise_mutations.py holds each against its checker (it must be refused, with
the words in ``says``), the CPU tests reuse them, and tests/gpu/test_device_exercises.py shows
the GPU checks on some. Most device-code ones are the reference with one change (``mutant``
writes each to a file: the DSL reads a kernel's source); the others are written out here."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from fa4_final.hopper.wgmma import issue_wgmma
from solutions import ch05_consumer as c5
from solutions import ch05_flash_hopper as ch05
from solutions import ch05_teaching as t5
from tests.exercise_mutations import SLOW, mutant, planted

# ----------------------------------------------------------------------------------------------
# 05.1: the stage count
STAGES_FORBID = {
    ch05.max_stages: "it is the kernel's own answer; do the sum yourself",
    ch05.smem_bytes: "it is the kernel's own sum; do the sum yourself",
    t5.smem_breakdown: "it is the sum, item by item; do it yourself",
}


def stages_one_tile_per_stage(head_dim, cfg):  # a stage holds a K tile and a V tile
    q_tile = cfg.tile_m * head_dim * 2
    return max(0, (ch05.SMEM_BYTES_PER_CTA - 1024 - q_tile) // (cfg.tile_n * head_dim * 2))


def stages_without_q(head_dim, cfg):  # Q's tile (and the barriers) forgotten
    return ch05.SMEM_BYTES_PER_CTA // (2 * cfg.tile_n * head_dim * 2)


def stages_in_kilobytes(head_dim, cfg):  # 227 KB taken as 227 bytes
    return max(0, (227 - 1024 - cfg.tile_m * head_dim * 2) // (2 * cfg.tile_n * head_dim * 2))


def stages_from_the_kernel(head_dim, cfg):
    return ch05.max_stages(head_dim, cfg)


# ----------------------------------------------------------------------------------------------
# 05.2: the producer's step (the simulator's broken producers, and a wrong byte count)
def producer_half_bytes(ring, t):
    stage, lap = t % ring.stages, t // ring.stages
    yield ring.empty[stage].wait(parity=(lap & 1) ^ 1)
    ring.full[stage].arrive_expect_tx(ring.tile_bytes // 2)
    ring.tma_load(stage, t)


# ----------------------------------------------------------------------------------------------
# 05.3: a race that hides (dicts of RingSim settings: hides, shows)
_H = dict(t5.RACE_SCENARIOS[0])
SCENARIO_TWO_CHANGES = (_H, dict(_H, read_ticks=3, latency=4))
SCENARIO_HIDES_SHOWS = (dict(_H, latency=4), dict(_H, latency=4, read_ticks=3))
SCENARIO_STAYS_HIDDEN = (_H, dict(_H, consumers=1))
SCENARIO_TOO_SHORT = (dict(_H, n_tiles=6), dict(_H, n_tiles=6, read_ticks=3))


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
    # through the DSL's loop (the mutation load_with_a_helper)
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


# K's slots are written without waiting for them to be free
load_without_acquire = mutant(t5.load_kv, "pipeline_k.producer_acquire(state_k)", None, 2)


# every K tile goes into the same slot
load_without_advance = mutant(t5.load_kv, "state_k.advance()", None, 2)


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


# ----------------------------------------------------------------------------------------------
# 05.5: the GEMMs of a steady turn
TURN_FORBID = {
    issue_wgmma: "it issues one whole group for you; write the fence, the k-loop and the commit",
    ch05.FlashAttentionHopper.wgmma: "it is the kernel's own issue; write it yourself",
    ch05.FlashAttentionHopper.gemm_turn: "it is the kernel's own turn; write it yourself",
}


@cute.jit
def _issue(tiled_mma, acc, tA, tB, accumulate: cutlass.Constexpr):
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


# "to be safe": S is ready, but so is P V
turn_waits_for_everything = mutant(c5.gemm_turn, "wait_group(1)", "wait_group(0)")


@cute.jit
def turn_pv_first(tiled_mma_qk, tiled_mma_pv, acc_s, acc_o, tSrQ, tSrK, tOrP, tOrVt):
    warpgroup.fence()
    mma_pv = cute.make_mma_atom(tiled_mma_pv.op)
    mma_pv.set(warpgroup.Field.ACCUMULATE, True)
    for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
        cute.gemm(mma_pv, acc_o, tOrP[None, None, k], tOrVt[None, None, k], acc_o)
    warpgroup.commit_group()
    mma_qk = cute.make_mma_atom(tiled_mma_qk.op)
    mma_qk.set(warpgroup.Field.ACCUMULATE, False)
    for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
        cute.gemm(mma_qk, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)
        mma_qk.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    warpgroup.wait_group(1)


# S and P V committed as one group
turn_one_group = mutant(c5.gemm_turn, "commit_group()  # the older group: S", None)


# S's first k-block adds into the old S, as O does
turn_s_accumulates = mutant(c5.gemm_turn, "mma_qk.set(warpgroup.Field.ACCUMULATE, False)",
                            "mma_qk.set(warpgroup.Field.ACCUMULATE, True)")


# no warpgroup.fence() before either GEMM
turn_without_fence = mutant(c5.gemm_turn, "warpgroup.fence()", None, 2)


@cute.jit
def turn_with_a_forbidden_helper(tiled_mma_qk, tiled_mma_pv, acc_s, acc_o, tSrQ, tSrK, tOrP,
                                 tOrVt):
    issue_wgmma(tiled_mma_qk, acc_s, tSrQ, tSrK, False)
    issue_wgmma(tiled_mma_pv, acc_o, tOrP, tOrVt, True)
    warpgroup.wait_group(1)


@cute.jit
def turn_with_own_helper(tiled_mma_qk, tiled_mma_pv, acc_s, acc_o, tSrQ, tSrK, tOrP, tOrVt):
    """Right: a helper of the learner's own is fine."""
    _issue(tiled_mma_qk, acc_s, tSrQ, tSrK, False)
    _issue(tiled_mma_pv, acc_o, tOrP, tOrVt, True)
    warpgroup.wait_group(1)


# ----------------------------------------------------------------------------------------------
# 05.6: the epilogue's hand-over
STORE_FORBID = {
    ch05.FlashAttentionHopper.store_o: "it is the kernel's own epilogue; write it yourself",
}
MEET = "cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=num_threads)"


# the stores are not fenced for the async proxy
store_without_fence = mutant(c5.store_o, "fence_view_async_shared()", None)


# only the warp that issues the TMA fences
store_fence_in_issuing_warp = mutant(c5.store_o, "fence_view_async_shared()", None, also=[
    ("cute.copy(", "cute.arch.fence_view_async_shared(); cute.copy(")])


# the fence comes before the stores it should order
store_fence_before_the_stores = mutant(c5.store_o, "fence_view_async_shared()", None, also=[
    ("cute.autovec_copy(", "cute.arch.fence_view_async_shared(); cute.autovec_copy(")])


store_before_the_barrier = mutant(  # the TMA store issued before the consumers meet
    c5.store_o, MEET, None, also=[("read=True)  # shared memory outlives the reads\n",
                                   f"read=True)\n    {MEET}\n")])


# __syncthreads instead of the consumers' named barrier
store_with_syncthreads = mutant(c5.store_o, MEET, "cute.arch.barrier()")


# every warp issues the TMA store
store_from_every_warp = mutant(c5.store_o, "if tidx // cute.arch.WARP_SIZE == 0:", "if True:")


# shared memory is let go before the TMA has read it
store_without_waiting = mutant(c5.store_o, "cp_async_bulk_wait_group(0, read=True)", None)


# warp 0 of the CTA is the producer's, not a consumer's
store_from_the_producer_warp = mutant(c5.store_o, "tidx // cute.arch.WARP_SIZE == 0",
                                      "cute.arch.warp_idx() == 0")


# ----------------------------------------------------------------------------------------------

MUTATIONS = [
    *planted("05.1", t5.check_stages_that_fit, t5.stages_that_fit, STAGES_FORBID, rows=[
        (stages_one_tile_per_stage, "need"),
        (stages_without_q, "more than 227 KB"),
        (stages_in_kilobytes, "fit: 1 KB barriers"),
        (stages_from_the_kernel, "the kernel's own answer"),
    ]),
    *planted("05.2", t5.check_producer_step, t5.producer_step, rows=[
        (t5.producer_same_parity, "deadlocked"),
        (t5.producer_no_wait, "empty"),
        (t5.producer_plain_arrive, "landed"),
        (producer_half_bytes, "nobody announced"),
    ]),
    *planted("05.3", t5.check_race_scenarios, t5.RACE_SCENARIOS, rows=[
        (SCENARIO_TWO_CHANGES, "change exactly one setting"),
        (SCENARIO_HIDES_SHOWS, "the race shows"),
        (SCENARIO_STAYS_HIDDEN, "the race stays hidden"),
        (SCENARIO_TOO_SHORT, "at least twice"),
    ]),
    *planted("05.4", t5.check_load_kv, t5.load_kv, rows=[
        (load_all_k_then_v, "deadlocked"),
        (load_in_ascending_order, "the consumers read them in the order"),
        (load_without_acquire, "without a producer_acquire"),
        (load_without_advance, "without advancing state_k"),
        (load_barrier_after_advance, "not on the barrier of the slot you acquired"),
        (load_forgets_last_v, "are never loaded"),
        (load_without_guard, "n_tiles = 0"),
        (load_with_a_helper, "state.advance() in the loop body itself", SLOW),
    ]),
    *planted("05.5", c5.check_gemm_turn, c5.gemm_turn, TURN_FORBID, rows=[
        (turn_waits_for_everything, "waits for P V as well"),
        (turn_pv_first, "P V is committed before S"),
        (turn_one_group, "S and P V are in one group"),
        (turn_s_accumulates, "S's first k-block accumulates"),
        (turn_without_fence, "no warpgroup.fence()"),
        (turn_with_a_forbidden_helper, "issues one whole group for you"),
    ]),
    *planted("05.6", c5.check_store_o, c5.store_o, STORE_FORBID, rows=[
        (store_without_fence, "no test can be sure to catch"),
        (store_fence_in_issuing_warp, "every thread that wrote O fences"),
        (store_fence_before_the_stores, "fences before it stores"),
        (store_before_the_barrier, "issues the TMA store before the barrier"),
        (store_with_syncthreads, "__syncthreads"),
        (store_from_every_warp, "warps issue the TMA store"),
        (store_without_waiting, "wait until the TMA has read the tile"),
        (store_from_the_producer_warp, "no thread issues the TMA store"),
    ]),
]
