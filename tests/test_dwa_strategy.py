"""The ``dwa`` strategy: Flower replies made by hand, aggregated against numeric oracles.

Everything here but the last test runs without Ray: a tiny fake Grid answers
``get_node_ids``, ``configure_train`` makes the instructions, and the replies are
``Message(content, reply_to=instruction)`` (so ``src_node_id`` is the instruction's
``dst_node_id``, as in a real run).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fedind import wire
from fedind.aggregation.conflicts import RestartMomentum
from fedind.aggregation.weighting import GlobalHistogram, dwa_weights
from fedind.config import RunConfig
from fedind.server.strategies import build_strategy
from fedind.server.dwa import DWA

# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def task_identity(flower_task_identity):
    """Every test here builds Messages: conftest's ``flower_task_identity`` for all of them."""


class FakeGrid:
    """All ``FedAvg.configure_train`` needs of a Grid."""

    def __init__(self, node_ids):
        self.node_ids = list(node_ids)

    def get_node_ids(self):
        return list(self.node_ids)


@dataclass
class Site:
    """What one site replies: arrays, example count, and optionally the rest."""

    arrays: dict
    n: float | int
    histogram: list | None = None
    site_id: str | None = None
    extra_metrics: dict = field(default_factory=lambda: {wire.TRAIN_LOSS: 1.0})
    drop_metric: str | None = None  # a metric key to leave out
    error: str | None = None  # reply with this Flower Error instead of content


