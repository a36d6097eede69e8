"""Chapter 04's typical wrong answers, each held against its exercise's checker
(tests/test_exercise_mutations.py). The device-code ones are written the way a learner would
write them, in this file because the DSL reads a kernel's source from its file."""

import cutlass
import cutlass.cute as cute

from solutions import ch04_flash_ampere as fa
from solutions import ch04_kv_step as kv
from solutions import ch04_teaching as t4
from tests.exercise_mutations import SLOW, mutant, planted


# ----------------------------------------------------------------------------------------------
# 04.1: registers of a tile
def registers_accumulators_only(cfg, head_dim):
    acc = cfg.accumulator_registers(head_dim)
    n = acc["acc_O"] + acc["acc_S"]
    return n, n <= 255


def registers_everything_at_once(cfg, head_dim):
    # S in fp32, P in bf16 and both operands' fragments all counted as live together
    acc = cfg.accumulator_registers(head_dim)
    n = acc["acc_O"] + acc["acc_S"] + acc["acc_S"] // 2 + 16 + 16 + 24 + 64
    return n, n <= 255


def _live_at_peak(cfg, head_dim):
    rows_per_warp = cfg.m_block // cfg.num_warps
    acc_o = cfg.m_block * head_dim // cfg.num_threads
    acc_s = cfg.m_block * cfg.n_block // cfg.num_threads
    q_slices = cfg.qk_unroll * rows_per_warp // 4
    return acc_o + acc_s + q_slices + 8 + rows_per_warp // 4 + 24


def registers_capped_at_the_limit(cfg, head_dim):
    n = min(_live_at_peak(cfg, head_dim), 255)  # "ptxas will make it fit"
    return n, True


def registers_ignore_the_limit(cfg, head_dim):
    return _live_at_peak(cfg, head_dim), True


def registers_from_the_model(cfg, head_dim):
    est = t4.register_estimate(cfg, head_dim)
    return est["peak"], est["fits"]


