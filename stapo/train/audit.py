"""Audit mode: with ``STAPO_AUDIT_DIR=<dir>`` set in the Ray runtime environment, the trainer and the actor
workers record what the mask really did, as JSON lines under ``<dir>``, so a run on a real cluster can prove the
three properties STAPO relies on (``python -m stapo.checks.gpu_smoke`` checks them):

* ``driver-<pid>.jsonl`` (one line per update): response tokens in TransferQueue before the update, while the
  workers train (original minus the silenced ones) and after it (restored), and the silenced count;
* ``loss-<pid>.jsonl`` (one line per micro-batch, per actor rank): the global denominator ``batch_num_tokens``
  verl used, the kept and original response tokens of the micro-batch, and the gradient of the loss with respect
  to the policy's log-probs at silenced tokens (must be exactly 0) and at kept ones, and whether verl's rollout
  correction gave the call its importance weights (``rollout_is_weights``).

Off by default; it costs one extra autograd pass per micro-batch when on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "STAPO_AUDIT_DIR"


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def write(kind: str, record: dict) -> None:
    """Append ``record`` as one JSON line to ``$STAPO_AUDIT_DIR/<kind>-<pid>.jsonl``."""
    directory = Path(os.environ[ENV])
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{kind}-{os.getpid()}.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


def loss_record(loss, model_output, data, dp_group) -> dict:
    """What one call of the actor loss did (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from verl.workers.utils.padding import no_padding_2_padding

    log_probs = model_output["log_probs"]
    (grad,) = torch.autograd.grad(loss, log_probs, retain_graph=True)
    grad = no_padding_2_padding(grad, data).abs()
    kept = data.select("response_mask").to_padded_tensor()["response_mask"].bool()
    lengths = data["responses"].offsets().diff().to(kept.device)
    real = torch.arange(kept.shape[1], device=kept.device)[None, :] < lengths[:, None]
    silenced = real & ~kept
    return {
        "rank": dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
        "batch_num_tokens": int(data["batch_num_tokens"]),
        "dp_size": int(data["dp_size"]),
        "response_tokens": int(real.sum()),
        "kept_tokens": int(kept.sum()),
        "silenced_tokens": int(silenced.sum()),
        "max_grad_silenced": float(grad[silenced].max()) if silenced.any() else 0.0,
        "nonzero_grad_kept": int((grad[kept] > 0).sum()),
        "rollout_is_weights": "rollout_is_weights" in data.keys(),
    }
