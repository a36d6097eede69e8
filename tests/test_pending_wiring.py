"""Three more pending features wired through fa4_final's API behind the gate of
fa4_final.runtime.pending (Note [Pending features]), on a CPU:

- lse_fold: with FA4_FINAL_PENDING listing it, the autograd backward of a call that returns the
  lse and uses it makes ONE backward call that takes dlse (the has_dlse builds, Note [The lse
  gradient folded]) instead of Note [Gradient of the returned lse]'s second call; without it,
  the probe's path is taken exactly as before. A dlse given to a runtime entry point is checked
  (named when bad), then gated; the Hopper row puts has_dlse in the compile key only when a
  dlse is given, the Blackwell row refuses it by name.

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
from utils.reference import attention_reference_features

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
GATE = "does not run"  # the gate's words (runtime.pending.refuse_pending)
DEVICE = "runs on CUDA GPUs"  # the device check's (runtime.dispatch.backend_for)


@pytest.fixture(autouse=True)
def no_pending(monkeypatch):
    monkeypatch.delenv(pending.ENV, raising=False)


@pytest.fixture
def cpu_kernels():
    with ref.active():
        yield


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


def _counting(monkeypatch, name: str):
    """Record each call of api.ops' backward op ``name`` ('bwd' or 'varlen_bwd') that the
    autograd formula makes, with whether it was given a dlse."""
    calls = []
    op = getattr(ops, name)

    def counted(*args):
        calls.append(len(args) > (11 if name == "bwd" else 16) and args[-1] is not None)
        return op(*args)

    monkeypatch.setattr(ops, name, counted)
    return calls


# ----------------------------------------------------------------------------------------------
# lse_fold


def test_lse_fold_is_a_pending_row_and_listed_reads_the_environment(monkeypatch):
    assert "lse_fold" in pending.PENDING and pending.PENDING["lse_fold"]
    assert not pending.listed("lse_fold") and pending.listed("not_a_pending_feature")
    monkeypatch.setenv(pending.ENV, "softcap, lse_fold")
    assert pending.listed("lse_fold")


def _loss_on_lse(q, k, v, causal, **kw):
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, **kw)
    g = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=g)
    dlse = torch.randn(lse.shape, generator=g)
    return (out.float() * dout).sum() + (lse.where(lse.isfinite(), 0.0) * dlse).sum(), dout, dlse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fold", [False, True])
def test_lse_fold_chooses_one_backward_call_and_both_paths_equal_float64(
        monkeypatch, cpu_kernels, causal, fold):
    """sq > sk with causal: rows that see no key (lse = -inf, no gradient either way)."""
    if fold:
        monkeypatch.setenv(pending.ENV, "lse_fold")
    calls = _counting(monkeypatch, "bwd")
    q, k, v = dense(sq=40, sk=24, grad=True)
    loss, dout, dlse = _loss_on_lse(q, k, v, causal)
    grads = torch.autograd.grad(loss, [q, k, v])
    assert calls == ([True] if fold else [False, False])
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out64, lse64 = attention_reference_features(*leaves, causal, None, 0.0, None)
    finite = lse64.isfinite()
    ref_loss = (out64 * dout.double()).sum() + (lse64.where(finite, 0.0) * dlse.double()).sum()
    for name, got, want in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref_loss, leaves)):
        err = (got.double() - want).abs().max() / want.abs().max().clamp(min=1)
        assert err < 3e-2, (name, float(err))


def test_lse_fold_changes_nothing_without_a_loss_on_lse_or_without_return_lse(
        monkeypatch, cpu_kernels):
    monkeypatch.setenv(pending.ENV, "lse_fold")
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
    results = []
    for env in ("softcap,learnable_sink", "softcap,learnable_sink,lse_fold"):
        monkeypatch.setenv(pending.ENV, env)
        q, k, v = dense(sq=40, sk=24, grad=True)
        s = sink.clone().requires_grad_(True)
        loss, _, _ = _loss_on_lse(q, k, v, True, softcap=5.0, learnable_sink=s)
        results.append(torch.autograd.grad(loss, [q, k, v, s]))
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_lse_fold_varlen_one_call_equals_the_probe_path(monkeypatch, cpu_kernels):
    results = []
    for env, want in (("", [False, False]), ("lse_fold", [True])):
        monkeypatch.setenv(pending.ENV, env)
        calls = _counting(monkeypatch, "varlen_bwd")
        pq, pk, pv, cu_q, cu_k = packed(lens_q=(5, 7, 19), lens_k=(9, 0, 30), grad=True)
        out, lse = flash_attn_varlen_func(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                          causal=True, return_lse=True)
        loss = out.float().square().sum() + lse.where(lse.isfinite(), 0.0).square().sum()
        results.append(torch.autograd.grad(loss, [pq, pk, pv]))
        assert calls == want
        monkeypatch.undo()
        monkeypatch.delenv(pending.ENV, raising=False)
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_lse_fold_under_compile_fullgraph(monkeypatch, cpu_kernels):
    monkeypatch.setenv(pending.ENV, "lse_fold")
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


def test_a_dlse_to_the_runtime_is_gated_then_gets_to_the_device_check(monkeypatch):
    q, k, v, out, lse, grads = _bwd_args()
    pq, pk, pv, cu_q, cu_k = packed()
    plse = torch.zeros(4, pq.shape[0])
    pgrads = (torch.zeros_like(pq), torch.zeros_like(pk), torch.zeros_like(pv))
    calls = [("backward_into", lambda: prologue.backward_into(
                 q, k, v, out, lse, out, *grads, dlse=torch.ones_like(lse))),
             ("varlen_backward_into", lambda: varlen.varlen_backward_into(
                 pq, pk, pv, torch.zeros_like(pq), plse, torch.zeros_like(pq), *pgrads, cu_q,
                 cu_k, None, None, None, dlse=torch.ones_like(plse)))]
    for func, call in calls:
        with pytest.raises(UnsupportedError) as info:
            call()
        message = str(info.value)
        assert func in message and "FA4's lse_fold=<tensor" in message, message
        assert f"{GATE} lse_fold yet" in message and pending.ENV in message, message
    monkeypatch.setenv(pending.ENV, "lse_fold")
    for _, call in calls:
        with pytest.raises(UnsupportedError, match=DEVICE):
            call()


@pytest.mark.parametrize("bad, words", [
    (torch.zeros(2, 4, 23), r"dlse must be a floating tensor of lse's shape \(2, 4, 24\)"),
    (torch.zeros(2, 4, 24, dtype=torch.int32), r"got torch.int32 \(2, 4, 24\)"),
    (1.0, "got float")])
def test_a_bad_dlse_is_named_before_the_gate(bad, words):
    q, k, v, out, lse, grads = _bwd_args()
    with pytest.raises(ValueError, match=words):
        prologue.backward_into(q, k, v, out, lse, out, *grads, dlse=bad)


def test_sdpa_backward_folds_dlse_into_one_call_only_when_listed(monkeypatch):
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
    assert seen == [False, False]  # Note [Gradient of the returned lse]: the probe's call
    seen.clear()
    monkeypatch.setenv(pending.ENV, "lse_fold")
    sdpa._flash_attn_bwd(q, k, v, out, out, lse, dlse=dlse)
    sdpa._flash_attn_bwd(q, k, v, out, out, lse)
    assert seen == [True, False]


def _recording(monkeypatch):
    calls = []

    class Plan:
        config = None

    def compiled(recipe_fn, *args):
        calls.append(("compiled", recipe_fn.__name__, args))
        return Plan()

    def launch(name):
        return lambda *args, **kw: calls.append((name, args, kw))

    monkeypatch.setattr(dispatch, "compiled", compiled)
    host = dispatch.HOPPER.host
    for name in ("launch_forward", "launch_backward", "launch_varlen_forward",
                 "launch_varlen_backward"):
        monkeypatch.setattr(host, name, launch(name))
    return calls


def test_hopper_puts_has_dlse_in_the_backward_key_only_when_given(monkeypatch):
    calls = _recording(monkeypatch)
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
