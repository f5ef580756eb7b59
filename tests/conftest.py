import os
import shutil
import subprocess

import pytest
import torch

# Rows of the fault report (`make faults`): one per fault scenario that passed.
FAULT_ROWS = pytest.StashKey[list]()


def pytest_addoption(parser):
    parser.addoption("--fault-report", action="store_true", help="print the fault scenarios' table at the end")


def pytest_configure(config):
    config.stash[FAULT_ROWS] = []


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU tier: needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def deterministic_cuda():
    """Deterministic kernels for a CUDA test that compares bytes (cuBLAS needs the workspace setting)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def fault_report(request):
    """``fault_report(scenario, expected, observed, data_lost)``: a row of the fault
    report. Call it last in the test, so only a scenario that held is reported."""

    tmp = str(request.getfixturevalue("tmp_path")) if "tmp_path" in request.fixturenames else None

    def record(scenario: str, expected: str, observed: str, data_lost: str) -> None:
        rows = request.config.stash[FAULT_ROWS]
        # Each row names one scenario: two of one name read as one scenario printed twice.
        assert scenario not in (row[0] for row in rows), f"fault scenario {scenario!r} reported twice"
        if tmp:
            observed = observed.replace(tmp, "<tmp>")
        rows.append((scenario, expected, observed, data_lost))

    return record


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not config.getoption("--fault-report"):
        return
    rows = config.stash[FAULT_ROWS]
    failed = [r.nodeid for r in terminalreporter.stats.get("failed", [])]
    write = terminalreporter.write_line
    write("")
    write("| scenario | expected | observed | data lost |")
    write("|---|---|---|---|")
    for row in rows:
        write("| " + " | ".join(cell.replace("|", "/").replace("\n", " ") for cell in row) + " |")
    for nodeid in failed:
        write(f"| FAILED: {nodeid} | | | |")


@pytest.fixture
def small_drives(tmp_path, monkeypatch):
    """``make(name, nbytes)``: a directory on a filesystem of ``nbytes`` of its own: a
    tmpfs where this process may mount one (root); elsewhere a drive modelled where
    the store measures it (``shutil.disk_usage``: ``nbytes`` less the sizes of the
    real files under it)."""
    mounted, modelled = [], {}
    measure = shutil.disk_usage

    def modelled_usage(path):
        real = os.path.realpath(path)
        for drive, nbytes in modelled.items():
            if os.path.commonpath([real, drive]) == drive:
                used = sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(drive) for f in files)
                return measure(path)._replace(total=nbytes, used=used, free=nbytes - used)
        return measure(path)

    def make(name: str, nbytes: int):
        path = tmp_path / name
        path.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(path)]
        if os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0:
            mounted.append(path)
        else:
            modelled[os.path.realpath(path)] = nbytes
            monkeypatch.setattr(shutil, "disk_usage", modelled_usage)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", "--lazy", str(path)], check=True)  # a failed test may hold files open
