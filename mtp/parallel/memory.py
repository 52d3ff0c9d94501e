"""Memory planner (`mtp-plan`): will a DeepSeek-V3.2 checkpoint and its caches fit on N GPUs, and how?

    mtp-plan config.json --gpus 8 --gpu-mem-gib 141                  # one node, 8 x H200
    mtp-plan config.json --gpus 8 --nodes 2 --gpu-mem-gib 80         # two nodes, 16 x H100

Per rank it prints:
- weights: every tensor of `mtp.checkpoint.inventory.checkpoint_spec`, cut by the same `mtp.parallel.layout.RankLayout` the
  sharded loader uses, in the dtype the loaded model holds it (FP8 1 byte + fp32 re-blocked scales; bf16
  tensors in the model dtype; router bias and indexer LayerNorm fp32). Equal, byte for byte, to the
  parameters `mtp.parallel.load_parallel` materializes (tests/parallel/test_memory.py checks it on a real load).
- KV cache: per token and layer (trunk + draft caches: eagle 1, vanilla k) what `mtp.model.cache.KVCache` stores:
  latent 512 fp8 + 4 fp32 scales, k_pe 64 in the model dtype, indexer key 128 fp8 + 1 fp32 scale
  (788 B in bf16). MLA's latent is shared by all heads, so with head-split attention every rank holds the
  whole cache (as DeepSeek's reference does).
- engine buffers: the engine's token and hidden-state buffers [B, max_len] and [B, max_len, D].
- draft head FP8 copy (`--draft-head-fp8`, `mtp.draft.head_fp8`): per MTP module the drafts read, the rank's
  vocabulary rows of its head in e4m3 + fp32 scales per 128 x 128 block (116 MB at TP=8, the bf16 shard's half),
  beside the bf16 head the verify keeps.
- rotary angle table: the fast path's (`mtp.backends.fast_path.FastRotary`, switch rope_table) cos and sin of every
  position, fp32 [max_position_embeddings, R/2] each, one per rank (`Rotary.angle_table_bytes`: 42 MB at
  DeepSeek-V3.2's 163840), counted whichever path runs.
- workspace: an ESTIMATE. Decode/verify step (B * (k+1) tokens), all counted as live at once: on the
  reference attention path the model runs today (each layer dequantizes the cache to fp32 and scores every
  key with every indexer head), and, for comparison, on the kernel path (indexer scores [B, T, S] fp32 +
  top-k ids, MLA split-KV partials); plus fp32 activations, MoE (token, slot) partials and logits. A CUDA
  graph keeps that much in its private pool (one shared pool for all batch buckets). Prefill: one eager forward over the prompt on the reference path (what `Engine.run` does
  today): indexer head dots [B, P, Hi, P] fp32 dominate, so the planner also prints the longest prompt
  that fits in one forward (longer prompts need chunked prefill). Plus a fixed reserve (CUDA context,
  NCCL buffers, allocator slack).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace

import torch

from ..model.cache import KVCache
from ..model.layers import Rotary
from ..draft.modes import DRAFTERS, drafter
from ..model.config import BLOCK, NUMERICS, ConfigError, ModelConfig
from .layout import MLP_SPLITS, ParallelPlan, RankLayout
from .reblock import scale_rows
from ..checkpoint.inventory import checkpoint_spec

GIB = 1024 ** 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}  # model dtypes by their CLI names
CATEGORIES = ("embedding + lm_head", "attention (head-split)", "attention (replicated)", "indexer (replicated)",
              "dense MLP", "routed experts", "shared experts", "router", "norms", "MTP extras")


def category(name: str, cfg: ModelConfig) -> str:
    """Which line of the report a checkpoint tensor is counted in."""
    base = name.replace(".weight_scale_inv", ".weight")
    if base in ("model.embed_tokens.weight", "lm_head.weight"):
        return "embedding + lm_head"
    if base == "model.norm.weight":
        return "norms"
    rest = base.split(".", 3)[3]  # after model.layers.N.
    if rest.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")):
        return "MTP extras"
    if rest.startswith("self_attn.indexer."):
        return "indexer (replicated)"
    if rest.startswith(("self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj")):
        return "attention (head-split)"
    if rest.startswith("self_attn."):
        return "attention (replicated)"
    if rest.startswith("mlp.experts."):
        return "routed experts"
    if rest.startswith("mlp.shared_experts."):
        return "shared experts"
    if rest.startswith("mlp.gate."):
        return "router"
    if rest.startswith("mlp."):
        return "dense MLP"
    return "norms"


def rank_weight_bytes(cfg: ModelConfig, plan: ParallelPlan, rank: int, dtype: torch.dtype = torch.bfloat16,
                      n_mtp: int | None = None) -> dict[str, int]:
    """{category: bytes} of the parameters rank `rank` loads (see the module docstring for dtypes)."""
    spec = checkpoint_spec(cfg, n_mtp)
    layout = RankLayout(cfg, plan, rank)
    model_b = dtype.itemsize
    out: dict[str, int] = defaultdict(int)
    for name, ts in spec.items():
        shard = layout.shard(name)
        if shard is None:
            continue
        if ts.kind == "scale":
            n, k = shard.local_shape(spec[name.replace(".weight_scale_inv", ".weight")].shape)
            nbytes = math.ceil(n / scale_rows(layout, name)) * math.ceil(k / BLOCK) * 4
        else:
            per = {"fp8": 1, "fp32": 4, "norm": 4, "bf16": model_b}[ts.kind]
            nbytes = math.prod(shard.local_shape(ts.shape)) * per
        out[category(name, cfg)] += nbytes
    return dict(out)


def weight_bytes_by_rank(cfg: ModelConfig, plan: ParallelPlan, dtype: torch.dtype = torch.bfloat16,
                         n_mtp: int | None = None) -> list[dict[str, int]]:
    """`rank_weight_bytes` for every rank. Ranks differ only in their MLP block counts ('blocks' split),
    so one rank per distinct (dense, shared) width is computed."""
    memo: dict[tuple[int, int], dict[str, int]] = {}
    out = []
    for r in range(plan.world):
        lay = RankLayout(cfg, plan, r)
        key = (lay.dense[1] - lay.dense[0], lay.shared[1] - lay.shared[0])
        if key not in memo:
            memo[key] = rank_weight_bytes(cfg, plan, r, dtype, n_mtp)
        out.append(memo[key])
    return out


def kv_bytes_per_token_layer(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, quantized: bool = True) -> int:
    """Bytes one position of one layer takes in `mtp.model.cache.KVCache` (fp8 numerics store real FP8)."""
    return KVCache.bytes_per_position(cfg, dtype, quantized)


def comm_bytes_per_forward(cfg: ModelConfig, tokens: int, blocks: int, dtype: torch.dtype = torch.bfloat16,
                           mtp: bool = False) -> dict:
    """Collective payloads of one tensor-parallel forward over `tokens` tokens and `blocks` blocks: one embedding
    all-reduce [N, D] in the model dtype, two fp32 all-reduces [N, D] per block (attention out, MLP / MoE out),
    one all-gather of the logits [N, V] (bytes: the gathered tensor). mtp: an MTP module's forward (a draft
    forward), which also all-gathers its column-parallel eh_proj output [N, D] in the model dtype."""
    D, dt = cfg.hidden_size, dtype.itemsize
    out = {"embedding_all_reduce": tokens * D * dt, "per_block_all_reduce": tokens * D * 4,
           "logits_all_gather": tokens * cfg.vocab_size * dt, "eh_proj_all_gather": tokens * D * dt if mtp else 0}
    out["total"] = (out["embedding_all_reduce"] + 2 * blocks * out["per_block_all_reduce"] + out["logits_all_gather"]
                    + out["eh_proj_all_gather"])
    return out


def collectives_per_forward(cfg: ModelConfig, blocks: int, mtp: bool = False) -> int:
    """Collectives `comm_bytes_per_forward` counts: the embedding's all-reduce, two per block, the logits'
    all-gather, and an MTP module's eh_proj all-gather."""
    return 1 + 2 * blocks + 1 + int(mtp)


