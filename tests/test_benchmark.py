"""The speed benchmark's CPU parts (stapo.checks.benchmark): the start-up clock over a real child process's output,
the per-stage table from verl-shaped step metrics, and which rollout settings the standalone vLLM run takes. The GPU
parts (the actor, vLLM, the rotating training run) run on the GPU hosts (docs/scale.md)."""

import contextlib
import os
import signal
import sys

import pytest

from stapo.checks import benchmark


def test_run_logged_times_the_startup_events_of_a_real_process(tmp_path):
    """Each of verl's set-up lines is timed when it appears; every line of the log carries the seconds since launch."""
    lines = [event for _, event in benchmark.STARTUP_EVENTS]
    script = "import time\n" + "".join(f"print({line!r}, flush=True); time.sleep(0.3)\n" for line in lines)
    log = tmp_path / "train.log"
    returncode, events = benchmark.run_logged([sys.executable, "-c", script], {}, log)
    assert returncode == 0
    assert list(events) == [name for name, _ in benchmark.STARTUP_EVENTS]
    times = list(events.values())
    assert times == sorted(times) and times[-1] - times[0] >= 0.29 * (len(lines) - 1)  # sleeps of 0.3 s between
    written = log.read_text().splitlines()
    assert len(written) == len(lines) and all(line.startswith("[") and "] " in line for line in written)
    assert float(written[-1][1:].split("]")[0]) == pytest.approx(events["agents_ready"], abs=0.1)


