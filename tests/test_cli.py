"""The console path a user meets: help of every command, closing lines in words (counters behind
--verbose), no wrapping off a terminal, refusing to overwrite an output folder, natural request-id
order, progress bars only on a terminal."""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
import unicodedata
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from teller.cli import app, main
from teller.cliutil import WIDE, console, fresh_dir, progress
from teller.errors import TellerError
from teller.logs.ids import natural_key
from teller.summary import ingest_lines, reconstruct_lines

ROOT = Path(__file__).resolve().parents[1]
KINETO = ROOT / "tests" / "data" / "external" / "kineto" / "h200_transformers_cb_llama4l.json.gz"
NORMAL = ROOT / "examples" / "h200_normal_a"


def _commands(cmd, path=()):
    """(argv path, click command) of every command and group under ``cmd``."""
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, (*path, name))


ALL = list(_commands(typer.main.get_command(app)))


def _flat(s: str) -> str:
    """Whitespace collapsed, and click's line breaks after a hyphen (``--out-`` / ``json``) joined."""
    return " ".join(re.sub(r"-[ \t]*\n[ \t]*", "-", s).split())


def test_every_command_is_reached():
    names = {" ".join(p) for p, _ in ALL}
    assert {"ingest", "reconstruct", "show", "record", "workload serve", "inject run", "dataset build",
            "tpe train", "rca predict", "diagnose", "export", "localize fit"} <= names
    assert len(ALL) >= 25


@pytest.mark.parametrize("path", [p for p, _ in ALL], ids=lambda p: " ".join(p) or "teller")
def test_help_shows_every_help_text_as_written(path):
    """Rendered through typer: no ``:a:`` emoji codes substituted, no ``<bool>`` metavar on flags,
    and every option's help text present word for word."""
    cmd = dict(ALL)[path]
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "100"})
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "<bool>" not in out
    assert not [c for c in out if unicodedata.category(c) == "So"], out  # emoji and pictographs
    for p in cmd.params:
        if getattr(p, "help", None):
            assert _flat(p.help) in _flat(out), (p.name, p.help)
        if getattr(p, "is_flag", False):  # no metavar after a flag: "--force   Replace ..."
            flag = max(p.opts, key=len)
            line = next(x for x in out.splitlines() if re.search(rf"(^|[ ,]){re.escape(flag)}( |,|$)", x))
            assert not re.search(rf"{re.escape(flag)} <", line), line


def test_workload_help_keeps_distribution_forms():
    out = CliRunner().invoke(app, ["workload", "serve", "--help"]).stdout
    assert "uniform:A:B" in out and "normal:MEAN:STD" in out and "🅰" not in out


# --------------------------------------------------------------------------------------------
# closing lines in words


def _err_lines(res) -> list[str]:
    return [x for x in res.stderr.splitlines() if x.strip()]


def test_ingest_ends_with_lines_in_words_and_counters_behind_verbose(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["ingest", str(KINETO), "-o", str(out)])
    assert res.exit_code == 0, res.output
    lines = _err_lines(res)
    assert 2 <= len(lines) <= 4, lines
    text = "\n".join(lines)
    assert "(Kineto trace, 1 file, 1 rank)" in text and "7,534 events (3,555 runtime calls, 3,067 kernels" in text
    assert "left out 7,449 records that are not timed events: 7,389 flow arrows" in text
    assert f"next: teller reconstruct {out}" in text
    assert "events_in" not in text and "=" not in text
    res = CliRunner().invoke(app, ["ingest", str(KINETO), "-o", str(tmp_path / "v"), "--verbose"])
    assert "  events_in: 14983" in res.stderr and "  skipped: 7449" in res.stderr
    assert json.loads((tmp_path / "v" / "run.json").read_text())["counts"]["events_in"] == 14983  # still stored


