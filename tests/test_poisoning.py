"""The poisoning benchmark's attacker (simulations/poisoning.py): its maths and its mod."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from fedind import wire
from simulations.poisoning import Attack, PoisonMod, peer_cosines, poison

SENT = {"conv.weight": np.full((2, 3), 1.0, np.float32), "head.bias": np.array([0.5, -0.5], np.float32)}
TRAINED = {"conv.weight": np.full((2, 3), 1.25, np.float32), "head.bias": np.array([0.25, 0.0], np.float32)}


def test_scale_boosts_the_update():
    out = poison(SENT, TRAINED, Attack("scale", 10))
    np.testing.assert_allclose(out["conv.weight"], np.full((2, 3), 1.0 + 10 * 0.25))
    np.testing.assert_allclose(out["head.bias"], [0.5 + 10 * -0.25, -0.5 + 10 * 0.5])
    assert all(out[k].dtype == np.float32 for k in out)


def test_signflip_reverses_and_scales_the_update():
    out = poison(SENT, TRAINED, Attack("signflip", 4))
    np.testing.assert_allclose(out["conv.weight"], np.full((2, 3), 1.0 - 4 * 0.25))
    np.testing.assert_allclose(out["head.bias"], [0.5 + 4 * 0.25, -0.5 - 4 * 0.5])


def test_bodyflip_reverses_everything_but_the_classifier_bias():
    out = poison(SENT, TRAINED, Attack.parse("bodyflip2"))
    np.testing.assert_allclose(out["conv.weight"], np.full((2, 3), 1.0 - 2 * 0.25))
    np.testing.assert_array_equal(out["head.bias"], TRAINED["head.bias"])


def test_scale_one_is_the_honest_update_and_signflip_one_its_mirror():
    same = poison(SENT, TRAINED, Attack("scale", 1))
    mirror = poison(SENT, TRAINED, Attack("signflip", 1))
    for k in SENT:
        np.testing.assert_array_equal(same[k], TRAINED[k])
        np.testing.assert_allclose(mirror[k] - SENT[k], -(TRAINED[k] - SENT[k]))


def test_non_float_arrays_and_inputs_are_untouched():
    sent = {**SENT, "steps": np.array([3], np.int64)}
    trained = {**TRAINED, "steps": np.array([7], np.int64)}
    before = {k: v.copy() for k, v in trained.items()}
    out = poison(sent, trained, Attack("scale", 100))
    np.testing.assert_array_equal(out["steps"], [7])
    for k in trained:
        np.testing.assert_array_equal(trained[k], before[k])


def test_mismatched_arrays_are_refused():
    with pytest.raises(ValueError, match="arrays differ"):
        poison(SENT, {"conv.weight": TRAINED["conv.weight"]}, Attack("scale", 2))


@pytest.mark.parametrize("text, attack", [("scale10", Attack("scale", 10)), ("signflip4", Attack("signflip", 4)),
                                          ("scale2.5", Attack("scale", 2.5))])
def test_attack_names_round_trip(text, attack):
    assert Attack.parse(text) == attack and attack.name == text


@pytest.mark.parametrize("text", ["flip4", "scale", "scale-1", "signflip0", "absent2"])
def test_invalid_attacks_are_refused(text):
    with pytest.raises(ValueError, match="Invalid"):
        Attack.parse(text)


# --------------------------------------------------------------------------- the mod


def _instruction(message_type: str = MessageType.TRAIN) -> Message:
    arrays = ArrayRecord({k: Array(v) for k, v in SENT.items()})
    content = RecordDict({wire.ARRAYS: arrays, wire.CONFIG: ConfigRecord({})})
    return Message(content, message_type=message_type, dst_node_id=1)


def _honest_site(msg: Message, context: Context) -> Message:
    metrics = MetricRecord({wire.NUM_EXAMPLES: 10, wire.LABEL_HISTOGRAM: [6, 4]})
    content = RecordDict({wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in TRAINED.items()}), wire.METRICS: metrics})
    return Message(content, reply_to=msg)


def _context(partition: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": partition}, state=RecordDict(), run_config={})


@pytest.mark.usefixtures("flower_task_identity")
def test_the_mod_poisons_the_attacked_site_only_and_keeps_its_metrics_honest():
    mod = PoisonMod(Attack("signflip", 4), sites=(0,))
    attacked = mod(_instruction(), _context(0), _honest_site)
    honest = mod(_instruction(), _context(3), _honest_site)
    np.testing.assert_allclose(attacked.content[wire.ARRAYS]["conv.weight"].numpy(), np.full((2, 3), 0.0))
    for k in SENT:
        np.testing.assert_array_equal(honest.content[wire.ARRAYS][k].numpy(), TRAINED[k])
    assert attacked.content[wire.METRICS][wire.NUM_EXAMPLES] == 10
    assert attacked.content[wire.METRICS][wire.LABEL_HISTOGRAM] == [6, 4]


@pytest.mark.usefixtures("flower_task_identity")
def test_an_absent_site_sends_an_error_reply_and_the_others_train():
    mod = PoisonMod(Attack.parse("absent"), sites=(0,))
    assert mod.attack.name == "absent"
    assert mod(_instruction(), _context(0), _honest_site).has_error()
    assert not mod(_instruction(), _context(3), _honest_site).has_error()
    with pytest.raises(ValueError, match="no weights"):
        poison(SENT, TRAINED, Attack("absent", 1.0))


@pytest.mark.usefixtures("flower_task_identity")
def test_the_mod_leaves_evaluate_messages_alone():
    mod = PoisonMod(Attack("scale", 100), sites=(0,))
    out = mod(_instruction(MessageType.EVALUATE), _context(0), _honest_site)
    for k in SENT:
        np.testing.assert_array_equal(out.content[wire.ARRAYS][k].numpy(), TRAINED[k])


@pytest.mark.usefixtures("flower_task_identity")
def test_the_benchmark_screen_records_norms_and_rejections():
    from tests.test_screening import GLOBAL, honest, instruction, reply

    from simulations.poisoning import recording_screen

    instructions = {node: instruction(node) for node in range(1, 7)}
    replies = [reply(instructions[n], honest(n)) for n in range(1, 6)]
    boosted = poison(GLOBAL, honest(6), Attack("scale", 100))
    replies.append(reply(instructions[6], boosted))
    rows: list[dict] = []
    out = recording_screen(rows)(num_classes=3)(instructions, replies)
    assert [r.has_error() for r in out] == [False] * 5 + [True]
    assert len(rows) == 6 and all(r["round"] == 1 for r in rows)
    assert [r["rejected"] for r in rows].count(True) == 1
    assert max(r["ratio_to_median"] for r in rows) > 10
    assert all(-1 - 1e-9 <= r["cosine_to_median_update"] <= 1 + 1e-9 for r in rows)


def test_peer_cosines_point_a_reversed_update_against_its_label_peers():
    rng = np.random.default_rng(0)
    shared, other = rng.normal(size=50), rng.normal(size=50)
    deltas = [shared + 0.3 * rng.normal(size=50), 2 * shared, shared + 0.3 * rng.normal(size=50), -shared, other]
    histograms = [[5, 5, 0, 0], [4, 6, 0, 0], [5, 4, 0, 0], [6, 4, 0, 0], [0, 0, 3, 7]]
    c = peer_cosines(deltas, histograms)
    assert min(c[:3]) > 0.5  # honest label peers agree
    assert c[3] < -0.5  # the reversed one points against them
    assert np.isnan(c[4])  # no class in common with anyone: no reference


def test_peer_cosines_weight_peers_by_label_overlap_and_normalise_them():
    # The peer sharing site 0's classes sets its reference, however short its update;
    # the long update of a site with other classes does not.
    deltas = [np.array([1.0, 0.0]), np.array([0.01, 0.0]), np.array([0.0, -100.0])]
    c = peer_cosines(deltas, [[1, 0, 0], [1, 0, 0], [0, 1, 1]])
    assert c[0] == pytest.approx(1.0)
    assert np.isnan(peer_cosines([np.zeros(2), np.ones(2), np.ones(2)], [[1], [1], [1]])[0])


@pytest.mark.parametrize("histograms", [[[1, 0]], [[1, 0], [-1, 2]], [[1, 0], [np.nan, 2]]])
def test_peer_cosines_refuse_bad_histograms(histograms):
    with pytest.raises(ValueError, match="Invalid"):
        peer_cosines([np.ones(2), np.ones(2)], histograms)


# --------------------------------------------------------------------------- colluding and targeted attacks


@pytest.mark.parametrize("text, attack", [("alie1.5", Attack("alie", 1.5)), ("ipm10", Attack("ipm", 10)),
                                          ("minmax", Attack("minmax", 1)), ("minsum", Attack("minsum", 1)),
                                          ("labelflip3", Attack("labelflip", 3))])
def test_adaptive_attack_names_round_trip(text, attack):
    assert Attack.parse(text) == attack and attack.name == text


@pytest.mark.parametrize("text", ["minmax2", "labelflip1.5", "alie", "ipm0"])
def test_invalid_adaptive_attacks_are_refused(text):
    with pytest.raises(ValueError, match="Invalid"):
        Attack.parse(text)


HONEST = np.random.default_rng(7).normal(size=(6, 5))


def test_alie_and_ipm_against_their_formulas():
    from simulations.poisoning import colluding_update

    mu, sigma = HONEST.mean(axis=0), HONEST.std(axis=0)
    np.testing.assert_allclose(colluding_update(HONEST, Attack("alie", 1.5)), mu - 1.5 * sigma)
    np.testing.assert_allclose(colluding_update(HONEST, Attack("ipm", 4)), -4 * mu)


@pytest.mark.parametrize("kind", ["minmax", "minsum"])
def test_minmax_and_minsum_stay_inside_the_honest_spread_at_its_edge(kind):
    from simulations.poisoning import colluding_update

    mu, sigma = HONEST.mean(axis=0), HONEST.std(axis=0)
    sq = ((HONEST[:, None] - HONEST[None]) ** 2).sum(axis=2)
    bound = sq.max() if kind == "minmax" else sq.sum(axis=1).max()

    def figure(m):
        d2 = ((HONEST - m) ** 2).sum(axis=1)
        return d2.max() if kind == "minmax" else d2.sum()

    m = colluding_update(HONEST, Attack(kind, 1))
    gamma = float(np.mean((mu - m) / sigma))
    np.testing.assert_allclose(m, mu - gamma * sigma)
    assert gamma > 0 and figure(m) <= bound * (1 + 1e-9)
    assert figure(mu - 1.01 * gamma * sigma) > bound  # the largest such gamma


@pytest.mark.parametrize("kind", ["alie", "ipm", "minmax", "minsum"])
def test_colluding_updates_obey_the_top_k_budget(kind):
    """Cut to ``limit`` values (the largest kept); min-max / min-sum pick gamma for the cut
    update, so it still reaches the edge of the honest spread."""
    from simulations.poisoning import colluding_update

    honest = np.random.default_rng(8).normal(size=(6, 40))
    cut = colluding_update(honest, Attack.parse(kind if kind in ("minmax", "minsum") else f"{kind}1"), limit=4)
    assert np.count_nonzero(cut) == 4
    if kind in ("minmax", "minsum"):
        sq = ((honest[:, None] - honest[None]) ** 2).sum(axis=2)
        d2 = ((honest - cut) ** 2).sum(axis=1)
        bound, reached = (sq.max(), d2.max()) if kind == "minmax" else (sq.sum(axis=1).max(), d2.sum())
        assert 0.99 * bound <= reached <= bound * (1 + 1e-9)


def test_collude_replaces_the_attackers_updates_only():
    from fedind.server.pipeline import SiteUpdate
    from simulations.poisoning import collude, colluding_update

    rng = np.random.default_rng(3)
    sent = {"conv.weight": np.ones((2, 3), np.float32), "head.bias": np.zeros(3, np.float32)}

    def site(i):
        weights = {k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in sent.items()}
        delta = {k: w.astype(np.float64) - sent[k] for k, w in weights.items()}
        return SiteUpdate(f"line-{i:02d}", i + 1, 10.0, (5, 3, 2), delta, weights, None)

    updates = [site(i) for i in range(5)]
    honest_deltas = [{k: v.copy() for k, v in u.delta.items()} for u in updates]
    collude(updates, Attack("ipm", 2), {"line-03", "line-04"})
    flat = np.stack([d["conv.weight"].ravel() for d in honest_deltas])
    expected = colluding_update(flat, Attack("ipm", 2))
    for i, u in enumerate(updates):
        if i < 3:
            np.testing.assert_array_equal(u.delta["conv.weight"], honest_deltas[i]["conv.weight"])
        else:
            np.testing.assert_allclose(u.delta["conv.weight"].ravel(), expected, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(u.weights["conv.weight"], sent["conv.weight"] + u.delta["conv.weight"])
        # the bias is sent as trained: the label-alignment rule reads it
        np.testing.assert_array_equal(u.delta["head.bias"], honest_deltas[i]["head.bias"])


def test_labelflip_relabels_one_class_as_healthy_at_the_attacked_sites_only():
    from fedind.data.format import SiteArrays
    from fedind.data.sources import SiteData
    from simulations.poisoning import relabelled

    data = SiteData("line-00", SiteArrays(np.zeros((5, 1, 2), np.float32), np.array([0, 1, 2, 2, 3])), None)
    load = relabelled(lambda context, config, phase=0: data, sites=(0,), target=2)
    assert load(_context(0), None).train.y.tolist() == [0, 1, 0, 0, 3]
    assert load(_context(3), None).train.y.tolist() == [0, 1, 2, 2, 3]


def test_the_summary_measures_an_attack_against_the_clean_and_the_absent_runs_seed_by_seed():
    from simulations.poisoning import _summarise

    def runs(*finals):
        return [{"seed": s, "final_accuracy": f, "best_accuracy": f, "rejected": 0, "rounds": 1, "curve": [f], "recall": [f]}
                for s, f in enumerate(finals)]

    grid = {("fedind", "clean"): runs(0.90, 0.80), ("fedind", "absent"): runs(0.88, 0.70),
            ("fedind", "minmax"): runs(0.86, 0.70)}
    attacked = _summarise("fedind", "minmax", grid[("fedind", "minmax")], grid, "fedind")
    assert attacked["drop_vs_clean"] == pytest.approx(0.07)  # (0.04 + 0.10) / 2
    assert attacked["drop_vs_absent"] == pytest.approx(0.01)  # (0.02 + 0.00) / 2: beyond losing the line
    assert _summarise("fedind", "absent", grid[("fedind", "absent")], grid, "fedind")["drop_vs_absent"] is None
    del grid[("fedind", "absent")]
    assert _summarise("fedind", "minmax", grid[("fedind", "minmax")], grid, "fedind")["drop_vs_absent"] is None


def test_the_trimmed_calibration_merge_leaves_out_the_farthest_line_of_a_widely_held_class_only():
    from fedind.continual.calibration import ClassMoments
    from simulations.labelflip_calibration import gaps, trimmed

    eye = np.eye(2)[None]
    def part(classes, means):
        return ClassMoments(np.array(classes), np.full(len(classes), 10), np.array(means, float), np.repeat(eye, len(classes), 0))

    near = [part([0, 1], [[0.0, 0.0], [5.0, 5.0]]) for _ in range(4)]
    far = part([0, 1], [[9.0, 0.0], [5.0, 5.0]])  # its class 0 lies far from everyone else's
    distance = gaps(near + [far], 0)
    assert max(distance, key=distance.get) == 4 and distance[4] == pytest.approx(9.0 / np.sqrt(2))
    kept = trimmed(near + [far], 2)
    assert sum(0 in p.classes for p in kept) == 4 and sum(1 in p.classes for p in kept) == 4  # one line per class out
    assert 0 not in kept[-1].classes  # the far line keeps its class 1 but not its class 0
    assert len(trimmed(near[:3] + [far], 2)) == 4  # four holders: fewer than five, nothing left out
