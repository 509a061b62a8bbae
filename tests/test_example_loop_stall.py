"""The bundled scheduling-side fault (examples/cpu_loop_stall: the engine thread held 40 ms
before each scheduling call, outside every recorded range) is seen as an engine iteration whose
untraced time is a GAP node, and `teller diagnose` against the fault-free examples/cpu_normal
flags those iterations at their STEP (the iteration's gap), not at an operator."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from teller.forest import Forest
from teller.inject.labels import label_run
from teller.inspect.show import show
from teller.reconstruct import reconstruct
from teller.report.diagnose import diagnose

EX = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("loop")
    for name in ("cpu_loop_stall", "cpu_normal"):
        shutil.copytree(EX / name, d / name)
        reconstruct(d / name)
    label_run(d / "cpu_loop_stall", json.loads((d / "cpu_loop_stall" / "labels.json").read_text()))
    return d


def _abnormal(run: Path) -> list[int]:
    return [r["step_num"] for r in pq.read_table(run / "step_labels.parquet").to_pylist() if r["is_anomaly"]]


def test_stall_is_a_gap_node_of_the_iteration(runs):
    run = runs / "cpu_loop_stall"
    ab = _abnormal(run)
    assert len(ab) >= 10
    lab = json.loads((run / "labels.json").read_text())
    (w,) = lab["windows"]
    it = pq.read_table(run / "iterations.parquet")
    steps = pq.read_table(run / "steps.parquet")
    num = steps.column("step_num").to_numpy()
    gap = it.column("gap_ns").to_numpy()
    stalled = np.isin(num, ab)
    # the held time is untraced: ≥ 0.8 × the stall in every labelled iteration, ~0.1 ms elsewhere
    assert (gap[stalled] >= 0.8 * w["magnitude"] * 1e6).all()
    assert np.median(gap[~stalled]) < 0.1 * w["magnitude"] * 1e6
    f = Forest.read(run, columns=["layer", "name", "dur_ns", "step_idx"])
    is_gap = f.layer == 10
    big = is_gap & (f.dur_ns >= 0.8 * w["magnitude"] * 1e6)
    assert set(np.unique(f.step_idx[big]).tolist()) == set(np.flatnonzero(stalled).tolist())
    console = Console(record=True, width=200)
    show(run, step=int(ab[0]), depth=2, console=console)
    out = console.export_text()
    assert "GAP untraced" in out and out.splitlines()[0].startswith(f"iteration of step {ab[0]}")


def test_diagnose_flags_the_stalled_iterations_at_their_step(runs, tmp_path):
    run = runs / "cpu_loop_stall"
    diag = diagnose(run, reference=[runs / "cpu_normal"], out=tmp_path / "d.json", model=False)
    ab = set(_abnormal(run))
    flagged = {s["step_num"]: s for s in diag["steps"] if s["flag"]}
    hit = ab & set(flagged)
    assert len(hit) >= 0.8 * len(ab), (sorted(ab), sorted(flagged))
    assert sum(flagged[s]["top_family"] == "STEP" for s in hit) >= 0.8 * len(hit)
