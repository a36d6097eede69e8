"""Stored-results rows of the shapes measure/package_sweep.py writes, for testing the readers of
chapter 13 and of the package lab without a GPU: fake numbers, real provenance fields."""

from pathlib import Path

from utils.results import Results

PROV = {"gpu": "NVIDIA H200", "driver": "x", "cuda": "13.0", "torch": "2.11", "cutlass_dsl": "4",
        "commit": "abc", "date": "2026-12-01 00:00 UTC", "command": "test"}


def fake(name, rows):
    return Results(name, Path(f"{name}.json"), PROV, rows)


def timed(impl, pass_, d, s, causal, tflops, spread=0.01):
    ms = 1000.0 / tflops
    return {"impl": impl, "pass": pass_, "dtype": "bf16", "b": 16384 // s, "s": s, "h": 16,
            "d": d, "causal": causal, "ms": ms, "tflops": tflops, "spread": spread,
            "ms_rounds": [ms] * 3}


def sweep(passes):
    """package_sweep rows: fa4_final ahead at D = 64, behind at D = 128, three peers."""
    rows = []
    for pass_ in passes:
        for d in (64, 128):
            for s in (512, 4096, 32768):
                for causal in (False, True):
                    base = 300 + s / 100
                    ours = base * (1.1 if d == 64 else 0.9)
                    rows += [timed("fa4_final", pass_, d, s, causal, ours),
                             timed("sdpa_flash", pass_, d, s, causal, base * 0.7),
                             timed("sdpa_cudnn", pass_, d, s, causal, base),
                             timed("fa4_package", pass_, d, s, causal, base * 1.003)]
    return fake("package_sweep", rows)
