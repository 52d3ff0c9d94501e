"""Tree decoding's keyword form: `generate_tree` and `run_tree`, which return the tree's own `TreeResult`.

The tree step itself is `tree_step.py` (`TreeStep`); the engine (engine.py) runs it through the same prefill, loop,
host sync and result as a chain, and `mtp.generate(..., tree=...)` is the same call through `GenerationConfig`.
In graph / overlap mode the engine (buffers, captured graphs) is kept across calls per model and settings
(mtp/decode/keep.py), so later calls replay the graph captured by the first. Design note: mtp/draft/TREES.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..model.deepseek import DeepseekV32
from ..spec.options import SamplingParams
from ..spec.tree_shape import TreeShape
from .config import GenerationConfig
from .engine import Engine, StepEvent
from .keep import kept
from .tree_metrics import TreeMetrics, TreeResult

__all__ = ["TreeMetrics", "TreeResult", "generate_tree", "run_tree"]


def run_tree(model: DeepseekV32, prompts: Sequence[Sequence[int]], g: GenerationConfig, seed: int | None = None,
             on_step: Callable[[StepEvent], None] | None = None) -> TreeResult:
    """Tree decoding with a `GenerationConfig` whose draft carries the tree: `mtp.generate`'s engine, its result as
    a `TreeResult`. graph / overlap: the engine is kept per model and settings, as `mtp.generate` keeps it, and
    dropped by `mtp.decode.engine.release(model)`; eager builds one per call."""
    if g.draft.tree is None:
        raise ValueError("run_tree needs a GenerationConfig whose draft carries a tree (DraftConfig.tree)")
    engine = Engine(model, g) if g.mode == "eager" else kept(model, g, lambda: Engine(model, g))
    seed = g.seed if seed is None else seed
    r = engine.run(prompts, on_step=on_step, max_new_tokens=g.max_new_tokens, seeds=[seed] * len(prompts))
    return TreeResult(r.tokens, r.finish_reasons, r.tree, r.row_accepted_hist)


def generate_tree(model: DeepseekV32, prompts: Sequence[Sequence[int]], tree: TreeShape | str,
                  max_new_tokens: int = 64, draft: str = "eagle", verify: str = "strict", *,
                  sampling: SamplingParams | None = None, draft_sampling: str = "greedy", top_n: int = 10,
                  delta: float = 0.6, think_ids: tuple[int, int] | None = None, min_draft_prob: float = 0.0,
                  seed: int = 0, eos_id: int | None = None, stop_ids: Sequence[int] = (), reuse_modules: bool = False,
                  target_hidden: str = "normed", chain_hidden: str = "normed", mode: str = "eager") -> TreeResult:
    """Tree speculative decoding (the keyword form; `mtp.generate(..., tree=...)` is the same through
    `GenerationConfig`, which checks every option). verify: 'strict' (greedy, lossless) | 'relaxed' (top_n /
    delta inside thinking spans delimited by think_ids, as the chain engine) | 'sample' (recursive rejection
    sampling with `sampling`; draft_sampling 'greedy' = top-k children, 'sample' = children drawn without
    replacement from the draft distribution). `min_draft_prob`: adaptive draft length (mtp.draft.tree_proposer);
    top-k children only. mode: 'eager' (one host sync per step), 'graph' (the whole step as one CUDA graph for
    this tree shape, replayed: `GraphRunner`, kept with its buffers for later calls of the same settings) or
    'overlap' (the graph replayed one step ahead of the host). On CUDA every mode runs the step with the same
    static bound (the buffer length), so all three give the same tokens; off CUDA the graph modes are refused,
    as for chains. Graph modes take verifiers whose tree rule can be captured (not 'sample': tree sampling draws
    from a torch.Generator, which a replayed graph would not advance)."""
    sp = sampling or SamplingParams()
    g = GenerationConfig.from_options(
        max_new_tokens, draft, None, verify, tree=tree, min_draft_prob=min_draft_prob, draft_sampling=draft_sampling,
        top_n=top_n, delta=delta, think_ids=think_ids, seed=seed, eos_id=eos_id, stop_ids=stop_ids,
        reuse_modules=reuse_modules, target_hidden=target_hidden, chain_hidden=chain_hidden, mode=mode,
        temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p)
    return run_tree(model, prompts, g)
