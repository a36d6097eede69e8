"""The Hopper backward at head dim 96 (dv = 96; dQ by one warpgroup, Note [dQ by one warpgroup]
in fa4_final.hopper.bwd), at head dim 192 with dv = 128 (dQ^T split unevenly, Note [dQ split
unevenly]; the d192 tests, the same checks with v, out, dout and dv of 128 columns) and at
D = dv = 192 and D = 256 (dK and dV swapped, Note [dK and dV swapped]; the d192v192 and d256
tests) on an H100/H200, against float64 torch.autograd: what lifts the bwd_head_dims row of
fa4_final.runtime.pending, so every test sets FA4_FINAL_PENDING to it.

Inputs are fresh random tensors (the seed is in each failure's line); out and lse come from the
float64 reference rounded as a forward stores them, so the backward is checked alone, then once
through the API's autograd with fa4_final's own forward. dq, dk, dv are NaN-filled before each
run (an element no kernel writes fails). The rule is the other backward tests': max error <= 2 x
PyTorch's own error in the input dtype + rounding slack (tests/gpu/test_fa4_final_bwd.py's
_check, and the varlen Problem of tests/gpu/test_fa4_final_varlen_bwd.py, which also guards
the buffers' edges). Shapes: lengths 1, 77, 1000, 4097, seqlen_q != seqlen_k both ways (causal
rows that see no key), GQA 4 and MQA, a window, varlen with uneven sequences (0, 1, odd, tile
multiples), fp16; the deterministic mode bitwise the same over 5 runs. Run with a timeout (a
broken barrier protocol hangs rather than fails), about 5 minutes for each head dim, most of it
compiling:
    timeout 580 python -m pytest -q -m gpu -p no:cacheprovider -rA \
        tests/gpu/test_bwd_head_dims.py -k "not d192 and not d256"
    (and then -k "d192 and not d192v192", -k d192v192, -k d256: each its own builds)
"""

from __future__ import annotations

import pytest
import torch

from fa4_final.runtime import pending
from tests.gpu.test_fa4_final_bwd import _check, _run
from tests.gpu.test_fa4_final_varlen_bwd import Problem
from utils.checks import rounding_atol
from utils.hardware import missing
from utils.reference import random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]

BF16, FP16 = torch.bfloat16, torch.float16
D = 96


@pytest.fixture(autouse=True)
def bwd_head_dims(monkeypatch):
    monkeypatch.setenv(pending.ENV, "bwd_head_dims")


# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, dtype)
CASES = [
    (1, 1, 1, 1, 1, D, BF16),
    (2, 77, 77, 2, 1, D, FP16),
    (1, 1000, 1000, 4, 4, D, BF16),
    (1, 77, 1000, 2, 2, D, BF16),  # seqlen_q < seqlen_k
    (1, 1000, 77, 2, 2, D, BF16),  # seqlen_q > seqlen_k: causal rows that see no key
    (2, 1000, 4097, 8, 2, D, BF16),  # GQA 4, a partial last key tile
    (1, 4097, 4097, 4, 1, D, BF16),  # MQA, many query tiles a CTA
    (2, 300, 129, 6, 1, D, FP16),
]


def _case_id(case):
    return "-".join(map(str, case)).replace("torch.", "")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_d96_backward_matches_float64(case, causal):
    ok, line = _check(case, causal)
    print(line)
    assert ok, line


@pytest.mark.parametrize("window", [(64, None), (32, 16), (200, 0), (None, -5)])
def test_d96_backward_sliding_windows(window):
    ok, line = _check((1, 700, 900, 4, 1, D, BF16), False, window=window)
    print(line)
    assert ok, line


