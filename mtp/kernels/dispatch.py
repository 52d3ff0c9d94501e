"""Which FP8 linear kernel the fast path runs, and the switches that pick the new fused kernels.

The switches are per model: `FastPathOptions`, owned by the fast path, carried by the model it was enabled on
(`model.fast_options`, shared by its fast modules) and read at call time, so two models in one process run
their own kernels, and old and new kernels can be timed side by side (graphs captured before a switch keep what
they captured: flip them with `mtp.backends.fast_path.set_kernels(model, ...)`, which also bumps the model's
version, so the engine captures its kept graphs again).
- gemv: `gemv_splitk.fp8_gemv` (CUDA-core split-K GEMV, all of a program's weight tile in one load) for
  1..gemv_rows rows (at most MAX_M); more rows, or off: the tensor-core `fp8_gemm.fp8_linear`. Its CUDA-core
  FMAs and lane reductions grow with the rows, so the row limit is a measured choice (BENCHMARKS.md).
- gemv_one_slice (16; an integer): the split-K GEMV takes the whole K in one slice (no partials, no fix-up; 4 warps)
  where K / 128 is a power of two above 8 and at most this (`gemv_splitk.gemv_plan`): the TP=8 rank's o_proj (K =
  2048) 7.41 vs 10.20 us alone (H200, BENCHMARKS.md session 17); 0: the split plan (variant gemv_split). Another sum
  order of the groups, the same formula.
- gemv_warps (0 = `gemv_splitk.gemv_plan`'s; 4 or 8; variant gemv_w4): the split-K GEMV's warps. 4 at a TP=8 rank's
  one-row calls (the field's comment says why it might pay) measured slower: +0.10 / +0.11 ms a step at w = 1 (busy,
  two alternations, H200, session 25; predicted -0.06): kept as an option, 0 by default.
- gemm_deep_rows (4; an integer, 0 in one process: `for_world(1)`): calls of 2..this many rows past gemv_rows run
  `fp8_gemm`'s few-row kernel with 8 K groups a slice and 4 pipeline stages where K / 128 is a multiple of 8
  (`FastPathOptions.deep_tune`; 4 groups and 3 stages before, variant gemm_deep_off): one TP=8 split rank's step -0.06
  to -0.07 ms at 1k w = 2..4 (H200, BENCHMARKS.md session 24). Another split of K: another sum order.
- gemm_deep_q_b (on; variant gemm_deep_q_b_off): with gemm_deep_rows, q_b's few-row GEMV (12 K groups, <= 4096 rows)
  with 3 K groups a slice and 4 stages: alone 5.80 -> 5.35-5.41 us at M = 2..4 (H200, session 25); in the step
  (one TP=8 split rank, 61 layers, 1k, busy, two alternations, session 25) within the noise (predicted ~-0.025 ms
  at w = 2..4; measured -0.01 to +0.01). Another split of K: another sum order.
- norm_quant: the decoder block's residual add + RMSNorm + FP8 quant in one kernel (`norm_quant`), its
  quantized output fed to the next GEMV (`fast_path.FastBlock`); also the q_a norm + quant.
- norm_warps (0; an integer: 0, 4, 8, 16 or 32): the warps of the add + RMSNorm + quant kernel on every row of the
  model's width (`FastBlock`'s input and post-attention norms, a `backends.pending.Pending`'s fallback), handed to
  `norm_quant.add_rms_norm_quant(num_warps=)`; 0: `norm_quant.row_tiles`' choice, 32 warps from 32 groups of 128 (the
  TP=8 rank's 7168 channels: 3.84-3.86 us alone on an H200 against 4.58-4.60 at 8, BENCHMARKS.md session 17; 8 before
  session 18: variant norm_8_warps; in the step -0.14 to -0.17 ms at 1k, session 18). The warps set the order of the row's sum of squares, so y can differ from
  another count's in its last bit; every launch of a model reads the one option (batch widths, graph and eager,
  draft, verify and MTP blocks alike), so its paths still agree bit for bit. Not the q_a norm (q_lora wide, 4 warps
  as `mla_prologue_fused`'s kv launch runs it) nor the one-shot all-reduce's fused norm (its own programs).
- router: the MoE router in one kernel (`router.moe_route_fused`); off: `moe.moe_route` (2 launches).
- router_one_tokens (8; variants router_one = 16, router_one_off = 0, router_split_off = 2 unsplit, session 20's
  default): with router, calls of at most this many tokens (and at most `router.ONE_MAX_TOKENS`, 16) take
  `moe_route_fused(impl="one")`: no split-K (each program the whole 7168-long dot of 2 experts, its gate rows loaded
  before the PDL wait), one arrival (the grouped impl's 'auto' choice has two in a chain: each E-block's last K slice,
  then the last E-block) and the routing after it by rank comparisons. The same choice on its logits as the others' on
  theirs; the logits themselves in another fixed fp32 order (`router._pair_tree`: the same bits at any warps, tile or
  width), so they can differ from the split-K sums in the last bits. Measured (H200, one TP=8 split rank, 61 layers, 1k,
  busy ms, BENCHMARKS.md session 20): at w = 1 / 2 / 3 / 4 -0.27 / -0.22 / +0.05 / -0.00 a step with impl one up to 16
  tokens and its whole routing in the last program (which grows with the tokens: 709 PTX instructions and 28 barriers
  after the arrival at one, 2526 and 66 at four); hence 2 tokens in session 20, 8 with router_one_split since session
  21.
- router_one_split (2; variant router_split3 = from 3, router_split_off = never): impl one's calls of at least this
  many tokens are routed by its last min(T, programs) programs to arrive, one token each
  (`moe_route_fused(split_tail=True)`), instead of all by the last one: the work after the arrival stays one
  token's (sm_90 PTX: 761 instructions and 32 barriers at any T, against 2526 and 66 unsplit at four tokens). The
  same logits, ids and weights bit for bit. Measured (H200, session 21, BENCHMARKS.md): alone (`mtp.bench.fused
  --only router`, 8 warps) 6.50 / 7.80 / 7.86 / 10.09 us at T = 2 / 3 / 4 / 8 against unsplit 6.94 / 10.60 / 10.72 /
  19.32 and grouped's (4 warps) 10.99 / 9.26 / 9.51 / 12.22; in the step (one TP=8 split rank, 61 layers, 1k, busy
  ms, impl one up to 8 tokens split from 2, against session 20's defaults run first and last) -0.03 / -0.08 / -0.16
  at w = 2 / 3 / 4, the same at w = 1 (one token: the unsplit kernel).
- prologue: the MLA prologue in two kernels (`mla_prologue`: kv_a norm, rotary, indexer key + cache write;
  q_pe rotary, indexer queries' rotary + Hadamard + quant); off: ~12 torch / compiled elementwise launches.
- fuse_prologue: with prologue, the kv prologue and the q_a norm + quant in one launch, and with absorb, the q
  prologue and the absorbed q in one (`mla_prologue_fused`: two launches fewer per layer, the same bits); off: one
  launch each.
- absorb: MLA's absorbed kv_b projections (q_nope -> latent, latent -> v) in one launch each (`absorb`);
  off: two torch einsums (~3 launches each).
- fuse_absorb_out (with absorb, up to its token limit): `mla_decode`'s stage 2 (the merge of its key splits) and the
  absorbed output projection in one launch (`mla_out.stage2_absorb`, bit-identical); off (the default): stage 2,
  then `absorb_out`. Off because it measured slower: one TP=8 rank on an H200, 61 layers, the fused launch cost
  0.3-0.6 ms a step at 1k and 0.9-1.6 ms at 32k more than the two launches (BENCHMARKS.md, session 11): each of its
  programs redoes its head's merge of the key splits, and the split count grows with the context.
- mla_channel_splits (0 = by score rows, `mla_decode.channel_splits_for`: 4 at one row, 2 at two, else 1, and 1 past
  16 heads a rank; or a fixed integer in `mla_decode.CHANNEL_SPLITS`: 1, 2, 4, 8): `mla_decode`'s stage 1 runs CS
  programs per (row, head block, key split), each the whole softmax and the output on 512 / CS channels
  (`mla_decode(channel_splits=)`): the same bits (GPU tests), CS x the programs, the key splits unchanged. Compiled
  for sm_90 at a TP=8 rank's 16 heads (8 warps; the compiler converts the fp8 tile once per dot operand layout, and
  only the value side shrinks): 2336 /
  2008 / 1704 SASS instructions a warp, 180 / 151 / 80 registers dense at CS = 1 / 2 / 4. Measured on one TP=8 rank
  (H200, BENCHMARKS.md session 18, b2b, two alternations): CS = 4 -0.12 / -0.22 ms a step at w = 1 (1k / 32k) and
  +0.2 to +0.8 from w = 2 on; CS = 2 -0.11 / -0.05 at w = 2, slower at w = 4; hence the rule by rows (variants
  mla_cs1 = the old kernel, mla_cs2, mla_cs4). The rule gives 1 under the Triton interpreter, whose numpy dots round
  by the tile's shape (a row's bits must not depend on the call's width there either).
- fuse_out_cast: tensor parallel under allreduce='nccl' (or where the one-shot kernel does not take the message),
  a row-parallel sublayer's all-reduced fp32 sum is rounded to the model dtype inside the kernel that adds it to the
  residual (o_proj: the post-attention add + norm + quant; the dense MLP: `norm_quant.add_rounded`), bit-identical;
  off: the sublayer's `.to(x.dtype)` is a launch of its own (2 launches per layer).
- index_weights: the lightning indexer's head weights (x @ weights_proj^T, scaled) in one launch
  (`index_weights.index_weights`), read from the weight in place; off: cuBLAS's bf16 GEMM with fp32 output (split-K
  with a reduce kernel, 2-3 launches by the rows) + the scale, or an fp32 linear (only past the indexer's top-k).
- mlp_reduce_norm: under allreduce='oneshot', a tensor-parallel block's FFN all-reduce is not done in the FFN but
  by the next block, in one kernel with its residual add + input RMSNorm + FP8 quant (`fast_path.FastTrunk`,
  `backends.pending.Pending`), as o_proj's already is with the post-attention norm; off: the FFN all-reduces
  its output, the block adds it, and the next block norms (3 launches instead of 1 per layer). Under another
  all-reduce (NCCL) with fuse_out_cast, the next block all-reduces the handed-off sum alone, then rounds and adds
  it in its add + norm + quant kernel (2 launches instead of 3: no `add_rounded`); the same bits.
- topk_rearm: the indexer top-k's workspace kept per (device, rows) and left zeroed by its last kernel
  (`topk.kept_workspace`, `indexer_topk(rearm=True)`); off: a fresh zeroed workspace per call (one memset launch).
- shared_in_experts: the MoE's shared expert as one more expert of the routed experts' kernels (stacked last,
  every token's implicit extra slot with weight 1: `moe.moe_experts(shared=)`, `fast_path.FastMoE.shared_in_stack`)
  where its slice has the routed experts' shapes (one process with n_shared = 1; a 'split' expert-parallel rank)
  and the pair / persistent layouts run; off: its own gate | up GEMV, silu * up and down (3 launches per layer).
- moe_wave_splits: where every routed slot of a MoE is local (a 'split' expert-parallel rank, one process) and its
  experts run the persistent layout, the K slices are sized for T * slots distinct experts so that the work items
  fill whole rounds of the grid (`moe.wave_splits`: 7 gate / up slices at one token on a TP=8 split rank, one round
  of 126 items, where the default's 8 give 144 items on 132 SMs); off: `moe.default_splits`, which assumes ~1
  active expert per token (a contiguous expert-parallel rank). Other sums' order (K slices), same formulas. On by
  default: measured on one TP=8 split rank (H200, 61 layers, BENCHMARKS.md session 12) -1.1 ms a step at w = 1
  (6.43 vs 7.54 ms at 1k, 9.15-9.19 vs 10.35-10.46 at 32k), -0.25 to -0.57 at w = 2, wider steps unchanged (they
  run the pair grid).
- moe_item_regs (on): the persistent experts' kernels with no dependent load before a work item's weight tiles
  (`moe.moe_experts(item_regs=True)`, `mtp.kernels.moe_items`): the item's expert, rows and slots from the ids the
  program loaded once (registers) instead of a reload per item; the per-group weight (and h) scales loaded one K
  group ahead instead of after each wgmma's wait; the down route weights before its loop; gate/up's last-arriving
  slice with its KS partial loads in flight at once instead of one round trip per slice. The same tiles, the same
  sums in the same order: bit-identical. Measured on one TP=8 split rank (H200, 61 layers, BENCHMARKS.md session 17,
  b2b, two alternations against off): -0.23 / -0.39 / -0.42 / -0.20 ms a step at 1k w = 1..4 (5.13-5.18 vs 5.36-5.41
  at w = 1), -0.27 / -0.41 / -0.42 / -0.22 at 32k; alone (`python -m mtp.bench.topk_moe --only moe_split`) 26.0 /
  48.6 / 54.8 / 72.9 us at T = 1..4 against 29.8 / 55.5 / 61.4 / 75.1. The program's next item's weight lines asked
  of L2 before this item's loop (`moe_experts(item_prefetch=True)`) measured slower alone (27.4 us at one token):
  off. Off: `moe._work_item` and the item loop of sessions 12-16 (variant moe_item_regs_off).
- kv_split (on; variant kv_split_off): with fuse_prologue, each token's latent + rotary key and its indexer key in
  two programs of the kv prologue + q_a norm launch instead of one (`mla_prologue_fused.mla_kv_prologue_norm(
  kv_split=True)`): the same code, the same bits; the token's two independent dependent chains side by side instead
  of one after the other. Measured on an H200 (BENCHMARKS.md session 18): alone 4.27 -> 3.68 us at one token, 4.05
  -> 3.25 at four; one TP=8 rank's step (b2b, two alternations) -0.00 / -0.08 / -0.10 / -0.06 ms at 1k w = 1..4,
  -0.03 / -0.14 / -0.10 / -0.14 at 32k.
- moe_x8 (on; variant moe_x8_off): the persistent experts' gate/up kernel reads the block's
  quantized input (`FastBlock`'s post-attention add + norm + quant hands (x8, sx) to `FastMoE`, which used it for
  the separate shared expert only) instead of quantizing x again in every K group of every work item
  (`moe.moe_experts(xq=)`: x8's [BM, 128] tile goes to shared memory by cp.async with the weights' and straight
  into the wgmma, its [BM] scales one K group ahead with the weights'). Those are the same bits: the norm kernels
  quantize the y they store (rounded to the model dtype) with the loop's own ue8m0 / e4m3 helpers. sm_90 code at a
  TP=8 split rank's shapes (triton 3.6, compiled on the CPU): the K loop's SASS 360 -> 230 instructions per K group
  (a 2 x 16 KB weight step) with moe_item_regs, no spills. Persistent layout only (`FastMoE.routed`); off: x
  quantized in the loop. Measured on an H200 (BENCHMARKS.md session 18): the split rank's experts alone 26.33 /
  48.70 / 55.00 / 73.52 -> 25.45 / 45.94 / 52.69 / 71.75 us at T = 1..4; the step (b2b, two alternations) -0.03 /
  -0.14 / -0.12 / -0.14 ms at 1k w = 1..4, -0.05 / -0.17 / -0.10 / -0.15 at 32k.
- moe_tma (on where the GPU has TMA, `moe.has_tma`: compute capability >= 9.0; pointer loads elsewhere and under the
  CPU's interpreter; variant moe_tma_off): the persistent experts' weight tiles (gate, up, down) loaded by
  Hopper's tensor memory accelerator: one thread issues a bulk copy of each [128, 128] fp8 tile into shared memory
  (completion on an mbarrier) through a host tensor descriptor of the stack seen as [E * N, K] (`moe.weight_desc`,
  cached per stack, a by-value kernel parameter that a CUDA graph captures), instead of pointer tensors compiled to
  cp.async (`moe.moe_experts(tma=True)`). The same tiles, scales, dots and sums in the same order: bit-identical.
  sm_90 code at a TP=8 split rank's shapes (triton 3.6, compiled on the CPU, x8 and item_regs on): the pipeliner
  still multi-buffers the copies (4 gate/up, 5 down stages, the same shared memory + 32 / 40 bytes of barriers); the
  K loop's SASS 230 -> 223 instructions per K group in gate/up, 176 -> 157 in down; registers 250 -> 158 (gate/up,
  one token), 168 -> 122 (down). Persistent layout only, sm_90+ (an older GPU is refused by name); off: cp.async.
  Measured (H200, session 19, BENCHMARKS.md; predicted within +-1 us a call): the experts alone -0.8 / -0.5 / -1.2 /
  -1.0 us at T = 1..4 (`topk_moe --only moe_knobs`); the TP=8 split rank's step (busy, two alternations) -0.00 /
  -0.03 / -0.00 / -0.08 ms at 1k w = 1..4, -0.03 / -0.05 / -0.00 / -0.07 at 32k.
- moe_down_nb (on; variant moe_down_nb_off): the persistent experts' down projection by output
  block (`moe.moe_experts(down_nb=True)`, `mtp.kernels.moe_down_nb`): one program per 64 rows of D (112 at D = 7168)
  loops over every expert of the call and its K groups in one pipelined loop, each program building the loop's plan
  (experts by id, token slots, column scales) in a scratch of its own, and stores y itself: no per-slot partials, no
  combine launch. Against the work items (expert, 128-row block, K slice) of `moe._moe_down_persistent`, whose
  2-group loops cannot be pipelined across items and whose per-item epilogue stores [128, T] partials, at T = 4 on a
  TP=8 split rank 29.4 us a layer where the tiles stream in 18.7 (H200, BENCHMARKS.md session 19), + ~2 us of
  combine. Another fp32 sum order (each token's experts by ascending id, the shared slot's last), within fp32
  reordering of the switch off; a token's bits do not depend on the call's other tokens. Persistent layout only
  (`FastMoE.routed`); off: the work items + `moe._moe_combine_kernel`. Measured (H200, one TP=8 split rank, 61
  layers, 1k, busy ms, BENCHMARKS.md session 20): +0.02 / -0.34 / -0.36 / -0.57 a step at w = 1 / 2 / 3 / 4; alone
  (`mtp.bench.topk_moe --only moe_down_nb`, gate/up + down (+ combine)) 43.5 -> 38.3 / 50.4 -> 43.6 / 69.1 -> 58.5 us
  at T = 2 / 3 / 4.
- moe_down_pf_experts (8 on a tensor-parallel rank, 0 in one process: `for_world(1)`; 0: off; an integer; variants
  moe_down_pf_off (this and moe_gate_up_aw off), moe_down_pf, moe_down_pf_noaw, moe_down_pf_all): with pdl,
  prefetch (`prefetch_at`) and moe_down_nb, where the gate/up launch before it triggers it only after gate/up's own
  wait (PDL_AFTER_WAIT: calls past pdl_early_tokens, or every call with moe_gate_up_aw), the down kernel by output
  block reads the router's ids and route weights and the down scales before its PDL wait and builds the weight
  side of its plan there (`moe_down_nb._plan_ids` / `_plan_ranks`: final by then, since gate/up could only trigger
  once the router had completed), and each program asks L2 for its rows of its loop's first this many experts
  (ascending id: the loop's order; `moe_down_nb._prefetch_routed`), as it did the shared expert's rows alone
  (`moe.moe_experts(down_pf_experts=)`). Where gate/up triggers at its start (one token by default) the router may
  still be running: compiled out there. The same plan, the same bits (a prefetch is a hint). Replaces: the whole
  plan after the wait (the ids' load, the down scales' load that waits on it, the ranks' ~8 barriers; ~1.5 us of
  round trips) and the first weight tiles from HBM. Why: profiled (H200, one TP=8 split rank, 61 layers, 1k) the
  down kernel is exposed 11.2 us a MoE layer at one token against ~4 us of bytes (16.5 MB: 9 experts x 7168 x 256),
  21 us at four against 13.4. Its programs (123 KB of shared memory) fit beside none of gate/up's (139 KB), so they
  start as gate/up's programs exit: the window is gate/up's tail (its fix-ups, its completion), ~1.5-3 us. Predicted:
  -1.5 to -3 us a MoE layer (the plan's ~1.5 us off the critical path, the first experts'
  tiles from L2), -0.09 to -0.17 ms a step at w = 2..4 (58 MoE layers); at w = 1 only with moe_gate_up_aw: -2 to -4
  us a layer, -0.12 to -0.23 ms. 8 covers a one-token call's routed experts (its shared one, the loop's last, is
  asked for anyway) and 14.7 MB of a four-token call's 60.5 (33 experts: all of them would overflow the 50 MB L2
  while gate/up's own weights stream through it); 64 (variant moe_down_pf_all): every expert of the call.
  Measured (H200, one TP=8 split rank, 61 layers, 1k, busy ms, two alternations in one process against the defaults
  of then, BENCHMARKS.md session 25, eval/results/s25/x2b): with moe_gate_up_aw -0.04 / -0.00 / -0.01 / -0.06 at
  w = 1 / 2 / 3 / 4 (4.39 vs 4.43 at w = 1, 6.75-6.76 vs 6.82 at w = 4); without it (variant moe_down_pf_noaw)
  w = 1 unchanged and w = 4 -0.06: below the prediction (the window is shorter than guessed, or L2 lines are lost),
  both reps alike. Default on a tensor-parallel rank since; one process keeps it off (not measured there).
- moe_gate_up_aw (on a tensor-parallel rank, off in one process: `for_world(1)`; variant moe_gate_up_aw, and with
  moe_down_pf_experts moe_down_pf; moe_down_pf_off turns both off): with pdl, the persistent
  experts' gate/up launch triggers the down launch after its own wait (`_triton.PDL_AFTER_WAIT`) at every width,
  one token included (pdl_early_tokens puts it at the start there), so that moe_down_pf_experts applies to one-token
  calls too (`moe.moe_experts(gate_up_after_wait=)`); the same bits. Trade-off (predicted, not yet measured): the
  down kernel launches only once the router has completed instead of when gate/up starts; its programs cannot sit
  beside gate/up's anyway (shared memory), but its successors' chain of early launches (down triggers at its start
  at one token) starts a few us later: ~0 (+0.3 us a layer at most) alone, -2 to -4 us a layer with the early plan.
  Measured with the early plan (above): -0.04 ms a step at w = 1 (not timed alone).
- pdl (on, for calls of up to `pdl_tokens` tokens: 64 by default on a tensor-parallel rank, with the trigger after
  the wait past one token, pdl_early_tokens 1: measured on one TP=8 split rank, H200, BENCHMARKS.md session 15,
  back-to-back replays: -0.36 to -0.51 ms a step at w = 2..4 at 1k, -0.14 to -0.43 at 32k, against PDL at w = 1
  only; 1 in one process, `FastPathOptions.for_world`, where it was 0.11 ms slower at w = 2..4; before, with the
  trigger at the start, session 12: -0.5 to -0.6 ms at w = 1, +0.3 to +0.9 ms at w = 2..4): launch
  every Triton kernel of the decode step with programmatic dependent launch (Hopper; `_triton.pdl_kwargs`), so that
  each launches while the one before runs: each triggers its successor first thing (`pdl_launch`), loads or asks
  L2 for its constant weights (the GEMV's tile, W_kb / W_vb, the gate, the indexer's weights_proj, the few-row
  GEMM's slab), then waits for the previous kernel (`pdl_wait`) before it reads an earlier kernel's output or
  stores anything: the same bits as without. Not in the chain: NCCL / one-shot all-reduces, cuBLAS (lm_head), torch
  glue (the glue's four kernels are, switch glue_pdl), the final norm, the grouped MoE layout (> 16 tokens), the
  prefill GEMM and the cooperative one-launch top-k / indexer (switches topk_one_launch, indexer_one_launch). The
  torch.compile'd elementwise ops join in only when TORCHINDUCTOR_ENABLE_PDL=1 is set before it compiles.
- topk_one_launch (off: measured no gain on the TP=8 rank at 32k, H200, session 12; alone 16.9 vs 17.3 us at 8k
  keys, 2 rows): the indexer top-k's three radix phases (histogram, split, write) in
  one cooperative launch whose programs meet at a barrier per row between them (`topk_one_launch`), where its grid
  fits the SMs (every decode shape: R x C <= the SM count, else the three launches); the same index sets. Off: three
  launches (`topk.radix_topk`).
- indexer_one_launch (off: measured slower alone, 31.7 vs 20.7 us at 8k keys, 2 rows, H200, session 12; radix
  top-k impls): the indexer's scores and its top-k in one
  cooperative launch (`indexer_one_launch`: each program scores its chunk of keys for a batch row's queries, then
  runs the top-k's phases on them), where its grid fits the SMs (else scores + the one-launch top-k); the same
  scores and index sets. The scores kernel's launch settings (`set_kernel_options(indexer_scores=)`) do not apply.
- pdl_prefetch_tokens (64: the behaviour pdl was measured with; an integer): with pdl, for calls of at most this
  many tokens, the kernels that ask L2 for their constant weights before the wait do so (`_triton.prefetch_l2`: the
  few-row GEMM's slab, the router's gate slice, W_kb / W_vb in absorb_q / absorb_out / the fused q prologue / stage
  2 + absorb, the shared expert's span in the experts' kernels); for more tokens (or 0) those prefetches are
  compiled out (a constexpr: PREFETCH, or absorb's PF 0) and each kernel still triggers its successor first and
  waits before reading an earlier output or storing: the same bits (a prefetch is a hint). A test of one guess for
  why PDL loses at w >= 2 (the prefetches competing with the running kernel for HBM or issue slots): variants
  pdl_nopf / pdl_all_nopf / pdl_all_pf1 (`mtp.bench.rank.KERNEL_VARIANTS`). Weight loads issued before the wait are
  not prefetches and stay (the split-K GEMVs' whole tile, `gemv_splitk`; index_weights' first chunk of W).
- pdl_early_tokens (1; an integer): with pdl, calls of at most this many
  tokens trigger their successor's launch at their start (PDL_EARLY), more tokens (or every call, 0) right after
  their own wait (PDL_AFTER_WAIT; `_triton.pdl_mode`): then a successor cannot launch before its predecessor's
  predecessor has finished, so at most two grids are resident, not a chain of waiting ones holding SM slots and
  prefetching. The guess for why PDL lost at w >= 2 (session 14: busy time +0.58 / +0.83 / +0.76 ms at w = 2 / 3 / 4
  at 1k, spread over many kernels); measured (session 15, H200, back to back): PDL at w = 2..4 with the trigger
  after the wait -0.51 / -0.44 / -0.41 ms a step at 1k against no PDL there (variants pdl_w1, pdl_all, pdl_all_aw1,
  pdl_aw in `mtp.bench.rank.KERNEL_VARIANTS`). The same bits (a trigger only allows a launch; every kernel still
  waits for its predecessor).
- topk_split_v2 (on; not yet timed against V1 on a GPU, session 15): the indexer top-k's kernels with fewer
  dependent global round trips on the split kernel's path (`topk._topk_split_kernel` / `_finish_row` V2: the chunk's
  scores loaded before the histograms, the scores' load not waiting for the row length's, the last program's
  candidate count, chunk counts and candidates in one round trip and its per-chunk counts from the same registers),
  and ties at the boundary over thousands of candidates resolved by a walk over the scores instead of three position
  passes (`topk._tied_position`); the same index sets bit for bit; in the one-launch top-k and indexer too. Off: V1,
  the kernels before (variants topk_split_v1 / topk_split_v2).
- fused_hist_rows (1; an integer): an indexer call of at most this many score rows (batch x queries) whose top-k is
  'radix' runs 'radix_fused' (`indexer.indexer_topk`: the radix select's histogram pass in the scores kernel's
  epilogue, one launch fewer per layer past the top-k's 2048 keys; the same scores and index sets bit for bit); more
  rows, or 0, the histogram launch. Measured on one TP=8 split rank at 32k (H200, session 14, busy kernel time per
  step): -0.34 ms at one row, +0.17 / +0.48 / +0.75 ms at 2 / 3 / 4 rows (not profiled why; each scores program
  loops over the rows, and its histogram epilogue with them). `topk_impl_at`.
- logits_scan (on; variant logits_scan_off): the decode step's argmaxes over the vocabulary (the strict verifier's,
  chain and tree; the greedy drafts') and the health flag of the target's logits (`mtp.decode.health`) by one launch of
  `logits_scan.logits_scan` each, the verify's argmax and flag in the same launch (`scan_logits`); off: torch.argmax,
  and isfinite / amax / amin (5-6 launches). Exact: the same indices (torch's rule: the first maximum, a NaN the
  largest) and the same flag in every case. CUDA logits in fp32 / bf16 / fp16 (and under the Triton interpreter);
  elsewhere torch's ops. Measured before (one H200, a TP=8 rank's eagle k = 3 step, session 19): torch.argmax 27.8 us
  a call (4 a step), the flag ~35 us; predicted ~4-6 us a launch, ~130 us a step saved. Measured after (same
  session, BENCHMARKS.md): argmax + flag 80.3 -> 4.6 us at one row; the eagle k = 3 step 8.821 -> 8.694 ms GPU.
- step_commit (on; variant step_commit_off): a chain decode step's accept + commit + count (`mtp.decode.accept`) in one
  launch of `kernels.step_commit.chain_commit` (one program holds every row's integers), where the step has no thinking
  state to update (relaxed verifiers with think ids keep the torch ops) and the kernel runs (CUDA, or the Triton
  interpreter); off: 48 torch launches (cat, index_put, isin, argmax, minimum, where, scatter, the counters' adds and
  copies). The same tokens, lengths, flags, cache lengths, counters and outputs, integer for integer. Counted on the
  CPU (`mtp.bench.step_launches`): 47 launches fewer a step (48 torch ops: a GPU runs isin as several kernels);
  predicted (H200, a TP=8 rank's eagle k = 3 step) ~50 us fewer (~1.1 us of exposed time a launch in session 20's
  profile, less the kernel's own ~3 us); to be measured (`--kernels step_commit=0`). A tree step's too (session 22,
  `tree_step.TreeStep`: the drafts along its path, no draft window, its cache compaction after the launch): 44 torch
  launches -> 2 (the kernel and the compaction's base) on an eagle 2x1x1 tree step (`mtp.bench.step_launches --tree
  2x1x1`: glue 252 -> 209).
- rope_table (on; variant rope_table_off): a forward's cache slots (seq_lens + t) and their rotary angles in one launch
  of `kernels.lookup.rope_slots`, gathered from tables of `Rotary.angles` over positions 0..P-1 that the reference's
  own ops made (`fast_path.FastRotary`: the same bits); off: the slots' add and the angles' cast, product, cos and sin
  (5 launches a forward). Every forward: the target's and each MTP module's.
- vocab_embed (on; variant vocab_embed_off): a vocabulary-parallel rank's embedding lookup (its rows, zeros for the
  ids it does not hold) in one launch of `kernels.lookup.embed_rows` (`fast_path.FastVocabParallelEmbedding`, the
  same bits), before its all-reduce; off: the reference's 8 launches (offset, 2 range compares, and, clamp, lookup,
  not, mask). Tensor-parallel models (one process looks up with one launch already).
- mtp_norms (on; variant mtp_norms_off): an MTP module's enorm and hnorm with their cat (eh_proj's input) in one
  launch of `elementwise.rms_norm_pair` (`fast_path.FastMTPLayer`: each half the Triton rms_norm kernel's code at its
  warps, the same bits) where the elementwise ops are the Triton ones; off: two norm launches and the cat.
  These three, counted for an eagle k = 3 step (4 forwards, 3 of them MTP modules; `mtp.bench.step_launches` on a
  tiny simulated rank under the Triton interpreter, held by tests/bench/test_step_launches.py): 4 x 4 + 4 x 7 + 3 x 2
  = 50 launches fewer, with step_commit 97; a target step (one forward) 11 fewer. Predicted on a TP=8 rank (H200):
  ~55 us an eagle step for the three (~1.1 us exposed a launch, session 20, less the new kernels' own time).
- glue_pdl (on; variant glue_pdl_off): with pdl, the four glue kernels above (the commit, the slots' gather, the
  embedding, the MTP norm pair) launch with programmatic dependent launch where a call of as many tokens / rows would
  (`glue_pdl_at`: `pdl_at`, the same trigger placement), waiting first thing (each reads an earlier kernel's output
  before anything else worth loading); the same bits. Off: launched plainly, as in session 21. Measured (H200,
  session 22, `mtp-bench --tp 8 --k 3`, same machine): eagle k = 3 GPU 7.619 ms off, 7.613 on: within the noise,
  the size predicted. Predicted (an eagle k = 3 step: 12 launches take it, 4 gathers, 4 embeddings, 3 norm pairs, 1
  commit): a kernel gains its launch gap (~1-1.5 us exposed) where the one before it triggers: the embedding after
  the gather (4 a step), and on the simulated TP=8 rank `mtp-bench --tp 8` times, whose all-reduces launch nothing,
  the norm pair after the embedding too (3; a real rank's NCCL all-reduce sits between them); the rest follow torch /
  NCCL / cuBLAS kernels, which never trigger, so their launch moves up to the predecessor's last block exit at best
  (<= 0.5 us each). ~7 x 1-1.5 + 5 x <= 0.5 us: ~7-13 us a step on the simulated rank (of ~7.6 ms), ~5-9 us on a
  real one.
- tree_glue (on; variant tree_glue_off): with step_commit, a tree step's glue after the commit kernel in one launch
  of `kernels.tree_commit.tree_commit` (session 23): the kept path's cache compaction (`KVCache.compact`: every
  layer's five buffers moved as integers), its target hidden rows and the tree's counters (`tree_step.keep_path`),
  where the kernel takes the shapes (`tree_commit_takes`); PDL as the other glue kernels (`glue_pdl_at`). The same
  bits, integer for integer. Off: those torch ops (the compaction's aranges, adds, an index + index_put per buffer,
  the lengths' copy; the positions, gathers, where / scatter of the hidden rows; the counters' compare, and, index,
  scatter_add, sum, add). Counted (`mtp.bench.step_launches --tree 2x1x1`, the tiny TP=2 rank): glue 209 -> 173 a
  step (the commit's base subtraction, 16 of the compaction and 20 of the step's ops -> the one kernel). Predicted on
  a TP=8 rank (H200, one row, 2x1x1: A = 4): 36 launches x ~2 us (1-3) of GPU each in the step's
  graph = ~72 us, less the kernel's own ~3-5 us (one wave of 61 + 7 + 1 programs, ~0.5 MB moved: 61 layers x 4
  slots x 788 bytes each way, 4 hidden rows of 14 KB; a few dependent memory round trips a program): ~65-70 us a
  tree step (~35-105 at 1-3 us a launch). Measured with tree_fwd_glue (both switches flipped together, below).
- tree_fwd_glue (on; variant tree_fwd_glue_off): with rope_table, a tree forward's (the verify's and each draft tree
  forward's: `Rotary.tree_slots`) cache slots, the angles of its nodes' positions (the tree's first slot + depth) and
  its visibility [B, T, S] in one launch of `kernels.lookup.tree_slots` (`fast_path.FastRotary`), the angles gathered
  from rope_table's table (the reference's own ops made it), the visibility from the lengths and the tree mask: the
  same bits, bool for bool. Off: the reference's 18 launches a forward (the slots' add, the first slot's two, the
  depths' add; the angles' cast, product, cos and sin; `tree_visibility`'s arange, sub, 2 compares, and, clamp,
  gather, compare, and, or). Counted (`mtp.bench.step_launches --tree 2x1x1`, the tiny TP=2 rank, 3 tree forwards a
  step: the verify and the eagle drafter's two): glue 173 -> 122 a step (54 -> 3). Predicted on a TP=8 rank (H200,
  one row, 2x1x1): 51 launches x ~2 us (1-3) of GPU each in the step's graph = ~100 us, less the
  kernel's own ~2-3 us x 3 (7 nodes x 2 blocks of 1024 slots at a 1k context, a few hundred bytes of angles and
  ~7 KB of bools each): ~95 us a tree step (~40-145 at 1-3 us a launch). The attention kernels read the [B, T, S]
  mask the launch writes (one a forward, shared by the 61 layers); taking the tree mask and the first slot instead
  would save only that launch and ~7 KB of reads a layer.
  Measured, both tree switches together (H200, one TP=8 split rank, 61 layers, 1k, `python -m mtp.bench.spec_ab
  --switches tree_glue,tree_fwd_glue --tree 2x1x1 --reps 3`, BENCHMARKS.md session 23): the 2x1x1 eagle tree step
  10.898 ms on vs 11.090 off (-0.19 ms; predicted ~0.16), the eagle k = 3 chain beside it 7.621 / 7.622.
- tree_verdict (on; variant tree_verdict_off): the strict verifier's tree verdict from the target's argmax at every
  node (`verify.tree.strict_argmax`: the deepest node whose whole path matches, ties to the lower index, dead nodes
  never accepted; its accept length, next token, path and inexact count) in one launch of
  `kernels.tree_verdict.tree_verdict` (one program a row), where the kernel takes the tensors; PDL as the other glue
  kernels (`glue_pdl_at`). The same integers. Off: `verify.tree.tree_strict_verdict`'s torch ops (`_exact`'s index
  and compares, `_live`'s and, `_deepest`'s ancestor reduction, score and argmax, `_verdict`'s gathers and inexact
  count). The relaxed, typical and sampling tree verifiers keep their torch ops. Counted (`mtp.bench.step_launches
  --tree 2x1x1`, the tiny TP=2 rank): glue 122 -> 98 a step (25 -> 1). Predicted on a TP=8 rank (H200, one row,
  2x1x1): 24 launches x ~1-2 us of GPU each in the step's graph = ~24-48 us, less the kernel's own ~2-3 us (one
  program a row, a [8, 4] tile, a few dependent loads): ~20-45 us a tree step; measured with the others (below).
- strict_commit (on; variant strict_commit_off): with step_commit, a strict chain step's verdict made inside the commit
  kernel's launch (`kernels.step_commit.chain_commit(target_BK1=)`, session 25): the kernel takes the target's argmax
  [B, K1] (the logits scan's) and computes the drafts' leading run equal to it, the argmax after it and no relaxed
  count, where `verify.strict.strict_verdict` ran compare, cumprod, sum, gather and zeros_like (5 torch launches) before
  it; verifiers that declare this rule (`Verifier.argmax_prefix`: strict) only. The same integers (the verdict never
  leaves the kernel; every state tensor it writes is torch.equal, tests/kernels/test_step_commit.py). Counted
  (`mtp.bench.step_launches`, eagle k = 3, the tiny TP=2 rank): glue -5 a step. Predicted on a TP=8 rank (H200): 5
  launches x ~1-2 us of GPU in the step graph's critical path (verify's argmax -> verdict -> commit is one chain of
  dependencies), ~5-10 us an eagle step, less the kernel's few extra loads; measured with the others (below).
- draft_window (on; variant draft_window_off): a chain step's draft window (`Proposer._window`: the first window
  module's tokens, the target's hidden rows over the window, its logits row and the drafts' slots) in one launch of
  `kernels.draft_window.draft_window` (session 25), where the torch ops were 9 (the positions' add, 2 subs and a clamp,
  the slots' add, the hidden rows' gather, the tokens' add, clamp and gather); the same integers and rows. Counted
  (`mtp.bench.step_launches`, eagle k = 3, the tiny TP=2 rank): glue -8 a step (once a step: the window; the draft
  prefill's chunks take it too). Predicted on a TP=8 rank (H200): 8 launches x ~1-2 us of GPU, all in the step
  graph's critical path (commit -> window -> the first draft forward's embedding), ~8-16 us an eagle step less the
  kernel's own ~2 us (B x W x 7168 fp32 hidden rows copied: 115 KB at one row, W = 4, what the gather moved);
  measured with the others (below). Also (session 25): the first window module's cache `truncate(p0)` (a copy) in
  the same launch (the kernel stores p0 as the cache's lengths): glue -1 more a step, at one row as at two (counted);
  ~1-2 us predicted. With it, the verify's slots n-1.. and x_{n-1}, from which the proposer stacks the verify's ids
  with its drafts (`Proposer.verify_input`: the chain step's own add and gather gone, -2 on; off, the torch window's
  add serves both and x_{n-1} is its own gather, -1): ~2-4 us predicted; both measured with the others (below).
- tree_window (on; variant tree_window_off): an eagle / vanilla tree step's first window (`TreeProposer._window_inputs`,
  module 0: the window's start from the lengths, the module's cache rolled back to it, its tokens, the target's hidden
  rows, its logits row and the root token x_{n-1}) in one launch of `kernels.draft_window.tree_window` (the chain's
  `draft_window` kernel in its TREE mode, session 25), where the torch ops were 12 (the start's sub and clamp, the
  lengths' copy, the positions' add, the tokens' add, clamp and gather, the hidden rows' gather, the logits row's sub
  and clamp, the root's sub and gather); the same integers and rows. Counted (`mtp.bench.step_launches --tree 2x1x1`,
  the tiny TP=2 rank): glue 65 -> 54 a step (-11: once a step; the draft prefill's windows take it too). Predicted on
  a TP=8 rank (H200, 2x1x1): 11 launches x ~1-2 us of GPU, all on the step graph's critical path (commit -> window ->
  the first draft forward's embedding), ~11-22 us a tree step less the kernel's own ~2 us (B x 4 x 7168 hidden rows
  copied, what the gather moved); measured with the others (below).
- gather_cast (on; variant gather_cast_off): a column-parallel rank's bf16 projections cast to fp32 (an MTP module's
  eh_proj output, the logits of the target's and the MTP modules' heads) by the copy that lays the all-gathered slices
  side by side (`fast_path.FastColumnParallelLinear`, `Comm.all_gather_last`'s out_dtype; session 25), where the
  copy and a cast after it were two launches; the same values. Past one row of the gathered tensor only (one token's
  slices already lie side by side: the cast is its one launch either way). Counted (`mtp.bench.step_launches`, eagle
  k = 3, the tiny TP=2 rank): glue -7 a step at two rows (3 eh_proj, 3 draft heads, the verify's head), -2 at one row
  (the window's eh_proj over W positions, the verify's head over K + 1 tokens). Predicted on a TP=8 rank (H200),
  one row: 2 launches x ~1-2 us in the step graph's critical path, plus the verify logits' bf16 copy no longer
  written and read again (K1 x 129280 x 2 B = 1 MB each way: ~0.4 us at 4.8 TB/s), ~2.5-4.5 us an eagle step;
  measured with the others (below).
  Measured, the session's glue switches together (H200, one TP=8 split rank, 61 layers, 1k, `python -m
  mtp.bench.spec_ab --switches ... --tree 2x1x1 --reps 3`, BENCHMARKS.md session 25): strict_commit + draft_window
  + tree_verdict: eagle k = 3 -0.017 ms a step, 2x1x1 tree -0.039; with tree_window and gather_cast too (and the
  window's later additions): -0.030 / -0.077 (predicted ~19-38 us / ~60-130 us with the switchless cuts, which both
  sides held).
Not a switch here, because it is not read at call time: which elementwise ops (norms, rotary, SiLU-mul, FP8 quant,
Hadamard) the fast path gives the model, `ELEMENTWISE_IMPLS` (`fast_path.enable_fast_path(elementwise=...)`,
`fast_path.set_elementwise`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

__all__ = ["ELEMENTWISE_IMPLS", "ExpertMap", "FastPathOptions", "expert_map", "linear", "local_ids", "route",
           "scan_logits"]

# the fast path's elementwise ops: 'triton' (one Triton kernel each, `kernels.elementwise`; the default), 'compile'
# (torch.compile of the reference functions: ~33 s of start-up on a cold cache), 'eager' (the reference functions)
ELEMENTWISE_IMPLS = ("triton", "compile", "eager")


# the options that are integers; every other field is an on / off switch
INT_FIELDS = ("gemv_rows", "pdl_tokens", "pdl_prefetch_tokens", "pdl_early_tokens", "fused_hist_rows",
              "gemv_one_slice", "gemv_warps", "norm_warps", "mla_channel_splits", "router_one_tokens",
              "router_one_split", "gemm_deep_rows", "moe_down_pf_experts")


@dataclass
class FastPathOptions:
    gemv: bool = True
    norm_quant: bool = True
    router: bool = True
    prologue: bool = True
    fuse_prologue: bool = True
    absorb: bool = True
    index_weights: bool = True
    pdl: bool = True
    mlp_reduce_norm: bool = True
    fuse_absorb_out: bool = False
    fuse_out_cast: bool = True
    topk_rearm: bool = True
    shared_in_experts: bool = True
    moe_wave_splits: bool = True
    topk_one_launch: bool = False
    indexer_one_launch: bool = False
    topk_split_v2: bool = True
    moe_item_regs: bool = True
    kv_split: bool = True
    moe_x8: bool = True
    logits_scan: bool = True
    moe_tma: bool = True
    moe_down_nb: bool = True
    step_commit: bool = True
    rope_table: bool = True
    vocab_embed: bool = True
    mtp_norms: bool = True
    glue_pdl: bool = True
    tree_glue: bool = True
    tree_fwd_glue: bool = True
    tree_verdict: bool = True
    strict_commit: bool = True
    draft_window: bool = True
    tree_window: bool = True
    gather_cast: bool = True
    moe_gate_up_aw: bool = True
    router_one_tokens: int = 8
    # impl one's calls of at least this many tokens route one token in each of its last programs to arrive
    # (`moe_route_fused(split_tail=True)`: the same bits); 0: never (the default until timed on a GPU)
    router_one_split: int = 2
    # the split-K GEMV for 1..gemv_rows rows (<= gemv_splitk.MAX_M), the tensor-core GEMM above. 1: measured on an
    # H200 (BENCHMARKS.md, 2026-11-23): at 2..4 rows the CUDA-core GEMV is 1.3-3x slower than the GEMM on the
    # TP=1 and TP=8 rank weights (TP=8 rank step at w = 4: 14.51 ms with 8, 11.24 ms with 1)
    gemv_rows: int = 1
    # with switch pdl: PDL on the launches of calls of at most this many tokens (rows). 64 (= fp8_gemm.SMALL_M: every
    # decode width), with pdl_early_tokens 1: measured on one TP=8 split rank (H200, BENCHMARKS.md session 15); 1
    # (session 12's measure, the trigger at the start: +0.3 to +0.9 ms a step at w = 2..4) before that, and still
    # for one process (`for_world`)
    pdl_tokens: int = 64
    # with switch pdl: the explicit L2 prefetches of constant weights before the wait for calls of at most this many
    # tokens (more, or 0: compiled out, the same bits). 64 (= fp8_gemm.SMALL_M, wherever PDL runs): the behaviour PDL
    # was measured with
    pdl_prefetch_tokens: int = 64
    # with switch pdl: calls of at most this many tokens trigger their successor's launch at their start
    # (`_triton.PDL_EARLY`), more tokens right after their own wait (`_triton.PDL_AFTER_WAIT`; 0: every call). 1:
    # one-token calls as measured since session 12; w = 2..4 after the wait (session 15: 0.41-0.51 ms a step faster
    # at 1k than without PDL there, where the start trigger was 0.13-0.39 slower than without)
    pdl_early_tokens: int = 1
    # indexer calls of at most this many score rows take the 'radix_fused' top-k where 'radix' is set (`topk_impl_at`)
    fused_hist_rows: int = 1
    # the split-K GEMV's whole K in one slice (no fix-up; 4 warps) where K / 128 is a power of two in (8, this]
    # (`gemv_splitk.gemv_plan`); 0: the split plan. 16: the TP=8 rank's o_proj (K = 2048), 7.41 vs 10.20 us alone
    # on an H200 (`mtp.bench.small_kernels`, BENCHMARKS.md session 17)
    gemv_one_slice: int = 16
    # the split-K GEMV's warps (4 or 8); 0: `gemv_splitk.gemv_plan`'s (8 on a 16 KB tile of a grid under 32 programs
    # an SM). Why 4 might pay on a TP=8 rank at one row (sm_90 code of the 16 KB tile, M = 1: 40 registers at 8 warps
    # = 6 programs an SM, 56 at 4 warps = 9): q_a | wk | kv_a's 980 programs fit one wave at 4 warps (1188 resident)
    # but not at 8 (792), so at 8 a fifth of its 16 MB is asked for only after the PDL wait, the rest before it.
    # Predicted ~-1 us a layer (~3 MB at ~3 TB/s), ~-0.06 ms a step at w = 1; measured +0.10 / +0.11 (variant
    # gemv_w4, session 25: each program's FMAs and lane sums on twice the elements a thread cost more than it saved).
    # Another layout of the tile over the threads: another order of each group's 128-term sum (within fp32 rounding)
    gemv_warps: int = 0
    # the warps of the add + norm + quant kernel on the model-width rows (`norm_quant.ROW_WARPS`); 0: `row_tiles`'
    # (32 at >= 32 groups of 128 since session 18: 3.84-3.86 vs 4.58-4.60 us at 8 on the TP=8 rank's 7168, H200)
    norm_warps: int = 0
    # mla_decode's stage 1 with this many programs per (row, head block, key split), each 512 / CS output channels
    # (one of mla_decode.CHANNEL_SPLITS; the same bits); 0: by score rows (`mla_decode.channel_splits_for`, timed on
    # an H200 in session 18); 1: the kernel until session 17
    mla_channel_splits: int = 0
    # the tensor-core few-row GEMV (`fp8_gemm`'s weight-streaming path, what a layer's projections run past gemv_rows)
    # for calls of 2..this many rows with K / 128 a multiple of 8: 8 K groups a slice (4 before) and 4 pipeline
    # stages (3 before) (`deep_tune`); 0: `fp8_gemm.default_plan`'s (one process: `for_world(1)`; at TP=1's full
    # width, 3 layers, it measured +0.01 to +0.02 ms a step at w = 2..4, session 24). Swept alone on an H200
    # (session 24, eval/results/s24/h200a/gemv4_sweep.json, graph replays, M = 4): q_a | wk | kv_a (2240 x 7168)
    # 9.38-9.69 -> 8.67 us, o_proj (7168 x 2048) 8.17-8.29 -> 7.86; predicted ~-1.2 us a layer, ~-0.07 ms a step at
    # w = 2..4. Measured on one TP=8 split rank (61 layers, 1k, b2b, two alternations, variant gemm_deep against
    # defaults, eval/results/s24/h200b/deep.json): -0.06 / -0.07 / -0.06 ms at w = 2 / 3 / 4 (w = 4: 6.896 / 6.886
    # against 6.958 / 6.952), w = 1 unchanged (the split-K GEMV)
    gemm_deep_rows: int = 4
    # with gemm_deep_rows, the few-row GEMV of q_b's shape (K / 128 = 12 groups, <= 4096 output rows: a TP=8 rank's
    # 3072) with 3 K groups a slice and 4 stages (`deep_tune`; off: the default plan's 4 groups and 3 stages). Swept
    # alone on an H200 (session 25, eval/results/s25/x2a/gemv_sweep2.json, graph replays, each setting held to the
    # float64 GEMM): 5.80 -> 5.35 / 5.41 us at M = 4 / 2 (its neighbours at 3 and 5 stages 5.38-5.45); predicted
    # -0.4 us a layer, ~-0.025 ms a step at w = 2..4. Not the 11264-row q_b | wq_b of a long context (session 24's
    # sweep: the default plan was its best)
    gemm_deep_q_b: bool = True
    # with pdl, prefetch and moe_down_nb, where gate/up triggers the down launch after its wait: the down kernel's plan
    # from the router's ids before its own wait, and its rows of its loop's first this many experts asked of L2 there
    # (`moe.moe_experts(down_pf_experts=)`); 0: off (one process). Measured on a TP=8 rank (session 25): -0.04 / -0.06
    # ms a step at w = 1 / 4 with moe_gate_up_aw
    moe_down_pf_experts: int = 8

    def deep_tune(self, rows: int, K: int, N: int) -> dict:
        """The few-row GEMV's launch overrides for a call of `rows` rows over K input channels into N outputs (see
        gemm_deep_rows, gemm_deep_q_b): {} where the default plan stands. Another split of K: another sum order of
        the same groups."""
        G = K // 128
        if not 2 <= rows <= self.gemm_deep_rows:
            return {}
        if G >= 8 and G % 8 == 0:
            return {"splits": G // 8, "num_stages": 4}
        if self.gemm_deep_q_b and G == 12 and N <= 4096:
            return {"splits": 4, "num_stages": 4}
        return {}

    def __post_init__(self) -> None:
        from mtp.kernels.gemv_splitk import MAX_M
        from mtp.kernels.mla_decode import CHANNEL_SPLITS
        from mtp.kernels.norm_quant import ROW_WARPS

        rows = self.gemv_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= MAX_M:
            raise ValueError(f"FastPathOptions: gemv_rows must be an integer in 0..{MAX_M}, got {rows!r}")
        # the integer options that take a set of values: 0 (its meaning) or one of them
        choices = {"norm_warps": ("row_tiles' choice", ROW_WARPS), "mla_channel_splits": ("by rows", CHANNEL_SPLITS),
                   "gemv_warps": ("gemv_plan's choice", (4, 8))}
        for name in INT_FIELDS:
            n = getattr(self, name)
            if name in choices:
                zero, allowed = choices[name]
                if isinstance(n, bool) or not isinstance(n, int) or n not in (0, *allowed):
                    raise ValueError(f"FastPathOptions: {name} must be 0 ({zero}) or one of {allowed}, got {n!r}")
            elif name != "gemv_rows" and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise ValueError(f"FastPathOptions: {name} must be an integer >= 0, got {n!r}")

    @classmethod
    def for_world(cls, world: int, **flags) -> FastPathOptions:
        """The defaults for a model split over `world` tensor-parallel ranks, with `flags` set on top. One process
        (world 1) takes PDL for one-token calls only (pdl_tokens 1): on the full-width 3-layer model (H200,
        BENCHMARKS.md session 15) PDL past one token, even with the trigger after the wait, made the step 0.11 ms
        slower at w = 2..4 (graph 1.404 / 1.553 / 1.692 vs 1.298 / 1.440 / 1.580 ms; its kernels' grids run several
        waves, and an early resident successor holds slots a later wave needs), where a TP=8 rank's step is 0.36-0.49
        ms faster at 1k. One process also keeps the few-row GEMV's default plan (gemm_deep_rows 0): the deep plan
        measured -0.06 to -0.07 ms a step at a TP=8 rank's w = 2..4, +0.01 to +0.02 at TP=1's (3 layers, session 24),
        and the down kernel's early plan off (moe_down_pf_experts 0, moe_gate_up_aw off: measured on a TP=8 rank only,
        session 25)."""
        if world < 1:
            raise ValueError(f"FastPathOptions.for_world: world must be >= 1, got {world}")
        base = ({"pdl_tokens": 1, "gemm_deep_rows": 0, "moe_down_pf_experts": 0, "moe_gate_up_aw": False} if world == 1
                else {})
        return cls(**{**base, **flags})

    def pdl_at(self, tokens: int) -> int:
        """Whether a launch for `tokens` rows takes PDL (switch pdl, and tokens <= pdl_tokens; 0: no) and where its
        kernel triggers the next launch: `_triton.PDL_EARLY` (1) at its start for tokens <= pdl_early_tokens, else
        `_triton.PDL_AFTER_WAIT` (2) after its wait. The kernels' wrappers take it as their `pdl` argument."""
        from mtp.kernels._triton import PDL_AFTER_WAIT, PDL_EARLY

        if not (self.pdl and tokens <= self.pdl_tokens):
            return 0
        return PDL_EARLY if tokens <= self.pdl_early_tokens else PDL_AFTER_WAIT

    def glue_pdl_at(self, tokens: int) -> int:
        """`pdl_at(tokens)` for a glue kernel's launch (the commit, the slots' gather, the embedding, the MTP norm
        pair) with switch glue_pdl on, else 0 (no PDL)."""
        return self.pdl_at(tokens) if self.glue_pdl else 0

    def prefetch_at(self, tokens: int) -> bool:
        """Whether a PDL launch for `tokens` rows asks L2 for its constant weights before the wait: tokens <=
        pdl_prefetch_tokens (without PDL no kernel prefetches, whatever this says)."""
        return tokens <= self.pdl_prefetch_tokens

    def topk_impl_at(self, impl: str, rows: int) -> str:
        """The indexer top-k for a call of `rows` score rows when `impl` is set: 'radix_fused' for 'radix' at rows <=
        fused_hist_rows (the same index sets, one launch fewer), else impl."""
        return "radix_fused" if impl == "radix" and rows <= self.fused_hist_rows else impl

    def scan_at(self, logits: torch.Tensor) -> bool:
        """Whether `scan_logits` runs the logits scan kernel on `logits`: switch logits_scan, logits on a CUDA device
        (or under the Triton interpreter) that the kernel takes (`logits_scan.scan_takes`: fp32 / bf16 / fp16)."""
        from mtp.kernels._triton import HAS_TRITON, interpreting
        from mtp.kernels.logits_scan import scan_takes

        return self.logits_scan and HAS_TRITON and (logits.is_cuda or interpreting()) and scan_takes(logits)

    def set(self, **flags) -> FastPathOptions:
        """Set some switches in place (names of the fields, all checked before any is set); returns a copy of the
        previous values, to restore with `set(**vars(old))`."""
        names = {f.name for f in fields(self)}
        bad = set(flags) - names
        if bad:
            raise ValueError(f"FastPathOptions: unknown switch {sorted(bad)}; known: {sorted(names)}")
        new = replace(self, **{k: v if k in INT_FIELDS else bool(v) for k, v in flags.items()})
        old = replace(self)
        for f in fields(self):
            setattr(self, f.name, getattr(new, f.name))
        return old


