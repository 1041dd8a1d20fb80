"""Head calibration on virtual features (fedind.continual.calibration): moments, merging,
the wire form, the refit, and the server's use of train replies (fedind.server.continual)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedind import wire
from fedind.continual.calibration import (
    agreeing,
    bounded_moments,
    calibrate_head,
    class_moments,
    decode_moments,
    encode_moments,
    merge_moments,
    shrunk_covariances,
    triangle,
    untriangle,
)


def _blobs(rng, centres, n, spread=0.5):
    z = np.concatenate([c + spread * rng.standard_normal((n, len(c))) for c in centres])
    return z, np.repeat(np.arange(len(centres)), n)


def test_merged_moments_are_those_of_the_union():
    """Sites' per-class moments merge into exactly the moments of all their windows."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal((200, 5)) + np.arange(5)
    y = rng.integers(0, 4, 200)
    parts = [class_moments(z[:70], y[:70]), class_moments(z[70:150], y[70:150]), class_moments(z[150:], y[150:])]
    counts, means, scatter = merge_moments(parts, num_classes=6)
    whole = class_moments(z, y)
    np.testing.assert_array_equal(counts[:4], whole.counts)
    assert counts[4:].tolist() == [0, 0]
    np.testing.assert_allclose(means[:4], whole.means)
    np.testing.assert_allclose(scatter[:4], whole.counts[:, None, None] * whole.covariances, atol=1e-9)


def test_shrinkage_pulls_a_thin_class_towards_the_pooled_covariance():
    counts = np.array([400.0, 3.0])
    scatter = np.stack([400 * np.eye(2), 3 * np.diag([1e-6, 1e-6])])
    shrunk = shrunk_covariances(counts, scatter, strength=2)
    np.testing.assert_allclose(shrunk[0], (400 * np.eye(2) + 2 * scatter.sum(0) / 403) / 402)
    # three windows alone give a needle (variance 1e-6); the pool gives it width: 2 / 5 of the pooled variance
    np.testing.assert_allclose(shrunk[1][0, 0], (3e-6 + 2 * 400 / 403) / 5)
    with pytest.raises(ValueError, match="no features"):
        shrunk_covariances(np.zeros(2), np.zeros((2, 2, 2)))


def test_the_wire_form_round_trips_within_the_int8_step():
    rng = np.random.default_rng(1)
    z, y = _blobs(rng, [np.zeros(6), np.ones(6), -np.ones(6)], 40)
    moments = class_moments(z, y)
    back = decode_moments(encode_moments(moments), num_classes=4, features=6)
    np.testing.assert_array_equal(back.classes, [0, 1, 2])
    np.testing.assert_array_equal(back.counts, [40, 40, 40])
    np.testing.assert_allclose(back.means, moments.means, rtol=1e-6)
    step = np.abs(triangle(moments.covariances)).max(axis=1) / 127
    assert np.all(np.abs(back.covariances - moments.covariances) <= step[:, None, None] / 2 + 1e-12)
    np.testing.assert_allclose(untriangle(triangle(moments.covariances), 6), moments.covariances)


@pytest.mark.parametrize("edit, match", [
    (lambda v: {k: x for k, x in v.items() if k != "scales"}, "expected classes"),
    (lambda v: {**v, "classes": [0, 0, 2]}, "classes"),
    (lambda v: {**v, "classes": [0, 1, 9]}, "a head of 4"),
    (lambda v: {**v, "counts": [40, 0, 40]}, "counts"),
    (lambda v: {**v, "counts": [40, 40]}, "one length"),
    (lambda v: {**v, "means": v["means"][:-4]}, "means: expected"),
    (lambda v: {**v, "means": np.full(18, np.nan, "<f4").tobytes()}, "finite"),
    (lambda v: {**v, "scales": np.float32([1, -1, 1]).tobytes()}, "scales >= 0"),
    (lambda v: {**v, "covariances": b"\x80" * len(v["covariances"])}, "-127..127"),
    (lambda v: {**v, "covariances": np.full(len(v["covariances"]), -5, np.int8).tobytes()}, "negative variance"),
])
def test_a_malformed_record_is_refused_with_its_fault(edit, match):
    rng = np.random.default_rng(2)
    z, y = _blobs(rng, [np.zeros(6), np.ones(6), -np.ones(6)], 40)
    with pytest.raises(ValueError, match=match):
        decode_moments(edit(encode_moments(class_moments(z, y))), num_classes=4, features=6)


