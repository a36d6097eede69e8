"""The shape of every chapter (utils.notebooks.course_stats, printed by `python -m
utils.notebooks stats`): one sitting, the learner writes device code from chapter 03 on, and a
prediction comes before every measurement."""

import pytest

from utils import notebooks as nbm

STATS = dict(nbm.course_stats())
CHAPTERS = [n for n in STATS if not n.startswith("labs/")]


@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_is_one_sitting(name):
    st = STATS[name]
    assert st["words"] <= nbm.SITTING_WORDS and st["cells"] <= nbm.SITTING_CELLS, (
        f"{name}: {st['words']} markdown words and {st['cells']} cells; one sitting is at most "
        f"{nbm.SITTING_WORDS} words and {nbm.SITTING_CELLS} cells: move measurement history to "
        f"a lab")


@pytest.mark.parametrize("name", [n for n in CHAPTERS if int(n[:2]) >= 3])
def test_chapter_has_two_device_code_exercises(name):
    device = STATS[name]["device_exercises"]
    assert len(device) >= 2, f"{name}: device-code exercises {device}, at least two wanted"


@pytest.mark.parametrize("name", list(STATS))
def test_a_prediction_comes_before_every_measurement(name):
    st = STATS[name]
    assert not st["unpredicted_measurements"], (
        f"{name}: cells {st['unpredicted_measurements']} read stored measurements with no "
        f"predict(...) earlier in their section")
    assert set(st["reveals"]) <= set(st["predictions"]), f"{name}: a reveal with no prediction"


def test_labs_exist_for_the_measurement_story():
    labs = [n for n in STATS if n.startswith("labs/")]
    assert len(labs) >= 3, labs
