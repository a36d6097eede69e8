"""fa4_final's Hopper forward with its knobs changed one at a time, timed in bursts in
interleaved rounds next to the peers (chapter 08's tuning runs, read in
labs/measuring_small_differences.ipynb and labs/the_last_three_percent.ipynb; the chapter's own
ablation is measure.fwd_clocked --ablation, at a fixed clock).

    python -m measure.fwd_knobs --knobs         # results/<gpu>/fa4_final_knobs.json

Each configuration is first checked against float64 on a small awkward shape (fresh random
inputs, NaN-poisoned outputs; a failing one is not timed), then timed at batch x seqlen = 16384
tokens, 16 heads, bf16, in ``--rounds`` rounds with SDPA's flash and cuDNN backends and the FA4
package in the same rounds (utils.bench.interleaved).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace

import torch

from fa4_final.hopper.config import hopper_fwd_default
from fa4_final.runtime.prologue import forward
from measure import fwd_checks
from utils import bench, results

KNOB_RESULTS = "fa4_final_knobs"
# (head_dim, seqlen, causal) groups timed; each runs every config of knob_configs
PLAN = ((128, 4096, False), (128, 16384, False), (128, 16384, True))
# the groups where fa4_final trails the FA4 package most (results/h200/fa4_final_fwd.json)
PLAN_GAPS = ((64, 16384, True), (128, 4096, True), (128, 16384, True))
# every shape of the forward's benchmark (measure.benchmark --name fa4_final_fwd)
PLAN_ALL = tuple((d, s, c) for d in (64, 128) for s in (4096, 16384) for c in (False, True))
PLAN_NON_CAUSAL = tuple(p for p in PLAN_ALL if not p[2])
_RUN = "python -m measure.fwd_knobs --knobs"
ABLATION_RESULTS = "fa4_final_ablation"
# chapter 08's ablation: the long-sequence shapes of the benchmark, both head dims, causal or not
PLAN_ABLATION = tuple((d, 16384, c) for d in (64, 128) for c in (False, True))
ABLATION_ROUNDS, ABLATION_SETTLE_MS = 5, 50.0
PRODUCES = [
    (f"results/h200/{ABLATION_RESULTS}.json", "python -m measure.fwd_knobs --ablation",
     "chapter 08's ideas switched off one at a time (ablation_configs), in settled bursts in "
     "5 interleaved rounds beside the peers, four shapes (its O-rescale and O-over-Q rows: "
     "knobs deleted since)"),
    (f"results/h200/{KNOB_RESULTS}.json", _RUN,
     "every overlap idea switched off or moved, in bursts beside the peers, three shapes "
     "(the O rescale's place and O over Q: knobs deleted since)"),
    ("results/h200/fa4_final_knobs_only.json", f"{_RUN} --gaps --only 'O rescaled' 'mask as bit'",
     "the O rescale's place and the bit-word mask where the FA4 package led (both knobs were "
     "deleted after this run, their variants with them: the stored file is what remains)"),
    ("results/h200/fa4_final_sched.json",
     f"{_RUN} --all-shapes --only 'one tile per CTA' zigzag --name fa4_final_sched",
     "the tile schedules (persistent or one tile per CTA, zigzag rounds) at eight shapes"),
    ("results/h200/fa4_final_split.json",
     f"{_RUN} --non-causal --only 'last round' 'cut along' --rounds 5 --name fa4_final_split",
     "the last round whole or cut along the keys, four non-causal shapes"),
    ("results/h200/fa4_final_d64_causal.json",
     f"{_RUN} --shape 64 16384 1 --only 'one tile per CTA, L2' 'stages 2/2' "
     "'zigzag rounds in L2' '128 x 128' 'after the softmax' --rounds 7 "
     "--name fa4_final_d64_causal", "D = 64 causal: schedules, stages and tiles (and the O "
     "rescale's place, a knob deleted since)"),
    ("results/h200/fa4_final_d64_softmax.json",
     f"{_RUN} --shape 64 4096 0 --shape 64 4096 1 --shape 64 16384 0 --shape 64 16384 1 "
     "--only 'exp2 emulation' 'tau = 8' --rounds 5 --name fa4_final_d64_softmax",
     "D = 64: the exp2 emulation share and the rescale threshold"),
    ("results/h200/fa4_final_tune.json",
     f"{_RUN} --all-shapes --only 'tau = 8' --exact --settle-ms 50 --rounds 5 "
     "--name fa4_final_tune", "tau = 8 at eight shapes, each config settled first"),
]


def knob_configs(head_dim: int, causal: bool) -> dict:
    """Name -> config: the default, then one idea of chapter 08 (or 06, 07) changed at a time."""
    base = hopper_fwd_default(head_dim, causal)
    configs = {
        "default": base,
        "no ping-pong": replace(base, pingpong=False),
        "one tile per CTA": replace(base, schedule="grid", l2_sections=False),
        "no intra-warpgroup overlap": replace(base, intra_wg_overlap=False),
        "exp2 emulation 1/4": replace(base, exp2_emulation_fraction=0.25),
        "exp2 emulation 1/8": replace(base, exp2_emulation_fraction=0.125),
        "tau = 8": replace(base, rescale_threshold=8.0, rescale_skip_unchanged=False),
        # from the SASS comparison with FA4's sm90 forward (solutions.ch08_compare)
        "K/V stages 2/2 (FA4's)": replace(base, stages_k=2, stages_v=2),
        "K/V stages 2/3": replace(base, stages_k=2, stages_v=3),
    }
    if head_dim == 64:  # FA4's choice is 192 x 128 with three; the 128-row tile of D = 128
        # at D = 64 a step's exponentials keep the MUFU busy about as long as its GEMMs keep
        # the tensor cores, so a share moved to the FMA units is timed, alone and with tau
        configs["exp2 emulation 1/8, tau = 8"] = replace(base, exp2_emulation_fraction=0.125,
                                                         rescale_threshold=8.0,
                                                         rescale_skip_unchanged=False)
        configs["128 x 128 tiles, two consumer warpgroups"] = replace(base, num_consumer_wgs=2)
    if not causal:  # equal tiles: the last round whole, or cut along the keys (Note [Split tail])
        if base.splits_tail:
            configs["last round of whole tiles"] = replace(base, schedule="table")
        else:
            configs["last round cut along the keys"] = replace(base, schedule="split_tail")
    if causal:  # the default: longest first in L2 sections, taken at run time (dynamic)
        # fixed zigzag rounds, longest first over every head (the first default)
        configs["zigzag rounds, longest first over all heads"] = replace(
            base, schedule="zigzag", l2_sections=False)
        configs["zigzag rounds in L2 sections"] = replace(base, schedule="zigzag",
                                                          l2_sections=True)
        # the host's list schedule (Note [Tile table]; the default before dynamic tiles)
        configs["tile table"] = replace(base, schedule="table")
        # the FA4 package's causal schedule on sm90: one CTA per tile, longest first in
        # sections of heads that fit L2, the hardware handing tiles to SMs as they free up
        configs["one tile per CTA, L2 sections"] = replace(base, schedule="grid",
                                                           l2_sections=True)
    return configs


def ablation_configs(head_dim: int, causal: bool) -> dict:
    """Name -> config: the default, then each idea of chapter 08 switched off in turn."""
    base = hopper_fwd_default(head_dim, causal)
    # not causal: the last round of whole tiles; causal: fixed zigzag rounds over the L2
    # sections' saw-tooth of costs, not tiles taken at run time
    unbalanced = "zigzag" if causal else "table"
    return {
        "default": base,
        "no ping-pong": replace(base, pingpong=False),
        "no intra-warpgroup overlap": replace(base, intra_wg_overlap=False),
        "one tile per CTA": replace(base, schedule="grid"),
        "tiles not balanced": replace(base, schedule=unbalanced),
    }


def compile_knob_configs(head_dim: int, causal: bool) -> dict:
    """The configs whose SASS solutions.ch08_compare records: every timed one but the debug
    and ablation builds that change the kernel's whole structure."""
    skip = ("one tile per CTA", "no intra-warpgroup overlap", "no ping-pong",
            "zigzag rounds, longest first over all heads", "zigzag rounds in L2 sections",
            "one tile per CTA, L2 sections")
    return {n: c for n, c in knob_configs(head_dim, causal).items() if n not in skip}


