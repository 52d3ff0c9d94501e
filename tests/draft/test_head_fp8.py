"""The drafts' FP8 head (`mtp.draft.head_fp8`, `draft_head_fp8=True`, `draft.head_fp8`) on the CPU.

Shape legend: M rows, D width, N head rows, V vocabulary.

- The copy: DeepSeek's weight format (e4m3, 128 x 128 block scales) of the head's rows, quantized in row chunks
  exactly as in one call; its logits are the FP8 formula (the input quantized per 128, x8 . w8 scaled per group) and
  sit within the FP8 quantization error of the bf16 head's, bounded element by element; its bytes are the planner's.
- Decoding with it (the bundled trained model in float64, whose drafts are accepted: MODEL_CARD.md): strict outputs stay plain
  greedy decoding's token for token in eagle and vanilla chains and an eagle and a vanilla tree, and with a draft
  vocabulary (the FP8 copy of its rows; the whole vocabulary in id order drafts as the FP8 head does); a zeroed copy
  is never accepted while the tokens stay greedy (the drafts really come from the copy, the verify never); proposers
  share one copy.
- Bad input: a non-bool value, draft='none', a head with no float weight, a width not a multiple of 128; the option
  through mtp-eval's config.
- Under the Triton interpreter (a subprocess, this file as a script): the fast path's head (`kernels.dispatch.linear`,
  the model's fast_options) against the reference formula at odd shapes, 1..4 rows, on inputs whose quantization is
  exact (the interpreter casts to e4m3 its own way), and strict decoding with it.
GPU twin (the TP=8 shard [16160, 7168], graphs): tests/draft/test_head_fp8_gpu.py. Two ranks over gloo:
tests/parallel/test_parallel.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402

import mtp  # noqa: E402
from mtp.draft import DraftConfig  # noqa: E402
from mtp.draft import head_fp8 as hf  # noqa: E402
from mtp.model import fp8  # noqa: E402
from mtp.spec.options import OptionError  # noqa: E402

E4M3_REL = 2.0 ** -4  # half an ulp of e4m3's 3 mantissa bits, relative (normal values)
E4M3_SUB = 2.0 ** -10  # half of e4m3's smallest subnormal step (2^-9), times the block's scale
N_NEW = 24


class Holder(torch.nn.Module):
    """What an Fp8Head reads of its model at call time: the fast path's switches (None: the reference) and the
    numerics."""

    def __init__(self, fast_options=None, numerics: str = "fp8"):
        super().__init__()
        from mtp.model.config import RuntimeOptions

        self.fast_options, self.runtime = fast_options, RuntimeOptions(numerics=numerics)


@pytest.fixture(scope="module")
def trained():
    """float64: speculative and plain decoding run other widths, and fp32 noise there flips FP8 roundings of the
    target (then even the bf16 head's strict outputs differ from greedy decoding's); in float64 they do not."""
    from mtp.checkpoint.tiny import default_checkpoint

    return mtp.load_model(default_checkpoint(), dtype=torch.float64)


@pytest.fixture(scope="module")
def prompts(trained):
    from mtp.checkpoint.tiny import default_checkpoint
    from mtp.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_checkpoint())
    texts = ["def parse_args(argv):\n    ", "import os\nimport sys\n\n\nclass Config:\n", "for i in range(10):\n"]
    return [[tok.bos_id] + tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def greedy(trained, prompts):
    """Plain greedy decoding's outputs, per number of leading prompts (decoded once for the module)."""
    done = {}

    def of(n: int):
        if n not in done:
            done[n] = mtp.generate(trained, prompts[:n], N_NEW)
        return done[n]

    return of


