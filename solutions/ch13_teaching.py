"""Chapter 13's helpers: the package's refusals shown live, the exercises 13.1 (a check of a new
keyword) and 13.2 (a compile-cache key) with their checkers, and readers of the stored files the
chapter reads: the compile times, the headline shapes of the sweep, accuracy against float64, the
training run, the conformance run. The device-code exercises 13.3 and 13.4 live in
solutions/ch13_scores.py; the lab's readers (the whole sweep, varlen, memory, host cost) in
labs/package_sweeps_and_host_cost_helpers.py.

Every reader takes a ``utils.results.Results`` (or None, when the file was never measured) and
derives what it prints from the rows: which implementation is fastest, whether a difference is
larger than the spread (``utils.bench.compare``), how far the loss curves drift. Nothing is
typed, so the text stays true when the files are measured again.
"""

from __future__ import annotations

import numbers

from utils import bench, plots
from utils.claims import claim

IMPL = "fa4_final"
PASSES = ("fwd", "bwd", "fwd+bwd")
SHAPE = ("pass", "dtype", "b", "s", "h", "d", "causal")
SWEEP = "package_sweep"  # measure/package_sweep.py --sweep
HEADLINE_SEQLENS = (4096, 16384)


def is_ours(impl: str) -> bool:
    """fa4_final and its variants (deterministic, ...); everything else in a file is a peer."""
    return impl.startswith(IMPL)


# ---------------------------------------------------------------------------------------------
# Reading the package where its pieces live


def api_module():
    """The module that defines fa4_final's public functions (its docstring is the API's)."""
    import inspect

    import fa4_final

    return inspect.getmodule(fa4_final.flash_attn_func)


def note(title: str, end: str = '"""') -> str:
    """The text of ``Note [title]`` from fa4_final's sources, up to the first later line that
    holds ``end``: found by its title wherever the note lives in the package."""
    from pathlib import Path

    import fa4_final

    root = Path(fa4_final.__file__).parent
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().lstrip("# ") == f"Note [{title}]":
                stop = next((j for j in range(i + 1, len(lines)) if end in lines[j]),
                            len(lines))
                return "\n".join(lines[i:stop])
    return f"(Note [{title}] not found in fa4_final)"


# ---------------------------------------------------------------------------------------------
# Behind PyTorch's SDPA: FA4's private contract (fa4_final.api.sdpa, Note [SDPA registration])

# What torch 2.13's SDPA glue passes to ``_flash_attn_fwd`` after q, k, v for a causal call of
# (batch, 8, heads, dim) tensors (recorded from the wheel: tests/data/sdpa_torch_keywords.json)
SDPA_FWD_KEYWORDS = {"softmax_scale": None, "causal": True, "window_size_left": None,
                     "window_size_right": None, "return_lse": True, "cu_seqlens_q": None,
                     "cu_seqlens_k": None, "max_seqlen_q": 8, "max_seqlen_k": 8,
                     "seqused_k": None, "page_table": None, "num_splits": 1, "out": "Tensor"}


