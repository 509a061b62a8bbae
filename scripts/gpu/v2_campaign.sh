# Record one part of dataset v2 (campaigns/h200_v2.toml) on the H200 in one device call and reduce it there:
#   bash scripts/gpu/v2_campaign.sh 1|2|3|4 [MAX_NORMAL]
# then, here: teller dataset merge h200_v2_p1 h200_v2_p2 -o data/h200_v2 (docs/results.md); part 3
# (campaigns/h200_v2_tp.toml, tensor-parallel runs) is built alone as data/h200_v2_tp, and
# `teller dataset merge data/h200_v2 data/h200_v2_tp -o V2_WHOLE` joins it (data/h200_v2_tp/README.md).
# Part 1: the two ex-* runs (one at a time), then 26 runs in eight lanes of two cores
# (scripts/gpu/campaign.py --lanes 8; CPU hogs pinned to their lane's cores). Part 2: the
# GPU-compute hogs alone (three lanes at once, windows at the same times), then the GPU
# memory-bandwidth hogs alone, then 19 runs in the lanes: a GPU hog shares the one GPU with every
# lane, so no run of another category is recorded beside it. Part 3: the 14 tensor-parallel runs of
# campaigns/h200_v2_tp.toml in the eight lanes (CPU hogs pinned to their lane's cores). Part 4: the
# link faults of campaigns/h200_v2_link.toml (each run in its own network namespace) and two
# fault-free runs of their workload (`... 4 1200` keeps every step; `teller dataset resample
# --max-normal 150` then gives data/h200_v2_link, README there). Each phase has a time after which no run starts,
# and is killed 120 s after it. Fault runs with too few fault-free steps of their own (KV
# pressure) are relabelled against the fault-free run of their workload recorded in the same part.
# $OUT gets: h200_v2_pN.tar.NN (15 MiB parts of the part's dataset), runs_meta_pN.tar (labels,
# steps, iterations, requests, step labels of every run), examples_v2.tar (part 1: the ex-* raw
# runs), the campaign log, env.txt (GPU clocks).
set -o pipefail
part=${1:?usage: v2_campaign.sh 1|2|3|4 [MAX_NORMAL]}
spec=campaigns/h200_v2.toml
[ "$part" = 3 ] && spec=campaigns/h200_v2_tp.toml
[ "$part" = 4 ] && spec=campaigns/h200_v2_link.toml
W=/tmp/v2
mkdir -p $W
source scripts/gpu/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/env.txt 2>&1
nproc >> $OUT/env.txt
phase() {  # phase NO_START_AFTER_S NAME...
  local until=$(( t0 + $1 )); shift
  local left=$(( until - $(date +%s) ))
  [ $left -gt 0 ] || { echo "phase not started (time): $*"; return; }
  timeout --kill-after=20 $(( left + 120 )) python3 scripts/gpu/campaign.py $spec $W/runs $W/out \
    --lanes 8 --co-located-in-lanes --until $until --no-pack --keep-raw ex-loop-stall ex-normal --only "$@"
  echo "phase rc $? after $(( $(date +%s) - t0 )) s: $*"
}
if [ "$part" = 1 ]; then
  phase 290 ex-loop-stall ex-normal normal-a normal-b normal-c normal-tp-a straggler-rank-a straggler-rank-c \
    throttled-collective-a throttled-collective-b netem-a targeted-op-delay-a targeted-op-delay-c \
    host-cpu-contention-a host-cpu-contention-b host-cpu-contention-c kv-cache-pressure-a kv-cache-pressure-b kv-cache-pressure-c \
    allocator-churn-a allocator-churn-b hidden-host-sync-a hidden-host-sync-c pageable-copies-a pageable-copies-b \
    gil-contention-a delayed-admission-a scheduler-stall-a > $OUT/campaign.log 2>&1
elif [ "$part" = 4 ]; then
  phase 200 normal-tp-e normal-tp-f link-throttle-a link-throttle-b link-throttle-c netem-b > $OUT/campaign.log 2>&1
elif [ "$part" = 3 ]; then
  phase 240 normal-tp-b normal-tp-d tp-op-delay-a tp-op-delay-b tp-op-delay-c tp-cpu-contention-a \
    tp-cpu-contention-b tp-cpu-contention-c tp-pageable-copies-a tp-hidden-host-sync-b tp-allocator-churn-c \
    tp-gil-contention-a tp-gil-contention-b tp-gil-contention-c > $OUT/campaign.log 2>&1
else
  phase 10 gpu-compute-contention-a gpu-compute-contention-b gpu-compute-contention-c > $OUT/campaign.log 2>&1
  phase 130 gpu-membw-hog-a gpu-membw-hog-b gpu-membw-hog-c >> $OUT/campaign.log 2>&1
  phase 310 normal-d normal-tp-c straggler-rank-b throttled-collective-c targeted-op-delay-b allocator-churn-c \
    hidden-host-sync-b pageable-copies-c gil-contention-b gil-contention-c delayed-admission-b delayed-admission-c \
    scheduler-stall-b scheduler-stall-c loop-stall-a loop-stall-b loop-stall-c mixed-a mixed-c >> $OUT/campaign.log 2>&1
fi
echo "recorded after $(( $(date +%s) - t0 )) s: $(ls -d $W/runs/*-r0 | wc -l) runs"
grep -h '"run_id"\|relabelled\|phase' $OUT/campaign.log | cut -c1-170
[ "$part" = 1 ] && tar cf $OUT/examples_v2.tar -C $W/out/reduced ex-loop-stall-r0 ex-normal-r0 2>/dev/null
(cd $W/runs && tar cf $OUT/runs_meta_p$part.tar $(ls -d *-r0 | grep -v '^ex-' | while read r; do for f in labels.json steps.parquet iterations.parquet requests.parquet step_labels.parquet reconstruct.json run.json; do [ -e $r/$f ] && echo $r/$f; done; done))
ds=h200_v2_p$part
[ "$part" = 3 ] && ds=h200_v2_tp
rm -rf data/$ds
timeout 150 python3 -m teller dataset build $(ls -d $W/runs/*-r0 | grep -v '/ex-') -o data/$ds --max-normal ${2:-150} 2>&1 | tail -12
du -sh data/$ds
(cd data && tar cf - $ds | split -b 15m -d - $OUT/$ds.tar.)
ls -la $OUT; echo "done after $(( $(date +%s) - t0 )) s"
