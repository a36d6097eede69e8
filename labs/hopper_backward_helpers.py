"""The Hopper backward lab's reading of the deterministic candidates' run on an H100
(results/h100/bwd_phases_det_*.json, measure.bwd_phases): the lines it prints and the claims its
prose makes (utils.claims)."""

from __future__ import annotations

from measure import bwd_phases
from utils.claims import claim

CANDIDATE_RUNS = ("bwd_phases_det_d128", "bwd_phases_det_d128b", "bwd_phases_det_d64")
GPU = "h100"


def load_runs(quiet: bool = False) -> dict:
    """name -> the stored run, for each of CANDIDATE_RUNS that exists (printing the ones that
    do not, unless ``quiet``)."""
    from utils import results

    runs = {}
    for name in CANDIDATE_RUNS:
        try:
            runs[name] = results.load(name, gpu=GPU)
        except FileNotFoundError:
            if not quiet:
                print(f"{name}: not measured (no results/{GPU}/{name}.json)")
    return runs


def over_deterministic(res) -> list[tuple]:
    """(impl, d, s, causal, candidate's total / today's deterministic total in the same run)
    for every candidate of measure.bwd_phases.CANDIDATES in ``res``."""
    got = bwd_phases.totals(res)
    out = []
    for (impl, d, s, causal, mode), v in sorted(got.items()):
        today = got.get(("fa4_final_deterministic", d, s, causal, mode))
        if impl in bwd_phases.CANDIDATES and today:
            out.append((impl, d, s, causal, v / today))
    return out


def ratio(runs: dict, impl: str, d: int, s: int, causal: bool):
    """``impl``'s total over today's deterministic mode's at one shape, from the run that timed
    it; None if none did."""
    for res in runs.values():
        for i, dd, ss, cc, r in over_deterministic(res):
            if (i, dd, ss, cc) == (impl, d, s, causal):
                return r
    return None


def lines(runs: dict) -> list[str]:
    """Every candidate at every shape: its total over the default's and over today's
    deterministic mode's, in the run that timed it."""
    out = []
    for name, res in runs.items():
        out.append(f"{name}:")
        out += ["  " + line for line in bwd_phases.candidate_lines(res)]
    return out


def _all_over(d: int):
    """over_deterministic's rows at head dim d, from every stored candidate run."""
    found = []
    for res in load_runs(quiet=True).values():
        found += [x for x in over_deterministic(res) if x[1] == d]
    return found


@claim("HB.candidates_not_better_d128", "bwd_phases_det_d128",
       "at D = 128 no deterministic candidate's backward is more than 2% faster than today's "
       "deterministic mode at any shape of the H100 runs, and every one is slower at both "
       "causal shapes", gpu=GPU)
def _not_better_d128(res):
    found = _all_over(128)
    causal = [r for _, _, _, c, r in found if c]
    ok = bool(found) and all(r >= 0.98 for *_, r in found) and all(r > 1 for r in causal)
    return ok, (f"{len(found)} (candidate, shape) pairs, over today's deterministic mode "
                f"{min(r for *_, r in found):.2f}-{max(r for *_, r in found):.2f}; causal "
                f"{min(causal, default=float('nan')):.2f}-{max(causal, default=float('nan')):.2f}")


@claim("HB.c4_store_helps_d64_s4096_dense", "bwd_phases_det_d64",
       "at D = 64, S = 4096, not causal, four dQ copies with first store "
       "(fa4_final_det_c4_store) take less total time than today's deterministic mode", gpu=GPU)
def _c4_store_d64(res):
    r = next((r for i, d, s, c, r in over_deterministic(res)
              if (i, d, s, c) == ("fa4_final_det_c4_store", 64, 4096, False)), None)
    return r is not None and r < 1, f"fa4_final_det_c4_store / deterministic: {r}"


# ------------------------------------------------------------------------------------------
# Section 8: ncu's profile of the deterministic mode (measure.profile_bwd_det) and the model's
# prediction for two dQ staging buffers (measure.dq_turns_model)

PROFILE = "bwd_det_profile"
PROFILE_METRICS = (  # (metric, what it is, unit)
    ("duration_ms", "main kernel at ncu's locked clock", "ms"),
    ("tensor_pipe_active_pct", "tensor pipe active", "%"),
    ("samples_barrier_pct", "warp samples stalled at a barrier", "%"),
    ("turn_wait_samples_pct", "samples at the dQ turn's acquire loads", "%"),
    ("dq_update_samples_pct", "samples at the dQ accumulator's adds", "%"),
)


def _stored(name: str):
    """results/<GPU>/<name>.json, or None after saying it was not measured."""
    from utils import results

    try:
        return results.load(name, gpu=GPU)
    except FileNotFoundError:
        print(f"{name}: not measured (no results/{GPU}/{name}.json)")
        return None


def load_profile():
    """The stored profile run of the deterministic mode (section 8), or None."""
    return _stored(PROFILE)


def profile_row(res, impl: str, metric: str):
    return next((r for r in res.rows if r["impl"] == impl and r["metric"] == metric), None)


def profile_value(res, impl: str, metric: str):
    r = profile_row(res, impl, metric)
    return None if r is None else r["value"]


def profile_lines(res, impls=("fa4_final", "fa4_final_deterministic")) -> list[str]:
    """The counters of PROFILE_METRICS for each build, then each build's most sampled
    instruction with its stall reason."""
    out = [f"{'':42s}" + "".join(f"{i:>26s}" for i in impls)]
    for metric, what, unit in PROFILE_METRICS:
        vals = [profile_value(res, i, metric) for i in impls]
        out.append(f"{what + ' (' + unit + ')':42s}" + "".join(
            f"{v:26.2f}" if v is not None else f"{'-':>26s}" for v in vals))
    for i in impls:
        top = profile_row(res, i, "top1_samples_pct")
        if top:
            out.append(f"{i}: most sampled instruction {top['sass']!r}, {top['value']:.1f}% of "
                       f"samples, stalled on {top['stall']}")
    return out


