"""The compressed downlink: the server's transform and the site's mod, end to end without Ray."""

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from fedind import wire
from fedind.config import ConfigError, RunConfig
from fedind.topk.downlink import (
    BROADCAST,
    STALE_DOWNLINK,
    CompressedDownlink,
    apply_step,
    digest,
    downlink_mod,
    step_toward,
)
from fedind.server.metering import PerReply, payload_bytes

pytestmark = pytest.mark.usefixtures("flower_task_identity")

SHAPES = {"conv.weight": (32, 3, 64), "head.weight": (10, 128), "head.bias": (10,)}
NODE = 7


def arrays(seed: int, scale: float = 1.0, shapes=SHAPES) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.normal(size=s)).astype(np.float32) for k, s in shapes.items()}


def record(values: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in values.items()})


def train_message(global_arrays: dict, server_round: int, extra: dict | None = None) -> Message:
    content = RecordDict(
        {
            wire.ARRAYS: record(global_arrays),
            wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps({}), wire.SERVER_ROUND: server_round}),
            **{name: record(v) for name, v in (extra or {}).items()},
        }
    )
    return Message(content, message_type=MessageType.TRAIN, dst_node_id=NODE)


class Site:
    """What the site agent saw (the rebuilt message) and a reply: its weights + ``delta``."""

    def __init__(self) -> None:
        self.context = Context(run_id=1, node_id=NODE, node_config={}, state=RecordDict(), run_config={})
        self.seen: Message | None = None

    def answer(self, wire_message: Message, delta: dict) -> Message:
        def train(msg: Message, context: Context) -> Message:
            self.seen = msg
            weights = {k: msg.content[wire.ARRAYS][k].numpy() + delta[k] for k in delta}
            content = RecordDict({wire.ARRAYS: record(weights), wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 10})})
            return Message(content, reply_to=msg)

        return downlink_mod(wire_message, self.context, train)


def send(server: CompressedDownlink, message: Message) -> Message:
    """What MeteredGrid does: prepare a copy (the strategy's message stays dense)."""
    copy = Message(RecordDict(dict(message.content.items())), dst_node_id=NODE, message_type=MessageType.TRAIN)
    return server.prepare(copy)


def full_round(server: CompressedDownlink, site: Site, g: dict, server_round: int, extra: dict | None = None) -> Message:
    """One round the site answers: send, rebuild, reply unchanged, decode, settle."""
    message = train_message(g, server_round, extra)
    reply = server(message, site.answer(send(server, message), {k: np.zeros_like(v) for k, v in g.items()}))
    server.settle({NODE})
    return reply


def test_a_step_rebuilds_the_same_model_at_both_ends_and_error_feedback_closes_the_gap():
    held, target = arrays(0), arrays(1)
    gaps = []
    for _ in range(40):
        payload, moved = step_toward(held, target, ratio=0.1, mode="int8")
        rebuilt = apply_step(held, payload)
        assert digest(rebuilt) == digest(moved)  # the site's float32 sum is the server's
        held = moved
        gaps.append(sum(float(np.abs(target[k] - held[k]).sum()) for k in target))
    assert gaps[-1] < 0.05 * gaps[0]
    assert all(b <= a + 1e-3 for a, b in zip(gaps, gaps[1:]))


def test_sites_get_the_whole_model_first_then_small_steps_that_rebuild_the_broadcast_model():
    server, site = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05), Site()
    g1 = arrays(0)
    first = send(server, train_message(g1, 1))
    assert wire.ARRAYS in first.content.array_records
    reply = site.answer(first, arrays(9, 0.0))
    server(train_message(g1, 1), reply)
    server.settle({NODE})

    g2 = {k: v + arrays(2, 0.01)[k] for k, v in g1.items()}
    dense = train_message(g2, 2)
    second = send(server, dense)
    assert wire.ARRAYS not in second.content.array_records
    assert payload_bytes(second.content) * 10 < payload_bytes(dense.content)
    site.answer(second, arrays(9, 0.0))
    rebuilt = {k: v.numpy() for k, v in site.seen.content[wire.ARRAYS].items()}
    assert digest(rebuilt) == digest(server.broadcast)
    assert rebuilt["head.bias"].shape == (10,)


def test_a_dense_reply_trained_from_the_broadcast_model_is_rebased_onto_the_global_model():
    server, site = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05), Site()
    g1 = arrays(0)
    full_round(server, site, g1, 1)
    g2 = {k: v + arrays(2, 0.1)[k] for k, v in g1.items()}
    delta = arrays(3, 0.01)
    message = train_message(g2, 2)
    out = server(message, site.answer(send(server, message), delta))
    for k in g2:  # G_t + delta, not P_t + delta
        np.testing.assert_allclose(out.content[wire.ARRAYS][k].numpy(), g2[k] + delta[k], atol=1e-5)


