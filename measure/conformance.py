"""fa4_final against the FA4 package on random calls of everything the API accepts.

    python -m measure.conformance --cases 240 --workers 4          # on a GPU with both packages
    python -m measure.conformance --cases 240 --dry-run            # the cases only (any machine)
    python -m measure.conformance --cases 72 --workers 6 --features softcap,learnable_sink \
        --name conformance_fa4_features                            # FA4's softcap and sinks

Each case is one random call: dense or varlen (with or without ``seqused_k``), bf16 or fp16,
head dim 64 or 128, GQA/MQA head groups, seqlen_q != seqlen_k, lengths of zero, ``causal``,
``window_size`` with sides of every sign, ``softmax_scale``, ``deterministic`` and ``return_lse``
with the lse's gradient in the loss. Both packages get the same call on the same inputs, forward
and backward; both are held against a float64 reference written here from FA4's semantics
(utils.window), with FlashAttention's rule: a result's worst error at most twice plain PyTorch's
in the same precision plus the step of rounding the reference to that precision; NaN never
passes; a row that sees no key is out = 0, lse = -inf.

A case's verdict for fa4_final:
    agree      both packages pass the rule (their results are the same function)
    ok         fa4_final passes; FA4 refused the call or failed the rule (``fa4`` says how)
    refused    fa4_final raised UnsupportedError, ValueError or TypeError naming what it got:
               a gap, never a wrong answer (``fa4`` says whether FA4 runs it)
    MISMATCH   fa4_final returned numbers that fail the rule, or raised anything else, or hung
A row per case goes to results/<gpu>/conformance_fa4.json. Kernels are compiled once per static
configuration; cases are drawn from a small list of them (``STATIC``) so that the run's compile
time stays a few minutes, with the run-time arguments (shapes, window values, scale, heads)
free within each.

``--features softcap,learnable_sink`` (either or both) draws every case with FA4's softcap
and/or a learnable sink ((heads,) logits, its gradient part of the judged backward), from their
own list of static configurations (``FEATURE_STATIC``: each fixes its cap value and sink dtype,
since both are compile-time constants of a build), and sets FA4_FINAL_PENDING around fa4_final's
calls of those cases (harmless since both left fa4_final's gate; needed at a commit where they
were pending).
The reference then caps the scaled scores (softcap * tanh(s / softcap), before the mask) and
adds the sink's column to every row's logsumexp (a row that sees no key: out = 0, lse = sink).
Without ``--features`` the cases are exactly those of earlier runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from solutions.ch13_teaching import conformance_summary
from utils.window import visible_mask

NAME = "conformance_fa4"
PRODUCES = [(f"results/h200/{NAME}.json", "python -m measure.conformance --cases 240 --workers 4",
             "fa4_final and the FA4 package on random calls of every accepted argument: a "
             "verdict per case"),
            (f"results/h200/{NAME}_features.json",
             f"python -m measure.conformance --cases 72 --workers 6 --features "
             f"softcap,learnable_sink --name {NAME}_features",
             "the same with FA4's softcap and learnable sink in every case: a verdict per "
             "case"),
            (f"results/h100/{NAME}_features.json",
             f"python -m measure.conformance --cases 72 --workers 6 --deadline 520 --features "
             f"softcap,learnable_sink --name {NAME}_features",
             "the same on an H100 visit, judged before Note [Reference leaves] (its one "
             "MISMATCH, case 71's bf16 sink gradient, is the reference's rounding)")]
CLEAN_ERRORS = ("UnsupportedError", "ValueError", "TypeError")
LSE_SLACK = 1e-5  # float32 lse: what rounding the float64 lse to float32 can cost, and more
# Note [Gradient floor]
# Where the exact gradient vanishes, PyTorch's same-precision path can compute the zero exactly
# while a kernel cannot: every row that sees a single key has P = 1, so dS = P (dP - delta) = 0,
# but the kernel's dP (a float32 wgmma sum of dO V) and delta (a float32 sum of dO O) round
# differently, leaving dq and dk of order 2^-24 D |dO| |V| |K|. Twice PyTorch's error (zero)
# plus the step of rounding the reference (zero too) refuses that. So each gradient's limit
# also gets a floor of GRAD_FLOOR times the largest entry of the call's three reference
# gradients: float32 roundoff at the scale of the call, far below a masking or indexing bug,
# whose errors are of the gradients' own size.
GRAD_FLOOR = 2.0 ** -14
# Note [Reference leaves]
# autograd returns a leaf's gradient in the leaf's dtype. The float64 reference differentiates
# float64 copies of q, k, v and the sink (the same values: bf16 and fp16 convert exactly), so
# its gradients are float64 too; on the inputs themselves they would come back rounded to
# bf16, and the rule's step (rounding the reference to the output's dtype) would be zero where
# it is half an ulp. A bf16 sink gradient of 31.66 is one such case: the reference read 31.75
# and a kernel's correctly rounded 31.625 sat 0.125 away, a whole ulp of [16, 32).
# Note [Sink gradient step]
# d sink[h] = -sum_i exp(sink[h] - lse_i) * (rowsum(dO_i * O_i) - dlse_i) reads the output a
# forward stored, rounded to bf16/fp16 (FA4 computes it so too, from its dpsum), while PyTorch's
# same-precision path differentiates through float32 probabilities and never sees that rounding.
# So dsink's limit also gets the step of rounding the reference output, carried through the
# formula: sum_i exp(sink - lse_i) * sum_d |dO_id| |O_id - round(O_id)|, per head, the largest
# head's (``sink_step``). A dropped or misplaced sink moves dsink by its own size, far above it.

# (head_dim, dtype, mask, layout, deterministic): compiled once each; the masks say which window
# sides a case may bound, the values are drawn per case (any sign)
MASKS = ("none", "causal", "left", "right", "both", "causal_left")
STATIC = [
    (64, "bf16", "none", "dense", False), (128, "fp16", "causal", "dense", False),
    (128, "bf16", "left", "dense", False), (64, "fp16", "right", "dense", False),
    (128, "bf16", "both", "dense", False), (64, "bf16", "causal_left", "dense", True),
    (128, "bf16", "right", "dense", True), (64, "fp16", "both", "dense", False),
    (128, "fp16", "none", "varlen", False), (64, "bf16", "causal", "varlen_used", False),
    (128, "bf16", "both", "varlen", True), (64, "fp16", "left", "varlen_used", False),
    (128, "bf16", "right", "varlen_used", False), (64, "bf16", "causal_left", "varlen", False),
    (128, "fp16", "causal", "dense", True), (64, "bf16", "left", "dense", False),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# --features: (head_dim, dtype, mask, layout, deterministic, softcap value, sink dtype); each
# case uses the cap, the sink or both (FEATURE_MODES, in turn), so a static row compiles at
# most three forwards and two backwards; with --workers 6 each worker keeps to one row (case i
# goes to worker i % workers) and compiles only that row's kernels
FEATURE_STATIC = [
    (128, "bf16", "causal", "dense", False, 5.0, "fp32"),
    (64, "fp16", "none", "dense", False, 30.0, "fp16"),
    (128, "bf16", "both", "dense", True, 15.0, "bf16"),
    (64, "bf16", "causal", "varlen_used", False, 5.0, "fp32"),
    (128, "fp16", "left", "varlen", False, 50.0, "fp32"),
    (64, "bf16", "causal_left", "varlen", True, 2.0, "bf16"),
]
FEATURE_MODES = (("softcap", "learnable_sink"), ("softcap",), ("learnable_sink",))
FEATURES = ("softcap", "learnable_sink")
SINK_DTYPES = {"fp32": torch.float32, **DTYPES}
PENDING_ENV = "FA4_FINAL_PENDING"  # fa4_final.runtime.pending.ENV
HEAD_GROUPS = ((1, 1), (2, 2), (4, 1), (6, 2), (8, 2), (3, 3))


@dataclass
class Case:
    index: int
    seed: int
    d: int
    dtype: str
    layout: str  # dense | varlen | varlen_used
    causal: bool
    window: tuple  # (left, right) as passed: None or an int of any sign
    deterministic: bool
    return_lse: bool
    h: int
    hk: int
    scale: float | None
    lens_q: list = field(default_factory=list)  # one per sequence (dense: batch copies of sq)
    lens_k: list = field(default_factory=list)
    used_k: list | None = None  # varlen_used: keys used per sequence
    softcap: float = 0.0  # FA4's softcap (0.0: none; --features)
    sink_dtype: str | None = None  # the learnable sink's dtype (None: no sink; --features)

    def features(self) -> tuple[str, ...]:
        """The pending features this case uses (FA4_FINAL_PENDING for fa4_final's call)."""
        return tuple(name for name, on in (("softcap", bool(self.softcap)),
                                           ("learnable_sink", self.sink_dtype is not None)) if on)

    def describe(self) -> str:
        w = f"window={self.window}" if self.window != (None, None) else ""
        extra = (f" softcap={self.softcap:g}" if self.softcap else "") + (
            f" sink={self.sink_dtype}" if self.sink_dtype else "")
        return (f"#{self.index} {self.layout} d={self.d} {self.dtype} h={self.h}/{self.hk} "
                f"q={self.lens_q} k={self.lens_k}{f' used={self.used_k}' if self.used_k else ''}"
                f" causal={self.causal} {w} det={self.deterministic} lse={self.return_lse} "
                f"scale={self.scale}{extra}")


def _side(rng: random.Random, longest: int) -> int:
    """A window side of any sign: near the diagonal, around a tile, or past every key."""
    magnitude = rng.choice([0, 1, 2, 5, 17, 64, 127, 130, longest // 2, longest + 3])
    return magnitude if rng.random() < 0.55 else -magnitude


def make_cases(n: int, seed: int = 0, features: tuple[str, ...] = ()) -> list[Case]:
    """``n`` random calls; with ``features`` (a subset of FEATURES) each also uses FA4's
    softcap and/or learnable sink, drawn over FEATURE_STATIC (the module's docstring)."""
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ValueError(f"--features takes {', '.join(FEATURES)}, got {sorted(unknown)}")
    modes = [tuple(f for f in m if f in features) for m in FEATURE_MODES]
    modes = list(dict.fromkeys(m for m in modes if m))
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        cap, sink_dtype = 0.0, None
        if modes:
            d, dtype, mask, layout, det, cap_value, sink_name = \
                FEATURE_STATIC[i % len(FEATURE_STATIC)]
            mode = modes[(i // len(FEATURE_STATIC)) % len(modes)]
            cap = cap_value if "softcap" in mode else 0.0
            sink_dtype = sink_name if "learnable_sink" in mode else None
        else:
            d, dtype, mask, layout, det = STATIC[i % len(STATIC)]
        h, hk = rng.choice(HEAD_GROUPS)
        batch = rng.choice([1, 2, 3])
        if layout == "dense":
            sq = rng.choice([0, 1, 17, 64, 129, 200, 384, 511, 700])
            sk = rng.choice([0, 1, 33, 128, 255, 300, 513, 640]) if rng.random() < 0.7 else sq
            if sq == 0 and sk == 0:
                sk = 5
            lens_q, lens_k = [sq] * batch, [sk] * batch
        else:
            batch = rng.choice([1, 3, 5])
            lens_q = [rng.choice([0, 1, 7, 64, 130, 257, 400]) for _ in range(batch)]
            lens_k = [rng.choice([0, 1, 9, 128, 200, 333, 500]) for _ in range(batch)]
        used = None
        if layout == "varlen_used":
            used = [rng.randint(0, n_k) for n_k in lens_k]
        longest = max(lens_k + lens_q + [1])
        left = right = None
        causal = mask in ("causal", "causal_left")
        if mask in ("left", "both", "causal_left"):
            left = _side(rng, longest)
        if mask in ("right", "both"):
            right = _side(rng, longest)
        if causal and rng.random() < 0.25:  # causal overrides any right side (FA4)
            right = _side(rng, longest)
        scale = None if rng.random() < 0.6 else round(rng.uniform(0.03, 0.3), 4)
        cases.append(Case(i, seed * 100003 + i, d, dtype, layout, causal, (left, right), det,
                          rng.random() < 0.5, h, hk, scale, lens_q, lens_k, used, cap,
                          sink_dtype))
    return cases


# ----------------------------------------------------------------------------------------------
# inputs and the float64 reference


def make_inputs(case: Case, device) -> dict:
    """q, k, v, the loss weights and (varlen) the offsets: fresh random values from the case's
    seed, the same for both packages."""
    g = torch.Generator(device="cpu").manual_seed(case.seed)
    dt = DTYPES[case.dtype]

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dt).to(device)

    if case.layout == "dense":
        b, sq, sk = len(case.lens_q), case.lens_q[0], case.lens_k[0]
        q, k, v = rand(b, sq, case.h, case.d), rand(b, sk, case.hk, case.d), rand(
            b, sk, case.hk, case.d)
        extra = {}
    else:
        tq, tk = sum(case.lens_q), sum(case.lens_k)
        q, k, v = rand(tq, case.h, case.d), rand(tk, case.hk, case.d), rand(tk, case.hk, case.d)

        def offsets(lens):
            return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                dtype=torch.int32, device=device)

        extra = {"cu_seqlens_q": offsets(case.lens_q), "cu_seqlens_k": offsets(case.lens_k)}
        if case.used_k is not None:
            extra["seqused_k"] = torch.tensor(case.used_k, dtype=torch.int32, device=device)
    w_out = torch.randn(q.shape, generator=g).to(device)
    lse_shape = (q.shape[0], case.h, q.shape[1]) if case.layout == "dense" else (case.h, q.shape[0])
    w_lse = torch.randn(lse_shape, generator=g).to(device)
    if case.sink_dtype is not None:  # drawn after the rest: a case without a sink is unchanged
        extra["learnable_sink"] = (torch.randn(case.h, generator=g) * 2 + 1).to(
            SINK_DTYPES[case.sink_dtype]).to(device)
    return {"q": q, "k": k, "v": v, "w_out": w_out, "w_lse": w_lse, **extra}


def _leaves(inputs: dict) -> tuple:
    """The tensors the loss is differentiated in: q, k, v and the sink when there is one."""
    return tuple(inputs[n] for n in ("q", "k", "v", "learnable_sink") if n in inputs)


def _fresh_leaves(inputs: dict, dtype=None) -> dict:
    """``inputs`` with fresh leaves that require grad (the same values), in ``dtype`` when
    given: the float64 reference's leaves are float64 (Note [Reference leaves])."""
    return {**inputs, **{n: inputs[n].detach().to(dtype or inputs[n].dtype).clone()
                         .requires_grad_(True)
                         for n in ("q", "k", "v", "learnable_sink") if n in inputs}}


def _one_sequence(q, k, v, case: Case, dtype, sink=None):
    """(out, lse) of one sequence, q (sq, h, d), k and v (sk, hk, d), in ``dtype`` (float64: the
    yardstick; the inputs' dtype: PyTorch in the kernels' precision, S and P rounded to it, the
    softmax in float32). FA4's softcap caps the scaled scores before the mask; a learnable
    ``sink`` (h,) is one more column of every row's logsumexp, with no value."""
    h, hk, d = q.shape[1], k.shape[1], q.shape[2]
    scale = d ** -0.5 if case.scale is None else case.scale
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    qf, kf, vf = (t.to(dtype).transpose(0, 1) for t in (q, k, v))  # (heads, s, d)
    kf, vf = kf.repeat_interleave(h // hk, 0), vf.repeat_interleave(h // hk, 0)
    s = (qf @ kf.transpose(-1, -2)).to(soft) * scale
    if case.softcap:
        s = case.softcap * torch.tanh(s / case.softcap)
    seen = visible_mask(q.shape[0], k.shape[0], case.causal, case.window, q.device)
    s = s.masked_fill(~seen, -math.inf)
    columns = s
    if sink is not None:
        columns = torch.cat([s, sink.to(soft).view(h, 1, 1).expand(h, s.shape[1], 1)], -1)
    lse = torch.logsumexp(columns, -1)  # (h, sq): -inf where a row sees no key (no sink)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0)[..., None])
    return (p.to(dtype) @ vf).transpose(0, 1), lse


def reference(inputs: dict, case: Case, dtype):
    """(out, lse) of the whole call with autograd, in the package's layouts."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    sink = inputs.get("learnable_sink")
    if case.layout == "dense":
        outs, lses = zip(*(_one_sequence(q[b], k[b], v[b], case, dtype, sink)
                           for b in range(q.shape[0]))) if q.shape[0] else ((), ())
        out = torch.stack(outs) if outs else q.new_zeros(q.shape, dtype=dtype)
        lse = torch.stack(lses) if lses else q.new_zeros((0, case.h, q.shape[1]),
                                                         dtype=torch.float64)
        return out, lse
    outs, lses = [], []
    cq, ck = [0], [0]
    for n_q, n_k in zip(case.lens_q, case.lens_k):
        cq.append(cq[-1] + n_q)
        ck.append(ck[-1] + n_k)
    for i in range(len(case.lens_q)):
        used = case.lens_k[i] if case.used_k is None else case.used_k[i]
        o, s = _one_sequence(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i] + used], v[ck[i]:ck[i] + used],
                             case, dtype, sink)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def loss_of(out, lse, inputs, case: Case):
    """What the backward differentiates: out weighted, plus lse weighted when it is returned
    (its gradient flows through the backward: FA4's dlse)."""
    loss = (out.double() * inputs["w_out"].double()).sum()
    if case.return_lse:
        finite = torch.isfinite(lse)
        loss = loss + torch.where(finite, lse.double(), 0.0).mul(inputs["w_lse"].double()).sum()
    return loss


# ----------------------------------------------------------------------------------------------
# the two packages


class pending_features:
    """FA4_FINAL_PENDING naming ``names`` inside the block (fa4_final refuses its pending
    features otherwise), the variable as it was after it."""

    def __init__(self, names: tuple[str, ...]):
        self.names, self.before = names, None

    def __enter__(self):
        self.before = os.environ.get(PENDING_ENV)
        if self.names:
            os.environ[PENDING_ENV] = ",".join(self.names)

    def __exit__(self, *exc):
        if self.before is None:
            os.environ.pop(PENDING_ENV, None)
        else:
            os.environ[PENDING_ENV] = self.before


def call(package, inputs: dict, case: Case):
    """(out, lse, grads) of one package's call, forward and backward: grads of q, k, v and the
    sink when the case has one."""
    leaves = _fresh_leaves(inputs)
    q, k, v = leaves["q"], leaves["k"], leaves["v"]
    kwargs = dict(softmax_scale=case.scale, causal=case.causal, window_size=case.window,
                  deterministic=case.deterministic, return_lse=case.return_lse)
    if case.softcap:
        kwargs["softcap"] = case.softcap
    if "learnable_sink" in leaves:
        kwargs["learnable_sink"] = leaves["learnable_sink"]
    gate = case.features() if getattr(package, "__name__", "") == "fa4_final" else ()
    with pending_features(gate):
        if case.layout == "dense":
            out, lse = package.flash_attn_func(q, k, v, **kwargs)
        else:
            kwargs.update(cu_seqlens_q=inputs["cu_seqlens_q"],
                          cu_seqlens_k=inputs["cu_seqlens_k"], max_seqlen_q=max(case.lens_q),
                          max_seqlen_k=max(case.lens_k), seqused_k=inputs.get("seqused_k"))
            out, lse = package.flash_attn_varlen_func(q, k, v, **kwargs)
        targets = _leaves(leaves)
        grads = torch.autograd.grad(loss_of(out, lse, inputs, case), targets, allow_unused=True)
    grads = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, targets))
    return out.detach(), lse.detach(), grads


def _rule(name, value, ref, same, dtype, slack=0.0):
    """FlashAttention's rule for one tensor: (passed, worst error, limit, why)."""
    v, r, p = (t.detach().double().cpu() for t in (value, ref, same))
    if v.shape != r.shape:
        return False, math.inf, 0.0, f"{name}: shape {tuple(v.shape)} != {tuple(r.shape)}"
    if v.numel() == 0:
        return True, 0.0, 0.0, ""
    nan = int(torch.isnan(v).sum())
    inf_r, inf_v = torch.isinf(r), torch.isinf(v)
    inf_bad = int(((inf_r | inf_v) & ~(inf_r & inf_v & (v == r))).sum())
    fin = ~(inf_r | inf_v | torch.isnan(v))
    err = float((v - r).abs()[fin].max()) if fin.any() else 0.0
    pt = float((p - r).abs()[fin & torch.isfinite(p)].max()) if (fin & torch.isfinite(p)).any() \
        else 0.0
    rf = r[torch.isfinite(r)]
    step = float((rf.to(dtype).double() - rf).abs().max()) if rf.numel() else 0.0
    limit = 2 * pt + step + slack
    ok = nan == 0 and inf_bad == 0 and err <= limit
    why = "" if ok else (f"{name}: max err {err:.3g} > limit {limit:.3g}" if not (nan or inf_bad)
                         else f"{name}: {nan} NaN, {inf_bad} infinities where the reference "
                              f"has none or other ones")
    return ok, err, limit, why


def grad_floor(ref_grads) -> float:
    """Note [Gradient floor]: GRAD_FLOOR times the largest |entry| of dq, dk, dv (float64)."""
    biggest = [float(g.detach().abs().max()) for g in ref_grads if g.numel()]
    return GRAD_FLOOR * max(biggest, default=0.0)


def sink_step(ref, inputs: dict, case: Case) -> float:
    """Note [Sink gradient step]: the largest head's bound, from the float64 reference."""
    sink = inputs.get("learnable_sink")
    out, lse = ref[0].detach().double(), ref[1].detach().double()
    if sink is None or out.numel() == 0:
        return 0.0
    step = (out - out.to(DTYPES[case.dtype]).double()).abs()
    rows = (inputs["w_out"].double().abs() * step).sum(-1)  # like out without its last dim
    rows = rows.transpose(1, 2) if case.layout == "dense" else rows.transpose(0, 1)  # like lse
    shape = (1, -1, 1) if case.layout == "dense" else (-1, 1)
    p_sink = torch.exp(sink.double().view(shape) - lse).nan_to_num(1.0)
    per_head = (p_sink * rows).sum(dim=(0, 2) if case.layout == "dense" else 1)
    return float(per_head.max())


def judge(result, ref, same, case: Case, dsink_slack: float = 0.0) -> dict:
    """The rule on out, lse, dq, dk, dv; plus rows that see no key: out 0, lse -inf."""
    out, lse, grads = result
    dtype = DTYPES[case.dtype]
    if lse is None:  # q, k, v require grad: both packages return the lse (FA4's convention)
        return {"passed": False, "why": "no lse returned for inputs that require grad",
                "err": {}, "limit": {}}
    verdicts = {"out": _rule("out", out, ref[0], same[0], dtype),
                "lse": _rule("lse", lse, ref[1], same[1], torch.float32, LSE_SLACK)}
    floor = grad_floor(ref[2])
    for name, g, g_ref, g_same in zip(("dq", "dk", "dv", "dsink"), grads, ref[2], same[2]):
        g_dtype = SINK_DTYPES[case.sink_dtype] if name == "dsink" else dtype
        slack = floor + (dsink_slack if name == "dsink" else 0.0)
        verdicts[name] = _rule(name, g, g_ref, g_same, g_dtype, slack)
    empty = ~torch.isfinite(ref[1].cpu())
    rows_ok = True
    if empty.any():
        lse_c, out_c = lse.detach().cpu(), out.detach().cpu()
        out_rows = out_c.transpose(1, 2) if case.layout == "dense" else out_c.transpose(0, 1)
        rows_ok = bool(torch.isneginf(lse_c[empty]).all()) and bool((out_rows[empty] == 0).all())
    whys = [v[3] for v in verdicts.values() if v[3]]
    if not rows_ok:
        whys.append("rows that see no key are not out = 0, lse = -inf")
    return {"passed": not whys, "why": "; ".join(whys),
            "err": {k: v[1] for k, v in verdicts.items()},
            "limit": {k: v[2] for k, v in verdicts.items()}}


def run_case(case: Case, packages: dict, device="cuda") -> dict:
    """One case: the references, then each package; the row that is stored."""
    inputs = make_inputs(case, device)
    refs = {}
    for key, dtype in (("ref", torch.float64), ("same", DTYPES[case.dtype])):
        leaves = _fresh_leaves(inputs, torch.float64 if key == "ref" else None)
        targets = _leaves(leaves)
        out, lse = reference(leaves, case, dtype)
        grads = torch.autograd.grad(loss_of(out, lse, inputs, case), targets,
                                    allow_unused=True)
        grads = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, targets))
        refs[key] = (out.detach(), lse.detach(), grads)
    row = {"impl": "fa4_final", "metric": "conformance", "unit": "case",
           "case": {k: v for k, v in asdict(case).items() if k != "seed"}, "seed": case.seed,
           "grad_floor": grad_floor(refs["ref"][2])}
    if case.sink_dtype is not None:
        row["sink_step"] = sink_step(refs["ref"], inputs, case)
    for name, package in packages.items():
        t0 = time.perf_counter()
        try:
            result = call(package, inputs, case)
            if device != "cpu":
                torch.cuda.synchronize()
            row[name] = {"status": "ran", **judge(result, refs["ref"], refs["same"], case,
                                                  row.get("sink_step", 0.0))}
        except Exception as exc:  # a refusal or a failure: which one is the verdict's business
            kind = type(exc).__name__
            row[name] = {"status": "refused" if kind in CLEAN_ERRORS else "error",
                         "error": f"{kind}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
            if kind not in CLEAN_ERRORS:
                row[name]["trace"] = traceback.format_exc(limit=3)[-600:]
        row[name]["seconds"] = round(time.perf_counter() - t0, 3)
    row["verdict"] = verdict(row)
    row["value"] = int(row["verdict"] == "MISMATCH")
    return row


def verdict(row: dict) -> str:
    ours, theirs = row["fa4_final"], row.get("fa4", {"status": "absent"})
    if ours["status"] == "refused":
        return "refused"
    if ours["status"] != "ran" or not ours["passed"]:
        return "MISMATCH"
    return "agree" if theirs.get("status") == "ran" and theirs.get("passed") else "ok"


# ----------------------------------------------------------------------------------------------
# the run


def _worker(indices: list[int], n_cases: int, seed: int, queue,
            features: tuple[str, ...] = ()) -> None:
    import fa4_final

    packages = {"fa4_final": fa4_final}
    try:
        from flash_attn import cute as fa4

        packages["fa4"] = fa4
    except Exception as exc:  # the peer is optional: rows then say "absent"
        print(f"FA4 package not importable: {exc}", file=sys.stderr)
    cases = make_cases(n_cases, seed, features)
    for i in indices:
        row = run_case(cases[i], packages)
        queue.put(row)
        print(f"{row['verdict']:9s} {cases[i].describe()}"
              + (f"  [{row['fa4_final'].get('why') or row['fa4_final'].get('error', '')}]"
                 if row["verdict"] not in ("agree", "ok") else ""), flush=True)


def run(n_cases: int, seed: int, workers: int, deadline_s: float,
        features: tuple[str, ...] = ()) -> list[dict]:
    """Cases spread over ``workers`` processes (kernels compile in parallel); a case whose
    worker died or ran past the deadline is a MISMATCH row saying so."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(list(range(w, n_cases, workers)), n_cases, seed,
                                               queue, features)) for w in range(workers)]
    for p in procs:
        p.start()
    rows, start = {}, time.monotonic()
    while len(rows) < n_cases and time.monotonic() - start < deadline_s:
        try:
            row = queue.get(timeout=5)
            rows[row["case"]["index"]] = row
        except Exception:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=1)
        if p.is_alive():
            p.kill()
    cases = make_cases(n_cases, seed, features)
    for i in range(n_cases):
        if i not in rows:
            rows[i] = {"impl": "fa4_final", "metric": "conformance", "unit": "case", "value": 1,
                       "case": {k: v for k, v in asdict(cases[i]).items() if k != "seed"},
                       "seed": cases[i].seed, "verdict": "MISMATCH",
                       "fa4_final": {"status": "no result: the worker died or the run "
                                               "reached its deadline"}}
    return [rows[i] for i in range(n_cases)]


_WHY = re.compile(r"(?P<name>\w+): max err (?P<err>[0-9.e+-]+) > limit (?P<limit>[0-9.e+-]+)")


def case_of(row: dict) -> Case:
    c = dict(row["case"])
    c["window"] = tuple(c["window"])
    return Case(seed=row["seed"], **c)


def rejudge(rows: list[dict]) -> list[dict]:
    """Verdicts of stored rows under today's rule, from their stored errors: a row judged
    before the gradient floor (Note [Gradient floor]) gets its floor from the float64 reference
    recomputed on this machine (the inputs come from the case's seed), and a gradient that
    failed only by its error is judged again against limit + floor. NaN, infinities and empty
    rows stay as they were."""
    out = []
    for row in rows:
        row = json.loads(json.dumps(row))
        if "grad_floor" not in row:
            case = case_of(row)
            inputs = make_inputs(case, "cpu")
            q, k, v = (inputs[n].detach().clone().requires_grad_(True) for n in "qkv")
            o, lse = reference({**inputs, "q": q, "k": k, "v": v}, case, torch.float64)
            grads = torch.autograd.grad(loss_of(o, lse, inputs, case), (q, k, v),
                                        allow_unused=True)
            row["grad_floor"] = grad_floor([g for g in grads if g is not None])
        for name in ("fa4_final", "fa4"):
            res = row.get(name)
            if not res or res.get("status") != "ran" or res["passed"]:
                continue
            parts = [p.strip() for p in res["why"].split(";") if p.strip()]
            kept = []
            for part in parts:
                m = _WHY.fullmatch(part)
                if m and m.group("name") in ("dq", "dk", "dv") and \
                        float(m.group("err")) <= float(m.group("limit")) + row["grad_floor"]:
                    res["limit"][m.group("name")] = float(m.group("limit")) + row["grad_floor"]
                    continue
                kept.append(part)
            res["why"], res["passed"] = "; ".join(kept), not kept
        row["verdict"] = verdict(row)
        row["value"] = int(row["verdict"] == "MISMATCH")
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=240)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole run")
    ap.add_argument("--name", default=NAME)
    ap.add_argument("--dry-run", action="store_true", help="print the cases and stop")
    ap.add_argument("--features", default="",
                    help="comma-separated FA4 features every case also uses: softcap, "
                         "learnable_sink (FA4_FINAL_PENDING is set for those calls, harmless "
                         "where they are not pending)")
    ap.add_argument("--rejudge", action="store_true",
                    help="judge the stored rows again under today's rule (any machine)")
    args = ap.parse_args(argv)
    features = tuple(f.strip() for f in args.features.split(",") if f.strip())
    if args.rejudge:
        from utils import results

        res = results.load(args.name)
        rows = rejudge(res.rows)
        prov = dict(res.provenance)
        prov["command"] += (f" (verdicts judged again with --rejudge at commit "
                            f"{results.collect_provenance('')['commit'][:10]}: the gradient floor)")
        print(conformance_summary(rows))
        print(f"saved {results.save(args.name, rows, prov['command'], provenance=prov)}")
        return int(any(r["verdict"] == "MISMATCH" for r in rows))
    if args.dry_run:
        for c in make_cases(args.cases, args.seed, features):
            print(c.describe())
        return 0
    rows = run(args.cases, args.seed, args.workers, args.deadline, features)
    print(conformance_summary(rows))
    from utils import results

    command = "python -m measure.conformance " + " ".join(argv or sys.argv[1:])
    path = results.save(args.name, rows, command)
    print(f"saved {path}")
    return int(any(r["verdict"] == "MISMATCH" for r in rows))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
