"""The gate of pending features (fa4_final.runtime.pending, Note [Pending features]) and FA4's
softcap and learnable_sink wired through every layer, on a CPU.

- softcap and learnable_sink passed their GPU tests (tests/gpu/test_softcap_sinks_api.py on an
  H100, results/h100/gpu_checks.json) and left the gate: every entry (flash_attn_func,
  flash_attn_varlen_func, api.sdpa's _flash_attn_fwd/_flash_attn_bwd, the runtime's entry
  points) takes them without FA4_FINAL_PENDING, to the device check (a CPU tensor is refused
  there, for its device, not for the feature).
- The gate's mechanism, with a row put back (monkeypatch.setitem on PENDING): each feature
  refused by name on every entry, let through when FA4_FINAL_PENDING lists it, the variable
  read at each call and while torch.compile traces.
- Bad values are refused by name before the gate (a negative or NaN softcap, a sink of the
  wrong shape, dtype or device).
- The custom ops carry both (schemas, fake implementations, opcheck), torch.compile traces them
  in one graph, and autograd gives dq, dk, dv and d(learnable_sink) equal to float64 autograd,
  with the test-only CPU kernels (tests/fa4_cpu_reference.py) in place of the GPU kernels.
- The dispatch rows: Hopper puts the softcap and the sink's dtype into the compile key only when
  set; Blackwell refuses both by name.
Nothing here runs a GPU kernel (tests/gpu/test_softcap_sinks_api.py does).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fa4_final import UnsupportedError, flash_attn_func, flash_attn_varlen_func
from fa4_final.api import ops, sdpa
from fa4_final.common.backward import sink_gradient
from fa4_final.runtime import dispatch, pending, prologue, varlen
from tests import fa4_cpu_reference as ref
from tests.hopper_recorder import record_hopper_runs
from utils.reference import attention_reference_features

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
GATE = "does not run"  # the gate's words (runtime.pending.refuse_pending)
DEVICE = "runs on CUDA GPUs"  # the device check's (runtime.dispatch.backend_for)


pytestmark = pytest.mark.usefixtures("no_pending")


def dense(b=2, sq=24, sk=40, h=4, hk=2, d=64, dv=None, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    dims = ((sq, h, d), (sk, hk, d), (sk, hk, dv or d))
    return [(torch.randn(b, s, n, x, generator=g) * 1.5).to(BF16).requires_grad_(grad)
            for s, n, x in dims]


def packed(lens_q=(5, 0, 19), lens_k=(9, 4, 0), h=4, hk=2, d=64, dv=None, grad=False):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(BF16)
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(BF16)
    v = torch.randn(sum(lens_k), hk, dv or d, generator=g).to(BF16)
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
          for lens in (lens_q, lens_k)]
    return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad), *cu


def sink(h=4, dtype=F32, grad=False):
    return torch.tensor([-1.0, 0.5, 2.0, 3.5][:h] + [1.0] * max(0, h - 4),
                        dtype=dtype).requires_grad_(grad)


# ----------------------------------------------------------------------------------------------
# the gate, on every entry


def _entries(feature: str, value):
    """(name, call) of every entry point with ``feature`` set to ``value``."""
    q, k, v = dense()
    pq, pk, pv, cu_q, cu_k = packed()
    out, lse = torch.zeros_like(q), torch.zeros(2, 4, 24)
    kw = {feature: value}
    bwd_kw = {"softcap": value} if feature == "softcap" else {}
    yield "flash_attn_func", lambda: flash_attn_func(q, k, v, **kw)
    yield "flash_attn_varlen_func", lambda: flash_attn_varlen_func(
        pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    yield "_flash_attn_fwd", lambda: sdpa._flash_attn_fwd(q, k, v, **kw)
    yield "_flash_attn_fwd", lambda: sdpa._flash_attn_fwd(
        pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    yield "_flash_attn_bwd", lambda: sdpa._flash_attn_bwd(q, k, v, out, out, lse, **kw)
    yield "forward_into", lambda: prologue.forward_into(q, k, v, out, lse, **kw)
    yield "varlen_forward_into", lambda: varlen.varlen_forward_into(
        pq, pk, pv, cu_q, cu_k, None, None, None, torch.zeros_like(pq),
        torch.zeros(4, pq.shape[0]), **kw)
    if bwd_kw:
        yield "backward_into", lambda: prologue.backward_into(
            q, k, v, out, lse, out, torch.zeros_like(q), torch.zeros_like(k),
            torch.zeros_like(v), **bwd_kw)


FEATURES = [("softcap", 30.0), ("learnable_sink", sink())]


def put_back(monkeypatch, *names):
    """The deleted rows ``names`` back in PENDING for one test (the gate reads the table at each
    call): how the gate's mechanism stays tested now that no row of these features is left."""
    for name in names:
        monkeypatch.setitem(pending.PENDING, name, f"put back by the test: {name}")


