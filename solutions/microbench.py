"""Microbenchmarks for chapters 00, 04 and 06: how fast one SM computes exp2, reads shared memory
and issues mma.sync. The kernels live here; ``python -m measure.microbench`` runs them (with a
large matmul, an HBM copy and the cost of an eager operator) and stores
results/<gpu>/microbench.json.

The cycle model of chapter 00 (``utils/roofline.py``) divides work by per-SM, per-clock figures:
16 exp2 per clock on MUFU, 128 bytes per clock from shared memory (ANCHORS.md). Here we measure
them, and the mixes of chapter 06, with kernels that do nothing else.

exp2 throughput (``ExpThroughput``). Each thread keeps CHAINS = 8 independent values in
registers and, UNROLL * steps times, replaces each by 2^-v: MUFU ``ex2.approx.ftz.f32`` for some
chains and chapter 06's FMA polynomial for the others, so ``emulated`` of 8 chains (0, 12.5, 25,
37.5, 50, 75, 100 %) go to the polynomial. v -> 2^-v maps [0, 1] into [0.5, 1] and converges to
0.64, so every value stays an ordinary float; the chains' sum is stored, so nothing is dead code.
Enough work hides the latency: 64 warps per SM, 8 independent chains each.

shared-memory bandwidth (``SmemBandwidth``). Each thread reads 16 B (``ld.shared.v4``, LDS.128)
or 4 B (LDS) per load; a warp's 32 loads cover consecutive addresses, so a 16-byte load is
4 conflict-free wavefronts of 128 B and a 4-byte load is one. ``ld.volatile`` keeps the compiler
from hoisting loads whose address does not change from one loop trip to the next.

Clocks. A block's thread 0 reads ``%clock64`` (the SM's cycle counter) after a barrier before
and after the loop, and ``%smid``. Per SM: cycles = last end - first start over its blocks (one
counter per SM, so those compare), work = the blocks' work, rate = work / cycles: per SM per
clock with no assumption about the clock frequency. The chip-wide rate uses CUDA-event time
(median of a few runs after warm-up); cycles / time gives the SM clock the run actually had.
"""

from __future__ import annotations

import statistics

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from solutions import ch06_exp2 as ch06

CHAINS = 8  # independent exp2 chains per thread; mixes are k/8 of them emulated
UNROLL = 4  # loop trips unrolled at compile time, so the loop's own 3 instructions are ~1 %
EXP_FRACTIONS = (0, 1, 2, 3, 4, 6, 8)  # emulated chains of 8
MMA_CHAINS = 8  # independent 16 x 8 accumulators per warp in the mma.sync benchmark
SMEM_LOADS_IN_FLIGHT = 4  # rows of the buffer one thread reads per loop trip
# 1024-thread blocks, 2 per SM: an SM holds at most 2048 threads, so the block scheduler cannot
# give one SM more blocks than another, and 64 warps per SM hide every latency.
THREADS = 1024
BLOCKS_PER_SM = 2
CLOCK_FIELDS = 4  # per block: smid, start cycle, end cycle, unused


# ----------------------------------------------------------------------------------------------
# Small PTX helpers


