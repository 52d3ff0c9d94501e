"""Load and write DeepSeek-V3.2 checkpoints in the HF layout (safetensors only, never pickle).

Loading validates everything that can be checked from the shard headers before any weight is read:
the index and its shards, missing / unexpected tensors, shapes, dtypes, and the config against the tensors.
Then it streams tensor by tensor from the shards (memory-mapped, or read with explicit reads: `reader='pread'`,
`mtp.checkpoint.reader`) straight into a model built on the meta device, so host memory holds the model (when
loading to CPU) plus one tensor, never a second copy. A model
is returned only when every parameter was filled: a failure leaves nothing half-initialized behind.

Name mapping: trunk tensors keep their names; MTP layer `model.layers.{num_hidden_layers + j}.X` is
`mtp.{j}.X` in the module tree.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..model import fp8
from ..model.config import ConfigError, ModelConfig, RuntimeOptions
from ..model.layers import yarn_inv_freq
from ..model.deepseek import DeepseekV32
from ..spec.options import DEFAULT_LOAD_READER, LOAD_READERS
from .header import ST_DTYPES, CheckpointError, shard_header
from .device_init import DeviceInit
from .inventory import checkpoint_spec
from .reader import ShardReader, Staging
from ..utils import publish_dir

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
def param_name(ckpt_name: str, cfg: ModelConfig) -> str:
    m = re.match(r"model\.layers\.(\d+)\.(.*)", ckpt_name)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        return f"mtp.{int(m.group(1)) - cfg.num_hidden_layers}.{m.group(2)}"
    return ckpt_name


def ckpt_name(param: str, cfg: ModelConfig) -> str:
    m = re.match(r"mtp\.(\d+)\.(.*)", param)
    if m:
        return f"model.layers.{cfg.num_hidden_layers + int(m.group(1))}.{m.group(2)}"
    return param


# ---------------------------------------------------------------------------------------------- reading
def weight_map(path: Path) -> dict[str, str]:
    """{tensor name: shard file name}, from the index json or the single-file layout."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            raw = json.loads(index.read_text(), object_pairs_hook=_no_repeated_keys)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index}: not valid JSON ({e})") from None
        except _RepeatedKey as e:  # json keeps the last of repeated keys: a tensor in two shards loads silently
            raise CheckpointError(f"{index}: {e.args[0]!r} is listed {e.args[1]} times (in {e.args[2]}); a tensor "
                                  "must be in one shard") from None
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        for name, f in wm.items():
            if not isinstance(f, str) or not _inside(f):
                raise CheckpointError(f"{index}: weight_map[{name!r}] = {f!r} is not a file name inside the "
                                      "checkpoint folder (no absolute path, no '..')")
        return dict(wm)
    single = path / SINGLE_NAME
    if single.is_file():
        _check_shard_size(single)
        with _open(single) as f:
            return {k: SINGLE_NAME for k in f.keys()}
    raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


class _RepeatedKey(Exception):
    pass


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: dict[str, list] = {}
        for k, v in pairs:
            seen.setdefault(k, []).append(v)
        k, vs = next((k, vs) for k, vs in seen.items() if len(vs) > 1)
        raise _RepeatedKey(k, len(vs), ", ".join(map(str, vs)))
    return d


def _inside(fname: str) -> bool:
    """A shard name that stays inside the checkpoint folder: relative, no '..' part (symlinks are the owner's)."""
    p = Path(fname)
    return bool(fname) and not p.is_absolute() and ".." not in p.parts and not fname.startswith(("/", "\\"))


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers / short files
        raise CheckpointError(f"{file}: not a readable safetensors file (truncated or corrupt?): {e}") from None


def read_headers(path: Path, wm: dict[str, str]) -> dict[str, tuple[tuple[int, ...], torch.dtype, str]]:
    """{name: (shape, dtype, file)} read from shard headers only; checks the index against the shards."""
    by_file: dict[str, list[str]] = {}
    for name, f in wm.items():
        by_file.setdefault(f, []).append(name)
    out = {}
    for fname, names in sorted(by_file.items()):
        file = path / fname
        if not file.is_file():
            raise CheckpointError(f"{file}: shard named in {INDEX_NAME} for {len(names)} tensors "
                                  f"(e.g. {names[0]!r}) does not exist")
        _check_shard_size(file)  # before safe_open, whose own error would not name the cut-off tensors
        with _open(file) as f:
            present = set(f.keys())
            elsewhere = sorted(n for n in present if wm.get(n, fname) != fname)
            if elsewhere:
                raise CheckpointError(f"{file}: holds tensor {elsewhere[0]!r}, which {INDEX_NAME} puts in "
                                      f"{wm[elsewhere[0]]}: a tensor must be in one shard")
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{file}: index says it holds tensor {name!r}, but it does not")
                sl = f.get_slice(name)
                dt = ST_DTYPES.get(sl.get_dtype())
                if dt is None:
                    raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {sl.get_dtype()}")
                out[name] = (tuple(sl.get_shape()), dt, fname)
    return out


