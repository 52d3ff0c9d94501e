"""The one-shot all-reduce (`mtp.parallel.oneshot`, allreduce='oneshot') against the reference primitive over NCCL,
on 2 GPUs: eager over widths 1..5, odd hidden sizes and both partial dtypes; inside a captured CUDA graph replayed
with changing inputs; each of those with a row in one program and cut into several (`SETTINGS`); and the TP=2 bundled model's strict tokens with 'oneshot' equal to 'nccl' (fp32), on the fast
path with both all-reduces of a block fused (o_proj's and the FFN's, `FastTrunk`) and with the FFN's not, with the
collectives and kernels of a forward counted.

Each check runs in its own guard on every rank and is reported as `name: ok` or `name: error ...`, so one failure
does not hide the others; a hung rank is killed by the run's time limit (faulthandler prints where it waited).
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python -m pytest -q -m gpu tests/parallel/test_allreduce_gpu.py
"""

from __future__ import annotations

import datetime
import traceback

import pytest
import torch

import mtp
from mtp.parallel.comm import Comm, init_process_group

from .test_parallel import run_ranks

WORLD = 2
WIDTHS = range(1, 6)
HIDDEN = (7168, 4096, 1000, 200)  # 1000, 200: odd (not a multiple of 128; no quant)
# the one-shot's program settings (`OneShot.set_programs`): the defaults (a fused row of 7168 in 14 programs, the
# unfused message in 1024-element programs, L2 loads), a row in one program with volatile loads (the settings
# before session 10), and rows cut into 8 / 2 groups of 128 per program (7168: 7 / 28 programs a row; 1000: 1 / 4,
# the last one partly masked) with the unfused message in 512 / 1024-element programs
SETTINGS = [{}, dict(ar_chunk=2048, row_groups=64, peer_load="volatile"), dict(ar_chunk=512, row_groups=8, peer_load="cg"),
            dict(ar_chunk=1024, row_groups=2, peer_load="volatile")]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")]


def _inputs(w: int, D: int, dtype, dev, rank: int, seed: int = 0):
    g = torch.Generator(device=dev).manual_seed(seed * 1000 + 10 * rank + w)
    x = (torch.randn(1, w, D, generator=g, device=dev) * 3).to(dtype)
    gh = torch.Generator(device=dev).manual_seed(seed * 1000 + 7 + w)  # the same residual and weight on every rank
    h = torch.randn(1, w, D, generator=gh, device=dev)
    wt = torch.rand(D, generator=gh, device=dev, dtype=torch.bfloat16) + 0.5
    return x, h, wt


def _compare(name: str, fast, ref, quant: bool) -> None:
    """fast vs reference: the residual to fp32 summation order, the bf16 norm to 1 ulp, the fp8 quant by value."""
    torch.testing.assert_close(fast.residual, ref.residual, rtol=1e-6, atol=1e-5, msg=lambda m: f"{name} residual: {m}")
    torch.testing.assert_close(fast.normed.float(), ref.normed.float(), rtol=1e-2, atol=1e-2,
                               msg=lambda m: f"{name} normed: {m}")
    if quant:
        torch.testing.assert_close(fast.sx, ref.sx, rtol=0, atol=0, msg=lambda m: f"{name} scales: {m}")
        same = (fast.x8.float() == ref.x8.float()).float().mean().item()
        assert same > 0.99, f"{name}: only {same:.4f} of the fp8 values equal the reference's"


def _eager(comm, ref, dev, rank) -> list[str]:
    bad = []
    for D in HIDDEN:
        for dtype in (torch.float32, torch.bfloat16):
            for w in WIDTHS:
                x, h, wt = _inputs(w, D, dtype, dev, rank)
                quant = D % 128 == 0
                for rd in (None, torch.bfloat16):
                    name = f"D={D} {dtype} w={w} round={rd}"
                    f = comm.all_reduce_add_norm(x.clone(), h, wt, 1e-6, torch.bfloat16, round_dtype=rd, quant=quant)
                    # the one-shot sums every partial in fp32; NCCL sums bf16 partials in bf16 (one rounding of the
                    # sum that the fp32 add after it keeps): unless the call rounds the sum itself, hold it to the
                    # reference over fp32 partials
                    xr = x.float() if rd is None else x
                    r = ref.all_reduce_add_norm(xr.clone(), h, wt, 1e-6, torch.bfloat16, round_dtype=rd, quant=quant)
                    try:
                        _compare(name, f, r, quant)
                    except AssertionError as e:
                        bad.append(str(e)[:400])
                s = comm.all_reduce(x.clone())
                want = ref.all_reduce(x.clone())
                if not torch.allclose(s.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                                      atol=1e-2 if dtype == torch.bfloat16 else 1e-5):
                    bad.append(f"all_reduce D={D} {dtype} w={w}: max |diff| {(s.float() - want.float()).abs().max()}")
    return bad


