"""Server-side screening of site updates: the robust norm rule and every rejection path."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from fedind import wire
from fedind.server.metering import MeteredGrid
from fedind.server.pipeline import NO_UPDATE
from fedind.server.strategies import FedMedian
from fedind.server.screening import (
    REJECTED_UPDATE,
    AlignmentRecord,
    UpdateScreen,
    clip_factors,
    consensus_cosines,
    consensus_weight,
    label_alignment,
    norm_outliers,
    outlier_bounds,
)

pytestmark = pytest.mark.usefixtures("flower_task_identity")

GLOBAL = {"conv.weight": np.ones((4, 2, 3), np.float32), "head.bias": np.zeros(3, np.float32)}


# --------------------------------------------------------------------------- the rule


def test_fewer_than_three_norms_are_never_flagged():
    assert not norm_outliers([1.0, 1e9]).any()
    assert norm_outliers([]).shape == (0,)


def test_a_hugely_scaled_update_is_flagged_and_only_it():
    norms = [1.0, 1.3, 0.8, 1.1, 0.9, 1.2, 1.05, 0.95, 1.0, 1e6]
    assert norm_outliers(norms).tolist() == [False] * 9 + [True]


def test_the_ordinary_spread_of_honest_sites_is_not_flagged():
    # Non-IID sites: norms spread over 4x, no outlier.
    assert not norm_outliers([0.5, 0.7, 1.0, 1.4, 2.0, 0.6, 1.1, 1.9, 0.8, 1.5]).any()


def test_the_ratio_floor_protects_a_round_of_nearly_equal_norms():
    """MAD ~ 0 would flag any deviation; below min_ratio x the median nothing is flagged."""
    equal = [1.0] * 9
    assert not norm_outliers(equal + [9.9]).any()
    assert norm_outliers(equal + [10.1]).tolist() == [False] * 9 + [True]
    assert norm_outliers(equal + [2.5], min_ratio=2.0)[-1]


def test_the_ratio_ceiling_rejects_a_huge_update_whatever_the_spread():
    """The round of the poisoning benchmark (seed 0, round 30) where honest norms spread
    from 0.23x to 4x the median: the deviation rule alone passed the 321x update."""
    honest = [2.85, 1.13, 0.23, 0.26, 2.36, 0.87, 0.72, 0.25, 4.03]
    assert not norm_outliers(honest + [321.0], max_ratio=1e9).any()  # the hole
    assert norm_outliers(honest + [321.0]).tolist() == [False] * 9 + [True]
    assert not norm_outliers(honest + [27.5]).any()  # the largest honest ratio logged
    assert norm_outliers([1.0] * 9 + [6.0], min_ratio=4.0, max_ratio=5.0)[-1]


def test_zero_norms_and_small_updates_are_not_flagged():
    assert not norm_outliers([0.0, 0.0, 1.0, 1e-9]).any()
    # Sites that did not move do not shrink the scale: only the 60x update is flagged.
    assert norm_outliers([0.0] * 6 + [1.0, 1.2, 0.9, 60.0]).tolist() == [False] * 9 + [True]
    assert not norm_outliers([0.0] * 6 + [1.0, 1.2, 0.9, 5.0]).any()


@pytest.mark.parametrize(
    "norms, kwargs",
    [([1.0, -1.0, 1.0], {}), ([1.0, float("nan"), 2.0], {}), ([1.0, 2.0, 3.0], {"z": 0.0}),
     ([1.0, 2.0, 3.0], {"min_ratio": 1.0}), ([1.0, 2.0, 3.0], {"max_ratio": 5.0}),
     ([1.0, 2.0, 3.0], {"max_ratio": float("inf")}), ([[1.0, 2.0]], {})],
)
def test_invalid_rule_arguments_are_rejected(norms, kwargs):
    with pytest.raises(ValueError, match="Invalid"):
        norm_outliers(norms, **kwargs)


# --------------------------------------------------------------------------- replies


def instruction(node: int) -> Message:
    content = RecordDict(
        {wire.ARRAYS: ArrayRecord({k: Array(v) for k, v in GLOBAL.items()}), wire.CONFIG: ConfigRecord({})}
    )
    return Message(content, message_type=MessageType.TRAIN, dst_node_id=node)


def reply(msg: Message, arrays: dict, metrics: dict | None = None) -> Message:
    metrics = {wire.NUM_EXAMPLES: 10, wire.LABEL_HISTOGRAM: [5, 3, 2]} if metrics is None else metrics
    content = RecordDict(
        {
            wire.ARRAYS: ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()}),
            wire.METRICS: MetricRecord(metrics),
        }
    )
    return Message(content, reply_to=msg)


def honest(node: int, scale: float = 0.01) -> dict:
    rng = np.random.default_rng(node)
    return {k: (v + scale * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in GLOBAL.items()}


def screened(bad_arrays=None, bad_metrics=None, sites: int = 6) -> list[Message]:
    """A round of ``sites`` honest replies where the last one is replaced by the bad one."""
    instructions = {node: instruction(node) for node in range(1, sites + 1)}
    replies = [reply(instructions[n], honest(n)) for n in range(1, sites)]
    replies.append(reply(instructions[sites], bad_arrays or honest(sites), bad_metrics))
    return UpdateScreen(num_classes=3)(instructions, replies)


def test_honest_replies_pass_unchanged():
    out = screened()
    assert not any(r.has_error() for r in out)


def _with(name: str, value) -> dict:
    arrays = honest(99)
    arrays[name] = value
    return arrays


BAD_UPDATES = {
    "NaN": (_with("head.bias", np.array([0.0, np.nan, 0.0], np.float32)), "NaN/Inf"),
    "Inf": (_with("conv.weight", np.full((4, 2, 3), np.inf, np.float32)), "NaN/Inf"),
    "wrong shape": (_with("head.bias", np.zeros(4, np.float32)), "shape"),
    "wrong dtype": (_with("head.bias", np.zeros(3, np.float64)), "dtype"),
    "missing array": ({"conv.weight": GLOBAL["conv.weight"]}, "missing ['head.bias']"),
    "extra array": ({**GLOBAL, "backdoor": np.zeros(2, np.float32)}, "unexpected ['backdoor']"),
    "scaled 1e6x": ({k: (v + 1e6 * (honest(99)[k] - v)).astype(v.dtype) for k, v in GLOBAL.items()}, "outlier"),
}


@pytest.mark.parametrize("kind", list(BAD_UPDATES))
def test_each_kind_of_bad_update_is_rejected_with_its_reason(kind):
    arrays, reason = BAD_UPDATES[kind]
    out = screened(bad_arrays=arrays)
    assert not any(r.has_error() for r in out[:-1])
    assert out[-1].has_error() and out[-1].error.code == REJECTED_UPDATE
    assert reason in out[-1].error.reason and out[-1].error.reason.startswith("rejected update:")
    assert out[-1].error.reason.endswith(f"(site node-{out[-1].metadata.src_node_id})")  # who was screened out


BAD_METRICS = {
    "lying histogram": ({wire.NUM_EXAMPLES: 10, wire.LABEL_HISTOGRAM: [50, 30, 20]}, "sums to 100"),
    "negative count": ({wire.NUM_EXAMPLES: 10, wire.LABEL_HISTOGRAM: [12, -2, 0]}, "non-negative"),
    "wrong classes": ({wire.NUM_EXAMPLES: 10, wire.LABEL_HISTOGRAM: [5, 5]}, "2 classes"),
    "negative examples": ({wire.NUM_EXAMPLES: -1}, "whole number >= 0"),
    "NaN examples": ({wire.NUM_EXAMPLES: float("nan")}, "whole number >= 0"),
    "fractional examples": ({wire.NUM_EXAMPLES: 10.5}, "whole number >= 0"),
    "no examples": ({wire.TRAIN_LOSS: 1.0}, "no 'num-examples'"),
}


@pytest.mark.parametrize("kind", list(BAD_METRICS))
def test_each_kind_of_bad_metric_is_rejected_with_its_reason(kind):
    metrics, reason = BAD_METRICS[kind]
    out = screened(bad_metrics=metrics)
    assert out[-1].has_error() and reason in out[-1].error.reason


def test_error_replies_and_evaluate_replies_pass_through():
    train, evaluate = instruction(1), Message(RecordDict({}), message_type=MessageType.EVALUATE, dst_node_id=2)
    failed = Message(Error(code=1, reason="site crashed"), reply_to=train)
    scored = Message(RecordDict({wire.METRICS: MetricRecord({"accuracy": 0.5})}), reply_to=evaluate)
    out = UpdateScreen()({1: train, 2: evaluate}, [failed, scored])
    assert out[0] is failed and out[1] is scored


def test_the_metered_grid_counts_screened_replies_as_failures():
    instructions = [instruction(n) for n in (1, 2, 3, 4)]
    replies = [reply(m, honest(m.metadata.dst_node_id)) for m in instructions[:3]]
    replies.append(reply(instructions[3], _with("head.bias", np.array([np.nan] * 3, np.float32))))

    class Sites:
        def send_and_receive(self, messages, *, timeout=None):
            return replies

    grid = MeteredGrid(Sites(), screen=UpdateScreen(num_classes=3))
    out = grid.send_and_receive(instructions)
    traffic = grid.take()
    assert [r.has_error() for r in out] == [False, False, False, True]
    assert len(traffic.replies) == 3 and len(traffic.failures) == 1
    assert traffic.failures[0].startswith("node 4: rejected update:")


# --------------------------------------------------------------------------- the norm clip


def test_clip_factors_scale_long_updates_to_the_ratio_times_the_median():
    # median 2.5, bound 2 x 2.5 = 5: only the 10 is scaled, to 5.
    np.testing.assert_allclose(clip_factors([1.0, 2.0, 3.0, 10.0], 2.0), [1.0, 1.0, 1.0, 0.5])
    np.testing.assert_allclose(clip_factors([0.0, 1.0, 4.0], 1.0), [1.0, 1.0, 0.25])
    assert clip_factors([], 1.0).shape == (0,)


@pytest.mark.parametrize("norms, ratio", [([1.0], 0.0), ([1.0], float("inf")), ([1.0, -1.0], 1.0), ([[1.0]], 1.0)])
def test_invalid_clip_arguments_are_rejected(norms, ratio):
    with pytest.raises(ValueError, match="Invalid"):
        clip_factors(norms, ratio)


def _delta_norm(msg: Message) -> float:
    arrays = msg.content[wire.ARRAYS]
    return float(np.sqrt(sum(np.sum((arrays[k].numpy().astype(np.float64) - v) ** 2) for k, v in GLOBAL.items())))


def _boosted_round(clip_ratio, factor: float = 4.0):
    """Six sites; the last sends its update boosted ``factor`` times (4: under the 10x
    floor of the norm rule)."""
    instructions = {node: instruction(node) for node in range(1, 7)}
    replies = [reply(instructions[n], honest(n)) for n in range(1, 6)]
    boosted = {k: (v + factor * (honest(6)[k] - v)).astype(v.dtype) for k, v in GLOBAL.items()}
    replies.append(reply(instructions[6], boosted))
    return replies, UpdateScreen(num_classes=3, clip_ratio=clip_ratio)(instructions, replies)


def test_the_clip_scales_an_accepted_long_update_down_to_the_ratio_times_the_median():
    replies, out = _boosted_round(clip_ratio=1.5)
    assert not any(r.has_error() for r in out)
    median = float(np.median([_delta_norm(r) for r in replies]))
    assert _delta_norm(out[-1]) == pytest.approx(1.5 * median, rel=1e-5)
    # Same direction, same metrics; honest sites under the bound pass as they came.
    before = replies[-1].content[wire.ARRAYS]["conv.weight"].numpy() - GLOBAL["conv.weight"]
    after = out[-1].content[wire.ARRAYS]["conv.weight"].numpy() - GLOBAL["conv.weight"]
    np.testing.assert_allclose(after, before * (1.5 * median / _delta_norm(replies[-1])), rtol=1e-4, atol=1e-7)
    assert out[-1].content[wire.METRICS][wire.NUM_EXAMPLES] == 10
    assert out[-1].metadata.src_node_id == replies[-1].metadata.src_node_id
    shorter = [i for i, r in enumerate(replies) if _delta_norm(r) <= 1.5 * median]
    assert shorter and all(_unchanged(out[i], replies[i]) for i in shorter)


def test_without_a_clip_ratio_accepted_updates_are_untouched():
    replies, out = _boosted_round(clip_ratio=None)
    assert all(_unchanged(o, r) for o, r in zip(out, replies))


def test_rejected_updates_stay_rejected_under_the_clip():
    instructions = {node: instruction(node) for node in range(1, 7)}
    replies = [reply(instructions[n], honest(n)) for n in range(1, 6)]
    replies.append(reply(instructions[6], BAD_UPDATES["scaled 1e6x"][0]))
    out = UpdateScreen(num_classes=3, clip_ratio=1.0)(instructions, replies)
    assert out[-1].has_error() and "outlier" in out[-1].error.reason



def test_an_outlying_norm_short_of_the_ceiling_is_scaled_down_to_the_bound_not_rejected():
    """An honest line that keeps learning late in a run sends 10-27x the median: it is
    scaled down to the rule's bound and its metrics and direction are kept."""
    replies, out = _boosted_round(None, 20.0)
    assert not any(r.has_error() for r in out)
    norms = [_delta_norm(r) for r in replies]
    bound, ceiling = outlier_bounds(norms)
    assert max(norms[:-1]) < bound < norms[-1] < ceiling
    assert _delta_norm(out[-1]) == pytest.approx(bound, rel=1e-5)
    before = replies[-1].content[wire.ARRAYS]["conv.weight"].numpy() - GLOBAL["conv.weight"]
    after = out[-1].content[wire.ARRAYS]["conv.weight"].numpy() - GLOBAL["conv.weight"]
    np.testing.assert_allclose(after, before * (bound / norms[-1]), rtol=1e-4, atol=1e-7)
    assert out[-1].content[wire.METRICS][wire.LABEL_HISTOGRAM] == [5, 3, 2]
    assert all(_unchanged(o, r) for o, r in zip(out[:-1], replies[:-1]))