# ---------------------------------------------------------------------------------------------- the copy
def test_quantize_rows_in_chunks_is_one_call(monkeypatch):
    w = torch.randn(300, 256) * torch.logspace(-3, 1, 256)
    monkeypatch.setattr(hf, "QUANT_ROWS", 128)  # 3 chunks, the last one ragged
    w8, sw = hf.quantize_rows(w)
    r8, rs = fp8.weight_quant(w)
    assert torch.equal(w8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(sw, rs)
    assert w8.shape == (300, 256) and sw.shape == (3, 2)


@pytest.mark.parametrize("numerics", ["fp8", "dequant"])
def test_logits_are_the_fp8_formula_within_the_quantization_error(trained, numerics):
    """Module 0's head of the trained model on its own normed hiddens (a window of a prompt): the FP8 copy's logits
    are x8 . w8 scaled per 128-group (act_quant'ed x under 'fp8', x itself under 'dequant'), and differ from the bf16
    head's by at most the bound the two roundings allow, element by element: |w^ - w| <= 2^-4 |w| + 2^-10 s_w, the
    same for x with s_x, so |y^ - y| <= sum_k |x^ - x| |w^| + |x| |w^ - w|."""
    m = trained
    head = m.mtp[0].shared_head.head
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        h = m(ids).hidden
        x = m.mtp_forward(0, ids[:, 1:], h[:, :-1], m.new_cache(1, 64, n_layers=1)).hidden[0]  # [M, D]
        holder = Holder(numerics=numerics)  # kept: the head holds it weakly, as it holds its model
        copy = hf.Fp8Head(holder, head.weight)
        got, bf16 = copy(x), x @ head.weight.t()
    w8, sw = copy.linear.weight, copy.linear.weight_scale_inv
    w_hat = fp8.weight_dequant(w8, sw)
    s_w = sw.repeat_interleave(128, 0)[: w8.shape[0]].repeat_interleave(128, 1)
    assert ((w_hat - head.weight).abs() <= E4M3_REL * head.weight.abs() + E4M3_SUB * s_w).all()
    if numerics == "fp8":
        x8, sx = fp8.act_quant(x)
        x_hat = fp8.act_dequant(x8, sx)
        s_x = sx.repeat_interleave(128, 1)
        assert ((x_hat - x).abs() <= E4M3_REL * x.abs() + E4M3_SUB * s_x).all()
    else:
        x_hat = x
    want = x_hat.double() @ w_hat.double().t()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), "not the FP8 formula"
    bound = (x_hat - x).abs().double() @ w_hat.abs().double().t() + x.abs().double() @ (w_hat - head.weight).abs().double().t()
    excess = (got.double() - bf16.double()).abs() - bound
    assert excess.max() <= 1e-5 * bf16.abs().max(), f"beyond the FP8 error bound by {excess.max():.3g}"
    rel = ((got - bf16).norm() / bf16.norm()).item()
    agree = (got.argmax(-1) == bf16.argmax(-1)).float().mean().item()
    print(f"{numerics}: rel L2 vs the bf16 head {rel:.4f}, argmax agreement {agree:.2f} over {x.shape[0]} rows")
    assert rel < 0.1 and agree >= 0.9


