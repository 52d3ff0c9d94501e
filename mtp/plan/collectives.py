"""Measured collective latencies, read once for both projections (`mtp-bench --tp N --collective-json`,
`mtp-plan --speed --collectives`): a table of us per call by message size, per op and implementation, with the
device, GPU count and dtype it was measured on, and the price of one call on the N GPUs a projection is for.

Two files give it:
- `python -m mtp.bench.collectives` ('ops': all_reduce / all_gather rows of {bytes, us, dtype}): NCCL only;
- `python -m mtp.bench.allreduce` ('rows': {variant, w, dtype, bytes, us, status}): all-reduce only, per
  variant: nccl, nccl+norm, torch_oneshot, oneshot, oneshot+norm, oneshot_fused (the one-shot all-reduce fused
  with the residual add + RMSNorm + FP8 quant, what the fast path runs at a block boundary under
  runtime.allreduce=oneshot).
The table keeps one all-reduce dtype (float32 by default: the block all-reduces reduce fp32 partial sums, and a
one-shot fp32 call costs ~2x a bf16 one of the same bytes on 4 x H100, so sizes of two dtypes do not mix).

Pricing (`MeasuredComm`): the measured row with the nearest message size at or above the call's (past the
table: the largest row scaled by bytes). Measured on fewer GPUs than the projection's: x `growth` per doubling,
an ASSUMPTION the label says. A block-boundary all-reduce is priced with the add + norm + quant kernel that
follows it (under oneshot the fused kernel, under nccl the all-reduce + that kernel alone where the file measured
it), less what the projected step already holds for that kernel (`held_us`): the simulated rank of mtp-bench ran
it (the file's measurement of it is subtracted, so nccl is the all-reduce alone there), the speed model books it
as one launch (its calibrated fixed cost, 0 on the roofline). The other all-reduces cost the plain variant; the
all-gather is NCCL's in every case.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

IMPLS = ("nccl", "oneshot")  # --allreduce choices
OPS = ("all_reduce", "all_gather")
# ASSUMED latency growth per doubling of GPUs past those measured (issue 25: 12-13 us on 2 x H200, 17-20 us on 4)
GROWTH = 1.45


def _field(d, key, path: str, where: str = ""):
    try:
        return d[key]
    except (KeyError, TypeError, IndexError):
        raise ValueError(f"{path}: missing field {where}{key!r}") from None


def _number(d, key, path: str, where: str) -> float:
    x = _field(d, key, path, where)
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
        raise ValueError(f"{path}: field {where}{key} = {x!r} must be a positive number")
    return float(x)


@dataclass(frozen=True)
class LatencyTable:
    """us per call by message size (bytes per rank): rows[op][impl] = ((bytes, us), ...) sorted by bytes."""

    path: str
    tool: str  # the writer: mtp.bench.collectives | mtp.bench.allreduce
    device: str
    world: int
    dtype: str  # the all-reduce rows' dtype
    rows: dict = field(default_factory=dict)

    def has(self, op: str, impl: str) -> bool:
        return bool(self.rows.get(op, {}).get(impl))

    def us(self, op: str, impl: str, nbytes: float) -> float:
        """The row with the nearest size at or above `nbytes`; past the largest, that row scaled by bytes."""
        rows = self.rows.get(op, {}).get(impl)
        if not rows:
            raise ValueError(f"{self.path}: no {op} rows of {impl!r} ({self.dtype}); the file has "
                             f"{', '.join(f'{o}/{i}' for o, by in self.rows.items() for i in by)}")
        for b, us in rows:
            if b >= nbytes:
                return us
        b, us = rows[-1]
        return us * nbytes / b

    def describe(self) -> str:
        return f"{self.world} x {self.device} ({self.path}, {self.tool}, {self.dtype} all-reduces)"

    def to_dict(self) -> dict:
        return {"path": self.path, "tool": self.tool, "device": self.device, "world": self.world,
                "dtype": self.dtype, "rows": {op: {i: [list(r) for r in rs] for i, rs in by.items()}
                                              for op, by in self.rows.items()}}


def read_json_object(path: str | Path, label: str) -> dict:
    """A JSON file holding one object (the bench tools' results); errors start with `label` (the file, with the
    option that named it where there is one)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{label}: cannot read a JSON file ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{label}: expected a JSON object, got {type(d).__name__}")
    return d


