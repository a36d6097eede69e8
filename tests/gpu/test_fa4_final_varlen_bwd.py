"""The varlen backward kernels (one launch each of pre, main, post over the packed batch) on an
H100/H200 against float64 torch.autograd, sequence by sequence.

Awkward packed batches: lengths 0 and 1, odd lengths and exact tile multiples, seqlen_q !=
seqlen_k both ways (rows that see no key), GQA and MQA, causal, windows, seqused_k (the unused
key rows hold large finite values: a leak shows), more than 32 sequences (the lookup's second
warp step). out and lse come from the float64 reference rounded as a forward stores them, so
the backward is checked alone. dq, dk, dv are NaN-filled before each run (an element no kernel
writes fails) and sit inside larger buffers whose guard rows must keep their sentinel (nothing
written outside the packed tensors). The error rule is the dense backward's (2 x PyTorch's own
error in the input dtype + the rounding slack), per sequence and tensor, plus what the stored
out's rounding moves dq and dk by through delta (_stored_out_slack: computed exactly, it matters
where a row sees very few keys); NaN never passes.
Then: the deterministic mode is bitwise repeatable and bitwise the per-sequence loop
(varlen.backward_loop), the non-deterministic kernel agrees with the loop within the rule, and
the API's autograd (torch.ops.fa4_final.varlen_bwd) runs exactly this kernel. Run with a
timeout (a broken barrier protocol hangs rather than fails):
    timeout 900 python -m pytest -q -m gpu tests/gpu/test_fa4_final_varlen_bwd.py -k varlen
"""

import math
import os

import pytest
import torch

from fa4_final import flash_attn_varlen_func
from fa4_final.runtime import varlen
from tests.gpu.test_fa4_final_bwd import _attention, _grads, _visible
from utils.checks import poison_, rounding_atol
from utils.hardware import missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]

BF16, FP16 = torch.bfloat16, torch.float16
DEVICE = "cuda"  # tests/test_fa4_final_varlen_bwd.py runs these checks on a CPU stand-in
GUARD = 131  # rows of sentinel before and after each gradient buffer
SENTINEL = 7.0
UNUSED_KV = 50.0  # what key and value rows past seqused_k hold

LENS_Q = [300, 0, 129, 1, 1024, 77, 0, 1, 128, 513, 64, 5]
LENS_K = [300, 50, 0, 200, 1500, 77, 0, 1, 64, 1000, 64, 130]  # sq != sk both ways; empties
USED_K = [300, 50, 0, 150, 1400, 3, 0, 1, 64, 999, 1, 129]
SKEWED_Q = [1, 700, 3, 0, 129, 256, 40]  # causal with sq > sk: rows that see no key
SKEWED_K = [500, 2, 0, 9, 129, 256, 1]


def _many(n, seed, longest=300):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, longest, (n,), generator=g)
    lens[::7], lens[3::11] = 0, 1
    return lens.tolist()


MANY_Q, MANY_K = _many(70, 1), _many(70, 2)

CASES = {  # name: (lens_q, lens_k, used_k, h, hk, d, dtype, causal, window)
    "mixed-gqa-d128": (LENS_Q, LENS_K, None, 8, 2, 128, BF16, False, (None, None)),
    "mixed-causal-used": (LENS_Q, LENS_K, USED_K, 8, 2, 128, BF16, True, (None, None)),
    "mixed-mqa-window-d64-fp16": (LENS_Q, LENS_K, None, 4, 1, 64, FP16, False, (100, 20)),
    "mixed-right-window-used": (LENS_Q, LENS_K, USED_K, 4, 2, 128, BF16, False, (None, 5)),
    "many-causal-d64": (MANY_Q, MANY_K, None, 4, 4, 64, BF16, True, (None, None)),
    "skewed-causal": (SKEWED_Q, SKEWED_K, None, 4, 2, 128, BF16, True, (None, None)),
}


def _rand(*shape, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)


