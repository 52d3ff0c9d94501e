#!/usr/bin/env bash
# session 24, call 2 (2 x H200): the Hydra / W&B / prompt_toolkit wheels, then the tree GPU tests (GPU 1, background)
# beside the dist part (launcher, mtp-eval TP=2 vs TP=1, a sweep, chat in a pty at TP=2)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
t0=$(date +%s)
(CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m pytest -q -m gpu tests/decode/test_tree_gpu.py -k "strict or graph" \
   -p no:cacheprovider > $OUT/tree_gpu.log 2>&1; echo "exit $? at $(( $(date +%s) - t0 )) s" >> $OUT/tree_gpu.log) &
TP=$!
PARTS=dist DIST_BUDGET_S=0 OUT=$OUT timeout 480 bash eval/gpu_session.sh 2>&1 | tee $OUT/dist.log | grep -v -i warn | tail -40
wait $TP
tail -3 $OUT/tree_gpu.log
echo "== end $(( $(date +%s) - t0 )) s"
