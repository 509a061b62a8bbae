"""Link faults between the tensor-parallel ranks (``link_throttle``, ``netem_link``): the workload
runs in a private network namespace, and the targeted rank's agent shapes its loopback through
rtnetlink while the window is open. Recorded for real where the machine allows it (root, network
namespaces, the qdisc in the kernel); elsewhere the mechanism is skipped with the reason."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest

from teller.inject import netlink, netns
from teller.inject.mechanisms import registry
from teller.inject.spec import parse_spec

SPEC = """
[campaign]
name = "link"
seed = 0
collector = "cpu"
be_depth = 1
timeout_s = 120

[[runs]]
name = "tp-link"
workload = { kind = "serve-tp", device = "cpu", tp = 2, requests = 12, arrivals_per_step = 0.5, output_len = "8" }
[[runs.faults]]
mechanism = "link_throttle"
magnitude = 2             # Mbit/s between the ranks
start_step = 6
steps = 16
params = { burst_kib = 66 }  # just above the loopback's 64 KiB MTU: larger bursts would hide a short window
"""


def _tbf_reason() -> str | None:
    return netns.unavailable("tbf")


def test_netns_runs_a_command_in_a_private_namespace_or_says_why():
    r = subprocess.run([sys.executable, "-m", "teller.inject.netns", "--", sys.executable, "-c",
                        "import socket; print(socket.if_nameindex())"], capture_output=True, text=True, timeout=60)
    if _tbf_reason() and "namespace" in _tbf_reason():
        assert r.returncode == netns.EXIT_NO_NAMESPACE and "cannot make a private network namespace" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[(1, 'lo')]"  # only its own loopback: none of the machine's interfaces


def test_mechanisms_say_why_they_cannot_run():
    ctx = {"gpu": False, "gpu_device": False, "tp": 2, "workload": "serve-tp"}
    reg = registry()
    assert "tensor-parallel" in reg["link_throttle"].unavailable({**ctx, "tp": 1})
    p = netns.cached_probe()
    for name, kind in (("link_throttle", "tbf"), ("netem_link", "netem")):
        why = reg[name].unavailable(ctx)
        assert (why is None) == (p.get(kind) == "ok" and os.geteuid() == 0), (name, why, p)
    if "No such file" in str(p.get("netem")):  # a kernel without sch_netem (the H200 machine's, this one's)
        assert "the kernel has no netem qdisc" in reg["netem_link"].unavailable(ctx)


def test_link_fault_refuses_a_loopback_it_does_not_own(monkeypatch):
    """Started outside the namespace teller.inject.netns makes (no TELLER_NETNS, or one naming the
    namespace it came from), the window adds no qdisc: it would shape the machine's loopback."""
    for name in ("link_throttle", "netem_link"):
        m = registry()[name]
        monkeypatch.delenv(netns.ENV_NETNS, raising=False)
        with pytest.raises(RuntimeError, match="not in the network namespace"):
            m.start(None, {"magnitude": 5.0, "params": {}})
        own = netns.namespace_inode()
        monkeypatch.setenv(netns.ENV_NETNS, f"{own}:{own}")  # "made" but never left
        with pytest.raises(RuntimeError, match="not in the network namespace"):
            m.start(None, {"magnitude": 5.0, "params": {}})


def test_tbf_limits_the_private_loopback():
    """In a child moved into its own namespace: bulk TCP on its loopback is cut to about the rate."""
    if _tbf_reason():
        pytest.skip(_tbf_reason())
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        res = {}
        try:
            netlink.unshare_net()
            netlink.link_up()

            def bulk_mb_s() -> float:
                """Bytes the receiving end got per second, from 0.5 s to 1.5 s of a bulk send (past the
                socket buffers' first fill and the bucket's burst)."""
                srv = socket.socket()
                srv.bind(("127.0.0.1", 0))
                srv.listen(1)
                got = [0]

                def sink() -> None:
                    c, _ = srv.accept()
                    while b := c.recv(1 << 20):
                        got[0] += len(b)

                threading.Thread(target=sink, daemon=True).start()
                cl = socket.create_connection(srv.getsockname())
                cl.setblocking(False)
                buf, t0, marks = b"x" * (1 << 16), time.perf_counter(), {}
                while (t := time.perf_counter() - t0) < 1.5:
                    try:
                        cl.send(buf)
                    except BlockingIOError:
                        time.sleep(0.001)
                    if t >= 0.5 and "a" not in marks:
                        marks["a"] = (t, got[0])
                marks["b"] = (time.perf_counter() - t0, got[0])
                cl.close()
                return (marks["b"][1] - marks["a"][1]) / (marks["b"][0] - marks["a"][0]) / 1e6

            res["plain"] = bulk_mb_s()
            netlink.tbf_add(2_000_000, 128 * 1024)
            res["tbf"] = bulk_mb_s()
            netlink.root_qdisc_del()
            res["after"] = bulk_mb_s()
            try:
                netlink.root_qdisc_del()
            except netlink.NetlinkError as e:
                res["second_del_errno"] = e.errno
        except Exception as e:  # reported to the parent
            res["error"] = repr(e)
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    res = json.loads(os.read(r, 65536))
    os.waitpid(pid, 0)
    assert "error" not in res, res
    # 2 MB/s once the 128 KiB burst is spent: never above it; a loaded machine's receiving thread
    # may read less in the one-second window, but bytes still flow
    assert 0.0 < res["tbf"] < 3.0 and res["plain"] > 20.0, res
    assert res["after"] > 4 * res["tbf"], res
    assert res["second_del_errno"] == 2  # nothing left to remove: ENOENT, named


@pytest.mark.slow
def test_link_throttle_slows_every_rank_inside_its_window(tmp_path):
    if _tbf_reason():
        pytest.skip(_tbf_reason())
    from teller.inject.campaign import run_campaign
    from teller.inject.effects import window_effects

    s = run_campaign(parse_spec(SPEC, "link.toml"), tmp_path)
    assert s["finished"] == 1, s
    run = tmp_path / "tp-link-r0"
    lab = json.loads((run / "labels.json").read_text())
    assert lab["command"][1:4] == ["-m", "teller.inject.netns", "--"]
    assert lab["unapplied"] == []
    opened = [w for w in lab["windows"] if w["start_tau_ns"] is not None]
    assert len(opened) == 1 and opened[0]["rank"] == 0 and not opened[0]["errors"] and opened[0]["injections"] > 0
    e = {r["mechanism"]: r for r in window_effects(run)}["link_throttle"]
    for rk in (0, 1):  # the shaped link slows the collective on both ends
        assert e[f"comm_in_p50_ms_rank{rk}"] > 2 * e[f"comm_out_p50_ms_rank{rk}"], e
    rows = pq.read_table(run / "step_labels.parquet").to_pylist()
    ab = [r for r in rows if r["is_anomaly"]]
    assert ab and all(r["in_window"] and r["fault_type"] == "communication" for r in ab)
    assert all(r["operator_labels"] == ["COMM all_reduce"] for r in ab)
    assert {r["rank"] for r in ab} == {0, 1}
