"""Stand-ins for the programs that need a GPU, so that the tests can run the recipe's chains of commands for real.

    python tests/standins.py train --config-name=METHOD KEY=VALUE ...   verl's trainer (python -m stapo.train)
    python tests/standins.py evaluate ARG ...                          python -m stapo.tools.evaluate, CPU sampling
    python tests/standins.py experiment ARG ...                        python -m stapo.quickstart.experiment
    python tests/standins.py pretrained ARG ...                        python -m stapo.tools.pretrained, any GGUF
    python tests/standins.py checkpoint MODEL RUN_DIR STEP [--world N]  a verl checkpoint of MODEL's weights

Each reads what the real program reads and writes what it writes, where it writes it, so that a wrong path between two
steps of a chain, a missing folder or a lost log fails the test that runs the chain:

* ``train`` composes the recipe's config with the overrides and runs the trainer's checks on it
  (:func:`stapo.train.main.validate`, without the GPU count), opens the model folder and the data files the config
  names, then writes what verl's V1 trainer writes for ``trainer.total_training_steps`` steps: the metrics, through
  verl's own ``FileLogger`` at ``$VERL_FILE_LOGGER_PATH`` (validation at step 0 and every ``test_freq`` steps and at
  the last), and a checkpoint every ``save_freq`` steps and at the last one, through verl's own
  ``FSDPCheckpointManager``. The metrics' values are made up (no model is trained); their keys are verl's. Like the
  recipe's trainer it resumes after the checkpoint that ``latest_checkpointed_iteration.txt`` names, setting the
  earlier metrics aside (``trainer.resume_mode=auto``, verl's default), and saves and exits with status 3 before
  ``stapo.deadline`` or on SIGUSR1/SIGTERM (:mod:`stapo.train.deadline`, with the recipe trainer's order: the save
  after the step, its metrics, then the stop); ``STANDIN_STEP_S`` paces its steps, and ``STANDIN_LOSE_NODE_AT=K``
  ends a first segment after step K as the driver ends on a lost Ray node (:mod:`stapo.train.nodes`: its line, status
  4), a stand-in for the node that the trainer does not have.
* ``checkpoint`` writes the model folder's weights as verl's FSDP checkpoint (``global_step_N/actor`` of
  ``RUN_DIR``, ``data.pt`` and ``latest_checkpointed_iteration.txt``): the model is sharded with verl's own
  ``apply_fsdp2`` over ``N`` CPU processes (gloo), as the engine shards it over N GPUs, and saved by verl's
  ``FSDPCheckpointManager``.
* ``evaluate`` is the real tool with only vLLM replaced, by sampling with transformers on the CPU.
* ``pretrained`` is the real converter without its check that the result is SmolLM2-135M: the tests hand it a
  small GGUF of SmolLM2's layout (tests/test_pretrained.py), since the real model's warm-up needs a GPU.
* ``experiment`` is the real tool with only the trainer replaced (by ``train`` above) and one GPU declared to it;
  its Ray clusters are real (other processes' clusters on the machine are not its own, as tests/conftest.py's
  ``foreign_ray_ignored`` decides).

:func:`calls` wraps a chain's runner (``stapo.quickstart.run.call``) so that it starts these instead of the real
programs and runs everything else as it is.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
STOOD_IN = {
    "stapo.train": "train",
    "stapo.tools.evaluate": "evaluate",
    "stapo.quickstart.experiment": "experiment",
    "stapo.tools.pretrained": "pretrained",
}
"""``python -m`` modules -> their stand-in here."""


def calls(call):
    """``call(cmd, log, **env)`` that runs the stand-in of a :data:`STOOD_IN` command and any other as it is."""

    def with_standins(cmd, log, **env):
        cmd = list(map(str, cmd))
        if cmd[1] == "-m" and cmd[2] in STOOD_IN:
            cmd = [sys.executable, str(HERE), STOOD_IN[cmd[2]], *cmd[3:]]
        return call(cmd, log, **env)

    return with_standins


LOGGING_SH = '#!/bin/sh\nprintf "%s\\n" "$*" >> {calls}\n'
"""A stand-in Python for :func:`run_gpu_script` that only logs its arguments, one call a line."""


def gpu_path(tmp_path: Path, gpu: bool = True) -> str:
    """A ``PATH`` of the system's folders behind a stand-in ``nvidia-smi`` that lists one GPU, or, without ``gpu``,
    none (as the real one answers on a machine without: "No devices were found", status 6): the scripts of
    scripts/gpu refuse to start where ``nvidia-smi -L`` lists none, and this machine has none."""
    folder = tmp_path / ("gpu-bin" if gpu else "no-gpu-bin")
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    answer = 'echo "GPU 0: stand-in (UUID: GPU-0)"' if gpu else "echo 'No devices were found'; exit 6"
    smi.write_text(f"#!/bin/sh\n{answer}\n")
    smi.chmod(0o755)
    return f"{folder}:/usr/bin:/bin"


def run_gpu_script(
    tmp_path: Path, script: str, program: str, *args, gpu: bool = True
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``bash scripts/gpu/SCRIPT ARGS`` as a user runs it (a PATH without this environment's), with a stand-in for the
    Python that needs a GPU: ``program``, a script's text whose ``{python}`` and ``{calls}`` are this interpreter and
    the file it logs its calls to, as ``STAPO_PYTHON``, and, with ``gpu``, for ``nvidia-smi`` (:func:`gpu_path`). The
    finished process and the logged calls."""
    calls, python = tmp_path / "calls", tmp_path / "python"
    python.write_text(program.format(python=sys.executable, calls=str(calls)))
    python.chmod(0o755)
    env = {"PATH": gpu_path(tmp_path, gpu), "STAPO_PYTHON": str(python), "PYTHONPATH": str(HERE.parents[1])}
    command = ["bash", str(HERE.parents[1] / "scripts" / "gpu" / script), *map(str, args)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    return done, calls.read_text().splitlines() if calls.exists() else []


def write_checkpoint(model: Path, run_dir: Path, step: int, world: int = 1) -> Path:
    """``run_dir/global_step_<step>`` with ``model``'s weights in verl's layout, written by verl's own code over
    ``world`` processes; returns the step folder."""
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_save_rank, args=(world, port, str(model), str(run_dir), step), nprocs=world, join=True)
    return run_dir / f"global_step_{step}"


