"""DWA: divergence-weighted, conflict-aware aggregation as a Flower Message-API strategy.

The maths is in :mod:`fedind.aggregation`; this class only validates replies, moves
records around and keeps the cross-round state. One training round, server side::

    replies -> drop the invalid ones (logged with the site and the reason)
    w_i     =  dwa_weights(n, histograms, global_hist.distribution(), T, floor)
               (or n_i / N: weighting off, or some site sent no label histogram)
    d_i     =  reply_i - global                                  (per array, float64)
    global  += conflict_momentum_aggregate(d, w, server_buffer, threshold, damping)
               (server_momentum > 0; conflict buffering off: FedAvgM's heavy ball on sum_i w_i d_i)
    global  += conflict_aware_aggregate(d, w, momentum_buffer, threshold)
               (server_momentum = 0; conflict buffering off: the weighted mean sum_i w_i d_i)

``server_momentum > 0`` with conflict buffering is ONE heavy-ball buffer over every
coordinate that restarts, per coordinate, where it points against the round's aggregate
(:class:`~fedind.aggregation.conflicts.RestartMomentum`), the sites' sign conflicts optionally damping
what enters it. (Heavy ball on agreeing coordinates only, conflicting ones through a
separate damped buffer, never learned: the sites' corrections of an overshoot went to the
damped buffer while the amplified one kept pushing.) With equal label distributions,
conflict buffering off and no server momentum this is FedAvg exactly; conflict buffering
off with server momentum is FedAvgM exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from numbers import Real

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy import FedAvg

from .. import wire
from ..records import numpy_arrays
from .pipeline import Rejected, SiteUpdate, decode_reply, update_of
from ..aggregation.conflicts import (
    MomentumBuffer,
    RestartMomentum,
    conflict_aware_aggregate,
    conflict_momentum_aggregate,
    heavy_ball,
    sign_agreement,
)
from ..aggregation.robust import CenteredClipping
from ..aggregation.weighting import class_row_scales, scale_rows, GlobalHistogram, dwa_weights, padded_histogram_state

# DWA reads the number of classes from HEAD_WEIGHT ([num_classes, features]) when none is given.
from ..continual.expansion import HEAD_BIAS, HEAD_WEIGHT

__all__ = ["DWA", "HEAD_WEIGHT", "SiteUpdate"]

_STATE_KEYS = {"global_histogram", "momentum", "server_momentum"}
_ROBUST_KEY = "robust"  # only with centered clipping on: checkpoints of runs without it stay as they were


class DWA(FedAvg):
    r"""Divergence-weighted aggregation with conflict buffering (Flower Message API).

    Each round, for the sites whose replies pass validation (:func:`fedind.server.pipeline.decode_reply`):

    1. **Weights.** With ``weighting`` on, every site's latest label histogram goes into a
       :class:`~fedind.aggregation.weighting.GlobalHistogram` (keyed by site id) and

       .. math::  w = \mathrm{dwa\_weights}(n, P, P_{global}, T, f)

       i.e. :math:`w_i \propto n_i e^{-KL(P_i \| P_{global})/T}`, each site kept at
       :math:`\ge f` times its FedAvg share. With ``weighting`` off, or in a round where
       some reply carries no ``label-histogram`` (a plain Flower ClientApp; logged once),
       :math:`w_i = n_i / N`.
    2. **Update.** :math:`d_i = \theta_i - \theta` (reply minus current global model). With
       ``conflict_buffer`` on, :math:`\theta \leftarrow \theta +
       \mathrm{conflict\_aware\_aggregate}(d, w, \mathrm{buffer}, \tau)`: coordinates whose
       weighted sign agreement is below ``threshold`` go through a momentum buffer
       (``momentum`` = :math:`\beta`), the others take the weighted mean. Off:
       :math:`\theta \leftarrow \theta + \sum_i w_i d_i`, the weighted average of the replies.
       Arrays keep their dtype (integer arrays are rounded).
    3. **Metrics.** Scalar metrics every valid reply carries are averaged weighted by
       ``num-examples`` (as FedAvg; list values such as the label histogram are left out),
       plus ``conflict-share`` (coordinates with agreement below ``threshold`` / all
       coordinates; measured whether or not buffering is on) and ``dwa-weight-min`` /
       ``dwa-weight-max``.

    Invalid replies are logged (WARNING, with site id and reason) and dropped; when none is
    left, :meth:`aggregate_train` returns ``(None, None)`` and the global model stays.
    Cross-round state (global histogram, momentum buffers) is saved and restored through
    :meth:`state_dict` / :meth:`load_state_dict`.

    Parameters
    ----------
    weighting : bool
        DWA weights (True) or example-count weights (False).
    temperature : float
        :math:`T > 0`; larger = closer to FedAvg weights.
    floor : float
        :math:`f \in [0, 1]`: every site keeps at least this share of its FedAvg weight.
    conflict_buffer : bool
        Route sign-conflicting coordinates through the momentum buffer.
    threshold : float
        :math:`\tau \in [0, 1]`: sign agreement below it is a conflict.
    momentum : float
        :math:`\beta \in [0, 1)` of the conflict momentum buffer.
    server_momentum : float
        :math:`\beta_s \in [0, 1)` of heavy-ball server momentum (0 = off). With
        ``conflict_buffer`` it replaces the conflict buffer: :class:`RestartMomentum`.
    restart : bool
        With server momentum and ``conflict_buffer``: drop a coordinate's momentum where it
        points against the round's weighted mean delta (adaptive restart).
    restart_agreement : float
        :math:`\rho \in [0, 1]`, with ``restart``: restart a coordinate only where the sites'
        sign agreement is at least :math:`\rho` (0 = wherever the mean opposes the buffer).
    conflict_damping : float
        :math:`\gamma \in [0, 1]`, with server momentum and ``conflict_buffer``: what enters
        the buffer is scaled by :math:`\gamma + (1-\gamma)\min(1, A/\tau)` (1 = no damping).
    robust : CenteredClipping, optional
        Centered clipping over random buckets (:mod:`fedind.aggregation.robust`): the
        round's deltas and weights become the clipped bucket means and the bucket weights
        (sums of the members' weights) before step 2. None: off.
    num_classes : int, optional
        Length of a valid label histogram. None: read from the global model at the first
        :meth:`configure_train` (first dimension of its ``head.weight`` array).
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, \
min_available_nodes, train_metrics_aggr_fn, evaluate_metrics_aggr_fn
        As :class:`flwr.serverapp.strategy.FedAvg`. Records use the keys of
        :mod:`fedind.wire`.
    """

    follows_grown_head = True  # fedind.server.strategies.edit_strategy_state: its label histograms grow with the head

    # pylint: disable=too-many-arguments
    def __init__(
        self,
        *,
        weighting: bool = True,
        temperature: float = 1.0,
        floor: float = 0.1,
        conflict_buffer: bool = True,
        threshold: float = 0.3,
        momentum: float = 0.9,
        server_momentum: float = 0.0,
        restart: bool = True,
        conflict_damping: float = 1.0,
        restart_agreement: float = 0.0,
        robust: CenteredClipping | None = None,
        num_classes: int | None = None,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
        evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
    ) -> None:
        for name, value in (("weighting", weighting), ("conflict_buffer", conflict_buffer), ("restart", restart)):
            if not isinstance(value, bool):
                raise ValueError(f"Invalid {name} value: {value!r} (expected True or False)")
        if not (_is_real(temperature) and temperature > 0):
            raise ValueError(f"Invalid temperature value: {temperature!r}")
        if not (_is_real(floor) and 0.0 <= floor <= 1.0):
            raise ValueError(f"Invalid floor value: {floor!r}")
        if not (_is_real(threshold) and 0.0 <= threshold <= 1.0):
            raise ValueError(f"Invalid threshold value: {threshold!r}")
        if not (_is_real(momentum) and 0.0 <= momentum < 1.0):
            raise ValueError(f"Invalid momentum value: {momentum!r}")
        if not (_is_real(server_momentum) and 0.0 <= server_momentum < 1.0):
            raise ValueError(f"Invalid server_momentum value: {server_momentum!r}")
        if not (_is_real(conflict_damping) and 0.0 <= conflict_damping <= 1.0):
            raise ValueError(f"Invalid conflict_damping value: {conflict_damping!r}")
        if not (_is_real(restart_agreement) and 0.0 <= restart_agreement <= 1.0):
            raise ValueError(f"Invalid restart_agreement value: {restart_agreement!r}")
        if robust is not None and not isinstance(robust, CenteredClipping):
            raise ValueError(f"Invalid robust value: {robust!r} (expected a CenteredClipping or None)")
        if num_classes is not None and not (_is_int(num_classes) and num_classes >= 1):
            raise ValueError(f"Invalid num_classes value: {num_classes!r}")
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=wire.NUM_EXAMPLES,
            arrayrecord_key=wire.ARRAYS,
            configrecord_key=wire.CONFIG,
            train_metrics_aggr_fn=train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
        )
        self.weighting = weighting
        self.temperature = float(temperature)
        self.floor = float(floor)
        self.conflict_buffer = conflict_buffer
        self.threshold = float(threshold)
        self.momentum = float(momentum)
        self.num_classes: int | None = None if num_classes is None else int(num_classes)
        self.current_arrays: ArrayRecord | None = None
        # Created once num_classes is known (here, or at the first configure_train).
        self.global_histogram: GlobalHistogram | None = (
            None if num_classes is None else GlobalHistogram(int(num_classes))
        )
        self.buffer = MomentumBuffer(beta=self.momentum)
        self.server_momentum = float(server_momentum)
        self.restart = restart
        self.conflict_damping = float(conflict_damping)
        self.restart_agreement = float(restart_agreement)
        self.robust = robust
        # First class whose head rows are averaged over the sites holding it (average_over_holders)
        self.holder_rows_from: int | None = None
        self.server_buffer = self._new_server_buffer()
        self._fallback_logged = False

    def _new_server_buffer(self) -> MomentumBuffer | None:
        """FedAvgM's heavy ball, conflict-aware (restart) with the conflict buffer on; None for 0."""
        if self.server_momentum <= 0:
            return None
        if self.conflict_buffer:
            return RestartMomentum(
                beta=self.server_momentum, restart=self.restart, restart_agreement=self.restart_agreement
            )
        return heavy_ball(self.server_momentum)

    def average_over_holders(self, first: int | None) -> None:
        """From the next round, average the head rows of classes ``first`` on over the sites
        that hold each class (:func:`~fedind.aggregation.weighting.class_row_scales`), the others over
        all sites; None: all over all sites. For the rows a phase grew (``young-rows =
        holders``): averaged over all sites, the one line that holds a new class moves its
        row by its share of the weights, and a site without the class sends that row almost
        no gradient under logit adjustment."""
        if first is not None and not (_is_int(first) and first >= 0):
            raise ValueError(f"Invalid first class: {first!r}")
        self.holder_rows_from = first

    def follow_global_model(
        self, arrays: ArrayRecord, edit: Callable[[dict], dict] | None = None, num_classes: int | None = None
    ) -> None:
        """``arrays`` (the server edited the global model after this strategy's step) is the
        model the next replies are compared to; ``edit`` (None: leave them) maps the momentum
        buffers (name -> array); ``num_classes``: the head grew, the label histograms get
        zero counts for the new classes."""
        self.current_arrays = arrays  # first: load_state_dict checks the buffers against it
        if edit is None:
            return
        state = self.state_dict()
        histogram = state["global_histogram"]
        if histogram is not None and num_classes is not None:
            histogram = padded_histogram_state(histogram, num_classes)
        state = {
            "global_histogram": histogram,
            "momentum": {"buffers": edit(state["momentum"]["buffers"])},
            "server_momentum": None
            if state["server_momentum"] is None
            else {"buffers": edit(state["server_momentum"]["buffers"])},
        } | ({_ROBUST_KEY: {"center": edit(state[_ROBUST_KEY]["center"])}} if self.robust is not None else {})
        if num_classes is not None:
            self.num_classes = num_classes
        self.load_state_dict(state)

    # ------------------------------------------------------------------ Flower hooks

    def summary(self) -> None:
        """Log the DWA settings, then FedAvg's."""
        log(INFO, "\t├──> DWA settings:")
        log(
            INFO,
            "\t│\t├── Weighting: %s (temperature %s, floor %s)",
            "DWA" if self.weighting else "example counts",
            self.temperature,
            self.floor,
        )
        log(
            INFO,
            "\t│\t├── Conflict buffer: %s (threshold %s, momentum %s)",
            "ON" if self.conflict_buffer else "OFF",
            self.threshold,
            self.momentum,
        )
        log(
            INFO,
            "\t│\t├── Server momentum: %s%s",
            self.server_momentum or "OFF",
            f" (conflict-aware: restart {'ON' if self.restart else 'OFF'} where sign agreement >= "
            f"{self.restart_agreement}, damping {self.conflict_damping})"
            if self.server_momentum and self.conflict_buffer
            else "",
        )
        if self.robust is not None:
            log(INFO, "\t│\t├── Centered clipping: radius %s x the median bucket distance, buckets of %d",
                self.robust.radius, self.robust.bucket_size)
        log(INFO, "\t│\t└── Classes: %s", self.num_classes if self.num_classes else "from the global model")
        super().summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the global arrays the replies will be compared to, then as FedAvg."""
        self._check_model(arrays)
        self.current_arrays = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, weight them, apply the (conflict-aware) mean delta."""
        if self.current_arrays is None or self.global_histogram is None:
            raise AggregationError(
                "DWA has no global arrays: configure_train must run before aggregate_train."
            )
        # Flower's checks split off error replies (and log them); each reply's typed update
        # is the pipeline's (fedind.server.pipeline), decoded here only without one.
        replies, _ = self._check_and_log_replies(list(replies), is_train=True, validate=False)
        current = numpy_arrays(self.current_arrays)
        updates = []
        for reply in replies:
            try:
                updates.append(update_of(reply, lambda r: decode_reply(None, r, current, num_classes=self.num_classes)))
            except Rejected as err:
                log(WARNING, "aggregate_train: round %d: dropped the reply of node %d: %s",
                    server_round, reply.metadata.src_node_id, err)
        return self.aggregate_updates(server_round, updates)

    def aggregate_updates(
        self, server_round: int, updates: list[SiteUpdate]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weight the round's typed updates, apply the (conflict-aware) mean delta."""
        current = numpy_arrays(self.current_arrays)
        updates = self._aggregated(server_round, updates)
        if not updates:
            log(WARNING, "aggregate_train: round %d has no valid reply; the global model stays", server_round)
            return None, None

        weights = self._weights(updates, self.global_histogram)
        deltas = [{name: u.delta[name] for name in current} for u in updates]
        agreements = {name: sign_agreement([d[name] for d in deltas], weights) for name in current}
        if self.holder_rows_from is not None and all(u.histogram is not None for u in updates):
            scales = class_row_scales(weights, [u.histogram for u in updates])
            scales[:, : self.holder_rows_from] = 1.0  # older classes: the site weights
            deltas = scale_rows(deltas, scales, [n for n in (HEAD_WEIGHT, HEAD_BIAS) if n in current])
        if self.robust is not None:  # each bucket's pull bounded around the server's history
            deltas, weights = self.robust.transform(deltas, weights, server_round)
        if self.conflict_buffer and isinstance(self.server_buffer, RestartMomentum):
            step = conflict_momentum_aggregate(
                deltas, weights, self.server_buffer, self.threshold, self.conflict_damping, agreements
            )
        elif self.conflict_buffer:
            step = conflict_aware_aggregate(deltas, weights, self.buffer, self.threshold, agreements)
        else:
            step = {
                name: np.average(np.stack([d[name] for d in deltas]), axis=0, weights=weights)
                for name in current
            }
            if self.server_buffer is not None:
                step = self.server_buffer.step(step)
        new = ArrayRecord(
            {name: Array(_cast_like(current[name] + step[name], current[name].dtype)) for name in current}
        )
        self.current_arrays = new

        metrics = self._aggregate_metrics(updates)
        flagged = sum(int(np.count_nonzero(a < self.threshold)) for a in agreements.values())
        metrics[wire.CONFLICT_SHARE] = flagged / max(sum(a.size for a in agreements.values()), 1)
        metrics[wire.DWA_WEIGHT_MIN] = float(weights.min())
        metrics[wire.DWA_WEIGHT_MAX] = float(weights.max())
        if self.robust is not None:
            metrics[wire.CCLIP_SHARE] = self.robust.last_clipped_share
        if isinstance(self.server_buffer, RestartMomentum):
            metrics[wire.RESTART_SHARE] = float(self.server_buffer.last_restart_share)
        return new, metrics

    # ------------------------------------------------------------------ which updates count

    def _aggregated(self, server_round: int, updates: list[SiteUpdate]) -> list[SiteUpdate]:
        """The updates that carry weight: not a no-update, one per site id (the first)."""
        kept: list[SiteUpdate] = []
        seen: set[str] = set()
        for u in updates:
            if not u.has_update:
                log(INFO, "aggregate_train: round %d: site %s trained on no windows (all of its classes are "
                    "new to the model); it carries no weight", server_round, u.site_id)
                continue
            if u.site_id in seen:
                log(WARNING, "aggregate_train: round %d: dropped the reply of site %s (node %d): another reply of "
                    "this round already came from this site id", server_round, u.site_id, u.node_id)
                continue
            seen.add(u.site_id)
            kept.append(u)
        return kept

    def _check_model(self, arrays: ArrayRecord) -> None:
        """Learn num_classes from the model if needed; a loaded buffer must fit the model."""
        if self.num_classes is None:
            head = arrays.get(HEAD_WEIGHT)
            if head is None or len(head.shape) < 1 or head.shape[0] < 1:
                raise ValueError(
                    f"DWA needs the number of classes: pass num_classes=..., or use a global "
                    f"model with a {HEAD_WEIGHT!r} array of shape [num_classes, ...]"
                )
            self.num_classes = int(head.shape[0])
            log(INFO, "DWA: %d classes (from the global model's %r)", self.num_classes, HEAD_WEIGHT)
        if self.global_histogram is None:
            self.global_histogram = GlobalHistogram(self.num_classes)
        for name, v in self.buffer.state_dict()["buffers"].items():
            if name not in arrays or tuple(arrays[name].shape) != v.shape:
                raise ValueError(
                    f"Invalid momentum buffer {name!r} (shape {v.shape}): the global model "
                    f"has {tuple(arrays[name].shape) if name in arrays else 'no such array'}"
                )

    # ------------------------------------------------------------------ weights, metrics

    def _weights(self, updates: list[SiteUpdate], histogram: GlobalHistogram) -> np.ndarray:
        n = np.array([u.num_examples for u in updates], dtype=np.float64)
        if not self.weighting:
            return n / n.sum()
        for u in updates:
            if u.histogram is not None:
                histogram.update(u.site_id, u.histogram)
        without = [u.site_id for u in updates if u.histogram is None]
        if without:
            if not self._fallback_logged:
                log(
                    WARNING,
                    "DWA: site(s) %s sent no %r; weighting by example counts in every round "
                    "where a site has none (logged once)",
                    ", ".join(without), wire.LABEL_HISTOGRAM,
                )
                self._fallback_logged = True
            return n / n.sum()
        return dwa_weights(
            n,
            [u.histogram for u in updates],
            histogram.distribution(),
            temperature=self.temperature,
            floor=self.floor,
        )

    def _aggregate_metrics(self, updates: list[SiteUpdate]) -> MetricRecord:
        """Scalar metrics that every reply carries, through ``train_metrics_aggr_fn``."""
        keys = set.intersection(
            *({k for k, v in u.metrics.items() if not isinstance(v, list)} for u in updates)
        )
        records = [
            RecordDict({wire.METRICS: MetricRecord({k: v for k, v in u.metrics.items() if k in keys})})
            for u in updates
        ]
        return self.train_metrics_aggr_fn(records, self.weighted_by_key)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """``{"global_histogram": dict | None, "momentum": {"buffers": {name: ndarray}}}``.

        Hyperparameters come from the run config; the current global arrays are the
        server's checkpoint, not the strategy's.
        """
        return {
            "global_histogram": None if self.global_histogram is None else self.global_histogram.state_dict(),
            "momentum": self.buffer.state_dict(),
            "server_momentum": None if self.server_buffer is None else self.server_buffer.state_dict(),
        } | ({_ROBUST_KEY: self.robust.state_dict()} if self.robust is not None else {})

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`; everything is validated before ``self`` changes."""
        expected = _STATE_KEYS | ({_ROBUST_KEY} if self.robust is not None else set())
        if not isinstance(state, Mapping) or set(state) != expected:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"Invalid DWA state: expected keys {sorted(expected)}, got {keys}")
        if self.robust is not None:  # checked before self changes: a copy takes the state first
            CenteredClipping(self.robust.radius).load_state_dict(state[_ROBUST_KEY])
        histogram = None
        if state["global_histogram"] is not None:
            hist_state = state["global_histogram"]
            if not isinstance(hist_state, Mapping):
                raise ValueError(f"Invalid DWA state: global_histogram is a {type(hist_state).__name__}")
            num_classes = hist_state.get("num_classes")
            if not (_is_int(num_classes) and num_classes >= 1):
                raise ValueError(f"Invalid num_classes in DWA state: {num_classes!r}")
            if self.num_classes is not None and num_classes != self.num_classes:
                raise ValueError(
                    f"Invalid num_classes in DWA state: {num_classes} (this strategy has {self.num_classes})"
                )
            histogram = GlobalHistogram(int(num_classes))
            histogram.load_state_dict(hist_state)
        buffer = MomentumBuffer(beta=self.momentum)
        if not isinstance(state["momentum"], Mapping):
            raise ValueError(f"Invalid DWA state: momentum is a {type(state['momentum']).__name__}")
        buffer.load_state_dict(state["momentum"])
        server_buffer = self._new_server_buffer()
        if (state["server_momentum"] is None) != (server_buffer is None):
            raise ValueError("Invalid DWA state: server momentum state does not match server_momentum setting")
        if server_buffer is not None:
            server_buffer.load_state_dict(state["server_momentum"])
        if self.current_arrays is not None:
            for name, v in buffer.state_dict()["buffers"].items():
                array = self.current_arrays.get(name)
                if array is None or tuple(array.shape) != v.shape:
                    raise ValueError(f"Invalid momentum buffer {name!r}: does not fit the global model")
        if histogram is not None:
            self.num_classes = histogram.num_classes
            self.global_histogram = histogram
        elif self.num_classes is not None:
            self.global_histogram = GlobalHistogram(self.num_classes)
        self.buffer = buffer
        self.server_buffer = server_buffer
        if self.robust is not None:
            self.robust.load_state_dict(state[_ROBUST_KEY])


# ---------------------------------------------------------------------- helpers


def _is_real(x) -> bool:
    """A finite real number (bool is not a number here)."""
    return isinstance(x, Real) and not isinstance(x, bool) and bool(np.isfinite(x))


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _cast_like(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` in the global array's dtype (integer arrays such as counters are rounded)."""
    value = np.asarray(value)
    if np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_):
        value = np.rint(value)
    return value.astype(dtype, copy=False)
