"""Ring attention over torch.distributed: chapter 14.

A sequence too long for one GPU is split along its tokens: each of W ranks holds a piece of Q,
K and V. Every query must still see every key, so the K, V pieces travel around a ring of ranks,
one hop per step, while each rank computes its queries against the piece in hand. After W steps
every rank has seen every piece; its partial results (out, lse) merge exactly through their
log-sum-exp, the property chapter 02's online softmax rests on.

    layout = zigzag_layout(seqlen, world)                    # who holds which tokens
    out, lse = ring_forward(q, k, v, layout, comm, causal)   # on each rank, its own tokens
    dq, dk, dv = ring_backward(dout, q, k, v, out, lse, layout, comm, causal)

The ring code is the same on every machine; what changes is the block function (one rank's
queries against one K, V piece) and the communicator:
- on a CPU, ``block_forward`` / ``block_backward``: the reference attention in float64 or
  float32, with a causal mask at global offsets; ``DistRing`` over gloo; ``ThreadRing`` (W
  threads in one process) for the notebook and the exercises' checks;
- on a Hopper GPU, ``fa4_block_forward`` / ``fa4_block_backward``: fa4_final's kernels through
  its eager entry points (``fa4_final.runtime.prologue``'s ``forward_into`` and
  ``backward_into``);
  ``DistRing`` over NCCL, or over gloo through host memory when several ranks share one GPU.

Note [The merge]
Two partial results of the same query rows over disjoint sets of keys, (o1, l1) and (o2, l2),
with o normalised and l the natural log of the row's sum of exp(score), combine exactly:
l = logaddexp(l1, l2), o = exp(l1 - l) o1 + exp(l2 - l) o2. In the stable form the larger lse
is subtracted before any exponential, so no exp overflows, and a row that saw no key in either
part (l1 = l2 = -inf) stays (0, -inf) instead of 0/0. The merge is the online softmax's step
(chapter 02) with a whole block's result in place of one tile's scores.

Note [Zigzag]
With a causal mask, query chunk i sees key chunks 0..i: the later chunks hold more work. Cut the
sequence into 2W chunks and give rank r chunks r and 2W-1-r: every rank then holds one early
and one late chunk, and every rank does the same number of visible chunk pairs (2W + 1 ... see
``visible_pairs``), so no rank waits for the others at the end of the ring.

Note [The backward's ring]
The backward needs every (query, key) pair again. Each rank keeps its dQ; K and V travel as in
the forward, and dK, dV accumulators travel with them: at each step a rank adds its queries'
contribution to the dK, dV of the piece in hand and passes them on. After the last step the
accumulators take one more hop and arrive at the rank that owns their K and V. Each block's
backward uses the global out and lse (the forward's final ones), so delta = rowsum(dO * O) is
the global delta and P = exp(S - lse) is each block's share of the global softmax: the blocks'
gradients add up to the full one exactly.
"""

from __future__ import annotations

import datetime
import math
import os
import queue
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

import torch

__all__ = [
    "DistRing", "Layout", "RankFailed", "ThreadRing", "block_backward", "block_forward",
    "block_visibility", "contiguous_layout", "fa4_block_backward", "fa4_block_forward", "launch",
    "merge", "reference_attention", "ring_backward", "ring_forward", "split_even",
    "varlen_blocks", "visible_pairs", "zigzag_layout",
]


# ================================================================================================
# 1. Who holds which tokens
# ================================================================================================
def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges (start, stop) covering 0..n, lengths differing by at most one
    (the first n % parts ranges are one longer)."""
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


@dataclass(frozen=True)
class Layout:
    """Which global token ranges each rank holds: ``ranges[rank]`` is a tuple of (start, stop),
    in the order the rank stores them (its local tensors are their concatenation)."""

    seqlen: int
    ranges: tuple

    @property
    def world(self) -> int:
        return len(self.ranges)

    def local_len(self, rank: int) -> int:
        return sum(b - a for a, b in self.ranges[rank])

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a full-sequence tensor (tokens along ``dim``)."""
        return torch.cat([x.narrow(dim, a, b - a) for a, b in self.ranges[rank]], dim=dim)

    def unshard(self, pieces: list, dim: int = 1) -> torch.Tensor:
        """The full-sequence tensor from every rank's local tensor (the inverse of shard)."""
        shape = list(pieces[0].shape)
        shape[dim] = self.seqlen
        full = pieces[0].new_empty(shape)
        for rank, piece in enumerate(pieces):
            at = 0
            for a, b in self.ranges[rank]:
                full.narrow(dim, a, b - a).copy_(piece.narrow(dim, at, b - a))
                at += b - a
        return full

    def local_ranges(self, rank: int) -> list[tuple[int, int, int]]:
        """(local start, global start, length) of each range of the rank."""
        out, at = [], 0
        for a, b in self.ranges[rank]:
            out.append((at, a, b - a))
            at += b - a
        return out


