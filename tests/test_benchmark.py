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
    assert float(written[-1][1:].split("]")[0]) == pytest.approx(events["ready_to_fit"], abs=0.1)


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

    args = argparse.Namespace(model=model, cycles=2, prompts=16, response_length=2048)
    config, run = benchmark.bench_run_args(args, tmp_path / "model", tmp_path / "train.parquet", tmp_path)
    assert config[0] == "--config-name=stapo" and any(r.endswith(benchmark.TRAINER_MODE) for r in run)
    rollout = benchmark.rollout_config([*config[1:], *run, "actor_rollout_ref.rollout.max_num_seqs=128"])
    assert rollout.max_num_seqs == 128
    assert rollout.gpu_memory_utilization == (0.6 if model == "qwen3_1.7b" else 0.3)  # size file; the tiny run's
    assert rollout.n == (8 if model == "qwen3_1.7b" else 4)
