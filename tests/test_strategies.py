"""Run config -> strategy, and the metric averaging every strategy shares."""

import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedProx

from fedind import wire
from fedind.config import RunConfig
from fedind.strategies import average_scalar_metrics, build_strategy
from fedind.strategy import DWA


@pytest.mark.parametrize(
    "name, kind", [("fedavg", FedAvg), ("fedprox", FedProx), ("fedavgm", FedAvgM), ("fedadam", FedAdam), ("dwa", DWA)]
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
