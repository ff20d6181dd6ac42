"""Test-wide environment and fixtures.

Ray started by a test writes no authentication token under $HOME (~/.ray). Tests own their Ray clusters: a cluster
that runs on the machine before a test (a user's job) is not the test's, and :func:`foreign_ray_ignored` keeps the
preflight's view of the machine to the clusters the test starts.
"""

import os
from pathlib import Path

import pytest

os.environ["RAY_AUTH_MODE"] = "disabled"


@pytest.fixture
def foreign_ray_ignored(monkeypatch):
    """Leave the Ray clusters already running (their GCS servers) out of :mod:`stapo.train.preflight`'s listing for
    this test, and yield a check that the test left no cluster of its own and no ``ray_current_cluster`` file that
    was not there before."""
    from ray._common.utils import get_ray_address_file

    from stapo.train import preflight

    listing = preflight._gcs_servers
    foreign = set(listing())
    address_file = Path(get_ray_address_file(None))
    had_address_file = address_file.exists()
    monkeypatch.setattr(preflight, "_gcs_servers", lambda: [pid for pid in listing() if pid not in foreign])

    def nothing_left(message: str = "a Ray cluster the test started was left running") -> None:
        assert preflight.local_ray_clusters() == [], message
        assert had_address_file or not address_file.exists(), f"{address_file} left behind"

    return nothing_left
