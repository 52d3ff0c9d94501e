"""Kernels one decode forward of the fast path launches on one rank, per layer kind, from its launch structure.

Legend: N tokens of the forward (rows x width), B rows, S keys after it (context), D hidden, tp ranks.

The speed model's fixed cost is paid per launch, so the count must follow the code (`mtp.backends.fast_path`
FastBlock / FastMLA / FastMoE / FastParallelMLP, `mtp.kernels.dispatch.linear`, `mtp.kernels.moe.moe_experts`,
`mtp.kernels.moe_grouped`), not a constant. Every branch below names the code that takes it, and its thresholds
are read from that code at call time (`Limits.current`), so a change there moves the count. The structure was
derived by reading the code and is held, per layer kind, to the launches `mtp.plan.launches` counts when the
code runs under the Triton interpreter on a tiny simulated rank (tests/plan/test_kernel_count.py), with those
thresholds shrunk so that every branch is taken at a few tokens.

What the count assumes: the decode path as `mtp-bench --tp N` runs it (bf16 model, fp32 residual, the fused
kernels on, `gemv_rows` 1, elementwise 'triton', radix top-k, NCCL or the simulated group: no one-shot hand-off),
a causal verify (no tree), an FP8 latent cache. Collectives are not kernels here (the simulated rank runs none;
with NCCL add one per `Comm` in `mtp.plan.cost`). The count is the GPU's too: every launch here is one kernel on
either (the indexer's head weights were a cuBLAS GEMM that the GPU ran split-K with one or two reduce kernels the
CPU counter could not see, by cuBLAS's heuristics per row count; they are one Triton kernel now,
`kernels.index_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.config import ModelConfig
from ..placement import choose_layout

# launches of the reference router (`Gate.forward`: an fp32 GEMM, sigmoid, group top-k, sort, gather, scatter ...)
# that `FastMoE.routed` runs above `kernel_route_tokens` tokens, with its ids' int32 cast, or on an expert-parallel
# rank instead of the cast the gather of its expert table (`dispatch.local_ids`, every expert layout: it gives int32
# ids): aten ops as `mtp.plan.launches` counts them (on a GPU its sort and top-k run several kernels each). Up to
# `kernel_route_tokens` the router kernel maps ids itself: the same launches in every expert layout.
REFERENCE_ROUTER = 17
# the decode step's glue outside the layers (`DeepseekV32.forward` / `positions`, the bench's `cache.truncate`), per
# target forward: the truncate, the embedding's fp32 cast and seq_lens += T (GLUE_FIXED; the logits' cast is the
# head's since session 25, `head`), the slots with their rotary angles (`glue`: one launch with switch rope_table,
# else ROPE_OPS) and the embedding (one launch with switch vocab_embed or in one process, else a vocabulary-parallel
# rank's VOCAB_EMBED_OPS); counted (tests/plan/test_kernel_count.py). Before session 21: 18 on a rank, 11 in one
# process (the slots' arange too: `Limits.slots_arange`)
GLUE_FIXED = 3
ROPE_OPS = 5  # `Rotary.slots`: the slots' add, then the angles' cast, product, cos and sin
VOCAB_EMBED_OPS = 8  # `VocabParallelEmbedding.forward`: offset, 2 range compares, and, clamp, lookup, not, mask
MTP_NORM_OPS = 3  # `MTPLayer.eh_input`: enorm, hnorm, their cat (one launch with switch mtp_norms)
KINDS = ("dense", "moe", "mtp", "head", "glue")


@dataclass(frozen=True)
class Limits:
    """The token thresholds the fast path branches on, as the code holds them."""

    gemv_rows: int  # dispatch.FastPathOptions.gemv_rows: the split-K GEMV up to this many rows
    fuse_m: int  # fp8_gemm.FUSE_M: x quantized inside the weight-streaming GEMV up to this many rows ...
    small_n: int  # fp8_gemm.SMALL_N: ... for weights of at most this many rows
    small_m: int  # fast_path.SMALL_M (= fp8_gemm.SMALL_M): the block's fused norm quantizes up to this many rows
    absorb_max: int  # fast_path.ABSORB_MAX_TOKENS: the absorb kernels up to this many tokens, else einsums
    router_max: int  # fast_path.ROUTER_MAX_TOKENS: tokens per router launch
    kernel_route: int  # FastMoE.kernel_route_tokens: the router kernels up to this many tokens
    grouped_above: int  # FastMoE.grouped_above: the grouped expert GEMM above this many tokens
    moe_chunk: int  # FastMoE.max_tokens: tokens per grouped expert call
    # dispatch.FastPathOptions.fuse_prologue (the default): the MLA prologue's launch pairs as one each
    # (`mla_prologue_fused`), the kv one up to norm_max_q q_lora channels (`mla_prologue_fused.NORM_MAX_Q`)
    fuse_prologue: bool = True
    norm_max_q: int = 2048
    fuse_absorb_out: bool = False  # FastPathOptions.fuse_absorb_out: absorb out inside mla_decode's stage 2
    fuse_out_cast: bool = True  # FastPathOptions.fuse_out_cast: no cast launch after a row-parallel all-reduce
    topk_rearm: bool = True  # dispatch.FastPathOptions.topk_rearm: the top-k's kept workspace, no memset per call
    shared_in_experts: bool = True  # dispatch.FastPathOptions.shared_in_experts: the shared expert in the experts' kernels
    topk_one_launch: bool = False  # dispatch.FastPathOptions.topk_one_launch: the radix top-k's phases in one launch
    indexer_one_launch: bool = False  # dispatch.FastPathOptions.indexer_one_launch: scores and top-k in one launch
    fused_hist_rows: int = 1  # dispatch.FastPathOptions.fused_hist_rows: the histogram in the scores kernel up to these rows
    mlp_reduce_norm: bool = True  # dispatch.FastPathOptions.mlp_reduce_norm: the FFN's sum added by the next block's norm
    moe_down_nb: bool = True  # dispatch.FastPathOptions.moe_down_nb: a persistent call's down stores y (no combine)
    split_persistent: int = 4  # fast_path.SPLIT_PERSISTENT_TOKENS: a 'split' rank's persistent layout up to these tokens
    persistent_pairs: int = 64  # moe.PERSISTENT_MAX_PAIRS: a rank of scattered experts' persistent layout (T x J)
    rope_table: bool = True  # dispatch.FastPathOptions.rope_table: a forward's slots and angles in one launch
    vocab_embed: bool = True  # dispatch.FastPathOptions.vocab_embed: a rank's embedding lookup in one launch
    mtp_norms: bool = True  # dispatch.FastPathOptions.mtp_norms: an MTP module's enorm, hnorm and cat in one launch
    gather_cast: bool = True  # dispatch.FastPathOptions.gather_cast: a rank's fp32 casts made by the gathered copy
    slots_arange: bool = False  # the code before session 21: an arange launch for the slots (kept since: model.static)

    @classmethod
    def current(cls) -> Limits:
        from ..backends import fast_path as fp
        from ..kernels import fp8_gemm
        from ..kernels.dispatch import FastPathOptions
        from ..kernels.mla_prologue_fused import NORM_MAX_Q
        from ..kernels.moe import PERSISTENT_MAX_PAIRS

        o = FastPathOptions()
        return cls(o.gemv_rows, fp8_gemm.FUSE_M, fp8_gemm.SMALL_N, fp.SMALL_M, fp.ABSORB_MAX_TOKENS,
                   fp.ROUTER_MAX_TOKENS, fp.FastMoE.kernel_route_tokens, fp.FastMoE.grouped_above,
                   fp.FastMoE.max_tokens, fuse_prologue=o.fuse_prologue, norm_max_q=NORM_MAX_Q,
                   fuse_absorb_out=o.fuse_absorb_out, fuse_out_cast=o.fuse_out_cast, topk_rearm=o.topk_rearm,
                   shared_in_experts=o.shared_in_experts, topk_one_launch=o.topk_one_launch,
                   indexer_one_launch=o.indexer_one_launch, fused_hist_rows=o.fused_hist_rows,
                   mlp_reduce_norm=o.mlp_reduce_norm, moe_down_nb=o.moe_down_nb,
                   split_persistent=fp.SPLIT_PERSISTENT_TOKENS, persistent_pairs=PERSISTENT_MAX_PAIRS,
                   rope_table=o.rope_table, vocab_embed=o.vocab_embed, mtp_norms=o.mtp_norms,
                   gather_cast=o.gather_cast)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def linear(M: int, n_out: int, lim: Limits, xq: bool) -> int:
    """`dispatch.linear`: the split-K GEMV (x quantized inside) for 1..gemv_rows rows; with x already quantized
    (xq) one GEMV / GEMM; else `fp8_linear`: one launch where it quantizes x itself (n_out <= SMALL_N, M <=
    FUSE_M), else act_quant + GEMV / GEMM."""
    if 1 <= M <= lim.gemv_rows or xq:
        return 1
    return 1 if M <= lim.small_m and n_out <= lim.small_n and M <= lim.fuse_m else 2


@dataclass(frozen=True)
class StepShape:
    """One decode forward on one rank: `rows` x `width` new tokens over `context` keys (S, after them);
    `cache_len`: the cache's capacity per row (None: exactly S), since the indexer copies its keys to a
    contiguous buffer when rows > 1 and S < capacity. `expert_layout`: the rank's (`mtp.placement`; 'auto' as the
    runtime and `mtp-bench --tp N` (--layout auto) resolve it: 'split' for DeepSeek-V3.2 at tp = 2..16), which
    decides whether the shared expert runs inside the experts' kernels (`shared_in_experts`: 'split' yes)."""

    rows: int
    width: int
    context: int
    tp: int = 1
    cache_len: int | None = None
    expert_layout: str = "auto"

    @property
    def tokens(self) -> int:
        return self.rows * self.width


