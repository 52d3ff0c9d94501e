"""The fast path's side-stream L2 prefetch (`mtp.backends.side_prefetch`, switch `FastPathOptions.l2_prefetch`) on the
CPU, on a tiny simulated TP=2 'split' rank (one dense and one MoE layer: the smallest whose MLA takes the kernels).

- Each point asks for the weights its kernels read: the tail (o_proj, the router's gate, the shared expert's slot of
  the stacked experts, or its own gate | up and down where it runs apart), the next block's head (q_a | wk | kv_a and
  q_b's rows; q_b | wq_b and the head weights where the indexer scores); the switches pick the points.
- No side stream off CUDA: `side_prefetch` gives None on the CPU, with the switch on, and creates no stream.
- Under the interpreter, a decode forward with the switch on (late tail and next; the prefetcher asks on the
  current stream, the CPU having none) launches the prefetch kernel right after each layer's q_b GEMV and after the
  dense layer's post-attention norm, asks for exactly those weights' lines, launches nothing else besides, and gives
  the switch off's logits, hidden and cache bytes.
On a GPU (side stream, CUDA-graph capture with PDL, 20 replays, every hint): tests/backends/test_side_prefetch_gpu.py.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`

from mtp.backends import side_prefetch as sp  # noqa: E402
from mtp.kernels.dispatch import FastPathOptions  # noqa: E402
from mtp.kernels.l2_prefetch import line_spans  # noqa: E402
from tests.interp import run_interpreted  # noqa: E402

CACHE = ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale")


@contextmanager
def _rank():
    """Rank 0 of a simulated TP=2 'split' group on the fast path (its group lives as long as the block)."""
    from mtp.backends.fast_path import install_fast_modules
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.simulate import simulated_rank
    from mtp.parallel.synthetic import random_parallel_model
    from tests.plan.test_kernel_count import _tiny

    with simulated_rank(2, 0) as comm:
        with torch.no_grad():
            model = random_parallel_model(_tiny(2), comm, ParallelPlan(2, expert_layout="split"), device="cpu",
                                          dtype=torch.bfloat16)
            install_fast_modules(model)
        yield model


@pytest.fixture(scope="module")
def rank():
    with _rank() as model:
        yield model


def _same_tensors(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    """The same bytes in memory: start, shape and dtype (views of a stack count as the stack's rows)."""
    key = [(t.data_ptr(), tuple(t.shape), t.dtype) for t in got]
    return key == [(t.data_ptr(), tuple(t.shape), t.dtype) for t in want]


def test_points_ask_for_what_their_kernels_read(rank):
    from mtp.backends.fast_path import FastMoE, set_kernels

    dense, moe_block = rank.model.layers
    moe = moe_block.mlp
    assert isinstance(moe, FastMoE) and moe.shared_index is not None, "the split rank stacks its shared expert"
    o0, o1 = dense.self_attn.o_proj, moe_block.self_attn.o_proj
    assert _same_tensors(sp.tail_weights(dense, 1), [o0.weight, o0.weight_scale_inv]), "a dense MLP adds nothing"
    se = moe.shared_experts
    slot = [getattr(getattr(se, p), a) for p in sp.PROJS for a in ("weight", "weight_scale_inv")]
    assert all(t.data_ptr() == moe.stacked[f"{p}.{a}"][moe.shared_index].data_ptr()
               for t, (p, a) in zip(slot, [(p, a) for p in sp.PROJS for a in ("weight", "weight_scale_inv")]))
    want = [o1.weight, o1.weight_scale_inv, moe.gate.weight, *slot]
    assert _same_tensors(sp.tail_weights(moe_block, 1), want), "the shared expert's slot of the stack"
    apart = [o1.weight, o1.weight_scale_inv, moe.gate.weight, *se.fused_gate_up, se.down_proj.weight,
             se.down_proj.weight_scale_inv]
    assert _same_tensors(sp.tail_weights(moe_block, moe.grouped_above + 1), apart), "the grouped layout: apart"
    old = set_kernels(rank, shared_in_experts=False)
    try:
        assert _same_tensors(sp.tail_weights(moe_block, 1), apart), "switch shared_in_experts off: apart"
    finally:
        set_kernels(rank, **vars(old))
    attn = moe_block.self_attn
    ix = attn.indexer
    head = [*attn.fused_a, attn.q_b_proj.weight, attn.q_b_proj.weight_scale_inv]
    assert attn.q_b_proj.weight.data_ptr() == attn.fused_qb[0].data_ptr(), "q_b's rows lead its stack"
    assert _same_tensors(sp.head_weights(moe_block, ix.topk), head), "no scores at S <= top-k: q_b's rows only"
    assert _same_tensors(sp.head_weights(moe_block, ix.topk + 1), [*attn.fused_a, *attn.fused_qb,
                                                                   ix.weights_proj.weight])
    assert sp.head_weights(None, 100) == [], "the last block has no next"
    for t in (1, moe.grouped_above + 1):
        line_spans(sp.tail_weights(moe_block, t) + sp.head_weights(moe_block, ix.topk + 1))  # contiguous, all


class Asked(sp.SidePrefetch):
    """Records what each point asks for instead of launching (no stream)."""

    def __init__(self, opts) -> None:
        super().__init__(torch.device("cpu"), opts)
        self.asked: list[tuple[str, list]] = []
        self.point = ""

    def ask(self, tensors) -> None:
        if tensors:
            self.asked.append((self.point, tensors))

    def at_start(self, block, tokens):
        self.point = "start"
        super().at_start(block, tokens)

    def after_qb(self, block, tokens):
        self.point = "after_qb"
        super().after_qb(block, tokens)

    def at_ffn(self, next_block, S):
        self.point = "ffn"
        super().at_ffn(next_block, S)


@pytest.mark.parametrize("tail,late,nxt", [(True, False, True), (True, True, True), (True, False, False),
                                           (False, False, True), (True, True, False)])
def test_switches_pick_the_points(rank, tail, late, nxt):
    dense, moe_block = rank.model.layers
    a = Asked(FastPathOptions(l2_prefetch=True, l2_prefetch_tail=tail, l2_prefetch_tail_late=late,
                              l2_prefetch_next=nxt))
    a.at_start(moe_block, 1)
    a.after_qb(moe_block, 1)
    a.at_ffn(moe_block, 8)  # the MoE block's next: another MoE block
    a.at_ffn(None, 8)  # the last block's: none
    want = [("after_qb" if late else "start", sp.tail_weights(moe_block, 1))] if tail else []
    want += [("ffn", sp.head_weights(moe_block, 8))] if nxt else []
    assert [p for p, _ in a.asked] == [p for p, _ in want]
    assert all(_same_tensors(g, w) for (_, g), (_, w) in zip(a.asked, want))


def test_no_side_stream_off_cuda(rank, monkeypatch):
    def no_stream(*args, **kwargs):
        raise AssertionError("a CUDA stream was created on the CPU")

    monkeypatch.setattr(torch.cuda, "Stream", no_stream)
    h = torch.zeros(1, 1, rank.cfg.hidden_size)
    trunk = rank.model
    assert trunk.fast_options is rank.fast_options, "the trunk reads the model's switches"
    for opts in (None, FastPathOptions(), FastPathOptions(l2_prefetch=True),
                 FastPathOptions(l2_prefetch=True, l2_prefetch_tail=False, l2_prefetch_next=False)):
        assert sp.side_prefetch(trunk, opts, h) is None
    assert "side_prefetch" not in trunk.__dict__


@pytest.mark.slow
def test_decode_forward_interpreted():
    """One subprocess, two forwards of the tiny rank under the interpreter: ~10 s."""
    run_interpreted(__file__, 300)


def _forward_checks() -> None:
    from collections import Counter

    from triton.runtime.interpreter import InterpretedFunction

    from mtp.backends import fast_path as fp
    from mtp.checkpoint.synthetic import fill_cache_random
    from mtp.kernels.l2_prefetch import l2_prefetch
    from tests.interp import L2_REQUESTS, patch_interpreter_l2, patch_interpreter_loop_bounds
    from tests.kernels.test_l2_prefetch import expected_requests

    patch_interpreter_loop_bounds()
    patch_interpreter_l2()
    launches: list[str] = []
    run = InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = recorded

    class OnCurrentStream(Asked):
        """The prefetcher's points and weights, asked on the CPU's (only) stream: the kernel runs interpreted."""

        def ask(self, tensors):
            if tensors:
                self.asked.append((self.point, tensors, len(launches)))
                l2_prefetch(tensors, programs=self.opts.l2_prefetch_programs)

    with _rank() as model, torch.no_grad():
        fp.set_elementwise(model, "triton")
        ids = torch.randint(0, model.cfg.vocab_size, (1, 1), generator=torch.Generator().manual_seed(0))
        out, seqs, made = {}, {}, []
        real = fp.side_prefetch
        for on in (False, True):
            fp.set_kernels(model, l2_prefetch=on, l2_prefetch_tail_late=True, l2_prefetch_programs=3)
            if on:
                fp.side_prefetch = lambda trunk, opts, h: made.append(OnCurrentStream(opts)) or made[-1]
            cache = fill_cache_random(model.new_cache(1, 12), 8, seed=1)
            launches.clear()
            L2_REQUESTS.clear()
            res = model(ids, cache, kv_len=9)
            fp.side_prefetch = real
            out[on] = [res.logits, res.hidden] + [getattr(cache, n) for n in CACHE]
            seqs[on] = list(launches)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)
               for a, b in zip(out[False], out[True])), "the prefetch changed a result"
    PF = "_l2_prefetch_kernel"
    assert [k for k in seqs[True] if k != PF] == seqs[False], "the prefetch changed another launch"
    asked = made[0].asked
    dense, moe_block = model.model.layers
    want = [("after_qb", sp.tail_weights(dense, 1)), ("ffn", sp.head_weights(moe_block, 9)),
            ("after_qb", sp.tail_weights(moe_block, 1))]  # the MoE block is the last: no next
    assert [p for p, _, _ in asked] == [p for p, _ in want]
    assert all(_same_tensors(g, w) for (_, g, _), (_, w) in zip(asked, want))
    on = seqs[True]
    assert [i for i, k in enumerate(on) if k == PF] == [i for _, _, i in asked], "one launch per ask"
    gemv, norm = "_gemv_fma_kernel", "_add_norm_quant_kernel"
    layer_starts = [i for i, k in enumerate(on) if k == norm][::2]  # input norm, post-attention norm per layer
    for (point, _, i), start in zip([a for a in asked if a[0] == "after_qb"], layer_starts):
        assert on[start:i].count(gemv) == 2 and on[i - 1] == gemv, f"not right after q_b's GEMV: {on[start:i + 1]}"
    i = asked[1][2]
    assert on[i - 1] == norm and on[layer_starts[0]:i].count(norm) == 2, f"not at the FFN half: {on[:i + 1]}"
    got = Counter((int(a), int(n)) for _, addr, nb in L2_REQUESTS for a, n in zip(addr, nb))
    assert got == sum((expected_requests(t, 3, False) for _, t in want), Counter()), "not the weights' lines"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.manual_seed(0)
    _forward_checks()
    print("interpreted checks ok")
