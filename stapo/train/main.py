"""Training entry point: ``python -m stapo.train --config-name <method> size=<size> [override ...]``
(``bash scripts/train.sh METHOD SIZE`` runs it).

A thin wrapper around verl's ``verl.trainer.main_ppo``: it composes the recipe's YAML (deltas over verl's own
``ppo_trainer``), checks the ``stapo:`` block, resolves the ``auto`` attention settings, runs the preflight checks
(GPUs, data, model, attention) and verl's own config rules on the driver, checks that the recipe is installed where
Ray will look for it, and then runs verl's V1 task runner unchanged. Any Hydra override works, e.g.
``stapo.tau_p=0.001 trainer.n_gpus_per_node=4``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path

import hydra
from omegaconf import DictConfig, open_dict

from stapo.config import CONFIG_DIR, StapoConfig, StapoConfigError, methods, sizes
from stapo.train import deadline, nodes, preflight, startup_cuts


class ConfigError(RuntimeError):
    """The composed config cannot run; one line per problem."""


def validate(config: DictConfig, environment: bool = True, overrides: Sequence[str] = ()) -> StapoConfig:
    """All checks that can run before Ray starts: verl's numeric keys and the ``+KEY`` ``overrides`` that look like
    typos, the ``stapo:`` block, the ``auto`` settings, the preflight checks (with ``environment``: GPUs, data, model
    too), then verl's own config rules. Raises :class:`ConfigError` with one line per problem."""
    counts = preflight.count_problems(config) + preflight.added_key_problems(config, overrides)  # first: the checks
    # below compute with these
    try:
        startup_cuts.selected()
    except ValueError as error:
        counts.append(str(error))
    if counts:
        raise ConfigError("\n".join(counts))
    try:
        stapo = preflight.validate_training_config(config)
        preflight.resolve_auto(config)
    except (StapoConfigError, RuntimeError) as error:
        raise ConfigError(str(error)) from None
    found = preflight.config_problems(config) + (preflight.environment_problems(config) if environment else [])
    if found:
        raise ConfigError("\n".join(found))
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    try:
        validate_config(
            config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
        )
    except (AssertionError, ValueError) as error:
        raise ConfigError(f"verl's config check: {error}") from None
    return stapo


