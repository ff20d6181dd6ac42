"""Runs longer than their job (stapo.train.deadline, issue 62): the deadline's arithmetic and sources, the stop files,
the driver's signals (also while it waits in ``ray.get``), the recipe trainer's stop inside verl's real ``fit`` loop
in all three trainer modes, and the exit status through scripts/train.sh.

Stand-ins, as everywhere in the suite: in the ``fit`` tests, the parts of a step that need GPUs (verl's ``step``,
``_compute_metrics``, the workers' checkpoint, the rollout's weight update); in the train.sh tests, verl's trainer
(tests/standins.py ``train``, which stops with the recipe's own :mod:`stapo.train.deadline` code)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import standins
from omegaconf import OmegaConf

from stapo.config import StapoConfigError, parse_deadline
from stapo.quickstart.run import build
from stapo.train import deadline
from stapo.train.deadline import StepClock, find_deadline, must_stop, slurm_end
from stapo.train.preflight import validate_training_config
from stapo.train.trainer import STAPOMixin

ROOT = Path(__file__).resolve().parents[1]
HOUR = 3600.0


# ---- the arithmetic -----------------------------------------------------------------------------------------------


def test_a_step_and_a_save_that_fit_go_on_and_those_that_do_not_stop():
    assert not must_stop(now=0, deadline=1000, longest_step=600, longest_save=300, margin=60)  # 960 <= 1000
    assert must_stop(now=0, deadline=1000, longest_step=600, longest_save=300, margin=120)  # 1020 > 1000
    assert must_stop(now=500, deadline=1000, longest_step=300, longest_save=10, margin=200)  # 510 > 500


def test_a_save_longer_than_a_step_counts_in_full():
    assert must_stop(now=0, deadline=700, longest_step=100, longest_save=650, margin=0)
    assert not must_stop(now=0, deadline=700, longest_step=100, longest_save=500, margin=0)


def test_before_any_save_a_save_is_guessed_as_verl_guesses():
    guess = deadline.SAVE_GUESS_S
    assert must_stop(now=0, deadline=100 + guess - 1, longest_step=100, longest_save=0, margin=0)
    assert not must_stop(now=0, deadline=100 + guess + 1, longest_step=100, longest_save=0, margin=0)


def test_a_deadline_in_the_past_stops_at_the_first_step_end():
    clock = StepClock(deadline=1000.0, margin=0)
    clock.began(2000.0)
    assert "deadline is -1005 s away" in clock.ended(2005.0)


def test_no_deadline_never_stops_and_nothing_stops_before_a_step_began():
    clock = StepClock(deadline=None, margin=60)
    clock.began(0.0)
    assert clock.ended(1e9) is None
    assert StepClock(deadline=10.0, margin=0).ended(1e9) is None


def test_the_clock_counts_the_longest_whole_step_and_the_step_under_way():
    clock = StepClock(deadline=621.0, margin=0)
    for now in (0.0, 100.0, 300.0, 350.0):  # whole steps of 100, 200 and 50 s; the fourth began at 350
        clock.began(now)
    assert clock.longest_step == 200
    clock.saved(30.0)
    clock.saved(20.0)
    assert clock.longest_save == 30
    assert clock.ended(390.0) is None  # 231 s left >= the 200 s step + 30 s save (+ 0 margin)
    assert "229 s away, less than a 200.0 s step, 30 s save" in clock.ended(392.0)
    # a step under way that already took longer than every whole step counts as far as it went
    assert "less than a 250.0 s step" in clock.ended(600.0)


# ---- where the deadline comes from ----------------------------------------------------------------------------------


def test_stapo_deadline_is_seconds_from_the_launch_or_a_time():
    assert parse_deadline(86000, start=1000.0) == 87000.0
    assert parse_deadline("90.5", start=10.0) == 100.5
    utc = datetime(2026, 12, 7, 9, 30, tzinfo=timezone.utc)
    assert parse_deadline("2026-12-07T09:30:00+00:00", 0) == utc.timestamp()
    assert parse_deadline("2026-12-07T09:30", 0) == datetime(2026, 12, 7, 9, 30).timestamp()  # local time
    for bad in ("tomorrow", -1, float("nan"), True):
        with pytest.raises(StapoConfigError, match="stapo.deadline="):
            parse_deadline(bad, 0)


def fake_squeue(stdout, calls=None):
    def run(cmd, **kwargs):
        if calls is not None:
            calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=stdout, stderr="")

    return run


def test_slurms_end_time_from_its_variable_else_from_squeue(monkeypatch, tmp_path):
    soon = time.time() + HOUR
    assert slurm_end({"SLURM_JOB_END_TIME": str(int(soon)), "SLURM_JOB_ID": "7"}) == int(soon)
    squeue = tmp_path / "squeue"  # on PATH, so that the lookup is tried; the call itself is faked
    squeue.write_text("#!/bin/sh\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    when = datetime.fromtimestamp(int(soon)).isoformat()  # squeue's %e: local time
    calls = []
    assert slurm_end({"SLURM_JOB_ID": "7"}, fake_squeue(when + "\n", calls)) == int(soon)
    assert calls == [["squeue", "-h", "-j", "7", "-o", "%e"]]
    assert slurm_end({"SLURM_JOB_ID": "7"}, fake_squeue("NONE\n")) is None  # a job without a time limit
    far = datetime.fromtimestamp(time.time() + 5 * 366 * 86400).isoformat(timespec="seconds")
    assert slurm_end({"SLURM_JOB_ID": "7"}, fake_squeue(far)) is None
    assert slurm_end({}) is None  # not in a job


def test_the_first_source_found_wins():
    env = {
        "SLURM_JOB_END_TIME": str(int(time.time() + HOUR)),
        "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP": "1900000000",
        "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP": "1800000000",
    }
    assert find_deadline(600, env, start=5.0) == (605.0, "stapo.deadline")
    assert find_deadline("", env, 0)[1] == "the Slurm job's end time"
    del env["SLURM_JOB_END_TIME"]
    assert find_deadline("", env, 0) == (1.9e9, "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP")
    env["MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"] = "not a time"
    assert find_deadline(None, env, 0) == (1.8e9, "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP")
    assert find_deadline("", {}, 0) is None


# ---- the stop files and the driver's signals -------------------------------------------------------------------


def test_a_request_is_written_once_and_cleared_with_the_answer(tmp_path):
    folder = tmp_path / "ckpt"
    assert deadline.requested(folder) is None
    assert deadline.request(folder, "SIGUSR1 at noon") and not deadline.request(folder, "SIGTERM")
    assert deadline.requested(folder) == "SIGUSR1 at noon"
    deadline.answer(folder, 7, "SIGUSR1 at noon")
    assert deadline.clear(folder) == {"step": 7, "reason": "SIGUSR1 at noon"}
    assert sorted(folder.iterdir()) == [] and deadline.clear(folder) is None


ARMED = """
import sys, time
from pathlib import Path
from stapo.train import deadline
deadline.arm()
print("armed", flush=True)
time.sleep(float(sys.argv[2]))  # a signal now is kept until the folder is known
deadline.arm(Path(sys.argv[1]))
print("watching", flush=True)
time.sleep(60)
"""


def started(tmp_path, script, *args):
    path = tmp_path / "driver.py"
    path.write_text(script)
    process = subprocess.Popen([sys.executable, str(path), *map(str, args)], stdout=subprocess.PIPE, text=True)
    return process


def test_sigusr1_and_a_first_sigterm_ask_for_a_save_and_a_second_sigterm_ends_the_driver(tmp_path):
    folder = tmp_path / "ckpt"
    driver = started(tmp_path, ARMED, folder, 0)
    assert driver.stdout.readline() == "armed\n" and driver.stdout.readline() == "watching\n"
    driver.send_signal(signal.SIGUSR1)
    for _ in range(100):
        if deadline.requested(folder):
            break
        time.sleep(0.05)
    assert deadline.requested(folder).startswith("SIGUSR1 at ")
    driver.send_signal(signal.SIGTERM)  # the first: a request (one is there already), not the end
    time.sleep(0.5)
    assert driver.poll() is None
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(10) == 128 + signal.SIGTERM


def test_a_signal_before_the_folder_is_known_is_kept_until_it_is(tmp_path):
    folder = tmp_path / "ckpt"
    driver = started(tmp_path, ARMED, folder, 1.5)
    assert driver.stdout.readline() == "armed\n"
    driver.send_signal(signal.SIGUSR1)
    assert driver.stdout.readline() == "watching\n"
    assert deadline.requested(folder).startswith("SIGUSR1 at ")
    driver.kill()
    driver.wait()


WAITING_IN_RAY = """
import sys, time
from pathlib import Path
import ray
from stapo.train import deadline
folder = Path(sys.argv[1])
deadline.arm()
deadline.arm(folder)
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)

