"""The streamed state's background saves inside Megatron's --async-save, driven
through megatron-core's own AsyncCallsQueue and AsyncRequest, as its training loop
drives them: the finalize before rank 0's tracker never stops training (a
non-blocking finalize defers the tracker to a later step), a blocking one waits,
a failed save never lets the tracker mark the checkpoint, and rank 0 marks it only
once every rank's streamed state is saved.

The job is a gloo group of one, or of two spawned ranks where ranks must agree
(megatron-core's queue all-reduces on ``torch.cuda.current_device()``, made the CPU
here). Fakes, where the real thing cannot run here: a collective that fails, and a
second rank at exit, simulated by the marker file it would write.
"""

import contextlib
import json
import os
import tempfile
import threading
import time
import types
from datetime import timedelta

import pytest
import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

from megatron_hooks import async_finalize
from megatron_hooks import checkpoint as hooks
from megatron_hooks.async_finalize import FinishStreamedSaves, StreamedSaveError
from megatron_hooks.contract import STREAMING_ATTR
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

    def __init__(self, queue, holder, tmp_path, iteration: int, done: list, manifest_of: str = "rank0") -> None:
        name = str(tmp_path / "ckpt" / f"iter_{iteration:07d}")
        self.state_dir = tmp_path / "ckpt" / f"iter_{iteration:07d}" / hooks.STATE_DIRNAME
        request = AsyncRequest(async_fn=None, async_fn_args=(), finalize_fns=[lambda: done.append("megatron")])
        hooks.save(types.SimpleNamespace(no_save_optim=False), holder, name, "GLOBAL", request)
        self.finish = request.finalize_fns[-1]
        assert isinstance(self.finish, FinishStreamedSaves)
        # The tracker says whether the streamed state was complete when it was written.
        manifest = self.state_dir / manifest_of / MANIFEST_NAME
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


def step(param, holder) -> None:
    """One training step through the optimizer Megatron saves with (the hook wraps its step)."""
    param.grad = torch.randn_like(param)
    holder.step()


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
        step(param, holder)  # training goes on while the streamed state is written
    assert done == ["megatron"]
    release.set()
    ckpt.wait_saved()
    step(param, holder)  # the first step after the save finds it complete
    assert done == ["megatron", ("tracker 1", True)]
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
            step(param, holder)  # the step after: the failure is raised there, once
        step(param, holder)  # and training may go on (from the previous checkpoint's point of view)
    assert "was not saved (rank 0: cannot rename" in str(failed.value)
    assert "the checkpoint is not marked complete" in str(failed.value) and "\n" not in str(failed.value)
    assert done == ["megatron"], "the tracker must not be written"
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
        step(param, holder)
        Checkpoint(queue, holder, tmp_path, 2, done)  # its hook waits for the earlier checkpoint's first
        assert done[:2] == ["megatron", ("tracker 1", True)]
        queue.maybe_finalize_async_calls(blocking=True)
        assert done == ["megatron", ("tracker 1", True), "megatron", ("tracker 2", True)]
    front.close()


