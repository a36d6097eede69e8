"""Chapter 10's typical wrong answers: the shared-memory cycles of a step (10.1), the schedule's
wave efficiency (10.2), the pair primer's MMA warp (10.3) and barrier set-up (10.4) in device
code. The wrong device code lives here, in a file, as the DSL needs."""

import math

import cutlass.cute as cute
from cutlass.cute.nvgpu import tcgen05

from solutions import ch09_primer as primer
from solutions import ch10_teaching as T
from tests.exercise_mutations import Mutation

MMA_WARP = primer.MMA_WARP


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
@cute.jit
def pair_both_issue(cta_rank, issue_s, issue_pv, mbar_load, mbar_s, mbar_p, mbar_o):
    cute.arch.mbarrier_wait(mbar_load, 0)
    issue_s()
    with cute.arch.elect_one():
        tcgen05.commit(mbar_s, 0b11, tcgen05.CtaGroup.TWO)
    cute.arch.mbarrier_wait(mbar_p, 0)
    issue_pv()
    with cute.arch.elect_one():
        tcgen05.commit(mbar_o, 0b11, tcgen05.CtaGroup.TWO)


@cute.jit
def pair_follower_issues(cta_rank, issue_s, issue_pv, mbar_load, mbar_s, mbar_p, mbar_o):
    if cta_rank == 1:
        cute.arch.mbarrier_wait(mbar_load, 0)
        issue_s()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_s, 0b11, tcgen05.CtaGroup.TWO)
        cute.arch.mbarrier_wait(mbar_p, 0)
        issue_pv()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_o, 0b11, tcgen05.CtaGroup.TWO)


@cute.jit
def pair_commit_no_mask(cta_rank, issue_s, issue_pv, mbar_load, mbar_s, mbar_p, mbar_o):
    if cta_rank == 0:
        cute.arch.mbarrier_wait(mbar_load, 0)
        issue_s()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_s, None, tcgen05.CtaGroup.TWO)
        cute.arch.mbarrier_wait(mbar_p, 0)
        issue_pv()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_o, None, tcgen05.CtaGroup.TWO)


@cute.jit
def pair_commit_group_one(cta_rank, issue_s, issue_pv, mbar_load, mbar_s, mbar_p, mbar_o):
    if cta_rank == 0:
        cute.arch.mbarrier_wait(mbar_load, 0)
        issue_s()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_s, 0b11)
        cute.arch.mbarrier_wait(mbar_p, 0)
        issue_pv()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_o, 0b11)


@cute.jit
def pair_no_wait_for_p(cta_rank, issue_s, issue_pv, mbar_load, mbar_s, mbar_p, mbar_o):
    if cta_rank == 0:
        cute.arch.mbarrier_wait(mbar_load, 0)
        issue_s()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_s, 0b11, tcgen05.CtaGroup.TWO)
        issue_pv()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_o, 0b11, tcgen05.CtaGroup.TWO)


@cute.jit
def pair_no_wait_for_loads(cta_rank, issue_s, issue_pv, mbar_load, mbar_s, mbar_p, mbar_o):
    if cta_rank == 0:
        issue_s()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_s, 0b11, tcgen05.CtaGroup.TWO)
        cute.arch.mbarrier_wait(mbar_p, 0)
        issue_pv()
        with cute.arch.elect_one():
            tcgen05.commit(mbar_o, 0b11, tcgen05.CtaGroup.TWO)


@cute.jit
def pair_whole_warp_commits(cta_rank, issue_s, issue_pv, mbar_load, mbar_s, mbar_p, mbar_o):
    if cta_rank == 0:
        cute.arch.mbarrier_wait(mbar_load, 0)
        issue_s()
        tcgen05.commit(mbar_s, 0b11, tcgen05.CtaGroup.TWO)
        cute.arch.mbarrier_wait(mbar_p, 0)
        issue_pv()
        tcgen05.commit(mbar_o, 0b11, tcgen05.CtaGroup.TWO)


# --- 10.4 ---------------------------------------------------------------------------------------
@cute.jit
def init_p_counts_one_cta(mbar_load, mbar_s, mbar_p, mbar_o, warp):
    if warp == MMA_WARP:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar_load, 1)
            cute.arch.mbarrier_init(mbar_s, 1)
            cute.arch.mbarrier_init(mbar_p, 128)
            cute.arch.mbarrier_init(mbar_o, 1)
        cute.arch.mbarrier_init_fence()
    cute.arch.cluster_arrive_relaxed()
    cute.arch.cluster_wait()


@cute.jit
def init_s_counts_two_commits(mbar_load, mbar_s, mbar_p, mbar_o, warp):
    if warp == MMA_WARP:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar_load, 1)
            cute.arch.mbarrier_init(mbar_s, 2)
            cute.arch.mbarrier_init(mbar_p, 256)
            cute.arch.mbarrier_init(mbar_o, 2)
        cute.arch.mbarrier_init_fence()
    cute.arch.cluster_arrive_relaxed()
    cute.arch.cluster_wait()


