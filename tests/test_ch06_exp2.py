"""Chapter 06 on a CPU: the fits, the float32 model of the GPU sequence, the checkers, the PTX."""

from fractions import Fraction

import cutlass
import cutlass.cute as cute
import numpy as np
import pytest
from cutlass import Float32

from solutions import ch06_exp2 as ch06
from utils.compile_only import compile_for, fake_stream, fake_tensor

F32 = np.float32
ANCHOR_DEGREE3 = 8.8e-5  # ANCHORS.md: max relative error of FA4's degree-3 fit


def exact_round_f32(v: Fraction, down: bool = False) -> F32:
    """Correct float32 rounding of an exact rational (nearest-even, or toward -inf)."""
    if v == 0:
        return F32(0.0)
    sign, mag = (-1, -v) if v < 0 else (1, v)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    while Fraction(2) ** e > mag:
        e -= 1
    while Fraction(2) ** (e + 1) <= mag:
        e += 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    q = mag / ulp
    lo = q.numerator // q.denominator
    rem = q - lo
    if down:
        lo += 1 if (sign < 0 and rem > 0) else 0
    elif rem > Fraction(1, 2) or (rem == Fraction(1, 2) and lo % 2 == 1):
        lo += 1
    return F32(sign * float(lo * ulp))


# -- single instructions ----------------------------------------------------------------------


def test_fma_is_one_rounding_and_float64_alone_is_not():
    a, b, c = ch06.FMA_DOUBLE_ROUNDING_EXAMPLE
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    want = exact_round_f32(exact)
    assert want == F32(1.0 + 2.0**-23)
    assert ch06.fma_rn_f32(a, b, c) == want
    assert ch06.fma_via_float64_naive(a, b, c) == F32(1.0), "the example should double-round"


def test_fma_matches_exact_arithmetic_on_random_and_cancelling_inputs():
    rng = np.random.default_rng(1)
    n = 1500
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-40, 40, n))).astype(F32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-40, 40, n))).astype(F32)
    c = (rng.standard_normal(n) * np.exp2(rng.integers(-80, 80, n))).astype(F32)
    c[: n // 2] = (-(a[: n // 2].astype(np.float64) * b[: n // 2])).astype(F32)  # cancellation
    got = ch06.fma_rn_f32(a, b, c)
    want = np.array([exact_round_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                     for x, y, z in zip(a, b, c)], dtype=F32)
    assert np.array_equal(ch06.f32_bits(got), ch06.f32_bits(want))


def test_add_rm_rounds_toward_minus_infinity():
    rng = np.random.default_rng(2)
    a = (rng.standard_normal(1500) * np.exp2(rng.integers(-140, 30, 1500))).astype(F32)
    b = (rng.standard_normal(1500) * np.exp2(rng.integers(-140, 30, 1500))).astype(F32)
    got = ch06.add_rm_f32(a, b)
    want = np.array([exact_round_f32(Fraction(float(x)) + Fraction(float(y)), down=True)
                     for x, y in zip(a, b)], dtype=F32)
    assert np.array_equal(ch06.f32_bits(got), ch06.f32_bits(want))
    assert np.signbit(ch06.add_rm_f32(F32(3.0), F32(-3.0)))  # exact zero rounds to -0
    assert ch06.add_rm_f32(F32(-1e-45), ch06.SHIFTER) == F32(ch06.SHIFTER - 1)


# -- range reduction --------------------------------------------------------------------------


def test_floor_trick_is_exact_over_the_softmax_range():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-127, 127, 100_000), np.arange(-127, 128),
                        np.arange(-127, 128) - 2.0**-16, [-1e-45, 1e-45, -0.0]]).astype(F32)
    n, f = ch06.floor_trick(x)
    assert np.array_equal(n, np.floor(x))
    assert np.all((f >= 0) & (f <= 1))
    bits = ch06.f32_bits(ch06.add_rm_f32(x, ch06.SHIFTER)).astype(np.int64)
    assert np.array_equal(bits - ch06.SHIFTER_BITS, np.floor(x).astype(np.int64))


def test_shifter_of_one_times_2_23_breaks_for_negative_x():
    x = F32(-2.25)
    j = ch06.add_rm_f32(x, 2.0**23)  # lands in [2^22, 2^23), where the spacing is 0.5
    assert ch06.sub_rn_f32(j, 2.0**23) == F32(-2.5)  # not floor(x) = -3


