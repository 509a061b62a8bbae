"""Killed recordings: the workload SIGKILLed, and the launcher (`teller record`) SIGKILLed.

Either way every later command (`reconstruct`, `stats`, `show`, `diagnose`) says the run is partial and
what was lost; a killed launcher takes the recorded command down with it (docs/design.md §12)
instead of leaving it serving unlogged, and `run.json` left at ``"status": "running"`` reads as
an interrupted recording, not a live one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_record_launcher import ENGINE, HOOKS, gone, wait_for

from teller.cli import main
from teller.rundir import RunDir, recording_state

pytestmark = pytest.mark.slow  # records a program in subprocesses

PROG = '''
import sys
sys.path.insert(0, '.')
import mymod
e = mymod.Engine()
i = 0
while True:
    e.step({"reqs": [f"req_{i}"], "sleep": 0.01})
    print(f"served req_{i}", flush=True)
    i += 1
'''


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "mymod.py").write_text(ENGINE)
    (tmp_path / "hooks.toml").write_text(HOOKS)
    (tmp_path / "prog.py").write_text(PROG)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-m", "teller.cli", "record", "-o", str(run), "--collector", "cpu", "--hooks",
                          "hooks.toml", "--flush-interval", "0.2", "--", sys.executable, "prog.py"],
                         cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_for(lambda: len(list((run / "events").glob("*.parquet"))) >= 2 and any((run / "proc").glob("*.json")))
    return p, run


def _later_commands(run: Path, capsys) -> tuple[dict, str, str, str, str]:
    assert main(["reconstruct", str(run)]) == 0
    rec_err = capsys.readouterr().err
    assert main(["stats", str(run)]) == 0
    stats_out = capsys.readouterr().out
    assert main(["show", str(run), "--step", "0"]) == 0
    show_out = capsys.readouterr().out
    # diagnosed against itself (the numeric stage alone): the diagnosis carries the same words
    assert main(["diagnose", str(run), "--reference", str(run), "--no-model", "-o", str(run.parent / "diag")]) == 0
    diag_out = capsys.readouterr().out
    health = json.loads((run.parent / "diag" / "diagnosis.json").read_text())["health"]
    assert health["partial"] and health["runs"][0]["role"] == "run" and health["runs"][0]["partial"]
    summary = json.loads((run / "reconstruct.json").read_text())
    return summary, *(" ".join(t.split()) for t in (rec_err, stats_out, show_out, diag_out))


def test_workload_sigkilled(tmp_path: Path, capsys):
    p, run = _start(tmp_path)
    try:
        child = int(next((run / "proc").glob("*.json")).stem)
        os.kill(child, signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGKILL
    state = recording_state(RunDir(run))
    assert state["status"] == "killed" and state["partial"]
    assert state["lost"]["processes_unfinished"] == 1
    summary, rec_err, stats_out, show_out, diag_out = _later_commands(run, capsys)
    assert summary["recording"]["status"] == "killed"
    for text in (rec_err, stats_out, show_out, diag_out):
        assert "killed (SIGKILL, exit code 137)" in text and "the run is partial" in text, text[-800:]
        assert f"(pid {child}) ended without their last flush" in text
    assert "run: partial (killed)" in stats_out


def test_launcher_sigkilled_takes_the_command_down(tmp_path: Path, capsys):
    p, run = _start(tmp_path)
    child = int(next((run / "proc").glob("*.json")).stem)
    try:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
        wait_for(lambda: gone(child), timeout=30)  # the engine did not outlive its launcher
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "running" and info["exit_code"] is None  # nobody was left to finish it
    assert info["launcher"]["pid"] == p.pid
    state = recording_state(RunDir(run))
    assert state["status"] == "interrupted" and state["partial"]
    summary, rec_err, stats_out, show_out, diag_out = _later_commands(run, capsys)
    assert summary["recording"]["status"] == "interrupted"
    assert summary["steps"] > 0  # what was flushed is kept
    for text in (rec_err, stats_out, show_out, diag_out):
        assert f"the recording was interrupted: its launcher (pid {p.pid}) ended without finishing run.json" in text, text[-800:]
    assert "run: partial (interrupted)" in stats_out
