"""stapo.train.clusters' multi-node pieces on a CPU: a Ray cluster of two nodes on one machine (``local_cluster``,
the stand-in for two machines of ``python -m stapo.checks.gpu_smoke --nodes 2``) and the join check of
scripts/slurm.sbatch (``python -m stapo.train.clusters wait``). Real Ray clusters, owned by the test."""

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from stapo.train import clusters


def test_a_local_cluster_of_two_nodes_gives_each_node_its_gpus(tmp_path, foreign_ray_ignored):
    """The stand-in for two machines of ``python -m stapo.checks.gpu_smoke --nodes 2``: two Ray nodes on this machine,
    one GPU declared to Ray on each (no GPU is touched), a dashboard that ``ray job submit`` reaches, and the join
    check of scripts/slurm.sbatch (``python -m stapo.train.clusters wait``), which counts nodes of one host apart."""
    host = socket.gethostname()
    with clusters.local_cluster(["0", "1"], tmp_path / "ray.log") as (address, dashboard):
        assert json.loads(urllib.request.urlopen(dashboard + "/api/version", timeout=10).read())["ray_version"]
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        try:
            group = placement_group([{"GPU": 1}, {"GPU": 1}], strategy="STRICT_SPREAD")  # as verl's nnodes=2 pools
            ray.get(group.ready(), timeout=60)

            @ray.remote(num_gpus=1, num_cpus=0)
            def where():
                return ray.get_runtime_context().get_node_id(), os.environ["CUDA_VISIBLE_DEVICES"]

            placed = ray.get([
                where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, bundle)).remote()
                for bundle in (0, 1)
            ])  # fmt: skip
        finally:
            ray.shutdown()
        assert len({node for node, _ in placed}) == 2 and sorted(gpu for _, gpu in placed) == ["0", "1"]
        wait = [sys.executable, "-m", "stapo.train.clusters", "wait", address]
        joined = subprocess.run([*wait, "60", host, host], capture_output=True, text=True, timeout=120)
        assert joined.returncode == 0 and f"all 2 node(s) joined: {host.split('.')[0]}" in joined.stdout
        late = subprocess.run([*wait, "3", host, "node-that-never-came"], capture_output=True, text=True, timeout=60)
        assert late.returncode == 1 and late.stderr.strip().splitlines()[-1].startswith(
            "error: node(s) node-that-never-came did not join the Ray cluster"
        )
        three = subprocess.run([*wait, "3", host, host, host], capture_output=True, text=True, timeout=60)
        assert "error: node(s) 1 of 3 did not join" in three.stderr
    foreign_ray_ignored()


def test_waiting_for_a_cluster_that_is_not_there_ends_in_time(tmp_path):
    """A head that never answers (a port taken between choosing it and `ray start`) must not hold the wait past its
    time: ray.init alone retries a closed port for minutes; and a node process that exited stops the wait at once."""
    import time

    address = f"127.0.0.1:{clusters.free_ports(1)[0]}"
    start = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        clusters.wait_for_nodes(address, 1, 2)
    expected = f"error: node(s) 1 of 1 did not join the Ray cluster at {address} within 2 s (live: 0: none)"
    assert str(stop.value) == expected
    assert time.monotonic() - start < 10
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(SystemExit, match=f"error: a Ray node of the cluster at {address} exited"):
        clusters.wait_for_nodes(address, 1, 60, [gone])
    assert not ray.is_initialized()
