"""`teller show` / `teller stats` on a hand-built reconstructed run."""

from __future__ import annotations

import io

import pyarrow as pa
import pytest
from rich.console import Console

from teller.cli import main
from teller.errors import TellerError
from teller.forest import Forest
from teller.inspect.show import show
from teller.inspect.stats import collect_stats
from teller.inspect.tree import shapes
from teller.rundir import FLAG_UNBOUND, RunDir, events_table

# node: (parent, layer, name, start, end)
NODES = [
    (-1, "STEP", "STEP id=7 reqs=req_0,req_1", 0, 1000),
    (0, "FE", "LlamaAttention", 10, 500),
    (1, "BE", "aten::mm", 20, 200),
    (2, "RT", "cudaLaunchKernel", 30, 40),
    (3, "K", "sm90_gemm_bf16", 50, 150),
    (1, "BE", "aten::softmax", 210, 400),
    (5, "RT", "cudaLaunchKernel", 220, 230),
    (5, "RT", "cudaLaunchKernel", 240, 250),
    (5, "RT", "cudaLaunchKernel", 260, 270),
    (6, "K", "softmax_kernel", 300, 320),
    (-1, "K", "orphan_kernel", 2000, 2100),
]


def _write_run(tmp_path):
    n = len(NODES)
    parent = [p for p, *_ in NODES]
    forest = pa.table({
        "node_id": pa.array(range(n), pa.int64()),
        "parent_id": pa.array(parent, pa.int64()),
        "layer": pa.array([x[1] for x in NODES]).dictionary_encode(),
        "name": pa.array([x[2] for x in NODES]).dictionary_encode(),
        "start_ns": pa.array([x[3] for x in NODES], pa.int64()),
        "end_ns": pa.array([x[4] for x in NODES], pa.int64()),
        "device": pa.array([0 if x[1] == "K" else -1 for x in NODES], pa.int32()),
        "step_id": pa.array([-1 if i == 10 else 0 for i in range(n)], pa.int64()),
        "flags": pa.array([FLAG_UNBOUND if i == 10 else 0 for i in range(n)], pa.int32()),
    })
    rd = RunDir(tmp_path / "run")
    rd.write_events(events_table({"kind": ["RANGE"] * 3 + ["RUNTIME"] * 4 + ["KERNEL"] * 3,
                                  "start_ns": list(range(10)), "end_ns": list(range(10))}))
    rd.write_table(forest, "forest")
    rd.write_table(pa.table({"step_id": pa.array([0], pa.int64()), "step_num": pa.array([7], pa.int64()),
                             "rank": pa.array([0], pa.int32()), "start_ns": pa.array([0], pa.int64()),
                             "end_ns": pa.array([1000], pa.int64()), "n_requests": pa.array([2], pa.int32())}), "steps")
    rd.write_table(pa.table({"request_id": ["req_0", "req_1"], "step_id": pa.array([0, 0], pa.int64()),
                             "rank": pa.array([0, 0], pa.int32())}), "requests")
    return rd.path


def test_forest_depth_and_subtree_counts(tmp_path):
    f = Forest.from_table(RunDir(_write_run(tmp_path)).read_table("forest"))
    assert f.depth.tolist() == [0, 1, 2, 3, 4, 2, 3, 3, 3, 4, 0]
    kernels = f.subtree_counts(f.layer == 6)  # K
    assert kernels[0] == 2 and kernels[1] == 2 and kernels[5] == 1 and kernels[10] == 1
    assert f.children(5).tolist() == [6, 7, 8]


def _render(**kw) -> str:
    buf = io.StringIO()
    show(console=Console(file=buf, width=200, color_system=None), **kw)
    return buf.getvalue()


def test_show_step_by_number_and_request(tmp_path):
    run = _write_run(tmp_path)
    out = _render(run=run, step=7)
    assert "STEP id=7" in out and "LlamaAttention" in out and "sm90_gemm_bf16" in out
    assert "2 kernels" in out
    # the three identical launches under softmax fold into one line... unless one has children
    assert "cudaLaunchKernel  ×2" in out
    assert _render(run=run, request="req_1").count("STEP id=7") == 1
    with pytest.raises(TellerError, match="req_9"):
        _render(run=run, request="req_9")
    with pytest.raises(TellerError, match="no step 99"):
        _render(run=run, step=99)


def test_show_depth_limit(tmp_path):
    out = _render(run=_write_run(tmp_path), step=7, depth=1)
    assert "LlamaAttention" in out and "aten::mm" not in out and "below depth 1" in out


def test_stats(tmp_path):
    s = collect_stats(_write_run(tmp_path))
    assert s["events"] == 10 and s["events_per_kind"] == {"RANGE": 3, "RUNTIME": 4, "KERNEL": 3}
    assert s["steps"] == 1 and s["requests"] == 2
    assert s["gpu_nodes"] == 3 and s["binding_coverage"] == pytest.approx(2 / 3)
    assert s["node_flags"] == {"unbound": 1}


