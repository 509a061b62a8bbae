"""Fault injection: spec validation, registry, availability, and a recorded CPU campaign."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from teller.errors import InputError
from teller.inject import CATEGORIES
from teller.inject.mechanisms import registry
from teller.inject.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1]
BASE = '[campaign]\nname = "t"\n[workload]\nkind = "serve"\ndevice = "cpu"\n'


def test_every_category_has_two_mechanisms():
    reg = registry()
    for c in CATEGORIES:
        assert sum(m.category == c for m in reg.values()) >= 2, c
    for m in reg.values():
        assert m.knob and m.cause and m.evidence in ("targets", "step", "comm", "admission")


@pytest.mark.parametrize("body, field", [
    ('[[runs]]\nname = "a"\n[[runs.faults]]\nmechanism = "nope"\n', "runs[0].faults[0].mechanism"),
    ('[[runs]]\nname = "a"\n[[runs.faults]]\nmechanism = "gil_contention"\nmagnitude = -1\n', "runs[0].faults[0].magnitude"),
    ('[[runs]]\nname = "a"\n[[runs.faults]]\nmechanism = "gil_contention"\nstart_s = 0.1\nstart_step = 2\n', "runs[0].faults[0].start_step"),
    ('[[runs]]\nname = "a b"\n', "runs[0].name"),
    ('[[runs]]\nname = "a"\nworkload = { bogus = 1 }\n', "runs[0].workload.bogus"),
    ('[[runs]]\nname = "a"\n[[runs.faults]]\nmechanism = "gil_contention"\ncolour = 1\n', "runs[0].faults[0].colour"),
    ('', "runs"),
])
def test_invalid_spec_names_the_field(body, field):
    with pytest.raises(InputError) as e:
        parse_spec(BASE + body, "x.toml")
    assert field in str(e.value)


def test_shipped_specs_parse():
    for p in sorted((ROOT / "campaigns").glob("*.toml")):
        if p.name.startswith("hooks"):
            continue
        c = load_spec(p)
        assert c.runs


def test_gpu_only_mechanisms_skip_with_reason_on_cpu():
    ctx = {"gpu": False, "gpu_device": False, "tp": 1, "workload": "serve"}
    reg = registry()
    assert "GPU" in reg["gpu_membw_hog"].unavailable(ctx)
    assert "tensor-parallel" in reg["straggler_rank"].unavailable(ctx)
    assert reg["targeted_op_delay"].unavailable(ctx) is None
    assert reg["targeted_op_delay"].implementation(ctx).startswith("cpu-analogue")
    assert reg["netem_link"].unavailable({**ctx, "tp": 2})


def test_skipped_run_is_recorded_as_skipped(tmp_path):
    from teller.inject.campaign import run_campaign

    spec = BASE + '[[runs]]\nname = "hog"\n[[runs.faults]]\nmechanism = "gpu_compute_contention"\n'
    s = run_campaign(parse_spec(spec, "s.toml"), tmp_path)
    lab = json.loads((tmp_path / "hog-r0" / "labels.json").read_text())
    assert lab["status"] == "skipped" and "GPU" in lab["skipped"][0]["reason"]
    assert s["skipped"] == 1


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from teller.inject.campaign import run_campaign

    out = tmp_path_factory.mktemp("smoke")
    return out, run_campaign(ROOT / "campaigns" / "cpu_smoke.toml", out)


def test_smoke_campaign_labels(smoke):
    out, s = smoke
    assert s["finished"] == 3 and s["crashed"] == 0
    lab = json.loads((out / "op-delay-r0" / "labels.json").read_text())
    (w,) = lab["windows"]
    assert w["start_tau_ns"] < w["end_tau_ns"] and w["injections"] > 0
    assert w["targets_hit"] == ["FE LlamaMLP"]
    t = pq.read_table(out / "op-delay-r0" / "step_labels.parquet")
    ab = np.asarray(t.column("is_anomaly").to_pylist())
    inw = np.asarray(t.column("in_window").to_pylist())
    assert ab.any() and not (ab & ~inw).any()  # abnormal only inside the window
    rows = [r for r in t.to_pylist() if r["is_anomaly"]]
    assert all(r["operator_labels"] == ["FE LlamaMLP"] and r["fault_type"] == "kernel" for r in rows)
    assert all(r["effect_ms"] > r["ref_p99_ms"] for r in rows)
    assert "FE LlamaMLP" in rows[0]["explanation"]
    normal = pq.read_table(out / "normal-r0" / "step_labels.parquet")
    assert not any(normal.column("is_anomaly").to_pylist())


def test_smoke_dataset_build(smoke, tmp_path):
    from teller.dataset.build import build_dataset

    out, _ = smoke
    sheet = build_dataset([out], tmp_path / "ds", seed=0)
    rec = pq.read_table(tmp_path / "ds" / "records.parquet")
    assert sheet["records"] == rec.num_rows > 0 and sheet["abnormal"] > 0
    d = rec.to_pylist()
    # request-disjoint: every (run, request) in one split
    seen = {}
    for r in d:
        seen.setdefault((r["run_id"], r["request_id"]), set()).add(r["split_request"])
    assert all(len(v) == 1 for v in seen.values())
    # records keep their subtree: the forest rows of the step are in the dataset's subtrees
    from teller.dataset.codec import read_subtrees

    sub = read_subtrees(tmp_path / "ds")
    keys = set(zip(sub.column("run_id").to_pylist(), sub.column("node_id").to_pylist(), strict=False))
    assert all((r["run_id"], r["step_id"]) in keys for r in d)
    assert all((not r["is_anomaly"]) == (r["operator_labels"] == []) for r in d)
    assert (tmp_path / "ds" / "datasheet.md").read_text().startswith("# Datasheet")
    again = build_dataset([out], tmp_path / "ds2", seed=0)
    assert again["by_split"] == sheet["by_split"]