# ----------------------------------------------------------------------------------------------
# 04.2: which KV tiles a causal query tile visits and masks
def tiles_everything(m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal):
    n = -(-seqlen_k // tile_n)
    return list(range(n)), [n - 1]


tiles_no_empty_rule = mutant(  # no step at all where no row sees a key
    t4.kv_tiles, "if n_visit == 0:", None, also=[("return [0], [0]", None)])


tiles_mask_off_by_one = mutant(  # one key short: the diagonal itself
    t4.kv_tiles, "m_block * tile_m + offset + 1", "m_block * tile_m + offset")


def tiles_from_the_kernel(m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal):
    ranges = t4.kv_tile_ranges(seqlen_q, seqlen_k, tile_m, tile_n, causal)
    n_max, n_masked = (int(x) for x in ranges[m_block])
    return list(range(max(n_max, 1))), list(range(max(n_masked, 0), max(n_max, 1)))


# ----------------------------------------------------------------------------------------------
# 04.3: S = Q K^T
qk_registers_by_k = mutant(  # registers indexed by the run-time k
    fa.gemm_from_smem, "None, 0]", "None, k]", 4)


qk_first_slice_of_k = mutant(  # every slice of Q times K's first
    fa.gemm_from_smem, "tCsB[None, None, k]", "tCsB[None, None, 0]")


qk_fully_unrolled = mutant(  # unrolled completely: all slices live at once
    fa.gemm_from_smem, "cutlass.range(cute.size(tCsA, mode=[2]), unroll=unroll)",
    "cutlass.range_constexpr(cute.size(tCsA, mode=[2]))", also=[("None, 0]", "None, k]", 4)])


qk_no_unroll = mutant(fa.gemm_from_smem, ", unroll=unroll)", ")")  # the unroll factor dropped


qk_into_the_mma_view = mutant(  # ldmatrix into the MMA's view: no retile
    fa.gemm_from_smem, ".retile(", None, 2, also=[("_copy[None", "[None", 2)])


qk_operands_swapped = mutant(  # B in A's place
    fa.gemm_from_smem, "tCrA[None, None, 0], tCrB[None, None, 0]",
    "tCrB[None, None, 0], tCrA[None, None, 0]")


qk_unrolled_fully_at_run_time = mutant(  # unroll_full: every slice live
    fa.gemm_from_smem, "unroll=unroll", "unroll_full=True")


@cute.jit
def qk_the_kernels(tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, smem_copy_A, smem_copy_B,
                   unroll: cutlass.Constexpr):
    fa.gemm_from_smem(tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, smem_copy_A, smem_copy_B, unroll)


@cute.jit
def qk_not_done(tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, smem_copy_A, smem_copy_B,
                unroll: cutlass.Constexpr):
    raise NotImplementedError("exercise: replace this line with your code")


# ----------------------------------------------------------------------------------------------
# 04.4: the online softmax in registers
softmax_no_guard = mutant(  # a fully masked row: exp2(-inf + inf)
    kv.online_softmax, "m_safe = 0.0 if m_new == -Float32.inf else m_new", "m_safe = m_new")


softmax_offsets_past_the_quad = mutant(  # offset 4 is another quad's lane
    kv.online_softmax, "offset=2", "offset=4")


softmax_one_shuffle = mutant(kv.online_softmax, "offset=2))", None)  # half the quad's max


softmax_no_shuffle = mutant(kv.online_softmax, "shuffle_sync_bfly", None, 2)  # lane's max only


softmax_no_o_rescale = mutant(  # O not rescaled
    kv.online_softmax, "o[r, None].store(o[r, None].load() * correction)", None)


softmax_no_sum_rescale = mutant(  # the row sum not rescaled
    kv.online_softmax, "row_sum[r] * correction + p_sum", "row_sum[r] + p_sum")


softmax_sums_the_quad = mutant(  # the quad's sum each tile: finalize adds it again
    kv.online_softmax, "Float32(0.0), 0)", "Float32(0.0), 0)"
    "; p_sum = p_sum + cute.arch.shuffle_sync_bfly(p_sum, offset=2)"
    "; p_sum = p_sum + cute.arch.shuffle_sync_bfly(p_sum, offset=1)")


softmax_forgets_earlier_max = mutant(  # this tile's max only
    kv.online_softmax, "m_tile if const_expr(is_first) else cute.arch.fmax(m_old, m_tile)",
    "m_tile")


softmax_natural_exp = mutant(kv.online_softmax, "cute.math.exp2(", "cute.math.exp(", 2)  # log2


softmax_shuffles_in_a_branch = mutant(  # shuffles skipped for a masked part of the row
    kv.online_softmax, "offset=1))", None, also=[(
        "m_tile = cute.arch.fmax(m_tile, cute.arch.shuffle_sync_bfly(m_tile, offset=2))",
        "if m_tile > -Float32.inf: "
        "m_tile = cute.arch.fmax(m_tile, cute.arch.shuffle_sync_bfly(m_tile, offset=2)); "
        "m_tile = cute.arch.fmax(m_tile, cute.arch.shuffle_sync_bfly(m_tile, offset=1))")])


softmax_an_extra_shuffle = mutant(  # a third shuffle changes nothing, and costs
    kv.online_softmax, "offset=1))",
    "offset=1)); m_tile = cute.arch.fmax(m_tile, cute.arch.shuffle_sync_bfly(m_tile, offset=2))")


softmax_with_the_kernels_reduce = mutant(  # the kernel's quad reduce
    kv.online_softmax, "shuffle_sync_bfly", None, 2, also=[(
        "m_tile = s_row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)",
        "m_tile = fa.quad_allreduce("
        "s_row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0), fa.fmax)")])


@cute.jit
def softmax_not_done(s, o, row_max, row_sum, scale_log2, is_first: cutlass.Constexpr):
    raise NotImplementedError("exercise: replace this line with your code")


# ----------------------------------------------------------------------------------------------
# 04.5: O += P V
pv_first_slice_never_loaded = mutant(  # slice 0 of V never loaded
    fa.gemm_from_regs, "tCsB[None, None, 0], tCrB_copy[None, None, 0]", None)


@cute.jit
def pv_run_time_loop(tiled_mma, acc, tCrA, tCrB, tCsB, smem_copy_B):
    tCrB_copy = smem_copy_B.retile(tCrB)
    for k in cutlass.range(cute.size(tCrA, mode=[2]), unroll=1):
        cute.copy(smem_copy_B, tCsB[None, None, k], tCrB_copy[None, None, 0])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, 0], acc)


