r"""Which coordinates a site sends, and how their values are quantised (pure numpy).

Top-k: the ``k`` coordinates of largest magnitude of an update taken as one vector, found
exactly (:func:`topk_indices`) or from a sampled threshold (:func:`sampled_topk_indices`),
with a sparsity warm-up over the first rounds (:func:`warmup_ratio`). What goes on the
wire for one array is a :class:`SparseTensor`: its indices, quantised codes and a scale.

Quantisation (per tensor, over the values sent in that tensor)
--------------------------------------------------------------
- ``int8``: ``scale = max|v|``, ``q = round(v / scale * 127)`` in ``[-127, 127]``,
  ``v^ = q * float32(scale / 127)``. Per-coordinate error
  ``|v - v^| <= scale / 254 + scale * 2**-22`` (half a step, plus float32 rounding).
- ``int4``: as ``int8`` with 7 levels: ``q`` in ``[-7, 7]``, error ``<= scale / 14`` (plus
  float32 rounding). Half the bytes of ``int8`` per value; error feedback carries the rest.
- ``sign``: ``scale = mean|v|``, ``v^ = sign(v) * scale`` (1 bit per value). Error
  ``|v - v^| = ||v| - scale| <= max|v| - min|v|``; biased per coordinate, which error
  feedback corrects over the following rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import TOPK_ALLOCATIONS

__all__ = [
    "ALLOCATIONS",
    "LEVELS",
    "MODES",
    "THRESHOLDS",
    "SparseTensor",
    "allocated_topk",
    "budget",
    "dequantise",
    "quantise",
    "sampled_topk_indices",
    "topk_indices",
    "warmup_ratio",
]

MODES = ("int8", "int4", "sign")
THRESHOLDS = ("exact", "sampled")
ALLOCATIONS = TOPK_ALLOCATIONS  # how a site's budget is shared between its arrays: allocated_topk
LEVELS = {"int8": 127, "int4": 7}  # linear modes: codes in [-levels, levels]
U32_MAX = 2**32 - 1

# "sampled" threshold: sample enough coordinates that ~SAMPLE_HITS of them lie above the
# true k-th magnitude, and aim the threshold OVERSAMPLE times lower so it lets >= k through.
SAMPLE_MIN = 1024
SAMPLE_HITS = 100
OVERSAMPLE = 1.5


# --------------------------------------------------------------------------- quantisation


def quantise(values: np.ndarray, mode: str) -> tuple[np.ndarray, float]:
    """``(codes int8, scale)`` of the 1-D float ``values`` (non-zero, finite) for ``mode``.

    ``int8``: ``scale = max|v|`` (float32), ``codes = round(v / scale * 127)``.
    ``int4``: the same with 7 levels, ``codes`` in ``[-7, 7]``.
    ``sign``: ``scale = float32(mean|v|)``, ``codes = sign(v)`` in ``{-1, +1}``.
    An empty ``values`` gives ``(empty, 0.0)``. See the module docstring for error bounds.
    """
    if mode not in MODES:
        raise ValueError(f"Invalid mode: {mode!r} (expected one of {MODES})")
    v = np.asarray(values, dtype=np.float32).ravel()
    if v.size == 0:
        return np.zeros(0, dtype=np.int8), 0.0
    mag = np.abs(v)
    if mode in LEVELS:
        levels = LEVELS[mode]
        scale = np.float32(mag.max())
        if not scale > 0:
            raise ValueError("Invalid values: all zero (zeros are never sent)")
        q = np.rint(v.astype(np.float64) * (levels / np.float64(scale)))
        codes = np.clip(q, -levels, levels).astype(np.int8)
    else:
        # mean of non-zero float32 magnitudes >= their minimum > 0, so scale > 0
        scale = np.float32(mag.astype(np.float64).mean())
        if not scale > 0:
            raise ValueError("Invalid values: all zero (zeros are never sent)")
        codes = np.where(v < 0, -1, 1).astype(np.int8)
    return codes, float(scale)


def dequantise(codes: np.ndarray, scale: float, mode: str) -> np.ndarray:
    """float32 values of ``codes``: ``codes * float32(scale / 127)`` (int8) or
    ``codes * scale`` (sign). The site and the server both call this, so they agree bit
    for bit on what was sent."""
    codes = np.asarray(codes, dtype=np.int8)
    if mode in LEVELS:
        step = np.float32(np.float64(np.float32(scale)) / LEVELS[mode])
        return codes.astype(np.float32) * step
    if mode == "sign":
        return codes.astype(np.float32) * np.float32(scale)
    raise ValueError(f"Invalid mode: {mode!r} (expected one of {MODES})")


# --------------------------------------------------------------------------- top-k


def topk_indices(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """Sorted flat indices of the ``k`` largest ``magnitudes`` (>= 0), zeros left out.

    ``np.argpartition``, O(N). Ties at the k-th value are broken by argpartition
    (deterministic for a given input).
    """
    mag = np.asarray(magnitudes).ravel()
    if k < 0:
        raise ValueError(f"Invalid k: {k}")
    if k >= mag.size:
        return np.flatnonzero(mag > 0)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.argpartition(mag, mag.size - k)[mag.size - k :]
    idx = idx[mag[idx] > 0]
    idx.sort()
    return idx.astype(np.int64, copy=False)


def sampled_topk_indices(
    magnitudes: np.ndarray, k: int, rng: np.random.Generator, sample_size: int | None = None
) -> np.ndarray:
    """Approximate :func:`topk_indices` from a random sample (DGC-style threshold).

    1. Draw ``s = max(SAMPLE_MIN, ceil(SAMPLE_HITS * N / k))`` magnitudes with replacement
       (or ``sample_size``); if ``s >= N`` sampling saves nothing and the exact top-k is
       returned.
    2. The threshold ``t`` is the ``h``-th largest sampled magnitude with
       ``h = ceil(OVERSAMPLE * k * s / N)``: an estimate of the ``1.5 k``-th largest
       magnitude of the whole vector.
    3. Candidates are all coordinates with ``|u| >= t`` (one vectorised comparison); if
       there are more than ``k`` — the usual case — the exact top-k of the candidates is
       kept (argpartition over ~1.5k values instead of N).

    So the count is never more than ``k``. It is less only when fewer than ``k``
    coordinates pass ``t``: the share of coordinates above the ``h``-th sample order
    statistic has relative standard deviation ``~ 1/sqrt(h)`` (``h >= 150`` by default,
    ~8 %), and falling short needs an undershoot of 1/3, about four standard deviations
    (probability ~1e-4). Even then the count stays near ``k`` (``>= k / 2`` needs another
    ~4 sigma). Zeros are never sent, as in the exact version.
    """
    mag = np.asarray(magnitudes).ravel()
    n = mag.size
    if k <= 0 or k >= n:
        return topk_indices(mag, k)
    s = sample_size if sample_size is not None else max(SAMPLE_MIN, math.ceil(SAMPLE_HITS * n / k))
    if s < 1:
        raise ValueError(f"Invalid sample_size: {sample_size}")
    if s >= n:
        return topk_indices(mag, k)
    sample = mag[rng.integers(0, n, size=s)]
    h = min(s, math.ceil(OVERSAMPLE * k * s / n))
    threshold = np.partition(sample, s - h)[s - h]
    if threshold > 0:
        cand = np.flatnonzero(mag >= threshold)
    else:
        cand = np.flatnonzero(mag > 0)
    if cand.size > k:
        cand = cand[np.argpartition(mag[cand], cand.size - k)[cand.size - k :]]
        cand.sort()
    return cand.astype(np.int64, copy=False)


def budget(ratio: float, total: int) -> int:
    """Values a top-k update of ``total`` coordinates may carry at density ``ratio``:
    ``round(ratio * total)``, at least 1 and at most ``total``. The sites select this many
    (:class:`~fedind.topk.feedback.ErrorFeedback`) and the server refuses a reply that
    changes more coordinates (:class:`~fedind.topk.uplink.TopkUplink`): whatever a site
    sends, it moves at most this many coordinates of the model."""
    if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total < 0:
        raise ValueError(f"Invalid total value: {total!r} (expected an int >= 0)")
    return min(int(total), max(1, int(round(ratio * total))))


def tensor_quotas(sizes, k: int) -> np.ndarray:
    """``k`` split between arrays of ``sizes`` in proportion to their size (largest
    remainders round up), each at most its size; the quotas sum to ``min(k, sum(sizes))``."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    k = min(int(k), total)
    if k <= 0 or total == 0:
        return np.zeros(len(sizes), dtype=np.int64)
    exact = sizes * (k / total)
    quotas = np.minimum(np.floor(exact).astype(np.int64), sizes)
    order = np.argsort(-(exact - quotas), kind="stable")
    for i in order[: k - int(quotas.sum())]:
        quotas[i] += 1
    return quotas


