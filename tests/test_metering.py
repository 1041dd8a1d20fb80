"""The metering grid: bytes, replies and failures per round, matched to the right site."""

import pytest
from flwr.app import ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from fedind import wire
from fedind.server.metering import MeteredGrid

pytestmark = pytest.mark.usefixtures("flower_task_identity")


def pushed(node: int) -> Message:
    """A train instruction as a Flower grid leaves it after pushing: with a message id."""
    msg = Message(RecordDict({wire.CONFIG: ConfigRecord({})}), message_type=MessageType.TRAIN, dst_node_id=node)
    msg.metadata.__dict__["_message_id"] = f"id-{node}"
    return msg


def answer(msg: Message, site: str) -> Message:
    content = RecordDict(
        {wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 3}), wire.SITE: ConfigRecord({wire.SITE_ID: site})}
    )
    return Message(content, reply_to=msg)


class FixedReplies:
    def __init__(self, replies):
        self.replies = replies

    def send_and_receive(self, messages, *, timeout=None):
        return self.replies


def test_an_unreachable_site_is_one_failure_even_when_flower_answers_for_it():
    """Flower's error reply for an unreachable node comes from another node id (the
    SuperLink's); matched by message id it is that site's one failure, not also a timeout."""
    a, b, c = pushed(11), pushed(12), pushed(13)
    unreachable = Message(Error(code=2, reason="node unavailable"), reply_to=c)
    unreachable.metadata.__dict__["_src_node_id"] = 1
    grid = MeteredGrid(FixedReplies([answer(a, "line-a"), answer(b, "line-b"), unreachable]))
    grid.send_and_receive([a, b, c])
    traffic = grid.take()
    assert traffic.failures == ["node 13: node unavailable"]
    assert [r.site_id for r in traffic.replies] == ["line-a", "line-b"]


def test_a_site_that_never_answers_is_a_timeout():
    a, b = pushed(11), pushed(12)
    grid = MeteredGrid(FixedReplies([answer(a, "line-a")]))
    grid.send_and_receive([a, b])
    assert grid.take().failures == ["node 12: no reply (timeout)"]


def test_replies_come_back_in_site_order_whatever_the_arrival_order():
    a, b, c = pushed(11), pushed(12), pushed(13)
    grid = MeteredGrid(FixedReplies([answer(c, "line-c"), answer(a, "line-a"), answer(b, "line-b")]))
    out = grid.send_and_receive([a, b, c])
    assert [r.content[wire.SITE][wire.SITE_ID] for r in out] == ["line-a", "line-b", "line-c"]
    traffic = grid.take()
    assert traffic.messages_sent == 3 and traffic.uplink_bytes > 0 and traffic.downlink_bytes > 0


def test_every_fedind_error_code_is_distinct_and_above_flowers():
    """One table (fedind.wire): a reply's code names one cause."""
    from fedind.paillier import site
    from fedind.server import encrypted, screening
    from fedind.topk import downlink, uplink

    codes = [wire.REJECTED_PAYLOAD, wire.REJECTED_CIPHERTEXT, wire.SITE_KEY_MISSING, wire.STALE_DOWNLINK,
             wire.REJECTED_UPDATE, wire.SITE_ABSENT, wire.SUM_OUT_OF_RANGE]
    assert len(set(codes)) == len(codes) == len(wire.ERROR_CODES) and min(codes) > 1000
    assert (uplink.REJECTED_PAYLOAD, encrypted.REJECTED_CIPHERTEXT, site.SITE_KEY_MISSING, downlink.STALE_DOWNLINK,
            screening.REJECTED_UPDATE) == tuple(codes[:5])
    assert site.REJECTED_CIPHERTEXT == encrypted.REJECTED_CIPHERTEXT and site.SUM_OUT_OF_RANGE == codes[6]