def draft_cache_layers(draft: str, k: int) -> int:
    return drafter(draft).n_caches(k)


def draft_head_fp8_bytes(cfg: ModelConfig, plan: ParallelPlan, draft: str, k: int, rank: int = 0) -> int:
    """Bytes of the FP8 copies of the MTP heads that `draft` with k drafts reads under draft_head_fp8
    (`mtp.draft.head_fp8.Fp8Head.nbytes`): one per module used, each the rank's vocabulary rows [Vl, D] in e4m3 plus
    fp32 scales [ceil(Vl / 128), ceil(D / 128)]."""
    d = drafter(draft)
    if not d.drafts or not k:
        return 0
    n_mtp = cfg.num_nextn_predict_layers
    modules = len({d.module_for(j, n_mtp) for j in range(k)})
    v0, v1 = RankLayout(cfg, plan, rank).vocab
    rows, D = v1 - v0, cfg.hidden_size
    return modules * (rows * D + math.ceil(rows / BLOCK) * math.ceil(D / BLOCK) * 4)


@dataclass(frozen=True)
class Workload:
    batch: int = 1
    max_len: int = 32768  # positions per row (prompt + generated + 3k + 2, as Engine.run allocates)
    prompt_len: int = 4096  # tokens of the one-shot prefill
    draft: str = "eagle"
    k: int = 2
    numerics: str = "fp8"
    dtype: str = "bf16"
    head_fp8: bool = False  # the drafts read an FP8 copy of the head (draft_head_fp8)


