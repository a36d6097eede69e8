"""Chapter 10's typical wrong answers: the shared-memory cycles of a step (10.1), the schedule's
wave efficiency (10.2), the pair primer's MMA warp (10.3) and barrier set-up (10.4) in device
code, these stated as the reference with one change (``mutant``)."""

import math

from solutions import ch09_primer as primer
from solutions import ch10_teaching as T
from tests.exercise_mutations import mutant, planted


# --- 10.1 ---------------------------------------------------------------------------------------
def smem_kv_once(d, two_cta):
    tile = 128 * d * 2
    return (2 * tile + 2 * tile / (2 if two_cta else 1)) / 128


def smem_halves_a(d, two_cta):
    tile = 128 * d * 2
    return (2 * tile / (2 if two_cta else 1) + 4 * tile) / 128


def smem_in_bytes(d, two_cta):
    tile = 128 * d * 2
    return 2 * tile + 4 * tile / (2 if two_cta else 1)


# --- 10.2 ---------------------------------------------------------------------------------------
def efficiency_pairs_on_every_sm(seqlen, heads, batch, two_cta):
    tiles = seqlen // (512 if two_cta else 256) * heads * batch
    return tiles / (148 * math.ceil(tiles / 148))


def efficiency_tiles_of_128(seqlen, heads, batch, two_cta):
    units = 74 if two_cta else 148
    tiles = seqlen // 128 * heads * batch
    return tiles / (units * math.ceil(tiles / units))


def efficiency_no_rounds(seqlen, heads, batch, two_cta):
    units = 74 if two_cta else 148
    return seqlen // (512 if two_cta else 256) * heads * batch / units


# --- 10.3 ---------------------------------------------------------------------------------------
PAIR, INIT = primer.pair_mma, primer.init_pair_barriers

pair_both_issue = mutant(PAIR, "if cta_rank == LEADER:", "if True:")  # both CTAs issue
pair_follower_issues = mutant(PAIR, "cta_rank == LEADER", "cta_rank == 1")  # the wrong CTA
pair_commit_no_mask = mutant(PAIR, "PAIR_MASK", "None", 2)  # commits to the leader alone
pair_commit_group_one = mutant(PAIR, ", tcgen05.CtaGroup.TWO)", ")", 2)  # cta_group::1 commits
pair_no_wait_for_p = mutant(PAIR, "mbarrier_wait(mbar_p, 0)", None)  # P V before P is written
pair_no_wait_for_loads = mutant(PAIR, "mbarrier_wait(mbar_load, 0)", None)  # S before Q, K land
pair_whole_warp_commits = mutant(  # 32 lanes commit, 32 arrivals
    PAIR, "with cute.arch.elect_one():", "if True:", 2)


# --- 10.4 ---------------------------------------------------------------------------------------
init_p_counts_one_cta = mutant(  # the follower's softmax threads not counted
    INIT, "mbarrier_init(mbar_p, PAIR * TILE)", "mbarrier_init(mbar_p, TILE)")
init_s_counts_two_commits = mutant(  # a multicast commit counted as two
    INIT, "mbarrier_init(mbar_s, 1)", "mbarrier_init(mbar_s, 2)",
    also=[("mbarrier_init(mbar_o, 1)", "mbarrier_init(mbar_o, 2)")])
init_load_counts_both_ctas = mutant(  # two arrivals where the leader's expect_tx is the one
    INIT, "mbarrier_init(mbar_load, 1)", "mbarrier_init(mbar_load, 2)")
init_with_cta_barrier = mutant(  # the CTA's barrier where the pair's is needed
    INIT, "cluster_arrive_relaxed()", None, also=[("cluster_wait()", "barrier()")])
init_cluster_barrier_in_one_warp = mutant(  # only the MMA warp meets the cluster barrier
    INIT, "cluster_arrive_relaxed()", None, also=[
        ("cluster_wait()", None),
        ("mbarrier_init_fence()", "mbarrier_init_fence(); cute.arch.cluster_arrive_relaxed(); "
         "cute.arch.cluster_wait()")])
init_without_fence = mutant(INIT, "mbarrier_init_fence()", None)  # inits not made visible
init_fence_after_arrive = mutant(  # fenced after the arrive that should publish the inits
    INIT, "mbarrier_init_fence()", None, also=[
        ("cluster_arrive_relaxed()",
         "cluster_arrive_relaxed()\n    if warp == MMA_WARP: cute.arch.mbarrier_init_fence()")])


MUTATIONS = [
    *planted("10.1", T.check_smem_cycles_per_step, T.smem_cycles_per_step, rows=[
        (smem_kv_once, "read twice per step"),
        (smem_halves_a, "halves the B operands"),
        (smem_in_bytes, "that is bytes"),
    ]),
    *planted("10.2", T.check_schedule_efficiency, T.schedule_efficiency, rows=[
        (efficiency_pairs_on_every_sm, "74 pairs"),
        (efficiency_tiles_of_128, "two Q stages"),
        (efficiency_no_rounds, "round up"),
    ]),
    *planted("10.3", T.check_pair_mma, primer.pair_mma, rows=[
        (pair_both_issue, "CTA 1 issued MMAs too"),
        (pair_follower_issues, "CTA 1 issued MMAs too"),
        (pair_commit_no_mask, "multicast the commit to both CTAs"),
        (pair_commit_group_one, "cta_group=tcgen05.CtaGroup.TWO"),
        (pair_no_wait_for_p, "wait on mbar_p"),
        (pair_no_wait_for_loads, "wait on mbar_load"),
        (pair_whole_warp_commits, "elect_one"),
    ]),
    *planted("10.4", T.check_init_pair_barriers, primer.init_pair_barriers, rows=[
        (init_p_counts_one_cta, "128 that the follower's threads make remotely"),
        (init_s_counts_two_commits, "arrives once on each CTA's barrier"),
        (init_load_counts_both_ctas, "the TMA bytes complete it"),
        (init_with_cta_barrier, "pass the cluster barrier"),
        (init_cluster_barrier_in_one_warp, "Every thread of both CTAs arrives and waits"),
        (init_without_fence, "mbarrier_init_fence()"),
        (init_fence_after_arrive, "mbarrier_init_fence()"),
    ]),
]
