"""DeepSeek-V3.2 target model and its MTP modules (reference forward, plain PyTorch).

Shape legend: B batch, T new tokens, D width, V vocabulary, S cache slots.

Parameter names equal the HF checkpoint names (`model.layers.N.self_attn.q_a_proj.weight`, ...); the MTP
layers (checkpoint layers N >= num_hidden_layers) live in `DeepseekV32.mtp[j]`, see `mtp.checkpoint.files`.
The residual stream is fp32; module inputs and outputs are in the model dtype.

Cache-using forward (what decoding uses): `model.forward(ids_BT, cache=kv)` writes the T tokens at positions
`kv.seq_lens[b] + t`, attends causally per row over the cache, and advances `kv.seq_lens` by T. Roll back
with `kv.truncate(lens)`. Without a cache the call is a fresh prompt forward.
Tree forward (`tree_depth`, `tree_mask`, see `mtp.spec.tree_shape`): the T tokens are nodes of a draft tree whose
nodes occupy the last U >= T slots up to and including them, from slot f = seq_lens[b] + T - U (U = T for a
target verify; a drafter writing a tree depth by depth has earlier depths already in the cache). Token t is still
written at slot seq_lens[b] + t, sits at rotary position f + tree_depth[t], and attends to every slot before f
plus the tree slots f + u with tree_mask[t, u]. A chain (depth t, lower-triangular [T, T] mask) is the default.
The forward is differentiable (training builds the model with float weights); inference callers wrap it in
`torch.no_grad()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import fp8
from .attention import MLA
from .cache import KVCache, LayerCache
from .config import ModelConfig, RuntimeOptions
from .layers import MLP, Embedding, Linear, RMSNorm, Rotary
from .moe import MoE


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V] (or [B, n] rows picked by `logits_at`) fp32
    hidden: torch.Tensor  # [B, T, D] after the final norm (what feeds lm_head)
    hidden_prenorm: torch.Tensor  # [B, T, D] fp32 residual stream before the final norm
    hidden_at: torch.Tensor | None = None  # [B, n, D] `hidden`'s rows at `logits_at` (what fed the head), if given


class Block(nn.Module):
    """Pre-norm decoder block: h += MLA(norm(h)); h += FFN(norm(h))."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLA(cfg, dtype)
        self.mlp = MoE(cfg, dtype) if cfg.is_moe_layer(layer_id) else MLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.is_fp8, dtype)

    def forward(self, h_BTD, pos_BT, cos, sin, cache: LayerCache, S: int, opts: RuntimeOptions, dtype,
                visible_BTS: torch.Tensor | None = None) -> torch.Tensor:
        x_BTD = self.input_layernorm(h_BTD, dtype)
        a = self.self_attn(x_BTD, pos_BT, cos, sin, cache, S, opts, visible_BTS=visible_BTS)
        h_BTD = h_BTD + a.to(h_BTD.dtype)
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD, dtype)).to(h_BTD.dtype)


