"""The decode step's fused pieces against their unfused references (run on the device: pytest -m gpu).

- `cache_write` (one launch) writes exactly the bytes `LayerCache.write` writes (FP8 latent + scales, indexer
  key + scale, rotary key), at per-row positions, leaving every other slot untouched.
- `fuse_rows` stacked projections: one fp8_linear over the stacked weight equals the separate fp8_linears.
MTP_TEST_DEVICE=cpu with TRITON_INTERPRET=1 dry-runs them on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
DEV = os.environ.get("MTP_TEST_DEVICE", "cuda")
if not (available() or (DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.model.cache import KVCache  # noqa: E402
from mtp.backends.fast_path import fuse_rows  # noqa: E402
from mtp.model.fp8 import weight_quant  # noqa: E402
from mtp.kernels.cache_write import cache_write  # noqa: E402
from mtp.kernels.fp8_gemm import fp8_linear  # noqa: E402
from mtp.model.layers import Linear  # noqa: E402
from mtp.model.presets import real_config  # noqa: E402


@pytest.mark.parametrize("B,T", [(1, 1), (3, 4), (2, 17)])
def test_cache_write_matches_layer_cache_write(B, T):
    cfg = real_config(layers=1, dense_layers=1, mtp_modules=0)
    S = 64
    caches = [KVCache(cfg, 2, B, S, device=DEV, dtype=torch.bfloat16, quantized=True) for _ in range(2)]
    g = torch.Generator(device=DEV).manual_seed(B * 100 + T)
    for kv in caches:  # same non-trivial prior contents in both
        kv.kv.copy_((torch.randn(kv.kv.shape, device=DEV, generator=g) * 50).to(kv.kv.dtype))
        g.manual_seed(B * 100 + T)
    start = torch.randint(0, S - T, (B,), device=DEV, generator=g)
    pos = start[:, None] + torch.arange(T, device=DEV)
    c = torch.randn(B, T, cfg.kv_lora_rank, device=DEV, generator=g).to(torch.bfloat16) * 3
    c[0, 0, :128] = 0  # an all-zero group: the amax floor
    pe = torch.randn(B, T, cfg.qk_rope_head_dim, device=DEV, generator=g).to(torch.bfloat16)
    k = torch.randn(B, T, cfg.index_head_dim, device=DEV, generator=g) * 0.1  # fp32, as the indexer keys are
    ref, ours = caches[0].layer(1), caches[1].layer(1)
    ref.write(pos, c, pe, k)
    cache_write(ours, pos, c, pe, k)
    for name in ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale"):
        a, b = getattr(caches[0], name), getattr(caches[1], name)
        same = a.view(torch.uint8) == b.view(torch.uint8) if a.element_size() == 1 else a == b
        assert bool(same.all()), f"{name}: {int((~same).sum())} elements differ"


def test_cache_write_rejects_bf16_cache():
    cfg = real_config(layers=1, dense_layers=1, mtp_modules=0)
    kv = KVCache(cfg, 1, 1, 8, device=DEV, dtype=torch.bfloat16, quantized=False)
    with pytest.raises(ValueError, match="not quantized"):
        cache_write(kv.layer(0), torch.zeros(1, 1, dtype=torch.long, device=DEV),
                    torch.zeros(1, 1, 512, device=DEV), torch.zeros(1, 1, 64, device=DEV),
                    torch.zeros(1, 1, 128, device=DEV))


def _lin(n, k):
    lin = Linear(k, n, True).to(DEV)
    w8, s = weight_quant(torch.randn(n, k, device=DEV) * 0.02)
    lin.weight.data, lin.weight_scale_inv.data = w8, s
    return lin


@pytest.mark.parametrize("M", [1, 4, 33])
def test_fused_projections_equal_separate(M):
    parts = [_lin(1536, 1024), _lin(128, 1024), _lin(576, 1024)]  # q_a | indexer wk | kv_a (last may be ragged)
    x = torch.randn(M, 1024, device=DEV).to(torch.bfloat16)
    sep = [fp8_linear(x, p.weight, p.weight_scale_inv, out_dtype=torch.float32) for p in parts]
    w, s = fuse_rows(parts)
    fused = fp8_linear(x, w, s, out_dtype=torch.float32)
    torch.testing.assert_close(fused, torch.cat(sep, -1), rtol=1e-5, atol=1e-5)
    # the parts now read their rows of the stack
    again = [fp8_linear(x, p.weight, p.weight_scale_inv, out_dtype=torch.float32) for p in parts]
    for a, b in zip(sep, again):
        assert torch.equal(a, b)
