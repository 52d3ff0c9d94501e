#!/bin/bash
# session 25, call 2 (nvidia-h200-x2): GPU 0 the TP=8 rank's variants then the glue A/B; GPU 1 the GPU tests
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
( CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m mtp.bench --tp 8 --layers 61 --prompt-len 1024 --no-spec \
    --kernel-variants defaults gemv_w4 gemm_deep_q_b_off moe_down_pf moe_down_pf_noaw defaults gemv_w4 gemm_deep_q_b_off moe_down_pf moe_down_pf_noaw \
    --json $OUT/variants.json > $OUT/variants.log 2>&1 ) &
CUDA_VISIBLE_DEVICES=1 timeout 470 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_tree_verdict_gpu.py \
    tests/backends/test_glue_gpu.py tests/kernels/test_moe_down_nb_gpu.py "tests/kernels/test_kernels_gpu.py::test_fp8_linear_variants" \
    > $OUT/gpu_tests.log 2>&1
echo "tests rc $?" >> $OUT/gpu_tests.log
wait
tail -5 $OUT/gpu_tests.log; grep -v "^\[" $OUT/variants.log | tail -40
