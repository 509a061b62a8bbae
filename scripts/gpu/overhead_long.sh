#!/bin/bash
# The long overhead matrix on the GPU (issue 16 §2) in one device call. Run it again on the same
# warm machine and it continues with the next round (state in $STATE, kept between calls).
#   bash scripts/gpu/overhead_long.sh [BUDGET_S] [CONFIGS] [ROUNDS] [GPUS]
# BUDGET_S: seconds from the start of this script by which every run has ended (default 525);
# GPUS: auto (runs at once, one per GPU: whole rounds with a GPU per configuration, else waves),
# none, or a list such as 0,1,2,3,4; OVL_EXTRA: more arguments for overhead.py (e.g.
# "--requests 6000 --probe-requests 300"). Results: $OUT/ovl/{overhead_long.md,overhead_long.json,
# runs.jsonl,workload.json}, $OUT/matrix.log, $OUT/env_call.txt.
T0=$(date +%s)
BUDGET=${1:-525}
CONFIGS=${2:-none,hooks,cupti,cupti_deferred,cupti_lean}
ROUNDS=${3:-10}
GPUS=${4:-auto}
# in the checkout's ignored runs/ folder, which a warm device machine keeps between calls
STATE=${TELLER_OVL_STATE:-runs/overhead_long/state}
source scripts/gpu/setup.sh
mkdir -p "$STATE"
# a fresh machine for the second call: the first call's files, if carried in the checkout
if [ ! -f "$STATE/runs.jsonl" ] && [ -f overhead_long_prev/runs.jsonl ]; then
  cp overhead_long_prev/runs.jsonl overhead_long_prev/workload.json "$STATE/"
fi
{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw,pci.bus_id --format=csv
  nvidia-smi topo -m
  echo "nproc $(nproc)"; lscpu | head -24
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "setup done after $(( $(date +%s) - T0 )) s"
} > "$OUT/env_call.txt" 2>&1
python3 benchmarks/overhead.py --long --out "$OUT/ovl" --state "$STATE" --work /tmp/teller_overhead_long/work \
  --configs "$CONFIGS" --rounds "$ROUNDS" --gpus "$GPUS" --deadline $(( T0 + BUDGET )) $OVL_EXTRA > "$OUT/matrix.log" 2>&1
grep -v '^{' "$OUT/matrix.log" | tail -n 14
echo "done after $(( $(date +%s) - T0 )) s"
