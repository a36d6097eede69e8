"""The generator that writes chapters/ from solutions/, and its drift check."""

import json
import shutil
from pathlib import Path

import pytest

from utils import notebooks as nbm

SOLVED = '''# %% [markdown]
# # Demo chapter
# Some *prose*.

# %%
%load_ext utils.notebook

# %%
def add(a, b):
    # BEGIN SOLUTION
    return a + b
    # END SOLUTION

# %%
# BEGIN SOLUTION stub: answer = None
answer = 42
# END SOLUTION

# %% tags=["gpu"]
%%gpu sm_90
print("on the GPU")

# %% tags=["solution-only"]
print("only in the solved notebook")
'''


def test_stub_keeps_indentation_and_custom_stub():
    nb = nbm.learner_version(nbm.from_percent(SOLVED))
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert "    raise NotImplementedError" in code[1] and "return a + b" not in code[1]
    assert code[2].splitlines() == ["# YOUR CODE HERE", "answer = None"]
    assert not any("only in the solved" in c for c in code)


def test_percent_round_trip():
    nb = nbm.from_percent(SOLVED)
    again = nbm.from_percent(nbm.to_percent(nb))
    assert again == nb
    assert nb["cells"][4]["metadata"] == {"tags": ["gpu"]}


def test_lint_rules():
    nb = nbm.from_percent(SOLVED)
    assert nbm.lint(nb, "demo") == []
    nb["cells"][4]["metadata"] = {}
    nb["cells"][2]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "x"}]
    problems = nbm.lint(nb, "demo")
    assert any("gpu" in p for p in problems) and any("outputs" in p for p in problems)


def test_unclosed_region_is_an_error():
    with pytest.raises(nbm.NotebookError, match="never closed"):
        nbm.stub_solutions("# BEGIN SOLUTION\nx = 1\n")
    with pytest.raises(nbm.NotebookError, match="without BEGIN"):
        nbm.stub_solutions("x = 1\n# END SOLUTION\n")


def test_repository_notebooks_are_in_step():
    assert nbm.build(write=False) == []


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "chapters").mkdir()
    (tmp_path / "solutions" / "99_demo.ipynb").write_text(nbm.dumps(nbm.from_percent(SOLVED)))
    monkeypatch.setattr(nbm, "SOLUTIONS", tmp_path / "solutions")
    monkeypatch.setattr(nbm, "CHAPTERS", tmp_path / "chapters")
    return tmp_path


def test_drift_check_catches_an_edited_solution(sandbox):
    assert nbm.build(write=False)  # chapters/ missing
    assert nbm.build(write=True) == []
    assert nbm.build(write=False) == []
    path = sandbox / "solutions" / "99_demo.ipynb"
    nb = json.loads(path.read_text())
    nb["cells"][0]["source"] = ["# Demo chapter, edited\n"]
    path.write_text(nbm.dumps(nb))
    problems = nbm.build(write=False)
    assert len(problems) == 1 and "differs" in problems[0]


def test_orphan_chapter_is_reported(sandbox):
    nbm.build(write=True)
    shutil.copy(sandbox / "chapters" / "99_demo.ipynb", sandbox / "chapters" / "98_orphan.ipynb")
    assert any("no solved notebook" in p for p in nbm.build(write=False))


# -- prose rules: no typed measurements, no talk about how the course was made -----------------


@pytest.mark.parametrize("text, figures", [
    ("The kernel reaches 394 TFLOP/s here.", ["394 TFLOP/s"]),
    ("It runs 1.06x as fast as FA2, and 61% of the peak.", ["1.06x", "61%"]),
    ("Copies move 3.9 TB/s; about 0.5 % more with 2 stages.", ["3.9 TB/s", "0.5 %"]),
    ("A 45× margin.", ["45×"]),
    ("1,234 GFLOPs of work", []),  # a FLOP count, not a rate
    ("2 × 16 lanes, a 128x64 tile, 2 x 16, bits 0x4B400000, x2.5 for the backward", []),
    ("In code it is fine: `ratio = 1.06x` and\n```\nprint('61%')\n```", []),
    ("sm_90a, %%gpu cells, 2^-8 = 3.9e-3, 4·B·H·S²·D", []),
])
def test_typed_figures_are_found(text, figures):
    assert nbm.typed_figures(text) == figures


def test_a_source_label_in_the_same_sentence_allows_a_quoted_figure():
    assert nbm.typed_figures("B200 reaches 1613 TFLOP/s (FA4 paper).") == []
    assert nbm.typed_figures("HBM moves 4.8 TB/s (H200 datasheet). Our copy: 4.1 TB/s.") == [
        "4.1 TB/s"]
    assert nbm.typed_figures("- 1.1-1.3x cuDNN (published)\n- 0.94x here") == ["0.94x"]
    assert nbm.typed_figures("The model gives 1.00x (model).") == []
    assert nbm.typed_figures("The model gives 1.00x.") == ["1.00x"]  # a label, not a word


def test_allow_figures_lists_exactly_what_a_cell_may_type():
    cell = "<!-- allow-figures: 1 %; 4x -->\nWithin 1 % is enough; it grows 4x, then 8x."
    assert nbm.typed_figures(cell) == ["8x"]


@pytest.mark.parametrize("text", [
    "as the lead asked", "The issue's target", "the target of this chapter",
    "after the re-base", "rebased on main", "who asked for it", "the brief says"])
def test_talk_about_making_the_course_is_found(text):
    assert nbm.making_talk(text)


def test_ordinary_words_are_not_making_talk():
    assert nbm.making_talk("the leading dimension; an issue slot; jump targets; the base case; "
                           "the lead-in; the issue slots of a warp; the issue rate; "
                           "the issue line") == []


def test_lint_checks_markdown_cells_only():
    nb = nbm.from_percent(SOLVED)
    nb["cells"].append({"cell_type": "markdown", "metadata": {},
                        "source": ["Ours: 628 TFLOP/s, 1.02x cuDNN, as the lead measured."]})
    nb["cells"].append({"cell_type": "code", "metadata": {}, "outputs": [],
                        "execution_count": None, "source": ['print("628 TFLOP/s, 1.02x")']})
    problems = nbm.lint(nb, "demo")
    assert len(problems) == 3, problems
    assert "'628 TFLOP/s', '1.02x'" in problems[0] and "(paper)" in problems[0]
    assert "'the lead'" in problems[1]
    assert "compares measurements ('1.02x')" in problems[2] and "claims:" in problems[2]


def test_no_notebook_imports_what_only_the_repository_root_can_import():
    """CI installs the course's packages (utils, solutions, measure, fa4_final) and runs each
    notebook from its own folder, with no PYTHONPATH: a lab's helpers are imported from beside
    the notebook (`import x_helpers`), never as `labs.x_helpers`, which only a run from the
    repository root could find."""
    root = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted([*root.glob("labs/*.ipynb"), *root.glob("chapters/*.ipynb"),
                        *root.glob("solutions/*.ipynb")]):
        for cell in json.loads(path.read_text())["cells"]:
            src = "".join(cell["source"])
            if cell["cell_type"] == "code" and ("from labs import" in src
                                                or "import labs" in src):
                found.append(path.relative_to(root).as_posix())
    assert not found, f"notebooks importing the labs package (not installed in CI): {found}"
