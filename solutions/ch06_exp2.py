"""Chapter 06: exp2 in software, on the FMA units.

What this adds: a second way to compute 2^x inside the softmax. Chapter 05's kernel sends every
exponential to the MUFU unit (``ex2.approx.ftz.f32``, SASS ``MUFU.EX2``), which does 16 per clock
per SM on Hopper and Blackwell, while the same SM does 128 fp32 FMAs per clock. We rebuild 2^x
from FMAs and integer operations:

    2^x = 2^n * 2^f,   n = floor(x),  f = x - n in [0, 1)
    2^f ~ p(f)         a degree-3 polynomial, 3 FMAs in Horner form
    2^n * p            integer-add n into the exponent field of p's bit pattern

One emulated exp2 costs 9 SASS instructions on sm_90a (1 FMNMX, 3 FADD, 3 FFMA, LEA, IADD3), so
on its own it is not faster than MUFU: at one instruction issued per clock per SM sub-partition
it gives 4 * 32 / 9 = 14.2 exp/clk/SM against MUFU's 16. But the two run on different units, so
a row split between them goes faster than either: with a share phi on the polynomial, a
sub-partition spends 8 * (1 - phi) clocks of MUFU time and (1 - phi) + 9 * phi clocks of issue
per 32 exps; they balance at phi = 7/16, for 28 exp/clk/SM in the model. ``measure.microbench``
measures it on the H200 (results/h200/microbench.json; the notebook prints the figures).

Numerics (all executed in NumPy on a CPU, every step rounded as the GPU rounds it):
- the floor trick: ``add.rm`` of 1.5 * 2^23 leaves floor(x) in the low mantissa bits;
- polynomial fits of degree 2 to 5, least squares and minimax (a Remez exchange written here);
- a float32 model of the exact instruction sequence, bit for bit, with an error bound proved
  below and tested against ``np.exp2``.

Device code (CuTe DSL): ``exp2_poly`` (one value), ``exp2_at`` (MUFU or polynomial by a
compile-time position) and ``exp2_fragment`` (a register fragment with a compile-time
``fraction`` on the polynomial), ready for chapter 05's softmax.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32

from fa4_final.common.fast_math import (  # noqa: F401  (re-exported: the notebook imports them here)
    CLAMP_LOW,
    DEGREES,
    EXP2_COEFFS,
    SHIFTER,
    emulated_count,
    exp2_at,
    exp2_coefficients,
    exp2_poly,
    inline_ptx_f32,
    is_emulated,
    ptx_add_rm,
    ptx_exponent_add,
    ptx_fma_rn,
    ptx_sub_rn,
)
from fa4_final.common.fast_math import check_degree as _check_degree
from utils.claims import claim

# ----------------------------------------------------------------------------------------------
# 1. Float32 bit patterns and the rounding of single instructions

SHIFTER_BITS = 0x4B400000  # of SHIFTER = 1.5 * 2^23 (fa4_final.common.fast_math, with CLAMP_LOW)
CANONICAL_NAN_BITS = 0x7FFFFFFF  # the NaN every GPU fp32 instruction returns
BF16_UNIT_ROUNDOFF = 2.0**-8  # 8 significant bits: 3.9e-3
FP16_UNIT_ROUNDOFF = 2.0**-11  # 11 significant bits: 4.9e-4
FP32_UNIT_ROUNDOFF = 2.0**-24

_F32 = np.float32
_U32 = np.uint32


def as_f32(x) -> np.ndarray:
    """``x`` as a float32 array (a copy only when needed)."""
    return np.asarray(x, dtype=_F32)


def f32_bits(x) -> np.ndarray:
    """The uint32 bit patterns of float32 values."""
    return as_f32(x).view(_U32)  # same item size: works for any shape, 0-d included


def bits_f32(b) -> np.ndarray:
    """Float32 values from uint32 bit patterns."""
    return np.asarray(b, dtype=_U32).view(_F32)


def canonical_nan(x) -> np.ndarray:
    """Replace every NaN by the GPU's canonical NaN 0x7FFFFFFF (x86 makes 0xFFC00000)."""
    x = np.array(x, dtype=_F32, copy=True)
    x[np.isnan(x)] = bits_f32(np.array(CANONICAL_NAN_BITS, dtype=_U32))
    return x


