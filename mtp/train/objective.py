"""Training objectives: the DeepSeek-V3 MTP loss, the DSA indexer's KL objective, aux-loss-free balancing.

Shape legend: B batch, T positions, H attention heads, Hi indexer heads, S keys, D width, V vocabulary, E experts.

MTP loss (DeepSeek-V3 report, section 2.2): L = L_main + (lambda / D) * sum_k L_mtp_k. Module k (1-based) at
position i takes h^{k-1}_i and embed(t_{i+k}) and predicts t_{i+k+1}; h^0 is the trunk's hidden after the
final norm and h^k is module k's output after its shared_head.norm (what `mtp.decode.engine` feeds by default,
`target_hidden = chain_hidden = 'normed'`).

Indexer (DeepSeek-V3.2 report, section 2.1): for query t the target is the main attention distribution summed
over heads and L1-normalized, p_t; the loss is KL(p_t || softmax(I_t)) over the visible keys (dense stage) or
over the keys the indexer selected (sparse stage). The indexer's inputs are detached, so the indexer learns
only from this loss and the language model only from its own. Both the attention target and the index score
are recomputed here from the live modules' weights (hooks capture each MLA's input); `tests/train/test_train.py`
holds the recomputation to the modules' own forward.

Balance (DeepSeek-V3, section 2.1.2): after each step, e_score_correction_bias += gamma * sign(mean load -
load) per MoE layer, counting the expert choices of every token of the step. No auxiliary loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model import fp8
from ..model.attention import MLA, Indexer
from ..model.cache import KVCache, LayerCache
from ..model.deepseek import DeepseekV32
from ..model.moe import Gate

DENSE_TOPK = 1 << 30  # an index_topk no context reaches: the indexer keeps every visible key


@dataclass
class Losses:
    total: torch.Tensor
    main: torch.Tensor
    mtp: list[torch.Tensor]
    indexer: torch.Tensor | None = None

    def scalars(self) -> dict[str, float]:
        """Host values for logging (one sync)."""
        vals = torch.stack([self.total.detach(), self.main.detach(), *[m.detach() for m in self.mtp],
                            *([self.indexer.detach()] if self.indexer is not None else [])]).float().cpu().tolist()
        out = {"loss/total": vals[0], "loss/main": vals[1]}
        out.update({f"loss/mtp_{k + 1}": v for k, v in enumerate(vals[2: 2 + len(self.mtp)])})
        if self.indexer is not None:
            out["loss/indexer_kl"] = vals[-1]
        return out


class TrainCache(KVCache):
    """A KV cache whose layers are separate tensors, so autograd can keep each layer's saved reads.

    `KVCache` stores all layers in one [L, ...] tensor; a write into layer i bumps the version counter of the
    shared base, and autograd then refuses the backward through the reads of layers < i ("modified by an
    inplace operation"). Training needs no static buffers, so it gets one tensor per layer instead.
    """

    def __init__(self, cfg, n_layers: int, batch: int, max_len: int, device, dtype: torch.dtype):
        super().__init__(cfg, 0, batch, max_len, device=device, dtype=dtype, quantized=False)
        self.n_layers = n_layers
        self._layers = [
            LayerCache(kv=torch.zeros(batch, max_len, cfg.kv_lora_rank, dtype=dtype, device=device),
                       kv_scale=torch.ones(batch, max_len, max(cfg.kv_lora_rank // fp8.BLOCK, 1), device=device),
                       pe=torch.zeros(batch, max_len, cfg.qk_rope_head_dim, dtype=dtype, device=device),
                       idx_k=torch.zeros(batch, max_len, cfg.index_head_dim, dtype=dtype, device=device),
                       idx_k_scale=torch.ones(batch, max_len, device=device), seq_lens=self.seq_lens,
                       quantized=False)
            for _ in range(n_layers)]

    def layer(self, i: int) -> LayerCache:
        return self._layers[i]


def mtp_chain(model: DeepseekV32, ids_BT1: torch.Tensor, n_modules: int | None = None):
    """Main logits and each MTP module's logits with their targets, for a batch of T+1 tokens.

    Returns (main_logits [B, T, V], main targets [B, T], [(logits_k [B, T-k, V], targets_k [B, T-k])])."""
    D = model.n_mtp if n_modules is None else n_modules
    B, T1 = ids_BT1.shape
    T = T1 - 1
    out = model(ids_BT1[:, :T], TrainCache(model.cfg, model.cfg.num_hidden_layers, B, T, model.device, model.dtype),
                kv_len=T)
    h = out.hidden
    heads = []
    for k in range(1, D + 1):
        n = T - k
        cache = TrainCache(model.cfg, 1, B, n, model.device, model.dtype)
        o = model.mtp_forward(k - 1, ids_BT1[:, k: k + n], h[:, :n], cache, kv_len=n)
        heads.append((o.logits, ids_BT1[:, k + 1: k + 1 + n]))
        h = o.hidden
    return out.logits, ids_BT1[:, 1:], heads


def ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def lm_losses(model: DeepseekV32, ids_BT1: torch.Tensor, mtp_lambda: float) -> Losses:
    main_logits, main_tgt, heads = mtp_chain(model, ids_BT1)
    main = ce(main_logits, main_tgt)
    mtp = [ce(lg, tg) for lg, tg in heads]
    total = main + (mtp_lambda / len(mtp)) * torch.stack(mtp).sum() if mtp else main
    return Losses(total, main, mtp)


# ---------------------------------------------------------------------------------------------- indexer
def causal_mask(T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def attention_probs(mla: MLA, x_BTD: torch.Tensor, cos, sin, keep_BTS: torch.Tensor) -> torch.Tensor:
    """MLA's attention distribution [B, H, T, S] (keys = the same T tokens), as MLA._naive computes it with
    dequant numerics; keys outside `keep_BTS` get probability 0."""
    B, T, _ = x_BTD.shape
    _, q_nope, q_pe, c, k_pe = mla.project(x_BTD, cos, sin)
    k_nope = mla.kv_b_proj(c).view(B, T, mla.H, mla.P + mla.V)[..., : mla.P]
    scores = torch.einsum("bthp,bshp->bhts", q_nope.float(), k_nope.float())
    scores = scores + torch.einsum("bthr,bsr->bhts", q_pe.float(), k_pe.float())
    scores = (scores * mla.softmax_scale).masked_fill(~keep_BTS.unsqueeze(1), float("-inf"))
    return scores.softmax(dim=-1)


def index_scores(idx: Indexer, x_BTD: torch.Tensor, qr_BTQ: torch.Tensor, cos, sin) -> torch.Tensor:
    """The lightning indexer's score I[b, t, s] over the same T tokens (before masking), differentiable in the
    indexer's weights; the same math as `Indexer.select` with dequant numerics."""
    q = idx.queries(qr_BTQ, cos, sin).float()
    k = idx.keys(x_BTD, cos, sin).float()
    w = F.linear(x_BTD.float(), idx.weights_proj.weight.float()) * idx.n_heads ** -0.5
    dots = torch.einsum("bthd,bsd->bths", q, k).relu()
    return torch.einsum("bth,bths->bts", w * idx.head_dim ** -0.5, dots)


def indexer_kl(mla: MLA, x_BTD: torch.Tensor, cos, sin, topk: int) -> torch.Tensor:
    """KL(attention summed over heads || softmax(index score)) per query, averaged; inputs detached.
    topk < T: the sparse stage, both distributions restricted to the keys the indexer selects."""
    x = x_BTD.detach()
    B, T, _ = x.shape
    visible = causal_mask(T, x.device).expand(B, T, T)
    with torch.no_grad():
        qr = mla.q_a_layernorm(mla.q_a_proj(x), x.dtype)
    score = index_scores(mla.indexer, x, qr, cos, sin).masked_fill(~visible, float("-inf"))
    keep = visible
    if topk < T:
        order = torch.sort(score.detach(), dim=-1, descending=True, stable=True).indices[..., :topk]
        keep = torch.zeros_like(visible).scatter_(-1, order, True) & visible
    with torch.no_grad():
        p = attention_probs(mla, x, cos, sin, keep).sum(1) / mla.H  # [B, T, S], rows sum to 1
    logq = score.masked_fill(~keep, float("-inf")).log_softmax(dim=-1)
    kl = torch.where(p > 0, p * (p.clamp_min(1e-30).log() - logq), torch.zeros_like(p)).sum(-1)
    return kl.mean()


class Capture:
    """Forward hooks on every MLA (its input, for the indexer loss) and every router (expert loads)."""

    def __init__(self, model: torch.nn.Module, rows: int):
        self.rows = rows
        self.active = False
        self.inputs: list[tuple[MLA, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.gates = [m for m in model.modules() if isinstance(m, Gate)]
        self.loads = {id(g): torch.zeros(g.n_experts, device=g.weight.device) for g in self.gates}
        self._handles = [m.register_forward_pre_hook(self._mla_hook) for m in model.modules() if isinstance(m, MLA)]
        self._handles += [g.register_forward_hook(self._gate_hook) for g in self.gates]

    def _mla_hook(self, mla, args):
        if self.active:
            x, _pos, cos, sin = args[:4]
            r = self.rows
            self.inputs.append((mla, x[:r], cos[:r], sin[:r]))

    def _gate_hook(self, gate, args, out):
        if self.active:
            ids = out[1].reshape(-1)
            self.loads[id(gate)] += torch.bincount(ids, minlength=gate.n_experts).to(self.loads[id(gate)].dtype)

    def indexer_loss(self, topk: int) -> torch.Tensor | None:
        if not self.inputs:
            return None
        kls = [indexer_kl(mla, x, cos, sin, topk) for mla, x, cos, sin in self.inputs]
        return torch.stack(kls).mean()

    @torch.no_grad()
    def update_biases(self, gamma: float) -> dict[str, torch.Tensor]:
        """The aux-loss-free balance step; returns max/mean load per router (device tensors, no sync)."""
        stats = {}
        for i, g in enumerate(self.gates):
            load = self.loads[id(g)]
            if gamma > 0:
                g.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
            stats[f"balance/max_over_mean_{i}"] = load.max() / load.mean().clamp_min(1e-9)
            load.zero_()
        return stats

    def clear(self) -> None:
        self.inputs.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def set_index_topk(model: DeepseekV32, topk: int) -> None:
    """The indexer's top-k on every layer: DENSE_TOPK during the dense stage, the config value after."""
    for m in model.modules():
        if isinstance(m, Indexer):
            m.topk = topk
