"""The speculative decoding engine end to end on tiny checkpoints in the real format (fp8 numerics, CPU).

Shape legend: B batch, S buffer positions, K drafts, V vocabulary.

Two models: the session `tiny_model` (random weights, 1 MTP module that never agrees with the trunk) and
`mtp_model`, a 2-module checkpoint whose blocks are damped (o_proj / down_proj scales / 16) and whose eh_proj
mostly passes the token embedding through, so the MTP heads agree with the trunk often enough to accept 0..K
drafts (real acceptance is what makes losslessness worth testing). Oracle and adversarial proposers plug in
through `Engine(..., proposer_factory=...)`.
"""

from __future__ import annotations

import math

import pytest
import torch

from mtp import generate
from mtp.checkpoint.files import load_model, save_checkpoint
from mtp.draft import DraftConfig
from mtp.decode.config import GenerationConfig
from mtp.decode.engine import Engine
from mtp.decode.metrics import SpecMetrics
from mtp.checkpoint.random_weights import random_tensors
from mtp.model.presets import tiny_config
from mtp.verify import SamplingParams, filter_probs

N_NEW = 16
PROMPT_LENS = (5, 14, 23)  # index_topk = 16: rows start dense and grow sparse, one starts sparse
TH, ETH = 510, 511  # <think>, </think> stand-ins in the 512-token tiny vocabulary
# Chi-square critical value at alpha = 0.001 for 26 degrees of freedom (27 cells): statistical tables, equal to
# the root of gammaincc(13, x / 2) = 1e-3. Fixed seeds make the test deterministic.
CHI2_CRIT_001_DOF26 = 54.052


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    cfg = tiny_config(mtp_modules=2)
    t = random_tensors(cfg, seed=0)
    g = torch.Generator().manual_seed(5)
    D = cfg.hidden_size
    for name in list(t):
        if name.endswith(("o_proj.weight_scale_inv", "down_proj.weight_scale_inv")):
            t[name] = t[name] / 16  # ue8m0 scales stay powers of two
        if name.endswith("eh_proj.weight"):
            w = torch.cat((torch.eye(D), 0.25 * torch.randn(D, D, generator=g) / math.sqrt(D)), dim=1)
            t[name] = w.to(t[name].dtype)
    path = save_checkpoint(t, cfg, tmp_path_factory.mktemp("ckpt2") / "tiny-2mtp")
    return load_model(path, dtype=torch.float32, numerics="fp8")


@pytest.fixture(scope="module")
def models(tiny_model, mtp_model):
    return {"tiny": tiny_model, "mtp2": mtp_model}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(2, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]
    out[1][-1] = TH  # row 1 ends inside a thinking span (only the relaxed runs care)
    return out


@pytest.fixture(scope="module")
def greedy(models, prompts):
    """Per model: plain greedy output (draft='none', N_NEW + 4 tokens so oracles can draft past N_NEW) and the
    [B, S] right-padded prompt + output."""
    out = {}
    for name, m in models.items():
        r = generate(m, prompts, max_new_tokens=N_NEW + 4)
        assert r.finish_reasons == ["length"] * 3, f"{name}: pick prompts whose greedy output has no EOS"
        full = torch.zeros(3, 64, dtype=torch.long)
        for b, (p, t) in enumerate(zip(prompts, r.tokens)):
            full[b, : len(p) + len(t)] = torch.tensor(p + t)
        out[name] = (r.tokens, full)
    return out


# ---------------------------------------------------------------------------------------------- helpers
def written(tokens_BS, n_B, drafts_BK):
    """A proposer writes its drafts at n.. of the token buffer (where the verify step reads them)."""
    tokens_BS.scatter_(1, n_B.unsqueeze(1) + torch.arange(drafts_BK.shape[1]), drafts_BK)
    return drafts_BK


class TableProposer:
    """Drafts read from a precomputed [B, S] sequence (`full[b, n + j]`); `wrong` shifts them all by one token,
    `miss` (row, step -> index) makes drafts wrong from that index on."""

    def __init__(self, full, k, V, wrong=False, miss=None):
        self.full, self.k, self.V, self.wrong, self.miss = full, k, V, wrong, miss
        self.draft_forwards, self.step = 0, 0

    def propose(self, tokens_BS, hidden_BSD, n_B, p0_B, W, draw, max_n):
        d = self.full.gather(1, n_B.unsqueeze(1) + torch.arange(self.k))
        bad = torch.full_like(d, self.wrong, dtype=torch.bool)
        if self.miss is not None:
            miss_B = torch.tensor([self.miss(b, self.step) for b in range(d.shape[0])])
            bad = torch.arange(self.k).unsqueeze(0) >= miss_B.unsqueeze(1)
        self.step += 1
        return written(tokens_BS, n_B, torch.where(bad, (d + 1) % self.V, d)), None


