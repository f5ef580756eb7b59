"""``python -m miles_plugins.optimizers.ckpt inspect``: a real saved state, described and
verified byte for byte; damaged ones are reported, each problem named, with exit 1."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_hooks.checkpoint import STATE_DIRNAME
from miles_plugins.optimizers import StreamConfig, StreamedOptimizer
from miles_plugins.optimizers.checkpoint.manifest import CHECKSUM_KEY, MANIFEST_NAME, checksum
from tests.helpers import CKPT_MODULE, REPO, ckpt_cli


def _run_module(*args):
    """The command as a user types it: its own process, its exit status."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", CKPT_MODULE, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def checkpoint(tmp_path):
    """An iteration directory as the Megatron hooks lay it out, with two ranks' stores."""
    iteration = tmp_path / "iter_0000003"
    for rank in range(2):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters())
        config = StreamConfig(
            directory=str(tmp_path / "scratch"), name=f"rank{rank}.opt0", moment_dtype="8bit", bucket_cap_elements=2048
        )
        with StreamedOptimizer(optimizer, config) as streamed:
            for _ in range(3):
                model(torch.randn(4, 64).to(torch.bfloat16)).float().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            streamed.save_to(str(iteration / STATE_DIRNAME))
    return iteration


def test_a_sound_checkpoint_is_described_and_verifies(checkpoint):
    result = _run_module("inspect", str(checkpoint))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.count("OK: every file's size and CRC-32 match") == 2
    assert "step 3" in out and "moments 8bit (dynamic map" in out and "2 of 2 saved stores verify" in out
    # One store alone, given directly, too.
    assert ckpt_cli("inspect", str(checkpoint / STATE_DIRNAME / "rank1.opt0")).returncode == 0


def _bucket(checkpoint, rank=0):
    store = checkpoint / STATE_DIRNAME / f"rank{rank}.opt0"
    return store / sorted(n for n in os.listdir(store) if n.startswith("bucket_"))[0]


def test_a_flipped_byte_is_reported_with_its_file_and_exit_1(checkpoint):
    path = _bucket(checkpoint)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x40
    path.write_bytes(bytes(data))
    result = ckpt_cli("inspect", str(checkpoint))
    assert result.returncode == 1
    assert f"PROBLEM: {path.name} fails its checksum: the CRC-32 of 1 of its" in result.stdout
    assert "1 of 2 saved stores verify" in result.stdout


def test_a_truncated_file_a_missing_file_and_an_edited_manifest_are_each_reported(checkpoint):
    truncated = _bucket(checkpoint, 0)
    truncated.write_bytes(truncated.read_bytes()[:-4096])
    manifest = checkpoint / STATE_DIRNAME / "rank1.opt0" / MANIFEST_NAME
    data = json.loads(manifest.read_text())
    data["steps_taken"] = 4  # edited without its checksum
    manifest.write_text(json.dumps(data))
    result = ckpt_cli("inspect", str(checkpoint))
    assert result.returncode == 1
    assert f"{truncated.name} has" in result.stdout and "(truncated?)" in result.stdout
    assert "fails its own checksum" in result.stdout
    _bucket(checkpoint, 0).unlink()
    assert f"{truncated.name} is missing" in ckpt_cli("inspect", str(checkpoint)).stdout


def test_an_incomplete_save_and_an_empty_directory_are_problems(checkpoint, tmp_path):
    (checkpoint / STATE_DIRNAME / "rank0.opt0" / MANIFEST_NAME).unlink()
    result = ckpt_cli("inspect", str(checkpoint))
    assert result.returncode == 1 and "holds no manifest.json: the save that wrote it did not complete" in result.stdout
    (tmp_path / "empty").mkdir()
    result = ckpt_cli("inspect", str(tmp_path / "empty"))
    assert result.returncode == 1 and "is not a saved streamed optimizer state: give a checkpoint's" in result.stderr
    result = ckpt_cli("inspect", str(tmp_path))  # the checkpoint root, one level too high
    assert result.returncode == 1 and "is not a saved streamed optimizer state" in result.stderr


def test_bad_usage_exits_2(tmp_path):
    assert _run_module().returncode == 2
    result = ckpt_cli("inspect", str(tmp_path / "nope"))
    assert result.returncode == 2 and "is not a directory" in result.stderr


