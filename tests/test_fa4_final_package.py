"""fa4_final installs as a package: the wheel pyproject.toml builds holds every subpackage
(hopper/, and blackwell/ when it lands), and the installed copy imports from another folder with
the source tree out of reach."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fa4_final"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build the project's wheel from a copy of what it packages (no build files in the tree)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("fa4_final", "utils", "solutions"):
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.ipynb"))
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(out), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    return next(out.glob("*.whl"))


def test_the_wheel_holds_every_module_of_the_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")
               if "__pycache__" not in p.parts}
    missing = sorted(modules - names)
    assert not missing, f"pyproject.toml leaves out {missing}"
    assert "fa4_final/hopper/fwd.py" in names and "fa4_final/hopper/host.py" in names


def test_the_installed_package_imports_from_another_folder(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel installs by unpacking
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import fa4_final, fa4_final.hopper.host, fa4_final.hopper.fwd, torch\n"
            "from fa4_final.runtime.dispatch import support_table\n"
            "assert callable(fa4_final.flash_attn_func)\n"
            "assert hasattr(torch.ops.fa4_final, 'fwd')\n"
            "assert '| Hopper (H100, H200) |' in support_table()\n"
            "print(fa4_final.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert Path(out.stdout.strip()).is_relative_to(site), out.stdout
