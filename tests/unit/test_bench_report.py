"""``bench.report`` on the repository's own files: the README's and the docs' generated
blocks equal what the committed results give (``--check``), an edited page or a stray
result file fails the check, the README's performance section keeps its shape, and the
comparisons behind the table (memory saved, Megatron dev at no more memory) and the
legacy files' reading hold."""

import json
import re
import shutil

import pytest

from bench import compare, legacy, report, workloads

GIB = 1 << 30


def test_the_pages_equal_what_the_committed_results_give(capsys):
    assert report.main(["--check"]) == 0, capsys.readouterr().err


@pytest.fixture
def copies(tmp_path, monkeypatch):
    """The README, docs/performance.md and bench/results/ copied, the report pointed at them."""
    for name in ("README", "DOCS"):
        copy = tmp_path / getattr(report, name).name
        shutil.copyfile(getattr(report, name), copy)
        monkeypatch.setattr(report, name, copy)
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "REPO", tmp_path)
    return tmp_path


def test_an_edited_number_fails_the_check_and_the_report_writes_it_back(copies, capsys):
    original = report.README.read_text()
    row = next(line for line in original.splitlines() if line.startswith("| host home, 3 GiB window"))
    edited = row.replace("1.122-1.125", "1.02")
    assert edited != row
    report.README.write_text(original.replace(row, edited))
    assert report.main(["--check"]) == 1
    assert "README.md: blocks performance differ" in capsys.readouterr().err
    assert report.main([]) == 0
    assert report.README.read_text() == original
    assert report.main(["--check"]) == 0


def test_a_result_file_the_report_does_not_read_fails_the_check(copies, capsys):
    (report.RESULTS / "iteration-h200-2026-12-04-stray.json").write_text("{}")
    (report.RESULTS / "orphan.png").write_bytes(b"")
    smoke = {"format": legacy.FORMAT, "workload": "dense-1b", "machine": "h200", "calls": [{"quick": True}]}
    (report.RESULTS / "dense-1b-h200.json").write_text(json.dumps(smoke))
    assert report.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "dense-1b-h200.json: a file the report does not read" in err
    assert "iteration-h200-2026-12-04-stray.json: a file the report does not read" in err
    assert "orphan.png: a file the report does not read" in err


def test_a_page_without_its_block_is_refused(copies):
    report.DOCS.write_text(report.DOCS.read_text().replace("<!-- /bench.report:codec -->", ""))
    with pytest.raises(SystemExit, match="needs one block <!-- bench.report:codec -->"):
        report.main(["--check"])


def _performance_section() -> str:
    text = report.README.read_text()
    return text[text.index("## Performance\n") : text.index("\n## ", text.index("## Performance\n") + 1)]


def test_the_readme_performance_section_is_short_with_one_table_every_number_from_a_file():
    section = _performance_section()
    assert len(section.splitlines()) <= 35
    table = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header == [
        "mode",
        "where the state lives",
        "exact",
        "GPU memory saved vs resident",
        "s/iter / resident",
        "vs Megatron dev at no more memory",
        "result file",
    ]
    rows = table[2:]
    assert 1 <= len(rows) <= 8
    assert not re.search(r"[*†‡§]", section.replace("**", ""))  # no footnote signs
    for row in rows:
        (name,) = re.findall(r"\(bench/results/([^)]+)\)", row.split("|")[-2])
        assert (report.RESULTS / name).is_file() and name in report.load()[0]
    for name in re.findall(r"\(bench/results/([^)]+)\)", section):
        assert (report.RESULTS / name).is_file()


def test_the_performance_page_stays_short():
    assert len(report.DOCS.read_text().splitlines()) <= 400


