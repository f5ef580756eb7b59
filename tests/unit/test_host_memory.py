"""Host memory the store holds (homes, staging, offloaded device buckets) stays out of forked children.

Linux copies a private mapping's DMA-pinned pages into a child at fork time; the pinning
needs CUDA, so here the mapping's flag and a real fork show the exclusion, and the GPU tier
(tests/gpu/test_cuda_stream.py) measures MemAvailable across forks of a pinned 16 GiB home.
"""

import os
import sys

import pytest

from miles_plugins.optimizers.homes.host_memory import HostMemory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK is Linux's")


def _mapping_flags(address: int) -> list[str] | None:
    """The VmFlags of the mapping of this process that holds ``address``, or None if none does."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


def test_host_memory_is_marked_dont_fork():
    memory = HostMemory(1 << 20, pin=False)
    flags = _mapping_flags(memory.tensor.data_ptr())
    assert flags is not None and "dc" in flags, flags


def test_a_forked_child_does_not_get_the_host_memory():
    memory = HostMemory(4 << 20, pin=False)
    memory.tensor.fill_(7)
    address = memory.tensor.data_ptr()
    pid = os.fork()
    if pid == 0:  # the child: the mapping must not exist here at all
        os._exit(0 if _mapping_flags(address) is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child holds the parent's host memory"
    assert int(memory.tensor[-1]) == 7  # the parent's memory is untouched
