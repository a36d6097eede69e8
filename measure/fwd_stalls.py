"""Where the warps of fa4_final's Hopper forward and of the FA4 package's wait, instruction by
instruction: ncu's warp-state sampling per SASS instruction (read by ``solutions.ch08_stalls``).

    python -m measure.fwd_stalls                 # GPU, ncu: results/<gpu>/fa4_final_stalls.json
    python -m measure.fwd_stalls --raw-dir DIR   # ... and keep ncu's CSV exports in DIR
    python -m measure.fwd_stalls --from-raw DIR  # re-read DIR (any machine, no GPU)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from measure import _ncu as ncu
from solutions import ch08_versus as versus
from solutions.ch08_stalls import IMPLS, RESULTS, SECTIONS, SHAPES, build_rows, table

PRODUCES = [(f"results/h200/{RESULTS}.json", "python -m measure.fwd_stalls --raw-dir DIR",
             "ncu's warp samples per SASS instruction of fa4_final and the FA4 package, "
             "grouped by kind of consumer instruction, D = 64")]


def run_ncu(impl: str, head_dim: int, seqlen: int, causal: bool) -> tuple[str, str]:
    spec = ncu.ProfileSpec(RESULTS, "measure.fwd_versus", versus.KERNEL_OF[impl], SECTIONS,
                            versus.EXTRA_METRICS, None)
    return ncu.run_ncu(spec, (impl, str(head_dim), str(seqlen), str(int(causal))), source=True)


def _stem(impl, d, s, causal) -> str:
    return f"{impl}_d{d}_s{s}_{'causal' if causal else 'noncausal'}"


def profile(raw_dir: Path | None = None, shapes=SHAPES) -> Path:
    from utils import results

    command = "python -m measure.fwd_stalls"
    provenance = results.collect_provenance(command)
    rows = []
    for d, s, causal in shapes:
        for impl in IMPLS:
            raw, source = run_ncu(impl, d, s, causal)
            if raw_dir is not None:
                raw_dir.mkdir(parents=True, exist_ok=True)
                (raw_dir / f"{_stem(impl, d, s, causal)}.raw.csv").write_text(raw)
                (raw_dir / f"{_stem(impl, d, s, causal)}.source.csv").write_text(source)
                (raw_dir / "meta.json").write_text(json.dumps({"provenance": provenance,
                                                               "shapes": shapes}, indent=1))
            rows += build_rows(raw, source, impl, d, s, causal)
            print(f"profiled {impl} D={d} S={s} causal={causal}", flush=True)
    return results.save(RESULTS, rows, command=command, provenance=provenance)


def from_raw(raw_dir: Path) -> Path:
    """Rebuild the results file from the CSV exports ``--raw-dir`` kept (their provenance)."""
    from utils import results

    meta = json.loads((raw_dir / "meta.json").read_text())
    rows = []
    for d, s, causal in meta["shapes"]:
        for impl in IMPLS:
            stem = raw_dir / _stem(impl, d, s, causal)
            rows += build_rows(Path(f"{stem}.raw.csv").read_text(),
                               Path(f"{stem}.source.csv").read_text(), impl, d, s, causal)
    provenance = ncu.reread_provenance(meta)
    return results.save(RESULTS, rows, command=provenance["command"], provenance=provenance)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw-dir", type=Path, help="also keep ncu's CSV exports here")
    ap.add_argument("--from-raw", type=Path, help="re-read the exports kept in this folder")
    args = ap.parse_args(argv)
    from utils import results

    if args.from_raw:
        path = from_raw(args.from_raw)
    else:
        import torch

        if not torch.cuda.is_available():
            print("needs a CUDA GPU (sm_90) and ncu; the stored results are in results/h200/")
            return 0
        path = profile(args.raw_dir)
    print("\n".join(table(results.load(RESULTS))))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
