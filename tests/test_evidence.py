"""The evidence pages (docs/evidence/) against the GPU runs' records (evidence/): the committed pages equal what the
records give, a changed number in a record makes the check fail, and the decisive test's verdict line in
docs/experiments.md is recomputed from its records (issues 52 and 53)."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stapo.tools import evidence
from stapo.tools.decisive import VERDICT, report

ROOT = Path(__file__).resolve().parents[1]


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stapo.tools.report", "evidence", "--check", "--root", str(root)],
        capture_output=True,
        text=True,
    )


def test_the_committed_pages_equal_their_records():
    done = check(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equal their records" in done.stdout


@pytest.fixture
def copy(tmp_path):
    """The repository's records and evidence pages in a folder of their own."""
    for part in ("evidence", "docs/evidence"):
        shutil.copytree(ROOT / part, tmp_path / part)
    return tmp_path


def test_one_changed_number_in_a_record_fails_the_check_until_regenerated(copy):
    metrics = copy / "evidence/decisive-round1/runs/stapo-s10/metrics.jsonl.gz"
    lines = gzip.decompress(metrics.read_bytes()).decode().splitlines()
    row = json.loads(lines[17])  # step 18: inside the endpoint's window
    row["data"]["critic/score/mean"] += 0.25
    lines[17] = json.dumps(row)
    metrics.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    done = check(copy)
    assert done.returncode == 1
    assert "docs/evidence/decisive.md: block 'decisive decisive-round1'" in done.stdout
    assert "docs/evidence/img/decisive-round1/reward.png" in done.stdout  # the figure, by its data
    regenerated = subprocess.run(
        [sys.executable, "-m", "stapo.tools.report", "evidence", "--root", str(copy)], capture_output=True, text=True
    )
    assert regenerated.returncode == 0 and check(copy).returncode == 0
    page = (copy / "docs/evidence/decisive.md").read_text()
    assert page != (ROOT / "docs/evidence/decisive.md").read_text() and "| 1 | stapo-s10 | 0.143 | 0.091 |" in page


def test_a_changed_card_or_a_missing_figure_fails_the_check(copy):
    card = copy / "evidence/smoke-sync-1gpu/card.json"
    card.write_text(card.read_text().replace('"gpu_count": 1', '"gpu_count": 2'))
    (copy / "docs/evidence/img/decisive-round1/entropy.png").unlink()
    done = check(copy)
    assert done.returncode == 1
    assert "block 'card smoke-sync-1gpu'" in done.stdout and "img/decisive-round1/entropy.png" in done.stdout


def test_a_page_naming_a_missing_record_gets_one_line(copy):
    page = copy / "docs/evidence/extra.md"
    page.write_text("<!-- evidence:card no-such-record -->\n<!-- /evidence -->\n")
    done = check(copy)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "docs/evidence/extra.md: block 'card no-such-record'" in done.stderr


def test_the_decisive_verdict_in_the_docs_is_what_the_records_give():
    _, verdict = report([ROOT / "evidence/decisive-round1"])
    lines = [line for line in (ROOT / "docs/experiments.md").read_text().splitlines() if VERDICT in line]
    assert lines and all(line.strip("*` ") == verdict for line in lines), lines


def test_collect_keeps_the_small_records_of_an_experiment(tmp_path):
    run = tmp_path / "exp/runs/stapo-s10"
    run.mkdir(parents=True)
    (tmp_path / "exp/experiment.json").write_text('{"seed": "0"}\n')
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {"critic/score/mean": 0.5}}) + "\n")
    (run / "exit_code").write_text("0\n")
    (run / "args.txt").write_text("stapo\nqwen3_1.7b\n")
    (run / "train.log").write_text("".join(f"line {i}\n" for i in range(500)))
    written = evidence.collect(tmp_path / "exp", tmp_path / "rec")
    names = sorted(str(p.relative_to(tmp_path / "rec")) for p in written)
    assert names == ["experiment.json", "runs/stapo-s10/args.txt", "runs/stapo-s10/exit_code",
                     "runs/stapo-s10/metrics.jsonl.gz", "runs/stapo-s10/train.log.tail"]  # fmt: skip
    assert (tmp_path / "rec/runs/stapo-s10/args.txt").read_text() == "stapo\nqwen3_1.7b\n"
    tail = (tmp_path / "rec/runs/stapo-s10/train.log.tail").read_text().splitlines()
    assert len(tail) == evidence.LOG_TAIL and tail[-1] == "line 499"
    assert (
        gzip.decompress((tmp_path / "rec/runs/stapo-s10/metrics.jsonl.gz").read_bytes()).decode().startswith('{"step"')
    )


