"""The measured collectives reader (`mtp.plan.collectives`): both writers' JSON formats, the nearest size at or
above, the growth label, the nccl / oneshot pricing counted by hand, and errors that name the file and the field;
then `mtp-plan --speed --collectives` taking it for the decode forwards' all-reduces."""

import json

import pytest

from mtp.bench.allreduce import HIDDEN, VARIANTS
from mtp.model.config import ModelConfig
from mtp.plan.cli import main
from mtp.plan.collectives import MeasuredComm, growth_scale, read
from mtp.plan.cost import Layout, Shape, draft_terms, forward_terms
from mtp.plan.hardware import GPUS
from mtp.plan.speed import Efficiency, Workload, predict

# us per call by (variant, dtype): w = 1, 2 (bytes = w x HIDDEN x itemsize), as mtp.bench.allreduce writes them
US = {("nccl", "float32"): (15.0, 14.0), ("nccl+norm", "float32"): (19.0, 18.5),
      ("torch_oneshot", "float32"): (16.0, 16.5), ("oneshot", "float32"): (16.0, 16.2),
      ("oneshot+norm", "float32"): (20.0, 20.1), ("oneshot_fused", "float32"): (13.0, 14.0),
      ("nccl", "bfloat16"): (13.0, 15.0), ("oneshot", "bfloat16"): (9.0, 8.0),
      ("oneshot_fused", "bfloat16"): (9.5, 9.7)}


def allreduce_json(tmp_path, world=4, drop=()):
    """A file in mtp.bench.allreduce's format (its keys, variant names and message sizes), one variant failed."""
    rows = []
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        for i, w in enumerate((1, 2)):
            for v in VARIANTS:
                row = {"variant": v, "w": w, "dtype": dtype, "bytes": w * HIDDEN * size}
                if (v, dtype) in US and v not in drop:
                    rows.append(dict(row, us=US[v, dtype][i], status="ok"))
                else:
                    rows.append(dict(row, status="error", error="RuntimeError: failed on another rank"))
    d = {"device": "NVIDIA H100 80GB HBM3", "world": world, "torch": "2.11", "nccl": "2.28.9", "date": "x",
         "inner": 50, "iters": 30, "env": {}, "setup": "ok", "rows": rows}
    p = tmp_path / "ar.json"
    p.write_text(json.dumps(d))
    return str(p)


def collectives_json(tmp_path, world=8):
    """mtp.bench.collectives' format: fp32 and bf16 all-reduces, fp32 logits all-gathered."""
    ar = [{"bytes": w * HIDDEN * s, "shape": [1, w, HIDDEN], "dtype": dt, "us": us}
          for w, us in ((1, 10.0), (2, 11.0)) for dt, s in (("float32", 4), ("bfloat16", 2))]
    ar[1]["us"] = ar[3]["us"] = 99.0  # the bf16 rows: never read for a float32 table
    ag = [{"bytes": w * 16160 * 4, "shape": [1, w, 16160], "dtype": "float32", "us": 12.0 + w} for w in (1, 2)]
    p = tmp_path / "coll.json"
    p.write_text(json.dumps({"device": "NVIDIA H200", "world": world, "torch": "x", "nccl": "x", "date": "x",
                             "inner": 50, "ops": {"all_reduce": ar, "all_gather": ag}}))
    return str(p)


def test_reads_the_allreduce_file_per_dtype_and_variant(tmp_path):
    t = read(allreduce_json(tmp_path))
    assert (t.tool, t.device, t.world, t.dtype) == ("mtp.bench.allreduce", "NVIDIA H100 80GB HBM3", 4, "float32")
    assert t.rows["all_reduce"]["nccl"] == ((HIDDEN * 4, 15.0), (2 * HIDDEN * 4, 14.0))
    assert t.rows["all_reduce"]["oneshot+norm"][0] == (HIDDEN * 4, 20.0)
    assert not t.has("all_gather", "nccl")
    b = read(allreduce_json(tmp_path), dtype="bfloat16")
    assert b.us("all_reduce", "oneshot", HIDDEN * 2) == 9.0
    assert not b.has("all_reduce", "nccl+norm") and not b.has("all_reduce", "torch_oneshot")  # failed rows


def test_reads_the_collectives_file(tmp_path):
    t = read(collectives_json(tmp_path))
    assert (t.tool, t.world, t.device) == ("mtp.bench.collectives", 8, "NVIDIA H200")
    assert t.rows["all_reduce"]["nccl"] == ((HIDDEN * 4, 10.0), (2 * HIDDEN * 4, 11.0))  # the bf16 rows left out
    assert t.us("all_gather", "nccl", 16160 * 4) == 13.0


