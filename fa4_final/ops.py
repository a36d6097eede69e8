"""Legacy path of fa4_final.api.ops (fa4_final/_legacy_paths.py): the same module."""

import sys

from fa4_final.api import ops as _module

sys.modules[__name__] = _module
