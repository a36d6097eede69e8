"""Readers of the stored files behind labs/package_sweeps_and_host_cost.ipynb (read after chapter
13): the full sweep of fa4_final's public API beside its peers, varlen batches, memory, and what a
call costs the host. Each takes a ``utils.results.Results`` (or None when the file was never
measured) and derives what it prints from the rows: which implementation is fastest, whether a
difference is larger than the spread (``utils.bench.compare``). The drivers that make the files
are measure/package_sweep.py, measure/package_varlen.py and measure/package_host.py.
"""

from __future__ import annotations

import math
from collections import Counter

from solutions.ch13_teaching import (
    IMPL,
    PASSES,
    SHAPE,
    impls_of,
    is_ours,
    peer_comparisons,
    plain_ticks,
)
from utils import bench, plots
from utils.claims import claim

# ---------------------------------------------------------------------------------------------
# The sweep: TFLOP/s against S, and the ratio to the best peer


def sweep_series(res, pass_: str, d: int, causal: bool, impls=None):
    """(seqlens, {impl: [TFLOP/s or None per seqlen]}) of one panel of the sweep."""
    rows = [r for r in res.rows if r["pass"] == pass_ and r["d"] == d and r["causal"] == causal]
    seqlens = sorted({r["s"] for r in rows})
    series = {}
    for n in impls or impls_of(res):
        got = {r["s"]: r.get("tflops") for r in rows if r["impl"] == n}
        if any(got.values()):
            series[n] = [got.get(s) for s in seqlens]
    return seqlens, series


def _panels(res, pass_):
    dims = sorted({r["d"] for r in res.rows if r["pass"] == pass_})
    return [(d, c) for d in dims for c in (False, True)]


def plot_sweep(res, pass_: str):
    """TFLOP/s against S for one pass: a panel per (head dim, causal), a line per impl."""
    import matplotlib.pyplot as plt

    panels = _panels(res, pass_)
    cols = 2
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.6 * rows), squeeze=False)
    for ax, (d, causal) in zip(axes.flat, panels):
        seqlens, series = sweep_series(res, pass_, d, causal)
        plots.curves(seqlens, series, title=f"{pass_}, D={d}, {'causal' if causal else 'no mask'}",
                     xlabel="sequence length S", ylabel="TFLOP/s", logx=True, ax=ax)
        plain_ticks(ax, seqlens)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    _figure_label(fig, res.label)
    return fig


def _figure_label(fig, label: str) -> None:
    """Lay out the panels, then put the provenance under all of them (one line for the figure,
    outside the axes, so it does not squeeze them)."""
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.text(0.01, 0.01, label, fontsize=7, color="#555555")


def plot_vs_best_peer(res, impl: str = IMPL):
    """``impl``'s TFLOP/s over the fastest peer of each shape, against S: a panel per pass, a
    line per (head dim, causal), the band of the larger spread shaded around 1."""
    import matplotlib.pyplot as plt

    passes = [p for p in PASSES if any(r["pass"] == p for r in res.rows)]
    fig, axes = plt.subplots(1, len(passes), figsize=(4.6 * len(passes), 3.8), squeeze=False,
                             sharey=True)
    for ax, pass_ in zip(axes.flat, passes):
        found = peer_comparisons(res, impl, pass_)
        for d, causal in _panels(res, pass_):
            pts = sorted((r["s"], c.ratio) for r, _, c in found
                         if r["d"] == d and r["causal"] == causal)
            if pts:
                ax.plot(*zip(*pts), marker="o" if causal else "s",
                        ls="-" if causal else "--", label=f"D={d}{' causal' if causal else ''}")
        noise = sorted((r["s"], c.noise) for r, _, c in found)
        if noise:
            s_all = sorted({s for s, _ in noise})
            band = [max(n for s2, n in noise if s2 == s) for s in s_all]
            ax.fill_between(s_all, [max(0.0, 1 - b) for b in band], [1 + b for b in band],
                            color="grey", alpha=0.2, label="largest spread")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        plain_ticks(ax, sorted({r["s"] for r, _, _ in found}))
        ax.set_title(f"{pass_}: {impl} / best peer")
        ax.set_xlabel("sequence length S")
        ax.legend(fontsize=7)
    axes.flat[0].set_ylabel("ratio (> 1: faster than every peer)")
    _figure_label(fig, res.label)
    return fig


