"""The streamed state's background saves inside Megatron's --async-save, driven
through megatron-core's own AsyncCallsQueue and AsyncRequest, as its training loop
drives them: the finalize before rank 0's tracker never stops training (a
non-blocking finalize defers the tracker to a later step), a blocking one waits,
a failed save never lets the tracker mark the checkpoint, and rank 0 marks it only
once every rank's streamed state is saved.

Fakes, where the real thing cannot run here: a gloo group of one stands for the
job (megatron-core's queue all-reduces on ``torch.cuda.current_device()``, made the
CPU here), and a second rank is simulated by the marker file it would write.
"""

import threading
import types

import pytest
import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

from megatron_hooks import async_finalize
from megatron_hooks import checkpoint as hooks
from megatron_hooks.async_finalize import FinishStreamedSaves, StreamedSaveError
from miles_plugins.optimizers.checkpoint import writer
from miles_plugins.optimizers.checkpoint.manifest import MANIFEST_NAME
from miles_plugins.optimizers.errors import StreamIOError
from tests.helpers import streamed


@pytest.fixture(autouse=True)
def job(tmp_path, monkeypatch):
    """A gloo group of one; nothing may stay deferred after a test."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()
    left = list(async_finalize._deferred)
    async_finalize._deferred.clear()  # not to be run by the tests after this one
    assert not left, "a test left finalize functions deferred"


class Checkpoint:
    """What Megatron's save_checkpoint does with --async-save, in its order: its request
    (its own part: nothing to write here), the hook, rank 0's tracker finalize after;
    then the request is scheduled on the queue."""

    def __init__(self, queue, holder, tmp_path, iteration: int, done: list) -> None:
        name = str(tmp_path / "ckpt" / f"iter_{iteration:07d}")
        self.state_dir = tmp_path / "ckpt" / f"iter_{iteration:07d}" / hooks.STATE_DIRNAME
        request = AsyncRequest(async_fn=None, async_fn_args=(), finalize_fns=[lambda: done.append("megatron")])
        hooks.save(types.SimpleNamespace(no_save_optim=False), holder, name, "GLOBAL", request)
        self.finish = request.finalize_fns[-1]
        assert isinstance(self.finish, FinishStreamedSaves)
        # The tracker says whether the streamed state was complete when it was written.
        manifest = self.state_dir / "rank0" / MANIFEST_NAME
        request.add_finalize_fn(lambda: done.append((f"tracker {iteration}", manifest.exists())))
        self.request = request
        if queue is not None:
            queue.schedule_async_request(request)

    def wait_saved(self) -> None:
        for save in self.finish.pending:
            save.wait()


def hold_publish(monkeypatch, fail: bool = False) -> threading.Event:
    """The background save's publish waits until the returned event is set (every bucket
    exported already: steps run freely meanwhile); with ``fail``, it then fails."""
    release, real = threading.Event(), writer.replace_dir

    def replace_dir(new, final):
        assert release.wait(60)
        if fail:
            raise StreamIOError(f"cannot rename {new} to {final}: Input/output error", final, 0, 5)
        return real(new, final)

    monkeypatch.setattr(writer, "replace_dir", replace_dir)
    return release


def step(param, front) -> None:
    param.grad = torch.randn_like(param)
    front.step()


def test_a_non_blocking_finalize_lets_training_go_on_and_the_tracker_waits_for_the_streamed_state(
    tmp_path, monkeypatch
):
    param, front, holder = streamed(tmp_path, "rank0", 0)
    release = hold_publish(monkeypatch)
    queue, done = AsyncCallsQueue(), []
    ckpt = Checkpoint(queue, holder, tmp_path, 1, done)
    queue.maybe_finalize_async_calls(blocking=False)  # the training loop's, each iteration
    assert queue.get_num_unfinalized_calls() == 0, "Megatron's own part is finalized"
    assert done == ["megatron"], "the tracker waits for the streamed state"
    for _ in range(2):
        step(param, front)  # training goes on while the streamed state is written
    assert done == ["megatron"]
    release.set()
    ckpt.wait_saved()
    step(param, front)  # the first step after the save finds it complete
    assert done == ["megatron", ("tracker 1", True)]
    assert (ckpt.state_dir / ".rank00000.saved").exists()
    front.close()
    # The checkpoint holds the state of the step it was taken at, not of the steps after.
    param2, again, holder2 = streamed(tmp_path / "again", "rank0", 0)
    assert again.store.load_from(str(ckpt.state_dir)) and again.store.steps_taken == 1
    again.close()


@pytest.mark.parametrize("caller", ["maybe_finalize_async_calls(blocking=True)", "AsyncRequest.execute_sync"])
def test_a_blocking_finalize_waits_for_the_streamed_state(tmp_path, caller):
    """miles' save_model and the end of Megatron's training finalize blocking; the
    synchronous fallback runs the finalize functions from execute_sync: both wait."""
    param, front, holder = streamed(tmp_path, "rank0", 0)
    done = []
    if caller == "AsyncRequest.execute_sync":
        Checkpoint(None, holder, tmp_path, 1, done).request.execute_sync()
    else:
        queue = AsyncCallsQueue()
        Checkpoint(queue, holder, tmp_path, 1, done)
        queue.maybe_finalize_async_calls(blocking=True)
    assert done == ["megatron", ("tracker 1", True)]
    front.close()


@pytest.mark.parametrize("blocking", [True, False])
def test_a_failed_background_save_never_lets_the_tracker_mark_the_checkpoint(tmp_path, monkeypatch, blocking):
    param, front, holder = streamed(tmp_path, "rank0", 0)
    release = hold_publish(monkeypatch, fail=True)
    queue, done = AsyncCallsQueue(), []
    ckpt = Checkpoint(queue, holder, tmp_path, 1, done)
    if blocking:
        release.set()
        with pytest.raises(StreamedSaveError) as failed:
            queue.maybe_finalize_async_calls(blocking=True)
    else:
        queue.maybe_finalize_async_calls(blocking=False)
        release.set()
        with pytest.raises(StreamIOError):
            ckpt.wait_saved()
        with pytest.raises(StreamedSaveError) as failed:
            step(param, front)  # the step after: the failure is raised there, once
        step(param, front)  # and training may go on (from the previous checkpoint's point of view)
    assert "was not saved (rank 0: cannot rename" in str(failed.value)
    assert "the checkpoint is not marked complete" in str(failed.value) and "\n" not in str(failed.value)
    assert done == ["megatron"], "the tracker must not be written"
    assert (ckpt.state_dir / ".rank00000.failed").exists()
    front.close()


@pytest.mark.parametrize("other_rank", ["saved", "failed"])
def test_rank_0_marks_the_checkpoint_only_once_every_rank_has_saved(tmp_path, monkeypatch, other_rank):
    """A job of two ranks, rank 1 simulated by the marker its finalize writes."""
    monkeypatch.setattr(hooks, "_rank_and_world_size", lambda: (0, 2))
    param, front, holder = streamed(tmp_path, "rank0", 0)
    queue, done = AsyncCallsQueue(), []
    ckpt = Checkpoint(queue, holder, tmp_path, 1, done)
    queue.maybe_finalize_async_calls(blocking=False)
    ckpt.wait_saved()
    step(param, front)
    assert done == ["megatron"], "rank 1's streamed state is not saved yet"
    assert (ckpt.state_dir / ".rank00000.saved").exists()
    (ckpt.state_dir / f".rank00001.{other_rank}").write_text("pid 1\n")
    if other_rank == "saved":
        step(param, front)
        assert done == ["megatron", ("tracker 1", True)]
    else:
        with pytest.raises(StreamedSaveError, match=r"was not saved on rank\(s\) 1: the checkpoint is not marked"):
            step(param, front)
        assert done == ["megatron"]
    front.close()


@pytest.mark.parametrize("until", ["the next save", "exit"])
def test_a_deferred_tracker_is_written_at_the_next_save_before_its_own_or_at_exit(tmp_path, monkeypatch, until):
    param, front, holder = streamed(tmp_path, "rank0", 0)
    release = hold_publish(monkeypatch)
    queue, done = AsyncCallsQueue(), []
    Checkpoint(queue, holder, tmp_path, 1, done)
    queue.maybe_finalize_async_calls(blocking=False)
    assert done == ["megatron"]
    release.set()
    if until == "exit":
        async_finalize._finish_at_exit()  # what atexit runs once the save threads are joined
        assert done == ["megatron", ("tracker 1", True)]
    else:
        step(param, front)
        Checkpoint(queue, holder, tmp_path, 2, done)  # its hook waits for the earlier checkpoint's first
        assert done[:2] == ["megatron", ("tracker 1", True)]
        queue.maybe_finalize_async_calls(blocking=True)
        assert done == ["megatron", ("tracker 1", True), "megatron", ("tracker 2", True)]
    front.close()


def test_saving_an_iteration_again_does_not_take_an_earlier_saves_markers(tmp_path, monkeypatch):
    """A restart from an earlier checkpoint saves the same iteration again: the markers
    of the first save must not tell rank 0 this one is complete."""
    monkeypatch.setattr(hooks, "_rank_and_world_size", lambda: (0, 2))
    param, front, holder = streamed(tmp_path, "rank0", 0)
    queue, done = AsyncCallsQueue(), []
    first = Checkpoint(queue, holder, tmp_path, 1, done)
    (first.state_dir / ".rank00001.saved").write_text("pid 1\n")
    queue.maybe_finalize_async_calls(blocking=True)
    assert done == ["megatron", ("tracker 1", True)]
    release = hold_publish(monkeypatch)
    done.clear()
    monkeypatch.setattr(hooks, "_rank_and_world_size", lambda: (1, 2))  # now as rank 1 would
    again = Checkpoint(queue, holder, tmp_path, 1, done)
    assert not (again.state_dir / ".rank00001.saved").exists(), "rank 1 cleared its marker of the first save"
    release.set()
    queue.maybe_finalize_async_calls(blocking=True)
    assert (again.state_dir / ".rank00001.saved").exists()
    front.close()
