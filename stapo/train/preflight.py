"""Checks that run on the driver before Ray starts, so that a run that cannot work stops in seconds with one line
per problem (what is wrong, which key, what to do) instead of hanging or failing after minutes of start-up.

* :func:`validate_training_config`: the ``stapo:`` block and how it fits the rest of verl's config;
* :func:`resolve_auto`: the ``auto`` attention and fused-kernel settings (:mod:`stapo.train.attention`);
* :func:`config_problems`: settings that cannot work together (attention implementation and sequence parallelism);
* :func:`environment_problems`: GPUs (visible here, or in the Ray cluster of ``RAY_ADDRESS``), training and
  validation files, model path, and the checkpoint a run would resume from.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from functools import cache
from importlib import resources
from importlib.metadata import entry_points
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from stapo.config import SEEDED_AGENT_LOOP, TAPE_GLOB, TRAINER_MODE, TRAINER_MODES, StapoConfig, StapoConfigError
from stapo.tools.io import DataFileError, first_line, model_folder_problems, output_problem
from stapo.train import attention
from stapo.train.verl_patches import VLLM_PLUGIN

PLUGIN_ENTRY_POINT = "stapo"
CLUSTER_TIMEOUT_S = 60
CLUSTER_END_S = 10.0
"""Seconds a Ray cluster found on this machine is given to end before a local run is refused beside it."""
TQ_CONTROLLER = ("TransferQueueController", "transfer_queue")
"""Name and namespace of the Ray actor that controls a verl run's TransferQueue (``transfer_queue.init``, verl 0.9.1);
it lives as long as the run."""
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_RESERVED = ("models", "datasets", "spaces")
"""Names the Hugging Face hub keeps for its own pages: no organisation has them, so ``models/NAME`` is a path."""


def validate_training_config(config: DictConfig) -> StapoConfig:
    """The typed ``stapo:`` block, checked together with the verl keys it depends on; raises
    :class:`stapo.config.StapoConfigError` naming the key."""
    stapo = StapoConfig.from_node(config.get("stapo"))
    trainer = config.trainer
    actor = config.actor_rollout_ref.actor
    if not (stapo.active or stapo.metrics):
        return stapo
    if not trainer.get("use_v1", True):
        raise StapoConfigError(
            "trainer.use_v1=False: the STAPO mask and metrics are implemented for verl's V1 trainer only; set "
            "trainer.use_v1=True"
        )
    if trainer.v1.trainer_mode not in TRAINER_MODES:
        needs = f"stapo.mask={stapo.mask}" if stapo.active else "stapo.metrics=true"
        modes = " or ".join(TRAINER_MODES)
        raise StapoConfigError(
            f"trainer.v1.trainer_mode={trainer.v1.trainer_mode!r}: {needs} needs trainer.v1.trainer_mode={modes} "
            f"({TRAINER_MODE}: the paper's; verl's stock trainers would silently skip it; set stapo.metrics=false for "
            "a stock run)"
        )
    bypass = (config.algorithm.get("rollout_correction") or {}).get("bypass_mode", False)
    if bypass and stapo.policy_source == "old" and (stapo.active or stapo.metrics):
        raise StapoConfigError(
            "algorithm.rollout_correction.bypass_mode=True: verl then takes the rollout's log-probs as π_old and "
            "computes no old-policy entropies, which the mask and the s2t/* metrics read; set bypass_mode=False, or "
            "stapo.policy_source=current (with stapo.metrics=false)"
        )
    if stapo.active and stapo.policy_source == "current" and not actor.calculate_entropy:
        raise StapoConfigError(
            "actor_rollout_ref.actor.calculate_entropy=False: stapo.policy_source=current needs the entropy of "
            "π_θ in the update; set actor_rollout_ref.actor.calculate_entropy=True "
            "(and actor_rollout_ref.actor.entropy_checkpointing=True to keep its memory low)"
        )
    old_mask = stapo.active and stapo.policy_source == "old" and stapo.quantile_scope == "mini_batch"
    if old_mask and actor.ppo_epochs > 1 and actor.shuffle:
        raise StapoConfigError(
            "actor_rollout_ref.actor.shuffle=True with ppo_epochs>1 regroups the mini-batches every epoch, so no "
            "single per-mini-batch mask exists; set actor_rollout_ref.actor.shuffle=False, ppo_epochs=1, "
            "stapo.quantile_scope=batch or stapo.policy_source=current"
        )
    return stapo


def check_installed() -> None:
    """Stop with instructions unless the package is installed with its ``verl.plugins`` entry point."""
    if not any(ep.name == PLUGIN_ENTRY_POINT for ep in entry_points(group="verl.plugins")):
        raise RuntimeError(
            "STAPO: the `stapo` package is importable but not installed, so verl's plugin loader and the Ray "
            "workers will not find it. Run `pip install -e .` in the repository (on every node of a multi-node "
            "cluster) or use docker/Dockerfile."
        )


def resolve_auto(config: DictConfig) -> tuple[str, bool]:
    """Replace ``auto`` in ``actor_rollout_ref.model.override_config.attn_implementation`` and
    ``actor_rollout_ref.model.use_fused_kernels`` by what this installation supports; returns both."""
    model = config.actor_rollout_ref.model
    implementation, fused = attention.resolve(
        model.get("override_config", {}).get("attn_implementation", "flash_attention_2"), model.use_fused_kernels
    )
    with open_dict(model):
        model.override_config["attn_implementation"] = implementation
        model.use_fused_kernels = fused
    return implementation, fused


def environment_problems(config: DictConfig) -> list[str]:
    """What in this environment would make the run fail, hang or part from its twin: GPUs, data files, model, the
    tapes, the recipe's vLLM plugin, the checkpoint folder; one line each."""
    found = _gpu_problems(config) + _data_problems(config) + _model_problems(config)
    found += tape_problems(config) + vllm_plugin_problems(config)
    folder = Path(str(config.trainer.default_local_dir)).expanduser()
    if problem := output_problem(folder, "folder", "trainer.default_local_dir"):
        return [*found, problem]
    return found + resume_problems(config)


