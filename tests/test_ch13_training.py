"""The CPU pieces of chapter 13's training comparison (solutions/ch13_training.py): the task, the
model, the curve comparison, and a short run through fa4_final's custom op and autograd (with the
test-only CPU reference kernel) against SDPA's math path. tests/gpu/test_fa4_final_training.py
runs the real kernels."""

import math
from dataclasses import replace

import pytest
import torch

from fa4_final.runtime import checks
from solutions import ch13_training as tr
from tests import fa4_cpu_reference as ref


def test_the_reverse_task():
    cfg = replace(tr.SMALL, batch=3)
    inputs, targets = tr.reverse_batch(torch.Generator().manual_seed(0), cfg)
    n = cfg.half_len
    assert inputs.shape == targets.shape == (3, 2 * n)
    assert torch.all(inputs[:, n] == 1)  # the separator
    assert torch.all(targets[:, :n] == -100)  # the random half is not scored
    assert torch.equal(targets[:, n:], inputs[:, :n].flip(1))  # the rest is it reversed
    again = tr.reverse_batch(torch.Generator().manual_seed(0), cfg)
    assert torch.equal(again[0], inputs)  # every run sees the same batches


def test_the_model_hands_tma_readable_views_to_the_kernel():
    seen = []

    def spy(q, k, v):
        assert q.dtype == torch.bfloat16 and not q.is_contiguous()  # autocast; a view, no copy
        seen.append(checks.check_inputs(q, k, v))  # what fa4_final would accept
        return tr.IMPLS["sdpa_math"](q, k, v)

    cfg = tr.SMALL
    model = tr.GPT(cfg, spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tr.reverse_batch(torch.Generator().manual_seed(0), cfg)[0])
    assert logits.shape == (cfg.batch, cfg.seqlen, cfg.vocab) and seen


def test_curve_comparison_arithmetic():
    assert tr.smooth([1, 3, 5, 7, 9], 2) == [2, 6, 9]
    assert tr.max_gap([1, 1, 1, 1], [1, 1, 2, 2], 2) == 1
    cfg = replace(tr.SMALL, window=2, vocab=10)
    good = {"losses": [2.0, 1.0, 0.5, 0.1]}
    runs = {"fa4_final": good, "sdpa_flash": good, "sdpa_efficient": good}
    assert tr.compare(runs, cfg)["ok"]
    runs["fa4_final"] = {"losses": [2.0, 1.0, 1.5, 1.4]}
    v = tr.compare(runs, cfg)
    assert not v["ok"] and v["gap"] == pytest.approx(1.15) and v["allowed"] == tr.GAP_ATOL


@pytest.fixture(scope="module")
def cpu_runs():
    cfg = tr.SMALL
    with ref.active():
        return cfg, {name: tr.train(name, cfg, "cpu") for name in ("fa4_final", "sdpa_math")}


def test_fa4_final_trains_like_sdpa(cpu_runs):
    cfg, runs = cpu_runs
    # on a CPU the "kernel" is float32 PyTorch too: no drift allowed beyond GAP_ATOL
    verdict = tr.compare(runs, cfg, baseline="sdpa_math", yardstick="sdpa_math")
    assert verdict["ok"], verdict
    start = math.log(cfg.vocab - 2)
    assert abs(runs["fa4_final"]["losses"][0] - start) < 0.3
    assert tr.smooth(runs["fa4_final"]["losses"], cfg.window)[-1] < 0.5 * start


def test_a_kernel_that_sees_the_future_fails_the_comparison(cpu_runs, monkeypatch):
    """The band is tight enough to catch a broken causal mask (keys after the query leak)."""
    cfg, runs = cpu_runs

    def leaky(q, k, v):
        g = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(g, dim=2).transpose(1, 2) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v)
        return out.transpose(1, 2)

    monkeypatch.setitem(tr.IMPLS, "leaky", leaky)
    broken = dict(runs, fa4_final=tr.train("leaky", cfg, "cpu"))
    verdict = tr.compare(broken, cfg, baseline="sdpa_math", yardstick="sdpa_math")
    assert not verdict["ok"] and verdict["gap"] > verdict["allowed"], verdict
