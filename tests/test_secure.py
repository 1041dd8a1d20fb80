"""Encrypted aggregation in Flower (fedind.paillier.site, fedind.server.encrypted): the site mod, the
decrypt query, the server's reply check and the SecureAggregation wrapper, with real Paillier ciphertexts.

Rounds run through a fake Grid that hands each message to the site-side code (the mod with a
stand-in for training, or the query handler). A guard makes any construction of a private
key, or any read of the private-key file, fail unless the site side is running: the server
side never loads the private key. One short simulation (Ray) checks the same end to end.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict

from fedind import wire
from fedind.paillier import keys, packing
from fedind.aggregation.weighting import GlobalHistogram, dwa_weights
from fedind.config import ConfigError, RunConfig
from fedind.server.metering import MeteredGrid
from fedind.paillier.site import SITE_KEY_MISSING, decrypt_query, paillier_mod
from fedind.server.encrypted import REJECTED_CIPHERTEXT, SecureAggregation, encrypted_server
from fedind.topk.downlink import CompressedDownlink, downlink_mod
from fedind.topk.uplink import TopkUplink

pytestmark = pytest.mark.usefixtures("flower_task_identity")

SHAPES = {"conv.weight": (4, 3, 5), "head.weight": (3, 8), "head.bias": (3,)}  # 87 values, 3 ciphertexts
CLIP = 0.5


@pytest.fixture(scope="module")
def key_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    key = keys.generate_keypair(512)
    keys.save_keypair(key, folder / "paillier.key", folder / "paillier.pub")
    return key, folder / "paillier.key", folder / "paillier.pub"


@pytest.fixture
def site_side(monkeypatch, key_files):
    """A switch: private keys may be built / read only while ``state["site"]`` is True."""
    _, private_path, _ = key_files
    state = {"site": False}
    original_init, original_read = keys.PrivateKey.__init__, keys._read_key_file

    def guarded_init(self, p, q, *orders):
        if not state["site"]:
            raise AssertionError("the server side constructed a Paillier private key")
        original_init(self, p, q, *orders)

    def guarded_read(path: Path):
        if Path(path).resolve() == private_path.resolve() and not state["site"]:
            raise AssertionError("the server side read the private key file")
        return original_read(path)

    monkeypatch.setattr(keys.PrivateKey, "__init__", guarded_init)
    monkeypatch.setattr(keys, "_read_key_file", guarded_read)
    return state


def arrays(seed: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (scale * rng.normal(size=s)).astype(np.float32) for k, s in SHAPES.items()}


def config(key_files, **settings) -> RunConfig:
    _, private_path, public_path = key_files
    values = dict(encryption="paillier", paillier_public_key=str(public_path),
                  paillier_private_key=str(private_path), paillier_clip=CLIP, num_sites=3, strategy="fedavg")
    return RunConfig(**{**values, **settings})


class Site:
    """A site's train handler stand-in (local weights, counts) plus the real fedind mods."""

    def __init__(self, node_id: int, local: dict, n: int, histogram: list[int], *, cheat=None, node_config=None):
        self.node_id, self.local, self.n, self.histogram = node_id, local, n, histogram
        self.cheat = cheat  # reply -> reply: what a misbehaving site does to its encrypted reply
        self.context = Context(run_id=1, node_id=node_id, node_config=node_config or {}, state=RecordDict(), run_config={})

    def train(self, msg: Message, context: Context) -> Message:
        content = RecordDict(
            {
                wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in self.local.items()}),
                wire.METRICS: MetricRecord(
                    {wire.NUM_EXAMPLES: self.n, wire.LABEL_HISTOGRAM: self.histogram, wire.TRAIN_LOSS: float(self.n)}
                ),
                wire.SITE: ConfigRecord({wire.SITE_ID: f"line-{self.node_id}"}),
            }
        )
        return Message(content, reply_to=msg)

    def handle(self, msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.TRAIN:
            reply = paillier_mod(msg, self.context, self.train)
            return self.cheat(reply) if self.cheat and not reply.has_error() else reply
        return decrypt_query(msg, self.context)


class SiteGrid:
    """A Grid whose SuperNodes are ``Site`` objects in this process (site side switched on)."""

    def __init__(self, sites: list[Site], state: dict, down: set[int] = frozenset()):
        self.sites = {s.node_id: s for s in sites}
        self.state, self.down = state, set(down)
        self.queries: list[int] = []

    def get_node_ids(self):
        return sorted(self.sites)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if msg.metadata.message_type == MessageType.QUERY:
                self.queries.append(node)
                if node in self.down:
                    continue  # no answer
            self.state["site"] = True
            try:
                replies.append(self.sites[node].handle(msg))
            finally:
                self.state["site"] = False
        return replies


def run_round(strategy: SecureAggregation, pipeline, grid: SiteGrid, global_arrays: dict, cfg: RunConfig, server_round=1):
    metered = MeteredGrid(grid, screen=pipeline)
    train_config = ConfigRecord({wire.RUN_CONFIG: json.dumps(cfg.to_flower())})
    messages = strategy.configure_train(server_round, ArrayRecord({k: Array(v) for k, v in global_arrays.items()}),
                                        train_config, metered)
    replies = metered.send_and_receive(messages)
    new, metrics = strategy.aggregate_train(server_round, replies)
    return new, metrics, metered.take()


def sites_for(global_arrays: dict, counts=(30, 10, 60), hists=None, **kwargs) -> tuple[list[Site], list[dict]]:
    hists = hists or [[c, 0, 0] for c in counts]
    locals_ = [{k: v + arrays(10 + i, 0.1)[k] for k, v in global_arrays.items()} for i in range(len(counts))]
    return [Site(i + 1, loc, n, h, **kwargs) for i, (loc, n, h) in enumerate(zip(locals_, counts, hists))], locals_


def oracle(global_arrays, locals_, weights) -> dict:
    return {
        k: global_arrays[k].astype(np.float64)
        + np.average(np.stack([np.clip(loc[k].astype(np.float64) - global_arrays[k], -CLIP, CLIP) for loc in locals_]),
                     axis=0, weights=weights)
        for k in global_arrays
    }


def close(new: ArrayRecord, expected: dict) -> float:
    return max(float(np.abs(new[k].numpy().astype(np.float64) - expected[k]).max()) for k in expected)


# --------------------------------------------------------------------------- one round


def test_encrypted_round_equals_the_plaintext_weighted_mean_and_the_server_holds_no_private_key(key_files, site_side):
    cfg = config(key_files)
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    g = arrays(0)
    sites, locals_ = sites_for(g)
    grid = SiteGrid(sites, site_side)
    new, metrics, traffic = run_round(strategy, pipeline, grid, g, cfg)
    k = packing.integer_weights([30, 10, 60])
    # one float32 rounding of the reply weights, plus the documented quantisation bound
    assert close(new, oracle(g, locals_, k)) <= packing.quantisation_bound(CLIP) + 4e-7
    assert metrics["paillier-sites"] == 3
    assert metrics[wire.TRAIN_LOSS] == pytest.approx((30 * 30 + 10 * 10 + 60 * 60) / 100)
    assert len(grid.queries) == 1 and not traffic.failures
    # nothing in clear on the uplink: train replies carry ciphertexts, no arrays
    assert traffic.uplink_bytes > 3 * 2 * 87 * 4


def test_a_compact_layout_round_sends_half_the_ciphertexts_and_decodes_within_its_step(key_files, site_side):
    """paillier-value-bits 3, paillier-weight-bits 7: 12-bit slots, weights summing to 128;
    the mean is the oracle's within one (coarser) step, and each site keeps what the step
    rounded away in its residual."""
    cfg = config(key_files, paillier_value_bits=3, paillier_weight_bits=7)
    layout = packing.Layout(3, 7)
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    g = arrays(0)
    sites, locals_ = sites_for(g)
    new, _, traffic = run_round(strategy, pipeline, SiteGrid(sites, site_side), g, cfg)
    assert not traffic.failures
    k = packing.integer_weights([30, 10, 60], layout.max_weight)
    assert sum(k) == 128
    assert close(new, oracle(g, locals_, k)) <= packing.quantisation_bound(CLIP, layout) + 1e-6
    for site, local in zip(sites, locals_):
        residual = site.context.state[RESIDUAL]["residual"].numpy()
        assert 0 < np.abs(residual).max() <= packing.quantisation_bound(CLIP, layout) + 1e-6
    assert layout.num_ciphertexts(keys.load_public_key(cfg.paillier_public_key), MODEL_SIZE) < \
        packing.FINE.num_ciphertexts(keys.load_public_key(cfg.paillier_public_key), MODEL_SIZE)


def test_dwa_weights_apply_under_encryption(key_files, site_side):
    cfg = config(key_files, strategy="dwa", conflict_buffer=False, dwa_momentum=0.0, dwa_temperature=0.5)
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    g = arrays(1)
    hists = [[20, 10, 0], [0, 5, 5], [10, 10, 40]]
    sites, locals_ = sites_for(g, counts=(30, 10, 60), hists=hists)
    new, metrics, _ = run_round(strategy, pipeline, SiteGrid(sites, site_side), g, cfg)
    hist = GlobalHistogram(3)
    for i, h in enumerate(hists):
        hist.update(f"line-{i + 1}", h)
    w = dwa_weights(np.array([30.0, 10.0, 60.0]), hists, hist.distribution(), temperature=0.5, floor=cfg.dwa_floor)
    assert not np.allclose(w, [0.3, 0.1, 0.6], atol=0.01)  # the KL weights differ from FedAvg's here
    assert close(new, oracle(g, locals_, packing.integer_weights(w))) <= packing.quantisation_bound(CLIP) + 4e-7
    assert metrics[wire.DWA_WEIGHT_MIN] == pytest.approx(w.min())


def test_server_momentum_acts_on_the_decrypted_aggregate(key_files, site_side):
    cfg = config(key_files, strategy="fedavgm", server_momentum=0.5)
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    g = arrays(2)
    sites, locals_ = sites_for(g)
    grid = SiteGrid(sites, site_side)
    first, _, _ = run_round(strategy, pipeline, grid, g, cfg, server_round=1)
    g1 = {k: v.numpy() for k, v in first.items()}
    sites2 = [Site(s.node_id, {k: g1[k] + (s.local[k] - g[k]) for k in g}, s.n, s.histogram) for s in sites]
    second, _, _ = run_round(strategy, pipeline, SiteGrid(sites2, site_side), g1, cfg, server_round=2)
    step = oracle(g, locals_, packing.integer_weights([30, 10, 60]))
    # heavy ball: the second step is the mean delta plus 0.5 x the first step
    expected = {k: g1[k] + (step[k] - g[k]) * 1.5 for k in g}
    assert close(second, expected) <= 4 * packing.quantisation_bound(CLIP) + 1e-6


# --------------------------------------------------------------------------- rejections


def truncate(reply: Message) -> Message:
    reply.content[wire.ENCRYPTED_UPDATE]["ciphertexts"] = reply.content[wire.ENCRYPTED_UPDATE]["ciphertexts"][:-7]
    return reply


def wrong_fingerprint(reply: Message) -> Message:
    reply.content[wire.ENCRYPTED_UPDATE]["key"] = "ab" * 32
    return reply


def out_of_range(reply: Message) -> Message:
    record = reply.content[wire.ENCRYPTED_UPDATE]
    record["ciphertexts"] = b"\xff" * len(record["ciphertexts"])
    return reply


def old_layout(reply: Message) -> Message:
    """A site still on layout version 1 (31-bit slots): its version and sizes."""
    record = reply.content[wire.ENCRYPTED_UPDATE]
    record["version"], record["slot-bits"], record["value-max"] = 1, 31, 2**20 - 1
    return reply


def other_layout(reply: Message) -> Message:
    """A site configured with the compact layout (paillier-value-bits 3, weight-bits 7)."""
    record = reply.content[wire.ENCRYPTED_UPDATE]
    record["slot-bits"], record["value-max"] = 12, 7
    return reply


def wrong_size(reply: Message) -> Message:
    """A version-2 header over one ciphertext too many (what 31-bit slots would need)."""
    record = reply.content[wire.ENCRYPTED_UPDATE]
    record["ciphertexts"] = record["ciphertexts"] + record["ciphertexts"][:64]
    return reply


def plaintext(reply: Message) -> Message:
    reply.content[wire.ARRAYS] = ArrayRecord({"head.bias": Array(np.zeros(3, np.float32))})
    return reply


@pytest.mark.parametrize(
    "cheat, reason",
    [
        (truncate, "truncated or padded"),
        (wrong_fingerprint, "key fingerprint abababababababab… does not match"),
        (out_of_range, "ciphertext 0 is out of range"),
        (plaintext, "carries plaintext arrays"),
        (old_layout, "version 1: expected 'fedind.paillier' version 3 "),
        (other_layout, "slot-bits 12, value-max 7: expected 24, 8191 (run config paillier-value-bits = 13"),
        (wrong_size, "truncated or padded"),
    ],
)
def test_bad_encrypted_replies_become_logged_failures_and_the_round_goes_on(key_files, site_side, flwr_log, cheat, reason):
    cfg = config(key_files, num_sites=4)
    strategy, pipeline = encrypted_server(cfg, num_sites=4, num_classes=3)
    g = arrays(3)
    sites, locals_ = sites_for(g, counts=(30, 10, 60, 20))
    sites[3].cheat = cheat
    new, _, traffic = run_round(strategy, pipeline, SiteGrid(sites, site_side), g, cfg)
    assert len(traffic.failures) == 1 and "rejected encrypted update" in traffic.failures[0]
    assert reason in traffic.failures[0]
    assert reason in " ".join(r.getMessage() for r in flwr_log.records)  # the server logs why
    # the three good sites are aggregated without the bad one
    assert close(new, oracle(g, locals_[:3], packing.integer_weights([30, 10, 60]))) <= packing.quantisation_bound(CLIP) + 1e-6


def lie(key, site_side, levels_of_slot_0: int):
    """A cheat: the site's first ciphertext replaced by one of a plaintext whose slot 0 holds
    ``levels_of_slot_0`` (past 2^24 it spills into slot 1) and its other slots Q (a zero delta)."""

    def cheat(reply: Message) -> Message:
        site_side["site"] = True
        (r,) = key.obfuscators(1)
        site_side["site"] = False
        n, n2, slots = key.public.n, key.public.n_square, packing.FINE.slots(key.public)
        m = levels_of_slot_0 + sum(packing.VALUE_MAX << (packing.SLOT_BITS * s) for s in range(1, slots))
        record = reply.content[wire.ENCRYPTED_UPDATE]
        forged = ((1 + m * n) * r % n2).to_bytes(key.public.ciphertext_bytes, "big")
        record["ciphertexts"] = forged + record["ciphertexts"][len(forged):]
        return reply

    return cheat


@pytest.mark.parametrize(
    "slot_0, reason",
    [
        (1 << (packing.SLOT_BITS * 21), "bits above its 21 slots"),  # a plaintext beyond the slots
        # under the liar's odd weight 51, 51 (2^24 + 2^23) carries 76 into slot 1 and leaves the guard bit set
        (2**packing.SLOT_BITS + 2**23, "with the guard bit set"),
    ],
)
def test_a_lying_site_makes_the_round_refused_with_a_logged_reason_and_the_next_round_goes_on(
    key_files, site_side, flwr_log, slot_0, reason
):
    key, _, _ = key_files
    cfg = config(key_files)
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    g = arrays(4)
    sites, locals_ = sites_for(g)
    assert packing.integer_weights([30, 10, 60])[1] == 51
    sites[1].cheat = lie(key, site_side, slot_0)
    grid = SiteGrid(sites, site_side)
    new, metrics, traffic = run_round(strategy, pipeline, grid, g, cfg)
    assert new is None and metrics is None  # the wrapped strategy keeps the model it had
    assert grid.queries == [1, 2] and strategy.refused_rounds == 1  # two decrypting sites agree
    logged = " ".join(r.getMessage() for r in flwr_log.records)
    assert "encrypted round 1: refused the aggregate: 2 decrypting site(s) found a sum honest sites cannot produce" in logged
    assert reason in logged and "one of the sites ['line-1', 'line-2', 'line-3']" in logged
    assert any("refused the decrypted sum" in f for f in traffic.failures)
    # the liar stops: the next round aggregates exactly, the count is kept in the checkpointed state
    # (each site adds its residual of round 1 to its delta: within 1 + decay steps of the oracle)
    sites[1].cheat = None
    new, _, _ = run_round(strategy, pipeline, SiteGrid(sites, site_side), g, cfg, server_round=2)
    steps = 1 + cfg.topk_residual_decay
    assert close(new, oracle(g, locals_, packing.integer_weights([30, 10, 60]))) <= steps * packing.quantisation_bound(CLIP) + 4e-7
    state = strategy.state_dict()
    assert state["refused_rounds"] == 1
    strategy.load_state_dict({k: v for k, v in state.items() if k != "refused_rounds"})  # an older checkpoint
    assert strategy.refused_rounds == 0


def test_sites_at_the_clip_give_the_largest_honest_sum_and_it_decodes(key_files, site_side):
    """Every value beyond the clip at every site: every slot sum is W * 2Q (or 0), the
    boundary of the range check, and the mean is +-clip exactly."""
    cfg = config(key_files)
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    g = arrays(5)
    sign = {k: np.where(np.arange(np.prod(shape)) % 2, 1.0, -1.0).reshape(shape) for k, shape in SHAPES.items()}
    beyond = {k: (g[k] + 3 * CLIP * sign[k]).astype(np.float32) for k in g}
    sites = [Site(i + 1, beyond, n, [n, 0, 0]) for i, n in enumerate((30, 10, 60))]
    new, _, _ = run_round(strategy, pipeline, SiteGrid(sites, site_side), g, cfg)
    expected = {k: g[k].astype(np.float64) + CLIP * sign[k] for k in g}
    assert close(new, expected) <= 1e-6 and strategy.refused_rounds == 0


def test_one_decrypting_site_that_claims_an_out_of_range_sum_cannot_refuse_the_round(key_files, site_side):
    cfg = config(key_files)
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    g = arrays(5)
    sites, locals_ = sites_for(g)
    claim = Error(code=wire.SUM_OUT_OF_RANGE, reason="refused the decrypted sum: (a false claim)")
    sites[0].handle = lambda msg, site=sites[0], handle=sites[0].handle: (  # noqa: E731
        Message(claim, reply_to=msg) if msg.metadata.message_type == MessageType.QUERY else handle(msg)
    )
    grid = SiteGrid(sites, site_side)
    new, _, _ = run_round(strategy, pipeline, grid, g, cfg)
    assert grid.queries == [1, 2] and strategy.refused_rounds == 0
    assert close(new, oracle(g, locals_, packing.integer_weights([30, 10, 60]))) <= packing.quantisation_bound(CLIP) + 4e-7


def test_a_failed_decrypt_query_goes_to_the_next_site(key_files, site_side):
    cfg = config(key_files)
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    g = arrays(5)
    sites, locals_ = sites_for(g)
    grid = SiteGrid(sites, site_side, down={1})
    new, _, traffic = run_round(strategy, pipeline, grid, g, cfg)
    assert grid.queries == [1, 2] and new is not None
    assert any("no reply" in f for f in traffic.failures)


def test_fewer_than_two_valid_updates_are_not_decrypted(key_files, site_side, flwr_log):
    cfg = config(key_files)
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    g = arrays(6)
    sites, _ = sites_for(g)
    sites[1].cheat = sites[2].cheat = truncate
    grid = SiteGrid(sites, site_side)
    new, _, _ = run_round(strategy, pipeline, grid, g, cfg)
    assert new is None and grid.queries == []
    assert "fewer than 2 sites is not decrypted" in " ".join(r.getMessage() for r in flwr_log.records)


def test_the_decrypting_site_refuses_an_aggregate_of_one_site(key_files, site_side):
    key, _, _ = key_files
    cfg = config(key_files)
    site = Site(1, arrays(0), 10, [10, 0, 0])
    site_side["site"] = True
    levels, _ = packing.quantise(np.zeros(87), CLIP, np.random.default_rng(0))
    single = packing.encrypt_levels(levels, key, CLIP)
    aggregate = packing.weighted_sum([single], [packing.MAX_SITES], key.public)
    query = Message(RecordDict({wire.ENCRYPTED_AGGREGATE: ConfigRecord(aggregate.to_config(key.public)),
                                wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps(cfg.to_flower())})}),
                    message_type=MessageType.QUERY, dst_node_id=1)
    reply = decrypt_query(query, site.context)
    assert reply.has_error() and "aggregate of 1 site(s) is not decrypted" in reply.error.reason


