"""The workshop guide's exercise reference, generated from the solved notebooks.

    python -m utils.workshop          # print the generated section
    python -m utils.workshop --write  # rewrite it inside docs/workshop.md

Every self-checking exercise is found where the notebooks declare it:
``@exercise("NN.k", check=..., reference=...)`` above a function, or
``check_answer("NN.k", answer, check=...)`` for a value. For each one the section gives its
chapter, what the learner writes, its title (from the markdown cell that sets it), and the
mistakes its checker names: the messages of the checker's own ``raise AssertionError(...)`` and
``assert ..., msg`` statements, read from its source ("…" stands for a value filled in at run
time). A test fails when docs/workshop.md is out of date, so the guide lists exactly the
exercises the notebooks have, with the hints their checkers really give.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from utils import notebooks as nbm

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "workshop.md"
START, END = "<!-- exercises:start -->", "<!-- exercises:end -->"
NOTE_HEADING = re.compile(r"^#### (\d\d\.\d+)\b", re.M)

_DECLARED = re.compile(
    r"""(?P<how>@exercise|check_answer)\(\s*["'](?P<id>\d\d\.\d+)["'].*?check=(?P<check>[\w.]+)""",
    re.S,
)
_IMPORT_AS = re.compile(
    r"^\s*from ([\w.]+) import (\w+) as (\w+)\s*$|^\s*import ([\w.]+) as (\w+)\s*$", re.M
)


@dataclass
class Exercise:
    id: str
    notebook: str  # e.g. "02_online_softmax"
    kind: str  # "function" or "value"
    learner_writes: str  # the function's name, or "answer"
    checker: str  # dotted path of the check function
    title: str
    messages: list[str] = field(default_factory=list)

    @property
    def chapter(self) -> str:
        return self.id.split(".")[0]


def _source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _aliases(code: str) -> dict[str, str]:
    out = {}
    for m in _IMPORT_AS.finditer(code):
        if m.group(1):
            out[m.group(3)] = f"{m.group(1)}.{m.group(2)}"
        else:
            out[m.group(5)] = m.group(4)
    return out


def _title(cells, index: int, ex_id: str) -> str:
    """The exercise's title from the nearest markdown cell above that names its id."""
    for j in range(index - 1, max(-1, index - 8), -1):
        if cells[j]["cell_type"] != "markdown":
            continue
        for para in re.split(r"\n\s*\n", _source(cells[j])):
            if ex_id not in para:
                continue
            line = next(ln for ln in para.splitlines() if ex_id in ln)
            m = re.search(rf"Exercise {re.escape(ex_id)}:\s*(.+?)(?:\*\*|$)", line.strip())
            text = " ".join(para.split())
            if m:
                return m.group(1).strip().rstrip(".").replace("**", "")
            rest = re.split(rf"\**(?:Exercise )?{re.escape(ex_id)}\.?\**", text, maxsplit=1)[-1]
            sentence = re.split(r"(?<=[.?])\s", rest.strip(), maxsplit=1)[0]
            return sentence.strip().rstrip(".").replace("**", "")
    return ""


def _render(node) -> str | None:
    """The literal text of a message expression; "…" for the parts filled in at run time."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _render(node.left), _render(node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else "…") + (right if right is not None else "…")
    return None


def _strings(node):
    """(line, text) of every message-like string under ``node``: string literals, f-strings and
    their ``+`` sums, docstrings left out."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        for child in body:
            yield from _strings(child)
        return
    text = _render(node) if isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)) else None
    if text is not None:
        yield node.lineno, text
        return
    for child in ast.iter_child_nodes(node):
        yield from _strings(child)


def _hint_tables(fn, tree) -> list[str]:
    """Strings in the module's private dicts, lists and tuples that ``fn`` reads (tables of
    explanations such as ``_OUTCOME_WHY[outcome]``)."""
    module = sys.modules[fn.__module__]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id.startswith("_"):
            table = getattr(module, node.id, None)
            values = table.values() if isinstance(table, dict) else table
            if isinstance(table, (dict, list, tuple)):
                out += [v for v in values if isinstance(v, str) and v not in out]
    return out


