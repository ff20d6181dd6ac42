"""Quickstart on the CPU: the synthetic task, the warm-up, the mask demonstration and scripts/quickstart.sh.

The silenced tokens are checked against an independent computation: a plain full forward pass of the model, GRPO
advantages by hand, then stapo.s2t.s2t_mask on the padded batch.
"""

import copy
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import standins
import torch
from hydra import compose, initialize_config_dir
from verl.utils.tracking import FileLogger

from stapo.config import CONFIG_DIR
from stapo.quickstart import run as qs
from stapo.quickstart import task
from stapo.tools.curves import read_metrics
from stapo.tools.data import SCHEMA, make_prompt
from stapo.tools.reward import compute_score
from stapo.train.main import validate

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "quickstart.sh"
TINY = ["--train", "32", "--val", "4", "--hidden-size", "64", "--layers", "1", "--warmup-steps", "3"]


def test_task_is_deterministic_disjoint_and_correct():
    splits = task.generate(seed=3, n_train=50, n_val=10)
    assert splits == task.generate(seed=3, n_train=50, n_val=10) != task.generate(seed=4, n_train=50, n_val=10)
    assert (len(splits["train"]), len(splits["validation"])) == (50, 10)
    assert not {p.question for p in splits["train"]} & {p.question for p in splits["validation"]}
    for problem in splits["train"] + splits["validation"]:
        a, b, c = map(int, re.findall(r"\d+", problem.question))
        assert problem.answer == a + b * c
        assert compute_score(task.DATA_SOURCE, problem.solution, str(problem.answer))["score"] == 1.0
        assert compute_score(task.DATA_SOURCE, problem.solution, str(problem.answer + 1))["score"] == 0.0
    with pytest.raises(ValueError, match="fewer than"):
        task.generate(n_train=700, n_val=100)


@pytest.mark.parametrize("difficulty", sorted(task.WORD_LEVELS))
def test_word_problems_are_right_distinct_and_as_hard_as_asked(difficulty):
    """Every worked solution's sums are right and end in the boxed answer; the splits are disjoint; the level sets
    the number of steps (sentences between the first and the question) and a multiplication from level 4."""
    splits = task.generate_word(seed=1, n_train=300, n_val=50, difficulty=difficulty)
    assert splits == task.generate_word(seed=1, n_train=300, n_val=50, difficulty=difficulty)
    assert not {p.question for p in splits["train"]} & {p.question for p in splits["validation"]}
    for problem in splits["train"][:100]:
        for a, op, b, c in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", problem.solution):
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c) >= 0
        assert problem.solution.count("=") == {1: 1, 2: 1, 3: 2, 4: 2, 5: 3}[difficulty]
        assert ("*" in problem.solution) == (difficulty >= 4)
        assert compute_score(task.WORD_DATA_SOURCE, problem.solution, str(problem.answer))["score"] == 1.0
    with pytest.raises(ValueError, match="difficulty must be one of"):
        task.word_problem(random.Random(0), 6)


def test_the_task_command_writes_both_splits(tmp_path, capsys):
    task.main(["word", "--difficulty", "3", "--out", str(tmp_path / "w"), "--train", "20", "--val", "5"])
    rows = pq.read_table(tmp_path / "w" / "train.parquet").to_pylist()
    assert len(rows) == 20 and {r["data_source"] for r in rows} == {task.WORD_DATA_SOURCE}
    assert "validation.parquet: 5 problems" in capsys.readouterr().out
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        task.main(["word", "--out", str(tmp_path / "file")])
    assert "a file is in the way" in capsys.readouterr().err


def test_parquet_matches_the_data_schema(tmp_path):
    splits = task.generate(seed=0, n_train=20, n_val=5)
    paths = task.write_task(splits, tmp_path, seed=0)
    for split, problems in splits.items():
        table = pq.read_table(paths[split])
        assert table.schema.equals(SCHEMA)
        rows = table.to_pylist()
        assert [r["prompt"] for r in rows] == [make_prompt(p.question) for p in problems]
        assert [r["reward_model"]["ground_truth"] for r in rows] == [str(p.answer) for p in problems]
        assert [r["extra_info"]["index"] for r in rows] == list(range(len(problems)))
        assert {r["extra_info"]["split"] for r in rows} == {split}
        assert {r["data_source"] for r in rows} == {task.DATA_SOURCE}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random model of the quickstart, its tokenizer and the task's splits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    splits, _, folder = qs.build(tmp_path_factory.mktemp("quickstart"), 0, 64, 8, hidden_size=64, num_layers=1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(folder), splits


