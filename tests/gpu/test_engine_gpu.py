"""GPU tests of the engine: graph and overlap modes replay exactly what eager computes, the Triton fast path
stays close to the reference, and strict speculative decoding is lossless on the GPU (float64 reference)."""

import pytest
import torch

from mtp.engine import generate
from mtp.fastpath import disable_fast_path, enable_fast_path
from mtp.synthetic import gpu_test_config, random_model
from mtp.tiny import random_tensors, tiny_config

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [list(range(3, 40)), list(range(50, 61)), list(range(100, 190))]  # 90 > index_topk 64: sparse rows


@pytest.fixture(scope="module")
def model():
    return random_model(gpu_test_config(layers=3, mtp_modules=1), device="cuda", dtype=torch.bfloat16, seed=1)


def _tiny_on_gpu(dtype):
    from mtp.checkpoint import load_model, save_checkpoint
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


@pytest.mark.parametrize("draft,k", [("eagle", 1), ("vanilla", 2)])
def test_strict_lossless_on_gpu_float64(draft, k):
    m = _tiny_on_gpu(torch.float64)
    base = generate(m, PROMPTS, 20)
    spec = generate(m, PROMPTS, 20, draft=draft, k=k, reuse_modules=True)
    assert spec.tokens == base.tokens


def test_fast_path_close_to_reference(model):
    """One verify block of 1..4 tokens after a prompt: Triton fast path vs reference, same FP8 numerics."""
    ids = torch.tensor([PROMPTS[2]], device="cuda")
    for w in (1, 2, 4):
        logits = {}
        for name in ("reference", "fast"):
            (enable_fast_path if name == "fast" else disable_fast_path)(model)
            kv = model.new_cache(1, 128)
            with torch.no_grad():
                model(ids[:, :-w], kv)
                logits[name] = model(ids[:, -w:], kv).logits.float()
        disable_fast_path(model)
        ref, fast = logits["reference"], logits["fast"]
        rel = ((fast - ref).norm() / ref.norm()).item()
        agree = (fast.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"verify width {w}: rel L2 {rel:.2e}, argmax agreement {agree:.2f}")
        assert rel < 5e-2 and agree >= 0.75


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
