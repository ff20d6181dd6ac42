"""The README's two commands are what CI runs; the shell launchers parse."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Set-up and tests.*?```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2, "the README shows exactly two commands: install, then test"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in block:
        assert command in ci, f"README command {command!r} is not run by .ci/run"
    assert ci.index(block[0]) < ci.index(block[1])


def test_launchers_parse_and_reject_bad_arguments():
    for script in ("train.sh", "ray_job.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "train.sh"), "ppo", "qwen3_8b"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "unknown method 'ppo'" in out.stderr
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "train.sh"), "stapo", "qwen3_4b"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "unknown size 'qwen3_4b'" in out.stderr
    out = subprocess.run(["bash", str(ROOT / "scripts" / "train.sh")], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout.startswith("usage: python -m stapo.train") and out.stderr == ""