def sdpa_contract() -> str:
    """fa4_final.api.sdpa against the contract: torch's keywords bind to ``_flash_attn_fwd``;
    each of FA4's parameters of both functions is run, ignored as a kernel knob (how FA4 runs,
    never what it returns), or refused unless it has the value that switches it off."""
    import inspect
    import textwrap

    from fa4_final.api import sdpa

    fwd = inspect.signature(sdpa._flash_attn_fwd)
    bound = fwd.bind("q", "k", "v", **SDPA_FWD_KEYWORDS)
    lines = [f"torch's call binds: {len(bound.arguments)} of _flash_attn_fwd's "
             f"{len(fwd.parameters)} parameters set"]
    for fn, run in ((sdpa._flash_attn_fwd, sdpa.SUPPORTED_FWD),
                    (sdpa._flash_attn_bwd, sdpa.SUPPORTED_BWD)):
        names = list(inspect.signature(fn).parameters)
        groups = (("run", [n for n in names if n in run]),
                  ("kernel knobs, ignored", [n for n in names if n in sdpa._FA4_KNOBS]),
                  ("refused unless off", [n for n in names
                                          if n not in run and n not in sdpa._FA4_KNOBS]))
        lines.append(f"{fn.__name__}: {len(names)} parameters, FA4's names, order and defaults")
        for what, group in groups:
            lines += textwrap.wrap(f"{what} ({len(group)}): {', '.join(group)}", 96,
                                   initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Refusals


def refusal(call) -> str:
    """What ``call()`` answers: 'accepted', or the error class and its message."""
    from fa4_final import UnsupportedError

    try:
        call()
    except (TypeError, ValueError, UnsupportedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


# ---------------------------------------------------------------------------------------------
# Exercise 13.1: the check of a new keyword, sink_tokens


def check_sink_tokens(sink_tokens, window_size=None, causal=False) -> int:
    """How many leading keys every query row also sees (attention sinks), checked: an int >= 0
    (a bool is not a count), and more than 0 only with a bounded left side of the window, read
    as FA4 reads ``window_size`` (None: unbounded; both sides negative: no window at all)."""
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, numbers.Integral):
        raise TypeError(f"sink_tokens must be an int >= 0, got {sink_tokens!r} "
                        f"({type(sink_tokens).__name__})")
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens}")
    left, right = (None, None) if window_size is None else window_size
    if left is not None and right is not None and left < 0 and right < 0:
        left = None  # FA4: two negative sides mean no window
    if sink_tokens > 0 and left is None:
        raise ValueError(f"sink_tokens={sink_tokens} keeps keys the window's left side would "
                         f"drop, but window_size={window_size!r} has no left side: every key "
                         f"left of the diagonal is visible already. Give window_size=(left, "
                         f"right) with a left bound, or sink_tokens=0")
    return int(sink_tokens)


# (sink_tokens, window_size, causal, what it is) the check must accept, with the count it returns
_SINKS_ACCEPTED = [
    (4, (128, 0), False, "4 sinks with a sliding window of 128 keys to the left"),
    (0, None, False, "no sinks and no window"),
    (0, (-1, -1), False, "no sinks, window (-1, -1) (no window)"),
    (3, (-3, 10), False, "3 sinks with window (-3, 10): a negative left side is a bound too"),
    (2, (0, None), True, "2 sinks, causal, window (0, None)"),
    (7, (100, None), True, "7 sinks, causal, a left side of 100"),
]
# (sink_tokens, window_size, causal, words the message must hold, what is wrong)
_SINKS_REFUSED = [
    (True, (64, 0), False, ("True",), "sink_tokens=True (a bool is not a count)"),
    (2.0, (64, 0), False, ("2.0",), "sink_tokens=2.0 (a float)"),
    ("4", (64, 0), False, ("'4'",), "sink_tokens='4' (a string)"),
    (-1, (64, 0), False, ("-1", "0"), "sink_tokens=-1"),
    (4, None, False, ("4", "left"), "4 sinks with window_size=None (no left side)"),
    (4, (None, 0), False, ("4", "left"), "4 sinks with window (None, 0): causal, no left side"),
    (4, (-1, -1), False, ("4", "left"), "4 sinks with window (-1, -1): two negative sides are "
                                        "no window"),
    (2, (-5, -1), True, ("2", "left"), "2 sinks with window (-5, -1), causal: still no window"),
]


def check_check_sink(fn) -> None:
    """Exercise 13.1: counts pass and come back as ints; every bad value is refused with a
    ValueError or TypeError whose message names the value given and what is accepted."""
    for sinks, window, causal, what in _SINKS_ACCEPTED:
        try:
            got = fn(sinks, window, causal)
        except (ValueError, TypeError) as exc:
            raise AssertionError(f"{what} is a valid call, but you refused it: {exc}") from None
        if type(got) is not int or got != sinks:
            raise AssertionError(f"{what}: return the count as an int, {sinks}; got {got!r}")
    for sinks, window, causal, named, what in _SINKS_REFUSED:
        try:
            got = fn(sinks, window, causal)
        except (ValueError, TypeError) as exc:
            msg = str(exc)
            missing = [n for n in named if n not in msg]
            if missing:
                raise AssertionError(f"{what}: your message {msg!r} does not name {missing}: "
                                     f"say what was given and what is accepted") from None
        except Exception as exc:
            raise AssertionError(f"{what}: raise ValueError or TypeError, not "
                                 f"{type(exc).__name__}, so callers can catch bad input") from None
        else:
            raise AssertionError(f"{what} must be refused, but you returned {got!r}")
    import numpy as np

    try:
        got = fn(np.int64(5), (64, 64), False)
    except (ValueError, TypeError) as exc:
        raise AssertionError(f"numpy's int64(5) is a count too (a numbers.Integral, not an "
                             f"int): you refused it: {exc}") from None
    if type(got) is not int or got != 5:
        raise AssertionError(f"numpy's int64(5) is a count too: return it as the int 5, got "
                             f"{got!r}")