def test_nearest_size_at_or_above_and_past_the_table(tmp_path):
    t = read(allreduce_json(tmp_path))
    assert t.us("all_reduce", "nccl", 1) == 15.0
    assert t.us("all_reduce", "nccl", HIDDEN * 4) == 15.0
    assert t.us("all_reduce", "nccl", HIDDEN * 4 + 1) == 14.0
    assert t.us("all_reduce", "nccl", 4 * HIDDEN * 4) == pytest.approx(28.0)  # twice the largest: scaled by bytes


def test_growth_scale_and_its_label(tmp_path):
    t = read(allreduce_json(tmp_path))
    m = MeasuredComm(t, 8, "nccl", 1.45)
    assert m.scale == pytest.approx(1.45) and growth_scale(2, 8, 1.5) == pytest.approx(2.25)
    assert growth_scale(8, 4, 1.45) == 1.0 and MeasuredComm(t, 4, growth=1.45).scale == 1.0
    d = m.describe()
    assert "4 x NVIDIA H100" in d and t.path in d and "8-GPU ESTIMATE = measured x 1.45" in d
    assert "ASSUMED x1.45 per doubling" in d and "all-gather: NCCL" in d
    assert "ESTIMATE" not in MeasuredComm(t, 4).describe()
    assert m.all_reduce_us(HIDDEN * 4) == pytest.approx(15.0 * 1.45)


def test_oneshot_against_nccl_by_hand(tmp_path):
    t = read(allreduce_json(tmp_path))
    b = HIDDEN * 4
    norm = 19.0 - 15.0  # nccl+norm - nccl: the add + norm + quant kernel alone
    nccl, one = MeasuredComm(t, 8, "nccl", 1.5), MeasuredComm(t, 8, "oneshot", 1.5)
    # mtp-bench (held = the measured kernel, which the simulated step already ran): nccl is the all-reduce alone
    assert nccl.all_reduce_us(b, fused=True) == pytest.approx(15.0 * 1.5) == nccl.all_reduce_us(b)
    assert one.all_reduce_us(b, fused=True) == pytest.approx(13.0 * 1.5 - norm)
    assert one.all_reduce_us(b) == pytest.approx(16.0 * 1.5)
    # mtp-plan (held = the model's charge for that launch): the kernel is added to nccl's block boundaries
    n2, o2 = MeasuredComm(t, 8, "nccl", 1.5, held_us=1.0), MeasuredComm(t, 8, "oneshot", 1.5, held_us=1.0)
    assert n2.all_reduce_us(b, fused=True) == pytest.approx(15.0 * 1.5 + norm - 1.0)
    assert o2.all_reduce_us(b, fused=True) == pytest.approx(13.0 * 1.5 - 1.0)
    c = read(collectives_json(tmp_path))  # no norm rows: nccl's block boundary is its all-reduce
    assert MeasuredComm(c, 8, held_us=1.0).all_reduce_us(b, fused=True) == 10.0


@pytest.mark.parametrize("content, bad", [
    ("not json", "cannot read"), ("[1]", "JSON object"), ('{"device": "x", "world": 4}', "missing field 'ops'"),
    ('{"world": 4, "rows": [{"variant": "nccl", "dtype": "float32", "bytes": 8, "us": 1.0, "status": "ok"}]}',
     "missing field 'device'"),
    ('{"device": "H100", "rows": [{"variant": "nccl", "dtype": "float32", "bytes": 8, "us": 1.0, "status": "ok"}]}',
     "missing field 'world'"),
    ('{"device": "H100", "world": 4, "rows": [{"variant": "nccl", "dtype": "float32", "bytes": 8, "status": "ok"}]}',
     r"missing field rows\[0\].'us'"),
    ('{"device": "H100", "world": 4, "rows": [{"variant": "nccl", "dtype": "float32", "bytes": 8, "us": -1, '
     '"status": "ok"}]}', r"rows\[0\].us = -1"),
    ('{"device": "H100", "world": 4, "rows": [{"variant": "nccl", "dtype": "bfloat16", "bytes": 8, "us": 1, '
     '"status": "ok"}]}', "no all_reduce row of dtype 'float32'"),
    ('{"device": "H100", "world": 1, "ops": {"all_reduce": [{"bytes": 8, "us": 1}]}}', "'world' = 1"),
    ('{"device": "H100", "world": 4, "ops": {"all_reduce": [{"us": 1}]}}', r"ops.all_reduce\[0\].'bytes'"),
    ('{"device": "H100", "world": 4, "ops": []}', "'ops' must be an object"),
])
def test_malformed_files_name_file_and_field(tmp_path, content, bad):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(ValueError, match=bad) as e:
        read(str(p))
    assert str(p) in str(e.value)


