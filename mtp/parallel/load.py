"""Sharded loading: each rank reads only its slices of the safetensors shards.

The checkpoint is validated from the shard headers exactly as `mtp.checkpoint.files.load_model` does (missing /
unexpected tensors, shapes, dtypes). Then the per-rank model is built on the meta device
(`shard_model`), and every one of its parameters is read with `safe_open(...).get_slice(name)[rows]` (or
`[:, cols]`): the bytes of other ranks' slices and of non-local experts are never touched. FP8 weights get
their scales re-blocked to the slice (`reblock.reblock_scale`, exact); a scale tensor is at most
[ceil(N/128), ceil(K/128)] floats, so it is read whole.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from ..checkpoint.device_init import DeviceInit
from ..checkpoint.files import CheckpointError, check_scales, check_values, ckpt_name, open_checkpoint, param_name
from ..checkpoint.header import in_file_order, shard_header
from ..checkpoint.reader import ShardReader, Staging
from ..model.config import BLOCK, ConfigError, ModelConfig, RuntimeOptions
from ..model.layers import yarn_inv_freq
from ..model.deepseek import DeepseekV32
from ..spec.options import DEFAULT_LOAD_READER, LOAD_READERS
from .comm import Comm
from .layout import FULL, ParallelPlan, RankLayout, Shard
from .modules import shard_model
from .reblock import ReblockError, block_map, reblock_scale

SCALE_SUFFIX = ".weight_scale_inv"


def take(src, shard: Shard) -> torch.Tensor:
    """`shard` of `src`: a safetensors slice (read lazily) or an in-memory tensor (a view); both index alike."""
    if shard.dim is None:
        return src[:]
    if shard.dim == 0:
        return src[shard.start: shard.stop]
    return src[:, shard.start: shard.stop]


def read_shard(layout: RankLayout, name: str) -> Shard:
    """The part of checkpoint tensor `name` that `rank_part` reads: a block scale whole (it is re-blocked in memory),
    a weight's rows or columns (`layout.shard`)."""
    if name.endswith(SCALE_SUFFIX):
        return FULL
    shard = layout.shard(name)
    if shard is None:
        raise ValueError(f"rank_part: rank {layout.rank} holds no part of {name!r}")
    return shard


