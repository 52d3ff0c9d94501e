# session 25, call 4 (the warm x2c machine, nvidia-h200-x2; carry [".whl"]), then call 5 on the same machine
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0; PARTS="nccl tp dist" NCCL_S=150 TP_S=150 DIST_BUDGET_S=0 OUT=$OUT timeout 480 bash eval/gpu_session.sh > $OUT/session.log 2>&1; echo rc $?; grep -v -i warn $OUT/session.log | tail -60
# call 5:
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0; timeout 280 python3 -m pytest -q -m gpu -rfE tests/distributed/test_driver.py tests/parallel/test_parallel.py tests/parallel/test_layouts_fast_path_gpu.py -p no:cacheprovider 2>&1 | tail -8
# (only 8 files of $OUT came back: session.log, tp2.json and the eval folders did not; their console lines are in
# BENCHMARKS.md's session 25 section, from the call's output tail)
