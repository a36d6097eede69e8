"""The deterministic backward with the rotated walk (HopperBwdConfig.dq_rotated,
Note [A rotated walk] in fa4_final.common.bwd_tiles), on an H100/H200, reached through config=
only: against float64 autograd (the rule of tests/gpu/test_fa4_final_bwd.py) where the walk
rotates (at most 64 key tiles a head), where it keeps the plain order (more key tiles, and
causal), with fewer query tiles than key tiles (starts shared) and GQA; the same bits over 20
runs, within rounding of the plain walk; varlen.
Run with a timeout (a turn that never comes hangs):
    timeout 580 python -m pytest -q -m gpu tests/gpu/test_bwd_rotated_walk.py
"""

import pytest
import torch

from tests.gpu.test_fa4_final_bwd import BF16, _check, _run
from tests.test_bwd_rotated_walk import rotated
from utils.hardware import missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]


# (batch, seqlen_q, seqlen_k, heads, heads_kv): 32 key tiles a head at 4096 keys; 80 at 10000
# (the plain order); 8 query tiles against 32 key tiles (starts shared)
SHAPES = [(1, 4096, 4096, 4, 2), (1, 10000, 10000, 2, 1), (2, 1000, 4000, 4, 1),
          (2, 1000, 777, 8, 2)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s[1:3])))
@pytest.mark.parametrize("d", [64, 128])
def test_rotated_walk_matches_float64(d, shape, causal):
    b, sq, sk, h, hk = shape
    ok, line = _check((b, sq, sk, h, hk, d, BF16), causal, deterministic=True,
                      config=rotated(d, causal))
    print(line)
    assert ok, line


@pytest.mark.parametrize("d", [64, 128])
def test_rotated_walk_bitwise_reproducible_and_close_to_the_plain_walk(d):
    """20 runs, GQA, odd lengths (11 key tiles: the walk rotates): the same bits every time;
    every gradient within rounding of the plain walk's (dQ's adds and dK's, dV's steps come in
    another order, so not its bits)."""
    from tests.gpu.test_bwd_deterministic_copies import same_bits_twenty_times

    window = (None, None)
    q, k, v, dout, first = same_bits_twenty_times(d, window, rotated(d, False))
    plain = _run(q, k, v, dout, window=window, deterministic=True,
                 config=rotated(d, False, on=False))[:3]
    for name, a, b in zip(("dq", "dk", "dv"), first, plain):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3, msg=name)


@pytest.mark.parametrize("name", ["mixed-gqa-d128", "many-causal-d64"])
def test_rotated_walk_varlen(name):
    """The varlen kernel with the rotated walk (each sequence's own query and key tiles):
    float64 per sequence, the same bits 20 times."""
    from tests.gpu.test_bwd_deterministic_copies import _varlen_runner
    from tests.gpu.test_fa4_final_varlen_bwd import CASES, Problem

    p = Problem(CASES[name])
    d = p.q.shape[-1]
    run = _varlen_runner(p)
    first = run(rotated(d, p.causal))
    p.check(first, f"{name} rotated walk")
    for _ in range(19):
        for g, a, b in zip(("dq", "dk", "dv"), first, run(rotated(d, p.causal))):
            assert torch.equal(a, b), f"{name} {g}: runs differ"
