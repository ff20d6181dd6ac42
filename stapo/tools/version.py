"""``python -m stapo.tools.version``: the recipe's version and the commit it was built from.

(Not ``python -m stapo --version``: a ``stapo/__main__.py`` would be a module of the method's layer, which
tests/test_layout.py keeps to the method itself.)

The commit is the image's ``STAPO_COMMIT`` (docker/build.sh sets it, and the image's OCI label
``org.opencontainers.image.revision``, from ``git rev-parse HEAD``, with ``-dirty`` when the checkout had changes not
committed), else the checkout's own ``git rev-parse HEAD`` (with ``-dirty`` likewise), else ``unknown``.
"""

import os
import subprocess
import sys
from pathlib import Path

from stapo import __version__

USAGE = """usage: python -m stapo.tools.version
Prints the recipe's version and the commit it was built from (STAPO_COMMIT in the image, else the
checkout's git HEAD, else unknown)."""


def commit() -> str:
    """STAPO_COMMIT, else the checkout's HEAD (``-dirty`` if it has changes not committed), else ``unknown``."""
    if os.environ.get("STAPO_COMMIT"):
        return os.environ["STAPO_COMMIT"]
    checkout = Path(__file__).resolve().parents[2]

    def git(*args):
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "--show-toplevel", "HEAD")
        if head.returncode != 0 or Path(head.stdout.split()[0]).resolve() != checkout:
            return "unknown"  # not a checkout of its own (an installed copy inside some other repository)
        dirty = git("status", "--porcelain").stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.split()[1] + ("-dirty" if dirty else "")


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in ([], ["--version"]):
        print(f"stapo-verl {__version__} commit {commit()}")
        return 0
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    print(f"error: unknown arguments {' '.join(args)!r}: python -m stapo.tools.version takes none", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
