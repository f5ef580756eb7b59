"""Bad input gets a clear error, and nothing is written."""

import errno
import fcntl
import logging
import os
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamConfigError, StreamedOptimizer, StreamIOError
from miles_plugins.optimizers.homes.backings import FileHandle
from miles_plugins.optimizers.homes.host_memory import HostMemory
from tests.helpers import REPO, wrap


def _bf16_model():
    return torch.nn.Linear(64, 64).to(torch.bfloat16)


@pytest.mark.parametrize("name", ["fp64", "bfloat16", "", "FP32"])
def test_unknown_moment_dtype_is_refused(tmp_path, name):
    with pytest.raises(StreamConfigError, match="unknown moment dtype .* choose one of fp32, bf16"):
        StreamConfig(directory=str(tmp_path), moment_dtype=name)


@pytest.mark.parametrize("cap", [0, -1])
def test_non_positive_bucket_cap_is_refused(tmp_path, cap):
    with pytest.raises(StreamConfigError, match="bucket cap must be > 0"):
        StreamConfig(directory=str(tmp_path), bucket_cap_elements=cap)


@pytest.mark.parametrize("budget", [0, -5, 1.5, True])
def test_bad_staging_budget_is_refused(tmp_path, budget):
    with pytest.raises(StreamConfigError, match="staging budget must be a positive number of MiB"):
        StreamConfig(directory=str(tmp_path), staging_budget_mb=budget)


def test_a_staging_budget_below_two_minimum_chunks_is_refused_for_the_pipelined_engine(tmp_path):
    with pytest.raises(StreamConfigError, match="staging budget 3 MiB is too small: .* at least 2 MiB per direction"):
        StreamConfig(directory=str(tmp_path), staging_budget_mb=3)
    assert StreamConfig(directory=str(tmp_path), staging_budget_mb=3, engine="sync").staging_bytes == 3 << 20


def test_directory_under_a_file_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StreamConfigError, match="cannot create state directory .* not a directory"):
        wrap(blocker / "state")
    assert blocker.read_text() == "x"


def test_unwritable_directory_is_refused_before_writing(tmp_path):
    """Root passes every permission check, so as root the directory sits on a
    read-only mount (in a private mount namespace); otherwise a 0555 directory."""
    parent = tmp_path / "ro"
    parent.mkdir()
    code = textwrap.dedent(f"""
        import os, torch
        from miles_plugins.optimizers import StreamConfig, StreamConfigError, StreamedOptimizer
        m = torch.nn.Linear(8, 8).to(torch.bfloat16)
        try:
            StreamedOptimizer(torch.optim.AdamW(m.parameters()), StreamConfig(directory={str(parent / "state")!r}))
        except StreamConfigError as exc:
            print("REFUSED:", exc)
        print("ENTRIES:", os.listdir({str(parent)!r}))
    """)
    command = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("running as root without unshare: no way to make a directory unwritable")
        mount = f"mount -t tmpfs -o ro tmpfs {shlex.quote(str(parent))} && exec {shlex.join(command)}"
        command = ["unshare", "-rm", "sh", "-c", mount]
    else:
        os.chmod(parent, 0o555)
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert "REFUSED:" in result.stdout, result.stdout + result.stderr
    assert "not writable" in result.stdout
    assert "ENTRIES: []" in result.stdout


def test_not_enough_free_space_says_how_much_before_writing(tmp_path):
    # Meta tensors describe a 12 TB state without allocating it; the preflight
    # runs before any byte is materialized or written.
    huge = torch.nn.Parameter(torch.empty(10**12, dtype=torch.bfloat16, device="meta"))
    directory = tmp_path / "state"
    with pytest.raises(
        StreamIOError, match=r"not enough free space .* needs .*GiB .* free; nothing was written"
    ) as info:
        StreamedOptimizer(torch.optim.AdamW([huge]), StreamConfig(directory=str(directory)))
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(directory) == []  # measured once locked and purged: the directory stays, empty


