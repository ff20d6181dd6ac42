"""The rollout's agent loop under ``determinism=full``: verl's single-turn loop, with a sampling seed of its own for
every response, and rollouts on tape (:class:`RolloutTape`).

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

import functools
import hashlib
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.workers.rollout.replica import TokenOutput

from stapo.config import SEEDED_AGENT_LOOP, TAPE_GLOB


def request_seed(seed: int, prompt: Any, *where: Any) -> int:
    """The sampling seed of one request: a 31-bit hash of the run's rollout seed, the prompt's messages and ``where``,
    what tells the request apart from the others of its step: the step (V1's ``global_steps``), the prompt's row in
    the data (``index``: the same text twice in one step gets other seeds), the response's index in its group (V1's
    ``session_id``) and its place in the batch (V0's ``priority``). The n responses of a prompt get n different
    seeds, and a rerun of the step (or a resumed run) gets the same ones."""
    text = json.dumps([seed, [str(w) for w in where], list(prompt)], sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & 0x7FFF_FFFF


class TapeError(RuntimeError):
    """A replayed run asked for a response its recording does not hold (another data set, seed or config)."""


LAUNCH = uuid.uuid4().hex[:12]
"""This process's launch: a recording process writes a file of its own (a resumed run's process may get the same
pid, and the kill may have cut the old file's last line)."""


def request_digest(prompt_ids: list[int], sampling_params: dict) -> str:
    """What a replayed response must have been generated for: the prompt's token ids and the sampling settings but
    the seed (the key)."""
    settings = {k: v for k, v in sampling_params.items() if k != "seed"}
    return hashlib.sha256(json.dumps([list(prompt_ids), settings], sort_keys=True, default=str).encode()).hexdigest()[
        :16
    ]


@functools.cache
def load_tape(folder: str) -> dict[int, dict]:
    """Every recorded response of ``folder`` by its request's seed. A last line cut short by a kill is left out; a
    seed recorded twice with other tokens or log-probabilities is an error: a resumed record run generated the steps
    after its checkpoint again, or two runs recorded into one folder."""
    entries: dict[int, dict] = {}
    for path in sorted(Path(folder).glob(TAPE_GLOB)):
        text = path.read_text(encoding="utf-8")
        for line in text.splitlines()[: None if text.endswith("\n") else -1]:
            entry = json.loads(line)
            first = entries.setdefault(entry["seed"], entry)
            if [first["output"].get(k) for k in ("token_ids", "log_probs")] != [
                entry["output"].get(k) for k in ("token_ids", "log_probs")
            ]:
                raise TapeError(
                    f"{folder}: the request of seed {entry['seed']} was recorded twice with different responses (a "
                    "resumed record run, or two runs in one folder); record a run in one go, into a new folder"
                )
    return entries


class RolloutTape:
    """verl's LLM server client with rollouts on tape: records every response it generates into ``folder`` (one
    JSON line each, keyed by the request's seed, with a digest of its prompt's token ids and sampling settings), or
    replays them from there without generating (for the same prompt and settings, or an error). Two runs that replay
    one recording train on the same rollouts, so what they compute differently is the training side's (FSDP, data
    order, seeds), not vLLM's batch dependence (issue 54, docs/determinism.md). The seed (:func:`request_seed`) tells
    every response of a run apart: it needs ``determinism=full``, which the preflight checks."""

    def __init__(self, server: Any, folder: str, replay: bool):
        self.server, self.folder, self.replay = server, Path(folder), replay
        self.path = self.folder / TAPE_GLOB.replace("*", f"{socket.gethostname()}-{os.getpid()}-{LAUNCH}")
        if not replay:
            self.folder.mkdir(parents=True, exist_ok=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict, **kwargs) -> TokenOutput:
        seed, digest = sampling_params["seed"], request_digest(prompt_ids, sampling_params)
        if self.replay:
            entry = load_tape(str(self.folder)).get(seed)
            if entry is None or entry["prompt"] != digest:
                found = "no response" if entry is None else "a response to another prompt or sampling setting"
                raise TapeError(
                    f"stapo.replay_rollouts={self.folder}: {found} for the request of seed {seed}: the recording "
                    "comes from another data set, seed, batch or step count; record with this run's settings"
                )
            return TokenOutput(**entry["output"])
        output = await self.server.generate(
            request_id=request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs
        )
        line = json.dumps({"seed": seed, "prompt": digest, "output": output.model_dump(mode="json")}) + "\n"
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:  # one write of a whole line: a kill leaves at most the last line cut short (load_tape skips it)
            os.write(descriptor, line.encode())
        finally:
            os.close(descriptor)
        return output


@register(SEEDED_AGENT_LOOP)
class SeededSingleTurnAgentLoop(SingleTurnAgentLoop):
    """verl's :class:`SingleTurnAgentLoop` that, under ``rollout.full_determinism``, gives each request the seed of
    :func:`request_seed` (a seed already in ``sampling_params`` is sent instead) and, where verl's V1 worker gave it
    no place (a ``session_id`` and ``priority`` 0), that seed as its place; otherwise verl's loop unchanged. With
    ``stapo.record_rollouts`` or ``stapo.replay_rollouts`` its server client is a :class:`RolloutTape`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        stapo = self.config.get("stapo") or {}
        if stapo.get("record_rollouts") or stapo.get("replay_rollouts"):
            replay = bool(stapo.get("replay_rollouts"))
            folder = stapo.replay_rollouts if replay else stapo.record_rollouts
            self.server_manager = RolloutTape(self.server_manager, folder, replay)

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs) -> AgentLoopOutput:
        if self.rollout_config.full_determinism:
            where = kwargs.get("global_steps"), kwargs.get("index"), kwargs.get("session_id"), int(priority)
            seed = request_seed(self.rollout_config.seed, kwargs["raw_prompt"], *where)
            sampling_params = {"seed": seed, **sampling_params}
            if "session_id" in kwargs and not priority:  # verl's V1 worker: no place of its own
                priority = seed
        return await super().run(sampling_params, priority=priority, **kwargs)
