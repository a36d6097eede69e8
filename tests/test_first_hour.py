"""The README's clone-to-notebook line is printed from the stored measurement, never typed."""

import json

from measure import first_hour
from utils import results

FAKE = {
    "provenance": {
        "gpu": "cpu", "driver": "none", "cuda": "none", "torch": "2.13.0+cpu",
        "cutlass_dsl": "4.8.1", "commit": "abc", "date": "2026-12-01 10:00 UTC",
        "command": "python -m measure.first_hour measure", "machine": "2 cores, 23.4 GiB, "
        "x86_64, no GPU", "python": "3.11.7",
        "conditions": "... torch, from a local wheel (torch-2.13.0+cpu.whl, PIP_FIND_LINKS) ...",
    },
    "rows": [{"impl": "make lab", "metric": m, "value": v, "unit": "s"} for m, v in zip(
        first_hour.METRICS, (0.4, 150.2, 5.1, 3.0, 155.7))],
}


def test_readme_line_is_current():
    text = first_hour.README.read_text()
    assert first_hour.render(text) == text, "run `python -m measure.first_hour --write`"


def test_line_reads_the_measurement():
    line = first_hour.line(FAKE)
    assert line.startswith("From a fresh `git clone` to chapter 00 open with its kernel ready "
                           "took 2.6 min")
    assert "150 s of it `make lab`" in line and "5 s opening" in line
    assert "a local CPU wheel" in line and "[2026-12-01, `results/cpu/first_hour.json`]" in line


def test_stored_measurement_has_provenance_and_every_figure():
    if not first_hour.RESULT.exists():
        return
    data = json.loads(first_hour.RESULT.read_text())
    results.validate(data, str(first_hour.RESULT))
    assert [r["metric"] for r in data["rows"]] == list(first_hour.METRICS)
    assert {"machine", "python", "conditions"} <= set(data["provenance"])
