"""Where fa4_final's Hopper forward spends its time: Nsight Compute on one launch.

    python -m measure.profile_fa4_final                  # GPU and ncu: profile, save the JSON
    python -m measure.profile_fa4_final --raw-dir DIR    # ... and keep ncu's CSV exports in DIR
    python -m measure.profile_fa4_final --from-raw DIR   # re-read DIR (any machine, no GPU)

What the rows hold and how they are read: ``solutions.ch08_profile``.
"""

from __future__ import annotations

import sys

from measure._ncu import ProfileSpec, main_with
from measure.profile_ch05 import launch_twice
from solutions.ch05_profile import EXTRA_METRICS, SECTIONS
from solutions.ch08_profile import KERNEL_REGEX, RESULTS, build_rows, config_label, default_config

PRODUCES = [(f"results/h200/{RESULTS}.json", "python -m measure.profile_fa4_final --raw-dir DIR",
             "Nsight Compute on one launch of fa4_final's Hopper forward, read as chapter 05's")]


def _run_target() -> None:
    from fa4_final.api import interface

    launch_twice(interface.attention)


def _label() -> str:
    return config_label(default_config())


SPEC = ProfileSpec(RESULTS, "measure.profile_fa4_final", KERNEL_REGEX, SECTIONS, EXTRA_METRICS,
                   build_rows)


def _main(argv=None) -> int:
    return main_with(SPEC, _run_target, _label, argv, __doc__)


if __name__ == "__main__":
    sys.exit(_main())
