"""Drive the course in a real browser: JupyterLab served by `make lab`, and the built website.

Used by ``tests/test_browser.py`` and by ``python -m measure.first_hour``. Headless Chromium from
the system (Debian's ``chromium`` package: ``/usr/bin/chromium``), driven by Playwright; no
browser is downloaded. ``COURSE_CHROMIUM`` names another binary.

A notebook run in JupyterLab is judged the way a learner would judge it, from what the page
shows: every code cell got an execution count (a cell that raised stops Run All, so the cells
after it keep an empty prompt), no output is a traceback, every figure output holds an image
that loaded, no widget failed to display. An exercise that is not done yet prints a line and is
not an error; a cell that needs a GPU prints a ``[skipped]`` note on a CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Flags for a headless Chromium on a machine whose only network is loopback.
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# JupyterLab settings for a test server: no news toast over the screenshots.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False,
    },
}


def find_chromium() -> str | None:
    """The Chromium binary to drive, or None when this machine has none."""
    named = os.environ.get("COURSE_CHROMIUM")
    if named:
        return named if Path(named).exists() else None
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def missing_browser_reason() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed (`make install` installs it)"
    named = os.environ.get("COURSE_CHROMIUM")
    if named and not Path(named).exists():
        return f"no Chromium found: COURSE_CHROMIUM={named} does not exist"
    if find_chromium() is None:
        return (
            "no Chromium found (looked for " + ", ".join(CHROMIUM_NAMES)
            + "; on Debian/Ubuntu: apt-get install chromium, or set COURSE_CHROMIUM)"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def chromium():
    """Headless Chromium with a fresh, empty profile (Playwright makes a new user-data-dir and
    removes it after); yields a Playwright ``Browser``: open a ``new_context()`` per visitor."""
    from playwright.sync_api import sync_playwright

    exe = find_chromium()
    if exe is None:
        raise RuntimeError(missing_browser_reason())
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


VIEWPORT = {"width": 1280, "height": 900}


# ----------------------------------------------------------------------------------------------
# JupyterLab, started the way a learner starts it


@dataclass
class LabServer:
    """``make lab`` on a free port with a token, serving ``root`` (None: the Makefile's own
    folder, chapters/); a context manager."""

    root: Path | None
    workdir: Path
    cwd: Path = ROOT
    port: int = 0
    token: str = "course-browser-test"
    timeout: float = 600.0
    env: dict | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    started_s: float | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str = "/") -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base}{path}{sep}token={self.token}"

    def command(self) -> list[str]:
        settings = self.workdir / "lab-settings"
        args = " ".join([
            "--no-browser", f"--IdentityProvider.token={self.token}", "--ServerApp.password=",
            "--ServerApp.ip=127.0.0.1", f"--LabApp.user_settings_dir={settings}",
            f"--LabApp.workspaces_dir={self.workdir / 'lab-workspaces'}",
        ])
        where = [f"LAB_DIR={self.root}"] if self.root is not None else []
        return ["make", "-s", "lab", f"PORT={self.port}", *where, f"LAB_ARGS={args}"]

    def __enter__(self) -> LabServer:
        self.port = self.port or free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        for rel, values in LAB_SETTINGS.items():
            path = self.workdir / "lab-settings" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = {
            **os.environ, **(self.env or {}),
            "JUPYTER_CONFIG_DIR": str(self.workdir / "jupyter-config"),
            "JUPYTER_RUNTIME_DIR": str(self.workdir / "jupyter-runtime"),
        }
        self.log_path = self.workdir / "lab.log"
        log = self.log_path.open("wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(), cwd=self.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        deadline = t0 + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`make lab` exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"JupyterLab did not answer in {self.timeout:.0f} s")
            try:
                with urllib.request.urlopen(self.url("/api/status"), timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        self.started_s = time.monotonic() - t0
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(self.url(path), method=method)
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        for session in self.api("/api/sessions") or []:
            with contextlib.suppress(OSError):
                self.api(f"/api/sessions/{session['id']}", method="DELETE")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)

    def __exit__(self, *exc) -> None:
        self.stop()


# ----------------------------------------------------------------------------------------------
# What the page shows after Run All, and the verdict on it

_CELLS_JS = """
() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  if (!panel) return null;
  return [...panel.querySelectorAll('.jp-Notebook .jp-Cell')].map((c) => ({
    kind: c.classList.contains('jp-CodeCell') ? 'code'
        : c.classList.contains('jp-MarkdownCell') ? 'markdown' : 'raw',
    prompt: (c.querySelector('.jp-InputArea-prompt') || {textContent: ''}).textContent.trim(),
    outputs: [...c.querySelectorAll('.jp-OutputArea-output')].map((o) => ({
      mime: o.getAttribute('data-mime-type') || '',
      text: (o.textContent || "").slice(0, 6000),
      images: [...o.querySelectorAll('img')].map((im) => (
        {complete: im.complete, width: im.naturalWidth, height: im.naturalHeight})),
      svgs: o.querySelectorAll('svg').length,
    })),
  }));
}
"""

IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")
STDERR_MIME = "application/vnd.jupyter.stderr"
# What an error output looks like once rendered: IPython's traceback header, or the last line of
# a SyntaxError-style report (``SyntaxError: ...``, ``IndentationError: ...``).
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\s*\w*(Error|Exception)\b.*$", re.M)
FIGURE_TEXT = re.compile(r"^<Figure size [\d.]+x[\d.]+ with \d+ Axes>$", re.M)
WIDGET_ERROR = re.compile(r"Error displaying widget|Failed to load model class")
EXERCISE_LINE = re.compile(r"\[exercise (\d\d\.\d+)\] (passed|not done yet|not right yet)")
SKIPPED_LINE = "[skipped] This cell needs"


@dataclass
class NotebookRun:
    name: str
    cells: list[dict]
    notebook: dict
    seconds: float = 0.0  # Run All Cells until the kernel settled
    open_seconds: float = 0.0  # opening the notebook until its kernel was idle
    screenshots: list[str] = field(default_factory=list)

    @property
    def code_cells(self) -> list[tuple[int, dict, dict]]:
        """(index, cell as shown, cell in the file) for every code cell."""
        return [(i, shown, cell)
                for i, (shown, cell) in enumerate(zip(self.cells, self.notebook["cells"]))
                if cell["cell_type"] == "code"]

    def exercises(self) -> dict[str, str]:
        found = {}
        for shown in self.cells:
            for out in shown["outputs"]:
                for ex_id, state in EXERCISE_LINE.findall(out["text"]):
                    found[ex_id] = state
        return found

    def figures(self) -> list[dict]:
        return [o for c in self.cells for o in c["outputs"] if o["mime"] in IMAGE_MIMES]

    def gpu_cells(self) -> list[int]:
        return [i for i, _, cell in self.code_cells
                if "gpu" in cell.get("metadata", {}).get("tags", [])]

    def problems(self, has_gpu: bool = False) -> list[str]:
        """Everything a learner would see as broken, in plain words (empty: all is well)."""
        out = []
        if len(self.cells) != len(self.notebook["cells"]):
            out.append(f"the page shows {len(self.cells)} cells, the file has "
                       f"{len(self.notebook['cells'])}")
            return out
        for i, shown, _cell in self.code_cells:
            if not re.fullmatch(r"\[\d+\]:", shown["prompt"]):
                out.append(f"cell {i} was not executed (prompt {shown['prompt'] or 'empty'!r})")
            for o in shown["outputs"]:
                if o["mime"] == STDERR_MIME and TRACEBACK.search(o["text"]):
                    lines = [ln.strip() for ln in o["text"].splitlines() if ln.strip()]
                    out.append(f"cell {i} shows an error: {lines[-1][:200]}")
                if o["mime"] in IMAGE_MIMES:
                    good = [im for im in o["images"] if im["complete"] and im["width"] > 0]
                    if not good and not o["svgs"]:
                        out.append(f"cell {i}: a figure output holds no image that loaded")
                if FIGURE_TEXT.search(o["text"]) and o["mime"] not in IMAGE_MIMES:
                    out.append(f"cell {i}: a figure came out as text ({o['text'][:60]!r})")
                if WIDGET_ERROR.search(o["text"]):
                    out.append(f"cell {i}: a widget did not display: {o['text'][:120]!r}")
        if not has_gpu:
            for i in self.gpu_cells():
                text = "".join(o["text"] for o in self.cells[i]["outputs"])
                if SKIPPED_LINE not in text:
                    out.append(f"cell {i} needs a GPU but shows no [skipped] note")
        if expects_figures(self.notebook) and not self.figures():
            out.append("the notebook draws figures but none is shown")
        return out


def notebook_code(nb: dict) -> str:
    return "\n".join(
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb["cells"] if c["cell_type"] == "code"
    )


def expects_figures(nb: dict) -> bool:
    """Whether a notebook draws with matplotlib in a cell that runs on a CPU."""
    for c in nb["cells"]:
        if c["cell_type"] != "code" or "gpu" in c.get("metadata", {}).get("tags", []):
            continue
        src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        if re.search(r"\bplt\.|matplotlib|\bplots\.\w+\(", src):
            return True
    return False


def exercise_ids(nb: dict) -> list[str]:
    """Ids of the self-checking exercises a notebook's code declares."""
    found = re.findall(r"""(?:@exercise|check_answer)\(\s*["'](\d\d\.\d+)["']""",
                       notebook_code(nb))
    return list(dict.fromkeys(found))