def dataloader_state(workers: int) -> dict:
    """What verl saves as ``data.pt``: the state of its dataloader (torchdata's ``StatefulDataLoader``) with
    ``workers`` worker processes, after two batches."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(16)), batch_size=4, shuffle=True, num_workers=workers)
    it = iter(loader)
    next(it), next(it)
    return loader.state_dict()


def _save_rank(rank: int, world: int, port: int, model_dir: str, run_dir: str, step: int) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": True}, {})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    contents = ["model", "optimizer", "extra"]
    manager = FSDPCheckpointManager(
        model=model,
        optimizer=optimizer,
        lr_scheduler=None,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        checkpoint_config=OmegaConf.create({"save_contents": contents, "load_contents": contents}),
    )
    folder = Path(run_dir) / f"global_step_{step}"
    manager.save_checkpoint(str(folder / "actor"), global_step=step)
    if rank == 0:  # what verl's trainer writes after the workers' checkpoint (trainer_base._save_checkpoint)
        torch.save(dataloader_state(workers=0), folder / "data.pt")  # the recipe's 0 workers
        (Path(run_dir) / "latest_checkpointed_iteration.txt").write_text(str(step))
    dist.destroy_process_group()


def train(argv: list[str]) -> None:
    """verl's trainer, as module docstring says."""
    import pyarrow.parquet as pq
    from hydra import compose, initialize_config_dir
    from transformers import AutoConfig
    from verl.utils.tracking import FileLogger

    from stapo.config import CONFIG_DIR
    from stapo.tools.io import set_aside
    from stapo.train import deadline, nodes
    from stapo.train.main import ConfigError, finish_stop, prepare_stop, validate
    from stapo.train.trainer import file_logger_path

    start = deadline.launched_at()
    deadline.arm()
    method = next(a.split("=", 1)[1] for a in argv if a.startswith("--config-name="))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        config = compose(method, [a for a in argv if not a.startswith("--")])
    stapo = validate(config, environment=False)
    model = Path(config.actor_rollout_ref.model.path)
    AutoConfig.from_pretrained(model)  # the model folder the run starts from
    pq.read_table(config.data.train_files, columns=["prompt"])
    source = pq.read_table(config.data.val_files, columns=["data_source"]).column(0)[0].as_py()
    try:
        folder = prepare_stop(config, start)
    except ConfigError as error:  # as the real entry point (stapo.train.main._hydra_main) says it
        raise SystemExit(f"error: {error}") from None
    trainer = config.trainer
    steps, val_n = trainer.total_training_steps, config.actor_rollout_ref.rollout.val_kwargs.n
    os.environ.update(config.ray_kwargs.ray_init.runtime_env.get("env_vars") or {})  # what Ray gives the TaskRunner
    tracker = folder / "latest_checkpointed_iteration.txt"
    first = int(tracker.read_text()) + 1 if trainer.resume_mode == "auto" and tracker.is_file() else 1
    set_aside(file_logger_path(config), segment=first > 1)
    logger = FileLogger(trainer.project_name, trainer.experiment_name)  # $VERL_FILE_LOGGER_PATH
    validation = {f"val-core/{source}/acc/mean@{val_n}": 0.25}
    if trainer.val_before_train and first == 1:
        logger.log(validation, step=0)
    clock, stop = deadline.StepClock.of(config.stapo.deadline, stapo.deadline_margin, start), None  # as STAPOMixin
    for step in range(first, steps + 1):
        if stop is not None:  # STAPOMixin.on_step_begin
            deadline.answer(folder, step - 1, stop)
            break
        began = time.time()
        clock.began(began)
        time.sleep(float(os.environ.get("STANDIN_STEP_S", 0)))
        metrics = {"critic/score/mean": 0.3, "actor/entropy": 0.5 - 0.01 * step, "actor/grad_norm": 0.2}
        metrics |= {"response_length/mean": 40.0, "s2t/spurious_frac": 0.001, "s2t/candidate_frac": 0.002}
        if stapo.active:
            metrics |= {"stapo/candidate_tokens": 4.0, "stapo/masked_tokens": 3.0, "stapo/masked_frac": 0.001}
        saved = trainer.save_freq > 0 and (step % trainer.save_freq == 0 or step == steps)
        if saved:
            saving = time.time()
            write_checkpoint(model, folder, step)
            clock.saved(time.time() - saving)
        if step < steps and (stop := deadline.requested(folder) or clock.ended(time.time())):  # .on_step_end
            if not saved:
                write_checkpoint(model, folder, step)
            print(f"STAPO: saved step {step}: {stop}; stopping before the next step", flush=True)
        if trainer.test_freq > 0 and (step % trainer.test_freq == 0 or step == steps):
            metrics |= validation
        logger.log(metrics | {"timing_s/step": time.time() - began}, step=step)
        print(f"step:{step} - critic/score/mean:0.3", flush=True)
        if step == int(os.environ.get("STANDIN_LOSE_NODE_AT", 0)) and first == 1:  # as the driver's node watcher
            print(nodes.lost_line("Ray node standin (127.0.0.1, Ray node 0123456789ab) was lost"), flush=True)
            os._exit(nodes.NODE_LOST_EXIT)
    logger.finish()
    finish_stop(config, folder)


