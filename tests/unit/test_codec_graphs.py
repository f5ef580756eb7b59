"""When the codec's CUDA graphs capture, replay and run eagerly (``step/graphs.py``).

This machine has no CUDA: the capture and the device context are stand-ins here, and
only the policy is tested (which call runs how). The GPU tier captures for real and
compares the bytes (``tests/gpu/test_fused_codec.py``)."""

import contextlib

import pytest
import torch

from miles_plugins.optimizers.step import graphs


class _Graph:
    """Stands in for a captured CUDA graph: replaying it runs what it captured."""

    def __init__(self, convert):
        self.convert = convert

    def replay(self):
        self.convert()


@pytest.fixture(autouse=True)
def _no_failure_yet(monkeypatch):
    monkeypatch.setattr(graphs, "failed", None)


@pytest.fixture
def bucket_graphs(monkeypatch):
    monkeypatch.setattr(graphs, "enabled", True)
    monkeypatch.setattr(graphs, "on_device", lambda device: contextlib.nullcontext())
    cache = graphs.BucketGraphs()
    monkeypatch.setattr(cache, "_capture", lambda device, convert: _Graph(convert))
    return cache


def test_a_bucket_is_captured_when_its_addresses_repeat_and_replayed_while_they_stay(bucket_graphs):
    ran = []
    keys = ["a", "a", "a", "b", "a", "b", "b", "b"]
    for key in keys:
        bucket_graphs.run(("decode", 0), key, "cuda", lambda key=key: ran.append(key))
    # Eager, captured (then replayed), replayed; b eager; a replayed (its graph is kept);
    # b seen twice in a row: captured in a's place; replayed.
    assert ran == keys  # every call converted once, whichever way
    assert bucket_graphs.captures == 2
    assert bucket_graphs.replays == 6
    assert bucket_graphs.eager == 2  # what a step's StepStats counts, with the replays


def test_slots_are_kept_apart(bucket_graphs):
    for _ in range(2):
        bucket_graphs.run(("decode", 0), "a", "cuda", lambda: None)
        bucket_graphs.run(("encode", 0), "a", "cuda", lambda: None)
        bucket_graphs.run(("decode", 1), "a", "cuda", lambda: None)
    assert bucket_graphs.captures == 3 and bucket_graphs.replays == 3


