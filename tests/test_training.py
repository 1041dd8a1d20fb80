"""Local training: the label-prior logit adjustment (formula, and what it does to training)."""

import math

import numpy as np
import pytest
import torch

from fedind.data.format import SiteArrays
from fedind.models import FaultCNN
from fedind.training import _split_front_end, prior_logit_adjustment, time_stretch, train_local, trained_label_counts
from simulations.step_time import WholeModel


def test_adjustment_is_tau_log_prior_with_a_floor_for_missing_classes():
    adj = prior_logit_adjustment([30, 10, 0, 60], tau=0.5, floor=1e-4)
    expected = 0.5 * np.log([0.3, 0.1, 1e-4, 0.6])
    np.testing.assert_allclose(adj.numpy(), expected, rtol=1e-6)
    assert adj.dtype == torch.float32 and adj.shape == (4,)


def test_trained_label_counts_add_the_replayed_share_in_the_buffer_mix():
    # 8 new windows per epoch, r = 0.5: 4 replayed ones per epoch, drawn from a buffer of [0, 1, 3]
    np.testing.assert_allclose(trained_label_counts([6, 2, 0], [0, 1, 3], 0.5), [6, 3, 3])
    # without replay, or with an empty buffer, the new data's histogram itself
    for replayed, ratio in [(None, 0.0), ([0, 1, 3], 0.0), ([0, 0, 0], 0.5)]:
        np.testing.assert_array_equal(trained_label_counts([6, 2, 0], replayed, ratio), [6, 2, 0])
    # a class only the buffer holds is no longer at the floor's adjustment
    mixed = prior_logit_adjustment(trained_label_counts([6, 2, 0], [0, 0, 4], 0.5), tau=0.5)
    np.testing.assert_allclose(mixed.numpy(), 0.5 * np.log([0.5, 2 / 12, 4 / 12]), rtol=1e-6)


@pytest.mark.parametrize("replayed, ratio", [([1, 2], 0.5), ([1, -1, 0], 0.5), ([1, float("nan"), 0], 0.5), ([1, 1, 1], -1.0)])
def test_trained_label_counts_reject_bad_input(replayed, ratio):
    with pytest.raises(ValueError, match="Invalid"):
        trained_label_counts([6, 2, 0], replayed, ratio)


def test_balanced_site_gets_a_constant_shift_and_tau_zero_gets_zeros():
    np.testing.assert_allclose(prior_logit_adjustment([5, 5, 5, 5]).numpy(), [math.log(0.25)] * 4, rtol=1e-6)
    assert not prior_logit_adjustment([1, 0, 7], tau=0.0).any()


@pytest.mark.parametrize(
    "histogram, tau, floor",
    [([0, 0, 0], 1.0, 1e-4), ([1, -1, 2], 1.0, 1e-4), ([[1, 2]], 1.0, 1e-4), ([1, 2], -1.0, 1e-4),
     ([1, 2], float("nan"), 1e-4), ([1, 2], 1.0, 0.0), ([1, float("inf")], 1.0, 1e-4)],
)
def test_invalid_adjustment_arguments_are_rejected(histogram, tau, floor):
    with pytest.raises(ValueError, match="Invalid"):
        prior_logit_adjustment(histogram, tau, floor)


def _site(labels: list[int], length: int = 256, seed: int = 0) -> SiteArrays:
    rng = np.random.default_rng(seed)
    y = np.array(labels, dtype=np.int64)
    x = rng.standard_normal((len(y), 1, length)).astype(np.float32)
    x += y[:, None, None].astype(np.float32)  # a learnable offset per class
    return SiteArrays(x=x, y=y)


def _trained(data: SiteArrays, adjustment: torch.Tensor | None) -> FaultCNN:
    torch.manual_seed(0)
    model = FaultCNN(in_channels=1, num_classes=4, width=8)
    train_local(
        model, data, epochs=2, batch_size=8, lr=0.05, seed=1, device=torch.device("cpu"),
        logit_adjustment=adjustment,
    )
    return model


def test_a_constant_adjustment_changes_nothing():
    """Softmax is shift-invariant: a balanced site's adjustment trains the same model."""
    data = _site([0, 1, 2, 3] * 6)
    plain = _trained(data, None).state_dict()
    shifted = _trained(data, prior_logit_adjustment([6, 6, 6, 6])).state_dict()
    for name in plain:
        torch.testing.assert_close(shifted[name], plain[name], rtol=1e-4, atol=1e-5)


