"""How a site's update travels: a client mod that sends a top-k sparse delta instead of
dense weights, and the server-side decoder that turns it back into dense weights.

Site::   reply weights w_local  ->  delta = w_local - w_global  ->  ErrorFeedback.compress
         -> encode -> ConfigRecord ``sparse-update`` (no ArrayRecord on the wire)
Server:: decode against the w_global sent to that site (:meth:`TopkUplink.decode`, called
         once per reply by :func:`fedind.server.pipeline.decode_reply`) -> the site's
         weights w_global + gain * delta, its typed update for every strategy.
A payload that fails validation is rejected with the reason (code ``REJECTED_PAYLOAD``,
by the pipeline): the server logs it and drops that site for the round; nothing of it
reaches the model.

The error-feedback residual is site state: it lives in the ClientApp's ``context.state``
(kept by Flower across rounds for the life of the SuperNode). With ``topk-feedback =
"estimate"`` (EF21) the site keeps an estimate of its update instead and sends the sparse
change of it; the server keeps the same estimate (:class:`EstimateUplink`) and aggregates it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from .. import wire
from ..records import array_record, numpy_arrays
from .codec import PayloadError, decode, encode, expected_of, from_record, to_record
from .feedback import ErrorFeedback, EstimateFeedback, decayed, estimate_token
from .selection import budget, warmup_ratio
from ..config import RunConfig

RESIDUALS = "topk-residuals"  # context.state ArrayRecord: error-feedback residuals
ESTIMATE = "topk-estimate"  # context.state ArrayRecord: the EF21 estimate of this site's update
FEEDBACK_STATE = "topk-state"  # context.state ConfigRecord: the compressor's step counter
REJECTED_PAYLOAD = wire.REJECTED_PAYLOAD  # the code's table: fedind.wire


def _load_feedback(context: Context, config: RunConfig, seed: int) -> ErrorFeedback | EstimateFeedback:
    if config.topk_feedback == "estimate":
        feedback = EstimateFeedback(mode=config.topk_quantization, threshold=config.topk_threshold, seed=seed,
                                    decay=config.topk_estimate_decay, allocation=config.topk_allocation)
        if ESTIMATE in context.state:
            estimate = numpy_arrays(context.state[ESTIMATE])
            feedback.load_state_dict({"estimate": estimate, "step": int(context.state[FEEDBACK_STATE]["step"])})
        return feedback
    feedback = ErrorFeedback(
        mode=config.topk_quantization, threshold=config.topk_threshold, seed=seed, decay=config.topk_residual_decay,
        allocation=config.topk_allocation,
    )
    if RESIDUALS in context.state:
        residuals = numpy_arrays(context.state[RESIDUALS])
        feedback.load_state_dict({"residuals": residuals, "step": int(context.state[FEEDBACK_STATE]["step"])})
    return feedback


def _save_feedback(context: Context, feedback: ErrorFeedback | EstimateFeedback) -> None:
    state = feedback.state_dict()
    key, arrays = (ESTIMATE, state["estimate"]) if "estimate" in state else (RESIDUALS, state["residuals"])
    context.state[key] = array_record(arrays)
    context.state[FEEDBACK_STATE] = ConfigRecord({"step": int(state["step"])})


def topk_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower client mod: with ``compression = "topk"``, replace the train reply's dense
    weights by the top-k sparse, quantised delta (with error feedback, or relative to the
    EF21 estimate the server says it holds)."""
    reply = call_next(msg, context)
    if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
        return reply
    config = RunConfig.from_json(str(msg.content[wire.CONFIG][wire.RUN_CONFIG]))
    if config.compression != "topk" or config.encryption != "none":  # encrypted: fedind.paillier.site sparsifies
        return reply
    started = time.process_time()
    sent, local = msg.content[wire.ARRAYS], reply.content[wire.ARRAYS]
    delta = {name: local[name].numpy().astype(np.float32) - sent[name].numpy().astype(np.float32) for name in sent}
    feedback = _load_feedback(context, config, seed=config.seed + int(context.node_id % 2**31))
    server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])
    ratio = warmup_ratio(config.topk_ratio, server_round, config.topk_warmup_rounds)
    content = RecordDict({name: record for name, record in reply.content.items() if name != wire.ARRAYS})
    if isinstance(feedback, EstimateFeedback):
        held = msg.content.config_records.get(wire.TOPK_ESTIMATE, {}).get(wire.TOKEN, "")
        sparse, base = feedback.compress(delta, ratio, server_token=str(held))
        content[wire.TOPK_ESTIMATE] = ConfigRecord({wire.TOKEN: base})
    else:
        sparse = feedback.compress(delta, ratio)
    _save_feedback(context, feedback)
    content[wire.SPARSE_UPDATE] = to_record(encode(sparse))
    content[wire.METRICS][wire.COMPRESS_SECONDS] = time.process_time() - started
    return Message(content, reply_to=msg)


