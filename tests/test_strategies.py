"""Run config -> strategy, and the metric averaging every strategy shares."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedTrimmedAvg, FedAdam, FedAvg, FedAvgM, FedProx

from fedind import wire
from fedind.config import RunConfig
from fedind.strategies import FedAdamKeepDtype, TrimmedFedAvgM, average_scalar_metrics, build_strategy
from fedind.strategy import DWA


@pytest.mark.parametrize(
    "name, kind",
    [("fedavg", FedAvg), ("fedprox", FedProx), ("fedavgm", FedAvgM), ("fedadam", FedAdamKeepDtype), ("dwa", DWA),
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


class TwoNodes:
    """All ``configure_train`` needs of a Grid."""

    def get_node_ids(self):
        return [1, 2]


def test_fedadam_keeps_float32_weights_so_later_rounds_still_aggregate(flower_task_identity):
    # Flower's FedAdam step returns float64 under NumPy 2; the server then rejected every
    # float32 site reply from round 2 on and the model froze.
    strategy = build_strategy(RunConfig(strategy="fedadam", min_sites=1), num_sites=2)
    assert isinstance(strategy, FedAdam)  # Flower's, with its checkpointed moments
    weights = np.zeros(4, dtype=np.float32)
    for server_round in (1, 2, 3):
        instructions = strategy.configure_train(
            server_round, ArrayRecord({"w": Array(weights)}), ConfigRecord(), TwoNodes()
        )
        replies = [
            Message(RecordDict({wire.ARRAYS: ArrayRecord({"w": Array(weights + np.float32(0.1 * (i + 1)))}),
                                wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 10})}), reply_to=message)
            for i, message in enumerate(instructions)
        ]
        arrays, _ = strategy.aggregate_train(server_round, replies)
        new = arrays["w"].numpy()
        assert new.dtype == np.float32
        assert np.all(new > weights)  # every site moved up, so does the server
        weights = new
