"""``teller record``: launcher, bootstrap, runtime and generic hooks, end to end in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from teller.rundir import FLAG_TRUNCATED, RunDir

pytestmark = pytest.mark.slow  # every test here records a program in subprocesses

ENGINE = '''
import time
class Engine:
    def step(self, batch):
        time.sleep(batch.get("sleep", 0.002))
        self.inner(batch)
        return len(batch["reqs"])
    def inner(self, batch):
        time.sleep(0.001)
'''
HOOKS = '''
"mymod:Engine.step" = "STEP"
"mymod:Engine.inner" = "FE"
[requests]
"mymod:Engine.step" = "args[0]['reqs'][*]"
'''


def teller(*args: str, cwd: Path, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "teller.cli", *args], cwd=cwd, capture_output=True,
                          timeout=timeout, env=env)


def _default_sigint() -> None:
    # a suite started as a background job of a script inherits SIGINT ignored, and so would the
    # recorded engine (the launcher passes on the dispositions it was given, as running the engine
    # without it would): the tests that send SIGINT start the launcher from the default
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def teller_popen(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "teller.cli", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint)


@pytest.fixture()
def engine_dir(tmp_path: Path) -> Path:
    (tmp_path / "mymod.py").write_text(ENGINE)
    (tmp_path / "hooks.toml").write_text(HOOKS)
    return tmp_path


def write_prog(d: Path, body: str, name: str = "prog.py") -> str:
    (d / name).write_text("import sys\nsys.path.insert(0, '.')\n" + textwrap.dedent(body))
    return name


def gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for its new parent counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


def read_jsonl(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines()]


def wait_for(pred, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def test_generic_hooks_logs_and_exit_code(engine_dir: Path):
    prog = write_prog(engine_dir, """
        import mymod
        e = mymod.Engine()
        for i in range(5):
            e.step({"reqs": [f"req_{i}", f"req_{i + 1}"]})
            print(f"step {i} done req_{i}", flush=True)
        sys.stderr.buffer.write(b"bad bytes \\xff\\xfe end\\n")
        sys.stderr.buffer.write(b"bar 10%\\rbar 100%\\r\\n")
        sys.exit(3)
    """)
    run = engine_dir / "run"
    t_before = time.time_ns()
    p = teller("record", "-o", str(run), "--collector", "cpu", "--hooks", "hooks.toml", "--", sys.executable, prog,
               cwd=engine_dir)
    t_after = time.time_ns()
    assert p.returncode == 3, p.stderr.decode(errors="replace")
    # passed through unchanged, bytes included
    assert b"step 4 done req_4\n" in p.stdout
    assert b"bad bytes \xff\xfe end\n" in p.stderr and b"bar 10%\rbar 100%\r\n" in p.stderr
    # captured with timestamps
    out = read_jsonl(run / "logs" / "stdout.jsonl")
    assert [r["text"] for r in out] == [f"step {i} done req_{i}" for i in range(5)]
    ts = [r["ts_ns"] for r in out]
    assert ts == sorted(ts) and t_before <= ts[0] and ts[-1] <= t_after
    assert {r["stream"] for r in out} == {"stdout"} and all(r["node"] == 0 and r["pid"] > 0 for r in out)
    err = [r["text"] for r in read_jsonl(run / "logs" / "stderr.jsonl")]
    assert "bad bytes \ufffd\ufffd end" in err and "bar 10%" in err and "bar 100%" in err
    # events: STEP ranges carry the request ids, FE ranges sit inside them
    t = RunDir(run).read_events()
    names, s, e = t.column("name").to_pylist(), t.column("start_ns").to_pylist(), t.column("end_ns").to_pylist()
    steps = [(n, a, b) for n, a, b in zip(names, s, e, strict=True) if n.startswith("STEP")]
    assert sorted(n for n, _, _ in steps) == [f"STEP id={i} reqs=req_{i},req_{i + 1}" for i in range(5)]
    fes = [(a, b) for n, a, b in zip(names, s, e, strict=True) if n == "FE Engine.inner"]
    assert len(fes) == 5
    assert all(any(sa <= fa <= fb <= sb for _, sa, sb in steps) for fa, fb in fes)
    # run.json
    info = json.loads((run / "run.json").read_text())
    assert info["exit_code"] == 3 and info["status"] == "finished"
    assert info["clock"]["t0_unix_ns"] <= ts[0]
    assert info["clock"]["utc_offset_s"] == time.localtime(info["clock"]["t0_unix_ns"] / 1e9).tm_gmtoff
    assert info["counts"]["processes"] == 1 and info["counts"]["event_rows"] == 10
    assert info["counts"]["log_lines"] == {"stdout": 5, "stderr": 3}
    assert "generic" in info["engine"]["detected"]
    assert info["dropped_records"]["sink_rows"] == 0
    assert info["ranks"][0]["status"] == "exited"


def test_bootstrap_chain_loads_and_stays_light(tmp_path: Path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("MARKER = 'site-ok'\nimport os\nos.environ['SITE_RAN'] = '1'\n")
    prog = write_prog(tmp_path, """
        import os, sitecustomize
        heavy = [m for m in ("torch", "numpy", "pyarrow", "transformers") if m in sys.modules]
        print(sitecustomize.MARKER, os.environ.get("SITE_RAN"), heavy, "teller.record.runtime" in sys.modules)
    """)
    env = dict(os.environ, PYTHONPATH=str(site))
    p = teller("record", "-o", str(tmp_path / "run"), "--collector", "cpu", "--", sys.executable, prog,
               cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr.decode()
    assert b"site-ok 1 [] True" in p.stdout


def test_command_errors(engine_dir: Path):
    run = engine_dir / "run"
    p = teller("record", "-o", str(run), "--collector", "cpu", "--", sys.executable, "-c", "import sys; sys.exit(5)",
               cwd=engine_dir)
    assert p.returncode == 5
    p = teller("record", "-o", str(run), "--", sys.executable, "-c", "pass", cwd=engine_dir)
    assert p.returncode == 2 and b"already exists and holds a run directory; pass --force" in p.stderr
    assert str(run).encode() in p.stderr
    p = teller("record", "-o", str(run), "--force", "--", "/no/such/program", cwd=engine_dir)
    assert p.returncode == 2 and b"cannot run" in p.stderr
    (engine_dir / "bad.toml").write_text('"mymod:Engine.step" = "STAGE"\n')
    p = teller("record", "-o", str(engine_dir / "r2"), "--hooks", "bad.toml", "--", sys.executable, "-c", "pass",
               cwd=engine_dir)
    assert p.returncode == 2 and b"bad.toml" in p.stderr and b"STAGE" in p.stderr
    assert not (engine_dir / "r2" / "run.json").exists()  # nothing ran


def test_sigkill_keeps_flushed_events(engine_dir: Path):
    prog = write_prog(engine_dir, """
        import mymod
        e = mymod.Engine()
        i = 0
        while True:
            e.step({"reqs": [f"req_{i}"], "sleep": 0.01})
            i += 1
    """)
    run = engine_dir / "run"
    p = teller_popen("record", "-o", str(run), "--collector", "cpu", "--hooks", "hooks.toml", "--flush-interval",
                     "0.2", "--", sys.executable, prog, cwd=engine_dir)
    try:
        wait_for(lambda: len(list((run / "events").glob("*.parquet"))) >= 2)
        pid = int(next((run / "proc").glob("*.json")).stem)
        os.kill(pid, signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGKILL
    info = json.loads((run / "run.json").read_text())
    assert info["exit_code"] == 137 and info["killed_by"] == "SIGKILL"
    assert info["counts"]["processes_unfinished"] == 1
    t = RunDir(run).read_events()
    assert t.num_rows > 0 and any(n.startswith("STEP id=0 reqs=req_0") for n in t.column("name").to_pylist())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_forwarded_and_open_step_flushed(engine_dir: Path, sig: int):
    prog = write_prog(engine_dir, """
        import mymod
        class InStep(dict):  # says so from inside the STEP range: the signal cannot come before it
            def get(self, key, default=None):
                if key == "sleep":
                    print("in step", flush=True)
                return super().get(key, default)
        e = mymod.Engine()
        e.step({"reqs": ["req_a"]})
        e.step(InStep(reqs=["req_b"], sleep=60))
    """)
    run = engine_dir / "run"
    p = teller_popen("record", "-o", str(run), "--collector", "cpu", "--hooks", "hooks.toml", "--",
                     sys.executable, prog, cwd=engine_dir)
    try:
        wait_for(lambda: (run / "logs" / "stdout.jsonl").exists()
                 and "in step" in (run / "logs" / "stdout.jsonl").read_text())
        time.sleep(0.2)
        p.send_signal(sig)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + sig, p.stderr.read().decode(errors="replace")
    info = json.loads((run / "run.json").read_text())
    assert info["signals_forwarded"] == [signal.Signals(sig).name]
    t = RunDir(run).read_events()
    flags = dict(zip(t.column("name").to_pylist(), t.column("flags").to_pylist(), strict=True))
    assert flags["STEP id=0 reqs=req_a"] == 0
    if sig == signal.SIGTERM:  # default action: the runtime flushes, the open STEP kept and flagged
        assert flags["STEP id=1 reqs=req_b"] & FLAG_TRUNCATED
    else:  # KeyboardInterrupt unwinds through the hook, which closes the STEP on the way out
        assert flags["STEP id=1 reqs=req_b"] == 0


def test_raising_hook_is_swallowed_and_logged_once(engine_dir: Path):
    (engine_dir / "hooks.toml").write_text('"mymod:Engine.step" = "STEP"\n[requests]\n"mymod:Engine.step" = "args[0].nope"\n')
    prog = write_prog(engine_dir, """
        import mymod
        e = mymod.Engine()
        print([e.step({"reqs": ["a", "b"]}) for _ in range(5)])
    """)
    run = engine_dir / "run"
    p = teller("record", "-o", str(run), "--collector", "cpu", "--hooks", "hooks.toml", "--", sys.executable, prog,
               cwd=engine_dir)
    assert p.returncode == 0 and b"[2, 2, 2, 2, 2]" in p.stdout
    lines = [x for x in p.stderr.decode().splitlines() if x.startswith("[teller]") and "Engine.step" in x]
    assert len(lines) == 1 and "AttributeError" in lines[0]
    info = json.loads((run / "run.json").read_text())
    assert info["processes"][0]["hook_errors"] == {"generic.Engine.step": 5}
    assert info["counts"]["hook_errors"] == 5
    assert RunDir(run).read_events().num_rows == 0  # the STEP could not open: nothing half-recorded


def test_spawned_children_are_recorded_too(engine_dir: Path):
    prog = write_prog(engine_dir, """
        import subprocess, multiprocessing as mp, mymod
        def work(tag):
            mymod.Engine().step({"reqs": [tag]})
        if __name__ == "__main__":
            work("parent")
            subprocess.run([sys.executable, "-c",
                            "import sys; sys.path.insert(0, '.'); import mymod; mymod.Engine().step({'reqs': ['child']})"],
                           check=True)
            ctx = mp.get_context("fork")
            pr = ctx.Process(target=work, args=("forked",))
            pr.start(); pr.join()
    """)
    run = engine_dir / "run"
    p = teller("record", "-o", str(run), "--collector", "cpu", "--hooks", "hooks.toml", "--", sys.executable, prog,
               cwd=engine_dir)
    assert p.returncode == 0, p.stderr.decode()
    t = RunDir(run).read_events()
    by_pid: dict[int, set] = {}
    for n, pid in zip(t.column("name").to_pylist(), t.column("pid").to_pylist(), strict=True):
        by_pid.setdefault(pid, set()).add(n)
    steps = sorted(n for names in by_pid.values() for n in names if n.startswith("STEP"))
    assert sorted(s.split("reqs=")[1] for s in steps) == ["child", "forked", "parent"]
    assert len(by_pid) == 3  # one events series per process
    info = json.loads((run / "run.json").read_text())
    assert info["counts"]["processes"] == 3 and info["counts"]["processes_unfinished"] == 0


def test_cupti_unavailable_falls_back_to_cpu(engine_dir: Path):
    pytest.importorskip("torch")
    prog = write_prog(engine_dir, """
        import torch, mymod
        mymod.Engine().step({"reqs": ["r0"]})
    """)
    run = engine_dir / "run"
    env = dict(os.environ)
    env.pop("NVTX_INJECTION64_PATH", None)
    p = teller("record", "-o", str(run), "--collector", "cupti", "--hooks", "hooks.toml", "--", sys.executable, prog,
               cwd=engine_dir, env=env)
    assert p.returncode == 0, p.stderr.decode()
    try:
        import cupti  # noqa: F401

        pytest.skip("cupti-python is installed here: no fallback to observe")
    except ImportError:
        pass
    info = json.loads((run / "run.json").read_text())
    assert info["collector"]["active"] == ["cpu"] and info["collector"]["fallback_reasons"]
    assert b"[teller] collector cupti unavailable" in p.stderr
    assert "STEP id=0 reqs=r0" in RunDir(run).read_events().column("name").to_pylist()


def test_requested_engine_that_never_loads_is_reported(tmp_path: Path):
    p = teller("record", "-o", str(tmp_path / "run"), "--collector", "cpu", "--engine", "vllm", "--",
               sys.executable, "-c", "print('hello')", cwd=tmp_path)
    assert p.returncode == 0 and p.stdout == b"hello\n"
    assert b"[teller] --engine vllm: no recorded process imported its modules" in p.stderr
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert any("--engine vllm" in n for n in info["notes"]) and info["counts"]["processes"] == 0


def test_extensions_get_the_runtime_and_fault_plans_alone_load_nothing(tmp_path: Path, monkeypatch):
    """The bootstrap calls TELLER_EXTENSIONS' entries with the runtime once its hooks are in; a
    failing entry is one [teller] line; a fault plan without the extension loads no fault code."""
    import io

    from teller.record.launcher import record

    (tmp_path / "myext.py").write_text(textwrap.dedent("""
        import os
        def install(runtime):
            rt = runtime.RUNTIME
            with open(os.environ["EXT_OUT"], "a") as f:
                f.write(f"{runtime.__name__} {rt.pid == os.getpid()} {len(rt.instrumentors) > 0}\\n")
        def broken(runtime):
            raise RuntimeError("boom")
    """))
    out = tmp_path / "ext.txt"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("EXT_OUT", str(out))
    monkeypatch.setenv("TELLER_FAULTS", json.dumps({"run_id": "x", "faults": []}))
    prog = "import sys; print('inject' if any(m.startswith('teller.inject') for m in sys.modules) else 'clean')"
    o, e = io.BytesIO(), io.BytesIO()
    s = record(tmp_path / "run", [sys.executable, "-c", prog], collector="cpu",
               extensions=["myext:install", "myext:broken"], stdout=o, stderr=e)
    assert s["exit_code"] == 0 and o.getvalue() == b"clean\n", e.getvalue()
    assert out.read_text() == "teller.record.runtime True True\n"
    assert b"[teller] extension myext:broken not loaded (RuntimeError: boom)" in e.getvalue()
    o, e = io.BytesIO(), io.BytesIO()  # the plan alone: the recorder does not apply it
    s = record(tmp_path / "run2", [sys.executable, "-c", prog], collector="cpu", stdout=o, stderr=e)
    assert s["exit_code"] == 0 and o.getvalue() == b"clean\n", e.getvalue()
    assert not (tmp_path / "run2" / "inject").exists()


def test_deadline_ends_the_whole_process_tree(tmp_path: Path):
    """A command that outlives ``deadline_s`` is ended with its children (a hung multi-process
    engine must not stall a campaign); what it printed is kept and run.json says why."""
    from teller.record.launcher import _descendants, record

    prog = ("import subprocess, sys, time\n"
            "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print('child', kid.pid, flush=True)\n"
            "time.sleep(600)\n")
    t0 = time.time()
    s = record(tmp_path / "run", [sys.executable, "-c", prog], collector="none", deadline_s=3.0,
               stdout=open(os.devnull, "wb"), stderr=open(os.devnull, "wb"))
    assert time.time() - t0 < 120  # bounded, not a timing claim: the command alone sleeps 600 s
    assert s["exit_code"] == 128 + signal.SIGTERM
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    extra = info.get("extra", info)
    assert extra["killed_by"] == "deadline" and extra["deadline_s"] == 3.0
    out = read_jsonl(tmp_path / "run" / "logs" / "stdout.jsonl")
    kid = int(next(r["text"] for r in out if r["text"].startswith("child")).split()[1])
    time.sleep(0.5)
    assert gone(kid)
    assert kid not in _descendants(os.getpid())


def test_cupti_decode_flag_reaches_the_process_and_run_json(tmp_path: Path):
    prog = tmp_path / "show.py"
    prog.write_text("import os\nprint('decode=' + os.environ.get('TELLER_CUPTI_DECODE', '-'))\n")
    run = tmp_path / "run"
    p = teller("record", "-o", str(run), "--collector", "cupti", "--cupti-decode", "Deferred", "--",
               sys.executable, str(prog), cwd=tmp_path)
    assert p.returncode == 0, p.stderr.decode()
    assert b"decode=deferred" in p.stdout
    assert json.loads((run / "run.json").read_text())["collector"]["cupti_decode"] == "deferred"
    bad = teller("record", "-o", str(tmp_path / "r2"), "--cupti-decode", "later", "--", sys.executable,
                 str(prog), cwd=tmp_path)
    assert bad.returncode != 0 and b"--cupti-decode" in bad.stderr
