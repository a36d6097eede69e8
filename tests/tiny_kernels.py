"""Tiny CuTe DSL programs used to test the compile-only helper."""

import cutlass
import cutlass.cute as cute


@cute.kernel
def _scale_kernel(g_x: cute.Tensor, g_y: cute.Tensor, alpha: cutlass.Float32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < cute.size(g_x):
        g_y[i] = g_x[i] * alpha


@cute.jit
def scale(m_x: cute.Tensor, m_y: cute.Tensor, alpha: cutlass.Float32, stream):
    n = cute.size(m_x)
    _scale_kernel(m_x, m_y, alpha).launch(grid=((n + 127) // 128, 1, 1), block=(128, 1, 1),
                                          stream=stream)


@cute.kernel
def _exp2_kernel(g_x: cute.Tensor, g_y: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    if tidx < cute.size(g_x):
        g_y[tidx] = cute.math.exp2(g_x[tidx], fastmath=True)


@cute.jit
def exp2(m_x: cute.Tensor, m_y: cute.Tensor, stream):
    _exp2_kernel(m_x, m_y).launch(grid=(1, 1, 1), block=(128, 1, 1), stream=stream)
