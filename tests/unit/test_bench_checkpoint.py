"""``make bench-checkpoint`` runs end to end on a small store, both tiers (no timing
is asserted: the bench reports, it does not judge)."""

import json

import pytest

from bench import checkpoint_save


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_the_checkpoint_bench_times_every_kind_of_save(tmp_path, tier):
    out = tmp_path / "result.json"
    checkpoint_save.main(
        ["--elements", "80000", "--repeats", "1", "--tier", tier, "--dir", str(tmp_path), "--out", str(out)]
    )
    (run,) = json.loads(out.read_text())["runs"]
    keys = {"save_to_s", "background_call_s", "background_step_waits_s", "background_total_s", "blocked_over_sync"}
    assert keys <= set(run) and all(run[k] >= 0 for k in keys)
    assert ("plain_copy_s" in run) == (tier == "disk")
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"], "the bench removes what it made"
