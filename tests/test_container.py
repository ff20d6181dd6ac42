"""The recipe's image (docker/Dockerfile, docker/build.sh) and slurm.sbatch's STAPO_CONTAINER: the image's pins follow
setup.py's, build.sh stops in one line, and the command lines slurm.sbatch runs with and without a container (srun,
scontrol and the container runner stubbed on PATH; docs/container.md has the builds and runs themselves)."""

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def _setup_extra(name):
    """extras_require[name] as setup.py writes it, its `*LIST` parts resolved from setup.py's module-level lists."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    lists = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
    }
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = next(k.value for k in call.keywords if k.arg == "extras_require")
    (value,) = [v for k, v in zip(extras.keys, extras.values) if ast.literal_eval(k) == name]
    out = []
    for element in value.elts:
        out += lists[element.value.id] if isinstance(element, ast.Starred) else [ast.literal_eval(element)]
    return out


def _lock(variant):
    """docker/lock/VARIANT.txt: {name: (version, [sha256, ...])}, names normalized as pip does."""
    text = (ROOT / "docker" / "lock" / f"{variant}.txt").read_text()
    pins = {}
    for entry in re.split(r"\n(?=[A-Za-z0-9])", text):
        found = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", entry)
        if found:
            name = re.sub(r"[-_.]+", "-", found[1]).lower()
            assert name not in pins, f"{name} pinned twice in docker/lock/{variant}.txt"
            pins[name] = (found[2], re.findall(r"--hash=sha256:([0-9a-f]{64})\b", entry))
    return text, pins


def _in_lock(requirement, pins, variant):
    """The lock's pin of `requirement` (a PEP 508 string), failing with the fix when it is missing or out of step."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    environment = {**default_environment(), "python_version": "3.11", "python_full_version": "3.11.2",
                   "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}  # fmt: skip
    if req.marker and not any(req.marker.evaluate({**environment, "extra": e}) for e in ("", "verl-core", "math")):
        return None
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    assert name in pins, f"{requirement} is not in docker/lock/{variant}.txt: bash docker/lock.sh {variant}"
    version = pins[name][0]
    assert req.specifier.contains(version, prereleases=True), (
        f"docker/lock/{variant}.txt pins {name}=={version}, outside {requirement}: bash docker/lock.sh {variant}"
    )
    return version


def test_cpu_lock_follows_setup_py_and_every_file_has_its_hash():
    """docker/lock/cpu.txt (pip-compile --generate-hashes, docker/lock.sh) is what the CPU image installs with
    --require-hashes: it must pin every requirement setup.py and .ci/run name (and verl's own for its verl-core and
    math extras) within their ranges, each with the sha256 of its files."""
    text, pins = _lock("cpu")
    assert "bash docker/lock.sh cpu" in text.split("\n\n")[0]  # its header names the command that writes it
    install_requires, _, _ = _setup_requirements()
    ci_torch = re.search(r"torch==\S+", (ROOT / ".ci" / "run").read_text()).group(0)
    lock_in = [line for line in (ROOT / "docker" / "lock" / "cpu.in").read_text().splitlines() if line[:1] != "#"]
    assert lock_in == [ci_torch, "setuptools", "wheel"]
    for requirement in [*install_requires, *_setup_extra("test"), *lock_in]:
        _in_lock(requirement, pins, "cpu")
    assert pins["torch"][0] == ci_torch.split("==")[1] + "+cpu"  # the CPU build, not PyPI's CUDA one
    # one level down: what verl 0.9.1 itself requires for the extras setup.py asks of it
    assert pins["verl"][0] == "0.9.1"
    for requirement in importlib.metadata.requires("verl"):
        if 'extra == "' not in requirement or re.search(r'extra == "(verl-core|math)"', requirement):
            _in_lock(requirement, pins, "cpu")
    assert len(pins) > 100 and all(hashes for _, hashes in pins.values()), [n for n, (_, h) in pins.items() if not h]
    assert "flash-attn" not in pins


