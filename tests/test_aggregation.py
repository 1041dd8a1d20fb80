"""Numeric oracles for fedind.aggregation: DWA weights, conflict split, momentum buffer."""

import json

import numpy as np
import pytest

from fedind.aggregation.conflicts import (
    MomentumBuffer,
    conflict_aware_aggregate,
    sign_agreement,
    split_conflicts,
)
from fedind.aggregation.weighting import (
    GlobalHistogram,
    class_row_scales,
    dwa_weights,
    kl_divergence,
    scale_rows,
)

# --------------------------------------------------------------------------- kl_divergence


def test_kl_matches_formula():
    p, q = np.array([1.0, 2.0, 7.0]), np.array([3.0, 3.0, 4.0])
    pn, qn = p / p.sum(), q / q.sum()
    assert kl_divergence(p, q) == pytest.approx(np.sum(pn * np.log(pn / qn)), rel=1e-9)


def test_kl_of_equal_distributions_is_exactly_zero():
    assert kl_divergence([3, 6, 1], [30, 60, 10]) == 0.0
    assert kl_divergence([0.2, 0.0, 0.8], [0.2, 0.0, 0.8]) == 0.0


def test_kl_zero_terms_and_unseen_classes_are_finite():
    # p = 0 where q > 0: that term contributes nothing.
    assert kl_divergence([1, 0], [1, 1]) == pytest.approx(np.log(2.0))
    # q = 0 where p > 0 (class unseen globally): large but finite.
    value = kl_divergence([1, 1], [1, 0])
    assert np.isfinite(value) and value > 10
    # All-zero histograms carry no information.
    assert kl_divergence([0, 0], [1, 3]) == 0.0
    assert kl_divergence([1, 3], [0, 0]) == 0.0


@pytest.mark.parametrize(
    "p, q",
    [([1, -1], [1, 1]), ([1, np.nan], [1, 1]), ([1, 1], [1, 1, 1]), ([[1, 1]], [1, 1])],
)
def test_kl_rejects_bad_histograms(p, q):
    with pytest.raises(ValueError):
        kl_divergence(p, q)


# --------------------------------------------------------------------------- GlobalHistogram


def test_global_histogram_keeps_latest_per_site():
    g = GlobalHistogram(3)
    np.testing.assert_array_equal(g.distribution(), [0, 0, 0])  # nothing seen yet
    g.update("a", [1, 0, 0])
    g.update("b", [0, 1, 0])
    g.update("a", [0, 0, 2])  # replaces a's first report, does not add to it
    np.testing.assert_array_equal(g.counts(), [0, 1, 2])
    np.testing.assert_allclose(g.distribution(), [0, 1 / 3, 2 / 3])


def test_global_histogram_state_round_trips_through_json():
    g = GlobalHistogram(3)
    g.update("site-1", [4, 0, 1])
    g.update("site-0", [0, 2, 2])
    state = json.loads(json.dumps(g.state_dict()))
    h = GlobalHistogram(3)
    h.load_state_dict(state)
    np.testing.assert_array_equal(h.counts(), g.counts())
    h.update("site-1", [0, 0, 0])  # latest-per-site still applies after a load
    np.testing.assert_array_equal(h.counts(), [0, 2, 2])


def test_global_histogram_rejects_bad_input():
    g = GlobalHistogram(2)
    for bad in ([1, 2, 3], [1, -1], [np.inf, 0]):
        with pytest.raises(ValueError):
            g.update("a", bad)
    with pytest.raises(TypeError):
        g.update(7, [1, 1])
    with pytest.raises(ValueError, match="num_classes"):
        g.load_state_dict({"num_classes": 3, "sites": {}})
    with pytest.raises(ValueError):
        g.load_state_dict({"num_classes": 2, "sites": {"a": [1, 2, 3]}})
    with pytest.raises(ValueError):
        GlobalHistogram(0)


# --------------------------------------------------------------------------- dwa_weights


