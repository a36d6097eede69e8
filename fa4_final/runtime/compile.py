"""One compile path for every kernel of the package: a recipe in, compiled functions out.

Kernels are compiled from *fake* tensors (common.recipe) through CuTe DSL's TVM-FFI entry, so the
same compiled function serves every batch, length and head count, takes torch tensors directly
and runs on the caller's current stream. ``compiled(recipe_fn, *args)`` is what the runtime
launches: looked up per call, built once, cached in memory and on disk (fa4_final.runtime.cache)
by (pass, role, arch, the kernel's ``cache_key()`` = its class and frozen config, CuTe DSL
version) and a fingerprint of the package's sources. ``artifacts(recipe)`` compiles afresh and
keeps the PTX, cubin, SASS and resources: what compile-only tools show and the CPU tests check,
with no GPU anywhere (the recipe names the target).
"""

from __future__ import annotations

import inspect
import re
import shutil
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import cutlass
import cutlass.cute as cute

from fa4_final.common.recipe import Recipe

ARCHS = ("sm_80", "sm_90a", "sm_100a")
DSL_VERSION = getattr(cutlass, "__version__", "unknown")


# ----------------------------------------------------------------------------------------------
# Compiled artifacts: what a kernel engineer checks before any run


@dataclass
class KernelResources:
    name: str
    registers: int
    frame_bytes: int  # per-thread stack frame: local memory the kernel asked for
    spill_instructions: int  # LDL/STL in the SASS
    static_smem_bytes: int

    @property
    def short_name(self) -> str:
        # kernel_cutlass_<python name>_<mangled argument types>_0  ->  <python name>
        m = re.match(r"kernel_cutlass_(.+?)_(tensor|Int|Float|object|ptr|\d)", self.name)
        return m.group(1) if m else self.name


@dataclass
class Artifacts:
    arch: str
    ptx: str
    cubin: bytes
    sass: str
    compile_seconds: float
    kernels: list[KernelResources] = field(default_factory=list)

    def count(self, word: str, where: str = "ptx") -> int:
        """How many times ``word`` occurs in the PTX (``where="ptx"``) or SASS."""
        return getattr(self, where).count(word)

    def require(self, *words: str, where: str = "ptx") -> None:
        text = getattr(self, where)
        missing = [w for w in words if w not in text]
        if missing:
            raise AssertionError(f"{self.arch} {where.upper()} lacks {missing}; present: "
                                 f"{[w for w in words if w in text]}")

    def forbid(self, *words: str, where: str = "ptx") -> None:
        text = getattr(self, where)
        found = [w for w in words if w in text]
        if found:
            raise AssertionError(f"{self.arch} {where.upper()} unexpectedly contains {found}")

    @property
    def registers(self) -> int:
        return max((k.registers for k in self.kernels), default=0)

    @property
    def spills(self) -> int:
        return sum(k.spill_instructions for k in self.kernels)

    @property
    def frame_bytes(self) -> int:
        return max((k.frame_bytes for k in self.kernels), default=0)

    def resources(self) -> str:
        rows = [
            f"{k.short_name[:40]:40s} regs {k.registers:3d}  stack {k.frame_bytes:4d} B  "
            f"spill instr {k.spill_instructions:3d}  static smem {k.static_smem_bytes} B"
            for k in self.kernels
        ]
        return f"[{self.arch}, compiled in {self.compile_seconds:.1f} s]\n" + "\n".join(rows)

    def summary(self) -> dict:
        """Plain data (JSON-ready): what compile_only() returns to callers without CuTe."""
        return {"arch": self.arch, "compile_seconds": self.compile_seconds,
                "registers": self.registers, "frame_bytes": self.frame_bytes,
                "spills": self.spills, "ptx_lines": self.ptx.count("\n"),
                "kernels": [k.__dict__ | {"short_name": k.short_name} for k in self.kernels]}


