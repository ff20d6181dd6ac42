"""The rollout's agent loop under ``determinism=full``: verl's single-turn loop, with a sampling seed of its own for
every response.

verl 0.9.1 seeds every vLLM request of a run alike when ``actor_rollout_ref.rollout.full_determinism`` is on
(``vllm_async_server.py``, ``generate``: ``sampling_params.setdefault("seed", replica_rank + rollout.seed)``). The n
responses of a prompt are then sampled from one prompt with one seed: they are the same response, every GRPO group
is uniform, its advantages are zero and nothing is learned. Measured on an H200 (docs/history.md): 0 to 361
positive-advantage tokens a step with verl's switch alone, against 4,533 to 6,789 without it. verl PR #6857 names the
same collision for SGLang. And verl's V1 trainer (the recipe's) passes no ``priority`` to the agent loop, so under
``full_determinism`` every request is named ``det-0`` and routed by that name to one and the same vLLM server.
:class:`SeededSingleTurnAgentLoop` passes a seed of each request's own (:func:`request_seed`), which verl's
``setdefault`` keeps, and, where verl gave no place, that seed as the request's place (its name and route; vLLM's
``fcfs`` scheduling, verl's default, does not order by it). configs/determinism/full.yaml selects it. It can go once
verl seeds, names and routes the responses of a group apart.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from stapo.config import SEEDED_AGENT_LOOP


def request_seed(seed: int, prompt: Any, *where: Any) -> int:
    """The sampling seed of one request: a 31-bit hash of the run's rollout seed, the prompt's messages and ``where``,
    what tells the request apart from the others of its step: the step (V1's ``global_steps``), the prompt's row in
    the data (``index``: the same text twice in one step gets other seeds), the response's index in its group (V1's
    ``session_id``) and its place in the batch (V0's ``priority``). The n responses of a prompt get n different
    seeds, and a rerun of the step (or a resumed run) gets the same ones."""
    text = json.dumps([seed, [str(w) for w in where], list(prompt)], sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & 0x7FFF_FFFF


@register(SEEDED_AGENT_LOOP)
class SeededSingleTurnAgentLoop(SingleTurnAgentLoop):
    """verl's :class:`SingleTurnAgentLoop` that, under ``rollout.full_determinism``, gives each request the seed of
    :func:`request_seed` (a seed already in ``sampling_params`` is sent instead) and, where verl's V1 worker gave it
    no place (a ``session_id`` and ``priority`` 0), that seed as its place; otherwise verl's loop unchanged."""

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs) -> AgentLoopOutput:
        if self.rollout_config.full_determinism:
            where = kwargs.get("global_steps"), kwargs.get("index"), kwargs.get("session_id"), int(priority)
            seed = request_seed(self.rollout_config.seed, kwargs["raw_prompt"], *where)
            sampling_params = {"seed": seed, **sampling_params}
            if "session_id" in kwargs and not priority:  # verl's V1 worker: no place of its own
                priority = seed
        return await super().run(sampling_params, priority=priority, **kwargs)
