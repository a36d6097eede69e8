"""Five features wired through fa4_final's API that have left the gate of
fa4_final.runtime.pending (Note [Pending features]: their GPU tests passed, their rows were
deleted), on a CPU:

- lse_fold: the autograd backward of a call that returns the lse and uses it makes ONE backward
  call that takes dlse (the has_dlse builds, Note [The lse gradient folded]), by default, in
  place of Note [Gradient of the returned lse]'s second call; that probe's path, still kept for
  a pending lse_fold, is reached here by putting the row back (``_lse_fold_row``) and gives the
  same gradients (both against float64). A dlse given to a runtime entry point is checked
  (named when bad), then runs (a CPU call stops at the device check); the Hopper row puts
  has_dlse in the compile key only when a dlse is given, the Blackwell row refuses it by name.
- head_dims: D and dv each from FWD_HEAD_DIMS, out (.., dv), taken by every forward entry and
  the ops' fake impls without FA4_FINAL_PENDING; a call that will need a gradient where no
  backward is built (outside runtime.pending.BACKWARD_HEAD_DIMS) is refused at the forward,
  gate or no gate; head_dim_v in the compile key only when != D.
- bwd_head_dims: the Hopper backward at D = dv = 96, (192, 128) and D = dv = 192 and 256 left
  the gate after tests/gpu/test_bwd_head_dims.py passed on an H100 with racecheck clean there
  and synccheck on an H200 (results/h100/gpu_checks.json, results/h200/gpu_checks.json): a
  call that needs a gradient there reaches the device check from every entry (forward and
  backward) without FA4_FINAL_PENDING (tests/test_bwd_head_dims.py, test_bwd_d192.py and
  test_bwd_swapped.py hold the rest).
- varlen_row_store: the varlen forward at v head dim 96 left the gate after
  tests/gpu/test_fwd_head_dims.py -k varlen passed on an H100 (results/h100/gpu_checks.json),
  at 192 after the same tests passed on an H200 (results/h200/gpu_checks.json): no varlen entry
  (flash_attn_varlen_func, api.sdpa's packed _flash_attn_fwd, the runtime's
  varlen_forward_into) and no dense call asks the gate at any v head dim.
- seqused_q: flash_attn_varlen_func and api.sdpa take it (dense q refused by name), checked
  like seqused_k (metadata, then values), through the ops (fake, autograd, compile) to the
  varlen runners' has_seqused_q keys; padding rows: out 0, dq 0.

The test-only CPU kernels (tests/fa4_cpu_reference.py) stand in for the GPU kernels; nothing
here runs a GPU kernel (tests/gpu/test_pending_api.py does).
"""

from __future__ import annotations

import pytest
import torch

from fa4_final import UnsupportedError, flash_attn_func, flash_attn_varlen_func
from fa4_final.api import ops, sdpa
from fa4_final.runtime import dispatch, pending, prologue, varlen
from tests import fa4_cpu_reference as ref
from tests.bwd_head_dims_common import refused_calls
from tests.hopper_recorder import record_hopper_runs
from tests.test_pending_features import BF16, DEVICE, GATE, dense, packed
from utils.reference import attention_reference_features

pytestmark = pytest.mark.usefixtures("no_pending")


def _counting(monkeypatch, name: str):
    """Record each call of api.ops' backward op ``name`` ('bwd' or 'varlen_bwd') that the
    autograd formula makes, with whether it was given a dlse."""
    calls = []
    op = getattr(ops, name)
    at = 12 if name == "bwd" else 17  # dlse's place among the op's arguments (after softcap)

    def counted(*args):
        calls.append(len(args) > at and args[at] is not None)
        return op(*args)

    monkeypatch.setattr(ops, name, counted)
    return calls


# ----------------------------------------------------------------------------------------------
# lse_fold


def _lse_fold_row(monkeypatch):
    """Put the deleted lse_fold row back in PENDING for this test (``listed`` reads the table
    at each call): the autograd formulas and api.sdpa then take Note [Gradient of the returned
    lse]'s probe path (two backward calls) again, the path the one call replaced."""
    monkeypatch.setitem(pending.PENDING, "lse_fold", "put back by the test: the probe's path")


def _probe_and_one_call_agree(monkeypatch, op: str, run):
    """The gradients of ``run()`` (which returns the loss and the inputs to differentiate) by
    the probe's two backward calls of ``op`` (the lse_fold row put back) and by the one call
    with dlse, each path's calls counted, and the two paths' gradients equal."""
    results = []
    for probe, want in ((True, [False, False]), (False, [True])):
        with monkeypatch.context() as m:
            if probe:
                _lse_fold_row(m)
            calls = _counting(m, op)
            loss, inputs = run()
            results.append(torch.autograd.grad(loss, inputs))
            assert calls == want
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_lse_fold_passed_its_gpu_tests_and_listed_is_true_without_the_environment(
        monkeypatch):
    """lse_fold left the gate (tests/gpu/test_lse_fold.py and test_pending_api.py -k lse_fold
    passed on an H200): listed without FA4_FINAL_PENDING, and naming it there changes nothing;
    a row still pending is listed only when named."""
    assert "lse_fold" not in pending.PENDING and "bwd_head_dims" not in pending.PENDING
    assert pending.listed("lse_fold") and pending.listed("not_a_pending_feature")
    assert pending.listed("bwd_head_dims")
    monkeypatch.setenv(pending.ENV, "bwd_head_dims, lse_fold")
    assert pending.listed("lse_fold") and pending.listed("bwd_head_dims")
    monkeypatch.delenv(pending.ENV)
    _lse_fold_row(monkeypatch)  # the mechanism the probe-path tests below rely on
    assert not pending.listed("lse_fold")
    monkeypatch.setenv(pending.ENV, "lse_fold")
    assert pending.listed("lse_fold")


def _loss_on_lse(q, k, v, causal, **kw):
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, **kw)
    g = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=g)
    dlse = torch.randn(lse.shape, generator=g)
    return (out.float() * dout).sum() + (lse.where(lse.isfinite(), 0.0) * dlse).sum(), dout, dlse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("probe", [False, True], ids=["default", "probe_path"])