def _check_shard_size(file: Path) -> None:
    """Parse the header by hand and name the tensors whose bytes lie past the end of a truncated file."""
    size = file.stat().st_size
    start, header = shard_header(file)
    try:
        ends = {k: int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"}
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    cut = sorted((k for k, end in ends.items() if start + end > size), key=ends.__getitem__)
    if cut:
        raise CheckpointError(f"{file}: truncated: {size} bytes, header describes {start + max(ends.values())}; "
                              f"tensor {cut[0]!r} and {len(cut) - 1} others lie past the end")


def validate(path: Path, cfg: ModelConfig, n_mtp: int) -> dict[str, tuple[tuple[int, ...], torch.dtype, str]]:
    wm = weight_map(path)
    _check_layer_count(path, wm, cfg, n_mtp)
    headers = read_headers(path, wm)
    spec = checkpoint_spec(cfg, n_mtp)
    missing = [n for n in spec if n not in headers]
    unexpected = [n for n in headers if n not in spec]
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensors the config requires are missing, e.g. "
                              f"{missing[:3]} (config: num_hidden_layers={cfg.num_hidden_layers}, "
                              f"num_nextn_predict_layers={cfg.num_nextn_predict_layers})")
    if unexpected:
        raise CheckpointError(f"{path}: {len(unexpected)} tensors not in the DeepSeek-V3.2 layout for this config, "
                              f"e.g. {unexpected[:3]} in {headers[unexpected[0]][2]}")
    for name, ts in spec.items():
        shape, dt, fname = headers[name]
        if shape != ts.shape:
            raise CheckpointError(f"{path / fname}: tensor {name!r} has shape {list(shape)}, the config implies "
                                  f"{list(ts.shape)} -- config.json and the weights disagree")
        if dt not in ts.dtypes:
            raise CheckpointError(f"{path / fname}: tensor {name!r} has dtype {dt}, expected "
                                  f"{' or '.join(str(d) for d in ts.dtypes)}")
    return headers


def _check_layer_count(path: Path, wm: dict[str, str], cfg: ModelConfig, n_mtp: int) -> None:
    """Config layers past those the index holds, refused before the tensor list is built: its size follows the
    config (num_hidden_layers: 1e9 would list billions of names, then the OOM killer)."""
    held = {int(m.group(1)) for n in wm if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    want = cfg.num_hidden_layers + n_mtp
    if want > len(held):
        first = min(set(range(len(held) + 1)) - held)
        raise CheckpointError(f"{path}: config.json implies {want} layers (num_hidden_layers="
                              f"{cfg.num_hidden_layers}, num_nextn_predict_layers={n_mtp}), the checkpoint holds "
                              f"{len(held)}: no tensor of model.layers.{first}. is present")


def iter_tensors(path: Path, headers, reader: str = DEFAULT_LOAD_READER,
                 device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) shard by shard: views of safetensors' memory map on the CPU (reader 'mmap': copy them
    before keeping them), or tensors of their own read to `device` in file order (reader 'pread',
    `mtp.checkpoint.reader`)."""
    device = torch.device(device)
    staging = Staging(device) if reader == "pread" and device.type == "cuda" else None
    if device.type != "cuda":  # explicit reads land on the host or a CUDA device; the caller moves them elsewhere
        device = torch.device("cpu")
    by_file: dict[str, list[str]] = {}
    for name, (_, _, f) in headers.items():
        by_file.setdefault(f, []).append(name)
    for fname in sorted(by_file):
        with _open(path / fname) if reader == "mmap" else ShardReader(path / fname, device, staging) as f:
            names = by_file[fname]
            if reader == "pread":
                names = f.in_file_order(names)
                f.will_read([f.span(n) for n in names])
            for name in names:
                try:
                    t = f.get_tensor(name) if reader == "mmap" else f.get_slice(name)[:]
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(f"{path / fname}: could not read tensor {name!r}: {e}") from None
                yield name, t


def check_values(t: torch.Tensor, file: Path, name: str) -> None:
    """Refuse a floating-point weight holding NaN or infinity: a NaN weight makes every logit NaN and every
    argmax token 0, which reads as perfect acceptance. Only reductions, no temporaries: e4m3fn has no
    infinities and NaN only at the bytes 0x7F and 0xFF, the maxima of the int8 and uint8 views; other float
    types propagate NaN / inf into their min or max. Measured on one busy CPU core: ~0.07 s/GB (fp8) and
    ~0.05 s/GB (bf16), a tenth of the cost of the copy that follows."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    if t.dtype == torch.float8_e4m3fn:
        bad = int(t.view(torch.uint8).max()) == 0xFF or int(t.view(torch.int8).max()) == 0x7F
    else:
        lo, hi = torch.aminmax(t)
        bad = not bool(torch.isfinite(lo) & torch.isfinite(hi))
    if bad:
        _name_bad(t, _bad_elems(t), file, name)


