#!/bin/bash
# One device call: the profiler BE backend on the GPU — a Kineto example recording and the
# overhead matrix (results under $OUT).
#   bash scripts/gpu/be_backend_measure.sh [REPS] [CONFIGS] [MATRIX_TIMEOUT_S]
source scripts/gpu/setup.sh
REPS=${1:-3}
CONFIGS=${2:-none,hooks_profiler,cupti_profiler,cupti_nobe,kineto,cupti_dispatch}
MATRIX_TIMEOUT=${3:-400}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
  python3 -c "
import json, torch, transformers
from torch._C._profiler import _ExperimentalConfig
doc = _ExperimentalConfig.__init__.__doc__ or ''
print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__,
                  'profile_all_threads': 'profile_all_threads' in doc, 'trace_only': 'trace_only' in doc,
                  'record_function_fast': hasattr(torch._C._profiler, '_RecordFunctionFast')}))"
} 2>&1 | tee $OUT/env.txt
# 1. the Kineto example: the workload recorded with --collector kineto (24 requests)
W="python3 -m teller.workload serve --device cuda --preset gpu --requests 24 --rate 100 --prompt-len uniform:16:64 --output-len 12 --seed 0 --warmup 1"
rm -rf /tmp/ex_kineto
timeout 80 python3 scripts/gpu/record.py /tmp/ex_kineto kineto -- $W > $OUT/ex_kineto.log 2>&1
tail -3 $OUT/ex_kineto.log
du -sh /tmp/ex_kineto; tar czf $OUT/ex_kineto.tgz -C /tmp ex_kineto
echo "example done after $(( $(date +%s) - T0 )) s"
# 2. the overhead matrix (same workload as the earlier measurement)
timeout $MATRIX_TIMEOUT python3 benchmarks/overhead.py --out $OUT/ov --work /tmp/ovwork --reps $REPS \
  --configs $CONFIGS > $OUT/matrix.log 2>&1
grep -v "^{" $OUT/matrix.log | tail -12
echo "all done after $(( $(date +%s) - T0 )) s"
