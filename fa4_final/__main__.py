"""``python -m fa4_final ...``: the package's small tools.

    python -m fa4_final support-table [--write README.md]   what each GPU runs (fa4_final.dispatch)
"""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = __doc__.strip().splitlines()[2:]


def support_table(argv: list[str]) -> int:
    from fa4_final.dispatch import render, support_table

    if not argv:
        print(support_table())
        return 0
    if argv[0] == "--write" and len(argv) == 2:
        path = Path(argv[1])
        path.write_text(render(path.read_text()))
        print(f"wrote the support table into {path}")
        return 0
    return usage()


def usage() -> int:
    print("usage:\n" + "\n".join(USAGE), file=sys.stderr)
    return 2


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    tools = {"support-table": support_table}
    if not argv or argv[0] not in tools:
        return usage()
    return tools[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