@pytest.mark.parametrize("feature, value", FEATURES, ids=[f for f, _ in FEATURES])
def test_softcap_and_sink_passed_their_gpu_tests_and_every_entry_takes_them_ungated(feature,
                                                                                    value):
    """No row, no FA4_FINAL_PENDING: every entry goes on to the device check."""
    assert feature not in pending.PENDING and pending.listed(feature)
    for func, call in _entries(feature, value):
        with pytest.raises(UnsupportedError) as info:
            call()
        assert DEVICE in str(info.value) and GATE not in str(info.value), (func, info.value)


@pytest.mark.parametrize("feature, value", FEATURES, ids=[f for f, _ in FEATURES])
def test_the_gate_refuses_a_pending_feature_by_name_on_every_entry(monkeypatch, feature, value):
    """The mechanism, its row put back: refused by name, value and variable on every entry."""
    put_back(monkeypatch, feature)
    for func, call in _entries(feature, value):
        with pytest.raises(UnsupportedError) as info:
            call()
        message = str(info.value)
        shown = "30.0" if feature == "softcap" else "(4,)"
        assert func in message and f"FA4's {feature}=" in message and shown in message, message
        assert f"{GATE} {feature} yet" in message and pending.ENV in message, message


@pytest.mark.parametrize("feature, value", FEATURES, ids=[f for f, _ in FEATURES])
def test_listed_in_the_environment_a_feature_gets_past_the_gate(monkeypatch, feature, value):
    """A row put back and FA4_FINAL_PENDING naming it: every entry goes on to the device
    check, which refuses a CPU tensor for its device."""
    put_back(monkeypatch, feature)
    monkeypatch.setenv(pending.ENV, f"qv, {feature}")
    for func, call in _entries(feature, value):
        with pytest.raises(UnsupportedError) as info:
            call()
        assert DEVICE in str(info.value) and GATE not in str(info.value), (func, info.value)


def test_the_environment_is_read_at_each_call_and_names_one_feature(monkeypatch):
    put_back(monkeypatch, "softcap", "learnable_sink")
    q, k, v = dense()
    monkeypatch.setenv(pending.ENV, "softcap")
    with pytest.raises(UnsupportedError, match=DEVICE):
        flash_attn_func(q, k, v, softcap=5.0)
    with pytest.raises(UnsupportedError, match=f"{GATE} learnable_sink yet"):
        flash_attn_func(q, k, v, softcap=5.0, learnable_sink=sink())
    monkeypatch.setenv(pending.ENV, "")
    with pytest.raises(UnsupportedError, match=f"{GATE} softcap yet"):
        flash_attn_func(q, k, v, softcap=5.0)


def test_the_table_and_refuse_pending(monkeypatch):
    assert not set(pending.PENDING) & {"softcap", "learnable_sink"}
    assert all(isinstance(why, str) and why for why in pending.PENDING.values())
    pending.refuse_pending("f", "not_a_pending_feature", 1)  # never gated
    pending.refuse_pending("f", "softcap", 2.0)  # no row: not gated any more
    put_back(monkeypatch, "softcap")
    with pytest.raises(UnsupportedError, match=r"f: FA4's softcap=2\.0 is refused"):
        pending.refuse_pending("f", "softcap", 2.0)


