"""The course as a static website: the solved notebooks, executed here, as a Jupyter Book.

    python -m utils.site build      # (what `make site` runs) -> build/site/index.html
    python -m utils.site stage      # only write the book's sources into build/site-src/

The book is staged in ``build/site-src/``: an index page made from the README's sections (the
chapter list and the progression table among them), every solved notebook
``solutions/NN_*.ipynb`` as executed on this machine, and the workshop guide, so a machine with
no GPU shows what the course shows there: compiled code, and the stored GPU figures with their
provenance. The notebooks are executed once, by ``python -m utils.execute solutions`` (which
``make notebooks`` runs for the test suite too); the site renders those executed copies and
runs them again only when they were executed from another tree (utils.execute.fresh). Jupyter
Book (1.x, Sphinx underneath) renders them without executing; it needs no network. The finished
HTML is copied to ``build/site/``.

Links between pages are rewritten for the site: a chapter's notebook name points at its page,
``docs/workshop.md`` at the guide's page; a link to a file the site does not carry (a ``.py``
source) keeps its text and loses the link.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SOLUTIONS = ROOT / "solutions"
DOCS = ROOT / "docs"
BUILD = ROOT / "build"
STAGE = BUILD / "site-src"
WORK = BUILD / "site-work"
SITE = BUILD / "site"

TITLE = "FlashAttention-4 from scratch"
# README sections shown on the index page, in this order; the others are about the repository.
INDEX_SECTIONS = ("Two commands", "What runs where", "Chapters", "Progression", "Teaching it")
# Pages besides the chapters: (source in the repo, page name in the site, caption in the menu).
EXTRA_PAGES = ((DOCS / "workshop.md", "workshop", "For instructors"),)
NOTEBOOK = re.compile(r"^(\d\d)_[a-z0-9_]+\.ipynb$")
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]+)\)")


def chapter_notebooks(solutions: Path = SOLUTIONS) -> list[Path]:
    return sorted(p for p in solutions.glob("*.ipynb") if NOTEBOOK.match(p.name))


def readme_sections(text: str) -> tuple[str, dict[str, str]]:
    """(the text before the first ``## `` heading, {heading: body}) of a markdown file."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    intro, sections = parts[0], {}
    for head, body in zip(parts[1::2], parts[2::2]):
        sections[head.strip()] = body.strip("\n")
    return intro, sections


def site_target(target: str, pages: dict[str, str], here: Path) -> str | None:
    """Where a link written in the file ``here`` points in the site: a page's file name, the
    target itself when it leaves the repository (a URL or an anchor), or None (a repository file
    the site does not carry)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return target
    path, _, anchor = target.partition("#")
    resolved = (here.parent / path).resolve()
    for source, page in pages.items():
        if resolved == Path(source).resolve() or Path(path).name == Path(source).name:
            return page + (f"#{anchor}" if anchor else "")
    return None


def rewrite_links(text: str, pages: dict[str, str], here: Path) -> str:
    def one(m: re.Match) -> str:
        target = site_target(m.group("target"), pages, here)
        return m.group("text") if target is None else f"[{m.group('text')}]({target})"

    return LINK.sub(one, text)


def link_notebook_names(text: str, names: list[str]) -> str:
    """In the chapter table, `` `00_slug` `` becomes a link to that chapter's page."""
    for name in names:
        text = text.replace(f"`{name}`", f"[`{name}`]({name}.ipynb)")
    return text


def index_page(readme_text: str, chapters: list[str], pages: dict[str, str]) -> str:
    intro, sections = readme_sections(readme_text)
    intro = re.sub(r"^# .*\n", "", intro.lstrip()).strip()
    out = [f"# {TITLE}", "", rewrite_links(intro, pages, README), ""]
    for head in INDEX_SECTIONS:
        if head not in sections:
            continue
        body = rewrite_links(sections[head], pages, README)
        if head == "Chapters":
            body = link_notebook_names(body, chapters)
        out += [f"## {head}", "", body, ""]
    return "\n".join(out)


def toc(chapters: list[str]) -> str:
    lines = ["format: jb-book", "root: index", "parts:", "  - caption: Chapters", "    chapters:"]
    lines += [f"      - file: {name}" for name in chapters]
    for _, page, caption in EXTRA_PAGES:
        lines += [f"  - caption: {caption}", "    chapters:", f"      - file: {page}"]
    return "\n".join(lines) + "\n"


CONFIG = f"""\
title: "{TITLE}"
author: ""
copyright: ""
only_build_toc_files: true
exclude_patterns: ["_build", "**.ipynb_checkpoints"]
execute:
  execute_notebooks: "off"
  stderr_output: show
html:
  use_repository_button: false
  use_issues_button: false
  use_edit_page_button: false
  use_multitoc_numbering: false
launch_buttons:
  notebook_interface: ""
  binderhub_url: ""
  thebe: false
sphinx:
  config:
    nb_execution_raise_on_error: true
    nb_execution_show_tb: true
    html_show_copyright: false
    html_show_sphinx: false
"""


def stage(dest: Path = STAGE, executed: Path | None = None) -> list[str]:
    """Write the book's sources into ``dest``; returns the chapter page names. ``executed``: the
    folder of the executed notebooks (utils.execute), whose outputs the pages show."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    notebooks = chapter_notebooks()
    chapters = [p.stem for p in notebooks]
    pages = {str(p): p.stem + ".ipynb" for p in notebooks}
    pages.update({str(ROOT / "chapters" / p.name): p.stem + ".ipynb" for p in notebooks})
    pages.update({str(src): page + ".md" for src, page, _ in EXTRA_PAGES})
    for nb_path in notebooks:
        source = executed / nb_path.name if executed is not None else nb_path
        nb = json.loads(source.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "markdown":
                src = cell["source"]
                src = "".join(src) if isinstance(src, list) else src
                cell["source"] = rewrite_links(src, pages, nb_path)
        (dest / nb_path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    for src, page, _ in EXTRA_PAGES:
        (dest / f"{page}.md").write_text(rewrite_links(src.read_text(), pages, src))
    (dest / "index.md").write_text(index_page(README.read_text(), chapters, pages))
    (dest / "_toc.yml").write_text(toc(chapters))
    (dest / "_config.yml").write_text(CONFIG)
    return chapters


def build(site: Path = SITE) -> Path:
    """Stage and render the book from the executed solved notebooks (executing them first when
    build/executed/ does not hold them for this tree); the HTML ends up in ``site``. Raises on
    any failed cell (the solved notebooks run with ``COURSE_STRICT_EXERCISES=1``, as in the test
    suite)."""
    from utils import execute

    if not execute.fresh("solutions") and execute.execute(["solutions"], execute.default_jobs()):
        raise RuntimeError("a solved notebook failed: see the lines above")
    stage(STAGE, executed=execute.OUT / "solutions")
    if WORK.exists():
        shutil.rmtree(WORK)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "COURSE_STRICT_EXERCISES": "1", "PYTHONPATH": path}
    jb = Path(sys.executable).with_name("jupyter-book")
    cmd = [str(jb) if jb.exists() else "jupyter-book", "build", str(STAGE),
           "--path-output", str(WORK), "--builder", "html", "--warningiserror", "--keep-going"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    html = WORK / "_build" / "html"
    if site.exists():
        shutil.rmtree(site)
    shutil.copytree(html, site)
    return site


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv else "build"
    if cmd == "build":
        print(f"site: {build() / 'index.html'}")
    elif cmd == "stage":
        stage()
        print(f"staged: {STAGE}")
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
