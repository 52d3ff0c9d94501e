"""MLA's absorbed kv_b projections for a few tokens, one launch each (Triton): q_lat = q_nope . W_kb per head
into the latent space, and o = o_lat . W_vb^T per head out of it.

Reference: `absorb_q_ref` / `absorb_out_ref` (the two `torch.einsum`s of `fast_path.mla_attend_fast`). Shape
legend: n = B*T tokens (<= 64), H heads, P nope dims, C latent dims, V value dims; W_kb [H, P, C] and
W_vb [H, V, C] (kv_b_proj dequantized once to bf16).

Each einsum is 3 launches on a decode step today (a copy of the strided q_nope / o_lat into head-major order,
the batched GEMM, a copy back to token-major order). Here one program per (head, 128-wide output block) loads
its weight tile and every token's row of that head straight from the strided input, multiplies on tensor
cores (bf16 products are exact in fp32; fp32 accumulation, as cuBLAS's bf16 GEMM) and writes token-major
output in the model dtype. At one TP=8 rank (16 heads) each weight is 2 MB: output blocks narrow until there are
>= 128 programs (q: 16 x 8 of 16 KB; out: 16 x 8 of 128 KB / 8).
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import (
    interpreting, line_elems, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, prefetch_rows_l2, require, tl, triton,
)

__all__ = ["absorb_q", "absorb_q_ref", "absorb_out", "absorb_out_ref", "absorb_tiles", "MAX_TOKENS", "out_block",
           "token_block"]

MAX_TOKENS = 64


def absorb_q_ref(q_nope_BTHP: torch.Tensor, w_kb_HPC: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bthp,hpc->bthc", q_nope_BTHP.to(w_kb_HPC.dtype), w_kb_HPC).contiguous()


def absorb_out_ref(o_lat_BTHC: torch.Tensor, w_vb_HVC: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bthc,hvc->bthv", o_lat_BTHC, w_vb_HVC)


@triton.jit
def dot_acc(acc, x, w, IEEE: tl.constexpr):
    """acc + x . w, x rounded to w's dtype first (tensor cores, fp32 accumulate; IEEE: fp32 weights, exact fp32
    products). Shared with `mla_out`'s fused stage 2, so that its product is this kernel's bit for bit."""
    if IEEE:
        d = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        d = tl.dot(x.to(w.dtype), w)
    return acc + d


@triton.jit
def _absorb_kernel(x_ptr, w_ptr, y_ptr, n_tok, stride_xn, stride_xh, stride_wh, stride_wk, stride_wo,
                   H: tl.constexpr, KD: tl.constexpr, OD: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
                   BT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, LINE: tl.constexpr):
    """y[n, h, o] = sum_k x[n, h, k] * w[h, k, o] (strides say how w is laid out), o in this program's block."""
    pdl_launch(PDL)
    _absorb_block(tl.program_id(0), tl.program_id(1), x_ptr, w_ptr, y_ptr, n_tok, stride_xn, stride_xh, stride_wh,
                  stride_wk, stride_wo, H, KD, OD, BO, BK, BT, IEEE, PDL, PF, LINE)


