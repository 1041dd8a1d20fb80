r"""Centered clipping around the server's history, over random buckets (pure numpy).

Karimireddy, He and Jaggi 2021 ("Learning from History for Byzantine Robust
Optimization"): clip every update's distance to a centre :math:`v` that carries the past
aggregates, then average,

.. math::  v' = v + \sum_b W_b\, \mathrm{clip}_\tau(x_b - v), \qquad
           \mathrm{clip}_\tau(z) = z \min(1, \tau / \lVert z \rVert)

so a site can move the round's aggregate by at most its weight times :math:`\tau`,
whichever direction it points. Karimireddy, He and Jaggi 2022 ("Byzantine-Robust
Learning on Heterogeneous Datasets via Bucketing"): first average random buckets of
:math:`s` updates (:func:`bucket_means`), which shrinks the honest spread that Non-IID
sites add and leaves an attacker's deviation diluted by its bucket-mates.

The radius is relative, :math:`\tau = \kappa \cdot \mathrm{median}_b \lVert x_b - v \rVert`
(a fixed :math:`\tau` cannot follow a learning rate that decays over the run): the
median is set by honest buckets as long as fewer than half of the buckets hold an
attacker. The centre is an exponential moving average of the aggregates,
:math:`c_t = \beta c_{t-1} + (1-\beta) a_t`, :math:`c_0 = 0`: the server momentum in the
scale of one round's update. No rule here rejects a site, so there is no exclusion to lift.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["CenteredClipping", "bucket_means", "centered_clip"]


def bucket_means(
    points: np.ndarray, weights: np.ndarray, size: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    r"""Random buckets of ``size`` points: ``(means [B, D], bucket weights [B])``.

    A random permutation cut into :math:`B = \lceil n / s \rceil` buckets (the last may be
    smaller); bucket :math:`b` gets :math:`W_b = \sum_{i \in b} w_i` and the weighted mean
    :math:`\sum_{i \in b} w_i x_i / W_b` (the plain mean where :math:`W_b = 0`), so
    :math:`\sum_b W_b \bar x_b = \sum_i w_i x_i`: bucketing alone changes nothing."""
    points, weights = _check(points, weights)
    if not (isinstance(size, (int, np.integer)) and not isinstance(size, bool) and size >= 1):
        raise ValueError(f"Invalid bucket size: {size!r}")
    order = rng.permutation(len(points))
    means, totals = [], []
    for start in range(0, len(order), int(size)):
        members = order[start : start + int(size)]
        w = weights[members]
        total = float(w.sum())
        means.append(np.average(points[members], axis=0, weights=w) if total > 0 else points[members].mean(axis=0))
        totals.append(total)
    return np.stack(means), np.asarray(totals)


def centered_clip(
    points: np.ndarray, weights: np.ndarray, center: np.ndarray, radius: float, iterations: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    r"""``(aggregate, clipped points)``: ``iterations`` steps of
    :math:`v \leftarrow v + \sum_i \hat w_i\, \mathrm{clip}_\tau(x_i - v)` from
    :math:`v = ` ``center``, with :math:`\hat w = w / \sum w` and :math:`\tau` = ``radius``.

    The clipped points are :math:`v + \mathrm{clip}_\tau(x_i - v)` at the last step, so their
    :math:`\hat w`-weighted mean is the aggregate (what lets a caller feed them to any
    weighted rule downstream). ``radius = inf`` returns the weighted mean and the points."""
    points, weights = _check(points, weights)
    center = np.asarray(center, dtype=np.float64)
    if center.shape != points.shape[1:]:
        raise ValueError(f"Invalid center shape {center.shape}: points are {points.shape[1:]}")
    if not (radius >= 0 and not np.isnan(radius)):
        raise ValueError(f"Invalid radius: {radius!r}")
    if not (isinstance(iterations, (int, np.integer)) and iterations >= 1):
        raise ValueError(f"Invalid iterations: {iterations!r}")
    if weights.sum() <= 0:
        raise ValueError("Invalid weights: they sum to 0")
    share = weights / weights.sum()
    v = center
    for _ in range(int(iterations)):
        offsets = points - v
        lengths = np.linalg.norm(offsets.reshape(len(points), -1), axis=1)
        factors = np.ones_like(lengths) if np.isinf(radius) else np.minimum(
            1.0, radius / np.maximum(lengths, np.finfo(np.float64).tiny))
        clipped = v + offsets * factors.reshape((-1,) + (1,) * (points.ndim - 1))
        v = np.tensordot(share, clipped, axes=1)
    return v, clipped


class CenteredClipping:
    r"""Bucketing, then centered clipping around the server's history, as a transform of
    a round's site deltas (:meth:`transform`) that any weighted rule can aggregate.

    Per round, with deltas :math:`d_i` (flattened over every array) and weights
    :math:`w_i`: buckets of ``bucket_size`` (:func:`bucket_means`, a generator seeded by
    ``(seed, round)``), :math:`\tau = \kappa\,\mathrm{median}_b \lVert \bar d_b - c\rVert`
    (``radius`` = :math:`\kappa`), the clipped bucket means of :func:`centered_clip` around
    the centre :math:`c`, returned with the bucket weights :math:`W_b`; then
    :math:`c \leftarrow \beta c + (1-\beta) a` with :math:`a = \sum_b \hat W_b \tilde d_b`.
    An array whose shape changed (a grown classifier head) restarts its centre at 0.
    The centre is the only state: :meth:`state_dict` / :meth:`load_state_dict`."""

    def __init__(self, radius: float = 2.0, bucket_size: int = 2, beta: float = 0.9, iterations: int = 1,
                 seed: int = 0) -> None:
        if not (isinstance(radius, (int, float)) and not isinstance(radius, bool) and np.isfinite(radius)
                and radius > 0):
            raise ValueError(f"Invalid radius value: {radius!r}")
        if not (isinstance(bucket_size, int) and not isinstance(bucket_size, bool) and bucket_size >= 1):
            raise ValueError(f"Invalid bucket_size value: {bucket_size!r}")
        if not (isinstance(beta, (int, float)) and 0.0 <= beta < 1.0):
            raise ValueError(f"Invalid beta value: {beta!r}")
        if not (isinstance(iterations, int) and iterations >= 1):
            raise ValueError(f"Invalid iterations value: {iterations!r}")
        self.radius = float(radius)
        self.bucket_size = bucket_size
        self.beta = float(beta)
        self.iterations = iterations
        self.seed = int(seed)
        self._center: dict[str, np.ndarray] = {}
        self.last_clipped_share = 0.0  # buckets clipped in the last round / buckets

    def transform(
        self, deltas: Sequence[Mapping[str, np.ndarray]], weights: np.ndarray, server_round: int
    ) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
        """``(clipped bucket deltas, bucket weights)``; their weighted mean is the robust aggregate."""
        if not deltas:
            raise ValueError("no deltas")
        names = list(deltas[0])
        shapes = {n: np.shape(deltas[0][n]) for n in names}
        for n in names:
            if n not in self._center or self._center[n].shape != shapes[n]:
                self._center[n] = np.zeros(shapes[n])
        flat = np.stack([np.concatenate([np.asarray(d[n], dtype=np.float64).ravel() for n in names]) for d in deltas])
        center = np.concatenate([self._center[n].ravel() for n in names])
        rng = np.random.default_rng((self.seed, int(server_round)))
        means, totals = bucket_means(flat, np.asarray(weights, dtype=np.float64), self.bucket_size, rng)
        distances = np.linalg.norm(means - center, axis=1)
        tau = self.radius * float(np.median(distances))
        aggregate, clipped = centered_clip(means, totals, center, tau if tau > 0 else np.inf, self.iterations)
        self.last_clipped_share = float(np.mean(distances > tau)) if tau > 0 else 0.0
        new_center = self.beta * center + (1.0 - self.beta) * aggregate
        out = [_split(row, names, shapes) for row in clipped]
        self._center = _split(new_center, names, shapes)
        return out, totals / totals.sum() if totals.sum() > 0 else totals

    def state_dict(self) -> dict:
        return {"center": {n: v.copy() for n, v in self._center.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        center = state.get("center") if isinstance(state, Mapping) else None
        if not isinstance(center, Mapping) or not all(
            isinstance(v, np.ndarray) and np.all(np.isfinite(v)) for v in center.values()
        ):
            raise ValueError("Invalid centered-clipping state: expected {'center': {name: finite ndarray}}")
        self._center = {str(n): np.asarray(v, dtype=np.float64).copy() for n, v in center.items()}


def _split(row: np.ndarray, names: list[str], shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    out, start = {}, 0
    for n in names:
        size = int(np.prod(shapes[n], dtype=np.int64))
        out[n] = row[start : start + size].reshape(shapes[n])
        start += size
    return out


def _check(points, weights) -> tuple[np.ndarray, np.ndarray]:
    points = np.asarray(points, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    if points.ndim < 1 or len(points) == 0:
        raise ValueError("Invalid points: need at least one")
    if weights.shape != (len(points),) or np.any(weights < 0) or not np.all(np.isfinite(weights)):
        raise ValueError(f"Invalid weights: one non-negative finite weight per point, got shape {weights.shape}")
    if not np.all(np.isfinite(points)):
        raise ValueError("Invalid points: NaN/Inf")
    return points, weights
