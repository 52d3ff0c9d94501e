"""The MLA prologue's launches that read one GEMV output, two per launch (Triton): horizontal fusions.

Two pairs of a decode block's launches (`fast_path.mla_forward_fast`) read only the output of the GEMV before
them and nothing the other writes:
- after q_a | wk | kv_a, `mla_prologue.mla_kv_prologue` (kv_a norm, rotary, indexer key, FP8 cache write) and
  `norm_quant.add_rms_norm_quant` of the q_a slice (q_a_layernorm + FP8 quant, y not stored);
- after q_b | wq_b, `mla_prologue.mla_q_prologue` (q_pe rotary, the indexer queries' rotary + Hadamard + quant)
  and `absorb.absorb_q` (q_nope . W_kb per head).
Here each pair is one launch whose grid is the two grids side by side (1-D, the first programs one job, the rest
the other): `mla_kv_prologue_norm` (B*T kv programs, then B*T norm rows) and `mla_q_prologue_absorb` (H x C/BO
absorb programs first, the longer ones, then B*T x heads q programs). Each program runs the unfused kernel's own
body (`_kv_prologue_token`, `_add_norm_quant_row`, `_absorb_block`, `_q_prologue_head`: @triton.jit functions the
unfused kernels call too) with the same arguments, tiles and warps (4), so every output is bit-identical to the
two launches': same formulas, same rounding points, same sum order (tests/kernels/test_fused_kernels.py under the
interpreter, tests/kernels/test_fused_kernels_gpu.py on the GPU, both with torch.equal). The norm's warps grow to 32
past 16 groups of 128 (`norm_quant.row_tiles`), which would change its sums' order: the kv launch takes
q_lora <= NORM_MAX_Q (DeepSeek's 1536), and the fast path's unfused q_a norm keeps row_tiles' warps (not
`FastPathOptions.norm_warps`, the model-width rows'); tests/kernels/test_norm_warps.py checks that both launches
get the same tile and warps.
Saves 2 launches per layer (2-6 us each on a CUDA-graph step; the programs were already concurrent-sized).
Shape legend as `mla_prologue`: n = B*T tokens, Q q_lora, H heads, P nope dims, C latent, Hi indexer heads.
"""

from __future__ import annotations

import torch

from mtp.model.fp8 import BLOCK, FP8_DTYPE
from mtp.kernels._triton import line_elems, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, tl, triton
from mtp.kernels.absorb import MAX_TOKENS as ABSORB_MAX_TOKENS
from mtp.kernels.absorb import _absorb_block, absorb_tiles, weight_prefetch
from mtp.kernels.mla_prologue import (_kv_prologue_token, _kv_token_part, _q_prologue_head, kv_prologue_args,
                                      q_prologue_args)
from mtp.kernels.norm_quant import _add_norm_quant_row, row_tiles

__all__ = ["NORM_MAX_Q", "kv_norm_fits", "mla_kv_prologue_norm", "mla_q_prologue_absorb"]

NORM_MAX_Q = 16 * BLOCK  # q_lora up to which the q_a norm runs on 4 warps (`row_tiles`), the kv programs' count


def kv_norm_fits(q_lora: int) -> bool:
    """Whether `mla_kv_prologue_norm` takes a q_a of q_lora channels (else the two launches run)."""
    return q_lora % BLOCK == 0 and q_lora <= NORM_MAX_Q


