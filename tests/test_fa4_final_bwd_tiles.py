"""fa4_final.common.bwd_tiles on Python ints against brute force: every (query tile, key tile) pair
with a visible score is visited, the steps left unmasked are fully visible, the visitors of a
query tile are contiguous, and the deterministic turns are a permutation that only waits for
CTAs launched earlier."""

import random

import pytest

from fa4_final.common.bwd_tiles import (
    dq_turn,
    first_visitor,
    last_visitor,
    launch_order_reversed,
    q_tile_range,
)
from fa4_final.common.tiles import TileWindow


def _visible(i, j, sq, sk, causal, left, right):
    off = sk - sq
    if not (0 <= i < sq and 0 <= j < sk):
        return False
    right = 0 if causal else right
    if right is not None and j > i + off + right:
        return False
    return not (left is not None and j < i + off - left)


def _cases(n, seed, max_len=300):
    """n random (tile_m, tile_n, seqlen_q, seqlen_k, causal, window_left, window_right)."""
    rng = random.Random(seed)
    for _ in range(n):
        causal = rng.random() < 0.4
        left = rng.choice([None, None, 0, 3, 17, 100])
        right = None if causal else rng.choice([None, None, 0, 5, 40])
        yield (rng.choice([16, 64, 80, 128]), rng.choice([32, 128]), rng.randint(1, max_len),
               rng.randint(1, max_len), causal, left, right)


@pytest.mark.parametrize("seed", range(4))
def test_ranges_cover_every_visible_pair_and_masks_are_safe(seed):
    for tm, tn, sq, sk, causal, left, right in _cases(150, seed):
        w = TileWindow(tm, tn, causal, has_left=left is not None,
                       has_right=right is not None and not causal)
        n_q, n_k = -(-sq // tm), -(-sk // tn)
        case = (tm, tn, sq, sk, causal, left, right)
        visitors = {}
        for n in range(n_k):
            m_min, m_max, n_first, n_last = q_tile_range(w, n, sq, sk, left, right)
            assert 0 <= m_min <= m_max <= n_q and n_first + n_last <= m_max - m_min, case
            keys = range(n * tn, min((n + 1) * tn, sk))
            for m in range(n_q):
                rows = range(m * tm, min((m + 1) * tm, sq))
                seen = [_visible(i, j, sq, sk, causal, left, right) for i in rows for j in keys]
                inside = m_min <= m < m_max
                assert inside or not any(seen), (case, n, m)
                if inside:
                    visitors.setdefault(m, []).append(n)
                    step = m - m_min
                    if n_first <= step < m_max - m_min - n_last:
                        assert all(seen), (case, n, m, "left unmasked but not fully visible")
        for m, ns in visitors.items():
            assert ns == list(range(ns[0], ns[-1] + 1)), (case, m, ns)
            assert first_visitor(w, m, sq, sk, left) == ns[0], (case, m)
            if w.masks_right:
                assert last_visitor(w, m, n_k, sq, sk, right) == ns[-1], (case, m)
            turns = [dq_turn(w, n, m, n_k, sq, sk, left, right) for n in ns]
            assert sorted(turns) == list(range(len(ns))), (case, m, turns)
            launch = {n: (n_k - 1 - n if launch_order_reversed(w) else n) for n in ns}
            for n, t in zip(ns, turns):
                assert all(launch[n2] < launch[n] for n2, t2 in zip(ns, turns) if t2 < t)


def test_causal_turns_follow_arrival():
    # causal: the key tile on the diagonal reaches a query tile first, so it adds first
    w = TileWindow(64, 128, True)
    sq = sk = 1024
    m = 10
    ns = [n for n in range(8) if q_tile_range(w, n, sq, sk)[0] <= m]
    arrival = {n: m - q_tile_range(w, n, sq, sk)[0] for n in ns}
    order = sorted(ns, key=lambda n: dq_turn(w, n, m, 8, sq, sk))
    assert [arrival[n] for n in order] == sorted(arrival.values())
