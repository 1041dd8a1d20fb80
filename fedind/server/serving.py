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
from flwr.app import ArrayRecord

from ..aggregation.averaging import ema_step
from ..records import array_record, numpy_arrays


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
        self.average = ema_step(self.average, numpy_arrays(arrays), self.decay)
        return self.current(arrays)

    def current(self, arrays: ArrayRecord) -> ArrayRecord:
        """The served model as it stands (``arrays`` when there is no average)."""
        if self.average is None:
            return arrays
        return array_record(self.average)

    def state_dict(self) -> dict:
        return {"average": dict(self.average) if self.average is not None else None}

    def load_state_dict(self, state: Mapping) -> None:
        average = state.get("average")
        self.average = {name: np.asarray(a) for name, a in average.items()} if average is not None else None
