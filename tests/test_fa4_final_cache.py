"""fa4_final's compile cache on a CPU: what its key holds, memory and disk hits, a second process
that loads instead of compiling, concurrent processes compiling once, a corrupt entry compiled
again with a warning. The kernel is tests/tiny_kernels.py's (compiled for sm_90a in 0.1 s)."""

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from fa4_final.hopper.config import hopper_fwd_default
from fa4_final.hopper.host import forward_recipe
from fa4_final.runtime import cache
from fa4_final.runtime import compile as compile_path

ROOT = Path(__file__).resolve().parent.parent

# One compile of the tiny kernel through a CompileCache; prints where it came from.
SCRIPT = textwrap.dedent("""
    import json, sys
    import cutlass.cute as cute
    from cutlass import Float32
    from fa4_final.runtime.cache import CompileCache
    from fa4_final.common.recipe import fake_stream, fake_tensor
    from fa4_final.runtime.compile import compile_kernel
    from tests.tiny_kernels import scale

    def build():
        n = cute.sym_int()
        x, y = (fake_tensor(Float32, (n,)) for _ in range(2))
        return compile_kernel(scale, x, y, Float32(1.0), fake_stream(), arch="sm_90a")[0]

    c = CompileCache(sys.argv[1])
    fn = c.get(("tiny", "sm_90a", int(sys.argv[2])), build)
    print(json.dumps(dict(c.stats) | {"type": type(fn).__name__}))
""")