@pytest.mark.parametrize("kw", [dict(softcap=0.0), dict(softcap=None), dict(learnable_sink=None)])
def test_the_neutral_values_pass_with_no_environment(cpu_kernels, kw):
    q, k, v = dense()
    flash_attn_func(q, k, v, **kw)
    sdpa_kw = {"softcap": kw["softcap"]} if "softcap" in kw else kw
    with pytest.raises(UnsupportedError, match=DEVICE):  # sdpa runs the runtime directly
        sdpa._flash_attn_fwd(q, k, v, **sdpa_kw)


# ----------------------------------------------------------------------------------------------
# bad values, named, before the gate


@pytest.mark.parametrize("value, error, words", [
    (-1.0, ValueError, re.escape("softcap must be 0.0 (no cap) or a finite number > 0, got "
                                 "-1.0")),
    (math.nan, ValueError, "got nan"),
    (math.inf, ValueError, "got inf"),
    ("30", TypeError, "softcap must be a Python float"),
    (True, TypeError, "got True"),
])
def test_a_bad_softcap_is_refused_by_name(value, error, words):
    q, k, v = dense()
    pq, pk, pv, cu_q, cu_k = packed()
    calls = [lambda: flash_attn_func(q, k, v, softcap=value),
             lambda: flash_attn_varlen_func(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                            softcap=value),
             lambda: sdpa._flash_attn_fwd(q, k, v, softcap=value)]
    for call in calls:
        with pytest.raises(error, match=words) as info:
            call()
        assert not isinstance(info.value, UnsupportedError)


@pytest.mark.parametrize("bad, error, words", [
    (torch.zeros(3), ValueError, r"shape \(4,\): one logit per query head .*got shape \(3,\)"),
    (torch.zeros(1, 4), ValueError, r"got shape \(1, 4\)"),
    (torch.zeros(4, dtype=torch.int32), TypeError, "dtype torch.int32; accepted: torch.float32"),
    (torch.zeros(4, dtype=F64), TypeError, "torch.float64"),
    (torch.zeros(4, device="meta"), ValueError, "on q's device cpu, got meta"),
    ([0.0] * 4, TypeError, "must be a torch.Tensor"),
])
def test_a_bad_sink_is_refused_by_name(bad, error, words):
    q, k, v = dense()
    pq, pk, pv, cu_q, cu_k = packed()
    calls = [lambda: flash_attn_func(q, k, v, learnable_sink=bad),
             lambda: flash_attn_varlen_func(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                            learnable_sink=bad),
             lambda: sdpa._flash_attn_fwd(q, k, v, learnable_sink=bad)]
    for call in calls:
        with pytest.raises(error, match=words) as info:
            call()
        assert "learnable_sink" in str(info.value) and GATE not in str(info.value)


@pytest.mark.parametrize("dtype", [F32, BF16, torch.float16])
def test_each_sink_dtype_fa4_takes_gets_past_its_checks(dtype):
    with pytest.raises(UnsupportedError, match=DEVICE):
        flash_attn_func(*dense(), learnable_sink=sink(dtype=dtype))


# ----------------------------------------------------------------------------------------------
# the custom ops: schemas, fake tensors, opcheck, torch.compile


def test_the_op_schemas_carry_both_with_their_off_defaults():
    for op, tail in ((ops.fwd, "float softcap=0., Tensor? learnable_sink=None)"),
                     (ops.varlen_fwd, "float softcap=0., Tensor? learnable_sink=None, "
                                      "Tensor? seqused_q=None)"),
                     (ops.bwd, "float softcap=0., Tensor? dlse=None)"),
                     (ops.varlen_bwd, "float softcap=0., Tensor? dlse=None, "
                                      "Tensor? seqused_q=None)")):
        schema = str(op._opoverload._schema)
        assert schema.split(" -> ")[0].endswith(tail), schema


