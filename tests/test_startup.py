"""The start-up timer (stapo/checks/startup.py): phases of a constructed log, a stand-in launch killed after its first
step (a real training launch needs a GPU), the markers against the installed verl and TransferQueue sources, and
import timing with and without bytecode."""

import json
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest
import standins

from stapo.checks import startup

FIXTURE = Path(__file__).parent / "fixtures" / "startup_train.log"


def marker(result: dict, phase: str) -> dict:
    return next(m for m in result["markers"] if m["phase"] == phase)


def test_phases_of_a_constructed_log():
    result = startup.phases(startup.read_log(FIXTURE))
    assert marker(result, "driver: ray.init") == {**marker(result, "driver: ray.init"), "at_s": 21.4, "phase_s": 21.4}
    assert marker(result, "TaskRunner: first line")["phase_s"] == 31.1
    assert marker(result, "TransferQueue ready")["at_s"] == 60.25
    assert marker(result, "vLLM engine core: first line")["at_s"] == 190.5
    assert marker(result, "vLLM worker: first line")["phase_s"] == 19.5
    vllm = ["vLLM: model loaded", "vLLM: KV cache sized", "vLLM: CUDA graphs captured", "vLLM: engine ready"]
    assert [(marker(result, m)["at_s"], marker(result, m)["phase_s"]) for m in vllm] == [
        (214.0, 4.0), (226.0, 12.0), (236.0, 10.0), (240.0, 4.0)
    ]  # fmt: skip
    missing = marker(result, "validation before training done")
    assert missing["at_s"] is None and missing["phase_s"] is None
    assert marker(result, "first step begins")["phase_s"] == 6.0  # since "ready to fit": the missing one is skipped
    assert marker(result, "first step ends")["at_s"] == 300.0
    kinds = {p["kind"]: p for p in result["processes"]}
    assert list(kinds)[:3] == ["driver", "TaskRunnerV1", "SimpleStorageUnit"]
    assert kinds["SimpleStorageUnit"]["pids"] == 2 and kinds["driver"]["pids"] is None
    assert (kinds["EngineCore"]["first_s"], kinds["EngineCore"]["last_s"]) == (190.5, 240.0)
    assert kinds["Worker"]["lines"] == 4 and "vLLMHttpServer" in kinds
    shown = startup.table(result)
    assert "| validation before training done | - | - |" in shown and "| EngineCore | 1 | 190.5 | 240.0 | 2 |" in shown


def test_the_markers_are_the_installed_sources_lines():
    """Each marker's text is printed by the installed verl 0.9.1 / TransferQueue (a renamed line fails here)."""
    import transfer_queue
    import verl
    from verl.utils.logger.aggregate_logger import concat_dict_to_str

    from stapo.train.trainer import FIRST_STEP_LINE

    verl_root, tq_root = Path(verl.__file__).parent, Path(transfer_queue.__file__).parent
    base = (verl_root / "trainer/ppo/v1/trainer_base.py").read_text()
    for text in ("create worker group", "actor and ref model engine initialized", "reward loop manager initialized"):
        assert text in base
    assert "checkpoint engine manager initialized" in base and "all initialize finished, ready to fit" in base
    assert 'print(f"ray init kwargs:' in (verl_root / "trainer/main_ppo.py").read_text()
    assert 'print(f"LLMServerManager: {' in (verl_root / "workers/rollout/llm_server.py").read_text()
    assert 'logger.info(f"TransferQueue config:' in (tq_root / "interface.py").read_text()
    patterns = dict(startup.MARKERS)
    assert re.search(patterns["first step begins"], FIRST_STEP_LINE.format(step=1))
    assert re.search(startup.FIRST_STEP_END, "(TaskRunnerV1 pid=7) " + concat_dict_to_str({"a": 1.0}, step=1))
    assert not re.search(startup.FIRST_STEP_END, concat_dict_to_str({"val-core/x": 1.0}, step=0))


