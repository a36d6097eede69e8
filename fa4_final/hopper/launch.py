"""What runs the Hopper kernels from torch: compile (through the cache), then launch. Chapter 13.

Inputs arrive checked (fa4_final.interface); these functions only pick the compiled kernel for
the dtype, head dim and masks and pass the run-time arguments. The backward plugs in through one
function, ``backward_kernel()``: it finds ``fa4_final.hopper.bwd.backward_into`` (chapter 11)
or says that this build lacks it.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from fa4_final.common.constants import CUTLASS_BY_NAME, DTYPE_NAMES, THREADS_PER_WARPGROUP, WGMMA_M
from fa4_final.common.errors import UnsupportedError
from fa4_final.common.schedule import (
    TILE_OVERHEAD_STEPS,
    WHOLE_TILE_KEYS,
    persistent_grid,
    split_tail_table,
    tile_coords,
    tile_table,
)
from fa4_final.common.tiles import TileWindow, kv_tile_range
from fa4_final.compile import (
    cached,
    compile_kernel,
    fake_attention_tensors,
    fake_stream,
    fake_tensor,
)
from fa4_final.config import HopperFwdConfig, hopper_fwd_default

ARCH = "sm_90a"
BACKWARD_MODULE = "fa4_final.backward"  # backward_into over fa4_final.hopper.bwd (chapter 11)
L2_BYTES_FOR_KV = 40 * 2**20  # of the H100/H200's 50 MB L2, what K and V may take

# compile_forward's arguments -> the compiled kernel, in front of the cache: a call of the
# forward must not pay for building the kernel object and its key (tens of us) every time.
_COMPILED: dict = {}


# ----------------------------------------------------------------------------------------------
# compiling


def _fwd_kernel(dtype_name: str, head_dim: int, causal: bool, has_left: bool, has_right: bool,
                config: HopperFwdConfig, varlen: bool = False, has_seqused_k: bool = False):
    from fa4_final.hopper.fwd import HopperForward

    return HopperForward(CUTLASS_BY_NAME[dtype_name], head_dim, causal, config,
                         has_window_left=has_left, has_window_right=has_right, varlen=varlen,
                         has_seqused_k=has_seqused_k)


def _fwd_fake_args(dtype_name: str, head_dim: int, cfg: HopperFwdConfig, varlen: bool = False,
                   has_seqused_k: bool = False):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from fa4_final.common.timeline import MARKS, MAX_STEPS

    q, k, v, o, lse = fake_attention_tensors(CUTLASS_BY_NAME[dtype_name], head_dim)
    timeline = fake_tensor(cutlass.Int64, (1 + cfg.num_consumer_wgs, MAX_STEPS, MARKS))
    # varlen: (batch + 1,) offsets and (batch,) used key counts, int32 (fa4_final.varlen)
    cu_q, cu_k, used_k = (fake_tensor(Int32, (cute.sym_int(),)) if varlen else None
                          for _ in range(3))
    used_k = used_k if has_seqused_k else None
    table = fake_tensor(Int32, (cute.sym_int(),)) if cfg.tile_table and not varlen else None
    # split_tail (scheduler Note [Split tail]): (slots, O elements, threads) and (slots, 2 *
    # rows, threads) float32 per consumer thread, one int32 counter per slot
    part_o = part_ml = counters = None
    if cfg.splits_tail and not varlen:
        threads, elems, rows = split_workspace_dims(cfg, head_dim)
        part_o = fake_tensor(Float32, (cute.sym_int(), elems, threads))
        part_ml = fake_tensor(Float32, (cute.sym_int(), 2 * rows, threads))
        counters = fake_tensor(Int32, (cute.sym_int(),))
    tile_counter = fake_tensor(Int32, (1,)) if cfg.schedules_dynamically else None
    return (q, k, v, o, lse, timeline, Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(1),
            cu_q, cu_k, used_k, table, part_o, part_ml, counters, tile_counter, fake_stream())


def split_workspace_dims(cfg: HopperFwdConfig, head_dim: int) -> tuple[int, int, int]:
    """(consumer threads, O elements per thread, rows per thread) of the split tail's
    workspace: a wgmma accumulator gives each thread of a warpgroup 64 * N / 128 elements of
    its 64 rows, in 2 rows."""
    threads = THREADS_PER_WARPGROUP * cfg.num_consumer_wgs
    return threads, WGMMA_M * head_dim // THREADS_PER_WARPGROUP, 2


def compile_forward(arch: str = ARCH, head_dim: int = 128, dtype: str = "bf16",
                    causal: bool = False, config: HopperFwdConfig | None = None,
                    has_window_left: bool = False, has_window_right: bool = False,
                    keep: bool = False, varlen: bool = False, has_seqused_k: bool = False):
    """Compile the forward for ``arch`` with fake tensors (no GPU needed); returns
    (compiled, artifacts or None). The GPU path and compile-only share this one function;
    without ``keep`` the result comes from the compile cache (fa4_final.cache). ``varlen``:
    the packed-sequence variant (varlen_forward_into), with ``has_seqused_k`` or without."""
    if dtype not in CUTLASS_BY_NAME:
        raise ValueError(f"dtype must be one of {sorted(CUTLASS_BY_NAME)}, got {dtype!r}")
    if arch != ARCH:
        raise UnsupportedError(f"the Hopper forward uses wgmma, TMA and setmaxnreg: it compiles "
                               f"for arch='{ARCH}' only, got {arch!r}")
    cfg = config or hopper_fwd_default(head_dim, causal, varlen)
    if not isinstance(cfg, HopperFwdConfig):
        raise TypeError(f"config must be a HopperFwdConfig or None, got {type(cfg).__name__}")
    memo = (arch, head_dim, dtype, bool(causal), cfg, bool(has_window_left),
            bool(has_window_right), bool(varlen), bool(varlen and has_seqused_k))
    if not keep and memo in _COMPILED:  # the per-call path: a dict lookup, about 1 us
        return _COMPILED[memo], None
    kernel = _fwd_kernel(dtype, head_dim, causal, has_window_left, has_window_right, cfg,
                         varlen, has_seqused_k)

    def build():
        return compile_kernel(kernel, *_fwd_fake_args(dtype, head_dim, cfg, varlen,
                                                      has_seqused_k), arch=arch, keep=keep)

    if keep:
        return build()
    _COMPILED[memo] = cached(("fwd", arch, kernel.cache_key()), lambda: build()[0])
    return _COMPILED[memo], None


# ----------------------------------------------------------------------------------------------
# running


def l2_section_pairs(seqlen_k: int, head_dim: int, elem_bytes: int, pairs: int) -> int:
    """(head, batch) pairs per section of the causal tile order (scheduler, Note [Causal
    order]): the largest power of two whose K and V fit in L2, at least 1, at most ``pairs``."""
    per_pair = 2 * seqlen_k * head_dim * elem_bytes
    g = 1
    while 2 * g * per_pair <= L2_BYTES_FOR_KV and 2 * g <= pairs:
        g *= 2
    return g


_SMS: dict = {}


def _num_sms(device) -> int:
    sms = _SMS.get(device)
    if sms is None:  # the device's properties do not change: read them once
        sms = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return sms


# What a forward call of one kind needs besides its tensors, looked up once: (compile_forward,
# _num_sms, device, head dim, dtype, causal, has_left, has_right, config) -> (compiled kernel,
# the config, the timeline buffer, the SM count). The functions are in the key so
# that a test or tool replacing one of them never meets an entry made with the other.
_PLANS: dict = {}


def _forward_plan(q, causal: bool, has_left: bool, has_right: bool, config):
    d = q.shape[-1]
    key = (compile_forward, _num_sms, q.device, d, q.dtype, causal, has_left, has_right, config)
    plan = _PLANS.get(key)
    if plan is None:
        compiled, _ = compile_forward(ARCH, d, DTYPE_NAMES[q.dtype], causal, config,
                                      has_window_left=has_left, has_window_right=has_right)
        cfg = config or hopper_fwd_default(d, causal)
        plan = _PLANS[key] = (compiled, cfg, _timeline_buffer(q.device, cfg),
                              _num_sms(q.device))
    return plan


def forward_into(q, k, v, out, lse, causal: bool, softmax_scale: float, window_left,
                 window_right, config: HopperFwdConfig | None = None):
    """Launch the forward on checked, non-empty inputs (window sides None when unbounded)."""
    compiled, args = forward_args(q, k, v, out, lse, causal, softmax_scale, window_left,
                                  window_right, config)
    compiled(*args)


def forward_args(q, k, v, out, lse, causal: bool, softmax_scale: float, window_left,
                 window_right, config: HopperFwdConfig | None = None):
    """(compiled kernel, its run-time arguments) for one dense forward call: what
    forward_into launches, for a tool that times the launch alone."""
    b, _, h, d = q.shape
    compiled, cfg, timeline, sms = _forward_plan(
        q, causal, window_left is not None, window_right is not None and not causal, config)
    group = h * b  # causal: longest first over every (head, batch) pair
    if cfg.l2_sections:
        group = l2_section_pairs(k.shape[1], d, q.element_size(), h * b)
    table, slots = None, 0
    if cfg.tile_table:
        table, slots = _tile_table(q.device, cfg, causal, q.shape[1], k.shape[1], h, b, group,
                                   sms, window_left, None if causal else window_right)
    part_o = part_ml = counters = None
    if cfg.splits_tail:  # Note [Split tail]: a workspace per call (one slot at least)
        threads, elems, rows = split_workspace_dims(cfg, d)
        n = max(slots, 1)
        part_o = torch.empty((n, elems, threads), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((n, 2 * rows, threads), dtype=torch.float32, device=q.device)
        counters = torch.zeros(n, dtype=torch.int32, device=q.device)
    tile_counter = _tile_counter(q.device) if cfg.schedules_dynamically else None
    return compiled, (q, k, v, out, lse, timeline, softmax_scale, window_left or 0,
                      window_right or 0, group, sms, None, None, None, table, part_o, part_ml,
                      counters, tile_counter)


def varlen_forward_into(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                        max_seqlen_k, out, lse, causal: bool, softmax_scale: float, window_left,
                        window_right, config: HopperFwdConfig | None = None):
    """One launch of the varlen kernel on checked inputs: q (total_q, h, d), k and v (total_k,
    h_kv, d), out like q, lse (h, total_q) (fa4_final.varlen). The packed tensors go in as a
    batch of one; the kernel finds each tile's sequence from the offsets (common.seqlens)."""
    total_q, h, d = q.shape
    if total_q == 0:
        return
    if k.shape[0] == 0:  # no key anywhere (a TMA descriptor cannot have an empty extent)
        out.zero_()
        lse.fill_(float("-inf"))
        return
    has_right = window_right is not None and not causal
    compiled, _ = compile_forward(ARCH, d, DTYPE_NAMES[q.dtype], causal, config,
                                  has_window_left=window_left is not None,
                                  has_window_right=has_right, varlen=True,
                                  has_seqused_k=seqused_k is not None)
    cfg = config or hopper_fwd_default(d, causal, varlen=True)
    group = h  # causal: longest first over every head of a sequence (Note [Varlen order])
    if cfg.l2_sections:
        longest_k = max_seqlen_k if max_seqlen_k is not None and max_seqlen_k >= 0 \
            else k.shape[0]
        group = l2_section_pairs(longest_k, d, q.element_size(), h)
    compiled(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0),
             _timeline_buffer(q.device, cfg), softmax_scale, window_left or 0,
             window_right or 0, group, _num_sms(q.device), cu_seqlens_q.contiguous(),
             cu_seqlens_k.contiguous(), None if seqused_k is None else seqused_k.contiguous(),
             None, None, None, None,
             _tile_counter(q.device) if cfg.schedules_dynamically else None)


