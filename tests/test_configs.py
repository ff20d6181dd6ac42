"""Every recipe config composes against the installed verl and passes verl's own validation and ours; the typed
``stapo:`` block names the key of every bad value; the ``auto`` attention settings resolve; the plugin registers
the trainer mode and the attention in a fresh ``import verl`` process; ``--help`` lists the recipe's options."""

import os
import subprocess
import sys
from dataclasses import fields

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass

from stapo.config import CONFIG_DIR, SEEDED_AGENT_LOOP, StapoConfig, StapoConfigError, methods, sizes, title
from stapo.train import attention, preflight
from stapo.train.main import ConfigError, usage, validate

MASKS = {"stapo": "s2t", "justrl": "none", "grpo": "none", "entropy20": "top_entropy"}
ABLATIONS = {"stapo_random": "random", "stapo_high_entropy": "high_entropy"}
"""The masking-strategy ablations: STAPO's config with another choice of the silenced candidates."""
MODELS = {"qwen3_1.7b": "Qwen/Qwen3-1.7B-Base", "qwen3_8b": "Qwen/Qwen3-8B-Base", "qwen3_14b": "Qwen/Qwen3-14B-Base"}


def load(name="stapo", *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def test_methods_and_sizes_come_from_the_config_folder():
    assert methods() == tuple(sorted([*MASKS, *ABLATIONS])) and sizes() == (*MODELS, "smollm2_135m")
    assert [title(m) for m in ("grpo", "entropy20", "justrl", "stapo")] == ["GRPO", "20-Entropy", "JustRL", "STAPO"]
    assert [title(s) for s in sizes()] == ["1.7B", "8B", "14B", "SmolLM2-135M"]


@pytest.mark.parametrize("method", MASKS)
def test_the_smollm2_size_file_fits_its_model_on_one_gpu(method):
    """The size file to copy for a model of one's own: SmolLM2-135M's 8,192-token context holds prompt and response,
    one GPU, four PPO mini-batches; the method's settings are untouched."""
    cfg = load(method, "size=smollm2_135m")
    stapo = validate(cfg, environment=False)
    assert stapo.mask == MASKS[method] and cfg.trainer.experiment_name == f"{method}_smollm2_135m"
    assert cfg.data.max_prompt_length + cfg.data.max_response_length <= 8192
    assert cfg.data.train_batch_size == 4 * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 1
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == load(method).actor_rollout_ref.actor.clip_ratio_high


@pytest.mark.parametrize("size", MODELS)
@pytest.mark.parametrize("method", MASKS)
def test_every_config_composes_and_validates(method, size):
    cfg = load(method, f"size={size}")
    stapo = validate(cfg, environment=False)  # ours, then verl's validate_config
    assert stapo.mask == MASKS[method] and stapo.metrics
    assert cfg.actor_rollout_ref.model.path == MODELS[size]
    assert cfg.trainer.experiment_name == f"{method}_{size}"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # what the trainer ships to the workers
    assert actor.optim.lr == 1e-6 and actor.optim.lr_warmup_steps == 10 and actor.optim.clip_grad == 1.0
    assert actor.entropy_coeff == 0 and actor.optim.weight_decay == 0.1
    assert cfg.data.train_batch_size == 256 and actor.ppo_mini_batch_size == 64
    assert cfg.actor_rollout_ref.rollout.n == 8 and cfg.data.max_response_length == 15360
    assert (cfg.actor_rollout_ref.rollout.temperature, cfg.actor_rollout_ref.rollout.top_p) == (1.0, 1.0)
    if method == "grpo":
        assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.use_kl_loss) == (0.2, 0.2, True)
    else:
        assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.use_kl_loss) == (0.2, 0.28, False)
        assert actor.loss_agg_mode == "token-mean"
    assert cfg.trainer.v1.trainer_mode == "stapo_sync"
    assert cfg.reward.custom_reward_function.name == "compute_score"  # math-verify; dapo_score is the option
    # auto resolved: no flash-attn on this machine
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == attention.NAME
    assert cfg.actor_rollout_ref.model.use_fused_kernels is True


