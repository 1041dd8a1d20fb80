"""EWC maths (Fisher, penalty, aggregation, online merge, server state) and head expansion."""

import numpy as np
import pytest
import torch
from torch import nn

from fedind.data.format import SiteArrays
from fedind.continual.ewc import (
    EWCPenalty,
    EWCState,
    aggregate_fishers,
    diagonal_fisher,
    ewc_penalty,
    merge_fisher,
    server_consolidation,
)
from fedind.continual.expansion import expand_head, head_classes, pad_head_rows, set_head_rows, zero_head_rows
from fedind.models import FaultCNN
from fedind.training import train_local

CPU = torch.device("cpu")


def _softmax_regression(d=5, k=3, n=40, seed=0):
    """A linear softmax model ``p = softmax(W x + b)`` on ``n`` windows of shape [1, d]."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(d, k))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 1, d)).astype(np.float32)
    y = rng.integers(0, k, n).astype(np.int64)
    return model, SiteArrays(x=x, y=y)


def _closed_form_fishers(model, data):
    """Independent float64 oracle. With z = W x + b, d log p_c / d W[k, j] = ([c = k] - p_k) x_j:

    true      F_W[k, j] = mean_n sum_c p_c ([c = k] - p_k)^2 x_j^2 = mean_n p_k (1 - p_k) x_j^2
    empirical F_W[k, j] = mean_n ([y_n = k] - p_k)^2 x_j^2          (bias: the same without x_j^2)
    """
    w = model[1].weight.detach().double().numpy()
    b = model[1].bias.detach().double().numpy()
    x = data.x[:, 0, :].astype(np.float64)
    z = x @ w.T + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    curv = p * (1 - p)
    resid2 = (np.eye(w.shape[0])[data.y] - p) ** 2
    true = {"1.weight": (curv.T @ x**2) / len(x), "1.bias": curv.mean(axis=0)}
    empirical = {"1.weight": (resid2.T @ x**2) / len(x), "1.bias": resid2.mean(axis=0)}
    return true, empirical


def test_fisher_of_softmax_regression_matches_its_closed_forms():
    model, data = _softmax_regression()
    true, empirical = _closed_form_fishers(model, data)
    got_true = diagonal_fisher(model, data, CPU, kind="true", batch_size=7)
    got_emp = diagonal_fisher(model, data, CPU, kind="empirical", batch_size=7)
    assert set(got_true) == set(got_emp) == {"1.weight", "1.bias"}
    for name in true:
        assert got_true[name].dtype == np.float32
        np.testing.assert_allclose(got_true[name], true[name], rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(got_emp[name], empirical[name], rtol=1e-5, atol=1e-8)


def test_true_fisher_of_softmax_regression_is_the_hessian_diagonal():
    """Known curvature: for a linear softmax model the Fisher is the Hessian of the mean
    cross-entropy (whatever the labels); its diagonal, by double autograd, is the oracle."""
    model, data = _softmax_regression(d=3, k=3, n=25, seed=1)
    w0, b0 = model[1].weight.detach().double(), model[1].bias.detach().double()
    x = torch.from_numpy(data.x[:, 0, :]).double()
    y = torch.from_numpy(data.y)

    def mean_nll(flat):
        w, b = flat[: w0.numel()].reshape(w0.shape), flat[w0.numel() :]
        return nn.functional.cross_entropy(x @ w.T + b, y)

    hessian = torch.autograd.functional.hessian(mean_nll, torch.cat([w0.ravel(), b0]))
    fisher = diagonal_fisher(model, data, CPU, kind="true")
    got = np.concatenate([fisher["1.weight"].ravel(), fisher["1.bias"]])
    np.testing.assert_allclose(got, torch.diagonal(hessian).numpy(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", ["true", "empirical"])
def test_fisher_of_the_cnn_matches_a_per_sample_backward_loop(kind):
    torch.manual_seed(0)
    model = FaultCNN(in_channels=1, num_classes=3, width=8)
    rng = np.random.default_rng(0)
    data = SiteArrays(rng.standard_normal((4, 1, 128)).astype(np.float32), rng.integers(0, 3, 4).astype(np.int64))
    model.train()
    fisher = diagonal_fisher(model, data, CPU, kind=kind, batch_size=2)
    assert model.training  # mode restored
    model.eval()
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(4):
        logp = torch.log_softmax(model(torch.from_numpy(data.x[i : i + 1])), dim=-1)[0]
        classes = [int(data.y[i])] if kind == "empirical" else range(3)
        for c in classes:
            model.zero_grad()
            logp[c].backward(retain_graph=True)
            weight = 1.0 if kind == "empirical" else float(logp[c].detach().exp())
            for name, p in model.named_parameters():
                expected[name] += weight * p.grad**2
    assert set(fisher) == set(expected)
    for name, e in expected.items():
        np.testing.assert_allclose(fisher[name], (e / 4).numpy(), rtol=1e-4, atol=1e-10)


def test_fisher_subsamples_deterministically_and_rejects_bad_arguments():
    model, data = _softmax_regression(n=40)
    a = diagonal_fisher(model, data, CPU, max_samples=10, seed=3)
    b = diagonal_fisher(model, data, CPU, max_samples=10, seed=3)
    c = diagonal_fisher(model, data, CPU, max_samples=10, seed=4)
    np.testing.assert_array_equal(a["1.weight"], b["1.weight"])
    assert not np.array_equal(a["1.weight"], c["1.weight"])
    with pytest.raises(ValueError, match="kind"):
        diagonal_fisher(model, data, CPU, kind="sampled")
    with pytest.raises(ValueError, match="max_samples"):
        diagonal_fisher(model, data, CPU, max_samples=0)
    with pytest.raises(ValueError, match="labels"):
        diagonal_fisher(model, SiteArrays(data.x, data.y + 5), CPU, kind="empirical")
    with pytest.raises(ValueError, match="0 examples"):
        diagonal_fisher(model, SiteArrays(data.x[:0], data.y[:0]), CPU)


# --------------------------------------------------------------------------- penalty


def _fisher_and_anchors(model, seed=0):
    rng = np.random.default_rng(seed)
    fisher = {n: rng.random(p.shape).astype(np.float32) for n, p in model.named_parameters()}
    anchors = {
        n: (p.detach().numpy() + rng.standard_normal(p.shape)).astype(np.float32) for n, p in model.named_parameters()
    }
    return fisher, anchors


def test_penalty_value_and_gradient():
    """Omega = lam/2 sum F (theta - theta*)^2 and dOmega/dtheta = lam F (theta - theta*)."""
    model, _ = _softmax_regression()
    fisher, anchors = _fisher_and_anchors(model)
    lam = 3.5
    value = ewc_penalty(model, fisher, anchors, lam)
    expected = 0.5 * lam * sum(
        float((fisher[n].astype(np.float64) * (p.detach().double().numpy() - anchors[n]) ** 2).sum())
        for n, p in model.named_parameters()
    )
    assert float(value) == pytest.approx(expected, rel=1e-5)
    value.backward()
    for name, p in model.named_parameters():
        expected_grad = lam * fisher[name] * (p.detach().numpy() - anchors[name])
        np.testing.assert_allclose(p.grad.numpy(), expected_grad, rtol=1e-5, atol=1e-7)


def test_penalty_covers_only_the_named_parameters_and_checks_them():
    model, _ = _softmax_regression()
    fisher, anchors = _fisher_and_anchors(model)
    penalty = EWCPenalty({"1.bias": fisher["1.bias"]}, {"1.bias": torch.from_numpy(anchors["1.bias"])}, lam=1.0)
    penalty(model).backward()
    assert model[1].weight.grad is None and model[1].bias.grad is not None
    with pytest.raises(ValueError, match="does not match the model"):
        EWCPenalty({"1.bias": np.ones(4, np.float32)}, {"1.bias": np.zeros(4, np.float32)}, 1.0)(model)
    with pytest.raises(ValueError, match="does not match the model"):
        EWCPenalty({"2.bias": np.ones(3, np.float32)}, {"2.bias": np.zeros(3, np.float32)}, 1.0)(model)
    for bad in [
        lambda: EWCPenalty({"1.bias": -np.ones(3)}, {"1.bias": np.zeros(3)}, 1.0),
        lambda: EWCPenalty({"1.bias": np.ones(3)}, {"1.weight": np.zeros(3)}, 1.0),
        lambda: EWCPenalty({"1.bias": np.ones(3)}, {"1.bias": np.zeros(2)}, 1.0),
        lambda: EWCPenalty({"1.bias": np.ones(3)}, {"1.bias": np.zeros(3)}, -1.0),
        lambda: EWCPenalty({}, {}, 1.0),
    ]:
        with pytest.raises(ValueError, match="Invalid"):
            bad()


def _site(labels, length=128, seed=0) -> SiteArrays:
    rng = np.random.default_rng(seed)
    y = np.array(labels, dtype=np.int64)
    x = rng.standard_normal((len(y), 1, length)).astype(np.float32) + y[:, None, None].astype(np.float32)
    return SiteArrays(x=x, y=y)


def test_train_local_adds_the_penalty_to_every_step():
    """A constant penalty changes the reported loss, not the weights. An EWC penalty on the
    head bias with lr * lam * F = 1 (plain SGD, one full batch per epoch) makes a step land at
    b' = b - lr (grad_b CE + lam F (b - b*)) = b* - lr grad_b CE: checked on the third step."""
    data = _site([0, 1, 2] * 6)

    def trained(penalty, epochs=3):
        torch.manual_seed(0)
        model = FaultCNN(in_channels=1, num_classes=3, width=8)
        start = model.head.bias.detach().clone()
        result = train_local(
            model, data, epochs=epochs, batch_size=18, lr=0.1, seed=0, device=CPU, momentum=0.0,
            weight_decay=0.0, penalty=penalty,
        )
        return model, start, result

    plain, start, plain_result = trained(None)
    shifted, _, shifted_result = trained(lambda m: torch.tensor(5.0))
    for name, p in plain.named_parameters():
        assert torch.equal(p, dict(shifted.named_parameters())[name])
    assert shifted_result.loss == pytest.approx(plain_result.loss + 5.0, rel=1e-6)

    penalty = EWCPenalty({"head.bias": np.full(3, 2.0, np.float32)}, {"head.bias": start.numpy()}, lam=5.0)
    before_last, _, _ = trained(penalty, epochs=2)
    last, _, _ = trained(penalty, epochs=3)
    loss = nn.functional.cross_entropy(before_last(torch.from_numpy(data.x)), torch.from_numpy(data.y))
    (grad_bias,) = torch.autograd.grad(loss, before_last.head.bias)
    torch.testing.assert_close(last.head.bias.detach(), start - 0.1 * grad_bias, rtol=0, atol=1e-6)
    assert not torch.allclose(before_last.head.bias.detach(), start - 0.1 * grad_bias, atol=1e-3)


