"""Legacy path of fa4_final.common.softmax (fa4_final/_legacy_paths.py): the same module."""

import sys

from fa4_final.common import softmax as _module

sys.modules[__name__] = _module
