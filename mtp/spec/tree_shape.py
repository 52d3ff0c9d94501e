"""Static draft trees: the shape one verify scores in one forward (one CUDA graph per shape).

Shape legend: N nodes (root included), C most children of a node, A = max_depth + 1 nodes on a longest path.

Node 0 is the root: the last committed token x_{n-1}, which the verify feeds anyway (a chain of K drafts is
the tree (1,) * K: N = K + 1). Every other node is a drafted token whose parent is the token before it. Nodes
are numbered level by level (parent index < node index, depth non-decreasing), siblings by rank: rank r is the
drafter's r-th best (or r-th drawn) token at the parent, so the sampling verifier tries siblings in rank order.
Sibling ranks may have gaps (TensorRT-LLM's published eagle_choices hold [0, 1, 1] without [0, 1, 0]): the
drafter still picks the best ranks[i] + 1 tokens at the parent and places only the listed ones.

The verify forward writes node i at cache slot seq_len + i, places it at rotary position seq_len + depth[i],
and lets it attend to the committed cache plus its own ancestors (`ancestor_mask`, self included).

`TreeShape` is torch-free (a `GenerationConfig` carries one and is validated without torch); its device tables
import torch when built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_BRANCHING = re.compile(r"[0-9]+(x[0-9]+)*")  # TreeShape.parse: '2x1x1'
_PATHS = re.compile(r"[0-9]+(\.[0-9]+)*(/[0-9]+(\.[0-9]+)*)*")  # '0/1/0.0/0.1'


@dataclass(frozen=True)
class TreeShape:
    parents: tuple[int, ...]  # parent node of each node; -1 for the root (node 0)
    # the drafter's pick rank of each node among its parent's candidates (0 for the root); None: siblings are
    # ranks 0, 1, ... in node order (no gaps). Stored resolved, so equal trees compare equal either way.
    ranks: tuple[int, ...] | None = None

    def __post_init__(self):
        p = tuple(self.parents)
        object.__setattr__(self, "parents", p)
        if not p or p[0] != -1:
            raise ValueError(f"tree parents must start with the root's -1, got {p[:4]}")
        for i, q in enumerate(p[1:], 1):
            if not isinstance(q, int) or not 0 <= q < i:
                raise ValueError(f"tree parents[{i}] must be a node before it (in [0, {i - 1}]), got {q!r}")
        if any(b < a for a, b in zip(self.depth, self.depth[1:])):
            raise ValueError(f"tree nodes must be numbered level by level (depths {self.depth}): a drafter "
                             "writes one depth per forward, as one block of slots")
        if self.ranks is None:
            r = [0] * len(p)
            for kids in self.children:
                for j, c in enumerate(kids):
                    r[c] = j
            object.__setattr__(self, "ranks", tuple(r))
            return
        r = tuple(self.ranks)
        object.__setattr__(self, "ranks", r)
        if len(r) != len(p) or r[0] != 0:
            raise ValueError(f"tree ranks must give one rank per node, 0 for the root: {len(p)} nodes, got {r}")
        for kids in self.children:
            kr = [r[c] for c in kids]
            if any(not isinstance(x, int) or x < 0 for x in kr) or any(b <= a for a, b in zip(kr, kr[1:])):
                raise ValueError(f"tree ranks of siblings {list(kids)} must be integers >= 0, increasing in node "
                                 f"order, got {kr}")

    # ------------------------------------------------------------------ builders
    @classmethod
    def chain(cls, k: int) -> TreeShape:
        """The chain of k drafts (what the engine verifies today) as a tree."""
        return cls.from_branching((1,) * k)

    @classmethod
    def from_branching(cls, branching: tuple[int, ...]) -> TreeShape:
        """Top-k per depth: every node at depth d - 1 gets branching[d - 1] children, e.g. (2, 2, 1) has
        2 + 4 + 4 drafts."""
        if any(not isinstance(b, int) or b < 1 for b in branching):
            raise ValueError(f"tree branching must be integers >= 1 per depth, got {tuple(branching)}")
        parents, level = [-1], [0]
        for b in branching:
            nxt = []
            for node in level:
                for _ in range(b):
                    nxt.append(len(parents))
                    parents.append(node)
            level = nxt
        return cls(tuple(parents))

    @property
    def name(self) -> str:
        """'chainK' for a chain, 'b1xb2x...' when every node of a depth has the same number of children, else the
        rank paths ('0/1/0.0'). Inverse of `parse`."""
        D = self.max_depth
        if D and self == TreeShape.chain(D):
            return f"chain{D}"
        per_depth = [{len(self.children[i]) for i in range(self.n_nodes) if self.depth[i] == d} for d in range(D)]
        if D and all(len(c) == 1 for c in per_depth) and TreeShape.from_branching(
                tuple(next(iter(c)) for c in per_depth)) == self:
            return "x".join(str(next(iter(c))) for c in per_depth)
        return "/".join(".".join(map(str, self.path_ranks(i))) for i in range(1, self.n_nodes))

    @classmethod
    def from_paths(cls, paths) -> TreeShape:
        """An explicit tree as its drafted nodes, each written as the ranks on its path from the root:
        (0,) is the top-1 child of the root, (0, 1) the second child of that. Every prefix of a path must be
        listed too (prefix-closed); sibling ranks may have gaps ((0, 1, 1) without (0, 1, 0)): the drafter picks
        its best max-rank + 1 tokens there and keeps the listed ranks."""
        paths = [tuple(p) if isinstance(p, (tuple, list)) else p for p in paths]
        nodes = set(paths)
        if len(nodes) != len(paths):
            raise ValueError("tree paths list a node twice")
        for p in nodes:
            if not isinstance(p, tuple) or not p or any(not isinstance(r, int) or r < 0 for r in p):
                raise ValueError(f"a tree path must be a non-empty tuple of ranks >= 0, got {p!r}")
            if len(p) > 1 and p[:-1] not in nodes:
                raise ValueError(f"tree path {p} needs its parent {p[:-1]} listed too")
        order = sorted(nodes, key=lambda p: (len(p), p))  # parents first, siblings by rank
        index = {(): 0} | {p: i + 1 for i, p in enumerate(order)}
        return cls((-1,) + tuple(index[p[:-1]] for p in order), (0,) + tuple(p[-1] for p in order))

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """A shape from its text form (config files, command lines): top-k per depth joined by 'x' ('2x1x1':
        2 children at depth 1, then a chain of 2 under each; '1x1x1' is the chain of 3), or the drafted nodes
        as rank paths joined by '/', ranks joined by '.' ('0/1/0.0/0.1/1.0', as `from_paths`), or 'chainK'. No commas or
        spaces, so a Hydra sweep can list shapes: `draft.tree=2x1x1,3x1,1x1x1`."""
        t = str(text).strip()
        try:
            if t.startswith("chain") and t[len("chain"):].isdigit():
                k = int(t[len("chain"):])
                if k < 1:
                    raise ValueError(f"a chain needs K >= 1 drafts, got {k}")
                return cls.chain(k)
            if _BRANCHING.fullmatch(t):
                return cls.from_branching(tuple(int(b) for b in t.split("x")))
            if _PATHS.fullmatch(t):
                return cls.from_paths([tuple(int(r) for r in part.split(".")) for part in t.split("/")])
        except ValueError as e:
            raise ValueError(f"tree shape {text!r} is invalid: {e}") from None
        raise ValueError(f"tree shape {text!r} is invalid: expected 'chainK', top-k per depth joined by 'x' (e.g. "
                         "'2x1x1') or rank paths joined by '/' with ranks joined by '.' (e.g. '0/1/0.0/0.1')")

    def path_ranks(self, i: int) -> tuple[int, ...]:
        """The sibling ranks on node i's path from the root (`from_paths`' form; () for the root)."""
        out = []
        while i > 0:
            out.append(self.rank[i])
            i = self.parents[i]
        return tuple(reversed(out))

    # ------------------------------------------------------------------ derived (host-side, computed once)
    @property
    def n_nodes(self) -> int:
        return len(self.parents)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        d = [0]
        for q in self.parents[1:]:
            d.append(d[q] + 1)
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each node in rank order."""
        out = [[] for _ in self.parents]
        for i, q in enumerate(self.parents[1:], 1):
            out[q].append(i)
        return tuple(tuple(c) for c in out)

    @property
    def rank(self) -> tuple[int, ...]:
        """The drafter's pick rank of each node among its parent's candidates (0 for the root)."""
        return self.ranks

    @property
    def max_children(self) -> int:
        return max(len(c) for c in self.children)

    @property
    def max_rank(self) -> int:
        """The highest pick rank of any node: the drafter draws max_rank + 1 candidates at most per node."""
        return max(self.ranks)

    def path(self, node: int) -> tuple[int, ...]:
        """The nodes from the root to `node`, both included."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return tuple(reversed(out))

    @property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.children) if not c)

    # ------------------------------------------------------------------ device tensors
    def tensors(self, device=None) -> TreeTensors:
        """Everything the verify forward and the verifiers read, on `device` (build once per shape)."""
        import torch

        return TreeTensors(self, torch.tensor(self.parents, dtype=torch.long, device=device),
                           self.depth_tensor(device), torch.tensor(self.rank, dtype=torch.long, device=device),
                           self.ancestor_mask(device), self.path_table(device), self.child_table(device))

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """Bool [N, N]: entry (i, j) is True iff node j is on the root-to-i path (i itself included)."""
        import torch

        m = torch.zeros(self.n_nodes, self.n_nodes, dtype=torch.bool)
        for i in range(self.n_nodes):
            m[i, list(self.path(i))] = True
        return m.to(device)

    def depth_tensor(self, device=None) -> torch.Tensor:
        import torch

        return torch.tensor(self.depth, dtype=torch.long, device=device)

    def path_table(self, device=None) -> torch.Tensor:
        """Long [N, A]: row i lists the path to node i, padded with i itself past its depth."""
        import torch

        A = self.max_depth + 1
        t = [list(self.path(i)) + [i] * (A - 1 - self.depth[i]) for i in range(self.n_nodes)]
        return torch.tensor(t, dtype=torch.long, device=device)

    def child_table(self, device=None) -> torch.Tensor:
        """Long [N, C]: children of each node in rank order, padded with -1."""
        import torch

        C = self.max_children
        t = [list(c) + [-1] * (C - len(c)) for c in self.children]
        return torch.tensor(t, dtype=torch.long, device=device)


@dataclass(frozen=True, eq=False)  # tensors: identity, not elementwise comparison
class TreeTensors:
    """A TreeShape's tables as device tensors (built once, then read inside captured steps)."""

    shape: TreeShape
    parent_N: torch.Tensor  # long [N], -1 for the root
    depth_N: torch.Tensor  # long [N]
    rank_N: torch.Tensor  # long [N]
    ancestor_NN: torch.Tensor  # bool [N, N]
    path_NA: torch.Tensor  # long [N, A]
    child_NC: torch.Tensor  # long [N, C], -1 padded
