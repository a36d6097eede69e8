"""measure/decode.py without a GPU: its grid, the page table it draws, the roofline and best-peer
fields it adds to rows, and the row shape the results files require (utils.results)."""

import pytest
import torch

from measure import decode
from utils import results


def test_the_grid_is_the_issue_s_grid():
    shapes = decode.grid([1, 4, 16], [1024, 8192, 32768, 131072], [1, 32, 128],
                         [(32, 8), (64, 8)], [128, 64])
    assert len(shapes) == 3 * 4 * 3 * 2 * 2
    s = decode.DecodeShape(batch=32, tokens=1, keys=8192, heads=32, heads_kv=8, d=128)
    assert s.kv_bytes() == 2 * 32 * 8192 * 8 * 128 * 2  # 1.07 GB: 0.25 ms at 4.3 TB/s
    assert s.flops() == 4 * 32 * 32 * 1 * 8192 * 128


def test_the_page_table_is_a_permutation_of_every_page():
    t = decode.random_page_table(3, 1024, 128, torch.Generator().manual_seed(1))
    assert t.dtype == torch.int32 and t.shape == (3, 8)
    assert sorted(t.flatten().tolist()) == list(range(24))
    with pytest.raises(ValueError, match="multiple of the page size"):
        decode.random_page_table(1, 1000, 128)


def _row(impl, ms, mode="flush", **shape):
    s = decode.DecodeShape(**{"batch": 32, "tokens": 1, "keys": 8192, "heads": 32,
                              "heads_kv": 8, "d": 128, **shape})
    return {"impl": impl, "mode": mode, **decode.row_fields(s, 128), "ms": ms,
            "tflops": s.flops() / (ms * 1e-3) / 1e12}


def test_roofline_and_best_peer_fields():
    rows = [{"impl": "copy", "metric": "copy_rate", "value": 4.0, "unit": "TB/s",
             "mode": "flush"},
            _row("fa4_final", 0.30), _row("sdpa_cudnn", 0.40), _row("fa4_package", 0.50),
            _row("fa4_final", 0.30, mode="back_to_back"),
            _row("sdpa_cudnn", 0.20, tokens=4)]
    decode.attach_roofline(rows)
    ours = rows[1]
    assert ours["best_peer"] == "sdpa_cudnn" and ours["vs_best_peer"] == pytest.approx(0.4 / 0.3)
    assert ours["read_tbps"] == pytest.approx(ours["kv_bytes"] / 0.30e-3 / 1e12)
    assert ours["of_copy"] == pytest.approx(ours["read_tbps"] / 4.0)
    assert rows[2]["best_peer"] == "fa4_package"  # a peer is compared with the other peers
    assert "best_peer" not in rows[4] and "of_copy" not in rows[4]  # no peer, no copy row there
    results.validate({"provenance": {k: "x" for k in results.PROVENANCE_KEYS}, "rows": rows})
