"""Predict before you measure: commit to a number or a choice, then read what was measured.

    predict("08.2", None, unit="x", default=1.0,
            question="fa4_final's speed over the FA4 package's at D = 128, S = 16384")
        # replace None with your number (or, with options=..., one of the options)
    ...
    reveal("08.2", measured, lesson={"close": "...", "low": "...", "high": "..."})

``reveal`` prints what you predicted, what was measured and how far apart they are, then the
lesson for where your prediction landed: a guess that was too low and one that was too high
usually miss different things. A prediction left at None is replaced by the chapter's
``default`` (a plain first guess, not the answer) and said so, so a notebook run from top to
bottom (nbval, a browser) still runs every cell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_PREDICTIONS: dict[str, Prediction] = {}


@dataclass
class Prediction:
    id: str
    value: object  # a number, or one of ``options``
    question: str
    unit: str = ""
    options: tuple | None = None
    yours: bool = True  # False when the default stood in


def predict(pred_id: str, value, *, question: str, default, unit: str = "",
            options=None) -> Prediction:
    """Record a prediction; ``value`` None means "not made yet" and ``default`` stands in."""
    opts = tuple(options) if options is not None else None
    yours = value is not None and value is not Ellipsis
    chosen = value if yours else default
    if opts is not None and chosen not in opts:
        raise ValueError(f"prediction {pred_id}: pick one of {list(opts)}, got {chosen!r}")
    if opts is None and not (isinstance(chosen, (int, float)) and not isinstance(chosen, bool)
                             and math.isfinite(chosen)):
        raise ValueError(f"prediction {pred_id}: give a number, got {chosen!r}")
    p = Prediction(pred_id, chosen, question, unit, opts, yours)
    _PREDICTIONS[pred_id] = p
    who = "your prediction" if yours else "no prediction made: the default stands in"
    print(f"[prediction {pred_id}] {question}: {_fmt(chosen, unit)} ({who})")
    return p


def _fmt(v, unit: str) -> str:
    if isinstance(v, float):
        text = f"{v:.3g}"
    else:
        text = str(v)
    return f"{text}{'' if not unit else (unit if unit in ('x', '%') else ' ' + unit)}"


def where(p: Prediction, measured, close: float) -> str:
    """'close', 'low' or 'high' for a number (relative to the measurement); 'right' or
    'wrong' for a choice."""
    if p.options is not None:
        return "right" if p.value == measured else "wrong"
    scale = max(abs(float(measured)), 1e-12)
    gap = (float(p.value) - float(measured)) / scale
    if abs(gap) <= close:
        return "close"
    return "low" if gap < 0 else "high"


def _kind_of(source: str) -> str:
    """What the revealed figure is, from its source label: a model's figure, a count read off a
    compiled kernel, or a measurement."""
    low = source.lower()
    if "model" in low:
        return "the model gives"
    if "compiled" in low or "sass" in low or "ptx" in low:
        return "compiled:"
    return "measured"


def reveal(pred_id: str, measured, lesson, *, close: float = 0.1,
           source: str = "", kind: str | None = None) -> str:
    """Print the prediction beside the measurement, and the lesson for where it landed.

    ``lesson``: a string, or a dict keyed by ``where``'s answer ('close', 'low', 'high' for a
    number; 'right', 'wrong' for a choice), or a function of that answer. ``close``: the relative
    gap that still counts as close. ``source``: where the figure comes from (a results file's
    label, "model", "compiled for sm_100a"). ``kind``: how the figure is introduced ("measured",
    "the model gives", "compiled:"); by default read from ``source``, so a model's figure is
    never called measured. Returns where the prediction landed."""
    p = _PREDICTIONS.get(pred_id)
    if p is None:
        raise LookupError(f"no prediction {pred_id} yet: run its predict(...) cell first")
    verdict = where(p, measured, close)
    if callable(lesson):
        text = lesson(verdict)
    elif isinstance(lesson, dict):
        text = lesson.get(verdict, lesson.get("any", ""))
    else:
        text = lesson
    who = "you predicted" if p.yours else "the default predicted"
    lines = [f"[prediction {pred_id}] {p.question}",
             f"  {who} {_fmt(p.value, p.unit)}; {kind or _kind_of(source)} "
             f"{_fmt(measured, p.unit)}"
             + (f" ({source})" if source else "")]
    if p.options is None:
        gap = (float(p.value) - float(measured)) / max(abs(float(measured)), 1e-12)
        lines.append(f"  {abs(gap):.0%} {'above' if gap > 0 else 'below'} the measurement: "
                     f"{ {'close': 'close', 'low': 'too low', 'high': 'too high'}[verdict]}")
    else:
        lines.append(f"  {verdict}")
    if text:
        lines.append(f"  What it means: {text}")
    print("\n".join(lines))
    return verdict


def predictions() -> dict[str, Prediction]:
    """The predictions made in this session, by id."""
    return dict(_PREDICTIONS)