STAND_IN = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
    print("ray init kwargs: {}")
    levels = [os.environ.get(name) for name in ("VERL_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL", "PYTHONUNBUFFERED")]
    print("levels", *levels, file=sys.stderr)
    time.sleep(0.4)
    print("(TaskRunnerV1 pid=11) INFO:create worker group dict_keys(['actor_rollout'])")
    time.sleep(0.4)
    print("(vLLMHttpServer pid=12) (EngineCore pid=13) INFO engine up")
    print("(TaskRunnerV1 pid=11) STAPO: step 1 begins")
    print(sys.argv[2])
    time.sleep(600)
    """
)


def alive(pid: int, wait_s: float = 5.0) -> bool:
    """Whether ``pid`` still runs ``wait_s`` later (a killed process takes a moment to go)."""
    deadline = time.monotonic() + wait_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _running(pid)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def launch_stand_in(tmp_path, last_line: str, timeout: float, until: str = "ends") -> tuple[dict, list[int], float]:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    pids = tmp_path / "pids"
    start = time.monotonic()
    command = [sys.executable, str(script), str(pids), last_line]
    result = startup.launch(command, tmp_path / "out", timeout, until)
    return result, [int(p) for p in pids.read_text().split()], time.monotonic() - start


def test_run_stops_the_command_after_its_first_step(tmp_path):
    """A stand-in for `bash scripts/train.sh` (the real one needs a GPU): verl-like lines, the first step's metrics
    line, then it and a child of it sleep for ten minutes. The tool kills both and reports the phases."""
    result, pids, seconds = launch_stand_in(tmp_path, "(TaskRunnerV1 pid=11) step:1 - actor/entropy:0.5", 120)
    assert seconds < 60 and result["stopped"] == "the first step ended"
    assert not any(alive(pid) for pid in pids)
    assert 0.7 < marker(result, "first step ends")["at_s"] < 30
    assert marker(result, "vLLM engine core: first line")["at_s"] >= marker(result, "worker group created")["at_s"]
    assert marker(result, "actor engine initialized")["at_s"] is None
    log = (tmp_path / "out" / "train.log").read_text()
    assert re.search(r"^ +\d+\.\d\d \| levels INFO INFO 1$", log, re.M)  # stderr merged, the environment added
    assert json.loads((tmp_path / "out" / "phases.json").read_text())["markers"] == result["markers"]


def test_run_stops_when_the_first_step_begins_by_default(tmp_path):
    """``--until begins`` (the default): start-up ends at the trainer's 'STAPO: step 1 begins'; the step itself, minutes
    at a real shape, is not waited for."""
    result, pids, _ = launch_stand_in(tmp_path, "(TaskRunnerV1 pid=11) STAPO: step 1 begins", 120, until="begins")
    assert result["stopped"] == "the first step began" and not any(alive(pid) for pid in pids)
    assert marker(result, "first step begins")["at_s"] > 0.7 and marker(result, "first step ends")["at_s"] is None


def test_run_stops_at_the_timeout(tmp_path):
    result, pids, seconds = launch_stand_in(tmp_path, "no metrics line", 2)
    assert result["stopped"] == "timeout after 2 s" and seconds < 30
    assert not any(alive(pid) for pid in pids)
    assert marker(result, "first step begins")["at_s"] is not None and marker(result, "first step ends")["at_s"] is None


def test_run_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "old.log").write_text("x")
    with pytest.raises(SystemExit) as stop:
        startup.main(["run", "--out", str(tmp_path), "--", "true"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert stop.value.code == 2 and len(errors) == 1 and "not empty" in errors[0]


def test_parse_importtime():
    stderr = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:    100000 |     100000 |   encodings.aliases",
            "import time:   2000000 |    2500000 |     numpy.core",
            "import time:    500000 |    3000000 |   numpy",
            "import time:   1000000 |    1000000 | _io",
            "ModuleNotFoundError: No module named 'vllm'",
        ]
    )
    parsed = startup.parse_importtime(stderr)
    assert parsed["top"][0] == ["numpy", 2.5] and parsed["import_s"] == 3.6
    assert parsed["stdlib_s"] == 1.1 and parsed["last_other_line"].startswith("ModuleNotFoundError")


def test_imports_cold_compiles_and_warm_reads_bytecode(tmp_path, monkeypatch):
    """A module of 4,000 functions imports several times faster with its bytecode; a missing module is recorded
    with its error line, not raised."""
    (tmp_path / "stapo_bigmod.py").write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(4000)))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    result = startup.time_imports({"big": ("stapo_bigmod",), "json": ("json",), "missing": ("stapo_no_such_mod",)})
    big = result["kinds"]["big"]
    top = dict(big["cold"]["top"])
    assert big["cold"]["error"] is None and top["stapo_bigmod"] > 3 * dict(big["warm"]["top"])["stapo_bigmod"]
    assert "json" in dict(result["kinds"]["json"]["cold"]["top"])
    missing = result["kinds"]["missing"]["warm"]
    assert "ModuleNotFoundError" in missing["error"] and "stapo_no_such_mod" in missing["error"]
    shown = startup.imports_table(result)
    assert "| missing |" in shown and "error: ModuleNotFoundError" in shown


def test_imports_command_writes_json(tmp_path, capsys):
    out = tmp_path / "imports.json"
    startup.main(["imports", "--out", str(out), "--module", "json=json"])
    assert list(json.loads(out.read_text())["kinds"]) == ["json"]
    assert "| json |" in capsys.readouterr().out


def _run_gpu_script(tmp_path, *args):
    """scripts/gpu/startup.sh with a stand-in for the Python that would train (it needs a GPU) and answer where the
    run's packages are (an ``elsewhere`` folder). Each other call is written to ``calls`` as ``cuts=C B ARGS``, B
    saying whether ``site/pkg`` had bytecode when a launch began (``yes``/``no``; ``-`` for the set-up calls); a launch
    then writes bytecode there, as its imports would, and makes its --out folder. compileall runs for real."""
    import subprocess

    calls, standin, cache = tmp_path / "calls", tmp_path / "python", tmp_path / "site" / "pkg" / "__pycache__"
    standin.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *package_folders*) echo {tmp_path / "elsewhere"} ;;\n'
        f'  *compileall*) exec {sys.executable} "$@" ;;\n'
        f"  *stapo.checks.startup*) b=no; ls {cache}/*.pyc >/dev/null 2>&1 && b=yes\n"
        f'    printf "cuts=%s %s %s\\n" "$STAPO_STARTUP_CUTS" $b "$*" >> {calls}\n'
        f"    mkdir -p {cache} && touch {cache}/imported.pyc\n"
        '    for a; do [ "$o" = --out ] && mkdir -p "$a"; o=$a; done ;;\n'  # what `startup run` makes
        f'  *) printf "cuts=%s - %s\\n" "$STAPO_STARTUP_CUTS" "$*" >> {calls} ;; esac\n'
    )
    standin.chmod(0o755)
    (tmp_path / "tok").mkdir(exist_ok=True)
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    for folder in ("site", "elsewhere"):
        (tmp_path / folder / "pkg").mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "pkg" / "mod.py").write_text("X = 1\n")
    script = Path(__file__).parents[1] / "scripts" / "gpu" / "startup.sh"
    done = subprocess.run(
        ["bash", str(script), str(tmp_path / "out"), str(tmp_path / "tok"), *args],
        env={"PATH": standins.gpu_path(tmp_path), "STAPO_PYTHON": str(standin)},
        capture_output=True,
        text=True,
    )
    return done, calls.read_text().splitlines() if calls.exists() else []


EIGHT_UNITS = "transfer_queue.backend.SimpleStorage.num_data_storage_units=8"


def _runs(lines):
    """The launches' calls, split into words."""
    import shlex

    return [shlex.split(line) for line in lines if " stapo.checks.startup " in line]


