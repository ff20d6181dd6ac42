"""Data preparation: template, benchmark recognition, the six public benchmarks, DAPO training data, bad rows."""

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stapo.tools import data
from stapo.tools.data import INSTRUCTION, InvalidRowError, make_prompt, prepare_eval, prepare_train
from stapo.tools.reward import grade_many, parse_answer

FIXTURES = Path(__file__).parent / "fixtures"
EVAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
EXPECTED_ROWS = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva": 272, "olympiadbench": 675}
# Golds that math-verify only keeps as strings (a response must then match them textually); any new
# entry is a regression in answer extraction or normalisation and fails the test.
UNPARSED_GOLDS = {("minerva", "E_{1},E_{2}"), ("olympiadbench", "t(0,4]")}


def read_rows(path):
    return pq.read_table(path).to_pylist()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_make_prompt_is_one_user_turn_ending_with_the_instruction():
    prompt = make_prompt("  What is $1+1$?\n")
    assert prompt == [{"role": "user", "content": f"What is $1+1$?\n\n{INSTRUCTION}"}]
    assert INSTRUCTION == "Please reason step by step, and put your final answer within \\boxed{}."


@pytest.mark.parametrize(
    "path, expected",
    [
        ("aime24.jsonl", "aime24"),
        ("data/AIME24/test.parquet", "aime24"),
        ("aime_2025.json", "aime25"),
        ("AIME25/test.parquet", "aime25"),
        ("amc23.jsonl", "amc23"),
        ("data/MATH-500/test.parquet", "math500"),
        ("math500.jsonl", "math500"),
        ("minerva_math.jsonl", "minerva"),
        ("Minerva/test.parquet", "minerva"),
        ("data/Olympiad-Bench/test.parquet", "olympiadbench"),
        ("olympiadbench.jsonl", "olympiadbench"),
        ("gsm8k/test.jsonl", None),
        ("aime.json", None),
    ],
)
def test_benchmark_from_path(path, expected):
    assert data.benchmark_from_path(Path(path)) == expected


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    if not EVAL_DATA.is_dir():
        pytest.skip(f"benchmark data not found at {EVAL_DATA} (expected ../shared/data/eval beside the repo)")
    out = tmp_path_factory.mktemp("eval")
    reports, ignored = prepare_eval([EVAL_DATA], out)
    return out, reports, ignored


def test_six_benchmarks_counts_and_schema(prepared):
    out, reports, ignored = prepared
    assert {r.name: r.rows for r in reports} == EXPECTED_ROWS
    assert ignored == []
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{name}.parquet" for name in EXPECTED_ROWS)
    for name, count in EXPECTED_ROWS.items():
        table = pq.read_table(out / f"{name}.parquet")
        assert table.schema.equals(data.SCHEMA)
        rows = table.to_pylist()
        assert len(rows) == count
        for index, row in enumerate(rows):
            assert row["data_source"] == name
            assert row["reward_model"]["ground_truth"].strip(), (name, index)
            assert row["prompt"][0]["role"] == "user" and len(row["prompt"]) == 1
            assert row["prompt"][0]["content"].endswith("\n\n" + INSTRUCTION)
            assert row["extra_info"]["index"] == index
            assert row["extra_info"]["split"] == "test"
            assert Path(row["extra_info"]["source_file"]).parent == EVAL_DATA


def test_ground_truth_shapes_are_normalised(prepared):
    out = prepared[0]
    first = {name: read_rows(out / f"{name}.parquet")[0]["reward_model"]["ground_truth"] for name in EXPECTED_ROWS}
    assert first["amc23"] == "27"  # was the float 27.0
    assert first["minerva"] == "1.6"  # taken from the solution's \boxed{}
    assert first["olympiadbench"] == "2"  # was the list ['2']
    assert first["aime25"] == "70"  # verl parquet with a chat prompt


def test_golds_parse_with_math_verify(prepared):
    out = prepared[0]
    unparsed = {
        (name, row["reward_model"]["ground_truth"])
        for name in EXPECTED_ROWS
        for row in read_rows(out / f"{name}.parquet")
        if all(isinstance(item, str) for item in parse_answer(row["reward_model"]["ground_truth"]))
    }
    assert unparsed == UNPARSED_GOLDS


def test_reward_self_consistency_on_every_row(prepared):
    """A response boxing the gold scores 1 and a clearly different number scores 0, judged by math-verify alone."""
    out = prepared[0]
    failures = []
    for name in EXPECTED_ROWS:
        golds = [row["reward_model"]["ground_truth"] for row in read_rows(out / f"{name}.parquet")]
        right = grade_many([(f"So the answer is \\boxed{{{g}}}.", g) for g in golds], 2, 10.0, fast_path=False)
        wrong = grade_many([("So the answer is \\boxed{-987654321}.", g) for g in golds], 2, 10.0, fast_path=False)
        failures += [(name, g, "right answer scored 0") for g, r in zip(golds, right, strict=True) if r["score"] != 1.0]
        failures += [(name, g, "wrong answer scored 1") for g, r in zip(golds, wrong, strict=True) if r["score"] != 0.0]
    assert failures == []


