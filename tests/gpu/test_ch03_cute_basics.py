"""Chapter 03's three kernels on a CUDA GPU against PyTorch.

Every output buffer is a window of a larger buffer filled with NaN: an element the kernel never
writes stays NaN inside the window, and a write past its edges changes a NaN canary outside it.
GEMM inputs sit in NaN-filled buffers too, so a read past A's or B's edges that reaches a valid
output turns it into NaN. Failures name the shape, dtype, seed and the first bad coordinates.
"""

import pytest
import torch

from solutions import ch03_cute_basics as ch03

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PAD = 64  # canary elements before and after each window: 128-256 bytes, alignment kept
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _window(numel: int, shape, dtype, fill=float("nan")):
    """A contiguous, 16-byte aligned view of ``shape`` inside a NaN buffer with canaries."""
    buf = torch.full((numel + 2 * PAD,), fill, dtype=dtype, device="cuda")
    return buf, buf[PAD:PAD + numel].view(shape)


def _check_canaries(buf, numel, what):
    torch.cuda.synchronize()
    outside = torch.cat([buf[:PAD], buf[PAD + numel:]])
    hit = (~torch.isnan(outside)).nonzero().flatten().tolist()
    assert not hit, (f"{what}: wrote outside the output ({len(hit)} canaries changed, e.g. "
                     f"offsets {[i - PAD if i < PAD else i - PAD + numel for i in hit[:5]]} "
                     "relative to the window's start/end)")


def _first_bad(mask: torch.Tensor, k: int = 5):
    return [tuple(i) for i in mask.nonzero()[:k].tolist()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 255, 256, 257, 100_003])
def test_vector_add(n, dtype):
    seed = 1000 + n
    g = _seeded(seed)
    a, b = (torch.randn(n, device="cuda", generator=g).to(dtype) for _ in range(2))
    buf, out = _window(n, (n,), dtype)
    ch03.vector_add(a, b, out=out)
    _check_canaries(buf, n, f"vector_add n={n} {dtype}")
    what = f"vector_add n={n} {dtype} seed={seed}"
    assert not torch.isnan(out).any(), f"{what}: unwritten elements {_first_bad(out.isnan())}"
    want = a + b  # both round the exact sum once to the dtype
    bad = out != want
    assert not bad.any(), (f"{what}: {int(bad.sum())} wrong, first at {_first_bad(bad)}: got "
                           f"{out[bad][:3].tolist()}, want {want[bad][:3].tolist()}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (17, 264), (100, 1000), (3, 4096), (1000, 72)])
def test_tiled_copy(shape, dtype):
    seed = shape[0] * 7 + shape[1]
    x = torch.randn(shape, device="cuda", generator=_seeded(seed)).to(dtype)
    numel = x.numel()
    buf, out = _window(numel, shape, dtype)
    ch03.tiled_copy(x, out=out)
    _check_canaries(buf, numel, f"tiled_copy {shape} {dtype}")
    what = f"tiled_copy {shape} {dtype} seed={seed} (tile {ch03.COPY_TILE_M} rows)"
    assert not torch.isnan(out).any(), (f"{what}: {int(out.isnan().sum())} elements never "
                                        f"written, first (row, col) {_first_bad(out.isnan())}")
    bad = out != x
    assert not bad.any(), f"{what}: {int(bad.sum())} wrong, first at {_first_bad(bad)}"


GEMM_SHAPES = [(64, 64, 64), (1, 1, 8), (77, 131, 136), (128, 200, 264), (513, 257, 1000),
               (1024, 1024, 512)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mnk", GEMM_SHAPES)
def test_gemm_tn(mnk, dtype):
    m, n, k = mnk
    seed = m * 31 + n * 7 + k
    g = _seeded(seed)
    # Inputs inside NaN buffers: a read past an edge that reaches a valid output makes it NaN.
    a_buf, a = _window(m * k, (m, k), dtype)
    b_buf, b = _window(n * k, (n, k), dtype)
    a.copy_(torch.randn(m, k, device="cuda", generator=g))
    b.copy_(torch.randn(n, k, device="cuda", generator=g))
    buf, out = _window(m * n, (m, n), torch.float32)
    ch03.gemm_tn(a, b, out=out)
    what = f"gemm_tn M={m} N={n} K={k} {dtype} seed={seed}"
    _check_canaries(buf, m * n, what)
    nan = out.isnan()
    assert not nan.any(), (f"{what}: {int(nan.sum())} outputs NaN (never written, or a read "
                           f"past an edge of A/B), first (m, n) {_first_bad(nan)}")
    ref = a.double() @ b.double().T
    err = (out.double() - ref).abs()
    # fp32 accumulation of exact bf16/fp16 products: |error| <= ~K * 2^-23 * sum|a_i b_i|.
    bound = k * 2.0**-22 * (a.double().abs() @ b.double().abs().T) + 1e-6
    bad = err > bound
    worst = divmod(int(err.argmax()), n)
    assert not bad.any(), (f"{what}: {int(bad.sum())} outputs beyond the fp32 accumulation "
                           f"bound, first {_first_bad(bad)}; worst |error| {err.max():.3e} at "
                           f"{worst} (got {out[worst].item():.6f}, want {ref[worst].item():.6f})")
    # Tensor cores may truncate when they add: allow 1e-4, still 40x below one bf16 rounding
    # (3.9e-3); a wrong tile, k-block or fragment gives errors of order 1.
    rel = (err.norm() / ref.norm()).item()
    assert rel < 1e-4, f"{what}: relative L2 error {rel:.2e}"


def test_one_compile_serves_every_size():
    x = torch.randn(5, 16, device="cuda", dtype=torch.bfloat16)
    ch03.tiled_copy(x)
    before = dict(ch03._COMPILED)
    for rows, cols in [(9, 24), (300, 8)]:
        y = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(ch03.tiled_copy(y), y)
    assert ch03._COMPILED.keys() == before.keys(), "a new size triggered a recompile"


def test_gpu_kernels_match_their_cpu_runs():
    """The per-thread code run in a loop on the CPU and the kernel on the GPU agree."""
    a, b = torch.randn(2, 1000).unbind(0)
    gpu = ch03.vector_add(a.cuda(), b.cuda()).cpu()
    cpu = torch.from_numpy(ch03.vector_add_on_cpu(a.numpy(), b.numpy()))
    assert torch.equal(gpu, cpu)
    x = torch.randn(33, 260)
    assert torch.equal(ch03.tiled_copy(x.cuda()).cpu(),
                       torch.from_numpy(ch03.tiled_copy_on_cpu(x.numpy())))


def test_bad_output_buffers_are_rejected():
    a = torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must be"):
        ch03.gemm_tn(a, a, out=torch.empty(4, 5, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        ch03.tiled_copy(a, out=torch.empty(16, 4, device="cuda", dtype=torch.bfloat16).T)