# --------------------------------------------------------------------------- server maths


def test_aggregate_fishers_is_the_weighted_mean():
    rng = np.random.default_rng(1)
    fishers = [{"a": rng.random((2, 3)).astype(np.float32), "b": rng.random(()).astype(np.float32)} for _ in range(3)]
    weights = [10, 30, 60]
    got = aggregate_fishers(fishers, weights)
    for name in ("a", "b"):
        expected = np.average(np.stack([f[name] for f in fishers]), axis=0, weights=weights)
        np.testing.assert_allclose(got[name], expected, rtol=1e-6)
        assert got[name].dtype == np.float32 and got[name].shape == fishers[0][name].shape
    np.testing.assert_array_equal(aggregate_fishers(fishers[:1], [7])["a"], fishers[0]["a"])


@pytest.mark.parametrize(
    "fishers, weights",
    [([], []), ([{"a": np.ones(2)}], [0]), ([{"a": np.ones(2)}], [1, 1]), ([{"a": np.ones(2)}], [np.nan]),
     ([{"a": np.ones(2)}, {"b": np.ones(2)}], [1, 1]), ([{"a": np.ones(2)}, {"a": np.ones(3)}], [1, 1]),
     ([{"a": -np.ones(2)}], [1]), ([{"a": np.array([1, 2])}], [1]), ({"a": np.ones(2)}, [1])],
)
def test_aggregate_fishers_rejects_bad_input(fishers, weights):
    with pytest.raises(ValueError, match="Invalid"):
        aggregate_fishers(fishers, weights)