def run_with(model, prompts, k, make, max_new=N_NEW, **gkw):
    gcfg = GenerationConfig(max_new_tokens=max_new, draft=DraftConfig("eagle", k), **gkw)
    events = []
    out = Engine(model, gcfg, proposer_factory=lambda m, d, b, s: make()).run(prompts, on_step=events.append)
    return out, events


def check_metrics(out, events, K, B, prompts):
    """Histogram and derived metrics consistent; on_step events concatenate to the result."""
    met = out.metrics
    h = met.accepted_hist
    assert len(h) == K + 1 and sum(h) == met.row_steps and met.n_rows == B
    assert met.prompt_tokens == sum(map(len, prompts))
    assert met.new_tokens == sum(map(len, out.tokens))
    steps = max(met.row_steps, 1)
    for j in range(K):
        assert met.accept_cum[j] == pytest.approx(sum(h[j + 1:]) / steps)
        reached = sum(h[j:])
        assert met.accept_cond[j] == pytest.approx(sum(h[j + 1:]) / reached if reached else 0.0)
    if met.row_steps:
        assert met.mean_accepted_len == pytest.approx(1 + sum(a * c for a, c in enumerate(h)) / met.row_steps)
    # Each (row, step) commits a + 1 tokens except a row's last block, which a stop token or max_new_tokens may cut
    # (by at most K tokens).
    committed, uncut = met.new_tokens - B, sum((a + 1) * c for a, c in enumerate(h))
    assert uncut - K * B <= committed <= uncut and met.target_forwards == len(events) - 1
    d = met.to_dict()
    assert d["accept/mean_len"] == met.mean_accepted_len and d["count/row_steps"] == met.row_steps
    assert [d[f"accept/hist_{a}"] for a in range(K + 1)] == h
    assert all(f"accept/pos_{j}" in d and f"accept/cond_pos_{j}" in d for j in range(1, K + 1))
    # Streaming: events concatenate to the final tokens; a block is the accepted drafts then one target token,
    # except a row's last block, which a stop token or max_new_tokens may cut.
    for b in range(B):
        assert sum((e.new_tokens[b] for e in events), []) == out.tokens[b]
        blocks = [(e.new_tokens[b], e.accepted[b]) for e in events if e.new_tokens[b]]
        assert all(len(t) == a + 1 for t, a in blocks[:-1])
        assert all(0 <= a <= min(K, len(t)) for t, a in blocks)
        assert all(not e.new_tokens[b] for e in events[len(blocks):])  # a finished row stays finished


def expected_output(tokens, stop_set, max_new):
    """Greedy output cut after the first stop token (inclusive) and at max_new."""
    out, reasons = [], []
    for t in tokens:
        cut = next((i for i, x in enumerate(t[:max_new]) if x in stop_set), None)
        out.append(t[: cut + 1] if cut is not None else t[:max_new])
        reasons.append("stop" if cut is not None else "length")
    return out, reasons


# ---------------------------------------------------------------------------------------------- lossless
LOSSLESS = [
    ("mtp2", "eagle", 1, {}), ("mtp2", "eagle", 2, {}), ("mtp2", "eagle", 3, {}), ("mtp2", "eagle", 4, {}),
    ("mtp2", "vanilla", 1, {}), ("mtp2", "vanilla", 2, {}),  # k = 2 uses the checkpoint's two modules
    ("mtp2", "vanilla", 3, dict(reuse_modules=True)), ("mtp2", "vanilla", 4, dict(reuse_modules=True)),
    ("mtp2", "eagle", 2, dict(target_hidden="prenorm", chain_hidden="prenorm")),
    ("mtp2", "vanilla", 2, dict(target_hidden="prenorm", chain_hidden="normed")),
    ("tiny", "eagle", 3, {}), ("tiny", "vanilla", 2, dict(reuse_modules=True)),
]
_runs: dict = {}


@pytest.mark.parametrize("model_name,mode,k,opts", LOSSLESS, ids=lambda x: str(x) if not isinstance(x, dict) else
                         "-".join(f"{a}={b}" for a, b in x.items()) or "default")