def record(arrays: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


def make_reply(instruction: Message, site: Site) -> Message:
    if site.error is not None:
        return Message(Error(code=0, reason=site.error), reply_to=instruction)
    metrics = {wire.NUM_EXAMPLES: site.n, **site.extra_metrics}
    if site.histogram is not None:
        metrics[wire.LABEL_HISTOGRAM] = site.histogram
    metrics.pop(site.drop_metric, None)
    content = RecordDict({wire.ARRAYS: record(site.arrays), wire.METRICS: MetricRecord(metrics)})
    if site.site_id is not None:
        content[wire.SITE] = ConfigRecord({wire.SITE_ID: site.site_id})
    return Message(content, reply_to=instruction)


def dwa(**kwargs) -> DWA:
    defaults = dict(num_classes=3, fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1)
    return DWA(**{**defaults, **kwargs})


def run_round(strategy: DWA, global_arrays: dict, sites: list[Site], server_round: int = 1):
    """configure_train over one node per site, reply, aggregate_train; also the replies."""
    grid = FakeGrid(range(1, len(sites) + 1))
    instructions = sorted(
        strategy.configure_train(server_round, record(global_arrays), ConfigRecord(), grid),
        key=lambda m: m.metadata.dst_node_id,
    )
    assert [m.metadata.dst_node_id for m in instructions] == grid.node_ids
    replies = [make_reply(ins, site) for ins, site in zip(instructions, sites)]
    arrays, metrics = strategy.aggregate_train(server_round, replies)
    return arrays, metrics, replies


def as_numpy(arrays: ArrayRecord) -> dict:
    return {k: v.numpy() for k, v in arrays.items()}


def weighted_mean(site_arrays: list[dict], weights) -> dict:
    """np.average oracle over sites, per array name, in float64."""
    return {
        name: np.average(np.stack([a[name].astype(np.float64) for a in site_arrays]), axis=0, weights=weights)
        for name in site_arrays[0]
    }


def warnings_about(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


RNG = np.random.default_rng(0)
GLOBAL = {
    "conv": RNG.normal(size=(4, 3)).astype(np.float32),
    "bias": RNG.normal(size=4).astype(np.float32),
    "scale": np.asarray(0.5, dtype=np.float32),  # 0-dim arrays aggregate like any other
}


def perturbed(seed: int, scale: float = 0.1) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (v + scale * rng.normal(size=v.shape)).astype(v.dtype) for k, v in GLOBAL.items()}


# --------------------------------------------------------------------------- FedAvg equivalence


@pytest.mark.parametrize("conflict_buffer, threshold", [(False, 0.3), (True, 0.0)])
def test_equal_histograms_give_fedavg(conflict_buffer, threshold):
    # Same label distribution everywhere: every KL is 0, so DWA weights are n / N. With
    # buffering off (or a threshold nothing falls below) the result is FedAvg's.
    ns = [10, 20, 30]
    sites = [
        Site(perturbed(i), n, histogram=[n // 5, 2 * n // 5, 2 * n // 5], site_id=f"s{i}",
             extra_metrics={wire.TRAIN_LOSS: float(i + 1)})
        for i, n in enumerate(ns)
    ]
    strategy = dwa(conflict_buffer=conflict_buffer, threshold=threshold)
    arrays, metrics, replies = run_round(strategy, GLOBAL, sites)

    fedavg = as_numpy(aggregate_arrayrecords([r.content for r in replies], wire.NUM_EXAMPLES))
    oracle = weighted_mean([s.arrays for s in sites], ns)
    got = as_numpy(arrays)
    assert list(got) == list(GLOBAL)
    for name, value in got.items():
        assert value.dtype == GLOBAL[name].dtype and value.shape == GLOBAL[name].shape
        np.testing.assert_allclose(value, fedavg[name], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(value, oracle[name], rtol=1e-6, atol=1e-6)

    assert metrics[wire.TRAIN_LOSS] == pytest.approx(np.average([1.0, 2.0, 3.0], weights=ns))
    assert wire.LABEL_HISTOGRAM not in metrics  # list values are left out
    assert metrics[wire.DWA_WEIGHT_MIN] == pytest.approx(10 / 60)
    assert metrics[wire.DWA_WEIGHT_MAX] == pytest.approx(30 / 60)
    if threshold == 0.0:
        assert metrics[wire.CONFLICT_SHARE] == 0.0


def test_weighting_off_is_fedavg_even_with_skewed_histograms():
    sites = [
        Site(perturbed(1), 10, [10, 0, 0], "a"),
        Site(perturbed(2), 30, [0, 15, 15], "b"),
    ]
    arrays, metrics, replies = run_round(dwa(weighting=False, conflict_buffer=False), GLOBAL, sites)
    fedavg = as_numpy(aggregate_arrayrecords([r.content for r in replies], wire.NUM_EXAMPLES))
    for name, value in as_numpy(arrays).items():
        np.testing.assert_allclose(value, fedavg[name], rtol=1e-6, atol=1e-6)
    assert metrics[wire.DWA_WEIGHT_MIN] == pytest.approx(0.25)


# --------------------------------------------------------------------------- DWA weighting


def test_skewed_site_gets_less_than_its_fedavg_share():
    # Sites a and b are close to the global distribution and send zero deltas; c holds one
    # class only and moves the single coordinate by 1. The aggregate move IS c's weight.
    zero = {"w": np.zeros(1, dtype=np.float32)}
    hists = {"a": [4, 3, 3], "b": [3, 4, 3], "c": [10, 0, 0]}
    sites = [
        Site(zero, 10, hists["a"], "a"),
        Site(zero, 10, hists["b"], "b"),
        Site({"w": np.ones(1, dtype=np.float32)}, 10, hists["c"], "c"),
    ]
    arrays, metrics, _ = run_round(dwa(conflict_buffer=False, temperature=1.0, floor=0.1), zero, sites)

    moved = float(arrays["w"].numpy()[0])
    global_hist = GlobalHistogram(3)
    for site_id, h in hists.items():
        global_hist.update(site_id, h)
    expected = dwa_weights([10, 10, 10], list(hists.values()), global_hist.distribution(), 1.0, 0.1)
    assert moved == pytest.approx(expected[2], rel=1e-6)
    assert 0.1 / 3 <= moved < 1 / 3 - 0.01  # below its FedAvg share, above the floor
    assert metrics[wire.DWA_WEIGHT_MIN] == pytest.approx(expected.min())
    assert metrics[wire.DWA_WEIGHT_MAX] == pytest.approx(expected.max())


def test_reply_without_histogram_falls_back_to_example_counts_logged_once(flwr_log):
    # A plain Flower ClientApp sends no label histogram (and no site record: node-<id>).
    strategy = dwa(conflict_buffer=False)
    current = GLOBAL
    for server_round in (1, 2):
        sites = [
            Site(perturbed(10 + server_round), 10, [10, 0, 0], "skewed"),
            Site(perturbed(20 + server_round), 30, None, None),
        ]
        arrays, metrics, _ = run_round(strategy, current, sites, server_round)
        oracle = weighted_mean([s.arrays for s in sites], [10, 30])
        for name, value in as_numpy(arrays).items():
            np.testing.assert_allclose(value, oracle[name], rtol=1e-6, atol=1e-6)
        assert metrics[wire.DWA_WEIGHT_MIN] == pytest.approx(0.25)
        current = as_numpy(arrays)
    logged = [m for m in (r.getMessage() for r in flwr_log.records) if "example counts" in m]
    assert len(logged) == 1
    assert wire.LABEL_HISTOGRAM in logged[0] and "node-2" in logged[0]  # names the site (node id here)


# --------------------------------------------------------------------------- validation


def _nan(site):
    site.arrays["conv"][0, 0] = np.nan


def _inf(site):
    site.arrays["bias"][1] = -np.inf


def _wrong_shape(site):
    site.arrays["bias"] = np.zeros(5, dtype=np.float32)


def _wrong_dtype(site):
    site.arrays["conv"] = site.arrays["conv"].astype(np.float64)


def _missing_array(site):
    del site.arrays["scale"]


def _extra_array(site):
    site.arrays["extra"] = np.zeros(2, dtype=np.float32)


def _missing_num_examples(site):
    site.drop_metric = wire.NUM_EXAMPLES


def _negative_num_examples(site):
    site.n = -10


def _nan_num_examples(site):
    site.n = float("nan")


def _histogram_wrong_length(site):
    site.histogram = [5, 5]


def _histogram_negative(site):
    site.histogram = [-1, 6, 5]  # sums to n: only the sign is wrong


def _histogram_wrong_sum(site):
    site.histogram = [3, 3, 3]


def _histogram_floats(site):
    site.histogram = [2.0, 4.0, 4.0]


def _error_reply(site):
    site.error = "site crashed"


MALFORMED = {
    "nan": (_nan, "NaN/Inf"),
    "inf": (_inf, "NaN/Inf"),
    "wrong shape": (_wrong_shape, "shape"),
    "wrong dtype": (_wrong_dtype, "dtype"),
    "missing array": (_missing_array, "missing ['scale']"),
    "extra array": (_extra_array, "unexpected ['extra']"),
    "missing num-examples": (_missing_num_examples, wire.NUM_EXAMPLES),
    "negative num-examples": (_negative_num_examples, wire.NUM_EXAMPLES),
    "nan num-examples": (_nan_num_examples, wire.NUM_EXAMPLES),
    "histogram wrong length": (_histogram_wrong_length, "classes"),
    "histogram negative": (_histogram_negative, "non-negative"),
    "histogram wrong sum": (_histogram_wrong_sum, "sums to 9"),
    "histogram floats": (_histogram_floats, "ints"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_reply_is_dropped_and_the_rest_aggregated(name, flwr_log):
    corrupt, reason = MALFORMED[name]
    good = [Site(perturbed(1), 10, [2, 4, 4], "good-1"), Site(perturbed(2), 30, [6, 12, 12], "good-2")]
    bad = Site(perturbed(3), 10, [2, 4, 4], "bad-site")
    corrupt(bad)
    arrays, metrics, _ = run_round(dwa(conflict_buffer=False), GLOBAL, [good[0], bad, good[1]])

    oracle = weighted_mean([s.arrays for s in good], [10, 30])  # equal distributions: n / N
    for key, value in as_numpy(arrays).items():
        np.testing.assert_allclose(value, oracle[key], rtol=1e-6, atol=1e-6)
    assert metrics[wire.DWA_WEIGHT_MIN] == pytest.approx(0.25)
    dropped = warnings_about(flwr_log, "bad-site")
    assert len(dropped) == 1 and reason in dropped[0], dropped
    assert not warnings_about(flwr_log, "good-")


def test_duplicate_site_id_keeps_the_first_reply(flwr_log):
    sites = [Site(perturbed(1), 10, [2, 4, 4], "same"), Site(perturbed(2), 30, [6, 12, 12], "same")]
    arrays, _, _ = run_round(dwa(conflict_buffer=False), GLOBAL, sites)
    for key, value in as_numpy(arrays).items():
        np.testing.assert_allclose(value, sites[0].arrays[key], rtol=1e-6, atol=1e-6)
    assert len(warnings_about(flwr_log, "already came from this site id")) == 1


def test_all_replies_invalid_keeps_the_global_model(flwr_log):
    bad = [Site(perturbed(i), 10, [2, 4, 4], f"bad-{i}") for i in range(2)]
    _nan(bad[0])
    _histogram_wrong_sum(bad[1])
    crashed = Site(perturbed(3), 10, error="out of memory")
    strategy = dwa()
    assert run_round(strategy, GLOBAL, bad + [crashed])[:2] == (None, None)
    assert len(warnings_about(flwr_log, "bad-")) == 2
    assert warnings_about(flwr_log, "no valid reply")
    assert strategy.state_dict()["momentum"]["buffers"] == {}  # nothing stepped
    assert strategy.aggregate_train(2, []) == (None, None)  # no reply at all


def test_aggregate_before_configure_is_an_error():
    with pytest.raises(AggregationError):
        dwa().aggregate_train(1, [])


# --------------------------------------------------------------------------- conflict buffering


def test_conflicting_coordinate_goes_through_the_momentum_buffer():
    # Global 0; weights 1/4 and 3/4 (equal distributions). Coordinate 0: a pushes +1, b -1,
    # agreement |1/4 - 3/4| = 0.5 < 0.6 -> conflict, mean -0.5 -> buffered:
    #   round 1: v = -0.5,               applied (1 - 0.9) v = -0.05
    #   round 2 (same deltas): v = 0.9 * -0.5 - 0.5 = -0.95, applied -0.095
    # Coordinates 1 and 2 agree: they move by the plain weighted mean (2 and 0.5).
    strategy = dwa(conflict_buffer=True, threshold=0.6, momentum=0.9)
    current = np.zeros(3, dtype=np.float32)
    expected_moves = [np.array([-0.05, 2.0, 0.5]), np.array([-0.095, 2.0, 0.5])]
    for server_round, move in enumerate(expected_moves, start=1):
        sites = [
            Site({"w": current + np.array([1.0, 2.0, 0.5], np.float32)}, 1, [1, 0, 0], "a"),
            Site({"w": current + np.array([-1.0, 2.0, 0.5], np.float32)}, 3, [3, 0, 0], "b"),
        ]
        arrays, metrics, _ = run_round(strategy, {"w": current}, sites, server_round)
        new = arrays["w"].numpy()
        np.testing.assert_allclose(new - current, move, rtol=1e-6, atol=1e-6)
        assert metrics[wire.CONFLICT_SHARE] == pytest.approx(1 / 3)
        current = new


def test_conflict_share_is_reported_with_buffering_off():
    sites = [
        Site({"w": np.array([1.0, 1.0], np.float32)}, 10, [10, 0, 0], "a"),
        Site({"w": np.array([-1.0, 1.0], np.float32)}, 10, [10, 0, 0], "b"),
    ]
    arrays, metrics, _ = run_round(dwa(conflict_buffer=False), {"w": np.zeros(2, np.float32)}, sites)
    np.testing.assert_allclose(arrays["w"].numpy(), [0.0, 1.0])  # plain mean, nothing held back
    assert metrics[wire.CONFLICT_SHARE] == 0.5


# --------------------------------------------------------------------------- state


def _state_sites(current: dict, seed: int) -> list[Site]:
    rng = np.random.default_rng(seed)
    return [
        Site({k: (v + rng.normal(size=v.shape)).astype(v.dtype) for k, v in current.items()}, 10, [10, 0, 0], "a"),
        Site({k: (v - rng.normal(size=v.shape)).astype(v.dtype) for k, v in current.items()}, 20, [5, 10, 5], "b"),
        Site({k: (v + rng.normal(size=v.shape)).astype(v.dtype) for k, v in current.items()}, 30, [10, 10, 10], "c"),
    ]


def test_state_dict_round_trip_restores_behaviour():
    settings = dict(conflict_buffer=True, threshold=0.9, momentum=0.8, temperature=0.5)
    first = dwa(**settings)
    arrays, _, _ = run_round(first, GLOBAL, _state_sites(GLOBAL, 1))
    after_round_1 = as_numpy(arrays)
    state = first.state_dict()
    assert set(state) == {"global_histogram", "momentum", "server_momentum"}
    assert all(isinstance(v, np.ndarray) for v in state["momentum"]["buffers"].values())

    restored = dwa(**settings)
    restored.load_state_dict(state)
    fresh = dwa(**settings)
    # Round 2 hears from a and b only: c is known through the saved histogram alone, and
    # the buffer carries round 1's conflicts.
    results = [run_round(s, after_round_1, _state_sites(after_round_1, 2)[:2], 2) for s in (first, restored, fresh)]
    (expected, expected_metrics, _), (got, got_metrics, _), (other, other_metrics, _) = results
    for name in GLOBAL:
        np.testing.assert_array_equal(got[name].numpy(), expected[name].numpy())
    assert got_metrics == expected_metrics
    assert other_metrics[wire.DWA_WEIGHT_MIN] != expected_metrics[wire.DWA_WEIGHT_MIN]
    assert any(not np.allclose(other[n].numpy(), expected[n].numpy()) for n in GLOBAL)

    # A saved state does not alias the strategy's buffers.
    state["momentum"]["buffers"]["conv"][...] = 1e9
    assert not np.any(first.state_dict()["momentum"]["buffers"]["conv"] == 1e9)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s.pop("momentum"), "keys"),
        (lambda s: s.update(extra=1), "keys"),
        (lambda s: s["global_histogram"].update(num_classes=4), "num_classes"),
        (lambda s: s["global_histogram"]["sites"].update(a=[1, -1, 0]), "non-negative"),
        (lambda s: s["momentum"]["buffers"]["conv"].fill(np.nan), "finite"),
        (lambda s: s["momentum"]["buffers"].update(conv=np.zeros((2, 2))), "conv"),
    ],
)
def test_load_state_dict_validates_and_changes_nothing_on_error(mutate, match):
    source = dwa()
    run_round(source, GLOBAL, _state_sites(GLOBAL, 1))
    target = dwa()
    run_round(target, GLOBAL, _state_sites(GLOBAL, 3))
    before = target.state_dict()
    state = source.state_dict()
    mutate(state)
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(state)
    after = target.state_dict()
    assert after["global_histogram"] == before["global_histogram"]
    for name, v in before["momentum"]["buffers"].items():
        np.testing.assert_array_equal(after["momentum"]["buffers"][name], v)


def test_loaded_buffer_that_does_not_fit_the_model_fails_before_the_round():
    source = dwa()
    one = np.ones(2, np.float32)
    sites = [Site({"other": one}, 10, [10, 0, 0], "a"), Site({"other": -one}, 10, [10, 0, 0], "b")]
    run_round(source, {"other": 0 * one}, sites)
    target = dwa()
    target.load_state_dict(source.state_dict())
    with pytest.raises(ValueError, match="other"):
        target.configure_train(1, record(GLOBAL), ConfigRecord(), FakeGrid([1]))


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(floor=-0.1), "floor"),
        (dict(floor=1.5), "floor"),
        (dict(threshold=1.1), "threshold"),
        (dict(momentum=1.0), "momentum"),
        (dict(momentum=-0.5), "momentum"),
        (dict(num_classes=0), "num_classes"),
        (dict(num_classes=2.5), "num_classes"),
        (dict(weighting="yes"), "weighting"),
        (dict(conflict_buffer=1), "conflict_buffer"),
    ],
)
def test_constructor_rejects_invalid_hyperparameters(kwargs, name):
    with pytest.raises(ValueError, match=f"Invalid {name} value"):
        DWA(**kwargs)