def _call(runs: dict[str, tuple[dict, float, int, dict]]) -> dict:
    """A call of (table entry, s/iter, peak GiB, stats beyond those) per mode."""
    return {
        "modes": {name: spec for name, (spec, *_) in runs.items()},
        "runs": {
            name: {
                "outcome": compare.OK,
                "stats": {"s_per_iter": {"median": s}, "max_reserved_bytes": peak * GIB, **more},
            }
            for name, (_, s, peak, more) in runs.items()
        },
    }


def test_a_mode_that_keeps_the_whole_state_on_the_gpu_saves_no_memory():
    resident = {"baseline": None, "dev_fraction": None, "ours": None}
    window = {"baseline": "resident", "dev_fraction": None, "ours": {"window_gb": 13}}
    home = {"baseline": "resident", "dev_fraction": None, "ours": {}}
    call = _call(
        {
            "resident": (resident, 1.9, 58, {}),
            "whole-window": (window, 1.94, 57, {"stored_bytes": 13.75e9}),
            "all-in-gpu-home": (home, 1.99, 57, {"placement": {"gpu": 23, "host": 0, "disk": 0}}),
            "host": (home, 2.3, 45, {"placement": {"gpu": 0, "host": 23, "disk": 0}}),
        }
    )
    rows = compare.summarize(call)
    assert rows["whole-window"]["saved_bytes"] == 0 and rows["all-in-gpu-home"]["saved_bytes"] == 0
    assert rows["host"]["saved_bytes"] == 13 * GIB
    assert rows["host"]["x_baseline"] == pytest.approx(2.3 / 1.9) and rows["resident"]["x_baseline"] is None


def test_dev_is_compared_at_no_more_memory_the_nearest_such_run():
    resident = {"baseline": None, "dev_fraction": None, "ours": None}
    ours = {"baseline": "resident", "dev_fraction": None, "ours": {}}

    def dev(fraction):
        return {"baseline": "resident", "dev_fraction": fraction, "ours": None}

    call = _call(
        {
            "resident": (resident, 1.9, 58, {}),
            "ours": (ours, 2.0, 52, {}),
            "dev@0.25": (dev(0.25), 1.95, 56, {}),
            "dev@0.5": (dev(0.5), 2.05, 53, {}),
            "dev@1": (dev(1), 2.2, 49, {}),
        }
    )
    row = compare.summarize(call)["ours"]
    assert row["vs_dev"]["dev"] == "dev@0.5" and row["vs_dev"]["ratio"] == pytest.approx(2.0 / 2.05)
    assert report.versus_dev([row]) == "2.4% faster than dev at fraction 0.5"
    del call["runs"]["dev@0.25"], call["runs"]["dev@0.5"]
    assert compare.summarize(call)["ours"]["vs_dev"] is None  # dev ran only with less memory


def test_the_legacy_iteration_file_reads_as_its_own_bench_summarized_it():
    name = "iteration-h200-2026-12-03-fraction-half.json"
    raw = json.loads((report.RESULTS / name).read_text())
    read = legacy.read(name, raw)
    assert len(read["calls"]) == len(raw["calls"])
    for call, raw_call in zip(read["calls"], raw["calls"], strict=True):
        for mode, run in call["runs"].items():
            old = raw_call["summary"][mode]
            assert run["stats"]["s_per_iter"]["median"] == pytest.approx(old["s_per_iter"])
            assert run["stats"]["max_reserved_bytes"] // 2**20 == old["max_reserved_mb"]
            assert run["stats"]["s_per_iter"]["n"] == raw_call["iters"] - legacy.ITERATION_WARMUP
            assert call["provenance"]["commit"] == "ff13426"


def test_the_legacy_modes_the_readme_names_by_suite_names_ran_the_suite_s_flags():
    for old, new in legacy.SUITE_NAMES.items():
        ran, suite_mode = legacy.ITERATION_MODES[old], workloads.DENSE_1B.mode(new)
        assert workloads.mode_flags(ran, "DIR") == workloads.mode_flags(suite_mode, "DIR"), old
    assert set(report.README_ROWS[1]) <= set(legacy.SUITE_NAMES)
