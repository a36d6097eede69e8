"""How tests/data/ch05_profile_raw/ and tests/data/fa4_final_profile_raw/ were made: stand-ins for
ncu's exports of chapter 05's kernel and of fa4_final's Hopper forward, so the profile's parser is
tested on the real shape of the problem before a real profile exists.

The SASS is each kernel's own (compiled here for sm_90a, no GPU); every count and sample in the
files is invented, with the kernel's structure: CTAs of 12 warps, one producer warp and 8
consumer warps per CTA, 128 KV tiles per query tile, so a KV loop body runs 127 times per warp
and tile. Chapter 05 launches 2048 CTAs of one tile each; fa4_final 132 persistent CTAs of 16
tiles each, so its per-tile code runs 16 times per warp. Only the innermost loops count as KV
loops (fa4_final's persistent tile loops hold them). Samples are weighted by kind of instruction
(heavy at the waits). Nothing here is a measurement.

    PYTHONPATH=. python tests/data/make_ch05_profile_fixture.py             # ch05_profile_raw/
    PYTHONPATH=. python tests/data/make_ch05_profile_fixture.py fa4_final   # fa4_final_..._raw/
"""

import json
import re
import sys
from pathlib import Path

BASE = 0x7F3A12000000  # ncu prints absolute addresses; branch targets too
TURNS = 128
STALLS = ("selected", "wait", "long_sb", "barrier", "math", "dispatch", "warpgroup_arrive")


def instructions(sass: str):
    """(offset, text) per instruction, with nvdisasm's labels turned into absolute targets."""
    labels, pending, out = {}, [], []
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            off = int(m.group(1), 16)
            for label in pending:
                labels[label] = off
            pending = []
            out.append((off, m.group(2).strip()))
    fixed = []
    for off, text in out:
        text = re.sub(r"`\((\.L_x_\d+)\)",
                      lambda m: hex(BASE + labels[m.group(1)]) if m.group(1) in labels else "0x0",
                      text)
        fixed.append((off, text))
    return fixed