def read(path: str | Path, dtype: str = "float32") -> LatencyTable:
    """Either JSON format -> one table. Errors name the file and the field."""
    path = str(path)
    d = read_json_object(path, path)
    if "ops" in d:
        tool, rows = "mtp.bench.collectives", _ops_rows(d, path, dtype)
    elif "rows" in d:
        tool, rows = "mtp.bench.allreduce", _allreduce_rows(d, path, dtype)
    else:
        raise ValueError(f"{path}: missing field 'ops' (mtp.bench.collectives) or 'rows' (mtp.bench.allreduce)")
    world = _field(d, "world", path)
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"{path}: field 'world' = {world!r} must be an integer >= 2 (GPUs measured on)")
    device = _field(d, "device", path)
    if not isinstance(device, str) or not device:
        raise ValueError(f"{path}: field 'device' = {device!r} must name the GPU")
    if not rows.get("all_reduce"):
        raise ValueError(f"{path}: no all_reduce row of dtype {dtype!r}")
    return LatencyTable(path, tool, device, world, dtype,
                        {op: {i: tuple(sorted(rs)) for i, rs in by.items()} for op, by in rows.items()})


def _ops_rows(d: dict, path: str, dtype: str) -> dict:
    ops = _field(d, "ops", path)
    if not isinstance(ops, dict):
        raise ValueError(f"{path}: field 'ops' must be an object of op -> rows, got {type(ops).__name__}")
    out: dict = {}
    for op in OPS:
        rows = ops.get(op, [])
        if not isinstance(rows, list):
            raise ValueError(f"{path}: field 'ops.{op}' must be a list, got {type(rows).__name__}")
        for j, r in enumerate(rows):
            where = f"ops.{op}[{j}]."
            # the all-gather's rows (fp32 logits, bf16 eh_proj slices) go by bytes: only the all-reduce's carry the
            # dtype choice
            if op == "all_reduce" and isinstance(r, dict) and r.get("dtype", dtype) != dtype:
                continue
            out.setdefault(op, {}).setdefault("nccl", []).append((int(_number(r, "bytes", path, where)),
                                                                  _number(r, "us", path, where)))
    return out


def _allreduce_rows(d: dict, path: str, dtype: str) -> dict:
    rows = _field(d, "rows", path)
    if not isinstance(rows, list):
        raise ValueError(f"{path}: field 'rows' must be a list, got {type(rows).__name__}")
    out: dict = {}
    for j, r in enumerate(rows):
        where = f"rows[{j}]."
        if _field(r, "status", path, where) != "ok":  # a variant that failed is recorded with its error
            continue
        if _field(r, "dtype", path, where) != dtype:
            continue
        out.setdefault("all_reduce", {}).setdefault(_field(r, "variant", path, where), []).append(
            (int(_number(r, "bytes", path, where)), _number(r, "us", path, where)))
    return out


def growth_scale(world: int, ranks: int, growth: float) -> float:
    """x growth per doubling of GPUs from `world` measured to `ranks` projected (1 at or below the measured)."""
    return growth ** math.log2(ranks / world) if world < ranks else 1.0


