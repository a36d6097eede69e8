"""What the drivers that time a grid of shapes in several modes share: their timing options, and
one shape's rows in every mode (``flush``: the L2 overwritten before every call;
``back_to_back``: calls one after another; ``graph``: each call captured once in a CUDA graph
and the replays timed back to back, as a serving engine replays a decode step, so that no
implementation's host work, Python or launches, is in the time; opt-in, ``--modes``)."""

from __future__ import annotations

import argparse
import time

from utils import bench

MODES = ("flush", "back_to_back")  # the default modes
ALL_MODES = (*MODES, "graph")


def add_timing_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, default=bench.MIN_ROUNDS)
    ap.add_argument("--rep", type=int, default=20, help="timed calls per round at most")
    ap.add_argument("--max-seconds", type=float, default=0.25,
                    help="one implementation's timed calls in one round take about this long")
    ap.add_argument("--deadline", type=float, default=None, help="seconds; stop after a shape")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=ALL_MODES)


def check_timing_args(ap: argparse.ArgumentParser, args) -> None:
    if args.rounds < bench.MIN_ROUNDS:
        ap.error(f"--rounds: at least {bench.MIN_ROUNDS}")


def past_deadline(args, start: float) -> bool:
    """Whether the run has passed ``--deadline`` seconds since ``start`` (time.monotonic)."""
    return args.deadline is not None and time.monotonic() - start > args.deadline


def deadline_note(args, done: int, total: int) -> str:
    return f"{done} of {total} shapes" + ("" if done == total else
                                          f" (stopped at --deadline {args.deadline} s)")


def capture_in_graph(fn):
    """``fn`` captured in a CUDA graph: three warm-up calls on a side stream (compilation,
    allocations, as torch.cuda.graph asks), then one call recorded; returns the replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graphed(calls: dict, capture=capture_in_graph) -> tuple[dict, dict]:
    """(replays, errors): each call of ``calls`` as the replay of its CUDA graph, and for a
    call that cannot be captured (a host synchronisation, a host read of device data) the
    reason, which its row stores as ``error``."""
    replays, errors = {}, {}
    for name, fn in calls.items():
        try:
            replays[name] = capture(fn)
        except Exception as e:  # noqa: BLE001 - any failure to capture is the row's finding
            errors[name] = f"not captured in a CUDA graph: {type(e).__name__}: {e}"[:300]
    return replays, errors


def rows_in_modes(calls: dict, extra: dict, fields: dict, flops: float, args,
                  capture=capture_in_graph) -> list[dict]:
    """One shape's rows: every call of ``calls`` timed in interleaved rounds in each of
    ``args.modes``, with the shape's ``fields`` and each implementation's ``extra`` fields; an
    implementation of ``extra`` that was not timed, or (mode ``graph``) not captured, gets a
    row saying why (its ``error``)."""
    rows = []
    for mode in args.modes:
        timed, errors = graphed(calls, capture) if mode == "graph" else (calls, {})
        measured = bench.interleaved(timed, rounds=args.rounds, rep=args.rep,
                                     max_seconds=args.max_seconds, flush_l2=(mode == "flush"))
        for name, m in measured.items():
            rows.append({"impl": name, "mode": mode, **fields, **extra.get(name, {}),
                         **m.fields(flops)})
        for name in [*extra, *(n for n in calls if n not in extra)]:
            if name not in measured:
                why = {"error": errors[name]} if name in errors else {}
                rows.append({"impl": name, "mode": mode, **fields, "ms": None, "tflops": None,
                             **extra.get(name, {}), **why})
        del timed  # a graph holds its memory until its replay is dropped
    return rows
