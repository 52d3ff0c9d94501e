"""GPU tests of the engine: graph and overlap modes replay exactly what eager computes, the Triton fast path
stays close to the reference, and strict speculative decoding is lossless on the GPU (float64 reference)."""

import copy

import pytest
import torch

from mtp.decode.engine import generate
from mtp.backends.fast_path import disable_fast_path, enable_fast_path
from mtp.checkpoint.synthetic import random_model
from mtp.model.presets import gpu_test_config
from mtp.checkpoint.random_weights import random_tensors
from mtp.model.presets import tiny_config

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [list(range(3, 40)), list(range(50, 61)), list(range(100, 190))]  # 90 > index_topk 64: sparse rows


@pytest.fixture(scope="module")
def model():
    return random_model(gpu_test_config(layers=3, mtp_modules=1), device="cuda", dtype=torch.bfloat16, seed=1)


def _tiny_on_gpu(dtype):
    from mtp.checkpoint.files import load_model, save_checkpoint
    import tempfile

    cfg = tiny_config()
    with tempfile.TemporaryDirectory() as td:
        save_checkpoint(random_tensors(cfg, 0), cfg, f"{td}/t")
        return load_model(f"{td}/t", device="cuda", dtype=dtype)


@pytest.mark.parametrize("draft,k", [("none", 0), ("eagle", 2), ("vanilla", 3)])
def test_graph_and_overlap_replay_eager_reference(draft, k):
    """Reference path (dense MoE on CUDA), bf16: the captured step reproduces eager token for token."""
    m = _tiny_on_gpu(torch.bfloat16)
    kw = dict(draft=draft, k=k, reuse_modules=True)
    outs = {mode: generate(m, PROMPTS, 24, mode=mode, **kw) for mode in ("eager", "graph", "overlap")}
    assert outs["graph"].tokens == outs["eager"].tokens
    assert outs["overlap"].tokens == outs["eager"].tokens
    assert outs["graph"].metrics.accepted_hist == outs["eager"].metrics.accepted_hist
    assert outs["overlap"].metrics.graph_capture_s > 0


@pytest.mark.parametrize("draft,k,draft_sampling", [("none", 0, "greedy"), ("eagle", 2, "sample")])
def test_seeded_sampling_is_the_same_in_every_mode(draft, k, draft_sampling):
    """Per-row counter-based draws (mtp/spec/draws.py): eager, graph and overlap sample the same tokens, a
    reused captured graph draws fresh numbers for new seeds, and a batch's rows reversed (with their seeds) give
    the same rows reversed. (A row alone vs in a batch also depends on whether the GPU's GEMMs round the same
    for both batch sizes; the CPU test in tests/decode/test_engine.py holds that case.)"""
    m = _tiny_on_gpu(torch.bfloat16)
    kw = dict(draft=draft, k=k, verify="sample", temperature=1.3, draft_sampling=draft_sampling, reuse_modules=True)
    seeds = [11, 12, 13]
    outs = {mode: generate(m, PROMPTS, 16, mode=mode, seed=seeds, **kw) for mode in ("eager", "graph", "overlap")}
    assert outs["graph"].tokens == outs["eager"].tokens == outs["overlap"].tokens
    other = generate(m, PROMPTS, 16, mode="graph", seed=[21, 22, 23], **kw)
    assert other.tokens == generate(m, PROMPTS, 16, seed=[21, 22, 23], **kw).tokens != outs["eager"].tokens
    flipped = generate(m, PROMPTS[::-1], 16, mode="overlap", seed=seeds[::-1], **kw)
    assert flipped.tokens == outs["eager"].tokens[::-1]


@pytest.mark.parametrize("draft,k", [("eagle", 1), ("vanilla", 2)])
def test_strict_lossless_on_gpu_float64(draft, k):
    m = _tiny_on_gpu(torch.float64)
    base = generate(m, PROMPTS, 20)
    spec = generate(m, PROMPTS, 20, draft=draft, k=k, reuse_modules=True)
    assert spec.tokens == base.tokens


def _as_float32(model):
    """The same model with its bf16 tensors widened to fp32 (exact) and fp32 activations."""
    m = copy.deepcopy(model)
    for mod in m.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.dtype == torch.bfloat16:
                setattr(mod, name, torch.nn.Parameter(p.float(), requires_grad=False))
    m.dtype, m.acc = torch.float32, torch.float32
    return m


