from solutions import progress
from solutions.registry import VERSIONS, by_name


def test_readme_progression_table_is_current():
    text = progress.README.read_text()
    assert progress.render(text) == text, "run `python -m solutions.progress --write`"


def test_registry_names_are_unique_and_ordered():
    names = [v.name for v in VERSIONS]
    assert len(set(names)) == len(names)
    assert [v.chapter for v in VERSIONS] == sorted(v.chapter for v in VERSIONS)
    assert by_name("naive").chapter == 1


def _results(rows):
    from pathlib import Path

    from utils.results import Results

    return Results("fake", Path("fake.json"), {"date": "2026-12-01 00:00 UTC"}, rows)


def _row(impl, tflops, spread=0.01):
    return {"impl": impl, "pass": "fwd", "d": 128, "s": 16384, "causal": False, "dtype": "bf16",
            "ms": 1e3 / tflops, "tflops": tflops, "ms_rounds": [1e3 / tflops] * 3,
            "spread": spread}


def test_headline_names_the_fastest_peer_of_the_same_run(monkeypatch):
    rows = [_row("flash_hopper", 640), _row("sdpa_cudnn", 700), _row("fa4_package", 680),
            _row("sdpa_flash", 350), {**_row("fa4_package", 999), "s": 4096}]
    monkeypatch.setattr(progress.results, "load", lambda name, gpu: _results(rows))
    text = progress.headline(by_name("flash_hopper"))
    assert text.startswith("640: 0.91x cuDNN (fastest peer), 0.94x FA4 package,"), text
    assert "1.83x FA2" in text and "[2026-12-01]" in text
    rows[1]["tflops"] = 650.0  # now the FA4 package is the fastest, and cuDNN within noise
    rows[1]["ms"] = 1e3 / 650
    rows[0]["spread"] = 0.05
    text = progress.headline(by_name("flash_hopper"))
    assert text.startswith("640: 0.94x FA4 package (fastest peer), ~0.98x cuDNN"), text
