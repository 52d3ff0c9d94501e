#!/usr/bin/env bash
# One device call that checks and times everything GPU-side, writing logs and JSON under $OUT (or ./gpu_out):
# the GPU test suite, mtp-bench (profile + draft vocabulary, vs transformers), and with >= 2 GPUs the NCCL test
# and the TP=2 benchmark against TP=1. Each part has its own time limit, so one hang cannot eat the call.
#   bash eval/gpu_session.sh                  # e.g. through the device tool: run(command="bash eval/gpu_session.sh")
#   PARTS="nccl tp" bash eval/gpu_session.sh  # a subset: tests, nccl, tp, bench (all four exceed one 10-minute call)
#   PARTS=tests GPU_TESTS="tests/kernels/test_kernels_gpu.py" ...  # some of the GPU test files (all: tests/*/test_*_gpu.py;
#                                             # they no longer fit one 10-minute call together)
#   PARTS=tp8 bash eval/gpu_session.sh        # one rank of TP=8 at full depth (needs ~96 GiB: an H200), alone in
#                                             # one call: ~82 GiB of random weights, 1k/8k/32k contexts, spec steps
#   PARTS="coll tp8" ...                      # with 2+ GPUs: NCCL latencies first, used by tp8's projection
#   PARTS="base tp8" BASE=.old ...            # the TP=8 rank of an older tree ($BASE_ARGS, default --no-spec; $BASE: `git archive <commit> mtp eval
#                                             # conf pyproject.toml | tar -x -C .old`, carried) next to this one
#   PARTS="mlarank" ...                       # mla_decode's heads per program at one TP=8 rank's 16 heads
#   PACK=1 ...                                # everything under $OUT packed into one results.tgz (few files return)
#   PARTS="trees1" ...                        # TP=1 tree verify widths (mtp-bench --trees $TREES)
#   PARTS=dist DIST_BUDGET_S=480 ...          # runtime.tp=2 over NCCL: launcher, mtp-eval TP=2 vs TP=1, a 3-point sweep,
#                                             # chat in a pty, then the NCCL tests until the budget is spent (carry the
#                                             # Hydra + pexpect wheels)
#   PARTS="startup f64 loadscale ncclloop" ... # cold / warm start (mtp.bench.startup), TP=2 == TP=1 in float64,
#                                             # a real-width checkpoint from disk at TP=2, mmap and pread readers, vs raw read (mtp.bench.load),
#                                             # the NCCL tests in a row for LOOP_BUDGET_S
#   PARTS=shards SHARDS="a.py,b.py c.py" ...  # GPU test files spread over the GPUs, one pytest process per GPU
#   PARTS=realdist ...                        # the launcher and mtp-eval at TP=2 on a real-width checkpoint from disk
#   PARTS=busiest LAYOUTS="contiguous split" ... # the TP=8 rank (H200) as each layout's busiest rank, forced routes
#   PARTS="ar par deep" ...                  # issue 25 on 2-4 GPUs: the all-reduce bench on every GPU, a real TP=2 and
#                                             # TP=$ngpu step with nccl vs oneshot (PAR_TP), a real TP=$ngpu step of
#                                             # DEEP_LAYERS beside its simulated rank (mtp-bench --tp $ngpu)
#   PARTS=moebatch MOEB_ARGS=--quick ...      # every moe_experts layout at T = 1..4096 (the grouped GEMM's thresholds)
#   PARTS="tp8v gemv tp1v" ...                # kernel choices side by side (issue 16): the TP=8 rank at 1k with the
#                                             # kernel variants $VARIANTS, the GEMV sweep (mtp.bench.fused), and
#                                             # the TP=1 bench once per switch set in $TP1_KERNELS ("-" = defaults)
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
PARTS=${PARTS:-tests nccl tp bench}  # tp8 only when named
want() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
same_runs() {  # label, TP=1 run folder, TP=2 run folder: do their samples hold the same tokens and histograms?
  python3 - "$@" <<'PY'
import json, sys
rows = lambda d: [json.loads(l) for l in open(f"{d}/samples.jsonl")]
a, b = rows(sys.argv[2]), rows(sys.argv[3])
same = [x["tokens"] == y["tokens"] and x["row_accepted_hist"] == y["row_accepted_hist"] for x, y in zip(a, b)]
print(f"mtp-eval {sys.argv[1]}: TP=N tokens and histograms equal TP=1 for {sum(same)} of {len(same)} prompts")
PY
}
nccl_loop() {  # start seconds, budget seconds: the NCCL tests run after run while the budget lasts (at most $LOOP_RUNS)
  local i=0
  while [ $(( $(date +%s) - $1 )) -lt "$2" ] && [ "$i" -lt "${LOOP_RUNS:-1000}" ]; do
    i=$((i + 1)); echo "== NCCL tests, run $i $(date -u +%H:%M:%S)"
    timeout "${DIST_TEST_S:-240}" python3 -m pytest -q -m gpu ${DIST_TESTS:-tests/distributed/test_driver.py tests/parallel/test_parallel.py} \
      -p no:cacheprovider 2>&1 | tee -a "$OUT/pytest_dist.log" | tail -1
  done
}
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $ngpu, commit $(git rev-parse --short HEAD 2>/dev/null)"
if want tests; then
  echo "== GPU tests ${GPU_TESTS:=$(ls tests/*/test_*_gpu.py | tr '\n' ' ')}"
  timeout "${TESTS_S:-420}" python3 -m pytest -q -m gpu $GPU_TESTS 2>&1 | tee "$OUT/pytest_gpu.log" | tail -4
