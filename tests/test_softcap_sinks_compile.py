"""FA4's softcap and learnable sink in fa4_final's Hopper forward, checked with no GPU.

Compiled for sm_90a from fake tensors (slow): the softcap, sink and softcap + sink builds at
D = 64 and 128, causal and not, and one varlen build; the tanh (tanh.approx.f32 / MUFU.TANH)
appears only in softcap builds, one per score per step body; the sink adds its exponential
(one MUFU.EX2 per row a thread finalises) and one global load only to sink builds; no spills,
no wgmma serialised by ptxas, the kernel's register count that of the default build.

On the CPU (fast): the kernel's softmax step with both features (Note [Softcap], Note
[Learnable sink] in fa4_final.common.softmax) replayed in float64 tile by tile in the kernel's
key order, the tanh on the pre-multiplied score, the running max and sum in capped units,
the sink folded once at the end (an empty row: lse = sink, out = 0), against
utils.reference.attention_reference_features; planted mistakes (the sink scaled, the cap after
the mask, the sink folded into every tile) are caught by the same comparison.
Nothing here runs on a GPU: tests/gpu/test_softcap_sinks.py does.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from utils.reference import attention_reference_features, causal_mask, random_qkv

LOG2_E = math.log2(math.e)

# ----------------------------------------------------------------------------------------------
# the kernel's step, replayed in float64


def emulate_forward(q, k, v, causal, scale, softcap=0.0, sink=None, tile_n=128, mutant=None):
    """out, lse of one head per (batch, head) computed as the Hopper forward's consumer does,
    in float64: key tiles from the last down, t = tanh(q.k * scale / softcap) (or the raw q.k)
    before the mask, the online softmax with scale_log2 = softcap log2 e (or scale log2 e), the
    sink folded once in finalize. ``mutant`` plants one mistake."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.empty(b, h, sq, dtype=torch.float64)
    visible = causal_mask(sq, sk) if causal else torch.ones(sq, sk, dtype=torch.bool)
    if softcap:
        cap_scale, scale_log2 = scale / softcap, softcap * LOG2_E
    else:
        cap_scale, scale_log2 = None, scale * LOG2_E
    n_tiles = -(-sk // tile_n)
    for bi in range(b):
        for hi in range(h):
            qh = q[bi, :, hi].double()
            kh, vh = k[bi, :, hi // (h // hk)].double(), v[bi, :, hi // (h // hk)].double()
            m = torch.full((sq,), -math.inf, dtype=torch.float64)
            l_sum = torch.zeros(sq, dtype=torch.float64)
            o = torch.zeros(sq, d, dtype=torch.float64)
            for n in reversed(range(n_tiles)):
                cols = slice(n * tile_n, min((n + 1) * tile_n, sk))
                s = qh @ kh[cols].T
                if cap_scale is not None and mutant != "cap_after_mask":
                    s = torch.tanh(s * cap_scale)
                s = s.masked_fill(~visible[:, cols], -math.inf)
                if cap_scale is not None and mutant == "cap_after_mask":
                    s = torch.tanh(s * cap_scale)
                m_new = torch.maximum(m, s.amax(dim=1))
                m_safe = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
                p = torch.exp2(s * scale_log2 - (m_safe * scale_log2)[:, None])
                alpha = torch.exp2(m * scale_log2 - m_safe * scale_log2)
                l_sum = alpha * l_sum + p.sum(dim=1)
                o = alpha[:, None] * o + p @ vh[cols]
                m = m_new
                if sink is not None and mutant == "sink_every_tile":
                    l_sum = l_sum + torch.exp2(float(sink[hi]) * LOG2_E - m_safe * scale_log2)
            max_scaled = m * scale_log2
            total = l_sum
            if sink is not None and mutant != "sink_every_tile":
                s_h = float(sink[hi]) * (scale if mutant == "sink_scaled" else 1.0)
                max_scaled = torch.where(m == -math.inf, torch.full_like(m, s_h * LOG2_E),
                                         max_scaled)
                total = total + torch.exp2(s_h * LOG2_E - max_scaled)
            seen = total > 0
            safe = torch.where(seen, total, torch.ones_like(total))
            out[bi, :, hi] = o * torch.where(seen, 1.0 / safe, torch.zeros_like(safe))[:, None]
            lse[bi, hi] = torch.where(seen, (max_scaled + torch.log2(safe)) * math.log(2.0),
                                      torch.full_like(safe, -math.inf))
    return out, lse


# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal): tails of a tile, GQA, rows that
# see no key (seqlen_q > seqlen_k, causal), one key
SHAPES = [
    (1, 37, 300, 2, 1, 16, True),
    (2, 300, 130, 4, 2, 8, True),  # 170 rows see no key
    (1, 65, 1, 2, 2, 8, False),
    (1, 129, 257, 3, 1, 8, False),
]


def _inputs(shape, seed, spread=3.0):
    b, sq, sk, h, hk, d, causal = shape
    q, k, v, _ = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=torch.float64,
                            seed=seed, scale=spread)
    sink = torch.linspace(-2.0, 4.0, h, dtype=torch.float64)
    return q, k, v, causal, sink


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("softcap, with_sink", [(0.0, True), (5.0, False), (5.0, True),
                                                (30.0, True)])
def test_emulated_step_matches_the_float64_reference(shape, softcap, with_sink):
    q, k, v, causal, sink = _inputs(shape, seed=7)
    sink = sink if with_sink else None
    scale = q.shape[-1] ** -0.5
    out, lse = emulate_forward(q, k, v, causal, scale, softcap, sink, tile_n=64)
    ref_out, ref_lse = attention_reference_features(q, k, v, causal, scale, softcap, sink)
    assert torch.allclose(out, ref_out, atol=1e-12, rtol=0)
    both_inf = torch.isneginf(lse) & torch.isneginf(ref_lse)
    assert torch.allclose(lse[~both_inf], ref_lse[~both_inf], atol=1e-12, rtol=0)
    if with_sink:  # no row is empty of probability mass: lse finite, empty rows lse = sink
        assert bool(torch.isfinite(lse).all())


def test_rows_without_keys_get_the_sink_as_lse_and_zero_out():
    q, k, v, causal, sink = _inputs((2, 300, 130, 4, 2, 8, True), seed=3)
    out, lse = emulate_forward(q, k, v, causal, 8 ** -0.5, 5.0, sink, tile_n=64)
    empty = ~causal_mask(300, 130).any(dim=1)  # rows 0 .. 169
    assert int(empty.sum()) == 170
    assert bool((out[:, empty] == 0).all())
    assert torch.equal(lse[:, :, empty], sink.view(1, 4, 1).expand(2, 4, 170))


@pytest.mark.parametrize("mutant", ["sink_scaled", "cap_after_mask", "sink_every_tile"])
def test_planted_mistakes_are_caught(mutant):
    q, k, v, causal, sink = _inputs((2, 300, 130, 4, 2, 8, True), seed=11)  # empty rows too
    scale = 8 ** -0.5
    out, lse = emulate_forward(q, k, v, causal, scale, 5.0, sink, tile_n=64, mutant=mutant)
    ref_out, ref_lse = attention_reference_features(q, k, v, causal, scale, 5.0, sink)
    err = max(float((out - ref_out).abs().max()), float((lse - ref_lse).abs().max()))
    assert not err < 1e-3, f"{mutant} not caught (error {err:.2e})"


def test_fold_sink_matches_its_emulation_row_by_row():
    """fa4_final.common.softmax.fold_sink's arithmetic (read off its source): the special cases
    of a row max of -inf and a sink of -inf (FA4's padded heads: out = 0, lse = -inf)."""
    def fold(total, row_max, scale_log2, sink):
        max_scaled = sink * LOG2_E if row_max == -math.inf else row_max * scale_log2
        return total + 2.0 ** (sink * LOG2_E - max_scaled), max_scaled  # 2 ** NaN = NaN

    total, ms = fold(0.0, -math.inf, 1.0, 2.5)
    assert total == 1.0 and ms * math.log(2.0) == pytest.approx(2.5)  # lse = sink, out = 0
    total, _ = fold(0.0, -math.inf, 1.0, -math.inf)
    assert not total > 0  # NaN: finalize's "seen" is false, so lse = -inf and out = 0
    total, _ = fold(3.0, 1.0, 1.0, -math.inf)
    assert total == 3.0


# ----------------------------------------------------------------------------------------------
# compiled for sm_90a


_ARTS: dict = {}


def _build(head_dim, causal, softcap=0.0, sink=None, varlen=False):
    key = (head_dim, causal, softcap, sink, varlen)
    if key not in _ARTS:
        from fa4_final.hopper.host import forward_recipe
        from fa4_final.runtime.compile import artifacts

        _ARTS[key] = artifacts(forward_recipe(head_dim, "bf16", causal, varlen=varlen,
                                              softcap=softcap, sink_dtype=sink))["main"]
    return _ARTS[key]


def _scores_per_thread(head_dim, causal):
    from fa4_final.hopper.config import hopper_fwd_default

    return hopper_fwd_default(head_dim, causal).tile_n // 2  # a wgmma warpgroup: 64 x n / 128


def _wgmma_serialised(art) -> int:
    return art.count("WARPGROUP.ARRIVE", where="sass") - art.count("wgmma.fence.sync.aligned")


BUILDS = [(d, causal, softcap, sink)
          for d in (64, 128) for causal in (False, True)
          for softcap, sink in ((30.0, "fp32"), (50.0, None), (0.0, "bf16"))
          if (softcap and sink) or (d, causal) in ((128, True), (64, False))]


@pytest.mark.slow
@pytest.mark.parametrize("head_dim, causal, softcap, sink", BUILDS, ids=str)
def test_feature_builds_compile_clean(head_dim, causal, softcap, sink):
    art, plain = _build(head_dim, causal, softcap, sink), _build(head_dim, causal)
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    assert _wgmma_serialised(art) == 0
    assert art.registers == plain.registers, (art.resources(), plain.resources())
    from fa4_final.hopper.config import hopper_fwd_default

    _, consumer = hopper_fwd_default(head_dim, causal).registers
    assert re.search(rf"setmaxnreg.inc.sync.aligned.u32\s+{consumer};", art.ptx)

    tanh_ptx, tanh_sass = art.count("tanh.approx.f32"), art.count("MUFU.TANH", "sass")
    if softcap:
        per_body = _scores_per_thread(head_dim, causal)
        # one tanh per score in each step body (first, masked, unmasked, ...), nothing else
        assert tanh_ptx > 0 and tanh_ptx % per_body == 0, (tanh_ptx, per_body)
        assert tanh_sass == tanh_ptx
    else:
        assert tanh_ptx == 0 and tanh_sass == 0
    extra_ex2 = art.count("MUFU.EX2", "sass") - plain.count("MUFU.EX2", "sass")
    extra_ld = art.count("ld.global") - plain.count("ld.global")
    if sink:
        assert extra_ex2 in (2, 4), extra_ex2  # two rows per thread, in one or two epilogues
        assert extra_ld == 1, extra_ld  # the head's sink logit, once per tile
    else:
        assert extra_ex2 == 0 and extra_ld == 0, (extra_ex2, extra_ld)


@pytest.mark.slow
def test_the_default_build_has_no_tanh():
    for d, causal in ((64, False), (128, True)):
        plain = _build(d, causal)
        assert plain.count("tanh.approx") == 0 and plain.count("MUFU.TANH", "sass") == 0


@pytest.mark.slow
def test_varlen_feature_build_compiles_clean():
    art = _build(128, True, 30.0, "fp32", varlen=True)
    plain = _build(128, True, varlen=True)
    assert art.spills == 0 and _wgmma_serialised(art) == 0, art.resources()
    assert art.registers == plain.registers
    assert art.count("tanh.approx.f32") % _scores_per_thread(128, True) == 0
    assert art.count("MUFU.EX2", "sass") - plain.count("MUFU.EX2", "sass") in (2, 4)


def test_recipe_refuses_bad_feature_flags():
    from fa4_final.hopper.host import forward_recipe

    with pytest.raises(ValueError, match="sink_dtype must be one of"):
        forward_recipe(128, "bf16", False, sink_dtype="fp64")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softcap must be 0.0"):
            forward_recipe(128, "bf16", False, softcap=bad)
    with pytest.raises(TypeError, match="softcap must be a float"):
        forward_recipe(128, "bf16", False, softcap="30")


def test_cache_keys_tell_the_builds_apart():
    from fa4_final.hopper.host import forward_recipe

    keys = {forward_recipe(128, "bf16", True, softcap=c, sink_dtype=s).kernels["main"]
            .cache_key() for c in (0.0, 30.0, 50.0) for s in (None, "fp32", "bf16")}
    assert len(keys) == 9
    plain = forward_recipe(128, "bf16", True).kernels["main"].cache_key()
    assert not any("softcap" in str(part) or "sink" in str(part) for part in plain)


# ----------------------------------------------------------------------------------------------
# the backward's softcap build (Note [Softcap in the backward]); a sink changes no kernel


def _build_bwd(head_dim, causal, softcap=0.0, varlen=False):
    key = ("bwd", head_dim, causal, softcap, varlen)
    if key not in _ARTS:
        from fa4_final.hopper.host import backward_recipe
        from fa4_final.runtime.compile import artifacts

        _ARTS[key] = artifacts(backward_recipe(head_dim, "bf16", causal, varlen=varlen,
                                               softcap=softcap))["main"]
    return _ARTS[key]


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_softcap_builds_compile_clean(head_dim, causal):
    from fa4_final.hopper.config import hopper_bwd_default, hopper_bwd_softcap

    art, plain = _build_bwd(head_dim, causal, 30.0), _build_bwd(head_dim, causal)
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    assert _wgmma_serialised(art) == 0
    assert art.registers == plain.registers
    cfg = hopper_bwd_softcap(hopper_bwd_default(head_dim, causal), head_dim, causal)
    # S^T per thread: (tile_n / 2 keys per warpgroup) x tile_m queries over 128 threads
    per_body = cfg.tile_n // 2 * cfg.tile_m // 128
    tanh = art.count("MUFU.TANH", "sass")
    assert tanh > 0 and tanh % per_body == 0 and tanh == art.count("tanh.approx.f32")
    assert plain.count("MUFU.TANH", "sass") == 0
    # one exponential per score and step body, as without the cap; the clamp of t^2 per score
    assert art.count("MUFU.EX2", "sass") == tanh
    assert art.count("min.f32") >= tanh


def test_the_softcap_backward_config():
    from fa4_final.hopper.config import hopper_bwd_default, hopper_bwd_softcap
    from fa4_final.hopper.host import backward_recipe

    assert backward_recipe(64, "bf16", True, softcap=30.0).config.tile_m == 64
    assert backward_recipe(64, "bf16", True).config == hopper_bwd_default(64, True)
    for d, causal in ((64, False), (128, False), (128, True)):
        cfg = hopper_bwd_default(d, causal)
        assert hopper_bwd_softcap(cfg, d, causal) == cfg


@pytest.mark.slow
def test_varlen_backward_softcap_build_compiles_clean():
    art = _build_bwd(128, True, 30.0, varlen=True)
    assert art.spills == 0 and _wgmma_serialised(art) == 0, art.resources()
    assert art.count("MUFU.TANH", "sass") > 0
