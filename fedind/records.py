"""numpy arrays to and from Flower's ArrayRecord, in one place.

Every record of arrays that the site or the server builds (replies, the sites' saved state,
the served model) goes through :func:`array_record`. It copies nothing already C-ordered
and keeps a 0-d array 0-d (``np.ascontiguousarray`` makes it 1-d, so an array read back
would no longer match its model's shape).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

__all__ = ["array_record", "numpy_arrays"]


def array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord of ``arrays`` (C-ordered, shapes as they are)."""
    return ArrayRecord({name: Array(np.require(a, requirements="C")) for name, a in arrays.items()})


def numpy_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The arrays of ``record`` as numpy arrays, by name."""
    return {name: array.numpy() for name, array in record.items()}
