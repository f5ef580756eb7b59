"""The per-process scratch directory: removed at close, at exit, and after a failed setup.

Purge, lock and symlink refusals are failure scenarios: ``test_security.py``."""

import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamingStore
from miles_plugins.optimizers.step.adam import backend_for
from miles_plugins.optimizers.step.entries import Entry
from tests.helpers import REPO, wrap


def test_scratch_is_private_and_removed_on_close(tmp_path):
    streamed = wrap(tmp_path, name="rank3")
    path = tmp_path / "rank3"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    files = os.listdir(path)
    assert files and all(stat.S_IMODE(os.stat(path / f).st_mode) == 0o600 for f in files)
    streamed.close()
    assert not path.exists()
    assert os.listdir(tmp_path) == []


def test_scratch_is_removed_at_interpreter_exit(tmp_path):
    code = textwrap.dedent(f"""
        import torch
        from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
        m = torch.nn.Linear(8, 8).to(torch.bfloat16)
        s = StreamedOptimizer(torch.optim.AdamW(m.parameters()), StreamConfig(directory={str(tmp_path)!r}))
        import os; print(sorted(os.listdir({str(tmp_path)!r})))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO}, check=True
    ).stdout
    assert "rank0" in out
    assert os.listdir(tmp_path) == []


def test_failed_setup_leaves_nothing_behind(tmp_path):
    """A failure after the scratch exists (here: building the initial mains) removes it all."""
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    entries = [Entry(param=p, main=torch.empty(p.shape), group_index=0) for p in model.parameters()]

    def broken_init(param, main):
        raise RuntimeError("cannot build mains")

    with pytest.raises(RuntimeError, match="cannot build mains"):
        StreamingStore(entries, backend_for(optimizer), StreamConfig(directory=str(tmp_path)), init_main=broken_init)
    assert os.listdir(tmp_path) == []
