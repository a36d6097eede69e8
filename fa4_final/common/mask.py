"""Masking scores in registers: keys past seqlen_k, right of the causal diagonal or outside a
sliding window get -inf before the softmax.

Note [Mask with constants]
A thread's column c inside a fragment is thread 0's column c (a compile-time constant) plus one
run-time offset per thread. So the offset moves into the row's limits once, and each element
costs one compare with a constant and one select (FSEL), not an index computation. A select, not
a branch: an ``if`` around the element would carry the whole fragment through the branch.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from fa4_final.common.fragments import acc_rows_cols
from fa4_final.common.tiles import TileWindow, visible_cols


def fragment_coords(thr_mma, tile_mn) -> tuple:
    """((rows, cols) of (row, col) in the tile for this thread, the same for thread 0)."""
    c = cute.make_identity_tensor(tile_mn)
    return (acc_rows_cols(thr_mma.partition_C(c)),
            acc_rows_cols(thr_mma.get_slice(0).partition_C(c)))


@cute.jit
def apply_mask(
    acc_s: cute.Tensor,  # accumulator fragment of S for one (m_block, n_block)
    tScS: cute.Tensor,  # (rows, cols) -> (row, col) in the tile, this thread
    t0ScS: cute.Tensor,  # the same for thread 0 (compile-time coordinates)
    w: cutlass.Constexpr[TileWindow],
    m_block,
    n_block,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    mask_left: cutlass.Constexpr[bool] = False,
):
    """Scores of invisible keys -> -inf (tiles.visible_cols gives each row's column range).
    ``mask_left`` adds the left edge of a sliding window (only the last tiles visited need it)."""
    s = acc_rows_cols(acc_s)
    col_offset = tScS[0, 0][1]
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = m_block * w.tile_m + tScS[r, 0][0]
        lo, hi = visible_cols(w, row, n_block, seqlen_q, seqlen_k, window_left, window_right)
        hi = hi - col_offset
        lo = lo - col_offset
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            col = t0ScS[0, c][1]
            if const_expr(mask_left):
                s[r, c] = -Float32.inf if (col >= hi) | (col < lo) else s[r, c]
            else:
                s[r, c] = -Float32.inf if col >= hi else s[r, c]


@cute.jit
def apply_mask_row(
    s_row: cute.Tensor,  # (cols,) this thread's row of S, as tcgen05.ld (32x32b) delivers it
    tScS_row: cute.Tensor,  # (cols,) -> (row, col) in the tile, this thread
    t0ScS_row: cute.Tensor,  # the same for thread 0 (compile-time columns)
    w: cutlass.Constexpr[TileWindow],
    row,  # this thread's query row in the sequence
    n_block,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    mask_left: cutlass.Constexpr[bool] = False,
):
    """One row per thread (Blackwell): the same rule as ``apply_mask`` with one row's limits,
    computed once per thread (Note [Mask with constants])."""
    lo, hi = visible_cols(w, row, n_block, seqlen_q, seqlen_k, window_left, window_right)
    col_offset = tScS_row[0][1]
    hi = hi - col_offset
    lo = lo - col_offset
    for c in cutlass.range_constexpr(cute.size(s_row)):
        col = t0ScS_row[c][1]
        if const_expr(mask_left):
            s_row[c] = -Float32.inf if (col >= hi) | (col < lo) else s_row[c]
        else:
            s_row[c] = -Float32.inf if col >= hi else s_row[c]


# Note [Mask as bits]
# A wgmma accumulator gives a thread, per row, the columns 8 j + e (+ its own offset) for
# j = 0 .. cols/2 - 1 and e = 0, 1: increasing with the element index c = 2 j + e. So "column
# < hi" holds exactly for the first n(hi) elements, n(h) = 2 floor(h / 8) + min(h mod 8, 2), and
# a row's whole mask is one word: the low n bits set. Testing bit c of it (c a compile-time
# constant) is what ptxas turns into R2P, seven predicates per instruction, instead of one
# ISETP per element: 64 compares per masked step at tile_n = 128 become a handful of integer
# ops per row. Only the right edge (causal, seqlen_k); a left window keeps apply_mask.

BITS_PER_WORD = 32


def wgmma_column_rule(t0ScS) -> bool:
    """Whether thread 0's columns are 8 (c // 2) + c % 2, the layout Note [Mask as bits]
    relies on (checked when the kernel is traced)."""
    return all(t0ScS[0, c][1] == 8 * (c // 2) + c % 2 for c in range(cute.size(t0ScS, mode=[1])))


@cute.jit
def apply_mask_bits(
    acc_s: cute.Tensor,  # accumulator fragment of S for one (m_block, n_block)
    tScS: cute.Tensor,  # (rows, cols) -> (row, col) in the tile, this thread
    w: cutlass.Constexpr[TileWindow],
    m_block,
    n_block,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
):
    """``apply_mask`` without a left window, one bit word per row (Note [Mask as bits])."""
    s = acc_rows_cols(acc_s)
    cols = cute.size(s, mode=[1])
    col_offset = tScS[0, 0][1]
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = m_block * w.tile_m + tScS[r, 0][0]
        _, hi = visible_cols(w, row, n_block, seqlen_q, seqlen_k, window_left, window_right)
        h = cutlass.max(hi - col_offset, 0)
        n = cutlass.min(2 * (h // 8) + cutlass.min(h % 8, 2), cols)  # visible elements
        for word in cutlass.range_constexpr(cute.ceil_div(cols, BITS_PER_WORD)):
            first = word * BITS_PER_WORD
            n_word = cutlass.max(cutlass.min(n - first, BITS_PER_WORD), 0)
            # 64-bit shift: 1 << 32 is defined there, and the low 32 bits are the mask
            bits = cutlass.Uint32((cutlass.Int64(1) << cutlass.Int64(n_word)) - 1)
            for c in cutlass.range_constexpr(first, min(first + BITS_PER_WORD, cols)):
                keep = (bits & cutlass.Uint32(1 << (c - first))) != cutlass.Uint32(0)
                s[r, c] = s[r, c] if keep else -Float32.inf
