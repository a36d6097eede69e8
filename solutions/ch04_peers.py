"""Chapter 04's kernel next to CUTLASS's own Ampere-style FlashAttention-2 example: what the
stored comparison (results/<gpu>/ch04_cutlass_peer.json, made by ``python -m
measure.ch04_cutlass_peer``) holds, and its reading.

CUTLASS ships a CuTe DSL example of the same design, ``flash_attention_v2.py`` (cp.async +
mma.sync, 128 x 64 tiles, 4 warps). Its own benchmark fills Q, K and V with integers in [-2, 2);
the course benchmarks with normal random values, so the run times both kinds of input. Rows: impl,
data, causal, round, tflops (and the shape); medians over rounds are compared inside one run.
"""

from __future__ import annotations

RESULTS = "ch04_cutlass_peer"
SHAPE = {"b": 1, "s": 16384, "h": 16, "d": 128}  # the chapter's headline shape
DATA = ("randn", "int[-2,2)")


def summary(rows: list[dict]) -> list[str]:
    """Per (causal, data): each contender's median over rounds and its ratio to SDPA flash."""
    import statistics

    lines = []
    for causal in dict.fromkeys(r["causal"] for r in rows):
        for data in dict.fromkeys(r["data"] for r in rows):
            sel = [r for r in rows if r["causal"] == causal and r["data"] == data]
            if not sel:
                continue
            med = {impl: statistics.median(r["tflops"] for r in sel if r["impl"] == impl)
                   for impl in dict.fromkeys(r["impl"] for r in sel)}
            base = med.get("sdpa_flash")
            cells = ", ".join(f"{impl} {t:.0f}" + (f" ({t / base:.3f}x)" if base else "")
                              for impl, t in med.items())
            lines.append(f"{'causal' if causal else 'non-causal'}, {data}: {cells}")
    return lines
