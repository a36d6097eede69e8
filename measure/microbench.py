"""Run the microbenchmarks on this machine's GPU and store them in results/<gpu>/microbench.json.

    timeout 300 python -m measure.microbench          # about 40 s on an H200
    python -m measure.microbench --quick              # 10x fewer loop trips: a smoke test

What it measures (the kernels are ``solutions/microbench.py``, which chapters 00, 04 and 06
teach from; the torch-level measurements are here):
- exp2: MUFU alone, the FMA polynomial alone (degrees 2..5, the naive cvt-floor version, the
  version that does not keep NaN), and mixes with 1..6 of every 8 exps on the polynomial;
  exps per second on the chip, exps per clock per SM, and the SM clock the run had;
- shared memory: bytes per clock per SM with 16-byte and 4-byte loads per thread;
- mma.sync (m16n8k16, bf16 -> fp32) from registers: FLOP/clk/SM and TFLOP/s, chapter 04's ceiling;
- a torch bf16 8192^3 matmul in TFLOP/s, the tensor-core ceiling the other figures compare to;
- a 1 GiB device-to-device copy in B/s (3 interleaved rounds), the HBM bandwidth a streaming
  kernel gets (chapter 01's roofline);
- the cost of one eager PyTorch operator on the GPU, measured where the data is too small to
  matter (chapter 02's launch-bound reading): a one-element ``torch.add`` issued back to back,
  and chapter 02's own tile loop on one head of 1024 tokens (64 KB per operator), per launch.

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

COMMAND = "python -m measure.microbench"
PRODUCES = [("results/h200/microbench.json", COMMAND,
             "per-SM rates of MUFU exp2 (and chapter 06's mixes), shared memory and mma.sync; a "
             "large bf16 matmul; a 1 GiB copy; the cost of one eager PyTorch operator")]
EAGER_OPS = 1000  # one-element adds per timed call of eager_launch_cost
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


def matmul_tflops(n: int = 8192, warmup: int = 3, reps: int = 20, rounds: int = 3) -> dict:
    """torch bf16 n x n x n matmul: 2 n^3 FLOPs per call, L2 flushed; the median over
    ``rounds`` rounds (``utils.bench.interleaved``), their range and the SM clock."""
    import torch

    from utils.bench import interleaved

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    m = interleaved({"matmul": lambda: a @ b}, rounds=rounds, warmup=warmup, rep=reps)["matmul"]
    flops = 2 * n**3
    per_round = [flops / (ms * 1e-3) / 1e12 for ms in m.ms_rounds]
    return {"ms": m.median_ms, "tflops": m.tflops(flops), "n": n, "min": min(per_round),
            "max": max(per_round), "rounds": len(per_round),
            "sm_clock_mhz": m.fields()["sm_clock_mhz"]}


def copy_bandwidth(nbytes: int = 2**30, rounds: int = 3, reps: int = 20) -> dict:
    """Device-to-device ``copy_`` of ``nbytes`` (far larger than the L2): each call reads and
    writes ``nbytes`` of HBM, so 2 * nbytes / time is the bandwidth a streaming kernel gets.
    Median over ``rounds`` rounds (``utils.bench.interleaved``), with their spread and the SM
    clock read during them."""
    import torch

    from utils.bench import interleaved

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    m = interleaved({"copy": lambda: dst.copy_(src)}, rounds=rounds, rep=reps)["copy"]
    per_round = [2 * nbytes / (ms * 1e-3) for ms in m.ms_rounds]
    fields = m.fields()
    return {"bytes_per_s": 2 * nbytes / (m.median_ms * 1e-3), "min": min(per_round),
            "max": max(per_round), "rounds": len(per_round), "ms": m.median_ms,
            "nbytes": nbytes, "sm_clock_mhz": fields["sm_clock_mhz"],
            "sensors": fields["sensors"]}


def eager_launch_cost(rounds: int = 3) -> dict:
    """What one eager PyTorch operator costs the GPU stream when its data is too small to matter:
    (a) ``EAGER_OPS`` one-element ``torch.add`` calls issued back to back, per call; (b) chapter
    02's tile loop (``attention_fa2``) on one head of 1024 tokens, D = 128 (64 KB per operator),
    per launch of its counted launches. CUDA events around a host-bound sequence measure the
    time the host takes to issue it. Medians over ``rounds`` interleaved rounds, with their
    range in microseconds."""
    import torch

    from solutions import ch02_online_softmax as ch02
    from utils.bench import interleaved
    from utils.reference import random_qkv

    x = torch.zeros(1, device="cuda")
    one = torch.ones(1, device="cuda")

    def adds():
        for _ in range(EAGER_OPS):
            torch.add(x, one, out=x)

    s = 1024
    q, k, v, _ = random_qkv(1, s, 1, 128, dtype=torch.bfloat16, device="cuda")
    launches = ch02.launch_count().total(s, s)
    m = interleaved({"adds": adds, "loop": lambda: ch02.attention_fa2(q, k, v)}, rounds=rounds,
                    rep=10, flush_l2=False)
    out = {}
    for key, per_call in (("adds", EAGER_OPS), ("loop", launches)):
        us = [ms * 1e3 / per_call for ms in m[key].ms_rounds]
        out[key] = {"us": m[key].median_ms * 1e3 / per_call, "min": min(us), "max": max(us),
                    "rounds": len(us), "launches": per_call,
                    "sm_clock_mhz": m[key].fields()["sm_clock_mhz"]}
    return out


def launch_rows(fig: dict) -> list[dict]:
    """Result rows of ``eager_launch_cost``: microseconds per operator, with the range of the
    rounds."""
    names = {"adds": "torch.add of one element, back to back",
             "loop": "chapter 02's tile loop, B=1 H=1 S=1024 D=128 (64 KB per operator)"}
    return [{"impl": names[key], "metric": "eager_launch_us", "value": f["us"], "unit": "us",
             "min": f["min"], "max": f["max"], "rounds": f["rounds"], "launches": f["launches"],
             "sm_clock_mhz": f["sm_clock_mhz"]} for key, f in fig.items()]


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
    command = f"{COMMAND} " + " ".join(argv or sys.argv[1:])

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
        fig = attempt("matmul", matmul_tflops)
        if fig is not None:
            rows += matmul_rows(fig)
            print(f"torch bf16 matmul {fig['n']}^3: {fig['tflops']:.0f} TFLOP/s "
                  f"({fig['ms']:.2f} ms)")
    if not over_budget("copy"):
        fig = attempt("copy", copy_bandwidth)
        if fig is not None:
            rows += copy_rows(fig)
            print(f"HBM copy: {fig['bytes_per_s'] / 1e12:.2f} TB/s read + write "
                  f"({fig['min'] / 1e12:.2f}-{fig['max'] / 1e12:.2f} over {fig['rounds']} rounds)")
    if not over_budget("eager launches"):
        fig = attempt("eager launches", eager_launch_cost)
        if fig is not None:
            rows += launch_rows(fig)
            print("eager operator cost: " + ", ".join(
                f"{r['impl']}: {r['value']:.1f} us" for r in launch_rows(fig)))
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
