"""What a tree run measured: `TreeMetrics` (acceptance per depth and sibling rank, nodes, AL) and `TreeResult`, and
the mapping to the chain engine's `SpecMetrics` (k = the tree's depth), so callers reading a chain's metrics read
a tree's the same way (`mtp.generate` with a tree, mtp-eval's tree runs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .metrics import SpecMetrics


@dataclass
class TreeMetrics:
    """Acceptance of a tree run; counting unit: one (row, step) pair of a still-active row.
    accepted_hist[a]: steps that accepted a drafts (a path to depth a); accepted_rank[d][r]: accepted nodes at
    depth d+1 with sibling rank r."""

    n_nodes: int
    max_depth: int
    accepted_hist: list[int] = field(default_factory=list)
    accepted_rank: list[list[int]] = field(default_factory=list)
    row_steps: int = 0
    live_nodes: int = 0  # nodes the adaptive length kept, summed over (row, step) pairs (N each without it)
    relaxed_only_accepts: int = 0  # accepted drafts that were not the target argmax (relaxed, sampling)
    target_forwards: int = 0
    draft_forwards: int = 0
    new_tokens: int = 0
    time_prefill_s: float = 0.0  # the target's prefill and the first token
    time_decode_s: float = 0.0  # everything after: the drafter's prefill, graph capture (if any) and every tree step
    time_draft_prefill_s: float = 0.0  # the drafter's pass over the prompt (inside time_decode_s)
    # graph / overlap modes (CUDA): capture cost and GPU time of the replays
    graph_replays: int = 0
    graph_captures: int = 0  # step graphs captured by this call (0: it replayed a graph kept from an earlier call)
    graph_capture_s: float = 0.0  # capture time of the graph replayed (in time_decode_s only if captured by this call)
    gpu_busy_ms: float = 0.0
    gpu_idle_ms: float = 0.0

    @property
    def mean_accepted_len(self) -> float:
        """AL: tokens committed per verify of a row (accepted drafts + the target's token)."""
        n = max(self.row_steps, 1)
        return 1 + sum(a * c for a, c in enumerate(self.accepted_hist)) / n

    @property
    def accept_depth(self) -> list[float]:
        """P(a >= d) for d = 1..max_depth."""
        n = max(self.row_steps, 1)
        return [sum(self.accepted_hist[d:]) / n for d in range(1, self.max_depth + 1)]

    @property
    def tokens_per_node(self) -> float:
        """Committed tokens per verified node: what a verify slot buys (1 / N for a tree that never hits)."""
        return self.mean_accepted_len / self.n_nodes

    @property
    def tokens_per_live_node(self) -> float:
        """Committed tokens per node the adaptive length kept (what a kernel skipping dead nodes would pay for)."""
        return self.mean_accepted_len * self.row_steps / max(self.live_nodes, 1)

    def merge(self, other: TreeMetrics) -> TreeMetrics:
        """Sum of two runs of the same tree shape (batches of one eval run)."""
        if (other.n_nodes, other.max_depth) != (self.n_nodes, self.max_depth):
            raise ValueError(f"cannot merge tree metrics of {self.n_nodes} nodes / depth {self.max_depth} with "
                             f"{other.n_nodes} nodes / depth {other.max_depth}")
        out = TreeMetrics(self.n_nodes, self.max_depth,
                          [a + b for a, b in zip(self.accepted_hist, other.accepted_hist)],
                          [[a + b for a, b in zip(r, q)] for r, q in zip(self.accepted_rank, other.accepted_rank)])
        for name in ("row_steps", "live_nodes", "relaxed_only_accepts", "target_forwards", "draft_forwards",
                     "new_tokens", "time_prefill_s", "time_decode_s", "time_draft_prefill_s", "graph_replays",
                     "graph_captures", "graph_capture_s", "gpu_busy_ms", "gpu_idle_ms"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def spec(self, draft: str, verify: str, prompt_tokens: int, n_rows: int) -> SpecMetrics:
        """The chain engine's metrics of this run: k = the depth, position j's acceptance = depth j's."""
        return SpecMetrics(k=self.max_depth, draft=draft, verify=verify, accepted_hist=list(self.accepted_hist),
                           relaxed_only_accepts=self.relaxed_only_accepts, target_forwards=self.target_forwards,
                           row_steps=self.row_steps, draft_forwards=self.draft_forwards, prompt_tokens=prompt_tokens,
                           new_tokens=self.new_tokens, n_rows=n_rows, time_prefill_s=self.time_prefill_s,
                           time_decode_s=self.time_decode_s, time_draft_prefill_s=self.time_draft_prefill_s,
                           graph_capture_s=self.graph_capture_s, graph_captures=self.graph_captures,
                           graph_replays=self.graph_replays, gpu_busy_ms=self.gpu_busy_ms, gpu_idle_ms=self.gpu_idle_ms)

    def raw(self) -> dict:
        return asdict(self)

    def to_dict(self) -> dict:
        d = {"accept/mean_len": self.mean_accepted_len, "tree/tokens_per_node": self.tokens_per_node,
             "tree/nodes": self.n_nodes, "count/row_steps": self.row_steps,
             "count/relaxed_only_accepts": self.relaxed_only_accepts,
             "tree/tokens_per_live_node": self.tokens_per_live_node,
             "tree/live_nodes_per_step": self.live_nodes / max(self.row_steps, 1),
             "count/target_forwards": self.target_forwards, "count/draft_forwards": self.draft_forwards}
        if self.graph_replays:
            busy = self.gpu_busy_ms + self.gpu_idle_ms
            d.update({"graph/capture_s": self.graph_capture_s, "graph/captures": self.graph_captures,
                      "graph/gpu_step_ms": self.gpu_busy_ms / self.graph_replays,
                      "graph/gpu_idle_frac": self.gpu_idle_ms / busy if busy else 0.0})
        n = max(self.row_steps, 1)
        for t, p in enumerate(self.accept_depth, 1):
            d[f"accept/depth_{t}"] = p
            for r, c in enumerate(self.accepted_rank[t - 1]):
                d[f"accept/depth_{t}_rank_{r}"] = c / n
        return d


@dataclass
class TreeResult:
    tokens: list[list[int]]
    finish_reasons: list[str]
    metrics: TreeMetrics
    row_accepted_hist: list[list[int]] = field(default_factory=list)  # accepted_hist of each row alone
