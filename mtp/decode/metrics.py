"""Acceptance and speed metrics of a speculative run, returned (never printed) for the caller to log.

Counting unit: one (row, step) pair, i.e. one target verify forward of one sequence that was still active.
- accepted_hist[a]: how often a drafts (a in 0..K) were accepted;
- accept_cum[j]   = P(a >= j+1): draft j+1 accepted (all earlier ones too);
- accept_cond[j]  = P(a >= j+1 | a >= j): acceptance of position j+1 given its predecessor was accepted;
- mean_accepted_len (AL) = tokens committed per target forward = E[a] + 1 (before stop-token trimming).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecMetrics:
    k: int = 0
    draft: str = "none"
    verify: str = "strict"
    accepted_hist: list[int] = field(default_factory=list)
    relaxed_only_accepts: int = 0
    target_forwards: int = 0  # decode steps (batched forwards, prefill excluded)
    row_steps: int = 0  # (row, step) pairs counted in the histogram
    draft_forwards: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    n_rows: int = 0  # sequences in the run
    time_prefill_s: float = 0.0
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_host_s: float = 0.0
    time_decode_s: float = 0.0
    ttft_s: float = 0.0
    hidden_options: dict = field(default_factory=dict)
    # graph / overlap modes (GPU): capture cost and how busy the GPU was between replays
    graph_capture_s: float = 0.0  # capture time of the step graph this call replayed (captured now or earlier)
    graph_captures: int = 0  # step graphs captured by this call (0: it replayed one kept from an earlier call)
    graph_pool_bytes: int = 0
    graph_replays: int = 0
    gpu_busy_ms: float = 0.0
    gpu_idle_ms: float = 0.0

    def __post_init__(self):
        if not self.accepted_hist:
            self.accepted_hist = [0] * (self.k + 1)

    # ------------------------------------------------------------------ derived
    @property
    def accept_cum(self) -> list[float]:
        n = max(self.row_steps, 1)
        return [sum(self.accepted_hist[j + 1:]) / n for j in range(self.k)]

    @property
    def accept_cond(self) -> list[float]:
        out = []
        for j in range(self.k):
            reached = sum(self.accepted_hist[j:])
            out.append(sum(self.accepted_hist[j + 1:]) / reached if reached else 0.0)
        return out

    @property
    def mean_accepted_len(self) -> float:
        if not self.row_steps:
            return 0.0
        return 1.0 + sum(a * c for a, c in enumerate(self.accepted_hist)) / self.row_steps

    @property
    def tpot_s(self) -> float:
        """Decode time per output token of one sequence (the first token belongs to TTFT)."""
        per_row = self.new_tokens - self.n_rows if self.n_rows else self.new_tokens
        return self.time_decode_s / per_row if per_row > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.time_prefill_s if self.time_prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = self.new_tokens - self.n_rows
        return n / self.time_decode_s if self.time_decode_s and n > 0 else 0.0

    def merge(self, other: "SpecMetrics") -> "SpecMetrics":
        """Sum of two runs with the same k (for per-dataset aggregation)."""
        if other.k != self.k:
            raise ValueError(f"cannot merge metrics of k={self.k} and k={other.k}")
        out = SpecMetrics(k=self.k, draft=self.draft, verify=self.verify, hidden_options=self.hidden_options)
        out.accepted_hist = [a + b for a, b in zip(self.accepted_hist, other.accepted_hist)]
        for name in ("relaxed_only_accepts", "target_forwards", "row_steps", "draft_forwards", "prompt_tokens",
                     "new_tokens", "time_prefill_s", "time_draft_s", "time_verify_s", "time_host_s",
                     "time_decode_s", "ttft_s", "n_rows", "graph_capture_s", "graph_captures", "graph_pool_bytes",
                     "graph_replays", "gpu_busy_ms", "gpu_idle_ms"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def to_dict(self) -> dict:
        """Namespaced flat metrics (`accept/pos_1`, `speed/decode_tok_s`, ...) for loggers."""
        d = {
            "accept/mean_len": self.mean_accepted_len,
            "accept/relaxed_only": self.relaxed_only_accepts,
            "count/target_forwards": self.target_forwards,
            "count/row_steps": self.row_steps,
            "count/draft_forwards": self.draft_forwards,
            "count/prompt_tokens": self.prompt_tokens,
            "count/new_tokens": self.new_tokens,
            "time/prefill_s": self.time_prefill_s,
            "time/draft_s": self.time_draft_s,
            "time/verify_s": self.time_verify_s,
            "time/host_s": self.time_host_s,
            "time/decode_s": self.time_decode_s,
            "speed/ttft_s": self.ttft_s,
            "speed/tpot_s": self.tpot_s,
            "speed/prefill_tok_s": self.prefill_tok_s,
            "speed/decode_tok_s": self.decode_tok_s,
        }
        if self.graph_replays:
            d.update({
                "graph/capture_s": self.graph_capture_s,
                "graph/pool_bytes": self.graph_pool_bytes,
                "graph/replays": self.graph_replays,
                "graph/gpu_idle_frac": self.gpu_idle_ms / max(self.gpu_busy_ms + self.gpu_idle_ms, 1e-9),
            })
        for j, (cum, cond) in enumerate(zip(self.accept_cum, self.accept_cond), start=1):
            d[f"accept/pos_{j}"] = cum
            d[f"accept/cond_pos_{j}"] = cond
        for a, c in enumerate(self.accepted_hist):
            d[f"accept/hist_{a}"] = c
        return d

    def raw(self) -> dict:
        return asdict(self)
