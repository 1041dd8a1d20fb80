"""Continual learning end to end: run config, phase schedule, drifting data and its on-disk
layout, the head's growth through strategy state, and a short two-phase simulation (head
grows at every site, replay stays bounded, EWC Fisher and anchors survive a resume).

Unit tests of the buffer, the Fisher, the penalty and the head expansion themselves are in
tests/test_replay.py and tests/test_ewc.py. Two ``simulate`` calls on the loopback runtime
(fedind.loopback, no Ray start: a few seconds each on 2 cores).
"""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvgM
from safetensors.numpy import load_file

from fedind import wire
from fedind.server.checkpoint import CheckpointStore
from fedind.config import ConfigError, RunConfig
from fedind.continual.phases import (
    fit_new_rows,
    forgetting,
    known,
    merge_row_proposals,
    propose_new_rows,
    replay_bytes,
    replay_capacity,
    restore_replay,
    row_bounds,
)
from fedind.training import window_features
from fedind.server.continual import PhaseController
from fedind.data.drift import (
    DriftSpec,
    drifted_sites,
    new_class_site,
    phase_classes,
    phase_global_test,
    phase_regimes,
    phase_site,
    write_drift_federation,
)
from fedind.data.federation import FederationSpec
from fedind.data.format import DataFormatError, SiteArrays, batch_dir, load_site, validate_phases, write_split
from fedind.data.synthetic import NUM_CLASSES
from fedind.continual.expansion import head_classes
from fedind.models import FaultCNN
from fedind.continual.replay import ReplayBuffer
from fedind.simulation import simulate
from fedind.server.strategies import build_strategy, grow_strategy_classes, strategy_state

SMALL = FederationSpec(num_sites=3, samples_per_site=40, window=256, global_test_per_class=2, seed=0)
DRIFT = DriftSpec(federation=SMALL, phases=3, regime_share=0.5, new_classes=1, speed_factor=1.5)


# --------------------------------------------------------------------------- run config


@pytest.mark.parametrize(
    "values, key",
    [
        ({"phases": 2}, "phase-rounds"),  # phases need a schedule
        ({"phases": 2, "phase-rounds": 40, "num-server-rounds": 40}, "phase-rounds"),  # last phase gets no round
        ({"phase-rounds": 5}, "phase-rounds"),  # no effect with one phase
        ({"replay-samples": 16}, "replay-samples"),  # filled at phase ends: needs phases
        ({"ewc-lambda": 10.0}, "ewc-lambda"),
        ({"phases": 2, "phase-rounds": 5, "replay-samples": 16, "replay-ratio": 0.0}, "replay-ratio"),
        ({"replay-policy": "fifo"}, "replay-policy"),
        ({"replay-share": 0.0}, "replay-share"),
        ({"ewc-gamma": 1.5}, "ewc-gamma"),
        ({"phases": 2, "phase-rounds": 5, "ewc-server-lambda": 10.0}, "ewc-server-lambda"),  # no Fisher without EWC
        ({"phases": 2, "phase-rounds": 5, "ewc-lambda": 1.0, "ewc-server-lambda": -1.0}, "ewc-server-lambda"),
        ({"drift-new-classes": NUM_CLASSES - 1}, "drift-new-classes"),
    ],
)
def test_invalid_continual_config_names_the_key(values, key):
    with pytest.raises(ConfigError, match=key):
        RunConfig.from_flower({"num-server-rounds": 20, **values})


def test_every_continual_key_is_in_pyproject_with_the_recipe_value():
    import tomllib

    from fedind.config import recipe

    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        table = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    defaults = recipe().to_flower()
    for key in ("phases", "phase-rounds", "drift-regime-share", "drift-new-classes", "drift-speed-factor", "replay-samples",
                "replay-bytes", "replay-share", "replay-ratio", "replay-policy", "ewc-lambda", "ewc-gamma",
                "ewc-server-lambda"):
        assert table[key] == defaults[key], key


def test_phase_schedule():
    config = RunConfig(num_server_rounds=25, phases=3, phase_rounds=8)
    assert [config.phase_of(r) for r in (0, 1, 8, 9, 16, 17, 25)] == [0, 0, 0, 1, 1, 2, 2]
    assert config.phase_end_rounds() == (8, 16)  # the last phase (17..25) has no phase end
    # The sites' cosine learning rate restarts with every phase; the last one runs to the end.
    assert [config.lr_progress(r) for r in (1, 8, 9, 17)] == [0.0, 7 / 8, 0.0, 0.0]
    assert config.lr_progress(25) == 8 / 9
    static = RunConfig(num_server_rounds=10)
    assert static.phase_of(7) == 0 and static.phase_end_rounds() == () and static.lr_progress(6) == 0.5


