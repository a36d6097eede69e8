"""Helpers of labs/context_parallel_three_ways.ipynb: the two ways of splitting attention over W
ranks that chapter 14 describes beside its ring, on torch.distributed (gloo on a CPU), with a
communicator that counts what each rank sends and receives.

    comm = CountingComm()                                            # after init_process_group
    out, lse = allgather_forward(q, k, v, layout, comm, causal)      # this rank's query rows
    dq, dk, dv = allgather_backward(dout, q, k, v, out, lse, layout, comm, causal)
    out, saved = ulysses_forward(q, k, v, layout, comm, causal)      # saved: this rank's heads
    dq, dk, dv = ulysses_backward(dout, saved, layout, comm, causal)
    comm.counts                                                      # bytes, messages, K, V held

q, k, v, dout are the rank's own tokens (``layout.shard`` of the full tensors, (b, s, heads, d)),
as for ``ch14_ring.ring_forward``; the block functions are the chapter's
(``ring.block_forward`` / ``ring.block_backward``: the reference attention at global offsets).
``three_ways_worker`` runs all three ways (the chapter's ring through ``CountingRing``) on one
rank; ``check_three_ways`` launches it on W gloo processes (``ring.launch``) and compares every
output and gradient with one process in float64, and every count with ``formula``.

Note [Counted bytes]
A collective's bytes per rank are counted from the tensors handed to torch.distributed: what the
rank sends to each other rank and receives from each other rank; its own chunk never leaves it
and is not counted. That is what the collective must deliver, whatever algorithm the backend
uses inside: a ring all-gather forwards other ranks' pieces, and still each rank sends W - 1
pieces and receives W - 1. gloo's all_gather and reduce_scatter need equal sizes on every rank;
when the layout's pieces differ by a token, the same collective runs as gloo's all-to-all with
per-rank sizes (the piece sent to every rank; the partial sums received and added), which moves
exactly those bytes, no padding. ``messages`` counts collectives called, or the ring's
exchanges (the chapter's "1 collective", "2 all-to-alls", "W - 1 steps"). ``held`` is the peak
K, V the forward works from, noted where it holds them: the all-gather's whole K, V, the ring's
piece in hand plus the one arriving, Ulysses' K, V heads over the whole sequence. The caller's
own k, v (kept for the backward by every way) are not in it.

Note [Ulysses' heads]
Rank r takes query heads r H/W .. (r+1) H/W and KV heads r Hkv/W .. (r+1) Hkv/W over the whole
sequence. With GQA, query head i reads KV head i // (H/Hkv), and that KV head is in the same
rank's group only when W divides Hkv: ``ulysses_heads`` refuses any other W. (W > Hkv would need
each KV head copied to several ranks; the chapter's model assumes that, this lab does not do it.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from solutions import ch14_ring as ring

WAYS = ("all-gather", "ring", "ulysses")
OUTPUTS = ("out", "lse", "dq", "dk", "dv")


# ================================================================================================
# 1. Counting
# ================================================================================================
@dataclass
class Counts:
    """One rank's traffic over a phase (Note [Counted bytes]): bytes sent to and received from
    other ranks, collectives called (or ring exchanges), and the peak K, V held, in bytes."""

    sent: int = 0
    received: int = 0
    messages: int = 0
    held: int = 0

    def hold(self, nbytes: int) -> None:
        self.held = max(self.held, int(nbytes))


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Counted:
    """A communicator's ``counts``; ``take()`` returns the counts so far and starts new ones."""

    counts: Counts

    def take(self) -> Counts:
        done, self.counts = self.counts, Counts()
        return done


