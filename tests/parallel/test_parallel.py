"""Tensor/expert/vocab-parallel model on 2 CPU ranks (gloo) against the single-process reference model.

One spawn of 2 ranks runs every parallel job (a load costs more than a forward); the parent computes the
single-rank references and compares. The checkpoint is the tiny random one with 8 heads (4 per rank:
o_proj gets 128 input channels per rank, a whole fp8 group) and a 512-wide dense MLP, plus one change so
that speculation is exercised: embeddings x10, the final / MTP norms = 1 and eh_proj = [10 I | 0], so the
residual stream is dominated by the current token's embedding and the MTP module predicts what the trunk
predicts one position later. Eagle k=2 then accepts both drafts on some steps and none on others.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.multiprocessing as mp

import mtp
from mtp.checkpoint.files import load_model, save_checkpoint
from mtp.model.config import RuntimeOptions
from mtp.parallel import Comm, ParallelPlan, load_parallel, param_bytes, set_static_moe
from mtp.checkpoint.random_weights import random_tensors
from mtp.model.presets import tiny_parallel_config
from mtp.parallel.comm import init_process_group
from mtp.distributed.group import leave
from mtp.parallel.memory import rank_weight_bytes

pytestmark = pytest.mark.slow
WORLD = 2
LOGIT_ATOL = 2e-5  # |logits| ~ 4; observed <= 1.1e-6 (fp32 reduction order differs from one rank)


def speculation_friendly(cfg, tensors, scale: float = 10.0):
    out = dict(tensors)
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    for n in ("model.embed_tokens.weight", f"model.layers.{L}.embed_tokens.weight"):
        out[n] = (tensors[n].float() * scale).bfloat16()
    for n in ("model.norm.weight", f"model.layers.{L}.shared_head.norm.weight", f"model.layers.{L}.enorm.weight"):
        out[n] = torch.ones(D, dtype=torch.bfloat16)
    eh = torch.zeros(D, 2 * D)
    eh[:, :D] = scale * torch.eye(D)
    out[f"model.layers.{L}.eh_proj.weight"] = eh.bfloat16()
    return out


def eh_proj_output(model, ids) -> torch.Tensor:
    """The MTP module's u = eh_proj([enorm(embed(t)); hnorm(h)]) for a fixed h (the trunk's hidden states differ in
    their last bits at TP = N): its input is then the same on every rank as on one (the embedding's all-reduce
    adds zeros), so u must be too, bit for bit. One thread: the CPU GEMM blocks its sums by the thread count."""
    h = torch.randn(*ids[:, 1:].shape, model.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    got = []
    hook = model.mtp[0].eh_proj.register_forward_hook(lambda mod, args, out: got.append(out))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            model.mtp_forward(0, ids[:, 1:], h.to(model.device, model.dtype), model.new_cache(2, 40, n_layers=1))
    finally:
        torch.set_num_threads(threads)
        hook.remove()
    return got[0]


def uneven_vocab(V: int) -> list[int]:
    """A draft vocabulary split unevenly over the two vocabulary halves (128 + 52 ids of 512): balanced, each rank
    holds 90 rows, rank 1 some of rank 0's half."""
    return list(range(0, V // 2, 2)) + list(range(V // 2, V, 5))


def checks(model, generate: bool = True) -> dict:
    """Logits of a prefill, a 3-token cached step and the MTP module, the MTP module's eh_proj output; eagle k=2
    and vanilla k=2 strict generations, eagle k=2 with a draft vocabulary, with an FP8 draft head and with both."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 20), generator=g).to(model.device)
    out = {}
    with torch.no_grad():
        cache = model.new_cache(2, 40)
        o = model(ids, cache)  # 20 > index_topk 16: the sparse indexer path is used
        out["prefill"] = o.logits
        out["decode"] = model(ids[:, :3], cache).logits
        mc = model.new_cache(2, 40, n_layers=1)
        out["mtp"] = model.mtp_forward(0, ids[:, 1:], o.hidden[:, :-1], mc).logits
    out["eh_proj"] = eh_proj_output(model, ids)
    if generate:
        prompts = [ids[0, :18].tolist(), ids[1, :7].tolist()]
        r = mtp.generate(model, prompts, max_new_tokens=12, draft="eagle", k=2)
        out["tokens"], out["accepted_hist"] = r.tokens, r.metrics.accepted_hist
        # vanilla: depth j's draft from the one module applied again (reuse_modules), each with its own cache
        r = mtp.generate(model, prompts, max_new_tokens=12, draft="vanilla", k=2, reuse_modules=True)
        out["vanilla_tokens"], out["vanilla_hist"] = r.tokens, r.metrics.accepted_hist
        vocab = uneven_vocab(model.cfg.vocab_size)
        r = mtp.generate(model, prompts, max_new_tokens=12, draft="eagle", k=2, draft_vocab=vocab)
        out["vocab_tokens"], out["vocab_hist"] = r.tokens, r.metrics.accepted_hist
        r = mtp.generate(model, prompts, max_new_tokens=12, draft="eagle", k=2, draft_head_fp8=True)
        out["fp8_head_tokens"], out["fp8_head_hist"] = r.tokens, r.metrics.accepted_hist
    return out


# A draft vocabulary's head (`SubHead`) on a synthetic vocabulary-parallel head [SUB_V, SUB_D]: each case's ids,
# with SUB_GATHER rows a build-time all-gather so the balanced build takes several calls.
SUB_V, SUB_D, SUB_GATHER = 24, 160, 2
SUB_ATOL = 2e-5  # |logits| ~ 20 (x, w ~ N(0, 1), D = 160); observed <= 2.9e-6 (GEMM sum order, n rows vs N)
SUB_CASES = {"uneven": (5, 17, 2, 23, 11, 0, 13),  # N % W = 1: rank 1 holds 3 ids and 1 padding row
             "one shard": (20, 13, 12, 23, 15),  # every row on rank 1: rank 0's come over the gather
             "one id": (7,),  # rank 1 holds only padding
             "all, reversed": tuple(range(SUB_V - 1, -1, -1))}


def sub_head_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(SUB_V, SUB_D, generator=g), torch.randn(3, SUB_D, generator=g)


def sub_head_cases(rank: int) -> dict:
    """Per case and layout: the gathered logits, ids_M, rows held and build-time all-gathers (a CountingComm on the
    default group); and the error each rank raises when the ranks' lists differ (in content, then in length)."""
    from types import SimpleNamespace

    from mtp.draft.vocab import SubHead
    from mtp.parallel.comm import CountingComm

    w, x = sub_head_inputs()
    Vl = SUB_V // WORLD
    out = {}
    for name, ids in SUB_CASES.items():
        for by_shard in (False, True):
            comm = CountingComm()
            head = SimpleNamespace(weight=w[rank * Vl:(rank + 1) * Vl].clone(), comm=comm)
            sub = SubHead(head, ids, SUB_V, "cpu", by_shard=by_shard, gather_rows=SUB_GATHER)
            built = comm.counts["all_gather_rows"]
            out[name, by_shard] = {"logits": sub(x), "ids_M": sub.ids_M, "weight": sub.weight, "calls": built}
    for name, ids in (("differ", (1, 2, 3 + rank)), ("length", (1, 2, 3)[: 3 - rank])):
        head = SimpleNamespace(weight=w[rank * Vl:(rank + 1) * Vl].clone(), comm=Comm())
        try:
            SubHead(head, ids, SUB_V, "cpu")
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def _worker(rank: int, ckpt: str, init: str, out_dir: str) -> None:
    init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=90))
    torch.set_num_threads(1)
    try:
        comm = Comm()
        res = {"sub_head": sub_head_cases(rank)}
        m = load_parallel(ckpt, comm, plan=ParallelPlan(WORLD), numerics="fp8")
        res["bytes_blocks"] = param_bytes(m)
        res["fp8_vocab"] = fp8_vocab_logits(m)
        res["fp8"] = checks(m)
        set_static_moe(m, True)
        res["fp8_static"] = checks(m, generate=False)
        set_static_moe(m, False)
        m.set_runtime(RuntimeOptions(numerics="dequant"))
        res["dequant"] = checks(m)
        # 'even' split: the 128-wide shared expert becomes 64 + 64 channels, cutting its 128x128 blocks
        m = load_parallel(ckpt, comm, plan=ParallelPlan(WORLD, mlp_split="even"), numerics="dequant")
        res["bytes_even"] = param_bytes(m)
        res["even"] = checks(m, generate=False)
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        leave(torch.device("cpu"))