def test_a_site_that_lost_its_copy_refuses_the_step_and_is_sent_the_whole_model_again():
    server, site = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05), Site()
    g = arrays(0)
    for server_round in (1, 2):
        full_round(server, site, g, server_round)
        g = {k: v + arrays(server_round, 0.01)[k] for k, v in g.items()}
    del site.context.state[BROADCAST]  # a restart without its state
    message = train_message(g, 3)
    stale = site.answer(send(server, message), arrays(9, 0.0))
    assert stale.has_error() and server.refused(NODE, stale)
    whole = server.resend(Message(RecordDict(dict(message.content.items())), dst_node_id=NODE,
                                  message_type=MessageType.TRAIN))
    assert wire.ARRAYS in whole.content.array_records
    reply = site.answer(whole, arrays(9, 0.0))
    assert not reply.has_error()
    server(message, reply)
    server.settle({NODE})
    assert wire.ARRAYS not in send(server, train_message({k: v + 0.01 for k, v in g.items()}, 4)).content.array_records


def test_a_site_back_after_missing_rounds_refuses_the_step_it_cannot_apply():
    server, site = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05), Site()
    g = arrays(0)
    full_round(server, site, g, 1)
    g = {k: v + 0.01 for k, v in g.items()}
    send(server, train_message(g, 2))  # round 2: the site is off the network, no reply
    server.settle(set())
    back = send(server, train_message({k: v + 0.01 for k, v in g.items()}, 3))
    assert wire.ARRAYS not in back.content.array_records  # a step: nothing whole while it is away
    refusal = site.answer(back, arrays(9, 0.0))
    assert refusal.has_error() and server.refused(NODE, refusal)


def test_records_the_site_holds_are_sent_once_and_restored_from_its_copy():
    server, site = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05), Site()
    g, fisher = arrays(0), {"f": np.arange(1000, dtype=np.float32)}
    message = train_message(g, 1, {wire.EWC_FISHER: fisher})
    server(message, site.answer(send(server, message), arrays(9, 0.0)))
    server.settle({NODE})
    message = train_message(g, 2, {wire.EWC_FISHER: fisher})
    on_wire = send(server, message)
    assert wire.EWC_FISHER not in on_wire.content.array_records
    site.answer(on_wire, arrays(9, 0.0))
    np.testing.assert_array_equal(site.seen.content[wire.EWC_FISHER]["f"].numpy(), fisher["f"])
    changed = {"f": fisher["f"] + 1}
    assert wire.EWC_FISHER in send(server, train_message(g, 3, {wire.EWC_FISHER: changed})).content.array_records


def test_a_grown_head_goes_whole_and_the_rest_of_the_model_as_a_step():
    server, site = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05), Site()
    g = arrays(0)
    full_round(server, site, g, 1)
    grown_shapes = dict(SHAPES, **{"head.weight": (11, 128), "head.bias": (11,)})
    grown = {**arrays(1, shapes=grown_shapes), "conv.weight": g["conv.weight"] + 0.01}
    on_wire = send(server, train_message(grown, 2))
    assert wire.ARRAYS not in on_wire.content.array_records
    assert set(on_wire.content[wire.DOWNLINK_WHOLE].keys()) == {"head.weight", "head.bias"}
    site.answer(on_wire, arrays(9, 0.0) | {"head.weight": np.zeros((11, 128), np.float32), "head.bias": np.zeros(11, np.float32)})
    rebuilt = {k: v.numpy() for k, v in site.seen.content[wire.ARRAYS].items()}
    assert list(rebuilt) == list(grown)
    assert digest(rebuilt) == digest(server.broadcast)
    np.testing.assert_array_equal(rebuilt["head.bias"], grown["head.bias"])


def test_downlink_config_is_checked():
    with pytest.raises(ConfigError, match="downlink-ratio"):
        RunConfig(downlink="topk", downlink_ratio=0.0)
    with pytest.raises(ConfigError, match="downlink"):
        RunConfig(downlink="gzip")


def test_mostly_zero_records_travel_packed_and_come_back_exactly():
    from fedind.topk.downlink import pack_sparse, unpack_sparse

    rng = np.random.default_rng(0)
    fisher = {"w": np.where(rng.random((64, 32)) < 0.1, rng.random((64, 32)), 0).astype(np.float32),
              "b": np.zeros(5, np.float32)}
    packed = pack_sparse(fisher)
    assert packed is not None and sum(v.nbytes for v in packed.values()) * 3 < sum(v.nbytes for v in fisher.values())
    back = unpack_sparse(packed)
    for name in fisher:
        np.testing.assert_array_equal(back[name], fisher[name])
    assert pack_sparse({"dense": rng.random(100).astype(np.float32)}) is None
    bad = dict(packed, **{"w.index": packed["w.index"][::-1].copy()})
    with pytest.raises(Exception, match="not increasing"):
        unpack_sparse(bad)


