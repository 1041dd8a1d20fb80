r"""Top-k sparsified site updates with error feedback, quantised values and a wire codec.

Pure numpy, no torch. Flower appears only in :func:`to_record` (imported there), so the
maths and the codec are importable and testable without Flower running.

Site, every round::

    ef = ErrorFeedback(mode="int8", threshold="exact")   # site state, checkpointed
    sparse = ef.compress(delta, ratio=0.01)              # delta = local - global weights
    record = to_record(encode(sparse))                   # ConfigRecord in the reply

Server, every reply::

    try:
        delta = decode(from_record(record), expected_of(global_arrays))
    except PayloadError as err:                          # reject this reply, log str(err)
        ...

Error feedback
--------------
All arrays of an update are treated as one vector (global top-k across the model). With
residual :math:`r_{t-1}` (zeros at first), update :math:`u_t`, ``k = max(1, round(ratio * N))``
over the :math:`N` coordinates of the model:

.. math::

    u'_t = u_t + r_{t-1}, \qquad
    s_t = Q\big(\mathrm{top}_k(u'_t)\big), \qquad
    r_t = u'_t - \hat s_t

where :math:`\mathrm{top}_k` keeps the ``k`` coordinates of largest magnitude (zeros are
never sent, so fewer than ``k`` go when fewer are non-zero), :math:`Q` quantises them and
:math:`\hat s_t` is the dense dequantised message — exactly what the server decodes. So the
residual absorbs the quantisation error as well as the unsent coordinates, and
:math:`\hat s_t + r_t = u_t + r_{t-1}` up to one float32 rounding of :math:`r_t` (for
``int8`` the subtraction is nearly always exact by Sterbenz' lemma, :math:`\hat s` being
within a factor 2 of :math:`u'`): nothing a site computes is lost, only delayed.

Quantisation (per tensor, over the values sent in that tensor)
--------------------------------------------------------------
- ``int8``: ``scale = max|v|``, ``q = round(v / scale * 127)`` in ``[-127, 127]``,
  ``v^ = q * float32(scale / 127)``. Per-coordinate error
  ``|v - v^| <= scale / 254 + scale * 2**-22`` (half a step, plus float32 rounding).
- ``int4``: as ``int8`` with 7 levels: ``q`` in ``[-7, 7]``, error ``<= scale / 14`` (plus
  float32 rounding). Half the bytes of ``int8`` per value; error feedback carries the rest.
- ``sign``: ``scale = mean|v|``, ``v^ = sign(v) * scale`` (1 bit per value). Error
  ``|v - v^| = ||v| - scale| <= max|v| - min|v|``; biased per coordinate, which error
  feedback corrects over the following rounds.

Wire format version 3 (current; what :func:`encode` writes)
----------------------------------------------------------
Version 2's records (below) with two changes that make a top-k payload about 15 %
smaller at 1.5 % density, losslessly (the same codes and indices as version 2):

- index encoding ``3`` = **Rice**, chosen when it is the smallest of the three. The block
  is the Rice parameter ``k`` (1 byte, ``<= 31``), then one bit stream (LSB first) of
  every gap's ``k``-bit remainder, followed by every gap's quotient ``q`` as ``q`` zero
  bits and a one, padded with zero bits to a whole byte (less than a byte of padding).
  The gaps are ``idx[0]`` and ``idx[i] - idx[i-1] - 1``, so duplicates cannot be written;
  ``gap = q * 2**k + remainder``. Geometric-like gaps of mean ``m`` take about
  ``log2(m) + 1.5`` bits where a varint takes 8 or 16.
- the **value block** of ``int8`` and ``int4``: ``low`` (1 byte, the smallest code
  magnitude), ``width`` (1 byte, ``<= 7``, the bits of ``|code| - low``), then per value
  its sign bit (1 = negative) and ``width`` bits of ``|code| - low`` (LSB first), padded
  with zero bits to a whole byte. Top-k values lie between the threshold and the maximum,
  so their int4 codes are mostly 4 to 7: 3 bits instead of 4. Every magnitude must be
  ``<= levels``; a sign bit on magnitude 0 is rejected. ``sign`` mode: as version 2.

Wire format version 2 (older; still decoded, written with ``encode(..., version=2)``)
-------------------------------------------------------------------------------------
Fixed integers little-endian; ``varint`` is unsigned LEB128 (minimal, at most 5 bytes,
< 2**32). Tensors are identified by POSITION, not by name: record ``i`` belongs to the
``i``-th name of the model's arrays sorted by Unicode code point (Python's ``sorted``;
:func:`encode` sorts the names of its input, :func:`decode` iterates
``sorted(expected)``). There is a record for every array, none is named and none carries
its size: the receiver's ``expected`` shapes give ``numel``, and the layout fingerprint
makes sure sender and receiver mean the same layout.

===============  =======  ============================================================
field            bytes    meaning
===============  =======  ============================================================
magic            4        ``b"FIDZ"``
version          1        ``2``
mode             1        value quantisation: ``1`` = int8, ``2`` = sign (1 bit + scale),
                          ``3`` = int4
fingerprint      4        u32 layout fingerprint (below); must equal the receiver's
*for each array, in sorted-name order:*
count            varint   number of sent coordinates, ``<= numel``; if ``0``, the record
                          ends here (no scale, blocks or lengths)
scale            4        f32, finite, ``> 0`` (only if ``count > 0``)
index enc.       1        ``1`` = delta-varint, ``2`` = bitmap (only if ``count > 0``)
index length     varint   ``I`` (only if ``count > 0``)
index block      I        as in version 1; a bitmap is ``ceil(numel / 8)`` bytes
value block      V        ``V = count`` int8 codes in ``[-127, 127]`` (int8), or
                          ``V = ceil(count / 2)`` bytes of int4 codes in ``[-7, 7]`` (4-bit
                          two's complement, low nibble first, padding nibble 0), or
                          ``V = ceil(count / 8)`` bytes of sign bits (1 = negative, LSB
                          first, padding bits 0); the length is implied, not sent
===============  =======  ============================================================

The payload ends after the last array's record (trailing bytes are an error). The layout
fingerprint is ``zlib.crc32`` of the UTF-8 bytes of the compact, ASCII-escaped JSON list
of ``[name, [dims...]]`` pairs in sorted-name order, e.g.
``[["b",[3]],["w",[2,4]]]`` (``json.dumps(..., separators=(",", ":"))``): a payload built
for other array names or shapes is rejected ("layout fingerprint mismatch") instead of
being decoded into the wrong arrays. Dtypes are not part of it.

Wire format version 1 (older; still decoded, written with ``encode(..., version=1)``)
-------------------------------------------------------------------------------------
All integers little-endian. Tensors are identified by name and may come in any order.

============  =======  ===============================================================
field         bytes    meaning
============  =======  ===============================================================
magic         4        ``b"FIDZ"``
version       1        ``1``
mode          1        value quantisation: ``1`` = int8, ``2`` = sign (1 bit + scale)
tensors       4        u32 ``T``, number of tensor records that follow
*T times:*
name length   2        u16 ``L``
name          L        UTF-8 array name (as in the model's state dict)
numel         4        u32 number of elements of the dense array
count         4        u32 number of sent coordinates, ``<= numel``
scale         4        f32, finite; ``> 0`` if ``count > 0``, ``0`` if ``count == 0``
index enc.    1        ``1`` = delta-varint, ``2`` = bitmap (smaller one, per tensor)
index length  4        u32 ``I``
index block   I        see below
value length  4        u32 ``V``: ``count`` (int8), ``ceil(count / 2)`` (int4) or ``ceil(count / 8)`` (sign)
value block   V        int8 codes in ``[-127, 127]``, or sign bits (1 = negative,
                       LSB first, padding bits 0)
============  =======  ===============================================================

Index blocks (both versions) hold the flat (C-order) indices, strictly increasing:

- delta-varint: ``count`` unsigned LEB128 varints (minimal, at most 5 bytes, < 2**32) of
  ``idx[0]`` then ``idx[i] - idx[i-1]`` — a zero delta is a duplicate index;
- bitmap: ``ceil(numel / 8)`` bytes, bit ``i`` (LSB first) set iff index ``i`` is sent,
  padding bits 0, popcount ``== count``.

The encoder picks, per tensor, whichever index block is smaller (varint on ties). No
pickle anywhere. :func:`decode` checks every field and raises :class:`PayloadError` with
the reason; nothing of a malformed payload is used.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = [
    "FORMAT",
    "MODES",
    "THRESHOLDS",
    "VERSION",
    "VERSIONS",
    "ErrorFeedback",
    "EstimateFeedback",
    "PayloadError",
    "SparseTensor",
    "decayed",
    "decode",
    "dense_size_bytes",
    "dequantise",
    "encode",
    "encoded_size",
    "estimate_token",
    "expected_of",
    "layout_fingerprint",
    "from_record",
    "quantise",
    "sampled_topk_indices",
    "to_record",
    "topk_indices",
    "warmup_ratio",
]

MAGIC = b"FIDZ"
VERSION = 3  # what encode() writes
VERSIONS = (1, 2, 3)  # what decode() reads
MODES = ("int8", "int4", "sign")
THRESHOLDS = ("exact", "sampled")
_MODE_CODE = {"int8": 1, "sign": 2, "int4": 3}
_MODE_NAME = {v: k for k, v in _MODE_CODE.items()}
INDEX_VARINT = 1
INDEX_BITMAP = 2
INDEX_RICE = 3  # version 3 only
_INDEX_NAME = {INDEX_VARINT: "delta-varint", INDEX_BITMAP: "bitmap", INDEX_RICE: "Rice"}
_INDEX_ENCODINGS = {1: (INDEX_VARINT, INDEX_BITMAP), 2: (INDEX_VARINT, INDEX_BITMAP), 3: tuple(_INDEX_NAME)}
_RICE_MAX_K = 31
_U32_MAX = 2**32 - 1
_LEVELS = {"int8": 127, "int4": 7}  # linear modes: codes in [-levels, levels]

# The ConfigRecord that carries a payload (lead: candidates for fedind/wire.py).
FORMAT = "fedind.topk"
FORMAT_KEY = "format"
VERSION_KEY = "version"
PAYLOAD_KEY = "payload"

# "sampled" threshold: sample enough coordinates that ~SAMPLE_HITS of them lie above the
# true k-th magnitude, and aim the threshold OVERSAMPLE times lower so it lets >= k through.
SAMPLE_MIN = 1024
SAMPLE_HITS = 100
OVERSAMPLE = 1.5


class PayloadError(ValueError):
    """A site's compressed payload is malformed; the message says which field and why."""


