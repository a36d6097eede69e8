"""The chapter 04 CPU model (host-side CuTe, no GPU) against the float64 reference, and the
thread-value layout facts the kernel relies on, read from the kernel's own TiledMma."""

import numpy as np
import pytest
import torch

from solutions import ch04_cpu_model as cm
from solutions import ch04_flash_ampere as fa
from utils.reference import attention_reference


def _inputs(rng, b, sq, sk, h, hk, d, scale=1.0):
    """Fresh float32 q, k, v; ``scale`` widens q and k, hence the scores."""
    q = (rng.standard_normal((b, sq, h, d)) * scale).astype(np.float32)
    k = (rng.standard_normal((b, sk, hk, d)) * scale).astype(np.float32)
    v = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    return q, k, v


def _compare(q, k, v, causal, out, lse, atol):
    ref_out, ref_lse = attention_reference(*(torch.from_numpy(a) for a in (q, k, v)),
                                           causal=causal)
    ref_out, ref_lse = ref_out.numpy(), ref_lse.numpy()
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "NaN in the model's output"
    err = np.abs(out - ref_out)
    worst = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= atol, f"max |out - ref| = {err.max():.2e} at (b, s, h, d) = {worst}"
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~seen, "rows that see no key: lse -inf")
    if seen.any():
        lse_err = np.abs(lse[seen] - ref_lse[seen]).max()
        assert lse_err <= 1e-5, f"max |lse - ref| = {lse_err:.2e}"
    empty_rows = ~seen.transpose(0, 2, 1)  # (b, s, h)
    assert (out[empty_rows] == 0).all(), "rows that see no key must be exactly 0"


# Lengths that are no multiple of any tile; GQA; seqlen_q < seqlen_k and > seqlen_k; one query.
CASES = [
    # (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal)
    (2, 37, 70, 2, 1, 64, False),
    (1, 150, 37, 3, 3, 64, True),  # the first 113 query rows see no key
    (1, 1, 131, 2, 2, 64, True),
    (1, 45, 200, 4, 2, 128, True),
    (1, 130, 33, 1, 1, 128, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}-{}".format(
    *c[:6], "causal" if c[6] else "full"))
def test_matches_float64_reference(case):
    b, sq, sk, h, hk, d, causal = case
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, b, sq, sk, h, hk, d)
    out, lse = cm.forward(q, k, v, causal=causal)
    _compare(q, k, v, causal, out, lse, atol=2e-5)


def test_p_rounded_like_the_kernel():
    """With P rounded to bf16 before PV, as the kernel's mma sees it: the error grows to the
    bf16 scale and the LSE (computed from unrounded P) stays exact."""
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 1, 45, 200, 4, 2, 128)
    out, lse = cm.forward(q, k, v, causal=True, p_dtype="bf16")
    _compare(q, k, v, True, out, lse, atol=2e-2)
    exact, _ = cm.forward(q, k, v, causal=True)
    assert np.abs(out - exact).max() > 1e-5, "bf16 rounding of P had no effect"


def test_softmax_scale_and_large_scores():
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, 1, 70, 90, 2, 2, 64, scale=4.0)  # scores up to ~hundreds
    out, lse = cm.forward(q, k, v, causal=False, softmax_scale=0.3)
    ref_out, ref_lse = attention_reference(*(torch.from_numpy(a) for a in (q, k, v)),
                                           softmax_scale=0.3)
    assert np.abs(out - ref_out.numpy()).max() <= 1e-4
    assert np.abs(lse - ref_lse.numpy()).max() <= 1e-4


def test_thread_s_elements_follow_the_mma_layout():
    """m16n8k16 accumulator: lane l holds rows l // 4 (+ 8) of each 16-row block and columns
    2 * (l % 4) (+ 1) of each 8-column block; warps stack along rows (Note [Work split])."""
    config = fa.DEFAULT_CONFIGS[64]  # 128 x 64, 4 warps: each warp owns rows 16w.. and 64+16w..
    for tidx in (0, 5, 37, 127):
        warp, lane = divmod(tidx, 32)
        rows = {16 * warp + lane // 4 + dr + 64 * mb for dr in (0, 8) for mb in (0, 1)}
        cols = {2 * (lane % 4) + dc + 8 * nb for dc in (0, 1) for nb in range(8)}
        got = cm.thread_s_elements(tidx, config, head_dim=64)
        assert len(got) == 128 * 64 // 128
        assert set(got) == {(r, c) for r in rows for c in cols}, f"thread {tidx}"
    with pytest.raises(ValueError, match="tidx"):
        cm.thread_s_elements(128, config, head_dim=64)


@pytest.mark.parametrize("d", [64, 128])
def test_every_s_element_has_one_owner(d):
    config = fa.DEFAULT_CONFIGS[d]
    owner = cm.s_owner_map(config, head_dim=d)
    assert owner.shape == (config.m_block, config.n_block)
    counts = np.bincount(owner.ravel(), minlength=config.num_threads)
    per_thread = config.m_block * config.n_block // config.num_threads
    assert (counts == per_thread).all() and owner.min() >= 0
    # The 4 lanes of a quad share rows: the row reductions only need the quad shuffles.
    for row in range(config.m_block):
        assert len({t // 4 for t in owner[row]}) == 1


@pytest.mark.parametrize("d", [64, 128])
def test_p_is_the_pv_mma_a_operand(d):
    """Note [P as an A operand], on the real layouts of every swept tile."""
    for config in fa.SWEEP_CONFIGS[d]:
        assert cm.p_as_a_operand_mismatches(config, head_dim=d) == 0, config


def test_rejects_bad_input():
    q = np.zeros((1, 4, 2, 64), np.float32)
    with pytest.raises(TypeError, match="NumPy array"):
        cm.forward(torch.zeros(1, 4, 2, 64), q, q)
    with pytest.raises(TypeError, match="float32"):
        cm.forward(q.astype(np.float64), q, q)
    with pytest.raises(ValueError, match="head dim"):
        cm.forward(*(np.zeros((1, 4, 2, 32), np.float32),) * 3)
    with pytest.raises(ValueError, match="p_dtype"):
        cm.forward(q, q, q, p_dtype="fp8")
    with pytest.raises(ValueError, match="softmax_scale"):
        cm.forward(q, q, q, softmax_scale=-1.0)
