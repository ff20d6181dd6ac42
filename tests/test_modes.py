"""scripts/gpu/modes.sh, the trainer modes' speed side by side, and scripts/gpu/length.sh, the paper's response
length, run as printed from a folder that does not exist yet, with a stand-in for the Python that needs a GPU (it
records each call; scripts/train.sh is the real one); the runs' configs compose with the recipe's and pass the
trainer's checks, in the order asked and alternated by default."""

import shlex
import subprocess
import sys

import standins
from hydra import compose, initialize_config_dir

from stapo.config import CONFIG_DIR
from stapo.train.main import validate


def run_script(tmp_path, *args):
    (tmp_path / "tok").mkdir(exist_ok=True)
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "new" / "out"
    return standins.run_gpu_script(tmp_path, "modes.sh", standins.LOGGING_SH, out, tmp_path / "tok", *args)


def test_each_mode_runs_twice_alternated_with_a_config_that_passes(tmp_path):
    done, lines = run_script(tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "new" / "out"
    assert lines[0].startswith(f"-m stapo.checks.scale model --shape qwen3_1.7b --tokenizer {tmp_path / 'tok'}")
    assert lines[1].startswith(f"-m stapo.quickstart.task word --out {out}/word")
    trains = [shlex.split(line) for line in lines if line.startswith("-m stapo.train")]
    modes = []
    for argv in trains:
        overrides = argv[4:]
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            config = compose(config_name=argv[2].split("=")[1], overrides=[argv[3], *overrides])
        validate(config, environment=False, overrides=overrides)
        modes.append(config.trainer.v1.trainer_mode)
        assert config.actor_rollout_ref.model.path == f"{out}/model" and config.trainer.total_training_steps == 5
        assert list(config.trainer.logger) == ["console", "file"]
    assert modes == ["stapo_sync", "stapo_colocate_async", "stapo_colocate_async", "stapo_sync"]
    for argv, d in zip(trains, ("sync-1", "colocate-1", "colocate-2", "sync-2")):  # what the cost model composes
        args = (out / d / "args.txt").read_text().splitlines()  # as passed; the stand-in's log lost the quotes
        assert [a.replace('"', "") for a in args] == [argv[2].split("=")[1], argv[3].split("=")[1], *argv[4:]]
    assert [(out / d / "exit_code").read_text() for d in ("sync-1", "colocate-1", "colocate-2", "sync-2")] == [
        "0\n"
    ] * 4
    assert lines[-1] == "-m stapo.checks.scale summary " + " ".join(
        f"{out}/{d}/metrics.jsonl" for d in ("sync-1", "colocate-1", "colocate-2", "sync-2")
    )
    again, lines = run_script(tmp_path, "colocate")  # numbering goes on after the folders there
    assert again.returncode == 0 and f"{out}/colocate-3/checkpoints" in lines[-2]


def test_bad_arguments_stop_first(tmp_path):
    done, lines = run_script(tmp_path, "sync,async")
    assert done.returncode == 2 and "ORDER=sync,async: a comma list of sync and colocate" in done.stderr and not lines
    usage = standins.run_gpu_script(tmp_path, "modes.sh", "", "--help")[0]
    assert usage.returncode == 0 and "side by side" in usage.stdout


LENGTH_SH = '#!/bin/sh\nif [ "$1" = -c ]; then exec {python} "$@"; fi\nprintf "%s\\n" "$*" >> {calls}\n'
"""A stand-in Python that logs its calls, except ``-c`` snippets (reading the config), which the real one runs."""


def test_the_paper_length_run_and_vllm_alone_on_the_same_work(tmp_path):
    """scripts/gpu/length.sh as printed, from a folder that does not exist yet: one sync run of the 1.7B shape whose
    config composes and passes the trainer's checks, at 15,360 tokens by default, its arguments in args.txt; then
    standalone vLLM with as many prompts, samples and tokens at the run's memory share, through the real parser."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "new" / "out"
    done, lines = standins.run_gpu_script(tmp_path, "length.sh", LENGTH_SH, out, tmp_path / "tok")
    assert done.returncode == 0, done.stderr
    [train] = [shlex.split(line) for line in lines if line.startswith("-m stapo.train")]
    args = (out / "sync-1" / "args.txt").read_text().splitlines()
    assert [a.replace('"', "") for a in args] == [train[2].split("=")[1], train[3].split("=")[1], *train[4:]]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        config = compose(config_name=args[0], overrides=[f"size={args[1]}", *args[2:]])
    validate(config, environment=False, overrides=args[2:])
    assert (config.data.max_response_length, config.data.train_batch_size, config.trainer.total_training_steps) == (
        15360, 2, 3)  # fmt: skip
    assert config.trainer.v1.trainer_mode == "stapo_sync" and list(config.trainer.logger) == ["console", "file"]
    [vllm] = [shlex.split(line) for line in lines if line.startswith("-m stapo.checks.benchmark vllm")]
    options = dict(zip(vllm[3::2], vllm[4::2]))
    share = config.actor_rollout_ref.rollout.gpu_memory_utilization
    assert options == {"--model": f"{out}/model", "--data": f"{out}/word/train.parquet", "--prompts": "2", "--n": "8",
                       "--response-length": "15360", "--repeats": "2", "--gpu-memory-utilization": str(share),
                       "--out": f"{out}/vllm"}  # fmt: skip
    found = subprocess.run(
        [sys.executable, *vllm], capture_output=True, text=True
    )  # parsed; the stand-in made no model
    assert found.returncode == 2 and f"--model {out}/model: no config.json in it" in found.stderr, found.stderr
    assert lines[-1] == f"-m stapo.checks.scale summary {out}/sync-1/metrics.jsonl"
    bad = standins.run_gpu_script(tmp_path, "length.sh", LENGTH_SH, out, tmp_path / "tok", "15360", "3")[0]
    assert bad.returncode == 2 and "PROMPTS=3: an even number" in bad.stderr
