# Train and evaluate one RCA variant on the H200 (one device call of under 10 minutes):
#   bash scripts/gpu/train_rca.sh mot      then      bash scripts/gpu/train_rca.sh single
# Needs nothing beyond the GPU image (torch, transformers, tokenizers, safetensors, pyarrow,
# scikit-learn are there) and data/h200_v2 in the tree. Results: $OUT/metrics_VARIANT.json,
# $OUT/rca_VARIANT.tar (the request split's model), $OUT/train_VARIANT.log.
set -o pipefail
variant=${1:?usage: train_rca.sh mot|single [deadline seconds]}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 scripts/gpu/train_rca.py --variant "$variant" --out "${OUT:-out}" --device cuda --deadline-s "${2:-480}" \
  2>&1 | tee "${OUT:-out}/train_$variant.log"