def weights(op: str, in_loop: bool, role: str):
    """(samples, {stall reason: samples}) invented for one instruction."""
    if role == "producer":
        if "PHASECHK" in op:
            return 300 if in_loop else 40, {"long_sb": 280 if in_loop else 36,
                                            "selected": 20 if in_loop else 4}
        return (3, {"selected": 2, "wait": 1}) if in_loop else (1, {"selected": 1})
    if role != "consumer" or not in_loop:
        return 1, {"selected": 1}
    if "DEPBAR.LE gsb0, 0x1" in op:
        return 900, {"warpgroup_arrive": 850, "selected": 50}
    if "DEPBAR.LE gsb0, 0x0" in op:
        return 500, {"warpgroup_arrive": 470, "selected": 30}
    if "PHASECHK" in op:
        return 120, {"long_sb": 110, "selected": 10}
    if op.startswith("HGMMA"):
        return 12, {"dispatch": 4, "selected": 8}
    if op.startswith("MUFU"):
        return 14, {"math": 8, "selected": 6}
    if op.startswith(("FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "FSEL")):
        return 6, {"wait": 2, "selected": 4}
    return 3, {"wait": 1, "selected": 2}


def compiled(impl: str):
    """(SASS, CTAs, tiles per CTA, ncu's kernel name, config label) of one kernel at D = 128."""
    if impl == "fa4_final":
        from fa4_final.api import interface
        from solutions import ch08_profile

        return (interface.compile_only("sm_90a", head_dim=128).sass, 132, 16,
                "kernel_cutlass_kernel_fa4_finalhopperfwdHopperForward",
                ch08_profile.config_label(ch08_profile.default_config()))
    from solutions import ch05_flash_hopper as ch05

    return (ch05.compile_only("sm_90a", head_dim=128).sass, 2048, 1,
            "kernel_cutlass_kernel_solutionsch05_flash_hopperFlashAttentionHopper",
            "128x128 wg2 s2 overlap")


def main(impl: str = "flash_hopper") -> None:
    sass, ctas, tiles, kernel_name, label = compiled(impl)
    here = Path(__file__).parent / ("fa4_final_profile_raw" if impl == "fa4_final"
                                    else "ch05_profile_raw")
    here.mkdir(exist_ok=True)
    ins = instructions(sass)
    ops = [t.split()[1] if t.startswith("@") else t.split()[0] for _, t in ins]
    producer = next(i for i, o in enumerate(ops) if o.startswith("USETMAXREG") and "DEALLOC" in o)
    consumer = next(i for i, o in enumerate(ops) if o.startswith("USETMAXREG")
                    and "DEALLOC" not in o)
    last_exit = max(i for i, o in enumerate(ops) if o == "EXIT")
    index = {BASE + off: i for i, (off, _) in enumerate(ins)}
    loops = []  # back edges in the main code: [target, branch]
    for i, (_, text) in enumerate(ins[:last_exit + 1]):
        m = re.search(r"BRA\s+(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) in index and index[int(m.group(1), 16)] < i:
            a = index[int(m.group(1), 16)]
            body = [t for _, t in ins[a:i + 1]]
            # the two KV loops: the producer's (TMA loads) and the consumers' (wait_group 1);
            # not the setmaxnreg retry loop
            if any("UTMALDG" in t for t in body) or any("gsb0, 0x1" in t for t in body):
                loops.append((a, i))
    loops = [(a, b) for a, b in loops  # innermost only: not a persistent loop around a KV loop
             if not any((a, b) != (c, d) and a <= c and d <= b for c, d in loops)]
    rows = []
    for i, (off, text) in enumerate(ins):
        role = ("setup" if i < min(producer, consumer) else
                "producer" if producer <= i < consumer else
                "consumer" if i <= last_exit else "retry")
        in_loop = any(a <= i <= b for a, b in loops)
        warps = {"setup": 12, "producer": 1, "consumer": 8, "retry": 1}[role]
        if role == "producer" and i < producer + 2:
            warps = 4  # all four producer warps give registers away; three then exit
        per_cta = 1 if role == "setup" else tiles
        executed = ctas * warps * per_cta * ((TURNS - 1) if in_loop else 1)
        if role == "retry":
            executed = ctas * tiles // 4
        samples, stalls = weights(text, in_loop, role)
        rows.append((BASE + off, text, samples, executed, stalls))
    head = ['"Address"', '"Source"', '"Warp Stall Sampling (All Samples)"',
            '"Warp Stall Sampling (Not-issued Samples)"', '"# Samples"',
            '"Instructions Executed"'] + [f'"stall_{s}"' for s in STALLS]
    lines = [f'"Kernel Name","{kernel_name}"',
             ",".join(head)]
    for addr, text, samples, executed, stalls in rows:
        cells = [hex(addr), text, samples, samples - stalls.get("selected", 0), samples,
                 executed] + [stalls.get(s, 0) for s in STALLS]
        lines.append(",".join(f'"{c}"' for c in cells))
    (here / "source.csv").write_text("\n".join(lines) + "\n")
    metrics = [
        ("gpu__time_duration.sum", "msecond", "4.21"),
        ("gpc__cycles_elapsed.avg.per_second", "cycle/nsecond", "1.38"),
        ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "%", "71.4"),
        ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "%", "71.2"),
        ("sm__inst_executed_pipe_tensor_op_gmma.sum", "inst", "8,388,608"),
        ("sm__issue_active.avg.pct_of_peak_sustained_elapsed", "%", "27.9"),
        ("launch__registers_per_thread", "register/thread", "168"),
        ("launch__occupancy_limit_registers", "block", "1"),
        ("launch__occupancy_limit_shared_mem", "block", "1"),
        ("sm__warps_active.avg.per_cycle_active", "warp", "8.9"),
        ("smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio", "", "1.31"),
        ("smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio", "", "0.92"),
        ("smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", "", "0.08"),
        ("smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", "", "0.44"),
        ("smsp__average_warps_issue_stalled_selected_per_issue_active.ratio", "", "1.00"),
        ("smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio", "",
         "0.37"),
        ("smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio", "", "0.12"),
    ]
    raw = [",".join(['"ID"', '"Kernel Name"'] + [f'"{m}"' for m, _, _ in metrics]),
           ",".join(['""', '""'] + [f'"{u}"' for _, u, _ in metrics]),
           ",".join(['"0"', '"kernel"'] + [f'"{v}"' for _, _, v in metrics])]
    (here / "raw.csv").write_text("\n".join(raw) + "\n")
    prov = {"gpu": "none (a hand-made fixture)", "driver": "none", "cuda": "none",
            "torch": "none", "cutlass_dsl": "4.8.1", "commit": "fixture", "date": "fixture",
            "command": f"python tests/data/make_ch05_profile_fixture.py "
                       f"{'fa4_final' if impl == 'fa4_final' else ''}".strip()}
    (here / "meta.json").write_text(json.dumps({"provenance": prov, "config": label}, indent=1)
                                    + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
