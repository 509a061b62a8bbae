"""``teller inject run --parallel``: lanes pinned to their cores, references first, one summary."""

from __future__ import annotations

import json
import os
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


def test_parallel_must_be_positive(tmp_path):
    assert main(["inject", "run", str(ROOT / "campaigns" / "cpu_smoke.toml"), "-o", str(tmp_path), "--parallel", "0"]) == 2
