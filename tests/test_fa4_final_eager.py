"""fa4_final's eager path (Note [The eager path], api/ops.py) on a CPU: the same results,
gradients and errors as the custom ops, the checks run once per public call, the launch plans
looked up once, and the ops still taken wherever something must see them (fake tensors,
torch.compile, dispatch modes, functorch, a double backward).

The eager path is for CUDA tensors; here ``ops.EAGER_DEVICE_TYPES`` admits CPU tensors too and
the device's backend computes with the test-only CPU reference (tests/fa4_cpu_reference.py),
which the ops get as their CPU kernels: both paths compute the same numbers."""

from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fa4_final import flash_attn_func
from fa4_final.api import interface, ops
from fa4_final.hopper import host
from fa4_final.runtime import checks, dispatch, prologue
from fa4_final.runtime import compile as compile_path
from tests import fa4_cpu_reference as ref

BF16 = torch.bfloat16


def qkv(b=2, sq=24, sk=40, h=4, hk=2, d=64, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(b, s, n, d, generator=g).to(BF16) for s, n in ((sq, h), (sk, hk), (sk, hk))]
    return [t.requires_grad_(grad) for t in ts]


class RefBackend:
    """The Hopper row with its forward and backward computed by the CPU reference."""

    def __init__(self):
        self.calls = []
        self.dlse_given = []  # per backward call: whether it was given the lse's gradient

    def forward(self, q, k, v, out, lse, causal, scale, left, right, config):
        self.calls.append("forward")
        o, s = ref.dense_forward(q, k, v, scale, causal, left, right)
        out.copy_(o)
        lse.copy_(s)

    def backward(self, q, k, v, out, lse, dout, dq, dk, dv, causal, scale, left, right, det,
                 config=None, dlse=None):
        self.calls.append("backward")
        self.dlse_given.append(dlse is not None)
        for t, g in zip((dq, dk, dv), ref.dense_backward(dout, q, k, v, out, lse, scale, causal,
                                                         left, right, dlse=dlse)):
            t.copy_(g)


@pytest.fixture
def eager_backend(monkeypatch):
    """CPU tensors take the eager path, on the reference backend; so do the ops' own
    implementations (fwd_impl, bwd_impl: every layer's checks). Yields the backend, whose
    ``calls`` record the launches."""
    rec = RefBackend()
    backend = replace(dispatch.BACKENDS[0], forward=rec.forward, backward=rec.backward)
    monkeypatch.setattr(prologue, "backend_for", lambda device: backend)
    monkeypatch.setattr(ops, "EAGER_DEVICE_TYPES", ("cuda", "cpu"))
    return rec


@pytest.fixture
def eager_cpu(eager_backend):
    """eager_backend, with the ops' CPU kernels the reference itself (``ref.active``)."""
    with ref.active():
        yield eager_backend


def op_path(monkeypatch):
    monkeypatch.setattr(ops, "EAGER_DEVICE_TYPES", ("cuda",))


def grads_of(q, k, v, return_lse=False, **kw):
    out, lse = flash_attn_func(q, k, v, return_lse=return_lse, **kw)
    loss = out.float().square().sum()
    if return_lse:
        loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).sum()
    return (out, lse, *torch.autograd.grad(loss, (q, k, v)))


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(7, 3)),
                                dict(softmax_scale=0.3, return_lse=True),
                                dict(causal=True, return_lse=True, deterministic=True)])
def test_eager_path_matches_the_ops(eager_cpu, monkeypatch, kw):
    q, k, v = qkv()
    eager = grads_of(q, k, v, **kw)
    # one backward call, the lse's gradient folded into it when the loss uses the lse (lse_fold)
    assert eager_cpu.calls == ["forward", "backward"]
    assert eager_cpu.dlse_given == ["return_lse" in kw]
    op_path(monkeypatch)
    calls = len(eager_cpu.calls)
    via_ops = grads_of(q, k, v, **kw)
    assert len(eager_cpu.calls) == calls  # the ops ran their CPU kernels, not the backend
    for a, b in zip(eager, via_ops):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert eager[1].requires_grad == via_ops[1].requires_grad


def test_eager_return_conventions(eager_cpu):
    q, k, v = qkv(grad=False)
    out, lse = flash_attn_func(q, k, v)
    assert lse is None and not out.requires_grad
    q, k, v = qkv()
    out, lse = flash_attn_func(q, k, v)
    assert out.requires_grad and out.grad_fn is not None and not lse.requires_grad
    with torch.no_grad():
        out, lse = flash_attn_func(q, k, v)
    assert out.grad_fn is None and lse is not None and not lse.requires_grad
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert lse.requires_grad
    out.sum().backward()  # lse unused: its gradient arrives as None, one backward only
    assert eager_cpu.calls.count("backward") == 1