def test_a_site_without_its_private_key_replies_with_an_error(key_files, site_side):
    cfg = config(key_files, paillier_private_key="")
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    g = arrays(7)
    sites, _ = sites_for(g)
    _, _, traffic = run_round(strategy, pipeline, SiteGrid(sites, site_side), g, cfg)
    assert len(traffic.failures) == 3 and "node config paillier-private-key" in traffic.failures[0]


def test_the_mod_passes_plain_runs_through(key_files, site_side):
    g = arrays(8)
    site = Site(1, arrays(9), 10, [10, 0, 0])
    cfg = RunConfig(num_sites=3)
    msg = Message(RecordDict({wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in g.items()}),
                              wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps(cfg.to_flower())})}),
                  message_type=MessageType.TRAIN, dst_node_id=1)
    reply = paillier_mod(msg, site.context, site.train)
    assert wire.ARRAYS in reply.content.array_records and wire.ENCRYPTED_UPDATE not in reply.content.config_records


def test_the_server_refuses_a_private_key_file_and_missing_key(key_files, site_side):
    _, private_path, _ = key_files
    with pytest.raises(ConfigError, match="paillier-public-key"):
        encrypted_server(config(key_files, paillier_public_key=""), num_sites=3, num_classes=3)
    site_side["site"] = True  # let the loader open it, to show it is refused by format
    with pytest.raises(ConfigError, match="PRIVATE key file"):
        encrypted_server(config(key_files, paillier_public_key=str(private_path)), num_sites=3, num_classes=3)
    site_side["site"] = False
    with pytest.raises(ConfigError, match=f"2 to {packing.MAX_SITES} sites per round"):
        encrypted_server(config(key_files, num_sites=3), num_sites=1, num_classes=3)
    with pytest.raises(TypeError, match="PUBLIC key only"):
        SecureAggregation(None, object(), CLIP, timeout=1.0)
    assert REJECTED_CIPHERTEXT != SITE_KEY_MISSING


