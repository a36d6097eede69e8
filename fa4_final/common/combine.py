"""The split-KV combine: one (out, lse) per query row from the float32 partials of its splits.

A split-KV forward cuts the keys of each (batch, kv head) into ``num_splits`` ranges, one CTA
each, and every split leaves, per query row, its normalised partial output ``out_s`` (float32)
and its natural-log ``lse_s`` (-inf when the split saw no key of the row). This kernel merges
them, the online softmax's merge done once for all splits:

    m   = max_s lse_s                       (0 in place of -inf when every split is empty)
    w_s = exp(lse_s - m)                    (0 for an empty split)
    out = sum_s w_s out_s / sum_s w_s       (0 for a row no split saw)
    lse = m + log(sum_s w_s)                (-inf for a row no split saw)

Layouts (the decode kernel's contract): out_partial (num_splits, batch, seqlen_q, heads, dv),
lse_partial (num_splits, batch, heads, seqlen_q), out (batch, seqlen_q, heads, dv) in bf16 or
fp16, lse (batch, heads, seqlen_q) float32. Varlen packs rows the same way, (num_splits,
total_q, heads, dv) and (num_splits, heads, total_q): it is the dense layout with a batch of one
(the launch adds that axis), since a row's merge never asks which sequence it belongs to.

Bytes: per row num_splits x dv x 4 B of partials read, 4 B of lse per split, dv x 2 B written.
At D = 128 and 4 splits a row costs 2 KB in and 256 B out for 1 K FLOPs (a multiply and an add
per partial element): under half a FLOP per byte, so the kernel is memory-bound and what it must
get right is the loads (Note [Combine layout]); a split that saw nothing costs no bytes at all.

Note [Combine layout]
A row is served by ``dv / 8`` lanes (16 at D = 128, 8 at D = 64), each owning 8 contiguous
columns: two 16-byte loads of float32 per split and one 16-byte store of the bf16/fp16 result.
128 threads serve 8 (D = 128) or 16 (D = 64) rows; rows are numbered in lse order (batch, head,
query), query fastest, so the lse reads of neighbouring rows share cache sectors. Per row, its
lanes first read the row's lse values (lane l holds splits l, l + lanes, ...: at most
MAX_SPLITS / lanes registers with fixed indices, so no local memory), reduce max and sum over
the lanes with butterfly shuffles, and write each split's weight w_s / sum_s w_s into a row of
shared memory (zeros past num_splits). Then every lane walks the splits in order, ``unroll``
(UNROLL by default) at a time: the weights of those splits are read, the partials of those
whose weight is not 0 are loaded (their loads all in flight together), then added in split
order. A split with weight 0 (it saw no key, or its weight underflows) is never loaded, so its
partial may hold anything, NaN included, and costs no bandwidth.

Note [Combine order]
The sum over splits runs in split order, 0 first, for every row and every run; the lse's max
and sum reduce over the lanes by a fixed butterfly. The combine is deterministic: the same
partials give the same bits. MAX_SPLITS = 128 is a compile-time bound (the weights' registers
and the shared-memory row are sized by it; the split loop itself runs to the runtime count):
128 is where the split heuristic stops (fa4_final.runtime.decode), and a bound in registers
keeps the max and the sum in one pass over the lse values, where a runtime loop would need two
passes or a rescaling sum. The launch refuses more splits.

Note [A NaN split poisons the row]
A split's lse is NaN only when its kernel poisoned it (the decode kernel's answer to a page or
a length out of range: Note [Out-of-range pages give NaN] in fa4_final.hopper.decode). The max
ignores NaN and the weight test (w > 0) is false for it, so without care the merge would drop
the split and return a finite row, or 0 and -inf, an answer that looks right. Instead a NaN
lse is merged as an empty split (its partial never read) and counted; when any split of a row
was NaN, the row's out and lse are NaN (a multiply and an add by a factor 1 or NaN).

Note [Splits in flight]
Each pass of the out loop waits for its loads, so a row of n splits costs about n / unroll
load latencies one after another, on top of the lse pass. At batch 1 the combine has few rows
(32 at one token and GQA 4: four CTAs), and its time is those latencies, not bandwidth. A
larger ``unroll`` (8 or 16: 16 or 32 loads of 16 bytes in flight a lane, 64 or 128 registers
of partials) walks 16 splits in two passes or one. The next Note overlaps the lse's round
trip with the first pass's, and Note [Which combine a call runs] says which the package runs.

Note [The first splits before the weights]
Even at one pass the combine waits for two round trips to memory, the lse values and then the
partials, since the weights decide which partials to load. With ``prefetch=True`` it loads the
first ``unroll`` splits' partials (those below num_splits) before it reads an lse, so both
round trips are in flight together; at 16 splits and ``unroll=16`` the whole combine is then
one. The weights still decide what is added: a loaded partial whose weight is 0 is replaced by
zeros before the add (a NaN there never reaches out), so the sum, in the same split order, is
the plain combine's bit for bit. The price: the first pass reads the partials of empty splits
too, bytes the plain combine skips (a split kernel writes every split's partial, an empty one
as zeros).

Note [Which combine a call runs]
The package's calls (combine_choice) load the first pass early (prefetch) and take ``unroll``
4 for at most 4 splits, 16 for more: one pass up to 16 splits. Measured on an H100 in one run
(batch 1, GQA 32/8, D = 128, steps replayed from CUDA graphs; the plain combine, 8 and 16
plain, 4 and 16 early): at 1k keys (4 splits) 4 early gave the fastest step, at 8k and 128k
keys (16 splits) 16 early did or was within the spread of the fastest, and at 8k keys
and one token the combine kernel alone took about 3.1 us where the plain one took 5.3. At 4
splits 16 early loads no more partials than 4 early (only splits below num_splits) and was
still slower; a hypothesis: its 168 registers a thread against 64, and 16 weights read a pass.
8 early was not measured, so 5 to 8 splits take 16. The bits do not depend on the choice
(Note [The first splits before the weights]).

Note [The combine launches early]
A candidate, not the default (``pdl=True``): the combine launched as a programmatic dependent of
the kernel before it on the stream (CUDA's programmatic dependent launch, Hopper and later). Its
CTAs may then be scheduled while the split kernel still runs, once every split CTA has executed
``griddepcontrol.launch_dependents`` (a split decode kernel does so once its barriers are set
up, fa4_final.hopper.decode; without a dependent launched this way the instruction does
nothing) or finished. Before its first read of a partial, every thread executes
``griddepcontrol.wait``, which returns only when the previous grid has finished and its writes
are visible: what the combine reads is what an ordinary launch would have read. What it could
gain is the gap between the two kernels, a few microseconds where a decode step takes ten or
twenty. Measured on an H100 (the calls replayed from CUDA graphs, batch 1): no gain at 1k keys,
and at 16 tokens with 8k keys the step about 2 us slower than with the ordinary launch. In a
graph the ordinary kernel-to-kernel gap is already short; why the early launch costs time there
is not profiled (a hypothesis: the combine's CTAs, resident early, wait beside the split CTAs
and delay the release). The package launches the combine the ordinary way.

Note [The combine is its own kernel]
The launch and the gap could go altogether: each split CTA, once its partial is written,
fences and adds one to a counter of its (batch, kv head, m-block); the CTA that brings the
counter to num_splits merges the rows and sets it back to 0. Not built, for what a drop-in call
must promise. The counters must read 0 when a call starts. A buffer kept per device is shared
by calls on two streams at once (their counts mix, a CTA merges partials another call has not
finished writing: a wrong answer, no error); a buffer per call must be zeroed, a memset node
before the kernel, the launch this was to save. A second kernel has none of these hazards:
the stream's order is the only synchronisation it needs, and a graph replays it as it is.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from fa4_final.common.constants import CUTLASS_BY_NAME, HEAD_DIMS, LOG2_E
from fa4_final.common.errors import UnsupportedError
from fa4_final.common.recipe import Recipe, fake_stream, fake_tensor

MAX_SPLITS = 128  # Note [Combine order]
THREADS = 128
ELEMS_PER_LANE = 8  # columns a lane owns: 2 x 16 B of float32 in, 16 B of bf16/fp16 out
UNROLL = 4  # the recipe's default: splits whose partials are loaded together
UNROLLS = (4, 8, 16)  # Note [Splits in flight]
W_PAD = 4  # floats of padding per weight row: row r starts 4 r banks further (no conflicts)
ARCHS = ("sm_90a", "sm_100a")


class SplitCombine:
    """out and lse from the split partials, one row per ``head_dim / 8`` lanes
    (Note [Combine layout]); ``dtype``: out's element type."""

    def __init__(self, dtype, head_dim: int, pdl: bool = False, unroll: int = UNROLL,
                 prefetch: bool = False):
        if head_dim not in HEAD_DIMS:
            raise UnsupportedError(f"the combine is built for head dims {HEAD_DIMS}, got "
                                   f"{head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.pdl = pdl  # Note [The combine launches early]
        if unroll not in UNROLLS:
            raise UnsupportedError(f"the combine loads {UNROLLS} splits at a time, got {unroll}")
        self.unroll = unroll  # Note [Splits in flight]
        self.prefetch = prefetch  # Note [The first splits before the weights]
        self.lanes_per_row = head_dim // ELEMS_PER_LANE
        self.rows_per_cta = THREADS // self.lanes_per_row
        self.lse_per_lane = MAX_SPLITS // self.lanes_per_row
        assert MAX_SPLITS % unroll == 0 and MAX_SPLITS % self.lanes_per_row == 0

    def cache_key(self) -> tuple:
        return (type(self).__name__, self.dtype.__name__, self.head_dim, MAX_SPLITS, self.pdl,
                self.unroll, self.prefetch)

    @cute.jit
    def __call__(
        self,
        mOp: cute.Tensor,  # (num_splits, batch, seqlen_q, heads, dv) float32
        mLSEp: cute.Tensor,  # (num_splits, batch, heads, seqlen_q) float32, natural log
        mO: cute.Tensor,  # (batch, seqlen_q, heads, dv) out
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) float32 out
        stream,
    ):
        if const_expr(mOp.element_type != Float32 or mLSEp.element_type != Float32):
            raise TypeError("the split partials must be float32")
        if const_expr(mO.element_type != self.dtype or mLSE.element_type != Float32):
            raise TypeError(f"out must be {self.dtype} and lse float32")
        rows = mO.shape[0] * mO.shape[2] * mO.shape[1]
        w_layout = cute.make_layout((self.rows_per_cta, MAX_SPLITS),
                                    stride=(MAX_SPLITS + W_PAD, 1))

        @cute.struct
        class SharedStorage:
            sW: cute.struct.Align[
                cute.struct.MemRange[Float32, self.rows_per_cta * (MAX_SPLITS + W_PAD)], 16]

        grid = cute.ceil_div(rows, self.rows_per_cta)
        self.kernel(mOp, mLSEp, mO, mLSE, w_layout, SharedStorage).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLSEp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               w_layout: cute.Layout, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sW = storage.sW.get_tensor(w_layout)  # (rows_per_cta, MAX_SPLITS)
        lanes = self.lanes_per_row
        lane = tidx % lanes
        local = tidx // lanes
        num_splits = mOp.shape[0]
        batch, seqlen_q, heads = mO.shape[0], mO.shape[1], mO.shape[2]
        row = bidx * self.rows_per_cta + local
        valid = row < batch * heads * seqlen_q
        q = row % seqlen_q
        h = (row // seqlen_q) % heads
        b = row // (seqlen_q * heads)
        if const_expr(self.pdl):  # Note [The combine launches early]: the partials are final
            cute.arch.griddepcontrol_wait()
        unroll = self.unroll
        rX = cute.make_rmem_tensor((ELEMS_PER_LANE, unroll), Float32)
        if const_expr(self.prefetch):  # Note [The first splits before the weights]
            for u in cutlass.range_constexpr(unroll):
                rX[None, u].fill(0.0)
                if valid and u < num_splits:
                    gX = cute.local_tile(mOp[u, b, q, h, None], (ELEMS_PER_LANE,), (lane,))
                    cute.autovec_copy(gX, rX[None, u])

        # 1. the row's lse values, lane l holding splits l, l + lanes, ...
        # a NaN lse marks a poisoned split (Note [A NaN split poisons the row]): counted in
        # ``bad`` and merged as an empty one, so the weights stay finite
        rW = cute.make_rmem_tensor(self.lse_per_lane, Float32)
        bad = Float32(0.0)
        for c in cutlass.range_constexpr(self.lse_per_lane):
            split = c * lanes + lane
            rW[c] = -Float32.inf
            if valid and split < num_splits:
                rW[c] = mLSEp[split, b, h, q]
            if rW[c] != rW[c]:
                rW[c] = -Float32.inf
                bad = Float32(1.0)
        bad = cute.arch.warp_reduction_max(bad, threads_in_group=lanes)
        poison = Float32(1.0) if bad == Float32(0.0) else Float32(float("nan"))
        # 2. max and sum over the splits: this lane's values, then the row's lanes
        m = rW[0]
        for c in cutlass.range_constexpr(1, self.lse_per_lane):
            m = cute.arch.fmax(m, rW[c])
        m = cute.arch.warp_reduction_max(m, threads_in_group=lanes)
        m_safe = Float32(0.0) if m == -Float32.inf else m  # every split empty: no inf - inf
        total = Float32(0.0)
        for c in cutlass.range_constexpr(self.lse_per_lane):
            rW[c] = cute.math.exp2((rW[c] - m_safe) * LOG2_E, fastmath=True)
            total = total + rW[c]
        total = cute.arch.warp_reduction_sum(total, threads_in_group=lanes)
        seen = total > Float32(0.0)
        inv = cute.arch.rcp_approx(total if seen else Float32(1.0))
        inv = inv if seen else Float32(0.0)
        # 3. the weights, normalised, into the row's shared-memory slots (zeros past num_splits)
        for c in cutlass.range_constexpr(self.lse_per_lane):
            sW[local, c * lanes + lane] = rW[c] * inv
        if valid and lane == 0:
            lse = -Float32.inf
            if seen:
                lse = m + cute.math.log(total, fastmath=True)
            mLSE[b, h, q] = lse + (poison - Float32(1.0))
        cute.arch.barrier()

        # 4. out = sum_s w_s out_s, ``unroll`` splits at a time, in split order
        # (Note [Combine order], Note [Splits in flight])
        acc = cute.make_rmem_tensor(ELEMS_PER_LANE, Float32)
        acc.fill(0.0)
        rWu = cute.make_rmem_tensor(unroll, Float32)
        sW_row = cute.flat_divide(sW[local, None], (unroll,))  # (unroll, MAX_SPLITS / unroll)
        first = 0
        if const_expr(self.prefetch):  # the first pass's partials are in registers already;
            first = 1  # a split of weight 0 adds 0, whatever its partial held
            cute.autovec_copy(sW_row[None, 0], rWu)
            for u in cutlass.range_constexpr(unroll):
                if rWu[u] <= Float32(0.0):
                    rX[None, u].fill(0.0)
            for u in cutlass.range_constexpr(unroll):
                acc.store(acc.load() + rX[None, u].load() * rWu[u])
        for t in cutlass.range(first, cute.ceil_div(num_splits, unroll), unroll=1):
            cute.autovec_copy(sW_row[None, t], rWu)
            for u in cutlass.range_constexpr(unroll):
                rX[None, u].fill(0.0)
                if rWu[u] > Float32(0.0):
                    gX = cute.local_tile(mOp[t * unroll + u, b, q, h, None], (ELEMS_PER_LANE,),
                                         (lane,))  # (ELEMS_PER_LANE,)
                    cute.autovec_copy(gX, rX[None, u])
            for u in cutlass.range_constexpr(unroll):
                acc.store(acc.load() + rX[None, u].load() * rWu[u])

        # 5. out, 16 B per lane
        if valid:
            rO = cute.make_rmem_tensor(ELEMS_PER_LANE, self.dtype)
            rO.store((acc.load() * poison).to(self.dtype))
            gO = cute.local_tile(mO[b, q, h, None], (ELEMS_PER_LANE,), (lane,))
            cute.autovec_copy(rO, gO)


def combine_choice(num_splits: int) -> tuple[int, bool]:
    """(unroll, prefetch) of the combine the package launches for ``num_splits`` splits
    (Note [Which combine a call runs])."""
    return (UNROLL if num_splits <= UNROLL else 16), True


def fake_combine_args(dtype_name: str, head_dim: int) -> tuple:
    """The combine's fake arguments: symbolic splits, batch, lengths and heads; the partials'
    and out's strides 16-byte multiples (the 16-byte loads and stores), lse strides free."""
    dt = CUTLASS_BY_NAME[dtype_name]
    n, b, sq, h = (cute.sym_int() for _ in range(4))
    out_partial = fake_tensor(Float32, (n, b, sq, h, head_dim), divisibility=4)
    lse_partial = fake_tensor(Float32, (n, b, h, sq), divisibility=1)
    out = fake_tensor(dt, (b, sq, h, head_dim), divisibility=128 // dt.width)
    lse = fake_tensor(Float32, (b, h, sq), divisibility=1)
    return out_partial, lse_partial, out, lse, fake_stream()


def combine_recipe(head_dim: int = 128, dtype: str = "bf16", arch: str = "sm_90a",
                   pdl: bool = False, unroll: int = UNROLL, prefetch: bool = False) -> Recipe:
    """The combine as a pass of one kernel ("main"), for Hopper or Blackwell (plain loads and
    stores: the same code for both); ``pdl``: the candidate launched early behind the kernel
    before it (Note [The combine launches early]); ``unroll``: splits loaded together
    (Note [Splits in flight]); ``prefetch``: the first ``unroll`` splits' partials loaded
    before the weights (Note [The first splits before the weights])."""
    if dtype not in CUTLASS_BY_NAME:
        raise ValueError(f"dtype must be one of {sorted(CUTLASS_BY_NAME)}, got {dtype!r}")
    if arch not in ARCHS:
        raise UnsupportedError(f"the combine compiles for {ARCHS}, got {arch!r}")
    kernel = SplitCombine(CUTLASS_BY_NAME[dtype], head_dim, pdl, unroll, prefetch)
    return Recipe("combine", arch, {"main": kernel},
                  lambda role: fake_combine_args(dtype, head_dim))

