"""Typical wrong answers to the course's exercises, one module per chapter (``chNN.py``), each
defining ``MUTATIONS``: a list of ``Mutation``. tests/test_exercise_mutations.py holds every one
against its checker: the answer must be refused, with the words ``says`` in the message.

Most wrong answers are the reference with one thing changed: ``mutant(reference, old, new)``
states just that change, so a table entry reads as the mistake it plants; ``planted`` gives an
exercise's rows its check, reference and forbid once."""

from __future__ import annotations

import ast
import hashlib
import inspect
import os
import sys
import tempfile
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Mutation:
    exercise: str  # "06.3"
    check: object  # the exercise's checker
    answer: object  # the wrong answer: a function (device code too) or a value
    says: str  # words the learner's message must contain
    reference: object = None  # the exercise's reference: an answer that calls it is refused
    forbid: dict = field(default_factory=dict)  # {helper: why}, as the exercise passes it
    slow: bool = False  # compiles a kernel: run with the slow tests


SLOW = True  # a row's third item: the check compiles a kernel (run with the slow tests)


def planted(exercise: str, check, reference=None, forbid: dict | None = None, *,
            rows) -> list[Mutation]:
    """One exercise's Mutations, the check, reference and forbid said once: ``rows`` of
    ``(answer, "words of the message")``, or ``(answer, words, SLOW)``."""
    return [Mutation(exercise, check, answer, says, reference, dict(forbid or {}), bool(slow))
            for answer, says, *slow in rows]


_DIR = Path(tempfile.gettempdir()) / f"course_mutants_{os.getuid()}"


def _replace(source: str, old: str, new: str | None, count: int, where: str) -> str:
    found = source.count(old)
    if found != count:
        raise ValueError(f"mutant of {where}: {old!r} stands {found} time(s) in its source, not "
                         f"{count}: restate this mutation against the reference as it is now")
    if new is not None:
        return source.replace(old, new)
    lines = source.splitlines(keepends=True)
    return "".join(line for line in lines if old not in line)


def _source(fn) -> str:
    """``fn``'s definition, decorators included, read from its module's file: not through its
    code object, which CuTe DSL replaces with its preprocessed one (whose first line is the
    ``def``, so ``inspect.getsource`` would lose ``@cute.jit``) once the function has run."""
    text = Path(sys.modules[fn.__module__].__file__).read_text()
    body = ast.parse(text).body
    for part in fn.__qualname__.split("."):
        node = next(n for n in body if getattr(n, "name", None) == part)
        body = node.body
    start = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return textwrap.dedent("".join(text.splitlines(keepends=True)[start - 1:node.end_lineno]))


def mutant(reference, old: str, new: str | None, count: int = 1, *,
           also: tuple[tuple, ...] = ()):
    """``reference`` (a function, plain or ``@cute.jit``) with ``old`` replaced by ``new`` in its
    source; ``old`` must stand exactly ``count`` times, else ValueError (a reference that changed
    cannot leave a table planting nothing). ``new=None`` deletes the lines holding ``old``.
    ``also``: further changes, ``(old, new)`` (``old`` standing once) or ``(old, new, count)``.

    The result is written to a real file (CuTe DSL's preprocessor reads a function's source) and
    run in a copy of the reference module's globals, so it sees the same names and helpers."""
    raw = inspect.unwrap(reference)
    where = f"{raw.__module__}.{raw.__qualname__}"
    source = _source(raw)
    for o, n, *c in ((old, new, count), *also):
        source = _replace(source, o, n, c[0] if c else 1, where)
    digest = hashlib.sha1(f"{where}\n{source}".encode()).hexdigest()[:12]
    name = f"_mutant_{raw.__name__}_{digest}"
    path = _DIR / f"{name}.py"
    if not path.exists():
        _DIR.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    module = types.ModuleType(name)
    scope = module.__dict__
    scope.update({k: v for k, v in raw.__globals__.items()
                  if k not in ("__loader__", "__spec__", "__cached__", "__file__", "__name__")})
    scope.update(__name__=name, __file__=str(path))
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), scope)  # noqa: S102 - the reference's own text
    return scope[raw.__name__]