def test_keep_takes_a_gpu_scripts_records_and_leaves_its_models_checkpoints_and_data(tmp_path, capsys):
    """``evidence keep OUT DEST`` as a user runs it, on the layout scripts/gpu/bitwise.sh writes: records folder for
    folder, metrics gzipped, logs cut to their tails, and nothing of the model, the checkpoints or the task."""
    out = tmp_path / "bw"
    files = {
        "bitwise/seeded.json": '{"setting": "fa3"}', "bitwise/seeded.log": "".join(f"{i}\n" for i in range(300)),
        "bitwise/table.md": "| a |\n", "replay/replay.json": "{}", "replay/twin/metrics.jsonl": '{"step": 1}\n',
        "replay/runs/twin/exit_code": "0\n", "replay/twin/checkpoints/latest_checkpointed_iteration.txt": "3",
        "replay/twin/checkpoints/global_step_3/actor/model.json": "{}", "smollm2/raw/config.json": "{}",
        "smollm2/raw/model.safetensors": "x", "task/train.parquet": "x", "locate.log": "done\n",
    }  # fmt: skip
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    evidence.main(["keep", str(out), str(tmp_path / "new" / "rec")])
    rec = tmp_path / "new" / "rec"
    kept = sorted(str(p.relative_to(rec)) for p in rec.rglob("*") if p.is_file())
    assert kept == ["bitwise/seeded.json", "bitwise/seeded.log.tail", "bitwise/table.md", "locate.log.tail",
                    "replay/replay.json", "replay/runs/twin/exit_code", "replay/twin/metrics.jsonl.gz"]  # fmt: skip
    assert sorted(capsys.readouterr().out.split()) == [str(rec / k) for k in kept]
    assert (rec / "bitwise/seeded.log.tail").read_text().split() == [str(i) for i in range(100, 300)]
    assert gzip.decompress((rec / "replay/twin/metrics.jsonl.gz").read_bytes()) == b'{"step": 1}\n'
    (out / "bitwise" / "probe.json").write_text("x" * (evidence.MAX_FILE_BYTES + 1))
    with pytest.raises(SystemExit, match=r"probe.json: \d+ bytes, over the records' 2 MB"):
        evidence.keep(out, tmp_path / "again")


def test_the_new_records_fail_the_check_when_a_number_changes(copy):
    """The determinism and start-up records: a changed phase time, a differing replay comparison or an edited probe
    table each fail the check on their own block."""
    phases = copy / "evidence/startup-1.7b/on/phases.json"
    found = json.loads(phases.read_text())
    found["markers"][-2]["at_s"] += 60  # "first step begins"
    phases.write_text(json.dumps(found))
    replayed = copy / "evidence/determinism-h200/replay/replay.json"
    found = json.loads(replayed.read_text())
    found["comparisons"]["halt3"] |= {"equal": False, "differ": ["actor/grad_norm"]}
    replayed.write_text(json.dumps(found))
    table = copy / "evidence/determinism-h200/invariance/table.md"
    table.write_text(table.read_text().replace("| single | 14 / 48 |", "| single | 0 / 48 |", 1))
    done = check(copy)
    assert done.returncode == 1
    for block in ("startup startup-1.7b off on", "replay determinism-h200", "markdown determinism-h200 invariance"):
        assert block in done.stdout, done.stdout
    shown = evidence.replay_block(copy, "determinism-h200")
    assert "| halt3 | 91 | 1, 2, 3, 4, 5, 6 | none | actor/grad_norm | DIFFERENT |" in shown
    assert "| halt2 | 91 | 1, 3, 4, 5, 6 | 2 (its line lost at the kill) | none | equal to the bit |" in shown
    shown = evidence.startup_block(copy, "startup-1.7b", "off", "on")
    assert "| first step begins | 364.1 (+3.4) | 240.4 (+1.8) |" in shown
    assert "First step began, s since launch: off: 364.1 (median 364.1); on: 240.4 (median 240.4)." in shown


