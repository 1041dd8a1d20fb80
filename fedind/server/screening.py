r"""Screening of site updates before any strategy sees them: bad input never reaches the model.

Every train reply of a round passes three checks (and, when configured, a norm clip) on the
server (:class:`UpdateScreen`, run by :class:`~fedind.server.metering.MeteredGrid` after decoding,
for every strategy — Flower's or fedind's):

1. **Structure** (:func:`fedind.server.pipeline.decode_reply`, per reply): exactly one ArrayRecord with the names,
   shapes and dtypes of the global arrays sent to that site, only finite values; one
   MetricRecord whose ``num-examples`` is a positive finite whole number; a
   ``label-histogram``, when present, of one non-negative int per class summing to
   ``num-examples`` (a histogram that disagrees with the claimed example count is a lie
   about the site's data).
2. **Update norm** (:func:`outlier_bounds`, per round): with ``d_i`` the site's delta
   (reply minus the global arrays it was sent) and ``m`` the median of
   :math:`\log \lVert d_i \rVert` over the round's structurally valid replies that moved,
   :math:`s = 1.4826\,\mathrm{MAD}(\log\lVert d\rVert)` (a robust standard deviation), a
   reply is an outlier when

   .. math::  \log \lVert d_i \rVert - m > \min\big(\log r_{\max},\;
              \max(\log r_{\min},\; z\, s)\big)

   i.e. its norm is more than ``z`` robust deviations above the median on a log scale, and
   in any case more than ``r_min`` times the median (default ``r_min = 10``, ``z = 3.5``,
   Iglewicz and Hoaglin's cut-off); more than ``r_max`` times the median (default 50) is
   an outlier whatever the spread. An outlier **beyond** ``r_max`` times the median is
   rejected; one short of it is **scaled down** to the bound (the right-hand side), keeping
   its direction and metrics.

   - The floor keeps a round whose benign norms happen to be nearly equal (tiny MAD) from
     flagging an honest site that trained a little further: an honest top-k update (error
     feedback releasing a residual) was measured at 5.8x its round's median, which a
     floor of 4 rejected.
   - The ceiling closes the other side: when honest norms spread widely (``s`` = 1.76,
     ratios 0.23x to 4x) the deviation rule alone passed an update 321x the median, which
     threw the model from 0.76 to 0.21 accuracy (poisoning benchmark, a site sending 100x
     its update, seed 0, round 30). The largest honest ratio in that benchmark's 13,520
     logged honest replies was 27.5x.
   - Scaling, not rejecting, below the ceiling: late in a run most sites have converged
     and the median update is small, while a line with harder data learns on; with
     rejection one honest line was thrown out 9 times in rounds 64-80 at 10-12x the median.

   Only the upper side is flagged: a small update cannot drag the average far. Rounds
   with fewer than 3 replies that moved skip this rule (no robust median of two).
3. **Example count** (per round, the same rule on ``num-examples``): a site whose claimed
   count is an outlier above the round's median — more than ``z`` robust deviations of the
   log counts and more than ``r_min`` times the median, or more than ``r_max`` times — is
   rejected (a count cannot be scaled down to a truth the server does not know). The
   server cannot check a count, and the strategies weight each update by it: before this
   rule a site
   that claimed 1000x its windows, with a histogram to match, passed the structural
   checks, took over 99 % of the average and kept a 4-site simulation at chance (0.10 vs
   0.23 in 10 rounds). Honest Dirichlet sites of the synthetic scenarios lie within 3.5x
   of their round's median; a plant whose lines differ more in size needs a larger
   ``min_ratio`` or ``count_rule=False``.

4. **Norm clip** (:func:`clip_factors`, per round, after the rules above; ``clip_ratio``
   :math:`c`, the run config's ``norm-clip``, off when None): every accepted update longer
   than :math:`c` times the round's median norm :math:`M` (the median of rule 2, over the
   structurally valid replies) is scaled down to that length, the site's reply becoming
   :math:`g + d_i \min(1,\, c M / \lVert d_i \rVert)`. Rule 2 only bounds updates far
   out (10x and more); the clip bounds what any accepted site can move the model by to
   :math:`c` honest-sized steps (norm bounding, as in Sun et al. 2019, "Can you really
   backdoor federated learning?"). It keeps the direction, so it only limits, never
   removes, an update pointing the wrong way. Off by default: honest updates of the
   recipe pass 1.5x their round's median in 5 % of replies, and the long ones carry
   information, so at c = 1.5 it cost clean runs 0.6 to 2.1 points (poisoning benchmark,
   selection seeds 1-3; docs/benchmarks/poisoning.md).

5. **Label alignment** (:func:`label_alignment`, per site across rounds; ``alignment_threshold``,
   the run config's ``alignment-threshold``, default -0.4 in the server): the correlation
   of a site's classifier-bias update with its own log label shares. An honest site
   trained with the logit-adjusted loss moves the bias towards its own label prior; a
   sign-flipped update moves it away, every round. A site whose decayed mean (β = 0.9)
   falls below the threshold, from its third round on, **while its whole update also runs
   against the rounds' median updates** (rule 6's decayed mean below 0; the evidence of
   two statistics, which no honest line gave together in the recorded runs, while a
   well-fitted honest line on the gearbox family gave the first alone and was banned
   for it), is rejected for the rest of the run (logged with its site; the verdict is in
   the server checkpoint). Not re-admitted when
   its record recovers: once the model fits a dropped attacker's data well, its reversed
   update no longer reads as reversed (an honest update of a well-fitted site pushes the
   bias slightly against its prior, through the logit adjustment), and let back in it
   costs the points again (seed 2: re-admitted at a mean of 0 after round 57, it took the
   model from 0.887 to 0.812 in five rounds). Measured on
   the poisoning benchmark (default scenario, seeds 0 and 2, 80 rounds): a site sending
   its reversed update averaged -0.58 and -0.59 per round, honest lines -0.22 to +0.66
   (single rounds down to about -0.6: hence the decayed mean and the warm-up). It needs the
   label histogram the sites send; it does not see an attacker that keeps the classifier
   bias honest and flips the rest.

6. **Consensus** (:func:`consensus_cosines`, per site across rounds; ``consensus_threshold``,
   the run config's ``consensus-threshold``, default -0.25 in the server): the cosine of a
   site's update to the round's coordinate-wise median update, decayed as rule 5 (β = 0.9,
   from the site's third round). A site whose mean is below the threshold is rejected for
   that round and judged again the next: no ban. A site whose mean is between the
   threshold and 0 is accepted weighed down: its update scaled by ``1 - mean / threshold``
   and to no longer than the round's median update (1.5 % of honest site-rounds in the
   recorded runs, 88 % of a body-flipper's, whose update grows to 2-6 times the median
   once it has done damage). Non-IID lines pull apart for stretches
   (single rounds down to -0.44), but no honest line's decayed mean went below -0.19 in the
   poisoning benchmark's recorded runs, while an inner-product-manipulation attacker (which
   sends the reverse of the honest mean) sits at -0.5 to -0.66, and a reversed body at
   about -0.1 to -0.3 (weighed down, not rejected). It does not see attacks built to stay
   inside the honest spread (min-max, ALIE: positive); docs/benchmarks/poisoning.md.

A rejected reply becomes an error reply (code :data:`REJECTED_UPDATE`) whose reason names
the fault and the site; strategies drop error replies and the server logs and counts them as failures,
so the round goes on with the rest. What this does not catch: an update of ordinary norm
pointing the wrong way in a way rule 5 cannot read (the bias kept honest, or a site
without a histogram); ``simulations/poisoning.py`` measures what each attack costs each
strategy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from logging import INFO, WARNING
from numbers import Real
from typing import NamedTuple

import numpy as np
from flwr.app import Array, Message, MetricRecord
from flwr.common.logger import log

from .. import wire

__all__ = [
    "REJECTED_UPDATE", "AlignmentRecord", "Consensus", "InvalidUpdate", "UpdateScreen", "check_histogram", "is_real",
    "clip_factors", "consensus_cosines", "consensus_weight", "label_alignment", "norm_outliers", "outlier_bounds", "read_metrics", "read_reply",
]

REJECTED_UPDATE = wire.REJECTED_UPDATE  # the code's table: fedind.wire
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution x 1.4826 = its standard deviation
ALIGNMENT_FLOOR = 0.01  # label shares below this count as this in the log (absent classes)


class InvalidUpdate(ValueError):
    """A site's train reply that must not be aggregated; the message says why."""


