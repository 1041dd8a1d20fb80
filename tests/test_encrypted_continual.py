"""The recipe's continual part under encryption: the Fisher and the feature moments summed
as side vectors (fedind.paillier.sums), young head rows averaged over their holders without
the server reading any site's rows, real ciphertexts (512-bit test keys). The end-to-end run
is tests/test_secure.py::test_the_recipe_runs_under_encryption_and_the_server_reads_no_site_s_fisher_or_moments."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedind import wire
from fedind.aggregation.weighting import class_row_scales
from fedind.continual.calibration import class_moments, merge_moments, moments_vector, vector_moments
from fedind.continual.ewc import aggregate_fishers
from fedind.paillier import packing
from fedind.paillier.sparse import head_rows
from fedind.paillier.sums import encrypt_side, flatten, parse_side, unflatten
from fedind.server.encrypted import encrypted_server
from tests.test_secure import (  # noqa: F401 (fixtures)
    CLIP, SHAPES, SiteGrid, arrays, close, config, key_files, run_round, site_side, sites_for,
)

pytestmark = pytest.mark.usefixtures("flower_task_identity")


def _site_vectors(key, vectors, windows):
    """Each site's side vector encrypted, summed with weights by windows, decrypted."""
    parsed = [parse_side(encrypt_side(v, key, np.random.default_rng(0))[0], key.public, v.size) for v in vectors]
    weights = packing.integer_weights(windows, packing.SIDE.max_weight)
    return packing.decrypt_sum(packing.weighted_sum(parsed, weights, key.public), key)


def test_encrypted_side_sums_are_the_pooled_fisher_and_the_merged_moments(key_files):
    key = key_files[0]
    rng = np.random.default_rng(0)
    windows = [128, 128, 256]  # weights 1/4, 1/4, 1/2: exact multiples of 1/512
    fishers = [{name: rng.gamma(0.5, 3.0, size=shape).astype(np.float32) for name, shape in SHAPES.items()}
               for _ in windows]
    summed = unflatten(_site_vectors(key, [flatten(f, SHAPES) for f in fishers], windows), SHAPES)
    pooled = aggregate_fishers(fishers, windows)
    for name in SHAPES:
        np.testing.assert_allclose(summed[name], pooled[name], rtol=1e-5, atol=1e-6)

    parts = []
    for s, n in enumerate(windows):  # classes 0..2 at every site, class 3 at the last only
        labels = rng.integers(0, 3 if s < 2 else 4, size=n)
        parts.append(class_moments(rng.normal(1.0 + labels[:, None], 0.5, size=(n, 4)), labels))
    counts, means, scatter = vector_moments(_site_vectors(key, [moments_vector(p, 5) for p in parts], windows),
                                            sum(windows), 5, 4)
    expected = merge_moments(parts, 5)
    np.testing.assert_array_equal(counts, expected[0])
    np.testing.assert_allclose(means, expected[1], atol=1e-5)
    np.testing.assert_allclose(scatter, expected[2], rtol=1e-4, atol=1e-3)
    assert counts[4] == 0 and not means[4].any()  # a class nobody holds stays empty


def _calibrate_reply(instruction: Message, record: dict, windows: int, site: str) -> Message:
    return Message(RecordDict({
        wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: windows}),
        wire.SITE: ConfigRecord({wire.SITE_ID: site}),
        wire.FEATURE_MOMENTS_ENCRYPTED: ConfigRecord(record),
    }), reply_to=instruction)


@pytest.mark.parametrize("forged", [False, True])
def test_the_head_is_refit_from_encrypted_moments_and_a_sum_over_the_declared_windows_is_refused(
        key_files, site_side, flwr_log, forged):
    """Three lines send encrypted moments; the server refits the head from their decrypted
    sum through a site. A line that claims ten times its windows of class 0 cannot be seen
    in the sum, but the sum then claims more windows than the lines declared in training:
    the head stays, with the reason logged."""
    from tests.test_continual import _controller

    key = key_files[0]
    cfg = config(key_files, strategy="fedavg")
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    sites, _ = sites_for(arrays(1))
    grid = SiteGrid(sites, site_side)
    strategy.grid, strategy.train_config = grid, ConfigRecord({wire.RUN_CONFIG: json.dumps(cfg.to_flower())})
    controller = _controller(ewc_lambda=0.0, head_calibration=True)
    controller.secure = strategy
    rng = np.random.default_rng(4)
    centres = np.array([[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0]])
    replies = []
    for i, site in enumerate(sites):
        labels = np.repeat([0, 1, 2], 20)
        z = centres[labels] + rng.normal(0, 0.7, size=(60, 4))
        moments = class_moments(z, labels)
        if forged and i == 2:
            moments = moments._replace(counts=moments.counts * [10, 1, 1])
        controller.declared[f"line-{site.node_id}"] = [20, 20, 20]
        instruction = Message(RecordDict({"config": ConfigRecord({})}), message_type=wire.CALIBRATE,
                              dst_node_id=site.node_id)
        record = encrypt_side(moments_vector(moments, 3), key, np.random.default_rng(0))[0]
        replies.append(_calibrate_reply(instruction, record, int(moments.counts.sum()), f"line-{site.node_id}"))
    from flwr.app import Array, ArrayRecord

    head = ArrayRecord({"head.weight": Array(np.zeros((3, 4), np.float32)),
                        "head.bias": Array(np.array([5.0, 0, 0], np.float32))})
    calibrated = controller.calibrated(4, head, replies)
    if forged:
        assert calibrated is head
        assert "claim [240] windows of classes [0], over the [60] the lines declared" in flwr_log.text
        return
    w, b = calibrated["head.weight"].numpy(), calibrated["head.bias"].numpy()
    z = centres[[0, 1, 2]]
    assert np.argmax(z @ w.T + b, axis=1).tolist() == [0, 1, 2]
    assert "head calibrated on the feature moments of 3 sites (180 windows, 3 classes)" in flwr_log.text
    assert grid.queries  # a site decrypted the sum


