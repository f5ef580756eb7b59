"""The README's performance table and docs/performance.md's tables, from the committed
result files in ``bench/results/``.

    python -m bench.report            # rewrite the generated blocks
    python -m bench.report --check    # exit 1 where a block differs from what the files give

Each generated block sits between ``<!-- bench.report:NAME -->`` and
``<!-- /bench.report:NAME -->``; the text around the blocks is the pages' own. Every file
in ``bench/results/`` must be one the report reads (the suite's results, the legacy
files of ``bench.legacy``, the codec and moment-format files named here, and a result's
plot beside it; never a smoke run's): ``--check`` names any other.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bench import compare, legacy, workloads
from bench.harness import REPO

RESULTS = REPO / "bench" / "results"
README = REPO / "README.md"
DOCS = REPO / "docs" / "performance.md"
# The README's rows: one file, the modes in the order shown (at most 8), each a mode of
# the suite's tables (a legacy file's modes by their suite names, bench.legacy.SUITE_NAMES).
README_ROWS = (
    "iteration-h200-2026-12-03-fraction-half.json",
    ("resident", "host+overlap-3g", "gpu6.15+host-d6-cap32m", "megatron-dev@0.5", "megatron-dev@1"),
)
# The headline: a model whose state the GPU does not hold, trained.
HEADLINE = ("scale-h200-2026-12-02-7b-auto-fp32.json", "7.6b-auto")
CODEC_FILES = ("codec-h200-2026-12-02-one-read-back.json", "codec-h200-2026-12-02-second-call.json")
MOMENT_FILES = ("moment_formats-cpu-2026-11-30.json", "moment_training-h200-2026-11-30.json")
MIB, GIB = 1 << 20, 1 << 30


def load() -> tuple[dict[str, dict], dict[str, dict], list[str]]:
    """The suite results (legacy ones converted) and the other files the report reads, by
    file name; and the files in ``bench/results/`` it does not read."""
    suites, others, unread = {}, {}, []
    for path in sorted(RESULTS.iterdir()):
        if path.suffix == ".png" and path.with_suffix(".json").exists():
            continue  # a result's plot, linked from its table
        if path.suffix != ".json":
            unread.append(path.name)
            continue
        data = json.loads(path.read_text())
        if path.name in legacy.LEGACY:
            suites[path.name] = legacy.read(path.name, data)
        elif data.get("format") == legacy.FORMAT and not any(c.get("quick") for c in data["calls"]):
            suites[path.name] = data  # a smoke run's (--quick) is no result
        elif path.name in CODEC_FILES + MOMENT_FILES:
            others[path.name] = data
        else:
            unread.append(path.name)
    return suites, others, unread


# -- how a mode and its figures read ------------------------------------------------------


def label(spec: dict) -> str:
    """A mode in words, from its table entry."""
    if spec.get("dev_fraction") is not None:
        return f"Megatron dev chunked offload, fraction {spec['dev_fraction']:g}"
    ours = spec.get("ours")
    if not ours:
        return "resident"
    parts = [f"{ours['tier']} home"] if ours.get("tier") else []
    for key, name in (("gpu_budget_gb", "GPU"), ("host_budget_gb", "host")):
        if ours.get(key) == "auto":
            parts.append(f"auto {name} budget")
        elif ours.get(key) is not None:
            parts.append(f"{name} budget {ours[key]:g} GiB")
    if ours.get("window_gb") is not None:
        parts.append(f"{ours['window_gb']:g} GiB window")
    if ours.get("main_storage") != "fp32":
        parts.append(f"{ours['main_storage']} mains")
    if ours.get("moment_dtype") != "fp32":
        parts.append(f"{ours['moment_dtype']} moments")
    if ours.get("buckets_in_flight"):
        parts.append(f"{ours['buckets_in_flight']} in flight")
    if ours.get("bucket_cap"):
        parts.append(f"buckets of {ours['bucket_cap'] / 1e6:g}M")
    return ", ".join(parts)


def where(spec: dict, stats: dict) -> str:
    """Where the state lives between steps: homes by buckets and bytes, the window."""
    if spec.get("dev_fraction") is not None:
        return f"pinned host memory {spec['dev_fraction']:.0%}, the rest on the GPU"
    if not spec.get("ours"):
        return "GPU"
    homes = stats.get("home_bytes") or {}
    placement = stats.get("placement") or {}
    text = ", ".join(
        f"{'GPU' if home == 'gpu' else home} {placement[home]} buckets ({homes.get(home, 0) / 1e9:.1f} GB)"
        for home in ("gpu", "host", "disk")
        if placement.get(home)
    )
    window = spec["ours"].get("window_gb")
    return text + (f"; {window:g} GiB of it on the GPU across the step" if window else "")


def exact(spec: dict) -> str:
    if spec.get("dev_fraction") is not None:
        return "not checked"
    ours = spec.get("ours")
    if not ours:
        return "reference"
    return "yes" if ours["moment_dtype"] == "fp32" else f"no ({ours['moment_dtype']} moments)"


def span(values: list[float], digits: int) -> str:
    """``a-b`` of the values at ``digits`` decimals, one figure when they round alike."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def _ok_calls(result: dict, name: str) -> list[tuple[dict, dict, dict]]:
    """(call, run, comparison) for every call where ``name`` ran to its end; refuses a
    mode that never did (the README and the headline name only modes with figures)."""
    found = []
    for call in result["calls"]:
        run = call["runs"].get(name)
        if run and run.get("outcome") == compare.OK:
            found.append((call, run, compare.summarize(call)[name]))
    if not found:
        raise SystemExit(f"bench.report: {name} ran to its end in no call of its file: nothing to show")
    return found