# --------------------------------------------------------------------------- maths


def outlier_bounds(
    norms: Sequence[float], z: float = 3.5, min_ratio: float = 10.0, max_ratio: float = 50.0
) -> tuple[float, float]:
    """``(bound, ceiling)`` of the module's robust rule for the round's ``norms``: a norm
    above ``bound`` is an outlier, one above ``ceiling`` (``max_ratio`` times the median)
    is beyond repair. Both ``inf`` when fewer than 3 norms are positive.

    ``norms``: the L2 norms of the round's updates (finite, >= 0). The median and spread
    are taken over the positive norms only: a site that did not move (norm 0) says nothing
    about the size of a training step, and would otherwise drag the median towards zero
    and make the ceiling reject every real update.
    """
    if not (math.isfinite(z) and z > 0):
        raise ValueError(f"Invalid z value: {z!r}")
    if not (math.isfinite(min_ratio) and min_ratio > 1):
        raise ValueError(f"Invalid min_ratio value: {min_ratio!r}")
    if not (math.isfinite(max_ratio) and max_ratio >= min_ratio):
        raise ValueError(f"Invalid max_ratio value: {max_ratio!r} (finite, at least min_ratio {min_ratio!r})")
    values = np.asarray(norms, dtype=np.float64)
    if values.ndim != 1 or np.any(~np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"Invalid norms: {norms!r} (finite, non-negative)")
    moved = values[values > 0]
    if moved.size < 3:
        return math.inf, math.inf
    logs = np.log(moved)
    median = float(np.median(logs))
    spread = MAD_TO_SIGMA * float(np.median(np.abs(logs - median)))
    allowed = min(math.log(max_ratio), max(math.log(min_ratio), z * spread))
    return math.exp(median + allowed), math.exp(median + math.log(max_ratio))