@pytest.mark.parametrize("method", ABLATIONS)
def test_the_ablations_are_stapo_with_another_choice(method):
    stapo = validate(load(method), environment=False)
    assert (stapo.mask, stapo.silence, stapo.policy_source) == ("s2t", ABLATIONS[method], "old")
    assert validate(load("stapo"), environment=False).silence == "low_entropy"
    assert omega_conf_to_dataclass(load(method).actor_rollout_ref.actor) == omega_conf_to_dataclass(
        load("stapo").actor_rollout_ref.actor
    )


@pytest.mark.parametrize(
    "overrides",
    [["stapo.silence=random", "stapo.policy_source=current"], ["stapo.silence=random", "stapo.mask=top_entropy"]],
)
def test_an_ablation_needs_the_driver_s2t_mask(overrides):
    with pytest.raises(StapoConfigError, match="stapo.silence=random is an ablation of the S2T mask"):
        StapoConfig.from_node(load("stapo", *overrides).stapo)


def test_paper_defaults_live_in_the_typed_config_only():
    import hydra.utils

    stapo, justrl = load("stapo").stapo, load("justrl").stapo
    assert StapoConfig.from_node(stapo) == StapoConfig(mask="s2t", tau_p=0.002, q=0.75)
    assert set(justrl) - {"_target_"} == {f.name for f in fields(StapoConfig)}  # every knob in base.yaml, no other
    for f in fields(StapoConfig):
        assert justrl[f.name] == f.default, f"base.yaml's stapo.{f.name} differs from StapoConfig"
    assert hydra.utils.instantiate(stapo) == StapoConfig(mask="s2t")  # the YAML's _target_


@pytest.mark.parametrize(
    "override, message",
    [
        ("stapo.tau_p=0", r"stapo\.tau_p=0 is out of range; it must be a number in \(0, 1\]"),
        ("stapo.tau_p=1.5", r"stapo\.tau_p=1\.5 is out of range"),
        ("stapo.q=1.2", r"stapo\.q=1\.2 is out of range; it must be a number in \[0, 1\]"),
        ("stapo.q=-0.1", r"stapo\.q=-0\.1 is out of range"),
        ("stapo.tau_p=abc", r"stapo\.tau_p='abc' is not a number; it must be a number in \(0, 1\]"),
        ("stapo.top_entropy_ratio=0", r"stapo\.top_entropy_ratio=0 is out of range"),
        ("stapo.metrics=maybe", r"stapo\.metrics='maybe' is not a boolean"),
        ("stapo.mask=random", r"stapo\.mask='random' is not allowed; use one of: none, s2t, top_entropy"),
        ("stapo.policy_source=new", r"stapo\.policy_source='new' is not allowed; use one of: old, current"),
        ("stapo.quantile_scope=micro", r"stapo\.quantile_scope='micro' is not allowed"),
        ("stapo.top_entropy_norm=some", r"stapo\.top_entropy_norm='some' is not allowed; use one of: selected, all"),
        ("+stapo.tau=0.1", r"stapo\.tau: unknown key; the stapo block has mask, tau_p"),
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
        preflight.validate_training_config(cfg)


def test_good_variants_pass():
    for method, overrides in (
        ("stapo", ["stapo.policy_source=current", "actor_rollout_ref.actor.calculate_entropy=True"]),
        ("stapo", ["stapo.quantile_scope=batch", "actor_rollout_ref.actor.ppo_epochs=2"]),
        ("stapo", ["stapo.q=0", "stapo.tau_p=1"]),
        ("justrl", ["trainer.v1.trainer_mode=sync", "stapo.metrics=false"]),  # verl's stock trainer
        ("entropy20", ["stapo.top_entropy_norm=all"]),
    ):
        preflight.validate_training_config(load(method, *overrides))


def test_auto_attention_resolves_to_what_is_installed(monkeypatch):
    """flash-attn cannot be installed on a CPU machine: its presence is stubbed (attention.flash_attn_installed)."""
    assert attention.resolve("auto", "auto") == (attention.NAME, True)  # this machine: no flash-attn
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    assert attention.resolve("auto", "auto") == ("flash_attention_2", False)
    assert attention.resolve("sdpa", False) == ("sdpa", False)  # explicit choices are kept
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)
    monkeypatch.setattr(attention, "varlen_supported", lambda: False)
    with pytest.raises(RuntimeError, match="attn_implementation=auto: flash-attn is not installed and torch"):
        attention.resolve("auto", "auto")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["size=qwen3_8b", "actor_rollout_ref.model.override_config.attn_implementation=sdpa"],
            r"actor_rollout_ref\.actor\.ulysses_sequence_parallel_size=2 with .*=sdpa: verl's Ulysses all-to-all",
        ),
        (
            ["actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2"],
            r"=flash_attention_2 but flash-attn is not installed",
        ),
        (["actor_rollout_ref.model.use_remove_padding=False"], r"torch_varlen runs packed sequences"),
    ],
)
def test_attention_settings_that_cannot_work_stop_the_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load("stapo", *overrides), environment=False)


