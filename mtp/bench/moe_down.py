"""Time the persistent experts with their down projection as the item loop (old) and as one flattened loop per
program (`moe_experts(down_flat=True)`, switch `moe_down_flat`), side by side on one GPU.

    python -m mtp.bench.moe_down [--out DIR] [--quick]

One TP=8 'split' rank's stack (256 routed experts + the shared one, each 256 wide: I = 256, D = 7168), T = 1..4
tokens of 8 routed experts + the shared slot, called as the fast path calls it (persistent layout, splits='waves',
shared=True; at T = 1 also with PDL, as `FastPathOptions.pdl_at(1)` runs it). Each call is gate/up + down + combine:
the difference between the rows is the down kernel's. Every flat variant is checked bit for bit against the old
kernel on every routing before it is timed; rows also give the down projection's bytes over the copy bandwidth
(the down floor). Not --quick: the flat loop's pipeline depth (down_stages 3 / 4 / 6; default 5) and one program
per SM. Timing as `mtp.bench.topk_moe`: CUDA-graph replays over 8 routings (other experts' weights each call, from
HBM), CUDA events, median of 15. Writes DIR/gpu_moe_down.json (DIR: $OUT, else eval/results).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from mtp.bench.kernels import graph_us, report
from mtp.bench.topk_moe import CHECKS, DEV, ROWS, _expert_stack, _sms, check, copy_bandwidth, log, row, table


def down_section(quick: bool, D: int = 7168, I: int = 256, E: int = 256) -> None:
    """The old and flat down kernels in `moe_experts` at T = 1..4 (module docstring)."""
    from mtp.kernels.moe import moe_experts

    bw = copy_bandwidth()
    log(f"[bw] copy {bw / 1e9:.0f} GB/s")
    g = torch.Generator().manual_seed(0)
    ws = _expert_stack(E + 1, I, D)  # E routed slices + the shared one, one stack
    down_bytes = D * I + (D // 128) * (I // 128) * 4  # one slice's down weight and scales
    sm = _sms()
    for T in (1, 2, 3, 4):
        x = torch.randn(T, D, device=DEV).bfloat16()
        rw = torch.rand(T, 8, device=DEV)
        sets = [torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(T)]).int().to(DEV) for _ in range(8)]
        active = sum(len(set(s.flatten().tolist())) + 1 for s in sets) / len(sets)
        floor_us = active * down_bytes / bw * 1e6
        shape = f"split TP=8 T={T} ({active:.1f} slices)"
        variants = [("old", dict()), ("flat", dict(down_flat=True))]
        if T == 1:
            variants += [("old pdl", dict(pdl=True)), ("flat pdl", dict(down_flat=True, pdl=True))]
        if not quick:
            variants += [(f"flat {s} stages", dict(down_flat=True, down_stages=s)) for s in (3, 4, 6)]
            variants += [(f"flat {sm} programs", dict(down_flat=True, programs=(sm, sm)))]

        def call(s, **kw):
            return moe_experts(x, s, rw, *ws, out_dtype=torch.float32, layout="persistent", splits="waves",
                               shared=True, **kw)

        want = [call(s) for s in sets]
        res = {}
        for name, kw in variants:
            try:
                same = all(torch.equal(call(s, **kw), w) for s, w in zip(sets, want))
                us = graph_us([lambda s=s: call(s, **kw) for s in sets])
            except Exception as e:  # a config that does not fit (shared memory): said so, the others still run
                log(f"[down] {shape} {name} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            check(f"moe_experts {shape} {name} = old, bit for bit", same)
            res[name] = us
            row("down", shape, name, us, down_floor_us=round(floor_us, 2))
        if "old" in res and "flat" in res:
            log(f"[down] {shape}: flat - old = {res['flat'] - res['old']:+.2f} us (down floor {floor_us:.2f} us)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "eval/results"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    import triton

    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    down_section(args.quick)
    report(out, ROWS, CHECKS, t0, os.path.join(args.out, "gpu_moe_down.json"), table())


if __name__ == "__main__":
    main()
