"""The MLA prologue of a decode step in two launches (Triton): everything between the fused input GEMVs and
the attention kernels.

Reference: `mla_kv_prologue_ref` / `mla_q_prologue_ref`, the unfused steps of `fast_path.mla_forward_fast`
(`mtp.model.layers` norms and rotary, `Indexer.rotate`, `LayerCache.write`, `fp8.act_quant`). Shape legend: n = B*T
tokens, Q q_lora, Dk indexer head dim (128: one quant block, one Hadamard), C kv_lora (512), R rope dims (64),
H heads, P nope dims, Hi indexer heads.

Today these are ~12 launches per layer, each a few microseconds on a CUDA-graph step: kv_a RMSNorm, k_pe rotary,
indexer-key LayerNorm, half rotary, cat, Hadamard, cache write; q_pe rotary + contiguous copy, indexer-query
half rotary, cat, Hadamard, act_quant. Here:
- `mla_kv_prologue` (one program per token) reads the token's row of the q_a | wk | kv_a output and writes
  the FP8 latent + scales, the rotary key and the FP8 indexer key + scale into the cache slot (the bytes
  `LayerCache.write` writes);
- `mla_q_prologue` (one program per token and head) reads the q_b | wq_b output and writes q_pe (rotated,
  contiguous) and the FP8 indexer queries + per-head scales (what `act_quant` gives `indexer_topk`).
Each step rounds to the model dtype where the reference does (bf16 after the norm, after the rotary, after the
Hadamard), so the results differ from the reference only where fp32 summation order or FMA contraction moves
a value across a bf16 rounding boundary (then one FP8 code may move by one). The Hadamard transform is a sum
over a +-1 sign matrix built in registers (sign = parity of popcount(i & j)), times 128^-0.5 as the reference.
Predicted: ~10 launches fewer per layer, ~15-20 us per layer on the TP=8 rank step.
"""

from __future__ import annotations

import torch

from mtp.model.fp8 import FP8_DTYPE
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.kernels._triton import pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl, triton
from mtp.kernels.act_quant import quant_e4m3, ue8m0_scale

__all__ = ["mla_kv_prologue", "mla_kv_prologue_ref", "mla_q_prologue", "mla_q_prologue_ref"]


# ----------------------------------------------------------------------------- references
def mla_kv_prologue_ref(mla, cache, pos_BT, a_BTX, cos, sin) -> None:
    """The unfused kv side of `mla_forward_fast`: kv_a norm, k_pe rotary, indexer key, `LayerCache.write`."""
    ix = mla.indexer
    Q, Dk, C = mla.q_a_proj.out_features, ix.head_dim, mla.C
    k_idx, kv = a_BTX[..., Q:Q + Dk], a_BTX[..., Q + Dk:]
    c = mla.kv_a_layernorm(kv[..., :C], a_BTX.dtype)
    k_pe = mla.ops.rope_interleaved(kv[..., C:], cos, sin)
    cache.write(pos_BT, c, k_pe, ix.rotate(ix.k_norm(k_idx), cos, sin), mla.ops)


def mla_q_prologue_ref(mla, qq_BTX, cos, sin):
    """The unfused q side: (q_pe [B, T, H, R] rotated, iq8 [B, T, Hi, Dk] fp8, iqs [B, T, Hi, 1] fp32)."""
    ix = mla.indexer
    B, T, _ = qq_BTX.shape
    H, P, R = mla.H, mla.P, mla.R
    q = qq_BTX[..., :H * (P + R)].view(B, T, H, P + R)
    q_pe = mla.ops.rope_interleaved(q[..., P:], cos, sin)
    iq = ix.rotate(qq_BTX[..., H * (P + R):].view(B, T, ix.n_heads, ix.head_dim), cos, sin)
    iq8, iqs = act_quant_ref(iq)
    return q_pe, iq8, iqs


# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def _hadamard(r, DK: tl.constexpr, HSCALE: tl.constexpr):
    """r [DK] fp32 -> (r @ H_DK) * HSCALE (= DK^-0.5, as the reference's fp32 multiply) with H the Sylvester
    matrix: H[i, j] = (-1)^popcount(i & j) (parity by xor-folding; DK <= 128)."""
    i = tl.arange(0, DK)
    x = i[:, None] & i[None, :]
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    sign = 1.0 - 2.0 * (x & 1).to(tl.float32)
    return tl.sum(r[:, None] * sign, axis=0) * HSCALE


