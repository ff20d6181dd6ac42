"""The Hugging Face model in what ``scripts/train.sh`` writes: verl's checkpoints, merged once by verl's own merger.

verl 0.9.1 saves the actor every ``trainer.save_freq`` steps as FSDP shards::

    checkpoints/stapo/<method>_<size>/              trainer.default_local_dir
        latest_checkpointed_iteration.txt            the newest complete step
        global_step_N/
            data.pt                                  the dataloader's position
            actor/
                model_world_size_W_rank_R.pt         weights, one shard per GPU (W GPUs)
                optim_world_size_W_rank_R.pt         Adam states
                extra_state_world_size_W_rank_R.pt   learning-rate schedule, RNG states
                fsdp_config.json                     FSDP version and W
                huggingface/                         config.json and the tokenizer; the weights only with
                                                     checkpoint.save_contents containing hf_model
                huggingface_merged/                  written here (:data:`MERGED`), on first use

The recipe keeps verl's default ``save_contents`` (no ``hf_model``): a full copy of the weights at every save would
add the model's size in bfloat16 to each checkpoint (3.4 GB at 1.7B, 28 GB at 14B) and gather them on rank 0 while
the GPUs wait, for every one of the run's 30 saves, while only the checkpoints that get evaluated need it. Instead the
tools that load a model (``python -m stapo.tools.evaluate --model``, ``python -m stapo.tools.inspect_tokens
--model``) take the run folder (its newest step), a ``global_step_N`` folder, its ``actor/`` or
``actor/huggingface/``, and merge the shards once with ``verl.model_merger`` into ``actor/huggingface_merged/``
(through a temporary folder and a rename, so that a folder of that name is always complete), which later calls
reuse. A plain Hugging Face folder is used as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from stapo.tools.io import follow_umask, model_folder_problems

TRACKER = "latest_checkpointed_iteration.txt"
"""verl's record of the newest complete step, in ``trainer.default_local_dir``."""
MERGED = "huggingface_merged"
"""The merged Hugging Face folder, beside verl's ``huggingface/`` in ``global_step_N/actor/``."""


class CheckpointError(ValueError):
    """A path that holds no loadable model; the message names it and says what would."""


def has_weights(folder: Path) -> bool:
    """Whether a Hugging Face folder holds weight files (safetensors or PyTorch ``.bin``), not only its config."""
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


@dataclass(frozen=True)
class ModelSource:
    """Where a tool's ``--model`` loads from: a Hugging Face ``folder``, and the verl ``actor`` checkpoint to merge
    into it first while the folder does not exist yet (None otherwise)."""

    folder: Path
    actor: Path | None = None

    def ready(self) -> Path:
        """The folder, merged from the checkpoint first if it is not there yet."""
        if self.actor is not None and not self.folder.is_dir():
            merge(self.actor, self.folder)
        return self.folder


def _actor_folder(path: Path) -> Path | None:
    """The ``global_step_N/actor`` folder that ``path`` names (the run folder: its newest step), or None."""
    if (path / TRACKER).is_file():
        step = (path / TRACKER).read_text().strip()
        if not step.isdigit():
            raise CheckpointError(f"{path / TRACKER}: {step!r} is not a step number; name a global_step_N folder")
        path = path / f"global_step_{int(step)}"
        if not path.is_dir():
            raise CheckpointError(f"{path.parent / TRACKER} names step {step}, but {path} does not exist")
    if path.name == "huggingface":
        path = path.parent
    if (path / "actor" / "fsdp_config.json").is_file():
        path = path / "actor"
    return path if (path / "fsdp_config.json").is_file() else None


def find_model(path: Path, option: str = "--model") -> ModelSource:
    """The model that ``path`` names: a Hugging Face folder with weights, or a checkpoint of a training run (module
    docstring). Checks files only (nothing is merged or loaded); :class:`CheckpointError` in one line otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{option} {path}: no such folder")
    actor = _actor_folder(path)
    if actor is None:
        if not (path / "config.json").is_file():
            raise CheckpointError(
                f"{option} {path}: neither a Hugging Face model folder (no config.json) nor a training checkpoint "
                f"(a global_step_N folder, its actor/, or the run folder with {TRACKER})"
            )
        if not has_weights(path):
            raise CheckpointError(f"{option} {path}: config.json but no weight files (*.safetensors) in it")
        for problem in model_folder_problems(path, f"{option} {path}"):
            raise CheckpointError(problem)
        return ModelSource(path)
    for folder in (actor / "huggingface", actor / MERGED):
        if has_weights(folder):
            return ModelSource(folder)
    world = json.loads((actor / "fsdp_config.json").read_text()).get("world_size")
    ranks = range(world) if isinstance(world, int) else range(0)
    shards = [actor / f"model_world_size_{world}_rank_{rank}.pt" for rank in ranks]
    missing = [shard.name for shard in shards if not shard.is_file() or shard.stat().st_size == 0]
    if not shards or missing:
        raise CheckpointError(
            f"{option} {path}: the checkpoint in {actor} has no complete model weights "
            f"({', '.join(missing[:2]) or 'no world_size in fsdp_config.json'} missing); pick another global_step_N"
        )
    if not (actor / "huggingface" / "config.json").is_file():
        raise CheckpointError(f"{option} {path}: {actor / 'huggingface' / 'config.json'} is missing (verl writes it)")
    return ModelSource(actor / MERGED, actor)


def merge(actor: Path, target: Path) -> None:
    """Merge verl's FSDP checkpoint in ``actor`` into the Hugging Face folder ``target`` with verl's own merger
    (``python -m verl.model_merger merge --backend fsdp``) on the CPU, in a process of its own, written to a temporary
    folder beside ``target`` and renamed when complete.

    A process of its own: the shards hold DTensors whose device mesh was on the GPUs, and unpickling them initialises
    CUDA in the process that loads them; vLLM, started after the merge in the same process, then forks its engine
    and fails ("Cannot re-initialize CUDA in forked subprocess", H200, 2026-11-28)."""
    print(f"merging verl's checkpoint {actor} into {target} (once; verl.model_merger) ...", flush=True)
    began = time.monotonic()
    try:
        partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    except OSError as error:
        raise CheckpointError(
            f"{actor}: cannot write the merged model beside it ({error.strerror}); merge it elsewhere with "
            f"`python -m verl.model_merger merge --backend fsdp --local_dir {actor} --target_dir DIR` and pass DIR"
        ) from None
    command = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp"]
    command += ["--local_dir", str(actor), "--target_dir", str(partial)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, check=False
        )
        if done.returncode:
            last = ([line for line in done.stderr.splitlines() if line.strip()] or ["no output"])[-1][:300]
            raise CheckpointError(
                f"{actor}: verl's merger failed ({last}); a shard may be damaged or cut off: pick another global_step_N"
            )
        follow_umask(partial)  # safetensors and mkdtemp make 0600/0700
        try:
            os.rename(partial, target)
        except OSError:
            if not target.is_dir():
                raise
            shutil.rmtree(partial)  # another process (an evaluation shard) merged it meanwhile: same weights
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(f"merged in {time.monotonic() - began:.1f} s: {target}", flush=True)


if __name__ == "__main__":  # a library: say so, and what uses it, instead of printing nothing
    print(
        f"{__doc__.strip()}\n\nNot a command of its own: `python -m stapo.tools.evaluate --model CHECKPOINT` and "
        "`python -m stapo.tools.inspect_tokens --model CHECKPOINT` find, merge and load checkpoints with it."
    )
    sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