class _Capturing:
    """Stands in for torch's CUDA graph and allocator calls: records the clean-up."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.capturing = False
        monkeypatch.setattr(graphs, "on_device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(graphs.torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(graphs.torch.cuda, "Stream", lambda device: "stream")
        self.pools = 0
        monkeypatch.setattr(graphs.torch.cuda, "graph_pool_handle", self._pool)
        monkeypatch.setattr(graphs.torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(graphs.torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        monkeypatch.setattr(graphs.torch.cuda, "CUDAGraph", lambda: self)
        monkeypatch.setattr(
            graphs.torch.cuda.memory,
            "_cuda_endAllocateToPool",
            lambda index, pool: self.calls.append(("end routing", index, pool)),
            raising=False,
        )

    def _pool(self):
        self.pools += 1
        return "pool"

    def capture_begin(self, pool, capture_error_mode):
        self.calls.append(("begin", pool, capture_error_mode))
        self.capturing = True

    def capture_end(self):
        self.calls.append("end")
        self.capturing = False
        raise RuntimeError("operation failed due to a previous error during capture")


class _Device:
    index = 0


def test_a_failed_capture_is_cleaned_up_and_raises_naming_the_switch(monkeypatch):
    monkeypatch.setattr(graphs, "enabled", True)
    torch_calls = _Capturing(monkeypatch)
    cache, ran = graphs.BucketGraphs(), []

    def convert():
        ran.append(torch_calls.capturing)
        if torch_calls.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")

    cache.run(("encode", 0), "a", _Device(), convert)
    with pytest.raises(RuntimeError, match="MILES_CODEC_GRAPHS=0") as raised:
        cache.run(("encode", 0), "a", _Device(), convert)
    assert "operation not permitted" in str(raised.value)
    assert ran == [False, True]  # eager, then the capture (which ran nothing on the device)
    assert torch_calls.calls == [("begin", "pool", "thread_local"), "end", ("end routing", 0, "pool")]
    assert cache.captures == 0 and cache.replays == 0
    # From then on every conversion of the process refuses, eager or not, another codec's too.
    with pytest.raises(RuntimeError, match="not converting: .*MILES_CODEC_GRAPHS=0"):
        graphs.BucketGraphs().run(("decode", 3), "b", _Device(), convert)
    assert ran == [False, True]


def test_an_interrupt_during_a_capture_ends_it_and_is_raised(monkeypatch):
    monkeypatch.setattr(graphs, "enabled", True)
    torch_calls = _Capturing(monkeypatch)

    def clean_end():  # a capture that ends cleanly
        torch_calls.calls.append("end")
        torch_calls.capturing = False

    torch_calls.capture_end = clean_end
    cache = graphs.BucketGraphs()

    def convert():
        if torch_calls.capturing:
            raise KeyboardInterrupt

    cache.run(("decode", 1), "a", _Device(), convert)
    with pytest.raises(KeyboardInterrupt):
        cache.run(("decode", 1), "a", _Device(), convert)
    assert torch_calls.calls == [("begin", "pool", "thread_local"), "end", ("end routing", 0, "pool")]
    assert graphs.enabled and graphs.failed is None  # not a failure of the graphs: the next step may capture


def test_a_new_pool_once_the_codec_holds_no_graph(monkeypatch):
    """torch refuses to capture into a pool whose last graph is gone (found on the GPU)."""
    monkeypatch.setattr(graphs, "enabled", True)
    torch_calls = _Capturing(monkeypatch)
    torch_calls.capture_end = lambda: setattr(torch_calls, "capturing", False)
    cache = graphs.BucketGraphs()
    torch_calls.replay = lambda: None
    for slot in (("decode", 0), ("decode", 0), ("encode", 0), ("encode", 0)):
        cache.run(slot, "a", _Device(), lambda: None)
    assert cache.captures == 2 and torch_calls.pools == 1  # the second capture shares the first's pool
    cache.release()
    for _ in range(2):
        cache.run(("decode", 0), "a", _Device(), lambda: None)
    assert cache.captures == 3 and torch_calls.pools == 2


def test_the_switch_off_stops_held_graphs_too(bucket_graphs, monkeypatch):
    ran = []
    for _ in range(3):
        bucket_graphs.run(("decode", 0), "a", "cuda", lambda: ran.append("eager or replayed"))
    monkeypatch.setattr(graphs, "enabled", False)
    bucket_graphs.run(("decode", 0), "a", "cuda", lambda: ran.append("eager"))
    assert bucket_graphs.replays == 2 and ran[-1] == "eager" and bucket_graphs.eager == 2


def test_release_drops_the_graphs(bucket_graphs):
    for _ in range(3):
        bucket_graphs.run(("decode", 0), "a", "cuda", lambda: None)
    bucket_graphs.release()
    bucket_graphs.run(("decode", 0), "a", "cuda", lambda: None)  # eager: seen anew
    assert bucket_graphs.captures == 1 and bucket_graphs.replays == 2


@pytest.mark.parametrize(
    "moment_dtype, main_dtype, self_tested",
    [(torch.float32, torch.float32, False), (torch.bfloat16, torch.float32, True), (torch.float32, torch.int16, True)],
    ids=["fp32", "bf16 moments", "remainder mains"],
)
def test_the_kernels_are_self_tested_at_setup_not_in_the_first_step(monkeypatch, moment_dtype, main_dtype, self_tested):
    """A codec whose buckets convert builds and self-tests the fused kernels on its CUDA
    device when it is made: inside the first step the self-test's inputs would add to
    that step's device memory, past its stated bound. Fake: the CUDA device (a
    ``torch.device`` only; the registry is replaced)."""
    from miles_plugins.optimizers.formats import kernels
    from miles_plugins.optimizers.formats.layout import layout_bucket
    from miles_plugins.optimizers.step.codec import Codec

    asked = []
    monkeypatch.setattr(kernels, "for_device", asked.append)
    buckets = [layout_bucket(0, [0], [1000], moment_dtype, main_dtype, False, True)]
    Codec(buckets, torch.device("cpu"))
    assert asked == []
    Codec(buckets, torch.device("cuda", 0))
    assert asked == ([torch.device("cuda", 0)] if self_tested else [])
