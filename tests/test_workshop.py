"""docs/workshop.md lists exactly the notebooks' exercises, with their checkers' real hints."""

import re

from utils import notebooks as nbm
from utils import workshop

GUIDE = workshop.GUIDE.read_text()
HAND_WRITTEN = GUIDE.split(workshop.START)[0]
IDS = [e.id for e in workshop.exercises()]
ID = re.compile(r"(?<![\d.])\d\d\.\d+(?![\d.])")


def test_generated_reference_is_current():
    assert workshop.render(GUIDE) == GUIDE, "run `python -m utils.workshop --write`"


def test_every_exercise_of_the_notebooks_is_found():
    code = "\n".join(p.read_text() for p in nbm.solved_notebooks())
    declared = set(re.findall(r'(?:@exercise|check_answer)\(\\"(\d\d\.\d+)\\"', code))
    assert declared and set(IDS) == declared
    assert len(IDS) == len(set(IDS)), "an exercise id is used twice"
    for e in workshop.exercises():
        assert e.notebook.startswith(e.chapter + "_"), e
        assert e.title, f"{e.id}: no title found in the markdown above it"
        assert e.messages, f"{e.id}: no message found in {e.checker}"


def test_the_guide_names_only_exercises_and_chapters_that_exist():
    named = set(ID.findall(HAND_WRITTEN))
    assert named <= set(IDS), f"the guide names exercises that do not exist: {named - set(IDS)}"
    assert workshop.noted_ids(GUIDE) <= set(IDS)
    notebooks = {p.stem for p in nbm.solved_notebooks()}
    mentioned = set(re.findall(r"\b\d\d_[a-z0-9_]+\b", HAND_WRITTEN))
    assert mentioned <= notebooks, mentioned - notebooks


def test_the_paths_use_exercises_of_chapters_that_exist():
    paths = HAND_WRITTEN.split("## Notes on each exercise")[0]
    used = set(ID.findall(paths))
    assert used and used <= set(IDS)
    chapters = {p.name[:2] for p in nbm.solved_notebooks()}
    for row in re.findall(r"^\| [^|]*\| (\d\d)\b", paths, re.M):  # a table's chapter column
        assert row in chapters, row


def test_every_exercise_has_a_note_or_says_it_has_none():
    noted = workshop.noted_ids(GUIDE)
    for ex_id in IDS:
        marked = f"**{ex_id}** " in GUIDE and "(no instructor note yet)" in GUIDE
        assert ex_id in noted or marked, ex_id


def test_later_chapters_have_a_marked_place():
    """Every chapter of the course's plan (00-12) that has no notebook yet is named in the
    marked section, so the guide says what is still to come."""
    present = {int(p.name[:2]) for p in nbm.solved_notebooks()}
    missing = [n for n in range(13) if n not in present]
    if not missing:
        return
    assert "## Chapters still to come" in HAND_WRITTEN
    section = HAND_WRITTEN.split("## Chapters still to come", 1)[1].split("\n## ", 1)[0]
    for n in missing:
        assert f"{n:02d}" in section or f" {n}" in section, n
    assert "python -m utils.workshop --write" in HAND_WRITTEN


# ----------------------------------------------------------------------------------------------
# The extractor, on code written here

_TABLE = {"a": "a barrier orders the threads' ordinary stores among themselves"}


def _explain(x):
    return f"you gave {x}, which is not a whole number of tiles"


def check_demo(fn):
    """Docstrings are not messages, however many words they have in them."""
    got = fn(3)
    label = f"x={got}, n=2"  # a label: too few words to be a hint
    hint = ("a tile does two matmuls, count both" if got == 1 else "divide by the clock rate")
    assert got is not None, "return a number of tiles, not None"
    if got != 4:
        raise AssertionError(f"{label}: expected 4, got {got}: {hint}; " + _explain(got))
    if got == "a":
        raise AssertionError(_TABLE[got])


def test_checker_messages_reads_literals_helpers_and_tables():
    assert workshop.checker_messages(check_demo) == [
        "a tile does two matmuls, count both",  # literals in source order, labels left out
        "divide by the clock rate",
        "return a number of tiles, not None",
        "a barrier orders the threads' ordinary stores among themselves",  # a private table
        "you gave …, which is not a whole number of tiles",  # a private helper
    ]


def test_exercises_are_found_in_a_notebook(tmp_path):
    nb = nbm.from_percent(
        "# %% [markdown]\n# ### Exercise 42.1: a demo title\n# Some words.\n\n"
        "# %%\nfrom solutions import ch02_online_softmax as c2\n"
        "@exercise(\"42.1\", check=c2.check_lse, reference=c2.lse_from_state)\n"
        "def my_lse(m, l):\n    raise NotImplementedError\n\n"
        "# %% [markdown]\n# **42.2** Which unit binds? Answer with a name.\n\n"
        "# %%\nanswer = check_answer(\"42.2\", None, check=c2.check_lse)\n"
    )
    path = tmp_path / "42_demo.ipynb"
    path.write_text(nbm.dumps(nb))
    found = workshop.exercises([path])
    assert [(e.id, e.kind, e.learner_writes, e.checker, e.title) for e in found] == [
        ("42.1", "function", "my_lse", "solutions.ch02_online_softmax.check_lse",
         "a demo title"),
        ("42.2", "value", "answer", "solutions.ch02_online_softmax.check_lse",
         "Which unit binds?"),
    ]
    section = workshop.section(found, noted={"42.1"})
    assert "| 42.1 | `42_demo` | `my_lse(...)` | a demo title |" in section
    assert "**42.2** Which unit binds? (no instructor note yet)" in section