def test_reconstruct_ends_with_lines_in_words(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(NORMAL, run)
    res = CliRunner().invoke(app, ["reconstruct", str(run)])
    assert res.exit_code == 0, res.output
    lines = _err_lines(res)
    assert len(lines) == 4, lines  # forest/steps/requests, GPU binding, repairs, logs
    s = json.loads((run / "reconstruct.json").read_text())
    assert lines[0] == (f"reconstructed {run}: {s['nodes']:,} nodes on 8 threads, 77 steps (STEP ranges), 42 requests"
                        + (f", {s['iterations']['count']} engine iterations" if s.get("iterations") else ""))
    assert lines[1] == "GPU work: 100% of 14,438 kernels, copies and memsets bound to the host call that launched it"
    assert lines[2] == "nothing repaired"
    assert lines[3].startswith("logs: 94 lines from 2 files, 80 aligned to a step by the request they name, 3 by time")
    assert "pops_consumed" not in res.stderr
    res = CliRunner().invoke(app, ["reconstruct", str(run), "-v"])
    assert "  pops_consumed: 0" in res.stderr and "  repaired_pops_without_push: 0" in res.stderr
    assert json.loads((run / "reconstruct.json").read_text())["pops_consumed"] == 0


def test_repairs_and_drops_are_said_in_words():
    s = {"nodes": 10, "threads": 2, "steps": 3, "steps_rule": "fixed windows", "steps_detail": "windows of 100 ms",
         "requests": 0, "gpu_activity": 4, "gpu_bound": 3, "repaired_pops_without_push": 2,
         "repaired_negative_duration": 1, "repaired_partial_overlap": 5, "truncated": 1, "duplicate": 0,
         "reconciled": False}
    lines = reconstruct_lines(s, "R")
    assert lines[0] == "reconstructed R: 10 nodes on 2 threads, 3 steps (fixed windows: windows of 100 ms), 0 requests"
    assert lines[1] == ("GPU work: 75.0% of 4 kernels, copies and memsets bound to the host call that launched it; "
                        "1 with no launching call in the trace")
    assert "2 range ends with no start dropped" in lines[2] and "1 range ending before its start set to zero length" in lines[2]
    assert "5 ranges sticking out of its parent clipped to it" in lines[2] and "1 range never closed" in lines[2]
    assert "counts do not reconcile" in lines[2] and "duplicate" not in lines[2]
    k = ingest_lines({"files": 1, "ranks": 1, "events_out": 5, "out_by_kind": {"KERNEL": 5},
                      "skipped_by_reason": {"malformed": 2}, "repaired_by_reason": {"negative_duration": 3}}, "t.json", "R")
    assert k[1] == "left out 2 records that are not timed events: 2 malformed records; repaired 3 records: 3 negative durations set to 0"


def test_off_a_terminal_nothing_is_wrapped(tmp_path, monkeypatch):
    con = console()
    assert not con.is_terminal and con.width == WIDE
    name = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>" * 4
    buf = io.StringIO()
    con.file = buf
    con.print(f"K {name}")
    assert buf.getvalue() == f"K {name}\n"
    deep = tmp_path / ("a-long-folder-name-" * 6) / "run"  # the closing line is far wider than 80 columns
    res = CliRunner().invoke(app, ["ingest", str(KINETO), "-o", str(deep)])
    first = _err_lines(res)[0]
    assert first.startswith("ingested ") and first.endswith("48 memsets, 2 other)") and str(deep) in first


# --------------------------------------------------------------------------------------------
# refusing to overwrite


def test_ingest_refuses_an_existing_run_without_force(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["ingest", str(KINETO), "-o", str(out)]) == 0
    (out / "forest.parquet").write_bytes(b"stale")
    capsys.readouterr()
    assert main(["ingest", str(KINETO), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"teller: error: {out}: already exists and holds a run directory; pass --force to replace it" in err
    assert (out / "forest.parquet").read_bytes() == b"stale"  # untouched
    assert main(["ingest", str(KINETO), "-o", str(out), "--force"]) == 0
    assert not (out / "forest.parquet").exists() and (out / "run.json").is_file()  # replaced whole
    assert main(["ingest", str(out), "-o", str(out)]) == 0  # a run checked in place needs no --force
    assert "nothing rewritten" in capsys.readouterr().err


def test_a_failed_force_keeps_the_old_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["ingest", str(KINETO), "-o", str(out)]) == 0
    before = sorted(p.name for p in (out / "events").iterdir())
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    assert main(["ingest", str(bad), "-o", str(out), "--force"]) == 2
    assert sorted(p.name for p in (out / "events").iterdir()) == before
    assert not list(tmp_path.glob(".run.replaced-*"))


def test_force_never_deletes_a_folder_that_holds_no_run(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main(["ingest", str(KINETO), "-o", str(mine), "--force"]) == 2
    assert "holds files but no run directory; --force replaces only a run directory" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep"
    (tmp_path / "empty").mkdir()
    assert main(["ingest", str(KINETO), "-o", str(tmp_path / "empty")]) == 0  # an empty folder is fine
    with pytest.raises(TellerError, match="not a directory"):
        with fresh_dir(mine / "notes.txt", True):
            pass


def test_record_refuses_an_existing_run_before_running_anything(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(NORMAL, run)
    marker = tmp_path / "ran"
    rc = main(["record", "-o", str(run), "--collector", "none", "--", sys.executable, "-c",
               f"open({str(marker)!r}, 'w')"])
    assert rc == 2 and not marker.exists()
    err = capsys.readouterr().err
    assert f"{run}: already exists and holds a run directory; pass --force" in err


def test_inject_and_dataset_refuse_existing_output(tmp_path, capsys):
    runs = tmp_path / "runs"
    (runs / "normal-r0").mkdir(parents=True)
    (runs / "normal-r0" / "run.json").write_text("{}")
    assert main(["inject", "run", str(ROOT / "campaigns" / "cpu_smoke.toml"), "-o", str(runs)]) == 2
    err = capsys.readouterr().err
    assert f"{runs / 'normal-r0'}: already recorded; pass --force" in err
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "datasheet.json").write_text("{}")
    assert main(["dataset", "build", str(runs), "-o", str(ds)]) == 2
    assert f"{ds}: already exists and holds a dataset; pass --force" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# natural order


def test_natural_key_counts_like_a_person():
    ids = ["req_10", "req_2", "req_1", "req_0", "chatcmpl-a9", "req_1__child#10", "req_1__child#2"]
    assert sorted(ids, key=natural_key) == ["chatcmpl-a9", "req_0", "req_1", "req_1__child#2", "req_1__child#10",
                                            "req_2", "req_10"]


@pytest.fixture(scope="module")
def normal_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("cli") / "run"
    shutil.copytree(NORMAL, run)
    assert main(["reconstruct", str(run), "--no-logs"]) == 0
    return run


def test_request_ids_are_listed_in_natural_order(normal_run, capsys):
    assert main(["show", str(normal_run), "--request", "req_99"]) == 2
    err = capsys.readouterr().err
    assert "known requests include req_0, req_1, req_2, req_3, req_4, req_5, req_6, req_7" in err
    from teller.report.diagnose import _requests_by_step
    from teller.rundir import RunDir

    steps = RunDir(normal_run).read_table("steps").column("step_id").to_pylist()
    lists = _requests_by_step(normal_run, steps)
    long = max(lists.values(), key=len)
    assert len(long) > 10 and long == sorted(long, key=natural_key) and long != sorted(long)


def test_show_names_a_step_once(normal_run):
    res = CliRunner().invoke(app, ["show", str(normal_run), "--step", "19", "--depth", "1"])
    assert res.exit_code == 0
    first = next(x for x in res.stdout.splitlines() if "id=19" in x)
    assert first.startswith("STEP id=19 ") and "STEP STEP" not in res.stdout


# --------------------------------------------------------------------------------------------
# progress bars


def test_progress_bars_draw_only_on_a_terminal():
    from rich.console import Console

    assert progress().disable  # the tests' stderr is not a terminal
    buf = io.StringIO()
    bar = progress(Console(file=buf, force_terminal=True, width=60))
    assert not bar.disable
    with bar:
        t = bar.add_task("runs", total=2)
        bar.advance(t)
    assert "runs" in buf.getvalue()


def test_dataset_build_reports_each_run(normal_run, tmp_path):
    from teller.dataset.build import build_dataset

    lab = tmp_path / "lab"
    shutil.copytree(normal_run, lab)
    (lab / "labels.json").write_text(json.dumps({"run_id": "lab", "status": "finished", "plan": [], "windows": []}))
    calls = []
    build_dataset([lab], tmp_path / "ds", progress=lambda done, total: calls.append((done, total)))
    assert calls == [(0, 1), (1, 1)]
    res = CliRunner().invoke(app, ["dataset", "build", str(lab), "-o", str(tmp_path / "ds2")])
    assert res.exit_code == 0, res.output
    assert "━" not in res.stderr and "built " in res.stderr and "step records" in res.stderr


def test_campaign_reports_each_run_as_it_ends(tmp_path):
    """A campaign whose one run needs what this machine lacks: skipped at once, reported by the
    hook and by the command's line for it."""
    from teller.inject.campaign import machine_context, run_campaign
    from teller.inject.mechanisms import registry

    ctx = machine_context({"kind": "serve"})
    name = next((k for k, m in registry().items() if m.unavailable(ctx)), None)
    if name is None:
        pytest.skip("every mechanism runs here")
    spec = tmp_path / "c.toml"
    spec.write_text(f'[campaign]\nname = "c"\n[workload]\nkind = "serve"\ndevice = "cpu"\n'
                    f'[[runs]]\nname = "x"\n[[runs.faults]]\nmechanism = "{name}"\n')
    seen = []
    s = run_campaign(spec, tmp_path / "runs", on_result=seen.append)
    assert [r["run_id"] for r in seen] == ["x-r0"] and seen[0]["status"] == "skipped" and s["skipped"] == 1
    res = CliRunner().invoke(app, ["inject", "run", str(spec), "-o", str(tmp_path / "runs2")])
    assert res.exit_code == 0, res.output
    assert "x-r0: skipped, 0 steps" in res.stderr and "campaign c: 1 run (0 finished, 0 crashed, 1 skipped)" in res.stderr
