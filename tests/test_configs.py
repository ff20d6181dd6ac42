"""Every recipe config composes against the installed verl, passes verl's own validation and ours; bad STAPO
values fail with the key named; the plugin registers in a fresh ``import verl`` process."""

import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from verl.utils.config import omega_conf_to_dataclass

from stapo.config import CONFIG_DIR, StapoConfig, StapoConfigError, validate_training_config
from stapo.train import validate

METHODS = {"stapo": "s2t", "justrl": "none", "grpo": "none", "entropy20": "top_entropy"}
SIZES = {"qwen3_1.7b": "Qwen/Qwen3-1.7B-Base", "qwen3_8b": "Qwen/Qwen3-8B-Base", "qwen3_14b": "Qwen/Qwen3-14B-Base"}


def load(name="stapo", *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("method", METHODS)
def test_every_config_composes_and_validates(method, size):
    cfg = load(method, f"size={size}")
    stapo = validate(cfg)  # verl's validate_config, then ours
    assert stapo.mask == METHODS[method]
    assert cfg.actor_rollout_ref.model.path == SIZES[size]
    assert cfg.trainer.experiment_name == f"{method}_{size}"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # what the trainer ships to the workers
    assert actor.optim.lr == 1e-6 and actor.optim.lr_warmup_steps == 10 and actor.entropy_coeff == 0
    assert cfg.data.train_batch_size == 256 and actor.ppo_mini_batch_size == 64
    assert cfg.actor_rollout_ref.rollout.n == 8 and cfg.data.max_response_length == 15360
    assert (cfg.actor_rollout_ref.rollout.temperature, cfg.actor_rollout_ref.rollout.top_p) == (1.0, 1.0)
    if method == "grpo":
        assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.use_kl_loss) == (0.2, 0.2, True)
    else:
        assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.use_kl_loss) == (0.2, 0.28, False)
        assert actor.loss_agg_mode == "token-mean"
    assert cfg.trainer.v1.trainer_mode == ("sync" if METHODS[method] == "none" else "stapo_sync")


def test_paper_defaults():
    cfg = load("stapo")
    assert StapoConfig.from_node(cfg.stapo) == StapoConfig(mask="s2t", tau_p=0.002, q=0.75)


@pytest.mark.parametrize(
    "override, message",
    [
        ("stapo.tau_p=0", r"stapo\.tau_p=0 is out of range; it must be a number in \(0, 1\]"),
        ("stapo.tau_p=1.5", r"stapo\.tau_p=1\.5 is out of range"),
        ("stapo.q=1.2", r"stapo\.q=1\.2 is out of range; it must be a number in \[0, 1\]"),
        ("stapo.q=-0.1", r"stapo\.q=-0\.1 is out of range"),
        ("stapo.tau_p=abc", r"stapo\.tau_p='abc' is out of range"),
        ("stapo.top_entropy_ratio=0", r"stapo\.top_entropy_ratio=0 is out of range"),
        ("stapo.mask=random", r"stapo\.mask='random' is not allowed; use one of: none, s2t, top_entropy"),
        ("stapo.policy_source=new", r"stapo\.policy_source='new' is not allowed; use one of: old, current"),
        ("stapo.quantile_scope=micro", r"stapo\.quantile_scope='micro' is not allowed"),
        ("+stapo.tau=0.1", r"stapo\.tau: unknown key; allowed keys are"),
        (
            "trainer.v1.trainer_mode=sync",
            r"trainer\.v1\.trainer_mode='sync': stapo\.mask=s2t needs trainer\.v1\.trainer_mode=stapo_sync",
        ),
        ("trainer.use_v1=False", r"trainer\.use_v1=False"),
        ("stapo.policy_source=current", r"actor_rollout_ref\.actor\.calculate_entropy=False"),
        (
            "stapo.quantile_scope=batch stapo.policy_source=current",
            r"stapo\.quantile_scope=batch needs stapo\.policy_source=old",
        ),
        (
            "actor_rollout_ref.actor.ppo_epochs=2 actor_rollout_ref.actor.shuffle=True",
            r"actor_rollout_ref\.actor\.shuffle=True with ppo_epochs>1",
        ),
    ],
)
def test_bad_stapo_values_name_the_key(override, message):
    cfg = load("stapo", *override.split())
    with pytest.raises(StapoConfigError, match=message):
        validate_training_config(cfg)


def test_good_variants_pass():
    for overrides in (
        ["stapo.policy_source=current", "actor_rollout_ref.actor.calculate_entropy=True"],
        ["stapo.quantile_scope=batch", "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.shuffle=True"],
        ["stapo.q=0", "stapo.tau_p=1"],
    ):
        validate_training_config(load("stapo", *overrides))


def test_plugin_registers_through_the_entry_point_and_the_env_var():
    clean = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    assert _run({**clean, "VERL_USE_EXTERNAL_PLUGINS": "auto"})
    assert _run({**clean, "VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "stapo.plugin"})
    assert not _run({**clean, "VERL_USE_EXTERNAL_PLUGINS": "none"})  # the check can fail


def _run(env):
    code = "import verl\nfrom verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY\nprint(sorted(TRAINER_REGISTRY))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return "stapo_sync" in out.stdout


def test_training_entry_stops_when_the_package_is_not_installed(monkeypatch):
    import stapo.train

    check = stapo.train.check_installed
    check()  # installed by the README's set-up command: the entry point exists
    monkeypatch.setattr(stapo.train, "entry_points", lambda group: [])
    with pytest.raises(RuntimeError, match="pip install -e ."):
        check()
