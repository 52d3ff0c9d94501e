"""zartbot's "DeepSeek-V3/R1 inference efficiency analysis" (2025-03-14) re-derived from its own assumptions:
its TL;DR tables (prefill TPS on H800 / H20 under TP4 x DP8 attention and EP32; decode TPOT / TPS / per-GPU total
for H800 TP1, H20 TP4 and H20-3e TP8 at batch 32-64-128 under EP144) from `mtp.plan.cost`'s MAC counts
(V3: full attention, no indexer) and the article's recipe: time = FP8 GEMM MACs at the FP8 rate + attention MACs
at the FP16 rate (its o_proj included), rates = peak x 0.85 x (SMs not reserved for communication) / SMs, plus
KV-cache loads, all-reduce and all-to-all terms added per layer.

The article's arithmetic is reproduced as written, including where it is inconsistent; `fixed` gives each figure
with those inconsistencies repaired (the list is `INCONSISTENCIES`, each with its size in `compare`'s notes).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.config import ModelConfig
from .cost import Layout, Shape, forward_terms

MIB, GIB = 2 ** 20, 2 ** 30


@dataclass(frozen=True)
class ArticleGPU:
    """The article's GPU_perf figures (its code, not the vendor sheets: FP8 / FP16 TFLOPS already ~80% of the
    dense peaks), bandwidths in GB/s."""
    name: str
    sm: int
    fp16: float
    fp8: float
    mem_bw: float
    nvlink: float
    pcie: float


DISCOUNT = 0.85  # every figure at 85% of the above
GROUP_GEMM = 0.7  # decode expert GEMMs at 70% (DeepGEMM at small batch)
H800 = ArticleGPU("H800", 132, 791.6, 1583.2, 3350, 200, 50)
H20 = ArticleGPU("H20", 78, 118.4, 236.8, 3350, 400, 50)
H20_3E = ArticleGPU("H20_3e", 78, 118.4, 236.8, 4800, 400, 50)
PREFILL_COMM_SM = {"H800": 24, "H20": 10}
SEQ_LEN = 4383  # mean prompt (P = 4383, D = 1210: mean KV length per output token P + D / 2 = 4989)
KV_HIT = 0.563  # DeepSeek's published prefix-cache hit rate

# (column, GPU, attention TP, batch per GPU)
DECODE_CASES = [("H800(TP1) b32", H800, 1, 32), ("H800(TP1) b64", H800, 1, 64), ("H800(TP1) b128", H800, 1, 128),
                ("H20(TP4) b32", H20, 4, 32), ("H20_3e(TP8) b32", H20_3E, 8, 32), ("H20_3e(TP8) b64", H20_3E, 8, 64)]
PUBLISHED_DECODE = {  # TL;DR: TPOT(Overlap), TPOT, TPS(Overlap), TPS, Total(Overlap), Total
    "H800(TP1) b32": (9.858, 17.023, 101.442, 58.746, 3246.137, 1879.856),
    "H800(TP1) b64": (19.716, 34.045, 50.721, 29.373, 3246.137, 1879.856),
    "H800(TP1) b128": (39.431, 68.090, 25.360, 14.686, 3246.137, 1879.856),
    "H20(TP4) b32": (35.367, 42.532, 28.275, 23.512, 904.803, 752.383),
    "H20_3e(TP8) b32": (29.613, 36.778, 33.768, 27.190, 1080.591, 870.082),
    "H20_3e(TP8) b64": (49.005, 63.334, 20.406, 15.789, 1306.001, 1010.516)}
DECODE_METRICS = ("TPOT(Overlap) ms", "TPOT ms", "TPS(Overlap) per user", "TPS per user",
                  "Total(Overlap) tok/s per GPU", "Total tok/s per GPU")
PUBLISHED_PREFILL = {"H800": (52240.1, 33741.0), "H20": (9377.0, 8536.9)}  # TPS(Overlap), TPS per node

INCONSISTENCIES = {
    "units": "bytes / 2^20 (or 2^30) divided by GB/s: bandwidth terms are 4.9% (MiB) / 7.4% (GiB) too short",
    "decode_allreduce": "the decode TP all-reduce carries seq_len (4383) tokens x dim x 2 B instead of the batch's "
                        "tokens",
    "tp_batch": "TP columns split one batch of B over the TP group for MLA, but count B tokens per GPU for the "
                "experts and B tok/s-users per GPU in Total (a TP group of T GPUs serves B users, not T x B)",
    "prefill_square": "prefill attention counts all q x kv pairs (4383^2), not the causal half, and recomputes all "
                      "4383 tokens although 56.3% hit the prefix cache (only kv_a is discounted)",
}


def _macs(cfg: ModelConfig, mla: str, q: int, kv: int) -> dict:
    """The MLA MACs of one sequence (no batch), as cost.py counts them, V3-style: full attention, no causal cut."""
    terms = forward_terms(cfg, Layout(), Shape(1, q, kv, "prefill" if q > 1 else "decode", mla, dsa=False,
                                               causal=False))
    return {t.name: t.macs for t in terms}


def _split(m: dict, kv_a_scale: float) -> tuple[float, float]:
    """(FP8 GEMM, FP16 attention) GFLOP under the article's booking: o_proj counted with attention."""
    gemm = sum(v for k, (v, _) in m.items() if k not in ("scores", "values", "o_proj", "kv_a"))
    gemm += m["kv_a"][0] * kv_a_scale
    attn = m["scores"][0] + m["values"][0] + m["o_proj"][0]
    return 2 * gemm / 1e9, 2 * attn / 1e9


