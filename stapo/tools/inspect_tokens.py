"""Spurious-token inspector: the tokens of given rollouts that the S2T mask silences, in the paper's appendix form.

    python -m stapo.tools.inspect_tokens --model DIR --rollouts FILE [FILE ...] [--tau-p 0.002] [--q 0.75]
                                         [--max-samples N] [--context 20] [--top-k 5] [--show 50] [--out FILE.jsonl]

Rollouts are verl's rollout dumps (``trainer.rollout_data_dir``: one ``<step>.jsonl`` per step, lines with ``input``,
``output``, ``score`` and, from the V1 trainer, ``uid`` = ``<prompt uid>_<session>_<index>``) or the sample files of
``python -m stapo.tools.evaluate``. Advantages are recomputed GRPO-style with verl's ``compute_grpo_outcome_advantage``,
(r - mean) / (std + 1e-6) over the samples of the same prompt; token probabilities and entropies are recomputed with
transformers; :func:`stapo.s2t.s2t_mask` is applied to all inspected samples as one mini-batch (STAPO, arXiv
2602.15620, eq. I^S2T). Each silenced token is listed with its context, probability, entropy, top-k alternatives
and advantage, as in the paper's appendix examples.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from stapo.config import StapoConfig, StapoConfigError
from stapo.s2t import s2t_mask
from stapo.tools.checkpoint import find_model
from stapo.tools.io import DataFileError, output_problem, read_jsonl, write_atomic

EVAL_KEYS = ("benchmark", "problem_id", "sample", "prompt", "response", "score")
DUMP_KEYS = ("input", "output", "score")
# verl decodes dumped prompts with skip_special_tokens=True: Qwen's "<|im_start|>user\n...<|im_end|>\n
# <|im_start|>assistant\n" becomes "user\n...\nassistant\n", from which the user message is recovered.
_DECODED_CHAT = re.compile(r"user\n(?P<content>.*)\nassistant\n?", re.S)


class InspectError(ValueError):
    """Bad input; the message names the file and line at fault."""


@dataclass(frozen=True)
class Rollout:
    name: str  # file:line
    group: str  # samples of the same prompt (GRPO group) share it
    prompt: str  # as the model saw it, chat template applied
    response: str
    score: float


@dataclass(frozen=True)
class TokenStats:
    """Per response token: id, log-probability, entropy (natural log) and the top-k alternatives."""

    ids: list[int]
    log_probs: torch.Tensor
    entropy: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor


def read_rollouts(paths: Sequence[Path], tokenizer) -> list[Rollout]:
    """Rollouts of eval sample files or verl rollout dumps (detected per line)."""
    expected = "JSON lines: a verl rollout dump (trainer.rollout_data_dir) or an eval samples*.jsonl"
    rollouts = []
    for path in map(Path, paths):
        for number, record in enumerate(read_jsonl(path, expected), 1):
            rollouts.append(_rollout(record, f"{path}:{number}", tokenizer))
    if not rollouts:
        raise InspectError(f"no rollouts in {', '.join(map(str, paths))}")
    return rollouts


def _rollout(record: dict, name: str, tokenizer) -> Rollout:
    if all(key in record for key in EVAL_KEYS):
        group = f"{record['benchmark']}/{record['problem_id']}"
        return Rollout(name, group, record["prompt"], record["response"], float(record["score"]))
    if all(key in record for key in DUMP_KEYS):
        parts = str(record.get("uid", "")).rsplit("_", 2)
        prompt_key = parts[0] if len(parts) == 3 else record["input"]
        group = f"{name.rpartition(':')[0]}/{prompt_key}"
        match = _DECODED_CHAT.fullmatch(record["input"])
        if match is None:
            raise InspectError(
                f"{name}: cannot recover the chat prompt from 'input' (expected 'user\\n...\\nassistant')"
            )
        messages = [{"role": "user", "content": match["content"]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return Rollout(name, group, prompt, record["output"], float(record["score"]))
    raise InspectError(
        f"{name}: unknown record; expected eval samples ({', '.join(EVAL_KEYS)}) or a verl rollout dump "
        f"({', '.join(DUMP_KEYS)}, uid)"
    )


def grpo_advantages(rollouts: Sequence[Rollout]) -> torch.Tensor:
    """GRPO advantages of the rollouts' scores, grouped by prompt (:func:`group_advantages`)."""
    return group_advantages([r.score for r in rollouts], [r.group for r in rollouts])


