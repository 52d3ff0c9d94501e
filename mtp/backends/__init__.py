"""Backends applied to a loaded reference model by swapping its modules: the Triton fast path (fast_path.py).
Tensor / expert parallelism (`mtp.parallel.modules.shard_model`) follows the same pattern."""