def test_strict_speculation_equals_greedy(models, prompts, greedy, model_name, mode, k, opts):
    events = []
    out = generate(models[model_name], prompts, N_NEW, draft=mode, k=k, on_step=events.append, **opts)
    _runs[(model_name, mode, k, tuple(opts.items()))] = out
    base = greedy[model_name][0]
    for b in range(3):
        assert out.tokens[b] == base[b][:N_NEW], f"row {b} (prompt {PROMPT_LENS[b]} tokens) diverges from greedy"
    assert out.finish_reasons == ["length"] * 3
    check_metrics(out, events, k, 3, prompts)
    # k per step, plus the draft prefill over the prompt (each vanilla module once, the eagle module once)
    assert out.metrics.draft_forwards == k * out.metrics.target_forwards + (k if mode == "vanilla" else 1)
    assert out.metrics.hidden_options == {"target_hidden": opts.get("target_hidden", "normed"),
                                          "chain_hidden": opts.get("chain_hidden", "normed")}
    if model_name == "mtp2":  # the point of this model: drafts do get accepted, at several lengths
        assert sum(out.metrics.accepted_hist[1:]) >= 3, out.metrics.accepted_hist


@pytest.mark.parametrize("mode,k", [("eagle", 3), ("vanilla", 2)])
def test_batch_of_one_equals_greedy(models, prompts, greedy, mode, k):
    out = generate(models["mtp2"], [prompts[1]], N_NEW, draft=mode, k=k)
    assert out.tokens == [greedy["mtp2"][0][1][:N_NEW]]


def test_relaxed_with_zero_delta_equals_strict(models, prompts, greedy):
    strict = _runs.get(("mtp2", "eagle", 2, ())) or generate(models["mtp2"], prompts, N_NEW, draft="eagle", k=2)
    relaxed = generate(models["mtp2"], prompts, N_NEW, draft="eagle", k=2, verify="relaxed", delta=0.0,
                       think_ids=(TH, ETH))
    assert relaxed.tokens == strict.tokens
    ds, dr = strict.metrics.to_dict(), relaxed.metrics.to_dict()
    assert {k: v for k, v in ds.items() if not k.startswith(("time/", "speed/"))} == \
           {k: v for k, v in dr.items() if not k.startswith(("time/", "speed/"))}


# ---------------------------------------------------------------------------------------------- oracles
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_perfect_draft_accepts_k_every_step(tiny_model, prompts, greedy, k):
    """N = 14: after the prefill token, 13 tokens in blocks of k + 1 (13 is prime: the last block is cut)."""
    base, full = greedy["tiny"]
    V = tiny_model.cfg.vocab_size
    out, events = run_with(tiny_model, prompts, k, lambda: TableProposer(full, k, V), max_new=14)
    assert out.tokens == [t[:14] for t in base] and out.finish_reasons == ["length"] * 3
    assert all(len(t) == 14 for t in out.tokens)  # max_new_tokens exactly
    met = out.metrics
    assert met.accepted_hist == [0] * k + [met.row_steps]  # every step accepts all k drafts
    assert met.mean_accepted_len == k + 1
    assert met.target_forwards == math.ceil(13 / (k + 1))
    check_metrics(out, events, k, 3, prompts)


def test_wrong_draft_accepts_nothing_and_stays_greedy(tiny_model, prompts, greedy):
    base, full = greedy["tiny"]
    out, events = run_with(tiny_model, prompts, 2, lambda: TableProposer(full, 2, tiny_model.cfg.vocab_size,
                                                                        wrong=True), max_new=12)
    assert out.tokens == [t[:12] for t in base]
    assert out.metrics.accepted_hist == [out.metrics.row_steps, 0, 0] and out.metrics.row_steps == 3 * 11
    assert out.metrics.mean_accepted_len == 1.0
    check_metrics(out, events, 2, 3, prompts)