@ray.remote
def trainer(folder):  # stands for verl's TaskRunner: it reads the request at a step's end
    while deadline.requested(folder) is None:
        time.sleep(0.1)
    deadline.answer(folder, 4, deadline.requested(folder))
    return "stopped"

ref = trainer.remote(folder)
print("waiting", flush=True)
print(ray.get(ref), flush=True)  # run_ppo's ray.get(runner.run.remote(config))
ray.shutdown()
"""


def test_the_driver_takes_a_signal_while_it_waits_in_ray_get(tmp_path, foreign_ray_ignored):
    """verl's driver spends the run in ``ray.get``: Ray's core worker checks for signals there, so the handler runs
    and the trainer in its Ray worker sees the request."""
    folder = tmp_path / "ckpt"
    driver = started(tmp_path, WAITING_IN_RAY, folder)
    assert driver.stdout.readline() == "waiting\n"
    time.sleep(2)  # well inside ray.get
    driver.send_signal(signal.SIGUSR1)
    assert driver.stdout.readline() == "stopped\n" and driver.wait(60) == 0
    assert deadline.clear(folder)["step"] == 4
    foreign_ray_ignored()


IN_RUN_PPO = """
import sys, time
from pathlib import Path
import ray
from hydra import compose, initialize_config_dir
from stapo.config import CONFIG_DIR
from stapo.train import deadline
from stapo.train.main import ArmedRunner, finish_stop, prepare_stop
from verl.trainer.main_ppo import run_ppo

