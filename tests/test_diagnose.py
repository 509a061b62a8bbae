"""`teller diagnose` end to end: the bundled example, foreign traces, planted anomalies, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from teller.errors import TellerError
from teller.evaluate.metrics import evaluate, operator_metrics, step_metrics
from teller.ingest import ingest
from teller.localize.cli import register as register_localize
from teller.report.cli import register
from teller.report.diagnose import diagnose, evidence_text, print_summary
from teller.testing.planted import Plant, write_planted_run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "h200_llama8l_cupti"
EXT = Path(__file__).resolve().parent / "data" / "external"


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    if not EXAMPLE.is_dir():
        pytest.skip("examples/h200_llama8l_cupti not present")
    out = tmp_path_factory.mktemp("ex") / "run"
    ingest(EXAMPLE, out)
    return out


@pytest.fixture(scope="module")
def example_diagnosis(example, tmp_path_factory):
    """The example judged against itself by the numeric stage (the root-cause model is
    tests/test_diagnose_model.py's), with rare modes (under 0.5% of a family) suspicious."""
    out = tmp_path_factory.mktemp("diag")
    return diagnose(example, reference=[example], out=out, html=True, params={"min_central_weight": 0.005},
                    model=False), out


def test_bundled_example_against_itself(example, example_diagnosis):
    d, out = example_diagnosis
    on_disk = json.loads((out / "diagnosis.json").read_text())
    assert on_disk["format"] == "teller.diagnosis" and on_disk["steps_rule"]["rule"] == "STEP ranges"
    assert len(on_disk["steps"]) == 20 and on_disk["summary"]["reconciled"]
    flagged = [s for s in on_disk["steps"] if s["flag"]]
    # judged against itself, the first step (lazy module loading) stands out, and few others
    assert 0 in {s["step_num"] for s in flagged} and len(flagged) <= 5
    assert on_disk["localizer"]["params"]["min_central_weight"] == 0.005
    forest = pq.read_table(example / "forest.parquet", columns=["node_id", "layer"])
    ids = set(forest.column("node_id").to_pylist())
    for s in flagged:
        assert s["candidates"] and s["suspects"] and s["requests"]
        sl = {n["id"] for n in s["slice"]["nodes"]}
        assert sl <= ids
        assert {x["node_id"] for x in s["suspects"]} <= sl
        assert all(n["parent"] in sl or n["parent"] == -1 for n in s["slice"]["nodes"])
        for x in s["suspects"]:
            assert x["layer"] in ("FE", "BE", "COMM", "OTHER", "STEP") and 0 <= x["a"] <= 1
            for item in x["evidence"]:
                assert {"feature", "value", "reference", "z"} <= set(item)
                assert evidence_text(item).startswith(item["feature"])
    # the step with lazy module loading: driver time is the evidence
    s0 = next(s for s in flagged if s["step_num"] == 0)
    assert any(i["feature"] == "drv_ns" and i["z"] > 10 for x in s0["suspects"] for i in x["evidence"])
    # ... which points to a runtime/driver fault, with no model (teller.localize.faulttype)
    et = s0["evidence_type"]
    assert et["fault_type"] == "runtime" and et["family"] == s0["candidates"][0]["family"]
    assert et["reason"].startswith(f"runtime: {et['family']}")
    from teller.report.diagnose import verdict_line

    assert f"runtime fault by the evidence ({et['family']}, {et['feature']})" in verdict_line(s0)
    assert et["alternative"] is None and "cannot tell" not in verdict_line(s0)
    # evidence that cannot rule out another type names it, in the record and the verdict line
    for s in flagged:
        e = s.get("evidence_type")
        if e:
            host = e["fault_type"] == "memory" and (e["feature"] in ("iter.per_kernel", "iter.host_busy") or (
                e["feature"] in ("dur_ns", "self_ns") and e["family"].split(" ")[0] in ("FE", "BE")))
            assert e["alternative"] == ("scheduling" if host else None)
            assert ("or scheduling (it cannot tell them apart)" in verdict_line(s)) == host
    assert all(s.get("evidence_type", {}).get("fault_type", "runtime") in
               ("communication", "kernel", "memory", "runtime", "scheduling") for s in flagged)
    assert all(s["score"] < 0.5 for s in on_disk["steps"] if not s["flag"])
    assert Path(d["paths"]["html"]).is_file()


def test_suspects_are_lifted_to_their_module(example, example_diagnosis):
    from rich.console import Console

    from teller.forest import Forest
    from teller.report.diagnose import verdict_line

    d, _ = example_diagnosis
    fa = Forest.read(example)
    row = {int(n): i for i, n in enumerate(fa.node_id.tolist())}
    fe = fa.layer == 1  # LAYERS.index("FE")
    lifted_be = 0
    for s in (x for x in d["steps"] if x["flag"]):
        mods = []
        for x in s["suspects"]:
            r = row[x["node_id"]]
            m = x["module"]
            if x["layer"] == "FE":
                assert m == {"node_id": x["node_id"], "family": x["family"]}
            else:
                # the nearest enclosing FE module, walking up the forest's parents
                p = fa.parent[r]
                while p >= 0 and not fe[p]:
                    p = fa.parent[p]
                assert (m is None) == (p < 0)
                if m is not None:
                    assert m["node_id"] == int(fa.node_id[p]) and m["family"].startswith("FE ")
                    lifted_be += x["layer"] == "BE"
            mods.append(m["family"] if m else x["family"])
        assert s["modules"] == list(dict.fromkeys(mods))
        # the operators the stage names: the evidence's family first, then the candidates, framework
        # ops lifted to the modules around their suspects, at most three (what `teller evaluate` scores)
        et = s.get("evidence_type")
        fams = ([et["family"]] if et else []) + [c["family"] for c in s["candidates"]]
        want = []
        for f in fams:
            around = [x["module"]["family"] for x in s["suspects"] if x["family"] == f and x["module"]] if f.startswith("BE ") else []
            want += around or [f]
        assert s["operators"] == list(dict.fromkeys(want))[:3] and 1 <= len(s["operators"]) <= 3
        if et:
            assert s["operators"][0] in ([et["family"]] + mods)
        first = s["suspects"][0]
        line = verdict_line(s)
        if first["module"] and first["module"]["family"] != first["family"]:
            assert f"{first['family']} in {first['module']['family']}" in line
    assert lifted_be > 0  # the example's suspects include BE ops inside modules
    con = Console(record=True, width=200)
    print_summary(d, con)
    assert " in FE " in con.export_text()


def test_report_page_is_self_contained(example_diagnosis):
    d, out = example_diagnosis
    page = (out / "report.html").read_text()
    assert "<style>" in page and "<script" not in page
    for bad in ("src=\"http", "href=\"http", "src='http", "@import", "<link", "url("):
        assert bad not in page
    flagged = [s for s in d["steps"] if s["flag"]]
    assert flagged and all(f'id="step-{s["index"]}"' in page for s in flagged[:25])
    assert page.index('id="verdict"') < page.index('id="timeline"') < page.index('id="legend"')
    # the evidence trees show the reference's typical duration of the scored nodes
    nodes = [n for s in flagged for n in s["slice"]["nodes"]]
    assert all("reference_dur_ns" in n for n in nodes)
    assert any(n["reference_dur_ns"] for n in nodes if n["layer"] in ("FE", "BE"))
    assert all(n["reference_dur_ns"] is None for n in nodes if n["layer"] in ("RT", "DRV", "K"))


def test_console_summary(example_diagnosis):
    from rich.console import Console

    con = Console(record=True, width=120)
    print_summary(example_diagnosis[0], con)
    text = con.export_text()
    n = example_diagnosis[0]["summary"]["steps_flagged"]
    assert "worst steps" in text and f"flagged {n}" in text and "step 0" in text


def test_no_reference_reads_the_run_against_its_own_steps(example, example_diagnosis, tmp_path):
    """A run diagnosed alone is compared with its own steps, and says so; judged against itself
    it flags what it flags against itself given as the reference, and the steps the first fit
    flags are left out of the reference it is read against."""
    from teller.localize import SELF_REFERENCE_WARNING

    d = diagnose(example, out=tmp_path, params={"min_central_weight": 0.005}, model=False)
    sr = d["localizer"]["self_reference"]
    assert d["reference"].startswith("the run's own steps (no reference given") and SELF_REFERENCE_WARNING in d["health"]["lines"]
    warm = sum(bool(s.get("warmup")) for s in d["steps"])
    # 16 steps besides warm-up: fewer than a second fit needs left, so the first fit is the reference
    assert sr["steps"] == len(d["steps"]) - warm == 16 < sr["min_steps"] and sr["left_out"] == 0
    assert d["localizer"]["reference_steps"] == sr["steps"] - sr["left_out"]
    assert d["reference_match"]["same_deployment"] is True
    given, _ = example_diagnosis
    assert {s["step_num"] for s in given["steps"] if s["flag"]} <= {s["step_num"] for s in d["steps"] if s["flag"]}
    text = (tmp_path / "diagnosis.json").read_text()
    assert "no reference given" in text
    # the stage fitted on no run at all (`teller localize fit` without runs) names the commands that make one
    from teller.localize import fit_localizer

    with pytest.raises(TellerError) as e:
        fit_localizer([])
    msg = str(e.value)
    assert "--reference" in msg and "teller localize fit" in msg and "teller record" in msg
    with pytest.raises(TellerError, match="either --reference"):
        diagnose(example, reference=[example], localizer=tmp_path / "x.npz", out=tmp_path)


def test_cli_fit_then_diagnose(example, tmp_path):
    app = typer.Typer()
    register_localize(app)
    register(app)
    runner = CliRunner()
    art = tmp_path / "loc.npz"
    r = runner.invoke(app, ["localize", "fit", str(example), "-o", str(art)])
    assert r.exit_code == 0, r.output
    assert art.is_file()
    r = runner.invoke(app, ["diagnose", str(example), "--localizer", str(art), "-o", str(tmp_path / "o"), "--html"])
    assert r.exit_code == 0, r.output
    assert "worst steps" in r.output
    d = json.loads((tmp_path / "o" / "diagnosis.json").read_text())
    assert d["reference"] == f"localizer {art}"
    # with the default rare-mode weight the warm-ups are a mode of the reference itself
    assert sum(s["flag"] for s in d["steps"]) <= 5
    assert (tmp_path / "o" / "report.html").is_file()


@pytest.mark.parametrize("name,rule,layers", [
    ("nsys/cupy_report3.sqlite", "fixed windows", ["RT", "DRV"]),
    ("kineto/h200_torch211_matmul.json.gz", "profiler steps", ["FE", "BE", "COMM", "OTHER", "STEP"]),
    ("kineto/hta_backward_thread.json", "STEP ranges", ["FE", "BE", "COMM", "OTHER", "STEP"]),
])
def test_foreign_traces(tmp_path, name, rule, layers):
    run = tmp_path / "run"
    ingest(EXT / name, run)
    notes = []
    d = diagnose(run, reference=[run], out=tmp_path / "o", note=notes.append)  # reconstructs first
    assert any("teller reconstruct" in n for n in notes)
    assert d["steps_rule"]["rule"] == rule and d["instance_layers"] == layers
    assert d["summary"]["instances_in_steps"] > 0
    assert (tmp_path / "o" / "diagnosis.json").is_file()


def test_diagnose_reconstructs_once_and_reads_the_same_steps(tmp_path):
    """A run without a forest (or with one written before reconstruct decided the steps) is
    reconstructed by the public call, once; its steps are then those of steps.parquet."""
    from teller.reconstruct.ensure import ensure_reconstructed

    run = tmp_path / "run"
    ingest(EXT / "nsys" / "cupy_report3.sqlite", run)
    notes = []
    ensure_reconstructed(run, notes.append, window_ns=2_000_000)
    assert len(notes) == 1 and "no forest.parquet yet" in notes[0] and f"teller reconstruct {run}" in notes[0]
    summary = json.loads((run / "reconstruct.json").read_text())
    assert summary["steps_rule"] == "fixed windows" and "windows of 2 ms" in summary["steps_detail"]
    stamp = (run / "forest.parquet").stat().st_mtime_ns
    ensure_reconstructed(run, notes.append)  # reconstructed: used as it is
    assert len(notes) == 1 and (run / "forest.parquet").stat().st_mtime_ns == stamp
    old = pq.read_table(run / "forest.parquet").drop_columns(["step_idx"])
    pq.write_table(old, run / "forest.parquet")
    ensure_reconstructed(run, notes.append)
    assert len(notes) == 2 and "predates" in notes[1]
    assert "step_idx" in pq.read_schema(run / "forest.parquet").names


def test_planted_slowdowns_are_found(tmp_path):
    write_planted_run(tmp_path / "ref", 40_000, [], seed=1)
    plants = [Plant("BE aten::mul", [12, 40], "host", 4.0), Plant("BE aten::silu", [70], "churn", 4.0)]
    write_planted_run(tmp_path / "bad", 40_000, plants, seed=2)
    labels = json.loads((tmp_path / "bad" / "labels.json").read_text())
    assert labels["windows"] and {w["mechanism"] for w in labels["windows"]} == {"host", "churn"}
    d = diagnose(tmp_path / "bad", reference=[tmp_path / "ref"], out=tmp_path / "o")
    m = evaluate(d, labels)
    # the synthetic reference and test differ in structure too (op counts per module are drawn per
    # run), so a step or two of unusual shape may be flagged besides the planted ones
    assert m["step"]["recall"] == 1.0 and m["step"]["fp"] <= 2
    assert m["operator"]["macro_plus_f1"] >= 0.75
    by_num = {s["step_num"]: s for s in d["steps"]}
    assert by_num[12]["candidates"][0]["family"] == "BE aten::mul"
    churn = by_num[70]
    assert churn["candidates"][0]["family"] == "BE aten::silu"
    # evidence of allocator churn: more runtime calls and runtime time than the reference
    feats = {i["feature"] for x in churn["suspects"] for i in x["evidence"]}
    assert {"rt_n", "rt_ns"} & feats


def test_planted_slowdowns_without_a_reference(tmp_path):
    """The planted run alone: its halves (78 and 79 steps) are read against each other, the second,
    from which the first departs more (the two `aten::mul` steps), is the reference, and the three
    planted steps are found: the `aten::mul` ones by that family, the churn step by the decoder
    layer enclosing `aten::silu` (its module's time against a reference half of 78 steps; a
    fault-free recording names the op itself, the test above)."""
    from teller.localize import SELF_REFERENCE_HALF_STEPS

    plants = [Plant("BE aten::mul", [12, 40], "host", 4.0), Plant("BE aten::silu", [70], "churn", 4.0)]
    write_planted_run(tmp_path / "bad", 40_000, plants, seed=2)
    labels = json.loads((tmp_path / "bad" / "labels.json").read_text())
    d = diagnose(tmp_path / "bad", out=tmp_path / "o", model=False)
    m = evaluate(d, labels)
    assert m["step"]["recall"] == 1.0 and m["step"]["fp"] <= 1
    sr = d["localizer"]["self_reference"]
    sp = sr["spans"]
    assert min(sp["first"], sp["second"]) >= SELF_REFERENCE_HALF_STEPS and sp["first"] + sp["second"] == sr["steps"]
    assert sp["reference"] == "second" and sp["first_departs"] > sp["second_departs"]
    assert d["localizer"]["reference_steps"] == sr["reference_steps"] == sp["second"] - sr["left_out"]
    assert "the second half of its 157 steps outside warm-up (after step 80)" in d["reference"]
    by_num = {s["step_num"]: s for s in d["steps"]}
    assert by_num[12]["candidates"][0]["family"] == by_num[40]["candidates"][0]["family"] == "BE aten::mul"
    assert by_num[70]["candidates"][0]["family"] == "FE LlamaDecoderLayer"
    # the whole run as the reference (the rule for runs too short to halve): the repeated slowdown is absorbed
    from teller.localize import own_reference_steps

    calls = []

    def flags(mask):
        calls.append(int(mask.sum()))
        return np.zeros(len(mask), bool)

    ref, info = own_reference_steps(np.arange(60), np.ones(60, bool), flags)
    assert ref.all() and "spans" not in info and calls == [60]  # 30 a half: fewer than the halves need
    ref, info = own_reference_steps(np.arange(100), np.ones(100, bool), flags)
    assert calls[1:] == [50, 50] and info["spans"]["reference"] == "first" and ref[:50].all() and not ref[50:].any()


def test_leave_out_is_checked(tmp_path):
    from teller.localize import fit_localizer

    write_planted_run(tmp_path / "ref", 40_000, [], seed=1)
    with pytest.raises(ValueError, match="1 runs"):
        fit_localizer([tmp_path / "ref"], leave_out=[None, None])
    with pytest.raises(ValueError, match=r"leave_out\[0\]: 3 values"):
        fit_localizer([tmp_path / "ref"], leave_out=[np.zeros(3, bool)])


def test_metric_definitions():
    m = step_metrics(np.array([1, 1, 0, 0], bool), np.array([1, 0, 1, 0], bool))
    assert (m["precision"], m["recall"], m["f1"], m["accuracy"]) == (0.5, 0.5, 0.5, 0.5)
    o = operator_metrics([set(), {"a"}, {"a", "b"}], [set(), {"a", "c"}, set()])
    # both empty: f = j = 1, p = r = 0; {a} vs {a,c}: p .5 r 1 f 2/3 j .5; {a,b} vs {}: all 0
    assert o["f1"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert o["precision"] == pytest.approx((0 + 0.5 + 0) / 3)
    assert o["jaccard"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert o["macro_plus_f1"] == pytest.approx((2 / 3 + 0) / 2)
    assert o["macro_plus_recall"] == pytest.approx(0.5) and o["operator_positive_steps"] == 2


def test_iteration_durations_are_shown_as_durations():
    assert evidence_text({"feature": "iter.gap", "value": 4.38e7, "reference": 1.06e5, "ratio": 412.2, "z": 18.5}) == \
        "iter.gap 43.80 ms vs 106.0 µs (412.2×, z=+18.5)"


def test_a_cut_trace_is_diagnosed_as_partial(tmp_path):
    """A trace cut mid-file is read up to the cut; the diagnosis says the run is partial and
    why, in diagnosis.json, on the console and in the report (issue: damage shown where the
    user looks)."""
    import gzip

    src = EXT / "kineto" / "hta_backward_thread.json"
    text = src.read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(text[: int(len(text) * 0.6)]))
    ingest(src, tmp_path / "ref")
    ingest(cut, tmp_path / "cut")
    d = diagnose(tmp_path / "cut", reference=[tmp_path / "ref"], out=tmp_path / "o", html=True, model=False)
    h = d["health"]
    assert h["partial"] and [r["status"] for r in h["runs"]] == ["damaged", "complete"]
    assert any("cut or corrupt" in ln and ln.startswith("run ") for ln in h["lines"])
    assert json.loads((tmp_path / "o" / "diagnosis.json").read_text())["health"] == h
    page = (tmp_path / "o" / "report.html").read_text()
    assert "The input is partial" in page and "cut or corrupt" in page
    from rich.console import Console

    con = Console(record=True, width=200)
    print_summary(d, con)
    assert "is partial (damaged)" in con.export_text()
    # the intact trace is not partial, and says nothing
    d2 = diagnose(tmp_path / "ref", reference=[tmp_path / "ref"], out=tmp_path / "o2", model=False)
    assert not d2["health"]["partial"] and d2["health"]["lines"] == []
