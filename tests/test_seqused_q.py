"""FA4's seqused_q in the Hopper varlen forward (Note [Used query rows] in
fa4_final.common.seqlens), checked with no GPU.

Fast: the tile rule replayed in Python over the kernel's tile order (varlen_locate's count per
sequence from cu_seqlens_q): every used row lies in a tile that is computed, every tile wholly
in padding is skipped, and the used rows a tile stores are exactly min(tile_m, used - start).
Slow: the has_seqused_q builds compiled for sm_90a (with and without a sink, at dv != D): no
spill, no wgmma serialised; a plain varlen kernel given the tensor refuses it by name.
The backward's has_seqused_q kernels compiled likewise (Note [Used query rows in the backward]).
Nothing here runs on a GPU: tests/gpu/test_seqused_q.py does.
"""

from __future__ import annotations

import pytest


def tiles_of(cu_q: list[int], used_q: list[int], tile_m: int, heads: int):
    """(sequence, head, m_block, rows stored) per linear tile, as the kernel walks them."""
    out = []
    for b in range(len(cu_q) - 1):
        rows = cu_q[b + 1] - cu_q[b]
        n_m = -(-rows // tile_m)
        for h in range(heads):
            for m in range(n_m):
                stored = max(0, min(tile_m, used_q[b] - m * tile_m))
                out.append((b, h, m, stored))
    return out


@pytest.mark.parametrize("tile_m", [128, 192])
def test_every_used_row_is_stored_once_and_padding_never(tile_m):
    cu_q = [0, 1, 300, 300 + 1000, 300 + 1000 + 129]
    used_q = [1, 0, 257, 129]
    tiles = tiles_of(cu_q, used_q, tile_m, heads=3)
    for b in range(len(used_q)):
        for h in range(3):
            stored = sum(s for (bb, hh, _, s) in tiles if (bb, hh) == (b, h))
            assert stored == used_q[b]
    skipped = [t for t in tiles if t[3] == 0]
    # sequence 1 (299 padded rows, none used) and sequence 2's tiles past row 257 are skipped
    assert any(t[0] == 1 for t in skipped) and any(t[0] == 2 and t[2] >= 3 for t in skipped)


# ----------------------------------------------------------------------------------------------
# compiled for sm_90a


def _build(**kw):
    from fa4_final.hopper.host import forward_recipe
    from fa4_final.runtime.compile import artifacts

    d = kw.pop("d", 128)
    return artifacts(forward_recipe(d, "bf16", True, varlen=True, has_seqused_k=True,
                                    **kw))["main"]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"sink_dtype": "fp32"}, {"d": 192, "head_dim_v": 128}],
                         ids=["plain", "sink", "d192_dv128"])
def test_seqused_q_builds_compile_clean(kw):
    art = _build(has_seqused_q=True, **kw)
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    assert art.count("WARPGROUP.ARRIVE", where="sass") == art.count("wgmma.fence.sync.aligned")


@pytest.mark.slow
def test_only_the_seqused_q_build_takes_the_tensor():
    from fa4_final.hopper.config import hopper_fwd_default
    from fa4_final.hopper.host import forward_fake_args, forward_kernel
    from fa4_final.runtime.compile import compile_kernel

    cfg = hopper_fwd_default(128, True, True)
    with_q = forward_fake_args("bf16", 128, cfg, True, True, None, None, True)
    plain = forward_fake_args("bf16", 128, cfg, True, True)
    assert len(with_q) == len(plain) + 2 and with_q[-2] is None  # no sink, then seqused_q
    kernel = forward_kernel("bf16", 128, True, False, False, cfg, True, True)
    with pytest.raises(Exception, match="has_seqused_q"):
        compile_kernel(kernel, *with_q, arch="sm_90a")


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"has_dlse": True, "has_seqused_k": True}],
                         ids=["plain", "dlse_seqused_k"])
def test_seqused_q_backward_builds_compile_clean(kw):
    """Note [Used query rows in the backward]: bwd_pre, the main kernel and bwd_post of the
    has_seqused_q variant compile for sm_90a with no spill."""
    from fa4_final.hopper.host import backward_recipe
    from fa4_final.runtime.compile import artifacts

    arts = artifacts(backward_recipe(128, "bf16", True, varlen=True, has_seqused_q=True, **kw))
    for role, art in arts.items():
        assert art.spills == 0 and art.frame_bytes == 0, (role, art.resources())