def vllm_plugin_problems(config: DictConfig) -> list[str]:
    """``determinism=full`` needs the recipe's vLLM plugin in every vLLM process (vLLM 0.24's residual RMSNorm depends
    on the batch without it: :func:`stapo.train.verl_patches.batch_invariant_residual_rms_norm`): the package's entry
    point installed, and ``VLLM_PLUGINS``, where set, naming it; one line."""
    if not all(OmegaConf.select(config, key) for key in DETERMINISM):
        return []
    name = VLLM_PLUGIN
    if not any(e.name == name for e in entry_points(group="vllm.general_plugins")):
        return [f"determinism=full: the package's vLLM plugin {name} is not installed, so vLLM's residual RMSNorm "
                "would depend on the batch; reinstall the package (pip install -e .)"]  # fmt: skip
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and name not in allowed.split(","):
        return [f"VLLM_PLUGINS={allowed!r} leaves out the recipe's vLLM plugin {name}, which determinism=full needs; "
                f"add it (VLLM_PLUGINS={allowed + ',' if allowed else ''}{name}) or unset VLLM_PLUGINS"]  # fmt: skip
    return []


def tape_problems(config: DictConfig) -> list[str]:
    """``stapo.record_rollouts`` must be a folder that can be written, ``stapo.replay_rollouts`` one that holds a
    recording (:class:`stapo.train.agent_loop.RolloutTape`); one line each. Without determinism the tape cannot work
    at all, which :func:`config_problems` says instead."""
    stapo = config.get("stapo") or {}
    if not all(OmegaConf.select(config, key) for key in DETERMINISM):
        return []
    found = []
    if stapo.get("record_rollouts"):
        folder = Path(stapo.record_rollouts).expanduser()
        found += filter(None, [output_problem(folder, "folder", "stapo.record_rollouts")])
    if stapo.get("replay_rollouts") and not any(Path(stapo.replay_rollouts).expanduser().glob(TAPE_GLOB)):
        found.append(
            f"stapo.replay_rollouts={stapo.replay_rollouts}: no recording there ({TAPE_GLOB}); name the folder a run "
            "with stapo.record_rollouts wrote"
        )
    return found


