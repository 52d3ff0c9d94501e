"""Chunked prefill (target and draft caches filled `prefill_chunk` tokens at a time through the cache-using
forward) gives the same tokens and acceptance as one pass. float64 model: chunking changes batch shapes, and
in fp32 that noise can flip an FP8 rounding (see mtp/DESIGN.md)."""

import pytest
import torch

from mtp.checkpoint.files import load_model
from mtp.decode.engine import generate

PROMPTS = [list(range(5, 28)), list(range(40, 47)), list(range(100, 119))]  # 23 / 7 / 19 tokens; index_topk 16


@pytest.fixture(scope="module")
def model64(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float64, numerics="fp8")


@pytest.fixture(scope="module")
def one_pass(model64):
    """The one-pass run per (draft, k), made once for the chunk sizes that compare with it (deterministic: float64)."""
    runs = {}

    def get(draft, k):
        if (draft, k) not in runs:
            runs[draft, k] = generate(model64, PROMPTS, 10, draft=draft, k=k, reuse_modules=True)
        return runs[draft, k]
    return get


@pytest.mark.parametrize("draft,k", [("none", 0), ("eagle", 2), ("vanilla", 3)])
@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_one_pass(model64, one_pass, draft, k, chunk):
    kw = dict(draft=draft, k=k, reuse_modules=True)
    one = one_pass(draft, k)
    got = generate(model64, PROMPTS, 10, prefill_chunk=chunk, **kw)
    assert got.tokens == one.tokens
    assert got.metrics.accepted_hist == one.metrics.accepted_hist
    chunks = -(-max(map(len, PROMPTS)) // chunk)
    per_chunk = {"none": 0, "eagle": 1, "vanilla": k}[draft]
    assert got.metrics.draft_forwards == one.metrics.draft_forwards + per_chunk * (chunks - 1)


def test_bad_prefill_chunk(model64):
    with pytest.raises(ValueError, match="prefill_chunk"):
        generate(model64, PROMPTS, 4, prefill_chunk=0)
