"""Train the same small GPT with fa4_final and with SDPA's kernels, from the same weights on the
same batches, and store the loss curves and step times (solutions/ch13_training.py holds the task,
the model and Note [How close two loss curves must be]).

    python -m measure.package_training                  # H100/H200: about a minute
    python -m measure.package_training --compile        # the same through torch.compile
    python -m measure.package_training --steps 60 --no-save
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from solutions import ch13_training as tr

PRODUCES = [
    ("results/h200/fa4_final_training*.json", "python -m measure.package_training",
     "a small GPT trained with fa4_final, SDPA flash and SDPA memory-efficient from the same "
     "weights: loss curves, step times, the gap against the yardstick of the two SDPA kernels "
     "(--compile: the same through torch.compile, fa4_final_training_compiled)"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=tr.TrainConfig.steps)
    parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True)")
    parser.add_argument("--name", default="fa4_final_training", help="results file name")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    command = "python -m measure.package_training " + " ".join(argv or sys.argv[1:])
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing trained (tests/test_ch13_training.py runs the CPU "
              "pieces)")
        return 1
    cfg = replace(tr.TrainConfig(), steps=args.steps)
    runs = {name: tr.train(name, cfg, "cuda", compile=args.compile)
            for name in ("fa4_final", "sdpa_flash", "sdpa_efficient")}
    verdict = tr.compare(runs, cfg)
    print(tr.report(runs, cfg, verdict))
    if not args.no_save:
        from utils.results import save

        name = args.name + ("_compiled" if args.compile else "")
        print(f"saved {save(name, tr.rows_of(runs, cfg, verdict), command)}")
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