def _fedavg(n):
    n = np.asarray(n, dtype=np.float64)
    return n / n.sum()


def test_dwa_equal_histograms_give_exactly_fedavg():
    n = [10, 30, 60]
    # Sites match the global distribution ...
    w = dwa_weights(n, [[3, 6, 1], [6, 12, 2], [0.3, 0.6, 0.1]], [30, 60, 10])
    np.testing.assert_array_equal(w, _fedavg(n))
    # ... or merely match each other: equal divergences, same result.
    w = dwa_weights(n, [[1, 2, 3]] * 3, [6, 1, 1], temperature=0.1)
    np.testing.assert_array_equal(w, _fedavg(n))


def test_dwa_matches_formula_without_floor():
    n = np.array([10.0, 20.0, 30.0])
    hists = np.array([[5, 5, 0], [1, 8, 1], [2, 2, 6]], dtype=float)
    g = hists.sum(axis=0)
    t = 0.5
    div = np.array([kl_divergence(h, g) for h in hists])
    expected = n * np.exp(-div / t)
    expected /= expected.sum()
    np.testing.assert_allclose(dwa_weights(n, hists, g, temperature=t, floor=0.0), expected)


def test_dwa_weight_falls_monotonically_with_divergence():
    g = np.full(4, 0.25)
    corner = np.array([1.0, 0, 0, 0])
    for floor in (0.0, 0.1):
        first = [
            dwa_weights([50, 50, 50], [(1 - t) * g + t * corner, g, g], g, floor=floor)[0]
            for t in np.linspace(0, 1, 11)
        ]
        steps = np.diff(first)
        assert np.all(steps < 0) if floor == 0 else np.all(steps <= 0)


def test_dwa_floor_is_respected_and_weights_sum_to_one():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sites = rng.integers(1, 8)
        n = rng.integers(0, 100, size=sites).astype(float)
        n[0] += 1  # at least one site with data
        hists = rng.integers(0, 20, size=(sites, 5)) * rng.integers(0, 2, size=(sites, 5))
        floor = rng.uniform(0, 1)
        w = dwa_weights(n, hists, hists.sum(axis=0), temperature=rng.uniform(0.01, 2), floor=floor)
        lower = floor * _fedavg(n)
        assert np.all(np.isfinite(w))
        assert w.sum() == pytest.approx(1.0, abs=1e-12)
        assert np.all(w >= lower - 1e-12)
        assert np.all(w[n == 0] == 0)


def test_dwa_floor_pins_silenced_site_and_keeps_others_proportional():
    n = np.array([10.0, 10.0, 10.0])
    hists = [[10, 0, 0], [5, 5, 0], [0, 0, 10]]
    g = [15, 5, 10]
    raw = dwa_weights(n, hists, g, temperature=0.05, floor=0.0)
    w = dwa_weights(n, hists, g, temperature=0.05, floor=0.3)
    pinned = raw < 0.3 / 3
    assert pinned.any() and not pinned.all()
    np.testing.assert_allclose(w[pinned], 0.1)
    np.testing.assert_allclose(w[~pinned] / w[~pinned].sum(), raw[~pinned] / raw[~pinned].sum())
    assert w.sum() == pytest.approx(1.0)
    # floor = 1 is FedAvg; a huge temperature tends to it.
    np.testing.assert_allclose(dwa_weights(n, hists, g, floor=1.0), _fedavg(n))
    np.testing.assert_allclose(dwa_weights(n, hists, g, temperature=1e9, floor=0), _fedavg(n))