# --------------------------------------------------------------------------- quantisation


def quantise(values: np.ndarray, mode: str) -> tuple[np.ndarray, float]:
    """``(codes int8, scale)`` of the 1-D float ``values`` (non-zero, finite) for ``mode``.

    ``int8``: ``scale = max|v|`` (float32), ``codes = round(v / scale * 127)``.
    ``int4``: the same with 7 levels, ``codes`` in ``[-7, 7]``.
    ``sign``: ``scale = float32(mean|v|)``, ``codes = sign(v)`` in ``{-1, +1}``.
    An empty ``values`` gives ``(empty, 0.0)``. See the module docstring for error bounds.
    """
    if mode not in MODES:
        raise ValueError(f"Invalid mode: {mode!r} (expected one of {MODES})")
    v = np.asarray(values, dtype=np.float32).ravel()
    if v.size == 0:
        return np.zeros(0, dtype=np.int8), 0.0
    mag = np.abs(v)
    if mode in _LEVELS:
        levels = _LEVELS[mode]
        scale = np.float32(mag.max())
        if not scale > 0:
            raise ValueError("Invalid values: all zero (zeros are never sent)")
        q = np.rint(v.astype(np.float64) * (levels / np.float64(scale)))
        codes = np.clip(q, -levels, levels).astype(np.int8)
    else:
        # mean of non-zero float32 magnitudes >= their minimum > 0, so scale > 0
        scale = np.float32(mag.astype(np.float64).mean())
        if not scale > 0:
            raise ValueError("Invalid values: all zero (zeros are never sent)")
        codes = np.where(v < 0, -1, 1).astype(np.int8)
    return codes, float(scale)


def dequantise(codes: np.ndarray, scale: float, mode: str) -> np.ndarray:
    """float32 values of ``codes``: ``codes * float32(scale / 127)`` (int8) or
    ``codes * scale`` (sign). The site and the server both call this, so they agree bit
    for bit on what was sent."""
    codes = np.asarray(codes, dtype=np.int8)
    if mode in _LEVELS:
        step = np.float32(np.float64(np.float32(scale)) / _LEVELS[mode])
        return codes.astype(np.float32) * step
    if mode == "sign":
        return codes.astype(np.float32) * np.float32(scale)
    raise ValueError(f"Invalid mode: {mode!r} (expected one of {MODES})")


# --------------------------------------------------------------------------- top-k