def package_window_reader():
    """fa4_final's own reader of ``causal`` and ``window_size`` (runtime.checks)."""
    from fa4_final.runtime.checks import normalise_window

    return normalise_window


def _sink_forbid() -> dict:
    from utils.window import fa4_sides

    why = "read the window's sides yourself: the rule that only two negative sides mean no " \
          "window is the exercise"
    return {fa4_sides: why, package_window_reader(): why}


SINK_CHECK_FORBID = _sink_forbid()


# ---------------------------------------------------------------------------------------------
# Exercise 13.2: a compile-cache key


def example_call(**changes) -> dict:
    """One forward call as the cache sees it: what the kernel was compiled for and what varies
    from call to call."""
    from fa4_final.hopper.config import hopper_fwd_default

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

    from fa4_final.runtime.cache import entry_name

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
              "config": replace(cfg, stages_k=cfg.stages_k + 1)}
    for name, value in differ.items():
        if fn(example_call(**{name: value})) == key:
            raise AssertionError(f"changing {name} to {value!r} kept the key: the cache would "
                                 "return a kernel compiled for something else")
    if fn(example_call(window_size=(None, 64))) == fn(example_call(window_size=(64, None))):
        raise AssertionError("a bounded left side and a bounded right side gave the same key: "
                             "they compile different masks")


# ---------------------------------------------------------------------------------------------
# The compile cache's cost (results/cpu/compile_times.json, measure/compile_times.py)

COMPILE_METRICS = ("cold_first_call_s", "dsl_compile_s", "export_s", "warm_first_call_s",
                   "disk_load_s", "memory_hit_us", "import_s")


def compile_times_table(rows: list[dict]) -> str:
    """One line per (head dim, dtype, causal): the median of each metric over fresh processes."""
    head = f"{'case':18s}" + "".join(f"{m:>19s}" for m in COMPILE_METRICS)
    lines = [head]
    for case in sorted({(r["d"], r["dtype"], r["causal"]) for r in rows}):
        got = {r["metric"]: r["value"] for r in rows if (r["d"], r["dtype"], r["causal"]) == case}
        label = f"D={case[0]} {case[1]}{' causal' if case[2] else ''}"
        lines.append(f"{label:18s}" + "".join(f"{got[m]:19.4g}" for m in COMPILE_METRICS))
    return "\n".join(lines)


def warm_over_cold(rows: list[dict]) -> dict:
    """(head dim, causal) -> the warm first call's time as a fraction of the cold one's."""
    out = {}
    for d, causal in sorted({(r["d"], r["causal"]) for r in rows}):
        got = {r["metric"]: r["value"] for r in rows if (r["d"], r["causal"]) == (d, causal)}
        out[(d, causal)] = got["warm_first_call_s"] / got["cold_first_call_s"]
    return out


def impls_of(res) -> list[str]:
    """Implementations in the file, ours first, then the peers in file order."""
    names = list(dict.fromkeys(r["impl"] for r in res.rows))
    return sorted(names, key=lambda n: not is_ours(n))



