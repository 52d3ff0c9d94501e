#!/bin/bash
# session 25, call 6 (nvidia-h200-x2): GPU 0 the glue switches' A/B at HEAD (on = the defaults); GPU 1 the GPU tests of
# the merged glue kernels
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
( CUDA_VISIBLE_DEVICES=0 timeout 235 python3 -m mtp.bench.spec_ab --tp 8 \
    --switches strict_commit,draft_window,tree_verdict,tree_window,gather_cast --tree 2x1x1 --reps 3 \
    --json $OUT/ab_glue2.json > $OUT/ab_glue2.log 2>&1; echo "spec_ab rc $?" >> $OUT/ab_glue2.log ) &
CUDA_VISIBLE_DEVICES=1 timeout 235 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_tree_window_gpu.py \
    tests/backends/test_glue_gpu.py tests/plan/test_kernel_count_gpu.py tests/decode/test_capture_gpu.py > $OUT/gpu_tests.log 2>&1
echo "tests rc $?" >> $OUT/gpu_tests.log
wait
tail -6 $OUT/gpu_tests.log; grep -v "^\[" $OUT/ab_glue2.log | tail -5
