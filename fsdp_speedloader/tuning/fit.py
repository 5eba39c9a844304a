"""The tuner's memory model: lines fitted to the trial steps' measured peaks (GPU), and the host line whose
slope is known exactly (the activation slots' bytes per token). ``tuner.py`` says what is measured and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fsdp_speedloader.tuning.trial import Measurement

GIB = float(1 << 30)
LEAST_SQUARES = "least squares"


@dataclass(frozen=True)
class LinearFit:
    """``y = sum(coef[k] * feature[k])``; feature '1' is the intercept. ``method``: how the coefficients
    were found (least squares, or ``fit_host``'s known slope); ``r2``: of the measured points either way."""

    features: tuple[str, ...]
    coef: tuple[float, ...]
    r2: float
    num_points: int
    method: str = LEAST_SQUARES

    @property
    def exact(self) -> bool:
        """A least-squares line through as many points as coefficients: it meets every point, R^2 = 1 says nothing."""
        return self.method == LEAST_SQUARES and self.num_points <= len(self.features)

    def predict(self, values: dict[str, float]) -> float:
        return float(sum(c * (1.0 if f == "1" else values[f]) for f, c in zip(self.features, self.coef)))

    def describe(self, unit: float = GIB, unit_name: str = "GiB") -> str:
        terms = " + ".join(f"{c / unit:.4g} {unit_name}" + ("" if f == "1" else f" x {f}")
                           for f, c in zip(self.features, self.coef))
        quality = (f"R^2 = 1 by construction ({self.num_points} points, {len(self.features)} coefficients)"
                   if self.exact else f"R^2 = {self.r2:.6f} over {self.num_points} points")
        return f"{terms}  [{quality}{'' if self.method == LEAST_SQUARES else '; ' + self.method}]"


def r_squared(y: Sequence[float], predicted: Sequence[float]) -> float:
    y, predicted = np.asarray(y, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - predicted) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0


def fit_linear(rows: Sequence[dict[str, float]], y: Sequence[float], features: Sequence[str]) -> LinearFit:
    """Least-squares fit of ``y`` on ``features`` (each row maps a feature name to its value)."""
    X = np.array([[1.0 if f == "1" else float(r[f]) for f in features] for r in rows], dtype=np.float64)
    Y = np.asarray(y, dtype=np.float64)
    if len(rows) < len(features) or np.linalg.matrix_rank(X) < len(features):
        raise ValueError(f"cannot fit {' + '.join(features)} from {len(rows)} trial(s) at "
                         f"{[dict(r) for r in rows]}: the trials must differ in every tuned setting "
                         "(two different trial_sub_batch_sizes, and two blocks_per_unit values when tuning it)")
    coef, *_ = np.linalg.lstsq(X, Y, rcond=None)
    return LinearFit(tuple(features), tuple(float(c) for c in coef), r_squared(Y, X @ coef), len(rows))


HOST_METHOD = "slope: activation slot bytes per token, exact; intercept: the largest measured constant"


def fit_host(measurements: Sequence[Measurement]) -> LinearFit:
    """Host bytes on activation_tokens, without fitting: only the activation slots grow with the tokens,
    and their bytes are known (h x element size per token, with the store's rounding: ``slot_host_bytes``).
    Everything else -- model states, parameter and gradient shards, page-locked blocks of PyTorch's
    caching host allocator -- does not depend on n or N, but the trials see it at different levels (that
    allocator keeps what earlier steps freed; docs/tuner.md). A line through two trials turns
    that growth into a slope and stops N far too early, so the constant is the largest measured, not
    extrapolated. Predictions use ``TunePlan.predict_host_bytes`` (the slope is exact up to the rounding)."""
    assert len({(m.activation_storage, m.activation_bytes_per_token) for m in measurements}) == 1, \
        "the trials of one tune() share their activation store"
    m0 = measurements[0]
    per_token = 0 if m0.activations_on_device else m0.activation_bytes_per_token
    constant = max(m.host_bytes - m.host_activation_bytes for m in measurements)
    r2 = r_squared([m.host_bytes for m in measurements], [constant + m.host_activation_bytes for m in measurements])
    return LinearFit(("1", "activation_tokens"), (float(constant), float(per_token)), r2, len(measurements),
                     HOST_METHOD)


def gpu_values(n: int, b: int) -> dict[str, float]:
    return {"n": n, "b": b, "n*b": n * b}
