"""Evaluation harness on CPU: grading, avg@k / std / pass@k by hand, resume after a kill, shards, bad input.

vLLM is not installed here. The CLI tests put a stand-in ``vllm`` module in ``sys.modules``: ``LLM`` and
``SamplingParams`` record their arguments and ``LLM.generate`` returns canned responses. Only the vLLM generation call
is replaced; everything else (parquet reading, chat template, tokenization, grading with stapo.tools.reward in worker
processes, appends, resume, summaries) is the real code.
"""

import json
import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from stapo.quickstart.tiny import build_model, build_tokenizer
from stapo.tools import evaluate as ev
from stapo.tools.data import Report, build_rows, write_parquet

# problem -> (ground truth, [(response, finish_reason, tokens)]); correctness is in the comment after each problem
PROBLEMS = {
    "aime24": {
        "What is 1+2?": (
            "3",
            [
                ("so \\boxed{3}", "stop", 10),
                ("\\boxed{4}", "stop", 20),
                ("\\boxed{3}", "stop", 30),
                ("The answer is \\boxed{3}.", "stop", 40),
            ],
        ),  # 1 0 1 1
        "What is 2+5?": (
            "7",
            [
                ("\\boxed{6}", "stop", 10),
                ("no answer", "stop", 20),
                ("\\boxed{8}", "stop", 30),
                ("so \\boxed{7", "length", 40),
            ],
        ),  # 0 0 0 0 (cut off)
        "Half of one?": (
            "\\frac{1}{2}",
            [
                ("\\boxed{0.5}", "stop", 10),
                ("\\boxed{2}", "stop", 20),
                ("\\boxed{1}", "stop", 30),
                ("\\boxed{3}", "stop", 40),
            ],
        ),  # 1 0 0 0
    },
    "math500": {
        "Compute 3*3.": ("9", [("\\boxed{9}", "stop", 5), ("\\boxed{9}", "stop", 7)]),  # 1 1
        "Compute 10-4.": ("6", [("\\boxed{6}", "stop", 5), ("\\boxed{5}", "stop", 7)]),  # 1 0
    },
}
# By hand. aime24: 4/12 correct; per-sample-index accuracy 2/3, 0, 1/3, 1/3; pass@2 per problem 1, 0, 1 - C(3,2)/C(4,2).
AIME24 = {
    "problems": 3,
    "n": 4,
    "avg": 100 / 3,
    "std": math.sqrt(((200 / 3 - 100 / 3) ** 2 + (100 / 3) ** 2) / 3),
    "pass": {"1": 100 / 3, "2": 50.0, "4": 200 / 3},
    "mean_tokens": 25.0,
    "truncated": 100 / 12,
}
MATH500 = {
    "problems": 2,
    "n": 2,
    "avg": 75.0,
    "std": math.sqrt(2 * 25**2),
    "pass": {"1": 75.0, "2": 100.0},
    "mean_tokens": 6.0,
    "truncated": 0.0,
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny Qwen3 checkpoint laid out as verl saves it, and the two benchmarks as prepared parquet."""
    root = tmp_path_factory.mktemp("eval")
    model = root / "checkpoints" / "stapo" / "stapo_qwen3_1.7b" / "global_step_5" / "actor" / "huggingface"
    texts = [problem for bench in PROBLEMS.values() for problem in bench] + ["Please reason step by step \\boxed{}"]
    tokenizer = build_tokenizer(texts * 20, model)
    build_model(tokenizer, model, hidden_size=64, num_layers=1)
    data = root / "data"
    for bench, problems in PROBLEMS.items():
        records = [{"problem": problem, "answer": truth} for problem, (truth, _) in problems.items()]
        rows = build_rows([("fixture", records)], bench, "test", False, Report(bench, data, []))
        write_parquet(rows, data / f"{bench}.parquet")
    return SimpleNamespace(model=model, data=data, tokenizer=tokenizer)


def fake_vllm(monkeypatch, tokenizer, fail_on_call=None):
    """Install a stand-in ``vllm`` whose ``LLM.generate`` answers from PROBLEMS; records what it was given."""
    calls = SimpleNamespace(engines=[], params=[], prompts=[])
    responses = {problem: answers for bench in PROBLEMS.values() for problem, (_, answers) in bench.items()}

    class SamplingParams:
        def __init__(self, **kwargs):
            self.n = kwargs["n"]
            calls.params.append(kwargs)

    class LLM:
        def __init__(self, **kwargs):
            calls.engines.append(kwargs)

        def generate(self, prompts, params):
            if fail_on_call == len(calls.prompts) + 1:
                raise KeyboardInterrupt("killed")
            texts = [tokenizer.decode(prompt["prompt_token_ids"]) for prompt in prompts]
            calls.prompts.append(texts)
            outputs = []
            for text in texts:
                answers = next(answers for problem, answers in responses.items() if problem in text)
                outputs.append(
                    SimpleNamespace(
                        outputs=[
                            SimpleNamespace(text=response, finish_reason=reason, token_ids=[0] * tokens)
                            for response, reason, tokens in answers[: params.n]
                        ]
                    )
                )
            return outputs

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = LLM, SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    return calls


def run_cli(assets, out, *extra):
    common = ["--model", str(assets.model), "--data", str(assets.data), "--out", str(out), "--no-progress"]
    ev.main([*common, "--benchmarks", "aime24", "math500", "--n", "4", "math500=2", "--grade-workers", "2", *extra])


def run_dir(out, preset="train"):
    return out / "stapo_qwen3_1.7b_step5" / preset


def sample_keys(folder):
    keys = []
    for path in folder.glob("samples*.jsonl"):
        keys += [(r["benchmark"], r["problem_id"], r["sample"]) for r in map(json.loads, path.open())]
    return keys


def assert_metrics(actual, expected):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():  # approx does not nest
        assert actual[key] == pytest.approx(value, abs=1e-9), key


def test_pass_at_k_unbiased_estimator():
    assert ev.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert ev.pass_at_k(32, 0, 32) == 0.0
    assert ev.pass_at_k(32, 1, 32) == 1.0
    assert ev.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    assert ev.pass_at_k(5, 2, 4) == pytest.approx(1 - math.comb(3, 4) / math.comb(5, 4))  # C(3,4) = 0 -> 1
    with pytest.raises(ValueError, match="k <= n"):
        ev.pass_at_k(4, 1, 8)


def test_cli_end_to_end(assets, tmp_path, monkeypatch):
    calls = fake_vllm(monkeypatch, assets.tokenizer)
    run_cli(assets, tmp_path, "--preset", "justrl", "--max-tokens", "64", "--tp", "2", "--enforce-eager")
    folder = run_dir(tmp_path, "justrl")
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["label"], summary["method"], summary["size"]) == ("stapo_qwen3_1.7b_step5", "stapo", "qwen3_1.7b")
    assert (summary["temperature"], summary["top_p"], summary["max_tokens"]) == (0.7, 0.9, 64)
    assert summary["average"] is None  # two of the six benchmarks
    assert_metrics(summary["benchmarks"]["aime24"], AIME24)
    assert_metrics(summary["benchmarks"]["math500"], MATH500)
    # vLLM was asked for what the preset and options say, once per benchmark (chunks of 2048 samples)
    (engine,) = calls.engines
    assert engine["model"] == str(assets.model.resolve()) and engine["tensor_parallel_size"] == 2
    assert engine["enforce_eager"] is True and engine["seed"] == 0
    assert calls.params == [
        dict(n=4, temperature=0.7, top_p=0.9, max_tokens=64),
        dict(n=2, temperature=0.7, top_p=0.9, max_tokens=64),
    ]
    # prompts: the parquet's messages through the chat template, generation prompt appended
    first = calls.prompts[0][0]
    assert first.startswith("<|im_start|>user\nWhat is 1+2?\n\nPlease reason step by step")
    assert first.endswith("<|im_end|>\n<|im_start|>assistant\n")
    keys = sample_keys(folder)
    assert len(keys) == len(set(keys)) == 3 * 4 + 2 * 2
    records = [json.loads(line) for line in (folder / "samples.jsonl").open()]
    half = next(r for r in records if r["response"] == "\\boxed{0.5}")  # decided by math-verify, in a worker
    assert half["score"] == 1.0 and half["pred"] == "0.5" and half["ground_truth"] == "\\frac{1}{2}"
    cut = next(r for r in records if r["finish_reason"] == "length")
    assert cut["score"] == 0.0 and cut["tokens"] == 40 and cut["prompt"].endswith("assistant\n")


def test_other_benchmark_files_are_evaluated_too(assets, tmp_path, monkeypatch):
    """Any DATA/<name>.parquet in the recipe's schema (the quickstart's task): 4 samples per problem by default."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "arith.parquet").write_bytes((assets.data / "aime24.parquet").read_bytes())
    calls = fake_vllm(monkeypatch, assets.tokenizer)
    common = ["--model", str(assets.model), "--data", str(data), "--out", str(tmp_path / "out"), "--no-progress"]
    ev.main([*common, "--benchmarks", "arith", "--grade-workers", "2"])
    summary = json.loads((run_dir(tmp_path / "out") / "summary.json").read_text())
    assert list(summary["benchmarks"]) == ["arith"] and summary["average"] is None
    assert [p["n"] for p in calls.params] == [4]
    assert_metrics(summary["benchmarks"]["arith"], AIME24)


