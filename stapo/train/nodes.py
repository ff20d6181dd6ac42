"""A lost Ray node ends the run, it does not hang it (issue 62, item 3).

When a node of a several-node run dies (its processes killed, its machine gone), the ranks on the other nodes wait in
their next collective for peers that will never come, and verl's driver waits in ``ray.get`` for them: the job hangs
until its time limit, a day or more of GPUs for nothing. The driver (``python -m stapo.train``) therefore watches the
cluster's nodes from a thread of its own (:class:`NodeWatcher`, started with the task runner): every node seen alive
since the run began is watched, and once Ray's GCS reports one of them dead, the driver prints one line naming it and
exits with :data:`NODE_LOST_EXIT`; so does a run whose task runner died with the node (``ray.get`` raised:
:func:`check`). scripts/slurm.sbatch requeues the job on that status as on a save (bounded by
``STAPO_MAX_REQUEUES``), and the next segment resumes from the last checkpoint (``trainer.save_freq``).

The bound: Ray's GCS marks a node dead once it misses its health checks (about 15 s after its processes were killed,
Ray 2.60 on one machine, tests/test_nodes.py), and the watcher looks every :data:`POLL_S`: the driver ends within
:data:`BOUND_S`. On a Ray cluster shared with other runs (scripts/ray_job.sh), a lost node that held none of the run's
workers ends it too.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping

NODE_LOST_EXIT = 4
"""The driver's exit status when a node of the run was lost: nothing saved, the next segment resumes from the last
checkpoint."""

POLL_S = 5.0
"""How often the watcher asks Ray's GCS for the nodes, in seconds."""

BOUND_S = 60.0
"""From a node's processes killed to the driver's exit, at most, in s (Ray's health checks, then :data:`POLL_S`)."""

GCS_FAILURES = 6
"""Consecutive failed questions to the GCS (the head) after which the cluster counts as lost."""


def name(node: Mapping) -> str:
    """A node as the line names it: host, address and Ray node id (the first 12 hex digits)."""
    return f"{node['NodeManagerHostname']} ({node['NodeManagerAddress']}, Ray node {node['NodeID'][:12]})"


def lost(watched: set[str], nodes: Iterable[Mapping]) -> list[Mapping]:
    """The nodes of ``watched`` (ids) that ``nodes`` (``ray.nodes()``) reports dead or no longer lists."""
    listed = {node["NodeID"]: node for node in nodes}
    gone = [listed.get(i, {"NodeID": i, "NodeManagerHostname": "?", "NodeManagerAddress": "?"}) for i in watched]
    return [node for node in gone if not node.get("Alive", False)]


class NodeWatcher(threading.Thread):
    """Polls ``ray.nodes()`` while Ray is initialised in this process; on a lost node (or a GCS that stopped answering)
    prints one line and ends the process with :data:`NODE_LOST_EXIT` (``end``). :meth:`stop` ends the watch (the run
    returned: verl's own shutdown must not look like a loss)."""

    def __init__(self, poll_s: float = POLL_S, end: Callable[[int], None] = os._exit):
        super().__init__(name="stapo-node-watcher", daemon=True)
        self.poll_s, self.end, self.watched, self._failures = poll_s, end, set(), 0
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(self.poll_s):
            self.check()

    def check(self) -> None:
        """One look at the nodes: adds the live ones to those watched, ends the process on a lost one."""
        import ray

        if not ray.is_initialized():
            return
        try:
            listed = ray.nodes()
        except Exception as error:  # the GCS (the head node) does not answer
            self._failures += 1
            if self._failures >= GCS_FAILURES:
                self._lost(f"the Ray head (its GCS) stopped answering ({type(error).__name__})")
            return
        self._failures = 0
        if gone := lost(self.watched, listed):
            self._lost(f"Ray node {', '.join(map(name, gone))} was lost")
        self.watched |= {node["NodeID"] for node in listed if node.get("Alive")}

    def _lost(self, what: str) -> None:
        if self._stopped.is_set():
            return
        sys.stdout.flush()
        print(lost_line(what), file=sys.stderr, flush=True)
        self.end(NODE_LOST_EXIT)


def lost_line(what: str) -> str:
    """The driver's one line on a lost node (``what``: which, and that it was lost)."""
    return (
        f"STAPO: {what} at {time.strftime('%Y-%m-%d %H:%M:%S')}; the run ends with status {NODE_LOST_EXIT} instead "
        "of waiting for it. Run the same command to resume from the last checkpoint (scripts/slurm.sbatch requeues "
        "the job)"
    )


_watcher: NodeWatcher | None = None


def watch(poll_s: float = POLL_S) -> NodeWatcher:
    """Start this process's watcher (once); returns it."""
    global _watcher
    if _watcher is None:
        _watcher = NodeWatcher(poll_s)
        _watcher.start()
    return _watcher


def check(error: BaseException) -> None:
    """The run ended in ``error``: a lost node behind it gets its line and :data:`NODE_LOST_EXIT`. An actor that
    Ray lost (``RayActorError``: the runner was on the node) is reported the moment its socket closes, before the GCS
    rules on the node: then look again until :data:`BOUND_S` has passed; any other error at once."""
    import ray.exceptions

    if _watcher is None:
        return
    until = time.monotonic() + (BOUND_S if isinstance(error, ray.exceptions.RayActorError) else 0)
    while True:
        _watcher.check()
        if time.monotonic() >= until:
            return
        time.sleep(1)


def unwatch() -> None:
    """Stop this process's watcher, if any."""
    global _watcher
    if _watcher is not None:
        _watcher.stop()
        _watcher = None