def test_local_stretch_starts_at_its_phase():
    """``local-stretch-phase`` p: rounds of phases before p train unstretched; with one
    phase of static data, a stretch from phase 1 never starts."""
    config = RunConfig(num_server_rounds=25, phases=3, phase_rounds=8, local_stretch=1.25, local_stretch_phase=1)
    assert [config.local_stretch_at(r) for r in (1, 8, 9, 17, 25)] == [1.0, 1.0, 1.25, 1.25, 1.25]
    assert RunConfig(local_stretch=1.25).local_stretch_at(1) == 1.25  # phase 0: from the start
    assert RunConfig(local_stretch=1.25, local_stretch_phase=1).local_stretch_at(80) == 1.0
    with pytest.raises(ConfigError, match="local-stretch-phase"):
        RunConfig(local_stretch_phase=-1)
    with pytest.raises(ConfigError, match="local-stretch-phase = 3: the run has phases 0..2"):
        RunConfig(num_server_rounds=25, phases=3, phase_rounds=8, local_stretch_phase=3)


def test_local_stretch_ramps_up_from_its_start():
    """``local-stretch-ramp`` K: r ** (k / K) in the k-th round of the stretch, counted from
    the first round of ``local-stretch-phase``, then r."""
    ramped = RunConfig(local_stretch=1.25, local_stretch_ramp=4, phases=2, phase_rounds=8, num_server_rounds=16)
    assert [ramped.local_stretch_at(r) for r in (1, 2, 4, 5, 16)] == pytest.approx(
        [1.25 ** 0.25, 1.25 ** 0.5, 1.25, 1.25, 1.25])
    later = replace(ramped, local_stretch_phase=1)
    assert [later.local_stretch_at(r) for r in (8, 9, 10, 12, 13)] == pytest.approx([1.0, 1.25 ** 0.25, 1.25 ** 0.5, 1.25, 1.25])
    assert RunConfig(local_stretch_ramp=4).local_stretch_at(1) == 1.0  # no stretch, nothing to ramp
    with pytest.raises(ConfigError, match="local-stretch-ramp"):
        RunConfig(local_stretch_ramp=-2)


def test_local_stretch_waits_its_delay_then_ramps():
    """``local-stretch-delay`` d: the stretch's first d rounds train plain; a ramp counts
    from the first stretched round."""
    delayed = RunConfig(local_stretch=1.25, local_stretch_delay=3, phases=2, phase_rounds=8, num_server_rounds=16)
    assert [delayed.local_stretch_at(r) for r in (1, 3, 4, 9, 16)] == [1.0, 1.0, 1.25, 1.25, 1.25]
    ramped = replace(delayed, local_stretch_ramp=2)
    assert [ramped.local_stretch_at(r) for r in (3, 4, 5, 6)] == pytest.approx([1.0, 1.25 ** 0.5, 1.25, 1.25])
    later = replace(delayed, local_stretch_phase=1)
    assert [later.local_stretch_at(r) for r in (4, 9, 11, 12)] == [1.0, 1.0, 1.0, 1.25]
    with pytest.raises(ConfigError, match="local-stretch-delay"):
        RunConfig(local_stretch_delay=-1)


# --------------------------------------------------------------------------- drifting data


def test_drift_holds_the_new_class_back_then_shows_it_at_one_line():
    source = new_class_site(DRIFT)
    assert phase_classes(DRIFT, 0) == NUM_CLASSES - 1 and phase_classes(DRIFT, 1) == NUM_CLASSES
    for i in range(SMALL.num_sites):
        train0, test0 = phase_site(DRIFT, i, 0)
        assert train0.y.max() < NUM_CLASSES - 1 and test0.y.max() < NUM_CLASSES - 1
        labels1 = np.concatenate([s.y for s in phase_site(DRIFT, i, 1)])
        assert ((labels1 == NUM_CLASSES - 1).any()) == (i == source)
    assert phase_global_test(DRIFT, 0).y.max() == NUM_CLASSES - 2
    assert set(phase_global_test(DRIFT, 1).y.tolist()) == set(range(NUM_CLASSES))


def test_drift_changes_the_regime_of_the_drawn_lines_only():
    for phase in (1, 2):
        moved = drifted_sites(DRIFT, phase)
        assert len(moved) == round(0.5 * SMALL.num_sites)
        before, after = phase_regimes(DRIFT, phase - 1), phase_regimes(DRIFT, phase)
        assert [i for i in range(SMALL.num_sites) if before[i] != after[i]] == list(moved)
        assert all(30.0 <= after[i].shaft_hz <= 45.0 for i in moved)  # 1.5 x the 20-30 Hz of phase 0
    # a pure function of the spec
    a, b = phase_site(DRIFT, 1, 2), phase_site(replace(DRIFT), 1, 2)
    assert np.array_equal(a[0].x, b[0].x) and np.array_equal(a[0].y, b[0].y)