def test_cli_show_and_stats(tmp_path, capsys):
    run = str(_write_run(tmp_path))
    assert main(["show", run, "--step", "7"]) == 0
    assert main(["stats", run]) == 0
    assert main(["show", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_show_without_steps_picks_the_richest_root(tmp_path):
    # a long root holding nothing (a profiler's own span) and a shorter one holding the work
    nodes = [(-1, "OTHER", "PyTorch Profiler (0)", 0, 10_000), (-1, "BE", "aten::linear", 10, 500),
             (1, "RT", "cudaLaunchKernel", 20, 30), (2, "K", "gemm", 40, 400)]
    forest = pa.table({
        "node_id": pa.array(range(4), pa.int64()), "parent_id": pa.array([p for p, *_ in nodes], pa.int64()),
        "layer": pa.array([x[1] for x in nodes]).dictionary_encode(),
        "name": pa.array([x[2] for x in nodes]).dictionary_encode(),
        "start_ns": pa.array([x[3] for x in nodes], pa.int64()), "end_ns": pa.array([x[4] for x in nodes], pa.int64()),
        "step_id": pa.array([-1] * 4, pa.int64()), "flags": pa.array([0] * 4, pa.int32()),
    })
    rd = RunDir(tmp_path / "run")
    rd.write_events(events_table({"kind": ["RANGE"], "start_ns": [0], "end_ns": [1]}))
    rd.write_table(forest, "forest")
    out = _render(run=rd.path)
    assert "no STEP ranges" in out and "aten::linear" in out and "gemm" in out
    assert "PyTorch Profiler" not in out


def test_identical_sibling_subtrees_fold_and_shapes_ignore_times(tmp_path):
    # four launches each with one kernel (same shape, different times), then a different launch
    nodes = [(-1, "BE", "aten::fill_", 0, 1000)]
    for i in range(4):
        nodes += [(0, "RT", "cudaLaunchKernel", 10 + 100 * i, 20 + 100 * i), (len(nodes), "K", "fill", 30 + 100 * i, 60 + 100 * i + i)]
    nodes += [(0, "RT", "cudaLaunchKernel", 900, 910)]
    forest = pa.table({
        "node_id": pa.array(range(len(nodes)), pa.int64()), "parent_id": pa.array([p for p, *_ in nodes], pa.int64()),
        "layer": pa.array([x[1] for x in nodes]).dictionary_encode(),
        "name": pa.array([x[2] for x in nodes]).dictionary_encode(),
        "start_ns": pa.array([x[3] for x in nodes], pa.int64()), "end_ns": pa.array([x[4] for x in nodes], pa.int64()),
        "step_id": pa.array([-1] * len(nodes), pa.int64()), "flags": pa.array([0] * len(nodes), pa.int32()),
    })
    f = Forest.from_table(forest)
    sh = shapes(f)
    assert sh[1] == sh[3] == sh[5] == sh[7] and sh[9] != sh[1] and sh[2] == sh[4]
    rd = RunDir(tmp_path / "run")
    rd.write_events(events_table({"kind": ["RANGE"], "start_ns": [0], "end_ns": [1]}))
    rd.write_table(forest, "forest")
    out = _render(run=rd.path)
    assert "cudaLaunchKernel  ×4  40 ns total  4 kernels" in out
    assert out.count("K fill ") == 1 and out.count("RT cudaLaunchKernel") == 2


def test_cli_exit_codes_and_usage_errors(capsys):
    import typer

    from teller.cli import run_app

    app = typer.Typer()

    @app.command()
    def fail(code: int = 5) -> None:
        raise typer.Exit(code)

    @app.command()
    def ok() -> None:
        pass

    assert run_app(app, ["fail"]) == 5 and run_app(app, ["ok"]) == 0
    assert run_app(app, ["fail", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "No such option: --bogus" in err and "Traceback" not in err
    assert main(["workload", "serve-tp", "--tp", "0"]) == 2
    assert main(["ingest"]) == 2 and "Missing argument" in capsys.readouterr().err


def test_show_step_shows_the_window_that_diagnose_flags(tmp_path):
    """A trace without STEP ranges: its steps are fixed windows (no step node); the window that
    ``teller diagnose`` flags is shown by ``teller show --step N``: the roots of its rows."""
    from pathlib import Path

    from teller.ingest import ingest
    from teller.reconstruct import reconstruct
    from teller.report.diagnose import diagnose

    src = Path(__file__).parent / "data" / "external" / "kineto" / "h200_transformers_cb_llama4l.json.gz"
    ingest(src, tmp_path / "run")
    assert reconstruct(tmp_path / "run")["steps_rule"] == "fixed windows"
    d = diagnose(tmp_path / "run", reference=[tmp_path / "run"], out=tmp_path / "out", params={"tail": 0.5})
    flagged = [x for x in d["steps"] if x["flag"]]
    assert flagged and all(x["node_id"] == -1 for x in flagged)
    step = flagged[-1]
    f = Forest.read(tmp_path / "run")
    roots = f.roots[f.step_idx[f.roots] == step["index"]]
    assert len(roots) >= 1
    out = _render(run=tmp_path / "run", step=step["step_num"], max_children=len(roots))
    shown = [ln for ln in out.splitlines() if ln and not ln[0].isspace() and ln[0] not in "├└│"]
    assert len(shown) == len(roots)
    assert all(f.name(int(r))[:40] in out for r in roots)
