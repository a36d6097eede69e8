"""Chapter 14's exercises: typical wrong answers, each with the words its checker must say. The
device-code ones (14.1 the merge of two partials, 14.2 the one-pass step) are @cute.jit
functions; most wrong answers are the reference with one change (``mutant``)."""

import math

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32

from solutions import ch14_ring as ring
from solutions import ch14_teaching as t14
from tests.exercise_mutations import SLOW, mutant, planted

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


# --- 14.1 the merge of two partials -------------------------------------------------------------
PAIR, STEP, LOOP = t14.merge_pair, t14.merge_step, t14.ring_loop

merge_unstable = mutant(  # exp(lse) without subtracting the max
    PAIR, "(lse1 - m_safe)", "lse1",
    also=[("(lse2 - m_safe)", "lse2"), ("return m_safe + ", "return ")])


merge_nan_for_empty_rows = mutant(  # -inf - (-inf) when neither part saw a key
    PAIR, "Float32(0.0) if m == -Float32.inf else m", "m")


merge_lse_in_log2 = mutant(  # the lse returned in log2 units
    PAIR, "m_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)",
    "m_safe * Float32(LOG2_E) + cute.math.log2(total, fastmath=True)")


merge_not_normalised = mutant(  # the weights not divided by their sum
    PAIR, "w1 = w1 * inv", None, also=[("w2 = w2 * inv", None)])


@cute.jit
def merge_divides_per_element(o1, lse1: Float32, o2, lse2: Float32, o) -> Float32:
    m = cute.arch.fmax(lse1, lse2)
    m_safe = Float32(0.0) if m == -Float32.inf else m
    w1 = cute.math.exp2((lse1 - m_safe) * Float32(LOG2_E), fastmath=True)
    w2 = cute.math.exp2((lse2 - m_safe) * Float32(LOG2_E), fastmath=True)
    total = w1 + w2
    safe = Float32(1.0) if total == Float32(0.0) else total
    for i in cutlass.range_constexpr(cute.size(o)):
        o[i] = (o1[i] * w1 + o2[i] * w2) / safe
    return m_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)


merge_forgets_the_max = mutant(PAIR, "return m_safe + ", "return ")  # lse without the max


# --- 14.2 the one-pass step --------------------------------------------------------------------
step_without_rescale = mutant(  # acc not rescaled to the new max
    STEP, "acc[i] * alpha + o_b[i] * w", "acc[i] + o_b[i] * w")


step_nan_before_any_key = mutant(  # -inf - (-inf) before any key
    STEP, "Float32(0.0) if m_new == -Float32.inf else m_new", "m_new")


@cute.jit
def step_divides(acc, row_max: Float32, row_sum: Float32, o_b, lse_b: Float32):
    m_new = cute.arch.fmax(row_max, lse_b)
    m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
    old_safe = m_safe if row_max == -Float32.inf else row_max
    alpha = Float32(1.0) / cute.math.exp2((m_safe - old_safe) * Float32(LOG2_E), fastmath=True)
    alpha = Float32(0.0) if row_max == -Float32.inf else alpha
    w = cute.math.exp2((lse_b - m_safe) * Float32(LOG2_E), fastmath=True)
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = acc[i] * alpha + o_b[i] * w
    return m_new, row_sum * alpha + w


@cute.jit
def step_old_max_only(acc, row_max: Float32, row_sum: Float32, o_b, lse_b: Float32):
    m_safe = Float32(0.0) if row_max == -Float32.inf else row_max
    w = cute.math.exp2((lse_b - m_safe) * Float32(LOG2_E), fastmath=True)
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = acc[i] + o_b[i] * w
    m_new = row_max if row_max != -Float32.inf else lse_b
    scale = cute.math.exp2((m_safe - (Float32(0.0) if m_new == -Float32.inf else m_new))
                           * Float32(LOG2_E), fastmath=True)
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = acc[i] * scale
    return m_new, (row_sum + w) * scale


# --- 14.3 the ring loop ------------------------------------------------------------------------
loop_attends_first = mutant(  # the exchange starts only after attend: nothing overlaps
    LOOP, "handle = comm.exchange(kv) if", None, also=[
        ("if handle is not None:", "if step + 1 < comm.world:"),
        ("kv = handle.wait()", "kv = comm.exchange(kv).wait()")])


loop_waits_first = mutant(  # the next piece awaited before attend: nothing overlaps
    LOOP, "handle = comm.exchange(kv) if", "nxt = comm.exchange(kv).wait() if",
    also=[("if handle is not None:", "if nxt is not None:"), ("kv = handle.wait()", "kv = nxt")])


loop_sends_on_the_last_step = mutant(  # W exchanges where W - 1 do
    LOOP, "comm.exchange(kv) if step + 1 < comm.world else None", "comm.exchange(kv)")


loop_wrong_source = mutant(LOOP, "(comm.rank - step)", "(comm.rank + step)")  # wrong way round


loop_keeps_the_last_block = mutant(  # each step's result replaces the last
    LOOP, "(o_b, l_b) if out is None else ring.merge(out, lse, o_b, l_b)", "o_b, l_b")


def loop_uses_the_ring(q, kv, comm, attend):
    return ring.ring_forward(q, kv[0], kv[1], None, comm)


# --- 14.4 the chunk assignment -----------------------------------------------------------------
def chunks_contiguous(world):
    return [(2 * r, 2 * r + 1) for r in range(world)]


def chunks_striped(world):
    return [(r, world + r) for r in range(world)]


def chunks_off_by_one(world):
    return [(r, 2 * world - r) for r in range(world)]


def chunks_from_the_layout(world):
    return [tuple(range(2)) for _ in ring.zigzag_layout(2 * world, world).ranges]


MUTATIONS = [
    *planted("14.1", t14.check_merge_pair, t14.merge_pair, t14.FORBID_MERGE, rows=[
        (merge_unstable, "an exponential overflowed"),
        (merge_nan_for_empty_rows, "-inf - (-inf) is NaN"),
        (merge_lse_in_log2, "in log2 units"),
        (merge_not_normalised, "the weights do not sum to 1"),
        (merge_divides_per_element, "divides per element", SLOW),
        (merge_forgets_the_max, "the merged lse is"),
    ]),
    *planted("14.2", t14.check_merge_step, t14.merge_step, t14.FORBID_STEP, rows=[
        (step_without_rescale, "must be rescaled"),
        (step_nan_before_any_key, "is NaN"),
        (step_divides, "your step divides", SLOW),
        (step_old_max_only, "overflowed"),
    ]),
    *planted("14.3", t14.check_ring_loop, t14.ring_loop, t14.FORBID_RING_LOOP, rows=[
        (loop_attends_first, "attend ran before the exchange was started"),
        (loop_waits_first, "nothing overlaps"),
        (loop_sends_on_the_last_step, "W - 1 are enough"),
        (loop_wrong_source, "src must name it"),
        (loop_keeps_the_last_block, "every piece must be merged"),
        (loop_uses_the_ring, "that is the chapter's ring"),
    ]),
    *planted("14.4", t14.check_zigzag, t14.zigzag_chunks, t14.FORBID_ZIGZAG, rows=[
        (chunks_contiguous, "waits for rank"),
        (chunks_striped, "rank 1 (chunks (1, 3)) does"),
        (chunks_off_by_one, "chunk indices run from 0"),
        (chunks_from_the_layout, "that is the chapter's layout"),
    ]),
]

__all__ = ["MUTATIONS", "torch"]
