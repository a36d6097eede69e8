"""Chapter 08's typical wrong answers: the ping-pong turn (08.1), the persistent tile loop
(08.2), the shared-memory budget (08.3), a tile for a large head dim (08.4). Most are the
reference with one change (``mutant``)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from fa4_final.common.schedule import zigzag_tile
from fa4_final.hopper.config import hopper_fwd_default
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


SMEM, FIT = t08.smem_bytes_reference, t08.fit_tile_reference

smem_no_barriers = mutant(  # the mbarriers' block left out
    SMEM, "align(barriers) + ", "")

smem_no_o = mutant(  # O's own buffer forgotten
    SMEM, " + align(o)", "")

smem_v_at_d = mutant(  # V's tiles as wide as K's
    SMEM, "v = cfg.tile_n * dv * elem_bytes", "v = cfg.tile_n * head_dim * elem_bytes")

smem_o_always = mutant(  # O counted though it is written over Q
    SMEM, "if cfg.separate_o else 0", "")

smem_tile_n_128 = mutant(  # "a stage is always 128 keys"
    SMEM, "cfg.tile_n * ", "128 * ", 2)


def _smem_by_the_config(cfg, head_dim, elem_bytes=2, head_dim_v=None):
    return cfg.smem_bytes(head_dim, elem_bytes, head_dim_v)


OVER_Q = "(True, False) if over_q_allowed(head_dim, dv) else (True,)"
BETTER = "fit_rank(cfg) > fit_rank(best)"

fit_never_over_q = mutant(FIT, OVER_Q, "(True,)")  # O always keeps its own buffer

fit_over_q_anywhere = mutant(FIT, OVER_Q, "(True, False)")  # O over Q where dv > D

fit_over_q_first = mutant(  # at equal keys, O over Q preferred
    FIT, BETTER, "(keys_in_flight(cfg), cfg.tile_n, not cfg.separate_o) > "
                 "(keys_in_flight(best), best.tile_n, not best.separate_o)")

fit_smaller_tile_first = mutant(  # at equal keys, the smaller tile preferred
    FIT, BETTER, "(keys_in_flight(cfg), -cfg.tile_n, cfg.separate_o) > "
                 "(keys_in_flight(best), -best.tile_n, best.separate_o)")

fit_only_128_and_64 = mutant(FIT, "in FWD_TILE_NS:", "in (128, 64):")  # the defaults' tiles

fit_tile_n_72 = mutant(FIT, "in FWD_TILE_NS:", "in (128, 72):")  # not a multiple of 16

fit_whole_sm = mutant(  # the SM's 256 KB taken for the CTA's 227
    FIT, "<= SM90_SMEM_BYTES", "<= 256 * 1024")


def fit_by_the_package(d, dv):
    return hopper_fwd_default(d, head_dim_v=dv)


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
    *planted("08.3", t08.check_smem_bytes, SMEM, t08.SMEM_FORBID, rows=[
        (smem_no_barriers, "1 KB"),
        (smem_no_o, "O's own buffer left out"),
        (smem_v_at_d, "V's tiles counted at D instead of dv"),
        (smem_o_always, "O counted though it lies over Q"),
        (smem_tile_n_128, "tile_n taken as 128"),
        (_smem_by_the_config, "smem_bytes"),
    ]),
    *planted("08.4", t08.check_fit_tile, FIT, t08.FIT_FORBID, rows=[
        (fit_never_over_q, "O written over Q"),
        (fit_over_q_anywhere, "dv > D is not allowed"),
        (fit_over_q_first, "O's own buffer fits with the same keys"),
        (fit_smaller_tile_first, "take the larger tile_n"),
        (fit_only_128_and_64, "80 keys a stage"),
        (fit_tile_n_72, "not a multiple of 16"),
        (fit_whole_sm, "over the budget of 227 KB"),
        (fit_by_the_package, "the package's own choice"),
    ]),
]
