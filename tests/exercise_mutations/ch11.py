"""Chapter 11's exercises: typical wrong answers, each with the words its checker must say.
Most are the reference with one change (``mutant``); the device-code ones (11.5 the dS step, 11.6
the deterministic turn) are @cute.jit functions, whose source the DSL reads from a real file."""

import cutlass.cute as cute
from cutlass import Int32

from fa4_final.common.atomics import pass_turn, wait_turn
from solutions import ch11_backward as ch11
from solutions import ch11_ds_step as ds
from solutions import ch11_turns as turns
from tests.exercise_mutations import SLOW, mutant, planted

# --- 11.1 delta --------------------------------------------------------------------------------
delta_in_bf16 = mutant(  # summed in the inputs' bfloat16
    ch11.softmax_delta, "(dout.to(acc) * out.to(acc))", "(dout * out)")
delta_not_transposed = mutant(  # left (B, Sq, H)
    ch11.softmax_delta, ".transpose(1, 2)", "")


# --- 11.2 the tile step ------------------------------------------------------------------------
step_scaled = mutant(  # the softmax scale applied per step, not once by the loop
    ch11.tile_step, "dq_part = ds_in @ k_a", "dq_part = scale * ds_in @ k_a",
    also=[("dk_part = ds_in.transpose", "dk_part = scale * ds_in.transpose")])
step_dv_from_ds = mutant(  # dV from dS instead of P
    ch11.tile_step, "dv_part = p_in.transpose", "dv_part = ds_in.transpose")


# --- 11.3 where the inner loop starts ----------------------------------------------------------
first_tile_ignores_offset = mutant(  # top-left causal alignment: seqlen_k - seqlen_q forgotten
    ch11.first_q_tile, "k_start - (seqlen_k - seqlen_q)", "k_start")
first_tile_rounds_up = mutant(  # skips the tile whose later rows already see the key
    ch11.first_q_tile, "max(first_row, 0) // tile_m", "-(-max(first_row, 0) // tile_m)")


# --- 11.4 the dQ adds' bytes -------------------------------------------------------------------
def adds_every_pair(seqlen_q, seqlen_k, head_dim, tile_m, tile_n, causal):
    n_q, n_k = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    return n_q * n_k * tile_m * head_dim * 4


def adds_half_when_causal(seqlen_q, seqlen_k, head_dim, tile_m, tile_n, causal):
    n_q, n_k = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    return n_q * n_k * tile_m * head_dim * 4 // (2 if causal else 1)


def adds_rows_not_tiles(seqlen_q, seqlen_k, head_dim, tile_m, tile_n, causal):
    total = 0
    for k0 in range(0, seqlen_k, tile_n):
        first = ch11.first_q_tile(k0, seqlen_q, seqlen_k, tile_m, causal)
        total += max(seqlen_q - first * tile_m, 0) * head_dim * 4
    return total


adds_in_bf16 = mutant(  # dQ's accumulator counted in bfloat16
    ch11.dq_add_bytes, "head_dim * 4", "head_dim * 2")


# --- 11.5 the dS step in registers -------------------------------------------------------------
ds_natural_exp = mutant(ds.ds_step, "cute.math.exp2(", "cute.math.exp(")  # lse is in log2 units
ds_mask_off_by_one = mutant(  # the diagonal hidden too
    ds.ds_step, "key > query + offset", "key >= query + offset")
ds_mask_queries_on_rows = mutant(  # the mask of S, not of S^T
    ds.ds_step, "key > query + offset", "query > key + offset")
ds_forgets_seqlen_k = mutant(  # keys past seqlen_k stay visible
    ds.ds_step, "hidden = key >= seqlen_k", "hidden = False")
ds_lse_converted_again = mutant(  # lse taken to log2 units twice
    ds.ds_step, "- lse_c,", "- lse_c * 1.4426950408889634,")
ds_delta_outside = mutant(  # P dP - delta, not P (dP - delta)
    ds.ds_step, "s[r, c] * (dp[r, c] - delta_c)", "s[r, c] * dp[r, c] - delta_c")
ds_reads_dp_early = mutant(  # dS computed before waiting for dP
    ds.ds_step, "\n    wait_dp()\n", "\n",
    also=[("(dp[r, c] - delta_c)\n", "(dp[r, c] - delta_c)\n    wait_dp()\n")])
ds_waits_before_p = mutant(  # waits for dP first: P is not handed on before the wait
    ds.ds_step, "\n    wait_dp()\n", "\n",
    also=[("    rows = cute.size", "    wait_dp()\n    rows = cute.size")])
ds_delta_of_the_row = mutant(  # delta indexed by the key (row), not the query (column)
    ds.ds_step, "(dp[r, c] - delta_c)", "(dp[r, c] - delta[0, r])")


