"""The H200 protocol probes (solutions/ch09_protocol_probes.py) build for sm_90a on a CPU, and
their PTX is what the GPU test relies on: the register-plan probe starts each thread with the
launch's share of the register file and runs the plan's setmaxnreg per warpgroup; the exchange
probe runs the pair backward's own steps (fa4_final.blackwell.peer); the multicast probe issues
a multicast TMA; the cluster probes end with a cluster barrier."""

import re

import pytest

from fa4_final.common import register_plan as rp
from solutions import ch09_hardware_rules as H
from solutions import ch09_protocol_probes as P

pytestmark = pytest.mark.slow

SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);")


def _plans():
    return dict(P.kernel_plans(), **{"old blackwell bwd": (P.OLD_BWD_PLAN, 512)})


@pytest.mark.parametrize("name", list(_plans()))
def test_register_probe_compiles_for_each_plan(name):
    plan, threads = _plans()[name]
    _, art = P.compile_register_probe(plan, keep=True)
    # setmaxnreg counts from what a thread holds at launch: ptxas must give the kernel exactly
    # the launch's share (one CTA an SM), as in the real kernels
    assert art.registers == min(rp.launch_registers(threads), P.PTXAS_ENTRY_MAX), \
        art.resources()
    assert re.search(rf"\.reqntid\s+{threads}\b", art.ptx) and ".minnctapersm 1" in art.ptx
    found = SETMAXNREG.findall(art.ptx)
    runs = P._runs(plan)
    assert len(found) == len(runs)  # one instruction per warpgroup (per run of equal budgets)
    entry = min(rp.launch_registers(threads), P.PTXAS_ENTRY_MAX)
    for (action, value), (_, _, regs) in zip(found, runs):
        assert int(value) == regs and action == ("inc" if regs > entry else "dec")
    assert P.plan_fits(plan, threads) == (name != "old blackwell bwd")
    art.require("st.global")  # the flags


def test_register_probe_branches_follow_the_warpgroups():
    assert P._runs((176,) * 8 + (48,) * 4 + (112,) * 4) == \
        [(0, 4, 176), (4, 8, 176), (8, 12, 48), (12, 16, 112)]
    assert P._runs(P.OLD_BWD_PLAN)[-3:] == [(12, 13, 160), (13, 14, 48), (14, 16, 24)]


def test_exchange_probe_runs_the_backward_steps():
    """The pair backward's exchange, in miniature: a writer fence before st.async (8 of 16 B a
    thread, one remote expect_tx), cluster-scope waits with a fence before the bulk store that
    reads the tile, a release.cluster relay and buffer release, a cluster barrier at the end."""
    _, art = P.compile_exchange_probe(keep=True)
    ptx = art.ptx
    assert ptx.count("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32") == 8
    assert ptx.count("mbarrier.arrive.expect_tx.shared::cluster") == 1
    assert H.peer_stores_fenced(ptx) == []
    assert ptx.count("mbarrier.try_wait.parity.acquire.cluster") == 4  # free, full x2, relay
    assert H.peer_waits_acquire_then_fence(ptx) == []
    assert ptx.count("mbarrier.arrive.release.cluster.shared::cluster") == 2  # relay, free
    art.require("cp.async.bulk.global.shared::cta.bulk_group", "cp.async.bulk.wait_group.read",
                "mapa.shared::cluster")
    _ends_with_a_cluster_barrier(ptx)
    assert art.spills == 0


@pytest.mark.parametrize("leader_only", [True, False])
def test_multicast_probe_compiles(leader_only):
    _, art = P.compile_multicast_probe(leader_only, keep=True)
    ptx = art.ptx
    assert ptx.count("cp.async.bulk.tensor") == 1
    art.require(".multicast::cluster", "mbarrier.arrive.expect_tx", "barrier.cluster.arrive",
                "mbarrier.try_wait")
    _ends_with_a_cluster_barrier(ptx)
    # both barriers armed and published before the load is issued
    lines = ptx.splitlines()
    first_wait = next(i for i, ln in enumerate(lines) if "barrier.cluster.wait" in ln)
    load = next(i for i, ln in enumerate(lines) if "cp.async.bulk.tensor" in ln)
    arm = next(i for i, ln in enumerate(lines) if "mbarrier.arrive.expect_tx" in ln)
    assert arm < first_wait < load


def _ends_with_a_cluster_barrier(ptx: str) -> None:
    """The last barrier.cluster.arrive and wait come after every other cluster operation
    (remote arrive, st.async, bulk copy, multicast load) in the text, right before ret."""
    lines = [ln.strip() for ln in ptx.splitlines() if ln.strip()]
    arrive = max(i for i, ln in enumerate(lines) if ln.startswith("barrier.cluster.arrive"))
    wait = max(i for i, ln in enumerate(lines) if ln.startswith("barrier.cluster.wait"))
    assert arrive < wait and lines[wait + 1].startswith("ret")
    remote = [i for i, ln in enumerate(lines)
              if "shared::cluster" in ln and not ln.startswith("barrier.cluster")]
    assert max(remote) < arrive
