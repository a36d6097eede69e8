"""utils.predict: a prediction before a measurement, and its reveal."""

import pytest

from utils.predict import predict, reveal


def test_a_number_prediction_and_its_reveal(capsys):
    predict("t.1", 1.5, question="ratio", unit="x", default=1.0)
    verdict = reveal("t.1", 1.02, lesson={"close": "c", "low": "l", "high": "too optimistic"})
    out = capsys.readouterr().out
    assert verdict == "high" and "you predicted 1.5x; measured 1.02x" in out
    assert "What it means: too optimistic" in out


def test_the_default_stands_in_and_says_so(capsys):
    predict("t.2", None, question="cycles", default=1000, unit="cycles")
    assert reveal("t.2", 1040, lesson="x", close=0.05) == "close"
    out = capsys.readouterr().out
    assert "no prediction made: the default stands in" in out and "the default predicted" in out


def test_a_choice_prediction(capsys):
    predict("t.3", "hurts", question="ping-pong", default="helps",
            options=("helps", "no difference", "hurts"))
    assert reveal("t.3", "no difference", lesson={"wrong": "w", "right": "r"}) == "wrong"
    with pytest.raises(ValueError, match="pick one of"):
        predict("t.4", "maybe", question="q", default="helps", options=("helps", "hurts"))


def test_bad_predictions_and_reveals_say_what_is_wrong():
    with pytest.raises(ValueError, match="give a number"):
        predict("t.5", "fast", question="q", default=1.0)
    with pytest.raises(LookupError, match="run its predict"):
        reveal("t.never", 1.0, lesson="")


def test_a_model_or_compiled_figure_is_not_called_measured(capsys):
    predict("t.6", 2.0, question="binding unit ratio", default=1.0)
    reveal("t.6", 2.0, lesson="", source="model, chapter 00")
    predict("t.7", 10, question="LDTM count", default=8)
    reveal("t.7", 12, lesson="", source="compiled for sm_100a on this CPU")
    out = capsys.readouterr().out
    assert "the model gives 2" in out and "compiled: 12" in out and "measured" not in out
