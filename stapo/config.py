"""The ``stapo:`` block of a training config: one typed dataclass, the single home of the method's defaults and
allowed ranges, in verl's config style (``_target_: stapo.config.StapoConfig`` in the YAML, so that
``hydra.utils.instantiate`` builds it; ``Literal`` fields; checks in ``__post_init__``). Also the recipe's Hydra config
folder and the method and size names it defines.

Every error names the key, the value found and what is allowed, so that a bad YAML edit or override stops on the
driver in seconds, before Ray, vLLM and FSDP start.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf

_HERE = Path(__file__).resolve().parent
CONFIG_DIR = next(p for p in (_HERE / "configs", _HERE.parent / "configs") if (p / "base.yaml").is_file())
"""The recipe's Hydra configs: ``stapo/configs`` in an installed wheel, the top-level ``configs/`` in a checkout."""

_QWEN3 = dict(num_key_value_heads=8, head_dim=128, vocab_size=151936)
QWEN3_SHAPES = {
    "qwen3_0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16),
    "qwen3_1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16),
    "qwen3_8b": dict(
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "qwen3_14b": dict(
        _QWEN3,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        tie_word_embeddings=False,
    ),
}
"""The Qwen3 base models' shapes (their config.json), for runs at the true size with random weights
and the cost model (:mod:`stapo.tools.cost`)."""

TRAINER_MODE = "stapo_sync"
"""verl V1 trainer mode of every recipe config (:class:`stapo.train.trainer.STAPOTrainer`)."""
TRAINER_MODES = {
    "stapo_sync": "sync",
    "stapo_colocate_async": "colocate_async",
    "stapo_separate_async": "separate_async",
}
"""The recipe's trainer modes (``trainer.v1.trainer_mode``) -> the verl 0.9.1 mode each extends with the mask."""
SEEDED_AGENT_LOOP = "stapo_seeded_single_turn"
"""The agent loop of ``determinism=full`` (``actor_rollout_ref.rollout.agent.default_agent_loop``): verl's single-turn
loop with a sampling seed for each response (:class:`stapo.train.agent_loop.SeededSingleTurnAgentLoop`)."""
TAPE_GLOB = "rollouts-*.jsonl"
"""The files of a folder of recorded rollouts (``stapo.record_rollouts``), one per agent-loop process."""


@functools.cache
def methods() -> tuple[str, ...]:
    """Method names: the config files beside ``base.yaml`` (``stapo``, ``justrl``, ``grpo``, ``entropy20``)."""
    return tuple(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "base"))


@functools.cache
def sizes() -> tuple[str, ...]:
    """Model-size names: the files of ``configs/size`` (``qwen3_1.7b``, ``qwen3_8b``, ``qwen3_14b``)."""
    return tuple(sorted((p.stem for p in (CONFIG_DIR / "size").glob("*.yaml")), key=_size_key))


@functools.cache
def title(name: str) -> str:
    """The display name of a method or size in tables and plots: ``recipe.method_title`` or ``recipe.size_title``
    of its config file."""
    if (CONFIG_DIR / f"{name}.yaml").is_file():
        return str(OmegaConf.load(CONFIG_DIR / f"{name}.yaml").recipe.method_title)
    return str(OmegaConf.load(CONFIG_DIR / "size" / f"{name}.yaml").recipe.size_title)


def _size_key(name: str) -> float:
    number = name.rpartition("_")[2].rstrip("b")
    try:
        return float(number)
    except ValueError:
        return math.inf


class StapoConfigError(ValueError):
    """A STAPO setting is invalid; the message names the key and the fix."""


