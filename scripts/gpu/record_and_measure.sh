#!/bin/bash
# One device call: check the collectors, record the bundled example, run the overhead matrix.
#   bash scripts/gpu/record_and_measure.sh [REPS]      (results under $OUT)
source scripts/gpu/setup.sh
REPS=${1:-3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
# 1. raw vs object decoding on a deterministic probe program
PROBE_MODES=cupti,cupti_objects python3 scripts/gpu/probe_collectors.py /tmp/probe 2>&1 | grep -v Warning | tail -c 2500
cp /tmp/probe/probe_cupti.json $OUT/ 2>/dev/null
# 2. the bundled example: the workload recorded with CUPTI, and with Kineto for comparison
W="python3 -m teller.workload serve --device cuda --preset gpu --requests 24 --rate 100 --prompt-len uniform:16:64 --output-len 12 --seed 0 --warmup 1"
for c in cupti kineto; do
  rm -rf /tmp/ex_$c
  timeout 150 teller record -o /tmp/ex_$c --collector $c -- $W 2>&1 | tail -3
  du -sh /tmp/ex_$c; tar czf $OUT/ex_$c.tgz -C /tmp ex_$c
done
# 3. overhead matrix
timeout 420 python3 benchmarks/overhead.py --out $OUT/overhead --work /tmp/ovwork --reps $REPS \
  --configs none,hooks,cupti,kineto,cupti_nodecode,hooks_nobe,cupti_nofilter 2>&1 | grep -v "^{" | tail -15