class CountingComm(_Counted):
    """All-to-all, all-gather and reduce-scatter over a torch.distributed process group, each call
    counted in ``counts`` (Note [Counted bytes]); ``take()`` returns the counts so far and starts
    new ones. Tensors travel flat; the caller knows every rank's size from the layout."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.counts = Counts()

    def _count(self, send_numels, recv_numels, itemsize: int) -> None:
        c = self.counts
        c.sent += itemsize * sum(n for s, n in enumerate(send_numels) if s != self.rank)
        c.received += itemsize * sum(n for s, n in enumerate(recv_numels) if s != self.rank)
        c.messages += 1

    def _alltoallv(self, chunks, recv_numels) -> list:
        send = torch.cat([c.reshape(-1) for c in chunks])
        recv = send.new_empty(sum(recv_numels))
        self.dist.all_to_all_single(recv, send, list(recv_numels), [c.numel() for c in chunks],
                                    group=self.group)
        return list(recv.split(list(recv_numels)))

    def all_to_all(self, chunks, recv_numels) -> list:
        """Send ``chunks[s]`` to rank s; return the W flat tensors received, ``[s]`` from rank s,
        of ``recv_numels[s]`` elements."""
        self._count([c.numel() for c in chunks], recv_numels, chunks[0].element_size())
        return self._alltoallv(chunks, recv_numels)

    def all_gather(self, piece, numels) -> list:
        """Every rank's ``piece`` (flat), ``[s]`` from rank s; ``numels[s]`` their sizes."""
        flat = piece.reshape(-1).contiguous()
        self._count([flat.numel()] * self.world, numels, flat.element_size())
        if len(set(numels)) == 1:
            out = [torch.empty_like(flat) for _ in range(self.world)]
            self.dist.all_gather(out, flat, group=self.group)
            return out
        return self._alltoallv([flat] * self.world, numels)  # uneven pieces: gloo's alltoallv

    def reduce_scatter(self, chunks):
        """The sum over ranks of their ``chunks[rank]``, flat: rank s sends ``chunks[s']`` to
        rank s' and adds what it receives."""
        flat = [c.reshape(-1).contiguous() for c in chunks]
        mine = flat[self.rank].numel()
        self._count([c.numel() for c in flat], [mine] * self.world, flat[0].element_size())
        if len({c.numel() for c in flat}) == 1:
            out = torch.empty_like(flat[self.rank])
            self.dist.reduce_scatter(out, flat, op=self.dist.ReduceOp.SUM, group=self.group)
            return out
        return torch.stack(self._alltoallv(flat, [mine] * self.world)).sum(0)


class CountingRing(ring.DistRing, _Counted):
    """The chapter's DistRing, each exchange counted: the tensor sent, the one received, and the
    two held at once (the piece in hand and the one arriving)."""

    def __init__(self, group=None):
        super().__init__(group)
        self.counts = Counts()

    def exchange(self, tensor, shape=None):
        shape = tuple(tensor.shape) if shape is None else tuple(shape)
        sent, got = _nbytes(tensor), math.prod(shape) * tensor.element_size()
        c = self.counts
        c.sent, c.received, c.messages = c.sent + sent, c.received + got, c.messages + 1
        c.hold(sent + got)
        return super().exchange(tensor, shape)


# ================================================================================================
# 2. All-gather K, V: every rank holds the whole K and V
# ================================================================================================
def gather_kv(k, v, layout: ring.Layout, comm):
    """The whole K and V in global token order, from every rank's piece (one all-gather)."""
    b, _, hk, d = k.shape
    numels = [b * layout.local_len(s) * hk * (d + v.shape[-1]) for s in range(comm.world)]
    pieces = comm.all_gather(ring._pack(k, v), numels)
    kvs = [ring._unpack(p, ring._kv_shapes(k, v, layout.local_len(s)))
           for s, p in enumerate(pieces)]
    k_all = layout.unshard([kv[0] for kv in kvs])
    v_all = layout.unshard([kv[1] for kv in kvs])
    comm.counts.hold(_nbytes(k_all, v_all))
    return k_all, v_all


def _visible_keys(q_start: int, q_len: int, seqlen: int, causal: bool) -> int:
    """Keys 0..n that a query range can see: with a causal mask none after its last query."""
    return q_start + q_len if causal else seqlen


def allgather_forward(q, k, v, layout: ring.Layout, comm, causal: bool = False,
                      softmax_scale=None, block_fn=ring.block_forward):
    """This rank's (out, lse): gather K and V, then each of the rank's query ranges against every
    key it can see, at its global offset. No merge: each row sees all its keys in one block."""
    scale = ring._scale(q, softmax_scale)
    k_all, v_all = gather_kv(k, v, layout, comm)
    b, lq, h, _ = q.shape
    out = q.new_zeros(b, lq, h, v.shape[-1])
    lse = q.new_full((b, h, lq), float("-inf"))
    for q_at, q_start, q_len in layout.local_ranges(comm.rank):
        if q_len == 0:
            continue
        rows, keys = slice(q_at, q_at + q_len), _visible_keys(q_start, q_len, layout.seqlen,
                                                             causal)
        out[:, rows], lse[..., rows] = block_fn(q[:, rows], k_all[:, :keys], v_all[:, :keys],
                                                q_start, 0, causal, scale)
    return out, lse


