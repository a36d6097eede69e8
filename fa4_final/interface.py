"""Legacy path (fa4_final/_legacy_paths.py): its names live in fa4_final.api.interface and the
runtime (prologue, checks, dispatch, varlen) and fa4_final.hopper.host."""

from fa4_final._legacy_paths import compile_forward  # noqa: F401
from fa4_final.api.interface import (  # noqa: F401
    attention,
    compile_only,
    flash_attn_func,
    flash_attn_varlen_func,
)
from fa4_final.common.errors import UnsupportedError  # noqa: F401
from fa4_final.hopper.host import l2_section_pairs  # noqa: F401
from fa4_final.runtime.checks import check_inputs, check_tma_operand  # noqa: F401
from fa4_final.runtime.checks import normalise_window as _normalise_window  # noqa: F401
from fa4_final.runtime.dispatch import (  # noqa: F401
    BACKENDS,
    backend_for,
    support_table,
    supported_list,
)
from fa4_final.runtime.prologue import (  # noqa: F401
    backward_into,
    device_arch,
    forward,
    forward_into,
    forward_timeline,
)
from fa4_final.runtime.varlen import varlen_backward_into, varlen_forward_into  # noqa: F401
