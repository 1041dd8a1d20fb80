"""Server-side aggregation maths: DWA weights, conflict detection, momentum buffer.

Pure numpy, no Flower or torch: the strategy composes these functions and only moves
records around. Every rule here is stated as a formula in its docstring and tested
against a numeric oracle in ``tests/test_aggregation.py``.

Round, server side::

    hist.update(site, label_histogram)            # for every replying site
    w = dwa_weights(n, histograms, hist.distribution(), temperature, floor)
    delta = conflict_aware_aggregate(deltas, w, buffer, threshold)
    global_arrays = {k: global_arrays[k] + delta[k] for k in delta}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = [
    "GlobalHistogram",
    "MomentumBuffer",
    "RestartMomentum",
    "agreement_gain",
    "class_row_scales",
    "conflict_momentum_aggregate",
    "conflict_aware_aggregate",
    "dwa_weights",
    "kl_divergence",
    "scale_rows",
    "sign_agreement",
    "split_conflicts",
]


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


def _weights(weights, num_sites: int) -> np.ndarray:
    """Per-site aggregation weights: finite, non-negative, one per site, positive sum."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (num_sites,):
        raise ValueError(f"Invalid weights: expected shape ({num_sites},), got {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"Invalid weights: {w.tolist()}")
    return w


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


# --------------------------------------------------------------------------- conflicts


def sign_agreement(deltas: Sequence[np.ndarray], weights) -> np.ndarray:
    r"""Per-coordinate agreement of the sites' update directions, in [0, 1].

    .. math::

        A = \frac{\left|\sum_i w_i\, \mathrm{sign}(d_i)\right|}
                 {\sum_i w_i\, |\mathrm{sign}(d_i)|}

    1 = every site that moves the coordinate moves it the same way; 0 = the weight is
    split evenly between up and down. A site whose delta is exactly 0 at a coordinate
    abstains (it is in neither sum) — with top-k sparsified updates most coordinates are
    zero for most sites, and silence is not disagreement. A coordinate no site moves has
    agreement 1. ``weights`` need not be normalised.
    """
    if len(deltas) == 0:
        raise ValueError("Invalid deltas: need at least one site")
    stack = np.stack([np.asarray(d, dtype=np.float64) for d in deltas])
    w = _weights(weights, stack.shape[0]).reshape((-1,) + (1,) * (stack.ndim - 1))
    signs = np.sign(stack)
    voting = np.sum(w * np.abs(signs), axis=0)
    net = np.abs(np.sum(w * signs, axis=0))
    safe = np.where(voting > 0, voting, 1.0)  # avoid 0/0 where nobody votes
    return np.where(voting > 0, net / safe, 1.0)


def split_conflicts(
    mean_delta: np.ndarray, agreement: np.ndarray, threshold: float
) -> tuple[np.ndarray, np.ndarray]:
    """Split ``mean_delta`` into ``(agreeing, conflicting)`` parts that sum to it.

    A coordinate conflicts when ``agreement < threshold``; each part is zero where the
    other is not. ``threshold = 0`` never conflicts, ``threshold = 1`` sends every
    coordinate without a unanimous sign through the buffer.
    """
    if not (0.0 <= threshold <= 1.0):
        raise ValueError(f"Invalid threshold: {threshold}")
    mean_delta = np.asarray(mean_delta)
    agreement = np.asarray(agreement)
    if mean_delta.shape != agreement.shape:
        raise ValueError(
            f"Invalid agreement: shape {agreement.shape} != delta shape {mean_delta.shape}"
        )
    conflict = agreement < threshold
    zero = np.zeros_like(mean_delta)
    return np.where(conflict, zero, mean_delta), np.where(conflict, mean_delta, zero)


class MomentumBuffer:
    r"""Server momentum for the conflicting part of the aggregate.

    Per array name, with conflicting part :math:`c_t`, momentum :math:`\beta` and scale
    :math:`\eta` (``lr_scale``):

    .. math::

        v_t = \beta\, v_{t-1} + c_t, \qquad v_0 = 0

        u_t = \eta\, (1 - \beta)\, v_t \quad \text{(returned, added to the global model)}

    :math:`(1-\beta) v_t` is an exponential moving average of the conflicting parts and
    :math:`\sum_{t\le T} u_t = \eta\,(\sum_{t\le T} c_t - \beta v_T)`, so with
    :math:`\eta = 1` nothing is lost, only delayed: a steady conflict :math:`c` is
    applied in full in the limit (:math:`u_t \to c`), a one-off :math:`c` is applied in
    total over the following rounds (:math:`\sum_t (1-\beta)\beta^t = 1`), and a conflict
    that flips sign each round cancels inside the buffer (:math:`u_t` oscillates with
    amplitude :math:`\frac{1-\beta}{1+\beta}|c|` and sums to ~0 over pairs of rounds)
    instead of kicking the model back and forth. A coordinate that stops conflicting
    (``c = 0``) keeps draining its buffer geometrically.

    Buffers are created lazily on the first :meth:`step` that names an array, in that
    array's floating dtype; later steps must keep its shape.
    """

    def __init__(self, beta: float = 0.9, lr_scale: float = 1.0) -> None:
        if not (0.0 <= beta < 1.0):
            raise ValueError(f"Invalid beta value: {beta}")
        if not (np.isfinite(lr_scale) and lr_scale >= 0.0):
            raise ValueError(f"Invalid lr_scale value: {lr_scale}")
        self.beta = float(beta)
        self.lr_scale = float(lr_scale)
        self._buffers: dict[str, np.ndarray] = {}

    def step(self, conflicting: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Fold ``conflicting`` into the buffers; return ``u_t`` per name (same keys)."""
        out = {}
        for name, c in conflicting.items():
            c = np.asarray(c)
            dtype = np.result_type(c.dtype, np.float32)  # ints promote, floats keep
            v = self._buffers.get(name)
            if v is None:
                v = np.zeros(c.shape, dtype=dtype)
            elif v.shape != c.shape:
                raise ValueError(
                    f"Invalid conflicting[{name!r}]: shape {c.shape} != buffer shape {v.shape}"
                )
            # Buffer keeps its dtype; np.asarray keeps 0-dim buffers arrays (not numpy scalars).
            v = np.asarray(self.beta * v + c, dtype=v.dtype)
            self._buffers[name] = v
            out[name] = np.asarray((self.lr_scale * (1.0 - self.beta)) * v)
        return out

    def state_dict(self) -> dict:
        """``{"buffers": {name: ndarray}}`` (copies). Hyperparameters come from the config."""
        return {"buffers": {k: v.copy() for k, v in self._buffers.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore buffers; if buffers exist already, names and shapes must match them."""
        if set(state) != {"buffers"}:
            raise ValueError(f"Invalid MomentumBuffer state keys: {sorted(state)}")
        loaded = {}
        for name, v in dict(state["buffers"]).items():
            v = np.array(v, copy=True)
            if not np.issubdtype(v.dtype, np.floating) or not np.all(np.isfinite(v)):
                raise ValueError(f"Invalid buffer {name!r}: expected finite floats")
            loaded[name] = v
        if self._buffers:
            if set(loaded) != set(self._buffers):
                raise ValueError(
                    f"Invalid buffer names: {sorted(loaded)} != {sorted(self._buffers)}"
                )
            for name, v in loaded.items():
                if v.shape != self._buffers[name].shape:
                    raise ValueError(
                        f"Invalid buffer {name!r}: shape {v.shape} "
                        f"!= {self._buffers[name].shape}"
                    )
        self._buffers = loaded



def _per_array(deltas: Sequence[Mapping[str, np.ndarray]], weights) -> tuple[np.ndarray, dict]:
    """Validated weights, and per array name the sites' arrays and the result dtype."""
    if len(deltas) == 0:
        raise ValueError("Invalid deltas: need at least one site")
    w = _weights(weights, len(deltas))
    names = list(deltas[0])
    for i, d in enumerate(deltas):
        if set(d) != set(names):
            raise ValueError(f"Invalid delta of site {i}: names {sorted(d)} != {sorted(names)}")
    by_name = {}
    for name in names:
        arrays = [np.asarray(d[name]) for d in deltas]
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1:
            raise ValueError(f"Invalid deltas[{name!r}]: shapes differ across sites {shapes}")
        by_name[name] = (arrays, np.result_type(*(a.dtype for a in arrays), np.float32))
    return w, by_name

def conflict_aware_aggregate(
    deltas: Sequence[Mapping[str, np.ndarray]],
    weights,
    buffer: MomentumBuffer,
    threshold: float,
    agreements: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    r"""Weighted mean of the sites' deltas, conflicting coordinates through ``buffer``.

    Per array name: :math:`\bar d = \sum_i w_i d_i / \sum_i w_i` (``np.average``),
    :math:`A` = :func:`sign_agreement`, split at ``threshold`` (:func:`split_conflicts`),
    and the returned delta is

    .. math::  \Delta = \bar d\,[A \ge \tau] + \mathrm{buffer.step}(\bar d\,[A < \tau])

    ``threshold = 0`` with a fresh buffer is exactly the weighted average; so is a single
    site (its agreement is 1 everywhere). 0-dim arrays work like any other. The result has
    each array's input dtype. ``agreements``: :math:`A` per name when the caller has it.
    """
    w, by_name = _per_array(deltas, weights)
    agreements = agreements if agreements is not None else {n: sign_agreement(a, w) for n, (a, _) in by_name.items()}
    agreeing, conflicting, dtypes = {}, {}, {}
    for name, (arrays, dtypes[name]) in by_name.items():
        mean = np.average(np.stack(arrays), axis=0, weights=w)
        agreeing[name], conflicting[name] = split_conflicts(mean, agreements[name], threshold)
    applied = buffer.step(conflicting)
    return {n: (agreeing[n] + applied[n]).astype(dtypes[n], copy=False) for n in by_name}


def heavy_ball(beta: float) -> MomentumBuffer | None:
    r"""Server momentum :math:`v \leftarrow \beta v + \Delta`, applying :math:`v` (FedAvgM
    with server learning rate 1); None for ``beta = 0``."""
    return MomentumBuffer(beta=beta, lr_scale=1.0 / (1.0 - beta)) if beta > 0 else None


# --------------------------------------------------------------------------- conflict-aware server momentum


def agreement_gain(agreement, threshold: float, damping: float = 1.0) -> np.ndarray:
    r"""Per-coordinate multiplier in ``[damping, 1]`` from the sites' sign agreement.

    .. math::  g = \gamma + (1 - \gamma)\,\min(1, A / \tau)

    with :math:`\gamma` = ``damping``: 1 where :math:`A \ge \tau` (no conflict), falling
    linearly to :math:`\gamma` at :math:`A = 0` (an even split). ``damping = 1`` (or
    ``threshold = 0``) gives 1 everywhere.
    """
    if not (0.0 <= threshold <= 1.0):
        raise ValueError(f"Invalid threshold: {threshold}")
    if not (0.0 <= damping <= 1.0):
        raise ValueError(f"Invalid damping: {damping}")
    a = np.asarray(agreement, dtype=np.float64)
    if threshold == 0.0 or damping == 1.0:
        return np.ones_like(a)
    return damping + (1.0 - damping) * np.minimum(1.0, a / threshold)


class RestartMomentum(MomentumBuffer):
    r"""Heavy-ball server momentum that restarts, per coordinate, when it meets a conflict.

    Per array name, with this round's weighted mean delta :math:`\bar d_t`, a gain
    :math:`g_t` (:func:`agreement_gain`; 1 if not given), momentum :math:`\beta` and scale
    :math:`\eta` (``lr_scale``, FedAvgM's server learning rate):

    .. math::

        r_t = [\, v_{t-1} \odot \bar d_t < 0 \,]\,[\, A_t \ge \rho \,] \quad
        \text{(the buffer points against what the sites now agree on)}

        v_t = \beta\,(1 - r_t) \odot v_{t-1} + g_t \odot \bar d_t, \qquad v_0 = 0

        u_t = \eta\, v_t \quad \text{(returned, added to the global model)}

    Where the buffer and the round's aggregate agree in sign it is FedAvgM's heavy ball
    (steady progress amplified up to :math:`1/(1-\beta)`); where they conflict, the stale
    momentum is dropped and the coordinate takes this round's aggregate alone (adaptive
    restart, O'Donoghue & Candes 2015, applied per coordinate). This keeps heavy-ball's
    feedback — every correction the sites send enters the same buffer — while a coordinate
    that has overshot stops being pushed further. ``restart=False`` and no gain is FedAvgM
    exactly.

    :math:`A_t` is the sites' sign agreement (:func:`sign_agreement`) and :math:`\rho`
    ``restart_agreement``: with :math:`\rho > 0` a coordinate restarts only where the
    sites agree, among themselves, on the direction that opposes the buffer; where they
    split, a flip of the round's mean is noise of which sites happened to push harder,
    and the momentum is kept (heavy ball). :math:`\rho = 0` (or no agreement given)
    restarts wherever the mean opposes the buffer.
    """

    def __init__(self, beta: float = 0.9, lr_scale: float = 1.0, restart: bool = True,
                 restart_agreement: float = 0.0) -> None:
        super().__init__(beta=beta, lr_scale=lr_scale)
        if not (0.0 <= restart_agreement <= 1.0):
            raise ValueError(f"Invalid restart_agreement value: {restart_agreement}")
        self.restart = bool(restart)
        self.restart_agreement = float(restart_agreement)
        self.last_restart_share = 0.0  # share of coordinates restarted by the last step

    def step(  # type: ignore[override]
        self,
        mean: Mapping[str, np.ndarray],
        gain: Mapping[str, np.ndarray] | None = None,
        agreement: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Fold ``mean`` (times ``gain[name]`` if given) into the buffers; return ``u_t``.
        ``agreement[name]``: the sites' sign agreement, for ``restart_agreement``."""
        out = {}
        restarted = total = 0
        for name, d in mean.items():
            d = np.asarray(d)
            dtype = np.result_type(d.dtype, np.float32)
            v = self._buffers.get(name)
            if v is None:
                v = np.zeros(d.shape, dtype=dtype)
            elif v.shape != d.shape:
                raise ValueError(f"Invalid mean[{name!r}]: shape {d.shape} != buffer shape {v.shape}")
            g = 1.0 if gain is None else np.asarray(gain[name])
            keep = self.beta * v
            if self.restart:
                opposed = (v * d) < 0
                if agreement is not None and self.restart_agreement > 0:
                    opposed &= np.asarray(agreement[name]) >= self.restart_agreement
                restarted += int(np.count_nonzero(opposed))
                keep = np.where(opposed, 0.0, keep)
            total += v.size
            v = np.asarray(keep + g * d, dtype=v.dtype)
            self._buffers[name] = v
            out[name] = np.asarray(self.lr_scale * v)
        self.last_restart_share = restarted / total if total else 0.0
        return out


def conflict_momentum_aggregate(
    deltas: Sequence[Mapping[str, np.ndarray]],
    weights,
    momentum: RestartMomentum,
    threshold: float,
    damping: float = 1.0,
    agreements: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    r"""Weighted mean of the sites' deltas through conflict-aware server momentum.

    Per array name: :math:`\bar d = \sum_i w_i d_i / \sum_i w_i`, :math:`A` =
    :func:`sign_agreement`, :math:`g` = :func:`agreement_gain` (``threshold``, ``damping``)
    and :math:`\Delta = \mathrm{momentum.step}(\bar d, g, A)` (:class:`RestartMomentum`).

    Unlike :func:`conflict_aware_aggregate` with an agreement buffer, every coordinate goes
    through ONE buffer: splitting agreeing coordinates (amplified up to :math:`1/(1-\beta)`)
    from conflicting ones (a separate damped buffer) routes the sites' corrections of an
    overshoot into the damped buffer while the amplified one keeps pushing — in fedind's
    default run that drove the model to chance level. The result has each array's input dtype.
    ``agreements``: :math:`A` per name when the caller has it.
    """
    w, by_name = _per_array(deltas, weights)
    agreements = agreements if agreements is not None else {n: sign_agreement(a, w) for n, (a, _) in by_name.items()}
    means, gains, dtypes = {}, {}, {}
    for name, (arrays, dtypes[name]) in by_name.items():
        means[name] = np.average(np.stack(arrays), axis=0, weights=w)
        gains[name] = agreement_gain(agreements[name], threshold, damping)
    step = momentum.step(means, gains, agreements)
    return {n: step[n].astype(dtypes[n], copy=False) for n in by_name}