def _verify_logits(model, ids, w):
    kv = model.new_cache(1, 128)
    with torch.no_grad():
        model(ids[:, :-w], kv)
        return model(ids[:, -w:], kv).logits.double()


def test_fast_path_as_close_to_fp32_as_the_bf16_reference(model):
    """Random FP8 models amplify rounding noise (an FP8 rounding flip moves a value by up to 1/8), so the
    fast path is held to what the bf16 reference itself achieves: both against an fp32 reference of the same
    weights, on verify blocks of 1, 2 and 4 tokens after a 86-89 token prompt."""
    ids = torch.tensor([PROMPTS[2]], device="cuda")
    m32 = _as_float32(model)
    for w in (1, 2, 4):
        ref32 = _verify_logits(m32, ids, w)
        disable_fast_path(model)
        ref16 = _verify_logits(model, ids, w)
        enable_fast_path(model)
        try:
            fast = _verify_logits(model, ids, w)
        finally:
            disable_fast_path(model)
        err = lambda x: ((x - ref32).norm() / ref32.norm()).item()  # noqa: E731
        agree = lambda x: (x.argmax(-1) == ref32.argmax(-1)).double().mean().item()  # noqa: E731
        print(f"w={w}: rel L2 vs fp32 reference: bf16 reference {err(ref16):.3f}, fast {err(fast):.3f}; "
              f"argmax agreement {agree(ref16):.2f} / {agree(fast):.2f}")
        assert err(fast) <= 1.5 * err(ref16) + 0.02


@pytest.mark.parametrize("draft,k", [("none", 0), ("eagle", 3)])
def test_fast_path_graph_overlap_identical(model, draft, k):
    enable_fast_path(model)
    try:
        outs = {mode: generate(model, PROMPTS, 24, draft=draft, k=k, mode=mode) for mode in ("eager", "graph", "overlap")}
    finally:
        disable_fast_path(model)
    assert outs["graph"].tokens == outs["eager"].tokens
    assert outs["overlap"].tokens == outs["eager"].tokens
    d = outs["overlap"].metrics.to_dict()
    print({k_: v for k_, v in d.items() if k_.startswith("graph/")})
    assert d["graph/replays"] > 0


def test_captured_step_is_reused_across_calls():
    """generate(mode=graph/overlap) keeps the engine: later calls of the same batch and length bucket replay the
    graph captured by the first, and each call still equals its own eager run."""
    from mtp.decode.engine import _ENGINES, release

    m = _tiny_on_gpu(torch.bfloat16)
    calls = [(PROMPTS[:2], 20), (PROMPTS[1:], 12), (PROMPTS[:2], 7)]
    for mode in ("graph", "overlap"):
        release(m)
        for prompts, n in calls:
            got = generate(m, prompts, n, draft="eagle", k=2, mode=mode)
            want = generate(m, prompts, n, draft="eagle", k=2, mode="eager")
            assert got.tokens == want.tokens, (mode, n)
        (engine,) = _ENGINES[m].values()
        assert len(engine.runner.graphs) == 1  # one capture served the three calls


def test_switching_paths_drops_kept_graphs(model):
    """A graph captured on one path must never be replayed on the other (the fast path re-points weights): the
    swap bumps model.version and the kept engine captures again."""
    from mtp.decode.engine import _ENGINES

    def kept_graph():
        (engine,) = _ENGINES[model].values()
        (entry,) = engine.runner.graphs.values()
        return entry[0]

    _ENGINES.pop(model, None)
    generate(model, PROMPTS[:1], 4, mode="graph")
    ref_graph = kept_graph()
    enable_fast_path(model)
    try:
        fast = generate(model, PROMPTS[:1], 8, mode="graph").tokens
        fast_graph = kept_graph()
        assert fast_graph is not ref_graph
        assert fast == generate(model, PROMPTS[:1], 8, mode="eager").tokens
    finally:
        disable_fast_path(model)
    generate(model, PROMPTS[:1], 4, mode="graph")
    assert kept_graph() is not fast_graph