def warmed(tiny):
    """A copy of the tiny model after 12 warm-up steps (the fixture's model stays random for every test)."""
    model, tokenizer, splits = tiny
    model = copy.deepcopy(model)
    return model, qs.warmup(model, tokenizer, splits["train"], steps=12, batch_size=8, lr=3e-3)


def test_warmup_reduces_the_loss(tiny):
    _, losses = warmed(tiny)
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3


def reference(model, tokenizer, problems, responses, scores):
    """Padded log p, entropy, GRPO advantage and mask of every response token, from a plain full forward pass."""
    rows = []
    for problem, group, group_scores in zip(problems, responses, scores):
        prompt = tokenizer(qs.render_prompt(tokenizer, problem), add_special_tokens=False)["input_ids"]
        rewards = torch.tensor(group_scores)
        for response, score in zip(group, group_scores):
            ids = tokenizer(response, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, -1)
            advantage = (score - rewards.mean()) / (rewards.std() + 1e-6)
            rows.append((logp.gather(-1, torch.tensor(ids, dtype=torch.long)[:, None])[:, 0], logp, advantage))
    shape = (len(rows), max(len(row[0]) for row in rows))
    log_probs, entropy, advantages, mask = (torch.zeros(shape) for _ in range(4))
    for i, (lp, logp, adv) in enumerate(rows):
        n = len(lp)
        log_probs[i, :n], entropy[i, :n], advantages[i], mask[i, :n] = lp, -(logp.exp() * logp).sum(-1), adv, 1
    return log_probs, entropy, advantages, mask


def test_mask_demo_lists_exactly_the_silenced_tokens(tiny, tmp_path, capsys):
    from stapo.s2t import s2t_mask

    _, tokenizer, splits = tiny
    model, _ = warmed(tiny)
    model.eval()
    problems = splits["validation"][:3]
    responses = qs.sample(model, tokenizer, problems, n=4)
    scores = [[1.0, 0.0, 1.0, 0.0]] * len(problems)  # a random model solves nothing: mixed scores by hand
    args = qs.build_parser().parse_args(["cpu", "--samples", "4", "--tau-p", "0.02", "--out", str(tmp_path)])
    qs.run_cpu(args, model, tokenizer, problems, responses, scores)
    printed = capsys.readouterr().out
    listed = [json.loads(line) for line in (tmp_path / "s2t_tokens.jsonl").read_text().splitlines()]

    log_probs, entropy, advantages, mask = reference(model, tokenizer, problems, responses, scores)
    keep, stats = s2t_mask(log_probs, entropy, advantages, mask, tau_p=0.02, q=0.75)
    expected = {(f"problem {r // 4} sample {r % 4}", p) for r, p in ((mask > 0) & (keep == 0)).nonzero().tolist()}
    found = {(token["rollout"], token["position"]) for token in listed}
    shown = re.findall(r"^\[\d+\] (problem \d+ sample \d+)  response token (\d+)", printed, re.M)
    assert [(name, int(p)) for name, p in shown] == [(t["rollout"], t["position"]) for t in listed[: qs.SHOWN]]
    # The two computations differ in float rounding (chunked vs whole-sequence projection, two entropy formulas):
    # a token may fall on either side of a threshold only if it sits on it.
    tau_h = stats["entropy_threshold"]
    for name, position in found ^ expected:
        problem, sample = map(int, re.findall(r"\d+", name))
        row = 4 * problem + sample
        near_h = abs(float(entropy[row, position]) - tau_h) < 1e-4
        near_p = abs(float(log_probs[row, position]) - math.log(0.02)) < 1e-4
        assert near_h or near_p, (name, position, "differs from the reference away from the thresholds")
    assert stats["masked"] > 0 and len(found ^ expected) <= 2 < len(expected)
    candidates = int(re.search(r"candidates \(both\) +(\d+)", printed)[1])
    silenced = int(re.search(r"silenced: H < tau_h = [\d.]+ +(\d+)", printed)[1])
    assert silenced == len(found) and abs(candidates - stats["candidates"]) <= len(found ^ expected)
    for picture in ("s2t_scatter.png", "s2t_tokens.png"):  # drawn, and opened as images
        assert (tmp_path / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("method", ["justrl", "stapo"])
def test_gpu_overrides_compose_and_validate(method, tmp_path):
    paths = {"train": tmp_path / "train.parquet", "validation": tmp_path / "validation.parquet"}
    overrides = qs.train_overrides(method, tmp_path / "warmup", paths, 8, tmp_path / method, 0.02)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name=method, overrides=overrides)
    stapo = validate(cfg, environment=False)
    assert cfg.data.val_files == str(paths["validation"]) and cfg.trainer.total_training_steps == 8
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n) == (qs.PROMPTS, qs.ROLLOUTS)
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size * 4 == qs.PROMPTS
    assert cfg.reward.custom_reward_function.path == "pkg://stapo.tools.reward"
    assert cfg.trainer.save_freq == 8  # verl's checkpoint, as scripts/train.sh writes it; evaluate merges it
    assert "hf_model" not in cfg.actor_rollout_ref.actor.checkpoint.save_contents
    assert stapo.mask == ("s2t" if method == "stapo" else "none") and (method == "justrl" or stapo.tau_p == 0.02)