def test_num_classes_comes_from_the_global_model_head():
    strategy = DWA(fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1)
    model = {**GLOBAL, "head.weight": np.zeros((5, 4), np.float32)}
    strategy.configure_train(1, record(model), ConfigRecord(), FakeGrid([1]))
    assert strategy.num_classes == 5
    with pytest.raises(ValueError, match="num_classes"):
        DWA().configure_train(1, record(GLOBAL), ConfigRecord(), FakeGrid([1, 2]))


def test_build_strategy_makes_dwa_from_the_run_config():
    config = RunConfig(
        strategy="dwa", dwa_weighting=False, dwa_temperature=2.0, dwa_floor=0.3,
        conflict_buffer=False, conflict_threshold=0.4, conflict_momentum=0.5,
    )
    strategy = build_strategy(config, num_sites=4, num_classes=7)
    assert isinstance(strategy, DWA)
    assert (strategy.weighting, strategy.temperature, strategy.floor) == (False, 2.0, 0.3)
    assert (strategy.conflict_buffer, strategy.threshold, strategy.momentum) == (False, 0.4, 0.5)
    assert strategy.num_classes == 7 and strategy.min_available_nodes == 1
    # the default dwa: restart momentum gated by the sites' agreement
    restart = build_strategy(RunConfig(strategy="dwa"), num_sites=4, num_classes=7).server_buffer
    assert isinstance(restart, RestartMomentum) and restart.restart_agreement == 0.5


