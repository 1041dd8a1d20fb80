"""Fault injection: bad updates in a real simulation, a site killed mid-round in a deployment.

1. In-process simulation (the loopback runtime, fedind.loopback: the same ClientApp, mods
   and server, the sites called in this process): the site with partition-id 0
   sends a different bad update every round (NaN, +Inf, wrong shape, float64, int32, a
   sparse payload with an out-of-range index, a 1e6x scaled update, two lying label
   histograms, zero and 1000x inflated ``num-examples``). Each must be rejected by the
   server with the right reason; the model stays finite and is bit for bit the model of a
   run in which site 0 sends nothing at all (its train handler crashes every round): the
   bad updates had no influence whatever. The clean run (no attacker) says what losing
   site 0's update costs. About 20 s on 2 busy cores (three runs, no Ray start).
2. Deployment (``deployment`` marker, tests/deploy_harness.py; a scenario that runs in a thread
   from the end of collection, conftest.py, while the other tests run): three SuperNodes over TLS;
   one is SIGKILLed while it trains; the round ends at ``round-timeout`` with the other two,
   records the failure once and the run goes on; the agent, restarted once Flower counts
   it offline, takes part in the last round and scores the final global model. About
   2.5 minutes: Flower needs up to 60 s to see a silent node as offline, and every
   ClientApp message starts a process that imports torch.

Unit tests of the two fixes these runs led to: the screen's example-count rule and the
metering grid's matching of Flower's Node Unavailable replies.
"""

from __future__ import annotations

import csv
import json
import logging
import re
import shutil
import signal
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from safetensors.numpy import load_file

from fedind import wire
from fedind.site import app as agent
from fedind.topk.codec import PayloadError, decode, encode, expected_of, layout_fingerprint, to_record
from fedind.topk.feedback import ErrorFeedback
from fedind.topk.selection import SparseTensor
from fedind.config import RunConfig
from deploy_harness import BIN
from fedind.server.metering import MeteredGrid
from fedind.server.screening import UpdateScreen
from fedind.paillier.site import decrypt_query, paillier_mod
from fedind.simulation import simulate
from fedind.site.state import state_mod
from fedind.topk.uplink import topk_mod

# --------------------------------------------------------------------------- bad updates

# One kind per round, in this order; the reason the server must give for each.
ATTACKS: dict[str, str] = {
    "nan": "NaN/Inf values",
    "inf": "NaN/Inf values",
    "wrong-shape": "': shape (",
    "float64": "dtype float64 != global float32",
    "int32": "dtype int32 != global float32",
    "index-out-of-range": "out of range for numel",
    "scaled-1e6": "update norm",
    "histogram-sum": "label-histogram sums to",
    "histogram-negative": "counts must be non-negative",
    "num-examples-negative": "expected a whole number >= 0",
    "num-examples-inflated": "num-examples 5e+04 is an outlier",
}
CRASH = "crash"  # the train handler raises: the site sends no update at all


def out_of_range_payload(sent: dict[str, np.ndarray], trained: dict[str, np.ndarray]) -> bytes:
    """The site's honest top-k update (int8, 5 % of the coordinates), encoded, with one
    coordinate past the end of the last tensor: that tensor is encoded as if it were 8
    elements longer (its first two honest coordinates and index ``numel + 7``, so the
    delta-varint index block is the smaller and is chosen), then the header's layout
    fingerprint is overwritten with the real model's: only the index itself is wrong."""
    delta = {name: trained[name].astype(np.float32) - sent[name].astype(np.float32) for name in sent}
    sparse = dict(ErrorFeedback(mode="int8").compress(delta, 0.05))
    name = sorted(sparse)[-1]
    honest = sparse[name]
    sparse[name] = SparseTensor(
        shape=(honest.numel + 8,),
        indices=np.append(honest.indices[:2], honest.numel + 7),
        codes=np.append(honest.codes[:2], np.int8(1)),
        scale=honest.scale if honest.count else 1.0,
        mode="int8",
    )
    payload = bytearray(encode(sparse))
    payload[6:10] = struct.pack("<I", layout_fingerprint({n: a.shape for n, a in sent.items()}))
    return bytes(payload)


