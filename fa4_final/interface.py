"""The PyTorch entry points: input checks, dispatch by architecture, the compile cache.

Layout convention (FlashAttention's): q (batch, seqlen_q, heads, dim), k and v (batch, seqlen_k,
heads_kv, dim) with heads % heads_kv == 0 (GQA/MQA); out like q; lse float32 (batch, heads,
seqlen_q), the natural log of each row's sum of exp(scale * q.k). Causal and window masks are
bottom-right aligned when seqlen_q != seqlen_k; a row that sees no key gets out = 0, lse = -inf.
"""

from __future__ import annotations

import math

import torch

from fa4_final.compile import cached, compile_kernel, fake_stream, fake_tensor
from fa4_final.config import HEAD_DIMS, HopperFwdConfig, hopper_fwd_default
from fa4_final.constants import CUTLASS_BY_NAME, DTYPE_NAMES, TORCH_TO_CUTLASS

SUPPORTED_ARCHS = {(9, 0): "sm_90a"}  # Blackwell (sm_100a) joins with chapter 09's kernel
_GPU_TABLE = "Hopper (H100/H200, sm_90)"


class UnsupportedError(ValueError):
    """A setup this package does not run, with what it does run."""


# ----------------------------------------------------------------------------------------------
# input checks


def _normalise_window(causal: bool, window_size) -> tuple[bool, int | None, int | None]:
    """(causal, left, right) with None for an unbounded side; FlashAttention's -1 also means
    unbounded. A window of (None, 0) is causal."""
    if window_size is None:
        window_size = (None, None)
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    sides = []
    for name, w in zip(("left", "right"), window_size):
        if w is None or (isinstance(w, int) and not isinstance(w, bool) and w < 0):
            sides.append(None)
        elif isinstance(w, int) and not isinstance(w, bool):
            sides.append(int(w))
        else:
            raise ValueError(f"window_size {name} must be an int >= 0, -1 or None, got {w!r}")
    left, right = sides
    if causal:
        if right not in (None, 0):
            raise ValueError(f"causal=True fixes window_size's right side to 0, got {right}")
        right = 0
    if right == 0 and left is None:
        causal = True
    return bool(causal or right == 0), left, right


