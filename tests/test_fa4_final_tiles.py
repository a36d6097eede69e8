"""fa4_final's tile arithmetic against brute force: which key tiles a query tile visits, which
of them need a mask, and the persistent tile order. Plain Python ints, no GPU."""

import itertools
import random

import pytest

from fa4_final.common.schedule import (
    TILE_OVERHEAD_STEPS,
    list_schedule,
    rounds,
    table_rounds,
    tile_coords,
    tile_table,
    tiles_of_cta,
    zigzag_tile,
)
from fa4_final.common.tiles import TileWindow, kv_tile_range, visible_cols


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

    from fa4_final.hopper.config import hopper_fwd_default
    from fa4_final.hopper.host import l2_section_pairs, tile_costs

    cfg = replace(hopper_fwd_default(d, True), l2_sections=True, schedule="table")
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
    from types import SimpleNamespace

    from fa4_final.hopper.host import tile_costs

    cfg = SimpleNamespace(tile_m=tm, tile_n=tn)  # what tile_costs reads of a config
    heads, batch = 2, 1
    w = TileWindow(tm, tn, causal, left is not None, right is not None and not causal)
    costs = tile_costs(cfg, causal, sq, sk, heads, batch, None if not causal else heads * batch,
                       left, right)
    m_blocks = -(-sq // tm)
    for t, cost in enumerate(costs):
        m_block = tile_coords(t, m_blocks, heads, batch, causal, heads * batch)[0]
        needed, _ = brute(w, m_block, sq, sk, causal, left, right)
        assert cost == len(needed) + TILE_OVERHEAD_STEPS


# ----------------------------------------------------------------------------------------------
# the split tail (Note [Split tail]): the last round's tiles cut along the keys


def _pieces_by_tile(items):
    by_tile = {}
    for cta, its in enumerate(items):
        for tile, lo, hi, slot, first, count in its:
            by_tile.setdefault(tile, []).append((cta, lo, hi, slot, first, count))
    return by_tile


@pytest.mark.parametrize("num_tiles, steps, grid", [(2048, 32, 132), (1376, 86, 132),
                                                    (1408, 32, 132), (16, 33, 132),
                                                    (36, 5, 132), (8, 2, 132), (264, 32, 132),
                                                    (133, 40, 132), (7, 100, 3)])
def test_split_tail_covers_every_key_tile_of_every_tile_once(num_tiles, steps, grid):
    from fa4_final.common.schedule import (
        MIN_PIECE_STEPS,
        SPLIT_OVERHEAD_STEPS,
        WHOLE_TILE_KEYS,
        split_tail_items,
    )

    items, slots = split_tail_items(num_tiles, steps, grid)
    by_tile = _pieces_by_tile(items)
    assert sorted(by_tile) == list(range(num_tiles))
    used_slots = []
    for pieces in by_tile.values():
        if len(pieces) == 1:  # whole
            assert pieces[0][1:] == (0, WHOLE_TILE_KEYS, -1, 0, 0)
            continue
        keys = sorted(k for _, lo, hi, *_ in pieces for k in range(lo, hi))
        assert keys == list(range(steps))  # every key tile once
        firsts = {p[4] for p in pieces}
        counts = {p[5] for p in pieces}
        assert counts == {len(pieces)} and len(firsts) == 1
        mine = sorted(p[3] for p in pieces)
        assert mine == list(range(firsts.pop(), mine[0] + len(pieces)))  # consecutive slots
        assert all(hi - lo >= 1 for _, lo, hi, *_ in pieces)
        used_slots += mine
    assert sorted(used_slots) == list(range(slots))
    # a CTA computes at most two pieces, after its whole tiles
    for its in items:
        kinds = [slot >= 0 for _, _, _, slot, _, _ in its]
        assert sum(kinds) <= 2 and kinds == sorted(kinds)

    def span(its):
        return sum(steps if slot < 0 else hi - lo + SPLIT_OVERHEAD_STEPS
                   for _, lo, hi, slot, _, _ in its)

    unsplit = -(-num_tiles // grid) * steps
    makespan = max(span(its) for its in items)
    assert makespan <= unsplit  # the host splits only when the model says it pays
    if slots:
        longest = max(hi - lo for its in items for _, lo, hi, slot, _, _ in its if slot >= 0)
        assert longest <= -(-(num_tiles % grid) * steps // grid) + 1 or longest >= MIN_PIECE_STEPS


def test_split_tail_cuts_the_last_round_of_2048_tiles_on_132_sms():
    """The case it is for: 15 full rounds and 68 tiles more; cut, every CTA's last work is
    16 or 17 key tiles (plus the overhead of its one or two pieces) instead of 32 or none."""
    from fa4_final.common.schedule import split_tail_items

    items, slots = split_tail_items(2048, 32, 132)
    assert all(sum(slot < 0 for _, _, _, slot, _, _ in its) == 15 for its in items)
    tails = [sum(hi - lo for _, lo, hi, slot, _, _ in its if slot >= 0) for its in items]
    assert set(tails) == {16, 17} and sum(tails) == 68 * 32
    assert 132 <= slots <= 2 * 132


def test_split_tail_leaves_full_rounds_and_short_tiles_whole():
    from fa4_final.common.schedule import split_tail_items

    assert split_tail_items(264, 32, 132)[1] == 0  # two full rounds: nothing to balance
    assert split_tail_items(8, 2, 132)[1] == 0  # pieces shorter than their overhead
    assert split_tail_items(131, 32, 132)[1] == 0  # 131 of 132 busy: cutting costs more


def test_the_split_table_has_whole_entries_for_causal_and_windowed_shapes():
    """With split_tail the kernel reads six fields per entry; causal costs differ per tile,
    so the table is the list schedule's, every entry a whole tile."""
    from dataclasses import replace

    from fa4_final.common.schedule import SPLIT_FIELDS, WHOLE_TILE_KEYS
    from fa4_final.hopper.config import hopper_fwd_default
    from fa4_final.hopper.host import host_table

    cfg = replace(hopper_fwd_default(128, True), schedule="split_tail")
    plain = replace(cfg, schedule="table")
    flat, slots = host_table(cfg, True, 4096, 4096, 16, 4, 4, 132)
    want, _ = host_table(plain, True, 4096, 4096, 16, 4, 4, 132)
    assert slots == 0 and flat[::SPLIT_FIELDS] == want
    assert set(zip(*[flat[f::SPLIT_FIELDS] for f in range(1, SPLIT_FIELDS)])) == {
        (0, WHOLE_TILE_KEYS, -1, 0, 0)}
    nc = replace(hopper_fwd_default(128, False), schedule="split_tail")
    flat, slots = host_table(nc, False, 4096, 4096, 16, 4, 64, 132)
    assert slots > 0 and len(flat) % (SPLIT_FIELDS * 132) == 0


@pytest.mark.parametrize("tm, tn, sq, sk, causal, left, right", CASES)
def test_a_clipped_range_masks_exactly_the_tiles_brute_force_says(tm, tn, sq, sk, causal, left,
                                                                   right):
    """clip_range: every piece [lo, hi) of a tile's key range keeps kv_tile_range's promise,
    its first n_top and last n_bottom visits hold every tile that needs a mask."""
    from fa4_final.common.tiles import clip_range

    w = TileWindow(tm, tn, causal, has_left=left is not None,
                   has_right=right is not None and not causal)
    for m_block in range(-(-sq // tm)):
        n_min, n_max, top, bottom = kv_tile_range(w, m_block, sq, sk, left, right)
        visited, partial = brute(w, m_block, sq, sk, causal, left, right)
        for lo in range(n_min, n_max):
            for hi in range(lo + 1, n_max + 1):
                a, b, t, u = clip_range(n_min, n_max, top, bottom, lo, hi)
                assert (a, b) == (lo, hi)
                order = list(range(b - 1, a - 1, -1))  # visit order, highest first
                assert 0 <= t <= len(order) and 0 <= u <= len(order)
                masked = set(order[:t]) | set(order[len(order) - u:])
                assert partial & set(order) <= masked
