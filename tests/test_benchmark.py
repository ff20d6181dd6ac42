"""The speed benchmark's CPU parts (stapo.checks.benchmark): the start-up clock over a real child process's output,
the per-stage table from verl-shaped step metrics, and which rollout settings the standalone vLLM run takes. The GPU
parts (the actor, vLLM, the rotating training run) run on the GPU hosts (docs/scale.md)."""

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
    assert times == sorted(times) and times[-1] - times[0] >= 0.8  # three sleeps of 0.3 s between the four lines
    written = log.read_text().splitlines()
    assert len(written) == 4 and all(line.startswith("[") and "] " in line for line in written)
    assert float(written[-1][1:].split("]")[0]) == pytest.approx(events["ready_to_fit"], abs=0.1)


def test_run_logged_returns_a_failure_and_no_events(tmp_path):
    returncode, events = benchmark.run_logged([sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "log")
    assert returncode == 3 and events == {}


def step(seconds: float, gen: float, gpus: int = 1) -> dict:
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
    rows = [step(40.0, 20.0, gpus), step(44.0, 16.0, gpus), step(42.0, 18.0, gpus)]
    table = benchmark.stage_table(rows)
    assert table["gpus"] == gpus and table["step_s"] == 42.0 and table["gen_s"] == 18.0
    assert benchmark.generated_tokens(rows[0]) == pytest.approx(128 * 2000)
    assert table["gen_tokens_per_s_per_gpu"] == pytest.approx(128 * 2000 / 18.0 / gpus, rel=1e-3)
    assert table["update_tokens_per_s_per_gpu"] == pytest.approx(128 * 2030 / 16.0 / gpus, rel=1e-3)
    assert table["peak_actor_gb"] == 30.0


def test_rollout_settings_of_the_run_come_from_override_then_size_file_then_verl():
    assert benchmark.rollout_setting("qwen3_1.7b", [], "gpu_memory_utilization") == 0.6  # the size file
    overrides = ["+actor_rollout_ref.rollout.max_num_seqs=512", "trainer.n_gpus_per_node=1"]
    assert benchmark.rollout_setting("qwen3_1.7b", overrides, "max_num_seqs") == 512
    from omegaconf import OmegaConf

    verl = OmegaConf.load(benchmark.importlib.util.find_spec("verl").submodule_search_locations[0]
                          + "/trainer/config/rollout/rollout.yaml")  # fmt: skip
    assert benchmark.rollout_setting(None, [], "max_num_batched_tokens") == verl.max_num_batched_tokens
