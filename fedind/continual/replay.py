"""Bounded replay buffer of a site: what a site remembers of the data it has seen.

Pure numpy. A site offers every batch of new data to its buffer (with a per-sample
importance score, e.g. the loss of the current model: :func:`fedind.training.sample_losses`)
and mixes samples drawn from it into its local batches (``train_local(replay=..., replay_ratio=...)``).

**Bound.** Counted bytes are the ``nbytes`` of the arrays the buffer holds::

    x      float32 [capacity, C, L]   the windows
    y      int64   [capacity]         their labels
    score  float32 [capacity]         their importance scores
    seen   int64   [num_classes]      stream count per class
    count  int64   [num_classes]      stored count per class

``capacity = min(max_samples, (max_bytes - 16 * num_classes) // (4*C*L + 12))``. They are
allocated once, at construction (``np.zeros``: the OS commits pages as they are first
written), so :attr:`nbytes` is constant and ``<= max_bytes`` however long the stream; only
:meth:`expand_classes` reallocates, to a capacity that again fits ``max_bytes``. Python
object overhead (a few hundred bytes, constant) is not counted.

**Policies** (what to keep once the buffer is full; until then every sample is admitted):

``"reservoir"``
    Algorithm R (Vitter 1985): the ``t``-th sample of the stream (``t = 0, 1, ...``) draws
    ``j ~ U{0..t}`` and replaces slot ``j`` if ``j < capacity``. After ``n`` samples the buffer
    is a uniform random subset of size ``min(n, capacity)`` of the stream. Label skew and
    new classes are kept only in proportion to their share of the stream. Scores unused.

``"balanced"``
    Class-balanced reservoir sampling (CBRS, Chrysakis & Moens 2020). With ``m`` classes
    seen so far, each class's quota is ``q = max(capacity // m, 1)``. A sample of class ``c``
    with ``count[c] < q`` is always admitted and evicts a random sample of the largest class
    (ties: random); otherwise it replaces a random stored sample of its own class with
    probability ``count[c] / seen[c]`` (reservoir sampling within the class). A class that
    appears late, or rarely, thus gets its share at once and keeps it.

``"balanced-loss"`` (default)
    Same quotas, but importance decides instead of chance: a class under quota evicts the
    *lowest-score* sample of the largest class (ties between classes: the one whose lowest
    score is lowest); a class at quota admits a sample only if its score is higher than the
    lowest score stored for that class, which it then replaces. With the per-sample loss as
    score the buffer keeps, per class, the samples the model finds hardest: those near the
    decision boundary and those it is forgetting, which is what rehearsal needs (easy,
    low-loss samples add almost no gradient). Loss is used, not the per-sample gradient
    norm: it needs one forward pass instead of one backward pass per sample, and for
    softmax cross-entropy the two rank samples nearly alike (the loss is ``-log p_y``; the
    gradient w.r.t. the logits, ``p - e_y``, has a norm between ``1 - p_y`` and
    ``sqrt(2) (1 - p_y)``: both grow with ``1 - p_y``). Scores go stale as the model
    learns; :meth:`rescore` refreshes them (e.g. once per round, the buffer is small). A
    mislabelled sample keeps a high loss for ever, but can never take more than its class's
    quota.

**Randomness.** Draws come from ``np.random.default_rng([seed, seen_total])``, one generator
per :meth:`offer` call keyed by the stream position, so a buffer restored from
:meth:`state_dict` draws what the original would have drawn, and the result is
deterministic for a given seed and sequence of calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ..data.format import SiteArrays

__all__ = ["POLICIES", "ReplayBuffer"]

POLICIES = ("reservoir", "balanced", "balanced-loss")

_STATE_KEYS = ("x", "y", "score", "seen")
# Salt for draws that are not part of offering samples (shrinking on expand_classes).
_SHRINK_SALT = 1


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"Invalid {name} value: {value!r} (expected a positive integer)")
    return int(value)


class ReplayBuffer:
    """At most ``max_samples`` samples in at most ``max_bytes`` bytes; see the module doc.

    ``sample_shape`` is ``(C, L)`` of one window, ``num_classes`` the number of labels
    (grow it with :meth:`expand_classes`), ``policy`` one of :data:`POLICIES`.
    """

    def __init__(
        self,
        max_samples: int,
        max_bytes: int,
        sample_shape: tuple[int, int],
        num_classes: int,
        policy: str = "balanced-loss",
        seed: int = 0,
    ) -> None:
        self.max_samples = _positive_int(max_samples, "max_samples")
        self.max_bytes = _positive_int(max_bytes, "max_bytes")
        shape = tuple(sample_shape) if isinstance(sample_shape, (tuple, list)) else None
        if shape is None or len(shape) != 2:
            raise ValueError(f"Invalid sample_shape value: {sample_shape!r} (expected (channels, length))")
        self.sample_shape = (_positive_int(shape[0], "sample_shape[0]"), _positive_int(shape[1], "sample_shape[1]"))
        num_classes = _positive_int(num_classes, "num_classes")
        if policy not in POLICIES:
            raise ValueError(f"Invalid policy value: {policy!r} (expected one of {POLICIES})")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"Invalid seed value: {seed!r}")
        self.policy = policy
        self.seed = int(seed)
        self.capacity = self._capacity_for(num_classes)
        c, length = self.sample_shape
        self._x = np.zeros((self.capacity, c, length), dtype=np.float32)
        self._y = np.zeros(self.capacity, dtype=np.int64)
        self._score = np.zeros(self.capacity, dtype=np.float32)
        self._seen = np.zeros(num_classes, dtype=np.int64)
        self._count = np.zeros(num_classes, dtype=np.int64)
        self._size = 0

    # ------------------------------------------------------------------ sizes

    @property
    def sample_bytes(self) -> int:
        """Bytes one stored sample takes: x (float32), y (int64), score (float32)."""
        return 4 * math.prod(self.sample_shape) + 8 + 4

    def _capacity_for(self, num_classes: int) -> int:
        fixed = 16 * num_classes  # seen + count, int64 each
        capacity = min(self.max_samples, (self.max_bytes - fixed) // self.sample_bytes)
        if capacity < 1:
            raise ValueError(
                f"Invalid max_bytes value: {self.max_bytes} holds no sample of shape {self.sample_shape} "
                f"with {num_classes} classes (needs at least {self.sample_bytes + fixed})"
            )
        return int(capacity)

    @property
    def num_classes(self) -> int:
        return int(self._seen.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of every array the buffer holds; never more than ``max_bytes``."""
        return sum(a.nbytes for a in (self._x, self._y, self._score, self._seen, self._count))

    def __len__(self) -> int:
        return self._size

    @property
    def seen(self) -> int:
        """Samples offered so far (the stream count)."""
        return int(self._seen.sum())

    def class_seen(self) -> np.ndarray:
        """Samples offered so far per class (int64 ``[num_classes]``, a copy)."""
        return self._seen.copy()

    def class_counts(self) -> np.ndarray:
        """Samples stored per class (int64 ``[num_classes]``, a copy)."""
        return self._count.copy()

    # ------------------------------------------------------------------ reading

    def arrays(self) -> SiteArrays:
        """Copies of the stored windows and labels, in slot order (the order of :meth:`scores`)."""
        return SiteArrays(x=self._x[: self._size].copy(), y=self._y[: self._size].copy())

    def scores(self) -> np.ndarray:
        """Copies of the stored scores (float32), in slot order."""
        return self._score[: self._size].copy()

    def sample(self, n: int, generator: np.random.Generator, replace: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` of ``n`` stored samples drawn uniformly (copies). Without replacement
        ``n`` may not exceed ``len(self)``."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"Invalid n value: {n!r}")
        if not isinstance(generator, np.random.Generator):
            raise TypeError(f"generator must be a numpy Generator, got {type(generator).__name__}")
        if n > 0 and self._size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        if not replace and n > self._size:
            raise ValueError(f"cannot draw {n} samples without replacement from {self._size}")
        idx = generator.choice(self._size, size=int(n), replace=replace) if n else np.zeros(0, dtype=np.int64)
        return self._x[idx], self._y[idx]

    # ------------------------------------------------------------------ writing

    def offer(self, x: np.ndarray, y: np.ndarray, scores: np.ndarray | None = None) -> int:
        """Offer a batch of new samples (``x`` float32 [B, C, L], ``y`` integer [B]) in stream
        order; ``scores`` (finite, [B]) are required by ``"balanced-loss"``, optional (stored,
        unused) otherwise. Returns how many of them are stored afterwards."""
        x, y, scores = self._check_batch(x, y, scores)
        rng = np.random.default_rng([self.seed, self.seen])
        if self.policy == "reservoir":
            return self._offer_reservoir(x, y, scores, rng)
        return self._offer_balanced(x, y, scores, rng)

    def rescore(self, scores: np.ndarray) -> None:
        """Replace the stored scores (slot order, as :meth:`arrays`), e.g. with the losses of
        the current model: scores computed at admission go stale as the model learns."""
        s = np.asarray(scores)
        if s.shape != (self._size,) or not np.issubdtype(s.dtype, np.floating) or not np.all(np.isfinite(s)):
            raise ValueError(f"Invalid scores: expected {self._size} finite floats, got {s.dtype} {s.shape}")
        self._score[: self._size] = s

    def _check_batch(self, x, y, scores) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 3 or x.shape[1:] != self.sample_shape:
            got = f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
            raise ValueError(f"Invalid x: expected float32 [B, {self.sample_shape[0]}, {self.sample_shape[1]}], got {got}")
        if not isinstance(y, np.ndarray) or not np.issubdtype(y.dtype, np.integer) or y.shape != (x.shape[0],):
            got = f"{y.dtype} {y.shape}" if isinstance(y, np.ndarray) else type(y).__name__
            raise ValueError(f"Invalid y: expected integer labels of shape ({x.shape[0]},), got {got}")
        if y.size and (y.min() < 0 or y.max() >= self.num_classes):
            raise ValueError(
                f"Invalid y: labels must lie in [0, {self.num_classes}), got {int(y.min())}..{int(y.max())} "
                "(grow the buffer with expand_classes first)"
            )
        if not np.all(np.isfinite(x)):
            raise ValueError("Invalid x: non-finite values")
        if scores is None:
            if self.policy == "balanced-loss":
                raise ValueError("policy 'balanced-loss' needs scores (e.g. per-sample losses)")
        else:
            scores = np.asarray(scores)
            if (
                scores.shape != (x.shape[0],)
                or not np.issubdtype(scores.dtype, np.floating)
                or not np.all(np.isfinite(scores))
            ):
                raise ValueError(f"Invalid scores: expected {x.shape[0]} finite floats, got {scores.dtype} {scores.shape}")
        return x, y.astype(np.int64, copy=False), scores

    def _write(self, slots: np.ndarray, x, y, scores, rows: np.ndarray) -> None:
        self._x[slots] = x[rows]
        self._y[slots] = y[rows]
        self._score[slots] = 0.0 if scores is None else scores[rows]

    def _offer_reservoir(self, x, y, scores, rng) -> int:
        b, size, cap = y.shape[0], self._size, self.capacity
        fill = min(b, cap - size)  # free slots are taken in order (Algorithm R's first k)
        t = self.seen + np.arange(fill, b, dtype=np.int64)  # stream positions of the rest
        j = rng.integers(0, t + 1) if b > fill else np.zeros(0, dtype=np.int64)
        rows = np.concatenate([np.arange(fill), fill + np.flatnonzero(j < cap)])
        slots = np.concatenate([size + np.arange(fill), j[j < cap]])
        # A slot written twice within the batch keeps the later sample (stream order).
        last = len(slots) - 1 - np.unique(slots[::-1], return_index=True)[1]
        rows, slots = rows[last], slots[last]
        np.add.at(self._seen, y, 1)
        np.add.at(self._count, self._y[slots[slots < size]], -1)
        self._write(slots, x, y, scores, rows)
        np.add.at(self._count, y[rows], 1)
        self._size = size + fill
        return int(rows.size)

    def _offer_balanced(self, x, y, scores, rng) -> int:
        b = y.shape[0]
        fill = min(b, self.capacity - self._size)
        stored = set(range(fill))  # batch rows stored at the end of this call
        if fill:
            self._write(np.arange(self._size, self._size + fill), x, y, scores, np.arange(fill))
            np.add.at(self._seen, y[:fill], 1)
            np.add.at(self._count, y[:fill], 1)
            self._size += fill
        row_of_slot = {self._size - fill + r: r for r in range(fill)}  # slot -> batch row
        cache: dict[int, tuple[float, int]] = {}  # class -> (lowest score, its slot)
        seen = self._seen.tolist()
        count = self._count.tolist()
        ys = y.tolist()
        ss = None if scores is None else scores.tolist()
        by_loss = self.policy == "balanced-loss"
        for i in range(fill, b):
            c = ys[i]
            seen[c] += 1
            quota = max(self.capacity // sum(1 for s in seen if s > 0), 1)
            if count[c] < quota:
                top = max(count)
                largest = [k for k in range(len(count)) if count[k] == top]
                if by_loss:
                    victim = min(largest, key=lambda k: (self._lowest(k, cache)[0], k))
                    slot = self._lowest(victim, cache)[1]
                else:
                    victim = largest[int(rng.integers(len(largest)))] if len(largest) > 1 else largest[0]
                    members = np.flatnonzero(self._y[: self._size] == victim)
                    slot = int(members[rng.integers(len(members))])
                count[victim] -= 1
                count[c] += 1
                cache.pop(victim, None)
            else:
                if by_loss:
                    low, slot = self._lowest(c, cache)
                    if ss[i] <= low:
                        continue
                else:
                    r = int(rng.integers(seen[c]))
                    if r >= count[c]:
                        continue
                    slot = int(np.flatnonzero(self._y[: self._size] == c)[r])
            cache.pop(c, None)
            self._y[slot] = c
            self._x[slot] = x[i]
            self._score[slot] = 0.0 if ss is None else ss[i]
            stored.discard(row_of_slot.get(slot, -1))
            row_of_slot[slot] = i
            stored.add(i)
        self._seen[:] = seen
        self._count[:] = count
        return len(stored)

    def _lowest(self, c: int, cache: dict[int, tuple[float, int]]) -> tuple[float, int]:
        """(lowest score, its slot) of class ``c`` (which must be stored); ties: lowest slot."""
        if c not in cache:
            members = np.flatnonzero(self._y[: self._size] == c)
            j = int(members[np.argmin(self._score[members])])
            cache[c] = (float(self._score[j]), j)
        return cache[c]

    # ------------------------------------------------------------------ new classes

    def expand_classes(self, num_classes: int) -> None:
        """Accept labels up to ``num_classes - 1`` (a new fault class). The per-class counters
        grow by 16 bytes a class; if the samples then no longer fit ``max_bytes`` the buffer
        evicts by its policy (reservoir: a uniform random subset is kept, which keeps it a
        uniform sample of the stream; balanced: from the largest classes, at random or
        lowest score first) and reallocates at the smaller capacity."""
        num_classes = _positive_int(num_classes, "num_classes")
        if num_classes < self.num_classes:
            raise ValueError(f"Invalid num_classes value: {num_classes} < {self.num_classes} (classes cannot shrink)")
        capacity = self._capacity_for(num_classes)
        grow = num_classes - self.num_classes
        seen = np.concatenate([self._seen, np.zeros(grow, dtype=np.int64)])
        count = np.concatenate([self._count, np.zeros(grow, dtype=np.int64)])
        if capacity < self.capacity:
            keep = self._keep_on_shrink(capacity)
            x, y, score = self._x[keep], self._y[keep], self._score[keep]
            self._x = np.zeros((capacity,) + self.sample_shape, dtype=np.float32)
            self._y = np.zeros(capacity, dtype=np.int64)
            self._score = np.zeros(capacity, dtype=np.float32)
            self._size = len(keep)
            self._x[: self._size], self._y[: self._size], self._score[: self._size] = x, y, score
            count[:] = np.bincount(y, minlength=num_classes)
            self.capacity = capacity
        self._seen, self._count = seen, count

    def _keep_on_shrink(self, capacity: int) -> np.ndarray:
        """Slots to keep (sorted) when the capacity drops to ``capacity``."""
        if self._size <= capacity:
            return np.arange(self._size)
        rng = np.random.default_rng([self.seed, self.seen, _SHRINK_SALT])
        if self.policy == "reservoir":
            return np.sort(rng.choice(self._size, size=capacity, replace=False))
        alive = np.ones(self._size, dtype=bool)
        count = np.bincount(self._y[: self._size], minlength=self.num_classes)
        for _ in range(self._size - capacity):
            largest = np.flatnonzero(count == count.max())
            if self.policy == "balanced-loss":
                lows = [self._score[np.flatnonzero(alive & (self._y[: self._size] == k))].min() for k in largest]
                victim = int(largest[int(np.argmin(lows))])
                members = np.flatnonzero(alive & (self._y[: self._size] == victim))
                slot = int(members[np.argmin(self._score[members])])
            else:
                victim = int(largest[rng.integers(len(largest))])
                members = np.flatnonzero(alive & (self._y[: self._size] == victim))
                slot = int(members[rng.integers(len(members))])
            alive[slot] = False
            count[victim] -= 1
        return np.flatnonzero(alive)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """``{"x": float32 [n, C, L], "y": int64 [n], "score": float32 [n], "seen": int64
        [num_classes]}``, copies of the stored part. Bounds, policy and seed come from the
        config; the stored count per class is derived from ``y``."""
        n = self._size
        return {
            "x": self._x[:n].copy(),
            "y": self._y[:n].copy(),
            "score": self._score[:n].copy(),
            "seen": self._seen.copy(),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from :meth:`state_dict`; validates everything before changing ``self``.
        The buffer must have the state's number of classes (build it with the old number,
        load, then :meth:`expand_classes`) and room for its samples. A buffer whose bound
        was raised since the save loads a smaller state and fills up again from the stream."""
        if not isinstance(state, Mapping) or set(state) != set(_STATE_KEYS):
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"Invalid ReplayBuffer state keys: {keys} (expected {sorted(_STATE_KEYS)})")
        for name, dtype in zip(_STATE_KEYS, (np.float32, np.int64, np.float32, np.int64)):
            arr = state[name]
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype:
                got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
                raise ValueError(f"Invalid {name} in state: expected a {np.dtype(dtype)} array, got {got}")
        x, y, score, seen = (state[k] for k in _STATE_KEYS)
        n = y.shape[0] if y.ndim == 1 else -1
        if y.ndim != 1 or x.shape != (n,) + self.sample_shape or score.shape != (n,):
            raise ValueError(
                f"Invalid state shapes: x {x.shape}, y {y.shape}, score {score.shape} "
                f"(expected [n, {self.sample_shape[0]}, {self.sample_shape[1]}], [n], [n])"
            )
        if seen.shape != (self.num_classes,):
            raise ValueError(
                f"Invalid seen in state: shape {seen.shape}, this buffer has {self.num_classes} classes "
                "(build it with the state's number of classes, load, then expand_classes)"
            )
        if n > self.capacity:
            raise ValueError(
                f"Invalid state: {n} samples exceed this buffer's capacity of {self.capacity} "
                f"(max_samples={self.max_samples}, max_bytes={self.max_bytes})"
            )
        if n and (y.min() < 0 or y.max() >= self.num_classes):
            raise ValueError(f"Invalid y in state: labels must lie in [0, {self.num_classes})")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(score))):
            raise ValueError("Invalid state: non-finite values in x or score")
        count = np.bincount(y, minlength=self.num_classes).astype(np.int64)
        if np.any(seen < 0) or np.any(count > seen):
            raise ValueError(
                f"Invalid state: stored per class {count.tolist()} exceeds seen per class {seen.tolist()}"
            )
        self._x[:n], self._y[:n], self._score[:n] = x, y, score
        self._seen = seen.copy()
        self._count = count
        self._size = int(n)
