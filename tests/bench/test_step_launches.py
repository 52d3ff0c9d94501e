"""The launches of one eagle k = 3 chain step (`mtp.bench.step_launches`: a tiny simulated TP=2 rank's fast path under
the Triton interpreter, 2 rows), held to bounds: the glue outside the blocks (positions, embeddings, the MTP modules'
norms and heads, the drafts' argmaxes, verification, accept / commit / count) must not grow back, and the glue
switches (step_commit, rope_table, vocab_embed, mtp_norms) change launches, never a bit of the decode state.

Counted (session 21): glue 188 launches a step before the session's changes (commit cce8eca), 164 with the switches off
(kept aranges, shared index tensors, the drafts written in one scatter, ...), 67 with them on; the blocks' launches
(dense 18, moe 19, mtp 3 x 21 + 1) are not touched. Session 25: 54 (switch strict_commit, the strict verdict inside the
commit kernel: -5; switch draft_window, the proposer's window in one launch: -8; its cache's truncate too: -1); then
46 (switch gather_cast, the fp32 casts of eh_proj and the heads' logits made by their gathered copies: -7; the
head keeps 3, its cast in place of the glue's; 1 row: glue 48 -> 46); 45 (the eagle chain's first hidden is the row
the window's head read, `ModelOutput.hidden_at`, not gathered again: -1); 43 (the verify's ids stacked with the drafts
and its slots from the window kernel, `Proposer.verify_input`: -2).

Here (CI) the step with the default switches only: ~50 s of interpreted kernels on a 2-core CI machine, against ~100 s
with `--compare` (a second prefill and two more steps), which session 22 took out to keep CI under its 20 minutes.
That the switches keep every bit is held per switch on the CPU (test_step_commit's interpreted engine runs on / off;
test_lookup: rope_table, vocab_embed, mtp_norms against the torch ops) and for the whole step on a GPU (tests/backends/test_glue_gpu.py: the TP=8 rank's eagle
k = 3 step, switches off vs on, eager and graphs); `python -m mtp.bench.step_launches --compare` prints the off count
(164) and the state comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.interp import interpreted

ROOT = Path(__file__).resolve().parents[2]
GLUE_BOUND = 43  # the eagle k = 3 step's glue with the default switches (counted; lower it when it drops)
BLOCKS = {"dense": 18, "moe": 19, "mtp": 64, "head": 3}  # the blocks' launches of the same step (counted, session 21)


@pytest.mark.slow
def test_eagle_k3_step_launches():
    r = interpreted(["-m", "mtp.bench.step_launches", "--draft", "eagle", "--k", "3"], 900)
    assert r.returncode == 0, f"step_launches failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    on = json.loads(r.stdout)["step"]
    assert on["per_kind"]["glue"] <= GLUE_BOUND, on["glue_by_site"]
    assert {k: v for k, v in on["per_kind"].items() if k != "glue"} == BLOCKS, "the blocks' launches changed"
    names = on["glue_by_name"]
    # one launch each for: the bookkeeping, each forward's slots + angles and embedding, each MTP module's norms
    assert names["_chain_commit_kernel"] == 1 and names["_rope_slots_kernel"] == 4
    assert names["_embed_kernel"] == 4 and names["_rms_norm_pair_kernel"] == 3
    assert names["_draft_window_kernel"] == 1 and not {"aten.cumprod", "aten.clamp", "aten.zeros_like"} & set(names)
    assert not {"aten.arange", "aten.cos", "aten.sin", "aten.isin", "aten.masked_fill", "aten.index_put_"} & set(names)
