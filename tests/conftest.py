import os
import shutil
import subprocess

import pytest
import torch

# A fault scenario's row of the report (`make faults`) travels with its test's report, as
# this user property, to where results are gathered: this process, or xdist's controller.
FAULT_ROW = "fault report row"


def pytest_addoption(parser):
    parser.addoption("--fault-report", action="store_true", help="print the fault scenarios' table at the end")


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        # An xdist worker (`make test` runs one per core): one thread for torch here and in
        # the processes its tests start, so that workers do not contend for the cores.
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    else:
        config.pluginmanager.register(FaultReport(), "fault-report")


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
    report. Call it last in the test: a row is reported only if its test passes."""

    tmp = str(request.getfixturevalue("tmp_path")) if "tmp_path" in request.fixturenames else None

    def record(scenario: str, expected: str, observed: str, data_lost: str) -> None:
        if tmp:
            observed = observed.replace(tmp, "<tmp>")
        order = request.session.items.index(request.node)  # the table follows the tests' order
        request.node.user_properties.append((FAULT_ROW, [order, scenario, expected, observed, data_lost]))

    return record


class FaultReport:
    """Gathers the rows of the fault scenarios that passed and, with ``--fault-report``,
    prints their table. A scenario reported by two tests fails the later one: each row
    names one scenario, and two of one name would read as one scenario printed twice."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[int, list[str]]] = {}  # scenario -> (order, row)
        self.reported_by: dict[str, str] = {}

    @pytest.hookimpl(tryfirst=True)  # before the terminal counts the report
    def pytest_runtest_logreport(self, report):
        if report.when != "call" or not report.passed:
            return
        for name, (order, scenario, *cells) in report.user_properties:
            if name != FAULT_ROW:
                continue
            if scenario in self.rows:
                report.outcome = "failed"
                report.longrepr = f"fault scenario {scenario!r} reported twice: also by {self.reported_by[scenario]}"
                return
            self.rows[scenario] = (order, [scenario, *cells])
            self.reported_by[scenario] = report.nodeid

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        if not config.getoption("--fault-report"):
            return
        failed = [r.nodeid for r in terminalreporter.stats.get("failed", [])]
        write = terminalreporter.write_line
        write("")
        write("| scenario | expected | observed | data lost |")
        write("|---|---|---|---|")
        for _, row in sorted(self.rows.values(), key=lambda order_and_row: order_and_row[0]):
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