@dataclass(frozen=True)
class StapoConfig:
    """The ``stapo:`` block. Defaults are the paper's v4 values (STAPO, arXiv 2602.15620, hyper-parameter table);
    each field's ``help`` says what it does and where it comes from (``python -m stapo.train --help`` prints them)."""

    mask: Literal["none", "s2t", "top_entropy"] = field(
        default="none",
        metadata={
            "help": "s2t: STAPO's S2T mask; top_entropy: the 20-Entropy baseline (arXiv 2506.01939); none: GRPO, JustRL"
        },
    )
    tau_p: float = field(
        default=0.002,
        metadata={
            "help": "probability threshold tau_p in (0, 1]: candidates are tokens with p < tau_p in "
            "positive-advantage responses (paper: 0.002, for Qwen3's 151k-token vocabulary)"
        },
    )
    q: float = field(
        default=0.75,
        metadata={
            "help": "entropy quantile in [0, 1]: the bottom q of the candidates by entropy are silenced "
            "(paper v4: 0.75)"
        },
    )
    silence: Literal["low_entropy", "high_entropy", "random"] = field(
        default="low_entropy",
        metadata={
            "help": "which candidates S2T silences: low_entropy (STAPO); high_entropy or random: as many of them, the "
            "highest-entropy ones or a random draw (the paper's masking-strategy ablation)"
        },
    )
    policy_source: Literal["old", "current"] = field(
        default="old",
        metadata={
            "help": "old: p and H of the old policy, mask built on the driver before the update (exact "
            "renormalisation, no GPU cost); current: p and H of pi_theta inside the update (paper's Algorithm 1)"
        },
    )
    quantile_scope: Literal["mini_batch", "batch"] = field(
        default="mini_batch",
        metadata={"help": "mini_batch: one tau_h per PPO mini-batch (paper); batch: one per step (policy_source=old)"},
    )
    top_entropy_ratio: float = field(
        default=0.2,
        metadata={
            "help": "rho of 20-Entropy in (0, 1]: the share of response tokens kept by entropy (80/20 paper: 0.2)"
        },
    )
    top_entropy_norm: Literal["selected", "all"] = field(
        default="selected",
        metadata={
            "help": "20-Entropy loss denominator: selected (the kept tokens, the authors' code) or all (every "
            "response token, the 80/20 paper's formula)"
        },
    )
    observe_tau_p: float = field(
        default=0.0,
        metadata={
            "help": "a second tau_p at which the S2T rule's counts are logged too (s2t/observed/*), e.g. the paper's "
            "0.002 beside a larger tau_p that a small model needs; 0: none"
        },
    )
    metrics: bool = field(
        default=True,
        metadata={
            "help": "log the S2T rule and the paper's gradient-norm bound (s2t/*) every step, also when no "
            "mask is applied (JustRL, GRPO), for comparison"
        },
    )
    record_rollouts: str = field(
        default="",
        metadata={
            "help": "a folder: every response the rollout generates is written there, keyed by its request's seed "
            "(needs determinism=full); replay_rollouts reads it; empty: none"
        },
    )
    replay_rollouts: str = field(
        default="",
        metadata={
            "help": "a folder of record_rollouts: responses are read from it instead of generated, so that two runs "
            "train on the same rollouts (the training side's determinism apart from vLLM's); empty: none"
        },
    )
    deadline: str | float = field(
        default="",
        metadata={
            "help": "seconds from the launch, or a time (ISO 8601, local unless zoned), by which the run saves and "
            "exits with status 3 (the same command resumes); empty: the Slurm job's end time, if any"
        },
    )
    deadline_margin: float = field(
        default=60.0,
        metadata={"help": "seconds kept free before the deadline beside the longest step and save so far"},
    )

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for f in fields(self):
            value, kind = getattr(self, f.name), hints[f.name]
            if get_origin(kind) is Literal:
                if value not in get_args(kind):
                    allowed = ", ".join(get_args(kind))
                    raise StapoConfigError(f"stapo.{f.name}={value!r} is not allowed; use one of: {allowed}")
            elif kind is bool and not isinstance(value, bool):
                raise StapoConfigError(f"stapo.{f.name}={value!r} is not a boolean; use true or false")
            elif kind is str and not isinstance(value, str):
                raise StapoConfigError(f"stapo.{f.name}={value!r} is not a path; quote it: stapo.{f.name}='\"DIR\"'")
            elif kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise StapoConfigError(f"stapo.{f.name}={value!r} is not a number; {_RANGES[f.name][1]}")
        for key, (ok, allowed) in _RANGES.items():
            value = getattr(self, key)
            if math.isnan(value) or not ok(value):
                raise StapoConfigError(f"stapo.{key}={value!r} is out of range; {allowed}")
        if self.silence != "low_entropy" and (self.mask != "s2t" or self.policy_source != "old"):
            raise StapoConfigError(
                f"stapo.silence={self.silence} is an ablation of the S2T mask built on the driver: it needs "
                "stapo.mask=s2t and stapo.policy_source=old"
            )
        if self.deadline != "":
            parse_deadline(self.deadline, 0.0)
        if self.record_rollouts and self.replay_rollouts:
            raise StapoConfigError(
                "stapo.record_rollouts and stapo.replay_rollouts are both set: a run records its rollouts or replays "
                "another run's; set one"
            )
        if self.policy_source == "current" and self.quantile_scope == "batch":
            raise StapoConfigError(
                "stapo.quantile_scope=batch needs stapo.policy_source=old: with policy_source=current the mask is "
                "built inside the update, where only the current micro-batch exists; use quantile_scope=mini_batch"
            )

    @classmethod
    def from_node(cls, node: DictConfig | dict | None) -> StapoConfig:
        """Build and check from the ``stapo:`` node of a composed config (missing keys take the defaults)."""
        raw = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
        raw.pop("_target_", None)
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise StapoConfigError(f"stapo.{unknown[0]}: unknown key; the stapo block has {', '.join(known)}")
        return cls(**raw)

    @property
    def active(self) -> bool:
        """A mask is applied to the loss."""
        return self.mask != "none"


def parse_deadline(value: float | int | str, start: float) -> float:
    """``stapo.deadline`` as a Unix time: a number is seconds from ``start`` (the launch); a string is such a number
    or an ISO 8601 time (``2026-12-07T09:30``; without a zone, this machine's local time)."""
    if isinstance(value, bool):
        raise StapoConfigError(
            f"stapo.deadline={value!r}: give seconds from the launch or a time like 2026-12-07T09:30"
        )
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        try:
            seconds = float(value)
        except ValueError:
            try:
                moment = datetime.fromisoformat(value.strip())
            except ValueError:
                raise StapoConfigError(
                    f"stapo.deadline={value!r}: neither seconds from the launch nor an ISO 8601 time; give e.g. "
                    "stapo.deadline=86000 or stapo.deadline='\"2026-12-07T09:30\"'"
                ) from None
            return moment.timestamp()  # a naive time is local
    if not math.isfinite(seconds) or seconds < 0:
        raise StapoConfigError(f"stapo.deadline={value!r}: seconds from the launch must be 0 or more")
    return start + seconds


_RANGES = {
    "tau_p": (lambda v: 0.0 < v <= 1.0, "it must be a number in (0, 1] (paper: 0.002)"),
    "q": (lambda v: 0.0 <= v <= 1.0, "it must be a number in [0, 1] (paper: 0.75)"),
    "top_entropy_ratio": (lambda v: 0.0 < v <= 1.0, "it must be a number in (0, 1] (20-Entropy: 0.2)"),
    "observe_tau_p": (lambda v: 0.0 <= v <= 1.0, "it must be a number in (0, 1], or 0 for none"),
    "deadline_margin": (lambda v: 0.0 <= v < math.inf, "it must be seconds, 0 or more (default 60)"),
}
