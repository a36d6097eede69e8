"""Chapter 05's teaching helpers: small models, a pipeline simulation, pictures, and the exercises.

The kernel itself is ``solutions/ch05_flash_hopper.py``; this module only looks at it (its
config, its shared-memory sum, its compiled PTX and SASS) and models the ideas around it:

- why mma.sync cannot feed Hopper's tensor cores: B-operand reuse against shared-memory bandwidth;
- what a TMA tensor map holds, and a NumPy copy of one box with zero fill past the edges;
- the 128-byte swizzle as CuTe builds it for the kernel's tiles;
- an mbarrier ring with phase bits (``RingSim``): a producer, consumers, TMA latency, full and
  empty barriers; it finds deadlocks, overwrites and stale reads, and draws a timeline;
- one steady-state turn of the compiled SASS (where ptxas put the waits and the exponentials);
- a fluid model of two or three consumer warpgroups sharing the tensor cores and MUFU, with and
  without ping-pong;
- exercises 05.1 (stage count), 05.2 (the producer's step of the ring), 05.3 (a race that
  hides: drive the simulator into the failure), and 05.4 in device code, the kernel's own
  producer loop over the K and V rings (``HopperWithProducer`` swaps it into the kernel;
  ``record_producer`` and ``KVRingSim`` check it on the CPU): their references and checkers.
  The consumers' exercises in device code (05.5, 05.6) are in ``solutions.ch05_consumer``;
- the stored figures read with verdicts: standing against the peers, the knob run against the
  spread between runs, and the Nsight Compute profile (``solutions.ch05_profile``).

Nothing here needs a GPU, except the ``*_on_gpu`` checks of the exercises.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field, replace

import cutlass
import cutlass.cute as cute
import numpy as np

from solutions import ch05_flash_hopper as ch05
from utils import hardware, roofline
from utils.claims import claim
from utils.hardware import PER_SM
from utils.notebook import source_between  # noqa: F401 (the notebook quotes the kernel with it)
from utils.results import load_stored  # noqa: F401 (the notebook's stored-results cells)

HOPPER = PER_SM["sm_90"]
ELEM_BYTES = 2  # bf16 / fp16
SWIZZLE_BYTES = 128  # the widest TMA / wgmma swizzle: 16-byte chunks permuted within 128 B


# ================================================================================================
# Stored results
# ================================================================================================
def stored_table(res, prefer=("impl", "knob", "config", "d", "s", "causal", "ms", "tflops")):
    """A results file as a plain table of the preferred columns it actually has."""
    columns = [c for c in prefer if any(c in r for r in res.rows)]
    return res.table(columns or None)


def tflops_groups(res, pass_: str = "fwd") -> tuple[list[str], dict[str, list]]:
    """Attention results as (group labels, {impl: TFLOP/s per group}) for
    ``utils.plots.grouped_bars``: one group per (D, S, causal), every implementation side by
    side (None where it has no figure)."""
    rows = [r for r in res.rows if r.get("pass") == pass_]
    keys = sorted({(r["d"], r["s"], r["causal"]) for r in rows},
                  key=lambda k: (-k[0], k[2], k[1]))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    series = {
        impl: [next((r["tflops"] for r in rows
                     if r["impl"] == impl and (r["d"], r["s"], r["causal"]) == key), None)
               for key in keys]
        for impl in impls
    }
    labels = [f"D={d} S={s}\n{'causal' if c else 'non-causal'}" for d, s, c in keys]
    return labels, series


def plot_tflops(res, title: str, course=("flash_hopper",), ax=None):
    """``utils.plots.grouped_bars`` of ``tflops_groups(res)``, labelled with the provenance; the
    course's own kernels in the course colour."""
    import matplotlib.pyplot as plt

    from utils import plots

    groups, series = tflops_groups(res)
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 4.5))
    plots.grouped_bars(groups, series, title=title, ylabel="TFLOP/s", ax=ax,
                       provenance=res.label)
    for name, bars in zip(series, ax.containers):
        if name in course:
            for bar in bars:
                bar.set_color(plots.PALETTE["course"])
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    return ax


# What profile_lines prints of solutions.ch05_profile's file, in order: (metric, what it is).
PROFILE_METRICS = (
    ("tensor_pipe_gmma_active_pct", "tensor pipe busy with wgmma (share of cycles, %)"),
    ("tensor_pipe_active_pct", "tensor pipe busy, the mma.sync counter (%)"),
    ("issue_slots_busy_pct", "issue slots used (%)"),
    ("achieved_warps_per_scheduler", "warps per scheduler (achieved)"),
    ("registers_per_thread", "registers per thread at launch"),
    ("ctas_per_sm_limit_registers", "CTAs per SM the registers allow"),
    ("ctas_per_sm_limit_shared_mem", "CTAs per SM the shared memory allows"),
    ("warp_time_producer_pct", "warp time: producer warp %"),
    ("warp_time_consumer_pct", "warp time: consumer warps %"),
    ("producer_time_mbarrier_wait_pct", "producer: at its mbarrier waits (a free slot) %"),
    ("producer_time_tma_issue_pct", "producer: issuing TMA loads %"),
    ("consumer_time_mbarrier_wait_pct", "consumers: at mbarrier waits (a tile to land) %"),
    ("consumer_time_wgmma_wait_pct", "consumers: at wgmma waits (wait_group) %"),
    ("consumer_time_named_barrier_wait_pct", "consumers: at named barriers (turns, epilogue) %"),
    ("consumer_time_wgmma_issue_pct", "consumers: issuing wgmma %"),
    ("consumer_time_exp2_pct", "consumers: exponentials (MUFU.EX2) %"),
    ("consumer_turn_turn_head_pct", "consumers' steady turn: K/V waits, loop head %"),
    ("consumer_turn_issue_gemms_pct", "consumers' steady turn: issue S and P V %"),
    ("consumer_turn_wait_s_pct", "consumers' steady turn: wait for S (wait_group 1) %"),
    ("consumer_turn_softmax_under_pv_pct", "consumers' steady turn: softmax while P V runs %"),
    ("consumer_turn_wait_pv_pct", "consumers' steady turn: wait for P V (wait_group 0) %"),
    ("consumer_turn_after_pv_pct", "consumers' steady turn: after P V (P to bf16, O rescale) %"),
    ("consumer_time_outside_steady_turn_pct", "consumers: outside the steady turns %"),
    ("wgmma_per_consumer_warp_per_step", "wgmma per consumer warp per KV step"),
    ("other_instructions_per_consumer_warp_per_step",
     "other instructions per consumer warp per KV step"),
)


def profile_lines(res, stalls: int = 6) -> list[str]:
    """The stored Nsight Compute profile of chapter 05's kernel (solutions.ch05_profile): the
    counters of PROFILE_METRICS, the largest stall reasons (cycles per issued instruction, all
    warps), then the consumers' stall reasons by share of their samples."""
    from solutions.ch04_profile import format_profile

    lines = format_profile(res, PROFILE_METRICS, stalls)
    mine = sorted((r for r in res.rows if r["metric"].startswith("consumer_stall_")),
                  key=lambda r: -r["value"])
    if mine:
        lines.append("  consumers' samples by stall reason (%):")
        for r in mine[:stalls]:
            name = r["metric"][len("consumer_stall_"):-len("_samples_pct")]
            lines.append(f"    {name:26s} {r['value']:5.1f}")
    return lines


def profile_reading(res) -> list[str]:
    """The stored profile as sentences whose verdicts are computed from its numbers."""
    by = {r["metric"]: r["value"] for r in res.rows}
    out = []
    busy = by.get("tensor_pipe_gmma_active_pct", by.get("tensor_pipe_active_pct"))
    if busy is not None and "issue_slots_busy_pct" in by:
        issue = by["issue_slots_busy_pct"]
        verdict = ("the tensor pipe is the busier of the two" if busy > issue
                   else "the issue slots are the busier of the two")
        out.append(f"tensor pipe busy {busy:.0f}% of the cycles, issue slots {issue:.0f}%: "
                   f"{verdict}")
    waits = {k: by.get(f"consumer_time_{k}_wait_pct") for k in ("mbarrier", "wgmma",
                                                                 "named_barrier")}
    if all(v is not None for v in waits.values()):
        total = sum(waits.values())
        top = max(waits, key=waits.get)
        out.append(f"the consumer warps spend {total:.0f}% of their sampled time at waits, most "
                   f"at {top.replace('_', ' ')} waits ({waits[top]:.0f}%)")
    parts = [(p, by.get(f"consumer_turn_{p}_pct")) for p in (
        "turn_head", "issue_gemms", "wait_s", "softmax_under_pv", "wait_pv", "after_pv")]
    if all(v is not None for _, v in parts):
        names = {"turn_head": "K/V waits and loop head", "issue_gemms": "issuing S and P V",
                 "wait_s": "waiting for S", "softmax_under_pv": "softmax under P V",
                 "wait_pv": "waiting for P V", "after_pv": "after P V"}
        ranked = sorted(parts, key=lambda kv: -kv[1])
        out.append("the consumers' steady turn, largest part first: "
                   + ", ".join(f"{names[p]} {v:.0f}%" for p, v in ranked))
        under, after = by["consumer_turn_softmax_under_pv_pct"], by["consumer_turn_after_pv_pct"]
        out.append(f"work between the two waits (under P V) {under:.0f}% against after P V "
                   f"{after:.0f}%: " + ("more of the turn's time runs after P V than under it"
                                        if after > under else
                                        "more of the turn's time runs under P V than after it"))
    if "consumer_time_mbarrier_wait_pct" in by:
        tile = by["consumer_time_mbarrier_wait_pct"]
        out.append(f"the consumers wait for a tile to land {tile:.1f}% of their time: "
                   + ("the loads keep up with them" if tile < 5 else
                      "the loads hold them up noticeably"))
    if "producer_time_mbarrier_wait_pct" in by and "producer_time_tma_issue_pct" in by:
        wait, issue = by["producer_time_mbarrier_wait_pct"], by["producer_time_tma_issue_pct"]
        if wait > 50:
            verdict = "the ring is full most of the time, loads are not the limit"
        elif issue > 50:
            verdict = "it is mostly issuing: the loads may be close to the limit"
        else:
            verdict = ("neither dominates; its other samples sit elsewhere in its code, so the "
                       "producer's own samples do not say whether the loads limit")
        out.append(f"the producer warp: {wait:.1f}% of its samples at its empty-slot waits, "
                   f"{issue:.1f}% issuing TMA loads: {verdict}")
    return out


def knob_name(row) -> str:
    """A knob row's name as its setting: the "ping-pong" knob flips the default, so it reads
    "ping-pong on" or "ping-pong off" after what the row really ran."""
    name = row.get("config") or row.get("impl")
    if name == "ping-pong" and "pingpong" in row:
        return f"ping-pong {'on' if row['pingpong'] else 'off'}"
    return name


def knob_lines(res) -> list[str]:
    """The knob benchmark (``ch05_flash_hopper --bench``), grouped by (D, causal): TFLOP/s of
    each configuration, its own spread (``utils.bench.row_spread``: between rounds, or in an
    older one-round file between the median and the fastest call) and its ratio to that
    group's "default" row."""
    from utils.bench import row_spread

    lines = []
    groups = dict.fromkeys((r.get("d"), r.get("causal")) for r in res.rows)
    for d, causal in groups:
        rows = [r for r in res.rows if (r.get("d"), r.get("causal")) == (d, causal)]
        base = next((r for r in rows if r.get("config") == "default" and r.get("tflops")), None)
        default = ""
        if base is not None:
            default = (f" (default: {base.get('tile_m')} x {base.get('tile_n')}, ping-pong "
                       f"{'on' if base.get('pingpong') else 'off'})")
        lines.append(f"D={d} causal={causal}{default}:")
        for r in rows:
            tile = f"{r.get('tile_m', '?')} x {r.get('tile_n', '?')}"
            if r.get("tflops") is None:
                lines.append(f"    {knob_name(r):24s} {tile:10s} not timed (verified: "
                             f"{r.get('verified')})")
                continue
            spread = row_spread(r)
            spread = f"spread {spread:4.1%}" if spread is not None else ""
            ratio = f"{r['tflops'] / base['tflops']:5.2f}x default" if base else ""
            lines.append(f"    {knob_name(r):24s} {tile:10s} {r['tflops']:6.0f} TFLOP/s "
                         f"{spread:12s} {ratio}")
    return lines


