"""Chapter 07's exercises: typical wrong answers, each with the words its checker must say.
The device-code ones (07.2, 07.3) are @cute.jit functions, most of them the reference with one
change (``mutant``)."""

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32

from solutions import ch07_rescaling as ch07
from solutions import ch07_sink
from tests.exercise_mutations import SLOW, mutant, planted

# --- 07.2 the decision and the vote -----------------------------------------------------------
RM, STEP = ch07.running_max, ch07.softmax_step
MAX_SAFE = "m_safe = Float32(0.0) if m_used[r] == -Float32.inf else m_used[r]"

running_max_no_vote = mutant(RM, "cute.arch.vote_any_sync(moved)", "moved")  # each lane alone


@cute.jit
def running_max_vote_moves_every_row(row_max, tile_max, tau: cutlass.Constexpr):
    m_used = cute.make_rmem_tensor(cute.size(row_max), Float32)
    moved = cutlass.Boolean(False)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        moved = moved | (cute.arch.fmax(row_max[r], tile_max[r]) - row_max[r] > Float32(tau))
    vote = cute.arch.vote_any_sync(moved)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        m_new = cute.arch.fmax(row_max[r], tile_max[r])
        m_used[r] = m_new if vote else row_max[r]
    return m_used, vote


running_max_exactly_tau_moves = mutant(RM, "> Float32(tau)", ">= Float32(tau)")  # tau moves


running_max_votes_last_row = mutant(RM, "moved = moved | grew", "moved = grew")  # last row


running_max_adds_growth = mutant(  # the growth added: -inf + inf at a row's first key
    RM, "m_used[r] = m_new if grew else row_max[r]",
    "m_used[r] = row_max[r] + ((m_new - row_max[r]) if grew else Float32(0.0))")


running_max_in_place = mutant(  # row_max overwritten: the caller's alpha reads it
    RM, "m_used[r] = m_new if grew else row_max[r]", "row_max[r] = m_new if grew else row_max[r]",
    also=[("return m_used,", "return row_max,")])


running_max_votes_in_a_branch = mutant(  # only lanes whose rows moved reach the vote
    RM, "return m_used, cute.arch.vote_any_sync(moved)",
    "vote = cutlass.Boolean(False)\n    if moved:\n        vote = cute.arch.vote_any_sync(moved)\n"
    "    return m_used, vote")


# --- 07.3 the step ----------------------------------------------------------------------------
step_no_alpha_on_l = mutant(STEP, "row_sum[r] * alpha[r] + total", "row_sum[r] + total")


step_always_multiplies = mutant(STEP, "if multiply_o:", "if True:")  # the vote ignored


step_forgets_row_max = mutant(STEP, "row_max[r] = m_used[r]", None)  # state not kept


step_exps_against_the_true_max = mutant(  # p against the true max, not the one kept
    STEP, MAX_SAFE, "m_true = cute.arch.fmax(row_max[r], tile_max[r]); "
    "m_safe = Float32(0.0) if m_true == -Float32.inf else m_true")


step_lanes_decide_alone = mutant(  # O's multiply by this lane's rows, not the warp's vote
    STEP, "if multiply_o:", "if mine:", also=[
        ("alpha = cute.make_rmem_tensor(rows, Float32)",
         "alpha = cute.make_rmem_tensor(rows, Float32); mine = cutlass.Boolean(False)"),
        (MAX_SAFE, "mine = mine | (m_used[r] != row_max[r]); " + MAX_SAFE)])


# right values (when the vote says no, no row moved), but the exponentials now read the vote's
# predicate: they wait for the warp
step_max_picked_by_the_vote = mutant(
    STEP, MAX_SAFE, "m_pick = m_used[r] if multiply_o else row_max[r]; "
    "m_safe = Float32(0.0) if m_pick == -Float32.inf else m_pick",
    also=[("row_max[r] = m_used[r]", "row_max[r] = m_pick")])


# --- 07.1 the end of the row, 07.4 the adversarial input --------------------------------------
def finalize_log2_lse(o_acc, row_sum, m_used):
    out = o_acc / row_sum.masked_fill(row_sum == 0, 1.0)[..., None]
    return out, m_used + torch.log2(row_sum)


def finalize_divides_by_zero(o_acc, row_sum, m_used):
    return o_acc / row_sum[..., None], (m_used + torch.log2(row_sum)) * ch07.LN_2


def finalize_natural_log_of_sum(o_acc, row_sum, m_used):
    out = o_acc / row_sum.masked_fill(row_sum == 0, 1.0)[..., None]
    return out, m_used * ch07.LN_2 + torch.log2(row_sum)


def adversarial_plain_random(seqlen_k, tile_n=128, tau=8.0, kv_order="reverse"):
    return tuple(torch.randn(1, n, 1, 32) for n in (16, seqlen_k, seqlen_k))