def dq_staging_offset(head_dim: int = 128, causal: bool = False) -> int:
    """Byte offset of the float32 dQ staging buffer in the backward's shared memory: the last
    field of HopperBwdConfig.smem_bytes (1 KB aligned, the struct padded to 1 KB)."""
    from fa4_final.hopper.config import hopper_bwd_default

    cfg = hopper_bwd_default(head_dim, causal)
    return cfg.smem_bytes(head_dim) - cfg.tile_m * head_dim * 4 * cfg.dq_buffers


def two_buffer_predictions() -> list[str]:
    """The model's main-kernel prices (over the default's) with one and two dQ staging buffers
    at the same tile, from results/cpu/dq_turns_model.json (predictions, not measurements)."""
    from utils import results

    res = results.load("dq_turns_model", gpu="cpu")
    got: dict = {}
    for r in res.rows:
        if r["metric"] == "predicted_price" and " buffer" in r["impl"]:
            got.setdefault((r["d"], r["s"], r["causal"]), {})[r["impl"]] = r["value"]
    return [f"  D{d:<3} S{s:<6} {'causal' if c else 'dense':6s}  " + "  ".join(
        f"{k} {v:.3f}" for k, v in sorted(vals.items())) for (d, s, c), vals in sorted(got.items())]


@claim("HB.det_profile_points_at_handoff", PROFILE,
       "the deterministic build's tensor pipe is active at least 10 points less than the "
       "default's, a larger share of its samples stalls at a barrier, and its most sampled "
       "instruction is a 16-byte shared store into the dQ staging buffer, stalled on a barrier",
       gpu=GPU)
def _det_profile_handoff(res):
    t0, t1 = (profile_value(res, i, "tensor_pipe_active_pct")
              for i in ("fa4_final", "fa4_final_deterministic"))
    b0, b1 = (profile_value(res, i, "samples_barrier_pct")
              for i in ("fa4_final", "fa4_final_deterministic"))
    top = profile_row(res, "fa4_final_deterministic", "top1_samples_pct") or {}
    offset = f"{dq_staging_offset(128, False):#x}"
    ok = (t0 - t1 >= 10 and b1 > b0 and top.get("sass", "").startswith("STS.128")
          and offset in top.get("sass", "") and top.get("stall") == "barrier")
    return ok, (f"tensor pipe {t0:.1f} -> {t1:.1f} %, barrier samples {b0:.1f} -> {b1:.1f} %, "
                f"top instruction {top.get('sass')!r} ({top.get('stall')}), dQ buffer at "
                f"{offset}")


# the H100 run of the two-buffer candidate: (run, two-buffer impl, one-buffer impl at the same
# tile) per head dim; at D = 64 the one-buffer build at the same tile is today's mode
TWO_BUFFER_RUNS = {128: ("bwd_phases_det_db128", "fa4_final_det_db64", "fa4_final_det_64"),
                   64: ("bwd_phases_det_db64", "fa4_final_det_db", "fa4_final_deterministic")}


def _total_rows(res) -> dict:
    """(impl, d, s, causal) -> the run's total row (device ms per call, its spread)."""
    return {(r["impl"], r["d"], r["s"], r["causal"]): r for r in res.rows
            if r["phase"] == "total" and r.get("value")}


def two_buffer_pairs():
    """(d, s, causal, two buffers / one buffer at the same tile, the larger spread, one buffer
    / the default) for every shape of the stored runs; nothing for a run not stored."""
    from utils import results

    out = []
    for d, (name, two, one) in sorted(TWO_BUFFER_RUNS.items()):
        try:
            rows = _total_rows(results.load(name, gpu=GPU))
        except FileNotFoundError:
            print(f"{name}: not measured (no results/{GPU}/{name}.json)")
            continue
        for (impl, _d, s, causal), r in sorted(rows.items()):
            if impl != two or (one, d, s, causal) not in rows:
                continue
            o, base = rows[(one, d, s, causal)], rows[("fa4_final", d, s, causal)]
            out.append((d, s, causal, r["value"] / o["value"],
                        max(r.get("spread") or 0, o.get("spread") or 0),
                        o["value"] / base["value"]))
    return out


def two_buffer_lines() -> list[str]:
    return [f"  {_shape(d, s, c)}  {_against('two buffers / one at the same tile', r, sp)}; "
            f"one buffer / default {b:.3f}" for d, s, c, r, sp, b in two_buffer_pairs()]


@claim("HB.two_buffers_not_faster", "bwd_phases_det_db128",
       "the two-buffer build is nowhere faster than the one-buffer build at the same tile by "
       "more than 1%, and slower beyond the spread at S = 4096 causal at D = 64 and 128",
       gpu=GPU)
def _two_buffers_not_faster(res):
    pairs = two_buffer_pairs()
    causal_4096 = [(r, sp) for d, s, c, r, sp, _ in pairs if s == 4096 and c]
    ok = (len(pairs) == 8 and all(r > 0.99 for *_, r, _sp, _b in pairs)
          and len(causal_4096) == 2 and all(r - 1 > sp for r, sp in causal_4096))
    return ok, f"{len(pairs)} shapes, ratios " + ", ".join(f"{p[3]:.3f}" for p in pairs)


