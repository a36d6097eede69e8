"""Chapter 13's subsection on SDPA's flash backend: what it prints holds (fa4_final.api.sdpa is
tested in tests/test_sdpa_registration.py; this checks only the chapter's reading of it)."""

import json
from pathlib import Path

import torch

from fa4_final.api import sdpa
from solutions import ch13_teaching as t13

DATA = Path(__file__).resolve().parent / "data" / "sdpa_torch_keywords.json"


def test_the_keywords_shown_are_torch_2_13s_recorded_ones():
    recorded = json.loads(DATA.read_text())["versions"]["2.13"]["sdpa_forward"]
    assert t13.SDPA_FWD_KEYWORDS == recorded


def test_the_contract_sorts_every_parameter_into_one_group():
    text = t13.sdpa_contract()
    assert text.startswith("torch's call binds")
    for fn in ("_flash_attn_fwd", "_flash_attn_bwd"):
        assert f"{fn}:" in text
    assert "tile_mn" in text and "learnable_sink" in text


def test_a_feature_the_package_lacks_is_refused_by_name():
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    said = t13.refusal(lambda: sdpa._flash_attn_fwd(q, q, q, score_mod=lambda *a: a[0]))
    assert said.startswith("UnsupportedError") and "score_mod" in said
