"""The online-softmax step of chapter 05's Hopper kernel, and views of wgmma register fragments.

A consumer warpgroup computes S = Q K^T for 64 query rows x tile_n keys with one wgmma; each of its
128 threads then holds 2 rows x (tile_n / 4) columns of S (rows r and r + 8 of an 8-row band,
two adjacent columns out of every 8). The four threads of a quad share a row, so a row's max and
sum need a reduction over those 4 lanes only.

Per KV tile and per row, in the log2 domain (exp(x) = 2^(x log2 e); the scale is folded in once):

    m_new   = max(m_old, max_j s_j)                       running max of raw scores
    p_j     = 2^(s_j * scale_log2 - m_new * scale_log2)   one FFMA + one MUFU ex2 each
    alpha   = 2^((m_old - m_new) * scale_log2)            how much the old sum and O shrink
    l_new   = alpha * l_old + sum_j p_j
    O_new   = alpha * O_old + P V                          (the kernel does the P V part)

and at the end out = O / l, lse = (m * scale_log2 + log2 l) * ln 2.

Two later chapters change this step without restructuring it; each enters at one method, and
both knobs are compile-time constants of the object (0 means: exactly chapter 05's code):
- chapter 06 (software exp2): ``exp2_row`` sends a fraction ``exp2_emulation_fraction`` of each
  row's exponentials from MUFU to chapter 06's FMA polynomial (``ch06_exp2.exp2_at``), chosen
  per element at compile time, so there is no branch;
- chapter 07 (conditional rescaling): ``running_max_to_use`` (called once per tile with every
  row's old and tile max) keeps the stale maxima of a whole warp unless some row of the warp
  grew by more than ``rescale_threshold`` (a ``vote.sync.any``); alpha is then exactly 1 and
  ``rescale_o`` skips the multiply of O. This is ``ch07_rescaling``'s ``group_rule="any"`` with
  ``group_rows=16`` (a wgmma warp owns 16 consecutive query rows), tiles in reverse order.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from solutions.ch06_exp2 import exp2_at

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# Threads that share one accumulator row in a wgmma fragment (lanes 4i .. 4i+3 of a warp).
THREADS_PER_ROW = 4
# Rows one warp owns in a wgmma accumulator: 8 quads x 2 rows (r and r + 8). The warp vote of
# chapter 07 decides for these 16 consecutive query rows together.
ROWS_PER_WARP = 16
# Chapter 06's knob works on blocks of this many consecutive elements of a thread's row: k of
# every 8 go to the polynomial (ch06_exp2.is_emulated), so the fraction moves in steps of 1/8.
EMULATION_PERIOD = 8
# Degree of chapter 06's polynomial: relative error 8.6e-5, 45 times below bf16's rounding of P.
EMULATION_DEGREE = 3


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View a wgmma accumulator fragment as (rows, cols) of the thread's own elements.

    An SM90 accumulator fragment is ((2, 2, N/8), MMA_M, MMA_N): mode 0 holds (2 adjacent
    columns, 2 rows 8 apart, N/8 column groups). Regroup to ((2, MMA_M), (2, N/8, MMA_N)) so
    ``view[r, c]`` is row r, column c of what this thread owns; no data moves.
    """
    flat = cute.make_layout(acc.layout.shape)  # compact: index order of the fragment
    s, d = flat.shape, flat.stride
    rows_cols = cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, rows_cols))


def acc_as_a_operand(acc: cute.Tensor) -> cute.Tensor:
    """View an m64nNk16 accumulator fragment as the register A operand of the next wgmma.

    Accumulator ((2, 2, N/8), 1, 1): (column pair, rows r / r+8, 8-column group). A fragment
    ((2, 2, 2), 1, N/16): (k pair, rows r / r+8, k half) per 16-wide k block. Columns
    16b .. 16b+15 of the accumulator are column groups 2b and 2b+1, exactly k block b of the
    A operand, so splitting N/8 into (2, N/16) is the whole conversion; no data moves.
    """
    split = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    s, d = split.shape, split.stride
    as_a = cute.make_layout(
        ((s[0][0], s[0][1], s[0][2][0]), s[1], (s[0][2][1], s[2])),
        stride=((d[0][0], d[0][1], d[0][2][0]), d[1], (d[0][2][1], d[2])),
    )
    return cute.make_tensor(acc.iterator, as_a)


