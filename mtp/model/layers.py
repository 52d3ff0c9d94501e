"""Building blocks of the reference forward: norms, FP8-aware linear, rotary embeddings.

Shape legend: B batch, T new tokens, S cached keys, D model width, R rotary dims.
Every module reads the numerics ('fp8' | 'dequant') from `self.numerics`, which `DeepseekV32.set_runtime`
sets on the whole tree. Nothing here knows about kernels: the Triton fast path (mtp/backends/fast_path.py)
swaps fast subclasses in on a loaded model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8
from .config import ModelConfig
from .static import arange


class RMSNorm(nn.Module):
    """w * x * rsqrt(mean(x^2) + eps) in fp32, cast to `out_dtype` (DeepSeek reference)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, out_dtype or self.weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    a = fp8.acc_dtype(x.dtype)
    xf = x.to(a)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(a)).to(out_dtype)


class LayerNorm(nn.Module):
    """The indexer's key norm: LayerNorm with weight and bias, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    a = fp8.acc_dtype(x.dtype)
    return F.layer_norm(x.to(a), (x.shape[-1],), weight.to(a), bias.to(a), eps).to(x.dtype)


class Embedding(nn.Embedding):
    """`nn.Embedding` whose weight starts uninitialized (`torch.empty`), as `Linear`'s does: the checkpoint (or
    `mtp.train.model_init`) fills it. nn.Embedding's own random init is not only wasted work: on the meta device
    (every loader builds there) its `normal_` runs through `torch._refs`, which imports `torch._dynamo` (1.4-3.4 s
    of start-up measured; nothing else on the load path needs it). A weight nobody fills stays meta (or garbage),
    and the loaders refuse a parameter the checkpoint does not fill."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32):
        super().__init__(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim, dtype=dtype))


class Linear(nn.Module):
    """y = x W^T with W stored either as FP8 + 128x128 block scales (checkpoint layout) or as a float tensor.

    numerics 'fp8': the input is quantized per 128 channels (ue8m0 scales) and the block-scaled product
    accumulates in fp32 (DeepSeek's fp8_gemm). 'dequant': plain float product with the dequantized weight.
    A float weight (bf16 tensors such as eh_proj, or a model being trained) is always a plain product.
    """

    numerics: str = "fp8"

    def __init__(self, in_features: int, out_features: int, fp8_weight: bool, dtype: torch.dtype = torch.float32,
                 scale_rows: int = fp8.BLOCK):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scale_rows = scale_rows  # output rows per scale block: 128, or fewer on a re-blocked rank slice
        if fp8_weight:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=fp8.FP8_DTYPE), requires_grad=False)
            sh = (math.ceil(out_features / scale_rows), math.ceil(in_features / fp8.BLOCK))
            self.weight_scale_inv = nn.Parameter(torch.empty(sh, dtype=torch.float32), requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            self.weight_scale_inv = None

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == fp8.FP8_DTYPE

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.is_fp8:
            return fp8.weight_dequant(self.weight, self.weight_scale_inv, dtype, self.scale_rows)
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x W^T in x.dtype, then cast to `out_dtype` where given (the casts of the logits and of an MTP module's
        eh_proj output to fp32: a column-parallel rank's fast path makes it with the gathered slices' copy,
        `backends.fast_path.FastColumnParallelLinear`)."""
        y = self.matmul(x)
        return y if out_dtype is None else y.to(out_dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in x.dtype, over this module's own rows and columns (subclasses that reduce across ranks build
        their forward on it; the fast path overrides it)."""
        if not self.is_fp8:
            return F.linear(x, self.weight.to(x.dtype))
        if self.numerics == "dequant":
            return F.linear(x, self.dequantized_weight(x.dtype))
        lead = x.shape[:-1]
        x8, sx = fp8.act_quant(x.reshape(-1, self.in_features))
        y = fp8.fp8_gemm_ref(x8, sx, self.weight, self.weight_scale_inv, acc=fp8.acc_dtype(x.dtype),
                             rows=self.scale_rows)
        return y.to(x.dtype).view(*lead, self.out_features)

    def matmul_acc(self, x: torch.Tensor) -> torch.Tensor:
        """`matmul` in the accumulation dtype a = fp8.acc_dtype(x.dtype) (fp32; fp64 for a float64 model): the
        value before the final cast, so a partial sum keeps its bits until a reduction. x.to(a) quantizes
        exactly as x does (act_quant widens to a first). Zero input columns (a rank without a share): zeros."""
        a = fp8.acc_dtype(x.dtype)
        if self.in_features == 0:
            return x.new_zeros((*x.shape[:-1], self.out_features), dtype=a)
        return self.matmul(x.to(a)).to(a)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.is_fp8}"