def test_gpu_lock_is_verls_pins_without_flash_attn():
    text, pins = _lock("gpu")
    assert "bash docker/lock.sh gpu" in text.split("\n\n")[0]
    install_requires, _, _ = _setup_requirements()
    lock_in = [line for line in (ROOT / "docker" / "lock" / "gpu.in").read_text().splitlines() if line[:1] != "#"]
    assert lock_in[0] == "verl==0.9.1" and lock_in[-2:] == ["setuptools", "wheel"]
    # the rest is verl's own list for the extras REQUIRED_VERL.txt names, nested extras expanded, flash-attn left out
    by_extra = {}
    for requirement in importlib.metadata.requires("verl"):
        found = re.fullmatch(r'(.+?)\s*;\s*extra == "(.+)"', requirement)
        if found:
            by_extra.setdefault(found[2], []).append(found[1])

    def expand(extra):
        for requirement in by_extra[extra]:
            nested = re.fullmatch(r"verl\[(.+)\]", requirement)
            yield from (r for e in nested[1].split(",") for r in expand(e)) if nested else [requirement]

    verls = {r for e in ("vllm", "fsdp", "math") for r in expand(e)}
    assert sorted(r for r in verls if not r.startswith("flash-attn")) == lock_in[1:-2] and "flash-attn" in str(verls)
    for requirement in [*install_requires, *lock_in]:
        _in_lock(requirement, pins, "gpu")
    assert "flash-attn" not in pins and all(hashes for _, hashes in pins.values())


def test_lock_sh_explains_itself_and_stops_in_one_line(tmp_path):
    """docker/lock.sh: --help, and one line for a missing or unknown variant, a Python other than bookworm's and a
    missing pip-compile, before anything is written (the locks stay as committed)."""
    script = str(ROOT / "docker" / "lock.sh")
    locks = {p.name: p.read_bytes() for p in (ROOT / "docker" / "lock").iterdir()}
    _stub(tmp_path, "python3", 'echo "${PY:-3.11}"\n')
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path), "STAPO_PIP_COMPILE": str(tmp_path / "none")}

    def lock(*args, **extra):
        return subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=30, env={**env, **extra})

    out = lock("--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: bash docker/lock.sh cpu|gpu") and out.stderr == ""
    for args, extra, line in [
        ((), {}, "error: name a variant: bash docker/lock.sh cpu|gpu (--help says more)"),
        (("tpu",), {}, "error: unknown variant 'tpu': bash docker/lock.sh cpu|gpu (--help says more)"),
        (("cpu",), {"PY": "3.12"}, "error: the lock is for Debian bookworm's Python 3.11, python3 is 3.12: "
         "set PYTHON=python3.11"),
        (("cpu",), {}, "error: pip-compile is missing: python3 -m pip install pip-tools (or set STAPO_PIP_COMPILE)"),
    ]:  # fmt: skip
        out = lock(*args, **extra)
        assert out.returncode == 2 and out.stderr.splitlines() == [line] and out.stdout == "", (args, out)
    assert {p.name: p.read_bytes() for p in (ROOT / "docker" / "lock").iterdir()} == locks


def test_dockerfile_installs_the_lock_before_the_source_and_labels_the_commit():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    lines = [line for line in dockerfile.splitlines() if line and line[0] != "#"]
    steps = [line.split()[0] for line in lines if re.match(r"[A-Z]+ ", line)]
    copy_lock = lines.index("COPY docker/lock/ wheel[s] /opt/deps/")
    copy_source = lines.index("COPY . .")
    install = next(i for i, line in enumerate(lines) if "--require-hashes" in line)
    assert copy_lock < install < copy_source  # a change to the source leaves the dependencies' layer as it was
    assert '-r "/opt/deps/$LOCK.txt"' in lines[install + 1] and "--no-index" in lines[install]
    final = lines[max(i for i, line in enumerate(lines) if line.startswith("FROM ")) :]
    labels = dict(re.findall(r'(org\.opencontainers\.image\.\w+(?:\.\w+)?)="\$(\w+)"', "\n".join(final)))
    assert labels == {
        "org.opencontainers.image.source": "SOURCE",
        "org.opencontainers.image.revision": "REVISION",
        "org.opencontainers.image.version": "VERSION",
        "org.opencontainers.image.created": "CREATED",
        "org.opencontainers.image.base.name": "BASE",
    }
    assert "ENV STAPO_COMMIT=$REVISION" in final and steps[-1] == "CMD" and lines[-1] == 'CMD ["bash"]'
    for arg in ("REVISION", "VERSION", "SOURCE", "CREATED"):
        assert f'"{arg}=' in BUILD.read_text(), arg  # build.sh passes each


