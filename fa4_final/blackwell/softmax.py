"""The online softmax with one row per thread, as Blackwell's TMEM hands it out.

``tcgen05.ld`` of a 32x32b shape gives lane t of TMEM (row t of S) to thread t of the warpgroup:
a thread owns a whole row, so the row max and sum need no shuffles at all (threads_per_row = 1),
and the rescale decision is per row. ``RowSoftmax`` is ``common.softmax.OnlineSoftmax`` with
``num_rows = 1, threads_per_row = 1``: ``reset`` and ``finalize`` are the same code; the step
differs where a row-per-thread layout pays:

- the row max is a tree of 3-input FMNMX (one instruction folds two new values);
- scale and subtract, and the row sum, use packed fp32 pairs (FFMA2 / FADD2: two lanes of
  arithmetic per instruction, sm_100's answer to an FMA pipe that the exponentials crowd);
- the emulated share of the exponentials (fast_math) is evaluated in pairs with the same
  packed instructions (``exp2_poly2``), chosen per pair at compile time;
- conditional rescaling is decided per row (Note [Per-row threshold]).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cutlass_dsl import dsl_user_op

from fa4_final.common.fast_math import (
    CLAMP_LOW,
    SHIFTER,
    exp2_coefficients,
    is_emulated,
    ptx_exponent_add,
)
from fa4_final.common.softmax import EMULATION_DEGREE, EMULATION_PERIOD, OnlineSoftmax


@dsl_user_op
def exp2_poly2(x0, x1, degree: int = EMULATION_DEGREE, *, loc=None, ip=None) -> tuple:
    """2^x for a pair on the FMA pipe with packed fp32 instructions: fast_math's sequence
    (Note [The instruction sequence]) with FADD2.RM / FADD2 / FFMA2 doing two elements per
    instruction; the clamp and the integer exponent add stay scalar. Same coefficients (halved,
    so a NaN stays NaN), so the same 8.6e-5 bound at degree 3."""
    coeffs = tuple(c / 2.0 for c in exp2_coefficients(degree))
    x0 = cute.arch.fmax(Float32(x0), Float32(CLAMP_LOW), nan=True, loc=loc, ip=ip)
    x1 = cute.arch.fmax(Float32(x1), Float32(CLAMP_LOW), nan=True, loc=loc, ip=ip)
    sh = (Float32(SHIFTER), Float32(SHIFTER))
    j = cute.arch.add_packed_f32x2((x0, x1), sh, rnd="rm", loc=loc, ip=ip)
    n = cute.arch.sub_packed_f32x2(j, sh, loc=loc, ip=ip)
    f = cute.arch.sub_packed_f32x2((x0, x1), n, loc=loc, ip=ip)
    q = (Float32(coeffs[-1]), Float32(coeffs[-1]))
    for c in coeffs[-2::-1]:
        q = cute.arch.fma_packed_f32x2(q, f, (Float32(c), Float32(c)), loc=loc, ip=ip)
    return (ptx_exponent_add(j[0], q[0], loc=loc, ip=ip),
            ptx_exponent_add(j[1], q[1], loc=loc, ip=ip))


def emulated_pair(pair: int, fraction) -> bool:
    """Whether pair ``pair`` (elements 2 pair, 2 pair + 1) goes to the polynomial: the Hopper
    rule (``fast_math.is_emulated``) applied to pairs, so the share is still k / 8."""
    return is_emulated(pair, fraction, EMULATION_PERIOD)


# Note [Per-row threshold]
# On Hopper four lanes share a row and a warp holds 16 rows in registers next to its O, so the
# softmax votes over the warp and keeps or moves all of its rows' maxima together (softmax.py,
# Note [Warp vote]). Here a thread owns one row and O is not in its registers: the correction
# warpgroup rescales O in TMEM. So each row decides alone: keep the stale max unless it grew by
# more than tau (alpha = 1 exactly), and the correction warp that owns the same 32 lanes votes
# (any alpha < 1 among its rows?) to branch around the TMEM load-multiply-store of O uniformly.
# FA4's SoftmaxSm100 makes the same per-row choice.


class RowSoftmax(OnlineSoftmax):
    """Running max and sum of the one row this thread owns (see the module docstring)."""

    def __init__(self, scale_log2: Float32, exp2_emulation_fraction=0.0, rescale_threshold=0.0,
                 row_max=None, row_sum=None):
        super().__init__(scale_log2, 1, exp2_emulation_fraction, rescale_threshold,
                         threads_per_row=1, row_max=row_max, row_sum=row_sum)

    def __new_from_mlir_values__(self, values):
        rebuilt, start = [], 0
        for x, n in zip(self._dynamic(), self._lengths):
            rebuilt.append(cutlass.new_from_mlir_values(x, values[start:start + n]))
            start += n
        return RowSoftmax(rebuilt[0], self.exp2_emulation_fraction, self.rescale_threshold,
                          rebuilt[1], rebuilt[2])

    @cute.jit
    def row_max_of(self, s: cute.Tensor) -> Float32:
        """max over the row: four independent chains (a chain of n dependent maxima would be
        n times the FMNMX latency), each folding two new values per step, which ptxas turns
        into one 3-input FMNMX3."""
        n = cute.size(s)
        m = [cute.arch.fmax(s[2 * k], s[2 * k + 1]) for k in range(4)]
        for c in cutlass.range_constexpr(8, n, 2):
            k = (c // 2) % 4
            m[k] = cute.arch.fmax(m[k], cute.arch.fmax(s[c], s[c + 1]))
        return cute.arch.fmax(cute.arch.fmax(m[0], m[1]), cute.arch.fmax(m[2], m[3]))

    @cute.jit
    def new_max(self, s: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> tuple:
        """(alpha, max * scale_log2) for this tile; the max in use moves to the row's true max
        unless the threshold keeps it (Note [Per-row threshold])."""
        m_old = self.row_max[0]
        tile_max = self.row_max_of(s)
        m_new = tile_max
        if const_expr(not is_first):
            m_new = cute.arch.fmax(m_old, tile_max)
        # a row whose keys are all masked so far has max -inf: subtract 0 instead (p = 0)
        m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
        max_scaled = m_safe * self.scale_log2
        alpha = Float32(1.0)
        if const_expr(not is_first):
            alpha = cute.math.exp2(m_old * self.scale_log2 - max_scaled, fastmath=True)
            if const_expr(self.rescale_threshold > 0.0):
                # growth <= tau: keep the stale max, alpha exactly 1 (NaN growth: no key yet)
                keep = (max_scaled - m_old * self.scale_log2) <= Float32(self.rescale_threshold)
                if keep:
                    m_new = m_old
                    max_scaled = m_old * self.scale_log2
                    alpha = Float32(1.0)
        self.row_max[0] = m_new
        return alpha, max_scaled

    @cute.jit
    def exp2_in_place(self, s: cute.Tensor, max_scaled: Float32) -> None:
        """s <- 2^(s * scale_log2 - max_scaled), in pairs: one FFMA2, then two MUFU ex2 or, for
        the emulated pairs, the packed polynomial."""
        neg = -max_scaled
        scale = self.scale_log2
        for p in cutlass.range_constexpr(cute.size(s) // 2):
            a, b = cute.arch.fma_packed_f32x2((s[2 * p], s[2 * p + 1]), (scale, scale),
                                              (neg, neg))
            if const_expr(emulated_pair(p, self.exp2_emulation_fraction)):
                a, b = exp2_poly2(a, b)
            else:
                a = cute.math.exp2(a, fastmath=True)
                b = cute.math.exp2(b, fastmath=True)
            s[2 * p], s[2 * p + 1] = a, b

    @cute.jit
    def add_to_sum(self, p: cute.Tensor, alpha: Float32, is_first: cutlass.Constexpr[bool]):
        """row_sum <- alpha * row_sum + sum(p): four packed partial sums (independent FADD2
        chains), folded at the end."""
        n = cute.size(p)
        acc = [(p[2 * k], p[2 * k + 1]) for k in range(4)]
        for q in cutlass.range_constexpr(4, n // 2):
            acc[q % 4] = cute.arch.add_packed_f32x2(acc[q % 4], (p[2 * q], p[2 * q + 1]))
        acc01 = cute.arch.add_packed_f32x2(acc[0], acc[1])
        acc23 = cute.arch.add_packed_f32x2(acc[2], acc[3])
        tot = cute.arch.add_packed_f32x2(acc01, acc23)
        tile_sum = tot[0] + tot[1]
        if const_expr(is_first):
            self.row_sum[0] = tile_sum
        else:
            self.row_sum[0] = self.row_sum[0] * alpha + tile_sum

    @cute.jit
    def exponentiate(self, s: cute.Tensor, max_scaled: Float32, alpha: Float32,
                     is_first: cutlass.Constexpr[bool]) -> None:
        """Both halves at once: exp2_in_place, then add_to_sum (the kernel calls them apart so
        that P leaves for TMEM before the sum is taken)."""
        self.exp2_in_place(s, max_scaled)
        self.add_to_sum(s, alpha, is_first)
