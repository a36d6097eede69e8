"""fa4_final's Hopper forward checked on a GPU (chapter 08): fresh random inputs of awkward
shapes against the float64 reference, NaN-poisoned outputs, one line per case.

    python -m measure.fwd_checks             # every case (also what the GPU tests run)
    python -m measure.fwd_checks --save      # ... and the verdicts: fa4_final_checks.json
    python -m measure.fwd_checks --small     # three small cases: what compute-sanitizer runs
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from fa4_final.hopper.config import hopper_fwd_default
from fa4_final.runtime.prologue import forward_into
from utils import checks
from utils.reference import random_qkv

BF16, FP16 = torch.bfloat16, torch.float16
RESULTS = "fa4_final_checks"
PRODUCES = [(f"results/h200/{RESULTS}.json", "python -m measure.fwd_checks --defaults --save",
             "fa4_final's forward against float64 on awkward shapes: a verdict per case")]
# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype, window_size)
CASES = [
    (1, 1, 1, 1, 1, 128, False, BF16, None),
    (2, 17, 17, 2, 1, 64, True, FP16, None),
    (1, 129, 129, 4, 4, 128, True, BF16, None),
    (3, 333, 555, 6, 2, 64, False, FP16, None),  # GQA, odd lengths
    (1, 100, 1000, 2, 2, 128, True, BF16, None),  # seqlen_q < seqlen_k: bottom-right diagonal
    (1, 1000, 100, 2, 2, 128, True, BF16, None),  # seqlen_q > seqlen_k: 900 rows see no key
    (2, 300, 77, 6, 1, 128, True, BF16, None),  # MQA
    (4, 2048, 2048, 16, 4, 128, True, BF16, None),  # many tiles per persistent CTA
    (2, 8192, 8192, 16, 2, 64, True, FP16, None),
    (1, 8192, 8192, 2, 2, 128, False, BF16, None),
    (1, 1000, 1000, 2, 1, 128, False, BF16, (100, 50)),  # sliding window
    (1, 700, 900, 2, 2, 64, True, BF16, (37, None)),  # causal + left window
    (2, 513, 513, 2, 2, 128, False, FP16, (None, 200)),
    (1, 2048, 2048, 4, 4, 128, True, BF16, (300, None)),
]
SMALL = [CASES[1], CASES[4], CASES[10]]
# small shapes whose tiles the default schedule cuts along the keys (Note [Split tail]): fewer
# tiles than SMs, so every tile is merged from several pieces (for the sanitizers)
SMALL_SPLIT = [(1, 1000, 4097, 2, 1, 128, False, FP16, None),
               (1, 2000, 1500, 4, 2, 64, False, BF16, None)]
# knobs of chapter 08 (and 06, 07) checked on two shapes each; ``--knob`` picks the sets that
# set a knob or choose a schedule by that name
KNOBS = [dict(pingpong=False), dict(schedule="grid"),
         dict(intra_wg_overlap=False), dict(exp2_emulation_fraction=0.25),
         dict(rescale_threshold=8.0, rescale_skip_unchanged=False),
         dict(schedule="zigzag", l2_sections=False),
         dict(schedule="zigzag", l2_sections=True),
         dict(stages_k=2, stages_v=2), dict(stages_k=2, stages_v=3),
         dict(schedule="table", l2_sections=True),
         dict(schedule="split_tail"),
         dict(schedule="dynamic", l2_sections=True),
         dict(rescale_threshold=0.0, rescale_skip_unchanged=True),
         dict(rescale_threshold=8.0, rescale_skip_unchanged=True)]
KNOB_SHAPES = [(1, 1000, 4097, 2, 1, 128, True, BF16, None),
               (2, 777, 777, 4, 2, 64, False, FP16, None)]
# knobs that change the mask or the P V bookkeeping also meet causal D = 64 (tile_m = 192, two
# diagonal tiles), seqlen_q > seqlen_k and a window with both edges
KNOB_MORE_SHAPES = {# the skipped O multiply: many KV tiles (maxima that stop moving), rows
                    # that see no key, a left window, both head dims
                    "rescale_skip_unchanged": [(2, 8192, 8192, 16, 2, 64, True, FP16, None),
                                               (1, 8192, 8192, 2, 2, 128, False, BF16, None),
                                               (1, 1000, 100, 2, 2, 128, True, BF16, None),
                                               (1, 700, 900, 2, 2, 64, True, BF16, (37, None))],
                    # every schedule changes which CTA computes what: many tiles per CTA,
                    # rows that see no key, windows, and a grid smaller than the SM count (the
                    # dynamic scheduler: every launch after the first takes its tiles from the
                    # counter the one before set back to zero)
                    "schedule": [(4, 2048, 2048, 16, 4, 128, True, BF16, None),
                                   (2, 8192, 8192, 16, 2, 64, True, FP16, None),
                                   (1, 1000, 100, 2, 2, 128, True, BF16, None),
                                   (1, 700, 900, 2, 2, 64, True, BF16, (37, None)),
                                   (3, 333, 555, 6, 2, 64, False, FP16, None),
                                   (1, 129, 129, 4, 4, 128, True, BF16, None)],
                    # Note [Split tail]: a last round cut along the keys (2048 and 1376 tiles
                    # on 132 SMs), tiles fewer than SMs (each in up to 9 pieces), a partial top
                    # key tile in a piece, sq > sk, GQA, both head dims and dtypes; causal and
                    # windowed shapes take whole tiles from the same table
                    "split_tail": [(4, 4096, 4096, 16, 4, 128, False, BF16, None),
                                   (2, 8192, 8192, 16, 2, 64, False, FP16, None),
                                   (1, 1000, 4097, 2, 1, 128, False, FP16, None),
                                   (3, 333, 555, 6, 2, 64, False, BF16, None),
                                   (1, 1000, 100, 2, 2, 128, False, BF16, None),
                                   (2, 4096, 4095, 8, 8, 64, False, BF16, None),
                                   (1, 700, 900, 2, 2, 64, True, BF16, (37, None)),
                                   (1, 600, 2000, 4, 2, 128, False, FP16, (300, 200))]}


def run_into(q, k, v, out, lse, causal, softmax_scale, config, window):
    forward_into(q, k, v, out, lse, causal, softmax_scale, window or (None, None), config)


def names(knobs: dict) -> list:
    """What ``--knob`` matches in a knob set: its knobs, and the schedule it chooses."""
    return [*knobs, knobs.get("schedule")]


def check_case(b, sq, sk, h, hk, d, causal, dtype, window=None, config=None):
    """Fresh random inputs, one poisoned run, compared with float64. Returns (ok, line)."""
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype,
                               device="cuda")
    out = checks.poisoned_empty(b, sq, h, d, dtype=dtype, device="cuda")
    lse = checks.poisoned_empty(b, h, sq, dtype=torch.float32, device="cuda")
    label = (f"b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} window={window} "
             f"{str(dtype).removeprefix('torch.')} {config or 'default'} seed={seed}")
    run_into(q, k, v, out, lse, causal, None, config, window)
    checks.wait_for_gpu(label)
    return checks.compare_outputs(q, k, v, out, lse, causal, label=label, window_size=window)


def all_cases(small: bool = False, knob: str | None = None, split: bool = False):
    """Every case, or the three small ones (``split``: the two small split-tail ones; with
    ``knob``, run with the first knob set naming it), or (``knob``) those of the knob sets
    naming it."""
    if small:
        shapes = SMALL_SPLIT if split else SMALL
        if knob is None:
            return [(c, None) for c in shapes]
        knobs = next(k for k in KNOBS if knob in names(k))  # the first knob set naming it
        return [(c, replace(hopper_fwd_default(c[5], c[6]), **knobs)) for c in shapes]
    cases = [(c, None) for c in CASES] if knob is None else []
    for knobs in KNOBS:
        if knob is not None and knob not in names(knobs):
            continue
        more = [c for k in names(knobs) for c in KNOB_MORE_SHAPES.get(k, [])]
        for c in KNOB_SHAPES + more:
            cases.append((c, replace(hopper_fwd_default(c[5], c[6]), **knobs)))
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="three small cases (for sanitizers)")
    ap.add_argument("--knob", help="only the cases of the knob sets that set this knob or "
                    "choose this schedule")
    ap.add_argument("--split", action="store_true", help="with --small: the split-tail cases")
    ap.add_argument("--defaults", action="store_true", help="only the cases that run the "
                    "default configs (no knob sets)")
    ap.add_argument("--save", action="store_true", help=f"write the verdicts to {RESULTS}.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU here; the compile-only checks are tests/test_fa4_final_compile.py")
        return 0
    cases = ([(c, None) for c in CASES] if args.defaults
             else all_cases(args.small, args.knob, args.split))
    if not args.save:
        return 1 if checks.run_cases(check_case, cases) else 0
    from utils import results

    rows = []
    for case, config in cases:
        ok, line = check_case(*case, config=config)
        print(line, flush=True)
        b, sq, sk, h, hk, d, causal, dtype, window = case
        rows.append({"name": "forward against float64", "metric": "passed", "value": bool(ok),
                     "unit": "verdict", "impl": "fa4_final", "b": b, "sq": sq, "sk": sk,
                     "h": h, "h_kv": hk, "d": d, "causal": causal,
                     "dtype": str(dtype).removeprefix("torch."), "window": window,
                     "config": "default" if config is None else str(config), "line": line})
    command = "python -m measure.fwd_checks " + " ".join(argv if argv is not None else
                                                         sys.argv[1:])
    print("wrote", results.save(RESULTS, rows, command=command))
    return 0 if all(r["value"] for r in rows) else 1

if __name__ == "__main__":
    sys.exit(main())
