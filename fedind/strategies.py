"""Build the server strategy named in the run config."""

from __future__ import annotations

from flwr.app import MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedMedian, FedProx, FedTrimmedAvg, Krum, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from .config import RunConfig
from .strategy import DWA


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
        min_train_nodes=max(1, round(config.fraction_train * num_sites)),
        min_available_nodes=num_sites,
    )
    if config.strategy == "fedavg":
        return FedAvg(**common)
    if config.strategy == "fedprox":
        return FedProx(proximal_mu=config.proximal_mu, **common)
    if config.strategy == "fedavgm":
        return FedAvgM(
            server_learning_rate=config.server_learning_rate,
            server_momentum=config.server_momentum,
            **common,
        )
    if config.strategy == "fedadam":
        return FedAdam(eta=config.fedadam_eta, eta_l=config.learning_rate, tau=config.fedadam_tau, **common)
    # Flower's robust aggregators (compared under attack in simulations/poisoning.py).
    if config.strategy == "fedmedian":
        return FedMedian(**common)
    if config.strategy == "fedtrimmedavg":
        return FedTrimmedAvg(beta=config.trimmed_beta, **common)
    if config.strategy == "krum":
        return Krum(num_malicious_nodes=config.krum_malicious, **common)
    if config.strategy == "dwa":
        return DWA(
            weighting=config.dwa_weighting,
            temperature=config.dwa_temperature,
            floor=config.dwa_floor,
            conflict_buffer=config.conflict_buffer,
            threshold=config.conflict_threshold,
            momentum=config.conflict_momentum,
            server_momentum=config.server_momentum,
            restart=config.server_restart,
            conflict_damping=config.conflict_damping,
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
