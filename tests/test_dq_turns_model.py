"""measure.dq_turns_model on small shapes (CPU, under a second each): a rotated start deadlocks
once a head's key tiles outnumber the resident slots and the current turns never do; the
makespan grows with the add latency; the turn orders add in the same sequence whatever the
timing (what makes the bits fixed), and that sequence is the copy's turn order."""

import pytest

from measure.dq_turns_model import Shape, simulate, turn_of


def test_rotated_start_deadlocks_past_the_slots_and_turns_do_not():
    shape = Shape(1, 2048, 2, 64, False)  # 16 key tiles a head
    bad = simulate(shape, "rotated", L=0.5, slots=8)
    assert bad.deadlock and bad.waiting > 0
    assert not simulate(shape, "rotated", L=0.5, slots=16).deadlock
    for order, kw in (("turns", {}), ("copies", {"copies": 4})):
        for causal in (False, True):
            r = simulate(Shape(1, 2048, 2, 64, causal), order, L=0.5, slots=3, jitter=0.2, **kw)
            assert not r.deadlock, (order, causal)
    # chunks no larger than the slots rescue the rotated start
    assert not simulate(shape, "rotated", L=0.5, slots=8, chunk=8).deadlock


@pytest.mark.parametrize("order,kw", [("none", {}), ("turns", {}), ("copies", {"copies": 2}),
                                      ("turns", {"early": True})])
def test_makespan_is_monotone_in_the_add_latency(order, kw):
    shape = Shape(2, 1024, 4, 128, False)
    spans = [simulate(shape, order, L=L, slots=16, **kw).makespan
             for L in (0.0, 0.2, 0.5, 1.0, 2.0)]
    assert all(a <= b + 1e-9 for a, b in zip(spans, spans[1:])), spans


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("order,copies", [("turns", 1), ("copies", 3)])
def test_the_add_sequence_is_fixed_whatever_the_timing(causal, order, copies):
    shape = Shape(1, 1536, 2, 128, causal)
    runs = [simulate(shape, order, L=L, jitter=j, seed=s, slots=6, copies=copies,
                     keep_adds=True, early=e).adds
            for L, j, s, e in ((0.3, 0.0, 0, False), (1.5, 0.4, 1, True), (0.1, 0.3, 7, False))]
    assert runs[0] == runs[1] == runs[2]
    for (_b, _head, m, copy), ns in runs[0].items():
        assert [turn_of(shape, order, n, m, copies)[1] for n in ns] == list(range(len(ns)))
        assert all(n % copies == copy for n in ns)


def test_default_is_one_wave_of_steps_per_slot():
    # no turns, no jitter, equal CTAs: makespan ~ waves x steps (+ the last adds)
    shape = Shape(1, 1024, 4, 128, False)  # 8 key tiles x 4 heads = 32 CTAs of 16 steps
    r = simulate(shape, "none", L=0.1, slots=8)
    assert 4 * 16 <= r.makespan <= 4 * 16 + 4 * 1.0


