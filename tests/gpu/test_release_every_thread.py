"""The Hopper backward with every MMA thread releasing its Q and dO stages
(HopperBwdConfig.release_every_thread, the default, Note [Release after the warp's reads] in
fa4_final.hopper.bwd) on an H100/H200, beside the one-lane release: against float64 autograd
(the rule of tests/gpu/test_fa4_final_bwd.py), default and deterministic modes; the release
moves no arithmetic, so the deterministic build's gradients are bitwise the one-lane build's
and the default build's dK and dV too (its dQ is summed by atomic adds in any order). Run with
a timeout (a wrong arrival count hangs):
    timeout 580 python -m pytest -q -m gpu tests/gpu/test_release_every_thread.py
"""

from dataclasses import replace

import pytest
import torch

from fa4_final.hopper.config import hopper_bwd_default
from tests.gpu.test_fa4_final_bwd import BF16, _check, _run
from utils.hardware import missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]


def every_thread(d, causal, deterministic=False, on=True):
    """The default tile of (d, causal) with release_every_thread = ``on``."""
    return replace(hopper_bwd_default(d, causal), deterministic=deterministic,
                   release_every_thread=on)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_release_every_thread_matches_float64(d, causal, deterministic):
    ok, line = _check((2, 1000, 777, 8, 2, d, BF16), causal, deterministic=deterministic,
                      config=every_thread(d, causal, deterministic))
    print(line)
    assert ok, line


@pytest.mark.parametrize("d,window", [(128, (None, None)), (128, (None, 0)), (64, (None, 0)),
                                      (128, (200, 0))])
def test_release_every_thread_bitwise_the_one_lane_builds(d, window):
    """GQA, odd lengths: the deterministic build gives the same bits 20 times and every gradient
    of the one-lane deterministic build; the default build's dK and dV equal the one-lane
    default build's bit for bit."""
    from tests.gpu.test_bwd_deterministic_copies import same_bits_twenty_times

    causal = window[1] == 0
    q, k, v, dout, first = same_bits_twenty_times(d, window, every_thread(d, causal, True))
    one = _run(q, k, v, dout, window=window, deterministic=True,
               config=every_thread(d, causal, True, on=False))[:3]
    for name, a, b in zip(("dq", "dk", "dv"), first, one):
        assert torch.equal(a, b), f"deterministic {name}: differs from the one-lane build's"
    got = _run(q, k, v, dout, window=window, config=every_thread(d, causal))[:3]
    was = _run(q, k, v, dout, window=window, config=every_thread(d, causal, on=False))[:3]
    for name, a, b in zip(("dk", "dv"), got[1:], was[1:]):
        assert torch.equal(a, b), f"default {name}: differs from the one-lane build's"
