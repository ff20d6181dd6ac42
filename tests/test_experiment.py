"""The multi-seed experiment (stapo.quickstart.experiment) on the CPU: the run plan, each run's Hydra overrides
composed and validated against verl's and the recipe's configs, the checks before any work, and the summary (table
and curves) from metrics written by verl's own FileLogger. The training runs themselves need GPUs
(docs/experiments.md)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
from hydra import compose, initialize_config_dir
from verl.utils.tracking import FileLogger

from stapo.config import CONFIG_DIR
from stapo.quickstart import experiment as ex
from stapo.train import clusters, preflight
from stapo.train.main import validate


def test_plan_is_seed_major_with_the_methods_reversed_at_every_other_seed():
    runs = ex.plan(["justrl", "stapo", "grpo"], [0, 1, 2])
    assert [r.name for r in runs[:4]] == ["justrl-s0", "stapo-s0", "grpo-s0", "grpo-s1"] and len(set(runs)) == 9
    positions = {m: sum(i for i, r in enumerate(runs[:6]) if r.method == m) for m in ("justrl", "stapo", "grpo")}
    assert len(set(positions.values())) == 1  # over two seeds, no method starts earlier on average


def test_the_learning_rate_sweep_runs_beside_the_grid_as_rows_of_its_own(tmp_path, monkeypatch):
    runs = ex.plan(["justrl", "stapo"], [0, 1], sweep_lrs=[1e-6, 2e-5])
    assert [r.name for r in runs[4:]] == ["justrl_lr1e-06-s0", "justrl_lr2e-05-s0"] and runs[5].method == "justrl"
    for name in ("justrl-s0", "justrl_lr2e-05-s0"):  # the summary reads each as a method of its own
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {"critic/score/mean": 0.5}}) + "\n")
    assert sorted(ex.read_runs(tmp_path)) == ["justrl", "justrl_lr2e-05"]
    monkeypatch.setattr(ex.torch.cuda, "device_count", lambda: 0)
    args = ex.build_parser().parse_args(["run", "--out", str(tmp_path), "--sweep-lrs", "1e-6", "1e-6"])
    with pytest.raises(SystemExit, match="--sweep-lrs"):
        ex.check_run_args(args)


STUB = """
import sys, time
print("driver from", time.time(), flush=True)
import os, ray
ray.init(log_to_driver=False)  # RAY_ADDRESS: the run's cluster
@ray.remote(num_gpus=1)
def hold(seconds):
    time.sleep(seconds)
    return os.environ["CUDA_VISIBLE_DEVICES"]