def test_chunks_with_their_own_copies_wait_on_no_other_chunk():
    shape = Shape(1, 2048, 2, 64, False)  # 16 key tiles, chunks of 4 in 4 copies
    r = simulate(shape, "rotated", L=0.5, slots=4, chunk=4, copies=4, keep_adds=True)
    assert not r.deadlock
    for (_b, _head, m, copy), ns in r.adds.items():
        assert all(n // 4 == copy for n in ns)
        assert [turn_of(shape, "rotated", n, m, 4, 4)[1] for n in ns] == list(range(len(ns)))


def test_total_price_charges_the_copies_to_pre_and_post():
    from measure.dq_turns_model import copies_of, total_price

    phases = {"pre": 0.07, "main": 2.0, "post": 0.05, "total": 2.12}
    assert abs(total_price(phases, 1.0, 1) - 1.0) < 1e-12
    prices = [total_price(phases, 1.0, c) for c in (1, 2, 4, 8)]
    assert prices == sorted(prices) and prices[0] < prices[1]
    assert copies_of("copies=4 early") == 4 and copies_of("turns early") == 1


def test_first_store_prices_less_than_zeroing_and_counts_visited_copies():
    from measure import dq_turns_model as dqm

    dense = dqm.Shape(1, 4096, 4, 64, False, tile_m=128)
    causal = dqm.Shape(1, 4096, 4, 64, True, tile_m=128)
    assert dqm.visited_copies(dense, 4) == 4  # every key tile reaches every query tile
    assert 1 <= dqm.visited_copies(causal, 4) < 4  # the first query tiles see one key tile
    assert dqm.visited_copies(dense, 1) == 1
    phases = {"pre": 0.1, "main": 1.0, "post": 0.1, "total": 1.2}
    for c in (1, 2, 4):
        zeroing = dqm.total_price(phases, 1.0, c)
        store = dqm.total_price(phases, 1.0, c, first_store=True, visited=c)
        assert store < zeroing
    # one copy, every tile visited: only bwd_pre's zeroing goes (4 of its 8 B an element)
    assert abs(dqm.total_price(phases, 1.0, 1, first_store=True, visited=1)
               - (0.05 + 1.0 + 0.1) / 1.2) < 1e-12


def test_dq_turns_model_two_buffers_keep_the_add_order_and_never_cost_more():
    """Two staging buffers (HopperBwdConfig.dq_buffers): the same adds in the same order at
    every accumulator tile, a makespan no longer than one buffer's, nothing changed without
    turns; early release with two buffers is refused, as the config refuses it."""
    from measure.dq_turns_model import Shape, simulate

    for causal in (False, True):
        shape = Shape(2, 2048, 4, 128, causal, tile_m=64)
        one = simulate(shape, "turns", L=0.9, keep_adds=True)
        two = simulate(shape, "turns", L=0.9, keep_adds=True, buffers=2)
        assert not one.deadlock and not two.deadlock
        assert one.adds == two.adds
        assert two.makespan <= one.makespan
        assert simulate(shape, "none", L=0.9, buffers=2).makespan == pytest.approx(
            simulate(shape, "none", L=0.9).makespan)
    with pytest.raises(ValueError, match="early"):
        simulate(shape, "turns", buffers=2, early=True)


def test_dq_turns_model_adds_overlap_keeps_the_add_order_and_ends():
    """dq_adds_overlap (Note [Adds in flight across turns]): two dQ warps on alternate steps,
    each passing its own turns; no CTA is left waiting (few slots, so CTAs wait on ones
    launched before them, GQA groups, causal or not) and every accumulator tile gets the
    one-warp build's adds in the same order. Refused without two buffers or without turns."""
    from measure.dq_turns_model import Shape, simulate

    for causal in (False, True):
        for slots in (132, 7):
            shape = Shape(2, 1500, 8, 128, causal, h_kv=2, tile_m=64)
            two = simulate(shape, "turns", L=0.9, jitter=0.05, keep_adds=True, buffers=2,
                           slots=slots)
            over = simulate(shape, "turns", L=0.9, jitter=0.05, keep_adds=True, buffers=2,
                            overlap=True, slots=slots)
            assert not two.deadlock and not over.deadlock
            assert over.adds == two.adds
    for bad in ({"buffers": 1}, {"buffers": 2, "order": "none"}):
        kw = {"order": "turns", **bad}
        with pytest.raises(ValueError, match="overlap"):
            simulate(shape, overlap=True, **kw)


def test_dq_turns_model_rotated_walk_never_prices_above_the_plain_walk():
    """predict_rotated (Note [A rotated walk]): with two buffers and a dQ warp each, the
    rotated walk's price is at most the plain walk's and at least the default's (1), dense."""
    from measure import dq_turns_model as dqm

    for d in (64, 128):
        shape = dqm.default_shape(1, 2048, 4, d, False)
        got = dqm.predict_rotated(shape, dqm.CALIBRATED[d])
        assert 0.99 <= got["rotated"] <= got["turns"] + 1e-9, got
