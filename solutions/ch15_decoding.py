"""Chapter 15: decoding. The models the notebook prints, its two device-code exercises with their
checkers, their GPU checks, a CUDA-graph replay of the split combine, and the readers of the
decode benchmark (results/<gpu>/decode.json, written by measure/decode.py).

15.1 ``combine_row``     (device code) one query row's merge of its split partials: the max of
                         the lse values, the weights into a row of shared memory, the sum in
                         split order, never reading a split that saw no key
15.2 ``gather_key_row``  (device code) one row of a key tile read from a paged cache: key j of
                         sequence b is row j % page_size of page page_table[b, j // page_size]

Note [Decode exercises on the CPU]
Both exercises are ``@cute.jit`` functions of one thread's work. The checkers run them on this
CPU through the DSL itself: a host ``@cute.jit`` loop over the rows calls the learner's function
on NumPy arrays (``from_dlpack``), so the same source is compiled to host code and run.
``cute.arch.fmax`` and ``cute.arch.rcp_approx`` have no host version and are swapped while the
host loop is traced (``cute.math.max``, a division). The paged cache and the page table sit
inside larger buffers whose margins hold -1, so a read past the cache or past the table lands
in memory the checker owns and is named, instead of reading someone else's. Then each function
is compiled for sm_90a in a kernel (one thread per row for 15.1, one CTA per key tile for
15.2) and its SASS and PTX are read.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import numpy as np
import torch
from cutlass import Float32, Int32

from fa4_final.runtime import decode as rdecode
from utils.claims import claim
from utils.hardware import DATASHEET_DENSE_BF16_TFLOPS, HBM_DATASHEET_BYTES_PER_S, PER_SM

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# Datasheet figures of the H200 (SXM): the roofline's two roofs before anything is measured.
H200 = {"hbm_tb_s": HBM_DATASHEET_BYTES_PER_S["H200"] / 1e12,
        "bf16_tflops": float(DATASHEET_DENSE_BF16_TFLOPS["sm_90"]), "sms": PER_SM["sm_90"].sms}
DECODE = "decode"  # results/<gpu>/decode.json (measure/decode.py)
KEYS_ON_M = "decode_keys_on_m"  # the same driver with the keys-on-M kernel's rows
TWO_CONSUMERS = "decode_wg2"  # the same driver at 16 tokens, one and two consumer warpgroups
GRAPH = "decode_graph"  # the same driver, each call back to back and replayed from a CUDA graph
# the shape where the chapter asks for a prediction of the two-consumer kernel
TWO_CONSUMERS_SHAPE = {"b": 32, "s_q": 16, "s": 8192, "h": 64, "h_kv": 8, "d": 128}
DECODE_GPUS = ("h200", "h100")  # where a stored decode run is looked for, in this order
HEADLINE = {"b": 32, "s_q": 1, "s": 8192, "h": 32, "h_kv": 8, "d": 128}


# ================================================================================================
# 1. The roofline of one decode step
# ================================================================================================
def decode_step(batch: int, tokens: int, keys: int, heads: int, heads_kv: int, d: int,
                elem_bytes: int = 2) -> dict:
    """Bytes a decode step must read (K and V of every sequence and KV head; Q and out are
    negligible beside them), its FLOPs (Q K^T and P V, 2 per multiply-add), the arithmetic
    intensity, and the time each roof allows at the H200's datasheet rates (model)."""
    kv_bytes = 2 * batch * keys * heads_kv * d * elem_bytes
    flops = 4.0 * batch * heads * tokens * keys * d
    return {"kv_bytes": kv_bytes, "flops": flops, "flop_per_byte": flops / kv_bytes,
            "t_memory_us": kv_bytes / (H200["hbm_tb_s"] * 1e12) * 1e6,
            "t_math_us": flops / (H200["bf16_tflops"] * 1e12) * 1e6}


def ridge_point() -> float:
    """FLOP per byte where the two roofs meet (datasheet rates)."""
    return H200["bf16_tflops"] * 1e12 / (H200["hbm_tb_s"] * 1e12)


def tile_intensity(rows: int, elem_bytes: int = 2) -> float:
    """FLOP per byte of K and V read when ``rows`` query rows share every key tile: each key
    and value element (2 B) serves ``rows`` multiply-adds in each GEMM, 4 FLOPs per row per
    key and column against 2 x 2 B read: ``rows`` FLOP/B."""
    return 4.0 * rows / (2 * elem_bytes)