def test_calibration_repairs_a_head_tilted_towards_one_class():
    """Three separable classes, a head that calls everything class 0 (the skew of one
    line's training): refit on virtual features from the moments, it separates them."""
    rng = np.random.default_rng(3)
    centres = [np.array([3.0, 0, 0, 0]), np.array([0, 3.0, 0, 0]), np.array([0, 0, 3.0, 0])]
    z, y = _blobs(rng, centres, 100)
    counts, means, scatter = merge_moments([class_moments(z, y)], num_classes=3)
    weight = np.zeros((3, 4), np.float32)
    bias = np.array([5.0, 0.0, 0.0], np.float32)
    assert np.mean(np.argmax(z @ weight.T + bias, axis=1) == y) < 0.4
    w, b = calibrate_head(weight, bias, counts, means, shrunk_covariances(counts, scatter), seed=0)
    assert w.dtype == np.float32 and w.shape == (3, 4) and b.shape == (3,)
    assert np.mean(np.argmax(z @ w.T + b, axis=1) == y) > 0.95
    again = calibrate_head(weight, bias, counts, means, shrunk_covariances(counts, scatter), seed=0)
    np.testing.assert_array_equal(again[0], w)  # seeded: the same moments give the same head
    with pytest.raises(ValueError, match="two classes"):
        calibrate_head(weight, bias, np.array([10.0, 0, 0]), means, scatter, seed=0)


def _mislabelled_line(rng, distance: float = 3.0, spread: float = 0.5, logged: int = 60):
    """Three classes in 4-D, three lines; line 0 holds ``logged`` windows of class 1 and
    logs them as class 0 (healthy). Returns the centres, the lines' ``(features, labels)``
    and the head of a model that learnt the classes (nearest centre)."""
    centres = np.stack([distance * np.eye(4)[i] for i in range(3)])

    def line(n1: int):
        z = np.concatenate([c + spread * rng.standard_normal((n, 4)) for c, n in zip(centres, (60, n1, 60))])
        return z, np.repeat(np.arange(3), (60, n1, 60))

    lines = [line(logged), line(30), line(30)]
    lines[0] = (lines[0][0], np.where(lines[0][1] == 1, 0, lines[0][1]))
    head = centres / spread ** 2, -0.5 * (centres ** 2).sum(axis=1) / spread ** 2
    return centres, lines, head


def test_agreeing_leaves_out_the_windows_the_head_contradicts():
    rng = np.random.default_rng(5)
    _, lines, (weight, bias) = _mislabelled_line(rng)
    z, y = lines[0]
    keep = agreeing(z, y, weight, bias, 0.01)
    truly = np.repeat(np.arange(3), 60)
    assert not keep[truly == 1].any()  # every class-1 window logged as healthy is left out
    assert keep[truly != 1].mean() > 0.95  # the line's true windows stay
    assert agreeing(z, y, weight, bias, 0.0).all()  # floor 0: every window
    # A class the head contradicts in every window (a row it has not learnt) keeps them all.
    blind = agreeing(z, y, weight, bias - np.array([0.0, 0.0, 1e3]), 0.01)
    assert blind[y == 2].all() and not blind[truly == 1].any()