def knobs(rounds: int = bench.MIN_ROUNDS, rep: int = 20, save: bool = True, plan=PLAN,
          only=None, results_name: str = KNOB_RESULTS, command: str | None = None,
          settle_ms: float = 0.0, exact: bool = False) -> list[dict]:
    """Every config of knob_configs (``only``: those whose name holds one of the given strings,
    or with ``exact`` is one of them, and the default) timed per group of ``plan``; saved as
    results/<gpu>/<results_name>.json."""
    from utils.reference import random_qkv

    table = ablation_configs if results_name == ABLATION_RESULTS else knob_configs

    def chosen(head_dim, causal):
        return {n: c for n, c in table(head_dim, causal).items()
                if only is None or n == "default" or any(
                    (o == n) if exact else (o in n) for o in only)}

    rows = []
    for head_dim, seqlen, causal in plan:
        batch = 16384 // seqlen
        q, k, v, seed = random_qkv(batch, seqlen, 16, head_dim, device="cuda")
        flops = bench.attention_flops(batch, 16, seqlen, seqlen, head_dim, causal)
        calls, checked = {}, {}
        for name, cfg in chosen(head_dim, causal).items():
            ok, line = fwd_checks.check_case(1, 1000, 1100, 4, 2, head_dim, causal,
                                              torch.bfloat16, config=cfg)
            checked[name] = ok
            if not ok:
                print(line, flush=True)
                continue
            calls[name] = (lambda cfg=cfg, qkv=(q, k, v), c=causal:
                           forward(*qkv, c, config=cfg))
        peers = bench.peer_calls(q, k, v, causal)
        measured = bench.interleaved({**calls, **peers}, rounds=rounds, rep=rep,
                                     max_seconds=1.5,
                                     **({"settle_ms": settle_ms} if settle_ms else {}))
        extra = bench.peer_fields({n: measured[n] for n in peers}, flops)
        for name, cfg in chosen(head_dim, causal).items():
            row = {"impl": "fa4_final", "config": name, "pass": "fwd", "dtype": "bf16",
                   "b": batch, "s": seqlen, "h": 16, "d": head_dim, "causal": causal,
                   "verified": checked[name], "seed": seed,
                   "knobs": {k_: v_ for k_, v_ in asdict(cfg).items()}}
            if name in measured:
                row.update(measured[name].fields(flops))
            row.update(extra)
            rows.append(row)
        line = ", ".join(f"{r['config']} {r['tflops']:.0f}" for r in rows[-len(calls):]
                         if r.get("tflops"))
        print(f"D={head_dim} S={seqlen} causal={causal}: {line}; best peer "
              f"{extra.get('best_peer')} {extra.get('best_peer_tflops') or 0:.0f}",
              flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    if save:
        print("wrote", results.save(results_name, rows,
                                    command=command or "python -m measure.fwd_knobs --knobs"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--knobs", action="store_true")
    ap.add_argument("--ablation", action="store_true", help="chapter 08's ablation "
                    "(ablation_configs at PLAN_ABLATION, 5 settled rounds): "
                    "fa4_final_ablation.json")
    ap.add_argument("--rounds", type=int, default=bench.MIN_ROUNDS)
    ap.add_argument("--only", nargs="*", help="configs whose name holds one of these (and the "
                    "default); saved as fa4_final_knobs_only.json, not over the full table")
    ap.add_argument("--gaps", action="store_true", help="time the groups of PLAN_GAPS (where "
                    "the FA4 package leads), not PLAN")
    ap.add_argument("--name", help="results file to write (default: fa4_final_knobs, or "
                    "fa4_final_knobs_only for a partial run)")
    ap.add_argument("--all-shapes", action="store_true", help="time the eight groups of "
                    "PLAN_ALL (D 64/128, S 4096/16384, causal or not), not PLAN")
    ap.add_argument("--non-causal", action="store_true", help="time the four non-causal "
                    "groups of PLAN_ALL only")
    ap.add_argument("--exact", action="store_true", help="--only names whole configs, not "
                    "parts of their names")
    ap.add_argument("--settle-ms", type=float, default=0.0, help="each config runs this long "
                    "more before its timed calls (utils.bench Note [Predecessors])")
    ap.add_argument("--shape", nargs=3, type=int, metavar=("D", "S", "CAUSAL"),
                    action="append", help="time this group only, e.g. --shape 64 16384 1 "
                    "(repeat for several)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90); the stored results are in results/h200/")
        return 0
    if args.ablation:
        knobs(rounds=max(args.rounds, ABLATION_ROUNDS), plan=PLAN_ABLATION,
              results_name=ABLATION_RESULTS, settle_ms=args.settle_ms or ABLATION_SETTLE_MS,
              command="python -m measure.fwd_knobs " + " ".join(argv or sys.argv[1:]))
    if args.knobs:
        partial = (args.only is not None or args.gaps or args.all_shapes or args.non_causal
                   or args.shape is not None)
        plan = (PLAN_ALL if args.all_shapes else PLAN_NON_CAUSAL if args.non_causal
                else PLAN_GAPS if args.gaps else PLAN)
        if args.shape is not None:
            plan = tuple((d, s, bool(c)) for d, s, c in args.shape)
        knobs(rounds=args.rounds, plan=plan, only=args.only,
              results_name=args.name or (KNOB_RESULTS + "_only" if partial else KNOB_RESULTS),
              command="python -m measure.fwd_knobs " + " ".join(argv or sys.argv[1:]),
              settle_ms=args.settle_ms, exact=args.exact)
    return 0


if __name__ == "__main__":
    sys.exit(main())
