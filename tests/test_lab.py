"""`make lab` must serve JupyterLab, also on a machine with no GPU."""

import os
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


@pytest.mark.slow
def test_make_lab_serves_jupyterlab(tmp_path):
    port = free_port()
    args = (
        "--no-browser --IdentityProvider.token= --ServerApp.password= "
        f"--ServerApp.ip=127.0.0.1 --ServerApp.runtime_dir={tmp_path}"
    )
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    proc = subprocess.Popen(
        ["make", "-s", "lab", f"PORT={port}", f"LAB_ARGS={args}"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        status, deadline = None, time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab", timeout=5) as r:
                    status = r.status
                    break
            except OSError:
                time.sleep(1)
        assert status == 200, proc.stdout.read1().decode() if proc.poll() is not None else status
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
