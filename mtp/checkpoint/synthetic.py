"""Random FP8 DeepSeek-V3.2 models built directly on a device (no checkpoint on disk), for benchmarks and GPU
tests at real width, and random valid KV-cache contents. The weights are those of
`mtp.checkpoint.random_weights.random_tensor` (the checkpoint format; every tensor from its own generator, seeded
from (seed, checkpoint name)): the sharded build (`mtp.parallel.synthetic`) draws each tensor whole on every rank
and keeps its slice, so TP=1 and TP=N hold the same weights.
"""

from __future__ import annotations

import torch

from .files import ckpt_name
from .inventory import checkpoint_spec
from .random_weights import random_tensor
from ..model import fp8
from ..model.cache import KVCache
from ..model.config import ModelConfig, RuntimeOptions
from ..model.deepseek import DeepseekV32
from ..model.layers import yarn_inv_freq


def compact(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it when it is a view into a larger storage (so that the storage can be freed)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


@torch.no_grad()
def fill_random(model: DeepseekV32, seed: int, device, part=None) -> DeepseekV32:
    """Materialize every (meta) parameter of `model` from its random checkpoint tensor, one tensor at a time:
    `part(ckpt_name, full)` gives the piece this model holds (default: all of it; a rank: its slice)."""
    cfg = model.cfg
    spec = checkpoint_spec(cfg)
    for pname, p in list(model.named_parameters()):
        name = ckpt_name(pname, cfg)
        full = random_tensor(cfg, name, seed, device, spec)
        value = compact((full if part is None else part(name, full)).to(p.dtype))
        del full
        if tuple(value.shape) != tuple(p.shape):
            raise RuntimeError(f"random {name!r}: built shape {list(value.shape)}, the model expects {list(p.shape)}")
        mod_path, _, attr = pname.rpartition(".")
        setattr(model.get_submodule(mod_path), attr, torch.nn.Parameter(value, requires_grad=False))
    model.rotary.inv_freq = yarn_inv_freq(cfg).to(device)
    return model.eval()


@torch.no_grad()
def random_model(cfg: ModelConfig, device="cuda", dtype=torch.bfloat16, seed: int = 0,
                 runtime: RuntimeOptions | None = None) -> DeepseekV32:
    """The random model on `device`, equal to `load_model` of a checkpoint holding
    `mtp.checkpoint.random_weights.random_state(cfg, seed)` (bf16 / fp32 tensors are drawn in their checkpoint
    dtype, then cast to `dtype`). Each tensor has its own seed (`random_weights.tensor_seed`), so
    `mtp.parallel.random_parallel_model` gives every rank its exact slices."""
    with torch.device("meta"):
        model = DeepseekV32(cfg, dtype=dtype, runtime=runtime or RuntimeOptions(numerics="fp8"))
    return fill_random(model, seed, device)


@torch.no_grad()
def fill_cache_random(cache: KVCache, length: int, seed: int = 0) -> KVCache:
    """Positions [0, length) of every layer and row of `cache` hold random valid entries, as if a prefill of
    `length` tokens had run (without running it: a 32k-token prefill at full depth takes minutes): latents and
    indexer keys N(0, 1) quantized as `LayerCache.write` quantizes them (per-128 / per-key ue8m0 scales), rotary
    keys N(0, 1); then seq_lens = length. For timing decode at a context length: the values mean nothing, the
    bytes and shapes are a real cache's."""
    if not isinstance(length, int) or not 0 < length <= cache.max_len:
        raise ValueError(f"fill_cache_random: length must be in [1, {cache.max_len}] (the cache's max_len), "
                         f"got {length!r}")
    dev = cache.kv.device
    g = torch.Generator(device=dev).manual_seed(seed)
    B, C, Dk = cache.batch, cache.kv.shape[-1], cache.idx_k.shape[-1]
    for i in range(cache.n_layers):  # one layer at a time: at most a [B, length, C] fp32 draw is live
        c = torch.randn(B, length, C, generator=g, device=dev)
        k = torch.randn(B, length, Dk, generator=g, device=dev)
        if cache.quantized:
            c8, cs = fp8.act_quant(c)
            k8, ks = fp8.act_quant(k, block=Dk)
            cache.kv[i, :, :length] = c8
            cache.kv_scale[i, :, :length] = cs
            cache.idx_k[i, :, :length] = k8
            cache.idx_k_scale[i, :, :length] = ks.squeeze(-1)
        else:
            cache.kv[i, :, :length] = c.to(cache.kv.dtype)
            cache.idx_k[i, :, :length] = k.to(cache.idx_k.dtype)
        cache.pe[i, :, :length] = torch.randn(B, length, cache.pe.shape[-1], generator=g, device=dev).to(cache.pe.dtype)
        del c, k
    cache.seq_lens.fill_(length)
    return cache
