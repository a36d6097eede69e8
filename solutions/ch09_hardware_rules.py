"""Chapter 09: the hardware rules no compiler checks, as data, and the PTX checks that hold the
Blackwell kernels to them.

ptxas accepts a kernel that asks one SM sub-partition for more registers than it has, that
publishes an mbarrier before initialising it, or that hands the async proxy bytes the generic
proxy wrote without a fence: the first hangs, the others race. ``RULES`` lists each such rule,
where the kernels keep it, the test that guards it (a pytest node id; tests/
test_hardware_rules_table.py checks that each one exists) and whether it ran on a real GPU: no
Blackwell GPU exists here, so a rule is either run by an sm_90a probe on the H200
(solutions/ch09_protocol_probes.py; the H200 shares it) or checked only in the compiled PTX.

The PTX checks below take a compiled kernel's PTX text and return what they find wrong (an
empty list: nothing); tests/test_blackwell_protocol_compile.py runs them on every Blackwell
kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

H200 = "H200 probe"
COMPILED = "compiled check only"
OPEN = "not kept yet"


@dataclass(frozen=True)
class Rule:
    rule: str
    where: str  # file: function, where the kernels keep it
    guards: tuple[str, ...]  # pytest node ids
    gpu: str  # H200, COMPILED or OPEN


SUB = "tests/test_register_plan_sub_partition.py"
PROT = "tests/test_blackwell_protocol_compile.py"
PROBE = "tests/gpu/test_protocol_probes.py"
PROBE_CPU = "tests/test_protocol_probes_compile.py"

RULES = (
    Rule("setmaxnreg per SM sub-partition: warp w runs on sub-partition w % 4; the budgets of "
         "the warps there sum to at most 512 registers per thread slot (and to no more than "
         "they held at launch), or a setmaxnreg.inc waits forever",
         "fa4_final/common/register_plan.py: check_role_registers, called by blackwell/roles.py: "
         "check_roles and the Hopper kernels' __init__; blackwell/config.py: BWD_REGISTERS",
         (f"{SUB}::test_sub_partition_every_kernel_plan_fits",
          f"{SUB}::test_sub_partition_refuses_the_old_backward_plan",
          f"{PROBE}::test_setmaxnreg_plan_finishes_within_each_sub_partition"),
         H200),
    Rule("setmaxnreg per warpgroup: every warp of a warpgroup runs the same setmaxnreg",
         "fa4_final/common/register_plan.py: problems; blackwell/bwd.py and bwd_pair.py: kernel "
         "(warpgroup 3 lowers once, at the top of its branch)",
         (f"{SUB}::test_sub_partition_refuses_a_mixed_warpgroup",
          f"{PROT}::test_backward_warpgroup3_lowers_once"),
         COMPILED),
    Rule("TMEM allocation: a power of two >= 32 columns, at most 512",
         "fa4_final/blackwell/tmem.py: alloc_columns, TmemPlan.columns_allocated",
         ("tests/test_blackwell_compile.py::test_tmem_plan_rejects_overflow_and_overlap",
          "tests/test_blackwell_compile.py::test_tmem_alloc_columns_equal_the_plan",
          "tests/test_blackwell_bwd_compile.py::test_blackwell_bwd_tmem_alloc_is_the_plan"),
         COMPILED),
    Rule("TMEM is allocated and freed by one warp, which relinquishes the allocation permit "
         "after every reader is done",
         "blackwell/fwd.py, bwd.py, bwd_pair.py: kernel (the MMA warp's branch)",
         (f"{PROT}::test_tmem_allocated_and_freed_once_by_one_warp",),
         COMPILED),
    Rule("2-CTA: the TMEM allocator's dealloc mbarrier is initialised before the cluster "
         "arrive that publishes the pair's barriers",
         "blackwell/fwd.py: kernel (Note [Allocator barrier first]); blackwell/bwd_pair.py: "
         "kernel",
         (f"{PROT}::test_pair_dealloc_barrier_initialised_before_cluster_arrive",
          f"{PROT}::test_barrier_order_check_refuses_an_init_after_the_arrive"),
         COMPILED),
    Rule("A CTA of a cluster does not exit while its peer may still touch its shared memory "
         "or TMEM: a cluster barrier or an equivalent handshake at the end",
         "blackwell/fwd.py: Note [The correction runs one phase ahead] (the pair's dealloc "
         "handshake); blackwell/bwd_pair.py: mma (the last dQ EMPTY) and the dealloc "
         "handshake; the probes end with a cluster barrier",
         ("tests/test_ch09_pipeline.py::test_blackwell_bwd_pair_pipeline_sim_runs_clean",
          f"{PROBE}::test_ds_exchange_between_the_ctas_of_a_cluster",
          f"{PROBE}::test_multicast_tma_fills_both_ctas_of_a_cluster"),
         H200),
    Rule("The dS exchange's proxies: st.async writes (generic proxy) read by the MMA (async "
         "proxy): the writer fences before st.async (the buffer's last async-proxy read), the "
         "reader acquires at cluster scope and fences before the MMA",
         "fa4_final/blackwell/peer.py; blackwell/bwd_pair.py: store_ds, mma, relay (Note [The "
         "dS exchange])",
         (f"{PROT}::test_ds_exchange_writer_fences_before_st_async",
          f"{PROT}::test_ds_exchange_reader_acquires_at_cluster_scope_then_fences",
          f"{PROBE_CPU}::test_exchange_probe_runs_the_backward_steps",
          f"{PROBE}::test_ds_exchange_between_the_ctas_of_a_cluster"),
         H200),
    Rule("Multicast TMA into a pair: one load with a CTA mask lands in both CTAs and "
         "completes the barrier at the same offset in each",
         "the probes only (solutions/ch09_protocol_probes.py: MulticastProbe); the pair "
         "kernels load with cta_group::2 TMA and multicast their commits",
         (f"{PROBE}::test_multicast_tma_fills_both_ctas_of_a_cluster",),
         H200),
    Rule("tcgen05.ld: the load is complete (tcgen05.wait::ld, or every loaded register "
         "consumed) before its TMEM columns may be overwritten or another thread is told so "
         "(a tcgen05.st, a barrier arrive, an MMA). The loaded registers themselves are read "
         "with no wait::ld before them, as FA4's and CUTLASS's kernels read them: our reading "
         "(not documented) is that ptxas tracks those registers like any load's",
         "blackwell/fwd.py: softmax, correction; bwd.py and bwd_pair.py: compute_step, "
         "store_dq (cute.arch.fence_view_async_tmem_load)",
         (f"{PROT}::test_tmem_loads_complete_before_a_signal",),
         COMPILED),
    Rule("tcgen05.st: tcgen05.wait::st before the thread sync after which an MMA reads the "
         "stored columns",
         "blackwell/fwd.py: softmax, correction; bwd.py and bwd_pair.py: compute_step "
         "(cute.arch.fence_view_async_tmem_store)",
         (f"{PROT}::test_tmem_stores_waited_before_a_signal",),
         COMPILED),
    Rule("tcgen05.fence::before_thread_sync before, and ::after_thread_sync after, a thread "
         "sync that orders tcgen05 operations of different threads (the PTX ISA's canonical "
         "patterns)",
         "not emitted by these kernels (nor by FA4's sm100 forward and backward, nor by "
         "CUTLASS's DSL pipelines)",
         (f"{PROT}::test_tcgen05_thread_sync_fences_are_not_emitted",),
         OPEN),
)


def table_rows() -> list[dict]:
    return [{"rule": r.rule, "where": r.where, "guards": list(r.guards), "ran on a GPU": r.gpu}
            for r in RULES]


def print_table(width: int = 100) -> None:
    """The rules, one block each: the rule, where, guards, and whether it ran on a GPU."""
    import textwrap

    for i, r in enumerate(RULES, 1):
        print(textwrap.fill(f"{i:2d}. [{r.gpu}] {r.rule}", width, subsequent_indent="    "))
        print(textwrap.fill("where: " + r.where, width, initial_indent="    ",
                            subsequent_indent="      "))
        for g in r.guards:
            print(f"    guard: {g}")


# ================================================================================================
# PTX checks
# ================================================================================================
def _lines(ptx: str) -> list[str]:
    return [ln.strip() for ln in ptx.splitlines()]


def barrier_init_before_cluster_arrive(ptx: str, offset: int) -> list[str]:
    """The mbarrier at byte ``offset`` of the kernel's barrier block (the block the first
    mbarrier.init addresses) is initialised before the first ``barrier.cluster.arrive``."""
    lines = _lines(ptx)
    inits = [i for i, ln in enumerate(lines) if ln.startswith("mbarrier.init")]
    if not inits:
        return ["no mbarrier.init in the PTX"]
    base = re.search(r"\[(%r\d+)", lines[inits[0]]).group(1)
    regs = {m.group(1) for ln in lines
            if (m := re.match(rf"add\.s32\s+(%r\d+),\s*{re.escape(base)},\s*{offset};", ln))}
    found = [i for i in inits
             if re.search(rf"\[{re.escape(base)}\+{offset}\]", lines[i])
             or any(re.search(rf"\[{re.escape(r)}\]", lines[i]) for r in regs)]
    arrive = next((i for i, ln in enumerate(lines) if ln.startswith("barrier.cluster.arrive")),
                  None)
    if not found:
        return [f"no mbarrier.init at offset {offset} of the barrier block"]
    if arrive is None:
        return ["no barrier.cluster.arrive in the PTX"]
    if found[0] > arrive:
        return [f"the mbarrier at offset {offset} is initialised on PTX line {found[0]}, after "
                f"the cluster arrive on line {arrive}"]
    return []


def peer_stores_fenced(ptx: str) -> list[str]:
    """Every st.async is preceded, since the last mbarrier wait, by a
    fence.proxy.async.shared::cluster."""
    lines = _lines(ptx)
    bad = []
    for i, ln in enumerate(lines):
        if not ln.startswith("st.async"):
            continue
        for j in range(i - 1, -1, -1):
            if lines[j].startswith("fence.proxy.async.shared::cluster"):
                break
            if "mbarrier.try_wait" in lines[j] or lines[j].startswith("ret"):
                bad.append(f"st.async on PTX line {i} follows the wait on line {j} with no "
                           f"fence.proxy.async.shared::cluster between them")
                break
    return bad


def peer_waits_acquire_then_fence(ptx: str) -> list[str]:
    """Each wait at cluster scope (mbarrier.try_wait...acquire.cluster) that a tcgen05.mma
    follows has a fence.proxy.async between the wait and that MMA, and there is one such wait
    at least."""
    lines = _lines(ptx)
    waits = [i for i, ln in enumerate(lines) if "try_wait.parity.acquire.cluster" in ln]
    if not waits:
        return ["no mbarrier.try_wait at cluster scope"]
    bad = []
    for w in waits:
        for j in range(w + 1, len(lines)):
            if lines[j].startswith("fence.proxy.async"):
                break
            if "tcgen05.mma" in lines[j] or "cp.async.bulk.global" in lines[j]:
                bad.append(f"the cluster-scope wait on PTX line {w} reaches an async-proxy "
                           f"read on line {j} with no fence.proxy.async between them")
                break
    return bad


_SIGNALS = ("tcgen05.st", "tcgen05.mma", "tcgen05.commit", "bar.sync", "bar.arrive",
            "barrier.sync", "barrier.arrive", "mbarrier.arrive", "ret;", "exit;")


def tmem_loads_complete_before_signal(ptx: str) -> list[str]:
    """Each tcgen05.ld is complete before the next TMEM store, MMA, commit, barrier or
    arrive in the text: a tcgen05.wait::ld comes first, or every register it loaded has been
    read by then."""
    lines = _lines(ptx)
    bad = []
    for i, ln in enumerate(lines):
        if not ln.startswith("tcgen05.ld"):
            continue
        pending = set(re.findall(r"%r\d+", ln.split("[")[0]))
        for j in range(i + 1, len(lines)):
            if lines[j].startswith("tcgen05.wait::ld"):
                break
            if any(lines[j].startswith(s) or f" {s}" in lines[j] for s in _SIGNALS):
                if pending:
                    bad.append(f"tcgen05.ld on PTX line {i}: {len(pending)} loaded registers "
                               f"not yet read and no tcgen05.wait::ld before line {j} "
                               f"({lines[j][:40]})")
                break
            pending -= {r for r in pending if re.search(rf"{re.escape(r)}\b", lines[j])}
    return bad


def tmem_stores_waited_before_signal(ptx: str) -> list[str]:
    """Each tcgen05.st is followed by tcgen05.wait::st before the next MMA, commit, barrier
    or arrive in the text."""
    lines = _lines(ptx)
    bad = []
    for i, ln in enumerate(lines):
        if not ln.startswith("tcgen05.st"):
            continue
        for j in range(i + 1, len(lines)):
            if lines[j].startswith("tcgen05.wait::st"):
                break
            if any(lines[j].startswith(s) for s in _SIGNALS if s != "tcgen05.st"):
                bad.append(f"tcgen05.st on PTX line {i} reaches line {j} ({lines[j][:40]}) "
                           f"with no tcgen05.wait::st")
                break
    return bad


def tmem_alloc_once(ptx: str) -> list[str]:
    """One tcgen05.alloc, one relinquish_alloc_permit and one dealloc, in that order: a
    single call site each, the allocating warp's branch."""
    lines = _lines(ptx)
    where = {op: [i for i, ln in enumerate(lines) if ln.startswith(f"tcgen05.{op}")]
             for op in ("alloc", "relinquish_alloc_permit", "dealloc")}
    bad = [f"{len(v)} tcgen05.{op} (want 1)" for op, v in where.items() if len(v) != 1]
    if bad:
        return bad
    a, r, d = (where[op][0] for op in ("alloc", "relinquish_alloc_permit", "dealloc"))
    if not a < r < d:
        return [f"alloc, relinquish and dealloc on PTX lines {a}, {r}, {d}: not in that order"]
    return []
