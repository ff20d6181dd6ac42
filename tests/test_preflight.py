"""What the driver checks before Ray starts (stapo/train/preflight.py): one line per problem, naming the key and the
fix, for GPUs, data, model and the checkpoint a run would resume from; and the entry point prints them without a
traceback, seconds after launch, where a run without GPUs used to hang."""

import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from standins import dataloader_state

from stapo.config import CONFIG_DIR
from stapo.tools.data import prepare_eval
from stapo.train import preflight

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def load(*overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="stapo", overrides=list(overrides))


@pytest.fixture(autouse=True)
def no_other_ray_cluster(monkeypatch):
    """A Ray cluster of another process on the test machine is not what these tests check (tests/test_experiment.py
    checks that line with a real cluster)."""
    monkeypatch.setattr(preflight, "local_ray_clusters", lambda: [])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A prepared benchmark parquet and a folder with a config.json: what a run's data and model keys point to."""
    root = tmp_path_factory.mktemp("preflight")
    source = root / "aime24.jsonl"
    source.write_text('{"problem": "What is 1+1?", "answer": "2"}\n')
    prepare_eval([source], root / "data", partial=True)
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}")
    return root


def good(files, *overrides):
    data = files / "data" / "aime24.parquet"
    return load(
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"actor_rollout_ref.model.path={files / 'model'}",
        "trainer.n_gpus_per_node=1",
        f"trainer.default_local_dir={files / 'ckpt'}",
        *overrides,
    )


def test_a_runnable_config_has_no_problems(files, monkeypatch):
    """The GPU count is the one thing a CPU machine cannot have: it is stubbed for this case."""
    monkeypatch.setattr(preflight, "local_gpus", lambda: 1)
    assert preflight.environment_problems(good(files)) == []


def test_gpu_problems_say_what_to_do(files, monkeypatch):
    monkeypatch.setattr(preflight, "local_gpus", lambda: 0)  # a machine without GPUs (this one: none anyway)
    (line,) = preflight.environment_problems(good(files, "trainer.n_gpus_per_node=8"))
    assert line.startswith("trainer.n_gpus_per_node=8 x trainer.nnodes=1 needs 8 GPUs; this machine has none visible")
    monkeypatch.setattr(preflight, "local_gpus", lambda: 2)
    (line,) = preflight.environment_problems(good(files, "trainer.n_gpus_per_node=8"))
    assert "this machine has 2 visible" in line and line.endswith(
        "set trainer.n_gpus_per_node=2 or run where the GPUs are"
    )
    (line,) = preflight.environment_problems(good(files, "trainer.n_gpus_per_node=0"))
    assert (
        line == "trainer.n_gpus_per_node=0 x trainer.nnodes=1: a run needs at least one GPU on at least one node; "
        "set both to 1 or more"
    )
    (line,) = preflight.environment_problems(good(files, "trainer.nnodes=2"))
    assert line.startswith("trainer.nnodes=2 needs a Ray cluster over those nodes") and "RAY_ADDRESS" in line
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    (line,) = preflight.environment_problems(good(files))
    assert "is a dashboard address, for `ray job submit`" in line
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    monkeypatch.setattr(preflight, "cluster_gpus", lambda address: "no Ray cluster answered")  # none to ask here
    (line,) = preflight.environment_problems(good(files))
    assert line == "RAY_ADDRESS=head:6379: no Ray cluster answered"
    monkeypatch.setattr(preflight, "cluster_gpus", lambda address: 4.0)
    (line,) = preflight.environment_problems(good(files, "trainer.n_gpus_per_node=8"))
    assert line.endswith("needs 8 GPUs; the Ray cluster at head:6379 has 4: lower them or add nodes")


def test_an_unreachable_cluster_is_reported_in_time():
    answer = preflight.cluster_gpus("127.0.0.1:9", timeout=5)
    assert isinstance(answer, str) and answer.startswith(("no Ray cluster answered within 5 s", "connecting to the"))


def test_data_and_model_problems_name_the_key_and_file(files, tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "local_gpus", lambda: 1)
    truncated = tmp_path / "math500.parquet"
    truncated.write_bytes((files / "data" / "aime24.parquet").read_bytes()[:100])
    no_reward = tmp_path / "no_reward.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["x"], "data_source": ["d"]}), no_reward)
    found = preflight.environment_problems(
        good(
            files,
            f"data.train_files={tmp_path / 'missing.parquet'}",
            f"data.val_files=[{truncated},{no_reward}]",
            f"actor_rollout_ref.model.path={tmp_path / 'nowhere' / 'model'}",
        )
    )
    assert found == [
        f"data.train_files: {tmp_path / 'missing.parquet'}: no such file; expected a verl parquet from "
        "`python -m stapo.tools.data train` (or set data.train_files=PATH)",
        f"data.val_files: {truncated}: not a readable parquet file ("
        + found[1].split("not a readable parquet file (", 1)[1],
        f"data.val_files: {no_reward}: missing column(s) reward_model; expected a verl parquet from "
        "`python -m stapo.tools.data eval` (or set data.val_files=PATH)",
        f"actor_rollout_ref.model.path={tmp_path / 'nowhere' / 'model'}: no such folder, and not a Hugging Face hub "
        "id (ORG/NAME)",
    ]
    assert preflight.environment_problems(good(files, "actor_rollout_ref.model.path=Qwen/Qwen3-1.7B-Base")) == []
    (line,) = preflight.environment_problems(good(files, f"actor_rollout_ref.model.path={tmp_path}"))
    assert line.endswith("no config.json in it; pass a Hugging Face model folder")