def _graph(comm, ref, dev, rank) -> list[str]:
    """Three one-shot calls back to back in one graph (fused, plain, fused on its output), replayed 6 times with
    new inputs copied in between; each replay against the reference computed eagerly on the same inputs."""
    from mtp.decode.graphs import capture_graph

    w, D = 3, 7168
    x, h, wt = _inputs(w, D, torch.float32, dev, rank)
    xs, hs = x.clone(), h.clone()
    out = {}

    def step():
        a = comm.all_reduce_add_norm(xs.clone(), hs, wt, 1e-6, torch.bfloat16, round_dtype=torch.bfloat16, quant=True)
        s = comm.all_reduce(xs.clone())
        b = comm.all_reduce_add_norm(s * 0.5, a.residual, wt, 1e-6, torch.bfloat16, quant=True)
        out.update(a=a, s=s, b=b)

    graph = capture_graph(step, warmup=2)
    bad = []
    for it in range(6):
        x, h, _ = _inputs(w, D, torch.float32, dev, rank, seed=it + 1)
        xs.copy_(x)
        hs.copy_(h)
        graph.replay()
        torch.cuda.synchronize()
        a = ref.all_reduce_add_norm(x.clone(), h, wt, 1e-6, torch.bfloat16, round_dtype=torch.bfloat16, quant=True)
        s = ref.all_reduce(x.clone())
        b = ref.all_reduce_add_norm(s * 0.5, a.residual, wt, 1e-6, torch.bfloat16, quant=True)
        try:
            _compare(f"replay {it} first", out["a"], a, True)
            torch.testing.assert_close(out["s"], s, rtol=1e-6, atol=1e-5, msg=lambda m: f"replay {it} sum: {m}")
            _compare(f"replay {it} third", out["b"], b, True)
        except AssertionError as e:
            bad.append(str(e)[:400])
    del graph
    return bad


def _identical_on_ranks(comm, dev, rank) -> list[str]:
    """Every rank gets the same bits (the parallel model's routing relies on it)."""
    x, h, wt = _inputs(4, 7168, torch.float32, dev, rank)
    r = comm.all_reduce_add_norm(x, h, wt, 1e-6, torch.bfloat16, quant=True)
    both = [torch.empty_like(r.residual) for _ in range(WORLD)]
    torch.distributed.all_gather(both, r.residual)
    return [] if all(torch.equal(both[0], b) for b in both) else ["ranks got different residuals"]


def _step_counts(m, comm, dev) -> dict:
    """Collectives (`CountingComm`) and kernels (`mtp.bench.timing.kernel_profile`, eager) of one 2 x 3-token
    trunk forward after a 20-token prompt."""
    from mtp.bench.timing import kernel_profile

    ids = torch.arange(46, device=dev).view(2, 23) * 7 % m.cfg.vocab_size
    cache = m.new_cache(2, 64)
    with torch.no_grad():
        m(ids[:, :20], cache)
        lens = cache.seq_lens.clone()

        def step():
            cache.truncate(lens)
            m(ids[:, 20:], cache, kv_len=23)

        comm.reset()
        step()
        counts = dict(comm.counts)
        counts["kernels"] = kernel_profile(step, steps=3)["kernels_per_step"]
    return counts