@triton.jit
def _rotate_index(v, vp, d, cs, sn, RH: tl.constexpr):
    """Half-split rotary on the first 2 RH channels: out[d] = v[d] cos - v[d+RH] sin (d < RH),
    v[d-RH] sin + v[d] cos (RH <= d < 2 RH), v[d] above; vp = v at the partner channel."""
    return tl.where(d < RH, v * cs - vp * sn, tl.where(d < 2 * RH, vp * sn + v * cs, v))


# ----------------------------------------------------------------------------- kv side
@triton.jit
def _kv_prologue_kernel(a_ptr, pos_ptr, cos_ptr, sin_ptr, wkv_ptr, kw_ptr, kb_ptr,
                        kv_ptr, kvs_ptr, pec_ptr, ik_ptr, iks_ptr,
                        T, stride_a, stride_pos_b, stride_pos_t, stride_cs, eps_kv, eps_k,
                        sb_kv, ss_kv, sb_kvs, ss_kvs, sb_pe, ss_pe, sb_ik, ss_ik, sb_iks, ss_iks,
                        Q: tl.constexpr, DK: tl.constexpr, C: tl.constexpr, R: tl.constexpr, HSCALE: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the GEMV's output, positions, cos / sin: earlier kernels'
    _kv_prologue_token(tl.program_id(0), a_ptr, pos_ptr, cos_ptr, sin_ptr, wkv_ptr, kw_ptr, kb_ptr,
                       kv_ptr, kvs_ptr, pec_ptr, ik_ptr, iks_ptr,
                       T, stride_a, stride_pos_b, stride_pos_t, stride_cs, eps_kv, eps_k,
                       sb_kv, ss_kv, sb_kvs, ss_kvs, sb_pe, ss_pe, sb_ik, ss_ik, sb_iks, ss_iks, Q, DK, C, R, HSCALE)


@triton.jit
def _kv_prologue_token(n, a_ptr, pos_ptr, cos_ptr, sin_ptr, wkv_ptr, kw_ptr, kb_ptr,
                       kv_ptr, kvs_ptr, pec_ptr, ik_ptr, iks_ptr,
                       T, stride_a, stride_pos_b, stride_pos_t, stride_cs, eps_kv, eps_k,
                       sb_kv, ss_kv, sb_kvs, ss_kvs, sb_pe, ss_pe, sb_ik, ss_ik, sb_iks, ss_iks,
                       Q: tl.constexpr, DK: tl.constexpr, C: tl.constexpr, R: tl.constexpr, HSCALE: tl.constexpr):
    """Token n (of B*T) of `_kv_prologue_kernel`; also `mla_prologue_fused`'s kv programs (the same code): its
    latent + rotary key, then its indexer key, in one program."""
    b64, pos, row, cos_row, sin_row = _kv_token(n, a_ptr, pos_ptr, cos_ptr, sin_ptr, T, stride_a, stride_pos_b,
                                                stride_pos_t, stride_cs)
    dt = a_ptr.dtype.element_ty
    _kv_latent(row, cos_row, sin_row, b64, pos, dt, wkv_ptr, kv_ptr, kvs_ptr, pec_ptr, eps_kv, sb_kv, ss_kv,
               sb_kvs, ss_kvs, sb_pe, ss_pe, Q, DK, C, R)
    _kv_index_key(row, cos_row, sin_row, b64, pos, dt, kw_ptr, kb_ptr, ik_ptr, iks_ptr, eps_k, sb_ik, ss_ik,
                  sb_iks, ss_iks, Q, DK, R, HSCALE)


@triton.jit
def _kv_token_part(n, PART: tl.constexpr, a_ptr, pos_ptr, cos_ptr, sin_ptr, wkv_ptr, kw_ptr, kb_ptr,
                   kv_ptr, kvs_ptr, pec_ptr, ik_ptr, iks_ptr,
                   T, stride_a, stride_pos_b, stride_pos_t, stride_cs, eps_kv, eps_k,
                   sb_kv, ss_kv, sb_kvs, ss_kvs, sb_pe, ss_pe, sb_ik, ss_ik, sb_iks, ss_iks,
                   Q: tl.constexpr, DK: tl.constexpr, C: tl.constexpr, R: tl.constexpr, HSCALE: tl.constexpr):
    """One of token n's two independent jobs of `_kv_prologue_token`: PART 0 its latent (RMSNorm, FP8 into the
    cache) and rotary key, PART 1 its indexer key (LayerNorm, half rotary, Hadamard, FP8). They read only the
    token's kv_a row and write apart, so `mla_prologue_fused`'s kv_split runs them as two programs (their dependent
    chains side by side; the same code, the same bits)."""
    b64, pos, row, cos_row, sin_row = _kv_token(n, a_ptr, pos_ptr, cos_ptr, sin_ptr, T, stride_a, stride_pos_b,
                                                stride_pos_t, stride_cs)
    dt = a_ptr.dtype.element_ty
    if PART == 0:
        _kv_latent(row, cos_row, sin_row, b64, pos, dt, wkv_ptr, kv_ptr, kvs_ptr, pec_ptr, eps_kv, sb_kv, ss_kv,
                   sb_kvs, ss_kvs, sb_pe, ss_pe, Q, DK, C, R)
    else:
        _kv_index_key(row, cos_row, sin_row, b64, pos, dt, kw_ptr, kb_ptr, ik_ptr, iks_ptr, eps_k, sb_ik, ss_ik,
                      sb_iks, ss_iks, Q, DK, R, HSCALE)


@triton.jit
def _kv_token(n, a_ptr, pos_ptr, cos_ptr, sin_ptr, T, stride_a, stride_pos_b, stride_pos_t, stride_cs):
    """Token n's batch row (int64), cache position, kv_a row and rotary rows."""
    b = n // T
    t = n - b * T
    pos = tl.load(pos_ptr + b * stride_pos_b + t * stride_pos_t).to(tl.int64)
    b64 = b.to(tl.int64)
    row = a_ptr + n.to(tl.int64) * stride_a
    return b64, pos, row, cos_ptr + n * stride_cs, sin_ptr + n * stride_cs


@triton.jit
def _kv_latent(row, cos_row, sin_row, b64, pos, dt, wkv_ptr, kv_ptr, kvs_ptr, pec_ptr, eps_kv, sb_kv, ss_kv,
               sb_kvs, ss_kvs, sb_pe, ss_pe, Q: tl.constexpr, DK: tl.constexpr, C: tl.constexpr, R: tl.constexpr):
    """`_kv_token_part` 0: the latent and the rotary key of one token into the cache."""
    # latent: RMSNorm (fp32, rounded to the model dtype), then FP8 per 128 into the cache
    g = tl.arange(0, C // 128)
    j = tl.arange(0, 128)
    x = tl.load(row + Q + DK + g[:, None] * 128 + j[None, :]).to(tl.float32)
    ms = tl.sum(tl.sum(x * x, axis=1), axis=0) / C
    w = tl.load(wkv_ptr + g[:, None] * 128 + j[None, :]).to(tl.float32)
    c = (x * tl.math.rsqrt(ms + eps_kv) * w).to(dt).to(tl.float32)
    s, inv = ue8m0_scale(tl.max(tl.abs(c), axis=1))
    tl.store(kv_ptr + b64 * sb_kv + pos * ss_kv + g[:, None] * 128 + j[None, :], quant_e4m3(c, inv[:, None]))
    tl.store(kvs_ptr + b64 * sb_kvs + pos * ss_kvs + g, s)
    # rotary key: interleaved pairs (x[2i], x[2i+1])
    i = tl.arange(0, R // 2)
    x0 = tl.load(row + Q + DK + C + 2 * i).to(tl.float32)
    x1 = tl.load(row + Q + DK + C + 2 * i + 1).to(tl.float32)
    cs = tl.load(cos_row + i)
    sn = tl.load(sin_row + i)
    pe_dt = pec_ptr.dtype.element_ty
    pe_base = pec_ptr + b64 * sb_pe + pos * ss_pe
    tl.store(pe_base + 2 * i, (x0 * cs - x1 * sn).to(dt).to(pe_dt))
    tl.store(pe_base + 2 * i + 1, (x0 * sn + x1 * cs).to(dt).to(pe_dt))


@triton.jit
def _kv_index_key(row, cos_row, sin_row, b64, pos, dt, kw_ptr, kb_ptr, ik_ptr, iks_ptr, eps_k, sb_ik, ss_ik, sb_iks,
                  ss_iks, Q: tl.constexpr, DK: tl.constexpr, R: tl.constexpr, HSCALE: tl.constexpr):
    """`_kv_token_part` 1: the indexer key of one token into its cache."""
    # indexer key: LayerNorm (fp32 -> model dtype), half rotary on the first R channels, Hadamard, FP8
    d = tl.arange(0, DK)
    RH: tl.constexpr = R // 2
    p = tl.where(d < RH, d + RH, tl.where(d < 2 * RH, d - RH, d))
    k = tl.load(row + Q + d).to(tl.float32)
    mean = tl.sum(k, axis=0) / DK
    var = tl.sum((k - mean) * (k - mean), axis=0) / DK
    rstd = tl.math.rsqrt(var + eps_k)
    kn = ((k - mean) * rstd * tl.load(kw_ptr + d) + tl.load(kb_ptr + d)).to(dt).to(tl.float32)
    kp = tl.load(row + Q + p).to(tl.float32)
    knp = ((kp - mean) * rstd * tl.load(kw_ptr + p) + tl.load(kb_ptr + p)).to(dt).to(tl.float32)
    ck = tl.load(cos_row + (d % RH), mask=d < 2 * RH, other=1.0)
    sk = tl.load(sin_row + (d % RH), mask=d < 2 * RH, other=0.0)
    r = _rotate_index(kn, knp, d, ck, sk, RH).to(dt).to(tl.float32)
    kh = _hadamard(r, DK, HSCALE).to(dt).to(tl.float32)
    ks, kinv = ue8m0_scale(tl.max(tl.abs(kh), axis=0))
    tl.store(ik_ptr + b64 * sb_ik + pos * ss_ik + d, quant_e4m3(kh, kinv))
    tl.store(iks_ptr + b64 * sb_iks + pos * ss_iks, ks)


def _check_mla(mla, cache=None):
    ix = mla.indexer
    if ix.head_dim != 128 or mla.R != ix.rope_dim or mla.R % 2 or mla.C % 128 or (mla.C // 128) & (mla.C // 128 - 1):
        raise ValueError(f"mla prologue kernels: need indexer head dim 128 and rope dims {mla.R} = the indexer's "
                         f"{ix.rope_dim}, C a power-of-two multiple of 128; got Dk={ix.head_dim}, C={mla.C}")
    if cache is not None and not cache.quantized:
        raise ValueError("mla_kv_prologue: the kernel writes the FP8 cache layout; this cache is not quantized")


def _token_rows(x_BTX: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x as [B*T, X] rows with unit last stride, cos / sin as contiguous [B*T, R/2]."""
    n = x_BTX.shape[0] * x_BTX.shape[1]
    x = x_BTX.reshape(n, x_BTX.shape[-1])
    return (x if x.stride(-1) == 1 else x.contiguous(), cos.reshape(n, -1).contiguous(),
            sin.reshape(n, -1).contiguous())


def mla_kv_prologue(mla, cache, pos_BT: torch.Tensor, a_BTX: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, pdl: bool = False) -> None:
    """Kernel twin of `mla_kv_prologue_ref`: a_BTX [B, T, Q + Dk + C + R] the q_a | wk | kv_a output (model
    dtype); cos / sin [B, T, R/2] fp32. Writes the cache slots at pos_BT in one launch. pdl: programmatic
    dependent launch (`_triton.pdl_kwargs`)."""
    a, args, consts = kv_prologue_args(mla, cache, pos_BT, a_BTX, cos, sin, "mla_kv_prologue")
    launch = pdl_kwargs(pdl, a)
    _kv_prologue_kernel[(a.shape[0],)](*args, **consts, PDL=pdl_mode(pdl, launch), num_warps=4, **launch)


def kv_prologue_args(mla, cache, pos_BT, a_BTX, cos, sin, name: str):
    """(a as [B*T, X] rows, the runtime arguments of `_kv_prologue_token` after n, its constexprs), checked:
    what `mla_kv_prologue` launches, and `mla_prologue_fused` with the same values."""
    require(a_BTX, name)
    _check_mla(mla, cache)
    ix = mla.indexer
    B, T, X = a_BTX.shape
    Q, DK, C, R = mla.q_a_proj.out_features, ix.head_dim, mla.C, mla.R
    if X != Q + DK + C + R or tuple(pos_BT.shape) != (B, T) or tuple(cos.shape) != (B, T, R // 2):
        raise ValueError(f"{name}: a must be [B, T, {Q + DK + C + R}], pos [B, T], cos [B, T, {R // 2}]; "
                         f"got {list(a_BTX.shape)}, {list(pos_BT.shape)}, {list(cos.shape)}")
    a, cs, sn = _token_rows(a_BTX, cos, sin)
    kv, kvs, pec, ik, iks = cache.kv, cache.kv_scale, cache.pe, cache.idx_k, cache.idx_k_scale
    if kv.dtype != FP8_DTYPE or ik.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: cache buffers must be {FP8_DTYPE}, got {kv.dtype} / {ik.dtype}")
    n_kv, k_n = mla.kv_a_layernorm, ix.k_norm
    args = (a, pos_BT, cs, sn, n_kv.weight, k_n.weight, k_n.bias, kv, kvs, pec, ik, iks,
            T, a.stride(0), pos_BT.stride(0), pos_BT.stride(1), cs.stride(0), n_kv.eps, k_n.eps,
            kv.stride(0), kv.stride(1), kvs.stride(0), kvs.stride(1), pec.stride(0),
            pec.stride(1), ik.stride(0), ik.stride(1), iks.stride(0), iks.stride(1))
    return a, args, dict(Q=Q, DK=DK, C=C, R=R, HSCALE=DK ** -0.5)


# ----------------------------------------------------------------------------- q side
@triton.jit
def _q_prologue_kernel(qq_ptr, cos_ptr, sin_ptr, qpe_ptr, iq8_ptr, iqs_ptr, stride_q, stride_cs,
                       H: tl.constexpr, P: tl.constexpr, R: tl.constexpr, HI: tl.constexpr, DK: tl.constexpr,
                       HSCALE: tl.constexpr, INDEX: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the q_b GEMV's output, cos / sin: earlier kernels'
    _q_prologue_head(tl.program_id(0), tl.program_id(1), qq_ptr, cos_ptr, sin_ptr, qpe_ptr, iq8_ptr, iqs_ptr,
                     stride_q, stride_cs, H, P, R, HI, DK, HSCALE, INDEX)


@triton.jit
def _q_prologue_head(n, h, qq_ptr, cos_ptr, sin_ptr, qpe_ptr, iq8_ptr, iqs_ptr, stride_q, stride_cs,
                     H: tl.constexpr, P: tl.constexpr, R: tl.constexpr, HI: tl.constexpr, DK: tl.constexpr,
                     HSCALE: tl.constexpr, INDEX: tl.constexpr):
    """Token n, head h of `_q_prologue_kernel` (q_pe of head h < H, the indexer query of head h < HI); also
    `mla_prologue_fused`'s q programs (the same code)."""
    row = qq_ptr + n.to(tl.int64) * stride_q
    dt = qq_ptr.dtype.element_ty
    cos_row = cos_ptr + n * stride_cs
    sin_row = sin_ptr + n * stride_cs
    n64 = n.to(tl.int64)
    if h < H:  # q_pe of head h: interleaved rotary, stored contiguous [n, H, R]
        i = tl.arange(0, R // 2)
        base = row + h * (P + R) + P
        x0 = tl.load(base + 2 * i).to(tl.float32)
        x1 = tl.load(base + 2 * i + 1).to(tl.float32)
        cs = tl.load(cos_row + i)
        sn = tl.load(sin_row + i)
        out = qpe_ptr + (n64 * H + h) * R
        tl.store(out + 2 * i, (x0 * cs - x1 * sn).to(qpe_ptr.dtype.element_ty))
        tl.store(out + 2 * i + 1, (x0 * sn + x1 * cs).to(qpe_ptr.dtype.element_ty))
    if INDEX and h < HI:  # indexer query of head h: half rotary, Hadamard, FP8 with one scale
        d = tl.arange(0, DK)
        RH: tl.constexpr = R // 2
        p = tl.where(d < RH, d + RH, tl.where(d < 2 * RH, d - RH, d))
        base = row + H * (P + R) + h * DK
        v = tl.load(base + d).to(tl.float32)
        vp = tl.load(base + p).to(tl.float32)
        ck = tl.load(cos_row + (d % RH), mask=d < 2 * RH, other=1.0)
        sk = tl.load(sin_row + (d % RH), mask=d < 2 * RH, other=0.0)
        r = _rotate_index(v, vp, d, ck, sk, RH).to(dt).to(tl.float32)
        qh = _hadamard(r, DK, HSCALE).to(dt).to(tl.float32)
        s, inv = ue8m0_scale(tl.max(tl.abs(qh), axis=0))
        tl.store(iq8_ptr + (n64 * HI + h) * DK + d, quant_e4m3(qh, inv))
        tl.store(iqs_ptr + n64 * HI + h, s)


def mla_q_prologue(mla, qq_BTX: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: bool = True,
                   pdl: bool = False):
    """Kernel twin of `mla_q_prologue_ref`: qq_BTX [B, T, H (P + R) + Hi Dk] the q_b | wq_b output (model
    dtype). Returns (q_pe [B, T, H, R] model dtype, contiguous; iq8 [B, T, Hi, Dk] fp8; iqs [B, T, Hi, 1]).
    index=False: the indexer will not score (it keeps every key when S <= its top-k), so qq_BTX may be the q_b
    output alone [B, T, H (P + R)] and (q_pe, None, None) is returned. pdl: programmatic dependent launch
    (`_triton.pdl_kwargs`)."""
    q, args, consts, outs = q_prologue_args(mla, qq_BTX, cos, sin, index, "mla_q_prologue")
    heads = max(consts["H"], consts["HI"]) if index else consts["H"]
    launch = pdl_kwargs(pdl, q)
    _q_prologue_kernel[(q.shape[0], heads)](*args, **consts, PDL=pdl_mode(pdl, launch), num_warps=4, **launch)
    return outs


def q_prologue_args(mla, qq_BTX, cos, sin, index: bool, name: str):
    """(qq as [B*T, X] rows, the runtime arguments of `_q_prologue_head` after (n, h), its constexprs, the
    outputs (q_pe, iq8, iqs), with None for the queries when not index), checked and allocated: what
    `mla_q_prologue` launches, and `mla_prologue_fused` with the same values."""
    require(qq_BTX, name)
    _check_mla(mla)
    ix = mla.indexer
    B, T, X = qq_BTX.shape
    H, P, R, HI, DK = mla.H, mla.P, mla.R, ix.n_heads, ix.head_dim
    widths = (H * (P + R) + HI * DK,) if index else (H * (P + R), H * (P + R) + HI * DK)
    if X not in widths or tuple(cos.shape) != (B, T, R // 2):
        raise ValueError(f"{name}: qq must be [B, T, {' or '.join(map(str, widths))}] and cos "
                         f"[B, T, {R // 2}], got {list(qq_BTX.shape)}, {list(cos.shape)}")
    q, cs, sn = _token_rows(qq_BTX, cos, sin)
    dev = q.device
    q_pe = torch.empty(B, T, H, R, dtype=q.dtype, device=dev)
    consts = dict(H=H, P=P, R=R, HI=HI, DK=DK, HSCALE=DK ** -0.5, INDEX=bool(index))
    if not index:
        return q, (q, cs, sn, q_pe, q_pe, q_pe, q.stride(0), cs.stride(0)), consts, (q_pe, None, None)
    iq8 = torch.empty(B, T, HI, DK, dtype=FP8_DTYPE, device=dev)
    iqs = torch.empty(B, T, HI, 1, dtype=torch.float32, device=dev)
    return q, (q, cs, sn, q_pe, iq8, iqs, q.stride(0), cs.stride(0)), consts, (q_pe, iq8, iqs)