def versus_dev(rows: list[dict]) -> str:
    """Against Megatron dev at no more GPU memory, over the calls a mode ran in."""
    found = [row["vs_dev"] for row in rows if row["vs_dev"]]
    if not found:
        return "no dev run at its memory or more"
    percents = [(f["ratio"] - 1) * 100 for f in found]
    if max(percents) <= 0:
        text = f"{span([-p for p in percents], 1)}% faster"
    elif min(percents) >= 0:
        text = f"{span(percents, 1)}% slower"
    else:
        text = f"{span(percents, 1)}% (below 0: faster)"
    fractions = " and ".join(sorted({f"{f['dev_fraction']:g}" for f in found}))
    if len(found) == len(rows):
        calls = "" if len(rows) == 1 else f" ({_calls(len(rows))})"
    else:
        calls = f" (in {len(found)} of its {len(rows)} calls; the others had none at its memory)"
    return f"{text} than dev at fraction {fractions}{calls}"


def _link(name: str, prefix: str) -> str:
    return f"[`{name}`]({prefix}bench/results/{name})"


def _calls(count: int) -> str:
    return f"{count} call{'s' if count != 1 else ''}"


def _commit(result: dict) -> str:
    commits = sorted({str(c["provenance"].get("commit"))[:7] for c in result["calls"]})
    dirty = any(c["provenance"].get("dirty") for c in result["calls"])
    return ", ".join(commits) + (" (dirty)" if dirty else "")


# -- the README's block -------------------------------------------------------------------


README_HEADER = (
    "| mode | where the state lives | exact | GPU memory saved vs resident | s/iter / resident "
    "| vs Megatron dev at no more memory | result file |\n|---|---|---|---|---|---|---|"
)


def headline(suites: dict[str, dict]) -> str:
    name, mode = HEADLINE
    call, run, _ = _ok_calls(suites[name], mode)[0]
    spec, stats = call["modes"][mode], run["stats"]
    s, homes = stats["s_per_iter"], stats["home_bytes"]
    layers = int(spec["model"][spec["model"].index("--num-layers") + 1])
    gpu = call["provenance"]["gpus"][0].split(",")[0].removeprefix("NVIDIA ")
    return (
        f"A {workloads.gpt_params(layers) / 1e9:.1f}B GPT (Megatron-LM's `pretrain_gpt.py`) trains on one {gpu} "
        f"with its {stats['stored_bytes'] / 1e9:.1f} GB of fp32 optimizer state streamed by `auto` budgets, "
        f"exact: {s['median']:.2f} s/iter ({span([s['min'], s['max']], 2)} over {s['n']} iterations), "
        f"{homes['gpu'] / 1e9:.1f} GB of the state in the gpu home and {homes['host'] / 1e9:.1f} GB in host "
        f"memory, host MemAvailable never below {run['mem_available_bytes']['min'] / 1e9:.1f} GB "
        f"({_link(name, '')}, {_commit(suites[name])})."
    )