def _gpu_problems(config: DictConfig) -> list[str]:
    trainer = config.trainer
    needed = trainer.n_gpus_per_node * trainer.nnodes
    where = f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} x trainer.nnodes={trainer.nnodes}"
    if needed < 1:  # verl would wait for a resource pool that never forms
        return [f"{where}: a run needs at least one GPU on at least one node; set both to 1 or more"]
    if TRAINER_MODES.get(trainer.v1.trainer_mode) == "separate_async":  # the rollout's own GPUs come on top
        rollout = config.actor_rollout_ref.rollout
        needed += rollout.n_gpus_per_node * rollout.nnodes
        where += f" + actor_rollout_ref.rollout.n_gpus_per_node={rollout.n_gpus_per_node} x nnodes={rollout.nnodes}"
    where += f" needs {needed} GPU{'s' * (needed != 1)}"
    address = os.environ.get("RAY_ADDRESS") or config.get("ray_kwargs", {}).get("ray_init", {}).get("address")
    if address:
        if address.startswith(("http://", "https://")):
            return [
                f"RAY_ADDRESS={address} is a dashboard address, for `ray job submit` (scripts/ray_job.sh); to run "
                "this script against a running cluster set RAY_ADDRESS=HEAD_IP:6379 (or leave it unset for a "
                "local run)"
            ]
        found = cluster_gpus(address)
        if isinstance(found, str):
            return [f"RAY_ADDRESS={address}: {found}"]
        if found < needed:
            return [f"{where}; the Ray cluster at {address} has {found:g}: lower them or add nodes"]
        return []
    if trainer.nnodes > 1:
        return [
            f"trainer.nnodes={trainer.nnodes} needs a Ray cluster over those nodes: start one and set "
            "RAY_ADDRESS=HEAD_IP:6379 (scripts/slurm.sbatch does both), or set trainer.nnodes=1"
        ]
    visible = local_gpus()
    if visible == 0:
        return [
            f"{where}; this machine has none visible (torch.cuda.device_count() is 0): run on a "
            "GPU node or submit to a Ray cluster with RAY_ADDRESS; without GPUs, try bash scripts/quickstart.sh"
        ]
    if visible < needed:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        return [
            f"{where}; this machine has {visible} visible"
            + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else "")
            + f": set trainer.n_gpus_per_node={visible} or run where the GPUs are"
        ]
    return local_cluster_problems()  # after the GPU count: no GPU is the first thing to fix


def local_cluster_problems() -> list[str]:
    """Why a local run (one that starts or finds its own Ray cluster) must not start now: another Ray cluster on this
    machine; one line, or none."""
    clusters = local_ray_clusters()
    if not clusters:
        return []
    return [
        f"another Ray cluster runs on this machine (gcs_server, pid {clusters[0]}): a local run beside it would start "
        "a second one, whose first job id is again 01000000, so verl 0.9.1's weight-transfer socket "
        "(/tmp/rl-colocate-zmq-01000000-replica-0-rank-0.sock) would be shared and the runs would hang or load each "
        "other's weights (or, if that cluster came from `ray start`, join it unasked); nor can two runs be jobs of "
        "one cluster, which share verl's TransferQueue: run them one after the other (`python -m "
        "stapo.quickstart.experiment` runs several at once, each in a cluster of its own with distinct job ids)"
    ]


