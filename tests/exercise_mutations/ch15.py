"""Chapter 15's exercises: typical wrong answers, each with the words its checker must say. Both
exercises are device code (@cute.jit functions: the DSL reads their source from this file):
15.1 the combine of one row's split partials, 15.2 one row of a key tile from a paged cache."""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from solutions import ch15_decoding as t15
from tests.exercise_mutations import Mutation

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


# --- 15.1 the combine of one row ----------------------------------------------------------------
@cute.jit
def combine_nan_when_no_split_saw(lse_p, out_p, w, out) -> Float32:
    n = cute.size(lse_p)
    m = -Float32.inf
    for s in cutlass.range(n):
        m = cute.arch.fmax(m, lse_p[s])
    total = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = cute.math.exp2((lse_p[s] - m) * Float32(LOG2_E), fastmath=True)
        total = total + w[s]
    inv = cute.arch.rcp_approx(total)
    for i in cutlass.range_constexpr(cute.size(out)):
        out[i] = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = w[s] * inv
        if w[s] > Float32(0.0):
            for i in cutlass.range_constexpr(cute.size(out)):
                out[i] = out[i] + w[s] * out_p[s, i]
    return m + cute.math.log2(total, fastmath=True) * Float32(LN_2)


@cute.jit
def combine_reads_every_split(lse_p, out_p, w, out) -> Float32:
    n = cute.size(lse_p)
    m = -Float32.inf
    for s in cutlass.range(n):
        m = cute.arch.fmax(m, lse_p[s])
    m_safe = Float32(0.0) if m == -Float32.inf else m
    total = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = cute.math.exp2((lse_p[s] - m_safe) * Float32(LOG2_E), fastmath=True)
        total = total + w[s]
    inv = Float32(0.0) if total == Float32(0.0) else cute.arch.rcp_approx(total)
    for i in cutlass.range_constexpr(cute.size(out)):
        out[i] = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = w[s] * inv
        for i in cutlass.range_constexpr(cute.size(out)):
            out[i] = out[i] + w[s] * out_p[s, i]
    return m_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)


@cute.jit
def combine_without_the_max(lse_p, out_p, w, out) -> Float32:
    n = cute.size(lse_p)
    total = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = cute.math.exp2(lse_p[s] * Float32(LOG2_E), fastmath=True)
        total = total + w[s]
    inv = Float32(0.0) if total == Float32(0.0) else cute.arch.rcp_approx(total)
    for i in cutlass.range_constexpr(cute.size(out)):
        out[i] = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = w[s] * inv
        if w[s] > Float32(0.0):
            for i in cutlass.range_constexpr(cute.size(out)):
                out[i] = out[i] + w[s] * out_p[s, i]
    return cute.math.log2(total, fastmath=True) * Float32(LN_2)


@cute.jit
def combine_empty_split_weight_one(lse_p, out_p, w, out) -> Float32:
    n = cute.size(lse_p)
    m = -Float32.inf
    for s in cutlass.range(n):
        m = cute.arch.fmax(m, lse_p[s])
    m_safe = Float32(0.0) if m == -Float32.inf else m
    total = Float32(0.0)
    for s in cutlass.range(n):
        lse_s = m_safe if lse_p[s] == -Float32.inf else lse_p[s]  # "avoid -inf arithmetic"
        w[s] = cute.math.exp2((lse_s - m_safe) * Float32(LOG2_E), fastmath=True)
        total = total + w[s]
    inv = cute.arch.rcp_approx(total)
    for i in cutlass.range_constexpr(cute.size(out)):
        out[i] = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = w[s] * inv
        if lse_p[s] != -Float32.inf:
            for i in cutlass.range_constexpr(cute.size(out)):
                out[i] = out[i] + w[s] * out_p[s, i]
    return m_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)


@cute.jit
def combine_unnormalised_weights(lse_p, out_p, w, out) -> Float32:
    n = cute.size(lse_p)
    m = -Float32.inf
    for s in cutlass.range(n):
        m = cute.arch.fmax(m, lse_p[s])
    m_safe = Float32(0.0) if m == -Float32.inf else m
    total = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = cute.math.exp2((lse_p[s] - m_safe) * Float32(LOG2_E), fastmath=True)
        total = total + w[s]
    inv = Float32(0.0) if total == Float32(0.0) else cute.arch.rcp_approx(total)
    for i in cutlass.range_constexpr(cute.size(out)):
        out[i] = Float32(0.0)
    for s in cutlass.range(n):
        if w[s] > Float32(0.0):
            for i in cutlass.range_constexpr(cute.size(out)):
                out[i] = out[i] + w[s] * out_p[s, i]
    for i in cutlass.range_constexpr(cute.size(out)):
        out[i] = out[i] * inv
    return m_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)


