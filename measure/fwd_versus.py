"""fa4_final's Hopper forward and the FA4 package's, profiled by Nsight Compute side by side
(read by ``solutions.ch08_versus``; labs/the_last_three_percent.ipynb).

    python -m measure.fwd_versus                  # GPU, ncu: results/<gpu>/fa4_final_versus.json
    python -m measure.fwd_versus --raw-dir DIR    # ... and keep ncu's CSV exports in DIR
    python -m measure.fwd_versus --boost 64 16384 1   # one shape at the GPU's own clock

Each (kernel, shape) is one ncu run of its own process, on the second launch (the first
compiles); ncu holds the SM clock at its base unless ``--boost``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from measure import _ncu as ncu
from solutions.ch08_versus import (
    EXTRA_METRICS,
    HEADS,
    KERNEL_OF,
    RESULTS,
    RESULTS_BOOST,
    SECTIONS,
    SHAPES,
    TOKENS,
    VARIANTS,
    impls_at,
    reading,
    rows_of,
    side_by_side,
)

PRODUCES = [
    (f"results/h200/{RESULTS}.json", "python -m measure.fwd_versus --raw-dir DIR",
     "Nsight Compute counters of fa4_final and the FA4 package side by side, three shapes"),
    (f"results/h200/{RESULTS_BOOST}.json",
     "python -m measure.fwd_versus --boost 64 16384 1 --raw-dir DIR",
     "the same at the GPU's own clock, one shape"),
]


def target(impl: str, head_dim: int, seqlen: int, causal: bool) -> None:
    """The profiled process: one kernel at one shape, launched twice (ncu skips the first)."""
    import torch

    from utils import bench
    from utils.reference import random_qkv

    if impl == "fa4_final" or impl in VARIANTS:
        from dataclasses import replace

        from fa4_final.api import interface
        from fa4_final.hopper.config import hopper_fwd_default

        cfg = replace(hopper_fwd_default(head_dim, causal), **VARIANTS.get(impl, {}))

        def run(q, k, v):
            return interface.attention(q, k, v, causal, config=cfg)
    else:
        fa4 = bench.peers()["fa4_package"]

        def run(q, k, v):
            return fa4(q, k, v, causal=causal)
    q, k, v, _ = random_qkv(TOKENS // seqlen, seqlen, HEADS, head_dim, device="cuda")
    for _ in range(2):
        run(q, k, v)
    torch.cuda.synchronize()


def run_ncu(impl: str, head_dim: int, seqlen: int, causal: bool, boost: bool = False) -> str:
    """ncu's raw page (CSV) for ``impl``'s forward kernel at the shape (chapter 04's runner,
    with this module's ``--target`` and no source page); ``boost``: at the GPU's own clock."""
    spec = ncu.ProfileSpec(RESULTS, "measure.fwd_versus", KERNEL_OF[impl], SECTIONS,
                            EXTRA_METRICS, None)
    raw, _ = ncu.run_ncu(spec, (impl, str(head_dim), str(seqlen), str(int(causal))),
                          source=False, ncu_args=("--clock-control", "none") if boost else ())
    return raw


def profile(raw_dir: Path | None = None, shapes=SHAPES, boost: bool = False) -> Path:
    """Profile every kernel at ``shapes``. ``boost``: at the GPU's own clock (ncu's
    ``--clock-control none``), the two kernels only, saved as RESULTS_BOOST."""
    from utils import results

    command = "python -m measure.fwd_versus" + (" --boost" if boost else "")
    provenance = results.collect_provenance(command)
    rows = []
    for d, s, causal in shapes:
        for impl in impls_at(causal, variants=not boost):
            raw = run_ncu(impl, d, s, causal, boost)
            if raw_dir is not None:
                raw_dir.mkdir(parents=True, exist_ok=True)
                (raw_dir / f"{impl}_d{d}_s{s}_{'causal' if causal else 'noncausal'}.csv"
                 ).write_text(raw)
            rows += rows_of(raw, impl, d, s, causal)
            print(f"profiled {impl} D={d} S={s} causal={causal}", flush=True)
    if raw_dir is not None:
        (raw_dir / "meta.json").write_text(json.dumps({"provenance": provenance}, indent=1))
    return results.save(RESULTS_BOOST if boost else RESULTS, rows, command=command,
                        provenance=provenance)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", nargs=4, metavar=("IMPL", "D", "S", "CAUSAL"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--raw-dir", type=Path, help="also keep ncu's CSV exports here")
    ap.add_argument("--boost", nargs=3, type=int, metavar=("D", "S", "CAUSAL"),
                    help="one shape at the GPU's own clock (ncu --clock-control none), saved "
                    "as fa4_final_versus_boost")
    args = ap.parse_args(argv)
    if args.target:
        impl, d, s, causal = args.target
        target(impl, int(d), int(s), bool(int(causal)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90) and ncu; the stored results are in results/h200/")
        return 0
    if args.boost:
        d, s, c = args.boost
        path = profile(args.raw_dir, shapes=((d, s, bool(c)),), boost=True)
    else:
        path = profile(args.raw_dir)
    from utils import results

    res = results.load(RESULTS_BOOST if args.boost else RESULTS)
    print("\n".join(side_by_side(res) + reading(res)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
