r"""DWA's site weights: how far each site's label histogram is from the global one (KL
divergence), turned into aggregation weights with a temperature and a floor; and the
per-class row scales of the classifier head (pure numpy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["GlobalHistogram", "class_row_scales", "dwa_weights", "kl_divergence", "scale_rows"]


# --------------------------------------------------------------------------- validation


def _histogram(x, name: str, length: int | None = None) -> np.ndarray:
    """``x`` as a 1-D float64 array of finite, non-negative counts, or ValueError."""
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"Invalid {name}: expected a 1-D histogram, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"Invalid {name}: expected {length} classes, got {arr.shape[0]}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"Invalid {name}: counts must be finite, got {arr.tolist()}")
    if np.any(arr < 0):
        raise ValueError(f"Invalid {name}: counts must be non-negative, got {arr.tolist()}")
    return arr


def _normalise(h: np.ndarray) -> np.ndarray | None:
    """Counts -> probabilities; None for an all-zero histogram (it carries no information)."""
    total = h.sum()
    return h / total if total > 0 else None


# --------------------------------------------------------------------------- DWA


def kl_divergence(p, q, eps: float = 1e-12) -> float:
    r"""KL(P || Q) in nats between two label histograms (counts or probabilities).

    Both are normalised first. Then

    .. math::  KL(P\|Q) = \max\Big(0,\ \sum_{k:\,p_k>0} p_k \log\frac{p_k}{q_k + \epsilon}\Big)

    - terms with ``p_k = 0`` contribute 0 (the limit of ``p log p``);
    - ``q`` is smoothed by ``eps`` so a class never seen in ``Q`` gives a large finite
      penalty (about ``p_k * 27.6`` for the default) instead of ``inf``. The smoothed ``q``
      is deliberately not renormalised: its bias is at most ``log(1 + K*eps)`` and the
      clamp at 0 then makes ``KL(P||P) == 0`` exactly, which keeps DWA == FedAvg exact;
    - an all-zero ``p`` or ``q`` carries no label information: the result is 0.
    """
    if not (np.isfinite(eps) and eps > 0):
        raise ValueError(f"Invalid eps: {eps}")
    p_arr = _histogram(p, "p")
    q_arr = _histogram(q, "q", length=p_arr.shape[0])
    p_n, q_n = _normalise(p_arr), _normalise(q_arr)
    if p_n is None or q_n is None:
        return 0.0
    seen = p_n > 0
    terms = p_n[seen] * (np.log(p_n[seen]) - np.log(q_n[seen] + eps))
    return max(0.0, float(terms.sum()))


class GlobalHistogram:
    """Global label distribution over every site seen so far, latest report per site.

    ``global[k] = sum over sites s ever seen of latest_hist_s[k]``; a site that reports
    again replaces its previous histogram (it does not add to it), so a site that reports
    every round is not counted once per round. ``distribution()`` is ``global / sum(global)``.
    """

    def __init__(self, num_classes: int) -> None:
        if not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
            raise ValueError(f"Invalid num_classes: {num_classes}")
        self.num_classes = int(num_classes)
        self._sites: dict[str, np.ndarray] = {}

    def update(self, site_id: str, hist) -> None:
        """Record ``hist`` (per-class counts) as the latest histogram of ``site_id``."""
        if not isinstance(site_id, str):
            raise TypeError(f"site_id must be a str, got {type(site_id).__name__}")
        counts = _histogram(hist, f"histogram of site {site_id!r}", self.num_classes)
        self._sites[site_id] = counts

    def counts(self) -> np.ndarray:
        """Summed per-class counts (float64, shape ``[num_classes]``)."""
        total = np.zeros(self.num_classes, dtype=np.float64)
        for site_id in sorted(self._sites):  # fixed order: deterministic float sums
            total += self._sites[site_id]
        return total

    def distribution(self) -> np.ndarray:
        """Normalised global histogram; all zeros until some site has reported a label."""
        total = self.counts()
        probs = _normalise(total)
        return total if probs is None else probs

    def state_dict(self) -> dict:
        """Plain ints / floats / lists / str keys: serialises to JSON as is."""
        return {
            "num_classes": self.num_classes,
            "sites": {s: self._sites[s].tolist() for s in sorted(self._sites)},
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from :meth:`state_dict`; validates everything before changing ``self``."""
        if set(state) != {"num_classes", "sites"}:
            raise ValueError(f"Invalid GlobalHistogram state keys: {sorted(state)}")
        if state["num_classes"] != self.num_classes:
            raise ValueError(
                f"Invalid num_classes in state: {state['num_classes']} "
                f"(this histogram has {self.num_classes})"
            )
        sites = {}
        for site_id, hist in dict(state["sites"]).items():
            if not isinstance(site_id, str):
                raise TypeError(f"site_id must be a str, got {type(site_id).__name__}")
            sites[site_id] = _histogram(hist, f"histogram of site {site_id!r}", self.num_classes)
        self._sites = sites