def linear(x: torch.Tensor | None, w8: torch.Tensor, sw: torch.Tensor, opts: FastPathOptions,
           out_dtype: torch.dtype | None = None, xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y = x @ dequant(w8, sw)^T on the kernels `opts` picks; xq = (x8, sx): x already quantized per 128 (x may be None,
    the output is then fp32 unless out_dtype says otherwise)."""
    from mtp.kernels.fp8_gemm import fp8_gemm, fp8_linear
    from mtp.kernels.gemv_splitk import MAX_M, fp8_gemv

    src = x if x is not None else xq[0]
    K = src.shape[-1]
    M = src.numel() // K if K else 0
    if opts.gemv and 1 <= M <= min(opts.gemv_rows, MAX_M) and w8.shape[0] > 0:
        return fp8_gemv(x, w8, sw, xq=xq, out_dtype=out_dtype, pdl=opts.pdl_at(M), one_slice=opts.gemv_one_slice,
                        num_warps=opts.gemv_warps or None)
    if xq is not None:
        x8, sx = xq
        y = fp8_gemm(x8.reshape(-1, K), sx.reshape(-1, K // 128), w8, sw,
                     out_dtype=out_dtype or (x.dtype if x is not None else torch.float32), pdl=opts.pdl_at(M),
                     prefetch=opts.prefetch_at(M), **opts.deep_tune(M, K, w8.shape[0]))
        return y.reshape(*src.shape[:-1], w8.shape[0])
    return fp8_linear(x, w8, sw, out_dtype=out_dtype, pdl=opts.pdl_at(M), prefetch=opts.prefetch_at(M),
                      **opts.deep_tune(M, K, w8.shape[0]))


def scan_logits(logits: torch.Tensor, opts: FastPathOptions | None, flag: torch.Tensor | None = None,
                argmax: bool = True) -> torch.Tensor | None:
    """torch.argmax(logits, -1) when `argmax` (else None) and, with `flag`, flag |= the health check of the logits
    (`logits_scan.unhealthy_ref`: a non-finite logit, or a row of equal values), on the kernels `opts` picks (None: the
    reference path's): one launch of `logits_scan.logits_scan` where `opts.scan_at(logits)`, else torch's ops
    (`logits_scan_ref`, the old path). The same indices and flag either way."""
    from mtp.kernels.logits_scan import logits_scan, logits_scan_ref

    if opts is not None and opts.scan_at(logits):
        return logits_scan(logits, flag, argmax)
    return logits_scan_ref(logits, flag, argmax)


@dataclass(frozen=True, eq=False)
class ExpertMap:
    """How a module finds its stacked experts from global expert ids (`expert_map`). table: int32 [E], each expert's
    index in the stack, -1 for one on another rank (None: the module holds all E, in order; one process, or a rank
    of 'split'). span: (e0, e1) when the held experts are one range ('contiguous'), else None."""

    table: torch.Tensor | None = None
    span: tuple[int, int] | None = None

    @property
    def router(self) -> tuple[int, int] | torch.Tensor | None:
        """What the router kernel maps by (`route`'s local): the range where there is one, mapped with arithmetic
        in its last program (the kernel's code as before tables: no load), else the table (one dependent load of
        the chosen ids), None for all experts."""
        return None if self.table is None else (self.span or self.table)


def expert_map(ids, n_experts: int, device: torch.device | str) -> ExpertMap:
    """The map of a module whose stack holds experts `ids` (global ids, ascending, stacked in that order) of
    `n_experts`: no table when it holds them all, else a table on `device`, and the range when they are one. The
    torch mapping (after the reference router, `local_ids`) takes the table in every layout: one gather, whose int32
    output is what the expert kernels read (a range would cost 5 launches: `mtp.plan.kernels`)."""
    ids = [int(e) for e in ids]
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= n_experts:
        raise ValueError(f"expert_map: expert ids must be distinct, ascending, in [0, {n_experts}), got {ids}")
    if len(ids) == n_experts:
        return ExpertMap()
    table = torch.full((n_experts,), -1, dtype=torch.int32)
    table[ids] = torch.arange(len(ids), dtype=torch.int32)
    span = (ids[0], ids[-1] + 1) if ids[-1] - ids[0] + 1 == len(ids) else None
    return ExpertMap(table.to(device), span)


def route(x_ND: torch.Tensor, gate, opts: FastPathOptions,
          local: tuple[int, int] | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router on the kernels for `gate` (an `mtp.model.moe.Gate`): (weights [N, K] fp32, ids [N, K] int32).
    local (`ExpertMap.router`: a range (e0, e1), a table, or None for all): ids as this rank sees them, the index
    of an expert in its stack and -1 for one on another rank (what `moe_experts` takes). Switch `router`: one
    launch (`router.moe_route_fused`, the mapping inside; impl "one" up to router_one_tokens (and its limit),
    its tail split from router_one_split tokens, else "auto"); off: `moe.moe_route` (gate GEMV + top-k) and the mapping in torch."""
    kw = dict(n_group=gate.n_groups, topk_group=gate.topk_groups, topk=gate.topk, route_scale=gate.route_scale)
    if opts.router:
        from mtp.kernels.router import moe_route_fused, one_takes

        N = x_ND.shape[0]
        one = N <= opts.router_one_tokens and one_takes(N, gate.n_experts, gate.n_groups, gate.topk_groups, gate.topk)
        split = one and 0 < opts.router_one_split <= N
        return moe_route_fused(x_ND, gate.weight, gate.e_score_correction_bias, local=local, pdl=opts.pdl_at(N),
                               prefetch=opts.prefetch_at(N), impl="one" if one else "auto", split_tail=split, **kw)
    from mtp.kernels.moe import moe_route

    w, ids = moe_route(x_ND, gate.weight, gate.e_score_correction_bias, **kw)
    return w, local_ids(ids, local)


def local_ids(ids: torch.Tensor, local: tuple[int, int] | torch.Tensor | None) -> torch.Tensor:
    """Global expert ids as a rank sees them: table[e] for a table (`ExpertMap.table`; one gather, int32); e - e0
    inside a range (e0, e1), -1 outside; the ids themselves for None (all experts)."""
    if local is None:
        return ids
    if isinstance(local, torch.Tensor):
        return local[ids]
    e0, e1 = local
    ids = ids - e0
    return torch.where((ids >= 0) & (ids < e1 - e0), ids, -1)
