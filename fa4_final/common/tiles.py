"""Which key tiles a query tile visits, and which of them need a per-element mask.

Plain arithmetic on purpose: kernels call these functions on run-time ``Int32`` values while they
are traced, and the CPU tests call them on Python ints and compare with brute force.

Visibility (FlashAttention's convention, bottom-right aligned when seqlen_q != seqlen_k): with
``offset = seqlen_k - seqlen_q``, query row i sees key j when 0 <= j < seqlen_k and
    i + offset - window_left <= j <= i + offset + window_right.
Causal is window_right = 0 with no left bound; no window at all is both bounds absent (None).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else cutlass.min(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else cutlass.max(a, b)


def _floor_div_nonneg(a, b: int):
    """floor(a / b) for a >= 0 (device integer division truncates, so callers clamp first)."""
    return a // b


def _ceil_div_nonneg(a, b: int):
    if isinstance(a, int):
        return -(-a // b)
    import cutlass.cute as cute

    return cute.ceil_div(a, b)


@dataclass(frozen=True)
class TileWindow:
    """The static part of the visibility rule: tile sizes and which bounds exist."""

    tile_m: int
    tile_n: int
    causal: bool = False
    has_left: bool = False  # a finite window_left (sliding-window attention)
    has_right: bool = False  # a finite window_right other than causal's 0

    @property
    def masks_right(self) -> bool:
        return self.causal or self.has_right

    def right_bound(self, window_right):
        return 0 if self.causal else window_right


def kv_tile_range(w: TileWindow, m_block, seqlen_q, seqlen_k, window_left=None,
                  window_right=None):
    """(n_min, n_max, n_top_masked, n_bottom_masked) for query tile ``m_block``.

    Tiles n_min .. n_max - 1 are visited, from n_max - 1 down to n_min. The first
    ``n_top_masked`` visited (the highest) can hold keys past seqlen_k or right of a row's window
    (causal: above the diagonal); the last ``n_bottom_masked`` can hold keys left of a row's
    window. The tiles between need no mask at all. n_max <= n_min means nothing is visited (a
    causal tile whose rows all precede the keys when seqlen_q > seqlen_k)."""
    offset = seqlen_k - seqlen_q
    n_max = _ceil_div_nonneg(seqlen_k, w.tile_n)
    # the tile's first and last rows bound what any of its rows sees
    first_row = m_block * w.tile_m
    last_row = first_row + w.tile_m - 1
    # keys of the tile's whole row range that pass the right bound: j <= last_row + offset + wr
    full_right = seqlen_k // w.tile_n  # tiles with no key past seqlen_k
    if w.masks_right:
        wr = w.right_bound(window_right)
        right_end = _max(last_row + offset + wr + 1, 0)  # one past the last visible key
        n_max = _min(n_max, _ceil_div_nonneg(right_end, w.tile_n))
        # a tile is free of right masking when even the first row sees all of it
        first_end = _max(first_row + offset + wr + 1, 0)
        full_right = _min(full_right, _floor_div_nonneg(first_end, w.tile_n))
    n_min = 0
    full_left = 0
    if w.has_left:
        left_start = _max(first_row + offset - window_left, 0)  # first key the first row sees
        n_min = _floor_div_nonneg(left_start, w.tile_n)
        # a tile is free of left masking when even the last row sees all of it
        last_start = _max(last_row + offset - window_left, 0)
        full_left = _ceil_div_nonneg(last_start, w.tile_n)
    if not w.has_left:  # n_min = 0 <= every count above: no clamp to spend registers on
        return 0, n_max, n_max - _min(full_right, n_max), 0
    n_max = _max(n_max, n_min)
    n_top_masked = n_max - _min(_max(full_right, n_min), n_max)
    bottom_end = _min(_max(full_left, n_min), n_max - n_top_masked)
    n_bottom_masked = bottom_end - n_min
    return n_min, n_max, n_top_masked, n_bottom_masked



def clip_range(n_min, n_max, n_top, n_bottom, n_lo, n_hi):
    """kv_tile_range's result restricted to the key tiles n_lo <= n < n_hi (a piece of a tile
    cut along the keys, Note [Split tail] in common.schedule). The masked tiles stay the first
    and last visited: the top ones are the piece's top ones, the bottom ones its bottom ones,
    each count less what the cut removed. An empty piece has n_max <= n_min."""
    lo, hi = _max(n_min, n_lo), _min(n_max, n_hi)
    size = _max(hi - lo, 0)
    top = _min(_max(n_top - (n_max - hi), 0), size)
    bottom = _min(_max(n_bottom - (lo - n_min), 0), size)
    return lo, hi, top, bottom

def visible_cols(w: TileWindow, row, n_block, seqlen_q, seqlen_k, window_left=None,
                 window_right=None):
    """(lo, hi): query ``row`` (index in the sequence) sees the columns lo <= c < hi of key tile
    ``n_block`` (columns counted inside the tile). Without a left window lo is a large negative
    number, so a comparison with it is always true."""
    base = n_block * w.tile_n
    offset = seqlen_k - seqlen_q
    hi = seqlen_k - base
    if w.masks_right:
        hi = _min(hi, row + offset + w.right_bound(window_right) + 1 - base)
    lo = -(1 << 30)
    if w.has_left:
        lo = row + offset - window_left - base
    return lo, hi
