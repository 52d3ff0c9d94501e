"""The elementwise kernels (`mtp/kernels/elementwise.py`) vs their references on the GPU at DeepSeek-V3.2's widths
(pytest -m gpu), and the bundled model's greedy tokens with the Triton glue vs the eager glue.

Widths: hidden 7168 (the residual stream's norms, fp32 in, bf16 out), q_lora 1536 and kv_lora 512 (norms of slices
of the q_a | wk | kv_a output), the indexer's 128 (its key LayerNorm, half rotary on the first 64, Hadamard, fake
quant), q rope 64 over 128 heads (TP=1) and 16 (one TP=8 rank), gate | up halves of 2 x 18432 (dense MLP) and
2 x 2048 (shared expert); 1 and 4 tokens (verify widths w = 1, K + 1), batches of 1 and 3.
Bit for bit: rotary (both layouts), silu_mul (libdevice expf and IEEE division, as torch's CUDA silu), act_quant
and fake_quant. Within a bound (`tests/kernels/test_elementwise._check`): rms_norm, layer_norm (their row sums
in another order: one bf16 ulp of the output, 8 / 16 fp32 ulps of an fp32 one), rotate_activation (the tl.dot's
sum order vs cuBLAS': 8 fp32 ulps of sum |x| / sqrt(n)).
The model check: strict greedy decoding of the bundled (trained) model, fast path, bf16, Triton glue vs eager glue:
the logits of one verify block differ only by the norms' and the Hadamard's last-bit roundings, and the FP8
roundings those may flip (relative L2 < 1e-2), and the tokens of the prompts below are equal in eager and graph
mode: a trained model's greedy margins are far above that (random weights would have near-ties, hence this model).
"""

from __future__ import annotations

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
DEV = "cuda"
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.kernels import elementwise as E  # noqa: E402
from mtp.model import fp8  # noqa: E402

from .test_elementwise import _check, _check_exact  # noqa: E402
from .test_kernels_gpu import poison  # noqa: E402

WIDTHS = [(1, 1), (1, 4), (3, 4)]  # (B, T)
DTYPES = [torch.bfloat16, torch.float32]


def _rand(*shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def _equal(name, got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    same = got.view(torch.uint8) == want.view(torch.uint8) if got.element_size() == 1 else got == want
    if not bool(same.all()):
        i = tuple(torch.nonzero(~same)[0].tolist())
        pytest.fail(f"{name}: {int((~same).sum())} of {same.numel()} differ; first at {list(i)}: "
                    f"{got[i].float().item()!r} vs {want[i].float().item()!r}")


@pytest.mark.parametrize("B,T", WIDTHS)
@pytest.mark.parametrize("dt", DTYPES)
def test_norms(B, T, dt):
    h = _rand(B, T, 7168, scale=3)  # the residual stream (fp32) -> model dtype
    w = (torch.rand(7168, device=DEV) + 0.5).to(dt)
    poison()
    _check("rms_norm 7168", E.rms_norm(h, w, 1e-6, dt), E.rms_norm_ref(h, w, 1e-6, dt), 8)
    a = _rand(B, T, 1536 + 128 + 576, scale=2, dtype=dt)  # q_a | wk | kv_a of one GEMV
    for name, x in (("q_a 1536", a[..., :1536]), ("kv_a 512", a[..., 1664:1664 + 512])):
        wx = (torch.rand(x.shape[-1], device=DEV) + 0.5).to(dt)
        _check(f"rms_norm {name}", E.rms_norm(x, wx, 1e-6, dt), E.rms_norm_ref(x, wx, 1e-6, dt), 8)
    k = a[..., 1536:1664] + 1  # wk's slice, mean ~1 (the LayerNorm's mean matters)
    lw, lb = torch.rand(128, device=DEV) + 0.5, torch.randn(128, device=DEV) * 0.3
    kf = k.double()
    rstd = torch.rsqrt(kf.var(-1, unbiased=False, keepdim=True) + 1e-6)
    scale = (kf.abs() + kf.mean(-1, keepdim=True).abs()) * rstd * lw.double() + lb.double().abs()
    _check("layer_norm 128", E.layer_norm(k, lw, lb, 1e-6), E.layer_norm_ref(k, lw, lb, 1e-6), 16, scale)


@pytest.mark.parametrize("B,T", WIDTHS)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("N", [18432, 2048])
def test_silu_mul_bit_exact(B, T, dt, N):
    gu = _rand(B, T, 2 * N, scale=4, dtype=dt)
    gu[0, 0, :8] = torch.tensor([-100.0, -88.0, -20.0, 0.0, 1e-20, 20.0, 88.0, 100.0])  # exp's edges
    poison()
    _equal(f"silu_mul {N} {dt}", E.silu_mul(gu[..., :N], gu[..., N:], dt), E.silu_mul_ref(gu[..., :N], gu[..., N:], dt))


@pytest.mark.parametrize("B,T", WIDTHS)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("H", [128, 16])
def test_rotary_bit_exact(B, T, dt, H):
    P, R, C = 128, 64, 512
    pos = torch.arange(B * T, device=DEV).view(B, T) * 977 + 5
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2, device=DEV).float() / R))
    ang = pos.float().unsqueeze(-1) * inv
    cos, sin = ang.cos(), ang.sin()
    q = _rand(B, T, H * (P + R) + 64 * 128, dtype=dt)  # q_b | wq_b of one GEMV
    q_pe = q[..., :H * (P + R)].view(B, T, H, P + R)[..., P:]
    kv = _rand(B, T, C + R, dtype=dt)
    poison()
    _equal("rope_interleaved q_pe", E.rope_interleaved(q_pe, cos, sin), E.rope_interleaved_ref(q_pe, cos, sin))
    _equal("rope_interleaved k_pe", E.rope_interleaved(kv[..., C:], cos, sin),
           E.rope_interleaved_ref(kv[..., C:], cos, sin))
    _equal("rope_interleaved cos [1, T, R/2]", E.rope_interleaved(q_pe, cos[:1], sin[:1]),
           E.rope_interleaved_ref(q_pe, cos[:1], sin[:1]))
    iq = q[..., H * (P + R):].view(B, T, 64, 128)
    ik = _rand(B, T, 128, dtype=dt)
    _equal("rope_half queries", E.rope_half(iq[..., :R], cos, sin), E.rope_half_ref(iq[..., :R], cos, sin))
    _equal("rope_half keys", E.rope_half(ik[..., :R], cos, sin), E.rope_half_ref(ik[..., :R], cos, sin))


