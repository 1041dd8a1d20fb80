"""A Grid wrapper that counts what crosses the wire and who answered, round by round."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from flwr.app import Message, RecordDict
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp import Grid

from .. import wire


def payload_bytes(content: RecordDict) -> int:
    """Size of a message's content as serialized (protobuf) for transport."""
    return recorddict_to_proto(content).ByteSize()


@dataclass
class SiteReply:
    site_id: str
    node_id: int
    message_type: str
    metrics: dict


@dataclass
class Traffic:
    """What happened on the wire since the last ``take()``."""

    uplink_bytes: int = 0
    downlink_bytes: int = 0
    messages_sent: int = 0
    replies: list[SiteReply] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # "node <id>: <reason>"
    started: float = field(default_factory=time.monotonic)


class ReplyTransform(Protocol):
    """What :class:`MeteredGrid` does to a round's messages besides counting them."""

    def prepare(self, message: Message) -> Message:
        """Runs on every outgoing message, before its bytes are counted."""

    def __call__(self, instruction: Message, reply: Message) -> Message:
        """Runs on every reply after its bytes are counted (e.g. decoding a sparse update)."""

    def settle(self, accepted: set[int]) -> None:
        """Runs after the screen with the node ids whose replies were accepted."""

    # Optional: ``refused(node, error_reply) -> bool`` and ``resend(message) -> message``, a
    # message to send again within the round (fedind.topk.downlink: the whole model to a site
    # that could not use a step).


class PerReply:
    """A :class:`ReplyTransform` that only maps each reply: ``fn(instruction, reply) -> reply``."""

    def __init__(self, fn: Callable[[Message, Message], Message]) -> None:
        self._fn = fn

    def prepare(self, message: Message) -> Message:
        return message

    def __call__(self, instruction: Message, reply: Message) -> Message:
        return self._fn(instruction, reply)

    def settle(self, accepted: set[int]) -> None:
        pass