@pytest.mark.parametrize("causal", [False, True])
def test_d96_deterministic_is_bitwise_repeatable_over_5_runs(causal):
    """Many key tiles add into each dQ tile, in turn: five runs, the same bits, and within the
    rule of float64."""
    ok, line = _check((2, 1000, 2049, 8, 2, D, BF16), causal, deterministic=True)
    print(line)
    assert ok, line
    q, k, v, _ = random_qkv(2, 1000, 8, D, seqlen_k=2049, heads_kv=2, dtype=BF16,
                            device="cuda")
    dout = torch.randn(q.shape, device="cuda").to(BF16)
    runs = [_run(q, k, v, dout, causal, deterministic=True)[:3] for _ in range(5)]
    for later in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, b), f"{name}: deterministic runs differ"


LENS_Q = [300, 0, 129, 1, 1024, 77, 0, 1, 128, 513, 64, 5]
LENS_K = [300, 50, 0, 200, 1500, 77, 0, 1, 64, 1000, 64, 130]
USED_K = [300, 50, 0, 150, 1400, 3, 0, 1, 64, 999, 1, 129]
# (lens_q, lens_k, seqused_k, heads, heads_kv, D, dtype, causal, window)
VARLEN = {
    "mixed-gqa": (LENS_Q, LENS_K, None, 8, 2, D, BF16, False, (None, None)),
    "mixed-causal-used": (LENS_Q, LENS_K, USED_K, 4, 4, D, BF16, True, (None, None)),
    "skewed-causal-fp16": ([1, 700, 3, 0, 129, 256, 40], [500, 2, 0, 9, 129, 256, 1], None,
                           4, 1, D, FP16, True, (None, None)),
    "window": (LENS_Q, LENS_K, None, 4, 2, D, BF16, False, (100, 0)),
}


@pytest.fixture(scope="module")
def problems():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Problem(VARLEN[name], seed=int(torch.randint(0, 2**20, (1,))))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(VARLEN))
def test_d96_varlen_backward_matches_float64(problems, name):
    p = problems(name)
    p.check(p.run(), f"{name} d96")


def test_d96_varlen_deterministic_is_bitwise_repeatable_and_the_loop(problems):
    p = problems("mixed-causal-used")
    runs = [p.run(deterministic=True) for _ in range(5)]
    p.check(runs[0], "d96 deterministic")
    for later in runs[1:]:
        for g, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, b), f"{g}: deterministic runs differ"
    for g, a, b in zip(("dq", "dk", "dv"), runs[0], p.loop(deterministic=True)):
        assert torch.equal(a, b), f"{g}: deterministic varlen kernel != the per-sequence loop"


