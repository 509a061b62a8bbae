#!/bin/bash
# Call B of scripts/gpu/union_stash.sh for the nested mechanism hold-out: the union of dataset v2's
# parts merged as union_matrix.sh merges it, its nested datasets written (`teller dataset nest
# --fold K`: the mechanism split's training part with one more mechanism per category held out) and
# one root-cause model trained on each, side by side on the one GPU.
#   FOLDS="0 1" SEED=0 PARTS="h200_v2 h200_v2_tp h200_v2_link" UNION=h200_v2_all \
#     bash scripts/gpu/nested_matrix.sh DEADLINE_S RECIPE
# RECIPE: VARIANT:SPLIT[:KEY=VALUE,...] as rca_matrix.py's --job without its name (the split:
# mechanism). Each fold K comes back in $OUT/nestK/: matrix.json (the training and its test
# scoring on the fold's held-out mechanisms), rca_nK.tar (the model; rca_nK.tar.gz where the tar is over 16 MiB), log.txt.
T0=$(date +%s)
DEADLINE=${1:-540}
RECIPE=${2:?give the recipe, e.g. mot:mechanism:unit=iteration,op_unit=family}
FOLDS=${FOLDS:-0 1}
source scripts/gpu/setup.sh >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
source scripts/gpu/union_merge.sh || exit $?
n=$(echo $FOLDS | wc -w)
for k in $FOLDS; do
  python3 -m teller.cli dataset nest runs/$UNION -o runs/${UNION}_nest$k --fold $k --force > "$OUT/nest$k.log" 2>&1 || { tail -5 "$OUT/nest$k.log"; exit 4; }
  mkdir -p "$OUT/nest$k"
  python3 scripts/gpu/rca_matrix.py --data runs/${UNION}_nest$k --out "$OUT/nest$k" --workers 1 --threads $(( 16 / n )) \
    --epochs 8 --batch-size 128 --seed ${SEED:-0} --eval-reserve-s 30 --work /tmp/nest_$k \
    --deadline-s $(( DEADLINE - ($(date +%s) - T0) )) --keep n$k --job "n$k=$RECIPE" > "$OUT/nest$k/log.txt" 2>&1 &
done
wait
for k in $FOLDS; do echo "== fold $k"; tail -4 "$OUT/nest$k/log.txt"; done
echo "done after $(( $(date +%s) - T0 )) s"
