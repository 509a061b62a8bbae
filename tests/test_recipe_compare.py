"""benchmarks/recipe_compare.py: two recipes read over several trainings from goal_check's files —
the exact rank-sum test checked by hand, trainings pooled per split and view, blocks only one
recipe holds left out, and the committed workload comparison read again."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("recipe_compare", ROOT / "benchmarks" / "recipe_compare.py")
rc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rc)


def test_rank_sum_p_by_hand():
    # the last recipe holds the top two of five values: 1 of the C(5,2) = 10 ways
    assert rc.rank_sum_p([1.0, 2.0, 3.0], [4.0, 5.0]) == pytest.approx(0.1)
    # ranks 1 (0.8), 2 (0.85), 3 (0.9): picking one value, rank 2 or better in 2 of 3 ways
    assert rc.rank_sum_p([0.9, 0.8], [0.85]) == pytest.approx(2 / 3)
    # all tied: every way is as good
    assert rc.rank_sum_p([0.5, 0.5], [0.5]) == 1.0
    # the lowest value: every way is at least as good
    assert rc.rank_sum_p([0.9, 0.8], [0.1]) == 1.0


def _goal(path: Path, blocks: list[tuple[str, str, int, dict[str, float]]], row: str = "teller_sustained_family",
          source: str | None = None) -> str:
    checks = []
    for split, view, seed, vals in blocks:
        cells = {c: {"value": vals.get(c), "verdict": "ahead" if vals.get(c, 0) > 0.9 else "behind"} for c in rc.COLUMNS}
        checks.append({"split": split, "view": view, "seed": seed, "row": row, "cells": cells,
                       "source": source or f"{path.stem}/s{seed}.json"})
    path.write_text(json.dumps({"checks": checks}))
    return str(path)


def test_trainings_pooled_per_split_and_view(tmp_path):
    a1 = _goal(tmp_path / "a1.json", [("workload", "vertical", 1, {"step F1": 0.91}), ("workload", "vertical", 0, {"step F1": 0.89}),
                                      ("run", "vertical", 1, {"step F1": 0.95})])
    a2 = _goal(tmp_path / "a2.json", [("workload", "vertical", 0, {"step F1": 0.88})])
    b = _goal(tmp_path / "b.json", [("workload", "vertical", 0, {"step F1": 0.95}), ("workload", "vertical", 1, {"step F1": 0.93})])
    out = tmp_path / "c.json"
    assert rc.main(["--recipe", f"A={a1},{a2}", "--recipe", f"B={b}", "--json", str(out), "-o", str(tmp_path / "c.md")]) == 0
    got = json.loads(out.read_text())["comparison"]
    assert [(e["split"], e["view"]) for e in got] == [("workload", "vertical")]  # run: only A has it
    col = got[0]["columns"]["step F1"]
    a, bb = col["recipes"]
    assert a["values"] == [0.89, 0.91, 0.88] and a["seeds"] == [0, 1, 0]  # file by file, seed by seed
    assert a["mean"] == pytest.approx(0.8933333) and a["met"] == 1 and bb["met"] == 2
    assert col["p_last_above_first"] == pytest.approx(0.1)  # B holds the top two of five
    assert col["p_last_below_first"] == 1.0  # every way is at least as low
    assert got[0]["columns"]["Macro₊ F1"]["recipes"][0]["values"] == []  # no figure: nothing to compare
    assert "p_last_above_first" not in got[0]["columns"]["Macro₊ F1"]
    assert "| workload, vertical | step F1 | 0.890 / 0.910 / 0.880 ; 0.893 ; 1 of 3 |" in (tmp_path / "c.md").read_text()


def test_one_training_read_by_two_goal_files_counts_once(tmp_path):
    # both goal files took the request block from the same results file (the shipped model), the
    # run blocks from their own: the request block is one training, the run blocks two
    shared = "docs/evaluate_v2_all/seed4/results.json"
    a1 = _goal(tmp_path / "a1.json", [("request", "vertical", 4, {"step F1": 0.96})], source=shared)
    a2 = _goal(tmp_path / "a2.json", [("request", "vertical", 4, {"step F1": 0.96})], source=shared)
    a3 = _goal(tmp_path / "a3.json", [("run", "vertical", 1, {"step F1": 0.93})])
    a4 = _goal(tmp_path / "a4.json", [("run", "vertical", 1, {"step F1": 0.94})])
    b = _goal(tmp_path / "b.json", [("request", "vertical", 4, {"step F1": 0.95}), ("run", "vertical", 1, {"step F1": 0.92})])
    out = tmp_path / "c.json"
    assert rc.main(["--recipe", f"A={a1},{a2},{a3},{a4}", "--recipe", f"B={b}", "--json", str(out)]) == 0
    got = {e["split"]: e["columns"]["step F1"] for e in json.loads(out.read_text())["comparison"]}
    assert got["request"]["recipes"][0]["values"] == [0.96]
    assert got["request"]["p_last_above_first"] == 1.0  # 0.95 below the one training: every way as good
    assert got["request"]["p_last_below_first"] == pytest.approx(0.5)  # the lower of two values: 1 of 2 ways
    assert got["run"]["recipes"][0]["values"] == [0.93, 0.94]
    assert got["run"]["p_last_below_first"] == pytest.approx(1 / 3)  # the lowest of three


def test_a_file_without_the_row_is_refused(tmp_path, capsys):
    a = _goal(tmp_path / "a.json", [("workload", "vertical", 0, {"step F1": 0.9})], row="teller_mot_family")
    assert rc.main(["--recipe", f"A={a}", "--recipe", f"B={a}"]) == 2
    assert "no blocks of the row teller_sustained_family" in capsys.readouterr().err
    assert rc.main(["--recipe", "A", "--recipe", f"B={a}"]) == 2
    assert "expected NAME=GOAL.json" in capsys.readouterr().err


RES = ROOT / "benchmarks" / "results"


def _committed(tmp_path: Path, twelve: list[str], kept: str) -> list[dict]:
    """The 8-epoch goal files against the 12-epoch ones ``twelve``, compared again; checked equal to
    the committed comparison ``kept`` and returned."""
    if not all((RES / f).is_file() for f in twelve):
        pytest.skip("the goal files are not in this checkout")
    out = tmp_path / "c.json"
    assert rc.main(["--row", "teller_sustained_family",
                    "--recipe", f"8 epochs={RES / 'goal_h200_v2_all.json'},{RES / 'goal_h200_v2_all_third.json'}",
                    "--recipe", "12 epochs=" + ",".join(str(RES / f) for f in twelve), "--json", str(out)]) == 0
    got = json.loads(out.read_text())["comparison"]
    assert got == json.loads((RES / kept).read_text())["comparison"]
    return got


def test_the_committed_workload_comparison_reads_again(tmp_path):
    got = _committed(tmp_path, ["goal_h200_v2_all_ep12.json"], "recipe_compare_ep12_workload.json")
    prior = got[0]["columns"]["F1 at 10%"]
    assert (got[0]["split"], got[0]["view"]) == ("workload", "vertical")
    assert prior["p_last_above_first"] == pytest.approx(11 / 84) and prior["recipes"][1]["met"] == 2


def test_the_committed_comparison_of_every_block_reads_again(tmp_path):
    got = _committed(tmp_path, ["goal_h200_v2_all_ep12.json", "goal_h200_v2_all_ep12b.json"], "recipe_compare_ep12_all.json")
    by = {(e["split"], e["view"]): e["columns"] for e in got}
    # the shipped request model, read by both 8-epoch goal files, is one training
    assert [len(r["values"]) for r in by[("request", "vertical")]["step F1"]["recipes"]] == [1, 1]
    assert [len(r["values"]) for r in by[("workload", "vertical")]["step F1"]["recipes"]] == [6, 6]
    # run, vertically: the two 12-epoch Macro₊ figures are the lowest two of six (1 of C(6,2) = 15 ways)
    assert by[("run", "vertical")]["Macro₊ F1"]["p_last_below_first"] == pytest.approx(1 / 15)
    assert by[("workload", "vertical")]["step F1"]["p_last_above_first"] < 0.05
