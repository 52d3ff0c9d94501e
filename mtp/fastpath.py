"""Switch a loaded model between the plain-PyTorch reference and the Triton fast path, at run time.

`enable_fast_path(model)` (CUDA, fp8 numerics) routes
- every FP8 `Linear` through `kernels.fp8_gemm.fp8_linear` (weight-streaming GEMV for <= 64 rows, tiled GEMM above);
  the bf16 ones (lm_head, MTP heads, eh_proj) stay on torch, whose bf16 GEMV reads the 1.85 GB lm_head at the
  HBM floor on an H200 (0.442 ms vs 0.439 ms; a Triton GEMV we tried was slower: BENCHMARKS.md);
- every `MoE` through `kernels.moe.moe_route` + `moe_experts` (reads only the chosen experts). The experts'
  weights are restacked per projection into [E, N, K] tensors, and each expert's parameters become views of
  the stack, so memory is not doubled (peak: one projection of one layer);
- `MLA` blocks of <= absorb_max_tokens new tokens through the indexer kernel + top-k and `mla_decode` over the
  real-FP8 latent cache; kv_b_proj is dequantized once to bf16 for the absorbed q / output projections
  (DeepSeek's reference keeps the same dequantized copy). Longer blocks (prefill) stay on the reference path.
`disable_fast_path(model)` switches back; the stacked expert tensors stay (they are the same weights).
Both paths compute DeepSeek's FP8 numerics; they differ only in summation order and top-k tie-breaking, and
tests hold one to the other within tolerance (tests/gpu).
"""

from __future__ import annotations

import torch

from .attention import MLA
from .layers import Linear, glue
from .model import DeepseekV32
from .moe import MoE


def enable_fast_path(model: DeepseekV32, compile_glue: bool = True) -> DeepseekV32:
    """compile_glue: torch.compile the elementwise glue (mtp.layers.Glue) into fused kernels."""
    from .kernels import available

    if not available():
        raise RuntimeError("the Triton fast path needs triton and a CUDA device; use the reference path")
    if model.device.type != "cuda":
        raise ValueError(f"the fast path needs the model on a CUDA device, it is on {model.device}")
    if model.runtime.numerics != "fp8" or not model.cfg.is_fp8:
        raise ValueError("the fast path implements DeepSeek's FP8 numerics: load an FP8 checkpoint with numerics='fp8'")
    if compile_glue:
        glue.compile()
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.is_fp8:
            mod.backend = "triton"
        elif isinstance(mod, MoE):
            _stack_experts(mod)
            mod.backend = "triton"
        elif isinstance(mod, MLA) and _mla_kernel_fits(mod):
            w = mod.kv_b_proj.dequantized_weight(torch.bfloat16).view(mod.H, mod.P + mod.V, mod.C)
            mod.w_kb = w[:, : mod.P].contiguous()  # [H, P, C]
            mod.w_vb = w[:, mod.P:].contiguous()  # [H, V, C]
            ix = mod.indexer
            mod.w_idx = ix.weights_proj.weight.float() * (ix.n_heads ** -0.5 * ix.head_dim ** -0.5)
            mod.backend = "triton"
    return model


def _mla_kernel_fits(mla: MLA) -> bool:
    """mla_decode is built for DeepSeek's latent 512 + rope 64; the indexer kernel for >= 16 power-of-two heads.
    Smaller test models keep the reference attention (their linears and MoE still use the kernels)."""
    hi = mla.indexer.n_heads
    return mla.C == 512 and mla.R == 64 and hi >= 16 and hi & (hi - 1) == 0


def disable_fast_path(model: DeepseekV32) -> DeepseekV32:
    for mod in model.modules():
        if hasattr(mod, "backend"):
            mod.backend = "reference"
    glue.reset()
    return model


def _stack_experts(moe: MoE) -> None:
    if getattr(moe, "stacked", None) is not None:
        return
    stacked = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for attr in ("weight", "weight_scale_inv"):
            parts = [getattr(e, proj) for e in moe.experts]
            big = torch.stack([getattr(p, attr).data for p in parts])
            for e, p in enumerate(parts):  # re-point each expert at its slice; the old tensor is freed
                setattr(p, attr, torch.nn.Parameter(big[e], requires_grad=False))
            stacked[f"{proj}.{attr}"] = big
    moe.stacked = stacked


def moe_forward_fast(moe: MoE, x_ND: torch.Tensor) -> torch.Tensor:
    from .kernels.moe import moe_experts, moe_route

    g = moe.gate
    w, idx = moe_route(x_ND, g.weight, g.e_score_correction_bias, n_group=g.n_groups, topk_group=g.topk_groups,
                       topk=g.topk, route_scale=g.route_scale)
    s = moe.stacked
    return moe_experts(x_ND, idx, w, s["gate_proj.weight"], s["gate_proj.weight_scale_inv"], s["up_proj.weight"],
                       s["up_proj.weight_scale_inv"], s["down_proj.weight"], s["down_proj.weight_scale_inv"],
                       out_dtype=torch.float32)


def mla_attend_fast(mla: MLA, x_BTD, qr_BTQ, q_nope, q_pe, cos, sin, cache, S: int) -> torch.Tensor:
    """Absorbed MLA over the FP8 cache with the indexer's top-k: returns o [B, T, H, V] fp32."""
    from .kernels.indexer import indexer_topk
    from .kernels.mla_decode import mla_decode

    ix = mla.indexer
    q8, qs = glue.act_quant(ix.queries(qr_BTQ, cos, sin))  # qs [B, T, Hi, 1]
    w = torch.nn.functional.linear(x_BTD.float(), mla.w_idx)  # fp32 copy, scaled by Hi^-0.5 * Dk^-0.5
    lens = cache.seq_lens  # keys before this block; query t sees < lens + t + 1
    topk_idx = None
    if ix.topk < S:
        topk_idx, _ = indexer_topk(q8, qs.squeeze(-1), w, cache.idx_k[:, :S], cache.idx_k_scale[:, :S], lens,
                                   topk=ix.topk)
    q_lat = torch.einsum("bthp,hpc->bthc", q_nope.to(torch.bfloat16), mla.w_kb).contiguous()
    o_lat = mla_decode(q_lat, q_pe.to(torch.bfloat16).contiguous(), cache.kv[:, :S], cache.kv_scale[:, :S],
                       cache.pe[:, :S], lens, mla.softmax_scale, topk_idx=topk_idx, out_dtype=torch.float32)
    return torch.einsum("bthc,hvc->bthv", o_lat.to(torch.bfloat16), mla.w_vb).float()
