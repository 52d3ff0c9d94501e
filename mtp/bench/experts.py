"""Busiest-rank expert reads per MoE layer, per expert layout (`mtp.placement`), EP size and tokens per step.

    python -m mtp.bench.experts --ep 8 --widths 1 2 3 4 8 32 64 --json experts.json

The slowest rank sets the pace of an expert-parallel step: per MoE layer it reads the distinct local experts the
step's tokens chose, and the step waits for the rank that reads the most. Two sources of routing:
- uniform: DeepSeek-V3.2's group-limited router (`mtp.model.moe.route`: top-`topk_group` of `n_group` groups,
  then top-K experts) on i.i.d. uniform scores, per token independently, over `--samples` seeded Monte Carlo
  draws of one layer (the standard error of each mean is printed). Tokens of one verify block come from one
  sequence and are likelier to share experts than independent draws: this errs towards more distinct experts.
- trained: the bundled trained model's real router choices (`mtp/assets/dsv32_stdlib_mini`: 8 experts in 4
  groups of 2, top-2 groups, 2 experts per token, 3 MoE layers -- NOT the real model's 256 / 8 / 4 / 8),
  recorded on every position of greedy generations from 8 docstring prompts; width w = w consecutive positions
  of one sequence (a verify block), batch b > 4 = b positions drawn at random from all recorded ones. Its EP is
  `--trained-ep` (default its n_group = 4, so that 'contiguous' puts one routing group on each rank, as EP 8
  does on the real model).
'split' holds 1/EP of every expert: the busiest rank reads (distinct experts) / EP expert-equivalents.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..model.moe import route
from ..placement import EXPERT_LAYOUTS, expert_owners

WIDTHS = (1, 2, 3, 4, 8, 32, 64)
PROMPTS = ("Return a copy of the list in reverse order.", "Return the number of lines in a text file.",
           "Parse an ISO 8601 date string into a datetime object.", "Join path components with the separator.",
           "Return True if the string is a valid Python identifier.", "Encode bytes as base64 text.",
           "Remove duplicate items from a list while keeping their order.", "Compute the SHA-256 digest of a file.")


def busiest_per_sample(ids_SNK: torch.Tensor, n_experts: int, world: int, layout: str, seed: int = 0) -> torch.Tensor:
    """[S] float: per sample (the N tokens of one step at one layer), the most expert reads of any rank -- distinct
    local experts, or for 'split' distinct experts / world (each rank reads its 1/world of every chosen one)."""
    S = ids_SNK.shape[0]
    chosen_SE = torch.zeros(S, n_experts, dtype=torch.bool).scatter_(1, ids_SNK.reshape(S, -1), True)
    owners = expert_owners(layout, n_experts, world, seed)
    if owners is None:
        return chosen_SE.sum(1).double() / world
    owner_EW = torch.nn.functional.one_hot(torch.tensor(owners), world).double()
    return (chosen_SE.double() @ owner_EW).amax(1)


def uniform_routes(E: int, groups: int, topk_groups: int, K: int, tokens: int, samples: int, seed: int) -> torch.Tensor:
    """[samples, tokens, K] expert ids of the group-limited router on i.i.d. uniform scores (seeded)."""
    return uniform_draws(E, groups, topk_groups, K, tokens, samples, seed)[1]


def uniform_draws(E: int, groups: int, topk_groups: int, K: int, tokens: int, samples: int, seed: int,
                  normalize: bool = True, route_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [samples, tokens, K] float64, ids [samples, tokens, K]) of the group-limited router on i.i.d.
    uniform scores (seeded; the ids do not depend on `normalize` / `route_scale`, which only scale weights)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(samples * tokens, E, generator=g, dtype=torch.float64)
    w, ids = route(scores, torch.zeros(E, dtype=torch.float64), groups, topk_groups, K, normalize, route_scale)
    return w.view(samples, tokens, K), ids.view(samples, tokens, K)


def uniform_table(cfg, world: int, widths, samples: int, seed: int) -> dict:
    """{layout: {w: {mean, sem, hist}}} for the uniform router on cfg's expert / group shape."""
    out: dict = {}
    for w in widths:
        ids = uniform_routes(cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, w,
                             samples, seed + w)
        for layout in EXPERT_LAYOUTS:
            out.setdefault(layout, {})[w] = summary(busiest_per_sample(ids, cfg.n_routed_experts, world, layout, seed))
    return out