def _rates(g: ArticleGPU, comm_sm: int) -> tuple[float, float]:
    frac = DISCOUNT * (g.sm - comm_sm) / g.sm
    return g.fp8 * frac, g.fp16 * frac  # TFLOPS: GFLOP / TFLOPS = ms


def _bw_ms(nbytes: float, gbps: float, unit: float) -> float:
    return nbytes / unit / (gbps * DISCOUNT) * (1e3 if unit == GIB else 1.0)  # MiB / (GB/s) -> "ms"; GiB -> s


def decode_case(cfg: ModelConfig, g: ArticleGPU, tp: int, bs: int, fixes: frozenset = frozenset()) -> tuple[float, ...]:
    fp8, fp16 = _rates(g, 0)
    # kv_cache_rate = 1 at decode drops the new token's own kv_a projection (0.002% of the FLOPs): kept as written
    gemm, attn = _split(_macs(cfg, "premultiplied", 1, SEQ_LEN)["mla"], 0.0)
    mib, gib = (1e6, 1e9) if "units" in fixes else (MIB, GIB)
    tokens_per_gpu = bs / tp if "tp_batch" in fixes else bs  # a TP group of tp GPUs serves bs users
    tp1 = bs * (gemm / fp8 + attn / fp16)
    ar_tokens = bs if "decode_allreduce" in fixes else SEQ_LEN
    ar = _bw_ms(ar_tokens * cfg.hidden_size * 2, g.nvlink, mib) if tp > 1 else 0.0
    load_kv = SEQ_LEN * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * bs / gib / (g.mem_bw * DISCOUNT) * 1e3
    dense_mla = tp1 + load_kv
    sparse_mla = tp1 / tp + ar + load_kv
    dense_mlp = 2 * 3 * bs * cfg.hidden_size * cfg.intermediate_size / 1e9 / fp8
    expert = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size / 1e9
    shared = tokens_per_gpu * expert / fp8 / GROUP_GEMM
    routed = tokens_per_gpu * cfg.num_experts_per_tok * expert / fp8 / GROUP_GEMM
    dispatch = _bw_ms(tokens_per_gpu * cfg.hidden_size * cfg.num_experts_per_tok, g.pcie, mib)
    n_dense = cfg.first_k_dense_replace
    n_moe = cfg.num_hidden_layers - n_dense
    tpot_o = n_dense * (dense_mla + dense_mlp) + n_moe * (sparse_mla + shared + routed)
    tpot = tpot_o + n_moe * 3 * dispatch  # combine = 2 x dispatch (bf16)
    users = tokens_per_gpu
    return tpot_o, tpot, 1e3 / tpot_o, 1e3 / tpot, 1e3 / tpot_o * users, 1e3 / tpot * users