def test_summary_logs_the_settings(flwr_log):
    dwa(temperature=0.7, floor=0.2, threshold=0.4, momentum=0.8).summary()
    text = "\n".join(r.getMessage() for r in flwr_log.records)
    for needle in ("DWA", "temperature 0.7", "floor 0.2", "threshold 0.4", "momentum 0.8", "Conflict buffer: ON"):
        assert needle in text


# --------------------------------------------------------------------------- end to end


def test_dwa_simulation_learns(tmp_path):
    # The loopback runtime (fedind.loopback; the same run as on Ray, bit for bit, without
    # the ~15 s start): a few seconds on 2 CPU cores. batch_size=8: with
    # the default 32 (4 local steps a round) neither FedAvg nor DWA leaves chance level in
    # 3 rounds; with 8, seed 0 went 0.10 -> 0.17 (FedAvg 0.10 -> 0.17 as well).
    from fedind.simulation import simulate

    summary = simulate(
        RunConfig(
            strategy="dwa", num_sites=3, samples_per_site=60, num_server_rounds=3, local_epochs=2,
            batch_size=8, learning_rate=0.01, model_width=16, run_dir=str(tmp_path), device="cpu",
        ),
        runtime="loopback",
    )
    assert summary["rounds"] == 3
    assert summary["final_accuracy"] > summary["initial_accuracy"]


