"""The Hopper backward at head dim 96 (dv = 96; dQ by one warpgroup, Note [dQ by one warpgroup]
in fa4_final.hopper.bwd), at head dim 192 with dv = 128 (dQ^T split unevenly, Note [dQ split
unevenly]; the d192 tests, the same checks with v, out, dout and dv of 128 columns) and at
D = dv = 192 and D = 256 (dK and dV swapped, Note [dK and dV swapped]; the d192v192 and d256
tests) on an H100/H200, against float64 torch.autograd: what verified these backwards (with
racecheck on an H100 and synccheck on an H200, results/h100/gpu_checks.json and
results/h200/gpu_checks.json), so that the bwd_head_dims row of fa4_final.runtime.pending was
deleted; the tests run without FA4_FINAL_PENDING.

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

from tests.gpu.test_fa4_final_bwd import _check, _compare, _grads, _run, _visible
from tests.gpu.test_fa4_final_varlen_bwd import LENS_K, LENS_Q, SKEWED_K, SKEWED_Q, USED_K, Problem
from utils.checks import rounding_atol
from utils.hardware import missing
from utils.reference import random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
    pytest.mark.usefixtures("no_pending"),  # FA4_FINAL_PENDING unset: the path users take
]

BF16, FP16 = torch.bfloat16, torch.float16

# tag: (D, dv). The tag starts every test id: the session runs each build alone with -k
# (tests/gpu/h200_session.sh: "not d192 and not d256", "d192 and not d192v192", d192v192, d256).
#   d96: dQ by one warpgroup (Note [dQ by one warpgroup]); checked by test_fa4_final_bwd's
#     _check (v drawn with q and k).
#   d192 (dv = 128, DeepSeek's MLA prefill): tile_m = 32, dQ^T split 128 + 64 rows of D (Note
#     [dQ split unevenly]), V, dO and dV of dv columns (Note [dV head dim]).
#   d192v192 (64 x 96) and d256 (64 x 48), dK and dV swapped: the head dim on the wgmma M of
#     dK^T and dV^T, S = Q K^T with the queries on M, P and dS through shared memory, dQ^T split
#     by rows of D (Note [dK and dV swapped]).
# All but d96 go through _check_dv (v drawn from its own seed, seed + 1).
SHAPES = {"d96": (96, 96), "d192": (192, 128), "d192v192": (192, 192), "d256": (256, 256)}
SWAPPED = ["d192v192", "d256"]


def _id(param):
    """A (tag, x) parameter's id: the tag, then x's items joined by '-'."""
    tag, x = param
    return tag + "-" + "-".join(map(str, x)).replace("torch.", "")


def _case(tag, b, sq, sk, h, hk, dtype):
    """(batch, seqlen_q, seqlen_k, heads, heads_kv, D, dtype) at d96 (_check's case), with dv
    after D at the others (_check_dv's)."""
    d, dv = SHAPES[tag]
    return (b, sq, sk, h, hk, d, dtype) if tag == "d96" else (b, sq, sk, h, hk, d, dv, dtype)


def _check_dv(case, causal, window=(None, None), deterministic=False):
    """tests/gpu/test_fa4_final_bwd.py's _check with v, out, dout and dv of dv columns: the
    backward on float64's out and lse into NaN-filled buffers, each gradient within 2 x
    PyTorch's own error in the input dtype + rounding slack of float64's, no NaN."""
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
    ok, lines = _compare((dq, dk, dvg), ref, same, dtype)
    return ok, (f"{case} causal={causal} window={window} det={deterministic} seed={seed}: "
                + "; ".join(lines)), (q, k, v, dout)


def _check_shape(tag, case, causal, window=(None, None), deterministic=False):
    """(ok, line, the inputs (q, k, v, dout), None at d96): _check at d96, else _check_dv."""
    if tag == "d96":
        return (*_check(case, causal, window=window, deterministic=deterministic), None)
    return _check_dv(case, causal, window=window, deterministic=deterministic)


def _assert_same_bits(runs, loop=None):
    """Every run's (dq, dk, dv) bitwise the first's, and the first the per-sequence loop's."""
    for later in runs[1:]:
        for g, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, b), f"{g}: deterministic runs differ"
    if loop is not None:
        for g, a, b in zip(("dq", "dk", "dv"), runs[0], loop):
            assert torch.equal(a, b), f"{g}: deterministic varlen kernel != the per-sequence loop"


SIZES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, dtype)
    (1, 1, 1, 1, 1, BF16),
    (2, 77, 77, 2, 1, FP16),
    (1, 1000, 1000, 4, 4, BF16),
    (1, 77, 1000, 2, 2, BF16),  # seqlen_q < seqlen_k
    (1, 1000, 77, 2, 2, BF16),  # seqlen_q > seqlen_k: causal rows that see no key
    (2, 1000, 4097, 8, 2, BF16),  # GQA 4, a partial last key tile
    (1, 4097, 4097, 4, 1, BF16),  # MQA, many query tiles a CTA
]
SIZES_D96 = [(2, 300, 129, 6, 1, FP16)]
CASES = [(tag, _case(tag, *size)) for tag in SHAPES
         for size in SIZES + (SIZES_D96 if tag == "d96" else [])]

