"""The fast path as a module swap, on the CPU (the kernels themselves are tested on the GPU, tests/kernels/*_gpu.py, and, for the MoE,
under the Triton interpreter in test_moe_ep.py): which classes a module gets, that tensor-parallel modules keep
their own forward and get the fast product, that parameters stay the same tensors, and that swapping back
restores the reference classes and outputs."""

from __future__ import annotations

import torch

from mtp.backends.fast_path import FastLinear, FastMLP, FastMoE, FastParallelMLP, disable_fast_path, fast_module, reference_class
from mtp.model.presets import tiny_config
from mtp.model.fp8 import weight_quant
from mtp.model.layers import MLP, Linear
from mtp.model.moe import MoE
from mtp.parallel.modules import ParallelMLP, RowParallelLinear


class IdentityComm:
    rank, world = 0, 1

    def all_reduce(self, t):
        return t


def fp8_linear(n_in, n_out, cls=Linear, *args):
    lin = cls(n_in, n_out, True, torch.float32, *args)
    w8, s = weight_quant(torch.randn(n_out, n_in) * 0.05)
    lin.weight.data, lin.weight_scale_inv.data = w8, s
    return lin


def test_tensor_parallel_linear_keeps_its_forward_and_gets_the_fast_product():
    row = fp8_linear(256, 128, RowParallelLinear, IdentityComm())
    params = [p.data_ptr() for p in row.parameters()]
    fast_module(row)
    assert isinstance(row, FastLinear) and isinstance(row, RowParallelLinear)
    assert type(row).forward is RowParallelLinear.forward  # the all-reduce stays
    assert type(row).matmul_acc is FastLinear.matmul_acc  # the kernel computes the partial
    assert [p.data_ptr() for p in row.parameters()] == params
    disable_fast_path(row)
    assert type(row) is RowParallelLinear
    assert reference_class(RowParallelLinear) is RowParallelLinear


def test_float_linears_keep_the_reference_and_parallel_mlps_fuse_gate_up():
    lin = Linear(64, 32, False, torch.float32)
    fast_module(lin)
    assert type(lin) is Linear  # bf16 heads stay on torch
    pm = ParallelMLP(256, 128, True, torch.float32, IdentityComm())
    fast_module(pm)
    assert isinstance(pm, FastParallelMLP) and pm.fused_gate_up is not None  # this rank's gate | up as one
    assert type(pm).forward is FastParallelMLP.forward and type(pm).partial is FastParallelMLP.partial
    disable_fast_path(pm)
    assert type(pm) is ParallelMLP


def test_swap_back_restores_reference_outputs():
    torch.manual_seed(0)
    mlp = MLP(256, 256, True, torch.float32)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, fp8_linear(256, 256))
    x = torch.randn(3, 256)
    want = mlp(x)
    fast_module(mlp)
    assert isinstance(mlp, FastMLP) and mlp.fused_gate_up is not None
    assert mlp.gate_proj.weight.data_ptr() == mlp.fused_gate_up[0].data_ptr()  # a view of the stack
    disable_fast_path(mlp)
    assert type(mlp) is MLP and torch.equal(mlp(x), want)

    cfg = tiny_config()
    moe = MoE(cfg, torch.float32)
    for mlp in [moe.expert(e) for e in range(moe.e0, moe.e1)] + [moe.shared_experts]:
        for name in ("gate_proj", "up_proj", "down_proj"):
            old = getattr(mlp, name)
            setattr(mlp, name, fp8_linear(old.in_features, old.out_features))
    moe.gate.weight.data.normal_(0, 0.1)
    x = torch.randn(4, cfg.hidden_size)
    want = moe(x)
    assert torch.isfinite(want).all()
    fast_module(moe)
    # n_shared = 1 at one process: the shared expert is the stack's last entry (`stack_experts`)
    assert isinstance(moe, FastMoE) and moe.stacked["down_proj.weight"].shape[0] == cfg.n_routed_experts + 1
    assert moe.shared_index == cfg.n_routed_experts
    disable_fast_path(moe)
    assert type(moe) is MoE and torch.equal(moe(x), want)
