"""Continual learning in Flower, the server's side: the
:class:`PhaseController` (phase ends, head growth, per-phase scores). The maths is in
:mod:`fedind.continual.phases`, :mod:`fedind.continual.replay`, :mod:`fedind.continual.ewc` and :mod:`fedind.continual.expansion`.

Wire (names in :mod:`fedind.wire`):

* end of phase ``p`` (after its last round, before it is scored and checkpointed): the
  server sends ``query.phase_end`` to every site with the global arrays and
  ``{run-config, phase: p, server-round}``; a site answers with its ``metrics``
  (``num-examples``, replay figures) and, with ``ewc-lambda > 0``, an ArrayRecord
  ``ewc-fisher`` (float32, one array per trainable parameter, ``>= 0``);
* every later train message carries ArrayRecords ``ewc-fisher`` (the consolidated Fisher)
  and ``ewc-anchors`` (the parameters at the last phase end) next to ``arrays``; a train
  reply still carries exactly one ArrayRecord, the site's weights, so screening and every
  strategy see what they always saw;
* train replies add ``classes-seen``, ``replay-samples``, ``replay-bytes``, ``windows-seen``
  to their metrics; a site whose data has classes the head lacks adds a ConfigRecord
  ``new-classes`` with its proposed rows for them (``rows``: the rows then the biases,
  flat; ``counts``: its windows of each class; :func:`fedind.continual.phases.propose_new_rows`).

Under ``encryption = "paillier"`` a phase-end reply carries ConfigRecord
``ewc-fisher-encrypted`` and a calibration reply ``feature-moments-encrypted`` instead
(:mod:`fedind.paillier.sums`): the controller has them summed and decrypted through a site
(``secure``, the run's :class:`~fedind.server.encrypted.SecureAggregation`) and reads the
federation's Fisher and moments, never one site's.

The site's half (replay buffer, EWC penalty of a train message) is :mod:`fedind.continual.site`.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from .. import wire
from ..records import array_record, numpy_arrays
from ..config import RunConfig
from ..continual.phases import (
    check_row_proposal,
    evaluate_known,
    forgetting,
    merge_row_proposals,
)
from ..data.format import SiteArrays
from ..continual.calibration import (
    bounded_moments, calibrate_head, decode_moments, merge_moments, shrunk_covariances, vector_moments,
)
from ..continual.ewc import EWCState, server_consolidation
from ..continual.expansion import HEAD_BIAS, HEAD_WEIGHT, expand_head, set_head_rows
from ..files import atomic_write
from ..paillier.sums import unflatten
from .metering import payload_bytes, site_id_of
from ..models import FaultCNN
from .pipeline import ReplyPipeline
from .screening import InvalidUpdate, check_histogram
from .strategies import grow_strategy_classes, reset_strategy_rows

if TYPE_CHECKING:  # the encrypted strategy, only where a run is encrypted
    from .encrypted import SecureAggregation

MAX_CLASSES = 4096  # a classes-seen claim above this is ignored (logged): the head cannot grow without bound


# =========================================================================== server


def _finite_or_none(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


class PhaseController:
    """The server's side of continual learning for one run (see :mod:`fedind.continual.phases`).

    ``end_of_round`` (the round loop's hook) grows the head when a site reports new classes
    and, after the last round of a phase, runs the phase-end query and consolidates the
    Fisher; ``train_records`` gives the EWC records of later train messages; ``score``
    scores the global model on each phase's test set so far (``phases.csv``);
    ``state_dict`` / ``load_state_dict`` go into the server checkpoint.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        strategy: Strategy,
        grid: Grid,
        node_ids: list[int],
        num_classes: int,
        initial_classes: int,
        test_sets: list[SiteArrays | None],
        device: torch.device,
        folder: Path,
        run_config_json: str,
        pipeline: ReplyPipeline | None = None,
        secure: SecureAggregation | None = None,
    ) -> None:
        if len(test_sets) != config.phases:
            raise ValueError(f"expected {config.phases} phase test sets, got {len(test_sets)}")
        self.config = config
        self.strategy = strategy
        self.grid = grid
        self.node_ids = list(node_ids)
        self.num_classes = int(num_classes)
        self.initial_classes = int(initial_classes)
        self.test_sets = list(test_sets)
        self.device = device
        self.folder = Path(folder)
        self.run_config_json = run_config_json
        self.pipeline = pipeline  # follows a grown head (the length of a valid label histogram)
        self.secure = secure  # encryption: the Fisher and the feature moments are summed under Paillier
        self.ewc = EWCState(config.ewc_gamma, config.ewc_keep) if config.ewc_lambda > 0 else None
        self.consolidated: list[int] = []  # phases whose end the sites were told of
        self.expansions: list[dict] = []  # {"round", "from", "to", "proposed_rows"}
        self.rows: list[dict] = []  # per-round scores (phases.csv)
        self.replay: dict[str, dict] = {}  # site -> latest replay figures
        self.declared: dict[str, list[int]] = {}  # site -> label histogram of its latest train reply (bounds its calibration counts)
        self._records: dict[str, ArrayRecord] | None = None  # EWC records, built once per change
        # First class grown in the current phase (None when none grew): its holders refit its
        # rows every round, or DWA averages them over the holders (young-rows; fedind.continual.phases).
        self.young_from: int | None = None

    # ------------------------------------------------------------------ round hooks

    def train_records(self, server_round: int) -> dict[str, ArrayRecord | ConfigRecord]:
        """``ewc-fisher`` and ``ewc-anchors`` for every train message once a phase ended, and
        ``new-classes`` (``refit-from``) while the current phase has grown rows."""
        records: dict[str, ArrayRecord | ConfigRecord] = {}
        if self.config.ewc_lambda_at(server_round):  # none while a faded penalty is off
            records.update(self._ewc_records())
        if self.young_from is not None and self.config.refits_young_rows:
            records[wire.NEW_CLASSES] = ConfigRecord({wire.REFIT_FROM: self.young_from})
        return records

    def _set_young(self, first: int | None) -> None:
        """Classes ``first`` on grew in this phase (None: none): DWA averages their rows over
        the sites that hold them (``young-rows = holders``), or the holders refit them every
        round (:meth:`train_records`; ``refit``, and every other strategy)."""
        self.young_from = first
        if not self.config.refits_young_rows:
            self.strategy.average_over_holders(first)

    def _ewc_records(self) -> dict[str, ArrayRecord]:
        if self.ewc is None or not self.ewc.phases:
            return {}
        if self._records is None:
            self._records = {wire.EWC_FISHER: array_record(self.ewc.fisher)}
            if self.config.ewc_anchor == "phase-end":  # global: the sites anchor at the model they receive
                self._records[wire.EWC_ANCHORS] = array_record(self.ewc.anchors)
        return self._records

    def end_of_round(self, server_round: int, arrays: ArrayRecord, replies: list[Message]) -> ArrayRecord:
        claimed = self.num_classes
        proposing: list[tuple[str, Mapping]] = []
        for reply in replies:
            if reply.has_error():
                continue
            site, metrics, proposal, histogram = _reported(reply)
            self.note_replay(site, metrics)
            if histogram is not None:
                self.declared[site] = list(histogram)
            seen = metrics.get(wire.CLASSES_SEEN)
            if seen is None:
                continue
            valid = isinstance(seen, (int, float)) and not isinstance(seen, bool) and math.isfinite(seen)
            if not (valid and float(seen).is_integer() and 1 <= seen <= MAX_CLASSES):
                log(WARNING, "round %d: site %s claims classes-seen = %r; ignored", server_round, site, seen)
                continue
            claimed = max(claimed, int(seen))
            if proposal is not None:
                proposing.append((site, proposal))
        # Proposals cover the classes from the first young one (or the head's end) on.
        refit = self.young_from is not None and self.config.refits_young_rows
        first = self.young_from if refit else self.num_classes
        rows = self._proposed_rows(server_round, arrays, first, claimed, proposing)
        young = {k: r for k, r in rows.items() if k < self.num_classes}
        if young:  # their holders' fit replaces the average, in which the others diluted them
            arrays = array_record(set_head_rows(numpy_arrays(arrays), young))
            reset_strategy_rows(self.strategy, arrays, sorted(young))  # no momentum for steps not taken
        if claimed > self.num_classes:
            if self.young_from is None:
                self._set_young(self.num_classes)
            arrays = self.grow(server_round, arrays, claimed, {k: r for k, r in rows.items() if k >= self.num_classes})
        if self.ewc is not None and self.ewc.phases and self.config.ewc_server_lambda > 0:
            arrays = self.damp(arrays)
        if server_round in self.config.phase_end_rounds():
            phase = self.config.phase_of(server_round)
            if phase not in self.consolidated and (self.ewc is not None or self.config.replay_samples):
                self.end_phase(server_round, phase, arrays)
            self._set_young(None)  # rows grown in a phase are ordinary rows from the next one on
        return arrays

    def _proposed_rows(
        self, server_round: int, arrays: ArrayRecord, first: int, num_classes: int, proposing: list[tuple[str, Mapping]]
    ) -> dict[int, tuple[np.ndarray, float]]:
        """The sites' proposed rows for classes ``first .. num_classes - 1``, merged
        (:func:`merge_row_proposals`); a malformed proposal, or one beyond the scale of the
        rows before ``first`` (:func:`~fedind.continual.phases.row_bounds`), is logged and left out."""
        if not proposing:
            return {}
        dim = arrays[HEAD_WEIGHT].shape[1]
        head = (arrays[HEAD_WEIGHT].numpy()[:first], arrays[HEAD_BIAS].numpy()[:first])
        valid = []
        for site, record in proposing:
            try:
                counts = np.asarray(record.get(wire.NEW_COUNTS), dtype=np.float64)
                flat = np.asarray(record.get(wire.NEW_ROWS), dtype=np.float64)
                m = counts.size
                if counts.ndim != 1 or flat.shape != (m * (dim + 1),):
                    raise ValueError(f"{flat.size} values for {m} classes of {dim} features (+ bias)")
                proposal = (flat[: m * dim].reshape(m, dim), flat[m * dim :], counts)
                check_row_proposal(proposal, first, num_classes, dim, head=head)
            except (TypeError, ValueError) as err:
                log(WARNING, "round %d: site %s proposes invalid new-class rows (%s); ignored", server_round, site, err)
                continue
            valid.append(proposal)
        return merge_row_proposals(valid, first, num_classes, dim)

    def grow(
        self, server_round: int, arrays: ArrayRecord, num_classes: int,
        rows: Mapping[int, tuple[np.ndarray, float]] | None = None,
    ) -> ArrayRecord:
        """Grow the global head to ``num_classes`` and everything that follows it; new classes
        in ``rows`` start from those rows (:func:`fedind.continual.expansion.expand_head`)."""
        old = self.num_classes
        arrays = array_record(expand_head(numpy_arrays(arrays), num_classes, new_rows=rows))
        grow_strategy_classes(self.strategy, arrays, num_classes)
        if self.pipeline is not None:
            self.pipeline.grow_classes(num_classes)
        if self.ewc is not None:  # the records sent stay as consolidated: sites pad new rows with F = 0
            self.ewc.expand_classes(num_classes)
        self.num_classes = num_classes
        proposed = sorted(rows or {})
        self.expansions.append({"round": server_round, "from": old, "to": num_classes, "proposed_rows": proposed})
        log(
            INFO, "round %d: a site reports %d classes; the head grew from %d to %d (rows proposed by sites for %s)",
            server_round, num_classes, old, num_classes, proposed or "none",
        )
        return arrays

    def damp(self, arrays: ArrayRecord) -> ArrayRecord:
        """The server's EWC step (``ewc-server-lambda``): each coordinate's drift from its
        anchor damped by ``1 / (1 + kappa F)`` (:func:`fedind.continual.ewc.server_consolidation`)."""
        kappa = self.config.ewc_server_lambda
        return array_record(server_consolidation(numpy_arrays(arrays), self.ewc.fisher, self.ewc.anchors, kappa))

    def end_phase(self, server_round: int, phase: int, arrays: ArrayRecord) -> None:
        """The phase-end query: sites offer their batch to their buffer and (EWC) send
        their Fisher at ``arrays``; the server consolidates them with ``arrays`` as anchors."""
        content = RecordDict(
            {
                wire.ARRAYS: arrays,
                wire.CONFIG: ConfigRecord(
                    {wire.RUN_CONFIG: self.run_config_json, wire.PHASE: phase, wire.SERVER_ROUND: server_round}
                ),
            }
        )
        messages = [Message(content=content, message_type=wire.PHASE_END, dst_node_id=n) for n in self.node_ids]
        replies = self.grid.send_and_receive(messages, timeout=self.config.round_timeout)
        fishers, weights, encrypted = [], [], []
        for reply in replies:
            if reply.has_error():
                log(WARNING, "phase %d end: node %d failed: %s", phase, reply.metadata.src_node_id, reply.error.reason)
                continue
            metrics = next(iter(reply.content.metric_records.values()), {})
            self.note_replay(site_id_of(reply), metrics)
            if self.ewc is None:
                continue
            try:
                if self.secure is not None:
                    encrypted.append((reply, *_encrypted_record(reply, wire.EWC_FISHER_ENCRYPTED)))
                    continue
                fisher, n = _read_fisher(reply, arrays)
            except ValueError as err:
                log(WARNING, "phase %d end: Fisher of site %s dropped: %s", phase, site_id_of(reply), err)
                continue
            fishers.append(fisher)
            weights.append(n)
        if encrypted:  # the sites' Fisher, summed under encryption: the pooled Fisher, never one site's
            shapes = {name: tuple(a.shape) for name, a in arrays.items()}
            summed = self.secure.side_mean(f"phase {phase} end Fisher", server_round, encrypted,
                                           sum(int(np.prod(s)) for s in shapes.values()))
            if summed is not None:
                fishers, weights = [unflatten(np.maximum(summed[0], 0.0), shapes)], [1.0]
        if self.ewc is not None:
            if fishers:
                self.ewc.consolidate(fishers, weights, numpy_arrays(arrays))
                self._records = None
                log(INFO, "phase %d end: EWC consolidated the Fisher of %d sites", phase, len(fishers))
            else:
                log(WARNING, "phase %d end: no site sent a valid Fisher; EWC keeps its earlier state", phase)
        self.consolidated.append(phase)

    def calibrate(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """Head calibration (``head-calibration``; :mod:`fedind.continual.calibration`): ask
        every site for its per-class feature moments under ``arrays`` (``query.calibrate``;
        with the compressed downlink a step that closes the whole gap to ``arrays``), merge them and refit
        the head on virtual features drawn from them. A malformed record is logged and left
        out; with fewer than two classes described the head stays. The head's momentum is
        cleared: it held steps towards the head that was replaced."""
        content = RecordDict({
            wire.ARRAYS: arrays,
            wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: self.run_config_json, wire.SERVER_ROUND: server_round}),
        })
        messages = [Message(content=content, message_type=wire.CALIBRATE, dst_node_id=n) for n in self.node_ids]
        return self.calibrated(server_round, arrays, self.grid.send_and_receive(messages, timeout=self.config.round_timeout))

    def calibrated(self, server_round: int, arrays: ArrayRecord, replies) -> ArrayRecord:
        """``arrays`` with the head refit on the moments of the calibration ``replies``."""
        weight = arrays[HEAD_WEIGHT].numpy()
        what = f"round {server_round} calibration"
        if self.secure is not None:
            encrypted = _answered(what, replies, lambda r: _encrypted_record(r, wire.FEATURE_MOMENTS_ENCRYPTED))
            merged = self._summed_moments(server_round, [(r, *v) for r, v in encrypted], *weight.shape)
            if merged is None:
                return arrays
            counts, means, scatter, sites = merged
            return self._refit(server_round, arrays, counts, means, scatter, sites=sites)
        described = {site_id_of(r): m for r, m in _answered(what, replies, lambda r: decode_moments(
            dict(r.content.config_records.get(wire.FEATURE_MOMENTS) or {}), *weight.shape))}
        parts, reasons = bounded_moments(described, self._declared_windows())
        for reason in reasons:
            log(WARNING, "round %d calibration: %s", server_round, reason)
        counts, means, scatter = merge_moments(parts, weight.shape[0]) if parts else (np.zeros(0), None, None)
        return self._refit(server_round, arrays, counts, means, scatter, sites=len(parts))

    def _refit(self, server_round: int, arrays: ArrayRecord, counts, means, scatter, *, sites: int) -> ArrayRecord:
        """``arrays`` with the head refit on the merged moments (fewer than two classes: as they are)."""
        weight, bias = arrays[HEAD_WEIGHT].numpy(), arrays[HEAD_BIAS].numpy()
        if np.count_nonzero(counts) < 2:
            log(WARNING, "round %d calibration: features of %d classes described; the head stays", server_round,
                np.count_nonzero(counts))
            return arrays
        new_weight, new_bias = calibrate_head(weight, bias, counts, means, shrunk_covariances(counts, scatter),
                                              seed=self.config.seed * 1_000_003 + server_round)
        log(INFO, "round %d: head calibrated on the feature moments of %d sites (%d windows, %d classes)",
            server_round, sites, int(counts.sum()), np.count_nonzero(counts))
        edited = array_record({**numpy_arrays(arrays), HEAD_WEIGHT: new_weight, HEAD_BIAS: new_bias})
        reset_strategy_rows(self.strategy, edited, range(weight.shape[0]))
        return edited

    def _summed_moments(self, server_round: int, parts: list[tuple[Message, Mapping, float]], num_classes: int,
                        features: int):
        """Under encryption: ``(counts, means, scatter, sites)`` of the sites' moments summed
        under Paillier (``parts``: reply, payload, windows; :func:`~fedind.continual.calibration.moments_vector`),
        or None (logged). One line's record cannot be bounded here; the sum's counts can: a
        class with more windows than the summed lines declared in training (label histograms
        plus replay buffers, with 2 % for the weights' rounding) means a forged record, and the head stays."""
        size = num_classes * (1 + features + features * (features + 1) // 2)
        summed = self.secure.side_mean(f"round {server_round} calibration", server_round, parts, size)
        if summed is None:
            log(WARNING, "round %d calibration: no summed feature moments; the head stays", server_round)
            return None
        mean, used = summed
        total = sum(windows for _, _, windows in used)
        try:
            counts, means, scatter = vector_moments(mean, total, num_classes, features)
        except ValueError as err:
            log(WARNING, "round %d calibration: the summed moments are invalid (%s); the head stays", server_round, err)
            return None
        declared = self._declared_windows()
        limit = np.zeros(num_classes)
        for reply, _, _ in used:
            line = np.asarray(declared.get(site_id_of(reply), []), dtype=np.float64)[:num_classes]
            limit[: line.size] += line
        over = np.flatnonzero(counts > 1.02 * limit + 1)
        if over.size:
            log(WARNING, "round %d calibration: the summed moments claim %s windows of classes %s, over the %s the "
                "lines declared in training; a line forged its record (which one the sum cannot tell): the head "
                "stays", server_round, counts[over].astype(int).tolist(), over.tolist(), limit[over].astype(int).tolist())
            return None
        return counts, means, scatter, len(used)

    def _declared_windows(self) -> dict[str, list[int]]:
        """Per site, the windows of each class it can describe: its latest label histogram,
        plus its whole replay buffer in every class (the buffer's mix is not reported)."""
        return {site: [c + self.replay.get(site, {}).get("samples", 0) for c in histogram]
                for site, histogram in self.declared.items()}

    def note_replay(self, site: str, metrics: Mapping) -> None:
        """Keep a site's replay-buffer figures (phase-end and final replies carry them)."""
        if wire.REPLAY_SAMPLES not in metrics:
            return
        entry = self.replay.setdefault(site, {"samples": 0, "bytes": 0, "windows": 0})
        entry["samples"] = max(entry["samples"], int(metrics[wire.REPLAY_SAMPLES]))
        entry["bytes"] = max(entry["bytes"], int(metrics[wire.REPLAY_BYTES]))
        entry["windows"] = max(entry["windows"], int(metrics[wire.WINDOWS_SEEN]))

    # ------------------------------------------------------------------ scores

    def score(self, server_round: int, arrays: ArrayRecord) -> tuple[float, float]:
        """(accuracy, loss) of the global model on the test sets of phases ``0..phase``
        together (rounds.csv); each phase's accuracy and the new classes' go to phases.csv."""
        phase = self.config.phase_of(server_round)
        model = FaultCNN.from_state_dict(arrays.to_torch_state_dict())
        row: dict = {"round": server_round, "phase": phase, "classes": model.head.out_features}
        correct = total = known = 0
        loss = 0.0
        latest = None
        for q in range(self.config.phases):
            test = self.test_sets[q]
            if q > phase or test is None:
                row[f"accuracy_phase_{q}"] = None
                continue
            result = evaluate_known(model, test, self.device, new_from=self.initial_classes)
            row[f"accuracy_phase_{q}"] = result.accuracy
            correct, total = correct + result.correct, total + result.num_examples
            if result.num_known:
                known, loss = known + result.num_known, loss + result.loss * result.num_known
            latest = result
        row["new_class_accuracy"] = latest.new_correct / latest.num_new if latest is not None and latest.num_new else None
        self.rows = [r for r in self.rows if r["round"] != server_round] + [row]
        self._write_csv()
        return (correct / total if total else float("nan")), (loss / known if known else float("nan"))

    def _write_csv(self) -> None:
        fields = ["round", "phase", "classes"] + [f"accuracy_phase_{q}" for q in range(self.config.phases)]
        fields.append("new_class_accuracy")
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(fields)
        for row in self.rows:
            writer.writerow(["" if row[f] is None else (f"{row[f]:.6f}" if isinstance(row[f], float) else row[f]) for f in fields])
        atomic_write(self.folder / "phases.csv", out.getvalue().encode())

    def summary(self) -> dict:
        """The continual section of summary.json."""
        by_round = {row["round"]: row for row in self.rows}
        ends = list(self.config.phase_end_rounds()) + [self.config.num_server_rounds]
        after_phase = []
        for p, end in enumerate(ends):
            row = by_round.get(end)
            after_phase.append(
                [float("nan") if row is None or row[f"accuracy_phase_{q}"] is None else row[f"accuracy_phase_{q}"]
                 for q in range(p + 1)]
            )
        final = after_phase[-1]
        last = by_round.get(self.config.num_server_rounds, {})
        windows = {s: e for s, e in self.replay.items()}
        shares = [e["samples"] / e["windows"] for e in windows.values() if e["windows"]]
        return {
            "phases": self.config.phases,
            "phase_rounds": self.config.phase_rounds,
            "phase_end_rounds": ends,
            "initial_classes": self.initial_classes,
            "classes": self.num_classes,
            "expansions": list(self.expansions),
            "consolidated_phases": list(self.consolidated),
            "accuracy_after_phase": [[_finite_or_none(a) for a in accs] for accs in after_phase],
            "final_accuracy_per_phase": [_finite_or_none(a) for a in final],
            "average_accuracy": _finite_or_none(float(np.nanmean(final))) if np.isfinite(final).any() else None,
            "forgetting": forgetting(after_phase),
            "new_class_accuracy": last.get("new_class_accuracy"),
            "replay": {
                "per_site": windows,
                "max_share": max(shares) if shares else None,
                "max_samples": max((e["samples"] for e in windows.values()), default=0),
                "max_bytes": max((e["bytes"] for e in windows.values()), default=0),
            },
            "ewc_bytes_per_train_message": payload_bytes(RecordDict(self._ewc_records())) if self.ewc and self.ewc.phases else 0,
        }

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {
            "num_classes": self.num_classes,
            "ewc": None if self.ewc is None else self.ewc.state_dict(),
            "consolidated": list(self.consolidated),
            "expansions": [dict(e) for e in self.expansions],
            "rows": [dict(r) for r in self.rows],
            "replay": {s: dict(e) for s, e in self.replay.items()},
            "declared": {s: list(h) for s, h in self.declared.items()},
            "young_from": self.young_from,
        }

    def load_state_dict(self, state: Mapping) -> None:
        keys = {"num_classes", "ewc", "consolidated", "expansions", "rows", "replay"}
        # young_from and declared are optional: checkpoints from before them resume without
        if not isinstance(state, Mapping) or not keys <= set(state) <= keys | {"young_from", "declared"}:
            raise ValueError(f"Invalid continual state: keys {sorted(state) if isinstance(state, Mapping) else state!r}")
        if (state["ewc"] is None) != (self.ewc is None):
            raise ValueError("Invalid continual state: EWC state does not match ewc-lambda")
        if self.ewc is not None:
            self.ewc.load_state_dict(state["ewc"])
        self.num_classes = int(state["num_classes"])
        if self.pipeline is not None:
            self.pipeline.grow_classes(self.num_classes)
        self.consolidated = [int(p) for p in state["consolidated"]]
        self.expansions = [dict(e) for e in state["expansions"]]
        self.rows = [dict(r) for r in state["rows"]]
        young = state.get("young_from")
        if young is not None and not (isinstance(young, int) and not isinstance(young, bool) and 1 <= young <= int(state["num_classes"])):
            raise ValueError(f"Invalid continual state: young_from = {young!r}")
        self.replay = {str(s): dict(e) for s, e in state["replay"].items()}
        self.declared = {str(s): [int(c) for c in h] for s, h in state.get("declared", {}).items()}
        self._set_young(young)
        self._records = None


def _reported(reply: Message) -> tuple[str, Mapping, Mapping | None, tuple[int, ...] | None]:
    """(site, metrics, new-classes proposal, checked label histogram or None) of a train
    reply: from its typed update (:mod:`fedind.server.pipeline`), or read off a reply that
    came without one (its histogram checked as the pipeline checks it)."""
    update = getattr(reply, "update", None)
    if update is not None:
        return update.site_id, update.metrics, update.proposal, update.histogram
    metrics = next(iter(reply.content.metric_records.values()), {})
    try:
        histogram = tuple(check_histogram(metrics.get(wire.LABEL_HISTOGRAM), None, metrics.get(wire.NUM_EXAMPLES)))
    except InvalidUpdate:
        histogram = None
    return site_id_of(reply), metrics, reply.content.config_records.get(wire.NEW_CLASSES), histogram


def _answered(what: str, replies, read) -> list[tuple[Message, Any]]:
    """``(reply, read(reply))`` of the replies to a query; a failed reply, or one whose record
    ``read`` finds malformed (ValueError), is logged under ``what`` and left out."""
    out = []
    for reply in replies:
        if reply.has_error():
            log(WARNING, "%s: node %d failed: %s", what, reply.metadata.src_node_id, reply.error.reason)
            continue
        try:
            out.append((reply, read(reply)))
        except ValueError as err:
            log(WARNING, "%s: feature moments of site %s dropped: %s", what, site_id_of(reply), err)
    return out


def _encrypted_record(reply: Message, name: str) -> tuple[Mapping, float]:
    """(payload, num-examples) of a reply carrying an encrypted side vector ``name``
    (:mod:`fedind.paillier.sums`); ValueError when either is missing or malformed."""
    record = reply.content.config_records.get(name)
    if record is None:
        raise ValueError(f"no {name!r} record")
    return record, _num_examples(reply)


def _num_examples(reply: Message) -> float:
    """A phase-end or calibration reply's ``num-examples`` (ValueError unless a positive number)."""
    metrics = next(iter(reply.content.metric_records.values()), {})
    n = metrics.get(wire.NUM_EXAMPLES)
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not (math.isfinite(n) and n > 0):
        raise ValueError(f"{wire.NUM_EXAMPLES} = {n!r}")
    return float(n)


def _read_fisher(reply: Message, arrays: ArrayRecord) -> tuple[dict[str, np.ndarray], float]:
    """(Fisher, num-examples) of a phase-end reply, checked against the global arrays."""
    records = reply.content.array_records
    if wire.EWC_FISHER not in records:
        raise ValueError(f"no {wire.EWC_FISHER!r} record")
    n = _num_examples(reply)
    fisher = {}
    for name, array in records[wire.EWC_FISHER].items():
        if name not in arrays:
            raise ValueError(f"{name!r} is not an array of the model")
        value = array.numpy()
        if value.dtype != np.float32 or value.shape != tuple(arrays[name].shape):
            raise ValueError(f"{name!r}: {value.dtype} {value.shape}, model {tuple(arrays[name].shape)}")
        if not np.all(np.isfinite(value)) or np.any(value < 0):
            raise ValueError(f"{name!r}: values must be finite and >= 0")
        fisher[name] = value
    if not fisher:
        raise ValueError("empty Fisher")
    return fisher, n