def test_plugin_registers_through_the_entry_point_and_the_env_var():
    clean = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    assert _run({**clean, "VERL_USE_EXTERNAL_PLUGINS": "auto"}) == "True True True"
    modules = {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "stapo.train.plugin"}
    assert _run({**clean, **modules}) == "True True True"
    assert _run({**clean, "VERL_USE_EXTERNAL_PLUGINS": "none"}) == "False False False"  # the check can fail


def _run(env):
    """Whether a fresh ``import verl`` registered the trainer mode, the attention and the agent loop of
    ``determinism=full`` (which verl's agent-loop workers look up by name)."""
    code = (
        "import verl\nfrom verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY\n"
        "from transformers import AttentionInterface\n"
        "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry\n"
        "print('stapo_sync' in TRAINER_REGISTRY, 'torch_varlen' in AttentionInterface._global_mapping,"
        f" {SEEDED_AGENT_LOOP!r} in _agent_loop_registry)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_training_entry_stops_when_the_package_is_not_installed(monkeypatch):
    preflight.check_installed()  # installed by the README's set-up command: the entry point exists
    monkeypatch.setattr(preflight, "entry_points", lambda group: [])
    with pytest.raises(RuntimeError, match="pip install -e ."):
        preflight.check_installed()


def test_help_lists_methods_sizes_and_every_stapo_key():
    out = subprocess.run([sys.executable, "-m", "stapo.train", "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == usage()
    assert len(out.stdout.splitlines()) < 30  # not verl's 1,100-line config
    for name in (*methods(), *sizes(), *(f"stapo.{f.name}=" for f in fields(StapoConfig))):
        assert name in out.stdout
    assert "| stapo: stapo.mask=s2t |" in out.stdout and "entropy20: stapo.mask=top_entropy |" in out.stdout


def test_the_plugin_keeps_the_workers_imports_small():
    """Every Ray process imports the plugin: it must not pull in the data tool (its CLI, pyarrow tables, hub
    clients), which only the driver's preflight needs."""
    code = "import sys, stapo.train.plugin; print('stapo.tools.data' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_yaml_typo_in_a_config_is_named_by_file_line_and_column(tmp_path):
    """An edit that breaks a config file's YAML (issue 38: a 75-line Hydra traceback at commit ea1edb6) is one line
    with the file, line and column; the shipped configs have none."""
    import shutil

    from stapo.train.main import yaml_problems

    assert yaml_problems() == []
    shutil.copytree(CONFIG_DIR, tmp_path / "configs", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    stapo_yaml = tmp_path / "configs" / "stapo.yaml"
    stapo_yaml.write_text(stapo_yaml.read_text().replace("  mask: s2t", "  mask: [s2t"))
    (problem,) = yaml_problems(tmp_path / "configs")
    assert problem.startswith(f"{stapo_yaml}, line ") and ", column " in problem and "a YAML syntax error" in problem


def test_determinism_full_reaches_every_flag_and_verls_environment(monkeypatch):
    """``determinism=full`` turns on verl's flags in the rollout and both FSDP engines, as verl's own config classes
    read them, and verl's main_ppo then sets the processes' environment before Ray starts (run here up to
    ``ray.init``, which is stopped: no cluster is needed to see it); a subset of the flags is refused in one line."""
    from verl.trainer import main_ppo

    cfg = load("stapo", "determinism=full")
    validate(cfg, environment=False)
    for key in preflight.DETERMINISM:
        assert OmegaConf.select(cfg, key) is True, key
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout).full_determinism
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).fsdp_config.full_determinism
    assert not any(OmegaConf.select(load("stapo"), key) for key in preflight.DETERMINISM)  # off by default
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert not rollout.enable_prefix_caching and rollout.agent.default_agent_loop == SEEDED_AGENT_LOOP
    assert rollout.enforce_eager and not load("stapo").actor_rollout_ref.rollout.enforce_eager
    assert load("stapo").actor_rollout_ref.rollout.enable_prefix_caching  # verl's default stays otherwise

    class Stop(Exception):
        pass

    def stop(**kwargs):
        raise Stop

    for name in ("VERL_FULL_DETERMINISM", "VLLM_BATCH_INVARIANT", "PYTHONHASHSEED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(main_ppo.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(main_ppo.ray, "init", stop)
    with pytest.raises(Stop):
        main_ppo.run_ppo(cfg, task_runner_class=main_ppo.TaskRunnerV1)
    assert os.environ["VERL_FULL_DETERMINISM"] == "1" and os.environ["VLLM_BATCH_INVARIANT"] == "1"
    assert os.environ["PYTHONHASHSEED"] == str(cfg.actor_rollout_ref.rollout.seed)

    partial = load("stapo", "actor_rollout_ref.rollout.full_determinism=true")
    with pytest.raises(ConfigError) as refused:
        validate(partial, environment=False)
    (line,) = str(refused.value).splitlines()
    assert line.startswith("determinism is partial (actor_rollout_ref.rollout.full_determinism=true, ")
    assert "set determinism=full" in line

    # all three flags (and eager vLLM) but verl's own agent loop: every response of a prompt would have one seed
    flags = [f"{key}=true" for key in preflight.DETERMINISM] + ["actor_rollout_ref.rollout.enforce_eager=true"]
    same_seed = load("stapo", *flags)
    assert same_seed.actor_rollout_ref.rollout.agent.default_agent_loop == "single_turn_agent"  # verl's default
    with pytest.raises(ConfigError) as refused:
        validate(same_seed, environment=False)
    (line,) = str(refused.value).splitlines()
    assert line.startswith("actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent: ")
    assert f"set it to {SEEDED_AGENT_LOOP} (determinism=full does)" in line
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == SEEDED_AGENT_LOOP
    with pytest.raises(ConfigError) as refused:  # the asynchronous modes train on whichever groups finished
        validate(load("stapo", "determinism=full", "trainer.v1.trainer_mode=stapo_colocate_async"), environment=False)
    (line,) = str(refused.value).splitlines()
    assert line.startswith("trainer.v1.trainer_mode=stapo_colocate_async with determinism=full: ")
    with pytest.raises(ConfigError) as refused:  # a compiled vLLM does not start under verl's determinism
        validate(load("stapo", "determinism=full", "actor_rollout_ref.rollout.enforce_eager=false"), environment=False)
    (line,) = str(refused.value).splitlines()
    assert line.startswith("actor_rollout_ref.rollout.enforce_eager=false with determinism=full: ")
    one = ["actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.val_kwargs.n=1"]
    validate(load("stapo", *flags, *one), environment=False)  # one response a prompt: nothing to tell apart
    with pytest.raises(ConfigError, match="default_agent_loop=single_turn_agent: "):
        validate(load("stapo", *flags, one[0]), environment=False)  # validation's avg@32 would be one sample


def test_the_launching_shells_paths_reach_the_runs_processes_on_any_cluster(monkeypatch, tmp_path):
    """``VERL_FILE_LOGGER_PATH`` and ``STAPO_AUDIT_DIR`` set where a run is launched travel in its Ray runtime
    environment, as absolute paths, to the cluster's processes (which get the cluster's environment, not the
    driver's): what verl's main_ppo hands to ``ray.init`` (stopped there: no cluster is needed to see it)."""
    from verl.trainer import main_ppo

    from stapo.train.main import forward_env

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", "runs/a.jsonl")
    monkeypatch.delenv("STAPO_AUDIT_DIR", raising=False)
    cfg = load("stapo")
    forward_env(cfg)
    seen = {}

    class Stop(Exception):
        pass

    def stop(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(main_ppo.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(main_ppo.ray, "init", stop)
    with pytest.raises(Stop):
        main_ppo.run_ppo(cfg, task_runner_class=main_ppo.TaskRunnerV1)
    env_vars = seen["runtime_env"]["env_vars"]
    assert env_vars["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "runs" / "a.jsonl") and "STAPO_AUDIT_DIR" not in env_vars
    given = load("stapo", "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH=/given/m.jsonl")
    forward_env(given)  # one set in the config (the quickstart's runs) is kept
    assert given.ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH == "/given/m.jsonl"