def corrupt(kind: str, msg: Message, reply: Message) -> Message:
    """The honest train ``reply`` to ``msg`` turned into a bad update of ``kind``."""
    sent = {k: v.numpy() for k, v in msg.content[wire.ARRAYS].items()}
    trained = {k: v.numpy() for k, v in reply.content[wire.ARRAYS].items()}
    metrics = dict(reply.content[wire.METRICS])
    arrays = dict(trained)
    first = next(n for n, a in trained.items() if np.issubdtype(a.dtype, np.floating) and a.size > 1)
    if kind in ("nan", "inf"):
        bad = trained[first].copy()
        bad.flat[0] = np.nan if kind == "nan" else np.inf
        arrays[first] = bad
    elif kind == "wrong-shape":
        arrays[first] = trained[first].reshape(-1)  # same values, flattened
    elif kind == "float64":
        arrays = {n: a.astype(np.float64) for n, a in trained.items()}
    elif kind == "int32":
        arrays = {n: np.round(a * 1000).astype(np.int32) for n, a in trained.items()}
    elif kind == "scaled-1e6":
        arrays = {n: (sent[n] + 1e6 * (trained[n] - sent[n])).astype(trained[n].dtype) for n in trained}
    elif kind == "histogram-sum":
        histogram = list(metrics[wire.LABEL_HISTOGRAM])
        histogram[0] += 5  # the site claims five windows more than num-examples
        metrics[wire.LABEL_HISTOGRAM] = histogram
    elif kind == "histogram-negative":
        histogram = list(metrics[wire.LABEL_HISTOGRAM])
        low, high = int(np.argmin(histogram)), int(np.argmax(histogram))
        shift = histogram[low] + 3
        histogram[low] -= shift  # -3 windows of one class ...
        histogram[high] += shift  # ... and the sum still equals num-examples
        metrics[wire.LABEL_HISTOGRAM] = histogram
    elif kind == "num-examples-negative":
        metrics[wire.NUM_EXAMPLES] = -1
    elif kind == "num-examples-inflated":  # 1000x the windows, and a histogram to match
        metrics[wire.NUM_EXAMPLES] = 1000 * metrics[wire.NUM_EXAMPLES]
        metrics[wire.LABEL_HISTOGRAM] = [1000 * c for c in metrics[wire.LABEL_HISTOGRAM]]
    elif kind != "index-out-of-range":
        raise ValueError(f"unknown attack {kind!r}")
    content = RecordDict({name: record for name, record in reply.content.items() if name not in (wire.ARRAYS, wire.METRICS)})
    content[wire.METRICS] = MetricRecord(metrics)
    if kind == "index-out-of-range":  # a sparse update instead of dense weights, as topk_mod sends
        content[wire.SPARSE_UPDATE] = to_record(out_of_range_payload(sent, trained))
    else:
        content[wire.ARRAYS] = ArrayRecord({n: Array(np.ascontiguousarray(a)) for n, a in arrays.items()})
    return Message(content, reply_to=msg)


@dataclass(frozen=True)
class FaultMod:
    """Client mod: at partition 0, the train reply of round ``r`` becomes a bad update of
    ``kinds[r - 1]`` (or, for :data:`CRASH`, the handler raises). Other sites, rounds past
    the list and evaluate messages pass unchanged."""

    kinds: tuple[str, ...]

    def __call__(self, msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN or int(context.node_config.get("partition-id", -1)) != 0:
            return call_next(msg, context)
        server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])
        kind = self.kinds[server_round - 1] if server_round <= len(self.kinds) else None
        if kind == CRASH:
            raise RuntimeError(f"site 0 crashes in round {server_round}")
        reply = call_next(msg, context)
        return corrupt(kind, msg, reply) if kind is not None and not reply.has_error() else reply


