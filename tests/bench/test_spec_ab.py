"""`mtp.bench.spec_ab`: its arguments are checked up front (a switch that is not a FastPathOptions switch, a bad tree
shape, counts below 1), and without a GPU it says it needs one; the measurement itself:
tests/bench/test_spec_ab_gpu.py."""

from __future__ import annotations

import pytest
import torch

from mtp.bench import spec_ab


def test_arguments_are_checked(capsys):
    a = spec_ab.parse_args(["--switches", "tree_glue, tree_fwd_glue", "--tree", "2x1x1"])
    assert a.switches == ["tree_glue", "tree_fwd_glue"] and a.tree == "2x1x1" and a.tp == 8 and a.reps == 3
    for argv, why in ((["--switches", "tree_glue,no_such"], "no_such"),
                      (["--switches", "router_one_tokens"], "router_one_tokens"),  # an integer option, not a switch
                      (["--switches", ","], "--switches"),
                      (["--switches", "tree_glue", "--tree", "2y"], "--tree"),
                      (["--switches", "tree_glue", "--reps", "0"], "--reps")):
        with pytest.raises(SystemExit):
            spec_ab.parse_args(argv)
        assert why in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        spec_ab.main(["--switches", "tree_glue"])