context = ray.get_runtime_context()
gpu = ray.get(hold.remote(float(sys.argv[1])))
print("job", context.get_job_id(), "cluster", context.gcs_address, "gpu", gpu, flush=True)
print("driver to", time.time(), flush=True)
sys.exit(int(sys.argv[2]))
"""


def test_launch_runs_each_run_in_a_cluster_of_its_own(tmp_path, monkeypatch, foreign_ray_ignored):
    """A stub stands in for the training command (verl's trainer needs GPUs); the Ray clusters are real, each with
    one GPU declared to Ray (``ray start --num-gpus=1``), as the experiment starts them on a GPU machine. Runs at the
    same time must not share a cluster (verl's TransferQueue) nor a Ray job id (verl's weight-transfer socket)."""
    monkeypatch.setattr(clusters, "HANDOVER_S", 2.0)
    runs = [ex.Run(method, seed) for seed in (0, 1) for method in ("justrl", "stapo")]  # this start order
    runs.append(ex.Run("grpo", 0))
    finished = tmp_path / "runs" / "grpo-s0"
    finished.mkdir(parents=True)
    (finished / "exit_code").write_text("0\n")  # a run finished before is kept, not started again
    script = tmp_path / "stub.py"
    script.write_text(STUB)

    def command(run):
        if run.name == "stapo-s1":  # hangs silently, as a run whose weight hand-over never completes
            return [sys.executable, "-c", "import time; time.sleep(600)"]
        return [sys.executable, str(script), "25", "1" if run.name == "stapo-s0" else "0"]  # > a cluster start

    codes = clusters.launch(runs, command, ["0", "1"], tmp_path, stall_s=40)  # > the stub's silence
    assert codes == {"grpo-s0": 0, "justrl-s0": 0, "stapo-s0": 1, "justrl-s1": 0, "stapo-s1": -9}  # -9: stalled
    logs = {r.name: (tmp_path / "runs" / r.name / "train.log").read_text() for r in runs[:3]}
    seen = {name: re.search(r"job (\w+) cluster (\S+) gpu (\w+)", log).groups() for name, log in logs.items()}
    # GPU slot s: this process connected s + 1 times before the run, whose driver is then job s + 2
    job = {slot: ray.JobID.from_int(slot + 2).hex() for slot in (0, 1)}
    assert seen["justrl-s0"][::2] == (job[0], "0") and seen["stapo-s0"][::2] == (job[1], "1")
    assert seen["justrl-s1"][::2] == (job[0], "0")  # the next run on GPU 0, in a fresh cluster
    assert len({cluster for _, cluster, _ in seen.values()}) == 3
    lives = [[float(re.search(rf"driver {edge} (\S+)", log)[1]) for edge in ("from", "to")] for log in logs.values()]
    overlapping = max(sum(start <= t < end for start, end in lives) for t, _ in lives)
    assert overlapping == 2  # the runs used both GPUs at once, and never ran more drivers than GPUs
    assert (tmp_path / "runs" / "stapo-s0" / "exit_code").read_text() == "1\n"
    assert (tmp_path / "runs" / "justrl-s0" / "ray.log").is_file()  # each run's cluster logs beside it
    assert not (tmp_path / "runs" / "grpo-s0" / "train.log").exists()
    foreign_ray_ignored("a run's Ray cluster was left running")  # and no address file a local ray.init() would read


TRAINING_OF_ITS_OWN = """
import os, subprocess, sys, time
trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(sys.argv[1] + ".tmp", "w").write(f"{os.getpid()} {trainer.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""
"""A run as ``stapo.checks.replay halt`` starts one: a wrapper, and below it a training in a session of its own."""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that nobody reaped yet does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_kill_tree_reaches_a_training_in_a_session_of_its_own(tmp_path):
    pids = tmp_path / "pids"
    run = subprocess.Popen([sys.executable, "-c", TRAINING_OF_ITS_OWN, str(pids)])
    deadline = time.monotonic() + 60
    while not pids.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    wrapper, trainer = map(int, pids.read_text().split())
    assert wrapper == run.pid and clusters.tree(run.pid) == [run.pid, trainer] and alive(trainer)
    clusters.kill_tree(run)
    assert run.returncode == -9
    deadline = time.monotonic() + 10  # the init process reaps the orphaned training
    while alive(trainer) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(trainer)


def test_a_stopped_launch_stops_what_its_runs_started(tmp_path, monkeypatch, foreign_ray_ignored):
    """The launcher stopped as scripts stop it (SystemExit from a SIGTERM handler, here SIGALRM's) while a run's
    wrapper has a training in a session of its own below it: the training goes too (a GPU node would keep it
    holding the GPU), and so does the run's Ray cluster. The cluster is real; the run is :data:`TRAINING_OF_ITS_OWN`,
    since verl's trainer needs a GPU."""
    pids = tmp_path / "pids"
    previous = signal.signal(signal.SIGALRM, lambda *_: sys.exit(143))
    monkeypatch.setattr(clusters, "POLL_S", 0.5)

    def stop_once_started():  # the signal reaches the main thread, in launch
        deadline = time.monotonic() + 120
        while not pids.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGALRM)

    command = [sys.executable, "-c", TRAINING_OF_ITS_OWN, str(pids)]
    threading.Thread(target=stop_once_started, daemon=True).start()
    try:
        with pytest.raises(SystemExit):
            clusters.launch([ex.Run("stapo", 0)], lambda run: command, ["0"], tmp_path, stall_s=600)
    finally:
        signal.signal(signal.SIGALRM, previous)
    trainer = int(pids.read_text().split()[1])
    deadline = time.monotonic() + 10
    while alive(trainer) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left := alive(trainer):
        os.kill(trainer, signal.SIGKILL)  # not to outlive the test
    assert not left, "the run's training outlived the launcher"
    foreign_ray_ignored("a run's Ray cluster was left running")


def test_runs_start_after_a_local_ray_run_left_its_auth_token(tmp_path, monkeypatch, foreign_ray_ignored):
    """A local ``ray.init()`` (a run of scripts/train.sh) writes ``~/.ray/auth_token``; Ray 2.60's ``ray start --head``
    then turns token auth on while its clients do not, and every cluster of the experiment refused its drivers (H200,
    2026-11-28). The launcher gives heads and clients one mode. The token is written by Ray itself, in a home of the
    test's own; the stub stands in for the training command (it needs GPUs)."""
    monkeypatch.setattr(clusters, "HANDOVER_S", 2.0)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    code = "import ray; ray.init(num_cpus=1, include_dashboard=False, logging_level='ERROR'); ray.shutdown()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120, capture_output=True)
    assert (tmp_path / ".ray" / "auth_token").is_file()
    script = tmp_path / "stub.py"
    script.write_text(STUB)
    codes = clusters.launch([ex.Run("stapo", 0)], lambda run: [sys.executable, str(script), "1", "0"], ["0"],
                            tmp_path, stall_s=60)  # fmt: skip
    assert codes == {"stapo-s0": 0}, (tmp_path / "runs" / "stapo-s0" / "ray.log").read_text()[-2000:]
    foreign_ray_ignored("a run's Ray cluster was left running")


def test_a_run_whose_cluster_cannot_start_fails_alone(tmp_path, monkeypatch, foreign_ray_ignored):
    """A run whose cluster does not number this process's job as planned, twice (on fresh heads), is recorded as
    failed; the run beside it trains on. The heads are real; the failure is forced in :func:`claim_job`."""
    claim = clusters.claim_job
    tries = []

    def claim_job(address, head, slot, log):
        if slot == 1:
            tries.append(address)
            raise SystemExit("error: forced")
        claim(address, head, slot, log)

    monkeypatch.setattr(clusters, "claim_job", claim_job)
    script = tmp_path / "stub.py"
    script.write_text(STUB)
    runs = ex.plan(["justrl", "stapo"], [0])
    codes = clusters.launch(runs, lambda run: [sys.executable, str(script), "1", "0"], ["0", "1"], tmp_path, stall_s=60)
    assert codes == {"justrl-s0": 0, "stapo-s0": 1} and len(set(tries)) == 2  # once more on another head
    assert (tmp_path / "runs" / "stapo-s0" / "exit_code").read_text() == "1\n"
    assert "job 02000000" in (tmp_path / "runs" / "justrl-s0" / "train.log").read_text()
    foreign_ray_ignored("a run's Ray cluster was left running")


def test_a_second_run_beside_a_running_cluster_is_refused(tmp_path, monkeypatch, foreign_ray_ignored):
    """Two local clusters on one machine share verl's weight-transfer socket, and two jobs of one cluster share
    verl's TransferQueue: the preflight refuses a local run beside a cluster, and a run given RAY_ADDRESS where a
    TransferQueue controller lives (an actor of that name stands in for a verl run's; the GPU count is stubbed: this
    machine has none). The run's cluster is a head over two GPUs, both declared to Ray."""
    monkeypatch.setattr(preflight, "local_gpus", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="justrl", overrides=["trainer.n_gpus_per_node=2"])
    assert preflight._gpu_problems(cfg) == []
    with clusters.ray_head("0,1", tmp_path / "ray.log") as (address, head):
        clusters.claim_job(address, head, 0, tmp_path / "ray.log")
        (line,) = preflight._gpu_problems(cfg)
        assert line.startswith("another Ray cluster runs on this machine (gcs_server, pid ")
        assert "/tmp/rl-colocate-zmq-01000000-replica-0-rank-0.sock" in line and "share verl's TransferQueue" in line
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert preflight._gpu_problems(cfg) == []  # the cluster has the two GPUs declared to it, and no verl run

        class Placeholder:  # defined here, so that Ray ships it by value to a worker that cannot import tests/
            def ready(self) -> bool:
                return True

        name, namespace = preflight.TQ_CONTROLLER
        ray.init(address=address, log_to_driver=False)
        controller = ray.remote(Placeholder).options(name=name, namespace=namespace).remote()
        ray.get(controller.ready.remote())
        (line,) = preflight._gpu_problems(cfg)
        assert line.startswith(f"RAY_ADDRESS={address}: a verl run is training on this cluster")
        ray.shutdown()  # the controller ends with its job, as a verl run's does
        for _ in range(20):
            if not preflight._gpu_problems(cfg):
                break
        else:
            pytest.fail("the cluster was still taken for busy after the controller's job ended")
    foreign_ray_ignored()


def test_the_preflight_looks_for_the_controller_that_transfer_queue_starts():
    import inspect

    import transfer_queue.interface

    name, namespace = preflight.TQ_CONTROLLER
    assert f'name="{name}", namespace="{namespace}"' in inspect.getsource(transfer_queue.interface)


@pytest.mark.parametrize("method", ["justrl", "stapo", "grpo", "entropy20"])
def test_run_overrides_compose_and_validate(method, tmp_path):
    args = ex.build_parser().parse_args(
        ["run", "--out", str(tmp_path), "--tau-p", "0.002", "--steps", "150", "--test-freq", "25", "--val-n", "4"]
    )
    paths = {"train": tmp_path / "train.parquet", "validation": tmp_path / "validation.parquet"}
    run = ex.Run(method, 7)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name=method, overrides=ex.run_overrides(run, tmp_path / "warmup", paths, args))
    stapo = validate(cfg, environment=False)
    assert (cfg.data.seed, cfg.actor_rollout_ref.rollout.seed) == (7, 7)
    assert (cfg.trainer.total_training_steps, cfg.trainer.test_freq, cfg.trainer.save_freq) == (150, 25, 50)
    assert cfg.trainer.val_before_train and cfg.actor_rollout_ref.rollout.val_kwargs.n == 4
    rollout = cfg.actor_rollout_ref.rollout
    assert not rollout.free_cache_engine and rollout.enable_prefix_caching  # verl clears the cache after each update
    assert rollout.log_prob_micro_batch_size_per_gpu == cfg.data.train_batch_size * rollout.n // 2
    assert cfg.data.train_batch_size == 32 and cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 8  # 4 mini-batches
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 8 * rollout.n  # one micro-batch each
    assert rollout.engine_kwargs.vllm.kv_cache_memory_bytes == ex.KV_CACHE_BYTES and rollout.agent.num_workers == 4
    assert cfg.trainer.experiment_name == f"experiment_{method}-s7"
    assert cfg.trainer.default_local_dir == str(tmp_path / "runs" / f"{method}-s7" / "ckpt")
    assert stapo.tau_p == 0.002 and stapo.metrics  # the s2t/* metrics observe the same rule in every method
    assert stapo.mask == {"stapo": "s2t", "entropy20": "top_entropy"}.get(method, "none")
    args = ex.build_parser().parse_args(["run", "--out", str(tmp_path), "--prompts", "64", "--save-freq", "0"])
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name=method, overrides=ex.run_overrides(run, tmp_path / "warmup", paths, args))
    validate(cfg, environment=False)
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.actor.ppo_mini_batch_size) == (64, 16)
    assert cfg.trainer.save_freq == -1  # no checkpoints


