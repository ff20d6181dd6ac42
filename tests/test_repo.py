"""The README's two commands are what CI runs; the shell launchers parse."""

import os
import re
import shutil
import subprocess
import sys
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
    for script in ("train.sh", "ray_job.sh", "slurm.sbatch", "check_launchers.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "train.sh"), "ppo", "qwen3_8b"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "unknown method 'ppo'" in out.stderr
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "train.sh"), "stapo", "qwen3_4b"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "unknown size 'qwen3_4b'" in out.stderr
    out = subprocess.run(  # any config group, in one line
        ["bash", str(ROOT / "scripts" / "train.sh"), "stapo", "qwen3_8b", "determinism=ful"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert (out.returncode, out.stderr) == (2, "error: unknown determinism 'ful'; choose one of: full, none\n")
    out = subprocess.run(["bash", str(ROOT / "scripts" / "train.sh")], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout.startswith("usage: python -m stapo.train") and out.stderr == ""


def test_ray_job_stops_with_one_line_before_contacting_a_cluster():
    """scripts/check_launchers.sh submits to a real local Ray head and runs slurm.sbatch under a real Slurm; these are
    the error paths that need neither."""
    script = str(ROOT / "scripts" / "ray_job.sh")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(["bash", script], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and out.stderr.startswith(
        "usage: RAY_ADDRESS=http://HEAD_IP:8265 bash scripts/ray_job.sh"
    )
    out = subprocess.run(["bash", script, "stapo", "qwen3_1.7b"], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: RAY_ADDRESS is not set: set RAY_ADDRESS=http://HEAD:8265, the dashboard address of the Ray cluster"
    ]
    for method, size, said in (("stapoo", "qwen3_8b", "method 'stapoo'"), ("stapo", "qwen3_4b", "size 'qwen3_4b'")):
        out = subprocess.run(["bash", script, method, size], capture_output=True, text=True, env=env)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith(f"error: unknown {said}")
        assert ("stapo, " if method != "stapo" else "qwen3_8b, ") in out.stderr


def test_check_launchers_explains_itself_and_asks_before_changing_the_system(tmp_path):
    """--help and a bad argument print the usage and change nothing; without --yes and without a terminal the
    script lists the system changes parts (b) and (c) need and stops before any check (as root, where Slurm is not
    installed; the list is never empty: (c) always starts a private two-node Slurm)."""
    script = str(ROOT / "scripts" / "check_launchers.sh")
    out = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("usage: bash scripts/check_launchers.sh [--yes]")
    assert "apt-get" in out.stdout and "/etc/slurm/slurm.conf" in out.stdout and out.stderr == ""
    out = subprocess.run(["bash", script, "--bogus"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stderr.startswith("usage:") and out.stdout == ""
    if os.geteuid() == 0 and not shutil.which("slurmctld"):
        out = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert out.returncode == 1 and "apt-get install slurm-wlm munge" in out.stdout
        assert "run with --yes" in out.stdout and "PASS" not in out.stdout and "two slurmd" in out.stdout


def help_texts() -> dict[str, str]:
    """What ``--help`` prints for every command line of the package (each ``python -m`` module and its subcommands,
    and each script of ``scripts/``)."""
    import re
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    root = Path(__file__).resolve().parents[1]
    modules = ["stapo.train"] + sorted(
        ".".join(path.relative_to(root).with_suffix("").parts)
        for path in (root / "stapo").rglob("*.py")
        if 'if __name__ == "__main__"' in path.read_text()
    )

    def usage(command: list[str]) -> str:
        done = subprocess.run([*command, "--help"], capture_output=True, text=True, cwd=root, timeout=120)
        return done.stdout + done.stderr

    def shown(argv: list[str]) -> str:
        return usage([sys.executable, "-m", *argv])

    with ThreadPoolExecutor(4) as pool:
        texts = dict(zip(modules, pool.map(lambda m: shown([m]), modules), strict=True))
        subcommands = [
            [module, sub] for module, text in texts.items() for group in re.findall(r"^\s*\{([\w,-]+)\}", text, re.M)
            for sub in group.split(",")
        ]  # fmt: skip
        texts |= dict(zip(map(" ".join, subcommands), pool.map(shown, subcommands), strict=True))
        scripts = [str(path.relative_to(root)) for path in sorted(root.glob("scripts/**/*.sh")) + sorted(
            root.glob("scripts/*.sbatch")) if path.name != "lib.sh"]  # fmt: skip  # (lib.sh is sourced, not run)
        texts |= dict(zip(scripts, pool.map(lambda script: usage(["bash", script]), scripts), strict=True))
    return texts


def test_no_help_text_cites_an_issue_number():
    """The project's issue numbers mean nothing to a user: ``--help`` of every command says what it does instead
    (docs and tests may cite them)."""
    import re

    texts = help_texts()
    assert len(texts) > 30 and all(text.strip() and "Traceback" not in text for text in texts.values()), texts
    cited = {command: re.findall(r".{0,40}\bissues? #?\d+.{0,20}", text) for command, text in texts.items()}
    assert {command: found for command, found in cited.items() if found} == {}