def test_target_logits_after_rollback_equal_a_fresh_recompute(tiny_model, prompts, greedy):
    """Drafts are right up to a scripted miss, so each step rolls the target cache back by a different amount; the
    verify logits at every committed position must equal a cache-free forward over the committed tokens."""
    base, full = greedy["tiny"]
    K = 3
    captured = []
    hook = tiny_model.lm_head.register_forward_hook(lambda mod, inp, out: captured.append(out.detach().clone()))
    try:
        out, events = run_with(tiny_model, prompts, K, lambda: TableProposer(
            full, K, tiny_model.cfg.vocab_size, miss=lambda b, s: (b + s) % (K + 1)), max_new=14)
    finally:
        hook.remove()
    assert out.tokens == [t[:14] for t in base]
    assert all(c > 0 for c in out.metrics.accepted_hist)
    verify_logits = captured[1:]  # captured[0] is the prefill
    assert len(verify_logits) == len(events) - 1
    with torch.no_grad():
        fresh = tiny_model(full[:, : max(PROMPT_LENS) + 14]).logits
    n = [len(p) + 1 for p in prompts]
    after_rejection, prev_a = 0, [K] * 3
    for s, (lg, ev) in enumerate(zip(verify_logits, events[1:])):
        assert lg.shape[1] == K + 1
        for b in range(3):
            if not ev.new_tokens[b]:
                continue
            # Inputs x_{n-1}, d_1..d_a were committed: their logits are final (j = a is the correction / bonus).
            for j in range(len(ev.new_tokens[b])):
                torch.testing.assert_close(lg[b, j], fresh[b, n[b] - 1 + j], atol=1e-4, rtol=0,
                                           msg=lambda e: f"step {s} row {b} position {n[b] - 1 + j}: {e}")
            after_rejection += prev_a[b] < K
            prev_a[b] = ev.accepted[b]
            n[b] += len(ev.new_tokens[b])
    assert after_rejection >= 6


# ---------------------------------------------------------------------------------------------- stops, lengths
def test_stop_token_ends_the_row_with_mtp_drafts(tiny_model, prompts, greedy):
    base = greedy["tiny"][0]
    stop = base[0][4]  # greedy produces it mid-way in row 0
    events = []
    out = generate(tiny_model, prompts, 12, draft="eagle", k=2, stop_ids=(stop,), on_step=events.append)
    exp, reasons = expected_output(base, {stop, tiny_model.cfg.eos_token_id}, 12)
    assert out.tokens == exp and out.finish_reasons == reasons
    assert out.tokens[0][-1] == stop and len(out.tokens[0]) <= 5
    check_metrics(out, events, 2, 3, prompts)


def test_stop_token_inside_an_accepted_block(tiny_model, prompts, greedy):
    """k = 3, perfect drafts: blocks cover generated tokens 1-4, 5-8, ...; the stop is draft 2 of block 2 (token 6)
    and comes as the model's eos_id. Nothing after it is emitted, though the step accepted all 3 drafts."""
    base, full = greedy["tiny"]
    stop = base[0][6]
    assert stop not in base[0][:6]
    out, events = run_with(tiny_model, prompts, 3, lambda: TableProposer(full, 3, tiny_model.cfg.vocab_size),
                           max_new=14, eos_id=stop)
    exp, reasons = expected_output(base, {stop}, 14)
    assert out.tokens == exp and out.finish_reasons == reasons
    assert out.tokens[0] == base[0][:7] and reasons[0] == "stop"
    assert events[2].accepted[0] == 2 and events[2].new_tokens[0] == base[0][5:7]
    check_metrics(out, events, 3, 3, prompts)


def test_single_token_budget(tiny_model, prompts, greedy):
    out = generate(tiny_model, prompts, 1, draft="eagle", k=2)
    assert out.tokens == [t[:1] for t in greedy["tiny"][0]] and out.finish_reasons == ["length"] * 3
    assert out.metrics.row_steps == 0 and out.metrics.target_forwards == 0 and out.metrics.mean_accepted_len == 0.0


# ---------------------------------------------------------------------------------------------- relaxed
class SecondBest:
    """Proposes the target's 2nd most likely token at each draft position (a cache-free forward per draft)."""

    def __init__(self, model, k):
        self.m, self.k, self.draft_forwards = model, k, 0

    def propose(self, tokens_BS, hidden_BSD, n_B, p0_B, W, draw, max_n):
        seq, rows = tokens_BS.clone(), torch.arange(n_B.shape[0])
        for j in range(self.k):  # right padding is causal-safe: each row reads its logits at n + j - 1
            logits = self.m(seq[:, : max_n + j], logits_at=(n_B + j - 1).unsqueeze(1)).logits[:, 0]
            seq[rows, n_B + j] = logits.topk(2).indices[:, 1]
        return written(tokens_BS, n_B, seq.gather(1, n_B.unsqueeze(1) + torch.arange(self.k))), None