def test_bad_options_stop_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(ex.torch.cuda, "device_count", lambda: 0)  # as on this machine, also on a GPU machine
    out = tmp_path / "exp"
    for options, message in (
        (["--methods", "ppo"], "error: --methods: unknown ppo"),
        (["--seeds", "1", "1"], "error: --methods and --seeds must not repeat"),
        (["--steps", "0"], "error: --steps=0: must be a positive integer"),
        (["--runs-per-gpu", "0"], "error: --runs-per-gpu=0: must be a positive integer"),
        (["--save-freq", "-1"], "error: --save-freq=-1: must be a non-negative integer"),
        (["--prompts", "30"], "error: --prompts=30: must be a positive multiple of 4"),
        (["--tau-p", "0"], "error: --tau-p=0.0 is out of range"),
        (["--tokenizer", str(tmp_path)], f"error: --tokenizer={tmp_path}: no tokenizer_config.json"),
        ([], "error: the experiment trains with verl and needs CUDA GPUs"),
    ):
        with pytest.raises(SystemExit) as stop:
            ex.main(["run", "--out", str(out), *options])
        assert str(stop.value).startswith(message), stop.value
    assert not out.exists()


def test_runs_per_gpu_interleave_the_gpus(tmp_path, monkeypatch, foreign_ray_ignored):
    """``--runs-per-gpu 2`` over GPUs 0 and 1: four slots, the GPUs taken in turn (the runs start in that order, so
    three runs use both GPUs), named as CUDA_VISIBLE_DEVICES names them (the Ray heads are started with them)."""
    monkeypatch.setattr(ex.torch.cuda, "device_count", lambda: 2)  # stubbed: this machine has no GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    args = ex.build_parser().parse_args(["run", "--out", str(tmp_path), "--gpus", "0,1", "--runs-per-gpu", "2"])
    assert ex.check_run_args(args) == ["3", "5", "3", "5"]
    args = ex.build_parser().parse_args(["run", "--out", str(tmp_path), "--gpus", "1,1"])
    with pytest.raises(SystemExit, match="pass distinct indices"):  # two runs a GPU: --runs-per-gpu
        ex.check_run_args(args)


