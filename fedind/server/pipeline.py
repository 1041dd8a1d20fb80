"""One pass per reply: every train reply is decoded, validated and screened once into a
:class:`SiteUpdate`, which every strategy consumes.

::

    reply --decode_reply--> SiteUpdate --UpdateScreen (round rules)--> SiteUpdate | error reply
          (top-k payload or dense arrays or Paillier ciphertexts; structure, num-examples,
           label histogram; delta = reply - global in float64, or NO_UPDATE)

:class:`ReplyPipeline` is :class:`~fedind.server.metering.MeteredGrid`'s round-level hook.
It returns an :class:`UpdateReply` per accepted reply: a plain Flower ``Message`` (dense
``arrays`` + ``metrics``, what Flower's built-in strategies read) that also carries its
typed ``update``, which fedind's strategies (DWA, the encrypted wrapper) and the phase
controller read instead of decoding the message again (:func:`update_of`). A rejected
reply becomes an error reply whose code (:mod:`fedind.wire`) says which step refused it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log

from .. import wire
from ..paillier.packing import CiphertextError, EncryptedVector, parse_record
from ..topk.codec import PayloadError
from .metering import site_id_of
from .screening import InvalidUpdate, UpdateScreen, check_histogram, is_real, read_metrics, read_reply

__all__ = ["NO_UPDATE", "NoUpdate", "Rejected", "ReplyPipeline", "SiteUpdate", "UpdateReply", "decode_reply",
           "update_of"]


@dataclass(frozen=True)
class NoUpdate:
    """A reply that arrived and was valid but carries nothing to aggregate (the site trained
    on no windows: every class of its data is new to the head). Its metrics and its
    proposed head rows still count (:class:`~fedind.server.continual.PhaseController`)."""

    reason: str = "trained on no windows"


NO_UPDATE = NoUpdate()


@dataclass(frozen=True, eq=False)
class SiteUpdate:
    """One train reply, decoded, validated and screened.

    ``change``: the site's delta ``reply - global`` (float64 per array), its Paillier
    ciphertexts (encrypted runs: :class:`~fedind.paillier.packing.EncryptedVector`), or
    :data:`NO_UPDATE`. ``weights``: the site's model after the screen in the global model's
    dtypes (dense runs; what Flower's built-ins average), else None. ``proposal``: the
    ``new-classes`` record of a site whose data has classes the head lacks."""

    site_id: str
    node_id: int
    num_examples: float
    histogram: tuple[int, ...] | None
    change: Mapping[str, np.ndarray] | EncryptedVector | NoUpdate
    weights: Mapping[str, np.ndarray] | None
    metrics: MetricRecord
    proposal: ConfigRecord | None = None

    @property
    def has_update(self) -> bool:
        return not isinstance(self.change, NoUpdate)

    @property
    def delta(self) -> Mapping[str, np.ndarray]:
        if isinstance(self.change, (NoUpdate, EncryptedVector)):
            raise TypeError(f"site {self.site_id}: no plaintext delta ({type(self.change).__name__})")
        return self.change


class Rejected(Exception):
    """A reply that must not be aggregated: ``code`` (:mod:`fedind.wire`) and the reason."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class UpdateReply(Message):
    """The reply a strategy receives for an accepted train reply: a Flower message with the
    site's dense weights (or, encrypted, its ciphertext record) and metrics, and ``update``."""

    def __init__(self, update: SiteUpdate, instruction: Message, reply: Message) -> None:
        content = RecordDict()
        for name, record in reply.content.items():  # the site's records, in the site's order
            if name in reply.content.array_records or name in (wire.SPARSE_UPDATE, wire.TOPK_ESTIMATE):
                continue
            content[name] = record
        if update.weights is not None:
            content[wire.ARRAYS] = ArrayRecord({name: Array(w) for name, w in update.weights.items()})
        super().__init__(content, reply_to=instruction)
        self.update = update


def decode_reply(
    instruction: Message,
    reply: Message,
    sent: Mapping[str, np.ndarray],
    *,
    num_classes: int | None = None,
    uplink=None,
    cipher: tuple | None = None,
) -> SiteUpdate:
    """THE decode of a train reply (one call per reply and round), or :class:`Rejected`.

    ``sent``: the global arrays that site got. ``uplink``: the top-k decoder (``decode(
    instruction, reply) -> dense change``, :mod:`fedind.topk.uplink`) for a reply carrying
    ``sparse-update``. ``cipher``: ``(public key, clip, packing layout)`` of an encrypted run."""
    content = reply.content
    if cipher is not None:
        key, clip, layout = cipher
        try:
            if content.array_records or wire.ENCRYPTED_UPDATE not in content.config_records:
                raise CiphertextError(
                    "encryption = 'paillier' but the reply carries plaintext arrays or no "
                    f"{wire.ENCRYPTED_UPDATE!r} record (is the site running without the fedind mods?)"
                )
            count, coordinates = int(sum(int(np.prod(a.shape)) for a in sent.values())), ""
            announced = None if instruction is None else instruction.content.config_records.get(wire.PAILLIER_SET)
            if announced is not None:  # a sparse round: k values on the set this site was sent
                count, coordinates = len(announced[wire.SET_INDICES]) // 4, str(announced[wire.SET_DIGEST])
            vector = parse_record(content[wire.ENCRYPTED_UPDATE], key, kind="update", count=count, clip=clip,
                                  coordinates=coordinates, layout=layout)
        except CiphertextError as err:
            raise Rejected(wire.REJECTED_CIPHERTEXT, f"rejected encrypted update: {err}") from None
        return _typed(reply, sent, num_classes, vector, None)
    if wire.SPARSE_UPDATE in content.config_records and uplink is not None:
        try:
            change = uplink.decode(instruction, reply)
        except PayloadError as err:
            raise Rejected(wire.REJECTED_PAYLOAD, f"rejected sparse update: {err}") from None
        if content.array_records:
            raise _screened(f"expected exactly one ArrayRecord, got {len(content.array_records) + 1}", reply)
        weights = {name: (base + change[name]).astype(base.dtype) for name, base in sent.items()}
    else:
        try:
            weights, _ = read_reply(reply, sent)
        except InvalidUpdate as err:
            raise _screened(str(err), reply) from None
    delta = {name: weights[name].astype(np.float64) - base.astype(np.float64) for name, base in sent.items()}
    return _typed(reply, sent, num_classes, delta, weights)


def _typed(reply: Message, sent, num_classes, change, weights) -> SiteUpdate:
    """The checks of the reply's metrics, then the update (NO_UPDATE when it trained on nothing)."""
    try:
        metrics = read_metrics(reply)
        n = metrics.get(wire.NUM_EXAMPLES)
        if n is None:
            raise InvalidUpdate(f"no {wire.NUM_EXAMPLES!r} metric")
        if not (is_real(n) and n >= 0 and float(n).is_integer()):
            raise InvalidUpdate(f"{wire.NUM_EXAMPLES} = {n!r}: expected a whole number >= 0")
        histogram = metrics.get(wire.LABEL_HISTOGRAM)
        if histogram is not None:
            histogram = tuple(check_histogram(histogram, num_classes, n))
    except InvalidUpdate as err:
        raise _screened(str(err), reply) from None
    if n == 0:  # trained on nothing (its classes are all new to the head): no update, whatever it sent
        change, weights = NO_UPDATE, None
    return SiteUpdate(
        site_id=site_id_of(reply), node_id=reply.metadata.src_node_id, num_examples=float(n), histogram=histogram,
        change=change, weights=weights, metrics=metrics,
        proposal=reply.content.config_records.get(wire.NEW_CLASSES),
    )


def _screened(reason: str, reply: Message) -> Rejected:
    return Rejected(wire.REJECTED_UPDATE, f"rejected update: {reason} (site {site_id_of(reply)})")


def scaled(update: SiteUpdate, sent: Mapping[str, np.ndarray], factor: float) -> SiteUpdate:
    """``update`` with its weights ``sent + factor * delta`` (each array's dtype) and the delta of those."""
    weights = {name: (base + factor * update.delta[name]).astype(base.dtype) for name, base in sent.items()}
    delta = {name: weights[name].astype(np.float64) - base.astype(np.float64) for name, base in sent.items()}
    return SiteUpdate(update.site_id, update.node_id, update.num_examples, update.histogram, delta, weights,
                      update.metrics, update.proposal)


def update_of(reply: Message, decode) -> SiteUpdate:
    """The typed update of a reply: the one the pipeline made, else ``decode(reply)`` (a
    strategy used without :class:`ReplyPipeline`, e.g. in a unit test or another server)."""
    update = getattr(reply, "update", None)
    return update if isinstance(update, SiteUpdate) else decode(reply)


class ReplyPipeline:
    """:class:`~fedind.server.metering.MeteredGrid`'s round-level hook: each train reply of a
    round decoded once (:func:`decode_reply`), then the round's screen (``screen``, an
    :class:`~fedind.server.screening.UpdateScreen`; None: none, as under encryption) over
    the updates. ``uplink``: the top-k decoder, also the grid's transform (its ``settle``
    learns from the grid which replies were accepted).

    ``num_classes``: length of a valid label histogram (None: not checked); it follows a
    grown head through :meth:`grow_classes`."""

    def __init__(self, num_classes: int | None = None, *, uplink=None, screen: UpdateScreen | None = None,
                 cipher: tuple | None = None) -> None:
        self.num_classes = num_classes if screen is None else screen.num_classes
        self.uplink = uplink
        self.screen = screen
        self.cipher = cipher

    def grow_classes(self, num_classes: int) -> None:
        """The head grew (or a resumed run restored it): histograms have ``num_classes`` counts."""
        self.num_classes = int(num_classes)
        if self.screen is not None:
            self.screen.grow_classes(num_classes)

    def __call__(self, instructions: Mapping[int, Message], replies: list[Message]) -> list[Message]:
        out = list(replies)
        decoded: dict[int, dict[str, np.ndarray]] = {}  # the sites share one global ArrayRecord
        updates: dict[int, tuple[Message, dict[str, np.ndarray], SiteUpdate]] = {}  # position -> (instruction, sent, update)
        for i, reply in enumerate(out):
            instruction = instructions.get(reply.metadata.src_node_id)
            if reply.has_error() or instruction is None or instruction.metadata.message_type != MessageType.TRAIN:
                continue
            if wire.ARRAYS not in instruction.content.array_records:
                continue
            record = instruction.content[wire.ARRAYS]
            if id(record) not in decoded:
                decoded[id(record)] = {name: a.numpy() for name, a in record.items()}
            sent = decoded[id(record)]
            try:
                updates[i] = (instruction, sent, decode_reply(instruction, reply, sent, num_classes=self.num_classes,
                                                               uplink=self.uplink, cipher=self.cipher))
            except Rejected as err:
                out[i] = Message(Error(code=err.code, reason=str(err)), reply_to=instruction)
        verdicts = {} if self.screen is None else self.screen.rules([u for _, _, u in updates.values()])
        for position, (i, (instruction, sent, update)) in enumerate(updates.items()):
            verdict = verdicts.get(position)
            if isinstance(verdict, str):
                out[i] = Message(Error(code=wire.REJECTED_UPDATE,
                                       reason=f"rejected update: {verdict} (site {update.site_id})"),
                                 reply_to=instruction)
                continue
            if verdict is not None and verdict < 1.0:
                update = scaled(update, sent, verdict)
            if not update.has_update:
                log(INFO, "site %s: no update (%s); its metrics count, its weights do not", update.site_id,
                    update.change.reason)
            out[i] = UpdateReply(update, instruction, out[i])
        return out