# ---------------------------------------------------------------- server momentum


def test_server_momentum_without_conflict_buffer_is_flowers_fedavgm():
    """Oracle: Flower's own FedAvgM (server lr 1) on the same replies, three rounds."""
    from flwr.serverapp.strategy import FedAvgM

    rng = np.random.default_rng(0)
    ours = dwa(weighting=False, conflict_buffer=False, server_momentum=0.9)
    theirs = FedAvgM(
        server_learning_rate=1.0, server_momentum=0.9, fraction_evaluate=0.0,
        min_train_nodes=1, min_available_nodes=1,
    )
    ours_global = theirs_global = {"w": np.zeros((2, 3), np.float32), "b": np.zeros((), np.float32)}
    for server_round in (1, 2, 3):
        sites_arrays = [
            {k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in ours_global.items()}
            for _ in range(3)
        ]
        sizes = [10, 30, 60]
        arrays, _, _ = run_round(
            ours, ours_global, [Site(a, n, site_id=f"s{i}") for i, (a, n) in enumerate(zip(sites_arrays, sizes))],
            server_round,
        )
        ours_global = as_numpy(arrays)
        grid = FakeGrid(range(1, 4))
        instructions = sorted(
            theirs.configure_train(server_round, record(theirs_global), ConfigRecord(), grid),
            key=lambda m: m.metadata.dst_node_id,
        )
        # The same site models: both strategies hold the same global model each round.
        replies = [make_reply(ins, Site(a, n)) for ins, a, n in zip(instructions, sites_arrays, sizes)]
        theirs_arrays, _ = theirs.aggregate_train(server_round, replies)
        theirs_global = as_numpy(theirs_arrays)
        for name in ours_global:
            np.testing.assert_allclose(ours_global[name], theirs_global[name], rtol=1e-5, atol=1e-6)