def test_assemble_exponent_is_ldexp():
    n = np.arange(-126, 128)
    p = np.random.default_rng(4).uniform(1, 2, n.size).astype(F32)
    got = ch06.assemble_exponent((ch06.SHIFTER + n).astype(F32), p)
    assert np.array_equal(got, np.ldexp(p, n).astype(F32))


# -- fits -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def remez():
    return {d: ch06.remez_fit(d) for d in ch06.DEGREES}


def test_degree3_minimax_matches_the_anchor(remez):
    err = remez[3].max_error
    assert ANCHOR_DEGREE3 / 1.2 <= err <= 1.2 * ANCHOR_DEGREE3, err


@pytest.mark.parametrize("degree", ch06.DEGREES)
def test_remez_error_equioscillates(remez, degree):
    fit = remez[degree]
    loc, val = ch06.error_extrema(fit.coeffs)
    assert len(val) == degree + 1  # pinned p(0) = 1: degree free coefficients + 1
    assert np.allclose(np.abs(val), fit.max_error, rtol=1e-6)
    assert np.all(np.sign(val[1:]) == -np.sign(val[:-1]))
    assert fit.coeffs[0] == 1.0 and loc[-1] == pytest.approx(1.0)


def test_minimax_beats_least_squares_and_degrees_improve(remez):
    errs = [remez[d].max_error for d in ch06.DEGREES]
    assert errs == sorted(errs, reverse=True)
    for d in ch06.DEGREES:
        assert remez[d].max_error < ch06.max_relative_error(ch06.least_squares_fit(d))
        free = ch06.remez_fit(d, pin_one=False)
        assert free.max_error <= remez[d].max_error  # pinning p(0) costs a little accuracy


@pytest.mark.parametrize("pin_one", (True, False))
@pytest.mark.parametrize("degree", ch06.DEGREES)
def test_remez_stops_on_any_machines_rounding(monkeypatch, remez, degree, pin_one):
    """The stop rule must not depend on this machine's last bits of float64.

    Another CPU (another libm or SIMD path for exp2, another BLAS for the solve) computes each
    error value differently, but within ``remez_eval_noise(degree)`` of the exact one: that is
    what the bound in Note [When the Remez exchange stops] derives. So we play several such
    machines: every error value the fit evaluates gets a fresh random error of up to that full
    bound, far more than the 1 to 3 ulp two real machines differ by. If the exchange converges
    and finds the same minimax error under all of them, it converges on any machine whose float64
    arithmetic meets the bound."""
    clean = remez[degree] if pin_one else ch06.remez_fit(degree, pin_one=False)
    exact = ch06.relative_error
    bound = ch06.remez_eval_noise(degree)
    for seed in range(4):
        rng = np.random.default_rng(seed)

        def other_machine(coeffs, f, rng=rng):
            r = exact(coeffs, f)
            return r + rng.uniform(-bound, bound, np.shape(r))

        monkeypatch.setattr(ch06, "relative_error", other_machine)
        fit = ch06.remez_fit(degree, pin_one=pin_one)
        monkeypatch.setattr(ch06, "relative_error", exact)
        assert fit.max_error == pytest.approx(clean.max_error, rel=1e-6), seed
        assert fit.max_error - fit.error <= max(1e-9 * fit.max_error, 4 * bound)


def test_frozen_coefficients_are_the_remez_fit_in_float32(remez):
    for d in ch06.DEGREES:
        frozen = np.array(ch06.exp2_coefficients(d), dtype=F32)
        fresh = remez[d].coeffs.astype(F32)
        ulps = np.abs(ch06.f32_bits(frozen).astype(np.int64) - ch06.f32_bits(fresh))
        assert ulps.max() <= 1, f"degree {d}: regenerate EXP2_COEFFS ({ulps})"
        assert all(float(F32(c)) == c for c in ch06.exp2_coefficients(d))


def test_fit_table_against_bf16_and_fp16():
    rows = {(r["degree"], r["method"]): r["max_rel_error"] for r in ch06.fit_table()}
    assert rows[(2, "minimax (Remez)")] < ch06.BF16_UNIT_ROUNDOFF
    assert rows[(3, "minimax (Remez)")] < ch06.FP16_UNIT_ROUNDOFF  # enough for P in bf16/fp16
    assert rows[(2, "minimax (Remez)")] > ch06.FP16_UNIT_ROUNDOFF  # degree 2 is not


def test_bad_degree_is_refused():
    with pytest.raises(ValueError, match="degree must be one of"):
        ch06.remez_fit(7)
    with pytest.raises(ValueError, match="degree must be one of"):
        ch06.exp2_coefficients(True)