def test_the_floor_keeps_a_mislabelling_line_from_calling_a_fault_healthy():
    """A line that holds most of class 1 and logs it as healthy: calibrated on every line's
    moments, the healthy Gaussian spreads over class 1 and the head calls much of it
    healthy; with the windows the received head contradicts left out, class 1 is recognised."""
    rng = np.random.default_rng(7)
    centres, lines, head = _mislabelled_line(rng, distance=2.0, spread=0.6, logged=200)
    test_z = np.concatenate([c + 0.6 * rng.standard_normal((300, 4)) for c in centres])
    test_y = np.repeat(np.arange(3), 300)

    def recall_1(floor: float) -> float:
        parts = [class_moments(z[agreeing(z, y, *head, floor)], y[agreeing(z, y, *head, floor)]) for z, y in lines]
        counts, means, scatter = merge_moments(parts, num_classes=3)
        w, b = calibrate_head(np.zeros((3, 4), np.float32), np.zeros(3, np.float32), counts, means,
                              shrunk_covariances(counts, scatter), seed=0)
        predicted = np.argmax(test_z @ w.T + b, axis=1)
        return float(np.mean(predicted[test_y == 1] == 1))

    assert recall_1(0.0) < 0.9
    assert recall_1(0.01) > recall_1(0.0) + 0.1


def _reply(moments_values, site: str = "line-01") -> Message:
    instruction = Message(RecordDict({"config": ConfigRecord({})}), message_type=wire.CALIBRATE, dst_node_id=1)
    content = RecordDict({wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 10}),
                          wire.SITE: ConfigRecord({wire.SITE_ID: site})})
    if moments_values is not None:
        content[wire.FEATURE_MOMENTS] = ConfigRecord(moments_values)
    return Message(content, reply_to=instruction)


def test_the_server_refits_the_head_from_the_replies_and_drops_a_bad_record(flower_task_identity, caplog):
    from tests.test_continual import _controller

    rng = np.random.default_rng(4)
    centres = [np.array([3.0, 0, 0, 0]), np.array([0, 3.0, 0, 0]), np.array([0, 0, 3.0, 0])]
    z, y = _blobs(rng, centres, 60)
    good = [encode_moments(class_moments(z[y != 2], y[y != 2])), encode_moments(class_moments(z[y == 2], y[y == 2]))]
    bad = {**good[0], "counts": [1, 2, 3]}
    controller = _controller(ewc_lambda=0.0, head_calibration=True)
    controller.declared = {"line-01": [60, 60, 0], "line-02": [0, 0, 60]}  # their train replies' histograms
    arrays = ArrayRecord({"head.weight": Array(np.zeros((3, 4), np.float32)),
                          "head.bias": Array(np.array([5.0, 0, 0], np.float32))})
    replies = [_reply(good[0]), _reply(good[1], "line-02"), _reply(bad, "line-03"), _reply(None, "line-04")]
    calibrated = controller.calibrated(4, arrays, replies)
    w, b = calibrated["head.weight"].numpy(), calibrated["head.bias"].numpy()
    assert np.mean(np.argmax(z @ w.T + b, axis=1) == y) > 0.95
    assert "feature moments of site line-03 dropped" in caplog.text and "of site line-04 dropped" in caplog.text
    assert "capped" not in caplog.text and "left out" not in caplog.text  # honest lines pass whole
    assert controller.calibrated(4, arrays, [_reply(None)]) is arrays  # nothing described: the head stays


