"""Composition of terms into time, TPOT and tok/s, by hand on made-up terms and GPUs."""

import pytest

from mtp.model.presets import tiny_config
from mtp.plan.cost import Comm, Layout, Term
from mtp.plan.hardware import GPU
from mtp.plan.speed import Efficiency, Workload, accept_len, predict, time_terms

G = GPU("toy", fp8_tflops=2.0, bf16_tflops=1.0, hbm_gb=1, hbm_gbps=1000.0, link_gbps=10.0, net_gbps=10.0,
        link_latency_us=5.0, link="toy", source="test")


def test_term_is_max_of_compute_and_memory_plus_launches_and_comm():
    t = Term("x", "weights", 3, flops_fp8=4e9, flops_bf16=1e9, weight_bytes=1e9, launches=2,
             comm=(Comm("all_reduce", 1e4),))
    f = time_terms([t], G, Layout(2, 2), Efficiency(bw=(("weights", 0.5),), launch=(("weights", 10.0),)))
    tt = f.terms[0]
    assert tt.compute_ms == pytest.approx(3 * (4e9 / 2e12 + 1e9 / 1e12) * 1e3)  # 9 ms
    assert tt.memory_ms == pytest.approx(3 * 1e9 / (1e12 * 0.5) * 1e3)  # 6 ms
    assert tt.launch_ms == pytest.approx(3 * 2 * 10e-3)
    # ring all-reduce over 2 ranks: 2 (p-1)/p * 1e4 B / 10 GB/s = 1 us, + log2(2) steps x 5 us
    assert tt.comm_ms == pytest.approx(3 * 6e-3)
    assert f.serial_ms == pytest.approx(9 + 0.06 + 0.018)
    assert f.overlap_ms == pytest.approx(9 + 0.06)
    assert tt.bound == "compute"


def test_accept_len():
    assert accept_len([0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert accept_len([0.9, 0.5, 0.1], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.045)
    assert accept_len([0.9], 0) == 1.0


def test_predict_tpot_and_per_gpu():
    cfg = tiny_config()
    r1 = predict(cfg, G, Layout(), Workload(batch=4, context=64, k=0))
    s = r1.summary()
    assert s["tpot_ms"] == pytest.approx(r1.verify.serial_ms)
    assert s["tok_s_gpu"] == pytest.approx(4 * 1e3 / s["tpot_ms"])
    r2 = predict(cfg, G, Layout(), Workload(batch=4, context=64, k=2, al=2.5))
    s2 = r2.summary()
    assert s2["step_ms"] == pytest.approx(r2.verify.serial_ms + 2 * r2.draft.serial_ms)
    assert s2["tpot_ms"] == pytest.approx(s2["step_ms"] / 2.5)
    assert s2["ttft_ms"] == pytest.approx(r2.prefill.serial_ms) and r2.prefill.serial_ms > r2.verify.serial_ms


@pytest.mark.parametrize("kw, bad", [(dict(batch=0), "--batch"), (dict(context=0), "--context"),
                                     (dict(k=-1), "--k"), (dict(k=1, al=2.5), "--al")])
def test_workload_errors_name_the_option(kw, bad):
    with pytest.raises(ValueError, match=bad):
        Workload(**kw)


def test_experts_touched_sets_the_verify_expert_bytes():
    from mtp.plan.cost import rank_bytes
    cfg = tiny_config()  # 2 MoE layers of 16 experts
    a, b = (predict(cfg, G, Layout(), Workload(batch=1, context=64, k=1, al=1.5, experts_touched=n)) for n in (2.0, 4.0))
    ea, eb = ([t for t in r.verify.terms if t.name == "routed_experts"][0] for r in (a, b))
    per_expert = rank_bytes(cfg, Layout())["routed experts"] / 2 / 16
    assert eb.bytes - ea.bytes == pytest.approx(2 * 2 * per_expert)  # 2 more experts in each of 2 layers
