"""solutions.ch05_profile reads ncu's CSV exports of the warp-specialised kernel (no GPU, no ncu):
a fixture with the kernel's own SASS and invented counts (tests/data/make_ch05_profile_fixture.py
says how it was made), small hand-made tables, and the stored profile when there is one."""

from pathlib import Path

import pytest

from solutions import ch04_profile as core
from solutions import ch05_profile as prof
from solutions import ch05_teaching as t5
from utils.results import Results, load

FIXTURE = Path(__file__).parent / "data" / "ch05_profile_raw"


@pytest.fixture(scope="module")
def records():
    return core.parse_source_rows((FIXTURE / "source.csv").read_text())


@pytest.fixture(scope="module")
def rows():
    return prof.build_rows((FIXTURE / "raw.csv").read_text(),
                           (FIXTURE / "source.csv").read_text(), "128x128 wg2 s2 overlap")


def _by(rows):
    return {r["metric"]: r["value"] for r in rows}


def test_source_rows_keep_address_text_and_stall_columns(records):
    first = records[0]
    assert first["address"] == 0x7F3A12000000 and first["opcode"] == "LDC"
    assert set(first["stalls"]) >= {"selected", "warpgroup_arrive", "long_sb"}
    # the tuple view chapter 04 uses is the same data
    assert core.parse_source((FIXTURE / "source.csv").read_text())[0][:3] == ("LDC", 1, 24576)


def test_roles_follow_setmaxnreg_and_the_retry_loops_go_home(records):
    role = prof.roles(records)
    ops = [r["opcode"] for r in records]
    dealloc = next(i for i, op in enumerate(ops) if "DEALLOC" in op)
    assert set(role[:dealloc]) == {"setup"} and role[dealloc] == "producer"
    assert all(role[i] == "producer" for i, op in enumerate(ops) if op.startswith("UTMALDG"))
    assert all(role[i] == "consumer" for i, op in enumerate(ops) if op.startswith("HGMMA"))
    # every out-of-line NANOSLEEP retry is attributed through its branches
    sleeps = [role[i] for i, op in enumerate(ops) if op == "NANOSLEEP.SYNCS"]
    assert sleeps and set(sleeps) == {"producer", "consumer"}


def test_the_steady_turn_is_the_consumers_loop_and_its_parts_are_in_order(records):
    role = prof.roles(records)
    a, b = prof.consumer_turn(records, role)
    turn = records[a:b + 1]
    assert sum(r["opcode"].startswith("HGMMA") for r in turn) == 16  # 8 for S, 8 for P V
    assert sum("gsb0, 0x1" in r["sass"] for r in turn) == 1
    parts = prof.turn_part(records, (a, b))
    seen = [parts[i] for i in range(a, b + 1)]
    order = [p for k, p in enumerate(seen) if k == 0 or p != seen[k - 1]]
    assert order == list(prof.TURN_PARTS)


def test_the_fallback_without_readable_branch_targets(records):
    no_targets = [{**r, "sass": r["sass"].split(" 0x")[0]} if r["opcode"] == "BRA" else r
                  for r in records]
    role = prof.roles(no_targets)
    span = prof.consumer_turn(no_targets, role)
    assert span == prof.consumer_turn(records, prof.roles(records))  # found by its counts
    assert "retry" in role  # the out-of-line loops can no longer be attributed


def test_relative_branch_targets_are_read_too(records):
    base = records[0]["address"]

    def relative(sass):
        head, _, target = sass.rpartition(" 0x")
        return f"{head} {hex(int(target, 16) - base)}" if head else sass

    rel = [{**r, "sass": relative(r["sass"])} if r["opcode"] == "BRA" else r for r in records]
    assert prof.roles(rel) == prof.roles(records)


def test_build_rows_carry_the_shape_and_sum_up(rows):
    by = _by(rows)
    assert all(r["impl"] == "flash_hopper" and r["d"] == 128 and r["s"] == 16384 for r in rows)
    assert by["tensor_pipe_gmma_active_pct"] == pytest.approx(71.4)
    assert by["duration_ms"] == pytest.approx(4.21)
    assert by["stall_gmma"] == pytest.approx(1.31)
    roles = sum(by[f"warp_time_{k}_pct"] for k in ("setup", "producer", "consumer", "retry"))
    assert roles == pytest.approx(100)
    turn = sum(by[f"consumer_turn_{p}_pct"] for p in prof.TURN_PARTS)
    assert turn + by["consumer_time_outside_steady_turn_pct"] == pytest.approx(100)
    assert by["wgmma_per_consumer_warp_per_step"] == pytest.approx(16)


