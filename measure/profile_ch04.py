"""Where chapter 04's kernel spends its time: Nsight Compute on one launch, stored with provenance.

    python -m measure.profile_ch04                      # GPU and ncu: profile, save the JSON
    python -m measure.profile_ch04 --raw-dir DIR        # ... and keep ncu's CSV exports in DIR
    python -m measure.profile_ch04 --from-raw DIR       # re-read DIR (any machine, no GPU)

What the rows hold and how they are read: ``solutions.ch04_profile``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from measure._ncu import ProfileSpec, from_raw_with, main_with, profile_with
from solutions.ch04_profile import EXTRA_METRICS, KERNEL_REGEX, RESULTS, SECTIONS, SHAPE, build_rows

PRODUCES = [(f"results/h200/{RESULTS}.json", "python -m measure.profile_ch04 --raw-dir DIR",
             "Nsight Compute on one launch of chapter 04's kernel: pipes, occupancy, stalls, "
             "the KV loop's parts")]


def _target() -> None:
    """The profiled process: compile, then launch the default kernel a second time (ncu skips
    the first launch, which includes nothing but is the warm-up)."""
    import torch

    from solutions import ch04_flash_ampere as fa
    from utils.reference import random_qkv

    q, k, v, _ = random_qkv(SHAPE["b"], SHAPE["s"], SHAPE["h"], SHAPE["d"], device="cuda")
    for _ in range(2):
        fa.attention(q, k, v, SHAPE["causal"])
    torch.cuda.synchronize()


def _label() -> str:
    from solutions import ch04_flash_ampere as fa
    from utils.hardware import device_arch

    return fa.config_label(fa.default_config(SHAPE["d"], SHAPE["causal"], device_arch("cuda"),
                                             "bf16"))


SPEC = ProfileSpec(RESULTS, "measure.profile_ch04", KERNEL_REGEX, SECTIONS, EXTRA_METRICS,
                   build_rows)


def profile(raw_dir: Path | None = None) -> Path:
    """Run ncu on this GPU; save and return results/<gpu>/ch04_profile.json."""
    return profile_with(SPEC, _label(), raw_dir)


def from_raw(raw_dir: Path) -> Path:
    """Rebuild the results file from ncu exports kept by ``--raw-dir`` (with their provenance)."""
    return from_raw_with(SPEC, raw_dir)


def _main(argv=None) -> int:
    return main_with(SPEC, _target, _label, argv, __doc__)


if __name__ == "__main__":
    sys.exit(_main())
