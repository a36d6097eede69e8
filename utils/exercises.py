"""Exercises that check themselves and never stop the notebook.

    @exercise("02.1", check=ch02.check_tile_update, reference=ch02.tile_update)
    def tile_update(...):
        ...learner's code...

When the cell runs, ``check`` is called on the learner's function. It raises AssertionError with
a plain-words message when something is wrong, and the learner's own NotImplementedError means
"not done yet". Either way the reference solution is returned in place of the learner's function
so every later cell still runs. A passing function is returned as is.

For a value rather than a function: ``answer = check_answer("00.2", answer, check=...,
reference=...)``; ``None`` means not done yet.

A checker judges the method as well as the value: before ``check`` runs, the learner's code is
read (its source, names resolved through its module), and an answer that calls the reference
solution, or a helper the exercise forbids (``forbid={helper: "why"}``), is refused with a
message that says which and why.

With ``COURSE_STRICT_EXERCISES=1`` (set by the test suite for the solved notebooks) anything but
a pass raises, so a broken solution cannot hide behind the fallback.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
import traceback

_STATUS: dict[str, str] = {}


def _strict() -> bool:
    return os.environ.get("COURSE_STRICT_EXERCISES") == "1"


def _report(ex_id: str, state: str, detail: str = "") -> None:
    _STATUS[ex_id] = state
    if state == "passed":
        print(f"[exercise {ex_id}] passed.")
        return
    if state == "not done":
        msg = (
            f"[exercise {ex_id}] not done yet: "
            "using the reference solution so the notebook carries on."
        )
    else:
        msg = (
            f"[exercise {ex_id}] not right yet: {detail}\n"
            "  Using the reference solution below so the notebook carries on; "
            "fix it and re-run the cell."
        )
    if _strict():
        raise AssertionError(msg)
    print(msg)


def _run_check(ex_id: str, check, candidate) -> bool:
    try:
        check(candidate)
    except NotImplementedError:
        _report(ex_id, "not done")
        return False
    except AssertionError as exc:
        _report(ex_id, "failed", str(exc) or "the check failed")
        return False
    except Exception as exc:  # the learner's code crashed: say where, in one line
        where = traceback.extract_tb(exc.__traceback__)[-1]
        _report(
            ex_id, "failed",
            f"your code raised {type(exc).__name__}: {exc} (line {where.lineno}: {where.line})",
        )
        return False
    _report(ex_id, "passed")
    return True


def _resolve(node, scope: dict):
    """The object a Name or a chain of Attributes (``ch05t.load_kv``) refers to, or None."""
    if isinstance(node, ast.Name):
        return scope.get(node.id, None)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope)
        return None if base is None else getattr(base, node.attr, None)
    return None


def referenced(fn) -> list[tuple[str, object]]:
    """(the text, the object) of every name and attribute chain ``fn``'s body refers to,
    resolved through its module's globals and its closure. Empty when the source cannot be
    read (then nothing can be refused)."""
    raw = inspect.unwrap(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(raw)))
    except (OSError, TypeError, SyntaxError):
        return []
    scope = dict(getattr(raw, "__globals__", {}))
    closure = getattr(raw, "__closure__", None) or ()
    for name, cell in zip(raw.__code__.co_freevars, closure):
        try:
            scope[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    body = tree.body[0].body if tree.body and hasattr(tree.body[0], "body") else tree.body
    found = []
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, (ast.Name, ast.Attribute)):
                obj = _resolve(node, scope)
                if obj is not None:
                    found.append((ast.unparse(node), obj))
    return found


def refused_call(fn, forbidden: dict) -> str | None:
    """The refusal for the first forbidden object ``fn`` refers to, or None. ``forbidden``:
    {object: why it may not be used}."""
    for text, obj in referenced(fn):
        for bad, why in forbidden.items():
            if obj is bad:
                return f"your code uses {text}: {why}"
    return None


def _forbidden(reference, forbid) -> dict:
    table = {} if reference is None else {
        reference: "that is the reference solution; write the code yourself"}
    for obj, why in (forbid or {}).items():
        table[obj] = why
    return table


def judge(check, answer, reference=None, forbid: dict | None = None) -> str | None:
    """What the exercise machinery says of ``answer``: None when it passes, "not done" when it
    raises NotImplementedError, else the message a learner reads (a refused reference or helper,
    a failed check, or the crash). The mutation tests (tests/test_exercise_mutations.py) hold
    every exercise's typical wrong answers against it."""
    if callable(answer):
        refusal = refused_call(answer, _forbidden(reference if callable(reference) else None,
                                                  forbid))
        if refusal:
            return refusal
    try:
        check(answer)
    except NotImplementedError:
        return "not done"
    except AssertionError as exc:
        return str(exc) or "the check failed"
    except Exception as exc:
        return f"your code raised {type(exc).__name__}: {exc}"
    return None


def exercise(ex_id: str, check, reference, forbid: dict | None = None):
    """Decorator: check the learner's function now; return it if it passes, else ``reference``.
    An answer that uses ``reference`` or an object of ``forbid`` ({helper: why}) is refused."""

    def decorate(fn):
        refusal = refused_call(fn, _forbidden(reference, forbid))
        if refusal:
            _report(ex_id, "failed", refusal)
            return reference
        return fn if _run_check(ex_id, check, fn) else reference

    return decorate


def check_answer(ex_id: str, value, check, reference=None, forbid: dict | None = None):
    """Check a value answer; ``None`` (or ``...``) means not done yet. A callable answer that
    uses the reference or an object of ``forbid`` is refused, as by ``exercise``."""
    if value is None or value is Ellipsis:
        _report(ex_id, "not done")
        return reference
    if callable(value):
        refusal = refused_call(value, _forbidden(reference if callable(reference) else None,
                                                 forbid))
        if refusal:
            _report(ex_id, "failed", refusal)
            return reference
    return value if _run_check(ex_id, check, value) else reference


def status() -> dict[str, str]:
    """Exercise id -> 'passed' / 'not done' / 'failed', for this kernel session."""
    return dict(_STATUS)


def summary() -> str:
    if not _STATUS:
        return "No exercises checked yet."
    return "\n".join(f"  {k}: {v}" for k, v in sorted(_STATUS.items()))
