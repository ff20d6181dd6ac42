"""Training entry point: ``python -m stapo.train --config-name <stapo|justrl|grpo|entropy20> size=<qwen3_1.7b|...>``.

A thin wrapper around verl's ``verl.trainer.main_ppo``: it composes the recipe's YAML (deltas over verl's own
``ppo_trainer``), checks the ``stapo:`` block and verl's own config rules on the driver, checks that the recipe is
installed where Ray will look for it, and then runs verl's V1 task runner unchanged. Any Hydra override works,
e.g. ``stapo.tau_p=0.001 trainer.n_gpus_per_node=4``.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import hydra
from omegaconf import DictConfig

from stapo.config import CONFIG_DIR, validate_training_config

PLUGIN_ENTRY_POINT = "stapo"


def check_installed() -> None:
    """Stop with instructions unless the package is installed with its ``verl.plugins`` entry point."""
    if not any(ep.name == PLUGIN_ENTRY_POINT for ep in entry_points(group="verl.plugins")):
        raise RuntimeError(
            "STAPO: the `stapo` package is importable but not installed, so verl's plugin loader and the Ray "
            "workers will not find it. Run `pip install -e .` in the repository (on every node of a multi-node "
            "cluster) or use docker/Dockerfile."
        )


def validate(config: DictConfig):
    """All checks that can run before Ray starts: verl's own config validation, then the STAPO block."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return validate_training_config(config)


def run(config: DictConfig) -> None:
    stapo = validate(config)
    if stapo.active:
        check_installed()
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo

    run_ppo(config, task_runner_class=TaskRunnerV1)


@hydra.main(config_path=str(CONFIG_DIR), config_name="stapo", version_base=None)
def main(config: DictConfig) -> None:
    run(config)


if __name__ == "__main__":
    main()