def counting(monkeypatch):
    """check_inputs counted wherever a layer calls it."""
    count = [0]
    for module in (checks, interface, ops, prologue):
        original = module.check_inputs

        def counted(*a, _original=original, **k):
            count[0] += 1
            return _original(*a, **k)

        monkeypatch.setattr(module, "check_inputs", counted)
    return count


def test_inputs_are_checked_once_per_call(eager_cpu, monkeypatch):
    count = counting(monkeypatch)
    q, k, v = qkv()
    flash_attn_func(q.detach(), k.detach(), v.detach())
    assert count[0] == 1
    count[0] = 0
    out, _ = flash_attn_func(q, k, v, causal=True)
    torch.autograd.grad(out.sum(), (q, k, v))  # the backward checks nothing again
    assert count[0] == 1 and eager_cpu.calls == ["forward", "forward", "backward"]


def test_the_ops_path_checks_in_every_layer(eager_backend, monkeypatch):
    """What the eager path saves: through the ops each layer checks again (three times: the
    public function, the forward's op and the backward's op, each through the prologue)."""
    op_path(monkeypatch)
    count = counting(monkeypatch)
    q, k, v = qkv()
    out, _ = flash_attn_func(q, k, v)
    torch.autograd.grad(out.sum(), (q, k, v))
    assert count[0] == 3 and eager_backend.calls == ["forward", "backward"]


@pytest.mark.parametrize("shift", [1, 3])
def test_a_misaligned_input_gets_the_same_error(eager_backend, monkeypatch, shift):
    q, k, v = qkv(grad=False)
    base = torch.zeros(q.numel() + 8, dtype=BF16)
    odd = base[shift:shift + q.numel()].view(q.shape)  # contiguous, address % 16 = 2 * shift
    with pytest.raises(ValueError) as eager:
        flash_attn_func(odd, k, v)
    op_path(monkeypatch)
    with pytest.raises(ValueError) as via_ops:
        flash_attn_func(odd, k, v)
    assert str(eager.value) == str(via_ops.value) and "address % 16" in str(eager.value)


def test_a_misaligned_dout_gets_the_same_error(eager_backend, monkeypatch):
    q, k, v = qkv()
    base = torch.zeros(q.numel() + 8, dtype=BF16)
    dout = base[1:1 + q.numel()].view(q.shape)
    errors = []
    for eager in (True, False):
        if not eager:
            op_path(monkeypatch)
        out, _ = flash_attn_func(q, k, v)
        with pytest.raises(ValueError, match="dout needs strides") as e:
            torch.autograd.grad(out, (q, k, v), dout)
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_bad_inputs_fail_before_any_path(eager_cpu):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="head_dim must be one of"):
        flash_attn_func(q[..., :48], k[..., :48], v[..., :48])
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        flash_attn_func(q, k, v, deterministic=1)
    assert eager_cpu.calls == []


def test_a_cpu_tensor_still_names_the_supported_gpus():
    from fa4_final.common.errors import UnsupportedError

    q, k, v = qkv()
    with pytest.raises(UnsupportedError, match="runs on CUDA GPUs"):
        flash_attn_func(q, k, v)


# ----------------------------------------------------------------------------------------------
# where the ops are taken


class Spy(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_the_op(eager_cpu):
    q, k, v = qkv(grad=False)
    with Spy() as spy:
        flash_attn_func(q, k, v)
    assert any("fa4_final.fwd" in op for op in spy.ops) and eager_cpu.calls == []


def test_fake_tensors_take_the_op(eager_cpu):
    with FakeTensorMode():
        q = torch.empty(2, 300, 8, 128, dtype=BF16)
        out, lse = flash_attn_func(q, q, q, return_lse=True)
        assert out.shape == q.shape and lse.shape == (2, 8, 300)
    assert eager_cpu.calls == []


def test_a_tensor_subclass_takes_the_op(eager_cpu):
    q, k, v = qkv(grad=False)
    assert ops.eager(q, k, v)
    assert not ops.eager(torch.nn.Parameter(q), k, v)


def test_functorch_takes_the_op(eager_cpu):
    q, k, v = qkv(grad=False)
    seen = []

    def f(q):
        seen.append(ops.eager(q, k, v))
        return q.sum()

    torch.func.grad(f)(q.float())
    assert seen == [False]


def test_torch_compile_keeps_the_op_in_the_graph(eager_cpu):
    torch._dynamo.reset()
    nodes = []

    def backend(gm, example_inputs):
        nodes.extend(str(n.target) for n in gm.graph.nodes)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    q, k, v = qkv()
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True)[0], fullgraph=True,
                      backend=backend)
    out = f(q, k, v)
    out.float().sum().backward()
    assert any("fa4_final.fwd" in n for n in nodes) and eager_cpu.calls == []
    torch._dynamo.reset()