def _two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """s = fl(a + b) and the exact error e, a + b = s + e (Knuth; float64, no overflow)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def add_rm_f32(a, b) -> np.ndarray:
    """PTX ``add.rm.f32``: a + b rounded once toward minus infinity, subnormals kept.

    float64 holds a + b only to 53 bits, so we carry the exact error e of the float64 sum (two-sum)
    and step one float32 down when the float64 sum s sits on or above the true sum a + b + e."""
    a64, b64 = as_f32(a).astype(np.float64), as_f32(b).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s, e = _two_sum(a64, b64)
        r = s.astype(_F32)  # nearest float32 to s
        r64 = r.astype(np.float64)
        step_down = np.isfinite(s) & ((r64 > s) | ((r64 == s) & (e < 0)))
        r = np.where(step_down, np.nextafter(r, _F32(-np.inf)), r)
        # An exact zero sum of opposite signs is -0 when rounding down (IEEE 754, 6.3).
        r = np.where((s == 0) & (e == 0) & (np.signbit(a64) != np.signbit(b64)), _F32(-0.0), r)
    return canonical_nan(r)


def fma_rn_f32(a, b, c) -> np.ndarray:
    """PTX ``fma.rn.f32``: a * b + c with ONE rounding to nearest even, subnormals kept.

    Why float64 is enough, with one precaution:
    1. a * b of two float32 (24-bit significands) has at most 48 bits: exact in float64 (53).
    2. The sum a*b + c is not exact in float64, and rounding twice (to 53 bits, then to 24) can
       go wrong when the first rounding lands exactly on a float32 midpoint
       (``FMA_DOUBLE_ROUNDING_EXAMPLE``). Rounding the first step to ODD instead (keep the
       float64 truncation, force its last bit to 1 if anything was cut off) fixes that:
       RN_24(RO_53(v)) = RN_24(v) whenever 53 >= 24 + 2 (Boldo and Melquiond, 2008). Two-sum
       gives the exact error, which tells us whether anything was cut off and in which direction.
    """
    a64, b64, c64 = (as_f32(v).astype(np.float64) for v in (a, b, c))
    with np.errstate(invalid="ignore", over="ignore"):
        prod = a64 * b64  # exact
        s, e = _two_sum(prod, c64)
        bits = s.view(np.int64)
        inexact = np.isfinite(s) & (e != 0) & (bits % 2 == 0)
        toward = np.where(e > 0, np.inf, -np.inf)
        s_odd = np.where(inexact, np.nextafter(s, toward), s)
        r = s_odd.astype(_F32)
    return canonical_nan(r)


def fma_via_float64_naive(a, b, c) -> np.ndarray:
    """The tempting wrong model: float32(float64(a * b + c)), which rounds twice."""
    a64, b64, c64 = (as_f32(v).astype(np.float64) for v in (a, b, c))
    return (a64 * b64 + c64).astype(_F32)


# a * b + c = 1 + 2^-24 + 2^-54 exactly, just above the midpoint between 1 and 1 + 2^-23: the
# correct float32 is 1 + 2^-23, the float64 detour gives 1.0 (a tie, broken toward even).
FMA_DOUBLE_ROUNDING_EXAMPLE = (1025 * 2.0**-10, 1047553 * 2.0**-44, 1.0)


def sub_rn_f32(a, b) -> np.ndarray:
    """PTX ``sub.rn.f32`` (NumPy's float32 arithmetic is IEEE round-to-nearest)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return canonical_nan(np.subtract(as_f32(a), as_f32(b), dtype=_F32))


def max_f32(a, b, keep_nan: bool = True) -> np.ndarray:
    """PTX ``max.NaN.f32`` (``keep_nan``: a NaN operand gives NaN) or ``max.f32`` (a NaN operand
    is ignored and the other one returned)."""
    a, b = np.broadcast_arrays(as_f32(a), as_f32(b))
    out = np.maximum(a, b) if keep_nan else np.fmax(a, b)
    return canonical_nan(out)


# ----------------------------------------------------------------------------------------------
# 2. Range reduction and exponent assembly (the references of exercises 06.1 and 06.2)
#
# Note [The floor trick]
# Float32 numbers in [2^23, 2^24) are spaced exactly 1 apart. Adding SHIFTER = 1.5 * 2^23 to an x
# with |x| < 2^22 lands in that binade, so the sum is rounded to an integer; rounding toward minus
# infinity (add.rm) makes that integer SHIFTER + floor(x). Its bit pattern is then
# 0x4B400000 + floor(x): floor(x), in two's complement, sits in the low mantissa bits, and
# (j - SHIFTER) recovers it as a float exactly (both numbers are in the same binade).
# Why 1.5 and not 1.0: with 2^23, any negative x takes the sum below 2^23, into [2^22, 2^23)
# where the spacing is 0.5 and the result is no longer an integer; 1.5 * 2^23 sits in the middle
# of its binade and leaves 2^22 of room on both sides.
#
# Note [Exponent assembly]
# A normal float32 with bit pattern b has value 2^(E - 127) * 1.m, with E = b >> 23 (for
# positive numbers). Adding n << 23 to b adds n to E: it multiplies by 2^n, exactly, as long as E
# stays in 1..254. The shift of j's pattern left by 23 throws away all but its low 9 bits, which
# are n mod 512: the shifter's own bits (0x4B400000 has none below bit 22 that survive) vanish
# and no separate integer conversion of n is needed.


def floor_trick(x) -> tuple[np.ndarray, np.ndarray]:
    """floor(x) and frac(x) = x - floor(x) of float32 x in [-2^22, 2^22), by the floor trick."""
    x = as_f32(x)
    j = add_rm_f32(x, SHIFTER)  # SHIFTER + floor(x), exact
    n = sub_rn_f32(j, SHIFTER)  # floor(x) as a float, exact (same binade)
    return n, sub_rn_f32(x, n)


def assemble_exponent(j, p) -> np.ndarray:
    """p * 2^n from j = SHIFTER + n (the float32 of the floor trick) and p, with integer bit
    operations only: (bits(j) << 23) + bits(p), wrapping modulo 2^32 like a 32-bit register."""
    shifted = (f32_bits(j).astype(np.uint64) << 23) & 0xFFFFFFFF
    return bits_f32((shifted + f32_bits(p)) & 0xFFFFFFFF)


# ----------------------------------------------------------------------------------------------
# 3. Polynomial fits of 2^f on [0, 1]
#
# Coefficients are listed lowest degree first: p(f) = c[0] + c[1] f + ... + c[d] f^d.
# The error that matters is relative: p(f) / 2^f - 1, because the exponent assembly multiplies by
# 2^n exactly, so the relative error of p is the relative error of the result.
#
# Note [Pinning p(0) = 1]
# We fix c[0] = 1 and fit the rest. Cost: a slightly larger minimax error (degree 3: 8.56e-5
# instead of 7.48e-5). Gain: 2^x is exact at every integer x (f = 0, p = 1, and the exponent
# assembly is exact), in particular the row maximum of a softmax gives exactly 1, and the
# polynomial agrees with MUFU, which is also exact at integers.


def relative_error(coeffs, f) -> np.ndarray:
    """p(f) / 2^f - 1 in float64 for coefficients lowest degree first."""
    f = np.asarray(f, dtype=np.float64)
    p = np.polynomial.polynomial.polyval(f, np.asarray(coeffs, dtype=np.float64))
    return p * np.exp2(-f) - 1.0


def _runs_of_sign(r: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) index ranges over which r keeps its sign (zeros join their neighbour)."""
    s = np.sign(r)
    nz = np.flatnonzero(s)
    if nz.size == 0:
        return [(0, len(r))]
    s = s[nz[np.clip(np.searchsorted(nz, np.arange(len(r))), 0, nz.size - 1)]]
    cuts = np.flatnonzero(np.diff(s)) + 1
    bounds = np.concatenate([[0], cuts, [len(r)]])
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def _golden_max(fn, lo: np.ndarray, hi: np.ndarray, steps: int = 60) -> np.ndarray:
    """Arg-max of |fn| on each bracket [lo, hi] by golden-section search (vectorised)."""
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo.copy(), hi.copy()
    for _ in range(steps):
        c, d = b - g * (b - a), a + g * (b - a)
        left = np.abs(fn(c)) >= np.abs(fn(d))
        b = np.where(left, d, b)
        a = np.where(left, a, c)
    return (a + b) / 2.0


def error_extrema(coeffs, points: int = 4097) -> tuple[np.ndarray, np.ndarray]:
    """Locations and values of the local extrema of the relative error on [0, 1], one per run of
    constant sign, located to ~1e-12 by golden-section search around the best grid point."""
    t = np.linspace(0.0, 1.0, points)
    r = relative_error(coeffs, t)
    h = t[1] - t[0]
    best = np.array([lo + int(np.argmax(np.abs(r[lo:hi]))) for lo, hi in _runs_of_sign(r)])
    loc = _golden_max(
        lambda u: relative_error(coeffs, u),
        np.clip(t[best] - h, 0.0, 1.0), np.clip(t[best] + h, 0.0, 1.0),
    )
    # An extremum on the edge of [0, 1] stays there (golden search converges inside).
    on_edge = np.abs(relative_error(coeffs, t[best])) >= np.abs(relative_error(coeffs, loc))
    loc = np.where(on_edge, t[best], loc)
    return loc, relative_error(coeffs, loc)


def max_relative_error(coeffs) -> float:
    """max over f in [0, 1] of |p(f) / 2^f - 1| (the reference of exercise 06.3)."""
    _, values = error_extrema(coeffs)
    return float(np.max(np.abs(values)))


def _basis_powers(degree: int, pin_one: bool) -> np.ndarray:
    return np.arange(1 if pin_one else 0, degree + 1)


def _with_constant(c: np.ndarray, pin_one: bool) -> np.ndarray:
    return np.concatenate([[1.0], c]) if pin_one else c


def least_squares_fit(degree: int, pin_one: bool = True) -> np.ndarray:
    """Coefficients minimising the integral over [0, 1] of the squared relative error.

    The relative error r(f) = sum_k c_k f^k 2^-f - 1 is linear in the c_k, so this is a weighted
    linear least-squares problem; the integral is taken by 64-point Gauss-Legendre quadrature
    (exact for the polynomial part far beyond degree 5)."""
    degree = _check_degree(degree)
    nodes, weights = np.polynomial.legendre.leggauss(64)
    t, w = (nodes + 1.0) / 2.0, np.sqrt(weights / 2.0)
    ks = _basis_powers(degree, pin_one)
    a = (t[:, None] ** ks) * np.exp2(-t)[:, None]
    rhs = 1.0 - np.exp2(-t) if pin_one else np.ones_like(t)
    c, *_ = np.linalg.lstsq(a * w[:, None], rhs * w, rcond=None)
    return _with_constant(c, pin_one)


@dataclass
class RemezResult:
    coeffs: np.ndarray  # float64, lowest degree first
    error: float  # the levelled error |E| of the last exchange
    max_error: float  # the true max |relative error| on [0, 1]
    points: np.ndarray  # the reference points where the error equioscillates
    iterations: int


# Note [When the Remez exchange stops]
# Each round gives two numbers that bracket the best possible max error E*: the level |E| of the
# exchange (a lower bound, de la Vallee Poussin) and the worst error found on [0, 1] (an upper
# bound: it is the max error of a real polynomial). The exchange is done when they meet. How
# close they can meet is set by float64, not by the algorithm: every value of the error
# r(f) = p(f) 2^-f - 1 is computed with a small absolute error, because p(f) 2^-f is close to 1
# and the final "- 1" is exact (Sterbenz). With u = 2^-53, relative errors of the pieces:
#   p(f) in [1, 2] by Horner, 2 roundings per degree, positive terms   <= 2d u
#   np.exp2(-f) in [1/2, 1], from a libm within 4 ulp                   <= 8 u
#   the product p(f) 2^-f, rounded once                                 <= u
# They add (to first order), and since the product is within 1e-2 of 1, relative is absolute:
# one evaluation is off by at most (2d + 9) u, 19 u = 2.1e-15 at degree 5. The gap between
# the worst error and the level carries that error twice (both come from evaluations), so we
# stop when the gap is below 4 (2d + 9) u, twice what the noise can make it, or below rtol times
# the worst error when that is larger. At degree 5 the level is 8.2e-8, so float64 locates it to
# about 1e-7 of itself: a stop rule of rtol = 1e-9 alone could be met only by luck, on machines
# whose exp2 happens to round favourably. From the Chebyshev start the fit meets this tolerance
# in a few rounds; tests/test_ch06_exp2.py adds random errors of the full (2d + 9) u to
# every evaluation and checks that it still converges to the same fit.


def remez_eval_noise(degree: int) -> float:
    """Bound on the float64 error of one ``relative_error`` value for a degree-``degree`` fit
    (Note [When the Remez exchange stops])."""
    return (2 * _check_degree(degree) + 9) * 2.0**-53


def remez_fit(degree: int, pin_one: bool = True, max_iter: int = 30,
              rtol: float = 1e-9) -> RemezResult:
    """Minimax (smallest max relative error) fit of 2^f on [0, 1] by the Remez exchange.

    The best approximation's error takes its extreme value m = (number of free coefficients + 1)
    times with alternating signs (Chebyshev's equioscillation theorem). Each round:
    1. solve r(t_i) = (-1)^i E at the m reference points t_i: linear in the coefficients and E;
    2. move the t_i to the extrema of the new error curve (one per run of constant sign);
    until the largest error on [0, 1] exceeds |E| by no more than ``rtol`` times itself or
    than float64 can resolve, whichever is larger (Note [When the Remez exchange stops]).
    With p(0) = 1 pinned the error is 0 at f = 0 and the m = degree + 1 points lie in (0, 1].
    """
    degree = _check_degree(degree)
    ks = _basis_powers(degree, pin_one)
    m = len(ks) + 1
    if pin_one:  # Chebyshev-like start, avoiding f = 0 where the error is pinned to zero
        t = (1.0 - np.cos(np.pi * np.arange(1, m + 1) / m)) / 2.0
    else:
        t = (1.0 - np.cos(np.pi * np.arange(m) / (m - 1))) / 2.0
    signs = (-1.0) ** np.arange(m)
    resolvable = 4.0 * remez_eval_noise(degree)  # twice the noise of a gap of two evaluations
    for it in range(1, max_iter + 1):
        w = np.exp2(-t)
        a = np.column_stack([(t[:, None] ** ks) * w[:, None], -signs])
        rhs = 1.0 - w if pin_one else np.ones_like(t)
        sol = np.linalg.solve(a, rhs)
        coeffs, level = _with_constant(sol[:-1], pin_one), abs(sol[-1])
        loc, val = error_extrema(coeffs)
        worst = float(np.max(np.abs(val)))
        tolerance = max(rtol * worst, resolvable)
        if worst - level <= tolerance:
            return RemezResult(coeffs, level, worst, t, it)
        if len(loc) < m:
            raise RuntimeError(
                f"Remez (degree {degree}) lost the alternation: {len(loc)} extrema, need {m}"
            )
        # Keep m consecutive extrema that include the worst one (they alternate by construction).
        top = int(np.argmax(np.abs(val)))
        start = min(max(top - m + 1, 0), len(loc) - m)
        starts = range(start, min(top, len(loc) - m) + 1)
        start = max(starts, key=lambda s: np.min(np.abs(val[s:s + m])))
        t = loc[start:start + m]
    raise RuntimeError(
        f"Remez (degree {degree}) did not converge in {max_iter} iterations: worst error "
        f"{worst:.6e}, level {level:.6e}, gap {worst - level:.2e} > tolerance {tolerance:.2e}"
    )


# The float32 coefficients the GPU uses: remez_fit(d).coeffs rounded to float32, frozen in
# fa4_final.common.fast_math (EXP2_COEFFS, exp2_coefficients) so every machine compiles the same
# kernel; tests/test_ch06_exp2.py checks that a fresh fit still rounds to them. Regenerate with
# ``python -m solutions.ch06_exp2 --coefficients``.


def fit_table() -> list[dict]:
    """Max relative error per degree and method, next to bf16 and fp16 rounding."""
    rows = []
    for d in DEGREES:
        for method, coeffs in (
            ("least squares", least_squares_fit(d)),
            ("minimax (Remez)", remez_fit(d).coeffs),
            ("minimax, float32 coefficients", np.array(exp2_coefficients(d))),
        ):
            err = max_relative_error(coeffs)
            rows.append({"degree": d, "method": method, "max_rel_error": err,
                         "vs_bf16": err / BF16_UNIT_ROUNDOFF, "vs_fp16": err / FP16_UNIT_ROUNDOFF})
    return rows


# ----------------------------------------------------------------------------------------------
# 4. The float32 model of the GPU instruction sequence
#
# Note [The instruction sequence]  (what exp2_poly emits; each line is one PTX instruction)
#   xc = max.NaN.f32(x, -127)          clamp: -inf and x < -127 become -127, NaN stays NaN
#   j  = add.rm.f32(xc, 1.5 * 2^23)    SHIFTER + floor(xc), exact (Note [The floor trick])
#   n  = sub.rn.f32(j, 1.5 * 2^23)     floor(xc), exact
#   f  = sub.rn.f32(xc, n)             in [0, 1]; exact except for xc in (-1, 0)
#   q  = fma.rn.f32 x degree           Horner with the coefficients HALVED: q = p(f) / 2
#   y  = (j << 23) + bits(q) + 2^23    integer: adds n + 1 to q's exponent = p(f) * 2^n
#
# Note [Special values]
# Why q = p/2 and the extra 2^23: a NaN input reaches the end as the canonical NaN 0x7FFFFFFF in
# both j and q. (j << 23) of it is 0xFF800000, i.e. -1 in the exponent field: with the plain
# "(j << 23) + bits(p)" the NaN would come out as 0x7F7FFFFF, the largest finite float. Carrying
# the +1 as a separate 2^23 term makes the NaN case wrap to 0x7FFFFFFF (NaN) while every finite
# case is unchanged: halving the coefficients halves every Horner step exactly. Cost: one
# integer add (an IADD3 next to the LEA). ``nan_safe=False`` drops it and uses the plain max
# (a NaN input then gives 0, as FA4's emulation does).
#   x = 0 or any integer in [-126, 127]   exactly 2^x (p(0) = 1)
#   x = -inf, x <= -127                    exactly +0 (n = -127, p = 1: the sum is 0)
#   -127 < x < -126                        a subnormal pattern below 2^-126 (error < 2^-126); MUFU
#                                          gives 0 here; any .ftz instruction reads either as 0
#   x = NaN                                NaN (nan_safe) or 0
#   x >= 128, +inf                         outside the domain: wrong (a softmax never goes past
#                                          its rescale threshold, 8 in chapter 07)


def exp2_f32_model(x, degree: int = 3, nan_safe: bool = True) -> np.ndarray:
    """2^x exactly as the GPU's ``exp2_poly`` computes it, bit for bit (NaN: canonical)."""
    coeffs = exp2_coefficients(degree)
    half = [c / 2.0 for c in coeffs] if nan_safe else list(coeffs)
    x = as_f32(x)
    xc = max_f32(x, CLAMP_LOW, keep_nan=nan_safe)
    j = add_rm_f32(xc, SHIFTER)
    n = sub_rn_f32(j, SHIFTER)
    f = sub_rn_f32(xc, n)
    q = np.full_like(f, half[-1])
    for c in half[-2::-1]:
        q = fma_rn_f32(q, f, c)
    total = ((f32_bits(j).astype(np.uint64) << 23) + f32_bits(q)) + (2**23 if nan_safe else 0)
    return bits_f32(total & 0xFFFFFFFF)


def model_error_bound(degree: int = 3) -> float:
    """A proven bound on |model(x) / 2^x - 1| for float32 x in [-126, 127).

    model(x) = 2^n * p32(f32) exactly (the exponent assembly is exact for normal results, and
    p32 >= 1 because every coefficient is positive), so three factors multiply:
    - the fit: |p(f) / 2^f - 1| <= E_fit, the max over [0, 1] of the float32 coefficients'
      polynomial in exact arithmetic (``max_relative_error``);
    - Horner in float32: each FMA rounds once, |delta| <= u = 2^-24; with positive coefficients
      and f >= 0 nothing cancels and the c_k f^k term meets at most ``degree`` roundings, so
      p32 / p lies within (1 +- u)^degree;
    - the reduced argument: f = x - n is exact except for x in (-1, 0), where x + 1 is rounded,
      |f32 - f| <= 2^-25, changing 2^f by a factor within 2^(+-2^-25).
    """
    fit = max_relative_error(exp2_coefficients(degree))
    horner = (1.0 + FP32_UNIT_ROUNDOFF) ** degree
    arg = 2.0 ** (2.0**-25)
    return (1.0 + fit) * horner * arg - 1.0


# ----------------------------------------------------------------------------------------------
# 5. Exercise checkers: each raises AssertionError in plain words, and judges the method too:
#    the exercises forbid the NumPy shortcuts (the FORBID_* tables, passed as ``forbid=``) and
#    the checkers run the answer with the chapter's helpers swapped for recording stand-ins, to
#    see that the trick was done (the round-down add of 1.5 * 2^23, the integer shift).

FORBID_FLOOR = {
    np.floor: "NumPy's floor is what the trick replaces: the GPU has no cheap floor",
    np.ceil: "a rounding function is what the trick replaces",
    np.trunc: "a rounding function is what the trick replaces",
    np.rint: "a rounding function is what the trick replaces",
    np.round: "a rounding function is what the trick replaces",
    np.fix: "a rounding function is what the trick replaces",
    np.modf: "modf splits x for you; the trick is the round-down add",
    np.fmod: "a remainder is what the trick replaces",
    np.remainder: "a remainder is what the trick replaces",
    np.divmod: "divmod rounds for you; the trick is the round-down add",
    math.floor: "a floor is what the trick replaces",
}
FORBID_ASSEMBLE = {
    np.ldexp: "ldexp multiplies by 2^n for you; build it from the bit patterns",
    np.exp2: "exp2 is the function this chapter builds",
    np.power: "a power computes 2^n by value; build it from the bit patterns",
    np.float_power: "a power computes 2^n by value; build it from the bit patterns",
    math.ldexp: "ldexp multiplies by 2^n for you; build it from the bit patterns",
    math.pow: "a power computes 2^n by value; build it from the bit patterns",
    np.frexp: "frexp reads the exponent for you; work on the bit patterns",
}


def _undecorated(fn):
    """The Python function behind ``fn`` as written (a ``@cute.jit`` function's original code
    even after the DSL compiled it; see utils.host_emulation.plain)."""
    raw = getattr(fn, "__wrapped__", fn)
    code = getattr(raw, "_original_code", None) or raw.__code__
    return raw, code


def swapped(fn, swap: dict, modules=()):
    """``fn`` (as written) with every object of ``swap`` ({original: stand-in}) replaced where
    its code names it: a global name, or an attribute of one of ``modules``. Returns
    (the function, a context manager that patches the modules' attributes while it runs)."""
    import types
    from contextlib import ExitStack

    from utils.host_emulation import patched

    by_id = {id(k): v for k, v in swap.items()}
    raw, code = _undecorated(fn)
    scope = dict(raw.__globals__)
    for name, value in list(scope.items()):
        if id(value) in by_id:
            scope[name] = by_id[id(value)]
    clone = types.FunctionType(code, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    clone.__kwdefaults__ = getattr(raw, "__kwdefaults__", None)

    def patches():
        stack = ExitStack()
        for mod in modules:
            attrs = {name: by_id[id(v)] for name, v in vars(mod).items() if id(v) in by_id}
            if attrs:
                stack.enter_context(patched(mod, **attrs))
        return stack

    return clone, patches


def _recorded_calls(fn, helper, args):
    """Run ``fn(*args)`` with ``helper`` (a function of this module) recording its calls;
    returns (fn's result, [the arguments of each call])."""
    import sys

    calls = []

    def recorder(*a, **kw):
        calls.append(a)
        return helper(*a, **kw)

    clone, patches = swapped(fn, {helper: recorder}, [sys.modules[__name__]])
    with patches():
        out = clone(*args)
    return out, calls


def _probe_points() -> np.ndarray:
    rng = np.random.default_rng(6)
    edge = [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 2.7, -2.7, -1e-7, 1e-7, 126.5, -126.5, -127.0,
            np.nextafter(_F32(3), _F32(0)), np.nextafter(_F32(-3), _F32(0)),
            np.nextafter(_F32(-3), _F32(-4)), -100.25]
    return as_f32(np.concatenate([edge, rng.uniform(-127, 127, 2000)]))


def check_floor_trick(fn) -> None:
    """Exercise 06.1: fn(x) -> (floor(x), x - floor(x)) as float32, by the floor trick: the
    answer must make the round-down add of 1.5 * 2^23 (``add_rm_f32``; NumPy's rounding
    functions are forbidden by FORBID_FLOOR)."""
    x = _probe_points()
    out, calls = _recorded_calls(fn, add_rm_f32, (x.copy(),))
    assert isinstance(out, tuple) and len(out) == 2, (
        f"return a pair (n, f), got {type(out).__name__}"
    )
    n, f = (np.asarray(v) for v in out)
    assert n.shape == x.shape and f.shape == x.shape, (
        f"n and f must have the shape of x {x.shape}, got {n.shape} and {f.shape}"
    )
    assert n.dtype == _F32 and f.dtype == _F32, (
        f"n and f must be float32 like the GPU registers, got {n.dtype} and {f.dtype}"
    )
    magic = [c for c in calls if any(np.all(as_f32(a) == _F32(SHIFTER)) for a in c[:2])]
    assert magic, (
        "your floor never makes the round-down add of 1.5·2^23 (add_rm_f32(x, SHIFTER)): the "
        "trick is that one add, which leaves floor(x) in the low bits of the sum; a floor "
        "computed any other way needs a conversion instruction on the GPU"
    )
    want = floor_trick(x)[0]
    bad = np.flatnonzero(n != want)
    if bad.size:
        i = bad[0]
        hint = ""
        if n[i] == np.round(x[i]):
            hint = (" It looks rounded to nearest: an ordinary float32 add rounds to nearest; "
                    "the trick needs the add that rounds toward minus infinity (add_rm_f32).")
        raise AssertionError(f"floor({x[i]!r}) should be {want[i]!r}, you gave {n[i]!r}.{hint}")
    want_f = sub_rn_f32(x, want)
    bad = np.flatnonzero(f != want_f)
    if bad.size:
        i = bad[0]
        raise AssertionError(
            f"for x = {x[i]!r} the fraction x - floor(x) should be {want_f[i]!r} "
            f"(in [0, 1]), you gave {f[i]!r}"
        )


def check_assemble_exponent(fn) -> None:
    """Exercise 06.2: fn(j, p) -> (bits(j) << 23) + bits(p) as float32, j = SHIFTER + n: p * 2^n
    for n in [-126, 127], and what a 32-bit register gives past that (the exponent field wraps:
    n = -127 gives +0 for p = 1, which the model relies on for x <= -127), so 2^n computed by
    value does not pass (NumPy's ldexp and powers are forbidden by FORBID_ASSEMBLE)."""
    rng = np.random.default_rng(62)
    n = np.concatenate([np.arange(-126, 128), rng.integers(-126, 128, 500), [-127, -127, 128]])
    p = as_f32(np.concatenate([np.ones(254), rng.uniform(1.0, 2.0, 500), [1.0, 1.5, 1.5]]))
    j = as_f32(SHIFTER + n)
    got = np.asarray(fn(j.copy(), p.copy()))
    assert got.shape == p.shape, f"expected shape {p.shape}, got {got.shape}"
    assert got.dtype == _F32, f"the result must be float32, got {got.dtype}"
    want = assemble_exponent(j, p)
    bad = np.flatnonzero(f32_bits(got) != f32_bits(want))
    if bad.size:
        inside = bad[(n[bad] >= -126) & (n[bad] <= 127)]
        i = inside[0] if inside.size else bad[0]
        if not inside.size:
            raise AssertionError(
                f"for n = {n[i]} and p = {p[i]!r} a 32-bit register gives "
                f"{int(f32_bits(want[i])):#010x} ({want[i]!r}): the exponent field wraps "
                f"around. You gave {int(f32_bits(got[i])):#010x} ({got[i]!r}), p * 2^n by value. "
                "Work on the bit patterns: (bits(j) << 23) + bits(p), as integers, modulo 2^32"
            )
        shifted = {s: (f32_bits(j).astype(np.uint64) << s) + f32_bits(p) for s in (22, 24)}
        wrong_shift = [s for s, v in shifted.items()
                       if np.array_equal(f32_bits(got), (v & 0xFFFFFFFF).astype(_U32))]
        if wrong_shift:
            hint = (f" You shifted by {wrong_shift[0]}: the exponent field starts at bit 23 "
                    "(23 mantissa bits below it), so n << 23 adds n to it.")
        elif np.all(n[bad] < 0):
            hint = " Negative n must wrap around modulo 2^32, as in a 32-bit register."
        elif np.array_equal(got, p):
            hint = " You returned p unchanged: n still has to go into its exponent bits."
        else:
            hint = (" Shift j's bit pattern (f32_bits) left by 23, keep 32 bits (mask with "
                    "0xFFFFFFFF) and add the bit pattern of p, as integers.")
        raise AssertionError(
            f"for n = {n[i]} and p = {p[i]!r}, p * 2^n = {want[i]!r}, you gave {got[i]!r}.{hint}"
        )


FORBID_MAX_ERROR = {
    error_extrema: "that is the chapter's own search for the extrema",
    relative_error: "write p(f) / 2^f - 1 yourself",
}


def check_max_relative_error(fn) -> None:
    """Exercise 06.3: fn(coeffs) -> max over f in [0, 1] of |p(f) / 2^f - 1|."""
    cases = [exp2_coefficients(3), exp2_coefficients(2), (1.0, 0.7, 0.25, 0.05),
             (1.0, 1.0)]
    for coeffs in cases:
        want = max_relative_error(coeffs)
        got = fn(tuple(coeffs))
        assert np.isscalar(got) or np.ndim(got) == 0, (
            f"return one number, got {type(got).__name__}"
        )
        got = float(got)
        if abs(got - want) > 0.01 * want:
            f = np.linspace(0.0, 1.0, 4097)
            p = np.polynomial.polynomial.polyval(f, coeffs)
            absolute = float(np.max(np.abs(p - np.exp2(f))))
            hint = ""
            if abs(got - absolute) <= 0.01 * absolute:
                hint = " That is the absolute error; divide by 2^f for the relative error."
            elif got < want:
                hint = " Too small: sample [0, 1] densely, ends included."
            raise AssertionError(
                f"for coefficients {tuple(coeffs)} the max relative error is {want:.4e}, "
                f"you gave {got:.4e}.{hint}"
            )


# ----------------------------------------------------------------------------------------------
# 6. Device code: the same sequence in CuTe DSL
#
# Each helper emits exactly one PTX instruction with its rounding mode written out, so nothing
# depends on LLVM's floating-point contraction and the PTX reads like the model above.


# The helpers live in fa4_final.common.fast_math (the kernels of chapters 05-10 use them from
# there):
# inline_ptx_f32, ptx_add_rm, ptx_sub_rn, ptx_fma_rn, ptx_exponent_add (one instruction each),
# exp2_poly (Note [The instruction sequence]), emulated_count / is_emulated (which elements of a
# row go to the polynomial) and exp2_at (MUFU or the polynomial, by position). This chapter
# imports them at the top and builds on them here.


@cute.jit
def exp2_fragment(
    frag,
    fraction: cutlass.Constexpr = 0.0,
    period: cutlass.Constexpr = 8,
    degree: cutlass.Constexpr = 3,
    nan_safe: cutlass.Constexpr = True,
):
    """2^x of every element of a float32 register fragment, a ``fraction`` of them on the FMA
    polynomial and the rest on MUFU (which ones: ``is_emulated``, by flat index).

    ``frag``: a ``cute.Tensor`` in registers (rewritten in place and returned) or a
    ``cute.TensorSSA`` (a new TensorSSA is returned). ``fraction``, ``period``, ``degree``,
    ``nan_safe`` are compile-time: each element's instruction sequence is fixed when the kernel
    is built, no branches. Chapter 05's softmax plugs it in after its scale-and-subtract FFMA:
    ``exp2_fragment(s_row, fraction=0.25)``; see ``exp2_at`` to fuse it into that loop instead.
    """
    emulated_count(fraction, period)  # raises at compile time on a bad fraction
    if cutlass.const_expr(isinstance(frag, cute.TensorSSA)):
        r_frag = cute.make_rmem_tensor(frag.shape, Float32)
        r_frag.store(frag)
        exp2_fragment(r_frag, fraction, period, degree, nan_safe)
        return r_frag.load()
    else:
        if cutlass.const_expr(frag.element_type is not Float32):
            raise TypeError(f"exp2_fragment needs a Float32 fragment, got {frag.element_type}")
        for i in cutlass.range_constexpr(cute.size(frag)):
            frag[i] = exp2_at(frag[i], i, fraction, period, degree, nan_safe)
        return frag


# ----------------------------------------------------------------------------------------------
# 7. A kernel around the helpers: each thread exps `size` consecutive values in registers


class Exp2Apply:
    """y = 2^x elementwise over a 1-D float32 tensor whose length is a multiple of ``size``;
    each thread loads ``size`` values into a register fragment and calls ``exp2_fragment``."""

    threads = 128

    def __init__(self, fraction=1.0, size: int = 16, period: int = 8, degree: int = 3,
                 nan_safe: bool = True):
        emulated_count(fraction, period)
        _check_degree(degree)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.fraction, self.size, self.period = fraction, size, period
        self.degree, self.nan_safe = degree, bool(nan_safe)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
        # (size, n / size): column t is thread t's fragment
        gX = cute.zipped_divide(mX, (self.size,))
        gY = cute.zipped_divide(mY, (self.size,))
        tiles = cute.size(gX, mode=[1])
        self.kernel(gX, gY, tiles).launch(
            grid=(cute.ceil_div(tiles, self.threads), 1, 1), block=(self.threads, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, gX: cute.Tensor, gY: cute.Tensor, tiles):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx * self.threads + tidx
        if t < tiles:
            r_x = cute.make_rmem_tensor((self.size,), Float32)  # (size,) in registers
            r_x.store(gX[None, t].load())
            exp2_fragment(r_x, self.fraction, self.period, self.degree, self.nan_safe)
            gY[None, t].store(r_x.load())


_COMPILED: dict = {}


def apply_exp2(x, fraction=1.0, size: int = 16, period: int = 8, degree: int = 3,
               nan_safe: bool = True):
    """Run ``Exp2Apply`` on a 1-D float32 CUDA tensor (padded to a multiple of ``size``).

    Element e uses the polynomial iff ``is_emulated(e % size, fraction, period)``."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack

    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 1:
        raise TypeError("x must be a 1-D torch.float32 tensor")
    if x.device.type != "cuda":
        raise ValueError(f"x must be on a CUDA device, got {x.device}")
    n = x.numel()
    padded = torch.zeros(-(-n // size) * size, dtype=torch.float32, device=x.device)
    padded[:n] = x
    out = torch.empty_like(padded)
    args = [from_dlpack(t, assumed_align=16).mark_layout_dynamic() for t in (padded, out)]
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    key = (fraction, size, period, degree, bool(nan_safe))
    if key not in _COMPILED:
        _COMPILED[key] = cute.compile(Exp2Apply(*key), *args, stream)
    _COMPILED[key](*args, stream)
    return out[:n]


def compile_only(arch: str = "sm_90a", fraction=1.0, size: int = 16, period: int = 8,
                 degree: int = 3, nan_safe: bool = True):
    """Compile ``Exp2Apply`` for ``arch`` with no GPU: PTX, SASS, registers."""
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    x = fake_tensor(Float32, (None,))
    y = fake_tensor(Float32, (None,))
    op = Exp2Apply(fraction, size, period, degree, nan_safe)
    return compile_for(arch, op, x, y, fake_stream())


# ----------------------------------------------------------------------------------------------
# 8. Counting one emulated exp2's instructions in the SASS

# Which unit executes a SASS opcode on Hopper (per SM per clock: FMA pipe 128 lanes, integer/
# logic ALU 64, MUFU/conversion 16; one warp instruction issued per clock per sub-partition).
PIPES = {
    "fma": {"FFMA", "FADD", "FMUL", "FFMA32I", "FADD32I", "FMUL32I", "IMAD", "HFMA2"},
    "alu": {"FMNMX", "IADD3", "LEA", "LOP3", "SHF", "SEL", "FSEL", "FSETP", "ISETP", "IMNMX",
            "PRMT", "MOV", "IABS"},
    "mufu": {"MUFU", "F2I", "I2F", "FRND", "F2F"},
}
_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_SCAFFOLD = {"NOP", "EXIT", "BRA", "RET"}
_CONSTANT_LOADS = ("MOV", "HFMA2.MMA", "IMAD.MOV", "IMAD.MOV.U32", "UMOV")


def sass_opcodes(sass: str) -> Counter:
    """Opcode (with its modifiers, e.g. FADD.RM) -> count over a SASS listing."""
    ops = Counter(m.group(1) for m in _SASS_LINE.finditer(sass))
    return Counter({k: v for k, v in ops.items() if k not in _SCAFFOLD})


def pipe_of(opcode: str) -> str:
    base = opcode.split(".")[0]
    return next((p for p, names in PIPES.items() if base in names), "other")


def instruction_census(arch: str = "sm_90a", degree: int = 3, nan_safe: bool = True) -> Counter:
    """SASS opcodes of ONE emulated exp2: a kernel applying it to one value per thread, minus
    the same kernel with MUFU, plus the one MUFU.EX2 that removes. Constant loads (MOV, HFMA2
    of immediates) are left out: inside a loop they are hoisted."""
    poly = compile_only(arch, fraction=1.0, size=1, period=1, degree=degree, nan_safe=nan_safe)
    mufu = compile_only(arch, fraction=0.0, size=1, period=1, degree=degree, nan_safe=nan_safe)
    diff = sass_opcodes(poly.sass)
    diff.subtract(sass_opcodes(mufu.sass))
    diff["MUFU.EX2"] += 1
    return Counter({k: v for k, v in diff.items() if v > 0 and k not in _CONSTANT_LOADS})


def exp_rate_model(fraction: float, census: Counter) -> dict:
    """Exps per clock per SM with a share ``fraction`` emulated, from the instruction counts of
    one emulated exp (``instruction_census``).

    Per SM sub-partition and per 32 exps (one warp instruction each): MUFU and conversions 8
    clocks per instruction (4 lanes), FMA pipe 1 clock (2 x 16 lanes), ALU 2 clocks (16 lanes),
    and 1 issue slot per instruction. The busiest of these sets the pace; 4 sub-partitions per
    SM. A model: it ignores latency, register-bank conflicts and the loop's own instructions."""
    per_pipe = Counter()
    for op, n in census.items():
        per_pipe[pipe_of(op)] += n
    clocks = {
        "mufu": 8.0 * ((1.0 - fraction) + fraction * per_pipe["mufu"]),
        "issue": (1.0 - fraction) * 1.0 + fraction * sum(census.values()),
        "fma": fraction * per_pipe["fma"],
        "alu": 2.0 * fraction * per_pipe["alu"],
    }
    binding = max(clocks, key=clocks.get)
    return {"fraction": fraction, "exp_per_clk_sm": 4 * 32 / clocks[binding],
            "binding": binding, **{f"clk_{k}": v for k, v in clocks.items()}}


# ----------------------------------------------------------------------------------------------
# 9. Exercises 06.4 and 06.5 (device code): run on the CPU, compiled for sm_90a, run on a GPU
#
# Note [Device code on the CPU]
# A @cute.jit function is Python that builds a program. Run as plain Python with NumPy values in
# place of the DSL's (utils.host_emulation), the same source computes what the GPU computes: a
# value becomes a ``Reg``, a float32 or int32 array with one entry per thread; its operators
# round once to nearest, as the GPU's FADD/FMUL do, and wrap modulo 2^32 for integers; each
# one-instruction helper (ptx_add_rm, ptx_sub_rn, ptx_fma_rn) becomes this module's float32
# model of that instruction, and MUFU's ex2 becomes float32(2^x), flushed to zero below 2^-126.
# So a learner's exp2 runs on a quarter of a million inputs at once and its bit patterns are
# compared with exp2_f32_model's. Only the helpers' models are trusted; everything the learner
# writes runs as written. The compile step then checks what emulation cannot see: which SASS
# instructions the code became.

HALF_COEFFS = tuple(c / 2.0 for c in exp2_coefficients(3))  # Note [Special values]: halved


class Reg:
    """One DSL register value for many threads at once: a float32, int32 or bool NumPy array.

    Operators as the DSL's: float32 ones round once to nearest, int32 ones wrap modulo 2^32,
    ``<<`` is a logical shift, ``bitcast`` reinterprets bits. A Python ``if`` on a Reg is an
    error: on the GPU it would be a branch on a run-time value."""

    __slots__ = ("v",)
    __array_ufunc__ = None  # NumPy scalars defer to Reg's own operators

    def __init__(self, v):
        self.v = np.asarray(v)

    @property
    def is_float(self) -> bool:
        return self.v.dtype == _F32

    def _other(self, other):
        if isinstance(other, Reg):
            if other.v.dtype != self.v.dtype:
                raise AssertionError(
                    f"an operation mixes a {_type_name(self)} and a {_type_name(other)}: "
                    "convert or bitcast one of them first (x.bitcast(Int32) reads a float's "
                    "bits)")
            return other.v
        if isinstance(other, (bool, np.bool_)):
            return np.asarray(other)
        if self.is_float and isinstance(other, (int, float, np.integer, np.floating)):
            return _F32(other)
        if self.v.dtype == np.int32 and isinstance(other, (int, np.integer)):
            return np.int64(int(other))
        raise AssertionError(f"an operation mixes a {_type_name(self)} and "
                             f"{type(other).__name__} {other!r}")

    def _float(self, op, other, reverse=False):
        b = self._other(other)
        a, b = (b, self.v) if reverse else (self.v, b)
        with np.errstate(all="ignore"):
            return Reg(canonical_nan(op(a, b)))

    def _int(self, op, other, reverse=False):
        b = self._other(other)
        a, b = (b, self.v) if reverse else (self.v, b)
        wide = op(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))
        return Reg((wide & 0xFFFFFFFF).astype(_U32).view(np.int32))

    def _arith(self, op, other, reverse=False):
        if self.v.dtype == np.bool_:
            raise AssertionError("arithmetic on a comparison's result: use it in a select")
        return (self._float if self.is_float else self._int)(op, other, reverse)

    def __add__(self, o):
        return self._arith(np.add, o)

    def __radd__(self, o):
        return self._arith(np.add, o, True)

    def __sub__(self, o):
        return self._arith(np.subtract, o)

    def __rsub__(self, o):
        return self._arith(np.subtract, o, True)

    def __mul__(self, o):
        return self._arith(np.multiply, o)

    def __rmul__(self, o):
        return self._arith(np.multiply, o, True)

    def __neg__(self):
        return self._arith(np.subtract, 0, True) if not self.is_float else Reg(-self.v)

    def __mod__(self, o):
        if self.is_float:
            raise AssertionError("% of a Float32: the GPU has no such instruction")
        return self._int(lambda a, b: np.fmod(a, b), o)

    def __floordiv__(self, o):
        if self.is_float:
            raise AssertionError("// of a Float32: the GPU has no such instruction")
        return self._int(lambda a, b: np.trunc(a / b).astype(np.int64), o)

    def __truediv__(self, o):
        raise AssertionError("a division is a multi-instruction sequence on the GPU; the exp2 "
                             "needs none")

    def __pow__(self, o):
        raise AssertionError("** has no GPU instruction: 2^n comes from the exponent bits")

    def _shift(self, amount, left: bool):
        if self.is_float:
            raise AssertionError("a shift of a Float32: shift its bit pattern, "
                                 "x.bitcast(Int32) << 23")
        amt = int(amount.v) if isinstance(amount, Reg) else int(amount)
        _log("shl" if left else "shr", amt)
        if left:
            return self._int(lambda a, b: a << b, amt)
        return Reg(self.v >> np.int32(amt))

    def __lshift__(self, amount):
        return self._shift(amount, True)

    def __rshift__(self, amount):
        return self._shift(amount, False)

    def _bits(self, op, other):
        b = self._other(other)
        return Reg(op(self.v, np.asarray(b).astype(self.v.dtype)))

    def __and__(self, o):
        return self._bits(np.bitwise_and, o)

    def __or__(self, o):
        return self._bits(np.bitwise_or, o)

    def __xor__(self, o):
        return self._bits(np.bitwise_xor, o)

    __rand__, __ror__, __rxor__ = __and__, __or__, __xor__

    def _cmp(self, op, other):
        with np.errstate(all="ignore"):
            return Reg(op(self.v, self._other(other)))

    def __lt__(self, o):
        return self._cmp(np.less, o)

    def __le__(self, o):
        return self._cmp(np.less_equal, o)

    def __gt__(self, o):
        return self._cmp(np.greater, o)

    def __ge__(self, o):
        return self._cmp(np.greater_equal, o)

    def __eq__(self, o):
        return self._cmp(np.equal, o)

    def __ne__(self, o):
        return self._cmp(np.not_equal, o)

    __hash__ = None

    def __bool__(self):
        raise AssertionError(
            "a Python if (or and / or / min / max) on a run-time value, which on the GPU is "
            "a branch that threads of one warp may take differently. A clamp is "
            "cute.arch.fmax; a choice that depends only on an element's position is made "
            "while the kernel is built, on plain Python ints")

    def bitcast(self, dtype, **_):
        kind = _dsl_kind(dtype)
        if kind is None:
            raise AssertionError(f"bitcast to {dtype!r}: use Float32 or Int32")
        _log("bitcast", kind)
        target = _F32 if kind == "Float32" else np.int32
        if self.v.dtype == np.bool_:
            raise AssertionError("bitcast of a comparison's result")
        return Reg(self.v.view(target))

    def to(self, dtype, **_):
        return _convert(self, _dsl_kind(dtype))


def _type_name(r: Reg) -> str:
    return {np.dtype(_F32): "Float32", np.dtype(np.int32): "Int32"}.get(r.v.dtype, "Boolean")


_DSL_KINDS = ("Float32", "Int32", "Uint32", "Boolean")


def _dsl_kind(dtype):
    name = getattr(dtype, "_emu_kind", None) or getattr(dtype, "__name__", None)
    return name if name in _DSL_KINDS else None


def _convert(value, kind: str):
    """The DSL's value conversion ``Float32(v)`` / ``Int32(v)`` (not a bitcast)."""
    if kind == "Float32":
        if isinstance(value, Reg):
            if value.is_float:
                return value
            _log("convert", "Int32 -> Float32")
            return Reg(value.v.astype(_F32))
        return Reg(_F32(value))
    if kind in ("Int32", "Uint32"):
        if isinstance(value, Reg):
            if value.is_float:
                _log("convert", "Float32 -> Int32")
                with np.errstate(all="ignore"):
                    return Reg(np.trunc(value.v).astype(np.int64).astype(np.int32))
            return value
        return Reg(np.asarray(int(value) & 0xFFFFFFFF, dtype=np.uint64).astype(_U32)
                   .view(np.int32))
    return Reg(np.asarray(value, dtype=np.bool_)) if not isinstance(value, Reg) else value


def _emu_type(kind: str):
    def new(cls, value=0):
        return _convert(value, kind)

    attrs = {"__new__": new, "_emu_kind": kind}
    if kind == "Float32":
        attrs["inf"] = _F32(np.inf)
    return type(kind, (), attrs)


EMU_TYPES = {kind: _emu_type(kind) for kind in _DSL_KINDS}
_EMU_LOG: list | None = None


def _log(*event) -> None:
    if _EMU_LOG is not None:
        _EMU_LOG.append(event)


def _as_reg(x) -> Reg:
    return x if isinstance(x, Reg) else Reg(_F32(x))


def mufu_ex2_model(x) -> np.ndarray:
    """``ex2.approx.ftz.f32`` for the emulation: 2^x rounded to float32, inputs and results
    below 2^-126 flushed to zero (the hardware is within 2 ulp of this)."""
    x = as_f32(x)
    x = np.where(np.abs(x) < _F32(2.0**-126), _F32(0), x)
    with np.errstate(all="ignore"):
        y = np.exp2(x.astype(np.float64)).astype(_F32)
    return canonical_nan(np.where(y < _F32(2.0**-126), _F32(0), y))


def _stand_ins(units: list | None = None) -> dict:
    """{DSL object: its NumPy stand-in} for the emulation. ``units`` collects, per call of
    MUFU's exp2 or of ``exp2_poly``, (unit, the input array)."""
    import cutlass.cute as cute_mod

    from fa4_final.common import fast_math
    from utils.host_emulation import _const_expr, _PyRange

    def fmax(a, b, *, abs=False, nan=False, ftz=False, **_):  # noqa: A002
        _log("fmax", bool(nan))
        return Reg(max_f32(_as_reg(a).v, _as_reg(b).v, keep_nan=bool(nan)))

    def add_rm(a, b, **_):
        a, b = _as_reg(a), _as_reg(b)
        _log("add_rm", *(float(r.v) for r in (a, b) if r.v.ndim == 0))
        return Reg(add_rm_f32(a.v, b.v))

    def sub_rn(a, b, **_):
        return Reg(sub_rn_f32(_as_reg(a).v, _as_reg(b).v))

    def fma_rn(a, b, c, **_):
        _log("fma")
        return Reg(fma_rn_f32(_as_reg(a).v, _as_reg(b).v, _as_reg(c).v))

    def mufu(x, fastmath=False, **_):
        _log("mufu")
        if units is not None:
            units.append(("MUFU", _as_reg(x).v.copy()))
        return Reg(mufu_ex2_model(_as_reg(x).v))

    def poly(x, degree=3, nan_safe=True, **_):
        _log("poly")
        if units is not None:
            units.append(("polynomial", _as_reg(x).v.copy()))
        return Reg(exp2_f32_model(_as_reg(x).v, degree, nan_safe))

    import cutlass as cutlass_mod

    swap = {
        cute_mod.arch.fmax: fmax, cute_mod.math.exp2: mufu,
        fast_math.ptx_add_rm: add_rm, fast_math.ptx_sub_rn: sub_rn, fast_math.ptx_fma_rn: fma_rn,
        fast_math.exp2_poly: poly,
        cutlass_mod.range: _PyRange, cutlass_mod.range_constexpr: _PyRange,
        cutlass_mod.const_expr: _const_expr,
        cute_mod.size: lambda t, mode=None, **_: t.size if hasattr(t, "size") else len(t),
    }
    for kind in _DSL_KINDS:
        swap[getattr(cutlass_mod, kind)] = EMU_TYPES[kind]
    return swap


def _emulation_modules():
    import sys

    import cutlass as cutlass_mod
    import cutlass.cute as cute_mod

    from fa4_final.common import fast_math

    return [sys.modules[__name__], fast_math, cute_mod, cute_mod.arch, cute_mod.math, cutlass_mod]


def emulate(fn, *args, units: list | None = None):
    """Run the ``@cute.jit`` function ``fn`` on the CPU (Note [Device code on the CPU]) with
    ``args`` (Reg values, fragments); returns (its result, the log of what it did)."""
    global _EMU_LOG
    swap = _stand_ins(units)
    clone, patches = swapped(fn, swap, _emulation_modules())
    _EMU_LOG = []
    try:
        with patches():
            out = clone(*args)
        return out, list(_EMU_LOG)
    finally:
        _EMU_LOG = None


# --- exercise 06.4: exp2 in device code -------------------------------------------------------


@cute.jit
def exp2_device(x: Float32) -> Float32:
    """Exercise 06.4's reference: Note [The instruction sequence], written out (degree 3,
    NaN-safe): the clamp, the round-down add, the Horner FMAs, the integer exponent add."""
    xc = cute.arch.fmax(x, Float32(CLAMP_LOW), nan=True)
    j = ptx_add_rm(xc, Float32(SHIFTER))  # SHIFTER + floor(xc)
    f = xc - (j - Float32(SHIFTER))  # both subtractions exact but for xc in (-1, 0)
    q = ptx_fma_rn(Float32(HALF_COEFFS[3]), f, Float32(HALF_COEFFS[2]))
    q = ptx_fma_rn(q, f, Float32(HALF_COEFFS[1]))
    q = ptx_fma_rn(q, f, Float32(HALF_COEFFS[0]))  # p(f) / 2
    bits = (j.bitcast(Int32) << 23) + q.bitcast(Int32) + Int32(1 << 23)  # + (n + 1) << 23
    return bits.bitcast(Float32)


FORBID_EXP2_DEVICE = {
    exp2_poly: "that is the package's finished exp2; write the sequence yourself",
    exp2_at: "exp2_at calls the package's exp2; write the sequence yourself",
    ptx_exponent_add: "ptx_exponent_add does the shift and the add for you",
    cute.math.exp2: "that is MUFU's ex2, the instruction this exercise replaces",
    np.exp2: "NumPy does not run on the GPU",
    np.floor: "NumPy does not run on the GPU; the floor is the round-down add",
    np.ldexp: "NumPy does not run on the GPU; 2^n goes into the exponent bits",
}


def _exp2_variant(x, *, clamp=True, keep_nan=True, floor_rm=True, fused=True, halved=True,
                  plus_one=True) -> np.ndarray:
    """exp2_f32_model with one step done another way: the typical slips of exercise 06.4."""
    coeffs = HALF_COEFFS if halved else exp2_coefficients(3)
    x = as_f32(x)
    xc = max_f32(x, CLAMP_LOW, keep_nan=keep_nan) if clamp else x
    j = add_rm_f32(xc, SHIFTER) if floor_rm else sub_rn_f32(xc, -_F32(SHIFTER))
    f = sub_rn_f32(xc, sub_rn_f32(j, SHIFTER))
    q = np.full_like(f, coeffs[-1])
    for c in coeffs[-2::-1]:
        if fused:
            q = fma_rn_f32(q, f, c)
        else:
            with np.errstate(all="ignore"):
                q = canonical_nan((q * f).astype(_F32) + _F32(c))
    total = (f32_bits(j).astype(np.uint64) << 23) + f32_bits(q) + (2**23 if plus_one else 0)
    return bits_f32(total & 0xFFFFFFFF)


_EXP2_SLIPS = [
    (dict(floor_rm=False), "the floor rounds to nearest: an ordinary add of 1.5·2^23 rounds to "
     "nearest, so half of the inputs get floor(x) + 1 and a fraction below 0. Use "
     "ch06.ptx_add_rm, the add that rounds toward minus infinity"),
    (dict(fused=False), "the Horner steps round twice (a multiply, then an add): use "
     "ch06.ptx_fma_rn(a, b, c), one rounding per step, as the model does"),
    (dict(keep_nan=False), "a NaN input comes out as 0: the clamp drops the NaN. Clamp with "
     "cute.arch.fmax(x, Float32(-127.0), nan=True), which keeps it"),
    (dict(clamp=False), "inputs below -127 (and -inf) come out wrong: without the clamp the "
     "exponent field wraps around. Clamp first: cute.arch.fmax(x, Float32(-127.0), nan=True)"),
    (dict(plus_one=False), "every result is half of 2^x: with the halved coefficients, add the "
     "lost factor 2 as one more 2^23 in the exponent field (+ Int32(1 << 23))"),
    (dict(halved=False), "every result is twice 2^x: the halved coefficients (ch06.HALF_COEFFS) "
     "go with the extra 2^23"),
    (dict(halved=False, plus_one=False), "a NaN input comes out as the largest finite float "
     "0x7f7fffff: with the full coefficients the NaN's bits shifted left by 23 put -1 into the "
     "exponent field. Use the halved coefficients (ch06.HALF_COEFFS) and add the lost factor 2 "
     "as a separate 2^23 (Note [Special values])"),
]


def exp2_probe_inputs() -> np.ndarray:
    """The inputs 06.4 is judged on: special values, the edges of the domain, (-1, 0), and a
    quarter of a million random values in [-130, 128)."""
    rng = np.random.default_rng(64)
    special = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 8.0, -126.0, -126.5, -127.0, -127.5, -128.0,
               -200.0, 127.0, 127.99, -1e-7, 1e-7, -1e-30, np.inf * -1, np.nan, -3.0e38]
    return as_f32(np.concatenate([special, rng.uniform(-130, 128, 200_000),
                                  rng.uniform(-1, 0, 50_000)]))


def _first_mismatch(x, got_bits, want_bits) -> str:
    i = int(np.flatnonzero(got_bits != want_bits)[0])
    return (f"for x = {x[i]!r} the GPU's sequence gives {int(want_bits[i]):#010x} "
            f"({bits_f32(want_bits[i])!r}), yours {int(got_bits[i]):#010x} "
            f"({bits_f32(got_bits[i])!r})")


def _check_exp2_values(fn) -> list:
    """06.4 on the CPU: fn's bits against exp2_f32_model on exp2_probe_inputs; returns the log."""
    x = exp2_probe_inputs()
    out, log = emulate(fn, Reg(x.copy()))
    assert isinstance(out, Reg), (
        f"return the Float32 result, got {type(out).__name__}")
    assert out.v.shape == x.shape, "return one value per input (one per thread)"
    assert out.v.dtype == _F32, (
        "your function returns the Int32 bit pattern: bitcast it back, bits.bitcast(Float32)")
    got, want = f32_bits(out.v), f32_bits(exp2_f32_model(x))
    if np.array_equal(got, want):
        return log
    if any(e == ("convert", "Float32 -> Int32") for e in log):
        raise AssertionError(
            "Int32(j) converts j's value to an integer; the trick needs j's bit pattern, "
            f"j.bitcast(Int32). {_first_mismatch(x, got, want)}")
    for kw, words in _EXP2_SLIPS:
        if np.array_equal(got, f32_bits(_exp2_variant(x, **kw))):
            raise AssertionError(f"{words}. {_first_mismatch(x, got, want)}")
    raise AssertionError(_first_mismatch(x, got, want) + ". Compare your steps with "
                         "Note [The instruction sequence], one instruction at a time")


def _check_exp2_method(log: list) -> None:
    adds = [e for e in log if e[0] == "add_rm"]
    assert any(SHIFTER in e[1:] for e in adds), (
        "the floor must be the round-down add of 1.5·2^23: ch06.ptx_add_rm(xc, "
        "Float32(ch06.SHIFTER))")
    fmas = sum(1 for e in log if e[0] == "fma")
    assert fmas == 3, (
        f"{fmas} calls of ptx_fma_rn: Horner's rule for degree 3 is exactly three FMAs")
    assert ("shl", 23) in log, (
        "the integer part must reach the exponent field by a shift: j.bitcast(Int32) << 23, "
        "then integer adds")


class Exp2Each:
    """y = fn(x) elementwise over a 1-D float32 tensor, one element per thread: the kernel
    around a learner's exp2 (exercise 06.4), for its compile check and its GPU run."""

    threads = 128

    def __init__(self, fn):
        self.fn = fn

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
        n = cute.size(mX)
        self.kernel(mX, mY, n).launch(grid=(cute.ceil_div(n, self.threads), 1, 1),
                                      block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor, n):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * self.threads + tidx
        if i < n:
            mY[i] = self.fn(mX[i])


_EXERCISE_BUILDS: dict = {}


def compile_exercise(kernel, key, arch: str = "sm_90a"):
    """``kernel`` (an Exp2Each or FragmentEach) compiled for ``arch`` with no GPU; remembered
    by ``key``."""
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    if key not in _EXERCISE_BUILDS:
        _EXERCISE_BUILDS[key] = compile_for(arch, kernel, fake_tensor(Float32, (None,)),
                                            fake_tensor(Float32, (None,)), fake_stream())
    return _EXERCISE_BUILDS[key]


@cute.jit
def _identity(x: Float32) -> Float32:
    return x


def exp2_sass_census(fn) -> Counter:
    """SASS opcodes of one ``fn`` (a @cute.jit exp2): Exp2Each(fn) compiled for sm_90a, minus
    the same kernel around the identity (the loads, the stores, the index), constant loads left
    out (in a loop they are hoisted)."""
    ops = sass_opcodes(compile_exercise(Exp2Each(fn), ("06.4", fn)).sass)
    ops.subtract(sass_opcodes(compile_exercise(Exp2Each(_identity), ("06.4", _identity)).sass))
    return Counter({k: v for k, v in ops.items() if v > 0 and k not in _CONSTANT_LOADS})


def _check_exp2_sass(fn) -> None:
    ops = exp2_sass_census(fn)

    def n(prefix):
        return sum(v for k, v in ops.items() if k.split(".")[0] == prefix)

    assert n("MUFU") == 0, (
        f"compiled for sm_90a the kernel has {n('MUFU')} MUFU instruction(s): the emulated "
        "path must use no MUFU (it is the unit being relieved)")
    conversions = {k: v for k, v in ops.items() if k.split(".")[0] in ("F2I", "I2F", "FRND")}
    assert not conversions, (
        f"conversion instructions in the SASS ({dict(conversions)}): they run on the same "
        "16-lane unit as MUFU. Take the floor with the round-down add of 1.5·2^23 and keep n "
        "in j's bits")
    assert ops.get("FADD.RM", 0) >= 1, (
        "no FADD.RM in the SASS: the floor is one add rounding toward minus infinity")
    assert n("FFMA") == 3, (
        f"{n('FFMA')} FFMA in the SASS (and {n('FMUL')} FMUL): the degree-3 Horner "
        "polynomial is three FFMAs")
    assert n("LEA") + n("SHF") + n("SHL") >= 1 and n("LEA") + n("IADD3") + n("IADD") >= 2, (
        f"the exponent is not assembled by integer instructions (SASS of one exp2: "
        f"{dict(ops)}): a shift left by 23 and integer adds (LEA, IADD3)")


def check_exp2_device(fn, compile_check: bool = True) -> None:
    """Exercise 06.4: ``fn`` (a @cute.jit 2^x of one Float32) run on the CPU on
    ``exp2_probe_inputs``, bit for bit against exp2_f32_model, the method read from what it
    did (the round-down add of SHIFTER, three FMAs, a shift by 23); then compiled for sm_90a:
    no MUFU, no conversion, FADD.RM, three FFMA, the integer shift and adds."""
    log = _check_exp2_values(fn)
    _check_exp2_method(log)
    if compile_check:
        _check_exp2_sass(fn)


def check_exp2_device_on_gpu(fn, n: int = 1 << 20, run=None) -> tuple[bool, list[str]]:
    """Exercise 06.4 on a GPU: ``Exp2Each(fn)`` on ``n`` random inputs in [-127, 127) and the
    probe inputs; bits against the model, and the relative error against float64 within
    ``model_error_bound(3)``. Returns (ok, lines). ``run``: the runner, by default ``_run_each``
    (``emulate_each`` checks this function's logic with no GPU)."""
    run = run or _run_each
    x = np.concatenate([exp2_probe_inputs(),
                        np.random.default_rng(7).uniform(-127, 127, n).astype(_F32)])
    y = run(Exp2Each(fn), ("06.4", fn), x)
    lines, ok = [], True
    bad = np.flatnonzero(f32_bits(y) != f32_bits(exp2_f32_model(x)))
    ok &= bad.size == 0
    lines.append(f"bits equal to the CPU model on {x.size - bad.size} of {x.size} inputs"
                 + (f"; first difference at x = {x[bad[0]]!r}" if bad.size else ""))
    inside = (x >= -126) & (x < 127)
    err = np.abs(y[inside].astype(np.float64) / np.exp2(x[inside].astype(np.float64)) - 1)
    bound = model_error_bound(3)
    ok &= bool(err.max() <= bound)
    lines.append(f"max relative error against float64 on [-126, 127): {err.max():.3e} "
                 f"(bound {bound:.3e})")
    return ok, lines


def emulate_each(kernel, key, x: np.ndarray) -> np.ndarray:
    """``_run_each`` on the CPU: the kernel's function emulated over all threads at once."""
    if isinstance(kernel, Exp2Each):
        return emulate(kernel.fn, Reg(as_f32(x).copy()))[0].v
    size = kernel.size
    padded = np.zeros(-(-x.size // size) * size, _F32)
    padded[:x.size] = x
    frag = EmuFragment(padded.reshape(-1, size).T)  # (size, threads)
    emulate(kernel.fn, frag, kernel.k)
    return frag.a.T.reshape(-1)[:x.size]


def _run_each(kernel, key, x: np.ndarray) -> np.ndarray:
    """Run an Exp2Each / FragmentEach kernel on a GPU over float32 ``x``; returns y (NumPy)."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack

    size = getattr(kernel, "size", 1)
    padded = -(-x.size // size) * size
    xt = torch.zeros(padded, dtype=torch.float32, device="cuda")
    xt[:x.size] = torch.from_numpy(x).cuda()
    yt = torch.empty_like(xt)
    args = [from_dlpack(t, assumed_align=16).mark_layout_dynamic() for t in (xt, yt)]
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    gpu_key = ("gpu", *key)
    if gpu_key not in _EXERCISE_BUILDS:
        _EXERCISE_BUILDS[gpu_key] = cute.compile[cute.GPUArch("sm_90a")](kernel, *args, stream)
    _EXERCISE_BUILDS[gpu_key](*args, stream)
    torch.cuda.synchronize()
    return yt[:x.size].cpu().numpy()


# --- exercise 06.5: a row split between MUFU and the polynomial -------------------------------


@cute.jit
def exp2_split(frag, k: cutlass.Constexpr):
    """Exercise 06.5's reference: 2^x of every element of a register fragment, in place; in each
    block of 8 elements, k go to the polynomial, spread out (position i when i * k mod 8 < k:
    k = 2 gives 0 and 4), the rest to MUFU. The choice is made while the kernel is traced."""
    for i in cutlass.range_constexpr(cute.size(frag)):
        if (i % 8) * k % 8 < k:
            frag[i] = exp2_poly(frag[i])
        else:
            frag[i] = cute.math.exp2(frag[i], fastmath=True)


FORBID_SPLIT = {
    is_emulated: "that is the package's choice of positions; make your own",
    emulated_count: "write the count yourself",
    exp2_at: "exp2_at makes the choice for you",
    exp2_fragment: "exp2_fragment does the whole exercise",
}


class EmuFragment:
    """A register fragment of ``size`` elements for many threads at once (rows: elements)."""

    def __init__(self, values: np.ndarray):
        self.a = np.array(values, dtype=_F32)
        self.size = self.a.shape[0]
        self.element_type = EMU_TYPES["Float32"]
        self.written = np.zeros(self.size, dtype=np.int64)

    def __getitem__(self, i):
        if not isinstance(i, (int, np.integer)):
            raise AssertionError(f"index the fragment element by element, frag[i]; got {i!r}")
        return Reg(self.a[i].copy())

    def __setitem__(self, i, value):
        if not isinstance(i, (int, np.integer)):
            raise AssertionError(f"index the fragment element by element, frag[i]; got {i!r}")
        value = _as_reg(value)
        if not value.is_float:
            raise AssertionError(f"element {i} was given an Int32: the fragment holds Float32")
        self.a[i] = value.v
        self.written[i] += 1

    def load(self):
        raise AssertionError("work element by element (frag[i]): each element's unit is "
                             "chosen when the kernel is built")

    store = load


SPLIT_SIZES = (8, 16, 32)


def split_positions(k: int, size: int = 8) -> list[int]:
    return [i for i in range(size) if (i % 8) * k % 8 < k]


def _spread_ok(positions: list[int]) -> bool:
    """Whether k positions of a block of 8 are as evenly spread as k allows: the gaps between
    neighbours, around the block, differ by at most 1."""
    if len(positions) < 2:
        return True
    gaps = np.diff(positions + [positions[0] + 8])
    return int(gaps.max() - gaps.min()) <= 1


def _check_split_emulated(fn) -> None:
    for size in SPLIT_SIZES:
        for k in range(9):
            threads = 3
            x = -(np.arange(size)[:, None] * 0.731 % 29.0) - 0.01 * np.arange(threads) - 0.5
            x32 = x.astype(_F32)
            frag = EmuFragment(x32)
            units: list = []
            emulate(fn, frag, k, units=units)
            what = f"with k = {k} and a fragment of {size} elements"
            unit_of: dict = {}
            for unit, arg in units:
                for i in range(size):
                    if np.array_equal(np.broadcast_to(arg, x32[i].shape), x32[i]):
                        unit_of.setdefault(i, []).append(unit)
            for i in range(size):
                got = unit_of.get(i, [])
                assert got, (f"{what}: element {i} never went through cute.math.exp2 (MUFU) or "
                             "ch06.exp2_poly (the polynomial)")
                assert len(got) == 1, (f"{what}: element {i} went through {' and '.join(got)}: "
                                       "each element needs one exponential, on one unit")
                unit = got[0]
                want = (exp2_f32_model(x32[i]) if unit == "polynomial"
                        else mufu_ex2_model(x32[i]))
                assert np.array_equal(f32_bits(frag.a[i]), f32_bits(want)), (
                    f"{what}: element {i} holds the wrong value: it must become 2^x of its own "
                    f"input, in place (frag[{i}] = ...)")
            for b in range(size // 8):
                poly = [i - 8 * b for i in range(8 * b, 8 * b + 8)
                        if unit_of[i] == ["polynomial"]]
                assert len(poly) == k, (
                    f"{what}: the block of elements {8 * b}..{8 * b + 7} sends {len(poly)} "
                    f"(positions {poly}) to the polynomial, not k = {k}")
                assert _spread_ok(poly), (
                    f"{what}: positions {poly} of each 8 go to the polynomial, bunched together: "
                    "side by side their FMAs queue behind each other while MUFU waits. Spread "
                    f"them as evenly as {k} of 8 allow (e.g. {split_positions(k)})")


class FragmentEach:
    """Each thread loads ``size`` consecutive floats into a register fragment, calls
    ``fn(fragment, k)`` and stores it back: the kernel around exercise 06.5."""

    threads = 128

    def __init__(self, fn, k: int, size: int = 16):
        self.fn, self.k, self.size = fn, k, size

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
        gX = cute.zipped_divide(mX, (self.size,))  # (size, n / size)
        gY = cute.zipped_divide(mY, (self.size,))
        tiles = cute.size(gX, mode=[1])
        self.kernel(gX, gY, tiles).launch(grid=(cute.ceil_div(tiles, self.threads), 1, 1),
                                          block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, gX: cute.Tensor, gY: cute.Tensor, tiles):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx * self.threads + tidx
        if t < tiles:
            r_x = cute.make_rmem_tensor((self.size,), Float32)  # (size,) in registers
            r_x.store(gX[None, t].load())
            self.fn(r_x, self.k)
            gY[None, t].store(r_x.load())


def split_ptx_counts(fn, k: int = 3, size: int = 16) -> dict:
    """PTX and SASS counts of FragmentEach(fn, k, size) compiled for sm_90a."""
    art = compile_exercise(FragmentEach(fn, k, size), ("06.5", fn, k, size))
    return {"ex2.approx": art.count("ex2.approx"), "fma.rn.f32": art.count("fma.rn.f32"),
            "MUFU.EX2": art.count("MUFU.EX2", where="sass")}


def check_exp2_split(fn, compile_check: bool = True) -> None:
    """Exercise 06.5: ``fn(frag, k)`` run on the CPU for fragments of 8, 16, 32 elements and
    k = 0..8, each element's unit recorded: k of every 8 on the polynomial, spread evenly, the
    rest on MUFU, each element 2^x of its own input; then compiled for sm_90a with k = 3 and 16
    elements: 10 ex2.approx and MUFU.EX2, 18 fma.rn (three per emulated element), no more."""
    _check_split_emulated(fn)
    if compile_check:
        got = split_ptx_counts(fn)
        want = {"ex2.approx": 10, "fma.rn.f32": 18, "MUFU.EX2": 10}
        assert got == want, (
            f"compiled for sm_90a with k = 3 and 16 elements the kernel has {got}, expected "
            f"{want}: each element's unit must be fixed when the kernel is built (a Python "
            "choice over cutlass.range_constexpr), with no run-time branch")


def check_exp2_split_on_gpu(fn, n: int = 1 << 20, run=None) -> tuple[bool, list[str]]:
    """Exercise 06.5 on a GPU: FragmentEach(fn, k) over ``n`` inputs in [-30, 0] for k = 0, 2,
    3, 8: the polynomial's positions bit for bit against the model, MUFU's within 2^-21 of
    float64 (ex2.approx), every result within the model's bound. Returns (ok, lines).
    ``run``: the runner, by default ``_run_each`` (``emulate_each`` with no GPU)."""
    run = run or _run_each
    x = np.random.default_rng(65).uniform(-30, 0, n).astype(_F32)
    exact = np.exp2(x.astype(np.float64))
    ok, lines = True, []
    for k in (0, 2, 3, 8):
        y = run(FragmentEach(fn, k), ("06.5", fn, k, 16), x)
        emulated = np.isin(np.arange(n) % 16, split_positions(k, 16))
        same = np.array_equal(f32_bits(y[emulated]), f32_bits(exp2_f32_model(x[emulated])))
        err_mufu = (np.abs(y[~emulated] / exact[~emulated] - 1).max() if (~emulated).any()
                    else 0.0)
        err_all = np.abs(y / exact - 1).max()
        case_ok = same and err_mufu <= 2.0**-21 and err_all <= model_error_bound(3)
        ok &= bool(case_ok)
        lines.append(f"k = {k}: polynomial positions {'bit-exact' if same else 'DIFFER'}, "
                     f"MUFU max rel. error {err_mufu:.2e}, all {err_all:.2e}: "
                     f"{'ok' if case_ok else 'WRONG'}")
    return ok, lines


# ----------------------------------------------------------------------------------------------
# 10. Reading the stored measurements (results/h200/microbench.json, ch05_knobs.json) and the
#     claims the notebook's prose makes about them (tests/test_claims.py runs the checks)

KNOBS_RESULTS = "ch05_knobs"  # chapter 05's kernel with each knob, one run
EMULATION_CONFIGS = ("exp2 emulation 1/4", "exp2 emulation 1/2")



def mix_rates(res) -> list[dict]:
    """The microbenchmark's exp2 rate per clock per SM against the share on the degree-3,
    NaN-safe, shifter-floor polynomial (MUFU alone at 0, the polynomial alone at 1)."""
    rows = res.where(metric="exp2_per_clk_sm", degree=3, nan_safe=True, floor="shifter")
    return sorted(rows, key=lambda r: r["fraction"])


def mix_summary(res) -> dict:
    """MUFU alone, the polynomial alone and the best mix, exp/clk/SM."""
    rows = mix_rates(res)
    best = max((r for r in rows if 0 < r["fraction"] < 1), key=lambda r: r["value"])
    return {"mufu": rows[0]["value"], "poly": rows[-1]["value"], "best": best["value"],
            "best_fraction": best["fraction"]}


@claim("06.mix_beats_both", "microbench",
       "a mix of MUFU and the polynomial computes more exponentials per clock than MUFU alone, "
       "and MUFU alone more than the polynomial alone")
def _mix_beats_both(res):
    s = mix_summary(res)
    return (s["best"] > s["mufu"] > s["poly"],
            f"best mix {s['best']:.2f} at {s['best_fraction']}, MUFU {s['mufu']:.2f}, "
            f"polynomial {s['poly']:.2f} exp/clk/SM")


@claim("06.mix_below_model", "microbench",
       "the best measured mix stays below the issue model's best, at a smaller share")
def _mix_below_model(res):
    s = mix_summary(res)
    census = Counter({"FMNMX.NAN": 1, "FADD.RM": 1, "FADD": 2, "FFMA": 3, "LEA": 1, "IADD3": 1})
    model = max((exp_rate_model(f / 16, census) for f in range(17)),
                key=lambda r: r["exp_per_clk_sm"])
    return (s["best"] < model["exp_per_clk_sm"] and s["best_fraction"] < model["fraction"],
            f"measured {s['best']:.2f} at {s['best_fraction']}, model "
            f"{model['exp_per_clk_sm']:.2f} at {model['fraction']:.3f}")


def knob_row(res, d: int, causal: bool, config: str) -> dict | None:
    return next((r for r in res.rows if (r["d"], r["causal"], r["config"]) == (d, causal, config)
                 and r.get("ms")), None)


def emulation_comparisons(res) -> list[tuple]:
    """(d, causal, config, utils.bench.compare of that row against the default) for every
    emulated share the run timed."""
    from utils.bench import compare

    out = []
    for d, causal in dict.fromkeys((r["d"], r["causal"]) for r in res.rows):
        base = knob_row(res, d, causal, "default")
        for cfg in EMULATION_CONFIGS:
            row = knob_row(res, d, causal, cfg)
            if base and row:
                out.append((d, causal, cfg, compare(row, base)))
    return out


def format_emulation(res) -> str:
    """One line per emulated share: its speed over the default's in the same run, verdict."""
    from utils.bench import spread_note

    lines = [f"{'D':>4} {'causal':7s} {'config':20s} speed vs default"]
    for d, causal, cfg, c in emulation_comparisons(res):
        lines.append(f"{d:>4} {causal!s:7s} {cfg:20s} {c}")
    lines.append(spread_note([r for r in res.rows if r.get("ms")]))
    return "\n".join(lines)


@claim("06.emulation_slower_at_d128", KNOBS_RESULTS,
       "at D = 128 every emulated share makes chapter 05's kernel slower than its default, "
       "beyond the spread, causal or not")
def _slower_at_128(res):
    found = [(cfg, causal, c) for d, causal, cfg, c in emulation_comparisons(res) if d == 128]
    ok = len(found) == 4 and all(c.real and c.ratio < 1 for *_, c in found)
    return ok, ", ".join(f"{cfg} causal={causal}: {c.ratio:.3f}" for cfg, causal, c in found)


@claim("06.loss_not_ordered_by_share", KNOBS_RESULTS,
       "at D = 128 non-causal the half share is not slower than the quarter beyond the spread")
def _not_ordered(res):
    from utils.bench import compare

    half = knob_row(res, 128, False, "exp2 emulation 1/2")
    quarter = knob_row(res, 128, False, "exp2 emulation 1/4")
    c = compare(half, quarter)
    return not (c.real and c.ratio < 1), f"1/2 over 1/4: {c}"


@claim("06.d64_quarter_faster", KNOBS_RESULTS,
       "at D = 64 non-causal a quarter emulated is faster than the default in this one run, "
       "beyond the spread between its calls")
def _d64_faster(res):
    c = dict(((d, causal, cfg), c) for d, causal, cfg, c in emulation_comparisons(res))
    c = c.get((64, False, "exp2 emulation 1/4"))
    return c is not None and c.real and c.ratio > 1, f"{c}"


def _print_coefficients() -> None:
    """Print EXP2_COEFFS as Python source, from a fresh Remez run."""
    for d in DEGREES:
        fit = remez_fit(d)
        hexes = [re.sub(r"0+p", "p", float(np.float32(c)).hex()) for c in fit.coeffs[1:]]
        body = ", ".join(f'float.fromhex("{h}")' for h in hexes)
        print(f"    {d}: (1.0, {body}),  # max relative error {fit.max_error:.3e}")


if __name__ == "__main__":
    import sys

    if "--coefficients" in sys.argv:
        _print_coefficients()
    else:
        for row in fit_table():
            print(f"degree {row['degree']}  {row['method']:30s} {row['max_rel_error']:.3e}")
