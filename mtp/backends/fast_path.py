"""Switch a loaded model between the plain-PyTorch reference and the Triton fast path, at run time.

`enable_fast_path(model)` (CUDA, fp8 numerics) routes
- every FP8 `Linear` through `kernels.dispatch.linear`: the CUDA-core split-K GEMV (`gemv_splitk`) for
  1..gemv_rows rows (1 by default: measured), else `kernels.fp8_gemm.fp8_linear` (weight-streaming GEMV for <= 64 rows, tiled GEMM above);
  the bf16 ones (lm_head, MTP heads, eh_proj) stay on torch, whose bf16 GEMV reads the 1.85 GB lm_head at the
  HBM floor on an H200 (0.442 ms vs 0.439 ms; a Triton GEMV we tried was slower: BENCHMARKS.md);
- every `MoE` through the router (`kernels.dispatch.route`: `router.moe_route_fused`, one launch that also maps
  ids to an expert-parallel rank's local ids) + `kernels.moe.moe_experts` (reads only the chosen experts; the expert-parallel
  MoE of `mtp.parallel` likewise over its rank's experts, any `expert_layout`: a range, scattered experts through
  a global -> local table, or every expert's slice under 'split'; slots routed to other ranks are skipped). The
  experts' weights are restacked per projection into [E, N, K] tensors, and each expert's parameters become views
  of the stack, so memory is not doubled (peak: one projection of one layer);
- `MLA` blocks of <= absorb_max_tokens new tokens through the indexer kernel + top-k (`kernels.topk` radix
  select, or torch.topk: `FastMLA.topk_impl`, `set_kernel_options`; the radix select's phases in one launch with
  switch `topk_one_launch`, the scores with them with `indexer_one_launch`) and `mla_decode` over the
  real-FP8 latent cache; kv_b_proj is dequantized once to bf16 for the absorbed q / output projections
  (DeepSeek's reference keeps the same dequantized copy). Longer blocks (prefill) stay on the reference path.
  A draft tree's verify passes the visibility [B, T, S] (the committed keys plus each node's ancestors): the
  indexer kernel scores only keys a node sees, so its top-k is per node, and with S <= top-k `mla_decode`
  masks by the visibility itself (`Indexer.select`'s rule in both cases);
  The block runs in `mla_forward_fast`: q_a | indexer wk | kv_a and q_b | indexer wq_b as one GEMV each
  (`fuse_rows`), the kv_a norm + rotary + indexer key + FP8 cache write and the q_pe rotary + indexer queries'
  rotary, Hadamard and quant in one kernel each (`kernels.mla_prologue`), the absorbed kv_b projections in one
  launch each (`kernels.absorb`; the output one can run inside `mla_decode`'s stage 2, `kernels.mla_out`, switch
  `fuse_absorb_out`, off by default: measured slower), the indexer's
  head weights in one (`kernels.index_weights`, from weights_proj in place: no per-layer copy); the kv prologue
  shares its launch with the q_a norm + quant, the q prologue with the absorbed q (`kernels.mla_prologue_fused`,
  switch `fuse_prologue`);
- dense MLPs and shared experts (also tensor-parallel ones: `FastParallelMLP`) with gate and up stacked into one
  GEMV (`fuse_rows`); where a shared expert has the routed experts' shapes (one process, n_shared = 1; a 'split'
  rank) it is also stacked last with them and runs in their kernels as every token's extra slot (`FastMoE`,
  switch `shared_in_experts`: 3 launches fewer per MoE layer), its gate | up stack a copy for the switch's off path;
- every decoder `Block` (`FastBlock`): residual add + RMSNorm + FP8 quant in one kernel (`kernels.norm_quant`)
  whose quantized output feeds the next GEMV directly (q_a | wk | kv_a; gate | up); tensor parallel under
  allreduce='oneshot', o_proj's all-reduce joins the post-attention one, and the FFN's the next block's input one
  (the trunk loop, `FastTrunk`, hands the un-reduced FFN output on as a `backends.pending.Pending`).
- the decode forward's glue (switches rope_table, vocab_embed, mtp_norms): a forward's cache slots and rotary angles
  gathered from a table in one launch (`FastRotary`, `kernels.lookup.rope_slots`; a tree forward's with its
  visibility, `kernels.lookup.tree_slots`, switch tree_fwd_glue), a vocabulary-parallel rank's
  embedding lookup in one (`FastVocabParallelEmbedding`, `kernels.lookup.embed_rows`), an MTP module's enorm, hnorm
  and their cat in one (`FastMTPLayer`, `elementwise.rms_norm_pair`); the same bits as the torch ops (the engine's
  accept / commit / count in one launch is the decode step's own: `mtp.decode.accept.fused_commit`, switch
  step_commit); with switches pdl and glue_pdl, each launched with programmatic dependent launch as the kernels above.
The new fused kernels have run-time switches per model (`kernels.dispatch.FastPathOptions`, carried as
`model.fast_options` and shared by the model's fast modules; `set_kernels(model, ...)` flips them and bumps the
model's version), so old and new kernels can be timed side by side in one process (`mtp.bench.fused`), and two
models in one process each run their own. The elementwise ops between the GEMMs are per model too
(`set_elementwise`: one Triton kernel each by default, `kernels.elementwise`; or torch.compile'd, or eager).
A module swap, as `mtp.parallel.modules.shard_model` swaps in the per-rank modules: each module's class becomes
a fast subclass of its own class (`FastLinear`, `FastMLP`, `FastParallelMLP`, `FastMoE`, `FastMLA`, `FastBlock`,
`FastTrunk`, `FastMTPLayer`, `FastVocabParallelEmbedding`, `FastRotary` over `Linear`, `MLP`, `ParallelMLP`, `MoE`,
`MLA`, `Block`, `Trunk`, `MTPLayer`, `VocabParallelEmbedding`, `Rotary`, and over their tensor-parallel subclasses, so
a sharded model and the MTP modules get the kernels too), holding the same parameters; the
reference modules know nothing of it. `disable_fast_path(model)` swaps the reference classes
back; the stacked expert tensors stay (they are the same weights). Both call `model.bump_version()`, so CUDA graphs
captured on the other path are never replayed.
Both paths compute DeepSeek's FP8 numerics; they differ only in summation order and top-k tie-breaking, and
tests hold one to the other within tolerance (tests/kernels/*_gpu.py, tests/backends/*_gpu.py).
"""

from __future__ import annotations

import warnings

import torch

from ..kernels import available
from ..kernels.absorb import MAX_TOKENS as ABSORB_MAX_TOKENS
from ..kernels.absorb import absorb_out, absorb_q
from ..kernels.cache_write import cache_write
from ..kernels.dispatch import ELEMENTWISE_IMPLS, ExpertMap, FastPathOptions, expert_map, linear, local_ids, route
from ..kernels.elementwise import rms_norm_pair, rms_norm_pair_takes, silu_mul, triton_ops
from ..kernels.fp8_gemm import SMALL_M
from ..kernels.index_weights import index_weights, index_weights_ref
from ..kernels.indexer import SCORES_DEFAULT, TOPK_IMPLS, indexer_topk
from ..kernels.indexer_one_launch import indexer_topk_one_launch
from ..kernels.lookup import embed_rows, embed_takes, rope_slots, rope_takes, tree_slots, tree_takes
from ..kernels.mla_decode import channel_splits_for, mla_decode
from ..kernels.mla_prologue import mla_kv_prologue, mla_q_prologue
from ..kernels.mla_prologue_fused import kv_norm_fits, mla_kv_prologue_norm, mla_q_prologue_absorb
from ..kernels.moe import GROUPED_ABOVE, MAX_TOKENS as MOE_KERNEL_MAX_TOKENS
from ..kernels.moe import default_layout, has_tma, moe_experts
from ..kernels.moe_grouped import default_block_m
from ..kernels.router import MAX_TOKENS as ROUTER_MAX_TOKENS
from ..kernels.norm_quant import add_rms_norm_quant, add_rounded
from ..model.attention import MLA
from ..model.deepseek import Block, DeepseekV32, MTPLayer, Trunk
from ..model.fp8 import BLOCK, acc_dtype
from ..model.layers import MLP, REFERENCE_OPS, ElementwiseOps, Linear, Rotary, compiled_ops, use_elementwise
from ..model.moe import Gate, MoE
from ..parallel.comm import Comm
from ..parallel.modules import (ColumnParallelLinear, ExpertParallelMoE, ParallelMLP, RowParallelLinear,
                                VocabParallelEmbedding)
from .pending import Pending, resolved