def test_two_real_runs_and_a_smokes_overrides_come_from_their_records(copy):
    """The twin block (two runs of one seed) recomputes where the runs part from their metrics: a twin whose step-1
    reward equalled the record's would part later; the smoke block names a run's overrides and verl's importance
    weights per step, and a changed mean fails the check."""
    shown = evidence.twin_block(copy, "deadline-h100-62eb206", "record", "twin")
    assert "| first step where they part | 1 |" in shown and "| last weights | different |" in shown
    assert "`critic/score/mean` 0.0460295 / 0.0435021" in shown
    twin = copy / "evidence/deadline-h100-62eb206/twin/metrics.jsonl.gz"
    record = gzip.decompress((copy / "evidence/deadline-h100-62eb206/record/metrics.jsonl.gz").read_bytes())
    twin.write_bytes(gzip.compress(record))  # the record's metrics as the twin's: nothing parts
    shown = evidence.twin_block(copy, "deadline-h100-62eb206", "record", "twin")
    assert "| first step where they part | none |" in shown and "| equal at every step (100) |" in shown
    folder = copy / "evidence/deadline-h100-62eb206"
    (folder / "twin-halt").mkdir()
    (folder / "twin-halt/metrics.jsonl.gz").write_bytes(twin.read_bytes())  # a halted twin: its verdict of its own
    verdicts = json.loads((folder / "replay.json").read_text())
    (folder / "replay.json").write_text(json.dumps({**verdicts, "twin_halt": {"weights_equal": True}}))
    shown = evidence.twin_block(copy, "deadline-h100-62eb206", "record", "twin-halt")
    assert "| first step where they part | none |" in shown and "| last weights | equal |" in shown
    assert "| steps compared | 1, 2, 3, 4, 5, 6 |" in shown and "| steps not compared | none |" in shown
    lines = gzip.decompress(twin.read_bytes()).decode().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["step"] != 3]  # its step-3 line lost at the kill
    (folder / "twin-halt/metrics.jsonl.gz").write_bytes(gzip.compress("".join(kept).encode()))
    (folder / "replay.json").write_text(json.dumps({**verdicts, "twin_halt": {"weights_equal": True, "halt": 3}}))
    shown = evidence.twin_block(copy, "deadline-h100-62eb206", "record", "twin-halt")
    assert (
        "| steps compared | 1, 2, 4, 5, 6 |" in shown
        and "| steps not compared | 3 (its line lost at the kill) |" in shown
    )
    (folder / "replay.json").write_text(
        json.dumps({**verdicts, "twin_halt": {"failed": "see runs/twin-halt*/train.log"}})
    )
    shown = evidence.twin_block(copy, "deadline-h100-62eb206", "record", "twin-halt")
    assert shown.endswith("| `twin-halt` | failed: see runs/twin-halt*/train.log |\n") and "weights" not in shown
    summary = copy / "evidence/smoke-rollout-correction-1gpu-62eb206/summary.jsonl"
    shown = evidence.smoke_block(copy, "smoke-rollout-correction-1gpu-62eb206")
    assert "`stapo` ran with `algorithm.rollout_correction.rollout_is=token`" in shown and "1.000032 / " in shown
    summary.write_text(summary.read_text().replace("1.0000319480895996", "0.5"))
    done = check(copy)
    assert done.returncode == 1 and "block 'smoke smoke-rollout-correction-1gpu-62eb206'" in done.stdout
    assert "block 'twin deadline-h100-62eb206 record twin'" in done.stdout


def test_first_steps_gives_each_kind_of_launch_in_order_and_its_median():
    """Launches KIND-N grouped by KIND in the order given; a launch that never began its first step shows `-` and
    leaves its kind without a median."""

    def record(began):
        return {"markers": [{"phase": "ready to fit", "at_s": 1.0}, {"phase": "first step begins", "at_s": began}]}

    found = {"warm-1": record(200.0), "off-1": record(300.0), "on-1": record(150.0), "on-2": record(140.0),
             "off-2": record(None)}  # fmt: skip
    assert evidence.first_steps(found) == (
        "First step began, s since launch: warm: 200.0 (median 200.0); off: 300.0, - (median -); "
        "on: 150.0, 140.0 (median 145.0)."
    )