def test_dwa_zero_counts_and_unseen_classes_stay_finite():
    # Site 1 has no examples; site 2 reports a class the global histogram has not seen;
    # site 3 reports an empty histogram.
    w = dwa_weights([10, 0, 10, 5], [[5, 5, 0], [0, 0, 0], [0, 0, 3], [0, 0, 0]], [5, 5, 0])
    assert np.all(np.isfinite(w)) and w.sum() == pytest.approx(1.0)
    assert w[1] == 0.0
    assert w[2] >= 0.1 * 10 / 25 - 1e-15  # divergent, but floored, not silenced
    w = dwa_weights([10, 10], [[1, 1], [1, 0]], [0, 0])  # nothing seen globally
    np.testing.assert_array_equal(w, [0.5, 0.5])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": 0}, "Invalid temperature: 0"),
        ({"temperature": -1}, "Invalid temperature: -1"),
        ({"temperature": float("nan")}, "Invalid temperature: nan"),
        ({"floor": -0.1}, "Invalid floor: -0.1"),
        ({"floor": 1.5}, "Invalid floor: 1.5"),
        ({"num_examples": [5, -1]}, r"Invalid num_examples: \[5.0, -1.0\]"),
        ({"num_examples": [0, 0]}, "Invalid num_examples"),
        ({"num_examples": [1, 1, 1]}, "Invalid histograms"),
        ({"histograms": [[1, 1], [1, -1]]}, "histogram 1"),
        ({"histograms": [[1, 1], [1, 1, 1]]}, "histogram 1"),
    ],
)
def test_dwa_rejects_invalid_arguments(kwargs, message):
    args = {"num_examples": [5, 5], "histograms": [[1, 1], [1, 0]], "global_dist": [2, 1]}
    with pytest.raises(ValueError, match=message):
        dwa_weights(**{**args, **kwargs})


# --------------------------------------------------------------------------- conflicts


def test_sign_agreement_on_hand_made_deltas():
    d = [np.array([1.0, 1.0, 0.0, 2.0]), np.array([1.0, -1, 0, 3]), np.array([-1.0, -1, 0, -5])]
    # Equal weights: two against one -> 1/3; nobody moves coordinate 2 -> 1.
    np.testing.assert_allclose(sign_agreement(d, [1, 1, 1]), [1 / 3, 1 / 3, 1, 1 / 3])
    # Weights 2,1,1: |2+1-1|/4, |2-1-1|/4.
    np.testing.assert_allclose(sign_agreement(d, [2, 1, 1]), [0.5, 0.0, 1.0, 0.5])
    # Unanimous is exactly 1, either direction.
    unanimous = [np.array([-2.0, 3.0]), np.array([-1.0, 1.0])]
    np.testing.assert_array_equal(sign_agreement(unanimous, [0.3, 0.7]), [1, 1])


def test_sign_agreement_zero_delta_abstains():
    d = [np.array([1.0]), np.array([0.0]), np.array([-1.0])]
    np.testing.assert_allclose(sign_agreement(d, [3, 1, 1]), [0.5])  # |3-1|/(3+1)


def test_split_conflicts_partitions_the_mean():
    mean = np.array([1.0, -2.0, 3.0, 4.0])
    agreement = np.array([1.0, 0.2, 0.5, 0.49])
    agree, conflict = split_conflicts(mean, agreement, 0.5)
    np.testing.assert_array_equal(agree, [1.0, 0.0, 3.0, 0.0])
    np.testing.assert_array_equal(conflict, [0.0, -2.0, 0.0, 4.0])
    np.testing.assert_array_equal(agree + conflict, mean)
    with pytest.raises(ValueError, match="Invalid threshold: 1.5"):
        split_conflicts(mean, agreement, 1.5)
    with pytest.raises(ValueError):
        split_conflicts(mean, agreement[:2], 0.5)


# --------------------------------------------------------------------------- MomentumBuffer


def test_momentum_recurrence_matches_hand_computation():
    buf = MomentumBuffer(beta=0.5, lr_scale=2.0)
    # v: 1, 1.5, 1.75 (steady) and 1, -0.5, 0.75 (flipping); u = 2 * 0.5 * v.
    steady = [buf.step({"s": np.array([1.0]), "f": np.array([s])}) for s in (1.0, -1.0, 1.0)]
    np.testing.assert_allclose([u["s"][0] for u in steady], [1.0, 1.5, 1.75])
    np.testing.assert_allclose([u["f"][0] for u in steady], [1.0, -0.5, 0.75])