def zigzag_layout(seqlen: int, world: int) -> Layout:
    """Note [Zigzag]: 2W chunks, rank r holds chunks r and 2W-1-r (in that order)."""
    chunks = split_even(seqlen, 2 * world)
    return Layout(seqlen, tuple((chunks[r], chunks[2 * world - 1 - r]) for r in range(world)))


def contiguous_layout(seqlen: int, world: int) -> Layout:
    """W contiguous pieces, rank r the r-th: balanced without a mask, not with a causal one."""
    return Layout(seqlen, tuple((piece,) for piece in split_even(seqlen, world)))


def block_visibility(q_range, k_range, causal: bool) -> str:
    """'all' when every query of q_range sees every key of k_range, 'none' when none does,
    'some' when the causal mask cuts the block (global positions: key j visible to query i when
    j <= i)."""
    (qa, qb), (ka, kb) = q_range, k_range
    if qb <= qa or kb <= ka:
        return "none"
    if not causal or kb - 1 <= qa:
        return "all"
    if ka > qb - 1:
        return "none"
    return "some"


def visible_pairs(layout: Layout, causal: bool = True) -> list[float]:
    """Per rank: the (query, key) pairs its queries see over the whole ring, counted in units
    of one full (chunk x chunk) block of the average chunk size: the work each rank does."""
    unit = (layout.seqlen / (2 * layout.world)) ** 2 or 1.0
    work = []
    for rank in range(layout.world):
        pairs = 0
        for qa, qb in layout.ranges[rank]:
            for ka, kb in (r for ranges in layout.ranges for r in ranges):
                if not causal:
                    pairs += (qb - qa) * (kb - ka)
                    continue
                for i in range(qa, qb):  # keys ka..min(kb, i + 1)
                    pairs += max(0, min(kb, i + 1) - ka)
        work.append(pairs / unit)
    return work


# ================================================================================================
# 2. Block functions: one rank's queries against one K, V piece, at global offsets
# ================================================================================================
def _scale(q, softmax_scale):
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, s, hk, d) -> (b, h, s, d), each KV head repeated for its group of query heads."""
    t = t.transpose(1, 2)
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _global_mask(q_start, sq, k_start, sk, device) -> torch.Tensor:
    """(sq, sk) True where key k_start + j is visible to query q_start + i (j <= i globally)."""
    qi = torch.arange(q_start, q_start + sq, device=device)[:, None]
    kj = torch.arange(k_start, k_start + sk, device=device)[None, :]
    return kj <= qi


def _doc_mask(q_start, sq, k_start, sk, cu_seqlens, device) -> torch.Tensor:
    """(sq, sk) True where query and key belong to the same document of a packed sequence
    (cu_seqlens: the documents' start offsets and the total, as in varlen attention)."""
    bounds = torch.as_tensor(cu_seqlens, device=device)[1:-1]
    qd = torch.bucketize(torch.arange(q_start, q_start + sq, device=device), bounds, right=True)
    kd = torch.bucketize(torch.arange(k_start, k_start + sk, device=device), bounds, right=True)
    return qd[:, None] == kd[None, :]


def _scores(q, k, q_start, k_start, causal, scale, cu_seqlens=None):
    h = q.shape[2]
    s = torch.matmul(q.transpose(1, 2), _expand_kv(k, h).transpose(-1, -2)) * scale
    if causal:
        mask = _global_mask(q_start, q.shape[1], k_start, k.shape[1], q.device)
        s = s.masked_fill(~mask, float("-inf"))
    if cu_seqlens is not None:
        mask = _doc_mask(q_start, q.shape[1], k_start, k.shape[1], cu_seqlens, q.device)
        s = s.masked_fill(~mask, float("-inf"))
    return s  # (b, h, sq, sk)


def block_forward(q, k, v, q_start: int = 0, k_start: int = 0, causal: bool = False,
                  softmax_scale=None, cu_seqlens=None):
    """(out, lse) of queries at global positions q_start.. over keys at k_start.. (the course's
    reference attention, in the inputs' dtype: float64 or float32 on a CPU). out like q; lse
    (b, h, sq); a row that sees no key gets out = 0, lse = -inf. ``cu_seqlens``: the sequence
    is a packed batch of documents (varlen), and a query sees only its own document's keys."""
    s = _scores(q, k, q_start, k_start, causal, _scale(q, softmax_scale), cu_seqlens)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe[..., None])  # masked scores give 0; a row with no key is all 0
    out = torch.matmul(p, _expand_kv(v, q.shape[2]))
    return out.transpose(1, 2).contiguous(), lse


