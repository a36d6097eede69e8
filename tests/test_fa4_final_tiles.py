"""fa4_final's tile arithmetic against brute force: which key tiles a query tile visits, which
of them need a mask, and the persistent tile order. Plain Python ints, no GPU."""

import itertools
import random

import pytest

from fa4_final.scheduler import rounds, tile_coords, tiles_of_cta, zigzag_tile
from fa4_final.tiles import TileWindow, kv_tile_range, visible_cols


def visible(i, j, sq, sk, causal, left, right):
    off = sk - sq
    if not 0 <= j < sk:
        return False
    if causal:
        right = 0
    if right is not None and j > i + off + right:
        return False
    return left is None or j >= i + off - left


def brute(w: TileWindow, m_block, sq, sk, causal, left, right):
    """(visited tiles, tiles needing a mask) by looking at every (row, key) of the tile."""
    rows = range(m_block * w.tile_m, (m_block + 1) * w.tile_m)
    n_tiles = -(-sk // w.tile_n)
    needed, partial = set(), set()
    for n in range(n_tiles):
        cols = range(n * w.tile_n, (n + 1) * w.tile_n)
        vis = [visible(i, j, sq, sk, causal, left, right) for i in rows for j in cols]
        if any(vis):
            needed.add(n)
            if not all(vis):
                partial.add(n)
    return needed, partial


CASES = [
    (128, 128, 1000, 1000, False, None, None), (128, 128, 1000, 1000, True, None, None),
    (64, 128, 300, 77, True, None, None), (128, 128, 77, 300, True, None, None),
    (192, 128, 1000, 4097, True, None, None), (128, 128, 4097, 1000, True, None, None),
    (128, 128, 1000, 1000, False, 100, 50), (128, 128, 700, 900, True, 37, None),
    (128, 128, 513, 513, False, None, 200), (128, 64, 2048, 2048, True, 300, None),
    (192, 128, 1, 1, False, None, None), (128, 128, 129, 129, True, 0, None),
]


@pytest.mark.parametrize("tm, tn, sq, sk, causal, left, right", CASES)
def test_kv_tile_range_matches_brute_force(tm, tn, sq, sk, causal, left, right):
    w = TileWindow(tm, tn, causal, has_left=left is not None,
                   has_right=right is not None and not causal)
    for m_block in range(-(-sq // tm)):
        n_min, n_max, top, bottom = kv_tile_range(w, m_block, sq, sk, left, right)
        needed, partial = brute(w, m_block, sq, sk, causal, left, right)
        visited = set(range(n_min, n_max))
        assert needed <= visited, (m_block, needed - visited)
        # visited tiles without visible keys only arise from rows past seqlen_q (padding rows)
        masked = set(range(n_max - top, n_max)) | set(range(n_min, n_min + bottom))
        assert partial <= masked, (m_block, sorted(partial - masked))
        assert top + bottom <= max(n_max - n_min, 0)


@pytest.mark.parametrize("tm, tn, sq, sk, causal, left, right", CASES)
def test_visible_cols_matches_the_rule(tm, tn, sq, sk, causal, left, right):
    w = TileWindow(tm, tn, causal, has_left=left is not None,
                   has_right=right is not None and not causal)
    rng = random.Random(0)
    for _ in range(200):
        i, n = rng.randrange(sq), rng.randrange(-(-sk // tn))
        lo, hi = visible_cols(w, i, n, sq, sk, left, right)
        for c in range(tn):
            assert (lo <= c < hi) == visible(i, n * tn + c, sq, sk, causal, left, right)


@pytest.mark.parametrize("m, h, b, group", [(5, 3, 2, None), (5, 3, 2, 2), (7, 4, 1, 4),
                                            (3, 5, 1, 2), (1, 1, 1, None)])
@pytest.mark.parametrize("longest_first", [False, True])
def test_tile_order_is_a_permutation(m, h, b, group, longest_first):
    tiles = [tile_coords(t, m, h, b, longest_first, group) for t in range(m * h * b)]
    assert sorted(tiles) == sorted(itertools.product(range(m), range(h), range(b)))
    if longest_first and group is None:  # longest first: m_block never increases
        assert all(x[0] >= y[0] for x, y in zip(tiles, tiles[1:]))


@pytest.mark.parametrize("num_tiles, grid", [(2048, 132), (10, 132), (133, 132), (264, 132),
                                             (1, 1), (7, 3)])
def test_persistent_ctas_cover_every_tile_once(num_tiles, grid):
    grid = min(grid, num_tiles)
    seen = [t for cta in range(grid) for t in tiles_of_cta(cta, grid, num_tiles)]
    assert sorted(seen) == list(range(num_tiles))
    assert all(zigzag_tile(r, c, grid) < grid * rounds(num_tiles, grid)
               for r in range(rounds(num_tiles, grid)) for c in range(grid))


def test_zigzag_balances_longest_first_causal_tiles():
    """The reason for the zigzag: causal tiles cost m_block + 1 steps; round robin hands the
    first CTA the longest tile of every round, zigzag pairs long with short."""
    m, h, grid = 128, 16, 132
    cost = lambda t: tile_coords(t, m, h, 1, True)[0] + 1  # noqa: E731
    n = m * h
    ideal = sum(cost(t) for t in range(n)) / grid
    zig = max(sum(cost(t) for t in tiles_of_cta(c, grid, n)) for c in range(grid))
    rr = max(sum(cost(t) for t in range(c, n, grid)) for c in range(grid))
    assert zig < 1.01 * ideal < rr / 1.04
