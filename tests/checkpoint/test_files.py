"""Checkpoint I/O: round trip in the real layout, every corruption refused by name, streaming memory."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mtp.checkpoint.files import INDEX_NAME, CheckpointError, load_model, save_checkpoint, state_for_checkpoint
from mtp.model.config import ConfigError
from mtp.checkpoint.inventory import checkpoint_spec
from mtp.checkpoint.random_weights import random_tensors
from mtp.model.presets import tiny_config

REPO = Path(__file__).resolve().parents[2]
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(cfg, tensors as written, checkpoint dir): 3 layers (1 dense), 1 MTP module, 3 shards."""
    cfg = tiny_config()
    tensors = random_tensors(cfg, seed=1)
    path = save_checkpoint(tensors, cfg, tmp_path_factory.mktemp("ckpt") / "base", n_shards=3)
    return cfg, tensors, path


@pytest.fixture
def ckpt(written, tmp_path):
    """A private copy of the base checkpoint, free to corrupt."""
    return Path(shutil.copytree(written[2], tmp_path / "ckpt"))


def _index(path: Path) -> dict:
    return json.loads((path / INDEX_NAME).read_text())


def _shard_of(path: Path, name: str) -> Path:
    return path / _index(path)["weight_map"][name]


def _rewrite_shard(path: Path, name: str, edit) -> Path:
    """Rewrite the shard holding `name` with edit(dict of its tensors) applied; return the shard path."""
    shard = _shard_of(path, name)
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard


def _set_index(path: Path, edit) -> None:
    index = _index(path)
    edit(index["weight_map"])
    (path / INDEX_NAME).write_text(json.dumps(index))


def _load_fails(path: Path, *must_name: str, exc=CheckpointError, **kwargs) -> str:
    """load_model raises `exc` whose message contains every string of `must_name`; no model comes back."""
    model = None
    with pytest.raises(exc) as ei:
        model = load_model(path, **kwargs)
    assert model is None
    msg = str(ei.value)
    for s in must_name:
        assert s in msg, f"{s!r} not in error message: {msg}"
    return msg


# ------------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_values(written, dtype):
    cfg, tensors, path = written
    model = load_model(path, dtype=dtype)
    assert model.n_mtp == 1 and not model.training
    got = state_for_checkpoint(model)
    assert set(got) == set(tensors)
    spec = checkpoint_spec(cfg)
    for name, want in tensors.items():
        g = got[name]
        kind = spec[name].kind
        if kind == "fp8":
            assert g.dtype == FP8, name
            assert torch.equal(g.view(torch.uint8), want.view(torch.uint8)), f"fp8 bytes differ: {name}"
        elif kind in ("scale", "fp32"):
            assert g.dtype == torch.float32 and torch.equal(g, want), name
        elif kind == "norm":  # the indexer's LayerNorm stays fp32 whatever the model dtype
            assert g.dtype == torch.float32 and torch.equal(g, want.float()), name
        else:  # bf16 on disk, cast to the model dtype (exact: bf16 -> bf16 / fp32)
            assert g.dtype == dtype and torch.equal(g, want.to(dtype)), name