def topk_indices(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """Sorted flat indices of the ``k`` largest ``magnitudes`` (>= 0), zeros left out.

    ``np.argpartition``, O(N). Ties at the k-th value are broken by argpartition
    (deterministic for a given input).
    """
    mag = np.asarray(magnitudes).ravel()
    if k < 0:
        raise ValueError(f"Invalid k: {k}")
    if k >= mag.size:
        return np.flatnonzero(mag > 0)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.argpartition(mag, mag.size - k)[mag.size - k :]
    idx = idx[mag[idx] > 0]
    idx.sort()
    return idx.astype(np.int64, copy=False)


def sampled_topk_indices(
    magnitudes: np.ndarray, k: int, rng: np.random.Generator, sample_size: int | None = None
) -> np.ndarray:
    """Approximate :func:`topk_indices` from a random sample (DGC-style threshold).

    1. Draw ``s = max(SAMPLE_MIN, ceil(SAMPLE_HITS * N / k))`` magnitudes with replacement
       (or ``sample_size``); if ``s >= N`` sampling saves nothing and the exact top-k is
       returned.
    2. The threshold ``t`` is the ``h``-th largest sampled magnitude with
       ``h = ceil(OVERSAMPLE * k * s / N)``: an estimate of the ``1.5 k``-th largest
       magnitude of the whole vector.
    3. Candidates are all coordinates with ``|u| >= t`` (one vectorised comparison); if
       there are more than ``k`` — the usual case — the exact top-k of the candidates is
       kept (argpartition over ~1.5k values instead of N).

    So the count is never more than ``k``. It is less only when fewer than ``k``
    coordinates pass ``t``: the share of coordinates above the ``h``-th sample order
    statistic has relative standard deviation ``~ 1/sqrt(h)`` (``h >= 150`` by default,
    ~8 %), and falling short needs an undershoot of 1/3, about four standard deviations
    (probability ~1e-4). Even then the count stays near ``k`` (``>= k / 2`` needs another
    ~4 sigma). Zeros are never sent, as in the exact version.
    """
    mag = np.asarray(magnitudes).ravel()
    n = mag.size
    if k <= 0 or k >= n:
        return topk_indices(mag, k)
    s = sample_size if sample_size is not None else max(SAMPLE_MIN, math.ceil(SAMPLE_HITS * n / k))
    if s < 1:
        raise ValueError(f"Invalid sample_size: {sample_size}")
    if s >= n:
        return topk_indices(mag, k)
    sample = mag[rng.integers(0, n, size=s)]
    h = min(s, math.ceil(OVERSAMPLE * k * s / n))
    threshold = np.partition(sample, s - h)[s - h]
    if threshold > 0:
        cand = np.flatnonzero(mag >= threshold)
    else:
        cand = np.flatnonzero(mag > 0)
    if cand.size > k:
        cand = cand[np.argpartition(mag[cand], cand.size - k)[cand.size - k :]]
        cand.sort()
    return cand.astype(np.int64, copy=False)


def warmup_ratio(ratio: float, server_round: int, warmup_rounds: int) -> float:
    r"""Share of coordinates to send in ``server_round`` (1-based) with a sparsity warm-up.

    DGC's warm-up, per round: the density falls geometrically from 1 towards ``ratio``
    over the first ``warmup_rounds`` rounds, then stays at ``ratio``:

    .. math::  \rho_t = \rho^{\min(1,\, t / (W + 1))}

    so with ``ratio = 0.01`` and ``W = 3``: 0.316, 0.1, 0.0316, then 0.01. Early rounds move
    the model most (largest learning rate, furthest from a good model); what a sparse
    update holds back then is stale by the time error feedback sends it. ``W = 0``: always
    ``ratio``.
    """
    if isinstance(ratio, bool) or not (isinstance(ratio, (int, float, np.floating)) and 0 < ratio <= 1):
        raise ValueError(f"Invalid ratio value: {ratio!r} (expected 0 < ratio <= 1)")
    for name, value, low in (("server_round", server_round, 1), ("warmup_rounds", warmup_rounds, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"Invalid {name} value: {value!r} (expected an int >= {low})")
    if server_round > warmup_rounds:
        return float(ratio)
    return float(ratio ** (server_round / (warmup_rounds + 1)))


# --------------------------------------------------------------------------- sparse tensor


@dataclass(frozen=True, eq=False)
class SparseTensor:
    """One array's share of a compressed update: what goes on the wire for it.

    ``indices``: strictly increasing flat (C-order) indices into ``shape`` (int64);
    ``codes``: int8 quantised values, one per index; ``scale``: float32-representable;
    ``mode``: ``"int8"``, ``"int4"`` or ``"sign"``. :meth:`values` / :meth:`to_dense` dequantise.
    """

    shape: tuple[int, ...]
    indices: np.ndarray
    codes: np.ndarray
    scale: float
    mode: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        indices = np.asarray(self.indices)
        codes = np.asarray(self.codes)
        if self.mode not in MODES:
            raise ValueError(f"Invalid mode: {self.mode!r} (expected one of {MODES})")
        if indices.ndim != 1 or not (indices.size == 0 or np.issubdtype(indices.dtype, np.integer)):
            raise ValueError(f"Invalid indices: expected 1-D integers, got {indices.dtype} {indices.shape}")
        if codes.dtype != np.int8 or codes.shape != indices.shape:
            raise ValueError(f"Invalid codes: expected int8 of shape {indices.shape}, got {codes.dtype} {codes.shape}")
        numel = math.prod(self.shape)
        if numel > _U32_MAX:
            raise ValueError(f"Invalid shape {self.shape}: more than 2**32 - 1 elements")
        if indices.size and (indices[0] < 0 or indices[-1] >= numel or np.any(np.diff(indices) <= 0)):
            raise ValueError("Invalid indices: must be strictly increasing and in range")
        scale = float(self.scale)
        if not np.isfinite(scale) or float(np.float32(scale)) != scale:
            raise ValueError(f"Invalid scale: {self.scale} (must be a finite float32)")
        if indices.size and not scale > 0:
            raise ValueError(f"Invalid scale: {self.scale} (must be > 0 when values are sent)")
        if not indices.size and scale != 0:
            raise ValueError(f"Invalid scale: {self.scale} (must be 0 when nothing is sent)")
        if self.mode in _LEVELS and np.any(np.abs(codes.astype(np.int16)) > _LEVELS[self.mode]):
            levels = _LEVELS[self.mode]
            raise ValueError(f"Invalid codes: {self.mode} codes lie in [-{levels}, {levels}]")
        if self.mode == "sign" and np.any((codes != 1) & (codes != -1)):
            raise ValueError("Invalid codes: sign codes are -1 or +1")
        object.__setattr__(self, "indices", indices.astype(np.int64, copy=False))
        object.__setattr__(self, "codes", codes)
        object.__setattr__(self, "scale", scale)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def count(self) -> int:
        return int(self.indices.size)

    def values(self) -> np.ndarray:
        """Dequantised float32 values, one per index."""
        return dequantise(self.codes, self.scale, self.mode)

    def to_dense(self) -> np.ndarray:
        """Dense float32 array of ``shape``: the values at ``indices``, zeros elsewhere."""
        dense = np.zeros(self.numel, dtype=np.float32)
        dense[self.indices] = self.values()
        return dense.reshape(self.shape)


# --------------------------------------------------------------------------- error feedback


class ErrorFeedback:
    r"""Site-side top-k sparsification with error feedback (residual carried over rounds).

    .. math::

        u' = u + \gamma r, \qquad s = Q(\mathrm{top}_k(u')), \qquad r \leftarrow u' - \hat s

    with ``k = max(1, round(ratio * N))`` over all ``N`` coordinates of the update taken
    together (global top-k), ``Q`` the per-tensor quantiser of ``mode`` and :math:`\hat s`
    its dequantised value, so :math:`\hat s + r_{new} = u + \gamma r_{old}`.

    ``threshold="exact"`` selects with argpartition; ``"sampled"`` estimates the k-th
    magnitude from a random sample (:func:`sampled_topk_indices`: never more than ``k``
    coordinates, fewer with probability ~1e-4). Its random draws come from
    ``default_rng([seed, step])``, ``step`` counting calls to :meth:`compress` and saved in
    :meth:`state_dict`, so a restored site draws what it would have drawn.

    ``decay`` :math:`\gamma \in [0, 1]` scales the carried residual,
    :math:`u' = u + \gamma r` (1 = classic error feedback, nothing lost; 0 = plain top-k,
    no memory). Why less than 1 can help in federated learning: a site's update is the
    displacement of several local epochs from the current global model, not a gradient;
    when a coordinate is not sent, the next round's local training pushes it again from
    the same place, so a full residual counts that displacement twice.

    Residuals are float32, created lazily by the first :meth:`compress`; later updates must
    have the same array names and shapes.
    """

    def __init__(self, mode: str = "int8", threshold: str = "exact", seed: int = 0, decay: float = 1.0) -> None:
        if mode not in MODES:
            raise ValueError(f"Invalid mode value: {mode!r} (expected one of {MODES})")
        if threshold not in THRESHOLDS:
            raise ValueError(f"Invalid threshold value: {threshold!r} (expected one of {THRESHOLDS})")
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"Invalid seed value: {seed!r}")
        if isinstance(decay, bool) or not (isinstance(decay, (int, float, np.floating)) and 0 <= decay <= 1):
            raise ValueError(f"Invalid decay value: {decay!r} (expected 0 <= decay <= 1)")
        self.mode = mode
        self.decay = float(decay)
        self.threshold = threshold
        self.seed = int(seed)
        self._residuals: dict[str, np.ndarray] = {}
        self._step = 0

    def compress(self, update: Mapping[str, np.ndarray], ratio: float) -> dict[str, SparseTensor]:
        """Sparsify and quantise ``update + residual``; keep what is not sent as residual.

        Returns one :class:`SparseTensor` per array of ``update`` (same order; arrays with
        nothing selected have ``count == 0``). The residuals change only if this succeeds.
        """
        if isinstance(ratio, bool) or not (isinstance(ratio, (int, float, np.floating)) and 0 < ratio <= 1):
            raise ValueError(f"Invalid ratio value: {ratio!r} (expected 0 < ratio <= 1)")
        if not isinstance(update, Mapping) or not update:
            raise ValueError("Invalid update: expected a non-empty mapping of name -> array")
        names = list(update)
        arrays = {}
        for name in names:
            a = np.asarray(update[name])
            if not np.issubdtype(a.dtype, np.floating):
                raise ValueError(
                    f"Invalid update[{name!r}]: dtype {a.dtype} is not floating (send integer buffers dense)"
                )
            if not np.all(np.isfinite(a)):
                raise ValueError(f"Invalid update[{name!r}]: non-finite values")
            arrays[name] = a
        if self._residuals:
            if set(names) != set(self._residuals):
                raise ValueError(f"Invalid update: names {sorted(names)} != residual names {sorted(self._residuals)}")
            for name in names:
                if arrays[name].shape != self._residuals[name].shape:
                    raise ValueError(
                        f"Invalid update[{name!r}]: shape {arrays[name].shape} "
                        f"!= residual shape {self._residuals[name].shape}"
                    )
        shapes = [arrays[n].shape for n in names]
        sizes = [math.prod(s) for s in shapes]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        total = int(offsets[-1])
        flat = np.empty(total, dtype=np.float32)
        for name, lo, hi in zip(names, offsets[:-1], offsets[1:]):
            flat[lo:hi] = arrays[name].ravel()
            if name in self._residuals:
                flat[lo:hi] += self.decay * self._residuals[name].ravel()
        if not np.all(np.isfinite(flat)):
            raise ValueError("Invalid update: update + residual overflows float32")

        k = min(total, max(1, int(round(ratio * total))))
        mag = np.abs(flat)
        if self.threshold == "exact":
            selected = topk_indices(mag, k)
        else:
            rng = np.random.default_rng([self.seed, self._step])
            selected = sampled_topk_indices(mag, k, rng)

        out: dict[str, SparseTensor] = {}
        bounds = np.searchsorted(selected, offsets)
        for i, name in enumerate(names):
            glob = selected[bounds[i] : bounds[i + 1]]
            codes, scale = quantise(flat[glob], self.mode)
            sparse = SparseTensor(shapes[i], glob - offsets[i], codes, scale, self.mode)
            flat[glob] -= sparse.values()  # residual absorbs quantisation error too
            out[name] = sparse
        self._residuals = {
            name: flat[lo:hi].reshape(shape)
            for name, shape, lo, hi in zip(names, shapes, offsets[:-1], offsets[1:])
        }
        self._step += 1
        return out

    def residual_norm(self) -> float:
        """L2 norm of all residuals together (0 before the first compress)."""
        return float(math.sqrt(sum(float(np.dot(r.ravel(), r.ravel())) for r in self._residuals.values())))

    def state_dict(self) -> dict:
        """``{"residuals": {name: float32 ndarray}, "step": int}`` (copies).
        Hyperparameters (mode, threshold, seed) come from the config."""
        return {"residuals": {k: v.copy() for k, v in self._residuals.items()}, "step": self._step}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from :meth:`state_dict`; validates everything before changing ``self``.
        If residuals exist already, names and shapes must match them."""
        if not isinstance(state, Mapping) or set(state) != {"residuals", "step"}:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"Invalid ErrorFeedback state keys: {keys}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"Invalid step in state: {step!r}")
        if not isinstance(state["residuals"], Mapping):
            raise ValueError("Invalid residuals in state: expected a mapping of name -> array")
        loaded = {}
        for name, r in state["residuals"].items():
            if not isinstance(name, str):
                raise ValueError(f"Invalid residual name: {name!r}")
            r = np.array(r, copy=True)
            if not np.issubdtype(r.dtype, np.floating) or not np.all(np.isfinite(r)):
                raise ValueError(f"Invalid residual {name!r}: expected finite floats")
            loaded[name] = r.astype(np.float32, copy=False)
        if self._residuals:
            if set(loaded) != set(self._residuals):
                raise ValueError(f"Invalid residual names: {sorted(loaded)} != {sorted(self._residuals)}")
            for name, r in loaded.items():
                if r.shape != self._residuals[name].shape:
                    raise ValueError(
                        f"Invalid residual {name!r}: shape {r.shape} != {self._residuals[name].shape}"
                    )
        self._residuals = loaded
        self._step = int(step)


def estimate_token(estimate: Mapping[str, np.ndarray]) -> str:
    """A 16-hex-digit fingerprint (SHA-256) of an estimate's names, shapes and float32
    bytes: site and server compare it to know they hold the same estimate; ``""`` for an
    empty one (nothing agreed yet)."""
    if not estimate:
        return ""
    digest = hashlib.sha256()
    for name in sorted(estimate):
        value = np.ascontiguousarray(estimate[name], dtype=np.float32)
        digest.update(json.dumps([name, list(value.shape)]).encode())
        digest.update(value.tobytes())
    return digest.hexdigest()[:16]


def decayed(estimate: Mapping[str, np.ndarray], decay: float) -> dict[str, np.ndarray]:
    """``decay * estimate`` in float32 (the same bits on the site and the server); the
    estimate itself when ``decay`` is 1."""
    if decay == 1.0:
        return dict(estimate)
    factor = np.float32(decay)
    return {name: (value * factor).astype(np.float32, copy=False) for name, value in estimate.items()}


class EstimateFeedback:
    r"""Site-side top-k with EF21 feedback (Richtárik, Sokolov, Fatkhullin 2021, "EF21: A
    New, Simpler, Theoretically Better, and Practically Faster Error Feedback").

    Site and server both keep an estimate :math:`g` of the site's update (zeros at first).
    Each round the site sends the compressed *change* of its update and both move the
    estimate by what was sent:

    .. math::

        s_t = Q\big(\mathrm{top}_k(u_t - g_{t-1})\big), \qquad g_t = g_{t-1} + \hat s_t

    and the server aggregates the dense :math:`g_t`, not the sparse :math:`\hat s_t`. Why it
    suits federated sites: a site's update (the displacement of its local epochs) changes
    slowly from round to round — same data, a global model that moved a little — so
    :math:`g` tracks it and the server averages a dense approximation of every site's
    update, where classic error feedback (:class:`ErrorFeedback`) averages sparse vectors
    and delays the rest. There is no residual: what was not sent is still in
    :math:`u - g` next round.

    ``decay`` :math:`\gamma`: the estimate carried into the next round is :math:`\gamma g`
    (:math:`s_t = Q(\mathrm{top}_k(u_t - \gamma g_{t-1}))`, :math:`g_t = \gamma g_{t-1} +
    \hat s_t`); 1 is EF21 as published. Below 1, a part of a site's update that the
    estimate no longer needs fades instead of being pushed every round until top-k gets to
    correcting it (the server applies the same factor).

    Agreement: both sides fingerprint the estimate (:func:`estimate_token`, bit-identical
    float32 arithmetic on both). The server sends the token it holds; when it is not this
    site's (``""`` after a server restart, a rejected or lost reply, a new site), the site
    starts again from :math:`g = 0`, and says so by returning ``""`` as the base it used.
    ``mode``, ``threshold`` and ``seed``: as for :class:`ErrorFeedback` (used with decay 0,
    i.e. a memoryless top-k compressor).
    """

    def __init__(self, mode: str = "int8", threshold: str = "exact", seed: int = 0, decay: float = 1.0) -> None:
        self._compressor = ErrorFeedback(mode=mode, threshold=threshold, seed=seed, decay=0.0)
        ErrorFeedback(decay=decay)  # validates decay
        self.decay = float(decay)
        self._estimate: dict[str, np.ndarray] = {}
        self.token = ""

    def compress(self, update: Mapping[str, np.ndarray], ratio: float,
                 server_token: str) -> tuple[dict[str, SparseTensor], str]:
        """``(sparse, base)``: the compressed ``update - estimate`` and the token of the
        estimate it is relative to (``""``: zeros, when ``server_token`` is not ours).
        The estimate and :attr:`token` move only if this succeeds."""
        base = self._estimate if (server_token and server_token == self.token) else {}
        base = decayed(base, self.decay)
        if base:  # ErrorFeedback.compress validates the rest
            if not isinstance(update, Mapping) or set(update) != set(base) or any(
                np.shape(update[n]) != base[n].shape for n in base
            ):
                raise ValueError("Invalid update: names or shapes differ from the estimate's")
            update = {name: np.asarray(update[name], dtype=np.float32) - base[name] for name in update}
        sparse = self._compressor.compress(update, ratio)
        self._estimate = {
            name: (base[name] + t.to_dense()) if base else t.to_dense() for name, t in sparse.items()
        }
        used, self.token = (self.token if base else ""), estimate_token(self._estimate)
        return sparse, used

    def state_dict(self) -> dict:
        """``{"estimate": {name: float32 ndarray}, "step": int}`` (copies)."""
        return {"estimate": {k: v.copy() for k, v in self._estimate.items()},
                "step": self._compressor.state_dict()["step"]}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from :meth:`state_dict`; validates everything before changing ``self``."""
        if not isinstance(state, Mapping) or set(state) != {"estimate", "step"}:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"Invalid EstimateFeedback state keys: {keys}")
        if not isinstance(state["estimate"], Mapping):
            raise ValueError("Invalid estimate in state: expected a mapping of name -> array")
        loaded = {}
        for name, g in state["estimate"].items():
            g = np.array(g, copy=True)
            if not isinstance(name, str) or not np.issubdtype(g.dtype, np.floating) or not np.all(np.isfinite(g)):
                raise ValueError(f"Invalid estimate {name!r}: expected a name and finite floats")
            loaded[name] = g.astype(np.float32, copy=False)
        self._compressor.load_state_dict({"residuals": {}, "step": state["step"]})
        self._estimate, self.token = loaded, estimate_token(loaded)


# --------------------------------------------------------------------------- index blocks


def _varint_lengths(d: np.ndarray) -> np.ndarray:
    n = np.ones(d.shape, dtype=np.int64)
    for j in range(1, 5):
        n += d >= (1 << (7 * j))
    return n


def _encode_varints(d: np.ndarray) -> bytes:
    """Unsigned LEB128 of each value of ``d`` (< 2**32), concatenated. Vectorised."""
    d = d.astype(np.uint64, copy=False)
    lengths = _varint_lengths(d)
    out = np.zeros(int(lengths.sum()), dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    for j in range(5):
        m = lengths > j
        if not m.any():
            break
        byte = (d[m] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (lengths[m] > j + 1).astype(np.uint64) << np.uint64(7)
        out[starts[m] + j] = (byte | more).astype(np.uint8)
    return out.tobytes()


def _index_deltas(indices: np.ndarray) -> np.ndarray:
    d = np.empty(indices.size, dtype=np.uint64)
    if indices.size:
        d[0] = indices[0]
        d[1:] = np.diff(indices)
    return d


def _encode_indices(indices: np.ndarray, numel: int, rice: bool = False) -> tuple[int, bytes]:
    """``(encoding, block)``: the smallest of delta-varint, bitmap and (``rice``) Rice
    coding; ties go to varint, then bitmap."""
    deltas = _index_deltas(indices)
    varint_size = int(_varint_lengths(deltas).sum())
    bitmap_size = (numel + 7) // 8
    rice_size, gaps, k = math.inf, None, 0
    if rice and indices.size:
        gaps = np.diff(indices.astype(np.int64), prepend=-1) - 1  # idx[0], then idx[i] - idx[i-1] - 1
        k = _rice_parameter(gaps)
        rice_size = 1 + (_rice_bits(gaps, k) + 7) // 8
    if varint_size <= min(bitmap_size, rice_size):
        return INDEX_VARINT, _encode_varints(deltas)
    if bitmap_size <= rice_size:
        bits = np.zeros(numel, dtype=bool)
        bits[indices] = True
        return INDEX_BITMAP, np.packbits(bits, bitorder="little").tobytes()
    return INDEX_RICE, _encode_rice(gaps, k)


def _rice_bits(gaps: np.ndarray, k: int) -> int:
    """Bits of the Rice code of ``gaps`` with parameter ``k``: a unary quotient and a stop
    bit per gap, and ``k`` remainder bits."""
    return int((gaps >> k).sum()) + gaps.size * (1 + k)


def _rice_parameter(gaps: np.ndarray) -> int:
    """The ``k`` in ``[0, 31]`` with the fewest bits (the smallest on ties)."""
    top = min(_RICE_MAX_K, int(gaps.max()).bit_length())
    return min(range(top + 1), key=lambda k: _rice_bits(gaps, k))


def _encode_rice(gaps: np.ndarray, k: int) -> bytes:
    """Rice index block: ``k`` (1 byte), then the bit stream (LSB first) of every gap's
    ``k``-bit remainder, then every gap's quotient ``q`` as ``q`` zero bits and a one,
    padded with zero bits to a whole byte. Remainders and quotients in separate runs so
    that both sides are vectorised."""
    remainders = ((gaps[:, None] >> np.arange(k)) & 1).astype(np.uint8).ravel()
    quotients = gaps >> k
    unary = np.zeros(int(quotients.sum()) + gaps.size, dtype=np.uint8)
    unary[np.cumsum(quotients + 1) - 1] = 1
    bits = np.concatenate([remainders, unary])
    return bytes([k]) + np.packbits(bits, bitorder="little").tobytes()


def _decode_varint_indices(block: bytes, count: int, numel: int, where: str) -> np.ndarray:
    b = np.frombuffer(block, dtype=np.uint8)
    if count == 0:
        if b.size:
            raise PayloadError(f"{where}: index block has {b.size} bytes but count is 0")
        return np.zeros(0, dtype=np.int64)
    if b.size == 0 or b[-1] & 0x80:
        raise PayloadError(f"{where}: truncated varint at the end of the index block")
    ends = np.flatnonzero(b < 0x80)
    if ends.size != count:
        raise PayloadError(f"{where}: index block holds {ends.size} varints, count is {count}")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if np.any(lengths > 5):
        raise PayloadError(f"{where}: varint too long ({int(lengths.max())} bytes, at most 5)")
    if np.any((lengths == 5) & (b[ends] > 0x0F)):
        raise PayloadError(f"{where}: varint overflow (value >= 2**32)")
    if np.any((lengths > 1) & (b[ends] == 0)):
        raise PayloadError(f"{where}: non-minimal varint (trailing zero byte)")
    d = np.zeros(count, dtype=np.uint64)
    for j in range(int(lengths.max())):
        m = lengths > j
        d[m] |= (b[starts[m] + j] & 0x7F).astype(np.uint64) << np.uint64(7 * j)
    dup = np.flatnonzero(d[1:] == 0)
    if dup.size:
        raise PayloadError(f"{where}: duplicate (non-increasing) index at position {int(dup[0]) + 1}")
    indices = np.cumsum(d, dtype=np.uint64)  # < count * 2**32 < 2**64: no wrap-around
    if indices[-1] >= numel:
        raise PayloadError(f"{where}: index {int(indices[-1])} out of range for numel {numel}")
    return indices.astype(np.int64)


def _decode_rice_indices(block: bytes, count: int, numel: int, where: str) -> np.ndarray:
    if not block or count == 0:  # an empty record has no index block at all
        raise PayloadError(f"{where}: empty Rice index block or count 0")
    k = block[0]
    if k > _RICE_MAX_K:
        raise PayloadError(f"{where}: Rice parameter {k} > {_RICE_MAX_K}")
    bits = np.unpackbits(np.frombuffer(block, dtype=np.uint8, offset=1), bitorder="little")
    if bits.size < count * k:
        raise PayloadError(f"{where}: Rice block too short for {count} remainders of {k} bits")
    stops = np.flatnonzero(bits[count * k :])
    if stops.size != count:
        raise PayloadError(f"{where}: Rice block holds {stops.size} quotients, count is {count}")
    if bits.size - count * k - 1 - stops[-1] >= 8:
        raise PayloadError(f"{where}: Rice block has a whole byte of padding (not minimal)")
    quotients = np.diff(stops, prepend=-1) - 1
    if int(quotients.sum()) > numel >> k:  # before shifting: sum(gaps) >= 2**k * sum(q)
        raise PayloadError(f"{where}: Rice gaps run past numel {numel} (index out of range)")
    remainders = bits[: count * k].reshape(count, k).astype(np.uint64) << np.arange(k, dtype=np.uint64)
    gaps = (quotients.astype(np.uint64) << np.uint64(k)) | remainders.sum(axis=1, dtype=np.uint64)
    indices = np.cumsum(gaps + np.uint64(1), dtype=np.uint64) - np.uint64(1)  # < 2**64 by the check above
    if indices[-1] >= numel:
        raise PayloadError(f"{where}: index {int(indices[-1])} out of range for numel {numel}")
    return indices.astype(np.int64)


def _decode_bitmap_indices(block: bytes, count: int, numel: int, where: str) -> np.ndarray:
    expected = (numel + 7) // 8
    if len(block) != expected:
        raise PayloadError(f"{where}: bitmap block is {len(block)} bytes, expected {expected} for numel {numel}")
    bits = np.unpackbits(np.frombuffer(block, dtype=np.uint8), bitorder="little")
    if bits[numel:].any():
        raise PayloadError(f"{where}: bitmap sets bits past numel {numel} (index out of range)")
    indices = np.flatnonzero(bits[:numel])
    if indices.size != count:
        raise PayloadError(f"{where}: bitmap popcount {indices.size} != count {count}")
    return indices.astype(np.int64, copy=False)


# --------------------------------------------------------------------------- encode / decode

_HEADER = struct.Struct("<4sBBI")  # magic, version, mode, tensors (v1) / fingerprint (v2, v3)
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_F32 = struct.Struct("<f")
_TENSOR_FIXED = struct.Struct("<IIfB")  # numel, count, scale, index encoding (v1)
_SCALE_ENC = struct.Struct("<fB")  # scale, index encoding (v2, v3)
_U8U8 = struct.Struct("<BB")  # value low, width (v3)


def layout_fingerprint(shapes: Mapping) -> int:
    """The version-2 layout fingerprint (u32) of ``{name: shape}``.

    ``zlib.crc32`` of the compact, ASCII-escaped JSON of ``[[name, [dims...]], ...]`` in
    sorted-name order. ``shapes`` values may be shapes, arrays (anything with ``.shape``)
    or ``(shape, dtype)`` pairs as in :func:`expected_of`; dtypes do not count.
    """
    layout = []
    for name in sorted(shapes):
        s = shapes[name]
        if hasattr(s, "shape"):
            s = s.shape
        elif isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], tuple):
            s = s[0]
        layout.append([name, [int(d) for d in s]])
    text = json.dumps(layout, separators=(",", ":"), ensure_ascii=True)
    return zlib.crc32(text.encode("utf-8")) & _U32_MAX


def _encode_varint(value: int) -> bytes:
    return _encode_varints(np.array([value], dtype=np.uint64))


def _value_block(t: SparseTensor) -> bytes:
    if t.mode == "int8":
        return t.codes.tobytes()
    if t.mode == "int4":
        return _pack_nibbles(t.codes)
    return np.packbits(t.codes < 0, bitorder="little").tobytes()


def _pack_nibbles(codes: np.ndarray) -> bytes:
    """int4 codes as 4-bit two's complement, two per byte, low nibble first, padding 0."""
    nibbles = (codes.astype(np.int16) & 0x0F).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()


def _value_block_size(mode: str, count: int) -> int:
    return {"int8": count, "int4": (count + 1) // 2, "sign": (count + 7) // 8}[mode]


def _value_block_v3(t: SparseTensor) -> bytes:
    """Version-3 values of a linear mode (int8, int4): the smallest magnitude code ``low``
    (1 byte) and the bit ``width`` of ``|code| - low`` (1 byte), then per value its sign
    bit (1 = negative) and ``width`` bits of ``|code| - low`` (LSB first), padded with zero
    bits to a whole byte. Top-k values all lie near the threshold or above it, so their
    codes span few levels (int4: mostly 4 to 7, 3 bits instead of 4). Sign mode: as v2."""
    if t.mode == "sign":
        return _value_block(t)
    mags = np.abs(t.codes.astype(np.int16))
    low = int(mags.min())
    width = int(mags.max() - low).bit_length()
    offsets = (mags - low)[:, None] >> np.arange(width)
    bits = np.concatenate([(t.codes < 0)[:, None].astype(np.int16), offsets & 1], axis=1)
    return bytes([low, width]) + np.packbits(bits.astype(np.uint8).ravel(), bitorder="little").tobytes()


def encode(sparse: Mapping[str, SparseTensor], version: int = VERSION) -> bytes:
    """The payload of ``sparse`` in wire format ``version`` (see the module docstring).

    ``sparse`` must hold every array of the model (as :meth:`ErrorFeedback.compress`
    returns it), all in one mode. Versions 3 (default) and 2 write the arrays in
    sorted-name order, identified by position and the layout fingerprint; version 1 writes
    them in the mapping's order, by name. Shapes travel as ``numel`` (v1) or not at all (v2, v3);
    the receiver knows them (:func:`decode`'s ``expected``).
    """
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version not in VERSIONS:
        raise ValueError(f"Invalid version: {version!r} (expected one of {VERSIONS})")
    if not isinstance(sparse, Mapping) or not sparse:
        raise ValueError("Invalid sparse update: expected a non-empty mapping of name -> SparseTensor")
    if not all(isinstance(t, SparseTensor) for t in sparse.values()):
        raise ValueError("Invalid sparse update: every value must be a SparseTensor")
    for name in sparse:
        if not isinstance(name, str):
            raise ValueError(f"Invalid tensor name: {name!r}")
    modes = {t.mode for t in sparse.values()}
    if len(modes) != 1:
        raise ValueError(f"Invalid sparse update: mixed modes {sorted(modes)}")
    if len(sparse) > _U32_MAX:
        raise ValueError("Invalid sparse update: too many tensors")
    mode = modes.pop()
    if version >= 2:
        fingerprint = layout_fingerprint({name: t.shape for name, t in sparse.items()})
        parts = [_HEADER.pack(MAGIC, version, _MODE_CODE[mode], fingerprint)]
        for name in sorted(sparse):
            t = sparse[name]
            parts.append(_encode_varint(t.count))
            if t.count == 0:
                continue
            encoding, index_block = _encode_indices(t.indices, t.numel, rice=version == 3)
            parts += [
                _SCALE_ENC.pack(t.scale, encoding),
                _encode_varint(len(index_block)),
                index_block,
                _value_block_v3(t) if version == 3 else _value_block(t),
            ]
        return b"".join(parts)

    parts = [_HEADER.pack(MAGIC, 1, _MODE_CODE[mode], len(sparse))]
    for name, t in sparse.items():
        raw = name.encode("utf-8")
        if len(raw) > 0xFFFF:
            raise ValueError(f"Invalid tensor name: {len(raw)} bytes (at most 65535)")
        encoding, index_block = _encode_indices(t.indices, t.numel)
        value_block = _value_block(t)
        parts += [
            _U16.pack(len(raw)),
            raw,
            _TENSOR_FIXED.pack(t.numel, t.count, t.scale, encoding),
            _U32.pack(len(index_block)),
            index_block,
            _U32.pack(len(value_block)),
            value_block,
        ]
    return b"".join(parts)


def encoded_size(sparse: Mapping[str, SparseTensor], version: int = VERSION) -> int:
    """Bytes of :func:`encode`'s payload for ``sparse`` in wire format ``version``."""
    return len(encode(sparse, version))


def dense_size_bytes(shapes) -> int:
    """Bytes of the same arrays sent dense as float32: ``4 * total elements``.

    ``shapes``: an iterable of shapes, or a mapping whose values are shapes, arrays
    (anything with ``.shape``) or ``(shape, dtype)`` pairs as in :func:`expected_of`.
    """
    items = shapes.values() if isinstance(shapes, Mapping) else shapes
    total = 0
    for s in items:
        if hasattr(s, "shape"):
            s = s.shape
        elif isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], tuple):
            s = s[0]
        total += math.prod(int(d) for d in s)
    return 4 * total