@cute.jit
def combine_lse_in_log2(lse_p, out_p, w, out) -> Float32:
    n = cute.size(lse_p)
    m = -Float32.inf
    for s in cutlass.range(n):
        m = cute.arch.fmax(m, lse_p[s])
    m_safe = Float32(0.0) if m == -Float32.inf else m
    total = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = cute.math.exp2((lse_p[s] - m_safe) * Float32(LOG2_E), fastmath=True)
        total = total + w[s]
    inv = Float32(0.0) if total == Float32(0.0) else cute.arch.rcp_approx(total)
    for i in cutlass.range_constexpr(cute.size(out)):
        out[i] = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = w[s] * inv
        if w[s] > Float32(0.0):
            for i in cutlass.range_constexpr(cute.size(out)):
                out[i] = out[i] + w[s] * out_p[s, i]
    return m_safe * Float32(LOG2_E) + cute.math.log2(total, fastmath=True)


@cute.jit
def combine_out_not_zeroed(lse_p, out_p, w, out) -> Float32:
    n = cute.size(lse_p)
    m = -Float32.inf
    for s in cutlass.range(n):
        m = cute.arch.fmax(m, lse_p[s])
    m_safe = Float32(0.0) if m == -Float32.inf else m
    total = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = cute.math.exp2((lse_p[s] - m_safe) * Float32(LOG2_E), fastmath=True)
        total = total + w[s]
    inv = Float32(0.0) if total == Float32(0.0) else cute.arch.rcp_approx(total)
    for s in cutlass.range(n):
        w[s] = w[s] * inv
        if w[s] > Float32(0.0):
            for i in cutlass.range_constexpr(cute.size(out)):
                out[i] = out[i] + w[s] * out_p[s, i]
    return m_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)


@cute.jit
def combine_recomputes_weights(lse_p, out_p, w, out) -> Float32:
    n = cute.size(lse_p)
    m = -Float32.inf
    for s in cutlass.range(n):
        m = cute.arch.fmax(m, lse_p[s])
    m_safe = Float32(0.0) if m == -Float32.inf else m
    total = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = cute.math.exp2((lse_p[s] - m_safe) * Float32(LOG2_E), fastmath=True)
        total = total + w[s]
    inv = Float32(0.0) if total == Float32(0.0) else cute.arch.rcp_approx(total)
    for i in cutlass.range_constexpr(cute.size(out)):
        out[i] = Float32(0.0)
    for s in cutlass.range(n):
        ws = cute.math.exp2((lse_p[s] - m_safe) * Float32(LOG2_E), fastmath=True) * inv
        w[s] = ws
        if ws > Float32(0.0):
            for i in cutlass.range_constexpr(cute.size(out)):
                out[i] = out[i] + ws * out_p[s, i]
    return m_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)


@cute.jit
def combine_calls_the_reference(lse_p, out_p, w, out) -> Float32:
    return t15.combine_row(lse_p, out_p, w, out)