def prefill_case(cfg: ModelConfig, g: ArticleGPU, tp: int = 4, dp: int = 8, nodes: int = 4,
                 fixes: frozenset = frozenset()) -> tuple[float, float]:
    """Per-node prefill tokens/s of the TP4 x DP8, EP32 unit (4 nodes x 8 GPUs), TPS(Overlap) and TPS."""
    fp8, fp16 = _rates(g, PREFILL_COMM_SM[g.name])
    S = SEQ_LEN
    fixed = "prefill_square" in fixes
    q = round(S * (1 - KV_HIT)) if fixed else S
    m = _macs(cfg, "naive", q, S)
    gemm, attn = _split(m["mla"], 1.0 if fixed else 1 - KV_HIT)
    if fixed:  # causal: the q new queries see the cached prefix and each other's earlier half
        attn -= 2 * (m["mla"]["scores"][0] + m["mla"]["values"][0]) / 1e9 * (1 - (S - q + (q + 1) / 2) / S)
    mib = 1e6 if "units" in fixes else MIB
    mla = gemm / fp8 + attn / fp16
    tp_mla = mla / tp + _bw_ms(q * cfg.hidden_size * 2, g.nvlink, mib)
    dense_mlp = 2 * 3 * q * cfg.hidden_size * cfg.intermediate_size / 1e9 / fp8
    expert = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size / 1e9
    devices = tp * dp
    shared = q * dp / devices * expert / fp8
    routed = q * dp * cfg.num_experts_per_tok / devices * expert / fp8
    per_node = 8
    dispatch = _bw_ms(3 * (per_node / tp) * q * cfg.hidden_size, g.pcie * per_node, mib)  # 3 remote nodes
    n_dense = cfg.first_k_dense_replace
    n_moe = cfg.num_hidden_layers - n_dense
    t_o = n_dense * (mla + dense_mlp) + n_moe * (tp_mla + shared + routed)
    t = t_o + n_moe * 3 * dispatch
    return dp * S * 1e3 / t_o / nodes, dp * S * 1e3 / t / nodes


def _figures(cfg: ModelConfig, fixes: frozenset) -> list[tuple[str, str, float, float]]:
    out = []
    for gname, g in (("H800", H800), ("H20", H20)):
        vals = prefill_case(cfg, g, fixes=fixes)
        for i, metric in enumerate(("TPS(Overlap) per node", "TPS per node")):
            out.append((f"prefill {gname} TP4xDP8 EP32", metric, PUBLISHED_PREFILL[gname][i], vals[i]))
    for case, g, tp, bs in DECODE_CASES:
        vals = decode_case(cfg, g, tp, bs, fixes)
        for i, metric in enumerate(DECODE_METRICS):
            out.append((f"decode {case} EP144", metric, PUBLISHED_DECODE[case][i], vals[i]))
    return out


def compare(cfg: ModelConfig) -> list[dict]:
    """One row per published figure: {case, metric, published, model, rel_err, fixed} (fixed: every entry of
    INCONSISTENCIES repaired)."""
    fixed = _figures(cfg, frozenset(INCONSISTENCIES))
    return [{"case": c, "metric": m, "published": p, "model": round(v, 4), "rel_err": round(v / p - 1, 5),
             "fixed": round(f[3], 4)} for (c, m, p, v), f in zip(_figures(cfg, frozenset()), fixed)]


def effects(cfg: ModelConfig) -> dict[str, tuple[float, float]]:
    """Each inconsistency alone: the (smallest, largest) relative change it makes to a figure it moves."""
    base = _figures(cfg, frozenset())
    out = {}
    for name in INCONSISTENCIES:
        moved = [f[3] / b[3] - 1 for b, f in zip(base, _figures(cfg, frozenset({name}))) if abs(f[3] / b[3] - 1) > 1e-9]
        out[name] = (min(moved, key=abs), max(moved, key=abs)) if moved else (0.0, 0.0)
    return out


def format_rows(rows: list[dict], cfg: ModelConfig | None = None) -> str:
    lines = [f"{'case':34s} {'metric':30s} {'published':>10s} {'model':>10s} {'rel err':>8s} {'fixed':>10s}"]
    for r in rows:
        lines.append(f"{r['case']:34s} {r['metric']:30s} {r['published']:10.3f} {r['model']:10.3f} "
                     f"{r['rel_err'] * 100:7.2f}% {r['fixed']:10.3f}")
    worst = max(abs(r["rel_err"]) for r in rows)
    lines += ["", f"{len(rows)} figures, worst |rel err| {worst * 100:.3f}%. The article's own inconsistencies "
              "('fixed' repairs all; alone, each changes the figures it touches by):"]
    eff = effects(cfg) if cfg is not None else {}
    for k, v in INCONSISTENCIES.items():
        size = f" [{eff[k][0] * 100:+.1f}% .. {eff[k][1] * 100:+.1f}%]" if k in eff else ""
        lines.append(f"  {k}{size}: {v}")
    return "\n".join(lines)