def attention(cfg: ModelConfig, sh: StepShape, lim: Limits) -> tuple[int, int]:
    """(attention, indexer) launches of `FastBlock` up to the FFN: input norm + quant, q_a | wk | kv_a, the kv
    prologue (norm, rotary, cache write), q_a norm + quant, q_b | wq_b, the q prologue, absorb q, mla_decode (2
    stages), absorb out (inside mla_decode's stage 2 with fuse_absorb_out up to absorb_max tokens,
    `kernels.mla_out`), o_proj (+ its cast to the model dtype after the all-reduce when row-parallel, unless
    fuse_out_cast: the post-attention norm rounds the fp32 sum, `Pending`), post-attention norm + quant; and the
    indexer's when it chooses (S > top-k, `mla_attend_fast`). With fuse_prologue (`mla_prologue_fused`): the kv
    prologue and the q_a norm + quant are one launch (q_lora <= norm_max_q), and up to absorb_max tokens the q
    prologue and absorb q are one."""
    N, D = sh.tokens, cfg.hidden_size
    quant = N <= lim.small_m
    absorb = N <= lim.absorb_max
    n = 1 + linear(N, cfg.q_lora_rank + cfg.index_head_dim + cfg.kv_lora_rank + cfg.qk_rope_head_dim, lim, quant)
    fuse_kv = lim.fuse_prologue and cfg.q_lora_rank <= lim.norm_max_q
    n += 1 if fuse_kv else 2  # kv prologue, q_a norm + quant
    n += 1  # q_b | wq_b (fed quantized)
    n += 1 if lim.fuse_prologue and absorb else 2  # q prologue, absorb q (or the einsum's bmm)
    # absorb out (inside mla_decode's stage 2 with fuse_absorb_out), or the einsums' copies (q's, out's) and out's bmm
    n += (0 if lim.fuse_absorb_out else 1) if absorb else 3
    n += 2  # mla_decode: stage 1, stage 2
    # o_proj; RowParallelLinear's `.to(x.dtype)`, or its rounding in the post-attention norm
    n += linear(N, D, lim, False) + (1 if sh.tp > 1 and not lim.fuse_out_cast else 0)
    n += 1  # post-attention add + norm + quant
    ix = 0
    if cfg.index_topk < sh.context:
        ix = 1 + indexer_select(sh, lim)  # head weights: one kernel (`fast_path.indexer_head_weights`)
    return n, ix