def test_a_deferred_tracker_stays_deferred_when_the_ranks_cannot_agree_for_a_while(tmp_path, monkeypatch):
    """A collective that fails (a peer's connection lost for a moment) raises from the
    step, and the checkpoint's tracker stays deferred for the next step: it is never
    dropped for anything but a failed save."""
    param, front, holder = streamed(tmp_path, "rank0", 0)
    queue, done = AsyncCallsQueue(), []
    release = hold_publish(monkeypatch)
    ckpt = Checkpoint(queue, holder, tmp_path, 1, done)
    queue.maybe_finalize_async_calls(blocking=False)
    release.set()
    ckpt.wait_saved()
    real, calls = async_finalize._exchange, []

    def flaky(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("Connection closed by peer")
        return real(*args)

    monkeypatch.setattr(async_finalize, "_exchange", flaky)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        step(param, holder)
    assert done == ["megatron"] and len(async_finalize._deferred) == 1
    step(param, holder)
    assert done == ["megatron", ("tracker 1", True)]
    front.close()


def test_exit_markers_of_an_earlier_save_of_the_iteration_are_cleared_by_the_next(tmp_path, monkeypatch):
    """A restart from an earlier checkpoint saves the same iteration again: a marker the
    first run left at its exit must not tell rank 0 at this run's exit that it is complete."""
    monkeypatch.setattr(hooks, "_rank_and_world_size", lambda: (1, 2))  # as rank 1's hook
    param, front, holder = streamed(tmp_path, "rank1", 0)
    stale = (
        tmp_path / "ckpt" / "iter_0000001" / hooks.STATE_DIRNAME / f".rank00001.save{async_finalize._saves + 1}.saved"
    )
    stale.parent.mkdir(parents=True)
    stale.write_text("pid 1\n")
    ckpt = Checkpoint(None, holder, tmp_path, 1, [])
    assert not stale.exists(), "rank 1 cleared its marker of the first save"
    ckpt.wait_saved()
    # This run's previous save of the iteration, finalized only now, writes its own marker late.
    (stale.parent / f".rank00001.save{ckpt.finish.number - 1}.saved").write_text("pid 1\n")
    monkeypatch.setattr(async_finalize, "STRAGGLER_WAIT_S", 0.5)
    as_rank0 = FinishStreamedSaves(ckpt.finish.pending, ckpt.finish.directory, 0, 2, ckpt.finish.number)
    with pytest.raises(StreamedSaveError, match=r"rank\(s\) 1 did not say within 0 s .* not marked complete"):
        as_rank0.complete_at_exit()
    front.close()


def test_a_run_that_exits_with_a_failed_deferred_save_says_so_and_never_marks_it(tmp_path, monkeypatch, caplog):
    param, front, holder = streamed(tmp_path, "rank0", 0)
    release = hold_publish(monkeypatch, fail=True)
    queue, done = AsyncCallsQueue(), []
    Checkpoint(queue, holder, tmp_path, 1, done)
    queue.maybe_finalize_async_calls(blocking=False)
    release.set()
    async_finalize._finish_at_exit()
    assert done == ["megatron"]
    assert (
        "at exit: the streamed optimizer state" in caplog.text and "was not saved (rank 0: cannot rename" in caplog.text
    )
    front.close()


# -- two ranks ------------------------------------------------------------------------


def _agreement_rank(rank: int, world_size: int, tmp: str) -> None:
    """One spawned rank of a two-rank job running every scenario of :func:`two_ranks`;
    writes what it saw to ``<tmp>/rank<r>.json``."""
    torch.cuda.current_device = lambda: "cpu"
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp}/group", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    seen = {}
    scenarios = ("deferred", "deferred, rank 1 fails", "blocking, rank 1 fails", "the iteration saved twice")
    more = ("rank 1 streams nothing", "blocking, rank 1 streams nothing, rank 0 slow", "blocking, rank 1 hangs")
    for scenario in (*scenarios, *more):
        with pytest.MonkeyPatch.context() as monkeypatch:
            seen[scenario] = _scenario(scenario, rank, os.path.join(tmp, scenario.replace(" ", "_")), monkeypatch)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def _scenario(scenario: str, rank: int, tmp: str, monkeypatch) -> list:
    """One rank's publish is held (rank 1's, or rank 0's where rank 1 streams nothing; it
    fails or hangs where the scenario says) until the other's save is done and two steps
    ran; what ``done`` held after each step, or the error raised."""
    from pathlib import Path

    tmp = Path(tmp)
    if "rank 1 streams nothing" in scenario and rank == 1:
        param, front, holder = torch.zeros(1), None, types.SimpleNamespace(step=lambda: None)
        setattr(holder, STREAMING_ATTR, True)  # its chain holds no params on this rank: no store
    else:
        param, front, holder = streamed(tmp / f"rank{rank}", f"rank{rank}", rank)
    held = 0 if "rank 1 streams nothing" in scenario else 1
    release = hold_publish(monkeypatch, fail=rank == 1 and "fails" in scenario)
    if rank != held:
        release.set()
    if scenario.startswith("blocking, rank 1"):
        monkeypatch.setattr(async_finalize, "STRAGGLER_WAIT_S", 3.0)
    queue, done, seen = AsyncCallsQueue(), [], []
    ckpt = Checkpoint(queue, holder, tmp, 1, done, manifest_of=f"rank{held}")

    def held_then_released() -> None:
        if rank == held:
            release.set()
            try:
                ckpt.wait_saved()
            except StreamIOError:
                pass
        torch.distributed.barrier()

    try:
        if scenario == "blocking, rank 1 hangs":
            queue.maybe_finalize_async_calls(blocking=True)
        elif scenario == "blocking, rank 1 streams nothing, rank 0 slow":
            if rank == held:
                threading.Timer(2 * async_finalize.STRAGGLER_WAIT_S, release.set).start()
            queue.maybe_finalize_async_calls(blocking=True)
        elif scenario.startswith("blocking"):
            held_then_released()
            queue.maybe_finalize_async_calls(blocking=True)
        else:
            queue.maybe_finalize_async_calls(blocking=False)
            for _ in range(2):
                step(param, holder)
                seen.append(list(done))
            if scenario == "the iteration saved twice":
                threading.Timer(0.5, release.set).start()
                Checkpoint(queue, holder, tmp, 1, done)  # waits for the first, agreeing on it
                seen.append(list(done))
                queue.maybe_finalize_async_calls(blocking=True)
            else:
                held_then_released()
                step(param, holder)
        seen.append(list(done))
    except StreamedSaveError as exc:
        seen.append(str(exc))
    release.set()
    with contextlib.suppress(StreamIOError):
        ckpt.wait_saved()
    if front is not None:
        front.close()
    return [[list(x) if isinstance(x, tuple) else x for x in s] if isinstance(s, list) else s for s in seen]