@dataclass
class MemoryPlan:
    world: int
    gpus_per_node: int
    nodes: int
    gpu_mem_bytes: int
    weights_by_rank: list[dict[str, int]]
    kv_per_token_layer: int
    kv_layers: int
    kv_bytes: int
    engine_bytes: int
    step_workspace: int
    step_workspace_kernel: int
    prefill_workspace: int
    reserve_bytes: int
    max_prefill_tokens: int
    max_kv_tokens: int
    collectives_per_step: int
    comm_bytes_per_step: int
    notes: list[str] = field(default_factory=list)
    draft_head_bytes: int = 0  # the FP8 copies of the drafts' heads (`draft_head_fp8_bytes`), 0 without them
    rope_table_bytes: int = 0  # the fast path's rotary angle table (`Rotary.angle_table_bytes`)

    @property
    def weights_max(self) -> int:
        return max(sum(w.values()) for w in self.weights_by_rank)

    @property
    def resident(self) -> int:
        return (self.weights_max + self.draft_head_bytes + self.rope_table_bytes + self.kv_bytes + self.engine_bytes
                + self.step_workspace + self.reserve_bytes)

    @property
    def peak(self) -> int:
        return self.resident + self.prefill_workspace

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu_mem_bytes


def step_workspace_reference(cfg: ModelConfig, world: int, wl: Workload) -> int:
    """Transient bytes of one decode/verify step on the reference path `mtp.model.attention` runs today: each layer
    dequantizes the whole cache to fp32 and scores every key with every indexer head."""
    B, T, S = wl.batch, wl.k + 1, wl.max_len
    Hl = cfg.num_attention_heads // world
    cache_f32 = B * S * (cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim) * 4
    indexer = B * T * S * (cfg.index_n_heads * 4 + 4 + 12 + 3)  # head dots, scores, sort, masks
    attention = B * Hl * T * S * 4 * 2 + B * T * S * 4
    return cache_f32 + indexer + attention + step_workspace(cfg, world, wl)


