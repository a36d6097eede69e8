"""Where chapter 04's kernel spends its time: Nsight Compute on one launch, stored with provenance.

    python -m solutions.ch04_profile                      # GPU and ncu: profile, save the JSON
    python -m solutions.ch04_profile --raw-dir DIR        # ... and keep ncu's CSV exports in DIR
    python -m solutions.ch04_profile --from-raw DIR       # re-read DIR (any machine, no GPU)

The kernel is the one ``attention()`` launches at the chapter's target shape (D = 128, 16 heads
of 16384 queries and keys, bf16, non-causal). ncu replays that launch to read its counters and
samples the warps' program counters; from that it reports:

- the tensor pipe's active share, issue slots used, warps per scheduler (occupancy) and the
  limits that set it, shared-memory bank conflicts per shared load wavefront;
- the stall reasons, as cycles per issued instruction (ncu's Warp State table);
- how each warp's time splits between the parts of the KV loop, by where the sampled program
  counter sat in the loop's SASS: the loop head (waits, barrier, cp.async address arithmetic),
  S = QK^T, the softmax, O += PV; the share spent at an mma.sync (issuing it or waiting for
  its turn on the tensor pipe or for its operands); and the instructions a warp issues per KV
  step.

ncu locks the SM clock to its base (1.38 GHz on the H200) while it measures, so the figures are
shares and ratios; speeds come from the benchmarks. Saved as results/<gpu>/ch04_profile.json
(rows: impl, metric, value, unit).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

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
}


def _scale(value: float, unit: str, want: str) -> float:
    """``value`` in ncu's ``unit``, converted to ``want`` (GHz or ms; counts such as registers,
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


def raw_rows(raw: dict[str, tuple[float, str]]) -> list[dict]:
    """The counters the chapter talks about, as result rows."""
    rows = []
    for metric, name, unit in RAW_METRICS:
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


def parse_source(text: str) -> list[tuple]:
    """``ncu --page source --csv --print-source sass``: per SASS instruction, in address order,
    (opcode, samples, warp-level executions, {stall reason: samples}) with the per-reason
    columns ncu exported (stall_wait, stall_short_sb, ...; none in an export without them)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(lines))
    header_at = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    header = rows[header_at]
    src = header.index("Source")
    samples = next(i for i, h in enumerate(header) if h.startswith("Warp Stall Sampling (All"))
    executed = header.index("Instructions Executed")
    reasons = {h[len("stall_"):]: i for i, h in enumerate(header)
               if h.startswith("stall_") and "(" not in h}
    return [(_opcode(r[src]), int(_number(r[samples]) or 0), int(_number(r[executed]) or 0),
             {name: int(_number(r[i]) or 0) for name, i in reasons.items()})
            for r in rows[header_at + 1:] if len(r) > max([executed, *reasons.values()])]


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


# ----------------------------------------------------------------------------------------------
# On the GPU


def _target() -> None:
    """The profiled process: compile, then launch the default kernel a second time (ncu skips
    the first launch, which includes nothing but is the warm-up)."""
    import torch

    from solutions import ch04_flash_ampere as fa
    from utils.reference import random_qkv

    q, k, v, _ = random_qkv(SHAPE["b"], SHAPE["s"], SHAPE["h"], SHAPE["d"], device="cuda")
    for _ in range(2):
        fa.attention(q, k, v, SHAPE["causal"])
    torch.cuda.synchronize()


def profile(raw_dir: Path | None = None) -> Path:
    """Run ncu on this GPU; save and return results/<gpu>/ch04_profile.json."""
    from solutions import ch04_flash_ampere as fa
    from utils import results
    from utils.hardware import device_arch

    ncu = shutil.which("ncu")
    if ncu is None:
        raise RuntimeError("ncu (Nsight Compute) is not on PATH; it comes with the CUDA toolkit")
    config = fa.default_config(SHAPE["d"], SHAPE["causal"], device_arch("cuda"), "bf16")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "ch04"
        cmd = [ncu, "--launch-skip", "1", "--launch-count", "1", "-k", KERNEL_REGEX,
               "--import-source", "no", "-f", "-o", str(report)]
        for s in SECTIONS:
            cmd += ["--section", s]
        cmd += ["--metrics", ",".join(EXTRA_METRICS), sys.executable, "-m",
                "solutions.ch04_profile", "--target"]
        subprocess.run(cmd, check=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        rep = f"{report}.ncu-rep"
        raw = subprocess.run([ncu, "-i", rep, "--page", "raw", "--csv"], check=True,
                             capture_output=True, text=True, timeout=300).stdout
        source = subprocess.run([ncu, "-i", rep, "--page", "source", "--csv", "--print-source",
                                 "sass"], check=True, capture_output=True, text=True,
                                timeout=300).stdout
    command = "python -m solutions.ch04_profile"
    provenance = results.collect_provenance(command)
    label = fa.config_label(config)
    if raw_dir is not None:
        raw_dir.mkdir(parents=True, exist_ok=True)
        (raw_dir / "raw.csv").write_text(raw)
        (raw_dir / "source.csv").write_text(source)
        (raw_dir / "meta.json").write_text(json.dumps({"provenance": provenance,
                                                        "config": label}, indent=1))
    return results.save(RESULTS, build_rows(raw, source, label), command=command,
                        provenance=provenance)


def from_raw(raw_dir: Path) -> Path:
    """Rebuild the results file from ncu exports kept by ``--raw-dir`` (with their provenance)."""
    from utils import results

    meta = json.loads((raw_dir / "meta.json").read_text())
    rows = build_rows((raw_dir / "raw.csv").read_text(), (raw_dir / "source.csv").read_text(),
                      meta["config"])
    provenance = dict(meta["provenance"])  # where and when it was measured: unchanged
    provenance["command"] += (f" (rows re-read from its CSV exports with --from-raw at commit "
                              f"{results.collect_provenance('')['commit'][:10]})")
    return results.save(RESULTS, rows, command=provenance["command"], provenance=provenance)


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--raw-dir", type=Path, help="also keep ncu's CSV exports here")
    ap.add_argument("--from-raw", type=Path, help="rebuild the JSON from a --raw-dir folder")
    args = ap.parse_args(argv)
    if args.target:
        _target()
        return 0
    path = from_raw(args.from_raw) if args.from_raw else profile(args.raw_dir)
    from utils import results

    print(results.load(RESULTS).table(["metric", "value", "unit"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
