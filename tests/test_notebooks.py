"""The generator that writes chapters/ from solutions/, and its drift check."""

import json
import shutil

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
