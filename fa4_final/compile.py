"""Legacy path (fa4_final/_legacy_paths.py): its names live in fa4_final.runtime.compile and,
the fake arguments, fa4_final.common.recipe."""

from fa4_final.common.recipe import fake_attention_tensors, fake_stream, fake_tensor  # noqa: F401
from fa4_final.runtime.compile import *  # noqa: F403
