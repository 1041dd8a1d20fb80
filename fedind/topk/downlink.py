"""The compressed downlink: the server sends each site the sparse change of a shared model,
and nothing the site already holds.

Every site mirrors one *broadcast model* ``P``. Each round the server moves it toward the
strategy's global model ``G`` by the top-k, quantised part of the gap::

    s_t = Q(top_k(G_t - P_{t-1}))      P_t = P_{t-1} + s_t      (the same float32 sum at both ends)

What is not sent stays in ``G_t - P_t`` and goes out in a later round: error feedback with
the residual kept implicitly (DoubleSqueeze, Tang et al. 2019).

With ``downlink-momentum`` :math:`\beta > 0` both ends first move their copy by
:math:`\beta` times its last move, and the step corrects that prediction::

    v_{t-1} = P_{t-1} - P_{t-2}      s_t = Q(top_k(G_t - (P_{t-1} + beta v_{t-1})))
    P_t = P_{t-1} + beta v_{t-1} + s_t

The global model moves with server momentum, so much of its next move is the last one
continued: at beta 0.5 and the same bytes the copy lags the global model by a quarter less
(``simulations/downlink_lag.py``); what that does to the plant benchmark is in
docs/benchmarks/plant.md (not adopted by the recipe). A site sent the whole model gets the
velocity ``v_t`` with it. A site that holds
``P_{t-1}`` (its last reply confirmed that copy) receives ``s_t`` only; any other site
(new, back after missing rounds, restarted without its state, or a plain Flower client,
which never confirms a copy) receives the whole ``P_t``; arrays that changed shape (a grown
head) go whole beside the step. The sites train from ``P_t``; their updates are
deltas, which the server adds to ``G_t``, so the strategy steps from its own model as usual.

Other array records of a train message that a site already holds (the EWC Fisher and
anchors, unchanged for a whole phase), and the run config text, are replaced by their
digest; the site restores them from its copy. Mostly-zero records (a focused Fisher) travel
packed (:func:`pack_sparse`), both ways. A site whose copy does not match a digest answers with an error reply
(:data:`STALE_DOWNLINK`) and gets everything whole next round.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict

from .. import wire
from ..records import array_record, numpy_arrays
from .codec import PayloadError, decode, encode, expected_of, from_record, to_record
from .feedback import ErrorFeedback

STALE_DOWNLINK = wire.STALE_DOWNLINK  # the code's table: fedind.wire
BROADCAST = "downlink-model"  # context.state ArrayRecord: the site's copy of the broadcast model P
VELOCITY = "downlink-velocity"  # context.state ArrayRecord: the copy's last move P_t - P_{t-1} (downlink-momentum)
HELD = "downlink-held"  # context.state ConfigRecord: digest of each record the site holds, by name
CACHED_PREFIX = "downlink-cache:"  # context.state ArrayRecord per cached record name
CACHED_RUN_CONFIG = "downlink-run-config"  # context.state ConfigRecord: the run config text the site holds
# Messages whose global model travels as a step: train rounds and the phase-end query (the
# final evaluation is sent whole, once).
MODEL_MESSAGES = (MessageType.TRAIN, wire.PHASE_END, wire.CALIBRATE)
SYNC_MESSAGES = (wire.CALIBRATE,)  # sent the whole gap G - P (int8): the sites' copy is then the global model
SYNC_MODE = "int8"


def digest(arrays: Mapping[str, np.ndarray]) -> str:
    """A short content digest of named arrays (names, shapes, dtypes and bytes, in order)."""
    h = hashlib.sha256()
    for name, array in arrays.items():
        a = np.ascontiguousarray(array)
        h.update(f"{name}|{a.dtype.str}|{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:24]


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def step_toward(
    held: Mapping[str, np.ndarray], target: Mapping[str, np.ndarray], ratio: float, mode: str
) -> tuple[bytes, dict[str, np.ndarray]]:
    """The payload of ``Q(top_k(target - held))`` and the model ``held + decoded payload``
    that a site holding ``held`` rebuilds from it (:func:`apply_step`)."""
    gap = {name: np.asarray(target[name], np.float32) - np.asarray(held[name], np.float32) for name in target}
    payload = encode(ErrorFeedback(mode=mode, decay=0.0).compress(gap, ratio))
    return payload, apply_step(held, payload)


def predicted(held: Mapping[str, np.ndarray], velocity: Mapping[str, np.ndarray] | None,
              beta: float) -> dict[str, np.ndarray]:
    """Where the copy is expected next: ``held + beta * velocity`` in float32, the same
    operations at both ends (arrays without a velocity of their shape stay where they are)."""
    out = {}
    for name, base in held.items():
        base = np.asarray(base, np.float32)
        v = None if velocity is None else velocity.get(name)
        out[name] = (base + np.float32(beta) * v).astype(np.float32) if beta and v is not None and v.shape == base.shape else base
    return out


def moved_by(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The velocity ``after - before`` of the arrays both hold with one shape (float32)."""
    return {k: (after[k] - np.asarray(before[k], np.float32)).astype(np.float32)
            for k in after if k in before and np.shape(before[k]) == after[k].shape}