def expected_of(arrays: Mapping) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{name: (shape, dtype)}`` of arrays: numpy arrays, or a Flower ``ArrayRecord``
    (its ``Array`` values have ``.shape`` and a numpy dtype name)."""
    return {name: (tuple(int(d) for d in a.shape), np.dtype(a.dtype)) for name, a in arrays.items()}


class _Reader:
    """Bounds-checked cursor over a payload: every short read is a PayloadError."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        left = len(self.data) - self.pos
        if n > left:
            raise PayloadError(f"truncated payload: {what} needs {n} bytes at offset {self.pos}, {left} left")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: struct.Struct, what: str) -> tuple:
        return fmt.unpack(self.take(fmt.size, what))

    def varint(self, what: str) -> int:
        """One minimal unsigned LEB128 varint < 2**32 (at most 5 bytes)."""
        start, value = self.pos, 0
        for j in range(5):
            if self.pos >= len(self.data):
                raise PayloadError(f"truncated payload: {what} varint cut off at offset {self.pos}")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << (7 * j)
            if not byte & 0x80:
                if j > 0 and byte == 0:
                    raise PayloadError(f"{what}: non-minimal varint (trailing zero byte) at offset {start}")
                if j == 4 and byte > 0x0F:
                    raise PayloadError(f"{what}: varint overflow (value >= 2**32) at offset {start}")
                return value
        raise PayloadError(f"{what}: varint too long (more than 5 bytes) at offset {start}")


