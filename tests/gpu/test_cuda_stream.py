"""GPU tier for the store engine: CUDA tensors through the pinned staging buffer, bit for bit."""

import functools
import os

import pytest
import torch

from bench.harness import mem_available
from tests.helpers import BF16_MAIN_TOLERANCE, STEPS, streamed_run
from tests.unit.reference import assert_same_training, reference_run, same_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic_cuda")]


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW], ids=["Adam", "AdamW"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_streamed_state_is_byte_identical_to_resident(tmp_path, opt_cls, dtype):
    control_params, _ = reference_run(opt_cls, dtype, STEPS, device="cuda")
    ref_params, ref_state = reference_run(opt_cls, dtype, STEPS, device="cuda")
    assert all(same_bytes(a, b) for a, b in zip(control_params, ref_params, strict=True)), "control run differs"
    params, state, streamed = streamed_run(opt_cls, dtype, STEPS, tmp_path, device="cuda")
    assert streamed.store._engine.idle_buffer().tensor.is_pinned()
    assert_same_training((ref_params, ref_state), (params, state))
    streamed.close()


@pytest.mark.parametrize(
    "tier, engine, main_storage, moment_dtype",
    [
        ("disk", "pipelined", "remainder", "fp32"),
        ("disk", "sync", "remainder", "fp32"),
        ("host", "pipelined", "fp32", "fp32"),
        ("host", "pipelined", "remainder", "fp32"),
        ("disk", "pipelined", "fp32", "bf16"),
    ],
)
def test_cuda_every_tier_and_engine(tmp_path, tier, engine, main_storage, moment_dtype):
    """Reader/writer threads on their own CUDA streams (disk), copies queued on the
    engine's copy streams (pinned host buffers), remainder mains decoded on the
    device: fp32 storage stays byte-identical; bf16 moments
    (a storage format) keep the params within BF16_MAIN_TOLERANCE (absolute, the
    CPU tier's stated bound: test_moment_dtypes.py) of the fp32-moment run."""
    ref_params, ref_state = reference_run(torch.optim.AdamW, torch.bfloat16, STEPS, device="cuda")
    params, state, streamed = streamed_run(
        torch.optim.AdamW,
        torch.bfloat16,
        STEPS,
        tmp_path,
        device="cuda",
        tier=tier,
        engine=engine,
        main_storage=main_storage,
        moment_dtype=moment_dtype,
    )
    if moment_dtype == "fp32":
        assert_same_training((ref_params, ref_state), (params, state))
    else:
        errors = [(a.float() - b.float()).abs().max().item() for a, b in zip(ref_params, params, strict=True)]
        assert 0 < max(errors) <= BF16_MAIN_TOLERANCE, errors
    streamed.close()


def test_pinned_host_copies_are_queued_on_copy_streams_and_keep_their_timeout(tmp_path):
    """The host home's pinned buffers: inside a step the pipelined engine queues their
    copies whole on its copy streams (no thread gets a request); the overlap
    window's copies, which run during forward and backward, go through the one
    window thread of their direction, in requests of ``WINDOW_REQUEST_BYTES``;
    the steps stay byte-identical either way. A ticket whose copies wait
    behind busy device work times out as a hung drive's would, then completes once
    that work is done."""
    from miles_plugins.optimizers.errors import StreamIOTimeout
    from miles_plugins.optimizers.homes.backings import BufferHandle
    from miles_plugins.optimizers.homes.engines import WINDOW_REQUEST_BYTES, PipelinedEngine
    from miles_plugins.optimizers.homes.host_memory import HostMemory

    submit = PipelinedEngine._submit
    reference = reference_run(torch.optim.AdamW, torch.bfloat16, STEPS, device="cuda")
    for window in (0, 40_000):  # none, and about two buckets: their writes land after the step
        submitted = []

        def counting_submit(self, pool, handle, *args, submitted=submitted):
            assert pool in self._window_threads and args[-1] == WINDOW_REQUEST_BYTES, handle.read_path
            submitted.append(handle.read_path)
            return submit(self, pool, handle, *args)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(PipelinedEngine, "_submit", counting_submit)
            params, state, streamed = streamed_run(
                torch.optim.AdamW,
                torch.bfloat16,
                STEPS,
                tmp_path / str(window),
                device="cuda",
                tier="host",
                overlap_bytes=window,
            )
        deferred = {f"<host memory of bucket {i}>" for i in streamed.store._window.deferred()}
        if window:
            assert deferred and set(submitted) == deferred, (sorted(set(submitted)), sorted(deferred))
        else:
            assert submitted == [], f"{len(submitted)} in-step host-memory requests went through threads"
        assert_same_training(reference, (params, state))
        streamed.close()

    engine = PipelinedEngine(threads=1, chunk_bytes=1 << 20, pin=True, device=torch.device("cuda"), timeout_s=5.0)
    memory = HostMemory(64 << 20, pin=True)
    memory.tensor.fill_(7)
    dst = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(2_000_000_000)  # about a second of device time on the caller's stream
    ready = torch.cuda.Event()
    ready.record()
    ticket = engine.read(BufferHandle(memory.tensor, "<pinned>", dma=True), [(0, dst)], ready)
    assert not ticket.done()
    with pytest.raises(StreamIOTimeout):
        ticket.wait(0.05)
    ticket.wait()
    assert ticket.done() and bool((dst == 7).all())
    engine.close()
    memory.release()


def test_fused_adam_steps_read_no_device_scalar_to_the_host(tmp_path, monkeypatch):
    """fused=True keeps each param's step count on the device: a streamed step must
    never read one back (``.item()`` on a CUDA tensor is a device synchronization;
    the rollback snapshot did it for every param of every bucket, every step)."""
    reads = []
    item = torch.Tensor.item

    def counting_item(self):
        if self.device.type == "cuda":
            reads.append(tuple(self.shape))
        return item(self)

    opt_cls = functools.partial(torch.optim.AdamW, fused=True)
    ref_params, ref_state = reference_run(opt_cls, torch.bfloat16, STEPS, device="cuda")
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    params, state, streamed = streamed_run(opt_cls, torch.bfloat16, STEPS, tmp_path, device="cuda")
    monkeypatch.undo()
    assert streamed.store._bucket_optimizers[0].optimizer.defaults["fused"] is True
    assert reads == [], f"{len(reads)} device scalars read back during {STEPS} steps"
    assert_same_training((ref_params, ref_state), (params, state))
    streamed.close()


@pytest.mark.parametrize("setting", ["fused", "capturable"])
def test_a_checkpoint_of_plain_adamw_resumes_under_fused_or_capturable(tmp_path, setting):
    """Plain AdamW keeps its step counts on the host, fused and capturable ones on
    the device: a load must place them as the live group needs (a step after the
    load used to fail: 'state_steps is on cpu')."""
    from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
    from tests.unit.reference import Net, groups, loss_fn

    def run(opt_cls, steps, load=None, save=None):
        model = Net(torch.bfloat16).to("cuda")
        optimizer = opt_cls(groups(model))
        config = StreamConfig(directory=str(tmp_path / "scratch"), bucket_cap_elements=1500)
        with StreamedOptimizer(optimizer, config) as streamed:
            if load:
                assert streamed.load_from(load)
            for step in steps:
                loss_fn(model, step).backward()
                optimizer.step()
                optimizer.zero_grad()
            if save:
                streamed.save_to(save)

    run(torch.optim.AdamW, range(3), save=str(tmp_path / "ckpt"))
    run(functools.partial(torch.optim.AdamW, **{setting: True}), range(3, 5), load=str(tmp_path / "ckpt"))


def test_forked_children_do_not_copy_a_pinned_host_home():
    """Megatron's DataLoader forks its workers after the optimizer is built: a pinned
    private mapping would be copied into each (16 GiB, two forks: 16.2 GiB measured
    before MADV_DONTFORK). MemAvailable is read while both children are alive."""
    from miles_plugins.optimizers.homes.host_memory import HostMemory

    size = 16 << 30
    memory = HostMemory(size, pin=True)
    memory.tensor[:: 1 << 20].fill_(1)  # every page of the home is pinned (registered) already; touch some anyway
    before = mem_available()
    reads, writes = os.pipe()
    children = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            os.read(reads, 1)  # both children alive before either exits
            os._exit(0)
        children.append(pid)
    during = mem_available()
    os.write(writes, b"xx")
    for pid in children:
        os.waitpid(pid, 0)
    memory.release()
    # A copy would take 2 x 16 GiB; a child's own pages are far below a GiB.
    assert before - during < (1 << 30), f"MemAvailable fell {(before - during) / 2**30:.1f} GiB across two forks"