def test_phase_layout_on_disk_newest_batch_and_validation(tmp_path):
    root = write_drift_federation(DRIFT, tmp_path / "plant")
    meta = json.loads((root / "meta.json").read_text())
    assert meta["num_classes"] == NUM_CLASSES - 1  # the initial model's classes
    site = "line-01"
    for phase in range(3):
        train, _ = load_site(root, site, phase=phase)
        assert np.array_equal(train.y, phase_site(DRIFT, 1, phase)[0].y)
    info = validate_phases(root, 3)
    assert info["max_label"] == NUM_CLASSES - 1 and info["phase_tests"] == [0, 1, 2]
    # a line without a new batch keeps its newest one
    for f in (root / "sites" / site / "phase-2").iterdir():
        f.unlink()
    (root / "sites" / site / "phase-2").rmdir()
    assert batch_dir(root / "sites" / site, 2) == root / "sites" / site / "phase-1"
    assert np.array_equal(load_site(root, site, phase=2)[0].y, phase_site(DRIFT, 1, 1)[0].y)
    # a half-copied batch folder, or a bad batch, stops the run naming the file
    (root / "sites" / site / "phase-2").mkdir()
    with pytest.raises(DataFormatError, match="phase-2: batch folder has no train.npz"):
        validate_phases(root, 3)
    bad = SiteArrays(np.zeros((4, 1, 128), np.float32), np.zeros(4, np.int64))  # another window length
    write_split(root / "sites" / site / "phase-2" / "train.npz", bad)
    with pytest.raises(DataFormatError, match=r"phase-2/train.npz: sample shape"):
        validate_phases(root, 3)


# --------------------------------------------------------------------------- site helpers


def test_known_labels_and_replay_capacity():
    data = SiteArrays(np.zeros((5, 1, 8), np.float32), np.array([0, 3, 1, 3, 2]))
    assert known(data, 3).y.tolist() == [0, 1, 2] and known(data, 4) is data
    assert [replay_capacity(64, 0.1, w) for w in (0, 9, 10, 199, 5000)] == [0, 0, 1, 19, 64]


def test_restored_replay_buffer_grows_with_the_head_and_keeps_its_windows():
    rng = np.random.default_rng(0)
    buffer = ReplayBuffer(8, 8 * (4 * 16 + 12) + 16 * 3, (1, 16), 3, policy="balanced-loss", seed=1)
    x, y = rng.normal(size=(20, 1, 16)).astype(np.float32), rng.integers(0, 3, 20)
    buffer.offer(x, y, rng.random(20).astype(np.float32))
    grown = restore_replay(buffer.state_dict(), max_samples=8, max_bytes=0, sample_shape=(1, 16), num_classes=4,
                           policy="balanced-loss", seed=1)
    assert grown.num_classes == 4 and len(grown) == 8 and grown.nbytes <= grown.max_bytes
    assert np.array_equal(grown.arrays().y, buffer.arrays().y)
    with pytest.raises(ValueError, match="classes"):
        restore_replay(grown.state_dict(), max_samples=8, max_bytes=0, sample_shape=(1, 16), num_classes=3,
                       policy="balanced-loss", seed=1)


