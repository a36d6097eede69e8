"""Legacy path (fa4_final/_legacy_paths.py): its names live in fa4_final.runtime.checks."""

from fa4_final.runtime.checks import *  # noqa: F403
from fa4_final.runtime.checks import normalise_window as _normalise_window  # noqa: F401