WINDOWS = [(64, None), (32, 16), (200, 0)]
WINDOWS_D96 = [(None, -5)]
WINDOW_CASES = [(tag, window) for tag in SHAPES
                for window in WINDOWS + (WINDOWS_D96 if tag == "d96" else [])]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tag_case", CASES, ids=_id)
def test_backward_matches_float64(tag_case, causal):
    ok, line, _ = _check_shape(*tag_case, causal)
    print(line)
    assert ok, line


@pytest.mark.parametrize("tag_window", WINDOW_CASES, ids=_id)
def test_backward_sliding_windows(tag_window):
    tag, window = tag_window
    ok, line, _ = _check_shape(tag, _case(tag, 1, 700, 900, 4, 1, BF16), False, window=window)
    print(line)
    assert ok, line


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tag", list(SHAPES))
def test_deterministic_is_bitwise_repeatable_over_5_runs(tag, causal):
    """Many key tiles (and at d192, d192v192, d256 both parts of dQ^T of every key tile) add
    into each dQ tile in turn: five runs, the same bits, and within the rule of float64."""
    ok, line, inputs = _check_shape(tag, _case(tag, 2, 1000, 2049, 8, 2, BF16), causal,
                                    deterministic=True)
    print(line)
    assert ok, line
    if inputs is None:  # d96: fresh inputs
        q, k, v, _ = random_qkv(2, 1000, 8, SHAPES[tag][0], seqlen_k=2049, heads_kv=2,
                                dtype=BF16, device="cuda")
        dout = torch.randn(q.shape, device="cuda").to(BF16)
    else:
        q, k, v, dout = inputs
    _assert_same_bits([_run(q, k, v, dout, causal, deterministic=True)[:3] for _ in range(5)])


# name: (lens_q, lens_k, seqused_k, heads, heads_kv, dtype, causal, window)
VARLEN = {
    "mixed-gqa": (LENS_Q, LENS_K, None, 8, 2, BF16, False, (None, None)),
    "mixed-causal-used": (LENS_Q, LENS_K, USED_K, 4, 4, BF16, True, (None, None)),
    "skewed-causal-fp16": (SKEWED_Q, SKEWED_K, None, 4, 1, FP16, True, (None, None)),
    "window": (LENS_Q, LENS_K, None, 4, 2, BF16, False, (100, 0)),
}
VARLEN_CASES = [(tag, (name,)) for tag in SHAPES for name in VARLEN
                if tag == "d96" or name != "skewed-causal-fp16"]


