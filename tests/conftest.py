"""Test-wide environment: Ray started by a test writes no authentication token under $HOME (~/.ray)."""

import os

os.environ["RAY_AUTH_MODE"] = "disabled"