def tree_reduce(values: list, op):
    """Combine values pairwise (depth log2 n instead of a chain of n - 1 dependent ops), so a
    row's 32 maxima or sums do not serialise behind each other's latency."""
    while len(values) > 1:
        pairs = [op(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
        values = pairs + values[len(pairs) * 2 :]
    return values[0]


class OnlineSoftmax:
    """Running row max and row sum for the rows one thread owns; lives in registers.

    ``exp2_emulation_fraction`` (chapter 06) and ``rescale_threshold`` (chapter 07, tau in log2
    units) are Python numbers fixed when the kernel is traced; the checks on their ranges are
    ``ch05_flash_hopper.check_config``'s."""

    def __init__(self, scale_log2: Float32, num_rows: int, exp2_emulation_fraction=0.0,
                 rescale_threshold=0.0, row_max=None, row_sum=None):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.exp2_emulation_fraction = exp2_emulation_fraction
        self.rescale_threshold = rescale_threshold
        self.row_max = row_max
        self.row_sum = row_sum
        if row_max is None:
            self.row_max = cute.make_rmem_tensor(num_rows, Float32)
            self.row_sum = cute.make_rmem_tensor(num_rows, Float32)
            self.row_max.fill(-Float32.inf)
            self.row_sum.fill(0.0)

    # The DSL carries this object through run-time `if`s and loops as its IR values.
    def __extract_mlir_values__(self):
        parts = [cutlass.extract_mlir_values(x) for x in self._dynamic()]
        self._lengths = [len(p) for p in parts]
        return [v for p in parts for v in p]

    def __new_from_mlir_values__(self, values):
        rebuilt, start = [], 0
        for x, n in zip(self._dynamic(), self._lengths):
            rebuilt.append(cutlass.new_from_mlir_values(x, values[start : start + n]))
            start += n
        return OnlineSoftmax(rebuilt[0], self.num_rows, self.exp2_emulation_fraction,
                             self.rescale_threshold, rebuilt[1], rebuilt[2])

    def _dynamic(self):
        return (self.scale_log2, self.row_max, self.row_sum)

    # -- where chapters 06 and 07 enter ---------------------------------------------------------

    # Note [Warp vote]
    # ----------------
    # A wgmma warp owns ROWS_PER_WARP = 16 consecutive query rows: lane 4i + j holds rows i and
    # i + 8 of the warp's band, and the 4 lanes of a quad hold the same row (so after the quad
    # reduction they agree on its tile max). With tau > 0, per KV tile, each thread asks for its
    # 2 rows "did the max grow by more than tau (log2 units)?" and vote.sync.any over the 32
    # lanes answers for all 16 rows at once:
    #   yes: every row of the warp moves to its true running max max(old, tile) and O, l are
    #        multiplied by alpha as in chapter 05 (a row that grew by less than tau rescales
    #        early, which is exact too);
    #   no:  every row keeps the max it had, alpha is exactly 1, and the whole warp branches
    #        around the O multiply: a uniform branch, no divergence.
    # The max in use is what row_max holds, so the LSE of finalize() pairs l with the max that
    # was subtracted (ch07_rescaling's Note [Why a stale max is exact]). A row whose max is still
    # -inf (no key yet) grows by +inf on its first key and always votes yes; rows past seqlen_q
    # (zeros from the TMA) score 0 everywhere, so after their first tile they never vote yes.
    # This is ch07_rescaling's model with group_rows=16, group_rule="any", kv_order="reverse":
    # the GPU test compares the max each row ends with (``max_used``) against that model.

    @cute.jit
    def running_max_to_use(self, row_max_old: cute.Tensor, tile_max: cute.Tensor) -> tuple:
        """(maxima this tile's exponentials are taken against, one per row of this thread;
        whether O must be multiplied by alpha). With tau = 0 (chapter 05): the true running max
        max(old, tile) and always True (a Python bool, so no branch is emitted). With tau > 0
        (chapter 07): Note [Warp vote], the answer is a warp-uniform Boolean."""
        new = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            new[r] = cute.arch.fmax(row_max_old[r], tile_max[r])
        rescale = True
        if cutlass.const_expr(self.rescale_threshold > 0.0):
            grew = cutlass.Boolean(False)
            for r in cutlass.range_constexpr(self.num_rows):
                # log2 units like tau: +inf at a row's first key (old max -inf), NaN while it
                # has none (-inf - -inf), and NaN > tau is false
                growth = (new[r] - row_max_old[r]) * self.scale_log2
                grew = grew | (growth > Float32(self.rescale_threshold))
            rescale = cute.arch.vote_any_sync(grew)
            for r in cutlass.range_constexpr(self.num_rows):
                new[r] = new[r] if rescale else row_max_old[r]
        return new, rescale

    @cute.jit
    def exp2_row(self, s_row: cute.Tensor, max_scaled: Float32) -> None:
        """In place: s <- 2^(s * scale_log2 - max_scaled). One FFMA per element, then MUFU
        ``ex2.approx`` or, for a share ``exp2_emulation_fraction`` of the elements, chapter 06's
        degree-3 polynomial on the FMA and integer pipes (``ch06_exp2.exp2_at``: which elements,
        by position, is fixed at compile time, so no branch, and MUFU and FMA work interleave).

        The argument is <= tau < 16 (0 without chapter 07) or -inf for a masked key, inside the
        polynomial's domain (x < 128; -inf gives exactly 0). ``nan_safe=True``: a NaN score (a
        NaN in q or k) then gives NaN on both units, as MUFU does; without the guard the
        polynomial turns it into 0, so whether a bad input shows up would depend on which
        columns a performance knob happened to emulate. Price: one IADD3 per emulated exp (9
        instructions instead of 8) on the integer pipe, which the softmax hardly uses."""
        for c in cutlass.range_constexpr(cute.size(s_row)):
            s_row[c] = exp2_at(s_row[c] * self.scale_log2 - max_scaled, c,
                               self.exp2_emulation_fraction, EMULATION_PERIOD, EMULATION_DEGREE,
                               nan_safe=True)

    @cute.jit
    def rescale_o(self, acc_o: cute.Tensor, row_scale: cute.Tensor, needed=True) -> None:
        """O_row *= alpha_row. ``needed`` is the second value ``update`` returned: with tau > 0
        the warp's vote, and when it is false every alpha is exactly 1 and the warp skips the
        D multiplies per row (64 FMULs per thread at D = 128) with one uniform branch."""
        if cutlass.const_expr(self.rescale_threshold > 0.0):
            if needed:
                self._multiply_rows(acc_o, row_scale)
        else:
            self._multiply_rows(acc_o, row_scale)

    @cute.jit
    def _multiply_rows(self, acc_o: cute.Tensor, row_scale: cute.Tensor) -> None:
        o = acc_rows_cols(acc_o)
        for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
            for c in cutlass.range(cute.size(o, mode=[1]), unroll_full=True):
                o[r, c] = o[r, c] * row_scale[r]

    # -- the step itself ------------------------------------------------------------------------

    @cute.jit
    def update(self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> tuple:
        """Turn the scores in ``acc_s`` into unnormalised probabilities in place, fold them into
        the running sum and return (alpha per row, whether O needs the multiply at all); pass
        both to ``rescale_o``."""
        s = acc_rows_cols(acc_s)
        cols = cute.size(s, mode=[1])
        tile_max = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row_tile_max = tree_reduce([s[r, c] for c in range(cols)], cute.arch.fmax)
            tile_max[r] = cute.arch.warp_reduction_max(row_tile_max,
                                                       threads_in_group=THREADS_PER_ROW)
        row_max_new = tile_max
        rescale = True
        if cutlass.const_expr(not is_first):
            row_max_new, rescale = self.running_max_to_use(self.row_max, tile_max)
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            s_row = s[r, None]
            # A row with every key masked so far has max -inf; exponentiate against 0 instead,
            # so its p are exp2(-inf) = 0 and alpha = exp2(-inf) = 0, never inf - inf = NaN.
            max_safe = Float32(0.0) if row_max_new[r] == -Float32.inf else row_max_new[r]
            max_scaled = max_safe * self.scale_log2
            self.exp2_row(s_row, max_scaled)
            tile_sum = tree_reduce([s_row[c] for c in range(cols)], lambda a, b: a + b)
            if cutlass.const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = tile_sum
            else:
                alpha = cute.math.exp2(self.row_max[r] * self.scale_log2 - max_scaled,
                                       fastmath=True)
                if cutlass.const_expr(self.rescale_threshold > 0.0):
                    # a kept max gives alpha = 1 exactly, not 2^(the FFMA's rounding of
                    # m * scale - round(m * scale)): l then stays paired with O, unmultiplied
                    alpha = alpha if rescale else Float32(1.0)
                row_scale[r] = alpha
                self.row_sum[r] = self.row_sum[r] * alpha + tile_sum
            self.row_max[r] = row_max_new[r]
        return row_scale, rescale

    @cute.jit
    def finalize(self) -> tuple:
        """Row sums are per-thread partial sums until now: reduce over the quad, then return
        (1 / l, lse) per row; a row that saw no key gets (0, -inf) so out = 0, lse = -inf."""
        inv_sum = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=THREADS_PER_ROW)
            seen = total > Float32(0.0)
            safe_total = total if seen else Float32(1.0)
            inv_sum[r] = cute.arch.rcp_approx(safe_total) if seen else Float32(0.0)
            log2_sum = self.row_max[r] * self.scale_log2 + cute.math.log2(safe_total)
            lse[r] = log2_sum * LN_2 if seen else -Float32.inf
        return inv_sum, lse
