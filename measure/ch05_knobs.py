"""Chapter 05's knob run: every knob of ``ch05_flash_hopper.HopperConfig`` at the chapter's target
shape, one changed at a time against the default, each verified against the float64 reference
and then timed in interleaved rounds with the peers; stored with provenance.

    python -m measure.ch05_knobs               # on an H100/H200: verify, time, save
    python -m measure.ch05_knobs --rounds 5

What is timed and how: ``solutions.ch05_flash_hopper.bench`` (BENCH_PLAN, bench_configs); how
the rows are read: labs/ch05_tuning.ipynb (``solutions.ch05_teaching.knob_lines``, and the
verdicts against the spread between runs).
"""

from __future__ import annotations

import argparse
import sys

from solutions.ch05_flash_hopper import BENCH_RESULTS

COMMAND = "python -m measure.ch05_knobs"
PRODUCES = [(f"results/h200/{BENCH_RESULTS}.json", COMMAND,
             "chapter 05's kernel with one knob changed at a time (overlap, ping-pong, stages, "
             "tiles, chapters 06-07's knobs) at S = 16384, verified then timed beside the peers")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds (at least 3)")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds: at least 3, so a round's spread can be told from an effect")
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: the knob run needs an H100/H200")
        return 1
    from solutions import ch05_flash_hopper as ch05
    from utils import results

    rows = ch05.bench(rounds=args.rounds)
    failed = [r for r in rows if not r["verified"]]
    path = results.save(BENCH_RESULTS, rows, command=COMMAND)
    print(f"wrote {path}" + (f" ({len(failed)} configs FAILED their check)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
