"""fa4_final's Blackwell backward (chapter 11) on a B200/B300 against float64 autograd.

No Blackwell GPU was available when this kernel was written: these tests are the first time it
runs, skipped (saying so) everywhere else. Run them in a subprocess with a timeout, since a broken
mbarrier protocol hangs instead of failing:

    timeout 900 python -m pytest tests/gpu/test_blackwell_bwd.py -m sm100 -x -v

The reference, the awkward shapes and the tolerance rule are the Hopper backward's GPU test's
(tests/gpu/test_fa4_final_bwd.py); outputs are NaN-filled before each launch.
"""

import math

import pytest
import torch

from tests.gpu.test_fa4_final_bwd import CASES, _attention, _grads, _visible
from utils.checks import poison_, rounding_atol
from utils.hardware import missing
from utils.reference import random_qkv

_WHY = missing("sm_100")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sm100,
    pytest.mark.skipif(_WHY is not None, reason=f"{_WHY}. No Blackwell GPU here: the backward is "
                       "verified by tests/test_blackwell_bwd_compile.py (compile-only)"),
]


def _check(case, causal, window=(None, None), deterministic=False, seed=None, config=None):
    from fa4_final.runtime.prologue import backward_into

    b, sq, sk, h, hk, d, dtype = case
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype,
                               device="cuda", seed=seed)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.float32).to(dtype)
    scale = d ** -0.5
    visible = _visible(sq, sk, causal, *window, q.device)
    out, lse = _attention(q, k, v, visible, scale, torch.float64)
    out, lse = out.to(dtype).contiguous(), lse.float().contiguous()
    grads = [poison_(torch.empty_like(t)) for t in (q, k, v)]
    backward_into(q, k, v, out, lse, dout, *grads, causal=causal, window_size=window,
                  deterministic=deterministic, config=config, target="sm_100a")
    torch.cuda.synchronize()
    ref = _grads(q, k, v, dout, visible, scale, torch.float64)
    same = _grads(q, k, v, dout, visible, scale, dtype)
    lines, ok = [], True
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref, same):
        err = (g.double() - r).abs().nan_to_num(math.inf)
        limit = 2 * (s.double() - r).abs().max().item() + rounding_atol(r, dtype) + 1e-4
        ok &= err.max().item() <= limit
        lines.append(f"{name} max|err| {err.max().item():.2e} (limit {limit:.2e})")
    return ok, (f"{case} causal={causal} window={window} det={deterministic} config={config}: "
                + "; ".join(lines))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_blackwell_bwd_matches_float64_autograd(case, causal):
    ok, line = _check(case, causal)
    assert ok, line


@pytest.mark.parametrize("window", [(64, None), (32, 16), (None, 40)])
def test_blackwell_bwd_sliding_windows(window):
    ok, line = _check((1, 300, 333, 2, 1, 128, torch.bfloat16), False, window)
    assert ok, line


@pytest.mark.parametrize("causal", [False, True])
def test_blackwell_bwd_deterministic(causal):
    ok, line = _check((2, 257, 513, 4, 2, 128, torch.bfloat16), causal, deterministic=True)
    assert ok, line


# the 2-CTA mode (fa4_final.blackwell.bwd_pair): the same checks, never run before either
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", [c for c in CASES if c[5] in (64, 128)],
                         ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_blackwell_bwd_pair_matches_float64_autograd(case, causal):
    from fa4_final.blackwell.config import BlackwellBwdConfig

    ok, line = _check(case, causal, config=BlackwellBwdConfig(two_cta=True))
    assert ok, line


@pytest.mark.parametrize("window", [(64, None), (None, 40)])
def test_blackwell_bwd_pair_sliding_windows(window):
    from fa4_final.blackwell.config import BlackwellBwdConfig

    ok, line = _check((1, 300, 333, 2, 1, 128, torch.bfloat16), False, window,
                      config=BlackwellBwdConfig(two_cta=True))
    assert ok, line
