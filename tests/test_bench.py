import pytest

from utils.bench import Shape, attention_flops, geomean, ratio_table


def test_flops_formula():
    f = attention_flops(1, 16, 4096, 4096, 128)
    assert f == 4 * 16 * 4096 * 4096 * 128
    assert attention_flops(1, 16, 4096, 4096, 128, causal=True) == f / 2
    assert attention_flops(1, 16, 4096, 4096, 128, pass_="bwd") == 2.5 * f
    with pytest.raises(ValueError):
        attention_flops(1, 1, 1, 1, 1, pass_="sideways")


def test_standard_shape_keeps_tokens_constant():
    assert Shape.standard(4096) == Shape(b=4, s=4096, h=16, d=128)
    assert Shape.standard(16384, d=64, causal=True).b == 1


def test_ratio_table():
    rows = [
        {"impl": "a", "pass": "fwd", "d": 128, "s": 4096, "causal": False, "tflops": 500.0},
        {"impl": "sdpa_cudnn", "pass": "fwd", "d": 128, "s": 4096, "causal": False,
         "tflops": 250.0},
    ]
    text = ratio_table(rows, "sdpa_cudnn")
    assert "2.00x" in text and "1.00x" in text
    assert geomean([2, 8]) == pytest.approx(4)
