"""Switch a loaded model between the plain-PyTorch reference and the Triton fast path, at run time.

`enable_fast_path(model)` (CUDA, fp8 numerics) routes
- every FP8 `Linear` through `kernels.fp8_gemm.fp8_linear` (weight-streaming GEMV for <= 64 rows, tiled GEMM above);
  the bf16 ones (lm_head, MTP heads, eh_proj) stay on torch, whose bf16 GEMV reads the 1.85 GB lm_head at the
  HBM floor on an H200 (0.442 ms vs 0.439 ms; a Triton GEMV we tried was slower: BENCHMARKS.md);
- every `MoE` through `kernels.moe.moe_route` + `moe_experts` (reads only the chosen experts; the expert-parallel
  MoE of `mtp.parallel` likewise over its rank's experts [e0, e1), skipping slots routed to other ranks). The experts'
  weights are restacked per projection into [E, N, K] tensors, and each expert's parameters become views of
  the stack, so memory is not doubled (peak: one projection of one layer);
- `MLA` blocks of <= absorb_max_tokens new tokens through the indexer kernel + top-k (`kernels.topk` radix
  select, or torch.topk: `FastMLA.topk_impl`, `set_kernel_options`) and `mla_decode` over the
  real-FP8 latent cache; kv_b_proj is dequantized once to bf16 for the absorbed q / output projections
  (DeepSeek's reference keeps the same dequantized copy). Longer blocks (prefill) stay on the reference path.
  The block runs in `mla_forward_fast`: q_a | indexer wk | kv_a and q_b | indexer wq_b as one GEMV each
  (`fuse_rows`), the cache write in one kernel (`kernels.cache_write`);
- dense MLPs and shared experts with gate and up stacked into one GEMV (`fuse_rows`).
A module swap, as `mtp.parallel.modules.shard_model` swaps in the per-rank modules: each module's class becomes
a fast subclass of its own class (`FastLinear`, `FastMLP`, `FastMoE`, `FastMLA` over `Linear`, `MLP`, `MoE`,
`MLA`, and over their tensor-parallel subclasses, so a sharded model gets the kernels too), holding the same
parameters; the reference modules know nothing of it. `disable_fast_path(model)` swaps the reference classes
back; the stacked expert tensors stay (they are the same weights). Both bump `model.version`, so CUDA graphs
captured on the other path are never replayed.
Both paths compute DeepSeek's FP8 numerics; they differ only in summation order and top-k tie-breaking, and
tests hold one to the other within tolerance (tests/gpu).
"""

from __future__ import annotations

import torch

from ..kernels import available
from ..kernels.cache_write import cache_write
from ..kernels.fp8_gemm import fp8_linear
from ..kernels.indexer import TOPK_IMPLS, indexer_topk
from ..kernels.mla_decode import mla_decode
from ..kernels.moe import MAX_TOKENS as MOE_KERNEL_MAX_TOKENS
from ..kernels.moe import moe_experts, moe_route
from ..model.attention import MLA
from ..model.deepseek import DeepseekV32
from ..model.fp8 import acc_dtype
from ..model.layers import MLP, Linear, glue
from ..model.moe import MoE