def _helpers(fn, tree) -> list:
    """The module's own private functions that ``fn`` calls (where checkers keep hints)."""
    module = sys.modules[fn.__module__]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            helper = getattr(module, node.func.id, None)
            if (node.func.id.startswith("_") and inspect.isfunction(helper)
                    and helper.__module__ == fn.__module__ and helper not in out):
                out.append(helper)
    return out


def checker_messages(fn, _seen=None) -> list[str]:
    """What a check function can tell a learner: the strings in its source, in the module's
    private tables of explanations it reads, and in the module's private helpers it calls, in
    that order ("…" where a value is filled in)."""
    seen = _seen if _seen is not None else set()
    seen.add(fn)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    found = [(0, text) for _, text in sorted(_strings(tree.body[0]))]
    found += [(0, text) for text in _hint_tables(fn, tree)]
    for helper in _helpers(fn, tree):
        if helper not in seen:
            found += [(1, text) for text in checker_messages(helper, seen)]
    out = []
    for _, text in found:
        text = " ".join(text.split())
        if _is_hint(text):
            out.append(text)
    return list(dict.fromkeys(out))


def _is_hint(text: str) -> bool:
    """A sentence in words, not a label such as "seqlen_q=…, tiles 32x32" (five words or more
    of two letters or more, once brackets and punctuation are stripped)."""
    words = [w.strip("()[]{},.;:?!'\"") for w in text.split()]
    return sum(1 for w in words if len(w) >= 2 and w.isalpha()) >= 5


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def exercises(notebooks=None) -> list[Exercise]:
    """Every exercise the solved notebooks declare, in chapter and id order."""
    out = []
    for path in notebooks or nbm.solved_notebooks():
        nb = json.loads(Path(path).read_text())
        cells = nb["cells"]
        code = "\n".join(_source(c) for c in cells if c["cell_type"] == "code")
        aliases = _aliases(code)
        for i, cell in enumerate(cells):
            if cell["cell_type"] != "code":
                continue
            src = _source(cell)
            for m in _DECLARED.finditer(src):
                head, _, attr = m.group("check").partition(".")
                checker = f"{aliases.get(head, head)}.{attr}" if attr else m.group("check")
                if m.group("how") == "@exercise":
                    fn = re.search(r"def (\w+)\(", src[m.end():])
                    kind, writes = "function", fn.group(1) if fn else "?"
                else:
                    kind, writes = "value", "answer"
                try:
                    messages = checker_messages(_resolve(checker))
                except (ImportError, AttributeError, OSError, TypeError):
                    messages = []
                out.append(Exercise(m.group("id"), Path(path).stem, kind, writes, checker,
                                    _title(cells, i, m.group("id")), messages))
    return sorted(out, key=lambda e: tuple(int(x) for x in e.id.split(".")))


def noted_ids(guide_text: str) -> set[str]:
    """Exercise ids that have a hand-written instructor note (a ``#### NN.k`` heading)."""
    head = guide_text.split(START)[0]
    return set(NOTE_HEADING.findall(head))


def _message(text: str) -> str:
    """A checker's message (plain text) made safe inside the guide's markdown."""
    for ch in "\\*|$":
        text = text.replace(ch, "\\" + ch)
    return text


def _cell(title: str, limit: int = 100) -> str:
    """A title (markdown from a notebook) cut to fit a table cell, code spans kept whole."""
    if len(title) > limit:
        title = title[:limit].rsplit(" ", 1)[0]
        if title.count("`") % 2:
            title = title[: title.rindex("`")].rstrip()
        title = title.rstrip(",;:(") + " …"
    return title.replace("|", "\\|")


