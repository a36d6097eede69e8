"""2^x on the FMA units: the device side of a software exp2.

The polynomial is a minimax fit (a Remez exchange, checked on a bit-exact float32 model with its
error bound); this module holds only what a kernel needs: the frozen coefficients and the
instruction sequence, written one PTX instruction per helper so nothing depends on LLVM's
contraction.

Note [The instruction sequence]
What exp2_poly emits, one PTX instruction a line:
  xc = max.NaN.f32(x, -127)          clamp: -inf and x < -127 become -127, NaN stays NaN
  j  = add.rm.f32(xc, 1.5 * 2^23)    SHIFTER + floor(xc), exact: add.rm rounds toward -inf
  n  = sub.rn.f32(j, 1.5 * 2^23)     floor(xc), exact
  f  = sub.rn.f32(xc, n)             in [0, 1]
  q  = fma.rn.f32 x degree           Horner with the coefficients HALVED: q = p(f) / 2
  y  = (j << 23) + bits(q) + 2^23    integer: adds n + 1 to q's exponent, = p(f) * 2^n
Halving the coefficients and adding the 2^23 separately lets a NaN input leave as NaN (the
canonical 0x7FFFFFFF wraps to itself) while every finite result is unchanged; ``nan_safe=False``
drops that integer add. Special values: integers in [-126, 127] are exact, x <= -127 and -inf
give +0, and the domain ends at 128 (a softmax argument stays below its rescale threshold).
"""

from __future__ import annotations

from fractions import Fraction

import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

SHIFTER = 1.5 * 2.0**23  # 12582912.0, bit pattern 0x4B400000
CLAMP_LOW = -127.0  # below it 2^x < 2^-127 is zero for every ftz consumer

# Minimax fits of 2^f on [0, 1) with p(0) = 1 pinned (a Remez exchange), rounded to float32 and
# frozen so every machine compiles the same kernel (a fresh fit still rounds to these). Lowest
# degree first.
EXP2_COEFFS: dict[int, tuple[float, ...]] = {
    2: (1.0, float.fromhex("0x1.54f8d6p-1"), float.fromhex("0x1.51d9ccp-2")),
    3: (1.0, float.fromhex("0x1.63e658p-1"), float.fromhex("0x1.d2378ap-3"),
        float.fromhex("0x1.3baaa6p-4")),
    4: (1.0, float.fromhex("0x1.62d6c6p-1"), float.fromhex("0x1.ee245p-3"),
        float.fromhex("0x1.abf868p-5"), float.fromhex("0x1.b7f73p-7")),
    5: (1.0, float.fromhex("0x1.62e4bap-1"), float.fromhex("0x1.ebdb56p-3"),
        float.fromhex("0x1.c91ce6p-5"), float.fromhex("0x1.277856p-7"),
        float.fromhex("0x1.e974fap-10")),
}
DEGREES = tuple(sorted(EXP2_COEFFS))


def check_degree(degree) -> int:
    if isinstance(degree, bool) or not isinstance(degree, int) or degree not in EXP2_COEFFS:
        raise ValueError(f"degree must be one of {DEGREES}, got {degree!r}")
    return int(degree)


def exp2_coefficients(degree: int = 3) -> tuple[float, ...]:
    """The frozen float32 minimax coefficients of ``degree`` (p(0) = 1), lowest first."""
    return EXP2_COEFFS[check_degree(degree)]


