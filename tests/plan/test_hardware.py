import pytest

from mtp.plan.hardware import GPUS, gpu


def test_allreduce_cost_hand_count():
    h = GPUS["h200"]
    # [1, 7168] fp32 over 8 NVLink ranks: 2 * 7/8 * 28672 B / 450 GB/s + 3 steps x 3.3 us
    assert h.allreduce_us(28672, 8) == pytest.approx(2 * 7 / 8 * 28672 / 450e9 * 1e6 + 3 * 3.3)
    assert h.allreduce_us(28672, 1) == 0.0
    pcie = GPUS["l40s"]  # the 32 x L40S entry: PCIe only, TP 32, experts re-blocked 128 -> 64
    assert pcie.default_tp == 32 and pcie.mlp_split == "even" and "PCIe" in pcie.link
    assert pcie.allreduce_us(28672, 32, nodes=4) == pytest.approx(2 * 31 / 32 * 28672 / 25e9 * 1e6 + 5 * 8.0)


def test_every_gpu_names_its_source_and_unknown_names_fail():
    assert {"h800", "h20", "h20-3e", "h100", "h200", "b200", "l40s"} <= set(GPUS)
    assert all(g.source and g.fp8_tflops >= g.bf16_tflops for g in GPUS.values())
    with pytest.raises(ValueError, match="--gpu.*'a100'"):
        gpu("a100")
