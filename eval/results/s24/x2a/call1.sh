#!/usr/bin/env bash
# session 24, call 1 (2 x H200): the balanced draft head on the TP=8 rank (GPU 0) beside the unverified GPU tests (GPU 1),
# then the NCCL test files on both GPUs
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
t0=$(date +%s)
(CUDA_VISIBLE_DEVICES=0 timeout 360 python3 -m mtp.bench --tp 8 --layers 61 --prompt-len 1024 --k 3 --draft-head-fp8 \
   --draft-vocab 32768 --json $OUT/dvshard.json > $OUT/dvshard.log 2>&1; echo "bench exit $? at $(( $(date +%s) - t0 )) s" >> $OUT/dvshard.log) &
BP=$!
for t in "tests/bench/test_spec_ab_gpu.py" "tests/decode/test_tree_gpu.py -k strict_or_graph" "tests/backends/test_glue_gpu.py"; do
  set -- $t; f=$1; k=${2:-}
  echo "== $f $k $(( $(date +%s) - t0 )) s"
  CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m pytest -q -m gpu $f ${k:+-k "${k//_/ }"} -p no:cacheprovider 2>&1 | tee -a $OUT/gpu_tests.log | tail -2
done
wait $BP
tail -1 $OUT/dvshard.log
grep -E "eagle_k3|gpu_step|draft vocab|balanced|by_shard" $OUT/dvshard.log | grep -v -i warn | tail -30
echo "== NCCL tests $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m pytest -q -m gpu tests/distributed/test_driver.py tests/parallel/test_parallel.py -p no:cacheprovider 2>&1 \
  | tee $OUT/nccl_tests.log | tail -3
echo "== end $(( $(date +%s) - t0 )) s"