def test_overrides_reach_every_run_and_are_checked_first(tmp_path, monkeypatch):
    monkeypatch.setattr(ex.torch.cuda, "device_count", lambda: 0)
    argv = ["run", "--out", str(tmp_path), "--methods", "justrl", "stapo", "--"]
    engine = "actor_rollout_ref.rollout.free_cache_engine"
    args = ex.build_parser().parse_args([*argv, f"{engine}=True", "trainer.balance_batch=False"])
    paths = {"train": tmp_path / "train.parquet", "validation": tmp_path / "validation.parquet"}
    overrides = ex.run_overrides(ex.Run("stapo", 1), tmp_path / "warmup", paths, args)
    assert f"{engine}=True" in overrides and "trainer.balance_batch=False" in overrides
    assert f"{engine}=False" not in overrides
    for bad, message in (
        ("trainer.no_such_key=1", "error: --methods justrl with the overrides: "),
        ("stapo.top_entropy_ratio=2", "error: --methods justrl with the overrides: stapo.top_entropy_ratio=2"),
        ("free_cache_engine", "error: overrides free_cache_engine: write each as KEY=VALUE"),
        ("++data.seed=3", "error: override ++data.seed=3: data.seed is set for each run by --seeds"),
        (
            "trainer.default_local_dir=/tmp/x",
            "error: override trainer.default_local_dir=/tmp/x: trainer.default_local_dir",
        ),
        (
            "trainer.total_training_steps=9",
            "error: override trainer.total_training_steps=9: trainer.total_training_steps is set for each run by --st",
        ),
    ):
        with pytest.raises(SystemExit) as stop:
            ex.main([*argv, bad])
        assert str(stop.value).startswith(message), stop.value
    with pytest.raises(SystemExit, match="needs CUDA GPUs"):  # valid overrides pass the check
        ex.main([*argv, "actor_rollout_ref.rollout.free_cache_engine=True"])
    assert not tmp_path.joinpath("runs").exists()


def test_continuing_with_other_options_is_refused(tmp_path):
    args = ex.build_parser().parse_args(["run", "--out", str(tmp_path), "--warmup-steps", "300"])
    (tmp_path / "experiment.json").write_text(json.dumps({**ex.recorded_options(args), "warmup_steps": "200"}))
    with pytest.raises(SystemExit, match="other --warmup-steps"):
        ex.warm_model(args)
    (tmp_path / "experiment.json").write_text(json.dumps({**ex.recorded_options(args), "tau_p": "0.002"}))
    with pytest.raises(SystemExit, match="other --tau-p"):  # runs kept from before used another threshold
        ex.warm_model(args)
    (tmp_path / "experiment.json").write_text(json.dumps(ex.recorded_options(args)))
    with_override = ex.build_parser().parse_args(["run", "--out", str(tmp_path), "--", "trainer.balance_batch=False"])
    with pytest.raises(SystemExit, match="other overrides after '--'"):
        ex.warm_model(with_override)
    old = {k: v for k, v in ex.recorded_options(args).items() if k not in ("overrides", "prompts")}  # recorded
    (tmp_path / "experiment.json").write_text(json.dumps(old))  # before overrides and --prompts existed
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="other --prompts"):  # those runs had 64 prompts a step
        ex.warm_model(args)
    args.prompts = 64
    assert ex.warm_model(args) == tmp_path / "warmup"  # the same options: the model from before, no warm-up


