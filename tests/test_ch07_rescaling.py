"""Chapter 07: conditional rescaling is exact, bounded, and as frequent as the statistics say."""

import math
from functools import partial

import pytest
import torch

from solutions import ch02_online_softmax as ch02
from solutions import ch07_rescaling as ch07
from utils.checks import check_attention, tolerance_check
from utils.reference import attention_reference, random_qkv

# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, tile_n): lengths that are not
# multiples of the tile, seqlen_q != seqlen_k both ways (bottom-right causal), GQA and MQA.
AWKWARD = [
    (2, 77, 300, 4, 2, 64, False, 64),
    (1, 130, 130, 2, 2, 32, True, 48),
    (2, 50, 200, 6, 3, 64, True, 32),
    (1, 200, 70, 4, 1, 16, True, 32),  # seqlen_q > seqlen_k: the first rows see no key
]


def _two_outputs(**kwargs):
    """attention_with_stats with the settings fixed, as a course-signature function."""

    def fn(q, k, v, causal=False, softmax_scale=None):
        return ch07.attention_with_stats(q, k, v, causal, softmax_scale, **kwargs)[:2]

    return fn


def _check_float32(fn, q, k, v, causal=False, seed=None):
    """The course rule (2 x PyTorch's same-precision max error + rounding) plus 1e-6 absolute:
    float32 errors are ~1e-7, so on small shapes one unlucky rounding can exceed twice PyTorch's
    largest (about 1 run in 1000 without the slack); a lost or doubled rescale errs by O(1)."""
    out, lse = fn(q, k, v, causal=causal)
    ref_out, ref_lse = attention_reference(q, k, v, causal)
    pt_out, pt_lse = attention_reference(q, k, v, causal, dtype=torch.float32)
    for verdict in (tolerance_check(out, ref_out, pt_out, "out", extra_atol=1e-6),
                    tolerance_check(lse, ref_lse, pt_lse, "lse", extra_atol=1e-5)):
        assert verdict.passed, (
            f"q {tuple(q.shape)} k {tuple(k.shape)} causal={causal} seed={seed}\n{verdict}")


def _stats_equal(a: ch07.RescaleStats, b: ch07.RescaleStats) -> None:
    for name in ("steps", "grew", "rescaled", "group_steps", "group_multiplied"):
        assert getattr(a, name) == getattr(b, name), name
    assert math.isclose(a.max_p, b.max_p, rel_tol=1e-6)


@pytest.mark.parametrize("tau", [0.0, 8.0])
@pytest.mark.parametrize("shape", AWKWARD)
def test_stale_max_attention_matches_float64_reference(tau, shape):
    b, sq, sk, h, hk, d, causal, tile_n = shape
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=torch.float32)
    fn = partial(ch07.attention, rescale_threshold=tau, tile_n=tile_n)
    _check_float32(fn, q, k, v, causal=causal, seed=seed)
    *_, stats = ch07.attention_with_stats(q, k, v, causal, rescale_threshold=tau, tile_n=tile_n)
    assert stats.steps > 0, f"seed {seed}"
    if tau == 8.0:
        assert stats.skipped > 0, f"seed {seed}: the stale-max path was never taken"
    for rule in ch07.GROUP_RULES:  # a warp vote over 16 rows, rows with no key among them
        grouped = _two_outputs(rescale_threshold=tau, tile_n=tile_n, group_rows=16,
                               group_rule=rule)
        _check_float32(grouped, q, k, v, causal=causal, seed=seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_inputs_pass_the_tolerance_rule(dtype):
    q, k, v, _ = random_qkv(1, 100, 4, 64, seqlen_k=333, heads_kv=2, dtype=dtype)
    check_attention(partial(ch07.attention, tile_n=64), q, k, v, causal=True)


def test_stale_max_is_exact_when_it_actually_lags():
    # A forward drift keeps the max in use up to tau below the true max most of the time.
    q, k, v = ch07.pattern_qkv("drift", seqlen_k=2048, seqlen_q=64, heads=2, dim=64,
                               seed=int(torch.randint(0, 2**31 - 1, ())), drift_nats=40.0)
    settings = {"rescale_threshold": 8.0, "tile_n": 64, "kv_order": "forward"}
    *_, stats = ch07.attention_with_stats(q, k, v, **settings)
    assert stats.skipped > 0 and stats.rescaled > 0 and stats.max_p > 16
    _check_float32(_two_outputs(**settings), q, k, v)


@pytest.mark.parametrize("shape", AWKWARD[:3])
def test_tau_zero_reproduces_always_rescale_bitwise(shape):
    b, sq, sk, h, hk, d, causal, tile_n = shape
    q, k, v, _ = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=torch.float32)
    for order in ch07.KV_ORDERS:
        run = partial(ch07.attention_with_stats, q, k, v, causal, tile_n=tile_n, kv_order=order)
        out0, lse0, st0 = run(rescale_threshold=0.0)
        out_a, lse_a, st_a = run(rescale_threshold=None)
        assert torch.equal(out0, out_a) and torch.equal(lse0, lse_a)
        # tau = 0 rescales exactly where the max grew; always-rescale multiplies at every step.
        assert st0.rescaled == st0.grew == st_a.grew and st_a.rescaled == st_a.steps