def test_relaxed_accepts_near_misses_only_inside_the_thinking_span(tiny_model):
    """Three rows: a span that the first draft closes, no span, a span that stays open. The proposer drafts the
    target's 2nd-best tokens (close to top-1 on this flat model), so every draft inside a span is a relaxed accept
    and every draft outside one is rejected. `</think>` is chosen as row 0's first draft: after it, within the same
    verify and in every later step, the rule must be strict again."""
    m = tiny_model
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(2, 500, (6,), generator=g).tolist() + [TH], torch.randint(2, 500, (9,), generator=g).tolist(),
            torch.randint(2, 500, (4,), generator=g).tolist() + [TH]]
    with torch.no_grad():
        t0 = int(m(torch.tensor([rows[0]])).logits[0, -1].argmax())
        eth = int(m(torch.tensor([rows[0] + [t0]])).logits[0, -1].topk(2).indices[1])
    out, events = run_with(m, rows, 2, lambda: SecondBest(m, 2), max_new=8, verify="relaxed", think_ids=(TH, eth),
                           top_n=10, delta=0.6)
    check_metrics(out, events, 2, 3, rows)
    assert out.tokens[0][:2] == [t0, eth]
    # Replay each row against a cache-free forward: a token that is not the target argmax must sit inside a span.
    non_argmax = []
    for b, p in enumerate(rows):
        with torch.no_grad():
            argmax = m(torch.tensor([p + out.tokens[b]])).logits[0].argmax(-1)
        in_span, count = TH in p, 0
        for i, t in enumerate(out.tokens[b]):
            if t != argmax[len(p) - 1 + i]:
                assert in_span, f"row {b}: token {i} ({t}) is not the target argmax and lies outside a thinking span"
                count += 1
            in_span = (in_span or t == TH) and t != eth
        non_argmax.append(count)
    assert non_argmax[0] == 1 and non_argmax[1] == 0 and non_argmax[2] >= 4, non_argmax
    # The metric counts accepted drafts before the max_new_tokens cut (at most K = 2 of them are cut per row).
    assert sum(non_argmax) <= out.metrics.relaxed_only_accepts <= sum(non_argmax) + 2


def test_span_rule_reaches_the_verifier(tiny_model, greedy, prompts):
    """A prompt holding <think> and then </think>: the tracked rule sees no open span (every 2nd-best draft is
    rejected, the output is greedy's), TensorRT-LLM's rule ('trtllm') sees one (the drafts pass)."""
    m = tiny_model
    rows = [prompts[0][:3] + [TH, 7, ETH, 9]]
    plain = generate(m, rows, 6).tokens
    out = {rule: run_with(m, rows, 2, lambda: SecondBest(m, 2), max_new=6, verify="relaxed", think_ids=(TH, ETH),
                          top_n=10, delta=0.6, span_rule=rule)[0] for rule in ("tracked", "trtllm")}
    assert out["tracked"].tokens == plain and out["tracked"].metrics.relaxed_only_accepts == 0
    assert out["trtllm"].metrics.relaxed_only_accepts >= 2
    assert out["trtllm"].tokens[0][0] == plain[0][0]  # the prefill's token is the argmax under either rule


# ---------------------------------------------------------------------------------------------- sampling
def test_seeded_sampling_reproduces(tiny_model, prompts):
    kw = dict(draft="eagle", k=2, verify="sample", temperature=0.8, top_p=0.95)
    a = generate(tiny_model, prompts, 6, seed=11, **kw)
    b = generate(tiny_model, prompts, 6, seed=11, **kw)
    c = generate(tiny_model, prompts, 6, seed=12, **kw)
    assert a.tokens == b.tokens and a.metrics.accepted_hist == b.metrics.accepted_hist
    assert a.tokens != c.tokens


@pytest.mark.parametrize("draft,k,draft_sampling", [("none", 0, "greedy"), ("eagle", 2, "greedy"),
                                                     ("vanilla", 2, "sample")])