def test_conflict_aware_server_momentum_is_one_restarting_buffer():
    """conflict buffer + server momentum: RestartMomentum over every coordinate."""
    from fedind.aggregation.conflicts import RestartMomentum, agreement_gain, sign_agreement

    strategy = dwa(weighting=False, conflict_buffer=True, threshold=0.5, server_momentum=0.5, conflict_damping=0.2)
    assert isinstance(strategy.server_buffer, RestartMomentum)
    current = {"w": np.zeros(2, np.float32)}
    v = np.zeros(2)
    for server_round, site_deltas in enumerate(([[1.0, 1.0], [1.0, -3.0]], [[-2.0, 1.0], [-2.0, -3.0]]), 1):
        sites = [Site({"w": (current["w"] + np.array(d)).astype(np.float32)}, 10, site_id=f"s{i}")
                 for i, d in enumerate(site_deltas)]
        arrays, metrics, _ = run_round(strategy, current, sites, server_round)
        deltas = [np.array(d) for d in site_deltas]
        mean = np.mean(deltas, axis=0)
        gain = agreement_gain(sign_agreement(deltas, [1, 1]), 0.5, 0.2)
        v = np.where(v * mean < 0, 0.0, 0.5 * v) + gain * mean
        np.testing.assert_allclose(arrays["w"].numpy(), current["w"] + v, rtol=1e-6)
        current = as_numpy(arrays)
        assert wire.RESTART_SHARE in metrics
    assert metrics[wire.RESTART_SHARE] == 0.5  # coordinate 0 reversed in round 2
    state = strategy.state_dict()
    restored = dwa(weighting=False, conflict_buffer=True, threshold=0.5, server_momentum=0.5, conflict_damping=0.2)
    restored.load_state_dict(state)
    np.testing.assert_allclose(restored.server_buffer.state_dict()["buffers"]["w"], v, rtol=1e-6)
    with pytest.raises(ValueError, match="conflict_damping"):
        dwa(conflict_damping=1.5)


