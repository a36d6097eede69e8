"""Execute notebooks once, keeping their outputs, for the test suite and the website.

    python -m utils.execute solutions [labs] [--jobs 2]   # -> build/executed/<folder>/*.ipynb

Each notebook runs top to bottom in its own Jupyter kernel (as nbval runs it), several at a time
(``--jobs``, default: the machine's cores, at most 4); any cell that raises fails the run with the
notebook, the cell and the error. The solved notebooks run with ``COURSE_STRICT_EXERCISES=1``, so
a solution that fails its own checker fails here. The executed copies, with their outputs, land
in ``build/executed/<folder>/`` beside a fingerprint of everything they were executed from (the
notebooks, the course's Python sources and the stored results): ``make site`` renders those
copies instead of executing every notebook a second time, and executes again only when the
fingerprint no longer matches.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "executed"
FINGERPRINT = ".fingerprint"
CELL_TIMEOUT_S = 900
# what an executed notebook's outputs depend on
SOURCES = ("solutions", "utils", "fa4_final", "measure", "labs", "results")


def fingerprint(root: Path = ROOT) -> str:
    """sha256 over every notebook, Python source and results file the notebooks read."""
    h = hashlib.sha256()
    for top in SOURCES:
        folder = root / top
        if not folder.exists():
            continue
        for path in sorted(folder.rglob("*")):
            if path.suffix in (".py", ".ipynb", ".json") and path.is_file() \
                    and "__pycache__" not in path.parts:
                h.update(path.relative_to(root).as_posix().encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def notebooks_of(folder: str) -> list[Path]:
    from utils.notebooks import lab_notebooks, solved_notebooks

    if folder == "solutions":
        return solved_notebooks()
    if folder == "labs":
        return lab_notebooks()
    raise ValueError(f"unknown folder {folder!r}: solutions or labs")


def execute_one(src: Path, dest: Path, strict: bool) -> tuple[float, str | None]:
    """Run ``src`` in a fresh kernel, write the executed copy to ``dest``. Returns (seconds,
    None) or (seconds, the error: notebook, cell and message)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(src, as_version=4)
    env_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ["PYTHONPATH"] = env_path  # the kernel inherits this process's environment
    if strict:
        os.environ["COURSE_STRICT_EXERCISES"] = "1"
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(src.parent)}})
    t0 = time.perf_counter()
    error = None
    try:
        client.execute()
    except CellExecutionError as exc:
        cell = next((i for i, c in enumerate(nb.cells) if c.get("cell_type") == "code"
                     and any(o.get("output_type") == "error" for o in c.get("outputs", []))),
                    "?")
        error = f"{src.relative_to(ROOT)} cell {cell}: {str(exc).strip().splitlines()[-1]}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest)
    return time.perf_counter() - t0, error


def execute(folders: list[str], jobs: int) -> int:
    """Execute every notebook of ``folders`` (``jobs`` at a time, each in a process of its
    own); write the fingerprint when all passed. Returns the number of failures."""
    todo = [(folder, nb) for folder in folders for nb in notebooks_of(folder)]
    for folder in folders:
        (OUT / folder / FINGERPRINT).unlink(missing_ok=True)
    fp = fingerprint()

    def run(item):
        folder, nb = item
        dest = OUT / folder / nb.name
        cmd = [sys.executable, "-m", "utils.execute", "--one", str(nb), str(dest)]
        if folder == "solutions":
            cmd.append("--strict")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        return folder, nb, proc

    failures = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for folder, nb, proc in pool.map(run, todo):
            print(proc.stdout.strip() or f"{folder}/{nb.name}: no output", flush=True)
            if proc.returncode:
                failures += 1
                print(proc.stderr.strip()[-3000:], flush=True)
    if not failures:
        for folder in folders:
            (OUT / folder).mkdir(parents=True, exist_ok=True)
            (OUT / folder / FINGERPRINT).write_text(fp + "\n")
    print(f"{len(todo) - failures}/{len(todo)} notebooks ran without an error", flush=True)
    return failures


def fresh(folder: str) -> bool:
    """Whether build/executed/<folder> holds every notebook executed from the current tree."""
    stamp = OUT / folder / FINGERPRINT
    if not stamp.exists() or stamp.read_text().strip() != fingerprint():
        return False
    return all((OUT / folder / nb.name).exists() for nb in notebooks_of(folder))


def default_jobs() -> int:
    return min(4, os.cpu_count() or 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", default=["solutions"])
    ap.add_argument("--jobs", type=int, default=default_jobs())
    ap.add_argument("--one", nargs=2, metavar=("NOTEBOOK", "DEST"), help=argparse.SUPPRESS)
    ap.add_argument("--strict", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        src, dest = Path(args.one[0]).resolve(), Path(args.one[1])
        seconds, error = execute_one(src, dest, args.strict)
        print(f"{src.relative_to(ROOT)}: {'FAILED' if error else 'ok'} in {seconds:.0f} s")
        if error:
            print(error, file=sys.stderr)
            return 1
        return 0
    return 1 if execute(args.folders, args.jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