@pytest.mark.parametrize("shape", AWKWARD)
def test_plugged_into_chapter_02_loop(shape):
    b, sq, sk, h, hk, d, causal, tile_n = shape
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=torch.bfloat16)
    loop = partial(ch02.attention_fa2, q, k, v, causal, tile_m=32, tile_n=tile_n)
    # tau = 0 is chapter 02's always-rescale tile_update, bit for bit
    out2, lse2 = loop()
    out0, lse0 = loop(update=ch07.conditional_tile_update(0.0))
    assert torch.equal(out0, out2) and torch.equal(lse0, lse2), f"seed {seed}"
    # tau = 8 (and a warp vote over 16 rows of each Q tile) passes the course's bf16 rule
    for group_rows in (None, 16):
        fn = partial(ch02.attention_fa2, tile_m=32, tile_n=tile_n,
                     update=ch07.conditional_tile_update(8.0, group_rows=group_rows))
        check_attention(fn, q, k, v, causal=causal)


def test_growth_counts_agree_with_chapter_02_trace():
    q, k, _, seed = random_qkv(1, 60, 2, 32, seqlen_k=500, dtype=torch.float32, scale=1.5)
    for causal in (False, True):
        mine = ch07.scan_tile_maxima(ch07.tile_maxima(q, k, causal, tile_n=32,
                                                      kv_order="forward"), 3.0)
        theirs = ch02.max_growth_fractions(ch02.trace_running_max(q, k, causal, tile_n=32), 3.0)
        assert (mine.steps, mine.grew) == (theirs.steps, theirs.grew), f"seed {seed}"
        # Chapter 02 counts single steps that grow by > tau; a stale max also rescales when
        # small growths add up past tau, so it rescales at least as often.
        assert mine.rescaled >= theirs.grew_over_tau


