"""Several verl runs at once on one machine, each in a Ray cluster of its own over its own GPU: the scheduler of
``python -m stapo.quickstart.experiment`` (and of any tool that runs several trainings side by side).

Why a cluster each, and why their job ids must differ, is verl 0.9.1's (:data:`stapo.train.verl_patches.WORKAROUNDS`):
the jobs of one cluster share its TransferQueue (a named Ray actor) and take each other's rollouts, and the socket
that carries a run's weights to vLLM is named after the Ray job id, which every fresh cluster starts at 01000000.
:func:`ray_head` starts a cluster (``ray start --head``), :func:`claim_job` makes the job id of a run's trainer
depend on its slot, :func:`launch` runs a queue of runs over a list of GPUs, stops a run whose log stays silent, and
stops every run and cluster when it stops.

The multi-node path uses the same pieces: :func:`local_cluster` builds a cluster of several Ray nodes on one machine
(``python -m stapo.checks.gpu_smoke --nodes 2``), and :func:`wait_for_nodes` (``python -m stapo.train.clusters wait``)
is scripts/slurm.sbatch's check that every node joined.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

from stapo.tools.io import write_atomic

POLL_S = 5.0
"""Seconds between two looks at the runs and the free GPUs."""
HANDOVER_S = 30.0
"""Seconds between the end of a run and the start of the next on the same GPU slot."""


@contextmanager
def ray_head(gpu: str, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """Starts the head of a Ray cluster of one run's own on this machine, over the GPU ``gpu`` (or the GPUs of a list,
    ``"1,2"``, all declared to Ray); yields its address and process at once (the head takes seconds to accept
    drivers), and stops it on exit. The caller makes sure that no
    other cluster runs here (:func:`stapo.train.preflight.local_cluster_problems`).

    Why a cluster each: verl 0.9.1 keeps a run's rollouts in TransferQueue, whose controller is a named Ray actor
    (``TransferQueueController`` in the namespace ``transfer_queue``), so the jobs of one cluster share it and take each
    other's rollouts (docs/history.md, section 7)."""
    from ray.util import get_node_ip_address

    port, client_port, dashboard_port, agent_port = free_ports(4)
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}"]
    cmd += [f"--ray-client-server-port={client_port}", f"--dashboard-port={dashboard_port}"]  # else fixed ports
    cmd += [f"--dashboard-agent-listen-port={agent_port}"]
    cmd += [f"--num-gpus={len(gpu.split(','))}", "--include-dashboard=false", "--disable-usage-stats"]
    head = start_node(cmd, gpu, log)
    address = f"{get_node_ip_address()}:{port}"
    try:
        yield address, head
    finally:
        stop_node(head)
        forget(address)


