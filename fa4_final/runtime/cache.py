"""The compile cache: in memory for this process, on disk for the next one.

A CuTe DSL kernel compiles in one to a few seconds (DSL tracing, MLIR passes, ptxas); loading
the same kernel from an object file takes milliseconds. A training job that starts 8 processes,
each compiling its forward and backward for a few head dims and masks, pays that compile time
again on every start unless it is kept on disk. FA4's users asked for exactly this: a persistent
cache by default, whose key never misses for a reason that does not change the code (a broken key
cost minutes per training step) and always misses when something that does change it moved.

Note [What the key holds]
An entry is named by sha256 of
  - the fingerprint: every .py file of fa4_final (path, size and bytes), the CuTe DSL and
    TVM-FFI versions, the Python version and the machine type: a changed kernel source or DSL
    makes a new folder of entries, an unchanged one finds the old;
  - the kernel key: (pass, arch, the kernel class's ``cache_key()`` = its dtype, head dim,
    masks and frozen config), plus the compile options read from the environment (FA4_PTXAS
    and CUTE_DSL_*), since those change the code too.
The key is hashed through ``repr``, so it must be made of plain values and frozen dataclasses.
A repr holding an object address (``<... at 0x...>``) differs in every process: such a key stays
in memory only, never on disk.

Note [Concurrent processes]
Entries are written to a temporary name and moved into place with ``os.replace``, which is atomic
on one file system: a reader sees the old entry, the new one, or none, never half of one. On a
miss a process takes an exclusive lock on the entry (``fcntl.flock``), looks again, and only then
compiles: eight ranks starting together compile each kernel once, the other seven wait and load.
An entry that cannot be loaded (truncated by a full disk, written by an incompatible DSL) gives a
warning, is compiled again and replaced.

Environment:
    FA4_FINAL_CACHE_DIR   where entries live (default: $XDG_CACHE_HOME/fa4_final, else
                          ~/.cache/fa4_final)
    FA4_FINAL_DISK_CACHE  "0" keeps compiled kernels in memory only
``python -m fa4_final cache`` prints the folder, the fingerprint and the entries; ``--clear``
removes them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import sys
import time
import warnings
from collections import Counter
from functools import lru_cache
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: atomic renames still keep entries whole
    fcntl = None

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # fa4_final/
ENV_DIR = "FA4_FINAL_CACHE_DIR"
ENV_DISK = "FA4_FINAL_DISK_CACHE"
FUNCTION_NAME = "fa4_final_kernel"  # the symbol every entry exports
LOCK_TIMEOUT_S = 600.0  # longer than any compile: a lock held longer belongs to a dead process


class CacheWarning(UserWarning):
    """The disk cache could not be used for one entry; the kernel is compiled instead."""


def cache_root() -> Path | None:
    """The folder of the disk cache, or None when FA4_FINAL_DISK_CACHE=0."""
    if os.environ.get(ENV_DISK, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fa4_final"


def source_digest(root: Path = PACKAGE_DIR) -> str:
    """sha256 over every .py file under ``root``: relative path, length and bytes."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        h.update(path.relative_to(root).as_posix().encode())
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def version(module: str) -> str:
    try:
        return getattr(__import__(module), "__version__", "unknown")
    except ImportError:
        return "absent"