def test_fake_shapes_with_softcap_and_sink():
    with FakeTensorMode():
        q = torch.empty(3, 1000, 8, 128, dtype=BF16, device="cuda")
        k = torch.empty(3, 777, 2, 128, dtype=BF16, device="cuda")
        s = torch.empty(8, dtype=F32, device="cuda")
        out, lse = ops.fwd(q, k, k, 0.1, True, -1, -1, False, True, 30.0, s)
        assert out.shape == q.shape and lse.shape == (3, 8, 1000) and lse.dtype == F32
        dq, dk, dv = ops.bwd(out, q, k, k, out, lse, 0.1, True, -1, -1, False, 30.0)
        assert dq.shape == q.shape and dk.shape == k.shape
        pq = torch.empty(1234, 8, 64, dtype=BF16, device="cuda")
        pk = torch.empty(999, 2, 64, dtype=BF16, device="cuda")
        cu = torch.empty(5, dtype=torch.int32, device="cuda")
        s16 = torch.empty(8, dtype=BF16, device="cuda")
        out, lse = ops.varlen_fwd(pq, pk, pk, cu, cu, None, -1, -1, 0.1, False, -1, -1, False,
                                  True, 5.0, s16)
        assert out.shape == pq.shape and lse.shape == (8, 1234)
        with pytest.raises(ValueError, match=r"learnable_sink must have shape \(8,\)"):
            ops.fwd(q, k, k, 0.1, True, -1, -1, False, True, 0.0, torch.empty(3, device="cuda"))
        with pytest.raises(ValueError, match="softcap must be 0.0"):
            ops.fwd(q, k, k, 0.1, True, -1, -1, False, True, -2.0, None)


def test_opcheck_with_softcap_and_sink(cpu_kernels):
    q, k, v = dense(grad=True)
    torch.library.opcheck(ops.fwd, (q, k, v, 0.125, True, None, 0, False, True, 5.0,
                                    sink(grad=True)))
    pq, pk, pv, cu_q, cu_k = packed(grad=True)
    torch.library.opcheck(ops.varlen_fwd, (pq, pk, pv, cu_q, cu_k, None, -1, -1, 0.125, False,
                                           None, None, False, False, 5.0, sink()))
    out, lse = ops.fwd(q.detach(), k.detach(), v.detach(), 0.125, False, None, None, False,
                       False, 5.0, None)
    torch.library.opcheck(ops.bwd, (torch.randn_like(out), q.detach(), k.detach(), v.detach(),
                                    out, lse, 0.125, False, None, None, False, 5.0))


def _float64(q, k, v, causal, softcap, s):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    s64 = None if s is None else s.detach().double().requires_grad_(True)
    out, lse = attention_reference_features(*leaves, causal, None, softcap, s64)
    return out, lse, leaves + ([s64] if s64 is not None else [])


@pytest.mark.parametrize("causal, softcap, with_sink, return_lse", [
    (True, 5.0, True, False), (False, 0.0, True, True), (True, 8.0, False, True),
    (False, 3.0, True, True)])
def test_autograd_through_the_ops_equals_float64(monkeypatch, cpu_kernels, causal, softcap,
                                                 with_sink, return_lse):
    """dq, dk, dv (the softcap backward) and d(learnable_sink) (sink_gradient, with dlse when
    the lse is returned and used) against float64 autograd; sq > sk with causal gives rows
    that see no key (out 0, lse = the sink)."""
    q, k, v = dense(sq=40, sk=24, grad=True)
    s = sink(grad=True) if with_sink else None
    out, lse = flash_attn_func(q, k, v, causal=causal, softcap=softcap, learnable_sink=s,
                               return_lse=return_lse)
    ref_out, ref_lse, leaves = _float64(q, k, v, causal, softcap, s)
    assert (out.double() - ref_out).abs().max() < 3e-2
    g = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=g)
    dlse = torch.randn(ref_lse.shape, generator=g)
    loss = (out.float() * dout).sum()
    ref_loss = (ref_out * dout.double()).sum()
    if return_lse:
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert (lse.double() - ref_lse)[finite].abs().max() < 1e-2
        loss = loss + (lse.where(finite, 0.0) * dlse).sum()
        ref_loss = ref_loss + (ref_lse.where(finite, 0.0) * dlse.double()).sum()
    else:
        assert not lse.requires_grad  # returned detached: its gradient is not asked for
    grads = torch.autograd.grad(loss, [q, k, v] + ([s] if with_sink else []))
    want = torch.autograd.grad(ref_loss, leaves)
    for name, got, ref_grad in zip(("dq", "dk", "dv", "dsink"), grads, want):
        err = (got.double() - ref_grad).abs().max() / ref_grad.abs().max().clamp(min=1)
        assert err < 3e-2, (name, float(err))
    if with_sink:
        assert grads[3].dtype == s.dtype and grads[3].shape == s.shape


