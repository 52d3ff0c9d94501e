#!/bin/bash
# session 25, call 3 (nvidia-h200-x2): GPU 0 the end state (TP=8 rank, 1k + 32k, spec steps, profile); GPU 1 the glue A/B
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
( CUDA_VISIBLE_DEVICES=0 timeout 340 python3 -m mtp.bench --tp 8 --layers 61 --prompt-len 1024 32768 --k 3 --profile \
    --draft-head-fp8 --draft-vocab 32768 --trees 2x1x1 --json $OUT/end.json > $OUT/end.log 2>&1 ) &
CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m mtp.bench.spec_ab --tp 8 --switches strict_commit,draft_window,tree_verdict \
    --tree 2x1x1 --reps 3 --json $OUT/ab_glue.json > $OUT/ab_glue.log 2>&1
echo "spec_ab rc $?" >> $OUT/ab_glue.log
wait
grep -v "^\[" $OUT/ab_glue.log | tail -12; grep -v "^\[" $OUT/end.log | sed -n '/simulated rank 0/,$p' | head -60
