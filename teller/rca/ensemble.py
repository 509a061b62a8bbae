"""Several trainings of one recipe read as one model (:class:`Ensemble`, ``teller rca ensemble``).

Trainings of the same MoT recipe that differ only in their seed disagree on a share of the units
(docs/results.md: step F1 moves by up to 0.03 between seeds on the run split). An ensemble reads
every unit with each member and answers once:

- **abnormal**: the members' abnormal probabilities averaged as log-odds, ``σ(mean logit p_k)``,
  against the cut ``σ(mean logit cut_k)``: a unit is flagged when the members' log-odds stand
  above their own cuts on average (each member's cut was chosen on its val part);
- **fault type**: the members' five type probabilities given abnormal (each with its type
  expert's share), averaged;
- **operators**: per family slot (or trace token), the probability each member names it by
  (:meth:`teller.rca.api.RCA.operator_probs`: σ(score − its threshold), with its operator
  expert's share), averaged; named above 0.5, the best one when none is, at most ``max_ops``;
- **explanation**: written by the first member, then projected onto the ensemble's type and
  operators as every model's is (:func:`teller.rca.schema.project_explanation`).

The members must read their units alike (same unit, operator head, inputs, tokenizers and
reference: one encoding serves them all); they are MoT models (the single-stream model names its
answers as text). A saved ensemble is a folder with ``ensemble.json`` naming its members' model
directories (relative to it where they lie below it); :func:`load` reads either kind of folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from teller.errors import InputError, TellerError
from teller.rca.api import RCA, FamilyScores, floor_below
from teller.rca.api import load as load_model
from teller.rca.batch import Prepared
from teller.rca.data import FAULT_TYPES, StepInputs
from teller.rca.schema import project_fault
from teller.rca.typer import type_shares

ENSEMBLE_FILE = "ensemble.json"
FORMAT = "teller-rca-ensemble"
FORMAT_VERSION = 1

#: the config keys that decide how a unit is encoded: members must agree on them
ENCODING_KEYS = ("variant", "inputs", "unit", "op_unit", "fam_span", "unit_stats", "trace_vocab", "tpe_max_token_nodes",
                 "max_trace_tokens", "max_log_tokens", "max_depth", "max_parent_offset", "max_ops")
#: probabilities are kept inside [EPS, 1 − EPS] before their log-odds are taken
EPS = 1e-6


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(p, np.float64), EPS, 1.0 - EPS)
    return np.log(p) - np.log1p(-p)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(z, np.float64)))


class Ensemble:
    """Members (loaded :class:`RCA` models) answering as one; ``predict`` returns what
    :meth:`RCA.predict` does."""

    def __init__(self, members: Sequence[RCA], names: Sequence[str] | None = None):
        members = list(members)
        self.names = [str(n) for n in names] if names is not None else [f"member {k}" for k in range(len(members))]
        if len(members) < 2:
            raise TellerError(f"an ensemble needs at least two models, got {len(members)}")
        if len(self.names) != len(members):
            raise TellerError(f"{len(self.names)} names for {len(members)} models")
        lead = members[0]
        for name, m in zip(self.names, members, strict=True):
            if m.cfg.variant != "mot":
                raise TellerError(f"{name}: a {m.cfg.variant} model; an ensemble reads MoT models (their heads' "
                                  "probabilities are averaged; the single-stream model writes its answers as text)")
            a, b = lead.cfg.to_json(), m.cfg.to_json()
            diff = [k for k in ENCODING_KEYS if a.get(k) != b.get(k)]
            if diff:
                raise TellerError(f"{name} encodes units differently from {self.names[0]} ({', '.join(f'{k}: {b.get(k)!r} against {a.get(k)!r}' for k in diff)}); "
                                  "an ensemble's members are trainings of one recipe")
            if m is not lead and not _same_encoding(lead, m):
                raise TellerError(f"{name}'s tokenizers or duration reference differ from {self.names[0]}'s; an ensemble's "
                                  "members are trainings of one recipe on the same split of the same dataset")
        self.members = members
        tr = [m.meta.get("training", {}) for m in members]
        self.meta: dict[str, Any] = {
            "training": {**{k: v for k, v in tr[0].items() if k != "seed"}, "seeds": [t.get("seed") for t in tr]},
            "calibration": {"abnormal_cut": self.abnormal_cut},
            "ensemble": {"members": self.names, "abnormal_cuts": [m.abnormal_cut for m in members]},
        }

    # ---- what the members share -----------------------------------------------------------------
    @property
    def cfg(self):
        return self.members[0].cfg

    @property
    def text_tok(self):
        return self.members[0].text_tok

    @property
    def trace_tok(self):
        return self.members[0].trace_tok

    @property
    def ref(self):
        return self.members[0].ref

    @property
    def device(self) -> torch.device:
        return self.members[0].device

    def use_flag_expert(self, shape: str | None, context: bool = True) -> bool:
        """Each member's :meth:`RCA.use_flag_expert` for workload shape ``shape``; whether any
        member uses its flag expert."""
        return any([m.use_flag_expert(shape, context) for m in self.members])

    @property
    def abnormal_cut(self) -> float:
        """``σ(mean logit cut_k)``: the ensemble flags a unit when ``mean logit p_k`` reaches
        ``mean logit cut_k``."""
        return float(_sigmoid(_logit(np.array([m.abnormal_cut for m in self.members])).mean()))

    def unit_novelty(self, prep: Prepared) -> np.ndarray | None:
        """The first member's with a fitted novelty (:meth:`RCA.unit_novelty`; the members are
        trained on one split, so their training units are the same), else None."""
        for m in self.members:
            if m.novelty is not None:
                return m.unit_novelty(prep)
        return None

    def inputs(self, *args, **kwargs) -> StepInputs:
        """:meth:`RCA.inputs` (the members encode alike)."""
        return self.members[0].inputs(*args, **kwargs)

    def prepare(self, inp: StepInputs, iterations: np.ndarray | None = None) -> Prepared:
        return self.members[0].prepare(inp, iterations)

    # ---- prediction -------------------------------------------------------------------------------
    def abnormal_probs(self, prep: Prepared, batch_size: int = 64) -> np.ndarray:
        """Per unit of ``prep``: the ensemble's abnormal probability, ``σ(mean logit p_k)``."""
        z = np.mean([_logit(m.abnormal_probs(prep, batch_size)) for m in self.members], 0)
        return _sigmoid(z)

    def heads(self, prep: Prepared, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """The members' heads averaged over units ``idx``: abnormal probability (averaged log-odds),
        the five type probabilities given abnormal, and per unit the probability of each operator
        slot (family head) or token and the mean of the members' token logits above their thresholds
        (which of a family's nodes names it)."""
        n = len(idx)
        z = np.zeros(n)
        types = np.zeros((n, len(FAULT_TYPES) - 1))
        ops: list[np.ndarray] | None = None
        toks: list[np.ndarray] | None = None
        for m in self.members:
            _, probs, scores = m.head_scores(prep, idx)
            z += _logit(1.0 - probs[:, 0])
            types += type_shares(probs)[1]
            p = [m.operator_probs(sc) for sc in scores]
            t = [np.asarray(sc.tokens if isinstance(sc, FamilyScores) else sc, np.float64) - m.op_threshold for sc in scores]
            ops = p if ops is None else [a + b for a, b in zip(ops, p, strict=True)]
            toks = t if toks is None else [a + b for a, b in zip(toks, t, strict=True)]
        k = len(self.members)
        return _sigmoid(z / k), types / k, [o / k for o in ops or []], [t / k for t in toks or []]

    @torch.no_grad()
    def predict(self, step_inputs: StepInputs | Prepared, batch_size: int = 64, explain: bool = True,
                explain_done: Callable[[str, str], bool] | None = None,
                explain_tokens: int | None = None, abnormal_floor: float | None = None) -> list[dict[str, Any]]:
        """One dict per unit, as :meth:`RCA.predict` (the same keys and arguments)."""
        abnormal_floor = floor_below(abnormal_floor, self.abnormal_cut)
        prep = step_inputs if isinstance(step_inputs, Prepared) else self.prepare(step_inputs)
        lead = self.members[0]
        for m in self.members:
            m.net.eval()
        stop = lead._explain_stop(explain_done, explain_tokens)
        out: list[dict[str, Any]] = []
        for a in range(0, len(prep), batch_size):
            idx = np.arange(a, min(a + batch_size, len(prep)))
            p_ab, types, ops, toks = self.heads(prep, idx)
            heads = []
            for k, i in enumerate(idx.tolist()):
                six = np.concatenate([[1.0 - p_ab[k]], p_ab[k] * types[k]])
                _, ftype, tp = project_fault(six, abnormal_floor)
                best = FAULT_TYPES[1 + int(np.argmax(types[k]))]
                heads.append((float(p_ab[k]), ftype, tp, best, self._nodes(prep, i, ftype, ops[k], toks[k])))
            texts = lead.explain_units(prep, idx, [h[1] for h in heads], stop) if explain else {}
            out += [lead._finish(prep, i, *heads[k][:5], texts.get(k)) for k, i in enumerate(idx.tolist())]
        return out

    def explain(self, prep: Prepared, idx: Sequence[int], ftypes: Sequence[str], batch_size: int = 64,
                explain_done: Callable[[str, str], bool] | None = None,
                explain_tokens: int | None = None) -> list[str]:
        """:meth:`RCA.explain`, by the lead member (who writes the explanations :meth:`predict` gives)."""
        return self.members[0].explain(prep, idx, ftypes, batch_size, explain_done, explain_tokens)

    node_families = staticmethod(RCA.node_families)

    def _nodes(self, prep: Prepared, i: int, ftype: str, probs: np.ndarray, toks: np.ndarray) -> list[int]:
        """Unit ``i``'s evidence nodes from the averaged operator probabilities (their log-odds at
        threshold 0, the lead member's rules for picking nodes)."""
        lead = self.members[0]
        z = _logit(probs)
        z[np.asarray(probs) <= 0.0] = -np.inf  # a slot no member can name stays unnamed
        if lead.cfg.op_unit == "family":
            return lead._family_nodes(prep, i, ftype, FamilyScores(toks, z), 0.0, op_weight=0.0)
        return lead._evidence_nodes(prep, i, ftype, z, 0.0)

    # ---- files ------------------------------------------------------------------------------------
    def save(self, directory: str | Path, paths: Sequence[str | Path]) -> Path:
        """Write ``directory/ensemble.json`` naming the members' model directories ``paths`` (in
        this ensemble's order; relative to ``directory`` where they lie below it, else absolute)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if len(paths) != len(self.members):
            raise TellerError(f"{len(paths)} paths for {len(self.members)} members")
        names = []
        for p in paths:
            p = Path(p).resolve()
            try:
                names.append(p.relative_to(d.resolve()).as_posix())
            except ValueError:
                names.append(str(p))
        doc = {"format": FORMAT, "version": FORMAT_VERSION, "members": names,
               "what": "trainings of one recipe read as one model: averaged abnormal log-odds against the averaged "
                       "log-odds of their cuts, averaged type probabilities, averaged operator probabilities",
               "abnormal_cut": round(self.abnormal_cut, 6), "training": self.meta["training"]}
        (d / ENSEMBLE_FILE).write_text(json.dumps(doc, indent=1))
        return d

    @classmethod
    def load(cls, directory: str | Path, device: str = "cpu") -> "Ensemble":
        d = Path(directory)
        p = d / ENSEMBLE_FILE
        fix = "write it with `teller rca ensemble MODEL MODEL... -o DIR`"
        try:
            doc = json.loads(p.read_text())
        except FileNotFoundError:
            raise InputError(p, "missing: not an ensemble directory", fix) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(p, f"not valid JSON ({e})", fix) from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or int(doc.get("version", 99)) > FORMAT_VERSION:
            raise InputError(p, f"not an ensemble this teller reads ({FORMAT} ≤ {FORMAT_VERSION})", fix)
        names = doc.get("members")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise InputError(p, "'members' is not a list of model directories", fix)
        paths = [Path(n) if os.path.isabs(n) else d / n for n in names]
        for n, q in zip(names, paths, strict=True):
            if not (q / "config.json").is_file():
                raise InputError(p, f"member {n!r}: no model at {q}", "restore the model directory or write the ensemble again")
        try:
            return cls([load_model(q, device) for q in paths], names)
        except TellerError as e:
            if isinstance(e, InputError):
                raise
            raise InputError(p, str(e), fix) from e


def _same_encoding(a: RCA, b: RCA) -> bool:
    """Whether ``a`` and ``b`` encode a unit alike: the same trace and text tokenizers and the same
    duration reference."""
    ta, tb = a.trace_tok, b.trace_tok
    if ta.vocab != tb.vocab or not np.array_equal(np.asarray(ta.merges), np.asarray(tb.merges)):
        return False
    if a.text_tok.to_str() != b.text_tok.to_str():
        return False
    return a.ref.to_json() == b.ref.to_json()


def load(path: str | Path, device: str = "cpu") -> "RCA | Ensemble":
    """A saved model (``teller rca train -o PATH``) or ensemble (``teller rca ensemble -o PATH``)."""
    if (Path(path) / ENSEMBLE_FILE).is_file():
        if device == "cuda" and not torch.cuda.is_available():
            raise TellerError("--device cuda: no CUDA device here; use --device cpu")
        return Ensemble.load(path, device)
    return load_model(path, device)