@pytest.mark.parametrize("causal", [False, True])
def test_d96_through_the_api_autograd(causal):
    """flash_attn_func with a gradient at D = 96 (the gate listed): fa4_final's forward and this
    backward, against float64 autograd of the same inputs, the rule with 2 x PyTorch's error."""
    from fa4_final import flash_attn_func
    from tests.gpu.test_fa4_final_bwd import _grads, _visible

    q, k, v, seed = random_qkv(2, 1000, 8, D, seqlen_k=777, heads_kv=2, dtype=BF16,
                               device="cuda")
    dout = torch.randn(q.shape, device="cuda").to(BF16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = flash_attn_func(*leaves, causal=causal)
    out.backward(dout)
    visible = _visible(1000, 777, causal, None, None, "cuda")
    scale = D**-0.5
    ref = _grads(q, k, v, dout, visible, scale, torch.float64)
    same = _grads(q, k, v, dout, visible, scale, BF16)
    for name, leaf, r, s in zip(("dq", "dk", "dv"), leaves, ref, same):
        g = leaf.grad
        assert g is not None and not g.isnan().any(), f"{name}: NaN (seed {seed})"
        # the forward's own rounding of out moves dq, dk through delta: 3 x, not 2 x
        limit = 3 * (s.double() - r).abs().max().item() + rounding_atol(r, BF16) + 1e-3
        err = (g.double() - r).abs().max().item()
        assert err <= limit, f"{name}: max|err| {err:.2e} > {limit:.2e} (seed {seed})"


# ----------------------------------------------------------------------------------------------
# D = 192 with dv = 128 (DeepSeek's MLA prefill): tile_m = 32, dQ^T split 128 + 64 rows of D
# (Note [dQ split unevenly] in fa4_final.hopper.bwd), V, dO and dV of dv columns (Note [dV head
# dim]). Its own builds: run alone with -k d192 (about 5 minutes, most of it compiling).

D192, DV128 = 192, 128
# (batch, seqlen_q, seqlen_k, heads, heads_kv, D, dv, dtype)
CASES_192 = [
    (1, 1, 1, 1, 1, D192, DV128, BF16),
    (2, 77, 77, 2, 1, D192, DV128, FP16),
    (1, 1000, 1000, 4, 4, D192, DV128, BF16),
    (1, 77, 1000, 2, 2, D192, DV128, BF16),  # seqlen_q < seqlen_k
    (1, 1000, 77, 2, 2, D192, DV128, BF16),  # seqlen_q > seqlen_k: causal rows that see no key
    (2, 1000, 4097, 8, 2, D192, DV128, BF16),  # GQA 4, a partial last key tile
    (1, 4097, 4097, 4, 1, D192, DV128, BF16),  # MQA, many query tiles a CTA
]


def _check_dv(case, causal, window=(None, None), deterministic=False):
    """tests/gpu/test_fa4_final_bwd.py's _check with v, out, dout and dv of dv columns: the
    backward on float64's out and lse into NaN-filled buffers, each gradient within 2 x
    PyTorch's own error in the input dtype + rounding slack of float64's, no NaN."""
    import math

    from tests.gpu.test_fa4_final_bwd import _grads

    b, sq, sk, h, hk, d, dv, dtype = case
    q, k, _, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype,
                               device="cuda")
    v = random_qkv(b, sq, h, dv, seqlen_k=sk, heads_kv=hk, dtype=dtype, device="cuda",
                   seed=seed + 1)[2]
    dout = torch.randn(*q.shape[:-1], dv, device="cuda", dtype=torch.float32).to(dtype)
    dq, dk, dvg, visible, scale = _run(q, k, v, dout, causal, window, deterministic)
    assert dvg.shape == v.shape and dq.shape == q.shape
    ref = _grads(q, k, v, dout, visible, scale, torch.float64)
    same = _grads(q, k, v, dout, visible, scale, dtype)
    lines, ok = [], True
    for name, g, r, s in zip(("dq", "dk", "dv"), (dq, dk, dvg), ref, same):
        err = (g.double() - r).abs()
        nan = int(torch.isnan(g).sum())
        limit = 2 * (s.double() - r).abs().max().item() + rounding_atol(r, dtype) + 1e-4
        worst = tuple(int(i) for i in torch.unravel_index(err.nan_to_num(math.inf).argmax(),
                                                          err.shape))
        good = nan == 0 and err.max().item() <= limit
        ok &= good
        lines.append(f"{name} max|err| {err.max().item():.2e} (limit {limit:.2e}) at {worst}, "
                     f"NaN {nan}")
    return ok, (f"{case} causal={causal} window={window} det={deterministic} seed={seed}: "
                + "; ".join(lines)), (q, k, v, dout)


def _case_id_192(case):
    return "d192-" + "-".join(map(str, case)).replace("torch.", "")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES_192, ids=_case_id_192)
def test_d192_dv128_backward_matches_float64(case, causal):
    ok, line, _ = _check_dv(case, causal)
    print(line)
    assert ok, line


@pytest.mark.parametrize("window", [(64, None), (32, 16), (200, 0)])
def test_d192_dv128_backward_sliding_windows(window):
    ok, line, _ = _check_dv((1, 700, 900, 4, 1, D192, DV128, BF16), False, window=window)
    print(line)
    assert ok, line