def _stored_out_slack(q, k, dout, out64, out_stored, visible, scale):
    """(dq, dk, dv) slack for the stored out: the backward's delta = rowsum(dO * out) uses out
    as the forward stored it (bf16/fp16), the float64 yardstick the exact one; the difference
    moves dS by P * (delta_stored - delta_exact), hence dq and dk by exactly this much, in
    float64 (dv does not use delta). Large where few keys make dS small, e.g. sq >> sk."""
    h, hk = q.shape[2], k.shape[2]
    qd = q.double().transpose(1, 2)  # (1, h, sq, d)
    kd = k.double().transpose(1, 2).repeat_interleave(h // hk, 1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0)[..., None])
    moved = (dout.double() * (out_stored.double() - out64.double())).sum(-1)  # (1, sq, h)
    ds = p * moved.transpose(1, 2)[..., None]
    dq = scale * (ds @ kd)
    dk = (scale * (ds.transpose(-1, -2) @ qd)).reshape(1, hk, h // hk, k.shape[1], -1).sum(2)
    return dq.abs().max().item(), dk.abs().max().item(), 0.0


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)


class Problem:
    """A packed batch, its float64 forward (out, lse as a forward stores them) and the
    per-sequence reference gradients (float64 and PyTorch in the input dtype)."""

    def __init__(self, case, seed=0, dv=None):
        """``dv``: v's (and out's, dout's) head dim when it differs from q's."""
        lens_q, lens_k, used, h, hk, d, dtype, causal, window = case
        dv = d if dv is None else dv
        self.lens_q, self.lens_k, self.used = lens_q, lens_k, used
        self.used_k = used if used is not None else lens_k
        self.causal, self.window, self.dtype = causal, window, dtype
        self.scale = d**-0.5
        tq, tk = sum(lens_q), sum(lens_k)
        self.q = _rand(tq, h, d, dtype=dtype, seed=seed)
        self.k = _rand(tk, hk, d, dtype=dtype, seed=seed + 1)
        self.v = _rand(tk, hk, dv, dtype=dtype, seed=seed + 2)
        self.dout = _rand(tq, h, dv, dtype=dtype, seed=seed + 3)
        self.cu_q, self.cu_k = _cu(lens_q), _cu(lens_k)
        self.seqused_k = None if used is None else torch.tensor(used, dtype=torch.int32,
                                                                device=DEVICE)
        cq, ck = self.cu_q.tolist(), self.cu_k.tolist()
        self.rows = [slice(cq[i], cq[i + 1]) for i in range(len(lens_q))]
        self.keys = [slice(ck[i], ck[i] + self.used_k[i]) for i in range(len(lens_q))]
        for i in range(len(lens_k)):  # KV cache rows past seqused_k: finite, but loud
            self.k[ck[i] + self.used_k[i]:ck[i + 1]] = UNUSED_KV
            self.v[ck[i] + self.used_k[i]:ck[i + 1]] = -UNUSED_KV
        self.out = torch.zeros_like(self.dout)
        self.lse = torch.full((h, tq), -math.inf, device=DEVICE)
        self.ref, self.same, self.slack = [], [], []  # per sequence: (dq, dk, dv) or None
        for i in range(len(lens_q)):
            nq, nk = lens_q[i], self.used_k[i]
            if nq == 0 or nk == 0:
                self.ref.append(None)
                self.same.append(None)
                self.slack.append(None)
                continue
            one = [t[None, s] for t, s in ((self.q, self.rows[i]), (self.k, self.keys[i]),
                                           (self.v, self.keys[i]))]
            visible = _visible(nq, nk, causal, *window, DEVICE)
            o, lse = _attention(*one, visible, self.scale, torch.float64)
            self.out[self.rows[i]] = o[0].to(dtype)
            self.lse[:, self.rows[i]] = lse[0].float()
            dout = self.dout[None, self.rows[i]]
            self.ref.append(_grads(*one, dout, visible, self.scale, torch.float64))
            self.same.append(_grads(*one, dout, visible, self.scale, dtype))
            self.slack.append(_stored_out_slack(*one[:2], dout, o, o.to(dtype), visible,
                                                self.scale))

    def buffers(self):
        """NaN-filled dq, dk, dv inside guarded buffers: (dq, dk, dv), (their buffers)."""
        grads, bufs = [], []
        for like in (self.q, self.k, self.v):
            buf = torch.full((GUARD + like.shape[0] + GUARD, *like.shape[1:]), SENTINEL,
                             dtype=like.dtype, device=DEVICE)
            grads.append(poison_(buf[GUARD:GUARD + like.shape[0]]))
            bufs.append(buf)
        return grads, bufs

    def run(self, deterministic=False):
        """The varlen backward kernels into fresh guarded, poisoned buffers."""
        (dq, dk, dv), bufs = self.buffers()
        varlen.varlen_backward_into(self.q, self.k, self.v, self.out, self.lse, self.dout, dq,
                                    dk, dv, self.cu_q, self.cu_k, self.seqused_k,
                                    max(self.lens_q), max(self.used_k), causal=self.causal,
                                    window_size=self.window, deterministic=deterministic)
        _sync()
        for name, buf in zip(("dq", "dk", "dv"), bufs):
            assert torch.all(buf[:GUARD] == SENTINEL) and torch.all(buf[-GUARD:] == SENTINEL), \
                f"{name}: a kernel wrote outside the packed tensor"
        return dq, dk, dv

    def check(self, grads, label=""):
        """Every sequence's gradients against float64 (the rule of the module docstring);
        exact zeros where nothing is seen; no NaN anywhere."""
        for name, g in zip(("dq", "dk", "dv"), grads):
            assert not g.isnan().any(), f"{label} {name}: NaN (an element nobody wrote?)"
        ck = self.cu_k.tolist()
        for i in range(len(self.lens_q)):
            spans = (self.rows[i], self.keys[i], self.keys[i])
            unused = slice(ck[i] + self.used_k[i], ck[i + 1])
            for g in grads[1:]:
                assert torch.all(g[unused] == 0), f"{label} seq {i}: keys past seqused_k"
            if self.ref[i] is None:
                for g, s in zip(grads, spans):
                    assert torch.all(g[s] == 0), f"{label} seq {i}: gradient of nothing seen"
                continue
            for name, g, r, sp, s, slack in zip(("dq", "dk", "dv"), grads, self.ref[i],
                                                self.same[i], spans, self.slack[i]):
                limit = (2 * (sp.double() - r).abs().max().item()
                         + rounding_atol(r, self.dtype) + slack + 1e-4)
                err = (g[s][None].double() - r).abs().max().item()
                assert err <= limit, (f"{label} seq {i} (sq={self.lens_q[i]}, sk="
                                      f"{self.used_k[i]}) {name}: max|err| {err:.2e} > "
                                      f"limit {limit:.2e}")

    def loop(self, deterministic=False):
        grads = varlen.backward_loop(self.q, self.k, self.v, self.out, self.lse, self.dout,
                                     self.cu_q, self.cu_k, self.seqused_k, causal=self.causal,
                                     window_size=self.window, deterministic=deterministic)
        _sync()
        return grads


@pytest.fixture(scope="module")
def problems():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Problem(CASES[name])
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_varlen_backward_kernel_against_float64(problems, name):
    p = problems(name)
    p.check(p.run(), name)


@pytest.mark.parametrize("name", ["mixed-gqa-d128", "mixed-causal-used", "skewed-causal"])
def test_varlen_backward_deterministic_is_bitwise_repeatable_and_the_loop(problems, name):
    p = problems(name)
    runs = [p.run(deterministic=True) for _ in range(3)]
    p.check(runs[0], f"{name} deterministic")
    for later in runs[1:]:
        for g, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, b), f"{name} {g}: deterministic runs differ"
    # same arithmetic in the same order as the dense kernel on each sequence alone: the rows a
    # varlen tile reads past its sequence add exact zeros (P = 0)
    for g, a, b in zip(("dq", "dk", "dv"), runs[0], p.loop(deterministic=True)):
        assert torch.equal(a, b), (f"{name} {g}: deterministic kernel != loop, max|diff| "
                                   f"{(a.float() - b.float()).abs().max().item():.2e}")