def _four_classes() -> tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features of 3 old classes and a new one, each around its own direction, and an old
    head that knows the old classes only: ``(centres, labels, features, weight, bias)``."""
    rng = np.random.default_rng(0)
    centres = 3.0 * np.eye(4, 6)
    labels = np.repeat(np.arange(4), [30, 30, 30, 6])
    features = torch.from_numpy(centres[labels] + 0.3 * rng.standard_normal((labels.size, 6)))
    return centres, labels, features, torch.from_numpy(centres[:3].copy()), torch.zeros(3, dtype=torch.float64)


def _picks_out_the_new_class(centres, labels, features, rows, biases) -> bool:
    logits = np.concatenate([features.numpy() @ centres[:3].T, features.numpy() @ rows.T + biases], axis=1)
    return np.mean(logits.argmax(1)[labels == 3] == 3) == 1.0 and np.mean(logits.argmax(1)[labels < 3] == 3) == 0.0


def test_fitted_new_rows_recognise_the_new_class_and_leave_the_old_rows_alone():
    centres, labels, features, weight, bias = _four_classes()
    rows, biases = fit_new_rows(features, torch.from_numpy(labels), weight, bias, 4)
    assert rows.shape == (1, 6) and biases.shape == (1,) and rows.dtype == np.float32
    assert _picks_out_the_new_class(centres, labels, features, rows, biases)
    assert torch.equal(weight, torch.from_numpy(centres[:3]))  # the old rows are not touched
    # weight decay keeps the row bounded on separable data; a stronger one shrinks it
    strong, _ = fit_new_rows(features, torch.from_numpy(labels), weight, bias, 4, weight_decay=1.0)
    assert 0 < np.linalg.norm(strong) < np.linalg.norm(rows) < 1e3
    with pytest.raises(ValueError, match="Invalid row fit"):
        fit_new_rows(features, torch.from_numpy(labels), weight, bias, 3)


def test_a_row_fitted_at_the_old_rows_norm_has_that_norm_and_still_recognises_the_new_class():
    centres, labels, features, weight, bias = _four_classes()
    rows, biases = fit_new_rows(features, torch.from_numpy(labels), weight, bias, 4, row_norm=3.0)
    assert np.linalg.norm(rows[0]) == pytest.approx(3.0, rel=1e-5)
    assert _picks_out_the_new_class(centres, labels, features, rows, biases)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="row_norm"):
            fit_new_rows(features, torch.from_numpy(labels), weight, bias, 4, row_norm=bad)


def test_row_proposals_are_merged_weighted_by_the_windows_of_each_class():
    a = (np.array([[1.0, 0.0], [5.0, 5.0]]), np.array([1.0, 9.0]), np.array([3, 0]))  # no windows of class 5
    b = (np.array([[0.0, 1.0]]), np.array([3.0]), np.array([1]))
    merged = merge_row_proposals([a, b], old=4, new=6, dim=2)
    assert list(merged) == [4]  # nobody has windows of class 5: it keeps the default start
    np.testing.assert_allclose(merged[4][0], [0.75, 0.25]) and merged[4][1] == pytest.approx(1.5)
    for bad in [(np.zeros((1, 3)), np.zeros(1), np.ones(1)), (np.full((1, 2), np.inf), np.zeros(1), np.ones(1)),
                (np.zeros((1, 2)), np.zeros(1), -np.ones(1)), (np.zeros((3, 2)), np.zeros(3), np.ones(3))]:
        with pytest.raises(ValueError, match="Invalid row proposal"):
            merge_row_proposals([bad], old=4, new=6, dim=2)


def test_forgetting_oracle():
    after = [[0.8], [0.6, 0.7], [0.5, 0.75, 0.9]]
    # phase 0: best 0.8 -> 0.5; phase 1: best 0.7 -> 0.75 (no forgetting: -0.05)
    assert forgetting(after) == pytest.approx(((0.8 - 0.5) + (0.7 - 0.75)) / 2)
    assert forgetting([[0.9]]) is None


# --------------------------------------------------------------------------- strategy state follows the head


def _arrays(num_classes: int, value: float = 0.0) -> ArrayRecord:
    return ArrayRecord({
        "features.w": Array(np.full((2, 3), value, np.float32)),
        "head.weight": Array(np.full((num_classes, 2), value, np.float32)),
        "head.bias": Array(np.full(num_classes, value, np.float32)),
    })


@pytest.mark.parametrize("strategy", ["fedavgm", "fedadam", "dwa"])
def test_strategy_state_is_padded_when_the_head_grows(strategy):
    s = build_strategy(RunConfig(strategy=strategy), num_sites=2, num_classes=3)
    if isinstance(s, FedAvgM):
        s.current_arrays = _arrays(3)
        s.momentum_vector = [np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), np.ones(3, np.float32)]
    elif isinstance(s, FedAdam):
        s.m_t = {k: np.ones_like(v.numpy()) for k, v in _arrays(3).items()}
        s.v_t = {k: np.ones_like(v.numpy()) for k, v in _arrays(3).items()}
    else:
        s.current_arrays = _arrays(3)
        s.global_histogram.update("line-00", [1, 2, 3])
        s.buffer.step({k: np.ones_like(v.numpy()) for k, v in _arrays(3).items()})
    grow_strategy_classes(s, _arrays(5), 5)
    flat = strategy_state(s)
    if isinstance(s, FedAvgM):
        assert [v.shape for v in s.momentum_vector] == [(2, 3), (5, 2), (5,)]
        assert s.momentum_vector[2].tolist() == [1, 1, 1, 0, 0]
    elif isinstance(s, FedAdam):
        assert s.m_t["head.bias"].tolist() == [1, 1, 1, 0, 0] and s.v_t["head.weight"].shape == (5, 2)
    else:
        state = flat["state_dict"]
        assert state["global_histogram"]["sites"]["line-00"] == [1, 2, 3, 0, 0]
        assert state["momentum"]["buffers"]["head.weight"].shape == (5, 2) and s.num_classes == 5


def _controller(**config) -> PhaseController:
    config = RunConfig(**{"num_server_rounds": 4, "phases": 2, "phase_rounds": 2, "ewc_lambda": 1.0, **config})
    return PhaseController(
        config, strategy=build_strategy(config, num_sites=1), grid=None, node_ids=[], num_classes=3,
        initial_classes=3, test_sets=[None, None], device=None, folder=Path("."), run_config_json="{}",
    )


@pytest.mark.parametrize("kappa, expected", [(0.0, [2.0, 2.0]), (1.0, [2.0, 1.0])])
def test_the_server_damps_the_aggregate_towards_the_anchors_after_a_phase_end(kappa, expected):
    controller = _controller(ewc_server_lambda=kappa)
    aggregate = ArrayRecord({"w": Array(np.float32([2.0, 2.0]))})
    assert controller.end_of_round(3, aggregate, [])["w"].numpy().tolist() == [2.0, 2.0]  # no phase ended yet
    controller.ewc.consolidate([{"w": np.float32([0.0, 1.0])}], [1.0], {"w": np.float32([0.0, 0.0])})
    assert controller.end_of_round(3, aggregate, [])["w"].numpy().tolist() == expected


def _train_reply(seen: int, proposal: dict | None = None) -> Message:
    instruction = Message(RecordDict({"config": ConfigRecord({})}), message_type=MessageType.TRAIN, dst_node_id=1)
    content = RecordDict({wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 10, wire.CLASSES_SEEN: seen})})
    if proposal is not None:
        content[wire.NEW_CLASSES] = ConfigRecord(proposal)
    return Message(content, reply_to=instruction)


def test_the_head_grows_from_the_proposed_row_and_a_malformed_proposal_is_left_out(flower_task_identity, caplog):
    controller = _controller(ewc_lambda=0.0)  # no phase-end query to send
    arrays = ArrayRecord({"head.weight": Array(np.ones((3, 2), np.float32)), "head.bias": Array(np.zeros(3, np.float32))})
    good = _train_reply(4, {wire.NEW_ROWS: [0.5, -0.5, 2.0], wire.NEW_COUNTS: [7]})
    bad = _train_reply(4, {wire.NEW_ROWS: [float("nan"), 0.0, 1.0], wire.NEW_COUNTS: [3]})
    short = _train_reply(4, {wire.NEW_ROWS: [0.5], wire.NEW_COUNTS: [3]})
    grown = controller.end_of_round(1, arrays, [good, bad, short, _train_reply(3)])
    np.testing.assert_array_equal(grown["head.weight"].numpy(), [[1, 1]] * 3 + [[0.5, -0.5]])
    np.testing.assert_array_equal(grown["head.bias"].numpy(), [0, 0, 0, 2.0])
    assert caplog.text.count("proposes invalid new-class rows") == 2
    assert controller.expansions == [{"round": 1, "from": 3, "to": 4, "proposed_rows": [3]}]

    # until the phase ends (round 2), the holders refit the grown row and their fit replaces the average
    assert controller.young_from == 3
    assert controller.train_records(2)[wire.NEW_CLASSES][wire.REFIT_FROM] == 3
    averaged = ArrayRecord({"head.weight": Array(np.full((4, 2), 9.0, np.float32)),
                            "head.bias": Array(np.zeros(4, np.float32))})
    refit = controller.end_of_round(2, averaged, [_train_reply(4, {wire.NEW_ROWS: [0.25, 0.75, -1.0], wire.NEW_COUNTS: [2]})])
    np.testing.assert_array_equal(refit["head.weight"].numpy(), [[9, 9]] * 3 + [[0.25, 0.75]])
    np.testing.assert_array_equal(refit["head.bias"].numpy(), [0, 0, 0, -1.0])
    assert controller.young_from is None and wire.NEW_CLASSES not in controller.train_records(3)
    state = controller.state_dict()
    assert state["young_from"] is None
    controller.load_state_dict({**state, "young_from": 3})
    assert controller.young_from == 3
    with pytest.raises(ValueError, match="young_from"):
        controller.load_state_dict({**state, "young_from": 9})


def test_row_bounds_are_the_factor_times_the_largest_row_around_the_mean_bias():
    assert row_bounds(np.array([[3.0, 4.0], [0.0, 1.0]]), np.array([1.0, 3.0]), factor=10.0) == (50.0, -48.0, 52.0)
    with pytest.raises(ValueError, match="Invalid row bounds"):
        row_bounds(np.zeros((0, 2)), np.zeros(0))


# A head at its initial scale (largest row norm 0.6) and the proposal a line fitted for a new
# class on it (a row of norm 37x that, bias 13x: the two-phase run below proposes 36x and 13x).
YOUNG_HEAD = {"head.weight": np.array([[0.6, 0.0], [0.0, 0.5], [-0.3, 0.3]], np.float32),
              "head.bias": np.array([0.1, -0.1, 0.0], np.float32)}
HONEST_ROW = [18.0, -13.0, 7.8]  # row, then bias


def _young_head() -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in YOUNG_HEAD.items()})


@pytest.mark.parametrize("scale", [10.0, 100.0])
def test_a_scaled_proposal_is_refused_with_a_logged_reason_and_the_honest_one_is_merged(
    flower_task_identity, caplog, scale
):
    controller = _controller(ewc_lambda=0.0)
    honest = _train_reply(4, {wire.NEW_ROWS: HONEST_ROW, wire.NEW_COUNTS: [5]})
    scaled = _train_reply(4, {wire.NEW_ROWS: [scale * v for v in HONEST_ROW], wire.NEW_COUNTS: [5]})
    grown = controller.end_of_round(1, _young_head(), [scaled, honest])
    np.testing.assert_allclose(grown["head.weight"].numpy()[3], HONEST_ROW[:2])  # the honest row alone, not diluted
    assert grown["head.bias"].numpy()[3] == pytest.approx(HONEST_ROW[2])
    assert caplog.text.count("proposes invalid new-class rows") == 1
    assert "class 3 has a row of norm" in caplog.text and "beyond 100x the model's largest row norm" in caplog.text
    assert controller.expansions == [{"round": 1, "from": 3, "to": 4, "proposed_rows": [3]}]


def test_a_refused_proposal_does_not_stop_the_round_the_row_starts_as_without_one(flower_task_identity, caplog):
    controller = _controller(ewc_lambda=0.0)
    blown = _train_reply(4, {wire.NEW_ROWS: [0.0, 0.0, 1e3], wire.NEW_COUNTS: [5]})  # a bias that takes every prediction
    grown = controller.end_of_round(1, _young_head(), [blown, _train_reply(3)])
    np.testing.assert_array_equal(grown["head.weight"].numpy()[3], [0.0, 0.0])  # W = 0, b = min b
    assert grown["head.bias"].numpy()[3] == pytest.approx(-0.1)
    assert controller.expansions == [{"round": 1, "from": 3, "to": 4, "proposed_rows": []}]
    assert "bias 1000" in caplog.text
    # a refit beyond the bound keeps the aggregated young row
    averaged = ArrayRecord({"head.weight": Array(np.vstack([YOUNG_HEAD["head.weight"], [[0.2, 0.2]]])),
                            "head.bias": Array(np.append(YOUNG_HEAD["head.bias"], -0.1).astype(np.float32))})
    kept = controller.end_of_round(2, averaged, [_train_reply(4, {wire.NEW_ROWS: [100.0, 0.0, 0.0], wire.NEW_COUNTS: [5]})])
    np.testing.assert_array_equal(kept["head.weight"].numpy(), averaged["head.weight"].numpy())


def test_a_site_proposes_rows_from_the_first_young_class_on():
    torch.manual_seed(0)
    model = FaultCNN(in_channels=1, num_classes=4, width=8)
    rng = np.random.default_rng(0)
    data = SiteArrays(rng.standard_normal((20, 1, 256)).astype(np.float32), np.repeat(np.arange(5), 4))
    rows, biases, counts = propose_new_rows(model, data, 5, 0.5, torch.device("cpu"), first=3)
    assert rows.shape == (2, 32) and biases.shape == (2,) and counts.tolist() == [4, 4]
    scale = model.head.weight.detach()[:3].double().norm(dim=1).mean().item()
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), scale, rtol=1e-5)  # at the trained rows' norm
    assert propose_new_rows(model, data, 5, 0.5, torch.device("cpu"))[0].shape == (1, 32)  # beyond the head only
    with pytest.raises(ValueError, match="first class"):
        propose_new_rows(model, data, 5, 0.5, torch.device("cpu"), first=5)


def test_replayed_windows_keep_a_proposed_row_from_winning_everywhere():
    """A line whose new windows are all of the new class: fitted on them alone, the new row
    wins on every window (nothing tells it where to stop); with the line's replayed windows
    as counter-examples it wins on none of the old classes' windows."""
    torch.manual_seed(0)
    model = FaultCNN(in_channels=1, num_classes=3, width=8)
    rng = np.random.default_rng(1)
    t = np.arange(256)

    def windows(k, n):
        tone = np.sin(2 * np.pi * (k + 1) * 4 * t / 256)[None, None, :]
        return (tone + 0.3 * rng.standard_normal((n, 1, 256))).astype(np.float32)

    old = SiteArrays(np.concatenate([windows(k, 10) for k in range(3)]), np.repeat(np.arange(3), 10))
    new = SiteArrays(windows(3, 10), np.full(10, 3))
    features = torch.from_numpy(window_features(model, old.x, torch.device("cpu"), 64)).double()
    trained = features @ model.head.weight.detach().double().T + model.head.bias.detach().double()
    called_new = {}
    for name, replayed in (("alone", None), ("with replay", old)):
        rows, biases, counts = propose_new_rows(model, new, 4, 0.5, torch.device("cpu"), replayed=replayed)
        assert counts.tolist() == [10]  # the line's own windows of the class, not the replayed ones
        proposed = features @ torch.from_numpy(rows).double().T + torch.from_numpy(biases).double()
        called_new[name] = float((proposed[:, 0] > trained.max(dim=1).values).double().mean())
    assert called_new == {"alone": 1.0, "with replay": 0.0}