def test_round_trip_layout_on_disk(written):
    cfg, tensors, path = written
    index = _index(path)
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    assert len(shards) >= 2
    assert sorted(p.name for p in path.glob("*.safetensors")) == shards
    assert all(s.startswith("model-") and s.endswith(f"-of-{len(shards):06d}.safetensors") for s in shards)
    assert set(wm) == set(checkpoint_spec(cfg))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())

    on_disk = {}  # name -> (dtype string, shape), straight from the shard headers
    data_bytes = 0
    for s in shards:
        with safe_open(str(path / s), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                on_disk[k] = (sl.get_dtype(), tuple(sl.get_shape()))
                data_bytes += math.prod(sl.get_shape()) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[sl.get_dtype()]
                assert wm[k] == s, f"{k} is in {s}, the index says {wm[k]}"
    assert data_bytes == index["metadata"]["total_size"]

    for name, ts in checkpoint_spec(cfg).items():
        dt, shape = on_disk[name]
        assert shape == ts.shape, name
        if ts.kind == "fp8":
            assert dt == "F8_E4M3", name
            scale = tensors[name + "_scale_inv"]
            assert on_disk[name + "_scale_inv"][0] == "F32"
            assert bool((scale > 0).all()), name
            mantissa, _ = torch.frexp(scale)
            assert bool((mantissa == 0.5).all()), f"{name}_scale_inv is not a power of two (ue8m0)"
        elif ts.kind == "bf16":
            assert dt == "BF16", name

    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    m = f"model.layers.{L}"
    assert on_disk[f"{m}.enorm.weight"] == ("BF16", (D,))
    assert on_disk[f"{m}.hnorm.weight"] == ("BF16", (D,))
    assert on_disk[f"{m}.eh_proj.weight"] == ("BF16", (D, 2 * D))
    assert f"{m}.eh_proj.weight_scale_inv" not in on_disk
    assert on_disk[f"{m}.shared_head.norm.weight"] == ("BF16", (D,))
    assert on_disk[f"{m}.shared_head.head.weight"] == ("BF16", (V, D))
    assert on_disk[f"{m}.embed_tokens.weight"] == ("BF16", (V, D))
    assert on_disk[f"{m}.self_attn.q_a_proj.weight"][0] == "F8_E4M3"  # a full decoder block, FP8 like the trunk
    assert f"{m}.mlp.experts.0.down_proj.weight" in on_disk  # MoE
    assert f"model.layers.{L + 1}.enorm.weight" not in on_disk
    assert torch.equal(tensors[f"{m}.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(tensors[f"{m}.shared_head.head.weight"], tensors["lm_head.weight"])

    cfg_on_disk = json.loads((path / "config.json").read_text())
    assert cfg_on_disk["model_type"] == "deepseek_v32"
    assert cfg_on_disk["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg_on_disk["quantization_config"]["scale_fmt"] == "ue8m0"


def test_written_checkpoint_is_readable_by_others(written):
    path = written[2]
    assert path.stat().st_mode & 0o055 == 0o055, oct(path.stat().st_mode)
    for f in path.iterdir():
        assert f.stat().st_mode & 0o044 == 0o044, f"{f.name} {oct(f.stat().st_mode)}"


def test_save_creates_missing_parents_and_replaces(written, tmp_path):
    cfg, tensors, _ = written
    out = save_checkpoint(tensors, cfg, tmp_path / "a" / "b" / "ckpt")
    assert (out / INDEX_NAME).is_file()
    save_checkpoint(tensors, cfg, out, n_shards=4)  # overwrite in place
    assert len(set(_index(out)["weight_map"].values())) == 4
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["ckpt"]  # no temp dir left behind


def test_save_refuses_tensors_off_layout(written, tmp_path):
    cfg, tensors, _ = written
    bad = dict(tensors)
    del bad["model.norm.weight"]
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        save_checkpoint(bad, cfg, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def _mapped_files() -> list[tuple[int, int, str]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(".safetensors"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[5]))
    return out


def test_loaded_model_owns_its_memory(ckpt):
    """A CPU model must not alias the shard files: safetensors hands out views of a private mmap, and a model
    built from those dies of SIGBUS once a shard is rewritten in place (checked here without crashing first)."""
    model = load_model(ckpt, dtype=torch.float32)
    maps = [m for m in _mapped_files() if m[2].startswith(str(ckpt))]
    aliased = [n for n, p in model.named_parameters()
               if any(lo <= p.data_ptr() < hi for lo, hi, _ in maps)]
    assert not aliased, f"{len(aliased)} parameters are views of a shard file, e.g. {aliased[:3]}"
    before = {k: v.clone() for k, v in state_for_checkpoint(model).items()}
    for shard in ckpt.glob("*.safetensors"):
        os.truncate(shard, 0)
    after = state_for_checkpoint(model)
    assert all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in before)


# ------------------------------------------------------------------------------------------ bad input
def test_missing_tensor(ckpt):
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    _rewrite_shard(ckpt, name, lambda t: t.pop(name))
    _set_index(ckpt, lambda wm: wm.pop(name))
    _load_fails(ckpt, str(ckpt), name, "missing")


def test_unexpected_tensor(ckpt):
    name = "model.layers.1.self_attn.o_proj.bias"
    shard = _rewrite_shard(ckpt, "model.layers.1.self_attn.o_proj.weight",
                           lambda t: t.__setitem__(name, torch.zeros(256, dtype=torch.bfloat16)))
    _set_index(ckpt, lambda wm: wm.__setitem__(name, shard.name))
    _load_fails(ckpt, str(ckpt), name, shard.name)


def test_wrong_shape(ckpt):
    name = "model.layers.2.mlp.experts.3.down_proj.weight"  # [256, 128]
    shard = _rewrite_shard(ckpt, name, lambda t: t.__setitem__(name, torch.zeros(256, 256).to(FP8)))
    _load_fails(ckpt, str(shard), name, "[256, 256]", "[256, 128]")


def test_wrong_dtype_fp8_weight_saved_as_bf16(ckpt):
    name = "model.layers.0.mlp.gate_proj.weight"
    shard = _rewrite_shard(ckpt, name, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    _load_fails(ckpt, str(shard), name, "bfloat16", "float8_e4m3fn")


def test_wrong_dtype_scale_saved_as_bf16(ckpt):
    name = "model.layers.0.mlp.gate_proj.weight_scale_inv"
    shard = _rewrite_shard(ckpt, name, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    _load_fails(ckpt, str(shard), name, "bfloat16", "float32")


def test_shard_named_in_index_but_absent(ckpt):
    shard = _shard_of(ckpt, "lm_head.weight")
    shard.unlink()
    _load_fails(ckpt, str(shard), "does not exist", "model.")


def _header(shard: Path) -> tuple[int, dict]:
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8:8 + n])


def test_truncated_shard(ckpt):
    shard = _shard_of(ckpt, "lm_head.weight")
    size = shard.stat().st_size
    os.truncate(shard, size - 1000)
    n, header = _header(shard)
    cut = [k for k, v in header.items() if k != "__metadata__" and 8 + n + v["data_offsets"][1] > size - 1000]
    assert cut
    msg = _load_fails(ckpt, str(shard), "truncated")
    assert any(repr(k) in msg for k in cut), msg


def test_shard_shorter_than_its_header(ckpt):
    shard = _shard_of(ckpt, "lm_head.weight")
    os.truncate(shard, 100)
    _load_fails(ckpt, str(shard))
    os.truncate(shard, 3)
    _load_fails(ckpt, str(shard), "truncated")


def test_corrupt_header_length(ckpt):
    shard = _shard_of(ckpt, "model.embed_tokens.weight")
    with open(shard, "r+b") as f:
        f.write(b"\xff" * 8)
    _load_fails(ckpt, str(shard), "header")


def test_corrupt_header_json(ckpt):
    shard = _shard_of(ckpt, "model.embed_tokens.weight")
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b"#garbage#")
    _load_fails(ckpt, str(shard), "corrupt")


def test_index_names_tensor_the_shard_lacks(ckpt):
    name = "model.layers.2.self_attn.indexer.k_norm.bias"
    shard = _rewrite_shard(ckpt, name, lambda t: t.pop(name))
    _load_fails(ckpt, str(shard), name, "index")


def test_index_points_to_wrong_shard(ckpt):
    name = "model.norm.weight"
    wrong = next(s for s in sorted(set(_index(ckpt)["weight_map"].values())) if s != _shard_of(ckpt, name).name)
    _set_index(ckpt, lambda wm: wm.__setitem__(name, wrong))
    _load_fails(ckpt, wrong, name)


@pytest.mark.parametrize("field, value, must_name", [
    ("hidden_size", 384, ["model.embed_tokens.weight", "[512, 256]", "[512, 384]", "config.json"]),
    ("vocab_size", 600, ["model.embed_tokens.weight", "[512, 256]", "[600, 256]"]),
    ("num_hidden_layers", 2, ["model.layers.2.enorm.weight", "num_hidden_layers=2"]),
    ("num_hidden_layers", 4, ["model.layers.4.", "num_hidden_layers=4"]),
    ("num_nextn_predict_layers", 2, ["model.layers.4.", "num_nextn_predict_layers=2"]),
    ("first_k_dense_replace", 2, ["model.layers.1.mlp"]),
])
def test_config_disagrees_with_tensors(ckpt, field, value, must_name):
    raw = json.loads((ckpt / "config.json").read_text())
    raw[field] = value
    (ckpt / "config.json").write_text(json.dumps(raw))
    _load_fails(ckpt, str(ckpt), *must_name)


def test_huge_layer_count_is_compared_with_the_index_first(ckpt):
    """num_hidden_layers: 1e9 used to build a billion-layer tensor list (15 GB, then the OOM killer)."""
    raw = json.loads((ckpt / "config.json").read_text())
    raw["num_hidden_layers"] = 1e9
    (ckpt / "config.json").write_text(json.dumps(raw))
    _load_fails(ckpt, str(ckpt), "1000000001 layers", "num_hidden_layers=1000000000", "holds 4")


def test_tensor_listed_twice_in_the_index(ckpt):
    """json keeps the last of repeated keys: the index's second entry for a tensor won silently."""
    text = (ckpt / INDEX_NAME).read_text()
    name = "model.norm.weight"
    other = next(s for s in sorted(set(_index(ckpt)["weight_map"].values())) if s != _shard_of(ckpt, name).name)
    (ckpt / INDEX_NAME).write_text(text.replace('"weight_map": {', f'"weight_map": {{"{name}": "{other}", ', 1))
    _load_fails(ckpt, str(ckpt / INDEX_NAME), repr(name), "2 times", other)


def test_tensor_in_two_shards(ckpt):
    """A shard holding a tensor the index places in another shard: two copies, refused."""
    name = "model.norm.weight"
    home = _shard_of(ckpt, name)
    other = next(ckpt / s for s in sorted(set(_index(ckpt)["weight_map"].values())) if s != home.name)
    tensors = load_file(str(other))
    tensors[name] = load_file(str(home))[name]
    save_file(tensors, str(other), metadata={"format": "pt"})
    _load_fails(ckpt, str(other), repr(name), home.name, "one shard")


@pytest.mark.parametrize("where", ["../outside.safetensors", "/abs/model.safetensors", "sub/../../x.safetensors"])
def test_weight_map_path_must_stay_inside(ckpt, where):
    """A '../' or absolute shard name used to load tensors from outside the checkpoint folder."""
    name = "model.norm.weight"
    _set_index(ckpt, lambda wm: wm.__setitem__(name, where))
    _load_fails(ckpt, str(ckpt / INDEX_NAME), name, repr(where), "inside the checkpoint folder")


def test_load_model_on_a_file_says_it_is_a_file(ckpt):
    _load_fails(ckpt / "config.json", str(ckpt / "config.json"), "is a file, not a checkpoint directory")


def test_unsupported_config_value(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["quantization_config"]["weight_block_size"] = [64, 64]
    (ckpt / "config.json").write_text(json.dumps(raw))
    _load_fails(ckpt, str(ckpt / "config.json"), "weight_block_size", "[64, 64]", exc=ConfigError)


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    _load_fails(ckpt, str(ckpt / "config.json"), exc=ConfigError)


def test_missing_directory(tmp_path):
    _load_fails(tmp_path / "nope", str(tmp_path / "nope"), "does not exist")


@pytest.mark.parametrize("text, must_name", [
    ('{"metadata": {}, "weight_map": {', "not valid JSON"),
    ('{"metadata": {}}', "weight_map"),
    ('{"weight_map": {"model.norm.weight": 3}}', "model.norm.weight"),
])
def test_invalid_index(ckpt, text, must_name):
    (ckpt / INDEX_NAME).write_text(text)
    _load_fails(ckpt, str(ckpt / INDEX_NAME), must_name)


def test_no_index_and_no_single_file(ckpt):
    (ckpt / INDEX_NAME).unlink()
    _load_fails(ckpt, str(ckpt), INDEX_NAME)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_non_positive_or_non_finite_scale(ckpt, bad):
    name = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"

    def poison(t):
        t[name] = t[name].clone()
        t[name][0, 0] = bad

    shard = _rewrite_shard(ckpt, name, poison)
    _load_fails(ckpt, str(shard), name, "scale")


def test_single_file_layout(written, tmp_path):
    """HF also ships small models as one `model.safetensors` without an index."""
    cfg, tensors, _ = written
    out = tmp_path / "single"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert load_model(out).n_mtp == 1
    os.truncate(out / "model.safetensors", (out / "model.safetensors").stat().st_size - 10)
    _load_fails(out, str(out / "model.safetensors"), "truncated")


# ------------------------------------------------------------------------------------------ n_mtp
def test_n_mtp_zero_skips_mtp_layers(written):
    cfg, tensors, path = written
    model = load_model(path, n_mtp=0)
    assert model.n_mtp == 0
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith("mtp.") for n in names)
    assert len(names) == sum(1 for k in tensors if not k.startswith(f"model.layers.{cfg.num_hidden_layers}."))


@pytest.mark.parametrize("n", [2, -1])
def test_n_mtp_out_of_range(written, n):
    _load_fails(written[2], f"n_mtp={n}", "1 MTP layer", exc=ConfigError, n_mtp=n)


# ------------------------------------------------------------------------------------------ memory
# Peak RSS comes from VmHWM, not getrusage: ru_maxrss survives execve, so a child started from pytest would
# report pytest's own peak (measured: 520 MiB in a child that never went above 8). Writing "5" to clear_refs
# resets VmHWM after the warm-up, so the peak covers load_model alone.
_MEASURE = textwrap.dedent("""
    import gc, json, sys, time
    import torch
    from mtp.checkpoint.files import load_model
    from mtp.model.config import ModelConfig
    from mtp.model.deepseek import DeepseekV32

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

    path = sys.argv[1]
    r_start = status("VmRSS")
    # Warm-up: the first meta-device model build imports what it first uses (it imported torch._dynamo, ~80 MB,
    # before the embeddings stopped running their random init on meta); independent of the size.
    with torch.device("meta"):
        DeepseekV32(ModelConfig.from_json(path + "/config.json"))
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False  # then VmHWM includes the warm-up: an over-estimate, never an under-estimate
    r_warm = status("VmRSS")
    t0 = time.perf_counter()
    model = load_model(path, device="cpu", dtype=torch.float32)
    load_s = time.perf_counter() - t0
    p_end, r_end = status("VmHWM"), status("VmRSS")
    params = list(model.parameters())
    print(json.dumps(dict(
        start=r_start, warm=r_warm, peak=p_end, end=r_end, load_s=load_s, hwm_reset=reset,
        model_bytes=sum(p.numel() * p.element_size() for p in params),
        largest=max(p.numel() * p.element_size() for p in params))))
""")


@pytest.mark.slow
def test_streaming_load_peak_memory(tmp_path):
    """Peak RSS while loading ~86 MB to CPU stays near the model's own size: no second full copy.

    Values are random (not quantized): memory does not depend on them and this keeps the test fast.
    4 shards: a shard's pages are file-backed RSS while it is read (the real checkpoint has 163 shards).
    """
    cfg = dataclasses.replace(tiny_config(layers=6, dense_layers=1, mtp_modules=1, vocab=4096),
                              n_routed_experts=32, moe_intermediate_size=512)
    cfg.validate("memory-test config")
    tensors = _fast_tensors(cfg)
    ckpt_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    path = save_checkpoint(tensors, cfg, tmp_path / "big", n_shards=4)
    del tensors

    # One thread: with 2 OpenMP threads on a shared 2-core box the load took 13 s instead of 0.45 s (spin-waits).
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    MiB = 2 ** 20
    peak_inc = r["peak"] - r["warm"]
    overhead = peak_inc - r["model_bytes"]
    allowance = 2 * r["largest"] + 60 * MiB
    print(f"\n[memory] checkpoint {ckpt_bytes / MiB:.1f} MiB in 4 shards; model on CPU (fp32 + fp8) "
          f"{r['model_bytes'] / MiB:.1f} MiB, largest tensor {r['largest'] / MiB:.1f} MiB")
    print(f"[memory] peak RSS increase during load_model {peak_inc / MiB:.1f} MiB "
          f"(over model: {overhead / MiB:.1f} MiB, allowed {allowance / MiB:.1f} MiB); "
          f"one-time import warm-up {(r['warm'] - r['start']) / MiB:.1f} MiB; "
          f"resident after load +{(r['end'] - r['warm']) / MiB:.1f} MiB; load {r['load_s']:.2f} s; "
          f"VmHWM reset: {r['hwm_reset']}")
    # The measurement sees the model itself (it is not left lazily mapped)...
    assert r["end"] - r["warm"] > 0.9 * r["model_bytes"]
    # ...and nothing like a second copy of it on top.
    assert overhead < allowance, f"peak exceeds model + {allowance / MiB:.0f} MiB by {(overhead - allowance) / MiB:.1f} MiB"
    assert ckpt_bytes > allowance, "checkpoint too small for the bound to detect a second copy"


def _fast_tensors(cfg) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.full(ts.shape, 2.0 ** -8) if ts.kind == "scale"
            else (0.1 * torch.randn(ts.shape, generator=g)).to(ts.dtypes[0])
            for n, ts in checkpoint_spec(cfg).items()}


def _poison_fp8(path: Path, name: str, byte: int) -> Path:
    """Set one byte of fp8 weight `name` to `byte` (0x7F / 0xFF are e4m3fn's NaN encodings)."""
    def poison(t):
        u = t[name].view(torch.uint8).clone()
        u.view(-1)[u.numel() // 2 + 1] = byte
        t[name] = u.view(FP8)

    return _rewrite_shard(path, name, poison)


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_fp8_weight_with_nan_bytes(ckpt, byte):
    """e4m3fn has no infinities; 0x7F and 0xFF are NaN. Such a weight turns every logit into NaN and every
    argmax into token 0, which used to load and be reported as perfect acceptance."""
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    shard = _poison_fp8(ckpt, name, byte)
    _load_fails(ckpt, str(shard), name, "NaN")


def test_fp8_weight_with_nan_bytes_parallel_loader(ckpt):
    from mtp.parallel import Comm, load_parallel

    name = "model.layers.0.self_attn.kv_b_proj.weight"
    shard = _poison_fp8(ckpt, name, 0x7F)
    with pytest.raises(CheckpointError, match="NaN") as ei:
        load_parallel(ckpt, Comm(), numerics="fp8")
    assert str(shard) in str(ei.value) and name in str(ei.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_bf16_weight_not_finite(ckpt, bad):
    name = "model.layers.1.post_attention_layernorm.weight"

    def poison(t):
        t[name] = t[name].clone()
        t[name][3] = bad

    shard = _rewrite_shard(ckpt, name, poison)
    _load_fails(ckpt, str(shard), name, "non-finite")


def test_largest_finite_fp8_bytes_load(ckpt):
    """0x7E / 0xFE are +-448, the largest finite e4m3fn values: not NaN, they must load."""
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    _poison_fp8(ckpt, name, 0x7E)
    _poison_fp8(ckpt, name, 0xFE)
    load_model(ckpt)


def test_check_values_refuses_exactly_the_nan_encodings_of_e4m3fn():
    """All 256 bytes, each alone in a clean tensor: refused iff the float value it decodes to is NaN."""
    from mtp.checkpoint.files import check_values

    decoded = torch.arange(256).to(torch.uint8).view(FP8).float()
    for byte in range(256):
        t = torch.zeros(3, 5, dtype=torch.uint8)
        t[1, 2] = byte
        refused = False
        try:
            check_values(t.view(FP8), Path("f"), "w")
        except CheckpointError as e:
            refused = True
            assert "[1, 2]" in str(e), str(e)
        assert refused == bool(decoded[byte].isnan()), f"byte {byte:#04x}"


@pytest.mark.parametrize("bad", [2.0 ** 60, 2.0 ** 100, 2.0 ** -60])
def test_scale_outside_a_real_checkpoints_range(ckpt, bad):
    """A finite but absurd block scale (2^60 drove every logit to exactly 0) is refused at load, naming the
    file, the tensor, the index and the value."""
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"

    def poison(t):
        t[name] = t[name].clone()
        t[name].view(-1)[-1] = bad

    shard = _rewrite_shard(ckpt, name, poison)
    last = [n - 1 for n in load_file(str(shard))[name].shape]
    msg = _load_fails(ckpt, str(shard), name, f"index {last}", f"{bad:g}")
    assert f"2^{math.log2(bad):g}" in msg