def test_a_kernel_without_warp_roles_is_refused():
    text = "\n".join([
        '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"',
        '"0x0","HMMA.16816.F32.BF16 R4, R8, R12, R4","3","10"', '"0x10","EXIT","0","10"'])
    with pytest.raises(ValueError, match="setmaxnreg"):
        prof.roles(core.parse_source_rows(text))


def test_the_teaching_lines_read_the_rows(rows):
    res = Results("ch05_profile", None, {}, rows)
    text = "\n".join(t5.profile_lines(res))
    assert "tensor pipe busy with wgmma" in text and "consumers' samples by stall reason" in text
    reading = t5.profile_reading(res)
    assert reading[0].endswith("the tensor pipe is the busier of the two")
    assert any("more of the turn's time runs after P V than under it" in s for s in reading)


def test_the_spec_shares_chapter_04s_machinery():
    from measure import profile_ch05

    spec = profile_ch05.SPEC
    assert spec.build is prof.build_rows and spec.module == "measure.profile_ch05"
    assert set(core.SECTIONS) <= set(spec.sections)
    assert prof.config_label(t5.ch05.default_config(128)) == "128x128 wg2 s2 overlap"


def test_stored_profile_if_there_is_one():
    try:
        res = load(prof.RESULTS)
    except FileNotFoundError:
        pytest.skip("no stored ch05_profile on the H200 yet")
    by = _by(res.rows)
    assert t5.profile_lines(res) and by["warp_time_consumer_pct"] > by["warp_time_producer_pct"]


# fa4_final's Hopper forward (solutions.ch08_profile): the same readers on its own SASS
# (tests/data/fa4_final_profile_raw, invented counts), and the side-by-side in notebook 08.

FA4 = Path(__file__).parent / "data" / "fa4_final_profile_raw"


@pytest.fixture(scope="module")
def fa4_records():
    return core.parse_source_rows((FA4 / "source.csv").read_text())


@pytest.fixture(scope="module")
def fa4_rows():
    from solutions import ch08_profile as p8

    return p8.build_rows((FA4 / "raw.csv").read_text(), (FA4 / "source.csv").read_text(),
                         "128x128 wg2 k3 v2 overlap pingpong persistent")


def test_fa4_final_roles_split_by_setmaxnreg_like_chapter_05s(fa4_records):
    role = prof.roles(fa4_records)
    ops = [r["opcode"] for r in fa4_records]
    assert sum(op.startswith("USETMAXREG") for op in ops) == 2  # one dec, one inc for all WGs
    assert all(role[i] == "producer" for i, op in enumerate(ops) if op.startswith("UTMALDG"))
    assert all(role[i] == "consumer" for i, op in enumerate(ops)
               if op.startswith(("HGMMA", "UTMASTG", "MUFU.EX2")))
    # the ping-pong turns and the epilogue's barrier are the consumers' code
    assert {role[i] for i, op in enumerate(ops) if op.startswith("BAR.")} == {"setup", "consumer"}
    sleeps = {role[i] for i, op in enumerate(ops) if op == "NANOSLEEP.SYNCS"}
    assert {"producer", "consumer"} <= sleeps


def test_fa4_final_steady_turn_is_the_innermost_loop_inside_the_persistent_one(fa4_records):
    role = prof.roles(fa4_records)
    a, b = prof.consumer_turn(fa4_records, role)
    turn = fa4_records[a:b + 1]
    assert sum(r["opcode"].startswith("HGMMA") for r in turn) == 16
    assert sum("gsb0, 0x1" in r["sass"] for r in turn) == 1
    # its turn: one bar.sync before S, one bar.arrive after P V is issued
    assert [r["opcode"].split(".")[0] + "." + r["opcode"].split(".")[1] for r in turn
            if r["opcode"].startswith("BAR.")] == ["BAR.SYNC", "BAR.ARV"]
    parts = prof.turn_part(fa4_records, (a, b))
    seen = [parts[i] for i in range(a, b + 1)]
    assert [p for k, p in enumerate(seen) if k == 0 or p != seen[k - 1]] == list(prof.TURN_PARTS)
    # a later back edge of the consumers jumps to before the turn: the persistent tile loop
    addresses = {r["address"]: i for i, r in enumerate(fa4_records)}
    base = fa4_records[0]["address"]
    outer = [i for i in range(b + 1, len(fa4_records)) if role[i] == "consumer"
             and fa4_records[i]["opcode"] == "BRA"
             and (prof._target(fa4_records[i]["sass"], addresses, base) or b) < a]
    assert outer