# --------------------------------------------------------------------------- a short two-phase run

SHORT = dict(
    num_server_rounds=3, num_sites=3, samples_per_site=40, local_epochs=1, batch_size=8, learning_rate=0.01,
    model_width=16, device="cpu", seed=0, phases=2, phase_rounds=2, replay_samples=64, replay_share=0.2,
    replay_ratio=0.5, ewc_lambda=50.0, drift_regime_share=0.5,
)


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def two_phase_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs")
    config = RunConfig(**SHORT, run_dir=str(run_dir), run_name="cl")
    return simulate(config, runtime="loopback"), run_dir / "cl", config


def test_the_head_grows_and_every_site_adopts_it(two_phase_run):
    summary, folder, _ = two_phase_run
    c = summary["continual"]
    assert c["initial_classes"] == NUM_CLASSES - 1 and c["classes"] == NUM_CLASSES
    # first round of phase 1; the line that has the new class proposed its row
    assert c["expansions"] == [{"round": 3, "from": NUM_CLASSES - 1, "to": NUM_CLASSES, "proposed_rows": [NUM_CLASSES - 1]}]
    assert head_classes(load_file(folder / "model.safetensors")) == NUM_CLASSES
    rounds = _rows(folder / "rounds.csv")
    assert all(int(r["sites"]) == 3 and int(r["failures"]) == 0 for r in rounds)  # no reply rejected, before or after
    assert set(summary["per_site"]) == {"line-00", "line-01", "line-02"}  # each scored the grown model
    phases = _rows(folder / "phases.csv")
    assert [int(r["classes"]) for r in phases] == [9, 9, 9, 10]
    assert phases[-1]["accuracy_phase_1"] != "" and phases[1]["accuracy_phase_1"] == ""
    assert c["new_class_accuracy"] is not None and c["forgetting"] is not None


