"""`teller show`: print the call-chain tree of a step or of a request (rich tree)."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.tree import Tree

from teller.errors import TellerError
from teller.forest import Forest
from teller.inspect.tree import fmt_ns, shapes
from teller.logs.ids import natural_key
from teller.rundir import LAYER_CODE, LAYERS, RunDir, np_col, recording_state

_STYLE = {
    "STEP": "bold magenta", "FE": "bold cyan", "BE": "cyan", "COMM": "bold yellow", "RT": "green",
    "DRV": "dark_green", "K": "red", "MEM": "orange3", "SYNC": "bright_red", "OTHER": "white",
    "GAP": "bold red",
}


def show(run: str | os.PathLike, step: int | None = None, request: str | None = None, depth: int = 6,
         max_children: int = 12, console: Console | None = None) -> None:
    """Print the tree of step ``step`` (its number or node id), of the steps of ``request``, or,
    with neither, a list of steps and the tree of the first one."""
    rd = RunDir(run).require()
    console = console or Console()
    rec = recording_state(rd)
    for line in rec["words"]:  # a partial run says so before its trees
        console.print(f"[yellow]warning[/]: {escape(line)}", highlight=False, soft_wrap=True)
    forest = Forest.read(rd.path, columns=["flags", "step_idx", "pid", "tid"])
    steps = rd.read_table("steps") if rd.has_table("steps") else None
    kernels = forest.subtree_counts(forest.layer == LAYER_CODE["K"])

    rows: list[int]
    if request is not None:
        if not rd.has_table("requests"):
            raise TellerError(f"{rd.path}: no requests.parquet; run `teller reconstruct {rd.path}` first")
        req = rd.read_table("requests")
        ids = np.asarray(req.column("request_id").to_pylist(), dtype=object)
        sel = np_col(req, "step_id")[ids == request]
        if not len(sel):
            known = sorted(set(ids.tolist()), key=natural_key)[:8]
            raise TellerError(f"{rd.path}: request {request!r} names no step; known requests include {', '.join(known) or 'none'}")
        all_rows = forest.rows_of(np.unique(sel))
        durs = forest.end[all_rows] - forest.start[all_rows]
        console.print(f"request [bold]{request}[/]: {len(all_rows)} step(s), "
                      f"{fmt_ns(durs.sum())} in steps, slowest {fmt_ns(durs.max())}")
        if len(all_rows) > 1:
            _print_step_list(console, forest, steps, limit=20, only=np.asarray(np.unique(sel)))
            console.print("showing the slowest step (use --step N for another)")
        rows = [int(all_rows[np.argmax(durs)])]
    elif step is not None:
        rows = _find_step(forest, steps, step, rd)
        its = _iterations(rd, forest, steps, step, rows)
        if its:
            for header, it_rows in its:
                console.print(header)
                for r in it_rows:
                    console.print(_tree(forest, r, kernels, depth, max_children))
            return
        if len(rows) > max_children:  # a fixed window: its root nodes
            console.print(f"step {step}: {len(rows)} root nodes; showing the first {max_children} (--max-children)")
            rows = rows[:max_children]
    else:
        step_rows = np.nonzero(forest.layer == LAYER_CODE["STEP"])[0]
        if len(step_rows):
            console.print(f"{len(step_rows)} steps; showing the first (use --step N or --request ID)")
            _print_step_list(console, forest, steps, limit=10)
            rows = [int(step_rows[np.argmin(forest.start[step_rows])])]
        else:
            # the root with the largest subtree is the most telling (the profiler's own span, often
            # the longest root, holds nothing); ties go to the longer one
            roots = forest.roots
            console.print(f"no STEP ranges; {len(roots)} root(s), showing the one with the most descendants "
                          "(`--step-pattern` on `teller reconstruct` names steps in foreign traces)")
            sizes = forest.size[roots]
            rows = [int(roots[np.lexsort((-(forest.end[roots] - forest.start[roots]), -sizes))[0]])] if len(roots) else []
    for r in rows:
        console.print(_tree(forest, r, kernels, depth, max_children))


_BATCH = ("prefill", "decode", "waiting", "kv_used", "kv_total", "preempted")


def _iterations(rd: RunDir, forest: Forest, steps, step: int, rows: list[int]) -> list[tuple[str, list[int]]]:
    """For each engine iteration of the step shown (``iterations.parquet``, rule ``engine
    ranges``): a header line (duration, schedule, STEP, post, untraced gap, busy times, batch
    context) and the roots to print (the iteration's roots on its thread: schedule, STEP, GAP
    nodes, update, in time order). Empty when the run has no such iteration."""
    if not rd.has_table("iterations") or steps is None or "step_idx" not in forest.table.column_names:
        return []
    it = rd.read_table("iterations")
    sid = np_col(it, "step_id")
    rule = np.asarray(it.column("rule").to_pylist(), dtype=object)
    pick = np.flatnonzero(np.isin(sid, np.asarray(rows, np.int64)) & (rule == "engine ranges"))
    if not len(pick):
        return []
    roots = forest.roots
    r_idx, r_tid, r_pid = forest.step_idx[roots], forest.tid[roots], forest.pid[roots]
    col = {c: np_col(it, c) for c in it.column_names if c != "rule"}
    out = []
    for k in pick.tolist():
        i = int(col["step_idx"][k])
        mine = roots[(r_idx == i) & (r_tid == col["tid"][k]) & (r_pid == col["pid"][k])]
        mine = mine[np.argsort(forest.start[mine], kind="stable")]
        n_gap = int((forest.layer[mine] == LAYER_CODE["GAP"]).sum())
        batch = [f"{b}={int(col[b][k])}" for b in _BATCH if col[b][k] >= 0]
        header = (f"[bold]iteration of step {step}[/] (rank {int(col['rank'][k])}, tid {int(col['tid'][k])}): "
                  f"[bold]{fmt_ns(col['dur_ns'][k])}[/] = schedule {fmt_ns(col['schedule_ns'][k])} + step "
                  f"{fmt_ns(col['step_ns'][k])} + post {fmt_ns(col['post_ns'][k])} + [red]gap {fmt_ns(col['gap_ns'][k])}[/]"
                  f" ({n_gap} GAP node(s)); host busy {fmt_ns(col['host_busy_ns'][k])}, GPU busy {fmt_ns(col['gpu_busy_ns'][k])}; "
                  f"{int(col['n_requests'][k])} request(s)" + (f"; {' '.join(batch)}" if batch else "")
                  + ("  [dim](warm-up)[/]" if col["warmup"][k] else ""))
        out.append((header, mine.tolist()))
    return out


def _find_step(forest: Forest, steps, step: int, rd: RunDir) -> list[int]:
    """Rows to show for step ``step``: by step number in ``steps.parquet``, the step's node (STEP
    range, profiler step) or, for a fixed window (no node: ``step_id`` -1), the roots of the
    forest rows whose ``step_idx`` is the window; else a STEP node id."""
    if steps is not None and steps.num_rows:
        idx = np.flatnonzero(np_col(steps, "step_num") == step)
        if len(idx):
            sid = np_col(steps, "step_id")[idx]
            rows = forest.rows_of(sid[sid >= 0]).tolist()
            windows = idx[sid < 0]
            if len(windows):
                if "step_idx" not in forest.table.column_names:
                    raise TellerError(f"{forest.path}: no step_idx column; re-run `teller reconstruct {rd.path}`")
                roots = forest.roots
                rows += roots[np.isin(forest.step_idx[roots], windows)].tolist()
            return rows
    r = forest.row(step)
    if r >= 0 and LAYERS[forest.layer[r]] == "STEP":
        return [r]
    raise TellerError(f"{rd.path}: no step {step} (neither a step number nor a STEP node id); `teller show {rd.path}` lists the steps")


def _print_step_list(console: Console, forest: Forest, steps, limit: int, only: np.ndarray | None = None) -> None:
    if steps is None or not steps.num_rows:
        return
    order = np.argsort(np_col(steps, "start_ns"))
    if only is not None:
        order = order[np.isin(np_col(steps, "step_id")[order], only)]
    if len(order) > limit:
        console.print(f"  (first {limit} of {len(order)})")
    order = order[:limit]
    nums, ranks = np_col(steps, "step_num"), np_col(steps, "rank")
    starts, ends = np_col(steps, "start_ns"), np_col(steps, "end_ns")
    nreq = np_col(steps, "n_requests")
    for i in order:
        console.print(f"  step {nums[i]:>5} rank {ranks[i]}  {fmt_ns(ends[i] - starts[i]):>10}  {nreq[i]} request(s)")


def _label(forest: Forest, r: int, kernels: np.ndarray) -> str:
    layer = LAYERS[forest.layer[r]]
    name = forest.name(r)
    if name.startswith(layer + " "):  # a STEP range's name already begins with STEP
        name = name[len(layer) + 1:]
    if len(name) > 90:
        name = name[:87] + "..."
    dur = fmt_ns(forest.end[r] - forest.start[r])
    extra = f"  [dim]{kernels[r]} kernels[/]" if kernels[r] and layer not in ("K",) else ""
    flag = "  [yellow]⚑[/]" if forest.flags[r] else ""
    return f"[{_STYLE[layer]}]{layer}[/] {_escape(name)}  [bold]{dur}[/]{extra}{flag}"


def _escape(s: str) -> str:
    return s.replace("[", r"\[")


def _tree(forest: Forest, root: int, kernels: np.ndarray, depth: int, max_children: int) -> Tree:
    shape = shapes(forest)
    tree = Tree(_label(forest, root, kernels))
    stack = [(tree, root, 0)]
    while stack:
        node, r, d = stack.pop()
        kids = forest.children(r)
        if not len(kids):
            continue
        if d + 1 > depth:
            node.add(f"[dim]… {len(kids)} children below depth {depth}[/]")
            continue
        # fold runs of identical sibling subtrees (same shape: layers, names, nesting) into groups [i, j)
        groups = []
        i = 0
        while i < len(kids):
            j = i + 1
            while j < len(kids) and shape[kids[j]] == shape[kids[i]]:
                j += 1
            groups.append((i, j, float(np.sum(forest.end[kids[i:j]] - forest.start[kids[i:j]]))))
            i = j
        # too many: keep the longest groups (what a user looks for), still in time order
        keep = sorted(sorted(range(len(groups)), key=lambda g: -groups[g][2])[:max_children])
        pending = []
        for g in keep:
            i, j, total = groups[g]
            k = kids[i]
            if j - i > 1:  # one of them stands for all; its subtree is printed once
                layer = LAYERS[forest.layer[k]]
                label = (f"[{_STYLE[layer]}]{layer}[/] {_escape(forest.name(k)[:90])}  ×{j - i}  "
                         f"[bold]{fmt_ns(total)}[/] total")
                if kernels[kids[i:j]].sum() and layer != "K":
                    label += f"  [dim]{int(kernels[kids[i:j]].sum())} kernels[/]"
                pending.append((node.add(label), k, d + 1))
            else:
                pending.append((node.add(_label(forest, k, kernels)), k, d + 1))
        if len(keep) < len(groups):
            hidden = np.concatenate([kids[groups[g][0]:groups[g][1]] for g in range(len(groups)) if g not in set(keep)])
            rest = Counter(LAYERS[forest.layer[k]] for k in hidden)
            node.add(f"[dim]… {len(hidden)} shorter ({', '.join(f'{v} {k}' for k, v in rest.most_common())}) "
                     f"{fmt_ns(float(np.sum(forest.end[hidden] - forest.start[hidden])))} in all[/]")
        stack.extend(reversed(pending))
    return tree