def test_momentum_steady_signal_accumulates_flipping_signal_cancels():
    buf = MomentumBuffer(beta=0.9)
    steady = flipping = 0.0
    for t in range(200):
        out = buf.step({"s": np.array(1.0), "f": np.array((-1.0) ** t)})
        steady += float(out["s"])
        flipping += float(out["f"])
    assert float(out["s"]) == pytest.approx(1.0, abs=1e-8)  # applied in full eventually
    assert steady > 190
    # Cancels inside the buffer: a small kick each round, and what was applied in total is
    # what went in (0) minus what is still buffered (sum u = sum c - beta * v_T).
    assert abs(float(out["f"])) == pytest.approx(0.1 / 1.9, rel=1e-6)
    assert flipping == pytest.approx(0.0 - 0.9 * float(out["f"]) / 0.1)
    assert abs(flipping) < 0.5


def test_momentum_one_off_conflict_is_applied_in_total():
    buf = MomentumBuffer(beta=0.8)
    total = buf.step({"x": np.array([2.0, -1.0])})["x"]
    for _ in range(200):
        total = total + buf.step({"x": np.zeros(2)})["x"]
    np.testing.assert_allclose(total, [2.0, -1.0])


def test_momentum_state_dict_round_trip_and_validation():
    buf = MomentumBuffer(beta=0.7)
    assert buf.state_dict() == {"buffers": {}}  # lazy: nothing before the first step
    buf.step({"w": np.ones((2, 3)), "b": np.array(0.5)})
    state = buf.state_dict()
    state["buffers"]["w"][0, 0] = 99.0  # a copy: the buffer is unaffected
    state = buf.state_dict()

    other = MomentumBuffer(beta=0.7)
    other.load_state_dict(state)
    step = {"w": np.full((2, 3), -1.0), "b": np.array(2.0)}
    a, b = buf.step(step), other.step(step)
    for k in step:
        np.testing.assert_array_equal(a[k], b[k])

    with pytest.raises(ValueError, match="shape"):
        buf.load_state_dict({"buffers": {"w": np.ones((3, 2)), "b": np.array(0.0)}})
    with pytest.raises(ValueError, match="names"):
        buf.load_state_dict({"buffers": {"w": np.ones((2, 3))}})
    with pytest.raises(ValueError, match="keys"):
        buf.load_state_dict({"buffers": {}, "extra": 1})
    with pytest.raises(ValueError):
        MomentumBuffer().load_state_dict({"buffers": {"w": np.array([np.nan])}})
    with pytest.raises(ValueError, match="shape"):
        other.step({"w": np.ones(6), "b": np.array(0.0)})


def test_momentum_zero_dim_buffers_stay_arrays():
    # beta * v on a 0-dim array is a numpy scalar; state_dict must still hold ndarrays
    # (checkpoints write them with safetensors).
    buf = MomentumBuffer(beta=0.5)
    for _ in range(2):
        out = buf.step({"b": np.array(1.0, dtype=np.float32)})
    assert isinstance(out["b"], np.ndarray) and out["b"].shape == () and out["b"] == pytest.approx(0.75)
    v = buf.state_dict()["buffers"]["b"]
    assert isinstance(v, np.ndarray) and v.shape == () and v.dtype == np.float32 and v == 1.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"beta": -0.1}, "Invalid beta value: -0.1"),
        ({"beta": 1.0}, "Invalid beta value: 1.0"),
        ({"lr_scale": -1.0}, "Invalid lr_scale value: -1.0"),
    ],
)
def test_momentum_rejects_invalid_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MomentumBuffer(**kwargs)


# ------------------------------------------------------------------ conflict_aware_aggregate


