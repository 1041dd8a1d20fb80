"""Persistent site state (fedind.site.state): round trip, the mod around topk_mod, corruption."""

import json
import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from fedind import wire
from fedind.topk.codec import decode, expected_of, from_record
from fedind.config import RunConfig
from fedind.site.state import (
    RUN_RECORD,
    CorruptStateError,
    decode_state,
    encode_state,
    load_state,
    run_scope_mod,
    save_state,
    state_mod,
)
from fedind.store import MANIFEST
from fedind.topk.uplink import topk_mod

pytestmark = pytest.mark.usefixtures("flower_task_identity")

SHAPES = {"conv.weight": (8, 1, 16), "head.weight": (10, 32), "head.bias": (10,)}


def arrays(seed: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}


def instruction(global_arrays: dict, server_round: int, run_name: str = "line-trial") -> Message:
    run_config = RunConfig(compression="topk", topk_ratio=0.05, run_name=run_name).to_flower()
    content = RecordDict(
        {
            wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in global_arrays.items()}),
            wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps(run_config), wire.SERVER_ROUND: server_round}),
        }
    )
    return Message(content, message_type=MessageType.TRAIN, dst_node_id=7)


def training(local: dict):
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


def context(state_dir=None, run_id: int = 1) -> Context:
    node_config = {} if state_dir is None else {"state-dir": str(state_dir)}
    return Context(run_id=run_id, node_id=7, node_config=node_config, state=RecordDict(), run_config={})


def agent(msg: Message, ctx: Context, local: dict) -> Message:
    """The ClientApp's mod chain: state_mod outermost, run_scope_mod, topk_mod, the handler."""
    return state_mod(msg, ctx, lambda m, c: run_scope_mod(m, c, lambda m2, c2: topk_mod(m2, c2, training(local))))


def sent(reply: Message, g: dict) -> dict:
    return decode(from_record(reply.content[wire.SPARSE_UPDATE]), expected_of(g))


def rich_state() -> RecordDict:
    return RecordDict(
        {
            "residuals": ArrayRecord(
                {
                    "w": Array(np.arange(12, dtype=np.float32).reshape(3, 4)),
                    "steps": Array(np.array([1, -2], dtype=np.int64)),
                    "mask": Array(np.array([True, False])),
                    "half": Array(np.array([0.5], dtype=np.float16)),
                    "scalar": Array(np.array(3.25, dtype=np.float64)),
                    "empty": Array(np.zeros((0, 4), dtype=np.float32)),
                }
            ),
            "counters": ConfigRecord(
                {"step": 3, "lr": 0.5, "name": "line-07", "blob": b"\x00\xff", "on": True,
                 "ints": [1, 2], "names": ["a", "b"], "flags": [True, False], "bad": float("nan")}
            ),
            "stats": MetricRecord({"loss": 0.25, "n": 4, "hist": [1, 2, 3], "fs": [0.5, float("inf")]}),
        }
    )


def assert_same_state(a: RecordDict, b: RecordDict) -> None:
    assert list(a.keys()) == list(b.keys())
    for name, record in a.items():
        other = b[name]
        assert type(record) is type(other), name
        assert list(record.keys()) == list(other.keys())
        for key, value in record.items():
            if isinstance(record, ArrayRecord):
                x, y = value.numpy(), other[key].numpy()
                assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), (name, key)
            else:
                assert type(value) is type(other[key]), (name, key)
                np.testing.assert_equal(value, other[key])


def test_every_record_type_round_trips_exactly():
    state = rich_state()
    assert_same_state(state, decode_state(*encode_state(state)))


def test_save_then_load_restores_the_state_and_keeps_one_generation(tmp_path):
    folder = tmp_path / "run-1"
    save_state(folder, rich_state(), {"message-type": "train", "server-round": 1})
    manifest = save_state(folder, rich_state(), {"message-type": "train", "server-round": 2})
    state, loaded = load_state(folder)
    assert_same_state(rich_state(), state)
    assert loaded == manifest and manifest["generation"] == 2
    assert [h["server-round"] for h in manifest["history"]] == [1, 2]
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "state-000002.json", "state-000002.safetensors"]