def allgather_backward(dout, q, k, v, out, lse, layout: ring.Layout, comm, causal: bool = False,
                       softmax_scale=None, block_fn=ring.block_backward):
    """This rank's (dq, dk, dv). K and V are gathered again (the forward did not keep them: between
    forward and backward a rank holds only its own piece, as with the ring); every rank computes
    dK, dV of all keys from its queries, and one reduce-scatter sums them at the keys' owners."""
    scale = ring._scale(q, softmax_scale)
    k_all, v_all = gather_kv(k, v, layout, comm)
    dq = torch.zeros_like(q)
    dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
    for q_at, q_start, q_len in layout.local_ranges(comm.rank):
        if q_len == 0:
            continue
        rows, keys = slice(q_at, q_at + q_len), _visible_keys(q_start, q_len, layout.seqlen,
                                                             causal)
        g_q, g_k, g_v = block_fn(dout[:, rows], q[:, rows], k_all[:, :keys], v_all[:, :keys],
                                 out[:, rows], lse[..., rows], q_start, 0, causal, scale)
        dq[:, rows] = g_q
        dk_all[:, :keys] += g_k
        dv_all[:, :keys] += g_v
    chunks = [ring._pack(layout.shard(dk_all, s), layout.shard(dv_all, s))
              for s in range(comm.world)]
    dk, dv = ring._unpack(comm.reduce_scatter(chunks), ring._kv_shapes(k, v, k.shape[1]))
    return dq, dk, dv


# ================================================================================================
# 3. All-to-all over heads (DeepSpeed Ulysses): every rank holds the whole sequence of its heads
# ================================================================================================
def ulysses_heads(world: int, heads: int, heads_kv: int) -> tuple[int, int]:
    """(query heads, KV heads) per rank (Note [Ulysses' heads]); a clear error for any other W."""
    if heads_kv <= 0 or heads % heads_kv:
        raise ValueError(f"heads = {heads} must be a multiple of heads_kv = {heads_kv} (GQA)")
    if world <= 0 or heads_kv % world:
        fits = [w for w in range(1, heads_kv + 1) if heads_kv % w == 0]
        raise ValueError(
            f"Ulysses gives every rank whole KV heads: W = {world} does not divide heads_kv = "
            f"{heads_kv}. Use W in {fits}, or the ring or the all-gather, which split the "
            "tokens and work for any W")
    return heads // world, heads_kv // world