def _apply_floor(w: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """Smallest change to ``w`` (sum 1) so that ``w_i >= lower_i`` and the sum stays 1.

    Water-filling: weights under their bound are pinned to it, the free ones are rescaled
    to the mass that is left, repeated until none is under (at most one pass per site).
    Needs ``sum(lower) <= 1``. Returns ``w`` itself when no weight is under its bound.
    """
    out = w.copy()
    pinned = np.zeros(w.shape, dtype=bool)
    while True:
        under = ~pinned & (out < lower)
        if not under.any():
            return out
        pinned |= under
        out[pinned] = lower[pinned]
        free = ~pinned
        mass = w[free].sum()
        if mass > 0:
            out[free] = w[free] * ((1.0 - lower[pinned].sum()) / mass)


def dwa_weights(
    num_examples,
    histograms,
    global_dist,
    temperature: float = 1.0,
    floor: float = 0.1,
) -> np.ndarray:
    r"""Divergence-weighted aggregation weights, one per site, summing to 1.

    With :math:`n_i` the example count of site :math:`i`, :math:`N = \sum_j n_j`,
    :math:`D_i = KL(P_i \| P_{global})` (:func:`kl_divergence`) and temperature :math:`T`:

    .. math::

        \tilde w_i = \frac{n_i\, e^{-(D_i - D_{min})/T}}{\sum_j n_j\, e^{-(D_j - D_{min})/T}},
        \qquad D_{min} = \min_{j:\,n_j>0} D_j

    (subtracting :math:`D_{min}` changes nothing mathematically; it avoids underflow and
    makes equal divergences give exactly ``n / n.sum()``, FedAvg's weights). Then the floor:

    .. math::  w_i \ge f\, n_i / N, \qquad \sum_i w_i = 1

    enforced by water-filling (:func:`_apply_floor`): a site below ``f`` times its FedAvg
    share is raised to it and the other sites are rescaled proportionally to pay for it.
    So no site with data is silenced, ``floor=0`` is the pure exponential weighting and
    ``floor=1`` is FedAvg. Large ``T`` tends to FedAvg; small ``T`` favours the sites
    closest to the global label distribution.

    Sites with ``n_i = 0`` get weight 0. A site with an all-zero histogram (or an all-zero
    ``global_dist``) has divergence 0.
    """
    if not (np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"Invalid temperature: {temperature}")
    if not (0.0 <= floor <= 1.0):
        raise ValueError(f"Invalid floor: {floor}")
    n = np.asarray(num_examples, dtype=np.float64)
    if n.ndim != 1 or n.size == 0:
        raise ValueError(f"Invalid num_examples: expected a non-empty 1-D list, got {n.tolist()}")
    if not np.all(np.isfinite(n)) or np.any(n < 0) or n.sum() <= 0:
        raise ValueError(f"Invalid num_examples: {n.tolist()}")
    g = _histogram(global_dist, "global_dist")
    if len(histograms) != n.size:
        raise ValueError(f"Invalid histograms: {len(histograms)} histograms for {n.size} sites")
    hists = [_histogram(h, f"histogram {i}", g.size) for i, h in enumerate(histograms)]
    div = np.array([kl_divergence(h, g) for h in hists])
    has_data = n > 0
    factor = np.exp(-(div - div[has_data].min()) / temperature)
    raw = n * factor
    w = raw / raw.sum()
    return _apply_floor(w, floor * (n / n.sum()))


def padded_histogram_state(state: Mapping, num_classes: int) -> dict:
    """A :meth:`GlobalHistogram.state_dict` grown to ``num_classes`` (the head grew): every
    site's counts padded with zeros for the new classes."""
    return {"num_classes": num_classes,
            "sites": {s: list(h) + [0] * (num_classes - len(h)) for s, h in state["sites"].items()}}


def class_row_scales(weights, histograms) -> np.ndarray:
    r"""Per site and class, the factor that turns the site-weighted mean of a head row into
    a mean over the sites that hold the class; shape ``[sites, classes]``.

    With site weights :math:`w_i` (sum 1) and label shares :math:`p_i(c) = h_{ic}/\sum_k h_{ik}`,
    class :math:`c`'s row is averaged with :math:`W_{ic} = w_i p_i(c) / \sum_j w_j p_j(c)`;
    the factor is :math:`W_{ic} / w_i`, so that :math:`\sum_i w_i (s_{ic} d_{ic}) = \sum_i W_{ic} d_{ic}`.
    A site learns a class's row only from windows of that class: averaged over all sites,
    the one line that holds a new fault class moves its row by a tenth of what it learnt
    (with ten lines), and the class stays unrecognised. A class no site holds this round
    keeps the site weights (factor 1). Sites with weight 0 get factor 0.
    """
    w = np.asarray(weights, dtype=np.float64)
    h = np.asarray(histograms, dtype=np.float64)
    if h.ndim != 2 or h.shape[0] != w.size or np.any(h < 0) or not np.all(np.isfinite(h)):
        raise ValueError(f"Invalid histograms: expected [{w.size}, classes] non-negative counts, got shape {h.shape}")
    totals = h.sum(axis=1, keepdims=True)
    shares = np.divide(h, totals, out=np.zeros_like(h), where=totals > 0)
    mass = (w[:, None] * shares).sum(axis=0)  # sum_j w_j p_j(c)
    held = mass > 0
    scales = np.ones_like(shares)
    scales[:, held] = shares[:, held] / mass[held]
    scales[w <= 0] = 0.0
    return scales


def scale_rows(deltas: Sequence[Mapping[str, np.ndarray]], scales: np.ndarray, names: Sequence[str]) -> list[dict]:
    """``deltas`` with the rows (first axis) of the arrays in ``names`` multiplied by the
    site's ``scales`` row (:func:`class_row_scales`); other arrays are shared, not copied."""
    out = []
    for d, s in zip(deltas, np.asarray(scales), strict=True):
        scaled = dict(d)
        for name in names:
            a = np.asarray(d[name])
            if a.shape[0] != s.size:
                raise ValueError(f"Invalid deltas[{name!r}]: {a.shape[0]} rows for {s.size} classes")
            scaled[name] = a * s.reshape((-1,) + (1,) * (a.ndim - 1))
        out.append(scaled)
    return out