def indexer_select(sh: StepShape, lim: Limits | None = None) -> int:
    """The indexer's scores and top-k (`kernels.indexer.indexer_topk`, radix): the zeroed workspace (a memset per
    call, unless `topk_rearm` keeps one that the top-k's write kernel re-arms), the scores kernel, histogram +
    split + write (one launch with `topk_one_launch` where its grid fits an H100's / H200's 132 SMs:
    `topk_one_launch.one_launch_grid`, which the interpreter's count plans the same; with `indexer_one_launch` the
    scores and the top-k are one launch where `indexer_one_launch.indexer_grid` fits, else the scores kernel with the
    histograms and the one-launch top-k), and the keys' contiguous copies (rows > 1, cache longer than S); up to
    `fused_hist_rows` tokens the histogram pass runs in the scores kernel (radix_fused: no histogram launch). What
    `mtp-bench` times as 'the indexer alone' (`rank_steps.indexer_alone`, always the histogram launch)."""
    from ..kernels.indexer_one_launch import indexer_grid
    from ..kernels.topk_one_launch import one_launch_grid

    lim = lim or Limits.current()
    copies = 2 if sh.rows > 1 and sh.context < (sh.cache_len or sh.context) else 0
    memset = 0 if lim.topk_rearm else 1
    if lim.indexer_one_launch:
        fits = indexer_grid(sh.rows, sh.width, sh.context, 132) is not None
        return memset + (1 if fits else 2 + (1 if one_launch_grid(sh.tokens, sh.context, 132) is None else 0)) + \
            copies
    one = lim.topk_one_launch and one_launch_grid(sh.tokens, sh.context, 132) is not None
    fused = sh.tokens <= lim.fused_hist_rows  # radix_fused (`FastPathOptions.topk_impl_at`)
    return memset + 1 + (1 if one else 3 - fused) + copies


