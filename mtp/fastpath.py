"""Switch a loaded model between the plain-PyTorch reference and the Triton fast path, at run time.

`enable_fast_path(model)` (CUDA, fp8 numerics) routes
- every FP8 `Linear` through `kernels.fp8_gemm.fp8_linear` (weight-streaming GEMV for <= 64 rows, tiled GEMM above);
  the bf16 ones (lm_head, MTP heads, eh_proj) stay on torch, whose bf16 GEMV reads the 1.85 GB lm_head at the
  HBM floor on an H200 (0.442 ms vs 0.439 ms; a Triton GEMV we tried was slower: BENCHMARKS.md);
- every `MoE` through `kernels.moe.moe_route` + `moe_experts` (reads only the chosen experts; the expert-parallel
  MoE of `mtp.parallel` likewise over its rank's experts, skipping slots routed to other ranks). The experts'
  weights are restacked per projection into [E, N, K] tensors, and each expert's parameters become views of
  the stack, so memory is not doubled (peak: one projection of one layer);
- `MLA` blocks of <= absorb_max_tokens new tokens through the indexer kernel + top-k (`kernels.topk` radix
  select, or torch.topk: `set_kernel_options`) and `mla_decode` over the
  real-FP8 latent cache; kv_b_proj is dequantized once to bf16 for the absorbed q / output projections
  (DeepSeek's reference keeps the same dequantized copy). Longer blocks (prefill) stay on the reference path.
  The block runs in `mla_forward_fast`: q_a | indexer wk | kv_a and q_b | indexer wq_b as one GEMV each
  (`fuse_rows`), the cache write in one kernel (`kernels.cache_write`);
- dense MLPs and shared experts with gate and up stacked into one GEMV (`fuse_rows`).
`disable_fast_path(model)` switches back; the stacked expert tensors stay (they are the same weights).
Both paths compute DeepSeek's FP8 numerics; they differ only in summation order and top-k tie-breaking, and
tests hold one to the other within tolerance (tests/gpu).
"""

from __future__ import annotations

import torch

from .attention import MLA
from .engine import release
from .layers import MLP, Linear, glue
from .model import DeepseekV32
from .moe import MoE
from .parallel.modules import ExpertParallelMoE


