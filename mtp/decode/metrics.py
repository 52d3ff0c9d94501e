"""Acceptance and speed metrics of a speculative run, returned (never printed) for the caller to log.

Counting unit: one (row, step) pair, i.e. one target verify forward of one sequence that was still active.
- accepted_hist[a]: how often a drafts (a in 0..K) were accepted;
- accept_cum[j]   = P(a >= j+1): draft j+1 accepted (all earlier ones too);
- accept_cond[j]  = P(a >= j+1 | a >= j): acceptance of position j+1 given its predecessor was accepted;
- mean_accepted_len (AL) = tokens committed per target forward = E[a] + 1 (before stop-token trimming);
- accept_rate      = accepted drafts / proposed drafts = E[a] / K (a chain proposes K drafts per step).
These formulas live once, in `acceptance` (over histograms of any leading shape): SpecMetrics, the intervals
over prompts (`AcceptanceStats`) and the breakdowns all call it.

Latency is per request: `ttft_s_rows` (one sample per sequence: every row of a batch gets its first token from
the same prefill) and `tpot_s_rows` (per sequence with two or more tokens: the time from its first token to its
last over its tokens after the first). A merge concatenates them, so percentiles stay exact (`mtp.stats`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from .. import stats


def acceptance(hist: np.ndarray) -> dict[str, np.ndarray]:
    """Acceptance figures of accepted-count histograms `hist` [..., K+1]: steps, mean_len (AL), rate, pos
    [..., K] (P(a >= j)) and cond [..., K] (P(a >= j | a >= j-1)). NaN where a figure has no steps."""
    h = np.asarray(hist, dtype=np.float64)
    K = h.shape[-1] - 1
    steps = h.sum(-1)
    drafts = (h * np.arange(K + 1)).sum(-1)
    tail = np.flip(np.cumsum(np.flip(h, -1), -1), -1)  # tail[..., j] = steps with a >= j
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"steps": steps, "mean_len": 1 + drafts / steps, "rate": drafts / (K * steps) if K else drafts * np.nan,
                "pos": tail[..., 1:] / steps[..., None], "cond": tail[..., 1:] / tail[..., :-1]}


def _num(x) -> float:
    x = float(x)
    return 0.0 if x != x else x  # no steps: 0.0, as the engine always reported


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
    time_decode_s: float = 0.0  # after the first token: the drafter's prompt pass and every step
    time_draft_prefill_s: float = 0.0  # the drafter's pass over the prompt (inside time_decode_s)
    ttft_s_rows: list[float] = field(default_factory=list)  # per request (see the module docstring)
    tpot_s_rows: list[float] = field(default_factory=list)
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

    @classmethod
    def from_raw(cls, raw: dict) -> "SpecMetrics":
        """From `raw()`; records written before per-request latency carried `ttft_s`, a sum over the batch's
        rows that no per-request figure can be recovered from: it is dropped."""
        return cls(**{key: v for key, v in raw.items() if key != "ttft_s"})

    # ------------------------------------------------------------------ derived
    def _acceptance(self) -> dict:
        return acceptance(np.asarray(self.accepted_hist))

    @property
    def accept_cum(self) -> list[float]:
        return [_num(x) for x in self._acceptance()["pos"]]

    @property
    def accept_cond(self) -> list[float]:
        return [_num(x) for x in self._acceptance()["cond"]]

    @property
    def mean_accepted_len(self) -> float:
        return _num(self._acceptance()["mean_len"])

    @property
    def accept_rate(self) -> float:
        """Accepted drafts / proposed drafts (K per verify step)."""
        return _num(self._acceptance()["rate"])

    @property
    def ttft(self) -> dict:
        """Per-request time to first token: mean, p50, p90, p99, n (seconds)."""
        return stats.latency(self.ttft_s_rows)

    @property
    def tpot(self) -> dict:
        """Per-request time per output token after the first: mean, p50, p90, p99, n (seconds)."""
        return stats.latency(self.tpot_s_rows)

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
                     "time_decode_s", "time_draft_prefill_s", "ttft_s_rows", "tpot_s_rows", "n_rows", "graph_capture_s", "graph_captures",
                     "graph_pool_bytes", "graph_replays", "gpu_busy_ms", "gpu_idle_ms"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def to_dict(self) -> dict:
        """Namespaced flat metrics (`accept/pos_1`, `speed/decode_tok_s`, ...) for loggers."""
        d = {
            "accept/mean_len": self.mean_accepted_len,
            "accept/rate": self.accept_rate,
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
            "time/draft_prefill_s": self.time_draft_prefill_s,
            **{f"speed/ttft_{q}_s": v for q, v in self.ttft.items() if q != "n"},
            **{f"speed/tpot_{q}_s": v for q, v in self.tpot.items() if q != "n"},
            "count/requests": len(self.ttft_s_rows),
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


class RowClock:
    """Per-request latency of one batched call, fed with the call's step events (`clock(new, keep, acc)`, the
    engines' emit signature; the first event is the prefill's token). Rows of a batch share the prefill, so
    they share a TTFT; a row's TPOT runs from its first token to the event that brought its last."""

    def __init__(self, B: int):
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: list[float | None] = [None] * B

    def __call__(self, new: list, keep: Sequence[int], acc: Sequence[int]) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        for b, kept in enumerate(keep):
            if kept:
                self.last[b] = now

    def fill(self, met: SpecMetrics, lengths: Sequence[int]) -> None:
        """Set met's per-request samples for rows that produced `lengths` tokens."""
        if self.first is None:
            return
        met.ttft_s_rows = [self.first - self.t0] * len(lengths)
        met.tpot_s_rows = [(self.last[b] - self.first) / (n - 1) for b, n in enumerate(lengths) if n > 1]