def config_problem(runs: dict[str, tuple[str, Sequence[str]]], overrides: Sequence[str]) -> tuple[str, str] | None:
    """The first of ``runs`` (name -> config name, Hydra overrides) whose composed config would not pass
    :func:`validate` without looking at files or GPUs, as (name, Hydra's or the check's message), or None. ``overrides``
    are the user's own, whose ``+KEY`` typos :func:`validate` looks for."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        for name, (config_name, argv) in runs.items():
            try:
                validate(compose(config_name, list(argv)), False, overrides)
            except Exception as error:  # Hydra's and the trainer's errors name the key
                return name, str(error)
    return None


FORWARDED_ENV = ("VERL_FILE_LOGGER_PATH", "STAPO_AUDIT_DIR")
"""Paths set in the launching shell that verl's processes read: Ray hands a job's processes the environment of the
cluster they run in, not the driver's, so on a cluster given by ``RAY_ADDRESS`` (scripts/slurm.sbatch) they would
not arrive (a run of 2026-11-28 wrote its metrics to verl's default path). They travel in the run's Ray runtime
environment, as absolute paths (the processes' working folder differs); one set there already is kept."""


def forward_env(config: DictConfig) -> None:
    """Copy :data:`FORWARDED_ENV` from this process into ``ray_kwargs.ray_init.runtime_env.env_vars``."""
    env_vars = config.ray_kwargs.ray_init.runtime_env.env_vars
    with open_dict(env_vars):
        for name in FORWARDED_ENV:
            if os.environ.get(name) and name not in env_vars:
                env_vars[name] = str(Path(os.environ[name]).absolute())


def absolute_tapes(config: DictConfig) -> None:
    """``stapo.record_rollouts`` and ``stapo.replay_rollouts`` as absolute paths: the agent-loop processes that read
    them run in another working folder."""
    with open_dict(config.stapo):
        for key in ("record_rollouts", "replay_rollouts"):
            if config.stapo.get(key):
                config.stapo[key] = str(Path(config.stapo[key]).expanduser().absolute())


def prepare_stop(config: DictConfig, start: float) -> Path:
    """Before Ray: the run's checkpoint folder as an absolute path (the driver and the trainer, which may run in
    another folder or on another node, read the stop files there), ``stapo.deadline`` resolved to a time from its
    first source (:func:`stapo.train.deadline.find_deadline`), the last launch's stop files removed, and the signals
    armed; returns the folder."""
    folder = Path(config.trainer.default_local_dir).expanduser().absolute()
    found = deadline.find_deadline(config.stapo.get("deadline"), os.environ, start)
    if found and (problem := stop_problem(config, *found)):
        if found[1] == "stapo.deadline":
            raise ConfigError(problem)
        print(f"STAPO: no save before {found[1]}: {problem}")
        found = None
    with open_dict(config):
        config.trainer.default_local_dir = str(folder)
        config.stapo.deadline = datetime.fromtimestamp(found[0], timezone.utc).isoformat() if found else ""
    if found:
        when = datetime.fromtimestamp(found[0]).astimezone().isoformat(sep=" ", timespec="seconds")
        print(
            f"STAPO: deadline {when} ({found[1]}): the run saves and exits with status {deadline.RESUME_EXIT} when "
            f"its longest step, a save and {config.stapo.deadline_margin:g} s no longer fit"
        )
    deadline.clear(folder)
    deadline.arm(folder)
    return folder


def stop_problem(config: DictConfig, end: float, source: str) -> str | None:
    """Why the run could not save before the deadline ``end`` (Unix time, from ``source``) and resume from it."""
    from stapo.config import TRAINER_MODES

    mode = config.trainer.v1.trainer_mode
    if mode not in TRAINER_MODES:
        return f"trainer.v1.trainer_mode={mode}: only the recipe's trainer modes ({', '.join(TRAINER_MODES)}) save"
    if (config.actor_rollout_ref.actor.get("checkpoint") or {}).get("async_save", False):
        return "actor_rollout_ref.actor.checkpoint.async_save=True: the save must be on disk before the run exits"
    if config.trainer.resume_mode != "auto":
        return f"trainer.resume_mode={config.trainer.resume_mode}: the same command would not resume from the save"
    if end <= time.time():
        return f"{source} has passed already ({datetime.fromtimestamp(end).astimezone().isoformat(timespec='seconds')})"
    return None


def finish_stop(config: DictConfig, folder: Path) -> None:
    """After the trainer returned: exit with status 3 if it saved and stopped early, saying how to go on (status 1 where
    the same command would not resume from that checkpoint)."""
    saved = deadline.clear(folder)
    if saved is None:
        return
    resume = config.trainer.resume_mode
    if resume != "auto":
        raise SystemExit(
            f"STAPO: saved step {saved['step']} in {folder} ({saved['reason']}); trainer.resume_mode={resume}: the "
            "same command would not resume from it; set trainer.resume_mode=auto to resume"
        )
    print(f"STAPO: saved step {saved['step']} in {folder} ({saved['reason']}); run the same command to resume from it")
    raise SystemExit(deadline.RESUME_EXIT)


class ArmedRunner:
    """verl's task runner class as ``run_ppo`` takes it, the driver's signals armed again and its node watcher started
    (:mod:`stapo.train.nodes`) when ``run_ppo`` creates the runner, Ray being up: Ray 2.60's ``ray.init`` (and the
    local node it starts) install SIGTERM handlers of their own in the driver, which would end it at once instead of
    asking for a save (:mod:`stapo.train.deadline`). Ray's own shutdown still runs when the driver exits."""

    def __init__(self, cls):
        self.cls = cls

    def remote(self, *args, **kwargs):
        deadline.arm()
        nodes.watch()
        return self.cls.remote(*args, **kwargs)

    def options(self, **kwargs):
        deadline.arm()
        nodes.watch()
        return self.cls.options(**kwargs)


def run(config: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    validate(config, overrides=HydraConfig.get().overrides.task)
    forward_env(config)
    absolute_tapes(config)
    preflight.check_installed()
    folder = prepare_stop(config, deadline.launched_at())
    for line in startup_cuts.apply(config):
        print(f"STAPO: {line}")
    startup_cuts.forward(config)
    from verl.trainer.main_ppo import TaskRunnerV1

    run_verl(config, TaskRunnerV1)
    finish_stop(config, folder)


def run_verl(config: DictConfig, runner) -> None:
    """verl's ``run_ppo`` with the task runner class ``runner`` (:class:`ArmedRunner`), the node watcher stopped when
    it returns; an error with a lost node behind it (the runner was on that node) ends the run with the node's line
    and status (:func:`stapo.train.nodes.check`), not a traceback."""
    from verl.trainer.main_ppo import run_ppo

    try:
        run_ppo(config, task_runner_class=ArmedRunner(runner))
    except Exception as error:
        nodes.check(error)
        raise
    finally:
        nodes.unwatch()


def method_settings() -> str:
    """What each method's config file sets in the ``stapo:`` block over base.yaml's values, wrapped to the terminal's
    usual width (``--help``)."""
    import textwrap

    import yaml

    shown = []
    for method in methods():
        block = (yaml.safe_load((CONFIG_DIR / f"{method}.yaml").read_text(encoding="utf-8")) or {}).get("stapo") or {}
        values = " ".join(f"stapo.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in block.items())
        shown.append(f"{method}: {values or '-'}")
    return textwrap.fill("Each METHOD sets: " + " | ".join(shown), 118, subsequent_indent="  ")


def usage() -> str:
    """What ``--help`` prints: the recipe's own options, not verl's 1,100-line config."""
    settings = [
        (f"stapo.{f.name}={str(f.default).lower() if f.type == 'bool' else f.default}", f) for f in fields(StapoConfig)
    ]
    knobs = "\n".join(f"  {setting:<34} {f.metadata['help']}" for setting, f in settings)
    return (
        "usage: python -m stapo.train --config-name METHOD [size=SIZE] [KEY=VALUE ...]\n"
        "       bash scripts/train.sh METHOD SIZE [KEY=VALUE ...]\n\n"
        f"METHOD: {' | '.join(methods())}   SIZE: {' | '.join(sizes())} (default qwen3_1.7b)\n"
        f"Configs: {CONFIG_DIR} (base.yaml, one file per method, size/*.yaml)\n\n"
        f"The stapo block (base.yaml's values; docs/configuration.md):\n{knobs}\n{method_settings()}\n\n"
        "Any key of verl's ppo_trainer config can be overridden, e.g. trainer.n_gpus_per_node=4 data.train_files=F.\n"
        "Print the composed config without running: python -m stapo.train --config-name=stapo --cfg=job"
    )


@hydra.main(config_path=str(CONFIG_DIR), config_name="stapo", version_base=None)
def _hydra_main(config: DictConfig) -> None:
    try:
        run(config)
    except ConfigError as error:
        raise SystemExit("\n".join(f"error: {line}" for line in str(error).splitlines())) from None


def yaml_problems(folder: Path = CONFIG_DIR) -> list[str]:
    """A YAML syntax error in any of the recipe's config files, as ``FILE, line L, column C: problem`` (Hydra would
    answer it with a 75-line traceback)."""
    import yaml

    found = []
    for path in sorted(folder.rglob("*.yaml")):
        try:
            yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            found.append(f"{path}{where}: {error.problem or error.context} (a YAML syntax error; fix the file)")
        except yaml.YAMLError as error:
            found.append(f"{path}: {error} (a YAML syntax error; fix the file)")
    return found


def check_names(argv: list[str]) -> None:
    """Stop with one line when the method (``--config-name``), ``size=`` or another config group's choice
    (``determinism=``: a folder of configs/) names no config file, or a config file is not valid YAML."""
    for problem in yaml_problems():
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    folders = [d for d in CONFIG_DIR.iterdir() if d.is_dir() and not d.name.startswith("_")]
    groups = {d.name: tuple(sorted(f.stem for f in d.glob("*.yaml"))) for d in folders}
    groups["size"] = sizes()
    values: dict[str, str | None] = {"method": "stapo", **dict.fromkeys(groups)}
    for i, arg in enumerate(argv):
        if arg.startswith("--config-name"):
            values["method"] = arg.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
        elif (group := arg.partition("=")[0]) in groups and "=" in arg:
            values[group] = arg.partition("=")[2]
    for kind, allowed in (("method", methods()), *groups.items()):
        if values[kind] is not None and values[kind] not in allowed:
            print(f"error: unknown {kind} '{values[kind]}'; choose one of: {', '.join(allowed)}", file=sys.stderr)
            raise SystemExit(2)


HYDRA_VALUE_FLAGS = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--cfg", "-c", "--package",
                     "-p", "--info", "-i")  # fmt: skip
"""Hydra's flags whose value may follow as the next argument (``--cfg job``): that value is no override."""
_KEY = re.compile(r"[+~]{0,2}[A-Za-z_][\w.-]*")


def overrides_of(argv: Sequence[str]) -> list[str]:
    """The Hydra overrides of ``argv``: what is neither a flag nor a flag's value."""
    return [
        arg for i, arg in enumerate(argv)
        if not arg.startswith("-") and not (i and argv[i - 1] in HYDRA_VALUE_FLAGS)
    ]  # fmt: skip


def parse_problem(argv: Sequence[str]) -> str | None:
    """The first override of ``argv`` that Hydra's grammar cannot parse, as one line that says what to write: a key
    without ``=`` (``stapo.tau_p 0.1``), a value the shell split at a space, or one with a space, ``ü`` or a stray
    quote, shown quoted; Hydra would answer with a ``LexerNoViableAltException`` and no hint."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    overrides = overrides_of(argv)
    for i, arg in enumerate(overrides):
        try:
            parser.parse_overrides([arg])
        except OverrideParseException:
            following = overrides[i + 1] if i + 1 < len(overrides) else None
            if _KEY.fullmatch(arg) and "." in arg and (following is None or "=" not in following):
                value = following if following is not None else "VALUE"
                return f"{arg}{' ' + following if following else ''}: an override is KEY=VALUE; write {arg}={value}"
            split = "=" not in arg and i > 0 and "=" in overrides[i - 1]  # a value the shell split at a space
            whole = f"{overrides[i - 1]} {arg}" if split else arg
            key, _, value = whole.partition("=")
            reason = (
                "split at a space by the shell"
                if split
                else "Hydra cannot parse it (a space, a non-ASCII letter or a quote in a value needs quoting)"
            )
            return f"{whole}: {reason}; quote the value: '{key}=\"{value}\"' (single quotes around it all)"
    return None


def key_problem(argv: Sequence[str]) -> str | None:
    """An override of a key that the composed config does not have (a typo: Hydra would answer with several lines
    that suggest adding it with ``+``), as one line naming the nearest key; None when the config composes."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    method = next((a.partition("=")[2] or argv[i + 1] for i, a in enumerate(argv) if a.split("=")[0] in
                   ("--config-name", "-cn") and (a.partition("=")[2] or i + 1 < len(argv))), "stapo")  # fmt: skip
    overrides = overrides_of(argv)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        try:
            compose(method, overrides)
            return None
        except ConfigCompositionException as error:
            found = re.match(r"Could not override '([^']+)'", str(error))
            if not found:
                return None  # Hydra's own message says it
            key = found[1]
            try:
                config = compose(method, [o for o in overrides if o.lstrip("+~").partition("=")[0] != key])
            except ConfigCompositionException:
                return None
    nearest = preflight.nearest_key(config, key)
    hint = f"did you mean {nearest}? " if nearest else ""
    return f"{key}: no such key in the config; {hint}(a key of your own: +{key}=VALUE)"


def main() -> None:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(usage())
        return
    deadline.arm()  # a signal from now on asks for a save (stapo.train.deadline), not the end of the process
    problem = parse_problem(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    check_names(sys.argv[1:])
    problem = key_problem(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    _hydra_main()