def test_lse_fold_takes_one_backward_call_by_default_and_both_paths_equal_float64(
        monkeypatch, cpu_kernels, causal, probe):
    """The default (no FA4_FINAL_PENDING): one backward call, given dlse. The probe's two calls
    (the row put back) give the same gradients: both against float64. sq > sk with causal:
    rows that see no key (lse = -inf, no gradient either way)."""
    if probe:
        _lse_fold_row(monkeypatch)
    calls = _counting(monkeypatch, "bwd")
    q, k, v = dense(sq=40, sk=24, grad=True)
    loss, dout, dlse = _loss_on_lse(q, k, v, causal)
    grads = torch.autograd.grad(loss, [q, k, v])
    assert calls == ([False, False] if probe else [True])
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out64, lse64 = attention_reference_features(*leaves, causal, None, 0.0, None)
    finite = lse64.isfinite()
    ref_loss = (out64 * dout.double()).sum() + (lse64.where(finite, 0.0) * dlse.double()).sum()
    for name, got, want in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref_loss, leaves)):
        err = (got.double() - want).abs().max() / want.abs().max().clamp(min=1)
        assert err < 3e-2, (name, float(err))


def test_lse_fold_changes_nothing_without_a_loss_on_lse_or_without_return_lse(
        monkeypatch, cpu_kernels):
    calls = _counting(monkeypatch, "bwd")
    q, k, v = dense(grad=True)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    out.float().sum().backward()  # lse unused: its gradient arrives as None
    out, _ = flash_attn_func(q, k, v)
    out.float().sum().backward()
    assert calls == [False, False]


def test_lse_fold_with_softcap_and_sink_equals_the_probe_path(monkeypatch, cpu_kernels):
    """The one call and the probe's two give the same gradients (dsink from sink_gradient)."""
    sink = torch.tensor([-1.0, 0.5, 2.0, 3.5])

    def run():
        q, k, v = dense(sq=40, sk=24, grad=True)
        s = sink.clone().requires_grad_(True)
        loss, _, _ = _loss_on_lse(q, k, v, True, softcap=5.0, learnable_sink=s)
        return loss, [q, k, v, s]

    _probe_and_one_call_agree(monkeypatch, "bwd", run)


def test_lse_fold_varlen_one_call_equals_the_probe_path(monkeypatch, cpu_kernels):
    def run():
        pq, pk, pv, cu_q, cu_k = packed(lens_q=(5, 7, 19), lens_k=(9, 0, 30), grad=True)
        out, lse = flash_attn_varlen_func(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                          causal=True, return_lse=True)
        loss = out.float().square().sum() + lse.where(lse.isfinite(), 0.0).square().sum()
        return loss, [pq, pk, pv]

    _probe_and_one_call_agree(monkeypatch, "varlen_bwd", run)


def test_lse_fold_under_compile_fullgraph(monkeypatch, cpu_kernels):
    torch._dynamo.reset()

    def layer(q, k, v):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out.float().square().mean() + lse.where(lse.isfinite(), 0.0).mean()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    q, k, v = dense(grad=True)
    grads = torch.autograd.grad(compiled(q, k, v), [q, k, v])
    want = torch.autograd.grad(layer(q, k, v), [q, k, v])
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w)


def _bwd_args():
    q, k, v = dense()
    out, lse = torch.zeros_like(q), torch.zeros(2, 4, 24)
    grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    return q, k, v, out, lse, grads


def test_a_dlse_to_the_runtime_gets_past_the_gate_to_the_device_check(monkeypatch):
    """No FA4_FINAL_PENDING: a (good) dlse is taken by both runtime entry points, and a CPU
    call stops at the device check; naming lse_fold there (as the GPU tests still do) changes
    nothing."""
    assert "lse_fold" not in pending.PENDING
    q, k, v, out, lse, grads = _bwd_args()
    pq, pk, pv, cu_q, cu_k = packed()
    plse = torch.zeros(4, pq.shape[0])
    pgrads = (torch.zeros_like(pq), torch.zeros_like(pk), torch.zeros_like(pv))
    calls = [("backward_into", lambda: prologue.backward_into(
                 q, k, v, out, lse, out, *grads, dlse=torch.ones_like(lse))),
             ("varlen_backward_into", lambda: varlen.varlen_backward_into(
                 pq, pk, pv, torch.zeros_like(pq), plse, torch.zeros_like(pq), *pgrads, cu_q,
                 cu_k, None, None, None, dlse=torch.ones_like(plse)))]
    for env in ("", "lse_fold"):
        monkeypatch.setenv(pending.ENV, env)
        for func, call in calls:
            with pytest.raises(UnsupportedError) as info:
                call()
            message = str(info.value)
            assert DEVICE in message and GATE not in message, (func, message)


@pytest.mark.parametrize("bad, words", [
    (torch.zeros(2, 4, 23), r"dlse must be a floating tensor of lse's shape \(2, 4, 24\)"),
    (torch.zeros(2, 4, 24, dtype=torch.int32), r"got torch.int32 \(2, 4, 24\)"),
    (1.0, "got float")])
def test_a_bad_dlse_is_named_before_the_gate(bad, words):
    q, k, v, out, lse, grads = _bwd_args()
    with pytest.raises(ValueError, match=words):
        prologue.backward_into(q, k, v, out, lse, out, *grads, dlse=bad)


def test_sdpa_backward_folds_dlse_into_one_call_by_default(monkeypatch):
    """One backward_into call, given the dlse, without FA4_FINAL_PENDING; none without a dlse;
    the probe's two calls (none given a dlse) only with the lse_fold row put back. The values
    of both paths against float64: test_sdpa_registration.test_dlse_adds_the_gradient_of_the_
    returned_lse."""
    seen = []

    def fake_backward(q, k, v, out, lse, dout, dq, dk, dv, causal, scale, window,
                      deterministic, softcap=0.0, **kw):
        seen.append(kw.get("dlse") is not None)
        for t in (dq, dk, dv):
            t.zero_()

    monkeypatch.setattr(sdpa, "backward_into", fake_backward)
    q, k, v, out, lse, _ = _bwd_args()
    dlse = torch.randn(lse.shape)
    sdpa._flash_attn_bwd(q, k, v, out, out, lse, dlse=dlse)
    sdpa._flash_attn_bwd(q, k, v, out, out, lse)
    assert seen == [True, False]
    seen.clear()
    _lse_fold_row(monkeypatch)
    sdpa._flash_attn_bwd(q, k, v, out, out, lse, dlse=dlse)
    assert seen == [False, False]  # Note [Gradient of the returned lse]: the probe's call