@dataclass
class AcceptanceStats:
    """Acceptance of a set of prompts with 95% intervals: AL, the acceptance rate (accepted / proposed drafts),
    acceptance per position (cumulative and conditional), each with (lo, hi) from a bootstrap over prompts
    (`mtp.stats`: the prompt is the independent unit, its steps are not), None with fewer than two prompts."""

    k: int
    prompts: int
    steps: int
    mean_len: float | None
    rate: float | None
    pos: list[float | None]
    cond: list[float | None]
    mean_len_ci: tuple[float, float] | None = None
    rate_ci: tuple[float, float] | None = None
    pos_ci: list[tuple[float, float]] | None = None
    cond_ci: list[tuple[float, float]] | None = None

    @classmethod
    def from_rows(cls, row_hists: Sequence[Sequence[int]], k: int) -> "AcceptanceStats":
        """From one accepted-count histogram [k+1] per prompt (prompts without a verify step are left out)."""
        h = np.asarray(row_hists, dtype=np.float64).reshape(-1, k + 1)
        h = h[h.sum(1) > 0]
        total = acceptance(h.sum(0))

        def figures(sums: np.ndarray) -> np.ndarray:
            a = acceptance(sums)
            return np.concatenate([a["mean_len"][..., None], a["rate"][..., None], a["pos"], a["cond"]], -1)

        ci = stats.bootstrap_rows(h, figures)

        def val(x) -> float | None:
            x = float(x)
            return None if x != x else x

        def pair(i: int) -> tuple[float, float] | None:
            if ci is None or ci[i, 0] != ci[i, 0]:
                return None
            return float(ci[i, 0]), float(ci[i, 1])

        return cls(k=k, prompts=len(h), steps=int(total["steps"]), mean_len=val(total["mean_len"]),
                   rate=val(total["rate"]), pos=[val(x) for x in total["pos"]], cond=[val(x) for x in total["cond"]],
                   mean_len_ci=pair(0), rate_ci=pair(1), pos_ci=None if ci is None else [pair(2 + j) for j in range(k)],
                   cond_ci=None if ci is None else [pair(2 + k + j) for j in range(k)])

    def to_dict(self) -> dict:
        """Flat keys: `accept/mean_len` with `_lo` / `_hi`, `accept/rate`, `accept/pos_{j}`, `accept/cond_pos_{j}`
        (each with `_lo` / `_hi`; None without an interval), `count/prompts`, `count/row_steps`."""
        d = {"count/prompts": self.prompts, "count/row_steps": self.steps}

        def put(key: str, v, ci) -> None:
            d[key], d[f"{key}_lo"], d[f"{key}_hi"] = v, ci and ci[0], ci and ci[1]

        put("accept/mean_len", self.mean_len, self.mean_len_ci)
        put("accept/rate", self.rate, self.rate_ci)
        for j in range(self.k):
            put(f"accept/pos_{j + 1}", self.pos[j], self.pos_ci and self.pos_ci[j])
            put(f"accept/cond_pos_{j + 1}", self.cond[j], self.cond_ci and self.cond_ci[j])
        return d

    def intervals(self) -> dict:
        """Only the interval keys (`..._lo`, `..._hi`): to put beside the same figures computed elsewhere."""
        return {key: v for key, v in self.to_dict().items() if key.endswith(("_lo", "_hi"))}