def fake_checkpoint(folder, world=1, missing=()):
    actor = folder / "actor"
    actor.mkdir(parents=True)
    names = [
        f"{kind}_world_size_{world}_rank_{r}.pt" for kind in ("model", "optim", "extra_state") for r in range(world)
    ]
    for name in [*names, "fsdp_config.json"]:
        if name not in missing:
            (actor / name).write_bytes(b"x")
    torch.save(dataloader_state(workers=0), folder / "data.pt")


def test_resume_problems(files, tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "local_gpus", lambda: 1)
    ckpt = tmp_path / "ckpt"

    def check(*overrides):
        return preflight.resume_problems(good(files, f"trainer.default_local_dir={ckpt}", *overrides))

    assert check() == []  # nothing saved yet
    fake_checkpoint(ckpt / "global_step_2")
    (line,) = check()
    assert "holds global_step_2 but no latest_checkpointed_iteration.txt, so verl would start from step 0" in line
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    tracker.write_text("")
    assert check() == [f"{tracker}: '' is not a step number; write the step of the newest complete global_step_N"]
    tracker.write_text("3")
    (line,) = check()
    assert "names step 3 but" in line and "verl would start from step 0 and overwrite" in line
    tracker.write_text("2")
    assert check() == [] and check("trainer.resume_mode=disable") == []
    (line,) = check("trainer.n_gpus_per_node=2")
    assert "is incomplete for 2 GPUs" in line and "it was saved as model_world_size_1: the GPU count changed" in line
    fake_checkpoint(ckpt / "global_step_4", missing=("optim_world_size_1_rank_0.pt",))
    tracker.write_text("4")
    (line,) = check()
    assert line.startswith(f"checkpoint {ckpt / 'global_step_4'} is incomplete for 1 GPU: 1 file(s) missing or empty")
    assert check("actor_rollout_ref.actor.checkpoint.save_contents=[model]") == []  # only what the run saves
    data = ckpt / "global_step_2" / "data.pt"
    tracker.write_text("2")
    torch.save(dataloader_state(workers=2), data)  # a run of verl's default, 8 workers (2 here)
    (line,) = check()
    assert line == (
        f"{data} was written by a dataloader with dataloader worker processes, which data.dataloader_num_workers=0 "
        "cannot restore; set data.dataloader_num_workers to a positive number, e.g. 8 (verl's default) to resume "
        "this run"
    )
    assert check("data.dataloader_num_workers=8") == []
    torch.save(dataloader_state(workers=0), data)
    (line,) = check("data.dataloader_num_workers=8")
    assert "without dataloader worker processes" in line and "set data.dataloader_num_workers to 0" in line
    data.write_bytes(b"x")
    (line,) = check()
    assert line == f"{data}: not a readable dataloader state (UnpicklingError); resume from an earlier global_step_N"
    (line,) = check("trainer.max_actor_ckpt_to_keep=1")
    assert line.startswith("trainer.max_actor_ckpt_to_keep=1: verl deletes the previous checkpoint")
    assert check("trainer.max_actor_ckpt_to_keep=1", "trainer.resume_mode=disable") == []


