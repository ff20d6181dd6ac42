"""The rollout's agent loop under ``determinism=full``: verl's single-turn loop, with a sampling seed of its own for
every response.

verl 0.9.1 seeds every vLLM request of a run alike when ``actor_rollout_ref.rollout.full_determinism`` is on
(``vllm_async_server.py``, ``generate``: ``sampling_params.setdefault("seed", replica_rank + rollout.seed)``). The n
responses of a prompt are then sampled from one prompt with one seed: they are the same response, every GRPO group
is uniform, its advantages are zero and nothing is learned. Measured on an H200 (docs/reproducibility.md): 0 to 361
positive-advantage tokens a step with verl's switch alone, against 4,533 to 6,789 without it. verl PR #6857 names the
same collision for SGLang. :class:`SeededSingleTurnAgentLoop` passes a seed of each request's own
(:func:`request_seed`), which verl's ``setdefault`` keeps; configs/determinism/full.yaml selects it. It can go once
verl seeds the responses of a group apart.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from stapo.config import SEEDED_AGENT_LOOP


def request_seed(seed: int, prompt: Any, sample: int) -> int:
    """The sampling seed of one request: a 31-bit hash of the run's rollout seed, the prompt's messages and the
    sample's place in the step's batch (verl's ``priority``, distinct for every response of a step). The n responses
    of a prompt get n different seeds, and a rerun of the step gets the same ones."""
    messages = json.dumps([dict(m) for m in prompt], sort_keys=True, default=str)
    digest = hashlib.sha256(f"{seed}\n{sample}\n{messages}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF


@register(SEEDED_AGENT_LOOP)
class SeededSingleTurnAgentLoop(SingleTurnAgentLoop):
    """verl's :class:`SingleTurnAgentLoop` that, under ``rollout.full_determinism``, gives each request the seed of
    :func:`request_seed` (a seed already in ``sampling_params`` is kept); otherwise verl's loop unchanged."""

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs) -> AgentLoopOutput:
        if self.rollout_config.full_determinism and "seed" not in sampling_params:
            seed = request_seed(self.rollout_config.seed, kwargs["raw_prompt"], int(priority))
            sampling_params = {**sampling_params, "seed": seed}
        return await super().run(sampling_params, priority=priority, **kwargs)
