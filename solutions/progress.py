"""The README's progression table, generated from the registry and the stored results.

    python -m solutions.progress          # print the table
    python -m solutions.progress --write  # rewrite it inside README.md

The headline figure of each version is its forward TFLOP/s at D=128, S=16384 (batch 1,
16 heads), bf16, non-causal, read from ``results/h200/<version results>.json``. A version that
was never measured says so; no figure is typed by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

from solutions.registry import VERSIONS
from utils import results

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- progression:start -->", "<!-- progression:end -->"
HEADLINE = {"pass": "fwd", "d": 128, "s": 16384, "causal": False, "dtype": "bf16"}


def headline(version) -> str:
    if version.results is None:
        return "runs on CPU (not benchmarked)"
    try:
        res = results.load(version.results, gpu="h200")
    except FileNotFoundError:
        return "not measured yet"
    rows = res.where(impl=version.name, **HEADLINE)
    if not rows or rows[0]["tflops"] is None:
        return "not measured yet"
    tflops = rows[0]["tflops"]
    text = f"{tflops:.0f}" if tflops >= 10 else f"{tflops:.2g}"
    ratios = []
    for peer, short in (("sdpa_cudnn", "cuDNN"), ("sdpa_flash", "FA2")):
        found = res.where(impl=peer, **HEADLINE)
        if found and found[0]["tflops"]:
            ratio = tflops / found[0]["tflops"]
            ratios.append(f"{ratio:.2f}x {short}" if ratio >= 0.01 else f"<0.01x {short}")
    if ratios:
        text += f" ({', '.join(ratios)})"
    return text + f" [{res.provenance['date'][:10]}]"


def table() -> str:
    lines = [
        "| chapter | idea | fwd TFLOP/s on H200 (D=128, S=16384; ratios in the same run) "
        "| source |",
        "|---|---|---|---|",
    ]
    for v in VERSIONS:
        src = v.module.replace(".", "/") + ".py"
        lines.append(f"| {v.chapter:02d} | {v.idea} | {headline(v)} | [`{src}`]({src}) |")
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
