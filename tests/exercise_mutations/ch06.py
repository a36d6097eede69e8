"""Chapter 06's exercises: typical wrong answers, each with the words its checker must say.
The device-code ones (06.4, 06.5) are @cute.jit functions, most of them the reference with one
change (``mutant``)."""


import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32

from solutions import ch06_exp2 as ch06
from tests.exercise_mutations import SLOW, mutant, planted


# --- 06.1 the floor trick ---------------------------------------------------------------------
def floor_by_numpy(x):
    x = np.asarray(x, dtype=np.float32)
    n = np.floor(x)
    return n, x - n


def floor_round_to_nearest(x):
    x = np.asarray(x, dtype=np.float32)
    n = (x + np.float32(ch06.SHIFTER)) - np.float32(ch06.SHIFTER)
    return n, x - n


def floor_shifter_two_to_23(x):
    x = np.asarray(x, dtype=np.float32)
    j = ch06.add_rm_f32(x, np.float32(2.0**23))
    n = j - np.float32(2.0**23)
    return n, x - n


def floor_in_float64(x):
    x = np.asarray(x, dtype=np.float32)
    j = ch06.add_rm_f32(x, ch06.SHIFTER).astype(np.float64)
    n = j - ch06.SHIFTER
    return n, x - n


# --- 06.2 exponent assembly -------------------------------------------------------------------
def assemble_by_ldexp(j, p):
    return np.ldexp(p, (j - np.float32(ch06.SHIFTER)).astype(np.int32)).astype(np.float32)


def assemble_by_value(j, p):
    n = (j - np.float32(ch06.SHIFTER)).astype(np.float64)
    with np.errstate(over="ignore"):
        return (p * 2.0**n).astype(np.float32)


def assemble_shift_24(j, p):
    shifted = (ch06.f32_bits(j).astype(np.uint64) << 24) & 0xFFFFFFFF
    return ch06.bits_f32((shifted + ch06.f32_bits(p)) & 0xFFFFFFFF)


def assemble_returns_p(j, p):
    return np.asarray(p, dtype=np.float32)


# --- 06.3 the fit's error ---------------------------------------------------------------------
def max_absolute_error(coeffs):
    f = np.linspace(0.0, 1.0, 100_001)
    return float(np.max(np.abs(np.polynomial.polynomial.polyval(f, coeffs) - np.exp2(f))))


def max_error_coarse(coeffs):
    f = np.linspace(0.0, 1.0, 4)
    p = np.polynomial.polynomial.polyval(f, coeffs)
    return float(np.max(np.abs(p / np.exp2(f) - 1.0)))


def max_error_by_extrema(coeffs):
    return float(np.max(np.abs(ch06.error_extrema(coeffs)[1])))


# --- 06.4 exp2 in device code -----------------------------------------------------------------
EXP2, SPLIT = ch06.exp2_device, ch06.exp2_split
PICK = "if (i % 8) * k % 8 < k:"

exp2_floor_to_nearest = mutant(  # a plain add rounds to nearest: floor(x) + 1 half the time
    EXP2, "ptx_add_rm(xc, Float32(SHIFTER))", "xc + Float32(SHIFTER)")


exp2_mul_then_add = mutant(  # Horner steps as a multiply and an add: two roundings each
    EXP2, "ptx_fma_rn(Float32(HALF_COEFFS[3]), f, Float32(HALF_COEFFS[2]))",
    "Float32(HALF_COEFFS[3]) * f + Float32(HALF_COEFFS[2])", also=[
        ("ptx_fma_rn(q, f, Float32(HALF_COEFFS[1]))", "q * f + Float32(HALF_COEFFS[1])"),
        ("ptx_fma_rn(q, f, Float32(HALF_COEFFS[0]))", "q * f + Float32(HALF_COEFFS[0])")])


exp2_clamp_drops_nan = mutant(EXP2, ", nan=True)", ")")  # fmax(NaN, -127) is -127



exp2_full_coefficients = mutant(  # p(f), not p(f) / 2: 2^128 overflows near the top
    EXP2, "HALF_COEFFS[", "exp2_coefficients(3)[", 4, also=[(" + Int32(1 << 23)  #", "  #")])


