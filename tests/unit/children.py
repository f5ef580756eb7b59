"""Starting a test's victim process: a module of this repository in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.unit.test_bad_input import REPO


def start(module: str, *args: str) -> subprocess.Popen:
    """``python -m module args...`` from the repository root, output captured as text."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
