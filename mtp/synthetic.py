"""Random FP8 DeepSeek-V3.2 models built directly on a device (no checkpoint on disk), for benchmarks and GPU
tests at real width. Weights follow the checkpoint layout (FP8 + ue8m0 128x128 block scales, bf16 norms and
router, fp32 router bias); values are N(0, 1) in FP8 with a power-of-two block scale near 1/sqrt(in), so
activations keep their scale through the layers, as with the tiny checkpoints. Every tensor is drawn from its
own generator, seeded from (seed, checkpoint name): the sharded build (`mtp.parallel.synthetic`) draws each
tensor whole on every rank and keeps its slice, so TP=1 and TP=N hold the same weights.
"""

from __future__ import annotations

import hashlib
import math

import torch

from .checkpoint.files import ckpt_name
from .checkpoint.inventory import TensorSpec, checkpoint_spec
from .model import fp8
from .model.cache import KVCache
from .model.config import ModelConfig, RuntimeOptions
from .model.deepseek import DeepseekV32
from .model.layers import yarn_inv_freq


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of checkpoint tensor `name`: a stable hash of (seed, name), so any process that needs
    a tensor (one GPU, or every rank of a sharded build) draws the same values without communicating."""
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def random_tensor(cfg: ModelConfig, name: str, seed: int = 0, device="cuda",
                  spec: dict[str, TensorSpec] | None = None) -> torch.Tensor:
    """Checkpoint tensor `name` of the random model, whole, in its checkpoint dtype, on `device`: FP8 weights are
    N(0, 1) in e4m3 with one power-of-two scale near 1/sqrt(in) for all blocks; bf16 linears N(0, 1/in);
    embeddings N(0, 1); norm weights 1 + N(0, 0.01), norm biases N(0, 0.01); router bias N(0, 0.0025).
    Values depend only on (seed, name, device type), not on which other tensors are drawn."""
    spec = spec if spec is not None else checkpoint_spec(cfg)
    ts = spec[name]
    if ts.kind == "scale":  # deterministic: no draw
        n, k = spec[name[: -len("_scale_inv")]].shape
        return torch.full(ts.shape, 2.0 ** round(math.log2(1 / math.sqrt(k))), device=device)
    g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    v = torch.randn(ts.shape, generator=g, device=device)
    if ts.kind == "fp8":
        return v.to(fp8.FP8_DTYPE)
    if name.endswith("e_score_correction_bias"):
        v.mul_(0.05)
    elif name.endswith("norm.bias"):
        v.mul_(0.1)
    elif name.endswith("norm.weight"):
        v.mul_(0.1).add_(1.0)
    elif not name.endswith("embed_tokens.weight"):
        v.div_(math.sqrt(ts.shape[-1]))
    return v.to(ts.dtypes[0])


def random_state(cfg: ModelConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of `random_model(cfg, seed=seed)` (small configs: for writing it as a checkpoint)."""
    spec = checkpoint_spec(cfg)
    return {name: random_tensor(cfg, name, seed, device, spec) for name in spec}


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
    """The random model on `device`, equal to `load_model` of a checkpoint holding `random_state(cfg, seed)`
    (bf16 / fp32 tensors are drawn in their checkpoint dtype, then cast to `dtype`). Each tensor has its own
    seed (`tensor_seed`), so `mtp.parallel.random_parallel_model` gives every rank its exact slices."""
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
