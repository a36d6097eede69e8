"""fa4_final's custom ops under FakeTensorMode, torch.library.opcheck and torch.compile, on a
CPU. The fake implementations need no kernel; opcheck and the compiled runs use the test-only CPU
reference (tests/fa4_cpu_reference.py) in place of the GPU kernels (tests/gpu/ runs the real
ones)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fa4_final import flash_attn_func, flash_attn_varlen_func
from fa4_final.api import ops

BF16 = torch.bfloat16


def dense(b=2, sq=24, sk=40, h=4, hk=2, d=64, dtype=BF16, grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, s, n, d, generator=g).to(dtype).requires_grad_(grad)
            for s, n in ((sq, h), (sk, hk), (sk, hk))]


def packed(lens_q=(5, 0, 19), lens_k=(9, 4, 0), h=4, hk=2, d=64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(BF16)
    k, v = (torch.randn(sum(lens_k), hk, d, generator=g).to(BF16) for _ in range(2))
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
          for lens in (lens_q, lens_k)]
    return q, k, v, *cu


# ----------------------------------------------------------------------------------------------
# fake tensors: shapes, dtypes and strides with no kernel and no data


def test_fake_forward_and_backward_shapes():
    with FakeTensorMode():
        q = torch.empty(3, 1000, 8, 128, dtype=BF16, device="cuda")
        k = torch.empty(3, 777, 2, 128, dtype=BF16, device="cuda")
        out, lse = ops.fwd(q, k, k, 0.1, True, -1, -1, False, False)
        assert out.shape == q.shape and out.dtype == BF16 and out.device.type == "cuda"
        assert out.is_contiguous() and lse.is_contiguous()
        assert lse.shape == (3, 8, 1000) and lse.dtype == torch.float32
        dq, dk, dv = ops.bwd(out, q, k, k, out, lse, 0.1, True, -1, -1, False)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_fake_varlen_shapes():
    with FakeTensorMode():
        q = torch.empty(1234, 8, 64, dtype=torch.float16, device="cuda")
        k = torch.empty(999, 4, 64, dtype=torch.float16, device="cuda")
        cu = torch.empty(5, dtype=torch.int32, device="cuda")
        used = torch.empty(4, dtype=torch.int32, device="cuda")
        out, lse = ops.varlen_fwd(q, k, k, cu, cu, used, 512, -1, 0.1, False, 64, 0, False,
                                  True)
        assert out.shape == q.shape and lse.shape == (8, 1234)
        dq, dk, dv = ops.varlen_bwd(out, q, k, k, out, lse, cu, cu, None, 512, -1, 0.1, False,
                                    64, 0, False)
        assert dq.shape == q.shape and dk.shape == k.shape


def test_public_functions_run_under_fake_mode():
    """What FA4 users do to compile ahead of time: call the API on fake CUDA tensors."""
    with FakeTensorMode():
        q = torch.empty(2, 300, 8, 128, dtype=BF16, device="cuda")
        k = torch.empty(2, 500, 8, 128, dtype=BF16, device="cuda")
        out, lse = flash_attn_func(q, k, k, causal=True, return_lse=True)
        assert out.shape == q.shape and lse.shape == (2, 8, 300)


def test_fake_impl_checks_inputs():
    with FakeTensorMode():
        q = torch.empty(2, 30, 8, 80, dtype=BF16, device="cuda")
        with pytest.raises(ValueError, match="head_dim must be one of"):
            ops.fwd(q, q, q, 0.1, False, -1, -1, False, False)
        q = torch.empty(2, 30, 8, 96, dtype=BF16, device="cuda")  # runs: head_dims left the gate
        out, lse = ops.fwd(q, q, q, 0.1, False, -1, -1, False, False)
        assert out.shape == q.shape and lse.shape == (2, 8, 30)


# ----------------------------------------------------------------------------------------------
# opcheck: schema, autograd registration, fake vs real, AOT dispatch


def test_opcheck_forward(cpu_kernels):
    q, k, v = dense(grad=True)
    torch.library.opcheck(ops.fwd, (q, k, v, 0.125, False, 6, 3, True, True))


def test_opcheck_backward(cpu_kernels):
    q, k, v = dense()
    out, lse = ops.fwd(q, k, v, 0.125, True, -1, -1, False, False)
    torch.library.opcheck(ops.bwd, (torch.randn_like(out), q, k, v, out, lse, 0.125, True, -1,
                                    -1, False))


def test_opcheck_varlen(cpu_kernels):
    q, k, v, cu_q, cu_k = packed()
    q.requires_grad_(True)
    used = torch.tensor([7, 4, 0], dtype=torch.int32)
    torch.library.opcheck(ops.varlen_fwd, (q, k, v, cu_q, cu_k, used, 19, 9, 0.125, True, -1,
                                           -1, False, True))
    out, lse = ops.varlen_fwd(q.detach(), k, v, cu_q, cu_k, None, -1, -1, 0.125, False, -1, -1,
                              False, False)
    torch.library.opcheck(ops.varlen_bwd, (torch.randn_like(out), q.detach(), k, v, out, lse,
                                           cu_q, cu_k, None, -1, -1, 0.125, False, -1, -1,
                                           False))


# ----------------------------------------------------------------------------------------------
# torch.compile: one graph, the op inside it, no recompile for new lengths


class Block(torch.nn.Module):
    """Attention as a model writes it: projections, the kernel, an output projection."""

    def __init__(self, dim=128, heads=2, kv_heads=1):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.hd, dtype=BF16)
        self.proj = torch.nn.Linear(dim, dim, dtype=BF16)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.hd, self.kv_heads * self.hd,
                                     self.kv_heads * self.hd], dim=-1)
        q = q.reshape(b, s, self.heads, self.hd)
        k, v = (t.reshape(b, s, self.kv_heads, self.hd) for t in (k, v))
        out, _ = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
        return self.proj(out.reshape(b, s, -1))


class GraphCounter:
    """A torch.compile backend that counts graphs and the fa4_final nodes in them, then runs
    them through AOT autograd (forward and backward graphs) like the default backend."""

    def __init__(self):
        self.graphs, self.fa4_nodes = 0, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.fa4_nodes += sum("fa4_final" in str(n.target) for n in gm.graph.nodes)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def test_compile_fullgraph_forward_and_backward(cpu_kernels):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block()
    counter = GraphCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter, dynamic=True)
    x = torch.randn(2, 48, 128, dtype=BF16)
    y = compiled(x)
    torch.testing.assert_close(y, model(x), atol=0, rtol=0)
    y.float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).float().pow(2).mean().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    compiled(torch.randn(3, 80, 128, dtype=BF16))  # other batch and length: the same graph
    assert counter.graphs == 1 and counter.fa4_nodes == 1


def test_compile_aot_eager_varlen(cpu_kernels):
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = packed()

    def f(q, k, v):
        out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                          max_seqlen_q=19, max_seqlen_k=9, causal=True,
                                          return_lse=True)
        return out.float().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    q.requires_grad_(True)
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()
    eager = q.grad.clone()
    q.grad = None
    f(q, k, v).backward()
    torch.testing.assert_close(eager, q.grad)
