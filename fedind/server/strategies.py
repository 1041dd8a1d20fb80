"""Build the server strategy named in the run config."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedMedian, FedProx, FedTrimmedAvg, Krum, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from ..aggregation.robust import CenteredClipping
from ..config import DWA_STRATEGIES, RunConfig
from ..continual.expansion import pad_head_rows, zero_head_rows
from .dwa import DWA


class TrimmedFedAvgM(FedAvgM, FedTrimmedAvg):
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
    """The strategy's cross-round state as JSON values and numpy arrays."""
    if callable(getattr(strategy, "state_dict", None)):  # fedind's dwa and SecureAggregation
        return {"state_dict": strategy.state_dict()}
    if isinstance(strategy, FedAvgM):  # server momentum, a list aligned with the arrays
        return {"momentum_vector": strategy.momentum_vector}
    if isinstance(strategy, FedAdam):  # first and second moments
        return {"m_t": strategy.m_t, "v_t": strategy.v_t}
    return {}  # fedavg, fedprox, fedmedian, fedtrimmedavg, krum: stateless between rounds


def load_strategy_state(strategy: Strategy, state: dict) -> None:
    """Restore :func:`strategy_state`; ValueError when it does not fit this strategy."""
    expected = set(strategy_state(strategy))
    if set(state) != expected:
        raise ValueError(f"checkpointed strategy state has {sorted(state)}, this strategy needs {sorted(expected)}")
    if "state_dict" in state:
        strategy.load_state_dict(state["state_dict"])
    elif isinstance(strategy, FedAvgM):
        vector = state["momentum_vector"]
        strategy.momentum_vector = None if vector is None else [np.asarray(v) for v in vector]
    elif isinstance(strategy, FedAdam):
        strategy.m_t = None if state["m_t"] is None else {k: np.asarray(v) for k, v in state["m_t"].items()}
        strategy.v_t = None if state["v_t"] is None else {k: np.asarray(v) for k, v in state["v_t"].items()}


# ---------------------------------------------------------------------- edits of the global model
# The server may change the global model after the strategy's step (a grown head, refitted
# young rows, EWC damping). The strategy must step from the edited model next round:
# FedAvgM keeps its own copy from the round before, and an edit it did not see would enter
# its pseudo-gradient as if its own step had made it, and momentum would repeat it round
# after round (an edit d adds up to d / (1 - beta), 10 d at beta = 0.9).


def adopt_global_model(strategy: Strategy, arrays: ArrayRecord) -> None:
    """Make ``arrays`` (edited after the strategy's step) the model ``strategy`` steps from."""
    _edit_strategy_state(strategy, arrays, None)


def grow_strategy_classes(strategy: Strategy, arrays: ArrayRecord, num_classes: int) -> None:
    """The head of the global model grew to ``num_classes`` (``arrays``, already grown):
    pad every piece of the strategy's cross-round state that follows it, with zeros
    (:func:`fedind.continual.expansion.pad_head_rows`: no momentum, no moments, no label counts yet
    for the new classes), and make ``arrays`` the strategy's current model."""
    _edit_strategy_state(strategy, arrays, lambda state: pad_head_rows(state, num_classes), num_classes)


def reset_strategy_rows(strategy: Strategy, arrays: ArrayRecord, classes) -> None:
    """The head rows of ``classes`` in ``arrays`` were set outside the strategy (a site's fit
    replaced the average): zero their momentum and moments
    (:func:`fedind.continual.expansion.zero_head_rows`: the steps they hold were not taken) and make
    ``arrays`` the strategy's current model."""
    _edit_strategy_state(strategy, arrays, lambda state: zero_head_rows(state, classes))


def _edit_strategy_state(
    strategy: Strategy,
    arrays: ArrayRecord,
    edit: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None,
    num_classes: int | None = None,
) -> None:
    """``arrays`` becomes the strategy's current model and ``edit`` (None: leave it) maps
    every piece of its cross-round state aligned with the arrays (name -> array);
    ``num_classes`` (a grown head) also pads DWA's label histograms. Stateless strategies
    need nothing; a strategy whose state this does not know is a ValueError (RunConfig
    refuses such combinations)."""
    names = list(arrays.keys())
    if isinstance(strategy, DWA):
        strategy.current_arrays = arrays  # first: load_state_dict checks the buffers against it
        if edit is not None:  # adoption alone copies no buffers
            state = strategy.state_dict()
            histogram = state["global_histogram"]
            if histogram is not None and num_classes is not None:
                histogram = {
                    "num_classes": num_classes,
                    "sites": {s: list(h) + [0] * (num_classes - len(h)) for s, h in histogram["sites"].items()},
                }
            state = {
                "global_histogram": histogram,
                "momentum": {"buffers": edit(state["momentum"]["buffers"])},
                "server_momentum": None
                if state["server_momentum"] is None
                else {"buffers": edit(state["server_momentum"]["buffers"])},
            } | ({"robust": {"center": edit(state["robust"]["center"])}} if "robust" in state else {})
            if num_classes is not None:
                strategy.num_classes = num_classes
            strategy.load_state_dict(state)
    elif isinstance(strategy, FedAvgM):
        if edit is not None and strategy.momentum_vector is not None:
            edited = edit(dict(zip(names, strategy.momentum_vector, strict=True)))
            strategy.momentum_vector = [edited[name] for name in names]
        strategy.current_arrays = arrays
    elif isinstance(strategy, FedAdam):
        if edit is not None:
            strategy.m_t = None if strategy.m_t is None else edit(strategy.m_t)
            strategy.v_t = None if strategy.v_t is None else edit(strategy.v_t)
        strategy.current_arrays = {name: array.numpy() for name, array in arrays.items()}
    elif strategy_state(strategy):
        raise ValueError(f"{type(strategy).__name__} keeps state an edit of the global model cannot follow")
