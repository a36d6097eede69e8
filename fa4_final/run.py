"""Legacy path (fa4_final/_legacy_paths.py): its names live in fa4_final.runtime.prologue."""

from fa4_final.runtime.dispatch import backend_for  # noqa: F401
from fa4_final.runtime.prologue import (  # noqa: F401
    backward_into,
    cached_backend,
    device_arch,
    forward,
    forward_into,
)
from fa4_final.runtime.prologue import backward_prepared as backward_checked  # noqa: F401
from fa4_final.runtime.prologue import forward_prepared as forward_checked  # noqa: F401
