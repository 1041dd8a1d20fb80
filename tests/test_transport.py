"""Sparse updates on the wire: the site mod and the server decoder, end to end without Ray."""

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from fedind import wire
from fedind.topk.codec import decode, expected_of, from_record
from fedind.config import RunConfig
from fedind.server.metering import payload_bytes
from fedind.server.pipeline import Rejected, decode_reply
from fedind.topk.codec import PayloadError
from fedind.topk.uplink import REJECTED_PAYLOAD, EstimateUplink, RoundBudget, TopkUplink, topk_mod

pytestmark = pytest.mark.usefixtures("flower_task_identity")

SHAPES = {"conv.weight": (32, 3, 64), "head.weight": (10, 128), "head.bias": (10,)}


def arrays(seed: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}


def instruction(global_arrays: dict, server_round: int = 1, **config) -> Message:
    run_config = RunConfig(**config).to_flower()
    content = RecordDict(
        {
            wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in global_arrays.items()}),
            wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps(run_config), wire.SERVER_ROUND: server_round}),
        }
    )
    return Message(content, message_type=MessageType.TRAIN, dst_node_id=7)


def site_training(local: dict):
    """A stand-in for the ClientApp's train handler: reply with these local weights."""

    def call_next(msg: Message, context: Context) -> Message:
        content = RecordDict(
            {
                wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in local.items()}),
                wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: 100}),
                wire.SITE: ConfigRecord({wire.SITE_ID: "line-07"}),
            }
        )
        return Message(content, reply_to=msg)

    return call_next


def context() -> Context:
    return Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})


def test_without_compression_the_mod_passes_the_reply_through():
    g, local = arrays(0), arrays(1)
    reply = topk_mod(instruction(g, compression="none"), context(), site_training(local))
    assert wire.ARRAYS in reply.content.array_records
    assert wire.SPARSE_UPDATE not in reply.content.config_records


def test_sparse_reply_is_small_and_decodes_to_global_plus_sent_delta():
    g = arrays(0)
    local = {k: v + arrays(1, 0.01)[k] for k, v in g.items()}
    msg = instruction(g, compression="topk", topk_ratio=0.01, topk_warmup_rounds=0)
    ctx = context()
    reply = topk_mod(msg, ctx, site_training(local))
    assert wire.ARRAYS not in reply.content.array_records
    dense_bytes = payload_bytes(site_training(local)(msg, ctx).content)
    assert payload_bytes(reply.content) * 50 < dense_bytes
    assert reply.content[wire.METRICS][wire.COMPRESS_SECONDS] >= 0

    update = decode_reply(msg, reply, g, uplink=TopkUplink())
    sent = decode(from_record(reply.content[wire.SPARSE_UPDATE]), expected_of(g))
    total = sum(v.size for v in g.values())
    assert sum(int(np.count_nonzero(v)) for v in sent.values()) == round(0.01 * total)
    for name in g:
        np.testing.assert_allclose(update.weights[name], g[name] + sent[name], rtol=0, atol=1e-6)
    assert update.site_id == "line-07" and update.num_examples == 100


def test_gain_scales_the_decoded_delta_not_the_global_weights():
    g = arrays(0)
    local = {k: v + arrays(1, 0.01)[k] for k, v in g.items()}
    msg = instruction(g, compression="topk", topk_ratio=0.01, topk_warmup_rounds=0)
    reply = topk_mod(msg, context(), site_training(local))
    sent = decode(from_record(reply.content[wire.SPARSE_UPDATE]), expected_of(g))
    change = TopkUplink(gain=1.5).decode(msg, reply)
    for name in g:
        np.testing.assert_allclose(change[name], 1.5 * sent[name], rtol=0, atol=1e-6)


def test_error_feedback_residual_persists_in_context_state_across_rounds():
    g = arrays(0)
    local = {k: v + arrays(1, 0.01)[k] for k, v in g.items()}
    ctx = context()
    msg = instruction(g, compression="topk", topk_ratio=0.01, topk_warmup_rounds=0)
    first = decode(from_record(topk_mod(msg, ctx, site_training(local)).content[wire.SPARSE_UPDATE]), expected_of(g))
    residual = {k: v.numpy() for k, v in ctx.state["topk-residuals"].items()}
    # invariant: what was sent + what is kept == the update
    for name in g:
        np.testing.assert_allclose(first[name] + residual[name], local[name] - g[name], atol=1e-6)
    # Same update again: the carried residual changes what is sent.
    second = decode(from_record(topk_mod(msg, ctx, site_training(local)).content[wire.SPARSE_UPDATE]), expected_of(g))
    assert any(not np.array_equal(first[k], second[k]) for k in g)
    assert int(ctx.state["topk-state"]["step"]) == 2


