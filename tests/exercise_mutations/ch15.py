"""Chapter 15's exercises: typical wrong answers, each with the words its checker must say. Both
exercises are device code (@cute.jit functions: the DSL reads their source from this file):
15.1 the combine of one row's split partials, 15.2 one row of a key tile from a paged cache."""

import math

import cutlass.cute as cute
from cutlass import Float32

from solutions import ch15_decoding as t15
from tests.exercise_mutations import SLOW, mutant, planted

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


# --- 15.1 the combine of one row ----------------------------------------------------------------
combine_nan_when_no_split_saw = mutant(  # -inf - (-inf) when no split saw the row
    t15.combine_row, "Float32(0.0) if m == -Float32.inf else m", "m")


combine_reads_every_split = mutant(  # reads the partials of empty splits
    t15.combine_row, "if w[s] > Float32(0.0):", "if True:")


combine_without_the_max = mutant(  # exp(lse) without subtracting the max
    t15.combine_row, "(lse_p[s] - m_safe) * Float32(LOG2_E)", "lse_p[s] * Float32(LOG2_E)",
    also=[("return m_safe + ", "return ")])


combine_empty_split_weight_one = mutant(  # "avoid -inf arithmetic": an empty split weighs 1
    t15.combine_row, "w[s] = cute.math.exp2((lse_p[s] - m_safe)",
    "lse_s = m_safe if lse_p[s] == -Float32.inf else lse_p[s]; "
    "w[s] = cute.math.exp2((lse_s - m_safe)",
    also=[("if w[s] > Float32(0.0):", "if lse_p[s] != -Float32.inf:")])


combine_unnormalised_weights = mutant(t15.combine_row, "w[s] = w[s] * inv", None)  # w: no / sum


combine_lse_in_log2 = mutant(  # the lse returned in log2 units
    t15.combine_row, "m_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)",
    "m_safe * Float32(LOG2_E) + cute.math.log2(total, fastmath=True)")


combine_out_not_zeroed = mutant(t15.combine_row, "out[i] = Float32(0.0)", "pass")  # not zeroed


combine_recomputes_weights = mutant(  # each split's exponential computed twice
    t15.combine_row, "w[s] = w[s] * inv",
    "w[s] = cute.math.exp2((lse_p[s] - m_safe) * Float32(LOG2_E), fastmath=True) * inv")


@cute.jit
def combine_calls_the_reference(lse_p, out_p, w, out) -> Float32:
    return t15.combine_row(lse_p, out_p, w, out)


# --- 15.2 one row of a key tile from a paged cache ---------------------------------------------
gather_slot_as_page = mutant(  # the page-table slot taken for the page
    t15.gather_key_row, "page = page_table[b, j // page_size]", "page = j // page_size")


gather_reads_past_the_sequence = mutant(  # no bound: reads past the sequence
    t15.gather_key_row, "if j < seqlen:", "if True:")


gather_page_per_tile = mutant(  # the page looked up by the key tile
    t15.gather_key_row, "page = page_table[b, j // page_size]", "page = page_table[b, n]")


gather_row_in_tile = mutant(t15.gather_key_row, "row = j % page_size", "row = i")  # the tile's row


gather_leaves_the_tail = mutant(  # keys past seqlen left as they were
    t15.gather_key_row, "sK[i, d] = sK.element_type(0)", "pass")


gather_wrong_head = mutant(  # always KV head 0
    t15.gather_key_row, "mK[page, row, h, d]", "mK[page, row, 0, d]")


MUTATIONS = [
    *planted("15.1", t15.check_combine_row, t15.combine_row, t15.FORBID_COMBINE, rows=[
        (combine_nan_when_no_split_saw, "-inf - (-inf) is NaN"),
        (combine_reads_every_split, "a split whose lse is -inf was read"),
        (combine_without_the_max, "an exponential overflowed"),
        (combine_empty_split_weight_one, "a split whose lse is -inf got weight"),
        (combine_unnormalised_weights, "the weights in w sum to"),
        (combine_lse_in_log2, "in log2 units"),
        (combine_out_not_zeroed, "set out to 0"),
        (combine_recomputes_weights, "recomputes the exponentials", SLOW),
        (combine_calls_the_reference, "that is the reference solution"),
    ]),
    *planted("15.2", t15.check_gather_key_row, t15.gather_key_row, t15.FORBID_GATHER, rows=[
        (gather_slot_as_page, "row offset uses page index instead of page_table[b, page]"),
        (gather_reads_past_the_sequence, "test j < seqlen"),
        (gather_page_per_tile, "you looked the page up by the key tile"),
        (gather_row_in_tile, "the row inside the page is j % page_size"),
        (gather_leaves_the_tail, "must be 0"),
        (gather_wrong_head, "you read KV head"),
    ]),
]


# --- 15.3 a decode loop a CUDA graph can replay -------------------------------------------------
def _copy_in(engine, step):
    q, table, used = step
    engine.q.copy_(q)
    engine.page_table.copy_(table)
    engine.seqused_k.copy_(used)


def _launch(engine):
    engine.decode(engine.q, engine.page_table, engine.seqused_k, engine.out)


serve_without_warm_up = mutant(  # the first launch (a compile) inside the capture
    t15.serve_graph, "engine.out)  # compile + warm up", None)


def serve_with_the_first_tensors(engine, steps):
    q, table, used = steps[0]
    engine.decode(q, table, used, engine.out)
    graph = t15.Graph()
    with engine.capture(graph):
        engine.decode(q, table, used, engine.out)
    outs = []
    for _ in steps:
        graph.replay()
        outs.append(engine.out.clone())
    return outs


def serve_capturing_every_step(engine, steps):
    _copy_in(engine, steps[0])
    _launch(engine)
    outs = []
    for step in steps:
        _copy_in(engine, step)
        graph = t15.Graph()
        with engine.capture(graph):
            _launch(engine)
        graph.replay()
        outs.append(engine.out.clone())
    return outs


serve_keeping_out_itself = mutant(  # every step's out is the one buffer
    t15.serve_graph, "outs.append(engine.out.clone())", "outs.append(engine.out)")


def serve_with_new_buffers(engine, steps):
    engine.q, engine.page_table, engine.seqused_k = (t.clone() for t in steps[0])
    _launch(engine)
    graph = t15.Graph()
    with engine.capture(graph):
        _launch(engine)
    outs = []
    for step in steps:
        engine.q, engine.page_table, engine.seqused_k = (t.clone() for t in step)
        graph.replay()
        outs.append(engine.out.clone())
    return outs


def serve_without_a_graph(engine, steps):
    outs = []
    for step in steps:
        _copy_in(engine, step)
        _launch(engine)
        outs.append(engine.out.clone())
    return outs


MUTATIONS += [
    *planted("15.3", t15.check_serve_graph, t15.serve_graph, t15.FORBID_SERVE, rows=[
        (serve_without_warm_up, "compiled while the graph was being captured"),
        (serve_with_the_first_tensors, "the replay reads the captured buffers"),
        (serve_capturing_every_step, "capture once"),
        (serve_keeping_out_itself, "engine.out itself"),
        (serve_with_new_buffers, "you replaced engine.q with a new tensor"),
        (serve_without_a_graph, "nothing was captured"),
    ]),
]