def test_resume_after_kill_keeps_one_record_per_sample(assets, tmp_path, monkeypatch):
    # one problem per generate call; the second call is "killed"
    fake_vllm(monkeypatch, assets.tokenizer, fail_on_call=2)
    with pytest.raises(KeyboardInterrupt):
        run_cli(assets, tmp_path, "--chunk-samples", "4")
    folder = run_dir(tmp_path)
    samples = folder / "samples.jsonl"
    first = [json.loads(line) for line in samples.open()]
    assert {r["problem_id"] for r in first} == {0} and not (folder / "summary.json").exists()
    # a kill in the middle of the next append: half a group, then half a line
    with samples.open("a") as file:
        for sample in (0, 1):
            file.write(json.dumps({**first[0], "problem_id": 1, "sample": sample}) + "\n")
        file.write(json.dumps(first[0])[:25])

    calls = fake_vllm(monkeypatch, assets.tokenizer)
    run_cli(assets, tmp_path, "--chunk-samples", "4")
    keys = sample_keys(folder)
    assert len(keys) == len(set(keys)) == 3 * 4 + 2 * 2
    generated = [text for chunk in calls.prompts for text in chunk]
    assert len(generated) == 4 and not any("What is 1+2?" in text for text in generated)  # problem 0 was kept
    summary = json.loads((folder / "summary.json").read_text())
    assert_metrics(summary["benchmarks"]["aime24"], AIME24)

    calls = fake_vllm(monkeypatch, assets.tokenizer)
    run_cli(assets, tmp_path)  # finished: vLLM is not even started, the summary is rewritten
    assert calls.engines == [] and len(sample_keys(folder)) == 16


