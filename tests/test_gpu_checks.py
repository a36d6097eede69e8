"""Reading GPU test logs into results rows (measure.gpu_checks), on the CPU."""

import pytest

from measure.gpu_checks import read_log


def test_pytest_summaries():
    assert read_log("...\nPASSED x\n45 passed, 1 warning in 112.08s (0:01:52)\n") == {
        "passed": 45}
    assert read_log("= 1 failed, 10 passed, 13 deselected, 14 warnings in 68.13s =") == {
        "failed": 1, "passed": 10, "deselected": 13}
    assert read_log("14 passed, 18 deselected, 4 xpassed in 77.33s") == {
        "passed": 14, "deselected": 18, "xpassed": 4}
    assert read_log("2 passed, 1 error in 3.0s") == {"passed": 2, "errors": 1}


def test_sanitizer_summaries():
    assert read_log("ok b=1\n========= ERROR SUMMARY: 0 errors\n") == {"errors": 0}
    assert read_log("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
                    ) == {"hazards": 0}


def test_racecheck_hazards_say_whose_kernel():
    log = ("========= Error: Race reported between Read access at nvjet_sm90_tst_64x8+0xaf0\n"
           "=========     and Write access at nvjet_sm90_tst_64x8+0x27e0 [512 hazards]\n"
           "========= Error: Race reported between Write access at kernel_cutlass_kernel_x+0x10"
           "\n1 passed in 3.0s\n"
           "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n")
    assert read_log(log) == {"hazards": 2, "hazards_in_course_kernels": 1}
    crashed = ("========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware "
               "exception.\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors)\n")
    assert read_log(crashed) == {"hazards": 0, "sanitizer_failures": 1}


def test_a_log_without_a_summary_is_refused():
    with pytest.raises(ValueError, match="no pytest summary"):
        read_log("Traceback (most recent call last):\n  killed\n")


def test_case_check_summaries():
    assert read_log("ok   b=1 ...\nFAIL b=2 ...\n71/72 cases passed\n") == {"passed": 71,
                                                                          "failed": 1}
    # a sanitizer run of the case checks: its own summary comes last and wins
    assert read_log("3/3 cases passed\n========= ERROR SUMMARY: 0 errors\n") == {"errors": 0}


def test_sanitizer_summaries_singular_and_after_a_print_limit():
    """compute-sanitizer writes "1 hazard displayed (1 error, ...)" in the singular, and after
    --print-limit a second ERROR SUMMARY line counting the errors it did not print: the
    summary is the first line's count, not the second's, nor pytest's reading of "1 error"."""
    assert read_log("========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n"
                    ) == {"hazards": 1}
    assert read_log("1 failed, 104 deselected in 9.44s\n"
                    "========= ERROR SUMMARY: 224 errors\n"
                    "========= ERROR SUMMARY: 220 errors were not printed. Use --print-limit "
                    "option to adjust the number of printed errors\n") == {"errors": 224}
    assert read_log("========= ERROR SUMMARY: 0 errors\n") == {"errors": 0}


def test_each_stored_suite_is_one_run():
    """A suite's rows in a stored gpu_checks.json come from one run (one commit and date): a
    merge that kept an older run's "failed" row beside a newer run's "passed" would report a
    failure that a later run no longer had, or hide one."""
    import json
    from pathlib import Path

    for path in sorted(Path(__file__).resolve().parent.parent.glob("results/*/gpu_checks.json")):
        runs = {}
        for row in json.loads(path.read_text())["rows"]:
            runs.setdefault(row["impl"], set()).add((row.get("commit"), row.get("date")))
        mixed = {impl: sorted(r) for impl, r in runs.items() if len(r) > 1}
        assert not mixed, f"{path}: suites with rows of more than one run: {mixed}"