def test_tmpfs_directory_works_with_a_warning(caplog):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    from miles_plugins.optimizers.homes.scratch import filesystem_type

    if filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    model = _bf16_model()
    with caplog.at_level(logging.WARNING):
        streamed = wrap(f"/dev/shm/miles-test-{os.getpid()}", model=model, name="tmpfs-test")
    assert "host RAM" in caplog.text
    model(torch.ones(2, 64, dtype=torch.bfloat16)).float().sum().backward()
    streamed.step()
    streamed.close()
    os.rmdir(f"/dev/shm/miles-test-{os.getpid()}")


def test_truncated_bucket_file_fails_naming_file_and_offset(tmp_path):
    model = _bf16_model()
    streamed = wrap(tmp_path, model=model)
    (bucket,) = streamed.store.buckets
    path = streamed.store._backing.file_backing(bucket).path(bucket)
    os.truncate(path, 1000)
    model(torch.ones(2, 64, dtype=torch.bfloat16)).float().sum().backward()
    with pytest.raises(StreamIOError, match=r"short read of .*bucket_00000.slot\d.bin at offset 1000") as info:
        streamed.step()
    assert info.value.path == path and info.value.offset == 1000
    streamed.close()


def test_write_error_names_file_and_offset(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * 8192)
    handle = FileHandle(str(path), str(path), direct=False)
    os.close(handle.read_fd)
    handle.read_fd = handle.write_fd = os.open(path, os.O_RDONLY)  # writes fail with EBADF, a real OS error
    try:
        with pytest.raises(StreamIOError, match=r"write of .*f.bin failed at offset 4096") as info:
            handle.write(4096, torch.ones(100, dtype=torch.uint8), HostMemory(4096, pin=False))
        assert info.value.offset == 4096
    finally:
        handle.close()


def test_unsupported_optimizers_are_refused(tmp_path):
    model = _bf16_model()
    with pytest.raises(StreamConfigError, match="cannot stream the state of torch.optim.sgd.SGD"):
        StreamedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), StreamConfig(directory=str(tmp_path)))
    with pytest.raises(StreamConfigError, match="amsgrad"):
        StreamedOptimizer(torch.optim.AdamW(model.parameters(), amsgrad=True), StreamConfig(directory=str(tmp_path)))
    assert os.listdir(tmp_path) == []


def test_an_optimizer_that_already_stepped_is_refused(tmp_path):
    model = _bf16_model().float()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 64)).sum().backward()
    optimizer.step()
    with pytest.raises(StreamConfigError, match="before its first step"):
        StreamedOptimizer(optimizer, StreamConfig(directory=str(tmp_path)))


def test_bucket_files_use_direct_io_where_the_filesystem_allows_it(tmp_path):
    from miles_plugins.optimizers.homes.scratch import filesystem_type

    if filesystem_type(str(tmp_path)) not in ("ext4", "xfs"):
        pytest.skip(f"{tmp_path} is on {filesystem_type(str(tmp_path))}, not a disk filesystem")
    streamed = wrap(tmp_path, model=_bf16_model())
    assert streamed.store._backing.direct is True
    handle = streamed.store._backing.open(streamed.store.buckets[0])
    try:
        assert fcntl.fcntl(handle.read_fd, fcntl.F_GETFL) & os.O_DIRECT
        assert fcntl.fcntl(handle.write_fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        handle.close()
    streamed.close()


def test_a_filesystem_refusing_direct_io_falls_back_to_buffered_with_a_log_line(tmp_path, monkeypatch, caplog):
    """Simulated: this machine's filesystems (ext4, and tmpfs on kernels >= 6.6) all
    accept O_DIRECT, so opens with O_DIRECT fail with EINVAL here as they do on
    filesystems without direct I/O support."""
    real_open = os.open

    def open_without_direct_io(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_without_direct_io)
    model = _bf16_model()
    with caplog.at_level(logging.WARNING):
        streamed = wrap(tmp_path, model=model)
    assert "refuses O_DIRECT: using buffered I/O" in caplog.text
    assert streamed.store._backing.direct is False
    model(torch.ones(2, 64, dtype=torch.bfloat16)).float().sum().backward()
    streamed.step()
    streamed.step()
    streamed.close()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("io_timeout_s", 0, "io timeout must be a positive number of seconds"),
        ("tier", "nvme", "unknown tier 'nvme'; choose one of disk, host"),
        ("engine", "async", "unknown engine 'async'; choose one of pipelined, sync"),
        ("main_storage", "bf16", "unknown main storage 'bf16'; choose one of fp32, remainder"),
    ],
)
def test_bad_pipeline_settings_are_refused(tmp_path, field, value, message):
    with pytest.raises(StreamConfigError, match=message):
        StreamConfig(directory=str(tmp_path), **{field: value})


