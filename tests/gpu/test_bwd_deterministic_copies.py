"""The deterministic backward's candidate of issue 34 on an H100/H200: dQ copies and early
release (HopperBwdConfig.dq_copies, dq_early_release; Note [dQ copies] in
fa4_final.common.bwd_tiles), reached through config= only. Against float64 autograd (the rule of
tests/gpu/test_fa4_final_bwd.py), bitwise the same over 20 runs, dK and dV bitwise the one-copy
deterministic kernel's (the copies change only dQ's order of adds), dQ the default kernel's
within rounding; causal or not, GQA, varlen. Run with a timeout (a broken turn protocol hangs):
    timeout 580 python -m pytest -q -m gpu tests/gpu/test_bwd_deterministic_copies.py
The dq_first_store tests (the second half of the file) need their own builds; alone:
    timeout 580 python -m pytest -q -m gpu tests/gpu/test_bwd_deterministic_copies.py -k first_store
"""

from dataclasses import replace

import pytest
import torch

from fa4_final.hopper.config import hopper_bwd_default
from tests.gpu.test_fa4_final_bwd import BF16, _check, _run
from utils.hardware import missing
from utils.reference import random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]


def candidate(d, causal, copies=2, early=True):
    return replace(hopper_bwd_default(d, causal), deterministic=True, dq_copies=copies,
                   dq_early_release=early)


def _within_rounding(a, b):
    """dQ of two orders of float32 adds, each rounded to bf16: at most an ulp or two apart."""
    a, b = a.float(), b.float()
    tol = 2 ** -6 * torch.maximum(a.abs(), b.abs()) + 1e-5 * b.abs().max()
    return bool(((a - b).abs() <= tol).all()), (a - b).abs().max().item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_copies_match_float64(d, causal):
    ok, line = _check((2, 1000, 777, 8, 2, d, BF16), causal, deterministic=True,
                      config=candidate(d, causal))
    print(line)
    assert ok, line


@pytest.mark.parametrize("copies,early", [(2, False), (1, True), (4, True)])
def test_each_half_and_other_counts_match_float64(copies, early):
    ok, line = _check((1, 2049, 2047, 4, 2, 128, BF16), False, deterministic=True,
                      config=candidate(128, False, copies, early))
    print(line)
    assert ok, line


def same_bits_twenty_times(d, window, cfg):
    """(q, k, v, dout, (dq, dk, dv)): GQA inputs of odd lengths, and the deterministic
    backward with ``cfg`` run 20 times on them, asserted to give the same bits every time."""
    q, k, v, seed = random_qkv(2, 1500, 8, d, seqlen_k=1300, heads_kv=2, dtype=BF16,
                               device="cuda", seed=11)
    dout = torch.randn(q.shape, device="cuda").to(BF16)
    first = _run(q, k, v, dout, window=window, deterministic=True, config=cfg)[:3]
    for run in range(19):
        again = _run(q, k, v, dout, window=window, deterministic=True, config=cfg)[:3]
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), (f"run {run + 2}: {name} differs in "
                                       f"{int((a != b).sum())} elements (seed {seed})")
    return q, k, v, dout, first


@pytest.mark.parametrize("d,window", [(128, (None, None)), (128, (None, 0)), (64, (None, None)),
                                      (64, (None, 0))])
def test_copies_are_bitwise_reproducible_and_agree_with_the_others(d, window):
    """20 runs, GQA: the same bits every time; dK, dV bitwise the one-copy kernel's; dQ the
    default (atomic) kernel's within rounding."""
    causal = window == (None, 0)
    q, k, v, dout, first = same_bits_twenty_times(d, window, candidate(d, causal))
    one_copy = _run(q, k, v, dout, window=window, deterministic=True)[:3]
    for name, a, b in zip(("dk", "dv"), first[1:], one_copy[1:]):
        assert torch.equal(a, b), f"{name}: the copies changed it"
    default = _run(q, k, v, dout, window=window)[:3]
    ok, worst = _within_rounding(first[0], default[0])
    assert ok, f"dq: {worst:.2e} from the default kernel's"


@pytest.mark.parametrize("name", ["mixed-gqa-d128", "many-causal-d64"])
def test_varlen_copies(name):
    """The varlen kernels with the candidate: float64 per sequence, the same bits 20 times,
    dK and dV the one-copy kernel's."""
    from tests.gpu.test_fa4_final_varlen_bwd import CASES, Problem

    p = Problem(CASES[name])
    d = p.q.shape[-1]
    cfg = candidate(d, p.causal)

    run = _varlen_runner(p)

    first = run(cfg)
    p.check(first, f"{name} copies")
    for _ in range(19):
        for g, a, b in zip(("dq", "dk", "dv"), first, run(cfg)):
            assert torch.equal(a, b), f"{name} {g}: runs differ"
    one_copy = run(None)
    for g, a, b in zip(("dk", "dv"), first[1:], one_copy[1:]):
        assert torch.equal(a, b), f"{name} {g}: the copies changed it"
    ok, worst = _within_rounding(first[0], one_copy[0])
    assert ok, f"{name} dq: {worst:.2e} from the one-copy kernel's"


# HopperBwdConfig.dq_first_store (Note [dQ copies]): turn 0 of each copy stores, nothing is
# zeroed, bwd_post reads the visited copies only. The accumulator is torch.empty: _poisoned
# leaves NaN in the allocator's cache first, so a slab read without a visitor shows up as NaN.


def first_store(d, causal, copies):
    return replace(candidate(d, causal, copies, True), dq_first_store=True)


