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
per 32 exps; they balance at phi = 7/16, for 28 exp/clk/SM in the model. ``run_microbench``
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
from cutlass import Float32

from fa4_final.fast_math import (  # noqa: F401  (re-exported: the notebook imports them here)
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
from fa4_final.fast_math import check_degree as _check_degree

# ----------------------------------------------------------------------------------------------
# 1. Float32 bit patterns and the rounding of single instructions

SHIFTER_BITS = 0x4B400000  # of SHIFTER = 1.5 * 2^23 (fa4_final.fast_math, with CLAMP_LOW)
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
# fa4_final.fast_math (EXP2_COEFFS, exp2_coefficients) so every machine compiles the same kernel;
# tests/test_ch06_exp2.py checks that a fresh fit still rounds to them. Regenerate with
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
# 5. Exercise checkers: each raises AssertionError in plain words


def _probe_points() -> np.ndarray:
    rng = np.random.default_rng(6)
    edge = [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 2.7, -2.7, -1e-7, 1e-7, 126.5, -126.5, -127.0,
            np.nextafter(_F32(3), _F32(0)), np.nextafter(_F32(-3), _F32(0)),
            np.nextafter(_F32(-3), _F32(-4)), -100.25]
    return as_f32(np.concatenate([edge, rng.uniform(-127, 127, 2000)]))


def check_floor_trick(fn) -> None:
    """Exercise 06.1: fn(x) -> (floor(x), x - floor(x)) as float32, by the floor trick."""
    x = _probe_points()
    out = fn(x.copy())
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
    want = np.floor(x)
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
    """Exercise 06.2: fn(j, p) -> p * 2^n, j = SHIFTER + n as float32, by integer operations."""
    rng = np.random.default_rng(62)
    n = np.concatenate([np.arange(-126, 128), rng.integers(-126, 128, 500)])
    p = as_f32(np.concatenate([np.ones(254), rng.uniform(1.0, 2.0, 500)]))
    j = as_f32(SHIFTER + n)
    got = np.asarray(fn(j.copy(), p.copy()))
    assert got.shape == p.shape, f"expected shape {p.shape}, got {got.shape}"
    assert got.dtype == _F32, f"the result must be float32, got {got.dtype}"
    want = np.ldexp(p, n.astype(np.int32)).astype(_F32)
    bad = np.flatnonzero(f32_bits(got) != f32_bits(want))
    if bad.size:
        i = bad[0]
        if np.all(n[bad] < 0):
            hint = " Negative n must wrap around modulo 2^32, as in a 32-bit register."
        elif np.array_equal(got, p):
            hint = " You returned p unchanged: n still has to go into its exponent bits."
        else:
            hint = (" Use j's BIT PATTERN (f32_bits), not its value: shift it left by 23, keep "
                    "32 bits (mask with 0xFFFFFFFF) and add the bit pattern of p, as integers.")
        raise AssertionError(
            f"for n = {n[i]} and p = {p[i]!r}, p * 2^n = {want[i]!r}, you gave {got[i]!r}.{hint}"
        )


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


# The helpers live in fa4_final.fast_math (the kernels of chapters 05-10 use them from there):
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
    constants = ("MOV", "HFMA2.MMA", "IMAD.MOV", "IMAD.MOV.U32", "UMOV")
    return Counter({k: v for k, v in diff.items() if v > 0 and k not in constants})


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
