"""Numbers every kernel of the package shares, each spelt once."""

import math

import cutlass
import torch

LOG2_E = math.log2(math.e)  # exp(x) = exp2(x * LOG2_E): the softmax runs in the log2 domain
LN_2 = math.log(2.0)  # lse = log2-domain value * LN_2
HEAD_DIMS = (64, 128)  # what every kernel of the package is built for
# the Hopper backward's head dims beyond HEAD_DIMS with dv == D, dQ by one warpgroup
# (Note [dQ by one warpgroup] in fa4_final.hopper.bwd)
BWD_EXTRA_HEAD_DIMS = (96,)
# the Hopper backward's other (D, dv) pairs: D = 192 with dv = 128 (DeepSeek's MLA prefill) and,
# with dK and dV swapped, D = dv = 192 and 256 (Note [dK and dV swapped] in fa4_final.hopper.bwd)
BWD_HEAD_DIM_PAIRS = ((192, 128), (192, 192), (256, 256))
# every (head_dim, dv) the Hopper backward runs (Note [Head dims] in fa4_final.hopper.config):
# HEAD_DIMS and BWD_EXTRA_HEAD_DIMS with dv == head_dim, and the pairs of BWD_HEAD_DIM_PAIRS
BACKWARD_HEAD_DIMS = tuple(sorted({(d, d) for d in HEAD_DIMS + BWD_EXTRA_HEAD_DIMS}
                                  | set(BWD_HEAD_DIM_PAIRS)))
# the Hopper forward's head dims (Note [Head dims] in fa4_final.hopper.config): D of Q and K, and
# dv of V and O, each one of these
FWD_HEAD_DIMS = (64, 96, 128, 192, 256)
WARP_SIZE = 32
THREADS_PER_WARPGROUP = 128  # 4 warps: the unit that issues a Hopper wgmma
WGMMA_M = 64  # rows of one wgmma: each Hopper consumer warpgroup owns this many query rows

# Hopper: 227 KB of dynamic shared memory per CTA (opt-in maximum), 64 K registers per SM.
SM90_SMEM_BYTES = 227 * 1024
SM90_REGISTERS = 64 * 1024
# Blackwell (sm_100): the same 227 KB per CTA; 512 columns x 128 lanes x 32 bit of tensor memory.
SM100_SMEM_BYTES = 227 * 1024
SM100_TMEM_COLUMNS = 512

TORCH_TO_CUTLASS = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# a learnable sink may also be float32 (FA4 takes all three): the names its builds go by
SINK_DTYPE_NAMES = {torch.float32: "fp32", **DTYPE_NAMES}
CUTLASS_BY_NAME = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
