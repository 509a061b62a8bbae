"""A trained RCA model as one object: files, inputs, prediction (:class:`RCA`, :func:`load`).

A model directory holds (loaded without pickle: JSON and safetensors only):

- ``config.json``: format, :class:`.model.RCAConfig` (with the backbone's own config), the fault
  classes, the training summary;
- ``model.safetensors``: the weights (``save_dtype``, float16 for the shipped sizes), in parts
  ``model-0000K-of-0000N.safetensors`` above :data:`SHARD_BYTES`;
- ``tokenizer.json``: the byte-level BPE text tokenizer (Hugging Face ``tokenizers``);
- ``trace_tokenizer/``: the TPE tokenizer (``vocab.json``, ``merges.json``, ``tokenizer_config.json``);
- ``reference.json``: the duration reference statistics (:class:`.data.ReferenceStats`);
- ``checkpoint/`` while training: float32 weights, optimizer state and the step counter (resume).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import torch

from teller.errors import InputError, TellerError
from teller.rca.batch import Prepared, prepare, prompt_batch, target_batch, trace_batch
from teller.rca.data import (
    FAULT_TYPES,
    ReferenceStats,
    StepForest,
    StepInputs,
    encode_units,
    step_forest,
)
from teller.rca.model import RCAConfig, build_model
from teller.rca.schema import (
    ABNORMAL_CUT,
    NameTrie,
    project_explanation,
    project_fault,
    project_operators,
)
from teller.rca.text import (
    EOS,
    EXPL,
    NO,
    OPS,
    PAD,
    SEP,
    SPECIALS,
    TYPE,
    TYPE_TOKENS,
    YES,
    encode_texts,
    load_text_tokenizer,
)


@dataclass
class FamilyScores:
    """A family operator head's logits for one unit: per trace token (``tokens``) and per family
    slot (``families``, :class:`teller.rca.data.FamilySlots`) and, where the model has an operator
    expert, its probability per slot (``expert``, :mod:`teller.rca.opexpert`)."""

    tokens: np.ndarray
    families: np.ndarray
    expert: np.ndarray | None = None


#: a selected token names every node it covers of its anchor's layer (a token merged from a
#: module and its first child module names both); TELLER_RCA_EVIDENCE=anchor names the anchor only
EVIDENCE_COVER = os.environ.get("TELLER_RCA_EVIDENCE", "cover") != "anchor"

FORMAT = "teller-rca"
FORMAT_VERSION = 1
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


#: weights above this size are written in parts (``model-00001-of-00002.safetensors``, ...), so no
#: file of a model directory — the shipped one is in the repository — exceeds it
SHARD_BYTES = 6 << 20


def weight_files(path: Path) -> list[Path]:
    """The file(s) holding the weights saved at ``path``: ``path`` itself, or its parts."""
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(path.parent.glob(f"{path.stem}-*-of-*{path.suffix}"))


def pack(model_dir: str | Path, tar_path: str | Path, name: str, max_bytes: int | None = None) -> Path:
    """The model directory as an (uncompressed) tar under the folder ``name``, without its
    ``checkpoint/`` (training state): what a trained model ships as. With ``max_bytes`` a tar over
    it is compressed instead (``TAR_PATH.gz``, gzip level 1: the experts' trees and the tokenizers
    shrink, the float16 weights a little; the tar removed). Returns the file written."""
    import gzip
    import shutil
    import tarfile

    model_dir, tar_path = Path(model_dir), Path(tar_path)
    with tarfile.open(tar_path, "w") as tf:
        for f in sorted(model_dir.rglob("*")):
            if f.is_file() and "checkpoint" not in f.relative_to(model_dir).parts:
                tf.add(f, arcname=f"{name}/{f.relative_to(model_dir)}")
    if max_bytes is None or tar_path.stat().st_size <= max_bytes:
        return tar_path
    gz = tar_path.with_name(tar_path.name + ".gz")
    with open(tar_path, "rb") as src, gzip.open(gz, "wb", compresslevel=1) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    tar_path.unlink()
    return gz


def save_weights(module: torch.nn.Module, path: Path, dtype: str = "float32", metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    sd = {k: v.detach().to("cpu", _DTYPES[dtype]).contiguous() for k, v in module.state_dict().items()}
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():  # tensors in state-dict order, a new part when the current one is full
        nb = v.numel() * v.element_size()
        if parts[-1] and size + nb > SHARD_BYTES:
            parts.append({})
            size = 0
        parts[-1][k] = v
        size += nb
    names = [path] if len(parts) == 1 else [
        path.with_name(f"{path.stem}-{i + 1:05d}-of-{len(parts):05d}{path.suffix}") for i in range(len(parts))]
    for old in [f for f in weight_files(path) if f not in names]:  # what an earlier save left
        old.unlink()
    for part, name in zip(parts, names, strict=True):
        tmp = name.with_suffix(".tmp")
        save_file(part, str(tmp), metadata=meta)
        tmp.replace(name)


def load_weights(module: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    files = weight_files(path)
    if not files:
        raise InputError(path, "missing", "retrain the model with `teller rca train`")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    own = module.state_dict()
    bad = sorted(set(own) ^ set(sd))
    if bad:
        raise InputError(path, f"weights do not match the model of config.json ({len(bad)} names differ, e.g. {bad[0]!r})",
                         "use the files of one `teller rca train` output directory together")
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()})


class RCA:
    """A loaded (or freshly trained) model: ``inputs`` builds :class:`StepInputs` from forest rows,
    ``predict`` returns one dict per unit (see :meth:`predict`)."""

    def __init__(self, cfg: RCAConfig, net: torch.nn.Module, text_tok, trace_tok, ref: ReferenceStats,
                 meta: dict | None = None, device: str | torch.device = "cpu"):
        self.cfg, self.net, self.text_tok, self.trace_tok, self.ref = cfg, net, text_tok, trace_tok, ref
        self.meta = dict(meta or {})
        self.device = torch.device(device)
        self.net.to(self.device)
        #: the fault-type expert (:mod:`teller.rca.typer`), where one was fitted
        self.type_expert = None
        #: the operator expert (:mod:`teller.rca.opexpert`), where one was fitted
        self.op_expert = None
        #: the abnormal-step expert (:mod:`teller.rca.flagexpert`), where one was fitted
        self.flag_expert = None
        #: True: the flag expert is left out (:meth:`use_flag_expert`)
        self.flag_off = False
        #: how unlike the training steps a unit is (:mod:`teller.rca.novelty`), where one was fitted
        self.novelty = None

    # ---- files --------------------------------------------------------------------------------
    def save(self, directory: str | Path, dtype: str | None = None, extra: dict | None = None) -> Path:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.save_tokenizers(d)
        save_weights(self.net, d / "model.safetensors", dtype or self.cfg.save_dtype, {"format": FORMAT})
        if self.type_expert is not None:
            self.type_expert.save(d)
        if self.op_expert is not None:
            self.op_expert.save(d)
        if self.flag_expert is not None:
            self.flag_expert.save(d)
        if self.novelty is not None:
            self.novelty.save(d)
        return self.save_config(d, extra)

    def save_config(self, directory: str | Path, extra: dict | None = None) -> Path:
        """(Re)write ``config.json`` alone, with ``extra`` merged into the model's metadata (a
        calibration after training); weights and tokenizers are left as they are."""
        d = Path(directory)
        meta = {**self.meta, **(extra or {})}
        cfg = {"format": FORMAT, "version": FORMAT_VERSION, "config": self.cfg.to_json(),
               "fault_types": list(FAULT_TYPES), "text_vocab": self.text_tok.get_vocab_size(),
               "trace_vocab": len(self.trace_tok), **meta}
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        self.meta = meta
        return d

    @property
    def op_threshold(self) -> float:
        """Logit above which the operator head's tokens are evidence (0: p 0.5); the value
        :func:`teller.rca.train.calibrate_operators` chose on held-out units, where it ran."""
        return float((self.meta.get("calibration") or {}).get("op_threshold", 0.0))

    @property
    def type_weight(self) -> float:
        """The type expert's weight in a flagged unit's fault type (0 without an expert):
        :func:`teller.rca.train.fit_type_expert` chose it on held-out units."""
        if self.type_expert is None:
            return 0.0
        return float((self.meta.get("calibration") or {}).get("type_weight", 0.5))

    @property
    def op_weight(self) -> float:
        """The operator expert's weight in a flagged unit's families (0 without an expert):
        :func:`teller.rca.train.fit_op_expert` chose it on held-out units."""
        if self.op_expert is None:
            return 0.0
        return float((self.meta.get("calibration") or {}).get("op_weight", 0.0))

    @property
    def flag_weight(self) -> float:
        """The flag expert's weight in a unit's abnormal probability (0 without an expert):
        :func:`teller.rca.train.fit_flag_expert` chose it with the abnormal cut on held-out units."""
        if self.flag_expert is None or self.flag_off:
            return 0.0
        return float((self.meta.get("calibration") or {}).get("flag_weight", 0.0))

    def use_flag_expert(self, shape: str | None, context: bool = True) -> bool:
        """Read the units of a run of workload shape ``shape`` (the dataset's ``workload`` column,
        e.g. ``"2 layers, hidden 1024"``) with the flag expert only where the model was trained on
        that shape (``training.workloads``; a model that records none keeps it). On another shape
        the head reads alone, against the cut chosen for it alone (the flag expert's grid row of
        weight 0): the trees read the layer mix of the shapes they were fitted on, and on a shape
        held out they cost step F1 where the head did not (docs/results.md, "The flag expert").
        A layer-mix expert (``reads == "stats"``) follows that rule. An expert that reads the
        shape-free context (``reads == "context"``, :mod:`teller.rca.context`) is used on every
        shape where the caller can give the units' context (``context``; its reference is every
        step of the run, so `teller diagnose --model-reads flagged` serializes them all for it and
        leaves the expert out where it cannot). Returns whether the
        expert is used."""
        known = (self.meta.get("training") or {}).get("workloads") or []
        if self.flag_expert is not None and self.flag_expert.reads == "context":
            self.flag_off = not context
        else:
            self.flag_off = bool(known) and shape not in known
        return self.flag_expert is not None and not self.flag_off

    def unit_novelty(self, prep: Prepared) -> np.ndarray | None:
        """Per unit of ``prep``, its novelty (:mod:`teller.rca.novelty`: above 1, further from every
        training step than 99 in 100 held-out steps of the kinds trained on); None without a
        fitted novelty or where the units' context was not prepared."""
        if self.novelty is None or prep.unit_ctx is None:
            return None
        return self.novelty.ratio(prep.unit_ctx, list(prep.inputs.view) if prep.inputs.view else None)

    @property
    def abnormal_cut(self) -> float:
        """The abnormal probability from which the model flags a unit: the value
        :func:`teller.rca.train.calibrate_abnormal` chose on held-out units for a deployment's
        low fault prior, where it ran, else :data:`teller.rca.schema.ABNORMAL_CUT`; with the flag
        expert left out (:meth:`use_flag_expert`) the cut chosen for the head alone."""
        cal = self.meta.get("calibration") or {}
        if self.flag_off and self.flag_expert is not None:
            head = [r["cut"] for r in (cal.get("flag_expert") or {}).get("grid", []) if not r.get("weight")]
            if head:
                return float(head[0])
        return float(cal.get("abnormal_cut", ABNORMAL_CUT))

    def save_tokenizers(self, d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        self.text_tok.save(str(d / "tokenizer.json"))
        self.trace_tok.save(d / "trace_tokenizer")
        self.ref.save(d / "reference.json")

    @classmethod
    def load(cls, directory: str | Path, device: str = "cpu") -> "RCA":
        from teller.tpe.tokenizer import TraceTokenizer

        d = Path(directory)
        p = d / "config.json"
        if not p.is_file():
            raise InputError(p, "missing: not a model directory", "give the -o directory of `teller rca train`")
        try:
            meta = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise InputError(p, f"not valid JSON ({e})", "retrain the model with `teller rca train`") from e
        if meta.get("format") != FORMAT or int(meta.get("version", 99)) > FORMAT_VERSION:
            raise InputError(p, f"format {meta.get('format')!r} version {meta.get('version')!r} is not an RCA model "
                             f"this teller reads ({FORMAT} ≤ {FORMAT_VERSION})", "retrain the model with `teller rca train`")
        if list(meta.get("fault_types", [])) != list(FAULT_TYPES):
            raise InputError(p, f"fault classes {meta.get('fault_types')} differ from {list(FAULT_TYPES)}", "retrain the model")
        cfg = RCAConfig.from_json(meta["config"])
        text_tok = load_text_tokenizer(d / "tokenizer.json")
        trace_tok = TraceTokenizer.load(d / "trace_tokenizer")
        ref = ReferenceStats.load(d / "reference.json")
        if cfg.reads_family_slots and bool(cfg.fam_span) != ref.family_span:
            raise InputError(d / "reference.json", f"its family statistics {'hold' if ref.family_span else 'lack'} the summed "
                             f"spans, but config.json has fam_span {cfg.fam_span}", "retrain the model with `teller rca train`")
        if cfg.reads_unit_stats and not len(ref.unit_stats):
            raise InputError(d / "reference.json", "it holds no unit statistics, but config.json has unit_stats true",
                             "retrain the model with `teller rca train`")
        net = build_model(cfg, text_tok.get_vocab_size(), len(trace_tok), pretrained=False)
        load_weights(net, d / "model.safetensors")
        net.eval()
        rest = {k: v for k, v in meta.items() if k not in ("format", "version", "config", "fault_types", "text_vocab", "trace_vocab")}
        m = cls(cfg, net, text_tok, trace_tok, ref, rest, device)
        if "type_weight" in (rest.get("calibration") or {}):
            from teller.rca.typer import TypeExpert

            if not cfg.reads_unit_stats:
                raise InputError(p, "its calibration gives a type expert a weight, but the model reads no unit statistics",
                                 "retrain the model with `teller rca train --unit-stats`")
            m.type_expert = TypeExpert.load(d)
        if "op_weight" in (rest.get("calibration") or {}):
            from teller.rca.opexpert import OperatorExpert

            if not (cfg.reads_unit_stats and cfg.reads_family_slots):
                raise InputError(p, "its calibration gives an operator expert a weight, but the model has no family head "
                                 "reading unit statistics", "retrain the model with `teller rca train --op-unit family --unit-stats`")
            m.op_expert = OperatorExpert.load(d)
        if "flag_weight" in (rest.get("calibration") or {}):
            from teller.rca.flagexpert import FlagExpert

            if not cfg.reads_unit_stats:
                raise InputError(p, "its calibration gives a flag expert a weight, but the model reads no unit statistics",
                                 "retrain the model with `teller rca train --unit-stats`")
            m.flag_expert = FlagExpert.load(d)
        if "novelty" in (rest.get("calibration") or {}):
            from teller.rca.novelty import Novelty

            m.novelty = Novelty.load(d)
        return m

    # ---- inputs -------------------------------------------------------------------------------
    def inputs(self, forest: pa.Table | StepForest, steps: Sequence[Sequence[int]], log_text: Sequence[str] | None = None,
               run_ids: Sequence[str] | None = None, views: Sequence[str] | None = None) -> StepInputs:
        """Model inputs of units given as lists of step node ids (one per rank) of ``forest`` (a
        run's ``forest.parquet`` table, a dataset's subtrees, or a :class:`StepForest` of the
        model's unit). For a model of unit "iteration" a table must hold the iteration rows
        beside the STEP subtrees (rows with the STEP row's ``step_idx`` and ``step_id`` -1, as a run's
        forest and a dataset's subtrees do); where they are missing the units are the STEP subtrees."""
        if isinstance(forest, StepForest) and forest.unit != self.cfg.unit:
            raise TellerError(f"the steps were serialized as unit {forest.unit!r}, the model reads unit {self.cfg.unit!r}; "
                              f"give the forest table or step_forest(table, unit={self.cfg.unit!r})")
        sf = forest if isinstance(forest, StepForest) else step_forest(forest, unit=self.cfg.unit)
        runs = list(run_ids) if run_ids is not None else [sf.runs[0]] * len(steps)
        logs = list(log_text) if log_text is not None else [""] * len(steps)
        return encode_units(sf, self.trace_tok, runs, [np.asarray(s, np.int64) for s in steps], logs,
                            self.cfg.max_trace_tokens, views)

    def prepare(self, inp: StepInputs, iterations: np.ndarray | None = None) -> Prepared:
        """The inputs of ``inp`` as the model reads them; ``iterations``: the units' iteration rows
        (:data:`teller.localize.features.ITER_FEATURES`), for the flag expert's context
        (:func:`teller.rca.batch.prepare`)."""
        return prepare(inp, self.text_tok, self.ref, self.cfg, iterations=iterations)

    # ---- prediction ---------------------------------------------------------------------------
    @torch.no_grad()
    def predict(self, step_inputs: StepInputs | Prepared, batch_size: int = 64, explain: bool = True,
                explain_done: Callable[[str, str], bool] | None = None,
                explain_tokens: int | None = None, abnormal_floor: float | None = None) -> list[dict[str, Any]]:
        """Per unit: ``abnormal_prob``, ``abnormal``, ``fault_type`` ("" when normal) and
        ``fault_type_prob`` (given abnormal), ``fault_type_best`` (the best of the five, also for a
        normal step), ``evidence_nodes`` (indices into the unit's nodes), ``evidence_node_ids``
        (forest node ids), ``evidence_operators`` (their families), ``explanation``.

        ``explain_done(text, fault_type)``: called after each explanation token with the text
        decoded so far; True ends that unit's explanation there (a caller that needs only its
        beginning, e.g. the mechanism `teller diagnose` keeps). ``explain_tokens``: at most this
        many explanation tokens (below the model's ``max_expl_tokens``). None (the defaults):
        every explanation runs to <eos> or ``max_expl_tokens``. ``abnormal_floor``: the abnormal
        probability from which a unit is abnormal (typed, evidenced, explained); the model's own
        :attr:`abnormal_cut` by default (None),
        lower where another detector already flagged the unit and the model only screens it
        (`teller diagnose`)."""
        abnormal_floor = floor_below(abnormal_floor, self.abnormal_cut)
        prep = step_inputs if isinstance(step_inputs, Prepared) else self.prepare(step_inputs)
        self.net.eval()
        stop = self._explain_stop(explain_done, explain_tokens)
        out: list[dict[str, Any]] = []
        for a in range(0, len(prep), batch_size):
            idx = np.arange(a, min(a + batch_size, len(prep)))
            out += (self._predict_mot if self.cfg.variant == "mot" else self._predict_single)(prep, idx, explain, stop,
                                                                                           abnormal_floor)
        return out

    def _explain_stop(self, explain_done: Callable[[str, str], bool] | None,
                      explain_tokens: int | None) -> Callable[[list[int], str], bool] | None:
        """``stop(ids, fault_type)``, asked after each explanation token (ids so far): whether it
        ends there (:meth:`predict`'s ``explain_done`` and ``explain_tokens``)."""
        if explain_done is None and explain_tokens is None:
            return None

        def stop(ids: list[int], ftype: str) -> bool:
            if explain_tokens is not None and len(ids) >= explain_tokens:
                return True
            return explain_done is not None and explain_done(self.text_tok.decode([t for t in ids if t >= len(SPECIALS)]), ftype)

        return stop

    def _amp(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        import contextlib

        return contextlib.nullcontext()

    def _forward(self, prep: Prepared, idx: np.ndarray, targets: list[list[int]], cache=None):
        p, pv = prompt_batch(prep, idx, self.device)
        tr = trace_batch(prep, idx, self.device)
        t, tv = target_batch([np.asarray(x, np.int64) for x in targets], self.device)
        with self._amp():
            return self.net(p, pv, tr, t, tv, **({} if cache is None else {"cache": cache}))

    def _decode(self, prep: Prepared, idx: np.ndarray, targets: list[list[int]], choose) -> None:
        """Lockstep greedy decoding: ``choose(row, logits)`` returns the tokens to append to row
        ``row`` (one or more; the last forced by the format) or None when the row is done."""
        active = list(range(len(idx)))
        limit = self.cfg.max_expl_tokens + self.cfg.max_ops_tokens + 16
        for _ in range(limit):
            if not active:
                break
            res = self._forward(prep, idx[active], [targets[r] for r in active])["lm"]
            last = torch.tensor([len(targets[r]) - 1 for r in active], device=res.device)
            logits = res[torch.arange(len(active), device=res.device), last].float().cpu().numpy()
            still = []
            for k, r in enumerate(active):
                add = choose(r, logits[k])
                if add:
                    targets[r].extend(add)
                    still.append(r)
            active = still

    def _decode_cached(self, prep: Prepared, idx: np.ndarray, targets: list[list[int]], choose,
                       start: tuple[Any, torch.Tensor, np.ndarray] | None = None) -> None:
        """What :meth:`_decode` does, for the MoT model and one token per turn, with its key/value
        cache (:meth:`teller.rca.model.MoTModel.extend`): the prompt and trace are run once, then
        each new token costs one position instead of the whole sequence. The rows start with
        targets of one length; a finished row is fed padding until every row is done.
        ``start``: ``(cache, lm logits, rows)`` of a forward pass over a batch that ``idx`` is
        rows ``rows`` of, with these targets, whose cache was filled (the heads' pass): decoding
        goes on from it instead of running the prompt and trace again."""
        from teller.rca.model import KVCache

        if len({len(t) for t in targets}) != 1:
            return self._decode(prep, idx, targets, choose)
        if start is not None:
            cache, lm, rows = start
            sel = torch.as_tensor(rows, dtype=torch.long, device=self.device)
            if len(rows) != lm.shape[0]:  # keep the rows being decoded
                for d in (cache.k, cache.v):
                    for layer in d:
                        d[layer] = d[layer].index_select(0, sel)
                cache.valid, cache.last_pos = cache.valid.index_select(0, sel), cache.last_pos.index_select(0, sel)
            logits = lm.index_select(0, sel)[:, -1].float().cpu().numpy()
        else:
            cache = KVCache()
            p, pv = prompt_batch(prep, idx, self.device)
            tr = trace_batch(prep, idx, self.device)
            t, tv = target_batch([np.asarray(x, np.int64) for x in targets], self.device)
            with self._amp():
                logits = self.net(p, pv, tr, t, tv, cache=cache)["lm"][:, -1].float().cpu().numpy()
        done = [False] * len(idx)
        for _ in range(self.cfg.max_expl_tokens + self.cfg.max_ops_tokens + 16):
            nxt = []
            for r in range(len(idx)):
                add = None if done[r] else choose(r, logits[r])
                if add and len(add) != 1:
                    raise ValueError("cached decoding appends one token per turn")
                if add:
                    targets[r].extend(add)
                done[r] = not add
                nxt.append(add[0] if add else PAD)
            if all(done):
                break
            with self._amp():
                logits = self.net.extend(cache, torch.tensor(nxt, dtype=torch.long, device=self.device)).cpu().numpy()

    def _free_token(self, logits: np.ndarray, history: list[int], no_repeat: int = 3) -> int:
        """Greedy explanation token: no special token but <eos>, no repeated ``no_repeat``-gram
        (a small model's loops), <eos> at the length bound."""
        if len(history) >= self.cfg.max_expl_tokens:
            return EOS
        lg = logits.copy()
        lg[:len(SPECIALS)] = -np.inf
        lg[EOS] = logits[EOS]
        k = no_repeat - 1
        if len(history) >= k:
            tail = history[-k:]
            for i in range(len(history) - k):
                if history[i:i + k] == tail:
                    lg[history[i + k]] = -np.inf
        return int(np.argmax(lg))

    def _finish(self, prep: Prepared, i: int, p_ab: float, ftype: str, tp: float, best: str, nodes: list[int],
                text_ids: list[int] | None) -> dict[str, Any]:
        inp = prep.inputs
        no = inp.node_offsets
        fams = self.node_families(prep, i, nodes)
        ids = [int(inp.node_id[no[i] + n]) for n in nodes]
        text = self.text_tok.decode([t for t in (text_ids or []) if t >= len(SPECIALS)]) if text_ids else ""
        return {"abnormal_prob": p_ab, "abnormal": bool(ftype), "fault_type": ftype, "fault_type_prob": tp if ftype else 0.0,
                "fault_type_best": best, "evidence_nodes": nodes, "evidence_node_ids": ids,
                "evidence_operators": fams,
                "explanation": project_explanation(text, ftype, fams, self.cfg.max_explanation_chars)}

    def _predict_mot(self, prep: Prepared, idx: np.ndarray, explain: bool,
                     stop: Callable[[list[int], str], bool] | None = None, floor: float = ABNORMAL_CUT) -> list[dict[str, Any]]:
        from teller.rca.model import KVCache

        cache = KVCache() if explain else None  # the heads' pass fills it; decoding goes on from it
        res, raw = self._mot_heads(prep, idx, cache, floor)
        heads = [(p_ab, ftype, tp, best, self._evidence_nodes(prep, i, ftype, scores, self.op_threshold))
                 for i, (p_ab, ftype, tp, best, scores) in zip(idx.tolist(), raw, strict=True)]
        texts = self.explain_units(prep, idx, [h[1] for h in heads], stop, (cache, res["lm"])) if explain else {}
        return [self._finish(prep, int(i), *heads[k][:4], heads[k][4], texts.get(k) if heads[k][1] else None)
                for k, i in enumerate(idx.tolist())]

    def explain(self, prep: Prepared, idx: Sequence[int], ftypes: Sequence[str], batch_size: int = 64,
                explain_done: Callable[[str, str], bool] | None = None,
                explain_tokens: int | None = None) -> list[str]:
        """The explanation text of each unit ``idx[k]`` given its fault type ``ftypes[k]`` ("" for
        none: no text), after the heads already answered (:meth:`predict` with ``explain=False``):
        a caller that decides which units to explain from the answers of many. ``explain_done``,
        ``explain_tokens``: as in :meth:`predict`."""
        stop = self._explain_stop(explain_done, explain_tokens)
        idx = np.asarray(idx, np.int64)
        out = [""] * len(idx)
        self.net.eval()
        with torch.no_grad():
            for a in range(0, len(idx), batch_size):
                part = np.arange(a, min(a + batch_size, len(idx)))
                got = self.explain_units(prep, idx[part], [ftypes[k] for k in part.tolist()], stop)
                for k, ids in got.items():
                    out[int(part[k])] = self.text_tok.decode([t for t in ids if t >= len(SPECIALS)])
        return out

    def explain_units(self, prep: Prepared, idx: np.ndarray, ftypes: Sequence[str],
                      stop: Callable[[list[int], str], bool] | None = None,
                      start: tuple[Any, torch.Tensor] | None = None) -> dict[int, list[int]]:
        """Greedy explanation tokens of the units ``idx`` typed abnormal (``ftypes[k]`` not ""),
        by position ``k`` in ``idx``. ``stop``: :meth:`_explain_stop`'s; ``start``: (cache, lm
        logits) of a heads' pass over all of ``idx`` that decoding goes on from."""
        rows = [k for k, f in enumerate(ftypes) if f]
        if not rows:
            return {}
        sub_t = [[EXPL] for _ in rows]

        def choose(r: int, logits: np.ndarray):
            if stop is not None and stop(sub_t[r][1:], ftypes[rows[r]]):
                return None
            t = self._free_token(logits, sub_t[r][1:])
            return None if t == EOS else [t]

        self._decode_cached(prep, idx[rows], sub_t, choose, None if start is None else (*start, rows))
        return {k: t[1:] for k, t in zip(rows, sub_t, strict=True)}

    def _mot_heads(self, prep: Prepared, idx: np.ndarray, cache=None, floor: float | None = None) -> tuple[dict, list[tuple]]:
        """The MoT's fault and operator heads over units ``idx``: the forward pass's outputs and,
        per unit, (abnormal p, type or "" under ``floor``, type p, best type, operator logits of
        its trace tokens); ``floor`` None: :attr:`abnormal_cut`."""
        floor = self.abnormal_cut if floor is None else floor
        res, probs, scores = self.head_scores(prep, idx, cache)
        out = []
        for k, sc in enumerate(scores):
            p_ab, ftype, tp = project_fault(probs[k], floor)
            out.append((p_ab, ftype, tp, FAULT_TYPES[1 + int(np.argmax(probs[k][1:]))], sc))
        return res, out

    @torch.no_grad()
    def head_scores(self, prep: Prepared, idx: np.ndarray, cache=None) -> tuple[dict, np.ndarray, list]:
        """The MoT's heads over units ``idx`` in one forward pass: its outputs, the six class
        probabilities (normal first; the type expert's share in them) and, per unit, its operator
        scores (the token logits, or :class:`FamilyScores` of a family head)."""
        res = self._forward(prep, idx, [[EXPL] for _ in idx], cache)
        probs = self._with_expert(prep, idx, self._with_flag(prep, idx, torch.softmax(res["fault"], -1).float().cpu().numpy()))
        ops = res["ops"].float().cpu().numpy()
        fam = res["fam"].float().cpu().numpy() if "fam" in res else None
        pex = self._slot_expert(prep) if fam is not None else None
        scores: list = []
        for k, i in enumerate(idx.tolist()):
            s = prep.inputs.tokens(i)
            sc = ops[k, :s.stop - s.start]
            if fam is not None:
                fs = prep.slots.slots(i)
                sc = FamilyScores(sc, fam[k, :fs.stop - fs.start], pex[fs] if pex is not None else None)
            scores.append(sc)
        return res, probs, scores

    def operator_probs(self, scores: "np.ndarray | FamilyScores") -> np.ndarray:
        """A unit's operator scores as the probabilities the model names them by: per family slot
        (family head) or trace token, σ(score − threshold), with the operator expert's share at
        :attr:`op_weight` (:func:`teller.rca.opexpert.fuse_logits`); above 0.5 is named."""
        t = self.op_threshold
        if isinstance(scores, FamilyScores):
            z = self._family_logits(scores, t)
        else:
            z = np.nan_to_num(np.asarray(scores, np.float64), nan=-np.inf)
        with np.errstate(over="ignore"):
            return 1.0 / (1.0 + np.exp(-(z - t)))

    def _family_logits(self, scores: "FamilyScores", threshold: float, op_weight: float | None = None) -> np.ndarray:
        """A family head's slot logits, mixed with the operator expert at ``op_weight`` (None:
        :attr:`op_weight`) around ``threshold`` (:func:`teller.rca.opexpert.fuse_logits`)."""
        z = np.nan_to_num(np.asarray(scores.families, np.float64), nan=-np.inf)
        w = self.op_weight if op_weight is None else float(op_weight)
        if w > 0 and scores.expert is not None and len(z):
            from teller.rca.opexpert import fuse_logits

            z = fuse_logits(z, scores.expert, w, threshold)
        return z

    def _slot_expert(self, prep: Prepared) -> np.ndarray | None:
        """The operator expert's probability of every family slot of ``prep`` (computed once per
        ``prep`` and expert), or None without an expert."""
        if self.op_expert is None or prep.slots is None or prep.unit_feat is None:
            return None
        seen = prep.cache.setdefault("op_expert", [])  # (expert, its probabilities): several models may share ``prep``
        for expert, p in seen:
            if expert is self.op_expert:
                return p
        from teller.rca.opexpert import slot_features

        p = self.op_expert.proba(slot_features(prep, self.ref))
        seen.append((self.op_expert, p))
        return p

    def flag_expert_probs(self, prep: Prepared) -> np.ndarray | None:
        """The flag expert's abnormal probability of every unit of ``prep`` (computed once per
        ``prep`` and expert), or None without an expert or the columns it reads."""
        X = self.flag_expert.features(prep) if self.flag_expert is not None else None
        if X is None:
            return None
        seen = prep.cache.setdefault("flag_expert", [])  # (expert, its probabilities): several models may share ``prep``
        for expert, p in seen:
            if expert is self.flag_expert:
                return p
        p = self.flag_expert.proba(X)
        seen.append((self.flag_expert, p))
        return p

    @property
    def flag_views(self) -> list[str] | None:
        """The views whose units the flag expert reads (its calibration's ``views``); None: every
        view (an expert fitted before views were chosen)."""
        views = ((self.meta.get("calibration") or {}).get("flag_expert") or {}).get("views")
        return None if views is None else [str(v) for v in views]

    def _with_flag(self, prep: Prepared, idx: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """The fault head's six class probabilities with the flag expert's share of the abnormal
        mass (:func:`teller.rca.flagexpert.fuse`) on the units of the views it reads, or as they
        are without an expert."""
        w = self.flag_weight
        px = self.flag_expert_probs(prep) if w else None
        if px is None:
            return probs
        from teller.rca.flagexpert import fuse

        views = self.flag_views
        weight = w if views is None else w * unit_in_views(prep, idx, views)
        return fuse(probs, px[idx], weight)

    def _with_expert(self, prep: Prepared, idx: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """The fault head's six class probabilities with the type expert's share of the five types
        (:func:`teller.rca.typer.fuse`), or as they are without an expert."""
        w = self.type_weight
        if not w or prep.unit_feat is None:
            return probs
        from teller.rca.typer import fuse

        return fuse(probs, self.type_expert.proba(prep.unit_feat[idx]), w)

    @torch.no_grad()
    def fault_probs(self, prep: Prepared, batch_size: int = 64, expert: bool = False, flag: bool = True) -> np.ndarray:
        """The fault head's six class probabilities (normal first) of every unit of ``prep``, in
        batches (MoT only), with the flag expert's share in the abnormal mass (``flag``, where one
        is fitted; False: the head's alone); with ``expert`` the type expert's share in the types."""
        if self.cfg.variant != "mot":
            raise ValueError("class probabilities are the MoT's fault head's")
        self.net.eval()
        parts = []
        for a in range(0, len(prep), batch_size):
            idx = np.arange(a, min(a + batch_size, len(prep)))
            probs = torch.softmax(self._forward(prep, idx, [[EXPL] for _ in idx])["fault"], -1).float().cpu().numpy()
            if flag:
                probs = self._with_flag(prep, idx, probs)
            parts.append(self._with_expert(prep, idx, probs) if expert else probs)
        return np.concatenate(parts) if parts else np.zeros((0, len(FAULT_TYPES)))

    def abnormal_probs(self, prep: Prepared, batch_size: int = 64, flag: bool = True) -> np.ndarray:
        """Per unit of ``prep`` (MoT only): its abnormal probability (1 − the normal class's), for
        choosing :attr:`abnormal_cut`; with the flag expert's share where one is fitted (``flag``
        False: the head's alone)."""
        return 1.0 - self.fault_probs(prep, batch_size, flag=flag)[:, 0]

    @torch.no_grad()
    def operator_logits(self, prep: Prepared, batch_size: int = 64) -> list[tuple[str, np.ndarray]]:
        """Per unit of ``prep`` (MoT only): its predicted fault type ("" when normal) and the
        operator head's logits over its trace tokens, for choosing the threshold of
        :meth:`evidence_families`."""
        if self.cfg.variant != "mot":
            raise ValueError("operator logits are the MoT's operator head; the single-stream model names operators as text")
        self.net.eval()
        out: list[tuple[str, np.ndarray]] = []
        for a in range(0, len(prep), batch_size):
            _, raw = self._mot_heads(prep, np.arange(a, min(a + batch_size, len(prep))))
            out += [(r[1], r[4]) for r in raw]
        return out

    def evidence_families(self, prep: Prepared, i: int, ftype: str, scores: np.ndarray, threshold: float,
                          op_weight: float | None = None) -> list[str]:
        """The families :meth:`predict` names for unit ``i`` with the operator logits ``scores``
        at logit ``threshold`` (and the operator expert at ``op_weight``; None: :attr:`op_weight`)."""
        return self.node_families(prep, i, self._evidence_nodes(prep, i, ftype, scores, threshold, op_weight))

    def _evidence_nodes(self, prep: Prepared, i: int, ftype: str, scores: np.ndarray, threshold: float,
                        op_weight: float | None = None) -> list[int]:
        """Unit ``i``'s evidence nodes from its operator logits (none when the trace is not read)."""
        if not prep.trace_visible:
            return []
        inp = prep.inputs
        if isinstance(scores, FamilyScores):
            return self._family_nodes(prep, i, ftype, scores, threshold, op_weight)
        cover = (lambda t: inp.covered(i, t)) if EVIDENCE_COVER else None
        return project_operators(scores, inp.anchor[inp.tokens(i)], bool(ftype), self.cfg.max_ops, threshold, cover)

    def _family_nodes(self, prep: Prepared, i: int, ftype: str, scores: "FamilyScores", threshold: float,
                      op_weight: float | None = None) -> list[int]:
        """Evidence of a family head: the slots scored above ``threshold`` (the best one when none
        is), best first, at most ``max_ops``; each named by one of its nodes: the node of its family
        under its best-scored token (by the token head), or its longest node where no kept token
        stands for it. With an operator expert at weight ``op_weight`` (None: :attr:`op_weight`)
        the slot scores are the mix of :func:`teller.rca.opexpert.fuse_logits`."""
        inp, sl = prep.inputs, prep.slots
        fam_logit = self._family_logits(scores, threshold, op_weight)
        if not ftype or not len(fam_logit) or self.cfg.max_ops <= 0:
            return []
        order = np.argsort(-fam_logit, kind="stable")
        picked = [int(k) for k in order if fam_logit[k] > threshold] or [int(order[0])]
        s, m = sl.slots(i), sl.members(i)
        no, nn = int(inp.node_offsets[i]), int(inp.node_offsets[i + 1] - inp.node_offsets[i])
        node_fam = inp.node_family[no:no + nn].astype(np.int64)
        t0 = int(inp.offsets[i])
        tok_logit = np.asarray(scores.tokens, np.float64)
        out: list[int] = []
        for k in picked[:self.cfg.max_ops]:
            f = int(sl.family[s.start + k])
            toks = sl.member_tok[m][sl.member_slot[m] == k]
            node = -1
            if len(toks):
                t = int(toks[np.argmax(tok_logit[toks])])
                a = int(inp.anchor[t0 + t])
                if node_fam[a] == f:
                    node = a
                elif len(inp.span):
                    f0 = int(inp.first_node[t0 + t])
                    hit = np.flatnonzero(node_fam[f0:f0 + int(inp.span[t0 + t])] == f)
                    node = f0 + int(hit[0]) if len(hit) else -1
            if node < 0:
                cand = np.flatnonzero(node_fam == f)
                if not len(cand):
                    continue
                dur = inp.node_duration[no + cand] if len(inp.node_duration) else np.zeros(len(cand))
                node = int(cand[np.argmax(dur)])
            if node not in out:
                out.append(node)
        return out

    @staticmethod
    def node_families(prep: Prepared, i: int, nodes: list[int]) -> list[str]:
        """The distinct families of unit ``i``'s nodes ``nodes`` (indices into the unit's nodes, as
        ``evidence_nodes``), in their order."""
        inp = prep.inputs
        no = inp.node_offsets
        return list(dict.fromkeys(inp.families[int(inp.node_family[no[i] + n])] for n in nodes))

    def _predict_single(self, prep: Prepared, idx: np.ndarray, explain: bool,
                        stop: Callable[[list[int], str], bool] | None = None, floor: float = ABNORMAL_CUT) -> list[dict[str, Any]]:
        from teller.rca.text import ABN

        inp = prep.inputs
        n = len(idx)
        targets: list[list[int]] = [[ABN] for _ in range(n)]
        state = ["abn"] * n
        info: list[dict[str, Any]] = [dict(p_ab=0.0, ftype="", tp=0.0, best=FAULT_TYPES[1], names=[], expl=[]) for _ in range(n)]
        tries: list[NameTrie | None] = [None] * n
        node = [None] * n
        cur: list[list[int]] = [[] for _ in range(n)]
        name_ids: dict[str, list[int]] = {}
        max_ops = self.cfg.max_ops

        def trie_for(r: int) -> NameTrie:
            cands = prep.candidates(int(idx[r]))
            for c in cands:
                if c not in name_ids:
                    name_ids[c] = encode_texts(self.text_tok, [c], 64)[0]
            return NameTrie(cands, [name_ids[c] for c in cands])

        def choose(r: int, logits: np.ndarray):
            st = state[r]
            if st == "abn":
                pair = logits[[YES, NO]].astype(np.float64)
                pair = np.exp(pair - pair.max())
                info[r]["p_ab"] = float(pair[0] / pair.sum())
                state[r] = "type"
                return [YES if info[r]["p_ab"] >= floor else NO, TYPE]
            if st == "type":
                lg = logits[list(TYPE_TOKENS[1:])].astype(np.float64)
                pr = np.exp(lg - lg.max())
                pr /= pr.sum()
                k = int(np.argmax(pr))
                info[r]["best"] = FAULT_TYPES[1 + k]
                if info[r]["p_ab"] < floor:
                    return None
                info[r]["ftype"], info[r]["tp"] = FAULT_TYPES[1 + k], float(pr[k])
                tries[r] = trie_for(r)
                node[r] = tries[r].root
                state[r] = "ops"
                return [TYPE_TOKENS[1 + k], OPS]
            if st == "ops":
                t = tries[r]
                nd = node[r]
                allowed = NameTrie.allowed(nd)
                done_name = NameTrie.complete(nd)
                enders = []
                if done_name is not None or (nd is t.root and not allowed):
                    enders.append(EXPL)
                    if done_name is not None and len(info[r]["names"]) + 1 < max_ops and t.root and NameTrie.allowed(t.root):
                        enders.append(SEP)
                if len(cur[r]) >= self.cfg.max_ops_tokens and allowed and done_name is None:
                    enders = []  # finish the name being written
                elif len(cur[r]) >= self.cfg.max_ops_tokens and enders:
                    allowed = []
                choices = allowed + enders
                tok = choices[int(np.argmax(logits[choices]))]
                if tok in (SEP, EXPL):
                    if done_name is not None:
                        info[r]["names"].append(done_name)
                        t.remove(cur[r])
                    cur[r] = []
                    node[r] = t.root
                    if tok == EXPL:
                        state[r] = "expl"
                        if not explain:
                            return None
                    return [tok]
                cur[r].append(tok)
                node[r] = nd[tok]
                return [tok]
            # explanation
            if stop is not None and stop(info[r]["expl"], info[r]["ftype"]):
                return None
            tok = self._free_token(logits, info[r]["expl"])
            if tok == EOS:
                return None
            info[r]["expl"].append(tok)
            return [tok]

        self._decode(prep, idx, targets, choose)
        out = []
        for k, i in enumerate(idx.tolist()):
            f = info[k]
            s = inp.tokens(i)
            fam = inp.family[s]
            want = [inp.families.index(nm) for nm in f["names"]]
            nodes: list[int] = []
            for w in want:  # the anchors of the tokens of each named family, in input order
                for a in inp.anchor[s][fam == w][:2].tolist():
                    if int(a) not in nodes and len(nodes) < max_ops:
                        nodes.append(int(a))
            if f["ftype"] and not nodes and s.stop > s.start and prep.trace_visible:
                nodes = [int(inp.anchor[s][0])]
            out.append(self._finish(prep, i, f["p_ab"], f["ftype"], f["tp"], f["best"], nodes, f["expl"] if f["ftype"] else None))
        return out


def floor_below(floor: float | None, cut: float) -> float:
    """The abnormal probability from which a unit is abnormal: ``floor``, or the cut when None; a
    floor above the cut (or not a probability) is an error."""
    if floor is None:
        return cut
    if not 0.0 < floor <= cut:
        raise ValueError(f"abnormal_floor {floor}: expected a probability in (0, {cut}]")
    return floor


def unit_in_views(prep: Prepared, idx: np.ndarray, views: Sequence[str]) -> np.ndarray:
    """Per unit ``idx`` of ``prep``: 1.0 where its view is one of ``views`` (a unit of unknown view
    counts as vertical, one rank's step), else 0.0."""
    known = list(prep.inputs.view) if prep.inputs.view else []
    got = [str(known[i]) if i < len(known) and known[i] else "vertical" for i in np.asarray(idx, np.int64).tolist()]
    return np.asarray([v in views for v in got], np.float64)


def load(path: str | Path, device: str = "cpu") -> RCA:
    """A saved model (``teller rca train -o PATH``)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise TellerError("--device cuda: no CUDA device here; use --device cpu")
    return RCA.load(path, device)