def test_kernel_options_switch_and_recapture(model):
    """set_kernel_options on the fast path: 'radix_fused' keeps exactly radix's keys (the same scores, the same
    rule), so the tokens are equal, whether chosen for one-row calls (`fused_hist_rows`, the default) or for every
    call; each switch bumps model.version, so the kept graph is captured again; the persistent MoE layout's graph
    replays its eager run. A 90-token prompt: the indexer's top-k is sparse."""
    from mtp.backends.fast_path import FastPathOptions, set_kernel_options, set_kernels
    from mtp.decode.engine import _ENGINES

    def kept_graph():
        (engine,) = _ENGINES[model].values()
        (entry,) = engine.runner.graphs.values()
        return entry[0]

    prompts = [PROMPTS[2]]
    _ENGINES.pop(model, None)
    enable_fast_path(model, options=FastPathOptions(fused_hist_rows=0))  # radix: the histogram as its own launch
    try:
        radix = generate(model, prompts, 8, mode="graph").tokens
        g = kept_graph()
        set_kernels(model, fused_hist_rows=1)  # the default: radix_fused at one row (each decode step here)
        assert generate(model, prompts, 8, mode="graph").tokens == radix
        assert kept_graph() is not g
        g = kept_graph()
        set_kernel_options(model, indexer_topk="radix_fused")
        assert generate(model, prompts, 8, mode="graph").tokens == radix
        assert kept_graph() is not g
        set_kernel_options(model, indexer_topk="torch")
        torch_topk = generate(model, prompts, 8, mode="graph").tokens
        print(f"radix vs torch.topk tokens equal: {torch_topk == radix}")  # ties may break otherwise
        set_kernel_options(model, indexer_topk="radix", moe_layout=None)
        assert generate(model, prompts, 8, mode="graph").tokens == generate(model, prompts, 8, mode="eager").tokens
    finally:
        disable_fast_path(model)


def _model_and_first_token():
    """A tiny GPU model, a prompt whose first generated token is not in it, that token and its embedding row
    (a copy): poisoning the row reaches the target only at the first verify step."""
    from mtp.decode.engine import release

    m = _tiny_on_gpu(torch.float32)
    candidates = [list(range(50, 61)), list(range(200, 215)), list(range(300, 309)), list(range(400, 420))]
    firsts = [generate(m, [p], 1).tokens[0][0] for p in candidates]
    prompt, first = next((p, f) for p, f in zip(candidates, firsts) if f not in p)
    row = m.model.embed_tokens.weight[first].clone()
    release(m)
    return m, prompt, first, row


@pytest.mark.parametrize("mode", ["eager", "graph", "overlap"])
def test_nonfinite_logits_stop_every_mode_at_the_step_that_made_them(mode):
    """The non-finite flag is read with the eager loop's host sync and staged in the graph runner's pinned slots
    (graph, overlap): every mode stops at step 1 naming the embedding, and the kept engine, its flag reset, runs
    the repaired model like eager again."""
    from mtp.decode.health import NonFiniteError

    m, prompt, first, row = _model_and_first_token()
    with torch.no_grad():
        m.model.embed_tokens.weight[first, 0] = float("nan")
    with pytest.raises(NonFiniteError) as ei:
        generate(m, [prompt], 12, draft="eagle", k=2, mode=mode)
    msg = str(ei.value)
    assert "in step 1;" in msg and "first non-finite output: model.embed_tokens (rows [0]" in msg, msg
    with torch.no_grad():
        m.model.embed_tokens.weight[first] = row
    got = generate(m, [prompt], 12, draft="eagle", k=2, mode=mode)
    assert got.tokens == generate(m, [prompt], 12, draft="eagle", k=2, mode="eager").tokens


@pytest.mark.parametrize("mode", ["eager", "graph", "overlap"])
def test_collapsed_logits_stop_every_mode_at_the_step_that_made_them(mode):
    """A finite failure (the first generated token's embedding row scaled by 1e30: RMSNorm's mean square
    overflows to inf and its output is exactly zero) is caught like a NaN in every mode: the flag is the same
    device-side check, inside the captured step too."""
    from mtp.decode.engine import release
    from mtp.decode.health import NonFiniteError

    m, prompt, first, row = _model_and_first_token()
    with torch.no_grad():
        m.model.embed_tokens.weight[first] *= 1e30  # finite; its mean square is not
    with pytest.raises(NonFiniteError) as ei:
        generate(m, [prompt], 12, draft="eagle", k=2, mode=mode)
    msg = str(ei.value)
    assert "in step 1;" in msg, msg
    assert "collapsed (all values equal) output: model.layers.0.input_layernorm (rows [0]" in msg, msg
    with torch.no_grad():
        m.model.embed_tokens.weight[first] = row
    release(m)
