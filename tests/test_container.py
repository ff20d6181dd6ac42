"""The recipe's image (docker/Dockerfile, docker/build.sh) and slurm.sbatch's STAPO_CONTAINER: the image's pins follow
setup.py's, build.sh stops in one line, and the command lines slurm.sbatch runs with and without a container (srun,
scontrol and the container runner stubbed on PATH; docs/container.md has the builds and runs themselves)."""

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "docker" / "build.sh"


def _setup_requirements():
    """install_requires and extras_require["gpu"] as setup.py writes them (its text, not an install's metadata)."""
    call = next(
        node
        for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup"
    )
    keywords = {k.arg: k.value for k in call.keywords}
    extras = keywords["extras_require"]
    names = [ast.literal_eval(key) for key in extras.keys]
    gpu = ast.literal_eval(extras.values[names.index("gpu")])
    return ast.literal_eval(keywords["install_requires"]), gpu, names


def test_dockerfile_pins_follow_setup_py():
    install_requires, gpu, extras = _setup_requirements()
    (core,) = install_requires
    version = core.split("==")[1]
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    # the image's own check asserts setup.py's verl version
    assert re.search(r"assert v == '([^']+)'", dockerfile).group(1) == version
    # its default extra is the GPU one; the CPU variant's (build.sh) is one of setup.py's
    assert re.search(r"^ARG EXTRAS=(\S+)$", dockerfile, re.M).group(1) == "gpu"
    assert re.search(r"^  extras=(\S+)$", BUILD.read_text(), re.M).group(1) in extras
    # build.sh takes the GPU pins from REQUIRED_VERL.txt, which must name setup.py's gpu extra
    required = (ROOT / "recipe" / "stapo" / "REQUIRED_VERL.txt").read_text()
    assert gpu == [re.search(r'^PIP_INSTALL="(.+)"$', required, re.M).group(1)]
    assert re.search(r"^VERL_VERSION=(\S+)$", required, re.M).group(1) == version
    assert gpu[0].startswith("verl[") and gpu[0].endswith("==" + version)
    # the base the Dockerfile names carries what verl's vllm extra pins (torch, vLLM), as its header says
    pins = dict(
        re.fullmatch(r"(torch|vllm)==(\d+\.\d+)\.\d+", r.split(";")[0].strip()).groups()
        for r in importlib.metadata.requires("verl")
        if re.fullmatch(r'(torch|vllm)==\S+; extra == "vllm"', r)
    )
    header = dockerfile.split("ARG BASE=")[0]
    assert f"torch {pins['torch']}" in header and f"vLLM {pins['vllm']}" in header
    # the CPU variant's torch is the README's, as CI installs it
    readme_torch = re.search(r"pip install (torch==\S+) -e", (ROOT / "README.md").read_text()).group(1)
    assert re.search(r"torch==\S+", (ROOT / ".ci" / "run").read_text()).group(0) == readme_torch


def _stub(folder: Path, name: str, script: str):
    path = folder / name
    path.write_text("#!/bin/bash\n" + script)
    path.chmod(0o755)


