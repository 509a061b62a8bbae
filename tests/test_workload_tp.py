"""The tensor-parallel workload recorded on 2 gloo ranks: the horizontal view end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from teller.reconstruct import reconstruct
from teller.rundir import RunDir, np_col

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_rank_recording_has_steps_and_matched_collectives(tmp_path):
    run = tmp_path / "tp"
    p = subprocess.run(
        [sys.executable, "-m", "teller.cli", "record", "-o", str(run), "--collector", "cpu", "--engine", "generic",
         "--hooks", str(ROOT / "campaigns" / "hooks_tp.toml"), "--", sys.executable, "-m", "teller.workload",
         "serve-tp", "--device", "cpu", "--tp", "2", "--requests", "4", "--stats-every-steps", "3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    s = reconstruct(run)
    rd = RunDir(run)
    steps = rd.read_table("steps")
    assert sorted(set(np_col(steps, "rank").tolist())) == [0, 1]
    assert s["requests"] == 4
    # both ranks run the same steps in lockstep, so every request shows up on both ranks
    req = rd.read_table("requests")
    assert set(np_col(req, "rank").tolist()) == {0, 1}
    edges = rd.read_table("comm_edges")
    assert edges.num_rows > 0
    assert set(zip(np_col(edges, "src_rank").tolist(), np_col(edges, "dst_rank").tolist(), strict=True)) == {(0, 1)}
    # an edge joins the same collective (group, seq) on the two ranks
    forest = rd.read_table("forest")
    names = np.asarray(forest.column("name").to_pylist(), dtype=object)
    src, dst = np_col(edges, "src_node_id"), np_col(edges, "dst_node_id")
    assert all(names[a].split(" ")[0] == names[b].split(" ")[0] for a, b in zip(src[:20], dst[:20], strict=True))
    # the model's blocks are FE ranges ([models] in hooks_tp.toml), each all_reduce inside one
    layer = np.asarray(forest.column("layer").to_pylist(), dtype=object)
    fe = set(names[layer == "FE"].tolist())
    assert {"TPDecoderLayer", "TPAttention", "TPMLP", "Embedding"} <= fe, sorted(fe)
    parent = np_col(forest, "parent_id")
    comm = np.nonzero((layer == "COMM") & np.char.startswith(names.astype(str), "all_reduce"))[0]
    assert len(comm) and set(names[parent[comm]].tolist()) == {"TPAttention", "TPMLP"}
    assert json.loads((run / "run.json").read_text())["model_config"]["class"] == "TPModel"  # its shape noted
    # the STEP messages carry the batch context the loop set ([batch] in hooks_tp.toml)
    step_names = [n for n in rd.read_events().column("name").to_pylist() if n.startswith("STEP")]
    fields = [dict(kv.split("=") for kv in n.removesuffix(" detail=0").split()[3:]) for n in step_names]
    assert step_names and all(set(f) == {"prefill", "decode", "waiting"} for f in fields), step_names[:3]
    assert all(int(f["prefill"]) + int(f["decode"]) > 0 for f in fields)
    assert int(fields[0]["prefill"]) > 0 and any(int(f["decode"]) > 0 for f in fields)
    # rank 0 writes the service logs: lifecycle lines and periodic statistics
    logs = "\n".join(json.loads(x)["text"] for f in sorted((run / "logs").glob("*.jsonl"))
                     for x in f.read_text().splitlines())
    for i in range(4):
        assert f"Added request req_{i}: prompt_tokens=" in logs
        assert re.search(rf"Finished request req_{i}: prompt_tokens=\d+ output_tokens=8 e2e=[\d.]+s ttft=[\d.]+s", logs)
    assert re.search(r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ "
                     r"tokens/s, Running: \d+ reqs, Waiting: \d+ reqs", logs)


def test_placement_picks_backend_by_gpus_per_rank(monkeypatch):
    import torch

    from teller.workload.tp import placement

    assert placement("cpu", "auto", 1, 2) == (torch.device("cpu"), "gloo")
    with pytest.raises(SystemExit, match="needs --device cuda"):
        placement("cpu", "nccl", 0, 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit, match="no GPU"):
        placement("cuda", "auto", 0, 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # two ranks share one GPU: gloo
    assert placement("cuda", "auto", 1, 2) == (torch.device("cuda", 0), "gloo")
    with pytest.raises(SystemExit, match="one GPU per rank"):
        placement("cuda", "nccl", 0, 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert placement("cuda", "auto", 1, 2) == (torch.device("cuda", 1), "nccl")


def test_ranks_stop_together_at_the_timeout():
    """At its timeout the run stops on every rank at the same step (rank 0 decides and
    broadcasts): both ranks reach the final barrier, and the run reports the unfinished count."""
    p = subprocess.run([sys.executable, "-m", "teller.workload", "serve-tp", "--device", "cpu", "--tp", "2",
                        "--requests", "400", "--arrivals-per-step", "0.5", "--output-len", "8", "--timeout", "2"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-2000:]
    m = re.search(r"requests (\d+)/400", p.stdout)
    assert m and int(m.group(1)) < 400
