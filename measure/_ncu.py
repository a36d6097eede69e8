"""The Nsight Compute runner every profile driver shares: which kernel, which counters, and the
command line (``--target``, ``--raw-dir``, ``--from-raw``). The reading of what ncu exports lives
with the chapters (``solutions.ch04_profile``, ``solutions.ch05_profile``)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProfileSpec:
    """What one chapter's profile needs: the results file, the module whose ``--target`` runs
    the kernel, ncu's kernel filter, sections and extra metrics, and ``build(raw, source,
    label) -> rows`` that turns ncu's two CSV exports into result rows."""

    results: str
    module: str
    kernel_regex: str
    sections: tuple
    metrics: tuple
    build: object


def _available(ncu: str, metrics) -> list[str]:
    """The metrics this ncu knows on this GPU (``--query-metrics``): an unknown name would make
    ncu refuse the whole run. Without the list (an older ncu), all of them are tried."""
    try:
        out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True,
                             timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return list(metrics)
    known = {line.split()[0] for line in out.splitlines() if line.strip()}
    if len(known) < 50:  # not a metric list: do not filter on it
        return list(metrics)
    keep = [m for m in metrics if m.split(".")[0] in known]
    for m in metrics:
        if m not in keep:
            print(f"ncu on this GPU has no metric {m.split('.')[0]}; profiling without it")
    return keep


def run_ncu(spec: ProfileSpec, target_args: tuple = (), source: bool = True,
            ncu_args: tuple = ()) -> tuple[str, str | None]:
    """Profile the second launch of ``spec``'s kernel in ``python -m spec.module --target
    [target_args]``; return ncu's raw page and (``source``) its SASS source page as CSV text.
    ``ncu_args``: more options for ncu (e.g. ``("--clock-control", "none")``: the GPU's own
    clock instead of ncu's fixed base clock)."""
    ncu = shutil.which("ncu")
    if ncu is None:
        raise RuntimeError("ncu (Nsight Compute) is not on PATH; it comes with the CUDA toolkit")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / spec.results
        cmd = [ncu, "--launch-skip", "1", "--launch-count", "1", "-k", spec.kernel_regex,
               "--import-source", "no", "-f", "-o", str(report), *ncu_args]
        for section in spec.sections:
            cmd += ["--section", section]
        metrics = _available(ncu, spec.metrics)
        if metrics:
            cmd += ["--metrics", ",".join(metrics)]
        cmd += [sys.executable, "-m", spec.module, "--target", *target_args]
        subprocess.run(cmd, check=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        rep = f"{report}.ncu-rep"
        raw = subprocess.run([ncu, "-i", rep, "--page", "raw", "--csv"], check=True,
                             capture_output=True, text=True, timeout=300).stdout
        if not source:
            return raw, None
        sass = subprocess.run([ncu, "-i", rep, "--page", "source", "--csv", "--print-source",
                               "sass"], check=True, capture_output=True, text=True,
                              timeout=300).stdout
    return raw, sass


def keep_exports(raw_dir: Path | None, case: str, raw: str, source: str | None = None) -> None:
    """Keep one profiled case's ncu CSV exports as ``raw_dir/case/raw.csv`` (and
    ``source.csv``); ``case`` "" keeps them in ``raw_dir`` itself; nothing when ``raw_dir`` is
    None. ``read_exports`` reads them back."""
    if raw_dir is None:
        return
    folder = raw_dir / case if case else raw_dir
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "raw.csv").write_text(raw)
    if source is not None:
        (folder / "source.csv").write_text(source)


def read_exports(raw_dir: Path, case: str = "", source: bool = True) -> tuple[str, str | None]:
    """(raw, source or None): the exports ``keep_exports`` kept for ``case``; a missing file is
    an error naming it."""
    folder = raw_dir / case if case else raw_dir
    raw = (folder / "raw.csv").read_text()
    return raw, (folder / "source.csv").read_text() if source else None


def keep_meta(raw_dir: Path | None, provenance: dict, **extra) -> None:
    """Write ``raw_dir/meta.json``: the run's provenance and ``extra``, what ``--from-raw``
    needs to rebuild the rows elsewhere; nothing when ``raw_dir`` is None."""
    if raw_dir is None:
        return
    raw_dir.mkdir(parents=True, exist_ok=True)
    (raw_dir / "meta.json").write_text(json.dumps({"provenance": provenance, **extra}, indent=1))


def read_meta(raw_dir: Path) -> dict:
    return json.loads((raw_dir / "meta.json").read_text())


def profile_with(spec: ProfileSpec, label: str, raw_dir: Path | None = None) -> Path:
    """Run ncu for ``spec`` on this GPU; keep the CSV exports in ``raw_dir`` if given; save and
    return results/<gpu>/<spec.results>.json."""
    from utils import results

    raw, source = run_ncu(spec)
    command = f"python -m {spec.module}"
    provenance = results.collect_provenance(command)
    keep_exports(raw_dir, "", raw, source)
    keep_meta(raw_dir, provenance, config=label)
    return results.save(spec.results, spec.build(raw, source, label), command=command,
                        provenance=provenance)


def from_raw_with(spec: ProfileSpec, raw_dir: Path) -> Path:
    """Rebuild ``spec``'s results file from ncu exports kept by ``--raw-dir`` (with their
    provenance): any machine, no GPU."""
    from utils import results

    meta = read_meta(raw_dir)
    rows = spec.build(*read_exports(raw_dir), meta["config"])
    provenance = reread_provenance(meta)
    return results.save(spec.results, rows, command=provenance["command"], provenance=provenance)


def reread_provenance(meta: dict) -> dict:
    """The provenance a ``--raw-dir`` folder's meta.json kept (where and when it was measured:
    unchanged), its command saying the rows were re-read here, at this commit."""
    from utils import results

    provenance = dict(meta["provenance"])
    provenance["command"] += (f" (rows re-read from its CSV exports with --from-raw at commit "
                              f"{results.collect_provenance('')['commit'][:10]})")
    return provenance


def main_with(spec: ProfileSpec, target, label, argv=None, doc: str = "") -> int:
    """The command line both chapters' profiles share: ``--target`` (the profiled process runs
    ``target()``), ``--raw-dir DIR``, ``--from-raw DIR``; ``label()`` names the profiled tile."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--raw-dir", type=Path, help="also keep ncu's CSV exports here")
    ap.add_argument("--from-raw", type=Path, help="rebuild the JSON from a --raw-dir folder")
    args = ap.parse_args(argv)
    if args.target:
        target()
        return 0
    if args.from_raw:
        path = from_raw_with(spec, args.from_raw)
    else:
        path = profile_with(spec, label(), args.raw_dir)
    from utils import results

    print(results.load(spec.results).table(["metric", "value", "unit"]))
    print(f"wrote {path}")
    return 0
