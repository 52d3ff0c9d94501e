"""Static draft-tree shapes (mtp.spec.tree_shape): construction, parsing, masks and paths, and the errors that name a
bad shape."""

from __future__ import annotations

import pytest
import torch

from mtp.spec.tree_shape import TreeShape

PATHS = TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 1, 0, 0)])


def test_branching_shape():
    t = TreeShape.from_branching((2, 2, 1))
    assert t.n_nodes == 1 + 2 + 4 + 4 and t.max_depth == 3
    assert t.parents == (-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6)
    assert t.depth == (0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
    assert t.rank == (0, 0, 1, 0, 1, 0, 1, 0, 0, 0, 0)
    assert t.leaves == (7, 8, 9, 10) and t.path(9) == (0, 2, 5, 9)
    assert t.child_table().tolist()[:3] == [[1, 2], [3, 4], [5, 6]]
    assert t.path_table().tolist()[4] == [0, 1, 4, 4]


def test_chain_is_a_lower_triangular_mask():
    t = TreeShape.chain(3)
    assert t.parents == (-1, 0, 1, 2)
    assert torch.equal(t.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_ancestor_mask_and_paths_agree():
    t = PATHS
    m = t.ancestor_mask()
    for i in range(t.n_nodes):
        assert m[i].nonzero().flatten().tolist() == sorted(t.path(i))
        assert len(t.path(i)) == t.depth[i] + 1


def test_from_paths_orders_parents_first_and_siblings_by_rank():
    t = TreeShape.from_paths([(1, 0), (0,), (1,), (0, 0)])
    assert t.parents == (-1, 0, 0, 1, 2) and t.rank == (0, 0, 1, 0, 0)
    assert TreeShape.from_paths([(0,), (0, 0), (0, 0, 0)]) == TreeShape.chain(3)


def test_from_paths_accepts_rank_gaps():
    """Any prefix-closed set of paths: TensorRT-LLM's published eagle_choices hold [0, 1, 1] without [0, 1, 0]."""
    t = TreeShape.from_paths([[0], [1], [0, 0], [0, 1], [0, 1, 1], [3]])
    assert t.parents == (-1, 0, 0, 0, 1, 1, 5) and t.rank == (0, 0, 1, 3, 0, 1, 1)
    assert t.max_rank == 3 and t.max_children == 3
    assert t.child_table().tolist()[:2] == [[1, 2, 3], [4, 5, -1]]
    assert [t.path_ranks(i) for i in range(1, t.n_nodes)] == [(0,), (1,), (3,), (0, 0), (0, 1), (0, 1, 1)]
    assert t.name == "0/1/3/0.0/0.1/0.1.1" and TreeShape.parse(t.name) == t
    lone = TreeShape.from_paths([(1,), (1, 2)])  # a chain in parents, not in ranks
    assert lone.parents == TreeShape.chain(2).parents and lone != TreeShape.chain(2) and lone.name == "1/1.2"


@pytest.mark.parametrize("ranks,match", [((0, 1, 1), "increasing"), ((0, 0), "one rank per node"),
                                         ((1, 0, 1), "0 for the root"), ((0, -1, 2), "integers >= 0")])
def test_bad_ranks_are_rejected(ranks, match):
    with pytest.raises(ValueError, match=match):
        TreeShape((-1, 0, 0), ranks)


@pytest.mark.parametrize("paths,match", [
    ([(0, 0)], r"needs its parent \(0,\)"),
    ([(0,), (0,)], "twice"),
    ([()], "non-empty tuple"),
    ([(0,), (-1,)], "ranks >= 0"),
])
def test_from_paths_rejects_bad_trees(paths, match):
    with pytest.raises(ValueError, match=match):
        TreeShape.from_paths(paths)


@pytest.mark.parametrize("text,shape", [
    ("2x1", TreeShape.from_branching((2, 1))), ("1x1x1", TreeShape.chain(3)), ("3", TreeShape.from_branching((3,))),
    ("0/1/0.0", TreeShape.from_paths([(0,), (1,), (0, 0)])), (" 2x2 ", TreeShape.from_branching((2, 2))),
    ("1.0/0/1/0.0/0.0.0", TreeShape.from_paths([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])),
])
def test_parse_reads_branching_and_paths(text, shape):
    assert TreeShape.parse(text) == shape


@pytest.mark.parametrize("text,match", [
    ("2x0", r"'2x0' is invalid: tree branching must be integers >= 1"),
    ("2,1", r"'2,1' is invalid: expected 'chainK', top-k per depth joined by 'x'"),
    ("", r"'' is invalid: expected"),
    ("x2", r"'x2' is invalid: expected"),
    ("0.0", r"'0.0' is invalid: tree path \(0, 0\) needs its parent"),
    ("0/0", r"'0/0' is invalid: tree paths list a node twice"),
])
def test_parse_names_the_bad_value(text, match):
    with pytest.raises(ValueError, match=match):
        TreeShape.parse(text)


@pytest.mark.parametrize("parents,match", [((0, 0), "start with the root"), ((-1, 1), r"parents\[1\]"),
                                           ((-1, 0, 3, 1), r"parents\[2\]")])
def test_bad_parents_are_rejected(parents, match):
    with pytest.raises(ValueError, match=match):
        TreeShape(parents)


def test_parse_and_name_round_trip():
    assert TreeShape.parse("chain3") == TreeShape.chain(3) and TreeShape.parse(" 2x2 ") == TreeShape.from_branching((2, 2))
    assert TreeShape.parse("4") == TreeShape.from_branching((4,))
    for name in ("chain1", "chain4", "2x2", "4x1x1", "3x2x1", "4"):
        assert TreeShape.parse(name).name == name
    assert TreeShape.parse("1x1").name == "chain2"  # a chain is named as one
    irregular = TreeShape.from_paths([(0,), (1,), (0, 0)])  # not top-k per depth: its rank paths
    assert irregular.name == "0/1/0.0" and TreeShape.parse(irregular.name) == irregular


@pytest.mark.parametrize("spec", ["chain0", "chainx", "2x0", "", "ax2", "2,2"])
def test_parse_rejects_bad_names(spec):
    with pytest.raises(ValueError, match=f"tree shape {spec!r} is invalid"):
        TreeShape.parse(spec)


def test_nodes_must_come_level_by_level():
    with pytest.raises(ValueError, match="level by level"):
        TreeShape((-1, 0, 1, 0))


def test_bad_branching_is_rejected():
    with pytest.raises(ValueError, match="branching"):
        TreeShape.from_branching((2, 0))
