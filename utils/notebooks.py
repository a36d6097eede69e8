"""The notebook machinery: solved notebooks are the source, learner notebooks are generated.

    python -m utils.notebooks build            # solutions/NN_*.ipynb -> chapters/NN_*.ipynb
    python -m utils.notebooks check            # exit 1 if chapters/ drifted or rules are broken
    python -m utils.notebooks stats            # words, cells, exercises, predictions per notebook
    python -m utils.notebooks from-percent draft.py solutions/NN_slug.ipynb
    python -m utils.notebooks to-percent solutions/NN_slug.ipynb draft.py

In a solved notebook's code cells, the lines between ``# BEGIN SOLUTION`` and ``# END SOLUTION``
are the exercise's answer. The learner's copy gets, at the same indentation, ``raise
NotImplementedError("exercise: replace this line with your code")``, or the single line written
after ``stub:`` on the BEGIN line. Cells tagged ``solution-only`` are left out of the learner's
copy. Outputs and execution counts are stripped from both.

Rules ``check`` enforces: BEGIN/END markers pair up; a cell starting with ``%%gpu`` carries the
``gpu`` tag and a ``gpu``-tagged cell starts with ``%%gpu``; committed notebooks hold no outputs;
markdown cells of solved notebooks type no figures that would be measured (``typed_figures``)
and say nothing about how the course was made (``making_talk``).
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

from utils.claims import unbacked_sentences

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
CHAPTERS = ROOT / "chapters"
LABS = ROOT / "labs"
LAB_NAME = re.compile(r"^[a-z0-9_]+\.ipynb$")
READ_FIRST = re.compile(r"\*\*Read first[:.]?\*\*", re.I)
# One sitting (60-120 minutes): a chapter's core stays within these
SITTING_WORDS, SITTING_CELLS = 3500, 70

BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?:\s+stub:\s*(?P<stub>.*))?$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
DEFAULT_STUB = 'raise NotImplementedError("exercise: replace this line with your code")'
NOTEBOOK_NAME = re.compile(r"^\d\d_[a-z0-9_]+\.ipynb$")

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


class NotebookError(ValueError):
    pass


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _set_source(cell, text: str) -> None:
    lines = text.split("\n")
    cell["source"] = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def stub_solutions(code: str, where: str = "") -> str:
    """Replace every solution region in ``code`` by its stub."""
    out, inside = [], False
    for n, line in enumerate(code.split("\n"), 1):
        m = BEGIN.match(line)
        if m:
            if inside:
                raise NotebookError(f"{where}: nested BEGIN SOLUTION at line {n}")
            inside = True
            out.append(f"{m.group('indent')}# YOUR CODE HERE")
            out.append(m.group("indent") + (m.group("stub") or DEFAULT_STUB).rstrip())
        elif END.match(line):
            if not inside:
                raise NotebookError(f"{where}: END SOLUTION without BEGIN at line {n}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise NotebookError(f"{where}: BEGIN SOLUTION never closed")
    return "\n".join(out)


def clean_cell(cell) -> dict:
    cell = copy.deepcopy(cell)
    if cell["cell_type"] == "code":
        cell["outputs"] = []
        cell["execution_count"] = None
    meta = {k: v for k, v in cell.get("metadata", {}).items() if k == "tags" and v}
    cell["metadata"] = meta
    cell.pop("id", None)
    return cell


def clean_notebook(nb) -> dict:
    return {
        "cells": [clean_cell(c) for c in nb["cells"]],
        "metadata": {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}},
        "nbformat": 4,
        "nbformat_minor": 4,
    }


def learner_version(solved: dict, name: str = "") -> dict:
    nb = clean_notebook(solved)
    cells = []
    for i, cell in enumerate(nb["cells"]):
        if "solution-only" in cell.get("metadata", {}).get("tags", []):
            continue
        if cell["cell_type"] == "code":
            _set_source(cell, stub_solutions(_source(cell), f"{name} cell {i}"))
        cells.append(cell)
    nb["cells"] = cells
    return nb


def dumps(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


# ----------------------------------------------------------------------------------------------
# Prose rules for markdown cells
#
# A measured number changes when it is measured again; typed into prose it goes stale and
# disagrees with the results file next to it. So markdown may not type figures of the kinds
# measurements produce: a throughput (TFLOP/s, TB/s), a speed ratio ("1.06x") or a percentage.
# A code cell prints them from results/ instead. Figures that are not measurements can stay,
# marked one of two ways:
# - the sentence carries a parenthesised source label: "(paper)", "(datasheet)", "(published)"
#   or "(model)" (a figure the course's cycle model computes), e.g. "1613 TFLOP/s on B200
#   (FA4 paper)";
# - the cell lists the exact figures it may type in an HTML comment, which the reader does not
#   see: ``<!-- allow-figures: 4x; 1 % -->`` (tolerances, arithmetic like "4x per doubling").

_FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:[TGP]FLOP/s|[TGP]FLOPS|[TG]B/s)"  # a rate
    r"|(?<![\w.])\d+(?:\.\d+)?[x×](?![\w.]*\d)(?!\w)"  # "1.06x"; not "2 x 16", "128x64"
    r"|(?<![\w.])\d+(?:\.\d+)?\s?%"  # percentage
)
_SOURCE_LABEL = re.compile(r"\([^()]*\b(?:paper|datasheet|published|model)\b[^()]*\)", re.I)
_ALLOW = re.compile(r"<!--\s*allow-figures:(?P<items>.*?)-->", re.S)
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(*\[])|\n\s*\n|\n(?=\s*(?:[-*]|\d+\.)\s)")
_ISSUE_AS_IN_INSTRUCTIONS = "slot|rate|width|port|queue|stage|cycle|logic|line|count|bound|time"
MAKING_TALK = re.compile(
    r"\bthe (?:lead|brief|owner)(?![\w-])"
    rf"|\bthe issue(?![\w-])(?!\s+(?:{_ISSUE_AS_IN_INSTRUCTIONS})s?\b)"
    r"|\btargets? of\b|\bre-?bas(?:e|ed|ing)\b"
    r"|\bwho asked\b"
    # the course's own history: learners meet kernels, not how the course was written
    r"|\btaken out again\b|\bwas not taken here\b|\bfirst version\b|\bnow fixed\b"
    r"|\bthe next thing to look at\b|\bchangelog\b|\bthree changes did it\b"
    r"|\b(?:before|after) (?:this|that|the) (?:change|commit|fix)\b"
    r"|\bin (?:an|the) (?:earlier|older|previous) (?:version|session|commit)\b"
    r"|\b(?:fixed|found) (?:two|three|several|the) (?:races|bugs)\b", re.I)
# a commit hash: 7 to 10 hex digits, with both a letter and a digit
COMMIT_HASH = re.compile(r"(?<![0-9a-zA-Z_/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,10}"
                         r"(?![0-9a-zA-Z_])")
# the answer given before the learner thinks: a prediction (utils.predict) comes first instead
TOLD = re.compile(r"\byou should see\b", re.I)


def typed_figures(markdown: str) -> list[str]:
    """The measured-looking figures a markdown cell types without a source label or an
    ``allow-figures`` entry (see the note above)."""
    allowed = set()
    for m in _ALLOW.finditer(markdown):
        allowed |= {a.strip() for a in m.group("items").split(";") if a.strip()}
    text = _CODE.sub(" ", _ALLOW.sub(" ", markdown))
    found = []
    for sentence in _SENTENCE_END.split(text):
        if _SOURCE_LABEL.search(sentence):
            continue
        found += [m.group(0) for m in _FIGURE.finditer(sentence)
                  if m.group(0).strip() not in allowed]
    return found


def making_talk(markdown: str) -> list[str]:
    """Phrases about how the course was made (its history, commit hashes), which learners have
    no use for, and answers told before a measurement instead of predicted."""
    text = _CODE.sub(" ", re.sub(r"<!--.*?-->", " ", markdown, flags=re.S))
    return [m.group(0) for rx in (MAKING_TALK, COMMIT_HASH, TOLD) for m in rx.finditer(text)]


def prose_problems(nb: dict, name: str) -> list[str]:
    problems = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        src = _source(cell)
        figures = typed_figures(src)
        if figures:
            problems.append(
                f"{name} cell {i}: markdown types {', '.join(repr(f) for f in figures)}: print "
                "measured figures from results/ in a code cell; label a quoted one (paper), "
                "(datasheet), (published) or (model), or list it in <!-- allow-figures: ... -->"
            )
        talk = making_talk(src)
        if talk:
            problems.append(f"{name} cell {i}: markdown talks about how the course was made or "
                            f"tells the answer before a measurement "
                            f"({', '.join(repr(t) for t in talk)}); say it to the learner, and "
                            f"ask for a prediction (utils.predict) instead of 'you should see'")
        unbacked = unbacked_sentences(src)
        if unbacked:
            problems.append(f"{name} cell {i}: markdown compares measurements "
                            f"({', '.join(repr(u) for u in unbacked)}) with no claim behind "
                            f"it: print it from its results file, name a registered claim "
                            f"(<!-- claims: id -->, utils/claims.py), or mark the cell "
                            f"<!-- not-measured: why --> when it compares by principle")
    return problems


def lint(nb: dict, name: str) -> list[str]:
    problems = prose_problems(nb, name)
    for i, cell in enumerate(nb["cells"]):
        src = _source(cell)
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] == "code":
            if cell.get("outputs") or cell.get("execution_count") is not None:
                problems.append(
                    f"{name} cell {i}: has outputs; run `python -m utils.notebooks strip`"
                )
            starts_gpu = src.lstrip().startswith("%%gpu")
            if starts_gpu != ("gpu" in tags):
                problems.append(f"{name} cell {i}: a %%gpu cell and the 'gpu' tag must go together")
            try:
                stub_solutions(src, f"{name} cell {i}")
            except NotebookError as exc:
                problems.append(str(exc))
    return problems


def solved_notebooks() -> list[Path]:
    return sorted(p for p in SOLUTIONS.glob("*.ipynb") if NOTEBOOK_NAME.match(p.name))


def lab_notebooks() -> list[Path]:
    return sorted(p for p in LABS.glob("*.ipynb") if LAB_NAME.match(p.name))


def lint_lab(nb: dict, name: str) -> list[str]:
    """A lab: the prose rules and no outputs, as a chapter; and its first markdown cell says what
    to read first (the chapter it deepens)."""
    problems = lint(nb, name)
    first = next((c for c in nb["cells"] if c["cell_type"] == "markdown"), None)
    if first is None or not READ_FIRST.search(_source(first)):
        problems.append(f"{name}: the first markdown cell must say what to read first "
                        f"('**Read first:** chapter NN, ...')")
    return problems


def build(write: bool = True) -> list[str]:
    """Generate chapters/ from solutions/; return the problems found (empty when all is well).

    With ``write=False`` nothing is written and drift counts as a problem.
    """
    problems = []
    expected = set()
    for path in solved_notebooks():
        solved = json.loads(path.read_text())
        problems += lint(solved, f"solutions/{path.name}")
        try:
            text = dumps(learner_version(solved, path.name))
        except NotebookError as exc:
            problems.append(str(exc))
            continue
        target = CHAPTERS / path.name
        expected.add(target.name)
        if write:
            target.parent.mkdir(exist_ok=True)
            if not target.exists() or target.read_text() != text:
                target.write_text(text)
        elif not target.exists():
            problems.append(
                f"chapters/{path.name} is missing: run `python -m utils.notebooks build`"
            )
        elif target.read_text() != text:
            problems.append(
                f"chapters/{path.name} differs from what solutions/{path.name} generates: "
                "edit the solution, then run `python -m utils.notebooks build`"
            )
    for extra in sorted(CHAPTERS.glob("*.ipynb")):
        if extra.name not in expected:
            problems.append(f"chapters/{extra.name} has no solved notebook in solutions/")
    for path in lab_notebooks():
        problems += lint_lab(json.loads(path.read_text()), f"labs/{path.name}")
    return problems


# ----------------------------------------------------------------------------------------------
# Stats: is every chapter one sitting, does the learner build and predict?

_EXERCISE = re.compile(r"@exercise\(\s*[\"'](?P<id>[\w.]+)[\"']"
                       r"|check_answer\(\s*[\"'](?P<id2>[\w.]+)")
_DEVICE = re.compile(r"^\s*@cute\.(?:jit|kernel)\b", re.M)
_PREDICT = re.compile(r"\bpredict\(\s*[\"'](?P<id>[\w.]+)")
_REVEAL = re.compile(r"\breveal\(\s*[\"'](?P<id>[\w.]+)")
_MEASURED = re.compile(r"\bload_stored\(|\bresults\.load\(")


def notebook_stats(nb: dict) -> dict:
    """Words and cells, exercises (device-code ones: a cell whose exercise is a ``@cute.jit`` or
    ``@cute.kernel`` function), predictions and reveals, and the measurement cells (those that
    read stored results) with no prediction earlier in their section (since the last ``## ``)."""
    words = cells = 0
    exercises, device, predictions, reveals, unpredicted = set(), set(), set(), set(), []
    predicted_in_section = False
    for i, cell in enumerate(nb["cells"]):
        src = _source(cell)
        cells += 1
        if cell["cell_type"] == "markdown":
            words += len(re.sub(r"<!--.*?-->", " ", src, flags=re.S).split())
            if re.search(r"^## ", src, re.M):
                predicted_in_section = False
            continue
        ids = {m.group("id") or m.group("id2") for m in _EXERCISE.finditer(src)}
        exercises |= ids
        if ids and _DEVICE.search(src):
            device |= ids
        if _PREDICT.search(src):
            predicted_in_section = True
        predictions |= {m.group("id") for m in _PREDICT.finditer(src)}
        reveals |= {m.group("id") for m in _REVEAL.finditer(src)}
        if _MEASURED.search(src) and not predicted_in_section:
            unpredicted.append(i)
    return {"words": words, "cells": cells, "exercises": sorted(exercises),
            "device_exercises": sorted(device), "predictions": sorted(predictions),
            "reveals": sorted(reveals), "unpredicted_measurements": unpredicted}


def course_stats() -> list[tuple[str, dict]]:
    """(name, stats) of every solved chapter notebook, then every lab."""
    rows = [(p.name, notebook_stats(json.loads(p.read_text()))) for p in solved_notebooks()]
    rows += [(f"labs/{p.name}", notebook_stats(json.loads(p.read_text())))
             for p in lab_notebooks()]
    return rows


def stats_table(rows=None) -> str:
    """The table ``python -m utils.notebooks stats`` prints: per chapter and lab its words and
    cells against the sitting, its exercises and how many are device code, its predictions, and
    the measurement cells no prediction comes before."""
    rows = course_stats() if rows is None else rows
    head = ("| notebook | md words | cells | one sitting | exercises | device code | "
            "predictions | measurements before any prediction |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for name, st in rows:
        chapter = not name.startswith("labs/")
        fits = st["words"] <= SITTING_WORDS and st["cells"] <= SITTING_CELLS
        lines.append(
            f"| {name} | {st['words']:,} | {st['cells']} | "
            f"{('yes' if fits else 'NO') if chapter else '(lab)'} | {len(st['exercises'])} | "
            f"{len(st['device_exercises'])} | {len(st['predictions'])} | "
            f"{', '.join(f'cell {i}' for i in st['unpredicted_measurements']) or '-'} |")
    return "\n".join(lines)


def strip(paths) -> None:
    for path in paths:
        path = Path(path)
        nb = json.loads(path.read_text())
        path.write_text(dumps(clean_notebook(nb)))


# ----------------------------------------------------------------------------------------------
# Percent-format drafts (the subset jupytext writes): "# %%" starts a code cell, "# %% [markdown]"
# a markdown cell whose lines start with "# ", and "tags=[...]" after "# %%" sets cell tags.

_CELL = re.compile(r"^# %%(?P<md>\s*\[markdown\])?(?:\s+tags=(?P<tags>\[.*\]))?\s*$")


def from_percent(text: str) -> dict:
    cells, current = [], None
    for line in text.split("\n"):
        m = _CELL.match(line)
        if m:
            current = {
                "cell_type": "markdown" if m.group("md") else "code",
                "metadata": {"tags": json.loads(m.group("tags"))} if m.group("tags") else {},
                "lines": [],
            }
            cells.append(current)
        elif current is not None:
            current["lines"].append(line)
    nb_cells = []
    for c in cells:
        lines = c.pop("lines")
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        if c["cell_type"] == "markdown":
            lines = [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in lines]
        else:
            c["outputs"], c["execution_count"] = [], None
        _set_source(c, "\n".join(lines))
        nb_cells.append(c)
    return clean_notebook({"cells": nb_cells})


def to_percent(nb: dict) -> str:
    parts = []
    for cell in nb["cells"]:
        tags = cell.get("metadata", {}).get("tags")
        head = "# %%" + (" [markdown]" if cell["cell_type"] == "markdown" else "")
        if tags:
            head += " tags=" + json.dumps(tags)
        body = _source(cell)
        if cell["cell_type"] == "markdown":
            body = "\n".join(("# " + ln) if ln else "#" for ln in body.split("\n"))
        parts.append(head + "\n" + body)
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv else "check"
    if cmd == "build":
        problems = build(write=True)
    elif cmd == "check":
        problems = build(write=False)
    elif cmd == "stats":
        print(stats_table())
        problems = []
    elif cmd == "strip":
        strip(argv[1:] or [*solved_notebooks(), *sorted(CHAPTERS.glob("*.ipynb"))])
        problems = []
    elif cmd == "from-percent" and len(argv) == 3:
        Path(argv[2]).write_text(dumps(from_percent(Path(argv[1]).read_text())))
        problems = []
    elif cmd == "to-percent" and len(argv) == 3:
        Path(argv[2]).write_text(to_percent(json.loads(Path(argv[1]).read_text())))
        problems = []
    else:
        print(__doc__)
        return 2
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
