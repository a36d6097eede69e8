"""The Blackwell kernels' protocol pieces that a Hopper GPU shares, run for real on it
(solutions/ch09_protocol_probes.py; tests/test_protocol_probes_compile.py builds them on a CPU):

- every kernel's setmaxnreg plan (Blackwell forward and backward, Hopper forward and backward)
  in a CTA of its own warps: each plan within every sub-partition's 512 registers per thread
  slot finishes, and every warp writes its flag;
- the pair backward's dS exchange in a cluster of 2 CTAs, with the backward's own steps
  (fa4_final.blackwell.peer), over several steps of one buffer, read back by a bulk store;
- multicast TMA into both CTAs of a cluster;
- both cluster probes end with a cluster barrier (no CTA leaves while its peer may touch it).

A probe that hangs would block the GPU, so each runs in a subprocess that polls its launch with
a deadline and exits when it passes; the test kills the subprocess if it outlives its timeout.
Fresh random data each run, outputs poisoned first.

    timeout 900 python -m pytest tests/gpu/test_protocol_probes.py -v
    PROBE_HANG=1 timeout 300 python -m pytest tests/gpu/test_protocol_probes.py -v -k hangs

The second line runs the one probe expected to hang (the Blackwell backward's old plan, 592
registers on sub-partition 0), to show the rule; it never runs unless PROBE_HANG=1 is set.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from utils.hardware import missing

ROOT = Path(__file__).resolve().parents[2]
WHY = missing("sm_90")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=str(WHY))]

PLAN_NAMES = ["blackwell fwd 1-CTA", "blackwell fwd 2-CTA", "blackwell bwd 1-CTA",
              "blackwell bwd pair", "hopper fwd 1 consumer", "hopper fwd 2 consumers",
              "hopper fwd 3 consumers", "hopper bwd"]


def run_probe(args: list[str], timeout: float) -> dict:
    """Run ``python -m solutions.ch09_protocol_probes *args`` with a hard timeout; return
    {"rows": the JSON lines it printed, "returncode", "timed_out", "tail": its last output}."""
    cmd = [sys.executable, "-m", "solutions.ch09_protocol_probes", *args]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        out, err, code, timed_out = done.stdout, done.stderr, done.returncode, False
    except subprocess.TimeoutExpired as exc:  # the child was killed
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        code, timed_out = None, True
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    tail = (out + "\n" + err).strip()[-1500:]
    how = "was killed at its timeout (a hang)" if timed_out else f"exited with {code}"
    return {"rows": rows, "returncode": code, "timed_out": timed_out, "tail": tail, "how": how}


@pytest.fixture(scope="module")
def plan_runs():
    """Every kernel's plan, one subprocess: each plan's launch polled with a 10 s deadline."""
    res = run_probe(["plans", "--deadline", "10"], timeout=600)
    return res, {row["plan"]: row for row in res["rows"]}


def test_protocol_probes_know_every_kernel_plan():
    from solutions.ch09_protocol_probes import kernel_plans

    assert sorted(kernel_plans()) == sorted(PLAN_NAMES)


@pytest.mark.parametrize("name", PLAN_NAMES)
def test_setmaxnreg_plan_finishes_within_each_sub_partition(plan_runs, name):
    res, rows = plan_runs
    row = rows.get(name)
    assert row is not None, (
        f"no result for {name!r}: the probe process {res['how']} (a setmaxnreg.inc that never "
        f"returns looks like this). Output:\n{res['tail']}")
    assert row["fits"], f"{name}: its plan {row['budgets']} breaks the sub-partition rule"
    assert row["status"] == "finished", (
        f"{name}: the plan {row['budgets']} ({row['threads']} threads) did not finish within "
        f"{row['seconds']:.1f} s of its launch: setmaxnreg.inc waiting for registers")
    assert row["bad_count"] == 0, (
        f"{name}: {row['bad_count']} of {row['ctas']} x {len(row['budgets'])} warp flags wrong "
        f"(cta, warp, value): {row['bad_flags']}")


@pytest.mark.skipif(os.environ.get("PROBE_HANG") != "1",
                    reason="runs a kernel expected to hang; set PROBE_HANG=1 to run it")
def test_setmaxnreg_over_a_sub_partition_hangs():
    """The Blackwell backward's old plan (compute 176, dQ 80, MMA 160, load 48, spare 24):
    592 registers per thread slot on sub-partition 0. Expected: no finish within 10 s."""
    res = run_probe(["plans", "--hang", "--deadline", "10"], timeout=240)
    rows = res["rows"]
    assert res["timed_out"] or (rows and rows[0]["status"] == "hung"), (
        f"the over-budget plan finished: {rows}\n{res['tail']}")


def test_ds_exchange_between_the_ctas_of_a_cluster():
    res = run_probe(["exchange"], timeout=180)
    assert res["rows"], f"the exchange probe reported nothing: it {res['how']}\n{res['tail']}"
    problems = res["rows"][0]["problems"]
    assert problems == [], "\n".join(problems[:10])


def test_multicast_tma_fills_both_ctas_of_a_cluster():
    res = run_probe(["multicast"], timeout=180)
    assert len(res["rows"]) == 2, (
        f"the multicast probe reported {len(res['rows'])} of 2 variants: it {res['how']}\n"
        f"{res['tail']}")
    for row in res["rows"]:
        assert row["problems"] == [], row["probe"] + ":\n" + "\n".join(row["problems"][:10])