def _wait_for_run(page, timeout: float) -> None:
    """Until the kernel is idle and no cell is queued or running, three polls in a row, once
    something has looked busy."""
    js = """() => {
      const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
      const ind = panel.querySelector('.jp-Notebook-ExecutionIndicator');
      const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
        .map((p) => p.textContent.trim());
      return {status: ind ? ind.getAttribute('data-status') : null,
              busy: prompts.filter((p) => p === '[*]:').length,
              done: prompts.filter((p) => /^\\[\\d+\\]:$/.test(p)).length};
    }"""
    t0 = time.monotonic()
    started, calm = False, 0
    while time.monotonic() < t0 + timeout:
        state = page.evaluate(js)
        started = started or bool(state["busy"] or state["done"]) or state["status"] == "busy"
        if not started and time.monotonic() > t0 + 30:
            raise RuntimeError("Run All Cells started nothing in 30 s")
        calm = calm + 1 if started and state["status"] == "idle" and not state["busy"] else 0
        if calm >= 3:
            return
        page.wait_for_timeout(500)
    raise TimeoutError(f"the notebook still ran after {timeout:.0f} s")


_KERNEL_READY_JS = """() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const ind = panel && panel.querySelector('.jp-Notebook-ExecutionIndicator');
  const bar = [...document.querySelectorAll('.jp-StatusBar-Item')].map((e) => e.textContent);
  return !!ind && ind.getAttribute('data-status') === 'idle'
    && bar.some((t) => /\\| Idle\\s*$/.test(t) && !t.startsWith('No Kernel'));
}"""