def test_varlen_backward_deterministic_on_long_sequences():
    """Many key tiles per sequence and GQA: many CTAs add into each dQ tile, in turn."""
    for causal in (False, True):
        p = Problem(([1500, 700, 1, 2048, 333], [1500, 900, 1, 2048, 200], None, 8, 2, 128,
                     BF16, causal, (None, None)), seed=10)
        runs = [p.run(deterministic=True) for _ in range(3)]
        p.check(runs[0], f"long causal={causal}")
        for later in runs[1:]:
            for a, b in zip(runs[0], later):
                assert torch.equal(a, b), f"causal={causal}: deterministic runs differ"


@pytest.mark.parametrize("name", ["mixed-gqa-d128", "mixed-causal-used"])
def test_varlen_backward_kernel_agrees_with_the_loop(problems, name):
    p = problems(name)
    got, want = p.run(), p.loop()
    p.check(want, f"{name} loop")
    for g, a, b, in zip(("dq", "dk", "dv"), got, want):
        ref = torch.cat([r[("dq", "dk", "dv").index(g)][0].flatten() for r in p.ref if r])
        slack = 4 * rounding_atol(ref, p.dtype) + 1e-3
        diff = (a.float() - b.float()).abs().max().item()
        assert diff <= slack, f"{name} {g}: max|kernel - loop| {diff:.2e} > {slack:.2e}"