@ray.remote
class StandInRunner:  # verl's TaskRunnerV1 needs GPUs; it reads the request at a step's end
    def run(self, config):
        folder = Path(config.trainer.default_local_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "started").touch()
        while deadline.requested(folder) is None:
            time.sleep(0.1)
        deadline.answer(folder, 9, deadline.requested(folder))

deadline.arm()  # as main() does
with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
    config = compose("stapo", [f"trainer.default_local_dir={sys.argv[1]}", "ray_kwargs.ray_init.num_cpus=1",
                               "+ray_kwargs.ray_init.include_dashboard=False"])
folder = prepare_stop(config, deadline.launched_at())
run_ppo(config, task_runner_class=ArmedRunner(StandInRunner))  # verl's own: ray.init, the runner, ray.get
finish_stop(config, folder)
"""


def test_sigterm_asks_for_a_save_also_after_verls_ray_init(tmp_path, foreign_ray_ignored):
    """verl's ``run_ppo`` starts Ray in the driver, and Ray's ``ray.init`` and local node replace the driver's SIGTERM
    handler with their own, which end the run at once (without :class:`ArmedRunner`: killed, -6); the recipe arms
    its own again when the runner is created."""
    folder = tmp_path / "ckpt"
    driver = started(tmp_path, IN_RUN_PPO, folder)
    for _ in range(1200):
        if (folder / "started").exists() or driver.poll() is not None:
            break
        time.sleep(0.1)
    assert (folder / "started").exists(), driver.stdout.read()
    driver.send_signal(signal.SIGTERM)
    out = driver.stdout.read()
    assert driver.wait(60) == deadline.RESUME_EXIT, out
    assert f"STAPO: saved step 9 in {folder} (SIGTERM at " in out and "run the same command to resume" in out
    assert not (folder / deadline.REQUEST_FILE).exists() and not (folder / deadline.SAVED_FILE).exists()
    foreign_ray_ignored()


# ---- the recipe trainer's stop in verl's real fit loop ------------------------------------------------------------


def fit_config(tmp_path, mode, steps, save_freq, *extra):
    from hydra import compose, initialize_config_dir

    from stapo.config import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(
            "stapo",
            [
                f"trainer.v1.trainer_mode={mode}",
                f"trainer.total_training_steps={steps}",
                f"trainer.save_freq={save_freq}",
                "trainer.test_freq=2",
                "trainer.val_before_train=False",
                'trainer.logger=["file"]',
                f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                *extra,
            ],
        )


class Run:
    """verl's real ``fit`` of a recipe trainer, with the GPU parts of a step stood in (module docstring): records
    each step's place in the loop (step, save, validation), and each logged line."""

    def __init__(self, tmp_path, monkeypatch, mode, steps=5, save_freq=-1, request_during=None, *extra):
        from types import SimpleNamespace

        import torch
        import transfer_queue as tq
        from tensordict import TensorDict
        from transfer_queue import KVBatchMeta
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer, get_trainer_cls

        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
        config = fit_config(tmp_path, mode, steps, save_freq, *extra)
        cls = get_trainer_cls(mode)
        trainer = cls.__new__(cls)  # as tests/test_trainer_hook.py: __init__ would build a replay buffer on Ray
        trainer.config, trainer.trainer_mode, trainer.parameter_sync_step = config, mode.removeprefix("stapo_"), 1
        trainer.stapo = validate_training_config(config)
        trainer._clock = StepClock.of(trainer.stapo.deadline, trainer.stapo.deadline_margin, time.time())
        trainer._stop_reason = None  # what STAPOMixin.__init__ sets
        trainer.global_steps, trainer.total_training_steps, trainer.steps_per_epoch = 0, steps, 100
        trainer.use_critic = trainer.use_reference_policy = False
        trainer._init_dump_executor()  # what _setup does
        self.events, self.folder = [], tmp_path / "ckpt"
        events = self.events

        def step(self_, metrics, timing_raw):
            events.append(("step", self_.global_steps))
            if self_.global_steps == request_during:
                deadline.request(self.folder, "SIGUSR1 at noon")
            metrics["actor/entropy"] = 1.0 / self_.global_steps
            key = [f"{tmp_path.name}-{self_.global_steps}"]  # what fit clears from TransferQueue after the step
            tq.kv_batch_put(keys=key, partition_id="train", fields=TensorDict({"x": torch.zeros(1, 1)}, batch_size=[1]))
            return KVBatchMeta(partition_id="train", keys=key, tags=[{}])

        def save(self_):
            events.append(("save", self_.global_steps))
            time.sleep(0.01)

        monkeypatch.setattr(cls, "step", step)
        monkeypatch.setattr(PPOTrainer, "_save_checkpoint", save)
        monkeypatch.setattr(cls, "_validate", lambda self_: events.append(("validate", self_.global_steps)) or {"v": 1})
        monkeypatch.setattr(cls, "_compute_metrics", lambda *a, **k: None)
        monkeypatch.setattr(cls, "_add_async_warmup_batches", lambda *a: None)  # needs the dataloader
        trainer.checkpoint_manager = SimpleNamespace(update_weights=lambda step: None,
                                                     resume_generation_replicas=lambda: None)  # fmt: skip
        if mode == "stapo_separate_async":  # its hybrid engine's mode switches need the rollout replicas
            verl_cls = cls.__mro__[cls.__mro__.index(STAPOMixin) + 1]
            monkeypatch.setattr(verl_cls, "on_step_begin", lambda self_: None)
            monkeypatch.setattr(verl_cls, "on_validate_begin", lambda self_: None)
            trainer.hybrid_rollout_config = SimpleNamespace(enable_switch=False)
            trainer.prev_step_profile = False
            trainer.standalone_checkpoint_manager = trainer.checkpoint_manager
        self.trainer = trainer

    def fit(self):
        self.trainer.fit(agent_loop_manager=None)
        lines = [json.loads(line) for line in (self.folder.parent / "metrics.jsonl").read_text().splitlines()]
        return [line["step"] for line in lines]