# ----------------------------------------------------------------------------- kv prologue + q_a norm
@triton.jit
def _kv_norm_kernel(a_ptr, pos_ptr, cos_ptr, sin_ptr, wkv_ptr, kw_ptr, kb_ptr,
                    kv_ptr, kvs_ptr, pec_ptr, ik_ptr, iks_ptr,
                    T, stride_a, stride_pos_b, stride_pos_t, stride_cs, eps_kv, eps_k,
                    sb_kv, ss_kv, sb_kvs, ss_kvs, sb_pe, ss_pe, sb_ik, ss_ik, sb_iks, ss_iks,
                    n_tok, wq_ptr, y_ptr, x8_ptr, sx_ptr, eps_q, stride_x8, stride_sx,
                    Q: tl.constexpr, DK: tl.constexpr, C: tl.constexpr, R: tl.constexpr, HSCALE: tl.constexpr,
                    BG: tl.constexpr, PDL: tl.constexpr, KV_SPLIT: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # as the norm's launch: every input may come from the GEMV before; only the launch overlaps it
    pid = tl.program_id(0)
    kv_progs = 2 * n_tok if KV_SPLIT else n_tok
    if pid < kv_progs:
        if KV_SPLIT:  # a token's latent + rotary key, or its indexer key: two programs, the chains side by side
            if pid < n_tok:
                _kv_token_part(pid, 0, a_ptr, pos_ptr, cos_ptr, sin_ptr, wkv_ptr, kw_ptr, kb_ptr,
                               kv_ptr, kvs_ptr, pec_ptr, ik_ptr, iks_ptr,
                               T, stride_a, stride_pos_b, stride_pos_t, stride_cs, eps_kv, eps_k,
                               sb_kv, ss_kv, sb_kvs, ss_kvs, sb_pe, ss_pe, sb_ik, ss_ik, sb_iks, ss_iks,
                               Q, DK, C, R, HSCALE)
            else:
                _kv_token_part(pid - n_tok, 1, a_ptr, pos_ptr, cos_ptr, sin_ptr, wkv_ptr, kw_ptr, kb_ptr,
                               kv_ptr, kvs_ptr, pec_ptr, ik_ptr, iks_ptr,
                               T, stride_a, stride_pos_b, stride_pos_t, stride_cs, eps_kv, eps_k,
                               sb_kv, ss_kv, sb_kvs, ss_kvs, sb_pe, ss_pe, sb_ik, ss_ik, sb_iks, ss_iks,
                               Q, DK, C, R, HSCALE)
        else:
            _kv_prologue_token(pid, a_ptr, pos_ptr, cos_ptr, sin_ptr, wkv_ptr, kw_ptr, kb_ptr,
                               kv_ptr, kvs_ptr, pec_ptr, ik_ptr, iks_ptr,
                               T, stride_a, stride_pos_b, stride_pos_t, stride_cs, eps_kv, eps_k,
                               sb_kv, ss_kv, sb_kvs, ss_kvs, sb_pe, ss_pe, sb_ik, ss_ik, sb_iks, ss_iks,
                               Q, DK, C, R, HSCALE)
    else:  # the q_a slice (the row's first Q channels): RMSNorm, rounded to y's dtype, FP8 per 128; y not stored
        _add_norm_quant_row((pid - kv_progs).to(tl.int64), a_ptr, a_ptr, wq_ptr, a_ptr, y_ptr, x8_ptr, sx_ptr, Q,
                            eps_q, stride_a, stride_a, stride_a, 0, stride_x8, stride_sx,
                            False, False, False, True, BG, 2)


def mla_kv_prologue_norm(mla, cache, pos_BT: torch.Tensor, a_BTX: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, out_dtype: torch.dtype, pdl: bool = False, kv_split: bool = False):
    """`mla_prologue.mla_kv_prologue(mla, cache, pos_BT, a_BTX, cos, sin)` and
    `add_rms_norm_quant(a_BTX[..., :Q], None, q_a_layernorm.weight, eps, out_dtype, store_y=False, pdl=pdl)` in
    one launch: writes the cache slots and returns the quantized q_a norm (q8 [B, T, Q] fp8, qs [B, T, Q/128]
    fp32), the same bits as the two launches. kv_split (switch `FastPathOptions.kv_split`): each token's latent +
    rotary key and its indexer key in two programs instead of one (`mla_prologue._kv_token_part`: three
    independent dependent chains per token side by side with the q_a norm's, instead of two after one another in
    one program; the same code, the same bits). Alone on an H200 the launch took 6.4 us at one token (session 17,
    Nsight Compute; 2 programs), about 2 us of it any launch's."""
    name = "mla_kv_prologue_norm"
    a, args, consts = kv_prologue_args(mla, cache, pos_BT, a_BTX, cos, sin, name)
    norm = mla.q_a_layernorm
    Q = consts["Q"]
    if not kv_norm_fits(Q) or tuple(norm.weight.shape) != (Q,):
        raise ValueError(f"{name}: q_lora must be a multiple of {BLOCK} up to {NORM_MAX_Q} (the norm's 4 warps) "
                         f"with q_a_layernorm.weight [{Q}]; got {Q}, {list(norm.weight.shape)}")
    B, T = pos_BT.shape
    n = a.shape[0]
    dev = a.device
    x8 = torch.empty(n, Q, dtype=FP8_DTYPE, device=dev)
    sx = torch.empty(n, Q // BLOCK, dtype=torch.float32, device=dev)
    y = torch.empty(1, 1, dtype=out_dtype, device=dev)  # not stored: its dtype is where y is rounded
    launch = pdl_kwargs(pdl, a)
    _kv_norm_kernel[((3 if kv_split else 2) * n,)](*args, n, norm.weight, y, x8, sx, norm.eps, x8.stride(0),
                                                   sx.stride(0), **consts, BG=row_tiles(Q)[0],
                                                   PDL=pdl_mode(pdl, launch), KV_SPLIT=bool(kv_split), num_warps=4,
                                                   **launch)
    return x8.view(B, T, Q), sx.view(B, T, Q // BLOCK)


# ----------------------------------------------------------------------------- q prologue + absorb q
@triton.jit
def _q_absorb_kernel(qq_ptr, cos_ptr, sin_ptr, qpe_ptr, iq8_ptr, iqs_ptr, stride_q, stride_cs,
                     w_ptr, ql_ptr, n_tok, stride_wh, stride_wk, stride_wo,
                     H: tl.constexpr, P: tl.constexpr, R: tl.constexpr, HI: tl.constexpr, DK: tl.constexpr,
                     HSCALE: tl.constexpr, INDEX: tl.constexpr, HQ: tl.constexpr, C: tl.constexpr,
                     BO: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                     PF: tl.constexpr, LINE: tl.constexpr):
    pdl_launch(PDL)
    pid = tl.program_id(0)
    NB: tl.constexpr = C // BO
    if pid < H * NB:  # q_lat = q_nope . W_kb: q_nope read in place from the q_b rows (head stride P + R)
        _absorb_block(pid // NB, pid % NB, qq_ptr, w_ptr, ql_ptr, n_tok, stride_q, P + R, stride_wh, stride_wk,
                      stride_wo, H, P, C, BO, BK, BT, IEEE, PDL, PF, LINE)  # (W_kb asked of L2, then the wait)
    else:
        pdl_wait(PDL)  # everything it reads is the q_b GEMV's
        m = pid - H * NB
        _q_prologue_head(m // HQ, m % HQ, qq_ptr, cos_ptr, sin_ptr, qpe_ptr, iq8_ptr, iqs_ptr, stride_q, stride_cs,
                         H, P, R, HI, DK, HSCALE, INDEX)


def mla_q_prologue_absorb(mla, qq_BTX: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: bool = True,
                          pdl: bool = False, prefetch: bool = True):
    """`mla_prologue.mla_q_prologue(mla, qq_BTX, cos, sin, index)` and `absorb.absorb_q(q_nope, mla.w_kb)` (q_nope
    the q_b output's nope channels) in one launch: returns (q_pe, iq8, iqs, q_lat [B, T, H, C] in w_kb's dtype),
    the same bits as the two launches (iq8, iqs None when not index). 1..absorb.MAX_TOKENS tokens. pdl:
    programmatic dependent launch (`_triton.pdl_kwargs`), the absorb programs' W_kb tiles asked of L2 before the
    wait (`absorb_q`'s) unless not prefetch (`FastPathOptions.prefetch_at`: compiled out, the same bits)."""
    name = "mla_q_prologue_absorb"
    q, args, consts, (q_pe, iq8, iqs) = q_prologue_args(mla, qq_BTX, cos, sin, index, name)
    w = mla.w_kb
    H, P, C = w.shape
    B, T = qq_BTX.shape[:2]
    n = q.shape[0]
    if (H, P) != (consts["H"], consts["P"]) or not 1 <= n <= ABSORB_MAX_TOKENS:
        raise ValueError(f"{name}: w_kb must be [{consts['H']}, {consts['P']}, C] and tokens 1..{ABSORB_MAX_TOKENS}; "
                         f"got {list(w.shape)}, {n} tokens")
    tiles = absorb_tiles(H, P, C, n, w.dtype)
    q_lat = torch.empty(B, T, H, C, dtype=w.dtype, device=q.device)
    heads = max(H, consts["HI"]) if index else H
    grid = H * (C // tiles["BO"]) + n * heads
    launch = pdl_kwargs(pdl, q)
    _q_absorb_kernel[(grid,)](*args, w, q_lat, n, w.stride(0), w.stride(1), w.stride(2), **consts, HQ=heads, C=C,
                              BO=tiles["BO"], BK=tiles["BK"], BT=tiles["BT"], IEEE=tiles["IEEE"], PDL=pdl_mode(pdl, launch),
                              PF=weight_prefetch(w.stride(1), w.stride(2), bool(launch) and prefetch),
                              LINE=line_elems(w), num_warps=4, **launch)
    return q_pe, iq8, iqs, q_lat