def _check_expected(expected: Mapping) -> dict[str, tuple[tuple[int, ...], int]]:
    """Caller's ``expected`` -> ``{name: (shape, numel)}``; a bad one is a ValueError (not
    the site's fault, so not a PayloadError)."""
    if not isinstance(expected, Mapping) or not expected:
        raise ValueError("Invalid expected: a non-empty mapping of name -> (shape, dtype)")
    out = {}
    for name, spec in expected.items():
        if not isinstance(name, str):
            raise ValueError(f"Invalid expected name: {name!r} (array names are strings)")
        try:
            shape, dtype = spec
            shape = tuple(int(d) for d in shape)
            dtype = np.dtype(dtype)
        except (TypeError, ValueError) as err:
            raise ValueError(f"Invalid expected[{name!r}]: {spec!r} is not (shape, dtype)") from err
        if not np.issubdtype(dtype, np.floating):
            raise ValueError(f"Invalid expected[{name!r}]: dtype {dtype} cannot carry a compressed delta")
        out[name] = (shape, math.prod(shape))
    return out


def _check_scale(scale: float, count: int, where: str) -> None:
    if not math.isfinite(scale):
        raise PayloadError(f"{where}: non-finite scale {scale}")
    if count > 0 and not scale > 0:
        raise PayloadError(f"{where}: scale {scale} must be > 0 when {count} values are sent")
    if count == 0 and scale != 0:
        raise PayloadError(f"{where}: scale {scale} must be 0 when no values are sent")


