"""fa4_final's forward, its variants and the FA4 package timed at one fixed SM clock, kernel by
kernel, by Nsight Compute (chapter 08; labs/measuring_small_differences.ipynb).

A burst on a power-limited H200 moves by several per cent with what ran before it (utils.bench
Note [Predecessors]); a difference of 1-2% between two kernels drowns in that. Nsight Compute
holds the SM clock at its base, runs one kernel at a time and flushes the caches before each:
no predecessor, no power limit, and a spread over the rounds of one to a few per cent (the
launches drift together, which the alternating rounds cancel), the instrument for telling
apart variants that close. It says nothing of power: a variant that saves energy gains under
the power limit and not here (measure.fwd_energy measures that), and the base clock makes
memory relatively faster than at the GPU's own clock.

    python -m measure.fwd_clocked             # GPU + ncu: results/<gpu>/fa4_final_clocked.json

Each shape is one ncu run of its own process (``--target``): every variant is called once to
compile (not profiled), then ``LAUNCHES`` times in rounds whose order alternates
(utils.bench.round_order); the launches are matched to variants by that order.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

RESULTS = "fa4_final_clocked"
HEADS, TOKENS = 16, 16384
LAUNCHES = 7
SHAPES = tuple((d, s, c) for d in (64, 128) for s in (4096, 16384) for c in (False, True))
# name -> fa4_final config changes (None: the FA4 package)
VARIANTS = {
    "fa4_final": {},
    # the threshold as chapter 07 has it: the warp votes before the exponentials
    "tau = 8": {"rescale_threshold": 8.0, "rescale_skip_unchanged": False},
    "fa4_package": None,
    # more, for --variants: the causal schedules and the stages of chapter 08's knobs (the
    # variants of knobs deleted since, the O rescale's place and the row reductions' chains,
    # went with them: their stored files remain, measure.defaults_table reads them)
    "one tile per CTA, L2 sections": {"schedule": "grid"},
    "zigzag rounds in L2 sections": {"schedule": "zigzag"},
    "dynamic tiles": {"schedule": "dynamic"},
    "tile table": {"schedule": "table"},
    "K/V stages 2/2": {"stages_k": 2, "stages_v": 2},
    "K/V stages 2/2, tau = 8": {"stages_k": 2, "stages_v": 2, "rescale_threshold": 8.0,
                                "rescale_skip_unchanged": False},
    # Note [Signalling lane] in fa4_final.hopper.fwd: the thread index read again every step
    "lane read every step": {"pin_lane": False},
    # Note [Warp vote] in fa4_final.common.softmax, last paragraph: no stale max, the vote off the
    # exponentials' path
    "tau = 0, O multiply skipped when no max moved": {"rescale_threshold": 0.0,
                                                      "rescale_skip_unchanged": True},
    "tau = 0": {"rescale_threshold": 0.0, "rescale_skip_unchanged": False},
    # the same with a threshold: each row keeps or moves its own max, the vote gates O only
    "tau = 8, rows decide alone": {"rescale_threshold": 8.0, "rescale_skip_unchanged": True},
    # chapter 08's ideas, each switched off (measure.fwd_knobs --ablation times them in bursts)
    "no ping-pong": {"pingpong": False},
    "no intra-warpgroup overlap": {"intra_wg_overlap": False},
    "one tile per CTA": {"schedule": "grid"},
    # not causal: the last round of whole tiles (no split tail); causal: fixed zigzag rounds
    # over the L2 sections' saw-tooth of costs instead of tiles taken at run time
    "tiles not balanced": lambda causal: {"schedule": "zigzag" if causal else "table"},
}
DEFAULT_VARIANTS = ("fa4_final", "tau = 8", "fa4_package")
DELETED = " (some of its variants' knobs were deleted since: the stored file is what remains)"
PRODUCES = [
    (f"results/h200/{RESULTS}.json", "python -m measure.fwd_clocked",
     "fa4_final, tau = 8, O rescaled after the softmax and the FA4 package at ncu's clock"
     + DELETED),
    ("results/h200/fa4_final_clocked_vs_package*.json",
     "python -m measure.fwd_clocked --variants fa4_final fa4_package "
     "--name fa4_final_clocked_vs_package", "fa4_final against the FA4 package at ncu's clock"),
    ("results/h200/fa4_final_clocked_d64_causal.json",
     "python -m measure.fwd_clocked --shape 64 16384 1 --shape 64 4096 1 --variants fa4_final "
     "'tau = 8' 'O rescaled after the softmax' 'tau = 8, O rescaled after the softmax' "
     "'one tile per CTA, L2 sections' 'zigzag rounds in L2 sections' 'K/V stages 2/2' "
     "fa4_package --name fa4_final_clocked_d64_causal",
     "D = 64 causal: knobs at ncu's clock" + DELETED),
    ("results/h200/fa4_final_clocked_d64_causal_stages.json",
     "python -m measure.fwd_clocked --shape 64 16384 1 --shape 64 4096 1 --variants fa4_final "
     "'K/V stages 2/2' 'K/V stages 2/2, tau = 8' 'K/V stages 2/2, O rescaled after the softmax' "
     "'K/V stages 2/2, tau = 8, O rescaled after the softmax' fa4_package "
     "--name fa4_final_clocked_d64_causal_stages",
     "D = 64 causal: two K/V stages with tau" + DELETED),
    ("results/h200/fa4_final_clocked_dynamic*.json",
     "python -m measure.fwd_clocked --shape 64 16384 1 --shape 64 4096 1 --shape 128 16384 1 "
     "--shape 128 4096 1 --variants fa4_final 'tile table' fa4_package "
     "--name fa4_final_clocked_dynamic", "the causal schedules: dynamic tiles or the table"),
    ("results/h200/fa4_final_clocked_lane.json",
     "python -m measure.fwd_clocked --variants fa4_final 'lane read every step' fa4_package "
     "--name fa4_final_clocked_lane", "the signalling lane read once or every step"),
    ("results/h200/fa4_final_clocked_row_sum.json",
     "python -m measure.fwd_clocked --variants fa4_final 'row sum in one chain' "
     "'row sum in two chains' fa4_package --name fa4_final_clocked_row_sum",
     "the row sum as a tree or as chains" + DELETED),
    ("results/h200/fa4_final_clocked_row_max.json",
     "python -m measure.fwd_clocked --shape 64 16384 1 --shape 64 4096 1 --variants fa4_final "
     "'row sum in one chain' 'row sum in one chain, row max in four chains' "
     "'row max in four chains' fa4_package --name fa4_final_clocked_row_max",
     "the row max as a tree or as chains (D = 64 causal)" + DELETED),
    ("results/h200/fa4_final_clocked_skip.json",
     "python -m measure.fwd_clocked --variants fa4_final 'tau = 8, rows decide alone' "
     "'tau = 0, O multiply skipped when no max moved' 'tau = 8' fa4_package "
     "--name fa4_final_clocked_skip", "the warp vote on or off the exponentials' path"),
]


def change_of(name: str, causal: bool) -> dict | None:
    """The config changes of variant ``name`` at a causal or non-causal shape (None: the FA4
    package)."""
    change = VARIANTS[name]
    return change(causal) if callable(change) else change
KERNEL_REGEX = "regex:HopperForward|FlashAttentionForwardSm90"
METRIC = "gpu__time_duration.sum"


def calls(head_dim: int, seqlen: int, causal: bool, names) -> dict:
    """name -> a zero-argument call of that variant's forward on one set of random inputs."""
    from dataclasses import replace

    from fa4_final.hopper.config import hopper_fwd_default
    from fa4_final.runtime.prologue import forward
    from utils import bench
    from utils.reference import random_qkv

    q, k, v, _ = random_qkv(TOKENS // seqlen, seqlen, HEADS, head_dim, device="cuda")
    out = {}
    for name in names:
        change = change_of(name, causal)
        if change is None:
            fa4 = bench.peers()["fa4_package"]
            out[name] = lambda fa4=fa4: fa4(q, k, v, causal=causal)
        else:
            cfg = replace(hopper_fwd_default(head_dim, causal), **change)
            out[name] = lambda cfg=cfg: forward(q, k, v, causal, config=cfg)
    return out


def launch_order(names: list, launches: int = LAUNCHES) -> list:
    """The variant of each profiled launch, in order: round r runs every variant once."""
    from utils.bench import round_order

    return [n for r in range(launches) for n in round_order(list(names), r)]


def target(head_dim: int, seqlen: int, causal: bool, names: list) -> None:
    """The profiled process: each variant once (compilation, skipped by ncu), then the rounds."""
    import torch

    fns = calls(head_dim, seqlen, causal, names)
    for name in names:
        fns[name]()
    torch.cuda.synchronize()
    for name in launch_order(names):
        fns[name]()
    torch.cuda.synchronize()


def durations(csv_text: str) -> list[float]:
    """Kernel durations (ms) in launch order from ncu's raw page (CSV; its second row holds the
    units)."""
    rows = list(csv.reader(io.StringIO(csv_text)))
    start = next(i for i, r in enumerate(rows) if METRIC in r)
    header, units = rows[start], rows[start + 1]
    col = header.index(METRIC)
    scale = {"ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
             "nsecond": 1e-6, "second": 1e3, "s": 1e3}[units[col].strip()]
    return [float(r[col].replace(",", "")) * scale for r in rows[start + 2:] if len(r) > col]


def run_ncu(head_dim: int, seqlen: int, causal: bool, names: list) -> str:
    ncu = shutil.which("ncu")
    if ncu is None:
        raise RuntimeError("ncu (Nsight Compute) is not on PATH; it comes with the CUDA toolkit")
    with tempfile.TemporaryDirectory() as tmp:
        rep = os.path.join(tmp, "clocked")
        subprocess.run(
            [ncu, "--launch-skip", str(len(names)), "--launch-count",
             str(len(launch_order(names))), "-k", KERNEL_REGEX, "--metrics", METRIC, "-f",
             "-o", rep, sys.executable, "-m", "measure.fwd_clocked", "--target",
             str(head_dim), str(seqlen), str(int(causal)), *names],
            check=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return subprocess.run([ncu, "-i", rep + ".ncu-rep", "--page", "raw", "--csv"],
                              check=True, capture_output=True, text=True, timeout=300).stdout


def rows_for(head_dim: int, seqlen: int, causal: bool, names: list, times: list) -> list[dict]:
    from utils import bench

    order = launch_order(names)
    if len(times) != len(order):
        raise RuntimeError(f"ncu timed {len(times)} kernels, {len(order)} were launched: the "
                           "kernel filter caught another kernel or missed one")
    b = TOKENS // seqlen
    flops = bench.attention_flops(b, HEADS, seqlen, seqlen, head_dim, causal)
    rows = []
    for name in names:
        ms = [t for t, n in zip(times, order) if n == name]
        med = statistics.median(ms)
        rows.append({"impl": "fa4_package" if VARIANTS[name] is None else "fa4_final",
                     "config": name, "knobs": change_of(name, causal), "pass": "fwd",
                     "dtype": "bf16",
                     "b": b, "s": seqlen, "h": HEADS, "d": head_dim, "causal": causal,
                     "ms": med, "ms_rounds": ms, "spread": (max(ms) - min(ms)) / med,
                     "tflops": flops / (med * 1e-3) / 1e12, "clock": "ncu base clock"})
    return rows


def measure(shapes=SHAPES, names=DEFAULT_VARIANTS) -> list[dict]:
    rows = []
    for d, s, c in shapes:
        times = durations(run_ncu(d, s, c, list(names)))
        new = rows_for(d, s, c, list(names), times)
        rows += new
        pkg = next((r for r in new if r["impl"] == "fa4_package"), None)
        line = ", ".join(f"{r['config']} {r['ms']:.4f} ms" + (
            f" ({pkg['ms'] / r['ms']:.3f}x)" if pkg and r is not pkg else "") for r in new)
        print(f"D={d} S={s} causal={c}: {line}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", nargs="+", metavar="D S CAUSAL NAME",
                    help="(the profiled process) head dim, seqlen, causal, variant names")
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                    choices=list(VARIANTS))
    ap.add_argument("--shape", nargs=3, type=int, action="append", metavar=("D", "S", "CAUSAL"),
                    help="this shape only (repeat for several; default: the eight)")
    ap.add_argument("--name", default=RESULTS, help="results file to write")
    args = ap.parse_args(argv)
    if args.target:
        d, s, c, *names = args.target
        target(int(d), int(s), bool(int(c)), names)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU and ncu; the stored results are in results/h200/")
        return 0
    from utils import results

    shapes = tuple((d, s, bool(c)) for d, s, c in args.shape) if args.shape else SHAPES
    rows = measure(shapes, names=tuple(args.variants))
    print("wrote", results.save(args.name, rows, command="python -m measure.fwd_clocked " +
                                " ".join(argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
