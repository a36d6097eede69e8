"""Reading the side-by-side Nsight Compute profile of fa4_final's Hopper forward and the FA4
package's (measured by ``python -m measure.fwd_versus``): two causal shapes and the headline
non-causal one, the two kernels' counters in two columns.

Chapter 08's own profile (``solutions.ch08_profile``) reads one kernel by SASS position; that
needs the kernel's structure, which the package's kernel does not share. This one reads only
what any kernel has: the counters of ncu's raw page (time, the tensor pipe, issue slots, DRAM
and L2, the stall reasons). Each (kernel, shape) is one ncu run of its own process, on the second
launch (the first compiles); ncu holds the SM clock at its base, so compare shares and ratios,
not speeds. The shapes are the benchmark's (16 heads, 16384 tokens, bf16). At the causal
shapes fa4_final is also profiled with the schedule it had before the tile table
(``fa4_final_zigzag``), which is how the difference in DRAM traffic was found.
"""

from __future__ import annotations

from solutions import ch04_profile as core
from solutions import ch05_profile as ch05p

RESULTS = "fa4_final_versus"
RESULTS_BOOST = "fa4_final_versus_boost"  # one shape at the GPU's own clock (--boost)
HEADS, TOKENS = 16, 16384
# (head_dim, seqlen, causal): D = 64 S = 16384 causal; D = 128 S = 4096 causal, the widest gap
# before the L2 sections; the headline non-causal shape
SHAPES = ((64, 16384, True), (128, 4096, True), (128, 16384, False))
# ncu's names: fa4_final's class is HopperForward, the package's FlashAttentionForwardSm90
KERNELS = {"fa4_final": "regex:HopperForward", "fa4_package": "regex:FlashAttentionForwardSm90"}
# fa4_final with the causal schedule it had before the tile table (Note [Tile table]): fixed
# zigzag rounds, longest first over every head; profiled at the causal shapes beside the default
VARIANTS = {"fa4_final_zigzag": dict(schedule="zigzag", l2_sections=False)}
KERNEL_OF = {**{name: KERNELS["fa4_final"] for name in VARIANTS}, **KERNELS}
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "LaunchStats",
            "Occupancy", "WarpStateStats", "SchedulerStats")
RAW_METRICS = ch05p.RAW_METRICS + (
    ("dram_throughput_pct", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%"),
    ("l2_hit_rate_pct", "lts__t_sector_hit_rate.pct", "%"),
    ("dram_read_gbytes", "dram__bytes_read.sum", "GB"),
)
EXTRA_METRICS = ch05p.EXTRA_METRICS + (
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sector_hit_rate.pct",
    "dram__bytes_read.sum",
)
# the rows the notebook prints, in order: (metric, what it is)
SIDE_BY_SIDE = (
    ("duration_ms", "kernel time at ncu's clock (ms)"),
    ("tensor_pipe_gmma_active_pct", "tensor pipe (GMMA) busy (% of cycles)"),
    ("tensor_pipe_active_pct", "tensor pipe busy (% of cycles)"),
    ("issue_slots_busy_pct", "issue slots busy (%)"),
    ("wgmma_instructions", "wgmma instructions (warp instructions)"),
    ("dram_throughput_pct", "DRAM throughput (% of peak)"),
    ("dram_read_gbytes", "DRAM bytes read (GB)"),
    ("l2_hit_rate_pct", "L2 hit rate (%)"),
    ("registers_per_thread", "registers per thread"),
)


def rows_of(raw_text: str, impl: str, head_dim: int, seqlen: int, causal: bool) -> list[dict]:
    shape = {"b": TOKENS // seqlen, "s": seqlen, "h": HEADS, "d": head_dim, "causal": causal}
    return [{"impl": impl, **shape, **r}
            for r in core.raw_rows(core.parse_raw(raw_text), RAW_METRICS)]


def impls_at(causal: bool, variants: bool = True) -> list[str]:
    return [*KERNELS, *(VARIANTS if causal and variants else ())]


def side_by_side(res, stalls: int = 5) -> list[str]:
    """Per shape, the two kernels' counters in two columns, then the largest stall reasons
    (cycles between two issues of a warp, all warps), largest in either column first."""
    lines = []
    shapes = sorted({(r["d"], r["s"], r["causal"]) for r in res.rows})
    for d, s, causal in shapes:
        by = {impl: {r["metric"]: r["value"] for r in res.rows
                     if (r["d"], r["s"], r["causal"], r["impl"]) == (d, s, causal, impl)}
              for impl in impls_at(causal)}
        by = {impl: b for impl, b in by.items() if b}
        lines.append(f"{f'D={d} S={s} ' + ('causal' if causal else 'non-causal'):46s}"
                     + "".join(f"{impl:>18s}" for impl in by))
        for metric, what in SIDE_BY_SIDE:
            if all(metric in b for b in by.values()):
                lines.append(f"  {what:44s}" + "".join(f"{b[metric]:18.2f}" for b in by.values()))
        reasons = {m for b in by.values() for m in b if m.startswith("stall_")}
        top = sorted(reasons, key=lambda m: -max(b.get(m, 0.0) for b in by.values()))[:stalls]
        for m in top:
            lines.append(f"  stall: {m[6:]:37s}"
                         + "".join(f"{b.get(m, 0.0):18.2f}" for b in by.values()))
    return lines


def reading(res) -> list[str]:
    """One sentence per shape, every number from the file: which kernel is shorter and by how
    much, and how their tensor-pipe, issue, DRAM and L2 figures compare."""
    out = []
    for d, s, causal in sorted({(r["d"], r["s"], r["causal"]) for r in res.rows}):
        by = {impl: {r["metric"]: r["value"] for r in res.rows
                     if (r["d"], r["s"], r["causal"], r["impl"]) == (d, s, causal, impl)}
              for impl in impls_at(causal)}
        theirs = by["fa4_package"]
        for name in (n for n in by if n != "fa4_package"):
            ours = by[name]
            if "duration_ms" not in ours or "duration_ms" not in theirs:
                continue
            ratio = theirs["duration_ms"] / ours["duration_ms"]
            parts = [f"D={d} S={s} {'causal' if causal else 'non-causal'}: {name} runs "
                     f"{ratio:.2f}x the package's speed under ncu"]
            for metric, what in (("tensor_pipe_active_pct", "tensor pipe busy"),
                                 ("issue_slots_busy_pct", "issue slots busy"),
                                 ("dram_throughput_pct", "DRAM throughput"),
                                 ("l2_hit_rate_pct", "L2 hit rate")):
                if metric in ours and metric in theirs:
                    parts.append(f"{what} {ours[metric]:.0f}% against {theirs[metric]:.0f}%")
            m = "tensor_pipe_active_pct"
            if m in ours and m in theirs:
                busy = [b[m] / 100 * b["duration_ms"] for b in (ours, theirs)]
                parts.append(f"tensor pipe busy for {busy[0]:.3f} ms against {busy[1]:.3f} ms")
            out.append("; ".join(parts))
    return out
