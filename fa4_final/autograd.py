"""Legacy path of fa4_final.api.autograd (fa4_final/_legacy_paths.py): the same module."""

import sys

from fa4_final.api import autograd as _module

sys.modules[__name__] = _module
