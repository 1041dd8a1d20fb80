"""Replay buffer: the hard bound, the admission / eviction policies, state, and replay mixing
in local training."""

import math

import numpy as np
import pytest
import torch

from fedind.data.format import SiteArrays
from fedind.models import FaultCNN
from fedind.continual.replay import POLICIES, ReplayBuffer
from fedind.training import evaluate, sample_losses, train_local

SHAPE = (1, 16)
SAMPLE_BYTES = 4 * 16 + 8 + 4


def _batch(rng, labels, shape=SHAPE):
    y = np.asarray(labels, dtype=np.int64)
    x = rng.standard_normal((len(y),) + shape).astype(np.float32)
    return x, y, rng.random(len(y))


def _held_arrays_nbytes(buffer: ReplayBuffer) -> int:
    return sum(v.nbytes for v in vars(buffer).values() if isinstance(v, np.ndarray))


# --------------------------------------------------------------------------- bound


@pytest.mark.parametrize("policy", POLICIES)
def test_bound_holds_in_samples_and_bytes_under_a_long_drifting_stream(policy):
    """100k samples whose label mix drifts and gains a class late: the buffer never holds more
    than its capacity, nor more bytes than max_bytes (counting every array it holds)."""
    num_classes, max_bytes = 6, 40_000
    buffer = ReplayBuffer(10_000, max_bytes, SHAPE, num_classes, policy=policy, seed=3)
    expected_capacity = (max_bytes - 16 * num_classes) // SAMPLE_BYTES
    assert buffer.capacity == expected_capacity == 525
    assert buffer.nbytes == _held_arrays_nbytes(buffer) <= max_bytes
    rng = np.random.default_rng(0)
    offered = 0
    for step in range(200):
        mix = np.array([8, 4, 2, 1, 1, 0], dtype=float) if step < 150 else np.array([1, 1, 1, 1, 1, 5], dtype=float)
        labels = rng.choice(num_classes, size=500, p=mix / mix.sum())
        buffer.offer(*_batch(rng, labels))
        offered += 500
        assert len(buffer) == min(offered, buffer.capacity)
        assert buffer.nbytes == _held_arrays_nbytes(buffer) <= max_bytes
        assert buffer.seen == offered
    assert offered == 100_000
    assert buffer.class_counts().sum() == len(buffer)
    np.testing.assert_array_equal(buffer.class_counts(), np.bincount(buffer.arrays().y, minlength=num_classes))


def test_max_samples_bounds_when_bytes_would_allow_more():
    buffer = ReplayBuffer(50, 10**9, SHAPE, 3, policy="reservoir")
    assert buffer.capacity == 50
    rng = np.random.default_rng(1)
    for _ in range(20):
        buffer.offer(*_batch(rng, rng.integers(0, 3, 64))[:2])
    assert len(buffer) == 50 and buffer.nbytes == 50 * SAMPLE_BYTES + 2 * 3 * 8


# --------------------------------------------------------------------------- reservoir


def test_reservoir_is_uniform_over_the_stream():
    """Each of 2000 stream positions is kept with probability 100/2000, whatever its place in
    the stream and the batch sizes (loose statistical check over 300 seeds)."""
    n, cap, runs = 2000, 100, 300
    kept = np.zeros(n)
    for seed in range(runs):
        buffer = ReplayBuffer(cap, 10**9, (1, 1), 1, policy="reservoir", seed=seed)
        ids = np.arange(n, dtype=np.float32).reshape(n, 1, 1)
        start = 0
        for size in [7, 93, 400, 1, 499, 1000]:  # uneven batches, crossing the fill boundary
            buffer.offer(ids[start : start + size], np.zeros(size, dtype=np.int64))
            start += size
        stored = buffer.arrays().x.ravel().astype(int)
        assert len(np.unique(stored)) == cap
        kept[stored] += 1
    rate = kept.reshape(20, 100).sum(axis=1) / (runs * 100)  # inclusion rate per 100 positions
    expected = cap / n
    sd = math.sqrt(expected * (1 - expected) / (runs * 100))
    assert np.all(np.abs(rate - expected) < 5 * sd), rate
    assert abs(kept.sum() / (runs * n) - expected) < 1e-12  # exactly cap kept per run


def test_reservoir_keeps_a_late_rare_class_only_in_proportion():
    rng = np.random.default_rng(2)
    buffer = ReplayBuffer(100, 10**9, SHAPE, 2, policy="reservoir", seed=0)
    buffer.offer(*_batch(rng, [0] * 20_000)[:2])
    buffer.offer(*_batch(rng, [1] * 20)[:2])
    assert buffer.class_counts()[1] <= 2  # expected 0.1