def _site_deltas(seed, sites=4):
    rng = np.random.default_rng(seed)
    return [
        {"conv": rng.normal(size=(3, 2, 5)).astype(np.float32), "bias": np.float32(rng.normal())}
        for _ in range(sites)
    ]


def test_threshold_zero_is_the_weighted_average():
    deltas, w = _site_deltas(1), [0.1, 0.2, 0.3, 0.4]
    out = conflict_aware_aggregate(deltas, w, MomentumBuffer(beta=0.9), threshold=0.0)
    for name in ("conv", "bias"):
        oracle = np.average(np.stack([d[name] for d in deltas]), axis=0, weights=w)
        np.testing.assert_array_equal(out[name], oracle.astype(np.float32))
        assert out[name].dtype == np.float32 and out[name].shape == np.shape(deltas[0][name])


def test_single_site_is_its_own_delta():
    (delta,) = _site_deltas(2, sites=1)
    out = conflict_aware_aggregate([delta], [7.0], MomentumBuffer(), threshold=1.0)
    for name in delta:
        np.testing.assert_allclose(out[name], delta[name], rtol=1e-6)


def test_conflicting_coordinates_go_through_the_buffer():
    deltas = [{"w": np.array([1.0, 1.0]), "b": np.array(2.0)},
              {"w": np.array([1.0, -1.0]), "b": np.array(-1.0)}]
    buf = MomentumBuffer(beta=0.5)
    # Weights 3:1 -> mean w = [1, 0.5], agreement [1, 0.5]; mean b = 1.25, agreement 0.5.
    first = conflict_aware_aggregate(deltas, [3, 1], buf, threshold=0.9)
    np.testing.assert_allclose(first["w"], [1.0, 0.25])  # 0.5 * v, v = 0.5
    np.testing.assert_allclose(first["b"], 0.625)
    assert first["b"].shape == ()
    second = conflict_aware_aggregate(deltas, [3, 1], buf, threshold=0.9)
    np.testing.assert_allclose(second["w"], [1.0, 0.375])  # v = 0.5 * 0.5 + 0.5
    np.testing.assert_allclose(second["b"], 0.9375)


def test_aggregate_rejects_mismatched_inputs():
    buf = MomentumBuffer()
    with pytest.raises(ValueError):
        conflict_aware_aggregate([], [], buf, 0.5)
    with pytest.raises(ValueError, match="names"):
        conflict_aware_aggregate([{"a": np.ones(2)}, {"b": np.ones(2)}], [1, 1], buf, 0.5)
    with pytest.raises(ValueError, match="shapes"):
        conflict_aware_aggregate([{"a": np.ones(2)}, {"a": np.ones(3)}], [1, 1], buf, 0.5)
    with pytest.raises(ValueError, match="weights"):
        conflict_aware_aggregate([{"a": np.ones(2)}], [-1], buf, 0.5)


def test_agreement_gain_formula_and_edges():
    from fedind.aggregation.conflicts import agreement_gain

    a = np.array([0.0, 0.15, 0.3, 0.9])
    np.testing.assert_allclose(agreement_gain(a, 0.3, 0.5), [0.5, 0.75, 1.0, 1.0])
    np.testing.assert_array_equal(agreement_gain(a, 0.3, 1.0), np.ones(4))  # no damping
    np.testing.assert_array_equal(agreement_gain(a, 0.0, 0.2), np.ones(4))  # never a conflict
    np.testing.assert_allclose(agreement_gain(a, 1.0, 0.0), a)  # linear in A
    for bad in (dict(threshold=1.5, damping=0.5), dict(threshold=0.3, damping=-0.1)):
        with pytest.raises(ValueError):
            agreement_gain(a, **bad)


def test_restart_momentum_without_restart_is_heavy_ball():
    from fedind.aggregation.conflicts import RestartMomentum, heavy_ball

    rng = np.random.default_rng(0)
    ours, theirs = RestartMomentum(beta=0.9, restart=False), heavy_ball(0.9)
    for _ in range(4):
        d = {"w": rng.normal(size=(2, 3)), "b": rng.normal(size=())}
        got, expected = ours.step(d), theirs.step(d)
        for k in d:
            np.testing.assert_allclose(got[k], expected[k], rtol=1e-12)
    assert ours.last_restart_share == 0.0