def summary(b_S: torch.Tensor) -> dict:
    values, counts = torch.unique(b_S, return_counts=True)
    return {"mean": b_S.mean().item(), "sem": (b_S.std() / len(b_S) ** 0.5).item() if len(b_S) > 1 else 0.0,
            "hist": {f"{v:g}": int(c) for v, c in zip(values.tolist(), counts.tolist())}, "samples": len(b_S)}


@torch.no_grad()
def trained_routes(new_tokens: int = 48) -> tuple[object, list[dict[int, torch.Tensor]]]:
    """(config, per prompt {MoE layer: [T, K] ids}) of the bundled trained model's router over each prompt's
    positions: the prefill's and every greedily generated token's (CPU, float32)."""
    import mtp
    from ..checkpoint.tiny import default_checkpoint
    from ..text.prompt import encode_chat
    from ..text.tokenizer import Tokenizer

    path = default_checkpoint()
    model = mtp.load_model(path, device="cpu", dtype=torch.float32)
    tok = Tokenizer.from_dir(path)
    seqs = []
    for text in PROMPTS:
        rec: dict[int, list] = {}
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o, li=li: rec.setdefault(li, []).append(o[1]))
                 for li, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
        try:
            ids = encode_chat([{"role": "user", "content": text}], tok, thinking=True)
            mtp.generate(model, [ids], max_new_tokens=new_tokens, draft="none", eos_id=tok.eos_id)
        finally:
            for h in hooks:
                h.remove()
        seqs.append({li: torch.cat(parts) for li, parts in rec.items()})
    return model.cfg, seqs


def trained_table(cfg, seqs: list[dict], world: int, widths, samples: int, seed: int) -> dict:
    """{layout: {w: {mean, sem, hist, per_layer}}} from recorded routes: windows of w consecutive positions for
    w <= 4, else w positions drawn from all (seeded); `samples` windows per layer."""
    rng = random.Random(seed)
    out: dict = {}
    for w in widths:
        per_layer: dict = {}
        for li in sorted(seqs[0]):
            pool = [s[li] for s in seqs]
            if w <= 4:
                picks = [pool[p][t:t + w] for p, t in ((i, rng.randrange(len(pool[i]) - w + 1))
                                                        for i in (rng.randrange(len(pool)) for _ in range(samples)))]
            else:
                flat = torch.cat(pool)
                picks = [flat[rng.sample(range(len(flat)), w)] for _ in range(samples)]
            per_layer[li] = torch.stack(picks)
        for layout in EXPERT_LAYOUTS:
            b = {li: busiest_per_sample(ids, cfg.n_routed_experts, world, layout, seed) for li, ids in per_layer.items()}
            row = summary(torch.cat(list(b.values())))
            row["per_layer"] = {li: v.mean().item() for li, v in b.items()}
            out.setdefault(layout, {})[w] = row
    return out


def draw_busiest(cfg, layout: str, world: int, tokens: int, n_layers: int, seed: int) -> list[int]:
    """One draw per MoE layer from the uniform-router distribution of the busiest rank's expert reads for
    `tokens` tokens per step: distinct local experts of the busiest rank, or for 'split' the distinct experts
    (each rank reads a slice of every one). Seeded."""
    ids = uniform_routes(cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, tokens,
                         n_layers, seed)
    return draw_counts(busiest_per_sample(ids, cfg.n_routed_experts, world, layout, seed), layout, world)


@dataclass
class BusiestRoute:
    """One MoE layer's routes for the busiest rank: `count` its drawn expert reads (distinct local experts;
    'split': distinct experts), `w_TK` / `ids_TK` the drawn router output of the step's T tokens with the expert
    ids renamed so that the busiest rank's experts are the simulated rank's own (`busiest_routes`)."""

    count: int
    w_TK: torch.Tensor
    ids_TK: torch.Tensor


