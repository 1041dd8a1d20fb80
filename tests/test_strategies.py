"""Run config -> strategy, and the metric averaging every strategy shares."""

import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict
from flwr.serverapp.strategy import FedTrimmedAvg, FedAdam, FedAvg, FedAvgM, FedProx

from fedind import wire
from fedind.config import RunConfig
from fedind.strategies import TrimmedFedAvgM, average_scalar_metrics, build_strategy
from fedind.strategy import DWA


@pytest.mark.parametrize(
    "name, kind",
    [("fedavg", FedAvg), ("fedprox", FedProx), ("fedavgm", FedAvgM), ("fedadam", FedAdam), ("dwa", DWA),
     ("trimmedavgm", TrimmedFedAvgM)],
)
def test_build_strategy_by_name(name, kind):
    strategy = build_strategy(RunConfig(strategy=name), num_sites=4, num_classes=10)
    assert type(strategy) is kind
    # rounds start with the sites connected, at least min-sites: a site that stays down must not stall
    assert strategy.min_available_nodes == strategy.min_train_nodes == 1
    assert strategy.fraction_evaluate == 0.0  # sites report local accuracy with each train reply


def test_scalar_metrics_are_averaged_by_examples_and_histograms_dropped():
    records = [
        RecordDict({"metrics": MetricRecord({wire.NUM_EXAMPLES: n, wire.TRAIN_LOSS: loss, wire.LABEL_HISTOGRAM: [n, 0]})})
        for n, loss in [(10, 1.0), (30, 3.0)]
    ]
    averaged = average_scalar_metrics(records, wire.NUM_EXAMPLES)
    assert wire.LABEL_HISTOGRAM not in averaged
    assert averaged[wire.TRAIN_LOSS] == pytest.approx(np.average([1.0, 3.0], weights=[10, 30]))


def test_trimmedavgm_is_momentum_over_the_trimmed_mean():
    strategy = build_strategy(RunConfig(strategy="trimmedavgm", trimmed_beta=0.1, server_momentum=0.8), num_sites=10)
    # FedAvgM.aggregate_train's super() call reaches FedTrimmedAvg's aggregation, then FedAvg
    mro = type(strategy).__mro__
    assert mro.index(FedAvgM) < mro.index(FedTrimmedAvg) < mro.index(FedAvg)
    assert strategy.beta == 0.1 and strategy.server_momentum == 0.8
    with pytest.raises(ValueError, match="beta"):
        TrimmedFedAvgM(beta=0.5)
