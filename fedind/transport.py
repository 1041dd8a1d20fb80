"""How a site's update travels: a client mod that sends a top-k sparse delta instead of
dense weights, and the server-side decoder that turns it back into dense weights.

Site::   reply weights w_local  ->  delta = w_local - w_global  ->  ErrorFeedback.compress
         -> encode -> ConfigRecord ``sparse-update`` (no ArrayRecord on the wire)
Server:: decode against the w_global sent to that site -> ArrayRecord ``arrays`` =
         w_global + delta, so every strategy (Flower's or fedind's) aggregates as usual.
A payload that fails validation becomes an error reply with the reason: the strategy logs
it and drops that site for the round; nothing of it reaches the model.

The error-feedback residual is site state: it lives in the ClientApp's ``context.state``
(kept by Flower across rounds for the life of the SuperNode).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict

from . import wire
from .compression import (
    ErrorFeedback,
    PayloadError,
    decode,
    encode,
    expected_of,
    from_record,
    to_record,
    warmup_ratio,
)
from .config import RunConfig

RESIDUALS = "topk-residuals"  # context.state ArrayRecord: error-feedback residuals
FEEDBACK_STATE = "topk-state"  # context.state ConfigRecord: error-feedback step counter
REJECTED_PAYLOAD = 1001  # Error code of a site reply whose sparse payload was rejected


def _load_feedback(context: Context, config: RunConfig, seed: int) -> ErrorFeedback:
    feedback = ErrorFeedback(
        mode=config.topk_quantization, threshold=config.topk_threshold, seed=seed, decay=config.topk_residual_decay
    )
    if RESIDUALS in context.state:
        residuals = {k: v.numpy() for k, v in context.state[RESIDUALS].items()}
        feedback.load_state_dict({"residuals": residuals, "step": int(context.state[FEEDBACK_STATE]["step"])})
    return feedback


def _save_feedback(context: Context, feedback: ErrorFeedback) -> None:
    state = feedback.state_dict()
    context.state[RESIDUALS] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in state["residuals"].items()})
    context.state[FEEDBACK_STATE] = ConfigRecord({"step": int(state["step"])})


def topk_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower client mod: with ``compression = "topk"``, replace the train reply's dense
    weights by the top-k sparse, quantised delta (with error feedback)."""
    reply = call_next(msg, context)
    if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
        return reply
    config = RunConfig.from_json(str(msg.content[wire.CONFIG][wire.RUN_CONFIG]))
    if config.compression != "topk":
        return reply
    started = time.process_time()
    sent, local = msg.content[wire.ARRAYS], reply.content[wire.ARRAYS]
    delta = {name: local[name].numpy().astype(np.float32) - sent[name].numpy().astype(np.float32) for name in sent}
    feedback = _load_feedback(context, config, seed=config.seed + int(context.node_id % 2**31))
    server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])
    ratio = warmup_ratio(config.topk_ratio, server_round, config.topk_warmup_rounds)
    payload = encode(feedback.compress(delta, ratio))
    _save_feedback(context, feedback)
    content = RecordDict({name: record for name, record in reply.content.items() if name != wire.ARRAYS})
    content[wire.SPARSE_UPDATE] = to_record(payload)
    content[wire.METRICS][wire.COMPRESS_SECONDS] = time.process_time() - started
    return Message(content, reply_to=msg)


def densify_reply(instruction: Message, reply: Message) -> Message:
    """Server side: a reply carrying ``sparse-update`` becomes one carrying dense ``arrays``
    (the global weights sent to that site plus the decoded delta); a malformed payload
    becomes an error reply naming the fault. Other replies pass unchanged."""
    if reply.has_error() or wire.SPARSE_UPDATE not in reply.content.config_records:
        return reply
    sent = instruction.content[wire.ARRAYS]
    try:
        delta = decode(from_record(reply.content[wire.SPARSE_UPDATE]), expected_of(sent))
    except PayloadError as err:
        return Message(Error(code=REJECTED_PAYLOAD, reason=f"rejected sparse update: {err}"), reply_to=instruction)
    dense = ArrayRecord(
        {name: Array((sent[name].numpy() + delta[name]).astype(sent[name].numpy().dtype)) for name in sent}
    )
    content = RecordDict({name: record for name, record in reply.content.items() if name != wire.SPARSE_UPDATE})
    content[wire.ARRAYS] = dense
    return Message(content, reply_to=instruction)
