"""The GPUs the speed model knows: peak dense FP8 / bf16 throughput, HBM bandwidth, the link collectives use,
and where each figure comes from. Units: TFLOPS (dense, no sparsity), GB/s (1e9 B/s), us.

`link_gbps` is one direction of the GPU's scale-up link (NVLink, or PCIe where there is none); `net_gbps` is its
scale-out NIC (between nodes). `link_latency_us` is one of the log2(p) steps of a small all-reduce: an
ASSUMPTION, 3.3 us on NVLink so that 8 ranks cost 10 us per all-reduce (the figure `mtp-bench --tp 8` assumes;
NCCL's small-message all-reduce on 8 NVLink GPUs is commonly 8-15 us; `mtp.bench.collectives` measures ours).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    fp8_tflops: float
    bf16_tflops: float
    hbm_gb: float
    hbm_gbps: float
    link_gbps: float
    net_gbps: float
    link_latency_us: float
    link: str
    source: str
    gpus_per_node: int = 8
    default_tp: int = 8
    mlp_split: str = "blocks"  # the MLP split this GPU's default TP needs (see mtp.parallel.layout)

    def allreduce_us(self, nbytes: float, ranks: int, nodes: int = 1) -> float:
        """One all-reduce of `nbytes` per rank over `ranks`: ring bandwidth term 2 (p-1)/p * bytes / bw plus a
        latency of log2(p) steps (recursive doubling / tree for small messages). Across nodes the slower of
        the link and the NIC bounds the ring."""
        if ranks <= 1:
            return 0.0
        bw = self.link_gbps if nodes <= 1 else min(self.link_gbps, self.net_gbps)
        return 2 * (ranks - 1) / ranks * nbytes / (bw * GB) * 1e6 + math.ceil(math.log2(ranks)) * self.link_latency_us

    def alltoall_us(self, nbytes: float, nodes: int = 1) -> float:
        """Dispatch or combine: `nbytes` leave each rank; over the NIC between nodes (DeepEP / IBGDA style)."""
        bw = self.link_gbps if nodes <= 1 else self.net_gbps
        return nbytes / (bw * GB) * 1e6 + self.link_latency_us


# Figures are the vendors' dense (non-sparse) peaks. NVLink: 900 GB/s bidirectional on H100/H200/H20 = 450 GB/s
# one way; H800's NVLink is cut to 400 GB/s bidirectional. NIC: one 400 Gb/s ConnectX-7 per GPU = 50 GB/s.
GPUS: dict[str, GPU] = {g.name: g for g in (
    # NVIDIA H800 SXM5 product brief: FP8 1979 / BF16 989.5 TFLOPS dense, 80 GB HBM3 3.35 TB/s, NVLink 400 GB/s.
    GPU("h800", 1979.0, 989.5, 80, 3350, 200, 50, 3.3, "NVLink (400 GB/s bidir)", "NVIDIA H800 SXM5 brief"),
    # NVIDIA H100 SXM5 datasheet: FP8 1979 / BF16 989.5 dense, 80 GB HBM3 3.35 TB/s, NVLink4 900 GB/s.
    GPU("h100", 1979.0, 989.5, 80, 3350, 450, 50, 3.3, "NVLink4 (900 GB/s bidir)", "NVIDIA H100 SXM5 datasheet"),
    # NVIDIA H200 SXM datasheet: H100's compute, 141 GB HBM3e 4.8 TB/s, NVLink4 900 GB/s.
    GPU("h200", 1979.0, 989.5, 141, 4800, 450, 50, 3.3, "NVLink4 (900 GB/s bidir)", "NVIDIA H200 SXM datasheet"),
    # NVIDIA H20 (China SKU) brief: FP8 296 / BF16 148 dense, 96 GB HBM3 4.0 TB/s, NVLink 900 GB/s.
    # (zartbot's analysis assumes 3.35 TB/s for it; see mtp.plan.published.)
    GPU("h20", 296.0, 148.0, 96, 4000, 450, 50, 3.3, "NVLink (900 GB/s bidir)", "NVIDIA H20 brief"),
    # H20 with 141 GB HBM3e (H20-3e): same compute, 4.8 TB/s (as zartbot's analysis and vendor listings give it).
    GPU("h20-3e", 296.0, 148.0, 141, 4800, 450, 50, 3.3, "NVLink (900 GB/s bidir)", "H20 141 GB HBM3e listings"),
    # NVIDIA HGX B200 datasheet, per GPU: FP8 4.5 / BF16 2.25 PFLOPS dense, 180 GB HBM3e 8 TB/s, NVLink5 1.8 TB/s.
    GPU("b200", 4500.0, 2250.0, 180, 8000, 900, 50, 3.3, "NVLink5 (1.8 TB/s bidir)", "NVIDIA HGX B200 datasheet"),
    # NVIDIA L40S datasheet: FP8 733 / BF16 362 TFLOPS dense (1466 / 733 with sparsity), 48 GB GDDR6 864 GB/s,
    # PCIe Gen4 x16 (64 GB/s bidir, ~25 GB/s one way achieved by NCCL rings), no NVLink. 32 of them (4 nodes)
    # hold the 671B model at TP = 32, which cuts the routed / shared expert intermediate 2048 to 64 per rank:
    # half a 128 x 128 scale block, so the loader re-blocks 128 -> 64 (mlp_split 'even', mtp.parallel.reblock).
    # A PCIe step costs more than an NVLink one (through the host bridge): 8 us assumed, so one decode all-reduce
    # of a token's [1, 7168] fp32 over 32 ranks is log2(32) = 5 steps = 40 us + 2 us of bandwidth (PCIe 25 GB/s,
    # the node-to-node NIC 25 GB/s as well): 122 of them per forward = ~5 ms, latency-bound (`allreduce_us`).
    GPU("l40s", 733.0, 362.0, 48, 864, 25, 25, 8.0, "PCIe Gen4 x16, no NVLink", "NVIDIA L40S datasheet",
        gpus_per_node=8, default_tp=32, mlp_split="even"),
)}


def gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"--gpu: unknown GPU {name!r}; known: {', '.join(GPUS)}") from None