# Tokens up to which a 'split' rank's experts run the persistent layout (`FastMoE.persistent_tokens`). Its pair grid
# has I / W / 128 = 2 N-blocks per (token, slot) pair at TP=8: 18 gate / up programs for one token (8 routed + the
# shared slot) on 132 SMs. Measured (BENCHMARKS.md, session 11; one TP=8 split rank on an H200, 61 layers, 1k,
# variants moe_by_size / moe_pairs alternated twice): persistent -0.3 to -0.9 ms a step at w = 1 and -0.5 to -0.7 at
# w = 2, even at w = 3, +0.5 to +0.9 at w = 4. With its K slices in whole waves (`moe_wave_splits`, session 12, one
# run, eval/results/s12/h200b, variant moe_waves_by_size against defaults): w = 3 -0.83 ms at 1k, -0.38 at 32k; w = 4
# -0.08 at 1k, +0.96 at 32k, when `wave_splits` gave 7 gate/up slices at 4 tokens. The experts alone at the split
# rank's shapes (`mtp.bench.topk_moe --only moe_split`, H200, session 12): the pair grid 66.8 / 71.3 / 77.1 / 84.6 us
# at 1..4 tokens, persistent with the slices `wave_splits` gives now (7 / 4 / 2 / 2) 31.1 / 56.4-57.5 / 63.2 / 77.0;
# the whole step at w = 4 (eval/results/s12/h200e) -0.6 to -0.9 ms against the pair grid. Hence 4.
SPLIT_PERSISTENT_TOKENS = 4