def test_the_sink_gradient_is_skipped_when_the_sink_needs_none(monkeypatch, cpu_kernels):
    q, k, v = dense(grad=True)
    s = sink()  # requires no grad
    out, _ = flash_attn_func(q, k, v, learnable_sink=s)
    out.float().sum().backward()
    assert s.grad is None and q.grad is not None


def test_varlen_autograd_with_softcap_and_sink(monkeypatch, cpu_kernels):
    pq, pk, pv, cu_q, cu_k = packed(lens_q=(5, 7, 19), lens_k=(9, 0, 30), grad=True)
    s = sink(grad=True)
    out, lse = flash_attn_varlen_func(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      softcap=5.0, learnable_sink=s, causal=True,
                                      return_lse=True)
    assert torch.equal(lse[:, 5:12], s.detach().view(4, 1).expand(4, 7))  # no key: lse = sink
    assert torch.equal(out[5:12].float(), torch.zeros(7, 4, 64))
    out.float().sum().backward()
    q0, k0 = 12, 9  # the third sequence, against float64 on its own
    ref_out, _, leaves = _float64(pq[None, q0:], pk[None, k0:], pv[None, k0:], True, 5.0, s)
    assert (out[None, q0:].double() - ref_out).abs().max() < 3e-2
    want_q = torch.autograd.grad(ref_out.sum(), leaves[0])[0]
    assert (pq.grad[None, q0:].double() - want_q).abs().max() < 3e-2
    assert s.grad is not None and s.grad.shape == (4,)


class GraphCounter:
    def __init__(self):
        self.graphs, self.fa4_nodes = 0, []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.fa4_nodes += [str(n.target) for n in gm.graph.nodes if "fa4_final" in str(n.target)]
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def test_compile_fullgraph_with_softcap_and_sink(monkeypatch, cpu_kernels):
    """One graph with the forward op in it; outputs and gradients (the sink's included) equal
    the eager call's."""
    torch._dynamo.reset()

    def layer(q, k, v, s):
        out, lse = flash_attn_func(q, k, v, causal=True, softcap=5.0, learnable_sink=s,
                                   return_lse=True)
        return out.float().square().mean() + lse.where(lse.isfinite(), 0.0).mean()

    counter = GraphCounter()
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    q, k, v = dense(grad=True)
    s = sink(grad=True)
    loss = compiled(q, k, v, s)
    grads = torch.autograd.grad(loss, [q, k, v, s])
    eager_loss = layer(q, k, v, s)
    eager_grads = torch.autograd.grad(eager_loss, [q, k, v, s])
    assert counter.graphs == 1 and any("fa4_final.fwd" in n for n in counter.fa4_nodes)
    torch.testing.assert_close(loss, eager_loss)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want)


def test_compile_traces_the_gate(monkeypatch, cpu_kernels):
    """Under torch.compile a pending row still refuses (the table and the environment are read
    while tracing); with no row the same call compiles and runs."""
    put_back(monkeypatch, "softcap")
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, softcap=5.0)[0],
                             fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=f"{GATE} softcap yet"):
        compiled(*dense())
    monkeypatch.delitem(pending.PENDING, "softcap")
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, softcap=5.0)[0],
                             fullgraph=True, backend="eager")
    assert compiled(*dense()).shape == (2, 24, 4, 64)


# ----------------------------------------------------------------------------------------------
# runtime: empty rows, sdpa's backward, the dispatch rows and their compile keys


def test_rows_with_no_key_get_the_sink_as_lse():
    q = torch.zeros(2, 3, 4, 64, dtype=BF16)
    k = torch.zeros(2, 0, 2, 64, dtype=BF16)
    out = torch.full_like(q, math.nan)
    lse = torch.full((2, 4, 3), math.nan)
    s = sink(dtype=BF16)
    prologue.forward_prepared(None, q, k, k, out, lse, False, 0.125, None, None,
                              learnable_sink=s)
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.equal(lse, s.float().view(1, 4, 1).expand(2, 4, 3))
    prologue.forward_prepared(None, q, k, k, out, lse, False, 0.125, None, None)
    assert bool(torch.isneginf(lse).all())
    packed_lse = torch.empty(4, 7)
    prologue.fill_empty_rows(torch.empty(7, 4, 64), packed_lse, s, heads_dim=0)
    assert torch.equal(packed_lse, s.float().view(4, 1).expand(4, 7))


