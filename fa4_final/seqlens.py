"""Legacy path of fa4_final.common.seqlens (fa4_final/_legacy_paths.py): the same module."""

import sys

from fa4_final.common import seqlens as _module

sys.modules[__name__] = _module
