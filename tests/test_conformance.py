"""The conformance run's machinery on a CPU (measure/conformance.py), and its stored verdicts.

The run itself needs a GPU and both packages; here its cases, its float64 reference and its
judge are checked with stand-in packages: one that computes the right function passes, and the
classic mistakes (a negative window side read as "unbounded", a NaN, a crash) are caught."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from measure import conformance as conf
from utils import results
from utils.window import visible_mask

CASES = conf.make_cases(96, seed=0)


def _package(window_reading=None, poison=None, raises=None):
    """A stand-in for a package: flash_attn_func / flash_attn_varlen_func computed by the
    conformance reference in float32 (more accurate than the rule asks), optionally with a
    mistake planted."""

    def attend(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None),
               deterministic=False, return_lse=False, cu_seqlens_q=None, cu_seqlens_k=None,
               max_seqlen_q=None, max_seqlen_k=None, seqused_k=None):
        if raises is not None:
            raise raises
        layout = "dense" if cu_seqlens_q is None else (
            "varlen" if seqused_k is None else "varlen_used")
        if layout == "dense":
            lens_q, lens_k = [q.shape[1]] * q.shape[0], [k.shape[1]] * q.shape[0]
        else:
            lens_q = torch.diff(cu_seqlens_q).tolist()
            lens_k = torch.diff(cu_seqlens_k).tolist()
        window = window_reading(window_size) if window_reading else window_size
        case = conf.Case(0, 0, q.shape[-1], "bf16", layout, causal, tuple(window),
                         deterministic, return_lse, q.shape[-2], k.shape[-2], softmax_scale,
                         lens_q, lens_k, None if seqused_k is None else seqused_k.tolist())
        out, lse = conf.reference({"q": q, "k": k, "v": v}, case, torch.float32)
        out = out.to(q.dtype)
        if poison == "nan":
            out = out + float("nan")
        return out, lse.float()

    return SimpleNamespace(flash_attn_func=attend, flash_attn_varlen_func=attend)


def _small(cases, n=14):
    """Cases small enough for a CPU (the largest lengths cost seconds in float64)."""
    return [c for c in cases if max(c.lens_q + c.lens_k) <= 260 and len(c.lens_q) <= 3][:n]


def test_conformance_cases_cover_every_accepted_argument():
    def has(pred):
        return any(pred(c) for c in CASES)

    assert has(lambda c: c.window[0] is not None and c.window[0] < 0 and c.window[1] is None)
    assert has(lambda c: c.window[1] is not None and c.window[1] < 0 and c.window[0] is None)
    assert has(lambda c: None not in c.window and min(c.window) < 0 <= max(c.window))
    assert has(lambda c: None not in c.window and max(c.window) < 0)  # both negative: none
    assert has(lambda c: c.causal and c.window[1] not in (None, 0))  # causal overrides right
    assert has(lambda c: c.causal) and has(lambda c: not c.causal)
    assert has(lambda c: c.lens_q[0] != c.lens_k[0])
    assert has(lambda c: 0 in c.lens_q) and has(lambda c: 0 in c.lens_k)
    assert has(lambda c: c.hk == 1 and c.h > 1) and has(lambda c: 1 < c.hk < c.h)
    assert {c.layout for c in CASES} == {"dense", "varlen", "varlen_used"}
    assert has(lambda c: c.deterministic) and has(lambda c: c.return_lse)
    assert has(lambda c: not c.return_lse) and has(lambda c: c.scale is not None)
    assert {c.dtype for c in CASES} == {"bf16", "fp16"} and {c.d for c in CASES} == {64, 128}


def test_conformance_cases_are_the_same_on_every_machine():
    again = conf.make_cases(96, seed=0)
    assert [c.describe() for c in again] == [c.describe() for c in CASES]


@pytest.mark.slow
def test_conformance_judge_passes_a_correct_package_on_negative_windows():
    cases = [c for c in _small(CASES, 40) if c.window != (None, None)][:8]
    assert any(w is not None and w < 0 for c in cases for w in c.window)
    for case in cases:
        row = conf.run_case(case, {"fa4_final": _package()}, device="cpu")
        assert row["verdict"] in ("agree", "ok"), (case.describe(), row["fa4_final"])


def _drop_negative_sides(window):
    """The mistake fa4_final once made: any negative side read as unbounded."""
    return tuple(None if w is not None and w < 0 else w for w in window)


def test_conformance_judge_catches_a_negative_side_read_as_unbounded():
    def matters(c):  # the two readings keep different pairs in some sequence of the case
        return any(not torch.equal(
            visible_mask(nq, nk, c.causal, c.window),
            visible_mask(nq, nk, c.causal, _drop_negative_sides(c.window)))
            for nq, nk in zip(c.lens_q, c.lens_k))

    cases = [c for c in _small(CASES, 60) if matters(c)][:4]
    assert cases
    for case in cases:
        row = conf.run_case(case, {"fa4_final": _package(_drop_negative_sides)}, device="cpu")
        assert row["verdict"] == "MISMATCH", case.describe()
        assert "max err" in row["fa4_final"]["why"] or "infinities" in row["fa4_final"]["why"]


@pytest.mark.parametrize("mistake, verdict, words", [
    (dict(poison="nan"), "MISMATCH", "NaN"),
    (dict(raises=RuntimeError("illegal memory access")), "MISMATCH", "RuntimeError"),
    (dict(raises=ValueError("head_dim must be one of (64, 128), got 96")), "refused",
     "head_dim"),
])
def test_conformance_judge_names_each_mistake(mistake, verdict, words):
    case = next(c for c in _small(CASES) if min(c.lens_q) > 0 and min(c.lens_k) > 0)
    row = conf.run_case(case, {"fa4_final": _package(**mistake)}, device="cpu")
    assert row["verdict"] == verdict
    assert words in (row["fa4_final"].get("why", "") + row["fa4_final"].get("error", ""))


def test_conformance_reference_gives_empty_rows_zero_and_minus_inf():
    case = conf.Case(0, 3, 64, "bf16", "dense", False, (5, -6), False, True, 2, 1, None,
                     [1, 1], [40, 40])  # an empty window: no row sees a key
    inputs = conf.make_inputs(case, "cpu")
    out, lse = conf.reference(inputs, case, torch.float64)
    assert torch.isneginf(lse).all() and (out == 0).all()


def test_stored_conformance_run_has_no_mismatch():
    """The H200 run (results/h200/conformance_fa4.json): no case where fa4_final returned numbers
    that fail the rule, crashed or hung; every refusal is a clean error naming what it got;
    and the cases that ran cover every accepted argument."""
    try:
        res = results.load(conf.NAME)
    except FileNotFoundError:
        pytest.skip("conformance not measured yet")
    bad = [r for r in res.rows if r["verdict"] == "MISMATCH"]
    assert not bad, [(r["case"], r["fa4_final"]) for r in bad[:3]]
    ran = [r for r in res.rows if r["verdict"] in ("agree", "ok")]
    windows = [tuple(r["case"]["window"]) for r in ran]
    assert any(w[0] is not None and w[0] < 0 for w in windows)
    assert any(w[1] is not None and w[1] < 0 for w in windows)
    assert {r["case"]["layout"] for r in ran} == {"dense", "varlen", "varlen_used"}
    assert any(r["case"]["deterministic"] for r in ran) and any(r["case"]["return_lse"]
                                                                for r in ran)
    for r in res.rows:
        if r["verdict"] == "refused":
            assert r["fa4_final"]["error"].split(":")[0] in conf.CLEAN_ERRORS
    agree = sum(r["verdict"] == "agree" for r in res.rows)
    assert agree >= len(res.rows) // 2, f"only {agree} of {len(res.rows)} cases agree with FA4"


def test_conformance_rule_is_flash_attention_s():
    """Twice PyTorch's same-precision error plus the rounding step; NaN never passes."""
    ref = torch.tensor([1.0, 2.0, -math.inf], dtype=torch.float64)
    same = torch.tensor([1.01, 2.0, -math.inf])
    ok, err, limit, _ = conf._rule("x", torch.tensor([1.015, 2.0, -math.inf]), ref, same,
                                   torch.bfloat16)
    assert ok and limit == pytest.approx(0.02 + 0.0, abs=1e-2)
    assert not conf._rule("x", torch.tensor([1.05, 2.0, -math.inf]), ref, same,
                          torch.bfloat16)[0]
    assert not conf._rule("x", torch.tensor([1.0, float("nan"), -math.inf]), ref, same,
                          torch.bfloat16)[0]
    assert not conf._rule("x", torch.tensor([1.0, 2.0, 0.0]), ref, same, torch.bfloat16)[0]