def test_eval_name_override_and_duplicates(tmp_path):
    records = [{"question": "What is $1+1$?", "answer": "2"}, {"question": "What is $2+2$?", "answer": 4.0}]
    src = write_jsonl(tmp_path / "my_copy.jsonl", records * 3)
    with pytest.raises(ValueError, match="--name"):
        prepare_eval([src], tmp_path / "out")
    (report,), _ = prepare_eval([src], tmp_path / "out", name="amc23", partial=True)
    assert (report.rows, report.duplicates) == (2, 4)
    assert [r["reward_model"]["ground_truth"] for r in read_rows(tmp_path / "out" / "amc23.parquet")] == ["2", "4"]


def test_eval_reads_verl_parquet_with_templated_prompts(tmp_path):
    folder = tmp_path / "data" / "AIME24"
    folder.mkdir(parents=True)
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": make_prompt("Find $x$.")[0]["content"]},
            ],
            "reward_model": {"ground_truth": "\\boxed{204}", "style": "rule"},
            "extra_info": {"index": "AIME24-0"},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), folder / "test.parquet")
    (report,), _ = prepare_eval([tmp_path / "data"], tmp_path / "out", partial=True)
    (row,) = read_rows(tmp_path / "out" / "aime24.parquet")
    assert report.name == "aime24"
    assert row["prompt"] == make_prompt("Find $x$.")  # the instruction is not doubled
    assert row["reward_model"]["ground_truth"] == "204"
    assert row["extra_info"]["original_id"] == "AIME24-0"


def test_train_on_dapo_layout_dedups_and_retemplates(tmp_path):
    records = [json.loads(line) for line in (FIXTURES / "dapo_math_17k_sample.jsonl").read_text().splitlines()]
    source = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(records), source)
    report = prepare_train(source, tmp_path / "out")
    rows = read_rows(tmp_path / "out" / data.TRAIN_FILENAME)
    assert (report.rows, report.duplicates, report.skipped) == (5, 7, [])
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["5", "9", "6", "55", "25"]
    assert rows[0]["prompt"] == [{"role": "user", "content": f"What is $2+3$?\n\n{INSTRUCTION}"}]
    for index, row in enumerate(rows):
        content = row["prompt"][0]["content"]
        assert "Answer:" not in content and "Solve the following" not in content
        assert row["data_source"] == data.TRAIN_DATA_SOURCE
        assert row["extra_info"]["index"] == index
        assert row["extra_info"]["source_file"] == str(source)
    assert rows[0]["extra_info"]["original_id"] == "00000000-0000-0000-0000-000000000001"
    assert [p.name for p in (tmp_path / "out").iterdir()] == [data.TRAIN_FILENAME]  # no temporary files left


def test_train_accepts_open_r1_processed_shape(tmp_path):
    report = prepare_train(FIXTURES / "dapo_processed_sample.jsonl", tmp_path)
    rows = read_rows(tmp_path / data.TRAIN_FILENAME)
    assert (report.rows, report.duplicates) == (3, 1)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["5", "9", "6"]


BAD_ROWS = [
    ({"problem": "Fine.", "answer": "1"}, None),
    ({"problem": "No answer here."}, "row 1: field 'answer': missing"),
    ({"answer": "3"}, "row 2: field 'problem': missing"),
    ({"problem": "Empty list.", "final_answer": []}, "row 3: field 'final_answer': empty ground truth"),
    ({"problem": "Broken.", "answer": "\\frac{1}{2"}, "row 4: field 'answer': unbalanced braces"),
    ({"problem": "Worked solution without a box.", "solution": "First...\nthen 3."}, "row 5: field 'solution'"),
    ({"problem": "", "answer": "1"}, "row 6: field 'problem': empty"),
    ({"problem": "Odd.", "answer": {"value": 1}}, "row 7: field 'answer': unparseable ground truth"),
]


