"""Paillier-encrypted aggregation at the site: the client mod that sends the encrypted,
packed delta instead of weights (all of it, or with ``compression = "topk"`` its values on
the round's announced coordinate set; what was not sent — the coordinates off the set, the
clipped excess, the rounding error — is kept in an error-feedback residual and added to the
next update: :mod:`fedind.paillier.sparse`), and the query handler that decrypts the round's weighted
sum. The round and the server's half: :mod:`fedind.server.encrypted`; the maths:
:mod:`fedind.paillier.packing`; the key files: :mod:`fedind.paillier.keys`.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict

from .. import wire
from ..config import RunConfig
from .keys import KeyFileError, PrivateKey, load_private_key
from ..continual.expansion import HEAD_BIAS, HEAD_WEIGHT
from .sparse import SetFeedback, head_rows, indices_from_bytes, set_digest
from .sums import SIDE_SUM, encrypt_side
from .packing import (
    MIN_SITES,
    SIDE,
    SIDE_CLIP,
    CiphertextError,
    Layout,
    ObfuscatorPool,
    SumOutOfRange,
    decrypt_sum,
    encrypt_levels,
    parse_record,
)

PRIVATE_KEY_NODE_CONFIG = "paillier-private-key"  # node config: this site's private key file
REJECTED_CIPHERTEXT = wire.REJECTED_CIPHERTEXT  # the code's table: fedind.wire
SITE_KEY_MISSING = wire.SITE_KEY_MISSING  # the code's table: fedind.wire
SUM_OUT_OF_RANGE = wire.SUM_OUT_OF_RANGE  # the code's table: fedind.wire
RESIDUAL = "paillier-residual"  # context.state ArrayRecord {"residual": float32 [model size]}: SetFeedback's (sparse and dense rounds)


def announced(msg: Message, count: int) -> tuple[np.ndarray, str]:
    """The coordinate set of a sparse encrypted round's train instruction and its digest,
    recomputed here (CiphertextError when the record is malformed or names another set)."""
    record = msg.content.config_records.get(wire.PAILLIER_SET)
    if record is None:
        raise CiphertextError(f"compression = 'topk' under encryption but no {wire.PAILLIER_SET!r} record")
    try:
        indices = indices_from_bytes(record[wire.SET_INDICES], count)
    except (KeyError, ValueError) as err:
        raise CiphertextError(f"announced set: {err}") from None
    digest = set_digest(indices, count, int(msg.content[wire.CONFIG][wire.SERVER_ROUND]))
    if record.get(wire.SET_DIGEST) != digest:
        raise CiphertextError("announced set: the digest does not name the indices sent")
    return indices, digest


def _load_feedback(context: Context, config: RunConfig, layout: Layout, size: int) -> SetFeedback:
    """The site's residual; one of another model size (the head grew since) is dropped: what
    it delayed is lost once, where the plaintext residuals are padded row by row."""
    feedback = SetFeedback(config.paillier_clip, config.topk_residual_decay, layout)
    if RESIDUAL in context.state:
        residual = context.state[RESIDUAL]["residual"].numpy()
        if residual.size == size:
            feedback.load_state_dict({"residual": residual})
    return feedback


def site_private_key(context: Context, config: RunConfig) -> PrivateKey:
    """The site's key: node config ``paillier-private-key``, else run config's path."""
    path = str(context.node_config.get(PRIVATE_KEY_NODE_CONFIG, "") or config.paillier_private_key)
    if not path:
        raise KeyFileError(
            "encryption = 'paillier' but this site has no private key: set node config "
            f"{PRIVATE_KEY_NODE_CONFIG}='/path/paillier.key' (or run config paillier-private-key)"
        )
    return load_private_key(path)


def flat_delta(sent: Mapping, local: Mapping) -> np.ndarray:
    """``local - sent`` of every array, sorted by name, flattened (float64)."""
    return np.concatenate(
        [
            (np.asarray(local[name].numpy(), np.float64) - np.asarray(sent[name].numpy(), np.float64)).ravel()
            for name in sorted(sent)
        ]
    )


def holder_scaled(delta: np.ndarray, sent: Mapping, holders: Mapping, histogram) -> np.ndarray:
    """``delta`` with its head rows of the young classes (``holders``: from class ``from`` on)
    times this site's share of windows of each class (0 for a class it does not hold): the
    server divides their sum by the federation's (:meth:`fedind.server.encrypted.SecureAggregation._over_holders`),
    which makes them means over the holders without reading any one site's rows."""
    first = holders[wire.HOLDER_ROWS_FROM]
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"{wire.HOLDER_ROWS} {wire.HOLDER_ROWS_FROM} = {first!r}")
    counts = np.asarray(histogram, dtype=np.float64)
    shares = counts / counts.sum() if counts.sum() > 0 else np.zeros_like(counts)
    shapes = {name: tuple(a.shape) for name, a in sent.items()}
    rows, classes = head_rows(shapes, (HEAD_WEIGHT, HEAD_BIAS), first)
    padded = np.zeros(max(shares.size, int(classes.max(initial=-1)) + 1))
    padded[: shares.size] = shares
    out = np.array(delta, dtype=np.float64, copy=True)
    out[rows] *= padded[classes]
    return out


def model_size(arrays: Mapping) -> int:
    return int(sum(int(np.prod(a.shape)) for a in arrays.values()))


def rounding_rng(config: RunConfig, site_id: str, server_round: int, what: str) -> np.random.Generator:
    """The draws of the stochastic rounding of ``what`` (a record name) at one site in one
    round: from :meth:`RunConfig.site_seed`, so an encrypted run repeats bit for bit like a
    plaintext one. They hide nothing (the ciphertexts' obfuscators do, from OS entropy);
    they only keep the rounding unbiased."""
    return np.random.default_rng([config.site_seed(site_id, server_round), zlib.crc32(what.encode())])


