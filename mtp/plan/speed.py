"""Time from terms: each term costs max(compute, memory) on its rank plus a fixed cost per kernel launch, and
its collectives; a forward is the sum over terms without overlap, or max(work, communication) with it (two
micro-batches, one's collectives hidden behind the other's kernels). Then TTFT, TPOT and tok/s at batch B with
MTP k and an acceptance length.

`Efficiency` holds the achieved fractions of peak per kernel class: HBM bandwidth, tensor-core FLOPs (a class
whose GEMMs run at small M, or on CUDA cores, reaches a few percent of the dense peak), and a fixed cost per
kernel launch. The default is the pure roofline (every fraction 1, no launch cost); `mtp.plan.calibrate` fits
them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..model.config import ModelConfig
from .cost import Layout, Shape, Term, draft_terms, forward_terms
from .collectives import MeasuredComm
from .hardware import GB, GPU

KINDS = ("weights", "experts", "attention", "indexer", "head")


@dataclass(frozen=True)
class Efficiency:
    bw: tuple[tuple[str, float], ...] = tuple((k, 1.0) for k in KINDS)  # achieved fraction of HBM bandwidth
    launch: tuple[tuple[str, float], ...] = ()  # fixed cost per kernel launch, us, per kernel class
    compute: tuple[tuple[str, float], ...] = ()  # achieved fraction of the dense peak FLOPs per class (absent: 1)
    source: str = "roofline: peak figures, no launch cost (uncalibrated)"

    def bw_of(self, kind: str) -> float:
        return dict(self.bw).get(kind, 1.0)

    def launch_of(self, kind: str) -> float:
        return dict(self.launch).get(kind, 0.0)

    def compute_of(self, kind: str) -> float:
        return dict(self.compute).get(kind, 1.0)


@dataclass(frozen=True)
class TermTime:
    name: str
    layers: int
    compute_ms: float
    memory_ms: float
    launch_ms: float
    comm_ms: float
    flops: float
    bytes: float
    comm_bytes: float

    @property
    def work_ms(self) -> float:
        return max(self.compute_ms, self.memory_ms) + self.launch_ms

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ms > self.memory_ms else "memory"


@dataclass(frozen=True)
class ForwardTime:
    terms: tuple[TermTime, ...]

    @property
    def work_ms(self) -> float:
        return sum(t.work_ms for t in self.terms)

    @property
    def comm_ms(self) -> float:
        return sum(t.comm_ms for t in self.terms)

    @property
    def serial_ms(self) -> float:
        return self.work_ms + self.comm_ms

    @property
    def overlap_ms(self) -> float:
        return max(self.work_ms, self.comm_ms)


def comm_us(gpu: GPU, lay: Layout, c, measured: MeasuredComm | None = None) -> float:
    """One collective: the link formula (`GPU.allreduce_us`), or an all-reduce's measured price (`measured`,
    `mtp-plan --collectives`). The all-gather keeps the formula: the files measure the per-rank fp32 logits,
    the model books the gathered tensor."""
    if measured is not None and c.op == "all_reduce" and lay.tp > 1:
        return measured.all_reduce_us(c.nbytes, c.fused)
    if c.op in ("all_reduce", "all_gather"):
        ranks = lay.tp
        nodes = lay.nodes if ranks > gpu.gpus_per_node else 1
        per = gpu.allreduce_us(c.nbytes, ranks, nodes)
        return per / 2 if c.op == "all_gather" else per  # a gather is half a ring all-reduce
    return gpu.alltoall_us(c.nbytes, lay.nodes)


def peak_s(t: Term, gpu: GPU) -> tuple[float, float]:
    """(compute, memory) seconds of one layer of a term at the GPU's peak FLOPs and HBM bandwidth."""
    return (t.flops_fp8 / (gpu.fp8_tflops * 1e12) + t.flops_bf16 / (gpu.bf16_tflops * 1e12),
            t.bytes / (gpu.hbm_gbps * GB))


