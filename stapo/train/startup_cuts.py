"""Start-up cuts (issue 55; verl issue #384): what the recipe removes from verl 0.9.1's start-up, each by name, so that
one launch can be timed with and without it (``python -m stapo.checks.startup``; docs/startup.md).

``STAPO_STARTUP_CUTS`` chooses them: unset or ``all`` for every cut, ``none`` for verl's own start-up, or a comma list
of :data:`CUTS`' names. The driver checks the value, prints which cuts are on and passes the variable to every Ray
process of the run (:func:`forward`), where the plugin reads it. Each cut is listed in
:data:`stapo.train.verl_patches.WORKAROUNDS`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import subprocess
import sys
from collections.abc import Mapping
from importlib.util import find_spec

from omegaconf import DictConfig, OmegaConf, open_dict

ENV = "STAPO_STARTUP_CUTS"
CUTS = {
    "lazy_plugin": "the plugin imports the recipe's trainers and agent loop only where verl imports its own",
    "uni_executor": "vLLM runs a one-GPU replica's model in its engine process (no worker process)",
    "bytecode": "the driver compiles missing bytecode of the run's packages in the background",
}
"""Name -> what it does (docs/startup.md has the why)."""

DEFERRED = {
    "verl.experimental.agent_loop": "stapo.train.agent_loop",
    "verl.trainer.ppo.v1": "stapo.train.trainer",
}
"""verl package -> the recipe module that registers into it (the seeded agent loop; the trainer modes), imported
right after the package with ``lazy_plugin`` and with the plugin otherwise."""

PRECOMPILED = ("torch", "transformers", "vllm", "verl", "ray", "transfer_queue", "tensordict", "triton", "sympy")
"""Packages whose bytecode ``bytecode`` compiles: what every process of a run imports most of (docs/startup.md)."""


def selected(environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The cuts ``STAPO_STARTUP_CUTS`` names (module docstring); ``ValueError`` with one line for an unknown name."""
    value = environ.get(ENV, "all").strip()
    if value in ("", "all"):
        return frozenset(CUTS)
    if value == "none":
        return frozenset()
    names = {name.strip() for name in value.split(",") if name.strip()}
    unknown = sorted(names - set(CUTS))
    if unknown:
        raise ValueError(f"{ENV}={value}: unknown cut {', '.join(unknown)}; use all, none or some of {', '.join(CUTS)}")
    return frozenset(names)


def enabled(name: str) -> bool:
    """Whether cut ``name`` is on in this process (an unreadable value: none, the driver refused it already)."""
    try:
        return name in selected()
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------------- lazy_plugin
class _ThenImport(importlib.abc.Loader):
    """A package's own loader, then the recipe modules that register into it."""

    def __init__(self, loader, modules: list[str]):
        self.loader, self.modules = loader, modules

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        for name in self.modules:
            importlib.import_module(name)

    def __getattr__(self, name):  # resources, source: the package's own loader answers
        return getattr(self.loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the watched packages with the other finders and wraps their loaders (:class:`_ThenImport`)."""

    def __init__(self):
        self.pending: dict[str, list[str]] = {}

    def find_spec(self, name, path=None, target=None):
        if name not in self.pending:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _ThenImport(spec.loader, self.pending.pop(name))
        return spec


_HOOK = _AfterImport()


def after_import(package: str, module: str) -> None:
    """Import ``module`` right after ``package`` has been imported (now, if it has been)."""
    if package in sys.modules:
        importlib.import_module(module)
        return
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
    _HOOK.pending.setdefault(package, []).append(module)


def register_recipe_modules() -> None:
    """What the plugin does for :data:`DEFERRED`: import each module now, or with ``lazy_plugin`` after its
    package."""
    for package, module in DEFERRED.items():
        if enabled("lazy_plugin"):
            after_import(package, module)
        else:
            importlib.import_module(module)


# ----------------------------------------------------------------------------------------------------- the driver
def uni_executor(config: DictConfig) -> bool:
    """Set ``actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend=uni`` for vLLM replicas of one
    GPU (TP × DP × PP = 1, no prefill/decode split) unless the key is set; whether it did. verl 0.9.1 asks for ``mp``
    (``vllm_async_server.py:launch_server``) and merges these engine arguments after its own."""
    rollout = config.actor_rollout_ref.rollout
    sizes = ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size")
    one_gpu = all((OmegaConf.select(rollout, size) or 1) == 1 for size in sizes)
    split = bool(OmegaConf.select(rollout, "disaggregation.enabled"))
    kwargs = OmegaConf.select(rollout, "engine_kwargs.vllm")
    if rollout.name != "vllm" or not one_gpu or split or (kwargs and "distributed_executor_backend" in kwargs):
        return False
    with open_dict(rollout):
        if rollout.get("engine_kwargs") is None:
            rollout.engine_kwargs = {}
        if rollout.engine_kwargs.get("vllm") is None:
            rollout.engine_kwargs.vllm = {}
        rollout.engine_kwargs.vllm.distributed_executor_backend = "uni"
    return True


def package_folders(names=PRECOMPILED) -> list[str]:
    """The installed folders of ``names`` (found without importing them; the missing ones left out)."""
    folders = []
    for name in names:
        spec = find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            folders.extend(spec.submodule_search_locations)
    return folders


_COMPILE = (
    "import os, runpy, sys; os.nice(10); sys.argv[0] = 'compileall'; "
    "runpy.run_module('compileall', run_name='__main__', alter_sys=True)"
)


def precompile(folders: list[str]) -> subprocess.Popen | None:
    """Start ``python -m compileall -j 0`` over ``folders`` (every core, niceness 10), not waited for: the bytecode a
    module's first import would write, written ahead in Python's own format (atomic writes). It writes also where
    ``PYTHONDONTWRITEBYTECODE`` is set, which stops imports from writing bytecode (every process of every launch then
    compiles what it imports) but not from reading it. None when there is nothing to compile."""
    if not folders:
        return None
    command = [sys.executable, "-c", _COMPILE, "-q", "-j", "0", *folders]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def apply(config: DictConfig) -> list[str]:
    """The driver's part: the cuts on the config and the background compile; what was done, one line each."""
    cuts = selected()
    done = [f"start-up cuts on: {', '.join(sorted(cuts)) or 'none'} ({ENV}; docs/startup.md)"]
    if "uni_executor" in cuts and uni_executor(config):
        done.append("uni_executor: vLLM's one-GPU replicas run the model in the engine process")
    if "bytecode" in cuts and precompile(package_folders()) is not None:
        done.append("bytecode: compiling missing bytecode in the background")
    return done


def forward(config: DictConfig) -> None:
    """Give the run's Ray processes the driver's ``STAPO_STARTUP_CUTS`` (``all`` when unset): a cluster given by
    ``RAY_ADDRESS`` does not inherit the driver's environment, and the plugin must choose as the driver did."""
    env_vars = config.ray_kwargs.ray_init.runtime_env.env_vars
    with open_dict(env_vars):
        env_vars[ENV] = os.environ.get(ENV, "all")
