"""The running average of a sequence of models (pure numpy): the served model's maths.

The server scores and publishes an exponential moving average of its global models
(:mod:`fedind.server.serving`, ``served-ema``), and a line's site agent keeps the same
average of the models it receives for the line's own service (``line_average`` in
:mod:`fedind.site.app`). One function, so the two are the same to the bit.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["ema_step"]


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