def check_inputs(q, k, v, softmax_scale=None):
    """Validate q, k, v for the kernels; return (batch, seqlen_q, seqlen_k, heads, heads_kv,
    dim). Raises TypeError / ValueError saying what is wrong and what is accepted."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in TORCH_TO_CUTLASS:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: torch.bfloat16, "
                            f"torch.float16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, sq, h, d = q.shape
    bk, sk, hk, dk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if bk != b:
        raise ValueError(f"q has batch {b} but k and v have batch {bk}")
    if dk != d:
        raise ValueError(f"q has head_dim {d} but k and v have head_dim {dk}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {d}")
    if hk == 0 or h % hk:
        raise ValueError(f"q's {h} heads must be a multiple of k/v's {hk} heads (GQA/MQA)")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
                or not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be a finite number > 0 or None, got "
                             f"{softmax_scale!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tma_operand(name, t)
    return b, sq, sk, h, hk, d


def _check_tma_operand(name: str, t: torch.Tensor) -> None:
    """TMA reads tensors through a descriptor: the last dim contiguous, the other strides
    multiples of 16 bytes, a 16-byte aligned base."""
    if t.numel() == 0:
        return
    if t.stride(-1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride 1), got strides "
                         f"{t.stride()}; call .contiguous() first")
    bad = [st for st in t.stride()[:-1] if (st * t.element_size()) % 16]
    if bad or t.data_ptr() % 16:
        raise ValueError(
            f"{name} needs strides that are multiples of 16 bytes and a 16-byte aligned base "
            f"address (TMA): strides {t.stride()} of {t.element_size()}-byte elements, address "
            f"% 16 = {t.data_ptr() % 16}; call .contiguous() first")


def device_arch(device: torch.device) -> str:
    """The kernel target for ``device``, or an UnsupportedError naming what is supported."""
    if device.type != "cuda":
        raise UnsupportedError(f"fa4_final runs on CUDA GPUs ({_GPU_TABLE}); got a tensor on "
                               f"{device}")
    cap = torch.cuda.get_device_capability(device)
    if cap not in SUPPORTED_ARCHS:
        raise UnsupportedError(
            f"fa4_final has kernels for {_GPU_TABLE}; {torch.cuda.get_device_name(device)} has "
            f"compute capability {cap[0]}.{cap[1]}")
    return SUPPORTED_ARCHS[cap]


# ----------------------------------------------------------------------------------------------
# compiling


def _fwd_kernel(dtype_name: str, head_dim: int, causal: bool, has_left: bool, has_right: bool,
                config: HopperFwdConfig):
    from fa4_final.hopper.fwd import HopperForward

    return HopperForward(CUTLASS_BY_NAME[dtype_name], head_dim, causal, config,
                         has_window_left=has_left, has_window_right=has_right)


def _fwd_fake_args(dtype_name: str, head_dim: int, cfg: HopperFwdConfig):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from fa4_final.timeline import MARKS, MAX_STEPS

    dt = CUTLASS_BY_NAME[dtype_name]
    div = 128 // dt.width  # 16-byte strides (TMA), in elements
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))
    q = fake_tensor(dt, (b, sq, h, head_dim), divisibility=div)
    k = fake_tensor(dt, (b, sk, hk, head_dim), divisibility=div)
    v = fake_tensor(dt, (b, sk, hk, head_dim), divisibility=div)
    o = fake_tensor(dt, (b, sq, h, head_dim), divisibility=div)
    lse = fake_tensor(Float32, (b, h, sq), divisibility=1)
    timeline = fake_tensor(cutlass.Int64, (1 + cfg.num_consumer_wgs, MAX_STEPS, MARKS))
    return (q, k, v, o, lse, timeline, Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(1),
            fake_stream())


def compile_forward(arch: str = "sm_90a", head_dim: int = 128, dtype: str = "bf16",
                    causal: bool = False, config: HopperFwdConfig | None = None,
                    has_window_left: bool = False, has_window_right: bool = False,
                    keep: bool = False):
    """Compile the forward for ``arch`` with fake tensors (no GPU needed); returns
    (compiled, artifacts or None). The GPU path and compile-only share this one function."""
    if dtype not in CUTLASS_BY_NAME:
        raise ValueError(f"dtype must be one of {sorted(CUTLASS_BY_NAME)}, got {dtype!r}")
    if arch != "sm_90a":
        raise UnsupportedError(f"the Hopper forward uses wgmma, TMA and setmaxnreg: it compiles "
                               f"for arch='sm_90a' only, got {arch!r}")
    cfg = config or hopper_fwd_default(head_dim, causal)
    if not isinstance(cfg, HopperFwdConfig):
        raise TypeError(f"config must be a HopperFwdConfig or None, got {type(cfg).__name__}")
    kernel = _fwd_kernel(dtype, head_dim, causal, has_window_left, has_window_right, cfg)

    def build():
        return compile_kernel(kernel, *_fwd_fake_args(dtype, head_dim, cfg), arch=arch,
                              keep=keep)

    if keep:
        return build()
    return cached(("fwd", arch, kernel.cache_key()), lambda: build()[0]), None


def compile_only(arch: str = "sm_90a", head_dim: int = 128, dtype: str = "bf16",
                 causal: bool = False, config: HopperFwdConfig | None = None, **window):
    """The compiled forward's artifacts (PTX, SASS, resources), built on any machine."""
    return compile_forward(arch, head_dim, dtype, causal, config, keep=True, **window)[1]


# ----------------------------------------------------------------------------------------------
# running