def test_a_norm_beyond_the_ceiling_is_rejected():
    _, out = _boosted_round(None, 80.0)
    assert out[-1].has_error() and "outlier" in out[-1].error.reason
    assert not any(r.has_error() for r in out[:-1])


def test_outlier_bounds_scale_with_the_median_of_the_moved_sites():
    bound, ceiling = outlier_bounds([0.0, 0.0, 2.0, 2.0, 2.0])
    assert bound == pytest.approx(20.0) and ceiling == pytest.approx(100.0)
    assert outlier_bounds([0.0, 1.0, 2.0]) == (float("inf"), float("inf"))


# --------------------------------------------------------------------------- label alignment

SHARES = np.log(np.array([5, 3, 2]) / 10)  # the log label shares of reply()'s default histogram


def test_label_alignment_is_plus_one_towards_the_sites_log_shares_and_minus_one_against():
    assert label_alignment(SHARES - SHARES.mean(), [5, 3, 2]) == pytest.approx(1.0)
    assert label_alignment(-3.0 * SHARES, [5, 3, 2]) == pytest.approx(-1.0)
    assert label_alignment(np.array([1.0, -1.0, 0.0]), [5, 5, 0]) == pytest.approx(
        np.corrcoef([1.0, -1.0, 0.0], np.log([0.5, 0.5, 0.01]))[0, 1]
    )