def test_a_focused_ewc_record_goes_packed_and_the_site_gets_it_dense():
    from fedind.continual.ewc import focus

    server, site = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05), Site()
    g = arrays(0)
    fisher, anchors = focus({k: np.abs(v) for k, v in arrays(5).items()}, g, keep=0.1)
    message = train_message(g, 1, {wire.EWC_FISHER: fisher, wire.EWC_ANCHORS: anchors})
    on_wire = send(server, message)
    assert wire.EWC_FISHER not in on_wire.content.array_records
    assert payload_bytes(on_wire.content) < 0.6 * payload_bytes(message.content)  # the model whole + 2 packed records
    site.answer(on_wire, arrays(9, 0.0))
    for name in g:
        np.testing.assert_array_equal(site.seen.content[wire.EWC_FISHER][name].numpy(), fisher[name])
        np.testing.assert_array_equal(site.seen.content[wire.EWC_ANCHORS][name].numpy(), anchors[name])


def test_the_run_config_text_is_sent_once_and_restored_from_the_sites_copy():
    server, site = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05), Site()
    g, text = arrays(0), json.dumps(RunConfig().to_flower())

    def with_config(server_round):
        message = train_message(g, server_round)
        message.content[wire.CONFIG] = ConfigRecord({wire.RUN_CONFIG: text, wire.SERVER_ROUND: server_round})
        return message

    message = with_config(1)
    server(message, site.answer(send(server, message), arrays(9, 0.0)))
    server.settle({NODE})
    on_wire = send(server, with_config(2))
    assert wire.RUN_CONFIG not in on_wire.content[wire.CONFIG]
    site.answer(on_wire, arrays(9, 0.0))
    assert site.seen.content[wire.CONFIG][wire.RUN_CONFIG] == text
    assert site.seen.content[wire.CONFIG][wire.SERVER_ROUND] == 2


def test_a_plain_flower_client_never_confirms_a_copy_and_gets_whole_models():
    server = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05)
    g = arrays(0)
    for server_round in (1, 2, 3):
        message = train_message(g, server_round)
        on_wire = send(server, message)
        assert wire.ARRAYS in on_wire.content.array_records  # whole every round
        local = {k: v.numpy() + 0.5 for k, v in on_wire.content[wire.ARRAYS].items()}  # no downlink mod
        reply = Message(RecordDict({wire.ARRAYS: record(local), wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 1})}),
                        reply_to=on_wire)
        out = server(message, reply)
        server.settle({NODE})
        for k in g:
            np.testing.assert_allclose(out.content[wire.ARRAYS][k].numpy(), g[k] + 0.5, atol=1e-5)
        g = {k: v + arrays(server_round, 0.01)[k] for k, v in g.items()}


def test_sites_build_the_initial_model_from_its_spec_and_a_mismatch_is_sent_whole():
    from fedind.models import initial_state

    spec = {"seed": 4, "in_channels": 1, "num_classes": 5, "width": 8}
    g = initial_state(**spec)
    server, site = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05, initial=(digest(g), spec)), Site()
    message = train_message(g, 1)
    on_wire = send(server, message)
    assert wire.ARRAYS not in on_wire.content.array_records and payload_bytes(on_wire.content) < 1000
    site.answer(on_wire, {k: np.zeros_like(v) for k, v in g.items()})
    assert digest({k: v.numpy() for k, v in site.seen.content[wire.ARRAYS].items()}) == digest(g)

    wrong = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05, initial=(digest(g), {**spec, "seed": 5}))
    other = Site()
    refusal = other.answer(send(wrong, message), {k: np.zeros_like(v) for k, v in g.items()})
    assert refusal.has_error() and wrong.refused(NODE, refusal)
    whole = wrong.resend(Message(RecordDict(dict(message.content.items())), dst_node_id=NODE,
                                 message_type=MessageType.TRAIN))
    assert wire.ARRAYS in whole.content.array_records