# -- the float32 model ------------------------------------------------------------------------


@pytest.mark.parametrize("degree", ch06.DEGREES)
def test_model_within_proven_bound(degree):
    rng = np.random.default_rng(10 + degree)
    x = np.concatenate([rng.uniform(-126, 127, 300_000), rng.uniform(-1, 0, 50_000),
                        np.arange(-126, 127) + F32(0.5)]).astype(F32)
    err = np.abs(ch06.exp2_f32_model(x, degree) / np.exp2(x.astype(np.float64)) - 1.0)
    bound = ch06.model_error_bound(degree)
    assert err.max() <= bound, (err.max(), bound)
    # The bound is not vacuous: the fit's own error shows up in the samples.
    assert err.max() >= 0.9 * ch06.max_relative_error(ch06.exp2_coefficients(degree))


@pytest.mark.parametrize("nan_safe", [True, False])
def test_model_special_values(nan_safe):
    model = lambda v: ch06.exp2_f32_model(np.array(v, dtype=F32), 3, nan_safe)  # noqa: E731
    ints = np.arange(-126, 128)
    assert np.array_equal(model(ints), np.exp2(ints.astype(np.float64)).astype(F32))
    assert model([0.0])[0] == 1.0 and model([-0.0])[0] == 1.0
    zeros = model([-np.inf, -127.0, -127.5, -200.0, -1e30])
    assert np.all(ch06.f32_bits(zeros) == 0), "x <= -127 must give +0 exactly"
    band = model(np.linspace(-126.99, -126.01, 50))
    assert np.all((band >= 0) & (band < 2.0**-126)), "(-127, -126): below the smallest normal"
    assert model([128.0])[0] == np.inf
    nan = model([np.nan])[0]
    if nan_safe:
        assert np.isnan(nan) and ch06.f32_bits(nan) == ch06.CANONICAL_NAN_BITS
    else:
        assert nan == 0.0


def test_nan_safe_and_fast_agree_on_finite_inputs():
    x = np.random.default_rng(5).uniform(-130, 127, 100_000).astype(F32)
    assert np.array_equal(ch06.f32_bits(ch06.exp2_f32_model(x, 3, True)),
                          ch06.f32_bits(ch06.exp2_f32_model(x, 3, False)))


# -- exercise checkers ------------------------------------------------------------------------


def test_checkers_accept_the_references():
    ch06.check_floor_trick(ch06.floor_trick)
    ch06.check_assemble_exponent(ch06.assemble_exponent)
    ch06.check_max_relative_error(ch06.max_relative_error)


def test_floor_checker_names_round_to_nearest():
    def rounds_to_nearest(x):
        n = (x + F32(ch06.SHIFTER)) - F32(ch06.SHIFTER)
        return n, x - n

    with pytest.raises(AssertionError, match="round-down add of 1.5·2\\^23"):
        ch06.check_floor_trick(rounds_to_nearest)
    def in_float64(x):
        n = ch06.add_rm_f32(x, ch06.SHIFTER).astype(np.float64) - ch06.SHIFTER
        return n, x - n

    with pytest.raises(AssertionError, match="float32"):
        ch06.check_floor_trick(in_float64)
    with pytest.raises(AssertionError, match="pair"):
        ch06.check_floor_trick(lambda x: np.floor(x))


def test_assemble_checker_rejects_wrong_answers():
    with pytest.raises(AssertionError, match="Shift j's bit pattern"):
        ch06.check_assemble_exponent(lambda j, p: (j * p).astype(F32))
    with pytest.raises(AssertionError, match="unchanged"):
        ch06.check_assemble_exponent(lambda j, p: p)

    def no_wraparound(j, p):  # n taken from j's value, negative n clipped to 0
        n = np.maximum(j - F32(ch06.SHIFTER), 0).astype(np.uint32)
        return ch06.bits_f32(ch06.f32_bits(p) + (n << 23))

    with pytest.raises(AssertionError, match="wrap around"):
        ch06.check_assemble_exponent(no_wraparound)


def test_error_checker_rejects_wrong_answers():
    def absolute(coeffs):
        f = np.linspace(0, 1, 4097)
        return np.max(np.abs(np.polynomial.polynomial.polyval(f, coeffs) - np.exp2(f)))

    with pytest.raises(AssertionError, match="absolute error"):
        ch06.check_max_relative_error(absolute)
    with pytest.raises(AssertionError, match="Too small"):
        ch06.check_max_relative_error(
            lambda c: np.max(np.abs(ch06.relative_error(c, np.array([0.0, 0.5]))))
        )


