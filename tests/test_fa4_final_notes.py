"""fa4_final's Notes: one syntax, unique names, references that resolve.

A Note is defined by a line that holds only ``Note [Title]``: ``# Note [Title]`` above the code
it explains, or ``Note [Title]`` on its own line as a heading inside a docstring. Every other
``Note [Title]`` in the package is a reference, written whole on one line (so grep finds it),
and names exactly one definition.
"""

import re
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fa4_final"
DEFINITION = re.compile(r"^\s*(?:# )?Note \[([^\]]+)\]\s*$")
REFERENCE = re.compile(r"Note \[([^\]]+)\]")


def _lines():
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{path.relative_to(PACKAGE.parent)}:{number}", line


def definitions() -> Counter:
    return Counter(m.group(1) for _, line in _lines() if (m := DEFINITION.match(line)))


def test_every_note_is_defined_once():
    twice = {title: n for title, n in definitions().items() if n > 1}
    assert not twice, f"Notes defined more than once: {twice}"


def test_every_reference_names_one_definition():
    defined = definitions()
    broken = [f"{where}: Note [{m.group(1)}]" for where, line in _lines()
              if not DEFINITION.match(line) for m in REFERENCE.finditer(line)
              if m.group(1) not in defined]
    assert not broken, "references to no Note:\n" + "\n".join(broken)


def test_references_are_whole_on_one_line():
    cut = [f"{where}: {line.strip()}" for where, line in _lines()
           if re.search(r"Note \[[^\]]*$", line) or re.search(r"Note \[[^\]]*\.\.\]", line)
           or re.search(r"\bNote$", line.rstrip())]
    assert not cut, "Note references cut off (grep cannot find them):\n" + "\n".join(cut)


def test_one_syntax():
    """No underline under a Note's heading, no other spelling of a definition."""
    lines = list(_lines())
    underlined = [where for (where, line), (_, nxt) in zip(lines, lines[1:])
                  if DEFINITION.match(line) and re.match(r"^\s*#?\s*-{3,}\s*$", nxt)]
    assert not underlined, f"Note headings with an underline: {underlined}"
    other = [f"{where}: {line.strip()}" for where, line in lines
             if re.match(r"^\s*#*\s*NOTE\b|^\s*#\s*Note:", line)]
    assert not other, other
