"""``teller inject run --parallel``: lanes pinned to their cores, references first, one summary."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from teller.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPU cores to pin two lanes")
def test_parallel_campaign_records_every_run_in_pinned_lanes(smoke_campaign):
    """The session's smoke campaign is recorded with `teller inject run --parallel 2` (conftest)."""
    out = smoke_campaign["out"]
    assert smoke_campaign["lanes"] == 2 and smoke_campaign["exit_code"] == 0
    summary = json.loads((out / "campaign_summary.json").read_text())
    assert summary["runs"] == 3 and summary["finished"] == 3
    labels = {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/labels.json")}
    assert sorted(labels) == ["gil-r0", "normal-r0", "op-delay-r0"]
    all_cpus = sorted(os.sched_getaffinity(0))
    # the two faulty runs ran at the same time, each pinned to its own half of the cores
    lanes = [labels[r]["machine"]["cpus"] for r in ("op-delay-r0", "gil-r0")]
    assert all(0 < len(c) < len(all_cpus) for c in lanes) and not set(lanes[0]) & set(lanes[1])
    assert labels["op-delay-r0"]["label_summary"]["abnormal"] > 0


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPU cores to pin two lanes")
def test_run_lanes_deals_the_runs_and_the_cores_out(tmp_path):
    """The lanes of `teller inject run --parallel` and of scripts/gpu/campaign.py: lane k gets
    every lanes-th run from the k-th, its own cores, and its exit code comes back."""
    from teller.inject.campaign import run_lanes
    from teller.inject.spec import load_spec

    runs = load_spec(ROOT / "campaigns" / "cpu_smoke.toml").runs
    assert [r.name for r in runs] == ["normal", "op-delay", "gil"]
    # each lane pins itself, writes what it got and exits with its number of runs
    lane = ("import json, os, sys; os.sched_setaffinity(0, json.loads(sys.argv[2])); "
            "json.dump({'runs': sys.argv[3:], 'cpus': sorted(os.sched_getaffinity(0))}, open(sys.argv[1], 'w')); "
            "sys.exit(len(sys.argv) - 3)")

    def command(k: int, names: list[str], cpus: list[int]) -> list[str]:
        return [sys.executable, "-c", lane, str(tmp_path / f"lane{k}.json"), json.dumps(cpus), *names]

    assert run_lanes(runs, 2, command) == [2, 1]
    got = [json.loads((tmp_path / f"lane{k}.json").read_text()) for k in range(2)]
    assert [g["runs"] for g in got] == [["normal", "gil"], ["op-delay"]]
    cpus = [set(g["cpus"]) for g in got]
    assert all(cpus) and not cpus[0] & cpus[1] and cpus[0] | cpus[1] <= set(os.sched_getaffinity(0))
    # more lanes than runs: one lane a run, no empty lane started
    assert run_lanes(runs[:2], 4, command) == [1, 1]
    assert not (tmp_path / "lane2.json").exists()


def test_parallel_must_be_positive(tmp_path):
    assert main(["inject", "run", str(ROOT / "campaigns" / "cpu_smoke.toml"), "-o", str(tmp_path), "--parallel", "0"]) == 2