def test_the_warm_up_is_rebuilt_to_the_recorded_weights(tmp_path):
    """An experiment continued on another machine carries its record and metrics, not its model: the warm-up runs
    again and must give the recorded weights (on the CPU here; the experiment does it on its first GPU)."""
    options = ["--train", "32", "--val", "8", "--hidden-size", "32", "--layers", "1", "--warmup-steps", "4"]
    args = ex.build_parser().parse_args(["run", "--out", str(tmp_path), *options, "--eval-problems", "2"])
    args.samples, args.warmup_target = 2, 0.0
    ex.warm_model(args, device="cpu")
    record = json.loads((tmp_path / "experiment.json").read_text())
    digest = record["weights_sha256"]
    assert record["warmup_rounds"] == 1 and len(record["warmup_low_prob_share"]) == 1  # target 0: one round
    assert 0 < record["warmup_low_prob_share"][0] <= 1
    shutil.rmtree(tmp_path / "warmup")
    ex.warm_model(args, device="cpu")  # rebuilt, and equal
    assert json.loads((tmp_path / "experiment.json").read_text())["weights_sha256"] == digest
    shutil.rmtree(tmp_path / "warmup")
    record = json.loads((tmp_path / "experiment.json").read_text())
    (tmp_path / "experiment.json").write_text(json.dumps({**record, "weights_sha256": "0" * 64}))
    with pytest.raises(SystemExit, match="the warm-up here gave other weights"):
        ex.warm_model(args, device="cpu")
    assert not (tmp_path / "warmup").exists()  # the other model is not left where a later call would take it


def test_tail_mass_is_the_chance_that_the_sampled_token_is_below_tau_p(tmp_path):
    """TailMass against the step scores that ``generate`` returns: at every step of every response that has not yet
    ended (its end-of-turn step included), the probability mass of the tokens below tau_p."""
    import torch
    from transformers import LogitsProcessorList

    from stapo.quickstart.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer(["12 + 7 = 19", "Please reason step by step"] * 20, tmp_path / "model")
    model = build_model(tokenizer, tmp_path / "model", hidden_size=32, num_layers=1)
    eos = tokenizer.eos_token_id
    model.lm_head.weight.data[eos] *= 40  # a random model that sometimes ends its responses early
    prompts = tokenizer(["12 + 7 =", "Please reason"], padding=True, padding_side="left", return_tensors="pt")
    tail = ex.TailMass(tau_p=0.002, eos_token_id=eos)
    torch.manual_seed(0)
    out = model.generate(
        **prompts,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=12,
        num_return_sequences=8,
        logits_processor=LogitsProcessorList([tail]),
        output_scores=True,
        return_dict_in_generate=True,
    )
    responses = out.sequences[:, prompts["input_ids"].shape[1] :]
    ended = (responses == eos).cumsum(dim=1)
    assert 0 < int((ended[:, -1] > 0).sum()) < len(responses)  # both kinds of response occur
    expected, real = [], []
    for step, scores in enumerate(out.scores):
        live = ended[:, step] - (responses[:, step] == eos).long() == 0  # no end-of-turn before this step
        probs = scores.float().softmax(dim=-1)
        expected.append(torch.where(live, (probs * (probs < 0.002)).sum(dim=-1), 0.0))
        real.append(live)
    expected, real = torch.stack(expected, dim=1), torch.stack(real, dim=1)
    assert torch.allclose(torch.stack(tail.mass, dim=1), expected)
    assert int(real.sum()) == int(((ended == 0) | ((ended == 1) & (responses == eos))).sum()) < real.numel()
    assert tail.share() == pytest.approx(float(expected.sum() / real.sum()))
    assert 0.01 < tail.share() < 0.99  # a random 512-token model puts much of its mass near 1/512
    rows = torch.tensor([True, False] * 8)  # the tokens of some responses only, over all sampled tokens
    assert tail.share(rows) == pytest.approx(float(expected[rows].sum() / real.sum()))
    assert 0 < tail.share(rows) < tail.share()


def test_warmup_only_stops_before_any_run(tmp_path, monkeypatch):
    """``run --warmup-only`` (the GPU check stubbed: this machine has none, and the warm-up runs on the CPU) writes
    the record of every round and starts no Ray cluster and no run."""
    warm = ex.warm_model
    monkeypatch.setattr(ex, "check_run_args", lambda args: ["0"])
    monkeypatch.setattr(ex, "warm_model", lambda args: warm(args, device="cpu"))
    monkeypatch.setattr(ex, "launch", lambda *a, **k: pytest.fail("--warmup-only launched runs"))
    options = ["--train", "32", "--val", "8", "--hidden-size", "32", "--layers", "1", "--warmup-steps", "4"]
    ex.main(["run", "--out", str(tmp_path), *options, "--eval-problems", "2", "--samples", "2", "--warmup-only"])
    assert json.loads((tmp_path / "experiment.json").read_text())["warmup_rounds"] >= 1
    assert not (tmp_path / "runs").exists()


def test_positive_advantage_is_a_score_above_the_group_mean():
    assert ex.positive_advantage([[1, 0, 0, 1], [1, 1, 1, 1], [0.5, 0, 0, 0]]).tolist() == [
        *(True, False, False, True),
        *(False, False, False, False),  # all equal: Â = 0, no candidates
        *(True, False, False, False),
    ]