def test_a_restarted_agent_resumes_error_feedback_exactly_where_it_stopped(tmp_path):
    g = arrays(0)
    locals_ = [{k: v + arrays(r, 0.01)[k] for k, v in g.items()} for r in (1, 2, 3)]
    # Reference: one agent that never restarts.
    ref = context()
    reference = [sent(topk_mod(instruction(g, r + 1), ref, training(loc)), g) for r, loc in enumerate(locals_)]

    first = context(tmp_path)
    for r in range(2):
        agent(instruction(g, r + 1), first, locals_[r])
    restarted = context(tmp_path)  # a new SuperNode process: empty context.state
    reply = agent(instruction(g, 3), restarted, locals_[2])
    for name in g:
        np.testing.assert_array_equal(sent(reply, g)[name], reference[2][name])
    assert int(restarted.state["topk-state"]["step"]) == 3
    _, manifest = load_state(tmp_path / "run-1")
    assert manifest["restores"] == 1
    assert [h["server-round"] for h in manifest["history"]] == [1, 2, 3]


def test_without_restore_the_payload_would_differ(tmp_path):
    # The check above is not vacuous: a fresh agent sends something else in round 3.
    g = arrays(0)
    locals_ = [{k: v + arrays(r, 0.01)[k] for k, v in g.items()} for r in (1, 2, 3)]
    ref = context()
    reference = [sent(topk_mod(instruction(g, r + 1), ref, training(loc)), g) for r, loc in enumerate(locals_)]
    fresh = sent(topk_mod(instruction(g, 3), context(), training(locals_[2])), g)
    assert any(not np.array_equal(fresh[k], reference[2][k]) for k in g)


def test_a_new_run_starts_fresh(tmp_path):
    g = arrays(0)
    agent(instruction(g, 1), context(tmp_path, run_id=1), arrays(1))
    other = context(tmp_path, run_id=2)
    agent(instruction(g, 1), other, arrays(1))
    assert int(other.state["topk-state"]["step"]) == 1
    assert (tmp_path / "run-1").is_dir() and (tmp_path / "run-2").is_dir()


def test_another_fedind_run_in_the_same_flower_run_starts_from_empty_state():
    # fedind.simulation.simulate_many: one Flower run (one context per site), several fedind runs.
    g = arrays(0)
    ctx = context()
    for r in (1, 2):
        agent(instruction(g, r, run_name="first"), ctx, arrays(r))
    assert int(ctx.state["topk-state"]["step"]) == 2
    reply = agent(instruction(g, 1, run_name="second"), ctx, arrays(1))
    assert int(ctx.state["topk-state"]["step"]) == 1
    assert ctx.state[RUN_RECORD]["run"] == "runs/second"
    # ... and it sends what a fresh site sends.
    fresh = sent(agent(instruction(g, 1, run_name="second"), context(), arrays(1)), g)
    for name in g:
        np.testing.assert_array_equal(sent(reply, g)[name], fresh[name])


def test_state_saved_before_runs_were_recorded_is_kept():
    # A site upgraded mid-run restores state without the run record: it keeps its residuals.
    g = arrays(0)
    ctx = context()
    for r in (1, 2):
        topk_mod(instruction(g, r), ctx, training(arrays(r)))  # no run_scope_mod: no record
    assert RUN_RECORD not in ctx.state
    agent(instruction(g, 3), ctx, arrays(3))
    assert int(ctx.state["topk-state"]["step"]) == 3
    assert ctx.state[RUN_RECORD]["run"] == "runs/line-trial"


def test_the_site_agent_scopes_state_to_a_run_inside_state_mod():
    from fedind.site.app import app

    assert app._mods[:2] == [state_mod, run_scope_mod]  # Flower 1.42 keeps the mods list here