@triton.jit
def prefetch_weight_tile(w_ptr, h, o0, stride_wh, stride_wk, stride_wo, KD: tl.constexpr, BO: tl.constexpr,
                         PF: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for head h's weight tile (all KD k, output channels o0 .. o0 + BO) along its contiguous dim
    (`weight_prefetch`): PF 1 rows over k (o contiguous: W_kb [H, P, C]), 2 rows over o (k contiguous: W_vb
    [H, V, C]), 0 none."""
    if PF == 1:
        k = tl.arange(0, KD).to(tl.int64)
        prefetch_rows_l2(w_ptr + h * stride_wh + k * stride_wk + o0 * stride_wo, BO, LINE)
    elif PF == 2:
        o = (o0 + tl.arange(0, BO)).to(tl.int64)
        prefetch_rows_l2(w_ptr + h * stride_wh + o * stride_wo, KD, LINE)


def weight_prefetch(stride_wk: int, stride_wo: int, on: bool = True) -> int:
    """`prefetch_weight_tile`'s PF for a weight of these strides (1: o contiguous, 2: k contiguous, 0: neither);
    0 when not on (a launch without PDL, or beyond `FastPathOptions.pdl_prefetch_tokens`: compiled out)."""
    if not on:
        return 0
    return 1 if stride_wo == 1 else 2 if stride_wk == 1 else 0


@triton.jit
def _absorb_block(h, ob, x_ptr, w_ptr, y_ptr, n_tok, stride_xn, stride_xh, stride_wh, stride_wk, stride_wo,
                  H: tl.constexpr, KD: tl.constexpr, OD: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
                  BT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, LINE: tl.constexpr):
    """Head h, output block ob of `_absorb_kernel`; also `mla_prologue_fused`'s absorb programs (the same code).
    PDL: the weight tile (constant) is asked of L2 (`prefetch_weight_tile`; none with PF 0), then the wait for x (the
    previous kernel's) and the store; the product is the same."""
    t = tl.arange(0, BT)
    o = ob * BO + tl.arange(0, BO)
    tmask = t < n_tok
    if PDL:
        prefetch_weight_tile(w_ptr, h, ob * BO, stride_wh, stride_wk, stride_wo, KD, BO, PF, LINE)
    pdl_wait(PDL)
    acc = tl.zeros((BT, BO), dtype=tl.float32)
    for k0 in tl.static_range(0, KD, BK):  # unrolled: every tile of the head requested at once
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + t[:, None] * stride_xn + h * stride_xh + k[None, :], mask=tmask[:, None], other=0.0)
        w = tl.load(w_ptr + h * stride_wh + k[:, None] * stride_wk + o[None, :] * stride_wo)
        acc = dot_acc(acc, x, w, IEEE)
    y = y_ptr + (t[:, None] * H + h) * OD + o[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=tmask[:, None])


def out_block(H: int, OD: int) -> int:
    """Output channels per program: 128, narrowed until there are >= 128 programs (H x OD / block) to stream the
    weight from many SMs. At one TP=8 rank (16 heads) latent -> v had 16 programs of 128 KB each (grid H x V / 128),
    the slower of the two launches; the sum over k per output element is the same at every width. Under the Triton
    interpreter the widest block (the fewest programs: each costs the interpreter its Python overhead, 8x the
    programs at a tiny model's 4 heads); every launch of a process plans it alike, so its kernels still agree."""
    bo = min(128, OD)
    if interpreting():
        return bo
    while bo // 2 >= 16 and OD % (bo // 2) == 0 and H * (OD // bo) < 128:
        bo //= 2
    return bo


def token_block(n: int) -> int:
    """Token rows of the tensor-core tile for n tokens (the dot's M: at least 16)."""
    return max(16, triton.next_power_of_2(n))


def _launch(x_BTHK, w, stride_wk, stride_wo, OD, out_dtype, pdl, prefetch):
    require(x_BTHK, "absorb")
    B, T, H, KD = x_BTHK.shape
    n = B * T
    if not 1 <= n <= MAX_TOKENS:
        raise ValueError(f"absorb: 1..{MAX_TOKENS} tokens, got {n}")
    if x_BTHK.stride(-1) != 1 or (B > 1 and T > 1 and x_BTHK.stride(0) != T * x_BTHK.stride(1)):
        x_BTHK = x_BTHK.contiguous()  # the kernel walks tokens with one stride
    # that stride: rows' when T = 1 (a view's stride of a size-1 dim is arbitrary: B > 1 rows of one token each,
    # a slice of the q_b output, must not be copied for it), else tokens'
    stride_t = x_BTHK.stride(0) if T == 1 else x_BTHK.stride(1)
    y = torch.empty(B, T, H, OD, dtype=out_dtype, device=x_BTHK.device)
    consts = absorb_tiles(H, KD, OD, n, w.dtype)
    launch = pdl_kwargs(pdl, x_BTHK)
    _absorb_kernel[(H, OD // consts["BO"])](x_BTHK, w, y, n, stride_t, x_BTHK.stride(2), w.stride(0), stride_wk,
                                            stride_wo, **consts, PDL=pdl_mode(pdl, launch),
                                            PF=weight_prefetch(stride_wk, stride_wo, bool(launch) and prefetch),
                                            LINE=line_elems(w), num_warps=4, **launch)
    return y


def absorb_tiles(H: int, KD: int, OD: int, n: int, w_dtype: torch.dtype) -> dict:
    """The constexprs of `_absorb_block` for H heads, KD -> OD dims, n tokens (grid H x OD / BO, 4 warps): what
    `absorb_q` / `absorb_out` launch, and `mla_prologue_fused` with the same tiles (so the same sums)."""
    bo = out_block(H, OD)
    bk = min(128, KD)
    if OD % bo or KD % bk:
        raise ValueError(f"absorb: dims {KD} -> {OD} must be multiples of {bk} / {bo}")
    return dict(H=H, KD=KD, OD=OD, BO=bo, BK=bk, BT=token_block(n), IEEE=w_dtype == torch.float32)


def absorb_q(q_nope_BTHP: torch.Tensor, w_kb_HPC: torch.Tensor, pdl: bool = False,
             prefetch: bool = True) -> torch.Tensor:
    """Kernel twin of `absorb_q_ref`: q_lat [B, T, H, C] contiguous in w_kb's dtype; q_nope may be a strided
    view (the q_b output's nope channels). pdl: programmatic dependent launch (`_triton.pdl_kwargs`; the weight
    tile is asked of L2 before the wait, unless not prefetch: `FastPathOptions.pdl_prefetch_tokens`, the same
    bits)."""
    H, P, C = w_kb_HPC.shape
    if q_nope_BTHP.shape[2:] != (H, P):
        raise ValueError(f"absorb_q: q_nope must be [B, T, {H}, {P}], got {list(q_nope_BTHP.shape)}")
    return _launch(q_nope_BTHP, w_kb_HPC, w_kb_HPC.stride(1), w_kb_HPC.stride(2), C, w_kb_HPC.dtype, pdl, prefetch)


def absorb_out(o_lat_BTHC: torch.Tensor, w_vb_HVC: torch.Tensor, pdl: bool = False,
               prefetch: bool = True) -> torch.Tensor:
    """Kernel twin of `absorb_out_ref`: o [B, T, H, V] contiguous in the einsum's dtype (o_lat's / W_vb's).
    pdl, prefetch: as `absorb_q`'s."""
    H, V, C = w_vb_HVC.shape
    if o_lat_BTHC.shape[2:] != (H, C) or o_lat_BTHC.dtype != w_vb_HVC.dtype:
        raise ValueError(f"absorb_out: o_lat must be [B, T, {H}, {C}] in {w_vb_HVC.dtype}, got "
                         f"{list(o_lat_BTHC.shape)} {o_lat_BTHC.dtype}")
    return _launch(o_lat_BTHC, w_vb_HVC, w_vb_HVC.stride(2), w_vb_HVC.stride(1), V, w_vb_HVC.dtype, pdl, prefetch)