def ffn_hand_off(sh: StepShape, lim: Limits) -> bool:
    """Whether a trunk block hands its FFN's un-reduced output to the next block (`FastBlock._hand_off_comm`), whose
    add + norm + quant then adds it (no `add_rounded` of its own; the trunk's last block's is resolved after the
    loop, one launch in the glue): tp > 1 with switch mlp_reduce_norm, on the quantized path (<= SMALL_M tokens),
    under NCCL (the bench's simulated rank) with fuse_out_cast; the one-shot all-reduce hands off without it, as a
    kernel this model does not count (collectives are priced apart). An MTP module's block keeps its add."""
    return sh.tp > 1 and lim.mlp_reduce_norm and lim.fuse_out_cast and sh.tokens <= lim.small_m


def dense_mlp(cfg: ModelConfig, sh: StepShape, lim: Limits) -> int:
    """`FastParallelMLP` (tp > 1: fp32 partial, all-reduce, `.to(x.dtype)`) or `FastMLP`: gate | up (fed the block's
    quantized x up to SMALL_M rows), silu * up, down; then the block's `h + y` (tp > 1 with fuse_out_cast: the cast
    and the add as one `add_rounded`; none where the next block adds it, `ffn_hand_off`)."""
    N = sh.tokens
    inter = cfg.intermediate_size // sh.tp
    n = linear(N, 2 * inter, lim, N <= lim.small_m) + 1 + linear(N, cfg.hidden_size, lim, False)
    if ffn_hand_off(sh, lim):
        return n
    return n + (1 if sh.tp > 1 and not lim.fuse_out_cast else 0) + 1


def router(N: int, lim: Limits) -> int:
    """`FastMoE.routed`: one router launch per ROUTER_MAX_TOKENS tokens (+ a cat of weights and of ids when several),
    or the reference router above kernel_route_tokens (with the id mapping on an expert-parallel rank)."""
    if N > lim.kernel_route:
        return REFERENCE_ROUTER
    r = _cdiv(N, lim.router_max)
    return r + (2 if r > 1 else 0)


