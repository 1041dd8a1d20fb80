"""The served model: an exponential moving average of the global models (``served-ema``).

On the plant the global model the sites train from moves about 8 points of accuracy from
one round to the next (server momentum, sparse steps, lines that disagree): the round a
target is first crossed, and the model a plant happens to publish at the end, are decided
by that swing as much as by the learning. An average of the last global models sits nearer
the floor of the valley they oscillate across than any one of them (Polyak-Ruppert
averaging; stochastic weight averaging, Izmailov et al. 2018). The server scores and
publishes that average each round; the sites keep training from the global model, so the
learning itself is what it was. The average starts at round 1's model (not the untrained
one) and restarts when the model's shapes change (a grown classifier head). After the last
round, head calibration (where it is on) refits the global model's head, and that model is
published instead (fedind.server.app).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord


def ema_step(average: Mapping[str, np.ndarray] | None, model: Mapping[str, np.ndarray],
             decay: float) -> dict[str, np.ndarray]:
    """``decay * average + (1 - decay) * model`` per array, in ``model``'s dtypes.

    ``model`` alone when there is no average yet or any name or shape differs (the average
    restarts); integer arrays (BatchNorm's batch counter) are taken from ``model``."""
    if average is None or average.keys() != model.keys() or any(
        np.shape(average[name]) != np.shape(model[name]) for name in model
    ):
        return {name: np.array(array, copy=True) for name, array in model.items()}
    out = {}
    for name, array in model.items():
        array = np.asarray(array)
        if np.issubdtype(array.dtype, np.floating):
            mixed = decay * np.asarray(average[name], dtype=np.float64) + (1.0 - decay) * array
            out[name] = mixed.astype(array.dtype)
        else:
            out[name] = np.array(array, copy=True)
    return out


class ServedModel:
    """The model the server scores and publishes: the EMA of the global models after each
    round (``decay`` 0: the global model itself). Checkpointed with the server's state."""

    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"served-ema must be in [0, 1), got {decay}")
        self.decay = decay
        self.average: dict[str, np.ndarray] | None = None

    def update(self, arrays: ArrayRecord) -> ArrayRecord:
        """Fold in the global ``arrays`` after a round; return the served model (``arrays``
        itself with decay 0)."""
        if self.decay == 0.0:
            return arrays
        self.average = ema_step(self.average, {name: a.numpy() for name, a in arrays.items()}, self.decay)
        return self.current(arrays)

    def current(self, arrays: ArrayRecord) -> ArrayRecord:
        """The served model as it stands (``arrays`` when there is no average)."""
        if self.average is None:
            return arrays
        return ArrayRecord({name: Array(np.require(a, requirements="C")) for name, a in self.average.items()})

    def state_dict(self) -> dict:
        return {"average": dict(self.average) if self.average is not None else None}

    def load_state_dict(self, state: Mapping) -> None:
        average = state.get("average")
        self.average = {name: np.asarray(a) for name, a in average.items()} if average is not None else None