@dataclass
class HeadShard:
    """What a rank keeps from Ulysses' forward for its backward: its heads over the whole
    sequence, in global token order. Query heads rank * H/W.., KV heads rank * Hkv/W..; lse is
    (b, H/W, S)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


def _heads(t, per_rank: int, s: int):
    return t[:, :, s * per_rank:(s + 1) * per_rank]


def ulysses_forward(q, k, v, layout: ring.Layout, comm, causal: bool = False, softmax_scale=None,
                    block_fn=ring.block_forward):
    """This rank's out (its tokens, every head) and its HeadShard. One all-to-all turns "my
    tokens, every head" into "every token, my heads" (Q, K and V packed together); the rank runs
    plain attention on its heads; a second all-to-all returns each rank its tokens of out."""
    world = comm.world
    b, lr, h, d = q.shape
    hk, dv = k.shape[2], v.shape[-1]
    hq, hkv = ulysses_heads(world, h, hk)
    scale = ring._scale(q, softmax_scale)
    lens = [layout.local_len(s) for s in range(world)]

    def shapes(n):
        return [(b, n, hq, d), (b, n, hkv, d), (b, n, hkv, dv)]

    chunks = [ring._pack(_heads(q, hq, s), _heads(k, hkv, s), _heads(v, hkv, s))
              for s in range(world)]
    got = comm.all_to_all(chunks, [b * n * (hq * d + hkv * (d + dv)) for n in lens])
    parts = [ring._unpack(g, shapes(n)) for g, n in zip(got, lens)]
    q_h, k_h, v_h = (layout.unshard([p[i] for p in parts]) for i in range(3))
    comm.counts.hold(_nbytes(k_h, v_h))
    out_h, lse_h = block_fn(q_h, k_h, v_h, 0, 0, causal, scale)
    back = comm.all_to_all([layout.shard(out_h, s) for s in range(world)],
                           [b * lr * hq * dv] * world)
    out = torch.cat([g.view(b, lr, hq, dv) for g in back], dim=2)
    return out, HeadShard(q_h, k_h, v_h, out_h, lse_h)


def ulysses_backward(dout, saved: HeadShard, layout: ring.Layout, comm, causal: bool = False,
                     softmax_scale=None, block_fn=ring.block_backward):
    """This rank's (dq, dk, dv): dout goes to the heads' owners, each rank runs the backward of
    its heads over the whole sequence, and dQ, dK, dV come back to the tokens' owners."""
    world = comm.world
    b, lr, h, dv = dout.shape
    hq, hkv, d = saved.q.shape[2], saved.k.shape[2], saved.q.shape[-1]
    scale = ring._scale(saved.q, softmax_scale)
    lens = [layout.local_len(s) for s in range(world)]
    got = comm.all_to_all([_heads(dout, hq, s) for s in range(world)],
                          [b * n * hq * dv for n in lens])
    dout_h = layout.unshard([g.view(b, n, hq, dv) for g, n in zip(got, lens)])
    dq_h, dk_h, dv_h = block_fn(dout_h, saved.q, saved.k, saved.v, saved.out, saved.lse, 0, 0,
                                causal, scale)
    back = comm.all_to_all(
        [ring._pack(layout.shard(dq_h, s), layout.shard(dk_h, s), layout.shard(dv_h, s))
         for s in range(world)], [b * lr * (hq * d + hkv * (d + dv))] * world)
    parts = [ring._unpack(g, [(b, lr, hq, d), (b, lr, hkv, d), (b, lr, hkv, dv)]) for g in back]
    return tuple(torch.cat([p[i] for p in parts], dim=2) for i in range(3))


# ================================================================================================
# 4. The formula: what each way must send and receive, per rank (any layout, even or not)
# ================================================================================================
def formula(way: str, phase: str, layout: ring.Layout, rank: int, b: int, h: int, hk: int,
            d: int, dv: int | None = None, itemsize: int = 8) -> Counts:
    """The Counts a rank must show for ``way`` ('all-gather', 'ring', 'ulysses') and ``phase``
    ('fwd', 'bwd'), from the layout's piece lengths L_s alone (S = sum L_s, r this rank).

    all-gather fwd: send L_r to W-1 ranks, receive S - L_r tokens of K, V; hold S tokens.
               bwd: the same gather again, then a reduce-scatter of dK, dV: send S - L_r, receive
                    W-1 partial sums of L_r.
    ring fwd: W-1 exchanges; step t sends piece r-t, receives piece r-t-1.
         bwd: those W-1 exchanges of K, V, and W of dK, dV (one more hop, home): every piece.
    ulysses fwd: Q, K, V of the other ranks' heads out (L_r tokens each), of mine in (S - L_r),
                 then out the other way; hold S tokens of my KV heads.
            bwd: dO out as Q went, dQ, dK, dV back as out came.
    ``held`` is given for the forward only (0 for the backward)."""
    dv = d if dv is None else dv
    world, seqlen = layout.world, layout.seqlen
    lens = [layout.local_len(s) for s in range(world)]
    mine, others = lens[rank], seqlen - lens[rank]
    kv = b * hk * (d + dv) * itemsize  # K and V of one token, all KV heads
    if way == "all-gather":
        gather = Counts((world - 1) * mine * kv, others * kv, 1, seqlen * kv)
        if phase == "fwd":
            return gather
        return Counts(gather.sent + others * kv, gather.received + (world - 1) * mine * kv, 2)
    if way == "ring":
        step = [(lens[(rank - t) % world], lens[(rank - t - 1) % world]) for t in range(world - 1)]
        sent, got = sum(a for a, _ in step) * kv, sum(c for _, c in step) * kv
        if phase == "fwd":
            return Counts(sent, got, world - 1, max((a + c for a, c in step), default=0) * kv)
        return Counts(sent + seqlen * kv, got + seqlen * kv, 2 * world - 1) if world > 1 \
            else Counts()
    if way == "ulysses":
        hq, hkv = ulysses_heads(world, h, hk)
        qkv = b * (hq * d + hkv * (d + dv)) * itemsize  # Q, K, V of one token, one rank's heads
        o = b * hq * dv * itemsize  # out (or dO) of one token, one rank's heads
        first, second = ((qkv, o) if phase == "fwd" else (o, qkv))
        held = seqlen * b * hkv * (d + dv) * itemsize if phase == "fwd" else 0
        return Counts((world - 1) * mine * first + others * second,
                      others * first + (world - 1) * mine * second, 2, held)
    raise ValueError(f"way must be one of {WAYS}, got {way!r}")