def test_run_logged_returns_a_failure_and_no_events(tmp_path):
    returncode, events = benchmark.run_logged([sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "log")
    assert returncode == 3 and events == {}


def test_run_logged_returns_when_the_command_ends_though_a_child_keeps_its_output(tmp_path):
    """A process the command leaves behind (a Ray or vLLM process) holding the output pipe does not hold the run; the
    test stops that process itself (it records its pid) instead of leaving it to sleep on."""
    pid_file = tmp_path / "child.pid"
    child = "[sys.executable, '-c', 'import time; time.sleep(30)']"
    script = f"import subprocess, sys; pid = subprocess.Popen({child}).pid; print('x')"
    script += f"; open({str(pid_file)!r}, 'w').write(str(pid))"
    start = benchmark.time.monotonic()
    try:
        returncode, _ = benchmark.run_logged([sys.executable, "-c", script], {}, tmp_path / "log", linger_s=1)
        assert returncode == 0 and benchmark.time.monotonic() - start < 10
        assert "] x" in (tmp_path / "log").read_text()
    finally:
        if pid_file.is_file():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def step_row(seconds: float, gen: float, gpus: int = 1) -> dict:
    """verl's metrics of a step with 128 responses of 2,000 tokens after 30-token prompts."""
    tokens = 128 * (30 + 2000)
    return {
        "timing_s/step": seconds,
        "timing_s/gen": gen,
        "timing_s/old_log_prob": 5.0,
        "timing_s/update_actor": 16.0,
        "timing_s/update_weights": 1.0,
        "perf/total_num_tokens": tokens,
        "perf/throughput": tokens / seconds / gpus,
        "prompt_length/mean": 30.0,
        "response_length/mean": 2000.0,
        "perf/mfu/actor": 0.2,
        "actor/perf/max_memory_allocated_gb": 30.0,
    }


@pytest.mark.parametrize("gpus", [1, 2])
def test_stage_table_per_gpu_figures(gpus):
    rows = [step_row(40.0, 20.0, gpus), step_row(44.0, 16.0, gpus), step_row(42.0, 18.0, gpus)]
    table = benchmark.stage_table(rows)
    assert table["gpus"] == gpus and table["step_s"] == 42.0 and table["gen_s"] == 18.0
    assert benchmark.generated_tokens(rows[0]) == pytest.approx(128 * 2000)
    assert table["gen_tokens_per_s_per_gpu"] == pytest.approx(128 * 2000 / 18.0 / gpus, rel=1e-3)
    assert table["update_tokens_per_s_per_gpu"] == pytest.approx(128 * 2030 / 16.0 / gpus, rel=1e-3)
    assert table["peak_actor_gb"] == 30.0


@pytest.mark.parametrize("gpus", [1, 2])
def test_stage_table_mfu_of_both_passes_on_the_drivers_clock(gpus):
    """verl's FLOP count of the 1.7B shape (dense weights including the untied-size embedding and head, plus causal
    attention) over the step's sequences, per GPU and second of the H100's dense bfloat16 peak; the old-log-prob pass
    (forward only) counts a third."""
    from transformers import Qwen3Config

    from stapo.config import QWEN3_SHAPES

    shape = QWEN3_SHAPES["qwen3_1.7b"]
    rows = [step_row(40.0, 20.0, gpus), step_row(44.0, 16.0, gpus)]
    table = benchmark.stage_table(rows, Qwen3Config(**shape), peak_tflops=989.0)
    hidden, layers, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    q, kv = heads * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    dense = layers * (3 * hidden * shape["intermediate_size"] + hidden * (2 * q + 2 * kv)) + 2 * 151936 * hidden
    flop = 6 * dense * 128 * 2030 + 6 * 128 * 2030**2 * shape["head_dim"] * heads * layers
    assert table["mfu_update_driver"] == pytest.approx(flop / 1e12 / 989.0 / gpus / 16.0, abs=1e-3)
    assert table["mfu_old_log_prob_driver"] == pytest.approx(flop / 1e12 / 989.0 / gpus / 3 / 5.0, abs=1e-3)
    assert 0.05 < table["mfu_update_driver"] * gpus < 0.5  # 3.35 PFLOP in 16 s of one H100
    assert "mfu_update_driver" not in benchmark.stage_table(rows)  # without the model's config: verl's figure only


def test_the_standalone_run_takes_the_runs_composed_rollout_settings():
    """The size file over verl's defaults and the recipe's base.yaml, then overrides, the last one winning."""
    rollout = benchmark.rollout_config(["size=qwen3_1.7b"])
    assert rollout.gpu_memory_utilization == 0.6 and rollout.n == 8  # the size file; base.yaml (verl's default is 1)
    assert rollout.max_num_batched_tokens == 8192  # verl 0.9.1's rollout.yaml
    seqs = ["actor_rollout_ref.rollout.max_num_seqs=64", "actor_rollout_ref.rollout.max_num_seqs=512"]
    assert benchmark.rollout_config(["size=qwen3_1.7b", *seqs]).max_num_seqs == 512
    assert benchmark.rollout_config(["actor_rollout_ref.rollout.max_num_seqs=null"]).max_num_seqs is None


def rotation(cycles: int) -> list[dict]:
    """verl-shaped metrics of a rotating run: JustRL, STAPO (driver), STAPO (current) per round; the first step slow."""
    rows = []
    for step in range(cycles * len(benchmark.PHASES)):
        row = step_row(72.0 if step == 0 else 34.0 + step % 3, 15.0)
        row["bench/phase"] = step % 3
        row["timing_s/update_actor"] = 14.0 + step % 3
        rows.append(row)
    return rows


def test_warm_rows_leave_out_the_first_step_and_the_current_policy_variant():
    rows = rotation(1)
    assert benchmark.warm_rows(rows) == [rows[1]]  # one round: STAPO's driver-mask step only
    warm = benchmark.warm_rows(rotation(4))
    assert len(warm) == 7 and all(r["bench/phase"] != 2 for r in warm) and max(r["timing_s/step"] for r in warm) < 72


def test_phase_comparison_drops_each_methods_first_round():
    result = benchmark.phase_comparison(rotation(4))
    assert result["justrl"]["steps"] == 3 and result["justrl"]["step_s"] == 34.0  # the 72 s first step is dropped
    assert result["stapo_old"]["step_s_ratio"] == round(35.0 / 34.0, 4)
    assert result["stapo_current"]["update_actor_s_ratio"] == round(16.0 / 14.0, 4)


@pytest.mark.parametrize("model", ["tiny", "qwen3_1.7b"])
def test_a_benchmark_runs_overrides_compose(tmp_path, model):
    """What ``gpu --standalone`` reads: the rotating run's own overrides (tiny: the smoke's vLLM settings; a shape:
    the size file's) and a user's, through Hydra as ``stapo.train`` composes them."""
    import argparse

    args = argparse.Namespace(model=model, cycles=2, prompts=16, response_length=2048, gpus=1)
    config, run = benchmark.bench_run_args(args, tmp_path / "model", tmp_path / "train.parquet", tmp_path)
    assert config[0] == "--config-name=stapo" and any(r.endswith(benchmark.TRAINER_MODE) for r in run)
    rollout = benchmark.rollout_config([*config[1:], *run, "actor_rollout_ref.rollout.max_num_seqs=128"])
    assert rollout.max_num_seqs == 128
    assert rollout.gpu_memory_utilization == (0.6 if model == "qwen3_1.7b" else 0.3)  # size file; the tiny run's
    assert rollout.n == (8 if model == "qwen3_1.7b" else 4)


def test_a_shape_run_on_two_gpus_is_one_node_and_loads_the_waiting_agent_manager(tmp_path):
    """``--gpus 2`` of the 8B shape: one node of two GPUs (its size file says 2 x 8), and verl's own loader finds the
    agent-loop manager the run names."""
    import argparse

    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ
    from verl.utils.import_utils import load_class_from_fqn

    from stapo.checks.ready_agents import ReadyAgentLoopManager
    from stapo.config import CONFIG_DIR

    args = argparse.Namespace(model="qwen3_8b", cycles=1, prompts=16, response_length=2048, gpus=2)
    config, run = benchmark.bench_run_args(args, tmp_path / "model", tmp_path / "train.parquet", tmp_path)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        composed = compose(config_name="stapo", overrides=[*config[1:], *run])
    assert (composed.trainer.nnodes, composed.trainer.n_gpus_per_node) == (1, 2)
    manager = load_class_from_fqn(composed.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    assert manager is ReadyAgentLoopManager and issubclass(manager, AgentLoopManagerTQ)


def test_the_agent_manager_returns_once_its_workers_are_up(tmp_path, foreign_ray_ignored, capsys):
    """verl's own worker creation (``_init_agent_loop_workers``: named actors, node affinity) on a Ray cluster of the
    test's own; the workers stand in for verl's agent-loop workers, which need a vLLM server (a GPU): they take 2 s to
    start and leave a file when up. The benchmark's manager returns only after both are up (verl's creates them and
    returns)."""
    import asyncio
    import time
    from types import SimpleNamespace

    import ray

    from stapo.checks.ready_agents import ReadyAgentLoopManager
    from stapo.train import clusters

    class SlowWorker:
        def __init__(self, config, llm_client, teacher_client, reward_handles):
            time.sleep(2)
            (config / f"up-{os.getpid()}").touch()

    with clusters.local_cluster(["0"], tmp_path / "ray.log") as (address, _):
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        try:
            manager = object.__new__(ReadyAgentLoopManager)  # the attributes verl's __init__ sets and the method reads
            manager.rollout_config = SimpleNamespace(agent=SimpleNamespace(num_workers=2))
            manager.agent_loop_workers_class = ray.remote(num_cpus=0)(SlowWorker)
            manager.config, manager.llm_client, manager.teacher_client = tmp_path, None, None
            manager.reward_loop_worker_handles = None
            start = time.monotonic()
            asyncio.run(manager._init_agent_loop_workers())
            seconds = time.monotonic() - start
            up = sorted(tmp_path.glob("up-*"))
        finally:
            ray.shutdown()
    assert len(manager.agent_loop_workers) == 2 and len(up) == 2 and seconds >= 2
    assert f"{benchmark.READY_LINE}: 2 in" in capsys.readouterr().out
    foreign_ray_ignored()
