"""`mtp-plan --speed`: an analytic speed model of DeepSeek-V3.2 inference (FLOPs, bytes and communication per
layer and phase -> prefill / decode time -> TTFT, TPOT, tok/s), checked against a published analysis and
calibrated on our measurements. Per-rank weight bytes come from `mtp.parallel.memory` (one source of truth)."""
