"""The website's sources as `make site` stages them (the build itself runs in `make site`)."""

import json
import re
from pathlib import Path

from utils import notebooks as nbm
from utils import site

ROOT = Path(__file__).resolve().parent.parent


def test_stage_has_every_solved_notebook_in_the_toc(tmp_path):
    chapters = site.stage(tmp_path)
    solved = [p.stem for p in nbm.solved_notebooks()]
    assert chapters == solved
    toc = (tmp_path / "_toc.yml").read_text()
    assert re.findall(r"- file: (\d\d_\w+)", toc) == solved
    assert "- file: workshop" in toc
    for name in solved:
        staged = json.loads((tmp_path / f"{name}.ipynb").read_text())
        assert len(staged["cells"]) == len(json.loads((ROOT / "solutions" / f"{name}.ipynb")
                                                      .read_text())["cells"])


def test_index_page_is_made_from_the_readme(tmp_path):
    site.stage(tmp_path)
    index = (tmp_path / "index.md").read_text()
    assert index.startswith(f"# {site.TITLE}\n")
    for head in site.INDEX_SECTIONS:
        assert f"\n## {head}\n" in index, head
    for name in (p.stem for p in nbm.solved_notebooks()):
        assert f"[`{name}`]({name}.ipynb)" in index, name
    # The progression table travels whole; its links to .py sources keep only their text.
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- progression:start -->")[1].split("<!-- progression:end -->")[0]
    rows = [ln for ln in table.strip().splitlines() if ln.startswith("| 0")]
    assert rows and all(re.sub(r"\[(`[^`]+`)\]\([^)]+\)", r"\1", r) in index for r in rows)
    assert ".py)" not in index
    assert "(workshop.md)" in index


def test_config_renders_the_executed_notebooks(tmp_path):
    """The site does not execute again: it renders the copies utils.execute ran (strict)."""
    site.stage(tmp_path)
    config = (tmp_path / "_config.yml").read_text()
    assert 'execute_notebooks: "off"' in config
    assert "nb_execution_raise_on_error: true" in config


def test_stage_takes_outputs_from_the_executed_copies(tmp_path):
    executed = tmp_path / "executed"
    executed.mkdir()
    for nb in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"):
        data = json.loads(nb.read_text())
        for cell in data["cells"]:
            if cell["cell_type"] == "code":
                cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "ran\n"}]
        (executed / nb.name).write_text(json.dumps(data))
    site.stage(tmp_path / "src", executed=executed)
    staged = json.loads((tmp_path / "src" / "00_hardware_roofline.ipynb").read_text())
    assert any(c.get("outputs") for c in staged["cells"] if c["cell_type"] == "code")


def test_execute_fingerprint_moves_with_the_sources(tmp_path):
    from utils import execute

    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "a.py").write_text("x = 1\n")
    first = execute.fingerprint(tmp_path)
    (tmp_path / "solutions" / "a.py").write_text("x = 2\n")
    assert execute.fingerprint(tmp_path) != first


def test_links_are_rewritten_for_the_site():
    pages = {str(ROOT / "solutions" / "02_online_softmax.ipynb"): "02_online_softmax.ipynb",
             str(ROOT / "docs" / "workshop.md"): "workshop.md"}
    here = ROOT / "docs" / "workshop.md"
    text = ("[ch 02](../chapters/02_online_softmax.ipynb) "
            "[src](../solutions/ch02_online_softmax.py) [web](https://example.org/x) [top](#top) "
            "[guide](workshop.md#paths) ![img](a.png)")
    assert site.rewrite_links(text, pages, here) == (
        "[ch 02](02_online_softmax.ipynb) src [web](https://example.org/x) [top](#top) "
        "[guide](workshop.md#paths) ![img](a.png)"
    )


def test_readme_sections():
    intro, sections = site.readme_sections("# T\nintro\n## A\na\n\n## B\nb\n")
    assert intro == "# T\nintro\n" and sections == {"A": "a", "B": "b"}
