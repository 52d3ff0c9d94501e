"""mtp-bench's host-side parts: argument defaults (TP=1 unchanged, --tp N full depth), the single-GPU table, and
the --tp N arithmetic (acceptance length, collective latency, byte floor, memory need, projection, table)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from mtp.bench import cli as bench
from mtp.parallel import Comm
from mtp.bench import rank as rb
from mtp.bench import rank_model as rm
from mtp.bench import rank_report as rr
from mtp.bench import rank_steps as rs
from mtp.parallel.synthetic import random_parallel_model
from mtp.model.presets import tiny_parallel_config
from mtp.model.presets import real_config


def _result(device="NVIDIA H100 80GB HBM3"):
    def width(ms, dense, experts, head, kv):
        return {"graph_ms": ms, "eager_ms": 10 * ms, "graph_ms_unfused_glue": 1.5 * ms, "roofline_ms": 0.7 * ms,
                "pct_of_roofline_graph": 70.0, "experts_touched": [0, 8, 8],
                "bytes": {"weights_dense": dense, "weights_experts": experts, "lm_head": head, "kv": kv,
                          "total": dense + experts + head + kv}}

    G = 1e9
    return {"device": device, "copy_TBps": 2.9, "torch": "x",
            "ours": {"target_step": {1: width(1.8, 0.9 * G, 0.7 * G, 1.85 * G, 0.01 * G),
                                     2: width(2.1, 0.9 * G, 1.3 * G, 1.85 * G, 0.01 * G)},
                     "spec_step": {"eagle_k1_graph": {"gpu_step_ms": 3.0, "step_ms_wall": 3.2, "gpu_idle_frac": 0.01}}},
            "hf": {"decode_ms": 18.0, "layers": 3}, "speedup_vs_hf_w1": 10.0, "speedup_bound_vs_hf_w1": 14.3}


def test_table_prints_every_line_and_no_projection(capsys):
    bench._table(_result())
    out = capsys.readouterr().out
    assert "target step w=2 graph" in out and "at the HBM roofline 14.3x" in out
    assert "full 61 layers" not in out and "mtp-bench --tp 8" in out


def test_tp1_arguments_are_unchanged():
    a = bench.parse_args([])
    assert (a.tp, a.layers, a.dense_layers, a.prompt_len, a.k, a.out) == (1, 3, 1, 1024, 3, None)
    assert bench.parse_args(["--prompt-len", "512"]).prompt_len == 512
    for bad in (["--prompt-len", "8", "16"], ["--rank", "1"], ["--tp", "0"], ["--layers", "2", "--dense-layers", "2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_trees_argument_and_table(capsys):
    assert bench.parse_args([]).trees == [] and bench.parse_args(["--tp", "8"]).trees == []
    assert bench.parse_args(["--trees", "chain3, 2x2,4x1x1,1x1"]).trees == ["chain3", "2x2", "4x1x1", "chain2"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--trees", "2x0"])
    res = _result()
    kind = lambda ms, by: {"ms": ms, "ms_per_node": ms / 7, "bytes": by, "bytes_per_node": by / 7}  # noqa: E731
    res["ours"]["trees"] = {"2x2": {"shape": "2x2", "nodes": 7, "depth": 2, "tree": kind(2.8, 4.2e9),
                                    "chain": kind(2.6, 4.1e9), "tree_over_chain": 2.8 / 2.6, "roofline_ms": 1.4,
                                    "pct_of_roofline": 50.0}}
    bench._table(res)
    out = capsys.readouterr().out
    assert "tree 2x2 N=7 graph" in out and "0.400 ms/node" in out and "600 MB/node" in out
    assert "chain of 7: 2.600 ms (tree/chain 1.08)" in out


def test_tp_arguments_default_to_full_depth():
    a = bench.parse_args(["--tp", "8", "--json", "x.json", "--accept", "0.9", "0.7"])
    assert (a.layers, a.dense_layers, a.out, a.accept, a.spec_modes) == (61, 3, "x.json", [0.9, 0.7], ("overlap",))
    assert a.prompt_len == ([1024, 8192, 32768] if torch.cuda.is_available() else [24, 40])
    assert bench.parse_args(["--tp", "8", "--layers", "2"]).dense_layers == 1
    for bad in (["--tp", "8", "--spec-modes", "eager"], ["--tp", "8", "--accept", "1.5"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_accept_len():
    assert rm.accept_len([0.8], 1) == pytest.approx(1.8)
    assert rm.accept_len([0.8], 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert rm.accept_len([0.9, 0.5], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.225)  # the last rate repeats


def test_collective_latency_assumed_and_measured(tmp_path):
    ns = argparse.Namespace(collective_json=None, allreduce_us=10.0, tp=8)
    lat = rm.collective_latency(ns)
    assert lat["assumed"] and "ASSUMED 10.0 us" in lat["source"]
    counts = {"all_reduce": 123, "all_reduce_bytes": 123 * 28672, "all_gather": 1, "all_gather_bytes": 64640}
    assert rm.comm_ms(lat, counts) == pytest.approx(124 * 10e-3)
    f = tmp_path / "coll.json"
    f.write_text('{"device": "H200", "world": 8, "ops": {"all_reduce": [{"bytes": 16384, "us": 8.0}, '
                 '{"bytes": 65536, "us": 11.0}], "all_gather": [{"bytes": 65536, "us": 9.0}]}}')
    lat = rm.collective_latency(argparse.Namespace(collective_json=str(f), allreduce_us=10.0, tp=8))
    assert not lat["assumed"] and "measured" in lat["source"] and "not the" not in lat["source"]
    assert "measured on 8 GPUs, not the 16" in rm.collective_latency(
        argparse.Namespace(collective_json=str(f), allreduce_us=10.0, tp=16))["source"]
    assert rm.latency_us(lat, "all_reduce", 28672) == 11.0  # the next measured size up
    assert rm.latency_us(lat, "all_reduce", 16384) == 8.0
    assert rm.latency_us(lat, "all_gather", 131072) == pytest.approx(18.0)  # past the table: scaled by bytes
    assert rm.comm_ms(lat, counts, times=2) == pytest.approx(2 * (123 * 11.0 + 9.0) * 1e-3)


def test_draft_all_gathers_priced_at_their_own_sizes(tmp_path):
    """A draft forward all-gathers eh_proj's slice [1, D / 8] bf16 (1792 B) and the logits [1, V / 8] (32320 B):
    with `all_gather_call_bytes` (`rank_steps.draft_collectives`) each is priced at its size, without it (files
    from before) both at the mean size."""
    f = tmp_path / "coll.json"
    f.write_text('{"device": "H200", "world": 8, "ops": {"all_reduce": [{"bytes": 16384, "us": 8.0}], '
                 '"all_gather": [{"bytes": 1792, "us": 6.0}, {"bytes": 32320, "us": 9.0}]}}')
    lat = rm.collective_latency(argparse.Namespace(collective_json=str(f), allreduce_us=10.0, tp=8))
    dc = {"all_reduce": 0, "all_reduce_bytes": 0, "all_gather": 2, "all_gather_bytes": 1792 + 32320}
    assert rm.comm_ms(lat, dc, draft=True) == pytest.approx(2 * 9.0e-3)  # both at the mean, 17056 B
    dc["all_gather_call_bytes"] = [1792, 32320]
    assert rm.comm_ms(lat, dc, times=3, draft=True) == pytest.approx(3 * (6.0 + 9.0) * 1e-3)


def test_default_rank_and_expected_experts():
    assert rb.default_rank(tiny_parallel_config(2), 2, torch.float32) == 1  # the shared expert's one block
    assert rb.default_rank(real_config(layers=4, dense_layers=3), 8, torch.bfloat16) == 0  # all ranks equal
    cfg = real_config(layers=4, dense_layers=3)
    assert rm.expected_local_experts(cfg, 8, 1) == pytest.approx(1.0)  # 32 local x 8/256
    assert 1.0 < rm.expected_local_experts(cfg, 8, 4) < 4.0


def test_memory_need_full_depth_tp8():
    """One rank of TP 8 at 61 layers: ~82 GiB of weights, too much for an 80 GB H100, fine on a 141 GB H200."""
    need = rm.memory_need(real_config(layers=61, dense_layers=3), 8, 0, torch.bfloat16, 32772, 1)
    assert 78 < need["weights_gib"] < 86 and 80 < need["need_gib"] < 130
    assert 1.0 < need["cache_gib"] < 2.5


def test_rank_floor_cache_and_experts():
    cfg = tiny_parallel_config(2)
    m = random_parallel_model(cfg, Comm(), device="cpu", dtype=torch.float32)  # world 1: every expert local
    per = rm.cache_bytes_per_position(cfg, dtype_bytes=4)  # fp32 model: rotary keys in fp32
    assert m.new_cache(1, 10).nbytes() == (per["latent"] + per["indexer"]) * 10 * cfg.num_hidden_layers
    dense_only = rm.rank_floor(m, {}, 10, 1)
    assert dense_only["weights_routed_experts"] == 0
    assert dense_only["cache"] == per["latent"] * 10 * cfg.num_hidden_layers  # S <= top-k: no indexer
    sparse = rm.rank_floor(m, {1: 3}, 40, 2)  # S > top-k 16: every indexer key, top-k latents
    assert sparse["cache"] == (per["latent"] * 16 + per["indexer"] * 40) * 2 * cfg.num_hidden_layers
    one = sum(p.numel() * p.element_size() for p in m.model.layers[1].mlp.experts["0"].parameters())
    assert sparse["weights_routed_experts"] == 3 * one
    assert sparse["total"] == sum(v for k, v in sparse.items() if k != "total")


def _tp_result(device="NVIDIA H200"):
    coll = {"all_reduce": 123, "all_reduce_bytes": 123 * 28672, "all_gather": 1, "all_gather_bytes": 64640}

    def ctx(ms, ix_us):
        return {"cache": "random", "widths": {w: {"graph_ms": ms + w, "collectives": coll, "floor_ms": 1.0,
                                                  "pct_of_floor": 10.0, "kernels_per_step": 4000.0,
                                                  "kernels_per_layer": 65.0,
                                                  "local_experts_touched": {"mean": 1.0}} for w in (1, 2, 3)},
                "indexer": {w: ({"scores_us_per_layer": ix_us, "topk_us_per_layer": ix_us, "ms_per_step": 1.0, "layers": 61}
                                if ix_us else {"skipped": "short"}) for w in (1, 2, 3)}}

    return {"mode": "simulated rank 0 of TP=8", "tp": 8, "device": device, "torch": "x", "param_gib": 82.0,
            "build_s": 60.0, "copy_TBps": 4.0, "config": {"num_hidden_layers": 61, "first_k_dense_replace": 3},
            "contexts": {1024: ctx(10.0, 0.0), 32768: ctx(12.0, 50.0)},
            "draft_collectives_per_forward": {"all_reduce": 3, "all_reduce_bytes": 3 * 28672, "all_gather": 1,
                                              "all_gather_bytes": 64640},
            "spec_step": {"prompt_len": 1024, "modes": ("overlap",), "runs": {
                "eagle_k1_overlap": {"k": 1, "gpu_step_ms": 15.0, "step_ms_wall": 15.5, "verify_ms": 11.5},
                "eagle_k2_overlap": {"k": 2, "gpu_step_ms": None, "step_ms_wall": 17.0, "verify_ms": 13.0}}}}


def test_tree_projection_uses_the_given_al_and_the_chain_draft(capsys):
    res = _tp_result()
    coll = {"all_reduce": 123, "all_reduce_bytes": 123 * 28672 * 7, "all_gather": 1, "all_gather_bytes": 64640 * 7}
    kind = lambda ms: {"ms": ms, "ms_per_node": ms / 7, "bytes": 7e9, "bytes_per_node": 1e9}  # noqa: E731
    for L in res["contexts"]:
        res["contexts"][L]["trees"] = {
            "2x2": {"shape": "2x2", "nodes": 7, "depth": 2, "tree": kind(20.0), "chain": kind(19.0),
                    "tree_over_chain": 20 / 19, "collectives": coll},
            "4x1x1": {"shape": "4x1x1", "nodes": 13, "depth": 3, "tree": kind(30.0), "chain": kind(29.0),
                      "tree_over_chain": 30 / 29, "collectives": coll}}
    args = argparse.Namespace(collective_json=None, allreduce_us=10.0, accept=[0.8], al=None, k=2, tp=8,
                              tree_al={"2x2": 2.9, "4x1x1": 3.2})
    pj = rm.project(res, args)
    t = pj["contexts"][1024]["tree_2x2"]
    c = 124 * 10e-3 + 2 * 4 * 10e-3  # the tree verify's collectives + 2 draft forwards'
    assert t["step_ms"] == pytest.approx(20.0 + (17.0 - 13.0) + c) and t["draft_ms"] == pytest.approx(4.0)
    assert "lower bound" in t["draft_source"]  # no tree step measured: the chain's draft of the same depth
    assert t["tok_s_per_user"] == pytest.approx(1e3 * 2.9 / t["step_ms"])
    assert "tree_4x1x1" not in pj["contexts"][1024]  # depth 3: no eagle k=3 step was measured
    res["spec_step"]["runs"]["tree_2x2_overlap"] = {"tree": "2x2", "k": 2, "gpu_step_ms": 26.0, "step_ms_wall": 27.0,
                                                    "verify_ms": 20.0}
    m = rm.project(res, args)["contexts"][1024]["tree_2x2"]  # the measured tree step: 26 - 20 ms of draft
    assert m["draft_ms"] == pytest.approx(6.0) and m["draft_source"] == "measured tree step"
    res["projection"] = pj
    rr.print_table(res)
    out = capsys.readouterr().out
    assert f"tree 2x2 {t['tpot_ms']:.2f} ms ({t['tok_s_per_user']:.0f} tok/s, AL 2.90 given)" in out
    assert "tree/chain" in out
    a = bench.parse_args(["--tp", "8", "--trees", "2x2,chain3", "--tree-al", "2x2=2.9", "chain3=2.5"])
    assert a.tree_al == {"2x2": 2.9, "chain3": 2.5}
    for bad in (["--tree-al", "2x2=2.9"], ["--trees", "2x2", "--tree-al", "2x2=0.5"],
                ["--trees", "2x2", "--tree-al", "2x2"], ["--trees", "2x2", "--tree-al", "3x3=2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_projection_adds_collectives_draft_and_divides_by_al(capsys):
    res = _tp_result()
    args = argparse.Namespace(collective_json=None, allreduce_us=10.0, accept=[0.8], al=None, k=2, tp=8)
    pj = rm.project(res, args)
    c = 124 * 10e-3  # 123 all-reduces + 1 all-gather at the assumed 10 us
    p = pj["contexts"][1024]
    assert p["plain"]["tpot_ms"] == pytest.approx(11.0 + c)
    e1 = p["eagle_k1"]
    assert e1["draft_ms"] == pytest.approx(15.0 - 11.5)  # spec step - the verify (w = 2) measured with it
    assert e1["step_ms"] == pytest.approx(12.0 + 3.5 + c + 4 * 10e-3)  # + one draft forward's 3 AR + 1 AG
    assert e1["tpot_ms"] == pytest.approx(e1["step_ms"] / 1.8)
    assert p["eagle_k2"]["draft_ms"] == pytest.approx(17.0 - 13.0)  # no GPU time: the wall time
    # at 32k the draft's one layer pays the longer indexer (k forwards x 100 us more per layer)
    assert pj["contexts"][32768]["eagle_k1"]["draft_ms"] == pytest.approx(3.5 + 0.1)
    assert pj["other_deployments"]["8 x H200"] == "this run"
    assert "not measured" in pj["other_deployments"]["16 x H100"]
    args.al = 2.5
    assert rm.project(res, args)["contexts"][1024]["eagle_k2"]["AL"] == 2.5  # --al sets AL at k = --k only
    res["projection"] = pj
    rr.print_table(res)
    out = capsys.readouterr().out
    assert "ASSUMED 10.0 us" in out and "158 tok/s per user" in out and "32768" in out
    best = max(pj["contexts"][1024]["eagle_k1"]["tok_s_per_user"], pj["contexts"][1024]["eagle_k2"]["tok_s_per_user"])
    assert f"8 x H200: this run, context 1024: plain {1e3 / (11.0 + c):.0f} tok/s per user, with MTP {best:.0f}" in out
    assert pj["target_step_timing"] == "graph_ms" and "one replay per event pair" in out
    # with back-to-back replays timed (graph_ms_b2b, since session 14) the projection reads those
    for ctx in res["contexts"].values():
        for r in ctx["widths"].values():
            r["graph_ms_b2b"] = r["graph_ms"] - 0.5
    b2b = rm.project(res, args)
    assert b2b["target_step_timing"] == "graph_ms_b2b"
    assert b2b["contexts"][1024]["plain"]["tpot_ms"] == pytest.approx(10.5 + c)
    assert b2b["contexts"][1024]["eagle_k1"]["verify_ms"] == pytest.approx(11.5)


def test_collbench_sizes_and_skip_on_one_gpu(monkeypatch, capsys):
    from mtp.bench import collectives as collbench

    shapes = collbench.message_shapes(real_config(layers=4, dense_layers=3), 8, widths=(1, 4))
    assert ("all_reduce", (1, 4, 7168), torch.float32) in shapes and ("all_gather", (1, 1, 16160), torch.float32) in shapes
    assert ("all_gather", (1, 4, 896), torch.bfloat16) in shapes  # an MTP module's eh_proj slices
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert collbench.main(["--json", "unused.json"]) == 0
    assert "skipped, needs 2+ GPUs" in capsys.readouterr().out


def test_extrapolate_is_linear_in_depth_and_labelled():
    def part(ms, n_ar, kernels):
        coll = {"all_reduce": n_ar, "all_gather": 1, "all_reduce_bytes": 100 * n_ar, "all_gather_bytes": 7}
        w = {"graph_ms": ms, "kernels_per_step": kernels, "kernel_us_per_step": 900 * ms, "floor_ms": ms / 10,
             "collectives": coll, "floor_bytes": {"total": 1e9 * ms}, "local_experts_touched": {"mean": 1.0}}
        return {"contexts": {1024: {"cache": "random", "widths": {1: w},
                                    "indexer": {1: {"scores_us_per_layer": 40.0, "topk_us_per_layer": 10.0,
                                                    "layers": 5, "ms_per_step": 0.25}}}}}

    got = rm.extrapolate(part(4.0, 11, 500), part(5.0, 13, 575), 5, 6, 61)[1024]
    r = got["widths"][1]
    assert got["extrapolated"] and "from 5 and 6 layers to 61" in r["extrapolated"]
    assert r["graph_ms"] == pytest.approx(5.0 + 55 * 1.0) and r["measured_ms"] == {5: 4.0, 6: 5.0}
    assert r["collectives"]["all_reduce"] == 1 + 2 * 61 and r["collectives"]["all_gather"] == 1
    assert r["kernels_per_step"] == pytest.approx(575 + 55 * 75) and r["kernels_per_layer"] == pytest.approx(
        r["kernels_per_step"] / 61)
    assert r["pct_of_floor"] == pytest.approx(10.0)
    assert got["indexer"][1]["ms_per_step"] == pytest.approx(0.05 * 61) and got["indexer"][1]["layers"] == 61


def test_extrapolate_arguments():
    a = bench.parse_args(["--tp", "8", "--extrapolate", "5", "9"])
    assert a.extrapolate == [5, 9] and a.layers == 61
    for bad in (["--tp", "8", "--extrapolate", "3", "9"], ["--tp", "8", "--extrapolate", "9", "5"],
                ["--tp", "8", "--extrapolate", "5", "61"], ["--extrapolate", "5", "9"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_kernel_switches_argument(capsys):
    """--kernels NAME=VALUE sets fast-path switches for the run; bad names and values are refused by name."""
    from mtp.bench.cli import parse_args

    assert parse_args(["--kernels", "gemv_rows=1", "pdl=1", "router=off", "pdl_tokens=4"]).kernels == dict(
        gemv_rows=1, pdl=True, router=False, pdl_tokens=4)
    assert parse_args([]).kernels == {}
    for bad, said in (("gemv_rows=x", "gemv_rows takes an integer"), ("pdl=maybe", "pdl takes 0 / 1"),
                      ("pdl_tokens=on", "pdl_tokens takes an integer"),
                      ("gemv", "expected NAME=VALUE"), ("gmev=1", "expected NAME=VALUE")):
        with pytest.raises(SystemExit):
            parse_args(["--kernels", bad])
        assert said in capsys.readouterr().err


def test_elementwise_argument(capsys):
    """--elementwise picks the fast path's glue ops (TP=1 and --tp N); the Triton kernels by default."""
    from mtp.bench.cli import parse_args

    assert parse_args([]).elementwise == "triton"
    assert parse_args(["--elementwise", "compile"]).elementwise == "compile"
    assert parse_args(["--tp", "8", "--elementwise", "eager"]).elementwise == "eager"
    with pytest.raises(SystemExit):
        parse_args(["--elementwise", "fused"])
    assert "invalid choice: 'fused'" in capsys.readouterr().err


