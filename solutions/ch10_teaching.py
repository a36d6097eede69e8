"""Chapter 10's exercises: what the pair saves and costs (10.1, 10.2), and the pair primer's
device code (10.3: what each CTA's MMA warp does; 10.4: the barriers and the cluster barrier
that publishes them).

The device-code pieces are checked with no GPU, as chapter 09's: run as plain Python with
stand-ins that write down every call, for both CTAs of the pair; the calls replayed in the
primer's simulation in pair mode (``solutions.ch09_pipeline.PrimerSim``: both CTAs' barriers,
multicast commits, the follower's remote arrivals, CTAs that start at different times); the
pair primer (``solutions.ch09_primer.PairTileAttention``) compiled for sm_100a with the piece
inside and its PTX read. On a B200 the pair primer runs against float64.
"""

from __future__ import annotations

import math
import re

from fa4_final.blackwell.config import BlackwellFwdConfig
from solutions import ch09_pipeline as sim
from solutions.ch09_pipeline import Op
from solutions.ch09_teaching import (
    _F32,
    _arch_recorders,
    _Bar,
    _bar_arg,
    _lines,
    _Recorder,
    _run_plain,
    _which,
    barrier_registers,
)
from utils.host_emulation import patched, python_loops

SMS = 148  # B200


# ----------------------------------------------------------------------------------------------
# 10.1: shared-memory cycles of one KV step on one SM


def smem_cycles_per_step(d: int, two_cta: bool) -> float:
    """Reference for 10.1: shared-memory cycles per KV step on one SM (two Q tiles), as
    chapter 09's model counts them."""
    from solutions import ch09_model

    return ch09_model.step_cycles(d, two_cta).smem


def check_smem_cycles_per_step(fn) -> None:
    for d in (64, 96, 128):
        for two in (False, True):
            got, want = fn(d, two), smem_cycles_per_step(d, two)
            if math.isclose(got, want, rel_tol=1e-6):
                continue
            tile = 128 * d * 2  # one 128 x D bf16 tile
            q, kv = 2 * tile, 4 * tile
            half = 2 if two else 1
            guesses = [
                (want * 128, "that is bytes; the model counts cycles at 128 bytes per "
                 "clock"),
                ((q + 2 * tile / half) / 128, "K and V are each read twice per step: once for "
                 "each Q tile's MMA (S_0 and S_1 read K, O_0 and O_1 read V)"),
                ((q / half + kv) / 128, "the pair halves the B operands (K for S, V for O), not "
                 "A: each CTA still reads all of its own Q rows"),
                ((q + kv) / half / 128, "the pair halves only the B operands; each CTA's Q "
                 "rows are its own, read in full"),
                (kv / half / 128, "Q is an operand too: both Q tiles (the A of S = Q K^T) are "
                 "read from shared memory every step"),
            ]
            why = next((w for g, w in guesses if math.isclose(got, g, rel_tol=1e-6)),
                       "count each MMA's operands read from shared memory: A of S = Q K^T (a Q "
                       "tile), B of S (K), B of O = P V (V; P comes from TMEM)")
            raise AssertionError(f"D={d} {'2-CTA' if two else '1-CTA'}: {got:g}, expected "
                                 f"{want:g} cycles. {why}")


# ----------------------------------------------------------------------------------------------
# 10.2: the schedule's wave efficiency, non-causal


def schedule_efficiency(seqlen: int, heads: int, batch: int, two_cta: bool) -> float:
    """Reference for 10.2: the persistent schedule's efficiency, non-causal (chapter 09's
    model: useful scores over what the SMs could compute in the schedule's makespan)."""
    from solutions import ch09_model

    return ch09_model.schedule(seqlen, heads, batch, False, two_cta)["efficiency"]


EFFICIENCY_CASES = [(4096, 16, 4), (1024, 16, 16), (2048, 3, 5), (512, 1, 37), (8192, 16, 2),
                    (1536, 7, 3)]


