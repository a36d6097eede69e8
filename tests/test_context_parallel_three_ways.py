"""The lab labs/context_parallel_three_ways: the all-gather of K, V and Ulysses (all-to-all over
heads) on 2 and 4 gloo processes against one process in float64 (outputs and gradients, causal
or not, GQA, sequence lengths the zigzag layout cuts unevenly), every rank's counted bytes and
messages equal to the formula, the formula equal to chapter 14's model, and Ulysses' refusal of a
W that does not divide heads_kv. One launch per W runs every case (as check_on_processes does)."""

from types import SimpleNamespace

import pytest

from labs import context_parallel_three_ways_helpers as H
from solutions import ch14_ring as R

CASES = [
    R.Case(1, 37, 4, 2, 8, True, 1),   # 37 tokens: uneven pieces; GQA; W = 4 > heads_kv = 2
    R.Case(2, 24, 8, 4, 8, False, 2),  # even pieces (gloo's all_gather, reduce_scatter), batch 2
    R.Case(1, 19, 4, 4, 4, False, 3),  # uneven, not causal, no GQA
    R.Case(1, 6, 4, 4, 4, True, 4),    # fewer tokens than 2W chunks at W = 4: empty chunks
    R.Case(1, 32, 8, 4, 8, True, 5),   # even, causal, GQA
]
TOL = 1e-10  # relative to each output's largest magnitude; float64 gives about 1e-15


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def runs(request):
    world = request.param
    return world, H.check_three_ways(world, CASES)


def test_context_parallel_outputs_and_gradients_equal_one_process(runs):
    world, reports = runs
    for case, report in zip(CASES, reports):
        for way in H.WAYS:
            r = report[way]
            if way == "ulysses" and case.hk % world:
                continue  # refused: the next test
            assert "errors" in r, f"W={world} {H.describe(case)}: {way} did not run: {r}"
            bad = {n: e for n, e in r["errors"].items() if not e <= TOL}
            assert not bad, f"W={world} {H.describe(case)}: {way} relative errors {bad}"


def test_context_parallel_counted_bytes_equal_the_formula(runs):
    world, reports = runs
    for case, report in zip(CASES, reports):
        for way in H.WAYS:
            if "counts" not in report[way]:
                continue
            for phase in ("fwd", "bwd"):
                for rank, (got, want) in enumerate(report[way]["counts"][phase]):
                    if phase == "bwd":
                        got.held = want.held = 0
                    assert got == want, (f"W={world} {H.describe(case)} {way} {phase} rank "
                                         f"{rank}: counted {got}, formula {want}")
                    assert got.received > 0 and got.sent > 0


def test_context_parallel_ulysses_refuses_w_not_dividing_heads_kv_on_every_rank(runs):
    world, reports = runs
    for case, report in zip(CASES, reports):
        r = report["ulysses"]
        if case.hk % world:
            assert r.get("all_refused"), r
            assert f"W = {world}" in r["refused"] and f"heads_kv = {case.hk}" in r["refused"]
        else:
            assert "refused" not in r


def test_context_parallel_ulysses_refuses_before_any_collective():
    q, k, v, _ = R.Case(1, 12, 8, 2, 4, True).inputs()
    comm = SimpleNamespace(rank=0, world=4, counts=H.Counts())  # no process group: must not talk
    layout = R.zigzag_layout(12, 4)
    with pytest.raises(ValueError, match=r"W = 4 does not divide heads_kv = 2"):
        H.ulysses_forward(layout.shard(q, 0), layout.shard(k, 0), layout.shard(v, 0), layout,
                          comm, True)
    with pytest.raises(ValueError, match=r"W = 3 does not divide heads_kv = 8"):
        H.ulysses_heads(3, 32, 8)
    with pytest.raises(ValueError, match=r"W = 3 does not divide heads_kv = 8"):
        H.formula("ulysses", "fwd", R.zigzag_layout(30, 3), 0, 1, 32, 8, 4)
    assert H.ulysses_heads(8, 32, 8) == (4, 1) and H.ulysses_heads(2, 4, 4) == (2, 2)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_context_parallel_formula_is_the_chapters_model(world):
    for row in H.model_check(1 << 20, world):
        assert row["formula_received_mb"] == pytest.approx(row["model_received_mb"], rel=1e-12)
        assert row["formula_held_mb"] == pytest.approx(row["model_held_mb"], rel=1e-12), row


def test_context_parallel_formula_on_uneven_layouts_adds_up():
    """Over all ranks, what is sent is what is received; even pieces give the chapter's terms."""
    for world in (2, 3, 4):
        for seqlen in (6, 37, 64):
            layout = R.zigzag_layout(seqlen, world)
            for way in ("all-gather", "ring") + (("ulysses",) if 4 % world == 0 else ()):
                for phase in ("fwd", "bwd"):
                    counts = [H.formula(way, phase, layout, r, 2, 8, 4, 8) for r in range(world)]
                    assert sum(c.sent for c in counts) == sum(c.received for c in counts)
    kv = 2 * 4 * 16 * 8  # b=2, hk=4, d=dv=8, float64: K and V of one token
    c = H.formula("ring", "fwd", R.zigzag_layout(64, 4), 1, 2, 8, 4, 8)
    assert (c.sent, c.received, c.messages, c.held) == (3 * 16 * kv, 3 * 16 * kv, 3, 2 * 16 * kv)


def test_context_parallel_crossover():
    # Ulysses' forward receives (W-1)/W L (2H + 2Hkv) per rank, the all-gather (W-1) L 2Hkv
    for h, hk in ((8, 4), (32, 8), (8, 8)):
        w0 = H.crossover_world(h, hk)
        for world in (w for w in (1, 2, 4, 8) if hk % w == 0 and w > 1):
            lay = R.contiguous_layout(64, world)
            u = H.formula("ulysses", "fwd", lay, 0, 1, h, hk, 8).received
            a = H.formula("all-gather", "fwd", lay, 0, 1, h, hk, 8).received
            assert (u < a) == (world > w0) and (u == a) == (world == w0)
