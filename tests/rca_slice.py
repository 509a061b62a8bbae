"""The slice of data/h200_v2 the root-cause model tests read: a run with a delayed operator and a
tensor-parallel run with a straggler rank (horizontal units)."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "h200_v2"
RUNS = ["targeted-op-delay-b-r0", "straggler-rank-b-r0"]


def need_rca():
    """torch (returned) and the packages the models need, or skip the module."""
    torch = pytest.importorskip("torch")
    for name in ("transformers", "tokenizers", "safetensors"):
        pytest.importorskip(name)
    return torch


def small_dataset(dest: Path, steps_below: int, iterations: bool = False, run: str | None = None) -> Path:
    """A dataset folder of the first run's (or ``run``'s) steps numbered below ``steps_below``: its
    records and subtrees (with ``iterations``, also each kept step's iteration rows beside its STEP
    subtree)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from teller.dataset.codec import write_subtree_parts
    from teller.forest import with_iterations
    from teller.rca.data import read_steps

    dest.mkdir(parents=True, exist_ok=True)
    run = run or RUNS[0]
    rec = pq.read_table(DATA / "records.parquet", filters=[("run_id", "in", [run])])
    rec = rec.filter(pc.less(rec.column("step_num"), steps_below))
    pq.write_table(rec, dest / "records.parquet")
    sub = read_steps(DATA, [run])
    sid = sub.column("step_id").to_numpy()
    keep = np.isin(sid, np.unique(rec.column("step_id").to_numpy()))
    if iterations:
        keep = with_iterations(keep, sid == sub.column("node_id").to_numpy(), sid, sub.column("step_idx").to_numpy())
    write_subtree_parts(sub.filter(pa.array(keep)), dest / "subtrees")
    return dest


def check_schema(pred: list, inp, max_chars: int) -> None:
    """Every prediction within the schema: a valid type, the abnormal flag its type, evidence
    nodes among the nodes its tokens name and families among theirs, nothing for a normal
    step, and a bounded sentence for an abnormal one."""
    from teller.rca.data import FAULT_TYPES

    for k, p in enumerate(pred):
        assert p["fault_type"] in FAULT_TYPES[1:] or p["fault_type"] == ""
        assert p["abnormal"] == bool(p["fault_type"]) and 0.0 <= p["abnormal_prob"] <= 1.0
        s = inp.tokens(k)
        covered = {n for t in range(s.stop - s.start) for n in inp.covered(k, t)}
        assert set(inp.anchor[s].tolist()) <= covered
        assert set(p["evidence_nodes"]) <= covered  # a token's anchor and the nodes of its layer it covers
        assert set(p["evidence_operators"]) <= {inp.families[int(inp.node_family[inp.node_offsets[k] + n])] for n in covered}
        assert set(p["evidence_operators"]) <= set(inp.candidates(k))
        if not p["abnormal"]:
            assert p["evidence_nodes"] == [] and p["explanation"] == ""
        else:
            assert p["explanation"].endswith((".", "!", "?")) and len(p["explanation"]) <= max_chars


def iteration_units(max_units: int = 90, seed: int = 1):
    """The slice's runs as engine-iteration units, a sample of ``max_units`` (the module-scoped
    ``ds`` fixtures of the model tests); skips where data/h200_v2 is not in the checkout."""
    torch = need_rca()
    torch.set_num_threads(1)
    if not (DATA / "records.parquet").is_file():
        pytest.skip("data/h200_v2 is not in this checkout")
    from teller.rca.data import load_dataset

    return load_dataset(DATA, runs=RUNS, max_units=max_units, seed=seed, unit="iteration")


def saved_and_broken(ref, folder: Path, edit):
    """``ref`` (a :class:`teller.rca.data.ReferenceStats`) saved in ``folder`` and loaded back,
    and the path of a copy whose JSON ``edit`` (a function changing the dict in place) broke."""
    import json

    from teller.rca.data import ReferenceStats

    ref.save(folder / "reference.json")
    d = json.loads((folder / "reference.json").read_text())
    edit(d)
    (folder / "bad.json").write_text(json.dumps(d))
    return ReferenceStats.load(folder / "reference.json"), folder / "bad.json"


def refused_without(model_dir: Path, name: str, tmp_path: Path) -> None:
    """A copy of the model directory ``model_dir`` without its file ``name`` (an expert whose
    weight config.json still gives) is refused at load, naming the missing file."""
    import shutil

    from teller.errors import InputError
    from teller.rca import load

    broken = tmp_path / f"without_{name}"
    shutil.copytree(model_dir, broken)
    (broken / name).unlink()
    with pytest.raises(InputError, match=f"{name}.*missing"):
        load(broken)


def tiny_family_model(ds, out: Path) -> Path:
    """A tiny family-head iteration MoT reading the unit statistics, trained a few steps on
    ``ds``'s request split into ``out`` (with its abnormal cut, threshold and experts)."""
    from teller.rca.train import train

    train(ds, out, variant="mot", split="request", config="tiny", epochs=1, max_steps=4, seed=0, progress=False,
          log=lambda m: None, unit="iteration", op_unit="family", fam_span=True, unit_stats=True)
    return out


def prepared_units(ds, m, n: int = 40):
    """The first ``n`` units of ``ds`` as model ``m`` reads them (encoded and prepared)."""
    import numpy as np

    from teller.rca.data import encode_units

    u = ds.units
    idx = np.arange(min(n, len(u)))
    inp = encode_units(ds.forest, m.trace_tok, u.run_id[idx].tolist(), [u.step_ids[i] for i in idx.tolist()],
                       [u.log_text[i] for i in idx.tolist()], m.cfg.max_trace_tokens, u.view[idx].tolist())
    return m.prepare(inp)


def broken_expert_files(cls, folder: Path, name: str) -> None:
    """An expert class's ``load`` refuses a file XGBoost cannot read (naming it) and a folder
    without the file ("missing")."""
    from teller.errors import InputError

    (folder / name).write_bytes(b"not a model")
    with pytest.raises(InputError, match=name):
        cls.load(folder)
    with pytest.raises(InputError, match="missing"):
        cls.load(folder / "nowhere")
