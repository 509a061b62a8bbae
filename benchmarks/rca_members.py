"""Two trainings of the root-cause model side by side, and averaged: does a second training lift the
scores, and does the fault head of a ``pool_drop`` model answer better from the layer mix alone?

    python benchmarks/rca_members.py runs/h200_v2_all --split run --models A B -o benchmarks/results/rca_members_run.json

For each model directory (trained on ``--split``; they must share the tokenizers and the reference,
as trainings of one recipe with other seeds do): the unit-level test metrics of ``teller rca
predict`` (vertical and horizontal: step F1, fault-type macro-F1, operator Macro₊ F1). Then the
average of the models: their fault heads' class probabilities and their operator logits averaged,
its abnormal cut and operator threshold chosen on the val part as ``teller rca train`` does
(``teller.rca.train.calibrate``), scored on the same test units. With ``--stats-alone`` (models
trained with ``--pool-drop``): each model's fault head on the unit statistics alone (``fault_head(u)``,
the path ``pool_drop`` trains), and the mean of that and the whole head's probabilities.
Answers without explanations; CPU or ``--device cuda``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from teller.rca import load
from teller.rca.data import load_dataset
from teller.rca.train import calibrate, evaluate


class Averaged(nn.Module):
    """The members' outputs averaged: fault-class probabilities (returned as their log), operator
    and family logits; the language-model logits are the first member's."""

    def __init__(self, nets: list[nn.Module]):
        super().__init__()
        self.nets = nn.ModuleList(nets)
        self.cfg = nets[0].cfg

    def forward(self, *args, **kw):
        outs = [n(*args, **kw) for n in self.nets]
        o = dict(outs[0])
        o["fault"] = torch.log(torch.stack([torch.softmax(x["fault"], -1) for x in outs]).mean(0))
        for key in ("ops", "fam"):
            if key in o:
                o[key] = torch.stack([x[key] for x in outs]).mean(0)
        return o


class StatsAlone(nn.Module):
    """A MoT whose fault logits come from the unit statistics alone (``mode`` "alone"), or whose
    fault probabilities are the mean of that and the whole head's (``mode`` "mean")."""

    def __init__(self, net: nn.Module, mode: str):
        super().__init__()
        self.net, self.mode, self.cfg = net, mode, net.cfg

    def forward(self, prompt, prompt_valid, trace, target, target_valid, cache=None):
        o = dict(self.net(prompt, prompt_valid, trace, target, target_valid, cache))
        fu = self.net.fault_head(self.net.unit_feat(trace["unit_feat"].to(o["fault"].dtype))).float()
        o["fault"] = fu if self.mode == "alone" else torch.log((torch.softmax(o["fault"], -1) + torch.softmax(fu, -1)) / 2)
        return o


def brief(met: dict) -> dict:
    return {v: {"step_f1": round(met[v]["step"]["f1"], 4),
                "fault_type_macro_f1": round(met[v]["fault_type"]["macro_f1"], 4),
                "operator_macro_plus_f1": round(met[v]["operator"]["macro_plus_f1"], 4)}
            for v in ("vertical", "horizontal") if v in met}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--split", required=True)
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--stats-alone", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    t0 = time.time()
    members = [load(d, device=a.device) for d in a.models]
    units = {m.cfg.unit for m in members}
    if len(units) != 1:
        raise SystemExit(f"--models: the models read different units ({sorted(units)})")
    ds = load_dataset(a.dataset, unit=units.pop())
    res: dict = {"dataset": a.dataset, "split": a.split, "models": a.models, "members": {}, "command":
                 "python benchmarks/rca_members.py " + " ".join([a.dataset, "--split", a.split, "--models", *a.models]
                                                               + (["--stats-alone"] if a.stats_alone else []))}
    for d, m in zip(a.models, members, strict=True):
        _, met, _ = evaluate(m, ds, a.split, "test", explain=False)
        res["members"][d] = {"abnormal_cut": m.abnormal_cut, "op_threshold": m.op_threshold, **brief(met)}
        if a.stats_alone:
            for mode in ("alone", "mean"):
                s = load(d, device=a.device)
                s.net = StatsAlone(s.net, mode).eval()
                _, met, _ = evaluate(s, ds, a.split, "test", explain=False)
                res["members"][d][f"fault_head_stats_{mode}"] = brief(met)
        print(d, res["members"][d], f"{time.time() - t0:.0f} s", flush=True)
    if len(members) > 1:
        avg = load(a.models[0], device=a.device)
        avg.net = Averaged([m.net for m in members]).eval()
        calibrate(avg, ds, a.split, "val")
        _, met, _ = evaluate(avg, ds, a.split, "test", explain=False)
        res["averaged"] = {"abnormal_cut": avg.abnormal_cut, "op_threshold": avg.op_threshold, **brief(met)}
        print("averaged", res["averaged"], f"{time.time() - t0:.0f} s", flush=True)
    res["seconds"] = round(time.time() - t0, 1)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
