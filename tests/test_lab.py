"""`make lab` must serve JupyterLab, also on a machine with no GPU, and open chapter 00."""

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lab_open() -> str:
    """The notebook the Makefile's `lab` target opens first (LAB_OPEN)."""
    return re.search(r"^LAB_OPEN \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def first_chapter() -> str:
    return sorted(p.name for p in (ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))[0]


def test_make_lab_opens_the_first_chapter():
    assert lab_open() == first_chapter() == "00_hardware_roofline.ipynb"


@pytest.mark.slow
def test_make_lab_serves_jupyterlab(tmp_path):
    port = free_port()
    args = "--no-browser --IdentityProvider.token= --ServerApp.password= --ServerApp.ip=127.0.0.1"
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    proc = subprocess.Popen(
        ["make", "-s", "lab", f"PORT={port}", f"LAB_ARGS={args}"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        status, landed, deadline = None, None, time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                # The address `make lab` opens in the browser and prints: the server's root.
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                    status, landed = r.status, r.url
                    break
            except OSError:
                time.sleep(1)
        assert status == 200, proc.stdout.read1().decode() if proc.poll() is not None else status
        assert landed.endswith(f"/lab/tree/{first_chapter()}"), landed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