def busiest_routes(cfg, layout: str, world: int, tokens: int, n_layers: int, seed: int,
                   local: Sequence[int]) -> list[BusiestRoute]:
    """Per MoE layer, one draw of the uniform group-limited router for `tokens` tokens (the draws of
    `draw_busiest` with the same arguments: same counts), as the rank holding expert ids `local` would see them
    if it were that step's busiest rank under `layout`: the busiest rank's experts (most distinct chosen ones,
    lowest rank on ties) are renamed to `local` (ascending to ascending), the other ranks' experts to the other
    ids, so the route's distinct local experts equal the drawn count and its tokens spread over them as drawn.
    A renaming of experts keeps every per-token choice (K distinct experts, their weights); only 'contiguous'
    at EP = n_group also keeps each id's routing group. 'split': every expert is local (`local` = all E), ids as
    drawn. Weights as the config's router makes them (`norm_topk_prob`, `routed_scaling_factor`)."""
    E = cfg.n_routed_experts
    owners = expert_owners(layout, E, world, seed)
    local = list(local)
    if len(local) != (E if owners is None else E // world) or len(set(local)) != len(local) or \
            not all(0 <= e < E for e in local):
        raise ValueError(f"busiest_routes: local must be {'all' if owners is None else E // world} distinct expert "
                         f"ids in [0, {E}) for layout {layout!r} at world {world}, got {local}")
    w, ids = uniform_draws(E, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, tokens, n_layers, seed,
                           cfg.norm_topk_prob, cfg.routed_scaling_factor)
    counts = draw_counts(busiest_per_sample(ids, E, world, layout, seed), layout, world)
    out = []
    for s in range(n_layers):
        if owners is None:
            out.append(BusiestRoute(counts[s], w[s], ids[s]))
            continue
        chosen = set(ids[s].flatten().tolist())
        per_rank = [0] * world
        for e in chosen:
            per_rank[owners[e]] += 1
        busiest = max(range(world), key=lambda r: (per_rank[r], -r))
        mine = set(local)
        rename = torch.empty(E, dtype=torch.long)
        rename[[e for e in range(E) if owners[e] == busiest]] = torch.tensor(local)
        rename[[e for e in range(E) if owners[e] != busiest]] = torch.tensor([e for e in range(E) if e not in mine])
        out.append(BusiestRoute(counts[s], w[s], rename[ids[s]]))
    return out


def draw_counts(b_S: torch.Tensor, layout: str, world: int) -> list[int]:
    """`busiest_per_sample`'s reads as integer counts: distinct local experts, or for 'split' distinct experts."""
    return [round(v * world) if layout == "split" else round(v) for v in b_S.tolist()]


def print_table(title: str, table: dict) -> None:
    widths = list(next(iter(table.values())))
    print(title)
    print(f"{'layout':>12s} " + " ".join(f"{'w=' + str(w):>12s}" for w in widths))
    for layout, row in table.items():
        print(f"{layout:>12s} " + " ".join(f"{row[w]['mean']:7.2f}±{row[w]['sem']:.2f}" for w in widths))


def main(argv=None) -> dict:
    from ..model.presets import real_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=8, help="expert-parallel ranks for the real config (uniform router)")
    ap.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS), help="tokens per step")
    ap.add_argument("--samples", type=int, default=20000, help="Monte Carlo steps per width (uniform router)")
    ap.add_argument("--trained-ep", type=int, default=None, help="EP for the trained model (default: its n_group)")
    ap.add_argument("--trained-samples", type=int, default=4000, help="windows per layer and width (trained router)")
    ap.add_argument("--no-trained", action="store_true", help="skip the trained model's router")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.ep < 1 or min(a.widths) < 1 or a.samples < 2:
        ap.error(f"--ep, --widths must be >= 1 and --samples >= 2, got {a.ep}, {a.widths}, {a.samples}")
    cfg = real_config(layers=4, dense_layers=3)
    res = {"date": time.strftime("%Y-%m-%d"), "device": "cpu", "args": vars(a),
           "uniform": {"config": "DeepSeek-V3.2: 256 experts, 8 groups, top-4 groups, 8 per token", "ep": a.ep,
                       "table": uniform_table(cfg, a.ep, a.widths, a.samples, a.seed)}}
    print_table(f"uniform router, real config, EP={a.ep}: mean busiest-rank expert reads per MoE layer "
                f"({a.samples} seeded samples per width; ± standard error)", res["uniform"]["table"])
    if not a.no_trained:
        tcfg, seqs = trained_routes()
        ep = a.trained_ep or tcfg.n_group
        res["trained"] = {"config": f"bundled model: {tcfg.n_routed_experts} experts, {tcfg.n_group} groups, top-"
                                    f"{tcfg.topk_group} groups, {tcfg.num_experts_per_tok} per token", "ep": ep,
                          "positions": sum(len(next(iter(s.values()))) for s in seqs),
                          "table": trained_table(tcfg, seqs, ep, a.widths, a.trained_samples, a.seed)}
        print_table(f"trained router ({res['trained']['config']}), EP={ep}, {res['trained']['positions']} positions",
                    res["trained"]["table"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