# -- the fraction knob ------------------------------------------------------------------------


def test_emulated_positions_are_exact_in_count_and_spread():
    for k in range(9):
        picked = [i for i in range(8) if ch06.is_emulated(i, k / 8, 8)]
        assert len(picked) == k
    assert [i for i in range(8) if ch06.is_emulated(i, 0.25, 8)] == [0, 4]
    assert [i for i in range(16) if ch06.is_emulated(i, 0.25, 8)] == [0, 4, 8, 12]


def test_bad_fraction_is_refused_with_what_is_accepted():
    with pytest.raises(ValueError, match="k/8"):
        ch06.emulated_count(0.3, 8)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ch06.emulated_count(1.5, 8)
    with pytest.raises(TypeError, match="number"):
        ch06.emulated_count("half", 8)
    with pytest.raises(ValueError, match="period"):
        ch06.emulated_count(0.5, 0)
    with pytest.raises(ValueError, match="k/8"):
        ch06.Exp2Apply(fraction=0.1)


# -- device code, compiled for sm_90a with no GPU ---------------------------------------------

SIZE = 16
FRACTIONS = (0.0, 0.25, 0.5, 1.0)


@pytest.fixture(scope="module")
def fragments():
    return {f: ch06.compile_only("sm_90a", fraction=f, size=SIZE) for f in FRACTIONS}


def test_fraction_knob_moves_exps_from_mufu_to_fma(fragments):
    ex2 = [fragments[f].count("ex2.approx.ftz.f32") for f in FRACTIONS]
    assert ex2 == [round(SIZE * (1 - f)) for f in FRACTIONS]
    for f in FRACTIONS:
        art = fragments[f]
        emulated = round(SIZE * f)
        assert art.count("fma.rn.f32") == 3 * emulated
        assert art.count("add.rm.f32") == emulated and art.count("max.NaN.f32") == emulated
        assert art.count("MUFU.EX2", where="sass") == SIZE - emulated
        assert art.spills == 0
    fragments[1.0].forbid("ex2.approx")
    fragments[1.0].require("FFMA", "FADD.RM", "LEA", "IADD3", where="sass")


def test_one_emulated_exp2_is_nine_instructions():
    census = ch06.instruction_census("sm_90a")
    assert census == {"FMNMX.NAN": 1, "FADD.RM": 1, "FADD": 2, "FFMA": 3, "LEA": 1, "IADD3": 1}
    fast = ch06.instruction_census("sm_90a", nan_safe=False)
    assert "IADD3" not in fast and sum(fast.values()) == 8
    rates = [ch06.exp_rate_model(k / 16, census)["exp_per_clk_sm"] for k in range(17)]
    assert rates[0] == 16.0 and rates[-1] == pytest.approx(128 / 9)
    assert max(rates) > 1.5 * rates[0]  # the mix beats MUFU alone


def test_blackwell_target_compiles_the_same_sequence():
    art = ch06.compile_only("sm_100a", fraction=0.25, size=SIZE)
    assert art.count("fma.rn.f32") == 3 * SIZE // 4 and art.count("ex2.approx") == 3 * SIZE // 4


@cute.kernel
def _ssa_kernel(g_x: cute.Tensor, g_y: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    tile = cute.zipped_divide(g_x, (8,))  # (8, n / 8)
    out = cute.zipped_divide(g_y, (8,))  # (8, n / 8)
    if tidx < cute.size(tile, mode=[1]):
        out[None, tidx].store(ch06.exp2_fragment(tile[None, tidx].load(), fraction=0.5))


@cute.jit
def _ssa(m_x: cute.Tensor, m_y: cute.Tensor, stream):
    _ssa_kernel(m_x, m_y).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)


def test_exp2_fragment_takes_a_tensor_ssa():
    x, y = fake_tensor(Float32, (None,)), fake_tensor(Float32, (None,))
    art = compile_for("sm_90a", _ssa, x, y, fake_stream(), sass=False)
    assert art.count("ex2.approx") == 4 and art.count("fma.rn.f32") == 12


@cute.kernel
def _half_kernel(g_x: cute.Tensor):
    r_h = cute.make_rmem_tensor((8,), cutlass.Float16)  # (8,) a wrong-type fragment
    r_h.fill(0)
    ch06.exp2_fragment(r_h, fraction=0.5)
    g_x[0] = Float32(r_h[0])