@pytest.mark.parametrize(
    "bias, histogram",
    [([0.1, 0.2, 0.3], [4, 4, 4]), ([0.2, 0.2, 0.2], [5, 3, 2]), ([0.1, 0.2], [5, 3, 2]), ([0.1, 0.2, 0.3], [0, 0, 0])],
    ids=["uniform labels", "constant update", "length mismatch", "no examples"],
)
def test_label_alignment_is_nan_without_evidence(bias, histogram):
    assert np.isnan(label_alignment(np.array(bias), histogram))


def test_alignment_record_is_a_decayed_mean_and_round_trips():
    record = AlignmentRecord(decay=0.5)
    assert record.add("line-00", 0.5) == (0.5, 1)
    mean, rounds = record.add("line-00", -1.0)
    assert (mean, rounds) == (pytest.approx((0.5 * 0.5 - 1.0) / (0.5 + 1.0)), 2)
    restored = AlignmentRecord(decay=0.5)
    restored.load_state_dict(record.state_dict())
    assert restored.add("line-00", 0.0) == record.add("line-00", 0.0)
    with pytest.raises(ValueError, match="line-01"):
        restored.load_state_dict({"line-01": [1.0, "x", 2]})
    with pytest.raises(ValueError, match="decay"):
        AlignmentRecord(decay=1.0)