def test_a_forged_record_cannot_outweigh_what_its_line_declared_in_training(flower_task_identity, caplog):
    """A line that claims 1,000 times its windows of class 0, with their mean on class 1's
    centre, would make the merged class 0 sit on class 1; capped at its declared windows it
    is one honest-sized voice among three and the refit head still separates the classes.
    A line that declared nothing in training, or a mean far outside the federation's, is left out."""
    from tests.test_continual import _controller

    rng = np.random.default_rng(5)
    centres = [np.array([3.0, 0, 0, 0]), np.array([0, 3.0, 0, 0]), np.array([0, 0, 3.0, 0])]
    z, y = _blobs(rng, centres, 60)
    honest = class_moments(z, y)
    forged = honest._replace(counts=honest.counts * 1000, means=honest.means[[1, 1, 2]])
    controller = _controller(ewc_lambda=0.0, head_calibration=True)
    controller.declared = {"line-01": [60, 60, 60], "line-02": [60, 60, 60], "line-03": [60, 60, 60]}
    arrays = ArrayRecord({"head.weight": Array(np.zeros((3, 4), np.float32)),
                          "head.bias": Array(np.zeros(3, np.float32))})
    replies = [_reply(encode_moments(honest), "line-01"), _reply(encode_moments(honest), "line-02"),
               _reply(encode_moments(forged), "line-03"), _reply(encode_moments(honest), "line-09")]
    calibrated = controller.calibrated(4, arrays, replies)
    w, b = calibrated["head.weight"].numpy(), calibrated["head.bias"].numpy()
    assert np.mean(np.argmax(z @ w.T + b, axis=1) == y) > 0.9
    assert "line line-03: counts [60000, 60000, 60000] of classes [0, 1, 2] capped at the declared [60, 60, 60]" in caplog.text
    assert "line line-09: declared no windows in training; left out" in caplog.text


def test_bounded_moments_caps_counts_and_leaves_out_far_classes():
    rng = np.random.default_rng(6)
    z, y = _blobs(rng, [np.array([1.0, 0, 0, 0]), np.array([0, 1.0, 0, 0])], 40)
    honest = class_moments(z, y)
    far = honest._replace(means=honest.means * np.array([[1.0], [50.0]]))  # class 1's mean 50x out
    kept, reasons = bounded_moments({"a": honest, "b": honest, "c": far, "d": honest},
                                    {"a": [40, 40], "b": [40, 10], "c": [40, 40]})
    assert [p.counts.tolist() for p in kept] == [[40, 40], [40, 10], [40]]
    np.testing.assert_array_equal(kept[0].means, honest.means)  # honest parts pass as they are
    assert kept[2].classes.tolist() == [0]
    assert reasons == [
        "line b: counts [40, 40] of classes [0, 1] capped at the declared [40, 10]",
        f"line c: classes [1] lie over 10x the median mean norm ({np.median(np.linalg.norm(np.concatenate([honest.means] * 3 + [far.means]), axis=1)):.3g}) or spread "
        f"({np.median(np.sqrt(np.trace(np.concatenate([honest.covariances] * 4), axis1=1, axis2=2))):.3g}); left out",
        "line d: declared no windows in training; left out",
    ]


def test_a_short_run_calibrates_its_final_head_from_the_sites_moments(tmp_path, caplog):
    """The real site agent and server (loopback): with head-calibration every site answers a
    calibration query after the last round with its moments, so only that round sends more
    than the same run without it, and the two runs are the same until then."""
    import csv
    from logging import INFO

    from fedind.config import RunConfig
    from fedind.simulation import simulate
    from tests.test_continual import SHORT

    def rounds(name: str, **extra) -> list[dict]:
        simulate(RunConfig(**SHORT, run_dir=str(tmp_path), run_name=name, **extra), runtime="loopback")
        with open(tmp_path / name / "rounds.csv", newline="") as f:
            return list(csv.DictReader(f))

    caplog.set_level(INFO)
    plain, calibrated = rounds("plain"), rounds("calibrated", head_calibration=True, calibration_label_floor=0.01)
    for before, after in zip(plain[:-1], calibrated[:-1]):
        assert (before["accuracy"], before["uplink_bytes"]) == (after["accuracy"], after["uplink_bytes"])
    assert int(calibrated[-1]["uplink_bytes"]) > int(plain[-1]["uplink_bytes"]) + 3 * 2000
    assert "round 3: head calibrated on the feature moments of 3 sites" in caplog.text
    assert "round 2: head calibrated" not in caplog.text