def test_wrapping_an_optimizer_twice_is_refused(tmp_path):
    model = _bf16_model()
    optimizer = torch.optim.AdamW(model.parameters())
    first = StreamedOptimizer(optimizer, StreamConfig(directory=str(tmp_path), name="a"))
    with pytest.raises(StreamConfigError, match="streamed already: wrap it once"):
        StreamedOptimizer(optimizer, StreamConfig(directory=str(tmp_path), name="b"))
    assert sorted(os.listdir(tmp_path)) == [".a.lock", "a"], "the refused wrap wrote nothing"
    first.close()


def test_remainder_mains_with_no_bf16_param_are_refused(tmp_path):
    model = torch.nn.Linear(64, 64)  # fp32: every param is its own main
    with pytest.raises(StreamConfigError, match="every param here is fp32 .* use main_storage='fp32'"):
        StreamedOptimizer(
            torch.optim.AdamW(model.parameters()), StreamConfig(directory=str(tmp_path), main_storage="remainder")
        )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("name", "a\0b", "scratch name must be one path component"),
        ("name", "x" * 201, "scratch name must be one path component of at most 200 bytes"),
        ("name", 7, "scratch name must be one path component"),
        # A save's partial directories and locks are named ".<name>.partial...": a name of
        # that shape would be taken for one of them (and removed as a cut-off save's).
        ("name", ".rank0", "without '/', NUL, a leading '.' or '.partial'"),
        ("name", "rank0.partial-h-1-t", "without '/', NUL, a leading '.' or '.partial'"),
        ("resident_warn_elements", "x", "resident warn elements must be a whole number of elements"),
        ("resident_warn_elements", -1, "resident warn elements must be a whole number of elements"),
        ("resident_warn_elements", True, "resident warn elements must be a whole number of elements"),
        ("direct_io", "no", "direct io must be True or False"),
        ("direct_io", 0, "direct io must be True or False"),
        ("directory", "/tmp/a\0b", "directory holds a NUL character"),
        ("moment_dtype", ["fp32"], "unknown moment dtype"),
        ("tier", ["disk"], "unknown tier"),
    ],
)
def test_config_values_of_the_wrong_kind_are_refused_at_construction(tmp_path, field, value, says):
    """Each used to escape validation and fail later, or not at all (a raw ValueError
    from os.open, a TypeError inside the store, direct I/O left on for "no")."""
    kwargs = {"directory": str(tmp_path)} | {field: value}
    with pytest.raises(StreamConfigError, match=says) as refused:
        StreamConfig(**kwargs)
    assert "\n" not in str(refused.value)


def test_fp64_params_are_refused_rather_than_trained_in_fp32(tmp_path):
    """fp64 params would train through fp32 mains and moments, silently unlike resident
    Adam in fp64: refused in one line, nothing written."""
    bf16, fp64 = (
        torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.zeros(1000).double()),
    )
    optimizer = torch.optim.AdamW([bf16, fp64])
    with pytest.raises(StreamConfigError, match="param '0.1' is torch.float64: the streamed state is fp32") as refused:
        StreamedOptimizer(optimizer, StreamConfig(directory=str(tmp_path / "state")))
    assert "\n" not in str(refused.value) and not (tmp_path / "state").exists()