def _signed(node: int, alignment: float) -> dict:
    """An honest-looking update whose classifier-bias update has this label alignment
    (a mix of the site's centred log label shares and a centred direction orthogonal to it)."""
    along = (SHARES - SHARES.mean()) / np.linalg.norm(SHARES - SHARES.mean())
    across = np.cross(along, np.ones(3) / np.sqrt(3))
    bias = alignment * along + np.sqrt(1 - alignment**2) * across
    arrays = honest(node)
    arrays["head.bias"] = (GLOBAL["head.bias"] + 0.02 * bias).astype(np.float32)
    return arrays


def _alignment_rounds(screen: UpdateScreen, rounds: int, flipper_sign: float = -1.0) -> list[list[Message]]:
    """``rounds`` rounds of five aligned sites and one (node 6) whose bias update has label
    alignment ``flipper_sign``."""
    out = []
    for _ in range(rounds):
        instructions = {node: instruction(node) for node in range(1, 7)}
        replies = [reply(instructions[n], _signed(n, 1.0)) for n in range(1, 6)]
        replies.append(reply(instructions[6], _signed(6, flipper_sign)))
        out.append(screen(instructions, replies))
    return out


def test_a_site_whose_bias_update_runs_against_its_labels_is_rejected_after_the_warm_up():
    screen = UpdateScreen(num_classes=3, alignment_threshold=-0.4, alignment_warmup=3)
    rounds = _alignment_rounds(screen, 4)
    for t, out in enumerate(rounds, start=1):
        assert not any(r.has_error() for r in out[:5])
        assert out[5].has_error() == (t >= 3)
    assert "label alignment -1.00 < -0.4" in rounds[2][5].error.reason
    assert "rejected for the rest of the run" in rounds[3][5].error.reason
    assert "(site node-6)" in rounds[-1][5].error.reason