MODES = ["stapo_sync", "stapo_colocate_async", "stapo_separate_async"]


@pytest.mark.parametrize("mode", MODES)
def test_without_a_deadline_or_a_signal_fit_runs_as_verls(tmp_path, monkeypatch, transfer_queue, mode):
    run = Run(tmp_path, monkeypatch, mode, 5, 2)
    assert run.fit() == [1, 2, 3, 4, 5]
    saves = [step for kind, step in run.events if kind == "save"]
    assert saves == [2, 4, 5] and deadline.clear(run.folder) is None  # verl's save_freq and the last step only


@pytest.mark.parametrize("mode", MODES)
def test_a_request_saves_after_the_step_logs_it_and_stops_before_the_next(tmp_path, monkeypatch, transfer_queue, mode):
    run = Run(tmp_path, monkeypatch, mode, 6, 4, 3)
    assert run.fit() == [1, 2, 3]  # step 3's line is logged; step 4 never begins
    assert run.events == [("step", 1), ("step", 2), ("validate", 2), ("step", 3), ("save", 3)]
    assert deadline.clear(run.folder) == {"step": 3, "reason": "SIGUSR1 at noon"}


def test_a_step_verl_saved_itself_is_not_saved_twice(tmp_path, monkeypatch, transfer_queue):
    run = Run(tmp_path, monkeypatch, "stapo_sync", 6, 2, 2)
    assert run.fit() == [1, 2]
    assert [e for e in run.events if e[0] == "save"] == [("save", 2)]


