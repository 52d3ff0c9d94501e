#!/usr/bin/env bash
# device call 2 of session 7 (not kept): leftovers killed, f64, one-shot all-reduce tests + bench, recompiles, NCCL loop
t0=$(date +%s)
pkill -9 -f "pytest|mtp\.|eval\.run|torch.distributed.run" 2>/dev/null; sleep 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi -L
R=$OUT/r; mkdir -p $R
OUT=$R PARTS=f64 bash eval/gpu_session.sh 2>&1 | tail -6
echo "== allreduce GPU tests $(date -u +%T)"
timeout 170 python3 -m pytest -q -m gpu tests/parallel/test_allreduce_gpu.py -rA -s -p no:cacheprovider > $R/ar_test.log 2>&1
grep -E "ok$|error|passed|failed" $R/ar_test.log | tail -30
echo "== allreduce bench 2 GPUs $(date -u +%T)"
timeout 130 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m mtp.bench.allreduce --json $R/ar2.json --widths 1 2 3 4 --dtypes bfloat16 --variant-timeout 40 > $R/ar2.log 2>&1
grep -v -i warn $R/ar2.log | tail -30
echo "== recompiles of the compiled elementwise ops (fast path, bundled) $(date -u +%T)"
TORCH_LOGS=recompiles timeout 110 python3 -m mtp.bench.startup --child fast > $R/recompiles.log 2>&1
grep -c "Recompiling function" $R/recompiles.log; grep -A2 "Recompiling function" $R/recompiles.log | grep -E "triggered by|guard" | sed 's/.*guard failed//' | sort | uniq -c | sort -rn | head -15; tail -1 $R/recompiles.log
left=$(( 585 - ($(date +%s) - t0) ))
echo "== NCCL loop for $left s"
OUT=$R PARTS=ncclloop LOOP_BUDGET_S=$((left - 90)) bash eval/gpu_session.sh 2>&1 | grep -E "run|passed|failed"
(cd $R && tar czf $OUT/results.tgz .)