def open_notebook(context, lab: LabServer, name: str, workspace: str, timeout: float = 180.0):
    """A new tab with ``name`` open in a fresh workspace and its kernel started and idle (the
    status bar says "Python 3 (ipykernel) | Idle"); returns the page."""
    page = context.new_page()
    page.goto(lab.url(f"/lab/workspaces/{workspace}/tree/{name}?reset"))
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=timeout * 1000)
    page.wait_for_function(_KERNEL_READY_JS, timeout=timeout * 1000, polling=250)
    return page


def run_all(page, timeout: float) -> None:
    """Run > Run All Cells, as a learner clicks it, then wait for the kernel to settle."""
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    _wait_for_run(page, timeout)


def run_notebook_in_lab(context, lab: LabServer, name: str, artifacts: Path,
                        timeout: float = 900.0) -> NotebookRun:
    """Open ``name`` (a file in the served folder), run all its cells, read back the page and
    keep screenshots in ``artifacts/<stem>/``."""
    shots = artifacts / Path(name).stem
    if shots.exists():
        shutil.rmtree(shots)
    shots.mkdir(parents=True)
    nb = json.loads(((lab.root or lab.cwd / "chapters") / name).read_text())
    t0 = time.monotonic()
    page = open_notebook(context, lab, name, workspace=re.sub(r"\W", "-", Path(name).stem))
    t1 = time.monotonic()
    try:
        run_all(page, timeout)
        cells = page.evaluate(_CELLS_JS) or []
        run = NotebookRun(name, cells, nb, seconds=time.monotonic() - t1, open_seconds=t1 - t0)
        _screenshots(page, run, shots)
    finally:
        page.close()
        with contextlib.suppress(OSError):
            lab.shutdown_kernels()
    return run