def test_dockerfile_pins_follow_setup_py():
    install_requires, gpu, extras = _setup_requirements()
    (core,) = install_requires
    version = core.split("==")[1]
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    # the image's own check asserts setup.py's verl version
    assert re.search(r"assert v == '([^']+)'", dockerfile).group(1) == version
    # without a lock (verl's image) it installs setup.py's install_requires and its gpu extra, then the recipe
    (line,) = [line for line in dockerfile.splitlines() if "venv/bin/python -m pip install" in line and "verl[" in line]
    assert re.findall(r'"(verl\[[^"]+)"', line) == [*install_requires, *gpu]
    assert '-e ".[gpu]"' in dockerfile and "test" in extras
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
    assert "--base debian" in out.stdout and "mmdebstrap" in out.stdout and "--debian-snapshot" in out.stdout
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for args, line in [
        (["--bogus"], "error: unknown argument '--bogus' (bash docker/build.sh --help lists the options)"),
        (["--tool"], "error: --tool needs a value (bash docker/build.sh --help)"),
        (["--variant", "cpu"], "error: --variant cpu needs --base debian (verl's image is the GPU one)"),
        (["--base", "alpine"], "error: --base alpine --variant gpu: use --base verl|debian and --variant cpu|gpu"),
        (["--tool", "lxc"], "error: --tool lxc: use docker, podman or buildah"),
        (["--work", str(a_file)], f"error: --work {a_file} is not a folder: name a folder (or a path to make one at)"),
        (["--debian-snapshot", "2026-01-01"],
         "error: --debian-snapshot 2026-01-01: use snapshot.debian.org's form, e.g. 20260101T000000Z"),
        (["--debian-snapshot", "20260101T000000Z", "--debian-mirror", "http://m/debian"],
         "error: --debian-mirror and --debian-snapshot: give one of them"),
    ]:  # fmt: skip
        out = _build(args, path)
        assert out.returncode == 2 and out.stderr.splitlines() == [line] and out.stdout == "", (args, out)