def verdict_summary(res, impl: str = IMPL) -> str:
    """Per pass: on how many shapes ``impl`` is faster, within noise, slower than the best
    peer, the geometric mean of the ratios, and the best and worst shape."""
    lines = []
    for pass_ in PASSES:
        found = peer_comparisons(res, impl, pass_)
        if not found:
            continue
        counts = Counter(c.verdict for _, _, c in found)
        gm = bench.geomean([c.ratio for _, _, c in found])
        lo = min(found, key=lambda f: f[2].ratio)
        hi = max(found, key=lambda f: f[2].ratio)
        lines.append(
            f"{pass_:8s} {len(found)} shapes: faster on {counts['faster']}, within noise on "
            f"{counts['within noise']}, slower on {counts['slower']}; geometric mean "
            f"{gm:.2f}x the best peer; lowest {_shape(lo[0])} {lo[2]} vs {lo[1]['impl']}, "
            f"highest {_shape(hi[0])} {hi[2]} vs {hi[1]['impl']}")
    return "\n".join(lines) or f"no timed {impl} rows with a peer"


def _shape(row) -> str:
    return f"D={row['d']} S={row['s']}{' causal' if row['causal'] else ''}"


def fastest_counts(res, pass_: str) -> str:
    """How often each implementation is the fastest of all at a shape of ``pass_``."""
    groups = {}
    for r in res.rows:
        if r["pass"] == pass_ and r.get("tflops"):
            groups.setdefault(tuple(r.get(k) for k in SHAPE), []).append(r)
    wins = Counter(bench.fastest(g)["impl"] for g in groups.values())
    return f"{pass_}: fastest at " + ", ".join(f"{n} {c}" for n, c in wins.most_common()) + \
        f" of {len(groups)} shapes"




# ---------------------------------------------------------------------------------------------
# Varlen and memory

VARLEN_CASE = ("dtype", "b", "h", "d", "causal", "pass")
VARLEN_OURS = "fa4_final_varlen"  # the kernel over the packed batch, as FA4's call (no host sync)


def varlen_table(res) -> str:
    """One line per case of the varlen file (measure/package_varlen.py): the pass (forward,
    backward, both; a file from before the backward rows has forward rows only), the batch's
    lengths, each implementation's TFLOP/s, and the varlen kernel over the fastest peer with the
    verdict of utils.bench.compare. The other fa4_final rows (the API's checked call, the
    per-sequence loop) are shown beside it, not compared as peers."""
    if res is None:
        return "not measured yet"
    groups = {}
    for r in res.rows:
        groups.setdefault(tuple(r.get(k) for k in VARLEN_CASE), []).append(r)
    names = impls_of(res)
    lines = [f"[{res.name}] {res.label}",
             f"{'case':50s}" + "".join(f"{n:>26s}" for n in names) + "  varlen kernel vs peer"]
    for case, rows in groups.items():
        by = {r["impl"]: r for r in rows}
        first = rows[0]
        label = (f"{case[5] or 'fwd'} {case[1]} seqs, mean {first.get('s')} max "
                 f"{first.get('s_max')}, d={case[3]}{' causal' if case[4] else ''}")
        cells = "".join(f"{by[n]['tflops']:>26.0f}" if by.get(n, {}).get("tflops") else
                        f"{'error' if by.get(n, {}).get('error') else '-':>26s}" for n in names)
        ours = by.get(VARLEN_OURS) if by.get(VARLEN_OURS, {}).get("tflops") else None
        peer = bench.fastest([r for r in rows if not is_ours(r["impl"])])
        cmp = bench.compare(ours, peer) if ours and peer else None
        verdict = f"  {cmp} vs {peer['impl']}" if cmp else "  -"
        lines.append(f"{label:50s}{cells}{verdict}")
    return "\n".join(lines)


VARLEN_ZIGZAG = "fa4_final_varlen_zigzag"  # the same kernel in fixed zigzag rounds (fwd only)


def varlen_schedule_lines(res) -> str:
    """Per forward case of the varlen file: the kernel taking its tiles at run time over the
    same kernel in fixed zigzag rounds (the same run), with the verdict of utils.bench.compare.
    A file without zigzag rows has none to show."""
    if res is None:
        return "not measured yet"
    lines = []
    for causal in (False, True):
        by = {r["impl"]: r for r in res.rows
              if r.get("pass", "fwd") == "fwd" and bool(r.get("causal")) == causal}
        cmp = bench.compare(by[VARLEN_OURS], by[VARLEN_ZIGZAG]) if (
            VARLEN_OURS in by and VARLEN_ZIGZAG in by) else None
        if cmp:
            lines.append(f"fwd{' causal' if causal else ''}: tiles taken at run time "
                         f"{cmp} against fixed zigzag rounds")
    return "\n".join(lines) or "no zigzag rows in this file"