def norm_outliers(
    norms: Sequence[float], z: float = 3.5, min_ratio: float = 10.0, max_ratio: float = 50.0
) -> np.ndarray:
    """Boolean mask of the norms above :func:`outlier_bounds`' bound (upper side only;
    zero norms and rounds of fewer than 3 positive norms are never flagged)."""
    bound, _ = outlier_bounds(norms, z, min_ratio, max_ratio)
    return np.asarray(norms, dtype=np.float64) > bound


def consensus_cosines(deltas: Sequence[np.ndarray]) -> np.ndarray:
    """Per flat update, its cosine to the round's coordinate-wise median update (0 for an
    all-zero update or median). The median is moved by at most the few attackers among
    the round's sites, so it points where most of them agree."""
    stacked = np.stack([np.asarray(d, dtype=np.float64).ravel() for d in deltas])
    middle = np.median(stacked, axis=0)
    norms = np.linalg.norm(stacked, axis=1) * float(np.linalg.norm(middle))
    return np.divide(stacked @ middle, norms, out=np.zeros(len(deltas)), where=norms > 0)


def consensus_weight(mean: float, threshold: float) -> float:
    """The weight of a site whose decayed mean cosine to the median update is ``mean``: 1 at
    or above 0, falling linearly to 0 at ``threshold`` (< 0) and 0 below it (rejected). The
    band below 0 holds a reversed body's record most rounds and an honest line's rarely
    (docs/benchmarks/poisoning.md), so it is weighed down, not cut."""
    if not threshold < 0:
        raise ValueError(f"Invalid consensus threshold: {threshold!r} (below 0)")
    return 1.0 if mean >= 0 else max(0.0, 1.0 - mean / threshold)