# ================================================================================================
# 5. On W processes: every way's outputs, gradients and counts against one process
# ================================================================================================
def three_ways_worker(rank: int, world: int, cases: list, layout_kind: str = "zigzag") -> list:
    """A rank of ``ring.launch``: every case through the ring, the all-gather and Ulysses (float64,
    forward then backward). Per case and way: this rank's outputs and its counts per phase, or,
    where Ulysses refuses this W, its error message. Ulysses' lse is its heads' (b, H/W, S)."""
    found = []
    for case in cases:
        q, k, v, dout = case.inputs()
        layout = ring.layout_of(layout_kind, case.s, world)
        lq, lk, lv, ldo = (layout.shard(t, rank) for t in (q, k, v, dout))
        ways = {}
        comm = CountingRing()
        out, lse = ring.ring_forward(lq, lk, lv, layout, comm, case.causal)
        fwd = comm.take()
        grads = ring.ring_backward(ldo, lq, lk, lv, out, lse, layout, comm, case.causal)
        ways["ring"] = {"outputs": (out, lse, *grads), "fwd": asdict(fwd),
                        "bwd": asdict(comm.take())}
        comm = CountingComm()
        out, lse = allgather_forward(lq, lk, lv, layout, comm, case.causal)
        fwd = comm.take()
        grads = allgather_backward(ldo, lq, lk, lv, out, lse, layout, comm, case.causal)
        ways["all-gather"] = {"outputs": (out, lse, *grads), "fwd": asdict(fwd),
                              "bwd": asdict(comm.take())}
        try:
            out, saved = ulysses_forward(lq, lk, lv, layout, comm, case.causal)
        except ValueError as exc:  # every rank refuses the same W before any collective
            ways["ulysses"] = {"refused": str(exc)}
        else:
            fwd = comm.take()
            grads = ulysses_backward(ldo, saved, layout, comm, case.causal)
            ways["ulysses"] = {"outputs": (out, saved.lse, *grads), "fwd": asdict(fwd),
                               "bwd": asdict(comm.take())}
        found.append(ways)
    return found


def _relative(got, want) -> float:
    """The largest |got - want| (ring.output_diff: equal infinities agree) over want's largest
    finite magnitude; the absolute difference where that is 0."""
    diff = ring.output_diff(got, want)
    worst = float(diff.max()) if diff.numel() else 0.0
    finite = want[torch.isfinite(want)].abs()
    scale = float(finite.max()) if finite.numel() else 0.0
    return worst / scale if scale > 0 else worst


def compare(case, world: int, per_rank: list, layout_kind: str = "zigzag") -> dict:
    """One case's per-rank results (``[three_ways_worker's entry for the case] per rank``) against
    one process: per way, the largest relative error of each output ({name: error}), the counts
    per rank and phase beside ``formula``'s, or the refusal."""
    layout = ring.layout_of(layout_kind, case.s, world)
    ref = dict(zip(OUTPUTS, ring.reference_case(case)))
    report = {}
    for way in WAYS:
        ranks = [per_rank[r][way] for r in range(world)]
        if "refused" in ranks[0]:
            report[way] = {"refused": ranks[0]["refused"],
                           "all_refused": all("refused" in x for x in ranks)}
            continue
        errors = {}
        for i, name in enumerate(OUTPUTS):
            pieces = [x["outputs"][i] for x in ranks]
            if way == "ulysses" and name == "lse":  # (b, H/W, S) per rank: heads in rank order
                got = torch.cat(pieces, dim=1)
            else:
                got = layout.unshard(pieces, dim=2 if name == "lse" else 1)
            errors[name] = _relative(got, ref[name])
        counts = {phase: [(Counts(**ranks[r][phase]),
                           formula(way, phase, layout, r, case.b, case.h, case.hk, case.d))
                          for r in range(world)] for phase in ("fwd", "bwd")}
        report[way] = {"errors": errors, "counts": counts}
    return report