@pytest.mark.parametrize("order", ch07.KV_ORDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adversarial_input_rescales_at_every_tile(order, dtype):
    tile_n, seqlen_k = 32, 32 * 40 + 5  # a short last tile too
    q, k, v = ch07.adversarial_qkv(seqlen_k, tile_n, 8.0, order, seqlen_q=48, dim=32,
                                   dtype=dtype)
    out, _, stats = ch07.attention_with_stats(q, k, v, tile_n=tile_n, kv_order=order,
                                              group_rows=16)
    n_tiles = -(-seqlen_k // tile_n)
    assert stats.rescaled == stats.steps == 48 * (n_tiles - 1)
    assert stats.group_multiplied == stats.group_steps == 3 * (n_tiles - 1)
    assert torch.isfinite(out).all()
    # Visited in the other order the same keys never move the max after the first tile.
    other = "forward" if order == "reverse" else "reverse"
    *_, flipped = ch07.attention_with_stats(q, k, v, tile_n=tile_n, kv_order=other)
    assert flipped.rescaled == 0


def test_random_inputs_rescale_rarely_after_the_first_tiles():
    # Scores q.k / sqrt(128) of N(0, 1) inputs are N(0, 1) nats. Over i.i.d. tiles the chance
    # that tile t holds the largest max so far is 1/t, so a row's max grows at about
    # H_n - 1 ~ ln(n) - 0.42 of its n - 1 steps: (4.74 - 1) / 63 = 6% for n = 64 tiles; we
    # assert < 10%. With tau = 8 (5.5 nats) a rescale needs a score 5.5 nats above the first
    # tile's max (itself ~2.5 nats): a 7-8 sigma event, so "at most 0.1%" is loose.
    q, k, v, seed = random_qkv(1, 128, 2, 128, seqlen_k=64 * 64, dtype=torch.float32)
    tmax = ch07.tile_maxima(q, k, tile_n=64)
    stats = ch07.scan_tile_maxima(tmax, 8.0, group_rows=16)
    assert stats.frac_grew < 0.10, f"seed {seed}: {stats}"
    assert stats.frac_rescaled <= 1e-3 and stats.frac_group <= 1e-2, f"seed {seed}: {stats}"


@pytest.mark.parametrize("tau", [0.0, 2.0, 8.0, 8.5])
def test_p_never_exceeds_two_to_the_tau(tau):
    for pattern, order in (("drift", "forward"), ("sorted", "forward"), ("random", "reverse")):
        q, k, v = ch07.pattern_qkv(pattern, seqlen_k=1024, seqlen_q=32, heads=2, dim=64,
                                   seed=int(torch.randint(0, 2**31 - 1, ())), drift_nats=30.0)
        *_, stats = ch07.attention_with_stats(q, k, v, rescale_threshold=tau, tile_n=32,
                                              kv_order=order)
        assert 1.0 <= stats.max_p <= 2.0**tau, (pattern, order, stats)


def test_p_reaches_the_bound_on_a_drift():
    # The bound is tight: a slow drift lets the max in use lag by nearly tau before rescaling.
    q, k, _ = ch07.pattern_qkv("drift", seqlen_k=8192, seqlen_q=64, heads=1, dim=64,
                               drift_nats=60.0)
    stats = ch07.scan_tile_maxima(ch07.tile_maxima(q, k, tile_n=32, kv_order="forward"), 8.0)
    assert 128 < stats.max_p <= 256


def test_far_too_large_tau_overflows_fp16_p():
    # The max grows by 40 log2 units in the last tile: tau = 200 keeps the stale max, so
    # p = 2^40 > 65504 is inf once cast to fp16 for P V, and O (hence out) is inf.
    q, k, v = ch07.late_spike_qkv(40.0, dtype=torch.float16)
    ref_out, _ = attention_reference(q, k, v)
    out_bad, _, bad = ch07.attention_with_stats(q, k, v, rescale_threshold=200.0)
    assert bad.rescaled == 0 and bad.max_p > 2.0**39 and not torch.isfinite(out_bad).all()
    out_ok, _, ok = ch07.attention_with_stats(q, k, v, rescale_threshold=8.0)
    assert ok.rescaled == q.shape[1] and ok.max_p <= 256
    assert (out_ok.double() - ref_out).abs().max() < 1e-2
    assert ch07.largest_safe_threshold(torch.float16, 32768) < 16 < 200


def test_growth_past_128_overflows_float32_itself():
    # float32 p = 2^150 is inf: l = inf and out = inf / inf = NaN, even with float32 inputs.
    q, k, v = ch07.late_spike_qkv(150.0, dtype=torch.float32)
    out_bad, lse_bad, _ = ch07.attention_with_stats(q, k, v, rescale_threshold=200.0)
    assert torch.isnan(out_bad).all()
    out_ok, _, _ = ch07.attention_with_stats(q, k, v, rescale_threshold=8.0)
    assert torch.isfinite(out_ok).all()


def test_lse_must_use_the_max_that_was_subtracted():
    o_acc, row_sum, m_used, want_out, want_lse, lag = ch07.stale_max_example()
    out, lse = ch07.finalize(o_acc, row_sum, m_used)
    assert torch.allclose(lse[:-1].double(), want_lse[:-1], atol=1e-5)
    # Pairing l with the true max instead is off by exactly the lag, in nats.
    m_true = m_used + lag.float()
    _, wrong = ch07.finalize(o_acc, row_sum, m_true)
    assert torch.allclose((wrong - lse)[:-1].double(), lag[:-1] * ch07.LN_2, atol=1e-5)
    assert lse[-1] == float("-inf") and (out[-1] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_scan_of_tile_maxima_agrees_with_the_attention_loop(causal):
    q, k, v, _ = random_qkv(1, 70, 2, 32, seqlen_k=333, dtype=torch.float32, scale=2.0)
    for tau, group_rows, rule in ((0.0, None, "any"), (3.0, 16, "any"), (3.0, 16, "own")):
        for order in ch07.KV_ORDERS:
            *_, st = ch07.attention_with_stats(q, k, v, causal, rescale_threshold=tau, tile_n=32,
                                               kv_order=order, group_rows=group_rows,
                                               group_rule=rule)
            tmax = ch07.tile_maxima(q, k, causal, tile_n=32, kv_order=order)
            _stats_equal(st, ch07.scan_tile_maxima(tmax, tau, group_rows, rule))


@pytest.mark.parametrize("rule", ch07.GROUP_RULES)
def test_warp_uniform_decisions_are_exact_and_uniform(rule):
    q, k, v, _ = random_qkv(1, 80, 2, 32, seqlen_k=400, dtype=torch.float32, scale=2.5)
    settings = {"rescale_threshold": 2.0, "tile_n": 32, "group_rows": 16, "group_rule": rule}
    _check_float32(_two_outputs(**settings), q, k, v)
    *_, st = ch07.attention_with_stats(q, k, v, **settings)
    per_row = ch07.scan_tile_maxima(ch07.tile_maxima(q, k, tile_n=32), 2.0)
    assert st.frac_group >= per_row.frac_rescaled > 0
    if rule == "any":
        _, tr = ch07.scan_tile_maxima(ch07.tile_maxima(q, k, tile_n=32), 2.0, group_rows=16,
                                      trace=True)
        groups = tr["rescaled"].reshape(1, 2, 5, 16, -1)
        assert (groups.all(dim=3) | ~groups.any(dim=3)).all()


def test_rescale_frequency_table():
    table = ch07.rescale_frequency(seqlen_k=2048, seqlen_q=32, heads=1, dim=64, tile_n=64)
    rows = {(r["pattern"], r["order"]): r for r in table}
    assert len(rows) == len(ch07.PATTERNS) * 2
    for order in ch07.KV_ORDERS:
        adv = rows[("adversarial", order)]
        assert adv["grew"] == adv["rescaled"] == adv["group16"] == adv["group32"] == 1.0
        assert adv["exact16"] == adv["exact32"] == 1.0
    for r in table:  # skipping only exact no-ops multiplies at least as often as the threshold
        assert r["exact16"] >= r["group16"] and r["exact32"] >= r["exact16"]
    assert rows[("sink", "forward")]["grew"] == 0.0  # the sink is seen first: max set at once
    # visited last, the sink moves every row's max by more than tau exactly once
    assert rows[("sink", "reverse")]["rescaled"] == pytest.approx(1 / 31)
    assert rows[("sorted", "reverse")]["grew"] < 0.05 < rows[("sorted", "forward")]["grew"]
    assert all(r["max_p"] <= 256 for r in table)
    assert "adversarial" in ch07.format_frequency(table)


def test_checkers_accept_the_references():
    ch07.check_finalize(ch07.finalize)
    ch07.check_adversarial(ch07.adversarial_qkv)


def test_conditional_update_keeps_a_growth_of_exactly_tau_and_empty_rows():
    ninf = float("-inf")
    m_old = torch.tensor([4.0, 4.0, ninf, ninf])
    tile = torch.tensor([[12.0], [13.0], [2.5], [ninf]])
    m_used, alpha, resc = ch07.conditional_update(m_old, tile, 8.0)
    assert m_used.tolist() == [4.0, 13.0, 2.5, ninf]
    assert alpha.tolist() == [1.0, 2.0**-9, 0.0, 1.0]
    assert resc.tolist() == [False, True, True, False]


def _lse_in_log2_units(o, row_sum, m):
    out, lse = ch07.finalize(o, row_sum, m)
    return out, lse / ch07.LN_2


def _lse_forgets_ln2_on_the_max(o, row_sum, m):
    out, _ = ch07.finalize(o, row_sum, m)
    return out, m + torch.log(row_sum)


def _divides_by_zero(o, row_sum, m):
    _, lse = ch07.finalize(o, row_sum, m)
    return o / row_sum[:, None], lse


@pytest.mark.parametrize("wrong, words", [
    (_lse_in_log2_units, "lse is off"),
    (_lse_forgets_ln2_on_the_max, "lse is off"),
    (_divides_by_zero, "NaN"),
])
def test_check_finalize_rejects(wrong, words):
    with pytest.raises(AssertionError, match=words):
        ch07.check_finalize(wrong)


def _plain_random(seqlen_k, tile_n=128, tau=8.0, kv_order="reverse"):
    q, k, v, _ = random_qkv(1, 16, 1, 32, seqlen_k=seqlen_k, dtype=torch.float32)
    return q, k, v


def _ignores_order(seqlen_k, tile_n=128, tau=8.0, kv_order="reverse"):
    return ch07.adversarial_qkv(seqlen_k, tile_n, tau, "forward")


def _steps_too_small(seqlen_k, tile_n=128, tau=8.0, kv_order="reverse"):
    return ch07.adversarial_qkv(seqlen_k, tile_n, tau / 2 - 1, kv_order)


@pytest.mark.parametrize("wrong", [_plain_random, _ignores_order, _steps_too_small])
def test_check_adversarial_rejects(wrong):
    with pytest.raises(AssertionError, match="must grow by more than tau"):
        ch07.check_adversarial(wrong)


@pytest.mark.parametrize("kwargs, error", [
    ({"rescale_threshold": -1.0}, ValueError),
    ({"rescale_threshold": float("inf")}, ValueError),
    ({"rescale_threshold": "8"}, ValueError),
    ({"kv_order": "backwards"}, ValueError),
    ({"tile_n": 0}, ValueError),
    ({"group_rows": 0}, ValueError),
    ({"group_rows": 16, "group_rule": "all"}, ValueError),
])
def test_bad_arguments_raise(kwargs, error):
    q, k, v, _ = random_qkv(1, 8, 2, 16, dtype=torch.float32)
    with pytest.raises(error):
        ch07.attention_with_stats(q, k, v, **kwargs)


def test_bad_inputs_raise():
    q, k, v, _ = random_qkv(1, 8, 3, 16, heads_kv=3, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        ch07.attention(q, k[:, :, :2], v[:, :, :2])
    with pytest.raises(ValueError, match="pattern"):
        ch07.pattern_qkv("zigzag")
    with pytest.raises(ValueError, match="tiles"):
        ch07.adversarial_qkv(300 * 128, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError):
        ch07.largest_safe_threshold(torch.int8, 1024)
    with pytest.raises(ValueError):
        ch07.conditional_update(torch.zeros(3), torch.zeros(4, 2), 8.0)


def test_knob_configs_say_what_chapter_05_accepts():
    try:
        off, on = ch07.knob_configs(128)
    except ValueError as exc:  # until chapter 05 takes the knob, the reason is given
        assert "rescale_threshold" in str(exc)
    else:
        assert (off.rescale_threshold, on.rescale_threshold) == (0.0, 8.0)
        assert off.tile_n == on.tile_n


def test_model_share_of_o_multiplies_and_the_knob_table():
    """The figures ``benchmark_knob`` stores next to each time, computed here on the CPU."""
    q, k, _ = ch07.pattern_qkv("adversarial", 1024, 1024, 1, 64, tile_n=128, tau=8.0)
    assert ch07.o_multiply_share(q, k, False, 8.0, 128) == 1.0  # every warp, every tile
    assert ch07.o_multiply_share(q, k, False, 0.0, 128) == 1.0  # tau = 0 always multiplies
    q, k, _ = ch07.pattern_qkv("random", 1024, 1024, 1, 64)
    assert ch07.o_multiply_share(q, k, True, 8.0, 128) < 0.2
    rows = [{"inputs": "random", "causal": False, "config": f"tau={t:g}", "ms": ms,
             "tflops": 600.0, "rescale_threshold": t, "o_multiply_share_model": share}
            for t, ms, share in ((0.0, 2.0, 1.0), (8.0, 1.9, 0.05))]
    table = ch07.format_knob_rows(rows)
    assert "0.950" in table and "5.0%" in table, table


def test_adversarial_input_makes_p_mostly_zero_at_tau_0():
    """Why the adversarial input can run faster at tau = 0 with the same instructions: its P is
    mostly exact zeros (each tile's leader pushes every other p below 2^-126), random P none."""
    q, k, _ = ch07.pattern_qkv("adversarial", seqlen_k=4096, seqlen_q=32, heads=1)
    assert ch07.p_zero_share(q, k) > 0.5
    q, k, _ = ch07.pattern_qkv("random", seqlen_k=4096, seqlen_q=32, heads=1)
    assert ch07.p_zero_share(q, k) == 0.0


# -- exercises 07.2 and 07.3: a warp on the CPU, compiled ------------------------------------


def test_warp_emulator_answers_every_lane_and_names_a_divergent_vote():
    warp = ch07.WarpEmulator()

    def lane_fn(lane):
        answer = warp.vote_any(lane == 5)
        warp.end_step()
        return bool(answer)

    assert warp.run(lane_fn) == [True] * ch07.WARP
    warp = ch07.WarpEmulator(timeout=5.0)

    def diverges(lane):
        if lane < 4:
            warp.vote_any(True)
        warp.end_step()

    with pytest.raises(AssertionError, match="lanes 0-3 reached vote_any_sync and lanes 4-31"):
        warp.run(diverges)


def test_device_exercises_pass_on_the_cpu_without_compiling():
    ch07.check_running_max(ch07.running_max, compile_check=False)
    ch07.check_softmax_step(ch07.softmax_step, compile_check=False)


def test_emulated_step_is_the_float64_softmax():
    for case in ch07.step_cases():
        tr = ch07.emulate_step(ch07.softmax_step, case)
        out, lse = ch07.reference_attention(case.scores, case.v)
        assert abs(tr.out - out).max() < 2e-5
        assert ch07._step_mistake(case, tr) is None
    late = ch07.step_cases()[2]
    tr = ch07.emulate_step(ch07.softmax_step, late)
    assert tr.votes[-1] and tr.o_writes[-1].all()  # rows grow late: the warp multiplies


@pytest.mark.slow
def test_device_exercises_pass_compiled_for_sm90a():
    ch07.check_running_max(ch07.running_max)
    ch07.check_softmax_step(ch07.softmax_step)
    facts = ch07.vote_in_sass(ch07.compile_step_kernel(ch07.softmax_step).sass)
    assert facts == {"vote": True, "exponentials wait for the vote": False,
                     "O multiply reads the vote": True}


def test_vote_in_sass_reads_the_predicate_around_the_first_exponential():
    loop = """
.L_x_1:
        /*0100*/                   FSETP.GT.AND P0, PT, R35, 8, PT ;
        /*0110*/                   VOTE.ANY P0, P0 ;
        /*0120*/                   FSEL R4, R4, R5, P0 ;
        /*0130*/                   MUFU.EX2 R4, R4 ;
        /*0140*/               @P0 FMUL R6, R6, R4 ;
        /*0150*/               @P1 BRA `(.L_x_1) ;
"""
    assert ch07.vote_in_sass(loop)["exponentials wait for the vote"]
    early = loop.replace("FSEL R4, R4, R5, P0", "FADD R4, R4, R5")
    facts = ch07.vote_in_sass(early)
    assert not facts["exponentials wait for the vote"] and facts["O multiply reads the vote"]


def test_stored_run_reads_as_the_chapter_says():
    from utils import results

    res = results.load(ch07.RESULTS_NAME, gpu="h200")
    cmp = ch07.knob_comparisons(res)
    assert set(cmp) == {(i, c) for i in ("random", "adversarial") for c in (False, True)}
    assert cmp[("adversarial", False)].ratio < 1


def test_the_measurement_driver_lives_in_measure():
    import measure.rescale_knob as driver

    assert driver.PRODUCES[0][0] == f"results/h200/{ch07.RESULTS_NAME}.json"
    assert not hasattr(ch07, "benchmark_knob") and not hasattr(ch07, "main")


def test_gpu_checks_judge_through_a_cpu_runner():
    """The GPU checks' own logic, with the kernels' runners swapped for the emulation."""
    from tests.exercise_mutations import ch07 as wrong

    assert ch07.check_running_max_on_gpu(ch07.running_max, run=ch07.emulate_vote_kernel)[0]
    assert not ch07.check_running_max_on_gpu(wrong.running_max_votes_last_row,
                                             run=ch07.emulate_vote_kernel)[0]
    small = [ch07.StepCase(c.what, c.scores[:100], c.v, c.tau) for c in ch07.step_cases()]
    assert ch07.check_softmax_step_on_gpu(ch07.softmax_step, run=ch07.emulate_step_kernel,
                                          cases=small)[0]
    ok, lines = ch07.check_softmax_step_on_gpu(wrong.step_no_alpha_on_l,
                                               run=ch07.emulate_step_kernel, cases=small)
    assert not ok and any("WRONG" in line for line in lines)