def enable_fast_path(model: DeepseekV32, compile_glue: bool = True, indexer_topk: str = "radix") -> DeepseekV32:
    """compile_glue: torch.compile the elementwise glue (mtp.layers.Glue) into fused kernels.
    indexer_topk: the indexer's top-k, 'radix' (Triton radix select, the reference's tie rule), 'radix_fused'
    (its histogram pass in the scores kernel) or 'torch' (torch.topk); switch it and the MoE expert layout
    later with `set_kernel_options`."""
    from .kernels import available
    from .kernels.indexer import TOPK_IMPLS

    if not available():
        raise RuntimeError("the Triton fast path needs triton and a CUDA device; use the reference path")
    if model.device.type != "cuda":
        raise ValueError(f"the fast path needs the model on a CUDA device, it is on {model.device}")
    if model.runtime.numerics != "fp8" or not model.cfg.is_fp8:
        raise ValueError("the fast path implements DeepSeek's FP8 numerics: load an FP8 checkpoint with numerics='fp8'")
    if indexer_topk not in TOPK_IMPLS:
        raise ValueError(f"enable_fast_path: indexer_topk must be one of {TOPK_IMPLS}, got {indexer_topk!r}")
    if compile_glue:
        glue.compile()
    mm_fp32 = _mm_out_fp32()
    routed = set()  # routed experts (MoE's list, the expert-parallel MoE's dict) keep their own layout
    for mod in model.modules():
        ex = getattr(mod, "experts", None)
        if isinstance(ex, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            routed.update(id(e) for e in (ex.values() if isinstance(ex, torch.nn.ModuleDict) else ex))
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
            mod.w_idx_t = (ix.weights_proj.weight.t().contiguous()
                           if ix.weights_proj.weight.dtype == torch.bfloat16 and mm_fp32 else None)
            # the projections that read the same input, as one weight each (one launch instead of 3 and 2)
            mod.fused_a = fuse_rows([mod.q_a_proj, ix.wk, mod.kv_a_proj_with_mqa])
            mod.fused_qb = fuse_rows([mod.q_b_proj, ix.wq_b])
            mod.topk_impl = indexer_topk
            mod.backend = "triton"
        elif isinstance(mod, ExpertParallelMoE):  # the rank's experts stacked; slots of other ranks' experts skipped
            mod.enable_fast_path()
        elif type(mod) is MLP and id(mod) not in routed:  # dense MLPs and shared experts: gate and up as one
            mod.fused_gate_up = fuse_rows([mod.gate_proj, mod.up_proj])
    release(model)  # graphs `generate` kept were captured on the other path, some over re-pointed weights
    return model


def set_kernel_options(model: torch.nn.Module, indexer_topk: str | None = None,
                       moe_layout: str | None = "keep") -> None:
    """Switch kernel variants of a fast-path model, so that old and new can be timed side by side:
    indexer_topk 'radix' | 'radix_fused' | 'torch' (every MLA); moe_layout for every MoE's expert kernels: 'pairs' (the pair
    grid at every size) or None (by size: persistent for T * J <= 64); 'keep' leaves it. Graphs captured before
    are released."""
    from .kernels.indexer import TOPK_IMPLS

    if indexer_topk is not None and indexer_topk not in TOPK_IMPLS:
        raise ValueError(f"set_kernel_options: indexer_topk must be one of {TOPK_IMPLS}, got {indexer_topk!r}")
    if moe_layout not in ("pairs", None, "keep"):
        raise ValueError(f"set_kernel_options: moe_layout must be 'pairs' or None, got {moe_layout!r}")
    for mod in model.modules():
        if isinstance(mod, MLA) and indexer_topk is not None:
            mod.topk_impl = indexer_topk
        elif isinstance(mod, (MoE, ExpertParallelMoE)) and moe_layout != "keep":
            mod.expert_layout = moe_layout
    if isinstance(model, DeepseekV32):
        release(model)


def fuse_rows(linears: list[Linear]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One FP8 weight (and its block scales) holding the given linears' rows one after the other, for one
    GEMV/GEMM launch where several projections read the same input. Each linear's parameters are re-pointed at
    its rows of the stacked tensors, so no memory is added and the reference path reads the same bytes.
    Exact: output row n of the stacked product is row n of the part it came from (same activation quant,
    same 128-block scales), provided every part but the last has a multiple of 128 rows, so that no scale
    block straddles two parts; otherwise (and for non-FP8 or mismatched inputs) returns None."""
    if not all(lin.is_fp8 for lin in linears) or len({lin.in_features for lin in linears}) != 1:
        return None
    if any(lin.out_features % 128 for lin in linears[:-1]):
        return None
    w = torch.cat([lin.weight.data for lin in linears])
    s = torch.cat([lin.weight_scale_inv.data for lin in linears])
    r, b = 0, 0
    for lin in linears:
        n, nb = lin.out_features, lin.weight_scale_inv.shape[0]
        lin.weight = torch.nn.Parameter(w[r:r + n], requires_grad=False)
        lin.weight_scale_inv = torch.nn.Parameter(s[b:b + nb], requires_grad=False)
        r, b = r + n, b + nb
    return w, s


def _mm_out_fp32() -> bool:
    """torch.mm(bf16, bf16, out_dtype=float32) (cuBLAS, fp32 accumulate and output) exists on this build."""
    try:
        a = torch.ones(1, 8, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


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
    release(model)  # graphs captured on the fast path must not be replayed on the reference path
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
                       out_dtype=torch.float32, layout=moe.expert_layout)


def mla_forward_fast(mla: MLA, x_BTD, pos_BT, cos, sin, cache, S: int) -> torch.Tensor:
    """The whole MLA block of a decode / verify step on the kernels: the fused input projections
    (q_a | indexer wk | kv_a, then q_b | indexer wq_b), the FP8 cache write in one launch, the indexer top-k and
    absorbed attention over the cache, o_proj. Same formulas as `MLA.forward`'s absorbed path."""
    from .kernels.cache_write import cache_write
    from .kernels.fp8_gemm import fp8_linear

    B, T, _ = x_BTD.shape
    dt = x_BTD.dtype
    ix = mla.indexer
    Q, Dk, H, P, R = mla.q_a_proj.out_features, ix.head_dim, mla.H, mla.P, mla.R
    if mla.fused_a is not None:
        a = fp8_linear(x_BTD, *mla.fused_a)
        qa, k_idx, kv = a[..., :Q], a[..., Q:Q + Dk], a[..., Q + Dk:]
    else:
        qa, k_idx, kv = mla.q_a_proj(x_BTD), ix.wk(x_BTD), mla.kv_a_proj_with_mqa(x_BTD)
    qr = mla.q_a_layernorm(qa, dt)
    c = mla.kv_a_layernorm(kv[..., : mla.C], dt)
    k_pe = glue.rope_interleaved(kv[..., mla.C:], cos, sin)
    cache_write(cache, pos_BT, c, k_pe, ix._rotate(ix.k_norm(k_idx), cos, sin))
    if mla.fused_qb is not None:
        qq = fp8_linear(qr, *mla.fused_qb)
        q, iq = qq[..., : H * (P + R)], qq[..., H * (P + R):]
    else:
        q, iq = mla.q_b_proj(qr), ix.wq_b(qr)
    q = q.view(B, T, H, P + R)
    q_nope, q_pe = q[..., :P], glue.rope_interleaved(q[..., P:], cos, sin)
    iq = ix._rotate(iq.view(B, T, ix.n_heads, Dk), cos, sin)
    o = mla_attend_fast(mla, x_BTD, iq, q_nope, q_pe, cache, S, out_dtype=dt)
    return mla.o_proj(o.reshape(B, T, H * mla.V))


def mla_attend_fast(mla: MLA, x_BTD, iq_BTHD, q_nope, q_pe, cache, S: int,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Absorbed MLA over the FP8 cache with the indexer's top-k: returns o [B, T, H, V] in out_dtype.
    iq_BTHD: the indexer queries, rotated (`Indexer.queries`), before quantization."""
    from .kernels.indexer import indexer_topk
    from .kernels.mla_decode import mla_decode

    ix = mla.indexer
    q8, qs = glue.act_quant(iq_BTHD)  # qs [B, T, Hi, 1]
    if mla.w_idx_t is not None and x_BTD.dtype == torch.bfloat16:
        # bf16 x bf16 products are exact in fp32 and cuBLAS sums them in fp32: the reference's fp32 math
        x2 = x_BTD.reshape(-1, x_BTD.shape[-1])
        w = torch.mm(x2, mla.w_idx_t, out_dtype=torch.float32).mul_(ix.n_heads ** -0.5 * ix.head_dim ** -0.5)
        w = w.view(*x_BTD.shape[:-1], ix.n_heads)
    else:
        w = torch.nn.functional.linear(x_BTD.float(), mla.w_idx)  # fp32 copy, scaled by Hi^-0.5 * Dk^-0.5
    lens = cache.seq_lens  # keys before this block; query t sees < lens + t + 1
    topk_idx = None
    if ix.topk < S:
        topk_idx, _ = indexer_topk(q8, qs.squeeze(-1), w, cache.idx_k[:, :S], cache.idx_k_scale[:, :S], lens,
                                   topk=ix.topk, impl=mla.topk_impl)
    q_lat = torch.einsum("bthp,hpc->bthc", q_nope.to(torch.bfloat16), mla.w_kb).contiguous()
    o_lat = mla_decode(q_lat, q_pe.to(torch.bfloat16).contiguous(), cache.kv[:, :S], cache.kv_scale[:, :S],
                       cache.pe[:, :S], lens, mla.softmax_scale, topk_idx=topk_idx, out_dtype=torch.bfloat16)
    return torch.einsum("bthc,hvc->bthv", o_lat, mla.w_vb).to(out_dtype)
