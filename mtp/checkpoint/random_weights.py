"""Random DeepSeek-V3.2 weights in the checkpoint format: FP8 e4m3 linears with ue8m0 128x128 block scales, bf16
norms / router / embeddings / heads, fp32 router bias, under the checkpoint's names (`checkpoint_spec`).

One value rule for every tensor (`_draw`): linears N(0, 1/in), so activations keep their scale through the layers;
embeddings N(0, 1); norm weights 1 + N(0, 0.01); norm biases N(0, 0.01); router bias N(0, 0.0025). Two ways to
draw it, each pinned by what depends on its exact values:

- `random_tensors(cfg, seed)`: the tiny checkpoints (`mtp.checkpoint.tiny`, the tests' fixtures). One generator,
  tensors in checkpoint order; FP8 weights quantized from their values with per-block scales, as a real
  checkpoint's; the MTP modules' embedding and head are copies of the trunk's, as in the real file.
- `random_tensor(cfg, name, seed, device)`: the random models built on a device at real width (`mtp.checkpoint.synthetic`,
  `mtp.parallel.synthetic`). A generator per tensor, seeded from (seed, name) (`tensor_seed`), so any process
  draws any tensor alone: every rank of a sharded build its slice, with no communication. FP8 weights are N(0, 1)
  codes under one power-of-two scale near 1/sqrt(in) that needs no draw, so a rank builds a weight's scales
  without drawing the weight again. `random_state` is all of them (small configs: to write as a checkpoint).
"""

from __future__ import annotations

import hashlib
import math

import torch

from ..model import fp8
from ..model.config import ModelConfig
from .inventory import TensorSpec, checkpoint_spec

def _draw(name: str, shape: tuple[int, ...], g: torch.Generator, device="cpu", unit: bool = False) -> torch.Tensor:
    """fp32 values of checkpoint tensor `name` (the rule above); unit: a linear's N(0, 1) before the 1/sqrt(in)."""
    v = torch.randn(shape, generator=g, device=device)
    if name.endswith("e_score_correction_bias"):
        v.mul_(0.05)
    elif name.endswith("norm.bias"):
        v.mul_(0.1)
    elif name.endswith("norm.weight"):
        v.mul_(0.1).add_(1.0)
    elif not (unit or name.endswith("embed_tokens.weight")):
        v.div_(math.sqrt(shape[-1]))
    return v


def _mtp_copy_of(name: str) -> str | None:
    """The trunk tensor an MTP module's embedding or head copies in the real checkpoint, else None."""
    if name.startswith("model.layers.") and name.endswith("embed_tokens.weight"):
        return "model.embed_tokens.weight"
    if name.endswith("shared_head.head.weight"):
        return "lm_head.weight"
    return None


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of a tiny random checkpoint (CPU), drawn in checkpoint order from one generator."""
    g = torch.Generator().manual_seed(seed)
    spec = checkpoint_spec(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, ts in spec.items():
        if ts.kind == "scale":
            continue  # written with its weight
        source = _mtp_copy_of(name)
        if source is not None:
            out[name] = out[source].clone()
            continue
        w = _draw(name, ts.shape, g)
        if ts.kind == "fp8":
            out[name], out[name + "_scale_inv"] = fp8.weight_quant(w)
        else:
            out[name] = w.to(ts.dtypes[0])
    return {n: out[n] for n in spec}


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of checkpoint tensor `name`: a stable hash of (seed, name), so any process that needs
    a tensor (one GPU, or every rank of a sharded build) draws the same values without communicating."""
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def random_tensor(cfg: ModelConfig, name: str, seed: int = 0, device="cuda",
                  spec: dict[str, TensorSpec] | None = None) -> torch.Tensor:
    """Checkpoint tensor `name`, whole, in its checkpoint dtype, on `device`, from its own generator. Values
    depend only on (seed, name, device type), not on which other tensors are drawn."""
    spec = spec if spec is not None else checkpoint_spec(cfg)
    ts = spec[name]
    if ts.kind == "scale":  # deterministic: no draw
        n, k = spec[name[: -len("_scale_inv")]].shape
        return torch.full(ts.shape, 2.0 ** round(math.log2(1 / math.sqrt(k))), device=device)
    g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    v = _draw(name, ts.shape, g, device, unit=ts.kind == "fp8")
    return v.to(fp8.FP8_DTYPE if ts.kind == "fp8" else ts.dtypes[0])


def random_state(cfg: ModelConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Every checkpoint tensor `random_tensor` gives (small configs: for writing it as a checkpoint)."""
    spec = checkpoint_spec(cfg)
    return {name: random_tensor(cfg, name, seed, device, spec) for name in spec}