def persistent(cfg: ModelConfig, sh: StepShape, lim: Limits) -> bool:
    """Whether `FastMoE.kernel_layout` gives the persistent layout: a 'split' rank up to split_persistent tokens; a
    rank of scattered experts (a table: 'contiguous' and the others at tp > 1) by size, T x J <= persistent_pairs
    (`moe.default_layout`); one process (every expert local) never (the pair grid)."""
    N = sh.tokens
    if sh.tp == 1 or N > lim.grouped_above:
        return False
    if choose_layout(sh.expert_layout, cfg.moe_intermediate_size, sh.tp) == "split":
        return N <= lim.split_persistent
    return N * cfg.num_experts_per_tok <= lim.persistent_pairs


def experts(N: int, lim: Limits, persistent: bool = False) -> int:
    """`moe_experts`: gate-up, down, combine (pairs / persistent layouts; a persistent call with moe_down_nb: its down
    stores y, no combine); above grouped_above tokens, per chunk of max_tokens, the grouped GEMM's count + align,
    act_quant, gate-up, down, combine (+ a cat of the chunks)."""
    if N <= lim.grouped_above:
        return 2 if persistent and lim.moe_down_nb else 3
    c = _cdiv(N, lim.moe_chunk)
    return 6 * c + (1 if c > 1 else 0)


def shared_in_experts(cfg: ModelConfig, sh: StepShape, lim: Limits) -> bool:
    """`FastMoE.shared_in_stack`: the shared expert as the experts' implicit extra slot (0 launches of its own) with
    the switch on, where its slice has the routed experts' shapes (`fast_path.shared_fits_stack`: tp = 1 with
    n_shared = 1, or a 'split' rank, n_shared = 1), on the block's quantized path (<= SMALL_M tokens, `forward_acc`)
    and the pair / persistent layouts (<= grouped_above tokens; the grouped GEMM keeps the separate shared expert)."""
    N = sh.tokens
    if not (lim.shared_in_experts and cfg.n_shared_experts == 1 and N <= lim.small_m and N <= lim.grouped_above):
        return False
    return sh.tp == 1 or choose_layout(sh.expert_layout, cfg.moe_intermediate_size, sh.tp) == "split"


def moe_ffn(cfg: ModelConfig, sh: StepShape, lim: Limits) -> dict[str, int]:
    """The MoE sublayer of `FastBlock` as {shared_expert, router, routed_experts}. Up to SMALL_M tokens (the block's
    norm quantizes): the shared expert's gate | up on the quantized x, silu * up, down (none where it runs inside
    the experts' kernels: `shared_in_experts`); router; experts (the shared output added in their combine, or the
    shared expert their last slot); `add_rounded` into the residual. Above: `MoE.forward` (its routed part still
    `FastMoE.routed`): the shared expert on x, routed + shared, `.to(x.dtype)`, and the block's `h + y`. The
    residual's add is booked to the routed experts."""
    N, D = sh.tokens, cfg.hidden_size
    inter = cfg.moe_intermediate_size * cfg.n_shared_experts // sh.tp
    quant = N <= lim.small_m
    if shared_in_experts(cfg, sh, lim):
        inter = 0  # the experts' kernels run it: no launch of its own
    shared = linear(N, 2 * inter, lim, quant) + 1 + linear(N, D, lim, False) if inter else 0
    if inter and sh.tp == 1:
        shared += 1  # `FastMLP` / `MoE.shared`: the shared expert's model-dtype output cast to fp32
    if inter and not quant:
        shared += 1  # `MoE.forward`: routed + shared
    # add_rounded (none where the next block adds it: `ffn_hand_off`); or `.to(x.dtype)` and the block's `h + y`
    routed = experts(N, lim, persistent(cfg, sh, lim)) + (0 if ffn_hand_off(sh, lim) else 1 if quant else 2)
    return {"shared_expert": shared, "router": router(N, lim), "routed_experts": routed}


