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
    from rich.console import Console

    from teller.inject.campaign import run_campaign

    s = run_campaign(spec, out, only=only or None, force=force, quiet=not verbose, parallel=parallel)
    con = Console(stderr=True)
    for r in s["results"]:
        skipped = "; ".join(f"{x['mechanism']}: {x['reason']}" for x in r.get("skipped", []))
        con.print(f"{r['run_id']}: {r['status']}, steps={r.get('steps', 0)}, abnormal={r.get('abnormal_steps', 0)}"
                  + (f" [yellow]skipped {skipped}[/]" if skipped else ""), highlight=False)
        for u in r.get("unapplied", []):
            rank = f" on rank {u['rank']}" if u.get("rank") is not None else ""
            con.print(f"  [bold red]window {u['id']} ({u['mechanism']}){rank} {u['problem']}[/]: {u['detail']} "
                      f"({u['fix']})", highlight=False)
    unapplied = s.get("unapplied_windows", 0)
    con.print(f"[green]campaign[/]: runs={s['runs']}, finished={s['finished']}, crashed={s['crashed']}, "
              f"skipped={s['skipped']}, steps={s['steps']}, abnormal={s['abnormal_steps']}"
              + (f", [bold red]windows not applied as planned={unapplied}[/] (labels.json: unapplied)" if unapplied else ""),
              highlight=False)


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