def test_the_modes_block_averages_whole_cycles_and_compares_with_sync(tmp_path):
    """Four runs as scripts/gpu/modes.sh leaves them: each run's phases averaged over its steps after the first,
    each mode's mean step and its ratio to sync's; a run with one step cannot be averaged and says so."""
    steps = {"sync": [60, 20, 20, 20, 20], "colocate": [70, 30, 10, 30, 10]}  # colocate: one generation, two steps
    for run, times in (("sync-1", steps["sync"]), ("colocate-1", steps["colocate"]), ("colocate-2", steps["colocate"]),
                       ("sync-2", [60, 22, 22, 22, 22])):  # fmt: skip
        folder = tmp_path / "evidence" / "modes" / run
        folder.mkdir(parents=True)
        rest = {"timing_s/old_log_prob": 1.0, "timing_s/update_actor": 5.0, "response_length/mean": 2048.0}
        data = [{"timing_s/step": t, "timing_s/gen": t / 2, **rest} for t in times]
        lines = [json.dumps({"step": i + 1, "data": d}) for i, d in enumerate(data)]
        (folder / "metrics.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
        (folder / "exit_code").write_text("0\n")
    shown = evidence.modes_block(tmp_path, "modes", "sync-1", "colocate-1", "colocate-2", "sync-2")
    assert "| sync-1 | 0 | 2-5 | 20.0 | 10.0 | 1.0 | 5.0 | 2048 |" in shown
    assert "| colocate-2 | 0 | 2-5 | 20.0 | 10.0 | 1.0 | 5.0 | 2048 |" in shown
    assert shown.endswith("per mode: sync 21.0 s (2 runs); colocate 20.0 s (2 runs, 0.95 × sync).\n")
    alone = evidence.modes_block(tmp_path, "modes", "sync-1", "colocate-1")
    assert alone.endswith("per mode: sync 20.0 s (1 run); colocate 20.0 s (1 run, 1.00 × sync).\n")
    one = tmp_path / "evidence" / "modes" / "sync-3"
    one.mkdir()
    (one / "metrics.jsonl.gz").write_bytes(gzip.compress(b'{"step": 1, "data": {"timing_s/step": 9.0}}\n'))
    with pytest.raises(evidence.EvidenceError, match="sync-3: fewer than two steps logged"):
        evidence.modes_block(tmp_path, "modes", "sync-3")


def test_the_locate_block_comes_from_its_record(copy):
    """The first locate record: what the engine chose and no module differing for any request; a record where a module
    differed names it, and the check fails until the page is regenerated."""
    shown = evidence.locate_block(copy, "locate-h100-adc01db")
    assert (
        "FLASH_ATTN (FlashAttentionImpl, FlashAttention 3)" in shown
        and "| 0 | 2 | 8 / 8 | no | none | - | - |" in shown
    )
    assert "`--partner same`, vLLM's residual norm;" in shown  # a record from before --partner and --norm
    many = evidence.locate_block(copy, "locate-h100-ab24722", "triton.json")
    assert "TRITON_ATTN (TritonAttentionImpl), seeded T = 1, 16 tokens a request" in many  # no FlashAttention there
    record_path = copy / "evidence/locate-h100-adc01db/locate.json"
    record = json.loads(record_path.read_text())
    record["requests_located"][0] |= {"module": "model.layers.3.self_attn.attn", "pass": 2, "max_abs_diff": 0.0039,
                                      "tokens_differ": True}  # fmt: skip
    record["first_modules"] = {"model.layers.*.self_attn.attn": 1, "none": 3}
    record_path.write_text(json.dumps(record))
    shown = evidence.locate_block(copy, "locate-h100-adc01db")
    assert "| 0 | 2 | 8 / 8 | yes | `model.layers.3.self_attn.attn` | 2 | 0.0039 |" in shown
    done = check(copy)
    assert done.returncode == 1 and "block 'locate locate-h100-adc01db'" in done.stdout
