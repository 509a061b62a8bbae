# Record campaigns/h200_types.toml on the H200 in one device call and score the fault type
# `teller diagnose` reads from the numeric evidence on it (benchmarks/evidence_types.py):
#   bash scripts/gpu/types_campaign.sh
# The fault-free references and every fault acting inside or beside the engine on the CPU are
# recorded in eight lanes of two cores; the two co-located GPU hogs after them, one at a time
# (a GPU hog shares the one GPU with every lane). $OUT gets evidence_types.json, the campaign log
# and labels.tar (every run's labels.json and step_labels.parquet).
set -o pipefail
W=/tmp/types
mkdir -p $W
source scripts/gpu/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
t0=$(date +%s)
spec=campaigns/h200_types.toml
phase() {  # phase NO_START_AFTER_S LANES NAME...
  local until=$(( t0 + $1 )) lanes=$2; shift 2
  timeout --kill-after=20 $(( until - $(date +%s) + 120 )) python3 scripts/gpu/campaign.py $spec $W/runs $W/out \
    --lanes $lanes --co-located-in-lanes --until $until --no-pack --only "$@"
  echo "phase rc $? after $(( $(date +%s) - t0 )) s: $*"
}
phase 150 8 normal-a normal-b normal-tp-a normal-tp-b targeted-op-delay host-cpu-contention allocator-churn \
  hidden-host-sync pageable-copies gil-contention delayed-admission scheduler-stall loop-stall straggler-rank \
  throttled-collective > $OUT/campaign.log 2>&1
phase 300 1 gpu-compute-contention gpu-membw-hog >> $OUT/campaign.log 2>&1
echo "recorded after $(( $(date +%s) - t0 )) s: $(ls -d $W/runs/*-r0 | wc -l) runs"
python3 benchmarks/evidence_types.py $W/runs -o $OUT/evidence_types.json --jobs 8 2>&1 | tee $OUT/evidence_types.log
(cd $W/runs && tar cf $OUT/labels.tar */labels.json */step_labels.parquet)
echo "done after $(( $(date +%s) - t0 )) s"
grep -h '"run_id"\|phase' $OUT/campaign.log | cut -c1-170