def test_conformance_gradient_floor_is_float32_roundoff_at_the_calls_scale():
    """Note [Gradient floor]: a row that sees one key has dq = dk = 0 exactly; a package whose
    float32 sums leave 1e-6 there passes, one whose dq is off by a bug's size does not."""
    case = conf.Case(0, 5, 64, "bf16", "dense", False, (None, None), False, False, 2, 2, None,
                     [9], [1])
    inputs = conf.make_inputs(case, "cpu")

    def graded(noise):
        refs = {}
        for key, dtype in (("ref", torch.float64), ("same", torch.bfloat16)):
            q, k, v = (inputs[n].detach().clone().requires_grad_(True) for n in "qkv")
            out, lse = conf.reference({**inputs, "q": q, "k": k, "v": v}, case, dtype)
            grads = torch.autograd.grad(conf.loss_of(out, lse, inputs, case), (q, k, v))
            refs[key] = (out.detach(), lse.detach(), grads)
        out, lse, (dq, dk, dv) = refs["ref"]
        result = (out.to(torch.bfloat16), lse.float(),
                  (dq.to(torch.bfloat16) + noise, dk.to(torch.bfloat16), dv.to(torch.bfloat16)))
        return conf.judge(result, refs["ref"], refs["same"], case)

    assert graded(1e-6)["passed"]
    bad = graded(0.05)
    assert not bad["passed"] and "dq: max err" in bad["why"]


