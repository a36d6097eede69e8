"""fa4_final's tile arithmetic against brute force: which key tiles a query tile visits, which
of them need a mask, and the persistent tile order. Plain Python ints, no GPU."""

import itertools
import random

import pytest

from fa4_final.scheduler import (
    TILE_OVERHEAD_STEPS,
    list_schedule,
    rounds,
    table_rounds,
    tile_coords,
    tile_table,
    tiles_of_cta,
    zigzag_tile,
)
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


# ----------------------------------------------------------------------------------------------
# the tile table (Note [Tile table]): list scheduling over the sectioned causal order


@pytest.mark.parametrize("costs, grid", [([5, 3, 3, 2, 2, 1], 2), ([1] * 10, 3), ([7], 4),
                                         ([4, 4, 1, 1, 1, 1, 1, 1], 3)])
def test_tile_table_holds_every_tile_once_in_each_ctas_order(costs, grid):
    table = tile_table(costs, grid)
    n = len(costs)
    assert len(table) % grid == 0 and table[-grid:] == [n] * grid  # the sentinel row
    assert sorted(t for t in table if t < n) == list(range(n))
    for cta in range(grid):
        mine = [table[r * grid + cta] for r in range(table_rounds(len(table), grid))]
        mine = [t for t in mine if t < n]
        assert mine == sorted(mine)  # a CTA's tiles in the order of the tile sequence
        # once a CTA has no tile left, it has none in any later round
        col = [table[r * grid + cta] for r in range(len(table) // grid)]
        assert col == mine + [n] * (len(col) - len(mine))


def test_list_schedule_is_greedy_and_within_the_list_scheduling_bound():
    costs = [random.Random(3).randint(1, 40) for _ in range(500)]
    grid = 17
    per_cta = list_schedule(costs, grid)
    loads = [sum(costs[t] for t in ts) for ts in per_cta]
    # Graham's bound for list scheduling: makespan <= mean load + the largest single cost
    assert max(loads) <= sum(costs) / grid + max(costs)


@pytest.mark.parametrize("d, seqlen, heads, batch", [(64, 16384, 16, 1), (128, 4096, 16, 4),
                                                     (128, 16384, 16, 1)])
def test_the_table_balances_causal_sections_that_zigzag_does_not(d, seqlen, heads, batch):
    """The reason for the table: in sections of heads that fit L2 the causal costs are a
    saw-tooth, which fixed zigzag rounds balance poorly and list scheduling well."""
    from dataclasses import replace

    from fa4_final.config import hopper_fwd_default
    from fa4_final.hopper.launch import l2_section_pairs, tile_costs

    cfg = replace(hopper_fwd_default(d, True), l2_sections=True, tile_table=True)
    group = l2_section_pairs(seqlen, d, 2, heads * batch)
    costs = tile_costs(cfg, True, seqlen, seqlen, heads, batch, group)
    grid = 132
    ideal = sum(costs) / grid
    zig = max(sum(costs[t] for t in tiles_of_cta(c, grid, len(costs))) for c in range(grid))
    table = max(sum(costs[t] for t in ts) for ts in list_schedule(costs, grid))
    assert table < 1.01 * ideal
    assert zig > 1.04 * ideal


@pytest.mark.parametrize("tm, tn, sq, sk, causal, left, right", CASES)
def test_tile_costs_count_the_visited_key_tiles(tm, tn, sq, sk, causal, left, right):
    from fa4_final.config import HopperFwdConfig
    from fa4_final.hopper.launch import tile_costs

    cfg = HopperFwdConfig(num_consumer_wgs=tm // 64 if tm % 64 == 0 else 2, tile_n=tn)
    if cfg.tile_m != tm:
        pytest.skip("tile_m is 64 per consumer warpgroup")
    heads, batch = 2, 1
    w = TileWindow(tm, tn, causal, left is not None, right is not None and not causal)
    costs = tile_costs(cfg, causal, sq, sk, heads, batch, None if not causal else heads * batch,
                       left, right)
    m_blocks = -(-sq // tm)
    for t, cost in enumerate(costs):
        m_block = tile_coords(t, m_blocks, heads, batch, causal, heads * batch)[0]
        needed, _ = brute(w, m_block, sq, sk, causal, left, right)
        assert cost == len(needed) + TILE_OVERHEAD_STEPS