@pytest.fixture(scope="module")
def problems():
    """(tag, name) -> its varlen Problem (test_fa4_final_varlen_bwd's), built once, seeded at
    random."""
    cache = {}

    def get(tag, name):
        if (tag, name) not in cache:
            d, dv = SHAPES[tag]
            lens_q, lens_k, used, h, hk, dtype, causal, window = VARLEN[name]
            cache[tag, name] = Problem((lens_q, lens_k, used, h, hk, d, dtype, causal, window),
                                       seed=int(torch.randint(0, 2**20, (1,))), dv=dv)
        return cache[tag, name]

    return get


@pytest.mark.parametrize("tag_name", VARLEN_CASES, ids=_id)
def test_varlen_backward_matches_float64(problems, tag_name):
    tag, (name,) = tag_name
    p = problems(tag, name)
    assert (p.q.shape[-1], p.v.shape[-1]) == SHAPES[tag]
    p.check(p.run(), f"{tag}-{name}")


@pytest.mark.parametrize("tag", list(SHAPES))
def test_varlen_deterministic_is_bitwise_repeatable_and_the_loop(problems, tag):
    p = problems(tag, "mixed-causal-used")
    runs = [p.run(deterministic=True) for _ in range(5)]
    p.check(runs[0], f"{tag} deterministic")
    _assert_same_bits(runs, p.loop(deterministic=True))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tag", list(SHAPES))
def test_through_the_api_autograd(tag, causal):
    """flash_attn_func with a gradient at (D, dv) (the gate listed): fa4_final's forward and
    this backward against float64 autograd of the same inputs (3 x PyTorch's error, not 2 x:
    the forward's own rounding of out moves dq, dk through delta)."""
    from fa4_final import flash_attn_func

    d, dv = SHAPES[tag]
    q, k, v, seed = random_qkv(2, 1000, 8, d, seqlen_k=777, heads_kv=2, dtype=BF16,
                               device="cuda")
    if dv != d:  # v from its own seed
        v = random_qkv(2, 1000, 8, dv, seqlen_k=777, heads_kv=2, dtype=BF16, device="cuda",
                       seed=seed + 1)[2]
    if tag in SWAPPED:
        dout = torch.randn_like(q)
    else:
        dout = torch.randn(*q.shape[:-1], dv, device="cuda").to(BF16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = flash_attn_func(*leaves, causal=causal)
    assert out.shape == dout.shape
    out.backward(dout)
    visible = _visible(1000, 777, causal, None, None, "cuda")
    scale = d**-0.5
    ref = _grads(q, k, v, dout, visible, scale, torch.float64)
    same = _grads(q, k, v, dout, visible, scale, BF16)
    for name, leaf, r, s in zip(("dq", "dk", "dv"), leaves, ref, same):
        g = leaf.grad
        assert g is not None and not g.isnan().any(), f"{name}: NaN (seed {seed})"
        assert g.shape == leaf.shape
        limit = 3 * (s.double() - r).abs().max().item() + rounding_atol(r, BF16) + 1e-3
        err = (g.double() - r).abs().max().item()
        assert err <= limit, f"{name}: max|err| {err:.2e} > {limit:.2e} (seed {seed})"


SOFTCAP_SWAPPED = [((1, 300, 77, 2, 2, True), 30.0), ((2, 257, 513, 4, 2, False), 5.0)]


@pytest.mark.parametrize("shape, softcap", SOFTCAP_SWAPPED, ids=str)
@pytest.mark.parametrize("tag", SWAPPED)
def test_swapped_softcap_backward_matches_float64(tag, shape, softcap):
    """The swapped softcap build (Note [Softcap in the backward]) on the float64 forward's out
    and lse rounded as a forward stores them, into NaN-filled buffers, against torch.autograd
    of the float64 reference (tests/gpu/test_softcap_sinks.py's rule and inputs)."""
    from fa4_final.hopper.host import backward_recipe, launch_backward
    from fa4_final.runtime.compile import compiled
    from tests.gpu.test_softcap_sinks import _inputs, _same_precision
    from utils import checks
    from utils.reference import attention_reference_features

    d = SHAPES[tag][0]
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