def check_scales(t: torch.Tensor, file: Path, name: str) -> None:
    """Block scales must be finite, positive and inside [SCALE_MIN, SCALE_MAX] (mtp.model.fp8: what a real
    checkpoint holds); the first scale outside is named with its index and value."""
    if not bool(torch.isfinite(t).all() and (t > 0).all()):
        raise CheckpointError(f"{file}: tensor {name!r} has non-positive or non-finite scales")
    bad = (t < fp8.SCALE_MIN) | (t > fp8.SCALE_MAX)
    if bool(bad.any()):
        first = [int(i) for i in torch.unravel_index(bad.reshape(-1).nonzero()[0, 0], t.shape)]
        v = float(t[tuple(first)])
        raise CheckpointError(f"{file}: tensor {name!r} holds {int(bad.sum())} block scales outside "
                              f"[2^{math.log2(fp8.SCALE_MIN):g}, 2^{math.log2(fp8.SCALE_MAX):g}], the first at "
                              f"index {first}: {v:g} (= 2^{math.log2(v):g}); no real checkpoint holds such a "
                              "scale (its weights would overflow the activations): the checkpoint is corrupt")


def _bad_elems(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return (t.view(torch.uint8) & 0x7F) == 0x7F
    return ~torch.isfinite(t)


def _name_bad(t: torch.Tensor, bad: torch.Tensor, file: Path, name: str) -> None:
    first = [int(i) for i in torch.unravel_index(bad.reshape(-1).nonzero()[0, 0], t.shape)]
    what = "NaN bytes (e4m3fn 0x7F / 0xFF)" if t.dtype == torch.float8_e4m3fn else "non-finite values"
    raise CheckpointError(f"{file}: tensor {name!r} holds {int(bad.sum())} {what}, the first at index {first}: "
                          "the checkpoint is corrupt")


def open_checkpoint(path: str | os.PathLike, n_mtp: int | None) -> tuple[Path, ModelConfig, int, dict]:
    """Read config.json and validate every shard header against it before any weight is read.
    Returns (path, config, number of MTP layers to load, headers)."""
    path = Path(path)
    if path.is_file():
        raise CheckpointError(f"{path}: is a file, not a checkpoint directory (give the folder holding "
                              "config.json and the shards)")
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    cfg = ModelConfig.from_json(path / "config.json")
    n_mtp = resolve_n_mtp(cfg, n_mtp, path / "config.json")
    return path, cfg, n_mtp, validate(path, cfg, cfg.num_nextn_predict_layers)


def resolve_n_mtp(cfg: ModelConfig, n_mtp: int | None, source: str | os.PathLike = "config") -> int:
    """MTP layers to load: `n_mtp`, or all the config has (None); more than it has is an error."""
    n_avail = cfg.num_nextn_predict_layers
    n_mtp = n_avail if n_mtp is None else n_mtp
    if not 0 <= n_mtp <= n_avail:
        raise ConfigError(f"n_mtp={n_mtp}: the checkpoint has {n_avail} MTP layers "
                          f"({source}: num_nextn_predict_layers)")
    return n_mtp


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               numerics: str = "fp8", n_mtp: int | None = None, runtime: RuntimeOptions | None = None,
               reader: str = DEFAULT_LOAD_READER) -> DeepseekV32:
    """Load an HF DeepSeek-V3.2 checkpoint directory (FP8 or bf16) into `DeepseekV32` on `device`.

    n_mtp: how many MTP layers to load (default: config's num_nextn_predict_layers; 0 skips them).
    reader: 'mmap' (safetensors' memory map) or 'pread' (explicit reads, `mtp.checkpoint.reader`): the same bytes.
    """
    if reader not in LOAD_READERS:
        raise ValueError(f"load_model: reader must be one of {list(LOAD_READERS)}, got {reader!r}")
    dev = DeviceInit(device)  # CUDA starts on a thread while the headers are read and the model is built
    path, cfg, n_mtp, headers = open_checkpoint(path, n_mtp)
    wanted = {k: v for k, v in headers.items() if _layer_keep(k, cfg, n_mtp)}
    runtime = runtime or RuntimeOptions(numerics=numerics)
    with torch.device("meta"):
        model = DeepseekV32(cfg, dtype=dtype, n_mtp=n_mtp, runtime=runtime)
    params = dict(model.named_parameters())
    if reader == "pread" and dev.device.type == "cuda":
        dev.wait()  # pread reads straight to the device (through pinned buffers): the device is up before
    for name, t in iter_tensors(path, wanted, reader, dev.device):
        pname = param_name(name, cfg)
        p = params.pop(pname)
        if t.dtype == torch.float32 and name.endswith("weight_scale_inv"):
            check_scales(t, path / headers[name][2], name)
        check_values(t, path / headers[name][2], name)
        dev.wait()  # the device is up before the first copy (and an init error raised here, as it was)
        # copy=True: safetensors returns views of a private mmap of the shard; a CPU model that kept them would
        # die of SIGBUS once the file is rewritten or truncated in place (and would page in at first use). A pread
        # tensor is memory of its own, already on `device`.
        value = t.to(device=device, dtype=p.dtype, copy=reader == "mmap")
        _set_param(model, pname, torch.nn.Parameter(value, requires_grad=False))
    if params:
        raise CheckpointError(f"{path}: internal error, parameters left unfilled: {sorted(params)[:3]}")
    model.rotary.inv_freq = yarn_inv_freq(cfg).to(device)
    return model.eval()