fi
if want shards; then  # GPU test files over the machine's GPUs, one pytest per GPU at a time, all in parallel
  SHARDS=${SHARDS:-$(ls tests/*/test_*_gpu.py | tr '\n' ' ')}  # a shard: files joined by commas
  n=$(( ngpu > 0 ? ngpu : 1 ))
  echo "== GPU tests in shards over $n GPUs $(date -u +%H:%M:%S)"
  i=0
  for sh in $SHARDS; do
    CUDA_VISIBLE_DEVICES=$((i % n)) timeout "${TESTS_S:-420}" python3 -m pytest -q -rfE -m gpu ${sh//,/ } -p no:cacheprovider \
      > "$OUT/pytest_shard$i.log" 2>&1 &
    i=$((i + 1)); [ $((i % (n * ${SHARDS_PER_GPU:-1}))) -eq 0 ] && wait  # SHARDS_PER_GPU pytest processes share a GPU
  done
  wait
  for ((j = 0; j < i; j++)); do echo "shard $j ($(echo $SHARDS | cut -d' ' -f$((j + 1)))): $(tail -1 "$OUT/pytest_shard$j.log")"; done
fi
if [ "$ngpu" -ge 2 ] && want nccl; then
  echo "== NCCL tests (2 ranks)"
  timeout "${NCCL_S:-200}" python3 -m pytest -q -m gpu tests/parallel/test_parallel.py -s 2>&1 | tee "$OUT/pytest_tp2.log" | tail -4
fi
if [ "$ngpu" -ge 2 ] && want tp; then
  echo "== TP=2 vs TP=1"
  timeout "${TP_S:-300}" python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m mtp.bench.parallel \
    --out "$OUT/tp2.json" --compare-tp1 2>&1 | tee "$OUT/tp2.log" | grep -v -i warn | tail -12
fi
if want bench; then
  echo "== mtp-bench"
  timeout "${BENCH_S:-360}" python3 -m mtp.bench --hf --profile --draft-vocab "${DRAFT_VOCAB:-32768}" \
    --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -v -i warn | tail -45
fi
if [ "$ngpu" -ge 2 ] && want coll; then
  echo "== collective latency, $ngpu GPUs (NCCL, graph-captured)"
  timeout "${COLL_S:-180}" python3 -m torch.distributed.run --standalone --nproc-per-node "$ngpu" \
    -m mtp.bench.collectives --json "$OUT/coll.json" 2>&1 | tee "$OUT/coll.log" | grep -v -i warn | tail -30
  [ -s "$OUT/coll.json" ] && COLL_JSON=${COLL_JSON:-$OUT/coll.json}
fi
if want mlarank; then
  echo "== mla_decode heads per program, one TP=8 rank (python -m mtp.bench.kernels --only mla_rank) $(date -u +%H:%M:%S)"
  timeout "${MLA_S:-150}" python3 -m mtp.bench.kernels --only mla_rank --out "$OUT" 2>&1 \
    | tee "$OUT/gpu_kernels_mla_rank.log" | grep -v -i warn | tail -14
fi
if want base && [ -d "${BASE:-.old}" ]; then
  echo "== baseline tree ${BASE:-.old}: mtp-bench --tp 8 (target steps only) $(date -u +%H:%M:%S)"
  (cd "${BASE:-.old}" && timeout "${BASE_S:-240}" python3 -m mtp.bench --tp 8 --layers 61 \
    --prompt-len ${BASE_CTX:-1024 32768} ${BASE_ARGS:---no-spec} --json "$OUT/bench_tp8_base.json") 2>&1 \
    | tee "$OUT/bench_tp8_base.log" | grep -v -i warn | grep -E "^ +[0-9]+ +[0-9] " | tail -12
fi
if want tp8v; then
  echo "== mtp-bench --tp 8, kernel variants ${VARIANTS:=gemv1 gemv2 new+pdl gemv1+pdl} $(date -u +%H:%M:%S)"
  timeout "${TP8V_S:-300}" python3 -m mtp.bench --tp 8 --layers 61 --prompt-len ${TP8_CTX:-1024} --profile \
    --kernel-variants $VARIANTS --json "$OUT/bench_tp8_variants.json" 2>&1 | tee "$OUT/bench_tp8_variants.log" \
    | grep -v -i warn | grep -v "^ \{4,\}[0-9.]* us" | tail -40
fi
if want gemv; then
  echo "== GEMV kernels side by side (python -m mtp.bench.fused --only gemv) $(date -u +%H:%M:%S)"
  timeout "${GEMV_S:-200}" python3 -m mtp.bench.fused --only gemv --out "$OUT" 2>&1 | tee "$OUT/gpu_fused_gemv.log" \
    | grep -v -i warn | tail -60
fi
if want tp1v; then
  for sw in ${TP1_KERNELS:-- gemv_rows=1 gemv_rows=2}; do
    tag=$(echo "$sw" | tr '=,' '__'); [ "$sw" = "-" ] && tag=default
    echo "== mtp-bench TP=1 (3 layers), kernels: $sw $(date -u +%H:%M:%S)"
    timeout "${TP1_S:-120}" python3 -m mtp.bench $([ "$sw" = "-" ] || echo --kernels ${sw//,/ }) \
      --out "$OUT/bench_tp1_$tag.json" 2>&1 | tee "$OUT/bench_tp1_$tag.log" | grep -E "graph|spec " | tail -12
  done
fi
if want trees1; then
  echo "== mtp-bench TP=1 (3 layers) tree verify widths ${TREES:=chain3,2x2,2x1x1,3x1x1,4x1x1} $(date -u +%H:%M:%S)"
  timeout "${TREES1_S:-150}" python3 -m mtp.bench --trees "$TREES" --new-tokens 16 --out "$OUT/bench_trees_tp1.json" \
    2>&1 | tee "$OUT/bench_trees_tp1.log" | grep -v -i warn | grep -iE "tree|chain|graph" | tail -16
fi
if want tp8; then
  echo "== mtp-bench --tp 8 (simulated rank, 61 layers) $(date -u +%H:%M:%S)"
  timeout "${TP8_S:-560}" python3 -m mtp.bench --tp 8 --layers 61 --prompt-len ${TP8_CTX:-1024 8192 32768} --profile \
    ${TP8_ARGS:-} ${COLL_JSON:+--collective-json "$COLL_JSON"} --json "$OUT/bench_tp8.json" 2>&1 \
    | tee "$OUT/bench_tp8.log" | grep -v -i warn | grep -v "^ \{4,\}[0-9.]* us" | tail -60
  echo "== done $(date -u +%H:%M:%S)"
fi
if [ "$ngpu" -ge 2 ] && want dist; then  # runtime.tp=$DIST_TP (default 2) over NCCL on the bundled model (needs the Hydra wheels: README)
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
  t_dist=$(date +%s); T=${DIST_TP:-2}
  CK=$(python3 -c "from mtp.checkpoint.tiny import default_checkpoint as d; print(d())")
  for dt in fp32 bf16; do  # the reference path: TP=2 and TP=1 then differ only in the all-reduce's summation order
    echo "== launcher TP=$T (torchrun) vs TP=1, $dt, reference path $(date -u +%H:%M:%S)"
    L=("$CK" --prompt "def reverse(xs):" --max-new-tokens 48 --dtype $dt --no-fast-path)
    timeout 240 python3 -m mtp.distributed.launch "${L[@]}" > "$OUT/launch_tp1_$dt.txt" 2> "$OUT/launch_tp1_$dt.err"
    timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node $T -m mtp.distributed.launch "${L[@]}" --check \
      > "$OUT/launch_tp${T}_$dt.txt" 2> "$OUT/launch_tp${T}_$dt.err"
    echo "exit $?; stdout equal: $(cmp -s "$OUT/launch_tp1_$dt.txt" "$OUT/launch_tp${T}_$dt.txt" && echo yes || echo NO)" \
      "($(wc -c < "$OUT/launch_tp${T}_$dt.txt") bytes)"
    grep -h "world" "$OUT/launch_tp1_$dt.err" "$OUT/launch_tp${T}_$dt.err"
  done
  [ -n "${DIST_LAUNCH_ONLY:-}" ] && exit 0
  EV="dataset.limit=4 max_new_tokens=48 timing.repeats=1 plots=false runtime=cuda runtime.mode=${DIST_MODE:-overlap}"
  for run in "tp1_fp32 runtime.tp=1 runtime.dtype=float32" "tp${T}_fp32 runtime.tp=$T runtime.dtype=float32" \
             "tp${T}_bf16 runtime.tp=$T"; do
    set -- $run; name=$1; shift
    echo "== mtp-eval $name $(date -u +%H:%M:%S)"
    /usr/bin/time -f "wall %e s, exit %x" timeout 300 python3 -m eval.run $EV "$@" hydra.run.dir="$OUT/eval_$name" 2>&1 \
      | grep -E "^│ all|wall|error"
  done
  same_runs fp32 "$OUT/eval_tp1_fp32" "$OUT/eval_tp${T}_fp32"
  echo "== mtp-eval sweep draft.k=1,2,3 at TP=$T (one load) $(date -u +%H:%M:%S)"
  /usr/bin/time -f "wall %e s, exit %x" timeout 400 python3 -m eval.run -m $EV runtime.tp=$T draft.k=1,2,3 \
    hydra.sweep.dir="$OUT/sweep_tp$T" 2>&1 | grep -E "^│ all|wall|error|#"
  echo "== mtp-chat at TP=2 (the test's own TP) in a pseudo-terminal $(date -u +%H:%M:%S)"
  MTP_CHAT_TEST_RUNTIME=cuda timeout 200 python3 -m pytest -q tests/chat/test_cli.py -k 2 -p no:cacheprovider 2>&1 | tail -2
  nccl_loop "$t_dist" "${DIST_BUDGET_S:-480}"  # the NCCL tests again and again, as long as the budget allows
fi
if [ "$ngpu" -ge 2 ] && want ar; then  # the one-shot all-reduce against NCCL on every GPU of the machine (issue 25)
  echo "== all-reduce + add + norm, $ngpu GPUs (mtp.bench.allreduce) $(date -u +%H:%M:%S)"
  TORCH_NCCL_AVOID_RECORD_STREAMS=1 timeout "${AR_S:-240}" python3 -m torch.distributed.run --standalone \
    --nproc-per-node "$ngpu" -m mtp.bench.allreduce --json "$OUT/allreduce_${ngpu}gpu.json" ${AR_ARGS:-} 2>&1 \
    | tee "$OUT/allreduce_${ngpu}gpu.log" | grep -v -i warn | tail -${AR_TAIL:-30}
fi
if [ "$ngpu" -ge 2 ] && want par; then  # a real TP=N step (3 layers), NCCL vs the one-shot all-reduce (issue 25)
  for n in ${PAR_TP:-2 $ngpu}; do
    [ "$n" -le "$ngpu" ] || continue
    echo "== mtp.bench.parallel TP=$n, --allreduce nccl oneshot $(date -u +%H:%M:%S)"
    timeout "${PAR_S:-240}" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" -m mtp.bench.parallel \
      --allreduce nccl oneshot --modes graph --layers ${PAR_LAYERS:-3} ${PAR_ARGS:-} --out "$OUT/par_tp${n}.json" 2>&1 \
      | tee "$OUT/par_tp${n}.log" | grep -v -i warn | tail -12
  done
fi
if [ "$ngpu" -ge 2 ] && want deep; then  # a real TP=N step as deep as the GPUs hold, beside its simulated rank
  echo "== mtp.bench.parallel TP=$ngpu, ${DEEP_LAYERS:=12} layers $(date -u +%H:%M:%S)"
  timeout "${DEEP_S:-300}" python3 -m torch.distributed.run --standalone --nproc-per-node "$ngpu" -m mtp.bench.parallel \
    --allreduce nccl oneshot --modes graph --layers "$DEEP_LAYERS" --dense-layers 3 --gen-tokens 0 ${PAR_ARGS:-} --out "$OUT/deep_tp${ngpu}.json" 2>&1 \
    | tee "$OUT/deep_tp${ngpu}.log" | grep -v -i warn | tail -12
  echo "== the simulated TP=$ngpu rank of the same $DEEP_LAYERS layers (mtp-bench --tp $ngpu) $(date -u +%H:%M:%S)"
  timeout "${DEEP_S:-300}" python3 -m mtp.bench --tp "$ngpu" --layers "$DEEP_LAYERS" --dense-layers 3 --prompt-len 1024 --no-spec ${DEEP_SIM_ARGS:-} \
    --json "$OUT/deep_sim_tp${ngpu}.json" 2>&1 | tee "$OUT/deep_sim_tp${ngpu}.log" | grep -v -i warn \
    | grep -v "^ \{4,\}[0-9.]* us" | tail -20
fi
if want moebatch; then  # every moe_experts layout over T = 1..4096 tokens, TP=8 rank and TP=1 (issue 25)
  echo "== moe_experts layouts by token count (python -m mtp.bench.topk_moe --only moe_batch) $(date -u +%H:%M:%S)"
  timeout "${MOEB_S:-360}" python3 -m mtp.bench.topk_moe --only moe_batch ${MOEB_ARGS:-} --out "$OUT" 2>&1 \
    | tee "$OUT/moe_batch.log" | grep -v -i warn | tail -40
fi
if want startup; then  # cold / warm start on the bundled model, phase by phase (issue 24 item 6)
  echo "== start-up, cold and warm $(date -u +%H:%M:%S)"
  timeout "${STARTUP_S:-420}" python3 -m mtp.bench.startup ${STARTUP_ARGS:-} --json "$OUT/startup.json" 2>&1 \
    | tee "$OUT/startup.log" | grep -v -i warn | tail -12
fi
if [ "$ngpu" -ge 2 ] && want f64; then  # strict tokens TP=2 == TP=1 in float64 on GPUs (reference path, 4 prompts)
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
  EV="dataset.limit=4 max_new_tokens=48 timing.repeats=1 plots=false runtime=cuda runtime.dtype=float64 baseline=false"
  for tp in 1 2; do
    echo "== mtp-eval float64 TP=$tp $(date -u +%H:%M:%S)"
    timeout 300 python3 -m eval.run $EV runtime.tp=$tp hydra.run.dir="$OUT/eval_f64_tp$tp" 2>&1 | grep -E "^│ all|error"
  done
  same_runs float64 "$OUT/eval_f64_tp1" "$OUT/eval_f64_tp2"
fi
if [ "$ngpu" -ge 2 ] && want loadscale; then  # a real-width checkpoint from local disk at TP=2 (issue 24 item 5)
  LD=${LOAD_DIR:-/tmp/mtp-load-ckpt}
  echo "== write a real-width checkpoint to $LD ($(df -h "$(dirname "$LD")" | tail -1)) $(date -u +%H:%M:%S)"
  timeout "${LOAD_WRITE_S:-300}" python3 -m mtp.bench.load write "$LD" --moe-layers "${LOAD_MOE:-3}" \
    --json "$OUT/load_write.json" 2>&1 | tail -2
  echo "== load it at TP=2 against the raw read rate $(date -u +%H:%M:%S)"
  MTP_PROGRESS=1 timeout "${LOAD_S:-300}" python3 -m mtp.bench.load measure "$LD" --tp 2 --json "$OUT/load_tp2.json" \
    2>&1 | tee "$OUT/load_tp2.log" | grep -v -i warn | tail -16
  [ -n "${LOAD_KEEP:-}" ] || rm -rf "$LD"
fi
if [ "$ngpu" -ge 2 ] && want realdist; then  # the launcher and mtp-eval at TP=2 on a real-width checkpoint from disk
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
  LD=${LOAD_DIR:-/tmp/mtp-load-ckpt}; CK=$(python3 -c "from mtp.checkpoint.tiny import default_checkpoint as d; print(d())")
  [ -f "$LD/config.json" ] || timeout "${LOAD_WRITE_S:-300}" python3 -m mtp.bench.load write "$LD" \
    --moe-layers "${LOAD_MOE:-1}" --json "$OUT/load_write.json" 2>&1 | tail -1
  cp "$CK"/tokenizer*.json "$LD"/  # random weights: their tokens mean nothing, but the text path is the real one
  echo "== launcher TP=2 on the real-width checkpoint $LD $(date -u +%H:%M:%S)"
  timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m mtp.distributed.launch "$LD" \
    --prompt "def reverse(xs):" --max-new-tokens 16 --check > "$OUT/launch_real_tp2.txt" 2> "$OUT/launch_real_tp2.err"
  echo "exit $?: $(grep -h world "$OUT/launch_real_tp2.err" | tail -1)"
  echo "== mtp-eval TP=2 on the real-width checkpoint $(date -u +%H:%M:%S)"
  /usr/bin/time -f "wall %e s, exit %x" timeout 300 python3 -m eval.run model=dsv32 model.path="$LD" runtime=cuda runtime.tp=2 \
    dataset.limit=2 max_new_tokens=16 timing.repeats=1 plots=false baseline=false hydra.run.dir="$OUT/eval_real_tp2" \
    2>&1 | grep -E "^│ all|wall|error|startup"
  [ -n "${LOAD_KEEP:-}" ] || rm -rf "$LD"
fi
if want busiest; then  # the TP=8 rank timed as the busiest rank of each expert layout (per-token forced routes)
  for lay in ${LAYOUTS:-contiguous interleaved split}; do
    echo "== mtp-bench --tp 8 --route busiest --layout $lay $(date -u +%H:%M:%S)"
    timeout "${BUSY_S:-200}" python3 -m mtp.bench --tp 8 --layers 61 --prompt-len 1024 --no-spec --route busiest \
      --layout "$lay" --batch ${BUSY_BATCH:-1} --json "$OUT/bench_tp8_busiest_$lay.json" 2>&1 \
      | tee "$OUT/bench_tp8_busiest_$lay.log" | grep -E "graph .* ms|busiest" | tail -10
  done
fi
if [ "$ngpu" -ge 2 ] && want ncclloop; then  # the NCCL tests in a row until the budget is spent
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
  nccl_loop "$(date +%s)" "${LOOP_BUDGET_S:-400}"
fi
if [ "${PACK:-0}" = 1 ]; then  # the device tool returns few files: one archive of everything
  (cd "$OUT" && tar czf results.tgz --exclude results.tgz . && find . -type f ! -name results.tgz -delete)
fi