@dataclass(frozen=True)
class MeasuredComm:
    """The price of one collective on `ranks` GPUs from a measured table. held_us: per block-boundary all-reduce,
    the add + norm + quant kernel's cost that the projected step already holds (None: the table's own measurement
    of it, nccl+norm - nccl at that size, 0 where the file lacks those rows)."""

    table: LatencyTable
    ranks: int
    allreduce: str = "nccl"
    growth: float = GROWTH
    held_us: float | None = None

    def __post_init__(self) -> None:
        if self.allreduce not in IMPLS:
            raise ValueError(f"--allreduce must be one of {IMPLS}, got {self.allreduce!r}")
        if not self.growth >= 1:
            raise ValueError(f"--collective-growth must be >= 1, got {self.growth}")
        need = ("oneshot", "oneshot_fused") if self.allreduce == "oneshot" else ("nccl",)
        for impl in need:
            if not self.table.has("all_reduce", impl):
                raise ValueError(f"--allreduce {self.allreduce}: {self.table.path} has no all_reduce rows of "
                                 f"{impl!r} ({self.table.tool} measures "
                                 f"{', '.join(self.table.rows['all_reduce'])})")

    @property
    def scale(self) -> float:
        return growth_scale(self.table.world, self.ranks, self.growth)

    def norm_us(self, nbytes: float) -> float | None:
        """The add + norm + quant kernel alone as the file measured it (nccl+norm - nccl; None: not measured)."""
        t = self.table
        if not (t.has("all_reduce", "nccl+norm") and t.has("all_reduce", "nccl")):
            return None
        return max(t.us("all_reduce", "nccl+norm", nbytes) - t.us("all_reduce", "nccl", nbytes), 0.0)

    def all_reduce_us(self, nbytes: float, fused: bool = False) -> float:
        """One all-reduce; `fused`: a block boundary, priced with the add + norm + quant that follows it, less
        what the step already holds for that kernel (`held_us`): under nccl the all-reduce x scale + the measured
        norm kernel - held (= the all-reduce alone where held is the measured kernel, mtp-bench), under oneshot the
        fused kernel x scale - held. The norm kernel is local: the growth assumption scales the collective only."""
        impl = "nccl" if self.allreduce == "nccl" else ("oneshot_fused" if fused else "oneshot")
        us = self.table.us("all_reduce", impl, nbytes) * self.scale
        if not fused:
            return us
        norm = self.norm_us(nbytes)
        held = self.held_us if self.held_us is not None else (norm or 0.0)
        if self.allreduce == "nccl":
            return us if norm is None else max(us + norm - held, 0.0)
        return max(us - held, 0.0)

    def all_gather_us(self, nbytes: float) -> float | None:
        """NCCL's all-gather (the fast path has no one-shot gather); None where the file measured none."""
        return self.table.us("all_gather", "nccl", nbytes) * self.scale if self.table.has("all_gather", "nccl") \
            else None

    def describe(self) -> str:
        t = self.table
        out = f"measured on {t.describe()}"
        if t.world != self.ranks:
            out += f"; measured on {t.world} GPUs, not the {self.ranks} of this TP"
        if t.world < self.ranks:
            out += (f"; {self.ranks}-GPU ESTIMATE = measured x {self.scale:.2f} (ASSUMED x{self.growth:g} per "
                    f"doubling of GPUs, --collective-growth)")
        held = ("the add + norm + quant kernel the step already holds (nccl+norm - nccl, measured)"
                if self.held_us is None else f"{self.held_us:.2f} us (the model's charge for that launch)")
        if self.allreduce == "oneshot":
            out += f"; all-reduce: block boundaries oneshot_fused x scale less {held}, the rest plain oneshot"
        elif self.table.has("all_reduce", "nccl+norm") and self.held_us is not None:
            out += f"; all-reduce: nccl, block boundaries + the measured add + norm + quant kernel less {held}"
        else:
            out += "; all-reduce: nccl"
        gather = "NCCL, measured" if t.has("all_gather", "nccl") else "NCCL, not in this file"
        return out + f"; all-gather: {gather}"

    def to_dict(self) -> dict:
        return {"table": self.table.to_dict(), "ranks": self.ranks, "allreduce": self.allreduce,
                "growth": self.growth, "scale": self.scale, "held_us": self.held_us, "source": self.describe()}
