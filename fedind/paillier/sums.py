"""Encrypted side sums: what a phase end (the sites' Fisher, for EWC) and head calibration
(their per-class feature moments) need from every site, summed under Paillier like the
updates. With ``encryption = "paillier"`` the server so learns the federation's Fisher and
moments, never one site's.

Both are per-example means at the site: the Fisher is one already, and the moments are
divided by the site's windows (:func:`fedind.continual.calibration.moments_vector`), so
their scale does not grow with a site's data. The server weights each site by its windows
(integer weights, as for an update), so the decrypted weighted mean is the pooled data's:
the plaintext aggregate, up to the weights' rounding to multiples of 1/512.

They have their own layout, :data:`~fedind.paillier.packing.SIDE`: 40-bit levels under a
clip of 2^16, a step of 6e-8. A Fisher or a second moment does not have an update's scale.
That makes 51-bit slots, 40 values per 2048-bit ciphertext, once per phase end or run end.
A decrypt query for one says so (``sum-of = "side"``), and the decrypting site checks the
payload against this layout (:func:`fedind.paillier.site.decrypt_query`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .keys import PrivateKey, PublicKey
from .packing import SIDE, SIDE_CLIP, EncryptedVector, ObfuscatorPool, encrypt_levels, parse_record, quantise

SIDE_SUM = "side"  # the decrypt query's sum-of for a side sum (wire.SUM_OF)


def flatten(values: Mapping[str, np.ndarray], shapes: Mapping[str, tuple]) -> np.ndarray:
    """``values`` over the arrays ``shapes`` names, sorted by name, flattened (float64): the
    order every encrypted vector of the model has; an array ``values`` lacks is zeros."""
    parts = []
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        value = values.get(name)
        if value is None:
            parts.append(np.zeros(int(np.prod(shape)), dtype=np.float64))
            continue
        value = np.asarray(value, dtype=np.float64)
        if value.shape != shape:
            raise ValueError(f"Invalid {name!r}: shape {value.shape}, expected {shape}")
        parts.append(value.ravel())
    unknown = sorted(set(values) - set(shapes))
    if unknown:
        raise ValueError(f"Invalid values: {unknown} are not arrays of the model")
    return np.concatenate(parts) if parts else np.zeros(0)


def unflatten(flat: np.ndarray, shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """:func:`flatten` undone (float32 arrays); ValueError when the length does not fit."""
    sizes = {name: int(np.prod(tuple(shapes[name]))) for name in sorted(shapes)}
    if np.size(flat) != sum(sizes.values()):
        raise ValueError(f"Invalid flat vector: {np.size(flat)} values for {sum(sizes.values())}")
    out, offset = {}, 0
    for name, size in sizes.items():
        out[name] = np.asarray(flat[offset: offset + size], dtype=np.float32).reshape(tuple(shapes[name]))
        offset += size
    return out


def encrypt_side(values: np.ndarray, key: PrivateKey, rng: np.random.Generator) -> tuple[dict, int]:
    """``(ConfigRecord content, number of values clipped to the side clip)`` of one site's
    side vector (stochastic rounding: its mean is exact)."""
    levels, clipped = quantise(values, SIDE_CLIP, rng, SIDE)
    vector = encrypt_levels(levels, key, SIDE_CLIP, ObfuscatorPool(key), layout=SIDE)
    return vector.to_config(key.public), clipped


def parse_side(record: Mapping, key: PublicKey, count: int) -> EncryptedVector:
    """A site's side vector, checked (CiphertextError naming the fault): the side layout
    and clip, dense, ``count`` values under the federation's key."""
    return parse_record(record, key, kind="update", count=count, clip=SIDE_CLIP, coordinates="", layout=SIDE)