def _varlen_runner(p, poison=False):
    """run(config) -> (dq, dk, dv): the deterministic varlen backward of test problem ``p``
    (tests.gpu.test_fa4_final_varlen_bwd.Problem) with ``config``; ``poison``: the allocator's
    cache filled with NaN first (_poisoned), so an unwritten accumulator slab would show."""
    from fa4_final.runtime import varlen
    from tests.gpu.test_fa4_final_varlen_bwd import _sync

    def run(config):
        (dq, dk, dv), _ = p.buffers()
        if poison:
            _poisoned()
        varlen.varlen_backward_into(p.q, p.k, p.v, p.out, p.lse, p.dout, dq, dk, dv, p.cu_q,
                                    p.cu_k, p.seqused_k, max(p.lens_q), max(p.used_k),
                                    causal=p.causal, window_size=p.window, deterministic=True,
                                    config=config)
        _sync()
        return dq, dk, dv
    return run


def _poisoned():
    """Fill and free a large block: the caching allocator hands it to the next accumulator."""
    junk = torch.full((64 << 20,), float("nan"), device="cuda")
    del junk


@pytest.mark.parametrize("copies", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_first_store_matches_float64(d, causal, copies):
    _poisoned()
    ok, line = _check((2, 1000, 777, 8, 2, d, BF16), causal, deterministic=True,
                      config=first_store(d, causal, copies))
    print(line)
    assert ok, line


@pytest.mark.parametrize("copies", [1, 4])
@pytest.mark.parametrize("d,window", [(128, (None, None)), (64, (None, 0))])
def test_first_store_bitwise_and_equal_to_the_zeroing_build(d, window, copies):
    """20 runs: the same bits; dK, dV bitwise the one-copy kernel's; dQ the zeroing build's
    (same copies and turns, bwd_pre zeroing) up to a zero's sign, so compared as values."""
    causal = window == (None, 0)
    cfg = first_store(d, causal, copies)
    q, k, v, seed = random_qkv(2, 1500, 8, d, seqlen_k=1300, heads_kv=2, dtype=BF16,
                               device="cuda", seed=12)
    dout = torch.randn(q.shape, device="cuda").to(BF16)
    _poisoned()
    first = _run(q, k, v, dout, window=window, deterministic=True, config=cfg)[:3]
    for run in range(19):
        _poisoned()
        again = _run(q, k, v, dout, window=window, deterministic=True, config=cfg)[:3]
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), (f"run {run + 2}: {name} differs in "
                                       f"{int((a != b).sum())} elements (seed {seed})")
    zeroing = _run(q, k, v, dout, window=window, deterministic=True,
                   config=candidate(d, causal, copies, True))[:3]
    for name, a, b in zip(("dq", "dk", "dv"), first, zeroing):
        assert bool((a == b).all()), f"{name}: the first store changed {int((a != b).sum())}"
    one_copy = _run(q, k, v, dout, window=window, deterministic=True)[:3]
    for name, a, b in zip(("dk", "dv"), first[1:], one_copy[1:]):
        assert torch.equal(a, b), f"{name}: the copies changed it"


@pytest.mark.parametrize("copies", [1, 4])
@pytest.mark.parametrize("window", [(None, 0), (0, 0)])
def test_first_store_query_tiles_nobody_visits(copies, window):
    """seqlen_q 1500 > seqlen_k 200, bottom-right aligned: causal rows < 1300 and the local
    window's too see no key, so their query tiles have no visitor in any copy (their slabs are
    never written): dQ must be exactly zero there, not the NaN left in the memory."""
    d = 64
    cfg = first_store(d, True, copies)
    q, k, v, _ = random_qkv(1, 1500, 4, d, seqlen_k=200, heads_kv=4, dtype=BF16,
                            device="cuda", seed=13)
    dout = torch.randn(q.shape, device="cuda").to(BF16)
    _poisoned()
    ok, line = _check((1, 1500, 200, 4, 4, d, BF16), False, window=window, deterministic=True,
                      config=cfg, seed=13)
    print(line)
    assert ok, line
    _poisoned()
    dq = _run(q, k, v, dout, window=window, deterministic=True, config=cfg)[0]
    assert not torch.isnan(dq).any()
    assert bool((dq[:, :1300] == 0).all()), "rows that see no key got a non-zero dQ"


@pytest.mark.parametrize("copies", [1, 4])
@pytest.mark.parametrize("name", ["mixed-gqa-d128", "many-causal-d64"])
def test_varlen_first_store(name, copies):
    """The varlen kernels with the first store: float64 per sequence, the same bits 20 times,
    dK and dV the one-copy kernel's, dQ the zeroing build's values."""
    from tests.gpu.test_fa4_final_varlen_bwd import CASES, Problem

    p = Problem(CASES[name])
    d = p.q.shape[-1]
    cfg = first_store(d, p.causal, copies)

    run = _varlen_runner(p, poison=True)

    first = run(cfg)
    p.check(first, f"{name} first store, {copies} copies")
    for _ in range(19):
        for g, a, b in zip(("dq", "dk", "dv"), first, run(cfg)):
            assert torch.equal(a, b), f"{name} {g}: runs differ"
    zeroing = run(candidate(d, p.causal, copies, True))
    assert bool((first[0] == zeroing[0]).all()), f"{name} dq: the first store changed it"
    one_copy = run(None)
    for g, a, b in zip(("dk", "dv"), first[1:], one_copy[1:]):
        assert torch.equal(a, b), f"{name} {g}: the copies changed it"