@pytest.mark.parametrize("B,T", WIDTHS)
@pytest.mark.parametrize("dt", DTYPES)
def test_hadamard_and_quant(B, T, dt):
    for shape in ((B, T, 128), (B, T, 64, 128)):
        x = _rand(*shape, scale=2, dtype=dt)
        poison()
        scale = x.double().abs().sum(-1, keepdim=True).expand(shape) * 128 ** -0.5
        _check(f"rotate_activation {list(shape)}", E.rotate_activation(x), E.rotate_activation_ref(x), 8, scale)
    basis = torch.zeros(B, T, 128, device=DEV, dtype=dt)
    basis[..., 77] = 1
    _check_exact("rotate_activation basis", E.rotate_activation(basis),
                 (fp8.hadamard_matrix(128, device=DEV)[77] * 128 ** -0.5).expand(B, T, 128).contiguous())
    iq = _rand(B, T, 64, 128, dtype=dt) * torch.logspace(-6, 2, 128, device=DEV).to(dt)
    iq[0, 0, 0] *= 1e-4  # a head under the amax floor
    x8, s = E.act_quant(iq)
    r8, rs = fp8.act_quant(iq)
    _equal("act_quant codes", x8, r8)
    _equal("act_quant scales", s, rs)
    for x in (iq.float(), iq):  # the indexer quantizes its fp32 queries; a bf16 input too
        _equal(f"fake_quant {x.dtype}", E.fake_quant(x), fp8.fake_quant(x))


def test_float64_and_cpu_stay_on_the_reference():
    x = torch.randn(2, 3, 128, device=DEV, dtype=torch.float64)
    assert "float64" in E.reference_reason("rotate_activation", x)
    assert torch.equal(E.rotate_activation(x), fp8.rotate_activation(x))
    c = torch.randn(2, 3, 128)
    assert "device cpu" in E.reference_reason("rotate_activation", c)
    assert torch.equal(E.rotate_activation(c), fp8.rotate_activation(c))


def test_bundled_model_greedy_tokens_triton_glue_equal_eager_glue():
    import mtp
    from mtp.backends.fast_path import enable_fast_path, set_elementwise
    from mtp.checkpoint.tiny import default_checkpoint
    from mtp.decode.engine import generate
    from mtp.text.tokenizer import Tokenizer

    path = default_checkpoint()
    tok = Tokenizer.from_dir(path)
    texts = ["def parse_args(argv):\n    ", "import os\n\n\ndef read_lines(path):\n    ", "class Stack:\n    def "]
    prompts = [[tok.bos_id] + tok.encode(t) for t in texts]
    model = mtp.load_model(path, device="cuda", dtype=torch.bfloat16)
    enable_fast_path(model, elementwise="eager")
    ids = torch.tensor([prompts[0]], device="cuda")

    def verify_logits():
        kv = model.new_cache(1, 64)
        with torch.no_grad():
            model(ids[:, :-4], kv)
            return model(ids[:, -4:], kv).logits.double()

    want_logits = verify_logits()
    want = {m: generate(model, prompts, 48, draft="eagle", k=3, mode=m).tokens for m in ("eager", "graph")}
    set_elementwise(model, "triton")
    assert all(m.ops.kind == "triton" for m in model.modules() if hasattr(type(m), "ops"))
    got_logits = verify_logits()
    rel = ((got_logits - want_logits).norm() / want_logits.norm()).item()
    print(f"verify logits, Triton vs eager glue: rel L2 {rel:.2e}")
    assert rel < 1e-2
    for m in ("eager", "graph"):
        got = generate(model, prompts, 48, draft="eagle", k=3, mode=m).tokens
        assert got == want[m], f"mode {m}: Triton glue tokens differ from the eager glue's"
    assert want["graph"] == want["eager"]