def test_a_request_at_the_last_step_changes_nothing(tmp_path, monkeypatch, transfer_queue):
    run = Run(tmp_path, monkeypatch, "stapo_sync", 3, -1, 3)
    assert run.fit() == [1, 2, 3]
    assert [e for e in run.events if e[0] == "save"] == [] and "step" not in (deadline.clear(run.folder) or {})


def test_a_deadline_that_the_next_step_would_pass_saves_and_stops(tmp_path, monkeypatch, transfer_queue):
    """Steps of ~0.3 s, a save guessed at 60 s, a deadline 61.5 s after the trainer starts: after the first step, with
    ~61.2 s left, the second still fits (0.3 + 60 + 0); about four steps later, no longer."""
    run = Run(tmp_path, monkeypatch, "stapo_sync", 20, -1, None, "stapo.deadline=61.5", "stapo.deadline_margin=0")
    original = run.trainer.__class__.step

    def paced(self_, metrics, timing_raw):
        time.sleep(0.3)
        return original(self_, metrics, timing_raw)

    monkeypatch.setattr(run.trainer.__class__, "step", paced)
    steps = run.fit()
    stopped = deadline.clear(run.folder)
    assert 1 < stopped["step"] < 20 and steps == list(range(1, stopped["step"] + 1))
    assert "deadline is" in stopped["reason"] and "a 0.3 s step, a save (guessed 60 s)" in stopped["reason"]
    saves = [step for kind, step in run.events if kind == "save"]
    assert saves == [stopped["step"]] and run.events.index(("save", saves[0])) > run.events.index(("step", saves[0]))


@pytest.fixture(scope="module")
def transfer_queue():
    import ray
    import transfer_queue as tq

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 100}}}))
    yield
    tq.close()
    ray.shutdown()


# ---- the exit status through scripts/train.sh, with the stand-in trainer -------------------------------------------


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    _, paths, model = build(tmp_path_factory.mktemp("deadline"), 0, 48, 8, hidden_size=32, num_layers=1)
    return model, paths


def python_standing_in(folder) -> Path:
    """A ``python`` for scripts/train.sh (``PYTHON``) that runs tests/standins.py ``train`` for ``-m stapo.train``."""
    wrapper = folder / "python"
    wrapper.write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = -m ] && [ "$2" = stapo.train ]; then shift 2; exec {sys.executable} {standins.HERE} train "$@"; fi
        exec {sys.executable} "$@"
        """)
    )
    wrapper.chmod(0o755)
    return wrapper


def train_sh(tmp_path, task, *extra, step_s="1"):
    model, paths = task
    cmd = ["bash", str(ROOT / "scripts" / "train.sh"), "stapo", "smollm2_135m",
           f"actor_rollout_ref.model.path={model}", f"data.train_files={paths['train']}",
           f"data.val_files={paths['validation']}", "trainer.total_training_steps=6", "trainer.save_freq=-1",
           "trainer.test_freq=-1", "trainer.val_before_train=False", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
           *extra]  # fmt: skip
    env = {**os.environ, "PYTHON": str(python_standing_in(tmp_path)), "STANDIN_STEP_S": step_s,
           "VERL_FILE_LOGGER_PATH": str(tmp_path / "metrics.jsonl")}  # fmt: skip
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def logged_steps(tmp_path):
    from stapo.tools.curves import read_metrics

    return sorted(read_metrics(tmp_path / "metrics.jsonl")["actor/entropy"])


def test_sigusr1_through_train_sh_saves_exits_3_and_the_same_command_resumes(tmp_path, task):
    run = train_sh(tmp_path, task)
    for line in run.stdout:
        if line.startswith("step:2 "):
            run.send_signal(signal.SIGUSR1)  # train.sh execs the trainer: the signal reaches it
            break
    out = run.stdout.read()
    assert run.wait(120) == deadline.RESUME_EXIT, out
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert saved in (2, 3) and f"STAPO: saved step {saved} in {tmp_path / 'ckpt'} (SIGUSR1 at " in out
    assert "run the same command to resume from it" in out and logged_steps(tmp_path) == list(range(1, saved + 1))
    again = train_sh(tmp_path, task, step_s="0")
    out = again.stdout.read()
    assert again.wait(120) == 0, out
    assert f"step:{saved} " not in out and f"step:{saved + 1} " in out  # resumed after the saved step
    assert logged_steps(tmp_path) == [1, 2, 3, 4, 5, 6]
    assert not (tmp_path / "ckpt" / deadline.REQUEST_FILE).exists()


def test_a_deadline_closer_than_a_step_and_a_save_stops_at_the_first_step_through_train_sh(tmp_path, task):
    run = train_sh(tmp_path, task, "stapo.deadline=40", step_s="0")
    out = run.stdout.read()
    assert run.wait(120) == deadline.RESUME_EXIT, out
    assert "STAPO: deadline " in out and "(stapo.deadline)" in out and "saved step 1 in" in out
    assert logged_steps(tmp_path) == [1]


@pytest.mark.parametrize(
    "override, line",
    [
        ("stapo.deadline=2020-01-01T00:00", "error: stapo.deadline has passed already (2020-01-01T00:00:00"),
        ("trainer.resume_mode=disable", "trainer.resume_mode=disable: the same command would not resume from the save"),
        ("actor_rollout_ref.actor.checkpoint.async_save=True", "async_save=True: the save must be on disk before"),
    ],
)
def test_a_deadline_the_run_could_not_save_before_and_resume_from_is_refused_before_any_step(tmp_path, task, override,
                                                                                             line):  # fmt: skip
    """stapo.deadline set by hand: refused in one line before Ray (a past one would make every requeued segment start
    up, train one step and stop); the same from the Slurm job's end is not acted on, with a line saying why."""
    extra = [override] if override.startswith("stapo.deadline") else ["stapo.deadline=3600", override]
    run = train_sh(tmp_path, task, *extra, step_s="0")
    out = run.stdout.read()
    assert run.wait(120) != 0 and line in out and "step:1" not in out, out