def _buildah_stub(tmp_path, run_fails_with):
    """A PATH whose buildah records each call (with BUILDAH_ISOLATION) and whose `buildah run` fails the way crun
    does on this project's machine unless the isolation is chroot; git answers as a clean checkout."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    log = tmp_path / "buildah.calls"
    _stub(
        stubs,
        "buildah",
        f'echo "BUILDAH_ISOLATION=${{BUILDAH_ISOLATION:-}} $*" >>{log}\n'
        "case $1 in from) echo ctr-1 ;; inspect) exit 0 ;;\n"
        f'  run) [ "${{BUILDAH_ISOLATION:-}}" = chroot ] || {{ echo "{run_fails_with}" >&2; exit 1; }} ;; esac\n',
    )
    _stub(stubs, "git", 'case "$*" in *"rev-parse HEAD"*) echo 0123abc ;; *"config --get"*) exit 1 ;; esac\n')
    return f"{stubs}:/usr/bin:/bin", log


CRUN = (
    "error running container: from /usr/bin/crun creating container for [/usr/bin/true]: cgroups in hybrid mode not "
    "supported, drop all controllers from cgroupv2"
)


def test_build_sh_chooses_chroot_isolation_when_no_oci_runtime_starts(tmp_path):
    """The issue's first finding: the documented command stopped at the first RUN step with crun's message. Now a
    RUN of `true` in the base finds it first, and the build runs with BUILDAH_ISOLATION=chroot, said in one line."""
    path, log = _buildah_stub(tmp_path, CRUN)
    out = _build(["--tool", "buildah", "--verl-image", "verlai/verl@sha256:" + "0" * 64], path)
    assert out.returncode == 0, out
    said = [line.rsplit(" (", 1)[0] for line in out.stdout.splitlines()]
    assert said == [
        f"stapo: no OCI runtime can start a RUN step here ({CRUN}); building with BUILDAH_ISOLATION=chroot",
        "stapo: revision 0123abc",
    ]
    calls = log.read_text().splitlines()
    assert calls[:2] == ["BUILDAH_ISOLATION= inspect --type image verlai/verl@sha256:" + "0" * 64,
                         "BUILDAH_ISOLATION= from --pull=never verlai/verl@sha256:" + "0" * 64]  # fmt: skip
    (build,) = [c for c in calls if " build " in c]
    assert build.startswith(f"BUILDAH_ISOLATION=chroot build --layers -f {ROOT}/docker/Dockerfile --build-arg BASE=")
    assert "--build-arg REVISION=0123abc " in build and "--build-arg VERSION=0.1.0 " in build
    # set by the user: no check, and the build has it as given
    log.unlink()
    out = _build(["--tool", "buildah"], path, BUILDAH_ISOLATION="oci")
    calls = log.read_text().splitlines()
    assert not [c for c in calls if " run " in c] and calls[-1].startswith("BUILDAH_ISOLATION=oci build --layers")
    # the moving tag is named, with the fix
    assert out.stdout.splitlines()[0].startswith(
        "stapo: verlai/verl:vllm024.latest is a moving tag: for an image a reproduction can name, pin it by digest"
    )
    # neither isolation starts: one line with the runtime's words
    (tmp_path / "x").mkdir()
    path, log = _buildah_stub(tmp_path / "x", "")
    fails = 'case $1 in from) echo c ;; run) echo "Error: no luck" >&2; exit 1 ;; esac\n'
    _stub(Path(path.split(":")[0]), "buildah", fails)
    out = _build(["--tool", "buildah", "--verl-image", "v@sha256:1"], path)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "error: no RUN step starts in v@sha256:1 here, with the default isolation (Error: no luck) nor with "
        "BUILDAH_ISOLATION=chroot"
    ], out


def _version(tmp_path):
    """A copy of the package in tmp_path/checkout, and a runner of its `python -m stapo.tools.version` there."""
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "stapo", checkout / "stapo", ignore=shutil.ignore_patterns("__pycache__"))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(checkout), "GIT_CONFIG_NOSYSTEM": "1"}

    def version(*args, code=0, **extra):
        out = subprocess.run(
            [sys.executable, "-m", "stapo.tools.version", *args],
            capture_output=True, text=True, timeout=60, env={**env, **extra}, cwd=tmp_path,
        )  # fmt: skip
        assert out.returncode == code and (out.stderr == "") == (code == 0), out
        return out.stdout if code == 0 else out.stderr

    return checkout, env, version


def test_version_prints_the_images_commit_or_unknown(tmp_path):
    """python -m stapo.tools.version: STAPO_COMMIT (the image's), else, outside a git checkout, unknown; a wrong
    argument gets one line. (No git needed: the image has none.)"""
    _, _, version = _version(tmp_path)
    assert version() == "stapo-verl 0.1.0 commit unknown\n"
    assert version(STAPO_COMMIT="feedface") == version("--version", STAPO_COMMIT="feedface")
    assert version(STAPO_COMMIT="feedface") == "stapo-verl 0.1.0 commit feedface\n"
    assert version("--verison", code=2).splitlines() == [
        "error: unknown arguments '--verison': python -m stapo.tools.version takes none"
    ]


@pytest.mark.skipif(shutil.which("git") is None, reason="no git here (the recipe's image has none)")
def test_version_names_the_checkouts_commit(tmp_path):
    """Without STAPO_COMMIT, the HEAD of the checkout the package is in (-dirty with changes): a real git
    repository holding a copy of the package."""
    checkout, env, version = _version(tmp_path)
    shutil.copy(ROOT / ".gitignore", checkout)  # as in the repository: __pycache__ is not a change
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True, env=env)
    subprocess.run([*git, "add", "."], check=True, env=env)
    subprocess.run([*git, "commit", "-qm", "c"], check=True, env=env)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert version() == f"stapo-verl 0.1.0 commit {head}\n"
    (checkout / "stapo" / "s2t.py").write_text("# changed\n")
    assert version() == f"stapo-verl 0.1.0 commit {head}-dirty\n"
    assert version(STAPO_COMMIT="feedface") == "stapo-verl 0.1.0 commit feedface\n"


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