def run_ranks(fn, args, timeout_s: float = 240.0) -> None:
    ctx = mp.start_processes(fn, args=args, nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()  # our own children only
            pytest.fail(f"parallel ranks did not finish within {timeout_s} s (collective mismatch?)")


@pytest.fixture(scope="module")
def par_ckpt(tmp_path_factory):
    cfg = tiny_parallel_config(WORLD)
    tensors = speculation_friendly(cfg, random_tensors(cfg, seed=0))
    return save_checkpoint(tensors, cfg, tmp_path_factory.mktemp("par") / "tiny-tp")


@pytest.fixture(scope="module")
def ranks(par_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    t0 = time.perf_counter()
    run_ranks(_worker, (str(par_ckpt), str(out / "rendezvous"), str(out)))
    print(f"\n2-rank jobs: {time.perf_counter() - t0:.1f} s")
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference(par_ckpt):
    res = {}
    for numerics in ("fp8", "dequant"):
        res[numerics] = checks(load_model(par_ckpt, numerics=numerics))
    return res


def _close(name, a, b, atol=LOGIT_ATOL):
    diff = (a - b).abs()
    where = [int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)]
    assert diff.max() <= atol, f"{name}: max |diff| {diff.max():.3g} at {where}: {a[tuple(where)]} vs {b[tuple(where)]}"


@pytest.mark.parametrize("job,ref", [("fp8", "fp8"), ("fp8_static", "fp8"), ("dequant", "dequant"),
                                     ("even", "dequant")])
def test_tp2_logits_equal_tp1(ranks, reference, job, ref):
    for key in ("prefill", "decode", "mtp"):
        for r in range(WORLD):
            _close(f"{job}/{key} rank {r}", ranks[r][job][key], reference[ref][key])
        assert torch.equal(ranks[0][job][key], ranks[1][job][key]), f"{job}/{key}: ranks disagree"


@pytest.mark.parametrize("job,ref", [("fp8", "fp8"), ("fp8_static", "fp8"), ("dequant", "dequant"),
                                     ("even", "dequant")])
def test_tp2_eh_proj_equals_tp1_bit_for_bit(ranks, reference, job, ref):
    """eh_proj is column parallel (each rank D / 2 output rows, then an all-gather): every channel of u is still
    one rank's whole dot over the 2D inputs, so u equals the single-rank u exactly (fp32, the same input)."""
    want = reference[ref]["eh_proj"]
    for r in range(WORLD):
        got = ranks[r][job]["eh_proj"]
        assert got.shape == want.shape and torch.equal(got, want), \
            f"{job} rank {r}: max |diff| {(got - want).abs().max():.3g}"


@pytest.mark.parametrize("numerics", ["fp8", "dequant"])
def test_tp2_speculative_tokens_equal_tp1(ranks, reference, numerics):
    ref = reference[numerics]
    acc = ref["accepted_hist"]
    assert acc[1] + acc[2] > 0 and acc[0] > 0, f"the test model should both accept and reject drafts: {acc}"
    for r in range(WORLD):
        assert ranks[r][numerics]["tokens"] == ref["tokens"], f"rank {r} generated other tokens"
        assert ranks[r][numerics]["accepted_hist"] == acc
        # vanilla drafts (the module again at depth 2): strict, so the greedy tokens, and the same drafts accepted
        assert ranks[r][numerics]["vanilla_tokens"] == ref["tokens"]
        assert ranks[r][numerics]["vanilla_hist"] == ref["vanilla_hist"]
        # draft vocabulary over a vocabulary-parallel head: per-rank rows, padded, all-gathered
        assert ranks[r][numerics]["vocab_tokens"] == ref["tokens"]  # strict: still the greedy tokens
        assert ranks[r][numerics]["vocab_hist"] == ref["vocab_hist"]  # the same drafts as one process makes
        # drafts from an FP8 copy of the head: each rank quantizes its shard, V / 2 = 256 rows in whole 128-row
        # blocks, so the blocks, scales and drafts of one process (with a draft vocabulary as well: one process,
        # tests/draft/test_head_fp8.py; its per-rank rows as the vocabulary's own check above)
        assert ranks[r][numerics]["fp8_head_tokens"] == ref["tokens"]
        assert ranks[r][numerics]["fp8_head_hist"] == ref["fp8_head_hist"]
        # both: the FP8 copy of each rank's balanced rows (90 of the 180 ids: FP8 blocks of 128 rows from each rank's
        # first row, so not one process's blocks, and other drafts may be made); strict, so the greedy tokens
    assert ref["vocab_hist"] != acc  # the vocabulary changed which drafts were made


def test_tp2_balanced_sub_head_equals_one_rank(ranks):
    """A draft vocabulary's head on 2 ranks, balanced: rank r holds the rows of ids[r n : (r + 1) n], n = ceil(N / 2),
    gathered from the rank holding them at build time: copied, so equal to the head's rows bit for bit, zero rows
    past the list. Its logits equal one process's `SubHead` over the same ids within SUB_ATOL, not bit for bit: the
    CPU GEMM sums a dot over D in another order for n rows than for N (seen: 2.9e-6 at |logit| ~ 20, one thread on
    both sides). Padding entries (id -1) are -inf. By shard: the same logits, in the ids' shard order."""
    from types import SimpleNamespace

    from mtp.draft.vocab import SubHead

    w, x = sub_head_inputs()
    for name, ids in SUB_CASES.items():
        N, n = len(ids), -(-len(ids) // WORLD)
        want = SubHead(SimpleNamespace(weight=w), ids, SUB_V, "cpu")(x)
        for r in range(WORLD):
            got = ranks[r]["sub_head"][name, False]
            mine = ids[r * n:(r + 1) * n]
            rows = torch.cat([w[list(mine)], w.new_zeros(n - len(mine), SUB_D)])
            assert torch.equal(got["weight"], rows), f"{name} rank {r}: rows differ from the head's"
            assert got["ids_M"].tolist() == list(ids) + [-1] * (WORLD * n - N), name
            _close(f"{name} rank {r}", got["logits"][:, :N], want, SUB_ATOL)
            assert torch.isneginf(got["logits"][:, N:]).all(), f"{name} rank {r}: padding not -inf"
            # 1 all-gather of the lists' (length, CRC-32), then the rows: ceil(most held by one rank / c) calls
            most = max(sum(1 for i in ids if i // (SUB_V // WORLD) == s) for s in range(WORLD))
            assert got["calls"] == 1 + -(-most // min(SUB_GATHER, most)), (name, got["calls"])
            old = ranks[r]["sub_head"][name, True]
            assert old["calls"] == 0
            ids_M = old["ids_M"].tolist()
            assert sorted(i for i in ids_M if i >= 0) == sorted(ids)
            for m, i in enumerate(ids_M):
                if i < 0:
                    assert torch.isneginf(old["logits"][:, m]).all(), (name, m)
                else:
                    _close(f"{name} by shard rank {r} entry {m}", old["logits"][:, m], want[:, ids.index(i)], SUB_ATOL)


FP8_IDS = tuple(range(255, -1, -1))  # every id in rank 0's half of the 512: rank 1's 128 rows all come over the gather


def fp8_vocab_logits(model) -> torch.Tensor:
    """Logits of the FP8 copy of module 0's head over FP8_IDS (`head_fp8.shared_fp8_head`), for a fixed input."""
    from mtp.draft.head_fp8 import shared_fp8_head

    x = torch.randn(2, model.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return shared_fp8_head(model, 0, FP8_IDS)(x.to(model.device, model.dtype))


def test_tp2_balanced_fp8_draft_head_equals_one_process(ranks, par_ckpt):
    """The FP8 copy of a draft vocabulary's rows takes the balanced layout: 128 rows a rank here, one whole 128-row
    FP8 block each, so the blocks and scales of one process's copy of the list and logits within LOGIT_ATOL of
    its (the block products summed over fewer rows)."""
    want = fp8_vocab_logits(load_model(par_ckpt, numerics="fp8"))
    for r in range(WORLD):
        _close(f"fp8 draft head rank {r}", ranks[r]["fp8_vocab"], want)


def test_tp2_ranks_with_different_draft_vocabularies_fail_together(ranks):
    """Every rank raises the same error from the one fixed-shape check, before any collective shaped by the ids."""
    for name in ("differ", "length"):
        errs = [ranks[r]["sub_head"][name] for r in range(WORLD)]
        assert errs[0] is not None and errs[0] == errs[1], errs
        assert "the ranks hold different id lists" in errs[0], errs[0]


def test_param_bytes_equal_planner(ranks, par_ckpt):
    cfg = mtp.ModelConfig.from_json(par_ckpt / "config.json")
    for split, key in (("blocks", "bytes_blocks"), ("even", "bytes_even")):
        for r in range(WORLD):
            want = sum(rank_weight_bytes(cfg, ParallelPlan(WORLD, split), r, torch.float32).values())
            assert ranks[r][key] == want, f"{split} rank {r}: loaded {ranks[r][key]} B, planner says {want} B"
    assert ranks[0]["bytes_blocks"] != ranks[1]["bytes_blocks"]  # the shared expert's one block is on rank 0


def test_world1_parallel_model_is_the_reference(par_ckpt, reference):
    """With one rank the parallel modules reduce to the plain ones: bit-identical logits, no process group."""
    got = checks(load_parallel(par_ckpt, Comm(), numerics="fp8"), generate=False)
    for key in ("prefill", "decode", "mtp", "eh_proj"):
        assert torch.equal(got[key], reference["fp8"][key]), key


def test_parallel_load_refuses_a_scale_no_real_checkpoint_holds(tmp_path):
    """The sharded loader runs the same scale check as load_model (a finite 2^60 block scale drove every logit
    to 0), naming file, tensor and value."""
    from mtp.checkpoint.files import CheckpointError

    cfg = tiny_parallel_config(WORLD)
    tensors = random_tensors(cfg, seed=0)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = 2.0 ** 60
    ckpt = save_checkpoint(tensors, cfg, tmp_path / "bad")
    with pytest.raises(CheckpointError, match=rf"{name}' holds 1 block scales outside .*: 1\.15292e\+18 \(= 2\^60\)"):
        load_parallel(ckpt, Comm(), numerics="fp8")


def test_parallel_load_refuses_an_eh_proj_of_the_wrong_shape(tmp_path):
    """eh_proj is cut by output rows per rank: a checkpoint whose eh_proj is not [D, 2D] is refused from its header
    before any rank reads a slice, naming the file, the tensor and both shapes (rank 0 of 2, no group needed)."""
    from mtp.checkpoint.files import CheckpointError
    from tests.parallel.test_moe_ep import SumLaterComm

    cfg = tiny_parallel_config(WORLD)
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    tensors = random_tensors(cfg, seed=0)
    name = f"model.layers.{L}.eh_proj.weight"
    tensors[name] = torch.zeros(D, 2 * D + 128, dtype=torch.bfloat16)
    ckpt = save_checkpoint(tensors, cfg, tmp_path / "bad")
    with pytest.raises(CheckpointError, match=rf"safetensors: tensor '{name}' has shape \[{D}, {2 * D + 128}\], "
                                              rf"the config implies \[{D}, {2 * D}\]"):
        load_parallel(ckpt, SumLaterComm(0, WORLD), plan=ParallelPlan(WORLD), numerics="fp8")


# ----------------------------------------------------------------------------------------- NCCL (GPU)
GPU_PROMPTS = [list(range(3, 40)), list(range(50, 61))]  # 37 > index_topk 16: sparse rows


def _nccl_worker(rank: int, ckpt: str, init: str, out_dir: str) -> None:
    """bf16 on 2 GPUs over NCCL: logits, and eagle k=2 generations in the engine's eager, graph (whole step
    captured, NCCL collectives inside) and overlap modes, on the reference path and on the Triton fast path
    (expert-parallel MoE included: `moe_experts` on the local experts, -1 slots for the other rank's); with a
    balanced draft vocabulary in eager and graph mode (bf16 head rows, and their FP8 copy on the fast path)."""
    from mtp.backends.fast_path import FastLinear, FastMoE, enable_fast_path
    from mtp.parallel.modules import ExpertParallelMoE, RowParallelLinear

    import faulthandler

    faulthandler.dump_traceback_later(100)  # a hung rank prints where it waits (the whole job takes ~30 s)
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=WORLD, device_id=dev,
                            timeout=datetime.timedelta(seconds=120))
    try:
        m = load_parallel(ckpt, Comm(), device=dev, dtype=torch.bfloat16, numerics="fp8")
        res = {"ref": {k: v.cpu() for k, v in checks(m, generate=False).items()}}
        for mode in ("eager", "graph", "overlap"):
            res[f"ref/{mode}"] = mtp.generate(m, GPU_PROMPTS, 16, draft="eagle", k=2, mode=mode).tokens
        vocab = uneven_vocab(m.cfg.vocab_size)  # balanced draft head: its rows all-gathered over NCCL at build time
        for mode in ("eager", "graph"):
            res[f"vocab/{mode}"] = mtp.generate(m, GPU_PROMPTS, 16, draft="eagle", k=2, mode=mode,
                                                draft_vocab=vocab).tokens
        enable_fast_path(m)
        res["ep_fast"] = [isinstance(mod, FastMoE) for mod in m.modules() if isinstance(mod, ExpertParallelMoE)]
        res["row_fast"] = [isinstance(mod, FastLinear) for mod in m.modules() if isinstance(mod, RowParallelLinear)]
        res["fast"] = {k: v.cpu() for k, v in checks(m, generate=False).items()}
        for mode in ("eager", "graph"):
            res[f"fast/{mode}"] = mtp.generate(m, GPU_PROMPTS, 16, draft="eagle", k=2, mode=mode).tokens
            res[f"fast_vocab_fp8/{mode}"] = mtp.generate(m, GPU_PROMPTS, 16, draft="eagle", k=2, mode=mode,
                                                         draft_vocab=vocab, draft_head_fp8=True).tokens
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        leave(dev)  # graphs holding NCCL collectives dropped, then abort: ncclCommDestroy hangs after a capture


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")
def test_nccl_tp2_eager_graph_overlap(par_ckpt, tmp_path):
    run_ranks(_nccl_worker, (str(par_ckpt), str(tmp_path / "rendezvous"), str(tmp_path)))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    tp1 = load_model(par_ckpt, device="cuda:0", dtype=torch.bfloat16, numerics="fp8")
    ref = {k: v.cpu() for k, v in checks(tp1, generate=False).items()}
    tp1_tokens = mtp.generate(tp1, GPU_PROMPTS, 16, draft="eagle", k=2).tokens
    for r in range(WORLD):
        for kind in ("ep_fast", "row_fast"):  # the swap reached the tensor-parallel modules
            assert got[r][kind] and all(got[r][kind]), f"rank {r}: {kind} {got[r][kind]}"
        for key in ("prefill", "decode", "mtp", "eh_proj"):  # eh_proj: bf16 cuBLAS on D / 2 rows, not bitwise
            for path, bound in (("ref", 2e-2), ("fast", 5e-2)):
                a, b = got[r][path][key].float(), ref[key].float()
                rel = ((a - b).norm() / b.norm()).item()
                print(f"rank {r} {path} {key}: rel L2 vs TP1 reference {rel:.2e}")
                assert rel < bound, (r, path, key, rel)
                assert torch.equal(got[r][path][key], got[0][path][key]), f"{path}/{key}: rank {r} != rank 0"
        for mode in ("graph", "overlap"):
            assert got[r][f"ref/{mode}"] == got[r]["ref/eager"], f"rank {r}: {mode} != eager (reference path)"
        assert got[r]["fast/graph"] == got[r]["fast/eager"], f"rank {r}: graph != eager (fast path)"
        for what in ("vocab", "fast_vocab_fp8"):  # a balanced draft vocabulary (bf16; FP8 copy on the fast path)
            assert got[r][f"{what}/graph"] == got[r][f"{what}/eager"], f"rank {r}: {what} graph != eager"
        assert all(got[r][k] == got[0][k] for k in got[0] if "/" in k), f"rank {r} generated other tokens"
    print(f"TP2 reference-path tokens equal TP1 (bf16): {got[0]['ref/eager'] == tp1_tokens}")
    print(f"TP2 tokens with a draft vocabulary equal without (bf16, strict): "
          f"{got[0]['vocab/eager'] == got[0]['ref/eager']}, FP8 copy on the fast path: "
          f"{got[0]['fast_vocab_fp8/eager'] == got[0]['fast/eager']}")
