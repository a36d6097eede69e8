"""Legacy path (fa4_final/_legacy_paths.py): the backward's entry points live in
fa4_final.runtime.prologue, its recipe and launch in fa4_final.hopper.host and
fa4_final.common.backward; its self-check moved to the course."""

from fa4_final._legacy_paths import backward_compile_only as compile_only  # noqa: F401
from fa4_final._legacy_paths import compile_backward  # noqa: F401
from fa4_final._legacy_paths import launch_backward_into as launch_backward  # noqa: F401
from fa4_final.common.backward import fake_backward_args as _fake_args  # noqa: F401
from fa4_final.hopper.host import backward_config as _config  # noqa: F401
from fa4_final.runtime.prologue import backward, backward_into  # noqa: F401