def test_rows_from_average_over_holders_follow_the_sites_holding_each_class():
    """average_over_holders(2): class 2's rows take the holder's delta, older rows FedAvg's."""
    head = {"head.weight": np.zeros((3, 2), np.float32), "head.bias": np.zeros(3, np.float32)}
    holder = {"head.weight": np.full((3, 2), 1.0, np.float32), "head.bias": np.full(3, 1.0, np.float32)}
    other = {"head.weight": np.full((3, 2), 3.0, np.float32), "head.bias": np.full(3, 3.0, np.float32)}
    sites = [Site(holder, 10, [5, 3, 2], "a"), Site(other, 10, [5, 5, 0], "b")]
    strategy = dwa(weighting=False, conflict_buffer=False)
    strategy.average_over_holders(2)
    arrays, _, _ = run_round(strategy, head, sites)
    got = as_numpy(arrays)
    np.testing.assert_allclose(got["head.bias"], [2.0, 2.0, 1.0])  # rows 0, 1: the mean; row 2: its holder
    np.testing.assert_allclose(got["head.weight"], [[2.0, 2.0], [2.0, 2.0], [1.0, 1.0]])
    strategy.average_over_holders(None)
    arrays, _, _ = run_round(strategy, head, sites, server_round=2)
    np.testing.assert_allclose(as_numpy(arrays)["head.bias"], [2.0, 2.0, 2.0])


