"""The logits scan (`mtp.kernels.logits_scan`, switch `FastPathOptions.logits_scan`): the argmax per row and the
health flag in one launch, exact against torch, and the decode step wired to it, on the CPU.

Shape legend: R rows, V vocabulary, B batch, K drafts.

- In-process: the switch (on by default) and its bench variants; the health check of `mtp.decode.health` (the
  reference path's torch ops) equal to the kernel's reference `logits_scan_ref` on adversarial rows; strict's rules of
  the argmax (chain and tree) give the verdicts of its rules of the logits; the kernel compiles for sm_90.
- Under the Triton interpreter (a subprocess, this file as a script):
  - kernel: indices torch.equal to torch.argmax(dim=-1) and the flag to the old check (`health.logits_nonfinite`) on
    random rows (R = 1..5, odd V) and adversarial ones (ties at chunk boundaries, NaN first / later / in several
    chunks, +-inf, -inf rows, all-equal rows, one-element chunks and last chunks, V = 1), at chunks of 1..64 and the
    default, fp32 / bf16 / fp16, strided rows and [B, T, V] logits; the flag only ever or-ed; every counter re-armed;
    bad input refused by name.
  - engine: strict decoding with the switch on (the kernel, in chunks of 64 over the tiny vocabulary of 512; MTP heads
    that agree with the trunk, so drafts get accepted) gives the tokens and acceptance of the switch off and of the
    reference path (no fast options): plain, eagle and vanilla chains and an eagle tree, the draft picks included,
    the kernel launched once per check and argmax; a NaN weight stops the run with the switch on naming the same
    module as with it off.
GPU twin (V = 129280, eager and CUDA graphs): tests/kernels/test_logits_scan_gpu.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402

NAN, INF = float("nan"), float("inf")


def adversarial_rows(V: int, chunk: int) -> list[tuple[str, torch.Tensor]]:
    """Named [R, V] fp32 cases whose argmax or flag a chunked scan could get wrong (chunk: the kernel's, so that ties
    and NaNs sit on its boundaries)."""
    g = torch.Generator().manual_seed(V * 31 + chunk)
    base = torch.randn(3, V, generator=g)
    cases = []

    def case(name, fill):
        x = base.clone()
        fill(x)
        cases.append((name, x))

    c1 = min(chunk, V - 1)  # the first index of the second chunk (or the last element)
    case("random", lambda x: None)

    def tie_boundary(x):  # the max at the end of chunk 0 and the start of chunk 1 (and later): the first wins
        x[:, [c1 - 1, c1, V - 1]] = 9.0
        x[1, c1 - 1] = 0.0  # row 1: only from chunk 1 on
        x[2, :] = 0.0
        x[2, [V - 1, c1]] = 5.0  # row 2: a later chunk's first element ties with the last one
    case("tie at chunk boundary", tie_boundary)

    def nan_first(x):
        x[0, 0] = NAN
        x[1, V - 1] = NAN  # the last element: NaN beats a larger finite value earlier
        x[1, 0] = 1e30
        x[2, [c1, V - 1]] = NAN  # NaNs in two chunks: the first
        x[2, 0] = INF
    case("nan first / later", nan_first)

    def infs(x):
        x[0, [c1, V - 1]] = INF
        x[1, :] = -INF  # an all -inf row: index 0, non-finite
        x[2, c1] = -INF
    case("inf", infs)

    def neg_inf_rows(x):
        x[:] = -INF
        x[1, V - 1] = -1e30
    case("-inf rows", neg_inf_rows)

    def all_equal(x):
        x[0] = 0.0
        x[1] = 3.5
        x[2, :] = 0.0
        x[2, V - 1] = 1e-30  # nearly equal: no flag from this row
    case("all equal", all_equal)

    def collapsed_row_only(x):  # finite everywhere; one row collapsed
        x[1] = -2.0
    case("one collapsed row", collapsed_row_only)

    def nan_and_equal(x):  # a NaN row whose other values are equal: amax = amin = NaN (unequal), still non-finite
        x[:] = 1.0
        x[0, c1] = NAN
        x[1] = NAN
    case("nan with equal values", nan_and_equal)

    def max_in_last_one_element_chunk(x):
        x[:, V - 1] = 50.0
        x[0, 0] = 50.0
    case("max in the last element", max_in_last_one_element_chunk)

    def huge(x):  # the largest finite floats: no overflow, no inf
        x[0, c1] = torch.finfo(torch.float32).max
        x[1, :] = -torch.finfo(torch.float32).max
        x[2, c1] = torch.finfo(torch.float32).tiny
    case("extreme finite", huge)
    return cases


def test_switch_is_on_and_variants_flip_it():
    """On by default (exact: the same indices and flag); `mtp-bench --kernel-variants logits_scan_off` (or `--kernels
    logits_scan=0` for the speculative steps) turns it off."""
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    o = FastPathOptions()
    assert o.logits_scan
    for name, want in (("logits_scan_off", False), ("logits_scan", True)):
        flags, options = KERNEL_VARIANTS[name]
        o.set(**flags)
        assert o.logits_scan is want and options == {}


def test_scan_runs_only_where_the_kernel_can():
    """`scan_at`: the switch, a device the kernel runs on (CUDA, or the interpreter) and logits it takes."""
    from mtp.kernels.dispatch import FastPathOptions

    on, off = FastPathOptions(), FastPathOptions(logits_scan=False)
    x = torch.zeros(2, 8)
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not on.scan_at(x)  # a CPU tensor, no interpreter: torch's ops
    assert not off.scan_at(x)
    assert not on.scan_at(x.double()) and not on.scan_at(torch.zeros(2, 0))


@pytest.mark.parametrize("V, chunk", [(37, 8), (64, 64), (5, 1)])
def test_old_check_is_the_kernels_reference(V, chunk):
    """`mtp.decode.health`'s torch path (the reference path, and the old one) and `logits_scan_ref` agree on every
    adversarial case: the flag, and the argmax of `scan`."""
    from mtp.decode.health import logits_nonfinite, scan
    from mtp.kernels.logits_scan import logits_scan_ref

    for name, x in adversarial_rows(V, chunk):
        for rows in (x, x[:1], x[1:2], x[2:]):
            f_old, f_ref, f_scan = (torch.zeros((), dtype=torch.bool) for _ in range(3))
            logits_nonfinite(f_old, rows)
            want = logits_scan_ref(rows, f_ref)
            assert torch.equal(scan(rows, None, f_scan), want), name
            assert bool(f_old) == bool(f_ref) == bool(f_scan), (name, rows)


def test_strict_rules_of_the_argmax_give_the_same_verdicts():
    """The registry's strict rules of the argmax (`chain_argmax`, `tree_argmax`) against its rules of the logits, on
    logits whose argmax the drafts match for 0..K positions, and trees with live masks; other verifiers have none."""
    from mtp.spec.tree_shape import TreeShape
    from mtp.verify.registry import VERIFIER_REGISTRY, verifier

    strict = verifier("strict")
    chain, chain_am = strict.chain_rule(), strict.chain_argmax_rule()
    tree, tree_am = strict.tree_rule(), strict.tree_argmax_rule()
    assert all(v.chain_argmax_rule() is None and v.tree_argmax_rule() is None
               for n, v in VERIFIER_REGISTRY.items() if n != "strict")
    g = torch.Generator().manual_seed(0)
    B, K, V = 6, 3, 11
    for _ in range(20):
        logits = torch.randn(B, K + 1, V, generator=g)
        drafts = logits[:, :K].argmax(-1)
        drafts[torch.rand(B, K, generator=g) < 0.3] = 0
        a, b = chain(None, drafts, None, logits, None, None), chain_am(None, drafts, logits.argmax(-1))
        assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))

    class Draft:
        def __init__(self, tokens_BN):
            self.tokens_BN, self.q_BNV = tokens_BN, None

    shape = TreeShape.from_branching((2, 2))
    tt = shape.tensors("cpu")
    N = shape.n_nodes
    for _ in range(20):
        logits = torch.randn(B, N, V, generator=g)
        target = logits.argmax(-1)
        tokens = target[:, tt.parent_N.clamp_min(0)]
        tokens[torch.rand(B, N, generator=g) < 0.4] = 0
        live = torch.rand(B, N, generator=g) < 0.8
        for lv in (None, live):
            a = tree(None, tt, Draft(tokens), logits, None, None, lv)
            b = tree_am(None, tt, Draft(tokens), target, lv)
            assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))


def test_kernel_compiles_for_hopper():
    """The kernel compiles for sm_90 (triton's own ptxas, no GPU) for fp32 and bf16 logits, with and without the
    argmax and the flag, at the default chunk (4 warps) and at 4096 (8 warps), with no local-memory spill."""
    pytest.importorskip("triton")
    from tests.kernels.test_fused_kernels import _compile_for_hopper

    from mtp.kernels.logits_scan import CHUNK, _scan_kernel

    for dtype in ("*fp32", "*bf16"):
        for argmax, flag in ((True, True), (True, False), (False, True)):
            for chunk, warps in ((CHUNK, 4), (4096, 8)):
                k = _compile_for_hopper(_scan_kernel, dict(x_ptr=dtype, first_ptr="*i32", cnt_ptr="*i32",
                                                           out_ptr="*i64", flag_ptr="*u8"),
                                        dict(CHUNK=chunk, CPAD=128, ARGMAX=argmax, FLAG=flag), num_warps=warps,
                                        aligned=("stride_r",))
                ptx = k.asm["ptx"]
                assert "atom.global" in ptx and ".local" not in ptx, (dtype, argmax, flag, chunk)


def test_logits_scan_interpreted():
    run_interpreted(__file__, 600, "kernel")


def test_engine_with_the_scan_interpreted():
    run_interpreted(__file__, 900, "engine")


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _check(x: torch.Tensor, chunk: int | None, name: str, full: bool = True) -> None:
    """The kernel against torch.argmax and the old check on `x`: argmax and flag; with `full` also the argmax alone,
    the flag alone, and a set flag staying set."""
    from mtp.decode.health import logits_nonfinite
    from mtp.kernels.logits_scan import logits_scan

    want = x.argmax(dim=-1)
    f_old, f = torch.zeros((), dtype=torch.bool), torch.zeros((), dtype=torch.bool)
    logits_nonfinite(f_old, x)
    got = logits_scan(x, f, chunk=chunk)
    where = f"{name}: {x.dtype} {list(x.shape)} chunk {chunk}"
    assert got.dtype == torch.long and torch.equal(got, want), f"{where}: argmax {got.tolist()} vs {want.tolist()}"
    assert bool(f) == bool(f_old), f"{where}: flag {bool(f)} vs the old check's {bool(f_old)}"
    if not full:
        return
    assert torch.equal(logits_scan(x, chunk=chunk), want), where
    f2 = torch.zeros((), dtype=torch.bool)
    assert logits_scan(x, f2, argmax=False, chunk=chunk) is None and bool(f2) == bool(f_old), where
    f3 = torch.ones((), dtype=torch.bool)
    logits_scan(x, f3, chunk=chunk)
    assert bool(f3), f"{where}: the flag is only or-ed"


def _kernel_checks() -> None:
    from mtp.kernels import fp8_gemm
    from mtp.kernels.logits_scan import logits_scan, scan_chunk

    g = torch.Generator().manual_seed(0)
    n = 0
    for V in (1, 2, 7, 37, 101):
        for R in (1, 2, 5):  # the interpreter is slow: one, two and an odd row count
            x = torch.randn(R, V, generator=g)
            for chunk in (1, 4, 16, None):
                _check(x, chunk, "random", full=chunk == 4)
                n += 1
    for V, chunk in ((37, 8), (33, 8), (17, 16), (40, 4), (9, 1), (64, 64), (130, 64)):
        for name, x in adversarial_rows(V, chunk):
            for rows in (x, x[1:2], x[2:]):  # each row's own flag, and all of them together
                _check(rows, chunk, name, full=rows is x)
                n += 1
            # they round the values (1e30 and the extremes go to inf in fp16): against torch on what they became;
            # one of the two per chunking (the interpreter is slow), both over the whole set
            dtype = (torch.bfloat16, torch.float16)[(V + chunk) % 2]
            _check(x.to(dtype), chunk, name, full=False)
            n += 1
    # ties in bf16 made by rounding: many equal maxima spread over chunks
    x = (torch.randn(4, 300, generator=g) * 0.01).round(decimals=1).bfloat16()
    _check(x, 16, "bf16 rounding ties")
    # rows of any stride (a slice of wider rows), and [B, T, V] logits
    wide = torch.randn(5, 80, generator=g)
    wide[2, 3] = NAN
    _check(wide[:, :37], 8, "strided rows")
    _check(wide[1:4, 10:50], 8, "strided rows, offset")
    x3 = torch.randn(2, 3, 29, generator=g)
    x3[1, 2, 7:9] = 100.0
    _check(x3, 4, "[B, T, V]")
    _check(torch.randn(2, 3, 40, generator=g)[:, :, 5:], 8, "[B, T, V] strided")
    n += 7
    # no rows, and the chunk plan
    assert logits_scan(torch.zeros(0, 9)).shape == (0,)
    f = torch.zeros((), dtype=torch.bool)
    assert logits_scan(torch.zeros(0, 9), f, argmax=False) is None and not bool(f)
    assert scan_chunk(129280) == 1024 and scan_chunk(1 << 20) == 1024 and scan_chunk((1 << 20) + 1) == 2048
    # every counter re-armed by its last user (the slots the calls above took)
    assert int(fp8_gemm._COUNTERS[torch.device("cpu")][0].abs().sum()) == 0
    # bad input, refused by name
    for bad, match in ((torch.zeros(2, 0), "V > 0"), (torch.zeros(2, 3, dtype=torch.int32), "int32"),
                       (torch.zeros(2, 3, dtype=torch.float64), "float64")):
        try:
            logits_scan(bad)
        except ValueError as e:
            assert "logits_scan" in str(e) and match in str(e), e
        else:
            raise AssertionError(f"logits_scan took {bad.dtype} {list(bad.shape)}")
    for kw, match in ((dict(chunk=12), "power of two"), (dict(flag=torch.zeros(2, dtype=torch.bool)), "flag"),
                      (dict(flag=torch.zeros((), dtype=torch.int32)), "flag")):
        try:
            logits_scan(torch.zeros(2, 9), **kw)
        except ValueError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"logits_scan took {kw}")
    print(f"{n} kernel cases")


def _engine_checks() -> None:
    """Strict decoding on the tiny checkpoint (fp32, FP8 numerics: reference modules) with fast options carried and
    nothing else of the fast path installed, so that the scan is the one thing the switch changes."""
    import tempfile

    import mtp.kernels.logits_scan as ls
    from mtp import generate
    from mtp.checkpoint.files import load_model, save_checkpoint
    from mtp.checkpoint.random_weights import random_tensors
    from mtp.checkpoint.tiny import agreeing_mtp
    from mtp.decode.health import NonFiniteError
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.model.presets import tiny_config

    ls.CHUNK = 64  # 8 chunks over the tiny vocabulary of 512: the combine across programs runs in every call
    calls = []
    kernel = ls._scan_kernel

    class Counted:  # counts the kernel's launches (the switch must reach every argmax and check)
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    ls._scan_kernel = Counted()
    cfg = tiny_config(mtp_modules=2)
    with tempfile.TemporaryDirectory() as td:
        path = save_checkpoint(agreeing_mtp(random_tensors(cfg, seed=0), cfg), cfg, f"{td}/m")  # drafts accepted
        model = load_model(path, dtype=torch.float32, numerics="fp8")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 23)]  # index_topk 16: dense, sparse
    runs = [dict(draft="none"), dict(draft="eagle", k=2), dict(draft="vanilla", k=2), dict(draft="eagle", tree="2x1")]
    for kw in runs:
        outs = {}
        labels = (("reference", None),) if kw == runs[1] else ()  # the torch path, with no fast options at all
        for label, opts in labels + (("off", FastPathOptions(logits_scan=False)), ("on", FastPathOptions())):
            model.fast_options = opts
            calls.clear()
            outs[label] = generate(model, prompts[:1] if "tree" in kw else prompts, 6, **kw)
            assert bool(calls) == (label == "on"), (kw, label, len(calls))
            if label == "on":
                steps = outs[label].metrics.target_forwards
                drafts = 0 if "tree" in kw else kw.get("k", 0)  # a chain's K greedy picks; a tree takes top-k
                # the prefill's check + first token, each step's check + argmax, each greedy chain draft's argmax
                assert len(calls) == 1 + steps * (1 + drafts), (kw, len(calls), steps)
        for label, out in outs.items():
            assert out.tokens == outs["off"].tokens, (kw, label)
            assert out.metrics.accepted_hist == outs["off"].metrics.accepted_hist, (kw, label)
        assert kw["draft"] == "none" or sum(outs["on"].metrics.accepted_hist[1:]), (kw, "no draft accepted")
    # a NaN weight stops the run at the prefill with the switch on, naming the module the old check names
    with torch.no_grad():
        model.get_parameter("model.layers.1.post_attention_layernorm.weight").view(-1)[0] = NAN
    named = {}
    for label, opts in (("off", FastPathOptions(logits_scan=False)), ("on", FastPathOptions())):
        model.fast_options = opts
        try:
            generate(model, prompts, 4, draft="eagle", k=2)
        except NonFiniteError as e:
            named[label] = str(e)
        else:
            raise AssertionError(f"switch {label}: a NaN weight did not stop the run")
    assert named["on"] == named["off"] and "model.layers.1.post_attention_layernorm" in named["on"], named
    print("engine checks ok")


if __name__ == "__main__":
    interpreted_main({"kernel": _kernel_checks, "engine": _engine_checks})