def test_merge_fisher_is_online_ewc():
    old, new = {"a": np.array([1.0, 2.0])}, {"a": np.array([0.5, 0.0])}
    np.testing.assert_allclose(merge_fisher(old, new, 0.9)["a"], [1.4, 1.8])
    np.testing.assert_allclose(merge_fisher(old, new, 0.0)["a"], [0.5, 0.0])
    np.testing.assert_allclose(merge_fisher(None, new)["a"], [0.5, 0.0])
    assert merge_fisher(old, new)["a"].dtype == np.float32
    with pytest.raises(ValueError, match="gamma"):
        merge_fisher(old, new, 1.5)
    with pytest.raises(ValueError, match="pad the old Fisher"):
        merge_fisher({"a": np.ones(3)}, new)


def test_ewc_state_consolidates_phases_and_round_trips():
    state = EWCState(gamma=0.5)
    assert state.state_dict() == {"fisher": {}, "anchors": {}, "phases": 0}
    f1 = [{"w": np.array([1.0, 0.0], np.float32)}, {"w": np.array([3.0, 2.0], np.float32)}]
    state.consolidate(f1, [1, 1], {"w": np.array([9.0, 9.0]), "unused": np.zeros(1)})
    np.testing.assert_allclose(state.fisher["w"], [2.0, 1.0])
    state.consolidate([{"w": np.array([1.0, 1.0], np.float32)}], [5], {"w": np.array([7.0, 8.0])})
    np.testing.assert_allclose(state.fisher["w"], [2.0, 1.5])  # 0.5 * [2, 1] + [1, 1]
    np.testing.assert_allclose(state.anchors["w"], [7.0, 8.0])
    assert state.phases == 2 and set(state.anchors) == {"w"}
    saved = state.state_dict()
    restored = EWCState(gamma=0.5)
    restored.load_state_dict(saved)
    saved["fisher"]["w"][:] = 0  # copies
    np.testing.assert_allclose(restored.fisher["w"], [2.0, 1.5])
    assert restored.phases == 2
    with pytest.raises(ValueError, match="no arrays"):
        state.consolidate(f1, [1, 1], {"v": np.zeros(2)})
    assert state.phases == 2  # unchanged by the failed call


