"""Chapter 12's exercises: typical wrong answers, each with the words its checker must say.
The device-code ones (12.2 the register split, 12.3 the writer's side of the dS exchange) are
@cute.jit functions, most of them the reference with one change (``mutant``)."""

import cutlass
import cutlass.cute as cute

from fa4_final.blackwell import peer
from fa4_final.blackwell.tmem import Region, TmemPlan
from solutions import ch12_blackwell_bwd as c12
from tests.exercise_mutations import SLOW, mutant, planted


# --- 12.1 dQ with columns of its own -----------------------------------------------------------
def plan_dq_still_inside_dp(head_dim, tile_m=128):
    return TmemPlan((
        Region("S", 0, tile_m, "S^T"), Region("dP", tile_m, tile_m, "dP^T"),
        Region("dV", 2 * tile_m, head_dim, "dV"), Region("dK", 2 * tile_m + head_dim, head_dim,
                                                        "dK"),
        Region("dQ", tile_m, head_dim, "dQ", alias_of="dP"),
        Region("P", tile_m // 2, tile_m // 2, "P^T", alias_of="S"))).check()


def plan_only_for_d64(head_dim, tile_m=128):
    return TmemPlan((
        Region("S", 0, tile_m, "S^T"), Region("dP", tile_m, tile_m, "dP^T"),
        Region("dV", 256, 64, "dV"), Region("dK", 320, 64, "dK"), Region("dQ", 384, 64, "dQ"),
        Region("P", tile_m // 2, tile_m // 2, "P^T", alias_of="S"))).check()


def plan_p_with_own_columns(head_dim, tile_m=128):
    return TmemPlan((
        Region("S", 0, tile_m, "S^T"), Region("dP", tile_m, tile_m, "dP^T"),
        Region("dV", 2 * tile_m, head_dim, "dV"), Region("dK", 2 * tile_m + head_dim, head_dim,
                                                        "dK"),
        Region("dQ", 2 * tile_m + 2 * head_dim, head_dim, "dQ"),
        Region("P", 2 * tile_m + 3 * head_dim, tile_m // 2, "P^T"))).check()


# --- 12.2 the register split -------------------------------------------------------------------
@cute.jit
def split_mma_warp_raised(warp):
    if warp == 12:
        cute.arch.setmaxregister_increase(160)
    elif warp >= 12:
        cute.arch.setmaxregister_decrease(48)
    elif warp >= 8:
        cute.arch.setmaxregister_decrease(80)
    else:
        cute.arch.setmaxregister_increase(176)


SPLIT, SEND = c12.split_registers, c12.send_ds
FENCE = 'cute.arch.fence_proxy("async.shared", space="cluster")'

split_over_512 = mutant(SPLIT, "decrease(112)", "decrease(120)")  # sums past the register file


split_increase_below_launch = mutant(  # an increase to less than the launch's 128
    SPLIT, "setmaxregister_decrease(112)", "setmaxregister_increase(112)")


split_forgets_warpgroup3 = mutant(  # warpgroup 3 keeps the launch's budget
    SPLIT, "cute.arch.setmaxregister_decrease(112)", "pass")


split_mma_starved = mutant(  # the MMA warpgroup lowered below what it needs
    SPLIT, "decrease(112)", "decrease(96)", also=[("increase(176)", "increase(184)")])


split_dq_starved = mutant(  # the dQ warpgroup lowered below what it needs
    SPLIT, "decrease(112)", "decrease(128)", also=[("decrease(48)", "decrease(32)")])


# --- 12.3 the writer's side of the dS exchange -------------------------------------------------
send_unfenced = mutant(SEND, FENCE, None)  # the peer's async read not ordered first


send_fenced_for_own_cta = mutant(SEND, FENCE, "cute.arch.fence_view_async_shared()")  # CTA


send_every_thread_arms = mutant(  # 128 arrivals of 128 bytes each
    SEND, "if tidx == 0:", "if True:", also=[("(dsx, nbytes, peer_cta", "(dsx, 128, peer_cta")])


send_half_the_bytes = mutant(  # half the units sent: the barrier waits forever
    SEND, "cute.size(words) // 4)", "cute.size(words) // 8)")


send_arms_own_barrier = mutant(  # expect-tx on this CTA's barrier, not the peer's
    SEND, "(dsx, nbytes, peer_cta_rank_in_cluster=peer)", "(dsx, nbytes)")


send_never_arms = mutant(  # no expect-tx at all
    SEND, "if tidx == 0:", None, also=[("mbarrier_arrive_and_expect_tx", None)])


send_words_out_of_order = mutant(  # unit j holds words j, j + 8, ... not 4j .. 4j + 3
    SEND, "words[4 * j], words[4 * j + 1], words[4 * j + 2],",
    "words[j], words[j + 8], words[j + 16],",
    also=[("words[4 * j + 3])", "words[j + 24])")])


@cute.jit
def send_with_package_steps(words, unit_addr, dsx, peer_rank, tidx, nbytes):
    peer.fence_before_peer_store()
    if tidx == 0:
        peer.arm_peer(dsx, nbytes, peer_rank)
    for j in cutlass.range_constexpr(cute.size(words) // 4):
        peer.store_peer_v4(unit_addr(j), (words[4 * j], words[4 * j + 1], words[4 * j + 2],
                                          words[4 * j + 3]), dsx, peer_rank)


MUTATIONS = [
    *planted("12.1", c12.check_own_dq_plan, c12.own_dq_plan, rows=[
        (plan_dq_still_inside_dp, "still lives inside"),
        (plan_only_for_d64, "640"),
        (plan_p_with_own_columns, "inside S^T"),
    ]),
    *planted("12.2", c12.check_split_rules, c12.split_registers, rows=[
        (split_mma_warp_raised, "sub-partition 0"),
        (split_mma_warp_raised, "same setmaxnreg"),
        (split_over_512, "520"),
        (split_increase_below_launch, "setmaxnreg.inc to 112"),
        (split_forgets_warpgroup3, "warp 12 runs no"),
    ]),
    *planted("12.2", c12.check_split_registers, c12.split_registers, rows=[
        (split_mma_starved, "spills", SLOW),
        (split_dq_starved, "Register allocation failed", SLOW),
    ]),
    *planted("12.3", c12.check_send_rules, c12.send_ds, c12.FORBID_SEND, rows=[
        (send_unfenced, "no proxy fence"),
        (send_fenced_for_own_cta, "space 'cluster'"),
        (send_every_thread_arms, "128 threads armed"),
        (send_every_thread_arms, "pair simulator"),
        (send_half_the_bytes, "Deadlock"),
        (send_arms_own_barrier, "own CTA's barrier"),
        (send_never_arms, "no thread arms"),
        (send_words_out_of_order, "words 4j"),
        (send_with_package_steps, "the package's"),
    ]),
    *planted("12.3", c12.check_send_ds, c12.send_ds, c12.FORBID_SEND, rows=[
        (send_unfenced, "no proxy fence", SLOW),
    ]),
]