# Section 9: the stage release (Note [Release after the warp's reads] in fa4_final.hopper.bwd)
RACECHECK_ROWS = (  # gpu_checks row -> what ran under racecheck (2 x 1000 x 777, GQA 8/2, bf16)
    ("bwd_default_racecheck_d128", "one lane a warp, D = 128, causal and dense"),
    ("det_one_buffer_racecheck_d128_causal", "one lane a warp, D = 128, deterministic causal"),
    ("bwd_one_lane_racecheck_d64", "one lane a warp, D = 64, causal, dense, deterministic"),
    ("release_all_racecheck_d128", "every thread, D = 128, causal, dense, deterministic"),
    ("release_all_racecheck_d64", "every thread, D = 64, causal, dense, deterministic"),
)
RELEASE_RUNS = {"back_to_back": "bwd_phases_release_all9", "flush": "bwd_phases_release_all9_flush"}
RELEASE_PAIRS = (("default", "fa4_final_release_all", "fa4_final"),
                 ("deterministic", "fa4_final_det_release_all", "fa4_final_deterministic"))


def _hazards() -> dict | None:
    """gpu_checks row -> racecheck's hazard count, from results/<GPU>/gpu_checks.json (None
    where that file is not stored)."""
    from utils import results

    try:
        rows = results.load("gpu_checks", gpu=GPU).rows
    except FileNotFoundError:
        return None
    return {r["impl"]: r["value"] for r in rows if r.get("metric") == "hazards"}


def racecheck_lines() -> list[str]:
    """compute-sanitizer racecheck's hazard count per stored run of the backward's release."""
    got = _hazards()
    if got is None:
        return [f"not measured (no results/{GPU}/gpu_checks.json)"]
    return [f"  {what:52s} {got[name]:>3} hazards" if name in got else
            f"  {what:52s} not run" for name, what in RACECHECK_ROWS]


def _ratio_pairs(res, new: str, old: str) -> list[tuple]:
    """(d, s, causal, ``new``'s total / ``old``'s, the larger of their spreads) for every shape
    of one stored phases run where both were timed, the largest head dim first."""
    rows = _total_rows(res)
    out = []
    for (impl, d, s, causal), r in sorted(rows.items(), key=lambda kv: (-kv[0][1], kv[0][2:])):
        o = rows.get((old, d, s, causal))
        if impl == new and o:
            out.append((d, s, causal, r["value"] / o["value"],
                        max(r.get("spread") or 0, o.get("spread") or 0)))
    return out


def _shape(d, s, c) -> str:
    return f"D{d:<3} S{s:<6} {'causal' if c else 'dense':6s}"


def _against(what: str, r: float, sp: float) -> str:
    """``what`` ratio ``r`` with the rounds' spread and whether it lies beyond it."""
    return f"{what} {r:.3f} (spread {sp:.1%}, {'beyond' if abs(r - 1) > sp else 'within'} it)"


def _each_stored(runs):
    """(key, the stored run) for each (key, name) of ``runs`` whose file exists (_stored says
    which do not)."""
    for key, name in runs:
        res = _stored(name)
        if res is not None:
            yield key, res


def release_pairs() -> list[tuple]:
    """(mode, which, d, s, causal, every-thread total / one-lane total, the larger spread) per
    stored shape of the nine-round H100 runs; nothing for a run not stored."""
    out = []
    for mode, res in _each_stored(RELEASE_RUNS.items()):
        for which, every, one in RELEASE_PAIRS:
            out += [(mode, which, *pair) for pair in _ratio_pairs(res, every, one)]
    return out


def release_lines() -> list[str]:
    return [f"  {mode:12s} {which:13s} {_shape(d, s, c)} "
            f"{_against('every thread / one lane', r, sp)}"
            for mode, which, d, s, c, r, sp in release_pairs()]


@claim("HB.every_thread_release_free", "bwd_phases_release_all9",
       "with every MMA thread releasing its stages, racecheck reports 0 hazards where one lane "
       "a warp had some; in the default mode the backward is nowhere slower than the one-lane "
       "build beyond the spread and faster beyond it somewhere; in the deterministic mode "
       "slower beyond the spread only at S = 4096 causal back to back, by under 1% (32 shapes "
       "and modes)", gpu=GPU)
def _every_thread_release_free(res):
    pairs = release_pairs()
    hazards = _hazards() or {}
    clean = all(hazards.get(n) == 0 for n, _ in RACECHECK_ROWS[3:])
    dirty = all((hazards.get(n) or 0) > 0 for n, _ in RACECHECK_ROWS[:3])
    default = [(r, sp) for _m, which, *_x, r, sp in pairs if which == "default"]
    det = [(m, s, c, r, sp) for m, which, _d, s, c, r, sp in pairs if which == "deterministic"]
    slower = [(m, s, c, r) for m, s, c, r, sp in det if r - 1 > sp]
    ok = (len(pairs) == 32 and clean and dirty and all(r - 1 <= sp for r, sp in default)
          and any(1 - r > sp for r, sp in default)
          and all(m == "back_to_back" and s == 4096 and c and r < 1.01
                  for m, s, c, r in slower))
    return ok, (f"{len(pairs)} pairs, default {min(r for r, _ in default):.3f}-"
                f"{max(r for r, _ in default):.3f}, deterministic slower beyond the spread: "
                f"{slower}")


# ----------------------------------------------------------------------------------------------
# section 10: hypothesis 2, both packages' main kernels under ncu in one run
VERSUS = "bwd_versus_profile"
VERSUS_METRICS = (
    ("duration_ms", "main kernel time", "ms"),
    ("sm_clock_ghz", "SM clock during it", "GHz"),
    ("tensor_pipe_active_pct", "tensor pipe active", "%"),
    ("samples_short_sb_pct", "samples stalled on the short scoreboard", "%"),
    ("samples_long_sb_pct", "samples stalled on the long scoreboard", "%"),
    ("samples_barrier_pct", "samples stalled at a barrier", "%"),
    ("samples_mio_pct", "samples stalled on MIO throttle", "%"),
)


