"""Prose that cannot drift from its data (utils/claims.py): every claim a notebook names is
registered, and every registered claim still holds on the results file it reads."""

import importlib
import json
from pathlib import Path

import pytest

from utils import claims
from utils import notebooks as nbm

ROOT = Path(__file__).resolve().parent.parent


def _registry() -> dict:
    """Import every module that registers claims (solutions/*.py, labs/*.py)."""
    for package in ("solutions", "labs"):
        for path in sorted((ROOT / package).glob("*.py")):
            if not path.stem.startswith("_") and "@claim(" in path.read_text():
                importlib.import_module(f"{package}.{path.stem}")
    return claims.REGISTRY


def _named() -> dict[str, list[str]]:
    """claim id -> the notebook cells that name it."""
    named: dict[str, list[str]] = {}
    for path in [*nbm.solved_notebooks(), *nbm.lab_notebooks()]:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                for cid in claims.markers(nbm._source(cell)):
                    named.setdefault(cid, []).append(f"{path.name} cell {i}")
    return named


def test_every_named_claim_is_registered():
    registry = _registry()
    unknown = {cid: where for cid, where in _named().items() if cid not in registry}
    assert not unknown, f"claims named in notebooks but not registered: {unknown}"


def test_every_registered_claim_is_named_somewhere():
    orphans = sorted(set(_registry()) - set(_named()))
    assert not orphans, f"registered claims no notebook makes: {orphans}"


@pytest.mark.parametrize("cid", sorted(_registry()))
def test_claim_holds_on_its_results_file(cid):
    c = claims.REGISTRY[cid]
    ok, line = claims.evaluate(c)
    assert ok, f"claim {cid}: '{c.text}' no longer holds on {c.results}: {line}"


def test_unbacked_comparison_is_found_and_a_marker_backs_it():
    text = "fa4_final is faster than the FA4 package at every shape."
    assert claims.unbacked_sentences(text) == ["faster"]
    assert claims.unbacked_sentences(text + " <!-- claims: 08.x -->") == []
    assert claims.unbacked_sentences("MUFU is slower than the FMA pipe (datasheet).") == []
    assert claims.unbacked_sentences("<!-- not-measured: rates --> MUFU is slower.") == []
    assert claims.unbacked_sentences("a 2.5x larger tile") == ["2.5x"]
    assert claims.markers("<!-- claims: a.b, c.d -->") == ["a.b", "c.d"]