# --------------------------------------------------------------------------- end to end


def test_simulation_end_to_end_without_the_server_loading_the_private_key(ray_runs):
    """The ServerApp runs in one process, the sites in Ray workers: with private keys
    forbidden in the ServerApp's process, the run still aggregates every round. (The run
    is one of the suite's single Ray start, ``ray_runs["encrypted"]``: tests/ray_batch.py,
    whose process is the ServerApp's and forbids ``keys.load_private_key`` and
    ``keys.PrivateKey.__init__`` while Ray runs.)"""
    config = ray_runs["configs"]["encrypted"]
    assert (config.strategy, config.encryption, config.num_server_rounds, config.num_sites) == ("dwa", "paillier", 2, 3)
    assert ray_runs["private_key_loads"] == []
    summary = ray_runs["encrypted"]
    rows = (ray_runs["run_dir"] / "encrypted" / "rounds.csv").read_text().splitlines()[1:]
    assert summary["rounds"] == 2 and summary["totals"]["failures"] == 0
    assert all(row.split(",")[5] == "3" for row in rows)  # sites aggregated per round


def _marked_site_agent(app, site_side):
    """``app`` with the private-key switch on only while a site handles a message."""

    def site_agent(message, context):
        site_side["site"] = True
        try:
            return app(message, context)
        finally:
            site_side["site"] = False

    return site_agent