@cute.jit
def init_load_counts_both_ctas(mbar_load, mbar_s, mbar_p, mbar_o, warp):
    if warp == MMA_WARP:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar_load, 2)
            cute.arch.mbarrier_init(mbar_s, 1)
            cute.arch.mbarrier_init(mbar_p, 256)
            cute.arch.mbarrier_init(mbar_o, 1)
        cute.arch.mbarrier_init_fence()
    cute.arch.cluster_arrive_relaxed()
    cute.arch.cluster_wait()


@cute.jit
def init_with_cta_barrier(mbar_load, mbar_s, mbar_p, mbar_o, warp):
    if warp == MMA_WARP:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar_load, 1)
            cute.arch.mbarrier_init(mbar_s, 1)
            cute.arch.mbarrier_init(mbar_p, 256)
            cute.arch.mbarrier_init(mbar_o, 1)
        cute.arch.mbarrier_init_fence()
    cute.arch.barrier()


@cute.jit
def init_cluster_barrier_in_one_warp(mbar_load, mbar_s, mbar_p, mbar_o, warp):
    if warp == MMA_WARP:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar_load, 1)
            cute.arch.mbarrier_init(mbar_s, 1)
            cute.arch.mbarrier_init(mbar_p, 256)
            cute.arch.mbarrier_init(mbar_o, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()


@cute.jit
def init_without_fence(mbar_load, mbar_s, mbar_p, mbar_o, warp):
    if warp == MMA_WARP:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar_load, 1)
            cute.arch.mbarrier_init(mbar_s, 1)
            cute.arch.mbarrier_init(mbar_p, 256)
            cute.arch.mbarrier_init(mbar_o, 1)
    cute.arch.cluster_arrive_relaxed()
    cute.arch.cluster_wait()


@cute.jit
def init_fence_after_arrive(mbar_load, mbar_s, mbar_p, mbar_o, warp):
    if warp == MMA_WARP:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar_load, 1)
            cute.arch.mbarrier_init(mbar_s, 1)
            cute.arch.mbarrier_init(mbar_p, 256)
            cute.arch.mbarrier_init(mbar_o, 1)
    cute.arch.cluster_arrive_relaxed()
    if warp == MMA_WARP:
        cute.arch.mbarrier_init_fence()
    cute.arch.cluster_wait()


def _m10_3(answer, says):
    return Mutation("10.3", T.check_pair_mma, answer, says, reference=primer.pair_mma)


def _m10_4(answer, says):
    return Mutation("10.4", T.check_init_pair_barriers, answer, says,
                    reference=primer.init_pair_barriers)


MUTATIONS = [
    Mutation("10.1", T.check_smem_cycles_per_step, smem_kv_once, "read twice per step",
             reference=T.smem_cycles_per_step),
    Mutation("10.1", T.check_smem_cycles_per_step, smem_halves_a, "halves the B operands",
             reference=T.smem_cycles_per_step),
    Mutation("10.1", T.check_smem_cycles_per_step, smem_in_bytes, "that is bytes",
             reference=T.smem_cycles_per_step),
    Mutation("10.2", T.check_schedule_efficiency, efficiency_pairs_on_every_sm, "74 pairs",
             reference=T.schedule_efficiency),
    Mutation("10.2", T.check_schedule_efficiency, efficiency_tiles_of_128, "two Q stages",
             reference=T.schedule_efficiency),
    Mutation("10.2", T.check_schedule_efficiency, efficiency_no_rounds, "round up",
             reference=T.schedule_efficiency),
    _m10_3(pair_both_issue, "CTA 1 issued MMAs too"),
    _m10_3(pair_follower_issues, "CTA 1 issued MMAs too"),
    _m10_3(pair_commit_no_mask, "multicast the commit to both CTAs"),
    _m10_3(pair_commit_group_one, "cta_group=tcgen05.CtaGroup.TWO"),
    _m10_3(pair_no_wait_for_p, "wait on mbar_p"),
    _m10_3(pair_no_wait_for_loads, "wait on mbar_load"),
    _m10_3(pair_whole_warp_commits, "elect_one"),
    _m10_4(init_p_counts_one_cta, "128 that the follower's threads make remotely"),
    _m10_4(init_s_counts_two_commits, "arrives once on each CTA's barrier"),
    _m10_4(init_load_counts_both_ctas, "the TMA bytes complete it"),
    _m10_4(init_with_cta_barrier, "pass the cluster barrier"),
    _m10_4(init_cluster_barrier_in_one_warp, "Every thread of both CTAs arrives and waits"),
    _m10_4(init_without_fence, "mbarrier_init_fence()"),
    _m10_4(init_fence_after_arrive, "mbarrier_init_fence()"),
]