def test_the_warm_up_goes_on_until_the_target_and_records_every_round(tmp_path, monkeypatch):
    """Below the target the warm-up runs more rounds (at most MAX_WARMUP_ROUNDS), records both shares of each round,
    and the saved model is the last round's (its digest is the recorded one)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(ex, "MAX_WARMUP_ROUNDS", 2)
    options = ["--train", "32", "--val", "8", "--hidden-size", "32", "--layers", "1", "--warmup-steps", "4"]
    args = ex.build_parser().parse_args(["run", "--out", str(tmp_path), *options, "--eval-problems", "2"])
    args.samples, args.warmup_target = 4, 1.0  # not reached by this model
    folder = ex.warm_model(args, device="cpu")
    record = json.loads((tmp_path / "experiment.json").read_text())
    assert record["warmup_rounds"] == 2
    assert len(record["warmup_low_prob_share"]) == len(record["warmup_candidate_share"]) == 2
    assert len(record["warmup_accuracy"]) == 2 and all(0 <= a <= 1 for a in record["warmup_accuracy"])
    assert all(0 <= c <= s for c, s in zip(record["warmup_candidate_share"], record["warmup_low_prob_share"]))
    assert ex.weights_digest(AutoModelForCausalLM.from_pretrained(folder)) == record["weights_sha256"]


def log_run(monkeypatch, folder, method, seed, steps, val, entropy, masked=None):
    """A run's metrics through verl's FileLogger: validation at steps 0 and 4, training metrics at steps 1..steps."""
    path = folder / "runs" / f"{method}-s{seed}" / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = FileLogger("experiment", method)
    logger.log({"val-core/arith/acc/mean@4": val[0]}, step=0)
    for step in range(1, steps + 1):
        data = {"critic/score/mean": 0.1 * step, "actor/entropy": entropy[step - 1], "response_length/mean": 30.0}
        data |= {"s2t/grad_bound/candidate_mean": 2.0 * step, "s2t/grad_bound/other_mean": 0.5}
        if masked is not None:
            data["stapo/masked_frac"] = masked
        if step == 4:
            data["val-core/arith/acc/mean@4"] = val[1]
        logger.log(data, step=step)
    logger.finish()


def test_summary_compares_methods_at_the_steps_every_run_reached(tmp_path, monkeypatch):
    log_run(monkeypatch, tmp_path, "justrl", 0, 4, (0.25, 0.50), [1.0, 1.2, 1.4, 1.6])
    log_run(monkeypatch, tmp_path, "justrl", 1, 4, (0.30, 0.60), [1.0, 1.1, 1.2, 1.3])
    log_run(monkeypatch, tmp_path, "stapo", 0, 6, (0.25, 0.70), [1.0, 1.0, 1.0, 1.0, 9.0, 9.0], masked=0.002)
    table = ex.summarize(tmp_path, tmp_path / "plots")
    summary, note = table.split("\n\n")
    rows = parse_table(summary)
    justrl, stapo = rows["justrl"], rows["stapo"]
    assert note.strip() == ex.PAIRED_NOTE  # paired over the seeds both ran: one, too few for a spread
    assert (justrl["seeds"], justrl["steps run"], stapo["steps run"]) == ("0,1", "4/4", "6")
    assert justrl["val acc % @ 0"] == f"27.5 ± {statistics.stdev([25, 30]):.2g}"
    assert justrl["val acc % @ 4"] == f"55 ± {statistics.stdev([50, 60]):.2g}" and stapo["val acc % @ 4"] == "70"
    # every run reached step 4: STAPO's steps 5 and 6 (entropy 9) are left out of the comparison
    assert justrl["entropy @ 1-4"] == f"{statistics.fmean([1.3, 1.15]):.4g} ± {statistics.stdev([1.3, 1.15]):.2g}"
    assert stapo["entropy @ 1-4"] == "1" and stapo["reward @ 1-4"] == f"{statistics.fmean([0.1, 0.2, 0.3, 0.4]):.4g}"
    assert justrl["silenced % @ 1-4"] == "-"  # JustRL silences nothing and logs no stapo/masked_frac
    assert stapo["silenced % @ 1-4"] == "0.2"
    assert stapo["candidate / other bound @ 1-4"] == f"{statistics.fmean([4 * s for s in range(1, 5)]):.4g}"
    assert (tmp_path / "summary.md").read_text() == table
    for name in ("entropy", "reward", "masked_frac", "val_arith"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000


def parse_table(markdown: str) -> dict[str, dict[str, str]]:
    """A Markdown table of the summary as ``first cell -> {column: cell}``."""
    header, _, *lines = [[c.strip() for c in line.strip("|").split("|")] for line in markdown.strip().splitlines()]
    return {cells[0]: dict(zip(header, cells)) for cells in lines}


def test_paired_differences_are_taken_seed_by_seed(tmp_path, monkeypatch):
    # seed 1 is better than seed 0 in both arms (val +10 points, entropy +1): pairing removes that shared part
    log_run(monkeypatch, tmp_path, "justrl", 0, 4, (0.25, 0.50), [1.0] * 4)
    log_run(monkeypatch, tmp_path, "justrl", 1, 4, (0.30, 0.60), [2.0] * 4)
    log_run(monkeypatch, tmp_path, "stapo", 0, 4, (0.25, 0.55), [0.5] * 4, masked=0.001)
    log_run(monkeypatch, tmp_path, "stapo", 1, 4, (0.30, 0.69), [1.7] * 4, masked=0.001)
    log_run(monkeypatch, tmp_path, "stapo", 2, 4, (0.30, 0.99), [9.0] * 4, masked=0.001)  # no JustRL seed 2: left out
    pair = ex.paired_rows(ex.read_runs(tmp_path))
    assert [(row["difference"], row["seeds"]) for row in pair] == [("stapo - justrl", "0,1")]

    def numbers(cell):  # "mean ± sd (t T)"
        mean, rest = cell.split(" ± ")
        sd, t = rest.removesuffix(")").split(" (t ")
        return float(mean), float(sd), float(t)

    mean, sd, t = numbers(pair[0]["val acc points @ 4"])  # differences 5 and 9 points
    assert mean == pytest.approx(7) and sd == pytest.approx(statistics.stdev([5, 9]), rel=0.05)
    assert t == pytest.approx(7 / (statistics.stdev([5, 9]) / 2**0.5), rel=0.05)  # as rounded in the cell
    mean, sd, t = numbers(pair[0]["entropy @ 1-4"])  # differences -0.5 and -0.3
    assert (mean, sd, t) == pytest.approx((-0.4, statistics.stdev([-0.5, -0.3]), -4.0), rel=0.05)
    assert pair[0]["gradient norm @ 1-4"] == "-"  # not logged
    assert ex._paired_cell([1.0, math.nan, 3.0]) == "+2 ± 1.4 (t 2, 2 seeds)"  # a seed without the metric is named
    assert ex._paired_cell([0.5, 0.5]) == "+0.5 ± 0 (t inf)"


def test_a_cluster_that_is_ending_is_waited_for(monkeypatch, foreign_ray_ignored):
    """Scripts run several trainings in a row (the quickstart, the GPU smoke): the previous run's local cluster may
    still be shutting down when the next run's preflight looks. A real one ends with its driver; the waiting itself
    is shown with a listing of GCS servers that empties after two looks."""
    code = "import ray; ray.init(address='local', num_cpus=1, include_dashboard=False)"  # never a running cluster
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    foreign_ray_ignored()
    listings = iter([[4242], [4242], []])
    monkeypatch.setattr(preflight, "_gcs_servers", lambda: next(listings))
    assert preflight.local_ray_clusters(wait_s=5) == []
    monkeypatch.setattr(preflight, "_gcs_servers", lambda: [4242])
    assert preflight.local_ray_clusters(wait_s=1) == [4242]


def test_a_prepared_model_and_task_replace_the_tiny_warm_up(tmp_path, monkeypatch, foreign_ray_ignored):
    """``--model`` and ``--data`` (SmolLM2 after its warm-up, the word task): every run starts from that folder on
    that task, the options and the weights' digest are recorded, and a continued experiment must match them."""
    from stapo.quickstart.task import WORD_DATA_SOURCE, generate_word, write_task
    from stapo.quickstart.tiny import build_model, build_tokenizer

    monkeypatch.setattr(ex.torch.cuda, "device_count", lambda: 1)  # stubbed: this machine has no GPU
    splits = generate_word(seed=0, n_train=20, n_val=5, difficulty=1)
    write_task(splits, tmp_path / "task", seed=0, data_source=WORD_DATA_SOURCE)
    build_model(build_tokenizer(["a b"] * 5, tmp_path / "model", vocab_size=300), tmp_path / "model", hidden_size=64)
    argv = ["run", "--out", str(tmp_path / "exp"), "--model", str(tmp_path / "model"), "--data", str(tmp_path / "task")]
    extra = ["--", "data.max_prompt_length=192", "actor_rollout_ref.actor.optim.lr=1e-6"]
    args = ex.build_parser().parse_args([*argv, "--methods", "justrl", "stapo_random", *extra])
    assert ex.check_run_args(args) == ["0"]
    overrides = ex.run_overrides(ex.Run("stapo_random", 1), args.model, ex.task_paths(args.data), args)
    assert f"actor_rollout_ref.model.path={tmp_path / 'model'}" in overrides
    assert f"data.val_files={tmp_path / 'task' / 'validation.parquet'}" in overrides
    assert "actor_rollout_ref.actor.optim.lr=1e-6" in overrides and "data.max_prompt_length=192" in overrides
    sweep = ex.run_overrides(ex.Run("justrl", 0, 2e-5), args.model, ex.task_paths(args.data), args)
    assert "actor_rollout_ref.actor.optim.lr=2e-05" in sweep and "actor_rollout_ref.actor.optim.lr=1e-6" not in sweep
    assert ex.prepared_model(args) == tmp_path / "model"
    record = json.loads((tmp_path / "exp" / "experiment.json").read_text())
    assert record["model"] == str(tmp_path / "model") and len(record["weights_sha256"]) == 64
    again = ex.build_parser().parse_args([*argv, "--steps", "100", *extra])
    with pytest.raises(SystemExit, match="holds an experiment with other steps"):
        ex.prepared_model(again)
    for bad, message in (
        (["--model", str(tmp_path / "model")], "--model and --data go together"),
        (["--model", str(tmp_path), "--data", str(tmp_path / "task")], "no config.json"),
        (["--model", str(tmp_path / "model"), "--data", str(tmp_path)], "train.parquet: no such file"),
    ):
        with pytest.raises(SystemExit, match=message):
            ex.check_run_args(ex.build_parser().parse_args(["run", "--out", str(tmp_path / "x"), *bad]))


