"""Reading an Nsight Compute profile of chapter 04's kernel (measured by
``python -m measure.profile_ch04`` on a GPU, stored as results/<gpu>/ch04_profile.json).

The kernel is the one ``attention()`` launches at the chapter's headline shape (D = 128, 16 heads
of 16384 queries and keys, bf16, non-causal). ncu replays that launch to read its counters and
samples the warps' program counters; from that the rows say:

- the tensor pipe's active share, issue slots used, warps per scheduler (occupancy) and the
  limits that set it, shared-memory bank conflicts per shared load wavefront;
- the stall reasons, as cycles per issued instruction (ncu's Warp State table);
- how each warp's time splits between the parts of the KV loop, by where the sampled program
  counter sat in the loop's SASS: the loop head (waits, barrier, cp.async address arithmetic),
  S = QK^T, the softmax, O += PV; the share spent at an mma.sync (issuing it or waiting for
  its turn on the tensor pipe or for its operands); and the instructions a warp issues per KV
  step.

ncu locks the SM clock to its base (1.38 GHz on the H200) while it measures, so the figures are
shares and ratios; speeds come from the benchmarks. The CSV readers (``parse_raw``,
``parse_source_rows``, ``raw_rows``) and ``format_profile`` are shared with chapter 05's reading,
``solutions.ch05_profile``, and through it with fa4_final's (``solutions.ch08_profile``).
"""

from __future__ import annotations

import csv
import io
from collections import Counter

RESULTS = "ch04_profile"
SHAPE = {"b": 1, "s": 16384, "h": 16, "d": 128, "causal": False}
KERNEL_REGEX = "regex:FlashAttentionAmpere"
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "LaunchStats", "Occupancy",
            "WarpStateStats", "SourceCounters")
EXTRA_METRICS = (
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
)
# (row metric, ncu raw metric, unit); a metric ncu does not report is left out of the file.
RAW_METRICS = (
    ("sm_clock_ghz", "gpc__cycles_elapsed.avg.per_second", "GHz"),
    ("duration_ms", "gpu__time_duration.sum", "ms"),
    ("tensor_pipe_active_pct",
     "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "%"),
    ("issue_slots_busy_pct", "sm__issue_active.avg.pct_of_peak_sustained_elapsed", "%"),
    ("registers_per_thread", "launch__registers_per_thread", "registers"),
    ("ctas_per_sm_limit_registers", "launch__occupancy_limit_registers", "CTAs"),
    ("ctas_per_sm_limit_shared_mem", "launch__occupancy_limit_shared_mem", "CTAs"),
    ("achieved_warps_per_sm", "sm__warps_active.avg.per_cycle_active", "warps"),
)
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
SCHEDULERS_PER_SM = 4
PHASES = ("loop_head", "qk", "softmax", "pv")


# ----------------------------------------------------------------------------------------------
# Reading ncu's CSV exports (plain text: tests feed them small hand-made tables)


def _number(text: str) -> float | None:
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


# ncu picks its own units for times and clocks; these are the ones the course converts.
_TO_COURSE_UNIT = {
    "GHz": {"ghz": 1.0, "mhz": 1e-3, "hz": 1e-9, "cycle/nsecond": 1.0, "cycle/usecond": 1e-3,
            "cycle/second": 1e-9},
    "ms": {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
           "second": 1e3, "s": 1e3},
    "GB": {"byte": 1e-9, "kbyte": 1e-6, "mbyte": 1e-3, "gbyte": 1.0, "tbyte": 1e3},
}


def _scale(value: float, unit: str, want: str) -> float:
    """``value`` in ncu's ``unit``, converted to ``want`` (GHz, ms or GB; counts such as registers,
    warps or % pass through). An unknown time or clock unit raises rather than guess."""
    if want not in _TO_COURSE_UNIT:
        return value
    factors = _TO_COURSE_UNIT[want]
    key = unit.strip().lower()
    if key not in factors:
        raise ValueError(f"cannot convert ncu's unit {unit!r} to {want}; known: {list(factors)}")
    return value * factors[key]


def parse_raw(text: str) -> dict[str, tuple[float, str]]:
    """``ncu --page raw --csv`` for one kernel: {metric name: (value, unit)} (numbers only)."""
    rows = list(csv.reader(io.StringIO(text)))
    rows = [r for r in rows if r and not r[0].startswith("==")]
    if len(rows) < 3:
        raise ValueError(f"expected a header, a unit row and a value row, got {len(rows)} rows")
    names, units, values = rows[0], rows[1], rows[2]
    out = {}
    for name, unit, value in zip(names, units, values):
        number = _number(value)
        if number is not None:
            out[name] = (number, unit)
    return out


def raw_rows(raw: dict[str, tuple[float, str]], metrics=RAW_METRICS) -> list[dict]:
    """The counters the chapter talks about (``metrics``: (row metric, ncu metric, unit)), the
    warps per scheduler, shared-load bank conflicts and the stall reasons, as result rows."""
    rows = []
    for metric, name, unit in metrics:
        if name in raw:
            value, ncu_unit = raw[name]
            rows.append({"metric": metric, "value": _scale(value, ncu_unit, unit), "unit": unit})
    if "sm__warps_active.avg.per_cycle_active" in raw:
        warps = raw["sm__warps_active.avg.per_cycle_active"][0]
        rows.append({"metric": "achieved_warps_per_scheduler",
                     "value": warps / SCHEDULERS_PER_SM, "unit": "warps"})
    conflicts = raw.get("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum")
    wavefronts = raw.get("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum")
    if conflicts and wavefronts and wavefronts[0] > 0:
        rows.append({"metric": "smem_load_bank_conflicts_pct",
                     "value": 100.0 * conflicts[0] / wavefronts[0], "unit": "%"})
    for name, (value, _) in sorted(raw.items()):
        if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX):
            reason = name[len(STALL_PREFIX):-len(STALL_SUFFIX)]
            rows.append({"metric": f"stall_{reason}", "value": value,
                         "unit": "cycles per issued instruction"})
    return rows