def run_script(root, variant=0, wait=True):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(root), str(variant)], cwd=ROOT,
                            env=os.environ | {"PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return finish(proc) if wait else proc


def finish(proc):
    import json

    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_build():
    import cutlass.cute as cute
    from cutlass import Float32

    from fa4_final.common.recipe import fake_stream, fake_tensor
    from fa4_final.runtime.compile import compile_kernel
    from tests.tiny_kernels import scale

    calls = []

    def build():
        calls.append(1)
        n = cute.sym_int()
        x, y = (fake_tensor(Float32, (n,)) for _ in range(2))
        return compile_kernel(scale, x, y, Float32(1.0), fake_stream(), arch="sm_90a")[0]

    build.calls = calls
    return build


# ----------------------------------------------------------------------------------------------
# the key


def test_source_digest_follows_the_sources(tmp_path):
    pkg = tmp_path / "fa4_final"
    shutil.copytree(cache.PACKAGE_DIR, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    same = cache.source_digest(pkg)
    assert same == cache.source_digest(cache.PACKAGE_DIR)
    (pkg / "notes.txt").write_text("not python")  # only .py files count
    assert cache.source_digest(pkg) == same
    fwd = pkg / "hopper" / "fwd.py"
    fwd.write_text(fwd.read_text() + "\n# one changed line\n")
    changed = cache.source_digest(pkg)
    assert changed != same
    (pkg / "hopper" / "extra.py").write_text("")
    assert cache.source_digest(pkg) not in (same, changed)


def test_entry_name_holds_the_fingerprint_and_the_key():
    key = ("fwd", "sm_90a", ("HopperForward", "BFloat16", 128, hopper_fwd_default(128)))
    a = cache.entry_name(key, "fp1")
    assert a == cache.entry_name(key, "fp1") and len(a) == 32
    assert cache.entry_name(key, "fp2") != a  # other sources or DSL version
    assert cache.entry_name(("fwd", "sm_100a", *key[2:]), "fp1") != a
    assert cache.entry_name((*key, object()), "fp1") is None  # repr differs in every process


def test_fingerprint_names_the_versions(monkeypatch):
    cache.fingerprint.cache_clear()
    a = cache.fingerprint()
    monkeypatch.setattr(cache, "version", lambda m: "9.9.9")
    cache.fingerprint.cache_clear()
    try:
        assert cache.fingerprint() != a
    finally:
        monkeypatch.undo()
        cache.fingerprint.cache_clear()


def test_compile_options_from_the_environment_are_part_of_the_key(monkeypatch):
    monkeypatch.delenv("FA4_PTXAS", raising=False)
    before = cache.compile_environment()
    monkeypatch.setenv("FA4_PTXAS", "-O1")
    assert cache.compile_environment() != before


def test_the_forward_key_names_what_changes_the_code(monkeypatch):
    keys = []
    monkeypatch.setattr(compile_path, "cached", lambda key, build: keys.append(key) or object())
    monkeypatch.setattr(compile_path, "_PLANS", {})

    def forward(d=128, dtype="bf16", causal=False, config=None, left=False):
        return compile_path.compiled(forward_recipe, d, dtype, causal, config, left, False,
                                     False, False).kernels["main"]

    first = forward()
    assert forward() is first and len(keys) == 1
    forward(causal=True)
    forward(d=64)
    forward(dtype="fp16")
    forward(left=True)
    forward(config=replace(hopper_fwd_default(128), stages_k=2))
    assert len(set(map(repr, keys))) == len(keys) == 6
    assert all(cache.entry_name(k, "fp") is not None for k in keys)


# ----------------------------------------------------------------------------------------------
# where it lives


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv(cache.ENV_DIR, raising=False)
    monkeypatch.delenv(cache.ENV_DISK, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "fa4_final"
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"
    monkeypatch.setenv(cache.ENV_DISK, "0")
    assert cache.cache_root() is None


def test_disabled_disk_cache_writes_nothing(monkeypatch, tmp_path, tiny_build):
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(cache.ENV_DISK, "0")
    c = cache.CompileCache()
    c.get(("tiny", 1), tiny_build)
    c.get(("tiny", 1), tiny_build)
    assert dict(c.stats) == {"compiled": 1, "memory": 1} and not any(tmp_path.iterdir())


def test_unwritable_folder_warns_and_keeps_memory(tmp_path, tiny_build):
    blocker = tmp_path / "file"
    blocker.write_text("")
    c = cache.CompileCache(blocker / "cache")
    with pytest.warns(cache.CacheWarning, match="cannot use the disk cache"):
        c.get(("tiny", 2), tiny_build)
    assert c.stats["compiled"] == 1


# ----------------------------------------------------------------------------------------------
# hits, misses, corruption


def test_memory_then_disk_hits(tmp_path, tiny_build):
    first = cache.CompileCache(tmp_path)
    n = len(tiny_build.calls)
    first.get(("tiny", 3), tiny_build)
    first.get(("tiny", 3), tiny_build)
    assert dict(first.stats) == {"compiled": 1, "memory": 1}
    entries = list(tmp_path.glob("*/*.o"))
    assert len(entries) == 1 and entries[0].with_suffix(".txt").read_text().startswith(
        "('tiny', 3")
    second = cache.CompileCache(tmp_path)  # a new process, as far as memory goes
    fn = second.get(("tiny", 3), tiny_build)
    assert dict(second.stats) == {"disk": 1} and type(fn).__name__ == "Function"
    assert len(tiny_build.calls) == n + 1
    assert set(first.seconds) == {"compile", "export"} and set(second.seconds) == {"load"}


def test_a_corrupt_entry_is_compiled_again_with_a_warning(tmp_path, tiny_build):
    cache.CompileCache(tmp_path).get(("tiny", 4), tiny_build)
    entry = next(tmp_path.glob("*/*.o"))
    entry.write_bytes(b"\x7fELF truncated by a full disk")
    c = cache.CompileCache(tmp_path)
    with pytest.warns(cache.CacheWarning, match="cannot be loaded"):
        c.get(("tiny", 4), tiny_build)
    assert dict(c.stats) == {"compiled": 1}
    again = cache.CompileCache(tmp_path)
    again.get(("tiny", 4), tiny_build)
    assert dict(again.stats) == {"disk": 1}  # the entry was replaced by a good one
    assert not list(tmp_path.glob("*/.*.tmp*"))


def test_clear_removes_only_fingerprint_folders(tmp_path, tiny_build):
    c = cache.CompileCache(tmp_path)
    c.get(("tiny", 5), tiny_build)
    (tmp_path / "keep-me").mkdir()
    assert c.clear(disk=True) >= 2 and [p.name for p in tmp_path.iterdir()] == ["keep-me"]
    assert not c.memory


# ----------------------------------------------------------------------------------------------
# other processes


def test_other_processes_load_instead_of_compiling(tmp_path):
    """Two processes start together on an empty cache: one compiles, the other loads what it
    wrote (having waited on the entry's lock if it came while the first was compiling)."""
    procs = [run_script(tmp_path, variant=7, wait=False) for _ in range(2)]
    stats = sorted((finish(p) for p in procs), key=lambda s: s.get("compiled", 0))
    assert stats == [{"disk": 1, "type": "Function"},
                     {"compiled": 1, "type": "TVMFFIJitCompiledFunctionWithKwargs"}], stats


def test_cli_lists_and_clears(monkeypatch, tmp_path, tiny_build, capsys):
    from fa4_final import __main__ as cli

    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(cache.ENV_DISK, raising=False)
    cache.CompileCache().get(("tiny", 8), tiny_build)
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "1 entries" in out and "('tiny', 8" in out
    assert cli.main(["cache", "--clear"]) == 0 and not any(tmp_path.iterdir())


def test_cli_warm_compiles_every_default_forward(monkeypatch, tmp_path, capsys):
    from fa4_final import __main__ as cli

    calls = []
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(compile_path, "compiled", lambda *a: calls.append(a))
    assert cli.main(["cache", "--warm"]) == 0
    assert len(calls) == 8 and {a[1] for a in calls} == {64, 128}
    assert "forward D=128 fp16 causal" in capsys.readouterr().out
