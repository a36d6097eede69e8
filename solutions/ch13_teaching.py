"""Chapter 13's helpers: the package's refusals shown live, two exercises with their checkers,
and readers of the stored measurements (the full sweep, varlen, accuracy, memory, training).

Every reader takes a ``utils.results.Results`` (or None, when the file was never measured) and
derives what it prints from the rows: which implementation is fastest, whether a difference is
larger than the spread (``utils.bench.compare``), how far the loss curves drift. Nothing is
typed, so the text stays true when the files are measured again.
"""

from __future__ import annotations

import math
from collections import Counter

from utils import bench, plots
from utils.claims import claim

IMPL = "fa4_final"
PASSES = ("fwd", "bwd", "fwd+bwd")
SHAPE = ("pass", "dtype", "b", "s", "h", "d", "causal")


def is_ours(impl: str) -> bool:
    """fa4_final and its variants (deterministic, ...); everything else in a file is a peer."""
    return impl.startswith(IMPL)


# ---------------------------------------------------------------------------------------------
# 1. Refusals


def refusal(call) -> str:
    """What ``call()`` answers: 'accepted', or the error class and its message."""
    from fa4_final import UnsupportedError

    try:
        call()
    except (TypeError, ValueError, UnsupportedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


# ---------------------------------------------------------------------------------------------
# 2. Exercise 13.1: a check of head dims and head groups


def check_heads(q, k) -> tuple[int, int, int]:
    """(heads, heads_kv, head_dim) of q (..., heads, dim) and k (..., heads_kv, dim), or a
    ValueError that says what was given and what is accepted."""
    from fa4_final.config import HEAD_DIMS

    h, d = q.shape[-2:]
    hk, dk = k.shape[-2:]
    if dk != d:
        raise ValueError(f"q has head_dim {d} but k has head_dim {dk}: they must be equal")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {d}")
    if hk == 0 or h % hk:
        raise ValueError(f"q's {h} heads must be a multiple of k's {hk} heads (GQA/MQA)")
    return h, hk, d


def _meta(*shape):
    import torch

    return torch.empty(*shape, dtype=torch.bfloat16, device="meta")


def check_check_heads(fn) -> None:
    """Exercise 13.1: good shapes pass with the right triple; every bad one raises ValueError
    whose message names the value given and what is accepted."""
    good = [((2, 64, 8, 128), (2, 64, 8, 128), (8, 8, 128)),
            ((1, 33, 8, 64), (1, 70, 2, 64), (8, 2, 64)),
            ((1, 33, 6, 64), (1, 70, 1, 64), (6, 1, 64))]
    for qs, ks, want in good:
        try:
            got = fn(_meta(*qs), _meta(*ks))
        except ValueError as exc:
            raise AssertionError(f"q {qs}, k {ks} is a valid input, but you refused it: "
                                 f"{exc}") from None
        if tuple(got) != want:
            raise AssertionError(f"q {qs}, k {ks}: return (heads, heads_kv, head_dim) = {want}, "
                                 f"got {got}")
    bad = [((1, 16, 8, 96), (1, 16, 8, 96), ("96", "64", "128"), "an unsupported head_dim"),
           ((1, 16, 8, 128), (1, 16, 8, 64), ("128", "64"), "q and k with different head dims"),
           ((1, 16, 8, 64), (1, 16, 3, 64), ("8", "3"), "8 query heads over 3 k/v heads"),
           ((1, 16, 8, 64), (1, 16, 0, 64), ("0",), "k with no heads")]
    for qs, ks, named, what in bad:
        try:
            fn(_meta(*qs), _meta(*ks))
        except ValueError as exc:
            msg = str(exc)
            missing = [n for n in named if n not in msg]
            if missing:
                raise AssertionError(f"{what}: your message {msg!r} does not name {missing}: say "
                                     f"what was given and what is accepted") from None
        except ZeroDivisionError:
            raise AssertionError(f"{what}: you divided by zero heads; test heads_kv == 0 "
                                 f"before h % heads_kv") from None
        except Exception as exc:
            raise AssertionError(f"{what}: raise ValueError, not {type(exc).__name__}, so "
                                 f"callers can catch bad input") from None
        else:
            raise AssertionError(f"{what} (q {qs}, k {ks}) must be refused with a ValueError")


# ---------------------------------------------------------------------------------------------
# 3. Exercise 13.2: a compile-cache key


def example_call(**changes) -> dict:
    """One forward call as the cache sees it: what the kernel was compiled for and what varies
    from call to call."""
    from fa4_final.config import hopper_fwd_default

    call = {"dtype": "bf16", "head_dim": 128, "causal": False, "window_size": (None, None),
            "config": hopper_fwd_default(128, False), "batch": 4, "seqlen_q": 4096,
            "seqlen_k": 4096, "heads": 16, "heads_kv": 16, "softmax_scale": 128**-0.5,
            "device_index": 0, "q_address": 0x7F00_0000_0000}
    call.update(changes)
    return call


def kernel_key(call: dict) -> tuple:
    """What changes the compiled code: dtype, head dim, causal, which window sides are bounded
    (their sizes are runtime arguments), the tile configuration."""
    left, right = call["window_size"]
    return ("fwd", call["dtype"], call["head_dim"], call["causal"], left is not None,
            right is not None, call["config"])


def check_kernel_key(fn) -> None:
    """Exercise 13.2: the key is stable (plain values, hashable, no object address), equal for
    changes the compiled code does not depend on, different for those it does."""
    from dataclasses import replace

    from fa4_final.cache import entry_name

    base = example_call()
    key = fn(base)
    try:
        hash(key)
    except TypeError:
        raise AssertionError("the key must be hashable (a tuple of plain values), got "
                             f"{type(key).__name__}") from None
    if entry_name(key, "fingerprint") is None:
        raise AssertionError(f"the key's repr holds an object address ({key!r}): it differs in "
                             "every process, so the disk cache would always miss")
    if fn(example_call()) != key:
        raise AssertionError("two identical calls give different keys")
    same = {"batch": 1, "seqlen_q": 333, "seqlen_k": 9000, "heads": 32, "heads_kv": 4,
            "softmax_scale": 0.1, "device_index": 3, "q_address": 0x7F00_0000_4000}
    for name, value in same.items():
        if fn(example_call(**{name: value})) != key:
            raise AssertionError(f"changing {name} gave a new key, but the kernel takes {name} "
                                 "as a runtime argument: this miss recompiles for nothing")
    if fn(example_call(window_size=(128, None))) != fn(example_call(window_size=(512, None))):
        raise AssertionError("window sizes 128 and 512 gave different keys: the size is a "
                             "runtime argument, only whether a side is bounded is compiled in")
    cfg = base["config"]
    differ = {"dtype": "fp16", "head_dim": 64, "causal": True, "window_size": (128, None),
              "config": replace(cfg, tile_n=cfg.tile_n // 2)}
    for name, value in differ.items():
        if fn(example_call(**{name: value})) == key:
            raise AssertionError(f"changing {name} to {value!r} kept the key: the cache would "
                                 "return a kernel compiled for something else")
    if fn(example_call(window_size=(None, 64))) == fn(example_call(window_size=(64, None))):
        raise AssertionError("a bounded left side and a bounded right side gave the same key: "
                             "they compile different masks")


# ---------------------------------------------------------------------------------------------
# 4. The sweep: TFLOP/s against S, and the ratio to the best peer


def impls_of(res) -> list[str]:
    """Implementations in the file, ours first, then the peers in file order."""
    names = list(dict.fromkeys(r["impl"] for r in res.rows))
    return sorted(names, key=lambda n: not is_ours(n))


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
        _plain_ticks(ax, seqlens)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    _figure_label(fig, res.label)
    return fig


def _plain_ticks(ax, xs=None, logy=False) -> None:
    """Plain numbers on log axes (no mathtext powers, which need fonts a CPU image may lack)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if xs:
        ax.set_xticks(xs, [str(x) for x in xs], rotation=45 if len(xs) > 5 else 0, fontsize=8)
        ax.xaxis.set_minor_formatter(NullFormatter())
    if logy:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())


def _figure_label(fig, label: str) -> None:
    """Lay out the panels, then put the provenance under all of them (one line for the figure,
    outside the axes, so it does not squeeze them)."""
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.text(0.01, 0.01, label, fontsize=7, color="#555555")


def peer_comparisons(res, impl: str = IMPL, pass_: str | None = None) -> list[tuple]:
    """(row, best peer row, utils.bench.Comparison) for every timed shape of ``impl``."""
    out = []
    for row in res.rows:
        if row["impl"] != impl or not row.get("tflops") or pass_ not in (None, row["pass"]):
            continue
        peer = bench.best_peer(res.rows, row)
        cmp = bench.compare(row, peer) if peer else None
        if cmp is not None:
            out.append((row, peer, cmp))
    return out


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
        _plain_ticks(ax, sorted({r["s"] for r, _, _ in found}))
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
# 5. Headline comparisons (fa4_final_fwd, ch11_bwd)


def headline_lines(res, impl: str = IMPL) -> str:
    """Each shape of ``impl``: its TFLOP/s and spread, the best peer's, the ratio and verdict."""
    if res is None:
        return "not measured yet"
    lines = [f"[{res.name}] {res.label}",
             f"{'pass':5s} {'D':>4s} {'S':>6s} {'causal':>6s} {impl + ' TFLOP/s':>18s} "
             f"{'best peer':>22s}  ratio (verdict; larger spread)"]
    for row, peer, cmp in sorted(peer_comparisons(res, impl),
                                 key=lambda f: (f[0]["pass"], f[0]["d"], f[0]["s"],
                                                f[0]["causal"])):
        spread = bench.row_spread(row) or 0.0
        lines.append(f"{row['pass']:5s} {row['d']:>4d} {row['s']:>6d} {row['causal']!s:>6s} "
                     f"{row['tflops']:>10.0f} ±{spread:5.1%} "
                     f"{peer['impl']:>16s} {peer['tflops']:>5.0f}  {cmp}")
    lines.append(bench.spread_note([r for r in res.rows if r["impl"] == impl]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 6. Varlen, accuracy, memory (files that may not be measured yet)

_PER_RUN = {"impl", "ms", "tflops", "ms_min", "ms_rounds", "spread", "rounds", "reps",
            "sm_clock_mhz", "sm_clock_mhz_rounds", "power_w", "power_w_rounds", "clock_reasons",
            "sensors", "tflops_rounds", "best_peer", "best_peer_tflops", "vs_best_peer",
            "best_peer_spread", "error", "tflops_min", "tflops_max"}


def _case_keys(rows) -> list[str]:
    """The fields that describe a case (not a measurement), in the rows' order."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [k for k in keys if k not in _PER_RUN and not isinstance(rows[0].get(k), (list, dict))]


def _fmt(v) -> str:
    return "-" if v is None else str(v)


VARLEN_CASE = ("dtype", "b", "h", "d", "causal", "pass")
VARLEN_OURS = "fa4_final_varlen"  # the kernel over the packed batch, as FA4's call (no host sync)


def varlen_table(res) -> str:
    """One line per case of the varlen file (solutions.ch12_varlen_bench): the pass (forward,
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


VARLEN_ZIGZAG = "fa4_final_varlen_zigzag"  # the same kernel in its old fixed rounds (fwd only)


def varlen_schedule_lines(res) -> str:
    """Per forward case of the varlen file: the kernel taking its tiles at run time over the
    same kernel in fixed zigzag rounds (the same run), with the verdict of utils.bench.compare.
    Files from before the zigzag rows have none to show."""
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


ACCURACY_CASE = ("dtype", "b", "sq", "sk", "h", "h_kv", "d", "causal")
TENSORS = ("out", "dq", "dk", "dv")


def accuracy_table(res) -> str:
    """Largest absolute error against float64 per case, implementation and tensor; a refused
    or skipped case shows its reason."""
    if res is None:
        return "not measured yet"
    cases = list(dict.fromkeys(tuple(r.get(k) for k in ACCURACY_CASE) for r in res.rows))
    lines = [f"[{res.name}] {res.label}",
             f"{'case':44s} {'impl':14s}" + "".join(f"{t:>10s}" for t in TENSORS)]
    for case in cases:
        label = "b={} sq={} sk={} h={}/{} d={}{}".format(*case[1:7],
                                                          " causal" if case[7] else "")
        rows = [r for r in res.rows if tuple(r.get(k) for k in ACCURACY_CASE) == case]
        for impl in impls_of(res):
            mine = [r for r in rows if r["impl"] == impl]
            if not mine:
                continue
            err = next((r["error"] for r in mine if r.get("error")), None)
            if err:
                cells = f"  {err[:70]}"
            else:
                got = {r["tensor"]: r for r in mine}
                cells = "".join(
                    f"{got[t]['value']:>10.2e}" + ("" if got[t].get("finite", True) else "!")
                    if t in got and got[t].get("value") is not None else f"{'-':>10s}"
                    for t in TENSORS)
            lines.append(f"{label:44s} {impl:14s}{cells}")
    lines.append("! marks a tensor with a NaN or inf")
    return "\n".join(lines)


def accuracy_summary(res, impl: str = IMPL) -> str:
    """Per tensor: the largest ratio of ``impl``'s error to the smallest peer error on the same
    case, and whether every value ``impl`` returned was finite."""
    if res is None:
        return "not measured yet"
    lines = []
    for t in TENSORS:
        ratios, finite = [], True
        for r in res.rows:
            if r["impl"] != impl or r.get("tensor") != t or r.get("value") is None:
                continue
            finite &= bool(r.get("finite", True))
            case = tuple(r.get(k) for k in ACCURACY_CASE)
            peers = [p["value"] for p in res.rows if not is_ours(p["impl"])
                     and p.get("tensor") == t and p.get("value") is not None
                     and tuple(p.get(k) for k in ACCURACY_CASE) == case]
            if peers and min(peers) > 0:
                ratios.append(r["value"] / min(peers))
        if ratios:
            lines.append(f"{t}: {impl}'s error is at most {max(ratios):.2f}x the most accurate "
                         f"peer's (over {len(ratios)} cases); all finite: {finite}")
    return "\n".join(lines) or f"no {impl} rows with a peer to compare"


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
# 7. The training comparison (results/h200/fa4_final_training.json, solutions/ch12_training.py)


def training_losses(res) -> dict[str, list[float]]:
    return {r["impl"]: r["losses"] for r in res.rows if r.get("losses")}


def plot_training(res, window: int | None = None):
    """Loss curves smoothed over ``window`` steps (the file's own window by default), one line
    per implementation, log scale."""
    import matplotlib.pyplot as plt

    from solutions.ch12_training import smooth

    losses = training_losses(res)
    window = window or next(r["window"] for r in res.rows if r.get("window"))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for impl, ls in losses.items():
        xs = [i * window + window / 2 for i in range(len(smooth(ls, window)))]
        ax.plot(xs, smooth(ls, window), marker="o", ms=3, label=impl, color=plots.color_for(impl))
    ax.set_yscale("log")
    _plain_ticks(ax, logy=True)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"loss (nats), mean over {window} steps")
    ax.set_title("a small GPT learning to reverse a sequence")
    ax.legend(fontsize=8)
    plots.label_provenance(ax, res.label)
    fig.tight_layout()
    return fig


def training_summary(res, impl: str = IMPL, baseline: str = "sdpa_flash") -> str:
    """The loss gap against the allowed band, and each implementation's step time over the
    baseline's."""
    lines = []
    gap = next((r for r in res.rows if r.get("metric") == f"max_loss_gap_vs_{baseline}"), None)
    if gap:
        lines.append(f"largest gap of the smoothed curves, {impl} vs {baseline}: "
                     f"{gap['value']:.2e} nats; allowed {gap['allowed']:.2e} (twice the drift "
                     f"between SDPA's two kernels, {gap['drift_efficient_vs_flash']:.2e}, plus "
                     f"a floor); within the band: {gap['ok']}")
    steps = {r["impl"]: r["value"] for r in res.rows if r.get("metric") == "step_ms"}
    base = steps.get(baseline)
    for n, ms in steps.items():
        rel = f", {base / ms:.2f}x the speed of {baseline}" if base and n != baseline else ""
        lines.append(f"{n:16s} {ms:6.2f} ms per training step{rel}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the host's cost per call (solutions/ch12_host.py)


def _us(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _host_shape(r) -> str:
    return f"{r['pass']} b={r['b']} S={r['s']} D={r['d']}{' causal' if r['causal'] else ''}"


def _host_value(res, variant: str, metric: str, impl: str = IMPL):
    row = next((r for r in res.rows if r.get("variant") == variant and r["metric"] == metric
                and r["impl"] == impl), None)
    return None if row is None else row["value"]


def host_table(res) -> str:
    """Host microseconds per call of each stored variant (``--profile``, kernels as no-ops),
    the checks and launches per call, and the floor: a Python autograd op that only allocates."""
    if res is None:
        return "not measured yet"
    variants = list(dict.fromkeys(r["variant"] for r in res.rows))
    lines = [res.label, "setup: " + res.rows[0]["setup"], "",
             f"{'':22s} {'fwd us':>8s} {'fwd+bwd us':>11s} {'checks/call':>12s} "
             f"{'launches/call':>14s}"]
    for v in variants:
        fwd, both = _host_value(res, v, "host_us fwd"), _host_value(res, v, "host_us fwd+bwd")
        checks = _host_value(res, v, "check_inputs per call fwd+bwd")
        launches = _host_value(res, v, "kernel launches per call fwd+bwd")
        commit = next(r["fa4_final_commit"] for r in res.rows if r["variant"] == v)
        lines.append(f"{IMPL + ' ' + v:22s} {fwd:8.1f} {both:11.1f} {checks:12g} "
                     f"{launches:14g}   (fa4_final of {str(commit)[:10]})")
    floor = _host_value(res, variants[-1], "host_us fwd+bwd", impl="floor")
    if floor is not None:
        lines.append(f"{'floor (a bare Function)':22s} {'':8s} {floor:11.1f}")
    if len(variants) >= 2:
        a, b = variants[0], variants[-1]
        for metric in ("host_us fwd", "host_us fwd+bwd"):
            ratio = _host_value(res, a, metric) / _host_value(res, b, metric)
            lines.append(f"{metric.split()[1]}: {ratio:.1f}x less host time per call ({b} vs "
                         f"{a})")
    return "\n".join(lines)


def host_parts(res, pass_: str = "fwd+bwd") -> str:
    """Where a call's host time goes, per variant side by side (cProfile shares, scaled)."""
    if res is None:
        return "not measured yet"
    variants = list(dict.fromkeys(r["variant"] for r in res.rows))
    parts = {}
    for r in res.rows:
        if r["metric"] == f"host_us {pass_} by part":
            parts.setdefault(r["part"], {})[r["variant"]] = r["value"]
    head = f"{'host us per ' + pass_ + ' call, by part':66s}" + "".join(f"{v:>9s}"
                                                                      for v in variants)
    lines = [head]
    for part, by in sorted(parts.items(), key=lambda kv: -max(kv[1].values())):
        lines.append(f"{part:66s}" + "".join(f"{_us(by.get(v)):>9s}" for v in variants))
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


# ----------------------------------------------------------------------------------------------
# Where fa4_final and the FA4 package (4.0.0b36) differ on purpose. Everything else a call
# accepts means what it means in FA4; measure/conformance.py holds the two side by side.

FA4_DIFFERENCES = [
    ("lse when an input requires grad but return_lse=False",
     "returned on the autograd graph; its gradient is dropped without a sign",
     "returned detached (requires_grad False): a loss that uses it shows the missing gradient",
     "a silently dropped gradient is a wrong answer"),
    ("arguments after q, k, v given by position",
     "taken: the 4th is qv (FlashAttention-2's is dropout_p, or cu_seqlens_q for varlen)",
     "refused with a TypeError that says to name them",
     "the same positional call means different things in FA2 and FA4"),
    ("inputs whose strides TMA cannot read",
     "copied into contiguous tensors first (an extra copy per call)",
     "refused, saying which stride and how to fix it (.contiguous())",
     "a hidden copy per call costs time and memory the caller does not see"),
    ("softmax_scale <= 0, NaN or infinite",
     "used as given",
     "refused, naming the value",
     "no attention layer means it; it is a bug upstream"),
    ("cu_seqlens not starting at 0, decreasing, or not ending at the row count; max_seqlen "
     "below the longest sequence; seqused_k above a sequence's keys",
     "trusted",
     "refused, naming the entry (one host copy of the offsets per call)",
     "a wrong offset reads another sequence's rows: a wrong answer, not an error"),
    ("varlen with seqused_k: dk and dv of the keys past seqused_k (keys the output never "
     "saw)",
     "left unwritten: whatever the fresh tensor held (NaN or garbage in the conformance run)",
     "written as 0, their true gradient",
     "a gradient that is not written is a wrong answer the optimizer then applies"),
    ("num_splits, pack_gqa",
     "change how the kernel runs",
     "accepted and ignored",
     "they never change the result"),
    ("softcap, learnable_sink, qv, score_mod, mask_mod, page_table, seqused_q, dv != d, head "
     "dims other than 64 and 128",
     "computed",
     "refused with UnsupportedError naming the argument and what runs (accepted at the value "
     "that means 'not used')",
     "not implemented here: an error is the only honest answer"),
]


def differences_table() -> str:
    """FA4_DIFFERENCES as a markdown table."""
    rows = ["| call | FA4 4.0.0b36 | fa4_final | why |", "|---|---|---|---|"]
    rows += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in FA4_DIFFERENCES]
    return "\n".join(rows)


def conformance_lines(res) -> str:
    """The stored conformance run (measure/conformance.py) in a few lines: verdict counts, what
    the FA4 package did with the same calls, and each kind of refusal."""
    if res is None:
        return "conformance: not measured yet"
    return f"[{res.name}] {res.label}\n{conformance_summary(res.rows)}"


def conformance_summary(rows: list[dict]) -> str:
    """Verdict counts of a conformance run, the FA4 package's outcomes, each kind of refusal."""
    from collections import Counter

    counts = Counter(r["verdict"] for r in rows)
    fa4 = Counter(r.get("fa4", {}).get("status", "absent") for r in rows)
    fa4_wrong = sum(1 for r in rows if r.get("fa4", {}).get("status") == "ran"
                    and not r["fa4"]["passed"])
    lines = [f"{len(rows)} cases: " + ", ".join(f"{k} {counts[k]}" for k in
                                                ("agree", "ok", "refused", "MISMATCH")),
             f"FA4 package: ran {fa4['ran']} (failed the rule {fa4_wrong}), refused "
             f"{fa4['refused']}, errors {fa4['error']}, absent {fa4['absent']}"]
    refusals = Counter(r["fa4_final"]["error"].split(":")[0] + ": " +
                       r["fa4_final"]["error"].split(":", 1)[1][:90]
                       for r in rows if r["verdict"] == "refused")
    lines += [f"  fa4_final refused ({n}): {msg}" for msg, n in refusals.most_common()]
    return "\n".join(lines)


@claim("13.fa4_seqused_grads", "conformance_fa4",
       "where the FA4 package fails the rule, it is varlen with seqused_k and only dk and dv "
       "(the keys past seqused_k left unwritten); fa4_final passes every case")
def _(res):
    theirs = [r for r in res.rows if r.get("fa4", {}).get("status") == "ran"
              and not r["fa4"]["passed"]]
    layouts = {r["case"]["layout"] for r in theirs}
    tensors = {part.strip().split(":")[0] for r in theirs for part in r["fa4"]["why"].split(";")}
    ours_ok = all(r["verdict"] in ("agree", "ok") for r in res.rows)
    ok = ours_ok and layouts <= {"varlen_used"} and tensors <= {"dk", "dv"}
    return ok, (f"FA4 fails {len(theirs)} cases, layouts {sorted(layouts)}, tensors "
                f"{sorted(tensors)}; fa4_final passes all {len(res.rows)}: {ours_ok}")
