"""Masking scores in registers: keys past seqlen_k, right of the causal diagonal or outside a
sliding window get -inf before the softmax.

Note [Mask with constants]
A thread's column c inside a fragment is thread 0's column c (a compile-time constant) plus one
run-time offset per thread. So the offset moves into the row's limits once, and each element
costs one compare with a constant and one select (FSEL), not an index computation. A select, not
a branch: an ``if`` around the element would carry the whole fragment through the branch.
Tried on Hopper: a row's right edge as one bit word (a wgmma fragment's columns increase with the
element index, so "column < hi" holds for the first n elements and ptxas tests bit c with R2P,
seven predicates an instruction, instead of one ISETP per element). Far fewer instructions in
the masked steps, but the masked steps are few: timed on the H200 it was never faster beyond the
spread, and it was deleted.
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
