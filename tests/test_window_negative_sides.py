"""Windows of every sign, checked against an independent brute-force mask (utils.window):
the package's reading of ``causal`` and ``window_size``, the forward's and the backward's tile
ranges and per-row column limits, and the split tail's clipped ranges. Plain Python ints, no GPU.

In the FA4 package a negative window side is a bound (``(None, -w)``: keys at least w before the
diagonal), and only a window whose two sides are both negative means "no window"."""

import itertools
import random

import pytest
import torch

from fa4_final.common.bwd_tiles import (
    dq_turn,
    first_visitor,
    last_visitor,
    q_tile_range,
    visible_queries,
)
from fa4_final.common.tiles import TileWindow, clip_range, kv_tile_range, visible_cols
from fa4_final.runtime.checks import normalise_window
from utils.window import WINDOWS, fa4_sides, sees, visible_mask


def _package_window(tm, tn, causal, window):
    """(TileWindow, left, right) as the package builds them from a public call's arguments."""
    causal, left, right = normalise_window(causal, window)
    w = TileWindow(tm, tn, causal, has_left=left is not None,
                   has_right=right is not None and not causal)
    return w, left, right


def _shapes(n, seed, tiles_m=(64, 128, 192), tiles_n=(64, 128), longest=330):
    rng = random.Random(seed)
    for _ in range(n):
        yield (rng.choice(tiles_m), rng.choice(tiles_n), rng.randint(1, longest),
               rng.randint(1, longest), rng.random() < 0.3, rng.choice(WINDOWS))


@pytest.mark.parametrize("causal, window", itertools.product((False, True), WINDOWS))
def test_normalised_negative_window_keeps_exactly_the_pairs_fa4_keeps(causal, window):
    """normalise_window's sides, read as plain bounds, select the same (row, key) pairs as
    FA4's reading of the raw arguments, for three shapes (sq = sk, sq < sk, sq > sk)."""
    causal_n, left, right = normalise_window(causal, window)
    assert left == fa4_sides(causal, window)[0]
    for sq, sk in ((40, 40), (17, 53), (61, 9)):
        want = visible_mask(sq, sk, causal, window)
        got = visible_mask(sq, sk, causal_n, (left, right))
        assert torch.equal(got, want), (window, causal, sq, sk)


def test_only_both_negative_sides_mean_no_window():
    everything = visible_mask(30, 30, False, (None, None))
    assert torch.equal(visible_mask(30, 30, False, (-1, -1)), everything)
    assert torch.equal(visible_mask(30, 30, False, (-7, -2)), everything)
    # (None, -1): keys strictly before the diagonal; (-1, None): strictly after it
    before = visible_mask(30, 30, False, (None, -1))
    after = visible_mask(30, 30, False, (-1, None))
    assert not before.diagonal().any() and not after.diagonal().any()
    assert torch.equal(before | after | torch.eye(30, dtype=torch.bool), everything)
    assert not visible_mask(30, 30, False, (5, -6)).any()  # an empty window: no row sees a key