def test_a_double_backward_goes_through_the_op(eager_cpu, monkeypatch):
    seen = []
    original = ops.bwd

    def spy_bwd(*args):
        seen.append(len(args))
        return original(*args)

    monkeypatch.setattr(ops, "bwd", spy_bwd)
    q, k, v = qkv()
    out, _ = flash_attn_func(q, k, v)
    torch.autograd.grad(out.float().sum(), (q, k, v), create_graph=True)
    assert seen and "backward" not in eager_cpu.calls


def test_a_backward_under_a_dispatch_mode_goes_through_the_op(eager_cpu):
    q, k, v = qkv()
    out, _ = flash_attn_func(q, k, v)  # eager: the Function
    assert eager_cpu.calls == ["forward"]
    with Spy() as spy:
        torch.autograd.grad(out.float().sum(), (q, k, v))
    assert any("fa4_final.bwd" in op for op in spy.ops) and eager_cpu.calls == ["forward"]


# ----------------------------------------------------------------------------------------------
# the launch layers look their plans up once


@pytest.fixture
def fake_compiles(monkeypatch):
    """The compile path with every kernel a recorder of its launches: (builds, launches)."""
    builds, launches = [], []

    def cached(key, build):
        builds.append(key)
        return lambda *a, role=key[1]: launches.append((role, a))

    monkeypatch.setattr(compile_path, "cached", cached)
    monkeypatch.setattr(compile_path, "_PLANS", {})
    monkeypatch.setattr(host, "num_sms", lambda device: 132)
    return builds, launches


def test_forward_plan_is_looked_up_once(fake_compiles):
    builds, launches = fake_compiles
    q, k, v = qkv(grad=False)
    out = torch.empty_like(q)
    lse = torch.empty(2, 4, 24)
    for causal in (False, True, False, True):
        dispatch.HOPPER.forward(q, k, v, out, lse, causal, 0.1, None, 0 if causal else None)
    launches = [a for _, a in launches]
    assert len(builds) == 2 and len(launches) == 4
    assert launches[0][9:11] == (2 * 4, 132)  # the (head, batch) group and the SM count
    # non-causal: the tile table, no counter; causal: the dynamic scheduler's counter, no table
    assert launches[0][14] is not None and launches[0][18] is None
    assert launches[1][14] is None and launches[1][18].shape == (1,)
    assert launches[3][18] is launches[1][18]  # one counter per device and stream


def test_backward_plan_is_looked_up_once(fake_compiles):
    builds, launched = fake_compiles
    q, k, v = qkv(grad=False)
    out, dout, dq = (torch.empty_like(q) for _ in range(3))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    lse = torch.empty(2, 4, 24)
    for det in (False, False, True, True):
        dispatch.HOPPER.backward(q, k, v, out, lse, dout, dq, dk, dv, False, 0.1, None, None,
                                 det)
    assert len(builds) == 2 * 3 and [r for r, _ in launched] == ["pre", "main", "post"] * 4
    turns = [a[6] for r, a in launched if r == "pre"]
    assert turns[0] is turns[1] and turns[0].shape == (1, 1, 1)  # one unused dummy
    assert turns[2].shape == (2, 4, 1) and turns[2] is not turns[3]


def test_the_backends_contract_runs_no_check(fake_compiles, monkeypatch):
    """Below the prologue nothing checks again: the inputs arrive checked."""
    seen = []
    for module in (checks, prologue):
        monkeypatch.setattr(module, "check_inputs", lambda *a, **k: seen.append("checked"))
    q, k, v = qkv(grad=False)
    lse = torch.empty(2, 4, 24)
    dispatch.HOPPER.backward(q, k, v, q, lse, q, q, k, v, True, 0.1, 5, 0, True)
    assert seen == [] and [r for r, _ in fake_compiles[1]] == ["pre", "main", "post"]


def test_a_profiler_trace_names_the_calls(eager_cpu):
    q, k, v = qkv()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out, _ = flash_attn_func(q, k, v)
        torch.autograd.grad(out.sum(), (q, k, v))
    names = {e.name for e in prof.events()}
    assert {"fa4_final::fwd", "fa4_final::bwd"} <= names
    assert eager_cpu.calls == ["forward", "backward"]