def test_loopback_simulation_keeps_the_private_key_inside_the_site_agent(tmp_path, key_files, site_side):
    """The same run on the loopback runtime (sites called in this process): the private key
    is read and built only inside the site agent's ClientApp call, never by the server's code."""
    from fedind.site.app import app
    from fedind.simulation import simulate

    _, private_path, public_path = key_files

    site_agent = _marked_site_agent(app, site_side)

    cfg = RunConfig(
        num_server_rounds=2, num_sites=3, samples_per_site=40, local_epochs=1, batch_size=8, learning_rate=0.01,
        model_width=8, device="cpu", strategy="dwa", encryption="paillier", paillier_public_key=str(public_path),
        paillier_private_key=str(private_path), run_dir=str(tmp_path), run_name="enc",
    )
    summary = simulate(cfg, client_app=site_agent, runtime="loopback")
    rows = (tmp_path / "enc" / "rounds.csv").read_text().splitlines()[1:]
    assert summary["rounds"] == 2 and summary["totals"]["failures"] == 0
    assert all(row.split(",")[5] == "3" for row in rows)  # sites aggregated per round


# --------------------------------------------------------------------------- sparse encrypted rounds


from fedind.paillier import sparse  # noqa: E402
from fedind.paillier.site import RESIDUAL  # noqa: E402

