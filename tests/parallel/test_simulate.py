"""A simulated rank (`mtp.parallel.simulate.simulated_rank`: torch's fake process group, every collective a no-op)
runs what that rank runs in a real group. Each of 2 spawned processes is first rank r of a real gloo group that
records the result of every collective it issues, then the simulated rank r, whose Comm issues each collective on
the fake group and puts the recorded result in place. The sequence of collectives (kind, shape, dtype), the
logits and the eagle tokens must equal the real rank's bit for bit; the fake group must be gone afterwards, also
after an error. And `mtp-bench --tp 2` end to end on CPU (tiny config), in a subprocess."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import mtp
from mtp.decode.engine import release
from mtp.parallel.comm import CountingComm, init_process_group
from mtp.parallel.simulate import simulated_rank
from mtp.parallel.synthetic import random_parallel_model
from mtp.model.presets import tiny_parallel_config
from tests.parallel.test_parallel import run_ranks

pytestmark = pytest.mark.slow
WORLD = 2
SEED = 5


class RecordingComm(CountingComm):
    """A real rank's Comm that keeps a copy of every collective's result, in issue order."""

    def __init__(self):
        super().__init__()
        self.results: list[torch.Tensor] = []

    def all_reduce(self, t):
        out = super().all_reduce(t)
        self.results.append(out.clone())
        return out

    def all_gather_last(self, t, out_dtype=None):
        out = super().all_gather_last(t, out_dtype)
        self.results.append(out.clone())
        return out


class ReplayComm(CountingComm):
    """A simulated rank's Comm: the collective runs on the fake group (a no-op), then the recorded result of the
    real rank's collective with the same index takes its place."""

    def __init__(self, results: list[torch.Tensor]):
        super().__init__()
        self.results, self.used = results, 0

    def _next(self, shape) -> torch.Tensor:
        r = self.results[self.used]
        self.used += 1
        if tuple(r.shape) != tuple(shape):
            raise AssertionError(f"collective {self.used - 1}: the real rank's result is {list(r.shape)}, the "
                                 f"simulated rank's is {list(shape)}")
        return r

    def all_reduce(self, t):
        return super().all_reduce(t).copy_(self._next(t.shape))

    def all_gather_last(self, t, out_dtype=None):
        out = super().all_gather_last(t, out_dtype)
        return self._next(out.shape).clone()


