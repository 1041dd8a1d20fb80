r"""Head calibration on virtual features (CCVR: Luo et al. 2021, "No Fear of Heterogeneity:
Classifier Calibration for Federated Learning with Non-IID Data").

Why: under strong label skew each line's local training tilts the classifier towards its
own classes, and a class that one line holds (a new fault) has a row that only that line
teaches while nine lines move the features under it. The feature extractor is shared and
fine; the head is what drifts. So after the run's last round the server refits the head,
and only the head, on features drawn from the federation's per-class feature distribution,
which the sites describe by moments without sending a window. (Refitting at the end of
phase 0 as well changed phase 1 for the worse on some seeds: training is left alone.)

**Site** (:func:`class_moments`): with the final global model as received, the features
:math:`z = \phi(x)` of its windows (this phase's and its replay buffer's), and per class it
holds, the count :math:`n_c`, the mean :math:`\mu_c` and the covariance :math:`\Sigma_c`
(upper triangle). Nothing per window. Under encryption the site sends them instead as one
side vector of per-window raw moments (:func:`moments_vector`), summed under Paillier; the
server reads the union's from the sum (:func:`vector_moments`) and never one line's.

A window whose label the received model contradicts with near certainty (probability
below ``calibration-label-floor``, :func:`agreeing`) is left out: a line that logs one
fault as healthy would otherwise spread the healthy class's Gaussian over that fault, and
the refit head would call it healthy (docs/benchmarks/poisoning.md).

**Server** (:func:`merge_moments`): the moments of the union, exactly,

.. math::

    n_c = \sum_s n_{sc}, \quad \mu_c = \sum_s \frac{n_{sc}}{n_c} \mu_{sc}, \quad
    S_c = \sum_s n_{sc} \big(\Sigma_{sc} + (\mu_{sc} - \mu_c)(\mu_{sc} - \mu_c)^\top\big),

after bounding what one line can claim (:func:`bounded_moments`: its counts at most the
windows its train replies declared, and no class mean or spread far outside the
federation's), then (:func:`shrunk_covariances`) each class's covariance shrunk towards the pooled one,
:math:`\hat\Sigma_c = (S_c + k \bar\Sigma) / (n_c + k)` with :math:`\bar\Sigma = \sum_c S_c /
\sum_c n_c` and :math:`k` = the feature dimension (regularised discriminant analysis,
Friedman 1989): a new class seen in 5 windows has a rank-4 scatter, and sampled from it
alone its region is a needle. Chosen on selection seeds 0–4 at alpha 0.1, final models
calibrated after the fact (``simulations/calibration_probe.py``): shrunk +1.6 points, the
classes' own covariances +1.4 to +2.2 (within the probe's noise), pooled −0.3 to −0.4,
diagonal −0.5 to −1.0 (docs/benchmarks/plant.md).

**Refit** (:func:`calibrate_head`): ``samples`` features per class drawn from
:math:`\mathcal N(\mu_c, \hat\Sigma_c)` (every class alike: the plant's test is balanced),
and the head trained on them by SGD with momentum from its current weights. Seeded: the same
moments give the same head.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

__all__ = [
    "ClassMoments", "agreeing", "bounded_moments", "calibrate_head", "class_moments", "decode_moments", "draw_gaussian",
    "encode_moments", "fit_head", "sampling_ridge",
    "merge_moments", "moments_vector", "shrunk_covariances", "triangle", "untriangle", "vector_moments",
]

SAMPLES_PER_CLASS = 1000  # virtual features per class
STEPS = 300  # SGD steps of the refit
BATCH = 256
LEARNING_RATE = 0.05
MOMENTUM = 0.9
MAX_SPREAD = 10.0  # a line's class mean or spread over this many times the federation's median: left out
RIDGE = 1e-6  # added to the diagonal before sampling, relative to the mean variance


class ClassMoments(NamedTuple):
    """Per-class feature moments of one site (or of the federation): the classes present,
    their counts, means ``[m, F]`` and covariances ``[m, F, F]``."""

    classes: np.ndarray
    counts: np.ndarray
    means: np.ndarray
    covariances: np.ndarray


def triangle(matrices: np.ndarray) -> np.ndarray:
    """The upper triangles (diagonal included) of ``[m, F, F]`` symmetric matrices, ``[m, F(F+1)/2]``."""
    f = matrices.shape[-1]
    rows, cols = np.triu_indices(f)
    return matrices[:, rows, cols]


def untriangle(packed: np.ndarray, features: int) -> np.ndarray:
    """:func:`triangle` undone: ``[m, F(F+1)/2]`` -> symmetric ``[m, F, F]``; ValueError on a wrong length."""
    packed = np.asarray(packed, dtype=np.float64)
    if packed.ndim != 2 or packed.shape[1] != features * (features + 1) // 2:
        raise ValueError(f"Invalid packed covariances: shape {packed.shape} for {features} features")
    rows, cols = np.triu_indices(features)
    out = np.zeros((packed.shape[0], features, features))
    out[:, rows, cols] = packed
    out[:, cols, rows] = packed
    return out


def encode_moments(moments: ClassMoments) -> dict:
    """The wire form (a ConfigRecord's values): ``classes`` and ``counts`` as int lists,
    ``means`` as float32 bytes ``[m, F]``, and each covariance's upper triangle
    ``[F(F+1)/2]`` as int8 codes (``covariances``, ``[m, F(F+1)/2]`` bytes) times its scale
    (``scales``, float32 bytes ``[m]``: the largest magnitude / 127), little-endian. A code
    step is under 0.4 % of the largest entry: far finer than what a few hundred windows
    tell of a covariance (8.3 kB a class at 128 features, a quarter of float32)."""
    packed = triangle(moments.covariances)
    scales = np.abs(packed).max(axis=1, initial=0.0) / 127 if packed.size else np.zeros(0)
    codes = np.round(np.divide(packed, scales[:, None], out=np.zeros_like(packed), where=scales[:, None] > 0))
    return {
        "classes": [int(c) for c in moments.classes],
        "counts": [int(n) for n in moments.counts],
        "means": np.ascontiguousarray(moments.means, dtype="<f4").tobytes(),
        "scales": np.ascontiguousarray(scales, dtype="<f4").tobytes(),
        "covariances": codes.astype(np.int8).tobytes(),
    }


def decode_moments(values: dict, num_classes: int, features: int) -> ClassMoments:
    """:func:`encode_moments` undone and checked (ValueError naming the fault): distinct
    classes of a head of ``num_classes``, counts >= 1, finite means and covariances of
    ``features`` features, variances >= 0."""
    keys = set(values)
    if keys != {"classes", "counts", "means", "scales", "covariances"}:
        raise ValueError(f"expected classes, counts, means, scales, covariances, got {sorted(map(str, keys))}")
    classes, counts = values["classes"], values["counts"]
    if not (isinstance(classes, list) and isinstance(counts, list) and len(classes) == len(counts)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in classes + counts)):
        raise ValueError("classes and counts must be int lists of one length")
    m, tri = len(classes), features * (features + 1) // 2
    if len(set(classes)) != m or any(not 0 <= c < num_classes for c in classes) or any(n < 1 for n in counts):
        raise ValueError(f"classes {classes} (a head of {num_classes}), counts {counts}")
    means, scales, packed = values["means"], values["scales"], values["covariances"]
    for name, value, size in (("means", means, 4 * m * features), ("scales", scales, 4 * m), ("covariances", packed, m * tri)):
        if not (isinstance(value, bytes) and len(value) == size):
            raise ValueError(f"{name}: expected {size} bytes for {m} classes of {features} features")
    means = np.frombuffer(means, dtype="<f4").reshape(m, features).astype(np.float64)
    scales = np.frombuffer(scales, dtype="<f4").astype(np.float64)
    if not (np.all(np.isfinite(means)) and np.all(np.isfinite(scales)) and np.all(scales >= 0)):
        raise ValueError("means and scales must be finite, scales >= 0")
    codes = np.frombuffer(packed, dtype=np.int8).reshape(m, tri)
    if np.any(codes == -128):
        raise ValueError("covariance codes must lie in -127..127")
    packed = codes.astype(np.float64) * scales[:, None]
    covariances = untriangle(packed, features)
    if np.any(np.diagonal(covariances, axis1=1, axis2=2) < 0):
        raise ValueError("a negative variance")
    return ClassMoments(np.asarray(classes, dtype=np.int64), np.asarray(counts, dtype=np.int64), means, covariances)


def class_moments(features: np.ndarray, labels: np.ndarray) -> ClassMoments:
    """The moments of ``features`` ``[N, F]`` per label present (population covariance)."""
    z = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels)
    if z.ndim != 2 or y.shape != (z.shape[0],):
        raise ValueError(f"Invalid features / labels: shapes {z.shape} and {y.shape}")
    classes = np.unique(y).astype(np.int64)
    counts = np.array([np.count_nonzero(y == c) for c in classes], dtype=np.int64)
    means = np.stack([z[y == c].mean(axis=0) for c in classes]) if classes.size else np.zeros((0, z.shape[1]))
    covariances = np.stack([np.cov(z[y == c], rowvar=False, bias=True).reshape(z.shape[1], z.shape[1])
                            for c in classes]) if classes.size else np.zeros((0, z.shape[1], z.shape[1]))
    return ClassMoments(classes, counts, means, covariances)


def agreeing(features: np.ndarray, labels: np.ndarray, weight: np.ndarray, bias: np.ndarray,
             floor: float) -> np.ndarray:
    """Which windows a site describes in its calibration moments: a boolean mask, False where
    the received head gives the window's label a probability below ``floor`` (0: every
    window). A line's mislabelled windows (class 1 logged as healthy) are what the
    federation's model contradicts with near certainty; kept, they spread the healthy
    Gaussian over class 1 and the calibrated head calls class 1 healthy. A class whose
    windows would all be left out keeps them all (a head that has not learnt a class yet
    contradicts every window of it)."""
    y = np.asarray(labels)
    keep = np.ones(y.shape, dtype=bool)
    if floor <= 0 or y.size == 0:
        return keep
    logits = np.asarray(features, dtype=np.float64) @ np.asarray(weight, dtype=np.float64).T + np.asarray(bias)
    logits -= logits.max(axis=1, keepdims=True)
    log_p = logits[np.arange(len(y)), y] - np.log(np.exp(logits).sum(axis=1))
    keep = log_p >= np.log(floor)
    for c in np.unique(y):
        if not keep[y == c].any():
            keep[y == c] = True
    return keep


def bounded_moments(parts: Mapping[str, ClassMoments], limits: Mapping[str, Sequence[int]],
                    factor: float = MAX_SPREAD) -> tuple[list[ClassMoments], list[str]]:
    """What one line can weigh in the merge, bounded. ``parts`` and ``limits`` by line:
    the counts of each line's part are capped at its limits (per class, the windows its
    train replies declared: label histogram plus replay buffer; a line that declared none
    is left out), and a class is left out where its mean's norm or its spread (root of the
    covariance's trace) is over ``factor`` times the median over every line's classes.
    Honest lines are never capped (they describe exactly the windows they declared) and
    their classes lie within a few times of each other; a forged record can neither
    outweigh what its line already claimed in training nor drag a class's mean far away.
    Returns the bounded parts (empty ones dropped) and one reason per change, naming the line."""
    norms = {line: np.linalg.norm(p.means, axis=1) for line, p in parts.items()}
    spreads = {line: np.sqrt(np.maximum(np.trace(p.covariances, axis1=1, axis2=2), 0.0)) for line, p in parts.items()}
    median_norm = float(np.median(np.concatenate(list(norms.values())))) if parts else 0.0
    median_spread = float(np.median(np.concatenate(list(spreads.values())))) if parts else 0.0
    kept, reasons = [], []
    for line, p in parts.items():
        if line not in limits:
            reasons.append(f"line {line}: declared no windows in training; left out")
            continue
        cap = np.zeros(max(len(limits[line]), int(p.classes.max(initial=-1)) + 1), dtype=np.int64)
        cap[:len(limits[line])] = np.asarray(limits[line], dtype=np.int64)
        counts = np.minimum(p.counts, cap[p.classes])
        if np.any(counts < p.counts):
            reasons.append(f"line {line}: counts {p.counts.tolist()} of classes {p.classes.tolist()} capped at the "
                           f"declared {cap[p.classes].tolist()}")
        far = (norms[line] > factor * median_norm) | (spreads[line] > factor * median_spread)
        if np.any(far):
            reasons.append(f"line {line}: classes {p.classes[far].tolist()} lie over {factor:g}x the median mean "
                           f"norm ({median_norm:.3g}) or spread ({median_spread:.3g}); left out")
        keep = (counts > 0) & ~far
        if np.any(keep):
            kept.append(ClassMoments(p.classes[keep], counts[keep], p.means[keep], p.covariances[keep]))
    return kept, reasons


def merge_moments(parts: Sequence[ClassMoments], num_classes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The union's ``(counts [C], means [C, F], scatter [C, F, F])`` (scatter = count times
    covariance); classes no part holds have count 0, mean 0 and scatter 0."""
    if not parts:
        raise ValueError("no moments to merge")
    f = parts[0].means.shape[1]
    counts = np.zeros(num_classes)
    sums = np.zeros((num_classes, f))
    for p in parts:
        counts[p.classes] += p.counts
        sums[p.classes] += p.counts[:, None] * p.means
    means = np.divide(sums, counts[:, None], out=np.zeros_like(sums), where=counts[:, None] > 0)
    scatter = np.zeros((num_classes, f, f))
    for p in parts:
        gap = p.means - means[p.classes]
        scatter[p.classes] += p.counts[:, None, None] * (p.covariances + gap[:, :, None] * gap[:, None, :])
    return counts, means, scatter


