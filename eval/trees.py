"""Tree runs of mtp-eval (`draft.tree=2x1x1`, adaptive length with `draft.min_draft_prob`).

A run with draft.tree set decodes through mtp.generate (mtp.decode.tree: eager, or runtime.mode=graph|overlap: the step
captured once and replayed across batches). Its result is reported twice: as the engine's SpecMetrics
(`TreeMetrics.spec`: k = the tree's depth), so AL, acceptance per
position (= per depth), speed, the baseline's speedup and the strict check aggregate exactly as for chains;
and as the tree's own TreeMetrics per batch (`batch_tree_metrics` in samples.jsonl), merged here into the
`tree/*` and `accept/depth_{d}_rank_{r}` metrics and the `tree` section of metrics.json.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mtp.verify.registry import verifier

from .common import NotAvailableError

TREE_KWARGS = ("tree", "min_draft_prob")  # generate kwargs of tree runs only (a baseline drops them)


def check(kw: dict, batch_size: int) -> None:
    """Refuse settings of a valid config that tree decoding does not serve, before anything runs (the rules that
    need no files are GenerationConfig's, checked by the schema)."""
    if "draft_vocab" in kw:
        raise NotAvailableError(f"draft.vocab_file with draft.tree={kw['tree']}: draft trees do not take a draft "
                                "vocabulary yet")
    if not verifier(kw["verify"]).tree_graphs and batch_size != 1:
        # mtp-eval seeds each prompt on its own so that an output does not depend on its batch; a tree rule that
        # cannot be captured draws a batch from one torch.Generator (tree sampling)
        raise NotAvailableError(f"verify={kw['verify']} with draft.tree needs runtime.batch_size=1, got "
                                f"{batch_size} (tree sampling seeds a whole batch at once)")


def generate(model, ids: list[list[int]], max_new_tokens: int, kw: dict, on_step: Callable | None = None):
    """One tree call with mtp-eval's generate kwargs: (the run, accepted-count histogram per row); `on_step`
    gets each step's `StepEvent`, as from mtp.generate."""
    import mtp
    from mtp.decode.config import GenerationConfig

    seed = kw.get("seed", 0)
    seed = seed[0] if isinstance(seed, list) else seed  # one row per sampling call (check)
    g = GenerationConfig.from_options(max_new_tokens, **{**kw, "seed": seed})
    r = mtp.generate(model, ids, g, on_step=on_step)  # through generate: a sharded model runs it on every rank
    return r, r.row_accepted_hist


def _merged(batch_recs: Sequence[dict]):
    from mtp.decode.tree_metrics import TreeMetrics

    out = None
    for r in batch_recs:
        t = TreeMetrics(**r["batch_tree_metrics"])
        out = t if out is None else out.merge(t)
    return out


def flat(batch_recs: Sequence[dict]) -> dict:
    """`tree/*` and `accept/depth_{d}_rank_{r}` over a set of batches (their first records)."""
    return {key: v for key, v in _merged(batch_recs).to_dict().items()
            if key.startswith("tree/") or "_rank_" in key}


def section(batch_recs: Sequence[dict], run: dict) -> dict:
    """The `tree` section of metrics.json: the shape and the acceptance by depth and sibling rank."""
    t = _merged(batch_recs)
    n = max(t.row_steps, 1)
    return {"shape": run.get("tree"), "min_draft_prob": run.get("min_draft_prob"), "nodes": t.n_nodes,
            "max_depth": t.max_depth, "row_steps": t.row_steps, "live_nodes": t.live_nodes,
            "accepted_rank": t.accepted_rank,  # counts: [depth - 1][rank]
            "accept_depth_rank": [[c / n for c in row] for row in t.accepted_rank],
            "accept_depth": t.accept_depth, "tokens_per_node": t.tokens_per_node,
            "tokens_per_live_node": t.tokens_per_live_node}


def label(draft: str, k: int, tree: str | None, min_draft_prob: float) -> str:
    """How a run's drafting reads in titles: 'eagle k=2', 'eagle tree=2x1x1', '... p>=0.3'."""
    if tree is None:
        return f"{draft} k={k}"
    return f"{draft} tree={tree}" + (f" p>={min_draft_prob:g}" if min_draft_prob else "")
