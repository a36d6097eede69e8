"""The table of hardware rules no compiler checks (solutions/ch09_hardware_rules.py): every guard
it names is a test that exists, every rule says where the kernels keep it and whether it ran on
a GPU, and the rules the issue lists are all there."""

import importlib
import re
from pathlib import Path

import pytest

from solutions import ch09_hardware_rules as H

ROOT = Path(__file__).resolve().parents[1]


def _resolve(node_id: str):
    path, _, name = node_id.partition("::")
    assert path.startswith("tests/") and path.endswith(".py"), node_id
    assert (ROOT / path).is_file(), f"{node_id}: no file {path}"
    module = importlib.import_module(path[:-3].replace("/", "."))
    func = getattr(module, name.split("[")[0], None)
    assert callable(func) and name.startswith("test_"), f"{node_id}: no test {name} in {path}"
    return func


@pytest.mark.parametrize("node_id", sorted({g for r in H.RULES for g in r.guards}))
def test_every_guard_in_the_table_exists(node_id):
    _resolve(node_id)


def test_every_rule_says_where_and_whether_it_ran_on_a_gpu():
    for r in H.RULES:
        assert r.rule and r.where and r.guards, r
        assert r.gpu in (H.H200, H.COMPILED, H.OPEN), r
        if r.gpu == H.H200:  # a rule that ran on the H200 names a GPU test among its guards
            assert any(g.startswith("tests/gpu/") for g in r.guards), r.rule


def test_the_table_covers_the_rules_of_the_issue():
    text = " ".join(r.rule.lower() for r in H.RULES)
    for words in ("sub-partition", "warpgroup", "power of two", "relinquish",
                  "initialised before the cluster arrive", "does not exit", "dS exchange",
                  "tcgen05.wait::ld", "tcgen05.wait::st"):
        assert words.lower() in text, words
    rows = H.table_rows()
    assert len(rows) == len(H.RULES) and set(rows[0]) == {"rule", "where", "guards",
                                                          "ran on a GPU"}


def test_the_table_prints(capsys):
    H.print_table()
    out = capsys.readouterr().out
    assert out.count("guard:") == sum(len(r.guards) for r in H.RULES)
    assert re.search(r"\[H200 probe\]", out) and re.search(r"\[compiled check only\]", out)