def allocated_topk(magnitudes: np.ndarray, offsets: np.ndarray, k: int, allocation: str = "model",
                   select=topk_indices) -> np.ndarray:
    """Sorted flat indices of ``k`` coordinates of a model whose arrays lie at
    ``offsets[i]:offsets[i + 1]`` of ``magnitudes``, chosen by ``allocation``:

    - ``"model"``: the ``k`` largest over the whole model (global top-k);
    - ``"tensor"``: each array its share of ``k`` in proportion to its size
      (:func:`tensor_quotas`), its largest values (layer-wise top-k, as DGC selects);
    - ``"mixed"``: half of ``k`` as ``"tensor"``, the other half the largest of the rest
      over the whole model.

    Why not always the model's largest: the arrays' update sizes differ by orders of
    magnitude (the classifier's are the largest, the first convolution's the smallest), so
    a global top-k leaves whole arrays unsent round after round; with a decaying residual
    they never move (measured: the gearbox family's first two convolutions got 0–71, mostly
    under 20, of their 18,432 coordinates a round after the warm-up, and the model stalled
    at chance; docs/benchmarks/plant.md).
    ``select(magnitudes, k)``: the per-part top-k (:func:`topk_indices` or a sampled one)."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"Invalid allocation value: {allocation!r} (expected one of {ALLOCATIONS})")
    mag = np.asarray(magnitudes).ravel()
    if allocation == "model":
        return select(mag, k)
    own = k if allocation == "tensor" else k // 2
    quotas = tensor_quotas(np.diff(offsets), own)
    parts = [select(mag[lo:hi], int(q)) + lo for lo, hi, q in zip(offsets[:-1], offsets[1:], quotas) if q > 0]
    chosen = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    rest = k - chosen.size
    if allocation == "mixed" and rest > 0:
        others = mag.copy()
        others[chosen] = 0
        chosen = np.concatenate([chosen, select(others, rest)])
    return np.unique(chosen).astype(np.int64, copy=False)


def warmup_ratio(ratio: float, server_round: int, warmup_rounds: int) -> float:
    r"""Share of coordinates to send in ``server_round`` (1-based) with a sparsity warm-up.

    DGC's warm-up, per round: the density falls geometrically from 1 towards ``ratio``
    over the first ``warmup_rounds`` rounds, then stays at ``ratio``:

    .. math::  \rho_t = \rho^{\min(1,\, t / (W + 1))}

    so with ``ratio = 0.01`` and ``W = 3``: 0.316, 0.1, 0.0316, then 0.01. Early rounds move
    the model most (largest learning rate, furthest from a good model); what a sparse
    update holds back then is stale by the time error feedback sends it. ``W = 0``: always
    ``ratio``.
    """
    if isinstance(ratio, bool) or not (isinstance(ratio, (int, float, np.floating)) and 0 < ratio <= 1):
        raise ValueError(f"Invalid ratio value: {ratio!r} (expected 0 < ratio <= 1)")
    for name, value, low in (("server_round", server_round, 1), ("warmup_rounds", warmup_rounds, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"Invalid {name} value: {value!r} (expected an int >= {low})")
    if server_round > warmup_rounds:
        return float(ratio)
    return float(ratio ** (server_round / (warmup_rounds + 1)))


# --------------------------------------------------------------------------- sparse tensor


@dataclass(frozen=True, eq=False)
class SparseTensor:
    """One array's share of a compressed update: what goes on the wire for it.

    ``indices``: strictly increasing flat (C-order) indices into ``shape`` (int64);
    ``codes``: int8 quantised values, one per index; ``scale``: float32-representable;
    ``mode``: ``"int8"``, ``"int4"`` or ``"sign"``. :meth:`values` / :meth:`to_dense` dequantise.
    """

    shape: tuple[int, ...]
    indices: np.ndarray
    codes: np.ndarray
    scale: float
    mode: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        indices = np.asarray(self.indices)
        codes = np.asarray(self.codes)
        if self.mode not in MODES:
            raise ValueError(f"Invalid mode: {self.mode!r} (expected one of {MODES})")
        if indices.ndim != 1 or not (indices.size == 0 or np.issubdtype(indices.dtype, np.integer)):
            raise ValueError(f"Invalid indices: expected 1-D integers, got {indices.dtype} {indices.shape}")
        if codes.dtype != np.int8 or codes.shape != indices.shape:
            raise ValueError(f"Invalid codes: expected int8 of shape {indices.shape}, got {codes.dtype} {codes.shape}")
        numel = math.prod(self.shape)
        if numel > U32_MAX:
            raise ValueError(f"Invalid shape {self.shape}: more than 2**32 - 1 elements")
        if indices.size and (indices[0] < 0 or indices[-1] >= numel or np.any(np.diff(indices) <= 0)):
            raise ValueError("Invalid indices: must be strictly increasing and in range")
        scale = float(self.scale)
        if not np.isfinite(scale) or float(np.float32(scale)) != scale:
            raise ValueError(f"Invalid scale: {self.scale} (must be a finite float32)")
        if indices.size and not scale > 0:
            raise ValueError(f"Invalid scale: {self.scale} (must be > 0 when values are sent)")
        if not indices.size and scale != 0:
            raise ValueError(f"Invalid scale: {self.scale} (must be 0 when nothing is sent)")
        if self.mode in LEVELS and np.any(np.abs(codes.astype(np.int16)) > LEVELS[self.mode]):
            levels = LEVELS[self.mode]
            raise ValueError(f"Invalid codes: {self.mode} codes lie in [-{levels}, {levels}]")
        if self.mode == "sign" and np.any((codes != 1) & (codes != -1)):
            raise ValueError("Invalid codes: sign codes are -1 or +1")
        object.__setattr__(self, "indices", indices.astype(np.int64, copy=False))
        object.__setattr__(self, "codes", codes)
        object.__setattr__(self, "scale", scale)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def count(self) -> int:
        return int(self.indices.size)

    def values(self) -> np.ndarray:
        """Dequantised float32 values, one per index."""
        return dequantise(self.codes, self.scale, self.mode)

    def to_dense(self) -> np.ndarray:
        """Dense float32 array of ``shape``: the values at ``indices``, zeros elsewhere."""
        dense = np.zeros(self.numel, dtype=np.float32)
        dense[self.indices] = self.values()
        return dense.reshape(self.shape)