def check_three_ways(world: int, cases: list, layout_kind: str = "zigzag",
                     deadline: float = 120.0) -> list[dict]:
    """All three ways on ``world`` gloo processes of this CPU (one launch for every case), each
    case compared with one process (``compare``)."""
    per_rank = ring.launch(three_ways_worker, world, (list(cases), layout_kind),
                           deadline=deadline)
    return [compare(case, world, [per_rank[r][n] for r in range(world)], layout_kind)
            for n, case in enumerate(cases)]


def counts_match(report: dict, way: str, phase: str) -> bool:
    """Whether every rank's counted sent, received and messages (and, for the forward, held)
    equal the formula's."""
    for got, want in report[way]["counts"][phase]:
        keys = ("sent", "received", "messages") + (("held",) if phase == "fwd" else ())
        if any(getattr(got, key) != getattr(want, key) for key in keys):
            return False
    return True


# ================================================================================================
# 6. What the notebook prints
# ================================================================================================
def describe(case) -> str:
    return (f"S={case.s} b={case.b} heads {case.h}/{case.hk} d={case.d} "
            f"{'causal' if case.causal else 'not causal'}")


def error_lines(world: int, cases: list, reports: list) -> list[str]:
    """Per case and way, the largest relative error over out, lse, dq, dk, dv, or the refusal."""
    lines = []
    for case, report in zip(cases, reports):
        lines.append(f"W = {world}, {describe(case)}:")
        for way in WAYS:
            r = report[way]
            if "refused" in r:
                lines.append(f"  {way:10s} refused: {r['refused']}")
                continue
            worst = max(r["errors"].values())
            lines.append(f"  {way:10s} largest relative error {worst:.1e} ("
                         + ", ".join(f"{n} {e:.0e}" for n, e in r["errors"].items()) + ")")
    return lines


def count_lines(table: dict, phase: str = "fwd") -> list[str]:
    """``table``: {world: report of one case}. Rank 0's counted bytes received and sent, messages
    and K, V held per way and W, and whether every rank equals the formula."""
    head = (f"{'way':11s} {'W':>2s} {'received B':>11s} {'sent B':>9s} {'messages':>8s} "
            + (f"{'K, V held B':>11s}" if phase == "fwd" else "") + "  every rank = formula")
    lines = [head]
    for way in WAYS:
        for world, report in table.items():
            r = report[way]
            if "refused" in r:
                lines.append(f"{way:11s} {world:2d}  refused (W does not divide heads_kv)")
                continue
            got = r["counts"][phase][0][0]
            lines.append(f"{way:11s} {world:2d} {got.received:11,d} {got.sent:9,d} "
                         f"{got.messages:8d} " + (f"{got.held:11,d}" if phase == "fwd" else "")
                         + f"  {'yes' if counts_match(report, way, phase) else 'NO'}")
    return lines


def model_check(seqlen: int, world: int, m: dict | None = None) -> list[dict]:
    """The chapter's model (ch14_teaching.strategies: MB per rank, forward, bf16, batch 1) beside
    ``formula`` on an even split of the same shape: received and K, V held, per way."""
    from solutions import ch14_teaching as t14

    m = t14.MODEL if m is None else m
    layout = ring.contiguous_layout(seqlen, world)
    names = {"all-gather K, V": "all-gather", "ring (this chapter)": "ring",
             "all-to-all over heads (Ulysses)": "ulysses"}
    rows = []
    for row in t14.strategies(seqlen, world, m):
        way = names[row["way"]]
        f = formula(way, "fwd", layout, 0, 1, m["heads"], m["heads_kv"], m["head_dim"],
                    itemsize=2)
        rows.append({"way": way, "model_received_mb": row["received_mb"],
                     "formula_received_mb": f.received / 1e6, "model_held_mb": row["kv_held_mb"],
                     "formula_held_mb": f.held / 1e6})
    return rows


def crossover_world(heads: int, heads_kv: int) -> float:
    """W above which Ulysses' forward receives fewer bytes per rank than the all-gather's (even
    split): (W-1)/W (2H + 2Hkv) < (W-1) 2Hkv, i.e. W > 1 + H/Hkv."""
    return 1 + heads / heads_kv
