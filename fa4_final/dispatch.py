"""Legacy path of fa4_final.runtime.dispatch (fa4_final/_legacy_paths.py): the same module."""

import sys

from fa4_final.runtime import dispatch as _module

sys.modules[__name__] = _module
