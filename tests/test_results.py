import json

import pytest

from utils import results

PROV = {k: "x" for k in results.PROVENANCE_KEYS}
ROW = {"impl": "a", "pass": "fwd", "dtype": "bf16", "b": 1, "s": 2, "h": 3, "d": 4,
       "causal": False, "ms": 1.0, "tflops": 2.0}


def write(tmp_path, data, gpu="h200", name="x"):
    folder = tmp_path / gpu
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(data))


def test_round_trip(tmp_path):
    write(tmp_path, {"provenance": PROV, "rows": [ROW]})
    res = results.load("x", gpu="h200", results_dir=tmp_path)
    assert res.rows == [ROW]
    assert "measured on x" in res.label
    assert res.one(impl="a")["tflops"] == 2.0
    assert "impl" in res.table()


def test_refuses_file_without_provenance(tmp_path):
    write(tmp_path, {"rows": [ROW]})
    with pytest.raises(results.ProvenanceError, match="provenance"):
        results.load("x", results_dir=tmp_path)


def test_refuses_incomplete_provenance_and_rows(tmp_path):
    write(tmp_path, {"provenance": {**PROV, "commit": ""}, "rows": [ROW]})
    with pytest.raises(results.ProvenanceError, match="commit"):
        results.load("x", results_dir=tmp_path)
    bad_row = {k: v for k, v in ROW.items() if k != "ms"}
    write(tmp_path, {"provenance": PROV, "rows": [bad_row]})
    with pytest.raises(results.ProvenanceError, match="ms"):
        results.load("x", results_dir=tmp_path)


def test_missing_file_says_not_measured(tmp_path):
    with pytest.raises(FileNotFoundError, match="not measured yet"):
        results.load("nothing", results_dir=tmp_path)


def test_save_collects_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    path = results.save("micro", [{"impl": "ex2", "metric": "rate", "value": 1.0, "unit": "T/s"}],
                        command="pytest", gpu="cpu")
    data = json.loads(path.read_text())
    assert set(results.PROVENANCE_KEYS) <= set(data["provenance"])
    assert data["provenance"]["command"] == "pytest"


def test_stored_results_in_repo_all_have_provenance():
    for folder in results.RESULTS_DIR.glob("*"):
        for path in folder.glob("*.json"):
            results.validate(json.loads(path.read_text()), str(path))