def time_terms(terms: list[Term], gpu: GPU, lay: Layout, eff: Efficiency = Efficiency(),
               measured: MeasuredComm | None = None) -> ForwardTime:
    out = []
    for t in terms:
        compute, memory = peak_s(t, gpu)
        compute, memory = compute / eff.compute_of(t.kind), memory / eff.bw_of(t.kind)
        comm = sum(comm_us(gpu, lay, c, measured) * c.count for c in t.comm) * 1e-3
        out.append(TermTime(t.name, t.layers, compute * 1e3 * t.layers, memory * 1e3 * t.layers,
                            t.launches * eff.launch_of(t.kind) * 1e-3 * t.layers, comm * t.layers,
                            (t.flops_fp8 + t.flops_bf16) * t.layers, t.bytes * t.layers,
                            sum(c.nbytes * c.count for c in t.comm) * t.layers))
    return ForwardTime(tuple(out))


def accept_len(accept: list[float], k: int) -> float:
    """Mean accepted length of a k-draft chain from conditional acceptance per position: 1 + sum_j prod_{i<=j}
    p_i (the last rate repeats past the list)."""
    al, run = 1.0, 1.0
    for j in range(k):
        run *= accept[min(j, len(accept) - 1)]
        al += run
    return al


@dataclass(frozen=True)
class Workload:
    batch: int = 1  # sequences per attention group (per TP group; per DP rank group with --dp-attention)
    context: int = 1024  # prompt length (prefill) = keys at decode
    k: int = 0  # MTP drafts per step
    al: float = 1.0  # mean accepted length per step (1 + accepted drafts)
    mla_decode: str = "absorbed"
    mla_prefill: str = "naive"
    experts_touched: float | None = None  # routed experts a rank reads per MoE layer in the verify forward
    # (None: the uniform-routing expectation; a measured run's count reproduces that run)

    def __post_init__(self) -> None:
        for name, lo in (("batch", 1), ("context", 1), ("k", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"--{name} must be an integer >= {lo}, got {v!r}")
        if not 1.0 <= self.al <= self.k + 1:
            raise ValueError(f"--al must be in [1, k + 1 = {self.k + 1}], got {self.al}")
        if self.experts_touched is not None and not self.experts_touched > 0:
            raise ValueError(f"--experts-touched must be > 0, got {self.experts_touched}")


@dataclass
class SpeedReport:
    gpu: str
    layout: dict
    workload: dict
    efficiency: str
    prefill: ForwardTime
    verify: ForwardTime
    draft: ForwardTime | None
    gpus: int
    notes: list[str] = field(default_factory=list)

    @property
    def step_ms(self) -> float:
        return self.verify.serial_ms + (self.workload["k"] * self.draft.serial_ms if self.draft else 0.0)

    @property
    def step_overlap_ms(self) -> float:
        return self.verify.overlap_ms + (self.workload["k"] * self.draft.overlap_ms if self.draft else 0.0)

    def summary(self) -> dict:
        al, B = self.workload["al"], self.workload["batch"]
        users = B * (self.layout["ep"] // self.layout["tp"] if self.layout["dp_attention"] else 1)
        out = {"ttft_ms": self.prefill.serial_ms, "ttft_overlap_ms": self.prefill.overlap_ms,
               "step_ms": self.step_ms, "step_overlap_ms": self.step_overlap_ms,
               "tpot_ms": self.step_ms / al, "tpot_overlap_ms": self.step_overlap_ms / al}
        for sfx in ("", "_overlap"):
            out[f"tok_s_user{sfx}"] = 1e3 / out[f"tpot{sfx}_ms"]
            out[f"tok_s_gpu{sfx}"] = out[f"tok_s_user{sfx}"] * users / self.gpus
        return out

    def to_dict(self) -> dict:
        def fwd(f: ForwardTime | None):
            if f is None:
                return None
            return {"serial_ms": f.serial_ms, "overlap_ms": f.overlap_ms, "work_ms": f.work_ms, "comm_ms": f.comm_ms,
                    "terms": [dict(asdict(t), bound=t.bound) for t in f.terms]}
        return {"gpu": self.gpu, "layout": self.layout, "workload": self.workload, "efficiency": self.efficiency,
                "gpus": self.gpus, "summary": self.summary(), "prefill": fwd(self.prefill),
                "verify": fwd(self.verify), "draft": fwd(self.draft), "notes": self.notes}


def predict(cfg: ModelConfig, gpu: GPU, lay: Layout, wl: Workload, eff: Efficiency = Efficiency(),
            measured: MeasuredComm | None = None) -> SpeedReport:
    """Prefill of `batch` prompts of `context` tokens, then one speculative step: the verify forward at width
    k + 1 over `context` keys and k draft forwards (one MTP module each, width 1). `measured`: the decode
    forwards' all-reduces from a measured table instead of the link formula (prefill keeps the formula: the
    tables stop at 8 tokens)."""
    pre = time_terms(forward_terms(cfg, lay, Shape(wl.batch, wl.context, wl.context, "prefill", wl.mla_prefill)),
                     gpu, lay, eff)
    vshape = Shape(wl.batch, wl.k + 1, wl.context + wl.k + 1, "decode", wl.mla_decode, touched=wl.experts_touched)
    vt = forward_terms(cfg, lay, vshape)
    ver = time_terms(vt, gpu, lay, eff, measured)
    drf = None
    if wl.k:
        drf = time_terms(draft_terms(cfg, lay, Shape(wl.batch, 1, wl.context + 1, "decode", wl.mla_decode)),
                         gpu, lay, eff, measured)
    notes = []
    ars = [(c, t.layers) for t in vt for c in t.comm if c.op == "all_reduce"]
    if ars:
        big = max(ars, key=lambda a: a[0].nbytes)[0]
        n = sum(c.count * layers for c, layers in ars)
        ring = gpu.link_gbps if lay.tp <= gpu.gpus_per_node else min(gpu.link_gbps, gpu.net_gbps)
        formula = (f"all-reduce over {gpu.link}: {comm_us(gpu, lay, big):.1f} us for {big.nbytes / 1e3:.1f} KB "
                   f"({lay.tp} ranks; {gpu.link_latency_us:g} us per log2 step + ring bandwidth {ring:g} GB/s), "
                   f"{n} per verify forward")
        if measured is None:
            notes.append(formula)
        else:
            notes.append(measured_note(measured, big, comm_us(gpu, lay, big), ver.comm_ms,
                                       time_terms(vt, gpu, lay, eff).comm_ms))
            notes.append(f"(not used) the table's {formula}")
    if lay.tp > gpu.gpus_per_node:
        notes.append(f"TP{lay.tp} spans {lay.tp // gpu.gpus_per_node} nodes: its all-reduces cross the "
                     f"{gpu.net_gbps:g} GB/s NIC")
    return SpeedReport(gpu.name, asdict(lay), asdict(wl), eff.source, pre, ver, drf, lay.world, notes)


def measured_note(m: MeasuredComm, big, formula_us: float, verify_ms: float, formula_verify_ms: float) -> str:
    """The measured all-reduce beside the link formula's, so a reader sees both."""
    t = m.table
    est = (f"{m.ranks}-GPU estimate" + (f" (ASSUMED growth x{m.growth:g} per doubling, --collective-growth)"
                                       if t.world < m.ranks else ""))
    fused = (f"{m.all_reduce_us(big.nbytes, True):.1f} us at a block boundary (with its add + norm + quant), "
             f"{m.all_reduce_us(big.nbytes):.1f} us plain")
    return (f"all-reduce measured on {t.world} x {t.device} ({t.path}, {t.dtype}), --allreduce {m.allreduce}: "
            f"{est} = {fused} for {big.nbytes / 1e3:.1f} KB (the link formula's: {formula_us:.1f} us); verify "
            f"forward communication {verify_ms:.3f} ms (formula {formula_verify_ms:.3f} ms). {m.describe()}")