# --------------------------------------------------------------------------- balanced


@pytest.mark.parametrize("policy", ["balanced", "balanced-loss"])
def test_balanced_policies_keep_rare_and_late_classes(policy):
    """Heavy label skew, then a new class with 20 samples after 20k others: the balanced
    buffer gives it its full quota at once and keeps the rare class's share."""
    rng = np.random.default_rng(4)
    buffer = ReplayBuffer(100, 10**9, SHAPE, 5, policy=policy, seed=0)
    for _ in range(40):
        labels = rng.choice(4, size=500, p=[0.9, 0.07, 0.02, 0.01])
        buffer.offer(*_batch(rng, labels))
    counts = buffer.class_counts()
    assert counts.tolist() == [25, 25, 25, 25, 0]
    buffer.offer(*_batch(rng, [4] * 20))
    counts = buffer.class_counts()
    assert counts[4] == 20 and counts.sum() == 100 and counts[:4].min() == 20


def test_balanced_loss_keeps_the_highest_scores_of_a_class():
    rng = np.random.default_rng(5)
    buffer = ReplayBuffer(30, 10**9, SHAPE, 1, policy="balanced-loss")
    scores = rng.random(1000).astype(np.float32)
    x = np.arange(1000, dtype=np.float32)[:, None, None] * np.ones((1, 1, 16), dtype=np.float32)
    for start in range(0, 1000, 64):
        buffer.offer(x[start : start + 64], np.zeros(len(x[start : start + 64]), np.int64), scores[start : start + 64])
    np.testing.assert_array_equal(np.sort(buffer.scores()), np.sort(scores)[-30:])
    ids = buffer.arrays().x[:, 0, 0].astype(int)
    np.testing.assert_array_equal(scores[ids], buffer.scores())  # windows stay with their scores


def test_balanced_loss_at_quota_replaces_the_lowest_score_within_each_class():
    """Three classes arriving round-robin fill their quotas (10 each) together; from then on
    each class keeps exactly its 10 highest scores."""
    rng = np.random.default_rng(6)
    buffer = ReplayBuffer(30, 10**9, SHAPE, 3, policy="balanced-loss")
    labels = np.tile([0, 1, 2], 400)
    scores = rng.random(labels.size)
    x = rng.standard_normal((labels.size,) + SHAPE).astype(np.float32)
    for start in range(0, labels.size, 50):
        sl = slice(start, start + 50)
        buffer.offer(x[sl], labels[sl], scores[sl])
    held = buffer.arrays()
    for c in range(3):
        expected = np.sort(scores[labels == c]).astype(np.float32)[-10:]
        np.testing.assert_array_equal(np.sort(buffer.scores()[held.y == c]), expected)


def test_balanced_loss_evicts_the_lowest_score_of_the_largest_class_for_a_new_class():
    buffer = ReplayBuffer(10, 10**9, SHAPE, 3, policy="balanced-loss")
    rng = np.random.default_rng(7)
    x, _, _ = _batch(rng, [0] * 10)
    buffer.offer(x, np.zeros(10, np.int64), np.linspace(1.0, 2.0, 10)[::-1].copy())
    buffer.offer(*_batch(rng, [1])[:2], np.array([0.001]))  # admitted despite its low score
    assert buffer.class_counts().tolist() == [9, 1, 0]
    np.testing.assert_allclose(np.sort(buffer.scores()[buffer.arrays().y == 0]), np.linspace(1.0, 2.0, 10)[1:], rtol=1e-6)
    assert buffer.offer(*_batch(rng, [0])[:2], np.array([0.5])) == 0  # class 0 at quota, score too low


def test_offer_reports_how_many_of_the_batch_are_stored():
    rng = np.random.default_rng(8)
    buffer = ReplayBuffer(5, 10**9, SHAPE, 1, policy="balanced-loss")
    x, y, _ = _batch(rng, [0] * 8)
    # rows 0-4 fill; rows 5, 6, 7 replace lows; row 7's score beats row 5's, which it evicts
    assert buffer.offer(x, y, np.array([5, 6, 7, 8, 9, 1, 0.5, 10.0])) == 5
    np.testing.assert_array_equal(np.sort(buffer.scores()), [6, 7, 8, 9, 10])


# --------------------------------------------------------------------------- sampling, scores