ds_exponentials_twice = mutant(  # exp2 again for dS: the exponents kept live, registers spill
    ds.ds_step, "cols = cute.size(s, mode=[1])",
    "cols = cute.size(s, mode=[1]); raw = cute.make_rmem_tensor((rows, cols), Float32)", also=[
        ("s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - lse_c, fastmath=True)",
         "raw[r, c] = s[r, c] * scale_log2 - lse_c; "
         "s[r, c] = cute.math.exp2(raw[r, c], fastmath=True)"),
        ("dp[r, c] = s[r, c] * (dp[r, c] - delta_c)",
         "dp[r, c] = cute.math.exp2(raw[r, c]) * (dp[r, c] - delta_c)")])


# --- 11.6 the deterministic turn ---------------------------------------------------------------
turn_never_passed = mutant(  # the turn is never passed on
    turns.add_in_turn, "cute.arch.fence_acq_rel_gpu()", None, also=[("cute.arch.red(", None)])
turn_passed_after_read = mutant(  # passed when the adds have read, not completed
    turns.add_in_turn, "read=False", "read=True")
turn_not_awaited = mutant(  # adds without waiting for the turn
    turns.add_in_turn, "seen = cute.arch.load", None, 2,
    also=[("while seen != my_turn:", None), ("if lane == 0:  # wait for the turn", None)])
turn_passed_by_every_lane = mutant(  # 32 lanes each pass the turn
    turns.add_in_turn, "if lane == 0:  # the adds complete", "if True:  # the adds complete")


@cute.jit
def turn_adds_in_lane_zero_only(lane, counter, my_turn, add_blocks):
    if lane == 0:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        while seen != my_turn:
            seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        add_blocks()
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.red(counter, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")
    cute.arch.sync_warp()


turn_relaxed = mutant(  # relaxed loads and add: nothing orders the adds
    turns.add_in_turn, 'sem="acquire"', 'sem="relaxed"', 2,
    also=[('sem="release"', 'sem="relaxed"')])


@cute.jit
def turn_with_package_helpers(lane, counter, my_turn, add_blocks):
    if lane == 0:
        wait_turn(counter, my_turn)
    cute.arch.sync_warp()
    add_blocks()
    if lane == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_acq_rel_gpu()
        pass_turn(counter)
    cute.arch.sync_warp()


MUTATIONS = [
    *planted("11.1", ch11.check_softmax_delta, ch11.softmax_delta, rows=[
        (delta_in_bf16, "float32"),
        (delta_not_transposed, "transpose the last two dims"),
    ]),
    *planted("11.2", ch11.check_tile_step, ch11.tile_step, rows=[
        (step_scaled, "softmax scale"),
        (step_dv_from_ds, "dV = P^T dO"),
    ]),
    *planted("11.3", ch11.check_first_q_tile, ch11.first_q_tile, rows=[
        (first_tile_ignores_offset, "sees key"),
        (first_tile_rounds_up, "already"),
    ]),
    *planted("11.4", ch11.check_dq_add_bytes, ch11.dq_add_bytes, ch11.FORBID_DQ_BYTES, rows=[
        (adds_every_pair, "skips"),
        (adds_half_when_causal, "not half"),
        (adds_rows_not_tiles, "whole tile"),
        (adds_in_bf16, "float32"),
    ]),
    *planted("11.5", ds.check_ds_step_rules, ds.ds_step, ds.FORBID, rows=[
        (ds_natural_exp, "exp2, not exp"),
        (ds_mask_off_by_one, "on the diagonal"),
        (ds_mask_queries_on_rows, "keys on the rows"),
        (ds_forgets_seqlen_k, "past seqlen_k"),
        (ds_lse_converted_again, "already in log2 units"),
        (ds_delta_outside, "inside the bracket"),
        (ds_reads_dp_early, "before calling wait_dp"),
        (ds_waits_before_p, "before calling wait_dp"),
        (ds_delta_of_the_row, "delta belongs to a query"),
    ]),
    *planted("11.6", turns.check_turn_rules, turns.add_in_turn, turns.FORBID, rows=[
        (turn_never_passed, "waits forever"),
        (turn_passed_after_read, "read=True"),
        (turn_not_awaited, "never read the counter"),
        (turn_passed_by_every_lane, "by 32"),
        (turn_adds_in_lane_zero_only, "every lane"),
        (turn_relaxed, "sem='acquire'"),
        (turn_with_package_helpers, "the package's"),
    ]),
    *planted("11.5", ds.check_ds_step, ds.ds_step, ds.FORBID, rows=[
        (ds_natural_exp, "exp2, not exp", SLOW),
        (ds_exponentials_twice, "spills", SLOW),
    ]),
    *planted("11.6", turns.check_add_in_turn, turns.add_in_turn, turns.FORBID, rows=[
        (turn_passed_after_read, "read=True", SLOW),
    ]),
]