def test_sparsity_warmup_sends_more_in_the_first_rounds_then_the_ratio():
    g = arrays(0)
    local = {k: v + arrays(1, 0.01)[k] for k, v in g.items()}
    total = sum(v.size for v in g.values())
    ctx = context()
    sent_counts = []
    for server_round in (1, 2, 3):
        msg = instruction(g, server_round, compression="topk", topk_ratio=0.01, topk_warmup_rounds=1)
        sent = decode(from_record(topk_mod(msg, ctx, site_training(local)).content[wire.SPARSE_UPDATE]), expected_of(g))
        sent_counts.append(sum(int(np.count_nonzero(v)) for v in sent.values()))
    assert sent_counts == [round(0.1 * total), round(0.01 * total), round(0.01 * total)]


@pytest.mark.parametrize("feedback", ["residual", "estimate"])
@pytest.mark.parametrize("server_round", [1, 2, 5])
def test_the_server_holds_every_reply_to_the_rounds_top_k_budget(server_round, feedback):
    """An honest reply at the warm-up schedule passes in every round; the same site
    sending its whole change in the sparse format (a dense change: what an attacker
    that wants to move every coordinate sends) is refused with the count and the budget."""
    g = arrays(0)
    local = {k: v + arrays(1, 0.01)[k] for k, v in g.items()}
    settings = {"compression": "topk", "topk_ratio": 0.01, "topk_warmup_rounds": 1, "topk_feedback": feedback}
    msg = instruction(g, server_round, **settings)
    schedule = RoundBudget(0.01, 1)

    def uplink():
        return EstimateUplink(schedule=schedule) if feedback == "estimate" else TopkUplink(schedule=schedule)

    honest = topk_mod(msg, context(), site_training(local))
    decode_reply(msg, honest, g, uplink=uplink())  # accepted
    dense = topk_mod(instruction(g, server_round, **(settings | {"topk_ratio": 1.0})), context(), site_training(local))
    total = sum(v.size for v in g.values())
    limit = round((0.1 if server_round == 1 else 0.01) * total)
    with pytest.raises(Rejected, match=f"over round {server_round}'s top-k budget of {limit} of {total}") as no:
        decode_reply(msg, dense, g, uplink=uplink())
    assert no.value.code == REJECTED_PAYLOAD
    assert TopkUplink().decode(msg, dense)  # without a schedule (ratio 1) every coordinate may move


def corrupt(reply: Message) -> Message:
    record = reply.content[wire.SPARSE_UPDATE]
    payload = bytearray(record["payload"])
    payload[-1] ^= 0xFF
    record["payload"] = bytes(payload[:-3])  # truncated
    return reply


def test_a_malformed_payload_is_rejected_with_its_code_and_the_fault():
    g = arrays(0)
    msg = instruction(g, compression="topk")
    reply = corrupt(topk_mod(msg, context(), site_training(arrays(1))))
    with pytest.raises(PayloadError):
        TopkUplink().decode(msg, reply)
    with pytest.raises(Rejected, match="rejected sparse update") as rejected:
        decode_reply(msg, reply, g, uplink=TopkUplink())
    assert rejected.value.code == REJECTED_PAYLOAD


@pytest.mark.parametrize(
    "key, value",
    [("topk-ratio", 0.0), ("topk-quantization", "fp8"), ("compression", "zip"), ("topk-warmup-rounds", -1),
     ("topk-feedback", "ef99")],
)
def test_invalid_compression_settings_fail_at_start(key, value):
    with pytest.raises(ValueError, match=key):
        RunConfig.from_flower({key: value})


# --------------------------------------------------------------------------- EF21 estimates


def estimate_round(uplink, ctx, g: dict, local: dict, server_round: int, corrupt_reply=None):
    """One round through EstimateUplink: prepare the instruction, the site's mod, decode,
    settle (the reply accepted unless decoding failed); ``out``: the estimate, or the PayloadError."""
    msg = uplink.prepare(instruction(g, server_round, compression="topk", topk_feedback="estimate",
                                     topk_ratio=0.02, topk_warmup_rounds=0))
    reply = topk_mod(msg, ctx, site_training(local))
    if corrupt_reply is not None:
        reply = corrupt_reply(reply)
    try:
        out = uplink.decode(msg, reply)
    except PayloadError as err:
        out = err
    uplink.settle(set() if isinstance(out, PayloadError) else {7})
    return msg, reply, out