class MeteredGrid(Grid):
    """Delegates to a Flower ``Grid``; records payload bytes, replies and failures."""

    def __init__(
        self,
        grid: Grid,
        transform: ReplyTransform | None = None,
        screen: Callable[[dict[int, Message], list[Message]], list[Message]] | None = None,
    ) -> None:
        """``transform`` (a :class:`ReplyTransform`, e.g. :class:`fedind.topk.downlink.CompressedDownlink`
        or :class:`fedind.topk.uplink.EstimateUplink`) prepares every outgoing message and maps
        every reply on arrival (wire-level only); then ``screen(instructions by node, replies)
        -> replies`` sees the whole round (:class:`fedind.server.pipeline.ReplyPipeline`: each
        reply decoded once, validated, screened); then ``transform.settle`` learns which
        replies were accepted. An error reply either returns is a failure."""
        self._grid = grid
        self._transform = transform
        self._screen = screen
        self._traffic = Traffic()

    def take(self) -> Traffic:
        """Return the traffic recorded so far and start a new tally."""
        traffic, self._traffic = self._traffic, Traffic()
        return traffic

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        # The transform and the screen see each instruction as the strategy made it (dense
        # global arrays), whatever prepare() put on the wire in its place.
        originals = {message.metadata.dst_node_id: message for message in messages}
        if self._transform is not None:
            messages = [self._transform.prepare(_copy(message)) for message in messages]
        for message in messages:
            self._traffic.downlink_bytes += payload_bytes(message.content)
        self._traffic.messages_sent += len(messages)
        received = list(self._grid.send_and_receive(messages, timeout=timeout))
        # The grid stamps the message ids when it pushes, inside send_and_receive: only now
        # can replies be matched by id.
        by_id = {
            message.metadata.message_id: originals[message.metadata.dst_node_id]
            for message in messages
            if message.metadata.message_id
        }
        received = self._resend_refused(received, originals, by_id, timeout)
        replies, answered = [], set()
        for reply in received:
            # Match by message id (the grid stamps it when pushing): an error reply Flower
            # makes for an unreachable node does not come from that node's id.
            instruction = _instruction_of(reply, by_id, originals)
            if instruction is not None:
                answered.add(id(instruction))
            if not reply.has_error():
                self._traffic.uplink_bytes += payload_bytes(reply.content)
                if self._transform is not None and instruction is not None:
                    reply = self._transform(instruction, reply)
            replies.append(reply)
        if self._screen is not None:
            replies = self._screen(originals, replies)
        if self._transform is not None:
            self._transform.settle({reply.metadata.src_node_id for reply in replies if not reply.has_error()})
        for reply in replies:
            if reply.has_error():
                instruction = _instruction_of(reply, by_id, originals)
                node = instruction.metadata.dst_node_id if instruction is not None else reply.metadata.src_node_id
                self._traffic.failures.append(f"node {node}: {reply.error.reason}")
            else:
                self._traffic.replies.append(_describe(reply))
        for message in originals.values():
            if id(message) not in answered:
                self._traffic.failures.append(f"node {message.metadata.dst_node_id}: no reply (timeout)")
        # Arrival order is random; aggregating float32 in a fixed (site) order keeps runs
        # bit-identical for a seed.
        return sorted(replies, key=_reply_order)

    def _resend_refused(
        self, received: list[Message], originals: dict[int, Message], by_id: dict[str, Message], timeout: float | None
    ) -> list[Message]:
        """Replies the transform wants sent again within the round (``transform.resend``:
        e.g. the whole model to a site that no longer holds the copy a step was for) go out
        once more; their new replies take the place of the refusals."""
        resend, wants = getattr(self._transform, "resend", None), getattr(self._transform, "refused", None)
        if resend is None or wants is None:
            return received
        def node_of(reply: Message) -> int | None:
            instruction = by_id.get(reply.metadata.reply_to_message_id)
            return instruction.metadata.dst_node_id if instruction is not None else None

        refused = [r for r in received if r.has_error() and node_of(r) is not None and wants(node_of(r), r)]
        nodes = {node_of(r) for r in refused}
        if not nodes:
            return received
        again = [resend(_copy(originals[node])) for node in sorted(nodes)]
        for message in again:
            self._traffic.downlink_bytes += payload_bytes(message.content)
        self._traffic.messages_sent += len(again)
        second = list(self._grid.send_and_receive(again, timeout=timeout))
        by_id.update({m.metadata.message_id: originals[m.metadata.dst_node_id] for m in again if m.metadata.message_id})
        return [r for r in received if r not in refused] + second

    # Plain delegation below.
    def set_run(self, run) -> None:
        self._grid.set_run(run)

    @property
    def run(self):
        return self._grid.run

    def create_message(self, *args, **kwargs) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def get_nodes(self):
        return self._grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)


def _copy(message: Message) -> Message:
    """A message with the same metadata and a shallow copy of the content, for prepare()
    to rewrite (strategies share one RecordDict between the round's messages)."""
    return Message(RecordDict(dict(message.content.items())), dst_node_id=message.metadata.dst_node_id,
                   message_type=message.metadata.message_type, group_id=message.metadata.group_id, ttl=message.metadata.ttl)


def site_id_of(reply: Message) -> str:
    """The site's id from its ``site`` ConfigRecord, else ``node-<node id>``."""
    site = reply.content.config_records.get(wire.SITE) if reply.has_content() else None
    if site is not None and wire.SITE_ID in site:
        return str(site[wire.SITE_ID])
    return f"node-{reply.metadata.src_node_id}"


def _instruction_of(reply: Message, by_id: dict[str, Message], by_node: dict[int, Message]) -> Message | None:
    """The message ``reply`` answers: by message id (the grid stamps it when pushing),
    else — ids not stamped, as with a stand-in grid in unit tests — by the replying node."""
    if by_id:
        return by_id.get(reply.metadata.reply_to_message_id)
    return by_node.get(reply.metadata.src_node_id)


def _reply_order(reply: Message) -> tuple:
    if reply.has_error():
        return (1, "", reply.metadata.src_node_id)
    return (0, site_id_of(reply), reply.metadata.src_node_id)


def _describe(reply: Message) -> SiteReply:
    metrics = next(iter(reply.content.metric_records.values()), None)
    return SiteReply(
        site_id=site_id_of(reply),
        node_id=reply.metadata.src_node_id,
        message_type=reply.metadata.message_type,
        metrics=dict(metrics) if metrics is not None else {},
    )
