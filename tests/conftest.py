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
