"""What to compile for one pass, and the fake arguments it is compiled with.

A kernel is compiled from *fake* tensors (symbolic extents and strides with a known
divisibility), so one compiled function serves every batch, length and head count. Each
architecture's host module describes a pass as a ``Recipe``: its kernels by role (the forward's
"main"; the backward's "pre", "main", "post"), the fake arguments of each, the target and the
config its launch needs. The runtime's one compile path (fa4_final.runtime.compile) turns a
recipe into compiled functions, through the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import cutlass.cute as cute
from cutlass import Float32


@dataclass(frozen=True)
class Recipe:
    tag: str  # the pass: "fwd" or "bwd"
    arch: str  # "sm_90a", "sm_100a"
    kernels: dict  # role -> kernel object (cache_key(), a @cute.jit __call__)
    fake_args: Callable[[str], tuple]  # role -> the fake arguments it is compiled with
    config: object = None  # the resolved config, for the launch


def fake_tensor(dtype, shape, divisibility: int = 1, leading_dim: int | None = -1,
                stride=None):
    """A fake global-memory tensor. ``shape`` entries are ints or ``cute.sym_int()``; strides
    are symbolic and divisible by ``divisibility`` elements except the stride-1 ``leading_dim``
    (the layout ``from_dlpack(t).mark_layout_dynamic(leading_dim)`` produces at run time)."""
    if leading_dim is not None and leading_dim < 0:
        leading_dim += len(shape)
    if stride is None:
        stride = tuple(1 if i == leading_dim else cute.sym_int64(divisibility=divisibility)
                       for i in range(len(shape)))
    align = max(divisibility * dtype.width // 8, 1)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def fake_attention_tensors(dtype, head_dim: int, head_dim_v: int | None = None) -> tuple:
    """Fake (q, k, v, out, lse) of an attention call: symbolic batch, lengths and heads
    (b, s_q, h, D) for q, (b, s_k, h_kv, D) for k, (b, s_k, h_kv, dv) for v and (b, s_q, h, dv)
    for out (dv = ``head_dim_v``, D if None), strides of 16-byte multiples (TMA), lse float32
    (b, h, s_q). Every kernel's fake arguments start from these."""
    dv = head_dim if head_dim_v is None else head_dim_v
    div = 128 // dtype.width  # 16-byte strides, in elements
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))
    q = fake_tensor(dtype, (b, sq, h, head_dim), divisibility=div)
    k = fake_tensor(dtype, (b, sk, hk, head_dim), divisibility=div)
    v = fake_tensor(dtype, (b, sk, hk, dv), divisibility=div)
    out = fake_tensor(dtype, (b, sq, h, dv), divisibility=div)
    lse = fake_tensor(Float32, (b, h, sq), divisibility=1)
    return q, k, v, out, lse


def fake_stream():
    """The stream argument of a TVM-FFI kernel: at run time the caller's current stream."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
