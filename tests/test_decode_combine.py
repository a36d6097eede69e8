"""The split-KV combine (fa4_final.common.combine) on a CPU.

- The merge itself, as a float64 host model that follows the kernel's steps (max, weights
  normalised once per row, splits added in order, a split of weight 0 never read): on random
  queries, keys and values cut into key ranges (empty ranges and rows that see no key among
  them), merging the ranges' partials equals one softmax over all keys; a row no split saw gets
  out 0 and lse -inf; the partials of empty splits may be NaN. The same model in float32 stays
  within float32's error of it.
- The kernel compiled from fake tensors for sm_90a and sm_100a (slow): 16-byte loads of the
  partials and 16-byte stores of out (PTX and SASS), no local memory and no spills, no atomics
  (the order is fixed), one shared-memory weight row per row of the CTA.
- The kernel's thread plan emulated in float32 on the host (CTAs of rows, lanes holding lse
  slots, butterfly max and sum, the weight table, UNROLL splits at a time): every element of out
  written once, no partial of an empty split read, the result within float32 of the model; and
  tests/gpu/test_decode_combine.py's cases run against that emulation on the CPU, so the GPU
  test's own harness is known to work before a GPU runs it.
- The launch's checks (runtime.decode.combine_splits) on CPU tensors: every bad tensor is named.
The same model is the yardstick of tests/gpu/test_decode_combine.py on the H200.
"""

import math
import re

import pytest
import torch

from fa4_final.common.combine import ELEMS_PER_LANE, MAX_SPLITS, UNROLL, combine_recipe
from fa4_final.common.errors import UnsupportedError
from fa4_final.runtime.decode import _combine_layout, partials_like, split_ranges

slow = pytest.mark.slow


# ----------------------------------------------------------------------------------------------
# the host model


def combine_reference(out_partial, lse_partial):
    """(out, lse) of the merge, in the partials' dtype (float64 for the yardstick): dense layout
    out_partial (n, b, s, h, dv), lse_partial (n, b, h, s). The kernel's steps: m = max lse (0
    in place of -inf), w_s = exp(lse_s - m) / sum w, splits added in order 0, 1, ..., a split
    of weight 0 skipped (its partial never read: NaN there does not leak); a row with a NaN
    split lse is NaN (Note [A NaN split poisons the row])."""
    poisoned = torch.isnan(lse_partial).any(dim=0)  # (b, h, s)
    lse_partial = torch.where(torch.isnan(lse_partial), -math.inf, lse_partial)
    m = lse_partial.amax(dim=0)  # (b, h, s)
    m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w = torch.exp(lse_partial - m_safe)
    total = w.sum(dim=0)
    seen = total > 0
    inv = torch.where(seen, 1.0 / torch.where(seen, total, torch.ones_like(total)),
                      torch.zeros_like(total))
    weights = (w * inv).permute(0, 1, 3, 2).unsqueeze(-1)  # (n, b, s, h, 1)
    out = torch.zeros_like(out_partial[0])
    for s in range(out_partial.shape[0]):
        out = out + torch.where(weights[s] > 0, out_partial[s] * weights[s], torch.zeros_like(out))
    lse = torch.where(seen, m + torch.log(torch.where(seen, total, torch.ones_like(total))),
                      torch.full_like(total, -math.inf))
    lse = torch.where(poisoned, math.nan, lse)
    out = torch.where(poisoned.permute(0, 2, 1).unsqueeze(-1), math.nan, out)
    return out, lse


