"""Chapter 06's exercises: typical wrong answers, each with the words its checker must say.
The device-code ones (06.4, 06.5) are @cute.jit functions: the DSL reads their source from this
file."""


import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32

from solutions import ch06_exp2 as ch06
from tests.exercise_mutations import Mutation

H = ch06.HALF_COEFFS


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
@cute.jit
def exp2_floor_to_nearest(x: Float32) -> Float32:
    xc = cute.arch.fmax(x, Float32(-127.0), nan=True)
    j = xc + Float32(ch06.SHIFTER)
    f = xc - (j - Float32(ch06.SHIFTER))
    q = ch06.ptx_fma_rn(Float32(H[3]), f, Float32(H[2]))
    q = ch06.ptx_fma_rn(q, f, Float32(H[1]))
    q = ch06.ptx_fma_rn(q, f, Float32(H[0]))
    return ((j.bitcast(Int32) << 23) + q.bitcast(Int32) + Int32(1 << 23)).bitcast(Float32)


@cute.jit
def exp2_mul_then_add(x: Float32) -> Float32:
    xc = cute.arch.fmax(x, Float32(-127.0), nan=True)
    j = ch06.ptx_add_rm(xc, Float32(ch06.SHIFTER))
    f = xc - (j - Float32(ch06.SHIFTER))
    q = Float32(H[3]) * f + Float32(H[2])
    q = q * f + Float32(H[1])
    q = q * f + Float32(H[0])
    return ((j.bitcast(Int32) << 23) + q.bitcast(Int32) + Int32(1 << 23)).bitcast(Float32)


@cute.jit
def exp2_clamp_drops_nan(x: Float32) -> Float32:
    xc = cute.arch.fmax(x, Float32(-127.0))
    j = ch06.ptx_add_rm(xc, Float32(ch06.SHIFTER))
    f = xc - (j - Float32(ch06.SHIFTER))
    q = ch06.ptx_fma_rn(Float32(H[3]), f, Float32(H[2]))
    q = ch06.ptx_fma_rn(q, f, Float32(H[1]))
    q = ch06.ptx_fma_rn(q, f, Float32(H[0]))
    return ((j.bitcast(Int32) << 23) + q.bitcast(Int32) + Int32(1 << 23)).bitcast(Float32)


C = ch06.exp2_coefficients(3)


@cute.jit
def exp2_full_coefficients(x: Float32) -> Float32:
    xc = cute.arch.fmax(x, Float32(-127.0), nan=True)
    j = ch06.ptx_add_rm(xc, Float32(ch06.SHIFTER))
    f = xc - (j - Float32(ch06.SHIFTER))
    q = ch06.ptx_fma_rn(Float32(C[3]), f, Float32(C[2]))
    q = ch06.ptx_fma_rn(q, f, Float32(C[1]))
    q = ch06.ptx_fma_rn(q, f, Float32(C[0]))
    return ((j.bitcast(Int32) << 23) + q.bitcast(Int32)).bitcast(Float32)


@cute.jit
def exp2_converts_j(x: Float32) -> Float32:
    xc = cute.arch.fmax(x, Float32(-127.0), nan=True)
    j = ch06.ptx_add_rm(xc, Float32(ch06.SHIFTER))
    f = xc - (j - Float32(ch06.SHIFTER))
    q = ch06.ptx_fma_rn(Float32(H[3]), f, Float32(H[2]))
    q = ch06.ptx_fma_rn(q, f, Float32(H[1]))
    q = ch06.ptx_fma_rn(q, f, Float32(H[0]))
    return ((Int32(j) << 23) + q.bitcast(Int32) + Int32(1 << 23)).bitcast(Float32)


@cute.jit
def exp2_converts_n(x: Float32) -> Float32:
    """Right bits, but n goes through an integer conversion and back (F2I, I2F: MUFU's unit)."""
    xc = cute.arch.fmax(x, Float32(-127.0), nan=True)
    j = ch06.ptx_add_rm(xc, Float32(ch06.SHIFTER))
    n = Float32(Int32(j - Float32(ch06.SHIFTER)))
    f = xc - n
    q = ch06.ptx_fma_rn(Float32(H[3]), f, Float32(H[2]))
    q = ch06.ptx_fma_rn(q, f, Float32(H[1]))
    q = ch06.ptx_fma_rn(q, f, Float32(H[0]))
    return ((j.bitcast(Int32) << 23) + q.bitcast(Int32) + Int32(1 << 23)).bitcast(Float32)


@cute.jit
def exp2_calls_the_package(x: Float32) -> Float32:
    return ch06.exp2_poly(x)


@cute.jit
def exp2_on_mufu(x: Float32) -> Float32:
    return cute.math.exp2(x, fastmath=True)