def test_restart_momentum_drops_momentum_that_opposes_the_aggregate():
    from fedind.aggregation.conflicts import RestartMomentum

    m = RestartMomentum(beta=0.5, lr_scale=2.0)
    np.testing.assert_allclose(m.step({"w": np.array([1.0, 1.0, 0.0])})["w"], [2.0, 2.0, 0.0])
    # coordinate 0 keeps going (same sign), 1 reverses (restart: only the new -0.5),
    # 2 had no momentum (0 * d is not < 0: nothing to restart)
    out = m.step({"w": np.array([1.0, -0.5, 3.0])})
    np.testing.assert_allclose(out["w"], 2.0 * np.array([0.5 + 1.0, -0.5, 3.0]))
    assert m.last_restart_share == pytest.approx(1 / 3)
    # a gain scales what enters the buffer, not the momentum already there
    out = m.step({"w": np.array([1.0, -1.0, 1.0])}, gain={"w": np.array([0.5, 1.0, 0.0])})
    np.testing.assert_allclose(out["w"], 2.0 * np.array([0.75 + 0.5, -0.25 - 1.0, 1.5]))
    # state round trip (same format as MomentumBuffer)
    copy = RestartMomentum(beta=0.5, lr_scale=2.0)
    copy.load_state_dict(m.state_dict())
    d = {"w": np.array([-1.0, -1.0, 2.0])}
    np.testing.assert_array_equal(copy.step(d)["w"], m.step(d)["w"])
    with pytest.raises(ValueError, match="shape"):
        m.step({"w": np.ones(2)})


def test_conflict_momentum_aggregate_oracle():
    from fedind.aggregation.conflicts import RestartMomentum, conflict_momentum_aggregate

    # coordinate 0: both sites +1 (agreement 1); coordinate 1: +1 vs -3 (agreement 0, mean -1)
    deltas = [{"w": np.array([1.0, 1.0], np.float32)}, {"w": np.array([1.0, -3.0], np.float32)}]
    m = RestartMomentum(beta=0.5)
    out1 = conflict_momentum_aggregate(deltas, [1, 1], m, threshold=0.5, damping=0.2)
    np.testing.assert_allclose(out1["w"], [1.0, -0.2])  # conflicting coordinate damped to 0.2
    assert out1["w"].dtype == np.float32
    out2 = conflict_momentum_aggregate(deltas, [1, 1], m, threshold=0.5, damping=0.2)
    np.testing.assert_allclose(out2["w"], [1.5, -0.3])  # one buffer: both accelerate
    # no damping, no restart: FedAvgM's heavy ball on the weighted mean
    plain = RestartMomentum(beta=0.5, restart=False)
    np.testing.assert_allclose(
        conflict_momentum_aggregate(deltas, [3, 1], plain, threshold=0.5)["w"], [1.0, 0.0]
    )
    with pytest.raises(ValueError, match="names"):
        conflict_momentum_aggregate([{"a": np.ones(2)}, {"b": np.ones(2)}], [1, 1], m, 0.5)


def test_heavy_ball_is_fedavgm_momentum():
    from fedind.aggregation.conflicts import heavy_ball

    buffer = heavy_ball(0.5)
    np.testing.assert_allclose(buffer.step({"w": np.array([1.0])})["w"], [1.0])  # v1 = 1
    np.testing.assert_allclose(buffer.step({"w": np.array([1.0])})["w"], [1.5])  # v2 = 0.5 + 1
    assert heavy_ball(0.0) is None


