"""Chapter 11's exercises: typical wrong answers, each with the words its checker must say.
The device-code ones (11.5 the dS step, 11.6 the deterministic turn) are @cute.jit functions: the
DSL reads their source from this file."""

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr

from fa4_final.common.atomics import pass_turn, wait_turn
from solutions import ch11_backward as ch11
from solutions import ch11_ds_step as ds
from solutions import ch11_turns as turns
from tests.exercise_mutations import Mutation


# --- 11.1 delta --------------------------------------------------------------------------------
def delta_in_bf16(out, dout):
    return (dout * out).sum(-1).transpose(1, 2)


def delta_not_transposed(out, dout):
    acc = torch.promote_types(out.dtype, torch.float32)
    return (dout.to(acc) * out.to(acc)).sum(-1)


# --- 11.2 the tile step ------------------------------------------------------------------------
def step_scaled(q_t, k_t, v_t, do_t, lse_t, delta_t, scale, visible=None):
    acc = torch.promote_types(q_t.dtype, torch.float32)
    q_a, k_a, v_a, do_a = (t.to(acc) for t in (q_t, k_t, v_t, do_t))
    s = (q_a @ k_a.transpose(-1, -2)) * (scale * ch11.LOG2E)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    p = ch11.recompute_p(s, lse_t)
    ds_ = ch11.ds_from_dp(p, do_a @ v_a.transpose(-1, -2), delta_t)
    return scale * ds_ @ k_a, scale * ds_.transpose(-1, -2) @ q_a, p.transpose(-1, -2) @ do_a


def step_dv_from_ds(q_t, k_t, v_t, do_t, lse_t, delta_t, scale, visible=None):
    acc = torch.promote_types(q_t.dtype, torch.float32)
    q_a, k_a, v_a, do_a = (t.to(acc) for t in (q_t, k_t, v_t, do_t))
    s = (q_a @ k_a.transpose(-1, -2)) * (scale * ch11.LOG2E)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    p = ch11.recompute_p(s, lse_t)
    ds_ = ch11.ds_from_dp(p, do_a @ v_a.transpose(-1, -2), delta_t)
    return ds_ @ k_a, ds_.transpose(-1, -2) @ q_a, ds_.transpose(-1, -2) @ do_a


# --- 11.3 where the inner loop starts ----------------------------------------------------------
def first_tile_ignores_offset(k_start, seqlen_q, seqlen_k, tile_m, causal):
    return k_start // tile_m if causal else 0


def first_tile_rounds_up(k_start, seqlen_q, seqlen_k, tile_m, causal):
    if not causal:
        return 0
    return -(-max(k_start - (seqlen_k - seqlen_q), 0) // tile_m)


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


def adds_in_bf16(seqlen_q, seqlen_k, head_dim, tile_m, tile_n, causal):
    n_q = -(-seqlen_q // tile_m)
    total = 0
    for k0 in range(0, seqlen_k, tile_n):
        first = ch11.first_q_tile(k0, seqlen_q, seqlen_k, tile_m, causal)
        total += max(n_q - first, 0) * tile_m * head_dim * 2
    return total


# --- 11.5 the dS step in registers -------------------------------------------------------------
@cute.jit
def ds_natural_exp(s, dp, lse, delta, scale_log2, wait_dp, mask):
    rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    if const_expr(mask is not None):
        coords, offset, seqlen_k, causal = mask
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                key, query = coords[r, c]
                hidden = key >= seqlen_k
                if const_expr(causal):
                    hidden = hidden | (key > query + offset)
                s[r, c] = -Float32.inf if hidden else s[r, c]
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            s[r, c] = cute.math.exp(s[r, c] * scale_log2 - lse[0, c], fastmath=True)
    wait_dp()
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            dp[r, c] = s[r, c] * (dp[r, c] - delta[0, c])


@cute.jit
def ds_mask_off_by_one(s, dp, lse, delta, scale_log2, wait_dp, mask):
    rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    if const_expr(mask is not None):
        coords, offset, seqlen_k, causal = mask
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                key, query = coords[r, c]
                hidden = key >= seqlen_k
                if const_expr(causal):
                    hidden = hidden | (key >= query + offset)
                s[r, c] = -Float32.inf if hidden else s[r, c]
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - lse[0, c], fastmath=True)
    wait_dp()
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            dp[r, c] = s[r, c] * (dp[r, c] - delta[0, c])


@cute.jit
def ds_mask_queries_on_rows(s, dp, lse, delta, scale_log2, wait_dp, mask):
    rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    if const_expr(mask is not None):
        coords, offset, seqlen_k, causal = mask
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                key, query = coords[r, c]
                hidden = key >= seqlen_k
                if const_expr(causal):
                    hidden = hidden | (query > key + offset)
                s[r, c] = -Float32.inf if hidden else s[r, c]
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - lse[0, c], fastmath=True)
    wait_dp()
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            dp[r, c] = s[r, c] * (dp[r, c] - delta[0, c])


