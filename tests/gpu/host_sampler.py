"""The host's available memory, watched while something runs: the GPU tier's and
the benches' check that streaming's host memory stays where it is stated."""

from __future__ import annotations

import threading


def mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes."""
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


class HostSampler:
    """``MemAvailable`` when entered and every ``interval_s`` until left (``samples``)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.samples: list[int] = []
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.samples.append(mem_available())

    def __enter__(self) -> HostSampler:
        self.samples.append(mem_available())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
