"""The varlen benchmark's host-side pieces (no GPU): the length list and the per-sequence FLOPs."""

from solutions.ch12_varlen_bench import draw_lengths, varlen_flops
from utils.bench import attention_flops


def test_lengths_are_seeded_in_range_and_about_the_total():
    lengths = draw_lengths(32, 64, 8192, 65536, seed=0)
    assert lengths == draw_lengths(32, 64, 8192, 65536, seed=0)
    assert len(lengths) == 32 and all(64 <= n <= 8192 for n in lengths)
    assert abs(sum(lengths) - 65536) < 0.1 * 65536


def test_flops_are_counted_per_sequence():
    assert varlen_flops([100, 300], 16, 128, False) == (
        attention_flops(1, 16, 100, 100, 128) + attention_flops(1, 16, 300, 300, 128))
    assert varlen_flops([100, 300], 16, 128, True) == varlen_flops([100, 300], 16, 128, False) / 2
    # more than the dense count at the mean length: the mean square exceeds the squared mean
    assert varlen_flops([100, 300], 1, 64, False) > attention_flops(2, 1, 200, 200, 64)
