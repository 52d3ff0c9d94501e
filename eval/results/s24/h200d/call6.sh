#!/usr/bin/env bash
# session 24, call 6 (one H200): the deep few-row GEMV plan at TP=1 (3 layers, full width), default vs
# gemm_deep_rows=4, alternated over four processes
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s)
i=0
for k in "" "gemm_deep_rows=4" "" "gemm_deep_rows=4"; do
  i=$((i + 1))
  timeout 55 python3 -m mtp.bench --layers 3 --prompt-len 1024 --no-spec ${k:+--kernels $k} --json $OUT/tp1_$i.json \
    > $OUT/tp1_$i.log 2>&1
  echo "== run $i ${k:-defaults}: exit $? at $(( $(date +%s) - t0 )) s"
  grep -E "^ +1024 +[1-4] |graph|b2b" $OUT/tp1_$i.log | grep -v -i warn | head -8
done