def section(exs: list[Exercise], noted: set[str] = frozenset()) -> str:
    lines = [
        "| exercise | chapter | the learner writes | title | checked by |",
        "|---|---|---|---|---|",
    ]
    for e in exs:
        writes = f"`{e.learner_writes}(...)`" if e.kind == "function" else "a value: `answer`"
        lines.append(
            f"| {e.id} | `{e.notebook}` | {writes} | {_cell(e.title)} | `{e.checker}` |"
        )
    for chapter in dict.fromkeys(e.chapter for e in exs):
        chapter_exs = [e for e in exs if e.chapter == chapter]
        lines += ["", f"### Chapter {chapter} exercises: `{chapter_exs[0].notebook}`"]
        for e in chapter_exs:
            note = "" if e.id in noted else " (no instructor note yet)"
            lines += ["", f"**{e.id}** {e.title}{note}. What its checker tells a learner:",
                      ""]
            if e.messages:
                lines += [f"- {_message(msg)}" for msg in e.messages]
            else:
                lines.append("- (its checker's messages come from a shared helper)")
    return "\n".join(lines)


FACTS_START, FACTS_END = "<!-- facts:start -->", "<!-- facts:end -->"
_GPU_CELL = re.compile(r"^\s*%%gpu\s+(sm_\d+)", re.M)
_READ_FIRST_CHAPTERS = re.compile(r"chapters?\s+(\d\d)(?:\s*(?:-|and|to)\s*(\d\d))?", re.I)


def _labs_by_chapter() -> dict[str, list[str]]:
    """Chapter number -> the labs whose first cell says to read that chapter first."""
    found: dict[str, list[str]] = {}
    for path in nbm.lab_notebooks():
        first = next((c for c in json.loads(path.read_text())["cells"]
                      if c["cell_type"] == "markdown"), None)
        line = next((ln for ln in _source(first).splitlines() if nbm.READ_FIRST.search(ln)), "")
        for a, b in _READ_FIRST_CHAPTERS.findall(line):
            for n in range(int(a), int(b or a) + 1):
                found.setdefault(f"{n:02d}", []).append(path.stem)
    return found


def facts() -> str:
    """The course at a glance, from the notebooks themselves: each chapter's size against one
    sitting, its exercises (device code among them), its predictions, which GPU its live cells
    need, and the labs that deepen it; then the longest chapter."""
    labs = _labs_by_chapter()
    lines = ["| chapter | markdown words | cells | exercises (device code) | predictions | "
             "live on a GPU | labs |", "|---|---|---|---|---|---|---|"]
    longest = None
    for path in nbm.solved_notebooks():
        nb = json.loads(path.read_text())
        st = nbm.notebook_stats(nb)
        gpus = sorted({m for c in nb["cells"] if c["cell_type"] == "code"
                       for m in _GPU_CELL.findall(_source(c))})
        chapter = path.stem[:2]
        lines.append(f"| `{path.stem}` | {st['words']:,} | {st['cells']} | "
                     f"{len(st['exercises'])} ({len(st['device_exercises'])}) | "
                     f"{len(st['predictions'])} | {', '.join(gpus) or 'CPU only'} | "
                     f"{', '.join(f'`{lab}`' for lab in labs.get(chapter, [])) or '-'} |")
        if longest is None or st["words"] > longest[1]:
            longest = (path.stem, st["words"], st["cells"])
    lines += ["", f"The longest chapter is `{longest[0]}` ({longest[1]:,} markdown words, "
                  f"{longest[2]} cells); one sitting is at most about {nbm.SITTING_WORDS:,} "
                  f"words and {nbm.SITTING_CELLS} cells. Every cell runs on a CPU; a cell "
                  f"marked for a GPU prints a note there, and the cell beside it shows the "
                  f"compiled code or the stored measurement."]
    return "\n".join(lines)


def render(guide_text: str, exs: list[Exercise] | None = None) -> str:
    exs = exercises() if exs is None else exs
    head, rest = guide_text.split(START, 1)
    _, tail = rest.split(END, 1)
    if FACTS_START in head:
        before, _, after = head.partition(FACTS_START)
        _, _, after = after.partition(FACTS_END)
        head = f"{before}{FACTS_START}\n{facts()}\n{FACTS_END}{after}"
    return f"{head}{START}\n{section(exs, noted_ids(guide_text))}\n{END}{tail}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--write" in argv:
        GUIDE.write_text(render(GUIDE.read_text()))
    else:
        print(section(exercises(), noted_ids(GUIDE.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