def test_sdpa_backward_returns_dsink_as_fa4(monkeypatch):
    """With a sink, _flash_attn_bwd returns (dq, dk, dv, dsink), dsink from sink_gradient in
    the sink's dtype (dlse included); the kernels' part is stubbed (no GPU here)."""
    seen = {}

    def fake_backward(q, k, v, out, lse, dout, dq, dk, dv, causal, scale, window,
                      deterministic, softcap=0.0, dlse=None):
        seen["softcap"] = softcap
        seen.setdefault("dlse", []).append(dlse)  # lse_fold: the one call takes it
        for t in (dq, dk, dv):
            t.zero_()

    monkeypatch.setattr(sdpa, "backward_into", fake_backward)
    q, k, v = dense()
    g = torch.Generator().manual_seed(3)
    out = torch.randn(q.shape, generator=g).to(BF16)
    dout = torch.randn(q.shape, generator=g).to(BF16)
    lse = torch.randn(2, 4, 24, generator=g) + 3
    dlse = torch.randn(2, 4, 24, generator=g)
    s = sink(dtype=BF16)
    grads = sdpa._flash_attn_bwd(q, k, v, out, dout, lse, softcap=5.0, learnable_sink=s,
                                 dlse=dlse)
    assert len(grads) == 4 and seen["softcap"] == 5.0
    assert len(seen["dlse"]) == 1 and torch.equal(seen["dlse"][0], dlse)
    torch.testing.assert_close(grads[3], sink_gradient(s, lse, out, dout, dlse))
    assert grads[3].dtype == BF16
    assert len(sdpa._flash_attn_bwd(q, k, v, out, dout, lse, softcap=5.0)) == 3
    assert seen["dlse"][1:] == [None]


def test_hopper_puts_softcap_and_sink_dtype_in_the_compile_key_only_when_set(monkeypatch):
    calls = record_hopper_runs(monkeypatch)
    runners = dispatch.runners(dispatch.HOPPER.host, dispatch.HOPPER.features)
    q, k, v = dense()
    out, lse = torch.empty_like(q), torch.empty(2, 4, 24)
    s = sink(dtype=BF16)[::1]
    runners["forward"](q, k, v, out, lse, True, 0.125, None, 0)
    runners["forward"](q, k, v, out, lse, True, 0.125, None, 0, None, softcap=5.0,
                       learnable_sink=s)
    runners["forward"](q, k, v, out, lse, True, 0.125, None, 0, None, learnable_sink=s)
    runners["backward"](q, k, v, out, lse, out, q, k, v, True, 0.125, None, 0, False, None,
                        softcap=5.0)
    runners["varlen_forward"](q[0], k[0], v[0], None, None, None, 24, 40, out[0], lse[0], False,
                              0.125, None, None, None, softcap=2.0, learnable_sink=s)
    keys = [c[2] for c in calls if c[0] == "compiled"]
    assert keys[0] == (64, "bf16", True, None, False, False, False, False)  # unchanged default
    assert keys[1] == (64, "bf16", True, None, False, False, False, False, "sm_90a", 5.0, "bf16")
    assert keys[2] == (64, "bf16", True, None, False, False, False, False, "sm_90a", 0.0, "bf16")
    assert keys[3] == (64, "bf16", True, None, False, False, False, False, False, "sm_90a", 5.0)
    assert keys[4][-3:] == ("sm_90a", 2.0, "bf16") and keys[4][6] is True
    launches = [c for c in calls if c[0] != "compiled"]
    assert len(launches[0][1]) == 10 and launches[1][1][-1] is s  # the sink, last
    assert launches[4][1][-1] is s
    # the recorded arguments, given to the real recipes, build the variants they name
    import cutlass

    from fa4_final.hopper import host

    main = host.forward_recipe(*keys[1]).kernels["main"]
    assert main.logit_softcap == 5.0 and main.sink_dtype is cutlass.BFloat16
    assert host.forward_recipe(*keys[0]).kernels["main"].has_sink is False
    assert host.backward_recipe(*keys[3]).kernels["main"].logit_softcap == 5.0
    varlen_main = host.forward_recipe(*keys[4]).kernels["main"]
    assert varlen_main.varlen and varlen_main.logit_softcap == 2.0 and varlen_main.has_sink


