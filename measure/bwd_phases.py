"""Where the backward's time goes, kernel by kernel: fa4_final's preprocess, main and
postprocess kernels beside the FA4 package's, from the GPU's own kernel durations.

    python -m measure.bwd_phases                       # D = 128 and 64, S = 4096 and 16384
    python -m measure.bwd_phases --dims 128 --seqlens 4096 --causal yes --rounds 5

Each implementation's backward (torch.autograd.grad of one forward's output) runs ``--rep``
times per round under torch.profiler (CUDA activity only: CUPTI's record of every kernel's
start and end on the device, no replay, no counters); the kernels are grouped into phases by
name (``phase_of``): ``pre`` (delta, lse in log2 units, the zeroed dQ accumulator), ``main``,
``post`` (dQ from float32 to the input dtype; dK and dV when the main kernel leaves them in
float32), ``other`` (everything else the call launched: memsets, copies, casts), and
``total`` (their sum per call). Implementations and rounds interleave (each round in the other
order from the last); a row is the median over rounds of a phase's device milliseconds per
call, with the rounds' values. ``--flush``: the L2 overwritten before every call (the flush's
own kernel, an in-place bitwise NOT, is left out by its name). The kernels' names are stored
with each row, so a phase that caught the wrong kernel shows.

The rows answer the issue's first question, "which of the three kernels loses the time", with
no profiler replay; ncu's counters (measure.profile_fa4_final) are the next step for the kernel
that does. Writes results/<gpu>/<name>.json (utils.results.save, with provenance).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

import torch

from utils import bench, results

PRODUCES = [
    ("results/h200/bwd_phases.json", "python -m measure.bwd_phases --rounds 5",
     "the backward's device time per kernel phase (preprocess, main, postprocess, other, "
     "total) of fa4_final (default, deterministic, and the deterministic candidate with two "
     "dQ copies and early release, fa4_final_det_c2) and the FA4 package, D = 128 and 64, "
     "S = 4096 and 16384, causal or not, from torch.profiler's CUDA kernel records"),
    ("results/h200/bwd_phases_det_*.json",
     "python -m measure.bwd_phases --rounds 5 --dims 128 --impls fa4_final "
     "fa4_final_deterministic fa4_final_det_c2 fa4_final_det_early fa4_final_det_c4 "
     "fa4_final_det_c4_store fa4_final_det_c2_store --name bwd_phases_det_d128",
     "the same phases for the deterministic candidates of issue 34 (CANDIDATES: dQ copies, "
     "early release and first store through config=) beside the default and today's "
     "deterministic mode, one head dim a file"),
    ("results/h100/bwd_phases_det_db*.json",
     "python -m measure.bwd_phases --rounds 5 --dims 128 --impls fa4_final "
     "fa4_final_deterministic fa4_final_det_64 fa4_final_det_db64 --name bwd_phases_det_db128 "
     "(det_db64: --dims 64 with fa4_final fa4_final_deterministic fa4_final_det_db)",
     "an H100 visit: the deterministic mode with two dQ staging buffers (Note [Two dQ "
     "buffers]) beside the default and the one-buffer deterministic mode"),
    ("results/h100/bwd_phases_det_overlap*.json",
     "python -m measure.bwd_phases --rounds 5 --dims 64 --impls fa4_final "
     "fa4_final_deterministic fa4_final_det_db fa4_final_det_overlap --name "
     "bwd_phases_det_overlap64 (overlap128: --dims 128 with fa4_final fa4_final_deterministic "
     "fa4_final_det_db64 fa4_final_det_overlap64 fa4_final_det_64)",
     "an H100 visit: two dQ staging buffers with a dQ warp each (dq_adds_overlap, "
     "Note [Adds in flight across turns]) beside two buffers with one warp and the one-buffer "
     "deterministic mode of that time; the overlap build became the deterministic default "
     "after this run"),
    ("results/h100/bwd_phases_rows_shuffled.json",
     "python -m measure.bwd_phases --rounds 7 --dims 64 --impls fa4_final "
     "fa4_final_rows_shuffled fa4_package --name bwd_phases_rows_shuffled",
     "an H100 visit: lse and delta by shuffles at D = 64 (rows_shuffled, "
     "Note [Per-query values by shuffle]) against the build without it and the FA4 package; "
     "rows_shuffled "
     "became the D = 64 default after this run"),
    ("results/h100/bwd_phases_defaults*.json",
     "python -m measure.bwd_phases --rounds 5 --dims 128 64 --impls fa4_final "
     "fa4_final_deterministic fa4_package --name bwd_phases_defaults (add --flush: _flush)",
     "an H100 visit: fa4_final's backward as a call runs it, the default and the deterministic "
     "mode (two dQ buffers with a dQ warp each at D = 64 and 128; lse and delta by shuffles at "
     "D = 64), beside the FA4 package, D = 128 and 64; calls back to back, and one call at a "
     "time after an L2 flush"),
    ("results/h100/bwd_phases_rows_shuffled128.json",
     "python -m measure.bwd_phases --rounds 7 --dims 128 --causal yes --impls fa4_final "
     "fa4_final_rows_shuffled fa4_package --name bwd_phases_rows_shuffled128",
     "the same visit: lse and delta by shuffles at D = 128, causal (the dense default is an "
     "80-row tile, which it refuses), against the default and the FA4 package"),
    ("results/h100/bwd_phases_det_*.json",
     "python -m measure.bwd_phases --rounds 5 --dims 128 --impls fa4_final "
     "fa4_final_deterministic fa4_final_det_c2 fa4_final_det_c4 fa4_final_det_c4_store "
     "--name bwd_phases_det_d128 (d128b: fa4_final fa4_final_deterministic "
     "fa4_final_det_early fa4_final_det_c2_store; d64: --dims 64 with fa4_final "
     "fa4_final_deterministic fa4_final_det_c2 fa4_final_det_early fa4_final_det_c4_store)",
     "an H100 visit: the same phases, the candidates split over three runs of five rounds"),
    ("results/h100/bwd_phases_release_all*.json",
     "python -m measure.bwd_phases --rounds 9 --dims 128 64 --impls fa4_final "
     "fa4_final_release_all fa4_final_deterministic fa4_final_det_release_all --name "
     "bwd_phases_release_all9 (add --flush: _flush; five rounds: release_all (D = 128), "
     "release_all_d64, release_all_flush)",
     "an H100 visit: every MMA thread releasing its stages (release_every_thread, Note "
     "[Release after the warp's reads]) against one lane a warp, then the default, in the "
     "default and the deterministic mode"),
    ("results/h100/bwd_phases_every_thread_default*.json",
     "python -m measure.bwd_phases --rounds 7 --dims 128 64 --impls fa4_final fa4_package "
     "fa4_final_deterministic --name bwd_phases_every_thread_default (add --flush: _flush)",
     "the same H100 visit, with release_every_thread the default: fa4_final beside the FA4 "
     "package and the deterministic mode"),
    ("results/h100/bwd_phases_rows_early.json",
     "python -m measure.bwd_phases --rounds 5 --dims 128 64 --impls fa4_final "
     "fa4_final_rows_early fa4_package --name bwd_phases_rows_early",
     "an H100 visit: lse and delta read into registers before the GEMM waits (rows_early, "
     "Note [Per-query values before the wait]) against the build without it and the FA4 "
     "package, D = 128 and 64"),
    ("results/h100/bwd_phases_rows_early_swapped*.json",
     "python -m measure.bwd_phases --rounds 5 --dims 256 192 --impls fa4_final "
     "fa4_final_rows_early --name bwd_phases_rows_early_swapped (_flush: --rounds 7 --flush; "
     "9: --rounds 9)",
     "the same H100 visit: rows_early in the swapped step (D = 192, 256, dkv_swap_ab) against "
     "the build without it, three runs; rows_early became those builds' default after them"),
    ("results/h100/bwd_phases_det_rotated*.json",
     "python -m measure.bwd_phases --rounds 5 --dims 64 --impls fa4_final "
     "fa4_final_deterministic fa4_final_det_rotated --name bwd_phases_det_rotated64 (128: "
     "--dims 128 with fa4_final_det_rotated64; _flush: add --flush)",
     "an H100 visit: the rotated walk (dq_rotated, Note [A rotated walk]) beside the "
     "deterministic default and the default, D = 64 and 128, calls back to back and one call "
     "at a time after an L2 flush; it stayed an option (config=) after them"),
    ("results/h100/bwd_phases_det_copies_overlap*.json",
     "python -m measure.bwd_phases --rounds 5 --dims 64 --impls fa4_final "
     "fa4_final_deterministic fa4_final_det_c2_overlap fa4_final_det_c4_overlap --name "
     "bwd_phases_det_copies_overlap64 (128: --dims 128 with fa4_final_det_c2_overlap64 "
     "fa4_final_det_c4_overlap64; _flush: add --flush)",
     "an H100 visit: accumulator copies (2, 4; first stores) on the overlapped two-buffer "
     "kernel beside the deterministic default and the default, D = 64 and 128, calls back to "
     "back and one call at a time after an L2 flush, after their GPU tests had passed"),
]

IMPLS = ("fa4_final", "fa4_final_deterministic", "fa4_final_det_c2", "fa4_package")
# deterministic candidates of issue 34, reached through config= (a HopperBwdConfig) only: the
# default's tiles with these knobs (Note [dQ copies] in fa4_final.common.bwd_tiles); their
# backward runs runtime.prologue.backward_into on the forward's out and lse, the three kernels
# the autograd path launches
CANDIDATES = {
    "fa4_final_det_c2": {"dq_copies": 2, "dq_early_release": True},
    "fa4_final_det_c4": {"dq_copies": 4, "dq_early_release": True},
    "fa4_final_det_c4_late": {"dq_copies": 4},
    "fa4_final_det_early": {"dq_early_release": True},
    # the first visitor of each copy stores instead of adding: no zeroing in bwd_pre, bwd_post
    # reads the visited copies only (HopperBwdConfig.dq_first_store)
    "fa4_final_det_c4_store": {"dq_copies": 4, "dq_early_release": True,
                               "dq_first_store": True},
    "fa4_final_det_c2_store": {"dq_copies": 2, "dq_early_release": True,
                               "dq_first_store": True},
    # two dQ staging buffers (HopperBwdConfig.dq_buffers, Note [Two dQ buffers] in
    # fa4_final.hopper.bwd) at the default's tile where it fits (D = 64, D = 128 causal) ...
    "fa4_final_det_db": {"dq_buffers": 2, "dq_adds_overlap": False},
    # ... and at 64 query rows with dQ = dS K (the D = 128 causal tile) for D = 128 not causal,
    # where 80 rows leave no room for the second buffer; fa4_final_det_64 is the same tile with
    # one buffer, so the two rows tell the tile's share from the buffer's
    "fa4_final_det_db64": {"dq_buffers": 2, "dq_adds_overlap": False, "tile_m": 64,
                           "dq_swap_ab": False},
    "fa4_final_det_64": {"tile_m": 64, "dq_swap_ab": False},
    # two buffers with a step's add issued before the previous step's turn passes
    # (HopperBwdConfig.dq_adds_overlap, Note [Adds in flight across turns] in
    # fa4_final.hopper.bwd), at the same tiles as fa4_final_det_db and _det_db64
    "fa4_final_det_overlap": {"dq_buffers": 2, "dq_adds_overlap": True},
    "fa4_final_det_overlap64": {"dq_buffers": 2, "dq_adds_overlap": True, "tile_m": 64,
                                "dq_swap_ab": False},
    # the overlapped two-buffer kernel with accumulator copies (first stores): turns only among
    # the key tiles of one copy, two adds in flight (Note [dQ copies] in
    # fa4_final.common.bwd_tiles); _64 at D = 128 not causal, the tile two buffers need
    "fa4_final_det_c2_overlap": {"dq_buffers": 2, "dq_adds_overlap": True, "dq_copies": 2,
                                 "dq_first_store": True},
    "fa4_final_det_c4_overlap": {"dq_buffers": 2, "dq_adds_overlap": True, "dq_copies": 4,
                                 "dq_first_store": True},
    "fa4_final_det_c2_overlap64": {"dq_buffers": 2, "dq_adds_overlap": True, "dq_copies": 2,
                                   "dq_first_store": True, "tile_m": 64, "dq_swap_ab": False},
    "fa4_final_det_c4_overlap64": {"dq_buffers": 2, "dq_adds_overlap": True, "dq_copies": 4,
                                   "dq_first_store": True, "tile_m": 64, "dq_swap_ab": False},
    # every MMA thread releases a Q or dO stage (HopperBwdConfig.release_every_thread,
    # Note [Release after the warp's reads]), in the default mode and the deterministic one:
    # timed against the one-lane release while that was the default
    # (results/h100/bwd_phases_release_all*.json), the default since; the _one_lane rows time
    # the old release against it
    "fa4_final_release_all": {"deterministic": False, "release_every_thread": True},
    "fa4_final_det_release_all": {"release_every_thread": True},
    "fa4_final_one_lane": {"deterministic": False, "release_every_thread": False},
    "fa4_final_det_one_lane": {"release_every_thread": False},
    # lse and delta read into registers before the GEMM waits (HopperBwdConfig.rows_early,
    # Note [Per-query values before the wait] in fa4_final.hopper.bwd), default mode and
    # deterministic
    "fa4_final_rows_early": {"deterministic": False, "rows_early": True},
    "fa4_final_det_rows_early": {"rows_early": True},
    # ... and the lazy reads, to time the swapped builds (D = 192, 256) against their default
    "fa4_final_rows_lazy": {"deterministic": False, "rows_early": False},
    # lse and delta an eighth per lane group, passed on by shuffles (rows_shuffled,
    # Note [Per-query values by shuffle]): D = 64, and D = 128 causal (tile_m 64)
    "fa4_final_rows_shuffled": {"deterministic": False, "rows_shuffled": True},
    # the deterministic default with the rotated walk (HopperBwdConfig.dq_rotated,
    # Note [A rotated walk] in fa4_final.common.bwd_tiles): D = 64, and at D = 128 the
    # deterministic tile (64 rows, dQ = dS K). Causal shapes and heads of more than 64 key
    # tiles keep the plain walk with the rotated build's registers (40 / 224): a control
    "fa4_final_det_rotated": {"dq_buffers": 2, "dq_adds_overlap": True, "dq_rotated": True},
    "fa4_final_det_rotated64": {"dq_buffers": 2, "dq_adds_overlap": True, "dq_rotated": True,
                                "tile_m": 64, "dq_swap_ab": False},
}
CHOICES = (*IMPLS, *(c for c in CANDIDATES if c not in IMPLS))
PHASES = ("pre", "main", "post", "other", "total")

# (phase, pattern) in order: the first match names a kernel's phase
_PHASE_PATTERNS = (
    ("pre", re.compile(r"BackwardPre|Preprocess|bwd_pre", re.I)),
    ("post", re.compile(r"BackwardPost|Postprocess|bwd_post|convert_dq", re.I)),
    ("main", re.compile(r"HopperBackward|HopperVarlenBackward|FlashAttentionBackward|"
                        r"flash_bwd", re.I)),
)
# this driver's own L2 flush: an in-place bitwise NOT of 256 MB, a kernel no backward launches,
# so its records can be told apart by name (a zero fill could be a backward's own memset)
FLUSH_KERNEL = re.compile(r"bitwise_not", re.I)
_FLUSH: list = []


def flush_l2() -> None:
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda"))
    _FLUSH[0].bitwise_not_()


def phase_of(kernel_name: str) -> str:
    """The phase of a kernel by its name; ``other`` when no pattern matches."""
    for phase, pattern in _PHASE_PATTERNS:
        if pattern.search(kernel_name):
            return phase
    return "other"


def device_ms(event) -> float:
    """A profiler kernel event's device time in milliseconds (the attribute's name moved
    between torch releases)."""
    for attr in ("device_time", "cuda_time", "self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value:
            return float(value) / 1000.0
    return 0.0


def phase_times(events, calls: int, flushed: bool) -> tuple[dict, dict]:
    """({phase: ms per call}, {phase: sorted kernel names}) of profiler ``events`` that cover
    ``calls`` calls; with ``flushed``, the L2 flush's kernels are left out."""
    ms = dict.fromkeys(PHASES, 0.0)
    names: dict[str, set] = {p: set() for p in PHASES}
    for ev in events:
        kind = getattr(ev, "device_type", None)
        if kind is None or "CUDA" not in str(kind):
            continue
        if flushed and FLUSH_KERNEL.search(ev.name):
            continue
        phase = phase_of(ev.name)
        t = device_ms(ev)
        ms[phase] += t / calls
        ms["total"] += t / calls
        names[phase].add(ev.name[:160])
    return ms, {p: sorted(v) for p, v in names.items() if v}


