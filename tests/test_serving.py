"""The served model (fedind.server.serving): an EMA of the global models, restarted when the
model's shapes change, checkpointed through the verified store."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedind.server.checkpoint import CheckpointStore
from fedind.aggregation.averaging import ema_step
from fedind.server.serving import ServedModel


def _model(value: float, classes: int = 3) -> dict[str, np.ndarray]:
    return {
        "conv.weight": np.full((2, 4), value, np.float32),
        "bn.num_batches_tracked": np.array(int(value * 10), np.int64),
        "head.weight": np.full((classes, 4), -value, np.float32),
    }


def _record(model) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in model.items()})


def test_ema_step_mixes_float_arrays_and_keeps_dtypes_and_counters():
    out = ema_step(_model(1.0), _model(3.0), decay=0.25)
    assert out["conv.weight"].dtype == np.float32
    np.testing.assert_allclose(out["conv.weight"], 0.25 * 1.0 + 0.75 * 3.0)
    np.testing.assert_allclose(out["head.weight"], -2.5)
    assert out["bn.num_batches_tracked"] == 30  # a counter is the latest model's, not averaged


def test_ema_step_starts_and_restarts_from_the_model():
    first = ema_step(None, _model(2.0), decay=0.5)
    np.testing.assert_array_equal(first["conv.weight"], 2.0)
    grown = ema_step(_model(1.0), _model(5.0, classes=4), decay=0.5)  # the head grew: restart
    np.testing.assert_array_equal(grown["head.weight"], -5.0)
    assert grown["head.weight"].shape == (4, 4)
    source = _model(7.0)
    copied = ema_step(None, source, decay=0.5)
    copied["conv.weight"][0, 0] = 0.0
    assert source["conv.weight"][0, 0] == 7.0  # the average never aliases the global model


def test_served_model_averages_rounds_and_decay_zero_serves_the_global_model():
    served = ServedModel(0.5)
    for value in (4.0, 0.0, 2.0):
        out = served.update(_record(_model(value)))
    # ((4 * .5 + 0 * .5) * .5 + 2 * .5) = 2.0
    np.testing.assert_allclose(out["conv.weight"].numpy(), 2.0)
    assert list(out.keys()) == list(_model(0.0))
    plain = ServedModel(0.0)
    record = _record(_model(1.0))
    assert plain.update(record) is record and plain.average is None
    with pytest.raises(ValueError, match="served-ema"):
        ServedModel(1.0)


def test_served_average_survives_a_checkpoint(tmp_path):
    served = ServedModel(0.5)
    served.update(_record(_model(1.0)))
    served.update(_record(_model(3.0)))
    store = CheckpointStore(tmp_path / "checkpoints", keep=2)
    store.save(2, _model(3.0), {"served": served.state_dict()})
    resumed = ServedModel(0.5)
    resumed.load_state_dict(store.load_latest().state["served"])
    a = served.update(_record(_model(5.0)))
    b = resumed.update(_record(_model(5.0)))
    for name in a.keys():
        np.testing.assert_array_equal(a[name].numpy(), b[name].numpy())
    fresh = ServedModel(0.5)
    fresh.load_state_dict(ServedModel(0.5).state_dict())  # saved before any round
    assert fresh.average is None and fresh.current(_record(_model(1.0)))["conv.weight"].numpy()[0, 0] == 1.0