@pytest.mark.parametrize(
    "bad",
    [{"fisher": {}, "anchors": {}}, {"fisher": {"w": np.ones(2, np.float32)}, "anchors": {}, "phases": 1},
     {"fisher": {"w": np.ones(2)}, "anchors": {"w": np.ones(2)}, "phases": 1},
     {"fisher": {"w": -np.ones(2, np.float32)}, "anchors": {"w": np.ones(2, np.float32)}, "phases": 1},
     {"fisher": {"w": np.ones(2, np.float32)}, "anchors": {"w": np.ones(2, np.float32)}, "phases": 0},
     {"fisher": {}, "anchors": {}, "phases": -1}],
)
def test_ewc_state_rejects_bad_state(bad):
    with pytest.raises(ValueError, match="Invalid"):
        EWCState().load_state_dict(bad)


# --------------------------------------------------------------------------- head expansion


def _numpy_state(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_expanded_head_keeps_old_logits_and_starts_new_classes_low():
    torch.manual_seed(0)
    model = FaultCNN(in_channels=1, num_classes=4, width=8).eval()
    state = _numpy_state(model)
    grown = expand_head(state, 6)
    assert head_classes(grown) == 6
    np.testing.assert_array_equal(grown["head.weight"][:4], state["head.weight"])  # bit-identical rows
    np.testing.assert_array_equal(grown["head.bias"][:4], state["head.bias"])
    assert not grown["head.weight"][4:].any()
    np.testing.assert_array_equal(grown["head.bias"][4:], [state["head.bias"].min()] * 2)
    assert grown["head.weight"].dtype == np.float32 and grown["features.1.weight"] is state["features.1.weight"]

    bigger = FaultCNN.from_state_dict({k: torch.from_numpy(v) for k, v in grown.items()}).eval()
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((8, 1, 256)).astype(np.float32))
    with torch.no_grad():
        assert torch.equal(bigger.features(x), model.features(x))
        old, new = model(x), bigger(x)
    # Same features, same rows: equal up to the GEMM's float32 rounding (BLAS blocks by K).
    torch.testing.assert_close(new[:, :4], old, rtol=0, atol=1e-6)
    assert torch.equal(new[:, :4].argmax(1), old.argmax(1))
    assert torch.all(new[:, 4:] == float(state["head.bias"].min()))  # constant, input-independent
    np.testing.assert_array_equal(expand_head(state, 5, new_bias=-3.0)["head.bias"][4], np.float32(-3.0))


