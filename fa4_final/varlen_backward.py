"""Legacy path (fa4_final/_legacy_paths.py): the varlen backward's recipe and launch live in
fa4_final.hopper.host."""

from fa4_final._legacy_paths import compile_varlen_backward, varlen_backward_launch  # noqa: F401
from fa4_final._legacy_paths import varlen_compile_only as compile_only  # noqa: F401
from fa4_final.hopper.host import workspace_shapes  # noqa: F401