MODEL_SIZE = sum(int(np.prod(s)) for s in SHAPES.values())  # 87


def sparse_config(key_files, **settings) -> RunConfig:
    values = dict(compression="topk", paillier_set_ratio=0.4, topk_warmup_rounds=0, paillier_gain=1.0, num_sites=4)
    return config(key_files, **{**values, **settings})


@pytest.mark.parametrize("rule", sparse.SET_RULES)
def test_the_announced_set_is_deterministic_and_uses_nothing_per_site(rule):
    change = np.random.default_rng(0).normal(size=1000)
    sets = [sparse.announced_set(rule, 7, 1000, 50, seed=3, last_change=change.copy()) for _ in range(2)]
    assert np.array_equal(*sets) and sets[0].size == 50 and np.all(np.diff(sets[0]) > 0)
    next_round = sparse.announced_set(rule, 8, 1000, 50, seed=3, last_change=change)
    assert np.array_equal(sets[0], next_round) == (rule == "change")  # the random part is drawn per round
    top = set(np.argsort(-np.abs(change))[:50].tolist())
    share = len(top & set(sets[0].tolist())) / 50
    assert share == {"random": share, "change": 1.0, "mixed": share}[rule]
    if rule == "mixed":
        assert set(np.argsort(-np.abs(change))[:25].tolist()) <= set(sets[0].tolist())
    # no last change (round 1, or a resumed server): the seeded random set of that round
    assert np.array_equal(sparse.announced_set(rule, 7, 1000, 50, seed=3),
                          sparse.announced_set("random", 7, 1000, 50, seed=3))


def test_every_site_gets_the_same_set_and_a_second_server_would_announce_it_too(key_files, site_side):
    cfg = sparse_config(key_files)
    g = {k: v.astype(np.float32) for k, v in arrays(3).items()}
    announced = []
    for _ in range(2):
        strategy, _ = encrypted_server(cfg, num_sites=4, num_classes=3)
        messages = list(strategy.configure_train(1, ArrayRecord({k: Array(v) for k, v in g.items()}),
                                                 ConfigRecord({wire.RUN_CONFIG: json.dumps(cfg.to_flower())}),
                                                 SiteGrid(sites_for(g, counts=(1, 2, 3, 4))[0], site_side)))
        records = {bytes(m.content[wire.PAILLIER_SET][wire.SET_INDICES]) for m in messages}
        assert len(messages) == 4 and len(records) == 1  # one set for every site
        announced.append(records.pop())
    assert announced[0] == announced[1]
    assert len(announced[0]) // 4 == round(0.4 * MODEL_SIZE)


def test_a_sparse_encrypted_round_is_the_mean_on_the_set_and_the_sites_keep_the_rest(key_files, site_side):
    # the stand-in sites change every coordinate (they do not train on the set), as with
    # paillier-train-set = false; the mean on the set is scaled by paillier-gain
    cfg = sparse_config(key_files, paillier_gain=2.0, topk_residual_decay=1.0, paillier_train_set=False)
    strategy, pipeline = encrypted_server(cfg, num_sites=4, num_classes=3)
    g = arrays(3)
    counts = (30, 10, 60, 20)
    sites, locals_ = sites_for(g, counts=counts)
    new, metrics, traffic = run_round(strategy, pipeline, SiteGrid(sites, site_side), g, cfg)
    assert traffic.failures == [] and metrics["paillier-coordinates"] == 35
    on = strategy.coordinates
    flat = lambda d: np.concatenate([np.asarray(d[k], np.float64).ravel() for k in sorted(d)])  # noqa: E731
    deltas = [flat(loc) - flat(g) for loc in locals_]
    k = packing.integer_weights(list(counts))
    expected = np.zeros(MODEL_SIZE)
    expected[on] = 2.0 * np.average([np.clip(d[on], -CLIP, CLIP) for d in deltas], axis=0, weights=k)
    got = flat({name: new[name].numpy() for name in new}) - flat(g)
    assert np.abs(got - expected).max() <= 2.0 * packing.quantisation_bound(CLIP) + 1e-6
    assert np.all(got[np.setdiff1d(np.arange(MODEL_SIZE), on)] == 0)
    # each site keeps what it did not send: its delta off the set, the clipped excess and the rounding
    for site, delta in zip(sites, deltas):
        residual = site.context.state[RESIDUAL]["residual"].numpy().astype(np.float64)
        off = np.setdiff1d(np.arange(MODEL_SIZE), on)
        assert np.allclose(residual[off], delta[off], atol=1e-6)
        assert np.all(np.abs(residual[on] - (delta[on] - np.clip(delta[on], -CLIP, CLIP))) <= CLIP / packing.VALUE_MAX + 1e-6)
    # the uplink: ceil(35 / slots) ciphertexts per site instead of ceil(87 / slots)
    key = keys.load_public_key(key_files[2])
    assert packing.FINE.num_ciphertexts(key, 35) < packing.FINE.num_ciphertexts(key, MODEL_SIZE)


