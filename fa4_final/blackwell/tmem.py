"""Tensor memory (TMEM) as data: the column plan of a kernel, and the rules of access.

TMEM is a 256 KB scratchpad per SM beside the tensor cores: 128 lanes (rows) x 512 columns of
32 bits. ``tcgen05.mma`` writes its fp32 accumulator there (one lane per row of the tile, one
column per output column) and may read its A operand from there; threads reach it only through
``tcgen05.ld`` / ``tcgen05.st`` (TMEM <-> registers). Three rules shape every plan:

1. Allocation is in columns, all 128 lanes at once, by one warp (``tcgen05.alloc``), a power of
   two >= 32 columns, at most 512 per SM; the same warp frees them (``tcgen05.dealloc``) and
   gives up the right to allocate again (``relinquish_alloc_permit``) so a second CTA on the SM
   can allocate.
2. The lane-quarter rule: warp w of a CTA reaches only lanes 32 (w mod 4) .. 32 (w mod 4) + 31.
   A warpgroup (4 consecutive warps starting at a multiple of 4) therefore covers all 128 lanes,
   one row per thread: that is why every TMEM role of the forward is a whole warpgroup.
3. A 16-bit operand packs two values per 32-bit column: P (bf16) for a 128 x 128 S tile needs 64
   columns, so it fits inside the 128 columns of the S it was computed from ("P aliases S").

Note [The forward's plan]
At D = 128 with two Q tiles (ping-pong) and 128-key tiles the forward needs S0, S1 (the scores of
each Q tile: 128 columns each) and O0, O1 (each Q tile's output accumulator: D columns each):
2 * 128 + 2 * 128 = 512, every column of the SM. P_i lives in the upper half of S_i's columns:
the softmax reads all of S_i into registers before it writes any P_i, and the MMA warp issues
P_i V before the next S_i = Q_i K^T, which tcgen05 executes in issue order. At D = 64 the plan
uses 384 columns and allocates 512 (the next power of two).
"""

from __future__ import annotations

from dataclasses import dataclass

TMEM_LANES = 128
TMEM_COLUMNS = 512  # per SM (fa4_final.common.constants.SM100_TMEM_COLUMNS)
COLUMN_BITS = 32
LANES_PER_WARP = 32
MIN_ALLOC_COLUMNS = 32