def test_young_rows_are_averaged_over_their_holders_without_the_server_reading_a_site_s_rows(key_files, site_side):
    """Class 2 grew this phase and only the third line holds it: its head rows move by that
    line's change, as DWA's young-rows = holders does in the clear, not by a third of it;
    the older rows are the weighted mean as before."""
    cfg = config(key_files)
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    strategy.average_over_holders(2)
    g = arrays(1)
    hists = [[30, 0, 0], [5, 5, 0], [20, 20, 20]]
    sites, locals_ = sites_for(g, counts=(30, 10, 60), hists=hists)
    new, _, _ = run_round(strategy, pipeline, SiteGrid(sites, site_side), g, cfg)
    w = np.array(packing.integer_weights([30, 10, 60]), np.float64) / packing.MAX_SITES
    scales = class_row_scales(w, hists)
    scales[:, :2] = 1.0
    deltas = [{k: np.clip(loc[k].astype(np.float64) - g[k], -CLIP, CLIP) for k in g} for loc in locals_]
    expected = {k: g[k] + sum(wi * d[k] for wi, d in zip(w, deltas)) for k in g}
    for name in ("head.weight", "head.bias"):
        rows = [s.reshape((-1,) + (1,) * (g[name].ndim - 1)) for s in scales]
        expected[name] = g[name] + sum(wi * r * d[name] for wi, r, d in zip(w, rows, deltas))
    # Each site rounds its scaled row within one step; the server divides the sum by the
    # class's mass sum_i w_i p_i(2) = 0.6 / 3, so the young rows are within step / 0.2.
    mass = (w @ (np.array(hists) / np.array(hists).sum(axis=1, keepdims=True)))[2]
    bound = packing.quantisation_bound(CLIP) / mass + 1e-6
    assert close(new, expected) <= bound
    assert abs(new["head.bias"].numpy()[2] - (g["head.bias"][2] + deltas[2]["head.bias"][2])) <= bound  # line 3's own


def test_head_rows_index_the_rows_of_young_classes_in_the_sites_flat_order():
    shapes = {"head.weight": (3, 2), "conv.weight": (2, 2), "head.bias": (3,)}  # sorted: conv 0..3, bias 4..6, weight 7..12
    indices, classes = head_rows(shapes, ("head.weight", "head.bias"), 1)
    assert indices.tolist() == [5, 6, 9, 10, 11, 12] and classes.tolist() == [1, 2, 1, 1, 2, 2]
    assert head_rows(shapes, ("head.weight", "head.bias"), 3)[0].size == 0


def test_a_side_sum_is_decrypted_only_as_one(key_files, site_side):
    """The decrypting site checks a side sum against the side layout: the same payload
    asked as a round's update sum, or under an unknown sum-of, is refused."""
    from fedind.paillier.site import decrypt_query

    key = key_files[0]
    cfg = config(key_files)
    sites, _ = sites_for(arrays(1))
    vectors = [parse_side(encrypt_side(np.ones(20), key, np.random.default_rng(0))[0], key.public, 20) for _ in range(2)]
    aggregate = packing.weighted_sum(vectors, [1, 1], key.public)
    for sum_of, refused in (("side", False), ("update", True), ("fisher", True)):
        query = Message(RecordDict({
            wire.ENCRYPTED_AGGREGATE: ConfigRecord(aggregate.to_config(key.public)),
            wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps(cfg.to_flower()), wire.SUM_OF: sum_of}),
        }), message_type=MessageType.QUERY, dst_node_id=1)
        site_side["site"] = True
        try:
            answer = decrypt_query(query, sites[0].context)
        finally:
            site_side["site"] = False
        assert answer.has_error() == refused
        if not refused:
            np.testing.assert_allclose(answer.content[wire.AGGREGATE]["mean"].numpy(), np.ones(20), atol=1e-6)