def wrong_set(reply: Message, key) -> Message:
    reply.content[wire.ENCRYPTED_UPDATE]["set"] = "ab" * 32
    return reply


def dense_version_2(reply: Message, key) -> Message:
    """A site that encrypts every coordinate in the old layout (version 2, no set)."""
    record = dict(reply.content[wire.ENCRYPTED_UPDATE])
    record.pop("set")
    blob = b"\x01" * packing.FINE.num_ciphertexts(key, MODEL_SIZE) * key.ciphertext_bytes
    reply.content[wire.ENCRYPTED_UPDATE] = ConfigRecord({**record, "version": 2, "count": MODEL_SIZE, "ciphertexts": blob})
    return reply


def one_value_short(reply: Message, key) -> Message:
    record = reply.content[wire.ENCRYPTED_UPDATE]
    record["count"] = record["count"] - 1
    return reply


def extra_ciphertext(reply: Message, key) -> Message:
    record = reply.content[wire.ENCRYPTED_UPDATE]
    record["ciphertexts"] = record["ciphertexts"] + record["ciphertexts"][-key.ciphertext_bytes:]
    return reply


@pytest.mark.parametrize(
    "cheat, reason",
    [
        (wrong_set, "coordinate set: version 3 payload of set abababababababab…, expected the announced set"),
        (dense_version_2, "version 2 payload of every coordinate (dense), expected the announced set"),
        (one_value_short, "count 34: expected 35"),
        (extra_ciphertext, "truncated or padded"),
    ],
)
def test_a_payload_of_the_wrong_set_or_size_is_a_logged_failure_and_the_round_goes_on(
    key_files, site_side, flwr_log, cheat, reason
):
    cfg = sparse_config(key_files)
    strategy, pipeline = encrypted_server(cfg, num_sites=4, num_classes=3)
    g = arrays(3)
    sites, locals_ = sites_for(g, counts=(30, 10, 60, 20))
    sites[3].cheat = lambda reply: cheat(reply, key_files[0].public)
    new, _, traffic = run_round(strategy, pipeline, SiteGrid(sites, site_side), g, cfg)
    assert len(traffic.failures) == 1 and "rejected encrypted update" in traffic.failures[0]
    assert reason in traffic.failures[0]
    assert reason in " ".join(r.getMessage() for r in flwr_log.records)
    assert new is not None  # the three good sites are aggregated
    assert metrics_sites(strategy, new, g) == 35


def metrics_sites(strategy, new, g) -> int:
    changed = np.concatenate([(new[k].numpy() != g[k]).ravel() for k in sorted(g)])
    assert not changed[np.setdiff1d(np.arange(MODEL_SIZE), strategy.coordinates)].any()
    return int(strategy.coordinates.size)


def test_a_dense_version_2_payload_is_still_read_in_a_dense_round(key_files, site_side):
    def as_version_2(reply: Message) -> Message:
        record = dict(reply.content[wire.ENCRYPTED_UPDATE])
        assert record.pop("set") == ""
        reply.content[wire.ENCRYPTED_UPDATE] = ConfigRecord({**record, "version": 2})
        return reply

    cfg = config(key_files, num_sites=3)
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    g = arrays(3)
    sites, locals_ = sites_for(g, cheat=as_version_2)
    new, _, traffic = run_round(strategy, pipeline, SiteGrid(sites, site_side), g, cfg)
    assert traffic.failures == []
    assert close(new, oracle(g, locals_, packing.integer_weights([30, 10, 60]))) <= packing.quantisation_bound(CLIP) + 1e-6


def test_a_site_refuses_an_instruction_whose_digest_does_not_name_its_set(key_files, site_side):
    cfg = sparse_config(key_files)
    g = arrays(3)
    site = sites_for(g, counts=(5,))[0][0]
    indices = np.arange(0, MODEL_SIZE, 3)
    content = RecordDict({
        wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in g.items()}),
        wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps(cfg.to_flower()), wire.SERVER_ROUND: 2}),
        wire.PAILLIER_SET: ConfigRecord({wire.SET_INDICES: sparse.indices_to_bytes(indices),
                                         wire.SET_DIGEST: sparse.set_digest(indices, MODEL_SIZE, 1)}),  # round 1's
    })
    msg = Message(content, dst_node_id=site.node_id, message_type=MessageType.TRAIN)
    site_side["site"] = True
    try:
        reply = site.handle(msg)
    finally:
        site_side["site"] = False
    assert reply.has_error() and reply.error.code == REJECTED_CIPHERTEXT and "digest" in reply.error.reason