def test_a_rejected_site_stays_rejected_in_a_round_whose_update_leaves_the_bias_out():
    """A top-k update that did not select the bias has no alignment (NaN): it is no
    evidence either way, so it neither moves the record nor lets a banned site back in."""
    screen = UpdateScreen(num_classes=3, alignment_threshold=-0.4, alignment_warmup=3)
    _alignment_rounds(screen, 3)  # node 6 rejected from its third round
    instructions = {node: instruction(node) for node in range(1, 7)}
    silent = _signed(6, -1.0)
    silent["head.bias"] = GLOBAL["head.bias"].copy()  # no bias change this round
    out = screen(instructions, [reply(instructions[n], _signed(n, 1.0)) for n in range(1, 6)]
                 + [reply(instructions[6], silent)])
    assert not any(r.has_error() for r in out[:5])
    assert out[5].has_error() and "no bias change this round" in out[5].error.reason
    assert screen.alignment.current("node-6")[1] == 3  # the record did not move


def test_the_alignment_record_survives_a_resume_through_the_screen_state():
    first = UpdateScreen(num_classes=3, alignment_threshold=-0.4)
    _alignment_rounds(first, 2)
    resumed = UpdateScreen(num_classes=3, alignment_threshold=-0.4)
    resumed.load_state_dict(first.state_dict())
    assert _alignment_rounds(resumed, 1)[0][5].has_error()  # its third round: past the warm-up