def _layer_keep(name: str, cfg: ModelConfig, n_mtp: int) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return not m or int(m.group(1)) < cfg.num_hidden_layers + n_mtp


def _set_param(model: torch.nn.Module, dotted: str, value: torch.nn.Parameter) -> None:
    mod_path, _, attr = dotted.rpartition(".")
    setattr(model.get_submodule(mod_path), attr, value)


# ---------------------------------------------------------------------------------------------- writing
def save_checkpoint(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | os.PathLike,
                    n_shards: int = 2, extra_files: dict[str, Path] | None = None) -> Path:
    """Write checkpoint-named tensors as `n_shards` safetensors shards + index + config.json, atomically
    (a temp dir renamed into place, so a crash never leaves a half-written checkpoint)."""
    out = Path(out_dir)
    spec = checkpoint_spec(cfg)
    problems = [n for n in spec if n not in tensors] + [n for n in tensors if n not in spec]
    if problems:
        raise CheckpointError(f"save_checkpoint: tensors do not match the layout of the config: {problems[:3]}")
    names = list(spec)
    total = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    n_shards = max(1, min(n_shards, len(names)))
    out.parent.mkdir(parents=True, exist_ok=True)  # the temp dir must sit beside `out` for an atomic rename
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-ckpt-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700: the renamed checkpoint would be unreadable for other users
    try:
        shards: list[list[str]] = [[] for _ in range(n_shards)]
        acc, target = 0, total / n_shards
        for n in names:
            i = min(int(acc // target) if target else 0, n_shards - 1)
            shards[i].append(n)
            acc += tensors[n].numel() * tensors[n].element_size()
        shards = [s for s in shards if s]
        wm = {}
        for i, s in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):06d}.safetensors"
            save_file({n: tensors[n].contiguous() for n in s}, str(tmp / fname), metadata={"format": "pt"})
            wm.update({n: fname for n in s})
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2))
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        for name, src in (extra_files or {}).items():
            shutil.copy(src, tmp / name)
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def state_for_checkpoint(model: DeepseekV32) -> dict[str, torch.Tensor]:
    """The model's parameters under checkpoint names (for round trips and exports)."""
    return {ckpt_name(n, model.cfg): p.detach() for n, p in model.named_parameters()}