def clip_factors(norms: Sequence[float], ratio: float) -> np.ndarray:
    """Per norm, the factor ``min(1, ratio * median(norms) / norm)`` that scales an update
    down to ``ratio`` times the round's median norm (1 where it is already shorter, and
    for a zero norm). Empty ``norms``: an empty array."""
    if not (math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"Invalid clip ratio value: {ratio!r}")
    values = np.asarray(norms, dtype=np.float64)
    if values.ndim != 1 or np.any(~np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"Invalid norms: {norms!r} (finite, non-negative)")
    if values.size == 0:
        return np.ones(0)
    bound = ratio * float(np.median(values))
    return np.minimum(1.0, bound / np.maximum(values, np.finfo(np.float64).tiny))


def label_alignment(bias_delta: np.ndarray, histogram: Sequence[float], floor: float = ALIGNMENT_FLOOR) -> float:
    r"""Pearson correlation of a site's classifier-bias update with its log label shares.

    .. math::  a = \mathrm{corr}\big(\Delta b,\; \log \max(n_c / n,\, f)\big)

    over the classes ``c`` (``f`` = ``floor``). Why it is positive for an honest site: with
    the logit-adjusted loss of fedind's sites (``logit-adjustment`` :math:`\tau < 1`) a
    site's optimum carries :math:`(1 - \tau) \log \pi_{site}` in its raw bias, so
    training moves the bias towards its own log prior and away from the global model's.
    A sign-flipped update moves it the other way. NaN when undefined (the shares or the
    update are constant, or the lengths differ): no evidence either way.
    """
    b = np.asarray(bias_delta, dtype=np.float64).ravel()
    counts = np.asarray(histogram, dtype=np.float64).ravel()
    if b.size != counts.size or b.size < 2 or not counts.sum() > 0:
        return float("nan")
    shares = np.log(np.maximum(counts / counts.sum(), floor))
    b, shares = _centred(b), _centred(shares)
    if b is None or shares is None:
        return float("nan")
    return float(b @ shares / (np.linalg.norm(b) * np.linalg.norm(shares)))


def _centred(x: np.ndarray) -> np.ndarray | None:
    """``x - mean(x)``; None when that is zero up to rounding (x constant)."""
    centred = x - x.mean()
    return centred if np.linalg.norm(centred) > 1e-9 * np.abs(x).max(initial=0.0) else None


class Consensus(NamedTuple):
    """One site's agreement with the round's median update: this round's cosine, and its
    record (decayed mean over the rounds it sent an update, and how many)."""

    cosine: float
    mean: float
    rounds: int


class AlignmentRecord:
    r"""Per site, the decayed mean of a per-round statistic (its :func:`label_alignment`, or
    its update's cosine to the round's median update) over the rounds it had one:
    :math:`A = \sum_t \beta^{T-t} a_t / \sum_t \beta^{T-t}` (``decay`` β), with the number of
    rounds seen. JSON-able state for the server checkpoint."""

    def __init__(self, decay: float = 0.9) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"Invalid decay value: {decay!r} (expected 0 <= decay < 1)")
        self.decay = float(decay)
        self._sums: dict[str, list[float]] = {}  # site -> [weighted sum, weight, rounds]

    def current(self, site: str) -> tuple[float, int]:
        """``site``'s ``(mean, rounds)`` as it stands (NaN and 0 before its first round)."""
        total, weight, rounds = self._sums.get(site, [0.0, 0.0, 0])
        return (total / weight if weight > 0 else math.nan), rounds

    def add(self, site: str, alignment: float) -> tuple[float, int]:
        """Fold one round's alignment into ``site``'s record; return ``(mean, rounds)``."""
        total, weight, rounds = self._sums.get(site, [0.0, 0.0, 0])
        total, weight = self.decay * total + alignment, self.decay * weight + 1.0
        self._sums[site] = [total, weight, rounds + 1]
        return total / weight, rounds + 1

    def state_dict(self) -> dict:
        return {site: list(values) for site, values in self._sums.items()}

    def load_state_dict(self, state: Mapping) -> None:
        loaded = {}
        for site, values in state.items():
            if not (isinstance(site, str) and len(values) == 3 and all(_is_real(v) for v in values)):
                raise ValueError(f"Invalid alignment record for site {site!r}: {values!r}")
            loaded[site] = [float(values[0]), float(values[1]), int(values[2])]
        self._sums = loaded


