r"""Sign conflicts between site updates, and the server momentum that handles them: the
conflicting part of the aggregate goes through a momentum buffer, or a heavy-ball momentum
restarts where the sites disagree (pure numpy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = [
    "MomentumBuffer",
    "RestartMomentum",
    "agreement_gain",
    "conflict_aware_aggregate",
    "conflict_momentum_aggregate",
    "heavy_ball",
    "sign_agreement",
    "split_conflicts",
]


def _weights(weights, num_sites: int) -> np.ndarray:
    """Per-site aggregation weights: finite, non-negative, one per site, positive sum."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (num_sites,):
        raise ValueError(f"Invalid weights: expected shape ({num_sites},), got {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"Invalid weights: {w.tolist()}")
    return w


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