def block_backward(dout, q, k, v, out, lse, q_start: int = 0, k_start: int = 0,
                   causal: bool = False, softmax_scale=None, cu_seqlens=None):
    """(dq, dk, dv) of one block from the GLOBAL out and lse of these query rows (Note [The
    backward's ring]): P = exp(S - lse) is the block's share of the global softmax, and
    delta = rowsum(dO * O) uses the global O, so the blocks' gradients add up exactly. GQA: dk,
    dv are summed over each group of query heads."""
    scale = _scale(q, softmax_scale)
    h, hk = q.shape[2], k.shape[2]
    s = _scores(q, k, q_start, k_start, causal, scale, cu_seqlens)
    safe = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    p = torch.exp(s - safe[..., None])  # (b, h, sq, sk); rows with lse = -inf: 0
    do = dout.transpose(1, 2)  # (b, h, sq, d)
    delta = (dout * out).sum(-1).transpose(1, 2)  # (b, h, sq)
    dv = torch.matmul(p.transpose(-1, -2), do)  # (b, h, sk, d)
    dp = torch.matmul(do, _expand_kv(v, h).transpose(-1, -2))
    ds = p * (dp - delta[..., None])
    dq = torch.matmul(ds, _expand_kv(k, h)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.transpose(1, 2)) * scale
    if hk != h:
        b, _, sk, d = dk.shape
        dk = dk.view(b, hk, h // hk, sk, d).sum(2)
        dv = dv.view(b, hk, h // hk, sk, dv.shape[-1]).sum(2)
    return dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous(), \
        dv.transpose(1, 2).contiguous()


def _fa4_window(q_start, sq, k_start, sk, causal):
    """fa4_final's window for a block at global offsets: its causal mask is bottom-right
    aligned (key j visible to query i when j <= i + sk - sq + right), so the global rule
    k_start + j <= q_start + i is the right side q_start - k_start - (sk - sq)."""
    if not causal:
        return (None, None)
    return (None, q_start - k_start - (sk - sq))


def fa4_block_forward(q, k, v, q_start: int = 0, k_start: int = 0, causal: bool = False,
                      softmax_scale=None):
    """block_forward on a Hopper GPU: fa4_final's forward kernel (bf16/fp16), lse float32."""
    from fa4_final.runtime.prologue import forward_into  # the package's eager entry point

    q, k, v = (t.contiguous() for t in (q, k, v))
    b, sq, h, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    forward_into(q, k, v, out, lse, causal=False, softmax_scale=softmax_scale,
                 window_size=_fa4_window(q_start, sq, k_start, k.shape[1], causal))
    return out, lse


def fa4_block_backward(dout, q, k, v, out, lse, q_start: int = 0, k_start: int = 0,
                       causal: bool = False, softmax_scale=None):
    """block_backward on a Hopper GPU: fa4_final's backward kernels, given the global out (in
    q's dtype) and lse; returns dq (float32) and dk, dv (float32) for accumulation."""
    from fa4_final.runtime.prologue import backward_into

    q, k, v = (t.contiguous() for t in (q, k, v))
    out, dout = out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward_into(q, k, v, out, lse.float().contiguous(), dout, dq, dk, dv, causal=False,
                  softmax_scale=softmax_scale,
                  window_size=_fa4_window(q_start, q.shape[1], k_start, k.shape[1], causal))
    return dq.float(), dk.float(), dv.float()


def reference_attention(q, k, v, causal: bool = False, softmax_scale=None, cu_seqlens=None):
    """One process, the whole sequence: what the ring must reproduce."""
    return block_forward(q, k, v, 0, 0, causal, softmax_scale, cu_seqlens)


def varlen_blocks(cu_seqlens):
    """(block forward, block backward) for a packed batch of documents: the ring code is
    unchanged, the block functions add the document mask at global positions. (On GPUs this
    would take fa4_final's varlen kernels with each block's documents cut to the block: not
    done here.)"""
    import functools

    return (functools.partial(block_forward, cu_seqlens=tuple(cu_seqlens)),
            functools.partial(block_backward, cu_seqlens=tuple(cu_seqlens)))


# ================================================================================================
# 3. The merge (Note [The merge])
# ================================================================================================
def merge(out, lse, block_out, block_lse):
    """The stable merge of two partial results of the same rows: out (b, s, h, d) normalised,
    lse (b, h, s). Returns new tensors (out in block_out's dtype, lse in lse's)."""
    new = torch.logaddexp(lse, block_lse)  # -inf, -inf -> -inf; never overflows
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    w_old = torch.exp(lse - safe).transpose(1, 2)[..., None]  # (b, s, h, 1); 0 where -inf
    w_new = torch.exp(block_lse - safe).transpose(1, 2)[..., None]
    return out * w_old + block_out * w_new, new


# ================================================================================================
# 4. Communicators: send to the next rank, receive from the previous one
# ================================================================================================
class _Done:
    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class DistRing:
    """The ring over a torch.distributed process group (NCCL or gloo). ``exchange(t, shape)``
    starts sending ``t`` to rank+1 and receiving a tensor of ``shape`` from rank-1; the returned
    handle's ``wait()`` gives the received tensor. With gloo and CUDA tensors (several ranks on
    one GPU) the blocks move through host memory. ``waited_s`` adds up the time spent in wait.
    """

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.through_host = dist.get_backend(group) == "gloo"
        self.waited_s = 0.0
        self.exchanges = 0

    def _global(self, rank):
        return rank if self.group is None else self.dist.get_global_rank(self.group, rank)

    def exchange(self, tensor: torch.Tensor, shape=None):
        dist = self.dist
        shape = tuple(tensor.shape) if shape is None else tuple(shape)
        device = tensor.device
        host = self.through_host and device.type != "cpu"
        send = tensor.detach().to("cpu") if host else tensor.detach().contiguous()
        recv = torch.empty(shape, dtype=tensor.dtype, device="cpu" if host else device)
        nxt, prv = self._global((self.rank + 1) % self.world), \
            self._global((self.rank - 1) % self.world)
        # post the receive first: with gloo a send may wait for its matching receive
        reqs = [dist.irecv(recv, prv, group=self.group), dist.isend(send, nxt, group=self.group)]
        self.exchanges += 1
        ring = self

        class Handle:
            def wait(self):
                t0 = time.perf_counter()
                for r in reqs:
                    r.wait()
                ring.waited_s += time.perf_counter() - t0
                return recv.to(device, non_blocking=True) if host else recv

        return Handle()


class RingTimeout(RuntimeError):
    pass


class ThreadRing:
    """W ranks as W threads of one process, for the notebook and the exercises' checks: the
    same ``exchange`` / ``wait`` as DistRing, with every call written to ``events[rank]`` as
    (what, step) so a checker can read the order of sends, waits and compute. ``run(fn)`` calls
    ``fn(comm)`` on every rank at once and returns the ranks' results; a rank that waits for a
    block nobody sends raises RingTimeout after ``timeout`` seconds instead of hanging."""

    def __init__(self, world: int, timeout: float = 10.0):
        self.world, self.timeout = world, timeout
        self.boxes = [queue.Queue() for _ in range(world)]
        self.events: list[list] = [[] for _ in range(world)]

    def log(self, rank: int, what: str, **info):
        self.events[rank].append((what, info))

    class Comm:
        def __init__(self, ring, rank):
            self.ring, self.rank, self.world = ring, rank, ring.world
            self.posted = 0
            self.waited_s = 0.0

        def exchange(self, tensor, shape=None):
            ring = self.ring
            ring.boxes[(self.rank + 1) % self.world].put((self.posted, tensor.detach().clone()))
            ring.log(self.rank, "exchange", n=self.posted)
            self.posted += 1
            comm, n = self, self.posted - 1
            done = []

            class Handle:
                def wait(self):
                    if done:
                        raise RuntimeError(
                            f"rank {comm.rank} waited twice on exchange {n}: each handle gives "
                            "its block once")
                    try:
                        got_n, got = ring.boxes[comm.rank].get(timeout=ring.timeout)
                    except queue.Empty:
                        raise RingTimeout(
                            f"rank {comm.rank} waited {ring.timeout:.0f} s for exchange {n} "
                            f"from rank {(comm.rank - 1) % comm.world} and nothing came: the "
                            "ranks did not start the same number of exchanges") from None
                    done.append(1)
                    ring.log(comm.rank, "wait", n=n)
                    return got

            return Handle()

    def comm(self, rank: int):
        return ThreadRing.Comm(self, rank)

    def run(self, fn) -> list:
        results, errors = [None] * self.world, [None] * self.world

        def main(rank):
            try:
                results[rank] = fn(self.comm(rank))
            except BaseException as exc:  # noqa: BLE001  (reported below with its rank)
                errors[rank] = exc

        threads = [threading.Thread(target=main, args=(r,), daemon=True)
                   for r in range(self.world)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout * 3
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            raise RingTimeout(f"ranks {stuck} did not finish within {self.timeout * 3:.0f} s")
        for exc in errors:
            if exc is not None:
                raise exc
        return results


# ================================================================================================
# 5. The ring, forward and backward
# ================================================================================================
def _pack(*tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat, shapes):
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[at:at + n].view(shape))
        at += n
    return out


def _kv_shapes(k, v, length):
    b, _, hk, d = k.shape
    return [(b, length, hk, d), (b, length, hk, v.shape[-1])]


def ring_forward(q, k, v, layout: Layout, comm, causal: bool = False, softmax_scale=None,
                 block_fn=block_forward, acc_dtype=None):
    """This rank's (out, lse) of attention over the whole sequence. q, k, v: the rank's local
    tokens (layout.shard of the full tensors). At each of the W steps the rank first starts the
    exchange of the K, V piece in hand (so it travels while the block is computed), computes its
    queries' ranges against the piece's ranges (skipping blocks the causal mask hides), merges
    the results into (out, lse) (Note [The merge]), then waits for the next piece. The first
    step's piece is the rank's own; step s holds the piece of rank (rank - s) mod W."""
    rank, world = comm.rank, comm.world
    scale = _scale(q, softmax_scale)
    acc_dtype = acc_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    b, lq, h, _ = q.shape
    out = torch.zeros(b, lq, h, v.shape[-1], dtype=acc_dtype, device=q.device)
    lse = torch.full((b, h, lq), float("-inf"), dtype=acc_dtype, device=q.device)
    kv = _pack(k, v)
    for step in range(world):
        src = (rank - step) % world
        pending = None
        if step + 1 < world:  # start the next piece's transfer before the compute
            nxt_len = layout.local_len((rank - step - 1) % world)
            pending = comm.exchange(kv, (sum(math.prod(s) for s in
                                             _kv_shapes(k, v, nxt_len)),))
        k_src, v_src = _unpack(kv, _kv_shapes(k, v, layout.local_len(src)))
        for q_at, q_start, q_len in layout.local_ranges(rank):
            for k_at, k_start, k_len in layout.local_ranges(src):
                seen = block_visibility((q_start, q_start + q_len), (k_start, k_start + k_len),
                                        causal)
                if seen == "none":
                    continue
                o_b, l_b = block_fn(q[:, q_at:q_at + q_len], k_src[:, k_at:k_at + k_len],
                                    v_src[:, k_at:k_at + k_len], q_start, k_start,
                                    seen == "some", scale)
                o_m, l_m = merge(out[:, q_at:q_at + q_len], lse[..., q_at:q_at + q_len],
                                 o_b.to(acc_dtype), l_b.to(acc_dtype))
                out[:, q_at:q_at + q_len] = o_m
                lse[..., q_at:q_at + q_len] = l_m
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, layout: Layout, comm, causal: bool = False,
                  softmax_scale=None, block_fn=block_backward, acc_dtype=None):
    """This rank's (dq, dk, dv) (Note [The backward's ring]). out, lse: this rank's rows of the
    forward's global result. K, V travel as in the forward; the dK, dV accumulator of the piece
    in hand travels one step behind them and takes one more hop after the last step, home."""
    rank, world = comm.rank, comm.world
    scale = _scale(q, softmax_scale)
    acc_dtype = acc_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    kv = _pack(k, v)
    dkv_in_flight = None
    for step in range(world):
        src = (rank - step) % world
        pending = None
        if step + 1 < world:
            nxt_len = layout.local_len((rank - step - 1) % world)
            pending = comm.exchange(kv, (sum(math.prod(s) for s in _kv_shapes(k, v, nxt_len)),))
        shapes = _kv_shapes(k, v, layout.local_len(src))
        k_src, v_src = _unpack(kv, shapes)
        dk_src = torch.zeros(shapes[0], dtype=acc_dtype, device=q.device)
        dv_src = torch.zeros(shapes[1], dtype=acc_dtype, device=q.device)
        for q_at, q_start, q_len in layout.local_ranges(rank):
            rows = slice(q_at, q_at + q_len)
            for k_at, k_start, k_len in layout.local_ranges(src):
                seen = block_visibility((q_start, q_start + q_len), (k_start, k_start + k_len),
                                        causal)
                if seen == "none":
                    continue
                keys = slice(k_at, k_at + k_len)
                g_q, g_k, g_v = block_fn(dout[:, rows], q[:, rows], k_src[:, keys],
                                         v_src[:, keys], out[:, rows], lse[..., rows], q_start,
                                         k_start, seen == "some", scale)
                dq[:, rows] += g_q.to(acc_dtype)
                dk_src[:, keys] += g_k.to(acc_dtype)
                dv_src[:, keys] += g_v.to(acc_dtype)
        dkv = _pack(dk_src, dv_src)
        if dkv_in_flight is not None:  # what the ranks before added to this piece's dK, dV
            dkv = dkv + dkv_in_flight.wait()
        if world == 1:
            break
        # pass them on (after the last step: home to the piece's owner)
        dkv_in_flight = comm.exchange(dkv, (sum(math.prod(s) for s in _kv_shapes(
            k, v, layout.local_len((rank - step - 1) % world))),))
        if pending is not None:
            kv = pending.wait()
    home = dkv_in_flight.wait() if world > 1 else dkv  # one rank: its own dK, dV
    dk_home, dv_home = _unpack(home, _kv_shapes(k, v, k.shape[1]))
    return dq.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype)


