"""The stored side-by-sides of chapter 09 (and 12): our sm_100a kernels and FA4's own, compiled on
a CPU the same way (no GPU: fake tensors, ``CUTE_DSL_ARCH=sm_100a``).

    python -m measure.sm100_vs_fa4 --write          # the forward, both sides (FA4 importable)
    python -m measure.sm100_vs_fa4 --write --ours   # the forward, our rows; FA4's kept
    python -m measure.sm100_vs_fa4 --bwd --write [--ours]   # the backward

writes ``results/compile/sm100_fwd_vs_fa4.json`` and ``sm100_bwd_vs_fa4.json``: rows of (impl,
config, metric, value, unit) with the provenance of the compile (CuTe DSL version, FA4 version,
date, commit); the backward's rows carry the questions its large differences raise (impl "note").
``solutions.ch09_compare`` reads them (chapters 09, 10 and 12).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from solutions.ch09_compare import (
    BWD_CONFIGS,
    BWD_NAME,
    CONFIGS,
    DEFAULT_FA4_SITE,
    FA4_DRIVER_HEAD,
    FA4_FWD_DRIVER,
    FA4_VERSION,
    FOLDER,
    NAME,
    bwd_kernel_metrics,
    bwd_path,
    bwd_side_by_side,
    compile_fa4,
    compile_seconds,
    flatten,
    kernel_metrics,
    load_bwd_table,
    load_table,
    our_bwd_metrics,
    path,
    side_by_side,
)
from utils import results

PRODUCES = [
    (f"results/{FOLDER}/{NAME}.json", "python -m measure.sm100_vs_fa4 --write --ours",
     "our sm_100a forward and FA4's, compiled on a CPU: instruction classes (overall and per "
     "role), resources, TMEM columns and instruction descriptors, per configuration"),
    (f"results/{FOLDER}/{BWD_NAME}.json", "python -m measure.sm100_vs_fa4 --bwd --write --ours",
     "our sm_100a backward (1-CTA and the pair) and FA4's, compiled on a CPU: per-role "
     "instruction classes, register budgets, TMEM plan, shared memory, with the questions the "
     "differences raise"),
]


def our_metrics(d: int, causal: bool, two_cta: bool) -> dict:
    from fa4_final.blackwell.config import BlackwellFwdConfig, blackwell_fwd_default
    from solutions.ch09_teaching import compile_forward

    cfg = BlackwellFwdConfig(**{**blackwell_fwd_default(d, causal).__dict__, "two_cta": two_cta})
    art = compile_forward(d, causal, cfg)
    out = kernel_metrics(art.ptx, art.sass, art.registers, art.spills)
    out["shared memory bytes"] = cfg.smem_bytes(d)
    out["compile seconds"] = round(art.compile_seconds, 1)
    return out


def fa4_metrics(d: int, causal: bool, site=DEFAULT_FA4_SITE) -> dict:
    """Compile FA4's sm100 forward (bf16, 2 x 4096 x 16 heads, fake CUDA tensors) in a fresh
    process, with its PTX and cubin dumped, and read the same metrics."""
    ptx, sass, registers, spills, stdout = compile_fa4(
        FA4_FWD_DRIVER, "FlashAttentionForwardSm100", "sm_100a", 148, d, causal, site)
    metrics = kernel_metrics(ptx, sass, registers, spills)
    metrics["compile seconds"] = compile_seconds(stdout)
    return metrics


def provenance(command: str) -> dict:
    prov = results.collect_provenance(command)
    prov.update(gpu="none: compile-only for sm_100a on a CPU", driver="none",
                fa4_version=FA4_VERSION, mode="compile-only (fake tensors)")
    return prov


def build_rows(ours_only: bool, site=DEFAULT_FA4_SITE) -> list[dict]:
    rows = []
    stored = load_table().rows if ours_only and path().exists() else []
    for c in CONFIGS:
        rows += flatten("fa4_final", c["config"], our_metrics(c["d"], c["causal"], c["two_cta"]))
        if c["fa4"]:
            if ours_only:
                rows += [r for r in stored if r["impl"] == "fa4" and r["config"] == c["config"]]
            else:
                rows += flatten("fa4", c["config"], fa4_metrics(c["d"], c["causal"], site))
    return rows


def write(ours_only: bool = False, site=DEFAULT_FA4_SITE) -> Path:
    command = "python -m measure.sm100_vs_fa4 --write" + (" --ours" if ours_only else "")
    rows = build_rows(ours_only, site)
    prov = provenance(command)
    if ours_only and path().exists():  # FA4's side keeps the provenance it was compiled with
        old = load_table().provenance
        prov["fa4_rows_from"] = f"{old.get('commit', '?')[:10]} {old.get('date', '?')}"
    return results.save(NAME, rows, command, gpu=FOLDER, provenance=prov)


_FA4_BWD_DRIVER = FA4_DRIVER_HEAD + r'''
from flash_attn.cute.flash_bwd_sm100 import FlashAttentionBackwardSm100 as K
made = []
init = K.__init__
def record(self, *a, **kw):
    init(self, *a, **kw)
    made.append(self)
K.__init__ = record
with FakeTensorMode():
    b, s, h = 2, 4096, 16
    q, k, v, o, do = (torch.empty(b, s, h, d, dtype=torch.bfloat16, device="cuda")
                      for _ in range(5))
    lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
    t0 = time.time()
    try:
        interface._flash_attn_bwd(q, k, v, o, do, lse, causal=causal)
    except Exception as exc:  # fake tensors end the call after the compile
        print("call ended with", type(exc).__name__)
    print("compile seconds", round(time.time() - t0, 1))
x = made[-1]
regions = {n: (getattr(x, f"tmem_{n}_offset"), getattr(x, f"tmem_cols_{n}"))
           for n in ("S", "dP", "dV", "dK", "dQ", "P", "dS")}
roles = {"reduce": (x.reduce_warp_ids, x.num_regs_reduce),
         "compute": (x.compute_warp_ids, x.num_regs_compute),
         "mma": ((x.mma_warp_id,), x.num_regs_mma), "load": ((x.load_warp_id,), x.num_regs_load),
         "relay": ((x.relay_warp_id,), x.num_regs_mma if x.use_2cta_instrs else x.num_regs_empty),
         "empty": ((x.empty_warp_id,), x.num_regs_empty)}
print("FA4BWD " + json.dumps({
    "two_cta": bool(x.use_2cta_instrs), "smem": x.shared_storage.size_in_bytes(),
    "regions": regions, "roles": roles, "Q_stage": x.Q_stage, "dO_stage": x.dO_stage,
    "dQ_reduce_ncol": x.dQ_reduce_ncol, "sdQaccum_stage": x.sdQaccum_stage}))
'''


def fa4_bwd_metrics(d: int, causal: bool, two_cta: bool, site=DEFAULT_FA4_SITE) -> dict:
    """Compile FA4's sm100 backward (bf16, 2 x 4096 x 16 heads, fake CUDA tensors; its 1-CTA
    kernel under FA_DISABLE_2CTA=1) in a fresh process; the same metrics as ours, its role
    budgets, TMEM map and shared memory read off the kernel object it built."""
    ptx, sass, registers, spills, stdout = compile_fa4(
        _FA4_BWD_DRIVER, "FlashAttentionBackwardSm100", "sm_100a", 148, d, causal, site,
        FA_DISABLE_2CTA="0" if two_cta else "1")
    found = re.search(r"^FA4BWD (.*)$", stdout, re.M)
    if not found:
        raise RuntimeError("FA4's backward driver did not report its kernel object")
    info = json.loads(found.group(1))
    assert info["two_cta"] == two_cta, info
    metrics = bwd_kernel_metrics(ptx, sass, registers, spills,
                                 {role: regs for role, (_, regs) in info["roles"].items()})
    used = [(n, o, c) for n, (o, c) in info["regions"].items() if c]
    metrics.update({
        "shared memory bytes": info["smem"],
        "TMEM columns used": max(o + c for _, o, c in used),
        "TMEM regions": [f"{n} {o}+{c}" for n, o, c in used],
        "Q stages": info["Q_stage"],
        "dO stages": info["dO_stage"],
        "dQ staging (buffers x float32 columns)":
            f"{info['sdQaccum_stage']}x{info['dQ_reduce_ncol']}",
    })
    metrics["compile seconds"] = compile_seconds(stdout)
    return metrics


# Questions a large difference raises, stored with the rows (impl "note"): each names the
# metric it is about; {ours} and {fa4} are filled from the rows of its configuration.
BWD_NOTES = [
    ("d128 non-causal 1-CTA", "FFMA2",
     "FA4 computes P and dS with packed FP32 pairs (FFMA2 / FMUL2 / FADD2: {fa4} FFMA2), we with "
     "scalar FFMA / FMUL / FADD ({ours} FFMA2): the same lane operations in twice the "
     "compute-warp instructions. Does that bound a step? ch09_model.bwd_step_cycles says no "
     "(FP32 and issue stay well under the shared-memory time, model): packing would save "
     "issue slots, not the step's bound."),
    ("d128 non-causal 1-CTA", "UTC*MMA (tcgen05.mma)",
     "FA4's code holds {fa4} tcgen05.mma, ours {ours}: one step's five GEMMs are D/16 + D/16 + 3 x "
     "8 = 40 at D = 128 in both, but FA4 software-pipelines its MMA loop (flash_bwd_sm100.mma: a "
     "prologue issuing S^T, dP^T, dV of the first step, a loop issuing S^T(i+1) before dK(i) and "
     "dQ(i), a tail), so each GEMM appears twice. Ours issues a step's five in order: S^T(i+1) "
     "waits until dS(i) is in shared memory. Do the tensor cores idle while the compute warps "
     "turn dP^T into dS^T? ch09_model.bwd_step_cycles: the in-order chain is shorter than the "
     "shared-memory time at 1-CTA, so the order costs nothing while shared memory binds; in the "
     "2-CTA kernel (bwd_pair) it is the longest term (model)."),
    ("d128 non-causal 1-CTA", "compute: BAR (named barriers)",
     "FA4's compute warps pass {fa4} named barriers in code, ours {ours}: FA4 syncs its eight "
     "compute warps before P^T overwrites S^T columns that the other warpgroup may still be "
     "loading (its comment: 'P overwrites S lanes another warp may still be loading'). Ours "
     "stores P^T into the upper half of S^T, which the second warpgroup reads: it needs the "
     "same barrier, bar.sync COMPUTE before storing P^T. Without it ch09_pipeline's backward "
     "simulation reports the race (mutation no_compute_sync)."),
    ("d128 non-causal 1-CTA", "MUFU.EX2",
     "We have {ours} MUFU.EX2 against FA4's {fa4}: our compute step is instantiated twice (masked "
     "and unmasked loops, bwd_tiles' n_first/n_last split), FA4's once. Static code size, not "
     "per-step work: both take 64 exponentials per thread per step."),
    ("d128 non-causal 1-CTA", "UBLKRED (bulk reduction)",
     "dQ leaves as {ours} bulk adds in our code (two 8 KB halves per 32-column chunk, to keep the "
     "Hopper accumulator order that bwd_post reads) against FA4's {fa4} (one 16 KB add per chunk, "
     "its own order): the same bytes of global float32 adds, in twice the operations."),
    ("d128 non-causal 1-CTA", "registers: mma",
     "Our MMA warp gets {ours} registers (ptxas hoists its nine operand descriptors out of the "
     "step loop), FA4's {fa4}; FA4 gives more to its dQ warpgroup instead (registers: dQ). "
     "Which role's registers buy time is a question for a GPU."),
    ("d64 non-causal", "shared memory bytes",
     "At D = 64 we take {ours} B against FA4's {fa4}: our dO ring is two deep where it fits "
     "(BlackwellBwdConfig.do_depth), FA4's one. Worth it only if a step waits for dO."),
    ("d128 non-causal 2-CTA", "UBLKRED (bulk reduction)",
     "Each CTA of our pair issues {ours} bulk dQ adds per step against the 1-CTA kernel's 8: it "
     "adds only its 64 queries (the pair's dQ GEMM has already summed the 256 keys), in 8 KB "
     "blocks of the Hopper order; FA4's pair issues {fa4} (its 4 x 8-column staging). Half "
     "the global float32 adds per query tile: what the pair is for, with the shared-memory "
     "relief of the halved B operands (ch09_model.bwd_step_cycles, model)."),
    ("d128 non-causal 2-CTA", "UTC*MMA (tcgen05.mma)",
     "Our pair's code holds {ours} tcgen05.mma (cta_group::2), FA4's {fa4}: ours is one step of "
     "D/16 + D/16 + 8 + 8 + 16, the dQ GEMM running over the pair's 256 keys (K = 256, 64 "
     "queries per CTA); FA4's software-pipelined loop repeats GEMMs (prologue, loop, tail), how "
     "its count splits by GEMM was not traced here."),
    ("d128 non-causal 2-CTA", "spill instructions",
     "Our pair compiles with {ours} spill instructions, FA4's 2-CTA kernel with {fa4} (this DSL, "
     "its own register budgets). Neither has run on a GPU here."),
    ("d128 non-causal 2-CTA", "shared memory bytes",
     "{ours} B per CTA for our pair, {fa4} for FA4's: both read dK's A (dS^T) from TMEM to fit; "
     "ours keeps two 32-column dQ staging buffers and sends dS to the peer by st.async (no "
     "staging buffer for the exchange), FA4 stages dS and bulk-copies it to the peer."),
]


def bwd_notes(rows: list[dict]) -> list[dict]:
    val = {(r["impl"], r["config"], r["metric"]): r["value"] for r in rows}
    out = []
    for config, metric, text in BWD_NOTES:
        filled = text.format(ours=val.get(("fa4_final", config, metric), "-"),
                             fa4=val.get(("fa4", config, metric), "-"))
        out.append({"impl": "note", "config": config, "metric": metric, "value": filled,
                    "unit": "question"})
    return out


def build_bwd_rows(ours_only: bool, site=DEFAULT_FA4_SITE) -> list[dict]:
    rows = []
    stored = load_bwd_table().rows if ours_only and bwd_path().exists() else []
    for c in BWD_CONFIGS:
        if c["ours"]:
            rows += flatten("fa4_final", c["config"],
                            our_bwd_metrics(c["d"], c["causal"], two_cta=c["two_cta"]))
        if ours_only:
            rows += [r for r in stored if r["impl"] == "fa4" and r["config"] == c["config"]]
        else:
            rows += flatten("fa4", c["config"], fa4_bwd_metrics(c["d"], c["causal"],
                                                                c["two_cta"], site))
    return rows + bwd_notes(rows)


def write_bwd(ours_only: bool = False, site=DEFAULT_FA4_SITE) -> Path:
    command = "python -m measure.sm100_vs_fa4 --bwd --write" + (" --ours" if ours_only else "")
    rows = build_bwd_rows(ours_only, site)
    prov = provenance(command)
    if ours_only and bwd_path().exists():
        old = load_bwd_table().provenance
        prov["fa4_rows_from"] = f"{old.get('commit', '?')[:10]} {old.get('date', '?')}"
    return results.save(BWD_NAME, rows, command, gpu=FOLDER, provenance=prov)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--ours", action="store_true", help="regenerate our rows only")
    ap.add_argument("--bwd", action="store_true", help="the backward (sm100_bwd_vs_fa4)")
    ap.add_argument("--fa4-site", nargs="*", default=list(DEFAULT_FA4_SITE))
    args = ap.parse_args(argv)
    if args.bwd:
        if args.write:
            print(write_bwd(args.ours, tuple(args.fa4_site)))
        res = load_bwd_table()
        print(bwd_side_by_side(res))
        for note in res.where(impl="note"):
            print(f"\n{note['config']}, {note['metric']}: {note['value']}")
        return
    if args.write:
        print(write(args.ours, tuple(args.fa4_site)))
    print(side_by_side(load_table()))


if __name__ == "__main__":
    main()