def test_loopback_sparse_encrypted_run_sends_the_announced_set_only(tmp_path, key_files, site_side):
    """Sparse encrypted rounds end to end on the loopback runtime, real ciphertexts: every
    round aggregates every site, and the uplink is the set's ciphertexts, not the model's;
    with the compressed downlink too, the sites get sparse steps instead of the model. The
    same run twice gives the same model (the stochastic rounding draws from the run's seed)."""
    from fedind.site.app import app
    from fedind.simulation import simulate

    _, private_path, public_path = key_files

    site_agent = _marked_site_agent(app, site_side)

    common = dict(
        num_server_rounds=3, num_sites=3, samples_per_site=40, local_epochs=1, batch_size=8, learning_rate=0.01,
        model_width=8, device="cpu", strategy="dwa", encryption="paillier", paillier_public_key=str(public_path),
        paillier_private_key=str(private_path), run_dir=str(tmp_path), topk_warmup_rounds=0, paillier_set_ratio=0.05,
    )
    summaries = {name: simulate(RunConfig(**common, run_name=name, **extra), client_app=site_agent, runtime="loopback")
                 for name, extra in (("sparse", dict(compression="topk")), ("dense", {}),
                                     ("both", dict(compression="topk", downlink="topk")),
                                     ("sparse-again", dict(compression="topk")))}
    for name, summary in summaries.items():
        rows = (tmp_path / name / "rounds.csv").read_text().splitlines()[1:]
        assert summary["rounds"] == 3 and summary["totals"]["failures"] == 0
        assert all(row.split(",")[5] == "3" for row in rows)  # sites aggregated per round
    assert summaries["sparse"]["totals"]["uplink_bytes"] * 8 < summaries["dense"]["totals"]["uplink_bytes"]
    assert summaries["both"]["totals"]["downlink_bytes"] * 2 < summaries["sparse"]["totals"]["downlink_bytes"]
    assert summaries["sparse-again"]["model_sha256"] == summaries["sparse"]["model_sha256"]


def test_the_rounding_draws_repeat_per_site_round_and_record_and_differ_otherwise():
    """Stochastic rounding under encryption is unbiased noise, not a secret: its draws come
    from the run's seed, the site, the round and the record, so a run repeats."""
    from fedind.paillier.site import rounding_rng

    cfg = RunConfig(seed=3)
    draws = lambda *key: rounding_rng(*key).random(4).tolist()  # noqa: E731
    assert draws(cfg, "line-01", 5, "encrypted-update") == draws(cfg, "line-01", 5, "encrypted-update")
    others = [(cfg, "line-02", 5, "encrypted-update"), (cfg, "line-01", 6, "encrypted-update"),
              (cfg, "line-01", 5, "ewc-fisher"), (RunConfig(seed=4), "line-01", 5, "encrypted-update")]
    assert all(draws(*key) != draws(cfg, "line-01", 5, "encrypted-update") for key in others)


def test_the_recipe_runs_under_encryption_and_the_server_reads_no_site_s_fisher_or_moments(
        tmp_path, key_files, site_side, flwr_log):
    """The default recipe plus ``encryption = "paillier"`` runs end to end (loopback, real
    ciphertexts): two phases, the head grows for the new class, the phase end consolidates
    the Fisher and the last round calibrates the head, both from sums the server decrypts
    through a site; no reply carries a plaintext Fisher or moments, and the server never
    builds the private key."""
    from fedind.config import recipe
    from fedind.site.app import app
    from fedind.simulation import simulate

    _, private_path, public_path = key_files
    seen: list[set] = []

    def recording_agent(message, context):
        reply = _marked_site_agent(app, site_side)(message, context)
        if not reply.has_error():
            seen.append(set(reply.content.array_records) | set(reply.content.config_records))
        return reply

    cfg = replace(
        recipe(run_name="enc-recipe", overwrite=True), run_dir=str(tmp_path), num_server_rounds=4, phase_rounds=2,
        num_sites=3, samples_per_site=60, local_epochs=1, model_width=8, device="cpu", topk_warmup_rounds=0,
        encryption="paillier", paillier_public_key=str(public_path), paillier_private_key=str(private_path),
    )
    summary = simulate(cfg, client_app=recording_agent, runtime="loopback")
    assert summary["rounds"] == 4 and summary["totals"]["failures"] == 0
    continual = summary["continual"]
    assert continual["consolidated_phases"] == [0] and continual["classes"] == continual["initial_classes"] + 1
    messages = [r.getMessage() for r in flwr_log.records]
    assert any("EWC consolidated the Fisher of 1 sites" in m for m in messages)  # one sum of every site's
    assert any("head calibrated on the feature moments of 3 sites" in m for m in messages)
    keys_sent = set().union(*seen)
    assert {wire.EWC_FISHER_ENCRYPTED, wire.FEATURE_MOMENTS_ENCRYPTED} <= keys_sent
    assert not {wire.EWC_FISHER, wire.FEATURE_MOMENTS, wire.ARRAYS} & keys_sent
    # It resumes from its checkpoint: the grown head's label histograms and young rows included.
    resumed = simulate(replace(cfg, resume=True, num_server_rounds=5), client_app=recording_agent, runtime="loopback")
    assert resumed["rounds"] == 5 and resumed["totals"]["failures"] == 0
    assert resumed["continual"]["classes"] == continual["classes"]


# --------------------------------------------------------------------------- compressed downlink


