"""Benchmarks, outside the library core (nothing in `mtp` imports this package): `mtp-bench` (`cli.py`: real-width
random FP8 models on the GPU against transformers and the HBM roofline), `rank.py` (`mtp-bench --tp N`: one rank
of TP=N at full depth on one GPU; its measurements in `rank_steps.py`, the byte floor and projection model in
`rank_model.py`, table and JSON in `rank_report.py`), `parallel.py` (TP=N against TP=1, torchrun entry),
`collectives.py` (NCCL latency of the step's collectives, torchrun entry), `timing.py` (CUDA-graph timing, kernel
profiles, step bytes);
`allreduce.py` (NCCL against the one-shot all-reduce), `load.py` (loading a real-width checkpoint at TP=N against
the disk's raw read rate), `startup.py` (cold / warm start phases), `experts.py` (busiest rank's expert reads per
layout, and its drawn routes), `forced_route.py` (an MoE's router output replaced per token: `--route busiest`); the kernel microbenchmarks, each `python -m mtp.bench.<name>`: `kernels.py` (every Triton kernel checked
and timed against the copy bandwidth), `fused.py` (the fused decode kernels against the path before them, per
switch), `topk_moe.py` (indexer top-k and expert-kernel layouts, old vs new).
"""
