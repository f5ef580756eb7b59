"""Checkpoints of the streamed state: round trip, atomic replacement, verified loads.

The round trip is judged against an independent resident run
(``reference.reference_run``) of the same number of steps, never against the
store itself.
"""

import functools
import json
import logging
import os

import pytest
import torch

from miles_plugins.optimizers import StreamConfig
from miles_plugins.optimizers.checkpoint.manifest import MANIFEST_NAME
from miles_plugins.optimizers.errors import CheckpointMismatchError, StreamConfigError
from miles_plugins.optimizers.step.adam import backend_for
from miles_plugins.optimizers.step.entries import Entry
from miles_plugins.optimizers.store.streaming_store import StreamingStore
from tests.helpers import (
    SAVE_AT,
    STEPS,
    as_format,
    fresh,
    refusal,
    resume,
    rewrite_manifest,
    save_run,
    state_of,
    train,
)
from tests.unit.reference import (
    assert_same_training,
    loss_fn,
    reference_run,
)


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW], ids=["Adam", "AdamW"])
def test_save_load_resume_is_byte_identical_to_an_uninterrupted_run(tmp_path, opt_cls):
    ckpt = tmp_path / "ckpt"
    first = save_run(tmp_path, ckpt, opt_cls=opt_cls)
    first[3].close()
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt, opt_cls=opt_cls)
    assert streamed.load_from(str(ckpt))
    assert streamed.store.steps_taken == SAVE_AT
    train(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    assert_same_training(reference_run(opt_cls, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


@pytest.mark.parametrize(
    "saving, loading",
    [
        ({"tier": "host", "main_storage": "remainder"}, {"tier": "host", "main_storage": "remainder"}),
        ({"engine": "sync", "main_storage": "remainder"}, {"main_storage": "remainder"}),
        ({"tier": "host"}, {"tier": "disk", "engine": "sync"}),
    ],
    ids=["host-remainder", "sync-to-pipelined-remainder", "host-to-disk"],
)
def test_checkpoints_resume_byte_identical_across_tiers_and_engines(tmp_path, saving, loading):
    """The checkpoint format depends on the storage formats only, not on where or how the state streams."""
    ckpt = tmp_path / "ckpt"
    save_run(tmp_path, ckpt, **saving)[3].close()
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt, **loading)
    assert streamed.load_from(str(ckpt))
    train(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_remainder_exceptions_travel_with_the_checkpoint(tmp_path):
    """Mains on exact ties need their exceptions: a load must bring them back."""
    tie_bits = torch.tensor([0x3F818000, 0x3F838000, 0x3F808000, 0x3F800001] * 25, dtype=torch.int32)
    mains = tie_bits.view(torch.float32)

    def store(name):
        param = mains.to(torch.bfloat16)
        entry = Entry(param=param, main=mains.clone(), group_index=0)
        config = StreamConfig(directory=str(tmp_path / "scratch"), name=name, main_storage="remainder")
        return StreamingStore([entry], backend_for(torch.optim.AdamW([entry.main])), config)

    first = store("r0")
    assert sum(len(e) for bucket in first._pipeline.codec.exceptions for e in bucket) == 50
    first.save_to(str(tmp_path / "ckpt"))
    first.close()
    second = store("r0")
    codec = second._pipeline.codec
    codec.exceptions = [[type(e).none() for e in bucket] for bucket in codec.exceptions]  # forget them
    assert second.load_from(str(tmp_path / "ckpt"))
    ((_, main, _, _),) = list(second.iter_state())
    assert torch.equal(main.view(torch.int32), tie_bits)
    second.close()


def test_without_the_load_the_resumed_run_differs(tmp_path):
    """The control: resuming without the optimizer state must not match (the test can fail)."""
    ckpt = tmp_path / "ckpt"
    save_run(tmp_path, ckpt)[3].close()
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt)
    train(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    with pytest.raises(AssertionError):
        assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_nothing_saved_loads_as_false(tmp_path):
    *_, streamed = fresh(tmp_path, "rank0")
    assert streamed.load_from(str(tmp_path / "empty")) is False
    streamed.close()


def test_a_load_from_a_file_is_refused_rather_than_taken_for_nothing_saved(tmp_path):
    """A path that is a file (a typo, a tarball) is not an empty checkpoint directory."""
    *_, streamed = fresh(tmp_path, "rank0")
    (tmp_path / "ckpt.tar").write_bytes(b"x")
    with pytest.raises(StreamConfigError, match="ckpt.tar: it is not a directory") as refused:
        streamed.load_from(str(tmp_path / "ckpt.tar"))
    assert "\n" not in str(refused.value)
    streamed.close()


def test_a_second_save_replaces_the_first_atomically(tmp_path):
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt)
    train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 1))
    streamed.save_to(str(ckpt))
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"]  # no partial or replaced copies left
    manifest = json.loads((ckpt / "rank0" / MANIFEST_NAME).read_text())
    assert manifest["steps_taken"] == SAVE_AT + 1
    streamed.close()


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    model, optimizer, scheduler, streamed = save_run(tmp_path, ckpt)
    before = {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()}
    train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 1))

    import miles_plugins.optimizers.homes.backings as backings_module

    def failing_copy(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(backings_module, "copy_file_crc32", failing_copy)
    with pytest.raises(OSError, match="No space left"):
        streamed.save_to(str(ckpt))
    assert {p.name: p.read_bytes() for p in (ckpt / "rank0").iterdir()} == before
    assert sorted(os.listdir(ckpt)) == ["rank0", "rest.pt"]
    streamed.close()


@pytest.fixture
def saved(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_run(tmp_path, ckpt)[3].close()
    return ckpt


def test_changed_moment_dtype_is_refused(tmp_path, saved):
    assert 'moment dtype differs: checkpoint has "fp32", this run has "bf16"' in refusal(
        tmp_path, saved, moment_dtype="bf16"
    )


def test_changed_main_storage_is_refused(tmp_path, saved):
    assert 'main dtype differs: checkpoint has "fp32", this run has "fp32 as bf16 param + int16 remainder"' in (
        refusal(tmp_path, saved, main_storage="remainder")
    )


def test_changed_layout_is_refused(tmp_path, saved):
    assert "bucket layout differs" in refusal(tmp_path, saved, bucket_cap_elements=100_000)


@pytest.mark.fault
def test_truncated_bucket_file_is_refused_before_anything_is_loaded(tmp_path, saved, fault_report):
    path = saved / "rank0" / "bucket_00001.bin"
    os.truncate(path, path.stat().st_size - 100)
    message = refusal(tmp_path, saved)
    assert "bucket_00001.bin has" in message and "truncated" in message
    fault_report(
        "checkpoint bucket file truncated",
        "load refuses before touching the live state",
        message.splitlines()[-1].strip(" -"),
        "none (the load refuses)",
    )


@pytest.mark.fault
@pytest.mark.parametrize("tier", ["disk", "host"])
def test_flipped_byte_fails_the_checksum_before_anything_is_loaded(tmp_path, saved, fault_report, tier):
    """The disk tier checks while copying into its spare slot, the host tier in a
    first read: either way a corrupt file is found before the live state changes."""
    path = saved / "rank0" / "bucket_00002.bin"
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01
    path.write_bytes(bytes(data))
    model, optimizer, scheduler, streamed = resume(tmp_path, saved, tier=tier)
    train(model, optimizer, scheduler, range(1))  # some live state to keep
    before = state_of(model, streamed)
    corrupt = (
        r"bucket_00002.bin: the CRC-32 of 1 of its 1 blocks of 4194304 bytes .*\(first: block 0, bytes 0-4194303\)"
    )
    with pytest.raises(CheckpointMismatchError, match=corrupt) as info:
        streamed.load_from(str(saved))
    assert_same_training(before, state_of(model, streamed))
    assert streamed.store.steps_taken == 1
    loss_fn(model, 1).backward()
    optimizer.step()  # the store is as it was before the load, and usable
    streamed.close()
    fault_report(
        f"checkpoint byte flipped ({tier} tier)",
        "load refuses on the checksum before the live state changes",
        f"{info.value}; the store byte-identical to before the load, and it steps",
        "none (the load refuses)",
    )


@pytest.mark.fault
def test_missing_manifest_is_refused(tmp_path, saved, fault_report):
    (saved / "rank0" / MANIFEST_NAME).unlink()
    message = refusal(tmp_path, saved)
    assert "holds no manifest.json" in message
    fault_report("checkpoint manifest missing", "load refuses", message, "none (the load refuses)")


@pytest.mark.fault
@pytest.mark.parametrize("name", ["../evil.bin", "/etc/passwd", ".hidden"])
def test_manifest_naming_files_outside_its_directory_is_refused(tmp_path, saved, fault_report, name):
    rewrite_manifest(
        saved / "rank0" / MANIFEST_NAME, lambda data: data["files"].update({name: {"size": 1, "block_crc32": [0]}})
    )
    message = refusal(tmp_path, saved)
    assert f"names a file outside its directory: {name!r}" in message
    fault_report(
        f"manifest names {name!r}",
        "load refuses without opening it",
        message,
        "none (the load refuses)",
    )


def test_changed_topology_is_refused_naming_what_changed(tmp_path):
    def store(name, topology):
        params = [torch.zeros(100, dtype=torch.bfloat16) for _ in range(3)]
        entries = [Entry(param=p, main=p.float(), group_index=0) for p in params]
        return StreamingStore(
            entries,
            backend_for(torch.optim.AdamW([e.main for e in entries])),
            StreamConfig(directory=str(tmp_path / "scratch"), name=name),
            topology=topology,
        )

    first = store("r0", {"dp_size": 2, "dp_rank": 0, "tp_size": 1})
    first.save_to(str(tmp_path / "ckpt"))
    first.close()
    second = store("r0", {"dp_size": 4, "dp_rank": 0, "tp_size": 1})
    with pytest.raises(
        CheckpointMismatchError, match=r"parallel topology differs \(checkpoint -> this run\): dp_size 2 -> 4"
    ):
        second.load_from(str(tmp_path / "ckpt"))
    second.close()


@pytest.mark.fault
def test_a_manifest_edited_without_its_checksum_is_refused(tmp_path, saved, fault_report):
    rewrite_manifest(saved / "rank0" / MANIFEST_NAME, lambda data: data.update(steps_taken=3), sign=False)
    message = refusal(tmp_path, saved)
    assert "fails its own checksum" in message and "damaged or edited" in message
    fault_report("manifest edited (checksum not updated)", "load refuses", message, "none (the load refuses)")


@pytest.mark.fault
@pytest.mark.parametrize("tier", ["disk", "host"])
def test_a_tampered_manifest_is_refused_and_the_store_is_unchanged(tmp_path, saved, fault_report, tier):
    """The reproduction from the review: one more param group in a bucket's saved
    state (its checksum recomputed). The load used to copy the bucket files in,
    fail on the group count, and leave a store that stepped on the checkpoint's
    moments with step counts of 0."""
    rewrite_manifest(
        saved / "rank0" / MANIFEST_NAME,
        lambda data: data["bucket_state"][0]["groups"].append({}),
    )
    model, optimizer, scheduler, streamed = resume(tmp_path, saved, tier=tier)
    train(model, optimizer, scheduler, range(1))
    before = state_of(model, streamed)
    with pytest.raises(CheckpointMismatchError, match=r"bucket 0: 2 saved param groups, 1 live") as info:
        streamed.load_from(str(saved))
    assert_same_training(before, state_of(model, streamed))
    assert streamed.store.steps_taken == 1
    train(model, optimizer, scheduler, range(1, 3))  # and it steps on
    assert streamed.store.steps_taken == 3
    streamed.close()
    fault_report(
        f"manifest tampered, checksum recomputed ({tier} tier)",
        "load refuses before the live state changes; the store is unchanged and steps on",
        str(info.value).splitlines()[-1].strip(" -") + "; state byte-identical to before the load",
        "none (the load refuses)",
    )


def test_a_failure_after_the_commit_leaves_the_store_refusing_to_step(tmp_path, saved, monkeypatch):
    """Host tier: the second read of a file fails part way (it was replaced or the
    drive failed between the two reads): some buckets are already loaded."""
    from miles_plugins.optimizers.checkpoint.reader import CheckpointReader
    from miles_plugins.optimizers.errors import StoreUnusableError

    model, optimizer, scheduler, streamed = resume(tmp_path, saved, tier="host")
    real = CheckpointReader._read_buckets

    def copy_then_fail(self, source, manifest, buckets, copy):
        # Between the verifying read and the copy (of the in-place buckets: all of the
        # host tier's), the last bucket file changes.
        if buckets and copy:
            path = saved / "rank0" / "bucket_00002.bin"
            path.write_bytes(b"\0" * path.stat().st_size)
        return real(self, source, manifest, buckets, copy)

    monkeypatch.setattr(CheckpointReader, "_read_buckets", copy_then_fail)
    with pytest.raises(CheckpointMismatchError, match="bucket_00002.bin: the CRC-32 of 1 of its 1 blocks"):
        streamed.load_from(str(saved))
    loss_fn(model, 0).backward()
    with pytest.raises(StoreUnusableError, match="no consistent state: loading .* failed after the live state began"):
        optimizer.step()
    streamed.close()


@pytest.mark.parametrize("version", [1, 2])
def test_a_manifest_of_an_older_format_still_loads(tmp_path, saved, version):
    """Checkpoints written before files had a checksum per block (format 2: one
    CRC-32 per file) and before manifests carried their own checksum (format 1)."""
    rewrite_manifest(saved / "rank0" / MANIFEST_NAME, as_format(saved / "rank0", version), sign=version >= 2)
    model, optimizer, scheduler, streamed = resume(tmp_path, saved)
    assert streamed.load_from(str(saved))
    train(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


@pytest.mark.parametrize("removed", ["fp8e4m3", "fp16"])
def test_a_checkpoint_with_a_removed_moment_dtype_is_refused_saying_why(tmp_path, saved, removed):
    """An old (format 1) checkpoint that stored its moments unscaled in a narrow dtype."""

    def old_narrow_save(data):
        as_format(saved / "rank0", 1)(data)
        data["moment_dtype"] = removed

    rewrite_manifest(saved / "rank0" / MANIFEST_NAME, old_narrow_save, sign=False)
    message = refusal(tmp_path, saved)
    assert f"stores its moments as {removed}, which this version no longer reads" in message
    assert "diverges" in message and "--no-load-optim" in message


def _set_first_step(value):
    def change(data):
        data["bucket_state"][0]["params"][0][0]["step"] = value

    return change


def _set_first_state(value):
    def change(data):
        data["bucket_state"][0]["params"][0][0] = value

    return change


@pytest.mark.parametrize(
    "change",
    [
        _set_first_step({"value": 2**70, "dtype": "torch.float32", "on_param_device": False}),
        _set_first_step({"value": float("nan"), "dtype": "torch.float32", "on_param_device": False}),
        _set_first_step({"value": -3, "dtype": "torch.float32", "on_param_device": False}),
        _set_first_step({"value": 2.5, "dtype": "torch.float32", "on_param_device": False}),
        _set_first_step({"value": 3, "dtype": "torch.qint8", "on_param_device": False}),
        _set_first_step({"value": 3, "dtype": "torch.float32", "on_param_device": "yes"}),
        _set_first_step(3),
        _set_first_state({}),
        _set_first_state({"step": {"value": 3, "dtype": "torch.float32", "on_param_device": False}, "extra": 1}),
        lambda data: data["bucket_state"][0]["groups"][0].update(step=1),
    ],
    ids=[
        "step beyond 2**53",
        "NaN step",
        "negative step",
        "fractional step",
        "quantized dtype",
        "device flag not a bool",
        "step not a tensor",
        "state without a step",
        "unknown key",
        "group step torch does not keep",
    ],
)
def test_small_state_that_would_fail_or_poison_training_is_refused_before_the_commit(tmp_path, saved, change):
    """Checksummed (a writer that means it, or a buggy one) but not what the
    optimizer keeps: each used to pass, then damage the store after the commit
    or load and break training later."""
    rewrite_manifest(saved / "rank0" / MANIFEST_NAME, change)
    model, optimizer, scheduler, streamed = resume(tmp_path, saved)
    train(model, optimizer, scheduler, range(1))
    before = state_of(model, streamed)
    with pytest.raises(CheckpointMismatchError, match="bucket 0: group 0"):
        streamed.load_from(str(saved))
    assert_same_training(before, state_of(model, streamed))
    train(model, optimizer, scheduler, range(1, 2))
    streamed.close()


def test_a_state_saved_by_plain_adamw_loads_into_a_fused_one_and_back(tmp_path):
    """torch.optim's own load_state_dict places a step count by the live group
    (fp32 on the param's device when fused or capturable): a checkpoint written
    under one setting resumes under the other."""
    ckpt = tmp_path / "ckpt"
    save_run(tmp_path, ckpt)[3].close()
    fused = functools.partial(torch.optim.AdamW, fused=True)
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt, opt_cls=fused)
    assert streamed.load_from(str(ckpt))
    train(model, optimizer, scheduler, range(SAVE_AT, SAVE_AT + 2))
    streamed.save_to(str(tmp_path / "fused"))
    streamed.close()
    model, optimizer, scheduler, streamed = resume(tmp_path, ckpt)
    assert streamed.load_from(str(tmp_path / "fused"))
    train(model, optimizer, scheduler, range(SAVE_AT + 2, SAVE_AT + 3))
    streamed.close()


def test_a_resume_restores_the_param_group_options_a_scheduler_left(tmp_path):
    """The master's state_dict refuses, so the lr a scheduler set (here after the LR
    drop at step 10) travels with the streamed state: restoring only the
    scheduler's own state, as without streaming, resumes byte-identically."""
    ckpt = tmp_path / "ckpt"
    save_run(tmp_path, ckpt)[3].close()
    model, optimizer, scheduler, streamed = fresh(tmp_path, "rank0")
    rest = torch.load(ckpt / "rest.pt")
    model.load_state_dict(rest["model"])
    scheduler.load_state_dict(rest["scheduler"])
    assert optimizer.param_groups[0]["lr"] != scheduler.get_last_lr()[0], "the scheduler alone does not set it"
    assert streamed.load_from(str(ckpt))
    assert [g["lr"] for g in optimizer.param_groups] == scheduler.get_last_lr()
    train(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    assert_same_training(reference_run(torch.optim.AdamW, torch.bfloat16, STEPS), state_of(model, streamed))
    streamed.close()


def test_nothing_to_load_says_where_it_looked(tmp_path, caplog):
    *_, streamed = fresh(tmp_path, "rank0")
    with caplog.at_level(logging.WARNING):
        assert streamed.load_from(str(tmp_path / "ckpt" / "rank0")) is False
    assert f"looked for {tmp_path / 'ckpt' / 'rank0' / 'rank0'}" in caplog.text
    streamed.close()