def check_schedule_efficiency(fn) -> None:
    for seqlen, heads, batch in EFFICIENCY_CASES:
        for two in (False, True):
            got = fn(seqlen, heads, batch, two)
            want = schedule_efficiency(seqlen, heads, batch, two)
            if math.isclose(got, want, rel_tol=1e-9):
                continue
            where = (f"seqlen={seqlen}, heads={heads}, batch={batch}, "
                     f"{'2-CTA' if two else '1-CTA'}")
            tile = 512 if two else 256
            tiles = seqlen // tile * heads * batch

            def eff(tiles, units):
                return tiles / (units * math.ceil(tiles / units))

            guesses = [
                (eff(tiles, SMS), "a pair takes two SMs: the grid has 74 pairs, not 148"),
                (eff(seqlen // 128 * heads * batch, SMS // (2 if two else 1)),
                 "a tile is what one CTA (or pair) computes at a time: two Q stages of 128 rows "
                 "per CTA, so 256 query rows (512 for a pair)"),
                (tiles / (SMS // (2 if two else 1)), "the grid runs whole rounds: a round that "
                 "is only partly filled still takes a tile's time (round up)"),
            ]
            why = next((w for g, w in guesses if math.isclose(got, g, rel_tol=1e-9)),
                       "count the tiles, the units that take them (CTAs or pairs), and the rounds "
                       "it takes; the last round may leave some units idle")
            raise AssertionError(f"{where}: {got:.4f}, expected {want:.4f}. {why}")


# ----------------------------------------------------------------------------------------------
# 10.3: the pair's MMA warp (pair_mma)


def run_pair_mma(fn, head_dim: int = 128) -> dict:
    """Run ``fn`` (exercise 10.3's signature) as plain Python for the MMA warp of each CTA of
    the pair. Returns {cta: its calls as ``Op``s}; the issue callables record one ``gemm`` per
    K-block of S = Q K^T (D/16) and of O = P V (8)."""
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import tcgen05

    out = {}
    for cta in (0, 1):
        rec = _Recorder(lane=0)

        def issue(what, blocks, rec=rec):
            def run(*args, **kwargs):
                if args or kwargs:
                    raise AssertionError(f"issue_{'s' if what == 'S' else 'pv'}() takes no "
                                         "arguments: it issues every K-block itself")
                for k in range(blocks):
                    rec.add(Op("gemm", what=what, k=k, accumulate=k != 0))
            return run

        def commit(bar, mask=None, cta_group=None, rec=rec, **kwargs):
            if cta_group is not tcgen05.CtaGroup.TWO:
                raise AssertionError(
                    "the commit tracks the MMAs of the pair's cta_group::2 instructions only "
                    "with cta_group=tcgen05.CtaGroup.TWO (a cta_group::1 commit waits for "
                    "cta_group::1 MMAs, and there are none)")
            rec.add(Op("commit", _bar_arg(bar, "tcgen05.commit"),
                       count=1 if rec.elect_depth else 32,
                       mask=None if mask is None else int(mask)))

        arch = _arch_recorders(rec)
        wait = arch["mbarrier_wait"]

        def wait_own(bar, phase=0, *args, cta=cta, rec=rec, **kwargs):
            wait(bar, phase)
            op = rec.ops.pop() if not rec.muted else None
            if op is not None:
                rec.add(Op("wait", op.bar, cta=cta, parity=op.parity))

        arch["mbarrier_wait"] = wait_own
        arch["block_idx_in_cluster"] = lambda *a, cta=cta, **k: cta
        import cutlass

        with python_loops(), patched(cute.arch, **arch), patched(tcgen05, commit=commit), \
                patched(cutlass, Float32=_F32):
            _run_plain(fn, cta, issue("S", head_dim // 16), issue("O", sim.PRIMER_ROWS // 16),
                       _Bar("load"), _Bar("s"), _Bar("p"), _Bar("o"))
        out[cta] = rec.ops
    return out


def _pair_softmax() -> dict:
    ops = sim.primer_softmax_ops(pair=True)
    return {c: [(sim.PRIMER_ROWS, [Op(o.kind, o.bar, cta=c if o.kind == "wait" else o.cta,
                                      parity=o.parity, what=o.what) for o in ops])]
            for c in (0, 1)}


def _pair_init() -> dict:
    return {c: sim.primer_init_ops() for c in (0, 1)}


def check_pair_mma(fn, compile_check: bool = True) -> None:
    """Exercise 10.3: ``fn`` (each CTA's MMA warp in the pair primer) run for both CTAs,
    replayed in the pair simulation against both CTAs' softmax warpgroups (eight
    interleavings, CTAs starting at different times), then compiled into the pair primer for
    sm_100a: cta_group::2 MMAs and commits, both commits multicast to the pair, the issue
    inside a branch on the CTA's rank."""
    calls = run_pair_mma(fn)
    if any(op.kind == "gemm" for op in calls[1]):
        raise AssertionError(
            "CTA 1 issued MMAs too: in a pair only the leader (cta_rank 0) issues. One "
            "cta_group::2 MMA already computes the 256 rows of both CTAs; the follower's would "
            "compute them again and commit a second time")
    if not any(op.kind == "gemm" for op in calls[0]):
        raise AssertionError("the leader (cta_rank 0) issued no MMA")
    commits = [op for op in calls[0] if op.kind == "commit"]
    if any(op.count != 1 for op in commits):
        raise AssertionError("a tcgen05.commit ran on all 32 threads of the warp: put it inside "
                             "`with cute.arch.elect_one():`")
    if any(op.mask != 0b11 for op in commits):
        hint = ("a commit without a mask arrives only on the leader's barrier, but each CTA's "
                "softmax waits on its own mbar_s and mbar_o: multicast the commit to both CTAs "
                "with the mask 0b11 (bit r = CTA rank r)")
    else:
        hint = ""
    try:
        sim.primer_run(calls, _pair_softmax(), _pair_init(), pair=True)
    except sim.Deadlock as exc:
        text = str(exc)
        if not hint and "CTA 1's MMA warp waits" in text:
            hint = ("the follower's MMA warp waits on a barrier of its own that nobody "
                    "completes (its mbar_load and mbar_p are never used): only the leader waits "
                    "and issues")
        elif not hint and "mbar_p" in text and "MMA warp waits" not in text:
            hint = "the leader waits for P (mbar_p) after issuing S"
        raise AssertionError(f"{hint or 'the pair deadlocks'}. Simulated: {exc}") from None
    except (sim.StaleRead, sim.Overwrite) as exc:
        text = str(exc)
        if "P in TMEM" in text:
            why = ("the leader issued O = P V before both CTAs had stored P: wait on mbar_p "
                   "(parity 0: it completes when both CTAs' 256 softmax threads have arrived)")
        elif "shared memory" in text:
            why = ("the leader issued S = Q K^T before both CTAs' Q, K and V had landed: wait "
                   "on mbar_load (parity 0) first")
        elif "S in TMEM" in text:
            why = "the commit onto mbar_s must come after issue_s(), once the MMAs are issued"
        else:
            why = "a buffer was read while being written"
        raise AssertionError(f"{hint or why}. Simulated: {exc}") from None
    except sim.PipelineError as exc:
        raise AssertionError(f"{hint or 'the pair breaks'}. Simulated: {exc}") from None
    if hint:
        raise AssertionError(hint)
    if compile_check:
        problems = pair_mma_ptx_problems(compile_pair_with(mma_fn=fn).ptx, 128)
        if problems:
            raise AssertionError("compiled for sm_100a: " + "; ".join(problems))


_PAIR_BUILDS: dict = {}


def compile_pair_with(mma_fn=None, init_fn=None, head_dim: int = 128):
    """The pair primer compiled for sm_100a (no GPU) with the given pieces; remembered."""
    from solutions import ch09_primer

    key = (mma_fn, init_fn, head_dim)
    if key not in _PAIR_BUILDS:
        _PAIR_BUILDS[key] = ch09_primer.compile_pair_tile(head_dim, mma_fn=mma_fn,
                                                          init_fn=init_fn)[1]
    return _PAIR_BUILDS[key]


def rank_registers(ptx: str) -> set[str]:
    """Registers (and predicates) whose value derives from %cluster_ctarank, the CTA's rank in
    its cluster, by simple forward data flow over the PTX."""
    derived = set(re.findall(r"mov\.u32\s+(%\w+),\s*%cluster_ctarank;", ptx))
    for _ in range(4):
        for ln in _lines(ptx):
            m = re.match(r"(?:@!?%p\d+\s+)?[a-z][\w.:]*\s+(%\w+)(?:\|%\w+)?,\s*(.*);", ln)
            if not m or ln.startswith(("st.", "bra", "tcgen05", "mbarrier", "cp.")):
                continue
            if any(src in derived for src in re.findall(r"%\w+", m.group(2))):
                derived.add(m.group(1))
    return derived


def pair_mma_ptx_problems(ptx: str, head_dim: int) -> list[str]:
    """What the pair primer's PTX shows wrong about the MMA warp's piece (empty: nothing)."""
    lines = _lines(ptx)
    out = []
    mmas = [i for i, ln in enumerate(lines) if ln.startswith("tcgen05.mma")]
    want = head_dim // 16 + sim.PRIMER_ROWS // 16
    if len(mmas) != want or any("cta_group::2" not in lines[i] for i in mmas):
        out.append(f"{len(mmas)} tcgen05.mma, expected {want}, all cta_group::2")
    commits = [i for i, ln in enumerate(lines) if ln.startswith("tcgen05.commit")]
    if len(commits) != 2:
        out.append(f"{len(commits)} tcgen05.commit, expected 2 (S is ready, O is ready)")
    for i in commits:
        if "cta_group::2" not in lines[i] or "multicast::cluster" not in lines[i]:
            out.append(f"a commit that is not cta_group::2 multicast: {lines[i][:70]}")
            continue
        mask = re.search(r",\s*(%rs\d+);", lines[i])
        moved = mask and re.search(rf"mov\.b16\s+{re.escape(mask.group(1))},\s*(\d+);", ptx)
        if moved and int(moved.group(1)) != 0b11:
            out.append(f"a multicast commit with mask {moved.group(1)}, expected 3 (both CTAs)")
    if not mmas or not commits:
        return out
    rank = rank_registers(ptx)
    labels = {ln.rstrip(":"): i for i, ln in enumerate(lines) if re.match(r"\$L\w+:$", ln)}
    guarded = False
    for ln in lines[:mmas[0]]:
        m = re.match(r"@!?(%p\d+)\s+bra\s+(\$L\w+);", ln)
        if m and m.group(1) in rank and labels.get(m.group(2), -1) > commits[-1]:
            guarded = True
    if not guarded:
        out.append("no branch on the CTA's rank (%cluster_ctarank) skips the MMAs and commits "
                   "in the follower: both CTAs would issue")
    return out


# ----------------------------------------------------------------------------------------------
# 10.4: the pair's barriers (init_pair_barriers)

PAIR_COUNTS = {"load": 1, "s": 1, "p": 2 * sim.PRIMER_ROWS, "o": 1}
COUNT_HINTS = {
    "load": "mbar_load: one arrival (the leader's arrive.expect_tx, which announces the bytes of "
            "both CTAs' loads); the TMA bytes complete it, they are not arrivals",
    "s": "mbar_s: one arrival per phase in each CTA: the leader's multicast commit arrives "
         "once on each CTA's barrier",
    "p": "mbar_p: the leader's MMA warp waits there for every softmax thread of the pair: 128 "
         "of its own and 128 that the follower's threads make remotely",
    "o": "mbar_o: one arrival, the multicast commit after O = P V",
}


def run_init_pair_barriers(fn) -> dict:
    """Run ``fn`` (exercise 10.4's signature) as plain Python for every warp of each CTA, for
    lane 0 and for one other lane (inside ``elect_one`` only lane 0 runs). Returns
    {cta: {(warp, lane): calls as ``Op``s}}."""
    import cutlass
    import cutlass.cute as cute

    from solutions.ch09_primer import MMA_WARP

    out = {}
    for cta in (0, 1):
        out[cta] = {}
        for warp in range(MMA_WARP + 1):
            for lane in (0, 1):
                rec = _Recorder(lane=lane)

                def init(bar, count, *args, rec=rec, **kwargs):
                    rec.add(Op("init", _bar_arg(bar, "mbarrier_init"), count=int(count)))

                arch = _arch_recorders(rec)
                arch.update(
                    mbarrier_init=init,
                    mbarrier_init_fence=lambda *a, rec=rec, **k: rec.add(Op("fence_init")),
                    cluster_arrive_relaxed=lambda *a, rec=rec, **k: rec.add(
                        Op("cluster_arrive", relaxed=True)),
                    cluster_arrive=lambda *a, rec=rec, **k: rec.add(
                        Op("cluster_arrive", relaxed=False)),
                    cluster_wait=lambda *a, rec=rec, **k: rec.add(Op("cluster_wait")),
                    barrier=lambda *a, rec=rec, **k: rec.add(Op("cta_barrier")),
                    block_idx_in_cluster=lambda *a, cta=cta, **k: cta)
                with python_loops(), patched(cute.arch, **arch), \
                        patched(cutlass, Float32=_F32):
                    _run_plain(fn, _Bar("load"), _Bar("s"), _Bar("p"), _Bar("o"), warp)
                out[cta][(warp, lane)] = rec.ops
    return out


def check_init_pair_barriers(fn, compile_check: bool = True) -> None:
    """Exercise 10.4: ``fn`` (each CTA's barrier set-up) run for every warp of both CTAs; the
    counts against the pair's arrivals; the set-up replayed in the pair simulation with the
    reference roles and CTAs that start up to 30 ticks apart (a barrier touched by the peer
    before its init is visible is named); then compiled for sm_100a: every init, then the
    fence, then the cluster arrive and wait, before anything the peer can see."""
    calls = run_init_pair_barriers(fn)
    setup = {}
    for cta, threads in calls.items():
        inits = {}
        for ops in threads.values():
            for op in ops:
                if op.kind == "init":
                    if inits.get(op.bar, op.count) != op.count:
                        raise AssertionError(f"mbar_{op.bar} is initialised with two different "
                                             f"counts ({inits[op.bar]} and {op.count})")
                    inits[op.bar] = op.count
        for bar, want in PAIR_COUNTS.items():
            if bar not in inits:
                raise AssertionError(f"mbar_{bar} is never initialised (CTA {cta})")
            if inits[bar] != want:
                raise AssertionError(f"mbar_{bar} counts {inits[bar]} arrivals per phase, "
                                     f"expected {want}: {COUNT_HINTS[bar]}")
        for (warp, _lane), ops in threads.items():
            kinds = [op.kind for op in ops]
            if "cluster_arrive" not in kinds or "cluster_wait" not in kinds:
                raise AssertionError(
                    f"warp {warp}'s threads do not pass the cluster barrier (arrive, then "
                    "wait): nothing then stops a CTA from touching the other's barriers before "
                    "they are initialised, and a cluster barrier that some threads skip never "
                    "completes. Every thread of both CTAs arrives and waits")
        initialiser = next(ops for ops in threads.values()
                           if any(op.kind == "init" for op in ops))
        setup[cta] = [op for op in initialiser if op.kind != "cta_barrier"]
    try:
        sim.primer_run({0: sim.primer_mma_ops(pair=True), 1: []}, _pair_softmax(), setup,
                       pair=True)
    except sim.Uninitialised as exc:
        if "published" in str(exc):
            why = ("the peer may see the barrier before its init: mbarrier_init_fence() "
                   "(fence.mbarrier_init.release.cluster) after the inits and before the "
                   "cluster arrive makes them visible to the cluster")
        else:
            why = ("a CTA touched the other's barrier before it was initialised: the cluster "
                   "barrier (cute.arch.cluster_arrive_relaxed(), then cluster_wait()) after "
                   "the inits keeps both CTAs from going on until both have initialised")
        raise AssertionError(f"{why}. Simulated: {exc}") from None
    except sim.PipelineError as exc:
        raise AssertionError(f"the pair breaks with these barriers. Simulated: {exc}") from None
    if compile_check:
        problems = init_ptx_problems(compile_pair_with(init_fn=fn).ptx)
        if problems:
            raise AssertionError("compiled for sm_100a: " + "; ".join(problems))


def init_ptx_problems(ptx: str) -> list[str]:
    """What the pair primer's PTX shows wrong about the barrier set-up (empty: nothing): the
    four barriers initialised with the pair's counts, every init before the fence, the fence
    before the cluster arrive, the arrive before the wait, and the wait before the first
    thing the peer sees (a TMA load into the pair, a remote arrive, a multicast commit)."""
    lines = _lines(ptx)
    bars = barrier_registers(ptx)
    out = []
    inits = {}
    for i, ln in enumerate(lines):
        m = re.match(r"mbarrier\.init\.shared\.b64\s+\[(%r\d+)\],\s*(%r\d+|\d+);", ln)
        if m:
            count = m.group(2)
            if count.startswith("%"):
                mv = re.search(rf"mov\.b32\s+{re.escape(count)},\s*(\d+);", ptx)
                count = mv.group(1) if mv else "?"
            inits[i] = (_which(m.group(1), bars).removeprefix("mbar_"), count)
    for bar, want in PAIR_COUNTS.items():
        got = [c for b, c in inits.values() if b == bar]
        if got != [str(want)]:
            out.append(f"mbar_{bar} initialised {got or 'never'}, expected once with {want}")
    fence = next((i for i, ln in enumerate(lines) if ln.startswith("fence.mbarrier_init")
                  and i > max(inits, default=-1)), None)
    arrive = next((i for i, ln in enumerate(lines) if ln.startswith("barrier.cluster.arrive")),
                  None)
    wait = next((i for i, ln in enumerate(lines) if ln.startswith("barrier.cluster.wait")), None)
    if fence is None:
        out.append("no fence.mbarrier_init after the last mbarrier.init")
    if arrive is None or wait is None:
        out.append("no cluster barrier (barrier.cluster.arrive and barrier.cluster.wait)")
        return out
    if fence is not None and not fence < arrive < wait:
        out.append("the order must be: the inits, fence.mbarrier_init, barrier.cluster.arrive, "
                   "barrier.cluster.wait")
    peer = next((i for i, ln in enumerate(lines) if "cta_group::2" in ln and
                 ln.startswith("cp.async.bulk.tensor") or ln.startswith("mapa")
                 or "multicast::cluster" in ln), None)
    if peer is not None and peer < wait:
        out.append(f"the peer can be touched (PTX line {peer}) before barrier.cluster.wait")
    return out


# ----------------------------------------------------------------------------------------------
# on a Blackwell GPU

PAIR_GPU_CASES = [(64, 1.0, 0), (128, 1.0, 1), (128, 8.0, 2)]


def check_pair_on_gpu(mma_fn=None, init_fn=None, cases=PAIR_GPU_CASES):
    """The pair primer with the given pieces on a B200/B300: 256 query rows x 128 keys on fresh
    random inputs, against float64. Returns (ok, one line per case)."""
    import torch

    from solutions import ch09_primer
    from utils.checks import poison_, tolerance_check
    from utils.reference import attention_reference

    ok, lines = True, []
    rows = ch09_primer.PAIR * ch09_primer.TILE
    for d, scale, seed in cases:
        compiled, _ = ch09_primer.compile_pair_tile(d, keep=False, mma_fn=mma_fn,
                                                    init_fn=init_fn)
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(rows, d, generator=g) * scale
        k, v = (torch.randn(ch09_primer.TILE, d, generator=g) for _ in range(2))
        q, k, v = (t.to(torch.bfloat16).cuda() for t in (q, k, v))
        out = poison_(torch.empty_like(q))
        lse = poison_(torch.empty(rows, dtype=torch.float32, device="cuda"))
        compiled(q, k, v, out, lse, d**-0.5)
        torch.cuda.synchronize()
        q4, k4, v4 = (t[None, :, None] for t in (q, k, v))
        ref = attention_reference(q4, k4, v4, dtype=torch.float64)
        same = attention_reference(q4, k4, v4, dtype=torch.bfloat16)
        verdict = tolerance_check(out[None, :, None], ref[0], same[0], "out")
        lse_ok = bool(torch.allclose(lse.double(), ref[1][0, 0].cuda(), atol=1e-3))
        ok &= verdict.ok and lse_ok
        lines.append(f"pair D={d} scale={scale} seed={seed}: out "
                     f"{'ok' if verdict.ok else 'WRONG'}, lse {'ok' if lse_ok else 'WRONG'}")
    return ok, lines


def pair_config_table() -> list[str]:
    """What the flag changes in the forward's configuration, one line per variant."""
    out = []
    for two in (False, True):
        cfg = BlackwellFwdConfig(two_cta=two)
        out.append(f"two_cta={two}: cluster of {cfg.cta_group}, MMA M = {cfg.mma_m}, tile of "
                   f"{cfg.cluster_tile_m} query rows; K/V stage {cfg.kv_stage_bytes(128)} B -> "
                   f"ring of {cfg.ring_depth(128)} stages; shared memory "
                   f"{cfg.smem_bytes(128)} B; TMEM columns "
                   f"{cfg.tmem_plan(128).columns_allocated}")
    return out