def test_replay_stays_within_its_bounds_and_ewc_records_travel(two_phase_run):
    summary, folder, config = two_phase_run
    replay = summary["continual"]["replay"]
    assert replay["max_samples"] > 0
    for entry in replay["per_site"].values():
        capacity = replay_capacity(config.replay_samples, config.replay_share, entry["windows"])
        assert 0 < entry["samples"] <= capacity <= config.replay_share * entry["windows"]
        assert entry["bytes"] <= replay_bytes(0, capacity, (1, 1024), NUM_CLASSES)
    rounds = _rows(folder / "rounds.csv")
    # after the phase end, every train message also carries the Fisher and the anchors (~2 models)
    assert int(rounds[2]["downlink_bytes"]) > 2.5 * int(rounds[0]["downlink_bytes"])
    assert summary["continual"]["ewc_bytes_per_train_message"] > 0


def test_ewc_state_is_checkpointed_and_survives_a_resume(two_phase_run):
    summary, folder, config = two_phase_run
    saved = CheckpointStore(folder / "checkpoints").load_latest()
    ewc = saved.state["continual"]["ewc"]
    assert saved.round == 3 and ewc["phases"] == 1
    assert ewc["fisher"]["head.weight"].shape[0] == NUM_CLASSES  # padded when the head grew
    assert not ewc["fisher"]["head.weight"][NUM_CLASSES - 1].any()  # the new row is unconstrained
    resumed = simulate(replace(config, resume=True, num_server_rounds=4), runtime="loopback")
    assert resumed["rounds"] == 4 and resumed["continual"]["classes"] == NUM_CLASSES
    again = CheckpointStore(folder / "checkpoints").load_latest()
    assert again.round == 4
    for part in ("fisher", "anchors"):
        for name, value in ewc[part].items():
            assert np.array_equal(again.state["continual"]["ewc"][part][name], value)
    rounds = _rows(folder / "rounds.csv")
    assert int(rounds[3]["downlink_bytes"]) > 2.5 * int(rounds[0]["downlink_bytes"])  # still sent after the resume