class FastLinear(Linear):
    """FP8 weights through `fp8_linear` (weight-streaming GEMV for <= 64 rows, tiled GEMM above)."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv)

    def matmul_acc(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_features == 0:
            return super().matmul_acc(x)
        return fp8_linear(x, self.weight, self.weight_scale_inv, out_dtype=acc_dtype(x.dtype))


class FastMLP(MLP):
    """Dense MLP / shared expert with gate and up as one GEMV (`fused_gate_up`, when `fuse_rows` could stack them)."""

    fused_gate_up: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is None:
            return super().forward(x)
        gu = fp8_linear(x, *self.fused_gate_up)
        i = self.gate_proj.out_features
        return self.down_proj(glue.silu_mul(gu[..., :i], gu[..., i:], x.dtype))


class FastMoE(MoE):
    """Routed experts [e0, e1) through `moe_route` + `moe_experts` on the stacked experts (`stack_experts`):
    reads only the chosen experts, no host sync, capturable; ids outside [e0, e1) (other ranks' experts) are
    -1 slots, which the kernel skips.

    expert_layout (`kernels.moe.moe_experts`' layout): 'pairs' or None (by size: persistent for T * J <= 64).
    A whole MoE picks 8 of its own experts per token, which the pair grid already spreads over the GPU (79-94%
    of copy bandwidth), so it keeps 'pairs'; one rank's range of an expert-parallel MoE gets None from
    `fast_module` (its few active experts are what the persistent layout is for). `set_kernel_options` switches."""

    stacked: dict[str, torch.Tensor] | None = None
    expert_layout: str | None = "pairs"

    def routed(self, x_ND: torch.Tensor) -> torch.Tensor:
        if x_ND.shape[0] > MOE_KERNEL_MAX_TOKENS:
            return super().routed(x_ND)
        g = self.gate
        w_NK, ids_NK = moe_route(x_ND, g.weight, g.e_score_correction_bias, n_group=g.n_groups,
                                 topk_group=g.topk_groups, topk=g.topk, route_scale=g.route_scale)
        if (self.e0, self.e1) != (0, g.n_experts):
            local_NK = ids_NK - self.e0
            ids_NK = torch.where((local_NK >= 0) & (local_NK < self.e1 - self.e0), local_NK, -1)  # -1: skipped
        s = self.stacked
        return moe_experts(x_ND, ids_NK, w_NK, s["gate_proj.weight"], s["gate_proj.weight_scale_inv"],
                           s["up_proj.weight"], s["up_proj.weight_scale_inv"], s["down_proj.weight"],
                           s["down_proj.weight_scale_inv"], out_dtype=torch.float32, layout=self.expert_layout)


class FastMLA(MLA):
    """Absorbed blocks (decode / verify) over the FP8 cache on the kernels (`mla_forward_fast`); the naive path
    (prefill), an unquantized cache and a tree verify's mask (no kernel takes one yet) keep the reference forward."""

    fused_a = fused_qb = None  # stacked FP8 weights of the projections that read one input (`fuse_rows`)
    topk_impl = "radix"  # the indexer's top-k (`kernels.indexer.TOPK_IMPLS`): enable_fast_path / set_kernel_options

    def forward(self, x_BTD, pos_BT, cos, sin, cache, S: int, opts, visible_BTS=None) -> torch.Tensor:
        if self.naive(x_BTD.shape[1], opts) or not cache.quantized or visible_BTS is not None:
            return super().forward(x_BTD, pos_BT, cos, sin, cache, S, opts, visible_BTS)
        return mla_forward_fast(self, x_BTD, pos_BT, cos, sin, cache, S)


FAST_CLASSES = (FastLinear, FastMLP, FastMoE, FastMLA)
_combined: dict[tuple[type, type], type] = {}


def _swap(mod: torch.nn.Module, fast: type) -> None:
    """Make `mod` an instance of `fast` over its own class (a subclass such as RowParallelLinear keeps its
    forward and gets the fast `matmul`). Parameters, buffers and names are untouched."""
    cls = type(mod)
    if isinstance(mod, fast):
        return
    if cls is fast.__base__:
        mod.__class__ = fast
        return
    if (fast, cls) not in _combined:
        _combined[(fast, cls)] = type(f"{fast.__name__[:4]}{cls.__name__}", (fast, cls), {})
    mod.__class__ = _combined[(fast, cls)]


def reference_class(cls: type) -> type:
    """The class a fast module swaps back to (its class without the fast mix-in)."""
    if cls in FAST_CLASSES:
        return cls.__base__
    for fast in FAST_CLASSES:
        if issubclass(cls, fast):
            return next(b for b in cls.__bases__ if b is not fast)
    return cls


def fast_module(mod: torch.nn.Module, mm_fp32: bool = False) -> None:
    """Swap one module to its fast class and prepare what the kernels read (stacked experts, fused projections,
    dequantized attention weights). Modules without a fast version are left alone."""
    if isinstance(mod, Linear) and mod.is_fp8:
        _swap(mod, FastLinear)
    elif isinstance(mod, MoE):
        stack_experts(mod)
        _swap(mod, FastMoE)
        # the default on every enable: one rank's few active experts take the persistent layout (by size)
        mod.expert_layout = "pairs" if (mod.e0, mod.e1) == (0, mod.gate.n_experts) else None
    elif isinstance(mod, MLA) and _mla_kernel_fits(mod):
        w = mod.kv_b_proj.dequantized_weight(torch.bfloat16).view(mod.H, mod.P + mod.V, mod.C)
        mod.w_kb = w[:, : mod.P].contiguous()  # [H, P, C]
        mod.w_vb = w[:, mod.P:].contiguous()  # [H, V, C]
        ix = mod.indexer
        mod.w_idx = ix.weights_proj.weight.float() * (ix.n_heads ** -0.5 * ix.head_dim ** -0.5)
        mod.w_idx_t = (ix.weights_proj.weight.t().contiguous()
                       if ix.weights_proj.weight.dtype == torch.bfloat16 and mm_fp32 else None)
        _swap(mod, FastMLA)
        # the projections that read the same input, as one weight each (one launch instead of 3 and 2)
        mod.fused_a = fuse_rows([mod.q_a_proj, ix.wk, mod.kv_a_proj_with_mqa])
        mod.fused_qb = fuse_rows([mod.q_b_proj, ix.wq_b])
    elif type(mod) is MLP:  # dense MLPs and shared experts (callers skip routed experts): gate and up as one
        _swap(mod, FastMLP)
        mod.fused_gate_up = fuse_rows([mod.gate_proj, mod.up_proj])


def enable_fast_path(model: DeepseekV32, compile_glue: bool = True, indexer_topk: str = "radix") -> DeepseekV32:
    """compile_glue: torch.compile the elementwise glue (mtp.model.layers.Glue) into fused kernels.
    indexer_topk: the indexer's top-k, 'radix' (Triton radix select, the reference's tie rule), 'radix_fused'
    (its histogram pass in the scores kernel) or 'torch' (torch.topk); switch it and the MoE expert layout
    later with `set_kernel_options`."""
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
    routed = {id(mod.expert(e)) for mod in model.modules() if isinstance(mod, MoE) for e in range(mod.e0, mod.e1)}
    for mod in list(model.modules()):
        if id(mod) not in routed:  # routed experts are read through their MoE's stack
            fast_module(mod, mm_fp32)
    # the options, and model.version bumped: graphs captured on the reference path must not be replayed
    set_kernel_options(model, indexer_topk=indexer_topk)
    return model


def set_kernel_options(model: torch.nn.Module, indexer_topk: str | None = None,
                       moe_layout: str | None = "keep") -> None:
    """Switch kernel variants of a fast-path model, so that old and new can be timed side by side:
    indexer_topk 'radix' | 'radix_fused' | 'torch' (every FastMLA; None keeps it); moe_layout for every
    FastMoE's expert kernels: 'pairs' (the pair grid at every size) or None (by size: persistent for
    T * J <= 64); 'keep' leaves it. Modules on the reference path are left alone. Bumps `model.version`, so
    CUDA graphs captured before are not replayed."""
    if indexer_topk is not None and indexer_topk not in TOPK_IMPLS:
        raise ValueError(f"set_kernel_options: indexer_topk must be one of {TOPK_IMPLS}, got {indexer_topk!r}")
    if moe_layout not in ("pairs", None, "keep"):
        raise ValueError(f"set_kernel_options: moe_layout must be 'pairs' or None, got {moe_layout!r}")
    for mod in model.modules():
        if isinstance(mod, FastMLA) and indexer_topk is not None:
            mod.topk_impl = indexer_topk
        elif isinstance(mod, FastMoE) and moe_layout != "keep":
            mod.expert_layout = moe_layout
    if isinstance(model, DeepseekV32):
        model.version += 1


def disable_fast_path(model: torch.nn.Module) -> torch.nn.Module:
    """Swap the reference classes back on `model` (a whole model or one module) and reset the glue."""
    for mod in model.modules():
        mod.__class__ = reference_class(type(mod))
    glue.reset()
    if isinstance(model, DeepseekV32):
        model.version += 1  # graphs captured on the fast path must not be replayed
    return model


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


def stack_experts(moe: MoE) -> None:
    """Stack experts [e0, e1) per projection into [E_local, N, K] weights / scales (local index e - e0) for
    `moe_experts`, and re-point each expert's parameters at its slice: memory is not doubled (peak: one
    projection of one layer), names and `state_dict` are unchanged. Idempotent; FP8 experts only."""
    if getattr(moe, "stacked", None) is not None:
        return
    experts = [moe.expert(e) for e in range(moe.e0, moe.e1)]
    if not all(getattr(ex, p).is_fp8 for ex in experts for p in ("gate_proj", "up_proj", "down_proj")):
        raise ValueError("stack_experts: the Triton expert kernels need FP8 experts")
    stacked = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for attr in ("weight", "weight_scale_inv"):
            parts = [getattr(ex, proj) for ex in experts]
            big = torch.stack([getattr(p, attr).data for p in parts])
            for i, p in enumerate(parts):  # re-point each expert at its slice; the old tensor is freed
                setattr(p, attr, torch.nn.Parameter(big[i], requires_grad=False))
            stacked[f"{proj}.{attr}"] = big
    moe.stacked = stacked


def mla_forward_fast(mla: MLA, x_BTD, pos_BT, cos, sin, cache, S: int) -> torch.Tensor:
    """The whole MLA block of a decode / verify step on the kernels: the fused input projections
    (q_a | indexer wk | kv_a, then q_b | indexer wq_b), the FP8 cache write in one launch, the indexer top-k and
    absorbed attention over the cache, o_proj. Same formulas as `MLA.forward`'s absorbed path."""
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
