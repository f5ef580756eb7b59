"""The homes' declared contracts hold: every concrete engine, backing, handle and
ticket satisfies its Protocol (``homes/protocols.py``), method for method with the
same parameters and defaults, and real instances pass ``isinstance``; the store
satisfies what the auto GPU budget needs of it; the purge command imports no torch.

Real objects on the CPU throughout (host memory unpinned, files in a temp directory)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
from miles_plugins.optimizers.formats.layout import BucketLayout
from miles_plugins.optimizers.homes.auto_budget import BudgetedStore, DeviceMemory
from miles_plugins.optimizers.homes.backings import BufferHandle, FileBacking, FileHandle, HostBacking
from miles_plugins.optimizers.homes.device_backing import DeviceBacking
from miles_plugins.optimizers.homes.engines import PipelinedEngine, SyncEngine
from miles_plugins.optimizers.homes.memory_probes import CudaMemory
from miles_plugins.optimizers.homes.placed_backing import PlacedBacking
from miles_plugins.optimizers.homes.protocols import Backing, DmaHandle, Engine, Handle, PendingTransfers
from miles_plugins.optimizers.homes.transfer_batch import TransferBatch
from miles_plugins.optimizers.store.streaming_store import StreamingStore

REPO = Path(__file__).resolve().parents[2]

CONTRACTS = [
    (Handle, FileHandle),
    (Handle, BufferHandle),
    (DmaHandle, BufferHandle),
    (Backing, FileBacking),
    (Backing, HostBacking),
    (Backing, DeviceBacking),
    (Backing, PlacedBacking),
    (Engine, SyncEngine),
    (Engine, PipelinedEngine),
    (PendingTransfers, TransferBatch),
    (DeviceMemory, CudaMemory),
    (BudgetedStore, StreamingStore),
]


def _methods(protocol: type) -> dict[str, object]:
    """A protocol's methods and properties (name -> its declaration), its base protocols'
    included. Its data members are checked on instances (``isinstance``)."""
    methods: dict[str, object] = {}
    for cls in reversed(protocol.__mro__):
        if getattr(cls, "_is_protocol", False) and cls.__module__ != "typing":
            public = {name: value for name, value in vars(cls).items() if not name.startswith("_")}
            methods.update({name: v for name, v in public.items() if callable(v) or isinstance(v, property)})
    return methods


def _parameters(function) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter: what a caller relies on (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize(
    "protocol, cls", CONTRACTS, ids=[f"{cls.__name__}-is-{protocol.__name__}" for protocol, cls in CONTRACTS]
)
def test_each_class_has_its_protocol_s_methods_with_the_same_parameters(protocol, cls):
    methods = _methods(protocol)
    assert methods, f"{protocol.__name__} declares no methods"
    for name, declared in methods.items():
        implemented = inspect.getattr_static(cls, name, None)
        if isinstance(declared, property):
            assert isinstance(implemented, property), f"{cls.__name__}.{name} is not a property"
            continue
        assert callable(implemented), f"{cls.__name__} has no method {name}"
        assert _parameters(implemented) == _parameters(declared), (
            f"{cls.__name__}.{name} differs from {protocol.__name__}"
        )


def _bucket(index: int, size: int) -> BucketLayout:
    return BucketLayout(
        index=index, entry_indices=(), numels=(), segments={}, file_name=f"b{index}.bin", file_size=size
    )


def test_real_instances_pass_isinstance_for_their_protocols(tmp_path):
    bucket = _bucket(0, 8192)
    files = FileBacking(str(tmp_path), [bucket], direct=False)
    host = HostBacking([bucket], pin=False)
    device = DeviceBacking([bucket], torch.device("cpu"))
    placed = PlacedBacking([bucket], ["host"], lambda key, mine: HostBacking(mine, pin=False))
    sync = SyncEngine(4096, pin=False)
    pipelined = PipelinedEngine(threads=1, chunk_bytes=4096, pin=False, device=torch.device("cpu"), timeout_s=5.0)
    handles = [files.open(bucket), host.open(bucket), device.open(bucket), placed.open(bucket)]
    try:
        for backing in (files, host, device, placed):
            assert isinstance(backing, Backing), type(backing).__name__
        for handle in handles:
            assert isinstance(handle, Handle), type(handle).__name__
        assert isinstance(host.open(bucket), DmaHandle) and not isinstance(handles[0], DmaHandle)
        for engine in (sync, pipelined):
            assert isinstance(engine, Engine), type(engine).__name__
            ticket = engine.read(handles[1], [(0, torch.empty(4096, dtype=torch.uint8))])
            assert isinstance(ticket, PendingTransfers) and isinstance(ticket, TransferBatch)
            ticket.wait()
            assert ticket.done()
    finally:
        for handle in handles:
            handle.close()
        for engine in (sync, pipelined):
            engine.close()
        for backing in (files, host, device, placed):
            backing.release()


def test_a_store_is_what_the_auto_gpu_budget_serves(tmp_path):
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    streamed = StreamedOptimizer(torch.optim.AdamW(model.parameters()), StreamConfig(directory=str(tmp_path)))
    try:
        assert isinstance(streamed.store, BudgetedStore)
    finally:
        streamed.close()


def test_the_purge_command_imports_no_torch(tmp_path):
    """Job epilogs run it where importing torch is slow or impossible: a ``torch`` that
    refuses to import sits first on the path, and the command still runs."""
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the purge command imported torch')\n")
    (tmp_path / "state").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "miles_plugins.optimizers.scratch", "purge", str(tmp_path / "state")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'shadow'}{os.pathsep}{REPO}"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "nothing to purge" in result.stdout
