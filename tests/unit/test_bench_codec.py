"""``bench.codec``'s sweep on the CPU. The bench itself needs CUDA; its sweep's only CUDA
call, ``torch.cuda.synchronize``, is a no-op stand-in here. It converts through the
store's ``Codec`` (the reference formulations on the CPU), restores the exact mains, and
keeps what the bench compares between formulations: the largest entry's stored bytes and
every entry's remainder exceptions."""

import torch

from bench import codec
from miles_plugins.optimizers.formats import quant8


def test_the_sweep_round_trips_through_the_codec_and_keeps_what_the_bench_compares(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    entries = codec.gpt_entries(1, 64, vocab=256, seq=128)
    size = sum(entries)  # one bucket: far below the cap
    g = torch.Generator().manual_seed(0)
    main = torch.randn(size, generator=g) * 0.02
    bits = main.view(torch.int32)
    bits[::50] = (bits[::50] & ~0xFFFF) | 0x18000  # ties with an odd high half: exceptions
    m = torch.randn(size, generator=g) * 1e-3
    buffers = {"main": main.clone(), "exp_avg": m.clone(), "exp_avg_sq": m * m}
    result = codec.sweep(entries, buffers, torch.empty(size, dtype=torch.bfloat16))
    assert result["encode"] > 0 and result["decode"] > 0
    assert torch.equal(buffers["main"].view(torch.int32), main.view(torch.int32))  # remainder mains: exact
    largest = max(entries)
    nbytes = [t.numel() for t in result["stored"]]
    assert nbytes == [2 * largest, quant8.stored_nbytes(largest), quant8.stored_nbytes(largest)]
    (bucket,) = result["exceptions"]
    assert len(bucket) == len(entries) and sum(len(index) for index, _ in bucket) >= size // 50


def test_the_preparation_only_sweep_converts_nothing(monkeypatch):
    """``convert=False`` is what the bench subtracts from a profiled sweep's device time:
    the params rounded from the mains as in a full sweep, and no byte of the state touched."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    entries = codec.gpt_entries(1, 64, vocab=256, seq=128)
    size = sum(entries)
    g = torch.Generator().manual_seed(1)
    buffers = {name: torch.randn(size, generator=g) for name in ("main", "exp_avg", "exp_avg_sq")}
    before = {name: t.clone() for name, t in buffers.items()}
    param = torch.zeros(size, dtype=torch.bfloat16)
    result = codec.sweep(entries, buffers, param, convert=False)
    assert result["encode"] == result["decode"] == 0.0 and result["stored"] == []
    assert all(torch.equal(buffers[n].view(torch.int32), before[n].view(torch.int32)) for n in buffers)
    assert torch.equal(param, before["main"].bfloat16())  # one bucket: every entry's param prepared
