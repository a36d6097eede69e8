"""``python -m measure [--write]``: which command makes each stored results file.

Every driver in measure/ declares ``PRODUCES``: a list of (results file, command, what it
holds), the file given as a path under results/ (a ``*`` stands for a run's own name). This
prints the table they make, and with ``--write`` puts it into measure/README.md between its
markers. tests/test_measure.py fails when a stored results file has no command, or the README's
table is out of date.
"""

from __future__ import annotations

import fnmatch
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
README = HERE / "README.md"
START, END = "<!-- produces:start -->", "<!-- produces:end -->"


def drivers() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_"))


def produces() -> list[tuple[str, str, str, str]]:
    """(results file, command, what it holds, driver) of every driver, sorted by file."""
    rows = []
    for name in drivers():
        module = importlib.import_module(f"measure.{name}")
        for entry in getattr(module, "PRODUCES", ()):
            path, command, what = entry
            rows.append((path, command, what, name))
    return sorted(rows)


def stored_files() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "results").rglob("*.json"))


def unmapped() -> list[str]:
    """Stored results files no driver says it makes."""
    patterns = [row[0] for row in produces()]
    return [f for f in stored_files() if not any(fnmatch.fnmatch(f, p) for p in patterns)]


def table() -> str:
    lines = ["| results file | command | what it holds |", "|---|---|---|"]
    lines += [f"| `{path}` | `{command}` | {what} |" for path, command, what, _ in produces()]
    return "\n".join(lines)


def render(text: str) -> str:
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        README.write_text(render(README.read_text()))
        print(f"wrote the table into {README}")
        return 0
    if argv:
        print(__doc__)
        return 2
    print(table())
    missing = unmapped()
    if missing:
        print("\nstored results files no driver makes:\n  " + "\n  ".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
