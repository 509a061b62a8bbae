"""Training: tokenizers and reference statistics fitted on the split's training part, then AdamW
on the losses of :mod:`.model`, with checkpoints that resume (no pickle: safetensors + JSON).

What a split's training part fits (so the run- and mechanism-disjoint tests stay unseen): the
TPE tokenizer (on the distinct steps of the training units), the text BPE (on their log lines and
explanations, and every operator family name of the dataset), and the duration reference (the
tokens of the *normal* training units).

Resume (``resume=True``): the model directory's ``checkpoint/`` holds float32 weights, the AdamW
state (``optimizer.safetensors``: every state tensor by parameter index; the hyper-parameters in
``state.json``) and the position (optimizer step, epoch, batch); the tokenizers and the reference
are read back from the directory instead of refitted, and the epoch order is a function of
(seed, epoch), so a resumed run continues the interrupted one batch for batch.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from teller.errors import TellerError
from teller.rca.api import RCA, load_weights, save_weights, weight_files
from teller.rca.batch import (
    DECISION,
    EXPLANATION,
    MARKER,
    OPERATOR,
    Prepared,
    prepare,
    prompt_batch,
    target_batch,
    trace_batch,
)
from teller.rca.data import (
    Dataset,
    ReferenceStats,
    Units,
    encode_units,
    family_slots,
    load_dataset,
    require_unit,
    training_workloads,
    unit_statistics,
)
from teller.rca.model import RCAConfig, build_model, token_ce
from teller.rca.schema import ABNORMAL_CUT

MARKER_WEIGHT = 0.1


def fit_tokenizers(ds: Dataset, train_idx: np.ndarray, cfg: RCAConfig):
    """(text tokenizer, TPE tokenizer) fitted on the training units."""
    from teller.rca.text import train_text_tokenizer
    from teller.tpe.tokenizer import SPECIAL_TOKENS, UNK_LAYER
    from teller.tpe.trainer import train as tpe_train

    u = ds.units
    pieces = np.concatenate([u.step_ids[i] for i in train_idx.tolist()]) if len(train_idx) else np.zeros(0, np.int64)
    runs = np.repeat(u.run_id[train_idx], [len(u.step_ids[i]) for i in train_idx.tolist()]).tolist()
    st = ds.forest.find(runs, pieces)
    seqs = ds.forest.seqs.select(np.unique(st[st >= 0]))
    n_base = len(SPECIAL_TOKENS) + len(UNK_LAYER) + len(set(np.asarray(seqs.symbols, dtype=object)[np.unique(seqs.codes)].tolist()))
    trace_tok = tpe_train(seqs, max(cfg.trace_vocab, n_base), max_token_nodes=cfg.tpe_max_token_nodes)
    texts = ds.explanations_and_logs(train_idx) + list(ds.forest.families)
    text_tok = train_text_tokenizer(texts, cfg.text_vocab)
    return text_tok, trace_tok


def prepare_units(ds: Dataset, idx: np.ndarray, cfg: RCAConfig, text_tok, trace_tok, ref: ReferenceStats | None,
                  labels: bool = True) -> tuple[Prepared, ReferenceStats]:
    """Inputs (and targets) of units ``idx``; ``ref=None`` fits the reference on their normal units.
    ``ds`` must be serialized with ``cfg.unit`` (:func:`.data.load_dataset`'s ``unit``)."""
    require_unit(ds, cfg.unit)
    u = ds.units.select(idx)
    inp = encode_units(ds.forest, trace_tok, u.run_id.tolist(), u.step_ids, u.log_text, cfg.max_trace_tokens,
                       u.view.tolist())
    if ref is None:
        normal = np.flatnonzero(~u.is_anomaly)
        sub = inp.select(normal)
        ref = ReferenceStats.fit(sub.input_ids, sub.duration, len(trace_tok), source=f"{ds.path}: {len(normal)} normal training units")
        if cfg.variant == "mot" and cfg.op_unit == "family":
            ref.fit_families(family_slots(sub), sub.families, span=cfg.fam_span)
        if cfg.reads_unit_stats:
            ref.fit_units(unit_statistics(sub))
    ctx = None
    if cfg.reads_unit_stats:  # each unit against every unit of its run the dataset holds
        from teller.rca.context import dataset_context_features

        ctx = dataset_context_features(ds, idx, trace_tok)
    if not labels:
        return prepare(inp, text_tok, ref, cfg, context=ctx), ref
    return prepare(inp, text_tok, ref, cfg, u.fault, u.operator_labels, u.explanation, context=ctx), ref


def losses(net: torch.nn.Module, cfg: RCAConfig, prep: Prepared, idx: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
    """The variant's loss terms on a batch; ``loss`` is the weighted total."""
    p, pv = prompt_batch(prep, idx, device)
    tr = trace_batch(prep, idx, device)
    t, tv, kind = target_batch([prep.target[int(i)] for i in idx], device, [prep.target_kind[int(i)] for i in idx])
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _null()
    with amp:
        out = net(p, pv, tr, t, tv)
    ce = token_ce(out["lm"], t)
    k = kind[:, 1:]

    def mean_of(code: int) -> torch.Tensor:
        m = (k == code).float()
        return (ce * m).sum() / m.sum().clamp(min=1.0)

    terms: dict[str, torch.Tensor] = {"lm": mean_of(EXPLANATION)}
    if cfg.variant == "mot":
        fault = torch.from_numpy(prep.fault[idx]).to(device)
        terms["fault"] = F.cross_entropy(out["fault"], fault)
        if prep.trace_visible:
            y = torch.zeros_like(out["ops"])
            v = tr["valid"].float()
            for r, i in enumerate(idx.tolist()):
                s = prep.inputs.tokens(i)
                y[r, :s.stop - s.start] = torch.from_numpy(prep.op_target[s]).to(device)
            bce = F.binary_cross_entropy_with_logits(out["ops"], y, reduction="none",
                                                     pos_weight=torch.tensor(cfg.op_pos_weight, device=device))
            terms["ops"] = (bce * v).sum() / v.sum().clamp(min=1.0)
        else:  # no tree read: no token to score as an operator
            terms["ops"] = out["ops"].sum() * 0.0
        terms["loss"] = terms["fault"] + cfg.lm_weight * terms["lm"] + cfg.op_weight * terms["ops"]
        if "fam" in out:  # the family head (op_unit "family"): one target per family slot
            fv = tr["fam_valid"].float()
            fb = F.binary_cross_entropy_with_logits(out["fam"], tr["fam_target"], reduction="none",
                                                    pos_weight=torch.tensor(cfg.op_pos_weight, device=device))
            terms["fam"] = (fb * fv).sum() / fv.sum().clamp(min=1.0)
            terms["loss"] = terms["loss"] + cfg.op_weight * terms["fam"]
    else:
        terms["fault"] = mean_of(DECISION)
        terms["ops"] = mean_of(OPERATOR)
        terms["loss"] = (terms["fault"] + cfg.lm_weight * terms["lm"] + cfg.op_weight * terms["ops"]
                         + MARKER_WEIGHT * mean_of(MARKER))
    return terms


def _null():
    import contextlib

    return contextlib.nullcontext()


# ---- optimizer state as safetensors ---------------------------------------------------------------


def save_optimizer(opt: torch.optim.Optimizer, path: Path) -> dict:
    from safetensors.torch import save_file

    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    tmp = path.with_suffix(".tmp")
    save_file(tensors or {"_empty": torch.zeros(1)}, str(tmp))
    tmp.replace(path)
    return {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer(opt: torch.optim.Optimizer, path: Path, meta: dict, device: torch.device) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        if key == "_empty":
            continue
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v.to(device) if k != "step" else v
    for key, v in meta.get("scalars", {}).items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    w = min(1.0, (step + 1) / max(1, warmup))
    c = 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total))))
    return base * w * (0.1 + 0.9 * c)