def step_workspace(cfg: ModelConfig, world: int, wl: Workload) -> int:
    """Transient bytes of one decode/verify step (B*(k+1) tokens), kernel path, all counted live at once."""
    B, T, S = wl.batch, wl.k + 1, wl.max_len
    N, D, V = B * T, cfg.hidden_size, cfg.vocab_size
    Hl = cfg.num_attention_heads // world
    dt = DTYPES[wl.dtype].itemsize
    keys = min(S, cfg.index_topk)
    splits = min(64, max(1, math.ceil(keys / 256)))
    indexer = N * S * 4 + N * cfg.index_topk * 4 + N * cfg.index_n_heads * cfg.index_head_dim * 4
    attention = N * Hl * splits * (cfg.kv_lora_rank + 1) * 4 + N * Hl * (cfg.qk_head_dim + 2 * cfg.kv_lora_rank) * 4
    activations = 8 * N * D * 4 + N * cfg.num_experts_per_tok * D * 4
    logits = N * V * (dt + 4) + N * (V // world) * dt
    return indexer + attention + activations + logits


def prefill_workspace(cfg: ModelConfig, world: int, wl: Workload, P: int) -> int:
    """Transient bytes of one eager reference forward over P prompt tokens (S = P keys), peak of one layer."""
    B, Hl, Hi = wl.batch, cfg.num_attention_heads // world, cfg.index_n_heads
    pairs = B * P * P
    indexer = pairs * Hi * 4 + pairs * (4 + 4 + 8)  # head dots, scores, sorted values + indices
    expanded = B * P * Hl * (cfg.qk_nope_head_dim + cfg.v_head_dim) * 4
    attention = pairs * Hl * 4 * 2 + pairs * (4 + 3)  # scores + probs; bias + 3 bool masks
    activations = 8 * B * P * cfg.hidden_size * 4 + B * P * Hl * cfg.qk_head_dim * 4
    return max(indexer, expanded + attention) + activations


def make_plan(cfg: ModelConfig, gpus_per_node: int, gpu_mem_gib: float, nodes: int = 1, wl: Workload = Workload(),
              mlp_split: str = "blocks", reserve_gib: float = 4.0) -> MemoryPlan:
    world = gpus_per_node * nodes
    plan = ParallelPlan(world=world, mlp_split=mlp_split)
    dtype = DTYPES[wl.dtype]
    weights = weight_bytes_by_rank(cfg, plan, dtype)
    kv_tl = kv_bytes_per_token_layer(cfg, dtype, wl.numerics == "fp8")
    layers = cfg.num_hidden_layers + draft_cache_layers(wl.draft, wl.k)
    kv = kv_tl * layers * wl.batch * wl.max_len
    engine = wl.batch * wl.max_len * (8 + cfg.hidden_size * dtype.itemsize)
    step = step_workspace_reference(cfg, world, wl)
    reserve = int(reserve_gib * GIB)
    mem = int(gpu_mem_gib * GIB)
    head = draft_head_fp8_bytes(cfg, plan, wl.draft, wl.k) if wl.head_fp8 else 0
    rope = Rotary.angle_table_bytes(cfg)
    resident = max(sum(w.values()) for w in weights) + head + rope + kv + engine + step + reserve
    pre = prefill_workspace(cfg, world, wl, wl.prompt_len)
    lo, hi = 0, wl.max_len  # longest one-shot prefill that fits next to everything resident
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if resident + prefill_workspace(cfg, world, wl, mid) <= mem else (lo, mid - 1)
    per_token = kv_tl * layers + cfg.hidden_size * dtype.itemsize + 8
    free = mem - (resident - kv - engine) - pre
    max_tokens = max(0, free // per_token)
    # collectives: each forward = 1 embedding all-reduce + 2 per block + 1 lm_head all-gather; a draft forward
    # (one MTP module) also its eh_proj all-gather
    n_fwd_draft = drafter(wl.draft).chain_forwards(wl.k)
    coll = (collectives_per_forward(cfg, cfg.num_hidden_layers)
            + n_fwd_draft * collectives_per_forward(cfg, 1, mtp=True))
    N = wl.batch * (wl.k + 1)
    comm = (comm_bytes_per_forward(cfg, N, cfg.num_hidden_layers, dtype)["total"]
            + n_fwd_draft * comm_bytes_per_forward(cfg, N, 1, dtype, mtp=True)["total"])
    notes = []
    lay = RankLayout(cfg, plan, 0)
    if any(w != weights[0] for w in weights):
        notes.append("ranks differ: MLP intermediates are split in whole 128-blocks (mlp_split='blocks')")
    if nodes > 1:
        notes.append(f"{coll} collectives per step cross the inter-node network; each carries a few KiB per "
                     f"token, so they are latency-bound (not measured here)")
    notes.append(f"per rank: {lay.n_heads} heads, {len(lay.expert_ids)} routed experts, "
                 f"{lay.vocab[1] - lay.vocab[0]} vocabulary rows, dense MLP {lay.dense[1] - lay.dense[0]} "
                 f"+ shared expert {lay.shared[1] - lay.shared[0]} channels (rank 0)")
    return MemoryPlan(world, gpus_per_node, nodes, mem, weights, kv_tl, layers, kv, engine, step,
                      step_workspace(cfg, world, wl), pre, reserve, lo, int(max_tokens), coll, comm, notes, head, rope)


def _g(n: float) -> str:
    return f"{n / GIB:9.2f} GiB" if n >= GIB or n == 0 else f"{n / 2**20:9.2f} MiB"


def format_plan(cfg: ModelConfig, p: MemoryPlan, wl: Workload, source: str = "config") -> str:
    lines = [f"mtp-plan: {source}",
             f"  model: {cfg.num_hidden_layers} layers + {cfg.num_nextn_predict_layers} MTP, "
             f"{cfg.n_routed_experts} experts, {cfg.num_attention_heads} heads, vocab {cfg.vocab_size}, "
             f"{'FP8' if cfg.is_fp8 else 'bf16'} weights, model dtype {wl.dtype}",
             f"  hardware: {p.nodes} node(s) x {p.gpus_per_node} GPUs = world {p.world}, "
             f"{p.gpu_mem_bytes / GIB:.1f} GiB per GPU",
             f"  parallel: attention TP{p.world} (heads split), MoE EP{p.world}, vocab-parallel embedding/head, "
             f"indexer replicated",
             f"  workload: batch {wl.batch}, max_len {wl.max_len}, prompt {wl.prompt_len}, draft {wl.draft} "
             f"k={wl.k}{' (FP8 draft head)' if wl.head_fp8 else ''}, {wl.numerics} numerics", "", "weights per rank:"]
    w0 = p.weights_by_rank[0]
    worst = max(p.weights_by_rank, key=lambda w: sum(w.values()))
    for c in CATEGORIES:
        if c in worst or c in w0:
            lines.append(f"  {c:26s} {_g(worst.get(c, 0))}")
    totals = [sum(w.values()) for w in p.weights_by_rank]
    spread = "" if min(totals) == max(totals) else f"   (ranks: {_g(min(totals)).strip()} .. {_g(max(totals)).strip()})"
    lines.append(f"  {'total (largest rank)':26s} {_g(max(totals))}{spread}")
    lines.append(f"  {'all ranks together':26s} {_g(sum(totals))}")
    lines += ["", "per rank, resident:",
              f"  {'weights':26s} {_g(p.weights_max)}"]
    if p.draft_head_bytes:
        lines.append(f"  {'draft head FP8 copy':26s} {_g(p.draft_head_bytes)}   (--draft-head-fp8: the rank's head "
                     f"rows in e4m3 + block scales, per MTP module drafting)")
    lines.append(f"  {'rotary angle table':26s} {_g(p.rope_table_bytes)}   (cos + sin of every position, fp32: the "
                 f"fast path's, switch rope_table)")
    lines += [f"  {'KV cache':26s} {_g(p.kv_bytes)}   ({p.kv_per_token_layer} B/token/layer x {p.kv_layers} layers "
              f"x {wl.batch} x {wl.max_len}, replicated on every rank)",
              f"  {'engine buffers':26s} {_g(p.engine_bytes)}   (tokens + hidden states [B, max_len, D])",
              f"  {'decode-step workspace':26s} {_g(p.step_workspace)}   (estimate, reference attention path; "
              f"kernel path {_g(p.step_workspace_kernel).strip()}; CUDA-graph pool)",
              f"  {'reserve':26s} {_g(p.reserve_bytes)}   (CUDA context, NCCL buffers, allocator slack)",
              f"  {'resident total':26s} {_g(p.resident)}",
              f"  {'prefill workspace':26s} {_g(p.prefill_workspace)}   (estimate; {wl.prompt_len}-token one-shot "
              f"prefill, reference path)",
              f"  {'peak':26s} {_g(p.peak)}   of {_g(p.gpu_mem_bytes).strip()} -> "
              f"{'FITS' if p.fits else 'DOES NOT FIT'} (headroom {(p.gpu_mem_bytes - p.peak) / GIB:.2f} GiB)",
              "",
              f"  longest one-shot prefill that fits: {p.max_prefill_tokens} tokens (longer: chunk the prefill)",
              f"  KV positions that fit (batch x length, all layers): {p.max_kv_tokens}",
              f"  collectives per speculative step: {p.collectives_per_step} "
              f"({p.comm_bytes_per_step / 2**20:.2f} MiB of payload: fp32 all-reduces of [tokens, D], logits gather, "
              f"draft eh_proj gather)"]
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


MAX_EXTRA_NODES = 64  # how far `what_would_fit` looks for a node count


def what_would_fit(cfg: ModelConfig, gpus_per_node: int, gpu_mem_gib: float, nodes: int, wl: Workload,
                   mlp_split: str = "blocks", reserve_gib: float = 4.0) -> list[str]:
    """For a plan that does not fit: the fewest nodes of the same GPUs that would hold it, and the longest
    cache (halving --max-len, not below the prompt) that would fit on the GPUs given; each checked by
    `make_plan`. World sizes the layout cannot split the model over are skipped."""
    def plan(n: int, w: Workload) -> MemoryPlan | None:
        try:
            return make_plan(cfg, gpus_per_node, gpu_mem_gib, n, w, mlp_split, reserve_gib)
        except ValueError:  # ConfigError included: heads / experts not divisible by the world size
            return None

    out = []
    for n in range(nodes + 1, nodes + MAX_EXTRA_NODES + 1):
        p = plan(n, wl)
        if p is not None and p.fits:
            out.append(f"--nodes {n} ({n * gpus_per_node} GPUs, peak {p.peak / GIB:.1f} GiB per rank)")
            break
    max_len = wl.max_len // 2
    while max_len >= wl.prompt_len:
        p = plan(nodes, replace(wl, max_len=max_len))
        if p is not None and p.fits:
            out.append(f"--max-len {max_len} (peak {p.peak / GIB:.1f} GiB per rank)")
            break
        max_len //= 2
    return out


# configs shipped in mtp/data/, found by name wherever mtp is installed
NAMED_CONFIGS = {"deepseek-v3.2": "deepseek_v32_671b_config.json"}


def named_config(config: str) -> str:
    """`config` as given, or the path of the bundled config it names (when no such file or folder exists)."""
    from pathlib import Path

    if config in NAMED_CONFIGS and not Path(config).exists():
        return str(Path(__file__).resolve().parents[1] / "data" / NAMED_CONFIGS[config])
    return config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mtp-plan", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="config.json, a checkpoint directory holding one, or a bundled config by name: "
                                   + ", ".join(NAMED_CONFIGS))
    ap.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpu-mem-gib", type=float, required=True, help="memory per GPU in GiB")
    ap.add_argument("--batch", type=int, default=Workload.batch)
    ap.add_argument("--max-len", type=int, default=Workload.max_len, help="positions per row (cache length)")
    ap.add_argument("--prompt-len", type=int, default=Workload.prompt_len, help="tokens of a one-shot prefill")
    ap.add_argument("--draft", choices=DRAFTERS.keys(), default=Workload.draft)  # live registry view
    ap.add_argument("--k", type=int, default=Workload.k, help="drafts per step")
    ap.add_argument("--draft-head-fp8", action="store_true",
                    help="the drafts read an FP8 copy of the head (draft_head_fp8): count the copy per rank")
    ap.add_argument("--numerics", choices=NUMERICS, default=Workload.numerics)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=Workload.dtype)
    ap.add_argument("--mlp-split", choices=MLP_SPLITS, default="blocks")
    ap.add_argument("--reserve-gib", type=float, default=4.0)
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = ap.parse_args(argv)
    for name, ok, want in (("--gpus", a.gpus >= 1, "an integer >= 1"), ("--nodes", a.nodes >= 1, "an integer >= 1"),
                           ("--gpu-mem-gib", math.isfinite(a.gpu_mem_gib) and a.gpu_mem_gib > 0, "a finite number > 0"),
                           ("--reserve-gib", math.isfinite(a.reserve_gib) and a.reserve_gib >= 0,
                            "a finite number >= 0"),
                           ("--batch", a.batch >= 1, "an integer >= 1"), ("--max-len", a.max_len >= 1, "an integer >= 1"),
                           ("--k", a.k >= 0, "an integer >= 0")):
        if not ok:
            ap.error(f"{name} must be {want}, got {getattr(a, name[2:].replace('-', '_'))}")
    if not 1 <= a.prompt_len <= a.max_len:
        ap.error(f"--prompt-len must be in [1, --max-len = {a.max_len}], got {a.prompt_len}")
    try:
        cfg = ModelConfig.from_json(named_config(a.config))
    except ConfigError as e:
        ap.exit(2, f"mtp-plan: error: {e}\n")
    from .load import check_split, split_degrees  # the loader's own rule: what it would refuse, refused here

    world = a.gpus * a.nodes
    try:
        check_split(cfg, ParallelPlan(world, a.mlp_split), a.numerics)
    except ConfigError as e:
        ap.exit(2, f"mtp-plan: error: --gpus {a.gpus} x --nodes {a.nodes} = {world} ranks: {e}; this config splits over "
                   f"{split_degrees(cfg, a.mlp_split, a.numerics)} ranks\n")
    wl = Workload(a.batch, a.max_len, a.prompt_len, a.draft, a.k if a.draft != "none" else 0, a.numerics, a.dtype,
                  a.draft_head_fp8 and a.draft != "none")
    p = make_plan(cfg, a.gpus, a.gpu_mem_gib, a.nodes, wl, a.mlp_split, a.reserve_gib)
    if a.json:
        d = asdict(p)
        d.update(fits=p.fits, peak=p.peak, resident=p.resident, weights_max=p.weights_max)
        print(json.dumps(d, indent=1))
    else:
        print(format_plan(cfg, p, wl, a.config))
        if not p.fits:
            fits = what_would_fit(cfg, a.gpus, a.gpu_mem_gib, a.nodes, wl, a.mlp_split, a.reserve_gib)
            print("would fit: " + ("; or ".join(fits) if fits else
                                   f"nothing within {MAX_EXTRA_NODES} more nodes or a shorter cache"))
    return 0 if p.fits else 1


if __name__ == "__main__":
    sys.exit(main())