class CopySite(Site):
    """A site behind the compressed downlink: it trains from the copy it rebuilt (the real
    downlink mod) and moves it by its own fixed ``delta``."""

    def __init__(self, node_id: int, delta: dict, n: int, histogram: list[int]):
        super().__init__(node_id, {}, n, histogram)
        self.delta, self.received = delta, None

    def train(self, msg: Message, context: Context) -> Message:
        self.received = {k: v.numpy().copy() for k, v in msg.content[wire.ARRAYS].items()}
        self.local = {k: self.received[k] + self.delta[k] for k in self.received}
        return super().train(msg, context)

    def handle(self, msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.TRAIN:
            return downlink_mod(msg, self.context, lambda m, c: paillier_mod(m, c, self.train))
        return decrypt_query(msg, self.context)


def test_under_the_compressed_downlink_the_decrypted_mean_moves_the_servers_own_model(key_files, site_side):
    """The sites train from a copy that lags the global model (a 20 % step) and encrypt
    their deltas from it; the server adds the decrypted mean to ITS model, as it re-bases
    plaintext replies: G_3 = G_2 + mean(delta), not the copy + mean(delta)."""
    cfg = config(key_files, downlink="topk", downlink_ratio=0.2, downlink_quantization="int4")
    strategy, pipeline = encrypted_server(cfg, num_sites=3, num_classes=3)
    counts = (30, 10, 60)
    sites = [CopySite(i + 1, arrays(20 + i, 0.05), n, [n, 0, 0]) for i, n in enumerate(counts)]
    grid = SiteGrid(sites, site_side)
    downlink = CompressedDownlink(TopkUplink(), 0.2, "int4")
    metered = MeteredGrid(grid, transform=downlink, screen=pipeline)
    train_config = ConfigRecord({wire.RUN_CONFIG: json.dumps(cfg.to_flower())})
    weights = packing.integer_weights(list(counts))
    model, sent_down = arrays(0), []
    size = sum(v.size for v in model.values())

    def residual(site):  # the site's error-feedback residual (flat, sorted names; zeros before round 1)
        state = site.context.state
        return state[RESIDUAL]["residual"].numpy().astype(np.float64) if RESIDUAL in state else np.zeros(size)

    for server_round in (1, 2):
        before = [residual(s) for s in sites]
        messages = strategy.configure_train(server_round, ArrayRecord({k: Array(v) for k, v in model.items()}),
                                            train_config, metered)
        replies = metered.send_and_receive(messages)
        new, _ = strategy.aggregate_train(server_round, replies)
        traffic = metered.take()
        assert not traffic.failures
        sent_down.append(traffic.downlink_bytes)
        if server_round == 2:  # the sites held a lagging copy, not the global model
            assert max(float(np.abs(sites[0].received[k] - model[k]).max()) for k in model) > 1e-3
        # each site sent delta + decay * (its last residual) - (its new residual): error feedback
        sent = [np.concatenate([s.delta[k].astype(np.float64).ravel() for k in sorted(model)])
                + cfg.topk_residual_decay * r0 - residual(s) for s, r0 in zip(sites, before)]
        mean, offset, expected = np.average(np.stack(sent), axis=0, weights=weights), 0, {}
        for k in sorted(model):
            expected[k] = model[k].astype(np.float64) + mean[offset : offset + model[k].size].reshape(model[k].shape)
            offset += model[k].size
        assert close(new, expected) <= 1e-6
        assert all(np.abs(residual(s)).max() <= packing.quantisation_bound(CLIP) + 1e-6 for s in sites)
        model = {k: new[k].numpy() for k in model}
    assert sent_down[1] < sent_down[0]  # round 2: a sparse step to each site, not the model


# --------------------------------------------------------------------------- training on the set


@pytest.mark.parametrize("train_set", [True, False])
def test_a_site_in_a_sparse_encrypted_round_trains_only_the_announced_coordinates(key_files, train_set):
    """The real site handler (synthetic line 0): with paillier-train-set (the default) every
    coordinate off the round's set comes back exactly as sent and the set's coordinates
    train; without it the whole model trains and the mod leaves the rest in the residual."""
    import torch

    from fedind.models import FaultCNN
    from fedind.site.app import train

    cfg = config(key_files, compression="topk", num_sites=3, samples_per_site=40, local_epochs=1, batch_size=8,
                 model_width=8, device="cpu", paillier_train_set=train_set)
    torch.manual_seed(0)
    sent = {k: v.detach().numpy().copy() for k, v in FaultCNN(1, 10, 8).state_dict().items()}
    size = sum(v.size for v in sent.values())
    indices = np.sort(np.random.default_rng(1).choice(size, size // 10, replace=False))
    msg = Message(RecordDict({
        wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in sent.items()}),
        wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps(cfg.to_flower()), wire.SERVER_ROUND: 2}),
        wire.PAILLIER_SET: ConfigRecord({wire.SET_INDICES: sparse.indices_to_bytes(indices),
                                         wire.SET_DIGEST: sparse.set_digest(indices, size, 2)}),
    }), dst_node_id=1, message_type=MessageType.TRAIN)
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 3},
                      state=RecordDict(), run_config={})
    reply = train(msg, context)
    delta = np.concatenate([(reply.content[wire.ARRAYS][k].numpy() - sent[k]).ravel() for k in sorted(sent)])
    on = np.zeros(size, dtype=bool)
    on[indices] = True
    assert np.count_nonzero(delta[on]) > 0.9 * on.sum()  # the set trains
    if train_set:
        assert not delta[~on].any()  # bit for bit as sent
    else:
        assert np.count_nonzero(delta[~on]) > 0.9 * (~on).sum()


def test_coordinate_masks_split_the_flat_set_by_sorted_names():
    masks = sparse.coordinate_masks(np.array([0, 4, 5, 9]), {"b": (2, 3), "a": (4,)})
    assert masks["a"].tolist() == [True, False, False, False]  # a: flat 0..3
    assert masks["b"].tolist() == [[True, True, False], [False, False, True]]  # b: flat 4..9


def test_train_local_refuses_a_mask_that_does_not_fit_the_model():
    import torch

    from fedind.data.format import SiteArrays
    from fedind.models import FaultCNN
    from fedind.training import train_local

    model = FaultCNN(1, 3, 8)
    data = SiteArrays(np.zeros((4, 1, 256), np.float32), np.zeros(4, np.int64))
    name, p = next(iter(model.named_parameters()))
    for bad, why in (({"nope": torch.ones(1, dtype=torch.bool)}, "lacks"),
                     ({name: torch.ones(p.shape)}, "expected bool")):
        with pytest.raises(ValueError, match=why):
            train_local(model, data, epochs=1, batch_size=2, lr=0.1, seed=0, device=torch.device("cpu"), trainable=bad)


def test_sparse_encrypted_rounds_step_by_paillier_gain_not_by_the_plaintext_top_k_gain(key_files):
    """The recipe's topk-gain (2.0, for its plaintext top-k) overshot sparse encrypted rounds,
    whose sites send their whole update on the set: they have their own, paillier-gain."""
    assert RunConfig().paillier_gain == 1.5
    strategy, _ = encrypted_server(sparse_config(key_files, topk_gain=2.0, paillier_gain=1.5), num_sites=4, num_classes=3)
    assert strategy.sparse.gain == 1.5
    strategy, _ = encrypted_server(sparse_config(key_files, topk_gain=2.0, paillier_gain=1.0), num_sites=4, num_classes=3)
    assert strategy.sparse.gain == 1.0
