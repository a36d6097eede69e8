"""Compile a CuTe DSL kernel for a chosen GPU architecture on a machine with no GPU.

The CuTe DSL compiler needs no driver: give it fake tensors (symbolic extents, a dtype and an
alignment) and a target such as ``sm_90a`` and it produces PTX and a cubin. From the cubin we
read what a kernel engineer checks before any run: registers per thread, the stack frame (local
memory, where spills land), spill instructions in the SASS, static shared memory.

    art = compile_for("sm_90a", my_jit_fn, fake_a, fake_b, fake_stream())
    art.require("wgmma.mma_async", "cp.async.bulk.tensor")   # raises, naming what is missing
    art.resources()                                             # registers, frame, spills

Kernels must be defined in a file or a notebook cell: the DSL reads their source.
"""

from __future__ import annotations

import tempfile
import time

import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor

# The artifact types and the cubin/SASS readers are fa4_final.runtime.compile's (one copy for the
# course and the package); this module adds the course's own compile helper around them.
from fa4_final.runtime.compile import (
    ARCHS,
    Artifacts,
    KernelResources,
    disassemble,
    kernel_resources,
)


def fake_tensor(dtype, shape, stride_order=None, align: int = 16):
    """A fake global-memory tensor: ints in ``shape`` are fixed, ``None`` becomes a symbolic
    extent (divisible by 1), so one compiled kernel serves any such size."""
    dims = tuple(cute.sym_int32() if s is None else s for s in shape)
    return make_fake_compact_tensor(dtype, dims, stride_order=stride_order, assumed_align=align)


def fake_stream():
    import cutlass.runtime

    return cutlass.runtime.make_fake_stream()


def compile_for(arch: str, fn, *args, sass: bool = True, **kwargs) -> Artifacts:
    """Compile ``fn`` (a ``@cute.jit`` function) for ``arch`` with no GPU present."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    from cutlass.base_dsl.compiler import DumpDir

    # KeepPTX/KeepCUBIN also write files; send them to a scratch folder, not the working dir.
    with tempfile.TemporaryDirectory(prefix="cute_dump_") as dump:
        opts = (cute.KeepPTX, cute.KeepCUBIN, cute.GPUArch(arch), DumpDir(dump))
        t0 = time.perf_counter()
        compiled = cute.compile[opts](fn, *args, **kwargs)
        seconds = time.perf_counter() - t0
    ptx = compiled.__ptx__ or ""
    cubin = compiled.__cubin__ or b""
    sass_text = disassemble(cubin) if sass and cubin else ""
    return Artifacts(arch, ptx, cubin, sass_text, seconds, kernel_resources(cubin, sass_text))


__all__ = [
    "ARCHS",
    "Artifacts",
    "KernelResources",
    "compile_for",
    "disassemble",
    "fake_stream",
    "fake_tensor",
    "kernel_resources",
]