@pytest.fixture(scope="module")
def two_ranks():
    """What each of two spawned ranks saw in each scenario."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ranks = mp.spawn(_agreement_rank, args=(2, tmp), nprocs=2, join=False)
        deadline = time.monotonic() + 240
        while not ranks.join(timeout=1):
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    process.kill()
                pytest.fail("the two ranks did not finish their scenarios in 240 s: a hang")
        return [json.loads(open(os.path.join(tmp, f"rank{r}.json")).read()) for r in range(2)]


def test_two_ranks_write_the_tracker_at_the_same_step_once_both_saves_are_complete(two_ranks):
    waiting, complete = ["megatron"], ["megatron", ["tracker 1", True]]
    for seen in two_ranks:
        assert seen["deferred"] == [waiting, waiting, complete], "rank 0's save ended first: both wait for rank 1's"


@pytest.mark.parametrize("finalize", ["deferred", "blocking"])
def test_a_save_failed_on_one_rank_raises_on_every_rank_at_the_same_point(two_ranks, finalize):
    """Each rank raises (none is left waiting in a collective for the others), and no
    rank's tracker is written."""
    rank0, rank1 = (seen[f"{finalize}, rank 1 fails"] for seen in two_ranks)
    assert rank0[:-1] == rank1[:-1] == ([["megatron"]] * 2 if finalize == "deferred" else [])
    assert "was not saved (rank(s) 1): the checkpoint is not marked complete" in rank0[-1]
    assert "was not saved (rank 1: cannot rename" in rank1[-1]


def test_the_iteration_saved_again_while_its_tracker_waits_completes_both(two_ranks):
    """Megatron saves an iteration twice when a batch-size ramp step falls on a save
    interval: the second save's hook waits for the first on every rank, with no hang."""
    waiting, first = ["megatron"], ["megatron", ["tracker 1", True]]
    for seen in two_ranks:
        assert seen["the iteration saved twice"] == [waiting, waiting, first, first + first]


