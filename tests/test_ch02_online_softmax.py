"""Chapter 02: online softmax, both loop orders, tile skipping, the max trace, the checkers."""
# ruff: noqa: E741  (m and l are the running max and sum in every FlashAttention paper)

import math

import pytest
import torch

from solutions import ch02_online_softmax as ch02
from utils.checks import check_attention
from utils.reference import attention_reference, causal_mask, random_qkv

NEG_INF = float("-inf")
# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, tile_m, tile_n): lengths not multiples of
# the tiles, sq != sk both ways, GQA and MQA, tiles larger than the sequence
CASES = [(2, 75, 110, 4, 2, 32, 32, 48), (1, 110, 75, 2, 2, 16, 32, 32),
         (1, 1, 200, 3, 1, 64, 16, 64), (1, 50, 50, 2, 2, 8, 128, 128),
         (1, 129, 63, 2, 1, 16, 64, 16)]
LOOPS = {"fa1": ch02.attention_fa1, "fa2": ch02.attention_fa2}


def test_safe_softmax():
    x = torch.randn(4, 37, dtype=torch.float64) * 50 + 1000  # exp(1000) overflows
    assert torch.allclose(ch02.safe_softmax(x), torch.softmax(x, -1), atol=1e-15)
    x[0] = NEG_INF
    y = ch02.safe_softmax(x)
    assert (y[0] == 0).all() and not torch.isnan(y).any()


@pytest.mark.parametrize("tile", [1, 7, 37, 64])
def test_online_softmax_equals_safe_softmax(tile):
    x = torch.randn(3, 5, 37, dtype=torch.float64) * 20
    x[0, 0] = NEG_INF
    x[1, 2, :30] = NEG_INF  # the first tiles of this row are empty
    m, l = ch02.online_softmax_stats(x, tile)
    assert torch.equal(m, x.amax(-1))
    assert torch.allclose(ch02.online_softmax(x, tile), ch02.safe_softmax(x), atol=1e-15)
    with pytest.raises(ValueError, match="tile"):
        ch02.online_softmax_stats(x, 0)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_loops_match_float64_reference(loop, case, causal):
    b, sq, sk, h, hk, d, tm, tn = case
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=torch.float64,
                               scale=2.0)
    out, lse = LOOPS[loop](q, k, v, causal=causal, tile_m=tm, tile_n=tn)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), seed
    assert torch.allclose(out, ref_out, atol=1e-12), seed
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), seed
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[fin], ref_lse[fin], atol=1e-5), seed


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loops_pass_the_tolerance_rule(loop, dtype):
    q, k, v, _ = random_qkv(1, 75, 4, 32, seqlen_k=110, heads_kv=2, dtype=dtype)

    def fn(q, k, v, causal=False, softmax_scale=None):
        return LOOPS[loop](q, k, v, causal, softmax_scale, tile_m=32, tile_n=32)

    check_attention(fn, q, k, v, causal=True)
    check_attention(fn, q, k, v, causal=False, softmax_scale=0.2)


def test_course_signature_and_bad_input():
    q, k, v, _ = random_qkv(1, 20, 2, 16, dtype=torch.float32)
    out, lse = ch02.attention(q, k, v, causal=True)
    assert out.shape == q.shape and lse.shape == (1, 2, 20) and lse.dtype == torch.float32
    with pytest.raises(ValueError, match="tile_m"):
        ch02.attention_fa2(q, k, v, tile_m=0)
    with pytest.raises(ValueError, match="tile_n"):
        ch02.attention_fa1(q, k, v, tile_n=16.0)
    with pytest.raises(ValueError, match="head dim"):
        ch02.attention(q, k[..., :8], v[..., :8])


def _brute_force_counts(sq, sk, tm, tn):
    """Computed / skipped / partially masked tiles, read off the mask itself."""
    mask = causal_mask(sq, sk)
    counts = ch02.TileCounts()
    for q0 in range(0, sq, tm):
        for k0 in range(0, sk, tn):
            block = mask[q0:q0 + tm, k0:k0 + tn]
            if not block.any():
                counts.skipped += 1
            else:
                counts.computed += 1
                counts.masked += int(not block.all())
    return counts