def encrypted_side(context: Context, config: RunConfig, values: np.ndarray,
                   rng: np.random.Generator) -> tuple[ConfigRecord, int]:
    """A side vector (:mod:`fedind.paillier.sums`) encrypted under the site's key, rounded
    with ``rng``: the ConfigRecord and how many values were clipped; KeyFileError when the
    site has no key."""
    record, clipped = encrypt_side(values, site_private_key(context, config), rng)
    return ConfigRecord(record), clipped


def paillier_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower client mod: with ``encryption = "paillier"`` the train reply's weights become
    the encrypted, packed delta (obfuscators are drawn while the site trains)."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    config = RunConfig.from_json(str(msg.content[wire.CONFIG][wire.RUN_CONFIG]))
    if config.encryption != "paillier":
        return call_next(msg, context)
    try:
        key = site_private_key(context, config)
    except KeyFileError as err:
        return Message(Error(code=SITE_KEY_MISSING, reason=str(err)), reply_to=msg)
    sent = msg.content[wire.ARRAYS]
    indices, digest = None, ""
    if config.compression == "topk":
        try:
            indices, digest = announced(msg, model_size(sent))
        except CiphertextError as err:
            return Message(Error(code=REJECTED_CIPHERTEXT, reason=f"refused the train instruction: {err}"), reply_to=msg)
    layout = Layout.of(config)
    pool = ObfuscatorPool(key)
    pool.fill_async(layout.num_ciphertexts(key.public, model_size(sent) if indices is None else indices.size))
    reply = call_next(msg, context)
    if reply.has_error():
        pool.wait()
        return reply
    started = time.perf_counter()
    delta = flat_delta(sent, reply.content[wire.ARRAYS])
    holders = msg.content.config_records.get(wire.HOLDER_ROWS)
    if holders is not None:
        try:
            delta = holder_scaled(delta, sent, holders, reply.content[wire.METRICS][wire.LABEL_HISTOGRAM])
        except (KeyError, TypeError, ValueError) as err:
            return Message(Error(code=REJECTED_CIPHERTEXT, reason=f"refused the train instruction: {err}"), reply_to=msg)
    feedback = _load_feedback(context, config, layout, delta.size)  # dense rounds too: the residual keeps the rounding error
    rng = rounding_rng(config, str(reply.content[wire.SITE][wire.SITE_ID]),
                       int(msg.content[wire.CONFIG][wire.SERVER_ROUND]), wire.ENCRYPTED_UPDATE)
    levels, clipped = feedback.encode(delta, indices, rng)
    context.state[RESIDUAL] = ArrayRecord({"residual": Array(feedback.residual)})
    vector = encrypt_levels(levels, key, config.paillier_clip, pool, coordinates=digest, layout=layout)
    content = RecordDict({name: record for name, record in reply.content.items() if name != wire.ARRAYS})
    content[wire.ENCRYPTED_UPDATE] = ConfigRecord(vector.to_config(key.public))
    content[wire.METRICS][wire.ENCRYPT_SECONDS] = time.perf_counter() - started
    content[wire.METRICS][wire.CLIPPED_VALUES] = clipped
    return Message(content, reply_to=msg)


def decrypt_query(msg: Message, context: Context) -> Message:
    """ClientApp query handler: decrypt the server's ``encrypted-aggregate`` and return the
    weighted mean as ArrayRecord ``aggregate`` (``{"mean": float32 [count]}``): the round's
    delta, or with ``sum-of = "side"`` a side sum (:mod:`fedind.paillier.sums`), each
    checked against its own layout and clip. A sum honest sites cannot produce is refused
    with ``sum-out-of-range`` (nothing decoded)."""
    config = RunConfig.from_json(str(msg.content[wire.CONFIG][wire.RUN_CONFIG]))
    sum_of = msg.content[wire.CONFIG].get(wire.SUM_OF, "update")
    try:
        key = site_private_key(context, config)
        record = msg.content.config_records.get(wire.ENCRYPTED_AGGREGATE)
        if record is None:
            raise CiphertextError(f"query without a {wire.ENCRYPTED_AGGREGATE!r} record")
        if sum_of not in ("update", SIDE_SUM):
            raise CiphertextError(f"{wire.SUM_OF} = {sum_of!r}: expected 'update' or {SIDE_SUM!r}")
        layout, clip = (SIDE, SIDE_CLIP) if sum_of == SIDE_SUM else (Layout.of(config), config.paillier_clip)
        aggregate = parse_record(record, key.public, kind="aggregate", clip=clip, layout=layout)
        if aggregate.sites < MIN_SITES:  # defence in depth: it would be one site's update
            raise CiphertextError(f"an aggregate of {aggregate.sites} site(s) is not decrypted (minimum {MIN_SITES})")
        mean = decrypt_sum(aggregate, key)
    except KeyFileError as err:
        return Message(Error(code=SITE_KEY_MISSING, reason=str(err)), reply_to=msg)
    except SumOutOfRange as err:
        return Message(Error(code=SUM_OUT_OF_RANGE, reason=f"refused the decrypted sum: {err}"), reply_to=msg)
    except CiphertextError as err:
        return Message(Error(code=REJECTED_CIPHERTEXT, reason=f"refused to decrypt the aggregate: {err}"), reply_to=msg)
    return Message(RecordDict({wire.AGGREGATE: ArrayRecord({"mean": Array(mean)})}), reply_to=msg)