def test_a_rank_that_streams_nothing_joins_the_agreement(two_ranks):
    """A rank whose chain holds no params (no store) still takes part: the tracker is
    written on both ranks at the same step, once rank 0's save is complete."""
    waiting, complete = ["megatron"], ["megatron", ["tracker 1", True]]
    for seen in two_ranks:
        assert seen["rank 1 streams nothing"] == [waiting, waiting, complete]


def test_a_rank_that_streams_nothing_starts_no_straggler_wait(two_ranks):
    """Its state is complete at once, but no save of it ended: rank 0's save, slower than
    the straggler wait, still completes the checkpoint."""
    for seen in two_ranks:
        assert seen["blocking, rank 1 streams nothing, rank 0 slow"] == [["megatron", ["tracker 1", True]]]


def test_a_save_that_hangs_on_one_rank_fails_every_rank_after_the_straggler_wait(two_ranks):
    for seen in two_ranks:
        [error] = seen["blocking, rank 1 hangs"]
        assert (
            "rank(s) 1 still saving the streamed optimizer state" in error
            and "after another rank's save ended" in error
        )


def test_an_interrupted_blocking_finalize_keeps_the_tracker_for_later(tmp_path, monkeypatch):
    """Megatron takes a request off its queue before it runs its finalize functions: an
    interrupt while a blocking one waits must not lose the tracker."""
    param, front, holder = streamed(tmp_path, "rank0", 0)
    queue, done = AsyncCallsQueue(), []
    ckpt = Checkpoint(queue, holder, tmp_path, 1, done)
    real = async_finalize._exchange

    def interrupted(*args):
        monkeypatch.setattr(async_finalize, "_exchange", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(async_finalize, "_exchange", interrupted)
    with pytest.raises(KeyboardInterrupt):
        queue.maybe_finalize_async_calls(blocking=True)
    assert done == ["megatron"] and queue.get_num_unfinalized_calls() == 0
    ckpt.wait_saved()
    step(param, holder)
    assert done == ["megatron", ("tracker 1", True)]
    front.close()


def test_at_exit_no_rank_runs_the_deferred_functions_before_every_rank_said_saved(tmp_path, monkeypatch, caplog):
    """Rank 1 of two at exit, rank 0's marker missing: rank 1's remaining finalize
    functions (Megatron's success callbacks) do not run."""
    monkeypatch.setattr(hooks, "_rank_and_world_size", lambda: (1, 2))
    monkeypatch.setattr(async_finalize, "STRAGGLER_WAIT_S", 0.5)
    param, front, holder = streamed(tmp_path, "rank1", 0)
    ckpt = Checkpoint(None, holder, tmp_path, 1, [], manifest_of="rank1")
    ckpt.wait_saved()
    ran = []
    async_finalize._deferred.append((ckpt.finish, [lambda: ran.append("on_save_checkpoint_success")]))
    async_finalize._finish_at_exit()
    assert ran == [] and "rank(s) 0 did not say within 0 s" in caplog.text
    front.close()


def test_an_interrupt_among_the_deferred_functions_leaves_the_rest_for_the_next_step(tmp_path, monkeypatch):
    """Each deferred function is taken off only once it ran: one cut short by an interrupt
    runs again, and the tracker after it is not lost."""
    param, front, holder = streamed(tmp_path, "rank0", 0)
    release = hold_publish(monkeypatch)
    queue, done, calls = AsyncCallsQueue(), [], []

    def interrupted_once() -> None:
        calls.append("callback")
        if len(calls) == 1:
            raise KeyboardInterrupt

    ckpt = Checkpoint(queue, holder, tmp_path, 1, done)
    ckpt.request.finalize_fns.insert(-1, interrupted_once)  # between the hook's and the tracker's
    queue.maybe_finalize_async_calls(blocking=False)
    release.set()
    ckpt.wait_saved()
    with pytest.raises(KeyboardInterrupt):
        step(param, holder)
    assert done == ["megatron"]
    step(param, holder)
    assert calls == ["callback", "callback"] and done == ["megatron", ("tracker 1", True)]
    front.close()
