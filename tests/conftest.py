"""Test-wide environment and fixtures.

Ray started by a test writes no authentication token under $HOME (~/.ray), and keeps its files (sessions, and the
record of the latest cluster that a plain ``ray.init()`` reads) in a folder of this test session's own
(``RAY_TMPDIR``), not in the machine's /tmp/ray, which another suite or a user's job may write meanwhile (a suite run
beside this one's CI run wrote /tmp/ray/ray_current_cluster during a test, which then saw it as its own leftover).
Tests own their Ray clusters: a cluster that another process runs on the machine, before the test or during it, is
not the test's, and :func:`foreign_ray_ignored` keeps the preflight's view of the machine to the clusters the test
starts.

Everything the tests and the processes they start put in the system's temporary folder (pytest's own folders, verl's
``ckpt_*.lock`` files, multiprocessing's ``pymp-*`` folders) goes to a folder of this session's own (``TMPDIR``),
removed when the session ends.
"""

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["TMPDIR"] = tempfile.tempdir = tempfile.mkdtemp(prefix="stapo-tests-")
atexit.register(shutil.rmtree, tempfile.tempdir, ignore_errors=True)
os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
atexit.register(shutil.rmtree, os.environ["RAY_TMPDIR"], ignore_errors=True)


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (``/proc``'s parent links)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
    return False


def own_gcs_servers(listing, ancestor: int) -> list[int]:
    """The Ray clusters (GCS servers, from ``listing()``) that ``ancestor``'s process tree started."""
    return [pid for pid in listing() if descends_from(pid, ancestor)]


@pytest.fixture
def foreign_ray_ignored(monkeypatch):
    """Leave the Ray clusters this test process did not start (their GCS servers, by process ancestry) out of
    :mod:`stapo.train.preflight`'s listing for this test, and yield a check that the test left no cluster of its own
    and no ``ray_current_cluster`` file that was not there before."""
    from ray._common.utils import get_ray_address_file

    from stapo.train import preflight

    listing, me = preflight._gcs_servers, os.getpid()
    address_file = Path(get_ray_address_file(None))
    had_address_file = address_file.exists()
    monkeypatch.setattr(preflight, "_gcs_servers", lambda: own_gcs_servers(listing, me))

    def nothing_left(message: str = "a Ray cluster the test started was left running") -> None:
        assert preflight.local_ray_clusters() == [], message
        assert had_address_file or not address_file.exists(), f"{address_file} left behind"

    return nothing_left


@pytest.fixture
def read_only():
    """A function that makes a folder unwritable and undoes it after the test: ``chmod 0555``, and where that does
    not stop this user (root ignores permission bits) ``chattr +i``, which root cannot write past either. Skips the
    test where neither holds (a filesystem without the immutable flag, run as root)."""
    made = []

    def make(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        made.append(folder)
        folder.chmod(0o555)
        if os.access(folder, os.W_OK) and shutil.which("chattr"):
            subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False)
        if os.access(folder, os.W_OK):
            pytest.skip("no way to make a folder read-only here (root, and no chattr +i)")
        return folder

    yield make
    for folder in made:
        if shutil.which("chattr"):
            subprocess.run(["chattr", "-i", str(folder)], capture_output=True, check=False)
        folder.chmod(0o755)
