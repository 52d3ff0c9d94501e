"""Count the kernels one forward of the fast path launches, on the CPU, by running it: a measurement of the code
that `mtp.plan.kernels`' launch structure is held to (tests/plan/test_kernel_count.py).

Two kinds of launch are counted while a forward runs under the Triton interpreter (TRITON_INTERPRET=1, chosen
when the kernels are decorated: run this in such a process):
- Triton kernels: `InterpretedFunction.run` is wrapped for the duration, one count per grid launch, by kernel
  name; the torch ops the interpreter itself runs inside a launch are not counted;
- torch ops: a `TorchDispatchMode` sees every aten op below autograd; an op counts as one launch unless it only
  makes a view or allocates (`NO_KERNEL`), which on a GPU launch nothing. On CUDA a few aten ops launch more
  than one kernel (a cuBLAS split-K GEMM its reduction, a sort its passes): the count says one, and the
  comparison with the profiler's count (BENCHMARKS.md) says where that matters.
Each launch is booked to the layer kind running it (`LAYER_KINDS`): the trunk block it is in (dense or MoE by
index), an MTP module, the head (final norm, lm_head, its gather), or glue (embedding, positions, cache
bookkeeping), by forward pre- / post-hooks on those modules. CPU-only branches the GPU never takes (the expert
ids' range check of `moe_experts`, a host read) are listed in `CPU_ONLY` and not counted. With `sites`, each launch is
also booked to the code that issued it (`mtp.bench.step_launches` lists a whole decode step's glue by site).
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch.utils._python_dispatch import TorchDispatchMode

LAYER_KINDS = ("dense", "moe", "mtp", "head", "glue")

# aten ops that make a view, read metadata or allocate: no kernel on a GPU
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "slice", "select", "as_strided", "expand", "permute", "t", "transpose", "squeeze",
    "unsqueeze", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow", "diagonal", "view_as_real",
    "view_as_complex", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
    "_reshape_alias", "unfold", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_has_compatible_shallow_copy_type", "set_", "resize_", "_local_scalar_dense", "is_nonzero", "item",
    "equal", "result_type", "dim", "size", "stride", "numel", "is_contiguous",
    "scalar_tensor",  # a Python number wrapped as a 0-dim CPU tensor (torch.where(c, x, -1)): no device work
})
# collectives: the simulated rank's fake group (`mtp.parallel.simulate`) answers them without a kernel, as in the
# profiled runs; a real group launches one NCCL kernel each (counted apart, `LaunchCount.collectives`)
COLLECTIVES = frozenset({"allreduce_", "_allgather_base_", "allgather_", "_reduce_scatter_base_", "broadcast_",
                         "allgather_into_tensor_coalesced_", "allreduce_coalesced_"})
# kernels whose phases the interpreter runs as launches of their own (a constexpr PHASE; on a GPU one launch, PHASE 0,
# its programs meeting at barriers the interpreter's one-after-another programs would never pass): a launch of a
# phase named here stands for the GPU's one launch, the others are not counted (`kernels.topk_one_launch`,
# `kernels.indexer_one_launch`; the router's split tail, `kernels.router`: phases 1 and 2 where several programs
# route, the one launch, phase 0, where one does)
SPLIT_PHASES = {"_topk_one_launch_kernel": {3}, "_indexer_topk_kernel": {3}, "_route_one_kernel": {0, 2}}
# host reads only the interpreter's CPU tensors make (`moe.moe_experts` checks expert ids when they live on the
# CPU, `if not idx.is_cuda`): ops of that check are not launches on the GPU
CPU_ONLY = frozenset({"min", "max", "aminmax"})  # (its distinct-ids check reads host lists: no aten op)


@dataclass
class LaunchCount:
    """Launches per (layer kind, name): Triton kernels by function name, torch ops as 'aten.<op>'; with `sites`
    (`counting(model, sites=True)`) also per (layer kind, site): the innermost function of mtp outside the kernels'
    wrappers that issued it, as 'folder/file.py:function'."""

    by_name: Counter = field(default_factory=Counter)
    collectives: Counter = field(default_factory=Counter)  # per layer kind
    sites: Counter | None = None

    def total(self, kind: str | None = None) -> int:
        return sum(n for (k, _), n in self.by_name.items() if kind is None or k == kind)

    def per_kind(self) -> dict[str, int]:
        return {k: self.total(k) for k in LAYER_KINDS}

    def names(self, kind: str) -> dict[str, int]:
        return {name: n for (k, name), n in sorted(self.by_name.items()) if k == kind}

    def at_sites(self, kind: str) -> dict[str, int]:
        return {site: n for (k, site), n in sorted((self.sites or {}).items()) if k == kind}


def _site() -> str:
    """'folder/file.py:function' of the innermost frame of mtp's code outside the kernels' wrappers and this module."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        if "/mtp/" in path and "/mtp/kernels/" not in path and not path.endswith("plan/launches.py"):
            return f"{path.rsplit('/mtp/', 1)[1]}:{f.f_code.co_name}"
        f = f.f_back
    return "?"


class _Counter(TorchDispatchMode):
    def __init__(self, count: LaunchCount):
        super().__init__()
        self.count, self.kind, self.inside = count, ["glue"], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and name in COLLECTIVES:
            self.count.collectives[self.kind[-1]] += 1
        elif not self.inside and name not in NO_KERNEL and name not in CPU_ONLY:
            self.count.by_name[(self.kind[-1], f"aten.{name}")] += 1
            if self.count.sites is not None:
                self.count.sites[(self.kind[-1], _site())] += 1
        return func(*args, **(kwargs or {}))


def _kind_of(model, module) -> str | None:
    """The layer kind a module's forward is (None: not one that books its launches)."""
    layers = list(model.model.layers)
    if module in layers:
        return "dense" if layers.index(module) < model.cfg.first_k_dense_replace else "moe"
    if module in list(getattr(model, "mtp", None) or []):
        return "mtp"
    if module is model.lm_head or module is model.model.norm:
        return "head"
    return None


@contextmanager
def counting(model, sites: bool = False):
    """Inside the block, every launch of `model`'s forwards (and of whatever else runs: an engine's step) is counted
    into the yielded `LaunchCount`; `sites`: by issuing site too (`LaunchCount.sites`)."""
    from triton.runtime.interpreter import InterpretedFunction

    count = LaunchCount(sites=Counter() if sites else None)
    mode = _Counter(count)
    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        name, phase = self.fn.__name__, SPLIT_PHASES.get(self.fn.__name__)
        if not mode.inside and (phase is None or kwargs.get("PHASE") in phase):
            count.by_name[(mode.kind[-1], name)] += 1
            if count.sites is not None:
                count.sites[(mode.kind[-1], _site())] += 1
        mode.inside += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            mode.inside -= 1

    hooks = []
    for mod in model.modules():
        kind = _kind_of(model, mod)
        if kind is not None:
            hooks.append(mod.register_forward_pre_hook(lambda m, a, k=kind: mode.kind.append(k) and None))
            hooks.append(mod.register_forward_hook(lambda m, a, o: mode.kind.pop() and None))
    InterpretedFunction.run = counted_run
    try:
        with mode:
            yield count
    finally:
        InterpretedFunction.run = run
        for h in hooks:
            h.remove()
