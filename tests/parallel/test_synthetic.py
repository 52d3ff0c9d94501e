"""The random model built sharded on each rank (`mtp.parallel.random_parallel_model`) against the single-process
`mtp.checkpoint.synthetic.random_model` and against `load_parallel` of a checkpoint holding the same tensors; and the
tensor-parallel benchmark entry (`python -m mtp.bench.parallel`) end to end under torchrun, 2 gloo ranks."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtp.checkpoint.files import load_model, save_checkpoint
from mtp.parallel import Comm, load_parallel
from mtp.parallel.comm import init_process_group
from mtp.parallel.synthetic import random_parallel_model
from mtp.model.presets import tiny_parallel_config
from mtp.checkpoint.synthetic import random_model
from mtp.checkpoint.random_weights import random_state

pytestmark = pytest.mark.slow
WORLD = 2
SEED = 3
LOGIT_ATOL = 2e-5  # |logits| ~ 4; fp32 partial sums are added in another order than on one rank


def outputs(model) -> dict:
    """Logits of a prefill (20 > index_topk 16: sparse attention), a cached 3-token step and the MTP module."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 20), generator=g)
    with torch.no_grad():
        cache = model.new_cache(2, 40)
        o = model(ids, cache)
        out = {"prefill": o.logits, "decode": model(ids[:, :3], cache).logits}
        mc = model.new_cache(2, 40, n_layers=1)
        out["mtp"] = model.mtp_forward(0, ids[:, 1:], o.hidden[:, :-1], mc).logits
    return out


def _params_mismatch(a, b) -> list[str]:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys():
        return sorted(set(pa) ^ set(pb))
    return [n for n in pa if pa[n].dtype != pb[n].dtype or not torch.equal(pa[n], pb[n])]


def _worker(rank: int, ckpt: str, init: str, out_dir: str) -> None:
    init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=90))
    torch.set_num_threads(1)
    try:
        cfg = tiny_parallel_config(WORLD)
        m = random_parallel_model(cfg, Comm(), device="cpu", dtype=torch.float32, seed=SEED)
        res = {"outputs": outputs(m), "n_params": len(list(m.parameters())),
               "mismatch_vs_load_parallel": _params_mismatch(m, load_parallel(ckpt, Comm(), dtype=torch.float32))}
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cfg():
    return tiny_parallel_config(WORLD)


@pytest.fixture(scope="module")
def ckpt(cfg, tmp_path_factory):
    return save_checkpoint(random_state(cfg, SEED), cfg, tmp_path_factory.mktemp("synth") / "ckpt")


@pytest.fixture(scope="module")
def tp1(cfg):
    return random_model(cfg, device="cpu", dtype=torch.float32, seed=SEED)


@pytest.fixture(scope="module")
def ranks(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("synth_ranks")
    ctx = mp.start_processes(_worker, args=(str(ckpt), str(out / "rendezvous"), str(out)), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()  # our own children only
            pytest.fail("parallel ranks did not finish within 120 s")
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_random_model_equals_its_checkpoint(cfg, ckpt, tp1):
    """random_model holds exactly what load_model reads from a checkpoint of random_state (same seed)."""
    assert _params_mismatch(tp1, load_model(ckpt, dtype=torch.float32)) == []


def test_world1_parallel_build_is_random_model(cfg, tp1):
    """One rank: the sharded build has the same parameters and bit-identical logits."""
    m = random_parallel_model(cfg, Comm(), device="cpu", dtype=torch.float32, seed=SEED)
    assert _params_mismatch(m, tp1) == []
    got, want = outputs(m), outputs(tp1)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_seed_changes_weights(cfg, tp1):
    other = random_model(cfg, device="cpu", dtype=torch.float32, seed=SEED + 1)
    assert not torch.equal(other.lm_head.weight, tp1.lm_head.weight)
    assert not torch.equal(other.model.layers[0].self_attn.q_b_proj.weight.float(),
                           tp1.model.layers[0].self_attn.q_b_proj.weight.float())


def test_tp2_slices_equal_load_parallel(ranks):
    """Each rank holds exactly what load_parallel gives it from the checkpoint (every parameter, bitwise)."""
    for r in range(WORLD):
        assert ranks[r]["n_params"] > 0
        assert ranks[r]["mismatch_vs_load_parallel"] == [], f"rank {r}"


def test_tp2_logits_equal_tp1_random_model(ranks, tp1):
    want = outputs(tp1)
    for key, ref in want.items():
        for r in range(WORLD):
            got = ranks[r]["outputs"][key]
            diff = (got - ref).abs().max().item()
            assert diff <= LOGIT_ATOL, f"{key} rank {r}: max |diff| {diff:.3g} (|logits| {ref.abs().max():.2f})"
        assert torch.equal(ranks[0]["outputs"][key], ranks[1]["outputs"][key]), f"{key}: ranks disagree"


def test_bench_entry_under_torchrun(tmp_path):
    out = tmp_path / "tp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           "-m", "mtp.bench.parallel", "--out", str(out), "--compare-tp1", "--k", "2", "--iters", "2",
           "--warmup", "1", "--gen-tokens", "6", "--allreduce", "nccl"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "TP=2 (gloo)" in p.stdout
    res = json.loads(out.read_text())
    assert res["world"] == 2 and res["backend"] == "gloo" and res["config"]["name"] == "tiny"
    par = res["parallel"]
    layers = res["config"]["num_hidden_layers"]
    # one all-reduce at the embedding, two per block (attention, FFN); the logits all-gathered once
    assert par["collectives_per_step"]["all_reduce"] == 1 + 2 * layers
    assert par["collectives_per_step"]["all_gather"] == 1 and par["collectives_same_every_width"]
    assert set(par["target_step"]) == {"1", "2", "3"}
    for w, r in par["target_step"].items():
        assert r["eager_ms"] > 0 and len(r["eager_ms_per_rank"]) == 2 and r["graph_ms"] is None  # no CUDA
        assert res["tp1"]["target_step"][w]["eager_ms"] > 0
        assert res["speedup_vs_tp1"][w]["eager"] > 0
    cmp = res["compare_tp1"]
    for d in [cmp["prefill_last"], *cmp["target_step"].values()]:
        assert d["max_abs"] <= LOGIT_ATOL and d["argmax_agree"] == 1.0
    assert cmp["generate_tokens_equal"] is True
    by = res["allreduce"]  # --allreduce: one entry per choice (gloo takes 'nccl' only: the one-shot needs NVLink)
    assert list(by) == ["nccl"] and by["nccl"]["generate_tokens_equal_nccl"] is True
    assert by["nccl"]["target_step"] == par["target_step"] and by["nccl"]["collectives_per_step"]["all_reduce_fused"] == 0
    assert len(par["param_gib_per_rank"]) == 2 and res["tp1"]["param_gib"] > max(par["param_gib_per_rank"])