class RoundBudget:
    """The top-k schedule the sites follow (run config ``topk-ratio``,
    ``topk-warmup-rounds``), as the server checks it: a reply that changes more coordinates
    than the round's :func:`~fedind.topk.selection.budget` is refused. Without the check a
    site could send a dense change in the sparse format and move every coordinate; with
    it, an attacker that knows every honest update of the round (the strongest setting of
    ``simulations/poisoning.py``) still moves at most the coordinates an honest site moves."""

    def __init__(self, ratio: float = 1.0, warmup_rounds: int = 0) -> None:
        warmup_ratio(ratio, 1, warmup_rounds)  # validates both
        self.ratio, self.warmup_rounds = float(ratio), int(warmup_rounds)

    def check(self, instruction: Message, change: dict[str, np.ndarray]) -> None:
        """PayloadError when ``change`` has more non-zero values than the round allows."""
        total = sum(int(d.size) for d in change.values())
        server_round = instruction.content.config_records.get(wire.CONFIG, {}).get(wire.SERVER_ROUND)
        if isinstance(server_round, bool) or not isinstance(server_round, int) or server_round < 1 or total < 1:
            return  # not a round instruction of a strategy (no budget to hold it to)
        limit = budget(warmup_ratio(self.ratio, server_round, self.warmup_rounds), total)
        sent = sum(int(np.count_nonzero(d)) for d in change.values())
        if sent > limit:
            raise PayloadError(
                f"{sent} changed values, over round {server_round}'s top-k budget of {limit} of {total}")


def _sent_change(instruction: Message, reply: Message, schedule: RoundBudget) -> dict[str, np.ndarray]:
    """The dense float32 arrays the reply's ``sparse-update`` payload carries, checked
    against the global arrays sent to that site and the round's budget; PayloadError
    naming the fault."""
    change = decode(from_record(reply.content[wire.SPARSE_UPDATE]), expected_of(instruction.content[wire.ARRAYS]))
    schedule.check(instruction, change)
    return change


class TopkUplink:
    """Server side of error-feedback top-k: :meth:`decode` turns a reply's payload into the
    dense change ``gain * delta`` to add to the global weights sent to that site.

    Why a gain (run config ``topk-gain``): a top-k reply carries only part of the site's
    update each round; the rest waits in its decaying residual and arrives rounds later or
    not at all, so training advances more slowly than with dense updates under the same
    round budget. Scaling every sparse delta alike is the same as a larger server learning
    rate for FedAvg-type strategies, and works with any strategy
    (docs/benchmarks has what it measured).

    Also the grid's transform (:class:`~fedind.server.metering.MeteredGrid`): nothing to
    add to outgoing messages, nothing to do to a reply on arrival, nothing to settle."""

    def __init__(self, gain: float = 1.0, schedule: RoundBudget | None = None) -> None:
        self.gain = float(gain)
        self.schedule = schedule or RoundBudget()

    def decode(self, instruction: Message, reply: Message) -> dict[str, np.ndarray]:
        """The dense float32 change ``gain * delta``; :class:`PayloadError` naming the fault."""
        scale = np.float32(self.gain)
        return {name: scale * d for name, d in _sent_change(instruction, reply, self.schedule).items()}

    def prepare(self, message: Message) -> Message:
        return message

    def __call__(self, instruction: Message, reply: Message) -> Message:
        return reply

    def settle(self, accepted: set[int]) -> None:
        pass