def gather_copy(sh: StepShape, lim: Limits) -> int:
    """Past one token on tp > 1, the copy that lays all-gathered column slices side by side (`Comm.all_gather_last`:
    the gather stacks the ranks' [tokens, n] blocks along dim 0) where a cast after it is its own launch (switch
    gather_cast off, the code before session 25); with the switch the cast to fp32 makes that copy."""
    return 1 if sh.tp > 1 and sh.tokens > 1 and not lim.gather_cast else 0


def head(cfg: ModelConfig, sh: StepShape, lim: Limits) -> int:
    """Final norm, lm_head (one cuBLAS GEMM) and the logits' fp32 cast (`Linear.forward`'s out_dtype; before session
    25 in the glue, the same count), with the gathered vocabulary slices' copy (`gather_copy`)."""
    return 3 + gather_copy(sh, lim)


def mtp_extra(cfg: ModelConfig, sh: StepShape, lim: Limits) -> int:
    """An MTP module's launches besides its block (`DeepseekV32.mtp_forward`): the glue's slots and angles, embedding
    and seq_lens update (without the bench's cache truncate and the embedding's fp32 cast), enorm, hnorm and their
    concat (`MTPLayer.eh_input`: 1 with switch mtp_norms), eh_proj (a bf16 cuBLAS GEMM over the rank's rows, column
    parallel on tp > 1) and its cast to fp32 (its gathered slices' copy: `gather_copy`), and the module's head (norm,
    GEMM, the logits' cast: `head`)."""
    norms = 1 if lim.mtp_norms else MTP_NORM_OPS
    return glue(sh, lim) - 2 + norms + 2 + gather_copy(sh, lim) + head(cfg, sh, lim)


def glue(sh: StepShape, lim: Limits) -> int:
    """The target step's launches outside its layers (`GLUE_FIXED` and the switches' launches: `ROPE_OPS`,
    `VOCAB_EMBED_OPS`)."""
    rope = 1 if lim.rope_table else ROPE_OPS + lim.slots_arange
    embed = 1 if sh.tp == 1 or lim.vocab_embed else VOCAB_EMBED_OPS
    return GLUE_FIXED + rope + embed


def terms(cfg: ModelConfig, sh: StepShape, lim: Limits | None = None) -> dict[str, int]:
    """Launches per layer of each `mtp.plan.cost` term (mla, indexer, dense_mlp, shared_expert, router,
    routed_experts; head with the step's glue; mtp_extra per MTP module)."""
    lim = lim or Limits.current()
    a, ix = attention(cfg, sh, lim)
    hand_off = int(ffn_hand_off(sh, lim))  # the trunk's last FFN resolved in the glue; an MTP block adds its own
    return {"mla": a, "indexer": ix, "dense_mlp": dense_mlp(cfg, sh, lim), **moe_ffn(cfg, sh, lim),
            "head": head(cfg, sh, lim) + glue(sh, lim) + hand_off, "mtp_extra": mtp_extra(cfg, sh, lim) + hand_off}


def per_layer(cfg: ModelConfig, sh: StepShape, lim: Limits | None = None) -> dict[str, int]:
    """Launches per layer of each kind: dense block, MoE block, MTP module (its block and extras), head, glue."""
    lim = lim or Limits.current()
    t = terms(cfg, sh, lim)
    attn = t["mla"] + t["indexer"]
    moe = attn + t["shared_expert"] + t["router"] + t["routed_experts"]
    return {"dense": attn + t["dense_mlp"], "moe": moe, "mtp": moe + t["mtp_extra"], "head": head(cfg, sh, lim),
            "glue": glue(sh, lim) + int(ffn_hand_off(sh, lim))}


def step_launches(cfg: ModelConfig, sh: StepShape, lim: Limits | None = None) -> dict[str, int]:
    """Launches of one target forward (trunk + head + glue) per layer kind, summed over its layers."""
    p = per_layer(cfg, sh, lim)
    n_dense = cfg.first_k_dense_replace
    return {"dense": p["dense"] * n_dense, "moe": p["moe"] * (cfg.num_hidden_layers - n_dense), "head": p["head"],
            "glue": p["glue"]}