_TABLES: dict = {}
_MAX_TABLES = 256  # a table is about one int32 per tile; built on the first call of a shape


def tile_costs(cfg: HopperFwdConfig, causal: bool, seqlen_q: int, seqlen_k: int, heads: int,
               batch: int, l2_group: int, window_left=None, window_right=None) -> list[int]:
    """Each linear tile's cost in key-tile steps, in the kernel's tile order (Note [Tile
    table]): the key tiles it visits plus the per-tile overhead."""
    window = TileWindow(cfg.tile_m, cfg.tile_n, causal, has_left=window_left is not None,
                        has_right=window_right is not None and not causal)
    num_m_blocks = -(-seqlen_q // cfg.tile_m)
    per_m_block = []
    for m in range(num_m_blocks):
        n_min, n_max, _, _ = kv_tile_range(window, m, seqlen_q, seqlen_k, window_left,
                                           window_right)
        per_m_block.append(max(n_max - n_min, 0) + TILE_OVERHEAD_STEPS)
    return [per_m_block[tile_coords(t, num_m_blocks, heads, batch, causal, l2_group)[0]]
            for t in range(num_m_blocks * heads * batch)]


def _tile_table(device, cfg: HopperFwdConfig, causal: bool, seqlen_q: int, seqlen_k: int,
                heads: int, batch: int, l2_group: int, sms: int, window_left, window_right):
    """The device copy of the launch's tile table, built once per shape (Note [Tile table]),
    and its number of split-tail slots. Its first call for a shape copies the table to the
    device, so a CUDA graph should be captured after a warm-up call of that shape, as for the
    compile."""
    key = (device, cfg.tile_m, cfg.tile_n, cfg.splits_tail, causal, seqlen_q, seqlen_k, heads,
           batch, l2_group, sms, window_left, window_right)
    if key not in _TABLES:
        if len(_TABLES) >= _MAX_TABLES:  # many shapes (e.g. a length per batch): keep it bounded
            _TABLES.clear()
        flat, slots = host_table(cfg, causal, seqlen_q, seqlen_k, heads, batch, l2_group, sms,
                                 window_left, window_right)
        _TABLES[key] = (torch.tensor(flat, dtype=torch.int32, device=device), slots)
    return _TABLES[key]


def host_table(cfg: HopperFwdConfig, causal: bool, seqlen_q: int, seqlen_k: int, heads: int,
               batch: int, l2_group: int, sms: int, window_left=None, window_right=None):
    """(flat table, split-tail slots) for one shape, as lists: Note [Tile table], or with
    split_tail Note [Split tail] when every tile costs the same (no causal diagonal, no
    window); otherwise its entries are the list schedule's, each a whole tile."""
    costs = tile_costs(cfg, causal, seqlen_q, seqlen_k, heads, batch, l2_group, window_left,
                       window_right)
    grid = persistent_grid(len(costs), sms)
    if not cfg.splits_tail:
        return tile_table(costs, grid), 0
    if len(set(costs)) == 1:
        return split_tail_table(len(costs), costs[0] - TILE_OVERHEAD_STEPS, grid)
    whole = (0, WHOLE_TILE_KEYS, -1, 0, 0)
    return [f for t in tile_table(costs, grid) for f in (t, *whole)], 0


_TILE_COUNTERS: dict = {}
_MAX_TILE_COUNTERS = 64


def _tile_counter(device) -> torch.Tensor:
    """The int32 counter the dynamic scheduler takes tiles from (Note [Dynamic tiles]): one
    per (device, stream), zeroed once here and set back to zero by each launch's last fetch,
    so launches that follow each other on a stream share it and launches on two streams,
    which may overlap, do not. While a CUDA graph is being captured the counter is a fresh
    one that the graph zeroes itself (its memset is captured with the launch)."""
    key = (device, None)  # a device without CUDA streams (tests on the CPU): one counter
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(1, dtype=torch.int32, device=device)
        key = (device, torch.cuda.current_stream(device).cuda_stream)
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        if len(_TILE_COUNTERS) >= _MAX_TILE_COUNTERS:  # a new stream per call: stay bounded
            _TILE_COUNTERS.clear()  # (each was allocated on its stream: freed in its order)
        counter = _TILE_COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


_TIMELINES: dict = {}


def _timeline_buffer(device, cfg: HopperFwdConfig) -> torch.Tensor:
    """The int64 (roles, MAX_STEPS, MARKS) buffer a kernel built with ``timeline=True``
    writes its phase stamps to (Note [Timeline]); other builds never touch it."""
    from fa4_final.common.timeline import MARKS, MAX_STEPS

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

    from fa4_final.run import forward

    cfg = replace(config or hopper_fwd_default(q.shape[-1], causal), timeline=True)
    buf = _timeline_buffer(q.device, cfg)
    buf.zero_()
    forward(q, k, v, causal, config=cfg)
    torch.cuda.synchronize(q.device)
    return buf.cpu().clone()


_BACKWARD_FN: dict = {}  # BACKWARD_MODULE -> its backward_into, once found


def backward_kernel():
    """``fa4_final.backward.backward_into``, or NotImplementedError naming what is missing.
    An import error inside a present module is not hidden."""
    fn = _BACKWARD_FN.get(BACKWARD_MODULE)
    if fn is not None:
        return fn
    if importlib.util.find_spec(BACKWARD_MODULE) is None:
        raise NotImplementedError(
            f"the Hopper backward is not in this build of fa4_final: {BACKWARD_MODULE} is "
            f"missing (chapter 11). The forward runs; gradients need backward_into(q, k, v, "
            f"out, lse, dout, dq, dk, dv, causal, softmax_scale, window_size, deterministic)")
    fn = getattr(importlib.import_module(BACKWARD_MODULE), "backward_into", None)
    if fn is None:
        raise NotImplementedError(f"{BACKWARD_MODULE} has no backward_into(q, k, v, out, lse, "
                                  f"dout, dq, dk, dv, ...) yet: the Hopper backward is not wired")
    _BACKWARD_FN[BACKWARD_MODULE] = fn
    return fn


def backward_into(q, k, v, out, lse, dout, dq, dk, dv, causal: bool, softmax_scale: float,
                  window_left, window_right, deterministic: bool = False):
    """Run the Hopper backward writing dq, dk, dv (inputs checked, non-empty). A backward_into
    that offers ``checked_inputs`` (fa4_final.backward's does: its launches without its
    checks) gets the call there, as the inputs were checked already."""
    fn = backward_kernel()
    checked = getattr(fn, "checked_inputs", None)
    if checked is not None:
        checked(q, k, v, out, lse, dout, dq, dk, dv, causal, softmax_scale, window_left,
                window_right, deterministic, arch=ARCH)
        return
    fn(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, softmax_scale=softmax_scale,
       window_size=(window_left, window_right), deterministic=deterministic)