def test_ef21_site_and_server_hold_the_same_estimate_and_it_tracks_a_steady_update():
    uplink, ctx, g = EstimateUplink(), context(), arrays(0)
    update = arrays(1, 0.01)
    local = {k: g[k] + update[k] for k in g}
    errors = []
    for server_round in range(1, 31):
        msg, reply, out = estimate_round(uplink, ctx, g, local, server_round)
        # The server's change for the site is its estimate, and the site holds that same estimate.
        site_estimate = {k: v.numpy() for k, v in ctx.state["topk-estimate"].items()}
        for name in g:
            np.testing.assert_array_equal(uplink.estimates[7][name], site_estimate[name])
            np.testing.assert_array_equal(out[name], site_estimate[name])
        # Round 1 starts from zeros; afterwards the site builds on the estimate the server names.
        held, base = msg.content[wire.TOPK_ESTIMATE][wire.TOKEN], reply.content[wire.TOPK_ESTIMATE][wire.TOKEN]
        assert (held, base) == ("", "") if server_round == 1 else (held != "" and base == held)
        errors.append(sum(float(np.linalg.norm(update[k] - site_estimate[k]) ** 2) for k in g) ** 0.5)
    # 2 % of the coordinates (int4) per round: the estimate of a steady Gaussian update
    # (no heavy tail for top-k to exploit) closes most of the gap within 30 rounds.
    assert errors[-1] < 0.25 * errors[0] and errors == sorted(errors, reverse=True)


def test_ef21_a_rejected_reply_makes_both_sides_start_again_from_zeros():
    uplink, ctx, g = EstimateUplink(), context(), arrays(0)
    local = {k: g[k] + arrays(1, 0.01)[k] for k in g}
    estimate_round(uplink, ctx, g, local, 1)
    estimate_round(uplink, ctx, g, local, 2, corrupt_reply=corrupt)  # payload rejected: estimate forgotten
    assert 7 not in uplink.estimates
    msg, reply, out = estimate_round(uplink, ctx, g, local, 3)
    assert msg.content[wire.TOPK_ESTIMATE][wire.TOKEN] == "" and reply.content[wire.TOPK_ESTIMATE][wire.TOKEN] == ""
    assert not isinstance(out, PayloadError) and 7 in uplink.estimates


def test_ef21_a_site_that_lost_its_state_restarts_from_zeros_and_an_unknown_base_is_rejected():
    uplink, g = EstimateUplink(), arrays(0)
    local = {k: g[k] + arrays(1, 0.01)[k] for k in g}
    estimate_round(uplink, context(), g, local, 1)
    # A fresh context (site restarted without its state) cannot build on the server's estimate.
    msg, reply, out = estimate_round(uplink, context(), g, local, 2)
    assert msg.content[wire.TOPK_ESTIMATE][wire.TOKEN] != "" and reply.content[wire.TOPK_ESTIMATE][wire.TOKEN] == ""
    assert not isinstance(out, PayloadError)

    def forged_base(reply):
        reply.content[wire.TOPK_ESTIMATE] = ConfigRecord({wire.TOKEN: "0123456789abcdef"})
        return reply

    _, _, out = estimate_round(uplink, context(), g, local, 3, corrupt_reply=forged_base)
    assert isinstance(out, PayloadError) and "estimate base" in str(out)
    assert 7 not in uplink.estimates  # rejected: forgotten, the next round starts from zeros


def test_ef21_instructions_get_their_own_token_without_touching_the_shared_content():
    uplink, g = EstimateUplink(), arrays(0)
    shared = instruction(g, compression="topk", topk_feedback="estimate").content
    messages = [Message(shared, message_type=MessageType.TRAIN, dst_node_id=n) for n in (7, 8)]
    prepared = [uplink.prepare(m) for m in messages]
    assert wire.TOPK_ESTIMATE not in shared.config_records
    assert all(p.content[wire.TOPK_ESTIMATE][wire.TOKEN] == "" for p in prepared)
    assert prepared[0].content[wire.ARRAYS] is shared[wire.ARRAYS]  # arrays are not copied
