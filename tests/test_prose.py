"""Learner-facing text speaks of kernels, never of how the course was made: the README, the
workshop guide, every solved notebook and lab (utils.notebooks.making_talk: the course's
history, commit hashes, "you should see" before a measurement)."""

import json
from pathlib import Path

import pytest

from utils import notebooks as nbm

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "labs").glob("*.md")), *sorted((ROOT / "measure").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_pages_have_no_process_talk(page):
    assert nbm.making_talk(page.read_text()) == []


@pytest.mark.parametrize("path", [*nbm.solved_notebooks(), *nbm.lab_notebooks()],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_notebooks_have_no_process_talk(path):
    found = {i: nbm.making_talk(nbm._source(c))
             for i, c in enumerate(json.loads(path.read_text())["cells"])
             if c["cell_type"] == "markdown"}
    assert not {i: f for i, f in found.items() if f}


def test_process_talk_is_recognised():
    for text in ("that knob was taken out again", "in the first version of the kernel",
                 "both races are now fixed", "measured at commit 805c395",
                 "You should see 42", "the next thing to look at is"):
        assert nbm.making_talk(text), text
    for text in ("the kernel issues one wgmma", "a TMA load of 128 rows", "see section 4",
                 "the issue slot of the FMA pipe", "tile 0x80 is 128"):
        assert not nbm.making_talk(text), text