def test_ray_job_sh_turns_a_signal_into_a_stop_and_exits_3_and_the_same_command_resumes(tmp_path, task):
    """scripts/ray_job.sh against a real Ray head (its dashboard, its job supervisor): SIGUSR1 to the script stops the
    job with ``ray job stop``, whose SIGTERM the training takes as a request to save (Ray waits STAPO_STOP_WAIT_S for
    it, not its 3 s); the script exits 3; the same command resumes. The head runs with the stand-in ``python3`` first
    on its PATH, so the job's ``python3 -m stapo.train`` is the stand-in trainer."""
    import socket

    def free_port():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python_standing_in(bin_dir).rename(bin_dir / "python3")
    port, dash, agent, client = free_port(), free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "STANDIN_STEP_S": "2",
        "VERL_FILE_LOGGER_PATH": str(tmp_path / "metrics.jsonl"),
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="rj", dir="/tmp"),
    }  # fmt: skip (short: Ray's socket paths)
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dash}", "--num-cpus=2",
         f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}", "--num-gpus=0"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    model, paths = task
    cmd = ["bash", str(ROOT / "scripts" / "ray_job.sh"), "stapo", "smollm2_135m",
           f"actor_rollout_ref.model.path={model}", f"data.train_files={paths['train']}",
           f"data.val_files={paths['validation']}",
           "trainer.total_training_steps=6", "trainer.save_freq=-1", "trainer.test_freq=-1",
           "trainer.val_before_train=False", f"trainer.default_local_dir={tmp_path / 'ckpt'}"]  # fmt: skip
    job_env = {**os.environ, "RAY_ADDRESS": f"http://127.0.0.1:{dash}", "RAY_AUTH_MODE": "disabled"}
    try:
        for _ in range(120):
            if subprocess.run(["curl", "-sf", "-m", "2", f"http://127.0.0.1:{dash}/api/version"],
                              capture_output=True).returncode == 0:  # fmt: skip
                break
            time.sleep(1)
        run = subprocess.Popen(cmd, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = []
        for line in run.stdout:
            seen.append(line)
            if line.startswith("step:2 "):
                run.send_signal(signal.SIGUSR1)
                break
        out = "".join(seen) + run.stdout.read()
        assert run.wait(180) == deadline.RESUME_EXIT, out
        saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
        assert "stapo: USR1 received; stopping job stapo-" in out and f"STAPO: saved step {saved} in " in out
        assert "(SIGTERM at " in out and 2 <= saved < 6 and logged_steps(tmp_path) == list(range(1, saved + 1))
        again = subprocess.run(cmd, env=job_env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout[-3000:]
        assert logged_steps(tmp_path) == [1, 2, 3, 4, 5, 6] and f"step:{saved} " not in again.stdout
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(60)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