def memory_table(res) -> str:
    """Peak memory of one forward + backward beyond the inputs and their gradients, in MiB and
    as a multiple of those inputs and gradients."""
    if res is None:
        return "not measured yet"
    names = impls_of(res)
    lines = [f"[{res.name}] {res.label}",
             f"{'S':>6s} {'D':>4s} {'causal':>6s} {'q,k,v + grads MiB':>18s}"
             + "".join(f"{n:>22s}" for n in names)]
    for s, d, causal in sorted({(r["s"], r["d"], r["causal"]) for r in res.rows}):
        rows = {r["impl"]: r for r in res.rows
                if (r["s"], r["d"], r["causal"]) == (s, d, causal)}
        floor = next(iter(rows.values()))["inputs_and_grads_bytes"]
        cells = []
        for n in names:
            r = rows.get(n, {})
            v = r.get("value")
            cells.append(f"{v / 2**20:>10.0f} ({v / floor:5.2f}x)".rjust(22) if v is not None
                         else ("error" if r.get("error") else "-").rjust(22))
        lines.append(f"{s:>6d} {d:>4d} {causal!s:>6s} {floor / 2**20:>18.0f}" + "".join(cells))
    lines.append("each cell: extra MiB (as a multiple of the inputs and gradients)")
    return "\n".join(lines)



# ---------------------------------------------------------------------------------------------
# What a call costs the host (measure/package_host.py)


