"""Triton kernels for DeepSeek-V3.2 FP8 decode, each beside a plain-PyTorch reference it is tested against.

Importing this package never needs Triton or CUDA; `available()` says whether the kernels can run.
Modules: act_quant (per-128 FP8 activation quant), fp8_gemm (block-scaled FP8 linear: weight-streaming
small-M path + tiled prefill path), moe (routing + selected-expert compute), mla_decode (absorbed MLA over
an FP8 latent cache, dense or top-k sparse), indexer (lightning-indexer scores + top-k), topk (radix select
of the indexer's top-k positions over many SMs), elementwise (the ops between the GEMMs: norms, rotary, SiLU-mul,
FP8 fake quant, Hadamard; `triton_ops()`).
"""

from mtp.kernels._triton import HAS_TRITON, available

__all__ = ["HAS_TRITON", "available"]