def test_new_rows_learn_from_their_own_samples():
    torch.manual_seed(0)
    grown = expand_head(_numpy_state(FaultCNN(in_channels=1, num_classes=3, width=8)), 4)
    model = FaultCNN.from_state_dict({k: torch.from_numpy(v) for k, v in grown.items()})
    train_local(model, _site([3, 0] * 4), epochs=1, batch_size=8, lr=0.1, seed=0, device=CPU)
    assert model.head.weight[3].abs().sum() > 0 and model.head.bias[3] > float(grown["head.bias"][3])


def test_expand_head_takes_proposed_rows_for_the_classes_given():
    state = _numpy_state(FaultCNN(in_channels=1, num_classes=3, width=8))
    grown = expand_head(state, 5, new_rows={4: (np.full(32, 0.5, np.float32), 1.5)})
    np.testing.assert_array_equal(grown["head.weight"][:3], state["head.weight"])  # old rows bit-identical
    assert not grown["head.weight"][3].any() and grown["head.bias"][3] == state["head.bias"].min()  # not proposed
    assert np.all(grown["head.weight"][4] == 0.5) and grown["head.bias"][4] == np.float32(1.5)
    for bad in ({2: (np.zeros(32), 0.0)}, {3: (np.zeros(31), 0.0)}, {3: (np.full(32, np.nan), 0.0)}):
        with pytest.raises(ValueError, match="Invalid (new )?row"):
            expand_head(state, 5, new_rows=bad)


def test_set_head_rows_replaces_only_the_rows_given():
    state = _numpy_state(FaultCNN(in_channels=1, num_classes=3, width=8))
    out = set_head_rows(state, {1: (np.full(32, 2.0, np.float32), -1.0)})
    np.testing.assert_array_equal(out["head.weight"][[0, 2]], state["head.weight"][[0, 2]])
    assert np.all(out["head.weight"][1] == 2.0) and out["head.bias"][1] == np.float32(-1.0)
    assert not np.all(state["head.weight"][1] == 2.0)  # the input is not modified
    assert out["head.weight"].dtype == np.float32 and out["features.1.weight"] is state["features.1.weight"]
    with pytest.raises(ValueError, match="Invalid row"):
        set_head_rows(state, {3: (np.zeros(32), 0.0)})


def test_per_class_arrays_follow_the_head():
    fisher = {"head.weight": np.ones((3, 2), np.float32), "head.bias": np.ones(3, np.float32), "conv": np.ones(5)}
    padded = pad_head_rows(fisher, 5)
    np.testing.assert_array_equal(padded["head.weight"], [[1, 1]] * 3 + [[0, 0]] * 2)
    np.testing.assert_array_equal(padded["head.bias"], [1, 1, 1, 0, 0])
    assert padded["conv"] is fisher["conv"]
    assert pad_head_rows({}, 5) == {}  # a lazily created buffer with nothing yet
    assert pad_head_rows({"head.bias": np.ones(2)}, 3, fill=7.0)["head.bias"].tolist() == [1, 1, 7]
    with pytest.raises(ValueError, match="disagree"):
        pad_head_rows({"head.weight": np.ones((3, 2)), "head.bias": np.ones(4)}, 5)


def test_zeroing_head_rows_leaves_other_rows_and_entries_alone():
    momentum = {"head.weight": np.ones((3, 2), np.float32), "head.bias": np.ones(3, np.float32), "conv": np.ones(5)}
    out = zero_head_rows(momentum, [2])
    np.testing.assert_array_equal(out["head.weight"], [[1, 1], [1, 1], [0, 0]])
    np.testing.assert_array_equal(out["head.bias"], [1, 1, 0])
    assert out["conv"] is momentum["conv"] and momentum["head.bias"][2] == 1  # the input is not modified
    assert zero_head_rows({}, [0]) == {}
    with pytest.raises(ValueError, match="Invalid classes"):
        zero_head_rows(momentum, [3])