def group_advantages(scores: Sequence[float], groups: Sequence) -> torch.Tensor:
    """GRPO advantages of ``scores`` within their ``groups`` (one label per score, shared by the samples of one
    prompt), with verl's own estimator."""
    import numpy as np
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    column = torch.tensor([[score] for score in scores], dtype=torch.float32)
    advantages, _ = compute_grpo_outcome_advantage(column, torch.ones_like(column), np.array(groups, dtype=object))
    return advantages[:, 0]


@torch.no_grad()
def token_stats(model, tokenizer, rollout: Rollout, top_k: int = 5, temperature: float = 1.0) -> TokenStats:
    """Probabilities and entropies of the response tokens given the prompt (logits / temperature, as verl).

    The response text is re-tokenized, which may differ from the sampled tokens where the text has several
    tokenizations. The vocabulary projection runs in chunks so that long responses fit in memory.
    """
    prompt_ids = tokenizer(rollout.prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(rollout.response, add_special_tokens=False)["input_ids"]
    device = next(model.parameters()).device
    hidden = model.base_model(input_ids=torch.tensor([prompt_ids + ids], device=device)).last_hidden_state
    hidden = hidden[0, len(prompt_ids) - 1 : -1]  # position t predicts response token t
    targets = torch.tensor(ids, dtype=torch.long, device=device)
    chunks = [
        _distribution_stats(
            model.get_output_embeddings()(hidden[start : start + 1024]).float() / temperature,
            targets[start : start + 1024],
            top_k,
        )
        for start in range(0, max(len(ids), 1), 1024)
    ]
    return TokenStats(ids, *(torch.cat(parts).cpu() for parts in zip(*chunks)))


def _distribution_stats(logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
    """log p of ``targets``, entropy (verl's ``entropy_from_logits``), top-k ids and probabilities."""
    from verl.utils.torch_functional import entropy_from_logits

    log_probs = torch.log_softmax(logits, dim=-1)
    top = log_probs.topk(min(top_k, log_probs.shape[-1]), dim=-1)
    return log_probs.gather(-1, targets[:, None])[:, 0], entropy_from_logits(logits), top.indices, top.values.exp()


@dataclass(frozen=True)
class MaskedBatch:
    """Rollouts as one padded mini-batch (a row per rollout) with the S2T mask applied: log p, entropy, the
    rollout's advantage per row, the response mask, ``keep`` (the mask with the silenced tokens at 0) and the mask's
    statistics (:func:`stapo.s2t.s2t_mask`)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    keep: torch.Tensor
    stats: dict

    @property
    def candidates(self) -> torch.Tensor:
        """Â > 0 and p < τ_p (bool, per token)."""
        return self.mask.bool() & (self.advantages[:, None] > 0) & (self.log_probs < math.log(self.stats["tau_p"]))

    @property
    def silenced(self) -> torch.Tensor:
        """The tokens S2T silences (bool, per token)."""
        return self.mask.bool() & ~self.keep.bool()


def mask_batch(
    stats: Sequence[TokenStats], advantages: torch.Tensor, tau_p: float = StapoConfig.tau_p, q: float = StapoConfig.q
) -> MaskedBatch:
    """:func:`stapo.s2t.s2t_mask` over the rollouts' tokens as one mini-batch."""
    length = max((len(s.ids) for s in stats), default=0)
    shape = (len(stats), length)
    log_probs, entropy, mask = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape, dtype=torch.long)
    for row, s in enumerate(stats):
        log_probs[row, : len(s.ids)], entropy[row, : len(s.ids)], mask[row, : len(s.ids)] = s.log_probs, s.entropy, 1
    keep, mask_stats = s2t_mask(log_probs, entropy, advantages[:, None].expand(shape), mask, tau_p=tau_p, q=q)
    return MaskedBatch(log_probs, entropy, advantages, mask, keep, {**mask_stats, "tau_p": tau_p, "q": q})


def silenced_records(
    rollouts: Sequence[Rollout], stats: Sequence[TokenStats], batch: MaskedBatch, tokenizer, context: int = 20
) -> list[dict]:
    """One record per silenced token of ``batch``: context, probability, entropy, alternatives, advantage."""
    found = []
    for row, position in batch.silenced.nonzero().tolist():
        s = stats[row]
        found.append(
            {
                "rollout": rollouts[row].name,
                "group": rollouts[row].group,
                "position": position,
                "token": tokenizer.decode([s.ids[position]]),
                "before": tokenizer.decode(s.ids[max(0, position - context) : position]),
                "after": tokenizer.decode(s.ids[position + 1 : position + 1 + context]),
                "prob": float(s.log_probs[position].exp()),
                "entropy": float(s.entropy[position]),
                "top": [
                    [tokenizer.decode([int(i)]), float(p)] for i, p in zip(s.top_ids[position], s.top_probs[position])
                ],
                "advantage": float(batch.advantages[row]),
                "score": rollouts[row].score,
            }
        )
    return found


def silenced_tokens(
    rollouts: Sequence[Rollout],
    stats: Sequence[TokenStats],
    advantages: torch.Tensor,
    tokenizer,
    tau_p: float = StapoConfig.tau_p,
    q: float = StapoConfig.q,
    context: int = 20,
) -> tuple[list[dict], dict]:
    """The tokens :func:`stapo.s2t.s2t_mask` silences, all rollouts forming one mini-batch, and the mask stats."""
    batch = mask_batch(stats, advantages, tau_p, q)
    return silenced_records(rollouts, stats, batch, tokenizer, context), batch.stats


def format_token(number: int, token: dict) -> str:
    """One silenced token as in the paper's appendix: context, probability, entropy, alternatives, advantage."""
    alternatives = " | ".join(f"{text!r} {prob:.4f}" for text, prob in token["top"])
    return (
        f"[{number}] {token['rollout']}  response token {token['position']}  advantage {token['advantage']:+.3f}\n"
        f"    ...{token['before']}⟦{token['token']}⟧{token['after']}...\n"
        f"    p = {token['prob']:.5f}   H = {token['entropy']:.4f}\n"
        f"    top-{len(token['top'])}: {alternatives}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (``python -m stapo.tools.inspect_tokens``)."""
    parser = argparse.ArgumentParser(prog="python -m stapo.tools.inspect_tokens", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, required=True,
        help="policy to inspect: a Hugging Face folder or a checkpoint of scripts/train.sh (as evaluate's --model)",
    )  # fmt: skip
    parser.add_argument("--rollouts", type=Path, nargs="+", required=True, help="verl rollout dumps or eval samples")
    defaults = StapoConfig()
    parser.add_argument("--tau-p", type=float, default=defaults.tau_p, help="probability threshold τ_p (stapo.tau_p)")
    parser.add_argument("--q", type=float, default=defaults.q, help="entropy quantile q (stapo.q)")
    parser.add_argument("--temperature", type=float, default=1.0, help="logit temperature (training rollouts: 1.0)")
    parser.add_argument("--max-samples", type=int, help="inspect only the first N samples (advantages use all)")
    parser.add_argument("--context", type=int, default=20, help="context tokens shown on each side")
    parser.add_argument("--top-k", type=int, default=5, help="alternatives shown per token")
    parser.add_argument("--show", type=int, default=50, help="silenced tokens printed (all go to --out)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="write every silenced token to this JSONL file")
    args = parser.parse_args(argv)
    try:
        StapoConfig(mask="s2t", tau_p=args.tau_p, q=args.q)  # before the model loads
        for name in ("max_samples", "context", "top_k", "show"):
            if getattr(args, name) is not None and getattr(args, name) < (0 if name == "context" else 1):
                raise InspectError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be a positive integer")
        if not args.temperature > 0:
            raise InspectError(f"--temperature={args.temperature}: must be positive")
        try:
            torch.device(args.device)
        except RuntimeError:
            raise InspectError(f"--device {args.device}: not a torch device (cpu, cuda, cuda:1)") from None
        source = find_model(args.model)
        if args.out and (problem := output_problem(args.out, "file")):
            raise InspectError(problem)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source.ready())
        rollouts = read_rollouts(args.rollouts, tokenizer)
        advantages = grpo_advantages(rollouts)[: args.max_samples]
        rollouts = rollouts[: args.max_samples]
        model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).to(args.device).eval()
        stats = [token_stats(model, tokenizer, r, args.top_k, args.temperature) for r in rollouts]
        tokens, mask_stats = silenced_tokens(rollouts, stats, advantages, tokenizer, args.tau_p, args.q, args.context)
    except StapoConfigError as error:
        parser.exit(2, f"error: --{str(error).removeprefix('stapo.').replace('_', '-')}\n")
    except (InspectError, DataFileError, ValueError) as error:  # CheckpointError is a ValueError
        parser.exit(2, f"error: {error}\n")
    print(
        f"{len(rollouts)} samples, {mask_stats['tokens']} response tokens, {mask_stats['candidates']} candidates "
        f"(A > 0, p < {args.tau_p}), {mask_stats['masked']} silenced (H < τ_h = {mask_stats['entropy_threshold']:.4f})"
    )
    for number, token in enumerate(tokens[: args.show], 1):
        print(format_token(number, token))
    if args.out:
        write_atomic(args.out, "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tokens))
        print(f"wrote {len(tokens)} tokens to {args.out}")


if __name__ == "__main__":
    main()