def test_what_a_load_would_refuse_or_read_instead_is_what_inspect_reports(checkpoint):
    state = checkpoint / STATE_DIRNAME
    # A replace cut off between its renames: the load reads .<name>.previous.
    os.rename(state / "rank1.opt0", state / ".rank1.opt0.previous")
    result = ckpt_cli("inspect", str(checkpoint))
    assert result.returncode == 0, result.stdout
    assert "rank1.opt0 is missing; a load reads the previous save" in result.stdout
    # Two ranks' stores swapped: each manifest names its own store.
    os.rename(state / ".rank1.opt0.previous", state / "rank1.opt0")
    os.rename(state / "rank0.opt0", state / "tmp")
    os.rename(state / "rank1.opt0", state / "rank0.opt0")
    os.rename(state / "tmp", state / "rank1.opt0")
    result = ckpt_cli("inspect", str(checkpoint))
    assert (
        result.returncode == 1 and "the manifest is store 'rank1.opt0''s, but it sits in 'rank0.opt0'" in result.stdout
    )


def test_a_stray_file_beside_the_stores_is_ignored_as_a_load_ignores_it(checkpoint):
    """A note copied in with the state is no store, and no load reads it; a file in
    the place of a store (a name a load reads) is still the problem a load meets."""
    state = checkpoint / STATE_DIRNAME
    (state / "NOTES.txt").write_text("copied from cluster A\n")
    result = ckpt_cli("inspect", str(checkpoint))
    assert result.returncode == 0, result.stdout
    assert f"note: ignoring {state / 'NOTES.txt'}: not a directory, so no saved store" in result.stdout
    assert "PROBLEM" not in result.stdout and "2 of 2 saved stores verify" in result.stdout
    (state / "rank2.opt0").write_text("")
    result = ckpt_cli("inspect", str(checkpoint))
    assert result.returncode == 1
    assert f"PROBLEM: {state / 'rank2.opt0'} is not a plain directory (a load refuses it)" in result.stdout


