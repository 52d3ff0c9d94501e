"""Switch a loaded model between the plain-PyTorch reference and the Triton fast path, at run time.

`enable_fast_path(model)` (CUDA, fp8 numerics) routes
- every FP8 `Linear` through `kernels.fp8_gemm.fp8_linear` (weight-streaming GEMV for <= 64 rows, tiled GEMM above);
  the bf16 ones (lm_head, MTP heads, eh_proj) stay on torch, whose bf16 GEMV reads the 1.85 GB lm_head at the
  HBM floor on an H200 (0.442 ms vs 0.439 ms; a Triton GEMV we tried was slower: BENCHMARKS.md);
- every `MoE` through `kernels.moe.moe_route` + `moe_experts` (reads only the chosen experts; the expert-parallel
  MoE of `mtp.parallel` likewise over its rank's experts, skipping slots routed to other ranks). The experts'
  weights are restacked per projection into [E, N, K] tensors, and each expert's parameters become views of
  the stack, so memory is not doubled (peak: one projection of one layer);
- `MLA` blocks of <= absorb_max_tokens new tokens through the indexer kernel + top-k and `mla_decode` over the
  real-FP8 latent cache; kv_b_proj is dequantized once to bf16 for the absorbed q / output projections
  (DeepSeek's reference keeps the same dequantized copy). Longer blocks (prefill) stay on the reference path.
  The block runs in `mla_forward_fast`: q_a | indexer wk | kv_a and q_b | indexer wq_b as one GEMV each
  (`fuse_rows`), the cache write in one kernel (`kernels.cache_write`);
- dense MLPs and shared experts with gate and up stacked into one GEMV (`fuse_rows`);
- every decoder `Block` through `block_forward_fast` (an instance-level forward; the class's stays the
  reference): residual add + RMSNorm + FP8 quant in one kernel (`kernels.norm_quant`) whose quantized output
  feeds the next GEMV directly. The new kernels are switchable at run time (`kernels.dispatch.SWITCHES`).
`disable_fast_path(model)` switches back; the stacked expert tensors stay (they are the same weights).
Both paths compute DeepSeek's FP8 numerics; they differ only in summation order and top-k tie-breaking, and
tests hold one to the other within tolerance (tests/gpu).
"""

from __future__ import annotations

import types

import torch

from .attention import MLA
from .engine import release
from .layers import MLP, Linear, glue
from .model import Block, DeepseekV32
from .moe import MoE
from .parallel.modules import ExpertParallelMoE, ParallelMLP


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
    install_fast_modules(model, _mm_out_fp32())
    release(model)  # graphs `generate` kept were captured on the other path, some over re-pointed weights
    return model


def install_fast_modules(model: torch.nn.Module, mm_fp32: bool = False) -> None:
    """The module changes of `enable_fast_path` without its device checks (tests run them under the Triton
    interpreter on the CPU). mm_fp32: cuBLAS has bf16 x bf16 -> fp32 (`_mm_out_fp32`)."""
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
            mod.backend = "triton"
        elif isinstance(mod, ExpertParallelMoE):  # the rank's experts stacked; slots of other ranks' experts skipped
            mod.enable_fast_path()
        elif isinstance(mod, MLP) and id(mod) not in routed:  # dense MLPs and shared experts: gate and up as one
            mod.fused_gate_up = fuse_rows([mod.gate_proj, mod.up_proj])
        if isinstance(mod, Block):  # an instance attribute: Block.forward stays the reference
            mod.forward = types.MethodType(block_forward_fast, mod)


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
        if isinstance(mod, Block):
            mod.__dict__.pop("forward", None)
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
    from .kernels.dispatch import route
    from .kernels.moe import moe_experts

    w, idx = route(x_ND, moe.gate)
    s = moe.stacked
    return moe_experts(x_ND, idx, w, s["gate_proj.weight"], s["gate_proj.weight_scale_inv"], s["up_proj.weight"],
                       s["up_proj.weight_scale_inv"], s["down_proj.weight"], s["down_proj.weight_scale_inv"],
                       out_dtype=torch.float32)


