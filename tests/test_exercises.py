import pytest

from utils import exercises


def reference(x):
    return 2 * x


def check(fn):
    got = fn(3)
    assert got == 6, f"double(3) should be 6, got {got}"


def test_passing_function_is_kept(capsys):
    @exercises.exercise("t.1", check=check, reference=reference)
    def double(x):
        return x + x

    assert double.__name__ == "double"
    assert "passed" in capsys.readouterr().out


def test_not_done_falls_back(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_EXERCISES", raising=False)

    @exercises.exercise("t.2", check=check, reference=reference)
    def double(x):
        raise NotImplementedError

    assert double is reference
    assert "not done yet" in capsys.readouterr().out
    assert exercises.status()["t.2"] == "not done"


def test_wrong_answer_says_what_is_wrong(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_EXERCISES", raising=False)

    @exercises.exercise("t.3", check=check, reference=reference)
    def double(x):
        return x + 1

    out = capsys.readouterr().out
    assert double is reference and "should be 6, got 4" in out


def test_crash_is_reported_with_line(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_EXERCISES", raising=False)

    @exercises.exercise("t.4", check=check, reference=reference)
    def double(x):
        return x / 0

    assert "ZeroDivisionError" in capsys.readouterr().out


def test_strict_mode_raises(monkeypatch):
    monkeypatch.setenv("COURSE_STRICT_EXERCISES", "1")
    with pytest.raises(AssertionError, match="not done"):
        exercises.check_answer("t.5", None, check=lambda v: None)


def test_value_answers(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_EXERCISES", raising=False)

    def near_42(v):
        assert abs(v - 42) < 1, f"{v} is not near 42"

    assert exercises.check_answer("t.6", 41.5, check=near_42, reference=42) == 41.5
    assert exercises.check_answer("t.7", 7, check=near_42, reference=42) == 42
    assert "7 is not near 42" in capsys.readouterr().out


def helper(x):
    return x * 2


def test_an_answer_calling_the_reference_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_EXERCISES", raising=False)

    @exercises.exercise("t.7", check=check, reference=reference)
    def double(x):
        return reference(x)

    out = capsys.readouterr().out
    assert double is reference and "uses reference: that is the reference solution" in out
    assert exercises.status()["t.7"] == "failed"


def test_an_answer_calling_a_forbidden_helper_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_EXERCISES", raising=False)
    import tests.test_exercises as here

    @exercises.exercise("t.8", check=check, reference=reference,
                        forbid={helper: "the exercise is to write the doubling"})
    def double(x):
        return here.helper(x)

    out = capsys.readouterr().out
    assert "uses here.helper: the exercise is to write the doubling" in out


def test_a_closure_variable_holding_the_reference_is_seen(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_EXERCISES", raising=False)
    ref_alias = reference

    @exercises.exercise("t.9", check=check, reference=reference)
    def double(x):
        return ref_alias(x)

    assert "uses ref_alias" in capsys.readouterr().out


def test_a_callable_answer_to_check_answer_is_read_too(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_EXERCISES", raising=False)
    got = exercises.check_answer("t.10", lambda x: reference(x), check=check,
                                 reference=reference)
    assert got is reference and "reference solution" in capsys.readouterr().out