def test_with_young_rows_holders_a_grown_row_is_averaged_over_its_holders_not_refit(flower_task_identity):
    """young-rows = holders: the server keeps the aggregate, asks for no refit, and DWA
    averages the grown rows over the sites that hold them until the phase ends."""
    controller = _controller(ewc_lambda=0.0, strategy="fedind", young_rows="holders")
    arrays = ArrayRecord({"head.weight": Array(np.ones((3, 2), np.float32)), "head.bias": Array(np.zeros(3, np.float32))})
    grown = controller.end_of_round(1, arrays, [_train_reply(4, {wire.NEW_ROWS: [0.5, -0.5, 2.0], wire.NEW_COUNTS: [7]})])
    np.testing.assert_array_equal(grown["head.weight"].numpy(), [[1, 1]] * 3 + [[0.5, -0.5]])  # grown from the proposal
    assert controller.young_from == 3 and controller.strategy.holder_rows_from == 3
    assert wire.NEW_CLASSES not in controller.train_records(2)
    averaged = ArrayRecord({"head.weight": Array(np.full((4, 2), 9.0, np.float32)),
                            "head.bias": Array(np.zeros(4, np.float32))})
    kept = controller.end_of_round(2, averaged, [_train_reply(4, {wire.NEW_ROWS: [0.25, 0.75, -1.0], wire.NEW_COUNTS: [2]})])
    np.testing.assert_array_equal(kept["head.weight"].numpy(), np.full((4, 2), 9.0))
    assert controller.young_from is None and controller.strategy.holder_rows_from is None  # the phase ended
    controller.load_state_dict({**controller.state_dict(), "young_from": 3})  # a resumed run
    assert controller.strategy.holder_rows_from == 3