def _model(dev, fast: bool) -> list[str]:
    """The bundled model at TP=2 in fp32, on the fast path (o_proj's all-reduce fused with the block's add + norm,
    and the FFN's with the next block's: `FastTrunk`) or the reference path (plain one-shot all-reduces): strict
    eagle tokens with 'oneshot' equal 'nccl', in eager and graph mode (fast path: also with the FFN hand-off off,
    switch `mlp_reduce_norm`), and the one-shot kernels did run (their epochs advanced). Fast path: per trunk
    forward of L layers, 1 + 2L all-reduces whatever the path, 2L of them fused with an add (+ norm) with the
    hand-off and L without, and 2L - 1 fewer kernels with it (each of the L - 1 block boundaries: all-reduce, add,
    next input norm -> one kernel; the last block: all-reduce, add -> one)."""
    from mtp.backends.fast_path import enable_fast_path, set_kernels
    from mtp.checkpoint.tiny import default_checkpoint
    from mtp.parallel import load_parallel, set_allreduce
    from mtp.parallel.comm import CountingComm

    comm = CountingComm()
    m = load_parallel(default_checkpoint(), comm, device=dev, dtype=torch.float32, numerics="fp8")
    if fast:
        enable_fast_path(m)
    prompts = [list(range(3, 40)), list(range(50, 61))]

    def tokens():
        return {mode: mtp.generate(m, prompts, 24, draft="eagle", k=2, mode=mode).tokens for mode in ("eager", "graph")}

    want = tokens()
    counts = {"nccl": _step_counts(m, comm, dev)}
    got = {}
    if fast:  # the reduced sums' casts as launches of their own (fp32 here: a check of the wiring, not the rounding)
        set_kernels(m, fuse_out_cast=False)
        got["nccl, cast fold off"] = tokens()
        set_kernels(m, fuse_out_cast=True)
    set_allreduce(m, "oneshot")
    got["oneshot"] = tokens()
    counts["oneshot"] = _step_counts(m, comm, dev)
    if fast:
        set_kernels(m, mlp_reduce_norm=False)
        got["oneshot, FFN hand-off off"] = tokens()
        counts["off"] = _step_counts(m, comm, dev)
        set_kernels(m, mlp_reduce_norm=True)
    bad = [f"{mode}: {name} {g[mode]} != nccl {want[mode]}" for name, g in got.items() for mode in want
           if g[mode] != want[mode]]
    if int(comm.oneshot.epoch.sum().item()) == 0:
        bad.append("the one-shot kernel never ran in the model")
    L = m.cfg.num_hidden_layers
    print(f"rank {comm.rank} fast={fast} per trunk forward: {counts}", flush=True)
    if any(c["all_reduce"] != 1 + 2 * L for c in counts.values()):
        bad.append(f"all-reduces per forward should be 1 + 2 x {L} on every path: {counts}")
    fused = {k: c["all_reduce_fused"] for k, c in counts.items()}
    if fused != ({"nccl": 0, "oneshot": 2 * L, "off": L} if fast else {"nccl": 0, "oneshot": 0}):
        bad.append(f"fused all-reduces per forward: {fused}")
    if fast and counts["off"]["kernels"] - counts["oneshot"]["kernels"] != 2 * L - 1:
        bad.append(f"kernels per forward: {counts['off']['kernels']} with the FFN hand-off off, "
                   f"{counts['oneshot']['kernels']} on; expected {2 * L - 1} fewer")
    return bad


def _settings(check):
    """The check once per program setting (`SETTINGS`), its problems prefixed with the setting; defaults after."""
    from mtp.parallel.oneshot import DEFAULT_PROGRAMS

    def run(comm, ref, dev, rank):
        bad = []
        for kw in SETTINGS:
            comm.oneshot.set_programs(**{**DEFAULT_PROGRAMS, **kw})
            bad += [f"{kw or 'defaults'}: {p}" for p in check(comm, ref, dev, rank)]
        comm.oneshot.set_programs(**DEFAULT_PROGRAMS)
        return bad
    return run


def _worker(rank: int, init: str, out: str) -> None:
    import faulthandler

    from mtp.distributed.group import leave

    faulthandler.dump_traceback_later(240)
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=WORLD, device_id=dev,
                       timeout=datetime.timedelta(seconds=120))
    report = {}
    try:
        ref = Comm()
        comm = Comm()
        try:
            comm.set_allreduce("oneshot", dev)
            report["setup"] = []
        except Exception:  # noqa: BLE001  (reported; the checks below then say why they could not run)
            report["setup"] = [traceback.format_exc()[-1500:]]
        for name, fn in [("eager", _settings(_eager)), ("graph", _settings(_graph)),
                         ("identical", _settings(lambda c, r, d, k: _identical_on_ranks(c, d, k))),
                         ("model_fast", lambda c, r, d, k: _model(d, True)),
                         ("model_ref", lambda c, r, d, k: _model(d, False))]:
            if report["setup"] and not name.startswith("model"):
                report[name] = ["not run: setup failed"]
                continue
            try:
                report[name] = fn(comm, ref, dev, rank)
            except Exception:  # noqa: BLE001  (one check's failure must not hide the others)
                report[name] = [traceback.format_exc()[-1500:]]
            print(f"rank {rank} {name}: " + ("ok" if not report[name] else "error\n" + "\n".join(report[name][:5])),
                  flush=True)
        torch.save(report, f"{out}/rank{rank}.pt")
    finally:
        leave(dev)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("oneshot")
    run_ranks(_worker, (str(d / "init"), str(d)), timeout_s=420.0)
    return [torch.load(d / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("check", ["setup", "eager", "graph", "identical", "model_fast", "model_ref"])
def test_oneshot(reports, check):
    problems = [f"rank {r}: {p}" for r, rep in enumerate(reports) for p in rep[check]]
    assert not problems, "\n".join(problems[:10])