def test_a_site_that_trained_on_no_windows_carries_no_weight(flwr_log):
    """num-examples 0 (its classes all new to the head): skipped, said at INFO, not a fault."""
    base = {"head.bias": np.zeros(3, np.float32)}
    sites = [Site({"head.bias": np.ones(3, np.float32)}, 10, [4, 3, 3], "a"),
             Site({"head.bias": np.full(3, 9.0, np.float32)}, 0, [0, 0, 0], "b")]
    arrays, _, _ = run_round(dwa(weighting=False, conflict_buffer=False), base, sites)
    np.testing.assert_array_equal(as_numpy(arrays)["head.bias"], np.ones(3))
    assert "site b trained on no windows" in flwr_log.text and not warnings_about(flwr_log, "site b")


# ---------------------------------------------------------------------- centered clipping (robust=)


def test_centered_clipping_oracle_inside_dwa():
    """No momentum, no conflict buffer, buckets of one: the step is centered_clip's aggregate
    around 0 over the sites' deltas, with the DWA weights (here n_i / N)."""
    from fedind.aggregation.robust import CenteredClipping, centered_clip

    rng = np.random.default_rng(11)
    sites = [Site({k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in GLOBAL.items()}, n)
             for n in (10, 20, 30)]
    sites[2].arrays = {k: (v + 1e3).astype(np.float32) for k, v in GLOBAL.items()}  # one huge outlier
    strategy = dwa(conflict_buffer=False, weighting=False, robust=CenteredClipping(radius=1.0, bucket_size=1))
    arrays, metrics, _ = run_round(strategy, GLOBAL, sites)
    names = list(GLOBAL)
    flat = np.stack([np.concatenate([(s.arrays[k].astype(np.float64) - GLOBAL[k]).ravel() for k in names])
                     for s in sites])
    w = np.array([10.0, 20.0, 30.0]) / 60
    tau = float(np.median(np.linalg.norm(flat, axis=1)))
    expected, _ = centered_clip(flat, w, np.zeros(flat.shape[1]), tau)
    got = np.concatenate([(arrays[k].numpy().astype(np.float64) - GLOBAL[k]).ravel() for k in names])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert metrics[wire.CCLIP_SHARE] == pytest.approx(1 / 3)


def test_centered_clipping_state_round_trip_and_config():
    from fedind.aggregation.robust import CenteredClipping

    first = dwa(robust=CenteredClipping(radius=2.0, bucket_size=2, seed=3))
    run_round(first, GLOBAL, _state_sites(GLOBAL, 1))
    state = first.state_dict()
    assert set(state) == {"global_histogram", "momentum", "server_momentum", "robust"}
    restored = dwa(robust=CenteredClipping(radius=2.0, bucket_size=2, seed=3))
    restored.load_state_dict(state)
    for name, v in state["robust"]["center"].items():
        np.testing.assert_array_equal(restored.robust.state_dict()["center"][name], v)
    with pytest.raises(ValueError, match="keys"):
        dwa().load_state_dict(state)  # a state with clipping does not load into a strategy without
    strategy = build_strategy(RunConfig(strategy="fedind", cclip_radius=2.0, cclip_bucket=3), 10, 3)
    assert isinstance(strategy.robust, CenteredClipping) and strategy.robust.bucket_size == 3
    assert build_strategy(RunConfig(strategy="fedind"), 10, 3).robust is None
    with pytest.raises(ValueError, match="cclip-radius"):
        RunConfig(strategy="fedavgm", cclip_radius=2.0)


def test_a_grown_head_keeps_the_centered_clipping_state():
    """The continual path edits every piece of DWA's state aligned with the arrays: the centre too."""
    from fedind.aggregation.robust import CenteredClipping
    from fedind.server.strategies import grow_strategy_classes

    strategy = dwa(robust=CenteredClipping(radius=2.0))
    run_round(strategy, GLOBAL, _state_sites(GLOBAL, 1))
    before = strategy.robust.state_dict()["center"]
    grow_strategy_classes(strategy, record(GLOBAL), 4)
    assert strategy.num_classes == 4
    for name, v in strategy.robust.state_dict()["center"].items():
        np.testing.assert_array_equal(v, before[name])
