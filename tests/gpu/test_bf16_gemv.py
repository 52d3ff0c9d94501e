"""bf16 weight-streaming GEMV (lm_head, MTP heads, eh_proj) vs the fp32 reference over odd shapes."""

import pytest
import torch

from mtp.kernels import available
from mtp.kernels.bf16_gemv import gemv, gemv_ref

pytestmark = pytest.mark.gpu
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)


@pytest.mark.parametrize("M,N,K", [(1, 129280, 7168), (4, 7168, 14336), (3, 1000, 7168), (16, 257, 2048), (7, 33, 256)])
def test_gemv_matches_reference(M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M * N + K)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = torch.randn(N, K, device="cuda", generator=g).bfloat16() / K ** 0.5
    y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    y.copy_(gemv(x, w))
    ref = gemv_ref(x, w).float()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert not torch.isnan(y).any() and rel < 8e-3, f"M={M} N={N} K={K}: rel {rel:.2e}"