pv_slot_off_by_one = mutant(  # slice k + 1 loaded over slice k before it is read
    fa.gemm_from_regs, "tCrB_copy[None, None, k + 1]", "tCrB_copy[None, None, k]")


pv_loads_one_past_the_end = mutant(  # the last trip loads a slice that is not there
    fa.gemm_from_regs, "if const_expr(k + 1 < num_k):", "if const_expr(True):")


pv_loads_p = mutant(  # P loaded from shared memory: it is in registers already
    fa.gemm_from_regs, "cute.gemm(",
    "cute.copy(smem_copy_B, tCsB[None, None, k], tCrA[None, None, k]); cute.gemm(")


@cute.jit
def pv_the_kernels(tiled_mma, acc, tCrA, tCrB, tCsB, smem_copy_B):
    fa.gemm_from_regs(tiled_mma, acc, tCrA, tCrB, tCsB, smem_copy_B)


@cute.jit
def pv_not_done(tiled_mma, acc, tCrA, tCrB, tCsB, smem_copy_B):
    raise NotImplementedError("exercise: replace this line with your code")


MUTATIONS = [
    *planted("04.1", t4.check_registers_needed, t4.registers_needed, t4.REGISTERS_FORBID, rows=[
        (registers_accumulators_only, "something large is missing", SLOW),
        (registers_everything_at_once, "not live at the same", SLOW),
        (registers_capped_at_the_limit, "ptxas could not fit it", SLOW),
        (registers_ignore_the_limit, "so fits must be False", SLOW),
        (registers_from_the_model, "the chapter's own model"),
    ]),
    *planted("04.2", t4.check_kv_tiles, t4.kv_tiles, t4.KV_TILES_FORBID, rows=[
        (tiles_everything, "some row of the tile sees some key"),
        (tiles_no_empty_rule, "fully masked step on tile 0"),
        (tiles_mask_off_by_one, "FIRST row"),
        (tiles_from_the_kernel, "runs the kernel's kv_tile_range"),
    ]),
    *planted("04.3", kv.check_gemm_qk, kv.gemm_qk, kv.QK_FORBID, rows=[
        (qk_registers_by_k, "indexed by the run-time loop counter k"),
        (qk_first_slice_of_k, "the k-th 16 columns of Q go with the k-th 16 of K"),
        (qk_fully_unrolled, "unrolled the loop over the k-slices completely"),
        (qk_no_unroll, "Pass unroll=unroll"),
        (qk_into_the_mma_view, "ldmatrix writes its registers in its own arrangement"),
        (qk_operands_swapped, "operands in the wrong places"),
        (qk_unrolled_fully_at_run_time, "uses local memory", SLOW),
        (qk_the_kernels, "the reference solution"),
        (qk_not_done, "not done"),
    ]),
    *planted("04.4", kv.check_online_softmax, kv.online_softmax, kv.SOFTMAX_FORBID, rows=[
        (softmax_no_guard, "exp2(-inf + inf) = NaN"),
        (softmax_offsets_past_the_quad, "reach beyond the quad"),
        (softmax_one_shuffle, "pair each lane with one partner only"),
        (softmax_no_shuffle, "no lane read another lane's value"),
        (softmax_no_o_rescale, "missing rescale of O"),
        (softmax_no_sum_rescale, "missing rescale of the row sum"),
        (softmax_sums_the_quad, "finalize adds the four partial sums"),
        (softmax_forgets_earlier_max, "remember the earlier tiles"),
        (softmax_natural_exp, "meant for exp2"),
        (softmax_shuffles_in_a_branch, "different numbers of shuffles"),
        (softmax_an_extra_shuffle, "butterfly shuffles where the kernel has", SLOW),
        (softmax_with_the_kernels_reduce, "write the two shuffles of the quad yourself"),
        (softmax_not_done, "not done"),
    ]),
    *planted("04.5", kv.check_gemm_pv, kv.gemm_pv, kv.PV_FORBID, rows=[
        (pv_first_slice_never_loaded, "before any ldmatrix filled it"),
        (pv_run_time_loop, "indexed by a run-time loop counter"),
        (pv_slot_off_by_one, "of P with slice"),
        (pv_loads_one_past_the_end, "you asked for slice 4"),
        (pv_loads_p, "already in registers"),
        (pv_the_kernels, "the reference solution"),
        (pv_not_done, "not done"),
    ]),
]