def checks(model) -> dict:
    """Logits of a prefill (20 > index_topk 16: sparse), a cached 3-token step and the MTP module, and an eagle
    k=2 generation (eager, CPU)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 20), generator=g)
    out = {}
    with torch.no_grad():
        cache = model.new_cache(2, 40)
        o = model(ids, cache)
        out["prefill"] = o.logits
        out["decode"] = model(ids[:, :3], cache).logits
        mc = model.new_cache(2, 40, n_layers=1)
        out["mtp"] = model.mtp_forward(0, ids[:, 1:], o.hidden[:, :-1], mc).logits
    out["tokens"] = mtp.generate(model, [ids[0, :18].tolist(), ids[1, :7].tolist()], 8, draft="eagle", k=2).tokens
    return out


def _worker(rank: int, init: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    cfg = tiny_parallel_config(WORLD)
    init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                       timeout=datetime.timedelta(seconds=90))
    try:
        comm = RecordingComm()
        real = checks(random_parallel_model(cfg, comm, device="cpu", dtype=torch.float32, seed=SEED))
        real_calls, results = comm.calls, comm.results
    finally:
        release()
        dist.destroy_process_group()
    with simulated_rank(WORLD, rank) as counting:
        sim_world = (dist.get_world_size(), dist.get_rank(), dist.get_backend())
        comm = ReplayComm(results)
        sim = checks(random_parallel_model(cfg, comm, device="cpu", dtype=torch.float32, seed=SEED))
        # without replay: the fake group's results, but the same collectives in the same order
        model = random_parallel_model(cfg, counting, device="cpu", dtype=torch.float32, seed=SEED)
        with torch.no_grad():
            model(torch.zeros(1, 3, dtype=torch.long), model.new_cache(1, 8))
        counted = counting.calls
        try:
            with simulated_rank(WORLD, rank):
                pass
            nested = "opened"
        except RuntimeError as e:
            nested = str(e)
    errors = {"nested": nested, "initialized_after": dist.is_initialized()}
    try:
        with simulated_rank(WORLD, rank):
            raise KeyError("inside")
    except KeyError:
        errors["initialized_after_error"] = dist.is_initialized()
    torch.save({"real": real, "sim": sim, "real_calls": real_calls, "sim_calls": comm.calls, "used": comm.used,
                "n_results": len(results), "sim_world": sim_world, "counted": counted, "errors": errors},
               f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("simulate")
    run_ranks(_worker, (str(out / "rendezvous"), str(out)), timeout_s=240.0)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_simulated_rank_replays_to_the_real_ranks_outputs(ranks):
    for r, got in enumerate(ranks):
        assert got["sim_world"] == (WORLD, r, "fake")
        assert got["real_calls"] and got["sim_calls"] == got["real_calls"], f"rank {r}: other collectives"
        assert got["used"] == got["n_results"]
        for key in ("prefill", "decode", "mtp"):
            assert torch.equal(got["sim"][key], got["real"][key]), f"rank {r} {key}"
        assert got["sim"]["tokens"] == got["real"]["tokens"], f"rank {r} tokens"
    assert ranks[0]["real"]["tokens"] == ranks[1]["real"]["tokens"]


def test_simulated_step_issues_the_real_collectives(ranks):
    layers = tiny_parallel_config(WORLD).num_hidden_layers
    for got in ranks:
        kinds = [c[0] for c in got["counted"]]
        # one all-reduce at the embedding, two per block (attention, FFN); the logits all-gathered once
        assert kinds == ["all_reduce"] * (1 + 2 * layers) + ["all_gather"]
        assert got["counted"][-1][1][-1] == tiny_parallel_config(WORLD).vocab_size // WORLD  # local logits


def test_fake_group_is_torn_down(ranks):
    for got in ranks:
        e = got["errors"]
        assert "already initialized" in e["nested"]
        assert e["initialized_after"] is False and e["initialized_after_error"] is False


def test_simulated_rank_rejects_bad_arguments():
    for world, rank in ((2, 2), (2, -1), (0, 0)):
        with pytest.raises(ValueError, match="simulated_rank"):
            with simulated_rank(world, rank):
                pass
    assert not dist.is_initialized()


def test_bench_tp_on_cpu(tmp_path):
    out = tmp_path / "tp2.json"
    cmd = [sys.executable, "-m", "mtp.bench", "--tp", "2", "--layers", "2", "--prompt-len", "24", "40", "--k", "1",
           "--new-tokens", "5", "--iters", "2", "--trees", "chain2,2x1", "--draft-vocab", "100", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tp"] == 2 and res["rank"] == 1 and res["rank_choice"].startswith("default")  # rank 1: shared block
    assert set(res["contexts"]) == {"24", "40"}
    for L, ctx in res["contexts"].items():
        assert "no prefill" in ctx["cache"]
        assert set(ctx["widths"]) == {"1", "2"}
        for w, r in ctx["widths"].items():
            assert r["collectives"]["all_reduce"] == 1 + 2 * 2 and r["collectives"]["all_gather"] == 1
            assert r["collectives"]["all_gather_bytes"] == int(w) * 256 * 4  # [1, w, V/2] fp32 local logits
            assert r["eager_ms"] > 0 and r["floor_bytes"]["total"] > 0
            assert ctx["indexer"][w]["scores_us_per_layer"] > 0  # S > index_topk 16: the indexer runs
        assert set(ctx["trees"]) == {"chain2", "2x1"}
        for name, t in ctx["trees"].items():
            N = {"chain2": 3, "2x1": 5}[name]
            assert t["nodes"] == N and t["tree"]["ms"] > 0 and t["chain"]["ms"] > 0
            assert t["tree"]["bytes_per_node"] == pytest.approx(t["tree"]["bytes"] / N) and t["tree"]["bytes"] > 0
    assert "tree/chain" in p.stdout and "     2x1   5" in p.stdout
    dc = res["draft_collectives_per_forward"]
    assert dc["all_reduce"] == 3  # embedding, attention, MoE
    # eh_proj's slice [1, 1, D / 2] (column parallel), then the logits [1, 1, V / 2]; fp32 on the CPU
    cfg = tiny_parallel_config(2, 2)
    assert dc["all_gather"] == 2 and dc["all_gather_call_bytes"] == [cfg.hidden_size // 2 * 4, cfg.vocab_size // 2 * 4]
    assert dc["all_gather_bytes"] == sum(dc["all_gather_call_bytes"])
    runs = res["spec_step"]["runs"]
    assert set(runs) == {"none_k0_eager", "eagle_k1_eager", "vanilla_k1_eager", "eagle_k1_vocab100_balanced_eager",
                         "eagle_k1_vocab100_by_shard_eager", "tree_chain2_eager", "tree_2x1_eager"}
    # ids 0..99 all in rank 0's half of the 512: balanced 50 rows a rank, by shard rank 0's 100 (padding on rank 1)
    for layout, rows in (("balanced", 50), ("by_shard", 100)):
        r = runs[f"eagle_k1_vocab100_{layout}_eager"]
        assert r["draft_vocab"] == 100 and r["draft_vocab_layout"] == layout and r["draft_vocab_rows"] == rows
        assert r["steps"] > 0
    assert "100 ids, by_shard, 100 head rows on this rank" in p.stdout
    assert runs["tree_2x1_eager"]["steps"] > 0 and runs["tree_2x1_eager"]["verify_ms"] > 0
    pj = res["projection"]
    assert pj["collective_latency"]["assumed"] is True and "ASSUMED" in p.stdout
    assert {"plain", "eagle_k1"} <= set(pj["contexts"]["24"])
    # on a CPU the projection is labelled as no GPU number, without the published GPU references beside it (their
    # labels: a bare "158 tok/s" also matched this CPU run's own projection when its timings made it 158)
    from mtp.bench.rank_model import REFERENCES

    assert "not GPU numbers" in p.stdout and "not measured" in p.stdout
    assert "reference:" not in p.stdout and not any(name in p.stdout for name, _ in REFERENCES)


def test_bench_tp_extrapolated_on_cpu(tmp_path):
    """Two depths measured, the full depth extrapolated and labelled; collectives are exactly linear in depth."""
    out = tmp_path / "ex.json"
    cmd = [sys.executable, "-m", "mtp.bench", "--tp", "2", "--layers", "4", "--dense-layers", "1", "--extrapolate",
           "2", "3", "--prompt-len", "24", "--k", "1", "--new-tokens", "4", "--iters", "1", "--trees", "2",
           "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "EXTRAPOLATED to 4 layers" in res["extrapolated"] and "EXTRAPOLATED" in p.stdout
    assert set(res["depths"]) == {"2", "3"} and "spec_step" in res["depths"]["3"] and "spec_step" not in res["depths"]["2"]
    for w, r in res["contexts"]["24"]["widths"].items():
        assert r["collectives"]["all_reduce"] == 1 + 2 * 4  # measured 5 and 7 at 2 and 3 layers
        assert res["depths"]["3"]["contexts"]["24"]["widths"][w]["collectives"]["all_reduce"] == 1 + 2 * 3
    assert "EXTRAPOLATED" in res["projection"]["deployment"]
    t = res["contexts"]["24"]["trees"]["2"]
    assert t["extrapolated"] and t["tree"]["ms_per_node"] == pytest.approx(t["tree"]["ms"] / 3)


@pytest.mark.parametrize("rank", [0, 3])
def test_bench_token_ids_embed_as_in_the_real_group(rank):
    """`rank_steps.rank_token_ids`: ids from the simulated rank's own vocabulary shard, whose embedding (no other rank
    to add) equals the whole table's row; an id from another shard embeds as zeros there (the case it avoids)."""
    from mtp.bench.rank_steps import rank_token_ids
    from mtp.checkpoint.synthetic import random_model
    from mtp.model.presets import tiny_parallel_config

    cfg = tiny_parallel_config(4, 2, 1, 1)
    full = random_model(cfg, device="cpu", dtype=torch.float32, seed=SEED).model.embed_tokens.weight
    with simulated_rank(4, rank) as comm:
        model = random_parallel_model(cfg, comm, device="cpu", dtype=torch.float32, seed=SEED)
        ids = rank_token_ids(model, (2, 64), torch.Generator().manual_seed(1))
        emb = model.model.embed_tokens
        assert ids.min() >= emb.vocab_start and ids.max() < emb.vocab_start + emb.num_embeddings
        assert len(set(ids.flatten().tolist())) > 16  # drawn, not one id
        assert torch.equal(emb(ids), full[ids])
        other = (emb.vocab_start + emb.num_embeddings) % cfg.vocab_size
        assert emb(torch.tensor([[other]])).abs().sum() == 0
