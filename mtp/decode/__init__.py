"""Speculative decoding: options, decode state, the eager loop and the CUDA-graph runner (see mtp/DESIGN.md)."""
