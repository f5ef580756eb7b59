"""The per-process scratch directory: private, purged at startup, locked, removed at exit."""

import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamConfigError, StreamingStore
from miles_plugins.optimizers.adam import backend_for
from miles_plugins.optimizers.store import Entry
from tests.unit.test_bad_input import REPO, _wrap


def test_scratch_is_private_and_removed_on_close(tmp_path):
    streamed = _wrap(tmp_path, name="rank3")
    path = tmp_path / "rank3"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    files = os.listdir(path)
    assert files and all(stat.S_IMODE(os.stat(path / f).st_mode) == 0o600 for f in files)
    streamed.close()
    assert not path.exists()
    assert os.listdir(tmp_path) == []


def test_stale_scratch_of_the_same_name_is_purged_and_others_are_kept(tmp_path):
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "bucket_00099.bin").write_bytes(b"stale")
    (tmp_path / "rank1").mkdir()
    (tmp_path / "rank1" / "keep.bin").write_bytes(b"other rank")
    streamed = _wrap(tmp_path, name="rank0")
    assert not (tmp_path / "rank0" / "bucket_00099.bin").exists()
    assert (tmp_path / "rank1" / "keep.bin").read_bytes() == b"other rank"
    streamed.close()


def test_a_symlink_where_the_scratch_belongs_is_refused_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("data")
    (tmp_path / "state").mkdir()
    os.symlink(victim, tmp_path / "state" / "rank0")
    with pytest.raises(StreamConfigError, match="not a plain directory"):
        _wrap(tmp_path / "state")
    assert (victim / "precious").read_text() == "data"


def test_second_user_of_the_same_scratch_name_is_refused(tmp_path):
    first = _wrap(tmp_path, name="rank0")
    with pytest.raises(StreamConfigError, match="in use by another process"):
        _wrap(tmp_path, name="rank0")
    first.close()
    _wrap(tmp_path, name="rank0").close()


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