def _launches(lines):
    """(cuts, bytecode at the start, --out folder's name, the storage-unit override or None) of each launch."""
    return [
        (run[0], run[1], Path(run[run.index("--out") + 1]).name, EIGHT_UNITS if run[-1] == EIGHT_UNITS else None)
        for run in _runs(lines)
    ]


def test_the_gpu_script_runs_the_launches_in_order_with_the_cuts_off_and_on(tmp_path):
    """The model and task once, then each launch of the list through `startup run`, in its own KIND-N folder, with
    STAPO_STARTUP_CUTS none and verl's 8 storage units for off and warm-off, all for warm and on; the training
    overrides compose with the real config and pass the trainer's checks; --cold removes bytecode before each
    launch."""
    from hydra import compose, initialize_config_dir

    from stapo.config import CONFIG_DIR
    from stapo.train.main import validate

    done, lines = _run_gpu_script(tmp_path, "warm,warm-off,off,on,on,off", "--cold", str(tmp_path / "site"))
    assert done.returncode == 0, done.stderr
    assert [line.split()[3] for line in lines] == [
        "stapo.checks.scale",
        "stapo.quickstart.task",
        *["stapo.checks.startup"] * 6,
    ]
    eight = EIGHT_UNITS
    assert _launches(lines) == [
        ("cuts=all", "no", "warm-1", None),
        ("cuts=none", "no", "warm-off-1", eight),
        ("cuts=none", "no", "off-1", eight),
        ("cuts=all", "no", "on-1", None),
        ("cuts=all", "no", "on-2", None),
        ("cuts=none", "no", "off-2", eight),
    ]
    for run in _runs(lines):
        command = run[run.index("--") + 1 :]
        assert command[:4] == ["bash", "scripts/train.sh", "stapo", "qwen3_1.7b"]
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            config = compose("stapo", overrides=["size=qwen3_1.7b", *command[4:]])
        validate(config, environment=False)
        assert config.trainer.n_gpus_per_node == 1 and config.trainer.val_before_train is False


