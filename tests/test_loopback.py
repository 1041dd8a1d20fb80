"""The in-process loopback grid (fedind.loopback): what it keeps of Flower's runtimes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from fedind.loopback import LoopbackGrid, loopback_node_ids, task_identity
from fedind.server.metering import MeteredGrid, payload_bytes


def echo_app() -> ClientApp:
    """Counts its calls in context.state, echoes the arrays doubled, fails on request,
    and draws from every global generator (which the server's must not see)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        calls = int(context.state.config_records.get("calls", ConfigRecord({"n": 0}))["n"]) + 1
        context.state["calls"] = ConfigRecord({"n": calls})
        random.random(), np.random.rand(), torch.rand(1)
        torch.manual_seed(12345)
        if msg.content["config"].get("fail", False):
            raise ValueError("asked to fail")
        arrays = msg.content["arrays"]
        arrays["w"] = Array(arrays["w"].numpy() * 2)  # the received copy only
        doubled = ArrayRecord({"w": Array(arrays["w"].numpy())})
        node = ConfigRecord({"partition": int(context.node_config["partition-id"]), "calls": calls,
                             "threads": torch.get_num_threads()})
        return Message(RecordDict({"arrays": doubled, "node": node}), reply_to=msg)

    return app


def train_message(node_id: int, fail: bool = False) -> Message:
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.arange(4, dtype=np.float32))}),
                          "config": ConfigRecord({"fail": fail})})
    return Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN)


@pytest.fixture
def grid():
    grid = LoopbackGrid(echo_app(), 3)
    with task_identity(grid.run.run_id):
        yield grid


def test_nodes_are_distinct_large_ids_ascending_with_the_partition(grid):
    nodes = list(grid.get_node_ids())
    assert nodes == sorted(nodes) == loopback_node_ids(3) and len(set(nodes)) == 3
    assert all(n > SUPERLINK_NODE_ID for n in nodes)
    assert [grid.contexts[n].node_config for n in nodes] == [
        {"partition-id": i, "num-partitions": 3} for i in range(3)
    ]


def test_replies_answer_their_message_and_the_server_keeps_its_own_copy(grid):
    nodes = list(grid.get_node_ids())
    sent = [train_message(n) for n in nodes]
    replies = list(grid.send_and_receive(sent, timeout=60))
    assert [r.metadata.reply_to_message_id for r in replies] == [m.metadata.message_id for m in sent]
    assert all(m.metadata.message_id for m in sent) and len({r.metadata.message_id for r in replies}) == 3
    assert [(r.metadata.src_node_id, r.metadata.dst_node_id) for r in replies] == [(n, SUPERLINK_NODE_ID) for n in nodes]
    assert [int(r.content["node"]["partition"]) for r in replies] == [0, 1, 2]
    for message, reply in zip(sent, replies):
        np.testing.assert_array_equal(message.content["arrays"]["w"].numpy(), np.arange(4))  # not doubled here
        np.testing.assert_array_equal(reply.content["arrays"]["w"].numpy(), 2 * np.arange(4))
    # MeteredGrid counts the bytes Flower would serialize
    metered = MeteredGrid(grid)
    message = train_message(nodes[0])
    metered.send_and_receive([message])
    assert metered.take().downlink_bytes == payload_bytes(message.content)


def test_context_state_persists_per_node_and_a_failed_call_leaves_it_as_it_was(grid):
    first, second, _ = grid.get_node_ids()
    calls = [int(r.content["node"]["calls"]) for r in grid.send_and_receive([train_message(first)])]
    calls += [int(r.content["node"]["calls"]) for r in grid.send_and_receive([train_message(first)])]
    [error] = grid.send_and_receive([train_message(first, fail=True)])
    calls += [int(r.content["node"]["calls"]) for r in grid.send_and_receive([train_message(first)])]
    assert calls == [1, 2, 3]  # the failed call's increment was dropped with its context
    assert int(next(iter(grid.send_and_receive([train_message(second)]))).content["node"]["calls"]) == 1
    assert error.has_error() and error.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert error.error.reason == "<class 'ValueError'>:<'asked to fail'>"
    assert error.metadata.src_node_id == first


def test_the_server_keeps_its_generators_and_threads(grid):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    torch.set_num_threads(1)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    [reply] = grid.send_and_receive([train_message(next(iter(grid.get_node_ids())))])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert int(reply.content["node"]["threads"]) == 1


def test_a_reply_slower_than_the_timeout_is_dropped_and_unknown_nodes_get_nothing(grid):
    node = next(iter(grid.get_node_ids()))
    assert list(grid.send_and_receive([train_message(node)], timeout=0.0)) == []
    assert list(grid.send_and_receive([train_message(12345)], timeout=1.0)) == []
    ids = list(grid.push_messages([train_message(node)]))  # push, then pull: delivered once
    assert len(list(grid.pull_messages(ids))) == 1 and list(grid.pull_messages(ids)) == []
