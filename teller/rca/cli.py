"""``teller rca train`` and ``teller rca predict``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def predictions_table(pred: list[dict], units, idx) -> "object":
    """One row per unit: its keys and the prediction (what ``teller rca predict`` writes)."""
    import pyarrow as pa

    u = units.select(idx)
    return pa.table({
        "run_id": pa.array(u.run_id.tolist(), pa.string()),
        "view": pa.array(u.view.tolist(), pa.string()),
        "step_num": pa.array(u.step_num, pa.int64()),
        "step_ids": pa.array([s.tolist() for s in u.step_ids], pa.list_(pa.int64())),
        "record_id": pa.array(u.record_id, pa.int64()),
        "abnormal_prob": pa.array([p["abnormal_prob"] for p in pred], pa.float64()),
        "abnormal": pa.array([p["abnormal"] for p in pred], pa.bool_()),
        "fault_type": pa.array([p["fault_type"] for p in pred], pa.string()),
        "fault_type_prob": pa.array([p["fault_type_prob"] for p in pred], pa.float64()),
        "fault_type_best": pa.array([p["fault_type_best"] for p in pred], pa.string()),
        "evidence_nodes": pa.array([p["evidence_nodes"] for p in pred], pa.list_(pa.int64())),
        "evidence_node_ids": pa.array([p["evidence_node_ids"] for p in pred], pa.list_(pa.int64())),
        "evidence_operators": pa.array([p["evidence_operators"] for p in pred], pa.list_(pa.string())),
        "explanation": pa.array([p["explanation"] for p in pred], pa.string()),
    })


def print_metrics(res: dict, con) -> None:
    for view in ("all", "vertical", "horizontal"):
        m = res.get(view)
        if not m:
            continue
        con.print(f"[bold]{res['split']} {res['part']} {view}[/]: units={m['units']}, step F1={m['step']['f1']:.3f} "
                  f"(P {m['step']['precision']:.3f}, R {m['step']['recall']:.3f}), fault-type macro-F1={m['fault_type']['macro_f1']:.3f}, "
                  f"6-class macro-F1={m['fault_type_6']['macro_f1']:.3f}, operator Macro+ F1={m['operator']['macro_plus_f1']:.3f} "
                  f"(F1 {m['operator']['f1']:.3f})")


def model_and_data(model: Path, dataset: Path, split: str | None, device: str, max_units: int | None = None,
                   seed: int = 0, ensemble: bool = False):
    """A saved model, the dataset read as its units (a sample of ``max_units`` drawn with ``seed``)
    and the split to use (``split``, else the one it was trained on). ``ensemble``: an ensemble
    folder (`teller rca ensemble`) is read too; otherwise it is refused (it is fitted and calibrated
    through its members)."""
    from teller.errors import TellerError
    from teller.rca import load
    from teller.rca.data import load_dataset
    from teller.rca.ensemble import ENSEMBLE_FILE

    if not ensemble and (Path(model) / ENSEMBLE_FILE).is_file():
        raise TellerError(f"{model} is an ensemble (`teller rca ensemble`): fit and calibrate each of its members, "
                          "whose directories its ensemble.json names")
    m = load(model, device=device)
    ds = load_dataset(dataset, max_units=max_units, seed=seed, unit=m.cfg.unit)
    return m, ds, split or m.meta.get("training", {}).get("split", "request")


def _fit_expert(model: Path, dataset: Path, split: str | None, device: str, name: str, key: str, fit, row, summary) -> None:
    """One expert command: ``fit(model, dataset, split)`` on the loaded model and data, each row of
    the val grid of its ``key`` block printed by ``row``, config.json rewritten with the
    calibration, then ``summary``."""
    from rich.markup import escape

    from teller.cliutil import console

    con = console(stderr=True)
    m, ds, sp = model_and_data(model, dataset, split, device)
    res = fit(m, ds, sp)
    for r in res[key]["grid"]:
        con.print("  " + row(r), markup=False)
    m.save_config(model, {"calibration": m.meta["calibration"]})
    con.print(f"[green]{name}[/] {escape(str(model))}: " + summary(res, m, sp))


def register(app: typer.Typer) -> None:
    """Add the ``rca`` command group to the ``teller`` app."""
    from teller.cliutil import new_app

    rca = new_app("Root-cause models: abnormal steps, fault type, evidence operators, explanation.")

    @rca.command("train")
    def train_cmd(
        dataset: Path = typer.Argument(..., help="Dataset folder (`teller dataset build`)."),
        out: Path = typer.Option(..., "-o", "--out", help="Model directory to write."),
        variant: str = typer.Option("mot", "--variant", help="mot (shared attention, dual head) | single (one stream, generated target)."),
        split: str = typer.Option("request", "--split", help="request | run | mechanism | workload: train on that protocol's train part."),
        inputs: str = typer.Option("trace+log", "--inputs", help="trace+log (the model) | trace | log (modality ablations) | summary+log (prompt-style: a text summary of the step instead of its tree)."),
        unit: str = typer.Option("step", "--unit", help="step (a unit's trace is the STEP subtree) | iteration (the whole engine iteration: the STEP subtree with the iteration's schedule/update ranges and GAP rows)."),
        op_unit: str = typer.Option("family", "--op-unit", help="What the MoT's operator head scores: family (each operator family of the unit, with its summed time against the reference) | token (each trace token; the shipped model's head)."),
        fam_span: bool = typer.Option(True, "--fam-span/--no-fam-span", help="With --op-unit family: the head also reads each family's summed span (children included, the time the operator labels measure) against the reference; --no-fam-span: the self time alone."),
        unit_stats: bool = typer.Option(True, "--unit-stats/--no-unit-stats", help="The MoT also reads the unit's layer mix (per layer its nodes' mean self time and span, its share of the nodes and of the self time, against the normal training units' spread) beside its trace tokens; --no-unit-stats: the tokens alone."),
        abnormal_prior: float = typer.Option(0.1, "--abnormal-prior", help="The MoT's abnormal cut is chosen on the val part for this fault prior (the best step F1 expected there; faults are rare where the model runs); 0: the cut stays 0.5."),
        type_expert: bool = typer.Option(True, "--type-expert/--no-type-expert", help="With --unit-stats: also fit the fault-type expert (gradient-boosted trees on the unit's layer mix) and choose its weight on the val part; --no-type-expert: the fault head alone names the type."),
        op_expert: bool = typer.Option(True, "--op-expert/--no-op-expert", help="With --op-unit family and --unit-stats: also fit the operator expert (gradient-boosted trees on each family's times against the reference, set beside the unit's other families and its layer mix) and choose its weight on the val part; --no-op-expert: the family head alone names the operators."),
        flag_expert: bool = typer.Option(True, "--flag-expert/--no-flag-expert", help="With --unit-stats and --abnormal-prior above 0: also fit the flag expert (gradient-boosted trees on a vertical unit's context, its engine iteration and its layer mix against its run's own steps, saying whether it is abnormal) and choose its weight in the abnormal probability with the abnormal cut on the val part; --no-flag-expert: the fault head alone."),
        pool_drop: Optional[float] = typer.Option(None, "--pool-drop", help="With --unit-stats: the share of training units whose fault head reads the layer mix alone, without the pooled trace state (default 0)."),
        trace_vocab: Optional[int] = typer.Option(None, "--trace-vocab", help="TPE vocabulary size (0: no merges; default of the config)."),
        device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
        epochs: int = typer.Option(10, "--epochs"),
        max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Stop after this many optimizer steps."),
        seed: int = typer.Option(0, "--seed"),
        config: str = typer.Option("small", "--config", help="tiny | small"),
        backbone: Optional[Path] = typer.Option(None, "--backbone", help="Local pretrained causal-LM checkpoint (from_pretrained)."),
        resume: bool = typer.Option(False, "--resume", help="Continue from MODEL/checkpoint."),
        max_minutes: Optional[float] = typer.Option(None, "--max-minutes", help="Stop training after this much time (schedule re-planned)."),
        batch_size: Optional[int] = typer.Option(None, "--batch-size"),
        lr: Optional[float] = typer.Option(None, "--lr"),
        max_units: Optional[int] = typer.Option(None, "--max-units", help="Use a random sample of this many units (smoke runs)."),
    ) -> None:
        """Train a root-cause model on a dataset split; writes model.safetensors, config.json, tokenizers, reference."""
        from rich.markup import escape

        from teller.cliutil import console
        from teller.rca.train import train

        con = console(stderr=True)
        s = train(dataset, out, variant=variant, split=split, device=device, epochs=epochs, max_steps=max_steps, seed=seed,
                  config=config, backbone=str(backbone) if backbone else None, resume=resume, max_minutes=max_minutes,
                  batch_size=batch_size, lr=lr, max_units=max_units, log=lambda m: con.print(m, markup=False),
                  inputs=inputs, trace_vocab=trace_vocab, unit=unit, op_unit=op_unit,
                  fam_span=fam_span if op_unit == "family" else None, unit_stats=unit_stats if variant == "mot" and inputs in ("trace+log", "trace") else None,
                  pool_drop=pool_drop, abnormal_prior=abnormal_prior, type_expert=type_expert,
                  op_expert=op_expert, flag_expert=flag_expert)
        con.print(f"[green]trained[/] {escape(str(out))}: {s['steps']:,} optimizer steps, loss {s['first_loss']:.4f} → {s['last_loss']:.4f}; "
                  f"{s['parameters']:,} parameters, {s['checkpoint_bytes'] / 2**20:.1f} MiB")

    @rca.command("predict")
    def predict_cmd(
        model: Path = typer.Argument(..., help="Model directory (`teller rca train -o`) or ensemble (`teller rca ensemble -o`)."),
        dataset: Path = typer.Argument(..., help="Dataset folder."),
        out: Path = typer.Option(..., "-o", "--out", help="Parquet file of predictions, one row per unit."),
        split: Optional[str] = typer.Option(None, "--split", help="Split protocol (default: the one the model was trained on)."),
        split_part: str = typer.Option("test", "--split-part", help="train | val | test"),
        device: str = typer.Option("cpu", "--device"),
        batch_size: int = typer.Option(64, "--batch-size"),
        metrics: Optional[Path] = typer.Option(None, "--metrics", help="Also write the metrics as JSON here."),
        max_units: Optional[int] = typer.Option(None, "--max-units", help="A random sample of this many units (smoke runs)."),
        seed: int = typer.Option(0, "--seed", help="Seed of --max-units sampling."),
    ) -> None:
        """Predict every unit of a split part and print step F1, fault-type macro-F1, operator Macro+ F1."""
        import json

        import pyarrow.parquet as pq
        from rich.markup import escape

        from teller.cliutil import console
        from teller.rca.train import evaluate

        con = console(stderr=True)
        m, ds, sp = model_and_data(model, dataset, split, device, max_units, seed, ensemble=True)
        pred, res, idx = evaluate(m, ds, sp, split_part, batch_size=batch_size)
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(predictions_table(pred, ds.units, idx), out, compression="zstd")
        print_metrics(res, con)
        if metrics:
            metrics.write_text(json.dumps(res, indent=1))
        con.print(f"[green]predicted[/] {len(pred):,} units into {escape(str(out))}")

    @rca.command("ensemble")
    def ensemble_cmd(
        models: list[Path] = typer.Argument(..., help="Two or more model directories: trainings of one MoT recipe on the same split (e.g. one per --seed)."),
        out: Path = typer.Option(..., "-o", "--out", help="Ensemble directory to write (its ensemble.json names the members)."),
        device: str = typer.Option("cpu", "--device"),
    ) -> None:
        """Read several trainings of one recipe as one model: their abnormal log-odds, type and operator probabilities averaged (`teller rca predict`, `teller diagnose --model` and `teller evaluate` read the folder as a model)."""
        from rich.markup import escape

        from teller.cliutil import console
        from teller.rca.api import load
        from teller.rca.ensemble import Ensemble

        con = console(stderr=True)
        e = Ensemble([load(m, device=device) for m in models], [str(m) for m in models])
        e.save(out, models)
        seeds = ", ".join(str(s) for s in e.meta["training"]["seeds"])
        con.print(f"[green]ensemble[/] {escape(str(out))}: {len(models)} models (seeds {seeds}), abnormal cut {e.abnormal_cut:.3f} "
                  f"(theirs: {', '.join(f'{c:.2f}' for c in e.meta['ensemble']['abnormal_cuts'])})")

    @rca.command("typer")
    def typer_cmd(
        model: Path = typer.Argument(..., help="Model directory (`teller rca train -o`, a MoT with --unit-stats); the expert and config.json are written there."),
        dataset: Path = typer.Argument(..., help="The dataset it was trained on."),
        split: Optional[str] = typer.Option(None, "--split", help="Split protocol (default: the one the model was trained on)."),
        seed: int = typer.Option(0, "--seed"),
        device: str = typer.Option("cpu", "--device"),
    ) -> None:
        """Fit the fault-type expert on the split's training part and choose its weight on the val part (`teller rca train` does this itself)."""
        from teller.rca.train import fit_type_expert

        _fit_expert(model, dataset, split, device, "type expert", "type_expert",
                    lambda m, ds, sp: fit_type_expert(m, ds, sp, seed=seed, out=model),
                    lambda r: f"weight {r['weight']:.2f}: fault-type macro-F1 {r['macro_f1']:.3f} on the val part's abnormal units",
                    lambda res, m, sp: f"weight {res['type_weight']:.2f}, fitted on {res['type_expert']['train_units']:,} "
                                       f"abnormal units of {sp}'s training part")

    @rca.command("opexpert")
    def opexpert_cmd(
        model: Path = typer.Argument(..., help="Model directory (`teller rca train -o`, a MoT with --op-unit family and --unit-stats); the expert and config.json are written there."),
        dataset: Path = typer.Argument(..., help="The dataset it was trained on."),
        split: Optional[str] = typer.Option(None, "--split", help="Split protocol (default: the one the model was trained on)."),
        seed: int = typer.Option(0, "--seed"),
        device: str = typer.Option("cpu", "--device"),
        batch_size: int = typer.Option(64, "--batch-size"),
    ) -> None:
        """Fit the operator expert on the split's training part and choose its weight on the val part (`teller rca train` does this itself)."""
        from teller.rca.train import fit_op_expert

        _fit_expert(model, dataset, split, device, "operator expert", "op_expert",
                    lambda m, ds, sp: fit_op_expert(m, ds, sp, seed=seed, batch_size=batch_size, out=model),
                    lambda r: (f"weight {r['weight']:.2f}: Macro+ F1 {r['macro_plus_f1']:.3f} (P {r['macro_plus_precision']:.3f}, "
                               f"R {r['macro_plus_recall']:.3f}) on the val part"),
                    lambda res, m, sp: (f"weight {res['op_weight']:.2f}, fitted on {res['op_expert']['train_slots']:,} family slots "
                                        f"({res['op_expert']['labelled_slots']:,} labelled) of {res['op_expert']['train_units']:,} "
                                        f"abnormal units of {sp}'s training part"))

    @rca.command("flagexpert")
    def flagexpert_cmd(
        model: Path = typer.Argument(..., help="Model directory (`teller rca train -o`, a MoT with --unit-stats); the expert and config.json are written there."),
        dataset: Path = typer.Argument(..., help="The dataset it was trained on."),
        split: Optional[str] = typer.Option(None, "--split", help="Split protocol (default: the one the model was trained on)."),
        abnormal_prior: float = typer.Option(0.1, "--abnormal-prior", help="The weight and the abnormal cut are chosen for the best step F1 expected at this fault prior."),
        reads: str = typer.Option("context", "--reads", help="What the trees read: context (the engine iteration and the layer mix against the run's own steps; carries across model shapes) or stats (the layer mix against the training reference; left out on shapes the model was not trained on)."),
        seed: int = typer.Option(0, "--seed"),
        in_window_weight: float = typer.Option(1.0, "--in-window-weight", help="The weight of a normal training unit a fault window overlaps (1: as any other)."),
        device: str = typer.Option("cpu", "--device"),
        batch_size: int = typer.Option(64, "--batch-size"),
    ) -> None:
        """Fit the flag expert on the split's training part and choose its weight with the abnormal cut on the val part (`teller rca train` does this itself; the operator threshold and the other experts stay)."""
        from teller.rca.train import fit_flag_expert

        _fit_expert(model, dataset, split, device, "flag expert", "flag_expert",
                    lambda m, ds, sp: fit_flag_expert(m, ds, sp, prior=abnormal_prior, seed=seed, batch_size=batch_size, out=model,
                                                    reads=reads, in_window_weight=in_window_weight),
                    lambda r: (f"weight {r['weight']:.2f}: cut {r['cut']:.2f}, recall {r['recall']:.3f}, false-positive rate "
                               f"{r['false_positive_rate']:.4f}, F1 at a {abnormal_prior:.0%} prior {r['f1_at_prior']:.3f} on the val part"),
                    lambda res, m, sp: (f"weight {res['flag_weight']:.2f}, abnormal cut {m.abnormal_cut:.2f}, fitted on "
                                        f"{res['flag_expert']['train_units']:,} units ({res['flag_expert']['train_abnormal']:,} "
                                        f"abnormal) of {sp}'s training part"))

    @rca.command("novelty")
    def novelty_cmd(
        model: Path = typer.Argument(..., help="Model directory (`teller rca train -o`, a MoT with --unit-stats); novelty.safetensors and config.json are written there."),
        dataset: Path = typer.Argument(..., help="The dataset it was trained on."),
        split: Optional[str] = typer.Option(None, "--split", help="Split protocol (default: the one the model was trained on)."),
        device: str = typer.Option("cpu", "--device"),
    ) -> None:
        """Keep the context of the split's training units with the model, so that it can say when a step is unlike every step it was trained on (the cut: the 99th percentile of the val part's units); `teller diagnose` then takes the type the numeric evidence points to for lasting episodes of such steps."""
        from rich.markup import escape

        from teller.cliutil import console
        from teller.rca.train import fit_novelty

        con = console(stderr=True)
        m, ds, sp = model_and_data(model, dataset, split, device)
        block = fit_novelty(m, ds, sp, out=model)
        for v, r in block["views"].items():
            con.print(f"  {v}: {r['units']:,} training units, cut {r['cut']:.3f} (the {block['quantile']:.0%} quantile of the "
                      f"val units' distance to their {block['k']}th nearest)", markup=False)
        m.save_config(model, {"calibration": m.meta["calibration"]})
        con.print(f"[green]novelty[/] {escape(str(model))}: {sp}'s training units, {len(block['views'])} view(s)")

    @rca.command("floor")
    def floor_cmd(
        model: Path = typer.Argument(..., help="Model directory (`teller rca train -o`, a MoT); its config.json is rewritten."),
        dataset: Path = typer.Argument(..., help="The dataset it was trained on."),
        split: Optional[str] = typer.Option(None, "--split", help="Split protocol (default: the one the model was trained on)."),
        split_part: str = typer.Option("val", "--split-part", help="The held-out part to measure on (val; never the test part you score on)."),
        quantile: float = typer.Option(0.85, "--quantile", help="The quantile of the model's probability over the part's normal units."),
        device: str = typer.Option("cpu", "--device"),
        batch_size: int = typer.Option(64, "--batch-size"),
    ) -> None:
        """Keep with the model its floor for the numeric stage's lasting departures: per view, the --quantile of its abnormal probability over the held-out part's normal units, warm-up out (`teller rca train` does this on the val part itself); `teller diagnose` and `teller evaluate` rule out a lasting departure the model gives less."""
        from rich.markup import escape

        from teller.cliutil import console
        from teller.rca.train import calibrate_episode_floor

        con = console(stderr=True)
        m, ds, sp = model_and_data(model, dataset, split, device)
        block = calibrate_episode_floor(m, ds, sp, split_part, quantile, batch_size)
        for v, r in block["views"].items():
            con.print(f"  {v}: floor {r['floor']:.3g} (the {quantile:.0%} quantile over {r['units']:,} normal units; median "
                      f"{r['median']:.3g})", markup=False)
        m.save_config(model, {"calibration": m.meta["calibration"]})
        con.print(f"[green]floor[/] {escape(str(model))}: the {split_part} part of {sp}, {len(block['views'])} view(s)")

    @rca.command("calibrate")
    def calibrate_cmd(
        model: Path = typer.Argument(..., help="Model directory (`teller rca train -o`); its config.json is rewritten."),
        dataset: Path = typer.Argument(..., help="The dataset it was trained on."),
        split: Optional[str] = typer.Option(None, "--split", help="Split protocol (default: the one the model was trained on)."),
        split_part: str = typer.Option("val", "--split-part", help="The held-out part to choose on (val; never the test part you score on)."),
        device: str = typer.Option("cpu", "--device"),
        batch_size: int = typer.Option(64, "--batch-size"),
        abnormal_prior: float = typer.Option(0.1, "--abnormal-prior", help="Choose the abnormal cut for this fault prior (0: the cut is 0.5)."),
    ) -> None:
        """Choose the abnormal cut (the best step F1 expected at --abnormal-prior) and the operator head's threshold (the best operator Macro+ F1) on held-out units (MoT); `teller rca train` does this on the val part itself."""
        from rich.markup import escape

        from teller.cliutil import console
        from teller.rca.train import calibrate

        con = console(stderr=True)
        m, ds, sp = model_and_data(model, dataset, split, device)
        cal = calibrate(m, ds, sp, split_part, prior=abnormal_prior, batch_size=batch_size)
        if "abnormal" in cal:
            for r in cal["abnormal"]["grid"]:
                con.print(f"  cut {r['cut']:.2f}: recall {r['recall']:.3f}, false-positive rate {r['false_positive_rate']:.4f}, "
                          f"F1 at a {abnormal_prior:.0%} prior {r['f1_at_prior']:.3f}", markup=False)
        for r in cal["grid"]:
            con.print(f"  threshold {r['threshold']:+.1f}: Macro+ F1 {r['macro_plus_f1']:.3f} "
                      f"(P {r['macro_plus_precision']:.3f}, R {r['macro_plus_recall']:.3f})", markup=False)
        m.save_config(model, {"calibration": cal})
        con.print(f"[green]calibrated[/] {escape(str(model))}: abnormal cut {m.abnormal_cut:.2f}, operator threshold {cal['op_threshold']:+.1f} (logit), "
                  f"Macro+ F1 {cal['macro_plus_f1']:.3f} on the {split_part} part of {sp} ({cal['units']:,} units; "
                  f"{cal['macro_plus_f1_at_0']:.3f} at 0)")

    @rca.command("experts")
    def experts_cmd(
        model: Path = typer.Argument(..., help="Model directory (`teller rca train -o`, a MoT); its experts and config.json are written there."),
        dataset: Path = typer.Argument(..., help="The dataset it was trained on."),
        split: Optional[str] = typer.Option(None, "--split", help="Split protocol (default: the one the model was trained on)."),
        seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the experts' trees (default: the training's)."),
        abnormal_prior: float = typer.Option(0.1, "--abnormal-prior", help="The abnormal cut (with the flag expert's weight) is chosen for the best step F1 expected at this fault prior (0: the cut is 0.5)."),
        type_expert: bool = typer.Option(True, "--type-expert/--no-type-expert"),
        op_expert: bool = typer.Option(True, "--op-expert/--no-op-expert"),
        flag_expert: bool = typer.Option(True, "--flag-expert/--no-flag-expert"),
        in_window_weight: float = typer.Option(1.0, "--in-window-weight", help="The flag expert's weight of a normal training unit a fault window overlaps (1: as any other)."),
        device: str = typer.Option("cpu", "--device"),
    ) -> None:
        """Fit everything `teller rca train` fits after its epochs, in its order and reading the dataset once: the flag expert, the calibration on the val part, the type and operator experts, the novelty and the floor for the stage's lasting departures (for a model trained where the experts could not be fitted, or to fit them again)."""
        from rich.markup import escape

        from teller.cliutil import console
        from teller.errors import TellerError
        from teller.rca.train import fit_experts

        con = console(stderr=True)
        m, ds, sp = model_and_data(model, dataset, split, device)
        if m.cfg.variant != "mot" or not m.cfg.reads_trace:
            raise TellerError(f"{model}: the experts and the calibration are a MoT's that reads the trace "
                              f"(this one: variant {m.cfg.variant}, inputs {m.cfg.inputs})")
        seed = int(m.meta.get("training", {}).get("seed", 0)) if seed is None else seed
        cal = fit_experts(m, ds, sp, abnormal_prior=abnormal_prior, seed=seed, type_expert=type_expert, op_expert=op_expert,
                          flag_expert=flag_expert, say=lambda s: con.print("  " + s, markup=False), out=model,
                          in_window_weight=in_window_weight)
        m.save_config(model, {"calibration": cal})
        con.print(f"[green]experts[/] {escape(str(model))}: fitted on {sp}'s training part, chosen on its val part (seed {seed}): "
                  + ", ".join(k for k in ("flag_expert", "type_expert", "op_expert", "novelty", "episode_floor") if k in cal))

    app.add_typer(rca, name="rca")