def local_ray_clusters(wait_s: float = CLUSTER_END_S) -> list[int]:
    """Process ids of the Ray clusters running on this machine (their GCS servers), from ``/proc``; a cluster still
    shutting down (that of the previous run of a script that runs several in a row) is given ``wait_s`` to end."""
    deadline = time.monotonic() + wait_s
    while (pids := _gcs_servers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return pids


def _gcs_servers() -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            program = cmdline.read_bytes().split(b"\0", 1)[0]
        except OSError:  # the process ended, or is not ours to read
            continue
        if program.rsplit(b"/", 1)[-1] == b"gcs_server":
            pids.append(int(cmdline.parent.name))
    return sorted(pids)


def local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def cluster_gpus(address: str, timeout: float = CLUSTER_TIMEOUT_S) -> float | str:
    """The GPUs of the Ray cluster at ``address``, asked from a separate process (so that this driver's own
    ``ray.init`` later still applies the recipe's runtime environment); else why not, as one line: no answer, or a
    verl run already training there. verl 0.9.1 keeps a run's rollouts in TransferQueue, whose controller is a named
    actor of the cluster (:data:`TQ_CONTROLLER`): a second run would share it, and each would take the other's
    rollouts (docs/history.md, section 7)."""
    name, namespace = TQ_CONTROLLER
    code = (
        "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
        f"try: ray.get_actor({name!r}, namespace={namespace!r}); print('busy')\n"
        "except ValueError: print(ray.cluster_resources().get('GPU', 0))"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return (
            f"no Ray cluster answered within {timeout:g} s; start it (`ray start --head` on the head node, `ray start "
            "--address=HEAD_IP:6379` on the others) or unset RAY_ADDRESS for a local run"
        )
    answer = (out.stdout.strip().splitlines() or [""])[-1]
    if answer == "busy":
        return (
            "a verl run is training on this cluster (its TransferQueue controller is alive), and the jobs of one "
            "cluster share it, each taking the other's rollouts: wait for that run to end, or run this one on a "
            "cluster of other machines"
        )
    try:
        return float(answer)
    except ValueError:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return f"connecting to the Ray cluster failed ({last}); check the address, Ray's version and RAY_AUTH_MODE"


def _data_problems(config: DictConfig) -> list[str]:
    from stapo.tools.data import check_verl_parquet  # here: the plugin imports this module in every Ray worker

    data = config.data
    keys = {"prompt_key": data.get("prompt_key", "prompt"), "source_key": data.get("reward_fn_key", "data_source")}
    found = []
    for key, command in (("train_files", "train"), ("val_files", "eval")):
        value = data.get(key)
        for name in [value] if isinstance(value, str) else list(value or []):
            if "://" in name:  # hdfs:// and other remote paths: verl copies them itself
                continue
            expected = f"a verl parquet from `python -m stapo.tools.data {command}` (or set data.{key}=PATH)"
            try:
                check_verl_parquet(Path(name).expanduser(), expected, **keys)
            except DataFileError as error:
                found.append(f"data.{key}: {error}")
    return found


def _model_problems(config: DictConfig) -> list[str]:
    model = config.actor_rollout_ref.model
    found = []
    for key in ("path", "tokenizer_path"):
        value = model.get(key)
        if value is None:
            continue
        path = Path(str(value)).expanduser()
        if path.exists():
            if key == "path":
                found += model_folder_problems(path, f"actor_rollout_ref.model.path={value}")
        elif problem := _hub_id_problem(str(value)):
            found.append(f"actor_rollout_ref.model.{key}={value}: {problem}")
    return found


def _hub_id_problem(value: str) -> str | None:
    """Why ``value``, no folder here, cannot be a model of the Hugging Face hub either: not of the form ORG/NAME, ORG
    a folder here or a name the hub keeps (``models/smollm2`` is a path that is missing), or not in the hub's cache
    while HF_HUB_OFFLINE is set; None if it can be one (the workers download it)."""
    if not _HUB_ID.fullmatch(value):
        return "no such folder, and not a Hugging Face hub id (ORG/NAME)"
    org = value.split("/")[0]
    if Path(org).is_dir() or org in HUB_RESERVED:
        return (
            f"no such folder ({org}/ is a folder name, not a hub organisation); make the model there (SmolLM2: "
            f"python -m stapo.tools.pretrained --out {value}) or set actor_rollout_ref.model.path=DIR"
        )
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(value, "config.json"), str):
        return "no such folder, and not in the Hugging Face cache while HF_HUB_OFFLINE is set; download it first"
    return None


VERL_CONFIG = "_generated_ppo_trainer.yaml"
"""verl 0.9.1's ``ppo_trainer.yaml`` as composed (verl keeps this file of ``verl.trainer.config`` equal to it)."""

_RULES = {
    "count": (lambda v: _whole(v) and v >= 1, "a whole number of at least 1"),
    "frequency": (lambda v: _whole(v) and v >= -1, "a whole number of steps (-1: never)"),
    "positive": (lambda v: _number(v) and v > 0, "a number greater than 0"),
    "share": (lambda v: _number(v) and 0 < v <= 1, "a fraction in (0, 1]"),
    "fraction": (lambda v: _number(v) and 0 <= v <= 1, "a fraction in [0, 1]"),
}
"""Rule -> (whether a value fits, what it must be)."""
RANGES = {
    "trainer.nnodes": ("count", "nodes"),
    "trainer.n_gpus_per_node": ("count", "GPUs a node"),
    "trainer.total_training_steps": ("count", "training steps; null: from total_epochs"),
    "trainer.total_epochs": ("count", "epochs"),
    "trainer.save_freq": ("frequency", "steps between checkpoints"),
    "trainer.test_freq": ("frequency", "steps between validations"),
    "data.train_batch_size": ("count", "prompts a step"),
    "data.max_prompt_length": ("count", "prompt tokens"),
    "data.max_response_length": ("count", "response tokens"),
    "actor_rollout_ref.rollout.n": ("count", "responses a prompt"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ("count", "GPUs a vLLM engine"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ("share", "of each GPU's memory that vLLM takes"),
    "actor_rollout_ref.rollout.val_kwargs.n": ("count", "validation responses a prompt"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": ("count", "sequences a log-prob micro-batch"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ("count", "sequences a log-prob micro-batch"),
    "actor_rollout_ref.actor.optim.lr": ("positive", "the actor's learning rate"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": ("fraction", "of the steps spent warming up"),
    "actor_rollout_ref.actor.optim.min_lr_ratio": ("fraction", "of the learning rate kept at the end"),
    "critic.optim.lr": ("positive", "the critic's learning rate"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("count", "prompts a PPO mini-batch"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("count", "sequences a micro-batch a GPU"),
    "actor_rollout_ref.actor.ppo_epochs": ("count", "PPO epochs"),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ("count", "tokens a micro-batch a GPU"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": ("count", "GPUs a sequence"),
}
"""verl's keys that a run depends on, each with its rule (:data:`_RULES`) and what it counts or means."""
OPTIONAL = {
    "trainer.total_training_steps",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
}
"""Keys of :data:`RANGES` that may be null (verl derives or does without them)."""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # NaN is no number


def _whole(value: object) -> bool:
    return _number(value) and isinstance(value, int)


def _leaves(node: DictConfig, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, node) of every key under ``node``, sub-configs included, without resolving interpolations."""
    for key in node.keys():
        child = node._get_node(key)
        yield f"{prefix}{key}", child
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_interpolation():
            yield from _leaves(child, f"{prefix}{key}.")


@cache
def verl_numbers() -> dict[str, int | float]:
    """verl's numeric keys and their defaults: the int and float leaves of its composed trainer config
    (:data:`VERL_CONFIG`); a key verl adds later is checked without a change here."""
    config = OmegaConf.create(resources.files("verl.trainer.config").joinpath(VERL_CONFIG).read_text())
    return {
        key: node._value()
        for key, node in _leaves(config)
        if not isinstance(node, DictConfig) and not node._is_interpolation() and _number(node._value())
    }


def count_problems(config: DictConfig) -> list[str]:
    """verl's numeric keys (:func:`verl_numbers`) that are not numbers, the :data:`RANGES` keys out of range, training
    files that name nothing, then mini-batches that do not divide the batch (:func:`batch_problems`); one line each,
    before anything computes with them (a string GPU count stopped the GPU check with a ``TypeError``, 1.5 GPUs
    passed it, ``lr=abc`` passed)."""
    found = []
    for key, default in verl_numbers().items():
        try:
            value = OmegaConf.select(config, key)
        except Exception as error:  # noqa: BLE001 - OmegaConf raises several kinds for a broken interpolation
            found.append(f"{key}: cannot be resolved ({first_line(error)}); fix the value")
            continue
        if key not in RANGES and value is not None and not _number(value):
            found.append(f"{key}={value}: must be a number (verl's default: {default})")
    for key, (rule, meaning) in RANGES.items():
        value = OmegaConf.select(config, key)
        fits, wanted = _RULES[rule]
        if not fits(value) and not (value is None and key in OPTIONAL):
            found.append(f"{key}={value}: must be {wanted} ({meaning})")
    files = config.data.get("train_files")
    if not files or (not isinstance(files, str) and not all(isinstance(f, str) and f for f in files)):
        found.append(f"data.train_files={files}: name one parquet file or a list of them")
    return found or batch_problems(config)


def batch_problems(config: DictConfig) -> list[str]:
    """Mini-batches that do not divide the batch, or whose responses do not divide evenly over the data-parallel
    GPUs (verl splits them there, and asserts only once the workers have started); one line each."""
    actor, batch = config.actor_rollout_ref.actor, config.data.train_batch_size
    mini, n = actor.ppo_mini_batch_size, config.actor_rollout_ref.rollout.n
    ranks = config.trainer.n_gpus_per_node * config.trainer.nnodes // actor.ulysses_sequence_parallel_size
    if batch % mini:
        return [
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}: must divide data.train_batch_size={batch} (each "
            "step trains on whole mini-batches); set it to a divisor"
        ]
    if ranks and (mini * n) % ranks:
        return [
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} x actor_rollout_ref.rollout.n={n}: the mini-batch's "
            f"{mini * n} responses do not split evenly over {ranks} data-parallel GPUs (trainer.n_gpus_per_node x "
            "nnodes / ulysses_sequence_parallel_size); change one of them"
        ]
    return []


def added_key_problems(config: DictConfig, overrides: Sequence[str]) -> list[str]:
    """``+KEY=VALUE`` overrides (Hydra: add a key) whose KEY the config does not otherwise have while a key it has is
    one edit away: a typo that verl would silently ignore; one line each, naming the likely key."""
    added = [o.lstrip("+").partition("=")[0] for o in overrides if o.startswith("+")]
    known = {key for key, _ in _leaves(config)} - set(added)
    found = []
    for key in added:
        close = sorted(k for k in known if _one_edit(k, key))
        if close:
            found.append(
                f"+{key}: no such key in verl's config; did you mean {close[0]}? (set it without the +: "
                f"{close[0]}=VALUE)"
            )
    return found


def nearest_key(config: DictConfig, key: str) -> str | None:
    """The key of ``config`` nearest to ``key`` (a typo of it), or None when none is near."""
    import difflib

    known = [k for k, _ in _leaves(config)]
    section = [k for k in known if k.rpartition(".")[0] == key.rpartition(".")[0]]  # the same block first
    close = difflib.get_close_matches(key, section, n=1, cutoff=0.6) or difflib.get_close_matches(key, known, n=1)
    return close[0] if close else None


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by exactly one inserted, deleted or replaced character."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    start = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[start + 1 :] == b[start + 1 :] or a[start + 1 :] == b[start:] or a[start:] == b[start + 1 :]


DETERMINISM = (
    "actor_rollout_ref.rollout.full_determinism",
    "actor_rollout_ref.actor.fsdp_config.full_determinism",
    "actor_rollout_ref.ref.fsdp_config.full_determinism",
)
"""verl 0.9.1's determinism flags on the recipe's path, which ``determinism=full`` (configs/determinism/full.yaml)
turns on together."""


def separate_async_problems(config: DictConfig) -> list[str]:
    """verl 0.9.1's own conditions for ``separate_async`` (asserted in ``PPOTrainerSeparateAsync.__init__``, once Ray
    and the task runner have started), checked here first; one line each."""
    if TRAINER_MODES.get(config.trainer.v1.trainer_mode) != "separate_async":
        return []
    found = []
    rollout, sync = config.actor_rollout_ref.rollout, config.trainer.v1.separate_async.parameter_sync_step
    mini = config.actor_rollout_ref.actor.ppo_mini_batch_size
    if config.data.train_batch_size != sync * mini:
        found.append(
            f"data.train_batch_size={config.data.train_batch_size}: separate_async trains a batch as "
            f"trainer.v1.separate_async.parameter_sync_step={sync} mini-batches of "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}; make the batch their product"
        )
    if not (rollout.nnodes > 0 and rollout.n_gpus_per_node > 0):
        found.append(
            f"actor_rollout_ref.rollout.nnodes={rollout.nnodes}: separate_async generates on GPUs of its own; set "
            "actor_rollout_ref.rollout.nnodes and n_gpus_per_node (e.g. 1 and 1 beside one trainer GPU)"
        )
    if rollout.checkpoint_engine.backend == "naive":
        found.append(
            "actor_rollout_ref.rollout.checkpoint_engine.backend=naive: separate_async sends the weights to GPUs of "
            "their own; set it to nccl"
        )
    return found


def config_problems(config: DictConfig) -> list[str]:
    """Settings that cannot work together: a partial determinism or one whose responses would share their seed,
    ``separate_async``'s conditions, and the attention settings (after :func:`resolve_auto`); one line each."""
    found = separate_async_problems(config)
    flags = {key: bool(OmegaConf.select(config, key)) for key in DETERMINISM}
    full = all(flags.values())
    if any(flags.values()) and not full:
        state = ", ".join(f"{key}={str(on).lower()}" for key, on in flags.items())
        found.append(
            f"determinism is partial ({state}): two runs compute the same numbers only with all of them on; set "
            "determinism=full (or determinism=none)"
        )
    rollout = config.actor_rollout_ref.rollout
    mode = config.trainer.v1.trainer_mode
    if full and TRAINER_MODES.get(mode, "sync") != "sync":
        found.append(
            f"trainer.v1.trainer_mode={mode} with determinism=full: in an asynchronous mode the groups a step trains "
            f"on depend on when their rollouts finish, so two runs cannot match; use {TRAINER_MODE} (or "
            "determinism=none)"
        )
    if full and not rollout.enforce_eager:
        found.append(
            "actor_rollout_ref.rollout.enforce_eager=false with determinism=full: verl 0.9.1 turns on torch's "
            "deterministic algorithms in vLLM's workers, where torch 2.11's Inductor refuses the benchmarking of "
            "vLLM 0.24's compile and the engine fails to start; set it to true (determinism=full does)"
        )
    samples = max(rollout.n, rollout.val_kwargs.n)  # responses a prompt gets in training or validation
    for key in ("record_rollouts", "replay_rollouts"):
        if (config.get("stapo") or {}).get(key) and not (
            full and rollout.agent.default_agent_loop == SEEDED_AGENT_LOOP
        ):
            found.append(
                f"stapo.{key} keys each response by its request's seed, which only determinism=full gives (with the "
                f"agent loop {SEEDED_AGENT_LOOP}); add determinism=full"
            )
    if full and samples > 1 and rollout.agent.default_agent_loop != SEEDED_AGENT_LOOP:
        found.append(
            f"actor_rollout_ref.rollout.agent.default_agent_loop={rollout.agent.default_agent_loop}: under "
            f"full_determinism verl 0.9.1 samples every response with one seed, so the {samples} responses of a "
            "prompt (rollout.n, rollout.val_kwargs.n) would be the same, GRPO's advantages zero and avg@k a single "
            f"sample; set it to {SEEDED_AGENT_LOOP} (determinism=full does)"
        )
    model = config.actor_rollout_ref.model
    implementation = model.override_config.get("attn_implementation")
    key = "actor_rollout_ref.model.override_config.attn_implementation"
    if implementation == "flash_attention_2" and not attention.flash_attn_installed():
        found.append(
            f"{key}=flash_attention_2 but flash-attn is not installed: `pip install flash-attn --no-build-isolation` "
            f"(needs the CUDA toolkit), or set {key}=auto"
        )
    if implementation == attention.NAME and not attention.varlen_supported():
        found.append(f"{key}={attention.NAME} needs PyTorch >= 2.10 (torch.nn.attention.varlen); set {key}=auto")
    if implementation == attention.NAME and not model.use_remove_padding:
        found.append(
            f"{key}={attention.NAME} runs packed sequences: set actor_rollout_ref.model.use_remove_padding=True"
        )
    for role in ("actor", "ref"):
        sp = config.actor_rollout_ref[role].get("ulysses_sequence_parallel_size", 1)
        if sp > 1 and implementation not in ("flash_attention_2", attention.NAME):
            found.append(
                f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size={sp} with {key}={implementation}: verl's "
                "Ulysses all-to-all runs inside flash_attention_2 (and this recipe's torch_varlen) only, so each GPU "
                f"would attend within its slice of the sequence; set {key}=auto or ulysses_sequence_parallel_size=1"
            )
    return found


def resume_problems(config: DictConfig) -> list[str]:
    """Checkpoints verl 0.9.1 would resume from wrongly, or silently ignore and overwrite (it starts from step 0
    when ``latest_checkpointed_iteration.txt`` is missing or names a missing folder); one line each."""
    trainer = config.trainer
    mode = trainer.get("resume_mode", "auto")
    if mode == "disable":
        return []
    if trainer.get("max_actor_ckpt_to_keep") == 1:
        return [
            "trainer.max_actor_ckpt_to_keep=1: verl deletes the previous checkpoint before it writes the new one's "
            "data.pt and tracker, so a kill in between leaves nothing to resume from; use 2 or more (or null)"
        ]
    if mode not in ("auto", "resume_path"):
        return [f"trainer.resume_mode={mode!r}: use auto, disable or resume_path"]
    root = Path(str(trainer.default_local_dir)).expanduser().absolute()  # relative to the working directory, as verl
    if mode == "resume_path":
        folder = Path(str(trainer.get("resume_from_path") or "")).expanduser().absolute()
        if "global_step_" not in folder.name:
            return [f"trainer.resume_from_path={trainer.get('resume_from_path')}: name a global_step_N folder"]
    else:
        from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename

        tracker = Path(get_checkpoint_tracker_filename(str(root)))
        if not tracker.is_file():
            left = sorted(p.name for p in root.glob("global_step_*")) if root.is_dir() else []
            if not left:
                return []
            return [
                f"trainer.default_local_dir={root} holds {', '.join(left)} but no {tracker.name}, so verl would "
                f"start from step 0 and overwrite them; write the step of a complete one into {tracker}, delete them, "
                "or set trainer.resume_mode=disable"
            ]
        text = tracker.read_text().strip()
        if not text.isdigit():
            return [f"{tracker}: {text!r} is not a step number; write the step of the newest complete global_step_N"]
        folder = root / f"global_step_{int(text)}"
        if not folder.is_dir():
            return [
                f"{tracker} names step {text} but {folder} does not exist: verl would start from step 0 and overwrite "
                "the run's checkpoints; restore the folder or fix the tracker"
            ]
    world = trainer.n_gpus_per_node * trainer.nnodes
    actor = folder / "actor"
    contents = config.actor_rollout_ref.actor.get("checkpoint", {}).get(
        "save_contents", ["model", "optimizer", "extra"]
    )
    kinds = [
        kind for key, kind in (("model", "model"), ("optimizer", "optim"), ("extra", "extra_state")) if key in contents
    ]
    needed = [actor / f"{kind}_world_size_{world}_rank_{rank}.pt" for kind in kinds
              for rank in range(world)] + [actor / "fsdp_config.json", folder / "data.pt"]  # fmt: skip
    missing = [p for p in needed if not p.is_file() or p.stat().st_size == 0]
    if missing:
        saved = sorted({p.name.split("_rank_")[0] for p in actor.glob("model_world_size_*_rank_*.pt")})
        changed = saved and f"model_world_size_{world}" not in saved
        hint = f" (it was saved as {', '.join(saved)}: the GPU count changed)" if changed else ""
        return [
            f"checkpoint {folder} is incomplete for {world} GPU{'s' * (world != 1)}: {len(missing)} file(s) missing "
            f"or empty, e.g. {missing[0].relative_to(folder)}{hint}; resume from an earlier global_step_N (write its N "
            "into the tracker) or set trainer.resume_mode=disable"
        ]
    return dataloader_state_problems(folder / "data.pt", config.data.get("dataloader_num_workers", 0))


def dataloader_state_problems(path: Path, workers: int) -> list[str]:
    """Whether verl can restore the dataloader state ``path`` (``data.pt``, torchdata's ``StatefulDataLoader``) into a
    dataloader of ``workers`` worker processes: a state written with workers does not load into one without them, and
    the other way round (torchdata asserts, after Ray and the workers have started); one line, or none."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=False)  # as verl loads it
    except Exception as error:  # torch raises several kinds for a damaged file
        kind = type(error).__name__
        return [f"{path}: not a readable dataloader state ({kind}); resume from an earlier global_step_N"]
    if not isinstance(state, dict):
        return [f"{path}: not a dataloader state; resume from an earlier global_step_N"]
    saved = "_snapshot" in state  # torchdata's multi-process state; a single-process one has _num_yielded at the top
    if saved != (workers > 0):
        was = "with dataloader worker processes" if saved else "without dataloader worker processes"
        fix = "a positive number, e.g. 8 (verl's default)" if saved else "0 (the recipe's default)"
        return [
            f"{path} was written by a dataloader {was}, which data.dataloader_num_workers={workers} cannot restore; "
            f"set data.dataloader_num_workers to {fix} to resume this run"
        ]
    return []