@pytest.mark.parametrize("sq, sk, tm, tn", [(128, 128, 32, 32), (100, 300, 64, 32),
                                            (300, 100, 32, 64), (77, 77, 16, 48),
                                            (1, 50, 16, 16), (64, 1, 16, 16)])
def test_tile_counts(sq, sk, tm, tn):
    want = _brute_force_counts(sq, sk, tm, tn)
    arithmetic = ch02.count_tiles(sq, sk, tm, tn, causal=True)
    assert (arithmetic.computed, arithmetic.skipped, arithmetic.masked) == (
        want.computed, want.skipped, want.masked)
    q, k, v, _ = random_qkv(1, sq, 1, 8, seqlen_k=sk, dtype=torch.float32)
    for loop in LOOPS.values():
        counts = ch02.TileCounts()
        loop(q, k, v, causal=True, tile_m=tm, tile_n=tn, counts=counts)
        assert (counts.computed, counts.skipped, counts.masked) == (
            want.computed, want.skipped, want.masked)
    full = ch02.count_tiles(sq, sk, tm, tn, causal=False)
    assert full.skipped == 0 and full.total == want.total


def test_square_causal_skips_almost_half():
    counts = ch02.count_tiles(4096, 4096, 128, 128, causal=True)
    assert counts.total == 32 * 32 and counts.skipped == 32 * 31 // 2
    assert counts.masked == 32  # only the diagonal tiles need the mask


def test_fa1_moves_the_state_fa2_does_not():
    q, k, v, _ = random_qkv(1, 256, 1, 32, dtype=torch.bfloat16)
    c1, c2 = ch02.TileCounts(), ch02.TileCounts()
    ch02.attention_fa1(q, k, v, tile_m=64, tile_n=64, counts=c1)
    ch02.attention_fa2(q, k, v, tile_m=64, tile_n=64, counts=c2)
    assert c1.state_read_bytes == 16 * 64 * (32 * 4 + 8)  # every (Q tile, KV tile) pair
    assert c2.state_read_bytes == 0
    assert c2.state_write_bytes == 256 * (32 * 2 + 4)  # O (bf16) and LSE, once
    # FA1 loads a Q tile per (Q tile, KV tile) pair and K, V once; FA2 the other way round.
    assert c1.qkv_bytes == 16 * 64 * 32 * 2 + 2 * 256 * 32 * 2
    assert c2.qkv_bytes == 16 * 2 * 64 * 32 * 2 + 256 * 32 * 2


def test_trace_running_max():
    q, k, _, _ = random_qkv(2, 200, 3, 32, seqlen_k=300, dtype=torch.float32)
    scale = 32**-0.5 * ch02.LOG2E
    for causal in (False, True):
        tr = ch02.trace_running_max(q, k, causal=causal, tile_n=64)
        assert tr.m.shape == (2, 3, 200, 5)
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
        if causal:
            s = s.masked_fill(~causal_mask(200, 300), NEG_INF)
        assert torch.allclose(tr.m[..., -1].double(), s.amax(-1), atol=1e-4)
        c = tr.counted
        assert torch.allclose(tr.alpha[c], torch.exp2(-tr.growth[c]))
        assert torch.isnan(tr.growth[~c]).all() and (tr.growth[c] >= 0).all()
    # causal: query 0 sees keys 0..100 (tiles 0, 1), so its later tiles are not counted
    assert tr.counted[0, 0, 0].tolist() == [False, True, False, False, False]


def test_growth_fractions_on_a_known_ramp():
    """Scores that rise along the keys: the max grows at every tile, by a known step."""
    d, tile = 4, 16
    k = torch.arange(160, dtype=torch.float64)[None, :, None, None].expand(1, 160, 1, d) / d
    q = torch.ones(1, 3, 1, d, dtype=torch.float64)
    # score of key j, log2 domain: j * c with c = softmax_scale * log2(e)
    for step, over in ((10.0, 1.0), (4.0, 0.0)):
        c = step / tile
        tr = ch02.trace_running_max(q, k, softmax_scale=c / ch02.LOG2E, tile_n=tile)
        g = ch02.max_growth_fractions(tr, tau=8.0)
        assert g.steps == 3 * 9 and g.fraction == 1.0 and g.fraction_over_tau == over
        assert torch.allclose(tr.growth[tr.counted], torch.full((27,), step, dtype=torch.float64))
    with pytest.raises(ValueError, match="tau"):
        ch02.max_growth_fractions(tr, tau=-1)