def _us(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _host_shape(r) -> str:
    return f"{r['pass']} b={r['b']} S={r['s']} D={r['d']}{' causal' if r['causal'] else ''}"


def _host_value(res, variant: str, metric: str, impl: str = IMPL):
    row = next((r for r in res.rows if r.get("variant") == variant and r["metric"] == metric
                and r["impl"] == impl), None)
    return None if row is None else row["value"]


def latest_variant(res) -> str:
    """The variant of the CPU profile that measured the tree the file was saved from (the file
    keeps every tree measured on that CPU, labelled); else the last one stored."""
    commit = str(res.provenance.get("commit", ""))
    for r in res.rows:
        if r.get("variant") and commit.startswith(str(r.get("fa4_final_commit"))[:10]):
            return r["variant"]
    return [r["variant"] for r in res.rows if r.get("variant")][-1]


def host_table(res, variant: str | None = None) -> str:
    """Host microseconds per call (``--profile``: kernels as no-ops) of one measured tree of the
    package (the newest by default), the checks and launches per call, and the floor: a Python
    autograd op that only allocates its outputs and gradients."""
    if res is None:
        return "not measured yet"
    v = variant or latest_variant(res)
    commit = next(r["fa4_final_commit"] for r in res.rows if r["variant"] == v)
    lines = [res.label, "setup: " + res.rows[0]["setup"],
             f"fa4_final as of {str(commit)[:10]}", "",
             f"{'':24s} {'fwd us':>8s} {'fwd+bwd us':>11s} {'checks/call':>12s} "
             f"{'launches/call':>14s}"]
    fwd, both = _host_value(res, v, "host_us fwd"), _host_value(res, v, "host_us fwd+bwd")
    checks = _host_value(res, v, "check_inputs per call fwd+bwd")
    launches = _host_value(res, v, "kernel launches per call fwd+bwd")
    lines.append(f"{IMPL:24s} {fwd:8.1f} {both:11.1f} {checks:12g} {launches:14g}")
    floor = _host_value(res, v, "host_us fwd+bwd", impl="floor")
    if floor is not None:
        lines.append(f"{'floor (a bare Function)':24s} {'':8s} {floor:11.1f}")
        lines.append(f"fwd+bwd: fa4_final's host time is {both / floor:.1f}x the floor's")
    return "\n".join(lines)


def host_parts(res, pass_: str = "fwd+bwd", variant: str | None = None) -> str:
    """Where a call's host time goes (cProfile's shares, scaled to the measured time), for one
    measured tree (the newest by default)."""
    if res is None:
        return "not measured yet"
    v = variant or latest_variant(res)
    parts = {r["part"]: r["value"] for r in res.rows
             if r["metric"] == f"host_us {pass_} by part" and r["variant"] == v}
    lines = [f"{'host us per ' + pass_ + ' call, by part':66s}{'us':>8s}"]
    for part, us in sorted(parts.items(), key=lambda kv: -kv[1]):
        lines.append(f"{part:66s}{_us(us):>8s}")
    return "\n".join(lines)


def host_gpu_table(res, impls=("fa4_final", "fa4_final_op", "sdpa_flash", "sdpa_cudnn",
                               "fa4_package")) -> str:
    """``--gpu``: host, wall and kernel microseconds per call of each implementation, per shape;
    ``host-bound`` where issuing the call took longer than its kernels ran."""
    if res is None:
        return "not measured yet"
    rows = [r for r in res.rows if r.get("pass") and r.get("wall_us") is not None
            and r["impl"] in impls]
    lines = [res.label, f"{'shape':36s} {'impl':13s} {'host us':>8s} {'wall us':>8s} "
                        f"{'kernels us':>10s}"]
    shapes = list(dict.fromkeys((r["pass"], r["b"], r["s"], r["h"], r["d"], r["causal"])
                                for r in rows))
    for shape in shapes:
        for r in rows:
            if (r["pass"], r["b"], r["s"], r["h"], r["d"], r["causal"]) != shape:
                continue
            bound = "  host-bound" if r.get("host_bound") else ""
            lines.append(f"{_host_shape(r):36s} {r['impl']:13s} {r['host_us']:8.1f} "
                         f"{r['wall_us']:8.1f} {_us(r.get('kernel_us')):>10s}{bound}")
    for r in res.rows:
        if r.get("metric") in ("tvm_ffi_launch_us", "torch_empty_us"):
            lines.append(f"{r['metric']}: {r['value']:.1f} us per call ({r['note']})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Numbers the lab's predictions are revealed against, and the claims its prose makes

def sweep_ratio(res, pass_: str, d: int, s: int, causal: bool) -> float:
    """fa4_final's TFLOP/s over the best peer's at one shape of the sweep."""
    row, peer, _ = next(f for f in peer_comparisons(res, IMPL, pass_)
                        if (f[0]["d"], f[0]["s"], f[0]["causal"]) == (d, s, causal))
    return row["tflops"] / peer["tflops"]


def _varlen_rows(res, pass_: str, causal: bool) -> dict:
    return {r["impl"]: r for r in res.rows
            if r.get("pass", "fwd") == pass_ and bool(r.get("causal")) == causal}


def varlen_over_loop(res, pass_: str = "fwd", causal: bool = False) -> float:
    """The varlen kernel's TFLOP/s over the per-sequence loop's, one case."""
    by = _varlen_rows(res, pass_, causal)
    return by[VARLEN_OURS]["tflops"] / by["fa4_final_loop"]["tflops"]


def memory_multiple(res, s: int = 32768, impl: str = IMPL) -> float:
    """``impl``'s extra memory over the inputs and gradients, at length ``s``."""
    row = next(r for r in res.rows if r["impl"] == impl and r["s"] == s)
    return row["value"] / row["inputs_and_grads_bytes"]


def host_over_floor(res) -> float:
    """fa4_final's host microseconds per fwd+bwd call over the floor's (CPU profile)."""
    v = latest_variant(res)
    return (_host_value(res, v, "host_us fwd+bwd")
            / _host_value(res, v, "host_us fwd+bwd", impl="floor"))


def _host_gpu_rows(res, impl: str) -> dict:
    return {(r["pass"], r["s"], r["d"], r["causal"]): r for r in res.rows
            if r["impl"] == impl and r.get("wall_us") is not None}


def op_over_eager(res, pass_: str = "fwd+bwd") -> float:
    """Median over the shapes of ``pass_``: the custom-op path's host microseconds per call over
    the eager path's."""
    import statistics

    op, eager = _host_gpu_rows(res, "fa4_final_op"), _host_gpu_rows(res, IMPL)
    return statistics.median(op[k]["host_us"] / eager[k]["host_us"] for k in eager
                             if k[0] == pass_ and k in op)


@claim("lab13.fwd_bwd_rarely_slower", "package_sweep",
       "for forward + backward, fa4_final is slower than the best peer beyond the spread at "
       "two of the sweep's shapes at most")
def _(res):
    found = peer_comparisons(res, IMPL, "fwd+bwd")
    n = sum(1 for _, _, c in found if c.verdict == "slower")
    return len(found) >= 20 and n <= 2, f"slower at {n} of {len(found)} fwd+bwd shapes"


@claim("lab13.short_forward_cudnn", "package_sweep",
       "in the forward at S <= 1024, cuDNN is the fastest peer at every shape, and fa4_final is "
       "slower than it beyond the spread at most of them")
def _(res):
    found = [f for f in peer_comparisons(res, IMPL, "fwd") if f[0]["s"] <= 1024]
    peers = {f[1]["impl"] for f in found}
    n = sum(1 for _, _, c in found if c.verdict == "slower")
    return (peers == {"sdpa_cudnn"} and n > len(found) / 2,
            f"fastest peers {sorted(peers)}; fa4_final slower at {n} of {len(found)}")


@claim("lab13.backward_fa4_leads", "package_sweep",
       "in the backward, the FA4 package is the fastest implementation at more shapes than "
       "fa4_final")
def _(res):
    groups = {}
    for r in res.rows:
        if r["pass"] == "bwd" and r.get("tflops"):
            groups.setdefault(tuple(r.get(k) for k in SHAPE), []).append(r)
    wins = Counter(bench.fastest(g)["impl"] for g in groups.values())
    return wins["fa4_package"] > wins[IMPL], f"fastest in the backward: {dict(wins)}"


@claim("lab13.varlen_level_with_fa4", "package_varlen",
       "the varlen kernel and the FA4 package's are within noise of each other in every case "
       "and pass")
def _(res):
    verdicts = []
    for pass_ in PASSES:
        for causal in (False, True):
            by = _varlen_rows(res, pass_, causal)
            if VARLEN_OURS in by and "fa4_package" in by:
                verdicts.append(bench.compare(by[VARLEN_OURS], by["fa4_package"]).verdict)
    return (bool(verdicts) and set(verdicts) == {"within noise"},
            f"verdicts against the FA4 package: {Counter(verdicts)}")


@claim("lab13.varlen_beats_the_loop", "package_varlen",
       "one launch of the varlen kernel is faster than the per-sequence loop beyond the spread "
       "in every forward and every backward case")
def _(res):
    verdicts = [bench.compare(by[VARLEN_OURS], by["fa4_final_loop"]).verdict
                for pass_ in ("fwd", "bwd") for causal in (False, True)
                for by in [_varlen_rows(res, pass_, causal)]]
    return set(verdicts) == {"faster"}, f"verdicts against the loop: {verdicts}"


@claim("lab13.varlen_check_cheap", "package_varlen",
       "the checked call (one host copy of the offsets) is within noise of the unchecked one in "
       "all but one case at most")
def _(res):
    verdicts = [bench.compare(by["fa4_final_varlen_checked"], by[VARLEN_OURS]).verdict
                for pass_ in PASSES for causal in (False, True)
                for by in [_varlen_rows(res, pass_, causal)]]
    n = sum(v != "within noise" for v in verdicts)
    return n <= 1, f"checked vs unchecked: {Counter(verdicts)}"


@claim("lab13.zigzag_costs_causal", "package_varlen",
       "for causal batches, tiles taken at run time are faster than fixed zigzag rounds beyond "
       "the spread")
def _(res):
    by = _varlen_rows(res, "fwd", True)
    cmp = bench.compare(by[VARLEN_OURS], by[VARLEN_ZIGZAG])
    return cmp.verdict == "faster", f"causal forward: {cmp}"


@claim("lab13.memory_like_peers", "package_memory",
       "at every length, fa4_final's extra memory is within 2% of the smallest peer's")
def _(res):
    worst = 0.0
    for s in {r["s"] for r in res.rows}:
        ours = next(r["value"] for r in res.rows if r["s"] == s and r["impl"] == IMPL)
        peers = [r["value"] for r in res.rows if r["s"] == s and not is_ours(r["impl"])
                 and r.get("value")]
        worst = max(worst, ours / min(peers))
    return worst <= 1.02, f"largest ratio to the smallest peer: {worst:.3f}"


@claim("lab13.op_path_costs_host_time", "package_host",
       "at every shape, a call through the custom op costs the host more than the eager path, "
       "and at least three quarters of the calls through the op are host-bound")
def _(res):
    op, eager = _host_gpu_rows(res, "fa4_final_op"), _host_gpu_rows(res, IMPL)
    worst = min(op[k]["host_us"] / eager[k]["host_us"] for k in eager if k in op)
    bound = sum(bool(r.get("host_bound")) for r in op.values())
    return (worst > 1.0 and bound >= 0.75 * len(op),
            f"smallest op / eager host time: {worst:.2f}; op calls host-bound: {bound} of "
            f"{len(op)}")


# ----------------------------------------------------------------------------------------------
# a decode step's host time (measure.decode_host; Note [A repeated decode call])

DECODE_BEFORE, DECODE_AFTER = "repeat_before", "repeat_after"


def decode_host_pairs(res) -> list[tuple]:
    """(call, host us without the memo, with it) per decode call of the stored CPU comparison."""
    got = {(r.get("variant"), r["metric"]): r["value"] for r in res.rows}
    calls = dict.fromkeys(r["metric"].removeprefix("host_us ") for r in res.rows
                          if r.get("variant") == DECODE_AFTER)
    return [(c, got.get((DECODE_BEFORE, f"host_us {c}")), got[(DECODE_AFTER, f"host_us {c}")])
            for c in calls]


def decode_host_lines(res) -> list[str]:
    if res is None:
        return ["not measured yet"]
    commits = {r.get("variant"): str(r.get("fa4_final_commit"))[:7] for r in res.rows}
    lines = [res.label, "setup: " + res.rows[0]["setup"],
             f"host us per call, the fastest batch: without the memo ({commits[DECODE_BEFORE]}) "
             f"and with it ({commits[DECODE_AFTER]})"]
    for call, before, after in decode_host_pairs(res):
        lines.append(f"  {call:22s} {_us(before):>7s} -> {_us(after):>7s}  "
                     f"({after / before:.2f}x)")
    return lines


def decode_host_gpu_lines(res) -> list[str]:
    """The GPU run: host microseconds per call (no synchronisation) beside the GPU's per call
    back to back, the API's calls and the kernel launched directly."""
    if res is None:
        return ["not measured yet"]
    lines = [res.label, f"{'call':28s} {'host us':>8s} {'GPU us back to back':>20s}"]
    for r in res.rows:
        if "by function" not in r["metric"]:
            lines.append(f"{r['metric'].removeprefix('host_us '):28s} {r['value']:8.1f} "
                         f"{r['gpu_us_per_call_back_to_back']:20.1f}")
    return lines


def repeated_over_before(res, call: str = "dense num_splits=0") -> float:
    return next(after / before for c, before, after in decode_host_pairs(res) if c == call)


@claim("lab13.repeated_decode_host", "decode_host",
       "on the stored CPU, every decode call repeated under the memo spends less than 0.7 of "
       "the host time it spent before, and each dense call a smaller share than the paged call "
       "with the same num_splits", gpu="cpu")
def _(res):
    pairs = {c: a / b for c, b, a in decode_host_pairs(res)}
    ok = (len(pairs) == 4 and all(r < 0.7 for r in pairs.values())
          and all(pairs[f"dense num_splits={n}"] < pairs[f"paged num_splits={n}"]
                  for n in (0, 1)))
    return ok, "; ".join(f"{c} {r:.2f}" for c, r in pairs.items())


def api_over_direct(res) -> float:
    """The API's dense split call's host time over the kernel and combine launched directly,
    in one GPU run."""
    got = {r["metric"]: r["value"] for r in res.rows}
    return got["host_us dense num_splits=0"] / got["host_us kernel dense num_splits=0"]


@claim("lab13.decode_api_host_over_direct", "decode_host_gpu_before_memo",
       "on the GPU run without the memo, the API's dense split call took the host more than "
       "three times as long as the decode kernel and combine launched directly, and longer "
       "than those kernels take per call back to back", gpu="h100")
def _(res):
    got = {r["metric"]: r for r in res.rows}
    api = got["host_us dense num_splits=0"]["value"]
    direct = got["host_us kernel dense num_splits=0"]
    kernels = direct["gpu_us_per_call_back_to_back"]
    return (api > 3 * direct["value"] and api > kernels,
            f"API {api:.1f} us, direct {direct['value']:.1f} us, kernels {kernels:.1f} us")


@claim("lab13.memo_halves_api_over_direct", "decode_host_gpu",
       "the API's dense split call's host time over the direct launch's, each run against its "
       "own direct launch, is less than half with the memo what it is without it", gpu="h100")
def _(res):
    from utils import results

    before = results.load("decode_host_gpu_before_memo", gpu="h100")
    a, b = api_over_direct(res), api_over_direct(before)
    return a < 0.5 * b, f"with the memo {a:.2f}, before {b:.2f}"


@claim("lab13.memo_back_to_back_ahead", "decode_graph_repeated",
       "with the memo, the call back to back at batch 1 (one and 16 tokens, 1k and 8k keys) is "
       "ahead of every peer at all four shapes, beyond both rows' spreads", gpu="h100")
def _(res):
    ours = [r for r in res.rows if r.get("impl") == "fa4_final_splits"
            and r.get("mode") == "back_to_back" and r.get("ms")]
    out, ok = [], len(ours) == 4
    for r in ours:
        peer = next(p for p in res.rows if p.get("impl") == r["best_peer"]
                    and p.get("mode") == "back_to_back"
                    and all(p.get(k) == r[k] for k in ("b", "s_q", "s", "h", "h_kv", "d")))
        ok = ok and r["vs_best_peer"] - 1 > max(r["spread"], peer["spread"])
        out.append(f"t{r['s_q']} k{r['s']} {r['vs_best_peer']:.2f} vs {r['best_peer']}")
    return ok, "; ".join(out)


# ---------------------------------------------------------------------------------------------
# The combine launched early (Note [The combine launches early] in fa4_final.common.combine)


def early_launch_pairs(res) -> list[tuple]:
    """(tokens, keys, early row, ordinary row, cuDNN row) of the replayed batch-1 shapes with
    more than one split. A file has the early launch either as the default rows beside a
    ``fa4_final_decode_nopdl`` row, or as a ``fa4_final_decode_pdl`` row beside the default."""
    from solutions.ch15_decoding import decode_row

    graph = [r for r in res.rows if r.get("mode") == "graph" and r.get("b") == 1]
    names = {r["impl"] for r in graph}
    early, ordinary = (("fa4_final_decode", "fa4_final_decode_nopdl")
                       if "fa4_final_decode_nopdl" in names
                       else ("fa4_final_decode_pdl", "fa4_final_decode"))

    def row(impl, t, k):  # the timed graph row of impl at batch 1, or None
        r = decode_row(res, impl, "graph", b=1, s_q=t, s=k)
        return r if r and r.get("ms") else None

    out = []
    for t, k in sorted({(r["s_q"], r["s"]) for r in graph}):
        e, o, c = row(early, t, k), row(ordinary, t, k), row("sdpa_cudnn", t, k)
        if e and o and e.get("splits", 1) > 1:
            out.append((t, k, e, o, c))
    return out


def early_launch_lines(res) -> list[str]:
    if res is None:
        return ["(no stored run of the early launch)"]
    lines = ["replayed from a CUDA graph, batch 1, microseconds per step (spread):",
             f"  {'tokens':>6} {'keys':>7} {'early':>13} {'ordinary':>13} {'early/ord':>9} "
             f"{'cuDNN':>7}"]
    for t, k, e, o, c in early_launch_pairs(res):
        cud = f"{c['ms'] * 1e3:7.1f}" if c else "      -"
        lines.append(f"  {t:6d} {k:7d} {e['ms'] * 1e3:6.1f} ({100 * e['spread']:3.1f}%) "
                     f"{o['ms'] * 1e3:6.1f} ({100 * o['spread']:3.1f}%) "
                     f"{e['ms'] / o['ms']:9.3f} {cud}")
    return lines


def early_over_ordinary(res, tokens: int = 1, keys: int = 8192) -> float:
    return next(e["ms"] / o["ms"] for t, k, e, o, _c in early_launch_pairs(res)
                if (t, k) == (tokens, keys))


# ---------------------------------------------------------------------------------------------
# The combine's splits in flight (Note [Splits in flight] in fa4_final.common.combine)

UNROLL_ROWS = (("fa4_final_decode_c4", "4"), ("fa4_final_decode_c8", "8"),
               ("fa4_final_decode_c16", "16"), ("fa4_final_decode_c4p", "4 first"),
               ("fa4_final_decode_c16p", "16 first"))  # "first": loaded before the weights
UNROLL_LABELS = tuple(label for _impl, label in UNROLL_ROWS)


def combine_label(row) -> str:
    """The combine a row of measure.decode ran, as UNROLL_ROWS names it: from its unroll and
    prefetch fields; a row without them ran the recipe's default (4 a pass, nothing early)."""
    return f"{row.get('unroll', 4)}{' first' if row.get('prefetch') else ''}"


def combine_passes(timeline, num_sms: int = 132) -> list[tuple]:
    """(keys, splits, passes, combine us) of the one-token batch-1 steps in a stored timeline:
    the split count the call chooses on ``num_sms`` SMs (132: the H100 the timeline ran on) and
    the passes of the plain combine (UNROLL splits a pass, the one that timeline ran) over
    them."""
    from fa4_final.common.combine import UNROLL
    from fa4_final.runtime.decode_entry import _plan  # the call's own plan, remembered

    out = []
    for r in timeline.rows:
        if (r["impl"], r["s_q"], r.get("kernel"), r["metric"]) != (
                "fa4_final_splits", 1, 1, "duration_us"):
            continue
        splits, _args = _plan(r["d"], r["dtype"], r["h"], r["h_kv"], r["b"], 1, r["s"], r["s"],
                              False, False, r["causal"], False, False, 0, num_sms)
        out.append((r["s"], splits, -(-splits // UNROLL), r["value"]))
    return sorted(out)


def combine_pass_lines(timeline) -> list[str]:
    """The arithmetic of the latency hypothesis: what one more pass of the combine costs, and
    the combine it predicts at one pass for the key count with the most splits."""
    rows = combine_passes(timeline)
    lines = [f"  {k:6d} keys: {n:2d} splits, {p} pass(es) of the plain combine, {us:.2f} us"
             for k, n, p, us in rows]
    (_k0, _n0, p0, us0), (k1, _n1, p1, us1) = rows[0], rows[-1]
    if p1 > p0:
        per = (us1 - us0) / (p1 - p0)
        lines.append(f"  one more pass: {per:.2f} us; at {k1} keys in one pass the combine "
                     f"would take about {us1 - per * (p1 - 1):.2f} us (the hypothesis)")
    return lines


def unroll_groups(res) -> list[tuple]:
    """(tokens, keys, {label: graph row}, cuDNN row, the call's label) of the replayed batch-1
    shapes with more than one split: the combines that ran, labelled by combine_label (4, 8 or
    16 splits a pass; "first": the first pass loaded before the weights). The call's own row
    (fa4_final_decode) fills its label where no candidate row has it."""
    from solutions.ch15_decoding import decode_row

    graph = [r for r in res.rows if r.get("mode") == "graph" and r.get("b") == 1]
    out = []
    for t, k in sorted({(r["s_q"], r["s"]) for r in graph}):
        got = {}
        for impl, label in UNROLL_ROWS:
            r = decode_row(res, impl, "graph", b=1, s_q=t, s=k)
            if r and r.get("ms"):
                got[label] = r
        call = decode_row(res, "fa4_final_decode", "graph", b=1, s_q=t, s=k)
        if not (call and call.get("ms") and call.get("splits", 1) > 1):
            continue
        got.setdefault(combine_label(call), call)
        cudnn = decode_row(res, "sdpa_cudnn", "graph", b=1, s_q=t, s=k)
        out.append((t, k, got, cudnn if cudnn and cudnn.get("ms") else None,
                    combine_label(call)))
    return out


def unroll_lines(res) -> list[str]:
    if res is None:
        return ["(no stored run of the combine's candidates)"]
    lines = ["replayed from a CUDA graph, batch 1, microseconds per step (spread); splits a "
             "pass (* the call's combine in this run, + the package's choice):",
             f"  {'tokens':>6} {'keys':>7} {'splits':>6} "
             + " ".join(f"{u:>14}" for u in UNROLL_LABELS) + f" {'cuDNN':>13}"]
    for t, k, got, c, call in unroll_groups(res):
        splits = next(iter(got.values()))["splits"]
        chosen = choice_label(splits)
        cells = [_unroll_cell(got.get(u), ("*" if u == call else "")
                              + ("+" if u == chosen else "")) for u in UNROLL_LABELS]
        cud = f"{c['ms'] * 1e3:6.1f} ({100 * c['spread']:3.1f}%)" if c else f"{'-':>13}"
        lines.append(f"  {t:6d} {k:7d} {splits:6d} " + " ".join(cells) + f" {cud}")
    return lines


def _unroll_cell(row, mark: str) -> str:
    if row is None:
        return f"{'-':>14}"
    return f"{row['ms'] * 1e3:6.1f} ({100 * row['spread']:3.1f}%){mark:<2}"[-14:]


def choice_label(splits: int) -> str:
    """The package's combine for ``splits`` splits (combine_choice), as combine_label names it."""
    from fa4_final.common.combine import combine_choice

    unroll, prefetch = combine_choice(splits)
    return combine_label({"unroll": unroll, "prefetch": prefetch})


@claim("lab13.combine_choice_fastest", "decode_combine",
       "replayed at batch 1, the combine the package chooses for the split count gives the "
       "fastest step of the combines measured, or one within the spread of the fastest, at "
       "every shape", gpu="h100")
def _(res):
    notes, ok = [], True
    groups = unroll_groups(res)
    for t, k, got, _c, _call in groups:
        mine = got.get(choice_label(next(iter(got.values()))["splits"]))
        best = min(got.values(), key=lambda r: r["ms"])
        cmp_ = bench.compare(mine, best) if mine else None
        good = cmp_ is not None and (mine is best or cmp_.verdict != "slower")
        ok = ok and good
        notes.append(f"t{t} k{k} chosen against the fastest: {cmp_}")
    return ok and bool(groups), "; ".join(notes)


@claim("lab13.combine_one_pass_faster", "decode_timeline_combine",
       "kernel by kernel, one token with 8k keys, the combine with 16 splits a pass and the "
       "first pass loaded early takes less time than the plain combine, closing most of the "
       "difference to cuDNN's reduction kernel but not all of it", gpu="h100")
def _(res):
    d = {r["impl"]: r["value"] for r in res.rows
         if (r.get("kernel"), r["metric"], r["s_q"], r["s"]) == (1, "duration_us", 1, 8192)}
    early, plain, cudnn = (d.get(i) for i in ("fa4_final_decode_c16p", "fa4_final_decode",
                                              "sdpa_cudnn"))
    ok = None not in (early, plain, cudnn) and cudnn < early < plain and (
        plain - early > early - cudnn)
    return ok, f"8k keys, one token: early 16 {early} us, plain {plain} us, cuDNN {cudnn} us"


@claim("lab13.early_launch_no_gain", "decode_pdl",
       "replayed at batch 1 with 1k and 8k keys, the step with the combine launched early is "
       "within the spread of the ordinary launch at three of the four shapes and slower beyond "
       "it at 16 tokens with 8k keys", gpu="h100")
def _(res):
    pairs = [p for p in early_launch_pairs(res) if p[1] <= 8192]
    got = {(t, k): bench.compare(e, o) for t, k, e, o, _c in pairs}  # early against ordinary
    ok = len(pairs) == 4 and all(
        c.verdict == ("slower" if shape == (16, 8192) else "within noise")
        for shape, c in got.items())
    return ok, "; ".join(f"t{t} k{k} early {c}" for (t, k), c in got.items())
