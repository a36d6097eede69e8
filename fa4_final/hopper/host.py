"""The Hopper kernels' host side: what to compile (recipes) and how to launch what was compiled.

One contract for every launch: the inputs are checked and not empty, the window sides are None
when unbounded (causal: right = 0), the softmax scale is resolved, and ``plan`` holds the
compiled kernels by role and the resolved config (fa4_final.runtime.compile.compiled, from the
recipe of the same arguments). The runtime's prologue does all of that before it calls here.

    forward_recipe / backward_recipe        kernels, fake arguments, config of one pass
    launch_forward / launch_varlen_forward  one launch of the forward
    launch_backward / launch_varlen_backward  bwd_pre, the main kernel, bwd_post
    decode_recipe / launch_decode           the decode forward (packed GQA, split-KV, paged)
"""

from __future__ import annotations

from dataclasses import replace

import cutlass
import torch

from fa4_final.common import backward as shared_backward
from fa4_final.common.backward import launch_backward  # noqa: F401  (the contract's backward)
from fa4_final.common.bwd_tiles import dq_accum_tiles
from fa4_final.common.constants import CUTLASS_BY_NAME, THREADS_PER_WARPGROUP, WGMMA_M
from fa4_final.common.errors import UnsupportedError
from fa4_final.common.recipe import Recipe, fake_attention_tensors, fake_stream, fake_tensor
from fa4_final.common.schedule import (
    TILE_OVERHEAD_STEPS,
    WHOLE_TILE_KEYS,
    persistent_grid,
    split_tail_table,
    tile_coords,
    tile_table,
)
from fa4_final.common.tiles import TileWindow, kv_tile_range
from fa4_final.common.timeline import MARKS, MAX_STEPS
from fa4_final.hopper.config import (
    HopperBwdConfig,
    HopperDecodeConfig,
    HopperFwdConfig,
    hopper_bwd_default,
    hopper_bwd_det_copies,
    hopper_bwd_softcap,
    hopper_decode_default,
    hopper_fwd_default,
)

