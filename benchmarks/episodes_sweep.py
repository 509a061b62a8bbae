"""The episode length of ``teller_episodes`` swept: the row with ``min_episode`` 3, 5 (the row's
own), 10 and 20 beside the model, the deployment stage and its screen, on every split and view.

    python benchmarks/episodes_sweep.py DATASET OUT [--reuse PREDICTIONS.parquet ...]

``--reuse``: a ``predictions.parquet`` of an earlier `teller evaluate` holding ``teller_mot`` (the
model's answers; the model itself is not needed then) and, if wanted, ``teller_numeric_deploy``
and ``teller_screened_deploy``. Writes OUT/results.json and results.md (docs/results.md,
"Episodes").
"""

from __future__ import annotations

import argparse

from teller.baselines import REGISTRY, register
from teller.baselines.rca import TellerEpisodes
from teller.evaluate.run import evaluate

LENGTHS = (3, 10, 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("out")
    ap.add_argument("--reuse", action="append", default=[])
    ap.add_argument("--split", default="request,run,mechanism,workload")
    ap.add_argument("--view", default="vertical,horizontal")
    a = ap.parse_args()
    for k in LENGTHS:
        name = f"teller_episodes_{k}"
        if name not in REGISTRY:
            register(name)(type(f"TellerEpisodes{k}", (TellerEpisodes,), {"min_episode": k,
                                                                          "label": f"{TellerEpisodes.label}, episodes of {k}+"}))
    methods = ["teller_mot", "teller_numeric_deploy", "teller_screened_deploy", "teller_episodes",
               *(f"teller_episodes_{k}" for k in LENGTHS)]
    evaluate(a.dataset, a.split.split(","), a.view.split(","), methods, seed=0, out=a.out, reuse=a.reuse or None,
             command="python benchmarks/episodes_sweep.py " + " ".join([a.dataset, a.out, *(f"--reuse {r}" for r in a.reuse)]),
             log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