def load_versus():
    """The stored side-by-side profile (section 10), or None."""
    return _stored(VERSUS)


def versus_pair(res, s: int, metric: str) -> tuple:
    """(our row, the FA4 package's row) of ``metric`` at sequence length ``s``; None where the
    run has none."""
    return tuple(next((r for r in res.rows if (r["impl"], r["s"], r["metric"]) == (i, s, metric)),
                      None) for i in ("fa4_final", "fa4_package"))


def versus_shapes(res) -> list[tuple[int, bool]]:
    return sorted({(r["s"], r["causal"]) for r in res.rows})


def versus_lines(res) -> list[str]:
    """Per shape: VERSUS_METRICS for ours and the FA4 package's, then each kernel's most
    sampled FFMA (the first one of P's exponent) with its share and stall."""
    out = []
    for s, causal in versus_shapes(res):
        title = f"D = 128, S = {s}, {'causal' if causal else 'not causal'}"
        out.append(f"{title:50s}{'fa4_final':>12s}  {'fa4_package':>12s}")
        for metric, what, unit in VERSUS_METRICS:
            out.append(f"  {what + ' (' + unit + ')':48s}" + "".join(
                f"{r['value']:12.2f}  " if r else f"{'-':>12s}  "
                for r in versus_pair(res, s, metric)))
        for impl in ("fa4_final", "fa4_package"):
            tops = [r for r in res.rows if r["impl"] == impl and r["s"] == s
                    and r["metric"].startswith("top")]
            for r in sorted(tops, key=lambda r: r["metric"]):
                out.append(f"  {impl} {r['metric'][:4]}: {r['value']:4.1f}% {r['sass']!r} "
                           f"({r['stall']})")
    return out


@claim("HB.versus_pipe_and_lse_load", VERSUS,
       "at both shapes our tensor pipe is active less than the FA4 package's, our share of "
       "samples stalled on the short scoreboard is larger, and at S = 16384 causal one of our "
       "five most sampled instructions is an FFMA stalled on the short scoreboard", gpu=GPU)
def _versus_pipe_and_lse_load(res):
    shapes = versus_shapes(res)
    pipe, sb = ([tuple(r["value"] for r in versus_pair(res, s, metric)) for s, _ in shapes]
                for metric in ("tensor_pipe_active_pct", "samples_short_sb_pct"))
    ffma = [r for r in res.rows if r["impl"] == "fa4_final" and r["causal"]
            and r["metric"].startswith("top") and r["sass"].startswith("FFMA")
            and r["stall"] == "short_sb"]
    ok = (len(shapes) == 2 and all(a < b for a, b in pipe) and all(a > b for a, b in sb)
          and bool(ffma))
    return ok, (f"tensor pipe {pipe}, short scoreboard {sb}, causal FFMA in the top five: "
                f"{[r['value'] for r in ffma]}")


# section 10, continued: the candidate it points to (HopperBwdConfig.rows_early), timed
ROWS_EARLY_RUNS = ("bwd_phases_rows_early", "bwd_phases_rows_early_swapped",
                   "bwd_phases_rows_early_swapped_flush", "bwd_phases_rows_early_swapped9")


def rows_early_pairs() -> list[tuple]:
    """(run, d, s, causal, rows_early total / the default build's, the larger spread) per
    stored shape of the rows_early runs (the default build of that commit had the lazy reads
    at every head dim); nothing for a run not stored."""
    out = []
    for name, res in _each_stored((name, name) for name in ROWS_EARLY_RUNS):
        out += [(name, *pair) for pair in _ratio_pairs(res, "fa4_final_rows_early", "fa4_final")]
    return out


def rows_early_lines() -> list[str]:
    return [f"  {name.replace('bwd_phases_', ''):28s} {_shape(d, s, c)} "
            f"{_against('rows_early / lazy reads', r, sp)}"
            for name, d, s, c, r, sp in rows_early_pairs()]


@claim("HB.rows_early_helps_only_swapped", "bwd_phases_rows_early",
       "reading lse and delta before the waits is slower beyond the spread at D = 64 at three "
       "shapes or more and at no shape faster, within the spread at D = 128 at every shape, "
       "and at D = 256 causal faster beyond the spread in each of the three runs, nowhere "
       "slower beyond it at D = 192 or 256", gpu=GPU)
def _rows_early_helps_only_swapped(res):
    pairs = rows_early_pairs()
    d64 = [(r, sp) for _n, d, _s, _c, r, sp in pairs if d == 64]
    d128 = [(r, sp) for _n, d, _s, _c, r, sp in pairs if d == 128]
    swapped = [(d, c, r, sp) for _n, d, _s, c, r, sp in pairs if d in (192, 256)]
    d256c = [(r, sp) for d, c, r, sp in swapped if d == 256 and c]
    ok = (len(d64) == 4 and sum(r - 1 > sp for r, sp in d64) >= 3
          and not any(1 - r > sp for r, sp in d64)
          and len(d128) == 4 and all(abs(r - 1) <= sp for r, sp in d128)
          and len(d256c) == 6 and all(1 - r > sp for r, sp in d256c)
          and len(swapped) == 24 and not any(r - 1 > sp for _d, _c, r, sp in swapped))
    return ok, (f"D64 {[round(r, 3) for r, _ in d64]}, D128 {[round(r, 3) for r, _ in d128]}, "
                f"D256 causal {[round(r, 3) for r, _ in d256c]}")


