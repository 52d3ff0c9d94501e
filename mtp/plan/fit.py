"""Bounded non-linear least squares for the speed model's efficiencies, and what the data can and cannot tell.

Why not a linear solve: a term costs max(compute, memory) + launches x fixed cost, so the prediction is piecewise
linear in the inverse efficiencies; a term crosses from memory- to compute-bound as batch x width grows, which is
the point of fitting the batch axis. scipy is not in the project's environment, so the solver is torch's L-BFGS
(strong Wolfe line search, float64) on an unconstrained variable z with value = lo + (hi - lo) * sigmoid(z), or
for an efficiency (`Param.inverse`) 1 / value running between 1 / hi and 1 / lo (times are linear in inverse
efficiencies, so the search moves along the model's own axes): every iterate respects the bounds, and a parameter the data push past a bound ends pinned at it (reported as such, not
as a fitted number). Several deterministic starts; the best is kept. A hard max has no gradient on its losing
side (a compute fraction that starts where no term is compute-bound would never move), so each start runs twice:
hard max alone, and a continuation (the max smoothed by `smooth_max` at sharpness 8, then 32, then hard).

Separability: at the solution, J = d(relative residual) / d(ln parameter) over the parameters not at a bound
gives the covariance s^2 (J^T J)^-1 (s^2 = residual sum of squares / degrees of freedom). A parameter whose
one-sigma relative error exceeds `UNRESOLVED` is reported as not separable, with the parameter it trades off
against (largest |correlation|); one no row is sensitive to is reported as not exercised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

UNRESOLVED = 0.5  # one-sigma relative error above which a parameter's value is not reported


@dataclass(frozen=True)
class Param:
    name: str
    unit: str
    lo: float
    hi: float
    why: str  # why these bounds (printed with the fit)
    inverse: bool = False  # searched in 1 / value (an efficiency: time is linear in its inverse)

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi or (self.inverse and self.lo == 0):
            raise ValueError(f"Param {self.name}: bounds must satisfy 0 <= lo < hi (lo > 0 if inverse), got "
                             f"[{self.lo}, {self.hi}]")


@dataclass
class FitResult:
    params: tuple[Param, ...]
    values: dict[str, float]
    residuals: list[float]  # predicted / measured - 1 per fitted row
    bound: dict[str, str] = field(default_factory=dict)  # name -> 'lower' | 'upper' for pinned parameters
    rel_sigma: dict[str, float] = field(default_factory=dict)  # one-sigma relative error of free parameters
    unresolved: dict[str, str] = field(default_factory=dict)  # name -> why the data do not determine it

    def determined(self, name: str) -> bool:
        return name not in self.bound and name not in self.unresolved

    def describe(self, name: str) -> str:
        """The value with its unit and uncertainty, or why there is none."""
        p = next(p for p in self.params if p.name == name)
        v = self.values[name]
        if name in self.bound:
            return f"at its {self.bound[name]} bound {v:.3g} {p.unit} (the data push it past [{p.lo:g}, {p.hi:g}])"
        if name in self.unresolved:
            return f"not separable ({self.unresolved[name]})"
        return f"{v:.3g} {p.unit} +/- {self.rel_sigma[name] * 100:.0f}%"


def smooth_max(a: torch.Tensor, b: torch.Tensor, sharpness: float | None) -> torch.Tensor:
    """max(a, b) of positive times; with a sharpness p, the p-norm (a^p + b^p)^(1/p) (computed in log space),
    which is >= the max by at most 2^(1/p) and has a gradient on both sides."""
    if sharpness is None:
        return torch.maximum(a, b)
    la, lb = a.clamp_min(1e-30).log(), b.clamp_min(1e-30).log()
    return (torch.logsumexp(torch.stack([la, lb]) * sharpness, dim=0) / sharpness).exp()


SCHEDULES = ((None,), (8.0, 32.0, None))


def _value(z: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    ilo, ihi = 1 / hi, 1 / torch.where(inv, lo, hi)  # (the second is unused where not inverse)
    return torch.where(inv, 1 / (ihi + (ilo - ihi) * s), lo + (hi - lo) * s)


def fit_bounded(model: Callable[..., torch.Tensor], measured: torch.Tensor, params: list[Param],
                starts: tuple[float, ...] = (0.5, 0.9, 0.1), iters: int = 400) -> FitResult:
    """Minimise sum((model(x) / measured - 1)^2) over lo <= x <= hi. `model(x, sharpness)` maps the parameter
    vector (in the order of `params`) to one prediction per row, in the units of `measured`, with its maxima
    taken by `smooth_max(..., sharpness)`. `starts`: each start puts every parameter at that fraction of its
    range."""
    if measured.ndim != 1 or not bool((measured > 0).all()):
        raise ValueError(f"fit_bounded: measured must be a 1-D tensor of positive times, got {measured.tolist()}")
    lo = torch.tensor([p.lo for p in params], dtype=torch.float64)
    hi = torch.tensor([p.hi for p in params], dtype=torch.float64)
    inv = torch.tensor([p.inverse for p in params])
    meas = measured.to(torch.float64)

    def loss_of(z: torch.Tensor, sharp: float | None = None) -> torch.Tensor:
        return ((model(_value(z, lo, hi, inv), sharp) / meas - 1) ** 2).sum()

    best_z, best = None, math.inf
    for s, schedule in ((s, sch) for s in starts for sch in SCHEDULES):
        z = torch.full((len(params),), math.log(s / (1 - s)), dtype=torch.float64, requires_grad=True)
        for sharp in schedule:
            opt = torch.optim.LBFGS([z], lr=1, max_iter=iters, tolerance_grad=1e-12, tolerance_change=1e-15,
                                    history_size=50, line_search_fn="strong_wolfe")

            def closure():
                opt.zero_grad()
                loss = loss_of(z, sharp)
                loss.backward()
                return loss
            opt.step(closure)
        loss = float(loss_of(z.detach()))
        if loss < best:
            best, best_z = loss, z.detach().clone()
    x = _value(best_z, lo, hi, inv)
    res = model(x, None) / meas - 1
    out = FitResult(tuple(params), {p.name: float(v) for p, v in zip(params, x)}, res.tolist())
    span = (hi - lo)
    for i, p in enumerate(params):
        if float(x[i] - lo[i]) < 1e-3 * float(span[i]):
            out.bound[p.name] = "lower"
        elif float(hi[i] - x[i]) < 1e-3 * float(span[i]):
            out.bound[p.name] = "upper"
    _separability(model, meas, x, params, out)
    return out


def _separability(model, meas: torch.Tensor, x: torch.Tensor, params: list[Param], out: FitResult) -> None:
    J = torch.autograd.functional.jacobian(lambda v: model(v, None) / meas - 1, x)
    for i, p in enumerate(params):  # a parameter no row depends on is unexercised (pinned or not)
        if float(J[:, i].norm()) == 0.0:
            out.bound.pop(p.name, None)
            out.unresolved[p.name] = "no fitted row is sensitive to it"
    free = [i for i, p in enumerate(params) if p.name not in out.bound and p.name not in out.unresolved]
    if not free:
        return
    # d residual / d ln x_i = x_i * d residual / d x_i (free parameters sit above their lower bound >= 0)
    J = (J * x)[:, free]
    n, k = J.shape
    res = torch.tensor(out.residuals, dtype=torch.float64)
    s2 = float((res ** 2).sum()) / max(n - k, 1)
    s2 = max(s2, 1e-6)  # an exact fit (synthetic rows) still leaves rounding: judge separability at 0.1% noise
    JtJ = J.T @ J
    cov = s2 * torch.linalg.pinv(JtJ, rtol=1e-12)
    sig = cov.diag().clamp(min=0).sqrt()
    d = sig.clamp(min=1e-30)
    corr = cov / (d[:, None] * d[None, :])
    for a, i in enumerate(free):
        name = params[i].name
        rel = float(sig[a])
        out.rel_sigma[name] = rel
        if rel > UNRESOLVED:
            others = [(abs(float(corr[a, b])), params[free[b]].name) for b in range(k) if b != a]
            partner = max(others, default=(0.0, ""))
            out.unresolved[name] = f"one sigma {rel * 100:.0f}% of its value" + \
                (f"; trades off with {partner[1]} (correlation {partner[0]:.2f})" if partner[1] else "")