def readme_rows(suites: dict[str, dict]) -> str:
    name, modes = README_ROWS
    result = suites[name]
    lines = [README_HEADER]
    for mode in modes:
        found = _ok_calls(result, mode)
        call, run, _ = found[-1]
        spec = call["modes"][mode]
        rows = [row for *_, row in found]
        medians = [r["stats"]["s_per_iter"]["median"] for _, r, _ in found]
        if spec.get("baseline"):
            ratio = span([row["x_baseline"] for row in rows if row["x_baseline"]], 3)
            saved = [row["saved_bytes"] for row in rows if row["saved_bytes"] is not None]
            saved_text = ("none" if max(saved) == 0 else f"{span([b / GIB for b in saved], 1)} GiB") if saved else "-"
        else:
            ratio, saved_text = f"1 ({span(medians, 3)} s/iter)", "-"
        dev = "-" if spec.get("dev_fraction") is not None or not spec.get("baseline") else versus_dev(rows)
        suite_name = legacy.SUITE_NAMES[mode] if name in legacy.LEGACY else mode
        words = label(spec) if label(spec) == suite_name else f"{label(spec)} (`{suite_name}`)"
        cells = [words, where(spec, run["stats"]), exact(spec), saved_text, ratio, dev]
        cells.append(f"{_link(name, '')} ({_calls(len(found))}, {_commit(result)})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def noise(suites: dict[str, dict]) -> str:
    """One line: the spread of resident across the calls of the README's file, and of
    the peer's peak, and how many iterations each figure is a median of."""
    name, modes = README_ROWS
    result = suites[name]

    def spread(mode: str) -> tuple[list[float], list[float]]:
        found = _ok_calls(result, mode)
        medians = [run["stats"]["s_per_iter"]["median"] for _, run, _ in found]
        peaks = [run["stats"]["max_reserved_bytes"] / MIB for _, run, _ in found]
        return medians, peaks

    medians, peaks = spread("resident")
    line = (
        f"Run-to-run noise, as measured: resident ran {span(medians, 3)} s/iter and peaked {span(peaks, 0)} MiB "
        f"over the file's {len(medians)} calls"
    )
    for mode in modes:
        call = next(c for c in result["calls"] if mode in c["modes"])
        fraction = call["modes"][mode].get("dev_fraction")
        _, dev_peaks = spread(mode)
        if fraction is not None and len(dev_peaks) > 1:
            line += f"; dev at fraction {fraction:g} peaked {span(dev_peaks, 0)} MiB over {len(dev_peaks)} calls"
    counts = sorted({run["stats"]["s_per_iter"]["n"] for c in result["calls"] for run in c["runs"].values()})
    return line + f". Each s/iter is the median of {span(counts, 0)} measured iterations of one run."


def readme_block(suites: dict[str, dict]) -> str:
    return "\n\n".join([headline(suites), readme_rows(suites), noise(suites)])


# -- docs/performance.md's blocks ---------------------------------------------------------

DOCS_HEADER = (
    "| mode | call | outcome | s/iter median (min-max, n) | x resident | step s | peak reserved / allocated MiB "
    "| saved vs resident GiB | host MemAvailable min GB | read / written per step GB | vs dev at no more memory |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def _cell(value: float | None, text: str) -> str:
    return "-" if value is None else text


def result_table(name: str, result: dict) -> str:
    """Every run of every call of one result file, one row each."""
    lines = [
        f"{_link(name, '../')} ({result['machine']}, {_calls(len(result['calls']))}, commit {_commit(result)}):",
        "",
        DOCS_HEADER,
    ]
    for call in result["calls"]:
        compared = compare.summarize(call)
        for mode, run in call["runs"].items():
            row, stats, spec = compared[mode], run["stats"], call["modes"][mode]
            s, step = stats["s_per_iter"], stats["step_s"]
            reserved, allocated = stats["max_reserved_bytes"], stats["max_allocated_bytes"]
            moved = stats.get("step_bytes_moved")
            available = run.get("mem_available_bytes")
            expected = {True: "; expectation met", False: "; expectation NOT met"}.get(run.get("expected"), "")
            words = label(spec)
            cells = [
                mode if words == mode else f"{mode}: {words}",
                str(call["number"]),
                f"{run['outcome']}{expected}",
                _cell(s, s and f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}, {s['n']})"),
                _cell(row["x_baseline"], row["x_baseline"] and f"{row['x_baseline']:.3f}"),
                _cell(step, step and f"{step['median']:.3f}"),
                _cell(reserved, f"{(reserved or 0) / MIB:.0f} / " + (f"{allocated / MIB:.0f}" if allocated else "-")),
                _cell(row["saved_bytes"], f"{(row['saved_bytes'] or 0) / GIB:.2f}"),
                _cell(available, available and f"{available['min'] / 1e9:.1f}"),
                _cell(moved, moved and f"{moved['read'] / 1e9:.1f} / {moved['written'] / 1e9:.1f}"),
                versus_dev([row]) if spec.get("dev_fraction") is None and row["vs_dev"] else "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        if call["skipped"]:
            lines.append(f"\nCall {call['number']} did not run before its deadline: {', '.join(call['skipped'])}.")
    plot = (RESULTS / name).with_suffix(".png")
    if plot.exists():
        lines += ["", f"Its plot: [`{plot.name}`](../bench/results/{plot.name})."]
    return "\n".join(lines)


def workload_block(workload: str, suites: dict[str, dict]) -> str:
    tables = [result_table(name, result) for name, result in suites.items() if result["workload"] == workload]
    return "\n\n".join(tables) if tables else f"No committed result of `{workload}` yet."


def workloads_block() -> str:
    """Every workload's model and modes, as the suite's tables define them."""
    parts = []
    for workload in workloads.WORKLOADS.values():
        counts = ", ".join(map(str, workload.gpu_counts))
        parts.append(
            f"`{workload.name}`: {workload.title}; GPUs {counts} (the first by default). Model flags: "
            f"`{' '.join(workload.model)}`"
            + (f"; `--quick` adds `{' '.join(workload.quick)}`." if workload.quick else ".")
        )
        rows = ["| mode | flags | baseline | peers | expects | host limit |", "|---|---|---|---|---|---|"]
        for mode in workload.modes:
            # Ours without the two flags every streamed mode has (the switch, the directory).
            flags = workloads.placement_flags(mode.ours)[1:] if mode.ours else workloads.mode_flags(mode, "")
            model = " ".join(mode.model)
            cells = [
                mode.name,
                " ".join(f"`{f}`" for f in ([model] if model else []) + [" ".join(flags)] if f) or "(none)",
                mode.baseline or "-",
                ", ".join(mode.peers) or "-",
                {"oom": "out of memory", "identical": "byte-identical to its baseline"}.get(mode.expect, "-"),
                f"{mode.memory_max_gib:g} GiB" if mode.memory_max_gib else "-",
            ]
            rows.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts)


def moe_block() -> str:
    """The moe workload's model at each GPU count: its size and what resident holds per GPU."""
    shape = workloads.QWEN3_30B_A3B
    lines = [
        "| GPUs (EP) | layers | params | active per token | resident per GPU before activations |",
        "|---|---|---|---|---|",
    ]
    for gpus in sorted(workloads.MOE.gpu_counts):
        layers = workloads.moe_layers(gpus, shape)
        lines.append(
            f"| {gpus} | {layers} | {workloads.moe_params(layers, shape) / 1e9:.2f}B "
            f"| {workloads.moe_params(layers, shape, active=True) / 1e9:.2f}B "
            f"| {workloads.moe_resident_bytes_per_gpu(gpus, shape) / GIB:.1f} GiB |"
        )
    return "\n".join(lines)


def codec_block(others: dict[str, dict]) -> str:
    lines = [
        "| file | formulation | wall s, median (samples) | x bound | device busy s | device x bound | bytes equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in CODEC_FILES:
        data = others[name]
        for form in ("reference", "fused", "fused_graphs"):
            row = data[form]
            same = {True: "yes", False: "NO"}.get(row.get("same_stored_bytes"), "reference")
            lines.append(
                f"| {_link(name, '../')} | {form} | {row['total_s']:.3f} ({span(row['samples_total_s'], 3)}) "
                f"| {row['x_bound']:.2f} | {row['device_busy_s']:.3f} | {row['device_x_bound']:.2f} | {same} |"
            )
    first = others[CODEC_FILES[0]]
    return "\n".join(lines) + (
        f"\n\n{first['params'] / 1e9:.2f}B params, {first['entries']} entries in {first['buckets']} buckets; "
        f"the bound: {first['bound_s']:.4f} s ({first['copy_bandwidth_gbs']:.0f} GB/s device copies)."
    )


def moments_block(others: dict[str, dict]) -> str:
    lines = ["| file | moments | final loss | vs fp32 |", "|---|---|---|---|"]
    for name in MOMENT_FILES:
        for form, run in others[name]["runs"].items():
            lines.append(
                f"| {_link(name, '../')} | {form} | {run['final_loss']:.4f} | {run['relative_to_fp32'] * 100:+.2f}% |"
            )
    floor = others[MOMENT_FILES[0]]["loss_floor"]
    return "\n".join(lines) + f"\n\nThe corpus's loss floor (its entropy): {floor:.3f} nats."


def provenance_block(suites: dict[str, dict]) -> str:
    lines = [
        "| file | commit | dirty | GPU | torch | megatron-core | drive | commit known from |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, result in suites.items():
        for p in {json.dumps(c["provenance"], sort_keys=True): c["provenance"] for c in result["calls"]}.values():
            megatron = ", ".join(f"{k} {t.get('megatron_core')}" for k, t in (p.get("trees") or {}).items()) or "-"
            drive = p.get("drive") or {}
            cells = [
                _link(name, "../"),
                str(p.get("commit"))[:12],
                {True: "yes", False: "no"}.get(p.get("dirty"), "not recorded"),
                "; ".join(p.get("gpus") or []) or "-",
                p.get("torch") or "not recorded",
                megatron,
                f"{drive.get('model') or '-'} ({drive.get('filesystem')})" if drive else "-",
                p.get("commit_source", "the file"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def blocks(suites: dict[str, dict], others: dict[str, dict]) -> dict[Path, dict[str, str]]:
    return {
        README: {"performance": readme_block(suites)},
        DOCS: {
            "workloads": workloads_block(),
            "dense-1b": workload_block("dense-1b", suites),
            "scale-1gpu": workload_block("scale-1gpu", suites),
            "moe-shape": moe_block(),
            "moe": workload_block("moe", suites),
            "codec": codec_block(others),
            "moments": moments_block(others),
            "provenance": provenance_block(suites),
        },
    }


def replace(text: str, name: str, content: str, page: str) -> str:
    """``text`` with block ``name``'s content replaced (its markers must be there, once)."""
    begin, end = f"<!-- bench.report:{name} -->", f"<!-- /bench.report:{name} -->"
    pattern = re.compile(f"({re.escape(begin)}\n).*?({re.escape(end)})", re.S)
    if len(pattern.findall(text)) != 1:
        raise SystemExit(f"bench.report: {page} needs one block {begin} ... {end}")
    return pattern.sub(lambda m: m.group(1) + content + "\n" + m.group(2), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a page differs")
    args = parser.parse_args(argv)
    suites, others, unread = load()
    troubles = [
        f"bench/results/{name}: a file the report does not read (remove it, or read it here)" for name in unread
    ]
    for page, named in blocks(suites, others).items():
        text = page.read_text()
        new = text
        for name, content in named.items():
            new = replace(new, name, content, page.name)
        if new == text:
            continue
        if args.check:
            changed = [n for n, c in named.items() if replace(text, n, c, page.name) != text]
            troubles.append(
                f"{page.relative_to(REPO)}: blocks {', '.join(changed)} differ from the result files "
                "(python -m bench.report rewrites them)"
            )
        else:
            page.write_text(new)
            print(f"bench.report: wrote {page.relative_to(REPO)}")
    for trouble in troubles:
        print(f"bench.report: {trouble}", file=sys.stderr)
    return 1 if troubles else 0


if __name__ == "__main__":
    raise SystemExit(main())
