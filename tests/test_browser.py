"""A learner's view, in a real browser (headless Chromium driven by Playwright).

JupyterLab is started by `make lab` (on a free port, with a token) over a copy of chapters/, so
nothing a run writes (autosave) reaches the repository. Every chapter notebook, found by glob, is
opened and run with Run > Run All Cells; the page must show no error, every figure must load, an
unsolved exercise must say "not done yet" and a GPU cell on a CPU must say it was skipped. Two
small notebooks made here check the judge itself: one with an unsolved exercise, a warning, a
figure and a GPU cell (no error), one whose cell raises (an error). Then the built website
(`make site`, build/site/) is opened: the index, the navigation to every chapter, its images.

Screenshots and the notebooks as the browser left them are kept in build/browser-artifacts/.
Skipped, with the reason, where no Chromium or no playwright is found; ``COURSE_REQUIRE_BROWSER=1``
(set by CI) turns that skip into a failure.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.notebook_cells import notebook
from utils import browser
from utils import notebooks as nbm
from utils.hardware import detect

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "build" / "browser-artifacts"
SITE = ROOT / "build" / "site"
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
SOLVED = [p.stem for p in nbm.solved_notebooks()]
HAS_GPU = detect().has_gpu
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _browser_available():
    reason = browser.missing_browser_reason()
    if reason:
        if os.environ.get("COURSE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{reason} (COURSE_REQUIRE_BROWSER=1 asks for the browser test)")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium():
    with browser.chromium() as b:
        yield b
    if TIMINGS:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "timings.json").write_text(json.dumps(TIMINGS, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------
# Two notebooks that test the judge: what must not count as an error, and what must.

CALM = notebook(
    ("markdown", "# Not an error\nAn unsolved exercise, a warning, a figure, a GPU cell."),
    ("code", "%load_ext utils.notebook"),
    ("code", "from utils.exercises import exercise\n\n\ndef check(fn):\n    assert fn(2) == 4\n\n\n"
             "@exercise('99.1', check=check, reference=lambda x: 2 * x)\ndef double(x):\n"
             "    raise NotImplementedError('exercise: replace this line with your code')"),
    ("code", "import warnings\nwarnings.warn('a warning is not an error')\nprint(double(3))"),
    ("code", "import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0])\nplt.show()"),
    ("code", "%%gpu sm_90\nprint('on a Hopper GPU')", "gpu"),
)
RAISES = notebook(
    ("markdown", "# An error"),
    ("code", "x = 1"),
    ("code", "x / 0"),
    ("code", "print('never reached')"),
)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = ARTIFACTS / "lab"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    for path in CHAPTERS:
        shutil.copy(path, root / path.name)
    (root / "zz_judge_calm.ipynb").write_text(nbm.dumps(CALM))
    (root / "zz_judge_raises.ipynb").write_text(nbm.dumps(RAISES))
    with browser.LabServer(root=root, workdir=tmp_path_factory.mktemp("lab")) as server:
        TIMINGS["make lab until the server answers (s)"] = round(server.started_s, 1)
        yield server


@pytest.fixture
def page_context(chromium):
    context = chromium.new_context(viewport=browser.VIEWPORT)
    yield context
    context.close()


def _run(page_context, lab, name):
    run = browser.run_notebook_in_lab(page_context, lab, name, ARTIFACTS / "screenshots")
    TIMINGS[f"{name}: open until the kernel is idle (s)"] = round(run.open_seconds, 1)
    TIMINGS[f"{name}: Run All (s)"] = round(run.seconds, 1)
    return run


def test_there_are_chapters():
    assert CHAPTERS, "no chapters/NN_*.ipynb found"


def test_make_lab_opens_chapter_00(page_context, lab):
    page = page_context.new_page()
    page.goto(lab.url("/"))  # what `make lab` opens, or the URL it prints
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
    tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current").first
    assert tab.inner_text().strip() == CHAPTERS[0].name
    assert page.url.split("?")[0].endswith(f"/lab/tree/{CHAPTERS[0].name}")
    (ARTIFACTS / "screenshots").mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "screenshots" / "make-lab-first-view.png"))
    page.close()


def test_the_judge_accepts_unsolved_exercises_warnings_and_skipped_gpu_cells(page_context, lab):
    run = _run(page_context, lab, "zz_judge_calm.ipynb")
    assert run.problems(has_gpu=HAS_GPU) == []
    assert run.exercises() == {"99.1": "not done yet"}
    assert len(run.figures()) == 1 and run.figures()[0]["images"][0]["width"] > 0
    stderr = [o for c in run.cells for o in c["outputs"] if o["mime"] == browser.STDERR_MIME]
    assert any("a warning is not an error" in o["text"] for o in stderr)  # shown, not an error


def test_the_judge_catches_an_exception(page_context, lab):
    run = _run(page_context, lab, "zz_judge_raises.ipynb")
    problems = run.problems(has_gpu=HAS_GPU)
    assert any(p.startswith("cell 2 shows an error") for p in problems), problems
    assert any(p.startswith("cell 3 was not executed") for p in problems), problems


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_runs_in_jupyterlab(page_context, lab, path):
    run = _run(page_context, lab, path.name)
    assert run.problems(has_gpu=HAS_GPU) == [], f"screenshots in {ARTIFACTS / 'screenshots'}"
    # The learner's copy: every exercise reports itself, and none is done yet.
    expected = browser.exercise_ids(run.notebook)
    assert run.exercises() == dict.fromkeys(expected, "not done yet")


# ----------------------------------------------------------------------------------------------
# The website


@pytest.fixture(scope="module")
def site():
    if not (SITE / "index.html").exists():
        if os.environ.get("COURSE_REQUIRE_BROWSER") == "1":
            pytest.fail("build/site/index.html is missing: run `make site` first")
        pytest.skip("build/site/index.html is missing: run `make site` (make test does)")
    with browser.serve_folder(SITE) as base:
        yield base


def test_site_index_and_chapter_navigation(chromium, site):
    context = chromium.new_context(viewport=browser.VIEWPORT)
    failures: list[str] = []
    browser.local_only(context, site, failures)
    shots = ARTIFACTS / "site"
    shots.mkdir(parents=True, exist_ok=True)
    page = context.new_page()
    page.goto(f"{site}/index.html")
    index = browser.read_site_page(page)
    page.screenshot(path=str(shots / "index.png"))
    assert "FlashAttention-4 from scratch" in index["title"]
    text = page.inner_text("main")
    assert "Chapters" in text and "Progression" in text
    assert [h for h in index["nav"] if h.removesuffix(".html") in SOLVED] == [
        f"{name}.html" for name in SOLVED
    ], index["nav"]
    for name in SOLVED:
        page.locator(f'nav.bd-docs-nav a.reference.internal[href="{name}.html"]').first.click()
        page.wait_for_url(f"**/{name}.html")
        shown = browser.read_site_page(page)
        page.screenshot(path=str(shots / f"{name}.png"))
        assert shown["h1"].strip(), f"{name}: no title"
        assert shown["errors"] == 0, f"{name}: an error output on the page"
        broken = [im["src"] for im in shown["images"] if not (im["complete"] and im["width"])]
        assert not broken, f"{name}: broken images {broken}"
        nb = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text())
        if browser.expects_figures(nb):
            assert shown["images"], f"{name}: the notebook draws figures, the page shows none"
    page.locator('nav.bd-docs-nav a.reference.internal[href="workshop.html"]').first.click()
    page.wait_for_url("**/workshop.html")
    assert browser.read_site_page(page)["h1"].strip()
    assert failures == [], failures
    context.close()
