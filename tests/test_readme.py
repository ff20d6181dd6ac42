"""Every command the README prints is accepted as printed: each ``python -m stapo.*`` line by its own argument parser
(the real one, stopped right after parsing), each ``scripts/train.sh`` line by the recipe's config (composed with its
overrides and checked by the trainer's checks, without GPUs or files), each launcher line's method and size by the
config folder. What the commands do is tested elsewhere; the GPU runs with records are in docs/evidence/."""

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from stapo.config import CONFIG_DIR, methods, sizes
from stapo.train.main import validate

README = Path(__file__).resolve().parents[1] / "README.md"


def commands() -> list[list[str]]:
    """The README's shell lines that run the recipe, split as the shell would (continuations joined, comments dropped,
    $STAPO_DATA set)."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():  # a line continued with a backslash is one command
            words = shlex.split(line.replace("$STAPO_DATA", "/data/stapo"), comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # RAY_ADDRESS=... bash ...
                words = words[1:]
            if words and (
                words[:2] == ["python", "-m"] and words[2].startswith("stapo.") or words[0] in ("bash", "sbatch")
            ):
                found.append(words)
    return found


class Parsed(Exception):
    """Raised with the parsed options in place of the program's work."""


PATH = (
    *("bash scripts/quickstart.sh", "python -m stapo.tools.data", "bash scripts/train.sh"),
    *("python -m stapo.tools.evaluate", "python -m stapo.tools.report", "python -m stapo.tools.inspect_tokens"),
    *("bash scripts/ray_job.sh", "sbatch --nodes=4 scripts/slurm.sbatch", "python -m stapo.tools.cost"),
)
"""The user's path: quickstart, data, train, evaluate, tables and curves, tokens, several nodes, cost."""


def test_the_readme_prints_the_whole_path():
    printed = {" ".join(words[:3]) for words in commands()}
    for step in PATH:
        assert any(line.startswith(step) for line in printed), step


@pytest.mark.parametrize("words", [w for w in commands() if w[0] == "python"], ids=" ".join)
def test_each_python_command_parses_as_printed(words, monkeypatch):
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        raise Parsed(original(parser, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    module = importlib.import_module(words[2])
    main = getattr(module, "main", None) or importlib.import_module(f"{words[2]}.__main__").main
    with pytest.raises(Parsed):
        main(words[3:])


@pytest.mark.parametrize("words", [w for w in commands() if w[0] in ("bash", "sbatch")], ids=" ".join)
def test_each_launcher_names_a_method_and_size_that_compose(words):
    script = next(i for i, word in enumerate(words) if word.startswith("scripts/"))
    if words[script] == "scripts/quickstart.sh":
        return  # its options are python -m stapo.quickstart's, run by tests/test_quickstart.py
    method, size, *overrides = words[script + 1 :]
    assert method in methods() and size in sizes()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        validate(compose(method, [f"size={size}", *overrides]), environment=False)


def test_the_smollm2_example_trains_on_files_the_readme_makes(tmp_path, monkeypatch):
    """Section 4's first run without the hub, as printed: the task command of section 3 writes the files, and the
    train.sh line names them for training and validation (it once named only the training file, and the preflight
    stopped on the hub benchmarks' $STAPO_DATA/aime24.parquet); its data pass the preflight's checks."""
    import subprocess
    import sys

    from stapo.train import preflight

    data = tmp_path / "stapo"
    lines = [" ".join(words) for words in commands()]
    (task,) = [line for line in lines if line.startswith("python -m stapo.quickstart.task word")]
    (train,) = [words for words in commands() if words[:4] == ["bash", "scripts/train.sh", "stapo", "smollm2_135m"]]
    made = subprocess.run([sys.executable, *task.replace("/data/stapo", str(data)).split()[1:]], capture_output=True)
    assert made.returncode == 0, made.stderr
    overrides = [word.replace("/data/stapo", str(data)) for word in train[4:]]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        config = compose("stapo", ["size=smollm2_135m", *overrides])
    assert preflight._data_problems(config) == []
    assert config.data.val_files == str(data / "word1" / "validation.parquet")