def test_hopper_puts_has_dlse_in_the_backward_key_only_when_given(monkeypatch):
    calls = record_hopper_runs(monkeypatch)
    runners = dispatch.runners(dispatch.HOPPER.host, dispatch.HOPPER.features)
    q, k, v, out, lse, grads = _bwd_args()
    dlse = torch.randn(lse.shape)
    runners["backward"](q, k, v, out, lse, out, *grads, True, 0.125, None, 0)
    runners["backward"](q, k, v, out, lse, out, *grads, True, 0.125, None, 0, False, None,
                        dlse=dlse)
    runners["backward"](q, k, v, out, lse, out, *grads, True, 0.125, None, 0, False, None,
                        softcap=5.0, dlse=dlse)
    runners["varlen_backward"](q[0], k[0], v[0], out[0], lse[0], out[0], grads[0][0],
                               grads[1][0], grads[2][0], None, None, None, 24, 40, False, 0.125,
                               None, None, True, None, dlse=dlse[1])
    keys = [c[2] for c in calls if c[0] == "compiled"]
    assert keys[0] == (64, "bf16", True, None, False, False, False, False, False)  # unchanged
    assert keys[1] == keys[0] + ("sm_90a", 0.0, True)
    assert keys[2] == keys[0] + ("sm_90a", 5.0, True)
    assert keys[3][7] is True and keys[3][-3:] == ("sm_90a", 0.0, True)
    launches = [c for c in calls if c[0] != "compiled"]
    assert len(launches[0][1]) == 14 and launches[1][1][-1] is dlse  # dlse after the window
    assert torch.equal(launches[3][1][-1], dlse[1]) and len(launches[3][1]) == 20
    from fa4_final.hopper import host

    assert host.backward_recipe(*keys[1]).kernels["pre"].has_dlse
    assert not host.backward_recipe(*keys[0]).kernels["pre"].has_dlse
    capped = host.backward_recipe(*keys[2]).kernels
    assert capped["pre"].has_dlse and capped["main"].logit_softcap == 5.0
    assert host.backward_recipe(*keys[3]).kernels["pre"].has_dlse


def test_blackwell_refuses_dlse_by_name():
    row = dispatch.wired(dispatch.BLACKWELL)
    with pytest.raises(UnsupportedError, match=r"dlse=<tensor \(2, 4, 24\)>: the sm_100a "
                                               r"backward has no build that folds .*Hopper"):
        row.backward(None, None, None, None, None, None, None, None, None, False, 0.1, None,
                     None, False, None, dlse=torch.zeros(2, 4, 24))


