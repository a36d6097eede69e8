"""Run a learner's CuTe DSL device function as plain Python, to check what it does.

A ``@cute.jit`` function is Python that builds a program. Called with ordinary Python and NumPy
values in place of the DSL's, with its loops turned back into Python loops, the same source runs
as a model of the device code: a value of a warp becomes a NumPy vector of 32 lanes, a shuffle
becomes an index into that vector, a pipeline becomes an object that writes down the calls it
receives. The exercises' checkers use this to say *which* lane, tile or barrier went wrong, in
words, before (or instead of) compiling and running the kernel.

    with python_loops(), patched(cute.arch, shuffle_sync_bfly=my_bfly):
        result = plain(fn)(lanes, op)

Everything is undone when the ``with`` block ends, also after an exception.
"""

from __future__ import annotations

import builtins
import contextlib


def plain(fn):
    """The undecorated Python function behind a ``@cute.jit`` function (or ``fn`` itself).

    Once compiled, the DSL swaps the function's code for its preprocessed version (loops and
    branches become IR builders) and keeps the original as ``_original_code``; a fresh function
    over that original code runs the source as written."""
    import types

    raw = getattr(fn, "__wrapped__", fn)
    code = getattr(raw, "_original_code", None)
    if code is None or code is raw.__code__:
        return raw
    return types.FunctionType(code, raw.__globals__, raw.__name__, raw.__defaults__,
                              raw.__closure__)


class _PyRange:
    """``cutlass.range`` / ``range_constexpr`` as a Python range; the DSL's loop options
    (unroll, unroll_full, ...) have no meaning here and are accepted and ignored."""

    def __new__(cls, *args, **_options):
        return builtins.range(*args)


def _const_expr(value):
    return value


@contextlib.contextmanager
def patched(obj, **attrs):
    """Set attributes of ``obj`` (a module or object) for the ``with`` block, then restore."""
    missing = object()
    saved = {name: getattr(obj, name, missing) for name in attrs}
    try:
        for name, value in attrs.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


@contextlib.contextmanager
def python_loops():
    """``cutlass.range``, ``cutlass.range_constexpr`` and ``cutlass.const_expr`` as plain
    Python for the ``with`` block: a loop over n runs n times, in order."""
    import cutlass

    with patched(cutlass, range=_PyRange, range_constexpr=_PyRange, const_expr=_const_expr):
        yield


__all__ = ["patched", "plain", "python_loops"]
