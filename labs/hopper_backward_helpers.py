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
