"""What the drivers that time a grid of shapes in two modes share: their timing options, and one
shape's rows in every mode (``flush``: the L2 overwritten before every call; ``back_to_back``:
calls one after another)."""

from __future__ import annotations

import argparse
import time

from utils import bench

MODES = ("flush", "back_to_back")


def add_timing_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, default=bench.MIN_ROUNDS)
    ap.add_argument("--rep", type=int, default=20, help="timed calls per round at most")
    ap.add_argument("--max-seconds", type=float, default=0.25,
                    help="one implementation's timed calls in one round take about this long")
    ap.add_argument("--deadline", type=float, default=None, help="seconds; stop after a shape")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)


def check_timing_args(ap: argparse.ArgumentParser, args) -> None:
    if args.rounds < bench.MIN_ROUNDS:
        ap.error(f"--rounds: at least {bench.MIN_ROUNDS}")


def past_deadline(args, start: float) -> bool:
    """Whether the run has passed ``--deadline`` seconds since ``start`` (time.monotonic)."""
    return args.deadline is not None and time.monotonic() - start > args.deadline


def deadline_note(args, done: int, total: int) -> str:
    return f"{done} of {total} shapes" + ("" if done == total else
                                          f" (stopped at --deadline {args.deadline} s)")


def rows_in_modes(calls: dict, extra: dict, fields: dict, flops: float, args) -> list[dict]:
    """One shape's rows: every call of ``calls`` timed in interleaved rounds in each of
    ``args.modes``, with the shape's ``fields`` and each implementation's ``extra`` fields; an
    implementation of ``extra`` that was not timed gets a row saying why (its ``error``)."""
    rows = []
    for mode in args.modes:
        measured = bench.interleaved(calls, rounds=args.rounds, rep=args.rep,
                                     max_seconds=args.max_seconds, flush_l2=(mode == "flush"))
        for name, m in measured.items():
            rows.append({"impl": name, "mode": mode, **fields, **extra.get(name, {}),
                         **m.fields(flops)})
        for name, fx in extra.items():
            if name not in measured:
                rows.append({"impl": name, "mode": mode, **fields, "ms": None, "tflops": None,
                             **fx})
    return rows
