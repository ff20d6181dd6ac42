"""Inspector on a tiny random Qwen3: it lists exactly the tokens s2t_mask silences, with verl-style GRPO advantages.

The expected tokens are computed here independently: a plain full forward pass of the model, GRPO advantages by
hand, then stapo.s2t.s2t_mask on the padded batch.
"""

import json
from pathlib import Path

import pytest
import torch

from stapo.quickstart.tiny import build_model, build_tokenizer
from stapo.s2t import s2t_mask
from stapo.tools import inspect_tokens as ins

DUMP = Path(__file__).parent / "fixtures" / "eval_rollout_dump.jsonl"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen3 with its embeddings scaled up, so that token probabilities and entropies spread out."""
    folder = tmp_path_factory.mktemp("inspect") / "model"
    texts = [text for line in DUMP.open() for text in json.loads(line).values() if isinstance(text, str)]
    tokenizer = build_tokenizer(texts * 10, folder, vocab_size=400)
    model = build_model(tokenizer, folder, hidden_size=64, num_layers=2)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(6)  # tied with the output projection
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


EVAL_PROBLEMS = [  # problem, [(response, score)]
    ("What is 6 times 7?", [("6 * 7 = 42, so \\boxed{42}.", 1.0), ("Six sevens are \\boxed{42}.", 1.0)]),
    ("What is 9 minus 4?", [("9 - 4 = 6, so \\boxed{6}.", 0.0), ("Nine minus four is \\boxed{5}.", 1.0)]),
]


def eval_samples(tokenizer, path):
    """EVAL_PROBLEMS as the sample records of ``python -m stapo.tools.evaluate``."""
    lines = []
    for problem_id, (problem, answers) in enumerate(EVAL_PROBLEMS):
        chat = [{"role": "user", "content": problem}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        for sample, (response, score) in enumerate(answers):
            record = dict(benchmark="aime24", problem_id=problem_id, sample=sample, prompt=prompt, response=response)
            lines.append(json.dumps({**record, "score": score}) + "\n")
    path.write_text("".join(lines))
    return path


def test_reads_verl_dumps_and_eval_samples(tokenizer, tmp_path):
    rollouts = ins.read_rollouts([DUMP, eval_samples(tokenizer, tmp_path / "samples.jsonl")], tokenizer)
    assert len(rollouts) == 7 + 4 and len({r.group for r in rollouts}) == 4
    first = rollouts[0]
    content = "What is the sum of 17 and 25?\n\nPlease reason step by step, and put your final answer within \\boxed{}."
    chat = [{"role": "user", "content": content}]
    assert first.prompt == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert first.name == f"{DUMP}:1" and first.score == 1.0
    # GRPO: (r - mean) / (std + 1e-6), unbiased std over the group; a group of equal scores gets 0
    advantages = ins.grpo_advantages(rollouts)
    std = (1 / 3) ** 0.5  # scores 1, 0, 1
    assert advantages[:3].tolist() == pytest.approx([(1 / 3) / std, -(2 / 3) / std, (1 / 3) / std], rel=1e-5)
    assert advantages[3:7].tolist() == pytest.approx([0.5 / std, -0.5 / std, 0.5 / std, -0.5 / std], rel=1e-5)
    assert advantages[7:].tolist() == pytest.approx([0.0, 0.0, -(0.5**0.5), 0.5**0.5], rel=1e-5)


def test_bad_rollout_lines_name_file_and_line(tokenizer, tmp_path):
    (tmp_path / "bad.jsonl").write_text(
        '{"input": "user\\nx\\nassistant\\n", "output": "y", "score": 1}\n{"text": 1}\n'
    )
    with pytest.raises(ins.InspectError, match=r"bad.jsonl:2: unknown record; expected eval samples"):
        ins.read_rollouts([tmp_path / "bad.jsonl"], tokenizer)


def test_a_file_that_is_not_json_lines_is_named(model_dir, tmp_path, capsys):
    (tmp_path / "rollouts.parquet").write_bytes(b"PAR1\x00\x9f\xff binary")  # e.g. a parquet passed by mistake
    with pytest.raises(SystemExit):
        ins.main(["--model", str(model_dir), "--rollouts", str(tmp_path / "rollouts.parquet")])
    err = capsys.readouterr().err
    assert err.strip() == (
        f"error: {tmp_path / 'rollouts.parquet'}: not a text file; expected JSON lines: a verl rollout dump "
        "(trainer.rollout_data_dir) or an eval samples*.jsonl"
    )


def reference(model_dir, tokenizer, rollouts):
    """Padded log p, entropy, GRPO advantage and mask of every response token, from a plain full forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for rollout in rollouts:
        prompt = tokenizer(rollout.prompt, add_special_tokens=False)["input_ids"]
        response = tokenizer(rollout.response, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits, -1)
        group = torch.tensor([r.score for r in rollouts if r.group == rollout.group])
        advantage = (rollout.score - group.mean()) / (group.std() + 1e-6)
        rows.append((logp.gather(-1, torch.tensor(response)[:, None])[:, 0], -(logp.exp() * logp).sum(-1), advantage))
    shape = (len(rows), max(len(row[0]) for row in rows))
    log_probs, entropy, advantages, mask = (torch.zeros(shape) for _ in range(4))
    for i, (lp, ent, adv) in enumerate(rows):
        log_probs[i, : len(lp)], entropy[i, : len(lp)], advantages[i], mask[i, : len(lp)] = lp, ent, adv, 1
    return log_probs, entropy, advantages, mask


def test_lists_exactly_the_silenced_tokens(model_dir, tokenizer, tmp_path, capsys):
    files = [DUMP, eval_samples(tokenizer, tmp_path / "samples.jsonl")]
    rollouts = ins.read_rollouts(files, tokenizer)
    log_probs, entropy, advantages, mask = reference(model_dir, tokenizer, rollouts)
    # tau_p between two log-probabilities near the median of the positive-advantage tokens: many candidates
    values = log_probs[(mask > 0) & (advantages > 0)].sort().values
    tau_p = float(((values[len(values) // 2] + values[len(values) // 2 + 1]) / 2).exp())
    keep, stats = s2t_mask(log_probs, entropy, advantages, mask, tau_p=tau_p)
    expected = {(rollouts[row].name, pos) for row, pos in ((mask > 0) & (keep == 0)).nonzero().tolist()}
    assert stats["candidates"] > stats["masked"] > 0  # some candidates, and the entropy quantile keeps some

    out = tmp_path / "silenced.jsonl"
    options = ["--tau-p", str(tau_p), "--device", "cpu", "--out", str(out), "--show", "3"]
    ins.main(["--model", str(model_dir), "--rollouts", *map(str, files), *options])
    tokens = [json.loads(line) for line in out.open()]
    assert {(t["rollout"], t["position"]) for t in tokens} == expected
    names = [r.name for r in rollouts]
    for token in tokens:
        row, position = names.index(token["rollout"]), token["position"]
        assert token["prob"] == pytest.approx(float(log_probs[row, position].exp()), rel=1e-4)
        assert token["entropy"] == pytest.approx(float(entropy[row, position]), rel=1e-4)
        assert token["advantage"] == pytest.approx(float(advantages[row, 0]), rel=1e-5) and token["advantage"] > 0
        assert len(token["top"]) == 5 and token["top"][0][1] >= token["top"][-1][1] >= 0
    printed = capsys.readouterr().out
    assert f"{stats['candidates']} candidates" in printed and f"{stats['masked']} silenced" in printed
    assert printed.count("top-5: ") == 3 and "⟦" in printed and "p = " in printed and "H = " in printed
