"""What a new user meets first (issue 27): every command's misuse is one clear line naming the option or file and
the fix, before any work; nothing is left behind by a refused command; outputs are readable like any other file."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import standins

from stapo.tools.io import model_folder_problems, output_problem

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # GPU checks see no GPU, also on a GPU machine
    return subprocess.run([*args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)


def tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.fixture
def place(tmp_path):
    """A working directory with a file and a folder where outputs of the other kind are asked for, an empty and a junk
    file, and a folder holding an empty summary.json."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "junk.gguf").write_bytes(b"not a model")
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "summary.json").write_text("")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize(
    "command, expected",
    [
        (["-m", "stapo.tools.report", "table", "--paper", "--out", "a-file"], "--out a-file: a file is in the way"),
        (["-m", "stapo.tools.data", "eval", "--src", "a-folder", "--out", "a-file"], "--out a-file: a file is in"),
        (["-m", "stapo.checks.scale", "summary", "/missing.jsonl"], "/missing.jsonl: no such file or folder"),
        (["-m", "stapo.checks.benchmark", "actor", "--out", "b"], "runs on a CUDA GPU and none is visible"),
        (["-m", "stapo.checks.benchmark", "attention"], "runs on a CUDA GPU and none is visible"),
        (
            ["-m", "stapo.checks.benchmark", "gpu", "--out", "b", "--model", "qwen3_1.7b", "--tokenizer", "tok"]
            + ["--weights", "a-folder"],
            "--weights a-folder: no config.json in it",
        ),
        (  # the standalone vLLM run is on one GPU: a rollout over two would look twice as fast
            ["-m", "stapo.checks.benchmark", "gpu", "--out", "b", "--gpus", "2", "--standalone", "2"],
            "--standalone compares the rollout with vLLM on one GPU; run it with --gpus 1",
        ),
        (["-m", "stapo.checks.gpu_smoke", "--out", "s"], "--gpus 1: 0 CUDA GPU(s) visible"),
        (
            ["-m", "stapo.checks.gpu_smoke", "--out", "s", "--trainer-mode", "stapo_separate_async"],
            "--gpus 1 (+ 1 for the rollout of --trainer-mode stapo_separate_async): 0 CUDA GPU(s) visible",
        ),
        (
            ["-m", "stapo.checks.gpu_smoke", "--out", "s", "--gpus", "2", "--nodes", "2", "--trainer-mode"]
            + ["stapo_colocate_async"],
            "--trainer-mode stapo_colocate_async runs on one node here: leave out --nodes",
        ),
        (["-m", "stapo.train", "--config-name=stapo", "stapo.tau_p=5"], "stapo.tau_p=5 is out of range"),
        # issue 38's list, as a new user met each at commit ea1edb6 (a traceback, or something left behind)
        (["-m", "stapo.train", "--config-name=stapo", "trainer.n_gpus_per_node=abc"], "n_gpus_per_node=abc: must be"),
        (["-m", "stapo.train", "--config-name=stapo", "trainer.n_gpus_per_node=1.5"], "n_gpus_per_node=1.5: must be"),
        (["-m", "stapo.train", "--config-name=stapo", "data.train_files=[]"], "data.train_files=[]: name one"),
        (["bash", "scripts/quickstart.sh", "a-file"], "--out a-file: a file is in the way"),
        (["-m", "stapo.tools.report", "table", "runs"], "summary.json: not a summary.json"),
        (["-m", "stapo.tools.pretrained", "--out", "m", "--src", "empty.gguf"], "empty.gguf: not a GGUF file"),
        (["-m", "stapo.tools.pretrained", "--out", "m", "--src", "junk.gguf"], "junk.gguf: not a GGUF file"),
        (["-m", "stapo.checks.gpu_smoke", "--out", "s", "--gpus", "0"], "--gpus 0: must be a positive integer"),
        (["-m", "stapo.checks.gpu_smoke", "--out", "s", "--gpus", "-1"], "--gpus -1: must be a positive integer"),
        (["-m", "stapo.tools.inspect_tokens", "--model", "a-folder", "--rollouts", "r"], "a-folder: neither"),
        (["-m", "stapo.tools.inspect_tokens", "--model", "m", "--rollouts", "r", "--tau-p", "5"], "--tau-p=5.0 is out"),
        (["-m", "stapo.quickstart.task", "arith", "--train", "-5", "--out", "t"], "--train -5: must be a positive"),
        (["-m", "stapo.quickstart.task", "word", "--val", "0", "--out", "t"], "--val 0: must be a positive"),
        (["bash", "scripts/slurm.sbatch", "stapo", "qwen3_1.7b"], "not inside a Slurm job"),
        (["-m", "stapo.tools.evaluate", "--model", "missing"], "--model missing: no such folder"),
        # issue 64's list, as a new user met each at commit a7923fb (a misleading line, or many)
        (
            ["-m", "stapo.train", "--config-name=stapo", "size=smollm2_135m", "stapo.tau_p", "0.1"],
            "stapo.tau_p 0.1: an override is KEY=VALUE; write stapo.tau_p=0.1",
        ),
        (
            ["-m", "stapo.train", "--config-name=stapo", "stapo.tau=0.1"],
            "stapo.tau: no such key in the config; did you mean stapo.tau_p? (a key of your own: +stapo.tau=VALUE)",
        ),
        (
            ["-m", "stapo.train", "--config-name=stapo", "trainer.total_trainig_steps=2"],
            "did you mean trainer.total_training_steps?",
        ),
        (
            ["-m", "stapo.quickstart", "cpu", "--out", "q", "--train", "700", "--val", "100"],
            "--train 700 + --val 100 = 800 problems, but the task has 729 distinct ones",
        ),
        (
            ["-m", "stapo.quickstart", "cpu", "--out", "q", "--hidden-size", "7"],
            "--hidden-size=7: gives attention heads of 7 dimensions, and rotary embeddings need an even number",
        ),
    ],
)
def test_misuse_is_one_line_and_leaves_nothing(place, command, expected):
    """One line on stderr, a non-zero exit, and no file written (no Hydra outputs/ folder, no half-made output);
    verl's import-time notices about engines and accelerators are not shown before it."""
    before = tree(place)
    if command[0] == "bash":
        command = [command[0], str(ROOT / command[1]), *command[2:]]
        out = run(*command, cwd=place)
    else:
        out = run(sys.executable, *command, cwd=place)
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], out
    assert tree(place) == before