@pytest.mark.parametrize("damage", ["flip-array-byte", "truncate-json", "garbage-manifest", "delete-array-file"])
def test_corrupt_state_is_reported_not_loaded_and_the_site_starts_fresh(tmp_path, caplog, damage):
    g = arrays(0)
    agent(instruction(g, 1), context(tmp_path), arrays(1))
    folder = tmp_path / "run-1"
    array_file, json_file = folder / "state-000001.safetensors", folder / "state-000001.json"
    if damage == "flip-array-byte":
        data = bytearray(array_file.read_bytes())
        data[-1] ^= 0x01
        array_file.write_bytes(bytes(data))
    elif damage == "truncate-json":
        json_file.write_bytes(json_file.read_bytes()[:5])
    elif damage == "garbage-manifest":
        (folder / MANIFEST).write_text("{not json")
    else:
        array_file.unlink()
    with pytest.raises(CorruptStateError):
        load_state(folder)

    restarted = context(tmp_path)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        reply = agent(instruction(g, 2), restarted, arrays(2))
    assert not reply.has_error()
    assert "site state not loaded, starting fresh" in caplog.text
    assert int(restarted.state["topk-state"]["step"]) == 1  # fresh error feedback
    assert [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]  # kept for inspection
    _, manifest = load_state(folder)  # and a new, valid state was saved
    assert manifest["restores"] == 0 and manifest["generation"] == 1


def test_without_state_dir_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ctx = context()
    agent(instruction(arrays(0), 1), ctx, arrays(1))
    assert "topk-residuals" in ctx.state and not list(tmp_path.iterdir())


def test_a_relative_state_dir_is_an_error():
    with pytest.raises(ValueError, match="absolute"):
        agent(instruction(arrays(0), 1), context("relative/dir"), arrays(1))


def test_state_of_an_evaluate_message_is_saved_too(tmp_path):
    ctx = context(tmp_path)
    ctx.state["counters"] = ConfigRecord({"seen": 1})
    msg = Message(RecordDict({wire.CONFIG: ConfigRecord({"x": 1})}), message_type=MessageType.EVALUATE, dst_node_id=7)
    state_mod(msg, ctx, lambda m, c: Message(RecordDict(), reply_to=m))
    state, manifest = load_state(tmp_path / "run-1")
    assert state["counters"]["seen"] == 1
    assert manifest["history"][-1]["message-type"] == MessageType.EVALUATE
    assert manifest["history"][-1]["server-round"] is None


def test_the_site_agent_runs_state_mod_outermost():
    # Inner mods (topk_mod's residuals, ...) write context.state after their call_next;
    # only the outermost mod sees and saves all of it.
    from fedind.site.app import app

    assert app._mods[0] is state_mod  # Flower 1.42 keeps the mods list here


def test_a_restarted_agent_keeps_its_ef21_estimate_in_step_with_the_server(tmp_path):
    from fedind.topk.uplink import EstimateUplink

    def ef21_instruction(g: dict, server_round: int) -> Message:
        msg = instruction(g, server_round)
        config = RunConfig(compression="topk", topk_ratio=0.05, topk_feedback="estimate").to_flower()
        msg.content[wire.CONFIG][wire.RUN_CONFIG] = json.dumps(config)
        return uplink.prepare(msg)

    uplink, g = EstimateUplink(), arrays(0)
    local = {k: v + arrays(1, 0.01)[k] for k, v in g.items()}
    first = context(tmp_path)
    for r in (1, 2):
        msg = ef21_instruction(g, r)
        uplink.decode(msg, agent(msg, first, local))
        uplink.settle({7})
    restarted = context(tmp_path)  # a new SuperNode process: the estimate comes back from disk
    msg = ef21_instruction(g, 3)
    reply = agent(msg, restarted, local)
    assert reply.content[wire.TOPK_ESTIMATE][wire.TOKEN] == msg.content[wire.TOPK_ESTIMATE][wire.TOKEN] != ""
    uplink.decode(msg, reply)  # raises PayloadError if the estimates were out of step
