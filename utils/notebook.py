"""IPython extension loaded by every chapter: ``%load_ext utils.notebook``.

It sets the course's plot style, prints what this machine can run, and registers the ``%%gpu``
cell magic:

    %%gpu sm_90
    rows = benchmark(...)        # runs only on a Hopper GPU

On a machine without the GPU the cell needs, its body is not run and a visible note says so; the
CPU substitute (compile-only output, stored results) lives in the ordinary cell beside it.
``COURSE_FORCE_CPU=1`` makes a GPU machine behave like a CPU one.
"""

from __future__ import annotations

ARCH_NAMES = {
    "sm_80": "an Ampere-or-newer GPU (sm_80+)",
    "sm_90": "a Hopper GPU (sm_90: H100/H200)",
    "sm_100": "a Blackwell datacenter GPU (sm_100: B200/B300)",
}


def gpu_cell(line: str, cell: str) -> None:
    from IPython import get_ipython

    from utils.hardware import detect

    need = (line.strip() or "sm_80").split()[0]
    if need not in ARCH_NAMES:
        raise ValueError(f"%%gpu needs one of {sorted(ARCH_NAMES)}, got {need!r}")
    machine = detect()
    if not machine.can_run(need):
        here = machine.gpu_name or "no CUDA GPU"
        print(
            f"[skipped] This cell needs {ARCH_NAMES[need]}; this machine has {here}.\n"
            "          The cell next to it shows the compiled code or stored measurements instead."
        )
        return
    result = get_ipython().run_cell(cell, store_history=False)
    result.raise_error()


def load_ipython_extension(ipython) -> None:
    from utils import plots
    from utils.hardware import describe

    ipython.register_magic_function(gpu_cell, magic_kind="cell", magic_name="gpu")
    plots.use_course_style()
    print(describe())


def source_between(fn, start: str | None = None, end: str | None = None) -> str:
    """The source of ``fn`` from the first line containing ``start`` up to (not including) the
    first later line containing ``end``, dedented. A marker that is not found means "from the
    top" / "to the end", with a note, so an edit of a kernel cannot break the notebook that
    quotes it."""
    import inspect
    import textwrap

    lines = inspect.getsource(getattr(fn, "__wrapped__", fn)).splitlines()
    notes = []
    i0 = 0
    if start is not None:
        i0 = next((i for i, ln in enumerate(lines) if start in ln), None)
        if i0 is None:
            notes.append(f"# ({start!r} not found: showing from the top)")
            i0 = 0
    i1 = len(lines)
    if end is not None:
        found = next((i for i in range(i0 + 1, len(lines)) if end in lines[i]), None)
        if found is None:
            notes.append(f"# ({end!r} not found: showing to the end)")
        else:
            i1 = found
    return textwrap.dedent("\n".join(notes + lines[i0:i1])).rstrip()
