"""The browser test's verdict on a notebook page, on pages described by hand (no browser)."""

from tests.notebook_cells import notebook
from utils import browser


def shown(prompt="[1]:", *outputs, kind="code") -> dict:
    return {"kind": kind, "prompt": prompt, "outputs": list(outputs)}


def out(mime="application/vnd.jupyter.stdout", text="", images=(), svgs=0) -> dict:
    return {"mime": mime, "text": text, "images": list(images), "svgs": svgs}


PNG_OK = {"complete": True, "width": 640, "height": 480}
PNG_BROKEN = {"complete": True, "width": 0, "height": 0}
STDERR = browser.STDERR_MIME
TRACE = ("---------------------------------------------------------------------------\n"
         "ZeroDivisionError                         Traceback (most recent call last)\n"
         "Cell In[2], line 1\n----> 1 x / 0\n\nZeroDivisionError: division by zero")


def run_of(notebook, *cells) -> browser.NotebookRun:
    return browser.NotebookRun("demo.ipynb", list(cells), notebook)


def test_a_clean_page_has_no_problems():
    book = notebook(("markdown", "# t"), ("code", "x = 1"), ("code", "print(x)"))
    run = run_of(book, shown("", kind="markdown"), shown("[1]:"), shown("[2]:", out(text="1")))
    assert run.problems() == []


def test_not_done_exercises_and_warnings_are_not_errors():
    book = notebook(("code", "@exercise('02.1', check=c, reference=r)\ndef f(): ..."),
              ("code", "warnings.warn('careful')"))
    run = run_of(
        book,
        shown("[1]:", out(text="[exercise 02.1] not done yet: using the reference solution so "
                               "the notebook carries on.")),
        shown("[2]:", out(STDERR, "/x.py:1: UserWarning: careful\n  warnings.warn('careful')")),
    )
    assert run.problems() == []
    assert run.exercises() == {"02.1": "not done yet"}
    assert browser.exercise_ids(book) == ["02.1"]


def test_a_traceback_and_the_cells_it_stopped_are_problems():
    book = notebook(("code", "x = 1"), ("code", "x / 0"), ("code", "print('after')"))
    run = run_of(book, shown("[1]:"), shown("[2]:", out(STDERR, TRACE)), shown("[ ]:"))
    problems = run.problems()
    assert problems[0].startswith("cell 1 shows an error") and "ZeroDivisionError" in problems[0]
    assert problems[1] == "cell 2 was not executed (prompt '[ ]:')"


def test_a_syntax_error_without_traceback_header_is_a_problem():
    book = notebook(("code", "1 +"))
    text = "  Cell In[1], line 1\n    1 +\n       ^\nSyntaxError: invalid syntax\n"
    assert run_of(book, shown("[1]:", out(STDERR, text))).problems()


def test_figures_must_load_and_must_exist_where_the_notebook_plots():
    book = notebook(("code", "import matplotlib.pyplot as plt\nplt.plot([1, 2])"))
    ok = run_of(book, shown("[1]:", out("image/png", images=[PNG_OK])))
    assert ok.problems() == [] and len(ok.figures()) == 1
    broken = run_of(book, shown("[1]:", out("image/png", images=[PNG_BROKEN])))
    assert broken.problems() == ["cell 0: a figure output holds no image that loaded"]
    missing = run_of(book, shown("[1]:", out(text="<Figure size 640x480 with 1 Axes>")))
    assert missing.problems() == [
        "cell 0: a figure came out as text ('<Figure size 640x480 with 1 Axes>')",
        "the notebook draws figures but none is shown",
    ]


def test_gpu_cells_must_say_they_were_skipped_on_a_cpu():
    book = notebook(("code", "%%gpu sm_90\nrun()", "gpu"))
    note = "[skipped] This cell needs a Hopper GPU (sm_90: H100/H200); this machine has no GPU."
    assert run_of(book, shown("[1]:", out(text=note))).problems() == []
    silent = run_of(book, shown("[1]:"))
    assert silent.problems() == ["cell 0 needs a GPU but shows no [skipped] note"]
    assert silent.problems(has_gpu=True) == []


def test_a_widget_that_fails_to_display_is_a_problem():
    book = notebook(("code", "explorer()"))
    run = run_of(book, shown("[1]:", out("text/plain", "Error displaying widget: model not found")))
    assert run.problems() == ["cell 0: a widget did not display: "
                              "'Error displaying widget: model not found'"]


def test_a_page_that_lost_cells_is_a_problem():
    book = notebook(("code", "x = 1"), ("code", "y = 2"))
    assert "the page shows 1 cells" in run_of(book, shown("[1]:")).problems()[0]


def test_expects_figures_ignores_gpu_cells():
    assert not browser.expects_figures(notebook(("code", "%%gpu sm_90\nplt.plot([1])", "gpu")))
    assert browser.expects_figures(notebook(("code", "fig = plots.roofline(rows)")))


def test_chromium_is_looked_up_by_name(monkeypatch, tmp_path):
    fake = tmp_path / "my-chromium"
    fake.write_text("")
    monkeypatch.setenv("COURSE_CHROMIUM", str(fake))
    assert browser.find_chromium() == str(fake)
    monkeypatch.setenv("COURSE_CHROMIUM", str(tmp_path / "absent"))
    assert browser.find_chromium() is None
    assert "COURSE_CHROMIUM" in browser.missing_browser_reason()
    monkeypatch.delenv("COURSE_CHROMIUM")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert browser.find_chromium() is None
    assert "no Chromium found" in browser.missing_browser_reason()