def test_sample_draws_stored_examples_deterministically():
    rng = np.random.default_rng(9)
    buffer = ReplayBuffer(40, 10**9, SHAPE, 2, policy="balanced", seed=1)
    buffer.offer(*_batch(rng, rng.integers(0, 2, 100))[:2])
    x1, y1 = buffer.sample(40, np.random.default_rng(0))
    x2, y2 = buffer.sample(40, np.random.default_rng(0))
    np.testing.assert_array_equal(x1, x2)
    held = buffer.arrays()
    assert sorted(map(bytes, x1)) == sorted(map(bytes, held.x))  # a permutation, no repeats
    assert buffer.sample(100, np.random.default_rng(0), replace=True)[1].shape == (100,)
    with pytest.raises(ValueError, match="without replacement"):
        buffer.sample(41, np.random.default_rng(0))
    with pytest.raises(ValueError, match="empty"):
        ReplayBuffer(4, 10**9, SHAPE, 2).sample(1, np.random.default_rng(0))


def test_rescore_replaces_scores_in_slot_order():
    rng = np.random.default_rng(10)
    buffer = ReplayBuffer(4, 10**9, SHAPE, 2, policy="balanced-loss")
    buffer.offer(*_batch(rng, [0, 1, 0, 1]))
    buffer.rescore(np.array([4.0, 3.0, 2.0, 1.0]))
    np.testing.assert_array_equal(buffer.scores(), [4, 3, 2, 1])
    with pytest.raises(ValueError, match="Invalid scores"):
        buffer.rescore(np.array([1.0, np.nan, 1.0, 1.0]))


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_samples=0), dict(max_bytes=100), dict(policy="fifo"), dict(seed=-1), dict(num_classes=0),
     dict(sample_shape=(1,)), dict(max_samples=True)],
)
def test_invalid_construction_is_rejected(kwargs):
    args = dict(max_samples=10, max_bytes=10**6, sample_shape=SHAPE, num_classes=3) | kwargs
    with pytest.raises(ValueError, match="Invalid"):
        ReplayBuffer(**args)


def test_invalid_batches_are_rejected_and_change_nothing():
    rng = np.random.default_rng(11)
    buffer = ReplayBuffer(10, 10**9, SHAPE, 3, policy="balanced-loss")
    x, y, s = _batch(rng, [0, 1, 2])
    bad = [
        (x.astype(np.float64), y, s), (x[:, :, :8], y, s), (x, y.astype(np.float32), s),
        (x, np.array([0, 1, 3]), s), (x, np.array([0, -1, 2]), s), (x, y, None),
        (x, y, np.array([0.1, np.inf, 0.3])), (x, y, s[:2]), (np.full_like(x, np.nan), y, s),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            buffer.offer(*args)
    assert len(buffer) == 0 and buffer.seen == 0


# --------------------------------------------------------------------------- state


@pytest.mark.parametrize("policy", POLICIES)
def test_state_round_trip_continues_identically(policy):
    rng = np.random.default_rng(12)
    batches = [_batch(rng, rng.integers(0, 4, 64)) for _ in range(12)]
    a = ReplayBuffer(50, 10**9, SHAPE, 4, policy=policy, seed=5)
    for batch in batches[:6]:
        a.offer(*batch)
    state = a.state_dict()
    assert set(state) == {"x", "y", "score", "seen"} and state["x"].shape == (50,) + SHAPE
    b = ReplayBuffer(50, 10**9, SHAPE, 4, policy=policy, seed=5)
    b.load_state_dict(state)
    state["x"][:] = 0  # the state is a copy
    for batch in batches[6:]:
        a.offer(*batch)
        b.offer(*batch)
    for key, value in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[key], value)
    np.testing.assert_array_equal(a.class_counts(), b.class_counts())


def _good_state():
    rng = np.random.default_rng(13)
    buffer = ReplayBuffer(8, 10**9, SHAPE, 3, policy="balanced-loss")
    buffer.offer(*_batch(rng, [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]))
    return buffer.state_dict()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.pop("score"), "state keys"),
        (lambda s: s.update(extra=np.zeros(1)), "state keys"),
        (lambda s: s.update(x=s["x"].astype(np.float64)), "x in state"),
        (lambda s: s.update(y=s["y"].astype(np.int32)), "y in state"),
        (lambda s: s.update(seen=s["seen"].tolist()), "seen in state"),
        (lambda s: s.update(x=s["x"][:, :, :8].copy()), "shapes"),
        (lambda s: s.update(score=s["score"][:-1].copy()), "shapes"),
        (lambda s: s.update(seen=np.zeros(4, np.int64)), "classes"),
        (lambda s: s["y"].__setitem__(0, 3), "labels"),
        (lambda s: s["x"].__setitem__((0, 0, 0), np.nan), "non-finite"),
        (lambda s: s["seen"].__setitem__(0, 1), "exceeds seen"),
        (lambda s: s["seen"].__setitem__(0, -5), "exceeds seen"),
    ],
)
def test_bad_state_is_rejected_and_changes_nothing(mutate, message):
    state = _good_state()
    mutate(state)
    buffer = ReplayBuffer(8, 10**9, SHAPE, 3, policy="balanced-loss")
    with pytest.raises(ValueError, match=message):
        buffer.load_state_dict(state)
    assert len(buffer) == 0 and buffer.seen == 0


