# Record dataset v2 (campaigns/h200_v2.toml) on the H200 in one device call and reduce it there:
#   bash scripts/gpu/v2_campaign.sh RECORD_S [MAX_NORMAL]
# Runs in eight lanes of two cores (scripts/gpu/campaign.py --lanes 8, co-located hogs in the lanes);
# no run starts after RECORD_S seconds. Then `teller dataset build` writes data/h200_v2 there, and
# $OUT gets: h200_v2.tar.NN (15 MiB parts), examples_v2.tar (the ex-* raw runs), runs_meta.tar
# (labels, steps, iterations, requests, step labels of every run), the campaign log, env.txt (netns probe, GPU clocks).
set -o pipefail
rec_s=${1:?usage: v2_campaign.sh RECORD_S [MAX_NORMAL]}
W=/tmp/v2
mkdir -p $W
source scripts/gpu/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
t0=$(date +%s)
{ ip netns add teller-probe && ip netns exec teller-probe ip link set lo up && echo "netns: ok"; ip netns del teller-probe; } > $OUT/env.txt 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >> $OUT/env.txt 2>&1
python3 scripts/gpu/campaign.py campaigns/h200_v2.toml $W/runs $W/out --lanes 8 --co-located-in-lanes \
  --until $(( t0 + rec_s )) --no-pack --keep-raw ex-loop-stall ex-normal > $OUT/campaign.log 2>&1
echo "recorded after $(( $(date +%s) - t0 )) s: $(ls -d $W/runs/*-r0 | wc -l) runs"
grep -h '"run_id"' $OUT/campaign.log | cut -c1-160 | tail -70
tar cf $OUT/examples_v2.tar -C $W/out/reduced ex-loop-stall-r0 ex-normal-r0 2>/dev/null
(cd $W/runs && tar cf $OUT/runs_meta.tar $(ls -d *-r0 | while read r; do for f in labels.json steps.parquet iterations.parquet requests.parquet step_labels.parquet reconstruct.json run.json; do [ -e $r/$f ] && echo $r/$f; done; done))
rm -rf data/h200_v2
timeout 150 python3 -m teller dataset build $(ls -d $W/runs/*-r0 | grep -v '/ex-') -o data/h200_v2 --max-normal ${2:-200} 2>&1 | tail -12
du -sh data/h200_v2
(cd data && tar cf - h200_v2 | split -b 15m -d - $OUT/h200_v2.tar.)
ls -la $OUT; echo "done after $(( $(date +%s) - t0 )) s"