def test_script_syntax_and_cpu_path(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    options = [*TINY, "--eval-problems", "2", "--samples", "2"]
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out"), *options], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("No GPU visible") and "warm-up: 3 steps" in result.stdout  # no blank lines first
    assert "\n\n\n" not in result.stdout.split("warm-up:")[0]  # progress bars piped to a file print only those
    assert "S2T mask on 2 problems x 2 samples" in result.stdout and "candidates (both)" in result.stdout
    assert "engine is not available" not in result.stderr and "accelerator" not in result.stderr  # verl's notices
    assert (tmp_path / "out" / "s2t_scatter.png").is_file() and (tmp_path / "out" / "s2t_tokens.jsonl").is_file()
    assert (tmp_path / "out" / "warmup" / "config.json").is_file()
    assert (tmp_path / "out" / "data" / "validation.parquet").is_file()


def test_s2t_totals_from_verls_file_logger(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    logger = FileLogger("quickstart", "stapo")
    logger.log({"val-core/quickstart/acc/mean@8": 0.25}, step=0)  # validation before training: no S2T counts
    for step, (candidates, masked) in enumerate([(10.0, 7.0), (4.0, 3.0), (0.0, 0.0)], start=1):
        logger.log({"stapo/candidate_tokens": candidates, "stapo/masked_tokens": masked, "actor/lr": 1e-6}, step)
    logger.finish()
    assert qs.s2t_totals(read_metrics(tmp_path / "metrics.jsonl")) == (3, 14.0, 10.0)


def test_bad_options_stop_before_any_work(tmp_path):
    """--tau-p 0 used to fail after the whole warm-up (on a GPU, after a whole JustRL run)."""
    for options, message in (
        (["--tau-p", "0"], "error: --tau-p=0.0 is out of range; it must be a number in (0, 1]"),
        (["--q", "1.5"], "error: --q=1.5 is out of range"),
        (["--eval-problems", "200"], "error: --eval-problems=200 exceeds --val=100"),
        (["--steps", "0"], "error: --steps=0: must be a positive integer"),
    ):
        with pytest.raises(SystemExit) as stop:
            qs.main(["cpu", "--out", str(tmp_path / "out"), *options])
        assert str(stop.value).startswith(message)
        assert not (tmp_path / "out").exists()  # nothing built


def test_the_gpu_chain_runs_from_a_new_folder_to_its_table_and_plots(tmp_path, monkeypatch, capsys):
    """``gpu`` mode run for real from an output folder that does not exist yet: task, warm-up, two training runs,
    the evaluation of their checkpoints, the table and the plots. Stand-ins replace only what needs a GPU
    (tests/standins.py): verl's trainer (writing verl's metrics and checkpoints where the real one does, with verl's
    own code) and vLLM in the evaluation (transformers' sampling); torch.cuda.is_available is stubbed and the warm-up
    runs on the CPU. A wrong path between two steps, a missing folder or a lost log fails here."""
    monkeypatch.setattr(qs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(qs, "GPU", "cpu")
    monkeypatch.setattr(qs, "call", standins.calls(qs.call))
    out = tmp_path / "new" / "quickstart"
    qs.main(["gpu", "--out", str(out), *TINY, "--eval-problems", "2", "--samples", "2", "--steps", "2"])
    printed = capsys.readouterr().out
    table = re.search(r"validation accuracy, avg@2 .*?\n((?:  \w+ +[\d.]+%\n)+)", printed)
    assert table and [line.split()[0] for line in table[1].splitlines()] == ["warmup", "justrl", "stapo"]
    assert "S2T over 2 STAPO steps (tau_p = 0.1): 8 candidates, 6 masked" in printed  # the stand-in's counts
    for method in ("justrl", "stapo"):
        assert "step:2" in (out / method / "train.log").read_text()
        assert (out / method / "ckpt" / "global_step_2" / "actor" / "huggingface_merged" / "config.json").is_file()
    for label in ("warmup", "justrl", "stapo"):
        summary = json.loads((out / "eval" / label / "train" / "summary.json").read_text())
        assert summary["benchmarks"]["arith"]["problems"] == 4 and summary["benchmarks"]["arith"]["n"] == 2
    assert {p.name for p in (out / "plots").glob("*.png")} >= {"entropy.png", "reward.png", "masked_frac.png"}


@pytest.fixture
def small_gguf(tmp_path):
    from test_pretrained import write_gguf

    write_gguf(tmp_path / "small.gguf")
    return tmp_path / "small.gguf"


def test_the_smollm2_chain_runs_from_a_new_folder_to_its_table_and_curves(
    small_gguf, tmp_path, monkeypatch, capsys, foreign_ray_ignored
):
    """``--model smollm2`` run for real from an output folder that does not exist yet (at commit ea1edb6 it stopped in
    its first second on the converter's log): the converter (on a small GGUF of SmolLM2's layout, written by
    tests/test_pretrained.py), the five word tasks, the warm-up (on the CPU, which the small model allows) and the
    experiment tool with its Ray clusters, to the table and curves it prints. Stand-ins (tests/standins.py): verl's
    trainer inside the experiment, one GPU declared to it, torch.cuda.is_available here, and the converter's check
    that its GGUF is the real SmolLM2-135M (whose warm-up needs a GPU)."""
    monkeypatch.setattr(qs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(qs, "call", standins.calls(qs.call))
    out = tmp_path / "new" / "smollm2"
    qs.main(["gpu", "--model", "smollm2", "--out", str(out), "--src", str(small_gguf), "--steps", "2", "--seed", "1"])
    printed = capsys.readouterr().out
    experiment = out / "experiment-s1"
    rows = re.findall(r"^\| (justrl|stapo|stapo_random) \| 1 \| 2 \|", printed, re.M)
    assert rows == ["justrl", "stapo", "stapo_random"]  # summary.md, printed: one row per arm, seed 1, 2 steps
    assert f"table: {experiment / 'summary.md'}" in printed
    for log in ("raw", "word1", "word5", "smollm2-s1", "experiment-s1"):  # one a step
        assert (out / "logs" / f"{log}.log").stat().st_size > 0, log
    assert (out / "smollm2-s1" / "step-300" / "config.json").is_file()
    for arm in ("justrl", "stapo", "stapo_random"):
        assert (experiment / "runs" / f"{arm}-s1" / "exit_code").read_text() == "0\n"
        assert "step:2" in (experiment / "runs" / f"{arm}-s1" / "train.log").read_text()
    assert (experiment / "plots" / "entropy.png").is_file()
    record = json.loads((experiment / "experiment.json").read_text())
    assert record["model"] == str(out / "smollm2-s1" / "step-300") and record["steps"] == "2"
    foreign_ray_ignored("the experiment left a Ray cluster running")


def test_the_smollm2_options_of_the_tiny_run_and_the_cpu_mode_are_refused(tmp_path):
    argv = ["--model", "smollm2", "--out", str(tmp_path / "cpu")]
    for extra, message in ((["--lr", "1e-3"], "--lr sets the tiny model's run"), ([], "runs in gpu mode only")):
        with pytest.raises(SystemExit, match=message):
            qs.main(["cpu", *argv, *extra])
    assert not (tmp_path / "cpu").exists()


def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    for out, message in (
        (tmp_path / "file", f"error: --out {tmp_path / 'file'}: a file is in the way; name a folder"),
        (tmp_path / "file" / "sub", f"error: --out {tmp_path / 'file' / 'sub'}: {tmp_path / 'file'} is a file, so"),
    ):
        with pytest.raises(SystemExit) as stop:
            qs.main(["cpu", "--out", str(out), *TINY, "--eval-problems", "2"])
        assert str(stop.value).startswith(message) and "\n" not in str(stop.value)
    assert (tmp_path / "file").read_text() == "x"


def test_smollm2_src_is_handed_to_the_converter_and_checked_first(tmp_path):
    """``--src`` (offline: the archive or .gguf) reaches ``stapo.tools.pretrained``; a missing file, or ``--src``
    without ``--model smollm2``, stops in one line before any work."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    args = qs.build_parser().parse_args(["gpu", "--model", "smollm2", "--out", str(tmp_path / "o"), "--src", str(gguf)])
    convert = list(map(str, qs.smollm2_commands(args)[0]))
    assert convert[2] == "stapo.tools.pretrained" and convert[convert.index("--src") + 1] == str(gguf)
    plain = qs.build_parser().parse_args(["gpu", "--model", "smollm2", "--out", str(tmp_path / "o")])
    assert "--src" not in map(str, qs.smollm2_commands(plain)[0])
    for argv, message in (
        (["--model", "smollm2", "--src", str(tmp_path / "none.gguf")], "--src=.*no such file"),
        (["--src", str(gguf)], "--src is the SmolLM2 archive"),
    ):
        with pytest.raises(SystemExit, match=message):
            qs.main(["gpu", "--out", str(tmp_path / "bad"), *argv])
    assert not (tmp_path / "bad").exists()


def test_smollm2_keeps_the_steps_done_before(tmp_path, monkeypatch):
    """A second call with the same seed goes straight to the experiment (which keeps its own finished runs); the
    experiment itself needs a GPU, so the runner of the commands is stubbed here and only records them."""
    args = qs.build_parser().parse_args(["gpu", "--model", "smollm2", "--out", str(tmp_path), "--seed", "3"])
    commands = qs.smollm2_commands(args)
    for cmd in commands[:-1]:  # what the converter, the task tool and the warm-up leave behind
        made = Path(cmd[cmd.index("--out") + 1]) / qs.SMOLLM2_MADE[str(cmd[2]).rsplit(".", 1)[1]]
        made.parent.mkdir(parents=True, exist_ok=True)
        made.write_text("{}")
    ran = []

    def record(cmd, log, **env):  # the runner, stubbed: it records, and writes the experiment's table
        ran.append(cmd)
        if str(cmd[2]) == "stapo.quickstart.experiment":
            summary = Path(cmd[cmd.index("--out") + 1]) / "summary.md"
            summary.parent.mkdir(parents=True, exist_ok=True)
            summary.write_text("| method |\n")

    monkeypatch.setattr(qs, "call", record)
    qs.run_smollm2(args)
    assert ran == commands[-1:]
    ran.clear()
    qs.run_smollm2(qs.build_parser().parse_args(["gpu", "--model", "smollm2", "--out", str(tmp_path), "--seed", "4"]))
    assert [str(c[2]).rsplit(".", 1)[1] for c in ran] == ["task"] * 5 + ["warmup", "experiment"]  # the model is kept


def test_an_output_folder_in_use_is_refused_and_a_killed_run_leaves_no_lock(tmp_path, capsys):
    """Two quickstarts into one folder at once ran side by side; the second now stops with one line. The lock is the
    first one's ``flock`` on the folder, which ``kill -9`` releases: nothing is written, nothing is left stuck."""
    out = tmp_path / "quickstart"
    code = "import sys, time; from stapo.tools.io import hold_folder as h; print(h(sys.argv[1]), flush=True); "
    code += "time.sleep(99)"
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "None"
        with pytest.raises(SystemExit) as stopped:
            qs.main(["cpu", "--out", str(out)])
        assert (
            stopped.value.code
            == f"error: --out {out}: another run is writing into it now; wait for it to end or name another folder"
        )
        assert list(out.iterdir()) == []
    finally:
        holder.kill()
        holder.wait()
    from stapo.tools.io import hold_folder

    assert hold_folder(out) is None and hold_folder(out) is None  # free again; this process may ask twice


def test_ctrl_c_ends_the_quickstart_with_one_line_and_nothing_half_written(tmp_path):
    """Ctrl-C during the warm-up: one line, no traceback, and no warm-up folder (it is written whole, through a
    temporary folder, once the warm-up ends); the argument errors come before the no-GPU banner."""
    import signal

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    options = [*TINY[:-1], "100000", "--eval-problems", "2", "--samples", "2"]  # a warm-up that Ctrl-C ends
    # a terminal's Ctrl-C reaches a foreground process; a test run in the background (`cmd &` in a script) passes on
    # SIGINT ignored, and Python then never raises KeyboardInterrupt: the child takes SIGINT as a terminal's would
    run = subprocess.Popen([sys.executable, "-m", "stapo.quickstart", "cpu", "--out", str(tmp_path / "out"), *options],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        for line in run.stdout:
            if line.startswith("task: "):  # the warm-up begins
                break
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()  # no quickstart left running when the test fails
    assert run.returncode == 1 and "Traceback" not in err, err
    assert (
        err.strip().splitlines()[-1]
        == f"interrupted: {tmp_path / 'out'} keeps what finished; nothing in it is half written"
    )
    assert not (tmp_path / "out" / "warmup").exists() and not (tmp_path / "out" / ".warmup.partial").exists()
    wrong = subprocess.run([sys.executable, "-m", "stapo.quickstart", "cpu", "--out", str(tmp_path / "o"), "--lr", "0"],
                           env=env, capture_output=True, text=True)  # fmt: skip
    assert wrong.returncode != 0 and wrong.stdout == "" and wrong.stderr.strip() == "error: --lr=0.0: must be positive"


def test_the_tokens_picture_draws_control_characters_as_dots(tmp_path):
    """A byte-level token such as ``\\x1e`` has no glyph in any font: matplotlib warned on every CPU quickstart
    ("Glyph 30 missing"). The picture shows it as ``·``; the tokens and the mask are the real code's (no model)."""
    import warnings

    from stapo.tools.curves import plot_s2t
    from stapo.tools.inspect_tokens import TokenStats, mask_batch

    texts = [["A", "\x1e", "\tb", "\n"], ["c", "d", "e", "f"]]
    stats = [TokenStats(ids=list(range(4)), log_probs=torch.log(torch.tensor([0.9, 1e-3, 1e-3, 0.5])),
                        entropy=torch.tensor([0.1, 0.2, 0.9, 0.3]), top_ids=None, top_probs=None)] * 2  # fmt: skip
    batch = mask_batch(stats, torch.tensor([1.0, -1.0]), tau_p=0.002, q=0.75)
    assert int(batch.silenced.sum()) == 1  # ⌈0.75 · (2 − 1)⌉ of the two candidates
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Glyph")  # a missing glyph is a UserWarning
        written = plot_s2t(batch, texts, ["one", "two"], tmp_path)
    assert [p.name for p in written] == ["s2t_scatter.png", "s2t_tokens.png"]
