"""The kernels' self-test (``formats/kernel_self_test.py``) against wrong kernels: copies of
``triton_kernels.py`` with one line changed, each a plausible bug, run by Triton's
interpreter on the CPU. Each must fail the self-test; each must also store other bytes
than the reference on some random input (a differential check, so that no mutant in
the set is a harmless rewrite); the kernels as they are must pass both (the control).

Each mutant runs in a process of its own, forked from one that has imported torch and
Triton: a mutant that writes past a buffer cannot disturb the next one. The fused
modules' constants are shrunk there (as in ``test_fused_codec_interpreted.py``) so that
the self-test's lengths, which follow them, cross chunk and program edges cheaply.

Not in the set, since the interpreter cannot show them (it runs the kernels with numpy,
whose division and square root round correctly, keep subnormals and whose max
propagates NaN): plain ``/`` or ``tl.sqrt`` for the correctly rounded ones, the
subnormal or tiny scalings removed whole, the scale's NaN rule dropped. Nor changes
that store the same bytes: a chunk that stands down one exception early (the host's
fallback finds the same ones), slots written past a run's capacity (a later run's
cover them, or nothing reads them), other padding in the decoders (never stored).
The GPU tier (``tests/gpu/test_fused_codec.py``) runs the compiled kernels."""

import difflib
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from miles_plugins.optimizers.formats import convert, fused, fused_remainder, quant8
from miles_plugins.optimizers.formats.kernel_self_test import (
    KernelMismatch,
    compare_quant8,
    compare_remainder,
    self_test,
)

KERNELS = Path(__file__).resolve().parents[2] / "miles_plugins" / "optimizers" / "formats" / "triton_kernels.py"

# Each mutant: (kernel, text in that kernel, its replacement; None deletes the line).
MUTANTS = {
    "midpoint comparison <= (first)": (
        "quantize",
        "(tl.load(mids_ptr + below) < v)",
        "(tl.load(mids_ptr + below) <= v)",
    ),
    "midpoint comparison <= (second)": (
        "quantize",
        "(tl.load(mids_ptr + below + 1) < v)",
        "(tl.load(mids_ptr + below + 1) <= v)",
    ),
    "approximate division": (
        "quantize",
        "v = tl.div_rn(numerator, tl.where(tiny, divisor * _TWO_64, divisor)[:, None])",
        "v = numerator * (1.0 / tl.where(tiny, divisor * _TWO_64, divisor)[:, None])",
    ),
    "padding 1.0": ("quantize", "other=0.0)", "other=1.0)"),
    "load one past the end": ("quantize", "mask=inside, other=0.0)", "mask=offs <= n, other=0.0)"),
    "scale stored one past the end": ("quantize", "mask=rows * BLOCK < n)", "mask=rows * BLOCK <= n)"),
    "scale from the smaller extreme": ("quantize", "tl.where(amax >= neg_amin,", "tl.where(amax <= neg_amin,"),
    "sign bit kept": ("quantize", "scale = (scale.to(tl.int32, bitcast=True) & 0x7FFFFFFF)", None),
    "NaN code rule dropped": ("quantize", "code = tl.where(v != v, 255, code)", None),
    "subnormal root not scaled up": (
        "quantize",
        "root = tl.sqrt_rn(tl.where(small, x * _TWO_64, x))",
        "root = tl.sqrt_rn(x)",
    ),
    "tiny block's numerator not scaled": (
        "quantize",
        "numerator = tl.where(tiny[:, None], x * _TWO_64, x)",
        "numerator = x",
    ),
    "program's first block dropped": (
        "quantize",
        "rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)",
        "rows = tl.program_id(0) + tl.arange(0, ROWS)",
    ),
    "dequantize one past the end": ("dequantize", "inside = offs < n", "inside = offs <= n"),
    "square flag inverted": ("dequantize", "if SQUARE:", "if not SQUARE:"),
    "tie rule dropped (encode)": (
        "remainder_encode",
        "rounded_up = (low < 0) & (low != -32768)",
        "rounded_up = low < 0",
    ),
    "zero low half rounds up (encode)": ("remainder_encode", "(low < 0) & (low", "(low <= 0) & (low"),
    "earlier chunks' slots dropped (before)": ("remainder_encode", "slot = before + first + ", "slot = first + "),
    "earlier programs' slots dropped (first)": ("remainder_encode", "slot = before + first + ", "slot = before + "),
    "run's first element dropped (base)": (
        "remainder_encode",
        "(offs.to(tl.int64) + base) << 16",
        "offs.to(tl.int64) << 16",
    ),
    "no stand-down after a stood-down chunk": (
        "remainder_encode",
        "stand_down = (tl.min(earlier, axis=0) < 0) | (before > capacity)",
        "stand_down = before > capacity",
    ),
    "stand-down ignored": ("remainder_encode", "inside = offs < tl.where(stand_down, 0, n)", "inside = offs < n"),
    "exception's high half sign-extended": (
        "remainder_encode",
        "((bits >> 16) & 0xFFFF).to(tl.int64)",
        "(bits >> 16).to(tl.int64)",
    ),
    "tie rule dropped (decode)": (
        "remainder_decode",
        "rounded_up = (low < 0) & (low != -32768)",
        "rounded_up = low < 0",
    ),
    "zero low half rounds up (decode)": ("remainder_decode", "(low < 0) & (low", "(low <= 0) & (low"),
    "low half sign-extended (decode)": ("remainder_decode", "(low.to(tl.int32) & 0xFFFF)", "low.to(tl.int32)"),
    "decode one past the end": ("remainder_decode", "inside = offs < n", "inside = offs <= n"),
}

