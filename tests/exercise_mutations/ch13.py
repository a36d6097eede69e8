"""Chapter 13's exercises: typical wrong answers, each with the words its checker must say. The
device-code ones (13.3 the sink mask, 13.4 the softcap) are @cute.jit functions. Most are the
reference with one change (``mutant``)."""

import math
import numbers

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from fa4_final.common.tiles import visible_cols
from solutions import ch13_scores as t13s
from solutions import ch13_teaching as t13
from tests.exercise_mutations import SLOW, mutant, planted

normalise_window = t13.package_window_reader()


# --- 13.3 the window mask with sink tokens ----------------------------------------------------
MASK, CAP, CHECK = t13s.sink_mask, t13s.softcap_scores, t13.check_sink_tokens
KEEP = "(col < hi) & ((col >= lo) | (col < sink_end))"

mask_without_sinks = mutant(MASK, KEEP, "(col < hi) & (col >= lo)")  # the window alone


sinks_one_too_many = mutant(MASK, "(col < sink_end)", "(col <= sink_end)")  # sink + 1 keys


sinks_past_the_right_side = mutant(  # sinks kept right of the window too
    MASK, KEEP, "((col < hi) & (col >= lo)) | (col < sink_end)")


sinks_in_every_tile = mutant(  # the first columns of every tile taken for sinks
    MASK, "sink - n_block * w.tile_n - col_offset", "sink - col_offset")


limits_not_shifted = mutant(  # tile limits compared with thread 0's columns unshifted
    MASK, "lo = lo - col_offset", None, also=[
        ("hi = hi - col_offset", None), ("n_block * w.tile_n - col_offset", "n_block * w.tile_n")])


@cute.jit
def mask_with_an_if(s, tScS, t0ScS, w: cutlass.Constexpr, m_block, n_block, seqlen_q, seqlen_k,
                    window_left, window_right, sink: cutlass.Constexpr[int]):
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = m_block * w.tile_m + tScS[r, 0][0]
        lo, hi = visible_cols(w, row, n_block, seqlen_q, seqlen_k, window_left, window_right)
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            col = tScS[r, c][1]
            if (col >= hi) | ((col < lo) & (n_block * w.tile_n + col >= sink)):
                s[r, c] = -Float32.inf


# --- 13.4 the softcap -------------------------------------------------------------------------
softcap_unscaled = mutant(  # the scale forgotten both ways
    CAP, "into = softmax_scale / softcap", "into = 1.0 / softcap",
    also=[("back = softcap / softmax_scale", "back = softcap")])


softcap_scaled_twice = mutant(  # not divided back: the softmax scales again
    CAP, "back = softcap / softmax_scale", "back = softcap")


softcap_slow_tanh = mutant(CAP, ", fastmath=True)", ")")  # tanh without MUFU.TANH


@cute.jit
def softcap_divides_per_element(s, softmax_scale: Float32, softcap: Float32):
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            s[r, c] = cute.math.tanh(s[r, c] * softmax_scale / softcap, fastmath=True) \
                * softcap / softmax_scale


def softcap_on_the_host(s, softmax_scale, softcap):
    for i in range(cute.size(s)):
        s[i] = math.tanh(s[i] * softmax_scale / softcap) * softcap / softmax_scale


# --- 13.1 the check of sink_tokens ----------------------------------------------------------
def _count(sink_tokens):
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, numbers.Integral) \
            or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
    return int(sink_tokens)


sink_check_takes_bools = mutant(CHECK, "isinstance(sink_tokens, bool) or ", "")  # True is 1


sink_check_reads_negative_left_as_none = mutant(  # a negative left side read as none
    CHECK, "left is not None and right is not None and left < 0 and right < 0",
    "left is not None and left < 0")


sink_check_forgets_two_negative_sides = mutant(  # (-1, -1) taken for a bound
    CHECK, "and left < 0 and right < 0:", None, also=[("left = None  # FA4", None)])


def sink_check_says_too_little(sink_tokens, window_size=None, causal=False):
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, numbers.Integral) \
            or sink_tokens < 0:
        raise ValueError("bad sink_tokens")
    left, right = (None, None) if window_size is None else window_size
    if left is not None and right is not None and left < 0 and right < 0:
        left = None
    if sink_tokens and left is None:
        raise ValueError("bad window")
    return int(sink_tokens)


def sink_check_through_the_package(sink_tokens, window_size=None, causal=False):
    _, left, _ = normalise_window(causal, window_size)
    n = _count(sink_tokens)
    if n and left is None:
        raise ValueError(f"sink_tokens={n} needs a left side of the window")
    return n


# --- 13.2 the cache key -----------------------------------------------------------------------
def key_of_everything(call):
    return tuple(sorted((k, repr(v)) for k, v in call.items()))


def _key(call):
    left, right = call["window_size"]
    return ("fwd", call["dtype"], call["head_dim"], call["causal"], left is not None,
            right is not None)


def key_with_window_sizes(call):
    return (*_key(call), call["config"], call["window_size"])


def key_without_config(call):
    return _key(call)


def key_with_an_object(call):
    return (*_key(call), call["config"], object())


def key_without_window_sides(call):
    return ("fwd", call["dtype"], call["head_dim"], call["causal"], call["config"])


MUTATIONS = [
    *planted("13.1", t13.check_check_sink, t13.check_sink_tokens, t13.SINK_CHECK_FORBID, rows=[
        (sink_check_takes_bools, "a bool is not a count"),
        (sink_check_reads_negative_left_as_none, "a negative left side is a bound too"),
        (sink_check_forgets_two_negative_sides, "two negative sides are no window"),
        (sink_check_says_too_little, "does not name"),
        (sink_check_through_the_package, "normalise_window"),
    ]),
    *planted("13.2", t13.check_kernel_key, t13.kernel_key, rows=[
        (key_of_everything, "runtime argument"),
        (key_with_window_sizes, "window sizes 128 and 512"),
        (key_without_config, "config"),
        (key_with_an_object, "object address"),
        (key_without_window_sides, "changing window_size"),
    ]),
    *planted("13.3", t13s.check_sink_mask, t13s.sink_mask, t13s.SINK_MASK_FORBID, rows=[
        (mask_without_sinks, "it is a sink token"),
        (sinks_one_too_many, "a mask off by one"),
        (sinks_past_the_right_side, "it is right of the window"),
        (sinks_in_every_tile, "is not a sink"),
        (limits_not_shifted, "must be masked"),
        (mask_with_an_if, "instructions per element", SLOW),
    ]),
    *planted("13.4", t13s.check_softcap, t13s.softcap_scores, t13s.SOFTCAP_FORBID, rows=[
        (softcap_unscaled, "the scores reach your function unscaled"),
        (softcap_scaled_twice, "the softmax multiplies by the scale again"),
        (softcap_slow_tanh, "fastmath=True"),
        (softcap_divides_per_element, "divides per element", SLOW),
        (softcap_on_the_host, "math.tanh"),
    ]),
]