def test_proposers_share_one_copy_of_the_planned_size(trained):
    """An engine keeps a proposer per buffer bucket: one FP8 copy serves them all; its bytes are the planner's."""
    from mtp.draft.proposer import Proposer
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.memory import draft_head_fp8_bytes

    dcfg = DraftConfig("eagle", 2, head_fp8=True)
    a, b = Proposer(trained, dcfg, 1, 64), Proposer(trained, dcfg, 3, 256)
    assert isinstance(a.heads[0], hf.Fp8Head) and a.heads[0] is b.heads[0] and a.vocab_ids is None
    V, D = trained.cfg.vocab_size, trained.cfg.hidden_size
    assert a.heads[0].nbytes == V * D + (V // 128) * (D // 128) * 4
    assert a.heads[0].nbytes == draft_head_fp8_bytes(trained.cfg, ParallelPlan(1), "eagle", 2)
    vanilla = Proposer(trained, DraftConfig("vanilla", 3, head_fp8=True), 1, 64)  # one copy per module
    assert sorted(vanilla.heads) == [0, 1, 2] and vanilla.heads[0] is a.heads[0]
    assert 3 * a.heads[0].nbytes == draft_head_fp8_bytes(trained.cfg, ParallelPlan(1), "vanilla", 3)
    vocab = Proposer(trained, DraftConfig("eagle", 2, vocab=(1, 5, 9), head_fp8=True), 1, 64)
    assert vocab.heads[0].linear.weight.shape == (3, D) and vocab.vocab_ids.tolist() == [1, 5, 9]


# ---------------------------------------------------------------------------------------------- decoding
# eagle and vanilla chains and an eagle tree (a vanilla tree and eagle k = 1 add no path of the head's: CI time)
@pytest.mark.parametrize("kw", [dict(draft="eagle", k=3), dict(draft="vanilla", k=3),
                                dict(draft="eagle", tree="2x1x1")], ids=["eagle3", "vanilla3", "eagle-tree"])
def test_strict_with_the_fp8_head_is_greedy_decoding(trained, prompts, greedy, kw):
    """The verify keeps the bf16 head: strict outputs are plain greedy decoding's, whatever the drafts; the drafts
    from the FP8 copy are accepted as often as the bf16 head's, give or take the drafts its rounding flips."""
    rows = prompts[:1] if "tree" in kw else prompts  # a tree decodes one row at a time here (one seed)
    base = greedy(len(rows))
    plain = mtp.generate(trained, rows, N_NEW, **kw)
    got = mtp.generate(trained, rows, N_NEW, draft_head_fp8=True, **kw)
    assert got.tokens == base.tokens == plain.tokens
    acc = got.metrics.mean_accepted_len
    print(f"{kw}: AL {plain.metrics.mean_accepted_len:.3f} (bf16 head) vs {acc:.3f} (FP8 copy)")
    assert sum(got.metrics.accepted_hist[1:]) > 0 and acc > 0.8 * plain.metrics.mean_accepted_len


def test_a_zeroed_copy_is_never_accepted_and_changes_no_token(trained, prompts, greedy):
    """The drafts come from the copy and the verify never does: all-zero FP8 rows make every draft logit 0 (draft
    id 0, never the greedy token here) and the outputs stay greedy."""
    base = greedy(len(prompts))
    assert all(0 not in row for row in base.tokens)
    head = hf.shared_fp8_head(trained, 0)
    kept = head.linear.weight.data.clone()
    head.linear.weight.data.view(torch.uint8).zero_()
    try:
        got = mtp.generate(trained, prompts, N_NEW, draft="eagle", k=2, draft_head_fp8=True)
    finally:
        head.linear.weight.data.copy_(kept)
    assert got.tokens == base.tokens and sum(got.metrics.accepted_hist[1:]) == 0


def test_composes_with_a_draft_vocabulary(trained, prompts, greedy):
    """The FP8 copy of a draft vocabulary's rows: strict outputs stay greedy; the whole vocabulary in id order is
    the FP8 head itself (the same rows, the same blocks: the same drafts)."""
    V = trained.cfg.vocab_size
    base = greedy(len(prompts))
    whole = mtp.generate(trained, prompts, N_NEW, draft="eagle", k=3, draft_head_fp8=True, draft_vocab=range(V))
    alone = mtp.generate(trained, prompts, N_NEW, draft="eagle", k=3, draft_head_fp8=True)
    assert whole.tokens == alone.tokens == base.tokens
    assert whole.metrics.accepted_hist == alone.metrics.accepted_hist
    half = mtp.generate(trained, prompts, N_NEW, draft="eagle", k=3, draft_head_fp8=True, draft_vocab=range(0, V, 2))
    assert half.tokens == base.tokens


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_values_name_the_option():
    with pytest.raises(OptionError, match="draft_head_fp8 must be True or False, got 'yes'"):
        DraftConfig("eagle", 2, head_fp8="yes")
    with pytest.raises(OptionError, match="draft_head_fp8 must be False with draft='none'"):
        DraftConfig("none", 0, head_fp8=True)
    with pytest.raises(OptionError, match="draft_head_fp8 must be True or False, got 1"):
        mtp.GenerationConfig.from_options(8, draft="eagle", k=1, draft_head_fp8=1)
    # as a draft vocabulary, ignored when nothing is drafted
    assert not mtp.GenerationConfig.from_options(8, draft_head_fp8=True).draft.head_fp8


def test_a_model_without_a_head_to_copy_is_refused(tiny_ckpt):
    """Before anything runs (GenerationConfig.validate, from generate): a module whose head holds no float weight,
    and a width the per-128 quantization cannot split."""
    from types import SimpleNamespace

    from mtp.checkpoint.files import load_model
    from mtp.model.layers import Linear

    m = load_model(tiny_ckpt, dtype=torch.float32)
    D, V = m.cfg.hidden_size, m.cfg.vocab_size
    m.mtp[0].shared_head.head = torch.nn.Identity()  # a head without a weight
    with pytest.raises(ValueError, match=r"draft_head_fp8: model.mtp\[0\].shared_head.head has no weight to copy "
                                         r"into FP8 \(got Identity\)"):
        mtp.generate(m, [[5, 6, 7]], 4, draft="eagle", k=2, draft_head_fp8=True)
    with torch.device("meta"):
        m.mtp[0].shared_head.head = Linear(D, V, True)  # already FP8 (and never filled)
    with pytest.raises(ValueError, match=rf"shared_head.head.weight must be a float \[rows, {D}\] tensor .* got "
                                         r"torch.float8_e4m3fn"):
        mtp.generate(m, [[5, 6, 7]], 4, draft="eagle", k=2, draft_head_fp8=True)
    odd = SimpleNamespace(cfg=SimpleNamespace(hidden_size=200))
    with pytest.raises(ValueError, match="hidden_size 200 is not a multiple of 128"):
        hf.check_model(odd, [0])


def test_experiment_config_passes_the_option():
    from hydra import compose, initialize_config_dir

    from eval.common import generate_kwargs
    from tests.eval.test_conf import CONF, FIXED

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for draft in ("eagle", "vanilla"):
            kw = generate_kwargs(compose("eval", overrides=[f"draft={draft}", "draft.head_fp8=true"] + FIXED))
            assert kw["draft_head_fp8"] is True
            assert mtp.GenerationConfig.from_options(8, **kw).draft.head_fp8
        assert "draft_head_fp8" not in generate_kwargs(compose("eval", overrides=FIXED))
        kw = generate_kwargs(compose("eval", overrides=["draft.head_fp8=true", "draft.tree=2x1"] + FIXED))
        assert kw["draft_head_fp8"] and kw["tree"] == "2x1"


# ---------------------------------------------------------------------------------------------- interpreted
def test_fast_path_head_under_the_interpreter():
    run_interpreted(__file__, 600)


def exact_fp8_input(M: int, D: int, g: torch.Generator) -> torch.Tensor:
    """[M, 1, D] fp32 values that per-128 quantization keeps exactly (e4m3 codes times a power of two, each group's
    amax 448 times it): the interpreter rounds its in-kernel e4m3 casts its own way (numpy; tests/kernels/
    test_fused_kernels.py compares the kernels' quantization with the interpreter's own for that reason), which
    on these inputs cannot show, so the kernels and the reference formula see the same x8 and scales."""
    codes = (torch.randn(M, D // 128, 128, generator=g) * 100).clamp(-448, 448).to(fp8.FP8_DTYPE).float()
    codes[..., 0] = 448.0
    scale = 2.0 ** torch.randint(-12, 0, (M, D // 128, 1), generator=g).float()
    return (codes * scale).reshape(M, 1, D)


def _interpreted_checks() -> None:
    """The kernels the fast path gives the head (dispatch.linear: the split-K GEMV at 1..gemv_rows rows, the
    weight-streaming GEMV above) against the reference formula at an odd shape (a ragged last scale block, 3 groups)
    and 1, 2 and 4 rows, in fp32 and bf16, then strict decoding with them."""
    from mtp.kernels.dispatch import FastPathOptions

    g = torch.Generator().manual_seed(0)
    for N, D in ((300, 384),):  # a ragged last scale block, 3 groups
        w = torch.randn(N, D, generator=g) * 0.05
        for opts in (FastPathOptions(), FastPathOptions(gemv_rows=4)):
            holders = Holder(opts), Holder(None)  # kept: the heads hold them weakly
            fast, ref = (hf.Fp8Head(h, w) for h in holders)
            for M in (1, 2, 4):
                for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
                    x = exact_fp8_input(M, D, g).to(dtype)
                    y, want = fast(x), ref(x)
                    assert y.dtype == dtype and y.shape == (M, 1, N)
                    err = ((y.double() - want.double()).norm() / want.double().norm()).item()
                    assert err < tol, (N, D, opts.gemv_rows, M, dtype, err)
    print("kernel checks ok")
    from mtp.checkpoint.tiny import default_checkpoint

    m = mtp.load_model(default_checkpoint(), dtype=torch.float64)  # the kernels compute in fp32 all the same
    rows = [[0] + list(range(40, 52)), [0, 7, 8, 9]]
    base = mtp.generate(m, rows, 8)
    ref = mtp.generate(m, rows, 8, draft="eagle", k=2, draft_head_fp8=True)
    m.fast_options = FastPathOptions()  # the fast path's switches, nothing of it installed: the head's kernels
    got = mtp.generate(m, rows, 8, draft="eagle", k=2, draft_head_fp8=True)
    assert got.tokens == ref.tokens == base.tokens  # the drafts' quantization is the interpreter's, the verify not
    print(f"engine: accepted {got.metrics.accepted_hist} (fast head) vs {ref.metrics.accepted_hist} (reference)")
    assert sum(got.metrics.accepted_hist[1:]) > 0


if __name__ == "__main__":
    interpreted_main([_interpreted_checks], seed=None, threads=1)