def test_every_command_train_help_prints_runs_as_printed(tmp_path):
    """``bash scripts/train.sh --help`` ends with a command to print the composed config: it runs as printed (it
    once failed as printed: Hydra's ``--cfg job`` took ``job`` for an override), and the help names docs that exist."""
    help_text = run("bash", str(ROOT / "scripts" / "train.sh"), "--help", cwd=tmp_path).stdout
    (printed,) = [line.split(": ", 1)[1] for line in help_text.splitlines() if "without running:" in line]
    assert printed == "python -m stapo.train --config-name=stapo --cfg=job"
    out = run(sys.executable, *printed.split()[1:], cwd=tmp_path)
    assert out.returncode == 0 and "stapo:" in out.stdout and "tau_p: 0.002" in out.stdout, out.stderr
    spaced = run(sys.executable, "-m", "stapo.train", "--config-name", "stapo", "--cfg", "job", cwd=tmp_path)
    assert spaced.returncode == 0 and "tau_p: 0.002" in spaced.stdout, spaced.stderr  # Hydra's spelling works too
    for doc in {word.strip("();,:") for word in help_text.split() if word.startswith(("docs/", "(docs/"))}:
        assert (ROOT / doc).is_file(), doc


def test_the_smollm2_size_files_missing_model_folder_is_named_before_ray(tmp_path):
    """The smollm2 size file's model is ``models/smollm2``, a relative path of two parts like a hub id (ORG/NAME); the
    hub keeps the name ``models``, so a missing folder is named before Ray starts, with how to make it."""
    data = tmp_path / "d.parquet"
    out = run(sys.executable, "-m", "stapo.train", "--config-name=stapo", "size=smollm2_135m",
              f"data.train_files={data}", f"data.val_files={data}", cwd=tmp_path)  # fmt: skip
    line = [line for line in out.stderr.splitlines() if "actor_rollout_ref.model.path" in line]
    assert out.returncode != 0 and line == [
        "error: actor_rollout_ref.model.path=models/smollm2: no such folder (models/ is a folder name, not a hub "
        "organisation); make the model there (SmolLM2: python -m stapo.tools.pretrained --out models/smollm2) or set "
        "actor_rollout_ref.model.path=DIR"
    ], out.stderr
    assert "ray init kwargs" not in out.stdout and "Started a local Ray" not in out.stderr  # stopped before Ray