@pytest.mark.parametrize("dtype,name", [(F32, "fp32"), (torch.float16, "fp16"), (BF16, "bf16")])
def test_each_sink_dtype_names_its_build(monkeypatch, dtype, name):
    """A float32 sink (FA4 takes float32, bf16 and fp16 sinks with bf16 q) keys the fp32 build:
    the dtype name comes from SINK_DTYPE_NAMES, not q's DTYPE_NAMES."""
    calls = record_hopper_runs(monkeypatch)
    runners = dispatch.runners(dispatch.HOPPER.host, dispatch.HOPPER.features)
    q, k, v = dense()
    out, lse = torch.empty_like(q), torch.empty(2, 4, 24)
    runners["forward"](q, k, v, out, lse, True, 0.125, None, 0, None,
                       learnable_sink=sink(dtype=dtype))
    keys = [c[2] for c in calls if c[0] == "compiled"]
    assert keys[0][-1] == name


def test_the_recipes_cache_keys_hold_the_softcap_and_the_sink_dtype():
    from fa4_final.hopper.host import backward_recipe, forward_recipe

    def key(**kw):
        return forward_recipe(128, "bf16", True, **kw).kernels["main"].cache_key()

    plain, capped, sunk = key(), key(softcap=5.0), key(sink_dtype="fp32")
    assert len({plain, capped, sunk, key(softcap=30.0), key(sink_dtype="bf16")}) == 5
    bwd = [backward_recipe(128, "bf16", True, softcap=c).kernels["main"].cache_key()
           for c in (0.0, 5.0)]
    assert bwd[0] != bwd[1]


def test_blackwell_refuses_both_by_name():
    row = dispatch.wired(dispatch.BLACKWELL)
    assert row.features == ()
    assert dispatch.HOPPER.features[:3] == ("softcap", "learnable_sink", "lse_fold")
    with pytest.raises(UnsupportedError, match=r"softcap=5.0: the sm_100a kernels have no "
                                               r"softcap variant; .*Hopper"):
        row.forward(None, None, None, None, None, False, 0.1, None, None, None, softcap=5.0)
    with pytest.raises(UnsupportedError, match="no learnable_sink variant"):
        row.forward(None, None, None, None, None, False, 0.1, None, None, None,
                    learnable_sink=sink())
    with pytest.raises(UnsupportedError, match="no softcap variant"):
        row.backward(None, None, None, None, None, None, None, None, None, False, 0.1, None,
                     None, False, None, softcap=1.0)
    with pytest.raises(UnsupportedError, match="Blackwell"):  # the unwired row itself
        dispatch.BLACKWELL.forward(softcap=5.0)


# ----------------------------------------------------------------------------------------------
# the eager path (Note [The eager path] in api.ops) with both: the same numbers as the ops


class RefBackend:
    """The Hopper row computed by the CPU reference, recording the feature keywords."""

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, out, lse, causal, scale, left, right, config, softcap=0.0,
                learnable_sink=None):
        self.calls.append(("forward", softcap, learnable_sink is not None))
        o, s = ref.dense_forward(q, k, v, scale, causal, left, right, softcap, learnable_sink)
        out.copy_(o)
        lse.copy_(s)

    def backward(self, q, k, v, out, lse, dout, dq, dk, dv, causal, scale, left, right, det,
                 config=None, softcap=0.0, dlse=None):
        self.calls.append(("backward", softcap, dlse is not None))
        for t, g in zip((dq, dk, dv), ref.dense_backward(dout, q, k, v, out, lse, scale, causal,
                                                         left, right, softcap, dlse)):
            t.copy_(g)