def test_seeded_rows_do_not_depend_on_their_batch(mtp_model, draft, k, draft_sampling):
    """verify='sample' with per-row seeds: each row of a batch of 8 (prompts of different lengths, a repeated
    prompt among them) equals the same prompt and seed run alone, and a reversed batch gives the same rows."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 9, 14, 3, 20, 7, 11, 5)]
    prompts[7] = prompts[0]
    seeds = [901, 17, 2**40 + 3, 0, 5, 77, 1234567, 902]
    kw = dict(draft=draft, k=k, verify="sample", temperature=1.5, draft_sampling=draft_sampling)
    batch = generate(mtp_model, prompts, 10, seed=seeds, **kw)
    alone = [generate(mtp_model, [p], 10, seed=[s], **kw).tokens[0] for p, s in zip(prompts, seeds)]
    assert batch.tokens == alone
    assert generate(mtp_model, prompts[::-1], 10, seed=seeds[::-1], **kw).tokens == alone[::-1]
    assert alone[0] != alone[7]  # same prompt, different seeds: the seed matters
    if k:
        assert sum(batch.metrics.accepted_hist[1:]) > 0  # drafts were accepted: the speculative path ran
    # An int seed gives row b the seed `seed + b`.
    assert generate(mtp_model, prompts[:3], 10, seed=40, **kw).tokens == \
        [generate(mtp_model, [p], 10, seed=40 + b, **kw).tokens[0] for b, p in enumerate(prompts[:3])]


class DistortedTable:
    """Sampled drafts from a q that differs from the target p: the target's top-3 logits in reversed order, looked up
    by the generated prefix (one shared prompt). Returns q so the verifier applies min(1, p/q)."""

    def __init__(self, P, logits_by_prefix, V):
        self.P, self.table, self.V, self.draft_forwards = P, logits_by_prefix, V, 0

    def lookup(self, prefix):
        lg = self.table.get(tuple(prefix))
        if lg is None:
            return torch.zeros(self.V)  # a state whose drafts are never emitted (past max_new_tokens)
        top = lg.topk(3)
        return torch.full((self.V,), -30.0).index_put_((top.indices,), top.values.flip(0))

    def propose(self, tokens_BS, hidden_BSD, n_B, p0_B, W, draw, max_n):
        gen = [tokens_BS[b, self.P: n].tolist() for b, n in enumerate(n_B.tolist())]
        d1, q1 = draw(torch.stack([self.lookup(x) for x in gen]))
        d2, q2 = draw(torch.stack([self.lookup(x + [d]) for x, d in zip(gen, d1.tolist())]))
        return written(tokens_BS, n_B, torch.stack((d1, d2), 1)), torch.stack((q1, q2), 1)


def _joint_law(m, prompt, sp):
    """Exact law of (t1, t2, t3) under plain sampling with `sp` (27 cells for top_k = 3), and the logits table
    the distorted proposer reads."""
    with torch.no_grad():
        p1 = filter_probs(m(torch.tensor([prompt])).logits[0, -1], sp)
        t1s = p1.nonzero().flatten().tolist()
        lg2 = m(torch.tensor([prompt + [t] for t in t1s])).logits[:, -1]
        pairs = [(t1, t2) for i, t1 in enumerate(t1s) for t2 in filter_probs(lg2[i], sp).nonzero().flatten().tolist()]
        lg3 = m(torch.tensor([prompt + list(x) for x in pairs])).logits[:, -1]
    exact = {}
    for i, (t1, t2) in enumerate(pairs):
        p2 = filter_probs(lg2[t1s.index(t1)], sp)
        p3 = filter_probs(lg3[i], sp)
        for t3 in p3.nonzero().flatten().tolist():
            exact[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    table = {(t,): lg2[i] for i, t in enumerate(t1s)} | {x: lg3[i] for i, x in enumerate(pairs)}
    return exact, table


def _assert_law(name, r, exact, B):
    cells = sorted(exact)
    counts = torch.zeros(len(cells), dtype=torch.float64)
    for t in r.tokens:
        assert tuple(t) in exact, f"{name}: {t} has zero probability under top_k = 3"
        counts[cells.index(tuple(t))] += 1
    e = B * torch.tensor([exact[c] for c in cells], dtype=torch.float64)
    assert e.min() >= 5
    stat = float(((counts - e) ** 2 / e).sum())
    assert stat < CHI2_CRIT_001_DOF26, f"{name}: chi2 = {stat:.1f} over 27 cells (26 dof, alpha 0.001)"


def test_speculative_sampling_matches_the_target_distribution(tiny_model):
    """500 copies of one prompt, top_k = 3, temperature 1, three new tokens: the joint law of (t1, t2, t3) over its
    27 cells must match the exact target law for plain sampling, MTP eagle k = 2 (greedy drafts) and sampled drafts
    from a distorted q (t2, t3 come out of speculative steps: accepted drafts, residual samples or bonus tokens)."""
    m, V, B = tiny_model, tiny_model.cfg.vocab_size, 500
    prompt = [7, 8, 9, 10]
    sp = SamplingParams(top_k=3)
    exact, table = _joint_law(m, prompt, sp)
    assert len(exact) == 27 and abs(sum(exact.values()) - 1) < 1e-5
    runs = {
        "none": generate(m, [prompt] * B, 3, verify="sample", top_k=3, seed=21),
        "eagle": generate(m, [prompt] * B, 3, draft="eagle", k=2, verify="sample", top_k=3, seed=22),
        "sampled q": Engine(m, GenerationConfig(max_new_tokens=3, draft=DraftConfig("eagle", 2, sampling="sample"),
                                                verify="sample", sampling=sp, seed=23),
                            proposer_factory=lambda *a: DistortedTable(len(prompt), table, V)).run([prompt] * B),
    }
    assert sum(runs["sampled q"].metrics.accepted_hist[1:]) > 100  # the distorted drafts are often accepted
    for name, r in runs.items():
        _assert_law(name, r, exact, B)


# ---------------------------------------------------------------------------------------------- draft vocabulary
@pytest.mark.parametrize("draft,k", [("eagle", 1), ("eagle", 3), ("vanilla", 2)])
def test_draft_vocabulary_strict_is_lossless(mtp_model, prompts, greedy, draft, k):
    """Drafts scored over a subset of the vocabulary: strict outputs stay those of greedy decoding; the whole
    vocabulary in id order is the plain head (same drafts, same acceptance); a subset that misses every token
    the target emits is never accepted (so the subset is really what the head scores)."""
    V = mtp_model.cfg.vocab_size
    base = [t[:N_NEW] for t in greedy["mtp2"][0]]  # plain greedy decoding (the module's one run)
    plain = generate(mtp_model, prompts, N_NEW, draft=draft, k=k)
    assert sum(plain.metrics.accepted_hist[1:]) > 0  # the drafts do get accepted: the comparison means something
    emitted = sorted({t for row in base for t in row})
    half = emitted[::2] + [i for i in range(V) if i not in set(emitted)][::3]
    for vocab in (half, emitted[1::2]):
        out = generate(mtp_model, prompts, N_NEW, draft=draft, k=k, draft_vocab=vocab)
        assert out.tokens == base
    whole = generate(mtp_model, prompts, N_NEW, draft=draft, k=k, draft_vocab=range(V))
    assert whole.tokens == base and whole.metrics.accepted_hist == plain.metrics.accepted_hist
    none = generate(mtp_model, prompts, N_NEW, draft=draft, k=k,
                    draft_vocab=[i for i in range(V) if i not in set(emitted)])
    assert none.tokens == base and sum(none.metrics.accepted_hist[1:]) == 0


def test_draft_vocabulary_keeps_sampling_exact(mtp_model):
    """Drafts sampled from the softmax over a draft vocabulary (zero elsewhere): speculative sampling still
    reproduces the target's joint law of three tokens (chi-square over the 27 cells of top_k = 3)."""
    m, B = mtp_model, 500
    prompt = [7, 8, 9, 10]
    sp = SamplingParams(top_k=3)
    exact, _ = _joint_law(m, prompt, sp)
    tokens = sorted({t for c in exact for t in c})
    vocab = tokens[::2] + [t for t in (3, 4, 5) if t not in tokens]  # half of what the law can emit, and others
    r = generate(m, [prompt] * B, 3, draft="eagle", k=2, verify="sample", top_k=3, draft_sampling="sample",
                 draft_vocab=vocab, seed=25)
    assert sum(r.metrics.accepted_hist[1:]) > 50  # drafts from the subset are accepted often
    _assert_law("eagle, sampled drafts over a draft vocabulary", r, exact, B)