def test_adjustment_keeps_a_skewed_site_from_pushing_down_classes_it_never_sees():
    """A site with classes 0 and 1 only: plain cross-entropy lowers the head bias of classes
    2 and 3 (it learns "never predict them"); with the adjustment it barely moves them."""
    data = _site([0] * 20 + [1] * 4)
    torch.manual_seed(0)
    start = FaultCNN(in_channels=1, num_classes=4, width=8).head.bias.detach().clone()
    plain = _trained(data, None).head.bias.detach()
    adjusted = _trained(data, prior_logit_adjustment([20, 4, 0, 0])).head.bias.detach()
    plain_drop = (start[2:] - plain[2:]).mean()
    adjusted_drop = (start[2:] - adjusted[2:]).mean()
    assert plain_drop > 0.05
    assert abs(adjusted_drop) < 0.2 * plain_drop


def test_per_example_rows_equal_to_one_adjustment_train_the_same_model():
    data = _site([0] * 20 + [1] * 4)
    one = prior_logit_adjustment([20, 4, 0, 0])
    shared = _trained(data, one).state_dict()
    per_example = _trained(data, one.expand(len(data.y), 4)).state_dict()
    for name in shared:
        torch.testing.assert_close(per_example[name], shared[name], rtol=0, atol=0)


def test_per_example_rows_follow_their_examples_through_the_shuffle():
    """Two pooled sites with their own priors, one shuffled batch, lr 0: the training loss
    is the cross-entropy of each window's logits plus ITS site's row (rows left in data
    order while the windows are shuffled would give another loss)."""
    a, b = _site([0] * 12 + [1] * 4, seed=1), _site([2] * 12 + [3] * 4, seed=2)
    pooled = SiteArrays(np.concatenate([a.x, b.x]), np.concatenate([a.y, b.y]))
    rows = torch.cat([
        prior_logit_adjustment([12, 4, 0, 0]).expand(16, 4),
        prior_logit_adjustment([0, 0, 12, 4]).expand(16, 4),
    ])
    torch.manual_seed(0)
    model = FaultCNN(in_channels=1, num_classes=4, width=8)
    with torch.no_grad():
        model.eval()
        expected = torch.nn.functional.cross_entropy(model(torch.from_numpy(pooled.x)) + rows, torch.from_numpy(pooled.y))
        unmatched = torch.nn.functional.cross_entropy(model(torch.from_numpy(pooled.x)) + rows.flip(0), torch.from_numpy(pooled.y))
    model.eval()  # GroupNorm has no batch statistics: train and eval forward agree
    result = train_local(model, pooled, epochs=1, batch_size=32, lr=0.0, seed=3, device=torch.device("cpu"),
                         logit_adjustment=rows)
    assert result.loss == pytest.approx(float(expected), rel=1e-5)
    assert abs(float(unmatched) - float(expected)) > 0.1


@pytest.mark.parametrize("rows", [3, 25])
def test_per_example_adjustment_needs_one_row_per_example(rows):
    data = _site([0, 1, 2, 3] * 6)
    with pytest.raises(ValueError, match="one row per example"):
        _trained(data, torch.zeros(rows, 4))


@pytest.mark.parametrize("clip", [0.05, 0.5])
def test_gradient_clipping_bounds_every_step(clip):
    """Plain SGD (no momentum, no weight decay), one batch per step: with ``grad_clip`` no
    step moves the weights further than ``lr * clip``; without it the first step does."""
    data = _site([0, 1, 2, 3] * 4)

    def steps(grad_clip: float) -> list[float]:
        torch.manual_seed(0)
        model = FaultCNN(in_channels=1, num_classes=4, width=8)
        moves, before = [], [p.detach().clone() for p in model.parameters()]
        for epoch in range(3):
            train_local(model, data, epochs=1, batch_size=len(data.y), lr=0.1, seed=epoch,
                        device=torch.device("cpu"), momentum=0.0, weight_decay=0.0, grad_clip=grad_clip)
            after = [p.detach().clone() for p in model.parameters()]
            moves.append(math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(after, before))))
            before = after
        return moves

    assert max(steps(clip)) <= 0.1 * clip * (1 + 1e-5)
    assert steps(0.0)[0] > 0.1 * clip


def test_classify_after_condition_is_forward():
    torch.manual_seed(0)
    model = FaultCNN(in_channels=2, num_classes=5, width=8)
    x = torch.randn(7, 2, 300)
    assert torch.equal(model.classify(model.condition(x)), model(x))