def lane_quarter(warp: int) -> range:
    """The TMEM lanes warp ``warp`` (its index in the CTA) may load from and store to."""
    if isinstance(warp, bool) or not isinstance(warp, int) or warp < 0:
        raise ValueError(f"warp must be a warp index >= 0, got {warp!r}")
    q = warp % (TMEM_LANES // LANES_PER_WARP)
    return range(q * LANES_PER_WARP, (q + 1) * LANES_PER_WARP)


def alloc_columns(needed: int) -> int:
    """Columns ``tcgen05.alloc`` must ask for to hold ``needed``: a power of two, >= 32."""
    if isinstance(needed, bool) or not isinstance(needed, int) or needed < 1:
        raise ValueError(f"needed must be a positive number of columns, got {needed!r}")
    if needed > TMEM_COLUMNS:
        raise ValueError(f"{needed} columns do not fit in TMEM's {TMEM_COLUMNS}")
    n = MIN_ALLOC_COLUMNS
    while n < needed:
        n *= 2
    return n


def columns_for(cols: int, bits: int) -> int:
    """32-bit TMEM columns that ``cols`` values of ``bits`` bits take in one lane."""
    if bits not in (16, 32):
        raise ValueError(f"TMEM holds 16- or 32-bit values here, got {bits} bits")
    return cols * bits // COLUMN_BITS


@dataclass(frozen=True)
class Region:
    """Columns [start, start + columns) of every lane, holding one tile."""

    name: str
    start: int
    columns: int
    what: str
    alias_of: str | None = None  # lives inside this other region (P inside S)

    @property
    def end(self) -> int:
        return self.start + self.columns


@dataclass(frozen=True)
class TmemPlan:
    """Named column regions of one kernel. ``check()`` proves the plan fits and that only
    declared aliases overlap; the kernel builds its TMEM tensors from these offsets."""

    regions: tuple[Region, ...]

    def __getitem__(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"no TMEM region {name!r}; regions: {[r.name for r in self.regions]}")

    def offset(self, name: str) -> int:
        return self[name].start

    @property
    def columns_used(self) -> int:
        return max(r.end for r in self.regions)

    @property
    def columns_allocated(self) -> int:
        return alloc_columns(self.columns_used)

    def check(self) -> TmemPlan:
        for r in self.regions:
            if r.start < 0 or r.columns < 1:
                raise ValueError(f"TMEM region {r.name}: bad extent [{r.start}, {r.end})")
            if r.alias_of is not None:
                host = self[r.alias_of]
                if not (host.start <= r.start and r.end <= host.end):
                    raise ValueError(f"{r.name} must lie inside {host.name} "
                                     f"[{host.start}, {host.end}), got [{r.start}, {r.end})")
        if self.columns_used > TMEM_COLUMNS:
            raise ValueError(
                f"the plan needs {self.columns_used} TMEM columns, more than the {TMEM_COLUMNS} "
                f"of an SM: {', '.join(f'{r.name} {r.columns}' for r in self.regions)}")
        owners = [r for r in self.regions if r.alias_of is None]
        for i, a in enumerate(owners):
            for b in owners[i + 1:]:
                if a.start < b.end and b.start < a.end:
                    raise ValueError(f"TMEM regions {a.name} [{a.start}, {a.end}) and "
                                     f"{b.name} [{b.start}, {b.end}) overlap")
        return self

    def table(self) -> list[dict]:
        return [{"region": r.name, "columns": f"{r.start}..{r.end - 1}", "count": r.columns,
                 "holds": r.what + (f" (inside {r.alias_of})" if r.alias_of else "")}
                for r in self.regions]


def forward_plan(tile_n: int, head_dim: int, q_stages: int = 2, elem_bits: int = 16) -> TmemPlan:
    """The forward's plan (Note [The forward's plan]): S_i, then O_i, for each Q stage i; P_i in
    the upper half of S_i's columns."""
    regions = []
    for i in range(q_stages):
        regions.append(Region(f"S{i}", i * tile_n, tile_n, f"S = Q{i} K^T, fp32"))
    o_base = q_stages * tile_n
    for i in range(q_stages):
        regions.append(Region(f"O{i}", o_base + i * head_dim, head_dim,
                              f"O{i} accumulator, fp32"))
    p_cols = columns_for(tile_n, elem_bits)
    for i in range(q_stages):
        s = regions[i]
        regions.append(Region(f"P{i}", s.end - p_cols, p_cols,
                              f"P{i} = exp2(S{i} - m), {elem_bits}-bit pairs", alias_of=s.name))
    return TmemPlan(tuple(regions)).check()


def backward_plan(tile_n: int, tile_m: int, head_dim: int, elem_bits: int = 16) -> TmemPlan:
    """The backward's plan (Note [The backward's plan] in fa4_final.blackwell.bwd): one key per
    lane. S^T and dP^T (tile_m query columns each), then the dV and dK accumulators (D columns
    each) that live for the whole CTA; P^T in the upper half of S^T, dQ (one query per lane)
    inside dP^T's columns."""
    regions = [
        Region("S", 0, tile_m, "S^T = K Q^T, fp32"),
        Region("dP", tile_m, tile_m, "dP^T = V dO^T, fp32"),
        Region("dV", 2 * tile_m, head_dim, "dV accumulator, fp32"),
        Region("dK", 2 * tile_m + head_dim, head_dim, "dK accumulator (unscaled), fp32"),
    ]
    p_cols = columns_for(tile_m, elem_bits)
    regions.append(Region("P", tile_m - p_cols, p_cols,
                          f"P^T = exp2(S^T - lse), {elem_bits}-bit pairs", alias_of="S"))
    regions.append(Region("dQ", tile_m, head_dim, "dQ = dS K, fp32, one query per lane",
                          alias_of="dP"))
    del tile_n  # the lanes: one key per lane, tile_n = 128
    return TmemPlan(tuple(regions)).check()


def backward_pair_plan(tile_m: int, head_dim: int, elem_bits: int = 16) -> TmemPlan:
    """The 2-CTA backward's plan, per CTA (fa4_final.blackwell.bwd_pair's docstring): the CTA's
    128 keys on its lanes, as the 1-CTA plan; S^T, dP^T, dV, dK = 512
    columns at D = 128. P^T in S^T's upper half; dS^T (16-bit, dK's A operand read from TMEM)
    in dP^T's upper half; dQ (the pair's M = 128 accumulator: 64 queries per CTA, lanes i and
    64 + i holding the two halves of query i's row, D/2 columns) in dP^T's lower half."""
    p_cols = columns_for(tile_m, elem_bits)
    regions = (
        Region("S", 0, tile_m, "S^T = K Q^T, fp32"),
        Region("dP", tile_m, tile_m, "dP^T = V dO^T, fp32"),
        Region("dV", 2 * tile_m, head_dim, "dV accumulator, fp32"),
        Region("dK", 2 * tile_m + head_dim, head_dim, "dK accumulator (unscaled), fp32"),
        Region("P", tile_m - p_cols, p_cols, f"P^T = exp2(S^T - lse), {elem_bits}-bit pairs",
               alias_of="S"),
        Region("dS", 2 * tile_m - p_cols, p_cols, f"dS^T, {elem_bits}-bit pairs (A of dK)",
               alias_of="dP"),
        Region("dQ", tile_m, head_dim // 2, "dQ = dS K, fp32: 64 queries, half a row per lane",
               alias_of="dP"),
    )
    return TmemPlan(regions).check()