def faulty_app(kinds: tuple[str, ...]) -> ClientApp:
    """fedind's site agent (same handlers and mods) with :class:`FaultMod` inside state_mod."""
    app = ClientApp(mods=[state_mod, FaultMod(kinds), topk_mod, paillier_mod])
    app.train()(agent.train)
    app.evaluate()(agent.evaluate_global)
    app.query()(decrypt_query)
    return app


def test_the_out_of_range_payload_is_rejected_for_its_index_alone():
    rng = np.random.default_rng(0)
    sent = {"a.weight": rng.normal(size=(4, 3)).astype(np.float32), "b.bias": rng.normal(size=64).astype(np.float32)}
    trained = {n: a + rng.normal(scale=0.1, size=a.shape).astype(np.float32) for n, a in sent.items()}
    with pytest.raises(PayloadError, match="tensor 'b.bias': index 71 out of range for numel 64"):
        decode(out_of_range_payload(sent, trained), expected_of(sent))


# --------------------------------------------------------------------------- the count rule (unit)


def _screen_round(counts: list[int], **kwargs) -> list[Message]:
    """One screened round of honest-looking replies claiming ``counts`` examples (histograms to match)."""
    rng = np.random.default_rng(0)
    base = {"conv.weight": np.ones((4, 2, 3), np.float32), "head.bias": np.zeros(3, np.float32)}
    instructions, replies = {}, []
    for node, n in enumerate(counts, start=1):
        content = RecordDict({wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in base.items()})})
        instructions[node] = Message(content, message_type=MessageType.TRAIN, dst_node_id=node)
        trained = {k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}
        metrics = MetricRecord({wire.NUM_EXAMPLES: n, wire.LABEL_HISTOGRAM: [n - 2 * (n // 3), n // 3, n // 3]})
        replies.append(Message(RecordDict({wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in trained.items()}),
                                           wire.METRICS: metrics}), reply_to=instructions[node]))
    return UpdateScreen(num_classes=3, **kwargs)(instructions, replies)


@pytest.mark.usefixtures("flower_task_identity")
def test_an_inflated_example_count_is_rejected_even_with_a_matching_histogram():
    out = _screen_round([50, 61, 44, 50_000])
    assert [r.has_error() for r in out] == [False, False, False, True]
    assert out[-1].error.reason.startswith("rejected update: num-examples 5e+04 is an outlier (")
    # Honest quantity skew (up to 3.5x the median in the synthetic scenarios, 5x here) passes ...
    assert not any(r.has_error() for r in _screen_round([40, 140, 60, 80, 400]))
    # ... and so does everything with the rule off, or in a round of two.
    assert not any(r.has_error() for r in _screen_round([50, 61, 44, 50_000], count_rule=False))
    assert not any(r.has_error() for r in _screen_round([50, 50_000]))


# --------------------------------------------------------------------------- a dead node (unit)


class StampingGrid:
    """A stand-in grid that, like Flower's, stamps message ids when it pushes (inside
    send_and_receive); the SuperLink answers for ``dead`` with a Node Unavailable error
    from its own node id (1), as Flower 1.42 does once the node's heartbeat has lapsed."""

    def __init__(self, dead: int) -> None:
        self.dead = dead

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for i, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"pushed-{i}"
            if msg.metadata.dst_node_id == self.dead:
                error = Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Node Unavailable"), reply_to=msg)
                error.metadata.__dict__["_src_node_id"] = 1
                replies.append(error)
            else:
                metrics = MetricRecord({wire.NUM_EXAMPLES: 3})
                replies.append(Message(RecordDict({wire.METRICS: metrics}), reply_to=msg))
        return replies


@pytest.mark.usefixtures("flower_task_identity")
def test_a_node_flower_reports_unavailable_is_one_failure_not_also_a_timeout():
    """Regression: the metering grid matched replies by message id through a dict built
    before the grid had stamped the ids, so a real deployment counted a dead site twice
    (the SuperLink's Node Unavailable reply as "node 1" and the site as a timeout)."""
    grid = MeteredGrid(StampingGrid(dead=13))
    messages = [Message(RecordDict({wire.CONFIG: ConfigRecord({})}), message_type=MessageType.TRAIN, dst_node_id=n)
                for n in (11, 12, 13)]
    grid.send_and_receive(messages)
    traffic = grid.take()
    assert traffic.failures == ["node 13: Node Unavailable"]
    assert len(traffic.replies) == 2


# --------------------------------------------------------------------------- in a simulation


SMALL = dict(
    num_server_rounds=len(ATTACKS),
    num_sites=4,
    samples_per_site=60,
    local_epochs=1,
    batch_size=8,
    learning_rate=0.05,
    model_width=8,
    device="cpu",
    seed=0,
)


def read_rounds(folder: Path) -> list[dict[str, str]]:
    with open(folder / "rounds.csv", newline="") as f:
        return list(csv.DictReader(f))


class Failures(logging.Handler):
    """The server's "failed: node ...: reason" lines, by round (the server runs in this
    process during a simulation)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.by_round: dict[int, list[str]] = {}
        self._round = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("round ") and "/" in text.split()[1]:
            self._round = int(text.split()[1].split("/")[0])
        elif text.strip().startswith("failed: node"):
            self.by_round.setdefault(self._round, []).append(text.strip())


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    """Three runs on the same sites and seed: clean, site 0 sending bad updates, site 0 crashing."""
    run_dir = tmp_path_factory.mktemp("faults")
    flwr_logger = logging.getLogger("flwr")
    runs = {}
    for name, kinds in (
        ("clean", None),
        ("attacked", tuple(ATTACKS)),
        ("silent", (CRASH,) * len(ATTACKS)),
    ):
        handler = Failures()
        flwr_logger.addHandler(handler)
        started = time.monotonic()
        try:
            config = RunConfig(**SMALL, run_dir=str(run_dir), run_name=name)
            summary = simulate(config, client_app=faulty_app(kinds) if kinds else None, runtime="loopback")
        finally:
            flwr_logger.removeHandler(handler)
        runs[name] = {
            "summary": summary,
            "rows": read_rounds(run_dir / name),
            "failures": handler.by_round,
            "folder": run_dir / name,
            "seconds": time.monotonic() - started,
        }
    return runs


def test_every_bad_update_is_rejected_for_its_fault(fault_runs):
    run = fault_runs["attacked"]
    rows = run["rows"]
    assert [int(r["round"]) for r in rows] == list(range(1, len(ATTACKS) + 1))
    for row, (kind, reason) in zip(rows, ATTACKS.items()):
        assert (int(row["sites"]), int(row["failures"])) == (3, 1), (kind, row)
        [failure] = run["failures"][int(row["round"])]
        assert "rejected" in failure and reason in failure, (kind, failure)
    assert run["summary"]["totals"]["failures"] == len(ATTACKS)
    # Site 0 is honest at evaluation: it scores the final model like every other site.
    assert len(run["summary"]["per_site"]) == 4


def test_bad_updates_leave_no_trace_in_the_model(fault_runs):
    attacked, silent, clean = (fault_runs[k] for k in ("attacked", "silent", "clean"))
    model = load_file(attacked["folder"] / "model.safetensors")
    assert model and all(np.all(np.isfinite(a)) for a in model.values())
    # The round aggregates what arrived: exactly the model of the run in which site 0 sent
    # nothing (its ClientApp raised; Flower turns that into an error reply, one failure).
    assert all((int(r["sites"]), int(r["failures"])) == (3, 1) for r in silent["rows"])
    assert all(f"site 0 crashes in round {r}" in silent["failures"][r][0] for r in range(1, len(ATTACKS) + 1))
    assert attacked["summary"]["model_sha256"] == silent["summary"]["model_sha256"]
    assert [r["accuracy"] for r in attacked["rows"]] == [r["accuracy"] for r in silent["rows"]]
    # Versus the run without an attacker, only site 0's honest update is missing (measured:
    # final 0.225 attacked vs 0.204 clean; a 4-site, 11-round run is far from converged).
    assert all((int(r["sites"]), int(r["failures"])) == (4, 0) for r in clean["rows"])
    assert attacked["summary"]["final_accuracy"] >= clean["summary"]["final_accuracy"] - 0.05
    for name, run in fault_runs.items():
        print(f"{name}: final {run['summary']['final_accuracy']:.4f} best {run['summary']['best_accuracy']:.4f} "
              f"failures {run['summary']['totals']['failures']} in {run['seconds']:.1f} s")


# --------------------------------------------------------------------------- a site killed mid-round


SITES = ["line-00", "line-01", "line-02"]
# Each ClientApp message starts a process that imports torch: 15-20 s on 2 busy cores.
# Not longer: round 3 must still sample line-00 before Flower counts it offline (its Node
# Unavailable reply is how this test sees that); with 60 s it was already left out silently.
ROUND_TIMEOUT = 40.0
# What the server logs once Flower's SuperLink has marked a silent node offline (its
# heartbeat, every ~24 s, lapsed for 2 x 30 s): the Node Unavailable reply it makes for the
# node's pending instruction, or the strategy waiting for the node before sampling a round.
OFFLINE = ("Error: Node Unavailable", "Waiting for nodes to connect: 2 connected")


def killed_site_scenario(scenario) -> None:
    """SIGKILL line-00's SuperNode (and its ClientApp process) while it trains in round 2.
    The round ends at round-timeout (or when Flower reports the node unavailable, if that
    comes first) with the two other sites and records line-00 as failed, once. The agent is
    restarted as soon as Flower has marked it offline: Flower 1.42 refuses to re-activate a
    node it still counts as online (the restarted SuperNode exits with code 305, "Failed to
    activate SuperNode"). The restarted agent gets the same node id, trains again in the
    rounds and scores the final global model. While it is away, rounds go on with the
    sites connected (strategies sample from at least ``min-sites``, not from every site:
    before that fix a site that stayed away stalled the run between rounds). Ten rounds:
    with seven, a restart slowed by a loaded machine found the run over (CI, 2026-12-05)."""
    from fedind.data.sources import site_from_dir
    from fedind.models import FaultCNN
    from fedind.site.state import load_state
    from fedind.training import evaluate

    with scenario.step("killed") as notes:
        plant = scenario.plant(scenario.root / "plant")
        with plant:
            root, data = plant.root, plant.set_up(SITES, seed=1)
            nodes = {site: plant.start_supernode(site, data / "sites" / site) for site in SITES}
            plant.wait_online(list(nodes.values()))  # 3 SuperNodes online
            victim = nodes["line-00"]
            node_id = re.search(r"SuperNode ID: (\d+)", victim.text()).group(1)

            run_config = (
                f"data-root='{data}' run-dir='{root / 'runs'}' run-name='killed' num-server-rounds=10 local-epochs=1 "
                f"model-width=8 round-timeout={ROUND_TIMEOUT} phases=1 phase-rounds=0 replay-samples=0 ewc-lambda=0 head-calibration=false"
            )
            run = plant.start("flwr-run", [BIN / "flwr", "run", ".", plant.connection, "--stream", "--run-config", run_config])
            # Round 2's instruction reached line-00 and its ClientApp process is training: kill both.
            plant.wait_for(lambda: victim.text().count("Start `flwr-clientapp` process") >= 2, 240,
                           "line-00 training in round 2", run, every=0.05)
            plant.stop(victim, signal.SIGKILL)
            # at most its round-1 reply (under load that one can still be in flight when round 2,
            # past the round timeout, starts), never round 2's
            assert victim.text().count("Sent successfully") <= 1
            killed = time.monotonic()
            # 240 s: the streamed log lagged past 120 s once in CI under load; rounds.csv below
            # still checks that round 2 itself ended within the round timeout
            plant.wait_for(lambda: any(line in run.text() for line in OFFLINE), 240, "line-00 offline", run, every=1)
            offline_after = time.monotonic() - killed
            # A site that stays away does not stall the run: a round goes on with the other two.
            plant.wait_for(lambda: re.search(r"round ([3-9]|10)/10 .* sites 2  failed 0", run.text()), 120,
                           "a round without line-00", run, every=1)
            restarted = plant.start_supernode("line-00", data / "sites" / "line-00", name="supernode-line-00-restarted")

            assert run.popen.wait(timeout=300) == 0, run.text()[-4000:]
            log = run.text()
            assert "fedind run 'killed' finished: 10 rounds, 3 sites" in log
            folder = root / "runs" / "killed"
            rows = [(int(r["sites"]), int(r["failures"])) for r in read_rounds(folder)]
            seconds = [float(r["seconds"]) for r in read_rounds(folder)]
            # Round 2 went on with the two others and did not wait past round-timeout (the
            # HTTP grid polls every 3 s); later rounds sample the sites connected.
            assert rows[:2] == [(3, 0), (2, 1)] and (2, 0) in rows[2:], rows
            assert all(sites + failures <= 3 for sites, failures in rows), rows
            assert seconds[1] < ROUND_TIMEOUT + 5, seconds
            round_2 = log[log.index("[ROUND 2/10]"):log.index("[ROUND 3/10]")]
            assert re.search(rf"failed: node {node_id}: (no reply \(timeout\)|Error: Node Unavailable)", round_2), round_2
            # Every failure is line-00's, counted once (not also as "node 1", the SuperLink).
            failures = re.findall(r"failed: node (\d+):", log)
            assert set(failures) == {node_id} and len(failures) == sum(f for _, f in rows)

            # The restarted agent is the same node and trained again from the global arrays its
            # instructions carry (a ClientApp keeps no model between messages).
            assert f"SuperNode ID: {node_id}" in restarted.text()
            _, manifest = load_state(next(plant.state_dir("line-00").glob("run-*")))
            trains = [h["server-round"] for h in manifest["history"] if h["message-type"] == "train" and not h["reply-error"]]
            assert trains[0] == 1 and 2 not in trains and trains[-1] > 3, trains
            # It scored the final global model: the accuracy of that model on its test split here.
            summary = json.loads((folder / "summary.json").read_text())
            assert sorted(summary["per_site"]) == SITES
            state = {k: torch.from_numpy(v) for k, v in load_file(folder / "model.safetensors").items()}
            site = site_from_dir(str(data / "sites" / "line-00"))
            local = evaluate(FaultCNN.from_state_dict(state), site.test, torch.device("cpu"))
            assert abs(summary["per_site"]["line-00"]["accuracy"] - local.accuracy) <= 1 / local.num_examples
            notes.append(f"rounds {rows}, seconds {[round(x, 1) for x in seconds]}, offline {offline_after:.0f} s after the kill")


@pytest.mark.deployment
@pytest.mark.skipif(shutil.which("flower-superlink", path=str(BIN)) is None, reason="Flower CLIs not installed")
@pytest.mark.scenario(run=killed_site_scenario)  # runs in a thread from the end of collection (conftest.py)
def test_a_site_killed_mid_round_does_not_stall_the_round_and_rejoins(scenario):
    """:func:`killed_site_scenario`: a SuperNode SIGKILLed while it trains; the round goes on without
    it, and it rejoins."""
    for line in scenario.result("killed"):
        print(line)