def test_the_gpu_script_compiles_the_bytecode_before_the_first_launch_with_compiled(tmp_path):
    """--compiled SITE with the default list: the bytecode of SITE and of the run's packages elsewhere exists when the
    first launch begins, as after pip's default install; a second call numbers its launches after the first's."""
    done, lines = _run_gpu_script(tmp_path, "--compiled", str(tmp_path / "site"))
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "elsewhere" / "pkg" / "__pycache__").glob("mod.*.pyc"))
    assert [(b, name) for _, b, name, _ in _launches(lines)] == [
        ("yes", "warm-1"), ("yes", "warm-off-1"), ("yes", "off-1"), ("yes", "on-1"), ("yes", "on-2"), ("yes", "off-2")
    ]  # fmt: skip
    (tmp_path / "calls").unlink()
    done, lines = _run_gpu_script(tmp_path, "on,warm", "--compiled", str(tmp_path / "site"))
    assert done.returncode == 0, done.stderr
    assert [name for *_, name, _ in _launches(lines)] == ["on-3", "warm-2"]


@pytest.mark.parametrize(
    "args, error",
    [
        (["fast"], "a comma list of warm, warm-off, off and on, or imports alone"),
        (["on,imports"], "a comma list of warm, warm-off, off and on, or imports alone"),
        (["on", "--hot", "x"], "give --cold SITE or --compiled SITE, a folder"),
        (["on", "--compiled", "/nonexistent"], "give --cold SITE or --compiled SITE, a folder"),
    ],
)
def test_the_gpu_script_refuses_what_it_cannot_run(tmp_path, args, error):
    done, lines = _run_gpu_script(tmp_path, *args)
    assert done.returncode == 2 and error in done.stderr and lines == []