def mla_forward_fast(mla: MLA, x_BTD, pos_BT, cos, sin, cache, S: int, xq=None) -> torch.Tensor:
    """The whole MLA block of a decode / verify step on the kernels: the fused input projections
    (q_a | indexer wk | kv_a, then q_b | indexer wq_b), the FP8 cache write in one launch, the indexer top-k and
    absorbed attention over the cache, o_proj. Same formulas as `MLA.forward`'s absorbed path.
    xq = (x8, sx): x_BTD already quantized per 128 (by the block's fused norm), fed to the first GEMV."""
    from .kernels.cache_write import cache_write
    from .kernels.dispatch import SWITCHES, linear
    from .kernels.mla_prologue import mla_kv_prologue, mla_q_prologue
    from .kernels.norm_quant import add_rms_norm_quant

    B, T, _ = x_BTD.shape
    dt = x_BTD.dtype
    ix = mla.indexer
    Q, Dk, H, P, R = mla.q_a_proj.out_features, ix.head_dim, mla.H, mla.P, mla.R
    if mla.fused_a is not None:
        a = linear(x_BTD, *mla.fused_a, xq=xq)
        qa, k_idx, kv = a[..., :Q], a[..., Q:Q + Dk], a[..., Q + Dk:]
    else:
        qa, k_idx, kv = mla.q_a_proj(x_BTD), ix.wk(x_BTD), mla.kv_a_proj_with_mqa(x_BTD)
    prologue = SWITCHES.prologue and mla.fused_a is not None and mla.fused_qb is not None
    if prologue:  # kv_a norm, rotary, indexer key and the cache write in one launch
        mla_kv_prologue(mla, cache, pos_BT, a, cos, sin)
    else:
        c = mla.kv_a_layernorm(kv[..., : mla.C], dt)
        k_pe = glue.rope_interleaved(kv[..., mla.C:], cos, sin)
        cache_write(cache, pos_BT, c, k_pe, ix._rotate(ix.k_norm(k_idx), cos, sin))
    if mla.fused_qb is not None and SWITCHES.norm_quant:  # the q_a norm + quant in one launch, y not stored
        n = mla.q_a_layernorm
        _, _, q8, qs = add_rms_norm_quant(qa, None, n.weight, n.eps, dt, store_y=False, pdl=SWITCHES.pdl)
        qq = linear(None, *mla.fused_qb, out_dtype=dt, xq=(q8, qs))
        q, iq = qq[..., : H * (P + R)], qq[..., H * (P + R):]
    elif mla.fused_qb is not None:
        qq = linear(mla.q_a_layernorm(qa, dt), *mla.fused_qb)
        q, iq = qq[..., : H * (P + R)], qq[..., H * (P + R):]
    else:
        qr = mla.q_a_layernorm(qa, dt)
        q, iq = mla.q_b_proj(qr), ix.wq_b(qr)
    q = q.view(B, T, H, P + R)
    if prologue:  # q_pe rotary and the indexer queries' rotary, Hadamard and quant in one launch
        q_pe, iq8, iqs = mla_q_prologue(mla, qq, cos, sin)
        o = mla_attend_fast(mla, x_BTD, None, q[..., :P], q_pe, cache, S, out_dtype=dt, iq_quant=(iq8, iqs))
        return mla.o_proj(o.reshape(B, T, H * mla.V))
    q_nope, q_pe = q[..., :P], glue.rope_interleaved(q[..., P:], cos, sin)
    iq = ix._rotate(iq.view(B, T, ix.n_heads, Dk), cos, sin)
    o = mla_attend_fast(mla, x_BTD, iq, q_nope, q_pe, cache, S, out_dtype=dt)
    return mla.o_proj(o.reshape(B, T, H * mla.V))


def mla_attend_fast(mla: MLA, x_BTD, iq_BTHD, q_nope, q_pe, cache, S: int,
                    out_dtype: torch.dtype = torch.float32, iq_quant=None) -> torch.Tensor:
    """Absorbed MLA over the FP8 cache with the indexer's top-k: returns o [B, T, H, V] in out_dtype.
    iq_BTHD: the indexer queries, rotated (`Indexer.queries`), before quantization; or iq_quant = (iq8, iqs
    [B, T, Hi, 1]) already quantized (`mla_prologue.mla_q_prologue`)."""
    from .kernels.absorb import MAX_TOKENS as ABSORB_MAX_TOKENS
    from .kernels.absorb import absorb_out, absorb_q
    from .kernels.dispatch import SWITCHES
    from .kernels.indexer import indexer_topk
    from .kernels.mla_decode import mla_decode

    ix = mla.indexer
    q8, qs = glue.act_quant(iq_BTHD) if iq_quant is None else iq_quant  # qs [B, T, Hi, 1]
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
                                   topk=ix.topk)
    absorb = SWITCHES.absorb and q_nope.shape[0] * q_nope.shape[1] <= ABSORB_MAX_TOKENS
    if absorb:  # one launch each instead of copy + batched GEMM + copy
        q_lat = absorb_q(q_nope, mla.w_kb)
    else:
        q_lat = torch.einsum("bthp,hpc->bthc", q_nope.to(torch.bfloat16), mla.w_kb).contiguous()
    o_lat = mla_decode(q_lat, q_pe.to(torch.bfloat16).contiguous(), cache.kv[:, :S], cache.kv_scale[:, :S],
                       cache.pe[:, :S], lens, mla.softmax_scale, topk_idx=topk_idx, out_dtype=torch.bfloat16)
    if absorb:
        return absorb_out(o_lat, mla.w_vb).to(out_dtype)
    return torch.einsum("bthc,hvc->bthv", o_lat, mla.w_vb).to(out_dtype)