def test_without_an_alignment_threshold_the_rule_is_off():
    for out in _alignment_rounds(UpdateScreen(num_classes=3), 4):
        assert not any(r.has_error() for r in out)


def test_with_a_release_level_a_site_that_recovers_is_accepted_again():
    screen = UpdateScreen(num_classes=3, alignment_threshold=-0.4, alignment_release=0.0, alignment_decay=0.5)
    assert _alignment_rounds(screen, 3)[-1][5].has_error()
    assert not _alignment_rounds(screen, 3, flipper_sign=1.0)[-1][5].has_error()


def test_by_default_a_rejected_site_stays_rejected_for_the_run():
    screen = UpdateScreen(num_classes=3, alignment_threshold=-0.4, alignment_decay=0.5)
    assert _alignment_rounds(screen, 3)[-1][5].has_error()
    later = _alignment_rounds(screen, 5, flipper_sign=1.0)
    assert all(out[5].has_error() for out in later)
    assert "rejected for the rest of the run" in later[-1][5].error.reason


def test_a_rejected_site_stays_rejected_until_its_record_reaches_the_release_level():
    flagged = UpdateScreen(num_classes=3, alignment_threshold=-0.4, alignment_release=0.0)
    assert _alignment_rounds(flagged, 3)[-1][5].has_error()
    later = _alignment_rounds(flagged, 10, flipper_sign=-0.2)
    assert all(out[5].has_error() for out in later)  # its mean climbs past -0.4 but stays below 0
    assert "< 0:" in later[-1][5].error.reason and "this round -0.20" in later[-1][5].error.reason
    never_flagged = UpdateScreen(num_classes=3, alignment_threshold=-0.4, alignment_release=0.0)
    assert not any(out[5].has_error() for out in _alignment_rounds(never_flagged, 10, flipper_sign=-0.2))


def test_the_label_alignment_of_the_test_updates_is_what_they_say():
    bias_update = _signed(6, -0.2)["head.bias"] - GLOBAL["head.bias"]
    assert label_alignment(bias_update, [5, 3, 2]) == pytest.approx(-0.2, abs=1e-4)


@pytest.mark.parametrize("threshold, release", [(-1.5, 0.0), (-0.4, -0.5), (0.5, 1.5)])
def test_invalid_alignment_threshold_is_rejected(threshold, release):
    with pytest.raises(ValueError, match="alignment_threshold"):
        UpdateScreen(alignment_threshold=threshold, alignment_release=release)


def test_a_reply_that_trained_on_no_windows_passes_with_no_update():
    """num-examples 0 (a line whose windows are all of classes the head lacks): the reply
    passes, carrying its metrics, but typed as no update: whatever it sent is dropped, so
    even a robust mean that ignores the example counts takes nothing from it."""
    out = screened(bad_arrays=_with("head.bias", np.full(3, 1e6, np.float32)),
                   bad_metrics={wire.NUM_EXAMPLES: 0, wire.LABEL_HISTOGRAM: [0, 0, 0]})
    assert not out[-1].has_error()
    assert out[-1].update.change is NO_UPDATE and not out[-1].update.has_update
    assert wire.ARRAYS not in out[-1].content.array_records
    assert out[-1].content[wire.METRICS][wire.NUM_EXAMPLES] == 0
    median = FedMedian(min_train_nodes=1, min_available_nodes=1)  # fedind's: drops a no-update reply
    median.configure_train(1, ArrayRecord({k: Array(v) for k, v in GLOBAL.items()}), ConfigRecord(), _NoGrid())
    arrays, _ = median.aggregate_train(1, out)
    assert arrays is not None and set(arrays) == set(GLOBAL)
    assert all(not r.has_error() for r in out[:-1])


