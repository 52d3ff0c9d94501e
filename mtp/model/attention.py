"""Multi-head Latent Attention with DeepSeek Sparse Attention's lightning indexer (reference path).

Shape legend: B batch, T new tokens, S cached keys (including the new ones), H heads, Hi indexer heads,
C kv_lora_rank, R qk_rope_head_dim, P qk_nope_head_dim, V v_head_dim, Dk index_head_dim.

A forward writes the T new tokens into the layer cache first and then attends over the first S slots;
query t of row b sees key s iff s <= pos[b, t] (causal, per-row lengths) and the indexer selected s; a draft
tree's verify passes its own `visible_BTS` instead (the committed keys plus the node's ancestors), and the
indexer's top-k is then taken per node over what that node sees.
Two equivalent MLA paths: 'naive' expands every cached latent through kv_b_proj (prefill), 'absorb' folds
kv_b_proj into the query and output so attention runs in the C-dim latent space (decode / verify).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8
from .cache import LayerCache
from .config import ModelConfig, RuntimeOptions
from .layers import REFERENCE_OPS, LayerNorm, Linear, RMSNorm


class Indexer(nn.Module):
    ops = REFERENCE_OPS  # the elementwise ops (`layers.use_elementwise`)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        q8 = cfg.is_fp8
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, q8, dtype)
        self.wk = Linear(cfg.hidden_size, self.head_dim, q8, dtype)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6, dtype=torch.float32)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, False, dtype)
        self.numerics = "fp8"

    def rotate(self, v: torch.Tensor, cos, sin) -> torch.Tensor:
        """Half-split RoPE on the first rope_dim channels (rope FIRST, then nope), then the Hadamard transform."""
        v = torch.cat((self.ops.rope_half(v[..., : self.rope_dim], cos, sin), v[..., self.rope_dim:]), dim=-1)
        return self.ops.rotate_activation(v)

    def keys(self, x_BTD: torch.Tensor, cos, sin) -> torch.Tensor:
        """The indexer key of each new token (rotated, Hadamard-transformed), before quantization."""
        return self.rotate(self.k_norm(self.wk(x_BTD)), cos, sin)

    def queries(self, qr_BTQ: torch.Tensor, cos, sin) -> torch.Tensor:
        """The indexer queries [B, T, Hi, Dk] (rotated, Hadamard-transformed), before quantization."""
        B, T, _ = qr_BTQ.shape
        return self.rotate(self.wq_b(qr_BTQ).view(B, T, self.n_heads, self.head_dim), cos, sin)

    def select(self, x_BTD, qr_BTQ, cos, sin, cache: LayerCache, S: int, visible_BTS: torch.Tensor) -> torch.Tensor:
        """Boolean [B, T, S]: the keys each query keeps (top-k of the index score among visible keys)."""
        a = fp8.acc_dtype(x_BTD.dtype)
        q = self.queries(qr_BTQ, cos, sin).to(a)
        if self.numerics == "fp8":
            q = self.ops.fake_quant(q)  # one ue8m0 scale per (token, head): the reference quantizes q first
        k_BSD = cache.read_index_k(S, a)
        w_BTH = F.linear(x_BTD.to(a), self.weights_proj.weight.to(a)) * self.n_heads ** -0.5
        dots_BTHS = torch.einsum("bthd,bsd->bths", q, k_BSD).relu()
        score_BTS = torch.einsum("bth,bths->bts", w_BTH * self.head_dim ** -0.5, dots_BTHS)
        score_BTS = score_BTS.masked_fill(~visible_BTS, float("-inf"))
        k = min(self.topk, S)
        if k >= S:
            return visible_BTS
        # Stable sort: among equal scores the earlier key wins, whatever the tensor shape (full vs incremental).
        order = torch.sort(score_BTS, dim=-1, descending=True, stable=True).indices[..., :k]
        keep = torch.zeros_like(visible_BTS).scatter_(-1, order, True)
        return keep & visible_BTS


class MLA(nn.Module):
    ops = REFERENCE_OPS  # the elementwise ops (`layers.use_elementwise`)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        q8 = cfg.is_fp8
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.H, self.P, self.R, self.V, self.C = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.q_a_proj = Linear(D, cfg.q_lora_rank, q8, dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
        self.q_b_proj = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, q8, dtype)
        self.kv_a_proj_with_mqa = Linear(D, self.C + self.R, q8, dtype)
        self.kv_a_layernorm = RMSNorm(self.C, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = Linear(self.C, H * (self.P + self.V), q8, dtype)
        self.o_proj = Linear(H * self.V, D, q8, dtype)
        self.indexer = Indexer(cfg, dtype)
        self.softmax_scale = cfg.softmax_scale

    def forward(self, x_BTD, pos_BT, cos, sin, cache: LayerCache, S: int, opts: RuntimeOptions,
                visible_BTS: torch.Tensor | None = None) -> torch.Tensor:
        """pos_BT: the cache slots the new tokens are written to; cos/sin: their rotary angles.
        visible_BTS: the keys each query may see (default: causal, s <= pos[b, t])."""
        B, T, _ = x_BTD.shape
        dt = x_BTD.dtype
        naive = self.naive(T, opts)
        qr, q_nope, q_pe, c, k_pe = self.project(x_BTD, cos, sin)
        cache.write(pos_BT, c, k_pe, self.indexer.keys(x_BTD, cos, sin), self.ops)
        if visible_BTS is None:
            visible_BTS = torch.arange(S, device=x_BTD.device).view(1, 1, S) <= pos_BT.unsqueeze(-1)
        keep_BTS = self.indexer.select(x_BTD, qr, cos, sin, cache, S, visible_BTS)
        a = fp8.acc_dtype(dt)
        c_BSC, pe_BSR = cache.read_kv(S, a)
        bias_B1TS = torch.zeros(keep_BTS.shape, dtype=a, device=x_BTD.device)
        bias_B1TS = bias_B1TS.masked_fill(~keep_BTS, float("-inf")).unsqueeze(1)

        if naive:
            o = self._naive(q_nope, q_pe, c_BSC.to(dt), pe_BSR, bias_B1TS)
        else:
            o = self._absorbed(q_nope, q_pe, c_BSC, pe_BSR, bias_B1TS)
        return self.o_proj(o.reshape(B, T, self.H * self.V).to(dt))

    def project(self, x_BTD: torch.Tensor, cos, sin):
        """The input projections: qr [B, T, q_lora_rank] (the query's low rank, also the indexer's input),
        q_nope [B, T, H, P], q_pe [B, T, H, R] (rotated), the normalized latent c [B, T, C] and the rotated rope
        key k_pe [B, T, R]. (The fast path computes the same with its fused projections.)"""
        B, T, _ = x_BTD.shape
        dt = x_BTD.dtype
        qr = self.q_a_layernorm(self.q_a_proj(x_BTD), dt)
        q = self.q_b_proj(qr).view(B, T, self.H, self.P + self.R)
        q_nope, q_pe = q[..., : self.P], self.ops.rope_interleaved(q[..., self.P:], cos, sin)
        kv = self.kv_a_proj_with_mqa(x_BTD)
        c = self.kv_a_layernorm(kv[..., : self.C], dt)
        k_pe = self.ops.rope_interleaved(kv[..., self.C:], cos, sin)
        return qr, q_nope, q_pe, c, k_pe

    @staticmethod
    def naive(T: int, opts: RuntimeOptions) -> bool:
        """Whether a block of T new tokens takes the naive path (expanded keys) rather than the absorbed one."""
        return opts.attn_impl == "naive" or (opts.attn_impl == "auto" and T > opts.absorb_max_tokens)

    def _naive(self, q_nope, q_pe, c_BSC, pe_BSR, bias):
        B, S = c_BSC.shape[:2]
        a = bias.dtype
        kv = self.kv_b_proj(c_BSC).view(B, S, self.H, self.P + self.V).to(a)
        k_nope, v = kv[..., : self.P], kv[..., self.P:]
        scores = torch.einsum("bthp,bshp->bhts", q_nope.to(a), k_nope)
        scores = scores + torch.einsum("bthr,bsr->bhts", q_pe.to(a), pe_BSR.to(a))
        p = (scores * self.softmax_scale + bias).softmax(dim=-1)
        return torch.einsum("bhts,bshv->bthv", p, v)

    def _absorbed(self, q_nope, q_pe, c_BSC, pe_BSR, bias):
        a = bias.dtype
        w = self.kv_b_proj.dequantized_weight(a).view(self.H, self.P + self.V, self.C)
        q_lat = torch.einsum("bthp,hpc->bthc", q_nope.to(a), w[:, : self.P])
        scores = torch.einsum("bthc,bsc->bhts", q_lat, c_BSC.to(a))
        scores = scores + torch.einsum("bthr,bsr->bhts", q_pe.to(a), pe_BSR.to(a))
        p = (scores * self.softmax_scale + bias).softmax(dim=-1)
        o_lat = torch.einsum("bhts,bsc->bthc", p, c_BSC.to(a))
        return torch.einsum("bthc,hvc->bthv", o_lat, w[:, self.P:])
