"""The README's progression table, generated from the registry and the stored results.

    python -m solutions.progress          # print the table
    python -m solutions.progress --write  # rewrite it inside README.md

The headline figure of each version is its forward TFLOP/s at D=128, S=16384 (batch 1,
16 heads), bf16, non-causal (for the backward of chapter 11, its backward TFLOP/s there),
read from ``results/h200/<version results>.json``, with its ratio
to the fastest peer measured in the same run (named), to the FA4 package when that is not the
fastest, and to cuDNN and FlashAttention-2 (SDPA's flash backend). A ratio within the rows'
spread is marked "~" (``utils.bench.compare``). A version that was never measured says so; no
figure is typed by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

from solutions.registry import VERSIONS
from utils import results
from utils.bench import compare, is_peer

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- progression:start -->", "<!-- progression:end -->"
HEADLINE = {"pass": "fwd", "d": 128, "s": 16384, "causal": False, "dtype": "bf16"}
# (chapter, idea, results file, impl, source): the backward's row, after the forwards
BACKWARD = (11, "fa4_final backward: K, V and dK, dV stay per CTA, dQ by float32 bulk adds",
            "ch11_bwd", "fa4_final", "fa4_final/hopper/bwd.py")


PEER_SHORT = {"fa4_package": "FA4 package", "sdpa_cudnn": "cuDNN", "sdpa_flash": "FA2",
              "sdpa_efficient": "SDPA mem-efficient", "sdpa_math": "SDPA math"}


def _ratio(row: dict, peer: dict) -> str:
    ratio = row["tflops"] / peer["tflops"]
    text = f"{ratio:.2f}x" if ratio >= 0.01 else "<0.01x"
    cmp = compare(row, peer)
    return ("~" if cmp is not None and not cmp.real else "") + text


def headline(version) -> str:
    if version.results is None:
        if version.needs == "sm_100":
            return "compiled for sm_100a and checked without a GPU; never run (no B200 here)"
        return "runs on CPU (not benchmarked)"
    return measured(version.results, version.name, HEADLINE)


def measured(results_name: str, impl: str, shape: dict) -> str:
    """``impl``'s TFLOP/s at ``shape`` in results/h200/<results_name>.json, with its ratios."""
    try:
        res = results.load(results_name, gpu="h200")
    except FileNotFoundError:
        return "not measured yet"
    rows = res.where(impl=impl, **shape)
    if not rows or rows[0]["tflops"] is None:
        return "not measured yet"
    row = rows[0]
    tflops = row["tflops"]
    text = f"{tflops:.0f}" if tflops >= 10 else f"{tflops:.2g}"
    peers = {r["impl"]: r for r in res.rows if is_peer(r) and r.get("tflops")
             and all(r.get(k) == v for k, v in shape.items())}
    ratios = []
    top = max(peers.values(), key=lambda r: r["tflops"], default=None)
    if top is not None:
        ratios.append(f"{_ratio(row, top)} {PEER_SHORT.get(top['impl'], top['impl'])} "
                      "(fastest peer)")
    for name in ("fa4_package", "sdpa_cudnn", "sdpa_flash"):
        if name in peers and peers[name] is not top:
            ratios.append(f"{_ratio(row, peers[name])} {PEER_SHORT[name]}")
    if ratios:
        text += f": {', '.join(ratios)}"
    return text + f" [{res.provenance['date'][:10]}]"


def table() -> str:
    lines = [
        "| chapter | idea | TFLOP/s on H200 (D=128, S=16384; forward unless marked bwd): ratios "
        "to peers of the same run, ~ within noise | source |",
        "|---|---|---|---|",
    ]
    for v in VERSIONS:
        src = v.module.replace(".", "/") + ".py"
        lines.append(f"| {v.chapter:02d} | {v.idea} | {headline(v)} | [`{src}`]({src}) |")
    chapter, idea, name, impl, src = BACKWARD
    figure = measured(name, impl, {**HEADLINE, "pass": "bwd"})
    lines.append(f"| {chapter:02d} | {idea} | bwd {figure} | [`{src}`]({src}) |")
    return "\n".join(lines)


def render(readme_text: str) -> str:
    head, rest = readme_text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--write" in argv:
        README.write_text(render(README.read_text()))
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