def _unchanged(out: Message, reply: Message) -> bool:
    """The screen passed ``reply`` as it came: the same site, weights (bit for bit) and metrics."""
    if out.has_error() or out.metadata.src_node_id != reply.metadata.src_node_id:
        return False
    got, sent = out.content[wire.ARRAYS], reply.content[wire.ARRAYS]
    same = set(got) == set(sent) and all(np.array_equal(got[k].numpy(), sent[k].numpy()) for k in sent)
    return same and dict(out.content[wire.METRICS]) == dict(reply.content[wire.METRICS])


class _NoGrid:
    def get_node_ids(self):
        return list(range(1, 7))


def test_consensus_weight_is_one_above_zero_linear_in_the_band_and_zero_below_the_threshold():
    assert consensus_weight(0.3, -0.25) == 1.0 and consensus_weight(0.0, -0.25) == 1.0
    assert consensus_weight(-0.1, -0.25) == pytest.approx(0.6)
    assert consensus_weight(-0.25, -0.25) == 0.0 and consensus_weight(-0.6, -0.25) == 0.0
    with pytest.raises(ValueError, match="threshold"):
        consensus_weight(-0.1, 0.0)


def test_consensus_cosines_are_each_updates_cosine_to_the_coordinate_wise_median():
    updates = [np.array([1.0, 0.0, 1.0]), np.array([1.0, 1.0, 0.0]), np.array([1.0, 0.0, 0.0]),
               np.array([-1.0, 0.0, 0.0]), np.zeros(3)]
    # median (1, 0, 0): cosines 1/sqrt(2), 1/sqrt(2), 1, -1, and 0 for the all-zero update
    np.testing.assert_allclose(consensus_cosines(updates), [2**-0.5, 2**-0.5, 1.0, -1.0, 0.0])
    assert consensus_cosines([np.zeros(2), np.zeros(2), np.ones(2)]).tolist() == [0.0, 0.0, 0.0]


def _consensus_round(screen: UpdateScreen, sites: int = 6, reversed_site: int | None = 6) -> list[Message]:
    """One round of sites moving the same way (plus their own noise); ``reversed_site``
    sends the reverse of such an update (cosine about -0.9 to the round's median)."""
    instructions = {node: instruction(node) for node in range(1, sites + 1)}
    replies = []
    for n in range(1, sites + 1):
        sign = -1.0 if n == reversed_site else 1.0
        arrays = {k: (GLOBAL[k] + sign * (0.02 + honest(n)[k] - GLOBAL[k])).astype(np.float32) for k in GLOBAL}
        replies.append(reply(instructions[n], arrays))
    return screen(instructions, replies)


def test_a_site_that_keeps_running_against_the_median_is_rejected_until_its_record_recovers():
    """From its third round on (the warm-up) a site whose decayed mean cosine is below the
    threshold is rejected for the round; it is judged again every round, and back once its
    record is (β = 0.9: two rounds along the rest after three against)."""
    screen = UpdateScreen(num_classes=3, consensus_threshold=-0.25)
    outs = [_consensus_round(screen) for _ in range(3)]
    assert not any(r.has_error() for out in outs for r in out[:5])
    assert [out[5].has_error() for out in outs] == [False, False, True]
    reason = outs[2][5].error.reason
    assert outs[2][5].error.code == REJECTED_UPDATE and "runs against the round's median update" in reason
    assert "judged again every round" in reason and "(site node-6)" in reason
    later = [_consensus_round(screen, reversed_site=None) for _ in range(2)]
    assert [out[5].has_error() for out in later] == [True, False]
    resumed = UpdateScreen(num_classes=3, consensus_threshold=-0.25)
    resumed.load_state_dict(screen.state_dict())
    assert resumed.consensus.current("node-6") == screen.consensus.current("node-6")


