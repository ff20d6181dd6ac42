"""The start-up cuts (stapo/train/startup_cuts.py, issue 55): the switch, the plugin's deferred registration in a fresh
interpreter with verl, vLLM's one-GPU executor in the composed config against the installed verl's argument order,
the background bytecode compile, and the one-node size files' TransferQueue storage units. What each saves on a GPU
is for the phase table of `python -m stapo.checks.startup run` (docs/startup.md)."""

import importlib
import importlib.resources
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from stapo.config import CONFIG_DIR
from stapo.train import startup_cuts
from stapo.train.main import ConfigError, validate

ROOT = Path(__file__).resolve().parents[1]


def load(name="stapo", *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def test_the_switch():
    assert startup_cuts.selected({}) == set(startup_cuts.CUTS) == startup_cuts.selected({"STAPO_STARTUP_CUTS": "all"})
    assert startup_cuts.selected({"STAPO_STARTUP_CUTS": "none"}) == frozenset()
    assert startup_cuts.selected({"STAPO_STARTUP_CUTS": " bytecode, lazy_plugin "}) == {"bytecode", "lazy_plugin"}
    with pytest.raises(ValueError, match="STAPO_STARTUP_CUTS=lazy,bytecode: unknown cut lazy; use all, none"):
        startup_cuts.selected({"STAPO_STARTUP_CUTS": "lazy,bytecode"})


def test_the_driver_refuses_an_unknown_cut_in_one_line(monkeypatch):
    monkeypatch.setenv("STAPO_STARTUP_CUTS", "fast")
    assert not startup_cuts.enabled("lazy_plugin")  # in a Ray process: none (the driver stopped such a run)
    with pytest.raises(ConfigError) as error:
        validate(load("stapo", "size=smollm2_135m"), environment=False)
    assert str(error.value) == (
        "STAPO_STARTUP_CUTS=fast: unknown cut fast; use all, none or some of lazy_plugin, uni_executor, bytecode"
    )


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A package with a data file, and a module that registers into it (as the recipe's do into verl's)."""
    (tmp_path / "stapo_toy").mkdir()
    (tmp_path / "stapo_toy" / "__init__.py").write_text("REGISTRY = []\n")
    (tmp_path / "stapo_toy" / "data.txt").write_text("resource")
    (tmp_path / "stapo_toyreg.py").write_text("import stapo_toy\nstapo_toy.REGISTRY.append('toyreg')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("stapo_toy", "stapo_toyreg"):
        sys.modules.pop(name, None)
    startup_cuts._HOOK.pending.clear()


def test_after_import_registers_when_the_package_arrives(toy):
    startup_cuts.after_import("stapo_toy", "stapo_toyreg")
    assert "stapo_toyreg" not in sys.modules
    toy_package = importlib.import_module("stapo_toy")
    assert toy_package.REGISTRY == ["toyreg"] and "stapo_toyreg" in sys.modules
    assert importlib.resources.files("stapo_toy").joinpath("data.txt").read_text() == "resource"  # loader delegates
    assert "stapo_toy" not in startup_cuts._HOOK.pending
    del sys.modules["stapo_toyreg"]
    startup_cuts.after_import("stapo_toy", "stapo_toyreg")  # already imported: at once
    assert toy_package.REGISTRY == ["toyreg", "toyreg"]


PROBE = textwrap.dedent(
    """
    import json, sys
    import {first}
    early = {{m: m in sys.modules for m in ("stapo.train.trainer", "stapo.train.agent_loop", "stapo.train.plugin")}}
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from stapo.config import SEEDED_AGENT_LOOP
    seeded, trainer_then = SEEDED_AGENT_LOOP in _agent_loop_registry, "stapo.train.trainer" in sys.modules
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.utils.experimental import torch_functional as tf
    from transformers import AttentionInterface
    cls = get_trainer_cls("stapo_sync")
    float32 = hasattr(tf.FusedLinearForPPOFunction, "_stapo_original")
    print(json.dumps({{"early": early, "seeded": seeded, "trainer_with_agent_loop": trainer_then,
        "trainer": cls.__module__ + "." + cls.__name__, "float32": float32,
        "varlen": "torch_varlen" in AttentionInterface._global_mapping}}))
    """
)


def probe(cuts: str, first: str = "verl") -> dict:
    """A fresh interpreter as a Ray process of a run starts: the plugin named by the runtime environment."""
    env = {**os.environ, "STAPO_STARTUP_CUTS": cuts, "VERL_USE_EXTERNAL_MODULES": "stapo.train.plugin"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_lazy_plugin_registers_only_where_verl_imports_its_own():
    lazy = probe("lazy_plugin")
    assert lazy["early"] == {"stapo.train.trainer": False, "stapo.train.agent_loop": False, "stapo.train.plugin": True}
    assert lazy["seeded"] and not lazy["trainer_with_agent_loop"]  # an agent-loop worker: the loop, not the trainers
    assert lazy["trainer"] == "stapo.train.trainer.STAPOTrainer" and lazy["float32"] and lazy["varlen"]
    eager = probe("none")
    assert eager["early"] == {"stapo.train.trainer": True, "stapo.train.agent_loop": True, "stapo.train.plugin": True}
    assert eager["trainer"] == lazy["trainer"] and eager["seeded"] and eager["float32"] and eager["varlen"]


def test_lazy_plugin_in_the_task_runner_order():
    """The task runner imports verl's V1 trainers first (``TaskRunnerV1.run``): the trainer modes are there."""
    assert probe("all", first="verl.trainer.ppo.v1")["trainer"] == "stapo.train.trainer.STAPOTrainer"


def test_uni_executor_for_one_gpu_replicas_only():
    config = load("stapo", "size=qwen3_1.7b")
    assert startup_cuts.uni_executor(config)
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend == "uni"
    assert not startup_cuts.uni_executor(load("stapo", "size=qwen3_8b"))  # tensor parallel 2: verl's mp stays
    kept = load(
        "stapo", "size=qwen3_1.7b", "+actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend=mp"
    )
    assert not startup_cuts.uni_executor(kept)
    assert kept.actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend == "mp"
    assert not startup_cuts.uni_executor(load("stapo", "size=qwen3_1.7b", "actor_rollout_ref.rollout.name=sglang"))


def test_verl_merges_the_engine_arguments_after_its_mp():
    """Why the cut works: in the installed verl the rollout's engine_kwargs.vllm come after its own
    distributed_executor_backend=mp in the arguments of vLLM's server (a later key wins)."""
    import verl

    source = (Path(verl.__file__).parent / "workers/rollout/vllm_rollout/vllm_async_server.py").read_text()
    launch = source[source.index("async def launch_server") : source.index("async def run_server")]
    assert 0 < launch.index('"distributed_executor_backend": "mp"') < launch.index("**engine_kwargs,")
    assert 'engine_kwargs = self.config.get("engine_kwargs", {}).get(self._get_engine_kwargs_key(), {})' in launch


def test_precompile_writes_the_bytecode_an_import_would(tmp_path, monkeypatch):
    """Also under PYTHONDONTWRITEBYTECODE, which keeps imports from writing bytecode, not from reading it."""
    (tmp_path / "pkg").mkdir()
    module = tmp_path / "pkg" / "mod.py"
    module.write_text("X = 1\n")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert startup_cuts.precompile([str(tmp_path / "pkg")]).wait(timeout=120) == 0
    assert Path(importlib.util.cache_from_source(str(module))).is_file()
    assert startup_cuts.precompile([]) is None
    import torch

    assert startup_cuts.package_folders(("torch", "stapo_no_such_package")) == list(torch.__path__)


def test_apply_and_forward(monkeypatch):
    monkeypatch.setattr(startup_cuts, "precompile", lambda folders: object())
    monkeypatch.setenv("STAPO_STARTUP_CUTS", "uni_executor")
    config = load("stapo", "size=smollm2_135m")
    assert startup_cuts.apply(config)[1:] == [
        "uni_executor: vLLM's one-GPU replicas run the model in the engine process"
    ]
    startup_cuts.forward(config)
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.STAPO_STARTUP_CUTS == "uni_executor"
    monkeypatch.delenv("STAPO_STARTUP_CUTS")
    config = load("stapo", "size=smollm2_135m")
    assert startup_cuts.apply(config)[-1] == "bytecode: compiling missing bytecode in the background"
    startup_cuts.forward(config)
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.STAPO_STARTUP_CUTS == "all"


@pytest.mark.parametrize("size, units", [("qwen3_1.7b", 2), ("smollm2_135m", 2), ("qwen3_8b", 8), ("qwen3_14b", 8)])
def test_one_node_sizes_start_two_transfer_queue_units(size, units):
    config = load("stapo", f"size={size}")
    storage = config.transfer_queue.backend.SimpleStorage
    assert storage.num_data_storage_units == units  # 8: verl's own default, for the multi-node sizes
    samples = config.data.train_batch_size * config.actor_rollout_ref.rollout.n
    assert storage.total_storage_size / units >= 2 * samples  # each unit still holds two steps' share and more
    verl_config = Path(importlib.import_module("verl").__file__).parent / "trainer/config"
    verls = OmegaConf.load(verl_config / "transfer_queue" / "transfer_queue.yaml")
    assert verls.backend.SimpleStorage.num_data_storage_units == 8


def test_ray_starts_an_actor_in_a_process_of_its_own_beside_an_idle_warm_worker(tmp_path, foreign_ray_ignored):
    """Why no cut pre-imports vLLM for verl's server actor (docs/startup.md, lead f): Ray 2.60 does not hand an actor
    an idle worker that already ran a task with the same runtime environment; it starts a new process, which imports
    everything again. Should Ray start reusing such workers, this fails and the lead is open again."""
    import time

    import ray

    from stapo.train import clusters

    env = {"env_vars": {"STAPO_PREWARM_PROBE": "1"}}

    @ray.remote(num_cpus=0)
    def warm():
        import json  # noqa: F401  (the module the actor's class would need)

        return os.getpid()

    @ray.remote(num_cpus=0)
    class Server:
        def pid(self):
            return os.getpid()

    with clusters.local_cluster(["0"], tmp_path / "ray.log") as (address, _):
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        try:
            task_pid = ray.get(warm.options(runtime_env=env).remote())
            time.sleep(1)  # the task's worker is idle in the pool now
            actor_pid = ray.get(Server.options(runtime_env=env).remote().pid.remote())
            again_pid = ray.get(warm.options(runtime_env=env).remote())
        finally:
            ray.shutdown()
    assert again_pid == task_pid  # the warm worker was alive and reusable: by tasks
    assert actor_pid != task_pid  # not by the actor
    foreign_ray_ignored()
