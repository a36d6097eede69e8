"""SASS digests of fa4_final's default kernels: proof that a move or a knob deletion left the
compiled code alone.

    python -m tests.fa4_final_sass --write [NAME ...]   store digests (tests/data/sass_digests.json)
    python -m tests.fa4_final_sass [NAME ...]           compare with the stored ones

Each kernel is compiled from fake tensors for its real target (sm_90a, sm_100a), no GPU needed.
The digest is the SHA-256 of nvdisasm's SASS with the kernel symbols replaced by KERNEL0,
KERNEL1, ...: a symbol carries the Python module path of the kernel class
(``kernel_cutlass_kernel_fa4_finalhopperfwdHopperForward_...``), which a pure move changes and
nothing else does. tests/test_fa4_final_sass.py compares them (slow: about 50 compiles).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

DIGESTS = Path(__file__).parent / "data" / "sass_digests.json"


def _hopper_fwd(d, causal, varlen=False, build="default"):
    from dataclasses import replace

    from fa4_final.hopper.config import hopper_fwd_default
    from fa4_final.hopper.host import forward_recipe
    from fa4_final.runtime.compile import artifacts

    cfg = None
    if build == "zigzag rounds":  # walk_tiles' fixed-round path
        cfg = replace(hopper_fwd_default(d, causal), schedule="zigzag", l2_sections=False)
    elif build == "no overlap":  # turn's path without the intra-warpgroup overlap
        cfg = replace(hopper_fwd_default(d, causal), intra_wg_overlap=False)
    return artifacts(forward_recipe(d, "bf16", causal, cfg, varlen=varlen))


def _hopper_bwd(d, causal, det, varlen=False):
    from fa4_final.hopper.host import backward_recipe
    from fa4_final.runtime.compile import artifacts

    return artifacts(backward_recipe(d, "bf16", causal, deterministic=det, varlen=varlen))


def _blackwell_fwd(d, causal, two_cta=None):
    from dataclasses import replace

    from fa4_final.blackwell.config import blackwell_fwd_default
    from fa4_final.blackwell.host import forward_recipe
    from fa4_final.runtime.compile import artifacts

    cfg = blackwell_fwd_default(d, causal)
    if two_cta is not None:
        cfg = replace(cfg, two_cta=two_cta)
    return artifacts(forward_recipe(d, "bf16", causal, cfg))


def _blackwell_bwd(d, causal, two_cta=False):
    from fa4_final.blackwell.config import BlackwellBwdConfig
    from fa4_final.blackwell.host import backward_recipe
    from fa4_final.runtime.compile import artifacts

    return artifacts(backward_recipe(d, "bf16", causal, BlackwellBwdConfig(two_cta=two_cta)))


def kernels() -> dict:
    """name -> a function returning {role: Artifacts}: every default kernel that compiles."""
    out = {}
    for d in (64, 128):
        for causal in (False, True):
            c = "causal" if causal else "dense"
            out[f"hopper_fwd_d{d}_{c}"] = lambda d=d, causal=causal: _hopper_fwd(d, causal)
            out[f"hopper_varlen_fwd_d{d}_{c}"] = \
                lambda d=d, causal=causal: _hopper_fwd(d, causal, varlen=True)
            for det in (False, True):
                tag = "_det" if det else ""
                out[f"hopper_bwd_d{d}_{c}{tag}"] = \
                    lambda d=d, causal=causal, det=det: _hopper_bwd(d, causal, det)
            out[f"blackwell_fwd_d{d}_{c}"] = lambda d=d, causal=causal: _blackwell_fwd(d, causal)
            out[f"blackwell_bwd_d{d}_{c}"] = lambda d=d, causal=causal: _blackwell_bwd(d, causal)
            out[f"blackwell_bwd_pair_d{d}_{c}"] = \
                lambda d=d, causal=causal: _blackwell_bwd(d, causal, two_cta=True)
    # the other paths of the two methods chapter 08's exercises replace (turn, walk_tiles)
    out["hopper_fwd_d128_causal_zigzag_rounds"] = \
        lambda: _hopper_fwd(128, True, build="zigzag rounds")
    out["hopper_fwd_d128_dense_no_overlap"] = lambda: _hopper_fwd(128, False, build="no overlap")
    out["hopper_varlen_bwd_d128_causal"] = lambda: _hopper_bwd(128, True, False, varlen=True)
    out["hopper_varlen_bwd_d128_dense"] = lambda: _hopper_bwd(128, False, False, varlen=True)
    out["blackwell_fwd_d128_causal_2cta"] = lambda: _blackwell_fwd(128, True, two_cta=True)
    out["blackwell_fwd_d128_dense_1cta"] = lambda: _blackwell_fwd(128, False, two_cta=False)
    return out


_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.+?)\s*;")


def instructions(sass: str) -> list[str]:
    """The SASS's instructions in order, without addresses or symbol names."""
    return [m.group(1) for m in map(_INSTR.search, sass.splitlines()) if m]


def digest(art) -> str:
    """SHA-256 of the SASS, kernel symbols renamed in order of appearance."""
    sass = art.sass
    if not sass:
        raise RuntimeError("no SASS: nvdisasm is missing")
    names = []
    for m in re.finditer(r"kernel_cutlass_\w+", sass):
        if m.group(0) not in names:
            names.append(m.group(0))
    for i, name in sorted(enumerate(names), key=lambda p: -len(p[1])):
        sass = sass.replace(name, f"KERNEL{i}")
    return hashlib.sha256(sass.encode()).hexdigest()


def compute(names=None) -> dict:
    table = kernels()
    return {name: {role: digest(a) for role, a in sorted(table[name]().items())}
            for name in (names or table)}


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def stored() -> dict:
    return json.loads(DIGESTS.read_text())


def main(argv: list[str]) -> int:
    write = "--write" in argv
    names = [a for a in argv if not a.startswith("--")] or None
    now = {}
    for name in names or kernels():
        now.update(compute([name]))
        print(name, now[name], flush=True)
    if write:
        data = stored() if DIGESTS.exists() else {"commit": head_commit(), "kernels": {}}
        data["kernels"].update(now)
        DIGESTS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(now)} kernels into {DIGESTS}")
        return 0
    old = stored()["kernels"]
    bad = [n for n in now if old.get(n) != now[n]]
    print("identical" if not bad else f"DIFFERENT: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