def inline_ptx_f32(ptx: str, *args, loc=None, ip=None) -> Float32:
    """One inline-PTX block with a 32-bit result ``$0`` and 32-bit operands ``$1, $2, ...``."""
    operands = [Float32(a).ir_value(loc=loc, ip=ip) for a in args]
    return Float32(
        llvm.inline_asm(
            T.f32(), operands, ptx, "=f" + ",f" * len(args),
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def ptx_add_rm(a, b, *, loc=None, ip=None) -> Float32:
    """a + b rounded toward minus infinity (SASS FADD.RM)."""
    return inline_ptx_f32("add.rm.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def ptx_sub_rn(a, b, *, loc=None, ip=None) -> Float32:
    """a - b rounded to nearest (an explicit .rn is never fused into an FMA)."""
    return inline_ptx_f32("sub.rn.f32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def ptx_fma_rn(a, b, c, *, loc=None, ip=None) -> Float32:
    """a * b + c with one rounding to nearest (SASS FFMA)."""
    return inline_ptx_f32("fma.rn.f32 $0, $1, $2, $3;", a, b, c, loc=loc, ip=ip)


@dsl_user_op
def ptx_exponent_add(j, q, plus_one: bool = True, *, loc=None, ip=None) -> Float32:
    """(bits(j) << 23) + bits(q) [+ 2^23], as 32-bit integers (SASS LEA [+ IADD3])."""
    tail = "add.s32 t, t, 8388608;\n" if plus_one else ""
    ptx = (
        "{\n.reg .b32 t;\nshl.b32 t, $1, 23;\nadd.s32 t, t, $2;\n" + tail + "mov.b32 $0, t;\n}"
    )
    return inline_ptx_f32(ptx, j, q, loc=loc, ip=ip)


@dsl_user_op
def exp2_poly(x, degree: int = 3, nan_safe: bool = True, *, loc=None, ip=None) -> Float32:
    """2^x on the FMA and integer units, no MUFU (Note [The instruction sequence]).

    ``degree`` (2..5) and ``nan_safe`` are compile-time. Relative error 8.6e-5 at degree 3 for x
    in [-126, 127) (the bound holds on a bit-exact float32 model of these instructions)."""
    coeffs = exp2_coefficients(degree)
    if nan_safe:
        coeffs = tuple(c / 2.0 for c in coeffs)
    xc = cute.arch.fmax(Float32(x), Float32(CLAMP_LOW), nan=bool(nan_safe), loc=loc, ip=ip)
    j = ptx_add_rm(xc, Float32(SHIFTER), loc=loc, ip=ip)
    n = ptx_sub_rn(j, Float32(SHIFTER), loc=loc, ip=ip)
    f = ptx_sub_rn(xc, n, loc=loc, ip=ip)
    q = Float32(coeffs[-1])
    for c in coeffs[-2::-1]:
        q = ptx_fma_rn(q, f, Float32(c), loc=loc, ip=ip)
    return ptx_exponent_add(j, q, plus_one=bool(nan_safe), loc=loc, ip=ip)


def emulated_count(fraction, period: int) -> int:
    """How many of every ``period`` elements go to the polynomial; fraction * period must be a
    whole number (0.25 with period 8 -> 2)."""
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period must be a positive int, got {period!r}")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float, Fraction)):
        raise TypeError(f"fraction must be a number in [0, 1], got {type(fraction).__name__}")
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    count = round(fraction * period)
    if abs(count - fraction * period) > 1e-9:
        raise ValueError(
            f"fraction * period must be a whole number of elements, got {fraction!r} * {period}"
            f"; accepted fractions for period {period}: k/{period}, k = 0..{period}"
        )
    return count


def is_emulated(index: int, fraction, period: int = 8) -> bool:
    """Whether element ``index`` of a fragment goes to the polynomial (decided at compile time).

    Inside each block of ``period`` elements, position i is emulated when (i * k) mod period < k
    for k = fraction * period: exactly k positions, spread evenly (k = 2 of 8: positions 0 and
    4), so MUFU and FMA instructions interleave in the instruction stream."""
    k = emulated_count(fraction, period)
    return (index % period) * k % period < k


@dsl_user_op
def exp2_at(x, index: int, fraction=0.0, period: int = 8, degree: int = 3,
            nan_safe: bool = True, *, loc=None, ip=None) -> Float32:
    """2^x for element ``index`` of a row: the polynomial if ``is_emulated(index, fraction,
    period)``, else MUFU ``ex2.approx.ftz.f32``. Everything but ``x`` is compile-time."""
    if is_emulated(index, fraction, period):
        return exp2_poly(x, degree, nan_safe, loc=loc, ip=ip)
    return cute.math.exp2(Float32(x), fastmath=True, loc=loc, ip=ip)
