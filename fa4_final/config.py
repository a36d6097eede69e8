"""Legacy path (fa4_final/_legacy_paths.py): its names live in fa4_final.hopper.config and,
HEAD_DIMS, fa4_final.common.constants."""

from fa4_final.common.constants import HEAD_DIMS  # noqa: F401
from fa4_final.hopper.config import *  # noqa: F403

# The fixed zigzag rounds, longest first over every head: the schedule's old spelling as the
# booleans it replaced (replace(cfg, **ZIGZAG_ROUNDS)).
ZIGZAG_ROUNDS = dict(schedule="zigzag", l2_sections=False)