def compile_kernel(kernel, *args, arch: str, keep: bool = False, tvm_ffi: bool = True):
    """Compile ``kernel`` (a ``@cute.jit`` callable) for ``arch``; needs no GPU.

    Returns ``(compiled, artifacts)``; ``artifacts`` is None unless ``keep``."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    flags = [f"--gpu-arch {arch}"] + (["--enable-tvm-ffi"] if tvm_ffi else [])
    import os
    if os.environ.get("FA4_PTXAS"):
        flags.append(f"--ptxas-options '{os.environ['FA4_PTXAS']}'")
    with tempfile.TemporaryDirectory(prefix="fa4_dump_") as dump:
        if keep:  # KeepPTX / KeepCUBIN write files too: keep them out of the working folder
            flags += ["--keep-ptx", "--keep-cubin", f"--dump-dir {dump}"]
        t0 = time.perf_counter()
        compiled = cute.compile(kernel, *args, options=" ".join(flags))
        seconds = time.perf_counter() - t0
    if not keep:
        return compiled, None
    ptx = compiled.__ptx__ or ""
    cubin = compiled.__cubin__ or b""
    sass = disassemble(cubin) if cubin else ""
    return compiled, Artifacts(arch, ptx, cubin, sass, seconds, kernel_resources(cubin, sass))


def artifacts(recipe: Recipe, roles=None) -> dict:
    """{role: Artifacts} of ``recipe``'s kernels (``roles``: a subset), compiled afresh with
    their PTX, cubin and SASS kept: what compile-only tools and the CPU tests read."""
    return {role: compile_kernel(kernel, *recipe.fake_args(role), arch=recipe.arch,
                                 keep=True)[1]
            for role, kernel in recipe.kernels.items() if roles is None or role in roles}


@dataclass(frozen=True)
class Plan:
    """A pass ready to launch: its compiled kernels by role and its resolved config."""

    kernels: dict
    config: object


# (recipe function, its arguments) -> Plan: what a call of the runtime looks up, a dict lookup
# of about a microsecond, in front of the cache (building kernel objects and their keys costs
# tens of microseconds). The function is in the key, so a replaced one is asked again.
_PLANS: dict = {}


def compiled(recipe_fn, *args) -> Plan:
    """The compiled kernels of ``recipe_fn(*args)``: each built once per key and process, and
    loaded from disk while the cache holds its entry (fa4_final.runtime.cache). The one compile
    path of the package: the runtime's calls, the tools' compiles and the disk cache's warm-up
    all come through here or ``artifacts``."""
    key = (recipe_fn, *args)
    plan = _PLANS.get(key)
    if plan is None:
        recipe = recipe_fn(*args)
        kernels = {}
        for role, kernel in recipe.kernels.items():
            def build(kernel=kernel, role=role):
                return compile_kernel(kernel, *recipe.fake_args(role), arch=recipe.arch)[0]

            kernels[role] = FullCall(cached((recipe.tag, role, recipe.arch,
                                             kernel.cache_key()), build), kernel)
        plan = _PLANS[key] = Plan(kernels, recipe.config)
    return plan


class FullCall:
    """A compiled kernel called with every run-time parameter of its ``__call__``.

    Note [Trailing defaults]
    A kernel's optional inputs (the sink, seqused_q, the lse's
    gradient) are trailing parameters with the default None. The function CuTe DSL compiles
    takes all of them, positionally; a freshly compiled one carries the DSL's keyword wrapper,
    which fills the defaults, but one loaded from the disk cache (runtime.cache) is the bare
    positional function, so a call that leaves a default out fails there ("Expects N
    parameters"). Every plan's kernel goes through this adapter, which fills the left-out
    trailing defaults itself, so a kernel behaves the same from memory and from disk."""

    __slots__ = ("fn", "names", "defaults")

    def __init__(self, fn, kernel):
        params = [p for p in inspect.signature(kernel.__call__).parameters.values()
                  if p.name != "stream"]  # the stream is TVM-FFI's environment stream
        self.fn = fn
        self.names = tuple(p.name for p in params)
        self.defaults = tuple(p.default for p in params)

    def __call__(self, *args):
        n = len(args)
        if n > len(self.names):
            raise TypeError(f"the kernel takes {len(self.names)} arguments "
                            f"({', '.join(self.names)}), got {n}")
        if n < len(self.names):
            rest = self.defaults[n:]
            missing = [nm for nm, d in zip(self.names[n:], rest) if d is inspect.Parameter.empty]
            if missing:
                raise TypeError(f"the kernel's arguments {', '.join(missing)} have no default; "
                                f"got {n} of {len(self.names)}")
            args += rest
        return self.fn(*args)


def forget() -> None:
    """Empty the per-call lookup (the cache's memory and disk are separate: CACHE.clear)."""
    _PLANS.clear()


def cached(key: tuple, build):
    """The compiled kernel for ``key``: ``build()`` runs once per key and process, and once per
    key on the machine while the disk cache holds its entry (fa4_final.runtime.cache)."""
    from fa4_final.runtime.cache import CACHE

    return CACHE.get((*key, DSL_VERSION), build)


# ----------------------------------------------------------------------------------------------
# SASS and resources from a cubin, without any CUDA tool but nvdisasm


def _nvdisasm() -> str | None:
    try:  # the pinned DSL's own locator: the [sass] extra's wheel, then a CUDA toolkit
        from cutlass.base_dsl.env_manager import _find_nvdisasm_binary

        return _find_nvdisasm_binary()
    except Exception:
        return shutil.which("nvdisasm")


def disassemble(cubin: bytes) -> str:
    """SASS of a cubin via nvdisasm; empty if no nvdisasm is installed."""
    tool = _nvdisasm()
    if tool is None:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {out.stderr.strip()[:500]}")
    return out.stdout


# ELF .nv.info attribute codes (see CUDA's cuobjdump -res-usage; stable across versions).
_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x11
_EIFMT_SVAL = 4
_EIFMT_HVAL = 3


def _elf_sections(data: bytes):
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF cubin")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = raw[shstrndx][4]

    def name(off):
        end = data.index(b"\0", strtab + off)
        return data[strtab + off:end].decode()

    # (name, type, offset, size, link, info)
    return [(name(r[0]), r[1], r[4], r[5], r[6], r[7]) for r in raw]


def _symbols(data: bytes, sections):
    symtab = next(s for s in sections if s[0] == ".symtab")
    strtab_off = sections[symtab[4]][2]
    names = []
    for i in range(symtab[3] // 24):
        st_name = struct.unpack_from("<I", data, symtab[2] + 24 * i)[0]
        end = data.index(b"\0", strtab_off + st_name)
        names.append(data[strtab_off + st_name:end].decode())
    return names


def _nv_info(data: bytes, off: int, size: int):
    """Yield (attribute, payload) pairs of an .nv.info section."""
    p, end = off, off + size
    while p < end:
        fmt, attr = data[p], data[p + 1]
        p += 2
        if fmt == _EIFMT_SVAL:
            n = struct.unpack_from("<H", data, p)[0]
            yield attr, data[p + 2:p + 2 + n]
            p += 2 + n
        elif fmt == _EIFMT_HVAL:
            yield attr, data[p:p + 2]
            p += 2
        else:  # EIFMT_BVAL (1 byte) or EIFMT_NVAL (none)
            p += 1 if fmt == 2 else 0


def kernel_resources(cubin: bytes, sass: str = "") -> list[KernelResources]:
    if not cubin:
        return []
    secs = _elf_sections(cubin)
    syms = _symbols(cubin, secs)
    regs, frame = {}, {}
    for name, _, off, size, _, _ in secs:
        if name == ".nv.info":
            for attr, payload in _nv_info(cubin, off, size):
                if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and len(payload) == 8:
                    sym, value = struct.unpack("<II", payload)
                    (regs if attr == _EIATTR_REGCOUNT else frame)[syms[sym]] = value
    smem = {s[0][len(".nv.shared."):]: s[3] for s in secs if s[0].startswith(".nv.shared.")}
    spills = _spills_per_kernel(sass)
    return [KernelResources(k, regs[k], frame.get(k, 0), spills.get(k, 0), smem.get(k, 0))
            for k in regs]


def _spills_per_kernel(sass: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    current = None
    for line in sass.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.(\S+?),", line)
        if m:
            current = m.group(1)
            counts[current] = 0
        elif current and re.search(r"\b(LDL|STL)(\.\w+)*\b", line):
            counts[current] += 1
    return counts
