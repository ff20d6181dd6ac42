"""What ``scripts/train.sh`` writes is what ``evaluate --model`` and ``inspect_tokens --model`` read.

The checkpoint is written by verl's own code on the CPU (tests/standins.py ``checkpoint``: the model sharded by
verl's ``apply_fsdp2`` over two gloo processes, saved by verl's ``FSDPCheckpointManager``), in the layout of a
training run; the tools merge it with verl's own ``verl.model_merger``.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_inspect import eval_samples

from stapo.quickstart.tiny import build_model, build_tokenizer
from stapo.tools import evaluate as ev
from stapo.tools import inspect_tokens as ins
from stapo.tools.checkpoint import MERGED, CheckpointError, find_model

STANDINS = Path(__file__).with_name("standins.py")


def verl_checkpoint(model: Path, run: Path, step: int, world: int) -> Path:
    """``run/global_step_<step>`` written by verl's checkpoint code over ``world`` CPU processes."""
    command = [sys.executable, str(STANDINS), "checkpoint", str(model), str(run), str(step), "--world", str(world)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return run / f"global_step_{step}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model and a run folder ``checkpoints/stapo/stapo_qwen3_1.7b`` with steps 2 and 4 of it (two GPUs)."""
    root = tmp_path_factory.mktemp("checkpoint")
    model = root / "model"
    build_model(build_tokenizer(["What is 6 times 7? \\boxed{42}"] * 20, model, vocab_size=300), model, hidden_size=64)
    run = root / "checkpoints" / "stapo" / "stapo_qwen3_1.7b"
    for step in (2, 4):
        verl_checkpoint(model, run, step, world=2)
    return model, run


def test_every_folder_of_a_run_names_its_merged_weights(trained):
    """The run folder (its newest step by verl's tracker), the step, its actor/ and actor/huggingface/ (config and
    tokenizer only: what verl writes without hf_model) all lead to one merge, made once, equal to the model."""
    from transformers import AutoModelForCausalLM

    model, run = trained
    actor = run / "global_step_4" / "actor"
    assert not any((actor / "huggingface").glob("*.safetensors"))  # verl saved no weights there
    sources = {find_model(path) for path in (run, run / "global_step_4", actor, actor / "huggingface")}
    assert len(sources) == 1
    source = sources.pop()
    assert source.folder == actor / MERGED and source.actor == actor and not source.folder.exists()
    assert source.ready() == actor / MERGED
    assert "verl.model_merger.fsdp_model_merger" not in sys.modules  # merged in a process of its own (docstring)
    merged = AutoModelForCausalLM.from_pretrained(actor / MERGED).state_dict()
    original = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).state_dict()
    assert merged.keys() == original.keys() and all(torch.equal(merged[k], original[k]) for k in original)
    assert not list(actor.glob(f".{MERGED}*"))  # no temporary folder left
    assert find_model(run) == type(source)(actor / MERGED)  # merged once: used as it is from now on
    written = (actor / MERGED / "model.safetensors").stat().st_mtime_ns
    find_model(run).ready()
    assert (actor / MERGED / "model.safetensors").stat().st_mtime_ns == written
    assert (actor / MERGED / "model.safetensors").stat().st_mode & 0o777 == 0o644  # as the other outputs (umask 022)


def test_evaluate_and_inspect_take_the_checkpoint_as_it_is(trained, tmp_path, capsys, monkeypatch):
    """``evaluate --model <step folder>``: labelled by experiment and step, method and size from the path, prompts
    from the checkpoint's tokenizer; ``inspect_tokens --model <run folder>`` reads the same weights."""
    from stapo.tools.data import make_prompt, write_parquet

    model, run = trained
    rows = [
        {
            "data_source": "aime24",
            "prompt": make_prompt("What is 6 times 7?"),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "42"},
            "extra_info": {"index": 0, "split": "test"},
        }
    ]
    write_parquet(rows, tmp_path / "data" / "aime24.parquet")
    argv = ["--model", str(run / "global_step_2"), "--data", str(tmp_path / "data"), "--benchmarks", "aime24"]
    args = ev.build_parser().parse_args([*argv, "--out", str(tmp_path / "eval"), "--n", "2"])
    monkeypatch.setattr(ev.VLLMGenerator, "check", staticmethod(lambda: None))  # vLLM cannot exist on this machine
    (plan,) = ev.plan_runs(args)
    assert plan.labels == {"label": "stapo_qwen3_1.7b_step2", "method": "stapo", "size": "qwen3_1.7b"}
    assert plan.settings["model"] == str(run / "global_step_2" / "actor" / MERGED)
    assert plan.dir == tmp_path / "eval" / "stapo_qwen3_1.7b_step2" / "train"
    assert "What is 6 times 7?" in plan.problems[0].prompt and plan.problems[0].prompt_ids

    from transformers import AutoTokenizer

    samples = eval_samples(AutoTokenizer.from_pretrained(model), tmp_path / "samples.jsonl")
    ins.main(["--model", str(run), "--rollouts", str(samples), "--tau-p", "0.5", "--device", "cpu"])
    assert "4 samples" in capsys.readouterr().out


def test_what_holds_no_model_is_named_in_one_line(trained, tmp_path):
    model, run = trained
    copy = tmp_path / "run"
    verl_checkpoint(model, copy, 3, world=2)
    actor = copy / "global_step_3" / "actor"
    (copy / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(CheckpointError, match=r"names step 7, but .*global_step_7 does not exist"):
        find_model(copy)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    for path, message in (
        (tmp_path / "missing", "no such folder"),
        (tmp_path, "neither a Hugging Face model folder"),
        (config_only, "config.json but no weight files"),
    ):
        with pytest.raises(CheckpointError, match=message):
            find_model(path)
    shard = actor / "model_world_size_2_rank_1.pt"
    shard.write_bytes(shard.read_bytes()[:1000])  # cut off, as by a full disk
    with pytest.raises(CheckpointError, match=r"verl's merger failed .*a shard may be damaged"):
        find_model(copy / "global_step_3").ready()
    assert not (actor / MERGED).exists() and not list(actor.glob(f".{MERGED}*"))  # nothing half-written is left
    shard.unlink()
    with pytest.raises(CheckpointError, match="no complete model weights .*model_world_size_2_rank_1.pt missing"):
        find_model(actor)


def test_a_run_that_saved_hugging_face_weights_needs_no_merge(trained, tmp_path):
    """``checkpoint.save_contents`` with ``hf_model``: verl's ``huggingface/`` holds the weights and is used."""
    model, _ = trained
    step = verl_checkpoint(model, tmp_path / "run", 1, world=1)
    for name in ("model.safetensors", "config.json"):
        (step / "actor" / "huggingface" / name).write_bytes((model / name).read_bytes())
    assert find_model(step) == type(find_model(step))(step / "actor" / "huggingface")
    assert json.loads((step / "actor" / "fsdp_config.json").read_text())["world_size"] == 1


def test_running_the_module_says_what_it_is():
    """``python -m stapo.tools.checkpoint --help`` printed nothing: it says it is a library, and what uses it."""
    out = subprocess.run(
        [sys.executable, "-m", "stapo.tools.checkpoint", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "Not a command of its own: `python -m stapo.tools.evaluate" in out.stdout
    assert subprocess.run([sys.executable, "-m", "stapo.tools.checkpoint"], capture_output=True).returncode == 2