@pytest.mark.parametrize("causal", [False, True])
def test_d192_dv128_deterministic_is_bitwise_repeatable_over_5_runs(causal):
    """Both warpgroups' chunks of every key tile add into each dQ tile in turn: five runs,
    the same bits, and within the rule of float64."""
    ok, line, (q, k, v, dout) = _check_dv((2, 1000, 2049, 8, 2, D192, DV128, BF16), causal,
                                          deterministic=True)
    print(line)
    assert ok, line
    runs = [_run(q, k, v, dout, causal, deterministic=True)[:3] for _ in range(5)]
    for later in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, b), f"{name}: deterministic runs differ"


VARLEN_192 = {
    "d192-mixed-gqa": (LENS_Q, LENS_K, None, 8, 2, D192, BF16, False, (None, None)),
    "d192-mixed-causal-used": (LENS_Q, LENS_K, USED_K, 4, 4, D192, BF16, True, (None, None)),
    "d192-window": (LENS_Q, LENS_K, None, 4, 2, D192, BF16, False, (100, 0)),
}


@pytest.fixture(scope="module")
def problems_192():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Problem(VARLEN_192[name], seed=int(torch.randint(0, 2**20, (1,))),
                                  dv=DV128)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(VARLEN_192))
def test_d192_dv128_varlen_backward_matches_float64(problems_192, name):
    p = problems_192(name)
    assert p.v.shape[-1] == DV128 and p.q.shape[-1] == D192
    p.check(p.run(), name)


def test_d192_dv128_varlen_deterministic_is_bitwise_repeatable_and_the_loop(problems_192):
    p = problems_192("d192-mixed-causal-used")
    runs = [p.run(deterministic=True) for _ in range(5)]
    p.check(runs[0], "d192 deterministic")
    for later in runs[1:]:
        for g, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, b), f"{g}: deterministic runs differ"
    for g, a, b in zip(("dq", "dk", "dv"), runs[0], p.loop(deterministic=True)):
        assert torch.equal(a, b), f"{g}: deterministic varlen kernel != the per-sequence loop"


