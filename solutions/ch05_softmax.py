"""The online-softmax step of chapter 05's Hopper kernel, and views of wgmma register fragments.

A consumer warpgroup computes S = Q K^T for 64 query rows x tile_n keys with one wgmma; each of its
128 threads then holds 2 rows x (tile_n / 4) columns of S (rows r and r + 8 of an 8-row band,
two adjacent columns out of every 8). The four threads of a quad share a row, so a row's max and
sum need a reduction over those 4 lanes only.

The code lives in the fa4_final package, written once for every kernel of the course:
``fa4_final.common.softmax.OnlineSoftmax`` (the step, with chapter 06's exp2 share and chapter 07's
rescale threshold as compile-time knobs, Note [Warp vote] there), ``fa4_final.common.fragments``
(``acc_rows_cols``, ``acc_as_a_operand``, ``tree_reduce``) and ``fa4_final.common.constants``. This
module names them for chapter 05 and adds the one number only this chapter needs.
"""

from fa4_final.common.constants import LN_2, LOG2_E
from fa4_final.common.fragments import THREADS_PER_ROW, acc_as_a_operand, acc_rows_cols, tree_reduce
from fa4_final.common.softmax import EMULATION_DEGREE, EMULATION_PERIOD, OnlineSoftmax

# Rows one warp owns in a wgmma accumulator: 8 quads x 2 rows (r and r + 8). The warp vote of
# chapter 07 decides for these 16 consecutive query rows together.
ROWS_PER_WARP = 16

__all__ = ["EMULATION_DEGREE", "EMULATION_PERIOD", "LN_2", "LOG2_E", "ROWS_PER_WARP",
           "THREADS_PER_ROW", "OnlineSoftmax", "acc_as_a_operand", "acc_rows_cols",
           "tree_reduce"]
