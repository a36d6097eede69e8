"""fa4_final cites nothing of the course around it: no course folder or file (solutions/,
results/, labs/, measure/, chapters/, the course's tests/), no chapter number, no notebook, in
any docstring, comment, Note or message. The course moves; the package's text must not rot with
it. (Which measurement backs a default: fa4_final.hopper.defaults, a table the course
generates.)"""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fa4_final"
COURSE = re.compile(
    r"\b(solutions|results|labs|measure|chapters)[/.]\w"  # a course file or module
    r"|\btests/"  # the course's tests
    r"|\bchapters? \d|\bch\d\d\b|\bchapter \d\d"  # a chapter
    r"|\bnotebooks?\b"  # a notebook
    r"|\w+\.ipynb\b|\w+\.json\b",  # a notebook or results file by name
    re.IGNORECASE)


def citations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in COURSE.finditer(line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {m.group(0)!r} in "
                             f"{line.strip()[:90]}")
    return found


def test_the_package_cites_no_course_file():
    found = citations()
    assert not found, f"{len(found)} citations of the course:\n" + "\n".join(found)