def _indices(encoding: int, block: bytes, count: int, numel: int, where: str) -> np.ndarray:
    if encoding == INDEX_VARINT:
        return _decode_varint_indices(block, count, numel, where)
    if encoding == INDEX_BITMAP:
        return _decode_bitmap_indices(block, count, numel, where)
    return _decode_rice_indices(block, count, numel, where)


def _codes(value_block: bytes, count: int, mode: str, where: str) -> np.ndarray:
    """int8 codes of a version-1/2 value block whose length was checked already."""
    if mode == "int8":
        codes = np.frombuffer(value_block, dtype=np.int8)
        if np.any(codes == -128):
            raise PayloadError(f"{where}: int8 code -128 out of range [-127, 127]")
        return codes
    if mode == "int4":
        packed = np.frombuffer(value_block, dtype=np.uint8)
        nibbles = np.empty(2 * packed.size, dtype=np.uint8)
        nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
        if nibbles[count:].any():
            raise PayloadError(f"{where}: int4 block padding nibble is set")
        nibbles = nibbles[:count]
        if np.any(nibbles == 0x08):
            raise PayloadError(f"{where}: int4 code -8 out of range [-7, 7]")
        return np.where(nibbles >= 8, nibbles.astype(np.int16) - 16, nibbles).astype(np.int8)
    bits = np.unpackbits(np.frombuffer(value_block, dtype=np.uint8), bitorder="little")
    if bits[count:].any():
        raise PayloadError(f"{where}: sign block padding bits are set")
    return np.where(bits[:count] == 1, -1, 1).astype(np.int8)


