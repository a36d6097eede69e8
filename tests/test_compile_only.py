"""Compiling CuTe DSL for a chosen GPU on a machine without one."""

import cutlass
import pytest

from tests.tiny_kernels import exp2, scale
from utils.compile_only import compile_for, fake_stream, fake_tensor, kernel_resources


@pytest.fixture(scope="module", params=["sm_90a", "sm_100a"])
def scaled(request):
    x = fake_tensor(cutlass.Float32, (None,))
    y = fake_tensor(cutlass.Float32, (None,))
    return compile_for(request.param, scale, x, y, cutlass.Float32(2.0), fake_stream())


def test_targets_the_requested_arch(scaled):
    assert f".target {scaled.arch}" in scaled.ptx
    scaled.require("ld.global", "st.global", "mul.f32")
    with pytest.raises(AssertionError, match="lacks"):
        scaled.require("wgmma.mma_async")


def test_resources_are_read_from_the_cubin(scaled):
    assert len(scaled.kernels) == 1
    k = scaled.kernels[0]
    assert k.short_name == "_scale_kernel"
    assert 4 <= k.registers <= 32
    assert k.frame_bytes == 0 and k.spill_instructions == 0
    assert "FMUL" in scaled.sass or "FMUL" in scaled.sass.upper()


def test_mufu_exp2_in_ptx_and_sass():
    x = fake_tensor(cutlass.Float32, (128,))
    art = compile_for("sm_90a", exp2, x, fake_tensor(cutlass.Float32, (128,)), fake_stream())
    art.require("ex2.approx")
    art.require("MUFU.EX2", where="sass")


def test_rejects_unknown_arch():
    with pytest.raises(ValueError, match="arch must be one of"):
        compile_for("sm_75", scale)


def test_kernel_resources_rejects_non_elf():
    assert kernel_resources(b"") == []
    with pytest.raises(ValueError, match="ELF"):
        kernel_resources(b"not an elf file")