class MLP(nn.Module):
    """down(silu(gate x) * up x): dense layers, routed experts and the shared expert."""

    def __init__(self, dim: int, inter: int, fp8_weight: bool, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = Linear(dim, inter, fp8_weight, dtype)
        self.up_proj = Linear(dim, inter, fp8_weight, dtype)
        self.down_proj = Linear(inter, dim, fp8_weight, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_proj(x), self.up_proj(x), x.dtype))


def silu_mul(g: torch.Tensor, u: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    a = fp8.acc_dtype(out_dtype)
    return (F.silu(g.to(a)) * u.to(a)).to(out_dtype)


class Rotary(nn.Module):
    """YaRN-scaled rotary frequencies (DeepSeek's precompute_freqs_cis), applied on the fly from positions.

    No table indexed by position: cos/sin come from `pos * inv_freq`, so one compiled step serves any position (the
    fast path's `FastRotary` reads a table of these same values instead, one launch for a forward's slots and angles).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # computed on the CPU, then moved to the default device: on the meta device (every loader builds there,
        # and sets the real table after) arange would run through torch._refs, which imports torch._dynamo
        self.register_buffer("inv_freq", yarn_inv_freq(cfg).to(torch.get_default_device()), persistent=False)
        self.max_positions = cfg.max_position_embeddings

    def angles(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, T] int -> (cos, sin) [B, T, R/2] fp32."""
        ang = pos.float().unsqueeze(-1) * self.inv_freq
        return ang.cos(), ang.sin()

    def angle_table(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [P, R/2] fp32 of every position 0..P-1, P = max_positions: `angles` of them, the same bits
        elementwise (the reference never reads it; the fast path's `FastRotary` gathers a forward's angles from it)."""
        cos, sin = self.angles(torch.arange(self.max_positions, device=device).unsqueeze(0))
        return cos[0], sin[0]

    @staticmethod
    def angle_table_bytes(cfg: ModelConfig) -> int:
        """Bytes of one `angle_table` (the memory planner counts the fast path's, one per device)."""
        return cfg.max_position_embeddings * (cfg.qk_rope_head_dim // 2) * 2 * 4

    def slots(self, seq_lens_B: torch.Tensor, T: int, bound: int | None = None):
        """The cache slots of T new tokens after each row's seq_lens, pos [B, T] = seq_lens[b] + t, and their angles
        (cos, sin) [B, T, R/2]. `bound`: a host-known bound on every slot + 1 (a forward's kv_len), or None."""
        pos_BT = seq_lens_B.unsqueeze(1) + arange(T, seq_lens_B.device)
        return (pos_BT, *self.angles(pos_BT))

    def tree_slots(self, seq_lens_B: torch.Tensor, T: int, depth: torch.Tensor, mask_TU: torch.Tensor, S: int):
        """A tree forward's (`mtp.model.deepseek`'s docstring) cache slots pos [B, T] = seq_lens[b] + t, the angles
        (cos, sin) [B, T, R/2] of its nodes' rotary positions first[b] + depth[t] (first = seq_lens + T - U, the
        tree's first slot; depth [T] or [B, T]) and its visibility [B, T, S] (`tree_visibility`; mask [T, U] or
        [B, T, U]). S: the forward's key bound, above every slot. A method of its own so that a backend can do it in
        one launch (the fast path's `FastRotary`, switch tree_fwd_glue)."""
        pos_BT = seq_lens_B.unsqueeze(1) + arange(T, seq_lens_B.device)
        first_B = seq_lens_B + T - mask_TU.shape[-1]
        cos, sin = self.angles((first_B.unsqueeze(1) + depth).expand_as(pos_BT))
        return pos_BT, cos, sin, tree_visibility(first_B, mask_TU, S)


def tree_visibility(first_B: torch.Tensor, mask_TU: torch.Tensor, S: int) -> torch.Tensor:
    """Bool [B, T, S]: query t of row b sees every slot before the tree (s < first[b]) and the tree slot
    first[b] + u iff mask[t, u] (mask [T, U] or [B, T, U]). Slots past the tree are never visible."""
    T, U = mask_TU.shape[-2:]
    u_BS = torch.arange(S, device=first_B.device).unsqueeze(0) - first_B.unsqueeze(1)
    in_tree_BS = (u_BS >= 0) & (u_BS < U)
    mask_BTU = mask_TU.to(torch.bool).expand(first_B.shape[0], T, U)
    seen_BTS = mask_BTU.gather(2, u_BS.clamp(0, U - 1).unsqueeze(1).expand(-1, T, -1))
    return (u_BS < 0).unsqueeze(1) | (in_tree_BS.unsqueeze(1) & seen_BTS)


def yarn_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The [R/2] fp32 table, always computed on the CPU (in float64) whatever the default device."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    rs = cfg.rope_scaling
    if rs is None or rs.factor <= 1.0:
        return freqs.float()

    def corr_dim(n_rot: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(rs.beta_fast)), 0)
    high = min(math.ceil(corr_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return (freqs / rs.factor * (1 - smooth) + freqs * smooth).float()


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x0, x1), (x2, x3), ... (MLA). x [B, T, ..., R]; cos/sin [B, T, R/2]."""
    shape = x.shape
    xf = x.to(fp8.acc_dtype(x.dtype)).unflatten(-1, (-1, 2))
    while cos.dim() < xf.dim() - 1:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.view(shape).to(x.dtype)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + R/2]) (the indexer's non-interleaved layout)."""
    xf = x.to(fp8.acc_dtype(x.dtype))
    half = x.shape[-1] // 2
    while cos.dim() < xf.dim():
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)


class ElementwiseOps:
    """The elementwise ops between the GEMMs (norms, rotary, activation quant, Hadamard, SiLU-mul).

    Modules call these through their `ops` (the plain functions, `REFERENCE_OPS`, unless `use_elementwise` gave
    their model others), so the Triton fast path can give one model fused versions while another model in the
    process keeps the plain ones. On a CUDA-graph decode step the launch count, not the bytes, is what these cost
    (each plain op is 5-12 small launches). `kind` says which:
    - 'reference': the plain functions below (and `fp8`'s);
    - 'compile': each torch.compile'd (`compiled_ops()`): one or two fused kernels, but tens of seconds of
      compiling at start-up (dynamo recompiles per dtype, rank and size-1 dimension);
    - 'triton': one Triton kernel each (`mtp.kernels.elementwise.triton_ops()`, which passes them as `impl`: the
      reference model imports no kernel), falling back to the plain function for inputs a kernel does not cover.
    Same formulas every way; the fused kernels may round in another order.
    """

    NAMES = ("rms_norm", "layer_norm", "silu_mul", "rope_interleaved", "rope_half", "act_quant", "fake_quant",
             "rotate_activation")
    KINDS = ("reference", "compile", "triton")

    def __init__(self, kind: str = "reference", impl: dict | None = None) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"ElementwiseOps: kind must be one of {self.KINDS}, got {kind!r}")
        if (impl is not None) != (kind == "triton") or (impl is not None and set(impl) != set(self.NAMES)):
            raise ValueError(f"ElementwiseOps: kind 'triton' takes `impl`, a function for each of {self.NAMES} "
                             f"(mtp.kernels.elementwise.triton_ops()); kind {kind!r} got "
                             f"{sorted(impl) if impl is not None else None}")
        self.kind = kind
        if impl is None:
            impl = {"rms_norm": rms_norm, "layer_norm": layer_norm, "silu_mul": silu_mul,
                    "rope_interleaved": rope_interleaved, "rope_half": rope_half, "act_quant": fp8.act_quant,
                    "fake_quant": fp8.fake_quant, "rotate_activation": fp8.rotate_activation}
        if kind == "compile":
            # one compiled function serves many call sites (input dtypes, strides of sliced views): dynamo's
            # default of 8 variants per function is reached on a full step, after which calls silently run unfused
            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, 64)
        for name in self.NAMES:
            setattr(self, name, torch.compile(impl[name], dynamic=True) if kind == "compile" else impl[name])


REFERENCE_OPS = ElementwiseOps()
_COMPILED: list[ElementwiseOps] = []


def compiled_ops() -> ElementwiseOps:
    """The torch.compile'd ops, built once per process (compiling is lazy, at the first call of each)."""
    if not _COMPILED:
        _COMPILED.append(ElementwiseOps("compile"))
    return _COMPILED[0]


def use_elementwise(module: nn.Module, ops: ElementwiseOps) -> None:
    """Every module of `module`'s tree that calls the elementwise ops calls `ops` from now on (other models
    keep theirs)."""
    for m in module.modules():
        if hasattr(type(m), "ops"):
            m.ops = ops


for _cls in (RMSNorm, LayerNorm, MLP):
    _cls.ops = REFERENCE_OPS  # until `use_elementwise` (defined here, after the functions it holds)