def rank_part(layout: RankLayout, name: str, src, weight_shape: tuple[int, ...] | None = None,
              what: str | None = None) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name`, given the whole tensor `src` (a safetensors slice or an
    in-memory tensor): rows / columns of a weight (`layout.shard`), or, for a `.weight_scale_inv`, the whole
    scale re-blocked to its weight's slice (`weight_shape`: the full weight's shape). The one place the loader
    (`load_parallel`) and the random sharded model (`mtp.parallel.synthetic`) cut tensors. May return a view
    of `src`: copy it before freeing the full tensor."""
    if name.endswith(SCALE_SUFFIX):
        wname = name[: -len(SCALE_SUFFIX)] + ".weight"
        if weight_shape is None:
            raise ValueError(f"rank_part: {name!r} is a block scale; pass the full shape of {wname!r}")
        return reblock_scale(take(src, read_shard(layout, name)), tuple(weight_shape), layout.shard(wname),
                             what=what or wname)
    return take(src, read_shard(layout, name))


def check_fp8_inputs(layout: RankLayout) -> None:
    """Row-parallel FP8 layers quantize their input slice per 128 channels; a slice that is not a whole
    number of groups would quantize with other amax values than the single-rank model."""
    cfg, W = layout.cfg, layout.plan.world
    cuts = {"o_proj (heads x v_head_dim)": layout.n_heads * cfg.v_head_dim,
            "dense down_proj (intermediate_size slice)": layout.dense[1] - layout.dense[0],
            "shared expert down_proj": layout.shared[1] - layout.shared[0],
            "routed expert down_proj (expert_layout='split')": layout.expert_inter[1] - layout.expert_inter[0]}
    for what, k in cuts.items():
        if what.startswith("o_proj") and k and BLOCK % k == 0:
            continue  # a group shared by 128 / k ranks: they agree on its amax (modules.RowParallelLinear)
        if k % BLOCK:
            raise ConfigError(f"parallel world {W}, rank {layout.rank}: {what} gets {k} input channels, not a "
                              f"multiple of {BLOCK}: fp8 numerics quantize activations per {BLOCK} channels. Use "
                              f"mlp_split='blocks', a world size that divides the heads into groups of "
                              f"{BLOCK // math.gcd(BLOCK, cfg.v_head_dim)}, or numerics='dequant'")


def check_split(cfg: ModelConfig, plan: ParallelPlan, numerics: str = "fp8") -> None:
    """Whether every rank of `plan` can hold its part of a checkpoint of `cfg` exactly (config only, no weight
    read): heads, experts and vocabulary divide by the world size, FP8 activation groups stay whole per rank
    (fp8 numerics), and every column cut of an FP8 weight keeps to its 128-column scale blocks. ConfigError
    naming the first problem."""
    for r in range(plan.world):
        layout = RankLayout(cfg, plan, r)
        if not cfg.is_fp8:
            continue
        if numerics == "fp8":
            check_fp8_inputs(layout)
        v = cfg.v_head_dim
        cuts = {"o_proj": (layout.heads[0] * v, layout.heads[1] * v), "dense down_proj": layout.dense,
                "shared expert down_proj": layout.shared, "routed expert down_proj": layout.expert_inter}
        for what, (lo, hi) in cuts.items():
            if hi > lo:
                try:
                    block_map(lo, hi, f"rank {r}'s {what} input channels")
                except ReblockError as e:
                    raise ConfigError(str(e)) from None


def split_degrees(cfg: ModelConfig, mlp_split: str = "blocks", numerics: str = "fp8", up_to: int = 64) -> list[int]:
    """The world sizes (powers of two up to `up_to`) a checkpoint of `cfg` splits into (`check_split`)."""
    out = []
    w = 1
    while w <= up_to:
        try:
            check_split(cfg, ParallelPlan(w, mlp_split), numerics)
            out.append(w)
        except ConfigError:
            pass
        w *= 2
    return out


def parallel_skeleton(cfg: ModelConfig, comm: Comm, *, plan: ParallelPlan | None = None,
                      dtype: torch.dtype = torch.float32, numerics: str = "fp8", n_mtp: int | None = None,
                      runtime: RuntimeOptions | None = None,
                      static_moe: bool = False) -> tuple[DeepseekV32, RankLayout]:
    """This rank's parallel model on the meta device (parameters still to be filled) and its layout, after
    the checks every sharded build needs (plan vs group size, whole fp8 activation groups per rank)."""
    plan = plan or ParallelPlan(world=comm.world)
    if plan.world != comm.world:
        raise ConfigError(f"plan.world = {plan.world} but the process group has {comm.world} ranks")
    runtime = runtime or RuntimeOptions(numerics=numerics)
    check_split(cfg, plan, runtime.numerics)
    layout = RankLayout(cfg, plan, comm.rank)
    with torch.device("meta"):
        model = DeepseekV32(cfg, dtype=dtype, n_mtp=n_mtp, runtime=runtime)
        shard_model(model, layout, comm, static_moe=static_moe)
    return model, layout


def open_shard(file: Path, reader: str, device: torch.device, staging: Staging | None):
    """A shard opened for `reader` (LOAD_READERS): both answer get_tensor (whole, on the CPU), get_slice (read when
    indexed; on `device` for 'pread', the CPU for 'mmap') and keys, and close as a context manager."""
    if reader == "mmap":
        return safe_open(str(file), framework="pt", device="cpu")
    return ShardReader(file, device, staging)


def load_parallel(path: str | os.PathLike, comm: Comm | None = None, *, plan: ParallelPlan | None = None,
                  device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, numerics: str = "fp8",
                  n_mtp: int | None = None, runtime: RuntimeOptions | None = None,
                  static_moe: bool = False, progress: Callable[[int, int], None] | None = None,
                  reader: str = DEFAULT_LOAD_READER) -> DeepseekV32:
    """This rank's part of an HF DeepSeek-V3.2 checkpoint as a `DeepseekV32` whose forward runs collectively.

    comm: the process group wrapper (default: the default group, or a single process). Every rank of the
    group must call this with the same arguments, then run the same forwards / `mtp.generate` calls.
    progress: called as progress(bytes_read, bytes_total) after each tensor (this rank's checkpoint bytes).
    reader: 'mmap' (safetensors' memory map) or 'pread' (`mtp.checkpoint.reader`); the same bytes either way.
    """
    if reader not in LOAD_READERS:
        raise ValueError(f"load_parallel: reader must be one of {list(LOAD_READERS)}, got {reader!r}")
    comm = comm or Comm()
    dev = DeviceInit(device)  # CUDA starts on a thread while the headers are read and the model is built
    device = torch.device(device)
    path, cfg, n_mtp, headers = open_checkpoint(path, n_mtp)
    model, layout = parallel_skeleton(cfg, comm, plan=plan, dtype=dtype, numerics=numerics, n_mtp=n_mtp,
                                      runtime=runtime, static_moe=static_moe)

    params = dict(model.named_parameters())
    by_file: dict[str, list[str]] = {}
    for pname in params:
        name = ckpt_name(pname, cfg)
        if name not in headers:
            raise CheckpointError(f"{path}: internal error, parameter {pname!r} has no checkpoint tensor {name!r}")
        by_file.setdefault(headers[name][2], []).append(name)
    total = sum(p.numel() * headers[ckpt_name(n, cfg)][1].itemsize for n, p in params.items())
    done = 0
    staging = None
    if reader == "pread" and device.type == "cuda":
        dev.wait()  # pread reads straight to the device (through pinned buffers): the device is up before
        staging = Staging(dev.device)
    for fname in sorted(by_file):
        file = path / fname
        with open_shard(file, reader, device, staging) as f:
            # front to back through the file (experts are stored by name, 0, 1, 10, 100, ..., not in parameter order)
            names = f.in_file_order(by_file[fname]) if reader == "pread" else in_file_order(shard_header(file)[1],
                                                                                            by_file[fname])
            if reader == "pread":
                f.will_read([f.span(n, s.dim, s.start, s.stop) for n in names for s in (read_shard(layout, n),)])
            for name in names:
                pname = param_name(name, cfg)
                p = params.pop(pname)
                try:
                    if name.endswith(SCALE_SUFFIX):
                        wname = name[: -len(SCALE_SUFFIX)] + ".weight"
                        t = f.get_tensor(name)
                        check_scales(t, file, name)
                        t = rank_part(layout, name, t, headers[wname][0], what=f"{file}: {wname}")
                    else:
                        t = rank_part(layout, name, f.get_slice(name))
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(f"{file}: could not read rank {comm.rank}'s slice of {name!r}: {e}") from None
                check_values(t, file, name)  # this rank's slice: each rank checks the bytes it reads
                if tuple(t.shape) != tuple(p.shape):
                    raise CheckpointError(f"{file}: rank {comm.rank}'s slice of {name!r} has shape {list(t.shape)}, "
                                          f"the parallel model expects {list(p.shape)}")
                dev.wait()  # the device is up before the first copy (and an init error raised here, as it was)
                # mmap: copy=True, never keep a view of the shard's private mmap (see mtp.checkpoint.files.load_model);
                # pread: t is memory of its own (on `device`, but for a re-blocked scale), converted only if need be
                value = t.to(device=device, dtype=p.dtype, copy=reader == "mmap")
                mod_path, _, attr = pname.rpartition(".")
                setattr(model.get_submodule(mod_path), attr, torch.nn.Parameter(value, requires_grad=False))
                if progress is not None:
                    done += t.numel() * t.element_size()
                    progress(done, total)
    if params:
        raise CheckpointError(f"{path}: internal error, parameters left unfilled: {sorted(params)[:3]}")
    model.rotary.inv_freq = yarn_inv_freq(cfg).to(device)
    return model.eval()


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters (what the memory planner predicts per rank)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
