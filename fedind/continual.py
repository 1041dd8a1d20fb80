r"""Continual learning across data phases: the pure parts (no Flower).

A run with ``phases = P > 1`` splits its rounds into phases (``RunConfig.phase_of``); in
phase ``p`` every site trains on its phase-``p`` batch only (the older batches are gone
from the line), plus what its replay buffer kept, under the EWC penalty of the phases
before. At the end of every phase but the last the server sends every site one
``phase_end`` query with the global model :math:`\theta^*_p`; each site

* offers its batch to its replay buffer (:class:`fedind.replay.ReplayBuffer`), scored by
  the per-sample loss under :math:`\theta^*_p`, after refreshing the stale scores of what
  the buffer holds; a buffer is bounded by ``replay-samples`` windows,
  ``replay-bytes`` bytes and ``replay-share`` of the windows the site has had
  (:func:`replay_capacity`);
* returns the diagonal Fisher of :math:`\theta^*_p` on that batch
  (:func:`fedind.ewc.diagonal_fisher`) with its number of examples; the server keeps
  :math:`F \leftarrow \gamma F + \sum_s n_s F_s / \sum_s n_s` and the anchors
  :math:`\theta^*_p` (:class:`fedind.ewc.EWCState`) and sends both with every later train
  message; sites add :math:`\frac{\lambda}{2}\sum_i F_i(\theta_i-\theta^*_i)^2` to their loss.

**New classes.** A site trains and evaluates on the labels the received head has
(:func:`known`) and reports ``classes-seen`` (:func:`classes_seen`); when a reply reports
more classes than the head, the server grows the head (:func:`fedind.expansion.expand_head`:
old rows bit-identical, new rows ``W = 0``, ``b = min b``) and every piece of state that
follows it, before the round is scored and checkpointed; the next round every site gets the
grown model, the sites' replay buffers grow with it.

**Scores** (:func:`phase_scores`, :func:`forgetting`). The server scores the global model
every round on the global test set of each phase so far (labels beyond the head count as
errors). With :math:`a_{p,q}` the accuracy on phase ``q``'s test set at the end of phase
``p``, the final average accuracy is :math:`\frac1P\sum_q a_{P-1,q}` and the forgetting
(Chaudhry et al. 2018) :math:`\frac{1}{P-1}\sum_{q<P-1}\big(\max_{q\le p<P-1} a_{p,q} - a_{P-1,q}\big)`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .data.format import SiteArrays
from .replay import ReplayBuffer
from .training import evaluate

__all__ = [
    "PhaseScore",
    "classes_seen",
    "evaluate_known",
    "forgetting",
    "known",
    "replay_capacity",
    "restore_replay",
]


# --------------------------------------------------------------------------- labels


def known(data: SiteArrays, num_classes: int) -> SiteArrays:
    """The examples whose label the head has (``y < num_classes``); ``data`` itself if all."""
    keep = data.y < num_classes
    if keep.all():
        return data
    return SiteArrays(x=data.x[keep], y=data.y[keep])


def classes_seen(*splits: SiteArrays | None) -> int:
    """1 + the largest label in any of ``splits`` (0 if none has an example)."""
    return max((int(s.y.max()) + 1 for s in splits if s is not None and s.num_examples), default=0)


# --------------------------------------------------------------------------- replay bound


def replay_capacity(max_samples: int, share: float, windows: int) -> int:
    """Windows a site's buffer may hold: ``min(max_samples, floor(share * windows))``, with
    ``windows`` the windows the site has had (offered to its buffer so far, plus its current
    batch). Non-decreasing in ``windows``, so a saved buffer always fits again."""
    if max_samples < 0 or not (0 < share <= 1) or windows < 0:
        raise ValueError(f"Invalid replay bound: max_samples={max_samples}, share={share}, windows={windows}")
    return int(min(max_samples, math.floor(share * windows + 1e-9)))


def replay_bytes(max_bytes: int, capacity: int, sample_shape: tuple[int, int], num_classes: int) -> int:
    """The byte bound of a buffer: ``max_bytes``, or (0) exactly what ``capacity`` windows and
    the per-class counters take (see :class:`~fedind.replay.ReplayBuffer`)."""
    if max_bytes:
        return int(max_bytes)
    return capacity * (4 * math.prod(sample_shape) + 12) + 16 * num_classes


def restore_replay(
    state: Mapping[str, np.ndarray] | None,
    *,
    max_samples: int,
    max_bytes: int,
    sample_shape: tuple[int, int],
    num_classes: int,
    policy: str,
    seed: int,
) -> ReplayBuffer:
    """A buffer of the given bounds holding ``state`` (:meth:`ReplayBuffer.state_dict`, or
    None for an empty one), grown to ``num_classes`` classes (evicting if the bytes no
    longer fit). ValueError when ``state`` does not fit."""
    saved_classes = int(np.asarray(state["seen"]).shape[0]) if state is not None else num_classes
    if saved_classes > num_classes:
        raise ValueError(f"replay state has {saved_classes} classes, the model {num_classes}")
    # A derived byte bound is that of the grown buffer: growing then keeps every window.
    bound = replay_bytes(max_bytes, max_samples, sample_shape, num_classes)
    buffer = ReplayBuffer(max_samples, bound, sample_shape, saved_classes, policy=policy, seed=seed)
    if state is not None:
        buffer.load_state_dict(state)
    if num_classes > saved_classes:
        buffer.expand_classes(num_classes)
    return buffer


# --------------------------------------------------------------------------- scores


@dataclass(frozen=True)
class PhaseScore:
    """The global model on one phase's test set."""

    correct: int
    num_examples: int
    loss: float  # mean cross-entropy over the examples whose label the head has (NaN: none)
    num_known: int
    new_correct: int  # among examples with label >= new_from
    num_new: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.num_examples if self.num_examples else float("nan")


def evaluate_known(model: nn.Module, data: SiteArrays, device: torch.device, new_from: int | None = None) -> PhaseScore:
    """Score ``model`` on ``data`` whose labels may exceed its head: such an example counts
    as an error (the model cannot name its class) and is left out of the loss. ``new_from``:
    examples with ``y >= new_from`` are also counted apart (the new classes)."""
    num_classes = model.head.out_features
    inside = known(data, num_classes)
    new_n = int((data.y >= new_from).sum()) if new_from is not None else 0
    if not inside.num_examples:
        return PhaseScore(0, data.num_examples, float("nan"), 0, 0, new_n)
    result = evaluate(model, inside, device)
    hits = np.diag(result.confusion)
    new_correct = int(hits[new_from:].sum()) if new_from is not None else 0
    return PhaseScore(
        int(hits.sum()), data.num_examples, result.loss, inside.num_examples, new_correct, new_n
    )


def forgetting(after_phase: Sequence[Sequence[float]]) -> float | None:
    """Mean over phases ``q < P-1`` of ``max_{q <= p < P-1} a[p][q] - a[P-1][q]``, with
    ``a[p][q]`` the accuracy on phase ``q``'s test set at the end of phase ``p``
    (``after_phase[p]`` lists phases ``0..p``). None with a single phase; NaN entries
    (a phase without a test set) are skipped."""
    last = len(after_phase) - 1
    if last < 1:
        return None
    drops = []
    for q in range(last):
        best = [after_phase[p][q] for p in range(q, last) if np.isfinite(after_phase[p][q])]
        if best and np.isfinite(after_phase[last][q]):
            drops.append(max(best) - after_phase[last][q])
    return float(np.mean(drops)) if drops else None
