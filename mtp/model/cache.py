"""Static KV cache for MLA + the lightning indexer, shaped for CUDA-graph capture and rollback.

Per layer and sequence it holds what DeepSeek deploys: the normalized latent c_kv (C = kv_lora_rank) with
one scale per 128 channels, the rotated k_pe (R = qk_rope_head_dim), and the indexer key (Dk = index_head_dim)
with one scale. With fp8 numerics c_kv and the indexer key are stored as real float8_e4m3fn (half the bytes
of bf16) and the scales are ue8m0 powers of two; with dequant numerics they are stored in the model dtype and
the scales are 1. Reading dequantizes, so both layouts serve one attention code path.

All buffers are allocated once. `seq_lens_B` is a device tensor updated in place: a forward writes its T
tokens at positions seq_lens[b] + t and advances seq_lens by T; `truncate` rolls back by lowering
seq_lens (stale entries past a row's length are masked, never read). Nothing is reallocated while decoding.
A draft tree's verify writes its N nodes at seq_lens[b] + i in node order; `compact` then moves the accepted
path's entries to consecutive slots and rolls the rest back, so the cache reads as if only the path was fed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import fp8
from .config import ModelConfig
from .layers import REFERENCE_OPS, ElementwiseOps


@dataclass
class LayerCache:
    """Views of one layer's buffers; `seq_lens` is shared by every layer of the owning KVCache."""

    kv: torch.Tensor  # [B, S, C]
    kv_scale: torch.Tensor  # [B, S, C // 128] fp32
    pe: torch.Tensor  # [B, S, R]
    idx_k: torch.Tensor  # [B, S, Dk]
    idx_k_scale: torch.Tensor  # [B, S] fp32
    seq_lens: torch.Tensor  # [B] int64
    quantized: bool

    def write(self, pos_BT: torch.Tensor, c_BTC: torch.Tensor, pe_BTR: torch.Tensor, k_BTD: torch.Tensor,
              ops: ElementwiseOps = REFERENCE_OPS) -> None:
        """ops: the writing model's elementwise ops (its FP8 quantization of the latent and the indexer key)."""
        b_BT = torch.arange(pos_BT.shape[0], device=pos_BT.device).unsqueeze(1).expand_as(pos_BT)
        if self.quantized:
            c8, cs = ops.act_quant(c_BTC)
            k8, ks = ops.act_quant(k_BTD, block=k_BTD.shape[-1])
            self.kv[b_BT, pos_BT] = c8
            self.kv_scale[b_BT, pos_BT] = cs
            self.idx_k[b_BT, pos_BT] = k8
            self.idx_k_scale[b_BT, pos_BT] = ks.squeeze(-1)
        else:
            self.kv[b_BT, pos_BT] = c_BTC.to(self.kv.dtype)
            self.idx_k[b_BT, pos_BT] = k_BTD.to(self.idx_k.dtype)
        self.pe[b_BT, pos_BT] = pe_BTR.to(self.pe.dtype)

    def read_kv(self, S: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized (c_kv [B, S, C], k_pe [B, S, R]) over the first S slots."""
        kv = self.kv[:, :S]
        if self.quantized:
            kv = fp8.act_dequant(kv, self.kv_scale[:, :S], dtype)
        return kv.to(dtype), self.pe[:, :S].to(dtype)

    def read_index_k(self, S: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized indexer keys [B, S, Dk] in `dtype` (fp32, or fp64 for a float64 model)."""
        k = self.idx_k[:, :S].to(dtype)
        if self.quantized:
            k = k * self.idx_k_scale[:, :S].unsqueeze(-1).to(dtype)
        return k


class KVCache:
    """Buffers for `n_layers` layers, `batch` sequences and `max_len` positions each."""

    def __init__(self, cfg: ModelConfig, n_layers: int, batch: int, max_len: int, *, device, dtype: torch.dtype,
                 quantized: bool):
        if batch < 1 or max_len < 1 or n_layers < 0:
            raise ValueError(f"KVCache needs batch >= 1, max_len >= 1, n_layers >= 0; got {batch}, {max_len}, {n_layers}")
        C, R, Dk = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
        store = fp8.FP8_DTYPE if quantized else dtype
        L, B, S = n_layers, batch, max_len
        self.batch, self.max_len, self.n_layers, self.quantized, self.dtype = B, S, L, quantized, dtype
        self.kv = torch.zeros(L, B, S, C, dtype=store, device=device)
        self.kv_scale = torch.ones(L, B, S, max(C // fp8.BLOCK, 1), dtype=torch.float32, device=device)
        self.pe = torch.zeros(L, B, S, R, dtype=dtype, device=device)
        self.idx_k = torch.zeros(L, B, S, Dk, dtype=store, device=device)
        self.idx_k_scale = torch.ones(L, B, S, dtype=torch.float32, device=device)
        self.seq_lens = torch.zeros(B, dtype=torch.long, device=device)

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self.kv[i], self.kv_scale[i], self.pe[i], self.idx_k[i], self.idx_k_scale[i],
                          self.seq_lens, self.quantized)

    def truncate(self, new_lens_B: torch.Tensor, less: int = 0) -> None:
        """Roll every row back to `new_lens_B` - `less` (device or host ints); entries past it become invisible.
        `less`: a decode step's `truncate(n_B, 1)` is one launch where `truncate(n_B - 1)` is two."""
        lens = torch.as_tensor(new_lens_B, dtype=torch.long).to(self.seq_lens.device)
        if less:
            torch.sub(lens, less, out=self.seq_lens)
        else:
            self.seq_lens.copy_(lens)

    def reset(self) -> None:
        self.seq_lens.zero_()

    @staticmethod
    def bytes_per_position(cfg: ModelConfig, dtype: torch.dtype, quantized: bool) -> int:
        """Bytes one position of one layer takes: latent + its scales, rope key, indexer key + its scale."""
        C, R, Dk = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
        store = 1 if quantized else torch.empty((), dtype=dtype).element_size()
        return C * store + max(C // fp8.BLOCK, 1) * 4 + R * torch.empty((), dtype=dtype).element_size() + Dk * store + 4

    def compact(self, base_B: torch.Tensor, nodes_BA: torch.Tensor, keep_B: torch.Tensor) -> None:
        """Commit a tree path: in every layer, move slot base[b] + nodes[b, i] to base[b] + i (i < A), then set
        seq_lens = base + keep. nodes_BA [B, A] lists the kept nodes in path order; entries at i >= keep[b]
        may be anything in range (they are copied past the new length, where nothing reads them). Static
        shapes, no sync: every row moves A slots. All sources are read before any slot is written."""
        B, A = nodes_BA.shape
        if base_B.shape != (B,) or keep_B.shape != (B,) or B != self.batch:
            raise ValueError(f"compact needs base [{self.batch}], nodes [{self.batch}, A], keep [{self.batch}]; got "
                             f"{tuple(base_B.shape)}, {tuple(nodes_BA.shape)}, {tuple(keep_B.shape)}")
        b_BA = torch.arange(B, device=nodes_BA.device).unsqueeze(1).expand(B, A)
        src_BA = base_B.unsqueeze(1) + nodes_BA
        dst_BA = base_B.unsqueeze(1) + torch.arange(A, device=nodes_BA.device)
        for buf in (self.kv, self.kv_scale, self.pe, self.idx_k, self.idx_k_scale):
            buf[:, b_BA, dst_BA] = buf[:, b_BA, src_BA]
        self.seq_lens.copy_(base_B + keep_B)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.kv_scale, self.pe, self.idx_k, self.idx_k_scale))