def test_ewc_state_grows_with_the_head_and_the_penalty_leaves_new_rows_free():
    torch.manual_seed(0)
    model = FaultCNN(in_channels=1, num_classes=3, width=8)
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    ewc = EWCState()
    ewc.consolidate([{n: np.ones_like(v) for n, v in params.items()}], [1], params)
    ewc.expand_classes(5)
    assert ewc.fisher["head.weight"].shape == (5, 32) and not ewc.fisher["head.bias"][3:].any()
    grown = expand_head(_numpy_state(model), 5)
    bigger = FaultCNN.from_state_dict({k: torch.from_numpy(v) for k, v in grown.items()})
    with torch.no_grad():
        bigger.head.weight.add_(1.0)
    EWCPenalty(ewc.fisher, ewc.anchors, lam=2.0)(bigger).backward()
    g = bigger.head.weight.grad
    assert not g[3:].any()
    torch.testing.assert_close(g[:3], torch.full_like(g[:3], 2.0))


@pytest.mark.parametrize(
    "state, new",
    [({"head.weight": np.ones((3, 2))}, 4), ({"head.weight": np.ones((3, 2)), "head.bias": np.ones(2)}, 4),
     ({"head.weight": np.ones((3, 2)), "head.bias": np.ones(3)}, 2),
     ({"head.weight": np.ones((3, 2), np.int64), "head.bias": np.ones(3, np.int64)}, 4)],
)
def test_expand_head_rejects_bad_input(state, new):
    with pytest.raises(ValueError, match="Invalid"):
        expand_head(state, new)


def test_server_consolidation_damps_the_drift_from_the_anchor_by_the_fisher():
    arrays = {"w": np.float32([2.0, 2.0, 2.0, -1.0]), "free": np.ones(2, dtype=np.float32)}
    fisher = {"w": np.float32([0.0, 1.0, 3.0, 1.0])}
    anchors = {"w": np.float32([0.0, 0.0, 0.0, 1.0])}
    out = server_consolidation(arrays, fisher, anchors, kappa=1.0)
    # anchor + (theta - anchor) / (1 + kappa F): F = 0 untouched, F = 1 halves the drift, F = 3 quarters it
    np.testing.assert_allclose(out["w"], [2.0, 1.0, 0.5, 0.0])
    assert out["w"].dtype == np.float32 and out["free"] is arrays["free"]  # no Fisher: passed through
    # it is the minimiser of 1/2 |theta - theta_agg|^2 + kappa/2 sum F (theta - anchor)^2: zero gradient there
    grad = (out["w"] - arrays["w"]) + 1.0 * fisher["w"] * (out["w"] - anchors["w"])
    np.testing.assert_allclose(grad, 0.0, atol=1e-6)
    np.testing.assert_array_equal(server_consolidation(arrays, fisher, anchors, kappa=0.0)["w"], arrays["w"])
    held = server_consolidation(arrays, fisher, anchors, kappa=1e9)["w"]
    np.testing.assert_allclose(held[1:], anchors["w"][1:], atol=1e-6)


@pytest.mark.parametrize(
    "fisher, anchors, kappa",
    [({"w": np.ones(3, np.float32)}, {"w": np.zeros(3, np.float32)}, 1.0),  # shape differs from the array
     ({"v": np.ones(4, np.float32)}, {"v": np.zeros(4, np.float32)}, 1.0),  # no such array
     ({"w": np.ones(4, np.float32)}, {}, 1.0),  # no anchor
     ({"w": np.ones(4, np.float32)}, {"w": np.zeros(4, np.float32)}, -1.0)],
)
def test_server_consolidation_rejects_bad_input(fisher, anchors, kappa):
    with pytest.raises(ValueError, match="Invalid"):
        server_consolidation({"w": np.zeros(4, np.float32)}, fisher, anchors, kappa)



def test_focus_keeps_the_largest_share_of_fisher_coordinates_and_their_anchors():
    from fedind.continual.ewc import focus

    fisher = {"a": np.array([0.0, 5.0, 1.0, 3.0], np.float32), "b": np.array([[4.0, 0.5]], np.float32)}
    anchors = {"a": np.arange(4, dtype=np.float32) + 1, "b": np.array([[7.0, 8.0]], np.float32)}
    f, a = focus(fisher, anchors, keep=0.5)  # 3 of 6 coordinates: 5, 4, 3
    np.testing.assert_array_equal(f["a"], [0, 5, 0, 3])
    np.testing.assert_array_equal(f["b"], [[4, 0]])
    np.testing.assert_array_equal(a["a"], [0, 2, 0, 4])
    np.testing.assert_array_equal(a["b"], [[7, 0]])
    same_f, same_a = focus(fisher, anchors, keep=1.0)
    np.testing.assert_array_equal(same_a["a"], anchors["a"])


