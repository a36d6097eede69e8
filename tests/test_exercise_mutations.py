"""Every exercise's typical wrong answers (tests/exercise_mutations/chNN.py) are caught, each
with the words that tell the learner what is wrong; and every exercise has at least one."""

import importlib
import pkgutil
import re

import pytest

import tests.exercise_mutations as pkg
from utils import notebooks as nbm
from utils.exercises import judge


def _mutations():
    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        found += [(info.name, i, m) for i, m in enumerate(getattr(module, "MUTATIONS", []))]
    return found


MUTATIONS = _mutations()


def _params():
    for name, i, m in MUTATIONS:
        marks = [pytest.mark.slow] if m.slow else []
        yield pytest.param(m, id=f"{m.exercise}-{name}-{i}", marks=marks)


@pytest.mark.parametrize("mutation", list(_params()))
def test_mutation_is_caught_with_its_words(mutation):
    said = judge(mutation.check, mutation.answer, mutation.reference, mutation.forbid)
    assert said is not None, f"exercise {mutation.exercise}: this wrong answer passes its check"
    assert mutation.says in said, (f"exercise {mutation.exercise}: the message does not say "
                                   f"{mutation.says!r}: {said}")


def test_every_exercise_has_planted_mistakes():
    declared = set()
    for path in nbm.solved_notebooks():
        declared |= set(re.findall(r'(?:@exercise|check_answer)\(\\"(\d\d\.\d+)\\"',
                                   path.read_text()))
    covered = {m.exercise for _, _, m in MUTATIONS}
    assert declared <= covered, f"exercises with no planted mistake: {sorted(declared - covered)}"
