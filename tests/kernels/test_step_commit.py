"""A chain (or tree) step's accept + commit + count in one launch (`mtp.kernels.step_commit`, switch
`FastPathOptions.step_commit`), integer for integer against the torch ops of `mtp.decode.accept`, on the CPU.

Shape legend: B rows, K drafts, K1 = K + 1, S buffer positions.

- In-process: the switch (on by default), its bench variant, the refusal of what the kernel does not take.
- Under the Triton interpreter (a subprocess, this file as a script):
  - kernel: random steps (B = 1..6, K = 0..5, finished rows, stop ids among the drafts and the target's token, rows
    at their last allowed tokens, windows of 1..2K) from random states: every tensor the torch ops write (tokens,
    n, generated, finished, the cache's lengths, the window start, the histogram, the two counters, the step's
    new / keep / acc outputs) torch.equal after the kernel; likewise with strict's verdict made in the launch from
    the target's argmax (switch strict_commit, `fused_commit` given the argmax) against `strict_verdict`'s;
  - kernel, a tree's step: random paths through trees of 3..9 nodes, the path's cache slots compacted after the kernel
    (`fused_commit(path_BA=)`), against accept / commit(path_BA) / count: every tensor above and the cache's entries
    torch.equal, the draft window's start untouched;
  - engine: strict decoding on a tiny model whose MTP heads agree with the trunk (drafts accepted) with the switch on
    and off (with it strict_commit, the verdict inside the launch, and draft_window, the proposer's window in one
    launch; nothing else of the fast path installed): the same tokens, acceptance, decode buffers and caches, for
    plain, eagle and vanilla chains, with a stop id cutting rows, and an eagle 2x1 tree (one row, no stop round:
    ~10 s); the kernel launched once a step.
GPU twin (eager and CUDA graphs, the real TP=8 rank's eagle k = 3 step): tests/backends/test_glue_gpu.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402


def test_switch_is_on_by_default_with_a_bench_variant():
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    assert FastPathOptions().step_commit
    assert KERNEL_VARIANTS["step_commit_off"][0] == {"step_commit": False}


def test_what_the_kernel_does_not_take_keeps_the_torch_ops():
    from mtp.decode.accept import fused_commit_takes
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.verify.common import Verdict

    st = SimpleNamespace(tokens=torch.zeros(2, 16, dtype=torch.long))
    d = torch.zeros(2, 3, dtype=torch.long)
    v = Verdict(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    stops = torch.tensor([1])
    on = FastPathOptions()
    assert not fused_commit_takes(None, None, st, d, v, stops)  # the reference path
    assert not fused_commit_takes(FastPathOptions(step_commit=False), None, st, d, v, stops)
    assert not fused_commit_takes(on, (5, 6), st, d, v, stops)  # a thinking state to update
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not fused_commit_takes(on, None, st, d, v, stops)  # CPU tensors, no interpreter


def test_kernel_compiles_for_hopper():
    """The kernel compiles for sm_90 (triton's own ptxas, no GPU) at one row and at 64 (4 warps), with no local-memory
    spill; it stores the bool flags as bytes. With PDL (switch glue_pdl), its trigger at the start (PDL_EARLY, one
    row) or after its wait (PDL_AFTER_WAIT), it waits before its first global load or store (`test_pdl._order`)."""
    pytest.importorskip("triton")
    from tests.kernels.test_fused_kernels import _compile_for_hopper
    from tests.kernels.test_pdl import _order

    from mtp.kernels.step_commit import _chain_commit_kernel

    ptrs = {name: "*i64" for name in ("tok_ptr", "n_ptr", "gen_ptr", "max_new_ptr", "lens_ptr", "p0_ptr", "hist_ptr",
                                      "relaxed_ptr", "steps_ptr", "new_ptr", "keep_ptr", "acc_ptr", "drafts_ptr",
                                      "a_ptr", "next_ptr", "ro_ptr", "stop_ptr")}
    gdc = ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]
    for rows, k1, warps, pdl, strict in ((2, 4, 1, 1, False), (64, 8, 4, 2, True)):
        k = _compile_for_hopper(_chain_commit_kernel, {**ptrs, "fin_ptr": "*u8"},
                                dict(NS=2, BLOCK_B=rows, BLOCK_K1=k1, PDL=pdl, STRICT=strict), num_warps=warps)
        ptx = k.asm["ptx"]
        assert "st.global.b8" in ptx and ".local" not in ptx, (rows, k1)
        order = _order(ptx)
        assert order[:2] == (gdc if pdl == 1 else gdc[::-1]) and order.count("griddepcontrol.wait") == 1, order[:4]


def test_step_commit_interpreted():
    run_interpreted(__file__, 300, "kernel")


@pytest.mark.slow
def test_engine_with_step_commit_interpreted():
    run_interpreted(__file__, 600, "engine")


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _random_step(g: torch.Generator, B: int, K: int, S: int = 40, layers: int = 0):
    """A decode state (the fields accept / commit / count touch) and a verdict, random but consistent: rows with n
    committed tokens and room for K + 1 more, some finished, generated counts near max_new, stop ids among the
    candidates; a target cache of `layers` layers (random entries: a tree's compaction moves them)."""
    from mtp.model.cache import KVCache
    from mtp.model.presets import tiny_config
    from mtp.verify.common import Verdict

    def ints(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=g)

    vocab = 12  # a small alphabet: stop ids land among the candidates often
    n = ints(2, S - 3 * K - 3, B)
    max_new = ints(1, 8, B)
    gen = torch.minimum(ints(0, 8, B), max_new)
    finished = (ints(0, 4, B) == 0) | (gen >= max_new)
    cache = KVCache(tiny_config(), layers, B, S, device="cpu", dtype=torch.float32, quantized=False)
    cache.seq_lens.copy_(ints(0, S, B))
    for buf in (cache.kv, cache.kv_scale, cache.pe, cache.idx_k, cache.idx_k_scale):
        buf.copy_(torch.randn(buf.shape, generator=g))
    st = SimpleNamespace(tokens=ints(0, vocab, B, S), n_B=n, gen_B=gen, max_new_B=max_new, finished_B=finished,
                         cache=cache, max_len=S, p0_B=ints(0, 5, B), think_B=torch.zeros(B, dtype=torch.bool),
                         hist_BK1=ints(0, 9, B, K + 1), relaxed_only=ints(0, 9), row_steps=ints(0, 9),
                         new_BK1=ints(0, vocab, B, K + 1), keep_B=ints(0, 5, B), acc_B=ints(0, 5, B))
    drafts = ints(0, vocab, B, K)
    verdict = Verdict(ints(0, K + 1, B), ints(0, vocab, B), ints(0, K + 1, B))
    stops = torch.unique(ints(0, vocab, int(ints(1, 4))))
    return st, drafts, verdict, stops


def _state(st) -> dict:
    out = {k: (v.seq_lens if k == "cache" else v).clone() for k, v in vars(st).items() if k not in ("max_len",)}
    if hasattr(st, "cache"):
        out |= {f"cache.{n}": getattr(st.cache, n).clone() for n in ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale")}
    return out


def _torch_commit(st, drafts, verdict, stops, **commit_kw):
    """A copy of `st` after the torch ops of a step's accept + commit + count (the kernel's reference)."""
    import copy

    from mtp.decode.accept import accept, commit, count

    want = copy.deepcopy(st)
    active = ~want.finished_B
    acc = accept(drafts, verdict, active, stops, want.max_new_B - want.gen_B)
    commit(want, acc, None, **commit_kw)
    count(want, acc, verdict.relaxed_only_B, active)
    return want


def _kernel_checks() -> None:
    import copy

    from mtp.decode.accept import fused_commit

    g = torch.Generator().manual_seed(0)
    cases = 0
    for B in (1, 2, 3, 6):
        for K in (0, 1, 3, 5):
            for _ in range(12):
                st, drafts, verdict, stops = _random_step(g, B, K)
                W = int(torch.randint(1, 2 * K + 2, (), generator=g))
                want = _torch_commit(st, drafts, verdict, stops, window=W)
                got = copy.deepcopy(st)
                drafts_strided = torch.cat((drafts, drafts), 1)[:, :K] if K else drafts  # a row stride of 2K
                fused_commit(got, drafts_strided, verdict, stops, W)
                a, b = _state(want), _state(got)
                bad = [k for k in a if not torch.equal(a[k], b[k])]
                assert not bad, (B, K, W, bad, {k: (a[k], b[k]) for k in bad})
                cases += 1
    # strict's verdict made inside the launch from the target's argmax (switch strict_commit): against
    # `strict_verdict` then the torch ops; argmaxes that agree with the drafts up to a random row-wise point
    from mtp.verify.strict import strict_verdict

    for B in (1, 3, 6):
        for K in (0, 1, 3, 5):
            for _ in range(4):
                st, drafts, _, stops = _random_step(g, B, K)
                target = torch.randint(0, 12, (B, K + 1), generator=g)
                agree = torch.arange(K + 1) < torch.randint(0, K + 2, (B, 1), generator=g)
                target[:, :K] = torch.where(agree[:, :K], drafts, target[:, :K])
                W = int(torch.randint(1, 2 * K + 2, (), generator=g))
                want = _torch_commit(st, drafts, strict_verdict(drafts, target), stops, window=W)
                got = copy.deepcopy(st)
                fused_commit(got, drafts, torch.cat((target, target), 1)[:, :K + 1], stops, W)  # a row stride
                a, b = _state(want), _state(got)
                bad = [k for k in a if not torch.equal(a[k], b[k])]
                assert not bad, ("strict", B, K, W, bad, {k: (a[k], b[k]) for k in bad})
                cases += 1
    # a tree's step: the drafts along a random path of a tree of N nodes, the path's cache slots compacted after the
    # kernel, no draft window (p0 untouched)
    for B, K, N in ((1, 1, 3), (3, 3, 9), (4, 2, 7)):
        for _ in range(6):
            st, drafts, verdict, stops = _random_step(g, B, K, layers=1)
            path = torch.cat((torch.zeros(B, 1, dtype=torch.long), torch.randint(1, N, (B, K), generator=g)), 1)
            want = _torch_commit(st, drafts, verdict, stops, path_BA=path)
            got = copy.deepcopy(st)
            fused_commit(got, drafts, verdict, stops, None, path_BA=path)
            a, b = _state(want), _state(got)
            bad = [k for k in a if not torch.equal(a[k], b[k])]
            assert not bad and torch.equal(b["p0_B"], st.p0_B), (B, K, N, bad)
            cases += 1
    # a stop in the drafts of an active row cuts it and finishes it, in both
    st, drafts, verdict, stops = _random_step(torch.Generator().manual_seed(1), 1, 4)
    st.finished_B.zero_(), st.gen_B.zero_(), st.max_new_B.fill_(10)
    drafts[0, 1], verdict.accept_len_B[0] = int(stops[0]), 4
    fused_commit(st, drafts, verdict, stops, 3)
    assert int(st.keep_B) == 2 and bool(st.finished_B) and int(st.acc_B) == 2
    from mtp.kernels.step_commit import chain_commit

    with pytest.raises(ValueError, match="chain_commit: takes int64"):
        chain_commit(st.tokens, st.n_B, st.gen_B, st.max_new_B, st.finished_B, st.cache.seq_lens, st.p0_B,
                     st.hist_BK1, st.relaxed_only, st.row_steps, st.new_BK1, st.keep_B, st.acc_B, drafts.int(),
                     verdict.accept_len_B, verdict.next_token_B, verdict.relaxed_only_B, stops, 3)
    print(f"kernel checks ok ({cases} random steps)")


def _engine_checks() -> None:
    """Strict decoding on the tiny checkpoint (fp32, FP8 numerics: reference modules) with fast options carried and
    nothing else of the fast path installed, so that the bookkeeping is the one thing the switch changes."""
    import tempfile

    import mtp.kernels.step_commit as sc
    from mtp.checkpoint.files import load_model, save_checkpoint
    from mtp.checkpoint.random_weights import random_tensors
    from mtp.checkpoint.tiny import agreeing_mtp
    from mtp.decode.config import GenerationConfig
    from mtp.decode.engine import Engine
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.model.presets import tiny_config

    calls = []
    kernel = sc._chain_commit_kernel

    class Counted:  # counts the kernel's launches (one a step with the switch on)
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    sc._chain_commit_kernel = Counted()
    cfg = tiny_config(mtp_modules=2)
    with tempfile.TemporaryDirectory() as td:
        path = save_checkpoint(agreeing_mtp(random_tensors(cfg, seed=0), cfg), cfg, f"{td}/m")  # drafts accepted
        model = load_model(path, dtype=torch.float32, numerics="fp8")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 23, 9)]
    runs = (dict(draft="none"), dict(draft="eagle", k=3), dict(draft="vanilla", k=2), dict(draft="eagle", tree="2x1"))
    for kw in runs:
        stop = None
        tree = "tree" in kw  # one row, one round: a tree's verify on the reference path is the run's slowest
        for _ in range(1 if tree else 2):  # the second round with a token the first made mid-row as a stop id
            outs = {}
            off = FastPathOptions(step_commit=False, strict_commit=False, draft_window=False)
            for label, opts in (("off", off), ("on", FastPathOptions())):
                model.fast_options = opts
                calls.clear()
                gcfg = GenerationConfig.from_options(8, kw["draft"], kw.get("k"), "strict", tree=kw.get("tree"),
                                                     stop_ids=() if stop is None else (stop,))
                engine = Engine(model, gcfg)
                res = engine.run(prompts[:1] if tree else prompts)
                st = next(iter(engine.pool.states.values()))
                caches = [st.cache, *getattr(st.proposer, "caches", ())]
                outs[label] = (res, {k: v.clone() for k, v in vars(st).items() if isinstance(v, torch.Tensor)},
                               [(c.seq_lens.clone(), c.kv.clone(), c.pe.clone(), c.idx_k.clone()) for c in caches])
                assert len(calls) == (res.metrics.target_forwards if label == "on" else 0), (kw, label, len(calls))
            (r0, s0, c0), (r1, s1, c1) = outs["off"], outs["on"]
            assert r1.tokens == r0.tokens and r1.metrics.accepted_hist == r0.metrics.accepted_hist, kw
            assert r1.row_accepted_hist == r0.row_accepted_hist and r1.finish_reasons == r0.finish_reasons, kw
            bad = [k for k in s0 if not torch.equal(s0[k], s1[k])]
            assert not bad, (kw, bad)
            assert all(torch.equal(x, y) for a, b in zip(c0, c1) for x, y in zip(a, b)), kw
            if stop is None:
                stop = next(t for row in r0.tokens for t in row[2:-1])
            else:
                assert "stop" in r0.finish_reasons, (kw, stop, r0.finish_reasons)
        assert kw["draft"] == "none" or sum(r0.metrics.accepted_hist[1:]), (kw, "no draft accepted")
    print("engine checks ok")


if __name__ == "__main__":
    interpreted_main({"kernel": _kernel_checks, "engine": _engine_checks})
