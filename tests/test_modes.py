"""scripts/gpu/modes.sh, the trainer modes' speed side by side, run as printed from a folder that does not exist yet,
with a stand-in for the Python that needs a GPU (it records each call; scripts/train.sh is the real one); the runs'
configs compose with the recipe's and pass the trainer's checks, in the order asked and alternated by default."""

import shlex

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
