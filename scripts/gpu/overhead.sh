#!/bin/bash
# One device call: the overhead matrix of benchmarks/overhead.py (results under $OUT/overhead).
#   bash scripts/gpu/overhead.sh [REPS] [CONFIGS]
source scripts/gpu/setup.sh
REPS=${1:-3}
CONFIGS=${2:-none,hooks,cupti,kineto,cupti_nodecode,hooks_nobe,cupti_nobe,cupti_nvtx}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
timeout 520 python3 benchmarks/overhead.py --out $OUT/overhead --work /tmp/ovwork --reps $REPS \
  --configs $CONFIGS 2>&1 | grep -v "^{" | tail -14