def _absorbed_fast(mla: MLA, T: int, cache, opts) -> bool:
    """Whether `MLA.forward` would take `mla_forward_fast` for a block of T tokens (its condition, kept equal)."""
    naive = opts.attn_impl == "naive" or (opts.attn_impl == "auto" and T > opts.absorb_max_tokens)
    return mla.backend == "triton" and not naive and cache.quantized


def block_forward_fast(block: Block, h_BTD, pos_BT, cos, sin, cache, S: int, opts, dtype) -> torch.Tensor:
    """`Block.forward` with the norms fused (switch `norm_quant`): input norm + quant in one kernel, then the
    attention's residual add + post-attention norm + quant in one, each quantized output fed to the next FP8
    GEMV (q_a | wk | kv_a; the shared expert's gate | up). Same formulas as `Block.forward`."""
    from .kernels.dispatch import SWITCHES
    from .kernels.fp8_gemm import SMALL_M
    from .kernels.norm_quant import add_rms_norm_quant

    if not SWITCHES.norm_quant or h_BTD.dtype != torch.float32:
        return Block.forward(block, h_BTD, pos_BT, cos, sin, cache, S, opts, dtype)
    B, T, D = h_BTD.shape
    quant = B * T <= SMALL_M and D % 128 == 0
    n1, n2 = block.input_layernorm, block.post_attention_layernorm
    pdl = SWITCHES.pdl
    _, x, x8, sx = add_rms_norm_quant(h_BTD, None, n1.weight, n1.eps, dtype, quant=quant, pdl=pdl)
    attn = block.self_attn
    if _absorbed_fast(attn, T, cache, opts):
        a = mla_forward_fast(attn, x, pos_BT, cos, sin, cache, S, xq=(x8, sx) if quant else None)
    else:
        a = attn(x, pos_BT, cos, sin, cache, S, opts)
    h_BTD, x, x8, sx = add_rms_norm_quant(h_BTD, a, n2.weight, n2.eps, dtype, quant=quant, pdl=pdl)
    # one kernel: the add promotes the model-dtype FFN output to fp32 exactly (no separate cast launch)
    return h_BTD + ffn_forward_fast(block.mlp, x, (x8, sx) if quant else None)


def ffn_forward_fast(mlp, x: torch.Tensor, xq=None) -> torch.Tensor:
    """`mlp(x)` (dense MLP, MoE, or their per-rank versions) with x's quantized form xq = (x8, sx) fed to the
    gate | up GEMV of the dense MLP / shared expert. Same formulas as each module's forward."""
    shape = x.shape
    D = shape[-1]
    x_ND = x.reshape(-1, D)
    xq_ND = None if xq is None else (xq[0].reshape(-1, D), xq[1].reshape(-1, D // 128))
    N = x_ND.shape[0]
    if isinstance(mlp, ExpertParallelMoE) and mlp.backend == "triton" and N <= 64:  # as its forward
        out = mlp._routed_fast(x_ND)
        if mlp.shared_experts is not None:
            out += _mlp_fast(mlp.shared_experts, x_ND, xq_ND, torch.float32)
        return mlp.comm.all_reduce(out).to(x.dtype).view(shape)
    if isinstance(mlp, MoE) and mlp.backend == "triton" and N <= 64:  # as MoE.forward
        out = moe_forward_fast(mlp, x_ND)
        if mlp.shared_experts is not None:
            out = out + _mlp_fast(mlp.shared_experts, x_ND, xq_ND, x.dtype).float()
        return out.to(x.dtype).view(shape)
    if type(mlp) is ParallelMLP and mlp.fused_gate_up is not None and mlp.gate_proj.out_features:
        return mlp.comm.all_reduce(_mlp_fast(mlp, x_ND, xq_ND, torch.float32)).to(x.dtype).view(shape)
    if type(mlp) is MLP and mlp.fused_gate_up is not None and mlp.gate_proj.backend == "triton":
        return _mlp_fast(mlp, x_ND, xq_ND, x.dtype).view(shape)
    return mlp(x)


def _mlp_fast(mlp: MLP, x_ND, xq_ND, out_dtype: torch.dtype) -> torch.Tensor:
    """down(silu(gate x) * up x) with gate | up as one GEMV on the quantized x, the output in out_dtype
    (x's dtype as `MLP.forward`; fp32 as `ParallelMLP.partial`)."""
    from .kernels.dispatch import linear

    if mlp.gate_proj.out_features == 0:  # a rank without a block of this MLP ('blocks' split)
        return x_ND.new_zeros((x_ND.shape[0], mlp.down_proj.out_features), dtype=out_dtype)
    gu = linear(x_ND, *mlp.fused_gate_up, xq=xq_ND)
    i = mlp.gate_proj.out_features
    h = glue.silu_mul(gu[..., :i], gu[..., i:], x_ND.dtype)
    return linear(h, mlp.down_proj.weight, mlp.down_proj.weight_scale_inv, out_dtype=out_dtype)
