"""The online softmax, in registers, for the rows one thread owns.

Per KV tile and per row, in the log2 domain (exp(x) = 2^(x log2 e); the scale folds into one FFMA):

    m_new   = max(m_old, max_j s_j)                       running max of raw scores
    p_j     = 2^(s_j * scale_log2 - m_new * scale_log2)   one FFMA + one exp2 each
    alpha   = 2^((m_old - m_new) * scale_log2)            how much the old sum and O shrink
    l_new   = alpha * l_old + sum_j p_j
    O_new   = alpha * O_old + P V                          (the kernel does the P V part)

and at the end out = O / l, lse = (m * scale_log2 + log2 l) * ln 2. The max is taken on raw
scores, valid because scale > 0 (the interface checks it).

Two compile-time knobs change the step without restructuring it (0 means the plain algorithm):
- ``exp2_emulation_fraction``: a share of each row's exponentials goes to the FMA
  polynomial of ``fast_math`` instead of MUFU, chosen per element at compile time (no branch);
- ``rescale_threshold`` (tau, in log2 units): keep a warp's stale maxima unless some
  row of the warp grew by more than tau (Note [Warp vote]); alpha is then exactly 1 and the O
  multiply is skipped with one warp-uniform branch. With ``skip_unchanged`` each row decides
  alone (it keeps its max unless it grew by more than tau; at tau = 0 it always takes the true
  max) and the vote only decides whether the warp multiplies O.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from fa4_final.common.constants import LN_2, LOG2_E
from fa4_final.common.fast_math import exp2_at
from fa4_final.common.fragments import THREADS_PER_ROW, acc_rows_cols, tree_reduce

# k of every EMULATION_PERIOD consecutive elements of a row go to the polynomial, so the
# emulated share moves in steps of 1/8.
EMULATION_PERIOD = 8
EMULATION_DEGREE = 3  # relative error 8.6e-5, 45 times below bf16's rounding of P

# With a stale max, p = 2^(s - m_used) <= 2^tau enters the P V MMA in the input dtype. fp16's
# largest value is 65504 = 2^15.9998, so tau < 16; 0.01 of headroom covers the FFMA's rounding
# and exp2's relative error: 2^15.99 * (1 + 1e-4) = 65089 < 65504.
MAX_RESCALE_THRESHOLD = 15.99


def check_softmax_knobs(exp2_emulation_fraction, rescale_threshold) -> None:
    """The two softmax knobs, for every kernel's config: TypeError / ValueError naming the knob and
    what it accepts."""
    from fa4_final.common.fast_math import emulated_count

    try:
        emulated_count(exp2_emulation_fraction, EMULATION_PERIOD)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"exp2_emulation_fraction: {exc}") from None
    tau = rescale_threshold
    if isinstance(tau, bool) or not isinstance(tau, (int, float)):
        raise TypeError(f"rescale_threshold must be a number, got {tau!r}")
    if not 0.0 <= tau <= MAX_RESCALE_THRESHOLD:
        raise ValueError(
            f"rescale_threshold must be in [0, {MAX_RESCALE_THRESHOLD}] (log2 "
            f"units; 0 = always "
            f"rescale), got {tau!r}: a stale max lets p reach 2^tau, and P must stay below "
            f"fp16's largest value 65504 = 2^15.9998")


class OnlineSoftmax:
    """Running row max and row sum of this thread's rows.

    ``threads_per_row``: how many lanes share a row and must agree on its max and sum (4 for
    mma.sync / wgmma fragments). The knobs are Python numbers fixed when the kernel is traced."""

    def __init__(self, scale_log2: Float32, num_rows: int, exp2_emulation_fraction=0.0,
                 rescale_threshold=0.0, threads_per_row: int = THREADS_PER_ROW, row_max=None,
                 row_sum=None, skip_unchanged: bool = False):
        self.skip_unchanged = skip_unchanged  # rows decide alone: Note [Warp vote], last paragraph
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.exp2_emulation_fraction = exp2_emulation_fraction
        self.rescale_threshold = rescale_threshold
        self.threads_per_row = threads_per_row
        self.row_max = row_max
        self.row_sum = row_sum
        if row_max is None:
            self.row_max = cute.make_rmem_tensor(num_rows, Float32)
            self.row_sum = cute.make_rmem_tensor(num_rows, Float32)
            self.reset()

    # The DSL carries this object through run-time `if`s and loops as its IR values.
    def __extract_mlir_values__(self):
        parts = [cutlass.extract_mlir_values(x) for x in self._dynamic()]
        self._lengths = [len(p) for p in parts]
        return [v for p in parts for v in p]

    def __new_from_mlir_values__(self, values):
        rebuilt, start = [], 0
        for x, n in zip(self._dynamic(), self._lengths):
            rebuilt.append(cutlass.new_from_mlir_values(x, values[start:start + n]))
            start += n
        return OnlineSoftmax(rebuilt[0], self.num_rows, self.exp2_emulation_fraction,
                             self.rescale_threshold, self.threads_per_row, rebuilt[1],
                             rebuilt[2], self.skip_unchanged)

    def _dynamic(self):
        return (self.scale_log2, self.row_max, self.row_sum)

    def reset(self) -> None:
        """A new query tile: no key seen yet."""
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    def _quad_max(self, x):
        if const_expr(self.threads_per_row == 1):
            return x
        return cute.arch.warp_reduction_max(x, threads_in_group=self.threads_per_row)

    def _quad_sum(self, x):
        if const_expr(self.threads_per_row == 1):
            return x
        return cute.arch.warp_reduction_sum(x, threads_in_group=self.threads_per_row)

    # Note [Warp vote]
    # A wgmma warp owns 16 consecutive query rows (an mma.sync warp 16 per m-block as well):
    # lane 4i + j holds rows i and i + 8 of the warp's band, and the lanes of a quad agree on a
    # row's tile max after the quad reduction. With tau > 0, per KV tile, each thread asks for its
    # rows "did the max grow by more than tau (log2 units)?" and vote.sync.any over the warp
    # answers for all of its rows at once:
    #   yes: every row of the warp moves to its true running max and O, l are multiplied by
    #        alpha (a row that grew by less than tau rescales early, which is exact too);
    #   no:  every row keeps the max it had, alpha is exactly 1, and the warp branches around the
    #        O multiply: a uniform branch, no divergence.
    # The max in use is what row_max holds, so finalize() pairs l with the max that was
    # subtracted: the result is exact after the final division. A row whose max is still -inf
    # grows by +inf on its first key and always votes yes.
    # With ``skip_unchanged`` each row decides alone: it moves to its true running max when
    # that grew by more than tau, else keeps the max it had (at tau = 0: it always takes the
    # true max, and "kept" means "did not move"). Nothing before the exponentials waits for the
    # vote; the warp votes only on whether any of its rows moved, and skips O's multiply when
    # none did (alpha is then exactly 1 for every row). The vote gates only the O multiply,
    # which comes later. In a warp that multiplies, a row that kept its max multiplies O and l
    # by the same 2^(rounding of the FFMA), about 1: consistent, so exact after the division.

    @cute.jit
    def running_max_to_use(self, row_max_old: cute.Tensor, tile_max: cute.Tensor) -> tuple:
        """(maxima this tile's exponentials are taken against; whether O must be multiplied).
        tau = 0: the true running max and always True (a Python bool: no branch is emitted)."""
        new = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            new[r] = cute.arch.fmax(row_max_old[r], tile_max[r])
        rescale = True
        if const_expr(self.skip_unchanged):  # each row on its own; the vote gates O only
            moved = cutlass.Boolean(False)
            for r in cutlass.range_constexpr(self.num_rows):
                if const_expr(self.rescale_threshold == 0.0):
                    grew = new[r] > row_max_old[r]  # -inf to -inf: not moved
                else:
                    # NaN (-inf to -inf) > tau is false: a row with no key yet stays at -inf
                    grew = (new[r] - row_max_old[r]) * self.scale_log2 > Float32(
                        self.rescale_threshold)
                    new[r] = new[r] if grew else row_max_old[r]
                moved = moved | grew
            rescale = cute.arch.vote_any_sync(moved)
        elif const_expr(self.rescale_threshold > 0.0):
            grew = cutlass.Boolean(False)
            for r in cutlass.range_constexpr(self.num_rows):
                # +inf at a row's first key, NaN while it has none (-inf - -inf): NaN > tau is false
                growth = (new[r] - row_max_old[r]) * self.scale_log2
                grew = grew | (growth > Float32(self.rescale_threshold))
            rescale = cute.arch.vote_any_sync(grew)
            for r in cutlass.range_constexpr(self.num_rows):
                new[r] = new[r] if rescale else row_max_old[r]
        return new, rescale

    @cute.jit
    def exp2_row(self, s_row: cute.Tensor, max_scaled: Float32) -> None:
        """In place: s <- 2^(s * scale_log2 - max_scaled): one FFMA each, then MUFU ex2 or, for
        the emulated share, the polynomial (nan_safe: a NaN score stays NaN on both units)."""
        for c in cutlass.range_constexpr(cute.size(s_row)):
            s_row[c] = exp2_at(s_row[c] * self.scale_log2 - max_scaled, c,
                               self.exp2_emulation_fraction, EMULATION_PERIOD, EMULATION_DEGREE,
                               nan_safe=True)

    @cute.jit
    def update(self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> tuple:
        """Scores in ``acc_s`` become unnormalised probabilities in place, folded into the
        running sum. Returns (alpha per row, whether O needs the multiply): pass both to
        ``rescale_o``. ``is_first``: the tile's first KV tile (max and sum start from it).
        Row by row: the exponentials, their sum, then alpha. ``new_max`` and ``exponentiate``
        split the same step in two, alpha first, so a kernel can place work between them."""
        s = acc_rows_cols(acc_s)
        cols = cute.size(s, mode=[1])
        row_max_new, rescale, max_scaled = self._maxima(s, is_first)
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            s_row = s[r, None]
            self.exp2_row(s_row, max_scaled[r])
            row_scale[r] = self._alpha(r, max_scaled[r], rescale, is_first)
            self._fold_sum(r, s_row, cols, row_scale, is_first)
            self.row_max[r] = row_max_new[r]
        return row_scale, rescale

    @cute.jit
    def _maxima(self, s: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> tuple:
        """(the max each row subtracts from now on, whether O needs the multiply, that max
        times scale_log2 with -inf replaced by 0) for the (rows, cols) view ``s``."""
        cols = cute.size(s, mode=[1])
        tile_max = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            values = [s[r, c] for c in range(cols)]
            tile_max[r] = self._quad_max(tree_reduce(values, cute.arch.fmax))
        row_max_new = tile_max
        rescale = True
        if const_expr(not is_first):
            row_max_new, rescale = self.running_max_to_use(self.row_max, tile_max)
        max_scaled = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            # A row whose keys were all masked so far has max -inf; exponentiate against 0
            # instead, so its p are exp2(-inf) = 0 and alpha = 0, never inf - inf = NaN.
            max_safe = Float32(0.0) if row_max_new[r] == -Float32.inf else row_max_new[r]
            max_scaled[r] = max_safe * self.scale_log2
        return row_max_new, rescale, max_scaled

    @cute.jit
    def _alpha(self, r: int, max_scaled, rescale, is_first: cutlass.Constexpr[bool]):
        """2^(old max - new max) of row r (before row_max moves on); 1 on the first tile."""
        if const_expr(is_first):
            return Float32(1.0)
        alpha = cute.math.exp2(self.row_max[r] * self.scale_log2 - max_scaled, fastmath=True)
        if const_expr(self._may_skip()):
            # a kept max gives alpha = 1 exactly, not 2^(the FFMA's rounding error)
            alpha = alpha if rescale else Float32(1.0)
        return alpha

    def _may_skip(self) -> bool:
        """Whether a warp may skip O's multiply (the vote decides at run time)."""
        return self.rescale_threshold > 0.0 or self.skip_unchanged

    @cute.jit
    def new_max(self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> tuple:
        """First half of ``update``, alpha first: the tile's row maxima, the max each row now
        subtracts, and alpha. Returns (alpha per row, whether O needs the multiply, max *
        scale_log2 per row); pass the first and last to ``exponentiate``."""
        row_max_new, rescale, max_scaled = self._maxima(acc_rows_cols(acc_s), is_first)
        row_scale = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            row_scale[r] = self._alpha(r, max_scaled[r], rescale, is_first)
            self.row_max[r] = row_max_new[r]
        return row_scale, rescale, max_scaled

    @cute.jit
    def exponentiate(self, acc_s: cute.Tensor, max_scaled: cute.Tensor,
                     row_scale: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> None:
        """Second half of ``update``: p = 2^(s * scale_log2 - max_scaled) in place, and the row
        sums l = alpha * l + sum(p)."""
        s = acc_rows_cols(acc_s)
        cols = cute.size(s, mode=[1])
        for r in cutlass.range_constexpr(self.num_rows):
            s_row = s[r, None]
            self.exp2_row(s_row, max_scaled[r])
            self._fold_sum(r, s_row, cols, row_scale, is_first)

    # Note [Reduction shape]
    # A row's 32 values (per thread, at tile_n = 128) reduce to one max and, after the
    # exponentials, one sum. A pairwise tree has depth 5 instead of 31, but a warp issues in
    # order: a tree's upper levels wait for the fixed latency of the level below, and with them
    # every exponential behind them in the stream. A chain that takes the values in the order
    # the exponentials produce them waits only for the value it adds: the MUFU result it would
    # wait for anyway. So chains were tried: the max and the sum each in 1, 2 or 4 running
    # chains, the sum's first chain starting from alpha * l (the rescaled old sum costs one FMUL
    # and no extra add; only the order of the fp32 additions changes). Timed on the H200 at a
    # fixed clock they did not pay: one chain was never faster than the tree beyond the
    # spread, and slower at D = 128, where ptxas scheduled the chained step worse (the
    # waiting moved to other instructions). The tree stayed and the knob went.

    @cute.jit
    def _fold_sum(self, r: int, s_row, cols: int, row_scale, is_first: cutlass.Constexpr[bool]):
        """row_sum[r] <- (alpha * row_sum[r] unless first) + sum of the row's p."""
        add = lambda a, b: a + b  # noqa: E731
        tile_sum = tree_reduce([s_row[c] for c in range(cols)], add)
        if const_expr(is_first):
            self.row_sum[r] = tile_sum
        else:
            self.row_sum[r] = self.row_sum[r] * row_scale[r] + tile_sum

    @cute.jit
    def rescale_o(self, acc_o: cute.Tensor, row_scale: cute.Tensor, needed=True) -> None:
        """O_row *= alpha_row; with tau > 0 (or skip_unchanged), skipped by the whole warp when
        its vote said no."""
        if const_expr(self._may_skip()):
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

    @cute.jit
    def finalize(self, sink=None) -> tuple:
        """(1 / l, lse) per row after reducing the partial sums over the row's lanes; a row that
        saw no key gets (0, -inf), so out = 0 and lse = -inf. ``sink``: the head's learnable
        sink logit (Float32, natural-log units), folded into l and lse
        (Note [Learnable sink]); None compiles the plain step."""
        inv_sum = cute.make_rmem_tensor(self.num_rows, Float32)
        lse = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total = self._quad_sum(self.row_sum[r])
            max_scaled = self.row_max[r] * self.scale_log2
            if const_expr(sink is not None):
                total, max_scaled = fold_sink(total, max_scaled, self.row_max[r], sink)
            inv_sum[r], lse[r] = inverse_sum_and_lse(total, max_scaled)
        return inv_sum, lse


@cute.jit
def inverse_sum_and_lse(total: Float32, max_scaled: Float32) -> tuple:
    """(1 / l, lse) of one row from its sum l (against its max) and that max times scale_log2:
    lse = (max scale_log2 + log2 l) ln 2. A row that saw no key (l = 0, or NaN from a sink
    folded into an empty row: Note [Learnable sink]) gets (0, -inf), so out = 0 and
    lse = -inf. Shared by OnlineSoftmax.finalize and the decode kernel's transposed epilogue
    (Note [Keys on M] in fa4_final.hopper.decode)."""
    seen = total > Float32(0.0)
    safe_total = total if seen else Float32(1.0)
    inv_sum = cute.arch.rcp_approx(safe_total) if seen else Float32(0.0)
    log2_sum = max_scaled + cute.math.log2(safe_total, fastmath=True)
    lse = log2_sum * LN_2 if seen else -Float32.inf
    return inv_sum, lse


# Note [Learnable sink]
# A learnable sink (FA4's ``learnable_sink``, gpt-oss's attention sinks) is one extra logit per
# query head, ``sink[h]`` in natural-log units (not multiplied by the softmax scale, not
# softcapped), that joins every row's softmax denominator and carries no value:
#     out_i = sum_j exp(s_ij - lse_i) v_j,   lse_i = log(exp(sink) + sum_j exp(s_ij))
# so a row's probabilities sum to 1 - exp(sink - lse_i) and lse includes the sink. The running
# max and sum of the KV loop never see it: it enters once, when the row is finalised, as
# 2^(sink log2 e - m scale_log2) added to l (one FFMA and one MUFU.EX2 per row), against the
# max the row's sum was taken with. A row that saw no key (m = -inf) has the sink as its only
# column: its sum becomes 1 against a max of sink log2 e, so out = 0 and lse = sink, as FA4.
# A -inf sink (FA4's padded heads) adds 2^(-inf) = 0 to a row with keys; to a row without any
# it adds 2^NaN, and NaN > 0 is false: out = 0, lse = -inf. The backward needs no new kernel
# code for q, k, v: P = exp(s - lse) with this lse is already the right probability. The sink's
# own gradient is d sink[h] = sum over rows of h of -exp(sink[h] - lse_i) * (delta_i - dlse_i),
# with delta_i = rowsum(dO_i * O_i) (a row without keys: exp(sink - lse) = 1).


@cute.jit
def fold_sink(total: Float32, max_scaled: Float32, row_max: Float32, sink: Float32) -> tuple:
    """(row sum, max * scale_log2) of one row with the sink logit folded in
    (Note [Learnable sink])."""
    if row_max == -Float32.inf:
        max_scaled = sink * Float32(LOG2_E)
    total = total + cute.math.exp2(sink * Float32(LOG2_E) - max_scaled, fastmath=True)
    return total, max_scaled


# Note [Softcap]
# FA4's ``softcap`` (Gemma 2's logit soft-capping): with c > 0 the score that enters the softmax
# is c * tanh(scale * q.k / c) instead of scale * q.k, so every logit lies in (-c, c); c = 0
# means no cap. The scale is applied before the cap, as FA4 orders it (its softcap is a score
# modifier applied to the scaled score, before the mask). The kernel keeps the softmax step
# as it is by moving the constants: it stores t = tanh(q.k * (scale / c)) in the score tile (one
# FMUL and one MUFU.TANH per score) and runs the online softmax with scale_log2 = c * log2 e,
# so 2^(t * c log2 e - m) = exp(c t - m'): the max is taken over t, which is monotone in the
# capped score since c > 0, and lse = (m scale_log2 + log2 l) ln 2 is the capped lse. The cap
# comes before the mask, so masked scores stay -inf (tanh would send them to -1). c is a
# compile-time constant of the build (FA4 bakes it into its compiled score modifier too); the
# run-time softmax_scale / c is the multiplier before tanh. The tanh is tanh.approx.f32 (its
# relative error is about 2^-11): a capped logit near c carries an absolute error up to about
# c * 2^-11, which the probabilities see as a relative error of the same size. The backward
# needs dS * d(capped score)/d(q.k) = dS * scale * (1 - t^2): the t of each score is
# recomputed there, nothing more is stored. The Hopper builds with a softcap and with a
# learnable sink are tested on an H100 against float64 (forward, backward and the sink's
# gradient, through every public entry); an H200 run is pending.


def check_softcap(softcap) -> float:
    """A kernel's softcap as a Python float: 0.0 (no cap) or a finite positive number, else
    TypeError / ValueError naming the value (Note [Softcap])."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0 = no cap), got {softcap!r}")
    softcap = float(softcap)
    if not (softcap == 0.0 or (softcap > 0.0 and math.isfinite(softcap))):
        raise ValueError(f"softcap must be 0.0 (no cap) or a finite number > 0, got {softcap!r}")
    return softcap


@cute.jit
def softcap_scores(acc_s: cute.Tensor, cap_scale: Float32) -> None:
    """In place: s <- tanh(s * cap_scale), cap_scale = softmax_scale / softcap
    (Note [Softcap]); one FMUL and one MUFU.TANH per score."""
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        acc_s[i] = cute.math.tanh(acc_s[i] * cap_scale, approx=True)
