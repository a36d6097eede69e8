"""Note [dQ copies] (fa4_final.common.bwd_tiles) on Python ints against brute force: with C
accumulator copies, for every query tile the visitors of each copy take turns 0 .. k - 1 exactly
once, every wait is on a CTA of the same copy launched earlier, and the slabs of a tile's copies
are a contiguous run that no other tile's overlaps; HopperBwdConfig's checks of the knobs."""

import random

import pytest

from fa4_final.common.bwd_tiles import (
    copy_visited,
    dq_accum_tile,
    dq_accum_tiles,
    dq_copy_turn,
    dq_slab,
    dq_turn,
    launch_order_reversed,
    q_tile_range,
)
from fa4_final.common.tiles import TileWindow
from fa4_final.hopper.config import HopperBwdConfig
from tests.test_fa4_final_bwd_tiles import _cases as bwd_tile_cases


def _cases(n, seed):
    return bwd_tile_cases(n, seed, max_len=700)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("copies", [1, 2, 3, 4, 8])
def test_each_copy_takes_every_turn_once_and_waits_only_on_earlier_ctas(seed, copies):
    for tm, tn, sq, sk, causal, left, right in _cases(120, seed):
        w = TileWindow(tm, tn, causal, has_left=left is not None,
                       has_right=right is not None and not causal)
        n_k = -(-sk // tn)
        case = (tm, tn, sq, sk, causal, left, right, copies)
        visitors = {}
        for n in range(n_k):
            m_min, m_max, _, _ = q_tile_range(w, n, sq, sk, left, right)
            for m in range(m_min, m_max):
                visitors.setdefault(m, []).append(n)
        launch = {n: (n_k - 1 - n if launch_order_reversed(w) else n) for n in range(n_k)}
        for m, ns in visitors.items():
            by_copy = {}
            for n in ns:
                c, t = dq_copy_turn(w, n, m, n_k, sq, sk, left, right, copies)
                assert c == n % copies, (case, m, n)
                by_copy.setdefault(c, []).append((t, n))
            for c, turns in by_copy.items():
                assert sorted(t for t, _ in turns) == list(range(len(turns))), (case, m, c)
                order = [n for _, n in sorted(turns)]
                # turn t waits for turn t - 1 of its copy: launched before it
                assert all(launch[a] < launch[b] for a, b in zip(order, order[1:])), \
                    (case, m, c, order)
            if copies == 1:
                assert all(dq_copy_turn(w, n, m, n_k, sq, sk, left, right)
                           == (0, dq_turn(w, n, m, n_k, sq, sk, left, right)) for n in ns)


@pytest.mark.parametrize("copies", [1, 2, 4, 5])
def test_copy_slabs_are_one_run_per_tile_and_never_overlap(copies):
    # dense: tiles 0 .. n_q - 1; varlen: each sequence's tiles from dq_accum_tile, all within
    # dq_accum_tiles * copies slabs
    rng = random.Random(copies)
    for _ in range(50):
        tile_m = rng.choice([64, 80, 128])
        lens = [rng.randint(0, 500) for _ in range(rng.randint(1, 6))]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        owner = {}
        for b, n in enumerate(lens):
            for m in range(-(-n // tile_m)):
                m_pad = dq_accum_tile(cu[b], b, tile_m) + m
                run = [dq_slab(m_pad, c, copies) for c in range(copies)]
                assert run == list(range(run[0], run[0] + copies))
                for s in run:
                    assert s not in owner, (lens, tile_m, b, m)
                    assert 0 <= s < dq_accum_tiles(cu[-1], len(lens), tile_m) * copies
                    owner[s] = (b, m)


def test_config_checks_the_copies():
    HopperBwdConfig(deterministic=True, dq_copies=4, dq_early_release=True).check(128)
    HopperBwdConfig().check(128)
    for bad in (0, 17, 2.0, True):
        with pytest.raises(ValueError, match="dq_copies must be"):
            HopperBwdConfig(deterministic=True, dq_copies=bad).check(128)
    with pytest.raises(ValueError, match="need deterministic=True"):
        HopperBwdConfig(dq_copies=4).check(128)
    with pytest.raises(ValueError, match="need deterministic=True"):
        HopperBwdConfig(dq_early_release=True).check(64)


def test_workspace_holds_the_copies():
    from fa4_final.hopper import host

    one = host.workspace_shapes(1000, 7, 4, 128, 64, True)
    four = host.workspace_shapes(1000, 7, 4, 128, 64, True, 4)
    assert four["accum"] == (1, 4, one["accum"][2] * 4)
    assert four["turn"] == (1, 4, one["turn"][2] * 4)
    assert four["lse2"] == one["lse2"] and four["delta"] == one["delta"]


def _visitors(w, n_k, sq, sk, left, right):
    visitors = {}
    for n in range(n_k):
        m_min, m_max, _, _ = q_tile_range(w, n, sq, sk, left, right)
        for m in range(m_min, m_max):
            visitors.setdefault(m, []).append(n)
    return visitors


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("copies", range(1, 9))
def test_copy_visited_is_brute_force_and_turn_zero_writes_first(seed, copies):
    # dq_first_store: copy c of query tile m holds data exactly when copy_visited says so, and
    # then exactly one of its visitors has turn 0 (it stores; the others add after it); the
    # counter bwd_post reads ends at the visitor count (0: nobody wrote the unzeroed slab)
    for tm, tn, sq, sk, causal, left, right in _cases(120, seed + 10):
        w = TileWindow(tm, tn, causal, has_left=left is not None,
                       has_right=right is not None and not causal)
        n_k = -(-sk // tn)
        visitors = _visitors(w, n_k, sq, sk, left, right)
        case = (tm, tn, sq, sk, causal, left, right, copies)
        for m in range(-(-sq // tm)):
            for c in range(copies):
                mine = [n for n in visitors.get(m, []) if n % copies == c]
                seen = copy_visited(w, m, c, n_k, sq, sk, left, right, copies)
                assert seen == bool(mine), (case, m, c)
                turns = [dq_copy_turn(w, n, m, n_k, sq, sk, left, right, copies)[1]
                         for n in mine]
                assert turns.count(0) == (1 if mine else 0), (case, m, c, turns)


def test_copy_visited_every_window_kind_and_tiles_nobody_visits():
    # each kind by name (dense): none, causal, left only, right only, both, and sq != sk both
    # ways; causal with sk << sq leaves query tiles with no visitor at all (rows that see no key)
    kinds = [(False, None, None), (True, None, None), (False, 0, None), (False, 40, None),
             (False, None, 0), (False, None, 17), (False, 30, 30), (True, 70, None)]
    for causal, left, right in kinds:
        for sq, sk in [(513, 513), (1000, 130), (130, 1000), (64, 1), (1, 64)]:
            for copies in range(1, 9):
                w = TileWindow(64, 128, causal, has_left=left is not None,
                               has_right=right is not None)
                n_k = -(-sk // 128)
                visitors = _visitors(w, n_k, sq, sk, left, right)
                for m in range(-(-sq // 64)):
                    for c in range(copies):
                        want = any(n % copies == c for n in visitors.get(m, []))
                        assert copy_visited(w, m, c, n_k, sq, sk, left, right, copies) == want
    w = TileWindow(64, 128, True, has_left=False, has_right=False)
    vis = _visitors(w, 2, 1000, 130, None, None)
    nobody = [m for m in range(16) if m not in vis]
    assert nobody == list(range(13))
    assert not any(copy_visited(w, m, c, 2, 1000, 130, None, None, 4)
                   for m in nobody for c in range(4))


@pytest.mark.parametrize("copies", [1, 2, 4, 8])
def test_copy_visited_varlen(copies):
    # per sequence, the same function of that sequence's lengths (the kernels see one sequence
    # at a time; its slabs start at dq_accum_tile)
    rng = random.Random(100 + copies)
    for _ in range(60):
        causal = rng.random() < 0.5
        left = rng.choice([None, 0, 33])
        w = TileWindow(80, 128, causal, has_left=left is not None, has_right=False)
        for sq, sk in [(rng.randint(1, 400), rng.randint(1, 400)) for _ in range(4)]:
            n_k = -(-sk // 128)
            visitors = _visitors(w, n_k, sq, sk, left, None)
            for m in range(-(-sq // 80)):
                for c in range(copies):
                    want = any(n % copies == c for n in visitors.get(m, []))
                    assert copy_visited(w, m, c, n_k, sq, sk, left, None, copies) == want


def test_config_checks_first_store():
    HopperBwdConfig(deterministic=True, dq_first_store=True).check(128)
    HopperBwdConfig(deterministic=True, dq_copies=4, dq_early_release=True,
                    dq_first_store=True).check(64)
    with pytest.raises(ValueError, match="needs deterministic=True"):
        HopperBwdConfig(dq_first_store=True).check(128)


@pytest.mark.parametrize("copies", [1, 2, 3, 4, 8])
def test_first_store_emulated_equals_the_zeroing_build(copies):
    # the protocol on the host, in float32: slabs start as NaN (never zeroed), each visitor of
    # (m, c) in its turn order checks the counter shows its turn, stores at turn 0 and adds
    # after, increments the counter; bwd_post's rule reads a copy only where its counter is
    # non-zero. The result must equal, bit for bit, the zeroing build's (slabs zeroed, every
    # visitor adds, every copy read), with no NaN, and zero where nobody visits
    import numpy as np

    rng = np.random.default_rng(copies)
    for tm, tn, sq, sk, causal, left, right in _cases(40, 50 + copies):
        w = TileWindow(tm, tn, causal, has_left=left is not None,
                       has_right=right is not None and not causal)
        n_k = -(-sk // tn)
        num_m = -(-sq // tm)
        visitors = _visitors(w, n_k, sq, sk, left, right)
        parts = {(n, m): rng.standard_normal(8).astype(np.float32)
                 for m, ns in visitors.items() for n in ns}
        store = np.full((num_m, copies, 8), np.nan, dtype=np.float32)
        zeroed = np.zeros((num_m, copies, 8), dtype=np.float32)
        counter = np.zeros((num_m, copies), dtype=np.int64)
        for m, ns in visitors.items():
            turns = sorted((dq_copy_turn(w, n, m, n_k, sq, sk, left, right, copies)[::-1], n)
                           for n in ns)
            for (turn, c), n in turns:
                assert counter[m, c] == turn  # wait_turn would let it through now
                if turn == 0:
                    store[m, c] = parts[(n, m)]
                else:
                    store[m, c] = store[m, c] + parts[(n, m)]
                zeroed[m, c] = zeroed[m, c] + parts[(n, m)]
                counter[m, c] += 1
        for m in range(num_m):
            a = np.zeros(8, dtype=np.float32)
            b = np.zeros(8, dtype=np.float32)
            for c in range(copies):
                a = a + (store[m, c] if counter[m, c] != 0 else np.float32(0))
                b = b + zeroed[m, c]
                assert (counter[m, c] != 0) == copy_visited(w, m, c, n_k, sq, sk, left, right,
                                                             copies)
            assert not np.isnan(a).any() and np.array_equal(a, b), (m, copies)
            if m not in visitors:
                assert not a.any()