ARCH = "sm_90a"
# the learnable sink's element types (FA4 takes these three), by name
SINK_DTYPES = {"fp32": cutlass.Float32, "bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
L2_BYTES_FOR_KV = 40 * 2**20  # of the H100/H200's 50 MB L2, what K and V may take


def _check_target(dtype: str, arch: str, what: str) -> None:
    if dtype not in CUTLASS_BY_NAME:
        raise ValueError(f"dtype must be one of {sorted(CUTLASS_BY_NAME)}, got {dtype!r}")
    if arch != ARCH:
        raise UnsupportedError(f"the Hopper {what} uses wgmma, TMA and setmaxnreg: it compiles "
                               f"for arch='{ARCH}' only, got {arch!r}")


# ----------------------------------------------------------------------------------------------
# the forward


def forward_kernel(dtype_name: str, head_dim: int, causal: bool, has_left: bool,
                   has_right: bool, config: HopperFwdConfig, varlen: bool = False,
                   has_seqused_k: bool = False, softcap: float = 0.0,
                   sink_dtype: str | None = None, head_dim_v: int | None = None,
                   has_seqused_q: bool = False):
    """The forward's kernel object (looked up by forward_recipe at each call: a teaching
    module may put its own kernel here). ``softcap``, ``sink_dtype``: Note [Softcap] and
    Note [Learnable sink] (fa4_final.common.softmax); ``head_dim_v``: dv of V and O when it is
    not D (Note [Head dims] in fa4_final.hopper.config)."""
    from fa4_final.hopper.fwd import HopperForward

    extra = {}  # only when asked: a kernel a teaching module puts here need not know them
    if softcap or sink_dtype is not None:
        extra = dict(softcap=softcap, sink_dtype=SINK_DTYPES[sink_dtype] if sink_dtype
                     else None)
    if head_dim_v is not None and head_dim_v != head_dim:
        extra["head_dim_v"] = head_dim_v
    if has_seqused_q:  # Note [Used query rows] (fa4_final.common.seqlens)
        extra["has_seqused_q"] = True
    return HopperForward(CUTLASS_BY_NAME[dtype_name], head_dim, causal, config,
                         has_window_left=has_left, has_window_right=has_right, varlen=varlen,
                         has_seqused_k=has_seqused_k, **extra)


def forward_fake_args(dtype_name: str, head_dim: int, cfg: HopperFwdConfig,
                      varlen: bool = False, has_seqused_k: bool = False,
                      sink_dtype: str | None = None, head_dim_v: int | None = None,
                      has_seqused_q: bool = False) -> tuple:
    """The forward's fake arguments, in its launch order."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    q, k, v, o, lse = fake_attention_tensors(CUTLASS_BY_NAME[dtype_name], head_dim, head_dim_v)
    timeline = fake_tensor(cutlass.Int64, (1 + cfg.num_consumer_wgs, MAX_STEPS, MARKS))
    # varlen: (batch + 1,) offsets and (batch,) used key counts, int32 (runtime.varlen)
    cu_q, cu_k, used_k = (fake_tensor(Int32, (cute.sym_int(),)) if varlen else None
                          for _ in range(3))
    used_k = used_k if has_seqused_k else None
    table = fake_tensor(Int32, (cute.sym_int(),)) if cfg.uses_table and not varlen else None
    # split_tail (schedule Note [Split tail]): (slots, O elements, threads) and (slots, 2 *
    # rows, threads) float32 per consumer thread, one int32 counter per slot
    part_o = part_ml = counters = None
    if cfg.splits_tail and not varlen:
        threads, elems, rows = split_workspace_dims(cfg, head_dim_v or head_dim)
        part_o = fake_tensor(Float32, (cute.sym_int(), elems, threads))
        part_ml = fake_tensor(Float32, (cute.sym_int(), 2 * rows, threads))
        counters = fake_tensor(Int32, (cute.sym_int(),))
    tile_counter = fake_tensor(Int32, (1,)) if cfg.schedules_dynamically else None
    args = (q, k, v, o, lse, timeline, Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(1),
            cu_q, cu_k, used_k, table, part_o, part_ml, counters, tile_counter, fake_stream())
    if sink_dtype is not None:  # (heads,): its own symbolic extent, contiguous
        args += (fake_tensor(SINK_DTYPES[sink_dtype], (cute.sym_int(),)),)
    if varlen and has_seqused_q:  # (batch,) int32 (Note [Used query rows]); after the sink's
        args += (() if sink_dtype is not None else (None,)) + (
            fake_tensor(Int32, (cute.sym_int(),)),)
    return args


def split_workspace_dims(cfg: HopperFwdConfig, head_dim: int) -> tuple[int, int, int]:
    """(consumer threads, O elements per thread, rows per thread) of the split tail's
    workspace: a wgmma accumulator gives each thread of a warpgroup 64 * N / 128 elements of
    its 64 rows, in 2 rows (``head_dim``: O's, dv)."""
    threads = THREADS_PER_WARPGROUP * cfg.num_consumer_wgs
    return threads, WGMMA_M * head_dim // THREADS_PER_WARPGROUP, 2


def forward_recipe(head_dim: int = 128, dtype: str = "bf16", causal: bool = False,
                   config: HopperFwdConfig | None = None, has_window_left: bool = False,
                   has_window_right: bool = False, varlen: bool = False,
                   has_seqused_k: bool = False, arch: str = ARCH, softcap: float = 0.0,
                   sink_dtype: str | None = None, head_dim_v: int | None = None,
                   has_seqused_q: bool = False) -> Recipe:
    """The forward for one (head dim, dtype, masks, config): dense, or with ``varlen`` the
    packed-sequence variant (with ``has_seqused_k`` or without); ``softcap`` (0.0: none) and
    ``sink_dtype`` ("fp32", "bf16", "fp16" or None: no learnable sink) build the variants of
    Note [Softcap] and Note [Learnable sink]; ``head_dim_v``: dv of V and O, D if None
    (Note [Head dims]); ``has_seqused_q``: the varlen variant that takes seqused_q
    (Note [Used query rows])."""
    _check_target(dtype, arch, "forward")
    head_dim_v = None if head_dim_v == head_dim else head_dim_v
    cfg = config or hopper_fwd_default(head_dim, causal, varlen, head_dim_v)
    if not isinstance(cfg, HopperFwdConfig):
        raise TypeError(f"config must be a HopperFwdConfig or None, got {type(cfg).__name__}")
    has_seqused_k = varlen and has_seqused_k
    has_seqused_q = varlen and has_seqused_q
    if sink_dtype is not None and sink_dtype not in SINK_DTYPES:
        raise ValueError(f"sink_dtype must be one of {sorted(SINK_DTYPES)} or None, got "
                         f"{sink_dtype!r}")
    kernel = forward_kernel(dtype, head_dim, causal, has_window_left, has_window_right, cfg,
                            varlen, has_seqused_k, softcap, sink_dtype, head_dim_v,
                            has_seqused_q)
    return Recipe("fwd", ARCH, {"main": kernel},
                  lambda role: forward_fake_args(dtype, head_dim, cfg, varlen, has_seqused_k,
                                                 sink_dtype, head_dim_v, has_seqused_q),
                  cfg)


def l2_section_pairs(seqlen_k: int, head_dim: int, elem_bytes: int, pairs: int) -> int:
    """(head, batch) pairs per section of the causal tile order (schedule,
    Note [Causal order]): the largest power of two whose K and V fit in L2, at least 1, at most
    ``pairs``."""
    per_pair = 2 * seqlen_k * head_dim * elem_bytes
    g = 1
    while 2 * g * per_pair <= L2_BYTES_FOR_KV and 2 * g <= pairs:
        g *= 2
    return g


_SMS: dict = {}


def num_sms(device) -> int:
    """The device's SM count, read once."""
    sms = _SMS.get(device)
    if sms is None:
        sms = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return sms


def forward_args(plan, q, k, v, out, lse, causal: bool, softmax_scale: float, window_left,
                 window_right, learnable_sink=None) -> tuple:
    """The run-time arguments of one dense forward launch of ``plan``: what launch_forward
    passes, for a tool that times the launch alone. ``learnable_sink``: (heads,), for a plan
    built with its sink_dtype (Note [Learnable sink])."""
    cfg = plan.config
    b, _, h, d = q.shape
    dv = v.shape[-1]
    sms = num_sms(q.device)
    group = h * b  # causal: longest first over every (head, batch) pair
    if cfg.l2_sections:  # K and V of a pair: D + dv columns
        group = l2_section_pairs(k.shape[1], (d + dv) // 2, q.element_size(), h * b)
    table, slots = None, 0
    if cfg.uses_table:
        table, slots = _tile_table(q.device, cfg, causal, q.shape[1], k.shape[1], h, b, group,
                                   sms, window_left, None if causal else window_right)
    part_o = part_ml = counters = None
    if cfg.splits_tail:  # Note [Split tail]: a workspace per call (one slot at least)
        threads, elems, rows = split_workspace_dims(cfg, dv)
        n = max(slots, 1)
        part_o = torch.empty((n, elems, threads), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((n, 2 * rows, threads), dtype=torch.float32, device=q.device)
        counters = torch.zeros(n, dtype=torch.int32, device=q.device)
    tile_counter = _tile_counter(q.device) if cfg.schedules_dynamically else None
    args = (q, k, v, out, lse, timeline_buffer(q.device, cfg), softmax_scale, window_left or 0,
            window_right or 0, group, sms, None, None, None, table, part_o, part_ml, counters,
            tile_counter)
    return args if learnable_sink is None else args + (learnable_sink,)


def launch_forward(plan, q, k, v, out, lse, causal: bool, softmax_scale: float, window_left,
                   window_right, learnable_sink=None) -> None:
    """One launch of the dense forward (the module's contract)."""
    plan.kernels["main"](*forward_args(plan, q, k, v, out, lse, causal, softmax_scale,
                                       window_left, window_right, learnable_sink))


def launch_varlen_forward(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                          max_seqlen_k, out, lse, causal: bool, softmax_scale: float,
                          window_left, window_right, learnable_sink=None,
                          seqused_q=None) -> None:
    """One launch of the varlen forward: q (total_q, h, d), k and v (total_k, h_kv, d), out like
    q, lse (h, total_q), none of them empty. The packed tensors go in as a batch of one; the
    kernel finds each tile's sequence from the offsets (common.seqlens). ``seqused_q``: (batch,)
    int32, for a plan built with has_seqused_q (Note [Used query rows])."""
    total_q, h, d = q.shape
    cfg = plan.config
    group = h  # causal: longest first over every head of a sequence (Note [Varlen order])
    if cfg.l2_sections:
        longest_k = max_seqlen_k if max_seqlen_k is not None and max_seqlen_k >= 0 \
            else k.shape[0]
        group = l2_section_pairs(longest_k, (d + v.shape[-1]) // 2, q.element_size(), h)
    sink = () if learnable_sink is None else (learnable_sink,)  # Note [Learnable sink]
    if seqused_q is not None:  # Note [Used query rows]: after the sink's place
        sink = (learnable_sink, seqused_q.contiguous())
    plan.kernels["main"](
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0),
        timeline_buffer(q.device, cfg), softmax_scale, window_left or 0, window_right or 0,
        group, num_sms(q.device), cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
        None if seqused_k is None else seqused_k.contiguous(), None, None, None, None,
        _tile_counter(q.device) if cfg.schedules_dynamically else None, *sink)


_TABLES: dict = {}
_MAX_TABLES = 256  # a table is about one int32 per tile; built on the first call of a shape


def tile_costs(cfg: HopperFwdConfig, causal: bool, seqlen_q: int, seqlen_k: int, heads: int,
               batch: int, l2_group: int, window_left=None, window_right=None) -> list[int]:
    """Each linear tile's cost in key-tile steps, in the kernel's tile order
    (Note [Tile table]): the key tiles it visits plus the per-tile overhead."""
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


def timeline_buffer(device, cfg: HopperFwdConfig) -> torch.Tensor:
    """The int64 (roles, MAX_STEPS, MARKS) buffer a kernel built with ``timeline=True``
    writes its phase stamps to (Note [Timeline]); other builds never touch it."""
    key = (device, cfg.num_consumer_wgs)
    if key not in _TIMELINES:
        _TIMELINES[key] = torch.zeros(1 + cfg.num_consumer_wgs, MAX_STEPS, MARKS,
                                      dtype=torch.int64, device=device)
    return _TIMELINES[key]


# ----------------------------------------------------------------------------------------------
# the backward


# the deterministic config with accumulator copies for a call's shape, or None where the
# deterministic default stays: the hook runtime.dispatch asks a host for (det_copies)
det_copies_config = hopper_bwd_det_copies


def backward_config(head_dim: int, causal: bool, deterministic: bool,
                    config: HopperBwdConfig | None,
                    head_dim_v: int | None = None) -> HopperBwdConfig:
    """``config`` (or the default for (head_dim, head_dim_v) and the mode: the deterministic
    mode has configs of its own), deterministic when asked."""
    cfg = config or hopper_bwd_default(head_dim, causal, deterministic, head_dim_v=head_dim_v)
    if not isinstance(cfg, HopperBwdConfig):
        raise TypeError(f"config must be a HopperBwdConfig or None, got {type(cfg).__name__}")
    if deterministic and not cfg.deterministic:
        cfg = replace(cfg, deterministic=True)
    return cfg


def _backward_kernels(dtype_name, head_dim, causal, has_left, has_right, cfg, varlen,
                      has_seqused_k, softcap: float = 0.0, has_dlse: bool = False,
                      has_seqused_q: bool = False, head_dim_v: int | None = None) -> dict:
    from fa4_final.common.bwd_post import BackwardPost, VarlenBackwardPost
    from fa4_final.common.bwd_pre import BackwardPre, VarlenBackwardPre
    from fa4_final.hopper.bwd import HopperBackward, HopperVarlenBackward

    dt = CUTLASS_BY_NAME[dtype_name]
    extra = dict(softcap=softcap) if softcap else {}  # Note [Softcap]
    dv = {} if head_dim_v in (None, head_dim) else dict(head_dim_v=head_dim_v)
    extra.update(dv)
    if varlen:
        main = HopperVarlenBackward(dt, head_dim, causal, cfg, has_window_left=has_left,
                                    has_window_right=has_right, has_seqused_k=has_seqused_k,
                                    has_seqused_q=has_seqused_q, **extra)
        pre = VarlenBackwardPre(dt, head_dim, cfg.tile_m, cfg.deterministic, has_dlse,
                                has_seqused_q, dq_copies=cfg.dq_copies,
                                dq_first_store=cfg.dq_first_store, **dv)
        return {"pre": pre, "main": main, "post": VarlenBackwardPost(main)}
    main = HopperBackward(dt, head_dim, causal, cfg, has_window_left=has_left,
                          has_window_right=has_right, **extra)
    pre = BackwardPre(dt, head_dim, cfg.tile_m, cfg.deterministic, has_dlse,
                      dq_copies=cfg.dq_copies, dq_first_store=cfg.dq_first_store, **dv)
    return {"pre": pre, "main": main, "post": BackwardPost(main)}


def _varlen_fake_args(dtype_name: str, head_dim: int, has_seqused_k: bool,
                      has_dlse: bool = False, has_seqused_q: bool = False,
                      head_dim_v: int | None = None) -> dict:
    """The dense kernels' fake arguments (their batch entry 0 is the packed batch of one) plus
    the offsets, int32."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    dense = shared_backward.fake_backward_args(dtype_name, head_dim, head_dim_v=head_dim_v)
    cu_q, cu_k = (fake_tensor(Int32, (cute.sym_int(),)) for _ in range(2))
    used_k = fake_tensor(Int32, (cute.sym_int(),)) if has_seqused_k else None
    out, dout, lse, lse2, delta, accum, turn, stream = dense["pre"]
    dlse = (fake_tensor(Float32, lse.shape, divisibility=1),) if has_dlse else ()
    used_q = ()  # Note [Used query rows]: after dlse's place in bwd_pre, last in the main kernel
    if has_seqused_q:
        used_q = (fake_tensor(Int32, (cute.sym_int(),)),)
        dlse = dlse or (None,)
    q, k, v, _, _, _, _, dk, dv, _, _, _, _, _ = dense["main"]
    _, dq, _, _ = dense["post"]
    return {
        "pre": (out, dout, lse, lse2, delta, accum, turn, cu_q, stream, *dlse, *used_q),
        "main": (q, k, v, dout, lse2, delta, accum, dk, dv, turn, cu_q, cu_k, used_k,
                 Float32(1.0), Int32(0), Int32(0), stream, *used_q),
        "post": (accum, dq, cu_q, Float32(1.0), stream),
    }


def backward_recipe(head_dim: int = 128, dtype: str = "bf16", causal: bool = False,
                    config: HopperBwdConfig | None = None, deterministic: bool = False,
                    has_window_left: bool = False, has_window_right: bool = False,
                    varlen: bool = False, has_seqused_k: bool = False,
                    arch: str = ARCH, softcap: float = 0.0, has_dlse: bool = False,
                    has_seqused_q: bool = False, head_dim_v: int | None = None) -> Recipe:
    """The backward's three kernels ("pre", "main", "post"), dense or varlen; ``softcap``
    (0.0: none) builds the main kernel of Note [Softcap]. A learnable sink changes no kernel:
    its gradient is sink_gradient's (fa4_final.common.backward). ``has_dlse``: bwd_pre takes
    the lse's gradient (Note [The lse gradient folded] in fa4_final.common.bwd_pre);
    ``has_seqused_q``: the varlen kernels take seqused_q
    (Note [Used query rows in the backward] in fa4_final.hopper.bwd); ``head_dim_v``: dv of
    V, out, dout and dv when it differs from head_dim (Note [dV head dim] there)."""
    _check_target(dtype, arch, "backward")
    head_dim_v = None if head_dim_v == head_dim else head_dim_v
    cfg = backward_config(head_dim, causal, deterministic, config, head_dim_v)
    if softcap and config is None:
        cfg = hopper_bwd_softcap(cfg, head_dim, causal)
    has_seqused_k = varlen and has_seqused_k
    has_seqused_q = varlen and has_seqused_q
    kernels = _backward_kernels(dtype, head_dim, causal, has_window_left, has_window_right, cfg,
                                varlen, has_seqused_k, softcap, has_dlse, has_seqused_q,
                                head_dim_v)
    dv = {} if head_dim_v is None else dict(head_dim_v=head_dim_v)
    if varlen:
        return Recipe("bwd", ARCH, kernels,
                      lambda role: _first_store_args(cfg, role, _varlen_fake_args(
                          dtype, head_dim, has_seqused_k, has_dlse, has_seqused_q, **dv)), cfg)
    return Recipe("bwd", ARCH, kernels,
                  lambda role: _first_store_args(cfg, role, shared_backward.fake_backward_args(
                      dtype, head_dim, has_dlse, **dv)), cfg)


def _first_store_args(cfg: HopperBwdConfig, role: str, args: dict) -> tuple:
    """``role``'s fake arguments; with dq_first_store bwd_post also takes the turn counters
    (bwd_pre's seventh argument), last (Note [dQ copies] in fa4_final.common.bwd_tiles)."""
    if role == "post" and cfg.dq_first_store:
        return args["post"] + (args["pre"][6],)
    return args[role]


def workspace_shapes(total_q: int, batch: int, heads: int, head_dim: int, tile_m: int,
                     deterministic: bool, dq_copies: int = 1) -> dict:
    """Shapes of the varlen backward's lse_log2, delta, dQ accumulator and turn counters: one
    slab per padded query tile and head (Note [Varlen dQ accumulator]), dq_copies of them in
    the accumulator and the turns (Note [dQ copies]); a (1, 1, 1) dummy of turns when not
    deterministic."""
    tiles = dq_accum_tiles(total_q, batch, tile_m)
    rows = tiles * tile_m
    return {"lse2": (1, heads, rows), "delta": (1, heads, rows),
            "accum": (1, heads, rows * head_dim * dq_copies),
            "turn": (1, heads, tiles * dq_copies) if deterministic else (1, 1, 1)}


def launch_varlen_backward(plan, q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q,
                           cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, causal: bool,
                           softmax_scale: float, window_left, window_right, dlse=None,
                           seqused_q=None) -> None:
    """The varlen backward in three launches: q, out, dout, dq (total_q, h, d), k, v, dk, dv
    (total_k, h_kv, d), lse (h, total_q), none of them empty. ``max_seqlen_*`` are not needed
    (the grids are counted from shapes), and the workspace is sized from shapes alone
    (Note [Varlen dQ accumulator]), so nothing waits for the GPU. ``dlse`` (h, total_q),
    for a plan built with has_dlse (Note [The lse gradient folded]); ``seqused_q`` (batch,),
    for a plan built with has_seqused_q (Note [Used query rows in the backward])."""
    total_q, h, d = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    if seqused_k is not None:  # keys past seqused_k belong to no key tile (Note [Varlen backward])
        dk.zero_()
        dv.zero_()
    kernels, cfg = plan.kernels, plan.config
    shapes = workspace_shapes(total_q, batch, h, d, cfg.tile_m, cfg.deterministic,
                              cfg.dq_copies)
    f32 = dict(dtype=torch.float32, device=q.device)
    lse2, delta, accum = (torch.empty(shapes[n], **f32) for n in ("lse2", "delta", "accum"))
    turn = torch.empty(shapes["turn"], dtype=torch.int32, device=q.device)
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    used = None if seqused_k is None else seqused_k.contiguous()
    dl = () if dlse is None else (dlse.float().contiguous()[None],)
    used_q = ()
    if seqused_q is not None:  # after dlse's place in bwd_pre; last in the main kernel
        used_q, dl = (seqused_q.contiguous(),), dl or (None,)
    kernels["pre"](out.unsqueeze(0), dout.unsqueeze(0), lse.unsqueeze(0), lse2, delta, accum,
                   turn, cu_q, *dl, *used_q)
    kernels["main"](q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), dout.unsqueeze(0), lse2,
                    delta, accum, dk.unsqueeze(0), dv.unsqueeze(0), turn, cu_q, cu_k, used,
                    softmax_scale, window_left or 0, window_right or 0, *used_q)
    kernels["post"](accum, dq.unsqueeze(0), cu_q, softmax_scale,
                    *((turn,) if cfg.dq_first_store else ()))


# ----------------------------------------------------------------------------------------------
# the decode forward


def decode_fake_args(dtype_name: str, head_dim: int, paged: bool, has_seqused_k: bool,
                     split: bool, varlen_q: bool = False) -> tuple:
    """The decode kernel's fake arguments, in its launch order: q (b, s_q, h, D); k and v
    (b, s_k, h_kv, D), or paged (num_pages, page_size, h_kv, D) (the pages' own extents); out and
    lse, or with ``split`` the float32 partials (splits, b, s_q, h, D) (16-byte strides, as the
    combine reads them) and (splits, b, h, s_q);
    the page table (b, max_pages) int32, contiguous along its pages; seqused_k (b,) int32;
    varlen_q: q, out and lse as a batch of one (the same fake shapes), cu_seqlens_q (b + 1,)
    int32 and max_seqlen_q."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    q, k, v, out, lse = fake_attention_tensors(CUTLASS_BY_NAME[dtype_name], head_dim)
    if paged:  # the cache's pages: its own extents, not q's batch
        dt, pages, page_size, hk = (CUTLASS_BY_NAME[dtype_name], cute.sym_int(), cute.sym_int(),
                                    cute.sym_int())
        k, v = (fake_tensor(dt, (pages, page_size, hk, head_dim), divisibility=128 // dt.width)
                for _ in range(2))
    if split:
        splits, b, sq, h = (cute.sym_int() for _ in range(4))
        out = fake_tensor(Float32, (splits, b, sq, h, head_dim), divisibility=4)  # 16 B
        lse = fake_tensor(Float32, (splits, b, h, sq))
    page_table = fake_tensor(Int32, (cute.sym_int(), cute.sym_int())) if paged else None
    used_k = fake_tensor(Int32, (cute.sym_int(),)) if has_seqused_k else None
    cu_q = fake_tensor(Int32, (cute.sym_int(),)) if varlen_q else None
    return (q, k, v, out, lse, page_table, used_k, cu_q, Int32(1), Int32(0), Float32(1.0),
            fake_stream())


def decode_recipe(head_dim: int = 128, dtype: str = "bf16", causal: bool = True,
                  paged: bool = False, has_seqused_k: bool = False, split: bool = False,
                  config: HopperDecodeConfig | None = None, varlen_q: bool = False,
                  has_window_left: bool = False, arch: str = ARCH) -> Recipe:
    """The decode forward (fa4_final.hopper.decode) for one (head dim, dtype, causal, paged,
    seqused_k, split, varlen queries, left window) and config: compiled from fake tensors, so
    it needs no GPU."""
    _check_target(dtype, arch, "decode forward")
    cfg = config or hopper_decode_default(head_dim)
    if not isinstance(cfg, HopperDecodeConfig):
        raise TypeError(f"config must be a HopperDecodeConfig or None, got {type(cfg).__name__}")
    from fa4_final.hopper.decode import HopperDecode

    kernel = HopperDecode(CUTLASS_BY_NAME[dtype], head_dim, causal, cfg, paged=paged,
                          has_seqused_k=has_seqused_k, split=split, varlen_q=varlen_q,
                          has_window_left=has_window_left)
    return Recipe("decode", ARCH, {"main": kernel},
                  lambda role: decode_fake_args(dtype, head_dim, paged, has_seqused_k, split,
                                                varlen_q), cfg)


def check_decode_page_size(page_size: int, config: HopperDecodeConfig) -> None:
    """UnsupportedError naming ``page_size`` when the TMA page walk cannot take it."""
    from fa4_final.common.decode_index import page_size_problem

    problem = page_size_problem(page_size, config.tile_n, config.page_box)
    if problem is not None:
        raise UnsupportedError(problem)


def launch_decode(plan, q, k, v, out, lse, page_table=None, seqused_k=None,
                  softmax_scale: float | None = None, cu_seqlens_q=None,
                  max_seqlen_q: int | None = None, window_left: int | None = None) -> None:
    """One launch of the decode forward compiled as ``plan`` (from decode_recipe with the same
    paged, seqused_k, split and varlen_q choices). q (b, s_q, h, D); k, v (b, s_k, h_kv, D) or,
    with ``page_table`` (b, max_pages) int32, (num_pages, page_size, h_kv, D); ``seqused_k``
    (b,) int32 or None. ``out`` and ``lse`` are preallocated by the caller: out like q and lse
    (b, h, s_q) float32 for one split, or the float32 partials (splits, b, s_q, h, D) and
    (splits, b, h, s_q) that the combine merges (runtime.decode.partials_like makes them; the
    first needs 16-byte strides and address, as the combine does). Varlen queries
    (``cu_seqlens_q`` (b + 1,) int32 and ``max_seqlen_q``, a host int that sizes the grid):
    q (total_q, h, D), out like q or (splits, total_q, h, D), lse (h, total_q) or (splits, h,
    total_q). ``window_left``: the left side of a sliding window (None: unbounded), for a plan
    built with has_window_left. Nothing here reads device memory: the launch is safe to capture
    in a CUDA graph (the compile must happen before, with a warm-up call)."""
    if page_table is not None:
        check_decode_page_size(k.shape[1], plan.config)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if cu_seqlens_q is None:
        plan.kernels["main"](q, k, v, out, lse, page_table, seqused_k, None, 0,
                             window_left or 0, softmax_scale)
        return
    if max_seqlen_q is None:
        raise ValueError("varlen decode needs max_seqlen_q (a host int: it sizes the grid, and "
                         "reading it from cu_seqlens_q would synchronise with the GPU)")
    split = out.dim() == 4  # (splits, total_q, h, D)
    out, lse = (out.unsqueeze(1), lse.unsqueeze(1)) if split else (out.unsqueeze(0),
                                                                   lse.unsqueeze(0))
    plan.kernels["main"](q.unsqueeze(0), k, v, out, lse, page_table, seqused_k, cu_seqlens_q,
                         max_seqlen_q, window_left or 0, softmax_scale)
