"""Centered clipping and bucketing (fedind.aggregation.robust) against numeric oracles."""

import numpy as np
import pytest

from fedind.aggregation.robust import CenteredClipping, bucket_means, centered_clip


def test_bucket_means_keep_the_weighted_mean():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(7, 5)), rng.uniform(0.1, 1.0, size=7)
    means, totals = bucket_means(x, w, 3, np.random.default_rng(1))
    assert means.shape == (3, 5) and totals.shape == (3,)
    np.testing.assert_allclose(totals.sum(), w.sum())
    np.testing.assert_allclose(totals @ means, w @ x)


def test_bucket_means_oracle_and_zero_weight_bucket():
    x, w = np.array([[1.0], [3.0], [10.0], [20.0]]), np.array([1.0, 3.0, 0.0, 0.0])
    rng = np.random.default_rng(5)
    order = np.random.default_rng(5).permutation(4)
    means, totals = bucket_means(x, w, 2, rng)
    for b, members in enumerate((order[:2], order[2:])):
        wb = w[members]
        expect = np.average(x[members], axis=0, weights=wb) if wb.sum() else x[members].mean(axis=0)
        np.testing.assert_allclose(means[b], expect)
        assert totals[b] == wb.sum()


def test_centered_clip_oracle_one_iteration():
    x = np.array([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0]])
    w = np.array([1.0, 1.0, 2.0])
    v, clipped = centered_clip(x, w, np.zeros(2), radius=1.0)
    np.testing.assert_allclose(clipped, [[0.6, 0.8], [0.0, 1.0], [0.0, 0.0]])
    np.testing.assert_allclose(v, (np.array([0.6, 0.8]) + np.array([0.0, 1.0])) / 4)


def test_infinite_radius_is_the_weighted_mean():
    rng = np.random.default_rng(2)
    x, w = rng.normal(size=(5, 3)), rng.uniform(size=5)
    v, clipped = centered_clip(x, w, rng.normal(size=3), np.inf, iterations=3)
    np.testing.assert_allclose(v, np.average(x, axis=0, weights=w))
    np.testing.assert_allclose(clipped, x)


def test_one_huge_outlier_moves_the_aggregate_by_at_most_its_share_of_tau():
    x = np.zeros((10, 4))
    x[0] = 1e9
    w = np.full(10, 0.1)
    v, _ = centered_clip(x, w, np.zeros(4), radius=2.0)
    assert np.linalg.norm(v) == pytest.approx(0.1 * 2.0)


def test_edge_cases_one_site_and_identical():
    v, clipped = centered_clip(np.array([[2.0, 0.0]]), np.array([1.0]), np.zeros(2), radius=1.0)
    np.testing.assert_allclose(v, [1.0, 0.0])
    same = np.tile([1.0, -2.0], (4, 1))
    v, _ = centered_clip(same, np.ones(4), same[0], radius=0.0)  # at the centre: nothing to clip
    np.testing.assert_allclose(v, same[0])


@pytest.mark.parametrize("bad", [dict(radius=0.0), dict(radius=-1.0), dict(bucket_size=0), dict(beta=1.0),
                                 dict(iterations=0), dict(radius=float("nan"))])
def test_constructor_checks(bad):
    with pytest.raises(ValueError):
        CenteredClipping(**bad)


def test_invalid_inputs():
    with pytest.raises(ValueError):
        centered_clip(np.ones((2, 2)), np.array([1.0, -1.0]), np.zeros(2), 1.0)
    with pytest.raises(ValueError):
        centered_clip(np.ones((2, 2)), np.ones(2), np.zeros(3), 1.0)
    with pytest.raises(ValueError):
        bucket_means(np.array([[np.nan]]), np.ones(1), 1, np.random.default_rng(0))


def _deltas(rng, n):
    return [{"a": rng.normal(size=(2, 3)), "b": rng.normal(size=4)} for _ in range(n)]


def test_transform_identical_sites_pass_unchanged():
    d = {"a": np.ones((2, 3)), "b": -np.ones(4)}
    cc = CenteredClipping(radius=1.0, bucket_size=2)
    out, w = cc.transform([d] * 5, np.full(5, 0.2), server_round=1)
    assert len(out) == 3
    agg = {k: sum(wb * o[k] for wb, o in zip(w, out)) for k in d}
    for k in d:
        np.testing.assert_allclose(agg[k], d[k])
    np.testing.assert_allclose(cc.state_dict()["center"]["a"], 0.1 * d["a"])


def test_transform_single_site_and_outlier():
    rng = np.random.default_rng(3)
    cc = CenteredClipping(radius=2.0, bucket_size=1)
    out, w = cc.transform(_deltas(rng, 1), np.ones(1), server_round=1)
    assert len(out) == 1 and w.tolist() == [1.0]
    deltas = _deltas(rng, 10)
    deltas[4] = {k: v * 1e6 for k, v in deltas[4].items()}
    cc = CenteredClipping(radius=2.0, bucket_size=1)
    out, w = cc.transform(deltas, np.full(10, 0.1), server_round=2)
    agg = np.concatenate([sum(wb * o[k] for wb, o in zip(w, out)).ravel() for k in ("a", "b")])
    honest = max(np.linalg.norm(np.concatenate([d[k].ravel() for k in ("a", "b")])) for i, d in enumerate(deltas)
                 if i != 4)
    assert np.linalg.norm(agg) < 2 * honest


def test_transform_deterministic_state_and_shape_change():
    rng = np.random.default_rng(4)
    deltas, w = _deltas(rng, 6), np.full(6, 1 / 6)
    a, b = CenteredClipping(seed=7), CenteredClipping(seed=7)
    out_a, _ = a.transform(deltas, w, 3)
    out_b, _ = b.transform(deltas, w, 3)
    for x, y in zip(out_a, out_b):
        np.testing.assert_array_equal(x["a"], y["a"])
    c = CenteredClipping(seed=7)
    c.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(c.state_dict()["center"]["b"], a.state_dict()["center"]["b"])
    grown = [{"a": rng.normal(size=(3, 3)), "b": d["b"]} for d in deltas]  # a head that grew a row
    out, _ = a.transform(grown, w, 4)
    assert out[0]["a"].shape == (3, 3)
    with pytest.raises(ValueError):
        c.load_state_dict({"center": {"a": np.array([np.nan])}})
