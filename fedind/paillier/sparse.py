r"""Sparse encrypted rounds: the round's announced coordinate set and the site's residual.

No Flower import (the plumbing: :mod:`fedind.paillier.site`, :mod:`fedind.server.encrypted`).

Under encryption every site must send ciphertexts of the *same* coordinates, or the server
could not add them slot by slot. So the server announces one set :math:`I_t` of ``k``
coordinates per round, built only from what it holds already (never from anything per
site), and every site encrypts its values on it:

.. math::  u'_t = u_t + \gamma r_{t-1}, \qquad
           \ell_t = \mathrm{quantise}(u'_t[I_t]), \qquad
           r_t = u'_t - \mathrm{scatter}_{I_t}(\hat\ell_t)

(:class:`SetFeedback`; :math:`\hat\ell` the dequantised levels, so the residual keeps the
coordinates off the set, the clipped excess and the rounding error: nothing is lost, only
delayed, as with top-k error feedback). Set rules (:func:`announced_set`):

- ``"random"``: ``k`` coordinates drawn without replacement from ``default_rng([seed, round])``;
- ``"change"``: the ``k`` largest :math:`|G_t - G_{t-1}|` of the last global change
  (ties by index); coordinates that have not moved are filled in at random;
- ``"mixed"``: ``k // 2`` largest of the last change, the rest drawn at random among the others.

The head rows of the classes a phase grew (averaged over their holders, ``young-rows =
holders``) are added to every set while they are young (:func:`head_rows`): a new class's
row is what its one holder must be able to send.

The set travels explicitly (sorted ``uint32`` little-endian), named by :func:`set_digest`,
a SHA-256 of the round, the model size and the indices: a payload must name the digest of
the set its site was sent and carry exactly ``k`` values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from .packing import FINE, Layout, dequantise, quantise

__all__ = [
    "SET_RULES", "SetFeedback", "announced_set", "coordinate_masks", "head_rows", "indices_from_bytes", "indices_to_bytes", "set_digest",
]

SET_RULES = ("random", "change", "mixed")


def _random_among(candidates: np.ndarray, size: int, seed: int, server_round: int) -> np.ndarray:
    rng = np.random.default_rng([int(seed), int(server_round), 0x5E7])
    return rng.choice(candidates, size=size, replace=False) if size else candidates[:0]


def announced_set(
    rule: str, server_round: int, count: int, k: int, *, seed: int, last_change: np.ndarray | None = None
) -> np.ndarray:
    """The round's coordinate set: ``k`` sorted distinct int64 indices into ``[0, count)``
    (module docstring). Deterministic in its arguments; ``last_change`` (the server's
    ``G_t - G_{t-1}``, flat) is used by ``"change"`` and ``"mixed"`` (None: random)."""
    if rule not in SET_RULES:
        raise ValueError(f"Invalid rule value: {rule!r} (expected one of {SET_RULES})")
    if not (isinstance(count, int) and count >= 1 and isinstance(k, int) and 1 <= k <= count):
        raise ValueError(f"Invalid set size: k = {k!r} of count = {count!r}")
    everything = np.arange(count, dtype=np.int64)
    top = 0 if rule == "random" else (k if rule == "change" else k // 2)
    chosen = everything[:0]
    if top and last_change is not None:
        mag = np.abs(np.asarray(last_change, dtype=np.float64).ravel())
        if mag.size != count:
            raise ValueError(f"last_change has {mag.size} values, expected {count}")
        order = np.argsort(-mag, kind="stable")[:top]
        chosen = order[mag[order] > 0]
    rest = np.setdiff1d(everything, chosen, assume_unique=True)
    drawn = _random_among(rest, k - chosen.size, seed, server_round)
    return np.sort(np.concatenate([chosen, drawn])).astype(np.int64)


def set_digest(indices: np.ndarray, count: int, server_round: int) -> str:
    """Hex SHA-256 naming the set of ``server_round`` over a model of ``count`` values."""
    digest = hashlib.sha256(b"fedind-paillier-set\0")
    digest.update(np.array([server_round, count, np.size(indices)], dtype="<u8").tobytes())
    digest.update(indices_to_bytes(indices))
    return digest.hexdigest()


def indices_to_bytes(indices: np.ndarray) -> bytes:
    return np.ascontiguousarray(indices, dtype="<u4").tobytes()


def indices_from_bytes(blob: bytes, count: int) -> np.ndarray:
    """Sorted distinct indices below ``count`` from :func:`indices_to_bytes`; ValueError otherwise."""
    if not isinstance(blob, bytes) or len(blob) % 4 or not blob:
        raise ValueError("coordinate set: expected a non-empty multiple of 4 bytes")
    indices = np.frombuffer(blob, dtype="<u4").astype(np.int64)
    if indices[-1] >= count or np.any(np.diff(indices) <= 0):
        raise ValueError(f"coordinate set: indices must be strictly increasing and below {count}")
    return indices


def head_rows(shapes: Mapping[str, tuple[int, ...]], names: Sequence[str], first: int) -> tuple[np.ndarray, np.ndarray]:
    """``(flat indices, class of each)`` of rows ``first`` on of the arrays ``names`` (the
    head's weight and bias: row ``c`` is class ``c``), flat over ``shapes`` in sorted-name
    order as the sites encrypt them."""
    indices, classes, offset = [], [], 0
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        size = int(np.prod(shape))
        if name in names and shape and shape[0] > first:
            per_row = size // shape[0]
            rows = np.arange(first, shape[0], dtype=np.int64)
            indices.append(offset + (rows[:, None] * per_row + np.arange(per_row)).ravel())
            classes.append(np.repeat(rows, per_row))
        offset += size
    if not indices:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(indices), np.concatenate(classes)


def coordinate_masks(indices: np.ndarray, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Boolean masks, one per array of ``shapes``, true on the coordinates of ``indices``
    (flat over the arrays in sorted-name order, as the sites encrypt them)."""
    flat = np.zeros(sum(int(np.prod(shape)) for shape in shapes.values()), dtype=bool)
    flat[np.asarray(indices, dtype=np.int64)] = True
    masks, offset = {}, 0
    for name in sorted(shapes):
        size = int(np.prod(shapes[name]))
        masks[name] = flat[offset : offset + size].reshape(shapes[name])
        offset += size
    return masks


class SetFeedback:
    r"""Site-side error feedback for sparse encrypted rounds (module docstring):
    :math:`u' = u + \gamma r`, the levels of :math:`u'` on the announced set, and
    :math:`r \leftarrow u' - \mathrm{scatter}(\hat\ell)` kept at the site. ``decay``
    :math:`\gamma` as ``topk-residual-decay``. The residual (float32, flat over the model's
    arrays in sorted-name order) is created lazily; :meth:`state_dict` saves it."""

    def __init__(self, clip: float, decay: float = 1.0, layout: Layout = FINE) -> None:
        if not (np.isfinite(clip) and clip > 0):
            raise ValueError(f"Invalid clip value: {clip!r}")
        if isinstance(decay, bool) or not (isinstance(decay, (int, float)) and 0 <= decay <= 1):
            raise ValueError(f"Invalid decay value: {decay!r} (expected 0 <= decay <= 1)")
        self.clip = float(clip)
        self.decay = float(decay)
        self.layout = layout
        self.residual: np.ndarray | None = None

    def encode(
        self, update: np.ndarray, indices: np.ndarray | None, rng: np.random.Generator
    ) -> tuple[np.ndarray, int]:
        """``(levels of u' on indices, number clipped)``; ``indices`` None: every coordinate (a
        dense round, whose residual keeps the clipped excess and the rounding error). The
        residual moves only on success."""
        if indices is None:
            indices = slice(None)
        u = np.asarray(update, dtype=np.float64).ravel()
        if self.residual is not None:
            if self.residual.size != u.size:
                raise ValueError(f"Invalid update: {u.size} values, the residual has {self.residual.size}")
            u = u + self.decay * self.residual
        levels, clipped = quantise(u[indices], self.clip, rng, self.layout)
        u[indices] -= dequantise(levels, 1, self.clip, self.layout)
        self.residual = u.astype(np.float32)
        return levels, clipped

    def residual_norm(self) -> float:
        return 0.0 if self.residual is None else float(np.linalg.norm(self.residual.astype(np.float64)))

    def state_dict(self) -> dict:
        return {"residual": None if self.residual is None else self.residual.copy()}

    def load_state_dict(self, state: Mapping) -> None:
        if not isinstance(state, Mapping) or set(state) != {"residual"}:
            raise ValueError("Invalid SetFeedback state: expected the key 'residual'")
        r = state["residual"]
        if r is not None:
            r = np.array(r, dtype=np.float32).ravel()
            if not np.all(np.isfinite(r)):
                raise ValueError("Invalid SetFeedback state: non-finite residual")
        self.residual = r