class EstimateUplink:
    """Server side of EF21 top-k (``topk-feedback = "estimate"``,
    :class:`~fedind.topk.feedback.EstimateFeedback`): one estimate of each site's update,
    by node id.

    - :meth:`prepare` (every outgoing train instruction): adds the token of the estimate
      held for that node (``""``: none, the site starts from zeros);
    - :meth:`decode` (every reply, once, by :func:`fedind.server.pipeline.decode_reply`):
      decodes the payload and adds it to the estimate the site says it used (zeros or the
      one held; any other base is rejected): the site's change is ``estimate``;
    - :meth:`settle` (after the round's screen): keeps the new estimates of accepted
      replies, forgets those of rejected ones, so a site whose update was screened out
      starts again from zeros next round rather than building on it.

    Not in the server checkpoint: after a resume every site restarts from zeros (one
    round of sparser, rougher estimates). Memory: one float32 model per site.
    """

    def __init__(self, decay: float = 1.0, schedule: RoundBudget | None = None) -> None:
        self.decay = float(decay)  # EstimateFeedback's decay: the sites use the same
        self.schedule = schedule or RoundBudget()
        self.estimates: dict[int, dict[str, np.ndarray]] = {}
        self._tokens: dict[int, str] = {}
        self._pending: dict[int, dict[str, np.ndarray]] = {}

    def prepare(self, message: Message) -> Message:
        if message.metadata.message_type != MessageType.TRAIN or wire.ARRAYS not in message.content.array_records:
            return message
        token = self._tokens.get(message.metadata.dst_node_id, "")
        # Strategies share one RecordDict between the round's messages: copy, then add.
        content = RecordDict(dict(message.content.items()))
        content[wire.TOPK_ESTIMATE] = ConfigRecord({wire.TOKEN: token})
        message.content = content
        return message

    def __call__(self, instruction: Message, reply: Message) -> Message:
        """As the grid's transform: nothing to do on arrival (the pipeline decodes)."""
        return reply

    def decode(self, instruction: Message, reply: Message) -> dict[str, np.ndarray]:
        """The site's new estimate (its change to the global weights); :class:`PayloadError`
        naming the fault (the estimate held for it is then forgotten)."""
        node = instruction.metadata.dst_node_id
        try:
            change = _sent_change(instruction, reply, self.schedule)
        except PayloadError:
            self._forget(node)
            raise
        base = reply.content.config_records.get(wire.TOPK_ESTIMATE, {}).get(wire.TOKEN)
        if base == "":
            estimate = change
        elif base is not None and base == self._tokens.get(node):
            held = decayed(self.estimates[node], self.decay)
            estimate = {name: held[name] + change[name] for name in change}
        else:
            held = self._tokens.get(node, "")
            self._forget(node)
            raise PayloadError(f"estimate base {base!r} is not the one held for this site ({held!r})")
        self._pending[node] = estimate
        return estimate

    def settle(self, accepted: set[int]) -> None:
        """Commit this round's estimates for the ``accepted`` node ids; drop the others'."""
        for node, estimate in self._pending.items():
            if node in accepted:
                self.estimates[node], self._tokens[node] = estimate, estimate_token(estimate)
            else:
                self._forget(node)
        self._pending = {}

    def _forget(self, node: int) -> None:
        self.estimates.pop(node, None)
        self._tokens.pop(node, None)