# --------------------------------------------------------------------------- checks


def is_real(x) -> bool:
    """A finite real number (bool is not a number here)."""
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


_is_real = is_real


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_array(name: str, array: Array, expected_shape: tuple[int, ...], expected_dtype: np.dtype) -> np.ndarray:
    """``array`` as numpy, checked against the global array of the same name."""
    if array.dtype != str(expected_dtype):
        raise InvalidUpdate(f"array {name!r}: dtype {array.dtype} != global {expected_dtype}")
    if tuple(array.shape) != tuple(expected_shape):
        raise InvalidUpdate(f"array {name!r}: shape {tuple(array.shape)} != global {tuple(expected_shape)}")
    try:
        value = array.numpy()
    except (TypeError, ValueError, OSError, EOFError) as err:
        raise InvalidUpdate(f"array {name!r}: cannot decode ({err})") from None
    if value.dtype != expected_dtype or value.shape != tuple(expected_shape):
        raise InvalidUpdate(
            f"array {name!r}: data is {value.dtype}{list(value.shape)}, declared "
            f"{array.dtype}{list(array.shape)}"
        )
    if np.issubdtype(value.dtype, np.inexact) and not np.all(np.isfinite(value)):
        raise InvalidUpdate(f"array {name!r}: {int(np.size(value) - np.isfinite(value).sum())} NaN/Inf values")
    return value


def check_histogram(histogram, num_classes: int | None, num_examples: float) -> list[int]:
    """The ``label-histogram`` metric as a list of ints, or :class:`InvalidUpdate`."""
    name = wire.LABEL_HISTOGRAM
    if not isinstance(histogram, list):
        raise InvalidUpdate(f"{name} is a {type(histogram).__name__}, expected a list of ints")
    if num_classes is not None and len(histogram) != num_classes:
        raise InvalidUpdate(f"{name} has {len(histogram)} classes, the global model {num_classes}")
    if not all(_is_int(c) for c in histogram):
        raise InvalidUpdate(f"{name} {histogram}: counts must be ints")
    if any(c < 0 for c in histogram):
        raise InvalidUpdate(f"{name} {histogram}: counts must be non-negative")
    if sum(histogram) != num_examples:
        raise InvalidUpdate(f"{name} sums to {sum(histogram)}, but {wire.NUM_EXAMPLES} = {num_examples}")
    return [int(c) for c in histogram]


def read_metrics(reply: Message) -> MetricRecord:
    """The one MetricRecord of a train reply, or :class:`InvalidUpdate`."""
    if len(reply.content.metric_records) != 1:
        raise InvalidUpdate(f"expected exactly one MetricRecord, got {len(reply.content.metric_records)}")
    return next(iter(reply.content.metric_records.values()))


