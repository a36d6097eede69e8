"""A newcomer's first minutes, measured: from `git clone` to chapter 00 open in JupyterLab.

    python -m measure.first_hour measure [--source REPO]  # writes results/cpu/first_hour.json
    python -m measure.first_hour --write                  # rewrites the README's line from it
    python -m measure.first_hour                          # prints that line

``measure`` does what the README asks of a newcomer, on this machine: a fresh ``git clone``
of ``REPO`` (default: this repository) into a temporary folder, then ``make lab`` there, with an
empty pip cache, until the server answers; then headless Chromium opens the address `make lab`
opens, and the clock stops when chapter 00 is on screen with its kernel idle. It also times the
first code cell. Where and how it was measured (cores, memory, Python, where torch came from,
the commit) is stored with the figures; the README line is printed from that file, and a test
fails when the README is out of date.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULT = ROOT / "results" / "cpu" / "first_hour.json"
PRODUCES = [("results/cpu/first_hour.json", "python -m measure.first_hour measure",
             "a fresh clone to chapter 00 open in JupyterLab: install, start, first cell")]
START, END = "<!-- first-hour:start -->", "<!-- first-hour:end -->"
METRICS = ("clone", "make_lab_until_server_answers", "chapter_00_open_kernel_idle",
           "first_code_cell", "clone_to_chapter_00")


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _torch_source() -> str:
    """Where ``pip install torch==...`` takes torch from on this machine."""
    links = os.environ.get("PIP_FIND_LINKS", "")
    wheels = [w for d in links.split() for w in Path(d).glob("torch-*.whl")] if links else []
    if wheels:
        return f"a local wheel ({wheels[0].name}, PIP_FIND_LINKS)"
    return "PyPI"


def measure(source: str = str(ROOT), workdir: Path | None = None) -> Path:
    from utils import browser, results

    reason = browser.missing_browser_reason()
    if reason:
        raise RuntimeError(reason)
    work = Path(workdir or tempfile.mkdtemp(prefix="first-hour-"))
    clone = work / "course"
    env = {"PIP_CACHE_DIR": str(work / "pip-cache")}  # empty: every package is fetched
    with browser.chromium() as b:  # the learner's browser is already running
        context = b.new_context(viewport=browser.VIEWPORT)
        page = context.new_page()
        t0 = time.monotonic()
        subprocess.run(["git", "clone", "--quiet", source, str(clone)], check=True)
        t_clone = time.monotonic()
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True,
                                text=True, check=True).stdout.strip()
        with browser.LabServer(root=None, cwd=clone, workdir=work / "lab", timeout=1800,
                               env=env) as lab:
            t_server = time.monotonic()
            page.goto(lab.url("/"))  # what `make lab` opens in a browser, and prints
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=600_000)
            page.wait_for_function(browser._KERNEL_READY_JS, timeout=600_000, polling=100)
            t_open = time.monotonic()
            title = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current").first
            opened = title.inner_text().strip()
            shots = ROOT / "build" / "browser-artifacts"
            shots.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shots / "first-hour-chapter-00.png"))
            first = page.locator(".jp-NotebookPanel .jp-CodeCell").first
            first.locator(".jp-InputArea-editor").click()
            t_cell0 = time.monotonic()
            page.keyboard.press("Shift+Enter")
            first.locator(".jp-InputArea-prompt", has_text="[1]:").wait_for(timeout=300_000)
            t_cell = time.monotonic()
            page.screenshot(path=str(shots / "first-hour-first-cell.png"))
        context.close()
    if opened != "00_hardware_roofline.ipynb":
        raise RuntimeError(f"`make lab` opened {opened!r}, not chapter 00")
    seconds = {
        "clone": t_clone - t0,
        "make_lab_until_server_answers": t_server - t_clone,
        "chapter_00_open_kernel_idle": t_open - t_server,
        "first_code_cell": t_cell - t_cell0,
        "clone_to_chapter_00": t_open - t0,
    }
    rows = [{"impl": "make lab", "metric": k, "value": round(seconds[k], 1), "unit": "s"}
            for k in METRICS]
    command = f"python -m measure.first_hour measure --source {source}"
    prov = results.collect_provenance(command)
    prov.update(
        commit=commit,
        machine=f"{os.cpu_count()} cores, {_memory_gib()} GiB, {platform.machine()}, no GPU",
        python=platform.python_version(),
        conditions=(
            f"fresh `git clone` of {source} (a local copy: no download for the clone); "
            "`make lab` with an empty pip cache, so every package is fetched from PyPI except "
            f"torch, from {_torch_source()}; headless Chromium opens the address `make lab` "
            "opens; the clock stops when chapter 00 is on screen with its kernel idle"
        ),
    )
    path = results.save("first_hour", rows, command, gpu="cpu", provenance=prov)
    shutil.rmtree(work, ignore_errors=True)
    return path


def line(data: dict | None = None) -> str:
    """The README's sentence, from the stored measurement."""
    if data is None:
        if not RESULT.exists():
            return "Clone to chapter 00: not measured yet (`python -m measure.first_hour measure`)."
        data = json.loads(RESULT.read_text())
    value = {r["metric"]: r["value"] for r in data["rows"]}
    p = data["provenance"]
    total = value["clone_to_chapter_00"]
    minutes = f"{total / 60:.1f} min" if total >= 90 else f"{total:.0f} s"
    return (
        f"From a fresh `git clone`{_clone_kind(p['conditions'])} to chapter 00 open with its "
        f"kernel ready took {minutes} "
        f"({value['make_lab_until_server_answers']:.0f} s of it `make lab` installing and "
        f"starting JupyterLab, {value['chapter_00_open_kernel_idle']:.0f} s opening the "
        f"notebook), measured on {p['machine']}, Python {p['python']}, with an empty pip "
        f"cache and torch from {_short_torch(p['conditions'])} "
        f"[{p['date'][:10]}, `results/cpu/first_hour.json`]. A CUDA build of torch from PyPI "
        "adds its download."
    )


def _clone_kind(conditions: str) -> str:
    return " (of a local copy)" if "a local copy" in conditions else ""


def _short_torch(conditions: str) -> str:
    return "a local CPU wheel" if "local wheel" in conditions else "PyPI"


def render(readme_text: str, data: dict | None = None) -> str:
    head, rest = readme_text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{line(data)}\n{END}{tail}"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "measure":
        source = argv[argv.index("--source") + 1] if "--source" in argv else str(ROOT)
        path = measure(source)
        print(f"wrote {path}")
        print(line())
    elif "--write" in argv:
        README.write_text(render(README.read_text()))
    else:
        print(line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
