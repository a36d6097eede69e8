"""Where the deterministic backward loses its time: Nsight Compute on one launch of fa4_final's
Hopper backward main kernel, once as a plain call and once with ``deterministic=True``.

    python -m measure.profile_bwd_det                   # GPU and ncu: profile both, save the JSON
    python -m measure.profile_bwd_det --raw-dir DIR     # ... and keep ncu's CSV exports in DIR
    python -m measure.profile_bwd_det --from-raw DIR    # re-read DIR (any machine, no GPU)

The shape is the one where the deterministic backward trails most in results/h100/
bwd_phases_det_d128b.json (b = 4, S = 4096, 16 heads, D = 128, bf16, not causal: its main
kernel 1.27x the plain one's). Each variant's profiled process runs forward and backward twice;
ncu skips the first main kernel (it compiles) and measures the second.

Rows (``impl`` fa4_final or fa4_final_deterministic): the counters of chapter 04's reading
(duration at ncu's locked clock, issue slots busy, registers, warps, the stall reasons as cycles
per issued instruction), the tensor pipe's busy share as wgmma drives it, and from the sampled
SASS: each stall reason's share of all warp samples (``samples_<reason>_pct``), the share of
samples at the loads that wait for the dQ turn (``turn_wait_samples_pct``: the acquire loads of
``fa4_final.common.atomics.wait_turn``, ``LD``/``LDG`` with ``STRONG.GPU``, and the
``CCTL.IVALL`` each compiles to) and at the dQ
accumulator's reductions (``dq_update_samples_pct``: ``RED``, ``ATOM`` and the bulk
``UBLKRED`` of the dQ tile), and the five instructions with the most
samples (``top<i>_samples_pct``, the instruction's text in ``sass``).

ncu locks the SM clock while it measures, so durations are comparable between the two rows of
one file, not with the benchmarks'. Saved as results/<gpu>/bwd_det_profile.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from measure import _ncu as ncu
from measure._ncu import ProfileSpec, run_ncu
from solutions import ch04_profile as core

RESULTS = "bwd_det_profile"
SHAPE = {"b": 4, "s": 4096, "h": 16, "d": 128, "causal": False}
KERNEL_REGEX = "regex:HopperBackward"
VARIANTS = {"plain": "fa4_final", "det": "fa4_final_deterministic"}
SECTIONS = (*core.SECTIONS, "SchedulerStats", "MemoryWorkloadAnalysis")
EXTRA_METRICS = (
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sectors_op_red.sum",
    "lts__t_sectors_op_atom.sum",
)
RAW_METRICS = (
    *core.RAW_METRICS,
    ("gmma_pipe_active_pct",
     "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "%"),
    ("dram_throughput_pct", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%"),
)
PRODUCES = [(f"results/h100/{RESULTS}.json", "python -m measure.profile_bwd_det --raw-dir DIR",
             "Nsight Compute on one launch of fa4_final's backward main kernel, plain and "
             "deterministic: stalls, the samples at the dQ turn's wait")]


def _is_turn_wait(opcode: str) -> bool:
    """The acquire load of the turn counter and the L1 invalidate it compiles to beside it."""
    return (opcode.split(".")[0] in ("LD", "LDG") and "STRONG.GPU" in opcode
            or opcode.startswith("CCTL.IVALL"))


def _is_dq_update(opcode: str) -> bool:
    return opcode.split(".")[0] in ("RED", "REDG", "ATOM", "ATOMG", "UBLKRED")


def source_rows(records: list[dict], top: int = 5) -> list[dict]:
    """Rows from the SASS source export: stall shares, the turn wait's and the dQ update's
    shares of all samples, the ``top`` instructions by samples."""
    total = sum(r["samples"] for r in records) or 1
    rows = []
    reasons = sorted({k for r in records for k in r["stalls"]})
    for reason in reasons:
        rows.append({"metric": f"samples_{reason}_pct", "unit": "%",
                     "value": 100.0 * sum(r["stalls"].get(reason, 0) for r in records) / total})
    rows.append({"metric": "turn_wait_samples_pct", "unit": "%",
                 "value": 100.0 * sum(r["samples"] for r in records
                                      if _is_turn_wait(r["opcode"])) / total})
    rows.append({"metric": "dq_update_samples_pct", "unit": "%",
                 "value": 100.0 * sum(r["samples"] for r in records
                                      if _is_dq_update(r["opcode"])) / total})
    ranked = sorted(records, key=lambda r: -r["samples"])[:top]
    for i, r in enumerate(ranked):
        stall = max(r["stalls"], key=r["stalls"].get) if r["stalls"] else ""
        rows.append({"metric": f"top{i + 1}_samples_pct", "unit": "%",
                     "value": 100.0 * r["samples"] / total, "sass": r["sass"][:120],
                     "stall": stall})
    return rows


def build_rows(raw_text: str, source_text: str, impl: str) -> list[dict]:
    rows = (core.raw_rows(core.parse_raw(raw_text), RAW_METRICS)
            + source_rows(core.parse_source_rows(source_text)))
    return [{"impl": impl, **SHAPE, **r} for r in rows]


def _run_target(variant: str) -> None:
    import torch

    import fa4_final
    from utils.reference import random_qkv

    q, k, v, _ = random_qkv(SHAPE["b"], SHAPE["s"], SHAPE["h"], SHAPE["d"], device="cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fa4_final.flash_attn_func(q, k, v, causal=SHAPE["causal"],
                                    deterministic=variant == "det")
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.randn_like(out)
    for _ in range(2):
        torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    torch.cuda.synchronize()


def _save(rows: list[dict], command: str, provenance: dict) -> Path:
    from utils import results

    return results.save(RESULTS, rows, command=command, provenance=provenance)


def main(argv=None) -> int:
    from utils import results

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--raw-dir", type=Path, help="also keep ncu's CSV exports here")
    ap.add_argument("--from-raw", type=Path, help="rebuild the JSON from a --raw-dir folder")
    args = ap.parse_args(argv)
    if args.target:
        _run_target(args.target)
        return 0
    if args.from_raw:
        meta = ncu.read_meta(args.from_raw)
        rows = []
        for variant, impl in VARIANTS.items():
            rows += build_rows(*ncu.read_exports(args.from_raw, variant), impl)
        provenance = ncu.reread_provenance(meta)
        path = _save(rows, provenance["command"], provenance)
    else:
        spec = ProfileSpec(RESULTS, "measure.profile_bwd_det", KERNEL_REGEX, SECTIONS,
                           EXTRA_METRICS, None)
        command = "python -m measure.profile_bwd_det"
        provenance = results.collect_provenance(command)
        rows = []
        for variant, impl in VARIANTS.items():
            raw, source = run_ncu(spec, target_args=(variant,))
            ncu.keep_exports(args.raw_dir, variant, raw, source)
            rows += build_rows(raw, source, impl)
        ncu.keep_meta(args.raw_dir, provenance)
        path = _save(rows, command, provenance)
    table = results.load(RESULTS, gpu=path.parent.name)  # the folder of the provenance's GPU
    print(table.table(["impl", "metric", "value", "unit"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