@cute.jit
def ds_forgets_seqlen_k(s, dp, lse, delta, scale_log2, wait_dp, mask):
    rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    if const_expr(mask is not None):
        coords, offset, seqlen_k, causal = mask
        if const_expr(causal):
            for r in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(cols):
                    key, query = coords[r, c]
                    s[r, c] = -Float32.inf if key > query + offset else s[r, c]
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - lse[0, c], fastmath=True)
    wait_dp()
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            dp[r, c] = s[r, c] * (dp[r, c] - delta[0, c])


@cute.jit
def ds_lse_converted_again(s, dp, lse, delta, scale_log2, wait_dp, mask):
    rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - lse[0, c] * 1.4426950408889634,
                                     fastmath=True)
    wait_dp()
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            dp[r, c] = s[r, c] * (dp[r, c] - delta[0, c])


@cute.jit
def ds_delta_outside(s, dp, lse, delta, scale_log2, wait_dp, mask):
    rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    if const_expr(mask is not None):
        coords, offset, seqlen_k, causal = mask
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                key, query = coords[r, c]
                hidden = key >= seqlen_k
                if const_expr(causal):
                    hidden = hidden | (key > query + offset)
                s[r, c] = -Float32.inf if hidden else s[r, c]
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - lse[0, c], fastmath=True)
    wait_dp()
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            dp[r, c] = s[r, c] * dp[r, c] - delta[0, c]


@cute.jit
def ds_reads_dp_early(s, dp, lse, delta, scale_log2, wait_dp, mask):
    rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    if const_expr(mask is not None):
        coords, offset, seqlen_k, causal = mask
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                key, query = coords[r, c]
                hidden = key >= seqlen_k
                if const_expr(causal):
                    hidden = hidden | (key > query + offset)
                s[r, c] = -Float32.inf if hidden else s[r, c]
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - lse[0, c], fastmath=True)
            dp[r, c] = s[r, c] * (dp[r, c] - delta[0, c])
    wait_dp()


@cute.jit
def ds_waits_before_p(s, dp, lse, delta, scale_log2, wait_dp, mask):
    rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    wait_dp()
    if const_expr(mask is not None):
        coords, offset, seqlen_k, causal = mask
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                key, query = coords[r, c]
                hidden = key >= seqlen_k
                if const_expr(causal):
                    hidden = hidden | (key > query + offset)
                s[r, c] = -Float32.inf if hidden else s[r, c]
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - lse[0, c], fastmath=True)
            dp[r, c] = s[r, c] * (dp[r, c] - delta[0, c])


@cute.jit
def ds_delta_of_the_row(s, dp, lse, delta, scale_log2, wait_dp, mask):
    rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    if const_expr(mask is not None):
        coords, offset, seqlen_k, causal = mask
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                key, query = coords[r, c]
                hidden = key >= seqlen_k
                if const_expr(causal):
                    hidden = hidden | (key > query + offset)
                s[r, c] = -Float32.inf if hidden else s[r, c]
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - lse[0, c], fastmath=True)
    wait_dp()
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            dp[r, c] = s[r, c] * (dp[r, c] - delta[0, r])


@cute.jit
def ds_exponentials_twice(s, dp, lse, delta, scale_log2, wait_dp, mask):
    rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
    if const_expr(mask is not None):
        coords, offset, seqlen_k, causal = mask
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                key, query = coords[r, c]
                hidden = key >= seqlen_k
                if const_expr(causal):
                    hidden = hidden | (key > query + offset)
                s[r, c] = -Float32.inf if hidden else s[r, c]
    raw = cute.make_rmem_tensor((rows, cols), Float32)
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            raw[r, c] = s[r, c] * scale_log2 - lse[0, c]
            s[r, c] = cute.math.exp2(raw[r, c], fastmath=True)
    wait_dp()
    for c in cutlass.range_constexpr(cols):
        for r in cutlass.range_constexpr(rows):
            dp[r, c] = cute.math.exp2(raw[r, c]) * (dp[r, c] - delta[0, c])


# --- 11.6 the deterministic turn ---------------------------------------------------------------
@cute.jit
def turn_never_passed(lane, counter, my_turn, add_blocks):
    if lane == 0:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        while seen != my_turn:
            seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_warp()
    add_blocks()
    if lane == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=False)
    cute.arch.sync_warp()


