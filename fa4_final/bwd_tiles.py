"""Which query tiles a key tile's backward visits, which of them need a mask, and the fixed turn
order of the deterministic dQ accumulation. The backward's mirror of ``fa4_final.tiles``.

Note [Turn order]
In the deterministic mode the key tiles that visit query tile m add their dQ parts one after the
other, in a fixed order. The order decides the speed: a key tile that arrives at m before its
turn waits. With a causal diagonal (or any right window) key tile n reaches m after m - m_min(n)
steps and m_min grows with n, so the highest key tile arrives first: turns go downwards, from
last_visitor(m). Without one every key tile starts at m = 0 and any order makes a staircase;
turns go upwards, from first_visitor(m). A CTA may only wait for CTAs launched before it (a
waiting CTA holds its SM; one that cannot launch would never come): the kernel numbers its
CTAs so that turns follow launch order (``launch_order_reversed``).

Same visibility rule (FlashAttention's, bottom-right aligned): with offset = seqlen_k - seqlen_q,
query i sees key j when 0 <= j < seqlen_k and i + offset - window_left <= j <= i + offset +
window_right, i.e. for a fixed key j the queries
    j - offset - window_right  <=  i  <=  j - offset + window_left.
Plain arithmetic on purpose (kernels call it on ``Int32`` values while traced; the CPU tests on
Python ints against brute force). Rows past seqlen_q in the last query tile are padding that the
kernel makes harmless (their lse is +inf, so P = 0): the ranges may count them as visible.
"""

from __future__ import annotations

import cutlass

from fa4_final.tiles import TileWindow


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else cutlass.min(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else cutlass.max(a, b)


def q_tile_range(w: TileWindow, n_block, seqlen_q, seqlen_k, window_left=None,
                 window_right=None):
    """(m_min, m_max, n_first_masked, n_last_masked) for key tile ``n_block``.

    Query tiles m_min .. m_max - 1 are visited in increasing order; m_min == m_max means none
    (keys that no query sees: their dK and dV are zero). The first ``n_first_masked`` visited
    can hold pairs right of a row's window (causal: above the diagonal); the last
    ``n_last_masked`` can hold pairs left of it. The tiles between need no mask. Keys past
    seqlen_k (the last key tile) are not counted here: the kernel masks every step of that tile.
    """
    offset = seqlen_k - seqlen_q
    num_m = (seqlen_q + w.tile_m - 1) // w.tile_m
    first_key = n_block * w.tile_n
    last_key = _min(first_key + w.tile_n, seqlen_k) - 1
    m_min = 0
    full_right = 0  # first query tile whose every row sees every key of the tile on the right
    if w.masks_right:
        wr = w.right_bound(window_right)
        first_row = _max(first_key - offset - wr, 0)  # the first query that sees first_key
        m_min = _min(first_row // w.tile_m, num_m)
        full_row = _max(last_key - offset - wr, 0)  # from here on rows see last_key too
        full_right = (full_row + w.tile_m - 1) // w.tile_m
    m_max = num_m
    full_left = num_m  # one past the last query tile free of left masking
    if w.has_left:
        last_row = last_key - offset + window_left  # the last query that sees last_key
        m_max = _min((_max(last_row, -1) + w.tile_m) // w.tile_m, num_m)
        # a tile is free of left masking when its last row still sees first_key
        full_left = _max(first_key - offset + window_left + 1, 0) // w.tile_m
    m_max = _max(m_max, m_min)
    n_first = _min(_max(full_right, m_min), m_max) - m_min
    n_last = m_max - _max(_min(full_left, m_max), m_min + n_first)
    return m_min, m_max, n_first, n_last


def visible_queries(w: TileWindow, key, seqlen_q, seqlen_k, window_left=None,
                    window_right=None, big=1 << 30):
    """(lo, hi): key ``key`` is seen by the queries lo <= i < hi (the rule of the module
    docstring; ``big`` stands for an unbounded side). A key past seqlen_k is seen by none. The
    backward kernels hold one key per accumulator row and compare these with query columns."""
    offset = seqlen_k - seqlen_q
    lo = -big
    hi = big
    if w.masks_right:
        lo = key - offset - w.right_bound(window_right)
    if w.has_left:
        hi = key - offset + window_left + 1
    # a key past seqlen_k is seen by no query: hi = -big (arithmetic, no run-time branch, so
    # the kernels may call this on traced values)
    inside = _min(_max(seqlen_k - key, 0), 1)
    hi = _min(hi, (2 * inside - 1) * big)
    return lo, hi


def first_visitor(w: TileWindow, m_block, seqlen_q, seqlen_k, window_left=None):
    """The lowest key tile whose ``q_tile_range`` contains query tile ``m_block`` (no left window:
    0, every key tile reaches the last rows). Key tiles first_visitor .. n all visit m_block
    when n does, so in the deterministic mode key tile n adds its dQ to m_block as turn
    n - first_visitor (Note [Turns] of fa4_final.hopper.bwd)."""
    if not w.has_left:
        return 0
    offset = seqlen_k - seqlen_q
    # key tile n reaches m_block when its last key is seen by the tile's first row:
    # last_key(n) >= m_block * tile_m + offset - window_left
    need = m_block * w.tile_m + offset - window_left
    return _max(need, 0) // w.tile_n


def last_visitor(w: TileWindow, m_block, num_n_blocks, seqlen_q, seqlen_k, window_right=None):
    """The highest key tile whose ``q_tile_range`` contains query tile ``m_block`` (-1 if none):
    the last n with m_min(n) <= m_block."""
    if not w.masks_right:
        return num_n_blocks - 1
    offset = seqlen_k - seqlen_q
    reach = (m_block + 1) * w.tile_m - 1 + offset + w.right_bound(window_right)
    return _min(_max(reach + w.tile_n, 0) // w.tile_n - 1, num_n_blocks - 1)


def launch_order_reversed(w: TileWindow) -> bool:
    """Whether the deterministic kernel numbers key tiles from the last: its turns go downwards
    (Note [Turn order]), so the CTAs waited for must be launched first."""
    return w.masks_right


def dq_turn(w: TileWindow, n_block, m_block, num_n_blocks, seqlen_q, seqlen_k,
            window_left=None, window_right=None):
    """Key tile ``n_block``'s turn (0 = first) among the key tiles that add to query tile
    ``m_block``'s dQ in the deterministic mode (Note [Turn order])."""
    if launch_order_reversed(w):
        return last_visitor(w, m_block, num_n_blocks, seqlen_q, seqlen_k, window_right) - n_block
    return n_block - first_visitor(w, m_block, seqlen_q, seqlen_k, window_left)
