"""A lost Ray node ends the run with one line instead of hanging it (:mod:`stapo.train.nodes`): verl's own ``run_ppo``
and the recipe's runner wrapper in a driver of a real two-node Ray cluster on this machine; verl's task runner needs
GPUs, so a stand-in runner keeps an actor on the second node and then waits, as ranks wait in a collective for a peer
that died."""

import os
import signal
import subprocess
import sys
import time

import pytest

from stapo.train import clusters, nodes


def node(node_id, alive=True):
    return {"NodeID": node_id, "Alive": alive, "NodeManagerHostname": "n1", "NodeManagerAddress": "10.0.0.1"}


def test_a_watched_node_dead_or_gone_is_lost_and_others_are_not():
    listed = [node("a" * 28), node("b" * 28, alive=False), node("c" * 28, alive=False)]
    assert nodes.lost({"a" * 28}, listed) == []
    assert [n["NodeID"] for n in nodes.lost({"a" * 28, "b" * 28}, listed)] == ["b" * 28]  # c: dead before the run
    (missing,) = nodes.lost({"d" * 28}, listed)  # no longer listed at all
    assert nodes.name(missing) == f"? (?, Ray node {'d' * 12})"
    assert nodes.name(listed[0]) == f"n1 (10.0.0.1, Ray node {'a' * 12})"


DRIVER = """
import sys, time
from pathlib import Path
import ray
from hydra import compose, initialize_config_dir
from stapo.config import CONFIG_DIR
from stapo.train import nodes
from stapo.train.main import run_verl

PLACED = sys.argv[1]  # (in the actors, sys.argv is their worker's)

@ray.remote(num_cpus=0, resources={"far": 0.5})
class Rank:  # a worker of the run on the second node
    def node(self):
        return ray.get_runtime_context().get_node_id()

@ray.remote(num_cpus=0, **({"num_gpus": 0.5} if sys.argv[2] == "head" else {"resources": {"far": 0.5}}))
class StandInRunner:  # verl's TaskRunnerV1 needs GPUs; on the head (which declares a GPU), or on the lost node
    def run(self, config):
        rank = Rank.remote()
        Path(PLACED).write_text(ray.get(rank.node.remote()))
        while True:  # the run's other ranks, waiting for a peer
            time.sleep(1)

with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
    config = compose("stapo", ["+ray_kwargs.ray_init.include_dashboard=False"])
run_verl(config, StandInRunner)  # verl's run_ppo: ray.init, the runner, ray.get
"""


@pytest.mark.parametrize("runner", ["head", "far"], ids=["runner-on-the-head", "runner-on-the-lost-node"])
def test_killing_a_nodes_processes_ends_the_driver_with_one_line_naming_it(tmp_path, foreign_ray_ignored, runner):
    """The ranks left wait for ever (the watcher's line), or the runner itself was on the node (``ray.get`` raises:
    the same line, not a traceback, and the same status)."""
    log, placed = tmp_path / "ray.log", tmp_path / "rank_node"
    with clusters.local_cluster(["0"], log) as (address, _):
        start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
        far = clusters.start_node([*start, f"--address={address}", '--resources={"far": 1}', "--num-cpus=1"], "", log)
        try:
            clusters.wait_for_nodes(address, 2, 120, [far])
            (tmp_path / "driver.py").write_text(DRIVER)
            env = {**os.environ, "RAY_ADDRESS": address}
            driver = subprocess.Popen(
                [sys.executable, str(tmp_path / "driver.py"), str(placed), runner],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in range(1200):
                if placed.exists() and placed.read_text() or driver.poll() is not None:
                    break
                time.sleep(0.1)
            if not placed.exists():
                driver.kill()
                raise AssertionError(driver.communicate()[1][-3000:])
            time.sleep(3)  # the watcher has seen both nodes alive
            os.killpg(far.pid, signal.SIGKILL)  # the node's `ray start`, raylet and workers, at once
            killed = time.monotonic()
            try:
                out, err = driver.communicate(timeout=nodes.BOUND_S)
            finally:
                driver.kill()
            took = time.monotonic() - killed
        finally:
            clusters.stop_node(far)
    lines = [line for line in err.splitlines() if line.startswith("STAPO:")]
    assert driver.returncode == nodes.NODE_LOST_EXIT, err[-3000:]
    assert len(lines) == 1 and f"Ray node {placed.read_text()[:12]}" in lines[0] and "was lost at" in lines[0]
    assert "Run the same command to resume from the last checkpoint" in lines[0]
    print(f"the driver ended {took:.1f} s after the node's processes were killed")
    assert took < nodes.BOUND_S
    foreign_ray_ignored()
