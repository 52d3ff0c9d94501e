"""mtp-plan's CLI: --speed runs the speed model, anything else the memory planner; every error names the bad
option and exits 2."""

import json

import pytest

from mtp.plan.cli import main


@pytest.mark.parametrize("args, bad", [
    (["--gpu", "a100"], "--gpu"), (["--tp", "3"], "--tp"), (["--tp", "8", "--ep", "16"], "--ep"),
    (["--k", "2"], "--k"), (["--k", "1", "--al", "3"], "--al"), (["--batch", "0"], "--batch"),
    (["--context", "0"], "--context"), (["--accept", "1.5", "--k", "1"], "--accept"),
    (["--al", "2", "--accept", "0.5", "--k", "2"], "--al"), (["--tp", "16", "--nodes", "1"], "--nodes"),
    (["--tp", "zero"], "--tp"), (["no_such_config.json"], "CONFIG"), (["--experts-touched", "0"], "--experts-touched"),
])
def test_errors_name_the_option(args, bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--speed", *args])
    assert e.value.code == 2
    assert bad in capsys.readouterr().err


def test_speed_json_on_the_bundled_config(capsys):
    assert main(["--speed", "--gpu", "h200", "--tp", "8", "--batch", "2", "--k", "1", "--accept", "0.8",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["workload"]["al"] == pytest.approx(1.8) and d["gpus"] == 8
    s = d["summary"]
    assert s["tok_s_gpu"] == pytest.approx(s["tok_s_user"] * 2 / 8)
    assert {t["name"] for t in d["verify"]["terms"]} >= {"mla", "routed_experts", "shared_expert", "head"}


def test_without_speed_it_is_the_memory_planner(tmp_path, capsys):
    from mtp.model.presets import tiny_config
    p = tmp_path / "config.json"
    p.write_text(json.dumps(tiny_config().to_dict()))
    assert main([str(p), "--gpus", "1", "--gpu-mem-gib", "80", "--json"]) == 0
    assert "weights_by_rank" in json.loads(capsys.readouterr().out)


def test_l40s_states_its_pcie_allreduce_cost(capsys):
    assert main(["--speed", "--gpu", "l40s", "--k", "1", "--al", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "l40s x 32, TP32" in out and "all-reduce over PCIe" in out and "123 per verify forward" in out


def test_two_node_tp_allreduce_rides_the_nic(capsys):
    assert main(["--speed", "--gpu", "h100", "--tp", "16", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "ring bandwidth 50 GB/s" in out and "TP16 spans 2 nodes" in out