def test_fa4_final_rows_and_spec(fa4_rows):
    from solutions import ch08_profile as p8

    by = _by(fa4_rows)
    assert {r["impl"] for r in fa4_rows} == {"fa4_final"} and fa4_rows[0]["d"] == 128
    roles = sum(by[f"warp_time_{k}_pct"] for k in ("setup", "producer", "consumer", "retry"))
    assert roles == pytest.approx(100)
    turn = sum(by[f"consumer_turn_{p}_pct"] for p in prof.TURN_PARTS)
    assert turn + by["consumer_time_outside_steady_turn_pct"] == pytest.approx(100)
    assert 0 < by["consumer_turn_named_barrier_pct"] <= by["consumer_turn_turn_head_pct"] \
        + by["consumer_turn_issue_gemms_pct"]
    assert by["wgmma_per_consumer_warp_per_step"] == pytest.approx(16)
    from measure import profile_fa4_final

    spec = profile_fa4_final.SPEC
    assert spec.results == "fa4_final_profile" and spec.module == "measure.profile_fa4_final"
    assert spec.sections == prof.SECTIONS and spec.metrics == prof.EXTRA_METRICS
    name = (FA4 / "source.csv").read_text().splitlines()[0]
    assert p8.KERNEL_REGEX.removeprefix("regex:") in name
    assert p8.KERNEL_REGEX.removeprefix("regex:") not in (FIXTURE / "source.csv").read_text()


def test_fa4_final_from_raw_writes_its_own_file(tmp_path, monkeypatch):
    import json

    from utils import results

    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    monkeypatch.setenv("COURSE_COMMIT", "0123456789abcdef")
    from measure import _ncu, profile_fa4_final

    path = _ncu.from_raw_with(profile_fa4_final.SPEC, FA4)
    assert path.name == "fa4_final_profile.json" and path.parent.parent == tmp_path
    data = json.loads(path.read_text())
    assert {r["impl"] for r in data["rows"]} == {"fa4_final"}
    assert data["rows"][0]["config"] == json.loads((FA4 / "meta.json").read_text())["config"]
    assert "--from-raw" in data["provenance"]["command"]


def test_notebook_08_side_by_side_with_and_without_fa4_final(fa4_rows):
    import json

    from solutions import ch08_teaching as t08

    prov = json.loads((FA4 / "meta.json").read_text())["provenance"]
    fa4 = Results("fa4_final_profile", None, prov, fa4_rows)
    old = Results("ch05_profile", None, prov, prof.build_rows(
        (FIXTURE / "raw.csv").read_text(), (FIXTURE / "source.csv").read_text(), "ch05"))
    both = "\n".join(t08.profile_table({"chapter 05": old, "fa4_final": fa4}))
    assert "tensor pipe busy, GMMA counter" in both and "ping-pong barriers" in both
    assert both.splitlines()[2].split() == ["chapter", "05", "fa4_final"]
    alone = t08.profile_table({"chapter 05": old, "fa4_final": None})
    assert alone[0] == "fa4_final: not measured yet, so it is left out of the table"
    assert "fa4_final" not in "\n".join(alone[1:])
    # a file without the GMMA counter: both columns read the HMMA one
    no_gmma = Results("ch05_profile", None, prov,
                      [r for r in old.rows if r["metric"] != "tensor_pipe_gmma_active_pct"])
    assert t08.profile_busy({"a": fa4, "b": no_gmma})[0] == "tensor_pipe_active_pct"
    reading = t08.profile_comparison(fa4, old)
    assert reading[0].startswith("fa4_final keeps the tensor pipe busy 71% of the cycles")
    assert any("ping-pong barriers" in s for s in reading)