def test_the_stability_gate_calls_an_explosion_unstable_and_a_collapse_stable(tmp_path, monkeypatch):
    """The pre-registered gate (docs/history.md, section 10) on constructed runs of 40 steps: an entropy that falls
    to 0.2 and rises back to 0.5 passes it (R = 0.3 >= 0.05 and >= half of 0.2); one that falls monotonically, as every
    SmolLM2 run did, does not; five gradient-norm spikes, or a reward 0.2 below its best window, pass it too."""
    steps = range(1, 41)
    explode = {"actor/entropy": {s: 0.2 if s < 25 else 0.5 for s in steps}}
    collapse = {"actor/entropy": {s: 0.5 - 0.01 * s for s in steps}}
    spikes = {
        "actor/entropy": {s: 0.3 for s in steps},
        "actor/grad_norm": {s: 3.0 if s % 8 == 0 else 0.5 for s in steps},
    }
    drop = {"actor/entropy": {s: 0.3 for s in steps}, "critic/score/mean": {s: 0.8 if s < 20 else 0.6 for s in steps}}
    assert ex.stability(explode)["unstable"] and ex.stability(explode)["entropy_rise"] == pytest.approx(0.3)
    gate = ex.stability(collapse)
    assert not gate["unstable"] and gate["entropy_rise"] == pytest.approx(0.0)
    assert ex.stability(spikes)["grad_spikes"] == 5 and ex.stability(spikes)["unstable"]
    assert ex.stability(drop)["reward_drop"] == pytest.approx(0.2) and ex.stability(drop)["unstable"]
    small = {"actor/entropy": {s: 0.2 if s < 25 else 0.24 for s in steps}}  # a rise of 0.04 nats: below the gate
    assert not ex.stability(small)["unstable"]
    log_run(monkeypatch, tmp_path, "justrl", 0, 12, (0.2, 0.3), [0.5 - 0.01 * s for s in range(12)])
    ex.summarize(tmp_path, None)
    rows = parse_table((tmp_path / "stability.md").read_text())
    assert rows["justrl-s0"]["unstable"] == "no" and rows["justrl-s0"]["grad norm > 2 (steps)"] == "0"