# Random inputs per kind of kernel for the differential check; the control must pass all.
CASES = 12


def mutated(source: str, kernel: str, old: str, new: str | None) -> str:
    """``source`` with ``old`` (exactly once in ``kernel``'s definition) replaced by ``new``,
    or the line holding it deleted."""
    start = source.index(f"\ndef {kernel}(")
    end = source.find("\n@triton.jit", start)
    end = len(source) if end < 0 else end
    body = source[start:end]
    assert body.count(old) == 1, f"{old!r} is not in {kernel} exactly once"
    if new is None:
        at = body.index(old)
        line_start, line_end = body.rindex("\n", 0, at), body.index("\n", at)
        body = body[:line_start] + body[line_end:]
    else:
        body = body.replace(old, new)
    return source[:start] + body + source[end:]


# ---- in the interpreted process ---------------------------------------------------------


def _load(source: str, directory: str):
    """The kernels of ``source`` as a module (Triton reads a kernel's source from its file)."""
    path = os.path.join(directory, "mutant_kernels.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("mutant_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _random_moment(g, signed: bool, sqrt: bool):
    """An 8-bit moment of whole or partial blocks, each of a random kind: wide-ranging
    values, ties at a random scale, small values of one sign, zeros of either sign,
    non-finite values among others, subnormals."""
    block = quant8.BLOCK
    midpoints = quant8.tables(signed, torch.device("cpu"))[1]

    def uniform(lo: float, hi: float) -> float:
        return lo + (hi - lo) * float(torch.rand(1, generator=g))

    def one_block():
        kind = int(torch.randint(6, (1,), generator=g))
        if kind == 0:
            x = torch.randn(block, generator=g) * 10 ** uniform(-25, 8)
        elif kind == 1:
            d = 10 ** uniform(-22, 6)
            x = midpoints[torch.randint(len(midpoints), (block,), generator=g)] * d
            step = torch.randint(-1, 2, (block,), generator=g)
            x = torch.where(step < 0, torch.nextafter(x, x - 1), torch.where(step > 0, torch.nextafter(x, x + 1), x))
            x[int(torch.randint(block, (1,), generator=g))] = d
        elif kind == 2:
            x = torch.rand(block, generator=g) * 10 ** uniform(-6, -1) * (-1 if torch.rand(1, generator=g) < 0.5 else 1)
        elif kind == 3:
            x = torch.where(torch.rand(block, generator=g) < uniform(0, 1), torch.tensor(0.0), torch.tensor(-0.0))
        elif kind == 4:
            x = torch.randn(block, generator=g)
            specials = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan")])
            at = torch.randint(block, (2,), generator=g)
            x[at] = specials[torch.randint(4, (2,), generator=g)]
        else:
            x = torch.randn(block, generator=g) * 1e-40
        if sqrt and kind in (0, 1, 2):
            x = x.abs() * x.abs() if kind == 1 else x.abs()
        return x

    blocks = int(torch.randint(1, 40, (1,), generator=g))
    partial = int(torch.randint(1, block, (1,), generator=g)) if torch.rand(1, generator=g) < 0.7 else 0
    parts = [one_block() for _ in range(blocks)] + [one_block()[:partial]]
    return torch.cat(parts)


def _random_main(g, n: int, exceptions: int, within: int):
    """``n`` fp32 mains whose exceptions are ``exceptions`` random elements of the first
    ``within`` (odd-high ties and NaNs of either sign); the others finite, with exact
    ties of an even high half and low halves of zero at random densities."""
    bits = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int32, generator=g) & ~0x40000000
    bits += (bits & 0xFFFF) == 0x8000
    even_ties = torch.rand(n, generator=g) < float(torch.rand(1, generator=g)) * 0.3
    bits = torch.where(even_ties, (bits & ~0x1FFFF) | 0x8000, bits)
    zeros = torch.rand(n, generator=g) < float(torch.rand(1, generator=g)) * 0.3
    bits = torch.where(zeros, bits & ~0xFFFF, bits)
    at = torch.randperm(within, generator=g)[:exceptions]
    placed = bits[at]
    nan = torch.rand(len(at), generator=g) < 0.3
    bits[at] = torch.where(nan, (placed & 0x803CFFFF) | 0x7FC00000, (placed & ~0xFFFF) | 0x18000)
    return bits.view(torch.float32)


