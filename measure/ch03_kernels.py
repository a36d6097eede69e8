"""Chapter 03's three kernels on a GPU beside what PyTorch does with the same bytes and FLOPs, in
interleaved rounds, stored in results/<gpu>/ch03_kernels.json.

    timeout 300 python -m measure.ch03_kernels          # about a minute on an H200

- the vector add (one 4-byte element per thread) and ``torch.add``, fp32, 2^26 elements: GB/s
  counting 12 bytes per element (read two, write one);
- the tiled copy (16-byte vectors) and ``Tensor.copy_``, bf16, 8192 x 8192: GB/s counting 4 bytes
  per element (read, write);
- ``gemm_tn`` (cp.async, ldmatrix, mma.sync, no overlap of loads and math) and torch's bf16
  matmul (cuBLAS), 4096^3: TFLOP/s.

Each pair is timed in ``--rounds`` interleaved rounds (utils.bench.interleaved); rows keep the
median, each round's value, the spread and the SM clock. Every kernel's result is checked against
PyTorch first; a wrong result is a FAIL and nothing of that pair is stored.
"""

from __future__ import annotations

import argparse
import sys

COMMAND = "python -m measure.ch03_kernels"
PRODUCES = [("results/h200/ch03_kernels.json", COMMAND,
             "chapter 03's vector add, tiled copy and gemm_tn beside torch.add, copy_ and the "
             "bf16 matmul, in interleaved rounds")]


def _rows(pair: str, measured: dict, per_call: float, unit: str, scale: float) -> list[dict]:
    """One row per implementation: ``per_call`` units of work per call (bytes or FLOPs),
    reported in ``unit`` after dividing by ``scale``."""
    rows = []
    for impl, m in measured.items():
        fields = m.fields()
        values = [per_call / (ms * 1e-3) / scale for ms in m.ms_rounds]
        rows.append({"impl": impl, "pair": pair, "metric": "rate", "unit": unit,
                     "value": per_call / (m.median_ms * 1e-3) / scale,
                     "value_rounds": values, **fields})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="ch03_kernels")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing measured")
        return 1

    from solutions import ch03_cute_basics as ch03
    from utils.bench import interleaved
    from utils.results import save

    rows, failures = [], []
    n = 1 << 26
    x, y = (torch.randn(n, device="cuda") for _ in range(2))
    z = torch.empty_like(x)
    if torch.equal(ch03.vector_add(x, y, out=z), x + y):
        m = interleaved({"vector_add": lambda: ch03.vector_add(x, y, out=z),
                         "torch.add": lambda: torch.add(x, y, out=z)}, rounds=args.rounds)
        rows += _rows("vector add, fp32, 2^26 elements", m, 12 * n, "GB/s", 1e9)
    else:
        failures.append("vector_add differs from torch.add")

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    if torch.equal(ch03.tiled_copy(a, out=out), a):
        m = interleaved({"tiled_copy": lambda: ch03.tiled_copy(a, out=out),
                         "torch copy_": lambda: out.copy_(a)}, rounds=args.rounds)
        rows += _rows("copy, bf16, 8192 x 8192", m, 4 * a.numel(), "GB/s", 1e9)
    else:
        failures.append("tiled_copy differs from its input")

    s = 4096
    ga = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    gb = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(s, s, device="cuda")
    ref = ga.double() @ gb.double().T
    err = ((ch03.gemm_tn(ga, gb, out=c).double() - ref).norm() / ref.norm()).item()
    if err < 1e-5:
        m = interleaved({"gemm_tn": lambda: ch03.gemm_tn(ga, gb, out=c),
                         "torch bf16 matmul": lambda: ga @ gb.T}, rounds=args.rounds)
        rows += _rows("gemm, bf16 in, 4096^3", m, 2 * s**3, "TFLOP/s", 1e12)
    else:
        failures.append(f"gemm_tn's relative error {err:.1e} against float64")

    for r in rows:
        print(f"{r['pair']:<34} {r['impl']:<18} {r['value']:9.1f} {r['unit']}  "
              f"(spread {r['spread']:.1%})")
    if rows:
        print("wrote", save(args.name, rows, command=f"{COMMAND} " + " ".join(argv or [])))
    for f in failures:
        print("FAIL", f)
    return 1 if failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