# the H100 run of the dQ warp per buffer (HopperBwdConfig.dq_adds_overlap): (run, overlap
# build, two buffers with one warp, one buffer at the same tile) per head dim; at D = 128 the
# one-buffer deterministic mode of that run kept its 80-row tile
OVERLAP_RUNS = {64: ("bwd_phases_det_overlap64", "fa4_final_det_overlap", "fa4_final_det_db"),
                128: ("bwd_phases_det_overlap128", "fa4_final_det_overlap64",
                      "fa4_final_det_db64")}


def overlap_rows() -> list[tuple]:
    """(d, s, causal, over the default: overlap, two buffers one warp, one buffer (the
    deterministic mode of that run); overlap over one buffer, the larger of their spreads) per
    stored shape; nothing for a run not stored."""
    out = []
    for d, res in _each_stored((d, run[0]) for d, run in OVERLAP_RUNS.items()):
        _name, over, two = OVERLAP_RUNS[d]
        rows = _total_rows(res)
        for (impl, dd, s, c), r in sorted(rows.items()):
            if impl != "fa4_final" or dd != d:
                continue
            o, t, one = (rows.get((k, d, s, c)) for k in (over, two, "fa4_final_deterministic"))
            if not (o and t and one):
                continue
            base = r["value"]
            out.append((d, s, c, o["value"] / base, t["value"] / base, one["value"] / base,
                        o["value"] / one["value"], max(o.get("spread") or 0,
                                                       one.get("spread") or 0)))
    return out


def overlap_lines() -> list[str]:
    return [f"  {_shape(d, s, c)} over the default: a dQ warp "
            f"per buffer {o:.3f}, two buffers one warp {t:.3f}, one buffer {one:.3f}; "
            f"the first over the last {r:.3f} (spread {sp:.1%})"
            for d, s, c, o, t, one, r, sp in overlap_rows()]


@claim("HB.overlap_halves_the_price", "bwd_phases_det_overlap128",
       "a dQ warp per buffer is faster than one buffer at all eight shapes, beyond the spread "
       "at seven, faster than two buffers with one warp at all eight, and within 3% of one "
       "buffer at D = 64, S = 4096 dense only", gpu=GPU)
def _overlap_halves_the_price(res):
    rows = overlap_rows()
    ok = (len(rows) == 8 and all(r < 1 for *_x, r, _sp in rows)
          and sum(1 - r > sp for *_x, r, sp in rows) >= 7
          and all(o < t for _d, _s, _c, o, t, *_y in rows)
          and [(d, s, c) for d, s, c, *_y, r, _sp in rows if r >= 0.97] == [(64, 4096, False)])
    return ok, "; ".join(f"D{d} S{s} {'c' if c else 'd'} {o:.3f} (one buffer {one:.3f})"
                         for d, s, c, o, _t, one, _r, _sp in rows)


def rows_shuffled_pairs() -> list[tuple]:
    """(d, s, causal, rows_shuffled total / the lazy read's, the larger spread, the FA4
    package's total / rows_shuffled's) per stored shape of the D = 64 run."""
    res = _stored("bwd_phases_rows_shuffled")
    if res is None:
        return []
    rows = _total_rows(res)
    return [(d, s, c, r, sp, rows[("fa4_package", d, s, c)]["value"]
             / rows[("fa4_final_rows_shuffled", d, s, c)]["value"])
            for d, s, c, r, sp in _ratio_pairs(res, "fa4_final_rows_shuffled", "fa4_final")
            if ("fa4_package", d, s, c) in rows]


def rows_shuffled_lines() -> list[str]:
    return [f"  {_shape(d, s, c)} {_against('shuffles / lazy reads', r, sp)}; the FA4 "
            f"package's time over the shuffles' {p:.3f}"
            for d, s, c, r, sp, p in rows_shuffled_pairs()]


@claim("HB.shuffles_faster_at_d64", "bwd_phases_rows_shuffled",
       "lse and delta by shuffles are faster than the lazy reads at all four D = 64 shapes, "
       "beyond the spread at both S = 4096 shapes, and the FA4 package is slower than them at "
       "all four", gpu=GPU)
def _shuffles_faster_at_d64(res):
    pairs = rows_shuffled_pairs()
    ok = (len(pairs) == 4 and all(r < 1 for _d, _s, _c, r, _sp, _p in pairs)
          and all(1 - r > sp for _d, s, _c, r, sp, _p in pairs if s == 4096)
          and all(p > 1 for *_x, p in pairs))
    return ok, "; ".join(f"S{s} {'c' if c else 'd'} {r:.3f} (spread {sp:.1%}), package {p:.3f}"
                         for _d, s, c, r, sp, p in pairs)


DEFAULT_RUNS = (("back to back", "bwd_phases_defaults"),
                ("after an L2 flush", "bwd_phases_defaults_flush"))


def defaults_rows() -> list[tuple]:
    """(mode, d, s, causal, the FA4 package's total / ours, the larger spread, deterministic /
    default, the larger spread) per stored shape of the two runs of the backward as a call
    runs it; nothing for a run not stored."""
    return [row for mode, res in _each_stored(DEFAULT_RUNS)
            for row in _two_ratios(mode, res, ("fa4_package", "fa4_final"),
                                   ("fa4_final_deterministic", "fa4_final"))]


def _two_ratios(mode, res, first: tuple, second: tuple) -> list[tuple]:
    """(mode, d, s, causal, first[0] / first[1], its spread, second[0] / second[1], its
    spread) for every shape of one stored run where all were timed."""
    other = {p[:3]: p[3:] for p in _ratio_pairs(res, *second)}
    return [(mode, d, s, c, r, sp, *other[(d, s, c)])
            for d, s, c, r, sp in _ratio_pairs(res, *first) if (d, s, c) in other]


