"""Run config -> strategy, and the metric averaging every strategy shares."""

from dataclasses import replace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedTrimmedAvg, FedAdam, FedAvg, FedAvgM, FedProx

from fedind import wire
from fedind.config import RunConfig
from fedind.server.rounds import in_dtypes_of, run_rounds
from fedind.server import strategies as fedind_strategies
from fedind.server.strategies import TrimmedFedAvgM, average_scalar_metrics, build_strategy, reset_strategy_rows
from fedind.server.dwa import DWA


@pytest.mark.parametrize(
    "name, kind",
    [("fedavg", FedAvg), ("fedprox", FedProx), ("fedavgm", FedAvgM), ("fedadam", FedAdam), ("dwa", DWA),
     ("trimmedavgm", TrimmedFedAvgM)],
)
def test_build_strategy_by_name(name, kind):
    strategy = build_strategy(RunConfig(strategy=name), num_sites=4, num_classes=10)
    assert isinstance(strategy, kind)  # Flower's built-in, as fedind's thin subclass of it
    assert type(strategy) is getattr(fedind_strategies, kind.__name__, kind)
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


def test_dwa_takes_its_own_momentum_and_fedavgm_flowers():
    # One config serves both: dwa-momentum drives DWA's restarting buffer, server-momentum
    # stays Flower's FedAvgM's, so the heavier DWA default does not change the baseline.
    config = RunConfig(strategy="dwa", dwa_momentum=0.95, server_momentum=0.5)
    assert build_strategy(config, num_sites=10).server_momentum == 0.95
    fedavgm = build_strategy(replace(config, strategy="fedavgm"), num_sites=10)
    assert isinstance(fedavgm, FedAvgM) and fedavgm.server_momentum == 0.5


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


class TwoSites(TwoNodes):
    """A Grid whose two sites each move every received weight up (site i by 0.1 (i + 1)),
    replying in float32 like a real site."""

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for i, message in enumerate(messages):
            weights = message.content[wire.ARRAYS]["w"].numpy().astype(np.float32)
            content = RecordDict({wire.ARRAYS: ArrayRecord({"w": Array(weights + np.float32(0.1 * (i + 1)))}),
                                  wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 10})})
            replies.append(Message(content, reply_to=message))
        return replies


def test_round_loop_keeps_float32_weights_so_fedadam_still_aggregates_later_rounds(flower_task_identity):
    # Flower's FedAdam step returns float64 under NumPy 2; the server then rejected every
    # float32 site reply from round 2 on and the model froze. The round loop casts back.
    strategy = build_strategy(RunConfig(strategy="fedadam", min_sites=1), num_sites=2)
    seen = []

    def record(server_round, arrays):
        seen.append(arrays["w"].numpy().copy())

    final = run_rounds(
        strategy, TwoSites(), ArrayRecord({"w": Array(np.zeros(4, dtype=np.float32))}), first_round=1,
        num_rounds=3, timeout=1.0, train_config=ConfigRecord(), evaluate_fn=lambda r, a: None, after_round=record,
    )
    assert [w.dtype for w in seen] == [np.float32] * 3 and final["w"].numpy().dtype == np.float32
    assert 0 < seen[0][0] < seen[1][0] < seen[2][0]  # every site moved up every round, so did the server


def test_in_dtypes_of_casts_to_the_reference_and_passes_a_matching_record_through():
    reference = ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32)), "n": Array(np.zeros(1, dtype=np.int64))})
    promoted = ArrayRecord({"w": Array(np.array([0.5, 1e-3])), "n": Array(np.array([3])), "extra": Array(np.ones(1))})
    cast = in_dtypes_of(promoted, reference)
    assert cast["w"].numpy().dtype == np.float32 and cast["n"].numpy().dtype == np.int64
    assert cast["extra"].numpy().dtype == np.float64  # no reference: kept
    np.testing.assert_array_equal(cast["w"].numpy(), np.float32([0.5, 1e-3]))
    assert in_dtypes_of(reference, reference) is reference


@pytest.mark.parametrize("name", ["fedavgm", "trimmedavgm", "fedadam", "dwa"])
def test_the_strategy_steps_from_the_model_end_of_round_edited(name, flower_task_identity):
    # The server edits the model after the step (grown head, refitted rows, EWC damping).
    # FedAvgM kept its own pre-edit copy: the edit then entered its pseudo-gradient and its
    # momentum repeated it every round after (+90 in round 3 here, not +0.3).
    strategy = build_strategy(RunConfig(strategy=name, min_sites=1, trimmed_beta=0.0), num_sites=2, num_classes=3)
    seen = []

    def edit(server_round, arrays, replies):
        return ArrayRecord({"w": Array(np.full(4, 100.0, np.float32))}) if server_round == 1 else arrays

    run_rounds(
        strategy, TwoSites(), ArrayRecord({"w": Array(np.zeros(4, dtype=np.float32))}), first_round=1,
        num_rounds=3, timeout=1.0, train_config=ConfigRecord(), evaluate_fn=lambda r, a: None,
        after_round=lambda r, a: seen.append(float(a["w"].numpy()[0])), end_of_round=edit,
    )
    assert seen[0] == 100.0
    assert 100.0 < seen[1] < seen[2] < 101.0  # the sites move it by 0.15 a round, momentum a little more


def test_fedavgm_momentum_of_rows_set_outside_the_strategy_is_zeroed():
    strategy = build_strategy(RunConfig(strategy="fedavgm"), num_sites=2)
    arrays = ArrayRecord({"head.weight": Array(np.zeros((3, 2), np.float32)), "head.bias": Array(np.zeros(3, np.float32))})
    strategy.load_state_dict({"momentum_vector": [np.ones((3, 2), np.float32), np.ones(3, np.float32)]})
    reset_strategy_rows(strategy, arrays, [1])
    assert strategy.momentum_vector[0].tolist() == [[1, 1], [0, 0], [1, 1]]
    assert strategy.momentum_vector[1].tolist() == [1, 0, 1] and strategy.current_arrays is arrays