def _backward_call(impl: str, shape: bench.Shape):
    """A zero-argument call running ``impl``'s backward once on fixed inputs (the forward ran
    once before)."""
    q, k, v = bench._inputs(shape, torch.bfloat16, requires_grad=True, seed=1)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    if impl in CANDIDATES:
        from dataclasses import replace

        from fa4_final import flash_attn_func
        from fa4_final.hopper.config import hopper_bwd_default
        from fa4_final.runtime.prologue import backward_into

        cfg = replace(hopper_bwd_default(shape.d, shape.causal),
                      **{"deterministic": True, **CANDIDATES[impl]})
        with torch.no_grad():
            out, lse = flash_attn_func(q, k, v, causal=shape.causal, return_lse=True)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        return lambda: backward_into(q.detach(), k.detach(), v.detach(), out, lse, dout,
                                     *grads, causal=shape.causal,
                                     deterministic=cfg.deterministic, config=cfg)
    if impl.startswith("fa4_final"):
        from fa4_final.api.autograd import attention_autograd

        out = attention_autograd(q, k, v, shape.causal, None, impl.endswith("deterministic"))
    else:
        from flash_attn.cute import flash_attn_func

        out = flash_attn_func(q, k, v, causal=shape.causal)[0]
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def measure_shape(shape: bench.Shape, impls, rounds: int, rep: int, flush: bool) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    calls, rows = {}, []
    for impl in impls:
        try:
            calls[impl] = _backward_call(impl, shape)
            calls[impl]()  # compile and warm up outside the records
        except Exception as exc:  # the FA4 package missing, a refused shape: say so
            rows.append(_row(impl, shape, "total", None, [], error=bench.error_text(exc)))
    torch.cuda.synchronize()
    per_round: dict[str, list[dict]] = {impl: [] for impl in calls}
    names: dict[str, dict] = {}
    for r in range(rounds):
        for impl in bench.round_order(list(calls), r):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(rep):
                    if flush:
                        flush_l2()
                    calls[impl]()
                torch.cuda.synchronize()
            ms, seen = phase_times(prof.events(), rep, flush)
            per_round[impl].append(ms)
            names[impl] = seen
    for impl, per in per_round.items():
        for phase in PHASES:
            values = [p[phase] for p in per]
            rows.append(_row(impl, shape, phase, values, names[impl].get(phase, []),
                             flush=flush))
    return rows