def attention_partials(q, k, v, bounds, visible=None, poison_empty=True):
    """Per key range [a, b) of ``bounds``: the normalised partial out (n, b, s, h, d) and lse
    (n, b, h, s) of attention restricted to it, in q's dtype; a range a row sees no key of gets
    lse -inf and (poison_empty) NaN out. ``visible``: (b, h, s, sk) bool mask."""
    b, sq, h, d = q.shape
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    outs, lses = [], []
    for lo, hi in bounds:
        s = scores[..., lo:hi]
        lse = torch.logsumexp(s, dim=-1) if hi > lo else \
            torch.full((b, h, sq), -math.inf, dtype=q.dtype)
        p = torch.exp(s - lse.unsqueeze(-1)) if hi > lo else s
        o = torch.einsum("bhqk,bkhd->bqhd", p, v[:, lo:hi]) if hi > lo else \
            torch.zeros(b, sq, h, d, dtype=q.dtype)
        empty = (lse == -math.inf).permute(0, 2, 1).unsqueeze(-1)  # (b, s, h, 1)
        o = torch.where(empty, torch.full_like(o, math.nan if poison_empty else 0.0), o)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def one_shot(q, k, v, visible=None):
    b, sq, h, d = q.shape
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows with no key: 0
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _inputs(b, sq, sk, h, d, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g, dtype=dtype) for n in (sq, sk, sk)]


CASES = {  # name: (batch, seqlen_q, seqlen_k, heads, dim, key ranges, mask)
    "one-split": (2, 1, 37, 4, 64, [(0, 37)], None),
    "three-with-an-empty": (2, 7, 300, 3, 128, [(0, 128), (128, 128), (128, 300)], None),
    "uneven": (1, 16, 1000, 2, 64, split_ranges(8, 5), None),
    "more-splits-than-keys": (1, 3, 5, 2, 64, [(i, min(i + 1, 5)) for i in range(9)], None),
    "causal-rows-see-few": (2, 16, 40, 2, 64, [(0, 8), (8, 24), (24, 40)], "causal"),
    "rows-that-see-nothing": (1, 16, 64, 2, 64, [(0, 16), (16, 64)], "nothing"),
    "128-splits": (1, 2, 512, 2, 64, [(4 * i, 4 * i + 4) for i in range(128)], None),
}


def _mask(kind, b, h, sq, sk):
    if kind is None:
        return None
    qi = torch.arange(sq)[:, None]
    kj = torch.arange(sk)[None, :]
    if kind == "causal":  # bottom right, sq < sk: query i sees keys <= i + sk - sq - 30
        vis = kj <= qi + sk - sq - 30
    else:  # rows 0..5 see no key at all, the others all
        vis = (qi >= 6).expand(sq, sk)
    return vis.expand(b, h, sq, sk)


@pytest.mark.parametrize("name", list(CASES))
def test_merge_equals_one_softmax(name):
    b, sq, sk, h, d, bounds, mask = CASES[name]
    if name == "uneven":  # 5 splits of 8 tiles of 125 keys
        bounds = [(lo * 125, hi * 125) for lo, hi in bounds]
    q, k, v = _inputs(b, sq, sk, h, d, seed=len(name))
    visible = _mask(mask, b, h, sq, sk)
    out_p, lse_p = attention_partials(q, k, v, bounds, visible)
    out, lse = combine_reference(out_p, lse_p)
    ref_out, ref_lse = one_shot(q, k, v, visible)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)
    finite = ref_lse > -math.inf
    assert (lse[finite] - ref_lse[finite]).abs().max() <= 1e-12 * (1 + ref_lse.abs().max())
    assert (out - ref_out).abs().max() <= 1e-12 * (1 + v.abs().max())
    empty_rows = (~finite).permute(0, 2, 1)  # (b, s, h)
    assert (out[empty_rows] == 0).all()


def test_all_empty_rows_give_zero_and_minus_inf():
    n, b, sq, h, d = 4, 2, 3, 2, 64
    out_p = torch.full((n, b, sq, h, d), math.nan, dtype=torch.float64)
    lse_p = torch.full((n, b, h, sq), -math.inf, dtype=torch.float64)
    out, lse = combine_reference(out_p, lse_p)
    assert (out == 0).all() and (lse == -math.inf).all()


