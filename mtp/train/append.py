"""Read one layer of a checkpoint, and write MTP layers into a checkpoint without rewriting its trunk.

`read_layer` streams only the named layer's tensors from the shards (FP8 weights dequantized), so building
a module from a 690 GB checkpoint reads a few GB. `write_mtp_layers` produces a new checkpoint folder:
the source shards are hard-linked (copied where links are impossible) and renumbered, a shard holding a
replaced layer is rewritten without it, the new layers go into new shards, and `config.json` changes only
in `num_nextn_predict_layers` (every other field of the source file is kept as is). The folder appears
atomically (temp dir + rename), as with `mtp.checkpoint.files.save_checkpoint`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..model import fp8
from ..checkpoint.files import INDEX_NAME, CheckpointError, weight_map
from ..model.config import ModelConfig
from ..utils import publish_dir

MAX_NEW_SHARD_BYTES = 4 * 2 ** 30


def read_layer(ckpt_dir: str | Path, layer_id: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """{name inside the layer: float tensor} of `model.layers.{layer_id}`, FP8 weights dequantized."""
    path = Path(ckpt_dir)
    prefix = f"model.layers.{layer_id}."
    wm = {n: f for n, f in weight_map(path).items() if n.startswith(prefix)}
    if not wm:
        raise CheckpointError(f"{path}: no tensors under {prefix!r} (has the checkpoint that layer?)")
    raw: dict[str, torch.Tensor] = {}
    for fname in sorted(set(wm.values())):
        with safe_open(str(path / fname), framework="pt", device="cpu") as f:
            for n in (n for n, ff in wm.items() if ff == fname):
                raw[n[len(prefix):]] = f.get_tensor(n)
    out = {}
    for n, t in raw.items():
        if n.endswith(".weight_scale_inv"):
            continue
        scale = raw.get(n.replace(".weight", ".weight_scale_inv")) if n.endswith(".weight") else None
        out[n] = fp8.weight_dequant(t, scale, dtype) if t.dtype == fp8.FP8_DTYPE else t.to(dtype)
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _split(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for n, t in tensors.items():
        b = t.numel() * t.element_size()
        if groups[-1] and size + b > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += b
    return [g for g in groups if g]


def write_mtp_layers(src_dir: str | Path, out_dir: str | Path, new_tensors: dict[str, torch.Tensor],
                     n_mtp: int, max_shard_bytes: int = MAX_NEW_SHARD_BYTES) -> Path:
    """Checkpoint `src_dir` with every tensor of the layers named in `new_tensors` (checkpoint names, stored
    dtypes) replaced or added, and num_nextn_predict_layers = n_mtp; written to `out_dir`."""
    src, out = Path(src_dir), Path(out_dir)
    raw_cfg = json.loads((src / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw_cfg, str(src / "config.json"))
    matches = [re.match(r"model\.layers\.(\d+)\.", n) for n in new_tensors]
    if not new_tensors or not all(matches):
        raise ValueError("write_mtp_layers: new_tensors must be non-empty and all named model.layers.N.*")
    layers = {int(m.group(1)) for m in matches}
    if min(layers) < cfg.num_hidden_layers:
        raise ValueError(f"write_mtp_layers: layer {min(layers)} is a trunk layer (MTP layers start at "
                         f"{cfg.num_hidden_layers})")
    if max(layers) >= cfg.num_hidden_layers + n_mtp:
        raise ValueError(f"write_mtp_layers: layer {max(layers)} does not fit n_mtp={n_mtp}")
    replaced = re.compile(r"model\.layers\.(" + "|".join(map(str, sorted(layers))) + r")\.")
    old_wm = weight_map(src)
    plan = []  # (source shard, tensors kept, whole shard kept), shards left empty dropped
    for fname in sorted(set(old_wm.values())):
        names = [n for n, f in old_wm.items() if f == fname]
        kept = [n for n in names if not replaced.match(n) and _layer_id(n) < cfg.num_hidden_layers + n_mtp]
        if kept:
            plan.append((fname, kept, len(kept) == len(names)))
    new_groups = _split(new_tensors, max_shard_bytes)
    total = len(plan) + len(new_groups)

    def name_of(i: int) -> str:
        return f"model-{i + 1:05d}-of-{total:06d}.safetensors"

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-ckpt-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        wm: dict[str, str] = {}
        written: list[Path] = []  # files made here (linked source shards keep their own mode)
        for i, (fname, kept, whole) in enumerate(plan):
            if whole:
                _link_or_copy(src / fname, tmp / name_of(i))
            else:  # one shard in memory at a time
                with safe_open(str(src / fname), framework="pt", device="cpu") as f:
                    save_file({n: f.get_tensor(n) for n in kept}, str(tmp / name_of(i)), metadata={"format": "pt"})
                written.append(tmp / name_of(i))
            wm.update({n: name_of(i) for n in kept})
        for j, group in enumerate(new_groups):
            fname = name_of(len(plan) + j)
            save_file({n: new_tensors[n].contiguous() for n in group}, str(tmp / fname), metadata={"format": "pt"})
            written.append(tmp / fname)
            wm.update({n: fname for n in group})
        total_size = 0
        for fname in sorted(set(wm.values())):
            with safe_open(str(tmp / fname), framework="pt", device="cpu") as f:
                for n in f.keys():
                    sl = f.get_slice(n)
                    total_size += _nbytes(sl.get_shape(), sl.get_dtype())
        index = {"metadata": {"total_size": total_size}, "weight_map": wm}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
        raw_cfg["num_nextn_predict_layers"] = n_mtp
        (tmp / "config.json").write_text(json.dumps(raw_cfg, indent=2))
        written += [tmp / INDEX_NAME, tmp / "config.json"]
        for f in src.iterdir():  # tokenizer files and whatever else the checkpoint carries
            if f.is_file() and f.name not in old_wm.values() and f.name not in (INDEX_NAME, "config.json"):
                shutil.copy2(f, tmp / f.name)
        publish_dir(tmp, out, written)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


_ST_BYTES = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "U8": 1, "BOOL": 1}


def _layer_id(name: str) -> int:
    """The layer number of `model.layers.N.*`, -1 for tensors outside the layers."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _nbytes(shape, st_dtype: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * _ST_BYTES[st_dtype]
