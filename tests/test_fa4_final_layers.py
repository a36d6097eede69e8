"""fa4_final in four layers, each importing only the layers below it, with no import cycle:

    api      fa4_final/__init__.py, __main__.py, api/   the public face, the custom ops
    runtime  runtime/                                   checks, prologue, dispatch, compile path
    arch     hopper/, blackwell/                        configs, kernels, host (never each other)
    common   common/                                    device code both architectures share

Every ``import`` is read from the source (module level and inside functions alike, by AST).
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fa4_final"
RANK = {"api": 3, "runtime": 2, "hopper": 1, "blackwell": 1, "common": 0}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))
           if "__pycache__" not in p.parts}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__", "api"):
        return "api"
    return parts[1]


def imports(module: str) -> set[str]:
    """The fa4_final modules ``module`` imports anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from a.b import c``: module a.b.c when it is one, else a.b
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                     else node.module for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "fa4_final" or n.startswith("fa4_final."))
    found.discard(module)
    return found


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_has_a_layer():
    assert {layer(m) for m in MODULES} <= set(RANK), sorted({layer(m) for m in MODULES})


def test_every_import_is_a_module_of_the_package():
    """An import of a path the package does not have (a module that moved) fails here, by
    name, before any test imports it."""
    missing = [f"{m} imports {i}" for m, deps in sorted(GRAPH.items()) for i in sorted(deps)
               if i not in MODULES]
    assert not missing, "\n".join(missing)


def test_each_layer_imports_only_the_layers_below():
    upward = []
    for m, deps in sorted(GRAPH.items()):
        for i in sorted(deps):
            a, b = layer(m), layer(i)
            if RANK[b] > RANK[a] or (RANK[a] == RANK[b] == 1 and a != b):
                upward.append(f"{m} ({a}) imports {i} ({b})")
    assert not upward, "imports that go up (or across architectures):\n" + "\n".join(upward)


def _cycle():
    """One import cycle of GRAPH as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for i in sorted(GRAPH.get(m, ())):
            if i not in GRAPH:
                continue
            if state.get(i) == "open":
                return stack[stack.index(i):] + [i]
            if i not in state and (found := visit(i)):
                return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(GRAPH):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("bad, says", [
    ({"fa4_final.common.tiles": {"fa4_final.hopper.config"}},
     "fa4_final.common.tiles (common) imports fa4_final.hopper.config (hopper)"),
    ({"fa4_final.hopper.host": {"fa4_final.blackwell.config"}},
     "fa4_final.hopper.host (hopper) imports fa4_final.blackwell.config (blackwell)"),
])
def test_the_check_names_both_modules(bad, says):
    saved = {m: set(GRAPH[m]) for m in bad}
    try:
        for m, extra in bad.items():
            GRAPH[m] |= extra
        with pytest.raises(AssertionError, match=re.escape(says)):
            test_each_layer_imports_only_the_layers_below()
    finally:
        GRAPH.update(saved)


def test_the_cycle_check_finds_a_cycle():
    saved = set(GRAPH["fa4_final.common.tiles"])
    try:
        GRAPH["fa4_final.common.tiles"] = saved | {"fa4_final.common.mask"}
        with pytest.raises(AssertionError, match="fa4_final.common.mask -> fa4_final.common.tiles"):
            test_no_import_cycle()
    finally:
        GRAPH["fa4_final.common.tiles"] = saved