@pytest.mark.parametrize("kw", [dict(softcap=5.0), dict(learnable_sink=True),
                                dict(softcap=3.0, learnable_sink=True, return_lse=True,
                                     causal=True)])
def test_eager_path_matches_the_ops(monkeypatch, cpu_kernels, kw):
    from dataclasses import replace

    rec = RefBackend()
    backend = replace(dispatch.BACKENDS[0], forward=rec.forward, backward=rec.backward)
    monkeypatch.setattr(prologue, "backend_for", lambda device: backend)
    monkeypatch.setattr(prologue, "_BACKENDS", {})

    def run():
        q, k, v = dense(sq=40, sk=24, grad=True)
        s = sink(grad=True) if kw.get("learnable_sink") else None
        call = {**kw, "learnable_sink": s}
        out, lse = flash_attn_func(q, k, v, **call)
        loss = out.float().square().sum()
        if kw.get("return_lse"):
            loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).sum()
        leaves = [q, k, v] + ([s] if s is not None else [])
        return (out, lse, *torch.autograd.grad(loss, leaves))

    monkeypatch.setattr(ops, "EAGER_DEVICE_TYPES", ("cuda", "cpu"))
    eager = run()
    cap = kw.get("softcap", 0.0)
    # one backward call, given the lse's gradient when the loss uses the lse (lse_fold)
    assert rec.calls == [("forward", cap, "learnable_sink" in kw),
                         ("backward", cap, "return_lse" in kw)]
    monkeypatch.setattr(ops, "EAGER_DEVICE_TYPES", ("cuda",))
    calls = len(rec.calls)
    via_ops = run()
    assert len(rec.calls) == calls  # the ops ran their CPU kernels, not the backend
    for a, b in zip(eager, via_ops):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# measure.conformance --features: cases with both, the gate opened for fa4_final's calls


def test_conformance_feature_cases_pass_on_the_cpu_reference_and_catch_a_dropped_sink(
        cpu_kernels):
    """fa4_final's API (its CPU kernels: the test-only reference) on small --features cases:
    the driver still sets FA4_FINAL_PENDING around the call (harmless since both left the gate),
    and every case agrees with the float64 reference (dsink judged too); a package that drops
    the sink is a MISMATCH."""
    import types

    import fa4_final
    from measure import conformance as conf

    cases = [c for c in conf.make_cases(60, 0, ("softcap", "learnable_sink"))
             if max(c.lens_q + c.lens_k) <= 260 and len(c.lens_q) <= 3][:6]
    assert {c.features() for c in cases} >= {("softcap", "learnable_sink"), ("softcap",)}
    assert pending.ENV not in __import__("os").environ
    for case in cases:
        row = conf.run_case(case, {"fa4_final": fa4_final}, device="cpu")
        assert row["verdict"] == "ok", (case.describe(), row["fa4_final"])
        if case.sink_dtype:
            assert "dsink" in row["fa4_final"]["err"]

    def drop_sink(fn):
        def call(*args, learnable_sink=None, **kw):
            return fn(*args, **kw)
        return call

    dropped = types.SimpleNamespace(
        __name__="fa4_final", flash_attn_func=drop_sink(fa4_final.flash_attn_func),
        flash_attn_varlen_func=drop_sink(fa4_final.flash_attn_varlen_func))
    sunk = next(c for c in cases if c.sink_dtype and sum(c.lens_q) and sum(c.lens_k))
    row = conf.run_case(sunk, {"fa4_final": dropped}, device="cpu")
    assert row["verdict"] == "MISMATCH", row["fa4_final"]


def test_conformance_default_cases_are_unchanged_by_the_features_option():
    from measure import conformance as conf

    plain = conf.make_cases(40, 0)
    assert all(c.softcap == 0.0 and c.sink_dtype is None for c in plain)
    assert all("softcap" not in c.describe() for c in plain)
    with pytest.raises(ValueError, match="--features takes softcap, learnable_sink"):
        conf.make_cases(4, 0, ("qv",))
    only_sink = conf.make_cases(12, 0, ("learnable_sink",))
    assert all(c.sink_dtype and not c.softcap for c in only_sink)