def evaluate(argv: list[str]) -> None:
    """``python -m stapo.tools.evaluate`` with vLLM replaced by transformers' sampling on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapo.tools import evaluate as tool

    class CPUGenerator(tool.VLLMGenerator):
        @staticmethod
        def check():  # no vLLM needed
            pass

        def __call__(self, prompt_ids, n):
            torch.manual_seed(self.seed)
            model = AutoModelForCausalLM.from_pretrained(self.model, dtype=torch.float32).eval()
            tokenizer = AutoTokenizer.from_pretrained(self.model)
            groups = []
            for ids in prompt_ids:
                output = model.generate(
                    torch.tensor([list(ids)]),
                    do_sample=True,
                    temperature=self.decoding.temperature,
                    top_p=self.decoding.top_p,
                    top_k=0,
                    max_new_tokens=self.max_tokens,
                    num_return_sequences=n,
                    pad_token_id=tokenizer.pad_token_id,
                )[:, len(ids) :].tolist()
                group = []
                for row in output:
                    ended = tokenizer.eos_token_id in row
                    row = row[: row.index(tokenizer.eos_token_id) + 1] if ended else row
                    text = tokenizer.decode(row, skip_special_tokens=True)
                    group.append(tool.Completion(text, "stop" if ended else "length", len(row)))
                groups.append(group)
            return groups

    tool.VLLMGenerator = CPUGenerator
    tool.main(argv)


def experiment(argv: list[str]) -> None:
    """``python -m stapo.quickstart.experiment`` with the trainer replaced by :func:`train` and one GPU declared."""
    from conftest import own_gcs_servers

    from stapo.quickstart import experiment as tool
    from stapo.train import preflight

    listing, me = preflight._gcs_servers, os.getpid()
    preflight._gcs_servers = lambda: own_gcs_servers(listing, me)
    tool.torch.cuda.device_count = lambda: 1
    tool.TRAINER = [sys.executable, str(HERE), "train"]
    tool.main(argv)


def pretrained(argv: list[str]) -> None:
    """``python -m stapo.tools.pretrained`` without the check of SmolLM2-135M's parameter count."""
    import functools

    from stapo.tools import pretrained as tool

    tool.convert = functools.partial(tool.convert, parameters=None)
    tool.main(argv)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "checkpoint":
        world = int(args[args.index("--world") + 1]) if "--world" in args else 1
        print(write_checkpoint(Path(args[0]), Path(args[1]), int(args[2]), world))
    else:
        {"train": train, "evaluate": evaluate, "experiment": experiment, "pretrained": pretrained}[command](args)
    print(json.dumps({"stand-in": command, "done": True}))