def test_oneshot_needs_its_rows(tmp_path):
    with pytest.raises(ValueError, match="no all_reduce rows of 'oneshot'") as e:
        MeasuredComm(read(collectives_json(tmp_path)), 8, "oneshot")
    assert "coll.json" in str(e.value)
    with pytest.raises(ValueError, match="oneshot_fused"):
        MeasuredComm(read(allreduce_json(tmp_path, drop=("oneshot_fused",))), 8, "oneshot")
    with pytest.raises(ValueError, match="--allreduce"):
        MeasuredComm(read(allreduce_json(tmp_path)), 8, "ring")


def test_speed_model_prices_the_decode_all_reduces_from_the_table(tmp_path):
    """TP=8 batch 1, k = 1: the verify forward (w = 2) has 2 x 61 block all-reduces (fused under oneshot) and the
    embedding's; the draft forward (w = 1) o_proj's fused, the embedding's and its FFN's plain; the all-gathers keep
    the link formula."""
    cfg, g, lay = ModelConfig(), GPUS["h200"], Layout(8, 8)
    wl = Workload(batch=1, k=1, al=1.5)
    t = read(allreduce_json(tmp_path))
    formula = predict(cfg, g, lay, wl)
    gathers = sum(g.allreduce_us(c.nbytes, 8) / 2 * c.count * x.layers * 1e-3
                  for terms in (forward_terms(cfg, lay, Shape(1, 2, 1026)), draft_terms(cfg, lay, Shape(1, 1, 1025)))
                  for x in terms for c in x.comm if c.op == "all_gather")
    s = 1.45
    verify_ar = {"nccl": 122 * 14.0 * s + 15.0 * s,  # w = 2 fp32: 57344 B; the bf16 embedding's 28672 B
                 "oneshot": 122 * (14.0 * s - 0.0) + 16.0 * s}
    draft_ar = {"nccl": 3 * 15.0 * s, "oneshot": 13.0 * s + 2 * 16.0 * s}
    got = {}
    for impl in ("nccl", "oneshot"):
        m = MeasuredComm(t, 8, impl, s, held_us=0.0)
        r = predict(cfg, g, lay, wl, Efficiency(), m)
        extra = 122 * (18.5 - 14.0) + (19.0 - 15.0) if impl == "nccl" else 0.0  # + the norm kernel (roofline: 0)
        want = (verify_ar[impl] + draft_ar[impl] + extra) * 1e-3 + gathers
        assert r.verify.comm_ms + r.draft.comm_ms == pytest.approx(want)
        assert r.prefill.comm_ms == formula.prefill.comm_ms  # prefill: the formula (tables stop at 8 tokens)
        assert any("measured on 4 x NVIDIA H100" in n and "8-GPU estimate (ASSUMED growth x1.45" in n
                   and "the link formula's" in n for n in r.notes)
        got[impl] = r.step_ms
    assert got["oneshot"] - got["nccl"] == pytest.approx(
        (verify_ar["oneshot"] - verify_ar["nccl"] + draft_ar["oneshot"] - draft_ar["nccl"]
         - 122 * (18.5 - 14.0) - (19.0 - 15.0)) * 1e-3)


def test_cli_collectives_and_allreduce(tmp_path, capsys):
    f = allreduce_json(tmp_path)
    base = ["--speed", "--gpu", "h200", "--tp", "8", "--k", "1", "--al", "1.5", "--collectives", f]
    assert main(base + ["--allreduce", "oneshot"]) == 0
    out = capsys.readouterr().out
    assert "all-reduce measured on 4 x NVIDIA H100 80GB HBM3" in out and "--allreduce oneshot" in out
    assert "(not used) the table's all-reduce over NVLink4" in out
    with pytest.raises(SystemExit) as e:
        main(["--speed", "--allreduce", "oneshot"])
    assert e.value.code == 2 and "needs --collectives" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(base[:-1] + [str(tmp_path / "nope.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--collectives" in err and "nope.json" in err


def test_calibrate_says_which_collectives_file_it_used(tmp_path, capsys):
    cal = ["--speed", "--gpu", "h200", "--tp", "8", "--calibrate", "eval/results/s9/h200/bench_tp8_batch.json"]
    f = allreduce_json(tmp_path)
    assert main(cal + ["--collectives", f, "--allreduce", "nccl"]) == 0
    assert f"collectives: communication from {f} (--collectives, --allreduce nccl)" in capsys.readouterr().out