def test_a_calibration_query_is_sent_the_whole_gap_so_the_site_holds_the_global_model():
    """A train round leaves the site's copy lagging (a 5 % step); the calibration query's
    step is the whole gap in int8, so the model the site computes its features under is
    the global model up to that rounding, not the lagging copy."""
    server, site = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05), Site()
    g = arrays(0)
    full_round(server, site, g, 1)
    g = {k: v + arrays(2, 0.05)[k] for k, v in g.items()}
    full_round(server, site, g, 2)
    lag = max(float(np.abs(server.broadcast[k] - g[k]).max()) for k in g)
    query = Message(RecordDict(dict(train_message(g, 2).content.items())), dst_node_id=NODE,
                    message_type=wire.CALIBRATE)
    sent = server.prepare(Message(RecordDict(dict(query.content.items())), dst_node_id=NODE,
                                  message_type=wire.CALIBRATE))
    assert wire.ARRAYS not in sent.content.array_records  # a step, not the whole model
    site.answer(sent, {k: np.zeros_like(v) for k, v in g.items()})
    rebuilt = {k: v.numpy() for k, v in site.seen.content[wire.ARRAYS].items()}
    assert digest(rebuilt) == digest(server.broadcast)
    left = max(float(np.abs(rebuilt[k] - g[k]).max()) for k in g)
    assert left < lag / 50  # int8 rounding of the gap, against the train round's lag


def _drift(rounds: int, momentum: float, seed: int = 11) -> list[dict]:
    """A global model moving as heavy-ball steps do: each round's move mostly the last one."""
    rng = np.random.default_rng(seed)
    g, v, out = arrays(0), {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}, []
    for _ in range(rounds):
        v = {k: (momentum * v[k] + 0.01 * rng.normal(size=v[k].shape)).astype(np.float32) for k in v}
        g = {k: (g[k] + v[k]).astype(np.float32) for k in g}
        out.append(g)
    return out


def test_a_predicted_step_keeps_both_ends_equal_and_the_copy_closer_to_a_model_that_moves_with_momentum():
    """downlink-momentum: both ends move the copy by beta times its last move and the step
    corrects it; the site rebuilds the server's copy to the bit every round, and at the
    same step size the copy lags the global model less than with plain steps."""
    models = _drift(16, momentum=0.9)
    lags = {}
    for beta in (0.0, 0.5):
        server, site = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.2, mode="int4", momentum=beta), Site()
        lag = []
        for t, g in enumerate(models, 1):
            full_round(server, site, g, t)
            rebuilt = {k: v.numpy() for k, v in site.seen.content[wire.ARRAYS].items()}
            assert digest(rebuilt) == digest(server.broadcast)
            lag.append(np.sqrt(sum(float(np.sum((g[k] - server.broadcast[k]) ** 2)) for k in g)))
        lags[beta] = float(np.mean(lag[3:]))
    assert lags[0.5] < 0.8 * lags[0.0], lags


def test_a_site_sent_the_whole_model_gets_the_velocity_and_follows_the_next_predicted_steps():
    models = _drift(6, momentum=0.9)
    server = CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05, momentum=0.5)
    site = Site()
    for t, g in enumerate(models[:3], 1):
        full_round(server, site, g, t)
    late = Site()  # joins at round 4: the whole model and its velocity
    late.context.node_id = NODE
    server.held.pop(NODE)  # as if this node had never answered
    message = train_message(models[3], 4)
    sent = send(server, message)
    assert wire.ARRAYS in sent.content.array_records and wire.DOWNLINK_VELOCITY in sent.content.array_records
    server(message, late.answer(sent, {k: np.zeros_like(v) for k, v in models[3].items()}))
    server.settle({NODE})
    for t, g in enumerate(models[4:], 5):
        message = train_message(g, t)
        sent = send(server, message)
        assert wire.DOWNLINK_STEP in sent.content.config_records
        server(message, late.answer(sent, {k: np.zeros_like(v) for k, v in g.items()}))
        server.settle({NODE})
        rebuilt = {k: v.numpy() for k, v in late.seen.content[wire.ARRAYS].items()}
        assert digest(rebuilt) == digest(server.broadcast)
    lost = Site()  # holds the copy but not the velocity (restarted from a saved copy): refuses, then gets it whole
    lost.context.state[BROADCAST] = record(server.broadcast)
    lost.context.state["downlink-held"] = ConfigRecord({wire.ARRAYS: digest(server.broadcast)})
    message = train_message({k: v + 0.01 for k, v in models[-1].items()}, 7)
    reply = lost.answer(send(server, message), {k: np.zeros_like(v) for k, v in models[-1].items()})
    assert reply.has_error() and reply.error.code == STALE_DOWNLINK


def test_downlink_momentum_is_checked():
    with pytest.raises(ValueError, match="downlink momentum"):
        CompressedDownlink(PerReply(lambda i, r: r), ratio=0.05, momentum=1.0)
    with pytest.raises(ConfigError, match="downlink-momentum"):
        RunConfig(downlink="topk", downlink_momentum=-0.1)
