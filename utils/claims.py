"""Prose that cannot drift from its data: every sentence that compares measured figures is
backed by a check that reads the results file it describes.

A markdown cell that compares measurements ("faster", "slower", "within noise", "ahead of the
FA4 package", a ratio, "the cost is ...") names the claims it makes in an HTML comment the reader
does not see:

    <!-- claims: 08.pingpong_within_noise, 08.persistent_helps_causal -->

and each claim is registered next to the chapter's teaching code:

    @claim("08.pingpong_within_noise", "fa4_final_knobs",
           "switching ping-pong off is within noise at every shape")
    def _(res):
        return all(...), "one line saying what the file shows"

tests/test_claims.py (so CI) imports every module that registers claims, loads each claim's
results file and runs its check (``evaluate``): a claim that no longer holds fails the build,
with the claim's text and the check's line. ``unbacked_sentences`` (run by ``python -m
utils.notebooks check``) lists the comparing sentences of a markdown cell that names no claim:
each must be printed by code from its file instead, backed by a claim, or marked as not a
measurement (a figure with a source label, "(paper)", "(datasheet)", "(published)" or
"(model)", or a cell marked ``<!-- not-measured: why -->`` when it compares by principle, e.g.
two units' documented rates).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MARKER = re.compile(r"<!--\s*claims:(?P<ids>[^>]*?)-->", re.S)
NOT_MEASURED = re.compile(r"<!--\s*not-measured:[^>]*-->", re.S)
# words that compare measured figures: a sentence with one needs a claim behind it
COMPARING = re.compile(
    r"\b(?:faster|slower|speed-?ups?|slow-?downs?|within (?:the )?noise|"
    r"(?:within|beyond|outside) (?:the|its|their|both|either) (?:row's )?spreads?|"
    r"outruns?|outpaces?|trails?|on par|as fast as|"
    r"(?:ahead of|behind) (?:the (?:FA4 )?package|the (?:best )?peers?|cuDNN|FA4|SDPA|FA2|"
    r"fa4_final|the course's|its peers?)|"
    r"the cost is|costs? (?:about |roughly |only )?\d|gains? (?:about |roughly )?\d)\b"
    r"|(?<![\w.])\d+(?:\.\d+)?\s?[x×](?![\w.]*\d)(?!\w)",
    re.I)


@dataclass(frozen=True)
class Claim:
    id: str
    results: str  # the results file's name (results/<gpu>/<name>.json)
    text: str  # the sentence the prose makes, in plain words
    check: Callable  # (Results) -> (bool, str): whether it holds and what the file shows
    gpu: str = "h200"


REGISTRY: dict[str, Claim] = {}


def claim(claim_id: str, results: str, text: str, gpu: str = "h200"):
    """Register the decorated check as the claim ``claim_id`` about
    ``results/<gpu>/<results>.json``: a function (Results) -> (holds, what the file shows)."""

    def register(check):
        old = REGISTRY.get(claim_id)
        if old is not None and old.check.__qualname__ != check.__qualname__:
            raise ValueError(f"claim {claim_id!r} is registered twice")
        REGISTRY[claim_id] = Claim(claim_id, results, text, check, gpu)
        return check

    return register

def evaluate(c: Claim) -> tuple[bool, str]:
    """(holds, what the file shows) for one claim; a missing file does not hold."""
    from utils import results

    try:
        res = results.load(c.results, gpu=c.gpu)
    except FileNotFoundError:
        return False, f"results/{c.gpu}/{c.results}.json does not exist"
    ok, line = c.check(res)
    return bool(ok), line


def markers(markdown: str) -> list[str]:
    """The claim ids a markdown cell names."""
    ids = []
    for m in MARKER.finditer(markdown):
        ids += [i.strip() for i in m.group("ids").split(",") if i.strip()]
    return ids


def unbacked_sentences(markdown: str) -> list[str]:
    """Sentences that compare measured figures in a cell that names no claim (see above)."""
    from utils.notebooks import _CODE, _SENTENCE_END, _SOURCE_LABEL

    if markers(markdown) or NOT_MEASURED.search(markdown):
        return []
    text = _CODE.sub(" ", re.sub(r"<!--.*?-->", " ", markdown, flags=re.S))
    found = []
    for sentence in _SENTENCE_END.split(text):
        if _SOURCE_LABEL.search(sentence):
            continue
        m = COMPARING.search(sentence)
        if m:
            found.append(m.group(0))
    return found
