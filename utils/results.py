"""Measured figures, stored with where and when they were measured.

A results file is ``results/<gpu>/<name>.json``:

    {"provenance": {"gpu": ..., "driver": ..., "cuda": ..., "torch": ..., "cutlass_dsl": ...,
                    "commit": ..., "date": ..., "command": ...},
     "rows": [{"impl": ..., "pass": "fwd", "dtype": "bf16", "b": .., "s": .., "h": .., "d": ..,
               "causal": false, "ms": .., "tflops": ..}, ...]}

Attention benchmarks carry at least those row keys; microbenchmarks carry ``impl``, ``metric``,
``value``, ``unit``. A notebook on a CPU shows stored figures through ``load``, and always with
``label``: no number appears without its provenance. A file without provenance is refused.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "results"

PROVENANCE_KEYS = ("gpu", "driver", "cuda", "torch", "cutlass_dsl", "commit", "date", "command")
ATTENTION_ROW_KEYS = ("impl", "pass", "dtype", "b", "s", "h", "d", "causal", "ms", "tflops")
MICRO_ROW_KEYS = ("impl", "metric", "value", "unit")


class ProvenanceError(ValueError):
    """A results file that does not say where and when it was measured."""


@dataclass
class Results:
    name: str
    path: Path
    provenance: dict
    rows: list[dict]

    @property
    def label(self) -> str:
        p = self.provenance
        return (
            f"measured on {p['gpu']} (driver {p['driver']}, CUDA {p['cuda']}), torch {p['torch']}, "
            f"CuTe DSL {p['cutlass_dsl']}, commit {str(p['commit'])[:10]}, {p['date']}"
        )

    def where(self, **match) -> list[dict]:
        """Rows whose fields equal every given value, e.g. ``where(impl="cudnn", d=128)``."""
        return [r for r in self.rows if all(r.get(k) == v for k, v in match.items())]

    def one(self, **match) -> dict:
        rows = self.where(**match)
        if len(rows) != 1:
            raise LookupError(f"{self.name}: {len(rows)} rows match {match}, expected one")
        return rows[0]

    def table(self, columns=None) -> str:
        """A plain-text table of the rows, headed by the provenance label."""
        if not self.rows:
            return f"{self.name}: no rows ({self.label})"
        columns = columns or list(self.rows[0].keys())
        widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in self.rows)) for c in columns}
        head = "  ".join(c.ljust(widths[c]) for c in columns)
        body = [
            "  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns) for r in self.rows
        ]
        return "\n".join([f"[{self.name}] {self.label}", head, *body])


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.4e}"
    return "" if v is None else str(v)


def _git_commit() -> str:
    """HEAD (with +dirty for uncommitted changes); ``COURSE_COMMIT`` overrides it on machines
    that receive a copy of the tree without its .git folder."""
    if os.environ.get("COURSE_COMMIT"):
        return os.environ["COURSE_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT, capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def collect_provenance(command: str) -> dict:
    """Everything that says where a measurement came from, read off this machine now."""
    import torch

    from utils.hardware import detect

    machine = detect()
    try:
        import cutlass

        dsl = getattr(cutlass, "__version__", None)
        if dsl is None:
            from importlib.metadata import version

            dsl = version("nvidia-cutlass-dsl")
    except Exception:  # the DSL is optional for PyTorch-only measurements
        dsl = "not installed"
    return {
        "gpu": machine.gpu_name or "cpu",
        "driver": machine.driver or "none",
        "cuda": torch.version.cuda or "none",
        "torch": torch.__version__,
        "cutlass_dsl": dsl,
        "commit": _git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
    }


def validate(data: dict, source: str = "results") -> None:
    prov = data.get("provenance")
    if not isinstance(prov, dict):
        raise ProvenanceError(
            f"{source}: no 'provenance' object; refusing figures of unknown origin"
        )
    missing = [k for k in PROVENANCE_KEYS if not prov.get(k)]
    if missing:
        raise ProvenanceError(f"{source}: provenance lacks {missing}")
    rows = data.get("rows")
    if not isinstance(rows, list):
        raise ProvenanceError(f"{source}: 'rows' must be a list")
    for i, row in enumerate(rows):
        keys = ATTENTION_ROW_KEYS if "tflops" in row or "pass" in row else MICRO_ROW_KEYS
        lacking = [k for k in keys if k not in row]
        if lacking:
            raise ProvenanceError(f"{source}: row {i} lacks {lacking}: {row}")


def save(name: str, rows: list[dict], command: str, gpu: str | None = None,
         provenance: dict | None = None) -> Path:
    """Write ``results/<gpu>/<name>.json`` with this machine's provenance; returns the path."""
    from utils.hardware import gpu_slug

    prov = provenance or collect_provenance(command)
    data = {"provenance": prov, "rows": rows}
    validate(data, name)
    folder = RESULTS_DIR / (gpu or gpu_slug(prov["gpu"] if prov["gpu"] != "cpu" else None))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    return path


def load(name: str, gpu: str = "h200", results_dir: Path | None = None) -> Results:
    """Read stored figures; raises FileNotFoundError if never measured, ProvenanceError if the
    file does not say where it came from."""
    path = (results_dir or RESULTS_DIR) / gpu / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no stored results {gpu}/{name}.json: not measured yet")
    data = json.loads(path.read_text())
    validate(data, str(path))
    return Results(name, path, data["provenance"], data["rows"])


def load_stored(name: str, gpu: str = "h200") -> Results | None:
    """``load(name)``, or None after printing "not measured yet" when the file is absent: what a
    notebook's stored-results cell wants on a machine where nothing was measured."""
    try:
        return load(name, gpu=gpu)
    except FileNotFoundError:
        print(f"{name}: not measured yet (results/{gpu}/{name}.json does not exist)")
        return None


def available(gpu: str = "h200") -> list[str]:
    folder = RESULTS_DIR / gpu
    return sorted(p.stem for p in folder.glob("*.json")) if folder.exists() else []