def one_auth_mode() -> None:
    """Give this process, the Ray nodes it starts and the runs it launches one Ray auth mode: ``RAY_AUTH_MODE`` as set,
    else ``disabled``. Ray 2.60's ``ray start --head`` turns token auth on when ``~/.ray/auth_token`` exists (any
    earlier local ``ray.init()`` writes it, e.g. a run of scripts/train.sh on the same machine), while a client given
    the address does not and is refused (``InvalidAuthToken``): after a train.sh run, every cluster of the experiment
    failed to start (H200, 2026-11-28). scripts/slurm.sbatch does the same for its nodes."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def start_node(cmd: list[str], gpus: str, log: Path) -> subprocess.Popen:
    """``ray start ... --block`` over the GPUs ``gpus`` in a process group of its own (a Ctrl-C of the caller must not
    reach its processes all at once), output appended to ``log``, with this Python's ``bin`` first on ``PATH`` (the
    jobs of the cluster run ``python3`` and ``ray`` from there), in the auth mode of its clients
    (:func:`one_auth_mode`)."""
    one_auth_mode()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "PATH": python_first_path()}
    with open(log, "a") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def python_first_path() -> str:
    """``PATH`` with this Python's ``bin`` first, so that ``python3`` and ``ray`` there are this environment's."""
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def stop_node(node: subprocess.Popen) -> None:
    """Stop a node of :func:`start_node`: SIGTERM, on which `ray start --block` stops its processes in order
    (signalling the whole process group instead leaves them waiting 30 s for a stopped GCS), then after 60 s SIGKILL
    to whatever is left of its group."""
    node.terminate()
    with suppress(subprocess.TimeoutExpired):
        node.wait(timeout=60)
    with suppress(ProcessLookupError):
        os.killpg(node.pid, signal.SIGKILL)


def forget(address: str) -> None:
    """Remove Ray's record of the machine's latest cluster if it names ``address``: `ray start` wrote it, and every
    later local ray.init() (a plain training run) would look for that stopped cluster there; `ray stop` would clear
    it, but stops every cluster."""
    from ray._common.utils import get_ray_address_file  # no public API names Ray's record of the latest cluster

    record = Path(get_ray_address_file(None))
    if record.is_file() and record.read_text().strip() == address:
        record.unlink()


@contextmanager
def local_cluster(
    node_gpus: Sequence[str], log: Path, timeout_s: float = 120, first_slot: int = 0
) -> Iterator[tuple[str, str]]:
    """A Ray cluster of ``len(node_gpus)`` nodes on this machine, as Ray's own test clusters build one: a head and one
    more raylet per entry, each over the GPUs of its entry (``CUDA_VISIBLE_DEVICES``, e.g. ``["0", "1"]``: two nodes of
    one GPU); yields the GCS address and the dashboard's URL (for ``ray job submit``, scripts/ray_job.sh) once every
    node has joined, and stops the nodes on exit, workers first. It stands in for several machines in the checks of the
    multi-node path (``python -m stapo.checks.gpu_smoke --nodes 2``); every port is chosen free, so that it runs beside
    other clusters, and its next drivers get Ray job ids above those of ``first_slot`` runs of :func:`launch` (verl's
    weight-transfer sockets are named after job ids, :func:`claim_job`)."""
    from ray.util import get_node_ip_address

    port, client_port, dashboard_port, *agent_ports = free_ports(3 + len(node_gpus))
    address, dashboard = f"{get_node_ip_address()}:{port}", f"http://127.0.0.1:{dashboard_port}"
    start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    nodes = [
        [*start, "--head", f"--port={port}", f"--ray-client-server-port={client_port}", "--include-dashboard=true"]
        + ["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
    ] + [[*start, f"--address={address}"] for _ in node_gpus[1:]]
    if first_slot == 1:  # the waits below are its jobs 1 and 2
        raise ValueError("local_cluster: first_slot must be 0 or at least 2")
    processes: list[subprocess.Popen] = []
    try:
        for cmd, gpus, agent_port in zip(nodes, node_gpus, agent_ports):
            cmd += [f"--num-gpus={len(gpus.split(','))}", f"--dashboard-agent-listen-port={agent_port}"]
            processes.append(start_node(cmd, gpus, log))
            if len(processes) == 1:  # the others join the head once it answers
                wait_for_nodes(address, 1, timeout_s, processes)
        wait_for_nodes(address, len(node_gpus), timeout_s, processes)
        if first_slot:
            claim_job(address, processes[0], first_slot, log)
        yield address, dashboard
    finally:
        for process in reversed(processes):  # workers first, while the head's GCS still answers their drain
            stop_node(process)
        forget(address)


def wait_for_nodes(
    address: str, count: int, timeout_s: float, processes: Sequence[subprocess.Popen] = (), names: Sequence[str] = ()
) -> int:
    """Waits until the Ray cluster at ``address`` has ``count`` live nodes, among them one on each host of ``names``
    (short host names, as ``scontrol show hostnames`` lists Slurm's nodes; several nodes of one host count apart);
    returns the live nodes. Stops with one line naming what is missing after ``timeout_s`` seconds, or at once if one of
    ``processes`` (the nodes' ``ray start``) exited."""
    import ray

    deadline, short = time.monotonic() + timeout_s, {name.split(".")[0] for name in names}
    host, port = address.rsplit(":", 1)
    alive: list[str] = []
    try:
        while True:
            for process in processes:
                if process.poll() is not None:
                    command = shlex.join(process.args)
                    raise SystemExit(f"error: a Ray node of the cluster at {address} exited ({command})")
            if not ray.is_initialized() and _answers(host, int(port)):  # ray.init retries a closed port for minutes
                with suppress(ConnectionError):
                    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            if ray.is_initialized():
                alive = [n["NodeManagerHostname"].split(".")[0] for n in ray.nodes() if n["Alive"]]
            if len(alive) >= count and short <= set(alive):
                return len(alive)
            if time.monotonic() > deadline:
                missing = " ".join(sorted(short - set(alive))) or f"{count - len(alive)} of {count}"
                raise SystemExit(
                    f"error: node(s) {missing} did not join the Ray cluster at {address} within {timeout_s:g} s "
                    f"(live: {len(alive)}: {' '.join(alive) or 'none'})"
                )
            time.sleep(1)
    finally:
        ray.shutdown()


def _answers(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at ``host:port`` within a second."""
    with suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def claim_job(address: str, head: subprocess.Popen, slot: int, log: Path) -> None:
    """Connects to the fresh cluster at ``address`` and leaves, until this process has been its job ``slot + 1``.

    Why: verl names the socket over which a run's trainer hands its weights to vLLM after the Ray job id
    (``/tmp/rl-colocate-zmq-<job id>-replica-0-rank-0.sock``, verl PR #6246), and a fresh cluster numbers its jobs from
    1 in the order their drivers connect. Every run connects alike, once in the preflight (``cluster_gpus``) and then
    as the trainer, so the trainers of runs in different slots get different job ids."""
    import ray

    job, deadline = 0, time.monotonic() + 120
    try:
        while job <= slot:
            try:
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            except ConnectionError:
                if head.poll() is not None:
                    raise SystemExit(f"error: the Ray head stopped (exit {head.returncode}); see {log}") from None
                if time.monotonic() > deadline:
                    raise SystemExit(f"error: no Ray cluster at {address} after 2 minutes; see {log}") from None
                time.sleep(1)
                continue
            job = int.from_bytes(bytes.fromhex(ray.get_runtime_context().get_job_id()), "little")
            ray.shutdown()
    finally:
        if ray.is_initialized():
            ray.shutdown()
    if job != slot + 1:  # another driver connected meanwhile: the run's job id could be another slot's
        raise SystemExit(f"error: the Ray cluster at {address} numbered this process's job {job}, not {slot + 1}")


def claimed(
    cluster: ExitStack, head: tuple[str, subprocess.Popen], gpu: str, slot: int, log: Path, name: str
) -> str | None:
    """The address of the cluster ``head`` (entered in ``cluster``) once :func:`claim_job` succeeded there, or on a
    fresh head on other ports when it did not (a port may be taken between choosing it and the head's start); ``None``
    if that failed too (``cluster`` closed)."""
    address, process = head
    for attempt in (1, 2):
        try:
            claim_job(address, process, slot, log)
            return address
        except SystemExit as error:
            cluster.close()
            print(f"{name}: {error}; {'once more, on other ports' if attempt == 1 else 'not started'}", flush=True)
            if attempt == 1:
                address, process = cluster.enter_context(ray_head(gpu, log))
    return None


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that are free now (the OS picks them)."""
    with ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("", 0))
        return [probe.getsockname()[1] for probe in probes]


def launch(runs: Sequence, command: Callable[..., list[str]], gpus: Sequence[str], out: Path, stall_s: float) -> dict:
    """Run every unfinished run (anything with a ``name``; ``command(run)`` starts it, logs in ``out/runs/NAME``), each
    in a Ray cluster of its own
    (:func:`ray_head`, :func:`claim_job`) over one of ``gpus``, one run per entry at a time (a GPU named twice takes
    two runs at once): an entry takes the next run :data:`HANDOVER_S` after its last run ended (that run's processes
    may still release GPU memory). A run whose log stays silent for ``stall_s`` seconds is stopped (a hung weight
    hand-over would hold its GPU for good); if this process stops (an exception, or SystemExit from a caller's SIGTERM
    handler), so do the runs, every process below them (:func:`kill_tree`) and their clusters. Returns each run's exit
    code (0 for runs kept from before)."""
    codes, queue = {}, []
    for run in runs:
        done = out / "runs" / run.name / "exit_code"
        if done.is_file() and done.read_text().strip() == "0":
            print(f"{run.name}: finished before, kept")
            codes[run.name] = 0
        else:
            queue.append(run)
    busy: dict[int, tuple[object, subprocess.Popen, ExitStack, float]] = {}  # slot: run, process, its cluster, start
    ended = dict.fromkeys(range(len(gpus)), -math.inf)

    def end(slot: int, run, code: int, cluster: ExitStack) -> None:
        codes[run.name] = code
        write_atomic(out / "runs" / run.name / "exit_code", f"{code}\n")
        print(f"{run.name}: exit {code}", flush=True)
        cluster.close()
        ended[slot] = time.monotonic()

    try:
        while queue or busy:
            for slot, (run, process, cluster, started) in list(busy.items()):
                log = out / "runs" / run.name / "train.log"
                if process.poll() is None and time.time() - max(log.stat().st_mtime, started) > stall_s:
                    print(f"{run.name}: no output for {stall_s:.0f} s, stopped (log: {log})", flush=True)
                    kill_tree(process)
                if process.poll() is not None:
                    end(slot, run, process.returncode, cluster)
                    del busy[slot]
            starting = []
            with ExitStack() as pending:  # the clusters started here, until their runs have started
                for slot, gpu in enumerate(gpus):  # every head at once: each takes seconds to accept drivers
                    if queue and slot not in busy and time.monotonic() - ended[slot] > HANDOVER_S:
                        run = queue.pop(0)
                        folder = out / "runs" / run.name
                        folder.mkdir(parents=True, exist_ok=True)
                        cluster = pending.enter_context(ExitStack())
                        starting.append(
                            (slot, gpu, run, folder, cluster, cluster.enter_context(ray_head(gpu, folder / "ray.log")))
                        )
                for slot, gpu, run, folder, cluster, head in starting:
                    address = claimed(cluster, head, gpu, slot, folder / "ray.log", run.name)
                    if address is None:  # this run fails; the others go on
                        end(slot, run, 1, cluster)
                        continue
                    env = {**os.environ, "RAY_ADDRESS": address, "PYTHONUNBUFFERED": "1"}
                    env["VERL_FILE_LOGGER_PATH"] = str(folder / "metrics.jsonl")
                    env.pop("CUDA_VISIBLE_DEVICES", None)  # Ray gives the run's workers its cluster's GPU
                    with open(folder / "train.log", "a") as log:
                        process = subprocess.Popen(
                            list(map(str, command(run))), stdout=log, stderr=subprocess.STDOUT, env=env
                        )
                    busy[slot] = (run, process, cluster.pop_all(), time.time())
                    print(f"{run.name}: started on GPU {gpu} (log: {folder / 'train.log'})", flush=True)
            time.sleep(POLL_S)
    finally:
        for _, process, cluster, _ in busy.values():
            kill_tree(process)
            cluster.close()
    return codes


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a run and every process below it, whatever process group or session each is in (a watcher's trainer,
    the training of ``stapo.checks.replay halt`` in a group of its own), then reap the run. Each process found is
    stopped first (SIGSTOP) and the tree read again, so that none starts another that the kill would miss; SIGINT and
    SIGTERM wait meanwhile, so that no process is left stopped. A run already reaped is left alone (its pid may be
    another process's by now), and so are processes that left the tree before (an orphan belongs to init)."""
    if process.returncode is not None:
        return
    found: set[int] = set()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        while new := set(tree(process.pid)) - found:
            for pid in new:
                with suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGSTOP)
            found |= new
    finally:
        for pid in found:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    process.wait()


def tree(pid: int) -> list[int]:
    """``pid`` and the processes below it (their parents read from Linux's ``/proc/PID/stat``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, IndexError, ValueError):  # a process that ended while read
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m stapo.train.clusters wait ADDRESS SECONDS HOST...``: wait until every Slurm node of the job has
    joined the Ray cluster at ``ADDRESS`` (scripts/slurm.sbatch), one line when they have, one error line when not.
    ``HOST...``: each node's host name (``hostname -s`` there; its Slurm node name may differ), once per node."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m stapo.train.clusters", description="Wait until every node of a job has joined its Ray cluster."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    wait = commands.add_parser("wait", help="wait until the nodes have joined the Ray cluster")
    wait.add_argument("address", help="the head's GCS address, HEAD_IP:PORT")
    wait.add_argument("seconds", type=float, help="how long to wait")
    wait.add_argument("nodes", nargs="+", help="each node's host name, once per node")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[\w.-]+:\d+", args.address):
        parser.exit(2, f"error: address {args.address}: the head's GCS address, HEAD_IP:PORT\n")
    if not args.seconds > 0:
        parser.exit(2, f"error: seconds {args.seconds}: must be a positive number\n")
    wait_for_nodes(args.address, len(args.nodes), args.seconds, names=args.nodes)
    names = " ".join(sorted({n.split(".")[0] for n in args.nodes}))
    print(f"stapo: Ray cluster at {args.address}: all {len(args.nodes)} node(s) joined: {names}")


if __name__ == "__main__":
    main()
