"""Where chapter 05's kernel spends its time: Nsight Compute on one launch, stored with provenance.

    python -m measure.profile_ch05                      # GPU and ncu: profile, save the JSON
    python -m measure.profile_ch05 --raw-dir DIR        # ... and keep ncu's CSV exports in DIR
    python -m measure.profile_ch05 --from-raw DIR       # re-read DIR (any machine, no GPU)

What the rows hold and how they are read: ``solutions.ch05_profile``.
"""

from __future__ import annotations

import sys

from measure._ncu import ProfileSpec, main_with
from solutions.ch05_profile import (
    EXTRA_METRICS,
    KERNEL_REGEX,
    RESULTS,
    SECTIONS,
    SHAPE,
    build_rows,
    config_label,
)

PRODUCES = [(f"results/h200/{RESULTS}.json", "python -m measure.profile_ch05 --raw-dir DIR",
             "Nsight Compute on one launch of chapter 05's kernel: pipes, each warp role's time, "
             "the steady KV turn's parts, stalls")]


def launch_twice(attention) -> None:
    """The profiled process: ``attention(q, k, v, causal)`` at SHAPE twice, the first compiles
    (ncu skips that launch)."""
    import torch

    from utils.reference import random_qkv

    q, k, v, _ = random_qkv(SHAPE["b"], SHAPE["s"], SHAPE["h"], SHAPE["d"], device="cuda")
    for _ in range(2):
        attention(q, k, v, SHAPE["causal"])
    torch.cuda.synchronize()


def _run_target() -> None:
    from solutions import ch05_flash_hopper as ch05

    launch_twice(ch05.attention)


def _label() -> str:
    from solutions import ch05_flash_hopper as ch05

    return config_label(ch05.default_config(SHAPE["d"]))


SPEC = ProfileSpec(RESULTS, "measure.profile_ch05", KERNEL_REGEX, SECTIONS, EXTRA_METRICS,
                   build_rows)


def _main(argv=None) -> int:
    return main_with(SPEC, _run_target, _label, argv, __doc__)


if __name__ == "__main__":
    sys.exit(_main())