def test_the_ladder_is_a_grid_of_learning_rates_and_temperatures(tmp_path):
    """``--lrs`` and ``--temperatures`` (the ladder of docs/history.md, section 10): every method and seed in every
    cell, seed-major, each cell's settings in its runs' overrides and name; an override of a gridded key is refused."""
    runs = ex.plan(["justrl"], [0, 1], lrs=[1e-5, 3e-5], temperatures=[1.0, 1.2])
    assert [r.name for r in runs[:4]] == ["justrl_lr1e-05_T1-s0", "justrl_lr1e-05_T1.2-s0", "justrl_lr3e-05_T1-s0",
                                          "justrl_lr3e-05_T1.2-s0"]  # fmt: skip
    assert len(runs) == 8 and len({r.name for r in runs}) == 8
    args = ex.build_parser().parse_args(["run", "--out", str(tmp_path), "--lrs", "1e-5", "--temperatures", "1.2"])
    overrides = ex.run_overrides(runs[1], tmp_path / "model", ex.task_paths(tmp_path), args)
    assert "actor_rollout_ref.actor.optim.lr=1e-05" in overrides
    assert "actor_rollout_ref.rollout.temperature=1.2" in overrides
    bad = [
        "run",
        "--out",
        str(tmp_path / "x"),
        "--temperatures",
        "1.2",
        "--",
        "actor_rollout_ref.rollout.temperature=2",
    ]
    with pytest.raises(SystemExit, match="--lrs or --temperatures sets it for each run"):
        ex.check_run_args(ex.build_parser().parse_args(bad))
    with pytest.raises(SystemExit, match="--temperatures 1.0 1.0: distinct positive numbers"):
        ex.check_run_args(
            ex.build_parser().parse_args(["run", "--out", str(tmp_path / "x"), "--temperatures", "1", "1"])
        )
    assert ex.plan(["justrl", "stapo"], [0]) == [ex.Run("justrl", 0), ex.Run("stapo", 0)]  # no grid: as before


def test_a_word_task_mixes_levels_in_turn(tmp_path):
    from stapo.quickstart import task

    task.main(["word", "--difficulty", "2", "3", "4", "--out", str(tmp_path / "mixed"), "--train", "30", "--val", "6"])
    rows = pq.read_table(tmp_path / "mixed" / "train.parquet").to_pylist()
    steps = [row["reward_model"]["ground_truth"] for row in rows]
    assert len(rows) == 30 and len(set(steps)) > 1
    splits = task.generate_word(seed=0, n_train=9, n_val=3, difficulty=[2, 3, 4])
    counts = [p.solution.count("=") for p in splits["train"][:3]]
    assert counts == [1, 2, 2]  # level 2 has one step, levels 3 and 4 two (tests/test_quickstart.py)
