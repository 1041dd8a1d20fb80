"""What the operator is told when sites, replies or a run fall short of what fedind expects.

A newcomer's first run often uses a plain Flower ClientApp (the quickstart's shape), a data
folder without every optional file, or a mistyped key. These helpers turn what arrives into
one clear line (the server, :mod:`fedind.server.app`, logs them):

- :func:`reported_accuracy`: a site's accuracy under the names Flower apps use for it;
- :func:`short_reason` / :func:`common_cause`: one line out of Flower's error reasons (a
  Ray traceback, ``<class 'KeyError'>:<''lr''>``), and the most frequent one of a round;
- :class:`FeatureLog`: once per run, which fedind features are off because the sites'
  replies lack what they need (label histogram, site id, CPU time);
- :func:`site_score` / :func:`failure_line`: a site's entry in the summary; the one line a
  failed run ends with;
- :func:`inferred_classes_warning`: a class count taken from a stray label.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from logging import WARNING
from numbers import Real

from flwr.common.logger import log

from .. import wire
from ..config import DWA_STRATEGIES

# Where Flower apps put a site's accuracy: fedind's and Flower's templates' names first.
ACCURACY_KEYS = ("accuracy", "eval_acc", "eval_accuracy", "test_accuracy", "test_acc", "val_accuracy", "val_acc", "acc")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FLOWER_REASON = re.compile(r"<class '([^']*)'>:<'(.*)'>", re.S)  # Flower's "<class 'E'>:<'message'>"
_NODE_PREFIX = re.compile(r"^node \d+: ")


def _number(value) -> float | None:
    if isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def reported_accuracy(metrics: Mapping) -> tuple[str, float] | None:
    """``(key, value)`` of the accuracy a site reported, or None when it reported none.

    Tries :data:`ACCURACY_KEYS` in order, then a single numeric key containing ``acc``
    (any case): a quickstart-style app reports ``eval_acc``, fedind's agent ``accuracy``."""
    for key in ACCURACY_KEYS:
        if (value := _number(metrics.get(key))) is not None:
            return key, value
    found = [(k, v) for k, v in metrics.items() if "acc" in k.lower() and _number(v) is not None]
    return (found[0][0], float(found[0][1])) if len(found) == 1 else None


def short_reason(reason: str, limit: int = 200) -> str:
    """One line out of a Flower error reason: ``"KeyError: 'lr'"`` from a SuperNode's
    ``<class 'KeyError'>:<''lr''>`` or from the last line of a Ray worker's traceback."""
    text = _ANSI.sub("", reason).strip()
    match = _FLOWER_REASON.fullmatch(text)
    if match:
        kind = match.group(1).rsplit(".", 1)[-1]
        lines = [line.strip() for line in match.group(2).splitlines() if line.strip()]
        if len(lines) > 1:  # a Ray traceback: its last line is the site's own exception
            text = lines[-1]
        else:
            text = f"{kind}: {lines[0]}" if lines else kind
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        text = lines[-1] if lines else "unknown error"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def common_cause(failures: Sequence[str]) -> str | None:
    """The most frequent cause among a round's failures (``"node <id>: <reason>"``, as
    :class:`fedind.server.metering.Traffic` records them), with how many share it; None for none."""
    if not failures:
        return None
    causes = Counter(short_reason(_NODE_PREFIX.sub("", failure)) for failure in failures)
    cause, count = causes.most_common(1)[0]
    return f"{cause} ({count} of {len(failures)} failed replies)"


def failure_line(err: BaseException) -> str:
    """``"<ExceptionType>: <first line of its message>"``: the cause a failed run ends with."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def site_score(metrics: Mapping) -> dict:
    """A site's entry in summary.json's ``per_site``, from its final-evaluation metrics:
    ``accuracy`` (None when it scored nothing or reported no accuracy; ``note`` says which),
    ``num_examples`` (None when not reported), and ``reported_as`` when the accuracy came
    under another name than ``accuracy``. A site without a test split replies
    ``num-examples = 0``: it is not scored on its training data."""
    count = _number(metrics.get(wire.NUM_EXAMPLES))
    entry: dict = {"accuracy": None, "num_examples": None if count is None else int(count)}
    found = reported_accuracy(metrics)
    if count == 0:
        entry["note"] = "no test split at the site: not scored"
    elif found is None:
        entry["note"] = f"reported no accuracy metric (got {', '.join(sorted(metrics)) or 'none'})"
    else:
        entry["accuracy"] = found[1]
        if found[0] != "accuracy":
            entry["reported_as"] = found[0]
    return entry


def label_ranges(labels: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    runs: list[list[int]] = []
    for label in sorted(labels):
        if runs and label == runs[-1][1] + 1:
            runs[-1][1] = label
        else:
            runs.append([label, label])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def inferred_classes_warning(info: Mapping) -> str | None:
    """The warning for a data-root whose class count comes from its labels (no meta.json
    count) while labels below it occur nowhere: one stray label (42) made a 43-class head.
    ``info``: :func:`fedind.data.format.validate_data_root`'s summary. None when all is well."""
    absent = info.get("absent_labels", [])
    if info.get("num_classes_from") != "labels" or not absent:
        return None
    n = int(info["num_classes"])
    return (
        f"meta.json declares no num_classes, so the model gets {n} classes from the largest label {n - 1}, "
        f"but labels {label_ranges(absent)} occur in no split (a stray label?); declare num_classes in meta.json"
    )


def missing_features(replies: Iterable, strategy: str, alignment_on: bool) -> dict[str, tuple[list[str], str]]:
    """What the round's train ``replies`` (:class:`fedind.server.metering.SiteReply`) lack, as
    ``{what is missing: (sites, which fedind feature is off for them)}``."""
    replies = list(replies)
    off_without_histogram = []
    if alignment_on:
        off_without_histogram.append("the label-alignment screen is off for them")
    if strategy in DWA_STRATEGIES:
        off_without_histogram.append(f"{strategy} weights the round by example counts")
    gaps = {
        f"no {wire.LABEL_HISTOGRAM!r} metric": (
            [r.site_id for r in replies if wire.LABEL_HISTOGRAM not in r.metrics and off_without_histogram],
            "; ".join(off_without_histogram),
        ),
        f"no {wire.SITE!r} record with {wire.SITE_ID!r}": (
            [r.site_id for r in replies if r.site_id == f"node-{r.node_id}"],
            "they are named by node id in the log and the summary",
        ),
        f"no {wire.TRAIN_SECONDS!r} metric": (
            [r.site_id for r in replies if wire.TRAIN_SECONDS not in r.metrics],
            "their CPU time is not counted (summary totals.site_train_cpu_seconds)",
        ),
    }
    return {what: (sites, effect) for what, (sites, effect) in gaps.items() if sites}


class FeatureLog:
    """Logs (WARNING) each gap of :func:`missing_features` once per run, naming the sites
    and what it switches off: a plain Flower ClientApp works, and the operator learns which
    fedind features it does not get."""

    def __init__(self, strategy: str, alignment_on: bool) -> None:
        self.strategy = strategy
        self.alignment_on = alignment_on
        self.logged: set[str] = set()

    def note(self, replies: Iterable) -> None:
        """Log, in one line, the gaps of these replies not logged before."""
        gaps = missing_features(replies, self.strategy, self.alignment_on)
        new = [f"{what} from {', '.join(sorted(sites))}: {effect}" for what, (sites, effect) in gaps.items()
               if what not in self.logged]
        self.logged.update(gaps)
        if new:
            log(WARNING, "fedind features off for what the sites' replies lack (logged once): %s", " | ".join(new))