def test_young_rows_holders_is_refit_under_a_strategy_that_cannot_average_over_holders(flower_task_identity):
    """--run-config strategy='fedavgm' on top of the recipe runs, with the refit."""
    assert not RunConfig(strategy="fedind", young_rows="holders").refits_young_rows
    assert RunConfig(strategy="fedavgm", young_rows="holders").refits_young_rows
    controller = _controller(ewc_lambda=0.0, strategy="fedavgm", young_rows="holders")
    arrays = ArrayRecord({"head.weight": Array(np.ones((3, 2), np.float32)), "head.bias": Array(np.zeros(3, np.float32))})
    controller.end_of_round(1, arrays, [_train_reply(4, {wire.NEW_ROWS: [0.5, -0.5, 2.0], wire.NEW_COUNTS: [7]})])
    assert controller.train_records(2)[wire.NEW_CLASSES][wire.REFIT_FROM] == 3


def test_a_line_whose_windows_are_all_of_a_new_class_still_grows_the_head(tmp_path):
    """Phase 1 gives the new-class line nothing but the new class: it trains on nothing (the
    head lacks the class) yet replies, so the head grows and no reply fails (at seed 8,
    alpha 0.1 of the plant benchmark two lines failed every round of phase 1 instead)."""
    from fedind.data.federation import site_ids

    config = RunConfig(**{**SHORT, "strategy": "fedind", "compression": "topk", "young_rows": "holders"},
                       run_dir=str(tmp_path / "runs"), run_name="only-new")
    root = write_drift_federation(config.drift_spec(), tmp_path / "data")
    holder = site_ids(config.num_sites)[new_class_site(config.drift_spec())]
    path = batch_dir(root / "sites" / holder, 1) / "train.npz"
    with np.load(path) as npz:
        x, y = npz["x"], npz["y"]
    new = y == NUM_CLASSES - 1
    assert new.any() and not new.all()
    write_split(path, SiteArrays(x[new], y[new]))
    summary = simulate(replace(config, data_root=str(root)), runtime="loopback")
    assert summary["continual"]["classes"] == NUM_CLASSES  # the line's reply said so
    assert all(int(r["failures"]) == 0 for r in _rows(tmp_path / "runs" / "only-new" / "rounds.csv"))