def _codes_v3(r: "_Reader", count: int, mode: str, where: str) -> np.ndarray:
    """Reads and checks a version-3 value block (see :func:`_value_block_v3`)."""
    if mode == "sign":
        return _codes(r.take(_value_block_size(mode, count), f"{where} value block"), count, mode, where)
    levels = _LEVELS[mode]
    low, width = r.unpack(_U8U8, f"{where} value low/width")
    if low > levels or width > 7:
        raise PayloadError(f"{where}: value low {low} / width {width} out of range for {mode} (codes in [-{levels}, {levels}])")
    block = r.take((count * (1 + width) + 7) // 8, f"{where} value block")
    bits = np.unpackbits(np.frombuffer(block, dtype=np.uint8), bitorder="little")
    if bits[count * (1 + width) :].any():
        raise PayloadError(f"{where}: value block padding bits are set")
    fields = bits[: count * (1 + width)].reshape(count, 1 + width).astype(np.int16)
    mags = low + (fields[:, 1:] << np.arange(width, dtype=np.int16)).sum(axis=1, dtype=np.int16)
    if np.any(mags > levels):
        raise PayloadError(f"{where}: {mode} code magnitude {int(mags.max())} > {levels}")
    if np.any((mags == 0) & (fields[:, 0] == 1)):
        raise PayloadError(f"{where}: negative zero code (sign bit set on magnitude 0)")
    return np.where(fields[:, 0] == 1, -mags, mags).astype(np.int8)


def _dense(indices: np.ndarray, codes: np.ndarray, scale: float, mode: str,
           shape: tuple[int, ...], numel: int, where: str) -> np.ndarray:
    """The dense float32 array of one tensor record's decoded and checked fields."""
    values = dequantise(codes, scale, mode)
    if not np.all(np.isfinite(values)):  # cannot happen for a finite float32 scale
        raise PayloadError(f"{where}: non-finite values")
    dense = np.zeros(numel, dtype=np.float32)
    dense[indices] = values
    return dense.reshape(shape)


def decode(payload: bytes, expected: Mapping) -> dict[str, np.ndarray]:
    """Dense float32 deltas ``{name: array of the expected shape}`` from a payload of wire
    format version 1, 2 or 3 (the payload says which).

    ``expected``: ``{name: (shape, dtype)}`` of every array the update must carry (e.g.
    :func:`expected_of` of the global arrays); floating dtypes only. Versions 2 and 3 match
    records to ``sorted(expected)`` by position, after checking the layout fingerprint.
    Every field is validated; any problem raises :class:`PayloadError` naming the field
    and the reason. The result, in ``expected``'s order, equals
    ``{n: t.to_dense() for n, t in sparse.items()}`` of the encoded ``sparse`` bit for bit.
    """
    spec = _check_expected(expected)
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes, got {type(payload).__name__}")
    r = _Reader(bytes(payload))
    magic = r.take(4, "magic")
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r} (expected {MAGIC!r})")
    (version,) = r.unpack(_U8, "version")
    if version not in VERSIONS:
        raise PayloadError(f"unknown version {version} (this decoder reads {', '.join(map(str, VERSIONS))})")
    (mode_code,) = r.unpack(_U8, "mode")
    if mode_code not in _MODE_NAME:
        raise PayloadError(f"unknown mode {mode_code} (known: {_MODE_NAME})")
    mode = _MODE_NAME[mode_code]
    out = _decode_v1(r, spec, mode) if version == 1 else _decode_positional(r, spec, mode, version)
    if r.pos != len(r.data):
        raise PayloadError(f"{len(r.data) - r.pos} trailing bytes after the last tensor")
    missing = [n for n in spec if n not in out]
    if missing:
        raise PayloadError(f"missing tensor(s): {missing}")
    return {name: out[name] for name in spec}