def test_a_truncated_or_unreadable_weights_file_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    assert model_folder_problems(tmp_path) == []
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(10))
    (problem,) = model_folder_problems(tmp_path)
    size, end = 8 + len(header) + 10, 8 + len(header) + 16
    assert problem == f"{tmp_path / 'model.safetensors'}: truncated ({size:,} of {end:,} bytes); copy it again"
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    (problem,) = model_folder_problems(tmp_path)
    assert "model.safetensors: not a readable safetensors file" in problem
    (tmp_path / "config.json").unlink()
    assert model_folder_problems(tmp_path, "actor_rollout_ref.model.path=X") == [
        "actor_rollout_ref.model.path=X: no config.json in it; pass a Hugging Face model folder"
    ]
    assert output_problem(tmp_path, "folder") is None and "a folder is in the way" in output_problem(tmp_path, "file")


def test_train_sh_says_what_is_missing(tmp_path):
    out = run("bash", str(ROOT / "scripts" / "train.sh"), "stapo", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert (
        out.stderr.startswith("error: SIZE is missing: bash scripts/train.sh stapo SIZE") and "qwen3_8b" in out.stderr
    )


def test_quickstart_sh_help_is_help(tmp_path):
    script = str(ROOT / "scripts" / "quickstart.sh")
    out = run("bash", script, "--help", cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and "bash scripts/quickstart.sh [OUT] [OPTION ...]" in out.stdout
    assert "usage: python -m stapo.quickstart" in out.stdout and not (tmp_path / "--help").exists()
    out = run("bash", script, "--steps", "3", cwd=tmp_path)
    assert out.returncode == 2 and "the first argument is the output folder" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_model_weights_are_as_readable_as_other_outputs(tmp_path):
    from stapo.quickstart.tiny import build_model, build_tokenizer

    tok = build_tokenizer(["a b c"] * 5, tmp_path / "m", vocab_size=300)
    build_model(tok, tmp_path / "m", hidden_size=64, num_layers=1)
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "m").iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~umask == modes["config.json"], modes


@pytest.mark.parametrize(
    "script, args",
    [
        *((name, ["OUT"]) for name in ("bitwise.sh", "deadline.sh", "determinism.sh", "locate.sh")),
        ("decisive.sh", ["1", "OUT"]),
        ("selection.sh", ["pilot", "OUT"]),
        ("selection.sh", ["block", "1", "OUT", "2e-5", "30"]),
        *((name, ["OUT", "TOK"]) for name in ("modes.sh", "length.sh", "startup.sh")),
    ],
)
def test_a_gpu_script_where_there_is_no_gpu_is_one_line_before_any_work(tmp_path, script, args):
    """Before a download, a conversion or a Ray cluster: ``nvidia-smi`` is a stand-in that lists no GPU, as the real
    one answers on a machine without (the test passes on a GPU machine too), and the Python one that logs its calls."""
    tok, out = tmp_path / "tok", tmp_path / "new" / "out"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    args = [str(out) if a == "OUT" else str(tok) if a == "TOK" else a for a in args]
    done, calls = standins.run_gpu_script(tmp_path, script, standins.LOGGING_SH, *args, gpu=False)
    said = f"error: {script} needs an NVIDIA GPU, and nvidia-smi -L lists none here: run it on a GPU node\n"
    assert (done.returncode, done.stderr, calls) == (2, said, []) and not out.parent.exists()


def test_a_python_without_the_recipe_is_named_with_the_fix(tmp_path):
    """``PYTHON`` set to an interpreter without the recipe (a fresh virtual environment of this Python's base), or to
    no interpreter at all: the launchers say so in one line, before Python's own traceback."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    work = tmp_path / "work"
    work.mkdir()
    launches = (("train.sh", ["stapo", "qwen3_1.7b"]), ("quickstart.sh", ["qs"]), ("quickstart.sh", ["-h"]))
    for python in (tmp_path / "bare" / "bin" / "python", tmp_path / "none"):
        for script, args in launches:
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            done = subprocess.run(["bash", str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                                  cwd=work, env={**env, "PYTHON": str(python)}, timeout=60)  # fmt: skip
            said = (f"error: PYTHON={python}: no Python with the recipe (stapo, verl, torch); activate the environment "
                    "of pip install -e . or set PYTHON to its python\n")  # fmt: skip
            assert (done.returncode, done.stdout, done.stderr) == (2, "", said), (script, args)
    assert list(work.iterdir()) == []
