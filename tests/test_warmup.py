"""The format warm-up (stapo/quickstart/warmup.py) on a tiny random Qwen3 on the CPU: one folder per step count, in
bfloat16 as verl and vLLM load it, readable like every other output, and no problem of the RL task files in it."""

import json
import stat

import pytest
import torch

from stapo.quickstart import task
from stapo.quickstart.tiny import build_model, build_tokenizer
from stapo.quickstart.warmup import excluded_questions, main, warmup_problems


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup")
    splits = task.generate_word(seed=0, n_train=30, n_val=5, difficulty=1)
    paths = task.write_task(splits, root / "task", seed=0, data_source=task.WORD_DATA_SOURCE)
    tok = build_tokenizer([p.question + " " + p.solution for p in splits["train"]], root / "model", vocab_size=400)
    build_model(tok, root / "model", hidden_size=64, num_layers=2)
    return root, paths, splits


def test_the_rl_problems_are_left_out(setup):
    _, paths, splits = setup
    exclude = excluded_questions(list(paths.values()))
    assert exclude == {p.question for split in splits.values() for p in split}
    pool = warmup_problems([1], 200, seed=0, exclude=exclude)  # the same generator and seed as the task
    assert len({p.question for p in pool}) == 200 and not exclude & {p.question for p in pool}


def test_one_bfloat16_folder_per_step_count(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    root, paths, _ = setup
    main(["--model", str(root / "model"), "--out", str(tmp_path / "w"), "--steps", "1", "3", "--problems", "20",
          "--batch-size", "2", "--lr", "1e-3", "--exclude", *map(str, paths.values())])  # fmt: skip
    record = json.loads((tmp_path / "w" / "warmup.json").read_text())
    assert len(record["losses"]) == 3 and record["steps"] == [1, 3]
    models = [AutoModelForCausalLM.from_pretrained(tmp_path / "w" / f"step-{k}") for k in (1, 3)]
    assert all(next(m.parameters()).dtype == torch.bfloat16 for m in models)
    assert not torch.equal(models[0].lm_head.weight, models[1].lm_head.weight)  # trained on between the two
    for path in (tmp_path / "w" / "step-3").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044, path  # safetensors' 0600 is not kept


def test_bad_options_stop_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--model", str(tmp_path), "--out", str(tmp_path / "w"), "--steps", "5", "2", "--levels", "9",
              "--exclude", str(tmp_path / "missing.parquet")])  # fmt: skip
    for expected in ("no config.json", "missing.parquet: no such file", "--levels 9", "increasing positive"):
        assert expected in str(stop.value)
    assert not (tmp_path / "w").exists()
