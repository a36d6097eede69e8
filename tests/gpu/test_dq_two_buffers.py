"""The deterministic backward with two dQ staging buffers (HopperBwdConfig.dq_buffers = 2,
Note [Two dQ buffers] in fa4_final.hopper.bwd), with and without dq_adds_overlap
(Note [Adds in flight across turns]), on an H100/H200, reached through config= only:
against float64 autograd (the rule of tests/gpu/test_fa4_final_bwd.py), the same bits over 20
runs, and dQ, dK, dV bitwise the one-buffer deterministic kernel's at the same tile (the adds
and their order are unchanged; only when a warpgroup may store moves). Dense and varlen, causal
or not, GQA. Run with a timeout (a broken hand-off hangs):
    timeout 580 python -m pytest -q -m gpu tests/gpu/test_dq_two_buffers.py
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


def two_buffers(d, causal, buffers=2, overlap=False):
    """measure.bwd_phases' fa4_final_det_db (D = 64, D = 128 causal) and det_db64 (D = 128 not
    causal: 64 query rows, dQ = dS K, where 80 rows leave no room for a second buffer);
    ``overlap``: with dq_adds_overlap (fa4_final_det_overlap, _det_overlap64)."""
    cfg = replace(hopper_bwd_default(d, causal), deterministic=True, dq_buffers=buffers,
                  dq_adds_overlap=overlap)
    if d == 128 and not causal:
        cfg = replace(cfg, tile_m=64, dq_swap_ab=False)
    return cfg


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlap"])
def test_two_dq_buffers_match_float64(d, causal, overlap):
    ok, line = _check((2, 1000, 777, 8, 2, d, BF16), causal, deterministic=True,
                      config=two_buffers(d, causal, overlap=overlap))
    print(line)
    assert ok, line


@pytest.mark.parametrize("d,window", [(128, (None, None)), (128, (None, 0)), (64, (None, None)),
                                      (64, (None, 0)), (128, (200, 0))])
@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlap"])
def test_two_dq_buffers_bitwise_reproducible_and_the_one_buffer_kernels(d, window, overlap):
    """20 runs, GQA, odd lengths: the same bits every time, and every gradient bitwise the
    one-buffer deterministic kernel's at the same tile (with dq_adds_overlap too:
    Note [Adds in flight across turns] changes when a turn passes, not the adds or their
    order)."""
    from tests.gpu.test_bwd_deterministic_copies import same_bits_twenty_times

    causal = window[1] == 0
    q, k, v, dout, first = same_bits_twenty_times(d, window,
                                                  two_buffers(d, causal, overlap=overlap))
    one = _run(q, k, v, dout, window=window, deterministic=True,
               config=two_buffers(d, causal, buffers=1))[:3]
    for name, a, b in zip(("dq", "dk", "dv"), first, one):
        assert torch.equal(a, b), f"{name}: differs from the one-buffer kernel's"


@pytest.mark.parametrize("overlap", [False, True], ids=["in_turn", "overlap"])
@pytest.mark.parametrize("name", ["mixed-gqa-d128", "many-causal-d64"])
def test_two_dq_buffers_varlen(name, overlap):
    """The varlen kernel with two buffers (and dq_adds_overlap): float64 per sequence, the same
    bits 20 times, every gradient the one-buffer kernel's."""
    from tests.gpu.test_bwd_deterministic_copies import _varlen_runner
    from tests.gpu.test_fa4_final_varlen_bwd import CASES, Problem

    p = Problem(CASES[name])
    d = p.q.shape[-1]
    run = _varlen_runner(p)
    first = run(two_buffers(d, p.causal, overlap=overlap))
    p.check(first, f"{name} two dQ buffers")
    for _ in range(19):
        for g, a, b in zip(("dq", "dk", "dv"), first,
                           run(two_buffers(d, p.causal, overlap=overlap))):
            assert torch.equal(a, b), f"{name} {g}: runs differ"
    for g, a, b in zip(("dq", "dk", "dv"), first, run(two_buffers(d, p.causal, buffers=1))):
        assert torch.equal(a, b), f"{name} {g}: differs from the one-buffer kernel's"


# dq_copies with two buffers and a dQ warp each (Note [dQ copies] in fa4_final.common.bwd_tiles,
# Note [Adds in flight across turns]): measure.bwd_phases' fa4_final_det_c4_overlap and kin

def copies_overlap(d, causal, copies, first_store, buffers=2):
    """two_buffers with dq_adds_overlap, ``copies`` accumulators and dq_first_store; with
    ``buffers=1`` the one-buffer kernel of the same copies, whose adds and order it keeps."""
    cfg = two_buffers(d, causal, buffers=buffers, overlap=buffers == 2)
    return replace(cfg, dq_copies=copies, dq_first_store=first_store)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("copies,first_store", [(2, True), (4, True), (4, False)])
def test_copies_with_two_buffers_match_float64(d, causal, copies, first_store):
    ok, line = _check((2, 1000, 777, 8, 2, d, BF16), causal, deterministic=True,
                      config=copies_overlap(d, causal, copies, first_store))
    print(line)
    assert ok, line


@pytest.mark.parametrize("d,window", [(128, (None, None)), (128, (None, 0)), (64, (None, None)),
                                      (64, (None, 0)), (128, (200, 0))])
@pytest.mark.parametrize("copies,first_store", [(2, True), (4, True), (4, False)])
def test_copies_with_two_buffers_bitwise_reproducible_and_the_one_buffer_kernels(
        d, window, copies, first_store):
    """20 runs, GQA, odd lengths: the same bits every time, and every gradient bitwise the
    one-buffer kernel's with the same copies (the same adds into the same copies in the same
    order; bwd_post sums the copies the same way)."""
    from tests.gpu.test_bwd_deterministic_copies import same_bits_twenty_times

    causal = window[1] == 0
    cfg = copies_overlap(d, causal, copies, first_store)
    q, k, v, dout, first = same_bits_twenty_times(d, window, cfg)
    one = _run(q, k, v, dout, window=window, deterministic=True,
               config=copies_overlap(d, causal, copies, first_store, buffers=1))[:3]
    for name, a, b in zip(("dq", "dk", "dv"), first, one):
        assert torch.equal(a, b), f"{name}: differs from the one-buffer kernel's"


@pytest.mark.parametrize("name", ["mixed-gqa-d128", "many-causal-d64"])
def test_copies_with_two_buffers_varlen(name):
    """The varlen kernel with four copies, first stores, two buffers and a dQ warp each:
    float64 per sequence, the same bits 20 times, the one-buffer kernel's bits."""
    from tests.gpu.test_bwd_deterministic_copies import _varlen_runner
    from tests.gpu.test_fa4_final_varlen_bwd import CASES, Problem

    p = Problem(CASES[name])
    d = p.q.shape[-1]
    run = _varlen_runner(p, poison=True)  # a copy left unwritten would show as NaN
    first = run(copies_overlap(d, p.causal, 4, True))
    p.check(first, f"{name} four copies, two dQ buffers")
    for _ in range(19):
        for g, a, b in zip(("dq", "dk", "dv"), first, run(copies_overlap(d, p.causal, 4, True))):
            assert torch.equal(a, b), f"{name} {g}: runs differ"
    for g, a, b in zip(("dq", "dk", "dv"), first,
                       run(copies_overlap(d, p.causal, 4, True, buffers=1))):
        assert torch.equal(a, b), f"{name} {g}: differs from the one-buffer kernel's"
