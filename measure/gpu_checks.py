"""What the GPU test runs found, stored like any measurement: results/<gpu>/gpu_checks.json
(h200, or h100 for a visit that was lent an H100: the folder is the provenance's GPU).

    python -m measure.gpu_checks SUITE=LOG [SUITE=LOG ...]
    python -m measure.gpu_checks --provenance-from results/h200/ch11_bwd.json SUITE=LOG ...

Each LOG is the output of a pytest run (its last "N passed, M failed ..." line is read), of a
compute-sanitizer run (its "ERROR SUMMARY" / "RACECHECK SUMMARY" line) or of a chapter's case
checks (utils.checks.run_cases: "N/M cases passed"). A row per suite:
impl (the suite's name), metric ("passed", "failed", "errors", "skipped" for pytest; "errors"
or "hazards" for a sanitizer; beside a racecheck's hazards, "hazards_in_course_kernels": those
whose report names one of the course's CuTe kernels, not a library kernel the test calls;
"sanitizer_failures" when compute-sanitizer says it failed itself), value, unit. Rows of
suites not named keep their stored value, so one run can add to what an earlier one recorded.

Run on the GPU machine, right after the tests, the provenance is that machine's. For logs brought
back from it, ``--provenance-from`` takes the provenance of a results file written in the same
session (same machine, commit and date), and the command says so.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from utils import results
from utils.hardware import gpu_slug

NAME = "gpu_checks"
PRODUCES = [(f"results/{gpu}/{NAME}.json", "python -m measure.gpu_checks SUITE=LOG ... (the "
             "'record' step of tests/gpu/h200_session.sh)",
             f"the GPU test and sanitizer runs of a visit on an {gpu.upper()}: passed/failed/"
             "errors per suite") for gpu in ("h200", "h100")]
PYTEST = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xpassed|xfailed)")
# "ERROR SUMMARY: 224 errors", "RACECHECK SUMMARY: 1 hazard displayed (1 error, ...)"; not the
# "ERROR SUMMARY: 220 errors were not printed" line that follows a print limit
SANITIZER = re.compile(r"(ERROR|RACECHECK) SUMMARY: (\d+) (error|hazard)s?\b")
# a racecheck report's first access names its kernel: the course's CuTe kernels are
# kernel_cutlass_kernel_...; others (cuBLAS's nvjet_* under a test's reference) are not ours
RACE = re.compile(r"Race reported between \w+ access at (\S+)")
COURSE_KERNEL = "kernel_cutlass_kernel_"
CASES = re.compile(r"^(\d+)/(\d+) cases passed")  # utils.checks.run_cases (ch04/05/08 checks)


def read_log(text: str) -> dict[str, int]:
    """{metric: count} from the log of one pytest or compute-sanitizer run."""
    for line in reversed(text.splitlines()):
        if "were not printed" in line:  # after --print-limit: not the summary
            continue
        m = SANITIZER.search(line)
        if m:
            counts = {m.group(3) + "s": int(m.group(2))}
            races = RACE.findall(text) if m.group(1) == "RACECHECK" else []
            if races:  # the reports are in the log: whose kernels they name
                counts["hazards_in_course_kernels"] = sum(
                    1 for race in races if race.startswith(COURSE_KERNEL))
            if "Internal Sanitizer Error" in text:  # the sanitizer failed, not the program
                counts["sanitizer_failures"] = text.count("Internal Sanitizer Error")
            return counts
        m = CASES.match(line.strip())
        if m:
            return {"passed": int(m.group(1)), "failed": int(m.group(2)) - int(m.group(1))}
        found = PYTEST.findall(line)
        if found and (" in " in line or line.strip().startswith("=")):
            return {"errors" if kind.startswith("error") else kind: int(n) for n, kind in found}
    raise ValueError("no pytest summary line, no compute-sanitizer summary and no 'N/M cases "
                     "passed' line in the log")


def rows_for(suite: str, text: str, provenance: dict) -> list[dict]:
    """The suite's rows, each saying which commit and date it was measured at (a file can
    hold rows of several runs; its own provenance is the latest run's)."""
    counts = read_log(text)
    unit = "findings" if set(counts) <= {"errors", "hazards", "hazards_in_course_kernels",
                                         "sanitizer_failures"} and SANITIZER.search(text) \
        else "tests"
    return [{"impl": suite, "metric": metric, "value": value, "unit": unit,
             "commit": provenance["commit"], "date": provenance["date"]}
            for metric, value in counts.items()]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    provenance = None
    if argv[:1] == ["--provenance-from"]:
        provenance = json.loads(Path(argv[1]).read_text())["provenance"]
        argv = argv[2:]
    if not argv or any("=" not in a for a in argv):
        print(__doc__, file=sys.stderr)
        return 2
    command = "python -m measure.gpu_checks " + " ".join(argv)
    if provenance is None:
        provenance = results.collect_provenance(command)
    else:
        provenance = {**provenance,
                      "command": command + f" (logs of the run of {provenance['date']})"}
    new = []
    for arg in argv:
        suite, log = arg.split("=", 1)
        new += rows_for(suite, Path(log).read_text(errors="replace"), provenance)
    gpu = gpu_slug(provenance["gpu"] if provenance["gpu"] != "cpu" else None)
    stored = results.load_stored(NAME, gpu=gpu)
    named = {r["impl"] for r in new}
    rows = [r for r in (stored.rows if stored else []) if r["impl"] not in named] + new
    path = results.save(NAME, rows, command, gpu=gpu, provenance=provenance)
    for r in new:
        print(f"{r['impl']:40s} {r['metric']:>10s} {r['value']}")
    print(f"stored {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