def test_a_nan_split_lse_poisons_only_its_row():
    """Note [A NaN split poisons the row]: the model's rows with a NaN split are NaN; the
    others are what they were without it (the NaN split merged as an empty one elsewhere)."""
    q, k, v = _inputs(1, 4, 90, 2, 64, seed=5)
    out_p, lse_p = attention_partials(q, k, v, [(0, 30), (30, 60), (60, 90)], poison_empty=False)
    clean_out, clean_lse = combine_reference(out_p, lse_p)
    lse_p[1, 0, 1, 2] = math.nan
    out_p[1, 0, 2, 1] = math.nan
    out, lse = combine_reference(out_p, lse_p)
    assert torch.isnan(lse[0, 1, 2]) and torch.isnan(out[0, 2, 1]).all()
    row = torch.zeros_like(lse, dtype=torch.bool)
    row[0, 1, 2] = True
    assert torch.equal(lse[~row], clean_lse[~row])
    assert torch.equal(out[~row.permute(0, 2, 1)], clean_out[~row.permute(0, 2, 1)])


def test_merge_is_the_online_softmax_merge_in_any_order():
    """Merging splits pairwise (the online softmax's step) in any order gives the same
    (out, lse): the combine's fixed order is a choice for bitwise repeatability only."""
    q, k, v = _inputs(1, 4, 90, 2, 64, seed=3)
    out_p, lse_p = attention_partials(q, k, v, [(0, 30), (30, 31), (31, 90)], poison_empty=False)
    out, lse = combine_reference(out_p, lse_p)
    for order in ([2, 0, 1], [1, 2, 0]):
        o, m = out_p[order[0]], lse_p[order[0]]
        for s in order[1:]:
            new = torch.logaddexp(m, lse_p[s])
            wa = torch.exp(m - new).permute(0, 2, 1).unsqueeze(-1)
            wb = torch.exp(lse_p[s] - new).permute(0, 2, 1).unsqueeze(-1)
            o, m = o * wa + out_p[s] * wb, new
        assert torch.allclose(o, out, atol=1e-12) and torch.allclose(m, lse, atol=1e-12)


def test_float32_model_within_float32_error():
    """The kernel computes in float32: the same model in float32 stays within a few float32
    ulps of the float64 one, also with lse values spread over 80 nats (weights underflow)."""
    g = torch.Generator().manual_seed(7)
    n, b, sq, h, d = 16, 3, 5, 4, 128
    out_p = torch.randn(n, b, sq, h, d, generator=g, dtype=torch.float64)
    lse_p = torch.rand(n, b, h, sq, generator=g, dtype=torch.float64) * 80 - 40
    lse_p[3] = -math.inf
    out_p[3] = math.nan
    ref_out, ref_lse = combine_reference(out_p, lse_p)
    out32, lse32 = combine_reference(out_p.float(), lse_p.float())
    assert (out32.double() - ref_out).abs().max() <= 1e-5 * ref_out.abs().max()
    assert (lse32.double() - ref_lse).abs().max() <= 1e-5 * (1 + ref_lse.abs().max())


# ----------------------------------------------------------------------------------------------
# the kernel's plan, emulated on the host


