"""measure/: the drivers that make results/. Every stored results file names the command that
makes it (measure/README.md, generated), and no module of solutions/ writes results any more:
solutions/ keeps what the notebooks teach."""

import re
from pathlib import Path

import measure.__main__ as m

ROOT = Path(__file__).resolve().parent.parent


def test_measure_readme_table_is_current():
    assert m.render(m.README.read_text()) == m.README.read_text(), \
        "run `python -m measure --write`"


def test_every_stored_results_file_has_a_command():
    assert not m.unmapped(), f"results files no driver makes: {m.unmapped()}"


def test_every_driver_declares_what_it_makes():
    for name in m.drivers():
        module = __import__(f"measure.{name}", fromlist=["PRODUCES"])
        assert getattr(module, "PRODUCES", None), f"measure/{name}.py declares no PRODUCES"


def test_solutions_write_no_results():
    writers = [p.name for p in sorted((ROOT / "solutions").glob("*.py"))
               if re.search(r"\bresults\.save\(|^from utils\.results import .*\bsave\b",
                            p.read_text(), re.M)]
    assert not writers, f"measurement drivers still in solutions/: {writers}"