class Trunk(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList([Block(cfg, i, dtype) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, h_BTD, pos_BT, cos, sin, cache: KVCache, S: int, opts: RuntimeOptions, dtype,
                visible_BTS: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder blocks over the embedded tokens h_BTD (the fp32 residual stream), then the final norm:
        returns (normed in dtype, the residual before it). A module of its own so that a backend can swap the
        loop (the fast path hands each block's FFN all-reduce to the next block: `mtp.backends.fast_path`)."""
        for i, layer in enumerate(self.layers):
            h_BTD = layer(h_BTD, pos_BT, cos, sin, cache.layer(i), S, opts, dtype, visible_BTS)
        return self.norm(h_BTD, dtype), h_BTD


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)


class MTPLayer(Block):
    """One MTP module: u = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), a full decoder block, its own head."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__(cfg, layer_id, dtype)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, False, dtype)
        self.shared_head = SharedHead(cfg, dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)

    def eh_input(self, e_BTD: torch.Tensor, h_BTD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """eh_proj's input [B, T, 2D]: [enorm(e); hnorm(h)] in `dtype` (e: the token embeddings, h: the hidden states
        the module reads). A method of its own so that a backend can fuse it (`fast_path.FastMTPLayer`)."""
        return torch.cat((self.enorm(e_BTD, dtype), self.hnorm(h_BTD, dtype)), dim=-1)


class DeepseekV32(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, n_mtp: int | None = None,
                 runtime: RuntimeOptions | None = None):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.acc = fp8.acc_dtype(dtype)  # residual stream and logits: fp32 (fp64 for a float64 model)
        n_mtp = cfg.num_nextn_predict_layers if n_mtp is None else n_mtp
        self.model = Trunk(cfg, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        self.mtp = nn.ModuleList([MTPLayer(cfg, cfg.num_hidden_layers + j, dtype) for j in range(n_mtp)])
        self.rotary = Rotary(cfg)
        self._swap_version = 0  # `version`
        # the fast path's switches for this model (`mtp.kernels.dispatch.FastPathOptions`, shared by its fast
        # modules), None on the reference path; the reference never reads them
        self.fast_options = None
        self.runtime = RuntimeOptions()
        self.set_runtime(runtime or RuntimeOptions())

    # ------------------------------------------------------------------ set-up
    def set_runtime(self, runtime: RuntimeOptions) -> None:
        """Switch numerics / attention path at run time on the whole module tree."""
        self.runtime = runtime
        self.bump_version()
        for m in self.modules():
            if hasattr(m, "numerics"):
                m.numerics = runtime.numerics

    @property
    def version(self) -> int:
        """Changes whenever what a forward runs changes (a module swap such as the fast path or sharding, kernel
        switches, new run-time options): CUDA graphs captured at an older version hold stale kernels and weight
        pointers, so the engine captures again. Read-only: `bump_version` is its one writer."""
        return self._swap_version

    def bump_version(self) -> None:
        """Called by whatever changes what a forward runs (`set_runtime`, the fast path, `shard_model`)."""
        self._swap_version += 1

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def n_mtp(self) -> int:
        return len(self.mtp)

    def new_cache(self, batch: int, max_len: int, n_layers: int | None = None) -> KVCache:
        """A cache for the trunk (default) or, with n_layers=1, for one MTP module."""
        return KVCache(self.cfg, self.cfg.num_hidden_layers if n_layers is None else n_layers, batch, max_len,
                       device=self.device, dtype=self.dtype, quantized=self.runtime.numerics == "fp8")

    # ------------------------------------------------------------------ forward
    def positions(self, cache: KVCache, T: int, kv_len: int | None, tree_depth=None, tree_mask=None):
        """Cache slots [B, T], rotary angles, the key bound S and the tree's visibility [B, T, S] (None: causal)."""
        if (tree_depth is None) != (tree_mask is None):
            raise ValueError("a tree forward needs both tree_depth [T] and tree_mask [T, U] (or neither)")
        if tree_depth is None:
            pos_BT, cos, sin = self.rotary.slots(cache.seq_lens, T, kv_len)
            if kv_len is None:
                kv_len = int(pos_BT.max()) + 1  # host sync: only when the caller gives no bound
            self._check_room(cache, kv_len)
            return pos_BT, cos, sin, kv_len, None
        if tree_depth.shape[-1:] != (T,) or tree_mask.shape[-2] != T or tree_mask.shape[-1] < T:
            raise ValueError(f"tree_depth must be [T] or [B, T] and tree_mask [T, U] or [B, T, U] with T = {T} <= U, "
                             f"got {tuple(tree_depth.shape)} and {tuple(tree_mask.shape)}")
        if kv_len is None:
            kv_len = int(cache.seq_lens.max()) + T  # host sync: only when the caller gives no bound
        self._check_room(cache, kv_len)
        pos_BT, cos, sin, vis_BTS = self.rotary.tree_slots(cache.seq_lens, T, tree_depth, tree_mask, kv_len)
        return pos_BT, cos, sin, kv_len, vis_BTS

    @staticmethod
    def _check_room(cache: KVCache, kv_len: int) -> None:
        if kv_len > cache.max_len:
            raise ValueError(f"cache overflow: need {kv_len} positions, cache holds {cache.max_len}")

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None, *, kv_len: int | None = None,
                logits_at: torch.Tensor | None = None, tree_depth: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None) -> ModelOutput:
        """input_ids [B, T]. `kv_len`: a host-known bound on seq_lens + T (saves a sync).
        `logits_at` [B, n] positions within the T tokens whose logits to compute (default: all).
        `tree_depth` [T] / `tree_mask` [T, U] (or per row, [B, T] / [B, T, U]): tree nodes (module docstring)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if cache is None:
            cache = self.new_cache(B, T)
        elif cache.batch != B:
            raise ValueError(f"input batch {B} != cache batch {cache.batch}")
        pos_BT, cos, sin, S, vis = self.positions(cache, T, kv_len, tree_depth, tree_mask)
        h = self.model.embed_tokens(input_ids).to(self.acc)
        hidden, h = self.model(h, pos_BT, cos, sin, cache, S, self.runtime, self.dtype, vis)
        cache.seq_lens += T
        sel = hidden if logits_at is None else hidden.gather(1, logits_at.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        return ModelOutput(self.lm_head(sel, out_dtype=self.acc), hidden, h, None if logits_at is None else sel)

    def mtp_forward(self, j: int, tokens_BT: torch.Tensor, h_BTD: torch.Tensor, cache: KVCache,
                    kv_len: int | None = None, head=None, logits_at: torch.Tensor | None = None,
                    tree_depth: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None) -> ModelOutput:
        """MTP module j at the positions of `cache` (its own one-layer cache): token t_{i+1} and hidden h_i
        in, logits for t_{i+2} out. Returns the module's normed and pre-norm output hidden states.
        `head`: a callable that replaces the shared head (a draft vocabulary's `mtp.draft.vocab.SubHead`, the FP8
        copy `mtp.draft.head_fp8.Fp8Head`); the logits are then over its entries. `logits_at` [B, n]: positions within the T tokens whose logits to
        compute (default: all; a draft needs one per row, and a window over a long prompt would otherwise make
        [B, T, V] fp32 logits). `tree_depth` / `tree_mask`: the T tokens are tree nodes, as in `forward`."""
        layer = self.mtp[j]
        T = tokens_BT.shape[1]
        pos_BT, cos, sin, S, vis = self.positions(cache, T, kv_len, tree_depth, tree_mask)
        # the fp32 casts inside eh_proj's and the heads' forwards (a rank's fast path: one launch with the gathered
        # copy)
        u = layer.eh_proj(layer.eh_input(layer.embed_tokens(tokens_BT), h_BTD, self.dtype), out_dtype=self.acc)
        h = layer(u, pos_BT, cos, sin, cache.layer(0), S, self.runtime, self.dtype, vis)
        cache.seq_lens += T
        normed = layer.shared_head.norm(h, self.dtype)
        sel = normed
        if logits_at is not None:
            sel = normed.gather(1, logits_at.unsqueeze(-1).expand(-1, -1, normed.shape[-1]))
        logits = head(sel).to(self.acc) if head is not None else layer.shared_head.head(sel, out_dtype=self.acc)
        return ModelOutput(logits, normed, h, None if logits_at is None else sel)