# ================================================================================================
# 6. The launcher: W processes, a clear error instead of a hang
# ================================================================================================
class RankFailed(RuntimeError):
    """A rank raised, died or ran past the deadline; the message says which, and what it said."""


def _serialise(value) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _deserialise(data: bytes):
    import io

    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(rank, world, backend, init_file, collective_timeout, threads, worker, args,
               results):
    """One process of ``launch``: join the group, say so, run ``worker(rank, world, *args)``,
    report its result or its error."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        # init_process_group can return on one rank while its peers are still connecting to it;
        # a rank that then fails at once would break their connections, and they would report a
        # connection error instead of its own. No rank leaves a barrier before every rank has
        # entered it, so after this one every connection of the group is made.
        if backend == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
        results.put(("ready", rank, b""))
        value = worker(rank, world, *args)
        results.put(("ok", rank, _serialise(value)))
    except BaseException as exc:  # noqa: BLE001  (every failure goes to the launcher, in words)
        tb = traceback.format_exc(limit=4).strip().splitlines()
        results.put(("error", rank, f"{type(exc).__name__}: {exc} [{' | '.join(tb[-3:])}]"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001  (a broken group cannot be torn down cleanly)
                pass


def launch(worker, world: int, args: tuple = (), backend: str = "gloo", deadline: float = 120.0,
           collective_timeout: float = 30.0, threads: int = 1, grace: float = 3.0,
           startup: float = 180.0) -> list:
    """Run ``worker(rank, world, *args)`` in ``world`` fresh processes joined in a process group
    (gloo on CPUs, NCCL on GPUs; one GPU per rank) and return the ranks' results in rank order.

    ``worker`` must be importable (a module-level function). The ranks have ``startup`` seconds
    to start and join the group (importing torch is slow on a busy machine), then ``deadline``
    seconds to finish; every collective times out after ``collective_timeout`` seconds. When a
    rank raises or dies, the others get ``grace`` seconds to report too, then are stopped, and
    RankFailed names every rank that failed, what it said, and the ranks that were still
    running: never a hang."""
    import multiprocessing as mp

    # fresh processes forked from a server that imported torch once (spawning each rank would
    # import torch W times per launch); no CUDA is touched before a rank sets its device
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "solutions.ch14_ring"])
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ring_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_main, args=(r, world, backend, init_file,
                                                      collective_timeout, threads, worker, args,
                                                      results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        ready, done, failed = set(), {}, {}
        end = time.monotonic() + startup
        first_failure = None
        while len(done) + len(failed) < world:
            now = time.monotonic()
            limit = end if first_failure is None else min(end, first_failure + grace)
            if now >= limit:
                break
            try:
                kind, rank, payload = results.get(timeout=min(0.2, limit - now))
            except queue.Empty:
                for r, p in enumerate(procs):  # died without a word (killed, crashed)
                    if r not in done and r not in failed and p.exitcode not in (None, 0):
                        failed[r] = f"exited with code {p.exitcode} without a result"
                        first_failure = first_failure or time.monotonic()
                continue
            if kind == "ready":
                ready.add(rank)
                if len(ready) == world:  # the run's own deadline starts when all have joined
                    end = time.monotonic() + deadline
            elif kind == "ok":
                done[rank] = _deserialise(payload)
            else:
                failed[rank] = payload
                first_failure = first_failure or time.monotonic()
        running = [r for r in range(world) if r not in done and r not in failed]
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        if failed or running:
            lines = [f"rank {r} failed: {msg}" for r, msg in sorted(failed.items())]
            if running and failed:
                lines.append(f"ranks {running} still running after the failure above (stopped)")
            elif running and len(ready) < world:
                lines.append(f"ranks {sorted(set(range(world)) - ready)} had not joined the "
                             f"process group after {startup:.0f} s")
            elif running:
                lines.append(f"ranks {running} ran past the {deadline:.0f} s deadline")
            raise RankFailed(f"{worker.__name__} on {world} {backend} processes: "
                             + "; ".join(lines))
    return [done[r] for r in range(world)]


# ================================================================================================
# 7. The check the tests and the notebook run: W processes against one
# ================================================================================================
@dataclass(frozen=True)
class Case:
    """One ring problem: batch, sequence, heads, KV heads, head dim, causal, seed."""

    b: int
    s: int
    h: int
    hk: int
    d: int
    causal: bool
    seed: int = 0
    cu_seqlens: tuple | None = None  # a packed batch of documents (varlen), b = 1

    def blocks(self):
        """The block functions of this case (the document mask added for varlen)."""
        if self.cu_seqlens is None:
            return block_forward, block_backward
        return varlen_blocks(self.cu_seqlens)

    def inputs(self, dtype=torch.float64, device="cpu"):
        g = torch.Generator().manual_seed(self.seed)
        q = torch.randn(self.b, self.s, self.h, self.d, generator=g, dtype=torch.float64)
        k, v = (torch.randn(self.b, self.s, self.hk, self.d, generator=g, dtype=torch.float64)
                for _ in range(2))
        dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
        return tuple(t.to(dtype=dtype, device=device) for t in (q, k, v, dout))


def reference_case(case: Case):
    """(out, lse, dq, dk, dv) of one process over the whole sequence, float64 autograd."""
    q, k, v, dout = case.inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = reference_attention(*leaves, causal=case.causal, cu_seqlens=case.cu_seqlens)
    grads = torch.autograd.grad(out, leaves, dout)
    return (out.detach(), lse.detach(), *grads)


def layout_of(kind: str, seqlen: int, world: int) -> Layout:
    """The layout named ``kind`` ("zigzag" or "contiguous") of ``seqlen`` tokens over ``world``
    ranks."""
    return (zigzag_layout if kind == "zigzag" else contiguous_layout)(seqlen, world)


def output_diff(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| element by element, 0 where both hold the same infinity (the lse of a row
    that sees no key is -inf in both); NaN stays NaN."""
    diff = (got - want).abs()
    return torch.where(torch.isinf(got) & torch.isinf(want) & (got == want),
                       torch.zeros_like(diff), diff)