def test_state_larger_than_the_bound_is_rejected_smaller_is_loaded():
    state = _good_state()
    with pytest.raises(ValueError, match="exceed this buffer's capacity"):
        ReplayBuffer(7, 10**9, SHAPE, 3, policy="balanced-loss").load_state_dict(state)
    bigger = ReplayBuffer(20, 10**9, SHAPE, 3, policy="balanced-loss")
    bigger.load_state_dict(state)
    assert len(bigger) == 8 and bigger.seen == 10


# --------------------------------------------------------------------------- new classes


@pytest.mark.parametrize("policy", POLICIES)
def test_expand_classes_accepts_new_labels_and_stays_within_bytes(policy):
    rng = np.random.default_rng(14)
    max_bytes = 16 * 3 + 10 * SAMPLE_BYTES + 8  # exactly 10 samples with 3 classes
    buffer = ReplayBuffer(100, max_bytes, SHAPE, 3, policy=policy, seed=2)
    buffer.offer(*_batch(rng, rng.integers(0, 3, 40)))
    assert buffer.capacity == 10 and len(buffer) == 10
    before = {bytes(row) for row in buffer.arrays().x}
    buffer.expand_classes(4)  # 16 more bytes of counters: room for 9 samples only
    assert buffer.num_classes == 4 and buffer.capacity == len(buffer) == 9
    assert buffer.nbytes == _held_arrays_nbytes(buffer) <= max_bytes
    assert {bytes(row) for row in buffer.arrays().x} <= before
    np.testing.assert_array_equal(buffer.class_counts(), np.bincount(buffer.arrays().y, minlength=4))
    buffer.offer(*_batch(rng, [3, 3]))
    assert buffer.class_counts()[3] >= (2 if policy != "reservoir" else 0)
    with pytest.raises(ValueError, match="cannot shrink"):
        buffer.expand_classes(3)


# --------------------------------------------------------------------------- training hooks


def _site(labels, length=128, seed=0) -> SiteArrays:
    rng = np.random.default_rng(seed)
    y = np.array(labels, dtype=np.int64)
    x = rng.standard_normal((len(y), 1, length)).astype(np.float32) + y[:, None, None].astype(np.float32)
    return SiteArrays(x=x, y=y)


def _train(**kwargs) -> FaultCNN:
    torch.manual_seed(0)
    model = FaultCNN(in_channels=1, num_classes=4, width=8)
    train_local(model, _site([0, 1] * 8), epochs=1, batch_size=8, lr=0.05, seed=1, device=torch.device("cpu"), **kwargs)
    return model


def test_replay_mixing_is_deterministic_and_changes_training():
    memory = _site([2, 3] * 4, seed=1)
    a = _train(replay=memory, replay_ratio=0.5).state_dict()
    b = _train(replay=memory, replay_ratio=0.5).state_dict()
    plain = _train().state_dict()
    empty = _train(replay=SiteArrays(memory.x[:0], memory.y[:0]), replay_ratio=0.5).state_dict()
    for name in plain:
        assert torch.equal(a[name], b[name])
        assert torch.equal(empty[name], plain[name])  # an empty buffer mixes nothing
    assert not torch.equal(a["head.bias"], plain["head.bias"])


@pytest.mark.parametrize(
    "kwargs",
    [dict(replay_ratio=0.5), dict(replay=_site([0]), replay_ratio=0.0), dict(replay=_site([0]), replay_ratio=-1.0),
     dict(replay=_site([0], length=64), replay_ratio=1.0)],
)
def test_inconsistent_replay_arguments_are_rejected(kwargs):
    with pytest.raises(ValueError):
        _train(**kwargs)


def test_sample_losses_are_the_per_example_cross_entropy():
    torch.manual_seed(0)
    model = FaultCNN(in_channels=1, num_classes=4, width=8)
    data = _site([0, 1, 2, 3, 1], seed=2)
    losses = sample_losses(model, data, torch.device("cpu"), batch_size=2)
    assert losses.dtype == np.float32 and losses.shape == (5,)
    with torch.no_grad():
        logits = model(torch.from_numpy(data.x))
        expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(data.y), reduction="none")
    np.testing.assert_allclose(losses, expected.numpy(), rtol=1e-5)
    assert losses.mean() == pytest.approx(evaluate(model, data, torch.device("cpu")).loss, rel=1e-5)
