"""Write a block's new tokens into one layer's FP8 KV cache in one launch (Triton).

Reference: `mtp.model.cache.LayerCache.write` (two act_quant calls and five index_put kernels, plus the index
tensors: ~8 launches per layer on a decode step, each a few microseconds of a ~1.5 ms step). Here one program
per token quantizes its latent c [C] per 128 channels and its indexer key [Dk] with one scale (ue8m0, the same
bit-exact helpers as `act_quant`), and stores them with the rotary key at (row b, position pos[b, t]).
Positions come from a device tensor, so the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from mtp.model.fp8 import BLOCK, FP8_DTYPE
from mtp.kernels._triton import pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl, triton
from mtp.kernels.act_quant import quant_e4m3, ue8m0_scale

__all__ = ["cache_write"]


@triton.jit
def _cache_write_kernel(c_ptr, pe_ptr, k_ptr, pos_ptr, kv_ptr, kvs_ptr, pec_ptr, ik_ptr, iks_ptr,
                        T, stride_c, stride_pe, stride_k, stride_pos_b, stride_pos_t,
                        sb_kv, ss_kv, sb_kvs, ss_kvs, sb_pe, ss_pe, sb_ik, ss_ik, sb_iks, ss_iks,
                        C: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the latent, keys and positions all come from earlier kernels
    n = tl.program_id(0)  # token n = b * T + t of the block
    b = n // T
    t = n - b * T
    pos = tl.load(pos_ptr + b * stride_pos_b + t * stride_pos_t).to(tl.int64)
    b64 = b.to(tl.int64)
    # latent: C // 128 groups, one ue8m0 scale each
    g = tl.arange(0, C // 128)
    j = tl.arange(0, 128)
    x = tl.load(c_ptr + n * stride_c + g[:, None] * 128 + j[None, :]).to(tl.float32)
    s, inv = ue8m0_scale(tl.max(tl.abs(x), axis=1))
    tl.store(kv_ptr + b64 * sb_kv + pos * ss_kv + g[:, None] * 128 + j[None, :], quant_e4m3(x, inv[:, None]))
    tl.store(kvs_ptr + b64 * sb_kvs + pos * ss_kvs + g, s)
    # indexer key: one group of DK channels
    d = tl.arange(0, DK)
    k = tl.load(k_ptr + n * stride_k + d).to(tl.float32)
    ks, kinv = ue8m0_scale(tl.max(tl.abs(k), axis=0))
    tl.store(ik_ptr + b64 * sb_ik + pos * ss_ik + d, quant_e4m3(k, kinv))
    tl.store(iks_ptr + b64 * sb_iks + pos * ss_iks, ks)
    # rotary key, stored in the cache's dtype
    r = tl.arange(0, R)
    pe = tl.load(pe_ptr + n * stride_pe + r)
    tl.store(pec_ptr + b64 * sb_pe + pos * ss_pe + r, pe.to(pec_ptr.dtype.element_ty))


def _rows(x: torch.Tensor, name: str, width: int, n: int) -> torch.Tensor:
    if x.shape[-1] != width or x.numel() != n * width:
        raise ValueError(f"cache_write: {name} must be [B, T, {width}] for {n} tokens, got {list(x.shape)}")
    x2 = x.reshape(n, width)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def cache_write(cache, pos_BT: torch.Tensor, c_BTC: torch.Tensor, pe_BTR: torch.Tensor, k_BTD: torch.Tensor,
                pdl: bool = False) -> None:
    """Kernel twin of `LayerCache.write` for a quantized (FP8) layer cache: same bytes in the same slots. pdl:
    programmatic dependent launch (`_triton.pdl_kwargs`)."""
    require(c_BTC, "cache_write")
    if not cache.quantized:
        raise ValueError("cache_write: the kernel writes the FP8 cache layout; this cache is not quantized")
    B, T = pos_BT.shape
    C, R, DK = cache.kv.shape[-1], cache.pe.shape[-1], cache.idx_k.shape[-1]
    if C % BLOCK or DK & (DK - 1) or R & (R - 1) or (C // BLOCK) & (C // BLOCK - 1):
        raise ValueError(f"cache_write: needs C a power-of-two multiple of {BLOCK}, R and Dk powers of two; "
                         f"got C={C}, R={R}, Dk={DK}")
    if cache.kv.dtype != FP8_DTYPE or cache.idx_k.dtype != FP8_DTYPE:
        raise ValueError(f"cache_write: cache buffers must be {FP8_DTYPE}, got {cache.kv.dtype} / {cache.idx_k.dtype}")
    n = B * T
    c, pe, k = _rows(c_BTC, "c", C, n), _rows(pe_BTR, "pe", R, n), _rows(k_BTD, "k", DK, n)
    kv, kvs, pec, ik, iks = cache.kv, cache.kv_scale, cache.pe, cache.idx_k, cache.idx_k_scale
    for t, name in ((kv, "kv"), (kvs, "kv_scale"), (pec, "pe"), (ik, "idx_k")):
        if t.stride(-1) != 1:
            raise ValueError(f"cache_write: cache.{name} must be contiguous in its last dim")
    launch = pdl_kwargs(pdl, c)
    _cache_write_kernel[(n,)](c, pe, k, pos_BT, kv, kvs, pec, ik, iks,
                              T, c.stride(0), pe.stride(0), k.stride(0), pos_BT.stride(0), pos_BT.stride(1),
                              kv.stride(0), kv.stride(1), kvs.stride(0), kvs.stride(1), pec.stride(0), pec.stride(1),
                              ik.stride(0), ik.stride(1), iks.stride(0), iks.stride(1),
                              C=C, R=R, DK=DK, PDL=pdl_mode(pdl, launch), num_warps=4, **launch)
