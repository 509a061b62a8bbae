#!/bin/bash
# Step sampling on the GPU (issue 16 §2) in one device call: what a sampled recording keeps per
# step (a short recording with windows of 4 detailed steps every 32), then rounds of the long
# overhead matrix for the remaining time (state in $STATE: a second call on a warm machine, or
# one given the first call's runs.jsonl in overhead_long_prev/, continues it).
#   bash scripts/gpu/detail_sampling.sh [BUDGET_S] [CONFIGS] [REQUESTS] [CHECK]
# Results: $OUT/detail_check.json, $OUT/ovl/{overhead_long.md,overhead_long.json,runs.jsonl},
# $OUT/matrix.log, $OUT/env_call.txt.
T0=$(date +%s)
BUDGET=${1:-560}
CONFIGS=${2:-none,cupti,cupti_nodetail}
REQUESTS=${3:-6000}
CHECK=${4:-1}
STATE=${TELLER_OVL_STATE:-runs/overhead_long/state}
source scripts/gpu/setup.sh
mkdir -p "$STATE"
if [ ! -f "$STATE/runs.jsonl" ] && [ -f overhead_long_prev/runs.jsonl ]; then
  cp overhead_long_prev/runs.jsonl overhead_long_prev/workload.json "$STATE/"
fi
{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
  echo "nproc $(nproc)"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "setup done after $(( $(date +%s) - T0 )) s"
} > "$OUT/env_call.txt" 2>&1
if [ "$CHECK" = "1" ]; then
  W="--device cuda --preset gpu --rate 0 --prompt-len uniform:32:128 --output-len 32 --seed 0 --requests 800"
  python3 -m teller.cli record -o /tmp/detail_k32 --force --collector cupti --detail-every 32 --detail-window 4 -- \
    python3 -m teller.workload serve $W > "$OUT/record_k32.log" 2>&1
  python3 -m teller.cli reconstruct /tmp/detail_k32 >> "$OUT/record_k32.log" 2>&1
  python3 benchmarks/detail_sampling.py /tmp/detail_k32 --json "$OUT/detail_check.json" > /dev/null 2>"$OUT/detail_check.err"
  tail -n 2 "$OUT"/record_k*.log
  echo "check done after $(( $(date +%s) - T0 )) s"
fi
python3 benchmarks/overhead.py --long --out "$OUT/ovl" --state "$STATE" --work /tmp/teller_overhead_long/work \
  --configs "$CONFIGS" --requests "$REQUESTS" --probe-requests 300 --deadline $(( T0 + BUDGET )) > "$OUT/matrix.log" 2>&1
cp "$STATE/runs.jsonl" "$OUT/ovl/runs_state.jsonl" 2>/dev/null
grep -v '^{' "$OUT/matrix.log" | tail -n 14
echo "done after $(( $(date +%s) - T0 )) s"
