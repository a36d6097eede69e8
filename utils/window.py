"""FA4's meaning of ``causal`` and ``window_size``, written out by brute force: the oracle the
package's tests and the conformance run (measure/conformance.py) hold fa4_final against.

The FA4 package (4.0.0b36: ``flash_attn/cute/interface.py`` resolves the window, ``testing.py``
builds its reference mask) reads a call so:
- a side that is None is unbounded;
- a side that is an int is a bound, negative ones included: with offset = seqlen_k - seqlen_q,
  query row i sees key j when i + offset - left <= j <= i + offset + right, and 0 <= j < seqlen_k;
  so ``(None, -w)`` keeps keys at least w before the diagonal and ``(-w, None)`` keys at least
  w after it;
- only a window whose two sides are both negative means "no window" (FlashAttention-2's -1);
- ``causal=True`` sets the right side to 0, whatever was given.

Nothing here imports fa4_final: the package's own normalisation and tile arithmetic are tested
against this (tests/test_window_negative_sides.py).
"""

from __future__ import annotations

import torch


def fa4_sides(causal: bool, window_size) -> tuple[int | None, int | None]:
    """(left, right) after FA4's resolution: None for an unbounded side."""
    left, right = (None, None) if window_size is None else window_size
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    return left, right


def sees(i: int, j: int, sq: int, sk: int, causal: bool, window_size) -> bool:
    """Whether query row i sees key j (one pair, plain ints)."""
    if not (0 <= i < sq and 0 <= j < sk):
        return False
    left, right = fa4_sides(causal, window_size)
    diagonal = i + sk - sq
    if right is not None and j > diagonal + right:
        return False
    return left is None or j >= diagonal - left


def visible_mask(sq: int, sk: int, causal: bool, window_size, device=None) -> torch.Tensor:
    """(sq, sk) bool, True where ``sees`` is; built by comparing index grids."""
    left, right = fa4_sides(causal, window_size)
    diagonal = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right is not None:
        ok &= j <= diagonal + right
    if left is not None:
        ok &= j >= diagonal - left
    return ok


# Windows of every sign, for the tests that walk them: unbounded, causal, positive and negative
# bounds on either side, both negative (no window), empty windows (left + right < 0).
WINDOWS = [
    (None, None), (-1, -1), (-5, -1), (None, 0), (0, 0), (0, None), (3, 0), (17, 5), (100, None),
    (None, 40), (None, -1), (None, -7), (-1, None), (-9, None), (-3, 10), (10, -3), (5, -5),
    (-4, 3), (2, -3), (-200, None), (None, -200), (300, -1),
]