def _screenshots(page, run: NotebookRun, folder: Path) -> None:
    def keep(path: Path, locator=None):
        with contextlib.suppress(Exception):
            (locator or page).screenshot(path=str(path), timeout=15000)
            run.screenshots.append(str(path))

    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")
    keep(folder / "00-top.png")
    n = 0
    for i, shown in enumerate(run.cells):
        if any(o["mime"] in IMAGE_MIMES for o in shown["outputs"]):
            n += 1
            outputs = cells.nth(i).locator(".jp-OutputArea-output[data-mime-type^='image/']")
            for k in range(outputs.count()):
                keep(folder / f"figure-cell{i:02d}-{k}.png", outputs.nth(k))
    bad = {int(m) for p in run.problems() for m in re.findall(r"^cell (\d+)", p)}
    for i in sorted(bad)[:5]:
        keep(folder / f"problem-cell{i:02d}.png", cells.nth(i))
    if run.cells:
        with contextlib.suppress(Exception):
            cells.nth(len(run.cells) - 1).scroll_into_view_if_needed(timeout=15000)
        keep(folder / "99-end.png")


# ----------------------------------------------------------------------------------------------
# The built website


@contextlib.contextmanager
def serve_folder(folder: Path):
    """A static HTTP server for ``folder`` on a free loopback port; yields its base URL."""
    import functools
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


_PAGE_JS = """
() => ({
  title: document.title,
  h1: (document.querySelector('main h1, article h1') || {textContent: ''}).textContent,
  nav: [...document.querySelectorAll('nav.bd-docs-nav a.reference.internal')]
        .map((a) => a.getAttribute('href')),
  images: [...document.querySelectorAll('article img, main img')].map((im) => (
    {src: im.getAttribute('src'), complete: im.complete, width: im.naturalWidth})),
  errors: document.querySelectorAll('.output.traceback, .cell_output .output.error').length,
})
"""


def read_site_page(page) -> dict:
    page.wait_for_load_state("load")
    with contextlib.suppress(Exception):
        page.evaluate("async () => { for (const im of document.images) {"
                      " if (!im.complete) await new Promise(r => {"
                      " im.onload = im.onerror = r; }); } }")
    return page.evaluate(_PAGE_JS)


def local_only(context, base: str, failures: list[str]) -> None:
    """Refuse every request that leaves ``base`` (the site must stand on its own), and note
    every local request that fails."""

    def route(r):
        if r.request.url.startswith(base):
            r.continue_()
        else:
            r.abort()

    context.route("**/*", route)

    def on_response(resp):
        if resp.url.startswith(base) and resp.status >= 400:
            failures.append(f"{resp.status} {resp.url[len(base):]}")

    context.on("response", on_response)
