"""Typical wrong answers to the course's exercises, one module per chapter (``chNN.py``), each
defining ``MUTATIONS``: a list of ``Mutation``. tests/test_exercise_mutations.py holds every one
against its checker: the answer must be refused, with the words ``says`` in the message."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Mutation:
    exercise: str  # "06.3"
    check: object  # the exercise's checker
    answer: object  # the wrong answer: a function (device code too) or a value
    says: str  # words the learner's message must contain
    reference: object = None  # the exercise's reference: an answer that calls it is refused
    forbid: dict = field(default_factory=dict)  # {helper: why}, as the exercise passes it
    slow: bool = False  # compiles a kernel: run with the slow tests