def _two_ratio_lines(rows, first: str, second: str, header: str = "calls {}:") -> list[str]:
    """Lines of (mode, d, s, causal, ratio, spread, second ratio, its spread) rows, a header
    per timing mode: the first ratio against its spread, the second with its spread."""
    lines, last = [], None
    for mode, d, s, c, r, sp, r2, sp2 in rows:
        if mode != last:
            lines.append(header.format(mode))
            last = mode
        lines.append(f"  {_shape(d, s, c)} {_against(first, r, sp)}; "
                     f"{second} {r2:.3f} (spread {sp2:.1%})")
    return lines


def defaults_lines() -> list[str]:
    return _two_ratio_lines(defaults_rows(), "FA4 package / ours", "deterministic / default")


@claim("HB.defaults_d128_behind_d64_ahead", "bwd_phases_defaults",
       "in both runs the FA4 package's time over ours is at most 1.001 at all four D = 128 "
       "shapes, below 1 beyond the spread only at S = 4096 causal, and above 1 at all four "
       "D = 64 shapes, beyond the spread at both S = 4096 shapes", gpu=GPU)
def _defaults_d128_behind_d64_ahead(res):
    rows = defaults_rows()
    d128 = [(m, s, c, r, sp) for m, d, s, c, r, sp, *_x in rows if d == 128]
    d64 = [(m, s, c, r, sp) for m, d, s, c, r, sp, *_x in rows if d == 64]
    ok = (len(d128) == len(d64) == 8 and all(r <= 1.001 for *_x, r, _sp in d128)
          and {(s, c) for _m, s, c, r, sp in d128 if 1 - r > sp} == {(4096, True)}
          and all(r > 1 for *_x, r, _sp in d64)
          and all(r - 1 > sp for _m, s, _c, r, sp in d64 if s == 4096))
    return ok, "; ".join(f"{m[:5]} D{d} S{s} {'c' if c else 'd'} {r:.3f} ({sp:.1%})"
                         for m, d, s, c, r, sp, *_x in rows)


@claim("HB.det_price_as_called", "bwd_phases_defaults",
       "in both runs deterministic=True costs more than a tenth over the default at the same "
       "four shapes, D = 128 S = 4096 dense and D = 64 S = 4096 both and S = 16384 dense, and "
       "less than a tenth at the other four", gpu=GPU)
def _det_price_as_called(res):
    rows = defaults_rows()
    over = {m: {(d, s, c) for m_, d, s, c, *_x, dr, _dsp in rows if m_ == m and dr > 1.1}
            for m, _name in DEFAULT_RUNS}
    want = {(128, 4096, False), (64, 4096, False), (64, 4096, True), (64, 16384, False)}
    ok = len(rows) == 16 and all(v == want for v in over.values())
    return ok, "; ".join(f"{m[:5]} D{d} S{s} {'c' if c else 'd'} {dr:.3f}"
                         for m, d, s, c, _r, _sp, dr, _dsp in rows)


@claim("HB.shuffles_d128_within_noise", "bwd_phases_rows_shuffled128",
       "at D = 128, causal, lse and delta by shuffles are within the spread of the lazy reads "
       "at both stored shapes", gpu=GPU)
def _shuffles_d128_within_noise(res):
    pairs = _ratio_pairs(res, "fa4_final_rows_shuffled", "fa4_final")
    ok = len(pairs) == 2 and all(abs(r - 1) <= sp for *_x, r, sp in pairs)
    return ok, "; ".join(f"S{s} {r:.3f} (spread {sp:.1%})" for _d, s, _c, r, sp in pairs)


# (mode, head dim, stored run, the rotated build's row): the rotated walk beside the
# deterministic default and the default, one head dim a file
ROTATED_RUNS = (("back to back", 64, "bwd_phases_det_rotated64", "fa4_final_det_rotated"),
                ("back to back", 128, "bwd_phases_det_rotated128", "fa4_final_det_rotated64"),
                ("after an L2 flush", 64, "bwd_phases_det_rotated64_flush",
                 "fa4_final_det_rotated"),
                ("after an L2 flush", 128, "bwd_phases_det_rotated128_flush",
                 "fa4_final_det_rotated64"))


def rotated_rows() -> list[tuple]:
    """(mode, d, s, causal, rotated / plain deterministic, its spread, rotated / default, its
    spread) per stored shape of the rotated walk's runs; nothing for a run not stored."""
    return [row for (mode, rot), res in _each_stored([((m, r), n) for m, _d, n, r in ROTATED_RUNS])
            for row in _two_ratios(mode, res, (rot, "fa4_final_deterministic"),
                                   (rot, "fa4_final"))]


def rotated_lines() -> list[str]:
    return _two_ratio_lines(rotated_rows(), "rotated / plain walk", "rotated / default")


@claim("HB.rotated_lowers_dense_4096", "bwd_phases_det_rotated128",
       "in both runs the rotated walk's deterministic time is below 0.9 of the plain walk's, "
       "beyond the spread, at S = 4096 dense for D = 64 and 128, and within the spread of it at "
       "the six shapes where the walk stays plain (causal, and S = 16384)", gpu=GPU)
def _rotated_lowers_dense_4096(res):
    rows = rotated_rows()
    dense = [(r, sp) for _m, _d, s, c, r, sp, *_x in rows if s == 4096 and not c]
    plain = [(r, sp) for _m, _d, s, c, r, sp, *_x in rows if s != 4096 or c]
    ok = (len(rows) == 16 and all(r < 0.9 and 1 - r > sp for r, sp in dense)
          and all(abs(r - 1) <= sp for r, sp in plain))
    return ok, "; ".join(f"{m[:5]} D{d} S{s} {'c' if c else 'd'} {r:.3f} ({sp:.1%})"
                         for m, d, s, c, r, sp, *_x in rows)