@cute.jit
def turn_passed_after_read(lane, counter, my_turn, add_blocks):
    if lane == 0:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        while seen != my_turn:
            seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_warp()
    add_blocks()
    if lane == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.red(counter, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")
    cute.arch.sync_warp()


@cute.jit
def turn_not_awaited(lane, counter, my_turn, add_blocks):
    cute.arch.sync_warp()
    add_blocks()
    if lane == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.red(counter, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")
    cute.arch.sync_warp()


@cute.jit
def turn_passed_by_every_lane(lane, counter, my_turn, add_blocks):
    if lane == 0:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        while seen != my_turn:
            seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_warp()
    add_blocks()
    cute.arch.cp_async_bulk_wait_group(0, read=False)
    cute.arch.fence_acq_rel_gpu()
    cute.arch.red(counter, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")
    cute.arch.sync_warp()


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


@cute.jit
def turn_relaxed(lane, counter, my_turn, add_blocks):
    if lane == 0:
        seen = cute.arch.load(counter, Int32, sem="relaxed", scope="gpu")
        while seen != my_turn:
            seen = cute.arch.load(counter, Int32, sem="relaxed", scope="gpu")
    cute.arch.sync_warp()
    add_blocks()
    if lane == 0:
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.red(counter, Int32(1), op="add", dtype=Int32, sem="relaxed", scope="gpu")
    cute.arch.sync_warp()


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


def _m(ex, check, answer, says, **kw):
    return Mutation(ex, check, answer, says, **kw)


_DS = dict(reference=ds.ds_step, forbid=ds.FORBID)
_TURN = dict(reference=turns.add_in_turn, forbid=turns.FORBID)

MUTATIONS = [
    _m("11.1", ch11.check_softmax_delta, delta_in_bf16, "float32",
       reference=ch11.softmax_delta),
    _m("11.1", ch11.check_softmax_delta, delta_not_transposed, "transpose the last two dims",
       reference=ch11.softmax_delta),
    _m("11.2", ch11.check_tile_step, step_scaled, "softmax scale", reference=ch11.tile_step),
    _m("11.2", ch11.check_tile_step, step_dv_from_ds, "dV = P^T dO", reference=ch11.tile_step),
    _m("11.3", ch11.check_first_q_tile, first_tile_ignores_offset, "sees key",
       reference=ch11.first_q_tile),
    _m("11.3", ch11.check_first_q_tile, first_tile_rounds_up, "already",
       reference=ch11.first_q_tile),
    _m("11.4", ch11.check_dq_add_bytes, adds_every_pair, "skips",
       reference=ch11.dq_add_bytes, forbid=ch11.FORBID_DQ_BYTES),
    _m("11.4", ch11.check_dq_add_bytes, adds_half_when_causal, "not half",
       reference=ch11.dq_add_bytes, forbid=ch11.FORBID_DQ_BYTES),
    _m("11.4", ch11.check_dq_add_bytes, adds_rows_not_tiles, "whole tile",
       reference=ch11.dq_add_bytes, forbid=ch11.FORBID_DQ_BYTES),
    _m("11.4", ch11.check_dq_add_bytes, adds_in_bf16, "float32",
       reference=ch11.dq_add_bytes, forbid=ch11.FORBID_DQ_BYTES),
    _m("11.5", ds.check_ds_step_rules, ds_natural_exp, "exp2, not exp", **_DS),
    _m("11.5", ds.check_ds_step_rules, ds_mask_off_by_one, "on the diagonal", **_DS),
    _m("11.5", ds.check_ds_step_rules, ds_mask_queries_on_rows, "keys on the rows", **_DS),
    _m("11.5", ds.check_ds_step_rules, ds_forgets_seqlen_k, "past seqlen_k", **_DS),
    _m("11.5", ds.check_ds_step_rules, ds_lse_converted_again, "already in log2 units", **_DS),
    _m("11.5", ds.check_ds_step_rules, ds_delta_outside, "inside the bracket", **_DS),
    _m("11.5", ds.check_ds_step_rules, ds_reads_dp_early, "before calling wait_dp", **_DS),
    _m("11.5", ds.check_ds_step_rules, ds_waits_before_p, "before calling wait_dp", **_DS),
    _m("11.5", ds.check_ds_step_rules, ds_delta_of_the_row, "delta belongs to a query", **_DS),
    _m("11.6", turns.check_turn_rules, turn_never_passed, "waits forever", **_TURN),
    _m("11.6", turns.check_turn_rules, turn_passed_after_read, "read=True", **_TURN),
    _m("11.6", turns.check_turn_rules, turn_not_awaited, "never read the counter", **_TURN),
    _m("11.6", turns.check_turn_rules, turn_passed_by_every_lane, "by 32", **_TURN),
    _m("11.6", turns.check_turn_rules, turn_adds_in_lane_zero_only, "every lane", **_TURN),
    _m("11.6", turns.check_turn_rules, turn_relaxed, "sem='acquire'", **_TURN),
    _m("11.6", turns.check_turn_rules, turn_with_package_helpers, "the package's", **_TURN),
    _m("11.5", ds.check_ds_step, ds_natural_exp, "exp2, not exp", slow=True, **_DS),
    _m("11.5", ds.check_ds_step, ds_exponentials_twice, "spills", slow=True, **_DS),
    _m("11.6", turns.check_add_in_turn, turn_passed_after_read, "read=True", slow=True,
       **_TURN),
]
