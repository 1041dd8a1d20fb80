r"""Continual learning across data phases: the pure parts (no Flower).

A run with ``phases = P > 1`` splits its rounds into phases (``RunConfig.phase_of``); in
phase ``p`` every site trains on its phase-``p`` batch only (the older batches are gone
from the line), plus what its replay buffer kept, under the EWC penalty of the phases
before. At the end of every phase but the last the server sends every site one
``phase_end`` query with the global model :math:`\theta^*_p`; each site

* offers its batch to its replay buffer (:class:`fedind.continual.replay.ReplayBuffer`), scored by
  the per-sample loss under :math:`\theta^*_p`, after refreshing the stale scores of what
  the buffer holds; a buffer is bounded by ``replay-samples`` windows,
  ``replay-bytes`` bytes and ``replay-share`` of the windows the site has had
  (:func:`replay_capacity`);
* returns the diagonal Fisher of :math:`\theta^*_p` on that batch
  (:func:`fedind.continual.ewc.diagonal_fisher`) with its number of examples; the server keeps
  :math:`F \leftarrow \gamma F + \sum_s n_s F_s / \sum_s n_s` and the anchors
  :math:`\theta^*_p` (:class:`fedind.continual.ewc.EWCState`) and sends both with every later train
  message; sites add :math:`\frac{\lambda}{2}\sum_i F_i(\theta_i-\theta^*_i)^2` to their loss.

**New classes.** A site trains and evaluates on the labels the received head has
(:func:`known`) and reports ``classes-seen`` (:func:`classes_seen`); when a reply reports
more classes than the head, the server grows the head (:func:`fedind.continual.expansion.expand_head`:
old rows bit-identical) and every piece of state that follows it, before the round is
scored and checkpointed; the next round every site gets the grown model, the sites' replay
buffers grow with it.

*Proposed rows.* A site that sees classes the head lacks also proposes their head rows
(:func:`fit_new_rows`): the softmax regression of its windows on the received model's
features with the old rows held fixed, under the loss of its local training (its logit
adjustment and weight decay), solved to the optimum (convex in the new rows). The server
starts each new row from the proposals weighted by the proposers' windows of that class
(:func:`merge_row_proposals`; without a valid proposal, ``W = 0``, ``b = min b``); a
proposal beyond the scale of the model's own rows (:func:`row_bounds`) is not valid. Until
the phase in which they grew ends, the holders refit those rows every round on the model
they receive (the train message's ``refit-from``), and their merged fit replaces the
aggregated rows: once, at the growth, was not enough, as the features moved on under the
new phase's data and the grown row recognised nothing two rounds later. Why:
under logit adjustment a site without the class sends almost no gradient to its row, so
the federated average dilutes the one line that has it by that line's share of the
examples; a zero row then took 20 rounds to recognise a class one line had 8 windows of,
and with replay or EWC it never did in a 30-round phase, although the features already
separated it (a row fitted on the final model's features at that line recognised 98 % of
it on the global test).

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

from ..data.format import SiteArrays
from .replay import ReplayBuffer
from ..training import WEIGHT_DECAY, evaluate, prior_logit_adjustment, window_features

__all__ = [
    "PhaseScore",
    "check_row_proposal",
    "classes_seen",
    "evaluate_known",
    "fit_new_rows",
    "forgetting",
    "known",
    "merge_row_proposals",
    "propose_new_rows",
    "replay_capacity",
    "restore_replay",
    "row_bounds",
]

ROW_SCALE = 100.0  # a proposed row and its bias may reach this many times the model's largest row norm


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


def fit_new_rows(
    features: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    num_classes: int,
    adjustment: torch.Tensor | None = None,
    weight_decay: float = WEIGHT_DECAY,
    row_norm: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    r"""Head rows ``K .. num_classes - 1`` for a head ``weight [K, F]``, ``bias [K]``: the
    minimiser over the new rows ``(W', b')`` of

    .. math:: \mathrm{CE}\big([W h + b,\; W' h + b'] + a,\; y\big) + \tfrac{\lambda}{2}\lVert W'\rVert^2

    over the examples (``features [N, F]``, ``labels [N]``), with the old rows fixed,
    ``a = adjustment`` (``[num_classes]``, the site's logit adjustment; None: 0) and
    ``λ = weight_decay``. Convex in ``(W', b')``: L-BFGS from ``W' = 0``, ``b' = min b``,
    float64. Returns float32 ``W' [num_classes - K, F]``, ``b' [num_classes - K]``.

    ``row_norm``: every new row has this norm, ``W'_j = s\, v_j / \lVert v_j \rVert`` (the
    direction ``v_j`` and ``b'`` fitted by L-BFGS from the class's mean feature; no decay
    term; not convex any more, so the start matters). Unconstrained, a fit on one site's
    separable windows outgrows the trained rows (2-4x their norm, biases near +-50 in the
    plant runs) and the new logit flips with small feature shifts; at the old rows' scale it
    competes on their terms (weight aligning, Zhao et al. 2020; imprinting, Qi et al. 2018)."""
    old, dim = weight.shape
    if num_classes <= old or features.ndim != 2 or features.shape[1] != dim or labels.shape != features.shape[:1]:
        raise ValueError(
            f"Invalid row fit: head {tuple(weight.shape)}, {num_classes} classes, features "
            f"{tuple(features.shape)}, labels {tuple(labels.shape)}"
        )
    h = features.detach().double()
    y = labels.detach().long()
    fixed = h @ weight.detach().double().T + bias.detach().double()
    shift = torch.zeros(num_classes, dtype=torch.float64) if adjustment is None else adjustment.detach().double()
    offsets = torch.full((num_classes - old,), float(bias.min()), dtype=torch.float64, requires_grad=True)
    if row_norm is None:
        free = torch.zeros(num_classes - old, dim, dtype=torch.float64, requires_grad=True)
    else:
        if not (math.isfinite(row_norm) and row_norm > 0):
            raise ValueError(f"Invalid row_norm: {row_norm!r}")
        start = torch.stack([h[y == k].mean(dim=0) if bool((y == k).any()) else h.mean(dim=0)
                             for k in range(old, num_classes)])
        free = (start + 1e-6).clone().requires_grad_(True)  # + 1e-6: never the zero vector
    decay = weight_decay if row_norm is None else 0.0

    def rows() -> torch.Tensor:
        """The new rows: the free parameters, or their directions at ``row_norm``."""
        return free if row_norm is None else row_norm * free / free.norm(dim=1, keepdim=True).clamp_min(1e-12)

    optimizer = torch.optim.LBFGS([free, offsets], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        w = rows()
        logits = torch.cat([fixed, h @ w.T + offsets], dim=1) + shift
        loss = nn.functional.cross_entropy(logits, y) + 0.5 * decay * (w * w).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return rows().detach().float().numpy(), offsets.detach().float().numpy()


def propose_new_rows(
    model: nn.Module,
    data: SiteArrays,
    num_classes: int,
    tau: float,
    device: torch.device,
    *,
    first: int | None = None,
    replayed: SiteArrays | None = None,
    batch_size: int = 256,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A site's proposal for the head rows of classes ``first .. num_classes - 1``
    (``first`` defaults to the end of ``model``'s head; ``num_classes`` =
    :func:`classes_seen`): :func:`fit_new_rows` on ``model.features`` of every window in
    ``data``, rows before ``first`` held fixed, each new row at their mean norm, with the
    logit adjustment ``tau`` of the fit's label histogram. When ``data`` has no window of
    the classes before ``first``, the fit also takes the windows of ``replayed`` (the
    site's replay buffer) as counter-examples: without any the fit is ill-posed, and its
    optimum makes the new class win on every window (at phase 1 of a plant run, alpha 0.1
    seed 8, where two lines hold only the new class: 365 and, encrypted, 538 of 600 test
    windows called the new class after the growth). Lines with old classes of their own
    fit on them alone (the buffer there too cost recall). Returns ``(rows [m, F], biases
    [m], the windows of ``data`` of each class [m])``."""
    head = model.head.out_features
    first = head if first is None else first
    if not 1 <= first <= head:
        raise ValueError(f"Invalid first class {first!r} for a head of {head}")
    x, y = data.x, data.y
    if replayed is not None and replayed.num_examples and not np.any(data.y < first):
        x, y = np.concatenate([x, replayed.x]), np.concatenate([y, replayed.y])
    features = torch.from_numpy(window_features(model, x, device, batch_size)).float()
    fitted = np.bincount(y, minlength=num_classes)
    adjustment = prior_logit_adjustment(fitted, tau) if tau else None
    weight, bias = model.head.weight.detach().cpu()[:first], model.head.bias.detach().cpu()[:first]
    scale = float(weight.double().norm(dim=1).mean())  # the trained rows' scale; 0 for an untrained zero head
    rows, biases = fit_new_rows(features, torch.from_numpy(y), weight, bias, num_classes, adjustment,
                                row_norm=scale if scale > 0 else None)
    return rows, biases, np.bincount(data.y, minlength=num_classes)[first:]


