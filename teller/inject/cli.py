"""``teller inject run SPEC -o RUNS/`` and ``teller inject mechanisms``."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional  # noqa: UP035 (typer reads these annotations)

import typer

from teller.cliutil import new_app

inject_app = new_app("Fault-injection campaigns: recorded runs with ground-truth labels.")


@inject_app.callback()
def _group() -> None:
    """Fault-injection campaigns: recorded runs with ground-truth labels."""


@inject_app.command("run")
def run_cmd(
    spec: Path = typer.Argument(..., help="Campaign spec (TOML), e.g. campaigns/cpu_smoke.toml."),
    out: Path = typer.Option(..., "-o", "--out", help="Folder for the runs (one run directory each)."),
    only: Optional[List[str]] = typer.Option(None, "--only", help="Run only these runs of the spec (by name)."),
    force: bool = typer.Option(False, "--force", help="Replace existing recordings."),
    verbose: bool = typer.Option(False, "--verbose", help="Pass the workload's output through."),
    parallel: int = typer.Option(1, "--parallel", help="Runs recorded at a time, each pinned to its share of the cores "
                                 "(machine-wide faults still run alone)."),
) -> None:
    """Record every run of SPEC with `teller record`, reconstruct it and write labels.json."""
    from rich.markup import escape

    from teller.cliutil import console, progress
    from teller.inject.campaign import run_campaign
    from teller.inject.spec import load_spec
    from teller.summary import n

    camp = load_spec(spec)
    planned = [f"{r.name}-r{k}" for r in camp.runs if not only or r.name in only for k in range(r.repetitions)]
    taken = [p for p in planned if (out / p).exists() and any((out / p).iterdir())]
    if taken and not force:
        from teller.errors import TellerError

        shown = ", ".join(str(out / p) for p in taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
        raise TellerError(f"{shown}: already recorded; pass --force to replace the runs of this campaign, "
                          "or choose another -o folder")
    con = console(stderr=True)

    def line(r: dict) -> None:
        skipped = "; ".join(f"{x['mechanism']}: {x['reason']}" for x in r.get("skipped", []))
        con.print(f"{escape(r['run_id'])}: {r['status']}, {n(r.get('steps', 0), 'step')}, {r.get('abnormal_steps', 0):,} abnormal"
                  + (f" [yellow]skipped {escape(skipped)}[/]" if skipped else ""))
        for u in r.get("unapplied", []):
            rank = f" on rank {u['rank']}" if u.get("rank") is not None else ""
            con.print(f"  [bold red]window {u['id']} ({u['mechanism']}){rank} {escape(str(u['problem']))}[/]: "
                      f"{escape(str(u['detail']))} ({escape(str(u['fix']))})")

    # the workload's own output (--verbose) and a live bar would interleave: no bar then
    with progress(con, enabled=False if verbose else None) as bar:
        task = bar.add_task(f"campaign {camp.name}", total=len(planned))

        shown: set[str] = set()

        def done(r: dict) -> None:
            line(r)
            shown.add(r["run_id"])
            bar.advance(task)

        s = run_campaign(camp, out, only=only or None, force=force, quiet=not verbose, parallel=parallel, on_result=done)
    for r in s["results"]:
        if r["run_id"] not in shown:
            line(r)
    unapplied = s.get("unapplied_windows", 0)
    con.print(f"[green]campaign[/] {escape(camp.name)}: {n(s['runs'], 'run')} ({s['finished']} finished, {s['crashed']} crashed, "
              f"{s['skipped']} skipped), {n(s['steps'], 'step')}, {s['abnormal_steps']:,} abnormal; labels in each run's labels.json"
              + (f"; [bold red]{n(unapplied, 'fault window')} not applied as planned[/] (labels.json: unapplied)" if unapplied else ""))


@inject_app.command("mechanisms")
def mechanisms_cmd() -> None:
    """List the mechanisms: category, magnitude knob, targets, where they act, what they need."""
    from teller.inject.campaign import machine_context
    from teller.inject.mechanisms import registry

    ctx = machine_context({"kind": "serve-tp", "tp": 2})
    for name, m in registry().items():
        why = m.unavailable(ctx)
        print(f"{name:24s} {m.category:14s} knob: {m.knob}; targets: {', '.join(m.targets) or '(measured)'}; "
              f"{m.where}" + (f"; here: {why}" if why else ""))


def register(app: typer.Typer) -> None:
    """Add the ``inject`` group to the ``teller`` app."""
    app.add_typer(inject_app, name="inject")