def _opcode(sass: str) -> str:
    """'@!P0 HMMA.16816.F32.BF16 R4, ...' -> 'HMMA.16816.F32.BF16'."""
    words = sass.strip().split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def parse_source_rows(text: str) -> list[dict]:
    """``ncu --page source --csv --print-source sass``: one dict per SASS instruction, in
    address order: address (an int, or None), sass (the instruction's text), opcode, samples
    (all warp-state samples at it), executed (warp-level executions) and stalls ({reason:
    samples} for the per-reason columns ncu exported: stall_wait, stall_short_sb, ...)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(lines))
    header_at = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    header = rows[header_at]
    src, addr = header.index("Source"), header.index("Address")
    samples = next(i for i, h in enumerate(header) if h.startswith("Warp Stall Sampling (All"))
    executed = header.index("Instructions Executed")
    reasons = {h[len("stall_"):]: i for i, h in enumerate(header)
               if h.startswith("stall_") and "(" not in h}
    out = []
    for r in rows[header_at + 1:]:
        if len(r) <= max([executed, *reasons.values()]):
            continue
        try:
            address = int(r[addr], 16)
        except ValueError:
            address = None
        out.append({"address": address, "sass": r[src].strip(), "opcode": _opcode(r[src]),
                    "samples": int(_number(r[samples]) or 0),
                    "executed": int(_number(r[executed]) or 0),
                    "stalls": {name: int(_number(r[i]) or 0) for name, i in reasons.items()}})
    return out


def parse_source(text: str) -> list[tuple]:
    """``ncu --page source --csv --print-source sass``: per SASS instruction, in address order,
    (opcode, samples, warp-level executions, {stall reason: samples}) with the per-reason
    columns ncu exported (stall_wait, stall_short_sb, ...; none in an export without them)."""
    return [(r["opcode"], r["samples"], r["executed"], r["stalls"])
            for r in parse_source_rows(text)]


def loop_phases(instructions: list[tuple]) -> list[dict]:
    """Split the KV loop by position in its SASS and count warp samples per part.

    The loop's instructions are those executed at least 1/16 as often as its most frequent
    mma.sync (the peeled first step and the prologue/epilogue run once per warp, the loop a few
    hundred times; QK^T's k-loop inside it runs twice per step, hence no tighter cut). In address
    order: loop head up to the first ldmatrix (waits, barrier, V's cp.async), S = QK^T up to
    the first max of the softmax (FMNMX), the softmax up to V's first ldmatrix.trans (LDSM.MT),
    O += PV up to the last mma.sync; what follows (the branch back) counts as loop head. ptxas
    moves a few instructions across these borders (the second barrier sits inside the softmax),
    so the split is by code position, not by source line."""
    hmma = [n for op, _, n, _ in instructions if op.startswith("HMMA")]
    if not hmma:
        raise ValueError("no HMMA in the SASS: is this chapter 04's kernel?")
    cutoff = max(hmma) // 16
    loop = [(i, op, s, n) for i, (op, s, n, _) in enumerate(instructions) if n >= cutoff]
    total = sum(s for _, s, _, _ in instructions)

    def first(pred, after=-1):
        return next(i for i, op, _, _ in loop if i > after and pred(op))

    qk = first(lambda op: op.startswith("LDSM") and ".MT" not in op)
    softmax = first(lambda op: op.startswith("FMNMX"), qk)
    pv = first(lambda op: op.startswith("LDSM") and ".MT" in op, softmax)
    pv_end = max(i for i, op, _, _ in loop if op.startswith("HMMA"))
    # Most loop instructions run once per warp per step: the most common count is the steps.
    steps = Counter(n for _, _, _, n in loop).most_common(1)[0][0]

    def phase(i):
        if qk <= i < softmax:
            return "qk"
        if softmax <= i < pv:
            return "softmax"
        if pv <= i <= pv_end:
            return "pv"
        return "loop_head"

    counts = dict.fromkeys(PHASES, 0)
    for i, _, s, _ in loop:
        counts[phase(i)] += s
    rows = [{"metric": f"warp_time_{p}_pct", "value": 100.0 * counts[p] / total, "unit": "%"}
            for p in PHASES]
    at_mma = sum(s for op, s, _, _ in instructions if op.startswith("HMMA"))
    rows.append({"metric": "warp_time_at_mma_sync_pct", "value": 100.0 * at_mma / total,
                 "unit": "%"})
    # Of the samples stalled for a reason, the share sitting at an mma.sync: "wait" there is the
    # fixed gap between two mma.sync of a warp, "short_sb" an mma.sync waiting for its ldmatrix.
    for reason in ("wait", "short_sb"):
        all_of_it = sum(st.get(reason, 0) for _, _, _, st in instructions)
        if all_of_it:
            at = sum(st.get(reason, 0) for op, _, _, st in instructions if op.startswith("HMMA"))
            rows.append({"metric": f"stall_{reason}_samples_at_mma_sync_pct",
                         "value": 100.0 * at / all_of_it, "unit": "%"})
    rows.append({"metric": "warp_time_outside_kv_loop_pct",
                 "value": 100.0 * (total - sum(counts.values())) / total, "unit": "%"})
    per_step = sum(n for _, _, _, n in loop) / steps
    mma_per_step = sum(n for _, op, _, n in loop if op.startswith("HMMA")) / steps
    rows += [
        {"metric": "mma_sync_per_warp_per_step", "value": mma_per_step, "unit": "instructions"},
        {"metric": "other_instructions_per_warp_per_step", "value": per_step - mma_per_step,
         "unit": "instructions"},
    ]
    return rows


def build_rows(raw_text: str, source_text: str, config_label: str) -> list[dict]:
    rows = raw_rows(parse_raw(raw_text)) + loop_phases(parse_source(source_text))
    return [{"impl": "flash_ampere", "config": config_label, **SHAPE, **r} for r in rows]


def format_profile(res, metrics, stalls: int = 6) -> list[str]:
    """A stored profile as lines: a head (tile, shape, the clock ncu held), the rows of
    ``metrics`` ((metric, what it is); rows the file lacks are skipped), then the ``stalls``
    largest stall reasons in cycles per issued instruction."""
    by_metric = {r["metric"]: r for r in res.rows}
    first = res.rows[0]
    head = (f"{first['config']} at D={first['d']}, S={first['s']}, "
            f"{'causal' if first['causal'] else 'non-causal'}")
    if "sm_clock_ghz" in by_metric:
        head += f"; SM clock held at {by_metric['sm_clock_ghz']['value']:.2f} GHz by ncu"
    lines = [head]
    for metric, what in metrics:
        if metric in by_metric:
            v = by_metric[metric]["value"]
            lines.append(f"  {what:58s} {v:8.2f}" if v % 1 else f"  {what:58s} {v:8.0f}")
    stall_rows = sorted((r for r in res.rows if r["metric"].startswith("stall_")
                         and r.get("unit") == "cycles per issued instruction"),
                        key=lambda r: -r["value"])
    if stall_rows and stalls:
        total = sum(r["value"] for r in stall_rows)
        lines.append(f"  cycles between two issues of a warp, by reason (sum {total:.2f}):")
        for r in stall_rows[:stalls]:
            lines.append(f"    {r['metric'][6:]:26s} {r['value']:5.2f}")
    return lines