def apply_step(held: Mapping[str, np.ndarray], payload: bytes) -> dict[str, np.ndarray]:
    """``held`` plus the decoded sparse ``payload`` (PayloadError if it does not fit ``held``)."""
    change = decode(payload, expected_of(held))
    return {name: (np.asarray(base, np.float32) + change[name]).astype(np.float32) for name, base in held.items()}


def pack_sparse(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """Lossless compact form of mostly-zero float arrays (a focused EWC Fisher and its
    anchors): per array its shape, the flat indices of its non-zeros (uint32) and their
    values. None when that would not be at least twice smaller than the dense arrays."""
    packed, dense_bytes = {}, 0
    for name, array in arrays.items():
        a = np.asarray(array)
        if a.dtype.kind != "f" or a.size >= 2**32:
            return None
        index = np.flatnonzero(a).astype(np.uint32)
        packed[name + ".shape"] = np.asarray(a.shape, dtype=np.int64)
        packed[name + ".index"] = index
        packed[name + ".value"] = a.ravel()[index]
        dense_bytes += a.nbytes
    packed_bytes = sum(v.nbytes for v in packed.values())
    return packed if 2 * packed_bytes <= dense_bytes else None


def unpack_sparse(packed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The dense arrays of :func:`pack_sparse`; PayloadError naming the fault."""
    names = sorted({key.rsplit(".", 1)[0] for key in packed})
    out = {}
    for name in names:
        try:
            shape = tuple(int(d) for d in np.asarray(packed[name + ".shape"]))
            index = np.asarray(packed[name + ".index"])
            value = np.asarray(packed[name + ".value"])
        except KeyError as err:
            raise PayloadError(f"sparse record {name!r}: missing {err}") from None
        numel = int(np.prod(shape)) if shape else 1
        if any(d < 0 for d in shape) or index.ndim != 1 or index.dtype != np.uint32 or value.shape != index.shape:
            raise PayloadError(f"sparse record {name!r}: bad shape, index or value arrays")
        if value.dtype.kind != "f" or (index.size and (int(index.max()) >= numel or np.any(np.diff(index.astype(np.int64)) <= 0))):
            raise PayloadError(f"sparse record {name!r}: indices out of range or not increasing, or values not float")
        dense = np.zeros(numel, dtype=value.dtype)
        dense[index] = value
        out[name] = dense.reshape(shape)
    return out


def _is_float_model(arrays: Mapping[str, np.ndarray]) -> bool:
    return all(np.issubdtype(np.asarray(a).dtype, np.floating) for a in arrays.values())


class CompressedDownlink:
    """Server side, as :class:`~fedind.server.metering.MeteredGrid`'s transform around ``inner``
    (the uplink decoder). ``prepare`` rewrites each outgoing train message; ``__call__``
    hands the reply to ``inner`` and re-bases dense replies (trained from ``P_t``) onto
    ``G_t``; ``settle`` learns which sites now hold what.

    Not in the server checkpoint: after a resume every site gets the whole model once.
    """

    def __init__(self, inner, ratio: float, mode: str = "int8", initial: tuple[str, dict] | None = None,
                 momentum: float = 0.0) -> None:
        """``initial``: (digest, spec) of a first model the sites can build themselves
        (:func:`fedind.models.initial_state` of ``spec``): sent as its spec, not its arrays.
        ``momentum``: beta of the predicted step (``downlink-momentum``; 0 = plain steps)."""
        if not 0 < ratio <= 1:
            raise ValueError(f"Invalid downlink ratio {ratio!r}: expected 0 < ratio <= 1")
        if not 0 <= momentum < 1:
            raise ValueError(f"Invalid downlink momentum {momentum!r}: expected 0 <= momentum < 1")
        self.inner = inner
        self.ratio = float(ratio)
        self.mode = mode
        self.momentum = float(momentum)
        self.broadcast: dict[str, np.ndarray] | None = None  # P_t
        self.velocity: dict[str, np.ndarray] | None = None  # P_t - P_{t-1} (momentum > 0)
        self.held: dict[int, dict[str, str]] = {}  # node -> {record name: digest} it holds
        self._round_key: tuple | None = None  # (server round, id of the global ArrayRecord) P_t was made for
        self._gap: dict[str, np.ndarray] = {}  # G_t - P_t
        # (base digest, step payload or None, names sent whole with the step, new digest)
        self._step: tuple[str, bytes | None, list[str], str] | None = None
        self._sent: dict[int, dict[str, str]] = {}  # node -> what this round's message gives it
        # id of a record shared by the round's messages -> (digest, packed form or None): each
        # is digested and packed once a round, not once a site
        self._records: dict[int, tuple[str, dict[str, np.ndarray] | None]] = {}
        self._answered: set[int] = set()  # nodes whose site answered this round's message
        self.initial = initial
        self._no_init: set[int] = set()  # nodes whose own initial model did not match: sent whole
        self._init_sent: set[int] = set()  # nodes sent the initial model's spec this round

    # -------------------------------------------------------------- outgoing
    def prepare(self, message: Message) -> Message:
        message = self.inner.prepare(message)
        if message.metadata.message_type not in MODEL_MESSAGES or wire.ARRAYS not in message.content.array_records:
            return message
        node = message.metadata.dst_node_id
        global_record = message.content[wire.ARRAYS]
        key = (message.content.config_records.get(wire.CONFIG, {}).get(wire.SERVER_ROUND), id(global_record))
        if self._round_key != key:  # first message of a round: move P once
            # A calibration query needs the sites' features under G itself: its step is the
            # whole gap, int8 (SYNC_MODE), so P_t = G_t up to the rounding of the gap.
            sync = message.metadata.message_type in SYNC_MESSAGES
            self._advance(numpy_arrays(global_record), 1.0 if sync else self.ratio, SYNC_MODE if sync else self.mode,
                          0.0 if sync else self.momentum)
            self._round_key, self._records = key, {}
        base, payload, whole, new = self._step
        holds = self.held.get(node, {})
        content = RecordDict({k: v for k, v in message.content.items() if k != wire.ARRAYS})
        downlink = {wire.TOKEN: new}
        # A step to every site that confirmed a copy: one that missed rounds (and holds an older
        # copy) refuses it and is sent the whole model in the same round (resend), so nothing
        # whole goes to a line while it is off the network.
        if payload is not None and wire.ARRAYS in holds:
            downlink[wire.DOWNLINK_BASE] = base
            downlink[wire.DOWNLINK_ORDER] = list(self.broadcast)
            if self.momentum:  # the site keeps its copy's velocity (a sync step is not predicted: beta 0)
                downlink[wire.DOWNLINK_MOMENTUM] = 0.0 if message.metadata.message_type in SYNC_MESSAGES else self.momentum
            content[wire.DOWNLINK_STEP] = to_record(payload)
            if whole:
                content[wire.DOWNLINK_WHOLE] = array_record({k: self.broadcast[k] for k in whole})
        elif self.initial is not None and self.initial[0] == new and node not in self._no_init:
            downlink[wire.DOWNLINK_INIT] = json.dumps(self.initial[1], sort_keys=True)  # the site builds it
            self._init_sent.add(node)
        else:
            content[wire.ARRAYS] = array_record(self.broadcast)
            if self.momentum and self.velocity:  # the site predicts its next step from it
                content[wire.DOWNLINK_VELOCITY] = array_record(self.velocity)
        sent = {wire.ARRAYS: new}
        for name, record in message.content.array_records.items():  # records the site may hold already
            if name == wire.ARRAYS:
                continue
            if id(record) not in self._records:
                values = numpy_arrays(record)
                self._records[id(record)] = (digest(values), pack_sparse(values))
            token, packed = self._records[id(record)]
            sent[name] = token
            if holds.get(name) == token:
                del content[name]
                downlink[f"{wire.CACHED_RECORD}{name}"] = token
            elif packed is not None:
                del content[name]
                content[f"{wire.SPARSE_RECORD}{name}"] = array_record(packed)
        config = message.content.config_records.get(wire.CONFIG)
        if config is not None and wire.RUN_CONFIG in config:  # the same JSON text every round
            token = text_digest(str(config[wire.RUN_CONFIG]))
            sent[wire.RUN_CONFIG] = token
            if holds.get(wire.RUN_CONFIG) == token:
                content[wire.CONFIG] = ConfigRecord({k: v for k, v in config.items() if k != wire.RUN_CONFIG})
                downlink[f"{wire.CACHED_RECORD}{wire.RUN_CONFIG}"] = token
        content[wire.DOWNLINK] = ConfigRecord(downlink)
        self._sent[node] = sent
        message.content = content
        return message

    def _advance(self, target: dict[str, np.ndarray], ratio: float, mode: str, beta: float = 0.0) -> None:
        """P_{t-1} -> P_t toward ``target`` (G_t): a step (``ratio`` of the gap's coordinates,
        quantised by ``mode``, from the prediction ``P_{t-1} + beta v_{t-1}``) over the arrays
        whose shape is unchanged; arrays that are new or changed shape (a grown head) go
        whole, with no velocity."""
        previous = self.broadcast or {}
        kept = [k for k in target if k in previous and previous[k].shape == target[k].shape]
        whole = [k for k in target if k not in kept]
        step = None
        # steps whenever the downlink compresses (a sync step included: ratio 1, self.ratio < 1)
        if kept and set(previous) <= set(target) and _is_float_model(target) and self.ratio < 1:
            held = {k: previous[k] for k in kept}
            try:
                step, moved = step_toward(predicted(held, self.velocity, beta), {k: target[k] for k in kept}, ratio, mode)
            except ValueError:  # a non-finite gap: send the model whole
                step = None
        if step is None:
            base, whole = "", []
            self.broadcast = {k: np.array(v, copy=True) for k, v in target.items()}
            self.velocity = None
        else:
            base = digest(previous)
            self.broadcast = {k: moved[k] if k in moved else np.array(target[k], copy=True) for k in target}
            self.velocity = moved_by(held, moved) if self.momentum else None
        self._step = (base, step, whole, digest(self.broadcast))
        self._gap = {k: (target[k].astype(np.float32) - self.broadcast[k]) for k in target if target[k].dtype.kind == "f"}

    # -------------------------------------------------------------- replies
    def __call__(self, instruction: Message, reply: Message) -> Message:
        node = instruction.metadata.dst_node_id
        if not reply.has_error() and wire.DOWNLINK in reply.content.config_records:
            held = reply.content.config_records[wire.DOWNLINK].get(wire.TOKEN)
            if node in self._sent and held == self._sent[node][wire.ARRAYS]:
                self._answered.add(node)  # it rebuilt the model it was sent and keeps it
            content = RecordDict({k: v for k, v in reply.content.items() if k != wire.DOWNLINK})
            reply = Message(content, reply_to=instruction)  # every strategy sees the same records
        if not reply.has_error():
            try:
                reply = _with_unpacked(reply)
            except PayloadError as err:
                return Message(Error(code=STALE_DOWNLINK, reason=f"rejected packed record: {err}"), reply_to=instruction)
        dense = not reply.has_error() and wire.ARRAYS in reply.content.array_records
        reply = self.inner(instruction, reply)  # a sparse reply becomes G_t + delta here
        if not dense or reply.has_error() or node not in self._sent:
            return reply
        gap = self._gap  # the round's G_t - P_t
        # A dense reply holds P_t + delta (the site trained from P_t); the strategy expects G_t + delta.
        weights = numpy_arrays(reply.content[wire.ARRAYS])
        rebased = {k: (w + gap[k]).astype(w.dtype) if k in gap else w for k, w in weights.items()}
        content = RecordDict(dict(reply.content.items()))
        content[wire.ARRAYS] = array_record(rebased)
        return Message(content, reply_to=instruction)

    def settle(self, accepted: set[int]) -> None:
        """Sites that answered (even if the screen then rejected their update) hold what
        they were sent; the others (an error reply, a time-out) get everything whole next time."""
        self.inner.settle(accepted)
        for node, sent in self._sent.items():
            if node in self._answered:
                self.held[node] = sent
        # A site that did not answer (off the network, failed) may still hold its older copy:
        # it gets a step next time, and if it refuses it (STALE_DOWNLINK) the whole model at
        # once, in the same round (resend).
        self._sent, self._answered, self._init_sent = {}, set(), set()

    def resend(self, message: Message) -> Message:
        """The message of a site that refused a step (:meth:`wants`), with everything whole."""
        node = message.metadata.dst_node_id
        self.held.pop(node, None)
        self._no_init.add(node)
        self._init_sent.discard(node)
        return self.prepare(message)

    def refused(self, node: int, reply: Message) -> bool:
        """Whether an error reply means the site could not use what it was sent: it says it
        does not hold the copy a message referred to, or it failed on a model it was to
        build itself (a plain Flower client reads ``arrays`` and finds none)."""
        return reply.error.code == STALE_DOWNLINK or node in self._init_sent


# ------------------------------------------------------------------ site side
def downlink_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower client mod: rebuild a compressed train message (the broadcast model from the
    site's copy plus the sparse step; cached records from the site's copies) before the
    site agent sees it, and keep the copies in ``context.state``."""
    if msg.metadata.message_type not in MODEL_MESSAGES or wire.DOWNLINK not in msg.content.config_records:
        return call_next(msg, context)
    try:
        msg = _rebuild(msg, context)
    except (PayloadError, StaleDownlink) as err:
        context.state.pop(BROADCAST, None)
        context.state.pop(VELOCITY, None)
        return Message(Error(code=STALE_DOWNLINK, reason=f"downlink: {err}; the server sends it whole next round"), reply_to=msg)
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    content = RecordDict(dict(reply.content.items()))
    for name, record in reply.content.array_records.items():  # e.g. a phase-end Fisher, focused
        if name != wire.ARRAYS and (packed := pack_sparse(numpy_arrays(record))) is not None:
            del content[name]
            content[f"{wire.SPARSE_RECORD}{name}"] = array_record(packed)
    # Confirm the model this site now holds: only then does the server send it steps (a
    # plain Flower client never confirms, and gets whole models).
    held = context.state.config_records[HELD][wire.ARRAYS]
    content[wire.DOWNLINK] = ConfigRecord({wire.TOKEN: held})
    return Message(content, reply_to=msg)


def _with_unpacked(message: Message) -> Message:
    """``message`` with every packed record (:func:`pack_sparse`) back in its dense form."""
    packed = [name for name in message.content.array_records if name.startswith(wire.SPARSE_RECORD)]
    if not packed:
        return message
    content = RecordDict({k: v for k, v in message.content.items() if k not in packed})
    for name in packed:
        content[name[len(wire.SPARSE_RECORD):]] = array_record(unpack_sparse(numpy_arrays(message.content[name])))
    message.content = content
    return message


class StaleDownlink(ValueError):
    """The message refers to a copy the site does not hold."""


def _rebuild(msg: Message, context: Context) -> Message:
    msg = _with_unpacked(msg)
    downlink = msg.content.config_records[wire.DOWNLINK]
    token = str(downlink[wire.TOKEN])
    content = RecordDict({k: v for k, v in msg.content.items()
                          if k not in (wire.DOWNLINK, wire.DOWNLINK_STEP, wire.DOWNLINK_WHOLE, wire.DOWNLINK_VELOCITY)})
    held_tokens = dict(context.state.config_records.get(HELD, ConfigRecord({})))
    if wire.DOWNLINK_BASE in downlink:
        base = str(downlink[wire.DOWNLINK_BASE])
        if BROADCAST not in context.state.array_records or held_tokens.get(wire.ARRAYS) != base:
            raise StaleDownlink(f"holds model {held_tokens.get(wire.ARRAYS)!r}, the step is from {base!r}")
        whole = numpy_arrays(msg.content[wire.DOWNLINK_WHOLE]) if wire.DOWNLINK_WHOLE in msg.content.array_records else {}
        order = [str(k) for k in downlink[wire.DOWNLINK_ORDER]]
        held = numpy_arrays(context.state[BROADCAST])
        if any(k not in held for k in order if k not in whole):
            raise StaleDownlink(f"the step covers arrays the held model lacks ({sorted(set(order) - set(held) - set(whole))})")
        stepped = {k: held[k] for k in order if k not in whole}
        velocity = numpy_arrays(context.state[VELOCITY]) if VELOCITY in context.state.array_records else None
        start = predicted(stepped, velocity, float(downlink.get(wire.DOWNLINK_MOMENTUM, 0.0)))
        moved = apply_step(start, from_record(msg.content[wire.DOWNLINK_STEP]))
        model = {k: whole[k] if k in whole else moved[k] for k in order}
        content[wire.ARRAYS] = array_record(model)
        velocity = moved_by(stepped, moved) if wire.DOWNLINK_MOMENTUM in downlink else None
    elif wire.DOWNLINK_INIT in downlink:
        from ..models import initial_state  # torch: only for this one message

        model = initial_state(**json.loads(str(downlink[wire.DOWNLINK_INIT])))
        content[wire.ARRAYS] = array_record(model)
        velocity = None
    else:
        model = numpy_arrays(msg.content[wire.ARRAYS])
        velocity = numpy_arrays(msg.content[wire.DOWNLINK_VELOCITY]) if wire.DOWNLINK_VELOCITY in msg.content.array_records else None
    if digest(model) != token:
        raise StaleDownlink(f"rebuilt model {digest(model)!r} != {token!r}")
    context.state[BROADCAST] = array_record(model)
    if velocity:
        context.state[VELOCITY] = array_record(velocity)
    else:
        context.state.pop(VELOCITY, None)
    held_tokens[wire.ARRAYS] = token
    cached_config = downlink.get(f"{wire.CACHED_RECORD}{wire.RUN_CONFIG}")
    config = dict(msg.content.config_records.get(wire.CONFIG, {}))
    if cached_config is not None:
        held_text = context.state.config_records.get(CACHED_RUN_CONFIG, {}).get(wire.RUN_CONFIG)
        if held_text is None or held_tokens.get(wire.RUN_CONFIG) != cached_config:
            raise StaleDownlink(f"holds no copy {cached_config!r} of the run config")
        content[wire.CONFIG] = ConfigRecord({**config, wire.RUN_CONFIG: held_text})
    elif wire.RUN_CONFIG in config:
        context.state[CACHED_RUN_CONFIG] = ConfigRecord({wire.RUN_CONFIG: str(config[wire.RUN_CONFIG])})
        held_tokens[wire.RUN_CONFIG] = text_digest(str(config[wire.RUN_CONFIG]))
    for key, value in downlink.items():
        if not key.startswith(wire.CACHED_RECORD) or key == f"{wire.CACHED_RECORD}{wire.RUN_CONFIG}":
            continue
        name = key[len(wire.CACHED_RECORD):]
        cached = context.state.array_records.get(CACHED_PREFIX + name)
        if cached is None or held_tokens.get(name) != value:
            raise StaleDownlink(f"holds no copy {value!r} of {name!r}")
        content[name] = cached
    for name, record in msg.content.array_records.items():  # keep copies of what came whole
        if name != wire.ARRAYS:
            context.state[CACHED_PREFIX + name] = record
            held_tokens[name] = digest(numpy_arrays(record))
    context.state[HELD] = ConfigRecord(held_tokens)
    msg.content = content  # same metadata: the reply still answers this message
    return msg