def test_the_entry_point_prints_one_line_per_problem_and_stops(files):
    """A launch on this CPU machine: seconds, one line per problem, no traceback, no Ray."""
    data = files / "data" / "aime24.parquet"
    out = subprocess.run(
        [sys.executable, "-m", "stapo.train", "--config-name=stapo", f"data.train_files={data}",
         f"data.val_files={files / 'absent.parquet'}", f"actor_rollout_ref.model.path={files / 'model'}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1 and "Traceback" not in out.stderr and "Started a local Ray" not in out.stderr
    assert errors[0].startswith("error: trainer.n_gpus_per_node=8 x trainer.nnodes=1 needs 8 GPUs")
    assert errors[1].startswith(f"error: data.val_files: {files / 'absent.parquet'}: no such file") and len(errors) == 2
    out = subprocess.run(
        [sys.executable, "-m", "stapo.train", "--config-name=stapo", "stapo.q=2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
        "error: stapo.q=2 is out of range; it must be a number in [0, 1] (paper: 0.75)"
    )
    assert "All configuration checks passed" not in out.stdout + out.stderr  # stops before verl's checks


def test_the_asynchronous_modes_are_checked_before_ray():
    """``stapo_separate_async``: verl 0.9.1 asserts its conditions only once the task runner builds the trainer (after
    Ray and the workers started); the preflight names each first, and counts the rollout's own GPUs. verl's bypass
    mode (no old-policy entropies) is refused with the driver's mask; ``stapo_colocate_async`` needs nothing more."""
    from stapo.train.main import ConfigError, validate

    assert validate(load("trainer.v1.trainer_mode=stapo_colocate_async"), environment=False).mask == "s2t"
    with pytest.raises(ConfigError) as refused:
        validate(load("trainer.v1.trainer_mode=stapo_separate_async"), environment=False)
    lines = str(refused.value).splitlines()
    assert len(lines) == 2 and lines[0].startswith("actor_rollout_ref.rollout.nnodes=0: separate_async generates")
    assert lines[1].startswith("actor_rollout_ref.rollout.checkpoint_engine.backend=naive")  # 256 = 4 x 64 fits
    fixed = ["trainer.v1.trainer_mode=stapo_separate_async", "actor_rollout_ref.rollout.nnodes=1"]
    fixed += ["actor_rollout_ref.rollout.n_gpus_per_node=2", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]
    validate(load(*fixed), environment=False)
    with pytest.raises(ConfigError, match="data.train_batch_size=128: separate_async trains a batch as"):
        validate(load(*fixed, "data.train_batch_size=128"), environment=False)
    gpus = preflight._gpu_problems(load(*fixed, "trainer.n_gpus_per_node=1"))
    assert gpus and "+ actor_rollout_ref.rollout.n_gpus_per_node=2 x nnodes=1" in gpus[0] and "needs 3 GPUs" in gpus[0]
    with pytest.raises(ConfigError, match="bypass_mode=True: verl then takes the rollout's log-probs as π_old"):
        validate(load("algorithm.rollout_correction.bypass_mode=True"), environment=False)


def test_rollouts_on_tape_need_determinism_and_a_recording(files, monkeypatch, tmp_path):
    """stapo.record_rollouts / replay_rollouts key each response by its request's seed: without determinism=full the
    run is refused, as is a replay of a folder without a recording or a record folder that cannot be written; both
    keys at once are refused by the stapo block's own check."""
    monkeypatch.setattr(preflight, "local_gpus", lambda: 1)
    tape = tmp_path / "tape"
    (line,) = preflight.config_problems(good(files, f"stapo.record_rollouts={tape}"))
    assert (
        line.startswith("stapo.record_rollouts keys each response by its request's seed") and "determinism=full" in line
    )
    assert preflight.config_problems(good(files, f"stapo.record_rollouts={tape}", "determinism=full")) == []
    assert preflight.environment_problems(good(files, f"stapo.record_rollouts={tape}", "determinism=full")) == []
    (line,) = preflight.environment_problems(good(files, f"stapo.replay_rollouts={tape}", "determinism=full"))
    assert line == (
        f"stapo.replay_rollouts={tape}: no recording there (rollouts-*.jsonl); name the folder a run with "
        "stapo.record_rollouts wrote"
    )
    tape.mkdir()
    (tape / "rollouts-host-1.jsonl").write_text("")
    assert preflight.environment_problems(good(files, f"stapo.replay_rollouts={tape}", "determinism=full")) == []
    (blocker := tmp_path / "file").write_text("")
    (line,) = preflight.environment_problems(good(files, f"stapo.record_rollouts={blocker}", "determinism=full"))
    assert line.startswith(f"stapo.record_rollouts {blocker}: a file is in the way")
    with pytest.raises(preflight.StapoConfigError, match="are both set"):
        preflight.validate_training_config(
            good(files, f"stapo.record_rollouts={tape}", f"stapo.replay_rollouts={tape}", "determinism=full")
        )


def test_determinism_needs_the_recipes_vllm_plugin(files, monkeypatch):
    """determinism=full with the package's vLLM plugin installed (this environment's entry point) passes; with
    VLLM_PLUGINS leaving it out, or without the entry point, one line says how to get it; without determinism the
    plugin is not asked for."""
    import importlib.metadata

    monkeypatch.setattr(preflight, "local_gpus", lambda: 1)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    full = good(files, "determinism=full")
    assert preflight.environment_problems(full) == []
    monkeypatch.setenv("VLLM_PLUGINS", "someone_else")
    (line,) = preflight.environment_problems(full)
    assert line.startswith("VLLM_PLUGINS='someone_else' leaves out the recipe's vLLM plugin stapo_rms_norm")
    assert line.endswith("add it (VLLM_PLUGINS=someone_else,stapo_rms_norm) or unset VLLM_PLUGINS")
    assert preflight.environment_problems(good(files)) == []
    monkeypatch.setenv("VLLM_PLUGINS", "someone_else,stapo_rms_norm")
    assert preflight.environment_problems(full) == []
    found = importlib.metadata.entry_points
    monkeypatch.setattr(
        preflight, "entry_points", lambda group: [] if group == "vllm.general_plugins" else found(group=group)
    )
    (line,) = preflight.environment_problems(full)
    assert line.startswith("determinism=full: the package's vLLM plugin stapo_rms_norm is not installed")