def ring_case_worker(rank: int, world: int, cases: list, layout_kind: str = "zigzag"):
    """A rank of ``launch``: every case's forward and backward through DistRing, float64;
    returns this rank's (out, lse, dq, dk, dv) per case."""
    comm = DistRing()
    found = []
    for case in cases:
        q, k, v, dout = case.inputs()
        layout = layout_of(layout_kind, case.s, world)
        lq, lk, lv, ldo = (layout.shard(t, rank) for t in (q, k, v, dout))
        fwd, bwd = case.blocks()
        out, lse = ring_forward(lq, lk, lv, layout, comm, case.causal, block_fn=fwd)
        grads = ring_backward(ldo, lq, lk, lv, out, lse, layout, comm, case.causal, block_fn=bwd)
        found.append((out, lse, *grads))
    return found


def ring_errors(per_rank: list, cases: list, world: int, layout_kind: str = "zigzag") -> list:
    """For each case, the largest |ring - one process| over out, lse, dq, dk, dv (float64)."""
    errors = []
    for n, case in enumerate(cases):
        layout = layout_of(layout_kind, case.s, world)
        ref = reference_case(case)
        worst = {}
        for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
            dim = 2 if name == "lse" else 1
            got = layout.unshard([per_rank[r][n][i] for r in range(world)], dim=dim)
            diff = output_diff(got, ref[i])
            worst[name] = float(diff.max()) if diff.numel() else 0.0
        errors.append(worst)
    return errors


