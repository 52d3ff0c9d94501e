#!/usr/bin/env bash
# session 24, call 5 (one H200): the end state with gemm_deep_rows on
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 300 python3 -m mtp.bench --tp 8 --layers 61 --prompt-len 1024 32768 --k 3 --profile --draft-head-fp8 \
  --draft-vocab 32768 --trees 2x1x1 --json $OUT/end.json > $OUT/end.log 2>&1; echo "end exit $? at $(( $(date +%s) - t0 )) s"
grep -E "^ +(1024|32768) +[1-4] |GPU [0-9.]+ ms|HEADLINE" $OUT/end.log | grep -v -i warn | tail -30