def test_varlen_backward_through_the_api_is_the_kernel():
    """flash_attn_varlen_func's autograd (the custom op fa4_final::varlen_bwd) gives bitwise
    what varlen_backward_into gives on the forward's own out and lse (deterministic), with the
    value checks on and off."""
    lens_q, lens_k = [300, 0, 129, 1, 513], [250, 7, 0, 1, 700]
    h, hk, d = 8, 2, 128
    q = _rand(sum(lens_q), h, d, dtype=BF16, seed=20).requires_grad_(True)
    k = _rand(sum(lens_k), hk, d, dtype=BF16, seed=21).requires_grad_(True)
    v = _rand(sum(lens_k), hk, d, dtype=BF16, seed=22).requires_grad_(True)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    dout = _rand(*q.shape, dtype=BF16, seed=23)
    before = os.environ.get("FA4_FINAL_VARLEN_CHECKS")
    try:
        for checks in ("1", "0"):
            os.environ["FA4_FINAL_VARLEN_CHECKS"] = checks
            out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                              max_seqlen_q=max(lens_q),
                                              max_seqlen_k=max(lens_k),
                                              causal=True, deterministic=True,
                                              return_lse=True)
            got = torch.autograd.grad(out, (q, k, v), dout)
            want = [poison_(torch.empty_like(t)) for t in (q, k, v)]
            varlen.varlen_backward_into(q.detach(), k.detach(), v.detach(), out.detach(),
                                        lse.detach(), dout, *want, cu_q, cu_k, None,
                                        max(lens_q), max(lens_k), causal=True,
                                        deterministic=True)
            _sync()
            for name, a, b in zip(("dq", "dk", "dv"), got, want):
                assert not a.isnan().any(), name
                assert torch.equal(a, b), f"checks={checks} {name}"
    finally:
        if before is None:
            os.environ.pop("FA4_FINAL_VARLEN_CHECKS", None)
        else:
            os.environ["FA4_FINAL_VARLEN_CHECKS"] = before


def test_varlen_backward_degenerate_batches():
    """No query row at all, no key at all, and every sequence empty: zeros, no launch fails."""
    h, d = 4, 64
    for lens_q, lens_k in (([0, 0], [5, 3]), ([4, 2], [0, 0]), ([0, 0, 0], [0, 0, 0])):
        q = _rand(sum(lens_q), h, d, dtype=BF16, seed=30)
        k, v = (_rand(sum(lens_k), h, d, dtype=BF16, seed=s) for s in (31, 32))
        out, dout = torch.zeros_like(q), _rand(*q.shape, dtype=BF16, seed=33)
        lse = torch.full((h, q.shape[0]), -math.inf, device=DEVICE)
        grads = [poison_(torch.empty_like(t)) for t in (q, k, v)]
        varlen.varlen_backward_into(q, k, v, out, lse, dout, *grads, _cu(lens_q), _cu(lens_k),
                                    None, None, None, causal=True)
        _sync()
        for g in grads:
            assert torch.all(g == 0), (lens_q, lens_k)