def _random_mains(g):
    """One to three mains converted one by one, of up to six scratch chunks, with no, a few
    or about a run's slots of exceptions; sometimes a packed group of small mains after them."""

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    mains = []
    for _ in range(randint(1, 3)):
        n = randint(1, 6 * fused.SCRATCH_ELEMENTS)
        mode, capacity = randint(0, 2), fused_remainder.exception_capacity(n)
        count = [0, min(n, randint(1, 20)), min(n, capacity + randint(-2, 4))][mode]
        mains.append(_random_main(g, n, count, randint(count, n)))
    groups = []
    if torch.rand(1, generator=g) < 0.5:
        first = len(mains)
        for _ in range(randint(2, 3)):
            n = randint(1, 2 * fused.ELEMENTS_PER_PROGRAM)
            count = randint(0, min(n, 8))
            mains.append(_random_main(g, n, count, n))
        groups.append(list(range(first, len(mains))))
    return mains, groups


def _first_difference(module, kernel: str, cases: int) -> str | None:
    """The first of ``cases`` random inputs on which ``module`` stores other bytes than the
    reference (or writes past an output), for the kind of conversion ``kernel`` serves."""
    cpu = torch.device("cpu")
    for case in range(cases):
        g = torch.Generator().manual_seed(case)
        try:
            if kernel in ("quantize", "dequantize"):
                for name, (signed, sqrt) in quant8.MOMENT_FORMATS.items():
                    compare_quant8(module, cpu, _random_moment(g, signed, sqrt), signed, sqrt, name)
            else:
                compare_remainder(module, cpu, *_random_mains(g))
        except KernelMismatch as exc:
            return f"case {case}: {exc}"
    return None


def _verdict(name: str | None, directory: str) -> dict:
    """Whether the self-test passes the kernels with mutant ``name`` (None: as they are),
    and the first random input whose bytes they change."""
    source = KERNELS.read_text()
    kernels = ["quantize", "remainder_encode"] if name is None else [MUTANTS[name][0]]
    module = _load(source if name is None else mutated(source, *MUTANTS[name]), directory)
    try:
        self_test(module, torch.device("cpu"))
        caught = None
    except KernelMismatch as exc:
        caught = str(exc)
    return {"caught": caught, "differs": [_first_difference(module, k, CASES) for k in kernels]}


def _run_isolated(name: str | None) -> dict:
    """:func:`_verdict` in a forked process of its own (its crash a verdict too)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        with tempfile.TemporaryDirectory() as directory:
            send.send(_verdict(name, directory))

    process = context.Process(target=child)
    process.start()
    send.close()
    try:
        verdict = receive.recv()
    except EOFError:
        verdict = {"crashed": True}
    process.join()
    return verdict


def main() -> None:
    """Every mutant's verdict and the control's, as JSON on stdout (shrunk constants)."""
    import triton  # noqa: F401  (once, before the forks)

    fused.SCRATCH_ELEMENTS, fused.PACKED_MAX_ELEMENTS, convert.CHUNK_ELEMENTS = 1024, 512, 512
    fused.BLOCKS_PER_PROGRAM, fused.ELEMENTS_PER_PROGRAM, fused_remainder._SLOTS_MIN = 4, 256, 64
    verdicts = {"control": _run_isolated(None)}
    for name in MUTANTS:
        verdicts[name] = _run_isolated(name)
    print(json.dumps(verdicts))


# ---- the tests ----------------------------------------------------------------------------

NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


@pytest.fixture(scope="module")
def verdicts() -> dict:
    # The interpreter is chosen when the kernels are decorated: a process of its own.
    repo = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@NEEDS_TRITON
def test_the_kernels_as_they_are_pass_the_self_test_and_store_the_reference_bytes(verdicts):
    assert verdicts["control"] == {"caught": None, "differs": [None, None]}


@NEEDS_TRITON
@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_kernel_with_a_planted_bug_fails_the_self_test(verdicts, name):
    verdict = verdicts[name]
    assert "crashed" not in verdict
    assert verdict["differs"][0] is not None, "no random input shows this change: not a bug, or the inputs miss it"
    assert verdict["caught"] is not None, f"the self-test let it through (random inputs catch it: {verdict['differs']})"


def test_each_planted_bug_changes_one_line():
    source = KERNELS.read_text().splitlines()
    for name, change in MUTANTS.items():
        diff = list(difflib.ndiff(source, mutated("\n".join(source), *change).splitlines()))
        removed, added = sum(d.startswith("- ") for d in diff), sum(d.startswith("+ ") for d in diff)
        assert (removed, added) in ((1, 1), (1, 0)), name


if __name__ == "__main__":
    main()