def row_bounds(weight: np.ndarray, bias: np.ndarray, factor: float = ROW_SCALE) -> tuple[float, float, float]:
    r"""``(row_max, bias_low, bias_high)``: what a proposed new-class row ``W'`` and bias
    ``b'`` may reach next to the established head rows ``weight [K, F]``, ``bias [K]``:

    .. math:: \lVert W' \rVert \le c\, s, \qquad |b' - \bar b| \le c\, s, \qquad
              s = \max_k \lVert W_k \rVert, \quad c = \mathrm{factor}.

    Why: a logit is :math:`W_k h + b_k`, so the model's own rows give the scale of a sane
    row, and it follows the model as it trains (no constant tuned to one stage). The
    softmax ignores a shift of every bias, so a bias is measured from their mean
    :math:`\bar b`, in the rows' unit (the biases barely spread). Honest fits outgrow the
    rows of a young model (weak weight decay on separable features), hence a wide ``c``:
    it bounds a row blown up by orders of magnitude, not one a few times too large."""
    weight, bias = np.asarray(weight, np.float64), np.asarray(bias, np.float64)
    if weight.ndim != 2 or bias.shape != weight.shape[:1] or not weight.shape[0] or not factor > 0:
        raise ValueError(f"Invalid row bounds: head {weight.shape}, biases {bias.shape}, factor {factor!r}")
    reach = factor * float(np.linalg.norm(weight, axis=1).max())
    centre = float(bias.mean())
    return reach, centre - reach, centre + reach


