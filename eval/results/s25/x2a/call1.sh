#!/bin/bash
# session 25, call 1 (nvidia-h200-x2): GPU 0 the few-row GEMV sweep then the TP=1 bench; GPU 1 the GPU tests
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpus.txt
( CUDA_VISIBLE_DEVICES=0 timeout 330 python3 s25tmp/gemv_sweep2.py > $OUT/sweep.log 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m mtp.bench --layers 3 --prompt-len 1024 --no-spec --json $OUT/tp1.json > $OUT/tp1.log 2>&1 ) &
CUDA_VISIBLE_DEVICES=1 timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_mla_channel_splits_gpu.py tests/kernels/test_moe_down_nb_gpu.py tests/kernels/test_router_one_gpu.py > $OUT/gpu_tests.log 2>&1
echo "tests rc $?" >> $OUT/gpu_tests.log
wait
tail -3 $OUT/gpu_tests.log; cat $OUT/sweep.log; tail -25 $OUT/tp1.log