def _bare_path(tmp_path):
    """A PATH with what build.sh needs of coreutils before its checks, for the stubs to be written into."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for command in ("dirname", "cat"):
        (folder / command).symlink_to(shutil.which(command))
    return folder


def _build(args, path, **env):
    return subprocess.run(
        [shutil.which("bash"), str(BUILD), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": str(path), "HOME": os.environ.get("HOME", "/root"), **env},
    )


def test_build_sh_explains_itself_and_rejects_bad_arguments(tmp_path):
    subprocess.run(["bash", "-n", str(BUILD)], check=True)
    path = _bare_path(tmp_path)
    out = _build(["--help"], path)
    assert out.returncode == 0 and out.stdout.startswith("usage: bash docker/build.sh") and out.stderr == ""
    assert "--base debian" in out.stdout and "mmdebstrap" in out.stdout
    for args, message in [
        (["--bogus"], "usage: bash docker/build.sh"),
        (["--tool"], "usage: bash docker/build.sh"),
        (["--variant", "cpu"], "error: --variant cpu needs --base debian"),
        (["--base", "alpine"], "error: --base alpine --variant gpu: use --base verl|debian"),
        (["--tool", "lxc"], "error: --tool lxc: use docker, podman or buildah"),
    ]:
        out = _build(args, path)
        assert out.returncode == 2 and out.stderr.startswith(message) and out.stdout == "", (args, out)


def test_build_sh_names_the_package_of_a_missing_tool(tmp_path):
    """Each stops in one line before any work: nothing is written to --work."""
    work = tmp_path / "work"
    path = _bare_path(tmp_path)
    cases = [
        ([], "error: no container builder here: apt-get install buildah (or podman, or docker.io with its engine)"),
        (["--tool", "buildah"], "error: buildah is missing: apt-get install buildah"),
        (["--tool", "podman"], "error: podman is missing: apt-get install podman"),
        (["--tool", "docker"], "error: docker is missing: apt-get install docker.io"),
    ]
    for args, line in cases:
        out = _build([*args, "--work", str(work)], path)
        assert out.returncode == 2 and out.stderr.splitlines() == [line], (args, out)
    _stub(path, "docker", "exit 1\n")  # the client without an engine, as on this project's machines
    out = _build(["--tool", "docker"], path)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "error: docker reaches no Docker engine (docker info fails): start dockerd, or use --tool podman|buildah"
    ]
    # buildah present, no image or tarball of the base yet, and no mmdebstrap to make one
    _stub(path, "buildah", "exit 1\n")
    _stub(path, "git", "exit 0\n")
    _stub(path, "python3", 'case $1 in -m) exit 0 ;; -c) echo "${PY:-3.11}" ;; esac\n')
    debian = ["--tool", "buildah", "--base", "debian", "--variant", "cpu", "--work", str(work)]
    out = _build(debian, path)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "error: mmdebstrap is missing: apt-get install mmdebstrap"
    ]
    out = _build(debian, path, PY="3.12")
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "error: the wheelhouse for Debian bookworm (Python 3.11) needs Python 3.11 here, python3 is 3.12: "
        "set PYTHON=python3.11"
    ]
    (path / "git").unlink()
    out = _build(debian, path)
    assert out.returncode == 2 and out.stderr.splitlines() == ["error: git is missing: apt-get install git"]
    assert not work.exists()


CALLS_END = "\x1e"


def _sbatch(tmp_path, container=None, nodes=2):
    """scripts/slurm.sbatch as a Slurm job of `nodes` nodes would run it, with srun, scontrol, python3 and the
    container runner `ctr-run` replaced by stubs that record their command lines: [argv, ...] in call order."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    log = tmp_path / "calls"
    # one write a record (cat of a file written first): bash's printf flushes at each newline, so the records of
    # steps started in the background (`ray start`, whose `bash -c` script has newlines) interleaved with others
    record = (
        f't=$(mktemp) && printf \'%s\\0\' "$(basename "$0")" "$@" \'{CALLS_END}\' >"$t" && '
        f'cat "$t" >>{log} && rm "$t"\n'
    )
    # srun answers the host-name step (one name per node) and the head's `test -s ray_current_cluster` check
    _stub(
        stubs,
        "srun",
        record + 'case " $* " in *" hostname -s "*) for i in $(seq $SLURM_NNODES); do echo h$i; done ;; esac\n',
    )
    _stub(stubs, "scontrol", "for i in $(seq $SLURM_NNODES); do echo n$i; done\n")
    _stub(stubs, "python3", record)
    _stub(stubs, "ctr-run", record)
    env = {
        "PATH": f"{stubs}:{os.path.dirname(shutil.which('bash'))}:/usr/bin:/bin",
        "SLURM_JOB_NODELIST": f"n[1-{nodes}]",
        "SLURM_NNODES": str(nodes),
        "SLURM_CPUS_PER_TASK": "16",
        "SLURM_GPUS_PER_NODE": "gpu:8",
        "SLURM_JOB_ID": "77",
        "SLURMD_NODENAME": "n1",
        "RAY_HEAD_IP": "192.0.2.1",  # a documentation address: nothing is contacted, every step is a stub
        "RAY_START_TIMEOUT": "30",
    }
    if container is not None:
        env["STAPO_CONTAINER"] = container
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm.sbatch"), "stapo", "qwen3_1.7b", "data.train_files=/d/t.parquet"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out
    calls = [c.strip("\0").split("\0") for c in log.read_text().split(CALLS_END) if c.strip("\0")]
    return out, calls


def _ray_starts(calls):
    """The `ray start` job steps (each in the background, so logged in any order), by node."""
    starts = [c for c in calls if c[0] == "srun" and any("exec ray start" in a for a in c)]
    return sorted(starts, key=lambda call: call[call.index("-w") + 1])


TRAIN = [
    "python3", "-m", "stapo.train", "--config-name=stapo", "size=qwen3_1.7b", "trainer.nnodes=2",
    "trainer.n_gpus_per_node=8", "data.train_files=/d/t.parquet",
]  # fmt: skip
CHECK = ["python3", "-c", "import sys; from stapo.train.main import check_names; check_names(sys.argv[1:])"]