def check_on_processes(world: int, cases: list, layout_kind: str = "zigzag",
                       deadline: float = 120.0) -> list:
    """The ring on ``world`` gloo processes of this CPU against one process: per case, the
    largest error of each output (float64)."""
    per_rank = launch(ring_case_worker, world, (cases, layout_kind), deadline=deadline)
    return ring_errors(per_rank, cases, world, layout_kind)


# ================================================================================================
# 8. fa4_final inside PyTorch's own context_parallel: through the SDPA registration, if present
# ================================================================================================
SDPA_MODULES = ("fa4_final.api.sdpa",)  # fa4_final.register_sdpa() registers this one


def fa4_sdpa_module() -> tuple[str | None, str]:
    """(the fa4_final module PyTorch's FA4 registration can use, or None; a sentence why).

    ``torch.nn.attention._fa4.register_flash_attention_fa4(module_path)`` swaps SDPA's flash
    kernels for a module that exposes FA4's private contract, ``_flash_attn_fwd`` and
    ``_flash_attn_bwd``; context_parallel's ring then calls them for every block."""
    import importlib

    for path in SDPA_MODULES:
        try:
            module = importlib.import_module(path)
        except ImportError:
            continue
        if hasattr(module, "_flash_attn_fwd") and hasattr(module, "_flash_attn_bwd"):
            return path, f"{path} exposes _flash_attn_fwd and _flash_attn_bwd"
    return None, ("fa4_final has no SDPA registration yet: none of "
                  f"{', '.join(SDPA_MODULES)} exposes _flash_attn_fwd and _flash_attn_bwd, the "
                  "contract torch.nn.attention's FA4 registration needs, so PyTorch's "
                  "context_parallel cannot call fa4_final's kernels; that comparison is skipped")


