"""Remainder mains: 16 stored bits plus the bf16 param rebuild every fp32 main exactly."""

import pytest
import torch

from miles_plugins.optimizers import StreamConfig, StreamConfigError, StreamedOptimizer
from miles_plugins.optimizers.formats import convert
from miles_plugins.optimizers.formats.remainder import decode_in_place, encode_in_place


def _bits(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _round_trip(main: torch.Tensor) -> tuple[torch.Tensor, int]:
    param = main.to(torch.bfloat16)  # what the step writes into the model param
    work = main.clone()
    exceptions = encode_in_place(work, param)
    stored = convert.stored_view(work, torch.int16).clone()
    rebuilt = torch.full_like(main, 12345.0)  # fresh storage: only the stored bits carry over
    convert.stored_view(rebuilt, torch.int16).copy_(stored)
    decode_in_place(rebuilt, param, exceptions)
    return rebuilt, len(exceptions)


def test_random_mains_round_trip_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    main = torch.randn(1 << 20, generator=g) * torch.logspace(-30, 30, 1 << 20)
    rebuilt, exceptions = _round_trip(main)
    assert torch.equal(rebuilt.view(torch.int32), main.view(torch.int32))
    assert exceptions < 64, "random mains should almost never need an exception"


@pytest.mark.parametrize(
    "name, bits",
    [
        # Exact ties (low half 0x8000): round-to-even goes down for even high halves, up for odd ones.
        ("tie, even high half", [0x3F808000, 0x3F828000, -0x407E8000]),
        ("tie, odd high half", [0x3F818000, 0x3F838000, -0x407F8000]),
        ("just above and below a tie", [0x3F808001, 0x3F807FFF, 0x3F81FFFF]),
        ("signed zeros and subnormals", [0, -0x80000000, 1, 0x00008000, -0x7FFF8000]),
        ("the largest finite (rounds to inf in bf16)", [0x7F7FFFFF, -0x0080_0001]),
        ("infinities", [0x7F800000, -0x00800000]),
        ("NaNs with payloads", [0x7FC12345, 0x7F80FFFF, -0x003EDCBB]),
    ],
)
def test_edge_values_round_trip_bit_for_bit(name, bits):
    main = _bits(bits)
    rebuilt, _ = _round_trip(main)
    assert rebuilt.view(torch.int32).tolist() == main.view(torch.int32).tolist(), name


def test_a_rebuilt_main_differs_when_the_exceptions_are_dropped():
    """The control: ties really need the exceptions (the test can fail)."""
    main = _bits([0x3F818000, 0x3F838000])
    param = main.to(torch.bfloat16)
    work = main.clone()
    exceptions = encode_in_place(work, param)
    assert len(exceptions) == 2
    decode_in_place(work, param, type(exceptions).none())
    assert not torch.equal(work.view(torch.int32), main.view(torch.int32))


def test_chunked_round_trip_crosses_chunk_boundaries(monkeypatch):
    """In-place conversions walk chunks in opposite directions; with tiny chunks
    every chunk overlaps its neighbours' bytes, and exceptions sit in several chunks."""
    monkeypatch.setattr(convert, "CHUNK_ELEMENTS", 7)
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31 - 1, (1000,), generator=g, dtype=torch.int64).to(torch.int32)
    bits[::37] = (bits[::37] & ~0xFFFF) | 0x8000  # ties spread over many chunks
    rebuilt, exceptions = _round_trip(bits.view(torch.float32))
    assert exceptions > 5
    assert torch.equal(rebuilt.view(torch.int32), bits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_encode_then_decode_in_place_equals_a_plain_cast(monkeypatch, dtype):
    monkeypatch.setattr(convert, "CHUNK_ELEMENTS", 5)
    values = torch.randn(333, generator=torch.Generator().manual_seed(2))
    expected = values.to(dtype).float()
    work = values.clone()
    stored = convert.encode_in_place(work, dtype)
    assert torch.equal(stored.float(), expected)
    convert.decode_in_place(work, dtype)
    assert torch.equal(work, expected)


def test_remainder_files_hold_two_bytes_per_main(tmp_path):
    model = torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16)
    sizes = {}
    for storage in ("fp32", "remainder"):
        optimizer = torch.optim.AdamW(model.parameters())
        config = StreamConfig(directory=str(tmp_path / storage), main_storage=storage)
        with StreamedOptimizer(optimizer, config) as streamed:
            (bucket,) = streamed.store.buckets
            sizes[storage] = bucket.segments["main"].entry_nbytes[0]
    assert sizes == {"fp32": 4 * 256 * 256, "remainder": 2 * 256 * 256}


def test_remainder_mains_refuse_non_bf16_params(tmp_path):
    model = torch.nn.Linear(8, 8).to(torch.float16)
    with pytest.raises(StreamConfigError, match="remainder mains need bf16 params"):
        StreamedOptimizer(
            torch.optim.AdamW(model.parameters()), StreamConfig(directory=str(tmp_path), main_storage="remainder")
        )