def test_slurm_sbatch_without_a_container_runs_the_commands_as_before(tmp_path):
    out, calls = _sbatch(tmp_path)
    assert "in a container" not in out.stdout
    # the checks run here, directly; Ray on each node and the training on the head as plain job steps
    assert calls[0] == [*CHECK, "--config-name=stapo", "size=qwen3_1.7b"]
    (wait,) = [c for c in calls if "stapo.train.clusters" in c]
    assert wait[:4] == ["python3", "-m", "stapo.train.clusters", "wait"] and wait[-2:] == ["h1", "h2"]
    starts = _ray_starts(calls)
    assert [c[:7] for c in starts] == [["srun", "--nodes=1", "--ntasks=1", "-w", n, "bash", "-c"] for n in ("n1", "n2")]
    assert "--head" in starts[0] and "--node-ip-address=192.0.2.1" in starts[0]
    assert "--address=192.0.2.1:6379" in starts[1]
    (train,) = [c for c in calls if c[0] == "srun" and "stapo.train" in c]
    assert train == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "-w", "n1", *TRAIN]
    assert not [c for c in calls if c[0] == "ctr-run"]


def test_slurm_sbatch_runs_ray_and_the_recipe_in_a_container_before_each_command(tmp_path):
    """STAPO_CONTAINER as a command (Apptainer's `apptainer exec --nv IMAGE`, Charliecloud's `ch-run IMAGE --`): it
    comes before the checks here, before `bash -c ... ray start` on each node and before the training; the steps
    that only look at the node (host names, the head's started file, stopping Ray) stay outside."""
    container = "ctr-run --bind /data:/data /images/stapo-verl.sif --"
    out, calls = _sbatch(tmp_path, container)
    prefix = container.split()
    assert f"stapo: in a container: {container}" in out.stdout
    runner = [c for c in calls if c[0] == "ctr-run"]
    assert runner[0] == [*prefix, *CHECK, "--config-name=stapo", "size=qwen3_1.7b"]
    assert runner[1][: len(prefix) + 4] == [*prefix, "python3", "-m", "stapo.train.clusters", "wait"]
    assert len(runner) == 2 and not [c for c in calls if c[0] == "python3"]
    starts = _ray_starts(calls)
    assert [c[: 5 + len(prefix) + 2] for c in starts] == [
        ["srun", "--nodes=1", "--ntasks=1", "-w", node, *prefix, "bash", "-c"] for node in ("n1", "n2")
    ]
    (train,) = [c for c in calls if c[0] == "srun" and "stapo.train" in c]
    assert train == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "-w", "n1", *prefix, *TRAIN]
    for call in calls:
        if call[0] == "srun" and ("hostname" in call or "test" in call or any("kill -TERM" in a for a in call)):
            assert "ctr-run" not in call, call


def test_slurm_sbatch_passes_pyxis_options_to_every_step_of_the_recipe(tmp_path):
    """STAPO_CONTAINER as pyxis's srun options: the checks become job steps on this node with them, and so do Ray's
    and the training's steps; the rest stays as it was."""
    options = ["--container-image=/images/stapo-verl.sqsh", "--container-mounts=/tmp:/tmp,/data:/data"]
    out, calls = _sbatch(tmp_path, " ".join(options))
    assert not [c for c in calls if c[0] in ("python3", "ctr-run")]
    on_head = ["srun", "--overlap", "--nodes=1", "--ntasks=1", "-w", "n1", *options]
    assert calls[0] == [*on_head, *CHECK, "--config-name=stapo", "size=qwen3_1.7b"]
    (wait,) = [c for c in calls if "stapo.train.clusters" in c]
    assert wait[: len(on_head) + 4] == [*on_head, "python3", "-m", "stapo.train.clusters", "wait"]
    starts = _ray_starts(calls)
    assert [c[: 5 + len(options) + 2] for c in starts] == [
        ["srun", "--nodes=1", "--ntasks=1", "-w", node, *options, "bash", "-c"] for node in ("n1", "n2")
    ]
    (train,) = [c for c in calls if c[0] == "srun" and "stapo.train" in c]
    assert train == [*on_head, *TRAIN]
    hosts = [c for c in calls if c[0] == "srun" and "hostname" in c]
    assert hosts == [["srun", "--nodes=2", "--ntasks-per-node=1", "hostname", "-s"]]


def test_check_launchers_takes_an_image_folder_only(tmp_path):
    """check_launchers.sh --image DIR runs (d), slurm.sbatch in the image under ch-run; a folder that is not the
    recipe's image stops it in one line before anything is checked or installed."""
    script = str(ROOT / "scripts" / "check_launchers.sh")
    out = subprocess.run(["bash", script, "--image", str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert (
        out.returncode == 2
        and out.stdout == ""
        and out.stderr.splitlines()
        == [f"error: --image {tmp_path} is not the recipe's image as a folder (no /opt/stapo/venv/bin/python in it)"]
    )
    out = subprocess.run(["bash", script, "--yes", "--image"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stderr.startswith("usage: bash scripts/check_launchers.sh [--yes] [--image DIR]")
