"""Legacy path (fa4_final/_legacy_paths.py): the Hopper host side lives in fa4_final.hopper.host
(recipes, launches, tile tables), the compile path in fa4_final.runtime.compile."""

from fa4_final._legacy_paths import compile_forward, forward_args  # noqa: F401
from fa4_final._legacy_paths import launch_backward_into as backward_into  # noqa: F401
from fa4_final._legacy_paths import launch_forward_into as forward_into  # noqa: F401
from fa4_final._legacy_paths import (  # noqa: F401
    launch_varlen_forward_into as varlen_forward_into,
)
from fa4_final.hopper.host import (  # noqa: F401
    ARCH,
    L2_BYTES_FOR_KV,
    _tile_counter,  # noqa: F401
    host_table,
    l2_section_pairs,
    split_workspace_dims,
    tile_costs,
)
from fa4_final.hopper.host import forward_fake_args as _fwd_fake_args  # noqa: F401
from fa4_final.hopper.host import num_sms as _num_sms  # noqa: F401
from fa4_final.hopper.host import timeline_buffer as _timeline_buffer  # noqa: F401
from fa4_final.runtime.compile import _PLANS  # noqa: F401
from fa4_final.runtime.compile import _PLANS as _COMPILED  # noqa: F401
from fa4_final.runtime.prologue import forward_timeline  # noqa: F401