# --- 15.2 one row of a key tile from a paged cache ---------------------------------------------
@cute.jit
def gather_slot_as_page(mK, page_table, b: Int32, h: Int32, n: Int32, i: Int32, seqlen: Int32,
                        sK):
    tile_n = cute.size(sK, mode=[0])
    page_size = cute.size(mK, mode=[1])
    j = n * tile_n + i
    if j < seqlen:
        for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
            sK[i, d] = mK[j // page_size, j % page_size, h, d]
    else:
        for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
            sK[i, d] = sK.element_type(0)


@cute.jit
def gather_reads_past_the_sequence(mK, page_table, b: Int32, h: Int32, n: Int32, i: Int32,
                                   seqlen: Int32, sK):
    tile_n = cute.size(sK, mode=[0])
    page_size = cute.size(mK, mode=[1])
    j = n * tile_n + i
    page = page_table[b, j // page_size]
    for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
        sK[i, d] = mK[page, j % page_size, h, d]


@cute.jit
def gather_page_per_tile(mK, page_table, b: Int32, h: Int32, n: Int32, i: Int32,
                         seqlen: Int32, sK):
    tile_n = cute.size(sK, mode=[0])
    page_size = cute.size(mK, mode=[1])
    j = n * tile_n + i
    if j < seqlen:
        page = page_table[b, n]
        for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
            sK[i, d] = mK[page, j % page_size, h, d]
    else:
        for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
            sK[i, d] = sK.element_type(0)


@cute.jit
def gather_row_in_tile(mK, page_table, b: Int32, h: Int32, n: Int32, i: Int32, seqlen: Int32,
                       sK):
    tile_n = cute.size(sK, mode=[0])
    page_size = cute.size(mK, mode=[1])
    j = n * tile_n + i
    if j < seqlen:
        page = page_table[b, j // page_size]
        for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
            sK[i, d] = mK[page, i, h, d]
    else:
        for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
            sK[i, d] = sK.element_type(0)


@cute.jit
def gather_leaves_the_tail(mK, page_table, b: Int32, h: Int32, n: Int32, i: Int32,
                           seqlen: Int32, sK):
    tile_n = cute.size(sK, mode=[0])
    page_size = cute.size(mK, mode=[1])
    j = n * tile_n + i
    if j < seqlen:
        page = page_table[b, j // page_size]
        for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
            sK[i, d] = mK[page, j % page_size, h, d]


@cute.jit
def gather_wrong_head(mK, page_table, b: Int32, h: Int32, n: Int32, i: Int32, seqlen: Int32,
                      sK):
    tile_n = cute.size(sK, mode=[0])
    page_size = cute.size(mK, mode=[1])
    j = n * tile_n + i
    if j < seqlen:
        page = page_table[b, j // page_size]
        for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
            sK[i, d] = mK[page, j % page_size, 0, d]
    else:
        for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
            sK[i, d] = sK.element_type(0)


ARGS_1 = dict(reference=t15.combine_row, forbid=t15.FORBID_COMBINE)
ARGS_2 = dict(reference=t15.gather_key_row, forbid=t15.FORBID_GATHER)
MUTATIONS = [
    Mutation("15.1", t15.check_combine_row, combine_nan_when_no_split_saw,
             "-inf - (-inf) is NaN", **ARGS_1),
    Mutation("15.1", t15.check_combine_row, combine_reads_every_split,
             "a split whose lse is -inf was read", **ARGS_1),
    Mutation("15.1", t15.check_combine_row, combine_without_the_max,
             "an exponential overflowed", **ARGS_1),
    Mutation("15.1", t15.check_combine_row, combine_empty_split_weight_one,
             "a split whose lse is -inf got weight", **ARGS_1),
    Mutation("15.1", t15.check_combine_row, combine_unnormalised_weights,
             "the weights in w sum to", **ARGS_1),
    Mutation("15.1", t15.check_combine_row, combine_lse_in_log2, "in log2 units", **ARGS_1),
    Mutation("15.1", t15.check_combine_row, combine_out_not_zeroed, "set out to 0", **ARGS_1),
    Mutation("15.1", t15.check_combine_row, combine_recomputes_weights,
             "recomputes the exponentials", slow=True, **ARGS_1),
    Mutation("15.1", t15.check_combine_row, combine_calls_the_reference,
             "that is the reference solution", **ARGS_1),
    Mutation("15.2", t15.check_gather_key_row, gather_slot_as_page,
             "row offset uses page index instead of page_table[b, page]", **ARGS_2),
    Mutation("15.2", t15.check_gather_key_row, gather_reads_past_the_sequence,
             "test j < seqlen", **ARGS_2),
    Mutation("15.2", t15.check_gather_key_row, gather_page_per_tile,
             "you looked the page up by the key tile", **ARGS_2),
    Mutation("15.2", t15.check_gather_key_row, gather_row_in_tile,
             "the row inside the page is j % page_size", **ARGS_2),
    Mutation("15.2", t15.check_gather_key_row, gather_leaves_the_tail, "must be 0", **ARGS_2),
    Mutation("15.2", t15.check_gather_key_row, gather_wrong_head, "you read KV head", **ARGS_2),
]


# --- 15.3 a decode loop a CUDA graph can replay -------------------------------------------------
def _copy_in(engine, step):
    q, table, used = step
    engine.q.copy_(q)
    engine.page_table.copy_(table)
    engine.seqused_k.copy_(used)


def _launch(engine):
    engine.decode(engine.q, engine.page_table, engine.seqused_k, engine.out)


def serve_without_warm_up(engine, steps):
    _copy_in(engine, steps[0])
    graph = t15.Graph()
    with engine.capture(graph):
        _launch(engine)
    outs = []
    for step in steps:
        _copy_in(engine, step)
        graph.replay()
        outs.append(engine.out.clone())
    return outs


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


def serve_keeping_out_itself(engine, steps):
    _copy_in(engine, steps[0])
    _launch(engine)
    graph = t15.Graph()
    with engine.capture(graph):
        _launch(engine)
    outs = []
    for step in steps:
        _copy_in(engine, step)
        graph.replay()
        outs.append(engine.out)
    return outs


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


ARGS_3 = dict(reference=t15.serve_graph, forbid=t15.FORBID_SERVE)
MUTATIONS += [
    Mutation("15.3", t15.check_serve_graph, serve_without_warm_up,
             "compiled while the graph was being captured", **ARGS_3),
    Mutation("15.3", t15.check_serve_graph, serve_with_the_first_tensors,
             "the replay reads the captured buffers", **ARGS_3),
    Mutation("15.3", t15.check_serve_graph, serve_capturing_every_step, "capture once",
             **ARGS_3),
    Mutation("15.3", t15.check_serve_graph, serve_keeping_out_itself, "engine.out itself",
             **ARGS_3),
    Mutation("15.3", t15.check_serve_graph, serve_with_new_buffers,
             "you replaced engine.q with a new tensor", **ARGS_3),
    Mutation("15.3", t15.check_serve_graph, serve_without_a_graph, "nothing was captured",
             **ARGS_3),
]