# ================================================================================================
# 2. A 64-row wgmma tile at GQA: what packing changes
# ================================================================================================
def tile_use(tokens: int, heads: int, heads_kv: int, tile_m: int = 64, packed: bool = True):
    """Per (batch entry, KV head): query tiles, real rows per tile, and how many times the keys
    of that KV head are read (once per tile walking them)."""
    group = heads // heads_kv
    if packed:
        rows = tokens * group
        tiles = -(-rows // tile_m)
        per_tile = rows / tiles
    else:  # each query head its own tile, reading the shared keys again
        tiles = group * -(-tokens // tile_m)
        per_tile = tokens * group / tiles
    return {"tiles": tiles, "real_rows_per_tile": per_tile, "of_tile": per_tile / tile_m,
            "kv_reads": tiles}


def plot_packing(tokens: int = 1, heads: int = 32, heads_kv: int = 8, tile_m: int = 64,
                 ax=None):
    """The rows of the 64-row tiles one (batch entry, KV head) runs, unpacked and packed."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    group = heads // heads_kv
    ax = ax or plt.subplots(figsize=(8.5, 2.6))[1]
    x = 0.0
    for label, packed in (("one tile per query head", False), ("query heads packed", True)):
        use = tile_use(tokens, heads, heads_kv, tile_m, packed)
        per_head = use["tiles"] // (1 if packed else group)  # tiles of one query head
        rows = tokens * group if packed else tokens
        for t in range(use["tiles"]):
            ax.add_patch(Rectangle((x, 0), 0.8, tile_m, fill=False, lw=1))
            real = min(rows - (t % per_head) * tile_m, tile_m)
            ax.add_patch(Rectangle((x, tile_m - real), 0.8, real, color="C1"))
            x += 1.0
        ax.text(x - use["tiles"] + (use["tiles"] - 1) / 2 + 0.4, -10, label, ha="center",
                fontsize=9)
        x += 1.0
    ax.set_xlim(-0.5, x)
    ax.set_ylim(-16, tile_m + 4)
    ax.set_yticks([0, tile_m])
    ax.set_xticks([])
    ax.set_ylabel("tile rows (M)")
    ax.set_title(f"{tokens} token(s), {heads} query heads over {heads_kv} KV heads: real rows "
                 f"(orange) per {tile_m}-row tile, each tile reads the KV head's keys",
                 fontsize=9)
    return ax


# ================================================================================================
# 3. Split-KV: how many CTAs a decode step has, and the split count
# ================================================================================================
def split_plan(batch: int, tokens: int, keys: int, heads: int, heads_kv: int,
               num_splits: int = 0, tile_m: int = 64, tile_n: int = 128,
               num_sms: int = H200["sms"]) -> dict:
    """CTAs without splits, the split count fa4_final's heuristic picks (num_splits < 1) or
    the one asked for, and the CTAs that gives (fa4_final.runtime.decode.choose_num_splits)."""
    packed = tokens * (heads // heads_kv)
    key_tiles = -(-keys // tile_n)
    ctas = batch * heads_kv * -(-packed // tile_m)
    splits = rdecode.choose_num_splits(num_splits, batch=batch, heads_kv=heads_kv,
                                       packed_rows=packed, key_tiles=key_tiles, num_sms=num_sms,
                                       tile_m=tile_m, tile_n=tile_n)
    return {"ctas": ctas, "splits": splits, "ctas_split": ctas * splits,
            "tiles_per_split": -(-key_tiles // splits)}


def combine_bytes(batch: int, tokens: int, heads: int, d: int, splits: int) -> int:
    """Bytes the split partials add: written once in float32 by the splits, read once by the
    combine (out partial and lse)."""
    return 2 * splits * batch * tokens * heads * (d + 1) * 4


# ================================================================================================
# Exercise 15.1: the combine of one row's split partials (device code)
# ================================================================================================
@cute.jit
def combine_row(lse_p: cute.Tensor, out_p: cute.Tensor, w: cute.Tensor,
                out: cute.Tensor) -> Float32:
    """One query row: lse_p (num_splits,) natural-log lse of each split (-inf: the split saw no
    key, and its partial must not be read), out_p (num_splits, D) the float32 partials, w
    (num_splits,) a row of shared memory for the weights, out (D,) registers. Writes
    w[s] = exp(lse_s - m) / sum and out = sum_s w[s] out_p[s] in split order, reading no split
    whose weight is 0; returns the row's lse (-inf and out = 0 for a row no split saw)."""
    n = cute.size(lse_p)
    m = -Float32.inf
    for s in cutlass.range(n):
        m = cute.arch.fmax(m, lse_p[s])
    m_safe = Float32(0.0) if m == -Float32.inf else m  # no split saw the row: exp2(-inf) = 0
    total = Float32(0.0)
    for s in cutlass.range(n):
        w[s] = cute.math.exp2((lse_p[s] - m_safe) * Float32(LOG2_E), fastmath=True)
        total = total + w[s]
    inv = Float32(0.0) if total == Float32(0.0) else cute.arch.rcp_approx(total)
    for i in cutlass.range_constexpr(cute.size(out)):
        out[i] = Float32(0.0)
    for s in cutlass.range(n):  # split order: the same bits every run
        w[s] = w[s] * inv
        if w[s] > Float32(0.0):
            for i in cutlass.range_constexpr(cute.size(out)):
                out[i] = out[i] + w[s] * out_p[s, i]
    return m_safe + cute.math.log2(total, fastmath=True) * Float32(LN_2)


MAX_SPLITS_EX = 32  # the exercise kernel's shared-memory row: at most this many splits
THREADS = 128


class CombineKernels:
    """A 15.1 function in a host loop over rows (this CPU) and in a kernel of one thread per row
    whose weights row lives in shared memory (sm_90a)."""

    def __init__(self, fn, head_dim: int):
        self.fn, self.head_dim = fn, head_dim

    @cute.jit
    def on_cpu(self, mLSEp: cute.Tensor, mOp: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor):
        # mLSEp (splits, rows), mOp (splits, rows, D), mW (rows, splits), mO (rows, D)
        for row in cutlass.range(cute.size(mLSE)):
            rO = cute.make_rmem_tensor(self.head_dim, Float32)  # (D,) as the kernel's registers
            for i in cutlass.range_constexpr(self.head_dim):
                rO[i] = Float32(math.nan)  # registers start with anything
            mLSE[row] = self.fn(mLSEp[None, row], mOp[None, row, None], mW[row, None], rO)
            for i in cutlass.range_constexpr(self.head_dim):
                mO[row, i] = rO[i]

    @cute.kernel
    def kernel(self, mLSEp: cute.Tensor, mOp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        # (THREADS, MAX_SPLITS_EX), one padding float per row: neighbours in different banks
        sW = smem.allocate_tensor(Float32, cute.make_layout(
            (THREADS, MAX_SPLITS_EX), stride=(MAX_SPLITS_EX + 1, 1)), 16)
        row = bidx * THREADS + tidx
        if row < cute.size(mLSE):
            rO = cute.make_rmem_tensor(self.head_dim, Float32)  # (D,)
            lse = self.fn(mLSEp[None, row], mOp[None, row, None],
                          cute.local_tile(sW[tidx, None], (cute.size(mLSEp, mode=[0]),), (0,)),
                          rO)
            mLSE[row] = lse
            for i in cutlass.range_constexpr(self.head_dim):
                mO[row, i] = rO[i]

    @cute.jit
    def launch(self, mLSEp: cute.Tensor, mOp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               stream):
        grid = (cute.ceil_div(cute.size(mLSE), THREADS), 1, 1)
        self.kernel(mLSEp, mOp, mO, mLSE).launch(grid=grid, block=(THREADS, 1, 1),
                                                 stream=stream)


def _host_fmax(a, b, **_):
    return cute.math.max(a, b)


def _host_rcp(x, **_):
    return Float32(1.0) / x


_HOST_OK = {"fmax", "rcp_approx"}


def _refuse_host_and_device_only(fn, allowed: str) -> None:
    from utils.exercises import referenced

    for text, obj in referenced(fn):
        if text.startswith("cute.arch.") and text.split(".")[2] not in _HOST_OK:
            raise AssertionError(f"your function calls {text}, which the check cannot run on "
                                 f"this CPU: {allowed}")
        if obj in (np.exp, np.log, np.logaddexp, math.exp, math.log, torch.logsumexp,
                   torch.exp, np.take, torch.gather, torch.index_select):
            raise AssertionError(f"your function calls {text}, which runs on the host, not in "
                                 f"device code: {allowed}")


def _on_cpu(run, *arrays) -> None:
    from cutlass.cute.runtime import from_dlpack

    from utils.host_emulation import patched

    with patched(cute.arch, fmax=_host_fmax, rcp_approx=_host_rcp):
        run(*(from_dlpack(a) for a in arrays))


def run_combine_on_cpu(fn, lse_p, out_p):
    """15.1's function on every row: lse_p (splits, rows), out_p (splits, rows, D) float32 ->
    (out (rows, D), lse (rows,), w (rows, splits)), all float32, NaN where nothing was
    written."""
    lse_p = np.ascontiguousarray(lse_p, dtype=np.float32)
    out_p = np.ascontiguousarray(out_p, dtype=np.float32)
    splits, rows, d = out_p.shape
    w = np.full((rows, splits), np.nan, dtype=np.float32)
    out = np.full((rows, d), np.nan, dtype=np.float32)
    lse = np.full(rows, np.nan, dtype=np.float32)
    _on_cpu(CombineKernels(fn, d).on_cpu, lse_p, out_p, w, out, lse)
    return out, lse, w


def combine_reference(lse_p, out_p):
    """The merge in float64 over the splits that saw the row: (out, lse, normalised weights
    (rows, splits))."""
    lse_p = np.asarray(lse_p, np.float64)
    out_p = np.asarray(out_p, np.float64)
    lse = np.logaddexp.reduce(lse_p, axis=0)
    safe = np.where(np.isfinite(lse), lse, 0.0)
    w = np.exp(lse_p - safe)  # (splits, rows); 0 for a split with lse -inf
    seen = ~np.isneginf(lse_p)
    out = np.einsum("sr,srd->rd", w, np.where(seen[..., None], out_p, 0.0))
    return out, lse, w.T


def combine_rows(splits: int = 4):
    """Rows that tell the mistakes apart: (what the row is, the lse of each split)."""
    inf = np.inf
    rows = [("an ordinary row", [0.3, -0.2, 1.1, 0.4]),
            ("a row with lse near 100 (float32's exp overflows above 88.7)",
             [96.0, 101.5, 99.0, 100.2]),
            ("a row whose split 1 saw no key (lse -inf; its partial holds NaN)",
             [1.5, -inf, 0.2, 0.9]),
            ("a row whose first and last splits saw no key", [-inf, 2.0, 0.7, -inf]),
            ("a row no split saw (every lse -inf)", [-inf] * 4),
            ("a row whose weights are far apart (one underflows to 0 in float32)",
             [0.0, -120.0, -40.0, 5.0]),
            ("a row with negative lse", [-60.0, -58.5, -61.0, -59.0])]
    return [(what, np.array(lse[:splits], dtype=np.float64)) for what, lse in rows]


def combine_case(splits: int = 4, d: int = 8, seed: int = 15, rows=None):
    """(row descriptions, lse_p (splits, rows), out_p (splits, rows, D)): the partials of a
    split that saw no key are NaN, as memory nothing wrote."""
    rng = np.random.default_rng(seed)
    rows = combine_rows(splits) if rows is None else rows
    lse_p = np.stack([r[1] for r in rows], axis=1)
    out_p = rng.standard_normal((splits, len(rows), d))
    out_p[np.isneginf(lse_p)] = np.nan
    return rows, lse_p, out_p


def _combine_mistake(what, lses, got_w, got_o, got_l, want_w, want_o, want_l) -> str | None:
    empty = np.isneginf(lses)
    if empty.all():
        if np.isnan(got_w).any() or np.isnan(got_l):
            return (f"{what}: NaN. With every lse = -inf the max is -inf too, and lse - max = "
                    "-inf - (-inf) is NaN; subtract 0 when the max is -inf: every weight is then "
                    "exp2(-inf) = 0")
        if np.any(got_w != 0):
            return (f"{what}: a split whose lse is -inf got weight {got_w[got_w != 0][0]:.4g}; "
                    "its weight is exp(-inf) = 0")
        if np.isnan(got_o).any():
            return (f"{what}: out is NaN: a split whose lse is -inf was read (its partial may "
                    "hold anything: NaN here, and 0 x NaN is NaN); skip a split whose weight is "
                    "0")
        if not (np.isneginf(got_l) and np.all(got_o == 0)):
            return (f"{what}: it gives lse {got_l:.4g}, out {got_o[:3]}...; a row no split saw "
                    "is out = 0, lse = -inf")
        return None
    bad = empty & (got_w != 0)
    if bad.any():
        s = int(np.flatnonzero(bad)[0])
        return (f"{what}: a split whose lse is -inf got weight {got_w[s]:.4g} (split {s}); its "
                "weight is exp(-inf - max) = 0")
    if not np.isfinite(got_w).all():
        return (f"{what}: the weights are {got_w}: an exponential overflowed. Subtract the "
                "row's largest lse first: exp2((lse_s - max) log2 e) is at most 1")
    if abs(got_w.sum() - 1.0) > 1e-4:
        return (f"{what}: the weights in w sum to {got_w.sum():.6g}: store each split's share, "
                "exp(lse_s - max) / sum over the splits (one reciprocal per row)")
    if np.abs(got_w - want_w).max() > 1e-5:
        s = int(np.argmax(np.abs(got_w - want_w)))
        return (f"{what}: split {s} got weight {got_w[s]:.6g}, it should be {want_w[s]:.6g} "
                "(exp(lse_s - max) / sum, the max over this row's splits)")
    if np.isnan(got_l) or abs(got_l - want_l) > 1e-4 * max(1.0, abs(want_l)):
        if np.isfinite(got_l) and abs(got_l - want_l * LOG2_E) < 1e-3 * max(1.0, abs(want_l)):
            return (f"{what}: your lse is {got_l:.6g}, log2(e) times {want_l:.6g}: it is in "
                    "log2 units; the combine's lse is a natural log (multiply the log2 by ln 2)")
        if np.isfinite(got_l) and abs(got_l - (want_l - lses.max())) < 1e-4 * max(1, abs(want_l)):
            return (f"{what}: your lse is {got_l:.6g}, the log of the sum alone: add back the "
                    f"max you subtracted ({lses.max():.6g})")
        return f"{what}: the row's lse is {got_l:.6g}, it should be {want_l:.6g}"
    if np.isnan(got_o).any():
        if empty.any():
            return (f"{what}: out is NaN: a split whose lse is -inf was read. Such a split's "
                    "partial carries nothing and may hold anything (NaN here), and 0 x NaN is "
                    "NaN: read no split whose weight is 0")
        return (f"{what}: out is NaN although every split saw keys: set out to 0 before the "
                "sum (registers start with anything)")
    err = np.abs(got_o - want_o).max()
    if err > 1e-4 * max(1.0, np.abs(want_o).max()):
        return (f"{what}: out differs from the float64 merge by {err:.3g} while the weights are "
                "right: out = sum over s of w[s] x out_p[s], each split's partial times its own "
                "weight")
    return None


def _check_combine_values(fn, splits: int, rows=None, seed: int = 15) -> None:
    described, lse_p, out_p = combine_case(splits, rows=rows, seed=seed)
    out, lse, w = run_combine_on_cpu(fn, lse_p, out_p)
    want_o, want_l, want_w = combine_reference(lse_p, out_p)
    for r, (what, lses) in enumerate(described):
        mistake = _combine_mistake(what, lses, w[r].astype(np.float64),
                                   out[r].astype(np.float64), float(lse[r]), want_w[r],
                                   want_o[r], float(want_l[r]))
        if mistake:
            raise AssertionError(f"{mistake} [{splits} splits]")


_SASS_CACHE: dict = {}
SASS_HEAD_DIM = 32


def combine_compiled(fn):
    """``fn`` in the one-thread-per-row kernel, compiled for sm_90a (cached per function)."""
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    if fn not in _SASS_CACHE:
        d = SASS_HEAD_DIM
        _SASS_CACHE[fn] = compile_for(
            "sm_90a", CombineKernels(fn, d).launch,
            fake_tensor(Float32, (None, None), stride_order=(1, 0)),
            fake_tensor(Float32, (None, None, d), stride_order=(2, 1, 0)),
            fake_tensor(Float32, (None, d), stride_order=(1, 0)),
            fake_tensor(Float32, (None,)), fake_stream())
    return _SASS_CACHE[fn]


def combine_sass_facts(fn) -> dict:
    """What the compiled row costs: exponentials, logs, reciprocals (and IEEE division calls),
    shared-memory stores of the weights, local memory."""
    from solutions.ch06_exp2 import sass_opcodes

    art = combine_compiled(fn)
    ops = sass_opcodes(art.sass)

    def count(*prefixes):
        return sum(v for k, v in ops.items() if k.startswith(prefixes))

    return {"row length D": SASS_HEAD_DIM,
            "MUFU.EX2": count("MUFU.EX2"), "MUFU.LG2": count("MUFU.LG2"),
            "reciprocals and division calls": count("MUFU.RCP", "CALL"),
            "shared-memory stores (STS)": count("STS"),
            "local memory": art.spills > 0 or any(k.frame_bytes for k in art.kernels)}


def _combine_sass_mistake(facts: dict, ref: dict) -> str | None:
    if facts["local memory"]:
        return ("compiled for sm_90a, the row sits in local memory: index out with "
                "compile-time indices (a cutlass.range_constexpr loop over its D elements)")
    if facts["MUFU.LG2"] > 1:
        return (f"compiled for sm_90a, {facts['MUFU.LG2']} MUFU.LG2: the lse takes one log per "
                "row, after the sum")
    if facts["MUFU.EX2"] > ref["MUFU.EX2"]:
        return (f"compiled for sm_90a, {facts['MUFU.EX2']} MUFU.EX2 where the weights need "
                f"{ref['MUFU.EX2']}: the sum over the partials recomputes the exponentials; "
                "compute each weight once, keep it in w, and read it back")
    if facts["reciprocals and division calls"] > ref["reciprocals and division calls"] + 2:
        return (f"compiled for sm_90a, {facts['reciprocals and division calls']} reciprocals and "
                "division calls: the weights divide by the sum per split or per element; take "
                "one reciprocal of the sum per row and multiply")
    if facts["shared-memory stores (STS)"] == 0:
        return ("compiled for sm_90a, nothing is stored to shared memory: write each split's "
                "weight into w (the kernel's shared-memory row), as the exercise asks")
    return None


COMBINE_NEEDS = ("the combine needs arithmetic, cute.arch.fmax, cute.arch.rcp_approx, "
                 "cute.math.exp2 and cute.math.log2")
ONE_SPLIT_ROWS = [("a row with one split", np.array([0.7])),
                  ("a row whose one split saw no key", np.array([-np.inf]))]
GATHER_NEEDS = "the gather needs integer arithmetic, the page table and the cache"
TABLE_LOADS = "scalar 32-bit global loads (seqlen, page table)"


def check_combine_row(fn, compile_check: bool = True) -> None:
    """Exercise 15.1: on this CPU with 4 splits (rows that tell the mistakes apart), 1 split and
    7 splits (so a fixed count is caught), against float64; then compiled for sm_90a and its
    SASS held against the reference's."""
    _refuse_host_and_device_only(fn, COMBINE_NEEDS)
    _check_combine_values(fn, 4)
    _check_combine_values(fn, 1, rows=ONE_SPLIT_ROWS, seed=16)
    rng = np.random.default_rng(17)
    seven = [(f"row {r} of seven splits", np.where(rng.random(7) < 0.25, -np.inf,
                                                   rng.normal(0, 6, 7))) for r in range(5)]
    _check_combine_values(fn, 7, rows=seven, seed=17)
    if compile_check:
        mistake = _combine_sass_mistake(combine_sass_facts(fn), combine_sass_facts(combine_row))
        if mistake:
            raise AssertionError(mistake)


FORBID_COMBINE = {
    combine_reference: "that is the checker's float64 merge; write the device code yourself",
    rdecode.combine_splits: "that launches the package's combine kernel; write the row's merge",
}


def _gpu_partials(rows: int, splits: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lse = torch.randn(splits, rows, generator=g, dtype=torch.float64) * 8
    lse[:, ::7] = float("-inf")  # rows no split saw
    lse[0, 3::5] = float("-inf")  # rows whose first split saw nothing
    lse[-1, 2::9] += 90.0  # a large lse in the last split
    out = torch.randn(splits, rows, d, generator=g, dtype=torch.float64)
    out[torch.isneginf(lse)] = float("nan")  # a partial that must not be read
    return lse, out


def combine_agrees(o, lo, want_o, want_l, tol: float = 1e-4):
    """(ok, max |out - want|, lse right) for float32 results against the float64 merge: -inf
    exactly where the merge has it, out finite everywhere."""
    empty = np.isneginf(want_l)
    finite_l = np.where(empty, 0.0, want_l)
    same_l = np.where(empty, np.isneginf(lo),
                      np.abs(np.where(empty, 0.0, lo) - finite_l) <= tol * np.maximum(
                          1.0, np.abs(finite_l)))
    err = float(np.abs(o - want_o).max()) if np.isfinite(o).all() else math.inf
    return bool(same_l.all()) and err < tol, err, bool(same_l.all())


def check_combine_on_gpu(fn, shapes=((1, 1), (300, 3), (1000, 17), (777, 32)), d: int = 64):
    """15.1 on a Hopper GPU: the one-thread-per-row kernel on awkward row and split counts,
    NaN partials for splits that saw no key, against float64. (ok, one line per shape)."""
    import cuda.bindings.driver as cuda_driver
    from cutlass.cute.runtime import from_dlpack

    ok, lines = True, []
    for n, (rows, splits) in enumerate(shapes):
        lse, part = _gpu_partials(rows, splits, d, 1500 + n)
        want_o, want_l, _ = combine_reference(lse.numpy(), part.numpy())
        lse_d, part_d = lse.float().cuda(), part.float().cuda()
        out = torch.full((rows, d), float("nan"), device="cuda")
        got_lse = torch.full((rows,), float("nan"), device="cuda")
        stream = cuda_driver.CUstream(torch.cuda.current_stream().cuda_stream)
        CombineKernels(fn, d).launch(*(from_dlpack(t) for t in (lse_d, part_d, out, got_lse)),
                                     stream)
        torch.cuda.synchronize()
        case_ok, err, lse_right = combine_agrees(out.double().cpu().numpy(),
                                                 got_lse.double().cpu().numpy(), want_o, want_l)
        ok &= case_ok
        lines.append(f"rows={rows} splits={splits} D={d}: max |out - float64| {err:.2e}, lse "
                     f"{'right' if lse_right else 'WRONG'} -> {'ok' if case_ok else 'FAIL'}")
    return ok, lines


# ================================================================================================
# Exercise 15.2: one row of a key tile from a paged cache (device code)
# ================================================================================================
@cute.jit
def gather_key_row(mK: cute.Tensor, page_table: cute.Tensor, b: Int32, h: Int32, n: Int32,
                   i: Int32, seqlen: Int32, sK: cute.Tensor):
    """Row i of key tile n of sequence b, KV head h, into sK (tile_n, D): key j = n tile_n + i
    is row j % page_size of page page_table[b, j // page_size] of mK (num_pages, page_size,
    heads_kv, D); a key at or past seqlen is 0 and its page-table slot is never read."""
    tile_n = cute.size(sK, mode=[0])
    page_size = cute.size(mK, mode=[1])
    j = n * tile_n + i
    if j < seqlen:
        page = page_table[b, j // page_size]
        row = j % page_size
        for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
            sK[i, d] = mK[page, row, h, d]
    else:
        for d in cutlass.range_constexpr(cute.size(sK, mode=[1])):
            sK[i, d] = sK.element_type(0)


class GatherKernels:
    """A 15.2 function in a host loop over (sequence, KV head, tile, row) on this CPU, and in a
    kernel of one CTA per (key tile, KV head, sequence) that gathers the tile into shared memory
    and writes it out (sm_90a)."""

    def __init__(self, fn, tile_n: int, head_dim: int):
        self.fn, self.tile_n, self.head_dim = fn, tile_n, head_dim

    @cute.jit
    def on_cpu(self, mK: cute.Tensor, mT: cute.Tensor, mLen: cute.Tensor, mOut: cute.Tensor):
        # mOut (batch, heads_kv, tiles, tile_n, D)
        for b in cutlass.range(mOut.shape[0]):
            for h in cutlass.range(mOut.shape[1]):
                for n in cutlass.range(mOut.shape[2]):
                    for i in cutlass.range(mOut.shape[3]):
                        self.fn(mK, mT, b, h, n, i, mLen[b], mOut[b, h, n, None, None])

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mT: cute.Tensor, mLen: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        n, h, b = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sK = smem.allocate_tensor(mK.element_type, cute.make_layout(
            (self.tile_n, self.head_dim), stride=(self.head_dim + 1, 1)), 16)  # (tile_n, D)
        self.fn(mK, mT, b, h, n, tidx, mLen[b], sK)
        cute.arch.barrier()
        for d in cutlass.range_constexpr(self.head_dim):
            mOut[b, h, n, tidx, d] = sK[tidx, d]

    @cute.jit
    def launch(self, mK: cute.Tensor, mT: cute.Tensor, mLen: cute.Tensor, mOut: cute.Tensor,
               stream):
        grid = (mOut.shape[2], mOut.shape[1], mOut.shape[0])
        self.kernel(mK, mT, mLen, mOut).launch(grid=grid, block=(self.tile_n, 1, 1),
                                               stream=stream)


GUARD_PAGES = 96  # pages of -1 before and after the cache (Note [Decode exercises on the CPU])
TABLE_GUARD = 8192  # entries of -1 after the page table


class PagedCase:
    """A paged cache whose every element says where it lives: k[p, r, h, d] = 1 + the flat
    index of (p, r, h, d), so a copied row names the page, row and head it came from; -1 in
    the margins around the cache and after the table. Pages are handed out in a random order,
    slots past a sequence's pages hold -1 (as engines pad them)."""

    def __init__(self, lengths, page_size: int, tile_n: int, heads_kv: int = 2, d: int = 4,
                 seed: int = 15):
        rng = np.random.default_rng(seed)
        self.lengths = np.asarray(lengths, dtype=np.int32)
        self.page_size, self.tile_n, self.heads_kv, self.d = page_size, tile_n, heads_kv, d
        self.pages_of = [-(-int(x) // page_size) for x in self.lengths]
        self.num_pages = sum(self.pages_of) + 3  # three pages no sequence uses
        shape = (self.num_pages, page_size, heads_kv, d)
        self._buf = np.full((self.num_pages + 2 * GUARD_PAGES, *shape[1:]), -1.0, np.float32)
        self.k = self._buf[GUARD_PAGES:GUARD_PAGES + self.num_pages]
        self.k[...] = 1.0 + np.arange(self.k.size, dtype=np.float32).reshape(shape)
        assert self.k.size < 2 ** 24  # exact in float32
        max_pages = max(self.pages_of) + 1
        self._flat = np.full(len(self.lengths) * max_pages + TABLE_GUARD, -1, np.int32)
        self.table = self._flat[:len(self.lengths) * max_pages].reshape(-1, max_pages)
        order = rng.permutation(self.num_pages)
        c = 0
        for b, pages in enumerate(self.pages_of):
            self.table[b, :pages] = order[c:c + pages]
            c += pages
        self.tiles = max(1, -(-int(self.lengths.max()) // tile_n))

    def where(self, value: float):
        """(page, row, head, column) a copied value came from; None for 0 and for the margins."""
        if value <= 0 or not np.isfinite(value) or value > self.k.size:
            return None
        return np.unravel_index(int(value) - 1, self.k.shape)

    def expected(self, b: int, h: int, j: int):
        slot, row = divmod(j, self.page_size)
        return int(self.table[b, slot]), row

    def run(self, fn):
        out = np.full((len(self.lengths), self.heads_kv, self.tiles, self.tile_n, self.d),
                      np.nan, np.float32)
        _on_cpu(GatherKernels(fn, self.tile_n, self.d).on_cpu, self.k, self.table,
                self.lengths, out)
        return out


def _gather_mistake(case: PagedCase, out) -> str | None:
    ps, tn = case.page_size, case.tile_n
    for b, length in enumerate(case.lengths):
        for h in range(case.heads_kv):
            for j in range(case.tiles * tn):
                n, i = divmod(j, tn)
                got = out[b, h, n, i]
                where_ = (f"key {j} of sequence {b} (row {i} of key tile {n}, tile_n = {tn}, "
                          f"page_size = {ps}, KV head {h})")
                if j >= length:
                    if np.all(got == 0):
                        continue
                    if np.any(got == -1):
                        return (f"{where_} is past the sequence's {length} keys, and your code "
                                "read page -1 for it: a table slot past a sequence's pages may "
                                "hold anything (here -1). Test j < seqlen before reading the "
                                "table, and write zeros")
                    return (f"{where_} is past the sequence's {length} keys: its row must be 0 "
                            f"(the softmax masks it), got {got}; test j < seqlen and write "
                            "zeros there")
                page, row = case.expected(b, h, j)
                if np.any(np.isnan(got)):
                    return f"{where_} was never written (its row of sK still holds NaN)"
                if np.any(got == -1):
                    return (f"{where_}: your code read outside the cache or the page table (a "
                            f"margin holding -1); it lives in page {page}, row {row}")
                src = [case.where(v) for v in got]
                if any(s is None for s in src):
                    return f"{where_}: got {got}, which is no element of the cache"
                p, r, hh, _ = src[0]
                cols = [int(s[3]) for s in src]
                if (p, r) != (page, row) and p * ps + r == page * ps + j % tn:
                    return (f"{where_}: you read row {j % tn} counted from the start of page "
                            f"{page}, the row inside the key tile (j % tile_n); the row inside "
                            f"the page is j % page_size = {row}")
                if p != page:
                    slot = j // ps
                    if p == slot:
                        return (f"{where_}: row offset uses page index instead of "
                                f"page_table[b, page]: you read page {p}, the slot number "
                                f"j // page_size; the key is on page page_table[{b}, {slot}] "
                                f"= {page}")
                    if p == int(case.table[b, n]) and n != slot:
                        return (f"{where_}: you looked the page up by the key tile (slot {n}); "
                                f"a tile of {tn} keys is not a page of {ps}: the slot is "
                                f"j // page_size = {slot}, page {page}")
                    rows_of = [bb for bb in range(len(case.lengths))
                               if p in case.table[bb, :case.pages_of[bb]]]
                    if rows_of and b not in rows_of:
                        return (f"{where_}: you read page {p}, a page of sequence {rows_of[0]}: "
                                f"the table's row is the sequence, page_table[b, slot]; it "
                                f"should be page {page}")
                    return f"{where_}: you read page {p}, the key lives on page {page}"
                if r != row:
                    return (f"{where_}: you read row {r} of page {page}, it is row {row} "
                            "(j % page_size)")
                if hh != h:
                    return f"{where_}: you read KV head {hh}, the tile is KV head {h}"
                if cols != list(range(case.d)):
                    return f"{where_}: the columns came from {cols}, in order 0..{case.d - 1}"
    return None


GATHER_CASES = (
    # (lengths, page_size, tile_n): a tile of 64 spanning four pages of 16; pages of 48 that a
    # tile of 32 straddles; a page of 16 with one tile of 16 (pages and tiles alike) and an
    # empty sequence
    ((100, 0, 37), 16, 64),
    ((131, 5, 96), 48, 32),
    ((16, 33), 16, 16),
)


def check_gather_key_row(fn, compile_check: bool = True) -> None:
    """Exercise 15.2: every row of every key tile of three paged caches (tiles spanning pages,
    pages straddling tiles, an empty sequence, -1 in unused table slots) on this CPU, each
    copied value traced back to the page, row and head it came from; then compiled for sm_90a
    and its PTX read."""
    _refuse_host_and_device_only(fn, GATHER_NEEDS)
    for lengths, page_size, tile_n in GATHER_CASES:
        case = PagedCase(lengths, page_size, tile_n)
        mistake = _gather_mistake(case, case.run(fn))
        if mistake:
            raise AssertionError(mistake)
    if compile_check:
        mistake = _gather_ptx_mistake(gather_ptx_facts(fn))
        if mistake:
            raise AssertionError(mistake)


_GATHER_CACHE: dict = {}
GATHER_COMPILE = {"page_size": 16, "tile_n": 64, "d": 32}


def gather_compiled(fn):
    """``fn`` in the one-CTA-per-tile kernel for sm_90a, with a compile-time page size of 16
    (a power of two: j // page_size and j % page_size can be a shift and a mask)."""
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    if fn not in _GATHER_CACHE:
        c = GATHER_COMPILE
        _GATHER_CACHE[fn] = compile_for(
            "sm_90a", GatherKernels(fn, c["tile_n"], c["d"]).launch,
            fake_tensor(Float32, (None, c["page_size"], None, c["d"]),
                        stride_order=(3, 2, 1, 0)),
            fake_tensor(Int32, (None, None), stride_order=(1, 0)),
            fake_tensor(Int32, (None,)),
            fake_tensor(Float32, (None, None, None, c["tile_n"], c["d"]),
                        stride_order=(4, 3, 2, 1, 0)),
            fake_stream())
    return _GATHER_CACHE[fn]


def gather_ptx_facts(fn) -> dict:
    """What the tile costs, read from the PTX: scalar 32-bit loads from global memory (the
    sequence's length and the page table; the cache's rows come as vector loads), integer
    divisions, local memory."""
    import re

    art = gather_compiled(fn)
    ptx = art.ptx
    return {TABLE_LOADS: len(re.findall(r"ld\.global(?:\.nc)?\.[bsu]32\b", ptx)),
            "vector global loads (the cache's rows)":
            len(re.findall(r"ld\.global(?:\.nc)?\.v\d\.", ptx)),
            "integer divisions (div/rem)": len(re.findall(r"\b(?:div|rem)\.[su]32", ptx)),
            "local memory": art.spills > 0 or any(k.frame_bytes for k in art.kernels)}


def _gather_ptx_mistake(facts: dict) -> str | None:
    if facts["local memory"]:
        return ("compiled for sm_90a, the row uses local memory: index sK and the cache with "
                "compile-time column indices (cutlass.range_constexpr over D)")
    if facts[TABLE_LOADS] < 2:
        return ("compiled for sm_90a, the kernel never loads the page table: the page of a key "
                "must come from page_table[b, j // page_size] in global memory")
    if facts["integer divisions (div/rem)"]:
        return ("compiled for sm_90a with a compile-time page size of 16, the PTX still divides "
                f"({facts['integer divisions (div/rem)']} div/rem): take the page size from "
                "the cache's shape (cute.size(mK, mode=[1])) and the tile's rows from sK, so "
                "the compiler sees powers of two and shifts")
    return None


FORBID_GATHER = {
    rdecode.paged_key_row: "that is the package's page-table rule; write the address yourself",
    rdecode.gather_pages: "that gathers on the host with torch; write the device code",
}


def gather_gpu_case(page_size: int, tile_n: int, lengths, seed: int, heads_kv: int = 2,
                    d: int = 64):
    """A random paged cache for the GPU check: (k (num_pages, page_size, heads_kv, D) float32,
    page_table (batch, max_pages) int32 with -1 past each sequence's pages, the tiles it must
    give (batch, heads_kv, tiles, tile_n, D) by fa4_final's own gather, zeros past the end)."""
    g = torch.Generator().manual_seed(seed)
    pages_of = [-(-x // page_size) for x in lengths]
    num_pages = sum(pages_of) + 2
    k = torch.randn(num_pages, page_size, heads_kv, d, generator=g)
    table = torch.full((len(lengths), max(pages_of) + 1), -1, dtype=torch.int32)
    order = torch.randperm(num_pages, generator=g)
    c = 0
    for b, p in enumerate(pages_of):
        table[b, :p] = order[c:c + p].to(torch.int32)
        c += p
    tiles = max(1, -(-max(lengths) // tile_n))
    want = torch.zeros(len(lengths), heads_kv, tiles * tile_n, d)
    for b, length in enumerate(lengths):
        want[b, :, :length] = rdecode.gather_pages(k, table[b], length).permute(1, 0, 2)
    return k, table, want.view(len(lengths), heads_kv, tiles, tile_n, d)


def check_gather_on_gpu(fn, cases=((32, 64, (1000, 0, 333, 4097)), (48, 32, (129, 96)),
                                   (128, 64, (8192, 1, 700)))):
    """15.2 on a Hopper GPU: the one-CTA-per-tile kernel over random page tables (float32 keys,
    D = 64, unused slots -1), bit for bit against torch's gather. (ok, one line per case)."""
    import cuda.bindings.driver as cuda_driver
    from cutlass.cute.runtime import from_dlpack

    ok, lines = True, []
    for seed, (page_size, tile_n, lengths) in enumerate(cases):
        k, table, want = gather_gpu_case(page_size, tile_n, lengths, 1510 + seed)
        d = k.shape[-1]
        lens = torch.tensor(lengths, dtype=torch.int32)
        out = torch.full_like(want, float("nan")).cuda()
        stream = cuda_driver.CUstream(torch.cuda.current_stream().cuda_stream)
        GatherKernels(fn, tile_n, d).launch(
            *(from_dlpack(t) for t in (k.cuda(), table.cuda(), lens.cuda(), out)), stream)
        torch.cuda.synchronize()
        same = torch.equal(out.cpu(), want)
        ok &= same
        lines.append(f"page_size={page_size} tile_n={tile_n} lengths={lengths}: "
                     f"{'bit for bit' if same else 'DIFFERENT'} -> {'ok' if same else 'FAIL'}")
    return ok, lines


# ================================================================================================
# CUDA graphs: the combine captured once and replayed on new partials
# ================================================================================================
def graph_reference(lse_partial, out_partial):
    """The float64 merge of the combine's dense layout: lse_partial (splits, b, h, q),
    out_partial (splits, b, q, h, d) -> (out (b, q, h, d), lse (b, h, q))."""
    splits, b, h, q = lse_partial.shape
    d = out_partial.shape[-1]
    rows = torch.as_tensor(lse_partial).permute(0, 1, 3, 2).reshape(splits, -1)  # (b, q, h)
    out, lse, _ = combine_reference(rows.numpy(),
                                    torch.as_tensor(out_partial).reshape(splits, -1, d).numpy())
    return out.reshape(b, q, h, d), lse.reshape(b, q, h).transpose(0, 2, 1)


def graph_replay_combine(batch: int = 4, tokens: int = 1, heads: int = 32, d: int = 128,
                         splits: int = 7, replays: int = 3):
    """On a GPU: compile and warm up fa4_final's combine, capture one call in a CUDA graph, then
    write new partials into the same buffers (new empty splits each time) and replay; each
    replay against float64. (ok, lines)."""
    out = torch.empty(batch, tokens, heads, d, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(batch, heads, tokens, dtype=torch.float32, device="cuda")
    out_p, lse_p = rdecode.partials_like(out, splits)

    def fill(seed):
        g = torch.Generator().manual_seed(seed)
        lp = torch.randn(lse_p.shape, generator=g, dtype=torch.float64) * 4
        lp[torch.rand(lp.shape, generator=g) < 0.3] = float("-inf")
        op = torch.randn(out_p.shape, generator=g, dtype=torch.float64)
        lse_p.copy_(lp)
        out_p.copy_(op)
        return lp, op

    lines = []
    fill(0)
    rdecode.combine_splits(out_p, lse_p, out, lse)  # compile ahead + warm-up: no JIT in capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rdecode.combine_splits(out_p, lse_p, out, lse)
    ok = True
    for r in range(replays):
        lp, op = fill(100 + r)
        graph.replay()
        torch.cuda.synchronize()
        want_o, want_l = graph_reference(lp, op)
        got_o = out.double().cpu().numpy()
        got_l = lse.double().cpu().numpy()
        err = float(np.abs(got_o - want_o).max())
        out_ok = bool(np.all(np.abs(got_o - want_o) <= np.abs(want_o) * 2.0 ** -7 + 1e-3))
        lse_ok = bool(np.allclose(got_l, want_l, rtol=1e-5, atol=1e-3))  # -inf where -inf
        case_ok = out_ok and lse_ok
        ok &= case_ok
        lines.append(f"replay {r}: max |out - float64| {err:.2e} (bf16 out: within one bf16 "
                     f"step {'yes' if out_ok else 'NO'}), lse "
                     f"{'right' if lse_ok else 'WRONG'} -> {'ok' if case_ok else 'FAIL'}")
    return ok, lines


# ================================================================================================
# Exercise 15.3: a decode loop a CUDA graph can replay (host Python, a model of capture)
# ================================================================================================
class GraphRuleError(AssertionError):
    """A rule of CUDA-graph capture broken (the model raises it where CUDA would fail)."""


class DecodeEngine:
    """One attention layer's decode step on this CPU, in float64, behind a model of CUDA-graph
    capture. ``decode(q, page_table, seqused_k, out)`` "launches" the step: the first launch of
    a shape compiles it; inside ``with engine.capture(graph):`` a launch is recorded (the
    tensors themselves, as a graph records their addresses) instead of run, and a compile is
    refused, as CUDA refuses module loading while a stream captures. ``graph.replay()`` runs the
    recorded launches on whatever those tensors hold now. Static buffers: ``q``, ``page_table``,
    ``seqused_k``, ``out``; the paged cache ``k_cache``, ``v_cache`` (new keys are written into
    it by the layer before attention, outside the graph here)."""

    def __init__(self, batch: int = 3, heads: int = 4, heads_kv: int = 2, d: int = 8,
                 page_size: int = 4, max_pages: int = 6, seed: int = 15):
        g = torch.Generator().manual_seed(seed)
        num_pages = batch * max_pages + 2
        f64 = dict(dtype=torch.float64)
        self.k_cache = torch.randn(num_pages, page_size, heads_kv, d, generator=g, **f64)
        self.v_cache = torch.randn(num_pages, page_size, heads_kv, d, generator=g, **f64)
        self.q = torch.zeros(batch, 1, heads, d, **f64)
        self.page_table = torch.full((batch, max_pages), -1, dtype=torch.int32)
        self.seqused_k = torch.zeros(batch, dtype=torch.int32)
        self.out = torch.zeros(batch, 1, heads, d, **f64)
        self.compiled: set = set()
        self.direct_launches = 0
        self.replayed = 0  # steps run by a replay
        self.runs = 0  # steps run at all
        self.captures = 0
        self._recording = None

    def capture(self, graph: Graph):
        import contextlib

        @contextlib.contextmanager
        def recording():
            if self._recording is not None:
                raise GraphRuleError("a capture inside a capture")
            self._recording = graph
            self.captures += 1
            try:
                yield graph
            finally:
                self._recording = None
        return recording()

    def decode(self, q, page_table, seqused_k, out) -> None:
        key = (tuple(q.shape), tuple(page_table.shape), tuple(out.shape))
        if key not in self.compiled:
            if self._recording is not None:
                raise GraphRuleError(
                    "the decode kernel compiled while the graph was being captured: compiling "
                    "loads a module, which a capturing stream refuses. Launch it once before "
                    "the capture (the warm-up call), with the same shapes")
            self.compiled.add(key)
        if self._recording is not None:
            self._recording.launches.append((self._replayed, (q, page_table, seqused_k, out)))
            return
        self.direct_launches += 1
        self._run(q, page_table, seqused_k, out)

    def _replayed(self, *args) -> None:
        self.replayed += 1
        self._run(*args)

    def _run(self, q, page_table, seqused_k, out) -> None:
        self.runs += 1
        batch, _, heads, d = q.shape
        group = heads // self.k_cache.shape[2]
        for b in range(batch):
            n = int(seqused_k[b])
            if n == 0:
                out[b] = 0.0
                continue
            keys = rdecode.gather_pages(self.k_cache, page_table[b], n)  # (n, heads_kv, d)
            vals = rdecode.gather_pages(self.v_cache, page_table[b], n)
            for h in range(heads):
                s = keys[:, h // group] @ q[b, 0, h] * d ** -0.5
                out[b, 0, h] = torch.softmax(s, 0) @ vals[:, h // group]

    def expected(self, steps) -> list:
        """What each step must give: the same computation run directly, on fresh tensors."""
        want = []
        runs = self.runs
        for q, table, used in steps:
            o = torch.zeros_like(self.out)
            self._run(q, table, used, o)
            want.append(o)
        self.runs = runs
        return want


class Graph:
    """A captured sequence of launches; ``replay()`` reruns them on the captured tensors."""

    def __init__(self):
        self.launches: list = []
        self.replays = 0

    def replay(self) -> None:
        if not self.launches:
            raise GraphRuleError("replay() of a graph that captured no launch: call "
                                 "engine.decode(...) inside `with engine.capture(graph):`")
        self.replays += 1
        for fn, args in self.launches:
            fn(*args)


def serve_graph(engine: DecodeEngine, steps) -> list:
    """Exercise 15.3's reference: warm up on the static buffers, capture one step, then per step
    copy the new inputs into the buffers, replay, and keep a copy of out."""
    q, table, used = steps[0]
    engine.q.copy_(q)
    engine.page_table.copy_(table)
    engine.seqused_k.copy_(used)
    engine.decode(engine.q, engine.page_table, engine.seqused_k, engine.out)  # compile + warm up
    graph = Graph()
    with engine.capture(graph):
        engine.decode(engine.q, engine.page_table, engine.seqused_k, engine.out)
    outs = []
    for q, table, used in steps:
        engine.q.copy_(q)
        engine.page_table.copy_(table)
        engine.seqused_k.copy_(used)
        graph.replay()
        outs.append(engine.out.clone())
    return outs


def decode_steps(engine: DecodeEngine, count: int = 5, seed: int = 16) -> list:
    """``count`` successive decode steps: each sequence grows by one key a step (a new page
    from the pool when it crosses a page edge), a new query token each step; one sequence is
    empty at first."""
    g = torch.Generator().manual_seed(seed)
    batch, page_size = engine.q.shape[0], engine.k_cache.shape[1]
    free = list(torch.randperm(engine.k_cache.shape[0], generator=g).tolist())
    lengths = [page_size - 2, 0, 2 * page_size - 1][:batch] + [3] * max(0, batch - 3)
    table = torch.full_like(engine.page_table, -1)
    steps = []
    for _ in range(count):
        lengths = [n + 1 for n in lengths]
        for b, n in enumerate(lengths):
            for slot in range(-(-n // page_size)):
                if table[b, slot] < 0:
                    table[b, slot] = free.pop()
        q = torch.randn(engine.q.shape, generator=g, dtype=torch.float64)
        steps.append((q, table.clone(), torch.tensor(lengths, dtype=torch.int32)))
    return steps


def check_serve_graph(fn) -> None:
    """Exercise 15.3: five steps of growing sequences (new pages as they cross page edges)
    served by ``fn``; the outputs against the same steps run directly, then the rules: one
    capture, no compile inside it, no direct launch after the warm-up, a copy of out per step."""
    engine = DecodeEngine()
    steps = decode_steps(engine)
    want = engine.expected(steps)
    buffers = {name: getattr(engine, name) for name in ("q", "page_table", "seqused_k", "out")}
    outs = fn(engine, steps)
    for name, t in buffers.items():
        if getattr(engine, name) is not t:
            raise AssertionError(f"you replaced engine.{name} with a new tensor: a graph holds "
                                 "the addresses it captured, so the buffers stay; copy new "
                                 f"values into them (engine.{name}.copy_(...))")
    if engine.captures == 0:
        raise AssertionError("nothing was captured: capture one step with `with "
                             "engine.capture(graph): engine.decode(...)`, then replay it")
    if engine.captures > 1:
        raise AssertionError(f"you captured {engine.captures} graphs for {len(steps)} steps: a "
                             "capture costs far more than a replay; capture once, replay each "
                             "step")
    if engine.runs > engine.direct_launches + engine.replayed:
        raise AssertionError("you ran the step without the engine's launch (engine._run): "
                             "serve every step through the graph's replay")
    if engine.direct_launches > 1:
        raise AssertionError(f"the kernel was launched directly {engine.direct_launches} times: "
                             "one warm-up launch before the capture, then every step a replay")
    if not isinstance(outs, (list, tuple)) or len(outs) != len(steps):
        raise AssertionError(f"return one output per step ({len(steps)}), got {type(outs)}")
    if len({id(o) for o in outs}) < len(outs) or any(o is engine.out for o in outs):
        raise AssertionError("your outputs are engine.out itself: the next replay overwrites it; "
                             "keep a copy per step (engine.out.clone())")
    for i, (got, exp) in enumerate(zip(outs, want)):
        if not torch.allclose(got, exp, atol=1e-12):
            stale = [j for j in range(len(steps)) if torch.allclose(got, want[j], atol=1e-12)]
            if stale:
                raise AssertionError(
                    f"step {i} gave step {stale[0]}'s output: the replay reads the captured "
                    "buffers, so copy each step's q, page_table and seqused_k into engine.q, "
                    "engine.page_table and engine.seqused_k before graph.replay()")
            raise AssertionError(f"step {i}: out differs from the direct run by "
                                 f"{float((got - exp).abs().max()):.3g}")


FORBID_SERVE = {
    decode_steps: "the steps are given to you; serve them",
}


# ================================================================================================
# Reading the decode benchmark (results/<gpu>/decode.json)
# ================================================================================================
def load_decode(name: str = DECODE):
    """The stored decode run ``name`` from the first of DECODE_GPUS that has one (both are
    Hopper GPUs; the run's label names the one it came from), or None after saying that none
    was measured."""
    from utils import results

    for gpu in DECODE_GPUS:
        try:
            return results.load(name, gpu=gpu)
        except FileNotFoundError:
            continue
    print(f"{name}: not measured yet (no results/<gpu>/{name}.json for gpu in {DECODE_GPUS})")
    return None


def stored_path(res) -> str:
    """The run's file relative to the course: results/<gpu>/<name>.json."""
    return f"results/{res.path.parent.name}/{res.path.name}"


def decode_row(res, impl: str, mode: str = "flush", **shape):
    """The row of ``impl`` at ``shape`` (HEADLINE's keys by default) in ``mode``, or None."""
    want = {**HEADLINE, **shape}
    for r in res.rows:
        if r.get("impl") == impl and r.get("mode") == mode and all(
                r.get(k) == v for k, v in want.items()):
            return r
    return None


def copy_rate(res, mode: str = "flush"):
    """The run's own copy rate (TB/s, read + written bytes over time) in ``mode``."""
    for r in res.rows:
        if r.get("impl") == "copy" and r.get("mode") == mode:
            return r.get("value")
    return None


def headline_lines(res, mode: str = "flush") -> list[str]:
    """Every implementation at the headline shape: time, bytes read per second, share of the
    run's copy rate, spread over rounds."""
    from utils import bench

    lines = [f"batch {HEADLINE['b']}, {HEADLINE['s_q']} query token, {HEADLINE['s']:,} keys, "
             f"{HEADLINE['h']}/{HEADLINE['h_kv']} heads, D = {HEADLINE['d']}, bf16, mode {mode}; "
             f"copy rate of the run {copy_rate(res, mode) or float('nan'):.2f} TB/s"]
    for impl in ("fa4_final_decode", "fa4_final_decode_paged", "fa4_final", "fa4_package",
                 "fa4_package_splits", "fa4_package_paged", "sdpa_flash", "sdpa_cudnn"):
        r = decode_row(res, impl, mode)
        if r is None:
            continue
        if not r.get("ms"):
            lines.append(f"  {impl:22s} no time: {r.get('error', 'not run')}")
            continue
        lines.append(f"  {impl:22s} {r['ms'] * 1e3:8.1f} us  {r.get('read_tbps', 0):5.2f} TB/s "
                     f" {r.get('of_copy', float('nan')):5.0%} of copy  spread "
                     f"{bench.row_spread(r) or 0:.0%}")
    return lines


def of_copy(res, impl: str = "fa4_final_decode", mode: str = "flush", **shape):
    r = decode_row(res, impl, mode, **shape)
    return None if r is None else r.get("of_copy")


def time_ratio(res, impl_a: str, impl_b: str, mode: str = "flush", **shape):
    """``impl_a``'s time over ``impl_b``'s at one shape (HEADLINE's keys updated by ``shape``)
    of one run; None if either is missing or untimed."""
    a, b = (decode_row(res, impl, mode, **shape) for impl in (impl_a, impl_b))
    if not (a and b and a.get("ms") and b.get("ms")):
        return None
    return a["ms"] / b["ms"]


def paged_over_contiguous(res, mode: str = "flush", **shape):
    """The decode kernel's time with a page table over its time on the contiguous cache, same
    shape and run; None if either is missing."""
    return time_ratio(res, "fa4_final_decode_paged", "fa4_final_decode", mode, **shape)


def keys_on_m_over_rows(res, mode: str = "flush", **shape):
    """The keys-on-M kernel's time over the 64-row kernel's, same shape and run; None if
    either is missing."""
    return time_ratio(res, "fa4_final_decode_keys_on_m", "fa4_final_decode", mode, **shape)


def timed_pairs(res, impl: str, mode: str = "flush"):
    """(shape, ``impl``'s row, fa4_final_decode's row) of every shape of the run where both were
    timed in ``mode``."""
    for a in res.rows:
        if a.get("impl") != impl or a.get("mode") != mode:
            continue
        shape = {k: a[k] for k in HEADLINE}
        b = decode_row(res, "fa4_final_decode", mode, **shape)
        if b and a.get("ms") and b.get("ms"):
            yield shape, a, b


def keys_on_m_lines(res, mode: str = "flush") -> list[str]:
    """Every shape of the run where both decode kernels were timed: the keys-on-M kernel's
    time over the 64-row kernel's, each kernel's share of the copy rate, and the verdict."""
    from utils import bench

    lines = []
    for shape, a, b in timed_pairs(res, "fa4_final_decode_keys_on_m", mode):
        c = bench.compare(a, b)
        lines.append(f"  b {shape['b']:3d}  tokens {shape['s_q']:2d}  keys {shape['s']:6d}  "
                     f"{shape['h']}/{shape['h_kv']}  N = {a.get('rows_n', '?'):>2}:  "
                     f"{a['ms'] / b['ms']:.3f}x the time  ({a.get('of_copy', 0):.0%} and "
                     f"{b.get('of_copy', 0):.0%} of copy; {c})")
    return lines


def grid_lines(res, impl: str = "fa4_final_splits", mode: str = "flush") -> list[str]:
    """Every shape of the run where ``impl`` was timed: its speed over the fastest peer of the
    shape (and which peer that was), its share of the copy rate, and the verdict beside the
    rounds' spread; a last line counts the shapes at or above 1.0x."""
    from utils import bench

    lines, ahead, timed = [], 0, 0
    for a in res.rows:
        if a.get("impl") != impl or a.get("mode") != mode or not a.get("ms"):
            continue
        if not a.get("best_peer"):
            continue
        shape = {k: a[k] for k in HEADLINE}
        peer = decode_row(res, a["best_peer"], mode, **shape)
        c = bench.compare(a, peer) if peer else None
        timed += 1
        ahead += a["vs_best_peer"] >= 1.0
        lines.append(f"  D {a['d']:3d}  {a['h']}/{a['h_kv']}  b {a['b']:3d}  tokens {a['s_q']:2d}"
                     f"  keys {a['s']:6d}:  {a['vs_best_peer']:.2f}x {a['best_peer']:18s} "
                     f"{a.get('of_copy', 0):4.0%} of copy  ({c.verdict if c else '?'})")
    lines.append(f"{impl} at or above the fastest peer at {ahead} of {timed} shapes ({mode})")
    return lines


def speed_ratios(res, impl: str = "fa4_final_decode", mode: str = "flush",
                 keys_at_least: int = 0, keys_below: int | None = None) -> list[float]:
    """vs_best_peer of ``impl``'s timed rows in ``mode`` whose cache length lies in
    [keys_at_least, keys_below)."""
    return [a["vs_best_peer"] for a in res.rows
            if a.get("impl") == impl and a.get("mode") == mode and a.get("ms")
            and a.get("vs_best_peer") and a.get("s", 0) >= keys_at_least
            and (keys_below is None or a.get("s", 0) < keys_below)]


def share_within_of_best(res, impl: str = "fa4_final_decode", mode: str = "flush",
                      min_keys: int = 8192, within: float = 0.01):
    """The fraction of the run's shapes with at least ``min_keys`` cached keys where ``impl``
    is at most ``within`` slower than the fastest peer, or faster (vs_best_peer >= 1 -
    within); None if none was timed."""
    ratios = speed_ratios(res, impl, mode, min_keys)
    return sum(r >= 1.0 - within for r in ratios) / len(ratios) if ratios else None


def two_over_one(res, mode: str = "flush", **shape):
    """The two-consumer kernel's time (fa4_final_decode_wg2) over the one-consumer kernel's
    (fa4_final_decode) at TWO_CONSUMERS_SHAPE updated by ``shape``; None if either is missing."""
    return time_ratio(res, "fa4_final_decode_wg2", "fa4_final_decode", mode,
                      **{**TWO_CONSUMERS_SHAPE, **shape})


def two_consumers_lines(res, mode: str = "flush") -> list[str]:
    """Every shape of the two-consumer run: its time over the one-consumer kernel's, each one's
    speed over the fastest peer of the run and share of the copy rate, and the verdict."""
    from utils import bench

    lines = []
    for shape, a, b in timed_pairs(res, "fa4_final_decode_wg2", mode):
        rows = shape["s_q"] * shape["h"] // shape["h_kv"]
        lines.append(f"  D {shape['d']:3d}  b {shape['b']:2d}  keys {shape['s']:6d}  "
                     f"{rows:3d} rows:  {a['ms'] / b['ms']:.3f}x the time;  vs the fastest "
                     f"peer {a.get('vs_best_peer', 0):.2f}x and {b.get('vs_best_peer', 0):.2f}x, "
                     f"{a.get('of_copy', 0):.0%} and {b.get('of_copy', 0):.0%} of copy; "
                     f"{bench.compare(a, b)}")
    return lines


def verdict(res, impl_a: str, impl_b: str, mode: str = "flush", **shape) -> str:
    """One sentence comparing two rows of the same shape and run, beyond their spread or within
    it (utils.bench.compare's rule)."""
    from utils import bench

    a, b = (decode_row(res, impl, mode, **shape) for impl in (impl_a, impl_b))
    if not (a and b and a.get("ms") and b.get("ms")):
        return f"{impl_a} or {impl_b} has no time at this shape"
    c = bench.compare(a, b)
    return f"{impl_a} against {impl_b}: {c}"


# ================================================================================================
# Claims the chapter's prose makes about the keys-on-M run (utils.claims)
# ================================================================================================
@claim("15.keys_on_m_ties_when_memory_bound", KEYS_ON_M,
       "where both decode kernels reach 90% of the copy rate or more, the keys-on-M kernel's time "
       "is within 1% of the 64-row kernel's", gpu="h100")
def _keys_on_m_ties(res):
    ratios = []
    for a in res.rows:
        if a.get("impl") != "fa4_final_decode_keys_on_m" or a.get("mode") != "flush":
            continue
        shape = {k: a[k] for k in HEADLINE}
        b = decode_row(res, "fa4_final_decode", "flush", **shape)
        if b and a.get("ms") and b.get("ms") and min(a["of_copy"], b["of_copy"]) >= 0.9:
            ratios.append(a["ms"] / b["ms"])
    return bool(ratios) and all(abs(r - 1) <= 0.01 for r in ratios), (
        f"{len(ratios)} shapes at >= 90% of copy, time ratios "
        f"{min(ratios, default=float('nan')):.3f}-{max(ratios, default=float('nan')):.3f}")


@claim("15.decode_grid_two_regimes", DECODE,
       "with 1k keys no kernel of the run streams near the copy rate and the decode kernel "
       "trails the fastest peer at most flushed shapes; from 8k keys on it is within 1% of the "
       "fastest peer at every flushed shape but those of 128 packed rows (16 tokens, GQA 8), "
       "where it trails by more, and the package's call, which gives those rows two consumer "
       "warpgroups, trails less there", gpu="h100")
def _decode_grid_two_regimes(res):
    short = speed_ratios(res, keys_below=8192)
    copy = [a["of_copy"] for a in res.rows if a.get("mode") == "flush" and a.get("ms")
            and a.get("s", 0) < 8192 and a.get("of_copy") and a.get("impl") != "copy"]
    tied, wide = [], []
    for a in res.rows:
        if (a.get("impl") != "fa4_final_decode" or a.get("mode") != "flush" or not a.get("ms")
                or a.get("s", 0) < 8192):
            continue
        if a["s_q"] * a["h"] // a["h_kv"] == 128:
            call = decode_row(res, "fa4_final", "flush", **{k: a[k] for k in HEADLINE})
            wide.append((a["vs_best_peer"], call and call.get("vs_best_peer")))
        else:
            tied.append(a["vs_best_peer"])
    ok = (bool(short) and sum(r < 1.0 for r in short) > len(short) / 2
          and bool(copy) and max(copy) < 0.9 and bool(tied) and min(tied) >= 0.99
          and bool(wide) and all(k < 0.99 and c and c > k for k, c in wide))
    return ok, (f"1k keys: {sum(r < 1.0 for r in short)} of {len(short)} below, best share of "
                f"copy {max(copy, default=0):.2f}; >= 8k keys: {min(tied, default=0):.3f}-"
                f"{max(tied, default=0):.3f} over {len(tied)} shapes, 128 rows (kernel, call): "
                + ", ".join(f"({k:.2f}, {c:.2f})" for k, c in wide))


def _two_consumer_pairs(res, d: int, b: int, rows: int):
    """(two-consumer row, one-consumer row) of every flushed shape of the run at head dim d,
    batch b and ``rows`` packed rows, both timed."""
    for a in res.rows:
        if (a.get("impl") != "fa4_final_decode_wg2" or a.get("mode") != "flush"
                or (a.get("d"), a.get("b"), a.get("s_q") * a.get("h") // a.get("h_kv"))
                != (d, b, rows)):
            continue
        one = decode_row(res, "fa4_final_decode", "flush", **{k: a[k] for k in HEADLINE})
        if one and a.get("ms") and one.get("ms"):
            yield a, one


@claim("15.two_consumers_lead_at_256_rows", TWO_CONSUMERS,
       "at D = 128, batch 32 and 256 packed rows (16 tokens, GQA 16) the two-consumer kernel is "
       "faster than the one-consumer kernel beyond the rounds' spread at every cache length of "
       "the run (L2 flushed)", gpu="h100")
def _two_consumers_lead(res):
    from utils import bench

    found = [(a["s"], one["ms"] / a["ms"], bench.compare(a, one).verdict == "faster")
             for a, one in _two_consumer_pairs(res, 128, 32, 256)]
    return bool(found) and all(f for _, _, f in found), (
        f"{len(found)} cache lengths; speed-ups " + ", ".join(f"{s}: {r:.2f}x" for s, r, _ in
                                                              sorted(found)))


@claim("15.two_consumers_tie_near_copy", TWO_CONSUMERS,
       "at D = 128, batch 32 and 128 packed rows (16 tokens, GQA 8), where the one-consumer "
       "kernel reaches 90% of the copy rate or more, the two-consumer kernel's time is within 10% "
       "of it (L2 flushed)", gpu="h100")
def _two_consumers_tie(res):
    ratios = [a["ms"] / one["ms"] for a, one in _two_consumer_pairs(res, 128, 32, 128)
              if one.get("of_copy", 0) >= 0.9]
    return bool(ratios) and all(abs(r - 1) <= 0.1 for r in ratios), (
        f"{len(ratios)} shapes, time ratios {min(ratios, default=float('nan')):.3f}-"
        f"{max(ratios, default=float('nan')):.3f}")


# ----------------------------------------------------------------------------------------------
# Section 5 measured: the calls replayed from CUDA graphs (measure/decode.py --modes graph)

GRAPH_IMPLS = (("fa4_final_splits", "fa4_final"), ("sdpa_cudnn", "cuDNN"),
               ("sdpa_flash", "SDPA flash"), ("fa4_package", "FA4 package"))


def graph_shapes(res) -> list[tuple]:
    """(batch, tokens, keys) of every shape where the package's call was timed both ways."""
    got = {(a["b"], a["s_q"], a["s"]) for a in res.rows
           if a.get("impl") == "fa4_final_splits" and a.get("mode") == "graph" and a.get("ms")}
    return sorted(got)


def graph_pair(res, impl: str, b: int, tokens: int, keys: int):
    """(back-to-back row, graph row) of ``impl`` at one shape of the run (None where absent)."""
    shape = {"b": b, "s_q": tokens, "s": keys}
    return (decode_row(res, impl, "back_to_back", **shape), decode_row(res, impl, "graph", **shape))


def graph_lines(res) -> list[str]:
    """Per shape: each implementation's microseconds per call back to back -> replayed, and the
    package's call over the fastest peer in both modes."""
    lines = ["microseconds per call, back to back -> replayed from a CUDA graph"]
    for b, t, k in graph_shapes(res):
        parts = []
        for impl, label in GRAPH_IMPLS:
            a, g = graph_pair(res, impl, b, t, k)
            if a and g and a.get("ms") and g.get("ms"):
                parts.append(f"{label} {a['ms'] * 1e3:.0f} -> {g['ms'] * 1e3:.0f}")
        a, g = graph_pair(res, "fa4_final_splits", b, t, k)
        lines.append(f"  b {b:2d} tokens {t:2d} keys {k:6d}: " + ", ".join(parts)
                     + f"; fa4_final over the fastest peer {a['vs_best_peer']:.2f} -> "
                     f"{g['vs_best_peer']:.2f}")
    return lines


def graph_speedup(res, impl: str = "fa4_final_splits", b: int = 1, tokens: int = 1,
                  keys: int = 1024):
    """``impl``'s back-to-back time over its replayed time at one shape, or None."""
    a, g = graph_pair(res, impl, b, tokens, keys)
    return a["ms"] / g["ms"] if a and g and a.get("ms") and g.get("ms") else None


@claim("15.graph_host_at_batch1", GRAPH,
       "at batch 1 with 1k and 8k keys every implementation is faster replayed from a graph "
       "than back to back, the package's call by 6x or more; at batch 32 with 8k keys or more "
       "its two times agree within 2%", gpu="h100")
def _graph_host_at_batch1(res):
    short = [(impl, graph_speedup(res, impl, 1, t, k)) for impl, _l in GRAPH_IMPLS
             for _b, t, k in graph_shapes(res) if _b == 1 and k <= 8192]
    ours = [x for impl, x in short if impl == "fa4_final_splits"]
    long_ = [graph_speedup(res, "fa4_final_splits", b, t, k) for b, t, k in graph_shapes(res)
             if b == 32 and k >= 8192]
    ok = (len(ours) == 4 and all(x and x > 1 for _i, x in short) and min(ours) >= 6
          and bool(long_) and all(abs(x - 1) <= 0.02 for x in long_))
    return ok, (f"batch 1: {', '.join(f'{i[:10]} {x:.1f}' for i, x in short if x)}; batch 32 "
                f">= 8k keys: {', '.join(f'{x:.3f}' for x in long_ if x)}")


@claim("15.graph_ranks_at_batch1", GRAPH,
       "replayed from graphs at batch 1, the package's call is ahead of every peer at 16 tokens "
       "(1k and 8k keys) and behind cuDNN at one token with 8k keys", gpu="h100")
def _graph_ranks(res):
    vs = {(t, k): graph_pair(res, "fa4_final_splits", 1, t, k)[1] for t in (1, 16)
          for k in (1024, 8192)}
    if not all(vs.values()):
        return False, "a shape is missing"
    ok = (all(vs[key]["vs_best_peer"] > 1 for key in ((16, 1024), (16, 8192)))
          and vs[(1, 8192)]["vs_best_peer"] < 1 and vs[(1, 8192)]["best_peer"] == "sdpa_cudnn")
    return ok, "; ".join(f"t{t} k{k} {r['vs_best_peer']:.2f} vs {r['best_peer']}"
                         for (t, k), r in vs.items())


TIMELINE = "decode_timeline"  # measure/decode_timeline.py: a replayed step, kernel by kernel


def timeline_value(res, impl: str, tokens: int, keys: int, kernel, metric: str):
    """One median of the kernel-by-kernel run (kernel None: the step's span), or None."""
    return next((r["value"] for r in res.rows if r["impl"] == impl and r["s_q"] == tokens
                 and r["s"] == keys and r.get("kernel") == kernel and r["metric"] == metric),
                None)


def timeline_lines(res, impls=("fa4_final_splits", "sdpa_cudnn")) -> list[str]:
    """Per shape and implementation: each kernel's microseconds, the gaps, the step's span."""
    lines = ["replayed at batch 1, microseconds (medians): kernel durations [gaps before], span"]
    width = max(17, *(len(i) for i in impls))
    for t, k in sorted({(r["s_q"], r["s"]) for r in res.rows}):
        for impl in impls:
            ks = sorted({r["kernel"] for r in res.rows if r["impl"] == impl and r["s_q"] == t
                         and r["s"] == k and r.get("kernel") is not None})
            parts = []
            for i in ks:
                part = f"{timeline_value(res, impl, t, k, i, 'duration_us'):.2f}"
                gap = timeline_value(res, impl, t, k, i, "gap_before_us") if i else None
                parts.append(part + (f" [{gap:.2f}]" if gap is not None else ""))
            span = timeline_value(res, impl, t, k, None, "span_us")
            if not parts:
                continue
            lines.append(f"  tokens {t:2d} keys {k:5d} {impl:{width}s} " + " + ".join(parts)
                         + f" = span {span:.2f}")
    return lines


@claim("15.timeline_combine_is_the_gap", TIMELINE,
       "replayed at batch 1 with one token, cuDNN runs two kernels as the package's call does; "
       "at 8k keys our combine takes longer than cuDNN's second kernel, by more than half of "
       "what our step's span exceeds cuDNN's", gpu="h100")
def _timeline_combine_is_the_gap(res):
    def v(impl, kernel, metric):
        return timeline_value(res, impl, 1, 8192, kernel, metric)

    two = all(v(impl, 1, "duration_us") is not None and v(impl, 2, "duration_us") is None
              for impl in ("fa4_final_splits", "sdpa_cudnn"))
    if not two:
        return False, "not two kernels each"
    combine = v("fa4_final_splits", 1, "duration_us") - v("sdpa_cudnn", 1, "duration_us")
    span = v("fa4_final_splits", None, "span_us") - v("sdpa_cudnn", None, "span_us")
    return (combine > 0.5 * span > 0,
            f"second kernel +{combine:.2f} us of a span difference of {span:.2f} us")