def _decode_positional(r: _Reader, spec: dict, mode: str, version: int) -> dict[str, np.ndarray]:
    """Versions 2 and 3 (the same records; version 3 adds Rice indices and packed values)."""
    (fingerprint,) = r.unpack(_U32, "layout fingerprint")
    want = layout_fingerprint({name: shape for name, (shape, _) in spec.items()})
    if fingerprint != want:
        raise PayloadError(
            f"layout fingerprint mismatch: payload 0x{fingerprint:08x}, expected 0x{want:08x} for the "
            f"{len(spec)} expected arrays (built for different array names or shapes)"
        )
    out: dict[str, np.ndarray] = {}
    for name in sorted(spec):
        shape, numel = spec[name]
        where = f"tensor {name!r}"
        count = r.varint(f"{where} count")
        if count > numel:
            raise PayloadError(f"{where}: count {count} > numel {numel}")
        if count == 0:
            out[name] = np.zeros(shape, dtype=np.float32)
            continue
        scale, encoding = r.unpack(_SCALE_ENC, f"{where} scale/encoding")
        _check_scale(scale, count, where)
        if encoding not in _INDEX_ENCODINGS[version]:
            known = {e: _INDEX_NAME[e] for e in _INDEX_ENCODINGS[version]}
            raise PayloadError(f"{where}: unknown index encoding {encoding} (known in version {version}: {known})")
        index_len = r.varint(f"{where} index block length")
        indices = _indices(encoding, r.take(index_len, f"{where} index block"), count, numel, where)
        if version == 3:
            codes = _codes_v3(r, count, mode, where)
        else:
            codes = _codes(r.take(_value_block_size(mode, count), f"{where} value block"), count, mode, where)
        out[name] = _dense(indices, codes, scale, mode, shape, numel, where)
    return out


def _decode_v1(r: _Reader, spec: dict, mode: str) -> dict[str, np.ndarray]:
    (num_tensors,) = r.unpack(_U32, "tensor count")
    if num_tensors > len(spec):
        raise PayloadError(f"payload declares {num_tensors} tensors, expected {len(spec)}")
    out: dict[str, np.ndarray] = {}
    for i in range(num_tensors):
        (name_len,) = r.unpack(_U16, f"tensor {i} name length")
        raw = r.take(name_len, f"tensor {i} name")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise PayloadError(f"tensor {i}: name is not valid UTF-8 ({err.reason})") from None
        where = f"tensor {name!r}"
        if name not in spec:
            raise PayloadError(f"{where}: not an expected tensor name")
        if name in out:
            raise PayloadError(f"{where}: appears twice")
        shape, size = spec[name]
        numel, count, scale, encoding = r.unpack(_TENSOR_FIXED, f"{where} numel/count/scale/encoding")
        if numel != size:
            raise PayloadError(f"{where}: numel {numel} != expected {size} for shape {shape}")
        if count > numel:
            raise PayloadError(f"{where}: count {count} > numel {numel}")
        _check_scale(scale, count, where)
        if encoding not in _INDEX_ENCODINGS[1]:
            known = {e: _INDEX_NAME[e] for e in _INDEX_ENCODINGS[1]}
            raise PayloadError(f"{where}: unknown index encoding {encoding} (known in version 1: {known})")
        (index_len,) = r.unpack(_U32, f"{where} index block length")
        index_block = r.take(index_len, f"{where} index block")
        (value_len,) = r.unpack(_U32, f"{where} value block length")
        want = _value_block_size(mode, count)
        if value_len != want:
            raise PayloadError(f"{where}: value block is {value_len} bytes, expected {want} for {count} {mode} values")
        value_block = r.take(value_len, f"{where} value block")
        indices = _indices(encoding, index_block, count, numel, where)
        out[name] = _dense(indices, _codes(value_block, count, mode, where), scale, mode, shape, numel, where)
    return out


# --------------------------------------------------------------------------- Flower record


def to_record(payload: bytes):
    """A ``flwr.app.ConfigRecord`` ``{"format": "fedind.topk", "version": v, "payload": bytes}``
    with ``v`` the wire format version of ``payload`` (read from its header; ConfigRecord
    values may be bytes in flwr 1.42)."""
    from flwr.app import ConfigRecord  # Flower only where a payload is packed into a record

    if not isinstance(payload, (bytes, bytearray)):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) < 5 or bytes(payload[:4]) != MAGIC or payload[4] not in VERSIONS:
        raise ValueError(f"Invalid payload: no {MAGIC!r} header of a known version {VERSIONS}")
    return ConfigRecord({FORMAT_KEY: FORMAT, VERSION_KEY: int(payload[4]), PAYLOAD_KEY: bytes(payload)})


def from_record(record) -> bytes:
    """The payload bytes of a record made by :func:`to_record`; PayloadError otherwise
    (including a record version that :func:`decode` cannot read or that disagrees with the
    payload's own header)."""
    if not isinstance(record, Mapping):
        raise PayloadError(f"compressed update must be a ConfigRecord, got {type(record).__name__}")
    keys = set(record)
    if keys != {FORMAT_KEY, VERSION_KEY, PAYLOAD_KEY}:
        raise PayloadError(f"record keys {sorted(keys)} != {sorted({FORMAT_KEY, VERSION_KEY, PAYLOAD_KEY})}")
    if record[FORMAT_KEY] != FORMAT:
        raise PayloadError(f"record format {record[FORMAT_KEY]!r} != {FORMAT!r}")
    version = record[VERSION_KEY]
    if type(version) is not int or version not in VERSIONS:
        raise PayloadError(f"record version {version!r} not in {VERSIONS}")
    payload = record[PAYLOAD_KEY]
    if not isinstance(payload, bytes):
        raise PayloadError(f"record payload must be bytes, got {type(payload).__name__}")
    if len(payload) >= 5 and payload[:4] == MAGIC and payload[4] != version:
        raise PayloadError(f"record version {version} != payload {payload[4]} (the header's version)")
    return payload