def plain_ticks(ax, xs=None, logy=False) -> None:
    """Plain numbers on log axes (no mathtext powers, which need fonts a CPU image may lack)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if xs:
        ax.set_xticks(xs, [str(x) for x in xs], rotation=45 if len(xs) > 5 else 0, fontsize=8)
        ax.xaxis.set_minor_formatter(NullFormatter())
    if logy:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())



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


# ---------------------------------------------------------------------------------------------
# Where the package stands: the sweep's headline shapes (measure/package_sweep.py --sweep)


def headline_rows(res, seqlens=HEADLINE_SEQLENS) -> list[tuple]:
    """(row, best peer row, Comparison) of fa4_final at the headline lengths, every pass."""
    return sorted((f for f in peer_comparisons(res) if f[0]["s"] in seqlens),
                  key=lambda f: (PASSES.index(f[0]["pass"]), f[0]["d"], f[0]["s"],
                                 f[0]["causal"]))


def headline_lines(res, seqlens=HEADLINE_SEQLENS) -> str:
    """Each headline shape of fa4_final: its TFLOP/s and spread, the best peer's, the ratio and
    the verdict (within noise when the ratio is inside the larger spread)."""
    if res is None:
        return "not measured yet"
    lines = [f"[{res.name}] {res.label}",
             f"{'pass':8s} {'D':>4s} {'S':>6s} {'causal':>6s} {IMPL + ' TFLOP/s':>18s} "
             f"{'best peer':>22s}  ratio (verdict; larger spread)"]
    for row, peer, cmp in headline_rows(res, seqlens):
        spread = bench.row_spread(row) or 0.0
        lines.append(f"{row['pass']:8s} {row['d']:>4d} {row['s']:>6d} {row['causal']!s:>6s} "
                     f"{row['tflops']:>10.0f} ±{spread:5.1%} "
                     f"{peer['impl']:>16s} {peer['tflops']:>5.0f}  {cmp}")
    return "\n".join(lines)


def headline_verdicts(res, seqlens=HEADLINE_SEQLENS) -> str:
    """Per pass: at how many headline shapes fa4_final is faster, within noise or slower than
    the best peer, and the geometric mean of the ratios."""
    from collections import Counter

    lines = []
    for pass_ in PASSES:
        found = [f for f in headline_rows(res, seqlens) if f[0]["pass"] == pass_]
        if not found:
            continue
        n = Counter(c.verdict for _, _, c in found)
        gm = bench.geomean([c.ratio for _, _, c in found])
        lines.append(f"{pass_:8s} {len(found)} shapes: faster at {n['faster']}, within noise "
                     f"at {n['within noise']}, slower at {n['slower']}; geometric mean "
                     f"{gm:.2f}x the best peer")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Accuracy against float64 (measure/package_sweep.py --accuracy)


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


# ---------------------------------------------------------------------------------------------
# The training run (results/h200/fa4_final_training.json, measure/package_training.py)


def training_losses(res) -> dict[str, list[float]]:
    return {r["impl"]: r["losses"] for r in res.rows if r.get("losses")}


def plot_training(res, window: int | None = None):
    """Loss curves smoothed over ``window`` steps (the file's own window by default), one line
    per implementation, log scale."""
    import matplotlib.pyplot as plt

    from solutions.ch13_training import smooth

    losses = training_losses(res)
    window = window or next(r["window"] for r in res.rows if r.get("window"))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for impl, ls in losses.items():
        xs = [i * window + window / 2 for i in range(len(smooth(ls, window)))]
        ax.plot(xs, smooth(ls, window), marker="o", ms=3, label=impl, color=plots.color_for(impl))
    ax.set_yscale("log")
    plain_ticks(ax, logy=True)
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


# ---------------------------------------------------------------------------------------------
# Numbers the chapter's predictions are revealed against


def headline_ratio(res, pass_: str = "fwd+bwd", d: int = 128, s: int = 16384,
                   causal: bool = False) -> float:
    """fa4_final's TFLOP/s over the best peer's at one shape of the sweep."""
    row, peer, _ = next(f for f in headline_rows(res, (s,)) if f[0]["pass"] == pass_
                        and f[0]["d"] == d and f[0]["causal"] == causal)
    return row["tflops"] / peer["tflops"]


def accuracy_ratios(res, impl: str = IMPL) -> list[float]:
    """fa4_final's error over the most accurate peer's, per (case, tensor) with a peer."""
    out = []
    for r in res.rows:
        if r["impl"] != impl or r.get("value") is None:
            continue
        case = tuple(r.get(k) for k in ACCURACY_CASE)
        peers = [p["value"] for p in res.rows if not is_ours(p["impl"])
                 and p.get("tensor") == r["tensor"] and p.get("value") is not None
                 and tuple(p.get(k) for k in ACCURACY_CASE) == case]
        if peers and min(peers) > 0:
            out.append(r["value"] / min(peers))
    return out


def training_gap(res) -> dict:
    return next(r for r in res.rows if r.get("metric") == "max_loss_gap_vs_sdpa_flash")


def plot_sink_mask(sq: int = 48, sk: int = 48, window_size=(12, 0), sink: int = 4):
    """Which keys each query row sees: the window alone, and the window with sinks."""
    import matplotlib.pyplot as plt

    from solutions.ch13_scores import sink_visible

    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), sharey=True)
    for ax, n, title in ((axes[0], 0, f"window_size={window_size}"),
                         (axes[1], sink, f"window_size={window_size}, {sink} sink tokens")):
        ax.imshow(sink_visible(sq, sk, False, window_size, n), cmap="Greys", vmin=0, vmax=1.6,
                  interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key j")
    axes[0].set_ylabel("query row i")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# Claims the chapter's prose makes (tests/test_claims.py checks them on the stored files)


@claim("13.headline_nine_tenths", SWEEP,
       "at every headline shape (D 64 and 128, S 4096 and 16384, causal or not) of every pass, "
       "fa4_final reaches at least nine tenths of the best peer's TFLOP/s")
def _(res):
    found = headline_rows(res)
    worst = min(found, key=lambda f: f[2].ratio)
    return (len(found) == 24 and worst[2].ratio >= 0.9,
            f"{len(found)} shapes; lowest {worst[2].ratio:.2f} ({worst[0]['pass']} "
            f"D={worst[0]['d']} S={worst[0]['s']} causal={worst[0]['causal']})")


@claim("13.headline_best_peer_is_fa4", SWEEP,
       "at every headline shape of every pass, the fastest peer is the FA4 package")
def _(res):
    peers = {f[1]["impl"] for f in headline_rows(res)}
    return peers == {"fa4_package"}, f"fastest peers at the headline shapes: {sorted(peers)}"


@claim("13.fwd_bwd_mostly_within_noise", SWEEP,
       "for forward + backward, fa4_final and the best peer are within noise at more than half "
       "of the headline shapes")
def _(res):
    found = [f for f in headline_rows(res) if f[0]["pass"] == "fwd+bwd"]
    n = sum(1 for _, _, c in found if c.verdict == "within noise")
    return n > len(found) / 2, f"within noise at {n} of {len(found)} fwd+bwd shapes"


@claim("13.accuracy_like_peers", "package_accuracy",
       "fa4_final's largest error against float64 is at most 1.5 times the most accurate "
       "peer's for every case and tensor (out, dq, dk, dv), and every value is finite")
def _(res):
    ratios = accuracy_ratios(res)
    finite = all(r.get("finite", True) for r in res.rows if r["impl"] == IMPL)
    return (bool(ratios) and max(ratios) <= 1.5 and finite,
            f"{len(ratios)} comparisons, largest ratio {max(ratios):.2f}, all finite {finite}")


@claim("13.training_within_band", "fa4_final_training",
       "the smoothed loss curves of fa4_final and SDPA's flash kernel stay within the band set "
       "by the drift between SDPA's two kernels (Note [How close two loss curves must be])")
def _(res):
    gap = training_gap(res)
    return bool(gap["ok"]), f"gap {gap['value']:.2e} nats, allowed {gap['allowed']:.2e}"


@claim("13.training_steps_close", "fa4_final_training",
       "the median training-step times of fa4_final and the SDPA kernels lie within a tenth of "
       "each other")
def _(res):
    steps = {r["impl"]: r["value"] for r in res.rows if r.get("metric") == "step_ms"}
    spread = max(steps.values()) / min(steps.values())
    return spread <= 1.1, f"step times {steps}: largest over smallest {spread:.3f}"
