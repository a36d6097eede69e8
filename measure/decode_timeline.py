"""One decode step at batch 1 replayed from a CUDA graph, kernel by kernel: where the
microseconds of a short step go, for fa4_final's call and for cuDNN's.

    python -m measure.decode_timeline                  # GPU: profile, save the JSON
    python -m measure.decode_timeline --reps 50
    python -m measure.decode_timeline --name decode_timeline_combine --impls fa4_final_decode \
        fa4_final_decode_c8 fa4_final_decode_c16 sdpa_cudnn   # the combine candidates

Replayed at batch 1 with one query token, fa4_final's call (``num_splits=0``: the split kernel
and the combine) trails cuDNN's SDPA by a microsecond or two in results/h100/decode_pdl.json,
a step of about 16 us. The replay's time is what its kernels run plus the gaps between them;
this driver separates the two. Each implementation's call is captured in a CUDA graph
(measure._modes.capture_in_graph), replayed ``--reps`` times under torch.profiler, and the
device-side kernel records of the replays are cut into steps (the same number of kernels per
step: any other count is refused). Per step and kernel position: the kernel's duration and the
gap from the previous kernel's end (the first kernel's gap is from the previous step's last
kernel: the replays run back to back); per step the span, first start to last end.

``--impls`` takes any row of measure.decode (its ``--variants`` rows included: the combine
candidates of Note [Splits in flight] are fa4_final_decode_c8 and _c16, those of
Note [The first splits before the weights] _c4p and _c16p).

Rows (utils.results): ``impl`` (by default fa4_final_splits, sdpa_cudnn), ``s_q``, ``s`` (keys), the
attention keys of measure.decode (b = 1, 32 query heads over 8 KV heads, D = 128, bf16),
``kernel`` (its position in the step), ``name`` (its name, cut to 80 characters), ``metric``
(duration_us, gap_before_us; span_us with kernel None), ``value`` the median over the steps,
``min``, ``max``. Saved as results/<gpu>/decode_timeline.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys

RESULTS = "decode_timeline"
SHAPES = ((1, 1024), (1, 8192), (16, 8192))  # (query tokens, cached keys) at batch 1
IMPLS = ("fa4_final_splits", "sdpa_cudnn")
PRODUCES = [("results/h100/decode_timeline.json", "python -m measure.decode_timeline",
             "an H100 visit: batch-1 decode steps replayed from CUDA graphs, each kernel's "
             "duration and the gaps between kernels, fa4_final's call beside cuDNN's"),
            ("results/h100/decode_timeline_combine.json", "python -m measure.decode_timeline "
             "--name decode_timeline_combine --impls fa4_final_decode fa4_final_decode_c8 "
             "fa4_final_decode_c16 fa4_final_decode_c16p sdpa_cudnn", "an H100 visit: the same "
             "timeline with the combine's candidates (8 and 16 splits a pass, 16 with the "
             "first pass loaded early); fa4_final_decode there runs the plain combine (4 a "
             "pass), the one the call ran when this was measured")]


def steps(kernels: list[tuple], reps: int) -> list[list[tuple]]:
    """``kernels`` (name, start_us, end_us) of ``reps`` replays, in any order, as ``reps`` steps
    of the same number of kernels each, in start order."""
    if reps < 1 or not kernels or len(kernels) % reps:
        raise ValueError(f"{len(kernels)} kernel records do not split into {reps} steps of "
                         "the same length (another kernel ran during the replays?)")
    ordered = sorted(kernels, key=lambda k: k[1])
    n = len(ordered) // reps
    out = [ordered[i * n:(i + 1) * n] for i in range(reps)]
    names = [[k[0] for k in step] for step in out]
    if any(x != names[0] for x in names):
        raise ValueError("the replays did not run the same kernels in the same order")
    return out


def step_rows(kernels: list[tuple], reps: int, fields: dict) -> list[dict]:
    """Rows of one implementation at one shape from its kernel records (steps' medians); the
    first step is left out of the gaps of its first kernel (nothing ran before it)."""
    cut = steps(kernels, reps)
    rows = []

    def row(kernel, name, metric, values):
        rows.append({**fields, "kernel": kernel, "name": name, "metric": metric,
                     "value": statistics.median(values), "min": min(values),
                     "max": max(values), "unit": "us", "steps": len(values)})

    for i, (name, _s, _e) in enumerate(cut[0]):
        row(i, name[:80], "duration_us", [step[i][2] - step[i][1] for step in cut])
        gaps = ([step[i][1] - step[i - 1][2] for step in cut] if i else
                [cut[j][0][1] - cut[j - 1][-1][2] for j in range(1, len(cut))])
        if gaps:
            row(i, name[:80], "gap_before_us", gaps)
    row(None, None, "span_us", [step[-1][2] - step[0][1] for step in cut])
    return rows


def variants_of(impls) -> list[str]:
    """measure.decode's --variants that ``impls`` name (rows fa4_final_decode_<variant>)."""
    from measure.decode import VARIANTS

    names = [n.removeprefix("fa4_final_decode_") for n in impls]
    return [n for n in names if n in VARIANTS]


def _kernel_records(prof) -> list[tuple]:
    """(name, start_us, end_us) of the device-side kernel records of a torch.profiler run."""
    import torch

    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower() \
                and "memset" not in e.name.lower():
            out.append((e.name, e.time_range.start, e.time_range.end))
    return out


def measure(reps: int, impls=IMPLS) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from measure import decode
    from measure._modes import capture_in_graph

    rows = []
    for tokens, keys in SHAPES:
        shape = decode.DecodeShape(1, tokens, keys, 32, 8, 128)
        calls, extra = decode._calls(shape, 128, variants=variants_of(impls), keys_on_m=False)
        fields = {k: v for k, v in decode.row_fields(shape, 128).items()
                  if k not in ("kv_bytes", "flops", "page", "pass")}
        for impl in impls:
            if impl not in calls:
                rows.append({"impl": impl, **fields, "metric": "span_us", "value": None,
                             "error": str(extra.get(impl, {}).get("error", "no such call"))})
                continue
            replay = capture_in_graph(calls[impl])
            for _ in range(10):
                replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    replay()
                torch.cuda.synchronize()
            try:
                rows += step_rows(_kernel_records(prof), reps, {"impl": impl, **fields})
            except ValueError as exc:
                rows.append({"impl": impl, **fields, "metric": "span_us", "value": None,
                             "error": str(exc)})
            span = next((r["value"] for r in rows[::-1] if r["impl"] == impl
                         and r["metric"] == "span_us"), None)
            print(f"{impl:18s} t={tokens:2d} keys={keys:6d}: "
                  + ", ".join(f"{r['metric'][:-3]} {r['kernel']} {r['value']:.2f} us"
                              for r in rows if r["impl"] == impl and r["s_q"] == tokens
                              and r["s"] == keys and r.get("value") is not None
                              and r["metric"] != "span_us")
                  + (f"; span {span:.2f} us" if span is not None else ""), flush=True)
        del calls
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=40, help="replays profiled per call")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS),
                    help="measure.decode's rows to profile (a variant's row adds the variant)")
    ap.add_argument("--name", default=RESULTS)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("measure.decode_timeline: needs a CUDA GPU", file=sys.stderr)
        return 2
    from utils import results

    rows = measure(args.reps, args.impls)
    command = "python -m measure.decode_timeline " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print(f"stored {results.save(args.name, rows, command=command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