@claim("HB.rotated_price", "bwd_phases_det_rotated128",
       "in both runs the rotated build costs at most 3% over the default at D = 128 S = 4096 "
       "dense and more than a tenth at exactly two shapes, D = 64 S = 4096 dense and causal",
       gpu=GPU)
def _rotated_price(res):
    rows = rotated_rows()
    over = {m: {(d, s, c) for m_, d, s, c, _r, _sp, rd, _x in rows if m_ == m and rd > 1.1}
            for m in {row[0] for row in rows}}
    d128 = [rd for _m, d, s, c, _r, _sp, rd, _x in rows if (d, s, c) == (128, 4096, False)]
    ok = (len(rows) == 16 and len(d128) == 2 and all(rd <= 1.03 for rd in d128)
          and all(v == {(64, 4096, False), (64, 4096, True)} for v in over.values()))
    return ok, "; ".join(f"{m[:5]} D{d} S{s} {'c' if c else 'd'} {rd:.3f}"
                         for m, d, s, c, _r, _sp, rd, _x in rows)


@claim("HB.rotated_model_near_d128_far_d64", "bwd_phases_det_rotated128",
       "section 6's model's rotated-walk prediction (deterministic over default) is within "
       "0.05 of the back-to-back measurement at D = 128 S = 4096 dense and more than 0.1 below "
       "it at D = 64", gpu=GPU)
def _rotated_model(res):
    from measure import dq_turns_model as dqm

    measured = {d: rd for m, d, s, c, _r, _sp, rd, _x in rotated_rows()
                if m == "back to back" and (s, c) == (4096, False)}
    model = {d: dqm.predict_rotated(dqm.default_shape(4, 4096, 16, d, False),
                                    dqm.CALIBRATED[d])["rotated"] for d in (128, 64)}
    ok = (set(measured) == {64, 128} and abs(model[128] - measured[128]) <= 0.05
          and measured[64] - model[64] > 0.1)
    return ok, "; ".join(f"D{d} model {model[d]:.3f} measured {measured.get(d, float('nan')):.3f}"
                         for d in (128, 64))


# ---------------------------------------------------------------------------------------------
# Section 11, beside every peer: measure.bwd_benchmark's tables (one call at a time after an
# L2 flush, five rounds), the backward alone and a forward with its backward

BENCH_RUNS = (("bwd", "bwd_bench"), ("fwd+bwd", "fwd_bwd_bench"))


def _tf_spread(row) -> float:
    """A benchmark row's spread: its rounds' TFLOP/s range over the median."""
    return (row["tflops_max"] - row["tflops_min"]) / row["tflops"]


def bench_rows() -> list[tuple]:
    """(pass, d, s, causal, our speed / the best peer's, the best peer, the larger spread,
    deterministic time / default time, the larger spread) per shape of the stored tables,
    the largest head dim first; nothing for a table not stored."""
    out = []
    for pass_, res in _each_stored(BENCH_RUNS):
        by = {}
        for r in res.rows:
            if r.get("pass") == pass_ and r.get("tflops"):
                by.setdefault((r["d"], r["s"], r["causal"]), {})[r["impl"]] = r
        for (d, s, c), g in sorted(by.items(), key=lambda kv: (-kv[0][0], kv[0][1:])):
            ours, det = g.get("fa4_final"), g.get("fa4_final_deterministic")
            peers = {n: r for n, r in g.items() if not n.startswith("fa4_final")}
            if not (ours and det and peers):
                continue
            best = max(peers, key=lambda n: peers[n]["tflops"])
            p = peers[best]
            out.append((pass_, d, s, c, ours["tflops"] / p["tflops"], best,
                        max(_tf_spread(ours), _tf_spread(p)), ours["tflops"] / det["tflops"],
                        max(_tf_spread(ours), _tf_spread(det))))
    return out


def bench_lines() -> list[str]:
    rows = bench_rows()
    best = sorted({row[5] for row in rows})
    return [f"the best peer: {', '.join(best)}"] + _two_ratio_lines(
        [(p, d, s, c, r, sp, dr, dsp) for p, d, s, c, r, _b, sp, dr, dsp in rows],
        "ours / the best peer", "deterministic / default",
        "{}, one call at a time after an L2 flush:")


def _bench_of(pass_: str, d: int | None = None) -> list[tuple]:
    """bench_rows of one pass (and head dim)."""
    return [row for row in bench_rows() if row[0] == pass_ and d in (None, row[1])]


def _bench_text(rows, index: int) -> str:
    """The shapes of ``rows`` with the ratio at ``index`` (and its spread beside the first)."""
    return "; ".join(f"D{r[1]} S{r[2]} {'c' if r[3] else 'd'} {r[index]:.3f}"
                     + (f" ({r[6]:.1%})" if index == 4 else "") for r in rows)


def bench_ratio(pass_: str, d: int, s: int, causal: bool) -> float | None:
    return next((r for p, d_, s_, c, r, *_x in bench_rows() if (p, d_, s_, c) == (pass_, d, s,
                                                                                 causal)), None)


@claim("HB.bench_d128_level_d64_ahead", "bwd_bench",
       "one call at a time after an L2 flush, the FA4 package is the best peer at all eight "
       "shapes; our backward is within the spread of it at all four D = 128 shapes and faster "
       "at all four D = 64 shapes, beyond the spread only at S = 4096 dense", gpu=GPU)