def read_reply(reply: Message, expected: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], MetricRecord]:
    """``(arrays, metrics)`` of a train reply with exactly one ArrayRecord holding the
    names, shapes and dtypes of ``expected`` (finite values only) and exactly one
    MetricRecord; :class:`InvalidUpdate` naming the fault otherwise. The metrics are not
    checked here: :func:`fedind.server.pipeline.decode_reply` does."""
    content = reply.content
    if len(content.array_records) != 1:
        raise InvalidUpdate(f"expected exactly one ArrayRecord, got {len(content.array_records)}")
    metrics = read_metrics(reply)
    record = next(iter(content.array_records.values()))
    missing, extra = sorted(set(expected) - set(record)), sorted(set(record) - set(expected))
    if missing or extra:
        raise InvalidUpdate(f"arrays differ from the global model: missing {missing}, unexpected {extra}")
    arrays = {name: check_array(name, record[name], base.shape, base.dtype) for name, base in expected.items()}
    return arrays, metrics


def _norm(delta: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.dot(d.ravel(), d.ravel())) for d in delta.values()))


# --------------------------------------------------------------------------- the screen


class UpdateScreen:
    """Round-level screen of train replies (structure, then the norm rule); see the module
    docstring. Called by :class:`~fedind.server.metering.MeteredGrid` with the round's
    instructions (by destination node) and replies; returns the replies with every rejected
    one replaced by an error reply.

    ``num_classes``: length of a valid label histogram (None: not checked). ``z``,
    ``min_ratio`` and ``max_ratio``: the parameters of the norm and count rules;
    ``norm_rule=False`` / ``count_rule=False`` turn one of them off (both off: only the
    structural checks). An update scaled down by the norm rule is logged with its site.
    ``clip_ratio``: the norm clip's :math:`c` (None: no clip); a clipped reply keeps its
    metrics and carries the scaled-down weights.

    ``alignment_threshold``: the label-alignment rule (None: off): a site whose decayed mean
    :func:`label_alignment` (``alignment_decay``, over the rounds it sent a histogram and
    ``bias_name``) is below this, from its ``alignment_warmup``-th such round on, is
    rejected, and stays rejected for the rest of the run (``alignment_release`` None) or
    until its mean is back at ``alignment_release`` or above. ``consensus_threshold``: the
    consensus rule (None: off): a site whose decayed mean cosine to the round's median update
    is below 0 is weighed down (:func:`consensus_weight`) and clipped to the median norm, and
    below this threshold rejected for the round. Both records use ``alignment_decay`` and
    ``alignment_warmup``, so both judge a site over the same recent rounds. The records
    survive a resume through :meth:`state_dict`.
    """

    def __init__(self, num_classes: int | None = None, *, z: float = 3.5, min_ratio: float = 10.0,
                 max_ratio: float = 50.0, norm_rule: bool = True, count_rule: bool = True,
                 clip_ratio: float | None = None, alignment_threshold: float | None = None,
                 alignment_release: float | None = None, alignment_decay: float = 0.9, alignment_warmup: int = 3,
                 bias_name: str = "head.bias", consensus_threshold: float | None = None) -> None:
        outlier_bounds([1.0, 1.0, 1.0], z, min_ratio, max_ratio)  # validates z and the ratios
        if clip_ratio is not None:
            clip_factors([1.0], clip_ratio)  # validates clip_ratio
        self.clip_ratio = None if clip_ratio is None else float(clip_ratio)
        self.num_classes = num_classes
        self.z = float(z)
        self.min_ratio = float(min_ratio)
        self.max_ratio = float(max_ratio)
        self.norm_rule = norm_rule
        self.count_rule = count_rule
        release = 1.0 if alignment_release is None else alignment_release
        if alignment_threshold is not None and not -1 <= alignment_threshold <= release <= 1:
            raise ValueError(
                f"Invalid alignment_threshold / alignment_release: {alignment_threshold!r} / {alignment_release!r} "
                "(expected -1 <= threshold <= release <= 1)"
            )
        self.alignment_threshold = alignment_threshold
        self.alignment_release = None if alignment_release is None else float(alignment_release)
        self.flagged: set[str] = set()  # sites the alignment rule rejects (until they reach the release level)
        self.alignment_warmup = int(alignment_warmup)
        self.bias_name = bias_name
        self.alignment = AlignmentRecord(alignment_decay)
        if consensus_threshold is not None and not -1 <= consensus_threshold < 0:
            raise ValueError(f"Invalid consensus_threshold: {consensus_threshold!r} (expected -1 <= threshold < 0)")
        self.consensus_threshold = consensus_threshold
        self.consensus = AlignmentRecord(alignment_decay)  # per site: decayed cosine to the round's median update

    def state_dict(self) -> dict:
        """What the screen learnt across rounds (the sites' label-alignment and consensus
        records, and the banned sites)."""
        return {"alignment": self.alignment.state_dict(), "flagged": sorted(self.flagged),
                "consensus": self.consensus.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        self.alignment.load_state_dict(state["alignment"])
        self.flagged = {str(site) for site in state["flagged"]}
        self.consensus.load_state_dict(state.get("consensus", {}))  # absent in checkpoints before the rule

    def grow_classes(self, num_classes: int) -> None:
        """The head grew: a valid label histogram has ``num_classes`` counts."""
        self.num_classes = int(num_classes)

    def __call__(self, instructions: Mapping[int, Message], replies: list[Message]) -> list[Message]:
        """The round's replies, each decoded once and screened (:class:`fedind.server.pipeline.ReplyPipeline`
        with this screen and no top-k decoder)."""
        from .pipeline import ReplyPipeline  # the pipeline composes the screen

        return ReplyPipeline(screen=self)(instructions, replies)

    def rules(self, updates: Sequence) -> dict[int, str | float]:
        """The round rules over the round's decoded updates
        (:class:`fedind.server.pipeline.SiteUpdate`): position -> the reason it is rejected,
        or the factor (< 1) its update is scaled down by. Updates without one are accepted as
        they are; so are those with no update (nothing to weigh or scale)."""
        valid: list[tuple[int, float, float]] = []  # (position, update norm, num-examples)
        for i, update in enumerate(updates):
            if update.has_update:
                valid.append((i, _norm(update.delta), update.num_examples))
        rules = [("update norm", 1, self.norm_rule), (wire.NUM_EXAMPLES, 2, self.count_rule)]
        reasons: dict[int, str] = {}  # position -> the first rule that rejects it
        factors: dict[int, float] = {}  # position -> the factor its update is scaled by
        for label, column, active in rules:
            if not (active and valid):
                continue
            bound, ceiling = outlier_bounds([entry[column] for entry in valid], self.z, self.min_ratio, self.max_ratio)
            median = ceiling / self.max_ratio  # the median the rule used (of the values above 0)
            for entry in valid:
                i, value = entry[0], entry[column]
                if value <= bound or i in reasons:
                    continue
                if column == 1 and value <= ceiling:  # an outlying norm short of the ceiling: scaled down
                    factors[i] = bound / value
                    log(WARNING, "update of site %s scaled down to the norm rule's bound: norm %.4g is %.3gx the "
                        "round's median %.4g (bound %.3gx)", updates[i].site_id, value, value / median, median,
                        bound / median)
                    continue
                reasons[i] = (
                    f"{label} {value:.4g} is an outlier ({value / median:.3g}x the round's median {median:.4g}; "
                    f"robust rule z={self.z:g}, ratios {self.min_ratio:g} to {self.max_ratio:g})"
                )
        consensus: dict[int, Consensus] = {}  # position -> the site's consensus record
        if (self.consensus_threshold is not None or self.alignment_threshold is not None) and len(valid) >= 3:
            flats = [np.concatenate([np.ravel(updates[i].delta[k]) for k in sorted(updates[i].delta)]) for i, _, _ in valid]
            for (i, _, _), cosine in zip(valid, consensus_cosines(flats)):
                consensus[i] = Consensus(float(cosine), *self.consensus.add(updates[i].site_id, float(cosine)))
        if self.alignment_threshold is not None:
            for i, _, _ in valid:
                reason = self._misaligned(updates[i], consensus.get(i))
                if reason and i not in reasons:
                    reasons[i] = reason
        if self.consensus_threshold is not None:
            to_median = dict(zip((i for i, _, _ in valid), clip_factors([entry[1] for entry in valid], 1.0)))
            for i, record in consensus.items():
                if record.mean >= 0 or record.rounds < self.alignment_warmup or i in reasons:
                    continue
                if record.mean < self.consensus_threshold:
                    reasons[i] = (f"update runs against the round's median update: decayed mean cosine {record.mean:.2f} "
                                  f"< {self.consensus_threshold:g} over {record.rounds} rounds (this round "
                                  f"{record.cosine:.2f}); judged again every round")
                else:  # weighed down linearly to the threshold, and no longer than the median update
                    factor = consensus_weight(record.mean, self.consensus_threshold) * float(to_median[i])
                    factors[i] = min(factor, factors.get(i, 1.0))
                    log(INFO, "update of site %s weighed down to %.3g: it runs against the round's median update "
                        "(decayed mean cosine %.2f over %d rounds, this round %.2f; dropped below %g)",
                        updates[i].site_id, factor, record.mean, record.rounds, record.cosine, self.consensus_threshold)
        if self.clip_ratio is not None and valid:
            for (i, _, _), factor in zip(valid, clip_factors([entry[1] for entry in valid], self.clip_ratio)):
                factors[i] = min(factor, factors.get(i, 1.0))
        verdicts: dict[int, str | float] = {i: f for i, f in factors.items() if f < 1.0}
        verdicts.update(reasons)
        return verdicts

    def _misaligned(self, update, consensus: Consensus | None = None) -> str | None:
        """Fold this update's label alignment into its site's record; the rejection reason
        when the record is below the threshold (None otherwise). An update without evidence
        (no histogram, no ``bias_name`` in the model, or a bias it did not change: a top-k
        update that left it out) does not move the record, and does not let a rejected
        site back in: before this, a banned attacker was accepted in every round whose
        sparse update left the bias out (13 of 40 rounds on seed 5).

        ``consensus``: the site's :class:`Consensus` record against the rounds' median
        updates. A record below the threshold bans the site only when this mean is below 0
        too (its update also runs against the rest): a well-fitted honest line can push its
        bias against its prior (the logit adjustment does), but in the recorded runs no
        honest line did both, and every reversed attacker did when it was first caught.
        Without a consensus record (fewer than three updates in the round) the label
        alignment decides alone."""
        histogram, delta = update.histogram, update.delta
        site = update.site_id
        alignment = math.nan
        if histogram is not None and self.bias_name in delta:
            alignment = label_alignment(delta[self.bias_name], histogram)
        if math.isfinite(alignment):
            mean, rounds = self.alignment.add(site, alignment)
        else:
            mean, rounds = self.alignment.current(site)
        this_round = f"this round {alignment:.2f}" if math.isfinite(alignment) else "no bias change this round"
        if site in self.flagged and self.alignment_release is None:
            return (
                f"label alignment: rejected for the rest of the run since its record fell below "
                f"{self.alignment_threshold:g} (decayed mean now {mean:.2f} over {rounds} rounds, {this_round})"
            )
        if not math.isfinite(alignment) and site not in self.flagged:
            return None
        bar = self.alignment_release if site in self.flagged else self.alignment_threshold
        if rounds < self.alignment_warmup or mean >= bar:
            self.flagged.discard(site)
            return None
        if site not in self.flagged and consensus is not None and consensus.mean >= 0:
            return None  # uncorroborated: its update goes with the round's median
        self.flagged.add(site)
        return (
            f"label alignment {mean:.2f} < {bar:g}: its {self.bias_name} update runs against its own label "
            f"shares (decayed mean over {rounds} rounds, {this_round})"
        )
