"""The names and limits of the generation options, torch-free so the front ends' schemas (`mtp-eval`,
`mtp-chat`) read them without loading the model code. `GenerationConfig` (config.py) validates against them."""

DRAFTS = ("none", "vanilla", "eagle")
VERIFIERS = ("strict", "relaxed", "sample")
MODES = ("eager", "graph", "overlap")  # eager | graph (whole step in one CUDA graph) | overlap (graph + pipelined host)
MAX_K = 16  # the most drafts per step the front ends offer: far past the point where position k is still accepted


def draft_room(k: int) -> int:
    """Buffer positions a call needs past prompt + max_new_tokens for K drafts per step (the drafts and the
    verify block written past the committed tokens, and the draft window's slack): 3K + 2. Prompt +
    max_new_tokens + this must fit the model's max_position_embeddings."""
    return 3 * k + 2
