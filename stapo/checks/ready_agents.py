"""The agent-loop manager of ``python -m stapo.checks.benchmark gpu`` runs: verl's own, which also waits until its
worker processes are up.

verl 0.9.1 creates the agent-loop workers (``actor_rollout_ref.rollout.agent.num_workers`` Ray actors, each importing
verl) after "ready to fit" (``TaskRunnerV1.init_agent_loop_manager``) and does not wait for them, so the first step's
clock (``timing_s/step``) holds their start-up: 34-36 s at the 1.7B and 8B shapes (docs/history.md). Waiting
here moves that time to the start-up, where it belongs, and logs it (``stapo.checks.benchmark.READY_LINE``), so that
the benchmark's start-up ends when training can start and its first step measures the step. verl's hook
``agent.agent_loop_manager_class`` selects this class; training runs keep verl's manager. It can go once verl waits
for its workers before the first step.
"""

from __future__ import annotations

import asyncio
import time

from verl.trainer.ppo.v1 import AgentLoopManagerTQ

from stapo.checks.benchmark import READY_LINE


class ReadyAgentLoopManager(AgentLoopManagerTQ):
    async def _init_agent_loop_workers(self):
        start = time.monotonic()
        await super()._init_agent_loop_workers()
        await asyncio.gather(*(worker.__ray_ready__.remote() for worker in self.agent_loop_workers))
        print(f"{READY_LINE}: {len(self.agent_loop_workers)} in {time.monotonic() - start:.1f} s", flush=True)
