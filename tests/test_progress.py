from solutions import progress
from solutions.registry import VERSIONS, by_name


def test_readme_progression_table_is_current():
    text = progress.README.read_text()
    assert progress.render(text) == text, "run `python -m solutions.progress --write`"


def test_registry_names_are_unique_and_ordered():
    names = [v.name for v in VERSIONS]
    assert len(set(names)) == len(names)
    assert [v.chapter for v in VERSIONS] == sorted(v.chapter for v in VERSIONS)
    assert by_name("naive").chapter == 1
