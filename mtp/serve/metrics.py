"""A request's acceptance in the units serving engines report, and the server's Prometheus metrics.

`SpecCounts` turns a run's `SpecMetrics` into vLLM's spec-decode counts: a *draft* is one speculative step of one
sequence (K tokens proposed), `draft_tokens` the tokens proposed, `accepted_tokens` those accepted, and
`accepted_per_pos[j]` how often position j+1 was accepted. The response's `draft_acceptance_rate` = accepted /
proposed (vLLM's "draft acceptance rate") is `SpecMetrics.accept_rate`; mean accepted length (AL) = 1 + accepted /
drafts, as `SpecMetrics.mean_accepted_len`.

`/metrics` names follow vLLM's (`vllm:spec_decode_num_drafts` -> `mtp:spec_decode_num_drafts_total`, and so on),
so dashboards built for vLLM need only the prefix changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..decode.metrics import SpecMetrics

# latency buckets (seconds): CPU replies of the bundled model take tens of ms per token, GPU ones a few ms
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


@dataclass(frozen=True)
class SpecCounts:
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_pos: tuple[int, ...]

    @classmethod
    def of(cls, m: SpecMetrics) -> "SpecCounts":
        if m.k == 0:
            return cls(0, 0, 0, ())
        hist = m.accepted_hist
        return cls(drafts=m.row_steps, draft_tokens=m.row_steps * m.k,
                   accepted_tokens=sum(a * c for a, c in enumerate(hist)),
                   accepted_per_pos=tuple(sum(hist[j + 1:]) for j in range(m.k)))



def acceptance(m: SpecMetrics) -> dict[str, Any]:
    """The response's `mtp` extension object: settings, acceptance and timing of this request."""
    c = SpecCounts.of(m)
    return {"draft": m.draft, "k": m.k, "verify": m.verify,
            "mean_accepted_len": m.mean_accepted_len, "draft_acceptance_rate": m.accept_rate if m.k else 0.0,
            "accept_per_position": m.accept_cum, "num_drafts": c.drafts, "num_draft_tokens": c.draft_tokens,
            "num_accepted_tokens": c.accepted_tokens, "num_accepted_tokens_per_pos": list(c.accepted_per_pos),
            "ttft_s": m.ttft["mean"], "tpot_s": m.tpot["mean"], "decode_tok_s": m.decode_tok_s}  # one request


class ServerMetrics:
    """Counters and histograms in one registry of their own (several servers in one process do not collide)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        self.drafts = Counter("mtp:spec_decode_num_drafts", "Speculative steps (one per sequence and step)",
                              registry=r)
        self.draft_tokens = Counter("mtp:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("mtp:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("mtp:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.prompt_tokens = Counter("mtp:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("mtp:generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("mtp:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.ttft = Histogram("mtp:time_to_first_token_seconds", "Request arrival to first token (queue included)",
                              buckets=_REQUEST_BUCKETS, registry=r)
        self.tpot = Histogram("mtp:time_per_output_token_seconds", "Decode time per output token after the first",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("mtp:e2e_request_latency_seconds", "Request arrival to last token",
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("mtp:request_queue_time_seconds", "Time waiting for the request before",
                               buckets=_REQUEST_BUCKETS, registry=r)

    def record(self, m: SpecMetrics, finish_reason: str, ttft_s: float | None, e2e_s: float, queue_s: float) -> None:
        c = SpecCounts.of(m)
        self.drafts.inc(c.drafts)
        self.draft_tokens.inc(c.draft_tokens)
        self.accepted.inc(c.accepted_tokens)
        for j, n in enumerate(c.accepted_per_pos):
            self.accepted_per_pos.labels(position=str(j)).inc(n)
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generation_tokens.inc(m.new_tokens)
        self.requests.labels(finished_reason=finish_reason).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if m.tpot_s_rows:  # a request with two or more tokens
            self.tpot.observe(m.tpot_s_rows[0])
        self.e2e.observe(e2e_s)
        self.queue.observe(queue_s)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