@dsl_user_op
def sm_id(*, loc=None, ip=None) -> Int32:
    """The SM this thread runs on (``%smid``)."""
    return Int32(
        llvm.inline_asm(T.i32(), [], "mov.u32 $0, %smid;", "=r", has_side_effects=True,
                        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    )


@dsl_user_op
def ld_shared_volatile(addr: Int32, offset: int, words: int, *, loc=None, ip=None):
    """``words`` (1 or 4) 32-bit words from shared byte address ``addr + offset``; volatile, so
    each one is executed even when the address repeats. Returns a tuple of Uint32."""
    if words == 1:
        value = llvm.inline_asm(
            T.i32(), [Int32(addr).ir_value(loc=loc, ip=ip)],
            f"ld.volatile.shared.u32 $0, [$1+{offset}];", "=r,r",
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
        return (Uint32(value),)
    if words != 4:
        raise ValueError(f"words must be 1 or 4 (4 or 16 bytes), got {words!r}")
    i32 = T.i32()
    struct = llvm.inline_asm(
        llvm.StructType.get_literal([i32] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
        f"ld.volatile.shared.v4.u32 {{$0, $1, $2, $3}}, [$4+{offset}];", "=r,=r,=r,=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return tuple(Uint32(llvm.extractvalue(i32, struct, [k], loc=loc, ip=ip)) for k in range(4))


@dsl_user_op
def exp2_poly_cvt(x, degree: int = 3, *, loc=None, ip=None) -> Float32:
    """The naive emulation, for comparison: floor by ``cvt.rmi`` (FRND) and the integer by
    ``cvt.rzi.s32`` (F2I). Both conversions run on the same 16-lane unit as MUFU, so this one
    competes with MUFU instead of relieving it."""
    coeffs = ch06.exp2_coefficients(degree)
    xc = cute.arch.fmax(Float32(x), Float32(ch06.CLAMP_LOW), loc=loc, ip=ip)
    n = Float32(
        llvm.inline_asm(T.f32(), [xc.ir_value(loc=loc, ip=ip)], "cvt.rmi.f32.f32 $0, $1;",
                        "=f,f", has_side_effects=False, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)
    )
    f = ch06.ptx_sub_rn(xc, n, loc=loc, ip=ip)
    p = Float32(coeffs[-1])
    for c in coeffs[-2::-1]:
        p = ch06.ptx_fma_rn(p, f, Float32(c), loc=loc, ip=ip)
    ptx = ("{\n.reg .s32 t;\ncvt.rzi.s32.f32 t, $1;\nshl.b32 t, t, 23;\nadd.s32 t, t, $2;\n"
           "mov.b32 $0, t;\n}")
    return ch06.inline_ptx_f32(ptx, n, p, loc=loc, ip=ip)


@cute.jit
def record_clock(mClock: cute.Tensor, bidx: Int32, start: Int64, end: Int64):
    """Block ``bidx``'s CLOCK_FIELDS slots: its SM and the cycle counter before and after."""
    mClock[bidx * CLOCK_FIELDS + 0] = Int64(sm_id())
    mClock[bidx * CLOCK_FIELDS + 1] = start
    mClock[bidx * CLOCK_FIELDS + 2] = end


def compile_seed_out_clock(bench, arch: str):
    """Compile a (seed, out, clock, steps) benchmark for ``arch`` with no GPU."""
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    return compile_for(
        arch, bench, fake_tensor(Float32, (None,)), fake_tensor(Float32, (None,)),
        fake_tensor(Int64, (None,)), Int32(1), fake_stream(),
    )


# ----------------------------------------------------------------------------------------------
# exp2 throughput


class ExpThroughput:
    """``emulated`` of the CHAINS chains per thread use the polynomial, the others MUFU.

    ``floor``: "shifter" (chapter 06's sequence) or "cvt" (the naive one, ``exp2_poly_cvt``)."""

    threads = THREADS
    blocks_per_sm = BLOCKS_PER_SM

    def __init__(self, emulated: int, degree: int = 3, nan_safe: bool = True,
                 floor: str = "shifter"):
        if isinstance(emulated, bool) or not isinstance(emulated, int) or not (
            0 <= emulated <= CHAINS
        ):
            raise ValueError(f"emulated must be an int in 0..{CHAINS}, got {emulated!r}")
        if floor not in ("shifter", "cvt"):
            raise ValueError(f"floor must be 'shifter' or 'cvt', got {floor!r}")
        ch06.exp2_coefficients(degree)  # validates degree
        self.emulated, self.degree, self.nan_safe, self.floor = emulated, degree, nan_safe, floor

    @property
    def fraction(self) -> float:
        return self.emulated / CHAINS

    @property
    def label(self) -> str:
        if self.emulated == 0:
            return "MUFU ex2"
        how = "cvt floor" if self.floor == "cvt" else "shifter floor"
        nan = "" if self.nan_safe else ", NaN not kept"
        poly = f"poly deg {self.degree} ({how}{nan})"
        return poly if self.emulated == CHAINS else f"{self.emulated}/{CHAINS} {poly} + MUFU"

    def exps_per_thread(self, steps: int) -> int:
        return CHAINS * UNROLL * steps

    def chain_is_emulated(self, k: int) -> bool:
        return ch06.is_emulated(k, self.fraction, CHAINS)

    @cute.jit
    def exp2(self, x: Float32, k: cutlass.Constexpr[int]) -> Float32:
        if cutlass.const_expr(not self.chain_is_emulated(k)):
            return cute.math.exp2(x, fastmath=True)
        elif cutlass.const_expr(self.floor == "cvt"):
            return exp2_poly_cvt(x, self.degree)
        else:
            return ch06.exp2_poly(x, self.degree, self.nan_safe)

    @cute.jit
    def __call__(self, mSeed: cute.Tensor, mOut: cute.Tensor, mClock: cute.Tensor,
                 steps: Int32, stream):
        blocks = cute.size(mOut) // self.threads
        self.kernel(mSeed, mOut, mClock, steps).launch(
            grid=(blocks, 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, mSeed: cute.Tensor, mOut: cute.Tensor, mClock: cute.Tensor, steps: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gid = bidx * self.threads + tidx
        r_v = cute.make_rmem_tensor((CHAINS,), Float32)  # (CHAINS,) one value per chain
        seed = mSeed[gid]
        for k in cutlass.range_constexpr(CHAINS):
            r_v[k] = seed + Float32(k / 64.0)

        cute.arch.sync_threads()
        start = cute.arch.clock64()
        for _ in cutlass.range(steps, unroll=1):
            for _u in cutlass.range_constexpr(UNROLL):
                for k in cutlass.range_constexpr(CHAINS):
                    r_v[k] = self.exp2(-r_v[k], k)
        cute.arch.sync_threads()
        end = cute.arch.clock64()

        total = r_v[0]
        for k in cutlass.range_constexpr(1, CHAINS):
            total = total + r_v[k]
        mOut[gid] = total
        if tidx == 0:
            record_clock(mClock, bidx, start, end)

    def compile_only(self, arch: str = "sm_90a"):
        """PTX, SASS and resources for ``arch`` with no GPU (``utils.compile_only``)."""
        return compile_seed_out_clock(self, arch)

    def measure(self, steps: int = 3000, warmup: int = 2, reps: int = 5) -> dict:
        """Run on the current CUDA GPU: chip-wide exps/s (CUDA events) and per-SM exps/clock
        (clock64). Returns a dict of the figures and of the raw clock data's summary."""
        import torch

        n = _threads_on_chip(self)
        seed = torch.rand(n, device="cuda", dtype=torch.float32)
        out = torch.empty_like(seed)
        figures = _time_and_rate(self, (seed, out), steps, self.exps_per_thread(steps), warmup,
                                 reps)
        # The chains converge to the fixed point of v = 2^-v (0.6412), whichever exp2 they use.
        sums = out / CHAINS
        figures.update(fixed_point_min=float(sums.min()), fixed_point_max=float(sums.max()))
        return figures


# ----------------------------------------------------------------------------------------------
# Shared-memory bandwidth


class SmemBandwidth:
    """Every thread reads ``width`` bytes (4 or 16) per load, SMEM_LOADS_IN_FLIGHT loads per loop
    trip from consecutive rows of a (rows, threads * width) byte buffer."""

    threads = THREADS
    blocks_per_sm = BLOCKS_PER_SM

    def __init__(self, width: int = 16):
        if width not in (4, 16):
            raise ValueError(f"width must be 4 or 16 bytes, got {width!r}")
        self.width = width
        self.words = width // 4
        self.row_bytes = self.threads * width
        self.buffer_words = SMEM_LOADS_IN_FLIGHT * self.row_bytes // 4

    @property
    def label(self) -> str:
        sass = "LDS.128" if self.width == 16 else "LDS"
        return f"shared-memory loads, {self.width} B per thread ({sass})"

    def bytes_per_thread(self, steps: int) -> int:
        return steps * SMEM_LOADS_IN_FLIGHT * self.width

    @cute.jit
    def __call__(self, mOut: cute.Tensor, mClock: cute.Tensor, steps: Int32, stream):
        blocks = cute.size(mOut) // self.threads
        self.kernel(mOut, mClock, steps).launch(
            grid=(blocks, 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, mClock: cute.Tensor, steps: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        # (rows * threads * width / 4,) 32-bit words; word w holds the value w
        s_buf = smem.allocate_tensor(Uint32, cute.make_layout(self.buffer_words), byte_alignment=16)
        for i in cutlass.range_constexpr(self.buffer_words // self.threads):
            w = tidx + i * self.threads
            s_buf[w] = Uint32(w)
        cute.arch.sync_threads()

        # This thread's bytes in row r: [r * row_bytes + tidx * width, ... + width)
        base = s_buf.iterator.toint() + tidx * self.width
        r_acc = cute.make_rmem_tensor((self.words,), Uint32)  # (words,) running sums
        r_acc.fill(0)
        start = cute.arch.clock64()
        for _ in cutlass.range(steps, unroll=1):
            for r in cutlass.range_constexpr(SMEM_LOADS_IN_FLIGHT):
                v = ld_shared_volatile(base, r * self.row_bytes, self.words)
                for c in cutlass.range_constexpr(self.words):
                    r_acc[c] = r_acc[c] + v[c]
        cute.arch.sync_threads()
        end = cute.arch.clock64()

        total = r_acc[0]
        for c in cutlass.range_constexpr(1, self.words):
            total = total + r_acc[c]
        mOut[bidx * self.threads + tidx] = total
        if tidx == 0:
            record_clock(mClock, bidx, start, end)

    def expected_sum(self, tidx: int, steps: int) -> int:
        """What thread ``tidx`` stores, modulo 2^32: the word indices it reads, ``steps`` times."""
        first = [r * self.row_bytes // 4 + tidx * self.words + c
                 for r in range(SMEM_LOADS_IN_FLIGHT) for c in range(self.words)]
        return (steps * sum(first)) % 2**32

    def compile_only(self, arch: str = "sm_90a"):
        from utils.compile_only import compile_for, fake_stream, fake_tensor

        return compile_for(
            arch, self, fake_tensor(Int32, (None,)), fake_tensor(Int64, (None,)), Int32(1),
            fake_stream(),
        )

    def measure(self, steps: int = 12000, warmup: int = 2, reps: int = 5) -> dict:
        """Run on the current CUDA GPU: bytes per clock per SM (clock64) and chip bytes/s."""
        import torch

        out = torch.zeros(_threads_on_chip(self), device="cuda", dtype=torch.int32)
        figures = _time_and_rate(self, (out,), steps, self.bytes_per_thread(steps), warmup, reps)
        got = out.view(-1, self.threads)[0].cpu().to(torch.int64) % 2**32
        want = torch.tensor([self.expected_sum(t, steps) for t in range(self.threads)])
        figures.update(checksum_ok=bool((got == want).all()))
        return figures


# ----------------------------------------------------------------------------------------------
# mma.sync throughput: the ceiling of chapter 04's kernel


class MmaSyncThroughput:
    """Every warp repeats ``MMA_CHAINS`` independent ``mma.sync.m16n8k16`` (bf16 in, fp32
    accumulate) on operands that stay in registers: no loads, so the figure is the tensor cores'
    rate for the Ampere-style instruction (HMMA in the SASS), the most chapter 04 can reach.
    Independent accumulators keep the pipe full despite each mma's latency; 32 warps per SM."""

    threads = 256
    blocks_per_sm = 4
    flops_per_mma = 2 * 16 * 8 * 16

    @property
    def label(self) -> str:
        return "mma.sync m16n8k16 bf16 -> fp32"

    def mmas_per_thread(self, steps: int) -> float:
        """Per thread: a warp's mma counted once per lane share (32 lanes do one mma)."""
        return MMA_CHAINS * UNROLL * steps / 32

    @cute.jit
    def __call__(self, mSeed: cute.Tensor, mOut: cute.Tensor, mClock: cute.Tensor,
                 steps: Int32, stream):
        blocks = cute.size(mOut) // self.threads
        tiled_mma = cute.make_tiled_mma(
            cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, Float32, (16, 8, 16)), (1, 1, 1)
        )
        self.kernel(mSeed, mOut, mClock, steps, tiled_mma).launch(
            grid=(blocks, 1, 1), block=(self.threads, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, mSeed: cute.Tensor, mOut: cute.Tensor, mClock: cute.Tensor, steps: Int32,
               tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gid = bidx * self.threads + tidx
        thr_mma = tiled_mma.get_slice(tidx % 32)
        # A (16, 16), B (8 * chains, 16), C (16, 8 * chains): one mma per 8 columns of C
        rA = thr_mma.make_fragment_A(thr_mma.partition_shape_A((16, 16)))
        rB = thr_mma.make_fragment_B(thr_mma.partition_shape_B((8 * MMA_CHAINS, 16)))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((16, 8 * MMA_CHAINS)), Float32)
        seed = mSeed[gid]
        for i in cutlass.range_constexpr(cute.size(rA)):  # distinct values: no operand reuse
            rA[i] = (seed * Float32(1.0 + i / 8)).to(cutlass.BFloat16)
        for i in cutlass.range_constexpr(cute.size(rB)):
            rB[i] = (seed * Float32(0.5 + i / 32)).to(cutlass.BFloat16)
        acc.fill(0.0)

        cute.arch.sync_threads()
        start = cute.arch.clock64()
        for _ in cutlass.range(steps, unroll=1):
            for _u in cutlass.range_constexpr(UNROLL):
                cute.gemm(tiled_mma, acc, rA, rB, acc)
        cute.arch.sync_threads()
        end = cute.arch.clock64()

        mOut[gid] = acc.load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        if tidx == 0:
            record_clock(mClock, bidx, start, end)

    def compile_only(self, arch: str = "sm_90a"):
        return compile_seed_out_clock(self, arch)

    def measure(self, steps: int = 20000, warmup: int = 2, reps: int = 5) -> dict:
        """Run on the current CUDA GPU: FLOP per clock per SM (clock64) and chip TFLOP/s."""
        import torch

        # Small operands (|a b| * 16 * steps stays far from overflow); not zero, which would
        # let the tensor cores switch fewer bits than real data does.
        seed = torch.rand(_threads_on_chip(self), device="cuda", dtype=torch.float32) * 1e-3
        out = torch.empty_like(seed)
        flops_per_thread = self.mmas_per_thread(steps) * self.flops_per_mma
        figures = _time_and_rate(self, (seed, out), steps, flops_per_thread, warmup, reps)
        figures.update(finite=bool(torch.isfinite(out).all()))
        return figures


# ----------------------------------------------------------------------------------------------
# Running on a GPU

_COMPILED: dict = {}


def _compiled_runner(bench, tensors, *scalars):
    """Compile ``bench`` once per configuration for this GPU; return a no-argument launcher."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack

    args = [from_dlpack(t, assumed_align=16).mark_layout_dynamic() for t in tensors]
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    key = (type(bench).__name__, tuple(sorted(vars(bench).items())))
    if key not in _COMPILED:
        _COMPILED[key] = cute.compile(bench, *args, *scalars, stream)
    compiled = _COMPILED[key]
    return lambda: compiled(*args, *scalars, stream)


def _sms() -> int:
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _threads_on_chip(bench) -> int:
    """Threads of one launch: ``blocks_per_sm`` blocks of ``threads`` on every SM."""
    return _sms() * bench.blocks_per_sm * bench.threads


def _time_and_rate(bench, tensors, steps: int, work_per_thread: float, warmup: int,
                   reps: int) -> dict:
    """Launch ``bench`` on ``tensors`` plus a clock buffer, ``steps`` loop trips, on
    ``blocks_per_sm`` blocks per SM; time it (median of ``reps``) and read the clocks. Returns
    ``_per_sm_rate``'s figures for ``work_per_thread`` units per thread, plus ms, the chip-wide
    units per second, sms, steps and the SM clock the run had."""
    import torch

    sms = _sms()
    blocks = sms * bench.blocks_per_sm
    clock = torch.zeros(blocks * CLOCK_FIELDS, device="cuda", dtype=torch.int64)
    ms = _median_ms(_compiled_runner(bench, (*tensors, clock), Int32(steps)), warmup, reps)
    figures = _per_sm_rate(clock, bench.threads * work_per_thread, sms)
    figures.update(
        ms=ms, per_s=blocks * bench.threads * work_per_thread / (ms * 1e-3), sms=sms,
        steps=steps, sm_clock_ghz=figures["median_cycles"] / (ms * 1e-3) / 1e9,
    )
    return figures


def _median_ms(fn, warmup: int, reps: int) -> float:
    """Median of ``reps`` CUDA-event timings after ``warmup`` calls (register/SMEM-only kernels:
    no L2 flush needed)."""
    from utils.bench import time_cuda

    return time_cuda(fn, warmup=warmup, rep=reps, flush_l2=False).median_ms


def _per_sm_rate(clock, work_per_block: float, sms: int) -> dict:
    """Per SM: work of its blocks / (last end - first start); median, min, max over SMs."""
    rows = clock.view(-1, CLOCK_FIELDS).cpu().tolist()
    broken = [i for i, (_, start, end, _) in enumerate(rows) if end <= start]
    if broken:
        raise RuntimeError(f"{len(broken)} of {len(rows)} blocks wrote no cycle span (first: "
                           f"block {broken[0]}, {rows[broken[0]]}); the kernel did not run fully")
    per_sm: dict[int, list] = {}
    for sm, start, end, _ in rows:
        per_sm.setdefault(sm, []).append((start, end))
    rates, cycles = [], []
    for spans in per_sm.values():
        c = max(e for _, e in spans) - min(s for s, _ in spans)
        cycles.append(c)
        rates.append(len(spans) * work_per_block / c)
    return {
        "per_clk_sm": statistics.median(rates), "per_clk_sm_min": min(rates),
        "per_clk_sm_max": max(rates), "median_cycles": statistics.median(cycles),
        "sms_used": len(per_sm), "sms_expected": sms,
    }


def exp_variants() -> list[ExpThroughput]:
    """MUFU, the mixes, the polynomial alone (degrees 2..5), and two degree-3 variants."""
    variants = [ExpThroughput(e) for e in EXP_FRACTIONS]
    variants += [ExpThroughput(CHAINS, degree=d) for d in (2, 4, 5)]
    variants += [ExpThroughput(CHAINS, nan_safe=False), ExpThroughput(3, nan_safe=False),
                 ExpThroughput(CHAINS, floor="cvt")]
    return variants
