"""Legacy path of fa4_final.common.bwd_post (fa4_final/_legacy_paths.py): the same module."""

import sys

from fa4_final.common import bwd_post as _module

sys.modules[__name__] = _module
