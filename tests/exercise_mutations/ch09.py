"""Chapter 09's typical wrong answers: the TMEM column plan (09.1), the lane quarters (09.2),
the primer's MMA issue (09.3) and softmax warpgroup (09.4) in device code, the arrivals of
s[i]'s EMPTY barrier (09.5). Most device-code ones are the reference with one change
(``mutant``)."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import tcgen05

from fa4_final.blackwell.softmax import RowSoftmax
from solutions import ch09_primer as primer
from solutions import ch09_teaching as T
from tests.exercise_mutations import mutant, planted


# --- 09.1 ---------------------------------------------------------------------------------------
def _plan(tile_n, head_dim, p_low=False, alloc=None, refuse=True):
    if 2 * tile_n + 2 * head_dim > 512 and refuse:
        raise ValueError("does not fit")
    s = {f"S{i}": (i * tile_n, tile_n) for i in range(2)}
    o = {f"O{i}": (2 * tile_n + i * head_dim, head_dim) for i in range(2)}
    p = {f"P{i}": (i * tile_n + (0 if p_low else tile_n // 2), tile_n // 2) for i in range(2)}
    used = 2 * tile_n + 2 * head_dim
    fits = next((a for a in (32, 64, 128, 256, 512) if a >= used), 1024)
    return {**s, **o, **p, "alloc": used if alloc == "used" else fits}


def plan_p_low_half(tile_n, head_dim):
    return _plan(tile_n, head_dim, p_low=True)


def plan_alloc_used(tile_n, head_dim):
    return _plan(tile_n, head_dim, alloc="used")


def plan_never_refuses(tile_n, head_dim):
    return _plan(tile_n, head_dim, refuse=False)


# --- 09.2 ---------------------------------------------------------------------------------------
def warps_first_quarter_only(rows):
    return [w for w in range(16) if w % 4 == rows.start // 32]


def warps_by_warpgroup(rows):
    return [w for w in range(16) if rows.start // 32 == w // 4]


# --- 09.3 ---------------------------------------------------------------------------------------
ISSUE, SOFTMAX = primer.issue_qk, primer.softmax_to_p

issue_always_accumulates = mutant(ISSUE, "k != 0)", "True)")  # adds onto the last tile's S


issue_never_accumulates = mutant(ISSUE, "k != 0)", "False)")  # each block overwrites S


@cute.jit
def issue_commits_every_mma(mma_qk, tStS, tSrQ, tSrK, mbar_s):
    for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
        mma_qk.set(tcgen05.Field.ACCUMULATE, k != 0)
        cute.gemm(mma_qk, tStS, tSrQ[None, None, k], tSrK[None, None, k], tStS)
        with cute.arch.elect_one():
            tcgen05.commit(mbar_s)


issue_commits_first = mutant(  # the commit before the MMAs: it tracks none of them
    ISSUE, "with cute.arch.elect_one():", None, also=[
        ("tcgen05.commit(mbar_s)", None),
        ("    for k in", "    with cute.arch.elect_one(): tcgen05.commit(mbar_s)\n    for k in")])


issue_whole_warp_commits = mutant(  # 32 lanes commit
    ISSUE, "with cute.arch.elect_one():", "if True:")


issue_one_block_of_k = mutant(  # K's first 16 columns with every block of Q
    ISSUE, "tSrK[None, None, k]", "tSrK[None, None, 0]")


# --- 09.4 ---------------------------------------------------------------------------------------
softmax_no_wait = mutant(SOFTMAX, "mbarrier_wait(mbar_s, 0)", None)  # reads S unready


softmax_wrong_parity = mutant(  # the first phase has parity 0
    SOFTMAX, "mbarrier_wait(mbar_s, 0)", "mbarrier_wait(mbar_s, 1)")


softmax_arrives_before_fence = mutant(  # arrives before P's stores are waited for
    SOFTMAX, "fence_view_async_tmem_store()", None, also=[
        ("cute.arch.mbarrier_arrive(mbar_p)",
         "cute.arch.mbarrier_arrive(mbar_p); cute.arch.fence_view_async_tmem_store()")])


softmax_no_fence = mutant(SOFTMAX, "fence_view_async_tmem_store()", None)  # no wait::st


softmax_without_max = mutant(  # exp2 of the raw scores
    SOFTMAX, "max_scaled = row_max * scale_log2", "max_scaled = Float32(0.0)")


softmax_natural_exp = mutant(SOFTMAX, "cute.math.exp2(", "cute.math.exp(")  # scale is log2


softmax_elected_arrive = mutant(  # one arrival per warp, not per thread
    SOFTMAX, "cute.arch.mbarrier_arrive(mbar_p)",
    "with cute.arch.elect_one(): cute.arch.mbarrier_arrive(mbar_p)")


softmax_arrives_on_s = mutant(  # the wrong barrier
    SOFTMAX, "mbarrier_arrive(mbar_p)", "mbarrier_arrive(mbar_s)")


softmax_fp16_p = mutant(  # P converted to fp16, not to rP's type
    SOFTMAX, ".to(rP.element_type)", ".to(cutlass.Float16)")


@cute.jit
def softmax_with_helper(load_s, tStS, rS, store_p, tPtP, rP32, rP, mbar_s, mbar_p, scale_log2):
    cute.arch.mbarrier_wait(mbar_s, 0)
    cute.copy(load_s, tStS, rS)
    max_scaled, row_sum = primer.row_exp2(rS, scale_log2)
    rP.store(rS.load().to(rP.element_type))
    cute.copy(store_p, rP32, tPtP)
    cute.arch.fence_view_async_tmem_store()
    cute.arch.mbarrier_arrive(mbar_p)
    return max_scaled, row_sum


SOFTMAX_FORBID = {
    primer.row_exp2: "it is the row arithmetic you are asked to write (the pair primer's helper)",
    RowSoftmax: "it is the full forward's softmax; write the row's max and exponentials here",
}


MUTATIONS = [
    *planted("09.1", T.check_plan_columns, T.plan_columns, rows=[
        (plan_p_low_half, "upper half of S_i's columns"),
        (plan_alloc_used, "a power of two >= 32"),
        (plan_never_refuses, "raise ValueError"),
    ]),
    *planted("09.2", T.check_warps_for_rows, T.warps_for_rows, rows=[
        (warps_first_quarter_only, "crosses a multiple of 32"),
        (warps_by_warpgroup, "lanes 32 (w mod 4)"),
    ]),
    *planted("09.3", T.check_issue_qk, primer.issue_qk, rows=[
        (issue_always_accumulates, "ACCUMULATE to False for k = 0"),
        (issue_never_accumulates, "must be True for every k > 0"),
        (issue_commits_every_mma, "commit once, after the last MMA"),
        (issue_commits_first, "before the last MMA"),
        (issue_whole_warp_commits, "cute.arch.elect_one()"),
        (issue_one_block_of_k, "the same 16 columns of D"),
    ]),
    *planted("09.4", T.check_softmax_to_p, primer.softmax_to_p, SOFTMAX_FORBID, rows=[
        (softmax_no_wait, "wait on mbar_s with parity 0"),
        (softmax_wrong_parity, "wait on mbar_s with parity 0"),
        (softmax_arrives_before_fence, "fence_view_async_tmem_store() (tcgen05.wait::st)"),
        (softmax_no_fence, "fence_view_async_tmem_store() (tcgen05.wait::st)"),
        (softmax_without_max, "did not subtract the row's max"),
        (softmax_natural_exp, "use cute.math.exp2"),
        (softmax_elected_arrive, "one per softmax thread"),
        (softmax_arrives_on_s, "the softmax arrives on mbar_p"),
        (softmax_fp16_p, "convert with .to(rP.element_type)"),
        (softmax_with_helper, "the row arithmetic you are asked to write"),
    ]),
    *planted("09.5", T.check_s_empty_arrivals, rows=[
        ({"1-CTA": 128, "2-CTA": 256}, "the correction warpgroup"),
        ({"1-CTA": 256, "2-CTA": 256}, "both CTAs' warpgroups arrive on the leader's barrier"),
    ]),
]
