"""Run the microbenchmarks on this machine's GPU and store them in results/<gpu>/microbench.json.

    timeout 300 python -m solutions.run_microbench          # about 30 s on an H200
    python -m solutions.run_microbench --quick              # 10x fewer loop trips: a smoke test

What it measures (``solutions/microbench.py`` says how):
- exp2: MUFU alone, the FMA polynomial alone (degrees 2..5, the naive cvt-floor version, the
  version that does not keep NaN), and mixes with 1..6 of every 8 exps on the polynomial;
  exps per second on the chip, exps per clock per SM, and the SM clock the run had;
- shared memory: bytes per clock per SM with 16-byte and 4-byte loads per thread;
- mma.sync (m16n8k16, bf16 -> fp32) from registers: FLOP/clk/SM and TFLOP/s, chapter 04's ceiling;
- a torch bf16 8192^3 matmul in TFLOP/s, the tensor-core ceiling the other figures compare to;
- a 1 GiB device-to-device copy in B/s (3 interleaved rounds), the HBM bandwidth a streaming
  kernel gets (chapter 01's roofline).

Each row: ``impl``, ``metric``, ``value``, ``unit`` and the knobs (``fraction``, ``degree``, ...).
Checks that would make a figure meaningless (an SM without blocks, chains that did not converge,
a wrong checksum of the loaded bytes, a measurement skipped for time) are printed as FAIL and make
the exit status 1; the file is written anyway so the failure can be read. Kernels are bounded
loops; ``--budget-s`` stops starting new ones when the run takes far longer than expected.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

FIXED_POINT = 0.641185744504986  # v = 2^-v


def exp_rows(bench, fig: dict) -> list[dict]:
    """Result rows of one ``ExpThroughput`` measurement."""
    knobs = {"fraction": bench.fraction, "degree": bench.degree, "nan_safe": bench.nan_safe,
             "floor": bench.floor, "emulated_of_8": bench.emulated}
    return [
        {"impl": bench.label, "metric": "exp2_rate", "value": fig["per_s"], "unit": "exp/s",
         **knobs},
        {"impl": bench.label, "metric": "exp2_per_clk_sm", "value": fig["per_clk_sm"],
         "unit": "exp/clk/SM", "min": fig["per_clk_sm_min"], "max": fig["per_clk_sm_max"],
         **knobs},
        {"impl": bench.label, "metric": "sm_clock", "value": fig["sm_clock_ghz"], "unit": "GHz",
         **knobs},
    ]


def smem_rows(bench, fig: dict) -> list[dict]:
    knobs = {"width_bytes": bench.width}
    return [
        {"impl": bench.label, "metric": "smem_bytes_per_clk_sm", "value": fig["per_clk_sm"],
         "unit": "B/clk/SM", "min": fig["per_clk_sm_min"], "max": fig["per_clk_sm_max"],
         **knobs},
        {"impl": bench.label, "metric": "smem_bandwidth", "value": fig["per_s"], "unit": "B/s",
         **knobs},
    ]


def mma_rows(bench, fig: dict) -> list[dict]:
    return [
        {"impl": bench.label, "metric": "mma_sync_tflops", "value": fig["per_s"] / 1e12,
         "unit": "TFLOP/s"},
        {"impl": bench.label, "metric": "mma_sync_flop_per_clk_sm", "value": fig["per_clk_sm"],
         "unit": "FLOP/clk/SM", "min": fig["per_clk_sm_min"], "max": fig["per_clk_sm_max"]},
        {"impl": bench.label, "metric": "sm_clock", "value": fig["sm_clock_ghz"], "unit": "GHz"},
    ]


def copy_rows(fig: dict) -> list[dict]:
    return [{"impl": f"torch copy_ of {fig['nbytes'] / 2**30:g} GiB (read + write)",
             "metric": "hbm_copy_bandwidth", "value": fig["bytes_per_s"], "unit": "B/s",
             "min": fig["min"], "max": fig["max"], "rounds": fig["rounds"], "ms": fig["ms"],
             "sm_clock_mhz": fig["sm_clock_mhz"], "sensors": fig["sensors"]}]


def matmul_rows(fig: dict) -> list[dict]:
    return [{"impl": f"torch bf16 matmul {fig['n']}^3", "metric": "matmul_tflops",
             "value": fig["tflops"], "unit": "TFLOP/s", "ms": fig["ms"],
             **{k: fig.get(k) for k in ("min", "max", "rounds", "sm_clock_mhz")}}]


def problems(fig: dict, exp: bool, checksum: bool = True) -> list[str]:
    """What makes a measurement unusable, in words (empty: fine)."""
    out = []
    if fig["sms_used"] != fig["sms_expected"]:
        out.append(f"blocks ran on {fig['sms_used']} SMs, expected {fig['sms_expected']}")
    if fig["per_clk_sm_max"] > 1.25 * fig["per_clk_sm_min"]:
        out.append(f"per-SM rates spread {fig['per_clk_sm_min']:.3g}..{fig['per_clk_sm_max']:.3g}"
                   " (uneven blocks per SM or clock changes)")
    if exp and not (FIXED_POINT - 0.01 < fig["fixed_point_min"]
                    <= fig["fixed_point_max"] < FIXED_POINT + 0.01):
        out.append(f"chains ended in [{fig['fixed_point_min']:.4f}, {fig['fixed_point_max']:.4f}],"
                   f" expected {FIXED_POINT:.4f}: an exp2 variant computes the wrong thing")
    if not exp and checksum and not fig["checksum_ok"]:
        out.append("the sum of loaded words is wrong: loads read the wrong addresses")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10x fewer loop trips (smoke test)")
    parser.add_argument("--name", default="microbench", help="results file name")
    parser.add_argument("--no-matmul", action="store_true", help="skip the bf16 matmul")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="stop starting new measurements after this many seconds (default "
                             "150); what was measured is still written")
    args = parser.parse_args(argv)
    command = "python -m solutions.run_microbench " + " ".join(argv or sys.argv[1:])

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing measured (the kernels' PTX: ExpThroughput(...)"
              ".compile_only('sm_90a'))")
        return 1

    from solutions import microbench as mb
    from utils.results import save

    scale = 10 if args.quick else 1
    t0 = time.perf_counter()
    rows, failures = [], []

    def attempt(what: str, fn):
        """Run one measurement; a crash becomes a FAIL line, the others still run."""
        try:
            return fn()
        except Exception as exc:  # report and carry on: GPU time is scarce
            failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
            traceback.print_exc()
            return None

    def over_budget(what: str) -> bool:
        spent = time.perf_counter() - t0
        if spent > args.budget_s:
            failures.append(f"{what}: skipped after {spent:.0f} s (--budget-s {args.budget_s:g})")
            return True
        return False

    def measure(bench, steps: int, to_rows, bad_of, line_of, indent: str = "  "):
        """One kernel benchmark: measure (unless over budget or it crashes), store its rows,
        turn its problems into FAIL lines, print one line."""
        if over_budget(bench.label):
            return
        fig = attempt(bench.label, lambda: bench.measure(steps=steps // scale))
        if fig is None:
            return
        rows.extend(to_rows(bench, fig))
        bad = bad_of(fig)
        failures.extend(f"{bench.label}: {b}" for b in bad)
        print(f"{indent}{line_of(bench, fig)}{'  FAIL' if bad else ''}")

    print(f"{torch.cuda.get_device_name()}: exp2 throughput "
          f"({mb.CHAINS} chains x {mb.UNROLL} per trip)")
    for bench in mb.exp_variants():
        measure(bench, 3000, exp_rows, lambda fig: problems(fig, exp=True),
                lambda b, fig: f"{b.label:48s} {fig['per_s'] / 1e12:6.3f} T exp/s  "
                               f"{fig['per_clk_sm']:6.2f} exp/clk/SM  (SM clock "
                               f"{fig['sm_clock_ghz']:.2f} GHz, {fig['ms']:.2f} ms)")
    print("shared-memory bandwidth")
    for width, steps in ((16, 12000), (4, 48000)):
        measure(mb.SmemBandwidth(width), steps, smem_rows, lambda fig: problems(fig, exp=False),
                lambda b, fig: f"{b.label:48s} {fig['per_clk_sm']:6.1f} B/clk/SM  "
                               f"{fig['per_s'] / 1e12:6.2f} TB/s  ({fig['ms']:.2f} ms)")
    measure(mb.MmaSyncThroughput(), 20000, mma_rows,
            lambda fig: problems(fig, exp=False, checksum=False)
            + ([] if fig["finite"] else ["the accumulators are not finite"]),
            lambda b, fig: f"{b.label}: {fig['per_s'] / 1e12:6.1f} TFLOP/s  "
                           f"{fig['per_clk_sm']:6.0f} FLOP/clk/SM  (SM clock "
                           f"{fig['sm_clock_ghz']:.2f} GHz, {fig['ms']:.2f} ms)", indent="")
    if not args.no_matmul and not over_budget("matmul"):
        fig = attempt("matmul", mb.matmul_tflops)
        if fig is not None:
            rows += matmul_rows(fig)
            print(f"torch bf16 matmul {fig['n']}^3: {fig['tflops']:.0f} TFLOP/s "
                  f"({fig['ms']:.2f} ms)")
    if not over_budget("copy"):
        fig = attempt("copy", mb.copy_bandwidth)
        if fig is not None:
            rows += copy_rows(fig)
            print(f"HBM copy: {fig['bytes_per_s'] / 1e12:.2f} TB/s read + write "
                  f"({fig['min'] / 1e12:.2f}-{fig['max'] / 1e12:.2f} over {fig['rounds']} rounds)")
    if rows:
        path = save(args.name, rows, command=command)
        print(f"wrote {path} ({len(rows)} rows) in {time.perf_counter() - t0:.1f} s")
    else:
        print("nothing measured: no results file written")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
