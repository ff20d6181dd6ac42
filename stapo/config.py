"""The ``stapo:`` block of a training config, and the checks that run before any GPU work.

Every error names the offending key, the value found and what is allowed, so a bad YAML edit or command-line
override fails on the driver in seconds instead of after Ray, vLLM and FSDP have started.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

_HERE = Path(__file__).resolve().parent
# The recipe's Hydra configs: shipped inside the wheel as stapo/configs, the top-level configs/ in a checkout.
CONFIG_DIR = next(p for p in (_HERE / "configs", _HERE.parent / "configs") if (p / "base.yaml").is_file())

TRAINER_MODE = "stapo_sync"
MASKS = ("none", "s2t", "top_entropy")
POLICY_SOURCES = ("old", "current")
QUANTILE_SCOPES = ("mini_batch", "batch")


class StapoConfigError(ValueError):
    """A STAPO setting is invalid; the message names the key and the fix."""


@dataclass(frozen=True)
class StapoConfig:
    """Typed view of the ``stapo:`` block (defaults are the paper's v4 values).

    Attributes:
        mask: ``s2t`` (STAPO), ``top_entropy`` (the 20-Entropy baseline) or ``none`` (GRPO / JustRL).
        tau_p: probability threshold τ_p in (0, 1].
        q: entropy quantile in [0, 1]; the bottom q of the candidates by entropy are silenced.
        policy_source: ``old``: mask from the old-policy log-probs and entropies verl already computes, built on
            the driver before the update (exact renormalisation, no extra cost); ``current``: mask from π_θ inside
            the update, as in the paper's Algorithm 1 (approximations: see :mod:`stapo.loss`).
        quantile_scope: ``mini_batch`` (the paper: one quantile per PPO mini-batch) or ``batch`` (one per step).
            Only with ``policy_source: old``.
        top_entropy_ratio: ρ of the 20-Entropy baseline, in (0, 1].
    """

    mask: str = "none"
    tau_p: float = 0.002
    q: float = 0.75
    policy_source: str = "old"
    quantile_scope: str = "mini_batch"
    top_entropy_ratio: float = 0.2

    @classmethod
    def from_node(cls, node: DictConfig | dict | None) -> StapoConfig:
        """Build and validate from the ``stapo:`` node (missing keys take the defaults)."""
        raw = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
        known = {f.name for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise StapoConfigError(f"stapo.{key}: unknown key; allowed keys are {', '.join(sorted(known))}")
        cfg = cls(**raw)
        cfg._check()
        return cfg

    def _check(self) -> None:
        _choice("mask", self.mask, MASKS)
        _choice("policy_source", self.policy_source, POLICY_SOURCES)
        _choice("quantile_scope", self.quantile_scope, QUANTILE_SCOPES)
        _number("tau_p", self.tau_p, "in (0, 1] (paper: 0.002)", lambda v: 0.0 < v <= 1.0)
        _number("q", self.q, "in [0, 1] (paper: 0.75)", lambda v: 0.0 <= v <= 1.0)
        _number("top_entropy_ratio", self.top_entropy_ratio, "in (0, 1] (20-Entropy: 0.2)", lambda v: 0.0 < v <= 1.0)
        if self.policy_source == "current" and self.quantile_scope == "batch":
            raise StapoConfigError(
                "stapo.quantile_scope=batch needs stapo.policy_source=old: with policy_source=current the mask is "
                "built inside the update, where only the current micro-batch exists; use quantile_scope=mini_batch"
            )

    @property
    def active(self) -> bool:
        return self.mask != "none"


def _choice(key: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise StapoConfigError(f"stapo.{key}={value!r} is not allowed; use one of: {', '.join(allowed)}")


def _number(key: str, value, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or not ok(value):
        raise StapoConfigError(f"stapo.{key}={value!r} is out of range; it must be a number {allowed}")


def validate_training_config(config: DictConfig) -> StapoConfig:
    """Check the ``stapo:`` block and how it fits the rest of a verl ``ppo_trainer`` config.

    Raises :class:`StapoConfigError` naming the key. Returns the typed ``stapo:`` block.
    """
    stapo = StapoConfig.from_node(config.get("stapo"))
    if not stapo.active:
        return stapo
    trainer = config.trainer
    actor = config.actor_rollout_ref.actor
    if not trainer.get("use_v1", True):
        raise StapoConfigError(
            "trainer.use_v1=False: the STAPO mask is implemented for verl's V1 trainer only; set trainer.use_v1=True"
        )
    if trainer.v1.trainer_mode != TRAINER_MODE:
        raise StapoConfigError(
            f"trainer.v1.trainer_mode={trainer.v1.trainer_mode!r}: stapo.mask={stapo.mask} needs "
            f"trainer.v1.trainer_mode={TRAINER_MODE} (verl's stock trainers would silently skip the mask)"
        )
    if stapo.policy_source == "current" and not actor.calculate_entropy:
        raise StapoConfigError(
            "actor_rollout_ref.actor.calculate_entropy=False: stapo.policy_source=current needs the entropy of "
            "π_θ in the update; set actor_rollout_ref.actor.calculate_entropy=True "
            "(and actor_rollout_ref.actor.entropy_checkpointing=True to keep its memory low)"
        )
    if stapo.policy_source == "old" and stapo.quantile_scope == "mini_batch" and actor.ppo_epochs > 1 and actor.shuffle:
        raise StapoConfigError(
            "actor_rollout_ref.actor.shuffle=True with ppo_epochs>1 regroups the mini-batches every epoch, so no "
            "single per-mini-batch mask exists; set actor_rollout_ref.actor.shuffle=False, ppo_epochs=1, "
            "stapo.quantile_scope=batch or stapo.policy_source=current"
        )
    return stapo