def test_random_scores_grow_like_one_over_t():
    """For exchangeable scores the max of t tiles lies in the last one with probability 1/t."""
    q, k, _, _ = random_qkv(2, 512, 4, 32, seqlen_k=1024, dtype=torch.float32)
    per_tile = ch02.growth_by_tile(ch02.trace_running_max(q, k, tile_n=64))
    assert math.isnan(per_tile[0])
    for t in (2, 4, 8, 16):
        assert abs(per_tile[t - 1] - 1 / t) < 0.05, (t, per_tile[t - 1])


# ---------------------------------------------------------------------------------------------
# Checkers accept the solutions (the planted mistakes: tests/exercise_mutations/ch02.py)


def test_checkers_accept_the_solutions():
    ch02.check_tile_update(ch02.tile_update)
    ch02.check_lse(ch02.lse_from_state)
    ch02.check_kv_tiles_to_visit(ch02.kv_tiles_to_visit)


def test_kv_tiles_forbid_names_the_other_implementations_once_imported():
    from solutions import ch04_flash_ampere as fa

    table = ch02.kv_tiles_forbid()
    assert ch02.count_tiles in table and fa.kv_tile_range in table


# -- launches of the PyTorch loop ---------------------------------------------------------------


def test_launch_model_counts_what_the_loop_dispatches():
    """The per-step model, fitted on tiny inputs, predicts the operator count of other shapes:
    lengths not a multiple of the tile, more heads and batches, another dtype."""
    lc = ch02.launch_count()
    assert 10 <= lc.per_step <= 40, lc
    for b, sq, sk, h, tile_m, tile_n in ((2, 75, 110, 4, 32, 48), (1, 300, 257, 8, 64, 64)):
        q, k, v, _ = random_qkv(b, sq, h, 16, seqlen_k=sk, dtype=torch.bfloat16)
        ops = ch02.count_kernel_ops(ch02.attention_fa2, q, k, v, tile_m=tile_m, tile_n=tile_n)
        assert sum(ops.values()) == lc.total(sq, sk, tile_m, tile_n), ops
    ops = ch02.count_kernel_ops(ch02.attention_fa2, *random_qkv(1, 8, 2, 8)[:3], tile_m=8,
                                tile_n=8)
    assert "aten.bmm.default" in ops and not any("view" in op or "slice" in op for op in ops)


def test_deferred_normalisation_divides_once_per_row():
    work = ch02.normalisation_work(4096, 4096, 128, tile_n=128)
    assert work == {"fa1": 32 * 4096 * 128, "fa2": 4096 * 128}


def test_work_partition_picture():
    import matplotlib

    matplotlib.use("Agg")
    ax_k, ax_q = ch02.plot_work_partition(warps=4)
    assert len(ax_k.patches) == len(ax_q.patches) == 4
    assert "keys" in ax_k.get_title() and "query rows" in ax_q.get_title()


def test_launch_lines_compare_with_a_cost_measured_alone():
    from utils import results

    v = results.load("ch01_ch02_fwd", gpu="h200")
    lc = ch02.launch_count()
    said = "\n".join(ch02.launch_lines(v, lc))
    assert "not in microbench.json yet" in said and "329,348 launches" in said

    class Micro:
        def where(self, metric):
            return [{"impl": "chapter 02's tile loop, B=1 H=1 S=1024", "value": 8.0, "min": 7.5,
                     "max": 8.5, "rounds": 3}] if metric == "eager_launch_us" else []

    said = "\n".join(ch02.launch_lines(v, lc, Micro()))
    model = lc.total(16384, 16384) * 8.0e-3
    assert f"{model:8.1f} ms" in said and "measured" in said