def activate_fa4_sdpa() -> str:
    """Register and activate fa4_final as SDPA's flash implementation (GPU only, PyTorch 2.10 or
    later: fa4_final.register_sdpa); returns the module path, or raises RuntimeError with
    fa4_sdpa_module's sentence."""
    import fa4_final

    path, why = fa4_sdpa_module()
    if path is None:
        raise RuntimeError(why)
    fa4_final.register_sdpa()
    return path


# ================================================================================================
# 9. fa4_final's kernels inside the ring, on Hopper GPUs
# ================================================================================================
# (b, s, h, hk, d, causal): lengths not a multiple of 2W, GQA, D 64 and 128
GPU_CASES = [(1, 1000, 4, 2, 128, True), (2, 777, 4, 4, 64, False), (1, 4099, 8, 2, 128, True)]


def gpu_ring_worker(rank: int, world: int, cases: list):
    """One rank: every case through the ring with fa4_final's kernels, bf16; returns this rank's
    (out, lse, dq, dk, dv) on the CPU in float64."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    comm = DistRing()
    found = []
    for n, (b, s, h, hk, d, causal) in enumerate(cases):
        q, k, v, dout = Case(b, s, h, hk, d, causal, 100 + n).inputs(torch.bfloat16, device)
        layout = zigzag_layout(s, world)
        lq, lk, lv, ldo = (layout.shard(t, rank) for t in (q, k, v, dout))
        out, lse = ring_forward(lq, lk, lv, layout, comm, causal, block_fn=fa4_block_forward)
        grads = ring_backward(ldo, lq, lk, lv, out, lse, layout, comm, causal,
                              block_fn=fa4_block_backward)
        torch.cuda.synchronize()
        found.append(tuple(t.double().cpu() for t in (out, lse, *grads)))
    return found


def check_on_gpus(world: int = 2, backend: str = "gloo", cases=GPU_CASES) -> tuple[bool, list]:
    """The ring with fa4_final's kernels on ``world`` ranks (gloo: ranks may share one GPU, the
    pieces move through host memory; nccl: one GPU per rank) against float64 autograd on the
    same bf16 inputs. Returns (ok, one line per case); the tolerance is 2e-2 of each output's
    largest magnitude (bf16 inputs and outputs)."""
    per_rank = launch(gpu_ring_worker, world, (list(cases),), backend=backend, deadline=600,
                      collective_timeout=120)
    ok, lines = True, []
    for n, (b, s, h, hk, d, causal) in enumerate(cases):
        q, k, v, dout = (t.to(torch.bfloat16).double()
                         for t in Case(b, s, h, hk, d, causal, 100 + n).inputs())
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = reference_attention(*leaves, causal=causal)
        ref = (ref_out.detach(), ref_lse.detach(), *torch.autograd.grad(ref_out, leaves, dout))
        layout = zigzag_layout(s, world)
        errs, case_ok = [], True
        for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
            got = layout.unshard([per_rank[r][n][i] for r in range(world)],
                                 dim=2 if name == "lse" else 1)
            err = float((got - ref[i]).abs().max())
            case_ok &= err <= 2e-2 * max(1.0, float(ref[i].abs().max()))
            errs.append(f"{name} {err:.1e}")
        ok &= case_ok
        lines.append(f"W={world} {backend} b={b} s={s} h={h}/{hk} d={d} causal={causal}: max "
                     f"|ring - float64| {', '.join(errs)} -> {'ok' if case_ok else 'FAIL'}")
    return ok, lines
