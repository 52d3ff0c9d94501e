"""A tree step's glue after the commit kernel in one launch (`mtp.kernels.tree_commit`, switch
`FastPathOptions.tree_glue`), bit for bit against its torch reference (`KVCache.compact` + `tree_step.keep_path`), on
the CPU.

Shape legend: L layers, B rows, S slots, A path nodes (root first), D depth, C sibling ranks, N nodes, H hidden width.

- In-process: the switch (on by default), its bench variant, the shapes the kernel refuses.
- Under the Triton interpreter (a subprocess, this file as a script; one check of a few seconds): random committed
  steps at B = 1 and 3, A = 3 and 5 (odd), L = 2 layers of an FP8 cache (bytes moved) and one of a float64 one, rows
  with keep = 1, keep = A and an inactive row (keep 0), paths whose source slots are other nodes' destinations (node
  i's source another node's destination: the loads must all precede the stores), a row whose nodes end at the
  buffer's last slot, a strided h: every cache buffer (bytes past the new length included), the lengths, the hidden
  rows and the counters torch.equal. The engine with the switch on vs all torch: tests/kernels/test_step_commit.py's
  interpreted engine run (an eagle 2x1 tree, step_commit off vs on: the tree glue is on by default).
GPU twin (real widths, CUDA graph capture + replay, the whole tree step on and off):
tests/kernels/test_tree_commit_gpu.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402


def test_switch_is_on_by_default_with_a_bench_variant():
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    assert FastPathOptions().tree_glue
    assert KERNEL_VARIANTS["tree_glue_off"][0] == {"tree_glue": False}


def test_without_a_gpu_or_the_interpreter_the_torch_ops_stay():
    from mtp.kernels.tree_commit import tree_commit_takes

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter takes CPU tensors")
    st, h, path, *_, live = random_step(torch.Generator().manual_seed(0), 2, 3, 1, 6, 8, False, torch.float32)
    assert not tree_commit_takes(st.cache, st.hidden, h, path, st.rank_DC, live)


def test_kernel_compiles_for_hopper():
    """The kernel compiles for sm_90 (triton's own ptxas, no GPU) at the real model's widths (FP8 cache bytes, bf16
    hidden rows) with no local-memory spill; with PDL (switch glue_pdl), its trigger at the start (PDL_EARLY) or after
    its wait (PDL_AFTER_WAIT), it waits once, before its first global load or store (`test_pdl._order`)."""
    pytest.importorskip("triton")
    from tests.kernels.test_fused_kernels import _compile_for_hopper
    from tests.kernels.test_pdl import _order

    from mtp.kernels.tree_commit import _tree_commit_kernel

    ptrs = {"kv_ptr": "*u8", "kvs_ptr": "*i32", "pe_ptr": "*i16", "ik_ptr": "*u8", "iks_ptr": "*i32", "hid_ptr": "*i16",
            "h_ptr": "*i16", "act_ptr": "*u8", "live_ptr": "*u8"}
    ptrs |= {n: "*i64" for n in ("lens_ptr", "n_ptr", "keep_ptr", "path_ptr", "acc_ptr", "rank_ptr", "rdc_ptr",
                                 "lnodes_ptr")}
    widths = dict(KV_W=512, KVS_W=4, PE_W=64, IK_W=128, BLOCK_KV=512, BLOCK_KVS=4, BLOCK_PE=64, BLOCK_IK=128,
                  BLOCK_H=1024, BLOCK_A=4, BLOCK_D=4, BLOCK_C=2, BLOCK_N=8)
    gdc = ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]
    for pdl in (1, 2):
        ptx = _compile_for_hopper(_tree_commit_kernel, ptrs, dict(widths, PDL=pdl), num_warps=4).asm["ptx"]
        assert ".local" not in ptx
        order = _order(ptx)
        assert order[:2] == (gdc if pdl == 1 else gdc[::-1]) and order.count("griddepcontrol.wait") == 1, order[:4]


def test_tree_commit_interpreted():
    run_interpreted(__file__, 300, "kernel")


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1 too
def random_step(g: torch.Generator, B: int, A: int, L: int, N: int, H: int, quantized: bool, dtype: torch.dtype,
                S: int = 24, device: str = "cpu", cfg=None):
    """A tree step's state after its commit, random but consistent: (st, h_BND, path_BA, n_before_B, active_B,
    accepted_B, rank_N, live_BN). Row 0 keeps 1 token, the last (B > 1) is inactive (keep 0), the middle keeps A; path
    nodes drawn so that sources meet destinations (row 0: node i read from node D + 1 - i's slot); the last active row's
    nodes end at the buffer's last slot. cfg: the cache's model config (tiny_config's by default)."""
    from mtp.model.cache import KVCache
    from mtp.model.presets import tiny_config

    def ints(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=g).to(device)

    cfg = cfg or tiny_config()
    cache = KVCache(cfg, L, B, S, device=device, dtype=dtype, quantized=quantized)
    for buf in (cache.kv, cache.kv_scale, cache.pe, cache.idx_k, cache.idx_k_scale):
        buf.copy_(torch.randn(buf.shape, generator=g).to(device) * 4)
    D = A - 1
    keep = [1] + [A] * (B - 2) + [0] if B > 1 else [1]
    active = torch.tensor([k > 0 for k in keep], device=device)
    keep_B = torch.tensor(keep, device=device)
    # the committed length before: room for N nodes at n-1..; the last active row near the end of the buffer
    n0 = ints(2, S - N, B)
    if B > 1:
        n0[-2] = S - N + 1  # its last node at the cache's last slot
    path = torch.cat((torch.zeros(B, 1, dtype=torch.long, device=device), ints(1, N, B, D)), 1)
    path[0, 1:] = torch.arange(D, 0, -1, device=device)  # node i from slot D + 1 - i: sources and destinations cross
    accepted = torch.where(active, keep_B - 1, ints(0, A, B))  # inactive rows: any accept length (not counted)
    accepted[0] = ints(0, A, 1)[0]  # keep 1 for another reason (a stop, the budget): the accept length still counts
    hidden = torch.randn(B, S, H, generator=g).to(device=device, dtype=dtype)
    st = SimpleNamespace(cache=cache, hidden=hidden, n_B=n0 + keep_B, keep_B=keep_B, max_len=S,
                         rank_DC=ints(0, 5, D, 3), live_nodes=ints(0, 9))
    cache.seq_lens.copy_(ints(0, S, B))  # the kernel sets them as compact does (the commit kernel wrote the same)
    h = torch.randn(B, N + 2, H, generator=g).to(device=device, dtype=dtype)[:, 1:N + 1]  # a strided view
    rank_N = ints(0, 3, N)
    live = ints(0, 4, B, N) > 0
    return st, h, path, n0, active, accepted, rank_N, live


def reference(st, h, path, n0, active, accepted, rank_N, live) -> None:
    """The torch ops the kernel replaces (switch tree_glue off), on `st` in place."""
    from mtp.decode.tree_step import keep_path

    A = path.shape[1]
    ar = torch.arange(A, device=path.device)
    st.cache.compact(n0 - 1, path, st.keep_B)
    pos = (n0.unsqueeze(1) + ar).clamp_max(st.max_len - 1)
    keep_path(st, h, path, pos, ar < st.keep_B.unsqueeze(1), accepted, active, rank_N, live)


def kernel(st, h, path, n0, active, accepted, rank_N, live, pdl: int = 0) -> None:
    from mtp.kernels.tree_commit import tree_commit

    tree_commit(st.cache, st.n_B, st.keep_B, path, st.hidden, h, active, accepted, rank_N, st.rank_DC, live,
                st.live_nodes, pdl)


def state(st) -> dict:
    c = st.cache
    out = {n: getattr(c, n) for n in ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale", "seq_lens")}
    out = {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in out.items()}  # NaN bits too
    return out | {k: getattr(st, k) for k in ("hidden", "n_B", "keep_B", "rank_DC", "live_nodes")}


def check(st, args, run) -> list[str]:
    """The names of the tensors `run(st, *args)` leaves unlike the reference's."""
    import copy

    want, got = copy.deepcopy(st), copy.deepcopy(st)
    reference(want, *args)
    run(got, *args)
    a, b = state(want), state(got)
    return [k for k in a if not torch.equal(a[k], b[k])]


def _kernel_checks() -> None:
    g = torch.Generator().manual_seed(0)
    cases = 0
    cases_BALNH = ((1, 3, 2, 4, 24, True, torch.bfloat16), (3, 5, 2, 9, 40, True, torch.bfloat16),
                   (3, 3, 1, 7, 17, False, torch.float64))  # FP8 caches (bytes) and a float64 one
    for B, A, L, N, H, quantized, dtype in cases_BALNH:
        for _ in range(2):
            st, *args = random_step(g, B, A, L, N, H, quantized, dtype)
            bad = check(st, args, kernel)
            assert not bad, (B, A, L, quantized, dtype, bad)
            cases += 1
    # what the kernel does not take keeps the torch ops; a direct call of such a step is refused by name
    from mtp.kernels.tree_commit import MAX_A, tree_commit_takes

    st, h, path, n0, active, accepted, rank_N, live = random_step(g, 2, 3, 1, 6, 8, False, torch.float32)
    assert tree_commit_takes(st.cache, st.hidden, h, path, st.rank_DC, live)
    assert not tree_commit_takes(st.cache, st.hidden, h.double(), path, st.rank_DC, live)  # another dtype
    assert not tree_commit_takes(st.cache, st.hidden, h, path[:, :2], st.rank_DC, live)  # not D + 1 nodes
    long_path = torch.zeros(2, MAX_A + 1, dtype=torch.long)
    assert not tree_commit_takes(st.cache, st.hidden, h, long_path, torch.zeros(MAX_A, 2, dtype=torch.long), live)
    with pytest.raises(ValueError, match="tree_commit: takes .* an int64 path"):
        kernel(st, h, path.int(), n0, active, accepted, rank_N, live)
    print(f"kernel checks ok ({cases} random steps)")


if __name__ == "__main__":
    interpreted_main([_kernel_checks])
