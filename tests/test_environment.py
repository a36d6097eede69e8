"""pyproject.toml and environment.yml must list the same dependencies."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pyproject_deps() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"dependencies = \[(.*?)\]\n", text, re.S).group(1)
    return {m.strip() for m in re.findall(r'"([^"]+)"', block)}


def conda_pip_deps() -> set[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:")
    return {ln.strip()[2:].strip() for ln in lines[start + 1 :] if ln.startswith("      - ")}


def test_same_dependencies():
    assert pyproject_deps() == conda_pip_deps()


def test_cutlass_dsl_pinned_exactly():
    pins = [d for d in pyproject_deps() if d.startswith("nvidia-cutlass-dsl")]
    assert pins and all("==4.8.1" in d for d in pins), pins


def test_python_range():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.10,<3.13"' in text
    assert "python>=3.10,<3.13" in (ROOT / "environment.yml").read_text()
