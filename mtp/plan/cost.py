"""Per layer and phase, on one rank: FLOPs, bytes (weights, KV cache, activations) and communication of one
forward of DeepSeek-V3.2, as a list of `Term`s. Weight bytes are `mtp.parallel.memory`'s per-rank bytes
(`rank_weight_bytes`, the same layout the sharded loader uses), cut per layer; nothing here re-derives them.

Legend: N tokens a rank's attention processes in one forward (batch x width), keys K a query attends, D hidden,
H heads on this rank (H_total / tp), E routed experts (E_loc on this rank), topk experts per token.
MACs are counted; FLOPs = 2 MACs. Each MAC is booked as 'fp8' (weight GEMMs on FP8 weights) or 'bf16'
(attention score / value products, absorb products, router, lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..model.config import ModelConfig
from ..placement import choose_layout
from ..parallel.layout import ParallelPlan, RankLayout
from ..parallel.memory import comm_bytes_per_forward, kv_bytes_per_token_layer, rank_weight_bytes

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class Layout:
    """tp: attention heads, dense / shared MLP and vocabulary split tp ways. ep: routed experts split ep ways.
    Without dp_attention one group of W = tp = ep ranks runs everything and every rank sees every token (our
    `mtp.parallel`: MoE partial sums ride the layer's all-reduce). With dp_attention, ep / tp attention groups
    each run their own batch and tokens reach their experts by all-to-all dispatch + combine (DeepEP style)."""

    tp: int = 1
    ep: int = 1
    dp_attention: bool = False
    nodes: int = 1
    mlp_split: str = "blocks"

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "nodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name} must be an integer >= 1, got {v!r}")
        if not self.dp_attention and self.ep != self.tp:
            raise ValueError(f"--ep {self.ep} must equal --tp {self.tp} without --dp-attention (one group of "
                             f"ranks runs attention and experts, mtp.parallel.layout)")
        if self.dp_attention and self.ep % self.tp:
            raise ValueError(f"--ep {self.ep} must be a multiple of --tp {self.tp} with --dp-attention")

    @property
    def world(self) -> int:
        return self.ep

    @property
    def dp(self) -> int:
        return self.ep // self.tp


@dataclass(frozen=True)
class Comm:
    op: str  # all_reduce | all_gather | dispatch | combine
    nbytes: float  # per call, leaving / reduced on one rank
    count: int = 1
    fused: bool = False  # an all-reduce at a block boundary: joined with the add + norm + quant under oneshot


@dataclass(frozen=True)
class Term:
    name: str
    kind: str  # kernel class the calibration fits one efficiency for: weights, experts, attention, indexer, head
    layers: int  # how many times one forward runs it
    flops_fp8: float
    flops_bf16: float
    weight_bytes: float
    kv_bytes: float = 0.0
    act_bytes: float = 0.0
    # kernels per layer on our fast path at this shape: `mtp.plan.kernels.terms` (decode; the head's term holds the
    # step's glue), `PREFILL_LAUNCHES` for a prefill (the reference path: its launches are not modelled)
    launches: int = 0
    comm: tuple[Comm, ...] = ()
    macs: dict = field(default_factory=dict, compare=False)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.act_bytes


# ---- MLA: three ways to compute the same attention, by name --------------------------------------------------
def mla_naive(cfg: ModelConfig, q: float, keys: float, pairs: float, H: int) -> dict[str, tuple[float, str]]:
    """Prefill form: up-project every key's latent to per-head K and V, then standard attention."""
    return {"q_a": (q * cfg.hidden_size * cfg.q_lora_rank, "fp8"),
            "q_b": (q * cfg.q_lora_rank * H * cfg.qk_head_dim, "fp8"),
            "kv_a": (q * cfg.hidden_size * (cfg.kv_lora_rank + cfg.qk_rope_head_dim), "fp8"),
            "k_up": (keys * cfg.kv_lora_rank * H * cfg.qk_nope_head_dim, "fp8"),
            "v_up": (keys * cfg.kv_lora_rank * H * cfg.v_head_dim, "fp8"),
            "scores": (pairs * H * cfg.qk_head_dim, "bf16"),
            "values": (pairs * H * cfg.v_head_dim, "bf16"),
            "o_proj": (q * H * cfg.v_head_dim * cfg.hidden_size, "fp8")}


def mla_absorbed(cfg: ModelConfig, q: float, keys: float, pairs: float, H: int) -> dict[str, tuple[float, str]]:
    """Decode form of DeepSeek's reference (and ours): the query is multiplied into latent space per token
    (W_UK), attention runs over the 512 + 64 latent, the output leaves latent space (W_UV) before o_proj."""
    C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return {"q_a": (q * cfg.hidden_size * cfg.q_lora_rank, "fp8"),
            "q_b": (q * cfg.q_lora_rank * H * cfg.qk_head_dim, "fp8"),
            "kv_a": (q * cfg.hidden_size * (C + R), "fp8"),
            "absorb_q": (q * H * cfg.qk_nope_head_dim * C, "bf16"),
            "scores": (pairs * H * (C + R), "bf16"),
            "values": (pairs * H * C, "bf16"),
            "absorb_o": (q * H * C * cfg.v_head_dim, "bf16"),
            "o_proj": (q * H * cfg.v_head_dim * cfg.hidden_size, "fp8")}


def mla_premultiplied(cfg: ModelConfig, q: float, keys: float, pairs: float, H: int) -> dict[str, tuple[float, str]]:
    """W_UK folded into W_UQ and W_UV into W_O ahead of time (DeepSeek-V2 paper; zartbot's 'MLA_absorb'): bigger
    weights ([q_lora, H * C] and [H * C, D]), no per-token absorb products."""
    C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return {"q_a": (q * cfg.hidden_size * cfg.q_lora_rank, "fp8"),
            "q_rope": (q * cfg.q_lora_rank * H * R, "fp8"),
            "q_absorb": (q * H * cfg.q_lora_rank * C, "fp8"),
            "kv_a": (q * cfg.hidden_size * (C + R), "fp8"),
            "scores": (pairs * H * (C + R), "bf16"),
            "values": (pairs * H * C, "bf16"),
            "o_proj": (q * H * C * cfg.hidden_size, "fp8")}


MLA_FORMS = {"naive": mla_naive, "absorbed": mla_absorbed, "premultiplied": mla_premultiplied}


def mla_form(name: str):
    try:
        return MLA_FORMS[name]
    except KeyError:
        raise ValueError(f"MLA form must be one of {sorted(MLA_FORMS)}, got {name!r}") from None


# ---- bytes from the memory model -----------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _category_bytes(cfg: ModelConfig, world: int, mlp_split: str, n_mtp: int) -> dict[str, int]:
    return rank_weight_bytes(cfg, ParallelPlan(world=world, mlp_split=mlp_split), 0, torch.bfloat16, n_mtp)


# categories split tp ways (attention group) vs ep ways (expert group); the rest are replicated
_EP_CATEGORIES = ("routed experts",)


def rank_bytes(cfg: ModelConfig, lay: Layout, n_mtp: int = 0) -> dict[str, int]:
    """{category: bytes} rank 0 holds: `mtp.parallel.memory.rank_weight_bytes` at world tp for the attention
    group's categories and at world ep for the routed experts. Equals `weight_bytes_by_rank(...)[0]` when
    tp == ep."""
    at_tp = _category_bytes(cfg, lay.tp, lay.mlp_split, n_mtp)
    at_ep = _category_bytes(cfg, lay.ep, lay.mlp_split, n_mtp)
    return {c: (at_ep if c in _EP_CATEGORIES else at_tp).get(c, 0) for c in set(at_tp) | set(at_ep)}


def kv_split(cfg: ModelConfig) -> tuple[int, int]:
    """(MLA, indexer) bytes per cached position and layer; they sum to `memory.kv_bytes_per_token_layer`. The
    indexer key is index_head_dim fp8 + one fp32 scale (`mtp.model.cache.KVCache`)."""
    total = kv_bytes_per_token_layer(cfg, torch.bfloat16, True)
    idx = cfg.index_head_dim + 4
    return total - idx, idx


def experts_touched(e_local: int, n_experts: int, topk: int, tokens: float) -> float:
    """Expected experts of E_loc a rank reads when `tokens` each pick topk of E uniformly."""
    return e_local * (1.0 - (1.0 - topk / n_experts) ** tokens)


@dataclass(frozen=True)
class Shape:
    """One forward on one rank. rows: sequences (batch), width: new tokens per row, context: keys per row
    after this forward. causal: prefill queries see only earlier keys (pairs ~ width^2 / 2 per row)."""

    rows: int
    width: int
    context: int
    phase: str = "decode"
    mla: str = "absorbed"
    dsa: bool = True  # the lightning indexer picks index_topk keys past index_topk context
    causal: bool = True
    touched: float | None = None  # routed experts a rank reads per MoE layer (None: uniform-routing expectation)
    cache_len: int | None = None  # keys the cache holds per row (None: exactly context; `kernels.StepShape`)
    expert_layout: str = "auto"  # the rank's expert layout (`kernels.StepShape`)
    # the launch structure's switches and thresholds of the code that ran (`kernels.Limits`; None: this code's), so a
    # measurement of older code is counted as it launched (`calibrate.measured_code`)
    launch_limits: object | None = None


# a prefill's launches per layer (it runs the reference path, whose launch count is not modelled; its time is
# FLOPs): the decode counts of the session-4 profile, kept so that a prefill's fixed cost stays what it was
PREFILL_LAUNCHES = {"mla": 11, "indexer": 2, "dense_mlp": 4, "routed_experts": 3, "shared_expert": 4, "router": 1,
                    "head": 3, "mtp_extra": 3}


def launches_of(cfg: ModelConfig, lay: Layout, sh: Shape) -> dict[str, int]:
    """Kernels per layer of each term: the fast path's launch structure (`mtp.plan.kernels`) for a decode."""
    if sh.phase != "decode":
        return PREFILL_LAUNCHES
    from .kernels import StepShape, terms

    return terms(cfg, StepShape(sh.rows, sh.width, sh.context, lay.tp, sh.cache_len, sh.expert_layout),
                 sh.launch_limits)


def forward_terms(cfg: ModelConfig, lay: Layout, sh: Shape, act_bytes_per: int = 2) -> list[Term]:
    """The terms of one target forward on rank 0 (trunk: n_layers blocks + head)."""
    if sh.phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {sh.phase!r}")
    n_launch = launches_of(cfg, lay, sh)
    D, L, N = cfg.hidden_size, sh.context, sh.rows * sh.width
    H = cfg.num_attention_heads // lay.tp
    n_dense = cfg.first_k_dense_replace
    n_moe = cfg.num_hidden_layers - n_dense
    cat = rank_bytes(cfg, lay)
    new_keys = sh.width
    prior = L - new_keys
    # keys each query attends: all earlier ones, capped at index_topk when the indexer selects
    dsa_on = sh.dsa and cfg.index_topk is not None and L > cfg.index_topk
    if sh.causal:
        per_row_pairs = sum(min(prior + i + 1, cfg.index_topk if dsa_on else L) for i in range(sh.width)) \
            if sh.width <= 64 else sh.width * (prior + (sh.width + 1) / 2)
    else:
        per_row_pairs = sh.width * L
    if dsa_on and sh.width > 64:
        per_row_pairs = min(per_row_pairs, sh.width * cfg.index_topk)
    pairs = sh.rows * per_row_pairs
    keys_read = sh.rows * (min(L, cfg.index_topk) if dsa_on else L)
    kv_mla, kv_idx = kv_split(cfg)
    mla_macs = mla_form(sh.mla)(cfg, N, sh.rows * L, pairs, H)
    attn_w = cat.get("attention (head-split)", 0) + cat.get("attention (replicated)", 0) + cat.get("norms", 0)
    ar = comm_bytes_per_forward(cfg, N, 1, torch.bfloat16)["per_block_all_reduce"]
    tp_comm = (Comm("all_reduce", ar, 1, fused=True),) if lay.tp > 1 else ()
    terms = [_term("mla", "attention", cfg.num_hidden_layers, mla_macs, attn_w / cfg.num_hidden_layers,
                   kv=keys_read * kv_mla, act=N * D * act_bytes_per * 2, launches=n_launch["mla"], comm=tp_comm)]
    if dsa_on:
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        visible = sh.width * (prior + (sh.width + 1) / 2) if sh.causal else sh.width * L  # keys each query scores
        ix = {"wq": (N * cfg.q_lora_rank * Hi * Di, "fp8"), "wk": (N * D * Di, "fp8"),
              "weights": (N * D * Hi, "bf16"), "scores": (sh.rows * visible * Hi * Di, "fp8")}
        terms.append(_term("indexer", "indexer", cfg.num_hidden_layers, ix,
                           cat.get("indexer (replicated)", 0) / cfg.num_hidden_layers,
                           kv=sh.rows * L * kv_idx, launches=n_launch["indexer"]))
    # MLPs: tokens reaching this rank's MLP weights
    mlp_comm = tp_comm if not lay.dp_attention else ()
    local = RankLayout(cfg, ParallelPlan(world=lay.tp, mlp_split=lay.mlp_split), 0)  # rank 0's MLP channels
    if n_dense:
        inter = local.dense[1] - local.dense[0]
        terms.append(_term("dense_mlp", "weights", n_dense, {"mlp": (N * 3 * D * inter, "fp8")},
                           cat.get("dense MLP", 0) / n_dense, act=N * D * act_bytes_per * 2,
                           launches=n_launch["dense_mlp"], comm=mlp_comm))
    if n_moe:
        e_loc = cfg.n_routed_experts // lay.ep
        # (token, expert) pairs this rank computes: every rank sees all N tokens and keeps its experts' share;
        # with DP attention the dp groups' N tokens each reach the ep ranks by all-to-all
        seen = N * (lay.dp if lay.dp_attention else 1)  # tokens whose routing this rank's experts see
        routed_tokens = seen * cfg.num_experts_per_tok / lay.ep
        # 'split' (`mtp.placement`): every rank holds a 1 / ep slice of every expert, so any of the E experts may be
        # touched (a measured `touched` counts them so) and each costs a slice's bytes; else E / ep whole experts.
        # Under uniform routing both give the same expected bytes; a measured count of a split rank read as whole
        # experts was ep times too many (session 15: a 16.3 ms roofline for an 8.6 ms step at w = 4)
        split = lay.ep > 1 and choose_layout(sh.expert_layout, cfg.moe_intermediate_size, lay.ep) == "split"
        held = cfg.n_routed_experts if split else e_loc
        touched = sh.touched if sh.touched is not None else experts_touched(
            held, cfg.n_routed_experts, cfg.num_experts_per_tok, seen)
        per_expert = cat.get("routed experts", 0) / n_moe / max(held, 1)
        a2a: tuple[Comm, ...] = ()
        if lay.dp_attention and lay.ep > 1:  # a TP group's ranks each send a 1 / tp share of its tokens
            remote = N / lay.tp * cfg.num_experts_per_tok * (1 - e_loc / cfg.n_routed_experts)
            a2a = (Comm("dispatch", remote * D * 1), Comm("combine", remote * D * 2))
        terms.append(_term("routed_experts", "experts", n_moe,
                           {"experts": (routed_tokens * 3 * D * cfg.moe_intermediate_size, "fp8")},
                           touched * per_expert, act=routed_tokens * D * 3, launches=n_launch["routed_experts"],
                           comm=a2a + mlp_comm))
        shared_inter = local.shared[1] - local.shared[0]
        terms.append(_term("shared_expert", "weights", n_moe, {"mlp": (N * 3 * D * shared_inter, "fp8")},
                           cat.get("shared experts", 0) / n_moe, launches=n_launch["shared_expert"]))
        terms.append(_term("router", "weights", n_moe, {"gate": (N * D * cfg.n_routed_experts, "bf16")},
                           cat.get("router", 0) / n_moe, launches=n_launch["router"]))
    head = cat.get("embedding + lm_head", 0) / 2  # lm_head; the embedding reads N rows
    hc = comm_bytes_per_forward(cfg, N, 0, torch.bfloat16)
    head_comm = (Comm("all_reduce", hc["embedding_all_reduce"]), Comm("all_gather", hc["logits_all_gather"])) \
        if lay.tp > 1 else ()
    terms.append(_term("head", "head", 1, {"lm_head": (N * D * cfg.vocab_size / lay.tp, "bf16")}, head,
                       act=N * D * 2, launches=n_launch["head"], comm=head_comm))
    return terms


def draft_terms(cfg: ModelConfig, lay: Layout, sh: Shape) -> list[Term]:
    """One MTP module forward (eh_proj + one MoE block + its head) at the shape given: the trunk's per-layer
    terms once, plus the module's own extras (bytes: memory model with one MTP module minus without)."""
    # the module's head, glue and own layers are launched in `mtp_extra` (the head term's launches are the trunk's)
    one = [Term(t.name, t.kind, 1, t.flops_fp8, t.flops_bf16, t.weight_bytes, t.kv_bytes, t.act_bytes,
                0 if t.name == "head" else t.launches, _module_reduces(t), t.macs)
           for t in forward_terms(cfg, lay, sh) if t.name not in ("dense_mlp",)]
    with_mtp, trunk = rank_bytes(cfg, lay, 1), rank_bytes(cfg, lay)
    extras = with_mtp.get("MTP extras", 0) - trunk.get("MTP extras", 0)
    embed_copy = trunk.get("embedding + lm_head", 0) / 2
    N = sh.rows * sh.width
    # eh_proj is column parallel (mtp.parallel.layout): a rank's D / tp output rows, then their all-gather
    eh_comm = (Comm("all_gather", comm_bytes_per_forward(cfg, N, 0, torch.bfloat16, mtp=True)["eh_proj_all_gather"]),) \
        if lay.tp > 1 else ()
    one.append(_term("mtp_eh_proj", "weights", 1, {"eh_proj": (N * 2 * cfg.hidden_size ** 2 / lay.tp, "fp8")},
                     max(extras - 2 * embed_copy, 0), launches=launches_of(cfg, lay, sh)["mtp_extra"], comm=eh_comm))
    return one


def _module_reduces(t: Term) -> tuple[Comm, ...]:
    """An MTP module reduces its FFN itself: that all-reduce is not fused with a norm (mtp/parallel/DESIGN.md)."""
    if t.name != "routed_experts":
        return t.comm
    return tuple(Comm(c.op, c.nbytes, c.count) if c.op == "all_reduce" else c for c in t.comm)


def _term(name: str, kind: str, layers: int, macs: dict, weight_bytes: float, kv: float = 0.0, act: float = 0.0,
          launches: int = 0, comm: tuple = ()) -> Term:
    fp8 = 2 * sum(m for m, p in macs.values() if p == "fp8")
    bf16 = 2 * sum(m for m, p in macs.values() if p == "bf16")
    return Term(name, kind, layers, fp8, bf16, weight_bytes, kv, act, launches, tuple(comm), dict(macs))