@pytest.mark.parametrize("causal", [False, True])
def test_d192_dv128_through_the_api_autograd(causal):
    """flash_attn_func with a gradient at (192, 128) (the gate listed): fa4_final's forward and
    this backward against float64 autograd of the same inputs (3 x PyTorch's error: the
    forward's rounding of out moves dq, dk through delta)."""
    from fa4_final import flash_attn_func
    from tests.gpu.test_fa4_final_bwd import _grads, _visible

    q, k, _, seed = random_qkv(2, 1000, 8, D192, seqlen_k=777, heads_kv=2, dtype=BF16,
                               device="cuda")
    v = random_qkv(2, 1000, 8, DV128, seqlen_k=777, heads_kv=2, dtype=BF16, device="cuda",
                   seed=seed + 1)[2]
    dout = torch.randn(*q.shape[:-1], DV128, device="cuda").to(BF16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = flash_attn_func(*leaves, causal=causal)
    assert out.shape == dout.shape
    out.backward(dout)
    visible = _visible(1000, 777, causal, None, None, "cuda")
    scale = D192**-0.5
    ref = _grads(q, k, v, dout, visible, scale, torch.float64)
    same = _grads(q, k, v, dout, visible, scale, BF16)
    for name, leaf, r, s in zip(("dq", "dk", "dv"), leaves, ref, same):
        g = leaf.grad
        assert g is not None and not g.isnan().any(), f"{name}: NaN (seed {seed})"
        assert g.shape == leaf.shape
        limit = 3 * (s.double() - r).abs().max().item() + rounding_atol(r, BF16) + 1e-3
        err = (g.double() - r).abs().max().item()
        assert err <= limit, f"{name}: max|err| {err:.2e} > {limit:.2e} (seed {seed})"


# ----------------------------------------------------------------------------------------------
# D = dv = 192 (64 x 96) and D = 256 (64 x 48) with dK and dV swapped: the head dim on the
# wgmma M of dK^T and dV^T, S = Q K^T with the queries on M, P and dS through shared memory,
# dQ^T split by rows of D (Note [dK and dV swapped] in fa4_final.hopper.bwd). Each head dim its
# own builds and its own -k marker: run alone with -k d192v192, and -k d256 (about 5 minutes
# each, most of it compiling). The same checks as (192, 128)'s.

SWAPPED = {"d192v192": 192, "d256": 256}


def _swapped_cases(d):
    return [
        (1, 1, 1, 1, 1, d, d, BF16),
        (2, 77, 77, 2, 1, d, d, FP16),
        (1, 1000, 1000, 4, 4, d, d, BF16),
        (1, 77, 1000, 2, 2, d, d, BF16),  # seqlen_q < seqlen_k
        (1, 1000, 77, 2, 2, d, d, BF16),  # seqlen_q > seqlen_k: causal rows that see no key
        (2, 1000, 4097, 8, 2, d, d, BF16),  # GQA 4, a partial last key tile
        (1, 4097, 4097, 4, 1, d, d, BF16),  # MQA, many query tiles a CTA
    ]


CASES_SWAPPED = [(tag, case) for tag, d in SWAPPED.items() for case in _swapped_cases(d)]


def _swapped_id(tag_case):
    tag, case = tag_case
    return tag + "-" + "-".join(map(str, case)).replace("torch.", "")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tag_case", CASES_SWAPPED, ids=_swapped_id)
def test_swapped_backward_matches_float64(tag_case, causal):
    ok, line, _ = _check_dv(tag_case[1], causal)
    print(line)
    assert ok, line


@pytest.mark.parametrize("window", [(64, None), (32, 16), (200, 0)])
@pytest.mark.parametrize("tag", list(SWAPPED))
def test_swapped_backward_sliding_windows(tag, window):
    d = SWAPPED[tag]
    ok, line, _ = _check_dv((1, 700, 900, 4, 1, d, d, BF16), False, window=window)
    print(line)
    assert ok, line


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tag", list(SWAPPED))
def test_swapped_deterministic_is_bitwise_repeatable_over_5_runs(tag, causal):
    """Both parts of dQ^T of every key tile add into each dQ tile in turn: five runs, the
    same bits, and within the rule of float64."""
    d = SWAPPED[tag]
    ok, line, (q, k, v, dout) = _check_dv((2, 1000, 2049, 8, 2, d, d, BF16), causal,
                                          deterministic=True)
    print(line)
    assert ok, line
    runs = [_run(q, k, v, dout, causal, deterministic=True)[:3] for _ in range(5)]
    for later in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, b), f"{name}: deterministic runs differ"


VARLEN_SWAPPED = {
    f"{tag}-{name}": (LENS_Q, LENS_K, used, heads, heads_kv, d, BF16, causal, window)
    for tag, d in SWAPPED.items()
    for name, used, heads, heads_kv, causal, window in (
        ("mixed-gqa", None, 8, 2, False, (None, None)),
        ("mixed-causal-used", USED_K, 4, 4, True, (None, None)),
        ("window", None, 4, 2, False, (100, 0)),
    )
}


@pytest.fixture(scope="module")
def problems_swapped():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Problem(VARLEN_SWAPPED[name], seed=int(torch.randint(0, 2**20, (1,))))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(VARLEN_SWAPPED))
def test_swapped_varlen_backward_matches_float64(problems_swapped, name):
    p = problems_swapped(name)
    p.check(p.run(), name)


@pytest.mark.parametrize("tag", list(SWAPPED))
def test_swapped_varlen_deterministic_is_bitwise_repeatable_and_the_loop(problems_swapped, tag):
    p = problems_swapped(f"{tag}-mixed-causal-used")
    runs = [p.run(deterministic=True) for _ in range(5)]
    p.check(runs[0], f"{tag} deterministic")
    for later in runs[1:]:
        for g, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, b), f"{g}: deterministic runs differ"
    for g, a, b in zip(("dq", "dk", "dv"), runs[0], p.loop(deterministic=True)):
        assert torch.equal(a, b), f"{g}: deterministic varlen kernel != the per-sequence loop"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tag", list(SWAPPED))