def test_shards_share_one_summary(assets, tmp_path, monkeypatch):
    calls = fake_vllm(monkeypatch, assets.tokenizer)
    run_cli(assets, tmp_path, "--shard", "1/2")
    folder = run_dir(tmp_path)
    assert (folder / "samples.1of2.jsonl").exists() and not (folder / "summary.json").exists()
    run_cli(assets, tmp_path, "--shard", "0/2")
    summary = json.loads((folder / "summary.json").read_text())
    assert_metrics(summary["benchmarks"]["aime24"], AIME24)
    assert_metrics(summary["benchmarks"]["math500"], MATH500)
    keys = sample_keys(folder)
    assert len(keys) == len(set(keys)) == 3 * 4 + 2 * 2 and len(calls.engines) == 2


def test_verifier_hook_overrides_rule_scores(assets, tmp_path, monkeypatch):
    (tmp_path / "my_verifier.py").write_text("def judge(records):\n    return [1.0 for _ in records]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_vllm(monkeypatch, assets.tokenizer)
    run_cli(assets, tmp_path / "out", "--verifier", "my_verifier:judge")
    folder = run_dir(tmp_path / "out")
    records = [json.loads(line) for line in (folder / "samples.jsonl").open()]
    assert all(r["score"] == 1.0 for r in records) and sum(r["rule_score"] for r in records) == 4 + 3
    assert json.loads((folder / "summary.json").read_text())["benchmarks"]["aime24"]["avg"] == 100.0


def bad_run(assets, tmp_path, monkeypatch, capsys, *args, data=None):
    calls = fake_vllm(monkeypatch, assets.tokenizer)
    common = ["--model", str(assets.model), "--data", str(data or assets.data), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        ev.main([*common, "--no-progress", *args])
    assert exit_info.value.code == 2 and calls.engines == []  # stopped before any model load
    return capsys.readouterr().err


def test_bad_input_stops_early_with_the_fix(assets, tmp_path, monkeypatch, capsys):
    err = bad_run(assets, tmp_path, monkeypatch, capsys, "--benchmarks", "aime25")
    assert f"{assets.data / 'aime25.parquet'}: not found" in err and "python -m stapo.tools.data eval" in err

    table = pq.read_table(assets.data / "aime24.parquet").drop_columns(["reward_model"])
    pq.write_table(table, tmp_path / "aime24.parquet")
    err = bad_run(assets, tmp_path, monkeypatch, capsys, "--benchmarks", "aime24", data=tmp_path)
    assert "aime24.parquet: missing column(s) reward_model" in err

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "aime24.parquet").write_bytes((assets.data / "aime24.parquet").read_bytes()[:200])  # truncated
    err = bad_run(assets, tmp_path, monkeypatch, capsys, "--benchmarks", "aime24", data=damaged)
    assert err.startswith(f"error: {damaged / 'aime24.parquet'}: not a readable parquet file (")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1

    err = bad_run(assets, tmp_path, monkeypatch, capsys, "--benchmarks", "aime2024")
    assert "aime2024.parquet: not found" in err and "the paper's benchmarks are aime24, aime25" in err
    err = bad_run(assets, tmp_path, monkeypatch, capsys, "--benchmarks", "aime24", "--n", "math500=2")
    assert "'math500' is not among the benchmarks run" in err
    err = bad_run(assets, tmp_path, monkeypatch, capsys, "--shard", "2/2")
    assert "--shard '2/2'" in err
    err = bad_run(assets, tmp_path, monkeypatch, capsys, "--model", str(tmp_path))
    assert f"--model {tmp_path}: neither a Hugging Face model folder (no config.json) nor a training checkpoint" in err


def test_without_vllm_the_error_says_how_to_install_it(assets, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(SystemExit):
        run_cli(assets, tmp_path / "out")
    err = capsys.readouterr().err
    assert "generation needs vLLM" in err and "pip install -e '.[gpu]'" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()  # no run.json written first


def test_changed_settings_do_not_mix_into_a_run(assets, tmp_path, monkeypatch, capsys):
    fake_vllm(monkeypatch, assets.tokenizer)
    run_cli(assets, tmp_path, "--max-tokens", "64")
    calls = fake_vllm(monkeypatch, assets.tokenizer)
    with pytest.raises(SystemExit):
        run_cli(assets, tmp_path, "--max-tokens", "128")
    err = capsys.readouterr().err
    assert "run.json: this folder holds a run with other settings: max_tokens (was 64, now 128)" in err
    assert "another --out or --label" in err and calls.engines == []


def test_labels_from_verl_checkpoint_paths():
    path = Path("/ckpt/stapo/entropy20_qwen3_14b/global_step_300/actor/huggingface")
    assert ev.default_label(path) == "entropy20_qwen3_14b_step300"
    assert ev.infer_method_size(path) == ("entropy20", "qwen3_14b")
    assert ev.infer_method_size(Path("/models/Qwen3-8B-Base")) == (None, None)
    assert ev.parse_n(["8", "aime24=32"], ["aime24", "math500"]) == {"aime24": 32, "math500": 8}
    assert ev.parse_n(None, ev.DEFAULT_N) == ev.DEFAULT_N
