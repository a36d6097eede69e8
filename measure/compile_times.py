"""Cold and warm compile times of fa4_final's forward: results/<machine>/compile_times.json.

    python -m measure.compile_times             # about a minute on a CPU, no GPU needed
    python -m measure.compile_times --repeats 1 --cases 128,bf16,0

Each measurement is a fresh Python process, so nothing is warm that a user's new process would
not have warm:
  cold   an empty disk cache: the first call of the compile path traces, compiles (MLIR, ptxas)
         and exports the entry (``dsl_compile_s`` + ``export_s`` of it);
  warm   a second process on the same cache: the first call loads the object file
         (``disk_load_s`` of it), then a second call in that process hits memory.
``import_s`` is ``import fa4_final`` (torch and CuTe DSL with it), paid by every process. Rows are
medians over ``--repeats`` processes, with min and max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PRODUCES = [
    ("results/cpu/compile_times.json", "python -m measure.compile_times --repeats 5",
     "fa4_final's forward in fresh processes: cold compile and export, warm load from the disk "
     "cache, the in-memory hit, the import; chapter 13 reads it"),
]

ROOT = Path(__file__).resolve().parent.parent
CASES = ((128, "bf16", False), (128, "bf16", True), (64, "bf16", False))

# One process: import, two calls of the compile path (runtime.compile.compiled), and what the
# cache says about them.
CHILD = """
import json, sys, time
t0 = time.perf_counter()
import fa4_final
from fa4_final.runtime.cache import CACHE
from fa4_final.hopper.host import forward_recipe
from fa4_final.runtime.compile import compiled
t1 = time.perf_counter()
d, dtype, causal = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
compiled(forward_recipe, d, dtype, causal, None, False, False, False, False)
t2 = time.perf_counter()
compiled(forward_recipe, d, dtype, causal, None, False, False, False, False)
t3 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, first_call_s=t2 - t1, memory_hit_us=(t3 - t2) * 1e6,
                      stats=dict(CACHE.stats), seconds=CACHE.seconds)))
"""


def one_process(cache_dir: str, d: int, dtype: str, causal: bool) -> dict:
    env = os.environ | {"FA4_FINAL_CACHE_DIR": cache_dir, "PYTHONPATH": str(ROOT)}
    env.pop("FA4_FINAL_DISK_CACHE", None)
    out = subprocess.run([sys.executable, "-c", CHILD, str(d), dtype, "1" if causal else "0"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the measuring process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(d: int, dtype: str, causal: bool, repeats: int) -> list[dict]:
    samples: dict[str, list[float]] = {}

    def add(metric, value):
        samples.setdefault(metric, []).append(value)

    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="fa4_cache_") as folder:
            cold = one_process(folder, d, dtype, causal)
            warm = one_process(folder, d, dtype, causal)
        if cold["stats"].get("compiled") != 1 or warm["stats"].get("disk") != 1:
            raise RuntimeError(f"expected a compile then a disk hit, got {cold['stats']} and "
                               f"{warm['stats']}")
        add("cold_first_call_s", cold["first_call_s"])
        add("dsl_compile_s", cold["seconds"]["compile"])
        add("export_s", cold["seconds"]["export"])
        add("warm_first_call_s", warm["first_call_s"])
        add("disk_load_s", warm["seconds"]["load"])
        add("memory_hit_us", warm["memory_hit_us"])
        add("import_s", warm["import_s"])
    units = {"memory_hit_us": "us"}
    return [{"impl": "fa4_final.hopper.fwd", "metric": metric,
             "value": statistics.median(values), "unit": units.get(metric, "s"),
             "min": min(values), "max": max(values), "repeats": len(values), "arch": "sm_90a",
             "d": d, "dtype": dtype, "causal": causal, **host()}
            for metric, values in samples.items()]


def host() -> dict:
    """The CPU the compiler ran on: compile times scale with it, not with the GPU."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host_cpu": model, "host_cores": os.cpu_count()}


def parse_case(text: str) -> tuple[int, str, bool]:
    d, dtype, causal = text.split(",")
    return int(d), dtype, causal.strip() in ("1", "true", "causal")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="processes per measurement")
    parser.add_argument("--cases", nargs="*", type=parse_case,
                        help="head_dim,dtype,causal (e.g. 128,bf16,0); default: three cases")
    parser.add_argument("--name", default="compile_times", help="results file name")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args(argv)
    command = "python -m measure.compile_times " + " ".join(argv or sys.argv[1:])
    rows = []
    for d, dtype, causal in args.cases or CASES:
        rows += measure(d, dtype, causal, args.repeats)
    from solutions.ch13_teaching import compile_times_table

    print(compile_times_table(rows))
    if not args.no_save:
        from utils.results import save

        print(f"saved {save(args.name, rows, command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
