"""Build the server strategy named in the run config."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp import strategy as flwr_strategy
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from ..aggregation.robust import CenteredClipping
from ..config import DWA_STRATEGIES, RunConfig
from ..records import numpy_arrays
from ..continual.expansion import pad_head_rows, zero_head_rows
from .dwa import DWA


# ---------------------------------------------------------------------- Flower's built-ins
# Thin subclasses: each takes the pipeline's replies (fedind.server.pipeline; a reply whose
# typed update is "no update" carries nothing to average) and keeps its own state, saved and
# edited only through its methods: state_dict / load_state_dict (the checkpoint) and
# follow_global_model (the server edited the global model after the strategy's step).

Edit = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


class _Typed:
    """Flower's ``aggregate_train`` over the replies that carry an update."""

    def aggregate_train(self, server_round: int, replies):
        kept = [r for r in replies if getattr(getattr(r, "update", None), "has_update", True)]
        return super().aggregate_train(server_round, kept)

    def state_dict(self) -> dict:
        return {}  # stateless between rounds

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)}")

    def follow_global_model(self, arrays: ArrayRecord, edit: Edit | None = None) -> None:
        """Nothing to follow: the strategy steps from what configure_train gets."""


class FedAvg(_Typed, flwr_strategy.FedAvg):
    pass


class FedProx(_Typed, flwr_strategy.FedProx):
    pass


class FedMedian(_Typed, flwr_strategy.FedMedian):
    pass


class FedTrimmedAvg(_Typed, flwr_strategy.FedTrimmedAvg):
    pass


class Krum(_Typed, flwr_strategy.Krum):
    pass


class FedAvgM(_Typed, flwr_strategy.FedAvgM):
    """Flower's FedAvgM; its momentum (a list aligned with the arrays) saved and edited here."""

    def state_dict(self) -> dict:
        return {"momentum_vector": self.momentum_vector}

    def load_state_dict(self, state: dict) -> None:
        vector = state["momentum_vector"]
        self.momentum_vector = None if vector is None else [np.asarray(v) for v in vector]

    def follow_global_model(self, arrays: ArrayRecord, edit: Edit | None = None) -> None:
        """``arrays`` is the model to step from; ``edit`` maps the momentum (name -> array).
        FedAvgM keeps its own copy of the model from the round before: an edit it did not
        see would enter its pseudo-gradient, and momentum would repeat it round after round."""
        if edit is not None and self.momentum_vector is not None:
            names = list(arrays.keys())
            edited = edit(dict(zip(names, self.momentum_vector, strict=True)))
            self.momentum_vector = [edited[name] for name in names]
        self.current_arrays = arrays


class FedAdam(_Typed, flwr_strategy.FedAdam):
    """Flower's FedAdam; its first and second moments saved and edited here."""

    def state_dict(self) -> dict:
        return {"m_t": self.m_t, "v_t": self.v_t}

    def load_state_dict(self, state: dict) -> None:
        self.m_t = None if state["m_t"] is None else {k: np.asarray(v) for k, v in state["m_t"].items()}
        self.v_t = None if state["v_t"] is None else {k: np.asarray(v) for k, v in state["v_t"].items()}

    def follow_global_model(self, arrays: ArrayRecord, edit: Edit | None = None) -> None:
        if edit is not None:
            self.m_t = None if self.m_t is None else edit(self.m_t)
            self.v_t = None if self.v_t is None else edit(self.v_t)
        self.current_arrays = numpy_arrays(arrays)


