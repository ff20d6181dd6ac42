"""verl plugin: registers the ``stapo_sync`` trainer mode in every process that imports verl.

Loaded automatically through the ``verl.plugins`` entry point once the package is installed, and explicitly
through ``VERL_USE_EXTERNAL_MODULES=stapo.plugin`` (set in the STAPO configs' Ray runtime environment, so it
reaches every Ray process even where entry points are disabled). verl swallows entry-point errors, so the
training entry point checks :func:`is_loaded` and stops with instructions when it is false.
"""

from stapo import trainer  # noqa: F401  (registers TRAINER_MODE)


def is_loaded() -> bool:
    """True when ``stapo_sync`` is registered with verl in this process."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from stapo.config import TRAINER_MODE

    return TRAINER_REGISTRY.get(TRAINER_MODE) is trainer.STAPOTrainer