def default_spread(knobs, fwd, d: int = 128, s: int = 16384, causal: bool = False):
    """The default configuration at (d, s, causal) in the knob run and in the benchmark run:
    {"knobs", "fwd", "spread"} (spread = larger / smaller - 1), or None if either lacks it.
    Two runs of the same kernel minutes apart: the yardstick for a knob's small effect."""
    if knobs is None or fwd is None:
        return None
    k = next((r for r in knobs.rows if r.get("config") == "default" and r.get("d") == d
              and r.get("s") == s and r.get("causal") == causal and r.get("tflops")), None)
    f = next((r for r in fwd.rows if r.get("impl") == "flash_hopper" and r.get("d") == d
              and r.get("s") == s and r.get("causal") == causal and r.get("tflops")), None)
    if k is None or f is None:
        return None
    lo, hi = sorted((k["tflops"], f["tflops"]))
    return {"knobs": k["tflops"], "fwd": f["tflops"], "spread": hi / lo - 1, "d": d, "s": s,
            "causal": causal}


def spread_line(spread) -> str:
    if spread is None:
        return "the knob run and the benchmark run do not share a default row to compare"
    return (f"the default configuration at D={spread['d']}, S={spread['s']}, "
            f"{'causal' if spread['causal'] else 'non-causal'}: {spread['knobs']:.0f} TFLOP/s in "
            f"the knob run, {spread['fwd']:.0f} in the benchmark run: a spread of "
            f"{spread['spread']:.0%} between two runs of the same kernel")


def knob_effects(res, spread: float | None) -> list[str]:
    """Each knob against its group's default with a verdict: "faster" or "slower" only when
    the ratio clears the noise, the larger of the two rows' own spreads (``utils.bench.
    compare``) and ``spread``, the spread between two runs of the same kernel (a fraction, from
    ``default_spread``); else "within noise"."""
    from utils.bench import compare

    out = []
    groups = dict.fromkeys((r.get("d"), r.get("causal")) for r in res.rows)
    for d, causal in groups:
        rows = [r for r in res.rows if (r.get("d"), r.get("causal")) == (d, causal)]
        base = next((r for r in rows if r.get("config") == "default" and r.get("tflops")), None)
        if base is None:
            continue
        for r in rows:
            c = None if r is base else compare(r, base)
            if c is None:
                continue
            noise = max(c.noise, spread or 0.0)
            verdict = ("within noise" if abs(c.ratio - 1) <= noise
                       else "faster" if c.ratio > 1 else "slower")
            out.append(f"D={d} {'causal' if causal else 'non-causal'}, {knob_name(r)}: "
                       f"{c.ratio:.2f}x the default, noise {noise:.0%} -> {verdict}")
    return out


def standing_lines(res, baseline: str = "sdpa_cudnn") -> list[str]:
    """flash_hopper against ``baseline`` at every shape of one run (chapter 04's standing
    lines), each with a verdict: level within 3%, ahead or behind."""
    from solutions.ch04_teaching import LEVEL
    from solutions.ch04_teaching import standing_lines as lines_of

    out = []
    for line in lines_of(res, "flash_hopper", baseline)[:-1]:
        ratio = float(line.rsplit(": ", 1)[1].rstrip("x"))
        verdict = "level" if abs(ratio - 1) < LEVEL else ("ahead" if ratio > 1 else "behind")
        out.append(f"{line} ({verdict})")
    return out


# ================================================================================================
# 1. mma.sync against wgmma: how often B must be read from shared memory
# ================================================================================================
def rows_per_b_read_needed(arch: str = "H100") -> float:
    """Rows of A an MMA must cover per read of B so shared memory keeps up with the tensor cores.

    Each 2-byte element of B read from shared memory feeds 2 FLOPs per row of A it meets. At
    ``F`` FLOP/clk and ``W`` B/clk of shared memory: F * 2 / (2 * rows) <= W, rows >= F / W.
    """
    fig = PER_SM[roofline.GPUS[roofline.resolve_gpu(arch)]]
    return fig.mma_flops_per_clk * ELEM_BYTES / (2 * fig.smem_bytes_per_clk)


def kv_smem_cycles(n: int, d: int, readers: int, arch: str = "H100") -> float:
    """Cycles of shared memory to read one K tile and one V tile (n x d each) ``readers`` times:
    once per warp for mma.sync (each warp loads its own B fragments with ldmatrix), once per
    warpgroup for wgmma."""
    fig = PER_SM[roofline.GPUS[roofline.resolve_gpu(arch)]]
    return readers * 2 * n * d * ELEM_BYTES / fig.smem_bytes_per_clk