def _row(impl, shape, phase, values, kernels, error=None, flush=False) -> dict:
    row = {"impl": impl, "metric": f"{phase}_ms", "unit": "ms",
           "value": statistics.median(values) if values else None,
           "value_rounds": values or [], "phase": phase, "dtype": "bf16",
           "b": shape.b, "s": shape.s, "h": shape.h, "d": shape.d, "causal": shape.causal,
           "mode": "flush" if flush else "back_to_back", "kernels": kernels}
    if values and row["value"]:
        row["spread"] = (max(values) - min(values)) / row["value"]
    if error:
        row["error"] = error
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--name", default="bwd_phases")
    ap.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--dims", nargs="+", type=int, default=[128, 64])
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=CHOICES)
    ap.add_argument("--rounds", type=int, default=bench.MIN_ROUNDS)
    ap.add_argument("--rep", type=int, default=10, help="backward calls per round")
    ap.add_argument("--flush", action="store_true", help="flush the L2 before every call")
    args = ap.parse_args(argv)
    if args.rounds < bench.MIN_ROUNDS:
        ap.error(f"--rounds: at least {bench.MIN_ROUNDS}")
    if not torch.cuda.is_available():
        print("measure.bwd_phases: needs a CUDA GPU", file=sys.stderr)
        return 2
    causal = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    shapes = [bench.Shape.standard(s, d, c) for d in args.dims for s in args.seqlens
              for c in causal]
    rows = []
    for shape in shapes:
        rows += measure_shape(shape, args.impls, args.rounds, args.rep, args.flush)
        print(f"done {shape}", flush=True)
    path = results.save(args.name, rows, command="python -m measure.bwd_phases " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    print(f"wrote {path}")
    for shape in shapes:
        print(f"D={shape.d} S={shape.s} causal={shape.causal} (ms per call, median of rounds)")
        for impl in args.impls:
            got = {r["phase"]: r for r in rows if r["impl"] == impl and r["s"] == shape.s
                   and r["d"] == shape.d and r["causal"] == shape.causal}
            cells = "  ".join(f"{p} {got[p]['value']:.3f}" if got.get(p, {}).get("value")
                              is not None else f"{p} -" for p in PHASES)
            print(f"  {impl:24s} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ----------------------------------------------------------------------------------------------
# Reading a stored run (labs/hopper_backward_compiled.ipynb)

KERNEL_PHASES = ("pre", "main", "post")


def phase_table(res, impl: str = "fa4_final", peer: str = "fa4_package") -> list[str]:
    """Per stored shape: each phase's device time, ``impl`` against ``peer`` (ms), and the
    difference; medians of the rounds."""
    shapes = sorted({(r["d"], r["s"], r["causal"], r["mode"]) for r in res.rows},
                    key=lambda t: (-t[0], t[1], t[2], t[3]))
    got = {(r["impl"], r["d"], r["s"], r["causal"], r["mode"], r["phase"]): r["value"]
           for r in res.rows if r.get("value") is not None}
    lines = [f"{'shape':32s} " + " ".join(f"{p + ' ours/FA4 (ms)':>22s}" for p in KERNEL_PHASES)]
    for d, s, causal, mode in shapes:
        cells = []
        for p in KERNEL_PHASES:
            a, b = got.get((impl, d, s, causal, mode, p)), got.get((peer, d, s, causal, mode, p))
            cells.append(f"{a:.3f}/{b:.3f} ({a - b:+.3f})" if a is not None and b is not None
                         else "-")
        name = f"D={d} S={s} {'causal' if causal else 'dense'} {mode}"
        lines.append(f"{name:32s} " + " ".join(f"{c:>22s}" for c in cells))
    return lines


def where_the_gap_is(res, d: int = 128, impl: str = "fa4_final",
                     peer: str = "fa4_package") -> str:
    """The phase holding the most of ``impl``'s extra time over ``peer`` at head dim ``d``,
    summed over the stored shapes and modes; "none" if ``impl`` is nowhere slower."""
    extra = dict.fromkeys(KERNEL_PHASES, 0.0)
    got = {(r["impl"], r["s"], r["causal"], r["mode"], r["phase"]): r["value"]
           for r in res.rows if r["d"] == d and r.get("value") is not None}
    for (i, s, causal, mode, p), v in got.items():
        if i == impl and p in extra and (peer, s, causal, mode, p) in got:
            extra[p] += v - got[(peer, s, causal, mode, p)]
    phase = max(extra, key=extra.get)
    return phase if extra[phase] > 0 else "none"


def totals(res) -> dict:
    """(impl, d, s, causal, mode) -> total device time (ms) of one call, every stored total."""
    return {(r["impl"], r["d"], r["s"], r["causal"], r["mode"]): r["value"] for r in res.rows
            if r["phase"] == "total" and r.get("value")}


def _totals_over_default(res):
    """(impl, d, s, causal, mode, total / the default's total, the table of totals) per stored
    total that has the default's beside it, largest head dim first."""
    got = totals(res)
    for (impl, d, s, causal, mode), v in sorted(got.items(), key=lambda kv: (-kv[0][1],
                                                                              kv[0][2:])):
        base = got.get(("fa4_final", d, s, causal, mode))
        if base:
            yield impl, d, s, causal, mode, v / base, got


def deterministic_lines(res) -> list[str]:
    """Per stored shape: the deterministic build's total device time over the default's."""
    return [f"D={d} S={s} {'causal' if causal else 'dense'} {mode}: deterministic / default "
            f"{ratio:.2f}"
            for impl, d, s, causal, mode, ratio, _ in _totals_over_default(res)
            if impl == "fa4_final_deterministic"]


def candidate_lines(res) -> list[str]:
    """Per stored shape and deterministic candidate (CANDIDATES): its total device time over
    the default's, beside today's deterministic mode's; none before a GPU has measured one."""
    lines = []
    for impl, d, s, causal, mode, ratio, got in _totals_over_default(res):
        if impl in CANDIDATES:
            today = got.get(("fa4_final_deterministic", d, s, causal, mode))
            base = got[("fa4_final", d, s, causal, mode)]
            was = f" (deterministic today {today / base:.2f})" if today else ""
            lines.append(f"D={d} S={s} {'causal' if causal else 'dense'} {mode}: {impl} / "
                         f"default {ratio:.2f}{was}")
    return lines