def _bench_d128_level_d64_ahead(res):
    rows = _bench_of("bwd")
    beyond = {(d, s, c) for _p, d, s, c, r, _b, sp, *_x in rows if abs(r - 1) > sp}
    ok = (len(rows) == 8 and all(b == "fa4_package" for *_x, b, _sp, _dr, _dsp in rows)
          and all(r > 1 for _p, d, _s, _c, r, *_x in rows if d == 64)
          and beyond == {(64, 4096, False)})
    return ok, _bench_text(rows, 4)


@claim("HB.training_step_d128_behind", "fwd_bwd_bench",
       "a forward and its backward per call: at all four D = 128 shapes ours is slower than "
       "the FA4 package, by less than 3% and within the spread at each", gpu=GPU)
def _training_step_d128_behind(res):
    rows = _bench_of("fwd+bwd", 128)
    ok = len(rows) == 4 and all(b == "fa4_package" and 0.97 < r < 1 and 1 - r <= sp
                                for _p, _d, _s, _c, r, b, sp, *_x in rows)
    return ok, _bench_text(rows, 4)


@claim("HB.bench_det_price", "bwd_bench",
       "one call at a time after an L2 flush, deterministic=True costs more than a tenth over "
       "the default at S = 4096 dense at both head dims and less than a tenth at the other "
       "six shapes", gpu=GPU)
def _bench_det_price(res):
    rows = _bench_of("bwd")
    over = {(d, s, c) for _p, d, s, c, *_x, dr, _dsp in rows if dr > 1.1}
    ok = len(rows) == 8 and over == {(128, 4096, False), (64, 4096, False)}
    return ok, _bench_text(rows, 7)


# ---------------------------------------------------------------------------------------------
# Accumulator copies on the overlapped two-buffer kernel (Note [dQ copies]): the H100 runs

COPIES_RUNS = {(64, "back to back"): "bwd_phases_det_copies_overlap64",
               (64, "flush"): "bwd_phases_det_copies_overlap64_flush",
               (128, "back to back"): "bwd_phases_det_copies_overlap128",
               (128, "flush"): "bwd_phases_det_copies_overlap128_flush"}
COPIES_IMPLS = {64: {1: "fa4_final_deterministic", 2: "fa4_final_det_c2_overlap",
                     4: "fa4_final_det_c4_overlap"},
                128: {1: "fa4_final_deterministic", 2: "fa4_final_det_c2_overlap64",
                      4: "fa4_final_det_c4_overlap64"}}


def copies_rows() -> list[tuple]:
    """(mode, d, s, causal, {copies: (over the default, spread)}, the package's choice) per
    stored shape: 1 is the deterministic default (one accumulator), 2 and 4 the copies; the
    choice is hopper_bwd_det_copies' (None: one copy)."""
    from fa4_final.hopper.config import hopper_bwd_det_copies

    out = []
    for (d, mode), res in _each_stored(COPIES_RUNS.items()):
        shapes: dict = {}
        for n, name in COPIES_IMPLS[d].items():
            for dd, s, c, r, sp in _ratio_pairs(res, name, "fa4_final"):
                if dd == d:
                    shapes.setdefault((s, c), {})[n] = (r, sp)
        for (s, c), got in sorted(shapes.items()):
            cfg = hopper_bwd_det_copies(d, c)
            out.append((mode, d, s, c, got, 1 if cfg is None else cfg.dq_copies))
    return out


def copies_lines() -> list[str]:
    lines = ["deterministic over the default, whole backward (spread); copies 1 is today's "
             "deterministic call, * the copies hopper_bwd_det_copies picks:"]
    for mode, d, s, c, got, pick in copies_rows():
        cells = "  ".join(f"{n} {'*' if n == pick else ' '}{r:.3f} ({sp:.1%})"
                          for n, (r, sp) in sorted(got.items()))
        lines.append(f"  {mode:12s} {_shape(d, s, c)} {cells}")
    return lines


def copies_ratio(d: int, s: int, causal: bool, copies: int, mode: str = "back to back"):
    for m, dd, ss, c, got, _pick in copies_rows():
        if (m, dd, ss, c) == (mode, d, s, causal) and copies in got:
            return got[copies][0]
    return None


@claim("HB.copies_pick_within_a_tenth", "bwd_phases_det_copies_overlap64",
       "with the copies hopper_bwd_det_copies picks per shape, the deterministic backward "
       "takes less than 1.1x the default's time at all eight shapes in both runs, where one "
       "accumulator takes more at D = 64 and 128, S = 4096 dense", gpu=GPU)
def _copies_pick(res):
    rows = copies_rows()
    picked = [(m, d, s, c, got[pick][0]) for m, d, s, c, got, pick in rows if pick in got]
    one = {(m, d, s, c): got[1][0] for m, d, s, c, got, _p in rows if 1 in got}
    ok = (len(picked) == 16 and all(r < 1.1 for *_k, r in picked)
          and all(one.get((m, d, 4096, False), 0) > 1.1 for m in ("back to back", "flush")
                  for d in (64, 128)))
    worst = max(picked, key=lambda t: t[-1]) if picked else None
    return ok, f"{len(picked)} shapes; the largest with the pick {worst}"


@claim("HB.four_copies_slow_d128_causal", "bwd_phases_det_copies_overlap128",
       "at D = 128 with a causal diagonal, four copies take more than 1.5x the default's time "
       "in both runs, two copies within 1% of one accumulator", gpu=GPU)
def _four_copies_d128_causal(res):
    rows = [(m, got) for m, d, s, c, got, _p in copies_rows() if d == 128 and c]
    ok = len(rows) == 4 and all(got[4][0] > 1.5 and abs(got[2][0] / got[1][0] - 1) < 0.01
                                for _m, got in rows)
    return ok, "; ".join(f"{m}: 4 copies {got[4][0]:.3f}, 2 {got[2][0]:.3f}, 1 {got[1][0]:.3f}"
                         for m, got in rows)
