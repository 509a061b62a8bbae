"""NCCL ranks recorded with CUPTI (no layer column): the collective kernels are COMM, bound
under their launch inside the hook's COMM range, and the host collectives match across ranks.

Built from the event shapes the CUPTI collector writes for a 2-rank NCCL all_reduce (RANGE
messages from the torch.distributed hook, RUNTIME launches and KERNELs joined by correlation
id), since this machine has no GPUs to run NCCL on.
"""

from __future__ import annotations

import pyarrow.compute as pc

from teller.reconstruct import reconstruct
from teller.rundir import RunDir, events_table

NCCL_KERNEL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _rank_events(rank: int, pid: int) -> dict[str, list]:
    ev: dict[str, list] = {c: [] for c in ("kind", "name", "rank", "pid", "tid", "device", "stream",
                                           "start_ns", "end_ns", "corr_id")}

    def add(kind, name, start, end, corr=-1, device=-1, stream=-1, tid=pid):
        for c, v in zip(ev, (kind, name, rank, pid, tid, device, stream, start, end, corr), strict=True):
            ev[c].append(v)

    off = 37 * rank  # the ranks' clocks and timings differ a little
    add("RANGE", "STEP id=0 reqs=req_0", 1_000 + off, 90_000 + off)
    for k in range(2):  # two collectives in the step, each launching one NCCL kernel
        t = 10_000 + 30_000 * k + off
        add("RANGE", f"COMM all_reduce bytes=8192 group=default seq={k}", t, t + 20_000)
        add("RUNTIME", "cudaLaunchKernelExC", t + 1_000, t + 3_000, corr=100 + k)
        add("KERNEL", NCCL_KERNEL, t + 4_000, t + 18_000, corr=100 + k, device=rank, stream=7, tid=-1)
    add("RANGE", "FE LlamaMLP", 75_000 + off, 85_000 + off)
    add("RUNTIME", "cudaLaunchKernel", 76_000 + off, 77_000 + off, corr=200)
    add("KERNEL", "sm90_xmma_gemm_bf16", 78_000 + off, 80_000 + off, corr=200, device=rank, stream=7, tid=-1)
    return ev


def test_cupti_nccl_kernels_are_comm_and_collectives_match_across_ranks(tmp_path):
    rd = RunDir(tmp_path / "run")
    for rank, pid in ((0, 500), (1, 600)):
        rd.write_events(events_table(_rank_events(rank, pid)), name=f"{pid}-00000")
    summary = reconstruct(rd.path)
    assert summary["unbound"] == 0
    f = rd.read_table("forest")
    name = f.column("name").cast("string").to_pylist()
    layer = f.column("layer").cast("string").to_pylist()
    parent = f.column("parent_id").to_pylist()
    nccl = [i for i, n in enumerate(name) if n.startswith("ncclDevKernel")]
    assert len(nccl) == 4 and all(layer[i] == "COMM" for i in nccl)
    assert all(layer[i] == "K" for i, n in enumerate(name) if n.startswith("sm90_"))
    for i in nccl:  # kernel → its launch → the hook's COMM range
        launch = parent[i]
        assert name[launch] == "cudaLaunchKernelExC" and layer[parent[launch]] == "COMM"
    edges = rd.read_table("comm_edges")
    # the host ranges of both collectives match between rank 0 and rank 1 by (group, seq)
    host = edges.filter(pc.equal(edges.column("source"), 0)) if "source" in edges.column_names else edges
    src = set(host.column("src_node_id").to_pylist()) | set(host.column("dst_node_id").to_pylist())
    comm_ranges = {i for i, n in enumerate(name) if n.startswith("all_reduce")}
    assert comm_ranges and comm_ranges <= src
