"""``python -m stapo.checks.replay``: record, replay, halt and resume, each run in a real Ray cluster of its own
(:func:`stapo.train.clusters.launch`), with the trainer stood in (verl's needs a GPU: tests/standins.py ``train``, which
composes and checks each run's config, writes verl's metrics and checkpoints, and resumes as verl does). What the
stand-in cannot show, that the tape gives a replayed run the recorded rollouts, tests/test_agent_loop.py shows."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import standins
import torch
from hydra import compose, initialize_config_dir

from stapo.checks import replay
from stapo.config import CONFIG_DIR
from stapo.quickstart.run import build
from stapo.train import clusters
from stapo.train.main import validate


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    _, paths, model = build(tmp_path_factory.mktemp("replay"), 0, 48, 8, hidden_size=32, num_layers=1)
    return model, paths["train"].parent


def args(tmp_path, task, *extra):
    model, data = task
    return ["run", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "out"), *extra]


def test_record_replay_halt_and_resume_compare_to_the_bit(tmp_path, task, monkeypatch, foreign_ray_ignored):
    """The halted run, and runs stopped by SIGUSR1 and by a deadline (stapo.train.deadline, in the stand-in as in the
    recipe's trainer), each resumed: all equal to the replay run; the stopped ones lose no step's metrics. The record
    run's twin and its halted twin are compared and reported (the stand-in computes alike: no step where they part)."""
    monkeypatch.setattr(clusters, "HANDOVER_S", 1.0)
    monkeypatch.setattr(replay, "TRAINER", [sys.executable, str(standins.HERE), "train"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # stubbed: no GPU here (the trainer is a stand-in)
    monkeypatch.setenv("STANDIN_STEP_S", "1")  # the halt and the signal must see a step before the run ends
    # the deadline run's deadline: 60 s from its launch, after its start-up (which takes 10-40 s here, the longer on a
    # loaded machine: a deadline already past is refused) and closer than a step and the 60 s guessed save after its
    # first step, so that it stops there (stapo.train.deadline.must_stop)
    with pytest.raises(SystemExit) as done:
        replay.main(args(tmp_path, task, "--steps", "4", "--halt", "2", "--signal", "1", "--deadline", "60", "--twin",
                         "--twin-halt", "2"))  # fmt: skip
    out = tmp_path / "out"
    assert done.value.code == 0, "\n".join(log.read_text()[-1500:] for log in (out / "runs").glob("*/train.log"))
    assert "halted at the checkpoint of step 2" in (out / "runs" / "halt2" / "train.log").read_text()
    assert "step:3" not in (out / "runs" / "halt2" / "train.log").read_text()  # killed before it logged step 3
    assert "step:1" not in (out / "runs" / "halt2-resumed" / "train.log").read_text()  # resumed after step 2
    record = json.loads((out / "replay.json").read_text())
    assert record["equal"] and record["weights_equal"] and record["weights_moved"]
    assert set(record["weights_sha256"]) == {"replay", "record", "halt2", "signal1", "deadline"}
    assert all(set(c["steps"]) | {2} == {1, 2, 3, 4} and c["metrics"] > 3 for c in record["comparisons"].values())
    for folder in ("record", "signal1", "deadline"):
        assert record["comparisons"][folder]["missing"] == []
    signalled = (out / "runs" / "signal1" / "train.log").read_text()
    assert "SIGUSR1 sent after step 1" in signalled and f"saved step {record['stopped_at']['signal1']} in" in signalled
    assert record["stopped_at"]["halt2"] == 2 and record["stopped_at"]["signal1"] in (2, 3)
    assert record["stopped_at"]["deadline"] == 1 and record["deadline_s"] == 60.0
    assert "(the deadline is " in (out / "runs" / "deadline" / "train.log").read_text()
    times = json.loads((out / "runs" / "deadline" / "times.json").read_text())  # when its steps appeared
    assert list(times) == ["1"]
    assert (out / "halt2" / "metrics.1.jsonl").is_file()  # the steps before the halt, set aside on resume
    assert (out / "replay.md").read_text().endswith("verdict: identical to the bit\n")
    twin = record["twin"]
    assert twin["weights_equal"] and twin["first_step"] is None and twin["differ"] == [] and twin["metrics"] > 3
    assert "twin" not in record["weights_sha256"] and "## record against twin" in (out / "replay.md").read_text()
    assert (out / "runs" / "twin" / "train.log").is_file() and (out / "twin" / "metrics.jsonl").is_file()
    halted = record["twin_halt"]  # the real run killed after step 2's checkpoint and resumed, generating all along
    assert halted["weights_equal"] and halted["first_step"] is None and halted["metrics"] > 3
    assert halted["halt"] == 2 and set(halted["missing"]) <= {2} and set(halted["steps"]) | {2} == {1, 2, 3, 4}
    assert twin["halt"] == 0 and twin["steps"] == [1, 2, 3, 4] and twin["missing"] == []
    assert "halted at the checkpoint of step 2" in (out / "runs" / "twin-halt" / "train.log").read_text()
    assert "step:1" not in (out / "runs" / "twin-halt-resumed" / "train.log").read_text()
    assert "## record against twin-halt" in (out / "replay.md").read_text()
    foreign_ray_ignored()


def test_a_twin_that_fails_is_reported_and_costs_nothing_else(tmp_path, task, monkeypatch, foreign_ray_ignored):
    """The twin is reported, not part of the verdict: one whose run fails (here a tape key the config lacks) leaves
    the record, replay and verdicts as they would be, and says where its log is."""
    monkeypatch.setattr(clusters, "HANDOVER_S", 1.0)
    monkeypatch.setattr(replay, "TRAINER", [sys.executable, str(standins.HERE), "train"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # stubbed: no GPU here (the trainer is a stand-in)
    monkeypatch.setattr(replay, "TWIN", replay.Leg("twin", "twin", "stapo.no_such_key", tape_dir="tape-twin"))
    halted = dataclasses.replace(replay.twin_halt(1), tape="stapo.no_such_key")  # the halted twin fails too
    monkeypatch.setattr(replay, "twin_halt", lambda at: halted)
    with pytest.raises(SystemExit) as done:
        replay.main(args(tmp_path, task, "--steps", "2", "--halt", "--twin", "--twin-halt", "1"))
    out = tmp_path / "out"
    assert done.value.code == 0, (out / "runs" / "record" / "train.log").read_text()[-1500:]
    record = json.loads((out / "replay.json").read_text())
    assert record["equal"] and record["twin"] == {"failed": f"see {out / 'runs' / 'twin' / 'train.log'}"}
    assert record["twin_halt"] == {"failed": f"see {out / 'runs'}/twin-halt*/train.log"}
    assert "no_such_key" in (out / "runs" / "twin" / "train.log").read_text()
    assert not (out / "runs" / "twin-halt-resumed").exists()  # a halted twin that failed is not resumed
    foreign_ray_ignored()


def test_a_twin_whose_records_cannot_be_read_is_reported_failed(tmp_path):
    """Unreadable metrics of a twin are its failure, reported, not the check's end."""
    found, table = replay.twins(tmp_path, 2, replay.twin_halt(1))
    assert set(found) == {"failed"} and "record/metrics.jsonl" in found["failed"] and table == ""


def test_a_replay_whose_gradients_were_all_zero_shows_nothing(tmp_path, monkeypatch):
    """A reward that never varies leaves every advantage and gradient 0: runs equal then say nothing of the update
    (the records of 2026-11-29 and 2026-12-06); one nonzero step is enough."""
    from verl.utils.tracking import FileLogger

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    logger = FileLogger("stapo", "replay")
    for step in (1, 2, 3):
        logger.log({"actor/grad_norm": 0.0, "actor/entropy": 2.0}, step)
    logger.finish()
    assert not replay.weights_moved(tmp_path / "metrics.jsonl")
    logger = FileLogger("stapo", "replay")
    logger.log({"actor/grad_norm": 0.01}, 4)
    logger.finish()
    assert replay.weights_moved(tmp_path / "metrics.jsonl")
    assert replay.REWARD.endswith("gpu_smoke:smoke_reward")


def test_every_run_has_the_tape_and_determinism(tmp_path, task):
    """The record run writes the tape, its twins one each of their own, every other run replays the first, all under
    determinism=full, and each run's config passes the trainer's checks; a halted run and its resumption save at the
    halt step."""
    parsed = replay.argparse.Namespace(
        model=task[0], data=task[1], out=tmp_path, steps=6, halt=[2, 3], tau_p=0.02, overrides=[]
    )
    legs = [
        replay.Leg("record", "record", "stapo.record_rollouts"),
        replay.Leg("halt3", "halt3", "stapo.replay_rollouts", 3, "kill"),
        replay.Leg("deadline", "deadline", "stapo.replay_rollouts", 0, "deadline", deadline_s=95.24),
        replay.TWIN,
        replay.twin_halt(3),
    ]
    tapes = [("record_rollouts", "tape"), *[("replay_rollouts", "tape")] * 2, ("record_rollouts", "tape-twin")]
    tapes.append(("record_rollouts", "tape-twin-halt"))  # the halted twin generates all along, a tape of its own
    for leg, (tape, folder) in zip(legs, tapes, strict=True):
        argv = replay.overrides(leg, parsed)
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            config = compose(argv[0].split("=")[1], argv[1:])
        stapo = validate(config, environment=False)
        assert config.stapo[tape] == str(tmp_path / folder) and config.actor_rollout_ref.rollout.full_determinism
        assert config.trainer.save_freq == (3 if leg.halt else 6)
        assert config.trainer.default_local_dir == str(tmp_path / leg.folder / "ckpt")
        assert (stapo.deadline, stapo.deadline_margin) == ((95.2, 0) if leg.stop == "deadline" else ("", 60))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--steps", "1"], "--steps 1: a replay needs at least 2 steps"),
        (["--halt", "6"], "--halt 6: halt between step 1 and step 5"),
        (["--signal", "5"], "--signal 5: signal after a step between 1 and 4 (--steps 6)"),
        (["--twin-halt", "6"], "--twin-halt 6: halt between step 1 and step 5 (0: no such run)"),
        (["--deadline", "-5"], "--deadline -5: seconds from a run's launch, more than 0 (0: no deadline run)"),
    ],
)
def test_bad_options_stop_before_any_run(tmp_path, task, capsys, extra, message):
    with pytest.raises(SystemExit) as done:
        replay.main(args(tmp_path, task, *extra))
    assert done.value.code == 2 and capsys.readouterr().err.startswith(f"error: {message}")
    assert not (tmp_path / "out").exists()


def test_halt_reports_a_run_that_ended_first(tmp_path, capsys):
    code = replay.halt(3, tmp_path, [sys.executable, "-c", "pass"])
    assert code == 1 and "ended (exit 0) before its checkpoint of step 3" in capsys.readouterr().out
    Path(tmp_path / "latest_checkpointed_iteration.txt").write_text("4")  # read late: a later checkpoint also halts
    assert replay.halt(3, tmp_path, [sys.executable, "-c", "import time; time.sleep(60)"]) == 0


STANDIN = """#!{python}
import json, os, sys
with open({calls!r}, "a") as calls:
    calls.write(" ".join(sys.argv[1:]) + f" ({{os.environ.get('CUBLASLT_WORKSPACE_SIZE')}})\\n")
if sys.argv[2] == "stapo.checks.batch_invariance" and sys.argv[3] in ("run", "locate"):  # a record (run's shape)
    out = sys.argv[sys.argv.index("--out") + 1]
    counts = {{"responses": 0, "tokens": 0, "logprobs": 0, "max_logprob_gap": 0.0}}
    record = {{"setting": sys.argv[sys.argv.index("--setting") + 1], "greedy": False, "eager": True, "requests": 48,
              "compositions": {{"together": counts, "again": counts}}}}
    open(out, "w").write(json.dumps(record))
elif sys.argv[2:4] == ["stapo.checks.batch_invariance", "table"]:
    from stapo.checks.batch_invariance import main
    main(sys.argv[3:])
"""


def test_the_gpu_script_probes_every_setting_beside_the_replay(tmp_path):
    """scripts/gpu/determinism.sh as printed, from a folder that does not exist yet, with a stand-in for the Python
    that needs a GPU (it records each command and writes a probe's record): six probes (two with vLLM's SM90 cuBLAS
    variables preset), the task, the replay check with arguments its real parser accepts and a config that passes
    the trainer's checks, and the table of the six records."""
    import shlex

    out = tmp_path / "new" / "det"
    (out / "smollm2" / "raw").mkdir(parents=True)
    (out / "smollm2" / "raw" / "config.json").write_text("{}")  # converted before: not again
    done, lines = standins.run_gpu_script(tmp_path, "determinism.sh", STANDIN, out)
    assert done.returncode == 0, done.stderr
    probes = sorted(line.split("--out ")[1].split()[0].rsplit("/", 1)[1] for line in lines if " run --model" in line
                    and "batch_invariance" in line)  # fmt: skip
    assert probes == [f"{name}.json" for name in ("fa2-cublas", "fa2", "fa3-cublas", "fa3", "flex", "triton")]
    assert "stapo.tools.pretrained" not in "\n".join(lines)
    preset = {line.split("--out ")[1].split()[0].rsplit("/", 1)[1] for line in lines if line.endswith(" (1)")}
    assert preset == {"fa3-cublas.json", "fa2-cublas.json"}
    (replay_line,) = [line for line in lines if line.startswith("-m stapo.checks.replay")]
    args = replay.build_parser().parse_args(shlex.split(replay_line)[2:-1])
    assert args.data == out / "task" and args.model == out / "smollm2" / "raw" and args.halt == [2, 3]
    assert replay.config_problem(args) is None
    assert lines[-1].startswith("-m stapo.checks.batch_invariance table") and lines[-1].count(".json") == 6
    assert (out / "invariance" / "table.md").read_text().count("| again |") == 6
    assert "-m stapo.quickstart.task word --difficulty 1 --train 48" in "\n".join(lines)
    usage = standins.run_gpu_script(tmp_path, "determinism.sh", "", "--help")[0]
    assert usage.returncode == 0 and "On one GPU: is vLLM batch-invariant here" in usage.stdout
    refused = standins.run_gpu_script(tmp_path, "determinism.sh", "", "x", "--srcx", "y")[0]
    assert refused.returncode == 2 and "unknown option" in refused.stderr


def test_the_deadline_script_runs_the_signal_and_deadline_legs(tmp_path, monkeypatch):
    """scripts/gpu/deadline.sh as printed, from a folder that does not exist yet, with the same stand-in Python: the
    model converted from --src, the task, and the replay check with a SIGUSR1 leg after step 2 and a deadline leg 60
    s after its launch (no halted legs), arguments its real parser accepts and a config that passes the trainer's
    checks."""
    import shlex

    out, gguf = tmp_path / "new" / "dl", tmp_path / "sm.gguf"
    gguf.write_bytes(b"GGUF")
    done, lines = standins.run_gpu_script(tmp_path, "deadline.sh", STANDIN, out, "--src", gguf)
    assert done.returncode == 0, done.stderr
    assert lines[0].startswith(f"-m stapo.tools.pretrained --out {out}/smollm2/raw --src {gguf}")
    assert lines[1].startswith(f"-m stapo.quickstart.task word --difficulty 1 --train 48 --val 8 --out {out}/task")
    (model := out / "smollm2" / "raw").mkdir(parents=True)  # what the stand-in did not write
    (model / "config.json").write_text("{}")
    (out / "task").mkdir()
    (out / "task" / "train.parquet").write_bytes(b"")
    args = replay.build_parser().parse_args(shlex.split(lines[2])[2:-1])
    assert (args.halt, args.signal, args.deadline, args.steps, args.twin) == ([], [2], 60, 6, True)
    assert args.out == out / "replay"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # stubbed: no GPU here
    assert replay.check(args) is None  # the options, every leg's config, the new output folder
    usage = standins.run_gpu_script(tmp_path, "deadline.sh", "", "--help")[0]
    assert usage.returncode == 0 and "outlives its job" in usage.stdout


TWIN = {"metrics": 104, "steps": [1, 2, 3, 4, 5, 6], "missing": [], "halt": 0, "first_step": None, "first_metrics": [],
        "one_sided": [], "weights_equal": True}  # fmt: skip
EQUAL_TWINS = {"twin": TWIN, "twin_halt": {**TWIN, "steps": [1, 2, 4, 5, 6], "missing": [3], "halt": 3}}
"""A ``replay.json``'s twins as ``replay run --twin --twin-halt 3`` writes them when both equal the record run (the
halted twin's step 3 line lost at the kill)."""


def bitwise_standin(twins: dict) -> str:
    """The stand-in Python for scripts/gpu/bitwise.sh: :data:`STANDIN`, each engine job and the replay check taking a
    while and logging its end, the replay check writing ``replay.json`` with ``twins``, and the real ``replay
    twins`` reading it."""
    record = json.dumps(twins).replace("{", "{{").replace("}", "}}")
    return (
        STANDIN
        + f"""import time
if sys.argv[2:4] == ["stapo.checks.replay", "twins"]:
    from stapo.checks.replay import main
    main(sys.argv[3:])
elif sys.argv[2] in ("stapo.checks.batch_invariance", "stapo.checks.replay") and "table" not in sys.argv:
    time.sleep(0.5)  # a job that takes a while: its end is logged, so that what ran after what shows
    out = sys.argv[sys.argv.index("--out") + 1]
    if sys.argv[2] == "stapo.checks.replay":
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "replay.json"), "w").write({record!r})
    with open({{calls!r}}, "a") as calls:
        calls.write("end " + out + "\\n")
"""
    )


BITWISE_RECORDS = ("seeded", "greedy", "alone-vllm", "alone-recipe")
LOCATE_RECORDS = ("fa3-many", "fa3-many-vllm", "probe-fa3", "probe-fa3-vllm", "probe-triton")


def test_the_bitwise_script_probes_beside_the_twins_then_times_each_norm_alone(tmp_path, monkeypatch):
    """scripts/gpu/bitwise.sh as printed, from a folder that does not exist yet, with the same stand-in Python: the
    model converted from --src, the task, locate.sh's five engines, the seeded and greedy probes with the recipe's norm
    and the replay check with its two twins (one halted after step 3) and no halted replayed legs, then, once all of
    those ended, the probe with vLLM's norm and after it the one with the recipe's, each with arguments the real
    parsers accept, and the table of the four records; run again on the same OUT without records written, it says
    each is missing, locate.sh's failure among them."""
    import shlex

    out, gguf = tmp_path / "new" / "bw", tmp_path / "sm.gguf"
    gguf.write_bytes(b"GGUF")
    (out / "bitwise").mkdir(parents=True)
    (out / "bitwise" / "alone-vllm.json").write_text("{}")  # a record of an earlier try: not taken for this one's
    done, lines = standins.run_gpu_script(tmp_path, "bitwise.sh", bitwise_standin(EQUAL_TWINS), out, "--src", gguf)
    assert done.returncode == 0, done.stderr
    assert "twin: equal to the bit\ntwin_halt: equal to the bit" in done.stdout
    assert lines[0].startswith(f"-m stapo.tools.pretrained --out {out}/smollm2/raw --src {gguf}")
    assert lines[1].startswith(f"-m stapo.quickstart.task word --difficulty 1 --train 48 --val 8 --out {out}/task")
    model = out / "smollm2" / "raw"
    runs = [line for line in lines if line.split()[1:3] == ["stapo.checks.batch_invariance", "run"]]
    probes = [shlex.split(line)[2:] for line in runs if f"{out}/bitwise/" in line]
    fa3 = ["run", "--model", str(model), "--setting", "fa3"]
    assert sorted(probes[:2]) == [[*fa3, "--greedy", "--out", f"{out}/bitwise/greedy.json", "(None)"],
                                  [*fa3, "--out", f"{out}/bitwise/seeded.json", "(None)"]]  # fmt: skip
    assert probes[2:] == [[*fa3, "--norm", "vllm", "--out", f"{out}/bitwise/alone-vllm.json", "(None)"],
                          [*fa3, "--out", f"{out}/bitwise/alone-recipe.json", "(None)"]]  # fmt: skip

    def start(job):
        return next(i for i, line in enumerate(lines) if line.startswith("-m") and f" --out {job} " in line)

    seeded, greedy, alone_vllm, alone_recipe = (f"{out}/bitwise/{n}.json" for n in BITWISE_RECORDS)
    located = [line.split()[-1] for line in lines if line.startswith(f"end {out}/locate/")]
    assert sorted(located) == sorted(f"{out}/locate/{n}.json" for n in LOCATE_RECORDS)  # locate.sh's engines, beside
    assert (out / "locate" / "table.md").is_file() and not (out / "locate.log").read_text().count("error")
    before = max(lines.index(f"end {job}") for job in (seeded, greedy, f"{out}/replay", *located))
    assert before < start(alone_vllm) and lines.index(f"end {alone_vllm}") < start(alone_recipe)  # then alone, in turn
    for probe in probes:  # the real parser takes each (it stops at the model folder, which the stand-in did not write)
        parsed = subprocess.run([sys.executable, "-m", "stapo.checks.batch_invariance", *probe[:-1]],
                                capture_output=True, text=True)  # fmt: skip
        assert parsed.returncode == 2 and "no config.json there" in parsed.stderr, parsed.stderr
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (out / "task").mkdir()
    (out / "task" / "train.parquet").write_bytes(b"")
    [check] = [shlex.split(line)[2:-1] for line in lines if line.split()[1:3] == ["stapo.checks.replay", "run"]]
    verdict = lines.index(f"-m stapo.checks.replay twins {out}/replay (None)")
    assert lines.index(f"end {out}/replay") < verdict  # the twins' verdict, once the check ended
    args = replay.build_parser().parse_args(check)
    assert (args.halt, args.signal, args.deadline, args.steps, args.twin, args.twin_halt) == ([], [], 0, 6, True, 3)
    (out / "replay" / "replay.json").unlink()  # the stand-in's record: the real check wants a new folder
    (out / "replay").rmdir()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # stubbed: no GPU here
    assert args.out == out / "replay" and replay.check(args) is None
    tables = [line.split()[3:-1] for line in lines if line.split()[1:3] == ["stapo.checks.batch_invariance", "table"]]
    [table] = [t for t in tables if f"{out}/bitwise/" in t[0]]  # and locate.sh's of its own probes
    assert sorted(table) == sorted(f"{out}/bitwise/{n}.json" for n in BITWISE_RECORDS)
    assert (out / "bitwise" / "table.md").is_file()
    usage = standins.run_gpu_script(tmp_path, "bitwise.sh", "", "--help")[0]
    assert usage.returncode == 0 and "Bit for bit end to end" in usage.stdout
    [again] = re.findall(r"`python -m (stapo\.checks\.replay run [^`]+)`", usage.stdout)  # the twins alone, as printed
    again = shlex.split(again.replace("OUT/", f"{out}/").replace("NEW", str(tmp_path / "twins")))[1:]
    assert replay.check(again := replay.build_parser().parse_args(again)) is None and (again.twin, again.halt) == (
        True, [])  # fmt: skip
    silent = "#!{python}\nimport sys\nopen({calls!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"  # no records
    again = standins.run_gpu_script(tmp_path, "bitwise.sh", silent, out)[0]  # the same OUT: its records don't count
    assert again.returncode == 1 and all(f"error: no {name} record" in again.stderr for name in BITWISE_RECORDS)
    assert f"error: locate.sh: exit 1; see {out}/locate.log" in again.stderr


def test_a_missing_step_fails_unless_a_kill_took_its_log_line(tmp_path, monkeypatch):
    """verl writes a step's checkpoint before it logs the step: a run halted at step 2 may miss step 2's line (on the
    H200, halt2 did), which passes; a run missing any other step fails, as does a differing value."""
    from verl.utils.tracking import FileLogger

    def log(folder, steps, entropy=0.5):
        (tmp_path / folder).mkdir()
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / folder / "metrics.jsonl"))
        logger = FileLogger("stapo", "replay")
        for step in steps:
            logger.log({"actor/entropy": entropy if step == 3 else 0.5, "actor/lr": 1e-6, "timing_s/step": step}, step)
        logger.finish()

    log("replay", [1, 2, 3, 4])
    log("halt2", [1, 3, 4])
    log("record", [1, 2, 4])
    log("other", [1, 2, 3, 4], entropy=0.5 + 2**-20)
    found, tables = replay.comparisons(tmp_path, {"halt2": 2, "record": 0, "other": 0}, 4)
    assert found["halt2"]["equal"] and found["halt2"]["missing"] == [2]
    assert not found["record"]["equal"] and found["record"]["missing"] == [3]
    assert not found["other"]["equal"] and found["other"]["differ"] == ["actor/entropy"]
    assert found["other"]["metrics"] == 2  # actor/entropy and actor/lr; the step time is never compared
    assert "## replay against other" in tables


def test_an_out_folder_in_use_is_refused(tmp_path, task, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "replay.json").write_text("{}")
    with pytest.raises(SystemExit) as done:
        replay.main(args(tmp_path, task))
    assert done.value.code == 2 and "--out" in (err := capsys.readouterr().err) and "not empty" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["replay.json"]


def test_the_bitwise_script_fails_when_a_twin_failed(tmp_path):
    """scripts/gpu/bitwise.sh as printed, the replay check's twin failed (as on the H100 of docs/evidence/bitwise.md):
    every record is there, yet the script exits 1 and says which twin and why."""
    out, gguf = tmp_path / "new" / "bw", tmp_path / "sm.gguf"
    gguf.write_bytes(b"GGUF")
    twins = {**EQUAL_TWINS, "twin": {"failed": "see OUT/replay/runs/twin/train.log"}}
    done, _ = standins.run_gpu_script(tmp_path, "bitwise.sh", bitwise_standin(twins), out, "--src", gguf)
    assert done.returncode == 1 and "error: twin: failed: see OUT/replay/runs/twin/train.log" in done.stderr
    assert "twin_halt: equal to the bit" in done.stdout and "no seeded record" not in done.stderr


@pytest.mark.parametrize(
    ("record", "code", "said"),
    [
        ("bitwise-twin-h100-45589f6/replay", 0, "twin: equal to the bit"),
        ("bitwise-h100-45589f6/replay", 1, "error: twin: failed: see /tmp/bw/replay/runs/twin/train.log"),
        ("deadline-h100-62eb206", 1, "error: twin: parts at step 1 in 68 metrics, first actor/entropy"),
        ("determinism-h200/replay", 1, "error: twins: none in replay.json: run the check with --twin or --twin-halt K"),
    ],
)
def test_the_twins_verdict_reads_the_recorded_checks(record, code, said):
    """``python -m stapo.checks.replay twins OUT`` on the replay checks' own records: the twin run alone after the
    recipe's norm (equal), the twin that failed at start-up beside the script's engines, the twin before the recipe's
    norm (parts at step 1, as docs/evidence/determinism.md reads it), and a check run without twins."""
    root = Path(__file__).resolve().parents[1] / "evidence" / record
    done = subprocess.run([sys.executable, "-m", "stapo.checks.replay", "twins", root], capture_output=True, text=True)
    assert done.returncode == code and said in done.stdout + done.stderr, done.stdout + done.stderr


def test_the_twins_verdict_allows_only_a_halted_twins_own_step_missing():
    """A halted twin may lack its halt step's line (the kill can take it); any other missing step, one-sided metric
    or different last weights is a problem."""
    assert replay.twin_problems(EQUAL_TWINS) == {"twin": None, "twin_halt": None}
    lost = {"twin_halt": {**EQUAL_TWINS["twin_halt"], "missing": [3, 4]}}
    assert replay.twin_problems(lost) == {"twin_halt": "steps not compared: [3, 4]"}
    assert replay.twin_problems({"twin": {**TWIN, "missing": [6]}}) == {"twin": "steps not compared: [6]"}
    assert replay.twin_problems({"twin": {**TWIN, "one_sided": ["a/b"]}}) == {"twin": "logged by one run only: a/b"}
    assert replay.twin_problems({"twin": {**TWIN, "weights_equal": False}}) == {"twin": "last weights differ"}
