"""GPU twin of tests/kernels/test_step_commit.py and tests/kernels/test_lookup.py: the decode step's glue in one launch
each (switches step_commit, rope_table, vocab_embed, mtp_norms) is bit for bit what the torch ops computed, on a GPU,
eager and in CUDA graphs, and whole speculative steps keep every token, acceptance count and cache entry.

- kernels at the real widths: the angle table gathered (`FastRotary`) against `Rotary.slots` over positions up to
  DeepSeek-V3.2's 163840 (the claim that the table's cos / sin are the per-step ones); `rms_norm_pair` against two
  Triton rms_norm launches and a cat (D = 7168, bf16); `embed_rows` against the vocabulary-parallel lookup (a TP=8
  rank's 16160 rows); `chain_commit` against accept / commit / count on random steps, eager and replayed in a graph;
- PDL (switch glue_pdl, session 22): the four kernels chained with programmatic dependent launch as a step chains them
  (the slots' gather, the embedding, the norm pair, the commit; each trigger at the start or after the wait) give the
  plain launches' bits eagerly and on 50 graph replays (a read or store before the wait shows up as a flaky
  difference); Hopper only;
- engine: eagle k = 3 and vanilla k = 2 (and plain decoding, and an eagle 2x1x1 tree) on the fast path of a small
  one-process model and of a simulated TP=8 rank at the real width (2 layers: the vocabulary-parallel embedding), graph
  and overlap modes, with every glue switch on and off (tree_glue too, session 23: the tree's compaction, hidden rows
  and counters; tree_verdict, session 25: the strict tree verdict): the same tokens, acceptance histograms, decode
  buffers and caches (torch.equal).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

GLUE_OFF = dict(step_commit=False, rope_table=False, vocab_embed=False, mtp_norms=False, tree_glue=False,
                tree_fwd_glue=False, tree_verdict=False, strict_commit=False, draft_window=False,
                tree_window=False, gather_cast=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16) if t.element_size() == 2 else t


def test_angle_table_equals_the_per_step_angles_at_real_positions():
    from mtp.backends.fast_path import FastRotary
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.model.layers import Rotary
    from mtp.model.presets import real_config

    cfg = real_config(layers=1)
    with torch.device("cuda"):
        ref = Rotary(cfg)
        fast = Rotary(cfg)
    fast.__class__ = FastRotary
    fast.fast_options = FastPathOptions()
    P = cfg.max_position_embeddings
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, T in ((1, 1), (1, 4), (3, 2), (8, 17)):
        for top in (1024, 40000, P):
            lens = torch.randint(0, top - T + 1, (B,), device="cuda", generator=g)
            got, want = fast.slots(lens, T, top), ref.slots(lens, T)
            assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want)), (B, T, top)
    # every position: the whole table against the angles computed in step-shaped pieces
    cos, sin = fast.table(torch.device("cuda", torch.cuda.current_device()))
    assert cos.nbytes + sin.nbytes == Rotary.angle_table_bytes(cfg) == 41_943_040  # the memory planner's count
    pos = torch.arange(P, device="cuda").view(-1, 4)
    c, s = ref.angles(pos)
    assert torch.equal(_bits(cos), _bits(c.reshape(P, -1))) and torch.equal(_bits(sin), _bits(s.reshape(P, -1)))


@pytest.mark.parametrize("rows", [1, 4])
def test_rms_norm_pair_equals_two_norm_launches(rows):
    from mtp.kernels.elementwise import rms_norm, rms_norm_pair

    g = torch.Generator(device="cuda").manual_seed(rows)
    D = 7168
    e = torch.randn(1, rows, D, device="cuda", generator=g).bfloat16()
    h = (torch.randn(1, rows + 3, D, device="cuda", generator=g) * 3).bfloat16()[:, 1:rows + 1]  # a strided view
    we = (torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16()
    wh = (torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16()
    want = torch.cat((rms_norm(e, we, 1e-6, torch.bfloat16), rms_norm(h, wh, 1e-6, torch.bfloat16)), -1)
    assert torch.equal(_bits(rms_norm_pair(e, we, 1e-6, h, wh, 1e-6, torch.bfloat16)), _bits(want))


def test_embed_rows_equals_the_vocabulary_parallel_lookup():
    from mtp.kernels.lookup import embed_rows, embed_rows_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    Vl, D, start = 16160, 7168, 4000  # the slots 5000.. as ids: rows of this rank
    w = torch.randn(Vl, D, device="cuda", generator=g).bfloat16()
    for shape in ((1, 1), (1, 4), (4, 5), (2, 1024)):
        ids = torch.randint(0, 8 * Vl, shape, device="cuda", generator=g)
        ids[0, 0] = start
        assert torch.equal(_bits(embed_rows(ids, w, start)), _bits(embed_rows_ref(ids, w, start))), shape


def _torch_ops(st, drafts, verdict, stops, W):
    """The step's state after `mtp.decode.accept`'s torch ops (a copy; `st` untouched)."""
    from tests.kernels.test_step_commit import _state

    from mtp.decode.accept import accept, commit, count

    want = copy.deepcopy(st)
    active = ~want.finished_B
    acc = accept(drafts, verdict, active, stops, want.max_new_B - want.gen_B)
    commit(want, acc, None, window=W)
    count(want, acc, verdict.relaxed_only_B, active)
    return _state(want)


def _on_cuda(st, drafts, verdict, stops):
    st = copy.deepcopy(st)
    for k, v in vars(st).items():
        if isinstance(v, torch.Tensor):
            setattr(st, k, v.cuda())
    st.cache.seq_lens = st.cache.seq_lens.cuda()
    return st, drafts.cuda(), type(verdict)(*(t.cuda() for t in vars(verdict).values())), stops.cuda()


def test_chain_commit_equals_the_torch_ops_eager_and_in_a_graph():
    from tests.kernels.test_step_commit import _random_step, _state

    from mtp.decode.accept import fused_commit
    from mtp.decode.graphs import capture_graph

    g = torch.Generator().manual_seed(0)
    for B, K in ((1, 3), (4, 3), (7, 1), (64, 4), (3, 0)):
        for _ in range(8):
            step = _random_step(g, B, K)
            want = _torch_ops(*step, K + 1)
            dev = _on_cuda(*step)
            fused_commit(*dev, K + 1)
            got = {k: v.cpu() for k, v in _state(dev[0]).items()}
            assert all(torch.equal(want[k], got[k]) for k in want), (B, K, [k for k in want if not
                                                                           torch.equal(want[k], got[k])])
    # captured once (every row finished: the capture changes nothing), replayed on new steps loaded into its buffers
    st, drafts, verdict, stops = _on_cuda(*_random_step(g, 4, 3))
    saved = st.finished_B.clone()
    st.finished_B.fill_(True)
    graph = capture_graph(lambda: fused_commit(st, drafts, verdict, stops, 4), warmup=1)
    st.finished_B.copy_(saved)
    for _ in range(4):
        step = _random_step(g, 4, 3)
        step = (step[0], step[1], step[2], stops.cpu())
        want = _torch_ops(*step, 4)
        for k, v in vars(step[0]).items():
            if isinstance(v, torch.Tensor):
                getattr(st, k).copy_(v)
        st.cache.seq_lens.copy_(step[0].cache.seq_lens)
        drafts.copy_(step[1])
        for t, src in zip(vars(verdict).values(), vars(step[2]).values()):
            t.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        got = {k: v.cpu() for k, v in _state(st).items()}
        assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]


@pytest.mark.parametrize("mode", [1, 2])
@torch.no_grad()
def test_glue_kernels_chained_with_pdl_in_a_graph_equal_plain(mode):
    """The glue kernels at a TP=8 rank's shapes, each reading the one before (the gather's slots as the embedding's
    ids, the embedding as the norm pair's input, the pair's bits as the commit's drafts), with PDL
    (`_triton.PDL_EARLY` 1 or PDL_AFTER_WAIT 2) against without: eagerly and on 50 replays of one graph, the same
    bits."""
    from tests.kernels.test_step_commit import _random_step, _state

    from mtp.decode.accept import fused_commit
    from mtp.decode.graphs import capture_graph
    from mtp.kernels.elementwise import rms_norm_pair
    from mtp.kernels.lookup import embed_rows, rope_slots
    from mtp.model.layers import Rotary
    from mtp.model.presets import real_config

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper")
    g = torch.Generator(device="cuda").manual_seed(0)
    cfg = real_config(layers=1)
    with torch.device("cuda"):
        cos_t, sin_t = (t[0] for t in Rotary(cfg).angles(torch.arange(8192).unsqueeze(0)))
    Vl, D, start = 16160, 7168, 4000  # the slots 5000.. as ids: rows of this rank
    w = torch.randn(Vl, D, device="cuda", generator=g).bfloat16()
    we, wh = ((torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16() for _ in range(2))
    h = torch.randn(1, 4, D, device="cuda", generator=g).bfloat16()
    lens = torch.tensor([5000], device="cuda")
    st, drafts, verdict, stops = _on_cuda(*_random_step(torch.Generator().manual_seed(1), 1, 3))
    st0 = copy.deepcopy(st)

    def chain(pdl):
        for k, v in vars(st0).items():  # the same state before each commit (the graph replays it too)
            if isinstance(v, torch.Tensor):
                getattr(st, k).copy_(v)
        st.cache.seq_lens.copy_(st0.cache.seq_lens)
        pos, cos, sin = rope_slots(lens, 4, cos_t, sin_t, pdl=pdl)
        e = embed_rows(pos, w, start, pdl=pdl)  # the slots as ids: the embedding reads the gather's output
        y = rms_norm_pair(e, we, 1e-6, h, wh, 1e-6, torch.bfloat16, pdl=pdl)
        drafts.copy_(y.view(torch.int16)[0, 1:, 0].long().abs().view(1, 3))  # the commit's drafts from the pair's bits
        fused_commit(st, drafts, verdict, stops, 4, pdl=pdl)
        return [pos, cos, sin, e, y, *_state(st).values()]

    want = [t.clone() for t in chain(0)]
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(chain(mode), want)), "the eager PDL chain differs"
    box = {}
    graph = capture_graph(lambda: box.__setitem__("out", chain(mode)))
    bad = []
    for i in range(50):
        graph.replay()
        torch.cuda.synchronize()
        bad += [(i, j) for j, (a, b) in enumerate(zip(box["out"], want)) if not torch.equal(_bits(a), _bits(b))]
    assert not bad, f"PDL glue replays differ (replay, output): {bad[:10]}"


def _run(model, prompts, draft, k, mode, flags, tree=None):
    from mtp.backends.fast_path import set_kernels
    from mtp.decode.config import GenerationConfig
    from mtp.decode.engine import Engine

    old = set_kernels(model, **flags)
    try:
        engine = Engine(model, GenerationConfig.from_options(24, draft, k or None, "strict", mode=mode,
                                                             reuse_modules=True, tree=tree))
        res = engine.run(prompts)
        st = next(iter(engine.pool.states.values()))
        caches = [st.cache, *getattr(st.proposer, "caches", ())]
        bufs = {k: v.clone() for k, v in vars(st).items() if isinstance(v, torch.Tensor)}
        for i, c in enumerate(caches):
            for name in ("seq_lens", "kv", "kv_scale", "pe", "idx_k", "idx_k_scale"):
                bufs[f"cache{i}.{name}"] = getattr(c, name).clone()
        return res, bufs
    finally:
        set_kernels(model, **vars(old))


def _check_switches(model, prompts):
    # chains, and an eagle tree (session 22: its accept + commit + count in the commit kernel, switch step_commit)
    for draft, k, tree in (("eagle", 3, None), ("vanilla", 2, None), ("none", 0, None), ("eagle", 0, "2x1x1")):
        for mode in ("graph", "overlap"):
            r0, b0 = _run(model, prompts, draft, k, mode, {}, tree)
            r1, b1 = _run(model, prompts, draft, k, mode, GLUE_OFF, tree)
            assert r0.tokens == r1.tokens and r0.metrics.accepted_hist == r1.metrics.accepted_hist, (draft, mode)
            assert r0.row_accepted_hist == r1.row_accepted_hist, (draft, mode)
            bad = [key for key in b0 if not torch.equal(_bits(b0[key]), _bits(b1[key]))]
            assert not bad, (draft, k, tree, mode, bad)


def test_fast_path_steps_are_bitwise_with_the_glue_switches_off():
    from mtp.backends.fast_path import enable_fast_path
    from mtp.checkpoint.synthetic import random_model
    from mtp.model.presets import gpu_test_config

    model = enable_fast_path(random_model(gpu_test_config(layers=3, mtp_modules=1), device="cuda",
                                          dtype=torch.bfloat16, seed=1))
    prompts = [list(range(3, 40)), list(range(50, 61)), list(range(100, 190))]  # 90 > index_topk 64: sparse rows
    _check_switches(model, prompts)


def test_simulated_tp8_rank_steps_are_bitwise_with_the_glue_switches_off():
    from mtp.backends.fast_path import enable_fast_path
    from mtp.decode.engine import release
    from mtp.model.presets import real_config
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.simulate import simulated_rank
    from mtp.parallel.synthetic import random_parallel_model

    cfg = real_config(layers=2, dense_layers=1, mtp_modules=1)
    with simulated_rank(8, 0) as comm:
        model = enable_fast_path(random_parallel_model(cfg, comm, ParallelPlan(8, expert_layout="split"),
                                                       device="cuda", dtype=torch.bfloat16))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (40,)]
        try:
            _check_switches(model, prompts)
        finally:
            release()