def moments_vector(moments: ClassMoments, num_classes: int) -> np.ndarray:
    """One site's moments as a side vector for an encrypted sum (:mod:`fedind.paillier.sums`):
    per class of the head, ``[n_c, n_c mu_c, triangle(n_c (Sigma_c + mu_c mu_c^T))]`` divided
    by the site's windows ``N`` (zeros for a class it lacks), so per-window raw moments.
    Averaged over sites with weights ``N_s / sum N`` and multiplied by ``sum N``
    (:func:`vector_moments`), they give the union's, as :func:`merge_moments` does."""
    f = moments.means.shape[1]
    tri = f * (f + 1) // 2
    total = float(np.sum(moments.counts))
    out = np.zeros((num_classes, 1 + f + tri))
    if total > 0:
        n = moments.counts.astype(np.float64)
        second = moments.covariances + moments.means[:, :, None] * moments.means[:, None, :]
        out[moments.classes, 0] = n / total
        out[moments.classes, 1:1 + f] = n[:, None] * moments.means / total
        out[moments.classes, 1 + f:] = n[:, None] * triangle(second) / total
    return out.ravel()


def vector_moments(vector: np.ndarray, total: float, num_classes: int, features: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`merge_moments`' ``(counts, means, scatter)`` from the weighted mean of the sites'
    :func:`moments_vector` and their windows in all, ``total``. Counts are rounded to whole
    windows (the weights' rounding moves them by a fraction); ValueError when the length
    does not fit or a count or variance comes out negative (no honest sum does)."""
    f, tri = features, features * (features + 1) // 2
    v = np.asarray(vector, dtype=np.float64)
    if v.shape != (num_classes * (1 + f + tri),) or not np.all(np.isfinite(v)):
        raise ValueError(f"Invalid moments vector: {v.shape} for {num_classes} classes of {features} features")
    v = v.reshape(num_classes, 1 + f + tri) * float(total)
    raw = v[:, 0]
    if np.any(raw < -0.5):
        raise ValueError("a negative count")
    counts = np.round(raw)
    held = counts > 0
    means = np.zeros((num_classes, f))
    means[held] = v[held, 1:1 + f] / raw[held, None]
    second = untriangle(v[:, 1 + f:], f)
    scatter = np.zeros((num_classes, f, f))
    scatter[held] = second[held] - raw[held, None, None] * means[held, :, None] * means[held, None, :]
    scatter[held] *= (counts[held] / raw[held])[:, None, None]
    if np.any(np.diagonal(scatter, axis1=1, axis2=2) < -1e-6 * (1 + np.abs(second).max(initial=0))):
        raise ValueError("a negative variance")
    return counts, means, scatter


def shrunk_covariances(counts: np.ndarray, scatter: np.ndarray, strength: float | None = None) -> np.ndarray:
    r"""Per class :math:`(S_c + k \bar\Sigma) / (n_c + k)`, :math:`\bar\Sigma` the pooled
    within-class covariance and ``strength`` :math:`k` (None: the feature dimension)."""
    counts = np.asarray(counts, dtype=np.float64)
    if not counts.sum() > 0:
        raise ValueError("no features to estimate a covariance from")
    k = float(scatter.shape[-1] if strength is None else strength)
    pooled = scatter.sum(axis=0) / counts.sum()
    return (scatter + k * pooled) / (counts + k)[:, None, None]


def calibrate_head(weight: np.ndarray, bias: np.ndarray, counts: np.ndarray, means: np.ndarray,
                   covariances: np.ndarray, *, seed: int = 0, samples: int = SAMPLES_PER_CLASS,
                   steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    """The head ``(weight [C, F], bias [C])`` refit on ``samples`` virtual features per class
    with a count above 0, drawn from ``N(means[c], covariances[c])``; classes without features
    keep their rows only as competitors (no samples of theirs). float32 out, as in."""
    present = np.flatnonzero(np.asarray(counts) > 0)
    if present.size < 2:
        raise ValueError(f"head calibration needs features of two classes or more, got {present.size}")
    rng = np.random.default_rng(seed)
    ridge = sampling_ridge(covariances[present])
    z = np.concatenate([draw_gaussian(rng, means[c], covariances[c], samples, ridge) for c in present])
    y = np.repeat(present, samples)
    return fit_head(weight, bias, z, y, seed=seed, steps=steps)


def sampling_ridge(covariances: np.ndarray) -> float:
    """The eigenvalue floor for drawing from ``covariances`` [K, F, F]: :data:`RIDGE` times
    their mean variance."""
    f = covariances.shape[-1]
    return RIDGE * max(float(np.mean([np.trace(c) / f for c in covariances])), 1e-12)


def draw_gaussian(rng: np.random.Generator, mean: np.ndarray, covariance: np.ndarray, n: int,
                  ridge: float) -> np.ndarray:
    """``n`` draws of ``N(mean, covariance)`` through the covariance's eigenvectors, its
    eigenvalues floored at ``ridge`` (PSD after rounding)."""
    values, vectors = np.linalg.eigh((covariance + covariance.T) / 2)
    root = vectors * np.sqrt(np.maximum(values, ridge))
    return mean + rng.standard_normal((n, len(mean))) @ root.T


def fit_head(weight: np.ndarray, bias: np.ndarray, z: np.ndarray, y: np.ndarray, *, seed: int = 0,
             steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    """The head ``(weight [C, F], bias [C])`` refit from itself by SGD on features ``z`` with
    labels ``y`` (``steps`` batches drawn with ``seed``). float32 out."""
    c_all, f = weight.shape
    z = torch.as_tensor(z, dtype=torch.float32)
    y = torch.as_tensor(y)
    head = nn.Linear(f, c_all)
    with torch.no_grad():
        head.weight.copy_(torch.as_tensor(weight, dtype=torch.float32))
        head.bias.copy_(torch.as_tensor(bias, dtype=torch.float32))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(head.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    for _ in range(steps):
        batch = torch.randint(0, len(y), (BATCH,), generator=generator)
        loss = nn.functional.cross_entropy(head(z[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.weight.detach().numpy().astype(np.float32), head.bias.detach().numpy().astype(np.float32)