def test_a_penalty_consolidated_before_the_head_grew_holds_nothing_on_the_new_rows(flower_task_identity):
    import json

    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

    from fedind import wire
    from fedind.config import RunConfig
    from fedind.continual.site import received_penalty

    model = FaultCNN(in_channels=1, num_classes=4, width=8)
    old = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    fisher = {k: np.ones_like(v) for k, v in old.items() if k in ("head.weight", "head.bias")}
    content = RecordDict({
        wire.EWC_FISHER: ArrayRecord({k: Array(v) for k, v in fisher.items()}),
        wire.EWC_ANCHORS: ArrayRecord({k: Array(old[k]) for k in fisher}),
        wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps({})}),
    })
    msg = Message(content, message_type=MessageType.TRAIN, dst_node_id=1)
    grown = FaultCNN(in_channels=1, num_classes=5, width=8)
    grown.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in expand_head(old, 5).items()}, strict=True)
    config = RunConfig(ewc_lambda=2.0, phases=2, phase_rounds=2, num_server_rounds=4)
    penalty = received_penalty(msg, config, None, num_classes=5)
    assert float(penalty(grown)) == 0.0  # at the anchors, and the new row is free
    with torch.no_grad():
        grown.head.weight[4] += 1.0  # the new class's row moves: no penalty
    assert float(penalty(grown)) == 0.0
    with torch.no_grad():
        grown.head.weight[0] += 1.0  # an old row moves: penalised
    assert float(penalty(grown)) > 0.0


def test_a_global_anchor_holds_training_near_the_received_model_and_needs_no_anchor_record(flower_task_identity):
    """``ewc-anchor = global``: the penalty is zero at the model the site received and grows
    as the kept coordinates leave it; the message carries the Fisher only."""
    import json

    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

    from fedind import wire
    from fedind.config import RunConfig
    from fedind.continual.site import received_penalty

    model = FaultCNN(in_channels=1, num_classes=4, width=8)
    fisher = {"head.weight": np.ones((4, model.head.in_features), np.float32)}
    content = RecordDict({
        wire.EWC_FISHER: ArrayRecord({k: Array(v) for k, v in fisher.items()}),
        wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps({})}),
    })
    msg = Message(content, message_type=MessageType.TRAIN, dst_node_id=1)
    config = RunConfig(ewc_lambda=2.0, ewc_anchor="global", phases=2, phase_rounds=2, num_server_rounds=4)
    penalty = received_penalty(msg, config, model, num_classes=4)
    assert float(penalty(model)) == 0.0
    with torch.no_grad():
        model.head.weight[1, 0] += 0.5  # the anchors are a copy: moving the model is penalised
    assert float(penalty(model)) == pytest.approx(0.5 * 2.0 * 0.25)
    with pytest.raises(ValueError, match="received model"):
        received_penalty(msg, config, None, num_classes=4)


def test_server_damping_needs_the_phase_end_anchor():
    from fedind.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="ewc-anchor"):
        RunConfig(ewc_lambda=1.0, ewc_server_lambda=1.0, ewc_anchor="global", phases=2, phase_rounds=2, num_server_rounds=4)
    with pytest.raises(ConfigError, match="ewc-anchor"):
        RunConfig(ewc_anchor="latest")


def test_a_faded_ewc_weight_falls_linearly_after_each_phase_end_and_is_off_after():
    from fedind.config import RunConfig

    config = RunConfig(ewc_lambda=10.0, ewc_fade_rounds=4, phases=2, phase_rounds=5, num_server_rounds=12)
    # phase 1 starts at round 6: weights 10, 7.5, 5, 2.5, then 0
    assert [config.ewc_lambda_at(r) for r in range(6, 12)] == [10.0, 7.5, 5.0, 2.5, 0.0, 0.0]
    assert RunConfig(ewc_lambda=3.0, phases=2, phase_rounds=5, num_server_rounds=12).ewc_lambda_at(11) == 3.0