def _leaders(seqlen_k, tile_n, step_log2, order):
    dim = 64
    q, k, v = torch.randn(1, 16, 1, dim), torch.randn(1, seqlen_k, 1, dim), torch.randn(
        1, seqlen_k, 1, dim)
    q[..., 0] = step_log2 * ch07.LN_2 * dim**0.5
    k[..., 0] = 0.0
    starts = list(range(0, seqlen_k, tile_n))
    if order == "reverse":
        starts = starts[::-1]
    for i, start in enumerate(starts):
        k[0, start, 0, :] = 0.0
        k[0, start, 0, 0] = i + 3
    return q, k, v


def adversarial_forward_order(seqlen_k, tile_n=128, tau=8.0, kv_order="reverse"):
    return _leaders(seqlen_k, tile_n, tau + 1, "forward")


def adversarial_steps_of_tau(seqlen_k, tile_n=128, tau=8.0, kv_order="reverse"):
    return _leaders(seqlen_k, tile_n, tau, kv_order)


# --- 07.5 the sink in the last step ------------------------------------------------------------
SINK = ch07_sink.finalize_with_sink

sink_in_log2_units = mutant(SINK, "sink_log2 = sink * Float32(LOG2_E)", "sink_log2 = sink")

sink_without_the_max = mutant(  # 2^(sink log2 e): l carries 2^-m, the sink does not
    SINK, "exp2(sink_log2 - m, fastmath=True)", "exp2(sink_log2, fastmath=True)")

sink_nan_on_empty_row = mutant(  # m = -inf kept: 2^inf and -inf + inf
    SINK, "m = sink_log2 if row_max[r] == -Float32.inf else row_max[r]", "m = row_max[r]")

sink_missing_from_lse = mutant(
    SINK, "cute.math.log2(total, fastmath=True)", "cute.math.log2(row_sum[r], fastmath=True)")

sink_empty_row_minus_inf = mutant(  # exercise 07.1's rule for an empty row, kept here
    SINK, "* Float32(LN_2)", "* Float32(LN_2)\n        if row_sum[r] == Float32(0.0):\n"
    "            lse[r] = -Float32.inf")

sink_divides = mutant(SINK, "cute.arch.rcp_approx(total)", "Float32(1.0) / total")


MUTATIONS = [
    *planted("07.2", ch07.check_running_max, ch07.running_max, ch07.FORBID_RUNNING_MAX, rows=[
        (running_max_no_vote, "not the same in every lane"),
        (running_max_vote_moves_every_row, "the vote decides only O's multiply"),
        (running_max_exactly_tau_moves, "a growth of exactly tau keeps it"),
        (running_max_votes_last_row, "moved its max but the warp's vote says skip"),
        (running_max_adds_growth, "got a NaN max"),
        (running_max_in_place, "changed row_max or tile_max in place"),
        (running_max_votes_in_a_branch, "reached vote_any_sync and lanes"),
    ]),
    *planted("07.3", ch07.check_softmax_step, ch07.softmax_step, ch07.FORBID_STEP, rows=[
        (step_no_alpha_on_l, "its row sum was not multiplied by alpha"),
        (step_always_multiplies, "yet O was multiplied"),
        (step_forgets_row_max, "row_max still holds"),
        (step_exps_against_the_true_max, "p is not 2^(s - m) with the max it keeps"),
        (step_lanes_decide_alone, "O's multiply diverges within the warp"),
        (step_max_picked_by_the_vote, "the exponentials wait for the warp to vote", SLOW),
    ]),
    *planted("07.1", ch07.check_finalize, ch07.finalize, ch07.FORBID_FINALIZE, rows=[
        (finalize_log2_lse, "lse is off by"),
        (finalize_divides_by_zero, "NaN in the result"),
        (finalize_natural_log_of_sum, "lse is off by"),
    ]),
    *planted("07.4", ch07.check_adversarial, ch07.adversarial_qkv, ch07.FORBID_ADVERSARIAL, rows=[
        (adversarial_plain_random, "must grow by more than tau"),
        (adversarial_forward_order, "Remember the kernel order"),
        (adversarial_steps_of_tau, "must grow by more than tau"),
    ]),
    *planted("07.5", ch07_sink.check_finalize_with_sink, ch07_sink.finalize_with_sink,
             ch07_sink.FORBID_SINK, rows=[
                 (sink_in_log2_units, "not 2^(sink - m)"),
                 (sink_without_the_max, "the same 2^-m"),
                 (sink_nan_on_empty_row, "a fully masked row gave NaN"),
                 (sink_missing_from_lse, "lse does not"),
                 (sink_empty_row_minus_inf, "lse = the sink"),
                 (sink_divides, "rcp_approx", SLOW),
             ]),
]