# ---------------------------------------------------------------------------------------------- bad arguments
BAD = [
    (dict(draft="eagle", k=-1), ValueError, r"k must be an integer in \[1, 16\], got -1"),
    (dict(draft="medusa", k=1), ValueError, "draft must be one of none, vanilla, eagle, got 'medusa'"),
    (dict(draft="none", k=2), ValueError, r"k must be 0 with draft='none', got 2 \(it drafts nothing\)"),
    (dict(draft="vanilla", k=2), ValueError, "needs 2 MTP modules, the checkpoint has 1.*reuse_modules"),
    (dict(draft="eagle", k=2, verify="relaxed"), ValueError,
     r"think_ids must be a \(<think> id, </think> id\) pair with verify='relaxed', got None"),
    (dict(draft="eagle", k=2, verify="greedy"), ValueError,
     "verify must be one of strict, relaxed, sample, typical, got 'greedy'"),
    (dict(draft="eagle", k=2, draft_sampling="sample"), ValueError,
     "draft_sampling must be 'greedy' unless verify='sample', got 'sample'"),
    (dict(draft="eagle", k=2, verify="sample", temperature=0.0), ValueError,
     "temperature must be a number > 0, got 0.0"),
    (dict(draft="eagle", k=2, temprature=0.5), TypeError, r"unknown options \['temprature'\]"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be an integer >= 1"),
    (dict(stop_ids=(512,)), ValueError, r"token id 512 is outside the vocabulary \[0, 512\)"),
    (dict(verify="relaxed", think_ids=(TH, 600)), ValueError, "token id 600"),
    (dict(verify="relaxed", think_ids=(TH, ETH), span_rule="last"), ValueError, "span_rule must be one of"),
    (dict(eos_id=-1), ValueError, r"token id -1 is outside the vocabulary"),
    (dict(verify="sample", seed=[1, 2]), ValueError, r"seed as a list needs one int per prompt \(1\)"),
    (dict(verify="sample", seed=1.5), ValueError, "seed must be an int or one int per prompt"),
    (dict(prompts=[]), ValueError, "prompts is empty"),
    (dict(prompts=[[1, 2], []]), ValueError, r"prompts\[1\] is empty"),
    (dict(prompts=[[1, 512]]), ValueError, r"prompts\[0\] has token ids outside \[0, 512\): \[512\]"),
    (dict(prompts=[[-1, 3]]), ValueError, r"outside \[0, 512\): \[-1\]"),
    (dict(prompts=[[1] * 4096]), ValueError, "exceed max_position_embeddings"),
]


@pytest.mark.parametrize("kw,exc,match", BAD, ids=lambda x: str(x)[:60] if isinstance(x, dict) else None)
def test_bad_arguments_fail_before_any_work(tiny_model, kw, exc, match):
    def no_work(*_):
        raise AssertionError("a forward ran before the argument error")

    kw = dict(kw)
    p = kw.pop("prompts", [[1, 2, 3]])
    hooks = [mod.register_forward_pre_hook(no_work) for mod in (tiny_model, *tiny_model.mtp)]
    try:
        with pytest.raises(exc, match=match):
            generate(tiny_model, p, kw.pop("max_new_tokens", 4), **kw)
    finally:
        for h in hooks:
            h.remove()


# ---------------------------------------------------------------------------------------------- metrics
def test_spec_metrics_derived_values_and_merge():
    a = SpecMetrics(k=3, accepted_hist=[2, 3, 1, 4], row_steps=10, n_rows=2, new_tokens=30, time_decode_s=2.0)
    assert a.accept_cum == pytest.approx([0.8, 0.5, 0.4])
    assert a.accept_cond == pytest.approx([0.8, 5 / 8, 4 / 5])
    assert a.mean_accepted_len == pytest.approx(1 + (3 + 2 + 12) / 10)
    assert a.decode_tok_s == pytest.approx(14.0)
    b = SpecMetrics(k=3, accepted_hist=[1, 0, 0, 1], row_steps=2, n_rows=1, new_tokens=6)
    c = a.merge(b)
    assert c.accepted_hist == [3, 3, 1, 5] and c.row_steps == 12 and c.n_rows == 3 and c.new_tokens == 36
    assert c.mean_accepted_len == pytest.approx(1 + (3 + 2 + 15) / 12)
    with pytest.raises(ValueError, match="k=3 and k=2"):
        a.merge(SpecMetrics(k=2))
    empty = SpecMetrics(k=2)
    assert empty.accepted_hist == [0, 0, 0] and empty.mean_accepted_len == 0.0 and empty.accept_cond == [0.0, 0.0]


def test_drafter_prompt_pass_is_timed_apart(tiny_model, prompts):
    """time_draft_prefill_s: the drafter's pass over the prompt, inside time_decode_s, so that a per-step wall
    figure can leave it out (mtp-bench's `spec_step_times`); none when nothing drafts."""
    from mtp.bench.timing import spec_step_times

    spec = generate(tiny_model, prompts[:1], 6, draft="eagle", k=2).metrics
    assert 0 < spec.time_draft_prefill_s < spec.time_decode_s
    assert spec.to_dict()["time/draft_prefill_s"] == spec.time_draft_prefill_s
    t = spec_step_times(spec)
    assert t["draft_prefill_ms"] == spec.time_draft_prefill_s * 1e3 and t["gpu_step_ms"] is None
    assert t["step_ms_wall"] == pytest.approx((spec.time_decode_s - spec.time_draft_prefill_s)
                                              / spec.target_forwards * 1e3)
    assert generate(tiny_model, prompts[:1], 6, draft="none").metrics.time_draft_prefill_s == 0.0
    assert spec.merge(spec).time_draft_prefill_s == 2 * spec.time_draft_prefill_s
