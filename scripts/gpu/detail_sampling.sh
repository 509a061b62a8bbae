#!/bin/bash
# Step sampling on the GPU (issue 16 §2) in one device call: what a sampled recording keeps per
# step (a short recording with windows of 4 detailed steps every 32), then rounds of the long
# overhead matrix for the remaining time (scripts/gpu/overhead_long.sh: its state in runs/, so a
# second call on a warm machine continues it).
#   bash scripts/gpu/detail_sampling.sh [BUDGET_S] [CONFIGS] [REQUESTS] [CHECK] [CORES] [PACE]
# CORES: pin every run to that many whole physical cores near the GPU (overhead.py --serial-cores; 0: not)
# PACE=K,W[,quiet]: first record REQUESTS requests queued at start with --detail-every K --detail-window W and
# measure a detailed step's cost inside that one run (benchmarks/detail_sampling.py --pace ->
# $OUT/pace.json); ",quiet" makes the other steps record nothing inside their STEP range
# (TELLER_DETAIL_QUIET=1), so the pairs measure detail against almost no recording; ",alternate"
# makes every other block of W light steps quiet, so light blocks pair with quiet ones; a fourth
# field "marks" records the pauses (TELLER_MARK_PAUSES=1), a fifth the CUPTI decoding
# (--cupti-decode, default inline); PACE_TAG names the outputs ($OUT/$PACE_TAG.json, default pace);
# PACE_OUTPUT_LEN the requests' output lengths (default 32), PACE_SEED the workload's seed (default 0);
# CONFIGS "-" skips the matrix
# Results: $OUT/detail_check.json, $OUT/record_k32.log and what overhead_long.sh writes.
T0=$(date +%s)
BUDGET=${1:-560}
CONFIGS=${2:-none,cupti,cupti_nodetail}
REQUESTS=${3:-6000}
CHECK=${4:-1}
CORES=${5:-0}
source scripts/gpu/setup.sh
if [ "$CHECK" = "1" ]; then
  W="--device cuda --preset gpu --rate 0 --prompt-len uniform:32:128 --output-len 32 --seed 0 --requests 800"
  python3 -m teller.cli record -o /tmp/detail_k32 --force --collector cupti --detail-every 32 --detail-window 4 -- \
    python3 -m teller.workload serve $W > "$OUT/record_k32.log" 2>&1
  python3 -m teller.cli reconstruct /tmp/detail_k32 >> "$OUT/record_k32.log" 2>&1
  python3 benchmarks/detail_sampling.py /tmp/detail_k32 --json "$OUT/detail_check.json" > /dev/null 2>"$OUT/detail_check.err"
  tail -n 2 "$OUT/record_k32.log"
  echo "check done after $(( $(date +%s) - T0 )) s"
fi
PACE=${6:-}
if [ -n "$PACE" ]; then
  IFS=, read -r K WIN QUIET MARKS DECODE <<< "$PACE"
  [ "$QUIET" = "quiet" ] && export TELLER_DETAIL_QUIET=1
  [ "$QUIET" = "alternate" ] && export TELLER_DETAIL_QUIET=alternate
  [ "$MARKS" = "marks" ] && export TELLER_MARK_PAUSES=1
  TAG=${PACE_TAG:-pace}
  python3 -m teller.cli record -o /tmp/pace_run --force --collector cupti --detail-every "$K" --detail-window "$WIN" \
    --cupti-decode "${DECODE:-inline}" -- \
    python3 -m teller.workload serve --device cuda --preset gpu --rate 0 --prompt-len uniform:32:128 \
    --output-len "${PACE_OUTPUT_LEN:-32}" --seed "${PACE_SEED:-0}" --requests "$REQUESTS" > "$OUT/${TAG}_record.log" 2>&1
  python3 -m teller.cli reconstruct /tmp/pace_run >> "$OUT/${TAG}_record.log" 2>&1
  cp /tmp/pace_run/run.json "$OUT/${TAG}_run.json"
  python3 benchmarks/detail_sampling.py /tmp/pace_run --pace --json "$OUT/$TAG.json" \
    --iterations-out "$OUT/${TAG}_iterations.parquet" > /dev/null 2>"$OUT/$TAG.err"
  python3 -c "import json; p=json.load(open('$OUT/$TAG.json'))[0]['pace']; print({k: v for k, v in p.items() if not k.endswith('_ratios') and k != 'pauses'})"
  unset TELLER_MARK_PAUSES
  echo "pace done after $(( $(date +%s) - T0 )) s"
  unset TELLER_DETAIL_QUIET
fi
[ "$CONFIGS" = "-" ] && exit 0
OVL_EXTRA="--requests $REQUESTS --probe-requests 300 --serial-cores $CORES" \
  bash scripts/gpu/overhead_long.sh $(( BUDGET - ($(date +%s) - T0) )) "$CONFIGS" 10 auto