@pytest.mark.parametrize("seed", range(3))
def test_kv_tile_range_negative_window_brute_force(seed):
    """The forward visits every key tile holding a visible pair, and every tile it leaves
    unmasked is fully visible, for windows of every sign."""
    for tm, tn, sq, sk, causal, window in _shapes(60, seed):
        w, left, right = _package_window(tm, tn, causal, window)
        case = (tm, tn, sq, sk, causal, window)
        n_k = -(-sk // tn)
        for m in range(-(-sq // tm)):
            n_min, n_max, top, bottom = kv_tile_range(w, m, sq, sk, left, right)
            assert top + bottom <= max(n_max - n_min, 0), case
            rows = range(m * tm, min((m + 1) * tm, sq))
            for n in range(n_k):
                seen = [sees(i, j, sq, sk, causal, window)
                        for i in rows for j in range(n * tn, (n + 1) * tn)]
                inside = n_min <= n < n_max
                assert inside or not any(seen), (case, m, n, "a visible tile is skipped")
                unmasked = inside and n_min + bottom <= n < n_max - top
                assert not unmasked or all(seen), (case, m, n, "a partial tile is not masked")


@pytest.mark.parametrize("seed", range(2))
def test_visible_cols_negative_window_brute_force(seed):
    """The per-row column limits the mask compares with are exactly the oracle's pairs."""
    rng = random.Random(100 + seed)
    for tm, tn, sq, sk, causal, window in _shapes(80, seed):
        w, left, right = _package_window(tm, tn, causal, window)
        for _ in range(20):
            i, n = rng.randrange(sq), rng.randrange(-(-sk // tn))
            lo, hi = visible_cols(w, i, n, sq, sk, left, right)
            for c in range(tn):
                j = n * tn + c
                assert (lo <= c < hi and j < sk) == sees(i, j, sq, sk, causal, window), (
                    tm, tn, sq, sk, causal, window, i, j)


@pytest.mark.parametrize("seed", range(2))
def test_clip_range_negative_window_masks_every_partial_tile(seed):
    """Every piece of a tile's key range (the split tail) keeps its partial tiles masked."""
    for tm, tn, sq, sk, causal, window in _shapes(30, seed, longest=260):
        w, left, right = _package_window(tm, tn, causal, window)
        for m in range(-(-sq // tm)):
            n_min, n_max, top, bottom = kv_tile_range(w, m, sq, sk, left, right)
            rows = range(m * tm, min((m + 1) * tm, sq))
            partial = {n for n in range(n_min, n_max)
                       if not all(sees(i, j, sq, sk, causal, window)
                                  for i in rows for j in range(n * tn, (n + 1) * tn))}
            for lo in range(n_min, n_max):
                for hi in range(lo + 1, n_max + 1):
                    a, b, t, u = clip_range(n_min, n_max, top, bottom, lo, hi)
                    masked = set(range(b - t, b)) | set(range(a, a + u))
                    assert partial & set(range(a, b)) <= masked, (window, m, lo, hi)


@pytest.mark.parametrize("seed", range(3))
def test_q_tile_range_negative_window_brute_force(seed):
    """The backward: each key tile visits every query tile holding a visible pair, leaves only
    fully visible tiles unmasked, and the deterministic dQ turns stay a permutation."""
    rng = random.Random(200 + seed)
    for _ in range(60):
        tm, tn = rng.choice([16, 64, 80, 128]), rng.choice([32, 128])
        sq, sk = rng.randint(1, 260), rng.randint(1, 260)
        causal, window = rng.random() < 0.3, rng.choice(WINDOWS)
        w, left, right = _package_window(tm, tn, causal, window)
        case = (tm, tn, sq, sk, causal, window)
        n_q, n_k = -(-sq // tm), -(-sk // tn)
        visitors = {}
        for n in range(n_k):
            m_min, m_max, n_first, n_last = q_tile_range(w, n, sq, sk, left, right)
            assert 0 <= m_min <= m_max <= n_q and n_first + n_last <= m_max - m_min, case
            keys = range(n * tn, min((n + 1) * tn, sk))
            for m in range(n_q):
                rows = range(m * tm, min((m + 1) * tm, sq))
                seen = [sees(i, j, sq, sk, causal, window) for i in rows for j in keys]
                inside = m_min <= m < m_max
                assert inside or not any(seen), (case, n, m)
                if inside:
                    visitors.setdefault(m, []).append(n)
                    if n_first <= m - m_min < m_max - m_min - n_last:
                        assert all(seen), (case, n, m)
        for m, ns in visitors.items():
            assert ns == list(range(ns[0], ns[-1] + 1)), (case, m, ns)
            assert first_visitor(w, m, sq, sk, left) == ns[0], (case, m)
            if w.masks_right:
                assert last_visitor(w, m, n_k, sq, sk, right) == ns[-1], (case, m)
            turns = sorted(dq_turn(w, n, m, n_k, sq, sk, left, right) for n in ns)
            assert turns == list(range(len(ns))), (case, m)


def test_visible_queries_negative_window_brute_force():
    rng = random.Random(7)
    for _ in range(150):
        sq, sk = rng.randint(1, 90), rng.randint(1, 90)
        causal, window = rng.random() < 0.3, rng.choice(WINDOWS)
        w, left, right = _package_window(64, 64, causal, window)
        for key in range(sk + 2):
            lo, hi = visible_queries(w, key, sq, sk, left, right)
            for i in range(sq):
                assert (lo <= i < hi) == sees(i, key, sq, sk, causal, window), (
                    sq, sk, causal, window, key, i)