def mma_styles(m: int = 128, n: int = 128, d: int = 128, warps: int = 4) -> list[dict]:
    """One forward tile (m query rows, n keys, head dim d) on an H100/H200 SM, two ways.

    Ampere style, as chapter 04's kernel does it: ``warps`` warps stacked along the rows; every
    step each warp loads its own rows of Q (the A operand of S = Q K^T) and all of K and V from
    shared memory with ldmatrix, and issues m16n8k16 mma.sync. Q is not kept in registers: its
    fragments are loaded again, k-slice by k-slice, for every K tile. Hopper style: one
    warpgroup per 64 rows, wgmma reads Q, K and V straight from shared memory, each once per
    warpgroup (utils.roofline's model); P stays in registers in both.
    """
    flops = 4 * m * n * d
    mma = flops / HOPPER.mma_flops_per_clk
    wg = roofline.tile_cycles("H100", "fwd", m=m, n=n, d=d)
    q_bytes = m * d * ELEM_BYTES  # each warp its own rows: the whole Q tile once per step
    ampere = kv_smem_cycles(n, d, warps) + q_bytes / HOPPER.smem_bytes_per_clk
    return [
        {"style": f"mma.sync, {warps} warps ({m // warps} rows each)",
         "instructions": flops // (2 * 16 * 8 * 16), "rows_per_b_read": m // warps,
         "mma_cycles": mma, "smem_cycles": ampere},
        {"style": f"wgmma, {m // ch05.WGMMA_M} warpgroups (64 rows each)",
         "instructions": (m // ch05.WGMMA_M) * (d // 16 + n // 16), "rows_per_b_read": 64,
         "mma_cycles": mma, "smem_cycles": wg.smem},
    ]


# ================================================================================================
# 2. TMA: the tensor map and one box
# ================================================================================================
@dataclass(frozen=True)
class TensorMapSketch:
    """The fields of a TMA descriptor (``CUtensorMap``, 128 bytes, built on the host by
    ``cuTensorMapEncodeTiled``) for a (batch, seqlen, heads, dim) tensor, as the kernel's TMA
    atoms use them. Dimensions are listed innermost first, as the TMA numbers them, and each
    copy names one coordinate per dimension: its box's corner."""

    dims: tuple  # (D, S, H, B) elements
    strides_bytes: tuple  # bytes from one index to the next along S, H, B (D is contiguous)
    box: tuple  # elements per dimension in one copy
    elem_bytes: int
    swizzle: str
    oob_fill: str

    @property
    def box_bytes(self) -> int:
        """Bytes one copy writes to shared memory, zero-filled elements included: the number
        the producer announces to the mbarrier with expect-tx."""
        return math.prod(self.box) * self.elem_bytes

    def __str__(self) -> str:
        names = ("D", "S", "H", "B")
        rows = [
            ("global dims (innermost first)",
             ", ".join(f"{n}={v}" for n, v in zip(names, self.dims))),
            ("global strides (bytes)",
             ", ".join(f"{n}: {v}" for n, v in zip(names[1:], self.strides_bytes))),
            ("box (elements)", ", ".join(f"{n}={v}" for n, v in zip(names, self.box))),
            ("element size", f"{self.elem_bytes} B"),
            ("swizzle", self.swizzle),
            ("out-of-bounds fill", self.oob_fill),
            ("bytes per copy", f"{self.box_bytes} (counted into the mbarrier)"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def tensor_map(batch: int, seqlen: int, heads: int, dim: int, box_rows: int,
               elem_bytes: int = ELEM_BYTES) -> TensorMapSketch:
    """The tensor map of a contiguous (batch, seqlen, heads, dim) tensor whose copies bring
    ``box_rows`` rows of one head. With the 128-byte swizzle the box's innermost extent is at
    most 128 bytes (64 bf16), so a D = 128 row is fetched as two boxes side by side."""
    inner = min(dim, SWIZZLE_BYTES // elem_bytes)
    return TensorMapSketch(
        dims=(dim, seqlen, heads, batch),
        strides_bytes=(heads * dim * elem_bytes, dim * elem_bytes,
                       seqlen * heads * dim * elem_bytes),
        box=(inner, box_rows, 1, 1),
        elem_bytes=elem_bytes,
        swizzle=f"{SWIZZLE_BYTES}B (16-byte chunk ^= row mod 8)",
        oob_fill="zeros",
    )


def tma_load_box(x: np.ndarray, corner: tuple, box: tuple) -> np.ndarray:
    """What one TMA load writes: the box of ``x`` (batch, seqlen, heads, dim) whose corner is
    ``corner`` = (d, s, h, b) (innermost first, like the PTX), returned as (rows, columns);
    elements outside the tensor read as zero."""
    d0, s0, h, b = corner
    box_d, box_s = box[0], box[1]
    out = np.zeros((box_s, box_d), dtype=x.dtype)
    s_hi = min(s0 + box_s, x.shape[1])
    d_hi = min(d0 + box_d, x.shape[3])
    if s_hi > s0 and d_hi > d0:
        out[: s_hi - s0, : d_hi - d0] = x[b, s0:s_hi, h, d0:d_hi]
    return out


def copy_instructions(rows: int, dim: int, threads: int = 128, elem_bytes: int = ELEM_BYTES):
    """Copy instructions to bring one (rows, dim) tile into shared memory: cp.async moves 16 B
    per thread per instruction; TMA moves one box per instruction, issued by one thread."""
    tile = rows * dim * elem_bytes
    boxes = -(-dim * elem_bytes // SWIZZLE_BYTES)
    return {"tile_bytes": tile, "cp.async (16 B each)": tile // 16,
            "cp.async per thread": tile // 16 // threads, "TMA boxes": boxes}


def draw_tma_box(seqlen=300, heads=3, dim=128, tile_rows=128, tile=2, head=1, ax=None):
    """One batch of a (seqlen, heads, dim) tensor drawn as memory lays it out (a row of the
    picture is one sequence position: heads side by side, dim contiguous), with the TMA boxes
    of K/V tile ``tile`` of head ``head``. Rows past ``seqlen`` are zero-filled by the TMA."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(8.5, 4.2))
    width = heads * dim
    top = max(seqlen, (tile + 1) * tile_rows)
    ax.add_patch(Rectangle((0, 0), width, seqlen, facecolor="#f2f2f2", edgecolor="#999999"))
    for h in range(heads):
        ax.text(h * dim + dim / 2, -8, f"head {h}", ha="center", va="bottom", fontsize=8)
        if h:
            ax.axvline(h * dim, color="#999999", linewidth=0.8)
    for t in range(1, -(-seqlen // tile_rows)):
        ax.axhline(t * tile_rows, color="#cccccc", linewidth=0.6, linestyle=":")
    inner = min(dim, SWIZZLE_BYTES // ELEM_BYTES)
    s0, s1 = tile * tile_rows, (tile + 1) * tile_rows
    colors = ("#1f77b4", "#ff7f0e")
    for i, d0 in enumerate(range(0, dim, inner)):
        x0 = head * dim + d0
        ax.add_patch(Rectangle((x0, s0), inner, min(s1, seqlen) - s0, facecolor=colors[i % 2],
                               alpha=0.55, edgecolor="black"))
        ax.text(x0 + inner / 2, (s0 + min(s1, seqlen)) / 2,
                f"box {i}\ncorner\n(d={d0}, s={s0},\n h={head}, b=0)", ha="center",
                va="center", fontsize=7)
        if s1 > seqlen:
            ax.add_patch(Rectangle((x0, seqlen), inner, s1 - seqlen, facecolor="white",
                                   hatch="///", edgecolor=colors[i % 2]))
    if s1 > seqlen:
        ax.text(head * dim + dim + 4, (seqlen + s1) / 2,
                f"rows {seqlen}..{s1 - 1}: outside the tensor,\nwritten as zeros, bytes still "
                "counted", va="center", fontsize=7)
    ax.axhline(seqlen, color="crimson", linewidth=1.2)
    ax.text(width + 2, seqlen, f"seqlen = {seqlen}", color="crimson", va="center", fontsize=8)
    ax.set_xlim(-2, width + dim * 0.9)
    ax.set_ylim(top + 8, -20)
    ax.set_xlabel("position in memory within a row: head * dim + d (d contiguous)")
    ax.set_ylabel("sequence position s")
    ax.set_title(f"TMA boxes of K tile {tile} (rows {s0}..{s1 - 1}), head {head}")
    ax.grid(False)
    return ax


# ================================================================================================
# 3. The 128-byte swizzle, as CuTe builds it for the kernel
# ================================================================================================
def smem_tile_layout(head_dim: int, rows: int = 128) -> dict:
    """The kernel's shared-memory layout for a (rows, head_dim) bf16 tile, asked from CuTe on the
    CPU: the swizzle atom (its ``Swizzle<bits, base, shift>`` acts on byte addresses) and the
    layout of the whole tile in elements."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import warpgroup
    from cutlass.tensor_utils import LayoutEnum

    found = {}

    @cute.jit
    def trace():
        kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.BFloat16, head_dim)
        atom = warpgroup.make_smem_layout_atom(kind, cutlass.BFloat16)
        tile = cute.tile_to_shape(atom, (rows, head_dim), order=(0, 1))
        sw = atom.inner
        found.update(kind=str(kind), atom=str(atom), tile=str(tile),
                     swizzle=(int(sw.num_bits), int(sw.num_base), int(sw.num_shift)))

    trace()
    return found


def swizzled_chunk(row: int, chunk: int, swizzle=(3, 4, 3)) -> int:
    """Where 16-byte chunk ``chunk`` of row ``row`` of a 128-byte-row tile lands in its row:
    the swizzle applied to the byte address ``row * 128 + chunk * 16``."""
    from utils.layout_plots import swizzle as apply

    return (apply(row * SWIZZLE_BYTES + chunk * 16, *swizzle) % SWIZZLE_BYTES) // 16


# ================================================================================================
# 4. An mbarrier ring, simulated
# ================================================================================================
class PipelineError(Exception):
    """The ring's protocol went wrong; the message says what, where and when, in plain words."""


class Deadlock(PipelineError):
    pass


class Overwrite(PipelineError):
    pass


class StaleRead(PipelineError):
    pass


@dataclass(frozen=True)
class Wait:
    """What a role yields to block until ``barrier`` has completed the phase of parity
    ``parity`` (``mbarrier.try_wait.parity`` in a loop)."""

    barrier: MBarrier
    parity: int

    def ready(self) -> bool:
        return self.barrier.try_wait(self.parity)


class MBarrier:
    """An mbarrier: a phase completes when ``arrivals`` threads have arrived and the bytes
    announced with expect-tx have all been written (transaction count back to zero).

    ``completed`` counts completed phases; the phase in progress has parity ``completed % 2``.
    ``try_wait(p)`` is true when the phase of parity p is not the one in progress: it has
    completed (a fresh barrier, in phase 0, reports parity 1 as complete)."""

    def __init__(self, name: str, arrivals: int, ring: Ring):
        self.name, self.arrivals, self._ring = name, arrivals, ring
        self.pending, self.tx, self.completed = arrivals, 0, 0

    def try_wait(self, parity: int) -> bool:
        return (self.completed & 1) != parity

    def wait(self, parity: int) -> Wait:
        if parity not in (0, 1):
            raise PipelineError(f"{self.name}.wait(parity={parity!r}): a parity is 0 or 1")
        return Wait(self, parity)

    def arrive(self) -> None:
        self._ring.log(f"arrives on {self.name}")
        self._arrive()

    def arrive_expect_tx(self, nbytes: int) -> None:
        self.tx += nbytes
        self._ring.log(f"arrives on {self.name}, expecting {nbytes} B")
        self._arrive()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._maybe_complete()

    def _arrive(self) -> None:
        if self.pending == 0:
            raise PipelineError(
                f"tick {self._ring.now}: {self._ring.actor} arrived on {self.name} again before "
                f"the phase it had armed completed (that phase still waits for {self.tx} bytes): "
                f"more arrivals in one phase than the barrier counts. A producer may arm a "
                f"slot's full barrier again only after waiting on that slot's empty barrier"
            )
        self.pending -= 1
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.arrivals
            self._ring.log(f"{self.name} completes phase {self.completed - 1} "
                           f"(parity {(self.completed - 1) & 1})")

    def describe(self) -> str:
        need = f"{self.pending} arrival(s)"
        if self.tx > 0:
            need += f" and {self.tx} more byte(s)"
        elif self.tx < 0:
            need += f", and it has received {-self.tx} byte(s) nobody announced"
        return (f"{self.name}: {self.completed} phase(s) completed; phase {self.completed} "
                f"(parity {self.completed & 1}) waits for {need}")


@dataclass
class _Copy:
    tile: int
    stage: int
    issued: int
    lands: int


class _Clock:
    """Time and the event log, shared by the rings of one simulation."""

    def __init__(self):
        self.now, self.actor = 0, "setup"
        self.events: list[tuple[int, str, str]] = []


class Ring:
    """A ring of ``stages`` shared-memory slots between one producer (TMA) and ``consumers``
    consumer warpgroups that all read every tile. ``full[s]``: 1 arrival (the producer's
    arrive-expect-tx) plus ``tile_bytes`` written by the TMA. ``empty[s]``: one arrival per
    consumer. Times are in ticks: a TMA copy lands ``latency`` ticks after it is issued, a
    consumer reads a tile for ``read_ticks`` ticks. ``name`` prefixes the barriers' names
    (``"K "``: "K full[0]"); rings given the same ``clock`` share time and the event log."""

    def __init__(self, stages=2, consumers=2, latency=4, read_ticks=3, tile_bytes=32768,
                 name: str = "", clock: _Clock | None = None):
        if stages < 1 or consumers < 1 or latency < 1 or read_ticks < 1:
            raise ValueError("stages, consumers, latency and read_ticks must all be >= 1")
        self.stages, self.consumers = stages, consumers
        self.latency, self.read_ticks, self.tile_bytes = latency, read_ticks, tile_bytes
        self.name = name
        self._where = f"[{name.strip()} ring] " if name.strip() else ""
        self.clock = clock or _Clock()
        self.full = [MBarrier(f"{name}full[{s}]", 1, self) for s in range(stages)]
        self.empty = [MBarrier(f"{name}empty[{s}]", consumers, self) for s in range(stages)]
        self.slot: list[int | None] = [None] * stages  # the tile whose bytes a slot holds
        self.unread: list[set] = [set() for _ in range(stages)]  # consumers yet to read it
        self.reading: list[dict] = [{} for _ in range(stages)]  # consumer -> tile, reading now
        self.in_flight: list[_Copy] = []
        self.copies: list[_Copy] = []
        self.reads: list[tuple[int, int, int, int, int]] = []  # (consumer, tile, stage, t0, t1)

    @property
    def now(self) -> int:
        return self.clock.now

    @now.setter
    def now(self, value: int) -> None:
        self.clock.now = value

    @property
    def actor(self) -> str:
        return self.clock.actor

    @actor.setter
    def actor(self, value: str) -> None:
        self.clock.actor = value

    @property
    def events(self) -> list:
        return self.clock.events

    def log(self, what: str) -> None:
        self.events.append((self.now, self.actor, what))

    def _check_stage(self, stage, what):
        if not isinstance(stage, (int, np.integer)) or not 0 <= stage < self.stages:
            raise PipelineError(
                f"{what}: slot {stage!r} does not exist (slots 0..{self.stages - 1})")

    def tma_load(self, stage: int, tile: int) -> None:
        """Start the TMA copy of ``tile`` into slot ``stage``; it completes the bytes of
        ``full[stage]`` when it lands."""
        self._check_stage(stage, f"tma_load of tile {tile}")
        copy = _Copy(tile, int(stage), self.now, self.now + self.latency)
        self.in_flight.append(copy)
        self.copies.append(copy)
        self.log(f"issues the TMA load of tile {tile} into slot {stage}")

    def read(self, stage: int, tile: int, me: int):
        """A consumer reads ``tile`` from slot ``stage`` for ``read_ticks`` ticks (a generator:
        use ``yield from``)."""
        self._check_stage(stage, f"consumer {me} reading tile {tile}")
        held = self.slot[stage]
        if held != tile:
            pending = any(c.tile == tile and c.stage == stage for c in self.in_flight)
            why = ("its load is still in flight" if pending
                   else f"no load of tile {tile} into slot {stage} has been issued")
            has = "is still empty" if held is None else f"holds tile {held}"
            raise StaleRead(
                f"{self._where}tick {self.now}: consumer {me} started reading tile {tile} from "
                f"slot {stage}, "
                f"but the slot {has} ({why}): its wait on full[{stage}] let it through before "
                f"tile {tile} had landed"
            )
        self.reading[stage][me] = tile
        start = self.now
        self.log(f"reads tile {tile} from slot {stage}")
        yield self.read_ticks
        del self.reading[stage][me]
        self.unread[stage].discard(me)
        self.reads.append((me, tile, stage, start, self.now))

    def land_copies(self) -> None:
        for copy in [c for c in self.in_flight if c.lands <= self.now]:
            self.in_flight.remove(copy)
            s, old = copy.stage, self.slot[copy.stage]
            if self.reading[s]:
                who = ", ".join(f"consumer {c}" for c in sorted(self.reading[s]))
                raise Overwrite(
                    f"{self._where}tick {self.now}: the load of tile {copy.tile} landed in slot "
                    f"{s} while "
                    f"{who} was still reading tile {old} there: the producer refilled slot {s} "
                    f"before every consumer had released it (on empty[{s}])"
                )
            if self.unread[s]:
                who = ", ".join(f"consumer {c}" for c in sorted(self.unread[s]))
                raise Overwrite(
                    f"{self._where}tick {self.now}: the load of tile {copy.tile} landed in slot "
                    f"{s} before "
                    f"{who} had read tile {old}: tile {old} was overwritten unread. The producer "
                    f"must wait until empty[{s}] says every consumer is done with the slot"
                )
            self.slot[s] = copy.tile
            self.unread[s] = set(range(self.consumers))
            self.actor = "TMA"
            self.log(f"tile {copy.tile} lands in slot {s}, {self.tile_bytes} B")
            self.full[s].complete_tx(self.tile_bytes)


def consumer_step(ring: Ring, t: int, me: int):
    """Consumer ``me``, tile ``t``: wait until the tile has landed, read it, hand the slot back.
    Tile t lives in slot t % stages; lap t // stages of the ring waits for the full barrier's
    phase of that lap's parity (phase 0 is the first fill)."""
    stage, lap = t % ring.stages, t // ring.stages
    yield ring.full[stage].wait(parity=lap & 1)
    yield from ring.read(stage, t, me)
    ring.empty[stage].arrive()


def producer_step(ring: Ring, t: int):
    """Producer, tile ``t`` (exercise 05.2's reference): wait until slot t % stages is free,
    announce the bytes on its full barrier, start the TMA. In lap 0 the slot has never been
    used, and parity (0 ^ 1) = 1 is what a fresh barrier reports complete: no wait. In lap r it
    waits for the consumers' releases of lap r - 1, the empty barrier's phase r - 1."""
    stage, lap = t % ring.stages, t // ring.stages
    yield ring.empty[stage].wait(parity=(lap & 1) ^ 1)
    ring.full[stage].arrive_expect_tx(ring.tile_bytes)
    ring.tma_load(stage, t)


def producer_same_parity(ring: Ring, t: int):
    """Broken: waits on empty with the consumer's parity, lap & 1."""
    stage, lap = t % ring.stages, t // ring.stages
    yield ring.empty[stage].wait(parity=lap & 1)
    ring.full[stage].arrive_expect_tx(ring.tile_bytes)
    ring.tma_load(stage, t)


def producer_no_wait(ring: Ring, t: int):
    """Broken: never waits for the consumers to release a slot."""
    stage = t % ring.stages
    ring.full[stage].arrive_expect_tx(ring.tile_bytes)
    ring.tma_load(stage, t)


def producer_plain_arrive(ring: Ring, t: int):
    """Broken: arrives on full without announcing the bytes the TMA will write."""
    stage, lap = t % ring.stages, t // ring.stages
    yield ring.empty[stage].wait(parity=(lap & 1) ^ 1)
    ring.full[stage].arrive()
    ring.tma_load(stage, t)


BROKEN_PRODUCERS = {
    "waits on empty with parity lap & 1": producer_same_parity,
    "never waits on empty": producer_no_wait,
    "arrives on full without expect-tx": producer_plain_arrive,
}


def _steps(result, name: str):
    """Run a role's step: a generator is delegated to, a plain function has already run."""
    if inspect.isgenerator(result):
        return (yield from result)
    if result is not None:
        raise PipelineError(f"{name} should yield its waits (a generator) or return None, "
                            f"but it returned {result!r}")
    return None


def _producer(ring, n_tiles, step):
    for t in range(n_tiles):
        yield from _steps(step(ring, t), "producer_step")
        yield 1  # issuing takes the producer's thread one tick


def _consumer(ring, n_tiles, me, step):
    for t in range(n_tiles):
        yield from _steps(step(ring, t, me), "consumer_step")


@dataclass
class _Agent:
    name: str
    gen: object
    waiting: Wait | None = None
    wait_since: int = 0
    busy_until: int = 0
    done: bool = False


@dataclass
class RingSim:
    """Step through a K/V ring tick by tick, or run it to the end.

    >>> sim = RingSim(n_tiles=5, stages=2)
    >>> sim.step()          # the events of one tick, as text
    >>> print(sim.state())  # barriers, slots, who waits on what
    >>> sim.run()           # to the end; raises Deadlock, Overwrite or StaleRead

    ``producer_step(ring, t)`` and ``consumer_step(ring, t, me)`` are the roles' bodies for one
    tile; they ``yield ring.<barrier>[s].wait(parity)`` to block.
    """

    n_tiles: int = 6
    stages: int = 2
    consumers: int = 2
    latency: int = 4
    read_ticks: int = 3
    producer_step: object = producer_step
    consumer_step: object = consumer_step
    max_ticks: int = 10_000
    ring: Ring = field(init=False)
    waits: list = field(init=False, default_factory=list)  # (agent, barrier, parity, t0, t1)

    def __post_init__(self):
        self.ring = Ring(self.stages, self.consumers, self.latency, self.read_ticks)
        self.agents = [_Agent("producer", _producer(self.ring, self.n_tiles, self.producer_step))]
        self.agents += [
            _Agent(f"consumer {c}", _consumer(self.ring, self.n_tiles, c, self.consumer_step))
            for c in range(self.consumers)
        ]

    @property
    def done(self) -> bool:
        return all(a.done for a in self.agents) and not self._in_flight()

    def _rings(self) -> list:
        return [self.ring]

    def _in_flight(self) -> bool:
        return any(r.in_flight for r in self._rings())

    def _advance(self, agent: _Agent) -> None:
        ring = self.ring
        ring.actor = agent.name
        while not agent.done and agent.busy_until <= ring.now:
            if agent.waiting is not None:
                if not agent.waiting.ready():
                    return
                w = agent.waiting
                if ring.now > agent.wait_since:
                    self.waits.append((agent.name, w.barrier.name, w.parity, agent.wait_since,
                                       ring.now))
                    ring.log(f"passes its wait on {w.barrier.name} (parity {w.parity})")
                agent.waiting = None
            try:
                item = next(agent.gen)
            except StopIteration:
                agent.done = True
                return
            if isinstance(item, Wait):
                agent.waiting, agent.wait_since = item, ring.now
                if not item.ready():
                    ring.log(f"waits on {item.barrier.name} for parity {item.parity}")
            elif isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                agent.busy_until = ring.now + item
            else:
                raise PipelineError(
                    f"{agent.name} yielded {item!r}: yield a barrier wait, such as "
                    f"ring.empty[s].wait(parity), or a number of ticks"
                )

    def step(self) -> list[str]:
        """Advance one tick; return what happened, one line per event."""
        ring = self.ring
        first = len(ring.events)
        for r in self._rings():
            r.land_copies()
        for agent in self.agents:
            self._advance(agent)
        lines = [f"t={t:3d} {who}: {what}" for t, who, what in ring.events[first:]]
        if not self.done:
            self._check_progress()
        ring.now += 1
        return lines

    def _check_progress(self) -> None:
        ring = self.ring
        live = [a for a in self.agents if not a.done]
        stuck = all(a.waiting is not None and not a.waiting.ready() and a.busy_until <= ring.now
                    for a in live)
        if stuck and not self._in_flight():
            lines = [f"deadlock at tick {ring.now}: nothing is in flight and nobody can move."]
            for a in live:
                w = a.waiting
                lines.append(f"  {a.name} waits for parity {w.parity} on {w.barrier.describe()}")
            raise Deadlock("\n".join(lines))
        if ring.now >= self.max_ticks:
            raise Deadlock(f"the ring did not finish within {self.max_ticks} ticks")

    def run(self) -> RingSim:
        while not self.done:
            self.step()
        loads = [c.tile for c in self.ring.copies]
        if sorted(loads) != list(range(self.n_tiles)):
            raise PipelineError(f"the producer should load each of the {self.n_tiles} tiles "
                                f"exactly once; it loaded {sorted(loads)}")
        return self

    def state(self) -> str:
        ring = self.ring
        lines = [f"tick {ring.now}"]
        for s in range(ring.stages):
            unread = ", ".join(str(c) for c in sorted(ring.unread[s])) or "nobody"
            lines.append(f"  slot {s}: holds tile {ring.slot[s]}; still to read it: {unread}")
            lines.append(f"    {ring.full[s].describe()}")
            lines.append(f"    {ring.empty[s].describe()}")
        for c in ring.in_flight:
            lines.append(f"  in flight: tile {c.tile} -> slot {c.stage}, lands at tick {c.lands}")
        for a in self.agents:
            if a.done:
                what = "finished"
            elif a.waiting is not None and not a.waiting.ready():
                what = f"waits on {a.waiting.barrier.name} for parity {a.waiting.parity}"
            elif a.busy_until > ring.now:
                what = f"busy until tick {a.busy_until}"
            else:
                what = "ready"
            lines.append(f"  {a.name}: {what}")
        return "\n".join(lines)


def draw_ring_timeline(sim: RingSim, ax=None, title=None):
    """Gantt chart of a finished RingSim: producer issues and waits, each slot's copy in flight
    (hatched) and resident (solid) until its last reader is done, each consumer's reads and
    waits. One colour per tile."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from utils.layout_plots import thread_color

    ring = sim.ring
    rows = ["producer"] + [f"slot {s}" for s in range(ring.stages)]
    rows += [f"consumer {c}" for c in range(ring.consumers)]
    y = {r: i for i, r in enumerate(rows)}
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.4))
    grey = "#bbbbbb"
    for who, _, _, t0, t1 in sim.waits:
        ax.barh(y[who], t1 - t0, left=t0, color="white", edgecolor=grey, hatch="...",
                height=0.5)
    last_read = {}
    for _, tile, _, _, t1 in ring.reads:
        last_read[tile] = max(last_read.get(tile, 0), t1)
    for c in ring.copies:
        col = thread_color(c.tile)
        ax.barh(y["producer"], 1, left=c.issued, color=col, height=0.5)
        ax.text(c.issued + 0.5, y["producer"], str(c.tile), ha="center", va="center", fontsize=7)
        row = y[f"slot {c.stage}"]
        ax.barh(row, c.lands - c.issued, left=c.issued, color="white", edgecolor=col,
                hatch="///", height=0.5)
        end = last_read.get(c.tile, c.lands)
        ax.barh(row, end - c.lands, left=c.lands, color=col, height=0.5)
        ax.text((c.lands + end) / 2, row, f"tile {c.tile}", ha="center", va="center", fontsize=7)
    for me, tile, _, t0, t1 in ring.reads:
        ax.barh(y[f"consumer {me}"], t1 - t0, left=t0, color=thread_color(tile), height=0.5)
        ax.text((t0 + t1) / 2, y[f"consumer {me}"], str(tile), ha="center", va="center",
                fontsize=7)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("tick")
    ax.legend(handles=[Patch(facecolor="white", edgecolor="gray", hatch="///",
                             label="TMA copy in flight"),
                       Patch(facecolor="white", edgecolor=grey, hatch="...",
                             label="waiting on a barrier")],
              fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or f"{ring.stages}-stage ring, {ring.consumers} consumers, TMA latency "
                 f"{ring.latency}, read {ring.read_ticks} ticks")
    ax.grid(axis="y", visible=False)
    return ax


RING_CASES = [(stages, consumers, latency, read, n_tiles)
              for stages in (1, 2, 3, 4) for consumers in (1, 2)
              for latency, read in ((1, 1), (4, 3), (2, 6))
              for n_tiles in (1, stages, 2 * stages + 1, 10)]


def check_producer_step(fn) -> None:
    """Exercise 05.2: fn(ring, t) is the producer's step; run the ring many ways with it."""
    for stages, consumers, latency, read, n_tiles in RING_CASES:
        sim = RingSim(n_tiles, stages, consumers, latency, read, producer_step=fn)
        what = (f"with {stages} stage(s), {consumers} consumer(s), {n_tiles} tile(s), TMA "
                f"latency {latency} and {read} tick(s) per read")
        try:
            sim.run()
        except Deadlock as exc:
            raise AssertionError(
                f"{what}: the ring deadlocked.\n{exc}\nHint: a fresh mbarrier reports the "
                "phase of parity 1 as complete, so the producer's first lap must wait for "
                "parity 1 on empty; and full[s] completes only after one arrival and exactly "
                "ring.tile_bytes bytes (arrive_expect_tx announces them)."
            ) from None
        except PipelineError as exc:
            raise AssertionError(f"{what}: {exc}") from None
        reads = sorted((me, tile) for me, tile, *_ in sim.ring.reads)
        want = sorted((me, t) for me in range(consumers) for t in range(n_tiles))
        assert reads == want, f"{what}: not every consumer read every tile exactly once"


# ================================================================================================
# 4b. Exercise 05.4: the kernel's own producer loop, in CuTe (device code)
# ================================================================================================
# The kernel's producer warp loads Q, then calls this loop; the learner writes it. It is checked
# three ways: run as plain Python with recording stand-ins for the pipelines, states and tensors
# (which slot, which barrier, which tile, in which order), then replayed against two consumer
# warpgroups in a two-ring simulation (deadlocks, overwrites, stale reads), then compiled.
@cute.jit
def load_kv(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k, tma_atom_v,
            tKgK, tKsK, tVgV, tVsV, n_tiles):
    """Exercise 05.4's reference, the kernel's K/V loop (Note [Phases]): K[n-1] alone, then for
    t = n-2 .. 0 K[t] with V[t+1], then V[0]. Each load: producer_acquire (wait until the slot
    is free, arm its full barrier with the tile's bytes), the TMA copy into the state's slot
    counting its bytes on that barrier, advance the state."""
    if n_tiles > 0:
        pipeline_k.producer_acquire(state_k)
        cute.copy(tma_atom_k, tKgK[None, n_tiles - 1], tKsK[None, state_k.index],
                  tma_bar_ptr=pipeline_k.producer_get_barrier(state_k))
        state_k.advance()
        for i in cutlass.range(n_tiles - 1, unroll=1):
            n_block = n_tiles - 2 - i
            pipeline_k.producer_acquire(state_k)
            cute.copy(tma_atom_k, tKgK[None, n_block], tKsK[None, state_k.index],
                      tma_bar_ptr=pipeline_k.producer_get_barrier(state_k))
            state_k.advance()
            pipeline_v.producer_acquire(state_v)
            cute.copy(tma_atom_v, tVgV[None, n_block + 1], tVsV[None, state_v.index],
                      tma_bar_ptr=pipeline_v.producer_get_barrier(state_v))
            state_v.advance()
        pipeline_v.producer_acquire(state_v)
        cute.copy(tma_atom_v, tVgV[None, 0], tVsV[None, state_v.index],
                  tma_bar_ptr=pipeline_v.producer_get_barrier(state_v))


class HopperWithProducer(ch05.FlashAttentionHopper):
    """Chapter 05's kernel with its producer's K/V loop replaced by ``load_kv_fn`` (the
    learner's, or ``load_kv``). Everything else is the kernel's own code."""

    def __init__(self, load_kv_fn, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.load_kv_fn = load_kv_fn

    @cute.jit
    def load(self, gQ_all, gK_all, gV_all, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v,
             pipeline_q, pipeline_k, pipeline_v, m_block, n_tiles):
        """The kernel's producer warp: the same partitions and Q load, then ``load_kv_fn``."""
        import cutlass.pipeline as pipeline
        from cutlass.cute.nvgpu import cpasync

        # (tile_m, D); (tile_n, D, n_tiles) for K and V
        gQ = cute.local_tile(gQ_all, (self.tile_m, self.head_dim), (m_block, 0))
        gK = cute.local_tile(gK_all, (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(gV_all, (self.tile_n, self.head_dim), (None, 0))
        # TMA partitions: (TMA,) for Q; (TMA, STAGE) in smem and (TMA, n_tiles) in gmem for K, V
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, cute.make_layout(1),
                                           cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_k, 0, cute.make_layout(1),
                                           cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_v, 0, cute.make_layout(1),
                                           cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.num_stages)
        state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.num_stages)
        pipeline_q.producer_acquire(state_q)
        cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(state_q))
        self.load_kv_fn(pipeline_k, pipeline_v, state_k, state_v, tma_atom_k, tma_atom_v,
                        tKgK, tKsK, tVgV, tVsV, n_tiles)


# --- recording stand-ins -----------------------------------------------------------------------
@dataclass(frozen=True)
class _Ref:
    ring: str  # "K" or "V"
    space: str  # "global" (a tile of the sequence), "shared" (a slot of the ring), "barrier"
    index: int
    phase: int = 0

    def __str__(self):
        if self.space == "global":
            return f"{self.ring} tile {self.index}"
        if self.space == "shared":
            return f"{self.ring} slot {self.index}"
        return f"{self.ring} full[{self.index}] (phase bit {self.phase})"


@dataclass(frozen=True)
class ProducerCall:
    """One call the producer made: ``kind`` is "acquire" (of slot ``index`` with ``phase``),
    "commit" or "copy" (``src`` tile into ``dst`` slot, bytes counted on ``bar``)."""

    kind: str
    ring: str
    index: int = -1
    phase: int = -1
    src: _Ref | None = None
    dst: _Ref | None = None
    bar: _Ref | None = None

    def __str__(self):
        if self.kind == "copy":
            return f"TMA {self.src} -> {self.dst}"
        return f"{self.kind} {self.ring} slot {self.index}"


class _State:
    """pipeline.PipelineState: index = tile % stages; the phase bit flips when index wraps."""

    def __init__(self, stages: int, phase: int):
        self.stages, self.index, self.phase, self.count = stages, 0, phase, 0

    def advance(self):
        self.index += 1
        self.count += 1
        if self.index == self.stages:
            self.index, self.phase = 0, self.phase ^ 1

    def clone(self):
        other = _State(self.stages, self.phase)
        other.index, other.count = self.index, self.count
        return other


class _Pipeline:
    def __init__(self, ring: str, calls: list):
        self.ring, self.calls = ring, calls

    def _state(self, state, what):
        if not isinstance(state, _State):
            raise AssertionError(f"pipeline_{self.ring.lower()}.{what} takes the {self.ring} "
                                 f"ring's state, state_{self.ring.lower()}; got {state!r}")
        return state

    def producer_acquire(self, state, try_acquire_token=None):
        st = self._state(state, "producer_acquire")
        self.calls.append(ProducerCall("acquire", self.ring, st.index, st.phase))

    def producer_get_barrier(self, state):
        st = self._state(state, "producer_get_barrier")
        return _Ref(self.ring, "barrier", st.index, st.phase)

    def producer_commit(self, state):  # a no-op for a TMA pipeline: the TMA's bytes complete it
        st = self._state(state, "producer_commit")
        self.calls.append(ProducerCall("commit", self.ring, st.index, st.phase))

    def producer_tail(self, state):
        pass

    def _consumer_side(self, *args, **kwargs):
        raise AssertionError("consumer_wait and consumer_release are the consumers' side of the "
                             "pipeline; the producer waits for a free slot with producer_acquire")

    consumer_wait = consumer_release = _consumer_side


class _Slots:
    """tKgK (the sequence's tiles in global memory) or tKsK (the ring's slots)."""

    def __init__(self, ring: str, space: str, n: int):
        self.ring, self.space, self.n = ring, space, n

    def __getitem__(self, key):
        name = f"t{self.ring}{'g' if self.space == 'global' else 's'}{self.ring}"
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] is None):
            raise AssertionError(f"index {name} as {name}[None, i]: mode 0 is the TMA's view of "
                                 "one tile, mode 1 picks the tile (or the slot)")
        i = key[1]
        what = "tiles" if self.space == "global" else "slots"
        if self.n == 0:
            raise AssertionError(f"there are no {self.ring} tiles (n_tiles = 0: a causal query "
                                 f"tile that sees no key), so nothing may be loaded; you asked "
                                 f"for {name}[None, {i!r}]. Load only if n_tiles > 0")
        if not isinstance(i, (int, np.integer)) or not 0 <= i < self.n:
            raise AssertionError(f"{name} has {what} 0..{self.n - 1}, you asked for {i!r}")
        return _Ref(self.ring, self.space, int(i))


@dataclass(frozen=True)
class _Atom:
    ring: str


def record_producer(fn, n_tiles: int, stages: int = 2) -> list[ProducerCall]:
    """Run ``fn`` (exercise 05.4's signature) as plain Python with recording stand-ins: the
    calls it makes, in order, for a CTA with ``n_tiles`` K/V tiles and rings of ``stages``."""
    from utils.host_emulation import patched, plain, python_loops

    calls: list[ProducerCall] = []

    def copy(atom, src, dst, *args, tma_bar_ptr=None, **kwargs):
        if not isinstance(atom, _Atom):
            raise AssertionError(f"cute.copy's first argument is the TMA atom (tma_atom_k or "
                                 f"tma_atom_v); got {atom!r}")
        for ref, want, what, form in ((src, "global", "source", "tKgK[None, tile]"),
                                      (dst, "shared", "destination", "tKsK[None, state_k.index]")):
            if not (isinstance(ref, _Ref) and ref.space == want):
                raise AssertionError(f"the {what} of a TMA load is {form} (or V's); got {ref!r}")
        calls.append(ProducerCall("copy", atom.ring, src=src, dst=dst, bar=tma_bar_ptr))

    args = [_Pipeline("K", calls), _Pipeline("V", calls), _State(stages, 1), _State(stages, 1),
            _Atom("K"), _Atom("V"), _Slots("K", "global", n_tiles), _Slots("K", "shared", stages),
            _Slots("V", "global", n_tiles), _Slots("V", "shared", stages), n_tiles]
    from cutlass.base_dsl.common import DSLBaseError

    with python_loops(), patched(cute, copy=copy):
        try:
            plain(fn)(*args)
        except DSLBaseError as exc:  # a nested @cute.jit helper tried to compile on its own
            raise AssertionError(
                "write the acquires, copies and advances in the loop itself: a helper function "
                "that takes the pipeline and the state hides the state's changes from the DSL's "
                f"loops ({type(exc).__name__} while running it)") from None
    return calls


def producer_order(fn, n_tiles: int = 4) -> str:
    """The TMA loads ``fn`` issues for ``n_tiles`` tiles, in order: 'K3 K2 V3 K1 V2 ...'."""
    return " ".join(f"{c.ring}{c.src.index}" for c in record_producer(fn, n_tiles)
                    if c.kind == "copy")


def _producer_mistake(calls: list[ProducerCall], n_tiles: int) -> str | None:
    """The first slip in the producer's calls, in words (None: none found). Each copy must be
    preceded by an acquire of the slot it fills, write that slot, count its bytes on that
    slot's full barrier, and each ring's state must advance between two acquires."""
    armed: dict = {"K": None, "V": None}  # (index, phase) acquired and not yet filled
    filled: dict = {"K": None, "V": None}
    order: dict = {"K": [], "V": []}
    for c in calls:
        r = c.ring
        if c.kind == "acquire":
            if armed[r] is not None:
                return (f"you acquired {r} slot {c.index} while {r} slot {armed[r][0]}, acquired "
                        "before, was never filled: its full barrier then waits for bytes no "
                        "TMA brings, and the consumers hang on it")
            if filled[r] == (c.index, c.phase):
                return (f"you acquired {r} slot {c.index} again without advancing state_"
                        f"{r.lower()} after the copy into it: the producer would arm the same "
                        "full barrier twice in one phase. Call state.advance() after each copy")
            armed[r] = (c.index, c.phase)
            continue
        if c.kind != "copy":
            continue
        if c.src.ring != r or c.dst.ring != r:
            return (f"the TMA load with tma_atom_{r.lower()} moved {c.src} into {c.dst}: each "
                    "ring's atom, tiles and slots go together")
        if c.bar is None:
            return (f"the TMA load of {c.src} has no tma_bar_ptr: its bytes are counted on no "
                    "barrier, so the consumers' wait on full never completes. Pass "
                    f"tma_bar_ptr=pipeline_{r.lower()}.producer_get_barrier(state_{r.lower()})")
        if armed[r] is None:
            return (f"the TMA load of {c.src} into {c.dst} came without a producer_acquire of "
                    "that slot: the consumers may still be reading it (an overwrite), and its "
                    "full barrier was not told how many bytes to expect")
        if c.dst.index != armed[r][0]:
            return (f"you acquired {r} slot {armed[r][0]} but the TMA wrote {c.dst}: write the "
                    f"slot of the state you acquired, t{r}s{r}[None, state_{r.lower()}.index]")
        if c.bar.ring == r and c.bar.index == armed[r][0] and c.bar.phase != armed[r][1]:
            return (f"the TMA load into {c.dst} counts its bytes on the next phase of {r} "
                    f"full[{c.bar.index}], not on the phase the acquire armed: the barrier was "
                    "taken from the state after state.advance(). Take it, and the slot, from "
                    "the state you acquired, before advancing")
        if c.bar.ring != r or (c.bar.index, c.bar.phase) != armed[r]:
            return (f"the TMA load into {c.dst} counts its bytes on {c.bar}, not on the barrier "
                    f"of the slot you acquired ({r} full[{armed[r][0]}]): take it from the same "
                    "state, producer_get_barrier(state) before advancing")
        filled[r], armed[r] = armed[r], None
        order[r].append(c.src.index)
    for r in "KV":
        if armed[r] is not None:
            return (f"the last acquire of {r} slot {armed[r][0]} is never followed by a TMA load "
                    "into it: the consumers would wait on its full barrier forever")
    want = list(range(n_tiles - 1, -1, -1))
    for r in "KV":
        got = order[r]
        if got == want:
            continue
        missing = sorted(set(want) - set(got))
        twice = sorted({t for t in got if got.count(t) > 1})
        if missing:
            return (f"with {n_tiles} tile(s), {r} tile(s) {missing} are never loaded: the "
                    "consumers wait for them forever. Each of K and V has tiles 0 .. n_tiles - 1")
        if twice:
            return f"{r} tile(s) {twice} are loaded more than once"
        return (f"you load the {r} tiles in the order {got}; the consumers read them in the "
                f"order {want} (the last tile first: it is the one that may need the mask), "
                "one after another through the ring, so the slots would hold tiles the "
                "consumers do not expect")
    return None


def _kv_consumer(rings: dict, n_tiles: int, me: int):
    """One consumer warpgroup in the kernel's order (intra-warpgroup overlap): S of the last
    tile alone; then each turn waits K[t] and V[t+1], computes S_t and P_{t+1} V_{t+1}, releases
    K[t] once S is done and V[t+1] after; last, P_0 V_0."""
    k, v = rings["K"], rings["V"]
    sk, sv = _State(k.stages, 0), _State(v.stages, 0)
    if n_tiles == 0:
        return
    yield k.full[sk.index].wait(parity=sk.phase)
    yield from k.read(sk.index, n_tiles - 1, me)
    k.empty[sk.index].arrive()
    sk.advance()
    for i in range(1, n_tiles):
        yield k.full[sk.index].wait(parity=sk.phase)
        yield v.full[sv.index].wait(parity=sv.phase)
        yield from k.read(sk.index, n_tiles - 1 - i, me)
        k.empty[sk.index].arrive()
        sk.advance()
        yield from v.read(sv.index, n_tiles - i, me)
        v.empty[sv.index].arrive()
        sv.advance()
    yield v.full[sv.index].wait(parity=sv.phase)
    yield from v.read(sv.index, 0, me)
    v.empty[sv.index].arrive()


def _replay(rings: dict, calls: list[ProducerCall]):
    """The producer's recorded calls as the producer's role in the simulation."""
    for c in calls:
        ring = rings[c.ring]
        if c.kind == "acquire":
            yield ring.empty[c.index].wait(parity=c.phase)
            ring.full[c.index].arrive_expect_tx(ring.tile_bytes)
        elif c.kind == "copy":
            ring.tma_load(c.dst.index, c.src.index)
            yield 1


@dataclass
class KVRingSim(RingSim):
    """The kernel's two rings, K and V, between a producer replaying ``calls`` (from
    ``record_producer``) and ``consumers`` warpgroups in the kernel's order (``_kv_consumer``).
    Same clock, same checks as RingSim: deadlocks, overwrites, stale reads."""

    calls: tuple = ()

    def __post_init__(self):
        clock = _Clock()
        self.rings = {r: Ring(self.stages, self.consumers, self.latency, self.read_ticks,
                              name=f"{r} ", clock=clock) for r in "KV"}
        self.ring = self.rings["K"]  # the clock and the event log of both
        self.agents = [_Agent("producer", _replay(self.rings, list(self.calls)))]
        self.agents += [_Agent(f"consumer {c}", _kv_consumer(self.rings, self.n_tiles, c))
                        for c in range(self.consumers)]

    def _rings(self) -> list:
        return list(self.rings.values())

    def run(self) -> KVRingSim:
        while not self.done:
            self.step()
        return self


KV_SIM_CASES = [(n, stages, latency, read) for n in (0, 1, 2, 3, 7) for stages in (2, 3, 1)
                for latency, read in ((1, 1), (4, 3), (9, 2))]
BOXES_PER_TILE = 2  # at D = 128 a 256-byte row comes as two 128-byte (swizzled) TMA boxes


def _consumer_order_hint() -> str:
    return ("Hint: a consumer warpgroup waits for K[t] and V[t+1] together (it issues "
            "S_t = Q K_t^T and O += P_{t+1} V_{t+1} in one turn) and releases K[t] only after "
            "that; so the producer must not get more than the ring's depth of K tiles ahead of "
            "the V tiles. Load in the consumers' order: K[n-1], then K[t] with V[t+1] for "
            "t = n-2 .. 0, then V[0] (Note [Phases]).")


def check_load_kv(fn, compile_check: bool = True) -> None:
    """Exercise 05.4: ``fn`` (the producer's K/V loop) run with recording stand-ins for 0 to 7
    tiles and 1 to 3 stages, each slot, barrier and tile checked; replayed against two consumer
    warpgroups in the two-ring simulation; then compiled into the kernel for sm_90a: every TMA
    load of a tile (two boxes at D = 128) follows one arrive.expect_tx."""
    for n, stages, latency, read in KV_SIM_CASES:
        what = f"with {n} K/V tile(s) and {stages}-stage rings"
        try:
            calls = record_producer(fn, n, stages)
        except AssertionError as exc:
            raise AssertionError(f"{what}: {exc}") from None
        mistake = _producer_mistake(calls, n)
        if mistake:
            raise AssertionError(f"{what}: {mistake}.")
        sim = KVRingSim(n_tiles=n, stages=stages, consumers=2, latency=latency,
                        read_ticks=read, calls=tuple(calls))
        try:
            sim.run()
        except Deadlock as exc:
            order = " ".join(f"{c.ring}{c.src.index}" for c in calls if c.kind == "copy")
            raise AssertionError(f"{what} (TMA latency {latency}, {read} tick(s) per read), "
                                 f"loading in the order {order}: the pipeline deadlocked.\n"
                                 f"{exc}\n{_consumer_order_hint()}") from None
        except PipelineError as exc:
            raise AssertionError(f"{what}: {exc}") from None
    if compile_check:
        try:
            counts = producer_ptx_counts(fn)
        except Exception as exc:
            if "does not dominate" not in str(exc):
                raise
            raise AssertionError(
                "the loop runs right as Python but does not compile: a pipeline state advanced "
                "inside a helper function (or a value made inside a loop and used after it) is "
                "not carried from one trip of a cutlass.range loop to the next. Call "
                "state.advance() in the loop body itself, as the consumers do") from None
        loads, arms = counts["TMA loads"], counts["arrive.expect_tx"]
        if loads != BOXES_PER_TILE * arms:
            raise AssertionError(
                f"compiled for sm_90a, the kernel has {loads} TMA loads "
                f"(cp.async.bulk.tensor, {BOXES_PER_TILE} boxes per tile) but {arms} "
                "mbarrier.arrive.expect_tx: every tile's copy needs the producer_acquire that "
                "arms its barrier with the tile's bytes, one per copy")


def producer_ptx_counts(fn, head_dim: int = 128) -> dict:
    """PTX counts of the whole kernel compiled for sm_90a with ``fn`` as its producer loop:
    TMA loads (cp.async.bulk.tensor from global into shared memory, each naming its mbarrier),
    arrive.expect_tx, and all mbarrier waits (producer's and consumers')."""
    ptx = compile_with_producer(fn, head_dim).ptx
    lines = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor" in ln
             and "shared::cta.global" in ln]
    return {"TMA loads": len(lines),
            "TMA loads naming an mbarrier": sum("mbarrier::complete_tx" in ln for ln in lines),
            "arrive.expect_tx": ptx.count("mbarrier.arrive.expect_tx"),
            "mbarrier waits": ptx.count("mbarrier.try_wait")}


_PRODUCER_BUILDS: dict = {}


def compile_with_producer(fn, head_dim: int = 128, causal: bool = False):
    """``HopperWithProducer(fn)`` compiled for sm_90a with fake tensors (no GPU); remembered."""
    import cutlass
    from cutlass.cute.runtime import make_fake_tensor

    from utils.compile_only import compile_for, fake_stream

    key = (fn, head_dim, causal)
    if key in _PRODUCER_BUILDS:
        return _PRODUCER_BUILDS[key]
    elem = cutlass.BFloat16
    batch, heads, heads_kv = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    seqlen_q, seqlen_k = cute.sym_int32(), cute.sym_int32()

    def bshd(seqlen, nheads):  # as ch05.compile_only: (b, s, h, D), 16-byte aligned strides
        strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
        return make_fake_tensor(elem, (batch, seqlen, nheads, head_dim), (*strides, 1),
                                assumed_align=16)

    lse = make_fake_tensor(cutlass.Float32, (batch, heads, seqlen_q),
                           (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    kernel = HopperWithProducer(fn, elem, head_dim, causal)
    art = compile_for("sm_90a", kernel, bshd(seqlen_q, heads), bshd(seqlen_k, heads_kv),
                      bshd(seqlen_k, heads_kv), bshd(seqlen_q, heads), lse, 1.0, fake_stream())
    _PRODUCER_BUILDS[key] = art
    return art


_GPU_BUILDS: dict = {}


def attention_into_with_producer(fn):
    """``ch05.attention_into`` with ``fn`` as the producer's K/V loop: a function (q, k, v,
    out, lse, causal, softmax_scale, config) for ``utils.checks``."""

    def attention_into(q, k, v, out, lse, causal=False, softmax_scale=None, config=None):
        import cuda.bindings.driver as cuda
        import torch

        b, sq, sk, h, hk, d = ch05.check_inputs(q, k, v, softmax_scale, config)
        cfg = config or ch05.default_config(d)
        scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
        args = [ch05._to_cute(t, 3) for t in (q, k, v, out)] + [ch05._to_cute(lse, 2, align=4)]
        stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
        key = (fn, q.dtype, d, bool(causal), cfg)
        if key not in _GPU_BUILDS:
            kernel = HopperWithProducer(fn, ch05.TORCH_TO_CUTLASS[q.dtype], d, bool(causal), cfg)
            _GPU_BUILDS[key] = cute.compile[cute.GPUArch("sm_90a")](kernel, *args, scale, stream)
        _GPU_BUILDS[key](*args, scale, stream)
        return out, lse

    return attention_into


# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype): one tile, ragged tiles,
# causal tiles that see no key (n_tiles = 0), many tiles through a 2-stage ring
PRODUCER_GPU_CASES = [
    (1, 128, 128, 1, 1, 128, False, "bfloat16"),
    (1, 300, 77, 2, 2, 128, True, "bfloat16"),
    (1, 1000, 4097, 2, 1, 128, True, "bfloat16"),
    (2, 129, 129, 4, 2, 64, True, "float16"),
    (1, 2048, 2048, 2, 2, 128, False, "bfloat16"),
]


def check_load_kv_on_gpu(fn, cases=PRODUCER_GPU_CASES) -> tuple[bool, list[str]]:
    """Exercise 05.4 on a Hopper GPU: the whole kernel with ``fn`` as its producer loop, on
    fresh random inputs, against the float64 reference. Returns (ok, one line per case)."""
    import torch

    from utils import checks

    run = attention_into_with_producer(fn)
    ok, lines = True, []
    for b, sq, sk, h, hk, d, causal, dtype in cases:
        case_ok, line = checks.check_random_case(run, b, sq, sk, h, hk, d, causal,
                                                 getattr(torch, dtype))
        ok &= case_ok
        lines.append(line)
    return ok, lines


# ================================================================================================
# 5. The compiled turn: where ptxas put the waits
# ================================================================================================
SASS_KINDS = ("S = Q K^T (HGMMA)", "O += P V (HGMMA)", "wgmma wait (DEPBAR)", "exp2 (MUFU.EX2)",
              "barriers (BAR, SYNCS)", "other")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]+\*/\s+(.+?)\s*;")


def _kind(op: str) -> str:
    if "HGMMA" in op:
        # O += P V takes A (P) from registers: "HGMMA.<shape> Rd, Ra, gdesc[...]"
        return SASS_KINDS[1] if re.search(r"HGMMA\.\S+ R\d+, R\d+", op) else SASS_KINDS[0]
    if "WARPGROUP.DEPBAR" in op:
        return SASS_KINDS[2]
    if "MUFU.EX2" in op:
        return SASS_KINDS[3]
    if re.search(r"\bBAR\.|SYNCS\.", op):
        return SASS_KINDS[4]
    return SASS_KINDS[5]


def steady_turn(sass: str) -> list[tuple[str, str]]:
    """The instructions of the first steady-state turn of an intra-warpgroup-overlap build, as
    (kind, instruction): from the last wait (turn or K/V barrier) before the first
    ``wait_group(1)`` to the next HGMMA or barrier after the ``wait_group(0)`` that follows."""
    ops = [m.group(1) for m in map(_INSTRUCTION.search, sass.splitlines()) if m]
    s_ready = next((i for i, op in enumerate(ops) if "DEPBAR.LE gsb0, 0x1" in op), None)
    if s_ready is None:
        return []
    start = max((i for i in range(s_ready) if "BAR.SYNC" in ops[i] or "PHASECHK" in ops[i]),
                default=0)
    pv_done = next(i for i in range(s_ready, len(ops)) if "DEPBAR.LE gsb0, 0x0" in ops[i])
    end = next((i for i in range(pv_done + 1, len(ops))
                if "HGMMA" in ops[i] or "BAR.SYNC" in ops[i] or "PHASECHK" in ops[i]), len(ops))
    return [(_kind(op), op) for op in ops[start:end]]


def turn_sections(turn) -> list[tuple[str, dict]]:
    """Opcode counts of a ``steady_turn`` in its three parts: issuing the GEMMs (up to the wait
    for S), while P V may still run (between the two waits), and after P V is done."""
    waits = [i for i, (kind, _) in enumerate(turn) if kind == SASS_KINDS[2]]
    if len(waits) < 2:
        return []
    bounds = [(0, waits[0]), (waits[0] + 1, waits[1]), (waits[1] + 1, len(turn))]
    names = ("issue S and P V", "S ready, P V may still run", "after P V is done")
    out = []
    for name, (a, b) in zip(names, bounds):
        counts: dict[str, int] = {}
        for _, op in turn[a:b]:
            word = op.split()[1] if op.startswith("@") else op.split()[0]
            base = word.split(".")[0]
            counts[base] = counts.get(base, 0) + 1
        out.append((name, dict(sorted(counts.items(), key=lambda kv: -kv[1]))))
    return out


def draw_steady_turn(turn, ax=None, title="One steady-state turn of a consumer, as compiled"):
    """Each instruction of ``steady_turn`` as a tick in its kind's row, in program order."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.8))
    colors = ("#1f77b4", "#17becf", "#d62728", "#ff7f0e", "#7f7f7f", "#dddddd")
    for row, (kind, col) in enumerate(zip(SASS_KINDS, colors)):
        xs = [i for i, (k, _) in enumerate(turn) if k == kind]
        ax.vlines(xs, row - 0.35, row + 0.35, color=col, linewidth=1.5)
        ax.text(len(turn) + 1, row, f"{len(xs)}", va="center", fontsize=8)
    for i, (_, op) in enumerate(turn):
        if "DEPBAR" in op:
            ax.axvline(i, color="#d62728", linewidth=0.8, linestyle="--")
            ax.text(i, -0.8, f"wait_group({int(op.split('gsb0, ')[-1], 16)})", fontsize=7,
                    ha="center", color="#d62728")
    ax.set_yticks(range(len(SASS_KINDS)), SASS_KINDS, fontsize=8)
    ax.set_ylim(len(SASS_KINDS) - 0.5, -1.2)
    ax.set_xlabel("instruction index in the turn (program order)")
    ax.set_title(title)
    ax.grid(False)
    return ax


# ================================================================================================
# 6. Warp specialisation: registers and ping-pong
# ================================================================================================
def register_table() -> list[dict]:
    """setmaxnreg budgets per number of consumer warpgroups: registers per thread and in all."""
    rows = []
    for wgs, (producer, consumer) in sorted(ch05.REGISTER_BUDGETS.items()):
        threads = ch05.THREADS_PER_WG * (1 + wgs)
        # the most a thread may have at launch: the CTA must fit the SM's 64 K registers,
        # counts go in steps of 8, and no thread may exceed 255
        launch = min(255, ch05.REGISTERS_PER_SM // threads // 8 * 8)
        rows.append({"consumer_wgs": wgs, "threads": threads, "at_launch": launch,
                     "producer": producer, "consumer": consumer,
                     "total": ch05.THREADS_PER_WG * (producer + wgs * consumer)})
    return rows


def consumer_fragments(head_dim: int, cfg=None) -> dict:
    """32-bit registers per consumer thread for the three big fragments: S and O in fp32, P
    packed two 16-bit values per register. Everything else (addresses, descriptors, softmax
    state, loop counters) comes on top."""
    cfg = cfg or ch05.default_config(head_dim)
    rows_per_thread = ch05.WGMMA_M / ch05.THREADS_PER_WG  # 64 rows over a warpgroup's threads
    s = int(rows_per_thread * cfg.tile_n)
    o = int(rows_per_thread * head_dim)
    return {"S (fp32)": s, "P (bf16 pairs)": s // 2, "O (fp32)": o, "sum": s + s // 2 + o}


def turn_cycles(head_dim: int, tile_n: int = 128) -> dict:
    """Model cycles of one consumer warpgroup's turn on an H100/H200 SM: its two GEMMs (64 rows,
    at the SM's full tensor-core rate) and its 64 x tile_n exponentials (the SM's MUFU)."""
    gemm = 2 * 2 * ch05.WGMMA_M * tile_n * head_dim / HOPPER.mma_flops_per_clk
    exp = ch05.WGMMA_M * tile_n / HOPPER.exp2_per_clk
    return {"gemm": gemm, "exp": exp}


SCHEDULE_MODES = {
    "interleaved": "GEMMs issued together share the tensor cores (instructions interleaved)",
    "issue order": "no barriers; assume the tensor cores take GEMM groups in issue order",
    "ping-pong": "named barriers make the warpgroups issue in turn; groups run in that order",
}


def pingpong_schedule(turns: int, gemm: float, softmax: float, mode: str = "ping-pong",
                      wgs: int = 2, dt: float = 4.0) -> dict:
    """A fluid model of ``wgs`` consumer warpgroups on one SM, each looping: issue its turn's
    GEMMs, wait for them, run its softmax. Softmaxes running at the same time share MUFU (and
    the issue slots of the same SM sub-partitions): each runs at 1/k speed. The tensor cores
    follow ``mode`` (a key of SCHEDULE_MODES): "interleaved" shares them the same way among
    all issued GEMMs; "issue order" runs the oldest issued group alone; "ping-pong" does too,
    and a warpgroup may issue only when the turn order (0, 1, ..., 0, 1, ...) reaches it.

    Returns ``segments`` (wg, "gemm"/"softmax", start, end; a GEMM from when it started to
    run), the ``makespan`` and the fraction of it the tensor cores were busy."""
    if mode not in SCHEDULE_MODES:
        raise ValueError(f"mode must be one of {sorted(SCHEDULE_MODES)}, got {mode!r}")
    phase = ["ready"] * wgs
    left = [0.0] * wgs
    turn = [0] * wgs
    started = [0.0] * wgs
    queue: list[int] = []  # warpgroups whose GEMMs are issued and not finished, oldest first
    next_in_turn = 0  # ping-pong: the warpgroup allowed to issue next
    segments, busy, now = [], 0.0, 0.0
    limit = 100 * turns * wgs * (gemm + softmax)
    while not all(p == "done" for p in phase):
        for w in range(wgs):
            if phase[w] == "ready" and (mode != "ping-pong" or next_in_turn == w):
                phase[w], left[w] = "gemm", gemm
                queue.append(w)
                next_in_turn = (w + 1) % wgs
        running = queue if mode == "interleaved" else queue[:1]
        for w in running:
            if left[w] == gemm:
                started[w] = now
        softs = [w for w in range(wgs) if phase[w] == "softmax"]
        busy += dt if running else 0.0
        for w in running:
            left[w] -= dt / len(running)
        for w in softs:
            left[w] -= dt / len(softs)
        now += dt
        for w in range(wgs):
            if phase[w] in ("gemm", "softmax") and left[w] <= 1e-9:
                segments.append((w, phase[w], started[w], now))
                if phase[w] == "gemm":
                    queue.remove(w)
                    phase[w], left[w], started[w] = "softmax", softmax, now
                else:
                    turn[w] += 1
                    phase[w] = "done" if turn[w] == turns else "ready"
        if now > limit:
            raise RuntimeError("pingpong_schedule did not finish; check its arguments")
    return {"segments": segments, "makespan": now, "tensor_busy": busy / now}


def draw_pingpong(schedules: dict, axes=None):
    """One panel per schedule of ``pingpong_schedule``: each warpgroup's GEMMs and softmaxes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if axes is None:
        _, axes = plt.subplots(len(schedules), 1, figsize=(9, 1.5 * len(schedules) + 0.8),
                               sharex=True)
    axes = np.atleast_1d(axes)
    colors = {"gemm": "#1f77b4", "softmax": "#ff7f0e"}
    for ax, (title, sched) in zip(axes, schedules.items()):
        ax.set_xlim(0, max(s["makespan"] for s in schedules.values()) * 1.02)
        wgs = 1 + max(s[0] for s in sched["segments"])
        for w, kind, t0, t1 in sched["segments"]:
            ax.barh(w, t1 - t0, left=t0, color=colors[kind], edgecolor="white", height=0.6)
        ax.set_yticks(range(wgs), [f"consumer WG {w + 1}" for w in range(wgs)], fontsize=8)
        ax.set_ylim(wgs - 0.5, -0.5)
        ax.set_title(f"{title}: tensor cores busy {sched['tensor_busy']:.0%} of "
                     f"{sched['makespan']:.0f} cycles", fontsize=10)
        ax.grid(axis="y", visible=False)
    axes[-1].set_xlabel("cycles (model)")
    axes[0].legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], fontsize=8,
                   loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return axes


# ================================================================================================
# 7. Shared memory and the stage count (exercise 05.1)
# ================================================================================================
def smem_breakdown(head_dim: int, cfg) -> list[tuple[str, int]]:
    """The kernel's SharedStorage item by item, each rounded up to the 1 KB swizzle alignment
    (the sum is ``ch05.smem_bytes``)."""
    kb = 1024
    align = lambda n: -(-n // kb) * kb
    barriers = 8 * (2 + 4 * cfg.num_stages)
    ring = cfg.num_stages * cfg.tile_n * head_dim * ELEM_BYTES
    items = [(f"mbarriers: {barriers // 8} x 8 B", align(barriers)),
             (f"Q (O reuses it): {cfg.tile_m} x {head_dim} x 2 B", align(cfg.tile_m * head_dim
                                                                        * ELEM_BYTES)),
             (f"K ring: {cfg.num_stages} x {cfg.tile_n} x {head_dim} x 2 B", align(ring)),
             (f"V ring: {cfg.num_stages} x {cfg.tile_n} x {head_dim} x 2 B", align(ring))]
    return items


def stages_that_fit(head_dim: int, cfg) -> int:
    """Exercise 05.1's reference: the most K/V stages whose SharedStorage fits 227 KB (0 if not
    even one does)."""
    stages = 0
    while ch05.smem_bytes(head_dim, replace(cfg, num_stages=stages + 1)) <= (
        ch05.SMEM_BYTES_PER_CTA
    ):
        stages += 1
    return stages


STAGE_CASES = [(d, ch05.HopperConfig(tile_n=n, num_consumer_wgs=w))
               for d in (64, 128, 256) for n in (64, 80, 128, 176, 256) for w in (1, 2, 3)]


def _sum_text(head_dim: int, cfg, stages: int) -> str:
    q = cfg.tile_m * head_dim * ELEM_BYTES // 1024
    kv = cfg.tile_n * head_dim * ELEM_BYTES // 1024
    total = ch05.smem_bytes(head_dim, replace(cfg, num_stages=max(stages, 0))) / 1024
    return f"1 KB barriers + Q {q} KB + {stages} x (K {kv} KB + V {kv} KB) = {total:g} KB"


def check_stages_that_fit(fn) -> None:
    """Exercise 05.1: fn(head_dim, cfg) -> the number of K/V stages that fit in 227 KB."""
    budget = ch05.SMEM_BYTES_PER_CTA // 1024
    for head_dim, cfg in STAGE_CASES:
        want = stages_that_fit(head_dim, cfg)
        got = fn(head_dim, cfg)
        what = (f"D={head_dim}, tile {cfg.tile_m} x {cfg.tile_n} ({cfg.num_consumer_wgs} "
                f"consumer warpgroup(s))")
        assert isinstance(got, (int, np.integer)) and not isinstance(got, bool), (
            f"{what}: return a whole number of stages, got {got!r}")
        if got > want:
            raise AssertionError(f"{what}: you said {got} stages, but {got} need "
                                 f"{_sum_text(head_dim, cfg, got)}, more than {budget} KB")
        if got < want:
            raise AssertionError(f"{what}: you said {got}, but {want} fit: "
                                 f"{_sum_text(head_dim, cfg, want)} <= {budget} KB")


# ================================================================================================
# 8. Reading the kernel's source in pieces
# ================================================================================================
def note(name: str, module=ch05) -> str:
    """A ``# Note [name]`` comment block of the kernel's module, without the comment marks."""
    lines = inspect.getsource(module).splitlines()
    head = next((i for i, ln in enumerate(lines) if ln.strip() == f"# Note [{name}]"), None)
    if head is None:
        return f"(Note [{name}] not found in {module.__name__})"
    out = []
    for ln in lines[head:]:
        if not ln.strip().startswith("#"):
            break
        out.append(ln.strip()[2:])
    return "\n".join(out)


def ptx_lines(ptx: str, pattern: str, limit: int = 8) -> list[str]:
    """Lines of PTX matching ``pattern``, with the long mangled kernel names cut short."""
    found = [ln.strip() for ln in ptx.splitlines() if re.search(pattern, ln)]
    return [re.sub(r"kernel_cutlass_\w+?_param", "param", ln) for ln in found[:limit]]


# ================================================================================================
# Exercise 05.3: a race that hides
# ================================================================================================
SCENARIO_KEYS = ("n_tiles", "stages", "consumers", "latency", "read_ticks")


def _scenario(name: str, cfg) -> dict:
    if not isinstance(cfg, dict):
        raise AssertionError(f"{name} should be a dict of RingSim settings, such as "
                             f"dict(n_tiles=8, stages=2, consumers=2, latency=4, read_ticks=3); "
                             f"got {cfg!r}")
    unknown = sorted(set(cfg) - set(SCENARIO_KEYS))
    if unknown:
        raise AssertionError(f"{name}: RingSim has no setting {unknown[0]!r} here; use "
                             f"{', '.join(SCENARIO_KEYS)}")
    full = {**{k: getattr(RingSim, k) for k in SCENARIO_KEYS}, **cfg}
    for key, value in full.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise AssertionError(f"{name}: {key} must be a whole number >= 1, got {value!r}")
    if full["n_tiles"] <= 2 * full["stages"]:
        raise AssertionError(
            f"{name}: {full['n_tiles']} tiles through {full['stages']} slot(s) reuse each slot "
            "at most once; a scenario that tests the producer's wait lets the ring wrap at "
            "least twice (n_tiles > 2 x stages)")
    return full


def run_scenario(cfg: dict, producer=None) -> str | None:
    """Run ``RingSim(**cfg)`` with ``producer`` (default: the one that never waits on empty):
    None when every consumer read every tile, else the simulator's complaint."""
    producer = producer_no_wait if producer is None else producer
    cfg = {**{k: getattr(RingSim, k) for k in SCENARIO_KEYS}, **cfg}
    try:
        sim = RingSim(**cfg, producer_step=producer).run()
    except PipelineError as exc:
        return f"{type(exc).__name__}: {exc}"
    reads = sorted((me, tile) for me, tile, *_ in sim.ring.reads)
    if reads != sorted((me, t) for me in range(cfg["consumers"]) for t in range(cfg["n_tiles"])):
        return "not every consumer read every tile exactly once"
    return None


# Exercise 05.3's reference: the producer that never waits on empty runs clean while each copy
# lands before the producer comes round the ring (latency < stages) and the consumers read a tile
# per tick, as fast as the producer issues; with slower reads the ring fills, and the producer
# refills a slot that is still being read.
_HIDES = dict(n_tiles=8, stages=3, consumers=2, latency=2, read_ticks=1)
RACE_SCENARIOS = (_HIDES, dict(_HIDES, read_ticks=3))


def check_race_scenarios(answer) -> None:
    """Exercise 05.3: ``answer`` = (hides, shows), two dicts of RingSim settings that differ in
    one setting; the checker runs both with ``producer_no_wait`` itself. ``hides`` must run
    clean (every tile read by every consumer), ``shows`` must end in an overwrite (or the extra
    arrival that comes with it), not a deadlock."""
    if answer is None or (isinstance(answer, (tuple, list)) and all(a is None for a in answer)):
        raise NotImplementedError
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
        raise AssertionError("answer with a pair (hides, shows) of dicts of RingSim settings")
    if any(a is r for a, r in zip(answer, RACE_SCENARIOS)):
        raise AssertionError("that is the reference's pair (RACE_SCENARIOS); find your own "
                             "settings with run_scenario")
    hides, shows = (_scenario(n, c) for n, c in zip(("hides", "shows"), answer))
    changed = [k for k in SCENARIO_KEYS if hides[k] != shows[k]]
    if len(changed) != 1:
        raise AssertionError(
            f"your two scenarios differ in {', '.join(changed) or 'nothing'}: change exactly "
            "one setting between them, so that the runs tell you which setting exposes the "
            "race")
    for name, cfg in (("hides", hides), ("shows", shows)):
        if run_scenario(cfg, producer_step) is not None:  # cannot happen: a sanity check
            raise AssertionError(f"{name}: even the correct producer fails: "
                                 f"{run_scenario(cfg, producer_step)}")
    said = run_scenario(hides)
    if said is not None:
        raise AssertionError(f"in 'hides' ({hides}) the race shows: {said}\nLook for "
                             "settings in which no slot is ever refilled while it is read")
    said = run_scenario(shows)
    if said is None:
        raise AssertionError(
            f"in 'shows' ({shows}) the broken producer runs clean: the race stays hidden. "
            f"You changed {changed[0]}; think about who is slower, the producer (one tile per "
            "tick) or the consumers, and when a slot is refilled")
    if said.startswith("Deadlock"):
        raise AssertionError(f"'shows' ends in a deadlock, not in the race: {said}")


# ================================================================================================
# Readings of the stored runs: the chapter's predictions, the peak, and the claims its prose (and
# the lab's) makes, each checked on its results file (tests/test_claims.py)
# ================================================================================================
# NVIDIA's dense bf16 tensor-core figure for the H100 SXM and the H200 SXM (datasheets).
DATASHEET_BF16_DENSE_TFLOPS = hardware.DATASHEET_DENSE_BF16_TFLOPS["sm_90"]


def peak_lines(micro=None) -> list[str]:
    """The chip's bf16 peak three ways, each with the clock it assumes: the datasheet figure
    (and the clock at which 4096 FLOP/clk/SM x 132 SMs gives it), the same product at the
    maximum boost clock, and the large matmul measured on the H200 (``micro``: microbench)."""
    per_clk_chip = HOPPER.mma_flops_per_clk * HOPPER.sms
    clock = DATASHEET_BF16_DENSE_TFLOPS * 1e12 / per_clk_chip / 1e9
    lines = [f"datasheet (H100/H200 SXM, dense bf16): {DATASHEET_BF16_DENSE_TFLOPS} TFLOP/s = "
             f"{HOPPER.mma_flops_per_clk} FLOP/clk/SM x {HOPPER.sms} SMs x {clock:.2f} GHz "
             f"(the clock that product needs)",
             f"the same product at the {HOPPER.boost_clock_ghz} GHz maximum boost clock: "
             f"{HOPPER.chip_peak(HOPPER.mma_flops_per_clk) / 1e12:.0f} TFLOP/s (model)"]
    if micro is not None:
        for r in micro.where(metric="matmul_tflops"):
            lines.append(f"measured, {r['impl']}: {r['value']:.0f} TFLOP/s at whatever clock "
                         f"the GPU held ({micro.label})")
    return lines


def fwd_row(res, impl: str, d: int = 128, s: int = 16384, causal: bool = False) -> dict:
    return res.one(impl=impl, d=d, s=s, causal=causal, **{"pass": "fwd"})


def fwd_ratio(res, impl: str, peer: str, d: int = 128, s: int = 16384,
              causal: bool = False) -> float:
    """``impl``'s TFLOP/s over ``peer``'s at one shape of one run."""
    return fwd_row(res, impl, d, s, causal)["tflops"] / fwd_row(res, peer, d, s, causal)["tflops"]


def _shapes(res) -> list[tuple]:
    return sorted({(r["d"], r["s"], r["causal"]) for r in res.rows if r.get("pass") == "fwd"})



@claim("05.fa2_far_behind", "ch05_fwd",
        "SDPA's FlashAttention-2 (mma.sync) reaches at most 0.75x of every wgmma kernel of the "
        "run (this chapter's, cuDNN, the FA4 package) at every shape")
def _fa2_far_behind(res):
    worst = max(fwd_ratio(res, "sdpa_flash", other, *k) for k in _shapes(res)
                for other in ("flash_hopper", "sdpa_cudnn", "fa4_package"))
    return worst <= 0.75, f"sdpa_flash over a wgmma kernel: at most {worst:.2f}"


@claim("05.level_with_cudnn_d128", "ch05_fwd",
        "at D = 128 the kernel is level with cuDNN (within 3%) "
        "at every S, causal or not")
def _level_with_cudnn(res):
    from solutions.ch04_teaching import LEVEL

    ratios = [fwd_ratio(res, "flash_hopper", "sdpa_cudnn", *k) for k in _shapes(res)
              if k[0] == 128]
    return all(abs(r - 1) < LEVEL for r in ratios), ", ".join(f"{r:.2f}" for r in ratios)


@claim("05.behind_fa4_package", "ch05_fwd",
        "the kernel is behind the FA4 package at every shape, and "
        "at D = 64 by more than either row's spread")
def _behind_fa4(res):
    from utils.bench import compare

    ok, out = True, []
    for k in _shapes(res):
        c = compare(fwd_row(res, "flash_hopper", *k), fwd_row(res, "fa4_package", *k))
        ok &= c.ratio < 1 and (c.real or k[0] != 64)
        out.append(f"D={k[0]} S={k[1]} causal={k[2]}: {c}")
    return ok, "; ".join(out)


@claim("05.d64_gap_larger", "ch05_fwd",
        "at D = 64 the kernel is behind cuDNN by more than 3%, and "
        "its gap to cuDNN and to the FA4 package is larger than at D = 128, at every S, "
        "causal or not")
def _d64_gap(res):
    from solutions.ch04_teaching import LEVEL

    lines, ok = [], True
    for s, causal in sorted({(k[1], k[2]) for k in _shapes(res)}):
        ok &= fwd_ratio(res, "flash_hopper", "sdpa_cudnn", 64, s, causal) < 1 - LEVEL
    for peer in ("sdpa_cudnn", "fa4_package"):
        for s, causal in sorted({(k[1], k[2]) for k in _shapes(res)}):
            r64 = fwd_ratio(res, "flash_hopper", peer, 64, s, causal)
            r128 = fwd_ratio(res, "flash_hopper", peer, 128, s, causal)
            ok &= r64 < r128
            lines.append(f"{peer} S={s} causal={causal}: {r64:.2f} vs {r128:.2f}")
    return ok, "; ".join(lines)


# --- the knob run (the lab reads it; labs/ch05_tuning.ipynb) ----------------------------------
def knob_verdicts(knobs, fwd=None) -> dict:
    """{(d, causal, knob name): (ratio to the default, noise, verdict)} of the knob run, with
    ``knob_effects``'s rule: the noise is the larger of the two rows' spreads and the spread
    between two runs of the same default (``default_spread`` with ``fwd``, when given)."""
    from utils.bench import compare

    spread = default_spread(knobs, fwd) if fwd is not None else None
    out = {}
    for d, causal in dict.fromkeys((r.get("d"), r.get("causal")) for r in knobs.rows):
        rows = [r for r in knobs.rows if (r.get("d"), r.get("causal")) == (d, causal)]
        base = next((r for r in rows if r.get("config") == "default" and r.get("tflops")), None)
        for r in rows:
            c = None if base is None or r is base else compare(r, base)
            if c is None:
                continue
            noise = max(c.noise, spread["spread"] if spread else 0.0)
            verdict = ("within noise" if abs(c.ratio - 1) <= noise
                       else "faster" if c.ratio > 1 else "slower")
            out[(d, causal, knob_name(r))] = (c.ratio, noise, verdict)
    return out


def _verdicts(res):
    from utils import results

    try:
        fwd = results.load("ch05_fwd", gpu="h200")
    except FileNotFoundError:
        fwd = None
    return knob_verdicts(res, fwd)


def _knob_holds(res, picks, want):
    v = _verdicts(res)
    found = {k: v[k] for k in v if any(k[0] == d and k[2].startswith(name) for d, name in picks)}
    ok = bool(found) and all(verdict in want for _, _, verdict in found.values())
    return ok, "; ".join(f"D={d} causal={c} {n}: {r:.2f}x, noise {z:.0%}, {verdict}"
                         for (d, c, n), (r, z, verdict) in found.items())


@claim("05.no_overlap_slower", "ch05_knobs",
        "without intra-warpgroup overlap the kernel is slower at "
        "D = 128, causal and not, by more than the noise")
def _no_overlap(res):
    return _knob_holds(res, [(128, "no intra-wg overlap")], {"slower"})


@claim("05.pingpong_within_noise", "ch05_knobs",
        "flipping ping-pong is within noise at D = 128 and at "
        "D = 64")
def _pingpong(res):
    return _knob_holds(res, [(128, "ping-pong"), (64, "ping-pong")], {"within noise"})


@claim("05.three_stages_within_noise", "ch05_knobs",
        "a third K/V stage is within noise at D = 128, "
        "causal and not")
def _stages(res):
    return _knob_holds(res, [(128, "3 stages")], {"within noise"})


@claim("05.d64_192x64_faster", "ch05_knobs",
        "at D = 64 the three-warpgroup 192 x 64 tile is faster "
        "than the two-warpgroup 128 x 128 tile, by more than the noise")
def _d64_tiles(res):
    from utils import results
    from utils.bench import compare

    small, big = d64_tile_rows(res)
    if small is None or big is None:
        return False, "the run has no 192 x 64 and 128 x 128 rows alike but for the tile"
    try:
        spread = default_spread(res, results.load("ch05_fwd", gpu="h200"))
    except FileNotFoundError:
        spread = None
    c = compare(small, big)
    noise = max(c.noise, spread["spread"] if spread else 0.0)
    return c.ratio > 1 + noise, f"192 x 64 / 128 x 128 = {c.ratio:.2f}, noise {noise:.0%}"


def d64_tile_rows(knobs) -> tuple[dict | None, dict | None]:
    """The knob run's D = 64 non-causal rows that differ only in the tile: the three-warpgroup
    192 x 64 and the two-warpgroup 128 x 128, both with the overlap, the same ping-pong setting
    and neither chapter 06's nor chapter 07's knob."""
    plain = [r for r in knobs.rows if r.get("d") == 64 and not r.get("causal") and r.get("tflops")
             and r.get("intra_wg_overlap") and not r.get("exp2_emulation_fraction")
             and not r.get("rescale_threshold")]
    small = next((r for r in plain if (r.get("tile_m"), r.get("tile_n")) == (192, 64)), None)
    big = next((r for r in plain if (r.get("tile_m"), r.get("tile_n")) == (128, 128)
                and small is not None and r.get("pingpong") == small.get("pingpong")), None)
    return small, big


@claim("05.d64_192x128_within_noise", "ch05_knobs",
        "at D = 64 the 192 x 128 tile without overlap is "
        "within noise of the two-warpgroup 128 x 128 tile")
def _d64_no_overlap(res):
    return _knob_holds(res, [(64, "192 x 128, no overlap")], {"within noise"})