def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def forward_into(q, k, v, out, lse, causal=False, softmax_scale=None, window_size=(None, None),
                 config: HopperFwdConfig | None = None):
    """Run the forward writing into ``out`` (like q) and ``lse`` ((b, h, sq) float32).
    Tests pass NaN-filled buffers here to prove every element is written."""
    b, sq, sk, h, hk, d = check_inputs(q, k, v, softmax_scale)
    causal, left, right = _normalise_window(causal, window_size)
    arch = device_arch(q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be like q {tuple(q.shape)} {q.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    _check_tma_operand("out", out)
    if lse.shape != (b, h, sq) or lse.dtype != torch.float32 or lse.stride(-1) != 1:
        raise ValueError(f"lse must be float32 {(b, h, sq)} with stride 1 last, got {lse.dtype} "
                         f"{tuple(lse.shape)} strides {lse.stride()}")
    if sq == 0 or b == 0 or h == 0:
        return out, lse
    if sk == 0:  # no key at all: every row is empty
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    has_right = right is not None and not causal
    compiled, _ = compile_forward(arch, d, DTYPE_NAMES[q.dtype], causal, config,
                                  has_window_left=left is not None, has_window_right=has_right)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    cfg = config or hopper_fwd_default(d, causal)
    group = h * b  # causal: longest first over every (head, batch) pair
    if cfg.l2_sections:
        group = l2_section_pairs(sk, d, q.element_size(), h * b)
    compiled(q, k, v, out, lse, _timeline_buffer(q.device, cfg), scale, left or 0, right or 0,
             group, _num_sms(q.device))
    return out, lse


_TIMELINES: dict = {}


def _timeline_buffer(device, cfg: HopperFwdConfig) -> torch.Tensor:
    """The int64 (roles, MAX_STEPS, MARKS) buffer a kernel built with ``timeline=True``
    writes its phase timestamps to (Note [Timeline]); other builds never touch it."""
    from fa4_final.timeline import MARKS, MAX_STEPS

    key = (device, cfg.num_consumer_wgs)
    if key not in _TIMELINES:
        _TIMELINES[key] = torch.zeros(1 + cfg.num_consumer_wgs, MAX_STEPS, MARKS,
                                      dtype=torch.int64, device=device)
    return _TIMELINES[key]


def forward_timeline(q, k, v, causal=False, config: HopperFwdConfig | None = None):
    """One run of the forward built with ``timeline=True``; returns the recorded (roles,
    MAX_STEPS, MARKS) cycle stamps of CTA 0's first tile as a CPU int64 tensor (0 = not
    reached). Role 0 is the producer (one stamp per K tile issued), role w + 1 consumer
    warpgroup w."""
    from dataclasses import replace

    cfg = replace(config or hopper_fwd_default(q.shape[-1], causal), timeline=True)
    buf = _timeline_buffer(q.device, cfg)
    buf.zero_()
    forward(q, k, v, causal, config=cfg)
    torch.cuda.synchronize(q.device)
    return buf.cpu().clone()


L2_BYTES_FOR_KV = 40 * 2**20  # of the H100/H200's 50 MB L2, what K and V may take


def l2_section_pairs(seqlen_k: int, head_dim: int, elem_bytes: int, pairs: int) -> int:
    """(head, batch) pairs per section of the causal tile order (scheduler, Note [Causal
    order]): the largest power of two whose K and V fit in L2, at least 1, at most ``pairs``."""
    per_pair = 2 * seqlen_k * head_dim * elem_bytes
    g = 1
    while 2 * g * per_pair <= L2_BYTES_FOR_KV and 2 * g <= pairs:
        g *= 2
    return g


def forward(q, k, v, causal=False, softmax_scale=None, window_size=(None, None), config=None):
    """(out, lse) of attention; see the module docstring for the conventions."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    return forward_into(q, k, v, out, lse, causal, softmax_scale, window_size, config)


def attention(q, k, v, causal=False, softmax_scale=None, config=None):
    """The course's common signature (every chapter's kernel has it): (out, lse)."""
    return forward(q, k, v, causal, softmax_scale, config=config)