def test_bad_row_stops_the_run_naming_file_row_and_field(tmp_path):
    src = write_jsonl(tmp_path / "math500.jsonl", [record for record, _ in BAD_ROWS[:2]])
    with pytest.raises(InvalidRowError, match=r"math500\.jsonl: row 1: field 'answer': missing"):
        prepare_eval([src], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_skip_invalid_counts_and_lists_bad_rows(tmp_path):
    src = write_jsonl(tmp_path / "math500.jsonl", [record for record, _ in BAD_ROWS])
    with src.open("a") as file:
        file.write("{not json\n")
    (report,), _ = prepare_eval([src], tmp_path / "out", skip_invalid=True, partial=True)
    assert report.rows == 1
    assert len(report.skipped) == len(BAD_ROWS)
    for (_, expected), message in zip(BAD_ROWS[1:], report.skipped, strict=False):
        assert message.startswith(f"{src}: {expected}")
    assert report.skipped[-1].startswith(f"{src}: row 8: field '<line>': not valid JSON")
    summary = data.format_report([report])
    assert all(f"skipped: {message}" in summary for message in report.skipped)


def test_cli_eval_prints_the_table_and_fails_cleanly(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    good = write_jsonl(tmp_path / "src" / "aime24.jsonl", [{"problem": "P", "answer": "1"}])
    write_jsonl(tmp_path / "src" / "notes.jsonl", [{"text": "not a benchmark"}])
    data.main(["eval", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--partial"])
    printed = capsys.readouterr().out
    assert str(tmp_path / "out" / "aime24.parquet") in printed and str(good) in printed
    assert f"ignored (no benchmark in the name): {tmp_path / 'src' / 'notes.jsonl'}" in printed
    write_jsonl(good, [{"problem": "P"}])
    with pytest.raises(SystemExit) as exit_info:
        data.main(["eval", "--src", str(good), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"{good}: row 0: field 'answer'" in capsys.readouterr().err


def test_eval_without_src_uses_the_pinned_hub_copies(tmp_path, monkeypatch):
    """The hub path itself needs network; check the wiring with a stand-in for the download."""
    requested = []

    def fake_hub_records(source):
        requested.append(source)
        return [{"problem": f"Problem from {source.repo}", "solution": "so \\boxed{12}"}]

    monkeypatch.setattr(data, "_hub_records", fake_hub_records)
    monkeypatch.setattr(data, "hub_unreachable", lambda: None)
    reports, _ = prepare_eval(None, tmp_path, partial=True)
    assert requested == [data.HUB_EVAL[name] for name in data.BENCHMARKS]
    assert [r.sources for r in reports] == [[f"hf://datasets/{s.repo} ({s.split})"] for s in requested]
    assert read_rows(tmp_path / "minerva.parquet")[0]["reward_model"]["ground_truth"] == "12"


def test_an_empty_or_short_source_never_replaces_good_data(prepared, tmp_path, capsys):
    """The new user's report: an empty math500.jsonl over a good 500-row file printed "0 500" and wrote 0 rows."""
    out = tmp_path / "out"
    out.mkdir()
    good = (prepared[0] / "math500.parquet").read_bytes()
    (out / "math500.parquet").write_bytes(good)
    empty = write_jsonl(tmp_path / "math500.jsonl", [])
    for argv in (["eval", "--src", str(empty)], ["eval", "--src", str(empty), "--partial"]):
        with pytest.raises(SystemExit) as exit_info:
            data.main([*argv, "--out", str(out)])
        assert exit_info.value.code == 2
        assert f"{empty}: no usable rows; {out / 'math500.parquet'} is left as it was" in capsys.readouterr().err
    (tmp_path / "src").mkdir()
    short = write_jsonl(tmp_path / "src" / "math500.jsonl", [{"problem": f"P{i}", "answer": str(i)} for i in range(3)])
    with pytest.raises(SystemExit):
        data.main(["eval", "--src", str(short), "--out", str(out)])
    err = capsys.readouterr().err
    assert "math500: 3 rows from" in err and "but the benchmark has 500; pass --partial" in err
    assert (out / "math500.parquet").read_bytes() == good
    with pytest.raises(SystemExit):
        data.main(["train", "--local", str(write_jsonl(tmp_path / "dapo.jsonl", [])), "--out", str(out)])
    assert "no usable rows" in capsys.readouterr().err and not (out / data.TRAIN_FILENAME).exists()
    data.main(["eval", "--src", str(short), "--out", str(out), "--partial"])  # explicitly asked for: written
    assert len(read_rows(out / "math500.parquet")) == 3


def test_a_source_larger_than_its_benchmark_is_refused(tmp_path, capsys):
    """100 problems in a file named aime24 (30 problems) are another data set under its name: one line, nothing
    written, with --partial too."""
    rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(100)]
    src = write_jsonl(tmp_path / "aime24.jsonl", rows)
    for partial in ([], ["--partial"]):
        with pytest.raises(SystemExit) as exit_info:
            data.main(["eval", "--src", str(src), "--out", str(tmp_path / "out"), *partial])
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and line.startswith("error: aime24: 100 rows from")
        assert "more than the benchmark's 30" in line and not (tmp_path / "out").exists()


def test_train_never_replaces_a_larger_file_without_partial(tmp_path):
    prepare_train(FIXTURES / "dapo_processed_sample.jsonl", tmp_path)
    fewer = write_jsonl(tmp_path / "one.jsonl", [{"problem": "What is 1+1?", "answer": "2"}])
    with pytest.raises(data.SourceError, match=r"holds 3 rows and would be replaced by 1; pass --partial"):
        prepare_train(fewer, tmp_path)
    assert len(read_rows(tmp_path / data.TRAIN_FILENAME)) == 3


def test_a_damaged_file_among_the_sources_is_named(prepared, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for name in EXPECTED_ROWS:
        (src / f"{name}.parquet").write_bytes((prepared[0] / f"{name}.parquet").read_bytes())
    damaged = src / "minerva.parquet"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # truncated
    with pytest.raises(SystemExit) as exit_info:
        data.main(["eval", "--src", str(src), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"error: {damaged}: not a readable parquet file (")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing written


def test_offline_hub_failures_say_what_to_pass(tmp_path, monkeypatch, capsys):
    """No hub access here: the download is replaced by one that fails as an offline machine's does."""

    def offline(*args, **kwargs):
        raise ConnectionError("Max retries exceeded with url: /api/datasets/math-ai/aime24")

    monkeypatch.setattr(data, "hub_unreachable", lambda: None)  # the host resolves, the download fails
    monkeypatch.setattr(data, "_hub_records", offline)
    with pytest.raises(SystemExit):
        data.main(["eval", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "could not download math-ai/aime24 from the Hugging Face hub (ConnectionError" in err
    assert "pass a local copy with --src PATH" in err and "Traceback" not in err
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(SystemExit):
        data.main(["train", "--out", str(tmp_path)])
    assert "pass a local copy with --local PATH" in capsys.readouterr().err


def test_a_hub_that_cannot_be_reached_is_named_at_once(tmp_path, monkeypatch, capsys):
    """Offline, the hub's clients retry for about 25 s, a line each; the tool says so in one line at once when the
    hub's host name does not resolve (``.invalid`` never does). Through a proxy, or with HF_HUB_OFFLINE (the clients
    then read their cache), nothing is probed: the download is tried."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    start = time.monotonic()
    with pytest.raises(SystemExit):
        data.main(["train", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert time.monotonic() - start < 10 and len(err.strip().splitlines()) == 1
    assert err.startswith(
        "error: could not download BytedTsinghua-SIA/DAPO-Math-17k: the Hugging Face hub cannot be "
        "reached (hub.invalid: "
    ) and err.strip().endswith("pass a local copy with --local PATH")
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert data.hub_unreachable() is None
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert data.hub_unreachable() is None


def test_outputs_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        prepare_train(FIXTURES / "dapo_processed_sample.jsonl", tmp_path)
    finally:
        os.umask(old)
    assert (tmp_path / data.TRAIN_FILENAME).stat().st_mode & 0o777 == 0o644


def test_atomic_writes_and_appends_follow_the_umask(tmp_path):
    from stapo.tools.io import append_atomic, write_atomic

    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a" / "summary.json", "{}")
        append_atomic(tmp_path / "samples.jsonl", ["1\n", "2\n"])
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "summary.json").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "samples.jsonl").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "samples.jsonl").read_text() == "1\n2\n" and os.listdir(tmp_path / "a") == ["summary.json"]


def test_a_benchmarks_file_is_refused_as_training_data(tmp_path, capsys):
    """A benchmark's own problems in the training set would inflate every table: a file whose name, or a folder's up
    to the one given, begins with a benchmark's (alone or in a folder) is one line to ``train --local``, and nothing is
    written; a name that only contains one (NuminaMath's ``olympiads``, a copy without AIME 24) is not refused."""
    sample = (FIXTURES / "dapo_processed_sample.jsonl").read_text()
    for name in ("aime24.jsonl", "MATH-500/test.jsonl", "x/MATH-500/sub/test.jsonl", "numina_olympiads.jsonl",
                 "dapo_no_aime24.jsonl"):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(sample)
    refused = {"aime24.jsonl": "aime24", "MATH-500/test.jsonl": "math500", "MATH-500": "math500", "x": "math500"}
    for local, bench in refused.items():
        with pytest.raises(SystemExit) as stop:
            data.main(["train", "--local", str(tmp_path / local), "--out", str(tmp_path / "out")])
        said = capsys.readouterr().err
        assert stop.value.code == 2 and said.count("\n") == 1 and f"a file of the benchmark {bench}, " in said, local
    assert not (tmp_path / "out").exists()
    for name in ("numina_olympiads.jsonl", "dapo_no_aime24.jsonl"):
        assert prepare_train(tmp_path / name, tmp_path / "out", partial=True).rows == 3
