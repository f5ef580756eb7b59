"""Megatron sources for the matrix and the tests: unpacked wheels and git trees.

Wheels come from the package registry (``pip download``, cached under
``.cache/megatron-wheels``); git trees are exported from a local clone given on
the command line. Nothing of Megatron is kept in this repository.
"""

from __future__ import annotations

import fcntl
import glob
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "megatron-wheels"

# megatron-core publishes cp312 manylinux wheels only; any Python can unpack them.
WHEEL_TAGS = ["--python-version", "3.12", "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64"]


class SourceError(RuntimeError):
    """A Megatron source that could not be fetched or exported."""


def wheel_file(version: str, cache: Path = CACHE) -> Path:
    """The megatron-core wheel of ``version``, downloaded once into ``cache``."""
    pattern = str(cache / f"megatron_core-{version}-*.whl")
    cache.mkdir(parents=True, exist_ok=True)
    # One process at a time (test workers, a matrix run): another could find a wheel half written.
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = glob.glob(pattern)
        if not found:
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *WHEEL_TAGS]
            command += [f"megatron-core=={version}", "-d", str(cache)]
            result = subprocess.run(command, capture_output=True, text=True)
            found = glob.glob(pattern)
            if result.returncode != 0 or not found:
                raise SourceError(f"pip could not download megatron-core=={version}: {result.stderr.strip()[-500:]}")
    return Path(found[0])


def wheel_tree(version: str, dest: Path) -> Path:
    """Unpack the wheel's ``megatron/`` into ``dest``; returns ``dest``."""
    with zipfile.ZipFile(wheel_file(version)) as wheel:
        wheel.extractall(dest, [n for n in wheel.namelist() if n.startswith("megatron/")])
    return dest


def find_commit(repos: list[str], commit: str) -> str | None:
    """The first of ``repos`` (local clones) that holds ``commit``."""
    for repo in repos:
        probe = subprocess.run(["git", "-C", repo, "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
        if probe.returncode == 0:
            return repo
    return None


def git_tree(repo: str, commit: str, dest: Path) -> Path:
    """Export ``megatron/`` at ``commit`` from the clone ``repo`` into ``dest``."""
    with tempfile.TemporaryFile() as archive:
        result = subprocess.run(
            ["git", "-C", repo, "archive", commit, "megatron"], stdout=archive, stderr=subprocess.PIPE
        )
        if result.returncode != 0:
            raise SourceError(f"git archive {commit} in {repo} failed: {result.stderr.decode().strip()}")
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(dest, filter="data")
    return dest