@pytest.mark.parametrize("replay_ratio", [0.0, 0.5])
def test_front_end_computed_once_trains_the_same_model_bit_for_bit(replay_ratio):
    """train_local conditions a FaultCNN's windows once (in chunks) instead of every batch:
    the trained weights are exactly those of running the whole model on each batch."""
    data = _site([0, 1, 2, 3] * 9 + [1] * 3, length=300)
    replay = _site([2, 3] * 5, length=300, seed=3) if replay_ratio else None
    trained = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = FaultCNN(in_channels=1, num_classes=4, width=8)
        train_local(
            WholeModel(model) if wrap else model, data, epochs=2, batch_size=8, lr=0.05, seed=1,
            device=torch.device("cpu"), replay=replay, replay_ratio=replay_ratio,
            logit_adjustment=prior_logit_adjustment([9, 12, 9, 9]),
        )
        trained.append(model.state_dict())
    for name in trained[0]:
        assert torch.equal(trained[0][name], trained[1][name]), name


def test_windows_conditioned_in_chunks_equal_the_whole_batch_and_other_models_pass_through():
    torch.manual_seed(0)
    model = FaultCNN(in_channels=1, num_classes=4, width=8)
    x = torch.randn(11, 1, 300)
    forward, z = _split_front_end(model, x, chunk=4)
    assert forward == model.classify and torch.equal(z, model.condition(x))
    assert _split_front_end(model, x[:0])[0] is model  # no windows: nothing to condition
    plain = torch.nn.Linear(300, 4)
    assert _split_front_end(plain, x) == (plain, x)


def _period(signal: np.ndarray) -> float:
    """Samples per cycle of the strongest non-DC frequency."""
    spectrum = np.abs(np.fft.rfft(signal - signal.mean()))
    return signal.size / float(np.argmax(spectrum[1:]) + 1)


@pytest.mark.parametrize("factor", [2 / 3, 1.5])
def test_time_stretch_slows_a_rhythm_by_its_factor(factor):
    """A 32-sample rhythm plays 32 * factor samples per cycle; a longer result is cut to the
    window from the offset, a shorter one is left short."""
    t = np.arange(1024)
    x = torch.from_numpy(np.sin(2 * np.pi * t / 32).astype(np.float32)).repeat(2, 3, 1)
    out = time_stretch(x, factor, offset=0.5)
    assert out.shape[:2] == (2, 3) and out.shape[-1] == min(1024, round(1024 * factor))
    assert _period(out[0, 0].numpy()) == pytest.approx(32 * factor, rel=0.03)
    assert time_stretch(x, 1.0) is x
    whole = time_stretch(x, 1.5, offset=0.0)
    late = time_stretch(x, 1.5, offset=1.0)
    assert torch.equal(whole[..., 512:], late[..., :512])  # the cut moves with the offset


@pytest.mark.parametrize("factor, offset", [(0.0, 0.0), (-1.5, 0.0), (math.inf, 0.0), (1.5, 1.5)])
def test_time_stretch_rejects_bad_arguments(factor, offset):
    with pytest.raises(ValueError, match="time stretch"):
        time_stretch(torch.zeros(1, 1, 64), factor, offset)


def test_stretched_training_is_seeded_and_off_at_one():
    """``stretch`` 1 is plain training bit for bit; above 1 the same seed gives the same
    model, and another model than plain training; below 1 it is refused."""
    data = _site([0, 1, 2, 3] * 9, length=300)
    trained = {}
    for name, stretch in (("plain", None), ("one", 1.0), ("a", 1.5), ("b", 1.5)):
        torch.manual_seed(0)
        model = FaultCNN(in_channels=1, num_classes=4, width=8)
        extra = {} if stretch is None else {"stretch": stretch}
        train_local(model, data, epochs=1, batch_size=8, lr=0.05, seed=1, device=torch.device("cpu"), **extra)
        trained[name] = model.state_dict()
    same = lambda a, b: all(torch.equal(trained[a][k], trained[b][k]) for k in trained[a])  # noqa: E731
    assert same("plain", "one") and same("a", "b") and not same("plain", "a")
    for bad in (0.5, True, math.nan):
        with pytest.raises(ValueError, match="stretch"):
            train_local(FaultCNN(in_channels=1, num_classes=4, width=8), data, epochs=1, batch_size=8,
                        lr=0.05, seed=1, device=torch.device("cpu"), stretch=bad)