class FastLinear(Linear):
    """FP8 weights through `kernels.dispatch.linear`: the split-K GEMV for 1..gemv_rows rows (switches `gemv`,
    `gemv_rows`), else `fp8_linear` (weight-streaming GEMV for <= 64 rows, tiled GEMM above)."""

    fast_options: FastPathOptions  # the model's (`fast_module`)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.weight_scale_inv, self.fast_options)

    def matmul_acc(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_features == 0:
            return super().matmul_acc(x)
        return linear(x, self.weight, self.weight_scale_inv, self.fast_options, out_dtype=acc_dtype(x.dtype))


def _gate_up(mlp: MLP, x: torch.Tensor, xq=None) -> torch.Tensor:
    """silu(gate x) * up x in x.dtype, gate | up as one GEMV; xq = (x8, sx): x already quantized per 128. The
    Triton silu * up launches with PDL under switch `pdl` (its ops object knows no switch: asked here)."""
    gu = linear(x, *mlp.fused_gate_up, mlp.fast_options, xq=xq)
    i = mlp.gate_proj.out_features
    if mlp.fast_options.pdl_at(gu.numel() // max(gu.shape[-1], 1)) and mlp.ops.kind == "triton":
        return silu_mul(gu[..., :i], gu[..., i:], x.dtype, pdl=True)
    return mlp.ops.silu_mul(gu[..., :i], gu[..., i:], x.dtype)


class FastMLP(MLP):
    """Dense MLP / shared expert with gate and up as one GEMV (`fused_gate_up`, when `fuse_rows` could stack them).
    xq = (x8, sx): x already quantized per 128 (by `FastBlock`'s fused norm), fed to that GEMV."""

    fused_gate_up: tuple[torch.Tensor, torch.Tensor] | None = None
    fast_options: FastPathOptions

    def forward(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        if self.fused_gate_up is None:
            return super().forward(x)
        return self.down_proj(_gate_up(self, x, xq))


class FastParallelMLP(ParallelMLP):
    """The tensor-parallel MLP (dense layers, shared expert) with this rank's gate | up rows as one GEMV; its
    all-reduce stays. Same formulas as `ParallelMLP.partial`."""

    fused_gate_up: tuple[torch.Tensor, torch.Tensor] | None = None
    fast_options: FastPathOptions

    def partial(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        if self.fused_gate_up is None or self.gate_proj.out_features == 0:
            return super().partial(x)
        return self.down_proj.matmul_acc(_gate_up(self, x, xq))

    def forward(self, x: torch.Tensor, xq=None, reduce: bool = True, rounded: bool = True) -> torch.Tensor:
        """reduce=False: this rank's partial (fp32), for `FastBlock` to hand to the next block's norm (`Pending`);
        rounded=False: the all-reduced sum before its `.to(x.dtype)`, which `FastBlock` does in its residual add
        (`add_rounded`). Called through the module, so hooks still see the call."""
        y = self.partial(x, xq)
        if not reduce:
            return y
        y = self.comm.all_reduce(y)
        return y.to(x.dtype) if rounded else y


class FastMoE(MoE):
    """The module's routed experts (`local_ids()`) through the router (`kernels.dispatch.route`: one fused launch
    with switch `router`, which also maps ids to this rank's stack indices by `id_map`) + `moe_experts` on the
    stacked experts (`stack_experts`): reads only the chosen experts, no host sync, capturable; other ranks'
    experts are -1 slots, which the kernel skips. `forward(x, xq)`: up to `grouped_above` tokens the shared expert is
    one more entry of the stack, run by the expert kernels for every token (weight 1, after the routed slots:
    `shared_in_stack`, switch `shared_in_experts`; one process with n_shared = 1, or a 'split' rank: 3 launches fewer
    per layer); elsewhere x's quantized form feeds the shared expert's own gate | up GEMV.

    Every expert layout of an expert-parallel rank (`mtp.placement`) runs here; per rank and MoE layer it costs:
    'contiguous' a range [e0, e1) (E/W experts; the mapping is arithmetic in the router's last program);
    'interleaved' / 'permuted' E/W scattered experts, mapped by an int32 table [E] (one dependent load of K ids in
    the router's last program);
    'split' all E experts at 1/W of their width (no mapping: every routed slot is local, so the expert kernels
    read K experts' slices per token on every rank; a rank without a 128-block of the width adds nothing).
    After the reference router (prefill; the bench's forced routes) every layout maps by its table in torch:
    one gather. The same launches in every layout (`mtp.plan.kernels`).

    expert_layout (`kernels.moe.moe_experts`' layout) for up to `grouped_above` tokens: 'pairs' or None (by
    size: persistent for T * J <= 64). A whole MoE picks 8 of its own experts per token, which the pair grid
    already spreads over the GPU (79-94% of copy bandwidth), so it keeps 'pairs'; one rank's range of an
    expert-parallel MoE gets None from `fast_module` (its few active experts are what the persistent layout is
    for); a 'split' rank keeps 'pairs' but runs the persistent layout up to `persistent_tokens`
    (SPLIT_PERSISTENT_TOKENS: its pair grid has 2 N-blocks per pair at TP=8), its K slices sized for every pair a
    distinct local expert (`all_local`, switch `moe_wave_splits`), its work items without dependent loads with
    switch `moe_item_regs` (any persistent call; the same bits), its gate/up on the block's quantized x (`forward`'s
    xq) with switch `moe_x8` (any persistent call; the same bits), its weight tiles by TMA with switch `moe_tma` (any
    persistent call on a GPU with TMA, `moe.has_tma`; the same bits), its down projection by output block with switch
    `moe_down_nb` (any persistent call; no combine launch, another fp32 sum order), its plan read from the router's ids
    and its first experts' rows asked of L2 before its PDL wait with option `moe_down_pf_experts`, gate/up's trigger
    after its wait with switch `moe_gate_up_aw` (any persistent call; the same bits). `set_kernel_options` switches.
    Above `grouped_above` tokens (verify batches, prefill) every MoE runs the grouped GEMM (`kernels.moe_grouped`),
    `max_tokens` per call."""

    stacked: dict[str, torch.Tensor] | None = None
    # up to this many tokens the persistent layout runs whatever expert_layout says ('split' ranks:
    # SPLIT_PERSISTENT_TOKENS from `fast_module`; 0: none; an explicit `set_kernel_options(moe_layout=)` sets 0)
    persistent_tokens: int = 0
    shared_index: int | None = None  # the shared expert's index in `stacked` (`stack_experts`), or None
    # every routed slot names an expert of the stack (one process; a 'split' rank), so that the persistent layout
    # sizes its K slices for T * slots distinct experts (switch `moe_wave_splits`, `moe.wave_splits`)
    all_local: bool = False
    id_map = ExpertMap()  # global id -> stack index (`kernels.dispatch.expert_map`), set by `stack_experts`
    expert_layout: str | None = "pairs"
    fast_options: FastPathOptions
    grouped_above = GROUPED_ABOVE  # tokens above which the grouped layout runs, whatever expert_layout says
    max_tokens = MOE_KERNEL_MAX_TOKENS  # tokens per expert-kernel call: longer inputs (prefill) go in chunks
    # The router kernels take <= 64 tokens: up to this many, one launch per 64 (a token routed as in a smaller
    # batch); above, the reference router's ~15 launches and fp32 GEMM cost less than a launch (~10 us) per 64.
    kernel_route_tokens = 4 * ROUTER_MAX_TOKENS

    def forward(self, x: torch.Tensor, xq=None, rounded: bool = True, reduce: bool = True) -> torch.Tensor:
        """rounded=False: the reduced routed + shared sum in fp32, before `MoE.forward`'s final rounding to x's
        dtype (`FastBlock` rounds it inside the residual add; called through the module, so hooks still see
        the call). reduce=False (with xq): this rank's fp32 sum before the all-reduce, which `FastBlock` hands
        to the next block's norm (`Pending`). The shared expert runs in the experts' kernels as their last slot
        (`shared_in_stack`), or its output is added in their combine launch."""
        if xq is None:
            if not reduce:
                raise ValueError("FastMoE: reduce=False needs xq, the block's quantized input")
            return super().forward(x)
        y = self.forward_acc(x, xq, reduce)
        return y.to(x.dtype) if rounded and reduce else y

    def forward_acc(self, x: torch.Tensor, xq, reduce: bool = True) -> torch.Tensor:
        """The routed + shared sum [.., D] fp32 (all-reduced when `reduce`). The shared expert runs inside the
        experts' kernels where `shared_in_stack(N)` says so (no launch of its own), else as its own 3 launches
        (gate | up GEMV on xq, silu * up, down) whose output the experts' combine adds."""
        shape = x.shape
        D = shape[-1]
        x_ND = x.reshape(-1, D)
        xq_ND = (xq[0].reshape(-1, D), xq[1].reshape(-1, D // 128))
        if self.shared_in_stack(x_ND.shape[0]):
            out = self.routed(x_ND, shared=True, xq=xq_ND)
        else:
            shared = None
            if self.shared_experts is not None:
                shared = self._shared_q(x_ND, xq_ND)
            out = self.routed(x_ND, add=shared, xq=xq_ND)
        return (self.reduce(out) if reduce else out).view(shape)

    def kernel_layout(self, N: int) -> str | None:
        """`moe_experts`' layout for N <= grouped_above tokens: the persistent one up to `persistent_tokens`, else
        `expert_layout`."""
        return "persistent" if N <= self.persistent_tokens else self.expert_layout

    def shared_in_stack(self, N: int) -> bool:
        """Whether N tokens run the shared expert as the experts' implicit extra slot (`moe_experts(shared=)`):
        switch `shared_in_experts` on, the shared expert stacked with the routed ones (`stack_experts`: one
        process with n_shared = 1, or a 'split' rank), and the pair / persistent layouts (N <= grouped_above; the
        grouped GEMM above keeps the separate shared expert). Numerics: the same FP8 formulas; its g, u and
        silu(g) * u stay fp32 in the kernel where `_gate_up` rounds g | u and silu * up to the model dtype (bf16),
        and its GEMVs sum in the expert kernels' order, not the split-K GEMV's; it is summed after the routed
        slots, as `add` was (tests/kernels/test_moe_shared.py)."""
        return self.shared_index is not None and self.fast_options.shared_in_experts and N <= self.grouped_above

    def _shared_q(self, x_ND: torch.Tensor, xq_ND) -> torch.Tensor:
        """`shared(x_ND)` with the quantized x fed to the fused gate | up GEMV where the shared expert has one."""
        se = self.shared_experts
        if isinstance(se, FastParallelMLP) and se.fused_gate_up is not None:
            return se.partial(x_ND, xq_ND)  # as ExpertParallelMoE.shared
        if isinstance(se, FastMLP) and se.fused_gate_up is not None and not isinstance(se, ParallelMLP):
            return se(x_ND, xq_ND).to(acc_dtype(x_ND.dtype))  # as MoE.shared
        return self.shared(x_ND)

    def routed(self, x_ND: torch.Tensor, add: torch.Tensor | None = None, shared: bool = False,
               xq=None) -> torch.Tensor:
        """The routed sum [N, D] fp32, plus `add` (fp32 [N, D], the shared expert's output) when given; shared:
        plus the stacked shared expert, run by the expert kernels as every token's last slot (`shared_in_stack`).
        Up to `grouped_above` tokens the `expert_layout` kernels, above it the grouped GEMM, in chunks of
        `max_tokens` (one M-block size for all chunks, so a token's result does not depend on its chunk).
        xq = (x8 [N, D], sx [N, D / 128]): x_ND quantized per 128 (the block's norm's), which the persistent layout's
        gate/up reads instead of quantizing x_ND with switch `moe_x8` (the same bits); ignored elsewhere."""
        N = x_ND.shape[0]
        s = self.stacked
        if shared and not self.shared_in_stack(N):
            raise ValueError(f"FastMoE.routed: shared=True needs the shared expert in the stack (shared_index "
                             f"{self.shared_index}), switch shared_in_experts on and N = {N} <= grouped_above = "
                             f"{self.grouped_above}")
        if s["gate_proj.weight"].shape[1] == 0:  # 'split': this rank holds no 128-block of the experts' width
            out = torch.zeros(x_ND.shape, dtype=torch.float32, device=x_ND.device)  # nor of the stacked shared one
            return out if add is None else out + add
        # the router kernels compute `Gate.forward` from the gate's weights; a gate whose class replaces forward
        # (the bench's forced routes, `mtp.bench.forced_route`) is called as a module, as for a prefill
        if N <= self.kernel_route_tokens and type(self.gate).forward is Gate.forward:  # local ids, or -1
            routes = [route(x_ND[a:a + ROUTER_MAX_TOKENS], self.gate, self.fast_options, local=self.id_map.router)
                      for a in range(0, N, ROUTER_MAX_TOKENS)]
            w_NK, ids_NK = routes[0] if len(routes) == 1 else (torch.cat([r[0] for r in routes]),
                                                               torch.cat([r[1] for r in routes]))
        else:  # prefill: the reference router (an fp32 GEMM and a sort, no host sync); or the forced gate's table
            w_NK, ids_NK = self.gate(x_ND)
            w_NK, ids_NK = w_NK.float(), local_ids(ids_NK, self.id_map.table).int()
        ws = (s["gate_proj.weight"], s["gate_proj.weight_scale_inv"], s["up_proj.weight"],
              s["up_proj.weight_scale_inv"], s["down_proj.weight"], s["down_proj.weight_scale_inv"])
        add = add if add is None or (add.dtype == torch.float32 and add.is_contiguous()) else add.float().contiguous()
        if N <= self.grouped_above:
            layout = self.kernel_layout(N)  # None: by size (`moe.default_layout`), resolved here for the splits
            persistent = (layout or default_layout(N, ids_NK.shape[1] + shared)) == "persistent"
            waves = persistent and self.all_local and self.fast_options.moe_wave_splits
            down_nb = persistent and self.fast_options.moe_down_nb
            return moe_experts(x_ND, ids_NK, w_NK, *ws, out_dtype=torch.float32, layout=layout, add=add,
                               shared=shared, splits="waves" if waves else None, pdl=self.fast_options.pdl_at(N),
                               prefetch=self.fast_options.prefetch_at(N),
                               item_regs=persistent and self.fast_options.moe_item_regs,
                               xq=xq if persistent and self.fast_options.moe_x8 else None,
                               tma=persistent and self.fast_options.moe_tma and has_tma(x_ND.device),
                               down_nb=down_nb, gate_up_after_wait=persistent and self.fast_options.moe_gate_up_aw,
                               down_pf_experts=self.fast_options.moe_down_pf_experts if down_nb else 0)
        C = self.max_tokens
        bm = default_block_m(min(N, C))
        outs = [moe_experts(x_ND[a:a + C], ids_NK[a:a + C], w_NK[a:a + C], *ws, out_dtype=torch.float32,
                            layout="grouped", block_m=bm, add=None if add is None else add[a:a + C])
                for a in range(0, N, C)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class FastMLA(MLA):
    """Absorbed blocks (decode / verify, tree verifies included) over the FP8 cache on the kernels
    (`mla_forward_fast`); the naive path (prefill) and an unquantized cache keep the reference forward."""

    fused_a = fused_qb = None  # stacked FP8 weights of the projections that read one input (`fuse_rows`)
    mm_fp32 = False  # cuBLAS bf16 x bf16 -> fp32 for the indexer's head weights (switch `index_weights` off)
    topk_impl = "radix"  # the indexer's top-k (`kernels.indexer.TOPK_IMPLS`): enable_fast_path / set_kernel_options
    scores_tune: dict = {}  # the indexer scores kernel's launch settings over `indexer.SCORES_DEFAULT` (set_kernel_options)
    fast_options: FastPathOptions

    def absorbed_fast(self, T: int, cache, opts) -> bool:
        """Whether `forward` takes `mla_forward_fast` for a block of T tokens."""
        return not self.naive(T, opts) and cache.quantized

    def forward(self, x_BTD, pos_BT, cos, sin, cache, S: int, opts, visible_BTS=None, xq=None) -> torch.Tensor:
        if not self.absorbed_fast(x_BTD.shape[1], cache, opts):
            return super().forward(x_BTD, pos_BT, cos, sin, cache, S, opts, visible_BTS)
        return mla_forward_fast(self, x_BTD, pos_BT, cos, sin, cache, S, xq=xq, visible_BTS=visible_BTS)


class FastBlock(Block):
    """`Block.forward` with the norms fused (switch `norm_quant`, fp32 residual): input norm + FP8 quant in one
    kernel (`kernels.norm_quant`), then the attention's residual add + post-attention norm + quant in one, each
    quantized output fed to the next FP8 GEMV (q_a | wk | kv_a; the dense MLP's / shared expert's gate | up).
    Same formulas as `Block.forward` (a tree verify's visibility goes to the attention); otherwise it is
    `Block.forward`.

    Tensor parallel with allreduce='oneshot', per decode block (B * T <= SMALL_M rows, D % 128 == 0):
    - o_proj's all-reduce is done here, with the post-attention add + norm + quant (`Comm.all_reduce_add_norm`,
      one kernel; `RowParallelLinear.defer_reduce`);
    - the FFN's all-reduce (dense `ParallelMLP`, expert-parallel MoE: routed + shared) is handed on (switch
      `mlp_reduce_norm`, `hand_off=True`, which `FastTrunk` passes): forward returns a `Pending` (the residual
      and this rank's un-reduced FFN output), and the next block's input add + norm + quant does the all-reduce
      in the same kernel; the trunk's last block's is resolved (one-shot all-reduce + add) before the final norm.
    Launches: o_proj's site 1 (NCCL: 2, the all-reduce, then add + norm + quant); from the FFN to the next
    block's quantized input 1 (unfused: all-reduce, residual add, next input norm + quant: 3; 4 for a bf16 dense
    MLP, whose cast is a launch).
    Tensor parallel under allreduce='nccl' (switch `fuse_out_cast`): o_proj's partial goes to a `Pending` too, whose
    fallback all-reduces it and rounds the fp32 sum inside the add + norm + quant kernel (no `.to(x.dtype)`
    launch); so does the FFN's, handed to the next block (switch `mlp_reduce_norm` too: NCCL, then that block's
    add + norm + quant, instead of NCCL, `add_rounded` and the norm: one launch fewer per block). Where nothing
    follows to take it (an MTP layer, a block called without hand_off) the FFN's reduced fp32 sum is rounded and
    added by `add_rounded` (one launch instead of its cast and the add). The same bits as the cast launches:
    round to nearest even, widen, add.
    Every rank makes the same choices (the one-shot kernels of all ranks must pair up): they read shapes, dtypes,
    classes and options only, never a rank's own module state (a rank without a block of the dense MLP hands off
    its zeros too). An MTP layer (called without hand_off) reduces
    its FFN itself."""

    fast_options: FastPathOptions

    def forward(self, h_BTD, pos_BT, cos, sin, cache, S: int, opts, dtype, visible_BTS=None,
                hand_off: bool = False):
        """h_BTD: the fp32 residual stream, or the previous block's `Pending` one (`FastTrunk`). hand_off: the
        caller takes a `Pending` back (the FFN's all-reduce left to the next block) where this block may fuse
        it; else the new residual stream."""
        h0 = h_BTD.h_BTD if isinstance(h_BTD, Pending) else h_BTD
        if not self.fast_options.norm_quant or h0.dtype != torch.float32:
            return super().forward(resolved(h_BTD), pos_BT, cos, sin, cache, S, opts, dtype, visible_BTS)
        B, T, D = h0.shape
        quant = B * T <= SMALL_M and D % 128 == 0
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        pdl = self.fast_options.pdl_at(B * T)
        nw = self.fast_options.norm_warps or None  # the model-width rows' warps (0: row_tiles'), on every norm here
        if isinstance(h_BTD, Pending):  # the previous block's FFN all-reduce, with this add + norm + quant
            x, h_BTD, x8, sx = h_BTD.add_norm(n1, dtype, quant, pdl, nw)
        else:
            _, x, x8, sx = add_rms_norm_quant(h_BTD, None, n1.weight, n1.eps, dtype, quant=quant, pdl=pdl,
                                              num_warps=nw)
        xq = (x8, sx) if quant else None
        attn = self.self_attn
        o_proj = getattr(attn, "o_proj", None)
        fo = self.fast_options
        # allreduce='oneshot': o_proj's all-reduce is done here, in one kernel with the add + norm + quant; 'nccl'
        # (switch fuse_out_cast): here too, alone, and the add + norm + quant kernel rounds its fp32 sum
        fuse = isinstance(o_proj, RowParallelLinear) and (o_proj.comm.allreduce == "oneshot" or fo.fuse_out_cast)
        o_proj = o_proj if fuse else None
        if o_proj is not None:
            o_proj.defer_reduce = True
        try:
            if isinstance(attn, FastMLA) and attn.absorbed_fast(T, cache, opts):
                a = attn(x, pos_BT, cos, sin, cache, S, opts, visible_BTS, xq=xq)
            else:
                a = attn(x, pos_BT, cos, sin, cache, S, opts, visible_BTS)
        finally:
            if o_proj is not None:
                o_proj.defer_reduce = False
        if o_proj is not None:  # the partial's sum rounded to the model dtype first, as o_proj's `.to(x.dtype)`
            pending = Pending(h_BTD, a, dtype, o_proj.comm, fo.fuse_out_cast)
            x, h_BTD, x8, sx = pending.add_norm(n2, dtype, quant, pdl, nw)
        else:
            h_BTD, x, x8, sx = add_rms_norm_quant(h_BTD, a, n2.weight, n2.eps, dtype, quant=quant, pdl=pdl,
                                                  num_warps=nw)
        xq = (x8, sx) if quant else None
        mlp = self.mlp
        comm = self._hand_off_comm(mlp) if hand_off and xq is not None else None
        if xq is not None and isinstance(mlp, FastMoE) and h_BTD.is_contiguous():
            if comm is not None:  # the fp32 sum, rounded to the model dtype in the next block's add (its `.to`)
                return Pending(h_BTD, mlp(x, xq, rounded=False, reduce=False).contiguous(), x.dtype, comm,
                               fo.fuse_out_cast, pdl)
            # one kernel: the MoE's fp32 sum rounded to the model dtype (its `.to(x.dtype)`) and added
            return add_rounded(h_BTD, mlp(x, xq, rounded=False).contiguous(), x.dtype, pdl)
        if comm is not None and isinstance(mlp, FastParallelMLP):  # every rank, also one without a block
            return Pending(h_BTD, mlp(x, xq, reduce=False), x.dtype, comm, fo.fuse_out_cast, pdl)  # as its `.to`
        if isinstance(mlp, FastParallelMLP) and fo.fuse_out_cast and h_BTD.is_contiguous():
            y = mlp(x, xq, rounded=False)  # the all-reduced sum in the accumulation dtype
            if y.dtype == torch.float32:  # one kernel: rounded to the model dtype (its `.to(x.dtype)`) and added
                return add_rounded(h_BTD, y.contiguous(), x.dtype, pdl)
            return h_BTD + y.to(x.dtype)
        if xq is not None and getattr(mlp, "fused_gate_up", None) is not None:
            y = mlp(x, xq)
        else:
            y = mlp(x)
        # one kernel: the add promotes the model-dtype FFN output to fp32 exactly (no separate cast launch)
        return h_BTD + y

    def _hand_off_comm(self, mlp: torch.nn.Module) -> Comm | None:
        """The group whose all-reduce the FFN may leave to the next block's norm, or None (it reduces itself):
        a tensor-parallel FFN on the fast path, switch `mlp_reduce_norm` on, under allreduce='oneshot' (the next
        norm's one-shot kernel all-reduces it) or with switch `fuse_out_cast` under any other all-reduce (the
        group's all-reduce alone, then the next block's add + norm + quant kernel rounds and adds the sum: one
        launch fewer per block than the FFN's own `add_rounded` before that norm, the same bits)."""
        fo = self.fast_options
        if not fo.mlp_reduce_norm:
            return None
        if not (isinstance(mlp, FastParallelMLP) or (isinstance(mlp, FastMoE) and isinstance(mlp, ExpertParallelMoE))):
            return None
        return mlp.comm if mlp.comm.allreduce == "oneshot" or fo.fuse_out_cast else None


class FastTrunk(Trunk):
    """`Trunk.forward` handing each block's FFN all-reduce to the next block (`FastBlock`, hand_off): the
    residual stream between blocks may be a `Pending`; the last one is resolved before the final norm, whose
    input is also the pre-norm hidden the MTP modules read."""

    def forward(self, h_BTD, pos_BT, cos, sin, cache, S: int, opts, dtype, visible_BTS=None):
        h = h_BTD
        for i, layer in enumerate(self.layers):
            if isinstance(layer, FastBlock):
                h = layer(h, pos_BT, cos, sin, cache.layer(i), S, opts, dtype, visible_BTS, hand_off=True)
            else:
                h = layer(resolved(h), pos_BT, cos, sin, cache.layer(i), S, opts, dtype, visible_BTS)
        h = resolved(h)
        return self.norm(h, dtype), h


class FastMTPLayer(MTPLayer, FastBlock):
    """An MTP module on the fast path: its block is `FastBlock`'s; with switch `mtp_norms` its enorm and hnorm and
    their cat (eh_proj's input, `MTPLayer.eh_input`) are one launch (`elementwise.rms_norm_pair`: each half as the
    Triton `rms_norm` kernel computes it, the same bits) where the module's elementwise ops are the Triton ones and
    their kernel takes both inputs; else the two norms and the cat (3 launches)."""

    def eh_input(self, e_BTD: torch.Tensor, h_BTD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        en, hn = self.enorm, self.hnorm
        if (self.fast_options.mtp_norms and en.ops.kind == "triton" and hn.ops is en.ops
                and rms_norm_pair_takes(e_BTD, en.weight, h_BTD, hn.weight, dtype)):
            rows = e_BTD.numel() // max(e_BTD.shape[-1], 1)
            return rms_norm_pair(e_BTD, en.weight, en.eps, h_BTD, hn.weight, hn.eps, dtype,
                                 pdl=self.fast_options.glue_pdl_at(rows))
        return super().eh_input(e_BTD, h_BTD, dtype)


class FastColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel bf16 projection (an MTP module's eh_proj, the vocabulary-parallel heads) whose cast to
    `out_dtype` (fp32: `DeepseekV32.forward` / `mtp_forward`) is made by the copy that lays the gathered slices side by
    side (`Comm.all_gather_last`'s out_dtype: one launch past one row, where the copy and the cast were two; the same
    values), with switch `gather_cast`; off, the reference's gather then cast."""

    fast_options: FastPathOptions

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if not self.fast_options.gather_cast:
            return super().forward(x, out_dtype)
        return self.comm.all_gather_last(self.matmul(x), out_dtype)


class FastVocabParallelEmbedding(VocabParallelEmbedding):
    """A vocabulary-parallel rank's lookup in one launch (switch `vocab_embed`, `kernels.lookup.embed_rows`: its rows,
    zeros for ids it does not hold, the same bits), then the all-reduce; off, or ids the kernel does not take: the
    reference's 8 launches (offset, range compares, clamp, lookup, mask)."""

    fast_options: FastPathOptions

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not (self.fast_options.vocab_embed and embed_takes(ids, self.weight)):
            return super().forward(ids)
        pdl = self.fast_options.glue_pdl_at(ids.numel())
        return self.comm.all_reduce(embed_rows(ids, self.weight, self.vocab_start, pdl=pdl))


class FastRotary(Rotary):
    """`Rotary.slots` in one launch (switch `rope_table`, `kernels.lookup.rope_slots`): the slots and their angles read
    from a table of every position's angles (`Rotary.angle_table`, made by the reference's own ops: the same bits as
    per step), one per device, made by the first forward with a bound there and kept for the module's life: 2 x R/2
    fp32 a position, 42 MB at DeepSeek-V3.2's 163840 (`Rotary.angle_table_bytes`, which the memory planner counts:
    `parallel.memory.make_plan`). Never grown, so never outgrown: a captured graph reads the table's address, and a
    table sized by the largest bound seen so far (session 21: doubled from 4096 positions) left each outgrown one in
    use by the graphs captured with it, which nothing here sees die (graphs are captured by the engine, the benches,
    tests); all of them were kept, up to 2.6x the largest (108 MB at 163840). The whole range once costs 42 MB
    against 1 MB for a 4096-position table at short contexts, and 4 launches once. A forward with no bound, past
    max_positions, on a device whose table would be made inside a graph capture (the engine's warm-up makes it
    first), or one the kernel does not take, takes the reference's launches.
    A tree forward's slots, angles (of the nodes' positions: the tree's first slot + depth) and visibility likewise in
    one launch from the same table (`Rotary.tree_slots`, `kernels.lookup.tree_slots`: switches rope_table and
    tree_fwd_glue, both on), where the reference takes 18."""

    fast_options: FastPathOptions

    def slots(self, seq_lens_B: torch.Tensor, T: int, bound: int | None = None):
        if (bound is not None and self.fast_options.rope_table and bound <= self.max_positions
                and rope_takes(seq_lens_B)):
            table = self.table(seq_lens_B.device)
            if table is not None:
                pdl = self.fast_options.glue_pdl_at(seq_lens_B.shape[0] * T)
                return rope_slots(seq_lens_B, T, *table, pdl=pdl)
        return super().slots(seq_lens_B, T, bound)

    def tree_slots(self, seq_lens_B: torch.Tensor, T: int, depth: torch.Tensor, mask_TU: torch.Tensor, S: int):
        o = self.fast_options
        if (o.rope_table and o.tree_fwd_glue and S <= self.max_positions
                and tree_takes(seq_lens_B, depth, mask_TU)):
            table = self.table(seq_lens_B.device)
            if table is not None:
                return tree_slots(seq_lens_B, T, depth, mask_TU, S, *table, pdl=o.glue_pdl_at(seq_lens_B.shape[0] * T))
        return super().tree_slots(seq_lens_B, T, depth, mask_TU, S)

    def table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (cos, sin) table [max_positions, R/2] on `device`, made here the first time; None where it would be
        made inside a graph capture."""
        tables = self.__dict__.setdefault("rope_tables", {})  # plain attribute: no buffer, no state_dict entry
        if device not in tables:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            tables[device] = self.angle_table(device)
        return tables[device]


FAST_CLASSES = (FastLinear, FastMLP, FastParallelMLP, FastMoE, FastMLA, FastMTPLayer, FastBlock, FastTrunk,
                FastVocabParallelEmbedding, FastRotary, FastColumnParallelLinear)
_combined: dict[tuple[type, type], type] = {}


def _swap(mod: torch.nn.Module, fast: type) -> None:
    """Make `mod` an instance of `fast` over its own class (a subclass such as RowParallelLinear keeps its
    forward and gets the fast `matmul`). Parameters, buffers and names are untouched."""
    cls = type(mod)
    if isinstance(mod, fast):
        return
    if cls is fast.__base__:
        mod.__class__ = fast
        return
    if (fast, cls) not in _combined:
        _combined[(fast, cls)] = type(f"{fast.__name__[:4]}{cls.__name__}", (fast, cls), {})
    mod.__class__ = _combined[(fast, cls)]


def reference_class(cls: type) -> type:
    """The class a fast module swaps back to (its class without the fast mix-in)."""
    if cls in FAST_CLASSES:
        return cls.__base__
    for fast in FAST_CLASSES:
        if issubclass(cls, fast):
            return next(b for b in cls.__bases__ if b is not fast)
    return cls


def fast_module(mod: torch.nn.Module, options: FastPathOptions | None = None, mm_fp32: bool = False) -> None:
    """Swap one module to its fast class and prepare what the kernels read (stacked experts, fused projections,
    dequantized attention weights); it reads its kernel switches from `options` (its model's, which
    `install_fast_modules` passes; default: the ones it has, else new defaults). Modules without a fast version
    are left alone."""
    # every class a fast one is made over
    if isinstance(mod, (Linear, MoE, MLA, MLP, Block, VocabParallelEmbedding, Rotary)):
        mod.fast_options = options or getattr(mod, "fast_options", None) or FastPathOptions()
    if isinstance(mod, Linear) and mod.is_fp8:
        if mod.scale_rows == BLOCK and not mod.in_features % BLOCK:  # the kernels' blocking; small models' odd
            # rank slices (finer scale rows, a shared activation group) keep the reference
            _swap(mod, FastLinear)
    elif isinstance(mod, ColumnParallelLinear):  # bf16 (eh_proj, the heads): the cast in the gathered copy
        _swap(mod, FastColumnParallelLinear)
    elif isinstance(mod, MoE):
        stack_experts(mod)
        _swap(mod, FastMoE)
        # the default on every enable: one rank's few active experts take the persistent layout (by size); a module
        # holding every expert (one process, or a rank's slices under 'split': K active per token) the pair grid,
        # a 'split' rank the persistent one up to SPLIT_PERSISTENT_TOKENS
        mod.expert_layout = "pairs" if mod.id_map.table is None else None
        split = isinstance(mod, ExpertParallelMoE) and mod.layout_name == "split"
        mod.persistent_tokens = SPLIT_PERSISTENT_TOKENS if split else 0
        mod.all_local = split or mod.id_map.table is None  # every routed slot names an expert of this stack
    elif isinstance(mod, MLA) and _mla_kernel_fits(mod):
        w = mod.kv_b_proj.dequantized_weight(torch.bfloat16).view(mod.H, mod.P + mod.V, mod.C)
        mod.w_kb = w[:, : mod.P].contiguous()  # [H, P, C]
        mod.w_vb = w[:, mod.P:].contiguous()  # [H, V, C]
        ix = mod.indexer
        # the head weights' old path (switch `index_weights` off): cuBLAS bf16 x bf16 -> fp32 where this build has it
        mod.mm_fp32 = mm_fp32 and ix.weights_proj.weight.dtype == torch.bfloat16
        _swap(mod, FastMLA)
        # the projections that read the same input, as one weight each (one launch instead of 3 and 2)
        mod.fused_a = fuse_rows([mod.q_a_proj, ix.wk, mod.kv_a_proj_with_mqa])
        mod.fused_qb = fuse_rows([mod.q_b_proj, ix.wq_b])
    elif type(mod) is ParallelMLP:  # this rank's gate and up rows as one
        _swap(mod, FastParallelMLP)
        if mod.gate_proj.out_features:
            mod.fused_gate_up = fuse_rows([mod.gate_proj, mod.up_proj], repoint=not _in_expert_stack(mod))
    elif type(mod) is MLP:  # dense MLPs and shared experts (callers skip routed experts): gate and up as one
        _swap(mod, FastMLP)
        mod.fused_gate_up = fuse_rows([mod.gate_proj, mod.up_proj], repoint=not _in_expert_stack(mod))
    elif isinstance(mod, MTPLayer):
        _swap(mod, FastMTPLayer)
    elif isinstance(mod, Block):
        _swap(mod, FastBlock)
    elif isinstance(mod, VocabParallelEmbedding):
        _swap(mod, FastVocabParallelEmbedding)
    elif isinstance(mod, Rotary):
        _swap(mod, FastRotary)
    elif isinstance(mod, Trunk):
        _swap(mod, FastTrunk)


def enable_fast_path(model: DeepseekV32, elementwise: str = "triton", indexer_topk: str = "radix",
                     options: FastPathOptions | None = None, *, compile_elementwise: bool | None = None) -> DeepseekV32:
    """elementwise: the ops between the GEMMs (`mtp.model.layers.ElementwiseOps`) for this model's modules
    (`set_elementwise`): 'triton' (one kernel each, `kernels.elementwise`), 'compile' (torch.compile'd: the same
    fusion for ~33 s more start-up on a cold cache, ~13 s warm) or 'eager' (the reference functions).
    compile_elementwise: deprecated (True: 'compile', False: 'eager'); warns, and goes in the next release.
    options: this model's kernel switches (default: `FastPathOptions.for_world` of its tensor-parallel group; flip
    them later with `set_kernels`).
    indexer_topk: the indexer's top-k, 'radix' (Triton radix select, the reference's tie rule), 'radix_fused'
    (its histogram pass in the scores kernel) or 'torch' (torch.topk); switch it and the MoE expert layout
    later with `set_kernel_options`."""
    if compile_elementwise is not None:
        warnings.warn("enable_fast_path(compile_elementwise=...) is deprecated: use elementwise='compile' or "
                      "'eager' (the default is 'triton')", DeprecationWarning, stacklevel=2)
        elementwise = "compile" if compile_elementwise else "eager"
    if elementwise not in ELEMENTWISE_IMPLS:
        raise ValueError(f"enable_fast_path: elementwise must be one of {ELEMENTWISE_IMPLS}, got {elementwise!r}")
    if not available():
        raise RuntimeError("the Triton fast path needs triton and a CUDA device; use the reference path")
    if model.device.type != "cuda":
        raise ValueError(f"the fast path needs the model on a CUDA device, it is on {model.device}")
    if model.runtime.numerics != "fp8" or not model.cfg.is_fp8:
        raise ValueError("the fast path implements DeepSeek's FP8 numerics: load an FP8 checkpoint with numerics='fp8'")
    if indexer_topk not in TOPK_IMPLS:
        raise ValueError(f"enable_fast_path: indexer_topk must be one of {TOPK_IMPLS}, got {indexer_topk!r}")
    install_fast_modules(model, _mm_out_fp32(), options)
    set_elementwise(model, elementwise)
    set_kernel_options(model, indexer_topk=indexer_topk)
    return model


def model_world(model: torch.nn.Module) -> int:
    """The size of the tensor-parallel group a model is split over: its first parallel module's `comm.world` (a
    simulated rank's too), 1 for a model of one process."""
    return next((m.comm.world for m in model.modules() if isinstance(getattr(m, "comm", None), Comm)), 1)


def elementwise_ops(elementwise: str) -> ElementwiseOps:
    """The ops object of one of `ELEMENTWISE_IMPLS` (each built once per process)."""
    if elementwise == "triton":
        return triton_ops()
    if elementwise == "compile":
        return compiled_ops()
    if elementwise == "eager":
        return REFERENCE_OPS
    raise ValueError(f"elementwise must be one of {ELEMENTWISE_IMPLS}, got {elementwise!r}")


def set_elementwise(model: torch.nn.Module, elementwise: str) -> None:
    """Give `model`'s modules the elementwise ops `elementwise` names (`ELEMENTWISE_IMPLS`; other models keep
    theirs) and bump its version, so CUDA graphs captured with the old ops are captured again."""
    use_elementwise(model, elementwise_ops(elementwise))
    if isinstance(model, DeepseekV32):
        model.bump_version()


def install_fast_modules(model: torch.nn.Module, mm_fp32: bool = False,
                         options: FastPathOptions | None = None) -> FastPathOptions:
    """The module swaps of `enable_fast_path` without its device checks (tests run them under the Triton
    interpreter on the CPU). mm_fp32: cuBLAS has bf16 x bf16 -> fp32 (`_mm_out_fp32`). options: the kernel
    switches of this model's fast modules (default: the model's own if it has some, else the defaults); a
    `DeepseekV32` carries them as `fast_options`. Returns them."""
    if options is None:
        options = getattr(model, "fast_options", None) or FastPathOptions.for_world(model_world(model))
    if not isinstance(options, FastPathOptions):
        raise TypeError(f"install_fast_modules: options must be a FastPathOptions, got {type(options).__name__}")
    routed = {id(mod.expert(e)) for mod in model.modules() if isinstance(mod, MoE) for e in mod.local_ids()}
    for mod in list(model.modules()):
        if id(mod) not in routed:  # routed experts are read through their MoE's stack
            fast_module(mod, options, mm_fp32)
    if isinstance(model, DeepseekV32):
        model.fast_options = options
        model.bump_version()  # graphs captured on the reference path must not be replayed
    return options


def set_kernels(model: DeepseekV32, **flags: bool) -> FastPathOptions:
    """Set some of `model`'s kernel switches (`FastPathOptions.set`: the new fused kernels on / off, read at
    call time by its fast modules only) and bump its version, so CUDA graphs the engine kept (captured with the
    old switches) are captured again. Returns the previous switches, to restore with `set_kernels(model,
    **vars(old))`."""
    if not isinstance(model, DeepseekV32) or model.fast_options is None:
        raise ValueError("set_kernels: the model has no fast path (enable_fast_path(model) first)")
    old = model.fast_options.set(**flags)
    model.bump_version()
    return old


def set_kernel_options(model: torch.nn.Module, indexer_topk: str | None = None,
                       moe_layout: str | None = "keep", indexer_scores: dict | None = None) -> None:
    """Switch kernel variants of a fast-path model, so that old and new can be timed side by side:
    indexer_topk 'radix' | 'radix_fused' | 'torch' (every FastMLA; None keeps it); indexer_scores: the scores
    kernel's launch settings (`kernels.indexer.indexer_scores`' block_s, num_warps, num_stages, programs; {}: its
    `SCORES_DEFAULT`; None keeps them); moe_layout for every
    FastMoE's expert kernels: 'pairs' (the pair grid at every size) or None (by size: persistent for
    T * J <= 64); 'keep' leaves it. Modules on the reference path are left alone. Bumps the model's version, so
    CUDA graphs captured before are not replayed."""
    if indexer_topk is not None and indexer_topk not in TOPK_IMPLS:
        raise ValueError(f"set_kernel_options: indexer_topk must be one of {TOPK_IMPLS}, got {indexer_topk!r}")
    bad = set(indexer_scores or {}) - set(SCORES_DEFAULT)
    if bad:
        raise ValueError(f"set_kernel_options: indexer_scores takes {sorted(SCORES_DEFAULT)}, got {sorted(bad)}")
    if moe_layout not in ("pairs", None, "keep"):
        raise ValueError(f"set_kernel_options: moe_layout must be 'pairs' or None, got {moe_layout!r}")
    for mod in model.modules():
        if isinstance(mod, FastMLA):
            if indexer_topk is not None:
                mod.topk_impl = indexer_topk
            if indexer_scores is not None:
                mod.scores_tune = dict(indexer_scores)
        elif isinstance(mod, FastMoE) and moe_layout != "keep":
            mod.expert_layout, mod.persistent_tokens = moe_layout, 0
    if isinstance(model, DeepseekV32):
        model.bump_version()


def disable_fast_path(model: torch.nn.Module) -> torch.nn.Module:
    """Swap the reference classes back on `model` (a whole model or one module) and the plain elementwise ops."""
    for mod in model.modules():
        mod.__class__ = reference_class(type(mod))
    use_elementwise(model, REFERENCE_OPS)
    if isinstance(model, DeepseekV32):
        model.fast_options = None
        model.bump_version()  # graphs captured on the fast path must not be replayed
    return model


def fuse_rows(linears: list[Linear], repoint: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One FP8 weight (and its block scales) holding the given linears' rows one after the other, for one
    GEMV/GEMM launch where several projections read the same input. Each linear's parameters are re-pointed at
    its rows of the stacked tensors, so no memory is added and the reference path reads the same bytes.
    repoint=False: the parameters stay where they are and the stack is a copy (a shared expert stacked with the
    routed experts, `stack_experts`, whose gate | up GEMV only the switch `shared_in_experts` off reads).
    Exact: output row n of the stacked product is row n of the part it came from (same activation quant,
    same 128-block scales), provided every part but the last has a multiple of 128 rows, so that no scale
    block straddles two parts; otherwise (and for non-FP8 or mismatched inputs) returns None."""
    if not all(lin.is_fp8 for lin in linears) or len({lin.in_features for lin in linears}) != 1:
        return None
    if any(lin.out_features % 128 for lin in linears[:-1]):
        return None
    w = torch.cat([lin.weight.data for lin in linears])
    s = torch.cat([lin.weight_scale_inv.data for lin in linears])
    if not repoint:
        return w, s
    r, b = 0, 0
    for lin in linears:
        n, nb = lin.out_features, lin.weight_scale_inv.shape[0]
        lin.weight = torch.nn.Parameter(w[r:r + n], requires_grad=False)
        lin.weight_scale_inv = torch.nn.Parameter(s[b:b + nb], requires_grad=False)
        r, b = r + n, b + nb
    return w, s


def _in_expert_stack(mlp: MLP) -> bool:
    """Whether `mlp` is a shared expert stacked with its MoE's routed experts (`stack_experts` ran on its parent
    first: `install_fast_modules` visits a module before its children)."""
    return getattr(mlp, "_stacked_shared", False)


def _mm_out_fp32() -> bool:
    """torch.mm(bf16, bf16, out_dtype=float32) (cuBLAS, fp32 accumulate and output) exists on this build."""
    try:
        a = torch.ones(1, 8, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def _mla_kernel_fits(mla: MLA) -> bool:
    """mla_decode is built for DeepSeek's latent 512 + rope 64; the indexer kernel for >= 16 power-of-two heads.
    Smaller test models keep the reference attention (their linears and MoE still use the kernels)."""
    hi = mla.indexer.n_heads
    blocks = all(lin.scale_rows == BLOCK for lin in (mla.q_b_proj, mla.kv_b_proj))
    return mla.C == 512 and mla.R == 64 and hi >= 16 and hi & (hi - 1) == 0 and blocks


def shared_fits_stack(moe: MoE) -> bool:
    """Whether the shared expert can be one more entry of the routed experts' stack: an FP8 MLP with exactly their
    weight and scale shapes. So on one process with n_shared = 1 (moe_intermediate wide, as each routed expert)
    and on a 'split' rank (1/W of every routed expert and 1/W of the shared one, both moe_intermediate / W wide;
    a rank without a 128-block of the width has both zero-wide). Not a contiguous / interleaved / permuted rank,
    whose shared slice (n_shared * moe_intermediate / W) is narrower than its whole experts, nor n_shared > 1 (nor
    the rank of such a layout that holds a 1-block shared expert whole: the ranks of a layout fuse alike, as
    `mtp.plan.kernels.shared_in_experts` counts)."""
    se = getattr(moe, "shared_experts", None)
    ids = list(moe.local_ids())
    if se is None or not ids or not isinstance(se, MLP):
        return False
    if isinstance(moe, ExpertParallelMoE) and moe.layout_name != "split":
        return False
    ex = moe.expert(ids[0])
    projs = ("gate_proj", "up_proj", "down_proj")
    if not all(getattr(se, p).is_fp8 and getattr(ex, p).is_fp8 for p in projs):
        return False
    return all(getattr(getattr(se, p), a).shape == getattr(getattr(ex, p), a).shape and
               getattr(getattr(se, p), a).dtype == getattr(getattr(ex, p), a).dtype
               for p in projs for a in ("weight", "weight_scale_inv"))


def stack_experts(moe: MoE) -> None:
    """Stack the module's experts (`moe.local_ids()`, ascending global ids) per projection into [E_local, N, K]
    weights / scales for `moe_experts`, in that order, and set `moe.id_map` (`kernels.dispatch.expert_map`: global
    id -> stack index); re-point each expert's parameters at its slice: memory is not doubled (peak: one
    projection of one layer), names and `state_dict` are unchanged. Idempotent; FP8 experts only.
    Where the shared expert has the routed experts' shapes (`shared_fits_stack`) it is stacked last, at index
    `moe.shared_index` = E_local (its parameters re-pointed too), so that `moe_experts(shared=True)` runs it as
    every token's implicit extra slot (`FastMoE`); else `moe.shared_index` is None. The router never names it."""
    if getattr(moe, "stacked", None) is not None:
        return
    ids = list(moe.local_ids())
    experts = [moe.expert(e) for e in ids]
    if not all(getattr(ex, p).is_fp8 for ex in experts for p in ("gate_proj", "up_proj", "down_proj")):
        raise ValueError("stack_experts: the Triton expert kernels need FP8 experts")
    shared = shared_fits_stack(moe)
    if shared:
        experts.append(moe.shared_experts)
    stacked = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for attr in ("weight", "weight_scale_inv"):
            parts = [getattr(ex, proj) for ex in experts]
            big = torch.stack([getattr(p, attr).data for p in parts])
            for i, p in enumerate(parts):  # re-point each expert at its slice; the old tensor is freed
                setattr(p, attr, torch.nn.Parameter(big[i], requires_grad=False))
            stacked[f"{proj}.{attr}"] = big
    moe.id_map = expert_map(ids, moe.gate.n_experts, stacked["gate_proj.weight"].device)
    moe.shared_index = len(ids) if shared else None
    if shared:
        moe.shared_experts._stacked_shared = True  # its gate | up GEMV (switch off) reads a copy (`fuse_rows`)
    moe.stacked = stacked


def mla_forward_fast(mla: MLA, x_BTD, pos_BT, cos, sin, cache, S: int, xq=None, visible_BTS=None) -> torch.Tensor:
    """The whole MLA block of a decode / verify step on the kernels: the fused input projections
    (q_a | indexer wk | kv_a, then q_b | indexer wq_b), the FP8 cache write in one launch (switch `prologue`:
    with the kv_a norm, rotary and indexer key), the indexer top-k and absorbed attention over the cache, o_proj.
    Same formulas as `MLA.forward`'s absorbed path. Switch `fuse_prologue`: the kv prologue with the q_a norm +
    quant, and the q prologue with the absorbed q (up to ABSORB_MAX_TOKENS, switch `absorb`), one launch per pair
    (`kernels.mla_prologue_fused`, bit-identical to the two launches).
    xq = (x8, sx): x_BTD already quantized per 128 (by the block's fused norm), fed to the first GEMV.
    visible_BTS: a draft tree's visibility (`MLA.forward`), or None (causal)."""
    B, T, _ = x_BTD.shape
    dt = x_BTD.dtype
    ix = mla.indexer
    Q, Dk, H, P, R = mla.q_a_proj.out_features, ix.head_dim, mla.H, mla.P, mla.R
    if mla.fused_a is not None:
        a = linear(x_BTD, *mla.fused_a, mla.fast_options, xq=xq)
        qa, k_idx, kv = a[..., :Q], a[..., Q:Q + Dk], a[..., Q + Dk:]
    else:
        qa, k_idx, kv = mla.q_a_proj(x_BTD), ix.wk(x_BTD), mla.kv_a_proj_with_mqa(x_BTD)
    fo = mla.fast_options
    prologue = fo.prologue and mla.fused_a is not None and mla.fused_qb is not None
    # switch fuse_prologue: each pair of launches that reads one GEMV output as one launch, the same bits
    fuse_kv = prologue and fo.fuse_prologue and fo.norm_quant and kv_norm_fits(Q)
    fuse_q = prologue and fo.fuse_prologue and fo.absorb and B * T <= ABSORB_MAX_TOKENS
    q8 = None
    if fuse_kv:  # the kv prologue below and the q_a norm + quant (y not stored)
        q8, qs = mla_kv_prologue_norm(mla, cache, pos_BT, a, cos, sin, dt, pdl=fo.pdl_at(B * T), kv_split=fo.kv_split)
    elif prologue:  # kv_a norm, rotary, indexer key and the cache write in one launch
        mla_kv_prologue(mla, cache, pos_BT, a, cos, sin, pdl=fo.pdl_at(B * T))
    else:
        c = mla.kv_a_layernorm(kv[..., : mla.C], dt)
        k_pe = mla.ops.rope_interleaved(kv[..., mla.C:], cos, sin)
        cache_write(cache, pos_BT, c, k_pe, ix.rotate(ix.k_norm(k_idx), cos, sin), pdl=fo.pdl_at(B * T))
    # The indexer scores only when it must choose (S > its top-k); else every visible key is kept and its query
    # side (the wq_b rows of the stacked GEMV, the queries' rotary / Hadamard / quant, the head weights) is
    # skipped: the keys it caches above are still written for later steps.
    score = ix.topk < S
    if mla.fused_qb is not None and fo.norm_quant:  # the q_a norm + quant in one launch, y not stored
        n = mla.q_a_layernorm
        if q8 is None:  # row_tiles' warps, not norm_warps: the bits of the fused kv launch's q_a norm
            _, _, q8, qs = add_rms_norm_quant(qa, None, n.weight, n.eps, dt, store_y=False, pdl=fo.pdl_at(B * T))
        wq = mla.fused_qb if score else (mla.q_b_proj.weight, mla.q_b_proj.weight_scale_inv)  # rows of fused_qb
        qq = linear(None, *wq, fo, out_dtype=dt, xq=(q8, qs))
        q, iq = qq[..., : H * (P + R)], qq[..., H * (P + R):]
    elif mla.fused_qb is not None:
        qq = linear(mla.q_a_layernorm(qa, dt), *mla.fused_qb, fo)
        q, iq = qq[..., : H * (P + R)], qq[..., H * (P + R):]
    else:
        qr = mla.q_a_layernorm(qa, dt)
        q, iq = mla.q_b_proj(qr), (ix.wq_b(qr) if score else None)
    q = q.view(B, T, H, P + R)
    if prologue:  # q_pe rotary and the indexer queries' rotary, Hadamard and quant in one launch
        q_lat = None
        if fuse_q:  # with the absorbed q
            q_pe, iq8, iqs, q_lat = mla_q_prologue_absorb(mla, qq, cos, sin, index=score, pdl=fo.pdl_at(B * T),
                                                          prefetch=fo.prefetch_at(B * T))
        else:
            q_pe, iq8, iqs = mla_q_prologue(mla, qq, cos, sin, index=score, pdl=fo.pdl_at(B * T))
        o = mla_attend_fast(mla, x_BTD, None, q[..., :P], q_pe, cache, S, out_dtype=dt,
                            iq_quant=(iq8, iqs) if score else None, visible_BTS=visible_BTS, q_lat=q_lat)
        return mla.o_proj(o.reshape(B, T, H * mla.V))
    q_nope, q_pe = q[..., :P], mla.ops.rope_interleaved(q[..., P:], cos, sin)
    iq = ix.rotate(iq.view(B, T, ix.n_heads, Dk), cos, sin) if score else None
    o = mla_attend_fast(mla, x_BTD, iq, q_nope, q_pe, cache, S, out_dtype=dt, visible_BTS=visible_BTS)
    return mla.o_proj(o.reshape(B, T, H * mla.V))


def indexer_head_weights(mla: MLA, x_BTD: torch.Tensor) -> torch.Tensor:
    """The indexer's head weights w [B, T, Hi] fp32 = x W^T * Hi^-0.5 * Dk^-0.5 (W = weights_proj.weight;
    `Indexer.select` applies the two factors apart): one launch (`kernels.index_weights`, switch `index_weights`);
    off, the old path: cuBLAS's bf16 GEMM with fp32 output and the scale (bf16 x bf16 products are exact in fp32 and
    cuBLAS sums them in fp32: the reference's fp32 math), else an fp32 linear and the scale."""
    ix = mla.indexer
    W = ix.weights_proj.weight
    scale = ix.n_heads ** -0.5 * ix.head_dim ** -0.5
    if mla.fast_options.index_weights:
        return index_weights(x_BTD, W, scale, pdl=mla.fast_options.pdl_at(x_BTD.shape[0] * x_BTD.shape[1]))
    if mla.mm_fp32 and x_BTD.dtype == torch.bfloat16:
        w = torch.mm(x_BTD.reshape(-1, x_BTD.shape[-1]), W.t(), out_dtype=torch.float32).mul_(scale)
        return w.view(*x_BTD.shape[:-1], ix.n_heads)
    return index_weights_ref(x_BTD, W, scale)  # the fp32 linear and the scale


def mla_attend_fast(mla: MLA, x_BTD, iq_BTHD, q_nope, q_pe, cache, S: int,
                    out_dtype: torch.dtype = torch.float32, iq_quant=None, visible_BTS=None,
                    q_lat=None) -> torch.Tensor:
    """Absorbed MLA over the FP8 cache with the indexer's top-k: returns o [B, T, H, V] in out_dtype.
    iq_BTHD: the indexer queries, rotated (`Indexer.queries`), before quantization; or iq_quant = (iq8, iqs
    [B, T, Hi, 1]) already quantized (`mla_prologue.mla_q_prologue`). q_lat [B, T, H, C]: q_nope . W_kb already
    computed (`mla_prologue_fused.mla_q_prologue_absorb`, with the q prologue), else done here from q_nope.
    visible_BTS: a draft tree's visibility
    [B, T, S]: the indexer scores only the keys each node sees (its top-k is then per node and never holds an
    unseen key), and without an indexer (S <= top-k) the attention masks by it directly."""
    ix = mla.indexer
    lens = cache.seq_lens  # keys before this block; query t sees < lens + t + 1
    n_tok = x_BTD.shape[0] * x_BTD.shape[1]
    pdl = mla.fast_options.pdl_at(n_tok)
    pf = mla.fast_options.prefetch_at(n_tok)  # with pdl: W_kb / W_vb asked of L2 first
    topk_idx = None
    if ix.topk < S:  # else every visible key is kept (the reference's select): no scores needed
        if iq_quant is None and iq_BTHD is None:
            raise ValueError(f"mla_attend_fast: the indexer must score {S} keys for its top-{ix.topk}: give the "
                             f"indexer queries (iq_BTHD or iq_quant)")
        q8, qs = mla.ops.act_quant(iq_BTHD) if iq_quant is None else iq_quant  # qs [B, T, Hi, 1]
        w = indexer_head_weights(mla, x_BTD)
        if mla.fast_options.indexer_one_launch and mla.topk_impl != "torch":  # scores and top-k in one launch
            topk_idx, _ = indexer_topk_one_launch(q8, qs.squeeze(-1), w, cache.idx_k[:, :S], cache.idx_k_scale[:, :S],
                                                  lens, topk=ix.topk, visible=visible_BTS,
                                                  rearm=mla.fast_options.topk_rearm,
                                                  split_v2=mla.fast_options.topk_split_v2)
        else:
            topk_idx, _ = indexer_topk(q8, qs.squeeze(-1), w, cache.idx_k[:, :S], cache.idx_k_scale[:, :S], lens,
                                       topk=ix.topk, impl=mla.fast_options.topk_impl_at(mla.topk_impl, n_tok),
                                       visible=visible_BTS,
                                       rearm=mla.fast_options.topk_rearm, scores=mla.scores_tune,
                                       one_launch=mla.fast_options.topk_one_launch, pdl=pdl,
                                       split_v2=mla.fast_options.topk_split_v2)
    absorb = mla.fast_options.absorb and q_nope.shape[0] * q_nope.shape[1] <= ABSORB_MAX_TOKENS
    if q_lat is None and absorb:  # one launch each instead of copy + batched GEMM + copy
        q_lat = absorb_q(q_nope, mla.w_kb, pdl=pdl, prefetch=pf)
    elif q_lat is None:
        q_lat = torch.einsum("bthp,hpc->bthc", q_nope.to(torch.bfloat16), mla.w_kb).contiguous()
    # switch fuse_absorb_out (off by default: measured slower): stage 2 and absorb_out in one launch (the same bits)
    fuse_out = absorb and mla.fast_options.fuse_absorb_out
    o_lat = mla_decode(q_lat, q_pe.to(torch.bfloat16).contiguous(), cache.kv[:, :S], cache.kv_scale[:, :S],
                       cache.pe[:, :S], lens, mla.softmax_scale, topk_idx=topk_idx, out_dtype=torch.bfloat16,
                       visible=visible_BTS if topk_idx is None else None,  # a top-k holds seen keys only
                       w_vb=mla.w_vb if fuse_out else None, pdl=pdl, prefetch=pf,
                       channel_splits=mla.fast_options.mla_channel_splits
                       or channel_splits_for(n_tok, q_lat.shape[2]))
    if fuse_out:  # o_lat is o [B, T, H, V] here, in W_vb's dtype as absorb_out's
        return o_lat.to(out_dtype)
    if absorb:
        return absorb_out(o_lat, mla.w_vb, pdl=pdl, prefetch=pf).to(out_dtype)
    return torch.einsum("bthc,hvc->bthv", o_lat, mla.w_vb).to(out_dtype)