def test_what_streamed_optimizer_save_to_wrote_is_described_and_verified(tmp_path):
    """The plain-PyTorch front end saves ``<dir>/<name>/``: inspect takes that ``dir``,
    passes over what else the caller keeps there, and finds a flipped byte."""
    param = torch.nn.Parameter(torch.randn(3000, dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW([param])
    config = StreamConfig(directory=str(tmp_path / "scratch"))
    with StreamedOptimizer(optimizer, config) as streamed:
        param.grad = torch.randn_like(param)
        optimizer.step()
        streamed.save_to(str(tmp_path / "saved"))
    torch.save({"step": 1}, tmp_path / "saved" / "model.pt")  # the caller's own checkpoint beside it
    result = ckpt_cli("inspect", str(tmp_path / "saved"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 of 1 saved stores verify" in result.stdout and "note: ignoring" in result.stdout
    path = tmp_path / "saved" / config.name / "bucket_00000.bin"
    data = bytearray(path.read_bytes())
    data[5] ^= 1
    path.write_bytes(bytes(data))
    result = ckpt_cli("inspect", str(tmp_path / "saved"))
    assert result.returncode == 1 and "PROBLEM: bucket_00000.bin fails its checksum" in result.stdout
    assert "StreamedOptimizer.save_to" in ckpt_cli("inspect", "--help").stdout


def test_a_rank_without_a_store_is_reported(checkpoint):
    state = checkpoint / STATE_DIRNAME
    for store in ("rank0.opt0", "rank1.opt0"):  # a topology of two ranks, as Megatron records it
        manifest = state / store / MANIFEST_NAME
        data = json.loads(manifest.read_text())
        data["topology"] = {"world_size": 2, "dp_size": 2}
        data[CHECKSUM_KEY] = checksum(data)
        manifest.write_text(json.dumps(data))
    assert ckpt_cli("inspect", str(checkpoint)).returncode == 0
    shutil.rmtree(state / "rank1.opt0")
    result = ckpt_cli("inspect", str(checkpoint))
    assert result.returncode == 1 and "the run had 2 ranks; no store for rank(s) [1]" in result.stdout


def _chain(state, stores):
    """Give the saved stores the names and Megatron topologies of ``stores``: name ->
    (dp_size, dp_rank, pp_rank), world size 2; copies of rank0.opt0's bytes."""
    for name, (dp_size, dp_rank, pp_rank) in stores.items():
        if not (state / name).exists():
            shutil.copytree(state / "rank0.opt0", state / name)
        topology = {"world_size": 2, "dp_size": dp_size, "dp_rank": dp_rank, "shard_peers": {"pp_rank": pp_rank}}
        _rewrite(state / name / MANIFEST_NAME, store=name, topology=topology)


def test_a_data_parallel_group_missing_a_store_of_one_optimizer_is_reported(checkpoint):
    """Each rank of a Megatron chain saves one store per optimizer (dense, experts): a
    rank with the dense optimizer's store but not the expert one's, where its
    data-parallel peers have both, is a missing store."""
    state = checkpoint / STATE_DIRNAME
    _chain(state, {f"rank{r}.opt{o}": (2, r, 0) for r in range(2) for o in range(2)})
    assert ckpt_cli("inspect", str(checkpoint)).returncode == 0
    shutil.rmtree(state / "rank1.opt1")
    result = ckpt_cli("inspect", str(checkpoint))
    assert result.returncode == 1, result.stdout
    assert "opt1: the data-parallel group of pp_rank 0 has 1 of its 2 stores (dp rank(s) [1] missing)" in result.stdout


def test_a_pipeline_stage_without_experts_is_no_problem(checkpoint):
    """PP=2 with experts only in the second stage: rank 0 has no expert optimizer at all."""
    state = checkpoint / STATE_DIRNAME
    _chain(state, {"rank0.opt0": (1, 0, 0), "rank1.opt0": (1, 0, 1), "rank1.opt1": (1, 0, 1)})
    result = ckpt_cli("inspect", str(checkpoint))
    assert result.returncode == 0, result.stdout


def test_stores_of_two_saves_in_one_directory_are_reported(checkpoint):
    state = checkpoint / STATE_DIRNAME
    _rewrite(state / "rank0.opt0" / MANIFEST_NAME, topology={"world_size": 2, "dp_size": 2})
    _rewrite(state / "rank1.opt0" / MANIFEST_NAME, topology={"world_size": 4, "dp_size": 4})
    result = ckpt_cli("inspect", str(checkpoint))
    assert result.returncode == 1 and "different world sizes [2, 4]: the directory mixes saves" in result.stdout
    _rewrite(state / "rank1.opt0" / MANIFEST_NAME, topology={"world_size": 2, "dp_size": 2}, steps_taken=2)
    result = ckpt_cli("inspect", str(checkpoint))
    assert result.returncode == 1 and "different step counts [2, 3]: the directory mixes saves" in result.stdout


def _rewrite(manifest, **fields):
    """Set manifest fields, with its own checksum recomputed (a writer that means to be believed)."""
    data = json.loads(manifest.read_text())
    data.update(fields)
    data[CHECKSUM_KEY] = checksum(data)
    manifest.write_text(json.dumps(data))


def test_block_checksums_are_each_blocks_crc32_however_the_bytes_arrive():
    """What a partial read verifies: the CRC-32 of each block, independent of how the
    stream was cut into reads (zlib over each block is the reference)."""
    import random
    import zlib

    from miles_plugins.optimizers.checkpoint.manifest import crc_mismatch
    from miles_plugins.optimizers.homes.file_io import BlockCrc

    data = random.Random(0).randbytes(10_000)
    for block in (4096, 3000, 10_000, 20_000):
        crc, at = BlockCrc(block), 0
        for size in [1, 4095, 5000, 7, 4096, 10_000]:
            crc.update(data[at : at + size])
            at += size
        assert crc.blocks == [zlib.crc32(data[i : i + block]) for i in range(0, len(data), block)]
    whole = BlockCrc(None)
    whole.update(data[:3])
    whole.update(data[3:])
    assert whole.blocks == [zlib.crc32(data)]
    assert BlockCrc(None).blocks == [0] and BlockCrc(4096).blocks == []  # an empty file, both forms
    bad = crc_mismatch([1, 2, 3], [1, 9, 3], 4096)
    assert bad.startswith("the CRC-32 of 1 of its 3 blocks of 4096 bytes") and "block 1, bytes 4096-8191" in bad
