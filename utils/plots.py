"""Plots with one shared look: benchmark curves, bar charts, stored results.

Every figure that shows measured numbers takes a ``Results`` object (utils/results.py) and puts
its provenance label under the axes, so a figure cannot lose where its numbers came from.
"""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt

# One colour per implementation family, reused in every chapter.
PALETTE = {
    "course": "#1f77b4",
    "naive": "#8c564b",
    "tiled_fa2": "#e377c2",
    "flash_ampere": "#17becf",
    "flash_hopper": "#1f77b4",
    "sdpa_flash": "#7f7f7f",
    "sdpa_cudnn": "#2ca02c",
    "sdpa_efficient": "#bcbd22",
    "sdpa_math": "#c7c7c7",
    "fa4_package": "#d62728",
    "mma": "#1f77b4",
    "exp": "#ff7f0e",
    "smem": "#9467bd",
}
_CYCLE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def use_course_style() -> None:
    matplotlib.rcParams.update({
        "figure.figsize": (7.5, 4.0),
        "figure.dpi": 100,
        "axes.grid": True,
        "grid.alpha": 0.3,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.titlesize": 12,
        "axes.titleweight": "bold",
        "axes.prop_cycle": matplotlib.cycler(color=_CYCLE),
        "legend.frameon": False,
        "font.size": 10,
    })


def color_for(name: str) -> str:
    if name in PALETTE:
        return PALETTE[name]
    return _CYCLE[sum(map(ord, name)) % len(_CYCLE)]


def label_provenance(ax, label: str) -> None:
    ax.annotate(label, xy=(0, 0), xycoords="axes fraction", xytext=(0, -34),
                textcoords="offset points", fontsize=7, color="#555555", va="top")


def bar_chart(labels, values, title="", ylabel="", colors=None, ax=None, annotate=True,
              provenance: str | None = None):
    """A labelled bar chart; returns the axes."""
    if ax is None:
        _, ax = plt.subplots()
    colors = colors or [color_for(str(lbl)) for lbl in labels]
    bars = ax.bar([str(lbl) for lbl in labels], values, color=colors)
    if annotate:
        for bar, v in zip(bars, values):
            if v is not None:
                ax.annotate(f"{v:.0f}" if abs(v) >= 10 else f"{v:.2g}",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", rotation=20)
    if provenance:
        label_provenance(ax, provenance)
    return ax


def grouped_bars(groups, series: dict[str, list], title="", ylabel="", ax=None,
                 provenance: str | None = None):
    """Bars grouped by ``groups`` (x labels), one colour per key of ``series``."""
    if ax is None:
        _, ax = plt.subplots()
    n = len(series)
    width = 0.8 / max(n, 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=name,
               color=color_for(name))
    ax.set_xticks(range(len(groups)), [str(g) for g in groups])
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    if provenance:
        label_provenance(ax, provenance)
    return ax


def curves(x, series: dict[str, list], title="", xlabel="", ylabel="", logx=False, logy=False,
           ax=None, provenance: str | None = None, marker="o"):
    """Line plot of several series against ``x``."""
    if ax is None:
        _, ax = plt.subplots()
    for name, ys in series.items():
        ax.plot(x, ys, marker=marker, label=name, color=color_for(name))
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    if provenance:
        label_provenance(ax, provenance)
    return ax


def tflops_bars(results, d: int, causal: bool, pass_: str = "fwd", impls=None, ax=None):
    """Stored attention results (a utils.results.Results) as TFLOP/s per implementation and
    sequence length, labelled with where they were measured."""
    rows = [r for r in results.rows
            if r["d"] == d and r["causal"] == causal and r["pass"] == pass_ and r["tflops"]]
    seqlens = sorted({r["s"] for r in rows})
    names = impls or list(dict.fromkeys(r["impl"] for r in rows))
    series = {
        n: [next((r["tflops"] for r in rows if r["impl"] == n and r["s"] == s), None)
            for s in seqlens]
        for n in names
    }
    title = f"{pass_} D={d} {'causal' if causal else 'non-causal'}"
    return grouped_bars([f"S={s}" for s in seqlens], series, title=title, ylabel="TFLOP/s",
                        ax=ax, provenance=results.label)
