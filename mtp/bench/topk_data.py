"""What the indexer's top-k sees inside a decode step, and what each radix phase costs on it (issue 25).

    python -m mtp.bench.topk_data [--layers 4] [--ctx 32768] [--widths 1 4] [--out FILE]    # one GPU

Why: inside the TP=8 rank's step at 32k the radix top-k's split kernel takes 18-19 us per layer (profile,
BENCHMARKS.md session 14), where the three launches together took ~22 us in isolation on synthetic scores
(`mtp.bench.topk_moe`). The split kernel's serial tail depends on the data: it ranks the candidates that share the
k-th key's 16-bit prefix (pairwise up to `topk.SMALL`, else byte passes over them in one program). So: build a
shallow TP=8 'split' rank (real widths, random FP8 weights, `fill_cache_random` cache, as `mtp-bench --tp 8`),
run one eager step per width with the radix top-k's inputs captured, and per captured score row report the
candidates (`candidate_stats`); then time the three kernels (profiler, graph replays) on those rows beside rows of
the same shape drawn from N(0, 1) and rows of zeros (every score tied), each with the kernels' V2 and V1 (switch
topk_split_v2), alternated twice. On CPU (no radix kernels) it checks the stats on random rows only.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from mtp.kernels.topk import HIST, SMALL


def candidate_stats(scores_S: torch.Tensor, k: int) -> dict:
    """For one row of scores (every position a candidate unless -inf / NaN): the candidates, the k-th largest
    key's 16-bit prefix P (as `topk._row_prefix` finds it), how many candidates share P (what the split kernel's
    last program ranks: pairwise up to SMALL, byte passes above), how many share the k-th key exactly, and the
    spread of the scores."""
    s = scores_S.detach().float().cpu()
    s = torch.where(s == 0, torch.zeros_like(s), s)  # -0.0 counts as +0.0, as `score_keys`
    valid = (s != float("-inf")) & ~s.isnan()
    b = s.view(torch.int32)
    key = torch.where(b >= 0, b, b ^ 0x7FFFFFFF)[valid]
    n = int(key.numel())
    out = {"n_valid": n, "k": k, "small": SMALL}
    if n <= k:
        return dict(out, all_kept=True)
    kth = torch.sort(key, descending=True).values[k - 1]
    pre = (key >> 16) + HIST // 2
    P = int((kth >> 16) + HIST // 2)
    v = s[valid]
    return dict(out, all_kept=False, prefix=P, n_prefix=int((pre == P).sum()), n_above_prefix=int((pre > P).sum()),
                n_tied_kth=int((key == kth).sum()), path="pairwise" if int((pre == P).sum()) <= SMALL else "radix",
                mean=float(v.mean()), std=float(v.std()), kth_score=float(v.sort(descending=True).values[k - 1]))


def capture_step_scores(layers: int, ctx: int, widths: list[int], seed: int = 0,
                        any_ids: bool = False) -> dict[int, list[torch.Tensor]]:
    """Score rows [T, S] that the radix top-k received in one eager step per width, per width (every layer). Token
    ids from the rank's vocabulary shard (`rank_steps.rank_token_ids`, as the bench draws them), or any_ids: from the
    whole vocabulary, as the bench drew them before session 14 (layer 0 then scores every key 0 on this rank)."""
    from mtp.bench.rank_steps import rank_token_ids
    from mtp.backends.fast_path import enable_fast_path
    from mtp.checkpoint.synthetic import fill_cache_random
    from mtp.kernels import indexer as ix
    from mtp.model.presets import real_config
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.simulate import simulated_rank
    from mtp.parallel.synthetic import random_parallel_model

    cfg = real_config(layers=layers, dense_layers=min(3, layers - 1), mtp_modules=1)
    got: dict[int, list[torch.Tensor]] = {}
    real = ix.radix_topk
    with simulated_rank(8, 0) as comm, torch.no_grad():
        model = random_parallel_model(cfg, comm, ParallelPlan(8, expert_layout="split"), device="cuda",
                                      dtype=torch.bfloat16, seed=seed)
        enable_fast_path(model)
        cache = fill_cache_random(model.new_cache(1, ctx + max(widths)), ctx, seed=seed + ctx)
        base = cache.seq_lens.clone()
        g = torch.Generator().manual_seed(seed + 1)
        ids = (torch.randint(0, cfg.vocab_size, (1, max(widths)), generator=g) if any_ids
               else rank_token_ids(model, (1, max(widths)), g))
        for w in widths:
            rows: list[torch.Tensor] = []

            def spy(sc, *a, **kw):
                rows.append(sc.detach().reshape(-1, sc.shape[-1]).clone())
                return real(sc, *a, **kw)

            ix.radix_topk = spy
            try:
                cache.truncate(base)
                model(ids[:, :w].cuda(), cache, kv_len=ctx + w)
            finally:
                ix.radix_topk = real
            got[w] = rows
        del model, cache
    torch.cuda.empty_cache()
    return got


def profile_topk(sc_TS: torch.Tensor, k: int, calls: int = 20, split_v2: bool = True) -> dict:
    """Per-kernel us per call of `radix_topk` (kept workspace, as the fast path; its kernels' V2 or V1, switch
    topk_split_v2) on these rows: profiler over replays of a graph of `calls` calls."""
    from mtp.bench.timing import kernel_profile
    from mtp.decode.graphs import capture_graph
    from mtp.kernels.topk import radix_topk

    sc = sc_TS.reshape(1, *sc_TS.shape).contiguous()
    lens = torch.full((1,), sc.shape[-1] - sc.shape[1], dtype=torch.long, device=sc.device)
    radix_topk(sc, lens, k, rearm=True, split_v2=split_v2)  # the kept workspace exists before the capture

    def many():
        for _ in range(calls):
            radix_topk(sc, lens, k, rearm=True, split_v2=split_v2)

    g = capture_graph(many)
    prof = kernel_profile(g.replay, steps=3)
    return {r["name"]: round(r["us_per_step"] / calls, 2) for r in prof["top"] if r["calls_per_step"] >= calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="trunk layers of the rank (the first min(3, n-1) dense)")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--any-ids", action="store_true", help="token ids from the whole vocabulary (the bench before "
                    "session 14), not the rank's shard")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "eval/results"), "topk_data.json"))
    args = ap.parse_args()
    res: dict = {"args": vars(args), "widths": {}}
    g = torch.Generator().manual_seed(3)
    if not torch.cuda.is_available():  # the stats on random rows: what the tests check
        for w in args.widths:
            res["widths"][w] = [candidate_stats(torch.randn(args.ctx, generator=g), args.k) for _ in range(w)]
    else:
        def timed(sc_TS: torch.Tensor) -> dict:
            """The kernels' us per call with V2 and V1 (switch topk_split_v2), alternated twice: v2, v1, v2#2, v1#2."""
            return {f"v{2 - i % 2}" + ("#2" if i >= 2 else ""): profile_topk(sc_TS, args.k, split_v2=i % 2 == 0)
                    for i in range(4)}

        for w, rows in capture_step_scores(args.layers, args.ctx, args.widths, any_ids=args.any_ids).items():
            ent = res["widths"][w] = {"layers": []}
            for li, sc in enumerate(rows):
                ent["layers"].append({"rows": [candidate_stats(r, args.k) for r in sc], "kernels_us": timed(sc)})
            rnd = torch.randn(sc.shape, generator=g).to(sc.device)
            ent["randn"] = {"rows": [candidate_stats(r, args.k) for r in rnd], "kernels_us": timed(rnd)}
            equal = torch.zeros_like(sc)  # every score tied: the split kernel's slowest rows
            ent["equal"] = {"rows": [candidate_stats(r, args.k) for r in equal], "kernels_us": timed(equal)}
    for w, ent in res["widths"].items():
        items = ent if isinstance(ent, list) else [r for lay in ent["layers"] for r in lay["rows"]]
        print(f"w={w}: candidates at the k-th key's 16-bit prefix per row: {[r.get('n_prefix') for r in items]}")
        if isinstance(ent, dict):
            for li, lay in enumerate(ent["layers"]):
                print(f"  layer {li}: {lay['kernels_us']}")
            for name in ("randn", "equal"):
                print(f"  {name}: {[r.get('n_prefix') for r in ent[name]['rows']]} {ent[name]['kernels_us']}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