def test_the_consensus_rule_is_off_without_a_threshold_and_needs_three_updates():
    screen = UpdateScreen(num_classes=3)
    assert not any(r.has_error() for _ in range(4) for r in _consensus_round(screen))
    two = UpdateScreen(num_classes=3, consensus_threshold=-0.25)
    assert not any(r.has_error() for _ in range(4) for r in _consensus_round(two, sites=2, reversed_site=2))
    for bad in (0.0, 0.5, -1.5):
        with pytest.raises(ValueError, match="consensus_threshold"):
            UpdateScreen(num_classes=3, consensus_threshold=bad)


def test_a_low_label_alignment_alone_does_not_ban_a_site_whose_update_goes_with_the_rest():
    """The false alarm of issue 35 (an honest line on gearbox seed 7, banned from round 36):
    a site whose bias update runs against its labels while its whole update goes with
    the round's median is not rejected; with its update reversed as well, it is banned."""
    def rounds(screen, body_sign):
        out = []
        for _ in range(4):
            instructions = {node: instruction(node) for node in range(1, 7)}
            arrays = {n: _signed(n, 1.0 if n < 6 else -1.0) for n in range(1, 7)}
            for n, a in arrays.items():  # every site moves the body the same way (the sixth: body_sign)
                a["conv.weight"] = (a["conv.weight"] + (body_sign if n == 6 else 1.0) * 0.05).astype(np.float32)
            out.append(screen(instructions, [reply(instructions[n], arrays[n]) for n in range(1, 7)]))
        return out

    along = UpdateScreen(num_classes=3, alignment_threshold=-0.4, consensus_threshold=-0.25)
    assert not any(r.has_error() for out in rounds(along, 1.0) for r in out)
    assert "node-6" not in along.flagged
    against = UpdateScreen(num_classes=3, alignment_threshold=-0.4, consensus_threshold=-0.25)
    assert [out[5].has_error() for out in rounds(against, -1.0)] == [False, False, True, True]
    assert "node-6" in against.flagged


def test_a_site_a_little_against_the_median_is_weighed_down_and_no_longer_than_the_median_update(flwr_log):
    """Five sites along +1 and a sixth 3.8 times as long at cosine -0.1 to them, round after
    round: from its third round it is accepted, scaled to the median norm times
    1 - mean / threshold (0.6 at a threshold of -0.25), and the log says so."""
    screen = UpdateScreen(num_classes=3, consensus_threshold=-0.25)
    instructions = {node: instruction(node) for node in range(1, 7)}
    size = sum(v.size for v in GLOBAL.values())
    replies = [reply(instructions[n], {k: GLOBAL[k] + np.float32(0.01) for k in GLOBAL}) for n in range(1, 6)]
    ones = np.ones(size) / np.sqrt(size)
    across = np.zeros(size)
    across[0], across[1] = 1 / np.sqrt(2), -1 / np.sqrt(2)  # orthogonal to the median's direction
    against = 0.2 * (-0.1 * ones + np.sqrt(1 - 0.01) * across)
    offsets = np.cumsum([GLOBAL[k].size for k in GLOBAL])[:-1]
    sixth = {k: (GLOBAL[k] + part.reshape(GLOBAL[k].shape)).astype(np.float32)
             for k, part in zip(GLOBAL, np.split(against, offsets))}
    for _ in range(3):
        out = screen(instructions, replies + [reply(instructions[6], sixth)])
    assert not any(r.has_error() for r in out)
    got = [np.asarray(out[5].content.array_records["arrays"][k].numpy(), np.float64) - GLOBAL[k] for k in GLOBAL]
    norm = np.sqrt(sum(float((d**2).sum()) for d in got))
    assert norm == pytest.approx(0.6 * 0.01 * np.sqrt(size), rel=1e-3)
    assert "update of site node-6 weighed down to" in flwr_log.text and "runs against the round's median" in flwr_log.text
