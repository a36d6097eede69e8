"""Chapter 08: our sm_90a forward and FA4's own, compiled the same way, side by side per KV step.

Neither kernel runs here; both compile on a CPU (fake tensors, ``CUTE_DSL_ARCH=sm_90a``). The
whole-kernel counts of chapter 09's table (solutions.ch09_compare) say little on Hopper, where
both kernels hold several copies of the step (first tile, masked tiles, last P V); what decides
the speed is the body of the steady KV loop, which every consumer warpgroup runs once per KV
tile. This module finds that body in the SASS (the innermost loop that holds both HGMMA and
MUFU.EX2), counts its instructions by class, and writes the order in which the step's waits,
barriers, GEMMs and softmax phases come, because on Hopper the order is the schedule:

- ``exps under P V``: MUFU.EX2 between the warpgroup's two WARPGROUP.DEPBAR (wait for S, then
  wait for P V). Those exponentials run while this warpgroup's P V is still on the tensor
  cores; the rest wait for it. With ping-pong at D = 128 a warpgroup has P V (512 tensor
  cycles) plus the other warpgroup's two GEMMs (1024) to do its softmax in: waiting for P V
  before the exponentials leaves it 1024.
- ``ALU between turn and issue``: instructions between BAR.SYNC (the turn begins) and the last
  HGMMA of the step: work that delays the GEMMs once the tensor cores are this warpgroup's.

``python -m measure.fwd_sass_vs_fa4 --write`` (both sides; ``--ours``: our rows only, FA4's kept
from the file) writes ``results/compile/sm90_fwd_vs_fa4.json`` (rows of impl, config, metric,
value, unit); ``load_table`` and ``side_by_side`` read it.
Counts are static: each loop body once, so they compare code shapes, not run time.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from solutions.ch09_compare import (
    sass_opcodes,
    setmaxnreg_values,
)
from utils import results

NAME = "sm90_fwd_vs_fa4"
FOLDER = "compile"
SMS = 132  # H100 / H200
# FA4's own sm90 choice (interface._tile_size_fwd_sm90): (tile_m, tile_n, consumer warpgroups)
FA4_TILES = {64: (192, 128, 3), 128: (128, 128, 2)}
CONFIGS = [(d, causal) for d in (64, 128) for causal in (False, True)]

# classes counted in a step: (label, regex on the opcode with its modifiers)
STEP_CLASSES = [
    ("HGMMA", r"^HGMMA"),
    ("FFMA", r"^FFMA"),
    ("FMUL", r"^FMUL"),
    ("FADD", r"^FADD"),
    ("FMNMX", r"^FMNMX"),
    ("MUFU.EX2", r"^MUFU\.EX2"),
    ("F2FP (fp32 -> 16-bit pairs)", r"^F2FP"),
    ("F2F (single conversions)", r"^F2F\b|^F2F\."),
    ("SHFL", r"^SHFL"),
    ("FSEL", r"^FSEL"),
    ("ISETP/FSETP", r"^(I|F)SETP"),
    ("BAR.SYNC", r"^BAR\.SYNC"),
    ("BAR.ARV", r"^BAR\.ARV"),
    ("WARPGROUP.ARRIVE", r"^WARPGROUP\.ARRIVE"),
    ("WARPGROUP.DEPBAR", r"^WARPGROUP\.DEPBAR"),
    ("SYNCS (mbarrier)", r"^SYNCS"),
    ("uniform (U*)", r"^U(?!TM)"),
    ("integer (IMAD/IADD3/LOP3/SHF/LEA/MOV)", r"^(IMAD|IADD3|LOP3|SHF|LEA|MOV|VIADD)\b"),
    ("LDL/STL (spills)", r"^(LDL|STL)\b"),
]
# the ops the order string shows; runs of one op are written opx<n>
ORDER_OPS = ("HGMMA", "MUFU.EX2", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "BAR.SYNC", "BAR.ARV",
             "SYNCS", "SHFL", "F2FP", "FMUL", "FMNMX", "FFMA", "FADD", "FSEL")
_INSTR = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def _instructions(lines: list[str]) -> list[tuple[bool, str]]:
    """(predicated, opcode) of each instruction line."""
    out = []
    for line in lines:
        m = _INSTR.match(line)
        if m:
            out.append((m.group(1) is not None, m.group(2)))
    return out


def kv_loops(sass: str) -> list[list[str]]:
    """Bodies (SASS lines, label to back-branch) of the KV loops: backward branches whose span
    holds HGMMA and MUFU.EX2, without the out-of-line retry blocks of mbarrier waits (they
    branch back into the middle of a body) and without the loops around them (tiles)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    spans = []
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\b[^;]*?`?\(?\.(L_x_\d+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            ops = [op for _, op in _instructions(lines[labels[m.group(1)]:i + 1])]
            if any(op.startswith("HGMMA") for op in ops) and any(
                    op.startswith("MUFU.EX2") for op in ops):
                spans.append((labels[m.group(1)], i))
    spans = [(a, b) for a, b in spans
             if not any(a2 < a <= b2 < b for a2, b2 in spans)]  # retry edges into a body
    spans = [(a, b) for a, b in spans
             if not any(a <= a2 and b2 <= b and (a2, b2) != (a, b) for a2, b2 in spans)]
    return [lines[a:b + 1] for a, b in sorted(set(spans))]


def by_mask(loops: list[list[str]]) -> list[list[str]]:
    """KV loops, the steady one first: the loop with the fewest predicated selects (FSEL);
    causal kernels also have the masked loop over the diagonal tiles, last."""
    return sorted(loops, key=lambda b: step_metrics(b)["counts"]["FSEL"])


def steady_loop(sass: str) -> list[str]:
    """The body of the steady KV loop (see ``by_mask``)."""
    return by_mask(kv_loops(sass))[0]


def thread_index_reads(sass: str) -> int:
    """How many reads of the thread index (S2R SR_TID) the KV loops hold: Note [Signalling
    lane] in fa4_final.hopper.fwd (LLVM re-reads it there every step unless it is pinned)."""
    return sum(1 for body in kv_loops(sass) for line in body
               if "S2R" in line and "SR_TID" in line)


def exponentials_wait_for_vote(sass: str) -> bool:
    """Whether, in the steady KV loop, an instruction before the first exponential reads the
    predicate a warp vote (VOTE.ANY) wrote: Note [Warp vote] in fa4_final.common.softmax. With
    tau > 0 alone the vote selects the maxima the exponentials subtract; with skip_unchanged it only
    gates O's multiply (ptxas may still place the vote early, which costs nothing)."""
    body = steady_loop(sass)
    first_exp = next(i for i, line in enumerate(body) if "MUFU.EX2" in line)
    voted = None
    for line in body[:first_exp]:
        m = re.search(r"VOTE\.ANY\s+(P\d)", line)
        if m:
            voted = m.group(1)
        elif voted and re.search(rf"\b{voted}\b\s*;", line):
            return True
    return False


def o_multiply_placement(sass: str) -> dict[str, int]:
    """Where the steady KV step's FMULs sit around its two GEMM issues: before the turn
    (BAR.SYNC), from the turn to the last HGMMA of the first group (S = Q K^T of the next
    tile), between that and the second group's WARPGROUP.ARRIVE (P V into O), and elsewhere.
    O's rescale is the bulk of them (issued at the next P V: it must land before P V adds to O)."""
    ops = [op for _, op in _instructions(steady_loop(sass))]
    turn = next((i for i, op in enumerate(ops) if op.startswith("BAR.SYNC")), 0)
    arrives = [i for i, op in enumerate(ops) if op.startswith("WARPGROUP.ARRIVE")]
    first = [i for i, op in enumerate(ops[:arrives[1]]) if op.startswith("HGMMA")]
    out = {"before the turn": 0, "with S's issue": 0, "between S's and P V's issue": 0,
           "elsewhere": 0, "first GEMM's HGMMA": len(first)}
    for i, op in enumerate(ops):
        if not op.startswith("FMUL"):
            continue
        key = ("before the turn" if i < turn else "with S's issue" if i < first[-1]
               else "between S's and P V's issue" if i < arrives[1] else "elsewhere")
        out[key] += 1
    return out


def order(ops: list[str]) -> str:
    """The step's key ops in program order, runs compressed: 'HGMMAx8 BAR.ARV ...'."""
    keys = []
    for op in ops:
        key = next((k for k in reversed(ORDER_OPS) if op.startswith(k)), None)
        if key:
            keys.append(key)
    runs = []
    for k in keys:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return " ".join(k if n == 1 else f"{k}x{n}" for k, n in runs)


def step_metrics(body: list[str]) -> dict:
    """Counts of one loop body (one KV step of one consumer warpgroup) and its schedule."""
    instrs = _instructions(body)
    ops = [op for _, op in instrs]
    counts = {label: sum(1 for op in ops if re.match(rx, op)) for label, rx in STEP_CLASSES}
    counts["predicated (@P)"] = sum(1 for pred, _ in instrs if pred)
    counts["instructions"] = len(ops)
    waits = [i for i, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR")]
    exps = [i for i, op in enumerate(ops) if op.startswith("MUFU.EX2")]
    turn = next((i for i, op in enumerate(ops) if op.startswith("BAR.SYNC")), None)
    gemms = [i for i, op in enumerate(ops) if op.startswith("HGMMA")]
    sched = {
        "exps under P V": (sum(1 for e in exps if waits[0] < e < waits[1])
                           if len(waits) >= 2 else None),
        "exps after the P V wait": (sum(1 for e in exps if e > waits[1])
                                    if len(waits) >= 2 else None),
        "ALU between turn and issue": (sum(1 for op in ops[turn + 1:gemms[-1]]
                                           if not op.startswith(("HGMMA", "WARPGROUP")))
                                       if turn is not None and gemms and turn < gemms[-1]
                                       else None),
        "order": order(ops),
    }
    return {"counts": counts, "schedule": sched}


def kernel_metrics(ptx: str, sass: str, registers: int, spills: int, tile_m: int,
                   tile_n: int) -> dict:
    regs = setmaxnreg_values(ptx)
    threads = re.search(r"\.reqntid\s+(\d+)", ptx) or re.search(r"\.maxntid\s+(\d+)", ptx)
    n_threads = int(threads.group(1)) if threads else None
    out = {
        "registers (launch)": registers,
        "spill instructions": spills,
        "setmaxnreg inc (consumers)": regs["inc"],
        "setmaxnreg dec (producer)": regs["dec"],
        "threads per CTA": n_threads,
        "consumer warpgroups": n_threads // 128 - 1 if n_threads else None,
        "tile (m x n)": f"{tile_m}x{tile_n}",
        "kernel HGMMA": sum(1 for op in sass_opcodes(sass) if op.startswith("HGMMA")),
        "kernel MUFU.EX2": sum(1 for op in sass_opcodes(sass) if op.startswith("MUFU.EX2")),
    }
    loops = kv_loops(sass)
    out["KV loops"] = len(loops)
    if loops:
        ordered = by_mask(loops)
        steady = step_metrics(ordered[0])
        out["steady step"] = steady["counts"]
        out["steady step schedule"] = steady["schedule"]
        if len(loops) > 1:
            masked = step_metrics(ordered[-1])
            out["masked step"] = masked["counts"]
            out["masked step schedule"] = masked["schedule"]
    return out


def our_metrics(d: int, causal: bool, config=None) -> dict:
    from fa4_final.api.interface import compile_only
    from fa4_final.hopper.config import hopper_fwd_default

    cfg = config or hopper_fwd_default(d, causal)
    art = compile_only("sm_90a", d, "bf16", causal, cfg)
    out = kernel_metrics(art.ptx, art.sass, art.registers, art.spills, cfg.tile_m, cfg.tile_n)
    out["stages (K, V)"] = f"{cfg.stages_k}, {cfg.stages_v}"
    return out


def config_name(d: int, causal: bool) -> str:
    return f"d{d} {'causal' if causal else 'non-causal'}"


def path() -> Path:
    return results.RESULTS_DIR / FOLDER / f"{NAME}.json"


def load_table() -> results.Results:
    return results.load(NAME, gpu=FOLDER)


SUMMARY = ["instructions", "HGMMA", "FFMA", "FMUL", "FADD", "FMNMX", "MUFU.EX2",
           "F2FP (fp32 -> 16-bit pairs)", "SHFL", "FSEL", "BAR.SYNC", "BAR.ARV",
           "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "SYNCS (mbarrier)", "uniform (U*)",
           "integer (IMAD/IADD3/LOP3/SHF/LEA/MOV)", "predicated (@P)"]


def side_by_side(res: results.Results, impls=("fa4_final", "fa4")) -> str:
    """Steady-step counts, ours / FA4's, one column per configuration."""
    names = [config_name(d, c) for d, c in CONFIGS]

    def get(impl, config, metric):
        rows = res.where(impl=impl, config=config, metric=metric)
        return rows[0]["value"] if rows else "-"

    lines = [f"{'steady step (per warpgroup)':34s}" + "".join(f"{n:>22s}" for n in names)]
    metrics = ([f"steady step: {m}" for m in SUMMARY]
               + ["steady step schedule: exps under P V", "steady step schedule: "
                  "ALU between turn and issue", "registers (launch)", "setmaxnreg inc "
                  "(consumers)", "spill instructions", "tile (m x n)", "consumer warpgroups",
                  "stages (K, V)", "masked step: instructions", "masked step: FSEL"])
    for m in metrics:
        cells = [" / ".join(_short(get(i, n, m)) for i in impls) for n in names]
        lines.append(f"{m.split(': ')[-1][:34]:34s}" + "".join(f"{c:>22s}" for c in cells))
    return "\n".join(lines)


def _short(v) -> str:
    if isinstance(v, list):
        return "+".join(f"{n}x{x}" if n > 1 else str(x) for x, n in Counter(v).items())
    return str(v)