exp2_converts_j = mutant(EXP2, "j.bitcast(Int32) << 23", "Int32(j) << 23")  # value, not bits


exp2_converts_n = mutant(  # right bits, but n through F2I and I2F (MUFU's unit)
    EXP2, "f = xc - (j - Float32(SHIFTER))", "f = xc - Float32(Int32(j - Float32(SHIFTER)))")


@cute.jit
def exp2_calls_the_package(x: Float32) -> Float32:
    return ch06.exp2_poly(x)


@cute.jit
def exp2_on_mufu(x: Float32) -> Float32:
    return cute.math.exp2(x, fastmath=True)


# --- 06.5 the split of a row ------------------------------------------------------------------
split_by_stride = mutant(SPLIT, PICK, "if k > 0 and i % (8 // k) == 0:")  # every 8 // k-th


split_bunched = mutant(SPLIT, PICK, "if i % 8 < k:")  # the first k of each 8


@cute.jit
def split_both_units(frag, k: cutlass.Constexpr):
    for i in cutlass.range_constexpr(cute.size(frag)):
        y = cute.math.exp2(frag[i], fastmath=True)
        if (i % 8) * k % 8 < k:
            y = ch06.exp2_poly(frag[i])
        frag[i] = y


split_by_package = mutant(SPLIT, PICK, "if is_emulated(i, k / 8):")  # the package's choice


split_chosen_at_run_time = mutant(  # the choice made on a run-time Int32
    SPLIT, PICK, "if Int32(i % 8) * k % 8 < k:")


MUTATIONS = [
    *planted("06.1", ch06.check_floor_trick, ch06.floor_trick, ch06.FORBID_FLOOR, rows=[
        (floor_by_numpy, "NumPy's floor is what the trick replaces"),
        (floor_round_to_nearest, "never makes the round-down add of 1.5·2^23"),
        (floor_shifter_two_to_23, "never makes the round-down add of 1.5·2^23"),
        (floor_in_float64, "must be float32 like the GPU registers"),
    ]),
    *planted("06.2", ch06.check_assemble_exponent, ch06.assemble_exponent,
             ch06.FORBID_ASSEMBLE, rows=[
        (assemble_by_ldexp, "ldexp multiplies by 2^n for you"),
        (assemble_by_value, "the exponent field wraps around"),
        (assemble_shift_24, "the exponent field starts at bit 23"),
        (assemble_returns_p, "You returned p unchanged"),
    ]),
    *planted("06.3", ch06.check_max_relative_error, ch06.max_relative_error,
             ch06.FORBID_MAX_ERROR, rows=[
        (max_absolute_error, "That is the absolute error"),
        (max_error_coarse, "Too small: sample [0, 1] densely"),
        (max_error_by_extrema, "the chapter's own search for the extrema"),
    ]),
    *planted("06.4", ch06.check_exp2_device, ch06.exp2_device, ch06.FORBID_EXP2_DEVICE, rows=[
        (exp2_floor_to_nearest, "the floor rounds to nearest"),
        (exp2_mul_then_add, "the Horner steps round twice"),
        (exp2_clamp_drops_nan, "a NaN input comes out as 0"),
        (exp2_full_coefficients, "the largest finite float"),
        (exp2_converts_j, "Int32(j) converts j's value"),
        (exp2_calls_the_package, "the package's finished exp2"),
        (exp2_on_mufu, "MUFU's ex2, the instruction this exercise replaces"),
        (exp2_converts_n, "conversion instructions in the SASS", SLOW),
    ]),
    *planted("06.5", ch06.check_exp2_split, ch06.exp2_split, ch06.FORBID_SPLIT, rows=[
        (split_by_stride, "sends 4 (positions [0, 2, 4, 6]) to the polynomial"),
        (split_bunched, "bunched together"),
        (split_both_units, "went through MUFU and polynomial"),
        (split_by_package, "the package's choice of positions"),
        (split_chosen_at_run_time, "a Python if (or and / or / min / max) on a run-time value"),
    ]),
]