# ---- the loop ---------------------------------------------------------------------------------------


def train(dataset: str | Path | Dataset, out: str | Path, variant: str = "mot", split: str = "request",
          device: str = "cpu", epochs: int = 10, max_steps: int | None = None, seed: int = 0, config: str = "small",
          backbone: str | None = None, resume: bool = False, max_minutes: float | None = None,
          batch_size: int | None = None, lr: float | None = None, max_units: int | None = None,
          progress: bool | None = None, log: Callable[[str], None] | None = None, checkpoint_every_s: float = 60.0,
          replan: bool = True, abnormal_prior: float | None = None, type_expert: bool = True,
          op_expert: bool = True, flag_expert: bool = True, **overrides: Any) -> dict[str, Any]:
    """Train one model on ``split``'s training part and save it to ``out``; returns a summary
    (loss curve, sizes, time). ``overrides`` set :class:`RCAConfig` fields (``inputs``,
    ``trace_vocab``, ``unit``, ...; a given :class:`Dataset` must be serialized with that
    ``unit``). ``max_minutes`` stops training when that much time is spent; with
    ``replan`` the learning-rate schedule is re-planned to end there (from the pace of the first
    steps), without it the epochs stay the plan and the time is only a hard stop. ``stopped_by``
    says whether the steps, a re-planned schedule or the time ended training. A MoT that reads the
    trace ends by choosing on the val part its abnormal cut for a fault prior of
    ``abnormal_prior`` (None: :data:`ABNORMAL_PRIOR`; 0: no cut chosen, 0.5 stays) and then its
    operator threshold (:func:`calibrate_abnormal`, :func:`calibrate_operators`); one that reads
    the unit statistics then fits its fault-type expert (``type_expert``,
    :func:`fit_type_expert`) and, with a family head, its operator expert (``op_expert``,
    :func:`fit_op_expert`); before the calibration it fits its flag expert (``flag_expert``,
    :func:`fit_flag_expert`), which chooses the abnormal cut with its weight. A checkpoint is
    written at the end of an epoch when ``checkpoint_every_s`` have passed since the last one,
    and at the end."""
    t_start = time.perf_counter()
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if device == "cuda" and not torch.cuda.is_available():
        raise TellerError("--device cuda: no CUDA device here; use --device cpu")
    dev = torch.device(device)
    torch.manual_seed(seed)
    np.random.seed(seed)
    out = Path(out)
    ck = out / "checkpoint"
    state = None
    if resume and (ck / "state.json").is_file():
        state = json.loads((ck / "state.json").read_text())
    # the unit (STEP subtree or engine iteration) decides how the dataset is serialized
    unit = (RCAConfig.from_json(json.loads((out / "config.json").read_text())["config"]).unit if state is not None
            else overrides.get("unit") or "step")
    ds = dataset if isinstance(dataset, Dataset) else load_dataset(dataset, max_units=max_units, seed=seed, unit=unit)
    require_unit(ds, unit, f"a model of unit {unit!r}")
    units: Units = ds.units
    tr_idx, va_idx = units.part(split, "train"), units.part(split, "val")
    if not len(tr_idx):
        raise TellerError(f"{ds.path}: no training units in the {split} split")
    if state is not None:
        from teller.rca.text import load_text_tokenizer
        from teller.tpe.tokenizer import TraceTokenizer

        meta = json.loads((out / "config.json").read_text())
        cfg = RCAConfig.from_json(meta["config"])
        if cfg.variant != variant or meta.get("training", {}).get("split") != split:
            raise TellerError(f"{out}: its checkpoint is of variant {cfg.variant}, split "
                              f"{meta.get('training', {}).get('split')}; resume with the same --variant/--split or drop --resume")
        text_tok = load_text_tokenizer(out / "tokenizer.json")
        trace_tok = TraceTokenizer.load(out / "trace_tokenizer")
        ref = ReferenceStats.load(out / "reference.json")
        trp, _ = prepare_units(ds, tr_idx, cfg, text_tok, trace_tok, ref)
    else:
        cfg = RCAConfig.preset(config, variant=variant, backbone=backbone, **overrides)
        t0 = time.perf_counter()
        text_tok, trace_tok = fit_tokenizers(ds, tr_idx, cfg)
        trp, ref = prepare_units(ds, tr_idx, cfg, text_tok, trace_tok, None)
        say(f"prepared {len(trp)} training units of the {split} split in {time.perf_counter() - t0:.1f} s "
            f"(text vocab {text_tok.get_vocab_size()}, trace vocab {len(trace_tok)}, "
            f"{int(trp.inputs.truncated.sum())} truncated to {cfg.max_trace_tokens} tokens)")
    net = build_model(cfg, text_tok.get_vocab_size(), len(trace_tok), pretrained=state is None and bool(cfg.backbone)).to(dev)
    n_params = sum(p.numel() for p in net.parameters())
    bs = batch_size or (8 if config == "tiny" else 32)
    base_lr = lr or (3e-3 if config == "tiny" else 1e-3)
    opt = torch.optim.AdamW(net.parameters(), lr=base_lr, weight_decay=0.01, betas=(0.9, 0.98))
    per_epoch = max(1, math.ceil(len(trp) / bs))
    total = epochs * per_epoch if max_steps is None else min(max_steps, epochs * per_epoch)
    step, epoch, batch_in_epoch = 0, 0, 0
    curve: list[dict[str, float]] = []
    model = RCA(cfg, net, text_tok, trace_tok, ref, device=dev)
    extra = {"training": {"dataset": str(ds.path), "split": split, "seed": seed, "config": config,
                          "train_units": int(len(trp)), "val_units": int(len(va_idx)), "batch_size": bs,
                          "lr": base_lr, "parameters": int(n_params), "workloads": training_workloads(ds, tr_idx)}}
    if state is not None:
        load_weights(net, ck / "model.safetensors")
        load_optimizer(opt, ck / "optimizer.safetensors", state["optimizer"], dev)
        step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        curve = state.get("curve", [])
        extra = json.loads((out / "config.json").read_text()).get("training") and \
            {"training": json.loads((out / "config.json").read_text())["training"]}
        say(f"resumed {out} at step {step} of {total} (epoch {epoch})")
    else:
        out.mkdir(parents=True, exist_ok=True)
        model.save(out, dtype="float32", extra=extra)  # tokenizers + config now, weights replaced at the end
    warmup = max(1, min(100, total // 20))
    use_bar = sys.stderr.isatty() if progress is None else progress
    deadline = t_start + 60 * max_minutes if max_minutes else None
    t_loop = time.perf_counter()
    steps_at_loop = step
    bar = None
    if use_bar:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        bar = Progress(TextColumn(f"rca {cfg.variant}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                       TimeElapsedColumn(), TimeRemainingColumn(), transient=True)
        bar.start()
        task = bar.add_task("train", total=total, completed=step, info="")
    run_loss: list[float] = []

    def checkpoint() -> None:
        ck.mkdir(parents=True, exist_ok=True)
        save_weights(net, ck / "model.safetensors", "float32")
        om = save_optimizer(opt, ck / "optimizer.safetensors")
        st = {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "total": total, "seed": seed,
              "optimizer": om, "curve": curve}
        (ck / "state.json.tmp").write_text(json.dumps(st))
        (ck / "state.json.tmp").replace(ck / "state.json")

    net.train()
    stopped = "steps"
    last_ck = time.perf_counter()
    try:
        while step < total:
            order = np.random.default_rng([seed, epoch]).permutation(len(trp))
            while batch_in_epoch < per_epoch and step < total:
                idx = np.sort(order[batch_in_epoch * bs:(batch_in_epoch + 1) * bs])
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, total, base_lr, warmup)
                terms = losses(net, cfg, trp, idx, dev)
                opt.zero_grad(set_to_none=True)
                terms["loss"].backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                step += 1
                batch_in_epoch += 1
                run_loss.append(float(terms["loss"].detach()))
                if step % 10 == 0 or step == total:
                    curve.append({"step": step, "loss": float(np.mean(run_loss[-10:])),
                                  **{k: float(v.detach()) for k, v in terms.items() if k != "loss"}})
                if bar is not None:
                    bar.update(task, completed=step, info=f"loss {np.mean(run_loss[-10:]):.3f}")
                if deadline is not None and step - steps_at_loop == 10:
                    t_loop = time.perf_counter()  # the first steps pay for CUDA start-up and kernel selection
                if deadline is not None and replan and step - steps_at_loop == 30:
                    # re-plan the schedule to end at the deadline, from the pace of steps 10-30
                    per_step = (time.perf_counter() - t_loop) / 20
                    fit = step + int((deadline - time.perf_counter()) / max(per_step, 1e-6))
                    if fit < total:
                        total = max(step + 1, fit)
                        stopped = "time budget (schedule re-planned)"
                        if bar is not None:
                            bar.update(task, total=total)
                        say(f"time budget: {max_minutes} min allows about {total} steps ({per_step * 1e3:.0f} ms a step)")
                if deadline is not None and time.perf_counter() > deadline:
                    stopped = "time budget"
                    total = step
                    break
            if batch_in_epoch >= per_epoch:
                epoch += 1
                batch_in_epoch = 0
                if bar is None:
                    say(f"epoch {epoch}: step {step}/{total}, loss {np.mean(run_loss[-per_epoch:]):.4f}")
                if time.perf_counter() - last_ck >= checkpoint_every_s:
                    checkpoint()
                    last_ck = time.perf_counter()
    finally:
        if bar is not None:
            bar.stop()
    checkpoint()
    secs = time.perf_counter() - t_start
    extra["training"].update({"steps": step, "epochs_done": round(step / per_epoch, 2), "stopped_by": stopped,
                              "seconds": round(secs, 1), "device": str(dev), "curve": curve[-200:]})
    model.net.eval()
    if len(va_idx) and model.cfg.variant == "mot" and model.cfg.reads_trace:
        extra["calibration"] = fit_experts(model, ds, split, abnormal_prior=abnormal_prior, seed=seed, type_expert=type_expert,
                                           op_expert=op_expert, flag_expert=flag_expert, say=say)
    model.save(out, extra=extra)
    size = sum(f.stat().st_size for f in weight_files(out / "model.safetensors"))
    say(f"saved {out}: {n_params / 1e6:.2f} M parameters, model.safetensors {size / 2**20:.1f} MiB ({cfg.save_dtype}), "
        f"{step} steps in {secs:.0f} s, last loss {np.mean(run_loss[-10:]) if run_loss else float('nan'):.4f}")
    return {"out": str(out), "parameters": int(n_params), "checkpoint_bytes": size, "steps": step,
            "seconds": secs, "curve": curve, "first_loss": run_loss[0] if run_loss else None,
            "last_loss": float(np.mean(run_loss[-10:])) if run_loss else None}


def fit_experts(model: RCA, ds: Dataset, split: str, abnormal_prior: float | None = None, seed: int = 0,
                type_expert: bool = True, op_expert: bool = True, flag_expert: bool = True,
                say: Callable[[str], None] | None = None, out: str | Path | None = None,
                in_window_weight: float = 1.0) -> dict[str, Any]:
    """What `teller rca train` does after the epochs of a MoT that reads the trace, in its order:
    the flag expert (``flag_expert``, with the unit statistics and a prior above 0), the
    calibration on the val part (abnormal cut for ``abnormal_prior``, operator threshold), the
    fault-type expert and the operator expert (``type_expert``, ``op_expert``, with the unit
    statistics; the latter with a family head), the novelty (with the unit statistics) and the
    floor for the stage's lasting departures. The val part is prepared once for all of them. With
    ``out`` the experts' files are written there once all are fitted and those of an earlier fit
    not fitted again are removed (`teller rca experts`; the caller rewrites config.json); returns
    the calibration block, which replaces the model's (its experts and calibration of an earlier
    fit are dropped first, so a model fitted again gets what its training would have kept). An
    expert that cannot be fitted (one kind of unit, too few types, no slot) is skipped with a line
    to ``say``."""
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    # from the model as its epochs left it: experts and a calibration of an earlier fit do not read into this one
    model.flag_expert = model.type_expert = model.op_expert = model.novelty = None
    model.meta["calibration"] = {}
    _, val_prep = part_units(model, ds, split, "val")  # prepared once: the calibration and the experts read it
    if model.cfg.reads_unit_stats and flag_expert and (abnormal_prior is None or abnormal_prior > 0):
        try:
            fx = fit_flag_expert(model, ds, split, prior=abnormal_prior, seed=seed, prep=val_prep, in_window_weight=in_window_weight)
            say(f"flag expert: weight {fx['flag_weight']} (step F1 on the val part at a fault prior, with its cut: "
                + ", ".join(f"{r['weight']}: {r['f1_at_prior']:.3f} at {r['cut']:.2f}" for r in fx["flag_expert"]["grid"]) + ")")
        except TellerError as e:  # one kind of unit only: the head alone
            say(f"flag expert skipped: {e}")
    calibrate(model, ds, split, "val", prior=abnormal_prior, prep=val_prep)  # each step below keeps model.meta["calibration"]
    if model.cfg.reads_unit_stats and type_expert:
        try:
            te = fit_type_expert(model, ds, split, seed=seed)
            say(f"type expert: weight {te['type_weight']} (fault-type macro-F1 on the val part's abnormal units "
                + ", ".join(f"{r['weight']}: {r['macro_f1']:.3f}" for r in te["type_expert"]["grid"]) + ")")
        except TellerError as e:  # too few fault types to learn from: the head alone
            say(f"type expert skipped: {e}")
    if model.cfg.reads_unit_stats and model.cfg.reads_family_slots and op_expert:
        try:
            ox = fit_op_expert(model, ds, split, seed=seed, prep=val_prep)
            say(f"operator expert: weight {ox['op_weight']} (Macro+ F1 on the val part "
                + ", ".join(f"{r['weight']}: {r['macro_plus_f1']:.3f}" for r in ox["op_expert"]["grid"]) + ")")
        except TellerError as e:  # no slot of either kind to learn from: the head alone
            say(f"operator expert skipped: {e}")
    if model.cfg.reads_unit_stats:
        try:
            nv = fit_novelty(model, ds, split)
            say("novelty: " + ", ".join(f"{v} {r['units']} training units, cut {r['cut']:.2f}" for v, r in nv["views"].items()))
        except TellerError as e:  # no training fault to measure against: no novelty
            say(f"novelty skipped: {e}")
    ef = calibrate_episode_floor(model, ds, split, prep=val_prep)
    cal = model.meta["calibration"]
    say("episode floor: " + (", ".join(f"{v} {r['floor']:.2g} ({r['units']} normal units)" for v, r in ef["views"].items())
                             or "none (no normal val unit)"))
    if "abnormal" in cal:
        ab = cal["abnormal"]
        say(f"abnormal cut {ab['abnormal_cut']:.2f} (step F1 on the val part at a {ab['prior']:.0%} fault prior "
            f"{ab['f1_at_prior']:.3f}, at {ABNORMAL_CUT}: {ab['f1_at_0_5']:.3f})")
    say(f"operator threshold {cal['op_threshold']:+.1f} (logit; Macro+ F1 on the val part "
        f"{cal['macro_plus_f1']:.3f}, at 0: {cal['macro_plus_f1_at_0']:.3f})")
    if out is not None:  # written once all are fitted (a failure above leaves the folder as it was); an expert
        # of an earlier fit that was not fitted again goes (the model would not read it)
        from teller.rca.flagexpert import FLAG_EXPERT_FILE
        from teller.rca.novelty import NOVELTY_FILE
        from teller.rca.opexpert import OP_EXPERT_FILE
        from teller.rca.typer import TYPE_EXPERT_FILE

        for key, name, part in (("flag_weight", FLAG_EXPERT_FILE, model.flag_expert), ("type_weight", TYPE_EXPERT_FILE, model.type_expert),
                                ("op_weight", OP_EXPERT_FILE, model.op_expert), ("novelty", NOVELTY_FILE, model.novelty)):
            if key in cal and part is not None:
                part.save(out)
            else:
                (Path(out) / name).unlink(missing_ok=True)
    return cal


#: the fault prior a model's abnormal cut is chosen for (:func:`calibrate_abnormal`): faults are
#: rare where the model runs; the low-prior analysis of `teller evaluate` scores 10% and 5%
ABNORMAL_PRIOR = 0.1
#: abnormal probabilities tried as the cut (from :data:`teller.rca.schema.ABNORMAL_CUT` up)
ABNORMAL_CUTS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


def f1_at_prior(recall: float, false_rate: float, prior: float) -> float:
    """Step F1 expected at fault prior ``prior`` from a detector's recall and false-positive rate
    (precision = prior·R / (prior·R + (1 − prior)·FPR)), as the low-prior analysis samples it."""
    if recall <= 0:
        return 0.0
    precision = prior * recall / (prior * recall + (1 - prior) * false_rate)
    return 2 * precision * recall / (precision + recall)


def part_units(model: RCA, ds: Dataset, split: str, part: str, prep: Prepared | None = None) -> tuple[np.ndarray, Prepared]:
    """The units of ``split``'s ``part`` and their inputs as ``model`` reads them, without labels:
    ``prep`` where the caller prepared them already (``teller rca train`` prepares the val part
    once for its calibration and experts), else prepared here."""
    idx = ds.units.part(split, part)
    if not len(idx):
        raise TellerError(f"{ds.path}: no units in the {part} part of the {split} split")
    if prep is None:
        prep, _ = prepare_units(ds, idx, model.cfg, model.text_tok, model.trace_tok, model.ref, labels=False)
    elif len(prep) != len(idx):
        raise TellerError(f"{len(prep)} prepared units for the {len(idx)} of the {part} part of the {split} split")
    return idx, prep


def calibrate_abnormal(model: RCA, ds: Dataset, split: str, part: str = "val", prior: float = ABNORMAL_PRIOR,
                       batch_size: int = 64, grid: tuple[float, ...] = ABNORMAL_CUTS,
                       prep: Prepared | None = None) -> dict[str, Any]:
    """The abnormal cut (:attr:`RCA.abnormal_cut`) with the best step F1 expected at fault prior
    ``prior`` on ``split``'s ``part`` (held-out units, never the test part): the units' recall and
    false-positive rate at each cut of ``grid``, weighted to the prior (:func:`f1_at_prior`); ties
    to the lowest cut. A part without both normal and abnormal units keeps
    :data:`teller.rca.schema.ABNORMAL_CUT`. ``prep``: the part's units as :func:`part_units`
    prepared them, where the caller has them. Returns the ``abnormal`` block of the calibration."""
    if model.cfg.variant != "mot" or not model.cfg.reads_trace:
        raise TellerError("only a MoT model that reads the trace has its abnormal cut chosen")
    if not 0.0 < prior < 1.0:
        raise TellerError(f"fault prior {prior}: expected a share in (0, 1)")
    idx, prep = part_units(model, ds, split, part, prep)
    p_ab = model.abnormal_probs(prep, batch_size)
    truth = ds.units.select(idx).is_anomaly.astype(bool)
    return {**abnormal_block(p_ab, truth, prior, grid), "split": split, "part": part}


def abnormal_block(p_ab: np.ndarray, truth: np.ndarray, prior: float, grid: tuple[float, ...] = ABNORMAL_CUTS) -> dict[str, Any]:
    """The cut of ``grid`` with the best step F1 expected at fault prior ``prior`` for abnormal
    probabilities ``p_ab`` of units whose truth is ``truth`` (ties to the lowest cut; without both
    kinds of unit :data:`teller.rca.schema.ABNORMAL_CUT`), with every cut's row."""
    truth = np.asarray(truth, bool)

    def row(c: float) -> dict[str, float]:
        flag = p_ab >= c
        r = float(flag[truth].mean()) if truth.any() else 0.0
        fpr = float(flag[~truth].mean()) if (~truth).any() else 0.0
        return {"cut": float(c), "recall": round(r, 6), "false_positive_rate": round(fpr, 6),
                "f1_at_prior": round(f1_at_prior(r, fpr, prior), 6)}

    rows = [row(c) for c in grid]
    both = bool(truth.any() and (~truth).any())
    best = max(rows, key=lambda r: (r["f1_at_prior"], -r["cut"])) if both else row(ABNORMAL_CUT)
    at = row(ABNORMAL_CUT)["f1_at_prior"]
    return {"abnormal_cut": best["cut"] if both else ABNORMAL_CUT, "prior": float(prior),
            "units": int(len(truth)), "abnormal_units": int(truth.sum()), "f1_at_prior": best["f1_at_prior"],
            "f1_at_0_5": at, "grid": rows}


def calibrate(model: RCA, ds: Dataset, split: str, part: str = "val", prior: float | None = None,
              batch_size: int = 64, prep: Prepared | None = None) -> dict[str, Any]:
    """A MoT's calibration on held-out units: its abnormal cut for fault prior ``prior`` (None:
    :data:`ABNORMAL_PRIOR`; 0: none chosen), then its operator threshold, which reads the flags of
    that cut (``prep``: the part's units, :func:`part_units`). Returns what
    :meth:`RCA.save_config` stores as ``calibration``; ``model`` uses it."""
    _, prep = part_units(model, ds, split, part, prep)
    prior = ABNORMAL_PRIOR if prior is None else float(prior)
    # the experts' weights were chosen apart (fit_type_expert, fit_op_expert, fit_flag_expert) and stay
    cal: dict[str, Any] = {k: v for k, v in (model.meta.get("calibration") or {}).items()
                           if k in ("type_weight", "type_expert", "op_weight", "op_expert", "flag_weight", "flag_expert",
                                    "novelty", "episode_floor")}
    if prior > 0:
        cal["abnormal"] = calibrate_abnormal(model, ds, split, part, prior, batch_size, prep=prep)
        cal["abnormal_cut"] = cal["abnormal"]["abnormal_cut"]
    model.meta["calibration"] = dict(cal)
    cal.update(calibrate_operators(model, ds, split, part, batch_size, prep=prep))
    model.meta["calibration"] = cal
    return cal


#: the quantile of a model's abnormal probability over its val part's normal units (warm-up out,
#: each view apart) under which it rules out even a lasting departure of the numeric stage
#: (:func:`calibrate_episode_floor`): chosen on the nested datasets' folds with the episode length
#: (docs/results.md, "A floor relative to the model")
EPISODE_QUANTILE = 0.85


def unit_abnormal_probs(model: RCA, ds: Dataset, idx: np.ndarray, prep: Prepared, batch_size: int = 64) -> np.ndarray:
    """Per unit ``idx`` of ``ds`` (prepared as ``prep``): the abnormal probability ``teller
    evaluate``'s model rows give it, the flag expert read on the workload shapes
    :meth:`RCA.use_flag_expert` keeps it for (the model's own setting restored after)."""
    from teller.rca.data import run_workloads

    shapes = run_workloads(ds)
    shape = np.asarray([shapes.get(r, "") for r in ds.units.run_id[idx].tolist()], dtype=object)
    keep_off = model.flag_off
    try:
        use = {w: model.use_flag_expert(w or None) for w in set(shape.tolist())}
        with_flag = model.abnormal_probs(prep, batch_size, flag=True) if any(use.values()) else None
        head = model.abnormal_probs(prep, batch_size, flag=False) if not all(use.values()) else None
    finally:
        model.flag_off = keep_off
    on = np.asarray([use[w] for w in shape.tolist()], bool)
    if with_flag is None:
        return head
    return with_flag if head is None else np.where(on, with_flag, head)


def calibrate_episode_floor(model: RCA, ds: Dataset, split: str, part: str = "val", quantile: float = EPISODE_QUANTILE,
                            batch_size: int = 64, prep: Prepared | None = None) -> dict[str, Any]:
    """The model's floor for the numeric stage's lasting departures, relative to the model: per
    view, the ``quantile`` of its abnormal probability (:func:`unit_abnormal_probs`) over the normal
    units of ``split``'s ``part`` (held out, never the test part), warm-up iterations left out.
    Probabilities differ by orders of magnitude from one training to another, so a floor set once
    for every model rules out steps of one it keeps for another. Sets
    ``calibration["episode_floor"]`` (read by :func:`teller.rca.episode_floor`) and returns that
    block; a view without normal units gets none (the absolute :data:`teller.rca.EPISODE_FLOOR`)."""
    from teller.rca.context import dataset_unit_warmup

    if model.cfg.variant != "mot" or not model.cfg.reads_trace:
        raise TellerError("only a MoT model that reads the trace has an episode floor")
    if not 0.0 < quantile < 1.0:
        raise TellerError(f"quantile {quantile}: expected a share in (0, 1)")
    idx, prep = part_units(model, ds, split, part, prep)
    u = ds.units.select(idx)
    normal = ~u.is_anomaly.astype(bool) & ~dataset_unit_warmup(ds)[idx]
    p = unit_abnormal_probs(model, ds, idx, prep, batch_size)
    view = np.asarray(u.view, dtype=str)
    views = {}
    for v in sorted(set(view.tolist())):
        m = normal & (view == v)
        if m.any():
            views[v] = {"floor": float(np.quantile(p[m], quantile)), "units": int(m.sum()),
                        "median": float(np.median(p[m]))}
    block = {"split": split, "part": part, "quantile": float(quantile), "views": views}
    model.meta.setdefault("calibration", {})["episode_floor"] = block
    return block


#: logits tried as the operator head's threshold (0 = p 0.5, the untrained default)
OP_THRESHOLDS = (-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Macro₊ F1 within which a threshold counts as good as the val part's best (the one nearest 0 of
#: them is chosen): on a flat grid the best row is a few units' noise, and a far threshold picked
#: for it can cost much recall on other runs (docs/results.md, "The abnormal cut")
OP_TOLERANCE = 0.005


def pick_threshold(rows: list[dict[str, float]], tolerance: float = OP_TOLERANCE) -> dict[str, float]:
    """The row of ``rows`` ({threshold, macro_plus_f1}) nearest threshold 0 (the lower on a tie)
    among those whose Macro₊ F1 is within ``tolerance`` of the best."""
    top = max(r["macro_plus_f1"] for r in rows)
    return min((r for r in rows if r["macro_plus_f1"] >= top - tolerance), key=lambda r: (abs(r["threshold"]), r["threshold"]))


def operator_families(model: RCA, prep: Prepared, heads: list[tuple[str, Any]], threshold: float,
                      op_weight: float | None = None) -> list[set[str]]:
    """The families ``model`` names for each unit of ``prep`` (``heads``: :meth:`RCA.operator_logits`;
    none for a unit it calls normal) at logit ``threshold`` and operator-expert weight ``op_weight``
    (None: the model's)."""
    return [set(model.evidence_families(prep, i, ft, sc, threshold, op_weight=op_weight)) if ft else set()
            for i, (ft, sc) in enumerate(heads)]


def operator_row(model: RCA, prep: Prepared, heads: list[tuple[str, Any]], truth: list[set[str]], threshold: float,
                 op_weight: float | None = None) -> dict[str, float]:
    """Operator Macro₊ F1, precision and recall of the families ``model`` names for the units of
    ``prep`` (``heads``: :meth:`RCA.operator_logits`) at logit ``threshold`` and operator-expert
    weight ``op_weight`` (None: the model's), against ``truth``: one row of a calibration grid."""
    from teller.rca.metrics import operator_metrics

    m = operator_metrics(truth, operator_families(model, prep, heads, threshold, op_weight))
    return {k: round(float(m[k]), 6) for k in ("macro_plus_f1", "macro_plus_precision", "macro_plus_recall")}


def pick_weight(rows: list[dict[str, float]], key: str) -> float:
    """An expert's weight: of ``rows`` ({weight, ``key``}) the best ``key``, ties to the weight
    nearest 0.5, then the lower."""
    top = max(r[key] for r in rows)
    return min((r["weight"] for r in rows if r[key] == top), key=lambda w: (abs(w - 0.5), w))


def calibrate_operators(model: RCA, ds: Dataset, split: str, part: str = "val", batch_size: int = 64,
                        grid: tuple[float, ...] = OP_THRESHOLDS, prep: Prepared | None = None) -> dict[str, Any]:
    """The operator head's logit threshold (:attr:`RCA.op_threshold`): of the thresholds whose
    operator Macro₊ F1 on ``split``'s ``part`` (held-out units, never the test part a model is
    scored on) is within :data:`OP_TOLERANCE` of the best, the one nearest 0. The head is trained with positives weighted
    ``op_pos_weight`` times, so its 0.5 point names more operators than the labels hold; the
    threshold moves no step flag and no fault type, only which operators a flagged step names.
    ``prep``: the part's units (:func:`part_units`). Returns the metadata :meth:`RCA.save_config`
    stores as ``calibration``."""
    from teller.rca.metrics import operator_truth

    if model.cfg.variant != "mot" or not model.cfg.reads_trace:
        raise TellerError("only a MoT model that reads the trace has an operator head to calibrate")
    idx, prep = part_units(model, ds, split, part, prep)
    heads = model.operator_logits(prep, batch_size)
    u = ds.units.select(idx)
    truth = operator_truth(u.operator_labels, u.is_anomaly)
    rows = [{"threshold": float(t), **operator_row(model, prep, heads, truth, t)} for t in grid]
    top = max(r["macro_plus_f1"] for r in rows)
    best = pick_threshold(rows)
    at0 = next((r["macro_plus_f1"] for r in rows if r["threshold"] == 0.0), float("nan"))
    return {"op_threshold": best["threshold"], "split": split, "part": part, "units": int(len(idx)),
            "operator_positive_units": int(sum(bool(x) for x in truth)), "macro_plus_f1": best["macro_plus_f1"],
            "macro_plus_f1_best": top, "tolerance": OP_TOLERANCE, "macro_plus_f1_at_0": at0, "grid": rows}


def evaluate(model: RCA, ds: Dataset, split: str, part: str = "test", batch_size: int = 64,
             explain: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any], np.ndarray]:
    """Predictions and metrics (all units, and per view) of ``split``'s ``part``; the model's own
    tokenizers and reference are applied (nothing is refitted)."""
    from teller.rca.metrics import evaluate_predictions

    idx = ds.units.part(split, part)
    if not len(idx):
        raise TellerError(f"the {part} part of the {split} split holds none of the {len(ds.units):,} units read; "
                          "read more of the dataset (a larger --max-units) or another part")
    prep, _ = prepare_units(ds, idx, model.cfg, model.text_tok, model.trace_tok, model.ref, labels=False)
    pred = model.predict(prep, batch_size=batch_size, explain=explain)
    u = ds.units.select(idx)
    expl = list(u.explanation) if explain else None
    res: dict[str, Any] = {"split": split, "part": part,
                           "all": evaluate_predictions(pred, u.is_anomaly, u.fault, u.operator_labels, expl)}
    for v in ("vertical", "horizontal"):
        m = np.flatnonzero(u.view == v)
        if len(m):
            res[v] = evaluate_predictions([pred[i] for i in m.tolist()], u.is_anomaly[m], u.fault[m],
                                          [u.operator_labels[i] for i in m.tolist()],
                                          [expl[i] for i in m.tolist()] if expl is not None else None)
    return pred, res, idx


# ---- the experts (teller.rca.typer, .opexpert, .flagexpert), fitted after the network ----
def unit_features(model: RCA, ds: Dataset, idx: np.ndarray) -> np.ndarray:
    """The unit statistics features (:meth:`ReferenceStats.unit_features`) of units ``idx`` as
    ``model`` reads them, without the rest of their inputs."""
    require_unit(ds, model.cfg.unit)
    u = ds.units.select(idx)
    inp = encode_units(ds.forest, model.trace_tok, u.run_id.tolist(), u.step_ids, [""] * len(idx), model.cfg.max_trace_tokens,
                       u.view.tolist())
    return model.ref.unit_features(unit_statistics(inp))


# ---- the fault-type expert (teller.rca.typer) ----
def fit_type_expert(model: RCA, ds: Dataset, split: str, seed: int = 0, batch_size: int = 64,
                    out: str | Path | None = None) -> dict[str, Any]:
    """Fit the expert on ``split``'s training part (its abnormal units), choose its weight on the
    val part (the best fault-type macro-F1 of :data:`TYPE_WEIGHTS` over the abnormal val units,
    every type present in their truth or the mix's answers counted, as `teller evaluate` scores
    it; ties to the weight nearest 0.5, then the lower), attach both to ``model`` and, with ``out``,
    save the expert there. Returns the ``type_expert`` block of the calibration (with
    ``type_weight``)."""
    from teller.rca.metrics import macro_f1
    from teller.rca.typer import TREES, TYPE_WEIGHTS, TYPES, TypeExpert, fuse

    if not model.cfg.reads_unit_stats:
        raise TellerError("the type expert reads the unit statistics: only a MoT trained with --unit-stats has them")
    u = ds.units

    def abnormal(part: str) -> np.ndarray:
        idx = u.part(split, part)
        return idx[u.is_anomaly[idx].astype(bool)]

    tr, va = abnormal("train"), abnormal("val")
    # the training units' statistics alone: the trees read nothing else of them
    Xtr = unit_features(model, ds, tr) if len(tr) else np.zeros((0, 0))
    ytr = np.asarray(u.fault[tr], np.int64) - 1
    expert = TypeExpert.fit(Xtr, ytr, seed=seed)
    rows = []
    if len(va):  # the val units' whole inputs: the head reads them too
        prep, _ = prepare_units(ds, va, model.cfg, model.text_tok, model.trace_tok, model.ref, labels=False)
        head = model.fault_probs(prep, batch_size)
        ex = expert.proba(prep.unit_feat)
        yva = np.asarray(u.fault[va], np.int64) - 1
        for w in TYPE_WEIGHTS:
            pred = fuse(head, ex, w)[:, 1:].argmax(1)
            f1 = macro_f1([TYPES[k] for k in yva.tolist()], [TYPES[k] for k in pred.tolist()], TYPES)["macro_f1"]
            rows.append({"weight": w, "macro_f1": round(f1, 6)})
    weight = pick_weight(rows, "macro_f1") if rows else 0.5
    model.type_expert, model.meta.setdefault("calibration", {})["type_weight"] = expert, weight
    block = {"split": split, "train_units": int(len(tr)), "val_units": int(len(va)), "classes": expert.classes,
             "trees": TREES, "seed": seed, "grid": rows, "chosen": weight}
    model.meta["calibration"]["type_expert"] = block
    if out is not None:
        expert.save(out)
    return {"type_weight": weight, "type_expert": block}


# ---- the operator expert (teller.rca.opexpert), fitted after the network ----
def fit_op_expert(model: RCA, ds: Dataset, split: str, seed: int = 0, batch_size: int = 64,
                  out: str | Path | None = None, prep: Prepared | None = None) -> dict[str, Any]:
    """Fit the operator expert on the family slots of ``split``'s abnormal training units (target:
    the slot's family is one of the unit's operator labels), choose its weight on the val part
    (the best operator Macro₊ F1 of :data:`teller.rca.opexpert.OP_WEIGHTS` over every val unit, at
    the model's operator threshold and abnormal cut, as :func:`calibrate_operators` scores; ties
    to the weight nearest 0.5, then the lower), attach both to ``model`` and, with ``out``, save
    the expert there (``prep``: the val part's units, :func:`part_units`). Returns the
    ``op_expert`` block of the calibration (with ``op_weight``)."""
    from teller.rca.metrics import operator_truth
    from teller.rca.opexpert import OP_WEIGHTS, TREES, OperatorExpert, slot_features

    if not (model.cfg.variant == "mot" and model.cfg.reads_trace and model.cfg.reads_family_slots
            and model.cfg.reads_unit_stats):
        raise TellerError("the operator expert reads family slots and unit statistics: only a MoT trained with "
                          "--op-unit family and --unit-stats has them")
    u = ds.units
    tr, va = u.part(split, "train"), u.part(split, "val")
    tr = tr[u.is_anomaly[tr].astype(bool)]
    if not len(tr) or not len(va):
        raise TellerError(f"{ds.path}: the operator expert needs abnormal units in the train part and units in the val part "
                          f"of the {split} split (got {len(tr)} and {len(va)})")
    trp, _ = prepare_units(ds, tr, model.cfg, model.text_tok, model.trace_tok, model.ref)
    expert = OperatorExpert.fit(slot_features(trp, model.ref), trp.slot_target, seed=seed)
    n_slots, n_pos = int(len(trp.slot_target)), int(np.asarray(trp.slot_target).sum())
    del trp
    model.op_expert = expert
    _, prep = part_units(model, ds, split, "val", prep)
    heads = model.operator_logits(prep, batch_size)
    sel = u.select(va)
    truth = operator_truth(sel.operator_labels, sel.is_anomaly)
    rows = [{"weight": w, **operator_row(model, prep, heads, truth, model.op_threshold, w)} for w in OP_WEIGHTS]
    weight = pick_weight(rows, "macro_plus_f1")
    model.meta.setdefault("calibration", {})["op_weight"] = weight
    block = {"split": split, "train_units": int(len(tr)), "train_slots": n_slots, "labelled_slots": n_pos,
             "val_units": int(len(va)), "op_threshold": model.op_threshold, "trees": TREES, "seed": seed,
             "grid": rows, "chosen": weight}
    model.meta["calibration"]["op_expert"] = block
    if out is not None:
        expert.save(out)
    return {"op_weight": weight, "op_expert": block}


# ---- the flag expert (teller.rca.flagexpert) ----
def fit_novelty(model: RCA, ds: Dataset, split: str, out: str | Path | None = None) -> dict[str, Any]:
    """Fit the model's novelty (:mod:`teller.rca.novelty`) on the units of ``split``'s training
    part (each view apart), its cut on the val part's units; attach it to ``model``
    (``calibration["novelty"]``) and, with ``out``, save it there. Returns the block."""
    from teller.rca.novelty import split_novelty

    if not (model.cfg.variant == "mot" and model.cfg.reads_unit_stats):
        raise TellerError("the novelty reads the units' context: only a MoT trained with --unit-stats has one")
    nov = split_novelty(ds, split, model.trace_tok)
    model.novelty = nov
    block = {"split": split, "part": "val", **nov.describe()}
    model.meta.setdefault("calibration", {})["novelty"] = block
    if out is not None:
        nov.save(out)
    return block


def fit_flag_expert(model: RCA, ds: Dataset, split: str, prior: float | None = None, seed: int = 0, batch_size: int = 64,
                    out: str | Path | None = None, prep: Prepared | None = None, reads: str = "context",
                    views: Sequence[str] | None = None, in_window_weight: float = 1.0) -> dict[str, Any]:
    """Fit the flag expert on every unit of ``views`` of ``split``'s training part (target: abnormal), then
    choose its weight and the abnormal cut together on the val part: for each weight of
    :data:`teller.rca.flagexpert.FLAG_WEIGHTS` the cut :func:`calibrate_abnormal` would choose on
    the mixed probability (fault prior ``prior``, None: :data:`ABNORMAL_PRIOR`), and of those the
    best step F1 expected at the prior, ties to the lower weight (the head's). Attaches both to
    ``model`` (``flag_weight``, ``abnormal_cut`` and the ``abnormal`` block of the calibration)
    and, with ``out``, saves the expert there (``prep``: the val part's units,
    :func:`part_units`). The operator threshold and the other experts' weights stay as they were
    chosen. ``reads``: the expert's columns, the shape-free context (``"context"``,
    :mod:`teller.rca.context`) or the layer mix against the training reference (``"stats"``).
    ``views``: the views whose units the expert is fitted on and reads (None:
    :data:`teller.rca.flagexpert.FLAG_VIEWS`); the other units keep the head's probability, and
    the cut is chosen on every val unit. ``in_window_weight``: the weight in the trees' loss of a
    normal training unit that a fault window overlaps (the fault ran, the labels measured no
    effect: the units a model most often flags wrongly, docs/results.md); the others weigh 1.
    Returns the ``flag_expert`` block of the calibration (with ``flag_weight``)."""
    from teller.rca.api import unit_in_views
    from teller.rca.context import dataset_context_features
    from teller.rca.flagexpert import FLAG_VIEWS, FLAG_WEIGHTS, READS, TREES, FlagExpert, mix

    if not (model.cfg.variant == "mot" and model.cfg.reads_unit_stats):
        raise TellerError("the flag expert reads the unit statistics: only a MoT trained with --unit-stats has them")
    prior = ABNORMAL_PRIOR if prior is None else float(prior)
    if not 0.0 < prior < 1.0:
        raise TellerError(f"fault prior {prior}: expected a share in (0, 1)")
    u = ds.units
    views = list(FLAG_VIEWS if views is None else views)
    tr = u.part(split, "train")
    tr = tr[np.isin(u.view[tr].astype(str), views)]
    y = u.is_anomaly[tr].astype(bool)
    if reads not in READS:
        raise TellerError(f"--reads {reads}: expected one of {', '.join(READS)}")
    X = dataset_context_features(ds, tr, model.trace_tok) if reads == "context" else unit_features(model, ds, tr)
    if in_window_weight <= 0:
        raise TellerError(f"--in-window-weight {in_window_weight}: expected a weight above 0")
    in_window_normal = None if u.in_window is None else ~y & u.in_window[tr].astype(bool)
    sw = None
    if in_window_weight != 1.0:
        if in_window_normal is None:
            raise TellerError(f"{ds.path}/records.parquet has no in_window column: no unit can be weighted by it")
        sw = np.where(in_window_normal, float(in_window_weight), 1.0)
    expert = FlagExpert.fit(X, y, seed=seed, reads=reads, weight=sw)
    idx, prep = part_units(model, ds, split, "val", prep)
    truth = u.is_anomaly[idx].astype(bool)
    if not (truth.any() and (~truth).any()):
        raise TellerError(f"{ds.path}: the flag expert's weight is chosen on normal and abnormal val units of the {split} split "
                          f"(got {int(truth.sum())} abnormal of {len(truth)})")
    head = model.abnormal_probs(prep, batch_size, flag=False)
    px = expert.proba(expert.features(prep))
    on = unit_in_views(prep, np.arange(len(prep)), views)  # the other views' units keep the head's
    blocks = {w: abnormal_block(mix(head, px, w * on), truth, prior) for w in FLAG_WEIGHTS}
    rows = [{"weight": w, "cut": b["abnormal_cut"], "f1_at_prior": b["f1_at_prior"],
             **{k: r[k] for r in b["grid"] if r["cut"] == b["abnormal_cut"] for k in ("recall", "false_positive_rate")}}
            for w, b in blocks.items()]
    top = max(r["f1_at_prior"] for r in rows)
    weight = min(r["weight"] for r in rows if r["f1_at_prior"] == top)
    cal = model.meta.setdefault("calibration", {})
    model.flag_expert = expert
    cal["flag_weight"] = weight
    cal["abnormal"] = {**blocks[weight], "split": split, "part": "val"}
    cal["abnormal_cut"] = blocks[weight]["abnormal_cut"]
    block = {"split": split, "train_units": int(len(tr)), "train_abnormal": int(y.sum()), "val_units": int(len(idx)),
             "prior": prior, "reads": reads, "views": views, "trees": TREES, "seed": seed, "grid": rows, "chosen": weight,
             "in_window_weight": float(in_window_weight),
             "train_in_window_normal": None if in_window_normal is None else int(in_window_normal.sum())}
    cal["flag_expert"] = block
    if out is not None:
        expert.save(out)
    return {"flag_weight": weight, "flag_expert": block}