def check_row_proposal(
    proposal: tuple[np.ndarray, np.ndarray, np.ndarray], old: int, new: int, dim: int,
    head: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """ValueError unless ``proposal = (rows [m, dim], biases [m], counts [m])`` fits classes
    ``old .. old + m - 1`` of a head growing to ``new``, with finite values and counts >= 0,
    and, given ``head = (weight, bias)`` (the established rows it joins), within
    :func:`row_bounds` of them."""
    rows, biases, counts = proposal
    m = len(counts)
    if rows.shape != (m, dim) or biases.shape != (m,) or old + m > new:
        raise ValueError(f"Invalid row proposal: rows {rows.shape}, biases {biases.shape}, {m} counts")
    if not (np.all(np.isfinite(rows)) and np.all(np.isfinite(biases)) and np.all(counts >= 0)):
        raise ValueError("Invalid row proposal: non-finite values or negative counts")
    if head is None:
        return
    reach, low, high = row_bounds(*head)
    norms = np.linalg.norm(np.asarray(rows, np.float64), axis=1)
    for j in range(m):
        if norms[j] > reach or not low <= biases[j] <= high:
            raise ValueError(
                f"Invalid row proposal: class {old + j} has a row of norm {norms[j]:.4g} and bias {biases[j]:.4g}, "
                f"beyond {ROW_SCALE:g}x the model's largest row norm (norm <= {reach:.4g}, bias in "
                f"[{low:.4g}, {high:.4g}])"
            )


def merge_row_proposals(
    proposals: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], old: int, new: int, dim: int
) -> dict[int, tuple[np.ndarray, float]]:
    """Per new class ``k`` in ``old .. new - 1``, the mean of the proposed rows (and biases)
    weighted by the proposers' windows of ``k``: ``{k: (row [dim] float32, bias)}``; a class
    nobody proposed with windows is absent. Each proposal is ``(rows [m, dim], biases [m],
    counts [m])`` for classes ``old .. old + m - 1`` (checked: finite, counts >= 0)."""
    total: dict[int, list] = {}
    for rows, biases, counts in proposals:
        check_row_proposal((rows, biases, counts), old, new, dim)
        for j in range(len(counts)):
            if counts[j] > 0:
                entry = total.setdefault(old + j, [np.zeros(dim), 0.0, 0.0])
                entry[0] += counts[j] * rows[j].astype(np.float64)
                entry[1] += counts[j] * float(biases[j])
                entry[2] += float(counts[j])
    return {k: ((w / n).astype(np.float32), b / n) for k, (w, b, n) in sorted(total.items())}


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
    the per-class counters take (see :class:`~fedind.continual.replay.ReplayBuffer`)."""
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