@lru_cache(maxsize=1)
def fingerprint() -> str:
    """What every entry of this installation shares (Note [What the key holds])."""
    parts = (f"python {sys.version_info.major}.{sys.version_info.minor}",
             f"machine {platform.machine()}", f"cutlass {version('cutlass')}",
             f"tvm_ffi {version('tvm_ffi')}", f"sources {source_digest()}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def compile_environment() -> tuple:
    """Environment variables that change generated code (runtime.compile reads FA4_PTXAS)."""
    return tuple(sorted((k, v) for k, v in os.environ.items()
                        if k == "FA4_PTXAS" or (k.startswith("CUTE_DSL_")
                                                and not k.startswith(("CUTE_DSL_LOG",
                                                                      "CUTE_DSL_DUMP")))))


def entry_name(key: tuple, fingerprint_: str | None = None) -> str | None:
    """The file stem of ``key``'s entry, or None when the key's repr is not stable across
    processes (it holds an object address)."""
    text = repr(key)
    if " at 0x" in text:
        return None
    fp = fingerprint() if fingerprint_ is None else fingerprint_
    return hashlib.sha256(f"{fp}\n{text}".encode()).hexdigest()[:32]


class _Lock:
    """An exclusive advisory lock on a file, polled until ``timeout`` seconds."""

    def __init__(self, path: Path, timeout: float = LOCK_TIMEOUT_S):
        self.path, self.timeout, self.fd = path, timeout, None

    def __enter__(self) -> bool:
        """True when the lock is held; False after the timeout (the caller goes on unlocked)."""
        if fcntl is None:
            return True
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


_RUNTIME_PRELOADED = False


def _preload_runtime() -> None:
    """Load the DSL runtime libraries with RTLD_GLOBAL before the first entry: an object file
    loaded later resolves its runtime symbols against them (the DSL's own loader opens them
    without RTLD_GLOBAL, and FA4 reports "undefined symbol" errors from cached kernels then)."""
    global _RUNTIME_PRELOADED
    if _RUNTIME_PRELOADED:
        return
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    _RUNTIME_PRELOADED = True


class CompileCache:
    """``get(key, build)``: the compiled kernel for ``key``, from memory, from disk, or from
    ``build()`` (stored on disk when the result can be exported). ``stats`` counts where each
    came from (``memory``, ``disk``, ``compiled``); ``seconds`` holds the last compile, export
    and load times."""

    def __init__(self, root: Path | None | str = "env"):
        self._root = root  # "env": read the environment at each call (tests change it)
        self.memory: dict = {}
        self.stats: Counter = Counter()
        self.seconds: dict[str, float] = {}
        self._unwritable: set[Path] = set()

    # -- where -------------------------------------------------------------------------------
    def folder(self) -> Path | None:
        """This fingerprint's folder of entries, created on first use; None when disabled or
        not writable (warned once)."""
        root = cache_root() if self._root == "env" else self._root
        if root is None:
            return None
        folder = Path(root) / fingerprint()[:16]
        if folder in self._unwritable:
            return None
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._unwritable.add(folder)
            warnings.warn(f"fa4_final: cannot use the disk cache at {folder} ({exc}); compiled "
                          f"kernels stay in memory. Set {ENV_DIR} to a writable folder or "
                          f"{ENV_DISK}=0.", CacheWarning, stacklevel=3)
            return None
        return folder

    # -- lookup ------------------------------------------------------------------------------
    def get(self, key: tuple, build):
        key = (*key, compile_environment())
        if key in self.memory:
            self.stats["memory"] += 1
            return self.memory[key]
        folder = self.folder()
        name = entry_name(key) if folder is not None else None
        if name is None:
            fn = self._build(build)
        else:
            fn = self._from_disk(folder, name, key, build)
        self.memory[key] = fn
        return fn

    def _build(self, build):
        t0 = time.perf_counter()
        fn = build()
        self.seconds["compile"] = time.perf_counter() - t0
        self.stats["compiled"] += 1
        return fn

    def _from_disk(self, folder: Path, name: str, key: tuple, build):
        path = folder / f"{name}.o"
        fn, broken = self._load(path)
        if fn is not None:
            return fn
        with _Lock(folder / f"{name}.lock") as locked:
            if not locked:
                warnings.warn(f"fa4_final: waited {LOCK_TIMEOUT_S:.0f} s for the lock of {path}; "
                              f"compiling without it", CacheWarning, stacklevel=4)
            if not broken:  # another process may have written it while this one waited
                fn, broken = self._load(path)
                if fn is not None:
                    return fn
            fn = self._build(build)
            if locked:
                self._store(fn, folder, name, key)
        return fn

    def _load(self, path: Path):
        """(function, False) on a hit, (None, False) when absent, (None, True) when present but
        unloadable (warned)."""
        if not path.exists():
            return None, False
        try:
            import cutlass.cute as cute

            _preload_runtime()
            t0 = time.perf_counter()
            fn = getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True),
                         FUNCTION_NAME)
            self.seconds["load"] = time.perf_counter() - t0
        except Exception as exc:
            warnings.warn(f"fa4_final: the cache entry {path} cannot be loaded "
                          f"({type(exc).__name__}: {str(exc)[:200]}); compiling it again",
                          CacheWarning, stacklevel=5)
            return None, True
        self.stats["disk"] += 1
        return fn, False

    def _store(self, fn, folder: Path, name: str, key: tuple) -> None:
        export = getattr(fn, "export_to_c", None)
        if export is None:  # not a TVM-FFI compiled function: memory only
            return
        tmp = folder / f".{name}.{os.getpid()}.tmp.o"
        try:
            t0 = time.perf_counter()
            export(str(tmp), function_name=FUNCTION_NAME)
            if tmp.stat().st_size == 0:
                raise OSError("the exported object file is empty")
            os.replace(tmp, folder / f"{name}.o")
            self.seconds["export"] = time.perf_counter() - t0
            _write_atomic(folder / f"{name}.txt", f"{key!r}\n")  # for people reading the folder
        except Exception as exc:
            tmp.unlink(missing_ok=True)
            warnings.warn(f"fa4_final: could not write the cache entry {folder / name}.o "
                          f"({type(exc).__name__}: {str(exc)[:200]}); the kernel stays cached in "
                          f"memory", CacheWarning, stacklevel=5)

    # -- housekeeping ------------------------------------------------------------------------
    def clear(self, disk: bool = False) -> int:
        """Forget the in-memory kernels; with ``disk``, also delete every entry of every
        fingerprint under the cache root. Returns the number of files removed."""
        self.memory.clear()
        root = cache_root() if self._root == "env" else self._root
        removed = 0
        if disk and root is not None and Path(root).exists():
            for sub in Path(root).iterdir():
                if sub.is_dir() and _is_fingerprint_folder(sub.name):
                    for f in sub.iterdir():
                        f.unlink(missing_ok=True)
                        removed += 1
                    sub.rmdir()
        return removed


def _is_fingerprint_folder(name: str) -> bool:
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


CACHE = CompileCache()
