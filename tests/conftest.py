"""Session fixtures shared by several test files: what costs a recorded workload is made once.

End-to-end tests (they record a workload or a campaign, or drive a browser) are marked
``@pytest.mark.slow``: ``python -m pytest -q -m "not slow"`` is the quick loop, ``.ci/run`` runs
everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The suite runs on the machine's cores through pytest-xdist (pyproject addopts: -n auto): every
# worker is one process, so each keeps to one thread (torch, BLAS, Arrow) and the recorded
# workloads it starts inherit that; two workers with two threads each on two cores only contend.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

#: files that share a session fixture run on one worker, so the fixture is made once
_SHARED = {"test_inject.py": "smoke_campaign", "test_inject_parallel.py": "smoke_campaign",
           "test_workload.py": "plain_tiny_tokens", "test_instrument_profiler.py": "plain_tiny_tokens"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """One xdist group per test file (a file's module fixtures are made once, on one worker;
    files sharing a session fixture form one group), and the files with slow tests first, so the
    long recordings start while the quick files fill the other workers (``--dist loadgroup``)."""
    slow_files = {it.path.name for it in items if it.get_closest_marker("slow")}
    for it in items:
        it.add_marker(pytest.mark.xdist_group(_SHARED.get(it.path.name, it.path.name)))
    items.sort(key=lambda it: it.path.name not in slow_files)  # stable: file order kept within each part

#: a tiny deterministic serve run (rate 0: batching, hence the greedy tokens, do not depend on timing)
TINY_SERVE = ["--requests", "4", "--rate", "0", "--prompt-len", "uniform:4:12", "--output-len", "6", "--seed", "3"]


def two_cores() -> bool:
    return hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2


@pytest.fixture(scope="session")
def plain_tiny_tokens(tmp_path_factory) -> list[dict]:
    """The per-request rows (with tokens) of the TINY_SERVE workload run without recording: the
    reference the recorded runs (cpu collector, profiler backend) must reproduce token for token."""
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("plain")
    p = subprocess.run([sys.executable, "-m", "teller.workload", "serve", *TINY_SERVE, "--save-tokens",
                        "--out-json", str(d / "plain.json")], cwd=d, capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    return json.loads((d / "plain.json").read_text())["requests"]


@pytest.fixture(scope="session")
def smoke_campaign(tmp_path_factory) -> dict:
    """campaigns/cpu_smoke.toml recorded once through `teller inject run`, two runs at a time in
    pinned lanes where there are two cores (tests/test_inject_parallel.py checks the lanes,
    tests/test_inject.py the labels and the dataset built from them)."""
    from teller.cli import main

    out = tmp_path_factory.mktemp("smoke") / "runs"
    lanes = 2 if two_cores() else 1
    rc = main(["inject", "run", str(ROOT / "campaigns" / "cpu_smoke.toml"), "-o", str(out), "--parallel", str(lanes)])
    summary = json.loads((out / "campaign_summary.json").read_text())
    return {"out": out, "exit_code": rc, "lanes": lanes, "summary": summary}