def test_restart_only_where_the_sites_agree():
    from fedind.aggregation.conflicts import RestartMomentum

    m = RestartMomentum(beta=0.5, restart_agreement=0.6)
    m.step({"w": np.array([1.0, 1.0])})
    # both coordinates now oppose the buffer; only at coordinate 0 do the sites agree
    out = m.step({"w": np.array([-1.0, -1.0])}, agreement={"w": np.array([0.8, 0.2])})
    np.testing.assert_allclose(out["w"], [-1.0, 0.5 - 1.0])  # 0 restarts, 1 keeps its momentum
    assert m.last_restart_share == pytest.approx(0.5)
    # without agreements it restarts wherever the mean opposes the buffer
    out = m.step({"w": np.array([1.0, 1.0])})
    np.testing.assert_allclose(out["w"], [1.0, 1.0])
    with pytest.raises(ValueError, match="restart_agreement"):
        RestartMomentum(restart_agreement=1.5)


def test_conflict_momentum_aggregate_gates_the_restart_by_the_sites_agreement():
    from fedind.aggregation.conflicts import RestartMomentum, conflict_momentum_aggregate

    m = RestartMomentum(beta=0.5, restart_agreement=0.9)
    first = [{"w": np.array([1.0, 1.0])}, {"w": np.array([1.0, 1.0])}]
    conflict_momentum_aggregate(first, [1, 1], m, threshold=0.0)
    # coordinate 0: both sites reverse (agreement 1, restarts); 1: split +1 / -3 (mean -1,
    # agreement 0: keeps its momentum 0.5 * 1)
    second = [{"w": np.array([-1.0, 1.0])}, {"w": np.array([-1.0, -3.0])}]
    out = conflict_momentum_aggregate(second, [1, 1], m, threshold=0.0)
    np.testing.assert_allclose(out["w"], [-1.0, 0.5 - 1.0])


# --------------------------------------------------------------------------- class rows


def test_class_rows_average_each_row_over_its_holders():
    """Row c's mean is sum_i w_i p_i(c) d_i[c] / sum_j w_j p_j(c); a class nobody holds keeps w."""
    w = np.array([0.5, 0.3, 0.2])
    h = np.array([[8, 2, 0], [0, 10, 0], [5, 5, 0]])
    d = [{"head.weight": np.full((3, 2), float(i + 1)), "head.bias": np.full(3, float(i + 1)), "body": np.ones(4)}
         for i in range(3)]
    scaled = scale_rows(d, class_row_scales(w, h), ["head.weight", "head.bias"])
    mean = {n: sum(wi * s[n] for wi, s in zip(w, scaled)) for n in d[0]}
    p = h / h.sum(axis=1, keepdims=True)
    for c in (0, 1):
        W = w * p[:, c] / np.sum(w * p[:, c])
        expected = float(np.sum(W * np.array([1.0, 2.0, 3.0])))
        assert mean["head.bias"][c] == pytest.approx(expected)
        np.testing.assert_allclose(mean["head.weight"][c], expected)
    assert mean["head.bias"][2] == pytest.approx(0.5 * 1 + 0.3 * 2 + 0.2 * 3)  # nobody holds class 2
    np.testing.assert_array_equal(mean["body"], np.ones(4))  # other arrays untouched
    assert scaled[0]["body"] is d[0]["body"]


def test_class_rows_give_a_lone_holder_its_whole_row():
    """The one line holding a new class moves that row by what it learnt, not a tenth of it."""
    w = np.full(10, 0.1)
    h = np.tile([50, 50, 0], (10, 1))
    h[3] = [40, 40, 20]
    scales = class_row_scales(w, h)
    assert scales[3, 2] == pytest.approx(10.0)
    assert np.all(scales[np.arange(10) != 3, 2] == 0)


def test_class_rows_refuse_a_bad_histogram():
    with pytest.raises(ValueError, match="histograms"):
        class_row_scales([0.5, 0.5], [[1, -1], [2, 2]])
    with pytest.raises(ValueError, match="rows"):
        scale_rows([{"head.bias": np.ones(2)}], np.ones((1, 3)), ["head.bias"])
