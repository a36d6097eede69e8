"""Where the D = 128 backward's main kernel and the FA4 package's differ in time: Nsight Compute
on one launch of each, same shapes, same process kind (hypothesis 2 of the lab
labs/hopper_backward_compiled.ipynb: the same GEMMs a step, fewer instructions in ours, so if
ours takes longer its warps wait longer somewhere).

    python -m measure.profile_bwd_versus                   # GPU and ncu: profile, save the JSON
    python -m measure.profile_bwd_versus --raw-dir DIR     # ... and keep ncu's CSV exports in DIR
    python -m measure.profile_bwd_versus --from-raw DIR    # re-read DIR (any machine, no GPU)

Shapes (``SHAPES``): bf16, 16 heads, D = 128, 16,384 tokens: S = 4096 not causal and S = 16384
causal, where fa4_final's backward trails the package's most in
results/h100/bwd_phases_every_thread_default.json. Each profiled process runs one forward and
two backwards through autograd (fa4_final.flash_attn_func, or flash_attn.cute.flash_attn_func
for the package); ncu skips the first main kernel (it compiles) and measures the second.

Rows (``impl`` fa4_final or fa4_package, ``s``, ``causal``): measure.profile_bwd_det's counters
(duration at ncu's locked clock, issue slots busy, registers, warps, stall reasons a issued
instruction, the tensor pipe's busy share as wgmma drives it, DRAM throughput) and from the
sampled SASS each stall reason's share of the warp samples and the five instructions with the
most samples. Durations compare between rows of one file (the same locked clock), not with
the benchmarks'. Saved as results/<gpu>/bwd_versus_profile.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from measure import _ncu as ncu
from measure._ncu import ProfileSpec, run_ncu
from measure.profile_bwd_det import EXTRA_METRICS, RAW_METRICS, SECTIONS, source_rows
from solutions import ch04_profile as core

RESULTS = "bwd_versus_profile"
SHAPES = ({"b": 4, "s": 4096, "h": 16, "d": 128, "causal": False},
          {"b": 1, "s": 16384, "h": 16, "d": 128, "causal": True})
# impl -> ncu's filter for its backward main kernel (CuTe kernels carry their class's name)
KERNELS = {"fa4_final": "regex:HopperBackward", "fa4_package": "regex:FlashAttentionBackwardSm90"}
PRODUCES = [(f"results/h100/{RESULTS}.json", "python -m measure.profile_bwd_versus --raw-dir DIR",
             "Nsight Compute on one launch of fa4_final's backward main kernel and one of the "
             "FA4 package's, D = 128, S = 4096 dense and 16384 causal: stalls, tensor pipe, "
             "the instructions with most samples; an H100 visit")]


def case_name(impl: str, shape: dict) -> str:
    return f"{impl}_s{shape['s']}_{'causal' if shape['causal'] else 'dense'}"


def build_rows(raw_text: str, source_text: str, impl: str, shape: dict) -> list[dict]:
    rows = (core.raw_rows(core.parse_raw(raw_text), RAW_METRICS)
            + source_rows(core.parse_source_rows(source_text)))
    return [{"impl": impl, **shape, **r} for r in rows]


def _run_target(impl: str, s: int) -> None:
    import torch

    from utils.reference import random_qkv

    shape = next(x for x in SHAPES if x["s"] == s)
    if impl == "fa4_final":
        from fa4_final import flash_attn_func
    else:
        from flash_attn.cute import flash_attn_func
    q, k, v, _ = random_qkv(shape["b"], s, shape["h"], shape["d"], device="cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attn_func(q, k, v, causal=shape["causal"])
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.randn_like(out)
    for _ in range(2):
        torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    torch.cuda.synchronize()


def main(argv=None) -> int:
    from utils import results

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", nargs=2, metavar=("IMPL", "S"), help=argparse.SUPPRESS)
    ap.add_argument("--raw-dir", type=Path, help="also keep ncu's CSV exports here")
    ap.add_argument("--from-raw", type=Path, help="rebuild the JSON from a --raw-dir folder")
    args = ap.parse_args(argv)
    if args.target:
        impl, s = args.target
        if impl not in KERNELS or int(s) not in {x["s"] for x in SHAPES}:
            ap.error(f"--target: impl one of {sorted(KERNELS)} and S one of "
                     f"{[x['s'] for x in SHAPES]}, got {impl!r} {s!r}")
        _run_target(impl, int(s))
        return 0
    rows = []
    if args.from_raw:
        meta = ncu.read_meta(args.from_raw)
        for shape in SHAPES:
            for impl in KERNELS:
                rows += build_rows(*ncu.read_exports(args.from_raw, case_name(impl, shape)),
                                   impl, shape)
        provenance = ncu.reread_provenance(meta)
        command = provenance["command"]
    else:
        command = "python -m measure.profile_bwd_versus"
        provenance = results.collect_provenance(command)
        for shape in SHAPES:
            for impl, regex in KERNELS.items():
                spec = ProfileSpec(RESULTS, "measure.profile_bwd_versus", regex, SECTIONS,
                                   EXTRA_METRICS, None)
                raw, source = run_ncu(spec, target_args=(impl, str(shape["s"])))
                ncu.keep_exports(args.raw_dir, case_name(impl, shape), raw, source)
                rows += build_rows(raw, source, impl, shape)
                print(f"profiled {case_name(impl, shape)}", flush=True)
        ncu.keep_meta(args.raw_dir, provenance)
    path = results.save(RESULTS, rows, command=command, provenance=provenance)
    table = results.load(RESULTS, gpu=path.parent.name)
    print(table.table(["impl", "s", "causal", "metric", "value", "unit"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