def test_the_cpu_reference_folds_dlse_as_the_probe_does():
    """tests/fa4_cpu_reference.py's dlse (delta - dlse) against its own probe path."""
    q, k, v = dense(sq=40, sk=24)
    out, lse = ref.dense_forward(q, k, v, 0.125, True, None, 0)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(out.shape, generator=g).to(BF16)
    dlse = torch.randn(lse.shape, generator=g)
    folded = ref.dense_backward(dout, q, k, v, out, lse, 0.125, True, None, 0, dlse=dlse)
    plain = ref.dense_backward(dout, q, k, v, out, lse, 0.125, True, None, 0)
    probe_dout, probe_out = ops._lse_probe(dlse.transpose(1, 2), out)
    extra = ref.dense_backward(probe_dout, q, k, torch.zeros_like(v), probe_out, lse, 0.125,
                               True, None, 0)
    for f, p, e in zip(folded[:2], plain[:2], extra[:2]):
        torch.testing.assert_close(f.float(), p.float() + e.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(folded[2], plain[2])


# ----------------------------------------------------------------------------------------------
# head_dims: FWD_HEAD_DIMS and dv != d, the Hopper forward only (left the gate), the varlen
# forward at v head dims 96 and 192 too (varlen_row_store, left the gate)


HEAD_DIM_CASES = [(96, 96), (192, 128), (256, 256), (64, 128), (128, 64), (128, 192),
                  (256, 96)]
def _head_dim_entries(d, dv):
    """(name, varlen, call) of every forward entry point at (d, dv)."""
    q, k, v = dense(d=d, dv=dv)
    pq, pk, pv, cu_q, cu_k = packed(d=d, dv=dv)
    out, lse = torch.zeros(*q.shape[:-1], dv, dtype=BF16), torch.zeros(2, 4, 24)
    pout, plse = torch.zeros(*pq.shape[:-1], dv, dtype=BF16), torch.zeros(4, pq.shape[0])
    yield "flash_attn_func", False, lambda: flash_attn_func(q, k, v)
    yield "flash_attn_varlen_func", True, lambda: flash_attn_varlen_func(
        pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    yield "_flash_attn_fwd", False, lambda: sdpa._flash_attn_fwd(q, k, v)
    yield "_flash_attn_fwd", True, lambda: sdpa._flash_attn_fwd(
        pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    yield "forward_into", False, lambda: prologue.forward_into(q, k, v, out, lse)
    yield "varlen_forward_into", True, lambda: varlen.varlen_forward_into(
        pq, pk, pv, cu_q, cu_k, None, None, None, pout, plse)


@pytest.mark.parametrize("d, dv", HEAD_DIM_CASES)
def test_head_dims_passed_their_gpu_tests_and_every_forward_entry_takes_them_ungated(d, dv):
    """head_dims left the gate (tests/gpu/test_fwd_head_dims.py and test_pending_api.py -k
    head_dims passed): without FA4_FINAL_PENDING every forward entry gets past the gate to the
    device check; so does a varlen call at v head dim 192 (varlen_row_store left the gate after
    its GPU test on an H200)."""
    assert "head_dims" not in pending.PENDING and pending.listed("head_dims")
    assert "varlen_row_store" not in pending.PENDING
    for func, _, call in _head_dim_entries(d, dv):
        with pytest.raises(UnsupportedError) as info:
            call()
        message = str(info.value)
        assert DEVICE in message and GATE not in message, (func, message)


@pytest.mark.parametrize("d, dv", HEAD_DIM_CASES)
@pytest.mark.parametrize("env", ["varlen_row_store", "head_dims,varlen_row_store"])
def test_naming_the_deleted_rows_in_the_environment_changes_nothing(monkeypatch, d, dv, env):
    """The GPU tests still set FA4_FINAL_PENDING=head_dims,varlen_row_store: harmless."""
    monkeypatch.setenv(pending.ENV, env)
    for func, _, call in _head_dim_entries(d, dv):
        with pytest.raises(UnsupportedError) as info:
            call()
        assert DEVICE in str(info.value) and GATE not in str(info.value), (func, info.value)


# ----------------------------------------------------------------------------------------------
# varlen_row_store (left the gate: v head dim 96 after an H100 run, 192 after an H200 run)


@pytest.mark.parametrize("d, dv", [(96, 96), (192, 192), (128, 96), (192, 128), (256, 192),
                                   (64, 96)])
def test_the_varlen_forward_at_dv_96_and_192_is_not_gated(d, dv):
    """flash_attn_varlen_func, api.sdpa's packed _flash_attn_fwd and the runtime's
    varlen_forward_into at v head dims 96 and 192 (whatever q's): past every check to the
    device check, no gate."""
    assert "varlen_row_store" not in pending.PENDING
    varlen_calls = [(func, call) for func, is_varlen, call in _head_dim_entries(d, dv)
                    if is_varlen]
    assert [f for f, _ in varlen_calls] == ["flash_attn_varlen_func", "_flash_attn_fwd",
                                            "varlen_forward_into"]
    for func, call in varlen_calls:
        with pytest.raises(UnsupportedError) as info:
            call()
        message = str(info.value)
        assert DEVICE in message and GATE not in message, (func, message)


@pytest.mark.parametrize("dv", (96, 192))
def test_dense_calls_at_dv_96_and_192_never_ask_varlen_row_store(dv):
    for d in (dv, 64, 128, 256):
        for func, is_varlen, call in _head_dim_entries(d, dv):
            if is_varlen:
                continue
            with pytest.raises(UnsupportedError) as info:
                call()
            assert DEVICE in str(info.value) and GATE not in str(info.value), (func, info.value)
    # the per-sequence loop over the dense forward (a reference, not the API) neither
    pq, pk, pv, cu_q, cu_k = packed(d=dv, dv=dv)
    with pytest.raises(UnsupportedError, match=DEVICE):
        varlen.forward_loop(pq, pk, pv, cu_q, cu_k)


@pytest.mark.parametrize("dv", (64, 128, 256))
def test_varlen_row_store_never_gates_the_other_v_head_dims(dv):
    for d in (64, 128, 256):
        for func, _, call in _head_dim_entries(d, dv):
            with pytest.raises(UnsupportedError) as info:
                call()
            assert DEVICE in str(info.value) and GATE not in str(info.value), (func, info.value)


def test_bad_arguments_of_the_varlen_forward_at_dv_192_are_named():
    """A v head dim the forward has no build for, and out of the wrong head dim, named."""
    pq, pk, pv, cu_q, cu_k = packed(d=192, dv=192)
    with pytest.raises(ValueError, match=r"out must be like q with v's head dim \(24, 4, 192\)"):
        varlen.varlen_forward_into(pq, pk, pv, cu_q, cu_k, None, None, None,
                                   torch.zeros(pq.shape[0], 4, 128, dtype=BF16),
                                   torch.zeros(4, pq.shape[0]))
    pq, pk, pv, cu_q, cu_k = packed(d=192, dv=160)
    with pytest.raises(UnsupportedError, match="v's head dim 160 differs"):
        flash_attn_varlen_func(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_the_default_head_dims_never_ask_the_gate(cpu_kernels):
    for d in (64, 128):
        q, k, v = dense(d=d)
        out, _ = flash_attn_func(q, k, v)
        assert out.shape == q.shape


@pytest.mark.parametrize("d, dv, words", [
    (80, 80, r"head_dim must be one of \(64, 96, 128, 192, 256\) \(the Hopper forward; the "
             r"backward \(64, 96, 128, 192, 256\) with dv == head_dim\), got 80"),
    (64, 32, r"v's head dim 32 differs from q and k's 64: fa4_final's Hopper forward takes dv "
             r"!= d with each of \(64, 96, 128, 192, 256\) \(its backward dv == d, and \(d, "
             r"dv\) in \(\(192, 128\),\)\)"),
    (64, 160, "v's head dim 160 differs")])
def test_head_dims_outside_the_forward_builds_are_named(d, dv, words):
    with pytest.raises(UnsupportedError, match=words):
        flash_attn_func(*dense(d=d, dv=dv))


def test_fake_out_has_v_head_dim_and_the_fake_takes_the_head_dims_ungated(monkeypatch):
    """The ops' fake impls pass the head dims' (deleted) gate without FA4_FINAL_PENDING; the
    varlen fake at dv 96 and 192 too (varlen_row_store left the gate)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 100, 8, 192, dtype=BF16, device="cuda")
        k = torch.empty(3, 77, 2, 192, dtype=BF16, device="cuda")
        v = torch.empty(3, 77, 2, 128, dtype=BF16, device="cuda")
        out, lse = ops.fwd(q, k, v, 0.1, True, -1, -1, False, True)
        assert out.shape == (3, 100, 8, 128) and lse.shape == (3, 8, 100)
        out, _ = flash_attn_func(q, k, v, causal=True)  # the public function on fakes too
        assert out.shape == (3, 100, 8, 128)
        pq = torch.empty(300, 8, 256, dtype=BF16, device="cuda")
        pk = torch.empty(200, 2, 256, dtype=BF16, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        pv = torch.empty(200, 2, 64, dtype=BF16, device="cuda")
        out, lse = ops.varlen_fwd(pq, pk, pv, cu, cu, None, -1, -1, 0.1, False, -1, -1, False,
                                  True)
        assert out.shape == (300, 8, 64) and lse.shape == (8, 300)
        pv = torch.empty(200, 2, 96, dtype=BF16, device="cuda")
        out, lse = ops.varlen_fwd(pq, pk, pv, cu, cu, None, -1, -1, 0.1, False, -1, -1, False,
                                  True)
        assert out.shape == (300, 8, 96) and lse.shape == (8, 300)


def _float64_forward(q, k, v, causal):
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    s = qf @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~ref.visible(q.shape[1], k.shape[1], True, None, 0), -torch.inf)
    return (torch.softmax(s, -1).nan_to_num(0.0) @ vf).transpose(1, 2)


@pytest.mark.parametrize("d, dv", [(192, 128), (96, 96), (128, 256)])
def test_forward_with_dv_through_the_ops_equals_float64(cpu_kernels, d, dv):
    q, k, v = dense(sq=40, sk=24, d=d, dv=dv)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 40, 4, dv) and lse.shape == (2, 4, 40)
    assert (out.double() - _float64_forward(q, k, v, True)).abs().max() < 3e-2


def test_compile_fullgraph_with_dv(cpu_kernels):
    torch._dynamo.reset()
    nodes = []

    def backend(gm, example_inputs):
        nodes.extend(str(n.target) for n in gm.graph.nodes if "fa4_final" in str(n.target))
        return gm.forward

    def layer(q, k, v):
        return flash_attn_func(q, k, v, causal=True)[0].float().square().mean()

    q, k, v = dense(d=192, dv=128)
    got = torch.compile(layer, fullgraph=True, backend=backend)(q, k, v)
    assert any("fa4_final.fwd" in n for n in nodes)
    torch.testing.assert_close(got, layer(q, k, v))


ROWS_DELETED = "head_dims,varlen_row_store,bwd_head_dims"


@pytest.mark.parametrize("env", ["", ROWS_DELETED], ids=["default", "listed"])
# the backward's (head_dim, dv) (pending.BACKWARD_HEAD_DIMS) run: test_bwd_head_dims_run_ungated
@pytest.mark.parametrize("d, dv", [(256, 96), (128, 64), (192, 64), (128, 96), (256, 128)])
def test_a_gradient_at_a_forward_only_head_dim_is_refused_at_the_forward(
        monkeypatch, cpu_kernels, d, dv, env):
    """Refused when the call will need a gradient (never a crash or a wrong gradient in
    backward()), whatever FA4_FINAL_PENDING says (refuse_backward_head_dims: no backward is
    built there); torch.no_grad() or inputs without requires_grad run the forward."""
    monkeypatch.setenv(pending.ENV, env)
    q, k, v = dense(d=d, dv=dv, grad=True)
    pq, pk, pv, cu_q, cu_k = packed(d=d, dv=dv, grad=True)
    for func, call, message in refused_calls(q, k, v, pq, pk, pv, cu_q, cu_k):
        assert f"{func}: the backward at head_dim={d}, dv={dv} is not built" in message
        assert "torch.no_grad()" in message and "requiring grad" in message
        with torch.no_grad():
            out, _ = call()
        assert out.shape[-1] == dv and not out.requires_grad
    out, _ = flash_attn_func(q.detach(), k.detach(), v.detach())
    assert out.shape[-1] == dv


@pytest.mark.parametrize("env", ["", ROWS_DELETED], ids=["default", "listed"])
@pytest.mark.parametrize("d, dv", [(256, 192), (256, 128), (192, 64), (128, 96), (96, 64)])
def test_the_backward_entry_points_refuse_forward_only_head_dims(monkeypatch, d, dv, env):
    """The backward entry points refuse where no backward is built, gate or no gate, naming
    the value; the backward's (head_dim, dv) run: test_bwd_head_dims_run_ungated below."""
    monkeypatch.setenv(pending.ENV, env)
    entries = list(_backward_entries(d, dv))
    assert len(entries) == 5
    for func, call in entries:
        with pytest.raises(UnsupportedError) as info:
            call()
        assert str(info.value).startswith(
            f"{func}: the backward at head_dim={d}, dv={dv} is not built"), info.value


def _backward_entries(d, dv):
    """(name, call) of every backward entry point at (d, dv): the runtime's dense, varlen and
    per-sequence loop, api.sdpa's _flash_attn_bwd dense and packed."""
    q, k, v = dense(d=d, dv=dv)
    out, lse = torch.zeros(*q.shape[:-1], dv, dtype=BF16), torch.zeros(2, 4, 24)
    pq, pk, pv, cu_q, cu_k = packed(d=d, dv=dv)
    pout, plse = torch.zeros(*pq.shape[:-1], dv, dtype=BF16), torch.zeros(4, pq.shape[0])
    yield "backward_into", lambda: prologue.backward_into(
        q, k, v, out, lse, out, torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    yield "varlen_backward_into", lambda: varlen.varlen_backward_into(
        pq, pk, pv, pout, plse, pout, torch.zeros_like(pq), torch.zeros_like(pk),
        torch.zeros_like(pv), cu_q, cu_k, None, None, None)
    yield "backward_loop", lambda: varlen.backward_loop(pq, pk, pv, pout, plse, pout, cu_q, cu_k)
    yield "_flash_attn_bwd", lambda: sdpa._flash_attn_bwd(q, k, v, out, out, lse)
    yield "_flash_attn_bwd", lambda: sdpa._flash_attn_bwd(
        pq, pk, pv, pout, pout, plse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("env", ["", ROWS_DELETED], ids=["default", "listed"])
@pytest.mark.parametrize("d, dv", pending.BACKWARD_HEAD_DIMS)
def test_bwd_head_dims_run_ungated(monkeypatch, d, dv, env):
    """bwd_head_dims left the gate: at every (head_dim, dv) the backward runs, a call that needs
    a gradient (flash_attn_func, flash_attn_varlen_func) and every backward entry point reach
    the device check (a CPU tensor), whatever FA4_FINAL_PENDING says."""
    assert "bwd_head_dims" not in pending.PENDING and not pending.forward_only(d, dv)
    monkeypatch.setenv(pending.ENV, env)
    q, k, v = dense(d=d, dv=dv, grad=True)
    pq, pk, pv, cu_q, cu_k = packed(d=d, dv=dv, grad=True)
    calls = [(func, call) for func, call, _ in refused_calls(q, k, v, pq, pk, pv, cu_q, cu_k)]
    calls += list(_backward_entries(d, dv))
    assert [f for f, _ in calls] == ["flash_attn_func", "flash_attn_varlen_func",
                                     "backward_into", "varlen_backward_into", "backward_loop",
                                     "_flash_attn_bwd", "_flash_attn_bwd"]
    for func, call in calls:
        with pytest.raises(UnsupportedError) as info:
            call()
        message = str(info.value)
        assert DEVICE in message and GATE not in message, (func, message)
        assert "is not built" not in message, (func, message)


def test_sdpa_forward_allocates_out_with_v_head_dim(monkeypatch):
    seen = []
    monkeypatch.setattr(sdpa, "forward_into",
                        lambda q, k, v, out, lse, *a, **kw: seen.append(tuple(out.shape)))
    q, k, v = dense(d=192, dv=128)
    out, _ = sdpa._flash_attn_fwd(q, k, v)
    assert seen == [(2, 24, 4, 128)] and out.shape == (2, 24, 4, 128)


def test_hopper_passes_head_dim_v_only_when_it_differs(monkeypatch):
    calls = record_hopper_runs(monkeypatch)
    runners = dispatch.runners(dispatch.HOPPER.host, dispatch.HOPPER.features)
    for d, dv in ((64, 64), (96, 96), (192, 128), (256, 256), (64, 128)):
        q, k, v = dense(d=d, dv=dv)
        out, lse = torch.empty(*q.shape[:-1], dv, dtype=BF16), torch.empty(2, 4, 24)
        runners["forward"](q, k, v, out, lse, True, 0.125, None, 0)
    q, k, v = dense(d=192, dv=128)
    runners["varlen_forward"](q[0], k[0], v[0], None, None, None, 24, 40,
                              torch.empty(24, 4, 128, dtype=BF16), lse[0], False, 0.125, None,
                              None, None, softcap=2.0)
    keys = [c[2] for c in calls if c[0] == "compiled"]
    base = (True, None, False, False, False, False)
    assert keys[0] == (64, "bf16", *base)  # unchanged default
    assert keys[1] == (96, "bf16", *base)
    assert keys[2] == (192, "bf16", *base, "sm_90a", 0.0, None, 128)
    assert keys[3] == (256, "bf16", *base)
    assert keys[4] == (64, "bf16", *base, "sm_90a", 0.0, None, 128)
    assert keys[5][6] is True and keys[5][-4:] == ("sm_90a", 2.0, None, 128)
    from fa4_final.hopper import host

    for key, (d, dv) in zip(keys, ((64, 64), (96, 96), (192, 128), (256, 256), (64, 128),
                                   (192, 128))):
        main = host.forward_recipe(*key).kernels["main"]
        assert (main.head_dim, main.head_dim_v) == (d, dv)
    assert host.forward_recipe(*keys[5]).kernels["main"].varlen


def test_blackwell_refuses_the_head_dims_by_name():
    row = dispatch.wired(dispatch.BLACKWELL)
    assert "head_dims" not in row.features and "head_dims" in dispatch.HOPPER.features
    q, k, v = dense(d=192, dv=128)
    with pytest.raises(UnsupportedError, match=r"head_dim=192, dv=128: the sm_100a kernels are "
                                               r"built for head dims \(64, 128\).*Hopper"):
        row.forward(q, k, v, None, None, False, 0.1, None, None, None)


# ----------------------------------------------------------------------------------------------
# seqused_q: a varlen sequence's queries are the first seqused_q[b] of its packed rows


LENS_Q, USED_Q, LENS_K = (5, 0, 19), (3, 0, 12), (9, 4, 30)


def _used(values=USED_Q):
    return torch.tensor(values, dtype=torch.int32)


def _seqused_q_entries(used):
    pq, pk, pv, cu_q, cu_k = packed(lens_q=LENS_Q, lens_k=LENS_K)
    out, lse = torch.zeros_like(pq), torch.zeros(4, pq.shape[0])
    grads = (torch.zeros_like(pq), torch.zeros_like(pk), torch.zeros_like(pv))
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used)
    yield "flash_attn_varlen_func", lambda: flash_attn_varlen_func(pq, pk, pv, **kw)
    yield "_flash_attn_fwd", lambda: sdpa._flash_attn_fwd(pq, pk, pv, **kw)
    yield "_flash_attn_bwd", lambda: sdpa._flash_attn_bwd(pq, pk, pv, out, out, lse, **kw)
    yield "varlen_forward_into", lambda: varlen.varlen_forward_into(
        pq, pk, pv, cu_q, cu_k, None, None, None, out, lse, seqused_q=used)
    yield "varlen_backward_into", lambda: varlen.varlen_backward_into(
        pq, pk, pv, out, lse, out, *grads, cu_q, cu_k, None, None, None, seqused_q=used)


def test_seqused_q_passed_its_gpu_tests_and_every_entry_takes_it_ungated():
    """seqused_q left the gate (its GPU tests passed: tests/gpu/test_seqused_q.py and
    test_pending_api.py -k seqused_q): every entry takes it without FA4_FINAL_PENDING, and a
    CPU call stops at the device check, not at the gate."""
    assert "seqused_q" not in pending.PENDING
    for func, call in _seqused_q_entries(_used()):
        with pytest.raises(UnsupportedError) as info:
            call()
        assert DEVICE in str(info.value) and GATE not in str(info.value), (func, info.value)


def test_seqused_q_with_dense_q_is_refused_by_name_as_varlen_only(monkeypatch):
    monkeypatch.setenv(pending.ENV, "seqused_q")
    q, k, v = dense()
    for call in (lambda: sdpa._flash_attn_fwd(q, k, v, seqused_q=_used((3, 4))),
                 lambda: sdpa._flash_attn_bwd(q, k, v, q, q, torch.zeros(2, 4, 24),
                                              seqused_q=_used((3, 4)))):
        with pytest.raises(UnsupportedError, match=r"seqused_q=<tensor \(2,\)> with dense q is "
                                                   r"refused: .*cu_seqlens_q and cu_seqlens_k"):
            call()
    with pytest.raises(TypeError, match="unexpected keyword argument 'seqused_q'"):
        flash_attn_func(q, k, v, seqused_q=_used((3, 4)))  # FA4's flash_attn_func has none


@pytest.mark.parametrize("bad, error, words", [
    (torch.tensor([3, 0, 12]), TypeError, "seqused_q must have dtype torch.int32"),
    (_used((3, 0)), ValueError, "seqused_q"),
    (_used((3, 0, 12)).view(3, 1), ValueError, "seqused_q must be 1-D"),
    ([3, 0, 12], TypeError, "seqused_q must be a torch.Tensor of int32")])
def test_a_bad_seqused_q_is_named_before_the_gate(bad, error, words):
    for _, call in _seqused_q_entries(bad):
        with pytest.raises(error, match=words):
            call()


class _VarlenRecorder:
    """The Hopper row with its varlen entries recorded (no kernel): the value checks run."""

    def __init__(self, monkeypatch):
        from dataclasses import replace

        self.calls = []
        backend = replace(dispatch.HOPPER, varlen_forward=self.record("forward"),
                          varlen_backward=self.record("backward"))
        monkeypatch.setattr(prologue, "backend_for", lambda device: backend)
        monkeypatch.setattr(prologue, "_BACKENDS", {})

    def record(self, name):
        return lambda *args, **kw: self.calls.append((name, kw))


@pytest.mark.parametrize("values, words", [
    ((3, 0, 20), r"seqused_q\[2\] = 20 must be in \[0, 19\] \(the length of sequence 2 in "
                 r"cu_seqlens_q\)"),
    ((6, 0, 12), r"seqused_q\[0\] = 6 must be in \[0, 5\]"),
    ((-1, 0, 12), r"seqused_q\[0\] = -1 must be in \[0, 5\]")])
def test_seqused_q_values_are_checked_where_seqused_k_values_are(monkeypatch, values, words):
    monkeypatch.setenv(pending.ENV, "seqused_q")
    rec = _VarlenRecorder(monkeypatch)
    for _, call in list(_seqused_q_entries(_used(values)))[3:]:
        with pytest.raises(ValueError, match=words):
            call()
    assert rec.calls == []


def test_seqused_q_reaches_the_backend_only_when_given(monkeypatch):
    monkeypatch.setenv(pending.ENV, "seqused_q")
    rec = _VarlenRecorder(monkeypatch)
    used = _used()
    for _, call in list(_seqused_q_entries(used))[3:]:
        call()
    for _, call in list(_seqused_q_entries(None))[3:]:
        call()
    assert [(n, kw.get("seqused_q") is used) for n, kw in rec.calls] == [
        ("forward", True), ("backward", True), ("forward", False), ("backward", False)]
    assert "seqused_q" not in rec.calls[2][1] and "seqused_q" not in rec.calls[3][1]
    # max_seqlen_q bounds the used rows (as max_seqlen_k bounds seqused_k's)
    pq, pk, pv, cu_q, cu_k = packed(lens_q=LENS_Q, lens_k=LENS_K)
    varlen.varlen_forward_into(pq, pk, pv, cu_q, cu_k, None, 12, None, torch.zeros_like(pq),
                               torch.zeros(4, pq.shape[0]), seqused_q=used)


def test_fake_varlen_with_seqused_q(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        pq = torch.empty(300, 8, 128, dtype=BF16, device="cuda")
        pk = torch.empty(200, 2, 128, dtype=BF16, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        used = torch.empty(3, dtype=torch.int32, device="cuda")
        out, lse = ops.varlen_fwd(pq, pk, pk, cu, cu, None, -1, -1, 0.1, True, -1, 0, False,
                                  True, 0.0, None, used)
        assert out.shape == pq.shape and lse.shape == (8, 300)
        dq, dk, dv = ops.varlen_bwd(out, pq, pk, pk, out, lse, cu, cu, None, -1, -1, 0.1, True,
                                    -1, 0, False, 0.0, None, used)
        assert dq.shape == pq.shape and dk.shape == pk.shape
        with pytest.raises(TypeError, match="seqused_q must have dtype torch.int32"):
            ops.varlen_fwd(pq, pk, pk, cu, cu, None, -1, -1, 0.1, True, -1, 0, False, True, 0.0,
                           None, torch.empty(3, dtype=torch.int64, device="cuda"))


def _varlen_used_call(used, causal=True, return_lse=False):
    pq, pk, pv, cu_q, cu_k = packed(lens_q=LENS_Q, lens_k=LENS_K, grad=True)
    out, lse = flash_attn_varlen_func(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      seqused_q=used, causal=causal, return_lse=return_lse)
    return pq, pk, pv, out, lse


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_q_forward_and_autograd_per_sequence_equal_float64(monkeypatch, cpu_kernels,
                                                                     causal):
    """Used rows against float64 on the used rows alone; padding rows: out 0, dq 0; keys of a
    sequence get gradients from its used rows only."""
    monkeypatch.setenv(pending.ENV, "seqused_q")
    pq, pk, pv, out, lse = _varlen_used_call(_used(), causal, return_lse=True)
    g = torch.Generator().manual_seed(9)
    dout = torch.randn(out.shape, generator=g)
    (out.float() * dout).sum().backward()
    q0 = k0 = 0
    for nq, used, nk in zip(LENS_Q, USED_Q, LENS_K):
        pad = slice(q0 + used, q0 + nq)
        assert torch.equal(out[pad].float(), torch.zeros_like(out[pad].float()))
        assert torch.equal(pq.grad[pad].float(), torch.zeros_like(pq.grad[pad].float()))
        if used:
            leaves = [t.detach()[rows].double()[None].requires_grad_(True) for t, rows in (
                (pq, slice(q0, q0 + used)), (pk, slice(k0, k0 + nk)), (pv, slice(k0, k0 + nk)))]
            ref_out = _float64_forward(*leaves, causal)
            assert (out[q0:q0 + used].double() - ref_out[0]).abs().max() < 3e-2
            want = torch.autograd.grad((ref_out * dout[None, q0:q0 + used].double()).sum(),
                                       leaves)
            for got, w in ((pq.grad[q0:q0 + used], want[0]), (pk.grad[k0:k0 + nk], want[1]),
                           (pv.grad[k0:k0 + nk], want[2])):
                assert (got.double() - w[0]).abs().max() < 3e-2
        q0, k0 = q0 + nq, k0 + nk


def test_seqused_q_with_lse_fold_and_the_probe_give_the_same_gradients(monkeypatch,
                                                                     cpu_kernels):
    def run():
        pq, pk, pv, out, lse = _varlen_used_call(_used(), return_lse=True)
        loss = out.float().square().sum() + lse.where(lse.isfinite(), 0.0).square().sum()
        return loss, [pq, pk, pv]

    _probe_and_one_call_agree(monkeypatch, "varlen_bwd", run)


def test_compile_fullgraph_with_seqused_q(monkeypatch, cpu_kernels):
    monkeypatch.setenv(pending.ENV, "seqused_q")
    torch._dynamo.reset()

    def layer(q, k, v, cu_q, cu_k, used):
        out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                        seqused_q=used, causal=True)
        return out.float().square().sum()

    pq, pk, pv, cu_q, cu_k = packed(lens_q=LENS_Q, lens_k=LENS_K, grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(pq, pk, pv, cu_q, cu_k, _used())
    grads = torch.autograd.grad(got, [pq, pk, pv])
    want = layer(pq, pk, pv, cu_q, cu_k, _used())
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, torch.autograd.grad(want, [pq, pk, pv])):
        torch.testing.assert_close(g, w)


def test_hopper_puts_has_seqused_q_in_the_varlen_keys_only_when_given(monkeypatch):
    calls = record_hopper_runs(monkeypatch)
    runners = dispatch.runners(dispatch.HOPPER.host, dispatch.HOPPER.features)
    q, k, v, out, lse, grads = _bwd_args()
    used = _used((3, 4))
    args = (q[0], k[0], v[0], None, None, None, 24, 40)
    runners["varlen_forward"](*args, out[0], lse[0], True, 0.125, None, 0)
    runners["varlen_forward"](*args, out[0], lse[0], True, 0.125, None, 0, seqused_q=used)
    bargs = (q[0], k[0], v[0], out[0], lse[0], out[0], grads[0][0], grads[1][0], grads[2][0],
             None, None, None, 24, 40, True, 0.125, None, 0, False, None)
    runners["varlen_backward"](*bargs)
    runners["varlen_backward"](*bargs, seqused_q=used)
    runners["varlen_backward"](*bargs, dlse=lse[1], seqused_q=used)
    keys = [c[2] for c in calls if c[0] == "compiled"]
    base = (64, "bf16", True, None, False, False, True, False)
    assert keys[0] == base and keys[1] == base + ("sm_90a", 0.0, None, None, True)
    bbase = (64, "bf16", True, None, False, False, False, True, False)
    assert keys[2] == bbase and keys[3] == bbase + ("sm_90a", 0.0, False, True)
    assert keys[4] == bbase + ("sm_90a", 0.0, True, True)
    launches = [c for c in calls if c[0] != "compiled"]
    assert launches[0][2] == {} and launches[1][2]["seqused_q"] is used
    assert launches[2][2] == {} and launches[3][2]["seqused_q"] is used
    from fa4_final.hopper import host

    assert host.forward_recipe(*keys[1]).kernels["main"].has_seqused_q
    assert not host.forward_recipe(*keys[0]).kernels["main"].has_seqused_q
    kernels = host.backward_recipe(*keys[4]).kernels
    assert kernels["main"].has_seqused_q and kernels["pre"].has_dlse
    assert not host.backward_recipe(*keys[2]).kernels["main"].has_seqused_q


def test_blackwell_refuses_seqused_q_by_name(monkeypatch):
    """Its row has no varlen kernel (the runtime's loop refuses seqused_q) and no seqused_q
    variant (its runners refuse it by name)."""
    row = dispatch.wired(dispatch.BLACKWELL)
    assert "seqused_q" not in row.features and "seqused_q" in dispatch.HOPPER.features
    with pytest.raises(UnsupportedError, match=r"seqused_q=<tensor \(2,\)>: the sm_100a kernels "
                                               r"have no seqused_q variant; .*Hopper"):
        dispatch.refuse_missing("sm_100a", row.features, 0.0, None, None, _used((3, 4)))
    monkeypatch.setenv(pending.ENV, "seqused_q")
    monkeypatch.setattr(prologue, "backend_for", lambda device: row)
    monkeypatch.setattr(prologue, "_BACKENDS", {})
    _, call = list(_seqused_q_entries(_used()))[3]
    with pytest.raises(UnsupportedError, match="seqused_q runs in the varlen kernels only"):
        call()


# ----------------------------------------------------------------------------------------------
# the ops with the three: opcheck (schema, fake vs real, autograd registration)


def test_opcheck_with_dlse_dv_and_seqused_q(cpu_kernels):
    q, k, v = dense(d=192, dv=128)
    torch.library.opcheck(ops.fwd, (q, k, v, 0.125, True, None, 0, False, True))
    q, k, v = dense()
    out, lse = ops.fwd(q, k, v, 0.125, False, None, None, False, True)
    torch.library.opcheck(ops.bwd, (torch.randn_like(out), q, k, v, out, lse, 0.125, False, None,
                                    None, False, 0.0, torch.randn_like(lse)))
    pq, pk, pv, cu_q, cu_k = packed(lens_q=LENS_Q, lens_k=LENS_K, grad=True)
    args = (pq, pk, pv, cu_q, cu_k, None, -1, -1, 0.125, True, None, 0, False, True, 0.0, None,
            _used())
    torch.library.opcheck(ops.varlen_fwd, args)
    out, lse = ops.varlen_fwd(*(t.detach() if isinstance(t, torch.Tensor) else t for t in args))
    torch.library.opcheck(ops.varlen_bwd, (torch.randn_like(out), pq.detach(), pk.detach(),
                                           pv.detach(), out, lse, cu_q, cu_k, None, -1, -1,
                                           0.125, True, None, 0, False, 0.0, None, _used()))