@cute.jit
def _half(m_x: cute.Tensor, stream):
    _half_kernel(m_x).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)


def test_exp2_fragment_refuses_a_non_float32_fragment():
    with pytest.raises(TypeError, match="needs a Float32 fragment, got Float16"):
        compile_for("sm_90a", _half, fake_tensor(Float32, (None,)), fake_stream(), sass=False)


# -- exercises 06.4 and 06.5: device code on the CPU, compiled, judged ------------------------


def test_registers_on_the_cpu_behave_like_the_gpus():
    R, I32 = ch06.Reg, ch06.EMU_TYPES["Int32"]
    x = R(np.array([1.5, -2.0], dtype=np.float32))
    assert np.array_equal(x.bitcast(I32).v, np.array([0x3FC00000, -0x40000000], dtype=np.int32))
    big = I32(0x40000000) << 2  # wraps modulo 2^32, like a register
    assert int(big.v) == 0
    assert (I32(-1) + I32(1)).v == 0
    with pytest.raises(AssertionError, match="Python if"):
        bool(x > 0.0)
    with pytest.raises(AssertionError, match="mixes a Float32 and a Int32"):
        x + I32(1)
    y = x + 0.1  # a Python float enters as a float32 constant and the sum rounds once
    assert y.v.dtype == np.float32 and y.v[0] == F32(1.5) + F32(0.1)


def test_emulated_reference_exp2_is_the_model_bit_for_bit():
    x = ch06.exp2_probe_inputs()
    out, log = ch06.emulate(ch06.exp2_device, ch06.Reg(x.copy()))
    assert np.array_equal(ch06.f32_bits(out.v), ch06.f32_bits(ch06.exp2_f32_model(x)))
    assert ("shl", 23) in log and sum(e[0] == "fma" for e in log) == 3


@pytest.mark.parametrize("slip", [kw for kw, _ in ch06._EXP2_SLIPS])
def test_each_named_slip_changes_some_bits(slip):
    x = ch06.exp2_probe_inputs()
    assert not np.array_equal(ch06.f32_bits(ch06._exp2_variant(x, **slip)),
                              ch06.f32_bits(ch06.exp2_f32_model(x)))


def test_device_exercises_pass_on_the_cpu_without_compiling():
    ch06.check_exp2_device(ch06.exp2_device, compile_check=False)
    ch06.check_exp2_split(ch06.exp2_split, compile_check=False)


@pytest.mark.slow
def test_device_exercises_pass_compiled_for_sm90a():
    ch06.check_exp2_device(ch06.exp2_device)
    ch06.check_exp2_split(ch06.exp2_split)
    census = ch06.exp2_sass_census(ch06.exp2_device)
    assert census == ch06.instruction_census("sm_90a")  # the package's exp2 compiles the same


def test_split_positions_are_spread_and_counted():
    for k in range(9):
        pos = ch06.split_positions(k)
        assert len(pos) == k and ch06._spread_ok(pos)
        assert pos == [i for i in range(8) if ch06.is_emulated(i, k / 8, 8)]


def test_stored_measurements_read_as_the_chapter_says():
    from utils import results

    s = ch06.mix_summary(results.load("microbench", gpu="h200"))
    assert s["best"] > s["mufu"] > s["poly"]
    comps = ch06.emulation_comparisons(results.load(ch06.KNOBS_RESULTS, gpu="h200"))
    assert {(d, cfg) for d, _, cfg, _ in comps} >= {(128, c) for c in ch06.EMULATION_CONFIGS}
    assert "speed vs default" in ch06.format_emulation(results.load(ch06.KNOBS_RESULTS,
                                                                    gpu="h200"))


def test_gpu_checks_judge_through_a_cpu_runner():
    """The GPU checks' own logic, with the kernels' runner swapped for the emulation."""
    from tests.exercise_mutations import ch06 as wrong

    run = ch06.emulate_each
    assert ch06.check_exp2_device_on_gpu(ch06.exp2_device, n=1 << 14, run=run)[0]
    ok, lines = ch06.check_exp2_device_on_gpu(wrong.exp2_clamp_drops_nan, n=1 << 14, run=run)
    assert not ok and "first difference at x = np.float32(nan)" in lines[0]
    assert ch06.check_exp2_split_on_gpu(ch06.exp2_split, n=1 << 12, run=run)[0]
    assert not ch06.check_exp2_split_on_gpu(wrong.split_bunched, n=1 << 12, run=run)[0]
