#!/bin/bash
# Call B of scripts/gpu/union_stash.sh: the union of dataset v2's parts (one from runs/stash/, the
# other in the tree) merged, then root-cause models trained and scored on it by rca_matrix.py.
#   bash scripts/gpu/union_matrix.sh [DEADLINE_S] [JOB...]
# JOBs as rca_matrix.py's --job (default: the iteration MoT of the four splits); results in $OUT,
# predictions.parquet among them: the model rows' per-step answers, which the other rows join on
# a CPU without the models, e.g. for the pipeline row:
#   teller evaluate runs/h200_v2_whole --split request,run,mechanism,workload --view vertical,horizontal \
#     --methods teller_mot,teller_numeric,teller --reuse OUT/predictions.parquet -o RESULTS
T0=$(date +%s)
DEADLINE=${1:-540}
shift || true
JOBS=("$@")
[ ${#JOBS[@]} -eq 0 ] && JOBS=(it_request=mot:request:unit=iteration it_run=mot:run:unit=iteration
                               it_mechanism=mot:mechanism:unit=iteration it_workload=mot:workload:unit=iteration)
source scripts/gpu/setup.sh >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# METHODS / EVAL_SPLITS: the model rows and splits `teller evaluate` scores after training (default
# teller_mot on the four splits), e.g. METHODS=teller_mot_trace,teller_single EVAL_SPLITS=run
# KEEP: jobs whose models come back as rca_NAME.tar (13-16 MiB), or rca_NAME.tar.gz where the tar is over
# the 16 MiB a returned file may have (a model with its experts: about 18 MB, 14.6 MB compressed); at most 8 files come back
# EVAL_RESERVE: seconds kept for `teller evaluate` after the trainings (default 200; two splits need about 120)
# EVAL_JOBS: the jobs `teller evaluate` reads (default all; one per split and head)
# SEED: the seed of the training and of the evaluation (default 0; the splits are the dataset's own)
# EPOCHS: the epochs of every training (default 8, the recipe's)
# WORK: the folder the models are trained in (default /tmp/rca_matrix_$UNION); under runs/ (e.g.
# WORK=runs/rca_work) they stay on the warm machine for the next call: scripts/gpu/matrix_after.py
# then fits their experts (where xgboost was not carried) and scores them once per seed
source scripts/gpu/union_merge.sh || exit $?
args=()
for j in "${JOBS[@]}"; do args+=(--job "$j"); done
EV=${EVAL_SPLITS:-request,run,mechanism,workload}
[ "$EV" = none ] && EV=""  # EVAL_SPLITS=none: no `teller evaluate` after the trainings (KEEP the models)
set -o pipefail
python3 scripts/gpu/rca_matrix.py --data runs/$UNION --out "$OUT" --workers ${#JOBS[@]} --threads $(( 16 / ${#JOBS[@]} )) \
  --epochs ${EPOCHS:-8} --batch-size 128 --seed ${SEED:-0} --eval-reserve-s 30 --work ${WORK:-/tmp/rca_matrix_$UNION} \
  --deadline-s $(( DEADLINE - ($(date +%s) - T0) )) --evaluate "$EV" --evaluate-reserve-s ${EVAL_RESERVE:-200} \
  --methods "${METHODS:-teller_mot}" --evaluate-jobs "${EVAL_JOBS:-}" --keep "${KEEP:-}" "${args[@]}" 2>&1 | tee "$OUT/log.txt" | tail -20