def test_swapped_through_the_api_autograd(tag, causal):
    """flash_attn_func with a gradient at D = dv (the gate listed): fa4_final's forward and
    the swapped backward against float64 autograd of the same inputs (3 x PyTorch's error:
    the forward's rounding of out moves dq, dk through delta)."""
    from fa4_final import flash_attn_func
    from tests.gpu.test_fa4_final_bwd import _grads, _visible

    d = SWAPPED[tag]
    q, k, v, seed = random_qkv(2, 1000, 8, d, seqlen_k=777, heads_kv=2, dtype=BF16,
                               device="cuda")
    dout = torch.randn_like(q)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = flash_attn_func(*leaves, causal=causal)
    out.backward(dout)
    visible = _visible(1000, 777, causal, None, None, "cuda")
    scale = d**-0.5
    ref = _grads(q, k, v, dout, visible, scale, torch.float64)
    same = _grads(q, k, v, dout, visible, scale, BF16)
    for name, leaf, r, s in zip(("dq", "dk", "dv"), leaves, ref, same):
        g = leaf.grad
        assert g is not None and not g.isnan().any(), f"{name}: NaN (seed {seed})"
        limit = 3 * (s.double() - r).abs().max().item() + rounding_atol(r, BF16) + 1e-3
        err = (g.double() - r).abs().max().item()
        assert err <= limit, f"{name}: max|err| {err:.2e} > {limit:.2e} (seed {seed})"


SOFTCAP_SWAPPED = [((1, 300, 77, 2, 2, True), 30.0), ((2, 257, 513, 4, 2, False), 5.0)]


@pytest.mark.parametrize("shape, softcap", SOFTCAP_SWAPPED, ids=str)
@pytest.mark.parametrize("tag", list(SWAPPED))
def test_swapped_softcap_backward_matches_float64(tag, shape, softcap):
    """The swapped softcap build (Note [Softcap in the backward]) on the float64 forward's out
    and lse rounded as a forward stores them, into NaN-filled buffers, against torch.autograd
    of the float64 reference (tests/gpu/test_softcap_sinks.py's rule and inputs)."""
    from fa4_final.hopper.host import backward_recipe, launch_backward
    from fa4_final.runtime.compile import compiled
    from tests.gpu.test_softcap_sinks import _inputs, _same_precision
    from utils import checks
    from utils.reference import attention_reference_features

    d = SWAPPED[tag]
    b, sq, sk, h, hk, causal = shape
    q, k, v, _, seed = _inputs((b, sq, sk, h, hk, d, causal, BF16), None, requires_grad=True)
    scale = d ** -0.5
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(b, sq, h, d, generator=g).to("cuda", BF16)
    leaves64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse = attention_reference_features(*leaves64, causal, scale, softcap, None)
    want = torch.autograd.grad((ref_out * dout.double()).sum(), leaves64)
    same_out, _ = _same_precision(q, k, v, causal, scale, softcap, None)
    same = torch.autograd.grad((same_out.float() * dout.float()).sum(), (q, k, v))
    out, lse = ref_out.detach().to(BF16), ref_lse.detach().float()
    dq, dk, dv = (checks.poisoned_empty(*t.shape, dtype=BF16, device="cuda") for t in (q, k, v))
    plan = compiled(backward_recipe, d, "bf16", causal, None, False, False, False, False,
                    False, "sm_90a", softcap)
    assert plan.config.dkv_swap_ab
    launch_backward(plan, q.detach(), k.detach(), v.detach(), out, lse, dout, dq, dk, dv,
                    causal, scale, None, 0 if causal else None)
    label = f"{tag} {shape} softcap={softcap} seed={seed}"
    checks.wait_for_gpu(label)
    failed = [str(v) for v in (checks.tolerance_check(x, r, p, name) for name, x, r, p in zip(
        ("dq", "dk", "dv"), (dq, dk, dv), want, same)) if not v.passed]
    assert not failed, f"{label}\n" + "\n".join(failed)