def test_batch_axis_arguments():
    a = bench.parse_args(["--tp", "8", "--batch", "1", "8", "32", "64"])
    assert (a.batch, a.batches) == (1, [1, 8, 32, 64])
    assert (bench.parse_args([]).batch, bench.parse_args([]).batches) == (1, [1])
    for bad in (["--batch", "1", "8"], ["--tp", "8", "--batch", "0"], ["--tp", "8", "--batch", "8", "8"],
                ["--tp", "8", "--layers", "8", "--extrapolate", "4", "6", "--batch", "1", "2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_batch_axis_times_each_batch_on_a_tiny_rank():
    """--tp 2 --batch 1 2 on CPU: one entry per batch, each with its own cache rows, routing and floor bytes."""
    from mtp.bench.timing import timer
    from mtp.parallel.simulate import simulated_rank

    args = bench.parse_args(["--tp", "2", "--layers", "2", "--prompt-len", "20", "--k", "0", "--batch", "1", "2"])
    cfg = tiny_parallel_config(2, layers=2, dense_layers=1)
    with simulated_rank(2, 0) as comm:
        model = random_parallel_model(cfg, comm, device="cpu", dtype=torch.float32, seed=0)
        time_fn = timer(False, 1, 0)
        part = {"contexts": {20: rs.target_steps(model, comm, args, 20, False, None, time_fn, 2)}}
        saves = []
        rb.batch_axis(model, comm, args, False, None, time_fn, 2, part, lambda: saves.append(1))
    assert set(part["batches"]) == {1, 2} and part["batches"][1]["contexts"] is part["contexts"] and saves == [1]
    one, two = (part["batches"][b]["contexts"][20]["widths"][1] for b in (1, 2))
    assert one["floor_bytes"]["cache"] < two["floor_bytes"]["cache"]  # two rows of cache read
    assert two["local_experts_touched"]["expected_uniform_routing"] == rm.expected_local_experts(cfg, 2, 2)
    assert one["eager_ms"] > 0 and two["eager_ms"] > 0


def test_draft_head_fp8_adds_the_eagle_step_with_the_copy_on_a_tiny_rank(capsys):
    """--tp 2 --draft-head-fp8 on CPU: the eagle k = K step again with the FP8 head, the copy's bytes on the rank
    (its vocabulary shard) equal to the planner's, in the table too; the memory need counts it."""
    from mtp.parallel.simulate import simulated_rank

    args = bench.parse_args(["--tp", "2", "--layers", "2", "--prompt-len", "20", "--k", "1", "--new-tokens", "6",
                             "--draft-head-fp8"])
    assert bench.parse_args(["--tp", "2"]).draft_head_fp8 is False
    cfg = tiny_parallel_config(2, layers=2, dense_layers=1)
    with simulated_rank(2, 1) as comm:
        model = random_parallel_model(cfg, comm, device="cpu", dtype=torch.float32, seed=0)
        sp = rs.spec_steps(model, args, 20, False)
    run = sp["runs"]["eagle_k1_head_fp8_eager"]
    rows, D = cfg.vocab_size // 2, cfg.hidden_size
    assert run["draft"] == "eagle" and run["k"] == 1 and run["steps"] > 0
    assert run["draft_head_fp8"] == {"bytes": rows * D + rows // 128 * D // 128 * 4,
                                     "planned_bytes": rows * D + rows // 128 * D // 128 * 4,
                                     "bf16_head_bytes": rows * D * 4}  # the float32 model's head
    rr.print_table({"mode": "m", "device": "cpu", "torch": "x", "param_gib": 0.1, "build_s": 1.0, "contexts": {},
                    "config": {"num_hidden_layers": 2, "first_k_dense_replace": 1}, "spec_step": sp})
    assert "its FP8 head copy: 0.1 MB on this rank (planner: 0.1 MB)" in capsys.readouterr().out
    real = real_config(layers=61, dense_layers=3)
    with_head = rm.memory_need(real, 8, 0, torch.bfloat16, 1024, 1, head_fp8=True)
    assert with_head["draft_head_fp8_gib"] * 2**30 == 115_863_328
    assert with_head["need_gib"] - rm.memory_need(real, 8, 0, torch.bfloat16, 1024, 1)["need_gib"] == \
        pytest.approx(115_863_328 / 2**30)


def test_results_are_written_only_where_asked_and_a_cpu_run_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert bench.parse_args(["--tp", "8"]).out is None
    rr.save({"x": 1}, None)
    assert list(tmp_path.iterdir()) == []
    rr.save({"x": 1}, str(tmp_path / "r.json"))
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    res = {"mode": "simulated rank 0 of TP=8", "device": "cpu", "torch": "x", "param_gib": 0.1, "build_s": 1.0,
           "contexts": {}, "config": {"num_hidden_layers": 2, "first_k_dense_replace": 1},
           "projection": {"deployment": "8 x cpu", "collective_latency": {"source": "ASSUMED"},
                          "accept_per_position": [0.85], "contexts": {}, "other_deployments": {},
                          "references_tok_s_per_user": {"TensorRT-LLM, 8 x H200": 158}}}
    rr.print_table(res)
    out = capsys.readouterr().out
    assert out.count("not GPU numbers") == 2 and "TensorRT-LLM" not in out
    rr.print_table({**res, "device": "NVIDIA H200"})
    out = capsys.readouterr().out
    assert "not GPU numbers" not in out and "TensorRT-LLM, 8 x H200: 158 tok/s" in out


def test_hf_without_transformers_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SystemExit, match=r"mtp-bench --hf needs 'transformers', which is not installed: "
                                         r"pip install 'mtp\[hf\]'"):
        bench.main(["--hf"])


def test_busiest_route_forces_the_drawn_local_expert_counts():
    """--route busiest: every MoE layer of the simulated rank computes exactly the drawn busiest count of local
    experts (no cap at K: counts above it occur), measured by the step's own router, not the rank's arbitrary
    routing; the tree verify gets its own draw for its node count; --batch draws for B x w tokens."""
    from mtp.bench import experts
    from mtp.bench.timing import timer
    from mtp.parallel.simulate import simulated_rank

    args = bench.parse_args(["--tp", "2", "--layers", "4", "--prompt-len", "20", "--k", "2", "--route", "busiest",
                             "--layout", "interleaved", "--batch", "2", "--trees", "2x1"])
    cfg = tiny_parallel_config(2, layers=4, dense_layers=1)
    with simulated_rank(2, 0) as comm:
        model = random_parallel_model(cfg, comm, device="cpu", dtype=torch.float32, seed=0)
        v0 = model.version
        ctx = rs.target_steps(model, comm, args, 20, False, None, timer(False, 1, 0), 2)
        assert model.version > v0  # the tables' first allocation: graphs captured before must not replay
    K, above_k = cfg.num_experts_per_tok, 0
    for w, r in ctx["widths"].items():
        b = r["busiest_rank"]
        want = experts.draw_busiest(cfg, "interleaved", 2, 2 * w, 3, args.seed + 1000 * 2 * w)
        assert b["drawn_per_moe_layer"] == want and b["layout"] == "interleaved" and b["tokens"] == 2 * w
        assert b["realised_per_moe_layer"] == want == r["local_experts_touched"]["per_moe_layer"]
        assert all(n <= p <= 2 * w * K for n, p in zip(want, b["local_pairs_per_moe_layer"]))
        above_k += sum(n > K for n in want)
    assert above_k > 0  # the old force capped these at K
    t = ctx["trees"]["2x1"]["busiest_rank"]
    assert t["tokens"] == 2 * ctx["trees"]["2x1"]["nodes"] and t["realised_per_moe_layer"] == t["drawn_per_moe_layer"]
    drawn = [experts.draw_busiest(cfg, "interleaved", 2, 1, 3, s) for s in range(20)]
    assert len({n for d in drawn for n in d}) > 1  # the draws vary: a constant would not test the forcing
    with pytest.raises(SystemExit):
        bench.parse_args(["--tp", "8", "--layout", "interleaved"])  # drawn layouts need --route busiest
    assert bench.parse_args(["--tp", "8"]).layout == "auto"  # the runtime's default, resolved by the run
    assert bench.parse_args(["--tp", "8", "--layout", "split"]).layout == "split"  # built split, its own route


def test_busiest_per_sample_counts_ranks_by_layout():
    from mtp.bench.experts import busiest_per_sample

    ids = torch.tensor([[[0, 1, 2, 3, 32, 33, 64, 65]]])  # one token: 4 experts of group 0, 2 of groups 1 and 2
    assert busiest_per_sample(ids, 256, 8, "contiguous").tolist() == [4.0]
    assert busiest_per_sample(ids, 256, 8, "interleaved").tolist() == [3.0]  # ranks 0, 1: 0 32 64 / 1 33 65
    assert busiest_per_sample(ids, 256, 8, "split").tolist() == [1.0]  # 8 experts, 1/8 of each per rank


def test_projection_overhead_headline_al_and_collective_estimate(tmp_path):
    res = _tp_result()
    base = argparse.Namespace(collective_json=None, allreduce_us=10.0, accept=[0.8], al=None, k=2, tp=8)
    plain = rm.project(res, base)["contexts"][1024]
    args = argparse.Namespace(**vars(base), real_overhead=1.25, headline_al=[2.8, 2.96])
    got = rm.project(res, args)["contexts"][1024]
    assert got["plain"]["tpot_ms"] == pytest.approx(1.25 * plain["plain"]["tpot_ms"])
    e2 = got["eagle_k2"]
    assert e2["step_ms"] == pytest.approx(1.25 * plain["eagle_k2"]["step_ms"])
    assert e2["at_AL"][2.8]["tok_s_per_user"] == pytest.approx(1e3 * 2.8 / e2["step_ms"])
    assert "at_AL" not in got["eagle_k1"]
    f = tmp_path / "coll.json"
    f.write_text('{"device": "H200", "world": 2, "ops": {"all_reduce": [{"bytes": 65536, "us": 12.0}], '
                 '"all_gather": [{"bytes": 65536, "us": 14.0}]}}')
    lat = rm.collective_latency(argparse.Namespace(collective_json=str(f), tp=8, collective_growth=1.5))
    assert lat["scale"] == pytest.approx(1.5 ** 2) and "8-GPU ESTIMATE" in lat["source"] and "ASSUMED" in lat["source"]
    assert rm.latency_us(lat, "all_reduce", 1000) == pytest.approx(12.0 * 2.25)


def test_startup_configs_name_the_fast_path_glue():
    """mtp.bench.startup times the fast path with each glue (the Triton kernels being the default) beside the
    reference."""
    from mtp.bench.startup import CONFIGS, ELEMENTWISE
    from mtp.kernels.dispatch import ELEMENTWISE_IMPLS

    assert set(CONFIGS) == {"reference", *ELEMENTWISE} and ELEMENTWISE["fast"] == "triton"
    assert sorted(ELEMENTWISE.values()) == sorted(ELEMENTWISE_IMPLS)


def test_projection_prices_all_reduces_from_the_allreduce_file(tmp_path):
    """An mtp.bench.allreduce file (4 GPUs) for TP=8: nccl rows, or under --allreduce oneshot the block boundaries
    at the fused kernel less the add + norm + quant the simulated step already ran, the embedding's plain; the
    all-gather has no row there and keeps the assumed --allreduce-us, said so."""
    from tests.plan.test_collectives import allreduce_json

    f = allreduce_json(tmp_path)
    res = _tp_result()  # 123 all-reduces of 28672 B (w = 1 fp32: nccl 15, oneshot 16, fused 13, norm 19 - 15) + 1 AG
    base = dict(collective_json=f, allreduce_us=10.0, accept=[0.8], al=None, k=2, tp=8, collective_growth=1.5)
    got = {}
    for impl in ("nccl", "oneshot"):
        args = argparse.Namespace(**base, allreduce=impl)
        lat = rm.collective_latency(args)
        assert "4 x NVIDIA H100" in lat["source"] and f in lat["source"] and "8-GPU ESTIMATE" in lat["source"]
        assert "all-gather ASSUMED 10.0 us" in lat["source"]
        pj = rm.project(res, args)
        json.dumps(pj["collective_latency"])  # the result JSON holds it
        got[impl] = pj["contexts"][1024]
    s, norm = 1.5, 19.0 - 15.0
    assert got["nccl"]["plain"]["collectives_ms"] == pytest.approx((123 * 15.0 * s + 10.0) * 1e-3)
    one = (122 * (13.0 * s - norm) + 16.0 * s + 10.0) * 1e-3  # 122 block boundaries, the embedding's plain
    assert got["oneshot"]["plain"]["collectives_ms"] == pytest.approx(one)
    assert got["oneshot"]["plain"]["tpot_ms"] - got["nccl"]["plain"]["tpot_ms"] == pytest.approx(
        one - (123 * 15.0 * s + 10.0) * 1e-3)
    # eagle k=1: + one draft forward of 3 all-reduces (o_proj's fused; the embedding's and the FFN's plain) + 1 AG
    d1 = {"nccl": (3 * 15.0 * s + 10.0) * 1e-3, "oneshot": (13.0 * s - norm + 2 * 16.0 * s + 10.0) * 1e-3}
    for impl in d1:  # the fixture's verify at w = 2 counts the same 123 all-reduces of 28672 B as w = 1
        assert got[impl]["eagle_k1"]["collectives_ms"] == pytest.approx(got[impl]["plain"]["collectives_ms"] + d1[impl])


def test_parse_args_reads_the_collective_json(tmp_path, capsys):
    from tests.plan.test_collectives import allreduce_json, collectives_json

    a = bench.parse_args(["--tp", "8", "--collective-json", allreduce_json(tmp_path), "--allreduce", "oneshot"])
    assert a.allreduce == "oneshot" and a.collective_growth == 1.45
    for bad, why in ((["--allreduce", "oneshot"], "needs --collective-json"),
                     (["--collective-json", collectives_json(tmp_path), "--allreduce", "oneshot"], "'oneshot'"),
                     (["--collective-json", str(tmp_path / "nope.json")], "nope.json")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--tp", "8", *bad])
        assert why in capsys.readouterr().err