class TrimmedFedAvgM(FedAvgM, flwr_strategy.FedTrimmedAvg):
    """FedAvgM's server momentum over FedTrimmedAvg's coordinate-wise trimmed mean.

    Flower's robust aggregators drop what server momentum gives on Non-IID sites, and
    FedAvgM trusts every site: here ``FedAvgM.aggregate_train``'s average is the trimmed
    mean (the MRO puts FedTrimmedAvg between FedAvgM and FedAvg), then momentum applies.
    Momentum over a robust aggregate is the recipe of Karimireddy et al. 2021, "Learning
    from History for Byzantine Robust Optimization"."""

    def __init__(self, *, beta: float, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= beta < 0.5:
            raise ValueError(f"Invalid beta {beta!r}: must be in [0, 0.5)")
        self.beta = beta


def build_strategy(config: RunConfig, num_sites: int, num_classes: int | None = None) -> Strategy:
    """Flower's own strategies and fedind's ``dwa``, configured for this federation.

    ``num_classes`` is the length of a valid label histogram (``dwa`` only); None reads it
    from the global model when the first round starts.

    Site-side evaluation rides on the training replies (each site scores the global model it
    received before training on it), so Flower's separate evaluate phase is off
    (``fraction_evaluate=0``); the server sends one evaluate round after the last round.
    """
    common = dict(
        train_metrics_aggr_fn=average_scalar_metrics,
        fraction_train=config.fraction_train,
        fraction_evaluate=0.0,
        # A round starts with the sites connected (at least min-sites; the server waited for
        # all before round 1): a site that stays down must not stall the run.
        min_train_nodes=config.min_sites,
        min_available_nodes=config.min_sites,
    )
    if config.strategy == "fedavg":
        return FedAvg(**common)
    if config.strategy == "fedprox":
        return FedProx(proximal_mu=config.proximal_mu, **common)
    server_step = dict(server_learning_rate=config.server_learning_rate, server_momentum=config.server_momentum)
    if config.strategy == "fedavgm":
        return FedAvgM(**server_step, **common)
    if config.strategy == "fedadam":
        return FedAdam(eta=config.fedadam_eta, eta_l=config.learning_rate, tau=config.fedadam_tau, **common)
    # Flower's robust aggregators (compared under attack in simulations/poisoning.py).
    if config.strategy == "fedmedian":
        return FedMedian(**common)
    if config.strategy == "fedtrimmedavg":
        return FedTrimmedAvg(beta=config.trimmed_beta, **common)
    if config.strategy == "trimmedavgm":
        return TrimmedFedAvgM(beta=config.trimmed_beta, **server_step, **common)
    if config.strategy == "krum":
        return Krum(num_malicious_nodes=config.krum_malicious, **common)
    if config.strategy in DWA_STRATEGIES:
        return DWA(
            weighting=config.dwa_weighting,
            temperature=config.dwa_temperature,
            floor=config.dwa_floor,
            conflict_buffer=config.conflict_buffer,
            threshold=config.conflict_threshold,
            momentum=config.conflict_momentum,
            server_momentum=config.dwa_momentum,
            restart=config.server_restart,
            conflict_damping=config.conflict_damping,
            restart_agreement=config.restart_agreement,
            robust=CenteredClipping(config.cclip_radius, config.cclip_bucket, beta=config.dwa_momentum, seed=config.seed)
            if config.cclip_radius > 0 else None,
            num_classes=num_classes,
            **common,
        )
    raise ValueError(f"unknown strategy {config.strategy!r}")  # RunConfig already checked it


def average_scalar_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """Flower's weighted average over the scalar metrics only: a label histogram belongs to
    its site, and its average means nothing (nor is it worth logging every round)."""
    scalar = [
        RecordDict(
            {
                name: MetricRecord({k: v for k, v in metrics.items() if not isinstance(v, list)})
                for name, metrics in record.metric_records.items()
            }
        )
        for record in records
    ]
    return aggregate_metricrecords(scalar, weight_key)


# ---------------------------------------------------------------------- checkpoint state
# What a strategy carries from round to round, beyond the global arrays (which the server
# checkpoints itself and hands back to configure_train on resume).


def strategy_state(strategy: Strategy) -> dict:
    """The strategy's cross-round state as JSON values and numpy arrays (its ``state_dict``;
    fedind's own strategies under ``state_dict``, as checkpoints have it)."""
    if isinstance(strategy, _Typed):  # Flower's built-ins: momentum_vector, m_t / v_t, or nothing
        return strategy.state_dict()
    if callable(getattr(strategy, "state_dict", None)):  # fedind's dwa and SecureAggregation
        return {"state_dict": strategy.state_dict()}
    return {}  # a Strategy fedind did not build keeps what it keeps


def load_strategy_state(strategy: Strategy, state: dict) -> None:
    """Restore :func:`strategy_state`; ValueError when it does not fit this strategy."""
    expected = set(strategy_state(strategy))
    if set(state) != expected:
        raise ValueError(f"checkpointed strategy state has {sorted(state)}, this strategy needs {sorted(expected)}")
    if isinstance(strategy, _Typed):
        strategy.load_state_dict(state)
    elif "state_dict" in state:
        strategy.load_state_dict(state["state_dict"])


# ---------------------------------------------------------------------- edits of the global model
# The server may change the global model after the strategy's step (a grown head, refitted
# young rows, EWC damping). The strategy must step from the edited model next round
# (its follow_global_model): an edit d it did not see adds up to d / (1 - beta) under momentum.


def adopt_global_model(strategy: Strategy, arrays: ArrayRecord) -> None:
    """Make ``arrays`` (edited after the strategy's step) the model ``strategy`` steps from."""
    edit_strategy_state(strategy, arrays, None)


def grow_strategy_classes(strategy: Strategy, arrays: ArrayRecord, num_classes: int) -> None:
    """The head of the global model grew to ``num_classes`` (``arrays``, already grown):
    pad every piece of the strategy's cross-round state that follows it, with zeros
    (:func:`fedind.continual.expansion.pad_head_rows`: no momentum, no moments, no label counts yet
    for the new classes), and make ``arrays`` the strategy's current model."""
    edit_strategy_state(strategy, arrays, lambda state: pad_head_rows(state, num_classes), num_classes)


def reset_strategy_rows(strategy: Strategy, arrays: ArrayRecord, classes) -> None:
    """The head rows of ``classes`` in ``arrays`` were set outside the strategy (a site's fit
    replaced the average): zero their momentum and moments
    (:func:`fedind.continual.expansion.zero_head_rows`: the steps they hold were not taken) and make
    ``arrays`` the strategy's current model."""
    edit_strategy_state(strategy, arrays, lambda state: zero_head_rows(state, classes))


def edit_strategy_state(strategy: Strategy, arrays: ArrayRecord, edit: Edit | None, num_classes: int | None = None) -> None:
    """Tell the strategy (its ``follow_global_model``) that ``arrays`` is its current model
    and ``edit`` (None: leave it) maps its cross-round state aligned with the arrays;
    ``num_classes``: the head grew (DWA pads its label histograms). A strategy that keeps
    state and has no such method is a ValueError (RunConfig refuses such combinations)."""
    if getattr(strategy, "follows_grown_head", False):  # DWA, SecureAggregation: their label histograms grow too
        strategy.follow_global_model(arrays, edit, num_classes)
    elif isinstance(strategy, _Typed):
        strategy.follow_global_model(arrays, edit)
    elif strategy_state(strategy):
        raise ValueError(f"{type(strategy).__name__} keeps state an edit of the global model cannot follow")