def test_conformance_float64_reference_gradients_are_not_rounded_to_the_inputs_dtype():
    """Note [Reference leaves]: the H100 run's case #71 (varlen, a bf16 sink, 655 rows that see
    no key): the float64 reference's gradients are float64, so a bf16 sink gradient rounded
    correctly (31.625 for 31.66) passes, and one off by 1.0 (a dropped row's size) does not."""
    case = conf.Case(71, 71, 64, "bf16", "varlen", True, (503, -130), True, True, 1, 1, None,
                     (0, 7, 400, 257, 257), (9, 333, 1, 1, 500), None, 0.0, "bf16")
    inputs = conf.make_inputs(case, "cpu")
    refs = {}
    for key, dtype in (("ref", torch.float64), ("same", torch.bfloat16)):
        leaves = conf._fresh_leaves(inputs, torch.float64 if key == "ref" else None)
        out, lse = conf.reference(leaves, case, dtype)
        grads = torch.autograd.grad(conf.loss_of(out, lse, inputs, case), conf._leaves(leaves))
        refs[key] = (out.detach(), lse.detach(), grads)
    assert all(g.dtype == torch.float64 for g in refs["ref"][2])
    dsink = refs["ref"][2][3]
    assert 31.6 < float(dsink) < 31.7  # between the bf16 neighbours 31.625 and 31.75
    slack = conf.grad_floor(refs["ref"][2]) + conf.sink_step(refs["ref"], inputs, case)
    rounded = dsink.to(torch.bfloat16)
    ok, err, limit, _ = conf._rule("dsink", rounded, dsink, refs["same"][2][3], torch.bfloat16,
                                   slack)
    assert ok and float(rounded) == 31.625 and err < limit
    assert not conf._rule("dsink", rounded + 1.0, dsink, refs["same"][2][3], torch.bfloat16,
                          slack)[0]
