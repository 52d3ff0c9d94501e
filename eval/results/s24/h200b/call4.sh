#!/usr/bin/env bash
# session 24, call 4 (one H200): gemm_deep against the defaults on the TP=8 rank (one process, alternated), the end
# state, the GPU test of the plan
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 230 python3 -m mtp.bench --tp 8 --layers 61 --prompt-len 1024 --no-spec --kernel-variants defaults gemm_deep \
  defaults gemm_deep --json $OUT/deep.json > $OUT/deep.log 2>&1; echo "variants exit $? at $(( $(date +%s) - t0 )) s"
grep -E "^\s*(defaults|gemm_deep)|variant|b2b" $OUT/deep.log | grep -v -i warn | tail -16
timeout 60 python3 -m pytest -q -m gpu tests/kernels/test_kernels_gpu.py -k "fp8_linear_variants" -p no:cacheprovider 2>&1 | tail -2
echo "== end state $(( $(date +%s) - t0 )) s"
timeout 280 python3 -m mtp.bench --tp 8 --layers 61 --prompt-len 1024 32768 --k 3 --profile --draft-head-fp8 \
  --draft-vocab 32768 --trees 2x1x1 --json $OUT/end.json > $OUT/end.log 2>&1; echo "end exit $? at $(( $(date +%s) - t0 )) s"
grep -E "b2b|GPU [0-9.]+ ms|tok/s" $OUT/end.log | grep -v -i warn | tail -24