# --- 06.5 the split of a row ------------------------------------------------------------------
@cute.jit
def split_by_stride(frag, k: cutlass.Constexpr):
    for i in cutlass.range_constexpr(cute.size(frag)):
        if k > 0 and i % (8 // k) == 0:
            frag[i] = ch06.exp2_poly(frag[i])
        else:
            frag[i] = cute.math.exp2(frag[i], fastmath=True)


@cute.jit
def split_bunched(frag, k: cutlass.Constexpr):
    for i in cutlass.range_constexpr(cute.size(frag)):
        if i % 8 < k:
            frag[i] = ch06.exp2_poly(frag[i])
        else:
            frag[i] = cute.math.exp2(frag[i], fastmath=True)


@cute.jit
def split_both_units(frag, k: cutlass.Constexpr):
    for i in cutlass.range_constexpr(cute.size(frag)):
        y = cute.math.exp2(frag[i], fastmath=True)
        if (i % 8) * k % 8 < k:
            y = ch06.exp2_poly(frag[i])
        frag[i] = y


@cute.jit
def split_by_package(frag, k: cutlass.Constexpr):
    for i in cutlass.range_constexpr(cute.size(frag)):
        if ch06.is_emulated(i, k / 8):
            frag[i] = ch06.exp2_poly(frag[i])
        else:
            frag[i] = cute.math.exp2(frag[i], fastmath=True)


@cute.jit
def split_chosen_at_run_time(frag, k: cutlass.Constexpr):
    for i in cutlass.range_constexpr(cute.size(frag)):
        if Int32(i % 8) * k % 8 < k:
            frag[i] = ch06.exp2_poly(frag[i])
        else:
            frag[i] = cute.math.exp2(frag[i], fastmath=True)


def _m(ex, check, answer, says, reference, forbid=None, slow=False):
    return Mutation(exercise=ex, check=check, answer=answer, says=says, reference=reference,
                    forbid=forbid or {}, slow=slow)


F1 = (ch06.check_floor_trick, ch06.floor_trick, ch06.FORBID_FLOOR)
F2 = (ch06.check_assemble_exponent, ch06.assemble_exponent, ch06.FORBID_ASSEMBLE)
F3 = (ch06.check_max_relative_error, ch06.max_relative_error, ch06.FORBID_MAX_ERROR)
F4 = (ch06.check_exp2_device, ch06.exp2_device, ch06.FORBID_EXP2_DEVICE)
F5 = (ch06.check_exp2_split, ch06.exp2_split, ch06.FORBID_SPLIT)


def _mut(ex, spec, answer, says, slow=False):
    check, reference, forbid = spec
    return _m(ex, check, answer, says, reference, forbid, slow)


MUTATIONS = [
    _mut("06.1", F1, floor_by_numpy, "NumPy's floor is what the trick replaces"),
    _mut("06.1", F1, floor_round_to_nearest, "never makes the round-down add of 1.5·2^23"),
    _mut("06.1", F1, floor_shifter_two_to_23, "never makes the round-down add of 1.5·2^23"),
    _mut("06.1", F1, floor_in_float64, "must be float32 like the GPU registers"),
    _mut("06.2", F2, assemble_by_ldexp, "ldexp multiplies by 2^n for you"),
    _mut("06.2", F2, assemble_by_value, "the exponent field wraps around"),
    _mut("06.2", F2, assemble_shift_24, "the exponent field starts at bit 23"),
    _mut("06.2", F2, assemble_returns_p, "You returned p unchanged"),
    _mut("06.3", F3, max_absolute_error, "That is the absolute error"),
    _mut("06.3", F3, max_error_coarse, "Too small: sample [0, 1] densely"),
    _mut("06.3", F3, max_error_by_extrema, "the chapter's own search for the extrema"),
    _mut("06.4", F4, exp2_floor_to_nearest, "the floor rounds to nearest"),
    _mut("06.4", F4, exp2_mul_then_add, "the Horner steps round twice"),
    _mut("06.4", F4, exp2_clamp_drops_nan, "a NaN input comes out as 0"),
    _mut("06.4", F4, exp2_full_coefficients, "the largest finite float"),
    _mut("06.4", F4, exp2_converts_j, "Int32(j) converts j's value"),
    _mut("06.4", F4, exp2_calls_the_package, "the package's finished exp2"),
    _mut("06.4", F4, exp2_on_mufu, "MUFU's ex2, the instruction this exercise replaces"),
    _mut("06.4", F4, exp2_converts_n, "conversion instructions in the SASS", slow=True),
    _mut("06.5", F5, split_by_stride, "sends 4 (positions [0, 2, 4, 6]) to the polynomial"),
    _mut("06.5", F5, split_bunched, "bunched together"),
    _mut("06.5", F5, split_both_units, "went through MUFU and polynomial"),
    _mut("06.5", F5, split_by_package, "the package's choice of positions"),
    _mut("06.5", F5, split_chosen_at_run_time, "a Python if (or and / or / min / max) on a "
         "run-time value"),
]

