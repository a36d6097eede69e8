"""``python -m fa4_final ...``: the package's two small tools.

    python -m fa4_final support-table [--write README.md]   what each GPU runs (runtime.dispatch)
    python -m fa4_final cache [--clear | --warm]             the disk cache (runtime.cache)

``cache --warm`` compiles the Hopper forward for every head dim, dtype and causal flag into the
disk cache, on any machine (no GPU needed): a build step can fill the cache that training jobs
then load in milliseconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = __doc__.strip().splitlines()[2:4]


def support_table(argv: list[str]) -> int:
    from fa4_final.runtime.dispatch import render, support_table

    if not argv:
        print(support_table())
        return 0
    if argv[0] == "--write" and len(argv) == 2:
        path = Path(argv[1])
        path.write_text(render(path.read_text()))
        print(f"wrote the support table into {path}")
        return 0
    return usage()


def cache(argv: list[str]) -> int:
    from fa4_final.runtime.cache import CACHE, ENV_DISK, cache_root, fingerprint, version

    root = cache_root()
    print(f"fa4_final compile cache: {root if root else f'disabled ({ENV_DISK}=0)'}")
    print(f"fingerprint {fingerprint()[:16]} (the package's sources, CuTe DSL "
          f"{version('cutlass')}, TVM-FFI {version('tvm_ffi')})")
    if root is None:
        return 0
    if argv == ["--clear"]:
        print(f"removed {CACHE.clear(disk=True)} files")
        return 0
    if argv == ["--warm"]:
        return warm()
    if argv:
        return usage()
    folder = Path(root) / fingerprint()[:16]
    entries = sorted(folder.glob("*.o")) if folder.exists() else []
    for e in entries:
        key = e.with_suffix(".txt")
        print(f"  {e.name}  {e.stat().st_size // 1024} KB  "
              f"{key.read_text().strip()[:150] if key.exists() else ''}")
    print(f"{len(entries)} entries for this fingerprint")
    return 0


def warm() -> int:
    import time

    from fa4_final.common.constants import HEAD_DIMS
    from fa4_final.hopper.host import forward_recipe
    from fa4_final.runtime import compile as compile_path
    from fa4_final.runtime.cache import CACHE

    for d in HEAD_DIMS:
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                before = dict(CACHE.stats)
                t0 = time.perf_counter()
                compile_path.compiled(forward_recipe, d, dtype, causal, None, False, False, False,
                                      False)
                how = "compiled" if CACHE.stats["compiled"] > before.get("compiled", 0) \
                    else "on disk already"
                print(f"  forward D={d} {dtype}{' causal' if causal else ''}: {how} "
                      f"({time.perf_counter() - t0:.1f} s)")
    return 0


def usage() -> int:
    print("usage:\n" + "\n".join(USAGE), file=sys.stderr)
    return 2


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tools = {"support-table": support_table, "cache": cache}
    if not argv or argv[0] not in tools:
        return usage()
    return tools[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
