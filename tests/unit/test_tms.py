"""The torch_memory_saver check against the real 0.0.10 wheel's libraries."""

import importlib.metadata
import shutil

import pytest

from miles_plugins.optimizers.tms import TorchMemorySaverError, check_disk_backup_support, check_preloaded_tms


def _real_tms_libraries():
    files = importlib.metadata.files("torch_memory_saver") or []
    libraries = [str(f.locate()) for f in files if f.name.endswith(".so")]
    assert libraries, "torch-memory-saver 0.0.10 (a test dependency) ships its hook libraries"
    return libraries


def test_real_tms_0_0_10_libraries_have_disk_backup():
    assert importlib.metadata.version("torch_memory_saver") == "0.0.10"
    for library in _real_tms_libraries():
        check_disk_backup_support(library)


def test_a_library_without_the_backend_is_refused(tmp_path):
    # A real shared library that is not a disk-backup build.
    other = tmp_path / "torch_memory_saver_hook_mode_preload.abi3.so"
    shutil.copy(shutil.which("ls"), other)
    with pytest.raises(TorchMemorySaverError, match="built without the disk-backup backend"):
        check_disk_backup_support(str(other))


def test_the_marker_is_found_across_read_chunks(tmp_path):
    from miles_plugins.optimizers import tms

    lib = tmp_path / "torch_memory_saver_x.so"
    lib.write_bytes(b"\0" * (tms._CHUNK - 5) + tms.DISK_BACKUP_MARKER + b"\0" * 10)
    check_disk_backup_support(str(lib))


def test_ld_preload_is_checked_and_must_name_tms(tmp_path):
    preload = _real_tms_libraries()[0]
    assert check_preloaded_tms(f"/usr/lib/libjemalloc.so {preload}") == [preload]
    with pytest.raises(TorchMemorySaverError, match="LD_PRELOAD names no torch_memory_saver"):
        check_preloaded_tms("/usr/lib/libjemalloc.so")
    with pytest.raises(TorchMemorySaverError, match="does not exist"):
        check_preloaded_tms(str(tmp_path / "torch_memory_saver_gone.so"))