def emulate_combine(out_partial, lse_partial, out, lse, unroll=UNROLL, prefetch=False):
    """What SplitCombine does, step by step in float32 on the host: its CTAs of
    ``rows_per_cta`` rows, each row's ``lanes`` lanes holding lse slots (lane l: splits l,
    l + lanes, ...), the butterfly max and sum over the lanes, the normalised weights in a
    (rows, MAX_SPLITS) table, the partials added UNROLL splits at a time in split order, a split
    of weight 0 never read; each lane writes its ELEMS_PER_LANE columns. Takes the launch's
    arguments (dense or varlen, checked by its checks); returns how many times each element of
    out was written (every one exactly once, by the plan). ``unroll``, ``prefetch``: the
    candidates' plans (Note [Splits in flight], Note [The first splits before the weights]:
    the first pass read whatever the weights, its weight-0 partials zeroed before the add)."""
    from fa4_final.common.combine import THREADS

    op, lp, o, lse4, rows = _combine_layout(out_partial, lse_partial, out, lse)
    n, b, sq, h, dv = op.shape
    lanes = dv // ELEMS_PER_LANE
    rows_per_cta = THREADS // lanes
    per_lane = MAX_SPLITS // lanes
    ctas = -(-rows // rows_per_cta)
    row = torch.arange(ctas * rows_per_cta)  # cta * rows_per_cta + local
    valid = row < rows
    q, hh, bb = row % sq, (row // sq) % h, row // (sq * h)
    qv, hv, bv = (t.clamp(max=m - 1) for t, m in ((q, sq), (hh, h), (bb, b)))
    split = torch.arange(per_lane)[None, :] * lanes + torch.arange(lanes)[:, None]  # (lane, c)
    r_w = torch.full((len(row), lanes, per_lane), -math.inf)
    take = valid[:, None, None] & (split < n)[None]
    lse_rows = lp[split.clamp(max=n - 1)[None], bv[:, None, None], hv[:, None, None],
                  qv[:, None, None]]
    r_w = torch.where(take, lse_rows.float(), r_w)

    def butterfly(x, op):
        for offset in (lanes // 2 ** (i + 1) for i in range(lanes.bit_length() - 1)):
            x = op(x, x[:, torch.arange(lanes) ^ offset])
        return x

    m = butterfly(r_w.amax(dim=2), torch.maximum)  # (rows, lanes), equal over the lanes
    m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)
    r_w = torch.exp2((r_w - m_safe[..., None]) * math.log2(math.e))
    lane_sum = torch.zeros(len(row), lanes)
    for c in range(per_lane):
        lane_sum = lane_sum + r_w[..., c]
    total = butterfly(lane_sum, torch.add)
    assert torch.equal(total, total[:, :1].expand_as(total))  # every lane holds the same sum
    seen = total[:, 0] > 0
    inv = torch.where(seen, 1.0 / torch.where(seen, total[:, 0], torch.ones(len(row))), 0.0)
    s_w = torch.zeros(len(row), MAX_SPLITS)
    s_w[:, split.flatten()] = (r_w * inv[:, None, None]).flatten(1)
    lse_val = torch.where(seen, m[:, 0] + torch.log(total[:, 0]), -math.inf)
    lse4[bv[valid], hv[valid], qv[valid]] = lse_val[valid]
    acc = torch.zeros(len(row), dv)
    for t in range(-(-n // unroll)):
        x = []
        for u in range(unroll):
            s = t * unroll + u
            w = s_w[:, s]
            read = (w > 0) & valid
            assert not read.any() or s < n  # weights past num_splits are 0: never read
            if prefetch and t == 0:  # loaded before the weights were known, then zeroed
                part = op[s, bv, qv, hv] if s < n else torch.zeros(len(row), dv)
                part = torch.where(valid[:, None], part, torch.zeros_like(part))
                x.append((w, torch.where((w > 0)[:, None], part, torch.zeros_like(part))))
                continue
            part = op[min(s, n - 1), bv, qv, hv] if read.any() else torch.zeros(len(row), dv)
            x.append((w, torch.where(read[:, None], part, torch.zeros_like(part))))
        for w, part in x:
            acc = acc + part * w[:, None]
    o[bv[valid], qv[valid], hv[valid]] = acc[valid].to(o.dtype)
    written = torch.zeros(o.shape, dtype=torch.int32)
    for lane in range(lanes):  # each lane's columns, each valid row once
        cols = slice(lane * ELEMS_PER_LANE, (lane + 1) * ELEMS_PER_LANE)
        written[bv[valid], qv[valid], hv[valid], cols] += 1
    return written


@pytest.mark.parametrize("n, b, sq, h, dv, varlen", [
    (1, 2, 1, 8, 128, False), (3, 3, 7, 5, 64, False), (128, 1, 16, 3, 128, False),
    (17, 1, 37, 6, 64, True), (5, 33, 7, 5, 128, False)])
def test_the_kernel_plan_writes_every_element_once(n, b, sq, h, dv, varlen):
    g = torch.Generator().manual_seed(n * 131 + dv)
    rows_shape = (b * sq, h) if varlen else (b, sq, h)
    out = torch.full((*rows_shape, dv), math.nan, dtype=torch.bfloat16)
    lse = torch.full((h, b * sq) if varlen else (b, h, sq), math.nan)
    out_p, lse_p = partials_like(out, n)
    out_p.copy_(torch.randn(out_p.shape, generator=g))
    lse_p.copy_(torch.randn(lse_p.shape, generator=g) * 10)
    lse_p[1::3] = -math.inf  # empty splits, NaN partials: never read
    out_p[1::3] = math.nan
    written = emulate_combine(out_p, lse_p, out, lse)
    assert (written == 1).all()
    dense = (out_p.unsqueeze(1), lse_p.unsqueeze(1)) if varlen else (out_p, lse_p)
    ref_out, ref_lse = combine_reference(dense[0].double(), dense[1].double())
    got_out, got_lse = (out.unsqueeze(0), lse.unsqueeze(0)) if varlen else (out, lse)
    assert not torch.isnan(got_out).any() and not torch.isnan(got_lse).any()
    assert (got_out.double() - ref_out).abs().max() <= 2 ** -8 * ref_out.abs().max() + 1e-6
    assert (got_lse.double() - ref_lse).abs().max() <= 1e-5 * (1 + ref_lse.abs().max())


@pytest.mark.parametrize("unroll, prefetch", [(8, False), (16, False), (4, True), (16, True)])
@pytest.mark.parametrize("n", [1, 3, 16, 37])
def test_the_candidates_plans_give_the_default_bits(n, unroll, prefetch):
    """The candidates' plans, emulated: more splits a pass, or the first pass loaded before
    the weights with NaN in the empty splits' partials, add the same terms in the same order
    as the default, so out and lse are the default's bit for bit."""
    g = torch.Generator().manual_seed(n * 7 + unroll)
    out_p = torch.randn(n, 2, 5, 3, 64, generator=g)
    lse_p = torch.randn(n, 2, 3, 5, generator=g) * 10
    lse_p[1::3] = -math.inf
    out_p[1::3] = math.nan
    runs = []
    for kwargs in ({}, {"unroll": unroll, "prefetch": prefetch}):
        out = torch.full((2, 5, 3, 64), math.nan, dtype=torch.bfloat16)
        lse = torch.full((2, 3, 5), math.nan)
        assert (emulate_combine(out_p, lse_p, out, lse, **kwargs) == 1).all()
        runs.append((out, lse))
    (o0, l0), (o1, l1) = runs
    assert not o0.isnan().any() and not l0.isnan().any()
    assert torch.equal(o0.view(torch.int16), o1.view(torch.int16))
    assert torch.equal(l0.view(torch.int32), l1.view(torch.int32))


def test_the_calls_combine_is_one_pass_up_to_16_splits_with_the_first_loaded_early():
    """Note [Which combine a call runs]: 4 a pass up to 4 splits, 16 beyond, the first pass
    always loaded before the weights; every choice a plan the combine builds, and its
    emulation the plain combine's bits (test_the_candidates_plans_give_the_default_bits)."""
    from fa4_final.common.combine import UNROLLS, combine_choice

    got = {n: combine_choice(n) for n in (1, 2, 4, 5, 8, 16, 17, 128)}
    assert got == {1: (4, True), 2: (4, True), 4: (4, True), 5: (16, True), 8: (16, True),
                   16: (16, True), 17: (16, True), 128: (16, True)}
    assert all(u in UNROLLS and MAX_SPLITS % u == 0 for u, _p in got.values())


def test_the_gpu_checks_run_on_the_emulated_plan(monkeypatch):
    """tests/gpu/test_decode_combine.py's cases and checks, run with the plan's emulation in
    place of the kernel and the CPU in place of the GPU: the harness itself (partials, guards,
    poisoning, the rule) works before a GPU is asked."""
    import tests.gpu.test_decode_combine as gpu

    def emulate(out_partial, lse_partial, out, lse):
        emulate_combine(out_partial, lse_partial, out, lse)
        return out, lse

    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    monkeypatch.setattr(gpu, "combine_splits", emulate)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    for name in gpu.CASES:
        gpu.test_combine_against_float64(name)
    gpu.test_varlen_layout(3, 37, 6, 128, torch.bfloat16)
    gpu.test_varlen_layout(17, 1, 32, 64, torch.float16)
    gpu.test_partials_of_attention_merge_to_attention(64, torch.float16)
    gpu.test_a_nan_never_passes()
    gpu.test_empty_problems_launch_nothing()


def test_split_ranges_cover_the_keys():
    for tiles in (1, 7, 64, 1000):
        for n in (1, 3, 16, 128):
            r = split_ranges(tiles, n)
            assert len(r) == n and r[0][0] == 0 and r[-1][1] == tiles
            assert all(a[1] == b_[0] for a, b_ in zip(r, r[1:]))


# ----------------------------------------------------------------------------------------------
# the compiled kernel


@pytest.fixture(scope="module")
def artifacts():
    from fa4_final.runtime.compile import artifacts as compile_artifacts

    cache = {}

    def get(head_dim, arch, dtype="bf16"):
        key = (head_dim, arch, dtype)
        if key not in cache:
            cache[key] = compile_artifacts(combine_recipe(head_dim, dtype, arch))["main"]
        return cache[key]

    return get


@slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_combine_compiles_with_16_byte_loads(artifacts, head_dim, arch):
    art = artifacts(head_dim, arch)
    # the partials: two 16-byte loads per split and lane, UNROLL splits in flight
    wide = art.count("ld.global.v4.b32") + art.count("ld.global.v2.b64")
    assert wide == 2 * UNROLL, (wide, art.resources())
    assert art.count("LDG.E.128", where="sass") == 2 * UNROLL
    assert art.count("STG.E.128", where="sass") == 1  # out: 8 columns x 2 B per lane
    # the lse: one 4-byte load per split and lane, at most MAX_SPLITS / lanes of them
    lanes = head_dim // ELEMS_PER_LANE
    assert art.count("ld.global.b32") + art.count("ld.global.f32") == MAX_SPLITS // lanes
    art.require("ex2.approx", "lg2.approx", "shfl.sync.bfly", "bar.sync")
    # no local memory; a fixed order, no atomics
    assert not re.search(r"\.local\b|^\s*(@%p\d+\s+)?(atom|red)\.", art.ptx, re.M)
    assert art.frame_bytes == 0 and art.spills == 0, art.resources()


@slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_combine_waits_for_the_split_grid_before_its_first_partial_read(artifacts, arch):
    """Note [The combine launches early]: the candidate launched as a programmatic dependent
    has every thread wait for the previous grid (griddepcontrol.wait) before any global load;
    the default (an ordinary launch) has no such instruction."""
    from fa4_final.runtime.compile import artifacts as compile_artifacts

    early = compile_artifacts(combine_recipe(128, "bf16", arch, pdl=True))["main"]
    body = early.ptx[early.ptx.index(".entry"):]
    assert body.count("griddepcontrol.wait;") == 1, early.resources()
    assert body.index("griddepcontrol.wait;") < body.index("ld.global")
    assert "griddepcontrol" not in artifacts(128, arch).ptx


@slow
@pytest.mark.parametrize("unroll", [8, 16])
def test_more_splits_in_flight_compile_clean(unroll):
    """Note [Splits in flight]: the candidates with 8 and 16 splits a pass issue two 16-byte
    loads per split and lane together, with no spill and no local memory."""
    from fa4_final.runtime.compile import artifacts as compile_artifacts

    art = compile_artifacts(combine_recipe(128, "bf16", "sm_90a", unroll=unroll))["main"]
    assert art.count("LDG.E.128", where="sass") == 2 * unroll, art.resources()
    assert art.frame_bytes == 0 and art.spills == 0, art.resources()
    assert not re.search(r"\.local\b", art.ptx)


@slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("unroll", [4, 16])
def test_the_first_splits_load_before_the_weights(arch, unroll):
    """Note [The first splits before the weights]: the candidate's first pass of partials
    (two 16-byte loads per split and lane) is issued before any lse load, so the two round
    trips overlap; the later passes load after the barrier as the default does. No spill."""
    from fa4_final.runtime.compile import artifacts as compile_artifacts

    art = compile_artifacts(combine_recipe(128, "bf16", arch, unroll=unroll,
                                           prefetch=True))["main"]
    loads = "".join("W" if "LDG.E.128" in line else "L" if "LDG" in line else "B"
                    for line in art.sass.splitlines()
                    if "LDG" in line or "BAR.SYNC" in line)
    lse = MAX_SPLITS // (128 // ELEMS_PER_LANE)
    assert loads == "W" * 2 * unroll + "L" * lse + "B" + "W" * 2 * unroll, loads
    assert art.frame_bytes == 0 and art.spills == 0, art.resources()
    assert not re.search(r"\.local\b", art.ptx)


def test_the_combine_refuses_an_unroll_it_does_not_build():
    with pytest.raises(UnsupportedError, match="splits at a time"):
        combine_recipe(128, "bf16", "sm_90a", unroll=5)


@slow
def test_combine_compiles_for_fp16(artifacts):
    art = artifacts(128, "sm_90a", "fp16")
    art.require("cvt.rn.f16x2.f32")
    assert art.count("STG.E.128", where="sass") == 1 and art.spills == 0


def test_recipe_refuses_what_it_does_not_build():
    with pytest.raises(UnsupportedError, match="sm_80"):
        combine_recipe(128, "bf16", "sm_80")
    with pytest.raises(ValueError, match="'fp32'"):
        combine_recipe(128, "fp32", "sm_90a")
    with pytest.raises(UnsupportedError, match="96"):
        combine_recipe(96, "bf16", "sm_90a")


# ----------------------------------------------------------------------------------------------
# the launch's checks


def _dense(n=3, b=2, sq=5, h=4, dv=128, dtype=torch.bfloat16):
    out = torch.empty(b, sq, h, dv, dtype=dtype)
    lse = torch.empty(b, h, sq)
    return (*partials_like(out, n), out, lse)


def _varlen(n=3, total_q=9, h=4, dv=64):
    out = torch.empty(total_q, h, dv, dtype=torch.float16)
    lse = torch.empty(h, total_q)
    return (*partials_like(out, n), out, lse)


def test_layouts_accepted():
    op, lp, out, lse, rows = _combine_layout(*_dense())
    assert op.shape == (3, 2, 5, 4, 128) and lp.shape == (3, 2, 4, 5) and rows == 40
    op, lp, out, lse, rows = _combine_layout(*_varlen())
    assert op.shape == (3, 1, 9, 4, 64) and lp.shape == (3, 1, 4, 9) and out.shape == (1, 9, 4, 64)
    assert lse.shape == (1, 4, 9) and rows == 36


@pytest.mark.parametrize("change, error, says", [
    (lambda t: (t[0].to(torch.bfloat16), *t[1:]), TypeError, "out_partial must be float32"),
    (lambda t: (t[0], t[1].double(), *t[2:]), TypeError, "lse_partial must be float32"),
    (lambda t: (*t[:2], t[2].float(), t[3]), TypeError, "out has dtype torch.float32"),
    (lambda t: (*t[:3], t[3][:, :, :4]), ValueError, r"lse must have shape \(2, 4, 5\)"),
    (lambda t: (t[0][:, :1], *t[1:]), ValueError, r"out_partial must have shape \(3, 2, 5"),
    (lambda t: (t[0], t[1][:2], *t[2:]), ValueError, "out_partial has 3 splits but lse_partial 2"),
    (lambda t: (t[0][:0], t[1][:0], *t[2:]), ValueError, r"must be in \[1, 128\], got 0"),
    (lambda t: (t[0][..., :96], t[1], t[2][..., :96], t[3]), UnsupportedError, "dv = 96"),
    (lambda t: (t[0], t[1], t[2].transpose(1, 2).contiguous().transpose(1, 2)[..., :128],
                t[3]), None, None),
    (lambda t: (torch.empty(3, 2, 5, 4, 130)[..., :128], *t[1:]), ValueError,
     "out_partial is read and written 16 bytes at a time"),
    (lambda t: (*t[:3], t[3].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "lse must have a unit last stride"),
    (lambda t: (*t[:3], "lse"), TypeError, "lse must be a torch.Tensor"),
], ids=["out_partial-dtype", "lse_partial-dtype", "out-dtype", "lse-shape", "out_partial-shape",
        "split-counts", "no-split", "dv", "out-strided-ok", "out_partial-strided",
        "lse-stride", "lse-type"])
def test_bad_tensors_named(change, error, says):
    args = change(_dense())
    if error is None:
        _combine_layout(*args)
        return
    with pytest.raises(error, match=says):
        _combine_layout(*args)


def test_more_than_max_splits_refused():
    with pytest.raises(ValueError, match=r"\[1, 128\], got 129"):
        _combine_layout(*_dense(n=129, b=1, sq=1, h=1))


def test_launch_glue_with_a_recording_kernel(monkeypatch):
    """combine_splits on CPU tensors with the compile path replaced: the recipe it asks for
    (head dim, dtype, target, and the combine_choice of its split count: Note [Which combine
    a call runs]), the dense layout it hands the kernel (varlen as a batch of one, the same
    storage), and no launch for an empty problem."""
    from fa4_final.runtime import compile as compile_path
    from fa4_final.runtime.compile import Plan
    from fa4_final.runtime.decode import combine_splits

    calls = []

    def compiled(recipe_fn, *args):
        calls.append(("recipe", recipe_fn.__name__, args))
        return Plan({"main": lambda *t: calls.append(("launch", t))}, None)

    monkeypatch.setattr(compile_path, "compiled", compiled)
    op, lp, out, lse = _dense(n=4, dv=64, dtype=torch.float16)
    assert combine_splits(op, lp, out, lse, target="sm_90a") == (out, lse)
    assert calls[0] == ("recipe", "combine_recipe", (64, "fp16", "sm_90a", False, 4, True))
    assert [t.shape for t in calls[1][1]] == [op.shape, lp.shape, out.shape, lse.shape]
    calls.clear()
    op, lp, out, lse = _varlen(n=2, total_q=9, h=4, dv=64)
    combine_splits(op, lp, out, lse, target="sm_100a")
    assert calls[0][2] == (64, "fp16", "sm_100a", False, 4, True)
    got = calls[1][1]
    assert [tuple(t.shape) for t in got] == [(2, 1, 9, 4, 64), (2, 1, 4, 9), (1, 9, 4, 64),
                                             (1, 4, 9)]
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(got, (op, lp, out, lse)))
    calls.clear()
    op, lp, out, lse = _dense(n=5, dv=128, dtype=torch.bfloat16)
    combine_splits(op, lp, out, lse, target="sm_90a")  # more than 4 splits: 16 a pass
    assert calls[0][2] == (128, "bf16", "sm_90a", False, 16, True)
    calls.clear()
    op, lp, out, lse = _dense(n=2, b=0)
    combine_splits(op, lp, out, lse, target="sm_90a")
    assert calls == []


def test_the_decode_path_combines_its_own_partials_without_the_checks(monkeypatch):
    """runtime.decode.combine_own_partials (the decode path's): the recipe and the launch of
    combine_splits, the varlen layout made dense the same way, and for an ``out`` that is not
    contiguous from an aligned address, combine_splits itself with its checks."""
    from fa4_final.runtime import compile as compile_path
    from fa4_final.runtime import decode

    launched, checked = [], []

    class Plan:
        kernels = {"main": lambda *a: launched.append(tuple(t.shape for t in a))}

    monkeypatch.setattr(compile_path, "compiled", lambda fn, *args: Plan())
    monkeypatch.setattr(decode, "combine_splits", lambda *a: checked.append(a))
    out = torch.empty(2, 3, 4, 128, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 3)
    op, lp = decode.partials_like(out, 5)
    decode.combine_own_partials(op, lp, out, lse, "sm_90a")
    assert launched == [((5, 2, 3, 4, 128), (5, 2, 4, 3), (2, 3, 4, 128), (2, 4, 3))]
    vout, vlse = torch.empty(7, 4, 64, dtype=torch.bfloat16), torch.empty(4, 7)
    op, lp = decode.partials_like(vout, 3)
    decode.combine_own_partials(op, lp, vout, vlse, "sm_90a")
    assert launched[-1] == ((3, 1, 7, 4, 64), (3, 1, 4, 7), (1, 7, 4, 64), (1, 4, 7))
    strided = torch.empty(2, 3, 8, 128, dtype=torch.bfloat16)[:, :, ::2]
    decode.combine_own_partials(*decode.partials_like(strided, 2), strided, lse, "sm_90a")
    assert len(checked) == 1 and len(launched) == 2
