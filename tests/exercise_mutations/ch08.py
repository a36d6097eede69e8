"""Chapter 08's typical wrong answers: the ping-pong turn (08.1), the persistent tile loop
(08.2), the shared-memory budget (08.3). Most device-code ones are the reference with one change
(``mutant``)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from fa4_final.common.schedule import zigzag_tile
from solutions import ch08_teaching as t08
from tests.exercise_mutations import mutant, planted

TURN0 = t08.TURN_WG0


TURN_FN, LOOP = t08.pingpong_turn, t08.tile_loop

turn_always_waits = mutant(  # warpgroup 0's first turn waits for nobody
    TURN_FN, "if (wg > 0) | (not first_of_cta):", "if True:")


turn_counts_one_warpgroup = mutant(  # the barrier counts one warpgroup, not two
    TURN_FN, "2 * THREADS_PER_WARPGROUP", "THREADS_PER_WARPGROUP", 2)


@cute.jit
def turn_hands_on_first(wg: Int32, num_wgs: cutlass.Constexpr[int], first_of_cta, last_of_cta,
                        issue_gemms):
    if (wg > 0) | (not first_of_cta):
        cute.arch.barrier(barrier_id=TURN0 + wg, number_of_threads=256)
    if (wg < num_wgs - 1) | (not last_of_cta):
        cute.arch.barrier_arrive(barrier_id=TURN0 + (wg + 1) % num_wgs, number_of_threads=256)
    issue_gemms()


turn_always_hands_on = mutant(  # the very last turn hands on to nobody
    TURN_FN, "if (wg < num_wgs - 1) | (not last_of_cta):", "if True:")


turn_on_barrier_wg = mutant(  # barrier 0 is __syncthreads
    TURN_FN, "int(NamedBarrier.TURN_WG0) + ", "", 2)


tiles_round_robin = mutant(  # round robin: no zigzag
    LOOP, "zigzag_tile(r, cta, grid)", "r * grid + cta",
    also=[("zigzag_tile(r + 1, cta, grid)", "(r + 1) * grid + cta")])


@cute.jit
def tiles_last_round_is_last(num_tiles: Int32, cta: Int32, grid: Int32, state_q, state_k,
                             state_v, visit):
    n = (num_tiles + grid - 1) // grid
    for r in cutlass.range(n, unroll=1):
        tile = r * grid + cta + (r % 2) * (grid - 1 - 2 * cta)
        if tile < num_tiles:
            state_q, state_k, state_v = visit(tile, r, r == n - 1, state_q, state_k, state_v)


@cute.jit
def tiles_no_bound(num_tiles: Int32, cta: Int32, grid: Int32, state_q, state_k, state_v,
                   visit):
    n = (num_tiles + grid - 1) // grid
    for r in cutlass.range(n, unroll=1):
        tile = r * grid + cta + (r % 2) * (grid - 1 - 2 * cta)
        state_q, state_k, state_v = visit(tile, r, r == n - 1, state_q, state_k, state_v)


@cute.jit
def tiles_states_not_carried(num_tiles: Int32, cta: Int32, grid: Int32, state_q, state_k,
                             state_v, visit):
    for r in cutlass.range((num_tiles + grid - 1) // grid, unroll=1):
        tile = r * grid + cta + (r % 2) * (grid - 1 - 2 * cta)
        if tile < num_tiles:
            after = (r + 1) * grid + cta + ((r + 1) % 2) * (grid - 1 - 2 * cta)
            visit(tile, r, after >= num_tiles, state_q, state_k, state_v)


@cute.jit
def tiles_by_the_helper(num_tiles: Int32, cta: Int32, grid: Int32, state_q, state_k, state_v,
                        visit):
    for r in cutlass.range((num_tiles + grid - 1) // grid, unroll=1):
        tile = zigzag_tile(r, cta, grid)
        if tile < num_tiles:
            last = zigzag_tile(r + 1, cta, grid) >= num_tiles
            state_q, state_k, state_v = visit(tile, r, last, state_q, state_k, state_v)


def _smem_no_barriers(cfg, head_dim, elem_bytes=2):
    def align(n):
        return -(-n // 1024) * 1024

    q = cfg.tile_m * head_dim * elem_bytes
    kv = cfg.tile_n * head_dim * elem_bytes
    return (align(q) + align(cfg.stages_k * kv) + align(cfg.stages_v * kv)
            + align(q))


def _smem_no_o(cfg, head_dim, elem_bytes=2):
    def align(n):
        return -(-n // 1024) * 1024

    barriers = 8 * 2 * (1 + cfg.stages_k + cfg.stages_v)
    q = cfg.tile_m * head_dim * elem_bytes
    kv = cfg.tile_n * head_dim * elem_bytes
    return align(barriers) + align(q) + align(cfg.stages_k * kv) + align(cfg.stages_v * kv)


def _smem_by_the_config(cfg, head_dim, elem_bytes=2):
    return cfg.smem_bytes(head_dim, elem_bytes)


MUTATIONS = [
    *planted("08.1", t08.check_turn, t08.pingpong_turn, rows=[
        (turn_always_waits, "Warpgroup 0's very first turn"),
        (turn_counts_one_warpgroup, "number_of_threads=128"),
        (turn_hands_on_first, "unordered issue"),
        (turn_always_hands_on, "left pending"),
        (turn_on_barrier_wg, "__syncthreads"),
    ]),
    *planted("08.2", t08.check_tile_loop, t08.tile_loop, t08.TILE_LOOP_FORBID, rows=[
        (tiles_round_robin, "reverse the order of every other round"),
        (tiles_last_round_is_last, "it is the CTA's last"),
        (tiles_no_bound, "test tile < num_tiles"),
        (tiles_states_not_carried, "rebind them in the loop body"),
        (tiles_by_the_helper, "zigzag_tile"),
    ]),
    *planted("08.3", t08.check_smem_bytes, t08.smem_bytes_reference, t08.SMEM_FORBID, rows=[
        (_smem_no_barriers, "1 KB"),
        (_smem_no_o, "O's own buffer"),
        (_smem_by_the_config, "smem_bytes"),
    ]),
]

